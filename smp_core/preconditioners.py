"""Preconditioners P_k of the update theta_k = theta_{k-1} + tau/(N+k) P_k^{-1} s_k (eq. 2.14).

Section 3.1.1 of the paper separates two independent choices, and so does this module:

* the **structure**, one class of the :class:`Structure` protocol each: which entries of the Fisher
  estimate are kept: ``none`` (:class:`Identity`, P = I), ``diag`` (:class:`Diagonal`), ``block``
  (:class:`Blocks`, one block per layer weight and per layer bias), ``dense`` (:class:`Dense`), or,
  beyond the paper, ``kfac`` (:class:`KFAC`, one block per ``Linear`` / ``Conv2d`` layer, weight
  and bias together, approximated by a Kronecker product ``G (x) A`` of the second moments of the
  layer's output gradients ``G`` and of its inputs ``A``; Martens and Grosse 2015, Grosse and
  Martens 2016);
* the **temporal strategy**: how the values are obtained over the run: ``fixed`` (the Fisher at
  theta_0 over a data set, once), ``ema`` (I_k = beta I_{k-1} + (1 - beta) s_{k-1} s_{k-1}^T,
  so that P_k depends only on F_{k-1}) or ``periodic`` (recomputed every T steps at the
  current theta over a data set).

A ridge ``lambda`` is added to the diagonal of every structured preconditioner: P = I_hat + lambda I.

A Fisher *statistic* is a tuple of tensors with a leading batch dimension C (1 when shared by
all chains, S when per chain): ``(diag,)`` with ``diag`` of shape ``(C, d)`` for ``diag``,
``(M,)`` with ``M`` of shape ``(C, d, d)`` for ``dense``, one ``(C, n_b, n_b)`` matrix per block
for ``block``, the pairs ``(A_1, G_1, A_2, G_2, ...)`` of ``(C, p_l, p_l)`` and ``(C, o_l, o_l)``
matrices for ``kfac`` (:class:`KroneckerLayer`) and ``()`` for ``none``. Statistics are plain
tensors, so the EMA is a map over the tuple. A :class:`Preconditioner` is plain data (a structure,
a strategy and their settings) whose methods ``init``, ``update`` and ``solve`` the recursion calls,
modelled on optax's ``GradientTransformation``; :func:`none`, :func:`fixed`, :func:`ema` and
:func:`periodic` build one.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

Stat = tuple[torch.Tensor, ...]
Curvature = Callable[[torch.Tensor], Stat]

STRATEGIES = ("fixed", "ema", "periodic")


# ---------------------------------------------------------------------------------------------
# Structures
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KroneckerLayer:
    """One layer of a ``kfac`` structure: where its weight and bias sit in the flat parameter vector.

    The weight, ``(n_out, ...)`` flattened row-major, is read as an ``(n_out, n_in)`` matrix (a
    ``Linear`` layer's own shape; a ``Conv2d``'s ``(out_channels, in_channels * kh * kw)``, the order
    of its input patches). With the bias as a last column the layer's parameters form the
    ``(n_out, p)`` matrix ``M = [W, b]``, ``p = n_in + 1`` (``n_in`` without a bias). One example's
    score for a linear layer is ``M`` = ``g a^T`` with ``a`` the input (and a 1 for the bias) and
    ``g`` the output gradient, so its outer product is ``(g g^T) (x) (a a^T)`` in the row-major
    order of ``M``: KFAC keeps ``G (x) A`` with ``A = E[a a^T]`` and ``G = E[g g^T]``.
    """

    weight: slice
    bias: slice | None
    n_out: int
    n_in: int

    @property
    def n_cols(self) -> int:
        """``p``: the columns of ``[W, b]``."""
        return self.n_in + (self.bias is not None)

    def matrix(self, v: torch.Tensor) -> torch.Tensor:
        """The ``(S, n_out, p)`` matrices ``[W, b]`` of the rows of ``v`` ``(S, d)`` (a copy)."""
        w = v[:, self.weight].reshape(v.shape[0], self.n_out, self.n_in)
        if self.bias is None:
            return w.clone()
        return torch.cat([w, v[:, self.bias].unsqueeze(-1)], dim=-1)

    def scatter_(self, out: torch.Tensor, m: torch.Tensor) -> None:
        """Write the ``(S, n_out, p)`` matrices ``m`` into their places in ``out`` ``(S, d)``."""
        out[:, self.weight] = m[..., : self.n_in].reshape(m.shape[0], -1)
        if self.bias is not None:
            out[:, self.bias] = m[..., self.n_in]

    def positions(self) -> torch.Tensor:
        """The flat-vector index of each entry of ``[W, b]`` in row-major order, ``(n_out * p,)``."""
        idx = torch.arange(self.weight.start, self.weight.stop).reshape(self.n_out, self.n_in)
        if self.bias is not None:
            idx = torch.cat([idx, torch.arange(self.bias.start, self.bias.stop).unsqueeze(-1)], dim=-1)
        return idx.reshape(-1)


@dataclass(frozen=True)
class Structure:
    """Which entries of the Fisher estimate a preconditioner keeps, and how it solves with them: one class
    per structure (:class:`Identity`, :class:`Diagonal`, :class:`Blocks`, :class:`Dense`, :class:`KFAC`),
    each implementing this protocol. :func:`make_structure` builds one by its name, and
    :func:`smp_core.fisher.structure_for` for a model (its blocks or Kronecker layers filled in).

    Class attributes say what the strategies may do with a structure, so that no code switches on names:
    ``name`` (as in the paper's variant names), ``constant`` (``P = I`` whatever the data: no Fisher, no
    update), ``elementwise`` (``P^{-1}`` acts entry by entry: an :class:`ElementwiseRule` steps) and
    ``matrices`` (the statistic holds matrices: ``statistic_dtype`` and ``ema_refresh`` apply).
    """

    name: ClassVar[str]
    constant: ClassVar[bool] = False
    elementwise: ClassVar[bool] = False
    matrices: ClassVar[bool] = True
    dim: int

    def __new__(cls, *args, **kwargs):
        if cls is Structure:
            raise TypeError("Structure is the protocol of the structure classes; build one with "
                            "smp_core.preconditioners.make_structure(name, dim, blocks=..., layers=...), a class "
                            "such as Diagonal(dim), or smp_core.fisher.structure_for(model, name)")
        return super().__new__(cls)

    def __post_init__(self):
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"dim, the number of parameters d, must be a whole number >= 1, got {self.dim!r}")

    def stat_numel(self) -> int:
        """Numbers in one chain's Fisher statistic (what a per-chain EMA or periodic strategy stores
        per chain): ``0`` (none), ``d`` (diag), ``sum n_b^2`` (block), ``d^2`` (dense) and
        ``sum p_l^2 + o_l^2`` (kfac)."""
        return sum(math.prod(shape) for shape in self.stat_shapes())

    def stat_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shape of each tensor of one chain's statistic (without the leading batch dimension)."""
        raise NotImplementedError

    # --- statistics -------------------------------------------------------------------------

    def outer_sum(self, vectors: torch.Tensor) -> Stat:
        """Sum of ``v v^T`` over the middle axis of ``vectors`` ``(C, n, d)``, restricted to the structure."""
        if vectors.ndim != 3 or vectors.shape[-1] != self.dim:
            raise ValueError(f"vectors must have shape (C, n, {self.dim}), got {tuple(vectors.shape)}")
        return self._outer_sum(vectors)

    def _outer_sum(self, vectors: torch.Tensor) -> Stat:
        raise NotImplementedError

    def ema_update_(self, stat: Stat, v: torch.Tensor, beta: float) -> Stat:
        """In place: ``stat <- beta stat + (1 - beta) v v^T`` per row of ``v`` ``(S, d)``, restricted to the
        structure (one fused kernel per tensor, no temporaries). ``stat`` must have ``C = S``."""
        raise NotImplementedError

    def identity(self, batch: int = 1, dtype=torch.float32, device=None) -> Stat:
        """The statistic of the identity matrix (a neutral starting value)."""
        return tuple(torch.eye(shape[0], dtype=dtype, device=device).expand(batch, *shape).clone()
                     for shape in self.stat_shapes())

    def to_dense(self, stat: Stat) -> torch.Tensor:
        """The ``(C, d, d)`` matrix a statistic stands for (for tests and inspection)."""
        raise NotImplementedError

    # --- solving ----------------------------------------------------------------------------

    def factorize(self, stat: Stat, ridge: float) -> Stat:
        """A factor of ``P = stat + ridge I`` that :meth:`apply` uses for repeated solves."""
        raise NotImplementedError

    def apply(self, factor: Stat, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``P^{-1} v`` for ``v`` of shape ``(S, d)`` from a :meth:`factorize` factor (C = 1 or S).

        ``out``: an optional ``(S, d)`` buffer for the ``diag`` result (no fresh allocation per
        step); the other structures return ``v`` itself (``none``) or a new tensor.
        """
        raise NotImplementedError

    def solve(self, stat: Stat, ridge: float, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``(stat + ridge I)^{-1} v`` directly (Cholesky solve; used when P changes every step); ``out`` as
        in :meth:`apply`."""
        raise NotImplementedError

    @classmethod
    def of(cls, dim: int, *, blocks: tuple[slice, ...] = (), layers: tuple[KroneckerLayer, ...] = ()) -> Structure:
        """This structure for ``dim`` parameters, taking what it uses of ``blocks`` and ``layers``
        (:func:`make_structure`)."""
        return cls(dim)

    @classmethod
    def elementwise_rule(cls, strategy: str, beta: float, ridge: float) -> ElementwiseRule | None:
        """The :class:`ElementwiseRule` of this structure under ``strategy``, or ``None`` (no such rule)."""
        return None


@dataclass(frozen=True)
class Identity(Structure):
    """``P = I`` (``none``): the statistic is ``()``."""

    name: ClassVar[str] = "none"
    constant: ClassVar[bool] = True
    elementwise: ClassVar[bool] = True
    matrices: ClassVar[bool] = False

    def stat_shapes(self):
        return ()

    def _outer_sum(self, vectors):
        return ()

    def ema_update_(self, stat, v, beta):
        return stat

    def to_dense(self, stat):
        return torch.eye(self.dim).unsqueeze(0)

    def factorize(self, stat, ridge):
        return ()

    def apply(self, factor, v, out=None):
        return v

    def solve(self, stat, ridge, v, out=None):
        return v

    @classmethod
    def elementwise_rule(cls, strategy, beta, ridge):
        return IDENTITY_RULE


@dataclass(frozen=True)
class Diagonal(Structure):
    """``diag``: the statistic is ``(diag,)``, ``(C, d)``; its factor ``1 / (diag + ridge)``."""

    name: ClassVar[str] = "diag"
    elementwise: ClassVar[bool] = True
    matrices: ClassVar[bool] = False

    def stat_shapes(self):
        return ((self.dim,),)

    def _outer_sum(self, vectors):
        return ((vectors * vectors).sum(1),)

    def ema_update_(self, stat, v, beta):
        stat[0].mul_(beta).addcmul_(v, v, value=1 - beta)
        return stat

    def identity(self, batch=1, dtype=torch.float32, device=None):
        return (torch.ones(batch, self.dim, dtype=dtype, device=device),)

    def to_dense(self, stat):
        return torch.diag_embed(stat[0])

    def factorize(self, stat, ridge):
        return (1.0 / (stat[0] + ridge),)

    def apply(self, factor, v, out=None):
        return torch.mul(v, factor[0], out=out)

    def solve(self, stat, ridge, v, out=None):
        if out is None or stat[0].shape != v.shape:
            return v / (stat[0] + ridge)
        return torch.div(v, torch.add(stat[0], ridge, out=out), out=out)

    @classmethod
    def elementwise_rule(cls, strategy, beta, ridge):
        return ema_diagonal_rule(beta, ridge) if strategy == "ema" else STORED_INVERSE_RULE


@dataclass(frozen=True)
class Dense(Structure):
    """``dense``: the statistic is ``(M,)``, ``(C, d, d)``; its factor the explicit inverse of ``M + ridge I``
    from a Cholesky factorisation (positive definite for ``ridge > 0``)."""

    name: ClassVar[str] = "dense"

    def stat_shapes(self):
        return ((self.dim, self.dim),)

    def _outer_sum(self, vectors):
        return (vectors.transpose(1, 2) @ vectors,)

    def ema_update_(self, stat, v, beta):
        stat[0].baddbmm_(v.unsqueeze(-1), v.unsqueeze(-2), beta=beta, alpha=1 - beta)
        return stat

    def to_dense(self, stat):
        return stat[0]

    def factorize(self, stat, ridge):
        return (_spd_inverse(stat[0], ridge),)

    def apply(self, factor, v, out=None):
        return _batched_matvec(factor[0], v)

    def solve(self, stat, ridge, v, out=None):
        return _spd_solve(stat[0], ridge, v)


@dataclass(frozen=True)
class Blocks(Structure):
    """``block``: one ``(C, n_b, n_b)`` matrix per block; ``blocks`` are slices that tile the flat parameter
    vector, e.g. ``ParamLayout.block_slices`` (one block per layer weight and per layer bias)."""

    name: ClassVar[str] = "block"
    blocks: tuple[slice, ...] = ()

    @classmethod
    def of(cls, dim, *, blocks=(), layers=()):
        return cls(dim, tuple(blocks))

    def __post_init__(self):
        super().__post_init__()
        if not self.blocks:
            raise ValueError("a block structure needs the parameter blocks (e.g. ParamLayout.block_slices)")
        _check_tiling(self.blocks, self.dim, "the blocks", "tile the parameter vector without gaps or overlaps")

    def stat_shapes(self):
        return tuple((b.stop - b.start,) * 2 for b in self.blocks)

    def _outer_sum(self, vectors):
        return tuple(vectors[..., b].transpose(1, 2) @ vectors[..., b] for b in self.blocks)

    def ema_update_(self, stat, v, beta):
        for b, m in zip(self.blocks, stat, strict=True):
            vb = v[:, b]
            m.baddbmm_(vb.unsqueeze(-1), vb.unsqueeze(-2), beta=beta, alpha=1 - beta)
        return stat

    def to_dense(self, stat):
        out = stat[0].new_zeros(stat[0].shape[0], self.dim, self.dim)
        for b, m in zip(self.blocks, stat, strict=True):
            out[:, b, b] = m
        return out

    def factorize(self, stat, ridge):
        return tuple(_spd_inverse(m, ridge) for m in stat)

    def apply(self, factor, v, out=None):
        return torch.cat([_batched_matvec(m, v[:, b]) for b, m in zip(self.blocks, factor, strict=True)], dim=1)

    def solve(self, stat, ridge, v, out=None):
        return torch.cat([_spd_solve(m, ridge, v[:, b]) for b, m in zip(self.blocks, stat, strict=True)], dim=1)


@dataclass(frozen=True)
class KFAC(Structure):
    """``kfac``: per layer (:class:`KroneckerLayer`, from :func:`smp_core.fisher.kronecker_layers`) the pair
    ``(A, G)`` of ``(C, p, p)`` and ``(C, o, o)`` matrices, ``P`` restricted to the layer ``G (x) A``."""

    name: ClassVar[str] = "kfac"
    layers: tuple[KroneckerLayer, ...] = ()

    @classmethod
    def of(cls, dim, *, blocks=(), layers=()):
        return cls(dim, tuple(layers))

    def __post_init__(self):
        super().__post_init__()
        if not self.layers:
            raise ValueError("a kfac structure needs the layers (smp_core.fisher.kronecker_layers(model))")
        pieces = []
        for layer in self.layers:
            if layer.weight.stop - layer.weight.start != layer.n_out * layer.n_in:
                raise ValueError(f"a kfac layer's weight slice {layer.weight} does not hold "
                                 f"{layer.n_out} x {layer.n_in} entries")
            if layer.bias is not None and layer.bias.stop - layer.bias.start != layer.n_out:
                raise ValueError(f"a kfac layer's bias slice {layer.bias} does not hold {layer.n_out} entries")
            pieces += [layer.weight] + ([layer.bias] if layer.bias is not None else [])
        _check_tiling(pieces, self.dim, "the kfac layers", "cover the parameter vector without gaps or overlaps "
                      "(every parameter in a Linear or Conv2d layer)")

    def stat_shapes(self):
        return tuple((n, n) for layer in self.layers for n in (layer.n_cols, layer.n_out))

    def _outer_sum(self, vectors):
        raise ValueError("the kfac factors come from the layers' inputs and output gradients, not from "
                         "score vectors: use smp_core.fisher.estimate_fisher (kronecker_fisher)")

    def ema_update_(self, stat, v, beta):
        """``kfac`` cannot keep the EMA of ``v v^T`` as one Kronecker product per layer. It keeps
        ``e (G^ (x) A^)``, where ``e`` is the EMA of the layer's ``|M|_F^2``, with ``M`` the layer's
        piece of ``v`` as a matrix, so that ``tr P`` follows the EMA of ``|s|^2`` as ``block`` does.
        ``A^`` and ``G^`` are the EMAs of the unit-trace factors ``M^T M / |M|^2`` and
        ``M M^T / |M|^2``."""
        # Per layer the score is a matrix M = [grad W, grad b], and the EMA of M M^T (x)-wise is kept
        # as P = e (G^ (x) A^): e = EMA of |M|_F^2 (the trace, as ema-block's), A^ and G^ EMAs of the
        # unit-trace factors M^T M / |M|^2 and M M^T / |M|^2. For one example of a linear layer,
        # M = g [a, 1]^T and e G^ (x) A^ = (g g^T) (x) (a a^T), the example's own block. The pair is
        # stored as (A, G) = (A^, e G^), G (x) A unchanged: tr A = 1 and tr G = e, rebalanced first
        # (any split of a starting pair, e.g. the Fisher's factors, gives the same P).
        tiny = torch.finfo(v.dtype).tiny
        for layer, a, g in zip(self.layers, stat[0::2], stat[1::2], strict=True):
            m = layer.matrix(v)
            norm = torch.linalg.matrix_norm(m)[:, None, None]
            unit = m / norm.clamp_min(tiny)  # |unit|_F = 1 (0 for a zero score: no direction)
            trace_a = a.diagonal(dim1=1, dim2=2).sum(-1)[:, None, None].clamp_min(tiny)
            trace_g = g.diagonal(dim1=1, dim2=2).sum(-1)[:, None, None].clamp_min(tiny)
            scale = trace_g * trace_a  # e = tr(G (x) A)
            a.div_(trace_a).mul_(beta).add_(unit.transpose(1, 2) @ unit, alpha=1 - beta)
            g.div_(trace_g).mul_(beta).add_(unit @ unit.transpose(1, 2), alpha=1 - beta)
            # a zero score adds no direction: renormalise the directions to unit trace again
            a.div_(a.diagonal(dim1=1, dim2=2).sum(-1)[:, None, None].clamp_min(tiny))
            g.div_(g.diagonal(dim1=1, dim2=2).sum(-1)[:, None, None].clamp_min(tiny))
            g.mul_(scale.mul_(beta).add_(norm.square(), alpha=1 - beta))
        return stat

    def to_dense(self, stat):
        out = stat[0].new_zeros(stat[0].shape[0], self.dim, self.dim)
        for layer, a, g in zip(self.layers, stat[0::2], stat[1::2], strict=True):
            idx = layer.positions().to(out.device)
            out[:, idx[:, None], idx[None, :]] = _kronecker(g, a)
        return out

    def factorize(self, stat, ridge):
        """Per layer the eigenvectors ``U_A``, ``U_G`` of both factors and ``1 / (lambda_G lambda_A^T +
        ridge)``, so that ``(G (x) A + ridge I)^{-1}`` is applied exactly (the ridge is not split between
        the factors, as KFAC's usual damping ``(G + sqrt(ridge) I) (x) (A + sqrt(ridge) I)`` does)."""
        factor: list[torch.Tensor] = []
        for a, g in zip(stat[0::2], stat[1::2], strict=True):
            # a chain that already diverged has non-finite factors: it gets NaN (which the recursion
            # detects and reports for that chain) instead of failing the decomposition for the batch
            bad = ~(torch.isfinite(a).all((-2, -1)) & torch.isfinite(g).all((-2, -1)))
            if bool(bad.any()):
                a = torch.where(bad[:, None, None], torch.eye(a.shape[-1], dtype=a.dtype, device=a.device), a)
                g = torch.where(bad[:, None, None], torch.eye(g.shape[-1], dtype=g.dtype, device=g.device), g)
            eig_a, u_a, failed_a = _eigh_per_chain(a)
            eig_g, u_g, failed_g = _eigh_per_chain(g)
            bad = bad | failed_a | failed_g
            # both factors are positive semi-definite; rounding may leave tiny negative eigenvalues
            scale = 1.0 / (eig_g.clamp_min(0)[:, :, None] * eig_a.clamp_min(0)[:, None, :] + ridge)
            factor += [u_a, u_g, scale.masked_fill(bad[:, None, None], float("nan"))]
        return tuple(factor)

    def apply(self, factor, v, out=None):
        result = torch.empty_like(v)
        for layer, u_a, u_g, scale in zip(self.layers, factor[0::3], factor[1::3], factor[2::3], strict=True):
            _kronecker_apply(layer, u_a, u_g, scale, v, result)
        return result

    def solve(self, stat, ridge, v, out=None):
        result = torch.empty_like(v)
        for layer, a, g in zip(self.layers, stat[0::2], stat[1::2], strict=True):
            if layer.n_out * layer.n_cols <= _SMALL_KRONECKER:  # the block itself, one Cholesky solve
                block = _kronecker(g, a)
                solved = _spd_solve(block, ridge, layer.matrix(v).reshape(v.shape[0], -1))
                layer.scatter_(result, solved.reshape(v.shape[0], layer.n_out, layer.n_cols))
            else:  # two eigendecompositions of the factors
                _kronecker_apply(layer, *self.factorize((a, g), ridge), v, result)
        return result


def _check_tiling(pieces, dim: int, what: str, must: str) -> None:
    """A ``ValueError`` unless the slices ``pieces`` tile ``[0, dim)`` without gaps or overlaps."""
    position = 0
    for start, stop in sorted((b.start, b.stop) for b in pieces):
        if start != position:
            raise ValueError(f"{what} must {must}")
        position = stop
    if position != dim:
        raise ValueError(f"{what} cover {position} parameters, the model has {dim}")


STRUCTURE_TYPES: dict[str, type[Structure]] = {cls.name: cls for cls in (Identity, Diagonal, Blocks, Dense, KFAC)}
"""Every structure by its name, in the paper's order (``kfac`` beyond it)."""
STRUCTURES = tuple(STRUCTURE_TYPES)


def structure_type(name: str) -> type[Structure]:
    """The :class:`Structure` class called ``name``; a ``ValueError`` names the known ones otherwise."""
    if not isinstance(name, str) or name not in STRUCTURE_TYPES:
        raise ValueError(f"unknown preconditioner structure {name!r}; choose one of {STRUCTURES}")
    return STRUCTURE_TYPES[name]


def make_structure(name: str, dim: int, *, blocks: Sequence[slice] = (),
                   layers: Sequence[KroneckerLayer] = ()) -> Structure:
    """The structure called ``name`` for ``dim`` parameters: ``blocks`` are read by ``block`` and ``layers`` by
    ``kfac`` only (so a caller may pass a model's blocks and layers whatever the name)."""
    return structure_type(name).of(dim, blocks=tuple(blocks), layers=tuple(layers))


# A kfac layer whose block G (x) A has at most this many rows is solved with the block itself (one
# batched Cholesky, for the EMA's per-step solves); larger ones through eigendecompositions of A and G.
_SMALL_KRONECKER = 64


def _kronecker(g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``G (x) A`` for batches ``(C, o, o)`` and ``(C, p, p)``: ``(C, o p, o p)``."""
    o, p = g.shape[-1], a.shape[-1]
    return (g[:, :, None, :, None] * a[:, None, :, None, :]).reshape(g.shape[0], o * p, o * p)


def _kronecker_apply(layer: KroneckerLayer, u_a: torch.Tensor, u_g: torch.Tensor, scale: torch.Tensor,
                     v: torch.Tensor, result: torch.Tensor) -> None:
    """``(G (x) A + ridge I)^{-1}`` on one layer's piece of ``v``, from the eigenbases and the scaled
    reciprocal eigenvalues of :meth:`Structure.factorize`, written into ``result`` (C = 1 broadcasts)."""
    m = u_g.transpose(1, 2) @ layer.matrix(v) @ u_a
    layer.scatter_(result, u_g @ (m * scale) @ u_a.transpose(1, 2))


def _ridged(m: torch.Tensor, ridge: float) -> torch.Tensor:
    return m + ridge * torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)


def _eigh_per_chain(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh`` of a batch ``(C, n, n)`` and a ``(C,)`` mask of the elements it failed on.

    LAPACK's eigensolver can fail on a finite matrix, by raising (it did not converge) or, worse, by
    returning NaN without an error; one such matrix must not stop the other chains. An element that
    fails in its own precision either way is decomposed again in float64 and cast back (for a
    float64 input that can only repeat the failure; a wrong but finite result is not detected). That rescues
    the failures seen so far: in the MNIST KFAC laptop run, MKL's float32 ``eigh`` returned NaN, without
    an error, for the output-gradient factor ``G`` (128 x 128, largest entry about 7e-3, smallest
    non-zero ones 1e-31 and below, about sixty zero rows) of LeNet-5's third layer for two chains at
    a periodic recomputation; before this retry both chains were stopped as if they had diverged
    (``notebooks/mnist_kfac.md``). An element that is not finite, or fails in float64 as well (a
    chain blowing up between two divergence checks), gets the identity's decomposition and its flag:
    the caller gives that chain NaN, which the recursion reports as a divergence.
    """
    failed = torch.zeros(m.shape[0], dtype=torch.bool, device=m.device)
    try:
        values, vectors = torch.linalg.eigh(m)
        precisions = (torch.float64,)  # the batch ran: its non-finite elements go to float64
    except torch.linalg.LinAlgError:  # element by element, in the own precision first
        values, vectors = m.new_full(m.shape[:-1], float("nan")), m.new_full(m.shape, float("nan"))
        precisions = (m.dtype, torch.float64)
    retry = ~(torch.isfinite(values).all(-1) & torch.isfinite(vectors).all((-2, -1)))
    if not bool(retry.any()):
        return values, vectors, failed
    finite = torch.isfinite(m).all((-2, -1)).tolist()
    eye = torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
    for i in retry.nonzero().ravel().tolist():
        values[i], vectors[i], failed[i] = 1.0, eye, True
        for dtype in precisions if finite[i] else ():
            try:
                value, vector = torch.linalg.eigh(m[i].to(dtype))
            except torch.linalg.LinAlgError:
                continue
            if bool(torch.isfinite(value).all() and torch.isfinite(vector).all()):
                values[i], vectors[i], failed[i] = value.to(m.dtype), vector.to(m.dtype), False
                break
    return values, vectors, failed


def _cholesky_per_element(ridged: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cholesky_ex`` of a batch ``(C, n, n)`` and the ``(C,)`` mask of the elements it failed on.

    A failed element's factor is replaced by the identity: the partial factor ``cholesky_ex`` leaves
    can hold an exact zero on its diagonal (a zero pivot), on which ``cholesky_inverse`` raises for the
    whole batch; the caller redoes the failed elements anyway (:func:`_redo_failed`)."""
    chol, info = torch.linalg.cholesky_ex(ridged)
    failed = info != 0
    chol.masked_fill_(failed[:, None, None], 0.0)  # in place, no host synchronisation
    chol.diagonal(dim1=-2, dim2=-1).masked_fill_(failed[:, None], 1.0)
    return chol, failed


def _psd_inverse_float64(m: torch.Tensor, ridge: float) -> torch.Tensor:
    """``(m_+ + ridge I)^{-1}`` in float64 for one ``(n, n)`` matrix, ``m_+`` its symmetric part with the
    negative eigenvalues set to 0 (as the kfac structure treats its factors); NaN if ``m`` is not
    finite or the eigensolver fails."""
    m = m.double()
    if not bool(torch.isfinite(m).all()):
        return torch.full_like(m, float("nan"))
    try:
        values, vectors = torch.linalg.eigh(0.5 * (m + m.T))
    except torch.linalg.LinAlgError:
        return torch.full_like(m, float("nan"))
    return (vectors / (values.clamp_min(0) + ridge)) @ vectors.T


def _redo_failed(m: torch.Tensor, ridge: float, failed: torch.Tensor, result: torch.Tensor, apply) -> torch.Tensor:
    """Redo the elements of a batched solve or inverse whose Cholesky factorisation failed.

    ``P = F + ridge I`` is positive definite for a positive semi-definite ``F`` and ``ridge > 0``, but a
    float32 statistic whose largest eigenvalues dwarf the ridge can, by rounding, have negative
    eigenvalues larger than the ridge; Cholesky then fails and leaves a partial factor, from which the
    solve gives a finite, wrong answer with no error, or (at an exact zero pivot) ``cholesky_inverse``
    raises for the whole batch. :func:`_cholesky_per_element` puts the identity in place of each failed
    factor, so the batched call goes through, and each failed element ``i`` is redone in float64 from
    its eigendecomposition with the negative eigenvalues set to 0 (:func:`_psd_inverse_float64`):
    ``apply(inverse, i)`` gives its result. That is the exact inverse of the nearest positive
    semi-definite matrix to the statistic *as stored*; what float32 rounding took from the statistic
    (its smallest eigenvalues) it cannot give back: it warns, and with such a statistic keep the
    statistic in float64 (``statistic_dtype`` of :func:`build_preconditioner`) or run the chains in
    float64. A non-finite element, or a singular positive part with ``ridge = 0``, gives NaN or
    infinity, which the recursion reports as that chain's divergence (no warning). A finite float32
    element redone with a ridge warns (:data:`ROUNDED_STATISTIC_WARNING`; a chain that is diverging
    but still finite can warn too). A shared ``P`` (``C = 1``) applies to every row of ``result``.
    """
    rounded = False
    for i in failed.nonzero().ravel().tolist():
        rows = slice(None) if m.shape[0] == 1 else slice(i, i + 1)
        result[rows] = apply(_psd_inverse_float64(m[i], ridge), i).to(result.dtype)
        # rounding, not a singular statistic with no ridge or a chain that diverged already
        rounded |= m.dtype != torch.float64 and ridge > 0 and bool(torch.isfinite(result[rows]).all())
    if rounded:  # one text for every case, so that the warnings filter shows it once, not once per count
        warnings.warn(ROUNDED_STATISTIC_WARNING, RuntimeWarning, stacklevel=2)
    return result


ROUNDED_STATISTIC_WARNING = (
    "a float32 Fisher statistic came out indefinite by more than the ridge (rounding: its largest eigenvalues "
    "dwarf the ridge, or a chain is diverging); it was solved with its positive part in float64. To keep what "
    "rounding loses, build the preconditioner with statistic_dtype=torch.float64 (e.g. "
    "smp_core.preconditioners.fixed('dense', statistic_dtype=torch.float64)) or use a larger ridge")


def _spd_inverse(m: torch.Tensor, ridge: float) -> torch.Tensor:
    """``(m + ridge I)^{-1}`` for a batch ``(C, n, n)`` of symmetric positive semi-definite matrices;
    an element whose Cholesky factorisation fails is redone by :func:`_redo_failed`."""
    chol, failed = _cholesky_per_element(_ridged(m, ridge))
    result = torch.cholesky_inverse(chol)
    if bool(failed.any()):
        result = _redo_failed(m, ridge, failed, result, lambda inverse, i: inverse)
    return result


def _spd_solve(m: torch.Tensor, ridge: float, v: torch.Tensor) -> torch.Tensor:
    """``(m + ridge I)^{-1} v`` row by row: ``m`` ``(C, n, n)`` with ``C = 1`` (shared) or one per row of ``v``
    ``(S, n)``. An element whose Cholesky factorisation fails is redone by :func:`_redo_failed` (NaN for
    a chain that already diverged); it never raises for the whole batch. (Checking for a failure costs
    one host synchronisation per call on a GPU.)"""
    chol, failed = _cholesky_per_element(_ridged(m, ridge))
    result = torch.cholesky_solve(v.unsqueeze(-1), chol).squeeze(-1)
    if bool(failed.any()):
        def apply(inverse, i):
            rows = v if m.shape[0] == 1 else v[i : i + 1]
            return rows.double() @ inverse  # symmetric

        result = _redo_failed(m, ridge, failed, result, apply)
    return result


def _batched_matvec(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if m.shape[0] == 1:
        return v @ m[0]  # symmetric: v P^{-1} = (P^{-1} v^T)^T
    # symmetric, so P v = (v^T P)^T; the row form is the faster bmm (see models._row_times_transposed)
    return torch.bmm(v.unsqueeze(1), m).squeeze(1)


# ---------------------------------------------------------------------------------------------
# Temporal strategies
# ---------------------------------------------------------------------------------------------


class PreconditionerState(NamedTuple):
    """What a preconditioner carries between steps."""

    stat: Stat  # current Fisher statistic (without ridge)
    factor: Stat  # factor for apply() (fixed / periodic), () otherwise

    def of_chain(self, chain: int) -> PreconditionerState:
        """The state of one chain alone: each tensor with one row per chain cut to ``[chain : chain + 1]``,
        a tensor shared by all chains (leading size 1) kept as it is. For instance the ``P`` a chain
        ends a run with (``SMPResult.precond_state.of_chain(i)``), for a computation that takes one ``P``
        for all its inputs. A state shared by all chains (every tensor of leading size 1, or none) is every
        chain's: it comes back as it is."""
        sizes = {t.shape[0] for t in (*self.stat, *self.factor) if isinstance(t, torch.Tensor) and t.ndim > 0}
        chains = max(sizes, default=1)
        if isinstance(chain, bool) or not isinstance(chain, int) or (chains > 1 and not -chains <= chain < chains):
            raise ValueError(f"chain must be an integer index of one of the state's {chains} chains, got {chain!r}")
        if chains == 1:
            return self
        chain %= chains

        def cut(parts: Stat) -> Stat:
            return tuple(t[chain : chain + 1] if isinstance(t, torch.Tensor) and t.ndim > 0 and t.shape[0] > 1
                         else t for t in parts)

        return PreconditionerState(cut(self.stat), cut(self.factor))


@dataclass(frozen=True)
class ElementwiseRule:
    """The step ``theta += gamma P^{-1} s`` of a preconditioner whose ``P^{-1}`` acts entry by entry,
    as an in-place rule on matching pieces of the parameters, the score and the state.

    * ``tensors(state)``: the ``(C, d)`` state tensors the rule reads (and, when ``covers_update``,
      writes), ``C`` = 1 (shared by the chains) or ``S``;
    * ``apply_(theta_part, score_part, parts, gamma)``: the step on one piece, with ``parts`` the
      matching pieces of ``tensors(state)`` (rows of length 1 broadcast over the chains);
    * ``apply_outer_(theta_part, delta, h, parts, gamma)`` (optional): the same for a score piece
      given as the outer products ``delta_b h_b^T`` of a linear layer, without forming them;
    * ``covers_update``: ``True`` when ``apply_`` also folds the score into the state (EMA), so the
      recursion does not call ``update`` after a step made by the rule. Such a rule needs one state
      row per chain (``C = S``). When it is ``False``, ``update`` must not read the score: after a
      step by the rule the recursion passes ``None`` for it (the score was never formed).

    Any piece of the vector gives the same numbers as the whole vector at once: the recursion may
    cut the parameters by layer and by chains however suits the memory hierarchy. ``gamma`` is a
    Python float, or a 0-d tensor on the parameters' device in the recursion's step blocks (a CUDA
    graph replays the same kernels with a new step size each step, so it cannot bake in a float);
    the built-in rules take both, and give the same numbers up to rounding.
    """

    tensors: Callable[[PreconditionerState], tuple[torch.Tensor, ...]]
    apply_: Callable[[torch.Tensor, torch.Tensor, Sequence[torch.Tensor], float | torch.Tensor], None]
    apply_outer_: (Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[torch.Tensor],
                             float | torch.Tensor], None] | None) = None
    covers_update: bool = False
    kernel: tuple | None = None
    """What the rule is, for a compiled kernel that implements it natively (``("ema", beta, ridge)``)."""


def _identity_step_(theta: torch.Tensor, score: torch.Tensor, parts, gamma: float | torch.Tensor) -> None:
    if isinstance(gamma, torch.Tensor):
        theta.add_(score * gamma)
    else:
        theta.add_(score, alpha=gamma)


def _identity_outer_step_(theta: torch.Tensor, delta: torch.Tensor, h: torch.Tensor, parts,
                          gamma: float | torch.Tensor) -> None:
    # one pass, the outer product never formed; a tensor gamma scales the small factor delta
    if isinstance(gamma, torch.Tensor):
        theta.addcmul_((delta * gamma).unsqueeze(-1), h.unsqueeze(-2))
    else:
        theta.addcmul_(delta.unsqueeze(-1), h.unsqueeze(-2), value=gamma)


def _scaled_step_(theta: torch.Tensor, score: torch.Tensor, parts, gamma: float | torch.Tensor) -> None:
    if isinstance(gamma, torch.Tensor):
        theta.addcmul_(score * gamma, parts[0])
    else:
        theta.addcmul_(score, parts[0], value=gamma)


IDENTITY_RULE = ElementwiseRule(tensors=lambda state: (), apply_=_identity_step_, apply_outer_=_identity_outer_step_)
"""``P = I`` (``none``)."""

STORED_INVERSE_RULE = ElementwiseRule(tensors=lambda state: (state.factor[0],), apply_=_scaled_step_)
"""A stored diagonal ``P^{-1} = 1 / (F + lambda)`` (fixed and periodic ``diag``)."""


def ema_diagonal_rule(beta: float, ridge: float) -> ElementwiseRule:
    """EMA ``diag``: ``theta += gamma s / (I_k + lambda)``, then ``I_{k+1} = beta I_k + (1 - beta) s^2``.

    The step uses the statistic before ``s_k`` is folded in, so ``P_k`` stays ``F_{k-1}``-measurable.
    """

    def apply_(theta: torch.Tensor, score: torch.Tensor, parts, gamma: float | torch.Tensor) -> None:
        (stat,) = parts
        if isinstance(gamma, torch.Tensor):
            theta.addcdiv_(score * gamma, stat + ridge)
        else:
            theta.addcdiv_(score, stat + ridge, value=gamma)
        stat.mul_(beta).addcmul_(score, score, value=1 - beta)

    return ElementwiseRule(tensors=lambda state: (state.stat[0],), apply_=apply_, covers_update=True,
                          kernel=("ema", beta, ridge))


@dataclass(frozen=True)
class MatrixRule:
    """The step ``theta += gamma P^{-1} s`` of a ``block`` or ``dense`` preconditioner, one symmetric matrix per
    block of the structure, applied to the whole score (not piece by piece, as an :class:`ElementwiseRule` is):

    * fixed and periodic (``ema=None``): ``P^{-1}`` stored, ``tensors`` the factor (each ``(C, n, n)``);
    * EMA (``ema=(beta, ridge)``): ``tensors`` the statistic (each ``(S, n, n)``); the step solves with
      ``I_k + ridge I``, then folds the score in, ``I_{k+1} = beta I_k + (1 - beta) s s^T`` (``covers_update``).

    ``kernel`` (``("matrices", blocks)`` or ``("ema-matrices", beta, ridge, blocks)``, ``blocks`` the
    ``(start, size)`` of each matrix) tells a compiled kernel what to do; ``None`` when the blocks are not in
    the order of the parameters."""

    structure: Structure
    ema: tuple[float, float] | None = None

    @property
    def covers_update(self) -> bool:
        return self.ema is not None

    def tensors(self, state: PreconditionerState) -> tuple[torch.Tensor, ...]:
        return tuple(state.stat if self.ema is not None else state.factor)

    def apply_(self, theta: torch.Tensor, score: torch.Tensor, parts, gamma: float | torch.Tensor) -> None:
        if self.ema is None:
            step = self.structure.apply(tuple(parts), score)
        else:
            step = self.structure.solve(tuple(parts), self.ema[1], score)
        if isinstance(gamma, torch.Tensor):
            theta.add_(step * gamma)
        else:
            theta.add_(step, alpha=gamma)
        if self.ema is not None:
            self.structure.ema_update_(tuple(parts), score, self.ema[0])

    @property
    def kernel(self) -> tuple | None:
        slices = self.structure.blocks if isinstance(self.structure, Blocks) else (slice(0, self.structure.dim),)
        starts = [b.start for b in slices]
        if starts != sorted(starts):
            return None
        blocks = tuple((b.start, b.stop - b.start) for b in slices)
        return ("matrices", blocks) if self.ema is None else ("ema-matrices", *self.ema, blocks)


@dataclass(frozen=True)
class Preconditioner:
    """A structure combined with a temporal strategy and their settings (Section 3.1.1): plain data,
    picklable, with the pure functions the recursion calls as methods (optax's ``init`` / ``update``).

    Build one with :func:`none`, :func:`fixed`, :func:`ema` or :func:`periodic` (or
    :func:`preconditioner_from_name`); :func:`~smp_core.recursion.run_smp` binds a structure given by name to
    the model's layout (``structure_for``).

    * ``init(theta0, curvature) -> state``: ``theta0`` ``(S, d)``; ``curvature(theta)`` returns the
      Fisher statistic at parameters ``theta`` ``(C, d)`` over the preconditioner's data set.
    * ``update(state, k, theta_k, s_k, curvature) -> state``: called after step ``k`` with the new
      parameters and the score just used, so that ``P_{k+1}`` is ``F_k``-measurable.
    * ``solve(state, v, out=None) -> P^{-1} v`` for ``v`` ``(S, d)``; ``out``, an optional buffer
      that is not ``v``, may receive the result (the caller must use the returned tensor).
    * ``elementwise``: for ``none`` and every ``diag``, an :class:`ElementwiseRule` that performs the
      step (and, for EMA, the update) on any piece of the parameter vector, so the recursion never
      forms the ``(S, d)`` score (``elementwise_step=False`` turns that fast path off).
    * ``block_rule``: the element-wise rule, or for ``block`` and ``dense`` a :class:`MatrixRule`: what a
      block of whole steps applies.
    * ``update_every``: ``0`` when ``update`` never changes the state (``none``, ``fixed``), ``T``
      for ``periodic``, ``None`` for the EMA (any step): what lets the recursion run blocks of steps.
    """

    structure: Structure | str
    strategy: str = "fixed"
    ridge: float = 1e-4
    beta: float = 0.98
    period: int = 500
    ema_init: str = "fisher"
    ema_refresh: int = 1
    statistic_dtype: torch.dtype | None = None
    elementwise_step: bool = True

    @property
    def name(self) -> str:
        return name_of(self.structure_name, self.strategy)

    @property
    def structure_type(self) -> type[Structure]:
        """The structure's class (known before the structure is bound to a model)."""
        return structure_type(self.structure) if isinstance(self.structure, str) else type(self.structure)

    @property
    def structure_name(self) -> str:
        return self.structure_type.name

    @property
    def needs_curvature(self) -> bool:
        return not self.structure_type.constant and not (self.strategy == "ema" and self.ema_init == "identity")

    @property
    def hyper(self) -> dict[str, Any]:
        """The settings that define it, as a run's config records them."""
        if self.structure_type.constant:
            return {}
        hyper: dict[str, Any] = {"ridge": self.ridge}
        if self.statistic_dtype is not None:
            hyper["statistic_dtype"] = str(self.statistic_dtype).removeprefix("torch.")
        if self.strategy == "periodic":
            hyper["period"] = self.period
        if self.strategy == "ema":
            hyper.update(beta=self.beta, ema_init=self.ema_init)
            if self.ema_refresh > 1:
                hyper["ema_refresh"] = self.ema_refresh
        return hyper

    @property
    def update_every(self) -> int | None:
        if self.structure_type.constant or self.strategy == "fixed":
            return 0
        return self.period if self.strategy == "periodic" else None

    @property
    def elementwise(self) -> ElementwiseRule | None:
        if not self.elementwise_step:
            return None
        return self.structure_type.elementwise_rule(self.strategy, self.beta, self.ridge)

    @property
    def block_rule(self) -> ElementwiseRule | MatrixRule | None:
        """The rule a block of steps applies (:mod:`smp_core.fast_paths`): the ``elementwise`` one, else, for
        ``block`` and ``dense`` with the statistic in the chains' dtype (fixed, periodic, and the EMA that
        factorises at every step), a :class:`MatrixRule`; ``None`` otherwise (and when ``elementwise_step=False``)."""
        rule = self.elementwise
        if rule is not None or not self.elementwise_step or isinstance(self.structure, str):
            return rule
        if self.statistic_dtype is not None or type(self.structure) not in (Blocks, Dense):
            return None
        if self.strategy in ("fixed", "periodic"):
            return MatrixRule(self.structure)
        if self.strategy == "ema" and self.ema_refresh == 1:
            return MatrixRule(self.structure, (self.beta, self.ridge))
        return None

    def _bound(self) -> Structure:
        if isinstance(self.structure, str):
            raise ValueError(f"the '{self.name}' preconditioner is not bound to a model yet: run_smp binds it "
                             "(or pass structure=smp_core.fisher.structure_for(model, name))")
        return self.structure

    def _kept(self, stat: Stat) -> Stat:
        """The statistic in ``statistic_dtype``."""
        return stat if self.statistic_dtype is None else tuple(m.to(self.statistic_dtype) for m in stat)

    def _fisher(self, curvature: Curvature | None, theta: torch.Tensor) -> Stat:
        if curvature is None:
            raise ValueError(f"the {self.name} preconditioner needs a Fisher estimate over a data set (curvature)")
        return self._kept(curvature(theta))

    def init(self, theta0: torch.Tensor, curvature: Curvature | None) -> PreconditionerState:
        struct = self._bound()
        if struct.constant:
            return PreconditionerState((), ())
        if self.strategy in ("fixed", "periodic"):
            stat = self._fisher(curvature, _shared_theta(theta0))
            return PreconditionerState(stat, struct.factorize(stat, self.ridge))
        n_chains = theta0.shape[0]  # EMA: I_1 is the Fisher at theta_0 or the identity, one row per chain
        if self.ema_init == "identity":
            stat = struct.identity(n_chains, self.statistic_dtype or theta0.dtype, theta0.device)
        else:
            stat = self._fisher(curvature, _shared_theta(theta0))
            stat = tuple(m.expand(n_chains, *m.shape[1:]).clone() for m in stat)
        return PreconditionerState(stat, struct.factorize(stat, self.ridge) if self.ema_refresh > 1 else ())

    def update(self, state: PreconditionerState, k: int, theta: torch.Tensor, score: torch.Tensor | None,
               curvature: Curvature | None) -> PreconditionerState:
        struct = self._bound()
        if struct.constant or self.strategy == "fixed":
            return state
        if self.strategy == "periodic":
            if k % self.period != 0:
                return state
            stat = self._fisher(curvature, theta)
            return PreconditionerState(stat, struct.factorize(stat, self.ridge))
        # EMA: I_{k+1} = beta I_k + (1 - beta) s_k s_k^T, applied after step k
        kept = score if self.statistic_dtype is None else score.to(self.statistic_dtype)
        stat = struct.ema_update_(state.stat, kept, self.beta)
        if self.ema_refresh > 1:  # the statistic every step; its factorisation every ema_refresh steps
            return PreconditionerState(stat, struct.factorize(stat, self.ridge) if k % self.ema_refresh == 0
                                       else state.factor)
        return PreconditionerState(stat, ())

    def solve(self, state: PreconditionerState, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        struct = self._bound()
        if struct.constant:
            return v
        own = v.dtype
        if self.statistic_dtype is not None:  # solve in the statistic's dtype, return in v's
            v, out = v.to(self.statistic_dtype), None
        if self.strategy == "ema" and self.ema_refresh == 1:
            result = struct.solve(state.stat, self.ridge, v, out)
        else:
            result = struct.apply(state.factor, v, out)
        return result.to(own)

    def dense_matrix(self, state: PreconditionerState) -> torch.Tensor:
        """``P`` itself, ``(C, d, d)``, ridge included (for tests and inspection)."""
        struct = self._bound()
        if struct.constant:
            return struct.to_dense(())
        m = struct.to_dense(state.stat)
        return m + self.ridge * torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)


def _shared_theta(theta0: torch.Tensor) -> torch.Tensor:
    """``theta0[:1]`` when every chain starts at the same point (one shared Fisher), else ``theta0``."""
    if theta0.shape[0] > 1 and bool((theta0 == theta0[:1]).all()):
        return theta0[:1]
    return theta0


def _checked(structure: Structure | str, strategy: str, *, ridge=1e-4, beta=0.98, period=500, ema_init="fisher",
             ema_refresh=1, statistic_dtype=None) -> Preconditioner:
    """A :class:`Preconditioner` with every setting checked (a ``ValueError`` names the bad one), even
    the settings its strategy does not use."""
    if not isinstance(structure, str | Structure):
        raise TypeError(f"structure must be one of {STRUCTURES} (or a bound Structure), got {structure!r}")
    kind = structure_type(structure) if isinstance(structure, str) else type(structure)
    name = kind.name
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown temporal strategy {strategy!r}; choose one of {STRATEGIES}")
    try:
        ridge_value = float("nan") if isinstance(ridge, str) else float(ridge)  # a numpy scalar or 0-d tensor too
    except (TypeError, ValueError, RuntimeError):
        ridge_value = float("nan")
    if isinstance(ridge, bool) or not (math.isfinite(ridge_value) and ridge_value >= 0):
        raise ValueError(f"the ridge lambda must be a finite number >= 0, got {ridge!r}")
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0 < beta < 1:
        raise ValueError(f"the EMA weight beta must lie in (0, 1), got {beta!r}")
    for what, value in (("the period T", period), ("ema_refresh (steps between factorisations)", ema_refresh)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or int(value) != value or value < 1:
            raise ValueError(f"{what} must be a positive integer, got {value!r}")
    if ema_init not in ("fisher", "identity"):
        raise ValueError(f"ema_init must be 'fisher' or 'identity', got {ema_init!r}")
    statistic_dtype = _as_statistic_dtype(statistic_dtype, kind)
    if ema_refresh > 1 and not (kind.matrices and strategy == "ema"):
        raise ValueError(f"ema_refresh = {ema_refresh} applies to the EMA of block, dense and kfac only, not to "
                         f"'{name_of(name, strategy)}'" + (": the diagonal EMA's solve is element-wise and exact at "
                                                          "every step" if _diagonal(kind) else ""))
    if kind.constant:
        ridge_value = 0.0
    return Preconditioner(structure, strategy, ridge_value, float(beta), int(period), ema_init, int(ema_refresh),
                          statistic_dtype)


def none() -> Preconditioner:
    """``P = I``: the plain recursion (SMP-none)."""
    return _checked("none", "fixed")


def fixed(structure: str, *, ridge: float = 1e-4, statistic_dtype: torch.dtype | str | None = None) -> Preconditioner:
    """``P = I_hat(theta_0) + lambda I``: the Fisher at the start over a data set, once (``SMP-fixed-<structure>``)."""
    return _checked(structure, "fixed", ridge=ridge, statistic_dtype=statistic_dtype)


def ema(structure: str, *, beta: float = 0.98, ridge: float = 1e-4, init: str = "fisher", refresh: int = 1,
        statistic_dtype: torch.dtype | str | None = None) -> Preconditioner:
    """``I_{k+1} = beta I_k + (1 - beta) s_k s_k^T`` from the chain's own scores (``SMP-ema-<structure>``); ``init``:
    ``I_1`` is the Fisher at theta_0 (``"fisher"``) or the identity; ``refresh``: factorise every so
    many steps (block, dense and kfac; see :func:`build_preconditioner`)."""
    return _checked(structure, "ema", ridge=ridge, beta=beta, ema_init=init, ema_refresh=refresh,
                    statistic_dtype=statistic_dtype)


def periodic(structure: str, *, period: int = 500, ridge: float = 1e-4,
             statistic_dtype: torch.dtype | str | None = None) -> Preconditioner:
    """The Fisher recomputed every ``period`` steps at each chain's current theta (``SMP-periodic-<structure>``)."""
    return _checked(structure, "periodic", ridge=ridge, period=period, statistic_dtype=statistic_dtype)


def build_preconditioner(
    structure: str,
    strategy: str | None = None,
    *,
    dim: int | None = None,
    blocks: Sequence[slice] = (),
    layers: Sequence[KroneckerLayer] = (),
    ridge: float = 1e-4,
    beta: float = 0.98,
    period: int = 500,
    ema_init: str = "fisher",
    ema_refresh: int = 1,
    statistic_dtype: torch.dtype | str | None = None,
) -> Preconditioner:
    """Compose a structure with a temporal strategy (Section 3.1.1), every setting checked.

    Args:
        structure: ``"none"``, ``"diag"``, ``"block"``, ``"dense"`` or ``"kfac"``.
        strategy: ``"fixed"``, ``"ema"`` or ``"periodic"`` (ignored, and may be omitted, for ``none``).
        dim: number of parameters ``d``; ``None`` leaves the structure unbound (``run_smp`` binds it
            to the model).
        blocks: the parameter blocks for ``block`` (``ParamLayout.block_slices``).
        layers: the layers for ``kfac`` (:func:`smp_core.fisher.kronecker_layers`). Its EMA folds in
            the Kronecker factors of each step's score (see :meth:`Structure.ema_update_`) and solves
            with every layer and chain at every step: by a Cholesky factorisation of the block
            ``G (x) A`` itself when it is small, else by eigendecompositions of both factors.
        ridge: ``lambda`` added to the diagonal (the paper: 1e-4).
        beta: EMA weight (the paper: 0.98).
        period: ``T``, steps between recomputations for ``periodic`` (the paper: 500).
        ema_init: starting value ``I_hat_1`` of the EMA, which the paper leaves open:
            ``"fisher"`` (the Fisher at theta_0 over the data set, as the fixed strategy uses;
            the default) or ``"identity"``.
        ema_refresh: beyond the paper, for the EMA of ``block``, ``dense`` and ``kfac``: factorise the
            statistic only every so many steps and solve with the last factorisation in between
            (1, the default: the paper's rule). A factorisation from an earlier step is still known
            before the step that uses it, so the martingale property holds; it saves the per-step
            eigendecompositions that make ``ema-kfac`` slow for LeNet-5's large layers.
        statistic_dtype: beyond the paper, for ``block``, ``dense`` and ``kfac``: keep the statistic
            and its factorisation in this dtype (e.g. ``torch.float64``) while the chains run in theirs;
            ``None``: the chains' dtype. In float32 a statistic loses eigenvalues below about ``1e-7``
            times its largest to rounding; where that exceeds the ridge a ``block`` or ``dense`` ``P``
            can come out indefinite and its factorisation warns (:func:`_redo_failed`); ``kfac`` sets
            negative eigenvalues to 0 without a warning. The cost of float64:
            ``benchmarks/bench_statistic_dtype.py``. A run whose chains are in this dtype already
            records nothing (the default's config and checkpoints).

    Returns:
        A :class:`Preconditioner`.
    """
    if strategy is None and isinstance(structure, str) and structure_type(structure).constant:
        strategy = "fixed"
    struct: Structure | str = structure
    if dim is not None and isinstance(structure, str):
        struct = make_structure(structure, dim, blocks=blocks, layers=layers)
    return _checked(struct, strategy, ridge=ridge, beta=beta, period=period, ema_init=ema_init,
                    ema_refresh=ema_refresh, statistic_dtype=statistic_dtype)


def statistic_dtype_of(dtype: torch.dtype | str | None, name: str = "statistic_dtype") -> torch.dtype | None:
    """``None``, ``torch.float32`` or ``torch.float64`` (or the name of one, ``"float64"``), checked; a
    ``ValueError`` naming ``name`` otherwise."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "float64": torch.float64}.get(dtype.removeprefix("torch."), dtype)
    if not isinstance(dtype, torch.dtype) or dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{name} must be torch.float32, torch.float64 or None, got {dtype!r}")
    return dtype


def _diagonal(kind: type[Structure]) -> bool:
    """An element-wise structure with a statistic (``diag``): the reason given when a matrix setting is refused."""
    return kind.elementwise and not kind.constant


def _as_statistic_dtype(dtype: torch.dtype | str | None, kind: type[Structure]) -> torch.dtype | None:
    """``statistic_dtype`` checked (:func:`statistic_dtype_of`), for a structure whose statistic holds
    matrices (``block``, ``dense``, ``kfac``) only."""
    dtype = statistic_dtype_of(dtype)
    if dtype is None:
        return None
    if not kind.matrices:
        raise ValueError(f"statistic_dtype applies to the block, dense and kfac structures, not to {kind.name!r}"
                         + (": a diagonal statistic is a sum of squares, which rounding cannot make negative, "
                            "and its element-wise step runs in the chains' dtype" if _diagonal(kind) else ""))
    return dtype


def name_of(structure: str, strategy: str | None) -> str:
    """The variant name of a structure and strategy: ``"none"`` or ``"<strategy>-<structure>"``."""
    return structure if structure_type(structure).constant else f"{strategy}-{structure}"


def ema_refresh_applies(name: str) -> bool:
    """Whether ``ema_refresh`` (see :func:`build_preconditioner`) means anything for the variant ``name``:
    the EMA of ``block``, ``dense`` and ``kfac``, not the diagonal EMA (element-wise, exact at every step)."""
    strategy, structure = parse_preconditioner_name(name)
    return strategy == "ema" and structure_type(structure).matrices


def parse_preconditioner_name(name: str) -> tuple[str | None, str]:
    """``(strategy, structure)`` of a variant name of the paper's tables (``"none"`` -> ``(None, "none")``,
    ``"SMP-ema-block"`` -> ``("ema", "block")``), checked without building anything: a ``ValueError`` names
    what is wrong, as :func:`build_preconditioner` would."""
    if not isinstance(name, str):
        raise TypeError(f"a preconditioner's name must be a string such as 'fixed-diag', got {type(name).__name__}")
    name = name.removeprefix("SMP-")
    if name == "none":
        return None, "none"
    parts = name.split("-")
    if len(parts) != 2:
        raise ValueError(f"unknown preconditioner {name!r}: use 'none' or '<strategy>-<structure>' with "
                         f"strategy in {STRATEGIES} and structure in {STRUCTURES[1:]}")
    strategy, structure = parts
    if structure not in STRUCTURES:
        raise ValueError(f"unknown preconditioner structure {structure!r}; choose one of {STRUCTURES}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown temporal strategy {strategy!r}; choose one of {STRATEGIES}")
    return strategy, structure


def preconditioner_from_name(name: str, **kwargs) -> Preconditioner:
    """Build from a variant name of the paper's tables: ``"none"``, ``"ema-block"``, ``"fixed-diag"``, ..."""
    strategy, structure = parse_preconditioner_name(name)
    if strategy is None:
        return build_preconditioner("none", **kwargs)
    return build_preconditioner(structure, strategy, **kwargs)
