"""Baselines beyond the paper (its Section 4.5): the Laplace approximation, its linearised predictive, MC dropout.

* :func:`fit_laplace`: ``N(theta_MAP, (GGN + alpha I)^-1)`` (MacKay 1992; Daxberger et al. 2021), ``diag``, ``kfac``
  and ``dense`` through laplace-torch (:class:`TorchLaplace`; its ``kron`` keeps a layer's bias in a block of its
  own), ``block`` (one dense block per parameter tensor, which laplace-torch lacks) this module's own.
* :func:`linearised_logits`: the "GLM" predictive (Immer et al. 2021) with one draw shared by every input.
* :func:`mc_dropout_logits`: MC dropout (Gal and Ghahramani 2016), masks from an explicit generator.

Deep ensembles need no code of their own: they are independent MAP fits from random starts.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.modules.dropout import _DropoutNd

from smp_core.fisher import estimate_fisher, structure_for
from smp_core.layout import ParamLayout
from smp_core.likelihoods import get_likelihood
from smp_core.models import ChainModel, as_chain_model, predict
from smp_core.preconditioners import Stat, Structure

LAPLACE_STRUCTURES = ("diag", "block", "kfac", "dense")
# The structures laplace-torch fits, by its names (Daxberger et al. 2021: "diag", "kron", "full").
LAPLACE_TORCH = {"diag": "diag", "kfac": "kron", "dense": "full"}
# Beyond this many parameters a block's d x d precision (and its Cholesky factor) is not built.
MAX_DENSE_DIM = 10_000
_NOT_FINITE = "the GGN at theta_map is not finite (does the network overflow at theta_map?)"


class _TwoClass(nn.Module):
    """A one-logit Bernoulli network as laplace-torch's two-class classifier with logits ``(0, g)``: the same model."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.net(x)
        return torch.cat([torch.zeros_like(g), g], dim=-1)


