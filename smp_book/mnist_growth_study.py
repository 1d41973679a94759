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

from .mnist_runs import (
    DIAGONAL_METHODS,
    default_device,
    largest_chain_shares,
    logits_on_test_set,
    run_variant,
    smp_path,
)
from .pipeline import CACHE, cached, code_hash, config_key


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
               progress: bool = True, cache_root: str | Path = CACHE) -> pd.DataFrame:
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


SHOWN = ["params_variance", "params_variance_se", "logits_variance", "logits_variance_se", "mutual_info",
         "mutual_info_se", "nll", "accuracy", "largest_chain_share", "diverged"]
"""The columns of the growth table that the chapter shows, per method and K."""

_RELATIVE = ["params_variance", "params_variance_zero_fisher", "params_variance_other", "logits_variance",
             "mutual_info"]


def zero_fisher_share(growth: pd.DataFrame, zero_fraction: float, steps: list[int]) -> pd.DataFrame:
    """The share of the parameter variance that the zero-Fisher coordinates (a ``zero_fraction`` of all)
    carry, per method (rows) at each K of ``steps`` (columns)."""
    share = zero_fraction * growth["params_variance_zero_fisher"] / growth["params_variance"]
    table = share.rename("zero-Fisher share").to_frame().assign(method=growth["method"]).loc[steps]
    methods = list(dict.fromkeys(growth["method"]))
    return table.reset_index().pivot(index="method", columns="K", values="zero-Fisher share").reindex(methods)


