"""Tables for the chapters' pages: our numbers beside the paper's and beside other scales, rounded for a reader."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd

from .results import ROOT, Results


def with_spread(mean: pd.DataFrame, std: pd.DataFrame, digits: int = 4) -> pd.DataFrame:
    """Each cell as ``mean ± sd`` over the replicates (no spread where the sd is NaN, as with one
    replicate), and "-" where a method has no value."""

    return beside_paper(mean, pd.DataFrame(), std, digits).droplevel(1, axis=1)


def beside_scales(paper: pd.DataFrame, scaled: dict[str, tuple[pd.DataFrame, pd.DataFrame | None]],
                  digits: int = 4) -> pd.DataFrame:
    """The paper's table beside ours at several scales, per column: ``(column, "paper")`` then
    ``(column, <scale>)`` for each ``scaled[<scale>] = (mean, std)`` (``std`` None or NaN: no spread shown),
    rows and columns those of the first scale's mean. A cell without a value shows "-"."""

    if not scaled:
        raise ValueError("scaled: give at least one scale's (mean, std)")
    first = next(iter(scaled.values()))[0]
    rows = first.index
    theirs = beside_paper(first, paper, None, digits)  # its (column, "paper") cells, formatted as everywhere
    parts = {name: beside_paper(mean.reindex(rows), pd.DataFrame(), None if std is None else std.reindex(rows),
                                digits).droplevel(1, axis=1) for name, (mean, std) in scaled.items()}
    cols = {}
    for column in first.columns:
        if (column, "paper") in theirs.columns:
            cols[(column, "paper")] = theirs[(column, "paper")]
        for name, part in parts.items():
            cols[(column, name)] = part[column] if column in part.columns else "-"
    return pd.DataFrame(cols, index=rows)


def ratio_to_paper(ours: pd.DataFrame, paper: pd.DataFrame) -> pd.DataFrame:
    """Each of our cells over the paper's, on the rows and columns both tables have (``ours``' order):
    1 is the paper's number. NaN where either is missing or the paper's is 0."""
    rows = [r for r in ours.index if r in paper.index]
    columns = [c for c in ours.columns if c in paper.columns]
    theirs = paper.loc[rows, columns].astype(float)
    return ours.loc[rows, columns].astype(float) / theirs.where(theirs != 0)


def paper_scale_choices(run: Results) -> str:
    """The two settings of ours in an MNIST run at the paper scale (``run``: its :class:`Results`), in
    words from its manifest and values: which MAP starts the chains (the rule, the candidates' validation
    losses and the one chosen) and how many validation images the periodic Fisher uses (the paper: all)."""
    config, values = run.config, run.values
    n_val, n_fisher = config["n_val"], config.get("n_fisher_periodic") or config["n_val"]
    seeds = config.get("select_map_from_seeds")
    if seeds and run.has("map_candidates"):
        candidates = run.table("map_candidates")
        losses = ", ".join(f"{int(s)}: {v:.4f}" for s, v in zip(candidates["seed"], candidates["val_loss"],
                                                                    strict=True))
        start = (f"The chains start from the MAP of seed {values['map_seed']}, the lowest validation loss after "
                 f"the last epoch among the seeds {', '.join(map(str, seeds))} ({losses}), a rule fixed before "
                 "any paper-scale SMP run (the paper names no seed).")
    else:
        start = f"The chains start from the MAP of seed {values['map_seed']} (the paper names no seed)."
    fisher = ("The periodic Fisher is recomputed on all "
              f"{n_val:,} validation images, as in the paper." if n_fisher >= n_val else
              f"The periodic Fisher is recomputed on the first {n_fisher:,} of the {n_val:,} validation images "
              "(the paper: all of them).")
    return f"{start} {fisher}"


