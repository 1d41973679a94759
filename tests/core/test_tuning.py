"""choose_tau and predictive_nll: the held-out score of a predictive mixture, and the grid search over tau."""

import math

import pytest
import torch
from torch import nn

import smp_core.tuning as tuning
from smp_core import DivergenceError, Gaussian
from smp_core.layout import ParamLayout


def _data(n=60, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=gen)
    return x, (x[:, 0] - x[:, 1] > 0).float()


def test_predictive_nll_is_the_mixtures_mean_negative_log_likelihood():
    torch.manual_seed(0)
    net = nn.Linear(2, 1)
    x, y = _data(7)
    theta = torch.randn(3, ParamLayout.from_module(net).dim)
    # by hand: p_s(y_i) = sigmoid(+-(x_i w_s + b_s)), mixed over s, then -mean log
    logits = x @ theta[:, :2].T + theta[:, 2]  # (n, S)
    p = torch.where(y[:, None] == 1, torch.sigmoid(logits), torch.sigmoid(-logits)).double()
    expected = -torch.log(p.mean(1)).mean()
    assert tuning.predictive_nll(net, "bernoulli", theta, x, y) == pytest.approx(float(expected), rel=1e-6)
    # one sample: the plain mean negative log-likelihood; a Gaussian with its sigma
    yr = torch.randn(7)
    mean = (x @ theta[0, :2] + theta[0, 2]).double()
    gauss = 0.5 * ((yr - mean) / 0.5) ** 2 + 0.5 * math.log(2 * math.pi) + math.log(0.5)
    assert tuning.predictive_nll(net, Gaussian(0.5), theta[:1], x, yr) == pytest.approx(float(gauss.mean()), rel=1e-6)


def test_choose_tau_returns_the_grids_best_and_scores_a_diverging_tau_as_infinite():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
    x, y = _data(60)
    x_val, y_val = _data(60, seed=1)
    best, rows = tuning.choose_tau(net, "bernoulli", x, x_val, y_val, [0.1, 1e7], n_steps=20, n_chains=8,
                                   options={"check_every": 10, "divergence_threshold": 50.0})
    assert [row["tau"] for row in rows] == [0.1, 1e7]
    assert math.isfinite(rows[0]["nll"]) and rows[1]["nll"] == math.inf and rows[1]["diverged"] > 4
    assert best == 0.1
    with pytest.raises(DivergenceError, match="every tau"):
        tuning.choose_tau(net, "bernoulli", x, x_val, y_val, [1e7], n_steps=20, n_chains=8,
                          options={"check_every": 10, "divergence_threshold": 50.0})


@pytest.mark.parametrize("kwargs, match", [
    (dict(taus=[]), "taus must be a non-empty sequence"),
    (dict(taus=0.3), "taus must be a non-empty sequence"),
    (dict(taus=[0.1, -1.0]), "tau must be a positive finite number"),
    (dict(taus=[0.1, "1"]), "tau must be a positive finite number"),
    (dict(y_val=torch.zeros(5)), r"x_val \(n, \*input_shape\) and y_val \(n, ...\) must have the same n"),
])
def test_choose_tau_refuses_bad_input_before_any_run(kwargs, match, monkeypatch):
    monkeypatch.setattr(tuning, "run_smp", lambda *a, **k: pytest.fail("a run started"))
    x, y = _data(10)
    args = dict(x_train=x, x_val=x, y_val=y, taus=[0.1])
    with pytest.raises(ValueError, match=match):
        tuning.choose_tau(nn.Linear(2, 1), "bernoulli", **{**args, **kwargs})
