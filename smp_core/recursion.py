"""The SMP recursion of Algorithm 1: S chains of predictive resampling in parallel.

For every chain ``l`` and step ``k = 1, ..., K`` (the empirical design of Section 3.1):

1. ``X_k ~ f_emp``: a covariate drawn with replacement from the ``N`` training inputs;
2. ``Y_k ~ f_{theta_{k-1}}(. | X_k)``: a response drawn from the model;
3. ``s_k = grad_theta log f_{theta_{k-1}}(Y_k | X_k)``: the score;
4. ``theta_k = theta_{k-1} + tau / (N + k) * P_k^{-1} s_k`` (eq. 2.14), moving **up** the
   log-likelihood (a test guards the sign);
5. the preconditioner folds in ``s_k`` or recomputes, so that ``P_{k+1}`` is ``F_k``-measurable and
   ``theta_k`` stays a martingale (eq. 2.15).

The chains are the leading dimension of one ``(S, d)`` tensor. Each chain draws its covariates and
responses from its own random stream (:mod:`smp_core.streams`): chain ``i``'s trajectory depends only
on the seed and ``i``, not on how many chains run beside it or how they are batched or split.
Chains whose parameters become non-finite or move further than ``divergence_threshold`` from
``theta_0`` are frozen, counted and reported (their rows of the result are NaN), never averaged in.

Module order follows posteriors' methods: what it builds (:func:`run_smp`), its state
(:class:`SMPState`), initialisation (:func:`init_smp`), update (:func:`advance_smp`).
"""

from __future__ import annotations

import hashlib
import inspect
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

from ._progress import progress_bar, trigamma
from .fisher import estimate_fisher, kronecker_layers
from .likelihoods import check_output_dim, get_likelihood
from .models import ChainModel, MLPChainModel, SequentialChainModel, as_chain_model, check_deterministic
from .preconditioners import Preconditioner, PreconditionerState, preconditioner_from_name, statistic_dtype_of
from .streams import ChainStreams, check_seed, has_noise


class DivergenceError(RuntimeError):
    """Every chain diverged: the step size is too large for this preconditioner."""


@dataclass
class SMPState:
    """Everything needed to continue a run: parameters, preconditioner, step, random state."""

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
        preconditioner: the run's :class:`~smp_core.preconditioners.Preconditioner`, and
        precond_state: its state after step ``K`` (``P_{K+1}``), which the Gaussian tail of
            :mod:`smp_core.tail` continues with (``None`` in results made before it existed).
    """

    theta: torch.Tensor
    diverged: torch.Tensor
    diverged_step: torch.Tensor
    trace: torch.Tensor | None
    trace_steps: list[int]
    elapsed: float
    config: dict[str, Any]
    preconditioner: Preconditioner | None = None
    precond_state: PreconditionerState | None = None

    def __getstate__(self) -> dict[str, Any]:
        # the preconditioner is a bundle of closures, which pickle (torch.save, the study caches) cannot
        # store; its state is tensors and stays. smp_core.tail rebuilds the bundle from the config.
        return {**self.__dict__, "preconditioner": None}

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


def residual_variance_ratio(n_obs: int, n_steps: int) -> float:
    """``r_K^2 / r_0^2`` with ``r_K^2 = sum_{i>K} (N + i)^{-2}`` (Section 3.2.3).

    A rough proxy for the share of the limiting variance that truncation at ``K`` leaves out
    (it ignores ``tau``, the preconditioner and the score covariance). ``sum_{i>K} (N+i)^{-2}``
    is the trigamma function at ``N + K + 1``. The toy example (N = 500, K = 5000): about 9 %.
    """
    if n_obs < 0 or n_steps < 0:
        raise ValueError("N and K must be non-negative")
    return trigamma(n_obs + n_steps + 1) / trigamma(n_obs + 1)


def _as_count(name: str, value, minimum: int) -> int:
    """``value`` as an ``int`` if it is a whole number ``>= minimum`` (a numpy integer or a float such as
    ``500.0`` included); otherwise a ``ValueError`` that names it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value).is_integer() \
            or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def _check_run_settings(n_obs, check_every, divergence_threshold) -> tuple[int, int]:
    """``n_obs`` (N in ``gamma_k = tau / (N + k)``, positive from k = 1) a whole number >= 0,
    ``check_every`` one >= 1 (0 would never advance), ``divergence_threshold`` a positive number (NaN
    would switch the check off; infinity keeps only the check for non-finite parameters). Returns
    ``n_obs`` and ``check_every`` as ints."""
    n_obs = _as_count("n_obs (N in gamma_k = tau / (N + k))", n_obs, 0)
    check_every = _as_count("check_every (steps between divergence checks)", check_every, 1)
    if isinstance(divergence_threshold, bool) or not isinstance(divergence_threshold, numbers.Real) \
            or not divergence_threshold > 0:
        raise ValueError(f"divergence_threshold must be a positive number, got {divergence_threshold!r}")
    return n_obs, check_every


