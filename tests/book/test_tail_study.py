"""The Gaussian-tail study on the toy example: its agreement rule on hand-made ratios, the tables shown, and one
tiny replicate end to end."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from smp_book import tail_study as tl
from smp_book.config import get_config


def _ratios(values: dict[str, list[float]], grid=(50, 500, 1000)) -> pd.DataFrame:
    rows = [{"method": m, "tail_from": k, "logits": v, "params": v} for m, vs in values.items()
            for k, v in zip(grid, vs, strict=True)]
    return pd.DataFrame(rows).set_index(["method", "tail_from"])


def test_agreement_is_the_first_k0_from_which_every_ratio_is_within_the_factor():
    agree = tl.agreement(_ratios({
        "SMP-a": [1.0, 1.1, 0.9],   # everywhere
        "SMP-b": [0.5, 1.2, 0.85],  # from 500
        "SMP-c": [1.0, 0.5, 1.0],   # disagrees at 500: only from 1000
        "SMP-d": [1.0, 1.0, 1.3],   # not at the largest K0: none
    }))
    col = agree["agrees in logits from K0"]
    assert col["SMP-a"] == 50 and col["SMP-b"] == 500 and col["SMP-c"] == 1000
    assert pd.isna(col["SMP-d"])



def test_agreement_groups_split_first_later_never():
    agree = tl.agreement(_ratios({"SMP-a": [1.0, 1.1, 0.9], "SMP-b": [0.5, 1.2, 0.85], "SMP-d": [1.0, 1.0, 1.3]}))
    groups = tl.agreement_groups(agree, [50, 500, 1000])
    assert groups == {"first": ["SMP-a"], "later": ["SMP-b"], "never": ["SMP-d"]}
    assert tl.short_names(groups["first"] + groups["later"]) == "a, b" and tl.short_names([]) == "none"


def test_ratios_shown_keep_the_variants_order_and_show_no_nan():
    mean = _ratios({"SMP-b": [1.0, 1.1, 0.9], "SMP-a": [0.5, 1.2, 0.85]})
    std = mean * 0.1
    std.iloc[0] = np.nan  # one replicate: no spread
    shown = tl.ratios_shown(mean, std)
    assert list(shown.index) == ["SMP-b", "SMP-a"]
    assert list(shown.columns) == [(s, k) for s in ("params", "logits") for k in (50, 500, 1000)]
    assert shown.loc["SMP-b", ("logits", 50)] == "1.000" and shown.loc["SMP-a", ("params", 500)] == "1.200 ± 0.120"
    assert not shown.map(lambda v: "nan" in v).any().any()


def test_remaining_variance_falls_with_the_stop():
    remaining = tl.remaining_variance(get_config("toy_tail", "ci"))
    assert list(remaining.index) == [50, 100, 300]
    assert remaining.iloc[:, 0].is_monotonic_decreasing and (remaining.iloc[:, 0] < 1).all()

def test_sampler_names_order():
    assert tl.sampler_names([500, 50]) == ["hybrid from 50", "hybrid from 500", tl.RECURSION, tl.TO_INFINITY]


@pytest.mark.parametrize("tail_from", [[100], [0], []])
def test_stops_must_lie_inside_the_run(tail_from):
    cfg = {**get_config("toy_tail", "ci"), "n_steps": 100, "tail_from": tail_from}
    with pytest.raises(ValueError, match="tail_from"):
        tl.run_replicate(cfg, 0)


@pytest.mark.slow
def test_one_tiny_replicate():
    cfg = {**get_config("toy_tail", "ci"), "n_train": 60, "n_test": 50, "nuts_warmup": 30, "nuts_samples": 30,
           "n_chains": 6, "n_steps": 100, "tail_from": [50], "tail_scores": 10, "variants": ["none", "ema-block"]}
    run = tl.run_replicate(cfg, 0)
    summary = tl.tables([run])
    scores = summary["scores_mean"]
    assert list(scores.index) == [(f"SMP-{v}", s) for v in cfg["variants"] for s in tl.sampler_names([50])]
    assert scores.notna().all().all()
    ratios = summary["ratios_mean"]
    assert list(ratios.index) == [("SMP-none", 50), ("SMP-ema-block", 50)]
    assert (ratios > 0).all().all()
