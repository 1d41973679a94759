"""The fast paths of the recursion, registered in :data:`PATHS` behind one dispatch point (:func:`choose_path`).

Each runs the same steps of Algorithm 1 as :func:`smp_core.recursion.plain_steps`, from the same
random numbers, and is tested equal to it. Each declares what it supports (:class:`FastPath`):

* ``"blocks"``: blocks of steps from pre-drawn covariates and noise with a tensor step size, run whole by
  the compiled kernel of a model that declares :class:`~smp_core.models.WholeStep` on a CPU (each chain's
  steps of a block back to back), or captured once as a CUDA graph and replayed;
* ``"elementwise"``: for ``none`` and the ``diag`` preconditioners, the step ``theta += gamma P^-1 s``
  (and an EMA's update) is applied by the preconditioner's element-wise rule in one pass, fused into
  the model's backward pass where the model declares :class:`~smp_core.models.FusedBackward` (the
  ``(S, d)`` score is never formed).

What a model offers it declares by subclassing those classes; nothing is found by the name of a method.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .models import ChainModel, FusedBackward, MLPChainModel, SequentialChainModel, WholeStep
from .preconditioners import ElementwiseRule, Preconditioner
from .streams import ChainStreams, has_noise


def accepts_out(fn) -> bool:
    """Whether ``fn`` takes an ``out=`` buffer (a user's chain model or preconditioner may not)."""
    try:
        return "out" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def elementwise_steps(model, likelihood, x_train, theta, precond, pstate, rule, draws, noise, tau, n_obs, k,
                      curvature):
    """Steps ``k + 1, ..., k + len(draws)`` with the preconditioner's element-wise rule; returns the
    preconditioner's state after them. With ``model.vjp_apply_`` the rule runs inside the backward pass."""
    fused_vjp = model.vjp_apply_ if isinstance(model, FusedBackward) else None
    if fused_vjp is None and rule.covers_update:  # an EMA rule needs the fused pass: the plain update
        rule = None
    # a score buffer for the steps that form the score (none is needed inside the fused pass)
    vjp_out = {"out": torch.empty_like(theta)} if fused_vjp is None and accepts_out(model.vjp) else {}
    for row, eps in zip(draws, noise, strict=True):
        k += 1
        gamma = tau / (n_obs + k)
        out, ctx = model.forward(theta, x_train.index_select(0, row))
        residual = likelihood.residual(out, likelihood.sample_from_noise(out, eps))
        if fused_vjp is not None:
            fused_vjp(ctx, residual, theta, rule, rule.tensors(pstate), gamma)
            score = None
        else:
            score = model.vjp(ctx, residual, **vjp_out)
            if rule is None:  # (an EMA without the fused pass) solve, add, update
                theta.add_(precond.solve(pstate, score), alpha=gamma)
            else:
                rule.apply_(theta, score, rule.tensors(pstate), gamma)
        if rule is None or not rule.covers_update:
            pstate = precond.update(pstate, k, theta, score, curvature)
    return pstate


@dataclass(frozen=True)
class FastPath:
    """A registered fast path: ``unavailable(model, likelihood, precond)`` says why it cannot run a combination
    (``None``: it can), and ``by_default(model, likelihood, precond, device, dtype)`` whether a run takes it
    without being asked. The recursion runs the path :func:`choose_path` names."""

    name: str
    unavailable: Callable[[ChainModel, Any, Preconditioner], str | None]
    by_default: Callable[[ChainModel, Any, Preconditioner, torch.device, torch.dtype], bool]


def choose_path(cuda_graph: bool | None, model, likelihood, precond: Preconditioner, device: torch.device,
                dtype: torch.dtype) -> str:
    """The one dispatch point: the first path of :data:`PATHS` that supports the combination and is taken by
    default, else ``"plain"`` (see the module docstring).

    ``cuda_graph``: ``False`` never takes the blocks; ``True`` insists on them (a ``ValueError`` says
    why they cannot run); ``None`` takes them on a CUDA device for the networks :mod:`smp_core.models`
    batches by hand, and on a CPU where a model's compiled kernel takes the whole step.
    """
    if cuda_graph:
        reason = BLOCKS.unavailable(model, likelihood, precond)
        if reason is not None:
            raise ValueError(f"cuda_graph=True needs blocks of steps, but {reason}")
        return BLOCKS.name
    for path in PATHS:
        if path is BLOCKS and cuda_graph is False:
            continue
        if path.unavailable(model, likelihood, precond) is None and path.by_default(model, likelihood, precond,
                                                                                     device, dtype):
            return path.name
    return "plain"


def step_blocks_unavailable(model: ChainModel, likelihood, precond: Preconditioner) -> str | None:
    """Why the recursion cannot run steps in blocks for this combination, or ``None`` when it can.

    A block of steps needs a rule for its steps (``Preconditioner.block_rule``: the element-wise rule of
    ``none`` and every ``diag``, or the stored matrices of a fixed or periodic ``block`` or ``dense``) whose
    state changes only through the rule itself (EMA) or at known steps (``update_every``: fixed,
    periodic), and a likelihood that draws its responses from pre-drawn noise
    (``noise_width`` / ``noise_from_uniforms`` / ``sample_from_noise``).
    """
    rule = precond.block_rule
    if rule is None:
        return (f"the '{precond.name}' preconditioner has no rule for blocks of steps (none, the diag ones, and "
                "fixed or periodic block and dense have)")
    if not rule.covers_update and precond.update_every is None:
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
    # a compiled kernel takes the whole block (each chain's steps back to back), else each step
    if isinstance(model, WholeStep) and model.steps_(theta, x_train, draws, likelihood, noise, rule, tensors, gammas):
        return
    for j in range(draws.shape[0]):
        rows = x_train.index_select(0, draws[j])
        out, ctx = model.forward(theta, rows)
        residual = likelihood.residual(out, likelihood.sample_from_noise(out, noise[j]))
        if fused_vjp is not None:
            fused_vjp(ctx, residual, theta, rule, tensors, gammas[j])
        else:
            rule.apply_(theta, model.vjp(ctx, residual), tensors, gammas[j])


class StepBlocks:
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
        # the fused backward pass steps piece by piece: element-wise rules only
        self.fused_vjp = model.vjp_apply_ if isinstance(model, FusedBackward) and isinstance(rule, ElementwiseRule) \
            else None
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


def _no_rule(model: ChainModel, likelihood, precond: Preconditioner) -> str | None:
    if precond.elementwise is None:
        return f"the '{precond.name}' preconditioner has no element-wise rule (only none and the diag ones have)"
    return None


def _blocks_by_default(model, likelihood, precond: Preconditioner, device: torch.device, dtype: torch.dtype) -> bool:
    """Blocks unasked on a CUDA device for the networks that :mod:`smp_core.models` batches by hand (their
    steps are known to be capturable; a user's chain model is captured only when asked), and on a CPU where
    the model's compiled kernel takes the whole step (:class:`~smp_core.models.WholeStep`)."""
    if device.type == "cuda":
        return isinstance(model, SequentialChainModel | MLPChainModel) and isinstance(precond.block_rule,
                                                                                        ElementwiseRule)
    return isinstance(model, WholeStep) and model.takes_whole_step(likelihood, precond.block_rule, device, dtype)


BLOCKS = FastPath("blocks", step_blocks_unavailable, _blocks_by_default)
ELEMENTWISE = FastPath("elementwise", _no_rule, lambda *_: True)
PATHS: tuple[FastPath, ...] = (BLOCKS, ELEMENTWISE)
"""The fast paths, in the order :func:`choose_path` tries them."""
