"""A compiled CPU kernel for the SMP step of ``nn.Sequential`` networks: one thread per chain (or, for an MLP,
per vector of chains), start to end.

On a CPU the batched step of :class:`~smp_core.models.SequentialChainModel` (a LeNet-5 with
S = 100 chains) is bound by its ~60 kernel calls and the memory passes between them: each layer
writes its activations, patches and gradients for all chains before the next layer reads them.
:class:`FusedSequentialChainModel` runs the same forward and backward passes (the same hand-derived
gradients, in the same order: each layer's parameters are stepped after its input gradient has been
pulled back through its current weights) as one C++ function per chain, with the chain's
activations in a small buffer that stays in cache, threaded over chains with ``at::parallel_for``.
The parameter step of the element-wise preconditioners (``none``, a stored ``diag``, the EMA
``diag``) is done inside the kernel (eq. 2.14), so no ``(S, d)`` score is ever written; the block and
dense preconditioners (a :class:`~smp_core.preconditioners.MatrixRule`: stored inverses for fixed and
periodic, a Cholesky solve and the EMA update for EMA) step each chain once its score is formed.
A block of steps (:meth:`FusedSequentialChainModel.steps_`) runs each chain's steps back to back.

An MLP (``Linear`` layers and element-wise activations, the toy network of the paper) has too little
work per chain for one thread per chain to pay: its chains run eight (float32; four in float64) at a
time in the lanes of a vector (the EMA's Cholesky solves of the block and dense structures included), each
lane one chain, so a chain's numbers still do not depend on its neighbours; they agree with the per-chain
code's to rounding (sums in another order). Its float32 ``tanh`` (``Tanh``, and GELU's tanh form) is a
rational approximation on whole vectors (Eigen's, which XLA uses), within 4 units in the last place of the
correctly rounded value (a test checks it).

The kernel (``smp_core/csrc/fused_sequential.cpp``) is compiled on first use with
``torch.utils.cpp_extension.load`` (a C++ compiler and ninja are needed; about a minute, then
cached under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``). When it cannot be built,
:func:`fused_unavailable` says why and :func:`~smp_core.models.as_chain_model` keeps the batched
torch model; ``SMP_CORE_FUSED=0`` turns the kernel off. CUDA tensors always take the batched torch
path (:class:`~smp_core.models.SequentialChainModel`), where one kernel per layer over all chains is the fast way.

Supported layers: ``Linear``, ``Conv2d`` (groups 1, zero padding, any stride and dilation),
``ReLU``, ``GELU`` (exact or tanh), ``Tanh``, ``Sigmoid``, ``Identity``, ``MaxPool2d`` (values only, any window, stride,
padding, dilation and ``ceil_mode``) and ``Flatten`` (from dimension 1), each of exactly that type.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .likelihoods import Bernoulli, Categorical, Gaussian
from .models import (
    SequentialChainModel,
    WholeStep,
    _check_out,
    _check_rows,
    _pair,
    register_sequential_backend,
    sequential_supported,
)
from .preconditioners import (
    IDENTITY_RULE,
    ROUNDED_STATISTIC_WARNING,
    STORED_INVERSE_RULE,
    ElementwiseRule,
    MatrixRule,
)

_SOURCE = Path(__file__).with_name("csrc") / "fused_sequential.cpp"

# layer kinds of the C++ records (see the source)
_LINEAR, _CONV, _RELU, _TANH, _SIGMOID, _IDENTITY, _MAXPOOL, _GELU_TANH, _GELU_ERF = range(9)
_ACTIVATION_KIND = {nn.ReLU: _RELU, nn.Tanh: _TANH, nn.Sigmoid: _SIGMOID, nn.Identity: _IDENTITY}


def _activation_kind(layer: nn.Module) -> int | None:
    """The C++ record kind of an element-wise activation layer, or ``None`` for one the kernel lacks."""
    if type(layer) is nn.GELU:
        return {"tanh": _GELU_TANH, "none": _GELU_ERF}.get(layer.approximate)
    return _ACTIVATION_KIND.get(type(layer))

_extension: Any = None
_build_error: str | None = None
_lock = threading.Lock()


def _flags() -> list[str]:
    # no loop is replaced by a call to memcpy or memset: the kernel's copies are short rows
    flags = ["-O3", "-fopenmp", "-fno-tree-loop-distribute-patterns"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
    return flags


def _extension_name() -> str:
    """A name tied to the source, the compiler's flags and this processor (the kernel is built with
    ``-march=native``)."""
    digest = hashlib.sha256(_SOURCE.read_bytes())
    digest.update(f"{platform.machine()} {_cpu_model()} {torch.__version__} {_flags()}".encode())
    return f"smp_fused_sequential_{digest.hexdigest()[:16]}"


def _cpu_model() -> str:
    """The processor's name and instruction-set flags (a ``-march=native`` build runs only where both match)."""
    lines: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":", 1)[0].strip()
            if key in ("model name", "flags", "Features") and key not in lines:
                lines[key] = line
    except OSError:
        pass
    return " ".join(lines.values()) or platform.processor()


