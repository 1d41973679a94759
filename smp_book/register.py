"""The register of the paper's claims, judged from the committed results.

``claims.toml`` (beside this module) states each claim once: its section of the paper, the chapter that shows it, the
study and scale whose results judge it, the criterion and why its thresholds are what they are. This module judges
every claim from those results files, so that a chapter or the summary shows the register's verdict (:func:`table`)
and never one of its own, and a rerun cannot leave a verdict stale.

A criterion is a few conditions, each a *margin* per run (positive where the condition holds in that run, the runs
being the scale's replicates or streams). A condition is resolved against the spread of its runs:

- three runs or more: ``z = mean / sd`` of the margins, true at ``z >= 2``, false at ``z <= -2``;
- two runs (two streams at the paper's scale): true if it holds in both and the smaller margin exceeds the
  difference between them, false likewise with the signs turned, else not resolved;
- one run: not resolved (there is no spread to judge the margin against);
- an exact quantity (a formula, with no random error): by the sign of its margin.

The verdict: *holds* if every condition is true; *partly* if some are true and some false; *does not hold* if some
are false and none is true (a criterion is a conjunction: one part that fails outside the spread decides that the
claim as stated fails, whatever the unresolved parts would show); *not resolved* if no condition is false and one is
unresolved; *not judged* where the register names no admissible evidence (the reason is the evidence).
"""

from __future__ import annotations

import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from .config import MNIST_VARIANTS
from .results import RESULTS, Results

REGISTER = Path(__file__).with_name("claims.toml")
WORDS = ("holds", "partly", "does not hold", "not resolved", "not judged")
FIELDS = ("id", "section", "chapter", "study", "scale", "claim", "criterion", "thresholds")
Z = 2.0
DIAGONAL = tuple(f"SMP-{v}" for v in MNIST_VARIANTS if v != "none")  # as mnist_runs.DIAGONAL_METHODS
FIXED, EMA, PERIODIC = DIAGONAL


@dataclass
class Condition:
    """One condition of a criterion: its margin in each run (positive where it holds)."""

    name: str
    margins: list[float]
    exact: bool = False  # a formula: no run-to-run spread


def resolve(condition: Condition) -> bool | None:
    """True, False, or None (not resolved), by the rules of the module's docstring."""
    m = np.asarray(condition.margins, dtype=np.float64)
    if m.size == 0 or not np.isfinite(m).all():
        return None
    if condition.exact or (m.size > 2 and m.std(ddof=1) == 0):  # no spread: the sign decides
        return bool(m[0] > 0) if m[0] != 0 else None
    if m.size < 3:  # two runs on one side of 0, each further from it than from the other
        one_side = m.size == 2 and ((m > 0).all() or (m < 0).all())
        return bool(m[0] > 0) if one_side and np.abs(m).min() > abs(m[0] - m[1]) else None
    z = m.mean() / m.std(ddof=1)
    return True if z >= Z else False if z <= -Z else None


def verdict(conditions: list[Condition]) -> str:
    """The verdict word of a criterion's conditions."""
    flags = [resolve(c) for c in conditions]
    if not flags:
        return "not judged"
    if all(f is True for f in flags):
        return "holds"
    if False in flags:
        return "partly" if True in flags else "does not hold"
    return "not resolved"


def count(verdicts) -> str:
    """``"3 hold, 1 partly, 2 not resolved"``: how many verdicts of each word, in the register's order."""
    counts, plural = Counter(verdicts), {"holds": "hold", "does not hold": "do not hold"}
    return ", ".join(f"{counts[w]} {w if counts[w] == 1 else plural.get(w, w)}" for w in WORDS if counts[w]) or "none"


