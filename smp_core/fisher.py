"""Fisher information estimates over a data set, in batches (Sections 3.1.1, 3.2.3 and 3.3.3).

Two estimates of ``I(theta)`` at a batch of parameters ``theta`` ``(C, d)``, both of the form
``(1/n) sum_i sum_c v_ic v_ic^T`` for vectors ``v`` computed per example:

* **model-expected** (the toy example, eq. in Section 3.2.3): ``v_ic = J_i^T L_i[:, c]`` where
  ``J_i = d g(x_i, theta) / d theta`` and ``L_i L_i^T`` is the output Fisher of the
  likelihood (``p(1-p)`` for Bernoulli, ``diag(pi) - pi pi^T`` for the softmax, ``I / sigma^2``
  for the Gaussian). Needs only the inputs ``x``.
* **empirical** (MNIST, eq. in Section 3.3.3): ``v_i = grad log f_theta(y_i | x_i)``, the observed
  score; needs inputs and labels.

Per-example gradients with a different ``theta`` per chain come from one backward pass over
"virtual rows" (every chain paired with every example of a batch), so the cost is that of
``C * n`` scores and the memory that of ``C * batch_size`` parameter vectors.

The diagonal of the empirical Fisher, the preconditioner of the MNIST study, has a faster exact
path for networks whose parameters all sit in ``Linear`` and ``Conv2d`` layers
(:func:`diagonal_empirical_fisher_by_layers`): one ordinary batched forward and backward pass per
chain over many examples, which never forms a per-example gradient of the whole network. For a
linear layer ``sum_i (grad W_i)^2 = (delta^2)^T (h^2)``, one matrix product over the examples;
a convolution forms its (small) per-example weight gradients from the patches of its input.

The Kronecker-factored (KFAC) statistic of the ``kfac`` structure, beyond the paper, comes from the
same recorded layer inputs and output gradients (:func:`kronecker_fisher`).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.func import functional_call

from .likelihoods import check_output_dim, check_responses
from .models import (
    ChainModel,
    MLPChainModel,
    SequentialChainModel,
    _conv_output_size,
    _im2col,
    check_deterministic,
)
from .preconditioners import (
    KFAC,
    Diagonal,
    KroneckerLayer,
    Stat,
    Structure,
    make_structure,
    statistic_dtype_of,
    structure_type,
)


def fisher_vectors(
    model: ChainModel, likelihood, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor | None = None,
    kind: str = "model",
) -> torch.Tensor:
    """The vectors ``v`` whose outer products average to the Fisher: ``(B, r, d)`` for one input per row.

    ``r`` is 1 for the empirical Fisher and for Bernoulli, ``m`` for the model-expected Fisher of an
    ``m``-output network.
    """
    out, ctx = model.forward(theta, x)
    if kind == "empirical":
        if y is None:
            raise ValueError("the empirical Fisher needs labels y")
        return model.vjp(ctx, likelihood.residual(out, y)).unsqueeze(1)
    if kind != "model":
        raise ValueError(f"unknown Fisher kind {kind!r}; choose 'model' (model-expected) or 'empirical'")
    factor = likelihood.fisher_factor(out)  # (B, m, r)
    r = factor.shape[-1]
    return torch.stack([model.vjp(ctx, factor[..., c], retain=c < r - 1) for c in range(r)], dim=1)


# Below this many examples per pass (large models, many chains), copying theta into virtual rows
# costs more than it saves on a CPU: the examples are then taken one at a time for all chains at once.
_MIN_VIRTUAL_BATCH = 32


def _path(n_chains: int, batch: int, n: int, device: torch.device) -> str:
    """How :func:`estimate_fisher` runs: ``"virtual rows"`` (every chain paired with ``batch`` examples per
    pass) or, on a CPU below :data:`_MIN_VIRTUAL_BATCH` examples per pass, ``"one example at a time"``.
    A CUDA device always takes the virtual rows: for the diagonal empirical Fisher of LeNet-5, 100 chains
    and 6,000 images, 14 per pass took 0.64 s on an H200, against 2.35 s by layers and 7.5 s one example
    at a time (``benchmarks/gpu_h200.md``); the other statistics were not timed there, but a pass over
    several examples launches fewer kernels than one per example. Other devices are treated as a CPU."""
    if torch.device(device).type == "cuda":
        return "virtual rows"
    return "one example at a time" if n_chains > 1 and batch < min(n, _MIN_VIRTUAL_BATCH) else "virtual rows"


def _fisher_example_by_example(model, likelihood, theta, x, y, kind, structure: Structure,
                               dtype: torch.dtype) -> Stat:
    """The same statistic, one example at a time with one row per chain (no copies of ``theta``)."""
    n_chains, n = theta.shape[0], x.shape[0]
    total: list[torch.Tensor] | None = None
    for i in range(n):
        xi = x[i : i + 1].expand(n_chains, *x.shape[1:])
        yi = None if y is None else y[i : i + 1].expand(n_chains)
        v = fisher_vectors(model, likelihood, theta, xi, yi, kind).to(dtype)  # (C, r, d)
        if isinstance(structure, Diagonal) and total is not None:
            for c in range(v.shape[1]):
                total[0].addcmul_(v[:, c], v[:, c])
            continue
        part = structure.outer_sum(v)
        total = list(part) if total is None else [t.add_(p) for t, p in zip(total, part, strict=True)]
    return tuple(t / n for t in total)


def _fisher_dtype(dtype: torch.dtype | str | None, theta: torch.Tensor) -> torch.dtype | None:
    """The ``dtype`` argument of the Fisher estimates checked: ``None``, float32 or float64, and not
    coarser than ``theta``'s (a float32 sum of float64 vectors would round away what they hold)."""
    dtype = statistic_dtype_of(dtype, "dtype")
    if dtype is not None and theta.is_floating_point() and torch.finfo(dtype).eps > torch.finfo(theta.dtype).eps:
        raise ValueError(f"dtype {dtype} is coarser than theta's {theta.dtype}: leave it out to use theta's")
    return dtype


