"""Beyond the paper (``notebooks/regression.md``): where SMP puts its spread in a regression whose data leave a gap,
beside NUTS, the MAP and the linearised Laplace approximation; scored by ``regression_scores`` and the spread ratio,
the median over a region's inputs of a method's epistemic standard deviation over NUTS's."""

import contextlib
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

REGIONS = ("in range", "in the gap")
GAP = (-1.0, 1.0)
REFERENCES = ("NUTS", "MAP", "Laplace (linearised)")


def curve(x: torch.Tensor) -> torch.Tensor:
    """The regression function ``sin 2x + 0.3 x``."""
    return torch.sin(2 * x) + 0.3 * x


def gap_data(n_train: int, n_in: int, n_gap: int, noise: float,
             seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"train", "in range", "in the gap"}: (x (n, 1), y (n,))`` in float32 from one seed (the gap ``(-1, 1)``)."""
    if min(n_train, n_in, n_gap) < 2:
        raise ValueError(f"every set needs at least 2 points, got n_train={n_train}, n_in={n_in}, n_gap={n_gap}")
    gen = torch.Generator().manual_seed(seed)

    def two_sides(n: int) -> torch.Tensor:
        return torch.cat([torch.rand(n // 2, generator=gen) * 2 - 3, torch.rand(n - n // 2, generator=gen) * 2 + 1])

    inputs = {"train": two_sides(n_train), "in range": two_sides(n_in),
              "in the gap": torch.rand(n_gap, generator=gen) * (GAP[1] - GAP[0]) + GAP[0]}
    return {name: (x[:, None], curve(x) + noise * torch.randn(len(x), generator=gen)) for name, x in inputs.items()}


def method_label(preconditioner: str, ridge: float, default_ridge: float) -> str:
    """``"SMP fixed-dense"``, then ``", ridge 1"`` where the ridge is not the default."""
    return f"SMP {preconditioner}" + ("" if ridge == default_ridge else f", ridge {ridge:g}")


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
    """The MAP by L-BFGS in float64, best of ``restarts`` (seeds ``seed + r``, the global generator left untouched)."""
    best, best_value = None, math.inf
    x64, y64 = x.double(), y.double()
    for restart in range(restarts):
        with torch.random.fork_rng(devices=[]):
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
    """:func:`regression_mlp`'s output ``(n,)`` in JAX, ``theta`` ``(d,)`` in its parameter order, ``x`` ``(n,)``."""
    import jax.numpy as jnp

    w1, b1, w2, b2 = theta[:hidden], theta[hidden:2 * hidden], theta[2 * hidden:3 * hidden], theta[3 * hidden]
    return jnp.tanh(x[:, None] * w1 + b1) @ w2 + b2


def jax_minus_log_posterior(theta, x, y, hidden: int, noise: float, prior_precision: float):
    """:func:`minus_log_posterior` in JAX (NUTS's potential energy), ``x`` and ``y`` ``(n,)``."""
    residual = y - jax_outputs(theta, x, hidden)
    return 0.5 * (residual**2).sum() / noise**2 + 0.5 * prior_precision * (theta**2).sum()


