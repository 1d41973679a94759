"""The claims of Section 3.3, judged by stated criteria from the tables the MNIST chapter writes, so that the
results of any scale, the paper scale's included, can be judged without their runs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd

DIAGONAL = ("SMP-fixed-diag", "SMP-ema-diag", "SMP-periodic-diag")
FIXED, EMA, PERIODIC = DIAGONAL
COLUMNS = ["claim", "criterion", "verdict", "evidence"]
KINDS = (("holds", "hold"), ("partly", "partly"), ("does not hold", "do not hold"))


def _verdict(flags: list[bool]) -> str:
    return "holds" if all(flags) else "partly" if any(flags) else "does not hold"


def entropy(probs: pd.Series) -> float:
    """The entropy (nats) of one predictive distribution over the classes (NaN if a probability is)."""
    p = probs.to_numpy(dtype=np.float64)
    return float(-(p[p > 0] * np.log(p[p > 0])).sum()) if np.isfinite(p).all() else float("nan")


def underconfidence_bound(accuracy: float, ece: float) -> float:
    """A lower bound on the part of the ECE where the confidence is below the accuracy: the confidence is at
    most 1, so the over-confident part ``sum_b w_b (conf_b - acc_b)_+`` is at most ``1 - accuracy``."""
    return max(0.0, ece - (1.0 - accuracy))


def further_claims(scores: pd.DataFrame, variances: pd.DataFrame, ambiguous: pd.DataFrame,
                   elapsed: pd.DataFrame, timing_note: str | None = None, n_test: int | None = None) -> pd.DataFrame:
    """The claims of Section 3.3 that :func:`claims` leaves out, from the chapter's ``*_mean`` and
    ``ambiguous_three`` tables. With ``n_test`` an accuracy is lower only by more than one binomial standard
    error of MAP's; a claim whose numbers are not all finite is "not checked"."""
    s, v, rows = scores, variances, []

    def add(claim, criterion, numbers, judge, evidence):
        finite = all(np.isfinite(np.asarray(x, dtype=np.float64)).all() for x in numbers)
        rows.append([claim, criterion, _verdict(judge()) if finite else "not checked (a number is missing)", evidence])

    mi, logit = s["mutual_info"], v["logits_variance"]
    add("Dispersion is largest for fixed, then EMA, then periodic (MI, logit variance)",
        "MI and logit variance both in that order (partly: one of them)",
        [mi[list(DIAGONAL)], logit[list(DIAGONAL)]],
        lambda: [mi[FIXED] > mi[EMA] > mi[PERIODIC], logit[FIXED] > logit[EMA] > logit[PERIODIC]],
        "; ".join(f"{m}: MI {mi[m]:.4g}, logit variance {logit[m]:.4g}" for m in DIAGONAL))
    map_accuracy, metrics = s.loc["MAP", "accuracy"], ["accuracy", "brier", "nll", "ece"]
    margin = float(np.sqrt(map_accuracy * (1 - map_accuracy) / n_test)) if n_test else 0.0
    add("The diagonal variants predict worse than MAP and SMP-none (accuracy, Brier, NLL, ECE)",
        "for each diagonal variant all four worse than both MAP's and SMP-none's, the accuracy by more than "
        f"{margin:.4f} (one binomial standard error of MAP's; partly: some variants)",
        [s.loc[["MAP", "SMP-none", *DIAGONAL], metrics]],
        lambda: [all(s.loc[m, "accuracy"] < s.loc[ref, "accuracy"] - margin
                     and all(s.loc[m, c] > s.loc[ref, c] for c in metrics[1:]) for ref in ("MAP", "SMP-none"))
                 for m in DIAGONAL],
        "; ".join(f"{m}: accuracy {s.loc[m, 'accuracy']:.4f}, Brier {s.loc[m, 'brier']:.4f}, "
                  f"NLL {s.loc[m, 'nll']:.4f}, ECE {s.loc[m, 'ece']:.4f}" for m in DIAGONAL)
        + f" (MAP: {s.loc['MAP', 'accuracy']:.4f}, {s.loc['MAP', 'brier']:.4f}, {s.loc['MAP', 'nll']:.4f}, "
          f"{s.loc['MAP', 'ece']:.4f})")
    ece = s["ece"]
    under = {m: underconfidence_bound(s.loc[m, "accuracy"], ece[m]) for m in (FIXED, EMA)}
    add("Calibration: MAP and SMP-none near the diagonal; fixed and EMA far under-confident; periodic between",
        "ECE < 0.01 for MAP and SMP-none; ECE > 0.05 for fixed and EMA, more than half of it provably "
        "under-confidence (ECE - (1 - accuracy)); periodic's ECE between theirs (partly: some of the three)",
        [ece, s["accuracy"]],
        lambda: [ece["MAP"] < 0.01 and ece["SMP-none"] < 0.01,
                 all(ece[m] > 0.05 and under[m] > ece[m] / 2 for m in (FIXED, EMA)),
                 max(ece["MAP"], ece["SMP-none"]) < ece[PERIODIC] < min(ece[FIXED], ece[EMA])],
        f"ECE: MAP {ece['MAP']:.4f}, SMP-none {ece['SMP-none']:.4f}, "
        + ", ".join(f"{m} {ece[m]:.4f} (under-confident at least {under[m]:.4f})" for m in (FIXED, EMA))
        + f", {PERIODIC} {ece[PERIODIC]:.4f}")
    probs, classes, shown = ambiguous.rename(columns=str), [str(c) for c in range(10)], ("MAP", "SMP-none", *DIAGONAL)
    h = {m: entropy(probs.loc[m, classes]) for m in shown}
    add("Ambiguous 3: SMP-none concentrated on 3 like MAP; fixed most diffuse, then EMA, then periodic",
        "SMP-none gives 3 a probability above 0.5 and within 0.05 of MAP's; entropies of the mean "
        "probabilities fixed > EMA > periodic > SMP-none (partly: one of the two)",
        [probs.loc[list(shown), classes]],
        lambda: [probs.loc["SMP-none", "3"] > 0.5 and abs(probs.loc["SMP-none", "3"] - probs.loc["MAP", "3"]) < 0.05,
                 h[FIXED] > h[EMA] > h[PERIODIC] > h["SMP-none"]],
        f"P(3): MAP {probs.loc['MAP', '3']:.3f}, SMP-none {probs.loc['SMP-none', '3']:.3f}; entropy (nats): "
        + ", ".join(f"{m} {h[m]:.3f}" for m in ("SMP-none", *DIAGONAL)))
    sec = elapsed.iloc[:, 0]
    add("The diagonal variants take longer than SMP-none, periodic (its recomputations) the longest",
        "each diagonal variant's seconds above SMP-none's, and periodic's the largest (partly: some of these)",
        [sec[["SMP-none", *DIAGONAL]]],
        lambda: [sec[m] > sec["SMP-none"] for m in DIAGONAL] + [sec[PERIODIC] == sec[list(DIAGONAL)].max()],
        "seconds: " + ", ".join(f"{m} {sec[m]:.0f}" for m in ("SMP-none", *DIAGONAL))
        + (f" (timing note: {timing_note})" if timing_note else ""))
    return pd.DataFrame(rows, columns=COLUMNS)


