"""The toy-gaps study: its paper-faithful rows are the toy chapter's, and its statistics say what they claim."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from smp_book import toy_gaps_study as tg
from smp_book import toy_study as ts
from smp_book.config import TOY

TINY = {**TOY["ci"], "n_train": 60, "n_test": 80, "nuts_warmup": 30, "nuts_samples": 30, "n_chains": 6,
        "n_steps": 20, "replicates": 1, "variants": list(tg.VARIANTS), "settings": tg.SETTINGS}


@pytest.fixture(scope="module")
def tiny_rows():
    return pd.DataFrame(tg.run_replicate(TINY, 0, progress=False)).set_index(["setting", "method"])


def test_paper_faithful_rows_are_the_toy_chapters(tiny_rows):
    """Same data, NUTS chain and SMP chains as toy_study.run_replicate with the same settings."""
    run = ts.run_replicate(TINY, 0, variants=list(tg.VARIANTS), progress=False)
    for method in ("NUTS", "NUTS-mean", "SMP-none", "SMP-fixed-dense"):
        theirs = {**run["evals"][method].scores, **run["evals"][method].variances}
        mine = tiny_rows.loc[(tg.OURS, method)]
        for metric in ("accuracy", "nll", "mutual_info", "logits_variance"):
            assert mine[metric] == pytest.approx(theirs[metric], rel=1e-6, abs=1e-12, nan_ok=True), (method, metric)


def test_every_setting_reruns_the_rows_it_touches(tiny_rows):
    methods = tiny_rows.reset_index().groupby("setting")["method"].apply(set)
    assert set(methods.index) == set(tg.SETTINGS)
    for setting, change in tg.SETTINGS.items():
        nuts = setting == tg.OURS or any(k in change for k in tg.NUTS_KEYS)
        expected = {"SMP-fixed-dense"} | ({"NUTS", "NUTS-mean"} if nuts else set())
        if not any(k in change for k in ("ridge", "fisher")):
            expected.add("SMP-none")
        assert methods[setting] == expected, setting
    # relabelling the same chain's draws changes NUTS-mean (theta0), never the NUTS ensemble's predictions
    assert tiny_rows.loc[("NUTS draws not relabelled", "NUTS"), "accuracy"] == \
        tiny_rows.loc[(tg.OURS, "NUTS"), "accuracy"]


def _fake_runs(shift: float, n: int = 6) -> pd.DataFrame:
    """SMP-none's MI per replicate: ours spread by 0.01 around 0.05; the other setting ours plus ``shift``
    plus a paired difference of +-0.001 (mean zero)."""
    rows = []
    for r in range(n):
        base = 0.05 + 0.01 * (-1) ** r * (r % 3)
        for setting, value in ((tg.OURS, base), ("float64 chains", base + shift + 0.001 * (-1) ** r)):
            rows.append({"setting": setting, "replicate": r, "method": "SMP-none", "mutual_info": value})
    return pd.DataFrame(rows).set_index(["setting", "replicate", "method"])


def test_a_shift_well_above_its_paired_noise_moves_and_can_reach_the_paper():
    table = tg.sensitivity(_fake_runs(shift=0.12), {("SMP-none", "mutual_info"): 0.17})
    row = table.loc[("SMP-none mutual_info", "float64 chains")]
    assert row["moves"] and row["shift"] == pytest.approx(0.12, abs=0.005)
    assert row["paper_within_spread"]
    assert not table.loc[("SMP-none mutual_info", tg.OURS), "paper_within_spread"]
    found = tg.findings(table).loc["SMP-none mutual_info"]
    assert found["closest_setting"] == "float64 chains" and found["paper_within_spread_of"] == "float64 chains"
    assert not found["ours_within_spread"]


def test_a_shift_within_its_paired_noise_does_not_move():
    rows = _fake_runs(shift=0.0)
    table = tg.sensitivity(rows, {("SMP-none", "mutual_info"): 0.17})
    assert not table.loc[("SMP-none mutual_info", "float64 chains"), "moves"]
    assert tg.findings(table).loc["SMP-none mutual_info", "paper_within_spread_of"] == "none"


def test_the_paper_inside_our_own_spread_is_no_gap():
    table = tg.sensitivity(_fake_runs(shift=0.12), {("SMP-none", "mutual_info"): 0.055})
    found = tg.findings(table).loc["SMP-none mutual_info"]
    assert found["ours_within_spread"] and found["paper_within_spread_of"] == "none"


def test_bayes_accuracy_bounds_every_classifier_and_is_what_the_data_give():
    from smp_book.toy import make_toy_data, p_true

    bayes = tg.bayes_accuracy()
    assert bayes == pytest.approx(tg.bayes_accuracy(4000), abs=1e-5)
    x, y = make_toy_data(200_000, 7)
    p = p_true(x.numpy())
    hits = ((p > 0.5) == (y.numpy() > 0.5)).astype(float)
    z = (hits.mean() - bayes) / (hits.std(ddof=1) / np.sqrt(len(hits)))
    assert abs(z) < 4, z  # the Bayes rule's accuracy on fresh data, within Monte Carlo error


def test_values_near_zero_do_not_hold_a_number_far_above_them():
    """A collapsed setting (values 1e-7 to 1e-4) must not 'hold' a paper value of 0.02: on the log scale its
    prediction interval reaches 0.022 and would hold it; on the natural scale it ends at 1.6e-4."""
    rows = []
    for r, tiny in enumerate([1e-7, 1e-6, 1e-5, 1e-4, 3e-5]):
        rows.append({"setting": tg.OURS, "replicate": r, "method": "SMP-none", "mutual_info": 0.01 + 0.001 * r})
        rows.append({"setting": "NUTS draws not relabelled", "replicate": r, "method": "SMP-none",
                     "mutual_info": tiny})
    table = tg.sensitivity(pd.DataFrame(rows).set_index(["setting", "replicate", "method"]),
                           {("SMP-none", "mutual_info"): 0.02})
    assert not table.loc[("SMP-none mutual_info", "NUTS draws not relabelled"), "paper_within_spread"]
