"""The MNIST KFAC chapter: the kfac preconditioners beside the diagonal ones, and the law of one step at the MAP."""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from smp_core.fisher import estimate_fisher, fisher_vectors, kronecker_layers
from smp_core.models import as_chain_model, lenet5
from smp_core.preconditioners import build_preconditioner

from .mnist_runs import (
    INPUT_SHAPE,
    _categorical,
    default_device,
    map_key,
    run_key,
    run_variant,
    smp_path,
    study_variants,
    validation_fisher_diagonal,
    variant_preconditioner,
    variant_tau,
)
from .pipeline import CACHE, cached, code_hash


def structure_table(scores: pd.DataFrame, variances: pd.DataFrame, elapsed: pd.DataFrame) -> pd.DataFrame:
    """One row per method (rows of the MNIST and KFAC studies may be concatenated): accuracy, NLL, ECE,
    mutual information, logit and parameter variance, and seconds; with each variant's strategy and
    structure (``MAP`` and ``SMP-none`` have none)."""
    table = scores[["accuracy", "nll", "ece", "mutual_info"]].join(variances[["logits_variance", "params_variance"]])
    table = table.join(elapsed[["seconds"]])
    parts = [name.removeprefix("SMP-").split("-") if name.count("-") == 2 else ["", ""] for name in table.index]
    table.insert(0, "structure", [p[1] for p in parts])
    table.insert(0, "strategy", [p[0] for p in parts])
    return table


def kfac_against_diag(table: pd.DataFrame) -> pd.DataFrame:
    """Per temporal strategy with both a ``diag`` and a ``kfac`` row in ``table`` (:func:`structure_table`):
    the ratios kfac / diag of the mutual information and of the logit variance, both NLLs beside MAP's,
    and two verdicts judged on these numbers: does KFAC over-disperse less (smaller MI), and does it
    predict better (smaller NLL)?"""
    rows = []
    for strategy in ("fixed", "ema", "periodic"):
        diag, kfac = f"SMP-{strategy}-diag", f"SMP-{strategy}-kfac"
        if diag not in table.index or kfac not in table.index:
            continue
        d, k = table.loc[diag], table.loc[kfac]
        rows.append({
            "strategy": strategy,
            "mi_kfac_over_diag": k["mutual_info"] / d["mutual_info"],
            "logits_variance_kfac_over_diag": k["logits_variance"] / d["logits_variance"],
            "nll_diag": d["nll"], "nll_kfac": k["nll"],
            "nll_map": table.loc["MAP", "nll"] if "MAP" in table.index else np.nan,
            "kfac less dispersed (smaller MI)": "yes" if k["mutual_info"] < d["mutual_info"] else "no",
            "kfac lower NLL": "yes" if k["nll"] < d["nll"] else "no",
        })
    return pd.DataFrame(rows).set_index("strategy") if rows else pd.DataFrame()


def directions_at_the_ridge(theta0: torch.Tensor, data: dict, ridge: float,
                            device: torch.device | None = None) -> pd.DataFrame:
    """How many directions each preconditioner leaves at the ridge, per layer of LeNet-5.

    The empirical Fisher over the validation set at ``theta0``, as the fixed strategies build it: per
    layer, the share of the eigenvalues of ``P - ridge I`` below ``ridge``, for the diagonal (its
    entries) and for KFAC (the products ``lambda_G lambda_A`` of the eigenvalues of both factors). In
    such a direction ``P^{-1}`` is about ``1 / ridge`` (10^4 for the paper's lambda): the step there is
    the score times 10^4 whatever the curvature, which is where over-dispersion can come from. Also the
    output units whose ``G`` row is exactly zero on the validation set (units that never activate there).
    """
    device = device or default_device()
    model = as_chain_model(lenet5().to(device), INPUT_SHAPE)
    xv, yv = (t.to(device) for t in data["val"])
    theta = theta0.to(device)[None]
    (diag,) = estimate_fisher(model, _categorical(), theta, xv, yv, kind="empirical", structure="diag")
    factors = estimate_fisher(model, _categorical(), theta, xv, yv, kind="empirical", structure="kfac")
    rows = []
    for i, layer in enumerate(kronecker_layers(model)):
        a, g = factors[2 * i][0].double().cpu(), factors[2 * i + 1][0].double().cpu()
        products = torch.linalg.eigvalsh(g).clamp_min(0)[:, None] * torch.linalg.eigvalsh(a).clamp_min(0)[None, :]
        entries = torch.cat([diag[0, layer.weight].reshape(-1)]
                            + ([diag[0, layer.bias].reshape(-1)] if layer.bias is not None else [])).double().cpu()
        rows.append({"layer": i + 1, "shape [W, b]": f"{layer.n_out} x {layer.n_cols}", "parameters": entries.numel(),
                     "diag: share below ridge": float((entries < ridge).double().mean()),
                     "diag: share exactly zero": float((entries == 0).double().mean()),
                     "kfac: share below ridge": float((products < ridge).double().mean()),
                     "units with zero G row": int((g.diagonal() == 0).sum())})
    table = pd.DataFrame(rows).set_index("layer")
    total = table["parameters"].sum()
    weights = table["parameters"] / total
    table.loc["all"] = {"shape [W, b]": "", "parameters": total,
                        **{c: float((table[c] * weights).sum()) for c in table.columns if "share" in c},
                        "units with zero G row": int(table["units with zero G row"].sum())}
    return table


