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

from .mnist_runs import default_device, largest_chain_shares, logits_on_test_set, run_variant, smp_path
from .pipeline import CACHE, cached, code_hash, config_key


def reached_share(n_obs: int, n_steps: int) -> float:
    """``1 - r_K^2 / r_0^2``: the share of the limiting variance that ``K`` steps reach while one Fisher ``F``
    describes the chains (uncorrelated increments: ``Var(theta_K) = tau^2 P^-1 F P^-1 sum_{k<=K} (N + k)^-2``)."""
    return 1.0 - residual_variance_ratio(n_obs, n_steps)


def growth_point(theta: torch.Tensor, data: dict, zero_mask: torch.Tensor,
                 device: torch.device | None = None) -> dict[str, float]:
    """The dispersion of the samples ``theta`` ``(S, d)`` on the test set (jackknife standard errors over the
    chains; the parameter variance also over the zero-Fisher coordinates ``zero_mask`` and the others)."""
    yt, logits = data["test"][1], logits_on_test_set(theta, data, device).double()
    probs, theta, zero_mask = torch.softmax(logits, dim=-1), theta.cpu().double(), zero_mask.cpu()

    def with_se(name, x, measure):
        return {name: measure(x), f"{name}_se": metrics.jackknife_se(x, measure)}

    return {**with_se("params_variance", theta, metrics.params_variance),
            **{f"params_variance_{name}": metrics.params_variance(theta[:, mask]) if mask.any() else np.nan
               for name, mask in (("zero_fisher", zero_mask), ("other", ~zero_mask))},
            **with_se("logits_variance", logits, metrics.logits_variance),
            **with_se("mutual_info", probs, metrics.mutual_information),
            "nll": metrics.nll(probs, yt), "accuracy": metrics.accuracy(probs, yt),
            "largest_chain_share": largest_chain_shares(logits)["largest_chain_share"]}


def run_growth(cfg: dict[str, Any], variant: str, theta0: torch.Tensor, data: dict, index: int,
               zero_mask: torch.Tensor, device: torch.device | None = None, use_cache: bool = True,
               progress: bool = True, cache_root: str | Path = CACHE) -> pd.DataFrame:
    """One SMP run of ``variant`` (seeds of replicate 0) through the grid ``cfg["growth_steps"]`` of K, with
    :func:`growth_point` at every K. The step size ``tau / (N + k)`` does not depend on K, so the run resumes
    from its checkpoint at each K and each row is cached by its K (a longer grid extends the run). Every K is a
    multiple of ``run_smp``'s ``check_every``, so that the divergence checks are those of a run of K steps."""
    device = device or default_device()
    grid, block = list(cfg["growth_steps"]), RunOptions().check_every
    if not grid or grid[0] < 1 or grid != sorted(set(grid)):
        raise ValueError(f"growth_steps must be increasing positive step counts, got {grid}")
    if any(k % block for k in grid):
        raise ValueError(f"every K of growth_steps must be a multiple of {block} (run_smp's check_every), got {grid}")
    # the settings without the grid: a longer grid extends the same run
    key = {**{k: v for k, v in cfg.items() if k not in ("growth_steps", "n_steps", "smp_replicates")},
           "part": f"growth-{variant}", "code": code_hash(__name__), "smp_path": smp_path(device)}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(cache_root) / "mnist_growth" if use_cache else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        checkpoint = folder / f"{config_key(key)}.checkpoint.pt"

        def row(n_steps):
            res = run_variant({**cfg, "n_steps": n_steps}, variant, theta0, data, index, device, checkpoint,
                              progress=progress)
            return {"K": n_steps, "reached_share": reached_share(cfg["n_train"], n_steps), "seconds": res.elapsed,
                    "diverged": res.n_diverged, **growth_point(res.theta[~res.diverged], data, zero_mask, device)}

        rows = [cached("mnist_growth", {**key, "n_steps": k}, lambda k=k: row(k), root=cache_root, enabled=use_cache)
                for k in grid]
    table = pd.DataFrame(rows).set_index("K")
    table.insert(0, "method", f"SMP-{variant}")
    return table


