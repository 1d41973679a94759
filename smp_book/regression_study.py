"""Beyond the paper: SMP on a one-dimensional regression with a gap in its data, against NUTS.

The paper's examples are classifications. This study (``notebooks/regression.md``) asks how SMP's
predictive uncertainty compares with the Bayesian posterior's when the likelihood is Gaussian and the
data leave a gap, the "in-between" uncertainty of Foong et al. (2019):

* data: ``x`` uniform on ``[-3, -1]`` and ``[1, 3]`` (half each), ``y = sin 2x + 0.3 x + sigma eps``
  with ``sigma`` known; new points from the same law in the data's range and in the gap ``(-1, 1)``;
* the network: one hidden layer of ``hidden`` tanh units (:func:`regression_mlp`), prior ``N(0, I / alpha)``;
* the reference: NUTS on that posterior (NumPyro, float64, several chains from the MAP), with its
  diagnostics (:func:`run_nuts_regression`);
* beside it: the MAP, the linearised Laplace approximation at the MAP with the same prior, and SMP
  from the MAP for each preconditioner setting of the configuration at every ``tau`` of a grid
  (:func:`run_data_set`);
* beyond the paper's empirical design: SMP whose covariates are resampled from a wider law than the
  ``N`` training inputs (:func:`design_pool`), with the preconditioner's Fisher from the training
  inputs or from that law.

Each method is scored on the new points by :func:`smp_core.metrics.regression_scores` and by the
ratio of its epistemic standard deviation ``sd_l g(x, theta^(l))`` to NUTS's at the same inputs
(median over the inputs of a region): 1 is NUTS's spread, below 1 narrower, above wider.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from smp_core import metrics
from smp_core.fisher import estimate_fisher
from smp_core.likelihoods import Gaussian
from smp_core.models import as_chain_model, predict
from smp_core.preconditioners import ROUNDED_STATISTIC_WARNING, parse_preconditioner_name, preconditioner_from_name
from smp_core.recursion import DivergenceError, Fisher, run_smp

from .baselines import fit_laplace, linearised_logits
from .config import DESIGNS
from .summaries import empirical_counterpart

__all__ = [
    "REGIONS",
    "DESIGNS",
    "curve",
    "gap_data",
    "design_pool",
    "design_label",
    "smoothing_bandwidth",
    "empirical_counterpart",
    "method_label",
    "minus_log_posterior",
    "regression_mlp",
    "fit_map",
    "jax_minus_log_posterior",
    "jax_outputs",
    "run_nuts_regression",
    "evaluate",
    "run_data_set",
    "summary_table",
    "eligible",
    "best_tau",
    "spread_shape",
    "matched_in_both",
    "prior_sensitivity",
]

REGIONS = ("in range", "in the gap")
GAP = (-1.0, 1.0)
POOL_SEED_OFFSET = 50  # a data set's design pools from seed + 1000 index + 50 + DESIGNS.index(design)


def curve(x: torch.Tensor) -> torch.Tensor:
    """The regression function ``sin 2x + 0.3 x``."""
    return torch.sin(2 * x) + 0.3 * x


def gap_data(n_train: int, n_in: int, n_gap: int, noise: float,
             seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"train", "in range", "in the gap"}: (x (n, 1), y (n,))`` in float32, from one seed.

    Training and "in range" inputs are uniform on ``[-3, -1]`` and ``[1, 3]``, half each; "in the gap"
    inputs uniform on ``(-1, 1)``; every response is ``curve(x) + noise * eps``.
    """
    if min(n_train, n_in, n_gap) < 2:
        raise ValueError(f"every set needs at least 2 points, got n_train={n_train}, n_in={n_in}, n_gap={n_gap}")
    gen = torch.Generator().manual_seed(seed)

    def two_sides(n: int) -> torch.Tensor:
        return torch.cat([torch.rand(n // 2, generator=gen) * 2 - 3, torch.rand(n - n // 2, generator=gen) * 2 + 1])

    inputs = {"train": two_sides(n_train), "in range": two_sides(n_in),
              "in the gap": torch.rand(n_gap, generator=gen) * (GAP[1] - GAP[0]) + GAP[0]}
    return {name: (x[:, None], curve(x) + noise * torch.randn(len(x), generator=gen)) for name, x in inputs.items()}


def design_pool(x: torch.Tensor, design: str, size: int, seed: int) -> torch.Tensor:
    """Covariates for SMP to resample from (``run_smp``'s ``x_train``) in place of the training inputs.

    The paper, like the martingale posterior of Fong, Holmes and Walker (2023), resamples the ``N`` training inputs
    (the empirical design, ``"empirical"``: ``x`` itself). Beyond it, ``size`` points drawn once from a
    wider law, whose uniform resampling approximates drawing from that law:

    * ``"uniform"``: uniform on the box spanned by the inputs' coordinates (``[min x_j, max x_j]`` for
      each ``j``), the gap included;
    * ``"smoothed"``: the smoothed bootstrap ``x_I + h * eps`` (``I`` uniform over the ``N`` inputs, ``eps``
      standard normal), a draw from a Gaussian kernel density estimate with the bandwidths of
      :func:`smoothing_bandwidth`.

    ``x`` is ``(N, p)``; the pool has ``x``'s dtype, ``(size, p)`` (``(N, p)`` for ``"empirical"``).
    """
    if design not in DESIGNS:
        raise ValueError(f"unknown design {design!r}; choose one of {DESIGNS}")
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"x must be (N, p) with N >= 2, got shape {tuple(x.shape)}")
    if design == "empirical":
        return x
    if size < 1:
        raise ValueError(f"size must be at least 1, got {size}")
    gen = torch.Generator().manual_seed(seed)
    x64 = x.double()
    if design == "uniform":
        low, high = x64.min(dim=0).values, x64.max(dim=0).values
        pool = low + (high - low) * torch.rand(size, x.shape[1], generator=gen, dtype=torch.float64)
    else:
        bandwidth = smoothing_bandwidth(x64)
        picked = x64[torch.randint(x.shape[0], (size,), generator=gen)]
        pool = picked + bandwidth * torch.randn(size, x.shape[1], generator=gen, dtype=torch.float64)
    return pool.to(x.dtype)


def smoothing_bandwidth(x: torch.Tensor) -> torch.Tensor:
    """Per coordinate of ``x`` ``(N, p)``, Silverman's rule of thumb ``h_j = 0.9 min(sd_j, IQR_j / 1.34) N^(-1/(p+4))``
    (for ``p = 1`` his ``N^(-1/5)``; the exponent ``-1/(p+4)`` is the multivariate normal reference's). Where the
    interquartile range is 0 the standard deviation alone is used. For inputs in clusters (this chapter's two
    intervals) the spread is that of the whole sample, gaps included, so ``h`` is large against each cluster."""
    x64 = x.double()
    n, p = x64.shape
    quartiles = torch.quantile(x64, torch.tensor([0.25, 0.75], dtype=torch.float64), dim=0)
    sd, iqr = x64.std(dim=0), quartiles[1] - quartiles[0]
    spread = torch.where(iqr > 0, torch.minimum(sd, iqr / 1.34), sd)
    return 0.9 * spread * n ** (-1.0 / (p + 4))


def design_label(preconditioner: str, ridge: float, default_ridge: float, design: str, fisher_from: str) -> str:
    """``"SMP none, uniform design"`` or ``"SMP fixed-dense, ridge 1, uniform design, P from the design"`` (a
    preconditioner whose Fisher is from the design's points rather than the training inputs)."""
    if fisher_from not in ("data", "design"):
        raise ValueError(f"fisher_from must be 'data' or 'design', got {fisher_from!r}")
    label = f"{method_label(preconditioner, ridge, default_ridge)}, {design} design"
    return label + (", P from the design" if fisher_from == "design" and preconditioner != "none" else "")


def regression_mlp(hidden: int) -> nn.Sequential:
    """``Linear(1, hidden) -> tanh -> Linear(hidden, 1)``; parameters in the order W1, b1, W2, b2."""
    return nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def minus_log_posterior(net: nn.Module, x: torch.Tensor, y: torch.Tensor, noise: float,
                        prior_precision: float) -> torch.Tensor:
    """``sum_i (y_i - g(x_i))^2 / (2 sigma^2) + alpha |theta|^2 / 2`` (the constant left out)."""
    residual = net(x)[:, 0] - y
    return (residual**2).sum() / (2 * noise**2) + prior_precision / 2 * sum((p**2).sum() for p in net.parameters())


def fit_map(x: torch.Tensor, y: torch.Tensor, hidden: int, noise: float, prior_precision: float, restarts: int,
            seed: int) -> tuple[nn.Sequential, dict[str, float]]:
    """The MAP by L-BFGS in float64 from ``restarts`` PyTorch initialisations (seeds ``seed + r``, drawn from a
    fork of PyTorch's global generator, whose state is left as it was); the lowest minus log posterior wins.
    Returns the float32 network and ``{"objective", "gradient_norm"}``."""
    best, best_value = None, math.inf
    x64, y64 = x.double(), y.double()
    for restart in range(restarts):
        with torch.random.fork_rng(devices=[]):  # the layers' default initialisation, the caller's generator untouched
            torch.manual_seed(seed + restart)
            net = regression_mlp(hidden).double()
        opt = torch.optim.LBFGS(net.parameters(), max_iter=5000, tolerance_grad=1e-9, tolerance_change=1e-15,
                                history_size=50, line_search_fn="strong_wolfe")

        def closure(net=net, opt=opt):
            opt.zero_grad()
            loss = minus_log_posterior(net, x64, y64, noise, prior_precision)
            loss.backward()
            return loss

        opt.step(closure)
        value = float(closure().detach())
        if math.isfinite(value) and value < best_value:
            best, best_value = net, value
    if best is None:
        raise RuntimeError("every MAP restart ended at a non-finite objective")
    gradient = torch.cat([p.grad.flatten() for p in best.parameters()]).norm().item()
    return best.float(), {"objective": best_value, "gradient_norm": gradient}


def jax_outputs(theta, x, hidden: int):
    """:func:`regression_mlp`'s output in JAX: ``theta`` ``(d,)`` in the network's parameter order (W1, b1, W2,
    b2), ``x`` ``(n,)``; returns ``(n,)``."""
    import jax.numpy as jnp

    h = hidden
    w1, b1, w2, b2 = theta[:h], theta[h:2 * h], theta[2 * h:3 * h], theta[3 * h]
    return jnp.tanh(x[:, None] * w1 + b1) @ w2 + b2


def jax_minus_log_posterior(theta, x, y, hidden: int, noise: float, prior_precision: float):
    """:func:`minus_log_posterior` in JAX (NUTS's potential energy), ``x`` and ``y`` ``(n,)``."""
    import jax.numpy as jnp

    residual = y - jax_outputs(theta, x, hidden)
    return 0.5 * jnp.sum(residual**2) / noise**2 + 0.5 * prior_precision * jnp.sum(theta**2)


def run_nuts_regression(x: torch.Tensor, y: torch.Tensor, theta_map: torch.Tensor, hidden: int, noise: float,
                        prior_precision: float, *, num_chains: int, num_warmup: int, num_samples: int,
                        target_accept_prob: float, max_tree_depth: int, init_jitter: float, seed: int,
                        x_eval: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """NUTS on the posterior of :func:`regression_mlp` (NumPyro, float64, CPU).

    ``num_chains`` chains, run one after the other, start at ``theta_map`` plus ``N(0, init_jitter^2)``
    noise, adapt a diagonal mass matrix for ``num_warmup`` steps and keep ``num_samples`` draws each.
    Returns the ``(num_chains * num_samples, d)`` draws (float32, the network's parameter order) and
    diagnostics: divergences, the share of transitions at the largest tree depth, and the smallest
    ESS and largest split R-hat (NumPyro's, not rank-normalised) of the outputs ``g(x_eval_j, theta)``
    across the chains.
    """
    import jax
    import jax.numpy as jnp
    from numpyro.diagnostics import effective_sample_size, split_gelman_rubin
    from numpyro.infer import MCMC, NUTS

    from .nuts import _cpu64

    xs = np.asarray(x, dtype=np.float64).reshape(-1)
    ys = np.asarray(y, dtype=np.float64).reshape(-1)
    x_eval_np = np.asarray(x_eval, dtype=np.float64).reshape(-1)

    def outputs(theta, inputs):
        return jax_outputs(theta, inputs, hidden)

    def potential(theta):
        return jax_minus_log_posterior(theta, xs, ys, hidden, noise, prior_precision)

    start = np.asarray(theta_map, dtype=np.float64)
    rng = np.random.default_rng(seed)
    inits = start + init_jitter * rng.standard_normal((num_chains, start.size))
    t0 = time.perf_counter()
    with _cpu64():
        kernel = NUTS(potential_fn=potential, target_accept_prob=target_accept_prob, max_tree_depth=max_tree_depth)
        mcmc = MCMC(kernel, num_warmup=num_warmup, num_samples=num_samples, num_chains=num_chains,
                    chain_method="sequential", progress_bar=False)
        init_params = jnp.asarray(inits[0] if num_chains == 1 else inits)  # one chain: no leading axis
        mcmc.run(jax.random.PRNGKey(seed), init_params=init_params, extra_fields=("diverging", "num_steps"))
        draws = np.asarray(mcmc.get_samples(group_by_chain=True), dtype=np.float64)   # (C, S, d)
        extra = {k: np.asarray(v) for k, v in mcmc.get_extra_fields().items()}
        out = np.asarray(jax.vmap(jax.vmap(lambda t: outputs(t, jnp.asarray(x_eval_np))))(jnp.asarray(draws)))
    depth = np.floor(np.log2(extra["num_steps"].astype(np.float64) + 1.0))
    diagnostics = {
        "divergences": int(extra["diverging"].sum()),
        "max_tree_depth_share": float((depth >= max_tree_depth).mean()),
        "min_ess_outputs": float(np.min(effective_sample_size(out))),
        "max_rhat_outputs": float(np.max(split_gelman_rubin(out))) if num_chains > 1 or num_samples >= 4 else math.nan,
        "wall_time_s": time.perf_counter() - t0,
    }
    return torch.tensor(draws.reshape(-1, start.size), dtype=torch.float32), diagnostics


def method_label(preconditioner: str, ridge: float, default_ridge: float) -> str:
    """``"SMP fixed-dense"``, or ``"SMP fixed-dense, ridge 1"`` for a ridge other than the default."""
    label = f"SMP {preconditioner}"
    return label if ridge == default_ridge else f"{label}, ridge {ridge:g}"


def evaluate(means: dict[str, torch.Tensor], reference_sd: dict[str, torch.Tensor], data, noise: float,
             level: float) -> dict[str, dict[str, float]]:
    """Per region: :func:`~smp_core.metrics.regression_scores`, ``median_sd``, the median over the region's inputs
    of the method's epistemic standard deviation, and ``sd_ratio``, the median of that standard deviation over
    NUTS's at the same input (both NaN for a point estimate)."""
    out = {}
    for region in REGIONS:
        row = metrics.regression_scores(means[region], data[region][1], noise, level=level)
        s = means[region].shape[0]
        sd = means[region][..., 0].double().std(dim=0) if s > 1 else None
        row["median_sd"] = math.nan if sd is None else float(sd.median())
        row["sd_ratio"] = math.nan if sd is None else float((sd / reference_sd[region]).median())
        out[region] = row
    return out


def _reference(cfg: dict[str, Any], data, alpha: float, base: int) -> dict[str, Any]:
    """The MAP, NUTS and the Laplace draws of one data set under the prior precision ``alpha`` (seeds from
    ``base``): what :func:`run_data_set` and :func:`prior_sensitivity` share."""
    x, y = data["train"]
    t0 = time.perf_counter()
    net, fit = fit_map(x, y, cfg["hidden"], cfg["noise"], alpha, cfg["map_restarts"], base + 1)
    map_time = time.perf_counter() - t0
    theta_map = as_chain_model(net).layout.flatten(net).detach()
    nuts_draws, nuts_diag = run_nuts_regression(
        x, y, theta_map, cfg["hidden"], cfg["noise"], alpha, num_chains=cfg["nuts_chains"],
        num_warmup=cfg["nuts_warmup"], num_samples=cfg["nuts_samples"], target_accept_prob=cfg["nuts_target_accept"],
        max_tree_depth=cfg["nuts_max_tree_depth"], init_jitter=cfg["nuts_init_jitter"], seed=base + 1,
        x_eval=torch.linspace(-4, 4, 17)[:, None])
    t0 = time.perf_counter()
    laplace = fit_laplace(net, Gaussian(cfg["noise"]), theta_map, x, y, prior_precision=alpha, structure="dense")
    laplace_draws = laplace.sample(cfg["n_chains"], torch.Generator().manual_seed(base + 1))
    return {"net": net, "fit": fit, "theta_map": theta_map, "nuts_draws": nuts_draws, "nuts": nuts_diag,
            "laplace_draws": laplace_draws, "timings": {"MAP": map_time, "NUTS": nuts_diag["wall_time_s"],
                                                        "Laplace (linearised)": time.perf_counter() - t0}}


def _checked_settings(cfg: dict[str, Any]) -> tuple[list[tuple[str, str, str, float, str]], list[float]]:
    """Every SMP setting of ``cfg`` checked before any work (NUTS takes minutes): the design runs as
    ``(label, design, preconditioner, ridge, fisher_from)`` and their tau grid."""
    for variant in cfg["smp_variants"]:
        if len(variant) != 2:
            raise ValueError(f"an smp_variants entry is [preconditioner, ridge], got {variant!r}")
        parse_preconditioner_name(variant[0])
    variants = cfg.get("design_variants", [])
    designs = []
    for variant in variants:
        if len(variant) != 4:
            raise ValueError("a design_variants entry is [design, preconditioner, ridge, fisher_from], "
                             f"got {variant!r}")
        design, preconditioner, ridge, fisher_from = variant
        if design not in DESIGNS:
            raise ValueError(f"unknown design {design!r} in design_variants; choose one of {DESIGNS}")
        parse_preconditioner_name(preconditioner)
        designs.append((design_label(preconditioner, ridge, cfg["ridge"], design, fisher_from), design,
                        preconditioner, ridge, fisher_from))
    if variants and not int(cfg.get("design_pool_size", 0)) >= 1:
        raise ValueError(f"design_variants need a design_pool_size of at least 1, got {cfg.get('design_pool_size')!r}")
    labels = [method_label(p, r, cfg["ridge"]) for p, r in cfg["smp_variants"]] + [d[0] for d in designs]
    if len(set(labels)) < len(labels):
        raise ValueError(f"two SMP settings share a label: {labels}")
    design_taus = cfg.get("design_tau_grid", cfg["tau_grid"])
    if max(len(cfg["tau_grid"]), len(design_taus)) > 10 or len(labels) > 89:
        raise ValueError("the SMP seeds base + 100 + 10 v + t need at most 10 taus and 89 variants (designs included)")
    return designs, design_taus


def run_data_set(cfg: dict[str, Any], index: int, progress: bool = False) -> dict[str, Any]:
    """One data set: its MAP, NUTS, the Laplace approximation and every SMP run of ``cfg``, evaluated.

    ``cfg["design_variants"]`` (optional) adds SMP runs whose covariates are resampled from a
    :func:`design_pool` of ``cfg["design_pool_size"]`` points (``[design, preconditioner, ridge, fisher_from]``;
    ``fisher_from`` ``"data"``: the preconditioner's Fisher from the training inputs, ``"design"``: from the
    pool), labelled by :func:`design_label`, at every ``tau`` of ``cfg["design_tau_grid"]`` (default: the
    ``tau_grid``); every SMP run takes ``N`` (the training inputs' number) in its step size ``tau / (N + k)``.

    Seeds: data ``seed + 1000 index``; MAP restarts, NUTS and Laplace from ``seed + 1000 index + 1``;
    the SMP run of variant ``v`` and ``tau`` position ``t`` from ``seed + 1000 index + 100 + 10 v + t`` (the
    design variants numbered after ``cfg["smp_variants"]``); the pool of design ``D`` from
    ``seed + 1000 index + 50 + DESIGNS.index(D)`` (apart from the MAP restarts' ``+ 1 + r``).
    The block, dense and kfac statistics are kept in ``cfg["statistic_dtype"]`` (float64: the Fisher's
    eigenvalues span more than float32 resolves against the ridge; ``smp_core.preconditioners``).
    Returns rows (one per method, tau and region, with the diverged chains and the factorisations that
    warned of rounding), NUTS's diagnostics, the MAP's fit, the eigenvalues of the model-expected Fisher
    at the MAP (float64), the wall times, and for the figure the 5 %, 50 % and 95 % predictive
    quantiles and the epistemic standard deviation on the grid of every method (SMP at every tau).
    """
    designs, design_taus = _checked_settings(cfg)
    base = cfg["seed"] + 1000 * index
    noise, alpha, level = cfg["noise"], cfg["prior_precision"], cfg["level"]
    data = gap_data(cfg["n_train"], cfg["n_in"], cfg["n_gap"], noise, base)
    x, y = data["train"]
    grid = torch.linspace(-4, 4, cfg["grid_points"])[:, None]
    inputs = {region: data[region][0] for region in REGIONS}
    inputs["grid"] = grid
    reference = _reference(cfg, data, alpha, base)
    net, fit, theta_map, nuts_diag = reference["net"], reference["fit"], reference["theta_map"], reference["nuts"]
    timings: dict[str, float] = dict(reference["timings"])
    chain = as_chain_model(net)
    fisher = estimate_fisher(chain, Gaussian(noise), theta_map, x, structure="dense", dtype=torch.float64)[0][0]
    fisher_eigenvalues = torch.linalg.eigvalsh(fisher).flip(0)

    def network_means(theta):
        return {name: predict(chain, theta, xs) for name, xs in inputs.items()}

    # label (SMP: "label|tau") -> (tau, means per input set; None where every chain, or all but one, diverged)
    methods: dict[str, tuple[float, dict[str, torch.Tensor] | None]] = {}
    methods["NUTS"] = (math.nan, network_means(reference["nuts_draws"]))
    reference_sd = {region: methods["NUTS"][1][region][..., 0].double().std(dim=0) for region in REGIONS}
    methods["MAP"] = (math.nan, network_means(theta_map[None]))
    laplace_draws = reference["laplace_draws"]
    methods["Laplace (linearised)"] = (math.nan, {name: linearised_logits(net, theta_map, laplace_draws, xs)
                                                  for name, xs in inputs.items()})

    diverged: dict[tuple[str, float], int] = {}
    rounding: dict[tuple[str, float], int] = {}

    def run_setting(label: str, v: int, preconditioner: str, ridge: float, pool: torch.Tensor,
                    fisher_x: torch.Tensor, taus: list[float]) -> None:
        structured = preconditioner != "none" and not preconditioner.endswith("-diag")
        precond = preconditioner_from_name(preconditioner, ridge=ridge,
                                           statistic_dtype=cfg["statistic_dtype"] if structured else None)
        for t, tau in enumerate(taus):
            t0 = time.perf_counter()
            draws = None
            with warnings.catch_warnings(record=True) as caught:  # diverged chains are counted in `diverged`
                warnings.simplefilter("always")
                try:
                    run = run_smp(net, Gaussian(noise), pool, preconditioner=precond, tau=tau,
                                  n_steps=cfg["n_steps"], n_chains=cfg["n_chains"], seed=base + 100 + 10 * v + t,
                                  n_obs=len(x), fisher=Fisher("model", fisher_x), progress=progress)
                    draws = run.samples()
                    diverged[(label, tau)] = int(run.diverged.sum())
                except DivergenceError:
                    diverged[(label, tau)] = cfg["n_chains"]
            rounding[(label, tau)] = sum(str(w.message) == ROUNDED_STATISTIC_WARNING for w in caught)
            timings[f"{label}, tau {tau:g}"] = time.perf_counter() - t0
            usable = draws is not None and draws.shape[0] >= 2
            methods[f"{label}|{tau:g}"] = (tau, network_means(draws) if usable else None)

    for v, (preconditioner, ridge) in enumerate(cfg["smp_variants"]):
        run_setting(method_label(preconditioner, ridge, cfg["ridge"]), v, preconditioner, ridge, x, x, cfg["tau_grid"])
    for j, (label, design, preconditioner, ridge, fisher_from) in enumerate(designs):
        pool = design_pool(x, design, cfg["design_pool_size"], base + POOL_SEED_OFFSET + DESIGNS.index(design))
        run_setting(label, len(cfg["smp_variants"]) + j, preconditioner, ridge, pool,
                    pool if fisher_from == "design" else x, design_taus)

    rows, bands = [], {}
    for key, (tau, means) in methods.items():
        label = key.split("|")[0]
        if means is None:
            rows += [{"method": label, "tau": tau, "region": region} for region in REGIONS]
            continue
        scored = evaluate(means, reference_sd, data, noise, level)
        for region, row in scored.items():
            rows.append({"method": label, "tau": tau, "region": region, **row})
        g = means["grid"]
        bands[key] = {"q05": metrics.predictive_quantile(g, noise, 0.05).float(),
                      "q50": metrics.predictive_quantile(g, noise, 0.5).float(),
                      "q95": metrics.predictive_quantile(g, noise, 0.95).float(),
                      "epistemic_sd": g[..., 0].double().std(dim=0).float() if g.shape[0] > 1
                      else torch.zeros(g.shape[1])}
    table = pd.DataFrame(rows)
    table["data_set"] = index
    table["diverged"] = [diverged.get((m, t), 0) if not math.isnan(t) else 0
                         for m, t in zip(table["method"], table["tau"], strict=True)]
    table["rounding_warnings"] = [rounding.get((m, t), 0) if not math.isnan(t) else 0
                                  for m, t in zip(table["method"], table["tau"], strict=True)]
    return {"rows": table, "nuts": nuts_diag, "map": fit, "timings": timings, "bands": bands,
            "grid": grid[:, 0], "train": (x[:, 0], y), "fisher_eigenvalues": fisher_eigenvalues}


def summary_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Median over the data sets of every score, per method, tau and region; ``data_sets`` counts the data
    sets with a result (a setting whose chains all diverged on a data set has none there) and
    ``max_diverged`` is the most chains that diverged on any one data set."""
    keys = ["method", "tau", "region"]
    filled = rows.assign(tau=rows["tau"].fillna(-1.0))
    values = [c for c in rows.columns if c not in (*keys, "data_set")]
    grouped = filled.groupby(keys, sort=False)
    median = grouped[values].median()
    median["data_sets"] = grouped["coverage"].count()
    median["max_diverged"] = grouped["diverged"].max()
    median = median.reset_index()
    median["tau"] = median["tau"].where(median["tau"] >= 0)
    return median.set_index(keys)


def eligible(summary: pd.DataFrame, n_data_sets: int) -> pd.Series:
    """Settings (rows of :func:`summary_table`) with a result on every data set and no diverged chain on any:
    their medians are over the same data sets and not over the less dispersed chains that survived."""
    return (summary["data_sets"] == n_data_sets) & (summary["max_diverged"] == 0)


def best_tau(summary: pd.DataFrame, n_data_sets: int, region: str = "in range") -> pd.DataFrame:
    """Per SMP method, among its eligible ``tau`` (:func:`eligible`), the one whose median ``sd_ratio`` in
    ``region`` is nearest 1 on the log scale (matching NUTS's spread there), with its median scores in both
    regions; ``within 2x`` says whether that ratio is within a factor 2 of 1 (where it is not, no ``tau`` of
    the grid matches), ``eligible taus`` how many there were. A method with none has a row with ``tau`` NaN."""
    ok = eligible(summary, n_data_sets)
    smp = summary[summary.index.get_level_values("method").str.startswith("SMP")]
    out = []
    for method in dict.fromkeys(smp.index.get_level_values("method")):
        one = smp.xs(method, level="method")
        fine = ok.xs(method, level="method").groupby(level="tau").all()
        ratio = one.xs(region, level="region")["sd_ratio"][fine].dropna()
        if ratio.empty:
            out.append({"method": method, "tau": math.nan, "within 2x": False, "eligible taus": 0})
            continue
        tau = float(np.log(ratio).abs().idxmin())
        row = {"method": method, "tau": tau, "within 2x": bool(abs(math.log(ratio[tau])) <= math.log(2.0)),
               "eligible taus": len(ratio)}
        for r in REGIONS:
            picked = one.loc[(tau, r)]
            row.update({f"sd_ratio ({r})": picked["sd_ratio"], f"coverage ({r})": picked["coverage"],
                        f"nll ({r})": picked["nll"]})
        out.append(row)
    return pd.DataFrame(out).set_index("method")


def spread_shape(rows: pd.DataFrame, n_data_sets: int) -> pd.DataFrame:
    """How a method's spread is shared between the regions, against NUTS's: per data set, method and ``tau``,
    ``sd_ratio`` in the gap over ``sd_ratio`` in range (1: the gap holds as much of the spread, relative to the
    data's range, as under NUTS; 0.1: a tenth as much), then the median over data sets. Unlike either ratio alone
    it does not grow with ``tau`` while the chains stay near the MAP (both grow in proportion). Rows: methods;
    columns: ``tau`` (NaN for the methods without one); NaN where a setting is not :func:`eligible`."""
    keyed = rows.assign(tau=rows["tau"].fillna(-1.0)).set_index(["data_set", "method", "tau", "region"])["sd_ratio"]
    ratio = keyed.xs(REGIONS[1], level="region") / keyed.xs(REGIONS[0], level="region")
    shape = ratio.groupby(level=["method", "tau"], sort=False).median()
    ok: dict[tuple[str, float], bool] = {}
    for (method, tau, _), fine in eligible(summary_table(rows), n_data_sets).items():
        key = (method, -1.0 if pd.isna(tau) else tau)
        ok[key] = ok.get(key, True) and bool(fine)
    shape = shape.where(pd.Series([ok.get(key, False) for key in shape.index], index=shape.index)).unstack("tau")
    shape.columns = [math.nan if t < 0 else t for t in shape.columns]
    return shape.loc[list(dict.fromkeys(rows["method"]))]


def matched_in_both(summary: pd.DataFrame, n_data_sets: int, factor: float = 2.0) -> list[tuple[str, float]]:
    """The eligible SMP settings (``(method, tau)``, :func:`eligible`) whose median ``sd_ratio`` is within ``factor``
    of 1 in every region: those that match NUTS's spread where the data are and in the gap at once."""
    fine = eligible(summary, n_data_sets)
    out = []
    for (method, tau), group in summary[fine].groupby(level=("method", "tau"), sort=False):
        ratios = group["sd_ratio"]
        if (method.startswith("SMP") and len(group) == len(REGIONS) and ratios.notna().all()
                and all(r > 0 and abs(math.log(r)) <= math.log(factor) for r in ratios)):
            out.append((method, tau))
    return out


def prior_sensitivity(cfg: dict[str, Any], alpha: float, index: int = 0) -> dict[str, Any]:
    """The reference under another prior: on data set ``index``, the MAP, NUTS and the linearised Laplace
    approximation with prior precision ``alpha`` (the other settings, seeds included, as in
    :func:`run_data_set`). Returns, per region, the median over its inputs of each method's epistemic
    standard deviation and its 90 % coverage, with NUTS's diagnostics."""
    base = cfg["seed"] + 1000 * index
    data = gap_data(cfg["n_train"], cfg["n_in"], cfg["n_gap"], cfg["noise"], base)
    reference = _reference(cfg, data, alpha, base)
    net, theta_map = reference["net"], reference["theta_map"]
    rows = []
    for region in REGIONS:
        inputs, targets = data[region]
        for method, means in (("NUTS", predict(as_chain_model(net), reference["nuts_draws"], inputs)),
                              ("Laplace (linearised)",
                               linearised_logits(net, theta_map, reference["laplace_draws"], inputs))):
            rows.append({"prior precision": alpha, "method": method, "region": region,
                         "median sd": float(means[..., 0].double().std(dim=0).median()),
                         "coverage": metrics.interval_coverage(means, targets, cfg["noise"], cfg["level"])})
    return {"rows": pd.DataFrame(rows), "nuts": reference["nuts"], "map": reference["fit"]}


# ----------------------------------------------------------------------------------------------
# The chapter's results (smp_book.pipeline): everything notebooks/regression.md shows

REFERENCES = ("NUTS", "MAP", "Laplace (linearised)")


def wide_table(summary: pd.DataFrame, metric_names, extra=("max_diverged", "data_sets")) -> pd.DataFrame:
    """:func:`summary_table` with the regions side by side: ``<metric> (<region>)`` for each of ``metric_names``
    and both regions, then the ``extra`` columns (those of the data's range, where every region has the same)."""
    wide = summary.unstack("region")
    wide.columns = [f"{metric} ({region})" for metric, region in wide.columns]
    columns = [f"{metric} ({region})" for metric in metric_names for region in REGIONS]
    renamed = {f"{name} ({REGIONS[0]})": name for name in extra}
    return wide[columns + list(renamed)].rename(columns=renamed)


def _smallest_tau_share(shape: pd.DataFrame, method: str) -> tuple[float, float] | None:
    """``(tau, gap share)`` of ``method`` at its smallest eligible ``tau`` in :func:`spread_shape`'s table, or None."""
    values = shape.loc[method].dropna() if method in shape.index else pd.Series(dtype=float)
    values = values[[not pd.isna(t) for t in values.index]]
    return (float(values.index[0]), float(values.iloc[0])) if len(values) else None


def _share_text(found: tuple[float, float] | None) -> str:
    return f"{found[1]:.3f} at tau = {found[0]:g}" if found else "none eligible"


def _nuts_value(summary: pd.DataFrame, column: str, region: str) -> float:
    return float(summary.xs(("NUTS", region), level=("method", "region"))[column].iloc[0])


def matched_findings(summary: pd.DataFrame, matched: pd.DataFrame, shape: pd.DataFrame,
                     n_data_sets: int) -> str:
    """The findings of the empirical design's runs, one Markdown bullet per SMP setting: at the ``tau`` matched
    to NUTS's spread in range (:func:`best_tau`), its spread in the gap against NUTS's, its gap share
    (:func:`spread_shape`) and its 90 % coverage of the gap; then Laplace's and the settings that match NUTS's
    spread in both regions (:func:`matched_in_both`)."""
    lines = []
    for method, row in matched.iterrows():
        if math.isnan(row["tau"]):
            lines.append(f"{method}: no tau of the grid gives a result on every data set without a diverged chain")
        elif not row["within 2x"]:
            lines.append(f"{method}: no tau of the grid comes within a factor 2 of NUTS's spread in range (nearest: "
                         f"{row['sd_ratio (in range)']:.3g} times, at tau = {row['tau']:g})")
        else:
            lines.append(f"{method} at tau = {row['tau']:g} (spread {row['sd_ratio (in range)']:.2f} times NUTS's in "
                         f"range): {row['sd_ratio (in the gap)']:.3f} times NUTS's in the gap, a gap share of "
                         f"{shape.loc[method, row['tau']]:.3f}; 90 % intervals cover "
                         f"{row['coverage (in the gap)']:.0%} of the gap points (NUTS "
                         f"{_nuts_value(summary, 'coverage', 'in the gap'):.0%})")
    laplace = summary.xs("Laplace (linearised)", level="method")
    lines.append(f"Laplace (linearised): {laplace.xs('in range', level='region')['sd_ratio'].iloc[0]:.2f} times "
                 f"NUTS's spread in range, {laplace.xs('in the gap', level='region')['sd_ratio'].iloc[0]:.2f} in the "
                 f"gap, a gap share of {shape.loc['Laplace (linearised)'].dropna().iloc[0]:.2f}")
    return _with_both(lines, "SMP settings", summary, n_data_sets)


def _with_both(lines: list[str], which: str, summary: pd.DataFrame, n_data_sets: int) -> str:
    """``lines`` as a Markdown list, ending with the settings matched to NUTS's spread in both regions."""
    both = matched_in_both(summary, n_data_sets)
    lines.append(f"{which} within a factor 2 of NUTS's spread in both regions: "
                 + (", ".join(f"{m} at tau = {t:g}" for m, t in both) if both else "none"))
    return "\n".join(f"- {line}" for line in lines)


def prior_table(rows: pd.DataFrame, sensitivity: list[dict[str, Any]], prior_precision: float) -> pd.DataFrame:
    """NUTS's and Laplace's median epistemic standard deviation and 90 % coverage on the first data set, per
    region, under the chapter's prior (``rows`` of :func:`run_data_set`) and under each prior of
    :func:`prior_sensitivity` (``sensitivity``); columns ``(value, prior precision)``."""
    first = rows[(rows["data_set"] == 0) & rows["method"].isin(["NUTS", "Laplace (linearised)"])]
    table = pd.concat([first.assign(**{"prior precision": prior_precision}).rename(columns={"median_sd": "median sd"}),
                       *[part["rows"] for part in sensitivity]])
    return table.pivot_table(index=["method", "region"], columns="prior precision", values=["median sd", "coverage"],
                             sort=False)


def prior_findings(table: pd.DataFrame, rows: pd.DataFrame, matched: pd.DataFrame,
                   sensitivity: list[dict[str, Any]]) -> str:
    """What :func:`prior_table` says, as Markdown bullets: how far NUTS's median spread moves over the priors in
    each region, the first data set's SMP spread in the gap (at the ``tau`` matched in range) against NUTS's under
    the tightest prior, and NUTS's diagnostics under each other prior."""
    nuts_gap = table.loc[("NUTS", "in the gap"), "median sd"]
    nuts_range = table.loc[("NUTS", "in range"), "median sd"]
    lines = [f"NUTS's median spread over the priors of the table: {nuts_gap.min():.3g} to {nuts_gap.max():.3g} in the "
             f"gap (a factor {nuts_gap.max() / nuts_gap.min():.2f}), {nuts_range.min():.3g} to {nuts_range.max():.3g} "
             f"in range (a factor {nuts_range.max() / nuts_range.min():.2f})"]
    first_smp = rows[rows["data_set"] == 0].set_index(["method", "tau", "region"])["median_sd"]
    for method, row in matched.iterrows():
        if row["within 2x"]:
            gap_sd = first_smp.loc[(method, row["tau"], "in the gap")]
            lines.append(f"{method} at tau = {row['tau']:g} (matched in range), first data set: median spread "
                         f"{gap_sd:.3g} in the gap, {gap_sd / nuts_gap.min():.2f} times NUTS's under the tightest "
                         "prior of the table")
    for part in sensitivity:
        d = part["nuts"]
        lines.append(f"NUTS with alpha = {part['rows']['prior precision'].iloc[0]:g}: {d['divergences']} divergences, "
                     f"largest split R-hat {d['max_rhat_outputs']:.3f}, smallest ESS {d['min_ess_outputs']:.0f}")
    return "\n".join(f"- {line}" for line in lines)


def design_findings(summary: pd.DataFrame, matched: pd.DataFrame, shape: pd.DataFrame,
                    empirical_shape: pd.DataFrame, n_data_sets: int) -> str:
    """The design runs' findings, one Markdown bullet per setting: its gap share at its smallest eligible ``tau``
    (first order) beside the same preconditioner and ridge with the empirical design, and at the ``tau`` matched
    to NUTS's spread in range its spread in the gap, gap share and coverage; then the settings that match NUTS's
    spread in both regions."""
    lines = []
    for method, row in matched.iterrows():
        empirical = empirical_counterpart(method)
        theirs = (_share_text(_smallest_tau_share(empirical_shape, empirical)) if empirical in empirical_shape.index
                  else "not run")
        ours = _share_text(_smallest_tau_share(shape, method))
        text = f"{method}: gap share {ours} (the empirical design's: {theirs})"
        if math.isnan(row["tau"]) or not row["within 2x"]:
            lines.append(text + "; no eligible tau within a factor 2 of NUTS's spread in range")
            continue
        lines.append(text + f"; at tau = {row['tau']:g}, matched in range ({row['sd_ratio (in range)']:.2f} times "
                     f"NUTS's spread there): {row['sd_ratio (in the gap)']:.3f} times NUTS's in the gap, a gap share "
                     f"of {shape.loc[method, row['tau']]:.3f}; 90 % intervals cover "
                     f"{row['coverage (in the gap)']:.0%} of the gap points")
    return _with_both(lines, "design settings", summary, n_data_sets)


def design_reading(matched: pd.DataFrame, shape: pd.DataFrame, empirical_shape: pd.DataFrame) -> str:
    """The design runs grouped as the chapter reads them, as Markdown bullets with the numbers each reading rests
    on: the design with ``P = I`` or a diagonal ``P`` (its first-order gap share over the empirical design's), the
    design with the data's structured ``P`` (the same, with the ridge), at NUTS's spread (the gap share at the
    ``tau`` matched in range over its first-order value) and the design's own ``P`` (its gap share over that of
    the data's ``P`` with the same design and ridge). A group without a run is left out."""
    def first_order(table, method):
        found = _smallest_tau_share(table, method) if method in table.index else None
        return None if found is None else found[1]

    alone, data_p, own_p, at_match = [], [], [], []
    for method, row in matched.iterrows():
        share = first_order(shape, method)
        empirical = first_order(empirical_shape, empirical_counterpart(method))
        against = f"{share:.3f} against {empirical:.3f}" if share is not None and empirical is not None else None
        preconditioner = empirical_counterpart(method).removeprefix("SMP ").split(",")[0]
        if method.endswith(", P from the design"):
            data_label = method.removesuffix(", P from the design")
            data_share = first_order(shape, data_label)
            if share is not None:
                own_p.append(f"{method}: {share:.3f}" + (f" (the data's P: {data_share:.3f}" if data_share is not None
                                                         else " (the data's P: not run")
                             + (f"; the empirical design's: {empirical:.3f})" if empirical is not None else ")"))
        elif preconditioner == "none" or preconditioner.endswith("-diag"):
            if against:
                alone.append(f"{method}: {against} ({share / empirical:.2f} times)")
        elif share is not None:
            data_p.append(f"{method}: {share:.3f}" + (f" against {empirical:.3f} ({share / empirical:.1f} times)"
                                                      if empirical is not None else " (the empirical design: not run)"))
        if share is not None and not math.isnan(row["tau"]) and row["within 2x"]:
            at_match.append(f"{method}: {shape.loc[method, row['tau']]:.3f} at tau = {row['tau']:g} against "
                            f"{share:.3f} at the smallest tau")
    groups = [("The design with $P = I$ or a diagonal $P$", "gap share at the smallest $\\tau$, against the "
               "empirical design's with the same preconditioner", alone),
              ("The design with the data's structured $P$", "gap share at the smallest $\\tau$, against the "
               "empirical design's with the same preconditioner and ridge (NUTS: 1)", data_p),
              ("At NUTS's spread in range", "gap share at the matched $\\tau$, against that at the smallest $\\tau$",
               at_match),
              ("The design's own $P$", "gap share at the smallest $\\tau$, against the data's $P$ with the same design "
               "and ridge", own_p)]
    return "\n".join(f"- **{title}** ({what}): " + "; ".join(items) + "." for title, what, items in groups if items)


def spread_ratio_figure(summary: pd.DataFrame):
    """Per region, the median spread ratio of every SMP setting against ``tau`` (log-log), with NUTS's (1) and
    Laplace's."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    smp = [m for m in dict.fromkeys(summary.index.get_level_values("method")) if m.startswith("SMP")]
    for ax, region in zip(axes, REGIONS, strict=True):
        for method in smp:
            one = summary.xs((method, region), level=("method", "region"))["sd_ratio"].dropna()
            ax.plot(one.index, one.values, "o-", ms=3, label=method.removeprefix("SMP "))
        laplace = summary.xs(("Laplace (linearised)", region), level=("method", "region"))["sd_ratio"].iloc[0]
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(laplace, color="0.5", ls="--", lw=0.8, label="Laplace (linearised)")
        ax.set(xscale="log", yscale="log", xlabel=r"$\tau$", title=f"spread / NUTS's spread, {region}")
    axes[0].set_ylabel("median ratio of standard deviations")
    axes[1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def bands_figure(run: dict[str, Any], keys: list[str], columns: int = 4, fontsize: float = 8,
                 wrap: bool = False):
    """The 5 %, 50 % and 95 % predictive quantiles of the methods ``keys`` (``"NUTS"``, ``"MAP"``, ``"<SMP
    label>|<tau>"``) of one data set (``run``, from :func:`run_data_set`) on its grid, with the regression
    function (dashed), the training points and the gap (grey). ``wrap``: break a label before its design."""
    import matplotlib.pyplot as plt

    keys = [key for key in keys if key in run["bands"]]
    n_rows = max(1, math.ceil(len(keys) / columns))
    fig, axes = plt.subplots(n_rows, columns, figsize=(3.4 * columns, 2.9 * n_rows), sharex=True, sharey=True,
                             squeeze=False)
    grid = run["grid"]
    for ax, key in zip(axes.flat, keys, strict=False):
        band = run["bands"][key]
        ax.axvspan(*GAP, color="0.92", lw=0)
        ax.fill_between(grid, band["q05"], band["q95"], alpha=0.35)
        ax.plot(grid, band["q50"], lw=1)
        ax.plot(grid, curve(grid), "k--", lw=0.7)
        ax.plot(*run["train"], "k.", ms=2)
        label, _, tau = key.partition("|")
        if wrap:
            for design in DESIGNS:
                label = label.replace(f", {design}", f",\n{design}")
        ax.set(title=label + (f", tau {tau}" if tau else ""), ylim=(-4, 4))
        ax.title.set_fontsize(fontsize)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def _matched_keys(matched: pd.DataFrame) -> list[str]:
    return [f"{m}|{row['tau']:g}" for m, row in matched.iterrows() if row["within 2x"]]


def _grid_text(values) -> str:
    return ", ".join(f"{v:g}" for v in values)


def compute(ctx) -> None:
    """The regression chapter's results (:mod:`smp_book.pipeline`): every data set (its MAP, NUTS, Laplace and
    SMP runs, :func:`run_data_set`, cached under ``.cache/regression/``), the scores and their medians, the
    ``tau`` matched to NUTS's spread, the gap shares, the prior's part (:func:`prior_sensitivity`, cached), the
    design runs, the figures and the numbers the prose quotes."""
    from .pipeline import cached, code_hash

    cfg = ctx.config
    n = cfg["data_sets"]
    runs = [cached("regression", {**cfg, "data_set": i, "code": code_hash(__name__)},
                   lambda i=i: run_data_set(cfg, i, progress=ctx.progress), enabled=ctx.use_cache)
            for i in range(n)]
    names = [f"data set {i}" for i in range(n)]
    all_rows = ctx.table("scores_per_data_set", pd.concat([run["rows"] for run in runs], ignore_index=True),
                         index=False)
    from_a_design = all_rows["method"].str.contains(" design")  # the last section's runs
    rows = all_rows[~from_a_design]
    summary = ctx.table("scores_median", summary_table(rows))
    elapsed = pd.DataFrame([run["timings"] for run in runs]).T
    elapsed.columns = names
    ctx.table("elapsed", elapsed)
    ctx.table("map_fit", pd.DataFrame([run["map"] for run in runs], index=names))
    nuts = ctx.table("nuts_diagnostics", pd.DataFrame([run["nuts"] for run in runs], index=names))
    eigenvalues = runs[0]["fisher_eigenvalues"]
    ctx.table("fisher_eigenvalues", pd.DataFrame({"eigenvalue": eigenvalues.numpy()}), index=False)
    ctx.table("scores_wide", wide_table(summary, ("sd_ratio", "coverage", "interval_width", "nll", "crps"),
                                        ("max_diverged", "data_sets", "rounding_warnings")))
    ctx.figure("spread_ratio", spread_ratio_figure(summary))

    matched = {region: ctx.table(f"tau_matched_{region.replace(' ', '_')}", best_tau(summary, n, region))
               for region in REGIONS}
    shape = spread_shape(rows, n)
    ctx.table("spread_shape", shape.set_axis(["no tau" if pd.isna(c) else c for c in shape.columns], axis=1))
    ctx.value("matched_text", matched_findings(summary, matched["in range"], shape, n))
    first = runs[0]
    ctx.figure("bands", bands_figure(first, list(REFERENCES) + _matched_keys(matched["in range"])))

    reference_cfg = {k: v for k, v in cfg.items() if not k.startswith("design_")}  # the design runs play no part
    sensitivity = [cached("regression", {**reference_cfg, "sensitivity_prior_precision": alpha,
                                         "code": code_hash(__name__)},
                          lambda alpha=alpha: prior_sensitivity(cfg, alpha), enabled=ctx.use_cache)
                   for alpha in cfg["prior_sensitivity"]]
    priors = ctx.table("prior_sensitivity", prior_table(rows, sensitivity, cfg["prior_precision"]))
    ctx.value("prior_text", prior_findings(priors, rows, matched["in range"], sensitivity))

    design_rows = all_rows[from_a_design | all_rows["method"].isin(REFERENCES)]
    design_summary = summary_table(design_rows)
    ctx.table("design_scores_wide", wide_table(design_summary, ("sd_ratio", "coverage", "nll")))
    design_matched = ctx.table("design_tau_matched_in_range", best_tau(design_summary, n, "in range"))
    design_shape = spread_shape(design_rows, n)
    ctx.table("design_spread_shape",
              design_shape.set_axis(["no tau" if pd.isna(c) else c for c in design_shape.columns], axis=1))
    ctx.value("design_text", design_findings(design_summary, design_matched, design_shape, shape, n))
    ctx.value("design_reading", design_reading(design_matched, design_shape, shape))
    ctx.figure("design_bands", bands_figure(first, ["NUTS"] + _matched_keys(design_matched), fontsize=7, wrap=True))

    # the settings the prose quotes
    for key in ("n_train", "n_in", "n_gap", "noise", "hidden", "data_sets", "map_restarts", "nuts_chains",
                "nuts_warmup", "nuts_samples", "nuts_target_accept", "nuts_max_tree_depth", "nuts_init_jitter",
                "n_chains", "n_steps", "ridge", "level", "prior_precision", "design_pool_size"):
        ctx.value(key, cfg[key])
    ctx.value("dim", len(eigenvalues))
    ctx.value("max_leapfrog", 2 ** cfg["nuts_max_tree_depth"] - 1)
    ctx.value("share_at_K", 1 - cfg["n_train"] / (cfg["n_train"] + cfg["n_steps"]))
    ctx.value("tau_grid", _grid_text(cfg["tau_grid"]))
    ctx.value("design_tau_grid", _grid_text(cfg.get("design_tau_grid", cfg["tau_grid"])))
    ctx.value("prior_alphas", " and ".join(f"{a:g}" for a in cfg["prior_sensitivity"]))
    settings = [method_label(p, r, cfg["ridge"]).removeprefix("SMP ") for p, r in cfg["smp_variants"]]
    ctx.value("smp_settings", "; ".join(settings))
    ctx.value("design_settings", "; ".join(design_label(p, r, cfg["ridge"], d, f).removeprefix("SMP ")
                                           for d, p, r, f in cfg.get("design_variants", [])))
    ctx.value("coverage_se_gap", math.sqrt(cfg["level"] * (1 - cfg["level"]) / cfg["n_gap"]))

    # the numbers the prose quotes
    healthy = (nuts["divergences"] == 0) & (nuts["max_rhat_outputs"] < 1.05) & (nuts["min_ess_outputs"] > 100)
    ctx.value("nuts_healthy", int(healthy.sum()))
    ctx.value("tree_depth_share_min", nuts["max_tree_depth_share"].min())
    ctx.value("tree_depth_share_max", nuts["max_tree_depth_share"].max())
    ctx.value("fisher_largest", ", ".join(f"{v:.3g}" for v in eigenvalues[:6].tolist()))
    ctx.value("fisher_above_1", int((eigenvalues > 1).sum()))
    ctx.value("fisher_above_ridge", int((eigenvalues > cfg["ridge"]).sum()))
    x = gap_data(cfg["n_train"], cfg["n_in"], cfg["n_gap"], cfg["noise"], cfg["seed"])["train"][0]
    ctx.value("smoothed_bandwidth", float(smoothing_bandwidth(x)[0]))
    for design in DESIGNS[1:]:
        pool = design_pool(x, design, cfg["design_pool_size"], cfg["seed"] + POOL_SEED_OFFSET + DESIGNS.index(design))
        ctx.value(f"{design}_gap_share", float(((pool > GAP[0]) & (pool < GAP[1])).double().mean()))
    laplace = summary.xs("Laplace (linearised)", level="method")["sd_ratio"]
    ctx.value("laplace_range", laplace.xs("in range", level="region").iloc[0])
    ctx.value("laplace_gap", laplace.xs("in the gap", level="region").iloc[0])
    ctx.value("nuts_coverage_gap", _nuts_value(summary, "coverage", "in the gap"))
    fine = matched["in range"][matched["in range"]["within 2x"]]
    both = matched_in_both(summary, n)
    if len(fine):
        gap = fine["sd_ratio (in the gap)"]
        answer = (f"Matched to NUTS's spread where the data are, the {len(fine)} SMP setting(s) that come within a "
                  f"factor 2 of it spread {gap.min():.2g} to {gap.max():.2g} times as much as NUTS in the gap, "
                  f"against {laplace.xs('in the gap', level='region').iloc[0]:.2f} times for the linearised Laplace "
                  "approximation")
    else:
        answer = "No SMP setting of the grid comes within a factor 2 of NUTS's spread where the data are"
    ctx.value("answer", answer + f"; {len(both)} SMP setting(s) of the empirical design come within a factor 2 of "
              "NUTS's spread in both regions.")
    ctx.record(seeds={"seed": cfg["seed"], "data_sets": [cfg["seed"] + 1000 * i for i in range(n)]})
