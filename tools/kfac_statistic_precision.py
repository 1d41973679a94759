"""Does float32 rounding of the Fisher statistic change the MNIST KFAC chapter's fixed-kfac preconditioner?

Prints :func:`smp_core.mnist_study.kfac_statistic_precision` at the MNIST MAP (the cache's, trained
first if missing) with the KFAC chapter's laptop settings: the fixed-kfac preconditioner with its
Kronecker factors summed in float32 (the default) and in float64 (``statistic_dtype``), per layer
the relative difference of ``P^{-1} s`` for 200 validation scores, the largest eigenvalue of
``G (x) A``, the smallest eigenvalues of the factors and the share of the directions below the
ridge. The chapter shows the same table::

    .venv/bin/python tools/kfac_statistic_precision.py
"""

from __future__ import annotations

import torch

from smp_core import mnist_study as ms
from smp_core.config import get_config

cfg = get_config("mnist_kfac", "laptop")
data, _ = ms.load_data(cfg)
theta_map = ms.fit_map(cfg, data)["theta"]
table = ms.kfac_statistic_precision(theta_map, data, cfg["ridge"], device=torch.device("cpu"))
print(f"MNIST fixed-kfac at the MAP (ridge {cfg['ridge']:g}), the statistic in float32 against float64\n")
print(table.to_markdown(floatfmt=".3g"))
