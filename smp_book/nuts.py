"""The NUTS baseline of the toy example (Section 3.2.2 of the paper), in JAX + NumPyro.

One NUTS chain on the posterior of the 2-3-2-1 GELU network of Section 3.2.1, prior ``theta ~ N(0, I_20)``,
likelihood ``y_i ~ Bernoulli(sigma(g(x_i, theta)))``; its sample mean is the point estimate ``NUTS-mean`` that
initialises SMP. The posterior is multimodal (at least through the permutations of hidden units), and the mean of a
chain that wanders between symmetric modes is a poor classifier. Three defences: :func:`run_nuts` starts the chain
at a MAP (:func:`find_map`), relabels every draw by the exact hidden-unit permutation (3! x 2! = 12) closest to the
running mean (:func:`align_hidden_units`; predictions unchanged, the chain as drawn stays in ``raw_samples``), and
:func:`check_nuts_mean` measures how much worse the mean predicts than the ensemble (:func:`nuts_mean_passes`
judges it; the toy chapter reports both).

Everything runs in float64 inside ``jax.enable_x64(True)`` (the global setting is untouched) on the CPU
(``jax_platforms`` is set to ``"cpu"`` at import when no platform was chosen). Order of the flat vector ``theta``
(20,), that of ``ParamLayout.from_module(toy_mlp())``: W1 (3x2, row-major), b1 (3), W2 (2x3), b2 (2), W3 (1x2), b3 (1).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

if not jax.config.jax_platforms:  # before any backend is initialised; a no-op afterwards
    jax.config.update("jax_platforms", "cpu")

D_TOY = 20
# (name, start, stop, shape) of every parameter tensor in the flat vector.
_SLICES = (("W1", 0, 6, (3, 2)), ("b1", 6, 9, (3,)), ("W2", 9, 15, (2, 3)), ("b2", 15, 17, (2,)),
           ("W3", 17, 19, (1, 2)), ("b3", 19, 20, (1,)))
# How much worse than the NUTS ensemble the NUTS-mean point estimate may predict (:func:`nuts_mean_passes`).
MAX_ACCURACY_DROP, MAX_BRIER_INCREASE = 0.05, 0.02


@contextlib.contextmanager
def _cpu64():
    """Float64 (locally) on the CPU device."""
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        yield


def _unpack(theta):
    batch = theta.shape[:-1]
    return {name: theta[..., a:b].reshape(*batch, *shape) for name, a, b, shape in _SLICES}


def mlp_logits_jax(theta, x):
    """Logits ``g(x, theta)`` of the 2-3-2-1 network (tanh-approximate GELU) in JAX, as :func:`smp_core.models.toy_mlp`.

    ``theta`` ``(20,)`` or ``(S, 20)``, ``x`` ``(n, 2)``; returns ``(n,)`` or ``(S, n)``.
    """
    theta = jnp.asarray(theta)
    x = jnp.asarray(x, dtype=theta.dtype)
    if theta.shape[-1] != D_TOY:
        raise ValueError(f"theta must end in a dimension of {D_TOY}, got shape {theta.shape}")
    p = _unpack(theta)
    h = jax.nn.gelu(jnp.einsum("ni,...ji->...nj", x, p["W1"]) + p["b1"][..., None, :], approximate=True)
    h = jax.nn.gelu(jnp.einsum("...ni,...ji->...nj", h, p["W2"]) + p["b2"][..., None, :], approximate=True)
    out = jnp.einsum("...ni,...ji->...nj", h, p["W3"]) + p["b3"][..., None, :]
    return out[..., 0]


def log_posterior(theta, x, y, prior_scale: float = 1.0):
    """Log posterior up to the evidence: ``log N(theta; 0, prior_scale^2 I) + sum_i (y_i g_i - softplus(g_i))``.

    ``theta`` ``(20,)`` or ``(S, 20)``; returns a scalar or ``(S,)``, in the dtype of ``theta``.
    """
    theta = jnp.asarray(theta)
    y = jnp.asarray(y, dtype=theta.dtype)
    g = mlp_logits_jax(theta, x)
    loglik = jnp.sum(y * g - jax.nn.softplus(g), axis=-1)
    z = theta / prior_scale
    logprior = -0.5 * jnp.sum(z * z, axis=-1) - D_TOY * (np.log(prior_scale) + 0.5 * np.log(2.0 * np.pi))
    return logprior + loglik


def predict_logits(samples, x, batch_size: int = 256) -> np.ndarray:
    """Logits of every sample at the inputs ``x``: ``(S, n)`` float64 NumPy for ``samples`` ``(S, 20)``."""
    samples = np.atleast_2d(np.asarray(samples, dtype=np.float64))
    x = np.asarray(x, dtype=np.float64)
    with _cpu64():
        f = jax.jit(mlp_logits_jax)
        return np.concatenate([np.asarray(f(samples[i:i + batch_size], x))
                               for i in range(0, samples.shape[0], batch_size)])


#: Every (first-layer permutation of 3 units, second-layer permutation of 2 units); index 0 is the identity.
HIDDEN_UNIT_PERMUTATIONS = tuple((np.array(p1), np.array(p2)) for p1 in itertools.permutations(range(3))
                                 for p2 in itertools.permutations(range(2)))


def permute_hidden_units(theta, perm1, perm2) -> np.ndarray:
    """Relabel hidden units (the network function is unchanged): unit ``perm1[k]`` of layer 1 becomes unit
    ``k``, likewise ``perm2`` for layer 2. ``theta`` ``(..., 20)``; returns a new NumPy array."""
    theta = np.asarray(theta)
    batch = theta.shape[:-1]
    p = _unpack(theta)
    w2 = p["W2"][..., :, perm1][..., perm2, :]
    parts = [p["W1"][..., perm1, :], p["b1"][..., perm1], w2, p["b2"][..., perm2], p["W3"][..., :, perm2], p["b3"]]
    return np.concatenate([a.reshape(*batch, -1) for a in parts], axis=-1)


def align_hidden_units(samples, reference) -> tuple[np.ndarray, np.ndarray]:
    """Relabel every draw by the hidden-unit permutation closest (Euclidean) to a reference.

    The reference starts at ``reference``, then becomes the mean of the relabelled draws until the labels stop
    changing (at most 50 rounds); the common labelling is finally chosen so that the most frequent label is the
    identity. Returns the relabelled draws ``(S, 20)`` and each draw's index into
    :data:`HIDDEN_UNIT_PERMUTATIONS` ``(S,)`` (0: unchanged).
    """
    samples = np.atleast_2d(np.asarray(samples, dtype=np.float64))
    candidates = np.stack([permute_hidden_units(samples, p1, p2) for p1, p2 in HIDDEN_UNIT_PERMUTATIONS])
    rows = np.arange(samples.shape[0])

    def closest(ref):  # each draw's label nearest to ref
        return ((candidates - ref) ** 2).sum(axis=-1).argmin(axis=0)

    labels = closest(np.asarray(reference, dtype=np.float64).reshape(-1))
    for _ in range(49):
        new = closest(candidates[labels, rows].mean(axis=0))
        if np.array_equal(new, labels):
            break
        labels = new
    # Undo the most frequent permutation on the reference (distances are invariant under a common
    # permutation of both arguments), so that the majority of draws keeps its labels.
    p1, p2 = HIDDEN_UNIT_PERMUTATIONS[int(np.bincount(labels).argmax())]
    labels = closest(permute_hidden_units(candidates[labels, rows].mean(axis=0), np.argsort(p1), np.argsort(p2)))
    return candidates[labels, rows], labels


@dataclass
class MapResult:
    """The best restart of :func:`find_map` (``theta`` (20,), float64), and every restart's final log posterior."""

    theta: np.ndarray
    log_posterior: float
    restart_log_posteriors: np.ndarray
    converged: bool


