"""Tests of smp_book.regression_study (the regression with a gap, beside NUTS)."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from smp_book import regression_study as rs
from smp_book.config import get_config
from smp_core.metrics import rmse
from smp_core.models import as_chain_model
from smp_core.preconditioners import preconditioner_from_name
from smp_core.recursion import Fisher, run_smp


def test_gap_data_regions_shapes_and_seed():
    data = rs.gap_data(40, 30, 20, 0.1, seed=3)
    assert set(data) == {"train", "in range", "in the gap"}
    for name, n in (("train", 40), ("in range", 30), ("in the gap", 20)):
        x, y = data[name]
        assert x.shape == (n, 1) and y.shape == (n,)
    for name in ("train", "in range"):
        x = data[name][0][:, 0]
        assert (((x >= -3) & (x <= -1)) | ((x >= 1) & (x <= 3))).all()
        assert (x < 0).sum() == len(x) // 2
    assert ((data["in the gap"][0] > -1) & (data["in the gap"][0] < 1)).all()
    again = rs.gap_data(40, 30, 20, 0.1, seed=3)
    assert all(torch.equal(data[k][1], again[k][1]) for k in data)
    assert not torch.equal(data["train"][1], rs.gap_data(40, 30, 20, 0.1, seed=4)["train"][1])
    with pytest.raises(ValueError, match="at least 2 points"):
        rs.gap_data(1, 30, 20, 0.1, seed=0)


def test_jax_network_and_potential_equal_the_torch_ones():
    """NUTS's potential is the same posterior as the MAP's objective, with the parameters in the network's order."""
    import jax.numpy as jnp

    from smp_book.nuts import _cpu64

    torch.manual_seed(0)
    net = rs.regression_mlp(5).double()
    theta = as_chain_model(net).layout.flatten(net).detach()
    x = torch.linspace(-3, 3, 11, dtype=torch.float64)[:, None]
    y = torch.sin(x[:, 0])
    with _cpu64():
        out = np.asarray(rs.jax_outputs(jnp.asarray(theta.numpy()), jnp.asarray(x[:, 0].numpy()), 5))
        energy = float(rs.jax_minus_log_posterior(jnp.asarray(theta.numpy()), jnp.asarray(x[:, 0].numpy()),
                                                  jnp.asarray(y.numpy()), 5, 0.3, 2.0))
    np.testing.assert_allclose(out, net(x)[:, 0].detach().numpy(), rtol=1e-12)
    assert energy == pytest.approx(float(rs.minus_log_posterior(net, x, y, 0.3, 2.0).detach()), rel=1e-12)


def test_nuts_without_data_samples_the_prior():
    """With no data the posterior is the prior N(0, I / alpha): each coordinate's mean and variance against it, with
    standard errors from NumPyro's effective sample size of theta (the mean) and of theta^2 (the variance; at least
    100 per coordinate, or the test says so)."""
    from numpyro.diagnostics import effective_sample_size

    alpha, hidden, chains, draws = 4.0, 2, 2, 600
    empty = torch.zeros(0, 1)
    cfg = {"hidden": hidden, "noise": 0.1, "prior_precision": alpha, "nuts_chains": chains, "nuts_warmup": 300,
           "nuts_samples": draws, "nuts_target_accept": 0.8, "nuts_max_tree_depth": 6, "nuts_init_jitter": 0.5}
    samples, diagnostics = rs.run_nuts_regression(empty, torch.zeros(0), torch.zeros(3 * hidden + 1), cfg, seed=1,
                                                  x_eval=torch.zeros(3, 1))
    assert samples.shape == (chains * draws, 3 * hidden + 1)
    assert diagnostics["divergences"] == 0
    theta = samples.double().numpy()
    ess = np.asarray(effective_sample_size(theta.reshape(chains, draws, -1)))
    ess_sq = np.asarray(effective_sample_size((theta**2).reshape(chains, draws, -1)))  # for the variance
    assert min(ess.min(), ess_sq.min()) > 100, (ess, ess_sq)
    variance = 1 / alpha
    z_mean = theta.mean(0) / np.sqrt(variance / ess)
    z_var = (theta.var(0, ddof=1) - variance) / (variance * np.sqrt(2 / ess_sq))
    assert np.abs(z_mean).max() < 4, z_mean
    assert np.abs(z_var).max() < 4, z_var


