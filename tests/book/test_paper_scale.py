"""The further claims of Section 3.3, judged from result tables: the paper's own tables satisfy them,
and each verdict turns when the number it rests on does."""

import json

import numpy as np
import pandas as pd
import pytest

from smp_book import mnist_claims as mc
from smp_book.paper import paper_table
from smp_book.results import Results

METHODS = ["MAP", "SMP-none", "SMP-fixed-diag", "SMP-ema-diag", "SMP-periodic-diag"]


def _ambiguous(p3: dict[str, float]) -> pd.DataFrame:
    """Mean class probabilities for a 3: ``p3[m]`` on class 3 and the rest spread evenly over the others."""
    rows = {m: [(1 - p) / 9] * 3 + [p] + [(1 - p) / 9] * 6 for m, p in p3.items()}
    return pd.DataFrame(rows, index=[str(c) for c in range(10)]).T


AS_PAPER = _ambiguous({"MAP": 0.9, "SMP-none": 0.9, "SMP-fixed-diag": 0.2, "SMP-ema-diag": 0.4,
                       "SMP-periodic-diag": 0.6})


def _judged(scores=None, variances=None, ambiguous=AS_PAPER, elapsed=None, note=None) -> pd.Series:
    table = mc.further_claims(paper_table("ex2_scores") if scores is None else scores,
                              paper_table("ex2_variances") if variances is None else variances,
                              ambiguous, paper_table("ex2_elapsed") if elapsed is None else elapsed, note)
    keys = {"Dispersion": "Dispersion", "predict worse": "Scores", "Calibration": "Calibration",
            "Ambiguous": "Ambiguous", "take longer": "Timing"}
    names = [next(k for w, k in keys.items() if w in claim) for claim in table["claim"]]
    return pd.Series(table["verdict"].to_numpy(), index=names)


def test_the_papers_own_tables_satisfy_the_papers_claims():
    table = mc.further_claims(paper_table("ex2_scores"), paper_table("ex2_variances"), AS_PAPER,
                              paper_table("ex2_elapsed"))
    assert list(table.columns) == ["claim", "criterion", "verdict", "evidence"]
    assert (table["verdict"] == "holds").all(), table


def test_each_verdict_turns_with_its_numbers():
    scores, variances = paper_table("ex2_scores").copy(), paper_table("ex2_variances").copy()
    swapped = scores.copy()
    swapped.loc["SMP-ema-diag", "mutual_info"] = 2.0  # EMA above fixed in MI, not in logit variance
    assert _judged(scores=swapped)["Dispersion"] == "partly"
    both = variances.copy()
    both.loc["SMP-ema-diag", "logits_variance"] = 200.0
    assert _judged(scores=swapped, variances=both)["Dispersion"] == "does not hold"

    better = scores.copy()
    better.loc["SMP-periodic-diag", "accuracy"] = 0.99  # periodic more accurate than MAP
    assert _judged(scores=better)["Scores"] == "partly"

    over = scores.copy()
    over.loc["SMP-fixed-diag", "ece"] = 0.02  # 1 - accuracy is 0.0163: could all be over-confidence
    assert mc.underconfidence_bound(0.9837, 0.02) == pytest.approx(0.0037)
    assert _judged(scores=over)["Calibration"] == "partly"
    inaccurate = scores.copy()
    inaccurate.loc["SMP-fixed-diag", "accuracy"] = 0.3  # its ECE of 0.605 could then be over-confidence
    assert mc.underconfidence_bound(0.3, 0.605) == 0.0
    assert _judged(scores=inaccurate)["Calibration"] == "partly"
    outside = scores.copy()
    outside.loc["SMP-periodic-diag", "ece"] = 0.8  # periodic no longer between
    assert _judged(scores=outside)["Calibration"] == "partly"

    # the accuracy must be lower by one binomial standard error of MAP's (0.0011 for 10,000 images)
    assert (mc.further_claims(scores, variances, AS_PAPER, paper_table("ex2_elapsed"), n_test=10_000)["verdict"]
            == "holds").all()
    close = scores.copy()
    close.loc["SMP-periodic-diag", "accuracy"] = 0.9870
    assert _judged(scores=close)["Scores"] == "holds"  # no margin without n_test
    judged = mc.further_claims(close, variances, AS_PAPER, paper_table("ex2_elapsed"), n_test=10_000)
    assert judged.loc[judged["claim"].str.contains("predict worse"), "verdict"].item() == "partly"

    flat = _ambiguous({"MAP": 0.9, "SMP-none": 0.9, "SMP-fixed-diag": 0.6, "SMP-ema-diag": 0.4,
                       "SMP-periodic-diag": 0.2})  # the diagonal order reversed
    assert _judged(ambiguous=flat)["Ambiguous"] == "partly"
    moved = _ambiguous({"MAP": 0.9, "SMP-none": 0.5, "SMP-fixed-diag": 0.6, "SMP-ema-diag": 0.4,
                        "SMP-periodic-diag": 0.2})
    assert _judged(ambiguous=moved)["Ambiguous"] == "does not hold"
    unsure = _ambiguous({"MAP": 0.48, "SMP-none": 0.45, "SMP-fixed-diag": 0.1, "SMP-ema-diag": 0.2,
                         "SMP-periodic-diag": 0.3})  # like MAP, but not concentrated on 3
    assert _judged(ambiguous=unsure)["Ambiguous"] == "partly"

    fast = paper_table("ex2_elapsed").copy()
    fast.loc["SMP-fixed-diag", "seconds"] = 1000.0
    judged = mc.further_claims(scores, variances, AS_PAPER, fast, "other work ran")
    row = judged[judged["claim"].str.contains("longer")].iloc[0]
    assert row["verdict"] == "partly" and "timing note: other work ran" in row["evidence"]


