"""The SMP recursion of Algorithm 1: S chains of predictive resampling in parallel.

For every chain ``l`` and step ``k = 1, ..., K`` (the empirical design of Section 3.1):

1. ``X_k ~ f_emp``: a covariate drawn with replacement from the ``N`` training inputs;
2. ``Y_k ~ f_{theta_{k-1}}(. | X_k)``: a response drawn from the model;
3. ``s_k = grad_theta log f_{theta_{k-1}}(Y_k | X_k)``: the score;
4. ``theta_k = theta_{k-1} + tau / (N + k) * P_k^{-1} s_k`` (eq. 2.14), moving **up** the
   log-likelihood (a test guards the sign);
5. the preconditioner folds in ``s_k`` or recomputes, so that ``P_{k+1}`` is ``F_k``-measurable and
   ``theta_k`` stays a martingale (eq. 2.15).

:func:`plain_steps` is that loop, written out; the fast paths of :mod:`smp_core.fast_paths` run the
same steps from the same random numbers (one dispatch point, each tested equal to the loop). The
chains are the leading dimension of one ``(S, d)`` tensor. Each chain draws its covariates and
responses from its own random stream (:mod:`smp_core.streams`): chain ``i``'s trajectory depends only
on the seed and ``i``, not on how many chains run beside it or how they are batched or split.
Chains whose parameters become non-finite or move further than ``divergence_threshold`` from
``theta_0`` are frozen, counted and reported (their rows of the result are NaN), never averaged in.

Module order follows posteriors' methods: what it builds (:class:`SMP`, and :func:`run_smp`, the
convenient entry point), its state (:class:`SMPState`), initialisation (:meth:`SMP.init`), update
(:meth:`SMP.advance`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import fast_paths
from ._progress import progress_bar, trigamma
from .checkpoint import inputs_fingerprint, load_checkpoint, save_checkpoint
from .fisher import estimate_fisher, structure_for
from .likelihoods import check_output_dim, get_likelihood
from .models import ChainModel, WholeStep, as_chain_model, check_deterministic
from .preconditioners import Preconditioner, PreconditionerState, preconditioner_from_name
from .streams import ChainStreams, check_seed, has_noise


class DivergenceError(RuntimeError):
    """Every chain diverged: the step size is too large for this preconditioner."""


@dataclass
class SMPState:
    """Everything needed to continue a run: parameters, preconditioner state, step, random streams."""

    theta: torch.Tensor  # (S, d) theta_k
    theta0: torch.Tensor  # (S, d)
    precond: PreconditionerState
    step: int  # k of the last completed step
    diverged_step: torch.Tensor  # (S,) long: check step at which the chain was frozen, -1 if never
    streams: ChainStreams  # the chains' random streams: the seed and the chains' indices
    trace: list[torch.Tensor] = field(default_factory=list)
    trace_steps: list[int] = field(default_factory=list)
    elapsed_before: float = 0.0  # seconds spent on this run before the last resume from a checkpoint


@dataclass
class SMPResult:
    """The output of :func:`run_smp`.

    Attributes:
        theta: ``(S, d)`` final parameters ``theta_K``; rows of diverged chains are NaN.
        diverged: ``(S,)`` bool mask of chains that diverged.
        diverged_step: ``(S,)`` the check step at which each diverged chain was caught (-1: never).
        trace: ``(n_saved, S, d)`` thinned trace on the CPU, or ``None``.
        trace_steps: the steps ``k`` of the trace rows.
        elapsed: wall-clock seconds of the run (Fisher set-up included), summed over the sessions of a
            run resumed from a checkpoint.
        config: the settings of the run (JSON-serialisable).
        preconditioner: the run's :class:`~smp_core.preconditioners.Preconditioner` (plain data), and
        precond_state: its state after step ``K`` (``P_{K+1}``), which the Gaussian tail of
            :mod:`smp_core.tail` continues with.
    """

    theta: torch.Tensor
    diverged: torch.Tensor
    diverged_step: torch.Tensor
    trace: torch.Tensor | None
    trace_steps: list[int]
    elapsed: float
    config: dict[str, Any]
    preconditioner: Preconditioner
    precond_state: PreconditionerState

    @property
    def n_diverged(self) -> int:
        return int(self.diverged.sum())

    def samples(self) -> torch.Tensor:
        """The converged chains only, ``(S - n_diverged, d)``; warns when some chains were dropped."""
        if self.n_diverged:
            warnings.warn(f"{self.n_diverged} of {self.diverged.numel()} chains diverged and are left out",
                          stacklevel=2)
        return self.theta[~self.diverged]

    def summary(self) -> str:
        return (f"SMP {self.config.get('preconditioner')}: S={self.diverged.numel()}, K={self.config.get('n_steps')}, "
                f"tau={self.config.get('tau')}, diverged={self.n_diverged}, {self.elapsed:.2f} s")


@dataclass(frozen=True)
class Fisher:
    """Where the fixed and periodic preconditioners (and the EMA's start) take their Fisher from.

    ``kind``: ``"model"`` (model-expected: responses drawn from the model, the default) or
    ``"empirical"`` (the observed labels ``y``); ``x``: the inputs (``None``: the training inputs
    ``x_train``); ``y``: the labels, for the empirical Fisher.
    """

    kind: str = "model"
    x: Any = None
    y: Any = None


@dataclass(frozen=True)
class RunOptions:
    """How :func:`run_smp` runs, apart from what it samples.

    Attributes:
        first_chain: the index of the first chain: a run of ``S`` chains from ``first_chain = j`` gives
            chains ``j, ..., j + S - 1`` of the same seed (to split a run over processes or machines).
        check_every: steps between divergence checks (and progress updates).
        divergence_threshold: a chain whose parameters leave ``theta0`` by more than this (max-norm),
            or become non-finite, is frozen and reported as diverged.
        trace_every: keep ``theta_k`` every so many steps (on the CPU).
        checkpoint: a file to save the state to every ``checkpoint_every`` steps (and at the end) and to
            resume from. It is resumed only by a call with the same settings, ``theta0``, ``x_train``,
            seed, chains, network (its modules as ``repr`` shows them), likelihood parameters and Fisher
            data; otherwise a ``ValueError`` names what differs, and the file is left as it is.
        cuda_graph: the execution path (:func:`smp_core.fast_paths.choose_path`): ``None`` (default)
            takes blocks of steps where they pay (on a GPU, as replays of CUDA graphs; on a CPU, where
            the compiled kernel of :mod:`smp_core.fused` takes the whole step); ``True`` insists on
            them; ``False``: step by step. Every path draws the same random numbers, so they give the
            same samples up to rounding (a checkpoint of one resumes with the other).
    """

    first_chain: int = 0
    check_every: int = 50
    divergence_threshold: float = 1e3
    trace_every: int | None = None
    checkpoint: str | os.PathLike | None = None
    checkpoint_every: int | None = None
    cuda_graph: bool | None = None

    def checked(self) -> RunOptions:
        """The options with every field checked (a ``ValueError`` or ``TypeError`` names the bad one)."""
        _as_count("first_chain", self.first_chain, 0)
        _check_divergence_settings(self.check_every, self.divergence_threshold)
        for name in ("trace_every", "checkpoint_every"):
            if getattr(self, name) is not None:
                _as_count(name, getattr(self, name), 1)
        _check_cuda_graph(self.cuda_graph)
        if self.checkpoint is not None and not isinstance(self.checkpoint, str | os.PathLike):
            raise TypeError(f"checkpoint must be a path, got {type(self.checkpoint).__name__}")
        return dataclasses.replace(
            self, first_chain=int(self.first_chain), check_every=int(self.check_every),
            trace_every=None if self.trace_every is None else int(self.trace_every),
            checkpoint_every=None if self.checkpoint_every is None else int(self.checkpoint_every))


def residual_variance_ratio(n_obs: int, n_steps: int) -> float:
    """``r_K^2 / r_0^2`` with ``r_K^2 = sum_{i>K} (N + i)^{-2}`` (Section 3.2.3).

    A rough proxy for the share of the limiting variance that truncation at ``K`` leaves out
    (it ignores ``tau``, the preconditioner and the score covariance). ``sum_{i>K} (N+i)^{-2}``
    is the trigamma function at ``N + K + 1``. The toy example (N = 500, K = 5000): about 9 %.
    """
    n_obs, n_steps = _as_count("n_obs (N)", n_obs, 0), _as_count("n_steps (K)", n_steps, 0)
    return trigamma(n_obs + n_steps + 1) / trigamma(n_obs + 1)


def _as_count(name: str, value, minimum: int) -> int:
    """``value`` as an ``int`` if it is a whole number ``>= minimum`` (a numpy integer or a float such as
    ``500.0`` included); otherwise a ``ValueError`` that names it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value).is_integer() \
            or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def _check_cuda_graph(cuda_graph) -> None:
    if not (cuda_graph is None or isinstance(cuda_graph, bool)):
        raise TypeError(f"cuda_graph must be True, False or None, got {cuda_graph!r}")


