"""The MNIST MAP-seeds chapter: every variant from several MAPs, and what moves the dispersion."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from .config import MNIST_VARIANTS
from .mnist_runs import DIAGONAL_METHODS, fit_map, map_seed, run_replicates, smp_seed
from .pipeline import CACHE
from .summaries import summarise_replicates, variance_components


def run_map_seeds(cfg: dict[str, Any], data: dict, device: torch.device | None = None, use_cache: bool = True,
                  progress: bool = True, cache_root: str | Path = CACHE) -> dict[str, Any]:
    """Beyond the paper: the four SMP variants in ``cfg["smp_replicates"]`` replicates from each of
    ``cfg["map_seeds"]`` MAPs.

    MAP ``m`` is trained with the MNIST study's settings and the seed :func:`map_seed` (``m = 0``: the
    MNIST chapter's MAP at the laptop and ci scales), and its variants run as that chapter's replicates
    with the MAP's seed (:func:`run_replicates`), so MAP 0's runs are then the MNIST chapter's and every
    MAP and run is shared through ``<cache_root>/mnist/``. Between MAPs the spread is that of the MAP's
    training run (initial weights and minibatch order) together with the SMP random stream; between the
    replicates of one MAP, that of the stream alone.

    Returns ``runs`` (per MAP, :func:`tables` per replicate), ``tables`` (per MAP, the mean over its
    replicates of each table), ``diverged`` (chains per MAP and variant, summed over its replicates)
    and ``maps`` (per MAP: its seed, training seconds and test accuracy and NLL).
    """
    settings = {**{k: v for k, v in cfg.items() if k != "map_seeds"}, "study": "mnist"}
    runs_per_map, per_map, diverged, maps = [], [], [], []
    for m in range(cfg["map_seeds"]):
        member = {**settings, "seed": map_seed(cfg, m)}
        fit = fit_map(member, data, device, use_cache=use_cache, progress=progress, cache_root=cache_root)
        runs = run_replicates(member, fit["theta"], data, device, use_cache, progress, cache_root)
        runs_per_map.append(runs["tables"])
        means = summarise_replicates(runs["tables"])
        per_map.append({name: means[f"{name}_mean"] for name in runs["tables"][0]})
        diverged.append(runs["diverged"].sum().rename(m))
        scores = runs["tables"][0]["scores"].loc["MAP"]
        maps.append({"map": m, "seed": member["seed"], "map_seconds": fit["seconds"],
                     "accuracy": scores["accuracy"], "nll": scores["nll"]})
    diverged_table = pd.DataFrame(diverged)
    diverged_table.index.name = "map"
    return {"runs": runs_per_map, "tables": per_map, "diverged": diverged_table,
            "maps": pd.DataFrame(maps).set_index("map")}


def least_dispersed_per_map(per_map: list[dict[str, pd.DataFrame]], variants=None) -> pd.DataFrame:
    """Per MAP, the mutual information of each diagonal variant and the one with the smallest (the
    paper's claim: periodic least)."""
    variants = list(variants or DIAGONAL_METHODS)
    table = pd.DataFrame([t["scores"].loc[variants, "mutual_info"] for t in per_map]).reset_index(drop=True)
    table.index.name = "map"
    table["least"] = table[variants].idxmin(axis=1)
    return table


def values_per_run(runs_per_map: list[list[dict[str, pd.DataFrame]]], table: str, column: str,
                   variants=None) -> pd.DataFrame:
    """One column of one of the :func:`tables` (e.g. ``"tails"``, ``"mi_largest_chain_share"``) for each
    variant (columns; the diagonal ones by default) in every run, indexed by ``(map, replicate)``."""
    variants = list(variants or DIAGONAL_METHODS)
    rows = {(m, r): t[table].loc[variants, column] for m, runs in enumerate(runs_per_map) for r, t in enumerate(runs)}
    out = pd.DataFrame.from_dict(rows, orient="index")
    out.index = pd.MultiIndex.from_tuples(out.index, names=["map", "replicate"])
    return out


def dispersion_per_run(runs_per_map: list[list[dict[str, pd.DataFrame]]], variants=None,
                       measure: str = "mutual_info") -> pd.DataFrame:
    """The test-set dispersion of each diagonal variant in every run, indexed by ``(map, replicate)``,
    with the natural logarithms of periodic over fixed and of periodic over EMA (below 0: periodic
    disperses less) and the least dispersed variant of the run.

    ``measure`` is ``"mutual_info"`` (the paper's mutual information, from the scores table) or
    ``"trimmed_mutual_info"`` (the same without the most deviant chains, :func:`mutual_information_tail`,
    from the tails table)."""
    variants = list(variants or DIAGONAL_METHODS)
    table_of = {"mutual_info": "scores", "trimmed_mutual_info": "tails"}
    if measure not in table_of:
        raise ValueError(f"measure must be one of {sorted(table_of)}, got {measure!r}")
    table = values_per_run(runs_per_map, table_of[measure], measure, variants)
    periodic, fixed, ema = "SMP-periodic-diag", "SMP-fixed-diag", "SMP-ema-diag"
    if {periodic, fixed, ema} <= set(variants):
        table["log periodic/fixed"] = np.log(table[periodic] / table[fixed])
        table["log periodic/EMA"] = np.log(table[periodic] / table[ema])
    table["least"] = table[variants].idxmin(axis=1)
    return table


def map_or_stream(per_run: pd.DataFrame) -> pd.DataFrame:
    """How much of the spread of each run's dispersion comes from the MAP and how much from the SMP random
    stream: :func:`smp_book.summaries.variance_components` of the log mutual information of each variant and
    of the log ratios of :func:`dispersion_per_run`, the MAPs as groups (``sd_map``, ``sd_stream``,
    ``map_share``; ``p_value`` tests for no difference between MAPs)."""
    logged = {}
    for column in per_run.columns.drop("least"):
        if column.startswith("log "):  # a log ratio already
            logged[column] = per_run[column]
        else:
            logged[f"log {column}"] = np.log(per_run[column])
    out = variance_components(pd.DataFrame(logged))
    return out.rename(columns={"sd_group": "sd_map", "sd_within": "sd_stream", "group_share": "map_share"})


def seeds(cfg: dict[str, Any]) -> dict[str, Any]:
    """The seeds of the study, for the manifest: the data split, each MAP's and each SMP run's."""
    variants = list(MNIST_VARIANTS)
    return {"split": cfg["split_seed"],
            "maps": {f"map_{m}": map_seed(cfg, m) for m in range(cfg["map_seeds"])},
            "smp": {f"map_{m}": {f"replicate_{r}": {v: smp_seed({**cfg, "seed": map_seed(cfg, m)}, i, r)
                                                    for i, v in enumerate(variants)}
                                 for r in range(cfg["smp_replicates"])}
                    for m in range(cfg["map_seeds"])}}


def least_dispersed_figure(least: pd.DataFrame, seed: int):
    """The mutual information of each diagonal variant per MAP (:func:`least_dispersed_per_map`), log scale."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    for variant in DIAGONAL_METHODS:
        ax.plot(least.index, least[variant], marker="o", label=variant)
    ax.set_xlabel(f"MAP (seed {seed} + 100 m)")
    ax.set_ylabel("mutual information")
    ax.set_yscale("log")
    ax.set_xticks(list(least.index))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def ratio_figure(panels: list[tuple[str, pd.Series]], ylabel: str):
    """One panel per ``(title, values)``: the values of every run (indexed by ``(map, replicate)``) against
    their MAP, with a line at 0."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(8, 3.2), sharey=True, squeeze=False)
    for ax, (title, values) in zip(axes[0], panels, strict=True):
        for m, group in values.groupby(level="map"):
            ax.scatter([m] * len(group), group, color="C0", s=18)
        ax.axhline(0.0, color="0.5", lw=0.8)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("MAP")
        ax.set_xticks(sorted(values.index.get_level_values("map").unique()))
    axes[0][0].set_ylabel(ylabel)
    fig.tight_layout()
    return fig


def _range(values, fmt: str) -> str:
    low, high = format(float(np.min(values)), fmt), format(float(np.max(values)), fmt)
    return low if low == high else f"{low} to {high}"


def _counts(series: pd.Series) -> str:
    return ", ".join(f"{name} {n}" for name, n in series.value_counts().items())


def excursions(per_run: pd.DataFrame, trimmed: pd.DataFrame, shares: pd.DataFrame, n_left_out: int,
               split: pd.DataFrame | None = None, split_trimmed: pd.DataFrame | None = None) -> dict[str, Any]:
    """What the most deviant chains do to each run's dispersion, from the tables of the chapter's last
    section: :func:`dispersion_per_run` by the mutual information (``per_run``) and by the trimmed one
    (``trimmed``, ``n_left_out`` chains left out), each run's largest chain's share of its mutual
    information (``shares``, :func:`values_per_run`) and, with two replicates or more per MAP,
    :func:`map_or_stream` of both (``split``, ``split_trimmed``).

    Returns ``lines`` (Markdown bullets stating the numbers) and the verdict on whether the paper's
    "periodic least" at this K rests on the excursions of a few fixed-diag chains: ``excursion``
    (periodic is least by the mutual information in exactly the runs with the largest fixed-diag
    excursions: every such run has a larger share than every other run, and there are runs of both
    kinds) and ``bulk_fixed_least`` (fixed-diag is least by the trimmed mutual information in every run;
    ``None`` when no chain is left out), with ``conclusion``, a sentence that states them."""
    fixed, periodic = "SMP-fixed-diag", "SMP-periodic-diag"
    n_runs = len(per_run)
    lines = ["The largest chain's share of each run's mutual information: "
             + "; ".join(f"{v} {_range(shares[v], '.0%')} (median {shares[v].median():.0%})"
                         for v in DIAGONAL_METHODS) + "."]
    periodic_least = per_run["least"] == periodic
    where = ", ".join(f"MAP {m} {int(k)} of {int(n)}" for m, (k, n) in
                      periodic_least.groupby(level="map").agg(["sum", "size"]).iterrows() if k > 0)
    line = f"By the mutual information, periodic is the least dispersed in {int(periodic_least.sum())} of {n_runs} runs"
    excursion = bool(periodic_least.any() and (~periodic_least).any()
                     and shares.loc[periodic_least, fixed].min() > shares.loc[~periodic_least, fixed].max())
    if periodic_least.any() and (~periodic_least).any():
        line += (f" ({where}). In those runs fixed-diag's largest chain carries "
                 f"{_range(shares.loc[periodic_least, fixed], '.0%')} of its mutual information, in the others "
                 f"{_range(shares.loc[~periodic_least, fixed], '.0%')}: "
                 + ("every run of the first kind has a larger share than every run of the second." if excursion
                    else "the two ranges overlap."))
    else:
        line += "."
    lines.append(line)
    bulk_fixed_least = None
    if n_left_out == 0:
        lines.append("The trimmed mutual information leaves no chain out at this scale: it is the mutual "
                     "information, and the bulk of the chains cannot be told from the excursions.")
    else:
        ratio = per_run[list(DIAGONAL_METHODS)] / trimmed[list(DIAGONAL_METHODS)]
        lines.append(f"Without the {n_left_out} most deviant chains, each variant's mutual information is smaller by "
                     "a factor of " + "; ".join(f"{v} {_range(ratio[v], '.1f')}" for v in DIAGONAL_METHODS) + ".")
        bulk_fixed_least = bool((trimmed["least"] == fixed).all())
        lines.append(f"By the bulk of the chains (the trimmed mutual information), the least dispersed variant per "
                     f"run: {_counts(trimmed['least'])} (of {n_runs}). Periodic's trimmed mutual information is "
                     f"{_range(np.exp(trimmed['log periodic/fixed']), '.1f')} times fixed's, and EMA's "
                     f"{_range(np.exp(-trimmed['log periodic/EMA']), '.1f')} times periodic's.")
        per_map = trimmed[fixed].groupby(level="map").mean()
        lines.append(f"Trimmed, fixed-diag's mutual information (each MAP's mean over its runs) ranges from "
                     f"{per_map.min():.4f} (MAP {per_map.idxmin()}) to {per_map.max():.4f} (MAP {per_map.idxmax()}), "
                     f"a factor {per_map.max() / per_map.min():.1f}.")
        if split is not None and split_trimmed is not None:
            before, after = split.loc[f"log {fixed}"], split_trimmed.loc[f"log {fixed}"]
            lines.append(f"The stream's standard deviation of log {fixed}: {before['sd_stream']:.2f} with the mutual "
                         f"information, {after['sd_stream']:.2f} trimmed; the MAP's {before['sd_map']:.2f} and "
                         f"{after['sd_map']:.2f}; trimmed, the MAP carries {after['map_share']:.0%} of the variance "
                         f"(F test of no MAP effect: p = {after['p_value']:.2g}).")
    if n_left_out == 0:
        conclusion = ("At this scale the excursions cannot be set apart from the bulk of the chains (no chain is "
                      "left out), so this section has no verdict.")
    elif excursion and bulk_fixed_least:
        conclusion = ("So at this scale periodic over-disperses least, by the paper's measure, exactly in the runs "
                      "where fixed-diag has its largest excursions, and the bulk of the chains says the opposite: "
                      "fixed-diag disperses least in every run. The verdict on \"periodic least\" at this K is a "
                      "verdict on the rare excursions of a few fixed-diag chains.")
    else:
        reasons = []
        if not periodic_least.any() or periodic_least.all():
            reasons.append("periodic is the least dispersed by the mutual information in "
                           + ("no run" if not periodic_least.any() else "every run"))
        elif not excursion:
            reasons.append("the runs where periodic is least by the mutual information are not exactly those "
                           "with the largest fixed-diag excursions")
        if not bulk_fixed_least:
            reasons.append("fixed-diag is not the least dispersed by the trimmed mutual information in every run")
        conclusion = ("At this scale the verdict on \"periodic least\" does not rest on the excursions of a few "
                      "fixed-diag chains alone: " + "; ".join(reasons) + ".")
    return {"lines": lines, "excursion": excursion, "bulk_fixed_least": bulk_fixed_least, "conclusion": conclusion}


def compute(ctx) -> None:
    """The MAP-seeds chapter's results (:mod:`smp_book.pipeline`): the MAPs and their runs
    (:func:`run_map_seeds`, shared with the MNIST chapters through ``.cache/mnist/``), the paper's
    tables over the MAPs, the least dispersed variant per MAP and per run, the verdicts per MAP, the
    split of the spread into the MAP's and the random stream's (:func:`map_or_stream`, with two
    replicates or more), the chains' shares of the mutual information and the same analysis by the
    trimmed mutual information, with the figures and the numbers the prose quotes."""
    from smp_core import metrics

    from .mnist_claims import claims
    from .mnist_runs import TRIM, default_device, load_data, smp_path

    cfg = ctx.config
    device = default_device()
    data, provenance = load_data(cfg)
    study = run_map_seeds(cfg, data, device, ctx.use_cache, progress=ctx.progress)
    per_map, runs = study["tables"], study["runs"]
    n_maps, n_reps = len(per_map), cfg["smp_replicates"]

    # the MAPs and the paper's tables over them
    # the replicates of these means are the MAPs (each MAP's mean over its runs): the level "replicate" of
    # X_replicates numbers the MAPs, so that the reproduction report judges X_mean by the spread over MAPs
    summary = summarise_replicates(per_map)
    for key in ("scores", "variances", "elapsed"):
        for part in ("mean", "std", "replicates"):
            ctx.table(f"{key}_{part}", summary[f"{key}_{part}"])
    maps = ctx.table("maps", study["maps"])
    ctx.table("diverged", study["diverged"])

    # the least dispersed diagonal variant and the verdicts, per MAP
    least = ctx.table("least_dispersed", least_dispersed_per_map(per_map))
    ctx.figure("least_dispersed", least_dispersed_figure(least, cfg["seed"]))
    verdicts = claims(summary["scores_mean"], summary["variances_mean"],
                      [(t["scores"], t["variances"]) for t in per_map]).rename(columns={"replicates": "per MAP"})
    ctx.table("claims", verdicts, index=False)
    differ = verdicts[verdicts["per MAP"].str.contains(",")]

    # the MAP or the random stream
    per_run = ctx.table("per_run", dispersion_per_run(runs))
    ctx.figure("periodic_ratio_per_run", ratio_figure([(r, per_run[r]) for r in ("log periodic/fixed",
                                                                               "log periodic/EMA")],
                                                      "log ratio of mutual information"))
    crosstab = pd.crosstab(per_run.index.get_level_values("map"), per_run["least"]).reindex(
        columns=list(DIAGONAL_METHODS), fill_value=0).rename_axis(index="MAP", columns="least dispersed run")
    ctx.table("least_per_run", crosstab)
    below = per_run["log periodic/fixed"] < 0
    split = ctx.table("map_or_stream", map_or_stream(per_run)) if n_reps >= 2 else None

    # the chains' shares, and the analysis without the most deviant chains
    shares = ctx.table("mi_largest_chain_share", values_per_run(runs, "tails", "mi_largest_chain_share"))
    trimmed = ctx.table("per_run_trimmed", dispersion_per_run(runs, measure="trimmed_mutual_info"))
    ctx.figure("periodic_ratio_trimmed", ratio_figure(
        [(f"log periodic/fixed, {name}", table["log periodic/fixed"])
         for name, table in [("mutual information", per_run), ("trimmed mutual information", trimmed)]],
        "log ratio"))
    split_trimmed = ctx.table("map_or_stream_trimmed", map_or_stream(trimmed)) if n_reps >= 2 else None
    n_left_out = metrics.n_trimmed(cfg["n_chains"], TRIM)
    found = excursions(per_run, trimmed, shares, n_left_out, split, split_trimmed)

    # the numbers the prose quotes
    paper_steps = ctx.settings("mnist", "paper")["n_steps"]
    ctx.value("laptop_n_steps", ctx.settings("mnist", "laptop")["n_steps"])
    for key in ("n_steps", "n_chains", "seed", "map_epochs"):
        ctx.value(key, cfg[key])
    ctx.value("n_maps", n_maps)
    ctx.value("n_replicates", n_reps)
    ctx.value("n_runs", len(per_run))
    ctx.value("other_maps", "MAP 1" if n_maps == 2 else f"MAPs 1 to {n_maps - 1}")
    ctx.value("device", str(device))
    ctx.value("n_diverged", int(study["diverged"].to_numpy().sum()))
    ctx.value("n_periodic_least_maps", int((least["least"] == "SMP-periodic-diag").sum()))
    ctx.value("least_counts", _counts(least["least"]))
    ctx.value("map_accuracy_min", maps["accuracy"].min())
    ctx.value("map_accuracy_max", maps["accuracy"].max())
    ctx.value("map_nll_min", maps["nll"].min())
    ctx.value("map_nll_max", maps["nll"].max())
    ctx.value("map0_nll_rank", int(maps["nll"].rank().loc[0]))
    ctx.value("n_claims", len(verdicts))
    ctx.value("n_claims_differ", len(differ))
    ctx.value("claims_differ", "; ".join(f"{row['claim']} ({row['per MAP']})" for _, row in differ.iterrows())
              or "none")
    ctx.value("runs_periodic_below_fixed", int(below.sum()))
    ctx.value("periodic_below_fixed_per_map", ", ".join(
        f"MAP {m} {int(k)} of {n_reps}" for m, k in below.groupby(level="map").sum().items()))
    ctx.value("df_map", n_maps - 1)
    ctx.value("df_stream", n_maps * (n_reps - 1))
    if split is not None:
        ratio = split.loc["log periodic/fixed"]
        ctx.value("split_text", f"For log(periodic / fixed), the MAP's standard deviation is {ratio['sd_map']:.2f} "
                  f"against the stream's {ratio['sd_stream']:.2f} (the MAP's share of the variance "
                  f"{ratio['map_share']:.0%}); F test of no MAP effect: p = {ratio['p_value']:.3g}.")
    else:
        ctx.value("split_text", "With one replicate per MAP at this scale the MAP and the stream cannot be told "
                  "apart, and the analysis of variance is left out.")
    ctx.value("trim", TRIM)
    ctx.value("n_left_out", n_left_out)
    ctx.value("one_over_s", 1 / cfg["n_chains"])
    if n_left_out:
        fixed_least = int((trimmed["least"] == "SMP-fixed-diag").sum())
        ctx.value("bulk_answer", f"By the bulk of the chains (the mutual information without the {n_left_out} most "
                  f"deviant), fixed-diag is the least dispersed in {fixed_least} of {len(trimmed)} runs.")
    else:
        ctx.value("bulk_answer", f"With S = {cfg['n_chains']} chains the trimmed mutual information leaves none "
                  "out, so this scale cannot tell the bulk of the chains from their excursions.")
    ctx.value("excursion_lines", "\n".join(f"- {line}" for line in found["lines"]))
    ctx.value("excursion_conclusion", found["conclusion"])
    ctx.value("paper_n_steps", paper_steps)
    ctx.value("paper_steps_ratio", paper_steps / cfg["n_steps"])
    ctx.record(seeds=seeds(cfg), device=str(device), data=provenance, smp_path=smp_path(device))
