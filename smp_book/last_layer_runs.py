"""The SMP runs of the last-layer chapter (:mod:`smp_book.last_layer_study`): LeNet-5 cut at its MAP, the frozen
layers' output (the features) computed once, and one run per variant on the sampled layers: the same recursion
with the same random numbers as SMP on the whole network with the other layers frozen (``requires_grad=False``),
which a test checks, at a fraction of the cost. They live apart from the scoring so that their cache key holds
only the code they run (this module and :mod:`smp_core`, :func:`~smp_book.pipeline.code_hash`) and a digest of
what they start from: a change to the scoring, to the baselines' code or to the verdicts reuses them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from smp_core.fisher import kronecker_layers
from smp_core.models import as_chain_model, lenet5
from smp_core.preconditioners import ema_refresh_applies, preconditioner_from_name
from smp_core.recursion import Fisher, run_smp

from .pipeline import CACHE, cached, code_hash

SUBSETS = {"last layer": 1, "last two layers": 2}  # the sampled fully connected layers, counted from the output
PREFIX = {"last layer": "LL", "last two layers": "LL2"}
# Per subset, the structures run. For the last two layers a dense or block statistic is 11,686^2 or 10,836^2
# numbers, 0.5 GB in float32: per chain for the EMA and periodic strategies (50 GB for S = 100), and once,
# shared, for the fixed one, where instead every step multiplies each chain's score by that matrix (about
# 1.4e10 multiply-adds per step for S = 100, hours at K = 10^4 on two cores).
STRUCTURES = {"last layer": ["diag", "block", "dense", "kfac"], "last two layers": ["diag", "kfac"]}
STRATEGIES = ["fixed", "ema", "periodic"]
SEED_OFFSET = 3000  # the chains draw other random numbers than the whole-network runs


def variants(cfg: dict[str, Any]) -> list[tuple[str, str]]:
    """``(subset, variant)`` of every run, in order: per subset ``none`` then every strategy and structure."""
    return [(subset, v) for subset in cfg["subsets"]
            for v in ["none"] + [f"{s}-{t}" for t in cfg["structures"][subset] for s in cfg["strategies"]]]


def split(theta_map: torch.Tensor, layers: int) -> tuple[nn.Sequential, nn.Sequential]:
    """LeNet-5 at ``theta_map`` cut before its last ``layers`` fully connected layers: ``(body, head)``."""
    net = lenet5()
    linear = [i for i, m in enumerate(net) if isinstance(m, nn.Linear)]
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= len(linear):
        raise ValueError(f"layers must be an integer from 1 to {len(linear)} (LeNet-5's fully connected layers), "
                         f"got {layers!r}")
    torch.nn.utils.vector_to_parameters(theta_map.to(torch.float32), net.parameters())
    cut = linear[-layers]
    return net[:cut].eval(), net[cut:]


def features(body: nn.Module, sets: dict[Any, tuple[torch.Tensor, torch.Tensor]], batch: int = 5000):
    """``{name: (body(x), y)}``: the frozen layers' output for every set, computed once."""
    with torch.no_grad():
        return {k: (torch.cat([body(xb) for xb in x.split(batch)]), y) for k, (x, y) in sets.items()}


def run_variant(cfg: dict[str, Any], head: nn.Module, feats: dict, variant: str, index: int,
                progress: bool = True, checkpoint=None):
    """SMP on the sampled layers ``head`` from their MAP values, fed with the features of the training set;
    the empirical Fisher from the validation set's features (the periodic strategy: its first
    ``n_fisher_periodic``), as the MNIST chapter takes it."""
    model = as_chain_model(head)
    theta0 = torch.nn.utils.parameters_to_vector(head.parameters()).detach()
    strategy = variant.split("-")[0]  # "none" for SMP-none
    precond = preconditioner_from_name(
        variant, dim=model.layout.dim, blocks=model.layout.block_slices, ridge=cfg["ridge"], period=cfg["period"],
        layers=kronecker_layers(model) if variant.endswith("-kfac") else (), ema_init="fisher",
        ema_refresh=cfg["ema_refresh"] if ema_refresh_applies(variant) else 1)
    fv, yv = feats["val"]
    n_fisher = (cfg.get("n_fisher_periodic") if strategy == "periodic" else None) or None  # None: all of them
    return run_smp(head, "categorical", feats["train"][0], theta0=theta0, preconditioner=precond,
                   tau=cfg["tau"][strategy], n_steps=cfg["n_steps"], n_chains=cfg["n_chains"],
                   seed=cfg["seed"] + SEED_OFFSET + index, fisher=Fisher("empirical", fv[:n_fisher], yv[:n_fisher]),
                   progress=progress, options={"checkpoint": checkpoint})


def run(cfg: dict[str, Any], subset: str, variant: str, index: int, head: nn.Module, feats: dict,
        use_cache: bool = True, progress: bool = True, cache_root: str | Path = CACHE) -> dict[str, Any]:
    """:func:`run_variant`, cached in ``<cache_root>/last_layer/`` by the settings, the run's name, this
    module's code and a digest of what the run starts from (the sampled layers at the MAP, the training
    and validation features, dtype and shape included: a new MAP or other data runs it again): ``theta``
    (the converged chains), ``seconds`` and ``diverged`` (the chains left out)."""
    def compute():
        res = run_variant(cfg, head, feats, variant, index, progress)
        return {"theta": res.theta[~res.diverged], "seconds": res.elapsed, "diverged": int(res.n_diverged)}

    digest = hashlib.sha256()
    for t in (torch.nn.utils.parameters_to_vector(head.parameters()), feats["train"][0], *feats["val"]):
        t = t.detach().cpu().contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode() + t.numpy().tobytes())
    key = {**cfg, "method": f"{PREFIX[subset]} SMP-{variant}", "part": "run", "code": code_hash(__name__),
           "inputs": digest.hexdigest()[:16]}
    return cached("last_layer", key, compute, root=cache_root, enabled=use_cache)