def kfac_statistic_precision(theta0: torch.Tensor, data: dict, ridge: float, n_scores: int = 200,
                             device: torch.device | None = None) -> pd.DataFrame:
    """Whether float32 rounding of the Fisher statistic changes the fixed-kfac preconditioner at ``theta0``.

    The chains, and by default their statistic, run in float32. This builds the fixed-kfac
    preconditioner of the KFAC chapter (the empirical Fisher over the validation set, ``ridge``) twice:
    its Kronecker factors summed, and eigendecomposed, in float32 and in float64 (``statistic_dtype``,
    beyond the paper). Per layer: the relative difference ``|P32^{-1} s - P64^{-1} s| / |P64^{-1} s|``
    on the layer's slice for the empirical scores ``s`` of the first ``n_scores`` validation images
    (median and largest); the largest eigenvalue of ``G (x) A`` (float32 rounds the statistic by about
    ``1e-7`` times it); and, from each preconditioner's own factor, the share of the directions whose
    eigenvalue product ``lambda_G lambda_A`` lies below the ridge (the directions at the ridge) and the
    smallest eigenvalues of ``A`` and ``G``.
    """
    device = device or default_device()
    model = as_chain_model(lenet5().to(device), INPUT_SHAPE)
    layers = kronecker_layers(model)
    xv, yv = (t.to(device) for t in data["val"])
    theta = theta0.to(device)[None]
    n_scores = min(n_scores, xv.shape[0])
    scores = fisher_vectors(model, _categorical(), theta.expand(n_scores, -1), xv[:n_scores], yv[:n_scores],
                            "empirical")[:, 0]
    factors, states, solved = {}, {}, {}
    for name, dtype in (("float32", None), ("float64", torch.float64)):
        factors[name] = estimate_fisher(model, _categorical(), theta, xv, yv, kind="empirical", structure="kfac",
                                        dtype=dtype)
        precond = build_preconditioner("kfac", "fixed", dim=model.layout.dim, layers=layers, ridge=ridge,
                                       statistic_dtype=dtype)
        states[name] = precond.init(theta, lambda t, name=name: factors[name])
        solved[name] = precond.solve(states[name], scores).double().cpu()
    rows = []
    for i, layer in enumerate(layers):
        idx = layer.positions()
        reference = solved["float64"][:, idx]
        rel = (solved["float32"][:, idx] - reference).norm(dim=1) / reference.norm(dim=1)
        # the eigenvalues of A and G (ascending) of each statistic, computed once
        spectra = {name: tuple(torch.linalg.eigvalsh(factors[name][2 * i + j][0].double().cpu()) for j in (0, 1))
                   for name in factors}
        eig_a, eig_g = spectra["float64"]
        row = {"layer": i + 1, "shape [W, b]": f"{layer.n_out} x {layer.n_cols}",
               "P^-1 s: relative difference, median": float(rel.median()),
               "P^-1 s: relative difference, largest": float(rel.max()),
               "largest eigenvalue of G (x) A": float(eig_a[-1] * eig_g[-1])}
        for name in factors:
            # the factor (U_A, U_G, 1 / (lambda_G lambda_A^T + ridge)): a product below the ridge has a scale
            # above 1 / (2 ridge)
            scale = states[name].factor[3 * i + 2][0].double().cpu()
            row[f"share below ridge ({name})"] = float((scale > 1.0 / (2.0 * ridge)).double().mean())
        for name, (eig_a, eig_g) in spectra.items():
            row[f"smallest eigenvalue of A ({name})"] = float(eig_a[0])
            row[f"smallest eigenvalue of G ({name})"] = float(eig_g[0])
        rows.append(row)
    return pd.DataFrame(rows).set_index("layer")


STEP_LAW_VARIANTS = ("none", "fixed-diag", "fixed-kfac")


STEP_LAW_BATCH = 100  # scores per batch of draw_steps


def step_law_key(cfg: dict[str, Any], variant: str, device: torch.device, draw_set: int = 0) -> dict[str, Any]:
    """The cache key of :func:`step_law_at_map` for one variant and set of draws: the MAP's key, the ridge,
    the draws, the evaluation images, the batch and the device type (both set the order of the random
    numbers) and the seed."""
    return {**map_key(cfg), "part": f"step law {variant}", "ridge": cfg["ridge"],
            "step_law_draws": cfg["step_law_draws"], "step_law_eval": cfg["step_law_eval"],
            "step_law_batch": STEP_LAW_BATCH, "device": torch.device(device).type,
            "seed": step_law_seed(cfg, draw_set), "code": code_hash(__name__)}


def step_law_seed(cfg: dict[str, Any], draw_set: int = 0) -> int:
    """The seed of set ``draw_set`` of drawn steps (``seed + 700 + draw_set``), the same for every variant:
    each preconditioner is applied to the same scores, so that the variants' draws are paired. Sets
    ``0, 1, ...`` are independent draws of the same law."""
    if isinstance(draw_set, bool) or not (isinstance(draw_set, numbers.Integral) and 0 <= draw_set < 100):
        raise ValueError(f"draw_set must be an integer in [0, 100), got {draw_set!r}")
    return cfg["seed"] + 700 + int(draw_set)


def step_law_groups(theta0: torch.Tensor, data: dict, ridge: float, device: torch.device | None = None
                    ) -> dict[str, torch.Tensor]:
    """The parameter groups of :func:`step_law_at_map`: LeNet-5's five layers (weights and biases, the
    kfac layers) and the coordinates whose diagonal empirical Fisher at ``theta0`` over the validation
    set (the fixed preconditioners' data) is below ``ridge`` or not (boolean masks)."""
    device = device or default_device()
    model = as_chain_model(lenet5().to(device), INPUT_SHAPE)
    below = validation_fisher_diagonal(theta0, data, device) < ridge
    groups = {f"layer {i + 1}": layer.positions() for i, layer in enumerate(kronecker_layers(model))}
    groups.update({"diag Fisher below ridge": below, "diag Fisher at or above ridge": ~below})
    return groups