def _require(ok, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_prior_precision(alpha) -> None:
    _require(isinstance(alpha, int | float) and not isinstance(alpha, bool) and math.isfinite(alpha) and alpha > 0,
             f"prior_precision must be a finite number > 0 (the prior N(0, I / alpha)), got {alpha!r}")


def _check_dense_size(rows: int, what: str) -> None:
    _require(rows <= MAX_DENSE_DIM, f"{what} would have {rows} rows; matrices of more than {MAX_DENSE_DIM} rows are "
             "not formed here: use structure='diag' or 'kfac', which never form them")


def _positive_int(value, name: str) -> None:
    _require(not isinstance(value, bool) and isinstance(value, int) and value >= 1,
             f"{name} must be a positive integer, got {value!r}")


class _Laplace:
    """What both fits share: another prior precision (the curvature shared) and ``z``."""

    def with_prior_precision(self, prior_precision: float):
        _check_prior_precision(prior_precision)
        return replace(self, prior_precision=float(prior_precision))

    @staticmethod
    def _z(n_samples: int, dim: int, generator, dtype, device) -> torch.Tensor:
        """Standard normal ``(n_samples, dim)`` drawn on the CPU from ``generator`` (the same draws on any device)."""
        _require(n_samples >= 1, f"n_samples must be at least 1, got {n_samples}")
        return torch.randn(n_samples, dim, generator=generator, dtype=dtype).to(device)


@dataclass(frozen=True, eq=False)
class TorchLaplace(_Laplace):
    """A laplace-torch ``Laplace`` object ``la`` under one prior precision (``la`` is shared, not refitted,
    by ``with_prior_precision``)."""

    la: Any
    structure: str
    prior_precision: float

    @property
    def mean(self) -> torch.Tensor:
        return self.la.mean.detach()

    def _set_prior(self) -> None:
        """Put this prior into the shared ``la``, only when it differs (setting it drops ``la``'s factorisation)."""
        current = self.la.prior_precision.reshape(-1)
        if current.numel() != 1 or float(current[0]) != self.prior_precision:
            self.la.prior_precision = self.prior_precision

    def sample(self, n_samples: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(n_samples, d)`` draws: ``la.sample``'s (``kron``: the symmetric root of each block, so no eigenvector's
        sign matters) but with ``z`` drawn on the CPU from ``generator``, so that a seed gives them on any device."""
        self._set_prior()
        la = self.la
        z = self._z(n_samples, la.n_params, generator, la._dtype, la._device)
        if self.structure == "diag":
            offsets = z * la.posterior_scale
        elif self.structure == "kfac":
            offsets = la.posterior_precision.bmm(z, exponent=-0.5).reshape(n_samples, la.n_params)
        else:
            offsets = z @ la.posterior_scale.T
        return (la.mean.reshape(1, -1) + offsets).detach()

    def log_marginal_likelihood(self) -> float:
        """laplace-torch's Laplace approximation of ``log p(D | alpha)`` (MacKay 1992)."""
        self._set_prior()
        return float(self.la.log_marginal_likelihood())

    def ggn_eigenvalues(self) -> torch.Tensor:
        """The eigenvalues (float64) of the GGN summed over the training set in laplace-torch's structure, times its
        ``1 / sigma^2`` of a Gaussian likelihood: the posterior precision's minus ``alpha``."""
        h, factor = self.la.H, float(self.la._H_factor)
        if self.structure == "diag":
            return factor * h.detach().double()
        if self.structure == "kfac":
            parts = [functools.reduce(lambda a, b: (a[:, None] * b.double()[None, :]).reshape(-1), values[1:],
                                      values[0].double()) for values in h.eigenvalues]
            return factor * torch.cat(parts).clamp_min(0)
        return factor * torch.linalg.eigvalsh(h.detach().double()).clamp_min(0)

    def optimise_prior_precision(self, **options) -> TorchLaplace:
        """The prior precision that maximises the evidence: ``la.optimize_prior_precision(method="marglik")``, one
        scalar, Adam on ``log alpha`` from the current ``alpha`` (``options`` pass on, e.g. ``n_steps``, ``lr``)."""
        self._set_prior()
        with warnings.catch_warnings():  # its note on link_approx concerns the 'gridsearch' method, not this one
            warnings.filterwarnings("ignore", message="By default `link_approx` is `probit`")
            self.la.optimize_prior_precision(pred_type="glm", method="marglik", prior_structure="scalar",
                                             init_prior_prec=self.prior_precision, **options)
        return replace(self, prior_precision=float(self.la.prior_precision.reshape(-1)[0]))


@dataclass(frozen=True, eq=False)
class BlockLaplace(_Laplace):
    """``N(mean, Lambda^-1)``, ``Lambda = n_data * GGN + prior_precision * I`` with the GGN as one dense block per
    parameter tensor: ``ggn`` holds the blocks (batch dimension 1) of ``shape``."""

    mean: torch.Tensor
    shape: Structure
    ggn: Stat
    prior_precision: float
    n_data: int
    structure: str = "block"

    @property
    def dim(self) -> int:
        return self.mean.shape[0]

    def _block(self, m: torch.Tensor) -> torch.Tensor:
        precision = self.n_data * m + self.prior_precision * torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
        return (precision + precision.T) / 2

    @property
    def precision(self) -> torch.Tensor:
        """``Lambda`` as a ``(d, d)`` matrix (zero between blocks)."""
        _check_dense_size(self.dim, "the 'block' precision as a d x d matrix")
        return self._block(self.shape.to_dense(self.ggn)[0])

    def sample(self, n_samples: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(n_samples, d)`` draws ``mean + L^-T z`` per block (``L L^T`` the block of ``Lambda``, ``z`` float64
        drawn on the CPU, so a seed gives the same draws on any device), in the mean's dtype and device."""
        z = self._z(n_samples, self.dim, generator, torch.float64, self.mean.device)
        offsets = torch.empty_like(z)
        for b, stat in zip(self.shape.blocks, self.ggn, strict=True):
            factor, info = torch.linalg.cholesky_ex(self._block(stat[0].double()))
            _require(info.item() == 0, "the Laplace precision N * GGN + alpha I is not positive definite (a "
                     "non-finite or negative GGN entry?)")
            offsets[:, b] = torch.linalg.solve_triangular(factor.mT, z[:, b].T, upper=True).T
        return (self.mean.double() + offsets).to(self.mean.dtype)


def _check_data(x: torch.Tensor, y: torch.Tensor) -> None:
    _require(y.shape[0] == x.shape[0], f"x has {x.shape[0]} rows but y has {y.shape[0]}")


def fit_laplace(model: nn.Module, likelihood, theta_map: torch.Tensor, x: torch.Tensor, y: torch.Tensor, *,
                prior_precision: float, structure: str = "dense", input_shape: tuple[int, ...] | None = None,
                batch_size: int | None = None) -> TorchLaplace | BlockLaplace:
    """The Laplace approximation ``N(theta_MAP, (GGN + alpha I)^-1)`` at ``theta_map`` ``(d,)``, the GGN summed over
    the training set ``(x, y)`` and kept in ``structure`` (one of ``LAPLACE_STRUCTURES``), ``alpha > 0``.

    ``likelihood``: ``"bernoulli"`` (to laplace-torch as two classes with logits ``(0, g)``), ``"categorical"``
    or a likelihood object (``smp_core.Gaussian(sigma)``). ``diag``, ``kfac``, ``dense``: laplace-torch's ``Laplace(...,
    subset_of_weights="all")`` fitted in batches of ``batch_size`` (default 16 for ``diag``, whose GGN holds every
    input's Jacobian: 1.1 GB on LeNet-5; else 500); ``block``: :func:`smp_core.fisher.estimate_fisher`'s model Fisher.
    """
    _require(structure in LAPLACE_STRUCTURES, f"unknown Laplace structure {structure!r}; choose one of "
             f"{LAPLACE_STRUCTURES}")
    _check_prior_precision(prior_precision)
    chain = as_chain_model(model, input_shape)
    dim = chain.layout.dim
    _require(theta_map.ndim == 1 and theta_map.shape[0] == dim,
             f"theta_map must have shape ({dim},) for this model, got {tuple(theta_map.shape)}")
    _require(torch.isfinite(theta_map).all(), "theta_map contains NaN or infinite values")
    _require(x.shape[0] > 0, "the Laplace approximation needs at least one training input x")
    _check_data(x, y)
    _require(not x.is_floating_point() or torch.isfinite(x).all(), "the training inputs x contain NaN or infinite "
             "values")
    batch_size = (16 if structure == "diag" else 500) if batch_size is None else batch_size
    _positive_int(batch_size, "batch_size")
    lik = get_likelihood(likelihood)
    if structure == "block":
        shape = structure_for(chain, structure)
        _check_dense_size(max(b.stop - b.start for b in shape.blocks), "the largest block of a 'block' precision")
        stat = estimate_fisher(chain, lik, theta_map.unsqueeze(0), x, kind="model", structure=shape)
        _require(all(bool(torch.isfinite(t).all()) for t in stat), _NOT_FINITE)
        stat = tuple(((t + t.mT) / 2).detach() for t in stat)  # exactly symmetric for the Cholesky factor
        return BlockLaplace(theta_map.detach().clone(), shape, stat, float(prior_precision), x.shape[0])
    if structure == "dense":
        _check_dense_size(dim, "a 'dense' Laplace precision")
    from torch.utils.data import DataLoader, TensorDataset

    with warnings.catch_warnings():  # laplace-torch's import calls torch.jit.script, which torch 2.14 deprecates
        warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated", category=FutureWarning)
        from laplace import Laplace

    net = copy.deepcopy(model)
    torch.nn.utils.vector_to_parameters(theta_map.detach().to(next(net.parameters()).dtype), net.parameters())
    if input_shape is not None:
        x = x.reshape(x.shape[0], *input_shape)
    options: dict[str, Any] = {}
    if lik.name == "bernoulli":
        net, kind, y = _TwoClass(net), "classification", y.reshape(-1).long()
    elif lik.name == "categorical":
        kind, y = "classification", y.reshape(-1).long()
    elif lik.name == "gaussian":
        kind, options["sigma_noise"] = "regression", lik.sigma
        y = y.reshape(x.shape[0], -1).to(theta_map.dtype)
    else:
        raise ValueError(f"no laplace-torch likelihood for {lik.name!r}")
    la = Laplace(net, kind, subset_of_weights="all", hessian_structure=LAPLACE_TORCH[structure],
                 prior_precision=float(prior_precision), **options)
    dtype, device = torch.get_default_dtype(), torch.get_default_device()
    try:  # laplace-torch forms the full GGN as linop @ eye(d) with the default dtype and device: the
        torch.set_default_dtype(la._dtype)  # network's, so that a float64 GGN is float64 throughout (in
        torch.set_default_device(la._device)  # float32 it is off by ~4e-8 relative) and a GPU's stays there
        la.fit(DataLoader(TensorDataset(x, y), batch_size=batch_size))
    except SystemExit as exc:  # laplace-torch calls exit() when it cannot eigendecompose a Kronecker factor
        raise ValueError(f"{_NOT_FINITE}: laplace-torch could not eigendecompose its Kronecker factors") from exc
    finally:
        torch.set_default_dtype(dtype)
        torch.set_default_device(device)
    curvature = la.H_facs.kfacs if structure == "kfac" else [[la.H]]
    _require(all(bool(torch.isfinite(t).all()) for factors in curvature for t in factors), _NOT_FINITE)
    return TorchLaplace(la, structure, float(prior_precision))


def _chain_for(model, theta, x, y, input_shape) -> ChainModel:
    chain = as_chain_model(model, input_shape)
    _require(theta.shape == (chain.layout.dim,), f"theta must have shape ({chain.layout.dim},), got "
             f"{tuple(theta.shape)}")
    _check_data(x, y)
    return chain


def log_likelihood(model: nn.Module | ChainModel, likelihood, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                   *, input_shape: tuple[int, ...] | None = None, batch_size: int = 8192) -> float:
    """``log p(D | theta) = sum_i log f(y_i | x_i, theta)`` over a data set (float64 sum)."""
    chain = _chain_for(model, theta, x, y, input_shape)
    out = predict(chain, theta[None], x, batch_size=batch_size)[0]
    return float(get_likelihood(likelihood).log_prob(out, y).double().sum())


def log_likelihood_gradient(model: nn.Module | ChainModel, likelihood, theta: torch.Tensor, x: torch.Tensor,
                            y: torch.Tensor, *, input_shape: tuple[int, ...] | None = None,
                            batch_size: int = 4096) -> torch.Tensor:
    """``grad_theta log p(D | theta)`` summed over a data set, ``(d,)`` in ``theta``'s dtype: ``alpha theta`` at a MAP
    of the prior ``N(0, I / alpha)``, the stationary point the Laplace approximation assumes."""
    chain = _chain_for(model, theta, x, y, input_shape)
    lik = get_likelihood(likelihood)
    t = theta.detach().clone().requires_grad_(True)
    total = torch.zeros_like(t)
    for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True):
        out = functional_call(chain.module, chain.layout.unflatten(t), (xb,)).reshape(xb.shape[0], -1)
        (grad,) = torch.autograd.grad(lik.log_prob(out, yb).sum(), t)
        total += grad
    return total


def linearised_logits(model: nn.Module | ChainModel, theta_map: torch.Tensor, samples: torch.Tensor,
                      x: torch.Tensor, *, input_shape: tuple[int, ...] | None = None,
                      batch_size: int = 1024) -> torch.Tensor:
    """Logits of the network linearised at ``theta_map`` ``(d,)``: ``g(x, theta_MAP) + J(x) (theta_s - theta_MAP)``.

    ``samples`` ``(S, d)``, ``x`` ``(n, *input_shape)``, ``batch_size`` inputs per Jacobian pass (memory
    ``batch_size * m * d``). Returns ``(S, n, m)`` logits in the dtype of ``samples``.
    """
    chain = as_chain_model(model, input_shape)
    dim = chain.layout.dim
    _require(theta_map.shape == (dim,), f"theta_map must have shape ({dim},), got {tuple(theta_map.shape)}")
    _require(samples.ndim == 2 and samples.shape[1] == dim,
             f"samples must have shape (S, {dim}), got {tuple(samples.shape)}")
    _require(batch_size >= 1, f"batch_size must be at least 1, got {batch_size}")
    offsets = (samples - theta_map).to(theta_map.dtype)  # (S, d)
    parts = []
    for xb in x.split(batch_size):
        b = xb.shape[0]
        out, ctx = chain.forward(theta_map.expand(b, dim).contiguous(), xb)  # (b, m)
        m = out.shape[1]
        columns = []
        for c in range(m):
            cotangent = torch.zeros_like(out)
            cotangent[:, c] = 1
            jac = chain.vjp(ctx, cotangent, retain=c < m - 1)  # (b, d): d g_c / d theta per input
            columns.append(out[:, c].detach() + offsets @ jac.detach().T)  # (S, b)
        parts.append(torch.stack(columns, dim=-1))
    return torch.cat(parts, dim=1).to(samples.dtype)


def _split_before_first_dropout(module: nn.Module) -> tuple[nn.Sequential | None, nn.Sequential | None]:
    """A plain ``nn.Sequential`` cut before its first dropout (a direct child after at least one layer), keeping the
    parent's parameter names; ``(None, None)`` unless running the first part once per batch cannot change the result:
    no subclass, only ``torch.nn``'s own layers (deterministic in eval mode) and no dropout before the cut, no
    parameter shared across it, no forward hook (global, on the parent or on those layers)."""
    from torch.nn.modules import module as module_module

    if type(module) is not nn.Sequential:
        return None, None
    first = next((i for i, child in enumerate(module) if isinstance(child, _DropoutNd)), 0)
    before = [m for child in list(module)[:first] for m in child.modules()]
    if (first == 0 or any(isinstance(m, _DropoutNd) or not type(m).__module__.startswith("torch.nn.modules.")
                          for m in before)
            or module_module._global_forward_hooks or module_module._global_forward_pre_hooks
            or any(m._forward_hooks or m._forward_pre_hooks for m in (module, *before))):
        return None, None
    prefix, suffix = module[:first], module[first:]
    names = [name for part in (prefix, suffix) for name, _ in part.named_parameters()]
    if sorted(names) != sorted(name for name, _ in module.named_parameters()):
        return None, None  # parameters shared between the two parts (tied weights)
    return prefix, suffix


def mc_dropout_logits(module: nn.Module, theta: torch.Tensor, x: torch.Tensor, n_samples: int,
                      generator: torch.Generator, *, batch_size: int = 4096) -> torch.Tensor:
    """MC dropout's predictive samples: the ``(S, n, m)`` logits of ``module`` at the flat parameters ``theta``
    ``(d,)`` (the order of ``module.parameters()``) on ``x`` ``(n, ...)``, every ``nn.Dropout`` left on, one pass
    per sample (``S = n_samples``), ``batch_size`` inputs per pass.

    Each pass draws a fresh mask for every input and dropout layer (inverted dropout: kept with probability
    ``1 - p``, scaled by ``1 / (1 - p)``) from ``generator`` (a CPU generator) in a fixed order (sample, batch,
    layer), moved to ``x``'s device, so a seed gives the same samples on any device; with two or more dropout
    layers the samples also depend on ``batch_size``. Only element-wise ``nn.Dropout`` is supported. The module's
    parameters, train/eval flags and hooks are left as they were. A plain ``nn.Sequential`` whose layers before the
    first dropout are ``torch.nn``'s own runs those layers once per batch, not once per pass (the same samples).
    """
    layout = ParamLayout.from_module(module)
    dim = layout.dim
    _require(theta.shape == (dim,), f"theta must have shape ({dim},), got {tuple(theta.shape)}")
    _positive_int(n_samples, "n_samples")
    _positive_int(batch_size, "batch_size")
    _require(isinstance(generator, torch.Generator) and generator.device.type == "cpu",
             "generator must be a torch.Generator on the CPU")
    _require(torch.isfinite(x).all(), "x contains NaN or infinite values")
    dropouts = [m for m in module.modules() if isinstance(m, _DropoutNd)]
    others = sorted({type(m).__name__ for m in dropouts if type(m) is not nn.Dropout})
    _require(not others, f"only element-wise nn.Dropout layers are supported, the module has {others}")
    _require(dropouts, "the module has no nn.Dropout layer: MC dropout needs a network trained with dropout")
    _require(all(0.0 <= m.p < 1.0 for m in dropouts),
             f"dropout probabilities must lie in [0, 1), got {[m.p for m in dropouts]}")

    def mask(layer: nn.Dropout, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        keep = 1.0 - layer.p
        kept = torch.rand(output.shape, generator=generator) < keep
        return output * kept.to(device=output.device, dtype=output.dtype) / keep

    def own(part):  # the parameters of a part of the module, by the module's names
        return {name: params[name] for name, _ in part.named_parameters()}

    flags = {m: m.training for m in module.modules()}
    hooks = []
    try:
        module.eval()  # each nn.Dropout is then the identity, and its hook applies our mask
        hooks = [m.register_forward_hook(mask) for m in dropouts]
        params = layout.unflatten(theta.to(x.device))
        prefix, suffix = _split_before_first_dropout(module)
        with torch.no_grad():
            part, part_params, heads = module, params, x.split(batch_size)
            if prefix is not None:  # the layers before the first dropout see no mask: run once per batch, not per pass
                part, part_params = suffix, own(suffix)
                heads = [functional_call(prefix, own(prefix), (h,)) for h in heads]
            samples = [torch.cat([functional_call(part, part_params, (h,)).reshape(h.shape[0], -1) for h in heads])
                       for _ in range(n_samples)]
    finally:
        for hook in hooks:
            hook.remove()
        for m, flag in flags.items():
            m.training = flag
    return torch.stack(samples)
