"""The toy baselines study: its agreement measures and findings on hand-made tables, and one tiny run."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from smp_book import baseline_study as bs
from smp_book import toy
from smp_book import toy_study as ts
from smp_book.config import get_config


def _evaluation(prob, mi):
    return toy.Evaluation(scores={}, variances={}, curve=None,  # agreement reads the surfaces only
                         surfaces={"prob": np.asarray(prob, np.float32), "mi": np.asarray(mi, np.float32),
                                   "exp_entropy": np.zeros(len(prob), np.float32)})


def test_agreement_against_hand_computed_values():
    nuts_prob, nuts_mi = np.array([0.1, 0.5, 0.9, 0.2]), np.array([0.01, 0.04, 0.01, 0.02])
    run = {"evals": {
        "NUTS": _evaluation(nuts_prob, nuts_mi),
        "MAP": _evaluation(nuts_prob + 0.1, np.zeros(4)),  # a point estimate: no MI anywhere
        "wide": _evaluation(nuts_prob, 3 * nuts_mi),  # the same shape of MI, three times as much
        "elsewhere": _evaluation(nuts_prob[::-1], nuts_mi[::-1]),
    }}
    table = bs.agreement(run)
    assert list(table.columns) == bs.AGREEMENT_COLUMNS
    assert table.loc["NUTS"].tolist() == pytest.approx([0.0, 1.0, 1.0])
    assert table.loc["MAP", "tv_to_nuts"] == pytest.approx(0.1)
    assert np.isnan(table.loc["MAP", "mi_surface_corr"]) and table.loc["MAP", "mi_over_nuts"] == 0
    assert table.loc["wide", "mi_surface_corr"] == pytest.approx(1.0)
    assert table.loc["wide", "mi_over_nuts"] == pytest.approx(3.0)
    assert table.loc["elsewhere", "tv_to_nuts"] == pytest.approx(np.abs(nuts_prob - nuts_prob[::-1]).mean())
    assert table.loc["elsewhere", "mi_surface_corr"] == pytest.approx(np.corrcoef(nuts_mi, nuts_mi[::-1])[0, 1])


def test_findings_pick_the_best_and_rank_smp():
    names = ["NUTS", "NUTS-mean", "MAP", "SMP-ema-block", "Laplace-dense", "Laplace-dense-nn", "Ensemble"]
    agree = pd.DataFrame({"tv_to_nuts": [0, 0.02, 0.01, 0.03, 0.005, 0.1, 0.04],
                          "mi_surface_corr": [1, np.nan, np.nan, 0.9, 0.5, 0.2, 0.95],
                          "mi_over_nuts": [1, 0, 0, 4.0, 1.5, 20.0, 0.5]}, index=names)
    scores = pd.DataFrame({"nll": [0.1, 0.2, 0.15, 0.13, 0.12, 0.3, 0.11]}, index=names)
    found = bs.findings(agree, scores)
    assert found.loc["closest predictive to NUTS (mean absolute difference of p)", "best"] == "Laplace-dense"
    assert found.loc["closest predictive to NUTS (mean absolute difference of p)", "SMP-ema-block rank"] == "2"
    assert found.loc["MI surface most like NUTS's (highest correlation)", "best"] == "Ensemble"
    amount = "amount of MI closest to NUTS's (absolute log of the MI ratio)"
    assert found.loc[amount, "best"] == "Laplace-dense"  # |log 1.5| < |log 0.5| < |log 4|
    assert found.loc[amount, "SMP-ema-block rank"] == "3"
    assert found.loc["lowest test NLL", "best"] == "Ensemble"
    assert found["methods ranked"].iloc[0] == 4  # NUTS and the point estimates are not ranked
    assert "lead (se)" not in found.columns  # no per-replicate tables, no leads
    assert found.filter(like="linearised", axis=0)["best"].item() == "Laplace-dense"
    assert found.filter(like="linearised", axis=0)["SMP-ema-block rank"].item() == "–"
    assert "|" not in "".join(found.index)  # the criteria print inside a markdown table


def test_paired_leads_over_replicates():
    assert bs.paired_lead([1.0, 2.0, 3.0]) == pytest.approx(2 / (1 / np.sqrt(3)))
    assert np.isnan(bs.paired_lead([0.5])) and np.isnan(bs.paired_lead([1.0, 1.0]))
    names = ["NUTS", "NUTS-mean", "MAP", "SMP-ema-block", "Laplace-dense", "Laplace-dense-nn"]
    # three replicates: Laplace-dense beats SMP-ema-block by 0.01 +- 0.001 in tv (resolved), and the NLLs of
    # the two dense predictives differ by +0.1, -0.1, +0.3 (mean 0.1, se 0.115: not resolved)
    tv = {"Laplace-dense": [0.010, 0.011, 0.012], "SMP-ema-block": [0.019, 0.021, 0.023],
          "Laplace-dense-nn": [0.1, 0.1, 0.1]}
    nll = {"Laplace-dense": [0.2, 0.3, 0.1], "Laplace-dense-nn": [0.3, 0.2, 0.4], "SMP-ema-block": [0.5, 0.5, 0.5]}
    agree_rows, score_rows = [], []
    for r in range(3):
        for m in names:
            agree_rows.append({"replicate": r, "method": m, "tv_to_nuts": tv.get(m, [0.0] * 3)[r],
                               "mi_surface_corr": 0.5, "mi_over_nuts": 1.5})
            score_rows.append({"replicate": r, "method": m, "nll": nll.get(m, [0.1] * 3)[r]})
    agree_reps = pd.DataFrame(agree_rows).set_index(["replicate", "method"])
    score_reps = pd.DataFrame(score_rows).set_index(["replicate", "method"])
    found = bs.findings(agree_reps.groupby(level="method", sort=False).mean(),
                        score_reps.groupby(level="method", sort=False).mean(), agree_reps, score_reps)
    tv_row = found.loc["closest predictive to NUTS (mean absolute difference of p)"]
    assert (tv_row["best"], tv_row["runner-up"]) == ("Laplace-dense", "SMP-ema-block")
    assert tv_row["lead (se)"] == pytest.approx(round(0.01 / (0.001 / np.sqrt(3)), 1))
    assert tv_row["resolved"] == "yes"
    dense = found.filter(like="linearised", axis=0).iloc[0]
    assert (dense["best"], dense["runner-up"], dense["resolved"]) == ("Laplace-dense", "Laplace-dense-nn", "no")
    assert dense["lead (se)"] == pytest.approx(round(0.1 / (np.std([0.1, -0.1, 0.3], ddof=1) / np.sqrt(3)), 1))


def test_baseline_seeds_are_apart_from_the_toy_chapters():
    theirs, ours = toy.replicate_seeds(2026, 1), bs.baseline_seeds(2026, 1)
    assert set(theirs.values()).isdisjoint(ours.values())


@pytest.fixture(scope="module")
def tiny_run():
    cfg = {**get_config("toy_baselines", "ci"), "n_test": 200, "grid_per_axis": 11, "nuts_warmup": 60,
           "nuts_samples": 60, "n_chains": 30, "n_steps": 60, "ensemble_members": 3}
    return cfg, bs.run_replicate(cfg, 0, progress=False)


def test_a_tiny_run_has_every_row(tiny_run):
    cfg, run = tiny_run
    expected = ["NUTS", bs.SECOND_NUTS, "NUTS-mean", "SMP-none", "SMP-ema-block", "MAP", "SMP-none from MAP",
                "SMP-ema-block from MAP", "Laplace-diag", "Laplace-block", "Laplace-kfac", "Laplace-dense",
                "Laplace-dense-nn", "Ensemble"]
    assert list(run["evals"]) == expected
    assert set(run["elapsed"]) == set(expected)
    tables = bs.summarise([run])
    assert list(tables["agreement_mean"].index) == expected
    assert np.isfinite(tables["scores_mean"].to_numpy()).all()
    # the MAP climbs from NUTS-mean: L-BFGS never ends below its start
    from smp_book.nuts import log_posterior

    x, y = run["train"]
    at_start = float(log_posterior(run["theta_hat"].astype(np.float64), x.astype(np.float64), y.astype(np.float64)))
    assert run["map"]["converged"] and run["map"]["log_posterior"] >= at_start
    assert len(run["ensemble_log_posteriors"]) == cfg["ensemble_members"]
    # the linearised and the network's own predictive of one structure share its draws
    assert (run["evals"]["Laplace-dense"].variances["params_variance"]
            == run["evals"]["Laplace-dense-nn"].variances["params_variance"])
    assert run["elapsed"]["Laplace-dense"] == run["elapsed"]["Laplace-dense-nn"]
    # another start (equal scores would mean the MAP was ignored and NUTS-mean used again)
    assert run["evals"]["SMP-none from MAP"].scores != run["evals"]["SMP-none"].scores
    assert set(run["diverged"]) == {"SMP-none", "SMP-ema-block", "SMP-none from MAP", "SMP-ema-block from MAP"}
    # the second NUTS chain: the first's start, other random numbers, so other draws of the same posterior
    second = run["evals"][bs.SECOND_NUTS]
    assert second.scores != run["evals"]["NUTS"].scores
    assert run["second_nuts"]["num_divergences"] >= 0
    from smp_book.nuts import HIDDEN_UNIT_PERMUTATIONS, permute_hidden_units

    theta_hat = run["theta_hat"].astype(np.float64)  # the same basin: nearer NUTS-mean than any relabelling of it
    to_relabelled = min(np.linalg.norm(permute_hidden_units(theta_hat, p1, p2) - theta_hat)
                        for p1, p2 in HIDDEN_UNIT_PERMUTATIONS[1:])
    assert 0 < run["second_nuts"]["distance_between_means"] < to_relabelled / 2
    assert tables["agreement_mean"].loc[bs.SECOND_NUTS, "tv_to_nuts"] > 0
    assert bs.SECOND_NUTS not in bs.findings(tables["agreement_mean"], tables["scores_mean"])["best"].to_list()


def test_smp_rows_are_the_toy_chapters_chains(tiny_run):
    """SMP-ema-block drawn in this study (second in its list) equals the toy chapter's (sixth in the paper's)."""
    cfg, run = tiny_run
    torch.manual_seed(0)
    toy = ts.run_replicate(cfg, 0, variants=["none", "fixed-diag", "fixed-block", "fixed-dense", "ema-diag",
                                             "ema-block"], progress=False)
    for name in ("SMP-none", "SMP-ema-block"):
        assert toy["evals"][name].scores == run["evals"][name].scores


def test_beyond_nuts_noise_subtracts_the_second_chain_replicate_by_replicate():
    rows = []
    tv = {"NUTS": [0, 0, 0], bs.SECOND_NUTS: [0.010, 0.012, 0.014], "close": [0.011, 0.011, 0.016],
          "far": [0.030, 0.031, 0.035], "MAP": [0.02, 0.02, 0.02]}
    corr = {"NUTS": [1, 1, 1], bs.SECOND_NUTS: [0.9, 0.8, 0.9], "close": [0.9, 0.8, 0.9], "far": [0.5, 0.4, 0.6],
            "MAP": [np.nan] * 3}
    ratio = {"NUTS": [1, 1, 1], bs.SECOND_NUTS: [1.1, 0.9, 1.0], "close": [1.2, 1.1, 0.8], "far": [3.0, 4.0, 5.0],
             "MAP": [0.0] * 3}
    for r in range(3):
        for m in tv:
            rows.append({"replicate": r, "method": m, "tv_to_nuts": tv[m][r], "mi_surface_corr": corr[m][r],
                         "mi_over_nuts": ratio[m][r]})
    reps = pd.DataFrame(rows).set_index(["replicate", "method"])
    table = bs.beyond_nuts_noise(reps)
    assert list(table.index) == ["close", "far", "MAP"]  # neither NUTS nor its second chain
    tv_far = np.array(tv["far"]) - np.array(tv[bs.SECOND_NUTS])
    assert table.loc["far", ("mean |p - p_NUTS|", "excess")] == pytest.approx(tv_far.mean())
    assert table.loc["far", ("mean |p - p_NUTS|", "excess (se)")] == pytest.approx(
        tv_far.mean() / (tv_far.std(ddof=1) / np.sqrt(3)))
    assert table.loc["close", ("1 - MI surface correlation", "excess")] == pytest.approx(0.0)
    log_close = np.abs(np.log(ratio["close"])) - np.abs(np.log(ratio[bs.SECOND_NUTS]))
    assert table.loc["close", ("|log MI ratio|", "excess")] == pytest.approx(log_close.mean())
    assert table.loc["MAP", ("mean |p - p_NUTS|", "excess")] == pytest.approx(0.008)
    assert np.isnan(table.loc["MAP", ("|log MI ratio|", "excess")])  # a point estimate has no MI to compare
    assert np.isnan(table.loc["MAP", ("1 - MI surface correlation", "excess (se)")])
    with pytest.raises(KeyError, match="second NUTS chain"):
        bs.beyond_nuts_noise(reps.drop(bs.SECOND_NUTS, level="method"))


def test_relabel_towards_undoes_a_common_permutation_of_the_hidden_units():
    from smp_book.nuts import HIDDEN_UNIT_PERMUTATIONS, permute_hidden_units

    rng = np.random.default_rng(0)
    reference = rng.normal(size=20) * 2
    draws = reference + 0.1 * rng.normal(size=(200, 20))
    permuted = permute_hidden_units(draws, *HIDDEN_UNIT_PERMUTATIONS[7])  # another copy of the same basin
    back, labelling, distance = bs.relabel_towards(permuted, reference)
    assert labelling != 0 and distance == pytest.approx(np.linalg.norm(draws.mean(0) - reference))
    np.testing.assert_allclose(back, draws)
    same, labelling, _ = bs.relabel_towards(draws, reference)
    assert labelling == 0 and np.array_equal(same, draws)