def run_nuts_regression(x: torch.Tensor, y: torch.Tensor, theta_map: torch.Tensor, cfg: dict[str, Any], seed: int,
                        x_eval: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """NUTS on :func:`regression_mlp`'s posterior with ``cfg``'s ``hidden``, ``noise``, ``prior_precision`` and
    ``nuts_*`` settings (NumPyro, float64, chains in turn from ``theta_map`` plus jitter): the ``(chains * samples,
    d)`` draws and diagnostics (the outputs' ESS and split R-hat at ``x_eval``)."""
    import jax
    from numpyro.diagnostics import effective_sample_size, split_gelman_rubin
    from numpyro.infer import MCMC, NUTS

    from .nuts import _cpu64

    xs, ys, x_eval_np = (np.asarray(t, dtype=np.float64).reshape(-1) for t in (x, y, x_eval))
    start, chains, hidden = np.asarray(theta_map, dtype=np.float64), cfg["nuts_chains"], cfg["hidden"]
    inits = start + cfg["nuts_init_jitter"] * np.random.default_rng(seed).standard_normal((chains, start.size))
    t0 = time.perf_counter()
    with _cpu64():
        kernel = NUTS(potential_fn=lambda t: jax_minus_log_posterior(t, xs, ys, hidden, cfg["noise"],
                                                                     cfg["prior_precision"]),
                      target_accept_prob=cfg["nuts_target_accept"], max_tree_depth=cfg["nuts_max_tree_depth"])
        mcmc = MCMC(kernel, num_warmup=cfg["nuts_warmup"], num_samples=cfg["nuts_samples"], num_chains=chains,
                    chain_method="sequential", progress_bar=False)
        mcmc.run(jax.random.PRNGKey(seed), init_params=inits[0] if chains == 1 else inits,  # 1: no chain axis
                 extra_fields=("diverging", "num_steps"))
        draws = np.asarray(mcmc.get_samples(group_by_chain=True), dtype=np.float64)   # (C, S, d)
        extra = {k: np.asarray(v) for k, v in mcmc.get_extra_fields().items()}
        out = np.asarray(jax.vmap(jax.vmap(lambda t: jax_outputs(t, x_eval_np, hidden)))(draws))
    depth = np.floor(np.log2(extra["num_steps"].astype(np.float64) + 1.0))
    rhat = np.max(split_gelman_rubin(out)) if chains > 1 or cfg["nuts_samples"] >= 4 else math.nan
    diagnostics = {"divergences": int(extra["diverging"].sum()),
                   "max_tree_depth_share": float((depth >= cfg["nuts_max_tree_depth"]).mean()),
                   "min_ess_outputs": float(np.min(effective_sample_size(out))), "max_rhat_outputs": float(rhat),
                   "wall_time_s": time.perf_counter() - t0}
    return torch.tensor(draws.reshape(-1, start.size), dtype=torch.float32), diagnostics


def evaluate(means: dict[str, torch.Tensor], reference_sd: dict[str, torch.Tensor], data, noise: float,
             level: float) -> dict[str, dict[str, float]]:
    """Per region, ``regression_scores``, the median epistemic sd and its median ratio to NUTS's (NaN for one draw)."""
    out = {}
    for region in REGIONS:
        sd = means[region][..., 0].double().std(dim=0) if means[region].shape[0] > 1 else None
        out[region] = metrics.regression_scores(means[region], data[region][1], noise, level=level) | {
            "median_sd": math.nan if sd is None else float(sd.median()),
            "sd_ratio": math.nan if sd is None else float((sd / reference_sd[region]).median())}
    return out


def _checked_settings(cfg: dict[str, Any]) -> list[tuple[str, str, float]]:
    """``(label, preconditioner, ridge)`` of every SMP setting, checked before any work."""
    settings = []
    for variant in cfg["smp_variants"]:
        if len(variant) != 2:
            raise ValueError(f"each smp_variants entry is [preconditioner, ridge], got {variant!r}")
        parse_preconditioner_name(variant[0])
        settings.append((method_label(*variant, cfg["ridge"]), *variant))
    labels = [label for label, _, _ in settings]
    if len(set(labels)) < len(labels):
        raise ValueError(f"two SMP settings share a label: {labels}")
    if len(cfg["tau_grid"]) > 10 or len(labels) > 89:
        raise ValueError("the SMP seeds base + 100 + 10 v + t need at most 10 taus and 89 variants")
    return settings


def run_data_set(cfg: dict[str, Any], index: int, progress: bool = False) -> dict[str, Any]:
    """One data set: its MAP, NUTS, the Laplace approximation and every SMP run of ``cfg``, evaluated.

    Seeds: data ``base = seed + 1000 index``; MAP restarts, NUTS and Laplace ``base + 1``; SMP setting ``v`` at ``tau``
    position ``t``: ``base + 100 + 10 v + t``.
    """
    settings = _checked_settings(cfg)
    base, noise, alpha = cfg["seed"] + 1000 * index, cfg["noise"], cfg["prior_precision"]
    data = gap_data(cfg["n_train"], cfg["n_in"], cfg["n_gap"], noise, base)
    x, y = data["train"]
    grid = torch.linspace(-4, 4, cfg["grid_points"])[:, None]
    inputs = {**{region: data[region][0] for region in REGIONS}, "grid": grid}
    net, fit = fit_map(x, y, cfg["hidden"], noise, alpha, cfg["map_restarts"], base + 1)
    chain = as_chain_model(net)
    theta_map = chain.layout.flatten(net).detach()
    nuts_draws, nuts_diag = run_nuts_regression(x, y, theta_map, cfg, base + 1, torch.linspace(-4, 4, 17)[:, None])
    laplace = fit_laplace(net, Gaussian(noise), theta_map, x, y, prior_precision=alpha, structure="dense")
    laplace_draws = laplace.sample(cfg["n_chains"], torch.Generator().manual_seed(base + 1))
    fisher = estimate_fisher(chain, Gaussian(noise), theta_map, x, structure="dense", dtype=torch.float64)[0][0]

    def network_means(theta):
        return {name: predict(chain, theta, xs) for name, xs in inputs.items()}

    # label (SMP: "label|tau") -> (tau, means per input set (None where every chain, or all but one, diverged),
    # diverged chains, warnings of a statistic rounded to float32)
    methods = {"NUTS": (math.nan, network_means(nuts_draws), 0, 0),
               "MAP": (math.nan, network_means(theta_map[None]), 0, 0),
               "Laplace (linearised)": (math.nan, {name: linearised_logits(net, theta_map, laplace_draws, xs)
                                                   for name, xs in inputs.items()}, 0, 0)}
    for v, (label, preconditioner, ridge) in enumerate(settings):
        structured = preconditioner != "none" and not preconditioner.endswith("-diag")
        precond = preconditioner_from_name(preconditioner, ridge=ridge,
                                           statistic_dtype=cfg["statistic_dtype"] if structured else None)
        for t, tau in enumerate(cfg["tau_grid"]):
            draws, diverged = None, cfg["n_chains"]  # unless run_smp returns: it raises when every chain diverged
            with warnings.catch_warnings(record=True) as caught, contextlib.suppress(DivergenceError):
                warnings.simplefilter("always")
                run = run_smp(net, Gaussian(noise), x, preconditioner=precond, tau=tau, n_steps=cfg["n_steps"],
                              n_chains=cfg["n_chains"], seed=base + 100 + 10 * v + t, n_obs=len(x),
                              fisher=Fisher("model", x), progress=progress)
                draws, diverged = run.samples(), int(run.diverged.sum())
            methods[f"{label}|{tau:g}"] = (tau, network_means(draws) if draws is not None and len(draws) >= 2 else None,
                                           diverged, sum(str(w.message) == ROUNDED_STATISTIC_WARNING for w in caught))

    reference_sd = {region: methods["NUTS"][1][region][..., 0].double().std(dim=0) for region in REGIONS}
    rows, bands = [], {}
    for key, (tau, means, diverged, rounding) in methods.items():
        scored = dict.fromkeys(REGIONS, {})
        if means is not None:  # and, for the figures, the 5 %, 50 % and 95 % predictive quantiles on the grid
            scored = evaluate(means, reference_sd, data, noise, cfg["level"])
            bands[key] = {f"q{round(100 * q):02d}": metrics.predictive_quantile(means["grid"], noise, q).float()
                          for q in (0.05, 0.5, 0.95)}
        rows += [{"method": key.split("|")[0], "tau": tau, "region": region, **row, "diverged": diverged,
                  "rounding_warnings": rounding} for region, row in scored.items()]
    return {"rows": pd.DataFrame(rows).assign(data_set=index), "nuts": nuts_diag, "map": fit, "bands": bands,
            "grid": grid[:, 0], "train": (x[:, 0], y), "fisher_eigenvalues": torch.linalg.eigvalsh(fisher).flip(0)}


def summary_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Medians over the data sets per method, tau and region, ``data_sets`` (with a result) and ``max_diverged``."""
    keys = ["method", "tau", "region"]
    grouped = rows.assign(tau=rows["tau"].fillna(-1.0)).groupby(keys, sort=False)  # -1: the references' "no tau"
    median = grouped[[c for c in rows.columns if c not in (*keys, "data_set")]].median()
    median = median.assign(data_sets=grouped["coverage"].count(), max_diverged=grouped["diverged"].max()).reset_index()
    return median.assign(tau=median["tau"].where(median["tau"] >= 0)).set_index(keys)


def eligible(summary: pd.DataFrame, n_data_sets: int) -> pd.Series:
    """Rows of :func:`summary_table` with a result on every data set and no diverged chain on any."""
    return (summary["data_sets"] == n_data_sets) & (summary["max_diverged"] == 0)


def best_tau(summary: pd.DataFrame, n_data_sets: int, region: str = "in range") -> pd.DataFrame:
    """Per SMP method, the :func:`eligible` ``tau`` whose median ``sd_ratio`` in ``region`` is nearest 1 (log scale)."""
    ok, out = eligible(summary, n_data_sets), []
    for method in dict.fromkeys(m for m in summary.index.get_level_values("method") if m.startswith("SMP")):
        one = summary.xs(method, level="method")
        fine = ok.xs(method, level="method").groupby(level="tau").all()
        ratio = one.xs(region, level="region")["sd_ratio"][fine].dropna()
        row = {"method": method, "tau": math.nan, "within 2x": False, "eligible taus": len(ratio)}
        if len(ratio):
            row["tau"] = tau = float(np.log(ratio).abs().idxmin())
            row["within 2x"] = bool(abs(math.log(ratio[tau])) <= math.log(2.0))
            row |= {f"{c} ({r})": one.loc[(tau, r), c] for r in REGIONS for c in ("sd_ratio", "coverage", "nll")}
        out.append(row)
    return pd.DataFrame(out).set_index("method")


def spread_shape(rows: pd.DataFrame, n_data_sets: int) -> pd.DataFrame:
    """The gap share: the median over data sets of ``sd_ratio`` in the gap over in range (NaN where not eligible)."""
    keyed = rows.assign(tau=rows["tau"].fillna(-1.0)).set_index(["data_set", "method", "tau", "region"])["sd_ratio"]
    ratio = keyed.xs(REGIONS[1], level="region") / keyed.xs(REGIONS[0], level="region")
    shape = ratio.groupby(level=["method", "tau"], sort=False).median()
    ok = eligible(summary_table(rows), n_data_sets)
    ok = ok.groupby([ok.index.get_level_values("method"), ok.index.get_level_values("tau").fillna(-1.0)]).all()
    shape = shape.where(pd.Series([ok.get(key, False) for key in shape.index], index=shape.index)).unstack("tau")
    shape.columns = ["no tau" if t < 0 else t for t in shape.columns]
    return shape.loc[list(dict.fromkeys(rows["method"]))]


def matched_in_both(summary: pd.DataFrame, n_data_sets: int, factor: float = 2.0) -> list[tuple[str, float]]:
    """The :func:`eligible` SMP ``(method, tau)`` whose median ``sd_ratio`` is within ``factor`` of 1 in each region."""
    groups = summary[eligible(summary, n_data_sets)].groupby(level=("method", "tau"), sort=False)["sd_ratio"]
    return [(method, tau) for (method, tau), ratios in groups
            if method.startswith("SMP") and len(ratios) == len(REGIONS) and ratios.notna().all()
            and all(r > 0 and abs(math.log(r)) <= math.log(factor) for r in ratios)]


def wide_table(summary: pd.DataFrame, metric_names, extra=("max_diverged", "data_sets")) -> pd.DataFrame:
    """:func:`summary_table` with ``<metric> (<region>)`` columns for ``metric_names``, then the ``extra`` ones."""
    wide = summary.unstack("region")
    wide.columns = [f"{metric} ({region})" for metric, region in wide.columns]
    renamed = {f"{name} ({REGIONS[0]})": name for name in extra}
    return wide[[f"{m} ({r})" for m in metric_names for r in REGIONS] + list(renamed)].rename(columns=renamed)


def prior_table(runs: list[tuple[float, pd.DataFrame]]) -> pd.DataFrame:
    """NUTS's and Laplace's median sd and coverage on the first data set, per ``(alpha, rows)`` of ``runs``."""
    table = pd.concat([rows[(rows["data_set"] == 0) & rows["method"].isin(REFERENCES[::2])]
                       .assign(**{"prior precision": alpha}) for alpha, rows in runs])
    return table.rename(columns={"median_sd": "median sd"}).pivot_table(
        index=["method", "region"], columns="prior precision", values=["median sd", "coverage"], sort=False)


def _value(summary: pd.DataFrame, method: str, column: str, region: str) -> float:
    return float(summary.xs((method, region), level=("method", "region"))[column].iloc[0])


def findings(summary: pd.DataFrame, matched: pd.DataFrame, shape: pd.DataFrame, n_data_sets: int) -> str:
    """Markdown bullets per SMP setting at the ``tau`` of ``matched``, then NUTS, Laplace and the settings matched in
    both regions."""
    lines = []
    for method, row in matched.iterrows():
        parts = []
        if math.isnan(row["tau"]):
            parts.append("no tau of the grid gives a result on every data set without a diverged chain")
        elif not row["within 2x"]:
            parts.append(f"no tau of the grid comes within a factor 2 of NUTS's spread in range (nearest: "
                         f"{row['sd_ratio (in range)']:.3g} times, at tau = {row['tau']:g})")
        else:
            parts.append(f"at tau = {row['tau']:g} ({row['sd_ratio (in range)']:.2f} times NUTS's spread in range), "
                         f"{row['sd_ratio (in the gap)']:.3f} times NUTS's in the gap, a gap share of "
                         f"{shape.loc[method, row['tau']]:.3f}; 90 % intervals cover "
                         f"{row['coverage (in the gap)']:.0%} of the gap points")
        lines.append(f"{method}: " + "; ".join(parts))
    laplace = [_value(summary, REFERENCES[2], "sd_ratio", region) for region in REGIONS]
    both = matched_in_both(summary, n_data_sets)
    lines += [f"NUTS: 90 % intervals cover {_value(summary, 'NUTS', 'coverage', 'in the gap'):.0%} of the gap points",
              f"Laplace (linearised): {laplace[0]:.2f} times NUTS's spread in range, {laplace[1]:.2f} in the gap, a "
              f"gap share of {shape.loc[REFERENCES[2]].dropna().iloc[0]:.2f}",
              "settings within a factor 2 of NUTS's spread in both regions: "
              + (", ".join(f"{m} at tau = {t:g}" for m, t in both) if both else "none")]
    return "\n".join(f"- {line}" for line in lines)


def prior_findings(table: pd.DataFrame, rows: pd.DataFrame, matched: pd.DataFrame,
                   nuts: list[tuple[float, dict[str, float]]]) -> str:
    """What :func:`prior_table` says, with SMP's spread in the gap and NUTS's diagnostics per prior (Markdown)."""
    gap, span = (table.loc[("NUTS", region), "median sd"] for region in ("in the gap", "in range"))
    lines = [f"NUTS's median spread over the priors of the table: {gap.min():.3g} to {gap.max():.3g} in the gap (a "
             f"factor {gap.max() / gap.min():.2f}), {span.min():.3g} to {span.max():.3g} in range (a factor "
             f"{span.max() / span.min():.2f})"]
    first = rows[rows["data_set"] == 0].set_index(["method", "tau", "region"])["median_sd"]
    for method, row in matched[matched["within 2x"]].iterrows():
        sd = first.loc[(method, row["tau"], "in the gap")]
        lines.append(f"{method} at tau = {row['tau']:g} (matched in range), first data set: median spread {sd:.3g} "
                     f"in the gap, {sd / gap.min():.2f} times NUTS's under the tightest prior of the table")
    lines += [f"NUTS with alpha = {alpha:g}: {d['divergences']} divergences, largest split R-hat "
              f"{d['max_rhat_outputs']:.3f}, smallest ESS {d['min_ess_outputs']:.0f}" for alpha, d in nuts]
    return "\n".join(f"- {line}" for line in lines)


def spread_ratio_figure(summary: pd.DataFrame):
    """Per region, every SMP setting's median spread ratio against ``tau`` (log-log), with NUTS's (1) and Laplace's."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    smp = [m for m in dict.fromkeys(summary.index.get_level_values("method")) if m.startswith("SMP")]
    for ax, region in zip(axes, REGIONS, strict=True):
        for method in smp:
            one = summary.xs((method, region), level=("method", "region"))["sd_ratio"].dropna()
            ax.plot(one.index, one.values, "o-", ms=3, label=method.removeprefix("SMP "))
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(_value(summary, REFERENCES[2], "sd_ratio", region), color="0.5", ls="--", lw=0.8,
                   label=REFERENCES[2])
        ax.set(xscale="log", yscale="log", xlabel=r"$\tau$", title=f"spread / NUTS's spread, {region}")
    axes[0].set_ylabel("median ratio of standard deviations")
    axes[1].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def bands_figure(run: dict[str, Any], keys: list[str], fontsize: float = 8):
    """The 5-95 % predictive bands of the methods ``keys`` (``"NUTS"``, ``"<label>|<tau>"``) of one data set, four
    to a row."""
    import matplotlib.pyplot as plt

    keys, grid = [key for key in keys if key in run["bands"]], run["grid"]
    n_rows = max(1, math.ceil(len(keys) / 4))
    fig, axes = plt.subplots(n_rows, 4, figsize=(13.6, 2.9 * n_rows), sharex=True, sharey=True, squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        band, (label, _, tau) = run["bands"][key], key.partition("|")
        ax.axvspan(*GAP, color="0.92", lw=0)
        ax.fill_between(grid, band["q05"], band["q95"], alpha=0.35)
        ax.plot(grid, band["q50"], lw=1)
        ax.plot(grid, curve(grid), "k--", lw=0.7)
        ax.plot(*run["train"], "k.", ms=2)
        ax.set_title(label + (f", tau {tau}" if tau else ""), fontsize=fontsize)
        ax.set_ylim(-4, 4)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def compute(ctx) -> None:
    """The regression chapter's results (:mod:`smp_book.pipeline`): runs cached under ``.cache/regression/``."""
    from .pipeline import cached, code_hash

    cfg, n = ctx.config, ctx.config["data_sets"]

    def run(settings, i):
        return cached("regression", {**settings, "data_set": i, "code": code_hash(__name__)},
                      lambda: run_data_set(settings, i, progress=ctx.progress), enabled=ctx.use_cache)

    def matched_keys(matched):
        return [f"{m}|{row['tau']:g}" for m, row in matched.iterrows() if row["within 2x"]]

    runs, names = [run(cfg, i) for i in range(n)], [f"data set {i}" for i in range(n)]
    rows = pd.concat([r["rows"] for r in runs], ignore_index=True)
    summary = ctx.table("scores_median", summary_table(rows))
    ctx.table("map_fit", pd.DataFrame([r["map"] for r in runs], index=names))
    nuts = ctx.table("nuts_diagnostics", pd.DataFrame([r["nuts"] for r in runs], index=names))
    ctx.table("scores_wide", wide_table(summary, ("sd_ratio", "coverage", "interval_width", "nll", "crps"),
                                        ("max_diverged", "data_sets", "rounding_warnings")))
    ctx.figure("spread_ratio", spread_ratio_figure(summary))
    matched, _ = (ctx.table(f"tau_matched_{r.replace(' ', '_')}", best_tau(summary, n, r)) for r in REGIONS)
    shape = ctx.table("spread_shape", spread_shape(rows, n))
    ctx.value("matched_text", findings(summary, matched, shape, n))
    ctx.figure("bands", bands_figure(runs[0], list(REFERENCES) + matched_keys(matched)))

    # the reference under the other priors: data set 0 without the SMP runs
    reference_cfg = cfg | {"smp_variants": []}
    others = [(alpha, run(reference_cfg | {"prior_precision": alpha}, 0)) for alpha in cfg["prior_sensitivity"]]
    priors = ctx.table("prior_sensitivity", prior_table([(cfg["prior_precision"], rows)]
                                                        + [(alpha, r["rows"]) for alpha, r in others]))
    ctx.value("prior_text", prior_findings(priors, rows, matched, [(a, r["nuts"]) for a, r in others]))

    # the settings and numbers the prose quotes
    settings, eigenvalues = _checked_settings(cfg), runs[0]["fisher_eigenvalues"]
    healthy = (nuts["divergences"] == 0) & (nuts["max_rhat_outputs"] < 1.05) & (nuts["min_ess_outputs"] > 100)
    fine = matched[matched["within 2x"]]["sd_ratio (in the gap)"]
    laplace_gap = _value(summary, REFERENCES[2], "sd_ratio", "in the gap")
    answer = (f"Matched to NUTS's spread where the data are, the {len(fine)} SMP setting(s) that come within a "
              f"factor 2 of it spread {fine.min():.2g} to {fine.max():.2g} times as much as NUTS in the gap, against "
              f"{laplace_gap:.2f} times for the linearised Laplace approximation" if len(fine) else
              "No SMP setting of the grid comes within a factor 2 of NUTS's spread where the data are")
    quoted = {key: cfg[key] for key in (
        "n_train", "n_in", "n_gap", "noise", "hidden", "data_sets", "map_restarts", "nuts_chains", "nuts_warmup",
        "nuts_samples", "nuts_target_accept", "nuts_max_tree_depth", "nuts_init_jitter", "n_chains", "n_steps", "ridge",
        "level", "prior_precision")} | {
        "dim": len(eigenvalues), "max_leapfrog": 2 ** cfg["nuts_max_tree_depth"] - 1,
        "share_at_K": 1 - cfg["n_train"] / (cfg["n_train"] + cfg["n_steps"]),
        "tau_grid": ", ".join(f"{v:g}" for v in cfg["tau_grid"]),
        "prior_alphas": " and ".join(f"{a:g}" for a in cfg["prior_sensitivity"]),
        "smp_settings": "; ".join(s[0].removeprefix("SMP ") for s in settings),
        "coverage_se_gap": math.sqrt(cfg["level"] * (1 - cfg["level"]) / cfg["n_gap"]),
        "nuts_healthy": int(healthy.sum()), "tree_depth_share_min": nuts["max_tree_depth_share"].min(),
        "tree_depth_share_max": nuts["max_tree_depth_share"].max(),
        "fisher_largest": ", ".join(f"{v:.3g}" for v in eigenvalues[:6].tolist()),
        "fisher_above_1": int((eigenvalues > 1).sum()), "fisher_above_ridge": int((eigenvalues > cfg["ridge"]).sum()),
        "nuts_coverage_gap": _value(summary, "NUTS", "coverage", "in the gap"),
        "answer": answer + f"; {len(matched_in_both(summary, n))} SMP setting(s) of the empirical design come within "
                  "a factor 2 of NUTS's spread in both regions."}
    for key, value in quoted.items():
        ctx.value(key, value)
    ctx.record(seeds={"seed": cfg["seed"], "data_sets": [cfg["seed"] + 1000 * i for i in range(n)]})
