"""Baselines beyond the paper: the Laplace approximation with its linearised predictive, and MC dropout.

The paper's first limitation (Section 4.5) is that SMP was compared only with NUTS and a point
estimate, not with the approximate methods practitioners use: Laplace approximations, deep ensembles,
MC dropout. This module gives the Laplace approximation for any ``nn.Module`` with a Bernoulli,
categorical or Gaussian likelihood, built on the same Fisher statistics as the SMP preconditioners:

* :func:`fit_laplace`: ``theta ~ N(theta_MAP, Lambda^-1)`` with the precision
  ``Lambda = N * GGN(theta_MAP) + alpha I``. ``GGN`` is the model-expected Fisher of
  :func:`smp_core.fisher.estimate_fisher` over the ``N`` training inputs (for these likelihoods it
  equals the generalised Gauss-Newton matrix ``(1/N) sum_i J_i^T H_i J_i``, ``H_i`` the Hessian of the
  negative log likelihood in the network output), restricted to a structure: ``diag``, ``block``
  (one block per parameter tensor), ``kfac`` (``G (x) A`` per layer) or ``dense``. ``alpha`` is the
  precision of the Gaussian prior ``N(0, alpha^-1 I)`` whose log density the MAP maximised with the
  log likelihood (MacKay 1992; Ritter, Botev and Barber 2018 for KFAC; Daxberger et al. 2021).
  ``diag`` and ``kfac`` never form a ``d x d`` matrix (a ``kfac`` posterior is sampled through the
  eigenvectors of its factors), so they serve networks of any size, LeNet-5 included.
* :meth:`LaplacePosterior.log_marginal_likelihood` and :func:`optimise_prior_precision`: the
  Laplace approximation of the evidence ``log p(D | alpha)`` and the prior precision that maximises
  it with ``theta_MAP`` held fixed (MacKay 1992; the post-hoc tuning of Daxberger et al. 2021).
* :func:`linearised_logits`: the "GLM" predictive of Immer, Korzepa and Bauer (2021): a sample's
  logits are ``g(x, theta_MAP) + J(x) (theta - theta_MAP)``, the network linearised at the MAP, the
  model whose exact Laplace approximation is the dense GGN one (the other structures approximate
  it). Sampling the network itself at Laplace draws (``predict``) is the other, known to underfit.

* :func:`mc_dropout_logits`: MC dropout (Gal and Ghahramani 2016): a network trained with dropout
  predicts with dropout left on, each of ``S`` passes under fresh masks drawn from an explicit
  generator (so the draws are reproducible and the same on any device).

Deep ensembles need no code of their own here: they are independent MAP fits from random starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.func import functional_call

from smp_core.fisher import diagonal_fisher_by_layers, estimate_fisher, structure_for
from smp_core.layout import ParamLayout
from smp_core.likelihoods import get_likelihood
from smp_core.models import ChainModel, as_chain_model, predict
from smp_core.preconditioners import Stat, Structure

LAPLACE_STRUCTURES = ("diag", "block", "kfac", "dense")
# Beyond this many parameters a dense d x d precision (and its Cholesky factor) is not built.
MAX_DENSE_DIM = 10_000


@dataclass(frozen=True, eq=False)
class LaplacePosterior:
    """``N(mean, Lambda^-1)`` with ``Lambda = n_data * GGN + prior_precision * I``, the GGN kept in a structure.

    ``ggn`` is the GGN statistic of ``shape`` (a :class:`~smp_core.preconditioners.Structure`, batch
    dimension 1): the diagonal, the blocks, the Kronecker factors ``(A_1, G_1, ...)`` or the matrix.
    Nothing of size ``d x d`` is formed for ``diag`` and ``kfac``, so these work for networks of any
    size; ``block`` forms one matrix per block, ``dense`` one ``d x d`` matrix.

    The prior precision can be changed afterwards (:meth:`with_prior_precision`), for example to the
    value that maximises the Laplace approximation of the marginal likelihood
    (:func:`optimise_prior_precision`), without computing the GGN again.
    """

    mean: torch.Tensor
    shape: Structure
    ggn: Stat
    prior_precision: float
    n_data: int

    @property
    def structure(self) -> str:
        return self.shape.name

    @property
    def dim(self) -> int:
        return self.mean.shape[0]

    def with_prior_precision(self, prior_precision: float) -> LaplacePosterior:
        """The same GGN and mean with another prior precision ``alpha``."""
        _check_prior_precision(prior_precision)
        other = replace(self, prior_precision=float(prior_precision))
        other.__dict__["_cache"] = self.__dict__.setdefault("_cache", {})  # the GGN's spectrum does not depend on alpha
        return other

    @property
    def precision(self) -> torch.Tensor:
        """``Lambda``: the ``(d,)`` diagonal for ``diag``, otherwise the ``(d, d)`` matrix (refused above
        ``MAX_DENSE_DIM`` parameters)."""
        if self.structure == "diag":
            return self.n_data * self.ggn[0][0] + self.prior_precision
        _check_dense_size(self.dim, f"the {self.structure!r} precision as a d x d matrix")
        ggn = self.shape.to_dense(self.ggn)[0]
        precision = self.n_data * ggn + self.prior_precision * torch.eye(self.dim, dtype=ggn.dtype, device=ggn.device)
        return (precision + precision.T) / 2

    def ggn_eigenvalues(self) -> torch.Tensor:
        """The ``d`` eigenvalues of ``n_data * GGN`` in its structure (float64; ``Lambda``'s are these
        plus ``alpha``). ``kfac``: ``N lambda_G,i lambda_A,j`` per layer; ``block``: those of every block."""
        return self._spectrum()[0]

    def log_det_precision(self) -> float:
        """``log det Lambda`` from :meth:`ggn_eigenvalues` (no ``d x d`` matrix for ``diag`` and ``kfac``)."""
        return float(torch.log1p(self.ggn_eigenvalues() / self.prior_precision).sum()
                     + self.dim * math.log(self.prior_precision))

    def log_marginal_likelihood(self, log_likelihood: float) -> float:
        """The Laplace approximation of ``log p(D | alpha)`` (MacKay 1992; Immer et al. 2021,
        *Scalable marginal likelihood estimation*):

        ``log p(D | theta*) + log N(theta* | 0, I / alpha) + (d / 2) log 2 pi - (1 / 2) log det Lambda``
        ``= log p(D | theta*) - alpha |theta*|^2 / 2 + (d / 2) log alpha - (1 / 2) log det Lambda``,

        with ``theta*`` = ``mean`` and ``log_likelihood`` = ``log p(D | theta*)``, the sum over the
        ``N`` training points (:func:`log_likelihood`). Exact for a linear-Gaussian model at its MAP.
        """
        if not math.isfinite(log_likelihood):
            raise ValueError(f"log_likelihood must be finite, got {log_likelihood!r}")
        sq_norm = float(self.mean.double().square().sum())
        return (log_likelihood - self.prior_precision * sq_norm / 2
                - 0.5 * float(torch.log1p(self.ggn_eigenvalues() / self.prior_precision).sum()))

    def _spectrum(self) -> tuple[torch.Tensor, list]:
        """``(eigenvalues of N * GGN, pieces)``, computed once: ``pieces`` holds what sampling needs
        (``kfac``: per layer the eigenvectors and eigenvalues of both factors)."""
        cache = self.__dict__.setdefault("_cache", {})
        if "spectrum" not in cache:
            n = self.n_data
            if self.structure == "diag":
                eigenvalues, pieces = n * _psd_eigenvalues(self.ggn[0][0].double(), "diagonal", self.ggn[0].dtype), []
            elif self.structure == "kfac":
                parts, pieces = [], []
                for layer, a, g in zip(self.shape.layers, self.ggn[0::2], self.ggn[1::2], strict=True):
                    eig_a, u_a = torch.linalg.eigh(a[0].double())
                    eig_g, u_g = torch.linalg.eigh(g[0].double())
                    scale = (n * _psd_eigenvalues(eig_g, "G", g.dtype)[:, None]
                             * _psd_eigenvalues(eig_a, "A", a.dtype)[None, :])
                    parts.append(scale.reshape(-1))
                    pieces.append((layer, u_a, u_g, scale))
                eigenvalues = torch.cat(parts)
            else:
                blocks = self.ggn if self.structure == "block" else (self.ggn[0],)
                eigenvalues = torch.cat([n * _psd_eigenvalues(torch.linalg.eigvalsh(b[0].double()), "GGN", b.dtype)
                                         for b in blocks])
                pieces = []
            cache["spectrum"] = (eigenvalues, pieces)
        return cache["spectrum"]

    def covariance(self) -> torch.Tensor:
        """The ``(d, d)`` covariance ``Lambda^-1`` (float64; refused above ``MAX_DENSE_DIM`` parameters)."""
        if self.structure == "diag":
            return torch.diag(1 / self.precision.double())
        _check_dense_size(self.dim, "the covariance as a d x d matrix")
        return torch.cholesky_inverse(_cholesky(self.precision.double()))

    def sample(self, n_samples: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(n_samples, d)`` draws ``mean + Lambda^{-1/2} z`` (``z`` standard normal, float64),
        returned in the mean's dtype.

        ``diag``: ``z / sqrt(Lambda)``; ``dense`` and ``block``: ``L^-T z`` with ``L L^T = Lambda`` (per
        block); ``kfac``: per layer ``U_G [(U_G^T Z U_A) / sqrt(N lambda_G lambda_A^T + alpha)] U_A^T``
        with ``Z`` the layer's part of ``z`` as an ``n_out x p`` matrix and ``U`` the factors'
        eigenvectors: the symmetric inverse square root of ``N G (x) A + alpha I`` applied to ``z``, so
        the covariance is exact and the draws do not depend on the signs (or, for repeated
        eigenvalues, the basis) that the eigensolver of a device picks.

        ``z`` is drawn on the CPU (with a CPU ``generator``), so the same seed gives the same draws on
        any device; the draws are returned on the mean's device.
        """
        if n_samples < 1:
            raise ValueError(f"n_samples must be at least 1, got {n_samples}")
        z = torch.randn(n_samples, self.dim, generator=generator, dtype=torch.float64).to(self.mean.device)
        alpha = self.prior_precision
        if self.structure == "diag":
            offsets = z / self.precision.double().sqrt()
        elif self.structure == "kfac":
            offsets = torch.empty_like(z)
            for layer, u_a, u_g, scale in self._spectrum()[1]:
                # the symmetric root: a function of the precision alone, not of the eigenvectors' signs
                m = u_g.T @ layer.matrix(z) @ u_a / (scale + alpha).sqrt()
                layer.scatter_(offsets, u_g @ m @ u_a.T)
        else:
            blocks = self.shape.blocks if self.structure == "block" else (slice(0, self.dim),)
            stats = self.ggn if self.structure == "block" else (self.ggn[0],)
            offsets = torch.empty_like(z)
            for b, stat in zip(blocks, stats, strict=True):
                m = stat[0].double()
                precision = self.n_data * m + alpha * torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
                factor = _cholesky((precision + precision.T) / 2)
                offsets[:, b] = torch.linalg.solve_triangular(factor.mT, z[:, b].T, upper=True).T
        return (self.mean.double() + offsets).to(self.mean.dtype)