def test_a_missing_number_leaves_its_claim_not_checked():
    scores = paper_table("ex2_scores").copy()
    scores.loc["SMP-ema-diag", "ece"] = np.nan
    judged = _judged(scores=scores)
    assert judged["Calibration"].startswith("not checked") and judged["Scores"].startswith("not checked")
    assert judged["Dispersion"] == "holds"
    ambiguous = AS_PAPER.copy()
    ambiguous.loc["SMP-none", "3"] = np.nan
    assert _judged(ambiguous=ambiguous)["Ambiguous"].startswith("not checked")
    assert np.isnan(mc.entropy(pd.Series([0.5, np.nan])))


def test_entropy_of_a_uniform_and_of_a_point():
    assert mc.entropy(pd.Series([0.1] * 10)) == pytest.approx(np.log(10))
    assert mc.entropy(pd.Series([1.0] + [0.0] * 9)) == 0.0


def test_from_results_reads_the_chapters_tables(tmp_path):
    layout = {"index": 1, "header": 1}
    tables = {"scores_mean": paper_table("ex2_scores"), "variances_mean": paper_table("ex2_variances"),
              "ambiguous_three": AS_PAPER, "elapsed_mean": paper_table("ex2_elapsed")}
    for name, df in tables.items():
        df.to_csv(tmp_path / f"{name}.csv")
    (tmp_path / "manifest.json").write_text(json.dumps({"config": {}, "tables": dict.fromkeys(tables, layout),
                                                        "timing_note": "busy"}))
    judged = mc.from_results(Results(tmp_path))
    assert (judged["verdict"] == "holds").all() and judged["evidence"].iloc[-1].endswith("(timing note: busy)")


def _results(folder, tables, config, values=None):
    folder.mkdir()
    layouts = {}
    for name, df in tables.items():
        df.to_csv(folder / f"{name}.csv")
        layouts[name] = {"index": df.index.nlevels, "header": 1}
    (folder / "manifest.json").write_text(json.dumps({"config": config, "tables": layouts}))
    (folder / "values.json").write_text(json.dumps(values or {}))
    return Results(folder)