def from_results(res) -> pd.DataFrame:
    """:func:`further_claims` of the MNIST chapter's results ``res`` (:class:`smp_book.results.Results`)."""
    return further_claims(res.table("scores_mean"), res.table("variances_mean"), res.table("ambiguous_three"),
                          res.table("elapsed_mean"), res.manifest.get("timing_note"), res.config.get("n_test"))


def all_claims(res) -> pd.DataFrame:
    """The MNIST chapter's own verdicts (its ``claims`` table) followed by :func:`from_results`'s."""
    return pd.concat([res.table("claims"), from_results(res)], ignore_index=True)


# The settings that make the MAP-seeds chapter's runs comparable with a paper-scale run: the same data and
# MAP training (then a MAP of the same seed is the same MAP) and the same number of chains.
SAME_MAP = ("n_train", "n_val", "split_seed", "map_batch", "map_epochs", "map_lr", "map_weight_decay")


def paper_scale_gaps(run, paper_scores: pd.DataFrame, seeds=None) -> pd.DataFrame:
    """Per SMP variant, the paper-scale mutual information (``run``) beside the paper's, their ``ratio`` and our
    ``largest chain's share``. Where the MAP-seeds chapter's ``seeds`` have the data, MAP training and S of
    ``run``: ``MAP sd`` and ``stream sd`` of the log MI there, ``gap in sds`` (the log ratio over the sd of the
    difference of two runs from independent MAPs and streams: the paper's and ours are one draw each) and
    ``growth`` from the same MAP (periodic only with as many Fisher images) beside ``linear growth``, the
    ratio of the reached shares ``1 - r_K^2 / r_0^2`` at the two K."""
    from smp_core.recursion import residual_variance_ratio

    scores, tails = run.table("scores"), run.table("tails")
    methods = [m for m in scores.index if m != "MAP" and m in paper_scores.index]
    ours, theirs = scores.loc[methods, "mutual_info"], paper_scores.loc[methods, "mutual_info"].astype(float)
    table = pd.DataFrame({"paper": theirs, "paper scale": ours, "ratio": ours / theirs.where(theirs != 0),
                          "largest chain's share": tails.loc[methods, "mi_largest_chain_share"]})
    comparable = (seeds is not None and all(seeds.has(t) for t in ("map_or_stream", "per_run", "maps"))
                  and all(seeds.config.get(k) == run.config.get(k) for k in (*SAME_MAP, "n_chains")))
    if comparable:
        spread = seeds.table("map_or_stream")
        for column, name in (("MAP sd", "sd_map"), ("stream sd", "sd_stream")):
            table[column] = [spread[name].get(f"log {m}", np.nan) for m in methods]
        table["gap in sds"] = np.log(table["ratio"]) / (np.sqrt(2) * np.hypot(table["MAP sd"], table["stream sd"]))
        maps, per_run = seeds.table("maps"), seeds.table("per_run")  # indexed by map, (map, replicate)
        same = maps.index[maps["seed"] == run.values.get("map_seed")]
        if len(same) == 1:
            runs = per_run.xs(same[0], level="map")
            same_fisher = seeds.config.get("n_fisher_periodic") == run.config.get("n_fisher_periodic")
            table["growth"] = [ours[m] / runs[m].mean() if m in runs.columns and (m != PERIODIC or same_fisher)
                               else np.nan for m in methods]
            n, k_here, k_paper = run.config["n_train"], seeds.config["n_steps"], run.config["n_steps"]
            table["linear growth"] = ((1 - residual_variance_ratio(n, k_paper))
                                      / (1 - residual_variance_ratio(n, k_here)))
    table.index.name = "method"
    return table


