"""An independent JAX implementation of the toy recursion, the reference ``run_smp`` is timed against.

The toy example of Section 3.2 of the paper: the 2-3-2-1 network with tanh-approximated GELU (d = 20, the
parameters in ``smp_core.toy_mlp``'s order: W1 (3 x 2, row-major), b1, W2 (2 x 3), b2, W3 (1 x 2), b3), a
Bernoulli likelihood and the empirical design. Each of S chains steps, for k = 1, ..., K,

    X_k drawn from the N training inputs,  Y_k ~ Bernoulli(sigmoid(g(X_k; theta))),
    s_k = (Y_k - sigmoid(g)) grad_theta g(X_k; theta),  theta_k = theta_{k-1} + tau / (N + k) P_k^{-1} s_k,

with ``P = I_hat + lambda I`` (``none``: ``P = I``) of one structure, ``diag``, ``block`` (one block per layer
weight and per layer bias) or ``dense``, and one strategy: ``fixed`` (the model-expected Fisher
``(1/N) sum_i p_i (1 - p_i) grad g_i grad g_i^T`` at theta_0), ``ema`` (per chain, I_1 that Fisher, then
``I_{k+1} = beta I_k + (1 - beta) s_k s_k^T`` on the structure's entries) or ``periodic`` (the Fisher at
each chain's theta_k after every T-th step).

Written from the paper and the docstrings of ``smp_core``, whose code it does not import: it draws its own
random numbers (``jax.random``), so it agrees with ``run_smp`` in distribution, not draw for draw
(``tests/book/test_jax_reference.py`` compares the two within Monte Carlo error). How it runs: the
covariates and uniforms of a chunk of steps are drawn at once and the chunk runs as one compiled
``lax.scan`` (a chunk is T steps for ``periodic``, so that the Fisher is recomputed between chunks);
``fixed`` and ``periodic`` invert each block once per Fisher; ``ema`` solves its blocks at every step by a
Cholesky factorisation unrolled over the entries of a block, each entry a vector over the chains (the statistic
is held as ``(n, n, S)`` per block, the chains last), so that the compiled step makes no per-chain LAPACK call.
No divergence checks: a chain that leaves the finite numbers stays NaN, and :func:`run` counts such chains.
"""

from __future__ import annotations

import math
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = ((3, 2), (3,), (2, 3), (2,), (1, 2), (1,))
SIZES = tuple(math.prod(s) for s in SHAPES)
DIM = sum(SIZES)
STRUCTURES = ("none", "diag", "block", "dense")
STRATEGIES = ("fixed", "ema", "periodic")
CHUNK = 1000  # steps per compiled scan (fixed, ema; periodic: T)


def _blocks(structure: str) -> tuple[tuple[int, int], ...]:
    """``(start, size)`` of each block: one per layer weight and bias, or the whole vector."""
    if structure == "dense":
        return ((0, DIM),)
    starts = np.cumsum((0,) + SIZES[:-1])
    return tuple((int(a), n) for a, n in zip(starts, SIZES, strict=True))


def logit(theta: jax.Array, x: jax.Array) -> jax.Array:
    """The network's output ``g(x; theta)`` for one input ``x`` ``(2,)``."""
    parts, start = [], 0
    for shape, size in zip(SHAPES, SIZES, strict=True):
        parts.append(theta[start:start + size].reshape(shape))
        start += size
    w1, b1, w2, b2, w3, b3 = parts
    h = jax.nn.gelu(w1 @ x + b1, approximate=True)
    h = jax.nn.gelu(w2 @ h + b2, approximate=True)
    return (w3 @ h + b3)[0]


_value_and_grad = jax.vmap(jax.value_and_grad(logit))  # over chains: theta (S, d), x (S, 2)


@jax.jit
def fisher(theta: jax.Array, x: jax.Array) -> jax.Array:
    """The model-expected Fisher ``(d, d)`` at one ``theta`` over the inputs ``x`` ``(N, 2)``."""
    eta, grads = jax.vmap(jax.value_and_grad(logit), in_axes=(None, 0))(theta, x)
    p = jax.nn.sigmoid(eta)
    return (grads * (p * (1 - p))[:, None]).T @ grads / x.shape[0]