def _check_model_and_labels(model: ChainModel, likelihood, y: torch.Tensor | None) -> None:
    """No training-mode dropout or batch norm, an output size the likelihood can use and, for the
    empirical Fisher, valid observed labels (a wrong one gives a finite, wrong Fisher)."""
    check_deterministic(model)
    out_dim = getattr(model, "out_dim", None)
    if out_dim is not None and y is not None:
        check_responses(likelihood, y, out_dim)
    else:
        check_output_dim(likelihood, out_dim)


def estimate_fisher(
    model: ChainModel,
    likelihood,
    theta: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    *,
    kind: str = "model",
    structure: Structure | str = "dense",
    max_rows: int = 2**16,
    max_elements: int = 2**26,
    dtype: torch.dtype | None = None,
) -> Stat:
    """Fisher statistic ``(1/n) sum_i sum_c v_ic v_ic^T`` at each row of ``theta``, restricted to a structure.

    Args:
        model: a :class:`~smp_core.models.ChainModel`.
        likelihood: a likelihood of :mod:`smp_core.likelihoods`.
        theta: ``(C, d)`` parameters (or ``(d,)``); the result has batch dimension ``C``.
        x: ``(n, *input_shape)`` inputs.
        y: ``(n,)`` labels, for ``kind="empirical"``.
        kind: ``"model"`` (model-expected) or ``"empirical"``.
        structure: a :class:`~smp_core.preconditioners.Structure` or one of ``"diag"``, ``"block"``
            (one block per parameter tensor), ``"dense"``, ``"kfac"`` (:func:`kronecker_fisher`).
        max_rows: at most this many (chain, example) rows per backward pass.
        max_elements: at most this many elements in the per-example gradients of one pass.
        dtype: the statistic's dtype (default: ``theta``'s). The per-example vectors are cast to it
            before their outer products are formed and summed, so ``torch.float64`` keeps what a
            float32 sum would round away (``statistic_dtype`` of
            :func:`~smp_core.preconditioners.build_preconditioner`); the gradients themselves are
            computed in ``theta``'s dtype. (The empirical diagonal, when it takes
            :func:`diagonal_empirical_fisher_by_layers`, sums its squares in ``theta``'s dtype and is
            cast: a sum of squares cannot turn negative by rounding.) The float64 copies of the
            per-example vectors take memory beside them: ``max_elements`` counts elements, not bytes,
            so a pass holds about three times the bytes of a float32 one.

    The empirical diagonal of a network of ``Linear`` and ``Conv2d`` layers takes
    :func:`diagonal_empirical_fisher_by_layers` for one chain, and for several where the virtual rows
    would take too few examples per pass (:func:`_path`: on a CPU; a GPU keeps the virtual rows).

    Returns:
        The statistic as a tuple of tensors (see :mod:`smp_core.preconditioners`).
    """
    if theta.ndim == 1:
        theta = theta.unsqueeze(0)
    dtype = _fisher_dtype(dtype, theta)
    if isinstance(structure, str):
        structure = structure_for(model, structure)
    n = x.shape[0]
    if n == 0:
        raise ValueError("the Fisher needs at least one data point")
    if y is not None and y.shape[0] != n:
        raise ValueError(f"x has {n} rows but y has {y.shape[0]}")
    if not torch.isfinite(x).all():
        raise ValueError("the Fisher data x contains NaN or infinite values")
    expected = getattr(model, "input_shape", None)  # the chain models take an input flat or shaped
    if expected is not None and math.prod(x.shape[1:]) != math.prod(expected):
        raise ValueError(f"the Fisher data x has inputs of shape {tuple(x.shape[1:])}, the model takes inputs of "
                         f"shape {tuple(expected)}")
    _check_model_and_labels(model, likelihood, y if kind == "empirical" else None)
    if isinstance(structure, KFAC):
        return kronecker_fisher(model, likelihood, theta, x, y, kind=kind, structure=structure,
                                max_elements=max_elements, dtype=dtype)
    dtype = theta.dtype if dtype is None else dtype
    n_chains, dim = theta.shape
    per_row = dim * (model.out_dim if kind == "model" else 1)
    batch = max(1, min(n, max_rows // n_chains, max_elements // max(1, n_chains * per_row)))
    example_by_example = _path(n_chains, batch, n, theta.device) == "one example at a time"
    diagonal = isinstance(structure, Diagonal)
    if kind == "empirical" and diagonal and y is not None and (example_by_example or n_chains == 1):
        stat = diagonal_empirical_fisher_by_layers(model, likelihood, theta, x, y, max_elements=max_elements)
        if stat is not None:
            return tuple(t.to(dtype) for t in stat)
    if example_by_example:
        return _fisher_example_by_example(model, likelihood, theta, x, y, kind, structure, dtype)
    total: list[torch.Tensor] | None = None
    for start in range(0, n, batch):
        xb = x[start : start + batch]
        b = xb.shape[0]
        rows_theta = theta.repeat_interleave(b, dim=0)  # chain-major: (C*b, d)
        rows_x = xb.repeat(n_chains, *([1] * (xb.ndim - 1)))
        yb = None if y is None else y[start : start + batch]
        rows_y = None if yb is None else yb.repeat(n_chains, *([1] * (yb.ndim - 1)))  # (C*b, ...) like rows_x
        v = fisher_vectors(model, likelihood, rows_theta, rows_x, rows_y, kind)  # (C*b, r, d)
        part = structure.outer_sum(v.reshape(n_chains, -1, dim).to(dtype))
        total = list(part) if total is None else [t.add_(p) for t, p in zip(total, part, strict=True)]
    return tuple(t / n for t in total)


def _layers_covering(model: ChainModel) -> list[tuple[nn.Module, str | None, str | None]] | None:
    """``(layer, weight name, bias name)`` for every ``Linear`` / ``Conv2d`` of the module, when these
    layers own every parameter of the layout exactly once; ``None`` otherwise.

    Only the networks that :mod:`smp_core.models` batches by hand qualify (an ``nn.Sequential`` of
    exactly ``Linear`` / ``Conv2d`` layers and per-example parameter-free layers): their forward pass is
    known, so no weight enters the output outside its layer's call, the rows of every layer are the
    examples, and no layer mixes examples (a user's ``forward`` could do any of these).
    """
    if not isinstance(model, SequentialChainModel | MLPChainModel):
        return None
    layers, _ = _linear_and_conv_layers(model)
    return layers


def _linear_and_conv_layers(model: ChainModel) -> tuple[list[tuple[nn.Module, str, str | None]] | None, str]:
    """The ``Linear`` / ``Conv2d`` layers of any module that own all its parameters, or ``None`` and why not."""
    module = getattr(model, "module", None)
    if not isinstance(module, nn.Module):
        return None, f"the model {type(model).__name__} has no torch module to look into"
    names = set(model.layout.names)
    layers, covered = [], []
    for prefix, layer in module.named_modules():
        if isinstance(layer, nn.Linear | nn.Conv2d):
            if type(layer) not in (nn.Linear, nn.Conv2d):
                return None, f"{prefix!r} is a subclass of {type(layer).__mro__[1].__name__} (it may change forward)"
            if isinstance(layer, nn.Conv2d) and (layer.groups != 1 or layer.padding_mode != "zeros"
                                                 or isinstance(layer.padding, str)):
                return None, f"the convolution {prefix!r} has groups, a padding mode or string padding"
            weight_frozen = not layer.weight.requires_grad
            bias_frozen = layer.bias is not None and not layer.bias.requires_grad
            if weight_frozen and (layer.bias is None or bias_frozen):
                continue  # frozen: not sampled, no Kronecker block
            if weight_frozen or bias_frozen:
                return None, f"{prefix!r} is partly frozen (its weight and bias are sampled together or not at all)"
            own = [f"{prefix}.{p}" if prefix else p for p in ("weight", "bias")]
            weight, bias = (own[0] if own[0] in names else None), (own[1] if layer.bias is not None else None)
            if weight is None or (bias is not None and bias not in names):
                return None, f"{prefix!r} shares a parameter with another module"
            layers.append((layer, weight, bias))
            covered += [weight] + ([bias] if bias else [])
    outside = sorted(names - set(covered))
    if outside or len(covered) != len(names):
        return None, f"the parameters {outside} lie outside Linear and Conv2d layers"
    return layers, ""


def _kronecker_modules(model: ChainModel) -> list[tuple[nn.Module, str, str | None, KroneckerLayer]]:
    """``(layer, weight name, bias name, KroneckerLayer)`` of every ``Linear`` / ``Conv2d`` layer, in the order of the
    parameters; raises ``ValueError`` naming what stands in the way of the ``kfac`` structure."""
    layers, problem = _linear_and_conv_layers(model)
    if layers is None:
        raise ValueError(f"the kfac preconditioner needs every parameter in an nn.Linear or nn.Conv2d layer: {problem}")
    entries = {e.name: e for e in model.layout.entries}
    result = []
    for layer, weight, bias in layers:
        w = entries[weight]
        n_in = layer.in_features if isinstance(layer, nn.Linear) else w.size // layer.out_channels
        b = entries[bias] if bias else None
        kron = KroneckerLayer(slice(w.start, w.stop), slice(b.start, b.stop) if b else None, w.shape[0], n_in)
        result.append((layer, weight, bias, kron))
    return sorted(result, key=lambda t: t[3].weight.start)


def kronecker_layers(model: ChainModel) -> tuple[KroneckerLayer, ...]:
    """The :class:`~smp_core.preconditioners.KroneckerLayer` of every ``Linear`` / ``Conv2d`` layer of a model,
    in the order of its parameters, for the ``kfac`` structure.

    Any module qualifies whose sampled (not frozen) parameters all belong to ``nn.Linear`` and
    ``nn.Conv2d`` (``groups=1``, zero padding) layers, each called once per forward pass on a batch
    whose rows are the examples (checked when the factors are computed). Raises ``ValueError`` naming
    what stands in the way otherwise (normalisation layers, embeddings, shared weights, ...).
    """
    return tuple(kron for *_, kron in _kronecker_modules(model))


def structure_for(model: ChainModel, name: str) -> Structure:
    """The :class:`~smp_core.preconditioners.Structure` called ``name`` (``"none"``, ``"diag"``, ``"block"``,
    ``"dense"``, ``"kfac"``) for a model: its parameter blocks or Kronecker layers filled in."""
    layers = kronecker_layers(model) if structure_type(name) is KFAC else ()  # (raises for a model without them)
    return make_structure(name, model.layout.dim, blocks=model.layout.block_slices, layers=layers)


def _recorded_forward(module: nn.Module, layers, params: dict[str, torch.Tensor],
                      xb: torch.Tensor) -> tuple[torch.Tensor, dict[nn.Module, list]]:
    """One forward pass of ``module`` with ``params`` (``functional_call``) on the batch ``xb``.

    Returns the output ``(b, m)``, in the autograd graph, and ``{layer: [(input, output), ...]}``
    for every layer of ``layers`` (``(layer, ...)`` tuples), one pair per call of the layer: the
    input detached, the output in the graph for the output gradients.
    """
    record: dict[nn.Module, list] = {layer: [] for layer, *_ in layers}

    def keep(layer, inputs, output):
        record[layer].append((inputs[0].detach(), output))
        return output.clone()  # what follows (an in-place activation, say) must not overwrite it

    hooks = [layer.register_forward_hook(keep) for layer, *_ in layers]
    try:
        with torch.enable_grad():
            # the input requires a gradient so that autograd records the activations
            out = functional_call(module, params, (xb.detach().requires_grad_(True),)).reshape(xb.shape[0], -1)
    finally:
        for hook in hooks:
            hook.remove()
    return out, record


def kronecker_fisher(
    model: ChainModel, likelihood, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor | None = None,
    kind: str = "model", structure: Structure | None = None, batch_size: int = 512, max_elements: int = 2**26,
    dtype: torch.dtype | None = None,
) -> Stat:
    """The KFAC factors ``(A_1, G_1, A_2, G_2, ...)`` of the Fisher at every row of ``theta`` (``kfac`` structure).

    For a ``Linear`` layer with input ``a_i`` (a 1 appended for the bias) and output gradients
    ``g_ic``: ``A = (1/n) sum_i a_i a_i^T`` and ``G = (1/n) sum_i sum_c g_ic g_ic^T``, where ``g_ic``
    pulls back ``L_i[:, c]`` (the model-expected Fisher, ``L L^T`` the output Fisher of the likelihood)
    or the residual ``d log f(y_i | x_i) / d out`` (the empirical Fisher, one column). A ``Conv2d``
    treats its ``T`` output positions as examples that share the weights (KFAC-expand, Grosse and
    Martens 2016; Eschenhagen et al. 2023): ``A = (1/(n T)) sum_{i,t} a_it a_it^T`` over the input
    patches and ``G = (1/n) sum_{i,t} sum_c g_itc g_itc^T``. For one example of a linear layer
    ``G (x) A`` is that example's Fisher block exactly.

    Per chain and per batch: one forward pass of the module (``functional_call``) that records each
    layer's input and output, and one backward pass per column ``c`` for the output gradients only.

    Any module whose parameters all sit in such layers is taken (:func:`kronecker_layers`); a weight
    that also enters the output outside its own layer's call (weight tying) contributes nothing to
    its factors. The result is then a coarser approximation, still positive semi-definite: SMP stays
    a martingale with any positive definite ``P_k`` that is ``F_{k-1}``-measurable, so only the spread
    of the posterior, not its validity, depends on how well ``G (x) A`` approximates the Fisher.

    ``dtype``: the factors' dtype (default: ``theta``'s); each batch's inputs and output gradients
    are cast to it before their products are summed.
    """
    theta = theta.unsqueeze(0) if theta.ndim == 1 else theta
    dtype = _fisher_dtype(dtype, theta)
    layers = _kronecker_modules(model)
    found = tuple(kron for *_, kron in layers)
    if structure is not None and tuple(structure.layers) != found:
        raise ValueError("the kfac structure was built for another model (its layers differ from this model's)")
    if kind == "empirical" and y is None:
        raise ValueError("the empirical Fisher needs labels y")
    if kind not in ("model", "empirical"):
        raise ValueError(f"unknown Fisher kind {kind!r}; choose 'model' (model-expected) or 'empirical'")
    if not x.is_floating_point():
        raise ValueError("the kfac Fisher needs floating-point inputs x")
    _check_model_and_labels(model, likelihood, y if kind == "empirical" else None)
    n, n_chains = x.shape[0], theta.shape[0]
    batch_size = max(1, min(batch_size, max_elements // _elements_per_example(model, layers, theta[0], x[:2])))
    dtype = theta.dtype if dtype is None else dtype
    factors = []
    for k in found:
        factors.append(theta.new_zeros(n_chains, k.n_cols, k.n_cols, dtype=dtype))
        factors.append(theta.new_zeros(n_chains, k.n_out, k.n_out, dtype=dtype))
    # copies of the buffers: a layer that updates its running statistics leaves the module alone
    buffers = {name: buffer.clone() for name, buffer in model.module.named_buffers()}
    for chain, row in enumerate(theta):
        params = {**buffers, **model.layout.unflatten(row.detach())}
        for start in range(0, n, batch_size):
            xb = x[start : start + batch_size]
            b = xb.shape[0]
            out, record = _recorded_forward(model.module, layers, params, xb)
            for layer, weight, *_ in layers:
                rec = record[layer]
                if len(rec) != 1 or rec[0][0].shape[0] != b or (isinstance(layer, nn.Linear) and rec[0][0].ndim != 2):
                    raise ValueError(f"the kfac Fisher needs each Linear / Conv2d layer called once per forward pass "
                                     f"on a batch whose rows are the examples; {weight!r} is not")
            if kind == "empirical":
                cotangents = [likelihood.residual(out.detach(), y[start : start + batch_size])]
            else:
                factor = likelihood.fisher_factor(out.detach())  # (b, m, r)
                cotangents = [factor[..., c] for c in range(factor.shape[-1])]
            outputs = [record[layer][0][1] for layer, *_ in layers]
            for i, (layer, _, bias, _) in enumerate(layers):
                h = record[layer][0][0]
                if isinstance(layer, nn.Linear):
                    a, positions = h, 1
                else:
                    cols, _ = _im2col(h, layer)  # (b, C * kh * kw, T)
                    positions = cols.shape[-1]
                    a = cols.transpose(1, 2).reshape(-1, cols.shape[1])
                if bias is not None:
                    a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
                a = a.to(dtype)
                factors[2 * i][chain].add_(a.T @ a, alpha=1.0 / positions)
            for c, cotangent in enumerate(cotangents):
                deltas = torch.autograd.grad(out, outputs, cotangent, retain_graph=c < len(cotangents) - 1,
                                             allow_unused=True)
                for i, delta in enumerate(deltas):
                    if delta is None:
                        continue  # the layer does not reach the output
                    g = delta if delta.ndim == 2 else delta.flatten(2).transpose(1, 2).reshape(-1, delta.shape[1])
                    g = g.to(dtype)
                    factors[2 * i + 1][chain] += g.T @ g
    return tuple(f / n for f in factors)


def _elements_per_example(model: ChainModel, layers, theta_row: torch.Tensor, x1: torch.Tensor) -> int:
    """Numbers held per example by the convolutions' patches and per-example weight gradients (one
    forward pass of the examples ``x1`` (one or two) to learn the layers' input sizes)."""
    if not any(isinstance(layer, nn.Conv2d) for layer, *_ in layers):
        return 1
    sizes: dict[nn.Module, torch.Size] = {}
    hooks = [layer.register_forward_hook(lambda m, i, o: sizes.__setitem__(m, i[0].shape)) for layer, *_ in layers]
    buffers = {name: buffer.clone() for name, buffer in model.module.named_buffers()}  # left alone
    try:
        with torch.no_grad():
            functional_call(model.module, {**buffers, **model.layout.unflatten(theta_row.detach())}, (x1,))
    finally:
        for hook in hooks:
            hook.remove()
    total = 1
    for layer, *_ in layers:
        if isinstance(layer, nn.Conv2d) and layer in sizes:
            _, channels, height, width = sizes[layer]
            (kh, kw), (ph, pw) = layer.kernel_size, layer.padding
            out_h, out_w = _conv_output_size(height + 2 * ph, width + 2 * pw, layer)
            total += channels * kh * kw * (out_h * out_w + layer.out_channels)
    return total


def diagonal_empirical_fisher_by_layers(
    model: ChainModel, likelihood, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512,
    max_elements: int = 2**26,
) -> Stat | None:
    """:func:`diagonal_fisher_by_layers` of the empirical Fisher (the MNIST preconditioner)."""
    return diagonal_fisher_by_layers(model, likelihood, theta, x, y, kind="empirical", batch_size=batch_size,
                                     max_elements=max_elements)


def diagonal_fisher_by_layers(
    model: ChainModel, likelihood, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor | None = None, *,
    kind: str = "empirical", batch_size: int = 512, max_elements: int = 2**26,
) -> Stat | None:
    """``diag((1/n) sum_i sum_c v_ic v_ic^T)`` for every row of ``theta``: the empirical Fisher
    (``v_i = s_i = grad log f_theta(y_i | x_i)``, needs ``y``) or the model-expected one (``kind="model"``,
    ``v_ic = J_i^T L_i[:, c]``, one backward pass per column ``c`` of the output Fisher's factor; the
    diagonal of the generalised Gauss-Newton matrix).

    Exact, for networks whose parameters all belong to ``nn.Linear`` and ``nn.Conv2d`` (``groups=1``)
    layers that each run once per input (the eq. of Section 3.3.3). Per chain and per batch of
    ``batch_size`` examples: one forward pass of the module (``functional_call``) that records every
    layer's input ``h`` and output, and one backward pass for the per-example output gradients
    ``delta`` only (no weight gradients). Then, summed over the examples, a linear layer's squared
    weight gradients are ``(delta^2)^T (h^2)`` and its bias's ``delta^2``; a convolution's are the
    squares of its per-example weight gradients ``delta_i cols_i^T`` (``cols``: the patches of its
    input) and of ``delta_i`` summed over positions.

    Returns ``None`` (the caller then uses the general path) unless the model is one that
    :mod:`smp_core.models` batches by hand (see :func:`_layers_covering`) with floating-point inputs.
    ``batch_size`` examples go through at a time, fewer when a convolution's patches and per-example
    weight gradients for that many would exceed ``max_elements`` numbers.
    """
    if kind not in ("model", "empirical"):
        raise ValueError(f"unknown Fisher kind {kind!r}; choose 'model' (model-expected) or 'empirical'")
    if kind == "empirical" and y is None:
        raise ValueError("the empirical Fisher needs labels y")
    _check_model_and_labels(model, likelihood, y if kind == "empirical" else None)
    layers = _layers_covering(model)
    if layers is None or not x.is_floating_point():
        return None
    theta = theta.unsqueeze(0) if theta.ndim == 1 else theta
    index = {name: i for i, name in enumerate(model.layout.names)}
    n = x.shape[0]
    batch_size = max(1, min(batch_size, max_elements // _elements_per_example(model, layers, theta[0], x[:1])))
    totals = [theta.new_zeros(theta.shape[0], e.size) for e in model.layout.entries]
    for chain, row in enumerate(theta):
        params = model.layout.unflatten(row.detach())
        for start in range(0, n, batch_size):
            xb = x[start : start + batch_size]
            out, record = _recorded_forward(model.module, layers, params, xb)
            if any(len(r) != 1 for r in record.values()):
                return None  # a layer ran twice (or never): per-example products do not apply
            outputs = [record[layer][0][1] for layer, _, _ in layers]
            if kind == "empirical":
                cotangents = [likelihood.residual(out.detach(), y[start : start + batch_size])]
            else:
                factor = likelihood.fisher_factor(out.detach())  # (b, m, r)
                cotangents = [factor[..., c] for c in range(factor.shape[-1])]
            for c, cotangent in enumerate(cotangents):
                deltas = torch.autograd.grad(out, outputs, cotangent, retain_graph=c < len(cotangents) - 1,
                                             allow_unused=True)
                if not _add_squared_gradients_(totals, index, layers, record, deltas, chain, xb.shape[0]):
                    return None
    return (torch.cat(totals, dim=1) / n,)


def _add_squared_gradients_(totals, index, layers, record, deltas, chain: int, batch: int) -> bool:
    """Add the squares of the per-example gradients that the output gradients ``deltas`` pull back
    (one per layer) to ``totals``; ``False`` where a layer's rows are not the examples."""
    for (layer, weight, bias), delta in zip(layers, deltas, strict=True):
        if delta is None:
            continue  # the layer does not reach the output: zero gradient
        h = record[layer][0][0]
        if h.shape[0] != batch:
            return False  # the rows of this layer are not the examples
        if isinstance(layer, nn.Linear):
            if h.ndim != 2:
                return False
            sq = delta * delta
            totals[index[weight]][chain] += (sq.T @ (h * h)).reshape(-1)
            if bias:
                totals[index[bias]][chain] += sq.sum(0)
        else:
            cols, _ = _im2col(h, layer)  # (b, C * kh * kw, L)
            per_example = torch.bmm(delta.flatten(2), cols.transpose(1, 2))  # (b, O, C * kh * kw)
            totals[index[weight]][chain] += (per_example * per_example).sum(0).reshape(-1)
            if bias:
                totals[index[bias]][chain] += delta.sum((2, 3)).square().sum(0)
    return True
