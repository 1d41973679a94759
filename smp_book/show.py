"""Tables and sentences for the chapters' pages: our numbers beside the paper's and other scales', for a reader."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from .config import get_config
from .judge import ALPHA, judge_by_map_seeds
from .paper import paper_table
from .register import FIXED, PERIODIC, WORDS, count
from .results import RESULTS, ROOT, Results


def with_spread(mean: pd.DataFrame, std: pd.DataFrame | None = None, digits: int = 4) -> pd.DataFrame:
    """Each cell as ``mean ± sd`` (no spread where the sd is NaN or not given), "-" without a value."""
    out = mean.map(lambda v: "-" if np.isnan(v) else f"{v:.{digits}f}")
    return out if std is None else out + std.reindex_like(mean).map(
        lambda v: "" if np.isnan(v) else f" ± {v:.{digits}f}")


def beside_scales(paper: pd.DataFrame, scaled: dict[str, tuple[pd.DataFrame, pd.DataFrame | None]],
                  digits: int = 4) -> pd.DataFrame:
    """Per column of the first scale's mean, on its rows: the paper's number ``(column, "paper")`` where it has
    one, then ``(column, <scale>)`` for each ``scaled[<scale>] = (mean, std)`` (:func:`with_spread`), or "-"."""
    if not scaled:
        raise ValueError("scaled: give at least one scale's (mean, std)")
    rows = next(iter(scaled.values()))[0].index
    parts = {name: with_spread(mean.reindex(rows), std, digits) for name, (mean, std) in scaled.items()}
    cols = {}
    for c in next(iter(parts.values())).columns:
        if c in paper.columns:
            cols[(c, "paper")] = with_spread(paper[[c]].reindex(rows), digits=digits)[c]
        cols.update({(c, name): part[c] if c in part.columns else "-" for name, part in parts.items()})
    return pd.DataFrame(cols, index=rows)


def beside_paper(ours: pd.DataFrame, paper: pd.DataFrame, std: pd.DataFrame | None = None,
                 digits: int = 4) -> pd.DataFrame:
    """Per column, the paper's number (where it has one) and ours (``mean ± sd`` with ``std``)."""
    return beside_scales(paper, {"ours": (ours, std)}, digits)


def shown(df: pd.DataFrame, digits: int = 3, significant: bool = False) -> pd.DataFrame:
    """``df`` for display: floats rounded to ``digits`` decimals (``significant``: significant digits), booleans
    as yes/no, missing cells and labels (of the index and the columns) as "-"."""

    def label(v):
        return "-" if isinstance(v, float | np.floating) and math.isnan(v) else v

    def cell(v):
        if isinstance(v, bool | np.bool_):
            return "yes" if v else "no"
        if isinstance(v, float | np.floating) and not math.isnan(v):
            return f"{v:.{digits}g}" if significant else round(float(v), digits)
        return "-" if v is None or (isinstance(v, str) and v == "") else label(v)

    out = df.map(cell)
    if isinstance(out.index, pd.MultiIndex):
        out.index = pd.MultiIndex.from_tuples([tuple(map(label, key)) for key in out.index], names=out.index.names)
    else:
        out.index = pd.Index([label(v) for v in out.index], name=out.index.name)
    if not isinstance(out.columns, pd.MultiIndex):
        out.columns = [label(c) for c in out.columns]
    return out


def claims_table(claims: pd.DataFrame) -> str:
    """A claims table as Markdown, each verdict right after its claim (then the rest), missing cells as ``-``."""
    verdicts = [c for c in claims.columns if str(c).startswith("verdict")]
    first = ["claim", *verdicts] if "claim" in claims.columns else verdicts
    ordered = claims[first + [c for c in claims.columns if c not in first]].astype(object)  # "-" in any column
    return ordered.fillna("-").to_markdown(index=False)


def settings_table(config: dict) -> pd.DataFrame:
    """A study's settings, one per row, lists written out; each SMP variant's tau on a row ``tau of SMP-<variant>``
    (in place of the lists of taus and variants)."""
    rows = {key: ", ".join(map(str, value)) if isinstance(value, list) else value
            for key, value in config.items() if key not in ("tau", "variants") and not isinstance(value, dict)}
    rows.update({f"tau of SMP-{variant}": tau for variant, tau in config.get("tau", {}).items()
                 if variant in config.get("variants", config.get("tau", {}))})
    return pd.Series(rows, name="value", dtype=object).to_frame().rename_axis("setting")


