"""The NUTS baseline of the toy example (Section 3.2.2 of the paper), in JAX + NumPyro.

The paper runs one NUTS chain (Turing.jl) on the Bayesian posterior of the 2-3-2-1 GELU
network of Section 3.2.1, with prior ``theta ~ N(0, I_20)`` and Bernoulli likelihood
``y_i ~ Bernoulli(sigma(g(x_i, theta)))``: 1000 warm-up steps, ``S = 1000`` samples, target
acceptance 0.95. It stresses that one chain characterises one *local* posterior mode (the
posterior is multimodal, at least through the permutations of hidden units) and takes the
posterior mean as the point estimate ``NUTS-mean`` that initialises SMP.

A chain started at random may wander between symmetric modes: the sample mean then averages
parameters of different modes and is a poor classifier (observed here: ESS 6-26 and a mean
that predicted at 0.42 accuracy). Three defences:

* :func:`run_nuts` starts the chain at a MAP estimate (:func:`find_map`, L-BFGS with random
  restarts), inside one basin.
* Even so the chain still switches hidden units: the problem is (nearly) rotation invariant,
  so rotating the three first-layer weight vectors is a low-barrier path that ends in a
  permutation of them, and the two second-layer units can swap. Permuting hidden units is an
  *exact* symmetry of the posterior (the prior is isotropic and the network output is
  unchanged), so :func:`run_nuts` relabels every draw by the permutation of hidden units
  (3! x 2! = 12 of them) closest to the running sample mean (:func:`align_hidden_units`, as
  relabelling algorithms for mixture models do). Every draw's predictions, and so the NUTS
  ensemble, are unchanged; only the mean, the ``NUTS-mean`` point estimate, becomes a point of
  one basin. ``NutsResult.raw_samples`` keeps the chain as drawn.
* :func:`check_nuts_mean` fails loudly when the mean predicts much worse than the ensemble.

Precision and device. The sampler and the optimiser run in float64 inside
``jax.enable_x64(True)`` (a context manager: the global setting is untouched) and on the CPU
(``jax_platforms`` is set to ``"cpu"`` at import when no platform was chosen, and every
computation runs under ``jax.default_device(cpu)``). Thread settings are left alone.

Parameter order of the flat vector ``theta`` (20,), the order of
``ParamLayout.from_module(toy_mlp())``: W1 (3x2, row-major), b1 (3), W2 (2x3), b2 (2),
W3 (1x2), b3 (1).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

if not jax.config.jax_platforms:  # before any backend is initialised; a no-op afterwards
    jax.config.update("jax_platforms", "cpu")

__all__ = [
    "D_TOY",
    "HIDDEN_UNIT_PERMUTATIONS",
    "MapResult",
    "NutsDiagnostics",
    "NutsResult",
    "align_hidden_units",
    "check_nuts_mean",
    "find_map",
    "log_posterior",
    "mlp_logits_jax",
    "permute_hidden_units",
    "predict_logits",
    "run_nuts",
]

D_TOY = 20
# (name, start, stop, shape) of every parameter tensor in the flat vector.
_SLICES = (
    ("W1", 0, 6, (3, 2)),
    ("b1", 6, 9, (3,)),
    ("W2", 9, 15, (2, 3)),
    ("b2", 15, 17, (2,)),
    ("W3", 17, 19, (1, 2)),
    ("b3", 19, 20, (1,)),
)


@contextlib.contextmanager
def _cpu64(x64: bool = True):
    """Float64 (locally) on the CPU device."""
    with jax.enable_x64(x64), jax.default_device(jax.devices("cpu")[0]):
        yield


def _unpack(theta):
    batch = theta.shape[:-1]
    return {name: theta[..., a:b].reshape(*batch, *shape) for name, a, b, shape in _SLICES}


def mlp_logits_jax(theta, x):
    """Logits ``g(x, theta)`` of the 2-3-2-1 network (GELU, tanh approximation) in JAX.

    ``theta``: flat parameter vector ``(20,)`` (or a batch ``(S, 20)``) in the order of the
    module docstring; ``x``: ``(n, 2)``. Returns ``(n,)`` (or ``(S, n)``). Matches
    :func:`smp_core.models.toy_mlp` with the same flat vector.
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
    """Log posterior density up to the evidence: ``log N(theta; 0, prior_scale^2 I) + sum_i log f_theta(y_i|x_i)``.

    The Bernoulli log-likelihood ``y g - softplus(g)`` of Section 3.2.1. ``theta`` ``(20,)`` or
    ``(S, 20)``; returns a scalar (or ``(S,)``). Uses the dtype of ``theta``.
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


# ---------------------------------------------------------------------------------------------
# Hidden-unit permutations (exact symmetries) and relabelling
# ---------------------------------------------------------------------------------------------

#: Every (first-layer permutation of 3 units, second-layer permutation of 2 units); index 0 is the identity.
HIDDEN_UNIT_PERMUTATIONS = tuple((np.array(p1), np.array(p2)) for p1 in itertools.permutations(range(3))
                                 for p2 in itertools.permutations(range(2)))


def permute_hidden_units(theta, perm1, perm2) -> np.ndarray:
    """Relabel hidden units: unit ``perm1[k]`` of layer 1 becomes unit ``k`` (rows of W1, b1 and
    columns of W2 move together), likewise ``perm2`` for layer 2 (rows of W2, b2, columns of W3).

    The network function is unchanged. ``theta`` ``(..., 20)``; returns a new NumPy array.
    """
    theta = np.asarray(theta)
    batch = theta.shape[:-1]
    p = _unpack(theta)
    w2 = p["W2"][..., :, perm1][..., perm2, :]
    parts = [p["W1"][..., perm1, :], p["b1"][..., perm1], w2, p["b2"][..., perm2], p["W3"][..., :, perm2], p["b3"]]
    return np.concatenate([a.reshape(*batch, -1) for a in parts], axis=-1)


def align_hidden_units(samples, reference=None, max_iter: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """Relabel every draw by the hidden-unit permutation closest (Euclidean) to a reference.

    The reference starts at ``reference`` (default: the first draw) and then becomes the mean
    of the relabelled draws, until the labels stop changing (at most ``max_iter`` rounds).
    Finally the common labelling is chosen so that the most frequent label is the identity
    (the draws are relabelled as little as possible). Returns the relabelled draws ``(S, 20)``
    and the index into :data:`HIDDEN_UNIT_PERMUTATIONS` used for each draw ``(S,)`` (0: unchanged).
    """
    samples = np.atleast_2d(np.asarray(samples, dtype=np.float64))
    ref = samples[0] if reference is None else np.asarray(reference, dtype=np.float64).reshape(-1)
    candidates = np.stack([permute_hidden_units(samples, p1, p2) for p1, p2 in HIDDEN_UNIT_PERMUTATIONS])
    rows = np.arange(samples.shape[0])
    labels = None
    for _ in range(max_iter):
        new = ((candidates - ref) ** 2).sum(axis=-1).argmin(axis=0)
        if labels is not None and np.array_equal(new, labels):
            break
        labels = new
        ref = candidates[labels, rows].mean(axis=0)
    # Undo the most frequent permutation on the reference (distances are invariant under a common
    # permutation of both arguments), so that the majority of draws keeps its labels.
    p1, p2 = HIDDEN_UNIT_PERMUTATIONS[int(np.bincount(labels).argmax())]
    ref = permute_hidden_units(ref, np.argsort(p1), np.argsort(p2))
    labels = ((candidates - ref) ** 2).sum(axis=-1).argmin(axis=0)
    return candidates[labels, rows], labels


# ---------------------------------------------------------------------------------------------
# MAP
# ---------------------------------------------------------------------------------------------


@dataclass
class MapResult:
    """The best of several L-BFGS runs of :func:`find_map`.

    ``theta`` (20,) float64 maximises the log posterior among the restarts; ``init_theta`` is
    the random start it came from. ``restart_log_posteriors`` / ``restart_init_log_posteriors``
    hold the final / initial log posterior of every restart.
    """

    theta: np.ndarray
    log_posterior: float
    init_theta: np.ndarray
    init_log_posterior: float
    restart_log_posteriors: np.ndarray
    restart_init_log_posteriors: np.ndarray
    converged: bool
    message: str


def find_map(x, y, seed: int, num_restarts: int = 4, init_scale: float = 0.5, prior_scale: float = 1.0,
             maxiter: int = 5000, gtol: float = 1e-6, starts=None) -> MapResult:
    """MAP of the posterior (prior ``N(0, prior_scale^2 I_20)``, Bernoulli likelihood) by L-BFGS.

    Each of ``num_restarts`` runs of ``scipy.optimize.minimize(method="L-BFGS-B")`` (float64,
    exact JAX gradients) starts from ``N(0, init_scale^2 I_20)``; the starts are
    ``init_scale * np.random.default_rng(seed).standard_normal((num_restarts, 20))``. Returns
    the restart with the highest log posterior. Used to start NUTS inside one basin.

    ``starts`` ``(R, 20)``, when given, replaces the random starts (``seed``, ``num_restarts`` and
    ``init_scale`` are then unused): the MAP of the basin a given point lies in, e.g. NUTS-mean's.
    """
    if starts is None:
        if num_restarts < 1:
            raise ValueError("num_restarts must be at least 1")
        starts = init_scale * np.random.default_rng(seed).standard_normal((num_restarts, D_TOY))
    else:
        starts = np.atleast_2d(np.asarray(starts, dtype=np.float64))
        if starts.shape[1:] != (D_TOY,) or starts.shape[0] < 1 or not np.isfinite(starts).all():
            raise ValueError(f"starts must be finite with shape (R, {D_TOY}), R >= 1; got {starts.shape}")
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    with _cpu64():
        xj, yj = jnp.asarray(x), jnp.asarray(y)
        value_and_grad = jax.jit(jax.value_and_grad(lambda t: -log_posterior(t, xj, yj, prior_scale)))

        def fun(t):
            v, g = value_and_grad(jnp.asarray(t))
            return float(v), np.asarray(g, dtype=np.float64)

        runs = []
        for start in starts:
            init_value = -fun(start)[0]
            res = scipy.optimize.minimize(fun, start, jac=True, method="L-BFGS-B",
                                          options={"maxiter": maxiter, "gtol": gtol})
            runs.append((-float(res.fun), init_value, res))
    finals = np.array([r[0] for r in runs])
    best = int(np.nanargmax(finals))
    value, init_value, res = runs[best]
    return MapResult(theta=np.asarray(res.x, dtype=np.float64), log_posterior=value,
                     init_theta=starts[best].copy(), init_log_posterior=init_value,
                     restart_log_posteriors=finals, restart_init_log_posteriors=np.array([r[1] for r in runs]),
                     converged=bool(res.success), message=str(res.message))


# ---------------------------------------------------------------------------------------------
# NUTS
# ---------------------------------------------------------------------------------------------


@dataclass
class NutsDiagnostics:
    """Diagnostics of one NUTS chain (sampling phase unless the name says warm-up).

    Tree depth follows Stan's ``treedepth__``: ``floor(log2(num_steps + 1))`` for a transition
    with ``num_steps`` leapfrog steps; ``num_max_tree_depth_hits`` counts transitions that
    reached ``max_tree_depth``. ESS and split R-hat (NumPyro's ``effective_sample_size`` and
    ``split_gelman_rubin`` on a ``(1, S, .)`` array: split R-hat compares the two halves of
    the one chain) are given per parameter (of the returned, relabelled draws; ``ess_params_raw``
    for the chain as drawn) and per logit ``g(x_eval_j, theta)`` (relabelling leaves logits
    unchanged). ``num_relabelled`` counts draws that :func:`align_hidden_units` permuted.
    """

    num_divergences: int
    num_warmup_divergences: int
    mean_accept_prob: float
    step_size: float
    max_tree_depth: int
    max_tree_depth_reached: int
    num_max_tree_depth_hits: int
    mean_num_steps: float
    ess_params: np.ndarray
    rhat_params: np.ndarray
    ess_params_raw: np.ndarray
    num_relabelled: int
    ess_logits: np.ndarray
    rhat_logits: np.ndarray
    warmup_time_s: float
    sampling_time_s: float

    @property
    def wall_time_s(self) -> float:
        """Warm-up plus sampling, compilation included."""
        return self.warmup_time_s + self.sampling_time_s

    @property
    def min_ess_params(self) -> float:
        return float(np.nanmin(self.ess_params))

    @property
    def median_ess_params(self) -> float:
        return float(np.nanmedian(self.ess_params))

    @property
    def max_rhat_params(self) -> float:
        return float(np.nanmax(self.rhat_params))

    @property
    def min_ess_params_raw(self) -> float:
        return float(np.nanmin(self.ess_params_raw))

    @property
    def min_ess_logits(self) -> float:
        return float(np.nanmin(self.ess_logits))

    @property
    def median_ess_logits(self) -> float:
        return float(np.nanmedian(self.ess_logits))

    @property
    def max_rhat_logits(self) -> float:
        return float(np.nanmax(self.rhat_logits))

    def summary(self) -> dict[str, float]:
        """Scalar diagnostics as a flat dict (for tables and logs)."""
        return {
            "num_divergences": self.num_divergences,
            "num_warmup_divergences": self.num_warmup_divergences,
            "mean_accept_prob": self.mean_accept_prob,
            "step_size": self.step_size,
            "max_tree_depth": self.max_tree_depth,
            "max_tree_depth_reached": self.max_tree_depth_reached,
            "num_max_tree_depth_hits": self.num_max_tree_depth_hits,
            "mean_num_steps": self.mean_num_steps,
            "min_ess_params": self.min_ess_params,
            "median_ess_params": self.median_ess_params,
            "max_rhat_params": self.max_rhat_params,
            "min_ess_params_raw": self.min_ess_params_raw,
            "num_relabelled": self.num_relabelled,
            "min_ess_logits": self.min_ess_logits,
            "median_ess_logits": self.median_ess_logits,
            "max_rhat_logits": self.max_rhat_logits,
            "warmup_time_s": self.warmup_time_s,
            "sampling_time_s": self.sampling_time_s,
            "wall_time_s": self.wall_time_s,
        }


@dataclass
class NutsResult:
    """``samples`` ``(num_samples, 20)`` float64 posterior draws after warm-up, relabelled by
    :func:`align_hidden_units` unless ``run_nuts(relabel=False)``; ``raw_samples`` the chain as
    drawn; their :class:`NutsDiagnostics`; the initial point ``init``; the per-transition extra
    fields (``diverging``, ``accept_prob``, ``num_steps``, ``tree_depth``) and the relabelling
    ``labels`` (index into :data:`HIDDEN_UNIT_PERMUTATIONS` per draw)."""

    samples: np.ndarray
    diagnostics: NutsDiagnostics
    init: np.ndarray
    raw_samples: np.ndarray
    labels: np.ndarray
    extra_fields: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def mean(self) -> np.ndarray:
        """The ``NUTS-mean`` point estimate (Section 3.2.2): the sample mean, ``(20,)``."""
        return self.samples.mean(axis=0)


def _toy_model(x, y, prior_scale):
    import numpyro
    import numpyro.distributions as dist

    theta = numpyro.sample("theta", dist.Normal(0.0, prior_scale).expand([D_TOY]).to_event(1))
    numpyro.sample("y", dist.Bernoulli(logits=mlp_logits_jax(theta, x)), obs=y)


def run_nuts(x, y, seed: int, num_warmup: int = 1000, num_samples: int = 1000, target_accept_prob: float = 0.95,
             init=None, progress_bar: bool = False, x_eval=None, max_tree_depth: int = 10,
             dense_mass: bool = False, prior_scale: float = 1.0, map_restarts: int = 4,
             relabel: bool = True) -> NutsResult:
    """One NUTS chain on the toy posterior (Section 3.2.2): prior ``N(0, I_20)``, Bernoulli likelihood.

    The chain starts at ``init`` (``(20,)``; default: ``find_map(x, y, seed, map_restarts).theta``)
    through ``init_to_value``, adapts the step size and a diagonal mass matrix (as Turing's
    default NUTS) for ``num_warmup`` steps and keeps ``num_samples`` draws. ``seed`` seeds
    ``jax.random.PRNGKey`` (and the MAP restarts). Logit diagnostics are taken at ``x_eval``
    (default: the training inputs ``x``). With ``relabel`` (default) the returned ``samples``
    are relabelled by exact hidden-unit permutations towards one basin
    (:func:`align_hidden_units`, starting from ``init``; see the module docstring); the chain as
    drawn is ``raw_samples``. Runs in float64 on the CPU.
    """
    from numpyro.diagnostics import effective_sample_size, split_gelman_rubin
    from numpyro.infer import MCMC, NUTS, init_to_value

    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    x_eval = x if x_eval is None else np.asarray(x_eval, dtype=np.float64)
    if init is None:
        init = find_map(x, y, seed, num_restarts=map_restarts, prior_scale=prior_scale).theta
    init = np.asarray(init, dtype=np.float64).reshape(-1)
    if init.shape != (D_TOY,):
        raise ValueError(f"init must have shape ({D_TOY},), got {init.shape}")

    with _cpu64():
        kernel = NUTS(_toy_model, target_accept_prob=target_accept_prob, max_tree_depth=max_tree_depth,
                      dense_mass=dense_mass, init_strategy=init_to_value(values={"theta": jnp.asarray(init)}))
        mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_samples, num_chains=1,
                    progress_bar=progress_bar)
        args = (jnp.asarray(x), jnp.asarray(y), prior_scale)
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
    extra["tree_depth"] = tree_depth
    if relabel:
        samples, labels = align_hidden_units(raw, reference=init)
    else:
        samples, labels = raw.copy(), np.zeros(raw.shape[0], dtype=np.int64)
    logits = predict_logits(samples, x_eval)
    diagnostics = NutsDiagnostics(
        num_divergences=int(extra["diverging"].sum()),
        num_warmup_divergences=warmup_div,
        mean_accept_prob=float(extra["accept_prob"].mean()),
        step_size=step_size,
        max_tree_depth=max_tree_depth,
        max_tree_depth_reached=int(tree_depth.max()),
        num_max_tree_depth_hits=int((tree_depth >= max_tree_depth).sum()),
        mean_num_steps=float(extra["num_steps"].mean()),
        ess_params=np.asarray(effective_sample_size(samples[None]), dtype=np.float64),
        rhat_params=np.asarray(split_gelman_rubin(samples[None]), dtype=np.float64),
        ess_params_raw=np.asarray(effective_sample_size(raw[None]), dtype=np.float64),
        num_relabelled=int((labels != 0).sum()),
        ess_logits=np.asarray(effective_sample_size(logits[None]), dtype=np.float64),
        rhat_logits=np.asarray(split_gelman_rubin(logits[None]), dtype=np.float64),
        warmup_time_s=t1 - t0,
        sampling_time_s=t2 - t1,
    )
    return NutsResult(samples=samples, diagnostics=diagnostics, init=init, raw_samples=raw, labels=labels,
                      extra_fields=extra)


# ---------------------------------------------------------------------------------------------
# The NUTS-mean sanity check
# ---------------------------------------------------------------------------------------------


def check_nuts_mean(samples, x, y, max_accuracy_drop: float = 0.05, max_brier_increase: float = 0.02,
                    raise_error: bool = True) -> dict[str, float]:
    """Compare the ``NUTS-mean`` point estimate with the NUTS ensemble on ``(x, y)``; fail loudly.

    The ensemble predicts ``mean_l sigma(g(x, theta_l))``; the point estimate
    ``sigma(g(x, mean_l theta_l))``. Inside one basin the two nearly agree (the paper: "almost
    identical ... slightly more confident"); a chain that mixed across symmetric modes gives a
    mean that predicts far worse. Raises ``RuntimeError`` (unless ``raise_error=False``) when
    the mean's accuracy is more than ``max_accuracy_drop`` below the ensemble's or its Brier
    score more than ``max_brier_increase`` above it. The Brier score here is the one-class
    ``mean (p - y)^2`` of the toy tables (:func:`smp_book.toy_study.one_class_brier`), half the
    two-class score of :func:`smp_core.metrics.brier`. Returns the four metrics.
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
    if raise_error and not nuts_mean_passes(metrics, max_accuracy_drop, max_brier_increase):
        raise RuntimeError(
            "the NUTS-mean point estimate predicts much worse than the NUTS ensemble "
            f"(accuracy {metrics['accuracy_mean']:.3f} vs {metrics['accuracy_ensemble']:.3f}, "
            f"Brier {metrics['brier_mean']:.4f} vs {metrics['brier_ensemble']:.4f}; allowed: accuracy drop "
            f"{max_accuracy_drop}, Brier increase {max_brier_increase}). The chain probably mixed across "
            "posterior modes, so its mean is not a point of one basin: start it inside one basin "
            "(run_nuts(init=find_map(...).theta)), relabel hidden units (align_hidden_units, run_nuts(relabel=True)), "
            "change the seed, or inspect the trace and ESS.")
    return metrics


def nuts_mean_passes(metrics: dict[str, float], max_accuracy_drop: float = 0.05,
                     max_brier_increase: float = 0.02) -> bool:
    """Whether the metrics of :func:`check_nuts_mean` pass its test: the mean's accuracy at most
    ``max_accuracy_drop`` below the ensemble's and its Brier score at most ``max_brier_increase`` above."""
    return (metrics["accuracy_mean"] >= metrics["accuracy_ensemble"] - max_accuracy_drop
            and metrics["brier_mean"] <= metrics["brier_ensemble"] + max_brier_increase)