def both_scales(paper_run, here, scale: str) -> pd.DataFrame:
    """The verdicts of :func:`all_claims` at the paper scale beside those of ``here`` (columns ``claim``,
    ``verdict (paper scale)``, ``verdict (<scale>)``; "-" where ``here`` judges no such claim)."""
    return all_claims(paper_run)[["claim", "verdict"]].merge(
        all_claims(here)[["claim", "verdict"]], on="claim", how="left",
        suffixes=(" (paper scale)", f" ({scale})")).fillna("-")


def verdict_summary(verdicts) -> str:
    """``"3 hold, 1 partly, 1 does not hold"``: how many verdicts of each kind (absent kinds left out)."""
    counts = Counter(verdicts)
    return ", ".join(f"{counts[v]} {v if counts[v] == 1 else plural}" for v, plural in KINDS if counts[v]) or "none"


def count_verdicts(verdicts) -> str:
    """:func:`verdict_summary` with the other verdicts (not checked, or "-": not judged) counted as "not
    checked", so that the counts add up."""
    verdicts = list(verdicts)
    rest = sum(v not in dict(KINDS) for v in verdicts)
    parts = [verdict_summary(verdicts)] + ([f"{rest} not checked"] if rest else [])
    return ", ".join(p for p in parts if p != "none") or "none"


