"""Baselines beyond the paper: the Laplace approximation with its linearised predictive, and MC dropout.

The paper's first limitation (Section 4.5) is that SMP was compared only with NUTS and a point
estimate, not with the approximate methods practitioners use: Laplace approximations, deep ensembles,
MC dropout. This module gives the Laplace approximation for any ``nn.Module`` with a Bernoulli,
categorical or Gaussian likelihood, in the structures of the SMP preconditioners:

* :func:`fit_laplace`: ``theta ~ N(theta_MAP, (GGN + alpha I)^-1)``, the generalised Gauss-Newton
  matrix summed over the training set and restricted to a structure, ``alpha`` the precision of the
  Gaussian prior ``N(0, alpha^-1 I)`` the MAP was fitted under (MacKay 1992; Ritter, Botev and Barber
  2018 for KFAC; Daxberger et al. 2021). ``diag``, ``kfac`` and ``dense`` are laplace-torch's
  (``Laplace(model, likelihood, subset_of_weights="all", hessian_structure=...)``, as its users run it,
  with its evidence and its prior-precision optimisation, :class:`TorchLaplace`); its ``kron`` keeps a
  layer's bias in a block of its own (SMP's ``kfac`` folds it into the layer's ``G (x) A``). ``block``
  (one dense block per parameter tensor, an SMP preconditioner structure that laplace-torch lacks) is
  this module's own (:class:`BlockLaplace`), tested equal to the blocks of laplace-torch's ``full``.
* :func:`linearised_logits`: the "GLM" predictive of Immer, Korzepa and Bauer (2021): a sample's
  logits are ``g(x, theta_MAP) + J(x) (theta - theta_MAP)``, the network linearised at the MAP, the
  model whose exact Laplace approximation is the dense GGN one (the other structures approximate
  it). It is laplace-torch's ``"glm"`` predictive with one parameter draw shared by every input
  (laplace-torch draws each input's logits apart: the same distribution at each input, smoother
  surfaces here). Sampling the network itself at Laplace draws (``predict``) is the other, known to
  underfit.

* :func:`mc_dropout_logits`: MC dropout (Gal and Ghahramani 2016): a network trained with dropout
  predicts with dropout left on, each of ``S`` passes under fresh masks drawn from an explicit
  generator (so the draws are reproducible and the same on any device).

Deep ensembles need no code of their own here: they are independent MAP fits from random starts.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

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


class _TwoClass(nn.Module):
    """A one-logit Bernoulli network as laplace-torch's two-class classifier: the logits ``(0, g)``,
    whose softmax is ``(1 - sigmoid(g), sigmoid(g))``; the GGN, the likelihood and the draws are
    the Bernoulli model's (the constant logit has no parameters and no curvature)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.net(x)
        return torch.cat([torch.zeros_like(g), g], dim=-1)