@partial(jax.jit, static_argnames=("structure",))
def _statistic(matrix: jax.Array, structure: str):
    """The structure's entries of ``matrix`` ``(C, d, d)``: the diagonal ``(C, d)``, or one ``(C, n, n)`` per block."""
    if structure == "diag":
        return jnp.diagonal(matrix, axis1=-2, axis2=-1)
    return tuple(matrix[:, a:a + n, a:a + n] for a, n in _blocks(structure))


@partial(jax.jit, static_argnames=("structure", "ridge"))
def _inverse(stat, structure: str, ridge: float):
    """What ``fixed`` and ``periodic`` apply: ``1 / (diag + lambda)``, or each block's inverse."""
    if structure == "diag":
        return 1.0 / (stat + ridge)
    return tuple(jnp.linalg.inv(m + ridge * jnp.eye(m.shape[-1], dtype=m.dtype)) for m in stat)


def _apply(inverse, structure: str, s: jax.Array) -> jax.Array:
    if structure == "diag":
        return inverse * s
    parts = [jnp.einsum("cij,cj->ci", m, s[:, a:a + n]) for m, (a, n) in zip(inverse, _blocks(structure),
                                                                                strict=True)]
    return jnp.concatenate(parts, axis=1)


def _cholesky_solve(m: jax.Array, ridge: float, s: jax.Array) -> jax.Array:
    """``(m + lambda I)^{-1} s`` for every chain: ``m`` ``(n, n, S)`` (its lower triangle is read), ``s`` ``(n, S)``;
    the Cholesky factor, then the two triangular solves, written out entry by entry on vectors over the chains."""
    n = m.shape[0]
    low = {}
    for j in range(n):
        low[j, j] = jnp.sqrt(m[j, j] + ridge - sum((low[j, k] ** 2 for k in range(j)), 0.0))
        for i in range(j + 1, n):
            low[i, j] = (m[i, j] - sum((low[i, k] * low[j, k] for k in range(j)), 0.0)) / low[j, j]
    y = []
    for i in range(n):
        y.append((s[i] - sum((low[i, k] * y[k] for k in range(i)), 0.0)) / low[i, i])
    x = [None] * n
    for i in reversed(range(n)):
        x[i] = (y[i] - sum((low[k, i] * x[k] for k in range(i + 1, n)), 0.0)) / low[i, i]
    return jnp.stack(x)


def _solve(stat, structure: str, ridge: float, s: jax.Array) -> jax.Array:
    """``(I_hat + lambda I)^{-1} s`` per chain, for the EMA's statistic of this step (``s`` ``(S, d)``)."""
    if structure == "diag":
        return s / (stat + ridge)
    lanes = s.T  # (d, S): the chains last, as the statistic holds them
    return jnp.concatenate([_cholesky_solve(m, ridge, lanes[a:a + n]) for m, (a, n)
                            in zip(stat, _blocks(structure), strict=True)]).T


def _ema_update(stat, structure: str, beta: float, s: jax.Array):
    if structure == "diag":
        return beta * stat + (1 - beta) * s * s
    lanes = s.T
    return tuple(beta * m + (1 - beta) * lanes[a:a + n, None] * lanes[None, a:a + n]
                 for m, (a, n) in zip(stat, _blocks(structure), strict=True))