# The chapters whose claims the summary judges: their page in the book and what they reproduce.
CHAPTERS = {"toy": ("notebooks/toy", "Section 3.2: NUTS, NUTS-mean and ten SMP variants on a 2-3-2-1 network; "
                    "Tables ex1_scores, ex1_variances, ex1_elapsed and the figures"),
            "mnist": ("notebooks/mnist", "Section 3.3: a MAP LeNet-5 and four SMP variants on MNIST; Tables "
                      "ex2_scores, ex2_variances, ex2_elapsed and the figures")}


def at_a_glance(claims: pd.DataFrame) -> str:
    """The front page's table, as Markdown: per chapter, what it reproduces, the scale its claims are judged at
    and how many of each verdict the register (``claims``) gives."""

    def judged_at(study, scale):  # "(the paper's sizes)": a scale whose settings are the paper's
        sizes = [{k: v for k, v in get_config(study, s).items() if k != "scale"} for s in (scale, "paper")]
        return f"{scale} scale" + (" (the paper's sizes)" if sizes[0] == sizes[1] and scale != "paper" else "")

    rows = []
    for chapter, (page, what) in CHAPTERS.items():
        mine = claims[claims["chapter"] == chapter]
        counts, scales = mine["verdict"].value_counts(), mine["scale"].str.split(",").str[0].unique()
        rows.append({"chapter": f"{{doc}}`{page}`", "what is reproduced": what,
                     "judged at": ", ".join(judged_at(chapter, s) for s in scales),
                     **{w: int(counts.get(w, 0)) for w in WORDS}})
    return pd.DataFrame(rows).to_markdown(index=False)


def start_mismatch(scores: pd.DataFrame, still: str, images: int, tolerance: int = 10) -> str | None:
    """A warning when the row ``still`` (one that barely moves from its start: SMP-none) is more than ``tolerance``
    of the ``images`` test images away from the ``MAP`` row's accuracy: they did not start from the same MAP."""
    ours, theirs = scores.loc[still], scores.loc["MAP"]
    if abs(ours["accuracy"] - theirs["accuracy"]) * images <= tolerance:
        return None
    return (f"The last-layer rows did not start from the MAP of the rows beside them. `{still}`, which barely "
            f"moves from its start (mutual information {ours['mutual_info']:.1e}), has test accuracy "
            f"{ours['accuracy']:.4f} and NLL {ours['nll']:.4f}, against the `MAP` row's {theirs['accuracy']:.4f} and "
            f"{theirs['nll']:.4f}: their recomputation trained the MAP again, on another processor or thread count "
            "than the MAP of the MNIST chapters' committed runs, and got another MAP (the chapter *The reproduction "
            "report* says how). Their leads over the MAP and their verdict `helps under shift` are measured against "
            "the MAP they started from, not the `MAP` row shown (whose ECE sets the bar of `calibrated`), and the "
            "comparison with the whole-network rows mixes two MAPs until the MNIST chapters are recomputed from one.")


def reversals(replicates: pd.Series, leader: str, other: str) -> int:
    """In how many replicates ``other`` is below ``leader`` (``replicates`` indexed by ``(replicate, method)``)."""
    table = replicates.unstack("method")
    return int((table[other] < table[leader]).sum())


def paper_scale_choices(run: Results) -> str:
    """Our two choices in the paper-scale MNIST run, in words: the MAP that starts the chains (rule, candidates,
    choice) and how many validation images the periodic Fisher uses (the paper: all)."""
    config, seed, seeds = run.config, run.values["map_seed"], run.config.get("select_map_from_seeds")
    n_val, n_fisher = config["n_val"], config.get("n_fisher_periodic") or config["n_val"]
    start = f"The chains start from the MAP of seed {seed} (the paper names no seed)."
    if seeds and run.has("map_candidates"):
        losses = ", ".join(f"{int(s)}: {v:.4f}" for s, v in run.table("map_candidates")[["seed", "val_loss"]].values)
        start = (f"The chains start from the MAP of seed {seed}, the lowest validation loss after the last epoch "
                 f"among the seeds {', '.join(map(str, seeds))} ({losses}), a rule fixed before any paper-scale SMP "
                 "run (the paper names no seed).")
    fisher = (f"The periodic Fisher is recomputed on all {n_val:,} validation images, as in the paper."
              if n_fisher >= n_val else f"The periodic Fisher is recomputed on the first {n_fisher:,} of the "
              f"{n_val:,} validation images (the paper: all of them).")
    return f"{start} {fisher}"