@dataclass
class Evidence:
    """What a judge reads: the runs of the claim's study and scale (each a dict of tables indexed by method:
    ``scores``, ``variances``, ``elapsed``), the study's results, and where it is the paper scale's MNIST,
    the streams beyond the first."""

    results: Results
    runs: list[dict[str, pd.DataFrame]]
    root: Path = RESULTS

    def margins(self, fn, *methods: str) -> list[float]:
        """``fn(run)`` in every run that has all of ``methods`` in its scores."""
        return [float(fn(r)) for r in self.runs if all(m in r["scores"].index for m in methods)]

    def describe(self, label: str, fn, *methods: str, digits: int = 4) -> str:
        """``label mean ± sd`` of ``fn`` over the runs that have ``methods`` (no sd from one run)."""
        x = np.asarray(self.margins(fn, *methods))
        if x.size == 0:
            return f"{label} -"
        spread = f" ± {x.std(ddof=1):.{digits}g}" if x.size > 1 else ""
        return f"{label} {x.mean():.{digits}g}{spread}"

    def cond(self, name: str, fn, *methods: str) -> Condition:
        """The condition whose margin in a run is ``fn(run)``, in the runs that have ``methods``."""
        return Condition(name, self.margins(fn, *methods))

    def show(self, methods, *columns: str) -> str:
        """``describe`` of each of ``columns`` for each of ``methods``."""
        return "; ".join(self.describe(f"{m} {c}", lambda r, m=m, c=c: _at(r, m, c), m)
                         for c in columns for m in methods)


def _replicates(res: Results) -> list[dict[str, pd.DataFrame]]:
    runs: dict[int, dict[str, pd.DataFrame]] = {}
    for name in ("scores", "variances", "elapsed"):
        if res.has(f"{name}_replicates"):
            for r, part in res.table(f"{name}_replicates").groupby(level=0):
                runs.setdefault(int(r), {})[name] = part.droplevel(0)
    return [runs[r] for r in sorted(runs)]


def _paper_streams(res: Results, root: Path) -> list[dict[str, pd.DataFrame]]:
    """Stream 0 is the committed run; stream j its chains 100 j onwards (``smp_book.paper_streams``), one
    folder per variant, with the MAP it started from where that MAP's scores were saved."""
    runs = _replicates(res)[:1]
    base = root / "paper" / "mnist_streams"
    for j in range(1, 100):
        parts = [Results(f) for f in sorted(base.glob(f"*/stream_{j}")) if (f / "manifest.json").exists()]
        if not parts:
            break
        for p in parts:
            if not (p.has("scores") and p.has("variances")):
                raise ValueError(f"{p.folder}: its manifest lists no scores and variances tables (a stream written "
                                 "before smp_book.paper_streams.save recorded them); add their layout to it")
        run = {name: pd.concat([p.table(name) for p in parts]) for name in ("scores", "variances")}
        if (base / "map_scores.csv").exists():
            run["scores"] = pd.concat([pd.read_csv(base / "map_scores.csv", index_col=0), run["scores"]])
        runs.append(run)
    return runs


def evidence(res: Results, root: Path = RESULTS) -> Evidence:
    """The runs of ``res``: the paper scale's MNIST streams where it is that folder, else its replicates."""
    streams = res.folder.resolve() == (Path(root) / "paper" / "mnist").resolve()
    return Evidence(res, _paper_streams(res, Path(root)) if streams else _replicates(res), Path(root))


JUDGES = {}


def judge(claim_id: str):
    """Register the decorated function as the judge of ``claim_id``: ``ev -> (conditions or None, evidence)``."""
    def register(fn):
        JUDGES[claim_id] = fn
        return fn
    return register


def load(path: Path = REGISTER) -> list[dict]:
    """The register's claims, checked: every field present, ids unique, each with a judge."""
    claims = tomllib.loads(Path(path).read_text())["claim"]
    seen = set()
    for c in claims:
        missing = [f for f in FIELDS if not c.get(f)]
        if missing:
            raise ValueError(f"{path}: claim {c.get('id', '?')!r} lacks {', '.join(missing)}")
        if c["id"] in seen or c["id"] not in JUDGES:
            raise ValueError(f"{path}: claim id {c['id']!r} is " + ("repeated" if c["id"] in seen else "unjudged"))
        seen.add(c["id"])
    return claims


