"""The further claims of Section 3.3, judged from result tables: the paper's own tables satisfy them,
and each verdict turns when the number it rests on does."""

import json

import numpy as np
import pandas as pd
import pytest

from smp_book import show
from smp_book.results import Results

METHODS = ["MAP", "SMP-none", "SMP-fixed-diag", "SMP-ema-diag", "SMP-periodic-diag"]


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
    same = {**dict.fromkeys(show.SAME_MAP, 1), "n_train": 54_000, "n_chains": 100}
    run = _results(tmp_path / "run", {
        "scores": pd.DataFrame({"mutual_info": [0.0, 0.0004, 0.94, 0.1]}, index=methods),
        "tails": pd.DataFrame({"mi_largest_chain_share": [np.nan, 0.05, 0.03, 0.02]}, index=methods)},
        {**same, "n_steps": 1_000_000, "n_fisher_periodic": 1000}, {"map_seed": 2226})
    paper = pd.DataFrame({"mutual_info": [0.0, 0.0002, 1.88, 0.2]}, index=methods)
    alone = show.paper_scale_gaps(run, paper)
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

    table = show.paper_scale_gaps(run, paper, seeds("seeds"))
    fixed = table.loc["SMP-fixed-diag"]
    assert fixed["MAP sd"] == 0.3 and fixed["stream sd"] == 0.4
    # the difference of two runs, each with sd 0.5 (MAP and stream together)
    assert fixed["gap in sds"] == pytest.approx(np.log(0.5) / (np.sqrt(2) * 0.5))
    assert fixed["growth"] == pytest.approx(0.94 / 0.04)  # over the runs of MAP 1, seed 2226
    linear = (1 - residual_variance_ratio(54_000, 1_000_000)) / (1 - residual_variance_ratio(54_000, 10_000))
    assert fixed["linear growth"] == pytest.approx(linear) and 5 < linear < 7
    assert np.isnan(table.loc["SMP-none", "growth"]) and np.isnan(table.loc["SMP-none", "MAP sd"])
    assert np.isnan(table.loc["SMP-periodic-diag", "growth"])  # its Fisher on 500 images there, 1000 here
    assert show.paper_scale_gaps(run, paper, seeds("same_fisher", n_fisher_periodic=1000)).loc[
        "SMP-periodic-diag", "growth"] == pytest.approx(10.0)
    # runs on other data or with other S say nothing of this run: no such columns
    for other in ({"n_train": 2000}, {"n_chains": 8}, {"map_epochs": 2}):
        assert "MAP sd" not in show.paper_scale_gaps(run, paper, seeds(str(other), **other)).columns


FIXED = "SMP-fixed-diag"


def _gaps(**row):
    base = {"paper": 1.877, "paper scale": 1.129, "ratio": 1.129 / 1.877, "largest chain's share": 0.03}
    return pd.DataFrame([{**base, **row}], index=pd.Index(["SMP-fixed-diag"], name="method"))


def test_paper_scale_findings_name_the_changes_and_turn_with_the_evidence():
    verdicts = pd.DataFrame({"claim": ["A", "B"], "verdict (paper scale)": ["holds", "holds"],
                             "verdict (laptop)": ["holds", "does not hold"]})
    ours = pd.DataFrame({"accuracy": [0.9886, 0.9906], "logits_variance": [np.nan, 53.0]}, index=["MAP", FIXED])
    paper = pd.DataFrame({"accuracy": [0.9877, 0.9837], "logits_variance": [np.nan, 101.9]}, index=["MAP", FIXED])

    def findings(selected, **row):
        return show.paper_scale_findings(selected, _gaps(**row), ours, paper, "laptop", 100)

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
    coarse = show.paper_scale_findings(verdicts, _gaps(paper=0.0002, ratio=np.nan), ours, paper, "laptop", 100)
    assert "(not comparable with it, the paper's number having one significant figure)" in coarse
    few = findings(verdicts, **{"gap in sds": 0.5, "growth": 2.0, "linear growth": 6.1,
                                "largest chain's share": 0.1})
    assert "less than a fixed Fisher gives" in few and "a sizeable share for one chain" in few


def test_ratios_read_to_two_significant_figures():
    assert show._times(0.6015) == "0.6 times" and show._times(2.449) == "2.4 times"
    assert show._times(126.0) == "130 times"
    assert show._times(1e-5) == "0.00001 times" and show._times(np.nan) == "not comparable with"
