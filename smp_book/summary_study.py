"""The summary chapter: every table of the paper beside ours with a figure, and the findings of the chapters
beyond the paper (the verdicts on the paper's claims are the register's: :mod:`smp_book.register`).

Nothing is computed anew: :func:`compute` reads the other studies' results (``ctx.read``).
"""

from __future__ import annotations

import pandas as pd

from .paper import paper_table


def config(scale: str) -> dict[str, str]:
    """The summary has no settings of its own: it is recomputed when a chapter it reads is."""
    return {"scale": scale}


def _table_figure(ctx, source, prefix: str, name: str, digits: int) -> None:
    from . import plots
    from .show import beside_paper

    mean, std = source.table(f"{name}_mean"), source.table(f"{name}_std")
    paper = paper_table(f"{prefix}_{name}")
    ctx.table(f"{prefix}_{name}", beside_paper(mean, paper, std, digits=digits))
    ctx.figure(f"{prefix}_{name}", plots.beside_paper(mean, std, paper, f"Table {prefix}_{name}: paper and ours"))


def _copy(ctx, source, name: str, as_name: str) -> None:
    if source.has(name):
        ctx.table(as_name, source.table(name))


def compute(ctx) -> None:
    """Every table of the paper beside ours. The MNIST tables come from the paper scale's MNIST chapter where
    its results are there and current (the paper's K and S); else from this scale's."""
    toy, mnist_here = ctx.read("toy"), ctx.read("mnist")
    paper = ctx.read_other_scale("mnist", "paper") if ctx.scale != "paper" else None
    mnist = paper or mnist_here
    for name, digits in (("scores", 4), ("variances", 4), ("elapsed", 1)):
        _table_figure(ctx, toy, "ex1", name, digits)
    for name, digits in (("scores", 4), ("variances", 6), ("elapsed", 1)):
        _table_figure(ctx, mnist, "ex2", name, digits)
    ctx.value("mnist_scale", mnist.manifest.get("scale", ctx.scale))
    ctx.value("toy_replicates", toy.config["replicates"])
    ctx.value("mnist_steps", mnist.config["n_steps"])
    ctx.value("mnist_replicates", mnist.config["smp_replicates"])

    baselines = ctx.read("toy_baselines")
    _copy(ctx, baselines, "findings", "toy_baselines")
    _copy(ctx, ctx.read("mnist_baselines"), "findings", "mnist_baselines")
    _copy(ctx, ctx.read("toy_kfac"), "findings", "toy_kfac")
    _copy(ctx, ctx.read("mnist_kfac"), "findings", "mnist_kfac")
    tail = ctx.read("toy_tail")
    if tail.has("agreement"):
        agree = tail.table("agreement").astype("Int64")
        ctx.table("toy_tail", agree.astype(object).where(agree.notna(), "none"))
    table = tail_table(ctx.read("mnist_tail"), paper)
    if table is not None:
        ctx.table("mnist_tail", table)
    if baselines.has("beyond_nuts_noise") and baselines.has("agreement_mean"):
        noise = baselines.table("beyond_nuts_noise")[("mean |p - p_NUTS|", "excess (se)")]
        floor = baselines.table("agreement_mean").loc["NUTS, second chain", "tv_to_nuts"]
        ctx.value("nuts_floor", floor)
        ctx.value("within_nuts_noise", ", ".join(noise[noise < 2].index) or "none")
    regression_tables(ctx, ctx.read("regression"))


def tail_table(mnist_tail, paper=None) -> pd.DataFrame | None:
    """The MNIST tail chapter's check ratios per variant beside its mutual informations (the paper's, the
    recursion's and the tail's rows), and, where the paper-scale MNIST results ``paper`` are given, the
    mutual information of the recursion itself run to the paper's K there (its first replicate, as the
    tails are; the column names its MAP's seed). ``None`` without the tail chapter's tables."""
    if not (mnist_tail.has("ratios") and mnist_tail.has("beside_paper")):
        return None
    ratios = mnist_tail.table("ratios")
    ratios = ratios.droplevel("tail_from") if "tail_from" in ratios.index.names else ratios
    table = ratios.join(mnist_tail.table("beside_paper")["MI"].unstack())
    if paper is not None and paper.has("scores"):
        label = (f"recursion to {paper.config['n_steps']:,} (paper scale, MAP of seed "
                 f"{paper.values.get('map_seed', '?')})")
        table[label] = paper.table("scores")["mutual_info"].reindex(table.index)
    return table


def regression_tables(ctx, regression) -> None:
    """Per SMP setting of the regression chapter, the tau matched to NUTS's spread in range and the spread
    there (beside the linearised Laplace approximation's)."""
    if not (regression.has("tau_matched_in_range") and regression.has("scores_median")):
        return
    matched = regression.table("tau_matched_in_range")
    medians = regression.table("scores_median")
    medians = medians.reset_index() if "method" not in medians.columns else medians
    laplace = medians[medians["method"] == "Laplace (linearised)"].set_index("region")["sd_ratio"]
    matched["within 2x"] = matched["within 2x"].astype(object)
    matched.loc["Laplace (linearised)", ["sd_ratio (in range)", "sd_ratio (in the gap)"]] = (
        laplace["in range"], laplace["in the gap"])
    matched["within 2x"] = matched["within 2x"].map({True: "yes", False: "no"})
    columns = ["tau", "within 2x", "sd_ratio (in range)", "sd_ratio (in the gap)", "coverage (in the gap)"]
    ctx.table("regression", matched.reindex(columns=columns).map(
        lambda v: "-" if pd.isna(v) else f"{v:.3g}" if isinstance(v, float) else v))