def growth_figure(growth: pd.DataFrame, n_chains: int):
    """Parameter variance, logit variance and mutual information against K for each method (jackknife
    error bars), with the growth one Fisher predicts from the first K (dotted)."""
    import matplotlib.pyplot as plt

    panels = [("params_variance", "parameter variance"), ("logits_variance", "logit variance"),
              ("mutual_info", "mutual information")]
    methods = list(dict.fromkeys(growth["method"]))
    colors = {method: f"C{i}" for i, method in enumerate(methods)}  # the same in every panel
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (column, label) in zip(axes, panels, strict=True):
        for method, t in growth.groupby("method", sort=False):
            if method == "SMP-none" and column == "mutual_info":
                continue  # 1e-5 to 1e-3: it would flatten the log scale of the others
            ax.errorbar(t.index, t[column], yerr=t[f"{column}_se"], marker="o", ms=3, capsize=2, label=method,
                        color=colors[method])
            first = t.index[0]
            ax.plot(t.index, t.loc[first, column] * t["reached_share"] / t.loc[first, "reached_share"], ls=":",
                    color=colors[method])
        ax.set(xscale="log", yscale="log", xlabel="K", title=label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Dispersion against K (S = {n_chains}; dotted: growth with one Fisher)", fontsize=10)
    fig.tight_layout()
    return fig


def periodic_verdict(least: pd.DataFrame) -> str:
    """From :func:`least_dispersed`: since which K of the grid periodic has the smallest mutual
    information to the end of the grid, with its lead at the last K, or which variant has it there."""
    last = least.index[-1]
    periodic = least["least"] == "SMP-periodic-diag"
    since = [k for k in least.index if periodic.loc[k:].all()]
    if since:
        return (f"SMP-periodic-diag has the smallest mutual information of the diagonal variants from K = "
                f"{since[0]:,} to the end of the grid (lead at K = {last:,}: {least.loc[last, 'lead_z']:.1f} "
                "standard errors).")
    return (f"SMP-periodic-diag does not have the smallest mutual information at K = {last:,} "
            f"({least.loc[last, 'least']} has, by {least.loc[last, 'lead_z']:.1f} standard errors).")


def in_words(summary: pd.DataFrame, zero_fraction: float) -> list[str]:
    """The lines of :func:`growth_summary` in words, one per method."""
    lines = []
    for method, row in summary.iterrows():
        grew = {c: f"{row[f'{c} growth']:.1f} ± {row[f'{c} growth se']:.1f}-fold"
                for c in ("params_variance", "logits_variance", "mutual_info")}
        lines.append(f"{method}: the parameter variance grew {grew['params_variance']}, the logit variance "
                     f"{grew['logits_variance']} and the mutual information {grew['mutual_info']}; at K = "
                     f"{int(row['to K']):,} one chain carries {row['largest chain share']:.0%} of the logit variance, "
                     f"and the zero-Fisher coordinates ({zero_fraction:.0%} of all) carry "
                     f"{row['zero-Fisher share of params variance']:.2%} of the parameter variance.")
    return lines


def compute(ctx) -> None:
    """The growth chapter's results (:mod:`smp_book.pipeline`): the MNIST chapter's MAP (shared through
    ``.cache/mnist/``), the zero-Fisher coordinates, one run per variant extended through the grid of K
    (:func:`run_growth`, cached under ``.cache/mnist_growth/``), its growth against the one-Fisher
    prediction, the least dispersed diagonal variant at each K, the figure, the MNIST chapter's numbers at
    its K beside this chapter's (``ctx.read("mnist")``) and the numbers the prose quotes."""
    from .config import MNIST_VARIANTS
    from .mnist_runs import chapter_map, fisher_zero_mask, load_data, smp_seed

    cfg = ctx.config
    device = default_device()
    data, provenance = load_data(cfg)
    map_fit = chapter_map(cfg, data, device, use_cache=ctx.use_cache, progress=ctx.progress)
    theta_map = map_fit["theta"]
    zero_mask = fisher_zero_mask(theta_map, data, device)
    zero_fraction = float(zero_mask.double().mean())
    growth = pd.concat([run_growth(cfg, variant, theta_map, data, i, zero_mask, device, ctx.use_cache,
                                   progress=ctx.progress) for i, variant in enumerate(MNIST_VARIANTS)])
    grid = list(cfg["growth_steps"])
    first, last = grid[0], grid[-1]

    ctx.table("growth", growth.reset_index().set_index(["method", "K"]))
    ctx.table("reached_share", pd.DataFrame({"K": grid, "reached share 1 - r_K^2/r_0^2":
                                             [reached_share(cfg["n_train"], k) for k in grid]}).set_index("K"))
    # undefined (NaN, not infinite) where a part of the parameters has no variance at the first K
    ctx.table("growth_against_linear", pd.concat(
        {method: pd.DataFrame({c: growth_against_linear(t, c) for c in _RELATIVE})
         for method, t in growth.groupby("method", sort=False)}, names=["method"]).replace([np.inf, -np.inf], np.nan))
    summary = ctx.table("growth_summary", growth_summary(growth, zero_fraction))
    ctx.table("zero_fisher_share", zero_fisher_share(growth, zero_fraction, [first, last]))
    ctx.figure("growth", growth_figure(growth, cfg["n_chains"]))
    least = ctx.table("least_dispersed", least_dispersed(growth))

    # the MNIST chapter at the same scale, at its K (its S, mean over its replicates)
    mnist = ctx.read("mnist")
    k_mnist = mnist.config["n_steps"]
    chapter = mnist.table("scores_mean")[["mutual_info", "nll"]].join(mnist.table("variances_mean")).drop(index="MAP")
    if k_mnist in grid:
        here = growth.loc[growth.index == k_mnist].set_index("method")[list(chapter.columns)]
        chapter = chapter.join(here.add_suffix(" (here)"))
    ctx.table("mnist_comparison", chapter)

    paper, laptop = ctx.settings("mnist", "paper"), ctx.settings("mnist", "laptop")
    for key in ("n_chains", "n_train"):
        ctx.value(key, cfg[key])
    ctx.value("first_k", first)
    ctx.value("last_k", last)
    ctx.value("grid", ", ".join(f"{k:,}" for k in grid))
    ctx.value("device", str(device))
    ctx.value("inverse_ridge", 1 / cfg["ridge"])
    ctx.value("fisher_zero_fraction", zero_fraction)
    ctx.value("one_fisher_growth", reached_share(cfg["n_train"], last) / reached_share(cfg["n_train"], first))
    for method, grew in summary["mutual_info growth"].items():  # mi_growth_none, mi_growth_fixed_diag, ...
        ctx.value(f"mi_growth_{method.removeprefix('SMP-').replace('-', '_')}", grew)
    ctx.value("least_at_last", least.loc[last, "least"])
    ctx.value("periodic_verdict", periodic_verdict(least))
    ctx.value("in_words", "\n".join(f"- {line}" for line in in_words(summary, zero_fraction)))
    ctx.value("mnist_n_steps", k_mnist)
    ctx.value("mnist_n_chains", mnist.config["n_chains"])
    ctx.value("mnist_on_grid", "yes" if k_mnist in grid else "no")
    ctx.value("laptop_n_steps", laptop["n_steps"])
    ctx.value("paper_n_steps", paper["n_steps"])
    ctx.value("paper_n_train", paper["n_train"])
    ctx.value("paper_share_growth", reached_share(paper["n_train"], paper["n_steps"])
              / reached_share(paper["n_train"], laptop["n_steps"]))
    ctx.record(seeds={"split": cfg["split_seed"], "map": map_fit["seed"],
                      "smp": {v: smp_seed(cfg, i) for i, v in enumerate(MNIST_VARIANTS)}},
               device=str(device), data=provenance, fisher_zero_fraction=zero_fraction, smp_path=smp_path(device))