def growth_against_linear(table: pd.DataFrame, column: str) -> pd.Series:
    """``column`` at each K over its value at the first K, divided by the same ratio of :func:`reached_share`:
    1 where the variance grows as one Fisher predicts, above 1 where the chains outgrow the Fisher at the start."""
    first = table.index[0]
    return (table[column] / table.loc[first, column]) / (table["reached_share"] / table.loc[first, "reached_share"])


RESOLVED_Z = 2.0  # a lead of fewer standard errors than this is not resolved (as the register judges)


def least_dispersed(growth: pd.DataFrame, column: str = "mutual_info") -> pd.DataFrame:
    """Per K, the diagonal variant (every one but SMP-none) with the smallest ``column`` and the z-score of its
    lead over the runner-up (their difference over the root sum of the squared jackknife standard errors)."""
    rows = []
    for n_steps, at_k in growth[growth["method"] != "SMP-none"].groupby(level="K"):
        ranked = at_k.sort_values(column)
        first, second = ranked.iloc[0], ranked.iloc[1]
        se = float(np.hypot(first[f"{column}_se"], second[f"{column}_se"]))
        rows.append({"K": n_steps, "least": first["method"], "runner_up": second["method"],
                     "lead_z": (second[column] - first[column]) / se if se > 0 else np.nan})
    return pd.DataFrame(rows).set_index("K")


def growth_summary(growth: pd.DataFrame, zero_fraction: float) -> pd.DataFrame:
    """Per method, from the first to the last K: how many fold each dispersion grew (standard error of ``b / a``:
    ``(b / a) sqrt((se_a / a)^2 + (se_b / b)^2)``, the ends taken as independent since most of the variance at
    the last K comes from the later steps), beside one Fisher's; at the last K, the largest chain's share and
    the zero-Fisher coordinates' (a ``zero_fraction`` of all) share of the parameter variance."""
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


def zero_fisher_share(growth: pd.DataFrame, zero_fraction: float, steps: list[int]) -> pd.DataFrame:
    """The zero-Fisher coordinates' share of the parameter variance per method (rows) at each K of ``steps``."""
    share = zero_fraction * growth["params_variance_zero_fisher"] / growth["params_variance"]
    table = pd.DataFrame({"method": growth["method"], "share": share}).loc[steps].reset_index()
    return table.pivot(index="method", columns="K", values="share").reindex(list(dict.fromkeys(growth["method"])))


