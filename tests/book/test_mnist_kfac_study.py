"""Tests of the MNIST KFAC chapter's helpers that turn its results into tables, numbers and sentences
(smp_book.mnist_kfac_study; the runs and the step law are tested in test_mnist_study.py)."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from smp_book import mnist_kfac_study as mks


def test_storage_per_chain_of_lenet5():
    storage = mks.storage_per_chain()
    assert storage["diag"] == 47_154 and storage["dense"] == 47_154**2
    # the factors 26 + 6, 151 + 16, 257 + 128, 129 + 84, 85 + 10 (A: inputs and bias, G: outputs)
    assert storage["kfac"] == sum(a * a + g * g for a, g in ((26, 6), (151, 16), (257, 128), (129, 84), (85, 10)))
    assert storage["diag"] < storage["kfac"] < storage["block"] < storage["dense"]


def _means(names, mi, nll, seconds):
    index = pd.Index(names, name="method")
    return {"scores": pd.DataFrame({"accuracy": 0.98, "nll": nll, "ece": 0.01, "mutual_info": mi}, index=index),
            "variances": pd.DataFrame({"params_variance": 1e-6, "logits_variance": mi}, index=index),
            "elapsed": pd.DataFrame({"seconds": seconds}, index=index)}


def test_comparison_takes_the_kfac_rows_and_the_mnist_chapters_others():
    kfac = _means(["MAP", "SMP-fixed-kfac", "SMP-ema-kfac"], [0.0, 0.01, 0.1], [0.05, 0.06, 0.07], [0.0, 600, 1200])
    mnist = _means(["MAP", "SMP-none", "SMP-fixed-diag", "SMP-ema-diag", "SMP-periodic-diag"],
                   [0.0, 1e-4, 0.07, 0.5, 0.05], [0.049, 0.05, 0.06, 0.26, 0.07], [0.0, 55, 47, 57, 103])
    table = mks.comparison(kfac, mnist)
    assert list(table.index) == ["MAP", "SMP-none", "SMP-fixed-diag", "SMP-fixed-kfac", "SMP-ema-diag",
                                 "SMP-ema-kfac", "SMP-periodic-diag"]
    assert table.loc["MAP", "nll"] == 0.05                       # this chapter's MAP row, not the MNIST chapter's
    assert table.loc["SMP-ema-kfac", "seconds"] == 1200 and table.loc["SMP-ema-diag", "seconds"] == 57


def _sets(z_params, z_logits):
    """A table shaped like step_law_sets: predictions 1 with standard error 0.1 and the observed values that
    lie z standard errors above them (pooled), the set differences -0.5 and 0.5."""
    rows = []
    for method, zp, zl in zip(["SMP-none", "SMP-fixed-diag"], z_params, z_logits, strict=True):
        for name in ("set 0", "set 1", "pooled"):
            rows.append({"method": method, "set": name, **{
                f"{c}: {k}": v for c, z in (("params_variance", zp), ("logits_variance", zl))
                for k, v in (("predicted", 1.0), ("predicted se", 0.1), ("observed / predicted", 1 + 0.1 * z))}})
        rows.append({"method": method, "set": "difference (se)", "params_variance: predicted": -0.5,
                     "logits_variance: predicted": 0.5})
    return pd.DataFrame(rows).set_index(["method", "set"])


def test_step_law_numbers_quote_the_step_law_tables():
    """Four draws per variant: each scales the same scores into its steps (x2 diagonal, x4 KFAC) and its steps into
    output changes (x4, x2, x0.1); each group holds a fixed share of each; the second draw's label is surprising."""
    base = pd.DataFrame({"row": [3, 1, 4, 5], "training_label": [0, 1, 2, 1], "log_prob": np.log([0.9, 0.2, 0.99, 0.6]),
                         "score_sq": [1.0, 2.0, 3.0, 4.0]})
    frames = [base.assign(variant=v, step_sq=step * base["score_sq"], output_sq=step * out * base["score_sq"])
              for v, step, out in (("none", 1.0, 4.0), ("fixed-diag", 2.0, 2.0), ("fixed-kfac", 4.0, 0.1))]
    draws = pd.concat(frames, ignore_index=True)
    for group, share in (("layer 1", 0.25), ("layer 2", 0.75), ("diag Fisher below ridge", 0.5)):
        draws = draws.assign(**{f"{c}[{group}]": share * draws[c] for c in ("score_sq", "step_sq", "output_sq")})
    groups = {"layer 1": torch.arange(2), "layer 2": torch.arange(2, 8), "diag Fisher below ridge": torch.arange(8) < 4}
    tables = (draws, mks.step_law_by_group(draws, groups), mks.step_law_tails(draws), mks.step_law_surprise(draws),
              pd.concat({f"SMP-{v}": mks.largest_steps(draws, v) for v in mks.STEP_LAW_VARIANTS}, names=["method"]))
    numbers = mks.step_law_numbers(*tables, _sets([0.5, 1.0], [-1.5, 30.0]))
    expected = {"per_unit_ratio": 20.0, "step_ratio": 2.0, "layer_ratio_min": 20.0, "layer_ratio_max": 20.0,
                "diag_alignment": 0.5, "kfac_alignment": 0.025, "ridge_step_share": 0.5, "ridge_output_share": 0.5,
                "top_share_min": 0.4, "top_share_max": 0.4,  # the largest of 4 draws: 4 of 1 + 2 + 3 + 4
                "surprise_share": 0.25, "surprise_held_min": 0.2, "surprise_held_max": 0.2,
                "sets_difference_min": -0.5, "sets_difference_max": 0.5, "top_overlap": 4, "top_count": 4,
                "sets_pooled_within": 3, "sets_pooled_cells": 4}
    assert numbers == pytest.approx(expected)
    assert mks.step_law_numbers(*tables, _sets([0.5, 1.0], [-1.5, 2.0]))["sets_pooled_within"] == 4


