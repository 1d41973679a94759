"""How far SMP-none's parameter variance strays from the one-Fisher prediction over seeds.

The MNIST growth chapter runs one seed per variant. This script reruns SMP-none at its laptop
settings (S = 10 chains; the MNIST MAP from the cache, trained first if missing) with the seeds of
replicates 0, 5, 6 and 7 of ``mnist_study.smp_seed`` and prints, per seed, the growth of the
parameter variance from K = 10^3 to K = 10^4 over the growth of ``reached_share`` (1 = as
predicted). About a minute on 2 CPU cores::

    .venv/bin/python tools/none_growth_seeds.py
"""

from __future__ import annotations

import torch

from smp_core import metrics
from smp_core import mnist_study as ms
from smp_core.config import get_config

cfg = {**get_config("mnist_growth", "laptop"), "checkpoint_every": None}
data, _ = ms.load_data(cfg)
theta_map = ms.fit_map(cfg, data)["theta"]
first, last = 1_000, 10_000
predicted = ms.reached_share(cfg["n_train"], last) / ms.reached_share(cfg["n_train"], first)
print(f"| replicate seed | variance growth K = {first:,} to {last:,} | over the prediction ({predicted:.2f}) |")
print("|---|---|---|")
for replicate in (0, 5, 6, 7):
    var = {k: metrics.params_variance(ms.run_variant({**cfg, "n_steps": k}, "none", theta_map, data, 0,
                                                     torch.device("cpu"), progress=False, replicate=replicate).theta)
           for k in (first, last)}
    growth = var[last] / var[first]
    print(f"| {replicate} | {growth:.2f} | {growth / predicted:.2f} |")
