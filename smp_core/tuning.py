"""Choosing ``tau`` for one's own model: short runs over a grid, judged on held-out data.

``tau`` scales every step (``gamma_k = tau / (N + k)``), so the spread of the chains grows with it, and a
``tau`` too large for the preconditioner makes chains diverge. With ``P`` the Fisher and ``tau = 1`` a
linear-Gaussian model is sampled exactly (the usage chapter checks it); for a network nothing fixes it, and
the default ``tau = 1`` is no more than a start. :func:`choose_tau` runs a short SMP at each ``tau`` of
a grid and scores the predictive mixture of its chains by the negative log-likelihood of held-out data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from .likelihoods import get_likelihood
from .models import ChainModel, predict
from .recursion import DivergenceError, as_tensor_input, check_tau, run_smp


def predictive_nll(model: nn.Module | ChainModel, likelihood, theta: torch.Tensor, x: torch.Tensor,
                   y: torch.Tensor) -> float:
    """``-(1/n) sum_i log((1/S) sum_s f(y_i | x_i, theta_s))``: the mean negative log-likelihood of ``(x, y)``
    under the predictive mixture of the samples ``theta`` ``(S, d)`` (rows that diverged are left out, with
    :func:`~smp_core.models.predict`'s warning)."""
    lik = get_likelihood(likelihood)
    y = as_tensor_input("y", y)
    if y.ndim == 0 or y.shape[0] != len(x):
        raise ValueError(f"y must hold one response per row of x ({len(x)}), got shape {tuple(y.shape)}")
    out = predict(model, theta, x)  # (S, n, m)
    if out.shape[0] == 0:
        raise ValueError("theta holds no finite row: every sample diverged")
    log_p = torch.stack([lik.log_prob(o.double(), y) for o in out])  # (S, n)
    return float(-(torch.logsumexp(log_p, 0) - math.log(out.shape[0])).mean())


def choose_tau(model: nn.Module, likelihood, x_train, x_val, y_val, taus: Sequence[float], *,
               n_steps: int = 500, n_chains: int = 50, seed: int = 0, **run_kwargs) -> tuple[float, list[dict]]:
    """The ``tau`` of ``taus`` whose short run (``n_steps``, ``n_chains``, the other arguments of
    :func:`~smp_core.recursion.run_smp` in ``run_kwargs``) gives the lowest held-out :func:`predictive_nll`
    on ``(x_val, y_val)``, and one row per ``tau``: ``{"tau", "nll", "diverged"}``. A run in which more than
    half the chains diverged scores ``inf``. Every ``tau`` is checked before any run.

    Held-out data judge the spread: a ``tau`` too small gives a predictive as confident as the start point,
    one too large spreads the chains past what the data support. The run is short, so the choice is for
    that ``K``; the spread still grows a little with ``K`` (``residual_variance_ratio``)."""
    if isinstance(taus, str | bytes) or not isinstance(taus, Sequence) or len(taus) == 0:
        raise ValueError(f"taus must be a non-empty sequence of positive numbers, got {taus!r}")
    grid = [check_tau(tau) for tau in taus]
    x_val, y_val = as_tensor_input("x_val", x_val), as_tensor_input("y_val", y_val)
    if x_val.ndim < 2 or y_val.ndim == 0 or y_val.shape[0] != x_val.shape[0]:
        raise ValueError(f"x_val (n, *input_shape) and y_val (n, ...) must have the same n >= 1, got shapes "
                         f"{tuple(x_val.shape)} and {tuple(y_val.shape)}")
    rows = []
    for tau in grid:
        try:
            result = run_smp(model, likelihood, x_train, tau=tau, n_steps=n_steps, n_chains=n_chains, seed=seed,
                             progress=False, **run_kwargs)
            diverged = result.n_diverged
        except DivergenceError:
            result, diverged = None, n_chains
        if result is None or 2 * diverged > n_chains:
            nll = math.inf
        else:
            theta = result.theta[~result.diverged]
            x = x_val.to(theta.device, theta.dtype) if x_val.is_floating_point() else x_val.to(theta.device)
            nll = predictive_nll(model, likelihood, theta, x, y_val)
        rows.append({"tau": tau, "nll": nll, "diverged": diverged})
    best = min(rows, key=lambda row: row["nll"])
    if not math.isfinite(best["nll"]):
        raise DivergenceError(f"more than half the chains diverged at every tau of {grid}: try smaller ones")
    return best["tau"], rows