def with_paper_scale_rows(beside: pd.DataFrame, run: Results, map_seed: int | None = None) -> pd.DataFrame:
    """The tail chapter's table ``beside`` (rows ``(method, sampler)``) with, under each method, the recursion at
    the paper scale (``run``), labelled with its ``K`` and its MAP's seed where that is not ``map_seed``."""
    columns = {"NLL": "nll", "ECE": "ece", "MI": "mutual_info", "logit variance": "logits_variance",
               "accuracy": "accuracy"}
    ours, seed = run.table("scores").join(run.table("variances")), run.values.get("map_seed")
    label = (f"recursion at the paper scale (K = {run.config['n_steps']:,}"
             + (f", MAP of seed {seed})" if map_seed is not None and seed != map_seed else ")"))
    rows = []
    for method in beside.index.get_level_values("method").unique():
        rows.append(beside.loc[[method]])
        if method in ours.index:
            rows.append(pd.DataFrame([{c: ours.loc[method, col] for c, col in columns.items() if c in beside.columns}],
                                     index=pd.MultiIndex.from_tuples([(method, label)], names=beside.index.names)))
    return pd.concat(rows)


def benchmark(name: str, table: str, index: list[str] | None = None,
              measured: str | None = None) -> pd.DataFrame | None:
    """A benchmark's table ``benchmarks/<name>/<table>.csv``, its heading and machine in ``attrs``; with
    ``measured``, only the rows where that column is a number. ``None`` when the file or every row is missing."""
    file = ROOT / "benchmarks" / name / f"{table}.csv"
    if not file.exists():
        return None
    df = pd.read_csv(file, dtype=str, keep_default_na=False)
    if measured is not None:
        df = df[pd.to_numeric(df[measured], errors="coerce").notna()]
    if df.empty:
        return None
    headings = file.with_name("headings.json")
    headings = json.loads(headings.read_text()) if headings.exists() else {}
    df.attrs["heading"], df.attrs["machine"] = headings.get(table, ""), headings.get("machine", "")
    return df.set_index(index) if index else df


# The data and MAP training that make a MAP of the same seed the same MAP (with the same S: comparable runs).
SAME_MAP = ("n_train", "n_val", "split_seed", "map_batch", "map_epochs", "map_lr", "map_weight_decay")


def paper_scale_gaps(run, paper_scores: pd.DataFrame, seeds=None) -> pd.DataFrame:
    """Per SMP variant, the paper-scale MI (``run``) beside the paper's, their ratio and our largest chain's share;
    where the MAP-seeds chapter's ``seeds`` are comparable (:data:`SAME_MAP`), the sds, gap and growths that the
    MNIST chapter explains."""
    from smp_core.recursion import residual_variance_ratio

    scores, tails = run.table("scores"), run.table("tails")
    methods = [m for m in scores.index if m != "MAP" and m in paper_scores.index]
    ours, theirs = scores.loc[methods, "mutual_info"], paper_scores.loc[methods, "mutual_info"].astype(float)
    table = pd.DataFrame({"paper": theirs, "paper scale": ours, "ratio": ours / theirs.where(theirs != 0),
                          "largest chain's share": tails.loc[methods, "mi_largest_chain_share"]})
    table.index.name = "method"
    if seeds is None or not all(seeds.has(t) for t in ("map_or_stream", "per_run", "maps")) or any(
            seeds.config.get(k) != run.config.get(k) for k in (*SAME_MAP, "n_chains")):
        return table
    spread = seeds.table("map_or_stream")
    for column, name in (("MAP sd", "sd_map"), ("stream sd", "sd_stream")):
        table[column] = [spread[name].get(f"log {m}", np.nan) for m in methods]
    table["gap in sds"] = np.log(table["ratio"]) / (np.sqrt(2) * np.hypot(table["MAP sd"], table["stream sd"]))
    maps, per_run = seeds.table("maps"), seeds.table("per_run")  # indexed by map, (map, replicate)
    same = maps.index[maps["seed"] == run.values.get("map_seed")]
    if len(same) == 1:  # periodic's growth only with as many Fisher images
        runs = per_run.xs(same[0], level="map")
        same_fisher = seeds.config.get("n_fisher_periodic") == run.config.get("n_fisher_periodic")
        table["growth"] = [ours[m] / runs[m].mean() if m in runs.columns and (m != PERIODIC or same_fisher)
                           else np.nan for m in methods]
        n, k_here, k_paper = run.config["n_train"], seeds.config["n_steps"], run.config["n_steps"]
        table["linear growth"] = (1 - residual_variance_ratio(n, k_paper)) / (1 - residual_variance_ratio(n, k_here))
    return table