def _check_inputs(model: ChainModel, x_train: torch.Tensor, theta0: torch.Tensor, n_chains: int,
                  tau: float, n_steps: int) -> torch.Tensor:
    check_tau(tau)
    dim = model.layout.dim
    if theta0.ndim == 1:
        if theta0.shape[0] != dim:
            raise ValueError(f"theta0 has {theta0.shape[0]} entries, the model has d = {dim} parameters")
        theta0 = theta0.unsqueeze(0).expand(n_chains, dim)
    elif theta0.shape != (n_chains, dim):
        raise ValueError(f"theta0 must have shape ({dim},) or ({n_chains}, {dim}), got {tuple(theta0.shape)}")
    if not torch.isfinite(theta0).all():
        raise ValueError("theta0 contains NaN or infinite values")
    check_training_inputs(model, x_train)
    return theta0.contiguous().clone()


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


def init_smp(
    model: ChainModel, likelihood, theta0: torch.Tensor, precond: Preconditioner, curvature, seed: int,
    first_chain: int = 0,
) -> SMPState:
    """The state at ``k = 0``: ``theta_0`` ``(S, d)`` for chains ``first_chain, ..., first_chain + S - 1``
    and ``P_1``; their random streams are those of ``seed`` (:class:`~smp_core.streams.ChainStreams`)."""
    streams = ChainStreams(check_seed(seed), _as_count("first_chain", first_chain, 0), theta0.shape[0])
    pstate = precond.init(theta0, curvature)
    return SMPState(
        theta=theta0.clone(), theta0=theta0.clone(), precond=pstate, step=0,
        diverged_step=torch.full((theta0.shape[0],), -1, dtype=torch.long, device=theta0.device),
        streams=streams,
    )


def _accepts_out(fn) -> bool:
    try:
        return "out" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def step_blocks_unavailable(model: ChainModel, likelihood, precond: Preconditioner) -> str | None:
    """Why the recursion cannot run steps in blocks for this combination, or ``None`` when it can.

    A block of steps needs an element-wise preconditioner rule (``none`` and every ``diag``) whose
    state changes only through the rule itself (EMA) or at known steps (``update_every``: fixed,
    periodic), and a likelihood that draws its responses from pre-drawn noise
    (``noise_width`` / ``noise_from_uniforms`` / ``sample_from_noise``).
    """
    rule = getattr(precond, "elementwise", None)
    if rule is None:
        return f"the '{precond.name}' preconditioner has no element-wise rule (only none and the diag ones have)"
    if not rule.covers_update and getattr(precond, "update_every", None) is None:
        return f"the '{precond.name}' preconditioner does not say at which steps its update changes its state"
    if not has_noise(likelihood):
        return "the likelihood has no noise_width / noise_from_uniforms / sample_from_noise"
    return None


def _steps_from_noise(model: ChainModel, likelihood, x_train: torch.Tensor, theta: torch.Tensor, rule,
                      tensors: tuple[torch.Tensor, ...], fused_vjp, draws: torch.Tensor, noise: torch.Tensor,
                      gammas: torch.Tensor) -> None:
    """Steps of Algorithm 1 with the covariate indices ``draws`` ``(n, S)``, the response noise
    ``noise`` ``(n, S, ...)`` and the step sizes ``gammas`` ``(n,)`` given as tensors: no random
    number is drawn, nothing is read back to the host and the step size is a tensor, so the same
    kernels can be captured once in a CUDA graph and replayed with new inputs."""
    whole_step = getattr(model, "step_", None)  # a compiled kernel that does the whole step (smp_core.fused)
    for j in range(draws.shape[0]):
        rows = x_train.index_select(0, draws[j])
        if whole_step is not None and whole_step(theta, rows, likelihood, noise[j], rule, tensors, gammas[j]):
            continue
        out, ctx = model.forward(theta, rows)
        residual = likelihood.residual(out, likelihood.sample_from_noise(out, noise[j]))
        if fused_vjp is not None:
            fused_vjp(ctx, residual, theta, rule, tensors, gammas[j])
        else:
            rule.apply_(theta, model.vjp(ctx, residual), tensors, gammas[j])


