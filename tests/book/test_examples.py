"""The checks and bookkeeping of the chapter "Using SMP on your own model" (smp_book.examples).

The closed-form check of the linear-Gaussian regression must pass a correct run and fail one whose
variance is off (a run with another ``tau`` than the closed form's) or whose mean is (another start);
the MAP fit must reach the closed-form ridge-regression MAP of a linear model.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from smp_book.examples import (
    P_BEYOND_3,
    chance_beyond_3,
    fit_map,
    least_squares_linear,
    linear_gaussian_check,
    verdict,
)
from smp_core import run_smp
from smp_core.likelihoods import Gaussian
from smp_core.tail import add_gaussian_tail

NOISE = 0.5


@pytest.fixture(scope="module")
def linear_run():
    """A small linear-Gaussian SMP run from least squares, with its Gaussian tail."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(100, 2, generator=gen)
    y = x @ torch.tensor([1.0, -2.0]) + 0.5 + NOISE * torch.randn(100, generator=gen)
    linear, design = least_squares_linear(x, y)
    run = run_smp(linear, Gaussian(NOISE), x, preconditioner="fixed-dense", tau=1.0, n_steps=50, n_chains=1000,
                  seed=3, progress=False)
    limit = add_gaussian_tail(run, linear, Gaussian(NOISE), x, n_scores=300, seed=4)
    return linear, design, run, limit


def test_least_squares_linear_recovers_an_exact_fit():
    x = torch.randn(30, 3, generator=torch.Generator().manual_seed(1))
    y = x @ torch.tensor([0.5, -1.0, 2.0]) - 0.25
    linear, design = least_squares_linear(x, y)
    assert design.shape == (30, 4) and design.dtype == torch.float64
    assert torch.equal(design[:, 3], torch.ones(30, dtype=torch.float64))
    assert torch.allclose(linear.weight[0], torch.tensor([0.5, -1.0, 2.0]), atol=1e-5)
    assert torch.allclose(linear.bias, torch.tensor([-0.25]), atol=1e-5)
    with pytest.raises(ValueError, match="must be"):
        least_squares_linear(x, y[:-1])


def test_a_correct_run_meets_the_closed_form(linear_run):
    linear, design, run, limit = linear_run
    check = linear_gaussian_check(run, limit, design, NOISE, start=linear)
    assert check.n_checks == 27  # 3 groups x (3 means + 3 variances + 3 covariances)
    assert check.worst < 4, check.report()
    assert check.worst == max(abs(z) for z in check.z)
    assert check.table.shape == (9, 5)
    assert check.table["Bayes sd (flat prior)"].isna().sum() == 6  # Bayes's sd beside K = infinity only
    assert (check.shown()["Bayes sd (flat prior)"] == "").sum() == 6 and check.shown().notna().all().all()
    # sum_{k <= K} / sum_{k >= 1} (N + k)^-2 ~ K / (N + K + 1/2); N sum_{k >= 1} (N + k)^-2 ~ N / (N + 1/2)
    assert check.share_at_k == pytest.approx(50 / 150.5, rel=1e-3)
    assert check.bayes_ratio == pytest.approx(100 / 100.5, rel=1e-4)
    assert check.variance_se == pytest.approx(math.sqrt(2 / 999))
    assert check.verdict == verdict(check.worst, 27) and check.verdict in check.report()
    assert set(check.values()) >= {"share_at_k", "bayes_ratio", "variance_se", "n_checks", "worst", "one_in"}
    # the start as a tensor gives the same
    theta0 = torch.cat([linear.weight[0], linear.bias]).detach()
    assert linear_gaussian_check(run, limit, design, NOISE, start=theta0).worst == pytest.approx(check.worst)


def test_the_check_finds_a_wrong_tau(linear_run):
    linear, design, run, limit = linear_run
    # the run's variances are (1 / 0.8)^2 = 1.56 times the closed form's at tau = 0.8: z of about 9
    check = linear_gaussian_check(run, limit, design, NOISE, start=linear, tau=0.8)
    assert check.worst > 6
    assert check.table["z (variance)"].min() > 4
    assert check.verdict.startswith("a z beyond 4")


def test_the_check_finds_a_wrong_start(linear_run):
    linear, design, run, limit = linear_run
    shifted = torch.cat([linear.weight[0], linear.bias]).detach() + 0.05  # about 2 sd at K, 50 se of a mean
    check = linear_gaussian_check(run, limit, design, NOISE, start=shifted)
    assert check.worst > 10
    assert check.table.loc["the tail alone (K to infinity)", "z (mean)"].abs().max() < 4  # the tail has mean 0


def test_the_check_refuses_a_design_of_another_run(linear_run):
    linear, design, run, limit = linear_run
    with pytest.raises(ValueError, match="do not match"):
        linear_gaussian_check(run, limit, design[:50], NOISE, start=linear)


def test_verdict_and_chance():
    assert verdict(2.9, 27).startswith("every z within 3")
    assert verdict(3.5, 27).startswith("a z between 3 and 4") and "14" in verdict(3.5, 27)
    assert verdict(4.1, 27).startswith("a z beyond 4")
    assert P_BEYOND_3 == pytest.approx(0.0026998, rel=1e-4)
    assert chance_beyond_3(1) == pytest.approx(P_BEYOND_3)
    assert chance_beyond_3(27) == pytest.approx(1 - (1 - P_BEYOND_3) ** 27)


def test_fit_map_reaches_the_ridge_regression_map():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(50, 2, generator=gen)
    y = x @ torch.tensor([1.0, -1.0]) + 0.3 + 0.2 * torch.randn(50, generator=gen)
    net = nn.Linear(2, 1)
    gradient_norm = fit_map(net, Gaussian(0.2), x, y, prior_precision=3.0, adam_steps=10)
    design = torch.cat([x, torch.ones(50, 1)], dim=1).double()
    exact = torch.linalg.solve(design.T @ design / 0.04 + 3.0 * torch.eye(3), design.T @ y.double() / 0.04)
    assert net.weight.dtype == torch.float32
    assert torch.allclose(torch.cat([net.weight[0], net.bias]).double(), exact, atol=1e-5)
    assert gradient_norm < 1e-4


def test_fit_map_of_a_classifier_has_a_small_gradient():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(80, 2, generator=gen)
    y = (x[:, 0] + 0.5 * torch.randn(80, generator=gen) > 0).float()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
    assert fit_map(net, "bernoulli", x, y, prior_precision=1.0, max_iter=500) < 1e-5
