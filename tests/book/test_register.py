"""The register of claims: its rules against known margins, the paper's own tables against the paper's claims,
and every chapter showing the register's verdicts rather than its own."""

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from smp_book import paper_streams, register
from smp_book.paper import paper_table
from smp_book.register import Condition, Evidence, resolve, verdict
from smp_book.results import RESULTS, Results

ROOT = Path(register.__file__).parents[1]


def test_a_margin_is_resolved_against_the_spread_of_its_runs():
    assert resolve(Condition("z = 2.5", [1.5, 2.5, 3.5, 2.0, 3.0])) is True  # mean 2.5, sd 0.79: z 3.2
    assert resolve(Condition("inside", [1.0, -0.5, 2.0])) is None  # z 0.65
    assert resolve(Condition("below", [-3.0, -3.1, -2.9])) is False
    assert resolve(Condition("no spread", [0.2, 0.2, 0.2])) is True
    assert resolve(Condition("one run", [5.0])) is None  # one run has no spread
    assert resolve(Condition("two, apart", [1.0, 1.5])) is True  # both hold, smaller margin 1 > difference 0.5
    assert resolve(Condition("two, far", [0.2, 1.5])) is None  # difference 1.3 exceeds the smaller margin
    assert resolve(Condition("two, split", [0.5, -0.5])) is None
    assert resolve(Condition("two, below", [-1.0, -1.2])) is False
    assert resolve(Condition("exact", [0.001], exact=True)) is True
    assert resolve(Condition("missing", [1.0, np.nan, 2.0])) is None and resolve(Condition("none", [])) is None


def test_conditions_combine_into_one_word():
    yes, no, unsure = (Condition(n, m) for n, m in (("y", [1, 1, 1]), ("n", [-1, -1, -1]), ("u", [1, -1, 1])))
    assert verdict([yes, yes]) == "holds" and verdict([no, no]) == "does not hold"
    assert verdict([yes, no]) == "partly" and verdict([yes, no, unsure]) == "partly"
    assert verdict([yes, unsure]) == "not resolved" and verdict([unsure, unsure]) == "not resolved"
    assert verdict([no, unsure]) == "does not hold"  # one part fails outside the spread, none holds
    assert verdict([]) == "not judged"
    assert register.count(["holds", "holds", "not resolved", "does not hold"]) == (
        "2 hold, 1 does not hold, 1 not resolved")


def _as_runs(scores: pd.DataFrame, variances: pd.DataFrame, n: int = 3) -> Evidence:
    """``n`` runs equal to the given tables: no spread, so each condition is decided by its margin's sign."""
    run = {"scores": scores, "variances": variances}
    return Evidence(results=None, runs=[run] * n)


@pytest.mark.parametrize("claim", ["mnist-none-like-map", "mnist-none-collapses", "mnist-diag-overdisperse",
                                   "mnist-periodic-least", "mnist-diag-variances", "mnist-dispersion-order",
                                   "mnist-diag-worse", "mnist-calibration", "mnist-fixed-accuracy-drop",
                                   "mnist-periodic-best-diag"])
def test_the_papers_mnist_tables_satisfy_its_claims(claim):
    ev = _as_runs(paper_table("ex2_scores"), paper_table("ex2_variances"))
    conditions, _ = register.JUDGES[claim](ev)
    assert verdict(conditions) == "holds", [(c.name, c.margins[0]) for c in conditions]


@pytest.mark.parametrize("claim, expected", [
    ("toy-diag-collapse", "holds"), ("toy-dense-overdispersed", "holds"), ("toy-none-diffuse", "holds"),
    ("toy-none-param-collapse", "holds"), ("toy-ema-block-variances", "holds"), ("toy-ema-block-mi-4x", "holds"),
    ("toy-nuts-mean-like-nuts", "holds")])
def test_the_papers_toy_tables_satisfy_its_claims(claim, expected):
    ev = _as_runs(paper_table("ex1_scores"), paper_table("ex1_variances"))
    conditions, _ = register.JUDGES[claim](ev)
    assert verdict(conditions) == expected