def test_shown_writes_missing_cells_as_a_dash():
    df = pd.DataFrame({"x": [1.23456, math.nan], "s": ["a", ""], "n": [3, 4]},
                      index=pd.Index([0.5, math.nan], name="tau"))
    from smp_book.show import shown

    out = shown(df, significant=True)
    assert out["x"].tolist() == ["1.23", "-"] and out["s"].tolist() == ["a", "-"] and out["n"].tolist() == [3, 4]
    assert list(out.index) == [0.5, "-"]
    assert shown(df)["x"].tolist() == [1.235, "-"]  # to decimals by default


def test_precision_verdict_says_whether_rounding_matters():
    table = pd.DataFrame({"P^-1 s: relative difference, largest": [1e-4, 2e-3],
                          "share below ridge (float32)": [0.1, 0.5], "share below ridge (float64)": [0.1, 0.5],
                          "largest eigenvalue of G (x) A": [0.5, 3.0]}, index=pd.Index([1, 2], name="layer"))
    assert "float32 is not what shapes this preconditioner" in mks.precision_verdict(table, 1e-4)
    table.loc[2, "P^-1 s: relative difference, largest"] = 0.2
    table.loc[2, "share below ridge (float64)"] = 0.6
    verdict = mks.precision_verdict(table, 1e-4)
    assert "up to 20.0% (layer 2)" in verdict and "different in some layer" in verdict


def test_chain_check_text_compares_the_largest_chain_with_the_next():
    rows = [("SMP-fixed-diag", r, share, d, a, lin) for r, share, d, a, lin in
            ((0, 0.75, 1.6, 110.0, 2.7), (1, 0.01, 0.2, 1.1, 1.1), (2, 0.01, 0.4, 1.1, 0.8))]
    rows += [("SMP-fixed-kfac", r, 0.03, 0.2, 0.024, 0.021) for r in range(3)]
    chains = pd.DataFrame(rows, columns=["method", "rank", "share of the logit variance", "||theta - theta_0||^2",
                                         "actual mean (f - f_0)^2", "linearised mean (J (theta - theta_0))^2"])
    chains["largest move"] = 0.1
    text = mks.chain_check_text(chains.set_index(["method", "rank"]))
    assert "75% of the logit variance" in text and "4.0 to 8.0 times as far" in text
    assert f"a ratio of {110 / 2.7:.2f}" in text and f"within a factor {1 / 0.8 * 1.1:.3g}" in text


def test_the_answer_says_what_its_evidence_is():
    rows = pd.DataFrame({"kfac less dispersed (smaller MI)": ["yes", "yes", "no"],
                         "kfac lower NLL": ["yes", "no", "no"]}, index=["fixed", "ema", "periodic"])
    one = mks.answer(rows, 1)
    assert one.startswith("Partly, in one run, whose spread over runs is not measured: with 2 of the 3 ")
    assert one.endswith("and with 1 its test NLL is smaller.")
    assert mks.answer(rows.assign(**{"kfac less dispersed (smaller MI)": "yes"}), 3).startswith(
        "It does, in the means of 3 runs: with 3 of the 3")