def table(chapter: str | None = None, run: Results | None = None, root: Path = RESULTS,
          path: Path = REGISTER) -> pd.DataFrame:
    """Every claim of the register (or those ``chapter`` shows): section, claim, verdict, criterion, evidence,
    the scale that judged it and the chapter; a claim whose results are not there is "not judged". With
    ``run``, the results of a chapter run at another scale or with other parameters, a column ``this run``
    gives the verdicts the same criteria give there, for comparison: the register's verdict stays its scale's."""
    rows, cache = [], {}
    here = evidence(run, root) if run is not None else None
    for c in load(path):
        if chapter is not None and c["chapter"] != chapter:
            continue
        key = (c["study"], c["scale"])
        try:
            if key not in cache:
                cache[key] = evidence(Results(Path(root) / c["scale"] / c["study"]), root)
            conditions, text = JUDGES[c["id"]](cache[key])  # conditions None: no admissible evidence
            word = verdict(conditions or [])
            n = len(cache[key].runs)
            scale = f"{c['scale']}, {n} " + ("stream" if key == ("mnist", "paper") else "replicate") + "s" * (n != 1)
        except FileNotFoundError as e:
            word, text, scale = "not judged", f"no results: {e}", c["scale"]
        rows.append({"id": c["id"], "section": c["section"], "claim": c["claim"], "verdict": word,
                     "criterion": c["criterion"], "evidence": text, "scale": scale, "chapter": c["chapter"],
                     **({"this run": verdict(JUDGES[c["id"]](here)[0] or [])} if here is not None else {})})
    return pd.DataFrame(rows).set_index("id")


# --- the judges: one per claim of the register -------------------------------------------------------------------

WORSE = {"accuracy": -1, "brier": 1, "nll": 1, "ece": 1}  # the sign of getting worse: a lower accuracy, higher else


def _at(r, m: str, c: str) -> float:
    """Method ``m``'s ``c`` in run ``r``: from its variances for a ``*_variance``, else from its scores."""
    return r["variances" if c.endswith("_variance") else "scores"].loc[m, c]


def _minus(a: str, b: str, c: str, k: float = 1):
    """The margin ``a``'s ``c`` minus ``k`` times ``b``'s, as a function of a run."""
    return lambda r: _at(r, a, c) - k * _at(r, b, c)


def _close(ev: Evidence, m: str, ref: str, tolerances: dict[str, float]):
    """``m`` within each column's tolerance of ``ref``: the conditions and the differences."""
    return ([ev.cond(f"{c} within {t}", lambda r, c=c, t=t: t - abs(_minus(m, ref, c)(r)), m, ref)
             for c, t in tolerances.items()],
            "; ".join(ev.describe(f"{c} {m} - {ref}", _minus(m, ref, c), m, ref) for c in tolerances))


def _variances(ev: Evidence, m: str, factor: float):
    """``m``'s parameter variance below ``factor`` times NUTS's, its logit variance above NUTS's."""
    return ([ev.cond("params", lambda r: factor * _at(r, "NUTS", "params_variance") - _at(r, m, "params_variance"), m),
             ev.cond("logits", _minus(m, "NUTS", "logits_variance"), m)],
            ev.show((m, "NUTS"), "params_variance", "logits_variance"))


TOY_DIAGONAL, TOY_DENSE = ("SMP-fixed-diag", "SMP-periodic-diag"), ("SMP-fixed-dense", "SMP-periodic-dense")