def _check_divergence_settings(check_every, divergence_threshold) -> int:
    """``check_every`` a whole number >= 1 (0 would never advance), ``divergence_threshold`` a positive
    number (NaN would switch the check off; infinity keeps only the check for non-finite parameters).
    Returns ``check_every`` as an int."""
    check_every = _as_count("check_every (steps between divergence checks)", check_every, 1)
    if isinstance(divergence_threshold, bool) or not isinstance(divergence_threshold, numbers.Real) \
            or not divergence_threshold > 0:
        raise ValueError(f"divergence_threshold must be a positive number, got {divergence_threshold!r}")
    return check_every


def check_tau(tau) -> float:
    """``tau`` as a float if it is a positive finite real number (not a bool); else a ``ValueError``."""
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"the step-size scale tau must be a positive finite number, got {tau!r}")
    return float(tau)


def as_tensor_input(name: str, x, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` (a tensor, a numpy array or nested lists) as a tensor; a ``TypeError`` naming ``name`` for
    anything else (a string, a dict, ``None``...)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, str | bytes | dict | set) or x is None:
        raise TypeError(f"{name} must be a tensor or an array, got {type(x).__name__}")
    try:
        return torch.as_tensor(x, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"{name} must be a tensor or an array, got {type(x).__name__} ({error})") from None


def check_training_inputs(model: ChainModel, x_train: torch.Tensor) -> None:
    """Raise a ``ValueError`` naming the problem unless ``x_train`` is ``(N >= 1, *input_shape)`` and finite."""
    if x_train.ndim < 1 or x_train.shape[0] < 1:
        raise ValueError("x_train must hold at least one training input (shape (N, *input_shape))")
    expected = getattr(model, "input_shape", None)
    if expected is not None and tuple(x_train.shape[1:]) != tuple(expected):
        raise ValueError(f"x_train has inputs of shape {tuple(x_train.shape[1:])}, the model expects "
                         f"{tuple(expected)}")
    if not torch.isfinite(x_train).all():
        raise ValueError("x_train contains NaN or infinite values")


def plain_steps(model: ChainModel, likelihood, x_train: torch.Tensor, precond: Preconditioner, curvature,
                state: SMPState, until: int, *, tau: float, n_obs: int) -> None:
    """Steps ``state.step + 1, ..., until`` of Algorithm 1, in place: the reference every fast path equals.

    Chains already frozen (``state.diverged_step >= 0``) stay where they are."""
    theta, k = state.theta, state.step
    frozen = (state.diverged_step >= 0).unsqueeze(1)
    frozen = frozen if bool(frozen.any()) else None
    draws = state.streams.covariates(k + 1, until - k, x_train.shape[0], theta.device)  # X_k: indices (n, S)
    noise = state.streams.response_noise(likelihood, k + 1, until - k, model.out_dim, theta.device, theta.dtype)
    # two (S, d) work buffers for every step: a fresh (S, d) tensor per step costs page faults that, for
    # LeNet-5 on a CPU, take as long as the arithmetic (a user's model or preconditioner may lack out=)
    score_out = {"out": torch.empty_like(theta)} if fast_paths.accepts_out(model.vjp) else {}
    step_out = {"out": torch.empty_like(theta)} if fast_paths.accepts_out(precond.solve) else {}
    for row, eps in zip(draws, noise, strict=True):
        k += 1
        out, ctx = model.forward(theta, x_train.index_select(0, row))
        y = likelihood.sample_from_noise(out, eps)  # Y_k ~ f_theta(. | X_k)
        score = model.vjp(ctx, likelihood.residual(out, y), **score_out)  # s_k
        step = precond.solve(state.precond, score, **step_out)  # P_k^-1 s_k
        if frozen is not None:  # frozen chains stay where they are (their preconditioner may be NaN)
            score, step = score.masked_fill(frozen, 0.0), step.masked_fill(frozen, 0.0)
        theta.add_(step, alpha=tau / (n_obs + k))
        state.precond = precond.update(state.precond, k, theta, score, curvature)
    state.step = until


class SMP:
    """Algorithm 1 for one model, likelihood, design and preconditioner: :meth:`init` a state from
    ``theta0`` and a seed, :meth:`advance` it by any number of steps, from a loop of your own.

    Args:
        model: any ``torch.nn.Module`` (or a :class:`~smp_core.models.ChainModel`); parameters with
            ``requires_grad=False`` are frozen (not sampled). One input's shape is read from ``x_train``.
        likelihood: ``"bernoulli"``, ``"categorical"`` or a likelihood object (``smp_core.Gaussian(sigma)``
            for a regression: its noise is never taken by default).
        x_train: ``(n, *input_shape)`` inputs (a tensor or an array) that the covariates are resampled
            from: the ``N`` training inputs (the paper's empirical design) or any other pool, such as a
            wider design (beyond the paper; pass ``n_obs`` and a :class:`Fisher` with the data's inputs).
        preconditioner: a name (``"none"``, ``"<strategy>-<structure>"`` such as ``"ema-block"``, with
            the paper's settings) or a :class:`~smp_core.preconditioners.Preconditioner`
            (``smp_core.preconditioners.ema("kfac", refresh=10)``, say).
        tau: step-size scale; ``gamma_k = tau / (N + k)``.
        n_obs: ``N`` in the step size (default: ``len(x_train)``).
        fisher: ``"model"``, ``"empirical"`` or a :class:`Fisher`: the data of the Fisher estimate of the
            fixed and periodic preconditioners and of the EMA's start.
    """

    def __init__(self, model: nn.Module | ChainModel, likelihood, x_train, *,
                 preconditioner: str | Preconditioner = "none", tau: float = 1.0, n_obs: int | None = None,
                 fisher: str | Fisher = "model"):
        if not (isinstance(model, nn.Module) or all(hasattr(model, a) for a in ("layout", "forward", "vjp"))):
            raise TypeError(f"model must be a torch.nn.Module (or a smp_core ChainModel), got {type(model).__name__}")
        self.tau = check_tau(tau)
        if isinstance(fisher, str):
            fisher = Fisher(fisher)
        if not isinstance(fisher, Fisher):
            raise TypeError(f"fisher must be 'model', 'empirical' or a smp_core.Fisher, got {type(fisher).__name__}")
        if fisher.kind not in ("model", "empirical"):
            raise ValueError(f"fisher must be 'model' (model-expected) or 'empirical', got {fisher.kind!r}")
        if not isinstance(preconditioner, str | Preconditioner):
            raise TypeError("preconditioner must be a name such as 'fixed-diag' or a smp_core Preconditioner, got "
                            f"{type(preconditioner).__name__}")
        x_train = as_tensor_input("x_train", x_train)
        if x_train.ndim < 2:
            raise ValueError(f"x_train must have shape (N, *one input's shape), one row per input, got shape "
                             f"{tuple(x_train.shape)} (for N scalar inputs, x_train[:, None])")
        fx = x_train if fisher.x is None else as_tensor_input("the Fisher's x", fisher.x)
        fy = None if fisher.y is None else as_tensor_input("the Fisher's y", fisher.y)
        if fx.shape[1:] != x_train.shape[1:]:
            raise ValueError(f"fisher: the Fisher's inputs have shape {tuple(fx.shape)}, but the model takes inputs "
                             f"of shape {tuple(x_train.shape[1:])} as x_train's rows have it")
        if fy is not None and (fy.ndim == 0 or fy.shape[0] != fx.shape[0]):
            raise ValueError(f"fisher: the Fisher's y has shape {tuple(fy.shape)}, one label per input of its "
                             f"{fx.shape[0]} inputs is needed")
        check_deterministic(model)  # before wrapping: a training-mode batch norm fails on the probe input
        net = as_chain_model(model, tuple(x_train.shape[1:]))
        lik = get_likelihood(likelihood)
        if not has_noise(lik):
            raise TypeError(f"the likelihood {type(lik).__name__} has no noise_width / noise_from_uniforms / "
                            "sample_from_noise, which the chains' random streams need (see smp_core.likelihoods)")
        check_output_dim(lik, getattr(net, "out_dim", None))
        if isinstance(preconditioner, str):
            preconditioner = preconditioner_from_name(preconditioner)
        precond = bind(preconditioner, net)
        if fisher.kind == "empirical" and fy is None and precond.needs_curvature:
            raise ValueError("the empirical Fisher needs labels: pass fisher=smp_core.Fisher('empirical', x, y)")
        self.net, self.likelihood, self.precond, self.fisher = net, lik, precond, fisher.kind
        self._requested = precond
        self.x_train, self.fisher_x, self.fisher_y = x_train, fx, fy
        check_training_inputs(net, x_train)
        self.n_obs = _as_count("n_obs (N in gamma_k = tau / (N + k))", x_train.shape[0] if n_obs is None else n_obs, 0)

    def _on(self, device: torch.device, dtype: torch.dtype) -> None:
        """The data on the chains' device and dtype, checked against the model, and the preconditioner's
        statistic dtype for these chains (the chains' own named explicitly is the default)."""
        if (self.x_train.device, self.x_train.dtype) != (device, dtype):
            self.x_train = self.x_train.to(device=device, dtype=dtype)
            check_training_inputs(self.net, self.x_train)
        if (self.fisher_x.device, self.fisher_x.dtype) != (device, dtype):
            self.fisher_x = self.fisher_x.to(device=device, dtype=dtype)
        if self.fisher_y is not None and self.fisher_y.device != device:
            self.fisher_y = self.fisher_y.to(device)
        kept_in = self._requested.statistic_dtype
        self.precond = dataclasses.replace(self._requested, statistic_dtype=None) if kept_in == dtype \
            else self._requested
        if kept_in is not None and torch.finfo(kept_in).eps > torch.finfo(dtype).eps:
            raise ValueError(f"statistic_dtype {kept_in} is coarser than the chains' {dtype}: it would round away "
                             "what the chains keep (leave it out to use theirs)")

    def curvature(self, theta: torch.Tensor):
        """The Fisher statistic at ``theta`` ``(C, d)`` over the Fisher's data, in the preconditioner's structure."""
        return estimate_fisher(self.net, self.likelihood, theta, self.fisher_x, self.fisher_y, kind=self.fisher,
                               structure=self.precond.structure, dtype=self.precond.statistic_dtype)

    def init(self, theta0: torch.Tensor | None = None, n_chains: int = 100, seed: int = 0,
             first_chain: int = 0) -> SMPState:
        """The state at ``k = 0``: ``theta0`` (``(d,)``, ``(S, d)`` or ``None`` for the module's own
        parameters) for chains ``first_chain, ..., first_chain + S - 1``, their random streams under
        ``seed`` (an integer in ``[0, 2**63)``) and ``P_1``."""
        streams = ChainStreams(check_seed(seed), _as_count("first_chain", first_chain, 0),
                               _as_count("n_chains (S)", n_chains, 1))
        theta0 = self.start(theta0, streams.n_chains)
        self._on(theta0.device, theta0.dtype)
        with torch.no_grad():
            pstate = self.precond.init(theta0, self.curvature if self.precond.needs_curvature else None)
        return SMPState(theta=theta0.clone(), theta0=theta0.clone(), precond=pstate, step=0,
                        diverged_step=torch.full((theta0.shape[0],), -1, dtype=torch.long, device=theta0.device),
                        streams=streams)

    def start(self, theta0, n_chains: int) -> torch.Tensor:
        """``theta0`` as ``(S, d)`` floats, checked (finite, the model's ``d``)."""
        if theta0 is None:
            theta0 = self.net.layout.flatten(self.net.module)
        theta0 = as_tensor_input("theta0", theta0)
        if not theta0.is_floating_point():
            raise TypeError(f"theta0 must hold floating-point numbers, got {theta0.dtype}")
        dim = self.net.layout.dim
        if theta0.ndim == 1:
            if theta0.shape[0] != dim:
                raise ValueError(f"theta0 has {theta0.shape[0]} entries, the model has d = {dim} parameters")
            theta0 = theta0.unsqueeze(0).expand(n_chains, dim)
        elif theta0.shape != (n_chains, dim):
            raise ValueError(f"theta0 must have shape ({dim},) or ({n_chains}, {dim}), got {tuple(theta0.shape)}")
        if not torch.isfinite(theta0).all():
            raise ValueError("theta0 contains NaN or infinite values")
        return theta0.contiguous().clone()

    def path(self, device: torch.device, dtype: torch.dtype, cuda_graph: bool | None = None) -> str:
        """The execution path :meth:`advance` takes for chains on ``device`` in ``dtype``
        (:func:`smp_core.fast_paths.choose_path`)."""
        return fast_paths.choose_path(cuda_graph, self.net, self.likelihood, self.precond, device, dtype)

    def advance(self, state: SMPState, until: int, *, check_every: int = 50, divergence_threshold: float = 1e3,
                trace_every: int | None = None, cuda_graph: bool | None = None, on_check=None) -> SMPState:
        """Run steps ``state.step + 1, ..., until`` in place and return the state.

        Every ``check_every`` steps a chain whose parameters left ``theta0`` by more than
        ``divergence_threshold`` (max-norm) or became non-finite is frozen at ``theta0`` and recorded in
        ``state.diverged_step``; :class:`DivergenceError` when none is left. ``trace_every``: keep
        ``theta_k`` every so many steps. ``cuda_graph``: the path (:class:`RunOptions`). ``on_check``:
        called with the state after each check.
        """
        self.check_state(state)
        until = _as_count("until (the step to advance to)", until, state.step)
        check_every = _check_divergence_settings(check_every, divergence_threshold)
        trace_every = None if trace_every is None else _as_count("trace_every", trace_every, 1)
        _check_cuda_graph(cuda_graph)
        if on_check is not None and not callable(on_check):
            raise TypeError(f"on_check must be a function of the state, got {type(on_check).__name__}")
        self._on(state.theta.device, state.theta.dtype)
        net, lik, precond, x_train = self.net, self.likelihood, self.precond, self.x_train
        curvature = self.curvature if precond.needs_curvature else None
        theta, streams = state.theta, state.streams
        path = self.path(theta.device, theta.dtype, cuda_graph)
        rule = precond.block_rule if path == "blocks" else precond.elementwise
        blocks = fast_paths.StepBlocks(net, lik, x_train, theta, rule, rule.tensors(state.precond), capture=True) \
            if path == "blocks" else None
        k, any_frozen = state.step, bool((state.diverged_step >= 0).any())
        with torch.no_grad():
            while k < until:
                k_end = min(until, k + check_every)
                while k < k_end:
                    n = k_end - k  # a piece ends where a trace row is due (and, for blocks, P may change)
                    for every in (trace_every, precond.update_every if blocks is not None else None):
                        if every:
                            n = min(n, every - k % every)
                    if blocks is not None and not any_frozen:
                        blocks.run(k, n, self.tau, self.n_obs, x_train.shape[0], streams)
                        if precond.update_every and (k + n) % precond.update_every == 0:
                            state.precond = precond.update(state.precond, k + n, theta, None, curvature)
                            blocks.set_tensors(rule.tensors(state.precond))
                    elif path != "plain" and not any_frozen:
                        draws = streams.covariates(k + 1, n, x_train.shape[0], theta.device)
                        noise = streams.response_noise(lik, k + 1, n, net.out_dim, theta.device, theta.dtype)
                        state.precond = fast_paths.elementwise_steps(
                            net, lik, x_train, theta, precond, state.precond, rule, draws, noise, self.tau,
                            self.n_obs, k, curvature)
                    else:
                        state.step = k
                        plain_steps(net, lik, x_train, precond, curvature, state, k + n, tau=self.tau,
                                    n_obs=self.n_obs)
                    k += n
                    if trace_every and k % trace_every == 0:
                        state.trace.append(theta.detach().cpu().clone())
                        state.trace_steps.append(k)
                state.step = k
                any_frozen = self._check(state, divergence_threshold) or any_frozen
                if on_check is not None:
                    on_check(state)
        return state

    def check_state(self, state: SMPState) -> None:
        """A ``TypeError`` or ``ValueError`` unless ``state`` fits this sampler: an :class:`SMPState` whose
        chains have this model's ``d`` parameters and whose preconditioner state has this structure's size."""
        if not isinstance(state, SMPState):
            raise TypeError(f"state must be an SMPState from this sampler's init(), got {type(state).__name__}")
        theta, dim = state.theta, self.net.layout.dim
        chains = theta.shape[0] if theta.ndim == 2 else -1
        if theta.ndim != 2 or theta.shape[1] != dim or state.theta0.shape != theta.shape \
                or state.diverged_step.shape != (chains,) or state.streams.n_chains != chains:
            raise ValueError(f"state does not come from this sampler: its theta has shape {tuple(theta.shape)} and "
                             f"{state.streams.n_chains} random streams, this model has d = {dim} parameters")
        stat = [m for m in state.precond.stat if isinstance(m, torch.Tensor)]
        if sum(m[0].numel() for m in stat) != self.precond._bound().stat_numel() \
                or any(m.shape[0] not in (1, chains) for m in stat):
            raise ValueError(f"state does not come from this sampler: its preconditioner state does not fit the "
                             f"{self.precond.name} preconditioner of this model")

    def _check(self, state: SMPState, divergence_threshold: float) -> bool:
        """Freeze the chains that diverged by ``state.step``; whether any chain is frozen."""
        theta, theta0 = state.theta, state.theta0
        move = (theta - theta0).abs_().amax(1)  # a NaN or infinite parameter makes it non-finite
        alive = state.diverged_step < 0
        new = (~torch.isfinite(move) | (move > divergence_threshold)) & alive
        if bool(new.any()):
            state.diverged_step[new] = state.step
            theta[new] = theta0[new]
            if not bool((state.diverged_step < 0).any()):
                raise DivergenceError(
                    f"all {theta.shape[0]} chains diverged by step {state.step} (non-finite parameters or a move "
                    f"larger than {divergence_threshold} from theta0): tau = {self.tau} is too large for the "
                    f"'{self.precond.name}' preconditioner; try a smaller tau or a larger ridge")
        return not bool(alive.all()) or bool(new.any())

    def result(self, state: SMPState, elapsed: float, config: dict[str, Any]) -> SMPResult:
        """The :class:`SMPResult` of a state: diverged chains' rows NaN (and a warning naming how many)."""
        diverged = state.diverged_step >= 0
        theta = state.theta.clone()
        theta[diverged] = float("nan")
        if diverged.any():
            warnings.warn(f"{int(diverged.sum())} of {theta.shape[0]} chains diverged (tau={self.tau}, "
                          f"{self.precond.name}); their rows of theta are NaN", stacklevel=3)
        trace = torch.stack(state.trace) if state.trace else None
        return SMPResult(theta=theta, diverged=diverged, diverged_step=state.diverged_step.clone(), trace=trace,
                         trace_steps=list(state.trace_steps), elapsed=elapsed, config=config,
                         preconditioner=self.precond, precond_state=state.precond)


def bind(preconditioner: Preconditioner, model: ChainModel) -> Preconditioner:
    """``preconditioner`` with its structure given by name resolved for ``model`` (its parameter
    blocks, or its Kronecker layers); a bound one is checked against the model's ``d``."""
    if isinstance(preconditioner.structure, str):
        return dataclasses.replace(preconditioner, structure=structure_for(model, preconditioner.structure))
    if preconditioner.structure.dim != model.layout.dim:
        raise ValueError(f"the preconditioner is built for d = {preconditioner.structure.dim} parameters, the model "
                         f"has {model.layout.dim}")
    return preconditioner


def run_smp(
    model: nn.Module | ChainModel,
    likelihood,
    x_train,
    theta0: torch.Tensor | None = None,
    *,
    preconditioner: str | Preconditioner = "none",
    tau: float = 1.0,
    n_steps: int = 1000,
    n_chains: int = 100,
    seed: int = 0,
    n_obs: int | None = None,
    fisher: str | Fisher = "model",
    options: RunOptions | dict | None = None,
    progress: bool = True,
) -> SMPResult:
    """Sample the score-based martingale posterior (Algorithm 1) with ``S`` chains in parallel.

    Args:
        model, likelihood, x_train, preconditioner, tau, n_obs, fisher: see :class:`SMP`.
        theta0: start ``(d,)`` or ``(S, d)``; default: the module's current parameters.
        n_steps: ``K``. n_chains: ``S``.
        seed: an integer in ``[0, 2**63)``. Chain ``i`` draws from its own stream of ``(seed, i)``
            (:mod:`smp_core.streams`), so its trajectory does not depend on the other chains.
        options: a :class:`RunOptions` (or a dict of its fields): the first chain's index, divergence
            checks, a trace, a checkpoint to resume from, the execution path.
        progress: a progress bar on the terminal (tqdm's when installed).

    It changes no process-wide setting; on a CPU, :func:`smp_core.memory.retain_freed_memory` (an
    explicit opt-in) makes long LeNet-size runs faster.

    Returns:
        An :class:`SMPResult`.
    """
    started = time.perf_counter()
    # every argument is checked here, before any work
    seed = check_seed(seed)
    n_steps, n_chains = _as_count("n_steps (K)", n_steps, 1), _as_count("n_chains (S)", n_chains, 1)
    if options is None:
        options = RunOptions()
    elif isinstance(options, dict):
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(RunOptions)})
        if unknown:
            raise TypeError(f"options has unknown field(s) {unknown}; RunOptions has "
                            f"{[f.name for f in dataclasses.fields(RunOptions)]}")
        options = RunOptions(**options)
    if not isinstance(options, RunOptions):
        raise TypeError(f"options must be a smp_core.RunOptions or a dict, got {type(options).__name__}")
    options = options.checked()
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, got {progress!r}")
    sampler = SMP(model, likelihood, x_train, preconditioner=preconditioner, tau=tau, n_obs=n_obs, fisher=fisher)
    theta0 = sampler.start(theta0, n_chains)
    sampler._on(theta0.device, theta0.dtype)
    net, lik, precond = sampler.net, sampler.likelihood, sampler.precond
    device, x = theta0.device, sampler.x_train
    config = {
        "preconditioner": precond.name, "tau": sampler.tau, "n_steps": n_steps, "n_chains": n_chains, "seed": seed,
        "first_chain": options.first_chain, "n_obs": sampler.n_obs, "fisher": sampler.fisher, "likelihood": lik.name,
        **({"sigma": lik.sigma} if hasattr(lik, "sigma") else {}), "d": net.layout.dim, **precond.hyper,
        "check_every": options.check_every,
        "divergence_threshold": options.divergence_threshold, "trace_every": options.trace_every,
    }
    if sampler.path(device, theta0.dtype, options.cuda_graph) == "blocks":
        config["step_blocks"] = True
        if isinstance(net, WholeStep) and net.takes_whole_step(lik, precond.block_rule, device, theta0.dtype):
            config["compiled_step"] = True  # each whole step in the kernel of smp_core.fused
    # the key leaves out n_steps (a finished run can be extended to a larger K) and the execution path
    # (every path draws the same random numbers)
    settings = json.loads(json.dumps({
        **{k: v for k, v in config.items() if k not in ("n_steps", "step_blocks", "compiled_step")},
        "theta0": hashlib.sha256(theta0.cpu().numpy().tobytes()).hexdigest(),
        "x_train": hashlib.sha256(x.cpu().numpy().tobytes()).hexdigest(),
    }, default=str))
    path = Path(options.checkpoint) if options.checkpoint is not None else None
    inputs = inputs_fingerprint(net, lik, sampler.fisher_x, sampler.fisher_y) if path is not None else {}
    state = None
    if path is not None and path.exists():
        state = SMPState(**load_checkpoint(path, settings, inputs, device))
        if state.step > n_steps:
            raise ValueError(f"the checkpoint {path} is at step {state.step}, beyond n_steps = {n_steps}")
    if state is None:
        state = sampler.init(theta0, n_chains, seed, options.first_chain)
    bar = progress_bar(total=n_steps, initial=state.step, disable=not progress, desc=f"SMP {precond.name}",
                       mininterval=1.0)
    last = {"step": state.step}

    def on_check(s: SMPState) -> None:
        bar.update(s.step - last["step"])
        bar.set_postfix(diverged=int((s.diverged_step >= 0).sum()), refresh=False)
        every = options.checkpoint_every
        if path is not None and every and s.step // every != last["step"] // every:
            save_checkpoint(path, s, settings, inputs, s.elapsed_before + time.perf_counter() - started)
        last["step"] = s.step

    try:
        sampler.advance(state, n_steps, check_every=options.check_every,
                        divergence_threshold=options.divergence_threshold, trace_every=options.trace_every,
                        cuda_graph=options.cuda_graph, on_check=on_check)
    finally:
        bar.close()
    elapsed = state.elapsed_before + time.perf_counter() - started
    if path is not None:
        save_checkpoint(path, state, settings, inputs, elapsed)
    return sampler.result(state, elapsed, config)