def growth_figure(growth: pd.DataFrame, n_chains: int):
    """Each dispersion against K per method (jackknife error bars), with one Fisher's growth (dotted)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, column, label in zip(axes, ("params_variance", "logits_variance", "mutual_info"),
                                 ("parameter variance", "logit variance", "mutual information"), strict=True):
        for i, (method, t) in enumerate(growth.groupby("method", sort=False)):  # a method's colour in every panel
            if method == "SMP-none" and column == "mutual_info":
                continue  # 1e-5 to 1e-3: it would flatten the log scale of the others
            ax.errorbar(t.index, t[column], yerr=t[f"{column}_se"], marker="o", ms=3, capsize=2, label=method,
                        color=f"C{i}")
            ax.plot(t.index, t[column].iloc[0] * t["reached_share"] / t["reached_share"].iloc[0], ls=":", color=f"C{i}")
        ax.set(xscale="log", yscale="log", xlabel="K", title=label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Dispersion against K (S = {n_chains}; dotted: growth with one Fisher)", fontsize=10)
    fig.tight_layout()
    return fig


def periodic_verdict(least: pd.DataFrame) -> str:
    """From :func:`least_dispersed`: since which K periodic is least to the end of the grid, or who is at the end,
    with the lead at the end in standard errors of the chains; a lead under :data:`RESOLVED_Z` is not resolved."""
    last, z = least.index[-1], least["lead_z"].iloc[-1]
    spread = f"{z:.1f} standard errors of the chains" + ("" if z >= RESOLVED_Z else
                                                          f": within {RESOLVED_Z:g}, not resolved by this run")
    since = [k for k in least.index if (least.loc[k:, "least"] == "SMP-periodic-diag").all()]
    if since:
        return (f"SMP-periodic-diag has the smallest mutual information of the diagonal variants from K = "
                f"{since[0]:,} to the end of the grid (lead at K = {last:,}: {spread}).")
    return (f"SMP-periodic-diag does not have the smallest mutual information at K = {last:,} "
            f"({least.loc[last, 'least']} has, by {spread}).")


def compute(ctx) -> None:
    """The growth chapter's results (:mod:`smp_book.pipeline`), from the MNIST chapter's MAP."""
    from .config import MNIST_VARIANTS
    from .mnist_runs import chapter_map, fisher_zero_mask, load_data, smp_seed

    cfg, device = ctx.config, default_device()
    data, provenance = load_data(cfg)
    map_fit = chapter_map(cfg, data, device, use_cache=ctx.use_cache, progress=ctx.progress)
    zero_mask = fisher_zero_mask(map_fit["theta"], data, device)
    zero_fraction = float(zero_mask.double().mean())
    growth = pd.concat([run_growth(cfg, variant, map_fit["theta"], data, i, zero_mask, device, ctx.use_cache,
                                   progress=ctx.progress) for i, variant in enumerate(MNIST_VARIANTS)])
    grid, n = list(cfg["growth_steps"]), cfg["n_train"]
    first, last = grid[0], grid[-1]

    ctx.table("growth", growth.reset_index().set_index(["method", "K"]))
    ctx.table("reached_share", pd.DataFrame({"K": grid, "reached share 1 - r_K^2/r_0^2":
                                             [reached_share(n, k) for k in grid]}).set_index("K"))
    relative = ("params_variance", "params_variance_zero_fisher", "params_variance_other", "logits_variance",
                "mutual_info")  # undefined (NaN, not infinite) where a part has no variance at the first K
    ctx.table("growth_against_linear", pd.concat(
        {method: pd.DataFrame({c: growth_against_linear(t, c) for c in relative})
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

    def grew(row, c):
        return f"{row[f'{c} growth']:.1f} ± {row[f'{c} growth se']:.1f}-fold"

    in_words = [f"- {method}: the parameter variance grew {grew(row, 'params_variance')}, the logit variance "
                f"{grew(row, 'logits_variance')} and the mutual information {grew(row, 'mutual_info')}; at K = "
                f"{int(row['to K']):,} one chain carries {row['largest chain share']:.0%} of the logit variance, and "
                f"the zero-Fisher coordinates ({zero_fraction:.0%} of all) carry "
                f"{row['zero-Fisher share of params variance']:.2%} of the parameter variance."
                for method, row in summary.iterrows()]
    values = {
        "n_chains": cfg["n_chains"], "first_k": first, "last_k": last, "grid": ", ".join(f"{k:,}" for k in grid),
        "device": str(device), "inverse_ridge": 1 / cfg["ridge"], "fisher_zero_fraction": zero_fraction,
        "one_fisher_growth": reached_share(n, last) / reached_share(n, first),
        **{f"mi_growth_{m.removeprefix('SMP-').replace('-', '_')}": g  # mi_growth_none, mi_growth_fixed_diag, ...
           for m, g in summary["mutual_info growth"].items()},
        "periodic_verdict": periodic_verdict(least), "in_words": "\n".join(in_words),
        "mnist_n_steps": k_mnist, "mnist_n_chains": mnist.config["n_chains"],
        "mnist_on_grid": "yes" if k_mnist in grid else "no", "laptop_n_steps": laptop["n_steps"],
        "paper_n_steps": paper["n_steps"], "paper_n_train": paper["n_train"],
        "paper_share_growth": (reached_share(paper["n_train"], paper["n_steps"])
                               / reached_share(paper["n_train"], laptop["n_steps"]))}
    for key, value in values.items():
        ctx.value(key, value)
    ctx.record(seeds={"split": cfg["split_seed"], "map": map_fit["seed"],
                      "smp": {v: smp_seed(cfg, i) for i, v in enumerate(MNIST_VARIANTS)}},
               device=str(device), data=provenance, fisher_zero_fraction=zero_fraction, smp_path=smp_path(device))
