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
  activations, with a hand-derived backward pass (the toy network; fastest).
* :class:`SequentialChainModel`: ``nn.Sequential`` of ``Linear``, ``Conv2d``, activations,
  pooling and ``Flatten`` (the LeNet-5-like network), batched with ``bmm`` and ``unfold``,
  differentiated by autograd.
* :class:`FunctionalChainModel`: any other module, through ``torch.func.functional_call``
  and ``torch.func.vmap``, differentiated by autograd.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from .layout import ParamLayout

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


def lenet5() -> nn.Sequential:
    """The LeNet-5-like CNN of Section 3.3.1 (d = 47,154) for 1x28x28 inputs and 10 classes.

    Two 5x5 convolutions (6 and 16 channels) with ReLU and 2x2 max-pooling give a flattened
    vector of 256, then fully connected layers of 128 and 84 units with ReLU and a linear
    layer to 10 logits.
    """
    return nn.Sequential(
        nn.Conv2d(1, 6, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(256, 128),
        nn.ReLU(),
        nn.Linear(128, 84),
        nn.ReLU(),
        nn.Linear(84, 10),
    )


# ---------------------------------------------------------------------------------------------
# The chain-model protocol
# ---------------------------------------------------------------------------------------------


class ChainModel(Protocol):
    """A network seen as a function of a batch of flat parameter vectors (see module docstring)."""

    layout: ParamLayout
    out_dim: int
    module: nn.Module

    def forward(self, theta: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Outputs ``(B, m)`` for ``theta`` ``(B, d)`` and ``x`` ``(B, *input_shape)``, and a context."""
        ...

    def vjp(self, ctx: Any, cotangent: torch.Tensor, retain: bool = False) -> torch.Tensor:
        """``J_b^T cotangent_b`` for every row: ``(B, d)``. ``retain=True`` allows another call."""
        ...


def predict(model: ChainModel, theta: torch.Tensor, x: torch.Tensor, batch_size: int = 8192) -> torch.Tensor:
    """Network outputs of every sample at shared inputs: ``(S, n, m)`` for ``theta`` ``(S, d)``, ``x`` ``(n, ...)``.

    Runs the user's module itself (one ``functional_call`` per sample and input batch), so it
    works for every module and uses its ordinary batched kernels.
    """
    theta = _check_theta(theta, model.layout.dim)
    module = model.module
    out = []
    with torch.no_grad():
        for row in theta:
            params = model.layout.unflatten(row)
            parts = [functional_call(module, params, (xb,)) for xb in x.split(batch_size)]
            out.append(torch.cat(parts).reshape(x.shape[0], -1))
    return torch.stack(out)


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


def _output_dim(module: nn.Module, input_shape: tuple[int, ...]) -> int:
    param = next(module.parameters())
    with torch.no_grad():
        out = module(torch.zeros(1, *input_shape, dtype=param.dtype, device=param.device))
    return int(out[0].numel())


# ---------------------------------------------------------------------------------------------
# Autograd-based chain models
# ---------------------------------------------------------------------------------------------


class _AutogradChainModel:
    """Shared autograd machinery: ``forward`` records a graph, ``vjp`` pulls a cotangent back."""

    def __init__(self, module: nn.Module, input_shape: tuple[int, ...]):
        self.module = module
        self.layout = ParamLayout.from_module(module)
        self.input_shape = tuple(input_shape)
        self.out_dim = _output_dim(module, self.input_shape)

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

    def vjp(self, ctx: Any, cotangent: torch.Tensor, retain: bool = False) -> torch.Tensor:
        leaves, out = ctx
        grads = torch.autograd.grad(out, leaves, cotangent, retain_graph=retain)
        return torch.cat([g.reshape(g.shape[0], -1) for g in grads], dim=1)


_ELEMENTWISE = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.ELU, nn.LeakyReLU, nn.Softplus, nn.Identity)
_PARAMETER_FREE = _ELEMENTWISE + (nn.MaxPool2d, nn.AvgPool2d, nn.Dropout)


class SequentialChainModel(_AutogradChainModel):
    """``nn.Sequential`` of Linear / Conv2d / activation / pooling / Flatten layers, batched by hand.

    A Linear layer becomes one ``baddbmm`` over chains; a Conv2d layer an ``unfold`` followed
    by one ``baddbmm``; parameter-free layers act row by row as they are.
    """

    def __init__(self, module: nn.Sequential, input_shape: tuple[int, ...]):
        if not sequential_supported(module):
            raise ValueError("SequentialChainModel needs an nn.Sequential of Linear, Conv2d (groups=1), "
                             "activation, pooling and Flatten layers; use FunctionalChainModel instead")
        super().__init__(module, input_shape)

    def _batched(self, params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        params = iter(params)
        h = x
        for layer in self.module:
            if isinstance(layer, nn.Linear):
                weight = next(params)
                h = torch.bmm(weight, h.unsqueeze(-1)).squeeze(-1)
                if layer.bias is not None:
                    h = h + next(params)
            elif isinstance(layer, nn.Conv2d):
                weight = next(params)
                height, width = h.shape[-2:]
                cols = F.unfold(h, layer.kernel_size, layer.dilation, layer.padding, layer.stride)
                h = torch.bmm(weight.reshape(batch, layer.out_channels, -1), cols)
                if layer.bias is not None:
                    h = h + next(params).unsqueeze(-1)
                out_hw = [
                    (size + 2 * p - dil * (k - 1) - 1) // s + 1
                    for size, p, dil, k, s in zip(
                        (height, width), layer.padding, layer.dilation, layer.kernel_size, layer.stride,
                        strict=True,
                    )
                ]
                h = h.reshape(batch, layer.out_channels, *out_hw)
            elif isinstance(layer, nn.Flatten):
                h = h.flatten(1)
            else:
                h = layer(h)
        return h


def sequential_supported(module: nn.Module) -> bool:
    """Whether :class:`SequentialChainModel` can batch this module."""
    if not isinstance(module, nn.Sequential) or len(module) == 0:
        return False
    for layer in module:
        if isinstance(layer, nn.Linear):
            continue
        if isinstance(layer, nn.Conv2d):
            if layer.groups != 1 or layer.padding_mode != "zeros" or isinstance(layer.padding, str):
                return False
            continue
        if isinstance(layer, nn.Flatten):
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


def _activation_derivative(layer: nn.Module, pre: torch.Tensor, post: torch.Tensor, grad: torch.Tensor):
    """``grad * act'(pre)`` for the element-wise activations of :class:`MLPChainModel`."""
    if isinstance(layer, nn.Identity):
        return grad
    if isinstance(layer, nn.ReLU):
        return grad * (pre > 0)
    if isinstance(layer, nn.GELU):
        return torch.ops.aten.gelu_backward(grad, pre, approximate=layer.approximate)
    if isinstance(layer, nn.Tanh):
        return grad * (1 - post * post)
    if isinstance(layer, nn.Sigmoid):
        return grad * post * (1 - post)
    raise TypeError(f"no hand-derived derivative for {type(layer).__name__}")


_MLP_ACTIVATIONS = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.Identity)


def mlp_supported(module: nn.Module) -> bool:
    """Whether :class:`MLPChainModel` applies: Linear layers with biases and simple activations."""
    if not isinstance(module, nn.Sequential) or len(module) == 0:
        return False
    if not isinstance(module[0], nn.Linear):
        return False
    for layer in module:
        if isinstance(layer, nn.Linear):
            if layer.bias is None:
                return False
        elif not isinstance(layer, _MLP_ACTIVATIONS):
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
                h = torch.baddbmm(bias.unsqueeze(-1), weight, h.unsqueeze(-1)).squeeze(-1)
                steps.append([])
            else:
                pre = h
                h = layer(pre)
                steps[-1].append((layer, pre, h))
        return h, (inputs, weights, steps)

    def vjp(self, ctx: Any, cotangent: torch.Tensor, retain: bool = False) -> torch.Tensor:
        inputs, weights, steps = ctx
        delta = cotangent
        grads: list[torch.Tensor] = []
        for i in reversed(range(len(weights))):
            for layer, pre, post in reversed(steps[i]):
                delta = _activation_derivative(layer, pre, post, delta)
            grads.append(delta)  # bias
            grads.append((delta.unsqueeze(-1) * inputs[i].unsqueeze(1)).flatten(1))  # weight
            if i > 0:
                delta = torch.bmm(weights[i].transpose(1, 2), delta.unsqueeze(-1)).squeeze(-1)
        return torch.cat(grads[::-1], dim=1)


def as_chain_model(module: nn.Module | ChainModel, input_shape: tuple[int, ...] | None = None) -> ChainModel:
    """Wrap a module in the fastest :class:`ChainModel` that supports it.

    ``input_shape`` (one input, no batch dimension) is needed unless the module is an MLP whose
    first layer is ``Linear``.
    """
    if hasattr(module, "vjp") and hasattr(module, "layout"):
        return module  # already a chain model
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    if mlp_supported(module):
        return MLPChainModel(module)
    if input_shape is None:
        first = next(iter(module.modules()))
        if isinstance(module, nn.Sequential) and isinstance(module[0], nn.Linear):
            input_shape = (module[0].in_features,)
        else:
            raise ValueError(f"input_shape is needed for a {type(first).__name__} (the shape of one input, "
                             "without the batch dimension, e.g. (1, 28, 28))")
    if sequential_supported(module):
        return SequentialChainModel(module, input_shape)
    return FunctionalChainModel(module, input_shape)