@dataclass(frozen=True, eq=False)
class TorchLaplace:
    """A laplace-torch ``Laplace`` object (``la``) under one prior precision: what the studies draw
    from and score. ``with_prior_precision`` shares ``la`` (its curvature is not computed again)."""

    la: Any
    structure: str
    prior_precision: float

    @property
    def mean(self) -> torch.Tensor:
        return self.la.mean.detach()

    def with_prior_precision(self, prior_precision: float) -> TorchLaplace:
        _check_prior_precision(prior_precision)
        return replace(self, prior_precision=float(prior_precision))

    def _set_prior(self) -> None:
        """Put this object's prior into the shared ``la`` (only when it differs: setting it drops the
        factorisation ``la`` keeps for the draws)."""
        current = self.la.prior_precision.reshape(-1)
        if current.numel() != 1 or float(current[0]) != self.prior_precision:
            self.la.prior_precision = self.prior_precision

    def sample(self, n_samples: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(n_samples, d)`` draws from ``N(theta_MAP, P^-1)``, ``P`` laplace-torch's posterior precision:
        ``la.sample``'s formulas (``diag``: ``z / sqrt(P)``; ``full``: ``z`` times its posterior scale;
        ``kron``: the symmetric root of each block, so no eigenvector's sign matters) with ``z`` drawn on the
        CPU from ``generator``, so that a seed gives the same draws on any device (``la.sample`` draws ``z``
        on the model's device, where a CPU generator cannot serve). On the CPU they equal ``la.sample``'s."""
        if n_samples < 1:
            raise ValueError(f"n_samples must be at least 1, got {n_samples}")
        self._set_prior()
        la = self.la
        z = torch.randn(n_samples, la.n_params, generator=generator, dtype=la._dtype).to(la._device)
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
        """The eigenvalues of the GGN summed over the training set, in laplace-torch's structure (float64):
        the diagonal for ``diag``, the products of the Kronecker factors' eigenvalues for ``kron`` (a
        bias's block has one factor), those of the matrix for ``full``; times laplace-torch's factor
        ``1 / sigma^2`` of a Gaussian likelihood. ``P``'s are these plus ``alpha``."""
        h, factor = self.la.H, float(self.la._H_factor)
        if self.structure == "diag":
            return factor * h.detach().double()
        if self.structure == "kfac":
            parts = []
            for values in h.eigenvalues:
                block = values[0].double()
                for more in values[1:]:
                    block = (block[:, None] * more.double()[None, :]).reshape(-1)
                parts.append(block)
            return factor * torch.cat(parts).clamp_min(0)
        return factor * torch.linalg.eigvalsh(h.detach().double()).clamp_min(0)

    def optimise_prior_precision(self, **options) -> TorchLaplace:
        """The prior precision that maximises the evidence, found as laplace-torch's users find it:
        ``la.optimize_prior_precision(method="marglik")``, one scalar, Adam on ``log alpha`` from the current
        ``alpha`` (``options`` pass on, e.g. ``n_steps``, ``lr``)."""
        self._set_prior()
        with warnings.catch_warnings():  # its note on link_approx concerns the 'gridsearch' method, not this one
            warnings.filterwarnings("ignore", message="By default `link_approx` is `probit`")
            self.la.optimize_prior_precision(pred_type="glm", method="marglik", prior_structure="scalar",
                                             init_prior_prec=self.prior_precision, **options)
        return replace(self, prior_precision=float(self.la.prior_precision.reshape(-1)[0]))


@dataclass(frozen=True, eq=False)
class BlockLaplace:
    """``N(mean, Lambda^-1)`` with ``Lambda = n_data * GGN + prior_precision * I``, the GGN kept as one dense
    block per parameter tensor: the one structure laplace-torch does not fit. ``ggn`` holds the blocks
    (batch dimension 1) of ``shape`` (a :class:`~smp_core.preconditioners.Structure`)."""

    mean: torch.Tensor
    shape: Structure
    ggn: Stat
    prior_precision: float
    n_data: int
    structure: str = "block"

    @property
    def dim(self) -> int:
        return self.mean.shape[0]

    def with_prior_precision(self, prior_precision: float) -> BlockLaplace:
        _check_prior_precision(prior_precision)
        return replace(self, prior_precision=float(prior_precision))

    @property
    def precision(self) -> torch.Tensor:
        """``Lambda`` as a ``(d, d)`` matrix (zero between blocks)."""
        _check_dense_size(self.dim, "the 'block' precision as a d x d matrix")
        ggn = self.shape.to_dense(self.ggn)[0]
        precision = self.n_data * ggn + self.prior_precision * torch.eye(self.dim, dtype=ggn.dtype, device=ggn.device)
        return (precision + precision.T) / 2

    def sample(self, n_samples: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(n_samples, d)`` draws ``mean + L^-T z`` per block, ``L L^T`` the block of ``Lambda`` and ``z``
        standard normal (float64, drawn on the CPU, so a seed gives the same draws on any device),
        returned in the mean's dtype on its device."""
        if n_samples < 1:
            raise ValueError(f"n_samples must be at least 1, got {n_samples}")
        z = torch.randn(n_samples, self.dim, generator=generator, dtype=torch.float64).to(self.mean.device)
        offsets = torch.empty_like(z)
        for b, stat in zip(self.shape.blocks, self.ggn, strict=True):
            m = stat[0].double()
            precision = self.n_data * m + self.prior_precision * torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
            factor = _cholesky((precision + precision.T) / 2)
            offsets[:, b] = torch.linalg.solve_triangular(factor.mT, z[:, b].T, upper=True).T
        return (self.mean.double() + offsets).to(self.mean.dtype)


def _cholesky(precision: torch.Tensor) -> torch.Tensor:
    factor, info = torch.linalg.cholesky_ex(precision)
    if info.item() != 0:
        raise ValueError("the Laplace precision N * GGN + alpha I is not positive definite (a non-finite "
                         "or negative GGN entry?)")
    return factor


def _check_dense_size(rows: int, what: str) -> None:
    if rows > MAX_DENSE_DIM:
        raise ValueError(f"{what} would have {rows} rows; matrices of more than {MAX_DENSE_DIM} rows are not formed "
                         "here: use structure='diag' or 'kfac', which never form them")


def _check_prior_precision(prior_precision) -> None:
    if not (isinstance(prior_precision, int | float) and not isinstance(prior_precision, bool)
            and math.isfinite(prior_precision) and prior_precision > 0):
        raise ValueError(f"prior_precision must be a finite number > 0 (the prior N(0, I / alpha)), "
                         f"got {prior_precision!r}")


def fit_laplace(
    model: nn.Module,
    likelihood,
    theta_map: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    prior_precision: float,
    structure: str = "dense",
    input_shape: tuple[int, ...] | None = None,
    batch_size: int | None = None,
) -> TorchLaplace | BlockLaplace:
    """The Laplace approximation at ``theta_map``: ``N(theta_MAP, (GGN + alpha I)^-1)``, the GGN summed
    over the training set ``(x, y)`` and kept in ``structure``.

    ``diag``, ``kfac`` and ``dense`` go through laplace-torch as its users run it,
    ``Laplace(model, likelihood, subset_of_weights="all", hessian_structure=...)`` (``diag``, ``kron``,
    ``full``), fitted on ``(x, y)`` in batches of ``batch_size``; a Bernoulli network goes in as the
    two-class classifier with logits ``(0, g)`` (the same model), a Gaussian likelihood as ``regression``
    with its ``sigma`` as ``sigma_noise``. ``block`` (one dense block per parameter tensor, as the SMP
    preconditioner) is not one of laplace-torch's: it is this module's own, from the model-expected Fisher
    of :func:`smp_core.fisher.estimate_fisher` (the GGN for these likelihoods); ``tests/book`` checks that
    its blocks equal those of laplace-torch's ``full``.

    Args:
        model: the network (an ``nn.Module``; its parameters are not changed).
        likelihood: ``"bernoulli"``, ``"categorical"``, ``"gaussian"`` or a likelihood object.
        theta_map: ``(d,)`` the MAP of ``sum_i log f(y_i | x_i, theta) - alpha |theta|^2 / 2``.
        x, y: the training set the MAP was fitted on.
        prior_precision: ``alpha > 0``, the precision of the prior ``N(0, I / alpha)``.
        structure: one of ``diag``, ``block``, ``kfac``, ``dense``.
        input_shape: the shape of one input, where ``x`` holds its rows flattened.
        batch_size: training inputs per batch of laplace-torch's fit; by default 16 for ``diag`` (its
            diagonal GGN holds every input's whole Jacobian: on LeNet-5, 1.1 GB at 16 and 3.3 GB at 64,
            and slower) and 500 otherwise.
    """
    if structure not in LAPLACE_STRUCTURES:
        raise ValueError(f"unknown Laplace structure {structure!r}; choose one of {LAPLACE_STRUCTURES}")
    _check_prior_precision(prior_precision)
    chain = as_chain_model(model, input_shape)
    dim = chain.layout.dim
    if theta_map.ndim != 1 or theta_map.shape[0] != dim:
        raise ValueError(f"theta_map must have shape ({dim},) for this model, got {tuple(theta_map.shape)}")
    if not torch.isfinite(theta_map).all():
        raise ValueError("theta_map contains NaN or infinite values")
    if x.shape[0] == 0:
        raise ValueError("the Laplace approximation needs at least one training input x")
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows but y has {y.shape[0]}")
    if x.is_floating_point() and not torch.isfinite(x).all():
        raise ValueError("the training inputs x contain NaN or infinite values")
    if batch_size is None:
        batch_size = 16 if structure == "diag" else 500
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    lik = get_likelihood(likelihood)
    if structure == "block":
        shape = structure_for(chain, structure)
        largest = max(b.stop - b.start for b in shape.blocks)
        _check_dense_size(largest, "the largest block of a 'block' Laplace precision")
        stat = estimate_fisher(chain, lik, theta_map.unsqueeze(0), x, kind="model", structure=shape)
        if not all(bool(torch.isfinite(t).all()) for t in stat):
            raise ValueError("the GGN at theta_map is not finite (does the network overflow at theta_map?)")
        stat = tuple(((t + t.mT) / 2).detach() for t in stat)  # exactly symmetric for the Cholesky factor
        return BlockLaplace(theta_map.detach().clone(), shape, stat, float(prior_precision), x.shape[0])
    if structure == "dense":
        _check_dense_size(dim, "a 'dense' Laplace precision")
    return _laplace_torch(model, lik, theta_map, x, y, structure, float(prior_precision), input_shape, batch_size)


def _laplace_torch(model, lik, theta_map, x, y, structure, prior_precision, input_shape, batch_size) -> TorchLaplace:
    import copy

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
                 prior_precision=prior_precision, **options)
    dtype, device = torch.get_default_dtype(), torch.get_default_device()
    try:  # laplace-torch forms the full GGN as linop @ eye(d) with the default dtype and device: the
        torch.set_default_dtype(la._dtype)  # network's, so that a float64 GGN is float64 throughout (in
        torch.set_default_device(la._device)  # float32 it is off by ~4e-8 relative) and a GPU's stays there
        la.fit(DataLoader(TensorDataset(x, y), batch_size=batch_size))
    except SystemExit as exc:  # laplace-torch calls exit() when it cannot eigendecompose a Kronecker factor
        raise ValueError("the GGN at theta_map is not finite (laplace-torch could not eigendecompose its "
                         "Kronecker factors; does the network overflow at theta_map?)") from exc
    finally:
        torch.set_default_dtype(dtype)
        torch.set_default_device(device)
    curvature = la.H_facs.kfacs if structure == "kfac" else [[la.H]]
    if not all(bool(torch.isfinite(t).all()) for factors in curvature for t in factors):
        raise ValueError("the GGN at theta_map is not finite (does the network overflow at theta_map?)")
    return TorchLaplace(la, structure, prior_precision)


def log_likelihood(
    model: nn.Module | ChainModel, likelihood, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, *,
    input_shape: tuple[int, ...] | None = None, batch_size: int = 8192,
) -> float:
    """``log p(D | theta) = sum_i log f(y_i | x_i, theta)`` over a data set (float64 sum)."""
    chain = as_chain_model(model, input_shape)
    if theta.shape != (chain.layout.dim,):
        raise ValueError(f"theta must have shape ({chain.layout.dim},), got {tuple(theta.shape)}")
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows but y has {y.shape[0]}")
    lik = get_likelihood(likelihood)
    out = predict(chain, theta[None], x, batch_size=batch_size)[0]
    return float(lik.log_prob(out, y).double().sum())


def log_likelihood_gradient(
    model: nn.Module | ChainModel, likelihood, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, *,
    input_shape: tuple[int, ...] | None = None, batch_size: int = 4096,
) -> torch.Tensor:
    """``grad_theta log p(D | theta)``, summed over the data set (``(d,)``, in ``theta``'s dtype).

    At a MAP of the prior ``N(0, I / alpha)`` it equals ``alpha theta``: the norm of
    ``grad log p(D | theta) - alpha theta`` says how far ``theta`` is from the stationary point that
    the Laplace approximation (and its evidence, which drops the gradient term) assumes.
    """
    chain = as_chain_model(model, input_shape)
    if theta.shape != (chain.layout.dim,):
        raise ValueError(f"theta must have shape ({chain.layout.dim},), got {tuple(theta.shape)}")
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows but y has {y.shape[0]}")
    lik = get_likelihood(likelihood)
    t = theta.detach().clone().requires_grad_(True)
    total = torch.zeros_like(t)
    for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True):
        out = functional_call(chain.module, chain.layout.unflatten(t), (xb,)).reshape(xb.shape[0], -1)
        (grad,) = torch.autograd.grad(lik.log_prob(out, yb).sum(), t)
        total += grad
    return total


def linearised_logits(
    model: nn.Module | ChainModel,
    theta_map: torch.Tensor,
    samples: torch.Tensor,
    x: torch.Tensor,
    *,
    input_shape: tuple[int, ...] | None = None,
    batch_size: int = 1024,
) -> torch.Tensor:
    """Logits of the network linearised at ``theta_map``: ``g(x, theta_MAP) + J(x) (theta_s - theta_MAP)``.

    Args:
        model: the network (or a chain model).
        theta_map: ``(d,)`` the point of linearisation.
        samples: ``(S, d)`` parameter samples (for example the draws of :func:`fit_laplace`).
        x: ``(n, *input_shape)`` inputs.
        batch_size: inputs per Jacobian pass (memory ``batch_size * m * d``).

    Returns:
        ``(S, n, m)`` logits, in the dtype of ``samples``.
    """
    chain = as_chain_model(model, input_shape)
    dim = chain.layout.dim
    if theta_map.shape != (dim,):
        raise ValueError(f"theta_map must have shape ({dim},), got {tuple(theta_map.shape)}")
    if samples.ndim != 2 or samples.shape[1] != dim:
        raise ValueError(f"samples must have shape (S, {dim}), got {tuple(samples.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
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
    """For a plain ``nn.Sequential`` whose first dropout is a direct child after at least one layer, the
    layers before it and the layers from it on (both keep the parent's child names, so the parameter
    names match ``module.named_parameters()``); otherwise ``(None, None)``.

    The split is taken only where running the layers before the first dropout once per batch cannot
    change the result: the parent is ``nn.Sequential`` itself (a subclass may override ``forward``),
    every layer before the first dropout is one of ``torch.nn``'s own (deterministic in eval mode; a
    user's layer might draw random numbers), no parameter is shared between the two parts, and no
    forward hook (global, on the parent or on those layers) could see or change what runs.
    """
    from torch.nn.modules import module as module_module
    from torch.nn.modules.dropout import _DropoutNd

    if type(module) is not nn.Sequential:
        return None, None
    children = list(module)
    first = next((i for i, child in enumerate(children) if isinstance(child, _DropoutNd)), None)
    if first is None or first == 0:
        return None, None
    before = [m for child in children[:first] for m in child.modules()]
    if any(isinstance(m, _DropoutNd) for m in before):
        return None, None  # a dropout nested inside an earlier layer
    if any(not type(m).__module__.startswith("torch.nn.modules.") for m in before):
        return None, None  # a layer of the user's own
    if module_module._global_forward_hooks or module_module._global_forward_pre_hooks or any(
            m._forward_hooks or m._forward_pre_hooks for m in (module, *before)):
        return None, None
    prefix, suffix = module[:first], module[first:]
    names = [name for part in (prefix, suffix) for name, _ in part.named_parameters()]
    if sorted(names) != sorted(name for name, _ in module.named_parameters()):
        return None, None  # parameters shared between the two parts (tied weights)
    return prefix, suffix


def _params_of(part: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``params`` (names as in the parent ``nn.Sequential``) that belong to ``part``."""
    return {name: params[name] for name, _ in part.named_parameters()}


def mc_dropout_logits(
    module: nn.Module,
    theta: torch.Tensor,
    x: torch.Tensor,
    n_samples: int,
    generator: torch.Generator,
    *,
    batch_size: int = 4096,
) -> torch.Tensor:
    """MC dropout's predictive samples (Gal and Ghahramani 2016): the logits of ``module`` at the flat
    parameters ``theta`` with every ``nn.Dropout`` left on, one pass per sample.

    Each pass draws a fresh mask for every input and every dropout layer: an element is kept with
    probability ``1 - p`` and scaled by ``1 / (1 - p)`` (inverted dropout, as in training, so the mean
    over masks of a layer's output is its deterministic output). The masks come from ``generator``
    (a CPU generator) in a fixed order (sample, then batch, then layer) and are moved to ``x``'s
    device, so the same generator gives the same samples on any device. With two or more dropout
    layers that order, and so the samples, also depend on ``batch_size``. The module's parameters,
    its train/eval flags and its hooks are left as they were.

    For a plain ``nn.Sequential`` (LeNet-5 with dropout is one) whose layers before the first dropout
    are ``torch.nn``'s own, with no forward hooks, those layers are run once per batch instead of once
    per pass, and their outputs for all of ``x`` are held in memory; the masks and so the samples are
    the same as without this shortcut.

    Args:
        module: a network containing at least one ``nn.Dropout`` (element-wise dropout; the channel
            dropouts ``Dropout1d/2d/3d`` and ``AlphaDropout`` are refused).
        theta: ``(d,)`` flat parameters, in the order of ``module.parameters()``.
        x: ``(n, *input_shape)`` inputs.
        n_samples: ``S``, the number of passes.
        generator: a ``torch.Generator`` on the CPU.
        batch_size: inputs per pass.

    Returns:
        ``(S, n, m)`` logits.
    """
    from torch.nn.modules.dropout import _DropoutNd

    layout = ParamLayout.from_module(module)
    dim = layout.dim
    if theta.shape != (dim,):
        raise ValueError(f"theta must have shape ({dim},), got {tuple(theta.shape)}")
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples must be a positive integer, got {n_samples!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        raise ValueError("generator must be a torch.Generator on the CPU")
    if not torch.isfinite(x).all():
        raise ValueError("x contains NaN or infinite values")
    dropouts = [m for m in module.modules() if isinstance(m, _DropoutNd)]
    others = [type(m).__name__ for m in dropouts if type(m) is not nn.Dropout]
    if others:
        raise ValueError(f"only element-wise nn.Dropout layers are supported, the module has {sorted(set(others))}")
    if not dropouts:
        raise ValueError("the module has no nn.Dropout layer: MC dropout needs a network trained with dropout")
    if any(not 0.0 <= m.p < 1.0 for m in dropouts):
        raise ValueError(f"dropout probabilities must lie in [0, 1), got {[m.p for m in dropouts]}")

    def mask(layer: nn.Dropout, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        keep = 1.0 - layer.p
        kept = torch.rand(output.shape, generator=generator) < keep
        return output * kept.to(device=output.device, dtype=output.dtype) / keep

    flags = {m: m.training for m in module.modules()}
    hooks = []
    try:
        module.eval()  # each nn.Dropout is then the identity, and its hook applies our mask
        hooks = [m.register_forward_hook(mask) for m in dropouts]
        params = layout.unflatten(theta.to(x.device))
        prefix, suffix = _split_before_first_dropout(module)
        with torch.no_grad():
            if prefix is None:
                samples = [torch.cat([functional_call(module, params, (xb,)).reshape(xb.shape[0], -1)
                                      for xb in x.split(batch_size)]) for _ in range(n_samples)]
            else:
                # The layers before the first dropout see no mask: run them once per batch, not once
                # per pass. The masks are drawn in the same order (sample, batch, layer), so the
                # samples are those of the generic path above.
                heads = [functional_call(prefix, _params_of(prefix, params), (xb,)) for xb in x.split(batch_size)]
                tail_params = _params_of(suffix, params)
                samples = [torch.cat([functional_call(suffix, tail_params, (hb,)).reshape(hb.shape[0], -1)
                                      for hb in heads]) for _ in range(n_samples)]
    finally:
        for hook in hooks:
            hook.remove()
        for m, flag in flags.items():
            m.training = flag
    return torch.stack(samples)
