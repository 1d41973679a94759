"""Baselines beyond the paper: the Laplace approximation and its linearised predictive.

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
* :func:`linearised_logits`: the "GLM" predictive of Immer, Korzepa and Bauer (2021): a sample's
  logits are ``g(x, theta_MAP) + J(x) (theta - theta_MAP)``, the network linearised at the MAP, the
  model whose exact Laplace approximation is the dense GGN one (the other structures approximate
  it). Sampling the
  network itself at Laplace draws (``predict``) is the other, known to underfit.

Deep ensembles need no code of their own here: they are independent MAP fits from random starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .fisher import estimate_fisher, structure_for
from .likelihoods import get_likelihood
from .models import ChainModel, as_chain_model

LAPLACE_STRUCTURES = ("diag", "block", "kfac", "dense")
# Beyond this many parameters a dense d x d precision (and its Cholesky factor) is not built.
MAX_DENSE_DIM = 10_000


@dataclass
class LaplacePosterior:
    """``N(mean, precision^-1)``; ``precision`` is ``(d,)`` for ``diag`` and ``(d, d)`` otherwise.

    ``structure`` names the Fisher structure the precision kept; ``n_data`` and ``prior_precision``
    are the ``N`` and ``alpha`` of ``Lambda = N * GGN + alpha I``.
    """

    mean: torch.Tensor
    precision: torch.Tensor
    structure: str
    prior_precision: float
    n_data: int

    @property
    def dim(self) -> int:
        return self.mean.shape[0]

    def covariance(self) -> torch.Tensor:
        """The ``(d, d)`` covariance ``Lambda^-1`` (float64)."""
        if self.structure == "diag":
            return torch.diag(1 / self.precision.double())
        return torch.cholesky_inverse(self._cholesky())

    def _cholesky(self) -> torch.Tensor:
        factor, info = torch.linalg.cholesky_ex(self.precision.double())
        if info.item() != 0:
            raise ValueError("the Laplace precision N * GGN + alpha I is not positive definite (a non-finite "
                             "or negative GGN entry?)")
        return factor

    def sample(self, n_samples: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(n_samples, d)`` draws ``mean + L^-T z`` with ``L L^T = Lambda`` (``z`` standard normal, float64),
        returned in the mean's dtype."""
        if n_samples < 1:
            raise ValueError(f"n_samples must be at least 1, got {n_samples}")
        z = torch.randn(n_samples, self.dim, generator=generator, dtype=torch.float64)
        if self.structure == "diag":
            offsets = z / self.precision.double().sqrt()
        else:
            offsets = torch.linalg.solve_triangular(self._cholesky().mT, z.T, upper=True).T
        return (self.mean.double() + offsets).to(self.mean.dtype)


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
        ``N (G (x) A) + alpha I`` per layer, its ridge exact, stored as the dense matrix).
    """
    if structure not in LAPLACE_STRUCTURES:
        raise ValueError(f"unknown Laplace structure {structure!r}; choose one of {LAPLACE_STRUCTURES}")
    if not (isinstance(prior_precision, int | float) and math.isfinite(prior_precision) and prior_precision > 0):
        raise ValueError(f"prior_precision must be a finite number > 0 (the prior N(0, I / alpha)), "
                         f"got {prior_precision!r}")
    chain = as_chain_model(model, input_shape)
    dim = chain.layout.dim
    if theta_map.ndim != 1 or theta_map.shape[0] != dim:
        raise ValueError(f"theta_map must have shape ({dim},) for this model, got {tuple(theta_map.shape)}")
    if not torch.isfinite(theta_map).all():
        raise ValueError("theta_map contains NaN or infinite values")
    if structure != "diag" and dim > MAX_DENSE_DIM:
        raise ValueError(f"a {structure!r} Laplace precision is stored as a dense {dim} x {dim} matrix here; "
                         f"use structure='diag' for more than {MAX_DENSE_DIM} parameters")
    lik = get_likelihood(likelihood)
    shape = structure_for(chain, structure)
    stat = estimate_fisher(chain, lik, theta_map.unsqueeze(0), x, kind="model", structure=shape)
    n = x.shape[0]
    if structure == "diag":
        precision = n * stat[0][0] + prior_precision
    else:
        ggn = shape.to_dense(stat)[0]
        precision = n * ggn + prior_precision * torch.eye(dim, dtype=ggn.dtype)
        precision = (precision + precision.T) / 2  # exactly symmetric for the Cholesky factor
    if not torch.isfinite(precision).all():
        raise ValueError("the GGN at theta_map is not finite (does the network overflow at theta_map?)")
    return LaplacePosterior(theta_map.detach().clone(), precision.detach(), structure, float(prior_precision), n)


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