def verdict_counts(verdicts) -> str:
    """``["holds", "does not hold", "holds"]`` -> ``"holds 2, does not hold 1"`` (most frequent first)."""
    return ", ".join(f"{v} {n}" for v, n in Counter(verdicts).most_common())


def _times(x: float) -> str:
    """``x`` to two significant figures, without an exponent, and "times"."""
    if not np.isfinite(x):
        return "not comparable with"
    return f"{np.format_float_positional(float(f'{x:.2g}'), trim='-')} times"


def paper_scale_findings(verdicts: pd.DataFrame, gaps: pd.DataFrame, ours: pd.DataFrame, paper: pd.DataFrame,
                         scale: str, n_chains: int) -> str:
    """What the paper-scale results say, in Markdown: the verdict counts (``verdicts``: :func:`both_scales`),
    the verdicts that change, and per SMP variant its accuracy, MI and logit variance (``ours``, ``paper``)
    against the paper's with what ``gaps`` (:func:`paper_scale_gaps`) says of the gap. Fixed thresholds set
    the words: a gap within two sds is one that another MAP and stream could give; a growth above twice the
    linear one is faster than a fixed Fisher gives (for SMP-fixed-diag: its chains left the region where the
    MAP's Fisher holds), below half less; a largest chain's share below ``5 / n_chains`` says that the bulk
    of the chains carries the MI, one from 0.25 that much of it is one chain's excursion."""
    at_paper, here = "verdict (paper scale)", f"verdict ({scale})"
    changed = verdicts[verdicts[at_paper] != verdicts[here]]
    head = (f"Of the {len(verdicts)} claims, at the paper scale {count_verdicts(verdicts[at_paper])}; at the "
            f"{scale} scale, {count_verdicts(verdicts[here])}. "
            + ("The verdicts that change with the scale: " + "; ".join(
                f"*{c}* ({h} at the {scale} scale, {p} at the paper scale)"
                for c, p, h in changed[["claim", at_paper, here]].itertuples(index=False)) + "."
               if len(changed) else "No verdict changes with the scale."))
    bullets = []
    for method, row in gaps.iterrows():
        acc = [float(t.loc[m, "accuracy"]) for t in (ours, paper) for m in (method, "MAP")]
        logit = ours.loc[method, "logits_variance"] / float(paper.loc[method, "logits_variance"])
        coarse = np.isfinite(row["paper"]) and row["paper"] != 0 and float(f"{row['paper']:.1g}") == row["paper"]
        parts = [f"accuracy {acc[0]:.4f} against the MAP's {acc[1]:.4f} (the paper: {acc[2]:.4f} against "
                 f"{acc[3]:.4f})", f"mutual information {row['paper scale']:.4g} against the paper's "
                 f"{row['paper']:.4g} ({_times(row['ratio'])} it"
                 + (", the paper's number having one significant figure" if coarse else "")
                 + f"), logit variance {_times(logit)} the paper's"]
        gap, growth, linear = (row.get(c, np.nan) for c in ("gap in sds", "growth", "linear growth"))
        if np.isfinite(gap):
            parts.append(f"{abs(gap):.1f} standard deviations {'below' if gap < 0 else 'above'} the paper's: "
                         + ("within what another MAP and stream could give" if abs(gap) <= 2
                            else "more than another MAP and stream gave at the MAP-seeds chapter's K"))
        if np.isfinite(growth) and np.isfinite(linear):
            faster = "faster than a fixed Fisher gives" + (
                ": the chains left the region where the MAP's Fisher holds" if method == FIXED else "")
            parts.append(f"it grew {_times(growth)} from the MAP-seeds chapter's K on the same MAP, a fixed Fisher "
                         f"{_times(linear)}: " + (faster if growth > 2 * linear else "less than a fixed Fisher gives"
                                                  if growth < linear / 2 else "about what a fixed Fisher gives"))
        share = row.get("largest chain's share", np.nan)
        if np.isfinite(share):
            parts.append(f"the largest chain carries {share:.0%} of it (an even share: {1 / n_chains:.0%}), "
                         + ("so the bulk of the chains carries it" if share < 5 / n_chains else
                            "a sizeable share for one chain" if share < 0.25 else
                            "so much of it is one chain's excursion"))
        bullets.append(f"- {method}: " + "; ".join(parts) + ".")
    return "\n".join([head, "", *bullets])