def step_law_at_map(cfg: dict[str, Any], theta_map: torch.Tensor, data: dict, device: torch.device | None = None,
                    use_cache: bool = True, progress: bool = True, cache_root: str | Path = CACHE,
                    draw_set: int = 0) -> pd.DataFrame:
    """The law of one step at the MAP for the fixed diagonal and fixed KFAC preconditioners, and none.

    For each of :data:`STEP_LAW_VARIANTS`, the preconditioner a run of that variant starts with (the
    empirical Fisher over the validation set at the MAP, :func:`variant_preconditioner`; the identity
    for ``none``) and ``cfg["step_law_draws"]`` steps ``u = P^{-1} s`` drawn as the recursion draws
    them (:func:`smp_book.step_law.draw_steps`; the same scores for every variant,
    :func:`step_law_seed`), with their linearised change of the logits on the first
    ``cfg["step_law_eval"]`` test images, in total and per group of :func:`step_law_groups`. Cached
    under ``<cache_root>/mnist_kfac/`` by :func:`step_law_key`. ``draw_set`` ``1, 2, ...`` draws another,
    independent set of the same size (:func:`step_law_seed`). Returns the draws of every variant, with
    columns ``variant``, ``training_label`` (the drawn image's label in the training set; the label the
    score uses is drawn from the model, and ``log_prob`` is its log-probability) and those of ``draw_steps``.
    """
    from .step_law import draw_steps

    device = device or default_device()
    net = as_chain_model(lenet5().to(device), INPUT_SHAPE)
    x = data["train"][0].to(device)
    xv, yv = (t.to(device) for t in data["val"])
    x_eval = data["test"][0][: cfg["step_law_eval"]].to(device)
    theta = theta_map.to(device)
    frames, groups = [], {}  # the groups are computed once, and only if some variant is not cached
    for variant in STEP_LAW_VARIANTS:
        def compute(variant=variant):
            if not groups:
                groups.update(step_law_groups(theta_map, data, cfg["ridge"], device))
            precond = variant_preconditioner(cfg, variant)
            state = precond.init(theta[None], lambda t: estimate_fisher(net, _categorical(), t, xv, yv,
                                                                        kind="empirical", structure=precond.structure))
            return draw_steps(net, "categorical", x, theta, precond, state, n_draws=cfg["step_law_draws"],
                              groups=groups, x_eval=x_eval,
                              seed=step_law_seed(cfg, draw_set), batch=STEP_LAW_BATCH, progress=progress)

        draws = cached("mnist_kfac", step_law_key(cfg, variant, device, draw_set), compute, root=cache_root,
                       enabled=use_cache)
        labels = data["train"][1].numpy()[draws["row"].to_numpy()]
        frames.append(draws.assign(variant=variant, training_label=labels).reset_index())
    return pd.concat(frames, ignore_index=True)


def step_law_prediction(draws: pd.DataFrame, cfg: dict[str, Any], observed: pd.DataFrame) -> pd.DataFrame:
    """The variances a run of ``cfg["n_steps"]`` steps would show if ``theta`` and ``P`` stayed at the
    MAP (:func:`smp_book.step_law.predicted_variances` of the drawn steps), beside a run's.

    ``observed``: rows ``SMP-<variant>`` with ``params_variance``, ``logits_variance`` and (optional)
    ``largest_chain_share``. The predicted logit variance is over the evaluation images of the draws,
    the observed one over the whole test set.
    """
    from .step_law import predicted_variances

    dim = as_chain_model(lenet5(), INPUT_SHAPE).layout.dim
    rows = []
    for variant, d in draws.groupby("variant", sort=False):
        pred = predicted_variances(d, cfg["n_train"], cfg["n_steps"], variant_tau(cfg, variant), dim)
        name = f"SMP-{variant}"
        obs = observed.loc[name] if name in observed.index else pd.Series(dtype=float)
        row = {"method": name}
        for column in ("params_variance", "logits_variance"):
            row[f"{column}: predicted"] = pred[column]
            row[f"{column}: predicted se"] = pred[f"{column}_se"]
            row[f"{column}: observed"] = obs.get(column, float("nan"))
            row[f"{column}: observed / predicted"] = row[f"{column}: observed"] / pred[column]
        row["largest chain's share of the observed logit variance"] = obs.get("largest_chain_share", float("nan"))
        rows.append(row)
    return pd.DataFrame(rows).set_index("method")


def step_law_sets(sets: dict[str, pd.DataFrame], cfg: dict[str, Any], observed: pd.DataFrame) -> pd.DataFrame:
    """The predictions of :func:`step_law_prediction` from independent sets of draws (``name -> draws`` of
    :func:`step_law_at_map` with different ``draw_set``), and from all of them pooled, beside the runs.

    Rows ``(method, set)``; columns per variance: the prediction, its standard error, observed over
    predicted. For two sets, the rows ``"difference (se)"`` give the second set's prediction minus the
    first's over the standard error of that difference (the two sets are independent), stored in the
    ``: predicted`` columns: were the standard errors right, about normal. The variants' draws are
    paired, so these move together: a gross error in the standard errors shows, how much heavy tails
    make them too small does not.
    """
    if "pooled" in sets:
        raise ValueError("'pooled' names the pooled rows: give the sets other names")
    pooled = pd.concat(list(sets.values()), ignore_index=True)
    tables = {name: step_law_prediction(d, cfg, observed) for name, d in {**sets, "pooled": pooled}.items()}
    rows = []
    for method in tables["pooled"].index:
        for name, table in tables.items():
            rows.append({"method": method, "set": name,
                         **{f"{c}: {k}": table.loc[method, f"{c}: {k}"]
                            for c in ("params_variance", "logits_variance")
                            for k in ("predicted", "predicted se", "observed / predicted")}})
        if len(sets) == 2:
            first, second = (tables[name].loc[method] for name in sets)
            row = {"method": method, "set": "difference (se)"}
            for c in ("params_variance", "logits_variance"):
                se = math.hypot(first[f"{c}: predicted se"], second[f"{c}: predicted se"])
                row[f"{c}: predicted"] = (second[f"{c}: predicted"] - first[f"{c}: predicted"]) / se
            rows.append(row)
    return pd.DataFrame(rows).set_index(["method", "set"])