@partial(jax.jit, static_argnames=("structure", "strategy", "n_steps", "tau", "ridge", "beta", "n_obs"))
def _chunk(theta, held, first, key, x_train, *, structure, strategy, n_steps, tau, ridge, beta, n_obs):
    """Steps ``first, ..., first + n_steps - 1`` of every chain; ``held`` is the EMA's statistic, the inverse
    of ``fixed`` and ``periodic``, or ``()``."""
    n_chains = theta.shape[0]
    k_idx, k_u = jax.random.split(key)
    rows = jax.random.randint(k_idx, (n_steps, n_chains), 0, x_train.shape[0])
    uniforms = jax.random.uniform(k_u, (n_steps, n_chains), dtype=theta.dtype)

    def step(carry, inputs):
        theta, held, k = carry
        row, u = inputs
        eta, grads = _value_and_grad(theta, x_train[row])
        p = jax.nn.sigmoid(eta)
        s = ((u < p).astype(theta.dtype) - p)[:, None] * grads
        if structure == "none":
            direction = s
        elif strategy == "ema":
            direction = _solve(held, structure, ridge, s)
            held = _ema_update(held, structure, beta, s)
        else:
            direction = _apply(held, structure, s)
        return (theta + (tau / (n_obs + k)) * direction, held, k + 1), None

    (theta, held, _), _ = jax.lax.scan(step, (theta, held, first.astype(theta.dtype)), (rows, uniforms))
    return theta, held


_fisher_per_chain = jax.jit(jax.vmap(fisher, in_axes=(0, None)))


def run(variant: str, x_train, theta0, *, tau: float, n_steps: int, n_chains: int, seed: int,
        ridge: float = 1e-4, beta: float = 0.98, period: int = 500) -> dict:
    """``variant`` (``"none"`` or ``"<strategy>-<structure>"``) from ``theta0`` ``(d,)`` on ``x_train`` ``(N, 2)``:
    ``{"theta": (S, d) numpy array, "non_finite": chains that left the finite numbers, "seconds": wall time,
    "held": what step K + 1 would use}`` (the EMA's statistic; the inverse of ``fixed`` and ``periodic``, which
    recomputes after step K as well when T divides K, as ``run_smp`` does)."""
    structure = variant if variant == "none" else variant.split("-", 1)[1]
    strategy = "fixed" if variant == "none" else variant.split("-", 1)[0]
    if structure not in STRUCTURES or strategy not in STRATEGIES:
        raise ValueError(f"variant: 'none' or '<{'|'.join(STRATEGIES)}>-<{'|'.join(STRUCTURES[1:])}>', got {variant!r}")
    started = time.perf_counter()
    x = jnp.asarray(np.asarray(x_train, dtype=np.float32))
    theta = jnp.broadcast_to(jnp.asarray(np.asarray(theta0, dtype=np.float32)), (n_chains, DIM))
    settings = dict(structure=structure, strategy=strategy, tau=float(tau), ridge=float(ridge), beta=float(beta),
                    n_obs=x.shape[0])
    held = ()
    if structure != "none":
        start = _statistic(fisher(theta[0], x)[None], structure)  # one Fisher, shared by every chain
        if strategy == "ema" and structure == "diag":
            held = jnp.broadcast_to(start, (n_chains, DIM))
        elif strategy == "ema":  # (n, n, S) per block: the chains last
            held = tuple(jnp.broadcast_to(m[0][..., None], (*m.shape[1:], n_chains)) for m in start)
        else:
            held = _inverse(start, structure, ridge)
            if strategy == "periodic":  # per chain after the first recomputation: one shape throughout
                held = jax.tree_util.tree_map(lambda m: jnp.broadcast_to(m, (n_chains, *m.shape[1:])), held)
    chunk = period if strategy == "periodic" and structure != "none" else CHUNK
    key, done = jax.random.PRNGKey(seed), 0
    while done < n_steps:
        length = min(chunk, n_steps - done)
        key, sub = jax.random.split(key)
        theta, held = _chunk(theta, held, jnp.asarray(done + 1), sub, x, n_steps=length, **settings)
        done += length
        if strategy == "periodic" and structure != "none" and done % period == 0:  # after step K too, as P_{K+1}
            held = _inverse(_statistic(_fisher_per_chain(theta, x), structure), structure, ridge)
    out = np.asarray(jax.block_until_ready(theta))
    seconds = time.perf_counter() - started
    if strategy == "ema" and structure not in ("none", "diag"):
        held = tuple(jnp.moveaxis(m, -1, 0) for m in held)  # (S, n, n), as the other strategies hold theirs
    return {"theta": out, "non_finite": int((~np.isfinite(out).all(axis=1)).sum()), "seconds": seconds,
            "held": jax.tree_util.tree_map(np.asarray, held)}