def claims(scores: pd.DataFrame, variances: pd.DataFrame,
           replicates: list[tuple[pd.DataFrame, pd.DataFrame]] | None = None) -> pd.DataFrame:
    """The conclusions of Section 3.3.4, judged by stated criteria on ``scores`` and ``variances`` (with
    replicates, their means). ``replicates``, ``(scores, variances)`` of single runs, adds the column
    ``replicates``: the verdicts each run alone gets (:func:`verdict_counts`)."""
    table = _claims(scores, variances)
    if replicates:
        per_run = [_claims(s, v)["verdict"].tolist() for s, v in replicates]
        table["replicates"] = [verdict_counts(col) for col in zip(*per_run, strict=True)]
    return table


def _claims(s: pd.DataFrame, v: pd.DataFrame) -> pd.DataFrame:
    acc_gap = abs(s.loc["SMP-none", "accuracy"] - s.loc["MAP", "accuracy"])
    nll_gap = abs(s.loc["SMP-none", "nll"] - s.loc["MAP", "nll"])
    mi, std = s.loc["SMP-none", "mutual_info"], s.loc["SMP-none", "epistemic_std"]
    over = [s.loc[d, "mutual_info"] > 10 * max(mi, 1e-6) and s.loc[d, "nll"] > s.loc["MAP", "nll"] for d in DIAGONAL]
    least = min(DIAGONAL, key=lambda d: s.loc[d, "mutual_info"])
    big = [v.loc[d, "params_variance"] < 1e-3 and v.loc[d, "logits_variance"] > 1.0 for d in DIAGONAL]
    return pd.DataFrame([
        ["SMP-none predicts like MAP (same accuracy, Brier, NLL, ECE)",
         "accuracy within 0.002 and NLL within 0.005 of MAP",
         "holds" if acc_gap <= 0.002 and nll_gap <= 0.005 else ("partly" if acc_gap <= 0.005 else "does not hold"),
         f"accuracy {s.loc['SMP-none', 'accuracy']:.4f} vs {s.loc['MAP', 'accuracy']:.4f}; NLL "
         f"{s.loc['SMP-none', 'nll']:.4f} vs {s.loc['MAP', 'nll']:.4f}"],
        ["SMP-none collapses to a point estimate (tiny MI and epistemic std)", "MI < 0.005 and epistemic std < 0.005",
         _verdict([mi < 0.005 and std < 0.005]), f"MI {mi:.5f}, epistemic std {std:.5f}"],
        ["The diagonal variants over-disperse: much larger MI and worse NLL than MAP and SMP-none",
         "for each diagonal variant MI > 10x SMP-none's and NLL > MAP's (partly: some of them)", _verdict(over),
         "; ".join(f"{d}: MI {s.loc[d, 'mutual_info']:.4f}, NLL {s.loc[d, 'nll']:.4f}" for d in DIAGONAL)],
        ["Periodic recomputation over-disperses least among the diagonal variants",
         "SMP-periodic-diag has the smallest MI of the three", _verdict([least == PERIODIC]),
         f"smallest MI: {least}"],
        ["Diagonal variants: tiny parameter variance (< 1e-3) but large logit variance (> 1)",
         "both, for each diagonal variant (partly: some)", _verdict(big),
         "; ".join(f"{d}: params {v.loc[d, 'params_variance']:.2e}, logits {v.loc[d, 'logits_variance']:.3f}"
                   for d in DIAGONAL)]], columns=COLUMNS)