# The judges whose criterion is one expression, in the register's order; the others follow, one function each.
JUDGES.update({
    "toy-diag-collapse": lambda ev: (
        [ev.cond(m, lambda r, m=m: 0.015 - _at(r, m, "mutual_info"), m) for m in TOY_DIAGONAL],
        ev.show(TOY_DIAGONAL, "mutual_info")),
    "toy-dense-overdispersed": lambda ev: (
        [ev.cond(f"{m} {c}", _minus(m, "NUTS", c, 2), m) for m in TOY_DENSE for c in ("ece", "mutual_info")],
        ev.show(("NUTS", *TOY_DENSE), "ece", "mutual_info")),
    "toy-none-param-collapse": lambda ev: _variances(ev, "SMP-none", 0.1),
    "toy-ema-block-variances": lambda ev: _variances(ev, "SMP-ema-block", 1.0),
    "toy-smp-faster": lambda ev: (None, "the toy's seconds come from runs on a machine shared with other work (their "
                                  "manifest says not for comparisons), and no idle benchmark times the toy's NUTS"),
    "toy-nuts-mean-like-nuts": lambda ev: _close(ev, "NUTS-mean", "NUTS", {"accuracy": 0.005, "brier": 0.005}),
    "mnist-none-like-map": lambda ev: _close(ev, "SMP-none", "MAP", {"accuracy": 0.002, "nll": 0.005}),
    "mnist-none-collapses": lambda ev: (
        [ev.cond(c, lambda r, c=c: 0.005 - _at(r, "SMP-none", c), "SMP-none")
         for c in ("mutual_info", "epistemic_std")],
        ev.show(("SMP-none",), "mutual_info", "epistemic_std")),
    "mnist-periodic-least": lambda ev: (
        [ev.cond(f"below {m}", _minus(m, PERIODIC, "mutual_info"), m, PERIODIC) for m in (FIXED, EMA)],
        ev.show(DIAGONAL, "mutual_info")),
    "mnist-diag-variances": lambda ev: (
        [ev.cond(f"{m} params", lambda r, m=m: 1e-3 - _at(r, m, "params_variance"), m) for m in DIAGONAL]
        + [ev.cond(f"{m} logits", lambda r, m=m: _at(r, m, "logits_variance") - 1.0, m) for m in DIAGONAL],
        ev.show(DIAGONAL, "params_variance", "logits_variance")),
    "mnist-dispersion-order": lambda ev: (
        [ev.cond(f"{c}: {a} > {b}", _minus(a, b, c), a, b)
         for c in ("mutual_info", "logits_variance") for a, b in ((FIXED, EMA), (EMA, PERIODIC))],
        ev.show(DIAGONAL, "mutual_info", "logits_variance")),
    "mnist-diag-worse": lambda ev: (
        [ev.cond(f"{m} {c} against {ref}", lambda r, m=m, ref=ref, c=c: WORSE[c] * _minus(m, ref, c)(r), m, ref)
         for m in DIAGONAL for ref in ("MAP", "SMP-none") for c in WORSE],
        ev.show(("MAP", "SMP-none", *DIAGONAL), "accuracy")),
    "mnist-timing": lambda ev: (None, "the committed seconds add up interrupted runs on a machine shared with other "
                                "work; the idle benchmarks time the steps and the Fisher apart, not the paper's whole "
                                "runs"),
    "mnist-fixed-accuracy-drop": lambda ev: (
        [ev.cond("below MAP", _minus("MAP", FIXED, "accuracy"), FIXED, "MAP")],
        ev.describe("accuracy fixed-diag - MAP", _minus(FIXED, "MAP", "accuracy"), FIXED, "MAP") + " (paper -0.0040)"),
    "mnist-periodic-best-diag": lambda ev: (
        [ev.cond(c, lambda r, c=c: min(WORSE[c] * _minus(m, PERIODIC, c)(r) for m in (FIXED, EMA)), *DIAGONAL)
         for c in WORSE],
        ev.show(DIAGONAL, "accuracy", "nll")),
})


