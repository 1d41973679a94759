"""The MNIST growth chapter: one run per variant extended through a grid of K, and its growth against
the linear prediction."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from smp_core import metrics
from smp_core.recursion import RunOptions, residual_variance_ratio

from .mnist_study import (
    DIAGONAL_METHODS,
    default_device,
    largest_chain_shares,
    logits_on_test_set,
    run_variant,
    smp_path,
)
from .results import cached, code_hash, config_key


def reached_share(n_obs: int, n_steps: int) -> float:
    """``1 - r_K^2 / r_0^2``: the share of the limiting variance that ``K`` steps reach when the
    chains stay where one Fisher describes them. There the increments ``gamma_k P^{-1} s_k`` are
    uncorrelated with covariance ``gamma_k^2 P^{-1} F P^{-1}``, so ``Var(theta_K)`` is the constant
    ``tau^2 P^{-1} F P^{-1}`` times ``sum_{k <= K} (N + k)^{-2}``: this share of its limit."""
    return 1.0 - residual_variance_ratio(n_obs, n_steps)


def growth_key(cfg: dict[str, Any], variant: str, path: str) -> dict[str, Any]:
    """The key of one growth run (one checkpoint, extended through the grid of K): the settings
    without the grid, so that a longer grid extends the same run."""
    settings = {k: v for k, v in cfg.items() if k not in ("growth_steps", "n_steps", "smp_replicates")}
    return {**settings, "part": f"growth-{variant}", "code": code_hash(__name__), "smp_path": path}


def growth_point(theta: torch.Tensor, data: dict, zero_mask: torch.Tensor,
                 device: torch.device | None = None) -> dict[str, float]:
    """The dispersion of the samples ``theta`` ``(S, d)`` on the test set, each with its jackknife
    standard error over the chains (:func:`smp_core.metrics.jackknife_se`): parameter variance (also
    split into the coordinates where the Fisher diagonal at the MAP is exactly zero, ``zero_mask``,
    and the others), logit variance and mutual information; and NLL, accuracy and the largest chain's
    share of the logit variance."""
    yt = data["test"][1]
    logits = logits_on_test_set(theta, data, device).double()
    probs = torch.softmax(logits, dim=-1)
    theta = theta.cpu().double()
    zero_mask = zero_mask.cpu()
    row = {
        "params_variance": metrics.params_variance(theta),
        "params_variance_se": metrics.jackknife_se(theta, metrics.params_variance),
        "params_variance_zero_fisher": metrics.params_variance(theta[:, zero_mask]) if zero_mask.any() else np.nan,
        "params_variance_other": metrics.params_variance(theta[:, ~zero_mask]) if (~zero_mask).any() else np.nan,
        "logits_variance": metrics.logits_variance(logits),
        "logits_variance_se": metrics.jackknife_se(logits, metrics.logits_variance),
        "mutual_info": metrics.mutual_information(probs),
        "mutual_info_se": metrics.jackknife_se(probs, metrics.mutual_information),
        "nll": metrics.nll(probs, yt),
        "accuracy": metrics.accuracy(probs, yt),
    }
    row["largest_chain_share"] = largest_chain_shares(logits)["largest_chain_share"]
    return row


def run_growth(cfg: dict[str, Any], variant: str, theta0: torch.Tensor, data: dict, index: int,
               zero_mask: torch.Tensor, device: torch.device | None = None, use_cache: bool = True,
               progress: bool = True, cache_root: str = ".cache") -> pd.DataFrame:
    """One SMP run of ``variant`` (:func:`run_variant`, seeds of replicate 0) extended through the
    grid ``cfg["growth_steps"]`` of K, with :func:`growth_point` at every K.

    The step size ``tau / (N + k)`` does not depend on K, so the samples at a K of the grid are those
    of a run of exactly K steps: the run resumes from its own checkpoint at each K (in
    ``<cache_root>/mnist_growth/``, or a temporary folder without the cache) rather than starting
    again. Each row is cached by its K, so that a rerun, or a grid with larger K appended, redoes
    nothing; a K inserted below one already run cannot be had from the checkpoint (``run_smp`` then
    raises: delete the checkpoint to start the run again). Every K must be a multiple of
    ``run_smp``'s ``check_every`` (50): the run is resumed at whole blocks of steps, so that its
    divergence checks are those of a run of K steps.
    """
    device = device or default_device()
    grid = list(cfg["growth_steps"])
    if not grid or any(b <= a for a, b in zip(grid, grid[1:], strict=False)) or grid[0] < 1:
        raise ValueError(f"growth_steps must be increasing positive step counts, got {grid}")
    block = RunOptions().check_every
    if any(k % block for k in grid):
        raise ValueError(f"every K of growth_steps must be a multiple of {block} (run_smp's check_every), got {grid}")
    key = growth_key(cfg, variant, smp_path(device))
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(cache_root) / "mnist_growth" if use_cache else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        checkpoint = folder / f"{config_key(key)}.checkpoint.pt"
        for n_steps in grid:
            def compute(n_steps=n_steps):
                res = run_variant({**cfg, "n_steps": n_steps}, variant, theta0, data, index, device, checkpoint,
                                  progress=progress)
                point = growth_point(res.theta[~res.diverged], data, zero_mask, device)
                return {"K": n_steps, "reached_share": reached_share(cfg["n_train"], n_steps),
                        "seconds": res.elapsed, "diverged": res.n_diverged, **point}

            rows.append(cached("mnist_growth", {**key, "n_steps": n_steps}, compute, root=cache_root,
                               enabled=use_cache))
    table = pd.DataFrame(rows).set_index("K")
    table.insert(0, "method", f"SMP-{variant}")
    return table


def growth_against_linear(table: pd.DataFrame, column: str) -> pd.Series:
    """``column`` at each K over its value at the first K, divided by the same ratio of
    :func:`reached_share`: 1 where the variance grows as one Fisher predicts, above 1 where it grows
    faster (the chains reach where the Fisher at the start no longer describes them)."""
    first = table.index[0]
    return (table[column] / table.loc[first, column]) / (table["reached_share"] / table.loc[first, "reached_share"])


def least_dispersed(growth: pd.DataFrame, column: str = "mutual_info", variants=DIAGONAL_METHODS) -> pd.DataFrame:
    """Per K, the diagonal variant with the smallest ``column`` and the z-score of its lead over the
    runner-up (their difference over the root sum of the squared jackknife standard errors)."""
    rows = []
    for n_steps, at_k in growth[growth["method"].isin(variants)].groupby(level="K"):
        ranked = at_k.sort_values(column)
        first, second = ranked.iloc[0], ranked.iloc[1]
        se = float(np.hypot(first[f"{column}_se"], second[f"{column}_se"]))
        rows.append({"K": n_steps, "least": first["method"], "runner_up": second["method"],
                     "lead_z": (second[column] - first[column]) / se if se > 0 else np.nan})
    return pd.DataFrame(rows).set_index("K")


def growth_summary(growth: pd.DataFrame, zero_fraction: float) -> pd.DataFrame:
    """Per method, from the first to the last K of the grid: how many fold the parameter variance,
    the logit variance and the mutual information grew, each with a standard error, the growth one
    Fisher predicts (of the reached share), the largest chain's share of the logit variance at the
    last K and the share of the parameter variance that the zero-Fisher coordinates (a
    ``zero_fraction`` of all) carry there.

    The standard error of a ratio ``b / a`` is ``(b / a) sqrt((se_a / a)^2 + (se_b / b)^2)`` from the
    jackknife errors of its two ends, taken as independent: most of the variance at the last K comes
    from the steps after the first K."""
    rows = []
    for method, t in growth.groupby("method", sort=False):
        first, last = t.index[0], t.index[-1]
        row = {"method": method, "from K": first, "to K": last,
               "one-Fisher growth": t.loc[last, "reached_share"] / t.loc[first, "reached_share"]}
        for column in ("params_variance", "logits_variance", "mutual_info"):
            a, b = t.loc[first, column], t.loc[last, column]
            row[f"{column} growth"] = b / a
            if f"{column}_se" in t:
                row[f"{column} growth se"] = b / a * float(np.hypot(t.loc[first, f"{column}_se"] / a,
                                                                     t.loc[last, f"{column}_se"] / b))
        if "largest_chain_share" in t:
            row["largest chain share"] = t.loc[last, "largest_chain_share"]
        row["zero-Fisher share of params variance"] = (zero_fraction * t.loc[last, "params_variance_zero_fisher"]
                                                       / t.loc[last, "params_variance"])
        rows.append(row)
    return pd.DataFrame(rows).set_index("method")