def test_fit_map_reaches_a_stationary_point():
    data = rs.gap_data(30, 10, 10, 0.1, seed=0)
    state = torch.random.get_rng_state()
    net, fit = rs.fit_map(*data["train"], hidden=4, noise=0.1, prior_precision=1.0, restarts=2, seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)      # the caller's generator is left as it was
    assert next(net.parameters()).dtype == torch.float32
    assert fit["gradient_norm"] < 1e-3 * max(1.0, abs(fit["objective"]))
    again, _ = rs.fit_map(*data["train"], hidden=4, noise=0.1, prior_precision=1.0, restarts=2, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), again.parameters(), strict=True))


def test_method_label():
    assert rs.method_label("fixed-dense", 1e-4, 1e-4) == "SMP fixed-dense"
    assert rs.method_label("fixed-dense", 1.0, 1e-4) == "SMP fixed-dense, ridge 1"


@pytest.fixture(scope="module")
def small_run():
    cfg = {**get_config("regression", "ci"), "n_train": 20, "n_in": 30, "n_gap": 20, "grid_points": 9,
           "hidden": 4, "nuts_warmup": 50, "nuts_samples": 50, "n_chains": 8, "n_steps": 20, "tau_grid": [0.01, 1.0],
           "smp_variants": [["fixed-diag", 1e-4], ["fixed-dense", 1e-4]]}
    calls = []

    def recording_run_smp(net, likelihood, covariates, **kwargs):
        calls.append({"preconditioner": kwargs["preconditioner"], "covariates": covariates,
                      "fisher_x": kwargs["fisher"].x, "n_obs": kwargs["n_obs"], "seed": kwargs["seed"]})
        return run_smp(net, likelihood, covariates, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rs, "run_smp", recording_run_smp)
        run = rs.run_data_set(cfg, 0)
    return cfg, {**run, "run_smp_calls": calls}


def test_run_data_set_rows_and_reference(small_run):
    cfg, run = small_run
    rows = run["rows"]
    expected = ["NUTS", "MAP", "Laplace (linearised)", "SMP fixed-diag", "SMP fixed-diag", "SMP fixed-dense",
                "SMP fixed-dense"]
    assert list(rows["method"][::2]) == expected
    assert list(rows["tau"][::2].dropna()) == [0.01, 1.0, 0.01, 1.0]
    assert list(rows["region"][:2]) == list(rs.REGIONS)
    nuts = rows[rows["method"] == "NUTS"]
    assert (nuts["sd_ratio"] == 1.0).all()                           # NUTS against itself
    assert rows[rows["method"] == "MAP"]["sd_ratio"].isna().all()    # a point estimate has no spread
    assert set(rows.columns) >= {"rmse", "nll", "crps", "coverage", "interval_width", "sd_ratio", "diverged"}
    assert rows["diverged"].between(0, cfg["n_chains"]).all()
    for key, band in run["bands"].items():
        assert (band["q05"] <= band["q50"]).all() and (band["q50"] <= band["q95"]).all(), key
    assert set(run["nuts"]) >= {"divergences", "min_ess_outputs", "max_rhat_outputs", "wall_time_s"}
    assert (rows["rounding_warnings"] == 0).all()          # the dense statistic is float64 (cfg["statistic_dtype"])
    eigenvalues = run["fisher_eigenvalues"]
    assert eigenvalues.dtype == torch.float64 and eigenvalues.shape == (3 * cfg["hidden"] + 1,)
    assert (eigenvalues[:-1] >= eigenvalues[1:]).all()