def find_map(x, y, seed: int, num_restarts: int = 4, prior_scale: float = 1.0, starts=None) -> MapResult:
    """MAP of the posterior (prior ``N(0, prior_scale^2 I_20)``, Bernoulli likelihood) by L-BFGS, the best of restarts.

    Each restart is ``scipy.optimize.minimize(method="L-BFGS-B")`` (float64, exact JAX gradients) from
    ``0.5 * np.random.default_rng(seed).standard_normal((num_restarts, 20))``, or from the rows of
    ``starts`` ``(R, 20)`` when given (``seed`` and ``num_restarts`` are then unused).
    """
    if starts is None:
        if num_restarts < 1:
            raise ValueError("num_restarts must be at least 1")
        starts = 0.5 * np.random.default_rng(seed).standard_normal((num_restarts, D_TOY))
    starts = np.atleast_2d(np.asarray(starts, dtype=np.float64))
    if starts.shape[1:] != (D_TOY,) or starts.shape[0] < 1 or not np.isfinite(starts).all():
        raise ValueError(f"starts must be finite with shape (R, {D_TOY}), R >= 1; got {starts.shape}")
    with _cpu64():
        xj, yj = jnp.asarray(np.asarray(x, dtype=np.float64)), jnp.asarray(np.asarray(y, dtype=np.float64).reshape(-1))
        value_and_grad = jax.jit(jax.value_and_grad(lambda t: -log_posterior(t, xj, yj, prior_scale)))

        def fun(t):
            v, g = value_and_grad(jnp.asarray(t))
            return float(v), np.asarray(g, dtype=np.float64)

        options = {"maxiter": 5000, "gtol": 1e-6}
        fits = [scipy.optimize.minimize(fun, start, jac=True, method="L-BFGS-B", options=options) for start in starts]
    finals = np.array([-float(fit.fun) for fit in fits])
    best = int(np.nanargmax(finals))
    return MapResult(theta=np.asarray(fits[best].x, dtype=np.float64), log_posterior=float(finals[best]),
                     restart_log_posteriors=finals, converged=bool(fits[best].success))