def load_extension():
    """The compiled kernel, built on first use; raises ``RuntimeError`` (saying why) when it cannot be."""
    if _extension is not None:
        return _extension
    reason = fused_unavailable()
    if reason is not None:
        raise RuntimeError(f"the fused CPU kernel is not available: {reason}")
    return _extension


def fused_unavailable(verbose: bool = False) -> str | None:  # verbose: the compiler's output
    """Why the fused kernel cannot be used here (``SMP_CORE_FUSED=0``, no compiler, a failed build), or
    ``None`` once it is built and loaded. The first call builds it (about a minute), later ones are free."""
    global _extension, _build_error
    if os.environ.get("SMP_CORE_FUSED", "1").strip().lower() in ("0", "false", "no", "off"):
        return "turned off by SMP_CORE_FUSED=0"
    if _extension is not None:
        return None
    if _build_error is not None:
        return _build_error
    with _lock:
        if _extension is None and _build_error is None:
            try:
                # importing cpp_extension logs a warning about CUDA on a machine without it: not our case
                logger = logging.getLogger("torch.utils.cpp_extension")
                level = logger.level
                logger.setLevel(logging.ERROR)
                try:
                    from torch.utils import cpp_extension
                finally:
                    logger.setLevel(level)

                _put_ninja_on_path()
                flags = _flags()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _extension = cpp_extension.load(name=_extension_name(), sources=[str(_SOURCE)],
                                                    extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                                    verbose=verbose)
            except Exception as error:  # noqa: BLE001 - any build failure means: use the torch path
                _build_error = f"building {_SOURCE.name} failed ({type(error).__name__}: {str(error)[:300]})"
    return _build_error


def _put_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the pip package's copy sits beside the venv's python, which is
    not on PATH when the venv was not activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def fused_supported(module: nn.Module) -> bool:
    """Whether :class:`FusedSequentialChainModel` can run this module (see the module docstring)."""
    if not sequential_supported(module):
        return False
    for layer in module:
        kind = type(layer)
        if kind in (nn.Linear, nn.Conv2d, nn.Flatten) or _activation_kind(layer) is not None:
            continue
        if kind is nn.MaxPool2d and not layer.return_indices:
            continue
        return False
    return True