def test_smp_runs_resample_the_training_inputs_with_their_seeds(small_run):
    """Algorithm 1's empirical design: every run resamples the training inputs, takes its Fisher there and N as
    their number, with the seed base + 100 + 10 v + t of setting v at tau position t."""
    cfg, run = small_run
    base = cfg["seed"]                                                     # data set 0
    x = rs.gap_data(cfg["n_train"], cfg["n_in"], cfg["n_gap"], cfg["noise"], base)["train"][0]
    calls = iter(run["run_smp_calls"])
    for v, preconditioner in enumerate(("fixed-diag", "fixed-dense")):
        for t in range(len(cfg["tau_grid"])):
            call = next(calls)
            assert call["preconditioner"].name == preconditioner
            assert torch.equal(call["covariates"], x) and torch.equal(call["fisher_x"], x)
            assert call["n_obs"] == cfg["n_train"] and call["seed"] == base + 100 + 10 * v + t
    assert next(calls, None) is None


def test_the_prior_runs_reproduce_the_reference_and_prior_table_sets_them_side_by_side(small_run):
    """compute's runs under other priors are data set 0 without SMP: under the chapter's prior, its reference again."""
    cfg, run = small_run
    alone = {a: rs.run_data_set({**cfg, "prior_precision": a, "smp_variants": []}, 0)["rows"]
             for a in (cfg["prior_precision"], 4.0)}
    references = run["rows"][run["rows"]["method"].isin(rs.REFERENCES)]
    pd.testing.assert_frame_equal(alone[cfg["prior_precision"]], references)
    table = rs.prior_table(list(alone.items()))
    assert list(table.index) == [(m, r) for m in ("NUTS", "Laplace (linearised)") for r in rs.REGIONS]
    nuts = references.set_index(["method", "region"]).loc[("NUTS", "in the gap")]
    assert table.loc[("NUTS", "in the gap")].tolist() == [nuts["median_sd"], alone[4.0].iloc[1]["median_sd"],
                                                          nuts["coverage"], alone[4.0].iloc[1]["coverage"]]


def _synthetic_rows():
    rows = []
    for method, tau, ratios in (("NUTS", math.nan, (1.0, 1.0)), ("SMP a", 0.1, (0.5, 0.05)), ("SMP a", 1.0, (2.0, 0.2)),
                                ("SMP b", 0.1, (math.nan, math.nan)), ("SMP b", 1.0, (8.0, 0.9))):
        for data_set in (0, 1):
            for region, ratio in zip(rs.REGIONS, ratios, strict=True):
                rows.append({"method": method, "tau": tau, "region": region, "sd_ratio": ratio * (1 + data_set),
                             "coverage": 0.9 if math.isfinite(ratio) else math.nan, "nll": 0.0, "data_set": data_set,
                             "diverged": 0 if math.isfinite(ratio) else 8})
    return pd.DataFrame(rows)


def test_summary_table_medians_and_counts():
    summary = rs.summary_table(_synthetic_rows())
    assert summary.loc[("SMP a", 1.0, "in range"), "sd_ratio"] == pytest.approx(3.0)   # median of 2 and 4
    assert summary.loc[("SMP b", 0.1, "in range"), "data_sets"] == 0
    assert summary.loc[("SMP b", 0.1, "in range"), "max_diverged"] == 8
    assert math.isnan(summary.index.get_level_values("tau")[0])                        # NUTS keeps a NaN tau


