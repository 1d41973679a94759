"""Conditional likelihoods f_theta(y | x) of the paper (Section 2.1) on a network output g.

Each likelihood works on the network output ``out`` of shape ``(B, m)`` and provides:

* ``sample(out, generator)``: draws ``Y ~ f(. | x)`` (the predictive-resampling step of
  Algorithm 1),
* ``noise_width(out_dim)``, ``noise_from_uniforms(u, dtype)`` and ``sample_from_noise(out, noise)``: the
  same draw split in two, the randomness first (``noise_width`` uniforms per response, from the
  chain's own stream of :mod:`smp_core.streams`, turned into uniforms or standard normals) and
  then a deterministic transform of it; the recursion draws every response this way
  (``draw_noise(rows, out_dim, generator, ...)`` draws the same noise from a ``torch.Generator``),
* ``log_prob(out, y)``: ``log f(y | x)`` per row,
* ``residual(out, y)``: ``d log f(y | x) / d out`` of shape ``(B, m)``; the score is then
  ``s = J^T residual`` with ``J = d out / d theta`` (eq. 2.2 with the empirical design),
* ``fisher_factor(out)``: a matrix ``L`` of shape ``(B, m, r)`` with ``L L^T = Lambda``, the
  model-expected Fisher of the output, so that ``I(theta) = mean J^T L L^T J``,
* ``probs(out)``: class probabilities ``(..., C)`` for the metrics (classification only).

Binary classification uses one logit (eq. 2.7: ``p = sigmoid(g)``), multiclass the softmax
(eq. 2.5), regression a Gaussian with known noise standard deviation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _uniform_noise(self, rows: tuple[int, ...], out_dim: int, generator: torch.Generator | None = None,
                   device=None, dtype=torch.float32) -> torch.Tensor:
    """``U(0, 1)`` uniforms of shape ``rows``, one per response (``draw_noise`` of the classifiers)."""
    return torch.rand(rows, generator=generator, device=device, dtype=dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))``. Not ``torch.sigmoid``: its vectorised and scalar CPU loops round
    differently, so a chain's value would depend on where it sits in the batch (``exp`` does not)."""
    return torch.reciprocal(torch.exp(-x).add_(1))


def _one_uniform_width(self, out_dim: int) -> int:
    """A classifier's response takes one uniform (``noise_width``)."""
    return 1