def _psd_eigenvalues(eigenvalues: torch.Tensor, what: str, dtype: torch.dtype) -> torch.Tensor:
    """Eigenvalues of a positive semi-definite matrix stored in ``dtype``, the small negatives that
    rounding leaves (down to ``-n eps`` times the largest) set to 0."""
    if not torch.isfinite(eigenvalues).all():
        raise ValueError(f"the {what} matrix of the GGN is not finite")
    floor = -eigenvalues.numel() * torch.finfo(dtype).eps * float(eigenvalues.abs().max().clamp_min(1e-300))
    if float(eigenvalues.min()) < floor:
        raise ValueError(f"the {what} matrix of the GGN has a negative eigenvalue {float(eigenvalues.min()):.3g} "
                         "(it should be positive semi-definite)")
    return eigenvalues.clamp_min(0)


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
    model: nn.Module | ChainModel,
    likelihood,
    theta_map: torch.Tensor,
    x: torch.Tensor,
    *,
    prior_precision: float,
    structure: str = "dense",
    input_shape: tuple[int, ...] | None = None,
) -> LaplacePosterior:
    """The Laplace approximation at ``theta_map`` with the GGN restricted to ``structure``.

    Args:
        model: the network (or a :class:`~smp_core.models.ChainModel`).
        likelihood: ``"bernoulli"``, ``"categorical"``, ``"gaussian"`` or a likelihood object.
        theta_map: ``(d,)`` the MAP of ``sum_i log f(y_i | x_i, theta) - alpha |theta|^2 / 2``.
        x: ``(N, *input_shape)`` the training inputs the MAP was fitted on (the GGN needs no labels).
        prior_precision: ``alpha > 0``, the prior precision the MAP was fitted with.
        structure: one of ``diag``, ``block``, ``kfac``, ``dense``.
        input_shape: the shape of one input, for modules that are not MLPs.

    Returns:
        A :class:`LaplacePosterior` with precision ``N * GGN + alpha I`` (a ``kfac`` precision is
        ``N (G (x) A) + alpha I`` per layer, its ridge exact, never formed as a matrix).
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
    if x.is_floating_point() and not torch.isfinite(x).all():
        raise ValueError("the training inputs x contain NaN or infinite values")
    shape = structure_for(chain, structure)
    if structure == "dense":
        _check_dense_size(dim, "a 'dense' Laplace precision")
    elif structure == "block":
        largest = max(b.stop - b.start for b in shape.blocks)
        _check_dense_size(largest, "the largest block of a 'block' Laplace precision")
    lik = get_likelihood(likelihood)
    stat = None
    if structure == "diag":  # layer by layer where the network allows it: no per-example gradient of it all
        stat = diagonal_fisher_by_layers(chain, lik, theta_map.unsqueeze(0), x, kind="model")
    if stat is None:
        stat = estimate_fisher(chain, lik, theta_map.unsqueeze(0), x, kind="model", structure=shape)
    if not all(bool(torch.isfinite(t).all()) for t in stat):
        raise ValueError("the GGN at theta_map is not finite (does the network overflow at theta_map?)")
    stat = tuple(t.detach() for t in stat)
    if structure in ("block", "dense"):
        stat = tuple((t + t.mT) / 2 for t in stat)  # exactly symmetric for the Cholesky factor
    return LaplacePosterior(theta_map.detach().clone(), shape, stat, float(prior_precision), x.shape[0])


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


def optimise_prior_precision(posterior: LaplacePosterior, bounds: tuple[float, float] = (1e-6, 1e8)) -> float:
    """The prior precision ``alpha`` that maximises :meth:`LaplacePosterior.log_marginal_likelihood`
    with the GGN and ``theta*`` held fixed (the post-hoc choice of Daxberger et al. 2021; the log
    likelihood at ``theta*`` does not depend on ``alpha``, so it is not needed). MacKay (1992)
    alternates this step with refitting ``theta*`` under the new prior; post hoc, ``theta*`` stays.

    In ``u = log alpha`` the objective ``-(1/2) sum_i log(1 + N lambda_i e^-u) - e^u |theta*|^2 / 2``
    (plus constants) is concave, so a bounded scalar search finds its one maximum. At it MacKay's
    fixed point holds: ``alpha |theta*|^2 = gamma = sum_i N lambda_i / (N lambda_i + alpha)``, the
    effective number of parameters. Returns ``alpha``; a maximum at a bound raises (widen ``bounds``).
    """
    from scipy.optimize import minimize_scalar

    low, high = bounds
    if not 0 < low < high < math.inf:
        raise ValueError(f"bounds must satisfy 0 < low < high < inf, got {bounds}")
    eigenvalues = posterior.ggn_eigenvalues()
    sq_norm = float(posterior.mean.double().square().sum())
    if sq_norm == 0:
        raise ValueError("theta* is zero: the marginal likelihood grows without bound in alpha")

    def negative(u: float) -> float:
        alpha = math.exp(u)
        return 0.5 * float(torch.log1p(eigenvalues / alpha).sum()) + alpha * sq_norm / 2

    res = minimize_scalar(negative, bounds=(math.log(low), math.log(high)), method="bounded",
                          options={"xatol": 1e-10})
    u = float(res.x)
    if min(u - math.log(low), math.log(high) - u) < 1e-4:
        raise ValueError(f"the marginal likelihood is largest at the bound alpha = {math.exp(u):.3g} of {bounds}; "
                         "widen the bounds")
    return math.exp(u)


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
        samples: ``(S, d)`` parameter samples (for example :meth:`LaplacePosterior.sample`).
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
