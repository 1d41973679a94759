"""The law of one step (smp_book.step_law) against exact traces.

The means of the drawn quantities are traces of the step's covariance ``P^{-1} F P^{-1}``
(``F``, the model-expected Fisher over the training inputs). For small models ``F``, ``P`` and the
Jacobians are computed exactly, and every statistical check is a z-score of a Monte Carlo mean
against the exact value, with the standard error of the draws.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from smp_book.step_law import draw_steps, predicted_variances, top_share
from smp_core import Gaussian, run_smp
from smp_core.layout import ParamLayout
from smp_core.models import toy_mlp
from smp_core.preconditioners import preconditioner_from_name
from smp_core.tail import tail_variance

Z_LIMIT = 4.0  # a handful of z-tests per test: a false alarm has probability below 1e-3


def _z(values, expected: float) -> float:
    values = torch.tensor(values.to_numpy(), dtype=torch.float64)
    return (float(values.mean()) - expected) / (float(values.std()) / math.sqrt(values.numel()))


def _linear_problem(n=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    net = nn.Sequential(nn.Linear(3, 1)).double()
    features = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], dim=1)  # [x, 1]: weight (3), bias (1)
    return net, x, features.T @ features / n


def _flat(net: nn.Module) -> torch.Tensor:
    return torch.cat([q.detach().reshape(-1) for q in net.parameters()])


def _fixed(net, likelihood, x, structure, ridge=0.05):
    """A fixed preconditioner built from the model-expected Fisher at the module's parameters."""
    res = run_smp(net, likelihood, x, tau=0.1, n_steps=1, n_chains=1,
                  seed=0, progress=False, preconditioner=preconditioner_from_name(f"fixed-{structure}", ridge=ridge))
    p = res.preconditioner.dense_matrix(res.precond_state)[0]
    return res, p