def _the_uniform(self, u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(..., 1)`` float64 uniforms to the ``(...)`` noise of ``sample_from_noise`` in ``dtype``
    (``noise_from_uniforms``), kept below 1 where ``dtype`` would round them up to it."""
    return u[..., 0].to(dtype).clamp_(max=1 - torch.finfo(dtype).eps / 2)


class Bernoulli:
    """Binary response with ``P(Y=1 | x) = sigmoid(g(x, theta))`` for a scalar logit (eq. 2.7)."""

    name = "bernoulli"
    out_dim = 1

    def sample(self, out: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """``Y ~ Bernoulli(sigmoid(g))`` per row of ``out`` ``(B, 1)``, as 0. or 1. in ``out``'s dtype."""
        u = torch.rand(out.shape[0], generator=generator, device=out.device, dtype=out.dtype)
        return (u < sigmoid(out[:, 0])).to(out.dtype)

    draw_noise = _uniform_noise
    noise_width = _one_uniform_width
    noise_from_uniforms = _the_uniform

    def sample_from_noise(self, out: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """``Y = 1{U < sigmoid(g)}`` for the uniforms ``noise`` ``(B,)``: a ``Bernoulli(sigmoid(g))`` draw."""
        return (noise < sigmoid(out[:, 0])).to(out.dtype)

    def _check_y(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if out.ndim != 2 or out.shape[1] != 1:
            raise ValueError(f"Bernoulli needs one logit per row, output shape (B, 1); got {tuple(out.shape)}")
        if y.shape != (out.shape[0],):
            raise ValueError(f"y must have shape ({out.shape[0]},), got {tuple(y.shape)}")
        if not ((y == 0) | (y == 1)).all():
            raise ValueError("Bernoulli responses must be 0 or 1")
        return y.to(out.dtype)

    def log_prob(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``log f(y | x) = y g - log(1 + e^g)`` per row; ``y`` must hold 0 or 1."""
        y = self._check_y(out, y)
        logit = out[:, 0]
        return y * logit - F.softplus(logit)

    def residual(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``d log f / d g = y - sigmoid(g)``, shape ``(B, 1)``: the score is ``J^T`` times it (eqs. 2.7-2.8)."""
        return (y.to(out.dtype) - sigmoid(out[:, 0])).unsqueeze(-1)

    def fisher_factor(self, out: torch.Tensor) -> torch.Tensor:
        """``L = sqrt(p (1 - p))``, shape ``(B, 1, 1)``: ``L L^T`` is the output's Fisher ``p (1 - p)``."""
        p = sigmoid(out)
        return torch.sqrt(p * (1 - p)).unsqueeze(-1)

    def probs(self, out: torch.Tensor) -> torch.Tensor:
        """The two class probabilities ``(1 - p, p)`` along a new last axis, for the metrics."""
        p = sigmoid(out[..., 0])
        return torch.stack([1 - p, p], dim=-1)


class Categorical:
    """Multiclass response with softmax probabilities ``pi_j = softmax(g)_j`` (eq. 2.5-2.6)."""

    name = "categorical"

    def sample(self, out: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """One class per row from ``softmax(out)``. A row with non-finite outputs (a chain whose
        parameters blew up between two divergence checks of the recursion, which then freezes and
        reports it) draws from uniform probabilities instead of failing the whole batch; the other
        rows draw exactly as they would without it."""
        probs = torch.softmax(out, dim=-1)
        probs = torch.where(torch.isfinite(probs).all(-1, keepdim=True), probs, 1.0 / out.shape[-1])
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

    draw_noise = _uniform_noise
    noise_width = _one_uniform_width
    noise_from_uniforms = _the_uniform

    def sample_from_noise(self, out: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF draw: ``Y`` = the number of cumulative class probabilities below the uniform
        ``U`` (``noise``, ``(B,)``), so ``P(Y = c) = pi_c``; clamped to the last class against rounding
        (a total just below 1)."""
        cdf = torch.softmax(out, dim=-1).cumsum_(-1)
        return (cdf < noise.unsqueeze(-1)).sum(-1).clamp_(max=out.shape[-1] - 1)

    def _check_y(self, out: torch.Tensor, y: torch.Tensor) -> None:
        if y.shape != (out.shape[0],):
            raise ValueError(f"y must have shape ({out.shape[0]},), got {tuple(y.shape)}")
        if y.dtype.is_floating_point or (y.min() < 0) or (y.max() >= out.shape[1]):
            raise ValueError(f"categorical responses must be integer class labels in [0, {out.shape[1]})")

    def log_prob(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``log pi_y = g_y - log sum_j e^{g_j}`` per row; ``y`` must hold integer labels in ``[0, m)``."""
        self._check_y(out, y)
        return torch.log_softmax(out, dim=-1).gather(1, y.long().unsqueeze(-1)).squeeze(-1)

    def residual(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``d log f / d g = e_y - pi``, shape ``(B, m)``: the score is ``J^T`` times it (eq. 2.6)."""
        res = -torch.softmax(out, dim=-1)
        res.scatter_add_(1, y.long().unsqueeze(-1), torch.ones_like(res[:, :1]))
        return res

    def fisher_factor(self, out: torch.Tensor) -> torch.Tensor:
        """``L``, shape ``(B, m, m)``, with ``L L^T = diag(pi) - pi pi^T``, the output's Fisher."""
        # Lambda = diag(pi) - pi pi^T = L L^T with column c of L equal to sqrt(pi_c) (e_c - pi).
        pi = torch.softmax(out, dim=-1)
        eye = torch.eye(out.shape[1], dtype=out.dtype, device=out.device)
        return (eye - pi.unsqueeze(-1)) * pi.sqrt().unsqueeze(-2)

    def probs(self, out: torch.Tensor) -> torch.Tensor:
        """The class probabilities ``softmax(g)``, for the metrics."""
        return torch.softmax(out, dim=-1)


class Gaussian:
    """Regression response ``Y ~ N(g(x, theta), sigma^2 I)`` with known noise ``sigma``."""

    name = "gaussian"

    def __init__(self, sigma: float = 1.0):
        try:  # a number, a numpy scalar or a 0-d tensor; never a bool or a string
            value = math.nan if isinstance(sigma, bool | str) else float(sigma)
        except (TypeError, ValueError, RuntimeError):
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"sigma, the Gaussian noise standard deviation, must be a finite number > 0, "
                             f"got {sigma!r}")
        self.sigma = value

    def sample(self, out: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """``Y = g + sigma Z`` with standard normals ``Z``, shape ``(B, m)``."""
        noise = torch.randn(out.shape, generator=generator, device=out.device, dtype=out.dtype)
        return out + self.sigma * noise

    def draw_noise(self, rows: tuple[int, ...], out_dim: int, generator: torch.Generator | None = None,
                   device=None, dtype=torch.float32) -> torch.Tensor:
        """Standard normals of shape ``(*rows, out_dim)``."""
        return torch.randn((*rows, out_dim), generator=generator, device=device, dtype=dtype)

    def noise_width(self, out_dim: int) -> int:
        """One standard normal per output."""
        return out_dim

    def noise_from_uniforms(self, u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Standard normals ``Phi^-1(u) = sqrt(2) erfinv(2u - 1)`` in ``dtype`` from float64 uniforms
        ``(..., m)`` (not ``torch.special.ndtri``, whose CPU loops round by the position in the batch)."""
        return torch.erfinv(2 * u - 1).mul_(math.sqrt(2)).to(dtype)

    def sample_from_noise(self, out: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """``Y = g + sigma Z`` for the standard normals ``noise`` ``(B, m)``."""
        return out + self.sigma * noise

    def log_prob(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``log N(y | g, sigma^2 I)`` per row, summed over the ``m`` outputs."""
        y = y.reshape(out.shape).to(out.dtype)
        z = (y - out) / self.sigma
        # the constant in Python floats: float32 tensors of it would round a float64 log density
        return (-0.5 * z * z - (0.5 * math.log(2 * math.pi) + math.log(self.sigma))).sum(-1)

    def residual(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``d log f / d g = (y - g) / sigma^2``, shape ``(B, m)``: the score is ``J^T`` times it."""
        return (y.reshape(out.shape).to(out.dtype) - out) / self.sigma**2

    def fisher_factor(self, out: torch.Tensor) -> torch.Tensor:
        """``L = I / sigma``, shape ``(B, m, m)``: the output's Fisher ``I / sigma^2`` (constant)."""
        eye = torch.eye(out.shape[1], dtype=out.dtype, device=out.device) / self.sigma
        return eye.expand(out.shape[0], -1, -1)

    def probs(self, out: torch.Tensor) -> torch.Tensor:
        """Raises ``TypeError``: a regression has no class probabilities."""
        raise TypeError("a Gaussian likelihood has no class probabilities")


def check_output_dim(likelihood, out_dim: int | None) -> None:
    """Raise a ``ValueError`` if a network with ``out_dim`` outputs cannot carry ``likelihood``: Bernoulli
    needs one logit, categorical at least two (one logit's softmax is always 1: every residual would be
    0 and no chain would ever move). Other likelihoods, and an unknown ``out_dim`` (``None``: a user's
    chain model without one), pass."""
    if out_dim is None:
        return
    name = getattr(likelihood, "name", None)
    if name == "bernoulli" and out_dim != 1:
        raise ValueError(f"a Bernoulli likelihood needs a network with one output (a logit), this one has {out_dim}; "
                         "for several classes use 'categorical'")
    if name == "categorical" and out_dim < 2:
        raise ValueError(f"a categorical likelihood needs a network with one output per class (at least 2), this "
                         f"one has {out_dim}; for two classes and one logit use 'bernoulli'")


def check_responses(likelihood, y: torch.Tensor, out_dim: int) -> None:
    """Raise a ``ValueError`` naming the problem unless ``y`` holds valid responses for ``likelihood`` on a
    network with ``out_dim`` outputs: Bernoulli 0 or 1, categorical integer labels in ``[0, out_dim)``,
    Gaussian finite values, one row (of ``out_dim`` values) per example. Used for observed labels (the
    empirical Fisher), where a wrong label would otherwise give a finite, wrong Fisher."""
    check_output_dim(likelihood, out_dim)
    name = getattr(likelihood, "name", None)
    n = y.shape[0] if y.ndim else 0
    if name in ("bernoulli", "categorical") and y.ndim != 1:
        raise ValueError(f"{name} labels must have shape (n,), got {tuple(y.shape)}")
    if name == "bernoulli" and not ((y == 0) | (y == 1)).all():
        raise ValueError("Bernoulli labels must be 0 or 1")
    if name == "categorical" and (y.dtype.is_floating_point or y.dtype == torch.bool
                                  or (n and (y.min() < 0 or y.max() >= out_dim))):
        found = "" if y.dtype.is_floating_point or not n else f" in [{int(y.min())}, {int(y.max())}]"
        raise ValueError(f"categorical labels must be integer class labels in [0, {out_dim}), got {y.dtype}{found}")
    if name == "gaussian":
        if y.numel() != n * out_dim:
            raise ValueError(f"Gaussian responses must hold {out_dim} value(s) per example, got shape {tuple(y.shape)}")
        if not torch.isfinite(y).all():
            raise ValueError("the Gaussian responses contain NaN or infinite values")


def get_likelihood(name: str | Bernoulli | Categorical | Gaussian, **kwargs):
    """A likelihood object from its name (``"bernoulli"``, ``"categorical"``, ``"gaussian"`` with ``sigma=``)."""
    if not isinstance(name, str):
        return name
    table = {"bernoulli": Bernoulli, "categorical": Categorical, "gaussian": Gaussian}
    if name.lower() not in table:
        raise ValueError(f"unknown likelihood {name!r}; choose one of {sorted(table)}")
    if name.lower() == "gaussian" and "sigma" not in kwargs:
        raise ValueError("likelihood 'gaussian' needs its noise standard deviation: pass smp_core.Gaussian(sigma) "
                         "(the name alone would silently mean sigma = 1)")
    return table[name.lower()](**kwargs)