def step_law_tails(draws: pd.DataFrame, fractions=(0.01, 0.001)) -> pd.DataFrame:
    """How heavy the tail of each variant's step law is: for the squared step ``||u||^2`` and the squared
    output change ``mean (J u)^2``, the mean, median, 99th percentile and largest draw, the mean over
    the median, and the share of the sum held by the largest ``fraction`` of the draws."""
    from .step_law import top_share

    rows = []
    for variant, d in draws.groupby("variant", sort=False):
        for column, label in (("step_sq", "||u||^2"), ("output_sq", "mean (J u)^2")):
            values = d[column]
            row = {"method": f"SMP-{variant}", "quantity": label, "mean": values.mean(), "median": values.median(),
                   "99th percentile": values.quantile(0.99), "largest": values.max(),
                   "mean / median": values.mean() / values.median()}
            for fraction in fractions:
                row[f"share of the largest {fraction:.1%}"] = top_share(values, fraction)
            rows.append(row)
    return pd.DataFrame(rows).set_index(["method", "quantity"])


def step_law_by_group(draws: pd.DataFrame, groups: dict[str, torch.Tensor]) -> pd.DataFrame:
    """Where each variant's steps go, per group of :func:`step_law_groups`: its share of ``E ||s||^2`` and
    of ``E ||u||^2`` (both add up to 1 over a partition), and ``E mean (J u_g)^2 / E mean (J u)^2``, the
    output change of the step cut to the group relative to the whole step's (not additive: the groups'
    changes can cancel or add up), and ``E mean (J u_g)^2 / E ||u_g||^2``, how much the outputs move per
    unit of squared step in the group: large where the step points along directions the network's
    outputs are sensitive to."""
    rows = []
    for variant, d in draws.groupby("variant", sort=False):
        for name, g in groups.items():
            g = torch.as_tensor(g)
            size = int(g.sum()) if g.dtype == torch.bool else g.numel()
            rows.append({"method": f"SMP-{variant}", "group": name, "parameters": size,
                         "share of E||s||^2": d[f"score_sq[{name}]"].mean() / d["score_sq"].mean(),
                         "share of E||u||^2": d[f"step_sq[{name}]"].mean() / d["step_sq"].mean(),
                         "output change alone / whole": d[f"output_sq[{name}]"].mean() / d["output_sq"].mean(),
                         "output change per ||u||^2": d[f"output_sq[{name}]"].mean() / d[f"step_sq[{name}]"].mean()})
    return pd.DataFrame(rows).set_index(["method", "group"])


def largest_steps(draws: pd.DataFrame, variant: str, n: int = 5) -> pd.DataFrame:
    """The ``n`` draws of ``variant`` with the largest output change: the drawn training image, its label
    in the training set, the model's probability of the label the score used (drawn from the model),
    the output change, its share of the sum over all draws, the squared step, the step's share
    on the coordinates whose diagonal Fisher is below the ridge, and the layer whose part of the step
    alone changes the outputs most."""
    d = draws[draws["variant"] == variant]
    layers = [c for c in d.columns if c.startswith("output_sq[layer ")]
    top = d.nlargest(n, "output_sq")
    return pd.DataFrame({
        "training image": top["row"].to_numpy(), "training label": top["training_label"].to_numpy(),
        "probability of the drawn label": np.exp(top["log_prob"].to_numpy()),
        "mean (J u)^2": top["output_sq"].to_numpy(),
        "share of the sum": (top["output_sq"] / d["output_sq"].sum()).to_numpy(),
        "||u||^2": top["step_sq"].to_numpy(),
        "share of ||u||^2 below the ridge": (top["step_sq[diag Fisher below ridge]"] / top["step_sq"]).to_numpy(),
        "layer changing the outputs most": [c[len("output_sq["):-1] for c in top[layers].idxmax(axis=1)],
    }, index=pd.RangeIndex(1, len(top) + 1, name="rank"))


def step_law_surprise(draws: pd.DataFrame, threshold: float = 0.5) -> pd.DataFrame:
    """How much of each variant's steps come from surprising labels: the share of the draws whose drawn
    label had model probability below ``threshold``, and those draws' share of ``E ||s||^2``, of
    ``E ||u||^2`` and of ``E mean (J u)^2``."""
    rows = []
    for variant, d in draws.groupby("variant", sort=False):
        rare = np.exp(d["log_prob"]) < threshold
        rows.append({"method": f"SMP-{variant}", f"share of draws with p(Y | X) < {threshold:g}": rare.mean(),
                     **{f"their share of {label}": d.loc[rare, column].sum() / d[column].sum()
                        for column, label in (("score_sq", "E||s||^2"), ("step_sq", "E||u||^2"),
                                              ("output_sq", "E mean (J u)^2"))}})
    return pd.DataFrame(rows).set_index("method")


def cached_run(cfg: dict[str, Any], variant: str, theta_map: torch.Tensor, data: dict,
               device: torch.device | None = None, use_cache: bool = True, progress: bool = True,
               cache_root: str | Path = CACHE, replicate: int = 0):
    """One run of a study's variant (:func:`run_variant`), from the cache :func:`run_replicates` fills
    (``<cache_root>/<study>/``, :func:`run_key`), or run now and cached there."""
    device = device or default_device()
    index = study_variants(cfg).index(variant)
    def compute():
        return run_variant(cfg, variant, theta_map, data, index, device, None, progress, replicate=replicate)

    return cached(cfg.get("study", "mnist"), run_key(cfg, variant, replicate, smp_path(device)), compute,
                  root=cache_root, enabled=use_cache)


