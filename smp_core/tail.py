"""The Gaussian tail of the recursion: hybrid sampling (beyond the paper; its Section 4.4 leaves it open).

After ``K`` steps of Algorithm 1 the rest of the recursion is a sum of martingale differences,

    theta_inf - theta_K = sum_{k > K} gamma_k P_k^{-1} s_k,   gamma_k = tau / (N + k),

whose conditional covariances are ``gamma_k^2 P_k^{-1} F(theta_{k-1}) P_k^{-1}``, with
``F(theta) = E_{X ~ f_emp} E_{Y ~ f_theta(.|X)} [s s^T]`` the model-expected Fisher over the
empirical design: the covariance of the score as the recursion itself draws it (Section 3.1). The
predictive central limit theorem of Fong and Yiu (arXiv 2410.17692, the paper's
``fong2026asymptotics``) justifies replacing those steps by one normal draw; with ``theta`` and
``P`` frozen at their step-``K`` values:

    theta_{K'} ~= theta_K + N(0, v_{K,K'} P_K^{-1} F(theta_K) P_K^{-1}),
    v_{K,K'} = sum_{k=K+1}^{K'} tau^2 / (N + k)^2                       (K' = inf allowed).

:func:`tail_variance` is ``v``. :func:`gaussian_tail` draws the normal term without forming a
``d x d`` matrix: with ``M`` scores ``s_1, ..., s_M`` drawn at ``theta_K`` exactly as the recursion
draws them (a covariate resampled from the training inputs, a response from the model) and
independent standard normals ``eps_j``,

    z = P_K^{-1} M^{-1/2} sum_j eps_j s_j

has the covariance ``P_K^{-1} F_M P_K^{-1}`` given the scores (``F_M`` their second moment) and
``P_K^{-1} F(theta_K) P_K^{-1}`` unconditionally, for any ``M`` (``E F_M = F``); it is a normal
scale mixture that tends to the normal as ``M`` grows. ``sum_j eps_j s_j`` is one backward pass per
``j`` (the residual weighted by ``eps_j``), the cost of ``M`` steps without their updates.

The approximation has the exact covariance when the score's covariance and ``P`` do not change over
the tail (a linear-Gaussian model with ``none`` or a fixed preconditioner); it is only as good as
``theta`` and ``P`` are stable after step ``K`` otherwise (the EMA and periodic strategies keep
changing ``P``; the notebook ``toy_tail`` measures the difference against the recursion itself).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from ._progress import progress_bar, trigamma
from .fast_paths import accepts_out
from .likelihoods import check_output_dim, get_likelihood
from .models import ChainModel, as_chain_model, check_deterministic
from .preconditioners import Preconditioner, PreconditionerState
from .recursion import SMPResult, _as_count, as_tensor_input, check_training_inputs
from .streams import TAIL_COVARIATE, TAIL_RESPONSE, TAIL_WEIGHT, ChainStreams, check_seed, has_noise


def tail_variance(n_obs: int, k_from: int, k_to: int | None = None, tau: float = 1.0) -> float:
    """``v_{K,K'} = sum_{k=K+1}^{K'} tau^2 / (N + k)^2``: the scale of the tail's covariance.

    ``sum_{k>K} (N + k)^{-2}`` is the trigamma function at ``N + K + 1``, so the finite sum is a
    difference of two trigammas; ``k_to=None`` is ``K' = inf``. ``tail_variance(N, 0, None, 1)`` is
    the paper's ``r_0^2`` and ``tail_variance(N, K)`` its ``r_K^2`` (Section 3.2.3).
    """
    if not (isinstance(n_obs, numbers.Integral) and not isinstance(n_obs, bool) and n_obs >= 0):
        raise ValueError(f"N must be a non-negative integer, got {n_obs!r}")
    if not (isinstance(k_from, int) and k_from >= 0):
        raise ValueError(f"the step the tail starts from must be a non-negative integer, got {k_from!r}")
    if k_to is not None and not (isinstance(k_to, int) and k_to >= k_from):
        raise ValueError(f"the step the tail ends at must be an integer >= {k_from} (or None for infinity), "
                         f"got {k_to!r}")
    if not (isinstance(tau, int | float) and math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau must be a positive finite number, got {tau!r}")
    if n_obs + k_from + 1 <= 0:
        raise ValueError("N + K must be at least 0")
    head = trigamma(n_obs + k_from + 1)
    rest = 0.0 if k_to is None else trigamma(n_obs + k_to + 1)
    return float(tau) ** 2 * (head - rest)


@torch.no_grad()
def gaussian_tail(
    model: nn.Module | ChainModel,
    likelihood,
    x_train: torch.Tensor,
    theta: torch.Tensor,
    preconditioner: Preconditioner,
    precond_state: PreconditionerState,
    *,
    tau: float,
    k_from: int,
    k_to: int | None = None,
    n_obs: int | None = None,
    n_scores: int = 1000,
    seed: int = 0,
    first_chain: int = 0,
    progress: bool = False,
) -> torch.Tensor:
    """``theta_K`` plus one draw of the Gaussian tail from step ``k_from`` to ``k_to`` per chain.

    Args:
        model, likelihood, x_train: as for :func:`~smp_core.recursion.run_smp` (covariates are resampled from
            ``x_train``, responses drawn from the model at ``theta``).
        theta: ``(S, d)`` parameters at step ``k_from``; rows with NaN (diverged chains) stay NaN.
        preconditioner, precond_state: the preconditioner after step ``K``, the one step ``K + 1``
            would use (e.g. ``SMPResult.preconditioner`` and ``SMPResult.precond_state``; with
            ``ema_refresh > 1`` its last factorisation); its ``solve`` is applied once per chain.
        tau: the run's step-size scale. k_from: ``K``, the steps already taken. k_to: ``K'``, the
            step the tail replaces the recursion up to (``None``: infinity).
        n_obs: ``N`` in the step size (default ``len(x_train)``).
        n_scores: ``M``, the scores per chain whose normal-weighted sum gives the draw (the
            covariance is right for any ``M``; the draw is normal as ``M`` grows).
        seed, first_chain: the chains' random streams (:mod:`smp_core.streams`, with purposes of their
            own: the tail under the run's seed draws other numbers than the run).

    Returns:
        ``(S, d)``: ``theta + sqrt(v) P^{-1} M^{-1/2} sum_j eps_j s_j`` (module docstring).
    """
    x_train = as_tensor_input("x_train", x_train)
    check_deterministic(model)  # before wrapping: a training-mode batch norm fails on the probe input
    net = as_chain_model(model, tuple(x_train.shape[1:]))
    lik = get_likelihood(likelihood)
    dim = net.layout.dim
    if theta.ndim != 2 or theta.shape[1] != dim:
        raise ValueError(f"theta must have shape (S, {dim}) (one row per chain), got {tuple(theta.shape)}")
    n_scores = _as_count("n_scores", n_scores, 1)
    streams = ChainStreams(check_seed(seed), _as_count("first_chain", first_chain, 0), theta.shape[0])
    if not has_noise(lik):
        raise TypeError(f"the likelihood {type(lik).__name__} has no noise_width / noise_from_uniforms / "
                        "sample_from_noise, which the chains' random streams need (see smp_core.likelihoods)")
    x_train = x_train.to(device=theta.device, dtype=theta.dtype)
    check_training_inputs(net, x_train)
    check_output_dim(lik, getattr(net, "out_dim", None))  # (determinism was checked before wrapping)
    n_obs = _as_count("n_obs (N in gamma_k = tau / (N + k))", x_train.shape[0] if n_obs is None else n_obs, 0)
    variance = tail_variance(n_obs, k_from, k_to, tau)
    alive = torch.isfinite(theta).all(1)
    if not bool(alive.any()):
        raise ValueError("every row of theta is non-finite (all chains diverged): there is no tail to add")
    # diverged rows compute at a finite stand-in (their result is NaN again below)
    start = torch.where(alive[:, None], theta, theta[alive][:1]).contiguous()
    device, dtype, out_dim = theta.device, theta.dtype, net.out_dim
    total = torch.zeros_like(start)
    # one (S, d) score buffer for every pass, as the recursion does (no fresh tensor per score)
    vjp_out = {"out": torch.empty_like(start)} if accepts_out(net.vjp) else {}
    for j in progress_bar(range(1, n_scores + 1), disable=not progress, desc="Gaussian tail", mininterval=1.0):
        rows = x_train.index_select(0, streams.covariates(j, 1, x_train.shape[0], device, TAIL_COVARIATE)[0])
        out, ctx = net.forward(start, rows)
        weights = streams.normals(TAIL_WEIGHT, j, 1, 1, device)[0].to(dtype)  # (S, 1)
        noise = streams.response_noise(lik, j, 1, out_dim, device, dtype, TAIL_RESPONSE)[0]
        residual = lik.residual(out, lik.sample_from_noise(out, noise)) * weights
        total += net.vjp(ctx, residual, **vjp_out)
    total.masked_fill_(~alive[:, None], 0.0)
    z = preconditioner.solve(precond_state, total / math.sqrt(n_scores))
    result = start + math.sqrt(variance) * z
    result[~alive] = float("nan")
    return result


def add_gaussian_tail(result: SMPResult, model: nn.Module | ChainModel, likelihood, x_train: torch.Tensor, *,
                      k_to: int | None = None, n_scores: int = 1000, seed: int = 0,
                      progress: bool = False) -> torch.Tensor:
    """The hybrid sample: a finished run's ``theta_K`` plus the Gaussian tail to ``k_to`` (``None``:
    infinity), with the run's own ``tau``, ``N``, ``K`` and final preconditioner.

    ``model``, ``likelihood`` and ``x_train`` must be those of the run. Diverged chains stay NaN.
    """
    if not isinstance(result, SMPResult):
        raise TypeError(f"result must be the SMPResult of run_smp, got {type(result).__name__}")
    cfg = result.config
    return gaussian_tail(model, likelihood, x_train, result.theta, result.preconditioner, result.precond_state,
                         tau=cfg["tau"], k_from=cfg["n_steps"], k_to=k_to, n_obs=cfg["n_obs"], n_scores=n_scores,
                         seed=seed, first_chain=cfg["first_chain"], progress=progress)
