"""The synthetic 2-D binary classification problem of Section 3.2.1 of the paper ("Toy example").

Covariates are uniform on the square ``[-1, 1]^2`` and labels follow the equation of Section 3.2.1
(Data generation and network architecture)::

    Y_i ~ Bernoulli(p_true(X_i)),    p_true(x) = sigma(20 * (0.5 - ||x||_2^2)),

with ``sigma`` the logistic function: a circular decision boundary ``||x||_2^2 = 0.5`` with
confident labels inside (``Y = 1``) and outside (``Y = 0``). The paper uses ``N_train = 500``
training points and ``N_test = 5000`` test points.

Seed scheme. :func:`make_toy_data` draws from one ``torch.Generator`` seeded with ``seed``
(``torch.Generator().manual_seed(seed)``, CPU), never from the global torch RNG: first the
``2 n`` uniforms of the covariates (``torch.rand((n, 2))``, row-major), then the ``n`` label
draws (``torch.bernoulli``). The result depends only on ``(n, seed)``; data sets of different
sizes with the same seed are *not* prefixes of one another, so take the training and test sets
from different seeds (the notebooks use ``seed=0`` for training and ``seed=1`` for test).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["p_true", "make_toy_data", "make_grid"]


def p_true(x):
    """True class-1 probability ``sigma(20 (0.5 - ||x||_2^2))`` of Section 3.2.1 of the paper.

    ``x`` has shape ``(..., 2)``; the result has shape ``(...)``. A ``torch.Tensor`` gives a
    tensor (same dtype and device), anything else a NumPy array.
    """
    if isinstance(x, torch.Tensor):
        return torch.sigmoid(20.0 * (0.5 - (x * x).sum(dim=-1)))
    x = np.asarray(x, dtype=float)
    z = 20.0 * (0.5 - (x * x).sum(axis=-1))
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # the logistic function, without overflow warnings


def make_toy_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points of the toy problem (Section 3.2.1, ``Y_i ~ Bernoulli(p_true(X_i))``).

    Returns ``x`` float32 ``(n, 2)``, uniform on ``[-1, 1]^2``, and ``y`` float32 ``(n,)`` in
    ``{0, 1}``. Deterministic in ``(n, seed)``: see the module docstring for the seed scheme.
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    gen = torch.Generator().manual_seed(int(seed))
    x = torch.rand((n, 2), generator=gen, dtype=torch.float32) * 2.0 - 1.0
    y = torch.bernoulli(p_true(x), generator=gen).to(torch.float32)
    return x, y


def make_grid(n_per_axis: int = 101) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A regular grid over ``[-1, 1]^2`` for the function-space plots of Section 3.2.2.

    Returns ``xx`` and ``yy`` of shape ``(n_per_axis, n_per_axis)`` (``meshgrid`` with
    ``indexing="xy"``: ``xx[i, j]`` is the ``j``-th abscissa, ``yy[i, j]`` the ``i``-th ordinate,
    ready for ``plt.contourf(xx, yy, z.reshape(xx.shape))``) and ``points`` of shape
    ``(n_per_axis ** 2, 2)``, the rows ``(xx.ravel()[k], yy.ravel()[k])``. All float32.
    """
    if n_per_axis < 2:
        raise ValueError(f"n_per_axis must be at least 2, got {n_per_axis}")
    axis = torch.linspace(-1.0, 1.0, n_per_axis, dtype=torch.float32)
    yy, xx = torch.meshgrid(axis, axis, indexing="ij")
    points = torch.stack([xx.reshape(-1), yy.reshape(-1)], dim=1)
    return xx, yy, points