def linearised_against_actual(theta_map: torch.Tensor, thetas: torch.Tensor, x_eval: torch.Tensor,
                              device: torch.device | None = None) -> pd.DataFrame:
    """Per chain of a run, how far it moved and whether the linearised network describes its move.

    On the images ``x_eval``: the chain's share of the logit variance (its squared deviation from the
    chains' mean logits over the sum of all chains'), its largest move from the MAP (max-norm), its
    squared distance, the actual change of its logits from the MAP's, ``mean_{x, c} (f_l - f_0)^2``,
    and the linearised change ``mean_{x, c} (J (theta_l - theta_0))^2`` (a Jacobian-vector product),
    which is what :func:`step_law_at_map` measures step by step. Rows: chains left out by the run
    (NaN) are dropped; sorted by share, largest first.
    """
    device = device or default_device()
    module = lenet5().to(device)
    layout = as_chain_model(module, INPUT_SHAPE).layout
    x = x_eval.to(device).reshape(-1, *INPUT_SHAPE)
    theta0 = theta_map.to(device)
    kept = torch.isfinite(thetas).all(1)
    chains = kept.nonzero().reshape(-1).tolist()
    thetas = thetas[kept].to(device)

    def logits(flat):
        return torch.func.functional_call(module, layout.unflatten(flat), (x,))

    with torch.no_grad():
        base = logits(theta0)
        actual = torch.stack([logits(t) for t in thetas])  # (S, n, C)
        linear = torch.stack([torch.func.jvp(logits, (theta0,), (t - theta0,))[1] for t in thetas])
    deviation = (actual - actual.mean(0)).square().sum((1, 2))
    delta = thetas - theta0
    table = pd.DataFrame({
        "chain": chains, "share of the logit variance": (deviation / deviation.sum()).cpu().numpy(),
        "largest move": delta.abs().amax(1).cpu().numpy(),
        "||theta - theta_0||^2": delta.square().sum(1).cpu().numpy(),
        "actual mean (f - f_0)^2": (actual - base).square().flatten(1).mean(1).cpu().numpy(),
        "linearised mean (J (theta - theta_0))^2": linear.square().flatten(1).mean(1).cpu().numpy()})
    return table.sort_values("share of the logit variance", ascending=False).reset_index(drop=True)


# ----------------------------------------------------------------------------------------------
# The chapter's results (smp_book.pipeline): everything notebooks/mnist_kfac.md shows

KFAC_STRATEGIES = ("fixed", "ema", "periodic")


def storage_per_chain() -> dict[str, int]:
    """How many numbers one chain's preconditioner holds for LeNet-5, per structure: ``diag`` (``d``),
    ``kfac`` (the two Kronecker factors of each layer, ``n_out^2 + n_cols^2``), ``block`` (one dense block
    per parameter tensor) and ``dense`` (``d^2``)."""
    model = as_chain_model(lenet5(), INPUT_SHAPE)
    layout = model.layout
    return {"diag": layout.dim, "kfac": sum(la.n_out**2 + la.n_cols**2 for la in kronecker_layers(model)),
            "block": sum((s.stop - s.start) ** 2 for s in layout.block_slices), "dense": layout.dim**2}