def test_paper_scale_gaps_against_the_map_spread_and_the_growth_in_k(tmp_path):
    from smp_core.recursion import residual_variance_ratio

    methods = pd.Index(["MAP", "SMP-none", "SMP-fixed-diag", "SMP-periodic-diag"], name="method")
    same = {**dict.fromkeys(mc.SAME_MAP, 1), "n_train": 54_000, "n_chains": 100}
    run = _results(tmp_path / "run", {
        "scores": pd.DataFrame({"mutual_info": [0.0, 0.0004, 0.94, 0.1]}, index=methods),
        "tails": pd.DataFrame({"mi_largest_chain_share": [np.nan, 0.05, 0.03, 0.02]}, index=methods)},
        {**same, "n_steps": 1_000_000, "n_fisher_periodic": 1000}, {"map_seed": 2226})
    paper = pd.DataFrame({"mutual_info": [0.0, 0.0002, 1.88, 0.2]}, index=methods)
    alone = mc.paper_scale_gaps(run, paper)
    assert list(alone.index) == ["SMP-none", "SMP-fixed-diag", "SMP-periodic-diag"]
    assert alone.loc["SMP-fixed-diag", "ratio"] == pytest.approx(0.5) and alone.loc["SMP-none", "ratio"] == 2.0
    assert alone.loc["SMP-fixed-diag", "largest chain's share"] == 0.03 and "MAP sd" not in alone.columns

    per_run = pd.DataFrame({"SMP-fixed-diag": [0.01, 0.03, 0.02, 0.06], "SMP-periodic-diag": 0.01},
                           index=pd.MultiIndex.from_product([[0, 1], [0, 1]], names=["map", "replicate"]))

    def seeds(folder, **config):
        return _results(tmp_path / folder, {
            "map_or_stream": pd.DataFrame({"sd_map": [0.3], "sd_stream": [0.4]}, index=["log SMP-fixed-diag"]),
            "per_run": per_run, "maps": pd.DataFrame({"seed": [2026, 2226]}, index=pd.Index([0, 1], name="map"))},
            {**same, "n_steps": 10_000, "n_fisher_periodic": 500, **config})

    table = mc.paper_scale_gaps(run, paper, seeds("seeds"))
    fixed = table.loc["SMP-fixed-diag"]
    assert fixed["MAP sd"] == 0.3 and fixed["stream sd"] == 0.4
    # the difference of two runs, each with sd 0.5 (MAP and stream together)
    assert fixed["gap in sds"] == pytest.approx(np.log(0.5) / (np.sqrt(2) * 0.5))
    assert fixed["growth"] == pytest.approx(0.94 / 0.04)  # over the runs of MAP 1, seed 2226
    linear = (1 - residual_variance_ratio(54_000, 1_000_000)) / (1 - residual_variance_ratio(54_000, 10_000))
    assert fixed["linear growth"] == pytest.approx(linear) and 5 < linear < 7
    assert np.isnan(table.loc["SMP-none", "growth"]) and np.isnan(table.loc["SMP-none", "MAP sd"])
    assert np.isnan(table.loc["SMP-periodic-diag", "growth"])  # its Fisher on 500 images there, 1000 here
    assert mc.paper_scale_gaps(run, paper, seeds("same_fisher", n_fisher_periodic=1000)).loc[
        "SMP-periodic-diag", "growth"] == pytest.approx(10.0)
    # runs on other data or with other S say nothing of this run: no such columns
    for other in ({"n_train": 2000}, {"n_chains": 8}, {"map_epochs": 2}):
        assert "MAP sd" not in mc.paper_scale_gaps(run, paper, seeds(str(other), **other)).columns


FIXED = "SMP-fixed-diag"


def _gaps(**row):
    base = {"paper": 1.877, "paper scale": 1.129, "ratio": 1.129 / 1.877, "largest chain's share": 0.03}
    return pd.DataFrame([{**base, **row}], index=pd.Index(["SMP-fixed-diag"], name="method"))