def with_paper_scale_rows(beside: pd.DataFrame, run: Results, map_seed: int | None = None) -> pd.DataFrame:
    """The tail chapter's table ``beside`` (rows ``(method, sampler)``; columns NLL, ECE, MI, logit
    variance, accuracy) with one more row per method: the recursion itself at the paper scale (``run``,
    the MNIST chapter's results there: its first replicate, as the tail's runs are), labelled with its
    ``K`` and, when it started from another MAP than the tail's (``map_seed``), with its MAP's seed."""
    columns = {"NLL": ("scores", "nll"), "ECE": ("scores", "ece"), "MI": ("scores", "mutual_info"),
               "logit variance": ("variances", "logits_variance"), "accuracy": ("scores", "accuracy")}
    tables = {name: run.table(name) for name in {t for t, _ in columns.values()}}
    other_map = map_seed is not None and run.values.get("map_seed") != map_seed
    label = (f"recursion at the paper scale (K = {run.config['n_steps']:,}"
             + (f", MAP of seed {run.values.get('map_seed')})" if other_map else ")"))
    rows = []
    for method in beside.index.get_level_values("method").unique():
        rows.append(beside.loc[[method]])
        if method in tables["scores"].index:
            cells = {c: tables[t].loc[method, col] for c, (t, col) in columns.items() if c in beside.columns}
            rows.append(pd.DataFrame([cells], index=pd.MultiIndex.from_tuples([(method, label)],
                                                                               names=beside.index.names)))
    return pd.concat(rows)


def shown(df: pd.DataFrame, digits: int = 3, significant: bool = False) -> pd.DataFrame:
    """``df`` for display: floats rounded to ``digits`` decimals (``significant=True``: to ``digits``
    significant digits), yes/no for booleans, and missing cells (in the index and the column labels too)
    as ``-``."""
    import math

    import numpy as np

    def cell(v):
        if isinstance(v, bool | np.bool_):
            return "yes" if v else "no"
        if isinstance(v, float | np.floating):
            return "-" if math.isnan(v) else (f"{v:.{digits}g}" if significant else round(float(v), digits))
        return "-" if v is None or (isinstance(v, str) and v == "") else v

    def label(v):
        return "-" if isinstance(v, float | np.floating) and math.isnan(v) else v

    out = df.map(cell)
    if isinstance(out.index, pd.MultiIndex):
        out.index = pd.MultiIndex.from_tuples([tuple(label(v) for v in key) for key in out.index],
                                              names=out.index.names)
    else:
        out.index = pd.Index([label(v) for v in out.index], name=out.index.name)
    if not isinstance(out.columns, pd.MultiIndex):
        out.columns = [label(c) for c in out.columns]
    return out


def benchmark(name: str, table: str, index: list[str] | None = None,
              measured: str | None = None) -> pd.DataFrame | None:
    """A benchmark's saved table, ``benchmarks/<name>/<table>.csv`` (written by the script's ``--csv``), with
    its heading line in ``attrs["heading"]``; with ``measured``, only the rows whose ``measured`` column is a
    number (a run left out of a budget says so in words). ``None`` when the file or every row is missing."""
    folder = ROOT / "benchmarks" / name
    if not (folder / f"{table}.csv").exists():
        return None
    df = pd.read_csv(folder / f"{table}.csv", dtype=str, keep_default_na=False)
    if measured is not None:
        df = df[pd.to_numeric(df[measured], errors="coerce").notna()]
    if df.empty:
        return None
    headings = folder / "headings.json"
    df.attrs["heading"] = json.loads(headings.read_text()).get(table, "") if headings.exists() else ""
    return df.set_index(index) if index else df


def gpu_estimate(scaling: pd.DataFrame, steps: pd.DataFrame) -> str | None:
    """How one GPU's SMP-fixed-diag step with CUDA graphs (``steps``: ``bench_mnist.py``'s step table on a
    GPU, indexed by device, variant and what ran the step, its heading naming S) compares with the most
    processes of ``scaling`` (``bench_scaling.py``, the same variant on this CPU): a sentence, an estimate
    from the two tables and labelled so; ``None`` when a row it needs is missing."""
    found = re.search(r"S = (\d+)", steps.attrs.get("heading", ""))
    try:
        graphs, eager = (float(steps.loc[("cuda", "SMP-fixed-diag", mode), "ms / step"])
                         for mode in ("CUDA graphs", "batched torch, one by one"))
    except (KeyError, ValueError):
        return None
    cpu = float(scaling["chain-steps / s"].iloc[-1])
    if found is None:
        return None
    gpu = int(found.group(1)) / (graphs / 1000)
    return (f"An estimate from these tables and `benchmarks/gpu_h200/`, not a run: with CUDA graphs one H200 "
            f"steps {found.group(1)} chains of SMP-fixed-diag in {graphs} ms, {gpu:,.0f} chain-steps per second, "
            f"{gpu / cpu:.0f} times the {scaling.index[-1]} processes here. Without the graphs, which take away "
            f"the overhead of launching each kernel, the step takes {eager} ms ({eager / graphs:.1f} times as "
            "long): it is bound by launches more than by arithmetic, so we expect that splitting these chains "
            "over more GPUs would shorten a run little, and that more GPUs pay for more chains or a larger network.")