def comparison(kfac: dict[str, pd.DataFrame], mnist: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """:func:`structure_table` of the KFAC runs (``kfac``: ``scores``, ``variances``, ``elapsed``, the
    means over replicates) with the MNIST chapter's rows that the KFAC study has not (``mnist``, the
    same keys): MAP, SMP-none and the diagonal variants, in the order MAP, SMP-none, then per strategy
    diag and kfac."""
    parts = [pd.concat([kfac[key], mnist[key][~mnist[key].index.isin(kfac[key].index)]])
             for key in ("scores", "variances", "elapsed")]
    table = structure_table(*parts)
    order = ["MAP", "SMP-none"] + [f"SMP-{s}-{t}" for s in KFAC_STRATEGIES for t in ("diag", "kfac")]
    return table.reindex([name for name in order if name in table.index])


def precision_verdict(precision: pd.DataFrame, ridge: float) -> str:
    """What :func:`kfac_statistic_precision` says, in two sentences (Markdown): how much float32 rounds the
    statistic against the ridge, and whether that changes ``P^{-1} s`` or the shares below the ridge."""
    largest = precision["P^-1 s: relative difference, largest"]
    same = bool((precision["share below ridge (float32)"] == precision["share below ridge (float64)"]).all())
    shares = "the same in every layer" if same else "different in some layer"
    top = precision["largest eigenvalue of G (x) A"].max()
    text = (f"The largest eigenvalue of $G \\otimes A$ over the layers is {top:.3g}: float32 rounds the statistic by "
            f"about {1e-7 * top:.1g}, against the ridge {ridge:g}. ")
    if largest.max() < 0.01:
        return text + (f"Rounding changes $P^{{-1}} s$ by at most {largest.max():.2%} in any layer, and the shares "
                       f"below the ridge are {shares}: float32 is not what shapes this preconditioner.")
    return text + (f"Rounding changes $P^{{-1}} s$ by up to {largest.max():.1%} (layer {largest.idxmax()}), and the "
                   f"shares below the ridge are {shares}: here a float64 statistic would give other steps.")


def _z(row: pd.Series, column: str) -> float:
    """Observed minus predicted, in standard errors of the prediction, from a row of :func:`step_law_prediction`
    or :func:`step_law_sets`."""
    return (row[f"{column}: observed / predicted"] - 1) * row[f"{column}: predicted"] / row[f"{column}: predicted se"]


VARIANCES = {"params_variance": "parameter variance", "logits_variance": "logit variance"}


def prediction_text(prediction: pd.DataFrame) -> str:
    """The ratios observed / predicted of :func:`step_law_prediction`, with the predictions' relative
    standard errors, as one sentence."""
    def ratio(m, c):
        return prediction.loc[m, f"{c}: observed / predicted"]

    def se(m, c):
        return prediction.loc[m, f"{c}: predicted se"] / prediction.loc[m, f"{c}: predicted"]

    rows = prediction.index
    return ("Observed over predicted parameter variance: "
            + ", ".join(f"{m} {ratio(m, 'params_variance'):.2f}" for m in rows)
            + " (each prediction has a relative standard error of "
            + ", ".join(f"{se(m, 'params_variance'):.0%}" for m in rows)
            + "). For the logit variance: " + ", ".join(f"{m} {ratio(m, 'logits_variance'):.2f}" for m in rows)
            + " (standard errors " + ", ".join(f"{se(m, 'logits_variance'):.0%}" for m in rows) + ").")


def sets_text(sets: pd.DataFrame, threshold: float = 2.0) -> tuple[str, dict[str, Any]]:
    """What the two sets of draws (:func:`step_law_sets`, sets named ``set 0`` and ``set 1``) say: how far the
    second set's predictions lie from the first's, and which observed values lie within ``threshold`` standard
    errors of the pooled prediction. Returns the Markdown and the numbers it quotes."""
    pooled = sets.xs("pooled", level="set")
    difference = sets.xs("difference (se)", level="set")[[f"{c}: predicted" for c in VARIANCES]].to_numpy()
    cells = [(m, c, _z(pooled.loc[m], c), pooled.loc[m, f"{c}: observed / predicted"])
             for m in pooled.index for c in VARIANCES]
    within = [cell for cell in cells if abs(cell[2]) <= threshold]
    beyond = [cell for cell in cells if abs(cell[2]) > threshold]
    quoted = {"difference_min": float(np.nanmin(difference)), "difference_max": float(np.nanmax(difference)),
               "pooled_within": len(within), "pooled_cells": len(cells)}
    text = ("Observed minus the pooled prediction, in standard errors of the pooled prediction: parameter variance "
            + ", ".join(f"{m} {z:.1f}" for m, c, z, _ in cells if c == "params_variance") + "; logit variance "
            + ", ".join(f"{m} {z:.1f}" for m, c, z, _ in cells if c == "logits_variance") + ". "
            + f"The second set's predictions lie {quoted['difference_min']:.1f} to {quoted['difference_max']:.1f} "
            "standard errors of the difference from the first's. Pooled, "
            + f"{len(within)} of the {len(cells)} observed values lie within {threshold:g} standard errors of their "
            + "prediction" + ("." if not beyond else "; beyond: " + ", ".join(
                f"{m}'s {VARIANCES[c]} ({r:.1f} times its pooled prediction, {z:.1f} standard errors)"
                for m, c, z, r in beyond) + "."))
    return text, quoted


def chain_check_text(chains: pd.DataFrame) -> str:
    """What :func:`linearised_against_actual` says of the largest chains of the fixed-diag and fixed-kfac runs
    (``chains``: rows ``(method, rank)``): how far the fixed-diag chain with the largest share moved, against
    the next two, and how its actual logit change compares with the linearised one, and the others'."""
    actual, linear = "actual mean (f - f_0)^2", "linearised mean (J (theta - theta_0))^2"
    top = chains.loc[("SMP-fixed-diag", 0)]
    ratio = chains[actual] / chains[linear]
    others = ratio.drop(index=("SMP-fixed-diag", 0))
    spread = np.maximum(others, 1 / others).max()
    diag = chains.loc["SMP-fixed-diag"]
    distance = top["||theta - theta_0||^2"] / diag["||theta - theta_0||^2"].iloc[1:]
    return (f"The fixed-diag chain with the largest share ({top['share of the logit variance']:.0%} of the logit "
            f"variance on these images) moved at most {top['largest move']:.3g} from the MAP in any coordinate, "
            f"{distance.min():.1f} to {distance.max():.1f} times as far (in squared distance) as the next "
            f"{len(distance)}. Its actual squared logit change is {top[actual]:.3g} and the linearised one "
            f"{top[linear]:.3g}, a ratio of {ratio.loc[('SMP-fixed-diag', 0)]:.2f}. For the other chains of the "
            f"table the two agree within a factor {spread:.3g}.")


def step_direction_text(draws: pd.DataFrame, by_group: pd.DataFrame) -> tuple[str, dict[str, float]]:
    """Where the single steps go (:func:`step_law_by_group`): per unit of squared step, how much the whole
    step of each variant moves the linearised logits, the diagonal over the KFAC step per layer, and what the
    coordinates below the ridge contribute. Returns the Markdown and the numbers it quotes."""
    whole = draws.groupby("variant")[["output_sq", "step_sq"]].mean()
    per_unit = whole["output_sq"] / whole["step_sq"]
    median_output = draws.groupby("variant")["output_sq"].median()
    diag_ridge = by_group.loc[("SMP-fixed-diag", "diag Fisher below ridge")]
    per_layer = by_group["output change per ||u||^2"].unstack("method")
    per_layer = per_layer[per_layer.index.str.startswith("layer ")]
    layer_ratio = per_layer["SMP-fixed-diag"] / per_layer["SMP-fixed-kfac"]
    quoted = {"per_unit_ratio": per_unit["fixed-diag"] / per_unit["fixed-kfac"],
               "step_ratio": whole.loc["fixed-kfac", "step_sq"] / whole.loc["fixed-diag", "step_sq"],
               "layer_ratio_min": layer_ratio.min(), "layer_ratio_max": layer_ratio.max(),
               "diag_alignment": per_unit["fixed-diag"] / per_unit["none"],
               "kfac_alignment": per_unit["fixed-kfac"] / per_unit["none"],
               "ridge_step_share": diag_ridge["share of E||u||^2"],
               "ridge_output_share": diag_ridge["output change alone / whole"]}
    quoted = {k: float(v) for k, v in quoted.items()}
    text = (f"Per unit of squared step, the whole step changes the logits by {per_unit['none']:.3g} for SMP-none "
            f"(the raw score), {per_unit['fixed-diag']:.3g} for fixed-diag and {per_unit['fixed-kfac']:.3g} for "
            f"fixed-kfac: the diagonal step is {quoted['per_unit_ratio']:.0f} times as effective as the KFAC one at "
            f"moving the logits, keeping {quoted['diag_alignment']:.2g} of the raw score's effect against KFAC's "
            f"{quoted['kfac_alignment']:.2g}; layer by layer the factor is {quoted['layer_ratio_min']:.0f} to "
            f"{quoted['layer_ratio_max']:.0f}. The mean squared steps are {whole.loc['fixed-diag', 'step_sq']:.3g} "
            f"(diagonal) and {whole.loc['fixed-kfac', 'step_sq']:.3g} (KFAC), and the mean output changes "
            f"{whole.loc['fixed-diag', 'output_sq']:.3g} and {whole.loc['fixed-kfac', 'output_sq']:.3g}, a ratio of "
            f"{whole.loc['fixed-diag', 'output_sq'] / whole.loc['fixed-kfac', 'output_sq']:.0f} (of the medians "
            f"over the draws: {median_output['fixed-diag'] / median_output['fixed-kfac']:.0f}). The coordinates "
            f"whose diagonal Fisher is below the ridge take {quoted['ridge_step_share']:.0%} of the diagonal step's "
            f"squared norm, but the step cut to them changes the logits {quoted['ridge_output_share']:.1%} as much "
            "as the whole step.")
    return text, quoted


def tails_text(tails: pd.DataFrame, surprise: pd.DataFrame, largest: pd.DataFrame) -> tuple[str, dict[str, float]]:
    """How heavy the step laws' tails are (:func:`step_law_tails`, :func:`step_law_surprise`,
    :func:`largest_steps` of every variant): the share of each mean held by the largest 1 % of the draws, by
    the draws with a surprising label, and how many of the five largest diagonal steps are SMP-none's."""
    top = tails["share of the largest 1.0%"]
    rare = surprise.filter(like="share of draws with").iloc[:, 0]
    held = surprise[["their share of E||u||^2", "their share of E mean (J u)^2"]]
    diag_rows = set(largest.loc["SMP-fixed-diag", "training image"])
    none_rows = set(largest.loc["SMP-none", "training image"])
    quoted = {"top_share_min": float(top.min()), "top_share_max": float(top.max()),
               "surprise_share": float(rare.iloc[0]), "surprise_held_min": float(held.to_numpy().min()),
               "surprise_held_max": float(held.to_numpy().max()), "top_overlap": len(diag_rows & none_rows),
               "top_count": len(diag_rows)}
    text = (f"The largest 1 % of the draws hold {quoted['top_share_min']:.0%} to {quoted['top_share_max']:.0%} of "
            f"each mean. The {quoted['surprise_share']:.1%} of the draws whose drawn label had a model probability "
            f"below 0.5 hold {quoted['surprise_held_min']:.0%} to {quoted['surprise_held_max']:.0%} of each mean "
            "($\\lVert u \\rVert^2$ and the output change), over the three preconditioners. "
            f"{quoted['top_overlap']} of the {quoted['top_count']} largest diagonal steps below are also among "
            f"SMP-none's {quoted['top_count']} largest: the same scores.")
    return text, quoted


def compute(ctx) -> None:
    """The MNIST KFAC chapter's results (:mod:`smp_book.pipeline`): the MAP of the MNIST chapter (its cache),
    the directions at the ridge and the float32 check of the KFAC statistic, the replicates of the three KFAC
    variants (cached under ``.cache/mnist_kfac/``) with the MNIST chapter's rows beside them (its results, read
    with ``ctx.read("mnist")``), the verdicts, the law of one step at the MAP (two sets of draws, their raw
    draws kept as ``step_law_draws*.csv.gz``), the largest chains against the linearised network, the
    calibration figure and the numbers the prose quotes."""
    from . import plots
    from .mnist_runs import chapter_map, load_data, r_ratio, run_replicates, smp_seed, summarise
    from .pipeline import study_config

    cfg = ctx.config
    mnist = ctx.read("mnist")  # first: it fits the MAP and runs the diagonal variants this chapter reuses
    device = default_device()
    data, provenance = load_data(cfg)
    map_fit = chapter_map(cfg, data, device, use_cache=ctx.use_cache, progress=ctx.progress)
    theta_map = map_fit["theta"]

    at_ridge = ctx.table("directions_at_the_ridge", directions_at_the_ridge(theta_map, data, cfg["ridge"], device))
    precision = ctx.table("kfac_statistic_precision",
                          kfac_statistic_precision(theta_map, data, cfg["ridge"], device=device))

    runs = run_replicates(cfg, theta_map, data, device, use_cache=ctx.use_cache, progress=ctx.progress)
    summary = summarise(runs["tables"])
    for key, df in summary.items():
        ctx.table(key, df)
    ctx.table("diverged", runs["diverged"])
    divergence = ctx.table("divergence", runs["divergence"], index=False)

    theirs = {key: mnist.table(f"{key}_mean") for key in ("scores", "variances", "elapsed", "tails")}
    table = ctx.table("comparison", comparison({k: summary[f"{k}_mean"] for k in ("scores", "variances", "elapsed")},
                                               theirs))
    findings = ctx.table("findings", kfac_against_diag(table))

    # the law of one step at the MAP, two independent sets of draws
    step_draws = step_law_at_map(cfg, theta_map, data, device, ctx.use_cache, progress=ctx.progress)
    step_draws_again = step_law_at_map(cfg, theta_map, data, device, ctx.use_cache, progress=ctx.progress,
                                       draw_set=1)
    for name, draws in (("step_law_draws", step_draws), ("step_law_draws_set1", step_draws_again)):
        draws.to_csv(ctx.folder / f"{name}.csv.gz", index=False, compression={"method": "gzip", "mtime": 0})
    observed = table[["params_variance", "logits_variance"]].copy()
    shares = pd.concat([summary["tails_mean"], theirs["tails"]])["largest_chain_share"]
    observed["largest_chain_share"] = shares[~shares.index.duplicated()].reindex(observed.index)
    prediction = ctx.table("step_law_prediction", step_law_prediction(step_draws, cfg, observed))
    sets = ctx.table("step_law_sets", step_law_sets({"set 0": step_draws, "set 1": step_draws_again}, cfg, observed))

    x_eval = data["test"][0][: cfg["step_law_eval"]]
    chains = {}
    for name, study_cfg in (("fixed-diag", study_config("mnist", ctx.scale)), ("fixed-kfac", cfg)):
        run = cached_run(study_cfg, name, theta_map, data, device, ctx.use_cache, progress=ctx.progress)
        chains[f"SMP-{name}"] = linearised_against_actual(theta_map, run.theta, x_eval, device).head(3)
    chains = ctx.table("step_law_largest_chains", pd.concat(chains, names=["method", "rank"]))

    by_group = ctx.table("step_law_by_group",
                         step_law_by_group(step_draws, step_law_groups(theta_map, data, cfg["ridge"], device)))
    step_tails = ctx.table("step_law_tails", step_law_tails(step_draws))
    surprise = ctx.table("step_law_surprise", step_law_surprise(step_draws))
    largest = ctx.table("step_law_largest", pd.concat({f"SMP-{v}": largest_steps(step_draws, v)
                                                      for v in STEP_LAW_VARIANTS}, names=["method"]))

    ctx.figure("calibration_kfac", plots.calibration_all({n: e["curve"] for n, e in runs["figure_evals"].items()},
                                                         "Calibration, MNIST, KFAC"))

    # the numbers the prose quotes
    for key in ("n_train", "n_val", "n_chains", "n_steps", "ridge", "period", "ema_refresh", "step_law_draws",
                "step_law_eval"):
        ctx.value(key, cfg[key])
    ctx.value("n_fisher_periodic", cfg["n_fisher_periodic"] or cfg["n_val"])
    ctx.value("replicates", cfg["smp_replicates"])
    ctx.value("mnist_replicates", mnist.config["smp_replicates"])
    ctx.value("chain_steps", cfg["n_chains"] * cfg["n_steps"])
    ctx.value("mean_chain_share", 1 / cfg["n_chains"])
    ctx.value("r_ratio", r_ratio(cfg))
    ctx.value("device", str(device))
    ctx.value("threads", torch.get_num_threads())
    for variant, tau in cfg["tau"].items():
        ctx.value(f"tau_{variant.split('-')[0]}", tau)
    for structure, count in storage_per_chain().items():
        ctx.value(f"storage_{structure}", count)
    everywhere = at_ridge.loc["all"]
    ctx.value("diag_share_zero", everywhere["diag: share exactly zero"])
    ctx.value("diag_share_below_ridge", everywhere["diag: share below ridge"])
    ctx.value("kfac_share_below_ridge", everywhere["kfac: share below ridge"])
    ctx.value("inactive_units", everywhere["units with zero G row"])
    ctx.value("precision_text", precision_verdict(precision, cfg["ridge"]))

    m = theirs["scores"]
    diagonal = [f"SMP-{s}-diag" for s in KFAC_STRATEGIES]
    ctx.value("diag_mi_over_none_min", (m.loc[diagonal, "mutual_info"] / m.loc["SMP-none", "mutual_info"]).min())
    ctx.value("diag_mi_over_none_max", (m.loc[diagonal, "mutual_info"] / m.loc["SMP-none", "mutual_info"]).max())
    ctx.value("diag_nll_above_map", int((m.loc[diagonal, "nll"] > m.loc["MAP", "nll"]).sum()))
    ctx.value("map_nll_gap", abs(m.loc["MAP", "nll"] - summary["scores_mean"].loc["MAP", "nll"]))
    seconds = table["seconds"]
    time_ratio = pd.Series({s: seconds[f"SMP-{s}-kfac"] / seconds[f"SMP-{s}-diag"] for s in KFAC_STRATEGIES})
    ctx.value("time_ratio_min", time_ratio.min())
    ctx.value("time_ratio_max", time_ratio.max())

    ctx.value("diverged_chains", int(divergence["diverged"].sum()))
    ctx.value("largest_move", divergence["largest_move_of_a_kept_chain"].max())
    for strategy in KFAC_STRATEGIES:
        ctx.value(f"mi_ratio_{strategy}", findings.loc[strategy, "mi_kfac_over_diag"])
        ctx.value(f"nll_kfac_{strategy}", findings.loc[strategy, "nll_kfac"])
        ctx.value(f"nll_diag_{strategy}", findings.loc[strategy, "nll_diag"])
    ctx.value("nll_map", table.loc["MAP", "nll"])
    n_less = int((findings["kfac less dispersed (smaller MI)"] == "yes").sum())
    n_lower = int((findings["kfac lower NLL"] == "yes").sum())
    ctx.value("kfac_less_dispersed", n_less)
    ctx.value("kfac_lower_nll", n_lower)
    ctx.value("strategies", len(findings))
    ctx.value("answer", ("It does" if n_less == len(findings) else "Partly" if n_less else "It does not")
              + f": with {n_less} of the {len(findings)} temporal strategies the KFAC run is less dispersed "
              f"(smaller mutual information) than the diagonal one, and with {n_lower} it predicts better "
              "(smaller NLL).")
    lv = table["logits_variance"]
    ctx.value("fixed_kfac_lv_over_none", lv["SMP-fixed-kfac"] / lv["SMP-none"])
    ctx.value("fixed_diag_lv_over_none", lv["SMP-fixed-diag"] / lv["SMP-none"])
    pv = table["params_variance"]
    ctx.value("fixed_kfac_pv_over_diag", pv["SMP-fixed-kfac"] / pv["SMP-fixed-diag"])

    ctx.value("prediction_text", prediction_text(prediction))
    text, quoted = sets_text(sets)
    ctx.value("sets_text", text)
    for key, value in quoted.items():
        ctx.value(f"sets_{key}", value)
    diag_shares = mnist.table("tails_replicates")["largest_chain_share"].xs("SMP-fixed-diag", level="method")
    ctx.value("diag_top_chain_share_min", diag_shares.min())
    ctx.value("diag_top_chain_share_max", diag_shares.max())
    ctx.value("chain_text", chain_check_text(chains))
    text, quoted = step_direction_text(step_draws, by_group)
    ctx.value("direction_text", text)
    for key, value in quoted.items():
        ctx.value(key, value)
    text, quoted = tails_text(step_tails, surprise, largest)
    ctx.value("tails_text", text)
    for key, value in quoted.items():
        ctx.value(key, value)

    ctx.record(seeds={"split": cfg["split_seed"], "map": map_fit["seed"],
                      "smp": {f"replicate_{r}": {v: smp_seed(cfg, i, r) for i, v in enumerate(cfg["variants"])}
                              for r in range(cfg["smp_replicates"])},
                      "step_law": [step_law_seed(cfg, 0), step_law_seed(cfg, 1)]},
               device=str(device), data=provenance, r_ratio=r_ratio(cfg), smp_path=smp_path(device),
               raw_files=["step_law_draws.csv.gz", "step_law_draws_set1.csv.gz"])