def test_both_scales_puts_the_verdicts_side_by_side(tmp_path):
    def run(folder, order):  # the chapter's claims table, and scores that decide the ordering claim
        methods = pd.Index(["MAP", "SMP-none", *mc.DIAGONAL], name="method")
        scores = pd.DataFrame({"accuracy": 0.98, "brier": 0.1, "nll": 0.3, "ece": 0.2,
                               "mutual_info": [0.0, 0.001, *order]}, index=methods)
        variances = pd.DataFrame({"logits_variance": [np.nan, 0.01, *order]}, index=methods)
        ambiguous = pd.DataFrame(0.1, index=methods, columns=[str(c) for c in range(10)])
        return _results(folder, {"claims": pd.DataFrame({"claim": ["own claim"], "verdict": ["holds"]}),
                                 "scores_mean": scores, "variances_mean": variances,
                                 "ambiguous_three": ambiguous,
                                 "elapsed_mean": pd.DataFrame({"seconds": [0, 1, 2, 3, 4]}, index=methods)},
                        {"n_test": 10_000})
    table = mc.both_scales(run(tmp_path / "p", [3.0, 2.0, 1.0]), run(tmp_path / "l", [1.0, 2.0, 3.0]), "laptop")
    assert list(table.columns) == ["claim", "verdict (paper scale)", "verdict (laptop)"]
    assert table.iloc[0].tolist() == ["own claim", "holds", "holds"]
    order = table.set_index("claim").loc[
        "Dispersion is largest for fixed, then EMA, then periodic (MI, logit variance)"]
    assert order.tolist() == ["holds", "does not hold"]


def test_paper_scale_findings_name_the_changes_and_turn_with_the_evidence():
    verdicts = pd.DataFrame({"claim": ["A", "B"], "verdict (paper scale)": ["holds", "holds"],
                             "verdict (laptop)": ["holds", "does not hold"]})
    ours = pd.DataFrame({"accuracy": [0.9886, 0.9906], "logits_variance": [np.nan, 53.0]}, index=["MAP", FIXED])
    paper = pd.DataFrame({"accuracy": [0.9877, 0.9837], "logits_variance": [np.nan, 101.9]}, index=["MAP", FIXED])

    def findings(selected, **row):
        return mc.paper_scale_findings(selected, _gaps(**row), ours, paper, "laptop", 100)

    text = findings(verdicts)
    assert "at the paper scale 2 hold; at the laptop scale, 1 holds, 1 does not hold" in text
    assert "*B* (does not hold at the laptop scale, holds at the paper scale)" in text and "*A*" not in text
    assert "(0.6 times it), logit variance 0.52 times" in text and "bulk of the chains" in text
    assert "accuracy 0.9906 against the MAP's 0.9886 (the paper: 0.9837 against 0.9877)" in text
    assert "standard deviations" not in text and "grew" not in text  # no MAP-seeds columns, no such words

    near = findings(verdicts, **{"gap in sds": -1.5, "growth": 25.0, "linear growth": 6.1})
    assert "1.5 standard deviations below the paper's" in near
    assert "within what another MAP and stream could give" in near and "chains left the region" in near
    far = findings(verdicts[:1], **{"gap in sds": 2.5, "growth": 7.0, "linear growth": 6.1,
                                    "largest chain's share": 0.4})
    assert "2.5 standard deviations above the paper's" in far and "more than another MAP" in far
    assert "about what a fixed Fisher gives" in far and "one chain's excursion" in far
    assert "No verdict changes with the scale." in far
    coarse = mc.paper_scale_findings(verdicts, _gaps(paper=0.0002, ratio=np.nan), ours, paper, "laptop", 100)
    assert "(not comparable with it, the paper's number having one significant figure)" in coarse
    few = findings(verdicts, **{"gap in sds": 0.5, "growth": 2.0, "linear growth": 6.1,
                                "largest chain's share": 0.1})
    assert "less than a fixed Fisher gives" in few and "a sizeable share for one chain" in few


def test_count_verdicts_counts_what_is_not_judged():
    assert mc.count_verdicts(["holds", "partly", "holds"]) == "2 hold, 1 partly"
    assert mc.count_verdicts(["holds", "not checked (a number is missing)", "-"]) == "1 holds, 2 not checked"
    assert mc.count_verdicts(["-"]) == "1 not checked" and mc.count_verdicts([]) == "none"


def test_ratios_read_to_two_significant_figures():
    assert mc._times(0.6015) == "0.6 times" and mc._times(2.449) == "2.4 times" and mc._times(126.0) == "130 times"
    assert mc._times(1e-5) == "0.00001 times" and mc._times(np.nan) == "not comparable with"
