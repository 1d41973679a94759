"""The summary chapter: every table of the paper beside ours with a figure, one verdict per claim of the
paper's Section 3 from all the evidence that tests it, and the findings of the chapters beyond the paper.

Nothing is computed anew: :func:`compute` reads the other studies' results (``ctx.read``).
"""

from __future__ import annotations

import pandas as pd

from .mnist_claims import all_claims
from .paper import paper_table

SOURCES = ("toy", "toy_baselines", "toy_kfac", "toy_tail", "mnist", "mnist_baselines", "mnist_seeds",
           "mnist_growth", "mnist_kfac", "mnist_tail", "regression")
PERIODIC = "SMP-periodic-diag"
PERIODIC_CLAIM = "Periodic recomputation over-disperses least"


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


def _periodic_least(ctx, mnist_claims: pd.DataFrame) -> dict[str, str]:
    """The claim 'periodic recomputation over-disperses least among the diagonal variants', judged once
    from the MNIST chapter (one MAP, its replicates), the MAP seeds (every MAP) and the growth in K."""
    row = mnist_claims[mnist_claims["claim"].str.startswith(PERIODIC_CLAIM)]
    if len(row) != 1:
        raise ValueError(f"the MNIST chapter's claims hold {len(row)} rows starting {PERIODIC_CLAIM!r}, not one: "
                         "was the claim reworded?")
    sources, evidence = [], []
    if len(row):
        holds = row["verdict"].iloc[0] == "holds"
        sources.append(holds)
        evidence.append(f"MNIST chapter (one MAP): {row['verdict'].iloc[0]} ({row['evidence'].iloc[0]})")
    seeds = ctx.read("mnist_seeds")
    if seeds.has("least_dispersed"):
        per_map = seeds.table("least_dispersed")
        n = int((per_map["least"] == PERIODIC).sum())
        sources.append(n == len(per_map))
        evidence.append(f"MAP seeds: periodic least from {n} of {len(per_map)} MAPs")
    growth = ctx.read("mnist_growth")
    if growth.has("least_dispersed"):
        least = growth.table("least_dispersed")
        last = least.index[-1]
        resolved = least.loc[last, "lead_z"] >= 2
        if resolved:
            sources.append(least.loc[last, "least"] == PERIODIC)
        evidence.append(f"growth in K (fewer chains): at K = {last:,} the least is {least.loc[last, 'least']} "
                        f"(lead {least.loc[last, 'lead_z']:.1f} se{'' if resolved else ', not resolved'})")
    n_hold = sum(sources)
    verdict = ("not checked" if not sources else "holds" if n_hold == len(sources)
               else "partly" if n_hold else "does not hold")
    return {"verdict": verdict, "evidence": "; ".join(evidence),
            "criterion": "SMP-periodic-diag has the smallest MI among the diagonal variants in the MNIST chapter "
                         "(replicate means), from every MAP of the MAP-seeds chapter and at the largest K of the "
                         "growth chapter where its lead is resolved (2 se); partly: in some of these"}


