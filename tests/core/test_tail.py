"""The Gaussian tail (smp_core.tail) against known truths.

For a linear model with a Gaussian likelihood (sigma = 1) the score at any theta is
``s = [x, 1] (y - g)`` with ``y - g ~ N(0, 1)`` independent of theta, so the recursion's increments
are independent of where the chain is and the covariance of the tail is known exactly:
``v P^{-1} F P^{-1}`` with ``F = mean_i [x_i, 1][x_i, 1]^T`` over the training inputs. Every
statistical check is a z-score of a sample covariance entry against its Monte Carlo standard error
(the standard deviation of the products over the chains, divided by sqrt(S)).
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from smp_core import Gaussian, run_smp
from smp_core.models import toy_mlp
from smp_core.preconditioners import preconditioner_from_name
from smp_core.recursion import residual_variance_ratio
from smp_core.tail import add_gaussian_tail, gaussian_tail, tail_variance

N_TRAIN = 40
Z_LIMIT = 4.5  # for the 10 distinct entries of a 4 x 4 covariance: a false alarm has probability < 1e-4


def _linear_problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N_TRAIN, 3, generator=gen, dtype=torch.float64)
    net = nn.Sequential(nn.Linear(3, 1)).double()
    features = torch.cat([x, torch.ones(N_TRAIN, 1, dtype=torch.float64)], dim=1)  # [x, 1]
    fisher = features.T @ features / N_TRAIN  # in the layout's order: weight (3), bias (1)
    return net, x, fisher


def _covariance_z(samples: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """z-scores of the sample second moments of mean-zero ``samples`` ``(S, d)`` against ``expected``."""
    products = samples[:, :, None] * samples[:, None, :]
    se = products.std(0) / math.sqrt(samples.shape[0])
    return (products.mean(0) - expected) / se


def test_tail_variance_is_the_sum_of_squared_steps():
    n, k0, k1, tau = 50, 10, 2000, 0.3
    steps = tau / (n + torch.arange(k0 + 1, k1 + 1, dtype=torch.float64))
    assert tail_variance(n, k0, k1, tau) == pytest.approx(float((steps**2).sum()), rel=1e-12)
    # to infinity: the sum to 10^6 plus the integral bound of the rest (error below 1e-12 relative)
    far = 1_000_000
    head = float(((1 / (n + torch.arange(k0 + 1, far + 1, dtype=torch.float64))) ** 2).sum())
    assert tail_variance(n, k0) == pytest.approx(head + 1 / (n + far + 0.5), rel=1e-10)
    # the paper's r_K^2 / r_0^2 (Section 3.2.3)
    assert tail_variance(500, 5000) / tail_variance(500, 0) == pytest.approx(residual_variance_ratio(500, 5000))
    assert tail_variance(n, k0, k0, tau) == 0.0


@pytest.mark.parametrize("kwargs, message", [
    ({"n_obs": 10, "k_from": 5, "k_to": 4}, "ends at"),
    ({"n_obs": 10, "k_from": -1}, "starts from"),
    ({"n_obs": -1, "k_from": 0}, "N must be"),
    ({"n_obs": 10, "k_from": 0, "tau": 0.0}, "tau"),
    ({"n_obs": 10, "k_from": 0, "tau": float("nan")}, "tau"),
])
def test_tail_variance_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tail_variance(**kwargs)


def _none_run(net, x, n_chains=8, n_steps=5, seed=0):
    return run_smp(net, Gaussian(1.0), x, preconditioner="none", tau=1.0, n_steps=n_steps, n_chains=n_chains,
                   seed=seed, progress=False)


def test_gaussian_tail_rejects_bad_input():
    net, x, _ = _linear_problem()
    res = _none_run(net, x)
    args = (net, Gaussian(1.0), x)
    with pytest.raises(ValueError, match="shape"):
        gaussian_tail(*args, res.theta[0], res.preconditioner, res.precond_state, tau=1.0, k_from=5)
    with pytest.raises(ValueError, match="n_scores"):
        gaussian_tail(*args, res.theta, res.preconditioner, res.precond_state, tau=1.0, k_from=5, n_scores=0)
    with pytest.raises(ValueError, match="NaN"):
        bad = x.clone()
        bad[0, 0] = float("nan")
        gaussian_tail(net, Gaussian(1.0), bad, res.theta, res.preconditioner, res.precond_state, tau=1.0, k_from=5)
    with pytest.raises(ValueError, match="all chains diverged"):
        gaussian_tail(*args, torch.full_like(res.theta, float("nan")), res.preconditioner, res.precond_state,
                      tau=1.0, k_from=5)
    with pytest.raises(ValueError, match="input"):
        gaussian_tail(*args[:2], x[:, :2], res.theta, res.preconditioner, res.precond_state, tau=1.0, k_from=5)


def test_gaussian_tail_keeps_diverged_chains_out_and_is_reproducible():
    net, x, _ = _linear_problem()
    res = _none_run(net, x)
    theta = res.theta.clone()
    theta[2] = float("nan")
    first = gaussian_tail(net, Gaussian(1.0), x, theta, res.preconditioner, res.precond_state, tau=1.0, k_from=5,
                          n_scores=20, seed=3)
    again = gaussian_tail(net, Gaussian(1.0), x, theta, res.preconditioner, res.precond_state, tau=1.0, k_from=5,
                          n_scores=20, seed=3)
    assert torch.isnan(first[2]).all()
    keep = torch.arange(theta.shape[0]) != 2
    assert torch.isfinite(first[keep]).all()
    assert torch.equal(torch.nan_to_num(first), torch.nan_to_num(again))
    assert not torch.equal(first[keep], theta[keep])


@pytest.mark.slow
@pytest.mark.parametrize("variant, n_scores", [
    ("none", 3), ("none", 200), ("fixed-dense", 3), ("fixed-dense", 200),
    # per-chain states (EMA: every chain its own P; periodic: recomputed at each chain's theta) and the
    # other structures: the second moment over chains is then the mean of v P_i^-1 F P_i^-1
    ("ema-diag", 50), ("ema-dense", 50), ("periodic-block", 50), ("fixed-diag", 50),
])
def test_tail_covariance_is_v_p_inv_f_p_inv(variant, n_scores):
    """Cov(tail) = v P^-1 F P^-1 for any number of scores M (M = 3: far from normal, same covariance)."""
    net, x, fisher = _linear_problem()
    n_chains, k0 = 4000, 20
    res = run_smp(net, Gaussian(1.0), x, tau=0.5, n_steps=k0, n_chains=n_chains, seed=1,
                  progress=False, preconditioner=preconditioner_from_name(variant, ridge=0.05, period=10))
    tail = add_gaussian_tail(res, net, Gaussian(1.0), x, k_to=None, n_scores=n_scores, seed=2) - res.theta
    p_inv = torch.linalg.inv(res.preconditioner.dense_matrix(res.precond_state).to(fisher.dtype))  # (C, d, d)
    expected = tail_variance(N_TRAIN, k0, None, 0.5) * (p_inv @ fisher @ p_inv).mean(0)
    assert (tail.mean(0) / (tail.std(0) / math.sqrt(n_chains))).abs().max() < Z_LIMIT  # mean zero, per coordinate
    z = _covariance_z(tail, expected)
    assert z.abs().max() < Z_LIMIT, z


@pytest.mark.slow
def test_hybrid_has_the_recursions_covariance_at_k():
    """Recursion to K0 then the tail to K: theta_K - theta_0 has covariance sum_{k<=K} gamma_k^2 F,
    exactly that of the recursion run to K (linear-Gaussian, no preconditioner)."""
    net, x, fisher = _linear_problem()
    n_chains, k0, k1 = 4000, 10, 400
    res = _none_run(net, x, n_chains=n_chains, n_steps=k0, seed=4)
    hybrid = add_gaussian_tail(res, net, Gaussian(1.0), x, k_to=k1, n_scores=50, seed=5)
    theta0 = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    z = _covariance_z(hybrid - theta0, tail_variance(N_TRAIN, 0, k1) * fisher)
    assert z.abs().max() < Z_LIMIT, z
    # and the guard that this check can fail: the recursion's own covariance at K0 is far smaller
    z_short = _covariance_z(res.theta - theta0, tail_variance(N_TRAIN, 0, k1) * fisher)
    assert z_short.abs().max() > 10


@pytest.mark.parametrize("statistic_dtype", [None, torch.float64])
def test_a_result_loaded_from_disk_keeps_its_preconditioner(statistic_dtype):
    """A result is plain data: torch.save keeps its preconditioner (settings, no closures), and the tail
    from the loaded result equals the original's (ema-block on the toy MLP, a per-chain state; with a
    float64 statistic too)."""
    torch.manual_seed(0)
    x = torch.rand(30, 2) * 2 - 1
    net = toy_mlp()
    res = run_smp(net, "bernoulli", x, tau=0.3, n_steps=20, n_chains=6, seed=0, progress=False,
                  preconditioner=preconditioner_from_name("ema-block", statistic_dtype=statistic_dtype))
    buffer = io.BytesIO()
    torch.save(res, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.preconditioner == res.preconditioner
    assert loaded.preconditioner.statistic_dtype == statistic_dtype
    direct = add_gaussian_tail(res, net, "bernoulli", x, n_scores=30, seed=9)
    torch.testing.assert_close(add_gaussian_tail(loaded, net, "bernoulli", x, n_scores=30, seed=9), direct)
    assert direct.dtype == torch.float32
