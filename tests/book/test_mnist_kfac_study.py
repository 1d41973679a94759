"""Tests of the MNIST KFAC chapter's helpers that turn its results into tables and sentences
(smp_book.mnist_kfac_study; the runs and the step law are tested in test_mnist_study.py)."""

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


def _sets(z_params, z_logits):
    """A table shaped like step_law_sets: predictions 1 with standard error 0.1 and the observed values that
    lie z standard errors above them (pooled), the set difference 0.5."""
    rows = []
    for method, zp, zl in zip(["SMP-none", "SMP-fixed-diag"], z_params, z_logits, strict=True):
        for name in ("set 0", "set 1", "pooled"):
            rows.append({"method": method, "set": name, **{
                f"{c}: {k}": v for c, z in (("params_variance", zp), ("logits_variance", zl))
                for k, v in (("predicted", 1.0), ("predicted se", 0.1), ("observed / predicted", 1 + 0.1 * z))}})
        rows.append({"method": method, "set": "difference (se)", "params_variance: predicted": -0.5,
                     "logits_variance: predicted": 0.5})
    return pd.DataFrame(rows).set_index(["method", "set"])


def test_sets_text_counts_the_observed_values_within_two_standard_errors():
    text, quoted = mks.sets_text(_sets([0.5, 1.0], [-1.5, 30.0]))
    assert quoted["pooled_within"] == 3 and quoted["pooled_cells"] == 4
    assert quoted["difference_min"] == -0.5 and quoted["difference_max"] == 0.5
    assert "SMP-fixed-diag's logit variance (4.0 times its pooled prediction, 30.0 standard errors)" in text
    text, quoted = mks.sets_text(_sets([0.5, 1.0], [-1.5, 2.0]))
    assert quoted["pooled_within"] == 4 and "beyond" not in text


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