def claims_table(claims: pd.DataFrame) -> str:
    """A claims table as Markdown for the page, each verdict right after its claim (then the criterion and the
    evidence), missing cells as ``-``."""
    verdicts = [c for c in claims.columns if str(c).startswith("verdict")]
    first = ["claim", *verdicts] if "claim" in claims.columns else verdicts
    ordered = claims[first + [c for c in claims.columns if c not in first]]
    return ordered.fillna("-").to_markdown(index=False)


# The chapters whose claims the summary judges: their page in the book and what they reproduce.
CHAPTERS = {"toy": ("notebooks/toy", "Section 3.2: NUTS, NUTS-mean and ten SMP variants on a 2-3-2-1 network; "
                    "Tables ex1_scores, ex1_variances, ex1_elapsed and the figures"),
            "mnist": ("notebooks/mnist", "Section 3.3: a MAP LeNet-5 and four SMP variants on MNIST; Tables "
                      "ex2_scores, ex2_variances, ex2_elapsed and the figures")}


def _scale_words(study: str, scale: str) -> str:
    from .config import get_config

    same = {k: v for k, v in get_config(study, scale).items() if k != "scale"} == {
        k: v for k, v in get_config(study, "paper").items() if k != "scale"}
    return f"{scale} scale" + (" (the paper's sizes)" if same and scale != "paper" else "")


def at_a_glance(summary: Results) -> str:
    """The front page's table, as Markdown: per chapter of the paper, what it reproduces, at which scale its
    claims are judged and how many hold, hold in part or do not (from the summary's claims table)."""
    claims = summary.table("claims")
    rows = []
    for chapter, (page, what) in CHAPTERS.items():
        mine = claims[claims["chapter"].str.split(",").str[0] == chapter]  # a claim's first chapter judges it
        counts = mine["verdict"].value_counts()
        others = len(mine) - counts.reindex(["holds", "partly", "does not hold"], fill_value=0).sum()
        rows.append({"chapter": f"{{doc}}`{page}`", "what is reproduced": what,
                     "judged at": ", ".join(_scale_words(chapter, s) for s in mine["scale"].unique()),
                     "claims hold": counts.get("holds", 0), "partly": counts.get("partly", 0),
                     "do not": counts.get("does not hold", 0), **({"other": others} if others else {})})
    return pd.DataFrame(rows).fillna(0).to_markdown(index=False)


def settings_table(config: dict) -> pd.DataFrame:
    """A study's settings for the page, one per row: each SMP variant's tau on a row of its own
    (``tau of SMP-<variant>``), lists written out, the variants' list left out (their tau rows name them)."""
    rows = {key: ", ".join(map(str, value)) if isinstance(value, list) else value
            for key, value in config.items() if key not in ("tau", "variants") and not isinstance(value, dict)}
    rows.update({f"tau of SMP-{variant}": tau for variant, tau in config.get("tau", {}).items()
                 if variant in config.get("variants", config.get("tau", {}))})
    return pd.Series(rows, name="value", dtype=object).to_frame().rename_axis("setting")


def beside_paper(ours: pd.DataFrame, paper: pd.DataFrame, std: pd.DataFrame | None = None,
                 digits: int = 4) -> pd.DataFrame:
    """One table with, per column, the paper's number and ours (mean ± sd over replicates if given;
    a NaN sd, as with one replicate, shows no spread)."""
    cols = {}
    for c in ours.columns:
        if c in paper.columns:
            cols[(c, "paper")] = paper[c].reindex(ours.index).map(lambda v: "-" if np.isnan(v) else f"{v:.{digits}f}")
        mine = ours[c].map(lambda v: "-" if np.isnan(v) else f"{v:.{digits}f}")
        if std is not None:  # no spread to show where it is NaN (one replicate, or a row without values)
            mine = mine + std[c].reindex(ours.index).map(lambda v: "" if np.isnan(v) else f" ± {v:.{digits}f}")
        cols[(c, "ours")] = mine
    return pd.DataFrame(cols, index=ours.index)