def claims(ctx, toy, mnist, mnist_here=None) -> pd.DataFrame:
    """One row per claim of Section 3: its section, the claim, the criterion, the verdict, the evidence, the
    scale of the run that judged it and the chapter that shows it. ``mnist`` judges the MNIST claims (the
    paper scale's results where they exist); ``mnist_here``, when given, is this scale's MNIST chapter, whose
    verdict each MNIST row's evidence adds."""
    toy_claims = toy.table("claims").assign(section="3.2 toy", chapter="toy", scale=toy.manifest.get("scale"))
    mnist_claims = all_claims(mnist).assign(section="3.3 MNIST", chapter="mnist",
                                                      scale=mnist.manifest.get("scale"))
    combined = _periodic_least(ctx, mnist_claims)
    periodic = mnist_claims["claim"].str.startswith(PERIODIC_CLAIM)
    for key, value in combined.items():
        mnist_claims.loc[periodic, key] = value
    mnist_claims.loc[periodic, "chapter"] = "mnist, mnist_seeds, mnist_growth"
    if mnist_here is not None:
        here = all_claims(mnist_here).set_index("claim")["verdict"]
        mnist_claims["evidence"] = [
            f"{e}; at the {mnist_here.manifest.get('scale')} scale: {here.get(c, 'not judged')}"
            for c, e in zip(mnist_claims["claim"], mnist_claims["evidence"], strict=True)]
    nuts = toy.table("scores_mean")
    acc_gap = abs(nuts.loc["NUTS-mean", "accuracy"] - nuts.loc["NUTS", "accuracy"])
    brier_gap = abs(nuts.loc["NUTS-mean", "brier"] - nuts.loc["NUTS", "brier"])
    zero = mnist.values.get("fisher_zero_fraction", mnist.manifest.get("fisher_zero_fraction"))
    r_ratio, n_steps = toy.values.get("r_ratio"), toy.config["n_steps"]
    toy_scale, mnist_scale = toy.manifest.get("scale"), mnist.manifest.get("scale")
    extra = pd.DataFrame([
        {"section": "3.2 toy", "chapter": "toy", "scale": toy_scale,
         "claim": "NUTS-mean predicts almost exactly like NUTS (accuracy, Brier)",
         "criterion": "accuracy within 0.005 and Brier within 0.005",
         "verdict": "holds" if acc_gap < 0.005 and brier_gap < 0.005 else "does not hold",
         "evidence": f"accuracy {nuts.loc['NUTS-mean', 'accuracy']:.4f} vs {nuts.loc['NUTS', 'accuracy']:.4f}; "
                     f"Brier {nuts.loc['NUTS-mean', 'brier']:.4f} vs {nuts.loc['NUTS', 'brier']:.4f}"},
        {"section": "3.2 toy", "chapter": "toy", "scale": toy_scale,
         "claim": "r_K^2 / r_0^2 is about 9 % (N = 500, K = 5000)",
         "criterion": "the formula of Section 3.2.3 at the toy's N and K",
         "verdict": ("not checked (K differs at this scale)" if n_steps != 5000
                     else "holds" if abs(r_ratio - 0.09) < 0.005 else "does not hold"),
         "evidence": f"{r_ratio:.2%} at K = {n_steps:,}"},
        {"section": "3.3 MNIST", "chapter": "mnist", "scale": mnist_scale,
         "claim": "More than half of the diagonal empirical Fisher entries are exact zeros",
         "criterion": "fraction of zeros > 0.5 at the MAP, validation set",
         "verdict": ("not checked" if zero is None else "holds" if zero > 0.5 else "does not hold"),
         "evidence": "-" if zero is None else f"{zero:.1%}"},
    ])
    columns = ["section", "claim", "verdict", "criterion", "evidence", "scale", "chapter"]
    table = pd.concat([toy_claims, extra, mnist_claims], ignore_index=True)[columns]
    return table.sort_values("section", kind="stable", ignore_index=True)


def _copy(ctx, source, name: str, as_name: str) -> None:
    if source.has(name):
        ctx.table(as_name, source.table(name))


def compute(ctx) -> None:
    """Every table of the paper beside ours and one verdict per claim. The MNIST tables and claims come
    from the paper scale's MNIST chapter where its results are there and current (the paper's K and S),
    the MNIST rows' evidence adding this scale's verdict; else from this scale's."""
    toy, mnist_here = ctx.read("toy"), ctx.read("mnist")
    paper = ctx.read_other_scale("mnist", "paper") if ctx.scale != "paper" else None
    mnist = paper or mnist_here
    for name, digits in (("scores", 4), ("variances", 4), ("elapsed", 1)):
        _table_figure(ctx, toy, "ex1", name, digits)
    for name, digits in (("scores", 4), ("variances", 6), ("elapsed", 1)):
        _table_figure(ctx, mnist, "ex2", name, digits)
    verdicts = ctx.table("claims", claims(ctx, toy, mnist, mnist_here if paper else None), index=False)
    ctx.value("mnist_scale", mnist.manifest.get("scale", ctx.scale))
    counts = verdicts["verdict"].value_counts()
    for verdict in ("holds", "partly", "does not hold"):
        ctx.value(verdict.replace(" ", "_"), int(counts.get(verdict, 0)))
    ctx.value("claims", len(verdicts))
    ctx.value("not_checked", int(verdicts["verdict"].str.startswith("not checked").sum()))
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
    there (beside the linearised Laplace approximation's); and the wider design's gap shares."""
    from .summaries import empirical_counterpart

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
    if not all(regression.has(n) for n in ("design_spread_shape", "spread_shape", "design_tau_matched_in_range")):
        return
    design_shape, empirical_shape = regression.table("design_spread_shape"), regression.table("spread_shape")
    design_matched = regression.table("design_tau_matched_in_range")

    def smallest_tau_share(table, method):
        values = table.loc[method].dropna() if method in table.index else pd.Series(dtype=float)
        return f"{values.iloc[0]:.3g} (tau {float(values.index[0]):g})" if len(values) else "-"

    rows = {}
    for m in design_matched.index:
        row = design_matched.loc[m]
        ok = bool(row["within 2x"])
        rows[m] = {"gap share, smallest tau": smallest_tau_share(design_shape, m),
                   "empirical design's": smallest_tau_share(empirical_shape, empirical_counterpart(m)),
                   "tau matched in range": f"{row['tau']:.3g}" if ok and pd.notna(row["tau"]) else "-",
                   "sd_ratio (in the gap) there": (f"{row['sd_ratio (in the gap)']:.3g}"
                                                   if ok and pd.notna(row["sd_ratio (in the gap)"]) else "-"),
                   "gap share there": f"{design_shape.loc[m, f'{row.tau}']:.3g}" if ok else "-"}
    ctx.table("regression_design", pd.DataFrame.from_dict(rows, orient="index"))