@judge("toy-ema-block-compromise")
def _(ev):
    eb = "SMP-ema-block"

    def qualifies(r, m):
        return (_at(r, m, "accuracy") >= _at(r, "NUTS", "accuracy") - 0.005
                and _at(r, m, "mutual_info") >= _at(r, "NUTS", "mutual_info") / 2
                and _at(r, m, "ece") <= 3 * _at(r, "NUTS", "ece"))

    def best(r):
        ok = [m for m in r["scores"].index if m.startswith("SMP-") and qualifies(r, m)]
        return min(ok, key=lambda m: _at(r, m, "nll")) if ok else "none"

    picks = Counter(best(r) for r in ev.runs)
    return ([ev.cond("ema-block qualifies", lambda r: 1 if qualifies(r, eb) else -1, eb),
             ev.cond("ema-block best by NLL", lambda r: 1 if best(r) == eb else -1, eb)],
            "best by NLL among the qualifying, per run: " + ", ".join(f"{m} {n}" for m, n in picks.most_common()))


@judge("toy-none-diffuse")
def _(ev):
    none = "SMP-none"
    ratio = lambda r: _at(r, none, "mutual_info") / _at(r, "NUTS", "mutual_info")  # noqa: E731
    gap = _minus(none, "NUTS", "accuracy")
    return ([ev.cond("MI >= 5 NUTS's", _minus(none, "NUTS", "mutual_info", 5), none),
             ev.cond("accuracy within 0.01", lambda r: 0.01 - abs(gap(r)), none)],
            ev.describe("MI ratio to NUTS", ratio, none, digits=3) + " (paper 14.9); "
            + ev.describe("accuracy gap", gap, none))


@judge("toy-ema-block-mi-4x")
def _(ev):
    eb = "SMP-ema-block"
    ratio = lambda r: _at(r, eb, "mutual_info") / _at(r, "NUTS", "mutual_info")  # noqa: E731
    return ([ev.cond("ratio >= 2", lambda r: ratio(r) - 2, eb), ev.cond("ratio <= 8", lambda r: 8 - ratio(r), eb)],
            ev.describe("MI ratio ema-block / NUTS", ratio, eb, digits=3) + " (paper 4.0)")


@judge("toy-calibration-ranking")
def _(ev):
    rank = lambda r: r["scores"]["ece"].rank()  # noqa: E731
    n, eb = len(ev.runs[0]["scores"]) if ev.runs else 0, "SMP-ema-block"
    best, worst = ["NUTS", "NUTS-mean"], ["SMP-none", "SMP-fixed-dense"]
    ratio = lambda r: _at(r, eb, "ece") / _at(r, "NUTS", "ece")  # noqa: E731
    return ([ev.cond("NUTS, NUTS-mean among the 4 best", lambda r: 1 if rank(r)[best].max() <= 4 else -1, "NUTS"),
             ev.cond("SMP-none, fixed-dense the 2 worst", lambda r: 1 if rank(r)[worst].min() >= n - 1 else -1,
                     "SMP-none"),
             ev.cond("ema-block within 2x NUTS", lambda r: 2 * _at(r, "NUTS", "ece") - _at(r, eb, "ece"), eb)],
            "two worst ECE per run: " + "; ".join(", ".join(r["scores"]["ece"].nlargest(2).index) for r in ev.runs)
            + "; " + ev.describe("ECE ratio ema-block / NUTS", ratio, eb, digits=3))


@judge("toy-r-ratio")
def _(ev):
    ratio, steps = ev.results.values.get("r_ratio"), ev.results.config["n_steps"]
    if ratio is None or steps != 5000:
        return None, f"K = {steps:,} at this scale, not the paper's 5,000"
    return [Condition("within 0.005 of 9 %", [0.005 - abs(ratio - 0.09)], exact=True)], f"{ratio:.2%} at K = 5,000"


@judge("toy-nuts-ess")
def _(ev):
    d = ev.results.table("nuts_diagnostics")
    return ([Condition(f"median {c} ESS >= 500", list(d[f"median_ess_{c}"] - 500)) for c in ("params", "logits")],
            "median ESS per replicate, parameters: " + ", ".join(f"{x:.0f}" for x in d["median_ess_params"])
            + "; logits: " + ", ".join(f"{x:.0f}" for x in d["median_ess_logits"]))


