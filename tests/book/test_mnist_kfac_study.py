"""Tests of the MNIST KFAC chapter's helpers that turn its results into tables, numbers and sentences
(smp_book.mnist_kfac_study; its runs are tested in test_mnist_study.py)."""

import math

import pandas as pd

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


def test_shown_writes_missing_cells_as_a_dash():
    df = pd.DataFrame({"x": [1.23456, math.nan], "s": ["a", ""], "n": [3, 4]},
                      index=pd.Index([0.5, math.nan], name="tau"))
    from smp_book.show import shown

    out = shown(df, significant=True)
    assert out["x"].tolist() == ["1.23", "-"] and out["s"].tolist() == ["a", "-"] and out["n"].tolist() == [3, 4]
    assert list(out.index) == [0.5, "-"]
    assert shown(df)["x"].tolist() == [1.235, "-"]  # to decimals by default


def test_the_answer_says_what_its_evidence_is():
    rows = pd.DataFrame({"kfac less dispersed (smaller MI)": ["yes", "yes", "no"],
                         "kfac lower NLL": ["yes", "no", "no"]}, index=["fixed", "ema", "periodic"])
    one = mks.answer(rows, 1)
    assert one.startswith("Partly, in one run, whose spread over runs is not measured: with 2 of the 3 ")
    assert one.endswith("and with 1 its test NLL is smaller.")
    assert mks.answer(rows.assign(**{"kfac less dispersed (smaller MI)": "yes"}), 3).startswith(
        "It does, in the means of 3 runs: with 3 of the 3")