class _StepBlocks:
    """Runs blocks of steps by :func:`_steps_from_noise`, on CUDA as replays of captured graphs.

    The random numbers of a block (covariate indices and response noise) are drawn from the run's
    chains' streams before the block, and its step sizes ``tau / (N + k)`` computed, then copied into
    the static input buffers of the block's graph. A block length is captured the second time it is
    met (the first run, uncaptured, is the warm-up that CUDA graphs need); a capture that fails
    warns and leaves the run uncaptured. On a CPU nothing is captured: the blocks run as they are.
    """

    _MAX_GRAPHS = 4

    def __init__(self, model, likelihood, x_train, theta, rule, tensors, capture: bool):
        self.model, self.likelihood, self.x_train, self.theta, self.rule = model, likelihood, x_train, theta, rule
        self.tensors = tuple(tensors)
        self.fused_vjp = getattr(model, "vjp_apply_", None)
        self.capture = capture and theta.is_cuda
        self.graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.seen: set[int] = set()
        self.out_dim = model.out_dim

    def set_tensors(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """The rule's state tensors after a preconditioner update: copied into the captured ones
        (same shapes), else the graphs are dropped and captured again, after a new warm-up."""
        tensors = tuple(tensors)
        if all(new is old for new, old in zip(tensors, self.tensors, strict=True)):
            return
        if self.graphs and all(new.shape == old.shape for new, old in zip(tensors, self.tensors, strict=True)):
            for new, old in zip(tensors, self.tensors, strict=True):
                old.copy_(new)
            return
        self.tensors, self.graphs = tensors, {}
        self.seen.clear()

    def run(self, k: int, n: int, tau: float, n_obs: int, n_data: int, streams: ChainStreams) -> None:
        """Steps ``k + 1, ..., k + n``."""
        theta = self.theta
        device, dtype = theta.device, theta.dtype
        draws = streams.covariates(k + 1, n, n_data, device)
        noise = streams.response_noise(self.likelihood, k + 1, n, self.out_dim, device, dtype)
        # gamma_k = tau / (N + k), made on the device (no blocking host-to-device copy per block)
        wide = torch.float64 if device.type in ("cpu", "cuda") else dtype
        gammas = (tau / (n_obs + k + torch.arange(1, n + 1, device=device, dtype=wide))).to(dtype)
        if not self.capture:
            self._steps(draws, noise, gammas)
            return
        with torch.cuda.device(device):
            graph = self.graphs.get(n)
            if graph is None and n in self.seen and len(self.graphs) < self._MAX_GRAPHS:
                graph = self._capture(draws, noise, gammas)
            self.seen.add(n)
            if graph is None:  # the warm-up before a capture runs on a side stream (lazy CUDA set-up there)
                side = torch.cuda.Stream(device=device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    self._steps(draws, noise, gammas)
                torch.cuda.current_stream(device).wait_stream(side)
                return
            cuda_graph, static_draws, static_noise, static_gammas = graph
            static_draws.copy_(draws)
            static_noise.copy_(noise)
            static_gammas.copy_(gammas)
            cuda_graph.replay()

    def _steps(self, draws: torch.Tensor, noise: torch.Tensor, gammas: torch.Tensor) -> None:
        _steps_from_noise(self.model, self.likelihood, self.x_train, self.theta, self.rule, self.tensors,
                          self.fused_vjp, draws, noise, gammas)

    def _capture(self, draws, noise, gammas):
        """Capture a block on the parameters' device (the caller has made it current)."""
        n, device = draws.shape[0], self.theta.device
        static = (draws.clone(), noise.clone(), gammas.clone())
        capture_stream = torch.cuda.Stream(device=device)
        try:
            torch.cuda.synchronize(device)
            cuda_graph = torch.cuda.CUDAGraph()
            # the outer stream context puts the caller's stream back even when the capture fails
            # (torch.cuda.graph does not, when ending an invalidated capture raises)
            with torch.cuda.stream(capture_stream), torch.cuda.graph(cuda_graph, stream=capture_stream):
                self._steps(*static)
        except Exception as error:  # noqa: BLE001 - any failure to capture falls back to uncaptured blocks
            warnings.warn(f"capturing a block of {n} SMP steps in a CUDA graph failed ({error!r}); the run goes on "
                          "without CUDA graphs", stacklevel=3)
            self.capture = False
            return None
        self.graphs[n] = (cuda_graph, *static)
        return self.graphs[n]


def advance_smp(
    state: SMPState,
    model: ChainModel,
    likelihood,
    x_train: torch.Tensor,
    precond: Preconditioner,
    curvature,
    *,
    tau: float,
    n_obs: int,
    until: int,
    check_every: int = 50,
    divergence_threshold: float = 1e3,
    trace_every: int | None = None,
    on_check=None,
    cuda_graph: bool | None = False,
) -> SMPState:
    """Run steps ``state.step + 1, ..., until`` of Algorithm 1 in place and return the state.

    ``cuda_graph``: ``False`` runs step by step; ``True`` runs blocks of steps from pre-drawn noise
    (:class:`_StepBlocks`), captured as CUDA graphs on a GPU and run as they are on a CPU, and
    raises when this model, likelihood and preconditioner cannot (:func:`step_blocks_unavailable`);
    ``None`` runs blocks when the parameters are on a CUDA device, the model is one that
    :mod:`smp_core.models` batches by hand and blocks are possible, or on a CPU when the compiled
    kernel of :mod:`smp_core.fused` takes the whole step; else step by step.
    Both draw the same random numbers (each chain's stream at each step), so they give the same
    samples up to rounding.
    """
    n_obs, check_every = _check_run_settings(n_obs, check_every, divergence_threshold)
    theta, theta0, streams = state.theta, state.theta0, state.streams
    n_data, n_chains = x_train.shape[0], theta.shape[0]
    alive = (state.diverged_step < 0).unsqueeze(1)
    any_frozen = not bool(alive.all())
    k = state.step
    # two (S, d) work buffers reused at every step: a fresh (S, d) tensor per step costs page
    # faults that, for LeNet-5 on a CPU, take as long as the arithmetic.
    score_buf = torch.empty_like(theta, memory_format=torch.contiguous_format)
    step_buf = torch.empty_like(theta, memory_format=torch.contiguous_format)
    # a user's chain model or preconditioner written without the optional out= still works
    vjp_out = {"out": score_buf} if _accepts_out(model.vjp) else {}
    solve_out = {"out": step_buf} if _accepts_out(precond.solve) else {}
    # an element-wise P^{-1} (none, every diag) is applied by its rule in one pass with the update; a
    # model with vjp_apply_ then never forms the (S, d) score, and an EMA rule folds the score into
    # the statistic on the way (so update() is not called after such a step)
    rule = getattr(precond, "elementwise", None)
    fused_vjp = getattr(model, "vjp_apply_", None) if rule is not None else None
    # without the fused model path the EMA rule is not used: the plain path below keeps its update
    plain_rule = rule if rule is not None and not rule.covers_update else None
    blocks = _make_step_blocks(cuda_graph, state, model, likelihood, x_train, precond)
    update_every = getattr(precond, "update_every", None)
    while k < until:
        k_end = min(until, k + check_every)
        if blocks is not None and not any_frozen:
            while k < k_end:
                # a block ends where the preconditioner may change, or a trace row is due
                n = k_end - k
                for every in (update_every, trace_every):
                    if every:
                        n = min(n, every - k % every)
                blocks.run(k, n, tau, n_obs, n_data, streams)
                k += n
                if update_every and k % update_every == 0:
                    state.precond = precond.update(state.precond, k, theta, None, curvature)
                    blocks.set_tensors(rule.tensors(state.precond))
                if trace_every and k % trace_every == 0:
                    state.trace.append(theta.detach().cpu().clone())
                    state.trace_steps.append(k)
        else:
            # Algorithm 1, one step at a time: X_k from the design, Y_k from the model, the score, the step
            draws = streams.covariates(k + 1, k_end - k, n_data, theta.device)
            noise = streams.response_noise(likelihood, k + 1, k_end - k, model.out_dim, theta.device, theta.dtype)
            for row, eps in zip(draws, noise, strict=True):
                k += 1
                gamma = tau / (n_obs + k)
                out, ctx = model.forward(theta, x_train.index_select(0, row))
                residual = likelihood.residual(out, likelihood.sample_from_noise(out, eps))
                if fused_vjp is not None and not any_frozen:
                    fused_vjp(ctx, residual, theta, rule, rule.tensors(state.precond), gamma)
                    score, updated = None, rule.covers_update
                elif plain_rule is not None and not any_frozen:
                    # solve and update in one pass instead of two
                    score = model.vjp(ctx, residual, **vjp_out)
                    plain_rule.apply_(theta, score, plain_rule.tensors(state.precond), gamma)
                    updated = False
                else:
                    score = model.vjp(ctx, residual, **vjp_out)
                    step = precond.solve(state.precond, score, **solve_out)
                    if any_frozen:  # frozen chains stay where they are (their preconditioner may be NaN)
                        score.masked_fill_(~alive, 0.0)  # also masks step when the preconditioner returned score
                        if step is not score:
                            step.masked_fill_(~alive, 0.0)
                    theta.add_(step, alpha=gamma)
                    updated = False
                if not updated:
                    state.precond = precond.update(state.precond, k, theta, score, curvature)
                if trace_every and k % trace_every == 0:
                    state.trace.append(theta.detach().cpu().clone())
                    state.trace_steps.append(k)
        state.step = k
        # largest move of each chain from theta0, computed in the work buffer (no (S, d) temporaries);
        # a NaN or infinite parameter makes it non-finite
        move = torch.sub(theta, theta0, out=step_buf).abs_().amax(1)
        bad = ~torch.isfinite(move) | (move > divergence_threshold)
        new = bad & alive.squeeze(1)
        if bool(new.any()):
            state.diverged_step[new] = k
            theta[new] = theta0[new]
            alive = (state.diverged_step < 0).unsqueeze(1)
            any_frozen = True
            if not bool(alive.any()):
                raise DivergenceError(
                    f"all {n_chains} chains diverged by step {k} (non-finite parameters or a move larger than "
                    f"{divergence_threshold} from theta0): tau = {tau} is too large for the "
                    f"'{precond.name}' preconditioner; try a smaller tau or a larger ridge")
        if on_check is not None:
            on_check(state)
    return state


def _uses_step_blocks(cuda_graph: bool | None, model, likelihood, precond, device: torch.device,
                      dtype: torch.dtype) -> bool:
    """Whether a run takes the step blocks: when asked (``True``), or by default on a CUDA device for
    the networks that :mod:`smp_core.models` batches by hand (their steps are known to be capturable;
    a user's chain model is captured only when asked), and on a CPU where the compiled kernel of
    :mod:`smp_core.fused` takes the whole step (``model.takes_whole_step``)."""
    if cuda_graph is None:
        if step_blocks_unavailable(model, likelihood, precond) is not None:
            return False
        if device.type == "cuda":
            return isinstance(model, SequentialChainModel | MLPChainModel)
        takes = getattr(model, "takes_whole_step", None)
        return takes is not None and takes(likelihood, precond.elementwise, device, dtype)
    return bool(cuda_graph)


def _make_step_blocks(cuda_graph: bool | None, state: SMPState, model, likelihood, x_train, precond):
    """The :class:`_StepBlocks` of a run, or ``None`` for the step-by-step loop (see :func:`advance_smp`)."""
    if not _uses_step_blocks(cuda_graph, model, likelihood, precond, state.theta.device, state.theta.dtype):
        return None
    reason = step_blocks_unavailable(model, likelihood, precond)
    if reason is not None:
        raise ValueError(f"cuda_graph=True needs blocks of steps, but {reason}")
    rule = precond.elementwise
    return _StepBlocks(model, likelihood, x_train, state.theta, rule, rule.tensors(state.precond), capture=True)


def _config_key(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _sha(t: torch.Tensor | None) -> str | None:
    return None if t is None else hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _inputs_fingerprint(net: ChainModel, likelihood, fisher_x: torch.Tensor, fisher_y: torch.Tensor | None
                        ) -> dict[str, str]:
    """What a checkpoint's key leaves out, kept beside it to refuse resuming another run: the network
    (its modules' types and settings as ``repr`` shows them, so a GELU network is not a Tanh one with the
    same parameter count), the likelihood's parameters (a Gaussian's ``sigma``) and the Fisher data."""
    module = getattr(net, "module", None)
    network = repr(module) + "|" + ",".join(f"{type(m).__module__}.{type(m).__qualname__}"
                                            for m in (module.modules() if module is not None else ()))
    lik = json.dumps({"name": likelihood.name, **{k: v for k, v in vars(likelihood).items()
                                                 if isinstance(v, int | float | str)}}, sort_keys=True)
    return {"network": hashlib.sha256(network.encode()).hexdigest(), "likelihood": lik,
            "fisher_data": f"{_sha(fisher_x)}/{_sha(fisher_y)}"}


def _save_checkpoint(path: Path, state: SMPState, key: str, inputs: dict[str, str], started: float) -> None:
    payload = {
        "elapsed": state.elapsed_before + time.perf_counter() - started,
        "key": key, "inputs": inputs, "theta": state.theta.cpu(), "theta0": state.theta0.cpu(),
        "stat": [t.cpu() for t in state.precond.stat], "factor": [t.cpu() for t in state.precond.factor],
        "step": state.step, "diverged_step": state.diverged_step.cpu(),
        "streams": tuple(state.streams), "trace": state.trace, "trace_steps": state.trace_steps,
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def _load_checkpoint(path: Path, key: str, inputs: dict[str, str], device: torch.device) -> SMPState | None:
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if payload.get("key") != key:
        raise ValueError(f"the checkpoint {path} belongs to a run with other settings (seed, chains, tau, "
                         "preconditioner, theta0 or x_train); delete it or choose another checkpoint path "
                         "(nothing was overwritten)")
    differ = [name for name in inputs if payload["inputs"].get(name) != inputs[name]]
    if differ:
        raise ValueError(f"the checkpoint {path} belongs to a run with another {' and '.join(differ)}; delete "
                         "it or choose another checkpoint path (nothing was overwritten)")
    return SMPState(
        theta=payload["theta"].to(device), theta0=payload["theta0"].to(device),
        precond=PreconditionerState(tuple(t.to(device) for t in payload["stat"]),
                                    tuple(t.to(device) for t in payload["factor"])),
        step=payload["step"], diverged_step=payload["diverged_step"].to(device),
        streams=ChainStreams(*payload["streams"]),
        trace=payload["trace"], trace_steps=payload["trace_steps"], elapsed_before=payload.get("elapsed", 0.0),
    )


def run_smp(
    model: nn.Module | ChainModel,
    likelihood,
    x_train: torch.Tensor,
    theta0: torch.Tensor | None = None,
    *,
    preconditioner: str | Preconditioner = "none",
    tau: float = 1.0,
    n_steps: int = 1000,
    n_chains: int = 100,
    seed: int = 0,
    first_chain: int = 0,
    n_obs: int | None = None,
    fisher: str = "model",
    fisher_data: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ridge: float = 1e-4,
    beta: float = 0.98,
    period: int = 500,
    ema_init: str = "fisher",
    ema_refresh: int = 1,
    statistic_dtype: torch.dtype | str | None = None,
    input_shape: tuple[int, ...] | None = None,
    trace_every: int | None = None,
    check_every: int = 50,
    divergence_threshold: float = 1e3,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    progress: bool = True,
    cuda_graph: bool | None = None,
) -> SMPResult:
    """Sample the score-based martingale posterior (Algorithm 1) with ``S`` chains in parallel.

    Args:
        model: any ``torch.nn.Module`` (or a :class:`~smp_core.models.ChainModel`).
        likelihood: ``"bernoulli"``, ``"categorical"``, ``"gaussian"`` or a likelihood object.
        x_train: ``(n, *input_shape)`` inputs that the covariates are resampled from: the ``N`` training
            inputs (the paper's empirical design) or any other pool, such as a wider design (beyond the
            paper). With a pool, pass ``n_obs`` (the data's ``N``, for the step size) and ``fisher_data``
            (the inputs of the fixed or periodic preconditioners' Fisher, and of the EMA's start, whose
            statistic then follows the scores at the pool's covariates) where they should not be the pool's.
        theta0: start ``(d,)`` or ``(S, d)``; default: the module's current parameters.
        preconditioner: ``"none"``, ``"<strategy>-<structure>"`` (e.g. ``"ema-block"``; beyond the paper
            ``"fixed-kfac"`` and the like, for networks of Linear and Conv2d layers) or a
            :class:`~smp_core.preconditioners.Preconditioner`.
        tau: step-size scale; ``gamma_k = tau / (N + k)``.
        n_steps: ``K``. n_chains: ``S``.
        seed: an integer in ``[0, 2**63)``. Chain ``i`` draws from its own stream of ``(seed, i)``
            (:mod:`smp_core.streams`), so its trajectory does not depend on the other chains.
        first_chain: the index of the first chain: a run of ``S`` chains from ``first_chain = j`` gives
            chains ``j, ..., j + S - 1`` of the same seed (to split a run over processes or machines).
        n_obs: ``N`` in the step size (default: ``len(x_train)``).
        fisher: ``"model"`` (model-expected) or ``"empirical"`` Fisher for fixed / periodic / EMA start.
        fisher_data: ``(x, y)`` for the Fisher (default: ``(x_train, None)``; ``y`` is needed for the
            empirical Fisher).
        ridge, beta, period, ema_init, ema_refresh, statistic_dtype: see
            :func:`~smp_core.preconditioners.build_preconditioner` (``statistic_dtype=torch.float64``
            keeps a block, dense or kfac statistic, the Fisher included, in float64 while the chains
            run in float32).
        input_shape: one input's shape, for modules other than MLPs.
        trace_every: keep ``theta_k`` every so many steps (on the CPU).
        check_every: steps between divergence checks (and progress updates).
        divergence_threshold: a chain whose parameters leave ``theta0`` by more than this (max-norm),
            or become non-finite, is frozen and reported as diverged.
        checkpoint: a file to save the state to every ``checkpoint_every`` steps and to resume from. It
            is resumed only by a call with the same settings, ``theta0``, ``x_train``, network (its
            modules as ``repr`` shows them), likelihood parameters and Fisher data; otherwise a
            ``ValueError`` names what differs, and the file is left as it is.
        progress: show a tqdm progress bar.
        cuda_graph: run blocks of steps as replays of CUDA graphs (the step of a small network on a
            GPU is bound by kernel launches, not arithmetic). ``None`` (default): on a CUDA device,
            for a network batched by hand (an ``nn.Sequential`` of Linear / Conv2d / activation /
            pooling layers), when the preconditioner is ``none`` or a ``diag`` one and the likelihood
            a built-in one; on a CPU, when the compiled kernel of :mod:`smp_core.fused` runs the
            network (it then takes each whole step: forward, response, residual, backward, update);
            ``True``: insist (on a CPU the blocks run uncaptured, the same arithmetic); ``False``: the
            step-by-step loop. Both draw the same random numbers, so they give the same samples up to
            rounding (a checkpoint of one resumes with the other); the run's config records
            ``step_blocks``. See :func:`advance_smp`.

    It changes no process-wide setting; on a CPU, :func:`smp_core.memory.retain_freed_memory` (an
    explicit opt-in) makes long LeNet-size runs faster.

    Returns:
        An :class:`SMPResult`.
    """
    started = time.perf_counter()
    # every argument is checked here, before any work
    if not (isinstance(model, nn.Module) or all(hasattr(model, a) for a in ("layout", "forward", "vjp"))):
        raise TypeError(f"model must be a torch.nn.Module (or a smp_core ChainModel), got {type(model).__name__}")
    seed, first_chain = check_seed(seed), _as_count("first_chain", first_chain, 0)
    n_steps, n_chains = _as_count("n_steps (K)", n_steps, 1), _as_count("n_chains (S)", n_chains, 1)
    tau = check_tau(tau)
    if fisher not in ("model", "empirical"):
        raise ValueError(f"fisher must be 'model' (model-expected) or 'empirical', got {fisher!r}")
    if trace_every is not None:
        trace_every = _as_count("trace_every", trace_every, 1)
    if checkpoint_every is not None:
        checkpoint_every = _as_count("checkpoint_every", checkpoint_every, 1)
    for name, flag in (("progress", progress), ("cuda_graph", cuda_graph)):
        if not (isinstance(flag, bool) or (name == "cuda_graph" and flag is None)):
            raise TypeError(f"{name} must be True or False{' or None' if name == 'cuda_graph' else ''}, got {flag!r}")
    x_train = as_tensor_input("x_train", x_train)
    if fisher_data is not None:
        if not (isinstance(fisher_data, tuple | list) and len(fisher_data) == 2):
            raise TypeError("fisher_data must be a pair (x, y) (y may be None)")
        fisher_data = (as_tensor_input("fisher_data[0] (x)", fisher_data[0]),
                       None if fisher_data[1] is None else as_tensor_input("fisher_data[1] (y)", fisher_data[1]))
    check_deterministic(model)  # before wrapping: a training-mode batch norm fails on the probe input
    net = as_chain_model(model, input_shape)
    lik = get_likelihood(likelihood)
    if not has_noise(lik):
        raise TypeError(f"the likelihood {type(lik).__name__} has no noise_width / noise_from_uniforms / "
                        "sample_from_noise, which the chains' random streams need (see smp_core.likelihoods)")
    if theta0 is None:
        theta0 = net.layout.flatten(net.module)
    theta0 = as_tensor_input("theta0", theta0)
    if not theta0.is_floating_point():
        raise TypeError(f"theta0 must hold floating-point numbers, got {theta0.dtype}")
    device, dtype = theta0.device, theta0.dtype
    if not x_train.is_floating_point():
        x_train = x_train.to(dtype)
    x_train = x_train.to(device=device, dtype=dtype)
    theta0 = _check_inputs(net, x_train, theta0, n_chains, tau, n_steps)
    n_obs, check_every = _check_run_settings(x_train.shape[0] if n_obs is None else n_obs, check_every,
                                             divergence_threshold)
    check_output_dim(lik, getattr(net, "out_dim", None))  # (determinism was checked before wrapping)
    statistic_dtype = statistic_dtype_of(statistic_dtype)
    if statistic_dtype == dtype:
        statistic_dtype = None  # the chains' own: the default, with the default's config and checkpoints
    if isinstance(preconditioner, str):
        layers = kronecker_layers(net) if preconditioner.endswith("-kfac") else ()
        precond = preconditioner_from_name(
            preconditioner, dim=net.layout.dim, blocks=net.layout.block_slices, layers=layers, ridge=ridge,
            beta=beta, period=period, ema_init=ema_init, ema_refresh=ema_refresh, statistic_dtype=statistic_dtype)
    elif statistic_dtype is not None:
        raise ValueError("statistic_dtype is given to run_smp with a Preconditioner object: build the preconditioner "
                         "with build_preconditioner(..., statistic_dtype=...) instead")
    else:
        precond = preconditioner
    kept_in = getattr(precond, "statistic_dtype", None)
    if kept_in is not None and torch.finfo(kept_in).eps > torch.finfo(dtype).eps:
        raise ValueError(f"statistic_dtype {kept_in} is coarser than the chains' {dtype}: it would round away what "
                         "the chains keep (leave it out to use theirs)")
    if fisher_data is None:
        fisher_data = (x_train, None)
    fx = fisher_data[0].to(device=device, dtype=dtype)
    fy = None if fisher_data[1] is None else fisher_data[1].to(device)
    if fisher == "empirical" and fy is None and precond.needs_curvature:
        raise ValueError("the empirical Fisher needs labels: pass fisher_data=(x, y)")

    def curvature(theta: torch.Tensor):
        return estimate_fisher(net, lik, theta, fx, fy, kind=fisher, structure=precond.structure,
                               dtype=getattr(precond, "statistic_dtype", None))

    config = {
        "preconditioner": precond.name, "tau": float(tau), "n_steps": n_steps, "n_chains": n_chains,
        "seed": seed, "first_chain": first_chain, "n_obs": n_obs, "fisher": fisher,
        "likelihood": lik.name, "d": net.layout.dim, **precond.hyper, "check_every": check_every,
        "divergence_threshold": divergence_threshold, "trace_every": trace_every,
    }
    if _uses_step_blocks(cuda_graph, net, lik, precond, device, dtype):
        # (recorded only when on, so that the keys of earlier step-by-step checkpoints still match)
        config["step_blocks"] = True
        takes = getattr(net, "takes_whole_step", None)  # blocks imply an element-wise rule
        if takes is not None and takes(lik, precond.elementwise, device, dtype):
            config["compiled_step"] = True  # each whole step in the kernel of smp_core.fused
    # n_steps is left out of the key so that a finished run can be extended to a larger K, and the
    # execution path (step blocks, the compiled step) since every path draws the same random numbers.
    key = _config_key({
        **{k: v for k, v in config.items() if k not in ("n_steps", "step_blocks", "compiled_step")},
        "theta0": hashlib.sha256(theta0.cpu().numpy().tobytes()).hexdigest(),
        "x": hashlib.sha256(x_train.cpu().numpy().tobytes()).hexdigest(),
    })
    path = Path(checkpoint) if checkpoint is not None else None
    inputs = _inputs_fingerprint(net, lik, fx, fy) if path is not None else {}
    state = _load_checkpoint(path, key, inputs, device) if path is not None and path.exists() else None
    if state is not None and state.step > n_steps:
        raise ValueError(f"the checkpoint {path} is at step {state.step}, beyond n_steps = {n_steps}")
    with torch.no_grad():
        if state is None:
            state = init_smp(net, lik, theta0, precond, curvature if precond.needs_curvature else None, seed,
                             first_chain)
        bar = progress_bar(total=n_steps, initial=state.step, disable=not progress, desc=f"SMP {precond.name}",
                   mininterval=1.0)
        last = {"step": state.step}

        def on_check(s: SMPState) -> None:
            bar.update(s.step - last["step"])
            bar.set_postfix(diverged=int((s.diverged_step >= 0).sum()), refresh=False)
            if path is not None and checkpoint_every and (s.step // checkpoint_every
                                                           != last["step"] // checkpoint_every):
                _save_checkpoint(path, s, key, inputs, started)
            last["step"] = s.step

        try:
            advance_smp(state, net, lik, x_train, precond, curvature, tau=tau, n_obs=n_obs, until=n_steps,
                        check_every=check_every, divergence_threshold=divergence_threshold,
                        trace_every=trace_every, on_check=on_check, cuda_graph=cuda_graph)
        finally:
            bar.close()
        if path is not None:
            _save_checkpoint(path, state, key, inputs, started)
    diverged = state.diverged_step >= 0
    theta = state.theta.clone()
    theta[diverged] = float("nan")
    if diverged.any():
        warnings.warn(f"{int(diverged.sum())} of {n_chains} chains diverged (tau={tau}, {precond.name}); "
                      "their rows of theta are NaN", stacklevel=2)
    trace = torch.stack(state.trace) if state.trace else None
    return SMPResult(theta=theta, diverged=diverged, diverged_step=state.diverged_step.clone(), trace=trace,
                     trace_steps=list(state.trace_steps), elapsed=state.elapsed_before + time.perf_counter() - started,
                     config=config, preconditioner=precond, precond_state=state.precond)