@judge("toy-nuts-healthy")
def _(ev):
    d = ev.results.table("nuts_diagnostics")
    divergences, hits = d["num_divergences"].astype(int), d["num_max_tree_depth_hits"].astype(int)
    return ([Condition("no divergence", list(np.where(divergences == 0, 1, -1))),
             Condition("tree depth below the maximum", list(np.where(hits == 0, 1, -1)))],
            f"divergences per replicate: {', '.join(map(str, divergences))}; transitions at the maximum tree "
            f"depth: {', '.join(map(str, hits))}")


@judge("mnist-diag-overdisperse")
def _(ev):
    mi = lambda r, m: _at(r, m, "mutual_info")  # noqa: E731
    return ([ev.cond(f"{m} MI", lambda r, m=m: mi(r, m) - 10 * max(mi(r, "SMP-none"), 1e-6), m, "SMP-none")
             for m in DIAGONAL]
            + [ev.cond(f"{m} NLL", _minus(m, "MAP", "nll"), m, "MAP") for m in DIAGONAL],
            ev.show(("SMP-none", *DIAGONAL), "mutual_info") + "; " + ev.show(("MAP", *DIAGONAL), "nll"))


@judge("mnist-calibration")
def _(ev):
    def under(r, m):  # the part of the ECE that is provably under-confidence: ECE - (1 - accuracy)
        return max(0.0, _at(r, m, "ece") - (1.0 - _at(r, m, "accuracy")))

    def between(r):
        ece = r["scores"]["ece"]
        return min(ece[PERIODIC] - max(ece["MAP"], ece["SMP-none"]), min(ece[FIXED], ece[EMA]) - ece[PERIODIC])

    return ([ev.cond(f"{m} ECE < 0.01", lambda r, m=m: 0.01 - _at(r, m, "ece"), m) for m in ("MAP", "SMP-none")]
            + [ev.cond(f"{m} under-confident", lambda r, m=m: min(_at(r, m, "ece") - 0.05,
                                                                   under(r, m) - _at(r, m, "ece") / 2), m)
               for m in (FIXED, EMA)]
            + [ev.cond("periodic between", between, *DIAGONAL, "MAP", "SMP-none")],
            ev.show(("MAP", "SMP-none", *DIAGONAL), "ece"))


@judge("mnist-ambiguous-three")
def _(ev):
    if not ev.results.has("ambiguous_three"):
        return None, "no ambiguous-3 table"
    p = ev.results.table("ambiguous_three").rename(columns=str)[[str(c) for c in range(10)]]
    h = {m: float(-(p.loc[m][p.loc[m] > 0] * np.log(p.loc[m][p.loc[m] > 0])).sum()) for m in ("SMP-none", *DIAGONAL)}
    none, map_ = p.loc["SMP-none", "3"], p.loc["MAP", "3"]
    return ([Condition("SMP-none's P(3) above 0.5", [none - 0.5]),
             Condition("SMP-none's P(3) within 0.05 of MAP's", [0.05 - abs(none - map_)]),
             Condition("entropies in order",
                       [min(h[FIXED] - h[EMA], h[EMA] - h[PERIODIC], h[PERIODIC] - h["SMP-none"])])],
            f"one image, the first run: P(3) MAP {map_:.4f}, SMP-none {none:.4f}; entropy (nats) "
            + ", ".join(f"{m} {h[m]:.3f}" for m in h))


@judge("mnist-fisher-zeros")
def _(ev):
    fractions = {}
    for scale in ("paper", "laptop"):
        folder = ev.root / scale / "mnist"
        values = Results(folder).values if (folder / "manifest.json").exists() else {}
        if "fisher_zero_fraction" in values:
            fractions[f"{scale} scale's MAP (seed {values.get('map_seed', '?')})"] = values["fisher_zero_fraction"]
    # the fraction of one MAP is exact (no random error once the MAP is given): one condition per MAP
    return ([Condition(f"more than half at the {k}", [f - 0.5], exact=True) for k, f in fractions.items()],
            "; ".join(f"{k}: {v:.1%}" for k, v in fractions.items()))
