"""Networks of the paper and the batched "chain model" view of any ``nn.Module``.

SMP evaluates one score per chain per step, each chain with its own parameters. A
:class:`ChainModel` wraps a network so that ``forward(theta, x)`` takes a batch of flat
parameter vectors ``theta`` of shape ``(B, d)`` and one input per row, ``x`` of shape
``(B, *input_shape)``, and returns the outputs ``g(x_b, theta_b)`` of shape ``(B, m)``;
``vjp(ctx, v)`` returns the per-row vector-Jacobian products ``J_b^T v_b`` of shape
``(B, d)``. Every score of the paper is such a product: ``s = J^T r`` with ``r`` the
derivative of the log-likelihood in the network output (:mod:`smp_core.likelihoods`), and
so is every model-expected Fisher factor. Because the rows are independent, the gradient of
the sum over rows gives every row's gradient in one backward pass: no ``vmap`` and no Python
loop over chains.

Three implementations, chosen by :func:`as_chain_model`:

* :class:`MLPChainModel`: ``nn.Sequential`` of ``Linear`` layers and element-wise
  activations, with a hand-derived backward pass (the toy network on a GPU, or where the compiled
  CPU kernel is not built).
* :class:`SequentialChainModel`: ``nn.Sequential`` of ``Linear``, ``Conv2d``, activations,
  pooling and ``Flatten`` (the LeNet-5-like network), batched with ``bmm`` and a strided im2col,
  with a hand-derived backward pass (autograd only for the less common parameter-free layers).
* :class:`FunctionalChainModel`: any other module, through ``torch.func.functional_call``
  and ``torch.func.vmap``, differentiated by autograd.

A faster model for an ``nn.Sequential`` registers itself in :data:`SEQUENTIAL_BACKENDS` (the compiled
CPU kernel of :mod:`smp_core.fused` does, when imported; it takes MLPs too), so this module imports none of them.
"""

from __future__ import annotations

import abc
import math
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from .layout import ParamLayout
from .likelihoods import sigmoid
from .preconditioners import IDENTITY_RULE, STORED_INVERSE_RULE, ElementwiseRule

# ---------------------------------------------------------------------------------------------
# The paper's two networks
# ---------------------------------------------------------------------------------------------


def toy_mlp() -> nn.Sequential:
    """The 2-3-2-1 GELU network of Section 3.2.1 (d = 20).

    GELU is the tanh approximation, as in Lux.jl's ``gelu`` which the paper used. Parameter
    order (the flat vector): W1 (3x2, row-major), b1, W2 (2x3), b2, W3 (1x2), b3.
    """
    return nn.Sequential(
        nn.Linear(2, 3),
        nn.GELU(approximate="tanh"),
        nn.Linear(3, 2),
        nn.GELU(approximate="tanh"),
        nn.Linear(2, 1),
    )