@dataclass
class NutsResult:
    """``samples`` ``(num_samples, 20)`` float64 draws after warm-up, relabelled by :func:`align_hidden_units`
    (``labels``: each draw's index into :data:`HIDDEN_UNIT_PERMUTATIONS`); ``raw_samples`` the chain as drawn;
    ``init`` its initial point.

    ``diagnostics``, of the sampling phase unless a name says warm-up: tree depth is Stan's
    ``floor(log2(num_steps + 1))``; ESS (min and median) and split R-hat (max) are NumPyro's, on a ``(1, S, .)``
    array (split R-hat compares the two halves of the chain), per parameter of the relabelled draws
    (``min_ess_params_raw``: of the chain as drawn) and per logit at ``x_eval``; ``num_relabelled``: the draws that
    :func:`align_hidden_units` permuted; ``wall_time_s``: warm-up plus sampling, compilation included."""

    samples: np.ndarray
    diagnostics: dict[str, float]
    init: np.ndarray
    raw_samples: np.ndarray
    labels: np.ndarray


def _toy_model(x, y, prior_scale):
    import numpyro
    import numpyro.distributions as dist

    theta = numpyro.sample("theta", dist.Normal(0.0, prior_scale).expand([D_TOY]).to_event(1))
    numpyro.sample("y", dist.Bernoulli(logits=mlp_logits_jax(theta, x)), obs=y)