def test_best_tau_matches_on_the_log_scale_among_eligible_settings():
    summary = rs.summary_table(_synthetic_rows())
    in_range = rs.best_tau(summary, 2, "in range")
    # SMP a: medians 0.75 (tau 0.1) and 3 (tau 1): |log 0.75| < |log 3|; SMP b: only tau 1 has a result
    assert in_range.loc["SMP a", "tau"] == 0.1 and in_range.loc["SMP b", "tau"] == 1.0
    assert in_range.loc["SMP a", "sd_ratio (in the gap)"] == pytest.approx(0.075)
    assert bool(in_range.loc["SMP a", "within 2x"]) and not bool(in_range.loc["SMP b", "within 2x"])  # 12 > 2
    assert in_range.loc["SMP a", "eligible taus"] == 2 and in_range.loc["SMP b", "eligible taus"] == 1
    in_gap = rs.best_tau(summary, 2, "in the gap")
    assert in_gap.loc["SMP a", "tau"] == 1.0
    # a setting with diverged chains on one data set, or a result on only one, is not eligible
    rows = _synthetic_rows()
    rows.loc[(rows["method"] == "SMP a") & (rows["tau"] == 0.1) & (rows["data_set"] == 1), "diverged"] = 3
    assert rs.best_tau(rs.summary_table(rows), 2, "in range").loc["SMP a", "tau"] == 1.0
    rows = _synthetic_rows()
    rows.loc[(rows["method"] == "SMP a") & (rows["tau"] == 0.1) & (rows["data_set"] == 1), ["sd_ratio", "coverage"]] = (
        math.nan)
    assert rs.best_tau(rs.summary_table(rows), 2, "in range").loc["SMP a", "tau"] == 1.0
    rows.loc[rows["method"] == "SMP b", ["sd_ratio", "coverage"]] = math.nan          # every chain diverged
    none = rs.best_tau(rs.summary_table(rows), 2, "in range").loc["SMP b"]
    assert math.isnan(none["tau"]) and not none["within 2x"] and none["eligible taus"] == 0


def test_matched_in_both_needs_every_region_within_the_factor():
    summary = rs.summary_table(_synthetic_rows())
    # medians over the two data sets (ratio * 1 and ratio * 2): SMP a at 0.1 (0.75, 0.075), at 1.0 (3.0, 0.3);
    # SMP b at 1.0 (12, 1.35); SMP b at 0.1 diverged (not eligible); NUTS (1, 1) is not an SMP setting
    assert rs.matched_in_both(summary, 2) == []
    assert rs.matched_in_both(summary, 2, factor=4.0) == [("SMP a", 1.0)]
    assert rs.matched_in_both(summary, 2, factor=13.0) == [("SMP a", 1.0), ("SMP b", 1.0)]
    assert rs.matched_in_both(summary, 2, factor=14.0) == [("SMP a", 0.1), ("SMP a", 1.0), ("SMP b", 1.0)]
    rows = _synthetic_rows()
    rows.loc[(rows["method"] == "SMP a") & (rows["tau"] == 1.0) & (rows["data_set"] == 0), "diverged"] = 3
    assert rs.matched_in_both(rs.summary_table(rows), 2, factor=4.0) == []  # finite ratios, but a chain diverged


def test_spread_shape_is_the_gap_ratio_over_the_range_ratio():
    shape = rs.spread_shape(_synthetic_rows(), 2)
    assert list(shape.index) == ["NUTS", "SMP a", "SMP b"]
    assert shape.loc["NUTS"].dropna().tolist() == [1.0]
    assert shape.loc["SMP a", 0.1] == pytest.approx(0.1) and shape.loc["SMP a", 1.0] == pytest.approx(0.1)
    assert math.isnan(shape.loc["SMP b", 0.1]) and shape.loc["SMP b", 1.0] == pytest.approx(0.9 / 8)
    rows = _synthetic_rows()
    rows.loc[(rows["method"] == "SMP a") & (rows["tau"] == 1.0) & (rows["data_set"] == 0), "diverged"] = 1
    assert math.isnan(rs.spread_shape(rows, 2).loc["SMP a", 1.0])                     # not eligible


def test_evaluate_spread_ratio_and_scores():
    """Means spread twice as wide as the reference give a ratio of 2; a point estimate none."""
    data = rs.gap_data(10, 40, 30, 0.1, seed=1)
    gen = torch.Generator().manual_seed(2)
    reference = {region: torch.randn(50, len(data[region][0]), 1, generator=gen) for region in rs.REGIONS}
    sd = {region: reference[region][..., 0].double().std(dim=0) for region in rs.REGIONS}
    doubled = {region: 2 * reference[region] for region in rs.REGIONS}
    scored = rs.evaluate(doubled, sd, data, 0.1, 0.9)
    assert all(scored[region]["sd_ratio"] == pytest.approx(2.0) for region in rs.REGIONS)
    assert scored["in the gap"]["median_sd"] == pytest.approx(float((2 * sd["in the gap"]).median()))
    assert scored["in range"]["rmse"] == pytest.approx(rmse(doubled["in range"], data["in range"][1]))
    point = rs.evaluate({r: m[:1] for r, m in reference.items()}, sd, data, 0.1, 0.9)
    assert all(math.isnan(point[region]["sd_ratio"]) for region in rs.REGIONS)