def _times(x: float) -> str:
    """``x`` to two significant figures, without an exponent, and "times"."""
    if not np.isfinite(x):
        return "not comparable with"
    return f"{np.format_float_positional(float(f'{x:.2g}'), trim='-')} times"


def paper_scale_findings(verdicts: pd.DataFrame, gaps: pd.DataFrame, ours: pd.DataFrame, paper: pd.DataFrame,
                         scale: str, n_chains: int) -> str:
    """What the paper-scale results say, in Markdown: the verdict counts of ``verdicts`` at the paper scale and at
    ``scale`` and those that change, then per SMP variant its accuracy, MI and logit variance (``ours``) against
    the paper's and what ``gaps`` (:func:`paper_scale_gaps`) says, in words set by fixed thresholds."""
    at_paper, here = "verdict (paper scale)", f"verdict ({scale})"
    changed = verdicts[verdicts[at_paper] != verdicts[here]]
    head = (f"Of the {len(verdicts)} claims, at the paper scale {count(verdicts[at_paper])}; at the "
            f"{scale} scale, {count(verdicts[here])}. "
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
        gap, growth, linear, share = (row.get(c, np.nan) for c in ("gap in sds", "growth", "linear growth",
                                                                   "largest chain's share"))
        if np.isfinite(gap):  # within two sds: what another MAP and stream could give
            parts.append(f"{abs(gap):.1f} standard deviations {'below' if gap < 0 else 'above'} the paper's: "
                         + ("within what another MAP and stream could give" if abs(gap) <= 2
                            else "more than another MAP and stream gave at the MAP-seeds chapter's K"))
        if np.isfinite(growth) and np.isfinite(linear):  # faster above twice a fixed Fisher's growth, less below half
            faster = "faster than a fixed Fisher gives" + (
                ": the chains left the region where the MAP's Fisher holds" if method == FIXED else "")
            parts.append(f"it grew {_times(growth)} from the MAP-seeds chapter's K on the same MAP, a fixed Fisher "
                         f"{_times(linear)}: " + (faster if growth > 2 * linear else "less than a fixed Fisher gives"
                                                  if growth < linear / 2 else "about what a fixed Fisher gives"))
        if np.isfinite(share):  # the bulk of the chains below 5 / n_chains, one chain's excursion from 0.25
            parts.append(f"the largest chain carries {share:.0%} of it (an even share: {1 / n_chains:.0%}), "
                         + ("so the bulk of the chains carries it" if share < 5 / n_chains else
                            "a sizeable share for one chain" if share < 0.25 else
                            "so much of it is one chain's excursion"))
        bullets.append(f"- {method}: " + "; ".join(parts) + ".")
    return "\n".join([head, "", *bullets])


# The MNIST chapter's runs on periodic-diag alone (its parameters variants and fisher_images), at the laptop scale.
FISHER_IMAGES = (500, 1000, 6000)
FISHER_SHOWN = ("mutual_info", "epistemic_std", "logits_variance", "accuracy", "nll", "ece")


def _periodic_run(images: int, root=None) -> Results | None:
    """The MNIST chapter's laptop run on periodic-diag alone with its Fisher on ``images`` images, if committed."""
    from .pipeline import folder_of, results

    params, root = {"variants": [PERIODIC], "fisher_images": images}, root or RESULTS
    exists = (folder_of("mnist", "laptop", params, root) / "manifest.json").exists()
    return results("mnist", "laptop", params, root=root) if exists else None  # a note if its code is older


def fisher_images(root=None, paper_run: Results | None = None) -> pd.DataFrame | None:
    """SMP-periodic-diag at the laptop scale per committed count of Fisher images (mean ± sd over replicates),
    then the paper-scale run's and the paper's, each with its MAP's accuracy; ``None`` before any such run."""

    def row(table: pd.DataFrame, std: pd.DataFrame | None = None) -> dict[str, str]:
        cells = {c: f"{table.loc[PERIODIC, c]:.4g}" + ("" if std is None else f" ± {std.loc[PERIODIC, c]:.2g}")
                 for c in FISHER_SHOWN}
        return {**cells, "MAP accuracy": f"{table.loc['MAP', 'accuracy']:.4f}"}

    rows = {}
    for n in FISHER_IMAGES:
        if (res := _periodic_run(n, root)) is not None:
            rows[f"{n:,}"] = row(*(res.table(f"scores_{s}").join(res.table(f"variances_{s}")) for s in ("mean", "std")))
    if not rows:
        return None
    if paper_run is not None:
        images = paper_run.config.get("n_fisher_periodic") or paper_run.config["n_val"]
        rows[f"{images:,}, K = 10^6 (ours)"] = row(paper_run.table("scores").join(paper_run.table("variances")))
    rows["6,000, K = 10^6 (the paper)"] = row(paper_table("ex2_scores").join(paper_table("ex2_variances")))
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("images")


def fisher_images_in_words(root=None, ours: int = 1000, theirs: int = 6000,
                           paper_run: Results | None = None) -> str | None:
    """In words, periodic's MI and epistemic std with its Fisher on ``theirs`` images over ``ours``, per paired
    replicate of the laptop runs, and which way that moves ``paper_run``'s MI against the paper's. ``None`` until
    both runs are committed."""
    runs = [_periodic_run(n, root) for n in (ours, theirs)]
    if any(run is None for run in runs):
        return None
    low, high = (run.table("scores_replicates").xs(PERIODIC, level="method") for run in runs)
    ratios = {metric: high[metric] / low[metric] for metric in ("mutual_info", "epistemic_std")}
    parts = [f"{label} by {ratios[m].mean():.2f} (replicates {', '.join(f'{r:.2f}' for r in ratios[m])})"
             for m, label in (("mutual_info", "mutual information"), ("epistemic_std", "epistemic std"))]
    words = (f"At the `laptop` scale ($K = 10^4$, {len(ratios['mutual_info'])} paired replicates), a Fisher on "
             f"{theirs:,} images in place of {ours:,} multiplies SMP-periodic-diag's " + " and its ".join(parts) + ".")
    if paper_run is None:
        return words
    gap = (paper_run.table("scores").loc[PERIODIC, "mutual_info"]
           / paper_table("ex2_scores").loc[PERIODIC, "mutual_info"])
    toward = (ratios["mutual_info"].mean() > 1) == (gap < 1)
    verdict = ("it may account for part of the gap (whether the factor holds at $K = 10^6$ is not measured)"
               if toward else "the image count widens the gap rather than explaining it (at $K = 10^4$; $K = 10^6$ "
               "is not measured)")
    return words + (f" The paper-scale run's mutual information is {gap:.2f} times the paper's; the paper's image "
                    f"count moves it {'toward' if toward else 'away from'} the paper's at this scale, so {verdict}.")


TURING_REPLICATES = 15  # the toy chapter's run with the paper's NUTS start (nuts_start "uniform")
TURING_SHOWN = (("NUTS", "accuracy"), ("NUTS-mean", "accuracy"), ("SMP-none", "mutual_info"),
                ("SMP-fixed-dense", "accuracy"), ("SMP-ema-block", "mutual_info"))


def nuts_start_replicates(run: Results) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The toy chapter's run with the paper's NUTS start, per replicate below the paper's row; and per number, how
    many replicates land near the paper's (accuracy within 0.01, MI within 25 %), with our range."""
    scores, paper = run.table("scores_replicates"), paper_table("ex1_scores")
    table = pd.DataFrame({f"{m} {c}": scores[c].xs(m, level="method") for m, c in TURING_SHOWN})
    table.index = [f"replicate {r}" for r in table.index]
    theirs = pd.Series({f"{m} {c}": float(paper.loc[m, c]) for m, c in TURING_SHOWN})
    tolerance = pd.Series({f"{m} {c}": 0.01 if c == "accuracy" else 0.25 * theirs[f"{m} {c}"] for m, c in TURING_SHOWN})
    near = (table - theirs).abs() <= tolerance
    shares = pd.DataFrame({"the paper": theirs, "replicates near it": near.sum().astype(int).astype(str)
                           + f" of {len(table)}", "ours: min": table.min(), "ours: max": table.max()})
    return pd.concat([theirs.to_frame("the paper").T, table]), shares


STREAM_SHOWN = ("accuracy", "nll", "ece", "mutual_info", "epistemic_std", "logits_variance")


def over_streams(runs: list[dict[str, pd.DataFrame]], name: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Mean and sd over the streams ``runs`` of table ``name`` per method (sd NaN with fewer than two streams)."""
    long = pd.concat({j: run[name] for j, run in enumerate(runs) if name in run}, names=["stream"])
    grouped = long.groupby(level="method", sort=False)
    return grouped.mean(), grouped.std(ddof=1)


def stream_table(runs: list[dict[str, pd.DataFrame]]) -> pd.DataFrame:
    """The streams ``runs`` one by one: a row per method and stream, the columns :data:`STREAM_SHOWN`."""
    joined = pd.concat({j: run["scores"].join(run["variances"]) for j, run in enumerate(runs)}, names=["stream"])
    methods = list(dict.fromkeys(joined.index.get_level_values("method")))
    return joined.swaplevel().loc[methods, list(STREAM_SHOWN)]


def streams_in_words(runs: list[dict[str, pd.DataFrame]]) -> str:
    """How many streams each SMP variant has: ``"two streams of SMP-fixed-diag and SMP-ema-diag, one stream of
    SMP-none and SMP-periodic-diag"`` (``"no stream yet"`` for none)."""
    counts = pd.Series([m for run in runs for m in run["scores"].index if m != "MAP"]).value_counts(sort=False)
    words, parts = {1: "one", 2: "two", 3: "three", 4: "four"}, []
    for n in sorted(set(counts), reverse=True):
        names = list(counts.index[counts == n])
        listed = ", ".join(names[:-1]) + " and " * (len(names) > 1) + names[-1]
        parts.append(f"{words.get(n, n)} stream{'s' * (n != 1)} of {listed}")
    return ", ".join(parts) or "no stream yet"


def timings(scale: str, root: str | Path = RESULTS) -> pd.DataFrame:
    """Wall time, machine and load note of every study's results at ``scale``, from their manifests."""
    from .pipeline import STUDIES

    rows = []
    for study in STUDIES:
        if (file := Path(root) / scale / study / "manifest.json").exists():
            manifest = json.loads(file.read_text())
            env = manifest.get("environment", {})
            rows.append({"chapter": study, "minutes": round(manifest["wall_time_s"] / 60, 1),
                         "device": env.get("device", ""), "threads": env.get("torch_threads", ""),
                         "note": manifest.get("timing_note", "")})
    return pd.DataFrame(rows, columns=["chapter", "minutes", "device", "threads", "note"]).set_index("chapter")


def seed_reports(scale: str, root: str | Path = RESULTS) -> dict[int, tuple[pd.DataFrame, pd.DataFrame]]:
    """The reports of the reruns on other random streams (``--seed-offset``), by offset."""
    from .reproduce import read_report

    found = {int(f.name.rsplit("-", 1)[1]): read_report(scale, root, f.name)
             for f in sorted((Path(root) / scale).glob("reproduction-seed-*"))}
    return {offset: report for offset, report in found.items() if report is not None}


def _n(count: int, one: str, many: str | None = None) -> str:
    """``"1 chapter"``, ``"2,000 chapters"``."""
    return f"{count:,} {one if count == 1 else many or one + 's'}"


def _names(index) -> str:
    return ", ".join(index) if len(index) else "none"


REPORT_VERDICTS = ["equal", "within", "outside", "differs", "changed"]


def report_in_words(counts: pd.DataFrame, runs: pd.DataFrame, scale: str) -> tuple[str, pd.DataFrame]:
    """What a reproduction report compared and how it came out (``read_report``'s counts and runs): sentences
    for its page, and one table per chapter. A chapter the runs do not describe is *unknown*, never *same*."""
    number = counts.reindex(columns=REPORT_VERDICTS, fill_value=0)
    runs = runs.set_index("study").reindex(number.index)
    status = runs.reindex(columns=["code", "settings", "seeds"]).fillna("unknown")
    chapters = len(number)
    words = [f"The report compares the committed results of {_n(chapters, 'chapter')} with a rerun."]
    for column, what in (("seeds", "other seeds"), ("code", "a change in their code"),
                         ("settings", "changed settings")):
        moved = status.index[status[column] == "changed"]
        words.append(f"None was rerun with {what}." if not len(moved) else f"Every one was rerun with {what}."
                     if len(moved) == chapters else f"{len(moved)} of them {'was' if len(moved) == 1 else 'were'} "
                     f"rerun with {what} ({_names(moved)}).")
    unknown = status.index[(status == "unknown").any(axis=1)]
    if len(unknown):
        words.append(f"The report does not record what differs between the two runs of {_names(unknown)}.")
    known = runs.dropna(subset=["committed threads", "new threads"])
    if len(known):
        threads = (known["committed threads"].astype(int).astype(str) + " then "
                   + known["new threads"].astype(int).astype(str))
        words.append("Torch threads, committed run then rerun: " + "; ".join(
            f"{t} for {_names(threads.index[threads == t])}" for t in sorted(set(threads))) + ".")
        machines = sorted(set(known["committed machine"]) | set(known["new machine"]))
        words.append(f"The runs were on machines reporting {' or '.join(machines)} (the same report can name "
                     "different machines).")
    judged, outside = int(number["within"].sum() + number["outside"].sum()), int(number["outside"].sum())
    compared = int(number[["equal", "within", "outside", "differs"]].to_numpy().sum())
    equal = int(number["equal"].sum())
    words.append(
        f"Of {_n(compared, 'number')} compared, {equal:,} {'is' if equal == 1 else 'are'} equal; {judged:,} moved "
        f"and {'was' if judged == 1 else 'were'} judged against the spread of their replicates, "
        f"{outside:,} of them outside it (about {ALPHA * judged:.1f} would be by chance alone); "
        f"{int(number['differs'].sum()):,} moved without a spread to judge them by; "
        f"{_n(int(number['changed'].sum()), 'verdict or flag', 'verdicts or flags')} changed. The git revisions of "
        f"both runs of each chapter are in `results/{scale}/reproduction/runs.csv` (*added*: the rerun records "
        "settings the committed run did not, with the same values for the others).")
    table = pd.concat([status, number.rename(columns={"differs": "moved, no spread", "changed": "verdicts changed"})],
                      axis=1).rename_axis("chapter")
    return " ".join(words), table


def other_maps(cells: pd.DataFrame) -> list[str]:
    """The MNIST-based chapters of a report (``mnist*``, ``last_layer``) whose ``MAP`` row's own accuracy or NLL
    moved: their two runs started from different MAPs. (A chapter can start elsewhere than the MAP row it shows, as
    the last-layer check ``start_mismatch`` says; this sees only the row.)"""
    mnist = cells["study"].str.startswith("mnist") | (cells["study"] == "last_layer")
    at_map = cells[mnist & (cells["row"].astype(str) == "MAP") & cells["column"].isin(["accuracy", "nll"])]
    return list(dict.fromkeys(at_map.loc[at_map["verdict"].isin(["differs", "within", "outside"]), "study"]))


def over_maps_in_words(cells: pd.DataFrame, scale: str, root: str | Path = RESULTS) -> tuple[str, pd.DataFrame]:
    """The MNIST cells of a report that moved, judged against the spread over MAPs
    (:func:`smp_book.judge.judge_by_map_seeds`): a sentence, and the cells outside that spread."""
    if not (Path(root) / scale / "mnist_seeds" / "manifest.json").exists():
        return f"No MAP-seeds results lie with `results/{scale}/` to judge them over MAPs.", pd.DataFrame()
    by_maps = judge_by_map_seeds(cells, scale, root)
    verdicts = by_maps["verdict"].value_counts()
    within, out, bare = (int(verdicts.get(v, 0)) for v in ("within", "outside", "differs"))
    lead = ("The spread that includes the MAP's is measured in {doc}`mnist_seeds`: the mean of the SMP replicates "
            f"from each of {int(by_maps['n_maps'].max()) if len(by_maps) else 0} MAPs, same settings. ")
    if within + out == 0:
        return lead + "None of the MNIST chapter's mean scores and variances that moved could be judged by it.", \
            pd.DataFrame()
    text = (lead + f"Against it (Student's t on the difference of two such means, level {ALPHA:g}), of the "
            f"{within + out} mean scores and variances of the MNIST chapter that moved and have that spread, "
            f"{within} {'lies' if within == 1 else 'lie'} within it and {out} outside it (about "
            f"{ALPHA * (within + out):.1f} would by chance alone)"
            + (f"; {bare} moved where the MAPs' spread is zero or missing" if bare else "")
            + (", so the two MNIST runs agree once the MAP's own variation is counted." if out == 0 else ":"))
    return text, by_maps[by_maps["verdict"] == "outside"][["table", "row", "column", "committed", "new", "p"]]