def test_a_verdict_turns_with_its_numbers():
    scores, variances = paper_table("ex2_scores").copy(), paper_table("ex2_variances")
    scores.loc["SMP-periodic-diag", "mutual_info"] = 2.0  # now above fixed's and EMA's
    conditions, _ = register.JUDGES["mnist-periodic-least"](_as_runs(scores, variances))
    assert verdict(conditions) == "does not hold"
    scores.loc["SMP-periodic-diag", "mutual_info"] = 1.0  # above EMA's 0.91 only
    conditions, _ = register.JUDGES["mnist-periodic-least"](_as_runs(scores, variances))
    assert verdict(conditions) == "partly"


def test_the_register_is_complete_and_judges_the_committed_results():
    claims = register.load()
    assert len(claims) >= 25
    assert {c["chapter"] for c in claims} == {"toy", "mnist"}
    table = register.table()
    assert set(table["verdict"]) <= set(register.WORDS)
    assert (table["scale"].str.startswith("laptop") | table["scale"].str.startswith("paper")).all()


def test_an_unjudged_or_repeated_claim_is_refused(tmp_path):
    text = register.REGISTER.read_text()
    (tmp_path / "new.toml").write_text(text + '\n[[claim]]\nid = "new"\nsection = "3"\nchapter = "toy"\nstudy = "toy"'
                                       '\nscale = "laptop"\nclaim = "c"\ncriterion = "c"\nthresholds = "t"\n')
    with pytest.raises(ValueError, match="'new' is unjudged"):
        register.load(tmp_path / "new.toml")
    first = text.split("\n[[claim]]\n")[1]
    (tmp_path / "twice.toml").write_text(text + "\n[[claim]]\n" + first)
    with pytest.raises(ValueError, match="is repeated"):
        register.load(tmp_path / "twice.toml")
    (tmp_path / "short.toml").write_text(re.sub(r'thresholds = ".*"', "", text, count=1))
    with pytest.raises(ValueError, match="lacks thresholds"):
        register.load(tmp_path / "short.toml")


def test_a_second_stream_joins_the_paper_scale_runs(tmp_path):
    paper = tmp_path / "paper"
    (paper / "mnist").mkdir(parents=True)
    for name in ("mnist/manifest.json", "mnist/values.json", "mnist/scores_replicates.csv",
                 "mnist/variances_replicates.csv", "mnist/elapsed_replicates.csv"):
        (paper / name).write_bytes((RESULTS / "paper" / name).read_bytes())
    before = register.evidence(Results(paper / "mnist"), tmp_path)
    assert len(before.runs) == 1
    for variant in ("fixed-diag", "ema-diag"):  # written as smp_book.paper_streams writes a stream
        method = f"SMP-{variant}"
        tables = {name: Results(paper / "mnist").table(f"{name}_replicates").xs(0, level="replicate").loc[[method]]
                  for name in ("scores", "variances")}
        paper_streams.save(paper / "mnist_streams" / variant / "stream_1", tables, {"config": {}})
    after = register.evidence(Results(paper / "mnist"), tmp_path)
    assert len(after.runs) == 2
    # the same numbers twice: the margin exceeds their difference (0), so the order is resolved
    conditions, _ = register.JUDGES["mnist-dispersion-order"](after)
    assert resolve(conditions[0]) is True
    # a claim that needs SMP-none is judged on the one stream that has it: not resolved
    conditions, _ = register.JUDGES["mnist-none-collapses"](after)
    assert verdict(conditions) == "not resolved"
    # a stream whose manifest does not list its tables is refused, naming its folder, not left out
    old_style = paper / "mnist_streams" / "none" / "stream_1"
    paper_streams.save(old_style, {"scores": tables["scores"]}, {"config": {}})
    manifest = json.loads((old_style / "manifest.json").read_text())
    (old_style / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "tables"}))
    with pytest.raises(ValueError, match="none/stream_1: its manifest lists no scores"):
        register.evidence(Results(paper / "mnist"), tmp_path)


def test_every_chapter_shows_the_registers_verdicts():
    """No page shows a verdict of its own on the paper's claims: the claims tables and counts come from the
    register, and no study writes a claims table."""
    for page in ("notebooks/toy.md", "notebooks/mnist.md", "notebooks/mnist_seeds.md", "notebooks/summary.md",
                 "book/intro.md"):
        assert "register.table(" in (ROOT / page).read_text(), page
    for page in [*(ROOT / "notebooks").glob("*.md"), *(ROOT / "smp_book").glob("*.py")]:
        assert 'table("claims"' not in page.read_text(), page.name