@pytest.fixture(scope="module")
def tiny_map():
    """A MAP on 6 points with d = 13 (float64), its training inputs and an orthonormal basis of the null space of its
    Fisher (dimension 7), and a function: the median share of a short SMP run's displacement outside the range of F."""
    from smp_core import estimate_fisher, run_smp
    from smp_core.likelihoods import Gaussian

    data = rs.gap_data(6, 2, 2, 0.1, seed=0)
    net, _ = rs.fit_map(*data["train"], hidden=4, noise=0.1, prior_precision=1.0, restarts=1, seed=0)
    net = net.double()
    chain = as_chain_model(net)
    theta0 = chain.layout.flatten(net).detach()
    x = data["train"][0].double()
    fisher = estimate_fisher(chain, Gaussian(0.1), theta0, x, structure="dense", dtype=torch.float64)[0][0]
    values, vectors = torch.linalg.eigh(fisher)
    null = vectors[:, values < 1e-10 * values.max()]
    assert null.shape[1] == theta0.numel() - 6

    def outside_share(preconditioner, tau, ridge):
        run = run_smp(net, Gaussian(0.1), x, tau=tau, n_steps=50, n_chains=20, seed=1, progress=False, n_obs=len(x),
                      preconditioner=preconditioner_from_name(preconditioner, ridge=ridge),
                      fisher=Fisher("model", x, None))
        delta = run.theta - theta0
        return float(((delta @ null).norm(dim=1) / delta.norm(dim=1)).median())

    return x, outside_share


def test_the_chapters_mechanism_none_and_dense_steps_stay_in_the_fishers_range(tiny_map):
    """The chapter's argument: the score lies in the range of F (the span of the Jacobians at the training inputs),
    which P = I and a fixed dense P = F + lambda I keep, so a short run near the MAP moves the parameters (float64
    chains) almost only within it; a diagonal P^-1 does not keep it, and there most of the displacement falls outside
    (which shows that the measure can see it). 6 points and d = 13: F has a null space of dimension 7."""
    _, outside_share = tiny_map
    assert outside_share("none", 1e-3, 1e-4) < 0.02
    assert outside_share("fixed-dense", 1e-2, 1.0) < 0.02
    assert outside_share("fixed-diag", 1e-3, 1e-4) > 0.3


@pytest.mark.parametrize("change, match", [
    ({"smp_variants": [["none", 1e-4], ["none", 1e-4]]}, "share a label"),
    ({"smp_variants": [["fixed-dens", 1.0]]}, "unknown preconditioner"),
    ({"smp_variants": [["none"]]}, "smp_variants entry"),
    ({"tau_grid": [0.1] * 11}, "at most 10 taus")])
def test_run_data_set_refuses_bad_settings_before_any_work(change, match, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the data were drawn before the settings were checked")

    monkeypatch.setattr(rs, "gap_data", no_work)
    with pytest.raises(ValueError, match=match):
        rs.run_data_set({**get_config("regression", "ci"), **change}, 0)


def test_wide_table_puts_the_regions_side_by_side_and_shown_marks_missing_cells():
    wide = rs.wide_table(rs.summary_table(_synthetic_rows()), ("sd_ratio", "coverage"))
    assert list(wide.columns) == ["sd_ratio (in range)", "sd_ratio (in the gap)", "coverage (in range)",
                                  "coverage (in the gap)", "max_diverged", "data_sets"]
    assert wide.loc[("SMP a", 1.0), "sd_ratio (in the gap)"] == pytest.approx(0.3)
    from smp_book.show import shown as show

    shown = show(wide)
    assert ("NUTS", "-") in shown.index                                   # NUTS has no tau
    assert shown.loc[("SMP b", 0.1), "sd_ratio (in range)"] == "-"       # every chain diverged
    assert shown.loc[("SMP a", 0.1), "sd_ratio (in range)"] == 0.75