def lenet5(dropout: float = 0.0) -> nn.Sequential:
    """The LeNet-5-like CNN of Section 3.3.1 (d = 47,154) for 1x28x28 inputs and 10 classes.

    Two 5x5 convolutions (6 and 16 channels) with ReLU and 2x2 max-pooling give a flattened
    vector of 256, then fully connected layers of 128 and 84 units with ReLU and a linear
    layer to 10 logits.

    ``dropout > 0`` (beyond the paper: the MC dropout baseline) puts an ``nn.Dropout(dropout)`` before
    each of the three fully connected layers. Dropout has no parameters, so the flat parameter vector
    (its length and order) is the same as without it; ``dropout = 0`` gives the paper's network, with
    no dropout layers at all.
    """
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout}")

    def drop() -> list[nn.Module]:
        return [nn.Dropout(dropout)] if dropout > 0 else []

    return nn.Sequential(
        nn.Conv2d(1, 6, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        *drop(),
        nn.Linear(256, 128),
        nn.ReLU(),
        *drop(),
        nn.Linear(128, 84),
        nn.ReLU(),
        *drop(),
        nn.Linear(84, 10),
    )


# ---------------------------------------------------------------------------------------------
# The chain-model protocol
# ---------------------------------------------------------------------------------------------


class ChainModel(Protocol):
    """A network seen as a function of a batch of flat parameter vectors (see module docstring). A chain model
    may also declare fast paths by subclassing :class:`FusedBackward` or :class:`WholeStep`."""

    layout: ParamLayout
    out_dim: int
    module: nn.Module

    def forward(self, theta: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Outputs ``(B, m)`` for ``theta`` ``(B, d)`` and ``x`` ``(B, *input_shape)``, and a context."""
        ...

    def vjp(self, ctx: Any, cotangent: torch.Tensor, retain: bool = False,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """``J_b^T cotangent_b`` for every row: ``(B, d)``. ``retain=True`` allows another call.

        ``out``, a ``(B, d)`` contiguous buffer, receives the result when given (the recursion
        reuses one buffer for every step instead of allocating a fresh ``(S, d)`` tensor).
        """
        ...


class FusedBackward(abc.ABC):
    """A fast path a chain model declares by subclassing: ``vjp_apply_`` takes the step of an element-wise
    :class:`~smp_core.preconditioners.ElementwiseRule` inside its backward pass, so that the ``(S, d)`` score is
    never formed (:func:`smp_core.fast_paths.elementwise_steps`). :class:`SequentialChainModel` declares it."""

    @abc.abstractmethod
    def vjp_apply_(self, ctx: Any, cotangent: torch.Tensor, theta: torch.Tensor, rule: ElementwiseRule,
                   tensors: tuple[torch.Tensor, ...], gamma: float | torch.Tensor) -> None:
        """``theta += gamma P^{-1} J^T cotangent`` row by row, by ``rule`` on its state ``tensors``, in place."""


class WholeStep(abc.ABC):
    """A fast path a chain model declares by subclassing: a compiled kernel takes a whole step (forward pass,
    the response drawn from given noise, backward pass and the rule's step) for the combinations it
    accepts (:class:`smp_core.fused.FusedSequentialChainModel` declares it)."""

    @abc.abstractmethod
    def takes_whole_step(self, likelihood, rule: ElementwiseRule | None, device, dtype: torch.dtype) -> bool:
        """Whether :meth:`step_` takes every step of a run with this likelihood, rule, device and dtype."""

    @abc.abstractmethod
    def step_(self, theta: torch.Tensor, x: torch.Tensor, likelihood, noise: torch.Tensor, rule: ElementwiseRule,
              tensors: tuple[torch.Tensor, ...], gamma: float | torch.Tensor) -> bool:
        """One whole step in place; ``False`` (nothing done) for a combination it does not take."""

    def steps_(self, theta: torch.Tensor, x_train: torch.Tensor, draws: torch.Tensor, likelihood, noise: torch.Tensor,
               rule: ElementwiseRule, tensors: tuple[torch.Tensor, ...], gammas: torch.Tensor) -> bool:
        """A block of whole steps in place: step ``j`` takes rows ``draws[j]`` of ``x_train``, the noise
        ``noise[j]`` and the step size ``gammas[j]``; ``False`` (nothing done) for a combination it does not
        take. By default, :meth:`step_` once per step; a kernel may run each chain's steps back to back."""
        for j in range(draws.shape[0]):
            if not self.step_(theta, x_train.index_select(0, draws[j]), likelihood, noise[j], rule, tensors,
                              gammas[j]):
                if j:
                    raise RuntimeError(f"{type(self).__name__}.step_ declined step {j} of a block it began")
                return False
        return True


def check_deterministic(model) -> None:
    """Raise a ``ValueError`` if a module in training mode would make the network random or make one
    input's output depend on the others of its batch: dropout (fresh masks from the global random
    generator, so scores of a thinned network and runs not reproducible from their seed), batch
    normalisation (the batch's statistics, and its running averages updated) and ``RReLU``. Call
    ``module.eval()`` first. Takes a chain model or an ``nn.Module``; a chain model without a module
    passes."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.dropout import _DropoutNd

    module = model if isinstance(model, nn.Module) else getattr(model, "module", None)
    if module is None:
        return
    found = sorted({type(m).__name__ for m in module.modules()
                    if m.training and isinstance(m, _DropoutNd | _BatchNorm | nn.RReLU)})
    if found:
        raise ValueError(f"the network has {', '.join(found)} layers in training mode, which draw random masks or "
                         "use the batch's statistics: call module.eval() before SMP, the Fisher or predictions")


def predict(model: nn.Module | ChainModel, theta: torch.Tensor, x: torch.Tensor, batch_size: int = 8192
            ) -> torch.Tensor:
    """Network outputs of every sample at shared inputs: ``(S, n, m)`` for ``theta`` ``(S, d)``, ``x`` ``(n, ...)``.

    ``model``: the ``nn.Module`` the samples are of, or its :class:`ChainModel`. Runs the user's module
    itself (one ``functional_call`` per sample and input batch), so it works for every module and uses
    its ordinary batched kernels. Rows of ``theta`` with NaN or infinite entries (chains that diverged, as
    :attr:`~smp_core.recursion.SMPResult.theta` holds them) are left out with a warning, as
    :meth:`~smp_core.recursion.SMPResult.samples` does.
    """
    if isinstance(model, nn.Module) and not hasattr(model, "layout"):
        module, layout = model, ParamLayout.from_module(model)
    elif hasattr(model, "layout") and isinstance(getattr(model, "module", None), nn.Module):
        module, layout = model.module, model.layout
    else:
        raise TypeError(f"model must be a torch.nn.Module or a smp_core ChainModel, got {type(model).__name__}")
    if not isinstance(x, torch.Tensor) or x.ndim < 1 or x.shape[0] == 0:
        raise ValueError(f"x must be a tensor of inputs (n, *input_shape) with n >= 1, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
    theta = _check_theta(theta, layout.dim)
    finite = torch.isfinite(theta).all(1)
    if not finite.all():
        warnings.warn(f"{int((~finite).sum())} of {theta.shape[0]} rows of theta hold NaN or infinite values (chains "
                      "that diverged) and are left out", stacklevel=2)
        theta = theta[finite]
    check_deterministic(module)
    out_dim = _output_dim(module, tuple(x.shape[1:]), "x")  # a clear error when the module cannot take x's rows
    out = []
    with torch.no_grad():
        for row in theta:
            params = layout.unflatten(row)
            parts = [functional_call(module, params, (xb,)) for xb in x.split(batch_size)]
            out.append(torch.cat(parts).reshape(x.shape[0], -1))
    return torch.stack(out) if out else theta.new_empty(0, x.shape[0], out_dim)


def _check_theta(theta: torch.Tensor, dim: int) -> torch.Tensor:
    if theta.ndim == 1:
        theta = theta.unsqueeze(0)
    if theta.ndim != 2 or theta.shape[1] != dim:
        raise ValueError(f"theta must have shape (S, {dim}) (one flat parameter vector per chain), "
                         f"got {tuple(theta.shape)}")
    return theta


def _check_rows(theta: torch.Tensor, x: torch.Tensor, dim: int) -> None:
    if theta.ndim != 2 or theta.shape[1] != dim:
        raise ValueError(f"theta must have shape (B, {dim}), got {tuple(theta.shape)}")
    if x.shape[0] != theta.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows but theta has {theta.shape[0]}: one input per chain row")


def _check_out(out: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    if out.shape != (rows, dim):
        raise ValueError(f"out must have shape ({rows}, {dim}), got {tuple(out.shape)}")
    if not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor (strides {out.stride()} given)")
    return out


def _output_dim(module: nn.Module, input_shape: tuple[int, ...], source: str = "x_train") -> int:
    """The number of outputs of one input of shape ``input_shape``; a ``ValueError`` naming that shape
    when the module cannot take it (instead of torch's message from deep inside the module)."""
    param = next(module.parameters())
    buffers = {name: b.clone() for name, b in module.named_buffers()}  # a probe must not change the user's module
    try:
        with torch.no_grad():
            out = functional_call(module, buffers, (torch.zeros(1, *input_shape, dtype=param.dtype,
                                                                device=param.device),))
    except (RuntimeError, ValueError, IndexError) as error:
        raise ValueError(f"the module cannot take inputs of shape {tuple(input_shape)} (one input, as {source}'s "
                         f"rows have it): {error}") from error
    return int(out[0].numel())


# ---------------------------------------------------------------------------------------------
# Autograd-based chain models
# ---------------------------------------------------------------------------------------------


class _ModuleChainModel:
    """What every chain model of a user's module records: the module, its layout, input and output sizes."""

    def __init__(self, module: nn.Module, input_shape: tuple[int, ...]):
        self.module = module
        self.layout = ParamLayout.from_module(module)
        self.input_shape = tuple(input_shape)
        self.out_dim = _output_dim(module, self.input_shape)


class _AutogradChainModel(_ModuleChainModel):
    """Shared autograd machinery: ``forward`` records a graph, ``vjp`` pulls a cotangent back."""

    def _batched(self, params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, theta: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        _check_rows(theta, x, self.layout.dim)
        # One contiguous leaf per parameter tensor: autograd then returns dense per-tensor gradients,
        # joined by one cat, instead of scattering each into a zero-filled (B, d) slice.
        leaves = [p.contiguous().requires_grad_(True) for p in self.layout.split(theta.detach())]
        with torch.enable_grad():
            out = self._batched(leaves, x).reshape(theta.shape[0], self.out_dim)
        return out.detach(), (leaves, out)

    def vjp(self, ctx: Any, cotangent: torch.Tensor, retain: bool = False,
            out: torch.Tensor | None = None) -> torch.Tensor:
        leaves, output = ctx
        grads = torch.autograd.grad(output, leaves, cotangent, retain_graph=retain)
        return torch.cat([g.reshape(g.shape[0], -1) for g in grads], dim=1, out=out)


_ELEMENTWISE = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.ELU, nn.LeakyReLU, nn.Softplus, nn.Identity)
_PARAMETER_FREE = _ELEMENTWISE + (nn.MaxPool2d, nn.AvgPool2d, nn.Dropout)


class SequentialChainModel(_ModuleChainModel, FusedBackward):
    """``nn.Sequential`` of Linear / Conv2d / activation / pooling / Flatten layers, batched by hand.

    The forward pass reads each chain's weights as strided views of ``theta`` (no copy): a
    Linear layer is one ``bmm`` over chains (in row form, see :func:`_row_times_transposed`), a
    Conv2d layer an im2col (a strided view, copied once) followed by one ``bmm``. The backward
    pass is derived by hand for the layers with parameters and writes every gradient straight into
    its slice of the ``(B, d)`` result
    (``grad W = delta h^T`` for Linear, ``grad W = delta cols^T`` for Conv2d, ``grad b = delta``
    summed over positions). ReLU, GELU, tanh, sigmoid and identity use their hand-derived
    derivatives, ``MaxPool2d`` the ATen forward-with-indices and backward kernels directly; other
    parameter-free layers (average pooling, dropout, other activations or subclasses that change
    ``forward``) are pulled back with a local autograd call on their small activations.
    """

    def __init__(self, module: nn.Sequential, input_shape: tuple[int, ...]):
        if not sequential_supported(module):
            raise ValueError("SequentialChainModel needs an nn.Sequential of Linear, Conv2d (groups=1), "
                             "activation, pooling and Flatten layers; use FunctionalChainModel instead")
        super().__init__(module, input_shape)
        # which layout entries belong to which layer: (weight index, bias index or None)
        self._slots, position = [], 0
        for layer in module:
            if isinstance(layer, nn.Linear | nn.Conv2d):
                bias = position + 1 if layer.bias is not None else None
                self._slots.append((position, bias))
                position += 1 + (layer.bias is not None)
            else:
                self._slots.append(None)
        # layers below the first one with parameters (e.g. a leading Flatten) need no pull-back
        self._first_param_layer = next(i for i, slot in enumerate(self._slots) if slot is not None)

    def forward(self, theta: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        _check_rows(theta, x, self.layout.dim)
        theta = theta.detach()
        params = self.layout.split(theta)
        batch = theta.shape[0]
        h, saved = x, []
        for layer, slot in zip(self.module, self._slots, strict=True):
            if isinstance(layer, nn.Linear):
                weight = params[slot[0]]
                saved.append((h, weight))
                out = _row_times_transposed(h, weight)
                h = out if slot[1] is None else out.add_(params[slot[1]])
            elif isinstance(layer, nn.Conv2d):
                weight = params[slot[0]].reshape(batch, layer.out_channels, -1)
                cols, out_hw = _im2col(h, layer)
                saved.append((cols, weight, h.shape))
                out = torch.bmm(weight, cols)
                if slot[1] is not None:
                    out.add_(params[slot[1]].unsqueeze(-1))
                h = out.reshape(batch, layer.out_channels, *out_hw)
            elif isinstance(layer, nn.Flatten):
                saved.append(h.shape)
                h = h.flatten(1)
            elif _hand_activation(layer):
                pre, (h, kept) = h, _activation(layer, h)
                saved.append((pre, kept))
            elif _plain_max_pool(layer):
                pre = h
                h, argmax = _max_pool_forward(pre, layer)
                saved.append((pre, argmax))
            else:
                h_in = h.detach().requires_grad_(True)
                with torch.enable_grad():
                    # an in-place layer (ReLU(inplace=True)) must not overwrite the autograd leaf
                    h_out = layer(h_in.clone() if getattr(layer, "inplace", False) else h_in)
                saved.append((h_in, h_out))
                h = h_out.detach()
        return h.reshape(batch, self.out_dim), saved

    def vjp(self, ctx: Any, cotangent: torch.Tensor, retain: bool = False,
            out: torch.Tensor | None = None) -> torch.Tensor:
        batch, dim = cotangent.shape[0], self.layout.dim
        result = cotangent.new_empty(batch, dim) if out is None else _check_out(out, batch, dim)
        grads = self.layout.split(result)

        def emit(index: int, grad: torch.Tensor) -> None:
            grads[index].copy_(grad.view(grads[index].shape))

        def emit_outer(index: int, delta: torch.Tensor, h: torch.Tensor) -> None:
            torch.mul(delta.unsqueeze(-1), h.unsqueeze(1), out=grads[index])

        self._pull_back(ctx, cotangent, retain, emit, emit_outer)
        return result

    def vjp_apply_(self, ctx: Any, cotangent: torch.Tensor, theta: torch.Tensor, rule: ElementwiseRule,
                   tensors: tuple[torch.Tensor, ...], gamma: float | torch.Tensor) -> None:
        """The step ``theta += gamma P^{-1} J^T cotangent`` of an element-wise preconditioner, in place,
        without forming the ``(B, d)`` score (eq. 2.14). ``gamma`` is a float or a 0-d tensor (see
        :class:`~smp_core.preconditioners.ElementwiseRule`).

        ``rule`` is the preconditioner's :class:`~smp_core.preconditioners.ElementwiseRule` and
        ``tensors`` its state tensors (``rule.tensors(state)``, each ``(1, d)`` or ``(B, d)``). Each
        layer's parameters are stepped as soon as its input gradient has been pulled back through its
        current weights; the gradient of a linear layer is handed over as its two outer-product factors
        (when the rule takes them) or formed a few chains at a time (small enough to stay in cache).
        So every weight, and every state entry the rule uses, is read and written once, with no score
        array written and read back: the step of a large model on a CPU is bound by memory traffic,
        not by arithmetic. ``ctx`` must come from ``forward`` at this ``theta`` and is used up.
        """
        if rule.covers_update and any(t.shape[0] != theta.shape[0] for t in tensors):
            # one shared row would receive the update of every chain in turn
            raise ValueError(f"a rule that updates its state needs one state row per chain ({theta.shape[0]}), got "
                             f"rows {[t.shape[0] for t in tensors]}")
        params = self.layout.split(theta)
        parts = [self.layout.split(t) for t in tensors]

        def pieces(index: int, rows: slice | None = None) -> list[torch.Tensor]:
            return [p[index] if rows is None or p[index].shape[0] == 1 else p[index][rows] for p in parts]

        def emit(index: int, grad: torch.Tensor) -> None:
            target = params[index]
            rule.apply_(target, grad.view(target.shape), pieces(index), gamma)

        def emit_outer(index: int, delta: torch.Tensor, h: torch.Tensor) -> None:
            target = params[index]
            if rule.apply_outer_ is not None:
                rule.apply_outer_(target, delta, h, pieces(index), gamma)
                return
            # a few chains at a time on a CPU (the chunk stays in cache); all at once on a GPU, where
            # each chunk costs kernel launches and memory is no concern at this size
            rows = target.shape[0] if target.is_cuda else max(1, _OUTER_CHUNK_ELEMENTS // (
                target.shape[1] * target.shape[2]))
            for start in range(0, target.shape[0], rows):
                part = slice(start, start + rows)
                outer = delta[part].unsqueeze(-1) * h[part].unsqueeze(1)
                rule.apply_(target[part], outer, pieces(index, part), gamma)

        self._pull_back(ctx, cotangent, False, emit, emit_outer)

    def vjp_update_(self, ctx: Any, cotangent: torch.Tensor, theta: torch.Tensor, scale: float,
                    inverse_diagonal: torch.Tensor | None = None) -> None:
        """``theta += scale * D * J^T cotangent`` in place, without forming the ``(B, d)`` score.

        ``D`` is ``inverse_diagonal`` (``(1, d)`` or ``(B, d)``), or the identity when ``None``: the
        update of SMP-none and of a stored diagonal preconditioner, through :meth:`vjp_apply_`.
        """
        if inverse_diagonal is None:
            self.vjp_apply_(ctx, cotangent, theta, IDENTITY_RULE, (), scale)
        else:
            self.vjp_apply_(ctx, cotangent, theta, STORED_INVERSE_RULE, (inverse_diagonal,), scale)

    def _pull_back(self, saved: Any, cotangent: torch.Tensor, retain: bool, emit, emit_outer) -> None:
        """The backward pass; ``emit(index, grad)`` / ``emit_outer(index, delta, h)`` receive each
        parameter tensor's gradient (``delta h^T`` given as its two factors) after the layer's input
        gradient has been computed from its weights."""
        batch = cotangent.shape[0]
        delta = cotangent
        first = self._first_param_layer
        for i in reversed(range(first, len(self.module))):
            layer, slot, record = self.module[i], self._slots[i], saved[i]
            need_input = i > first
            if isinstance(layer, nn.Linear):
                h, weight = record
                delta_out = delta.reshape(batch, -1)
                if need_input:
                    delta = torch.bmm(delta_out.unsqueeze(1), weight).squeeze(1)
                emit_outer(slot[0], delta_out, h)
                if slot[1] is not None:
                    emit(slot[1], delta_out)
            elif isinstance(layer, nn.Conv2d):
                cols, weight, in_shape = record
                delta_out = delta.reshape(batch, layer.out_channels, -1)
                if need_input:
                    delta = _col2im(torch.bmm(weight.transpose(1, 2), delta_out), in_shape, layer)
                emit(slot[0], torch.bmm(delta_out, cols.transpose(1, 2)))
                if slot[1] is not None:
                    emit(slot[1], delta_out.sum(-1))
            elif isinstance(layer, nn.Flatten):
                delta = delta.reshape(record)
            elif _hand_activation(layer):
                pre, post = record
                delta = _activation_derivative(layer, pre, post, delta.reshape(post.shape))
            elif _plain_max_pool(layer):
                pre, argmax = record
                delta = _max_pool_backward(delta.reshape(argmax.shape), pre, argmax, layer)
            else:
                h_in, h_out = record
                (delta,) = torch.autograd.grad(h_out, h_in, delta.reshape(h_out.shape), retain_graph=retain)


_OUTER_CHUNK_ELEMENTS = 1 << 18  # 1 MB of float32 per chunk of outer products in vjp_apply_


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(value)


def _plain_max_pool(layer: nn.Module) -> bool:
    """A ``MaxPool2d`` (any window, stride, padding, dilation) that returns values only."""
    return type(layer) is nn.MaxPool2d and not layer.return_indices


def _max_pool_args(layer: nn.MaxPool2d) -> list:
    stride = layer.stride if layer.stride is not None else layer.kernel_size
    return [list(_pair(layer.kernel_size)), list(_pair(stride)), list(_pair(layer.padding)),
            list(_pair(layer.dilation)), layer.ceil_mode]


def _max_pool_forward(pre: torch.Tensor, layer: nn.MaxPool2d) -> tuple[torch.Tensor, torch.Tensor]:
    """Max-pooling values and argmax indices by the ATen kernel directly (the numbers autograd uses,
    without its bookkeeping)."""
    return torch.ops.aten.max_pool2d_with_indices(pre, *_max_pool_args(layer))


def _max_pool_backward(grad: torch.Tensor, pre: torch.Tensor, argmax: torch.Tensor, layer: nn.MaxPool2d):
    """The adjoint of :func:`_max_pool_forward`: ``grad`` routed to the argmax of each window."""
    return torch.ops.aten.max_pool2d_with_indices_backward(grad, pre, *_max_pool_args(layer), argmax)


def _row_times_transposed(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight_b h_b`` for every row: ``(B, out)`` from ``h`` ``(B, in)`` and ``weight`` ``(B, out, in)``.

    Computed as the row vector ``h_b^T W_b^T`` (a ``(B, 1, in) x (B, in, out)`` ``bmm``): with MKL
    on some CPUs that is several times faster than the column form ``W_b h_b`` for the same
    numbers (``benchmarks/bench_recursion.py`` times both).
    """
    return torch.bmm(h.unsqueeze(1), weight.transpose(1, 2)).squeeze(1)


def _conv_output_size(padded_h: int, padded_w: int, layer: nn.Conv2d) -> tuple[int, int]:
    (kh, kw), (sh, sw), (dh, dw) = layer.kernel_size, layer.stride, layer.dilation
    return (padded_h - dh * (kh - 1) - 1) // sh + 1, (padded_w - dw * (kw - 1) - 1) // sw + 1


def _im2col(h: torch.Tensor, layer: nn.Conv2d) -> tuple[torch.Tensor, list[int]]:
    """``(B, C * kh * kw, L)`` patches of ``h`` ``(B, C, H, W)`` in ``F.unfold``'s order, and the output size."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = layer.kernel_size, layer.stride, layer.padding, layer.dilation
    if ph or pw:
        h = F.pad(h, (pw, pw, ph, ph))
    batch, channels, height, width = h.shape
    out_h, out_w = _conv_output_size(height, width, layer)
    sb, sc, sy, sx = h.stride()
    patches = h.as_strided((batch, channels, kh, kw, out_h, out_w), (sb, sc, dh * sy, dw * sx, sh * sy, sw * sx))
    return patches.reshape(batch, channels * kh * kw, out_h * out_w), [out_h, out_w]


def _col2im(cols: torch.Tensor, in_shape: torch.Size, layer: nn.Conv2d) -> torch.Tensor:
    """The adjoint of :func:`_im2col`: sums the patch gradients back onto the input ``(B, C, H, W)``.

    On the CPU :func:`_col2im_indexed` (two kernels: the step of a small CNN is bound by the number
    of kernels it launches), elsewhere :func:`_col2im_strided` (CUDA's ``index_add_`` adds with
    atomics, in no fixed order). Both add the patches of every input position in the same order,
    so they give the same numbers to the bit.
    """
    if cols.device.type == "cpu":
        return _col2im_indexed(cols, in_shape, layer)
    return _col2im_strided(cols, in_shape, layer)


def _col2im_strided(cols: torch.Tensor, in_shape: torch.Size, layer: nn.Conv2d) -> torch.Tensor:
    """:func:`_col2im` by one strided in-place add per kernel offset."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = layer.kernel_size, layer.stride, layer.padding, layer.dilation
    batch, channels, height, width = in_shape
    padded_h, padded_w = height + 2 * ph, width + 2 * pw
    out_h, out_w = _conv_output_size(padded_h, padded_w, layer)
    patches = cols.view(batch, channels, kh, kw, out_h, out_w)
    grad = cols.new_zeros(batch, channels, padded_h, padded_w)
    sb, sc, sy, sx = grad.stride()
    for i in range(kh):
        for j in range(kw):
            grad.as_strided((batch, channels, out_h, out_w), (sb, sc, sh * sy, sw * sx),
                            i * dh * sy + j * dw * sx).add_(patches[:, :, i, j])
    return grad[:, :, ph : ph + height, pw : pw + width]


def _col2im_indexed(cols: torch.Tensor, in_shape: torch.Size, layer: nn.Conv2d) -> torch.Tensor:
    """:func:`_col2im` by one ``index_add_`` over a cached map from patch entries to input positions."""
    (ph, pw) = layer.padding
    batch, channels, height, width = in_shape
    padded_h, padded_w = height + 2 * ph, width + 2 * pw
    index = _col2im_index(channels, padded_h, padded_w, layer, cols.device)
    grad = cols.new_zeros(batch, channels * padded_h * padded_w)
    grad.index_add_(1, index, cols.reshape(batch, -1))
    return grad.view(batch, channels, padded_h, padded_w)[:, :, ph : ph + height, pw : pw + width]


_COL2IM_INDEX: dict[tuple, torch.Tensor] = {}


def _col2im_index(channels: int, padded_h: int, padded_w: int, layer: nn.Conv2d, device) -> torch.Tensor:
    """For every entry of the ``(C * kh * kw, L)`` patch matrix of :func:`_im2col`, the flat position
    ``c * Hp * Wp + y * Wp + x`` of the padded input it was read from (cached per geometry)."""
    key = (channels, padded_h, padded_w, layer.kernel_size, layer.stride, layer.dilation, str(device))
    index = _COL2IM_INDEX.get(key)
    if index is None:
        (kh, kw), (sh, sw), (dh, dw) = layer.kernel_size, layer.stride, layer.dilation
        out_h, out_w = _conv_output_size(padded_h, padded_w, layer)
        c = torch.arange(channels).view(channels, 1, 1, 1, 1)
        y = (torch.arange(kh) * dh).view(1, kh, 1, 1, 1) + (torch.arange(out_h) * sh).view(1, 1, 1, out_h, 1)
        x = (torch.arange(kw) * dw).view(1, 1, kw, 1, 1) + (torch.arange(out_w) * sw).view(1, 1, 1, 1, out_w)
        index = (c * padded_h * padded_w + y * padded_w + x).reshape(-1).to(device)
        _COL2IM_INDEX[key] = index
    return index


def sequential_supported(module: nn.Module) -> bool:
    """Whether :class:`SequentialChainModel` can batch this module.

    Layers with parameters must be exactly ``nn.Linear`` or ``nn.Conv2d``: a subclass may change
    ``forward``, which the hand-derived passes would silently ignore.
    """
    if not isinstance(module, nn.Sequential) or len(module) == 0:
        return False
    for layer in module:
        if type(layer) is nn.Linear:
            continue
        if type(layer) is nn.Conv2d:
            if layer.groups != 1 or layer.padding_mode != "zeros" or isinstance(layer.padding, str):
                return False
            continue
        if type(layer) is nn.Flatten:
            if layer.start_dim != 1 or layer.end_dim != -1:
                return False
            continue
        if isinstance(layer, _PARAMETER_FREE) and not any(True for _ in layer.parameters()):
            continue
        return False
    return True


class FunctionalChainModel(_AutogradChainModel):
    """Any ``nn.Module``: ``vmap`` over ``torch.func.functional_call`` (slower, fully general).

    The module must act on each input independently (no batch statistics: put batch-norm
    layers in eval mode).
    """

    def __init__(self, module: nn.Module, input_shape: tuple[int, ...]):
        super().__init__(module, input_shape)

        names = self.layout.names

        def single(params: tuple[torch.Tensor, ...], x_row: torch.Tensor) -> torch.Tensor:
            named = dict(zip(names, params, strict=True))
            return functional_call(self.module, named, (x_row.unsqueeze(0),)).reshape(-1)

        self._vmapped = vmap(single)

    def _batched(self, params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return self._vmapped(tuple(params), x)


# ---------------------------------------------------------------------------------------------
# Hand-derived MLP
# ---------------------------------------------------------------------------------------------


_MLP_ACTIVATIONS = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.Identity)


def _hand_activation(layer: nn.Module) -> bool:
    """One of the activations with a hand-derived derivative (exact type: a subclass may change forward)."""
    return type(layer) in _MLP_ACTIVATIONS


_GELU_C = math.sqrt(2 / math.pi)


def _gelu(h: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``h Phi(h)`` (or its tanh approximation) and its derivative, from ``exp``, ``erf`` and ``tanh``
    (``F.gelu`` and its backward round by a value's place in the batch on a CPU; these do not). The
    derivative is computed here, with the value's intermediates, and kept for the backward pass."""
    h2 = h * h
    if approximate == "tanh":
        t = h2.mul(0.044715).add_(1).mul_(h).mul_(_GELU_C).tanh_()
        cdf = t.add(1).mul_(0.5)
        slope = h2.mul_(3 * 0.044715).add_(1).mul_(h).mul_(0.5 * _GELU_C).mul_(t.mul_(t).neg_().add_(1))
    else:
        cdf = torch.erf(h * math.sqrt(0.5)).add_(1).mul_(0.5)
        slope = h2.mul_(-0.5).exp_().mul_(h).mul_(1 / math.sqrt(2 * math.pi))
    return h * cdf, slope.add_(cdf)


def _activation(layer: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation applied out of place (an ``inplace=True`` layer must not overwrite saved inputs),
    and what its derivative needs (:func:`_activation_derivative`: the output, or GELU's derivative).
    Each chain's value depends on its own inputs only, never on its place in the batch."""
    if isinstance(layer, nn.ReLU):
        out = torch.relu(h)
    elif isinstance(layer, nn.GELU):
        return _gelu(h, layer.approximate)
    elif isinstance(layer, nn.Tanh):
        out = torch.tanh(h)
    elif isinstance(layer, nn.Sigmoid):
        out = sigmoid(h)
    else:
        out = h
    return out, out


def _activation_derivative(layer: nn.Module, pre: torch.Tensor, saved: torch.Tensor, grad: torch.Tensor):
    """``grad * act'(pre)`` for the element-wise activations of :class:`MLPChainModel`; ``saved`` is the
    second value of :func:`_activation` (the output; GELU's derivative)."""
    post = saved
    if isinstance(layer, nn.Identity):
        return grad
    if isinstance(layer, nn.ReLU):
        # grad where post > 0, else 0: the kernel autograd uses (a masked select is several times slower)
        return torch.ops.aten.threshold_backward(grad, post, 0)
    if isinstance(layer, nn.GELU):
        return grad * saved
    if isinstance(layer, nn.Tanh):
        return grad * (1 - post * post)
    if isinstance(layer, nn.Sigmoid):
        return grad * post * (1 - post)
    raise TypeError(f"no hand-derived derivative for {type(layer).__name__}")


def mlp_supported(module: nn.Module) -> bool:
    """Whether :class:`MLPChainModel` applies: exactly ``nn.Linear`` layers with biases and simple activations."""
    if not isinstance(module, nn.Sequential) or len(module) == 0:
        return False
    if type(module[0]) is not nn.Linear:
        return False
    for layer in module:
        if type(layer) is nn.Linear:
            if layer.bias is None:
                return False
        elif not _hand_activation(layer):
            return False
    return True


class MLPChainModel:
    """A multilayer perceptron with a hand-derived, batched backward pass (no autograd).

    Forward: ``z_l = W_l h_{l-1} + b_l``, ``h_l = act(z_l)``. Backward for a cotangent ``v``
    on the output: ``delta = v``; for each layer from the top, ``grad b_l = delta``,
    ``grad W_l = delta h_{l-1}^T``, then ``delta = act'(z_{l-1}) * W_l^T delta``.
    """

    def __init__(self, module: nn.Sequential, input_shape: tuple[int, ...] | None = None):
        if not mlp_supported(module):
            raise ValueError("MLPChainModel needs an nn.Sequential of Linear layers (with bias) and "
                             "ReLU/GELU/Tanh/Sigmoid/Identity activations")
        self.module = module
        self.layout = ParamLayout.from_module(module)
        self.input_shape = (module[0].in_features,)
        self.out_dim = [layer for layer in module if isinstance(layer, nn.Linear)][-1].out_features

    def forward(self, theta: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        _check_rows(theta, x, self.layout.dim)
        params = iter(self.layout.split(theta))
        h = x.reshape(x.shape[0], -1)
        inputs, weights, steps = [], [], []  # steps: (activation layers after this linear, pre, post)
        for layer in self.module:
            if isinstance(layer, nn.Linear):
                weight, bias = next(params), next(params)
                inputs.append(h)
                weights.append(weight)
                h = torch.baddbmm(bias.unsqueeze(1), h.unsqueeze(1), weight.transpose(1, 2)).squeeze(1)
                steps.append([])
            else:
                pre = h
                h, kept = _activation(layer, pre)
                steps[-1].append((layer, pre, kept))
        return h, (inputs, weights, steps)

    def vjp(self, ctx: Any, cotangent: torch.Tensor, retain: bool = False,
            out: torch.Tensor | None = None) -> torch.Tensor:
        inputs, weights, steps = ctx
        delta = cotangent
        grads: list[torch.Tensor] = []
        for i in reversed(range(len(weights))):
            for layer, pre, post in reversed(steps[i]):
                delta = _activation_derivative(layer, pre, post, delta)
            grads.append(delta)  # bias
            grads.append((delta.unsqueeze(-1) * inputs[i].unsqueeze(1)).flatten(1))  # weight
            if i > 0:
                delta = torch.bmm(delta.unsqueeze(1), weights[i]).squeeze(1)
        return torch.cat(grads[::-1], dim=1, out=out)


def as_chain_model(module: nn.Module | ChainModel, input_shape: tuple[int, ...] | None = None) -> ChainModel:
    """Wrap a module in the fastest :class:`ChainModel` that supports it: the compiled kernel of
    :mod:`smp_core.fused` (built on first use; CPU tensors) for an ``nn.Sequential`` of the layers it
    knows, else :class:`MLPChainModel` for an MLP, else :class:`SequentialChainModel`, else
    :class:`FunctionalChainModel`.

    ``input_shape`` (one input, no batch dimension) is needed unless the module is an ``nn.Linear``
    or an ``nn.Sequential`` whose first layer is ``Linear``. Parameters with ``requires_grad=False`` are
    frozen (left out of the layout, never sampled); a module with frozen parameters takes
    :class:`FunctionalChainModel`, which calls it with the sampled ones substituted.
    """
    if hasattr(module, "vjp") and hasattr(module, "layout"):
        return module  # already a chain model
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    if input_shape is not None and (not isinstance(input_shape, tuple | list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in input_shape)):
        raise ValueError(f"input_shape must be a tuple of positive integers (one input's shape, no batch "
                         f"dimension), got {input_shape!r}")
    frozen = any(not p.requires_grad for p in module.parameters())
    if mlp_supported(module) and not frozen:
        for backend in SEQUENTIAL_BACKENDS:  # the compiled CPU kernel, where it takes the module
            model = backend(module, (module[0].in_features,))
            if model is not None:
                return model
        return MLPChainModel(module)
    if input_shape is None:
        first = next(iter(module.modules()))
        if isinstance(module, nn.Linear):  # a linear model: its input is a vector of in_features
            input_shape = (module.in_features,)
        elif isinstance(module, nn.Sequential) and isinstance(module[0], nn.Linear):
            input_shape = (module[0].in_features,)
        else:
            raise ValueError(f"input_shape is needed for a {type(first).__name__} (the shape of one input, "
                             "without the batch dimension, e.g. (1, 28, 28))")
    if sequential_supported(module) and not frozen:
        for backend in SEQUENTIAL_BACKENDS:
            model = backend(module, input_shape)
            if model is not None:
                return model
        return SequentialChainModel(module, input_shape)
    return FunctionalChainModel(module, input_shape)


SEQUENTIAL_BACKENDS: list[Callable[[nn.Sequential, tuple[int, ...]], ChainModel | None]] = []
"""Faster chain models for an ``nn.Sequential`` that :class:`SequentialChainModel` supports, tried in order by
:func:`as_chain_model`: each takes the module and one input's shape and returns its chain model, or ``None``
where it does not apply. :mod:`smp_core.fused` registers its compiled CPU kernel here when it is imported
(``import smp_core`` imports it), so that this module never imports it."""


def register_sequential_backend(backend: Callable[[nn.Sequential, tuple[int, ...]], ChainModel | None]):
    """Add ``backend`` to :data:`SEQUENTIAL_BACKENDS` (once); returns it, so it can decorate."""
    if backend not in SEQUENTIAL_BACKENDS:
        SEQUENTIAL_BACKENDS.append(backend)
    return backend