def run_nuts(x, y, seed: int, num_warmup: int = 1000, num_samples: int = 1000, target_accept_prob: float = 0.95,
             init=None, x_eval=None, max_tree_depth: int = 10, dense_mass: bool = False) -> NutsResult:
    """One NUTS chain on the toy posterior (Section 3.2.2): prior ``N(0, I_20)``, Bernoulli likelihood.

    Starts at ``init`` ``(20,)`` (default: ``find_map(x, y, seed).theta``), adapts the step size and a
    diagonal (or, with ``dense_mass``, dense) mass matrix for ``num_warmup`` steps and keeps
    ``num_samples`` draws, relabelled towards one basin starting from ``init``. ``seed`` seeds
    ``jax.random.PRNGKey`` (and the MAP restarts). Logit diagnostics at ``x_eval`` (default: ``x``).
    """
    from numpyro.diagnostics import effective_sample_size, split_gelman_rubin
    from numpyro.infer import MCMC, NUTS, init_to_value

    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    x_eval = x if x_eval is None else np.asarray(x_eval, dtype=np.float64)
    init = np.asarray(find_map(x, y, seed).theta if init is None else init, dtype=np.float64).reshape(-1)
    if init.shape != (D_TOY,):
        raise ValueError(f"init must have shape ({D_TOY},), got {init.shape}")

    with _cpu64():
        kernel = NUTS(_toy_model, target_accept_prob=target_accept_prob, max_tree_depth=max_tree_depth,
                      dense_mass=dense_mass, init_strategy=init_to_value(values={"theta": jnp.asarray(init)}))
        mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_samples, num_chains=1, progress_bar=False)
        args = (jnp.asarray(x), jnp.asarray(y), 1.0)
        t0 = time.perf_counter()
        mcmc.warmup(jax.random.PRNGKey(seed), *args, extra_fields=("diverging",), collect_warmup=True)
        warmup_div = int(np.asarray(mcmc.get_extra_fields()["diverging"]).sum()) if num_warmup > 0 else 0
        t1 = time.perf_counter()
        mcmc.run(mcmc.post_warmup_state.rng_key, *args, extra_fields=("diverging", "accept_prob", "num_steps"))
        raw = np.asarray(mcmc.get_samples()["theta"], dtype=np.float64)
        t2 = time.perf_counter()
        extra = {k: np.asarray(v) for k, v in mcmc.get_extra_fields().items()}
        step_size = float(mcmc.last_state.adapt_state.step_size)

    tree_depth = np.floor(np.log2(extra["num_steps"].astype(np.float64) + 1.0)).astype(np.int64)
    samples, labels = align_hidden_units(raw, reference=init)
    logits = predict_logits(samples, x_eval)

    ess_params, ess_raw, ess_logits = (np.asarray(effective_sample_size(a[None]), dtype=np.float64)
                                       for a in (samples, raw, logits))
    rhat_params, rhat_logits = (np.asarray(split_gelman_rubin(a[None]), dtype=np.float64) for a in (samples, logits))
    diagnostics = {
        "num_divergences": int(extra["diverging"].sum()), "num_warmup_divergences": warmup_div,
        "mean_accept_prob": float(extra["accept_prob"].mean()), "step_size": step_size,
        "max_tree_depth": max_tree_depth, "max_tree_depth_reached": int(tree_depth.max()),
        "num_max_tree_depth_hits": int((tree_depth >= max_tree_depth).sum()),
        "mean_num_steps": float(extra["num_steps"].mean()),
        "min_ess_params": float(np.nanmin(ess_params)), "median_ess_params": float(np.nanmedian(ess_params)),
        "max_rhat_params": float(np.nanmax(rhat_params)), "min_ess_params_raw": float(np.nanmin(ess_raw)),
        "num_relabelled": int((labels != 0).sum()),
        "min_ess_logits": float(np.nanmin(ess_logits)), "median_ess_logits": float(np.nanmedian(ess_logits)),
        "max_rhat_logits": float(np.nanmax(rhat_logits)), "warmup_time_s": t1 - t0, "sampling_time_s": t2 - t1,
        "wall_time_s": t2 - t0}
    return NutsResult(samples=samples, diagnostics=diagnostics, init=init, raw_samples=raw, labels=labels)


def check_nuts_mean(samples, x, y) -> dict[str, float]:
    """Compare the ``NUTS-mean`` point estimate with the NUTS ensemble on ``(x, y)``.

    The ensemble predicts ``mean_l sigma(g(x, theta_l))``, the point estimate ``sigma(g(x, mean_l theta_l))``; a
    chain that mixed across symmetric modes gives a mean that predicts far worse (:func:`nuts_mean_passes`).
    Returns the accuracy and the one-class Brier score ``mean (p - y)^2`` of the toy tables of both.
    """
    samples = np.atleast_2d(np.asarray(samples, dtype=np.float64))
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    logits = predict_logits(np.concatenate([samples, samples.mean(axis=0, keepdims=True)]), x)
    probs = 0.5 * (1.0 + np.tanh(0.5 * logits))
    p_ens, p_mean = probs[:-1].mean(axis=0), probs[-1]
    metrics = {
        "accuracy_ensemble": float(np.mean((p_ens > 0.5) == (y > 0.5))),
        "accuracy_mean": float(np.mean((p_mean > 0.5) == (y > 0.5))),
        "brier_ensemble": float(np.mean((p_ens - y) ** 2)),
        "brier_mean": float(np.mean((p_mean - y) ** 2)),
    }
    return metrics


def nuts_mean_passes(metrics: dict[str, float]) -> bool:
    """Whether, in the metrics of :func:`check_nuts_mean`, the mean's accuracy is at most
    :data:`MAX_ACCURACY_DROP` below the ensemble's and its Brier score at most :data:`MAX_BRIER_INCREASE` above."""
    return (metrics["accuracy_mean"] >= metrics["accuracy_ensemble"] - MAX_ACCURACY_DROP
            and metrics["brier_mean"] <= metrics["brier_ensemble"] + MAX_BRIER_INCREASE)