def test_traces_of_a_linear_gaussian_step():
    """Linear model, sigma = 1: s = [x, 1] e with e ~ N(0, 1), so E ss^T = F exactly and
    E ||u||^2 = tr(P^{-1} F P^{-1}), E (x_e^T u)^2 = tr(Phi_e^T Phi_e / n P^{-1} F P^{-1})."""
    net, x, fisher = _linear_problem()
    res, p = _fixed(net, Gaussian(1.0), x, "dense")
    assert torch.allclose(p - 0.05 * torch.eye(4, dtype=p.dtype), fisher, atol=1e-10)  # P = F + lambda I
    p_inv = torch.linalg.inv(p)
    cov = p_inv @ fisher @ p_inv
    x_eval = torch.randn(25, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    phi = torch.cat([x_eval, torch.ones(25, 1, dtype=torch.float64)], 1)
    eval_moment = phi.T @ phi / 25
    theta = _flat(net)
    draws = draw_steps(net, Gaussian(1.0), x, theta, res.preconditioner, res.precond_state, n_draws=4000,
                       groups={"weight": slice(0, 3), "bias": torch.tensor([False, False, False, True])},
                       x_eval=x_eval, seed=1, batch=300, jvp_batch=64)
    assert len(draws) == 4000 and draws["row"].between(0, 39).all()
    # log f(Y | X) of the drawn response: -e^2 / 2 - log(2 pi) / 2 with e ~ N(0, 1), mean -(1 + log 2 pi) / 2
    assert abs(_z(draws["log_prob"], -0.5 * (1 + math.log(2 * math.pi)))) < Z_LIMIT
    assert abs(_z(draws["score_sq"], float(fisher.trace()))) < Z_LIMIT
    assert abs(_z(draws["step_sq"], float(cov.trace()))) < Z_LIMIT
    assert abs(_z(draws["output_sq"], float((eval_moment * cov).sum()))) < Z_LIMIT
    # a group cuts u to its coordinates: J (u restricted) for the weight alone
    w = torch.zeros(4, dtype=torch.float64)
    w[:3] = 1
    assert abs(_z(draws["output_sq[weight]"], float((eval_moment * (w[:, None] * cov * w[None, :])).sum()))) < Z_LIMIT
    # the two groups split ||s||^2 and ||u||^2 exactly
    for column in ("step_sq", "score_sq"):
        parts = draws[f"{column}[weight]"] + draws[f"{column}[bias]"]
        assert parts.to_numpy() == pytest.approx(draws[column].to_numpy())


def test_output_change_of_a_nonlinear_network_is_its_jacobian():
    """toy MLP, Bernoulli: F = mean_i p_i (1 - p_i) g_i g_i^T (g_i the gradient of the logit), and the
    output change's mean is mean_e J_e P^{-1} F P^{-1} J_e^T with J_e the exact Jacobian (autograd)."""
    torch.manual_seed(0)
    net = toy_mlp().double()
    x = torch.randn(30, 2, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x_eval = torch.randn(7, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    res, p = _fixed(net, "bernoulli", x, "diag", ridge=1e-3)
    theta = _flat(net)

    layout = ParamLayout.from_module(net)

    def logits(flat, inputs):
        return torch.func.functional_call(net, layout.unflatten(flat), (inputs,))[:, 0]

    g = torch.autograd.functional.jacobian(lambda t: logits(t, x), theta)  # (30, d)
    prob = torch.sigmoid(logits(theta, x))
    fisher = (g.T * (prob * (1 - prob))) @ g / 30
    j_eval = torch.autograd.functional.jacobian(lambda t: logits(t, x_eval), theta)  # (7, d)
    p_inv = torch.linalg.inv(p)
    cov = p_inv @ fisher @ p_inv
    draws = draw_steps(net, "bernoulli", x, theta, res.preconditioner, res.precond_state, n_draws=3000,
                       x_eval=x_eval, seed=4, batch=500)
    assert abs(_z(draws["score_sq"], float(fisher.trace()))) < Z_LIMIT
    assert abs(_z(draws["step_sq"], float(cov.trace()))) < Z_LIMIT
    assert abs(_z(draws["output_sq"], float((j_eval @ cov @ j_eval.T).trace()) / 7)) < Z_LIMIT


def test_predicted_variances_match_a_run():
    """A fixed-P run of the linear-Gaussian problem, whose steps do not depend on theta: the mean over
    coordinates of the chains' squared distance from theta_0 (their mean, a martingale's), and the mean
    over evaluation points of the squared output change, against the predictions from drawn steps, with
    both standard errors."""
    net, x, _ = _linear_problem()
    n_steps, tau, chains = 30, 0.8, 3000
    run = run_smp(net, Gaussian(1.0), x, tau=tau, n_steps=n_steps, n_chains=chains,
                  seed=7, progress=False, preconditioner=preconditioner_from_name("fixed-dense", ridge=0.05))
    theta = _flat(net)
    x_eval = torch.randn(20, 3, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    phi = torch.cat([x_eval, torch.ones(20, 1, dtype=torch.float64)], 1)
    per_chain = {"params_variance": (run.theta - theta).square().mean(1),  # (S,)
                 "logits_variance": ((run.theta - theta) @ phi.T).square().mean(1)}  # the model is linear
    draws = draw_steps(net, Gaussian(1.0), x, theta, run.preconditioner, run.precond_state, n_draws=4000, seed=8,
                       batch=500, x_eval=x_eval)
    pred = predicted_variances(draws, n_obs=40, n_steps=n_steps, tau=tau, dim=4)
    v = tail_variance(40, 0, n_steps, tau)
    assert pred["params_variance"] == pytest.approx(v * draws["step_sq"].mean() / 4)
    assert pred["params_variance_se"] == pytest.approx(v * draws["step_sq"].std(ddof=1) / 4 / math.sqrt(4000))
    assert pred["logits_variance"] == pytest.approx(v * draws["output_sq"].mean())
    assert pred["logits_variance_se"] == pytest.approx(v * draws["output_sq"].std(ddof=1) / math.sqrt(4000))
    for column, values in per_chain.items():
        observed, observed_se = float(values.mean()), float(values.std()) / math.sqrt(chains)
        assert abs((observed - pred[column]) / math.hypot(observed_se, pred[f"{column}_se"])) < Z_LIMIT
    without = predicted_variances(draws.drop(columns="output_sq"), n_obs=40, n_steps=n_steps, tau=tau, dim=4)
    assert set(without) == {"params_variance", "params_variance_se"}  # no output change, no logits


def test_draws_are_reproducible_and_group_columns_named():
    net, x, _ = _linear_problem()
    res, _ = _fixed(net, Gaussian(1.0), x, "diag")
    theta = _flat(net)
    a = draw_steps(net, Gaussian(1.0), x, theta, res.preconditioner, res.precond_state, n_draws=7, seed=3, batch=3,
                   groups={"w": slice(0, 3)}, x_eval=x[:5])
    b = draw_steps(net, Gaussian(1.0), x, theta, res.preconditioner, res.precond_state, n_draws=7, seed=3, batch=3,
                   groups={"w": slice(0, 3)}, x_eval=x[:5])
    assert a.equals(b)
    assert list(a.columns) == ["row", "log_prob", "score_sq", "step_sq", "output_sq", "score_sq[w]", "step_sq[w]",
                               "output_sq[w]"]
    only = predicted_variances(a, 40, 10, 0.5, dim=3, group="w")
    assert only["params_variance"] == pytest.approx(tail_variance(40, 0, 10, 0.5) * a["step_sq[w]"].mean() / 3)
    assert "logits_variance" in only


def test_bad_input_is_named():
    net, x, _ = _linear_problem()
    res, _ = _fixed(net, Gaussian(1.0), x, "diag")
    theta = _flat(net)
    args = (net, Gaussian(1.0), x)
    state = (res.preconditioner, res.precond_state)
    with pytest.raises(ValueError, match="flat parameter vector"):
        draw_steps(*args, theta[None], *state, n_draws=2)
    with pytest.raises(ValueError, match="non-finite"):
        draw_steps(*args, theta * float("nan"), *state, n_draws=2)
    with pytest.raises(ValueError, match="n_draws"):
        draw_steps(*args, theta, *state, n_draws=0)
    with pytest.raises(ValueError, match="group 'g'"):
        draw_steps(*args, theta, *state, n_draws=2, groups={"g": torch.tensor([4])})
    with pytest.raises(ValueError, match="integer indices"):
        draw_steps(*args, theta, *state, n_draws=2, groups={"g": torch.ones(4, dtype=torch.float64)})
    with pytest.raises(ValueError, match="boolean mask"):
        draw_steps(*args, theta, *state, n_draws=2, groups={"g": torch.tensor([True, False])})
    with pytest.raises(ValueError, match="x_eval"):
        draw_steps(*args, theta, *state, n_draws=2, x_eval=torch.zeros(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="x_eval has non-finite"):
        draw_steps(*args, theta, *state, n_draws=2, x_eval=torch.full((3, 3), float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError, match="2 draws"):
        predicted_variances(draw_steps(*args, theta, *state, n_draws=1), 40, 10, 0.5, 4)


def test_a_state_with_one_p_per_chain_is_refused():
    """An EMA run's state has one P per chain: applying it to a batch of scores would pair chain i's P
    with score i, so it is refused, and one chain's state is accepted."""
    net, x, _ = _linear_problem()
    run = run_smp(net, Gaussian(1.0), x, preconditioner="ema-diag", tau=0.1, n_steps=3, n_chains=5, seed=0,
                  progress=False)
    with pytest.raises(ValueError, match="one P per chain"):
        draw_steps(net, Gaussian(1.0), x, _flat(net), run.preconditioner, run.precond_state, n_draws=5, batch=5)
    one = run.precond_state.of_chain(2)
    assert all(torch.equal(a, b[2:3]) for a, b in zip(one.stat, run.precond_state.stat, strict=True))
    draws = draw_steps(net, Gaussian(1.0), x, _flat(net), run.preconditioner, one, n_draws=6, batch=4)
    assert len(draws) == 6


def test_top_share():
    assert top_share([1.0, 1.0, 2.0, 6.0], 0.25) == pytest.approx(0.6)
    assert top_share([1.0, 1.0, 2.0, 6.0], 0.5) == pytest.approx(0.8)
    assert top_share([3.0, 1.0], 0.01) == pytest.approx(0.75)  # at least one value
    assert top_share([1.0] * 100, 0.07) == pytest.approx(0.07)  # 7 values, not 8 from 7.000000000000001
    assert math.isnan(top_share([0.0, 0.0], 0.5))
    with pytest.raises(ValueError, match="fraction"):
        top_share([1.0], 0.0)
    with pytest.raises(ValueError, match="non-negative"):
        top_share([1.0, -1.0], 0.5)