@register_sequential_backend
def compiled_backend(module: nn.Sequential, input_shape: tuple[int, ...]) -> SequentialChainModel | None:
    """:class:`FusedSequentialChainModel` for a module of the layers it knows on the CPU, built on first use;
    ``None`` for another module, a module on a GPU (the batched model needs no build there), or where the
    kernel cannot be built (with a warning, once, unless turned off by ``SMP_CORE_FUSED=0``)."""
    first = next(module.parameters(), None)
    if not fused_supported(module) or (first is not None and first.device.type != "cpu"):
        return None
    reason = fused_unavailable()
    if reason is not None:
        _warn_once(f"the compiled CPU kernel of smp_core.fused is not used: {reason}; the batched torch "
                   "model runs instead (slower on a CPU, the same numbers up to rounding)")
        return None
    try:
        return FusedSequentialChainModel(module, input_shape)
    except ValueError:  # a layout the kernel does not take (e.g. a Linear on a 4-D input)
        return None


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED and "SMP_CORE_FUSED=0" not in message:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=4)


class FusedSequentialChainModel(SequentialChainModel, WholeStep):
    """:class:`~smp_core.models.SequentialChainModel` with the forward pass, the backward pass and
    the element-wise parameter step of every chain run by one compiled CPU function per chain.

    Same protocol and same numbers up to rounding (the sums run in another order); CUDA tensors,
    and rules the kernel does not know, take the batched torch path of the parent class.
    """

    def __init__(self, module: nn.Sequential, input_shape: tuple[int, ...]):
        if not fused_supported(module):
            raise ValueError("FusedSequentialChainModel supports Linear, Conv2d, ReLU, GELU, Tanh, Sigmoid, Identity, "
                             "MaxPool2d and Flatten layers only; use SequentialChainModel")
        super().__init__(module, input_shape)
        self._kernel = load_extension()  # built here, so that a machine without a compiler says so at once
        self._spec, self._acts_size, self._out_offset, self._args_size = self._build_spec()

    def _build_spec(self) -> tuple[list[int], int, int, int]:
        entries = self.layout.entries
        with torch.no_grad():
            first = next(self.module.parameters(), None)
            h = torch.zeros(1, *self.input_shape, dtype=first.dtype if first is not None else None,
                            device=first.device if first is not None else None)
            offset, size, n_args = 0, h.numel(), 0
            spec: list[int] = []
            for layer, slot in zip(self.module, self._slots, strict=True):
                needs = {nn.Linear: 2, nn.Conv2d: 4, nn.MaxPool2d: 4}.get(type(layer))
                if needs is not None and h.ndim != needs:
                    what = "a flat input (add nn.Flatten)" if needs == 2 else "a C x H x W input"
                    raise ValueError(f"{type(layer).__name__} receives an input of shape {tuple(h.shape[1:])}; the "
                                     f"fused kernel needs {what}")
                out = layer(h)
                if isinstance(layer, nn.Flatten):
                    h = out
                    continue
                out_offset = size
                if isinstance(layer, nn.Linear | nn.Conv2d):
                    w_off = entries[slot[0]].start
                    b_off = entries[slot[1]].start if slot[1] is not None else -1
                if isinstance(layer, nn.Linear):
                    spec += [_LINEAR, layer.in_features, layer.out_features, w_off, b_off, offset, out_offset]
                elif isinstance(layer, nn.Conv2d):
                    (c, height, width), (o, oh, ow) = h.shape[1:], out.shape[1:]
                    spec += [_CONV, c, height, width, o, oh, ow, *layer.kernel_size, *layer.stride, *layer.padding,
                             *layer.dilation, w_off, b_off, offset, out_offset]
                elif isinstance(layer, nn.MaxPool2d):
                    (c, height, width), (oh, ow) = h.shape[1:], out.shape[2:]
                    stride = layer.stride if layer.stride is not None else layer.kernel_size
                    spec += [_MAXPOOL, c, height, width, oh, ow, *_pair(layer.kernel_size), *_pair(stride),
                             *_pair(layer.padding), *_pair(layer.dilation), offset, out_offset, n_args]
                    n_args += out.numel()
                elif type(layer) is nn.GELU:  # its derivative is kept after its output, for the backward pass
                    spec += [_activation_kind(layer), h.numel(), offset, out_offset, out_offset + out.numel()]
                    size += out.numel()
                else:
                    spec += [_activation_kind(layer), h.numel(), offset, out_offset]
                offset, size, h = out_offset, size + out.numel(), out
        if size * 4 >= 2**31 or n_args >= 2**31:
            raise ValueError("the network's activations are too large for the fused kernel's 32-bit indices")
        return spec, size, offset, max(n_args, 1)

    def _usable(self, theta: torch.Tensor) -> bool:
        return theta.device.type == "cpu" and theta.dtype in (torch.float32, torch.float64)

    def forward(self, theta: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if not self._usable(theta):
            return super().forward(theta, x)
        _check_rows(theta, x, self.layout.dim)
        self._check_input(x)
        theta = theta.detach().contiguous()
        batch = theta.shape[0]
        acts = theta.new_empty(batch, self._acts_size)
        acts[:, : x[0].numel()].copy_(x.reshape(batch, -1))
        args = torch.empty(batch, self._args_size, dtype=torch.int32)  # max-pooling argmax, read by the backward pass
        self._kernel.forward(theta, acts, args, self._spec)
        out = acts[:, self._out_offset : self._out_offset + self.out_dim]
        return out, ("fused", acts, theta, args)

    def _check_input(self, x: torch.Tensor) -> None:
        n_in = math.prod(self.input_shape)
        if x.device.type != "cpu" or x[0].numel() != n_in:
            raise ValueError(f"the fused kernel needs CPU inputs of {n_in} values each ({self.input_shape}); got "
                             f"{tuple(x.shape[1:])} on {x.device}")

    def _backward(self, ctx, cotangent: torch.Tensor, theta: torch.Tensor, mode: int, gamma, grad=None,
                  scale=None, stat=None, beta: float = 0.0, ridge: float = 0.0) -> None:
        acts, args = ctx[1], ctx[3]
        if cotangent.shape != (acts.shape[0], self.out_dim):
            raise ValueError(f"the cotangent must have shape ({acts.shape[0]}, {self.out_dim}), got "
                             f"{tuple(cotangent.shape)}")
        empty = theta.new_empty(0, 0)
        self._kernel.backward(theta, acts, args, cotangent.detach().contiguous(), self._spec, mode, float(gamma),
                              empty if grad is None else grad, empty if scale is None else scale,
                              empty if stat is None else stat, float(beta), float(ridge))

    def vjp(self, ctx: Any, cotangent: torch.Tensor, retain: bool = False,
            out: torch.Tensor | None = None) -> torch.Tensor:
        if not (isinstance(ctx, tuple) and ctx[:1] == ("fused",)):
            return super().vjp(ctx, cotangent, retain, out)
        _, acts, theta, _ = ctx
        batch, dim = cotangent.shape[0], self.layout.dim
        result = acts.new_empty(batch, dim) if out is None else _check_out(out, batch, dim)
        target = result if result.is_contiguous() else acts.new_empty(batch, dim)
        # mode 0 reads the weights of the forward pass's theta and writes the gradient only
        self._backward(ctx, cotangent, theta, 0, 0.0, grad=target)
        if target is not result:
            result.copy_(target)
        return result

    def vjp_apply_(self, ctx: Any, cotangent: torch.Tensor, theta: torch.Tensor, rule, tensors, gamma) -> None:
        if not (isinstance(ctx, tuple) and ctx[:1] == ("fused",)):
            return super().vjp_apply_(ctx, cotangent, theta, rule, tensors, gamma)
        if not theta.is_contiguous():
            raise ValueError("the fused kernel steps a contiguous theta in place")
        if rule.covers_update and any(t.shape[0] != theta.shape[0] for t in tensors):
            raise ValueError(f"a rule that updates its state needs one state row per chain ({theta.shape[0]}), got "
                             f"rows {[t.shape[0] for t in tensors]}")
        mode = self._rule_mode(rule, tensors, theta)
        if mode is not None and mode[0] <= 3:
            self._backward(ctx, cotangent, theta, mode[0], gamma, **mode[1])
        else:
            # a rule the kernel does not know: form the score, then the rule
            rule.apply_(theta, self.vjp(ctx, cotangent), tensors, gamma)

    @staticmethod
    def _rule_kind(rule) -> int | None:
        """The kernel's update mode for a rule (1 identity, 2 stored scale, 3 EMA, 4 stored matrices), or ``None``."""
        kernel = rule.kernel if isinstance(rule, ElementwiseRule | MatrixRule) else None
        if rule is IDENTITY_RULE:
            return 1
        if rule is STORED_INVERSE_RULE:
            return 2
        if kernel is not None and kernel[0] == "ema":
            return 3
        if kernel is not None and kernel[0] == "matrices":
            return 4
        if kernel is not None and kernel[0] == "ema-matrices":
            return 5
        return None

    def _rule_mode(self, rule, tensors, theta: torch.Tensor):
        """The kernel's update mode and the keyword arguments of its tensors for an element-wise rule, or
        ``None`` when it has no such mode or the state tensors do not fit it (contiguous, theta's dtype,
        for EMA one row per chain)."""
        kind = self._rule_kind(rule)
        if kind == 1:
            return 1, {}
        if kind == 4:  # (the inverses of a Cholesky factorisation come transposed: copied to rows here)
            blocks = [n for block in rule.kernel[1] for n in block]
            fits = len(tensors) == len(rule.kernel[1]) and all(
                t.dtype == theta.dtype and t.device.type == "cpu" and t.shape[0] in (1, theta.shape[0])
                for t in tensors)
            return (4, {"blocks": blocks, "factors": [t.contiguous() for t in tensors]}) if fits else None
        if kind == 5:  # the statistics are written in place: each must be contiguous, one per chain
            blocks = [n for block in rule.kernel[3] for n in block]
            fits = len(tensors) == len(rule.kernel[3]) and all(
                t.is_contiguous() and t.dtype == theta.dtype and t.device.type == "cpu"
                and t.shape[0] == theta.shape[0] for t in tensors)
            return (5, {"blocks": blocks, "factors": list(tensors), "beta": rule.kernel[1], "ridge": rule.kernel[2]}) \
                if fits else None
        if kind is None or not (tensors[0].is_contiguous() and tensors[0].dtype == theta.dtype):
            return None
        if kind == 2:
            return 2, {"scale": tensors[0]}
        if tensors[0].shape[0] != theta.shape[0]:
            return None
        kernel = rule.kernel
        return 3, {"stat": tensors[0], "beta": kernel[1], "ridge": kernel[2]}

    @staticmethod
    def _likelihood_code(likelihood) -> tuple[int, float] | None:
        kind = type(likelihood)
        if kind is Bernoulli:
            return 0, 0.0
        if kind is Categorical:
            return 1, 0.0
        if kind is Gaussian:
            return 2, likelihood.sigma
        return None

    def takes_whole_step(self, likelihood, rule, device, dtype: torch.dtype = torch.float32) -> bool:
        """Whether :meth:`step_` runs steps with this likelihood and element-wise rule on ``device``
        for parameters of ``dtype`` (float32 or float64)."""
        return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.float64)
                and self._rule_kind(rule) is not None and self._likelihood_code(likelihood) is not None)

    def step_(self, theta: torch.Tensor, x: torch.Tensor, likelihood, noise: torch.Tensor, rule, tensors,
              gamma: float | torch.Tensor) -> bool:
        """One whole step of Algorithm 1 for every chain, in place: the forward pass at ``theta``, the
        response drawn from ``noise`` as ``likelihood.sample_from_noise`` draws it, its residual, and
        ``theta += gamma P^{-1} J^T residual`` by ``rule`` (an element-wise rule, eq. 2.14, or a
        :class:`~smp_core.preconditioners.MatrixRule`), each chain start to end on one thread (its
        parameter row is still in cache for the backward pass).

        Returns ``False`` (and does nothing) when the kernel cannot take this combination (a CUDA
        tensor, a likelihood or rule it does not know): the caller then takes the general path.
        """
        if not self._usable(theta) or not theta.is_contiguous() or not self.takes_whole_step(
                likelihood, rule, theta.device, theta.dtype):
            return False
        _check_rows(theta, x, self.layout.dim)
        want = (theta.shape[0], self.out_dim) if self._likelihood_code(likelihood)[0] == 2 else (theta.shape[0],)
        if noise.shape != want or noise.device.type != "cpu":
            raise ValueError(f"the noise of a {likelihood.name} response must be a CPU tensor of shape {want}, got "
                             f"{tuple(noise.shape)} on {noise.device}")
        # a block of one step, chain b's input row b of x
        gammas = torch.tensor([float(gamma)], dtype=torch.float64).to(theta.dtype)
        return self.steps_(theta, x, torch.arange(x.shape[0]).unsqueeze(0), likelihood, noise.unsqueeze(0), rule,
                           tensors, gammas)

    def steps_(self, theta: torch.Tensor, x_train: torch.Tensor, draws: torch.Tensor, likelihood, noise: torch.Tensor,
               rule, tensors, gammas: torch.Tensor) -> bool:
        """Steps ``j = 0, ..., n - 1`` as :meth:`step_` takes them, chain ``b``'s input of step ``j`` being row
        ``draws[j, b]`` of ``x_train``, its noise ``noise[j, b]`` and the step size ``gammas[j]``: each chain
        runs all ``n`` steps on one thread (its parameter row and activations stay in cache). The same numbers
        as ``n`` calls of :meth:`step_`; ``False`` (nothing done) where :meth:`step_` would decline."""
        if not self._usable(theta) or not theta.is_contiguous():
            return False
        code, mode = self._likelihood_code(likelihood), self._rule_mode(rule, tensors, theta)
        if code is None or mode is None:
            return False
        mode, extra = mode
        n, chains = draws.shape[0], theta.shape[0]
        want = (n, chains, self.out_dim) if code[0] == 2 else (n, chains)
        if draws.shape != (n, chains) or noise.shape != want or noise.device.type != "cpu":
            raise ValueError(f"a block of {n} steps of {chains} chains needs draws of shape {(n, chains)} and the "
                             f"noise of a {likelihood.name} response of shape {want} on the CPU, got "
                             f"{tuple(draws.shape)} and {tuple(noise.shape)} on {noise.device}")
        if code[0] == 0 and self.out_dim != 1:
            raise ValueError(f"a Bernoulli likelihood needs one output (a logit); the network has {self.out_dim}")
        self._check_input(x_train)
        empty = theta.new_empty(0, 0)
        redone = self._kernel.steps(
            theta, x_train.reshape(x_train.shape[0], -1).to(theta.dtype).contiguous(), draws.contiguous(),
            noise.to(theta.dtype).contiguous(), gammas.to(theta.dtype).contiguous(), self._spec, self._acts_size,
            self._args_size, self._out_offset, self.out_dim, code[0], code[1], mode, extra.get("scale", empty),
            extra.get("stat", empty), float(extra.get("beta", 0.0)), float(extra.get("ridge", 0.0)),
            extra.get("blocks", []), extra.get("factors", []))
        _warn_rounded(redone, theta, extra)
        return True


def _warn_rounded(redone: int, theta: torch.Tensor, extra: dict) -> None:
    """The EMA matrices' warning of :func:`smp_core.preconditioners._redo_failed`: float32 statistics whose
    solve the kernel redid in double (``redone``, those with a finite result), with a ridge."""
    if redone and theta.dtype != torch.float64 and extra.get("ridge", 0.0) > 0:
        warnings.warn(ROUNDED_STATISTIC_WARNING, RuntimeWarning, stacklevel=4)
