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

from . import mnist_runs as mr
from .pipeline import CACHE, cached, code_hash, study_config
from .step_law import draw_steps, predicted_variances, top_share

KFAC_STRATEGIES = ("fixed", "ema", "periodic")
STEP_LAW_VARIANTS = ("none", "fixed-diag", "fixed-kfac")
STEP_LAW_BATCH = 100  # scores per batch of draw_steps: it sets the order of the random numbers
VARIANCES = ("params_variance", "logits_variance")
RAW_FILES = ("step_law_draws.csv.gz", "step_law_draws_set1.csv.gz")  # the two sets of draws, as written


def _lenet(device: torch.device | None = None):
    return as_chain_model(lenet5().to(device), mr.INPUT_SHAPE)


def _at(theta0: torch.Tensor, data: dict, device: torch.device | None):
    """The device, LeNet-5 there, ``theta0`` there as one chain ``(1, d)`` and the validation set there."""
    device = device or mr.default_device()
    return device, _lenet(device), theta0.to(device)[None], *(t.to(device) for t in data["val"])


def structure_table(scores: pd.DataFrame, variances: pd.DataFrame, elapsed: pd.DataFrame) -> pd.DataFrame:
    """One row per method: its strategy and structure (none for ``MAP``, ``SMP-none``), scores, variances, seconds."""
    table = scores[["accuracy", "nll", "ece", "mutual_info"]].join(variances[["logits_variance", "params_variance"]])
    parts = [name.removeprefix("SMP-").split("-") if name.count("-") == 2 else ["", ""] for name in table.index]
    return pd.DataFrame(parts, table.index, ["strategy", "structure"]).join(table.join(elapsed[["seconds"]]))


def kfac_against_diag(table: pd.DataFrame) -> pd.DataFrame:
    """Per strategy with both rows in ``table`` (:func:`structure_table`): kfac / diag of the MI and the logit
    variance, the NLLs beside MAP's, and whether KFAC has the smaller MI and the smaller NLL."""
    rows = []
    for s in KFAC_STRATEGIES:
        if {f"SMP-{s}-diag", f"SMP-{s}-kfac"} <= set(table.index):
            d, k = table.loc[f"SMP-{s}-diag"], table.loc[f"SMP-{s}-kfac"]
            rows.append({"strategy": s, "mi_kfac_over_diag": k["mutual_info"] / d["mutual_info"],
                         "logits_variance_kfac_over_diag": k["logits_variance"] / d["logits_variance"],
                         "nll_diag": d["nll"], "nll_kfac": k["nll"], "nll_map": table.loc["MAP", "nll"],
                         "kfac less dispersed (smaller MI)": "yes" if k["mutual_info"] < d["mutual_info"] else "no",
                         "kfac lower NLL": "yes" if k["nll"] < d["nll"] else "no"})
    return pd.DataFrame(rows).set_index("strategy") if rows else pd.DataFrame()


def directions_at_the_ridge(theta0: torch.Tensor, data: dict, ridge: float,
                            device: torch.device | None = None) -> pd.DataFrame:
    """Per layer, the share of the directions of the fixed strategies' ``P - ridge I`` below ``ridge`` (diagonal
    entries; KFAC's ``lambda_G lambda_A``), and the units whose ``G`` row is zero (never active)."""
    _, model, theta, xv, yv = _at(theta0, data, device)
    (diag,) = estimate_fisher(model, mr._categorical(), theta, xv, yv, kind="empirical", structure="diag")
    factors = estimate_fisher(model, mr._categorical(), theta, xv, yv, kind="empirical", structure="kfac")
    rows = []
    for i, layer in enumerate(kronecker_layers(model)):
        a, g = factors[2 * i][0].double().cpu(), factors[2 * i + 1][0].double().cpu()
        products = torch.linalg.eigvalsh(g).clamp_min(0)[:, None] * torch.linalg.eigvalsh(a).clamp_min(0)[None, :]
        entries = diag[0, layer.positions()].double().cpu()
        rows.append({"layer": i + 1, "shape [W, b]": f"{layer.n_out} x {layer.n_cols}", "parameters": entries.numel(),
                     "diag: share below ridge": float((entries < ridge).double().mean()),
                     "diag: share exactly zero": float((entries == 0).double().mean()),
                     "kfac: share below ridge": float((products < ridge).double().mean()),
                     "units with zero G row": int((g.diagonal() == 0).sum())})
    table = pd.DataFrame(rows).set_index("layer")
    weights = table["parameters"] / table["parameters"].sum()
    table.loc["all"] = {"shape [W, b]": "", "parameters": table["parameters"].sum(),
                        **{c: float((table[c] * weights).sum()) for c in table.columns if "share" in c},
                        "units with zero G row": int(table["units with zero G row"].sum())}
    return table


def kfac_statistic_precision(theta0: torch.Tensor, data: dict, ridge: float, n_scores: int = 200,
                             device: torch.device | None = None) -> pd.DataFrame:
    """Whether float32 rounding of the statistic changes the fixed-kfac ``P`` at ``theta0``: per layer, float32 against
    float64, ``P^{-1} s`` for the scores of ``n_scores`` validation images, the shares below the ridge, the spectra."""
    _, model, theta, xv, yv = _at(theta0, data, device)
    layers, n = kronecker_layers(model), min(n_scores, xv.shape[0])
    scores = fisher_vectors(model, mr._categorical(), theta.expand(n, -1), xv[:n], yv[:n], "empirical")[:, 0]
    factors, states, solved = {}, {}, {}
    for name, dtype in (("float32", None), ("float64", torch.float64)):
        factors[name] = estimate_fisher(model, mr._categorical(), theta, xv, yv, kind="empirical", structure="kfac",
                                        dtype=dtype)
        precond = build_preconditioner("kfac", "fixed", dim=model.layout.dim, layers=layers, ridge=ridge,
                                       statistic_dtype=dtype)
        states[name] = precond.init(theta, lambda t, name=name: factors[name])
        solved[name] = precond.solve(states[name], scores).double().cpu()
    rows = []
    for i, layer in enumerate(layers):
        reference = solved["float64"][:, layer.positions()]
        rel = (solved["float32"][:, layer.positions()] - reference).norm(dim=1) / reference.norm(dim=1)
        eig = {(m, name): torch.linalg.eigvalsh(f[2 * i + j][0].double().cpu()) for name, f in factors.items()
               for j, m in enumerate("AG")}
        rows.append({"layer": i + 1, "shape [W, b]": f"{layer.n_out} x {layer.n_cols}",
                     "P^-1 s: relative difference, median": float(rel.median()),
                     "P^-1 s: relative difference, largest": float(rel.max()),
                     "largest eigenvalue of G (x) A": float(eig["A", "float64"][-1] * eig["G", "float64"][-1]),
                     # the factor's scales 1 / (lambda_G lambda_A + ridge) are above 1 / (2 ridge) below the ridge
                     **{f"share below ridge ({name})": float((state.factor[3 * i + 2][0].double().cpu()
                                                              > 1.0 / (2.0 * ridge)).double().mean())
                        for name, state in states.items()},
                     **{f"smallest eigenvalue of {m} ({name})": float(e[0]) for (m, name), e in eig.items()}})
    return pd.DataFrame(rows).set_index("layer")


def step_law_seed(cfg: dict[str, Any], draw_set: int = 0) -> int:
    """The seed of the independent set ``draw_set`` of steps, the same for every variant (paired draws)."""
    if isinstance(draw_set, bool) or not (isinstance(draw_set, numbers.Integral) and 0 <= draw_set < 100):
        raise ValueError(f"draw_set must be an integer in [0, 100), got {draw_set!r}")
    return cfg["seed"] + 700 + int(draw_set)


def step_law_groups(theta0: torch.Tensor, data: dict, ridge: float, device: torch.device | None = None
                    ) -> dict[str, torch.Tensor]:
    """The groups of :func:`step_law_at_map`: LeNet-5's layers, and the coordinates whose diagonal Fisher is below
    ``ridge`` or not."""
    below = mr.validation_fisher_diagonal(theta0, data, device) < ridge
    return {**{f"layer {i + 1}": layer.positions() for i, layer in enumerate(kronecker_layers(_lenet()))},
            "diag Fisher below ridge": below, "diag Fisher at or above ridge": ~below}


def step_law_at_map(cfg: dict[str, Any], theta_map: torch.Tensor, data: dict, device: torch.device | None = None,
                    use_cache: bool = True, progress: bool = True, cache_root: str | Path = CACHE,
                    draw_set: int = 0, groups: dict[str, torch.Tensor] | None = None) -> pd.DataFrame:
    """Set ``draw_set`` of steps at the MAP of each of :data:`STEP_LAW_VARIANTS` (:func:`~smp_book.step_law.draw_steps`,
    the same scores for all), per group of :func:`step_law_groups`, with ``variant`` and ``training_label``; cached."""
    device, net, theta, xv, yv = _at(theta_map, data, device)
    x, x_eval = data["train"][0].to(device), data["test"][0][: cfg["step_law_eval"]].to(device)
    seed = step_law_seed(cfg, draw_set)
    groups = step_law_groups(theta_map, data, cfg["ridge"], device) if groups is None else groups
    frames = []
    for variant in STEP_LAW_VARIANTS:
        key = {**mr.map_key(cfg), "part": f"step law {variant}",
               **{k: cfg[k] for k in ("ridge", "step_law_draws", "step_law_eval")}, "step_law_batch": STEP_LAW_BATCH,
               "device": torch.device(device).type, "seed": seed, "code": code_hash(__name__)}

        def draw(variant=variant):
            precond = mr.variant_preconditioner(cfg, variant)
            state = precond.init(theta, lambda t: estimate_fisher(net, mr._categorical(), t, xv, yv,
                                                                  kind="empirical", structure=precond.structure))
            return draw_steps(net, "categorical", x, theta[0], precond, state, n_draws=cfg["step_law_draws"],
                              groups=groups, x_eval=x_eval, seed=seed, batch=STEP_LAW_BATCH, progress=progress)

        draws = cached("mnist_kfac", key, draw, root=cache_root, enabled=use_cache)
        labels = data["train"][1].numpy()[draws["row"].to_numpy()]
        frames.append(draws.assign(variant=variant, training_label=labels).reset_index())
    return pd.concat(frames, ignore_index=True)


def step_law_prediction(draws: pd.DataFrame, cfg: dict[str, Any], observed: pd.DataFrame) -> pd.DataFrame:
    """Per variant, the variances of a run that stayed at the MAP (:func:`~smp_book.step_law.predicted_variances`),
    beside ``observed`` (rows ``SMP-<variant>``: the variances and optionally ``largest_chain_share``)."""
    dim = _lenet().layout.dim
    rows = []
    for variant, d in draws.groupby("variant", sort=False):
        pred = predicted_variances(d, cfg["n_train"], cfg["n_steps"], mr.variant_tau(cfg, variant), dim)
        obs, row = observed.reindex([f"SMP-{variant}"]).iloc[0], {"method": f"SMP-{variant}"}
        for c in VARIANCES:
            row.update({f"{c}: predicted": pred[c], f"{c}: predicted se": pred[f"{c}_se"], f"{c}: observed": obs[c],
                        f"{c}: observed / predicted": obs[c] / pred[c]})
        row["largest chain's share of the observed logit variance"] = obs.get("largest_chain_share", np.nan)
        rows.append(row)
    return pd.DataFrame(rows).set_index("method")


def step_law_sets(sets: dict[str, pd.DataFrame], cfg: dict[str, Any], observed: pd.DataFrame) -> pd.DataFrame:
    """:func:`step_law_prediction` of independent sets of draws (``name -> draws``) and of all pooled, rows
    ``(method, set)``; for two sets the rows ``difference (se)`` hold (second - first) / its standard error."""
    if "pooled" in sets:
        raise ValueError("'pooled' names the pooled rows: give the sets other names")
    pooled = pd.concat(sets.values(), ignore_index=True)
    tables = {name: step_law_prediction(d, cfg, observed) for name, d in {**sets, "pooled": pooled}.items()}
    columns = [f"{c}: {k}" for c in VARIANCES for k in ("predicted", "predicted se", "observed / predicted")]
    rows = []
    for method in tables["pooled"].index:
        rows += [{"method": method, "set": name, **table.loc[method, columns]} for name, table in tables.items()]
        if len(sets) == 2:
            a, b = (tables[name].loc[method] for name in sets)
            rows.append({"method": method, "set": "difference (se)", **{
                f"{c}: predicted": (b[f"{c}: predicted"] - a[f"{c}: predicted"])
                / math.hypot(a[f"{c}: predicted se"], b[f"{c}: predicted se"]) for c in VARIANCES}})
    return pd.DataFrame(rows).set_index(["method", "set"])


def step_law_tails(draws: pd.DataFrame) -> pd.DataFrame:
    """How heavy the tails of each variant's ``||u||^2`` and ``mean (J u)^2`` are."""
    rows = []
    for variant, d in draws.groupby("variant", sort=False):
        for v, label in ((d["step_sq"], "||u||^2"), (d["output_sq"], "mean (J u)^2")):
            rows.append({"method": f"SMP-{variant}", "quantity": label, "mean": v.mean(), "median": v.median(),
                         "99th percentile": v.quantile(0.99), "largest": v.max(),
                         "mean / median": v.mean() / v.median(),
                         **{f"share of the largest {f:.1%}": top_share(v, f) for f in (0.01, 0.001)}})
    return pd.DataFrame(rows).set_index(["method", "quantity"])


def step_law_by_group(draws: pd.DataFrame, groups: dict[str, torch.Tensor]) -> pd.DataFrame:
    """Where each variant's steps go, per group: its shares of ``E ||s||^2``, ``E ||u||^2`` and of the output change,
    and the output change per unit of ``||u_g||^2``."""
    rows = []
    for variant, d in draws.groupby("variant", sort=False):
        for name, g in groups.items():
            g, mean = torch.as_tensor(g), {c: d[f"{c}[{name}]"].mean() for c in ("score_sq", "step_sq", "output_sq")}
            rows.append({"method": f"SMP-{variant}", "group": name,
                         "parameters": int(g.sum()) if g.dtype == torch.bool else g.numel(),
                         "share of E||s||^2": mean["score_sq"] / d["score_sq"].mean(),
                         "share of E||u||^2": mean["step_sq"] / d["step_sq"].mean(),
                         "output change alone / whole": mean["output_sq"] / d["output_sq"].mean(),
                         "output change per ||u||^2": mean["output_sq"] / mean["step_sq"]})
    return pd.DataFrame(rows).set_index(["method", "group"])


def largest_steps(draws: pd.DataFrame, variant: str, n: int = 5) -> pd.DataFrame:
    """The ``n`` draws of ``variant`` with the largest output change."""
    d = draws[draws["variant"] == variant]
    top = d.nlargest(n, "output_sq")
    table = pd.DataFrame({
        "training image": top["row"], "training label": top["training_label"],
        "probability of the drawn label": np.exp(top["log_prob"]), "mean (J u)^2": top["output_sq"],
        "share of the sum": top["output_sq"] / d["output_sq"].sum(), "||u||^2": top["step_sq"],
        "share of ||u||^2 below the ridge": top["step_sq[diag Fisher below ridge]"] / top["step_sq"],
        "layer changing the outputs most": top.filter(like="output_sq[layer ").idxmax(axis=1).str[10:-1]})
    return table.set_axis(pd.RangeIndex(1, len(top) + 1, name="rank"))


def step_law_surprise(draws: pd.DataFrame, threshold: float = 0.5) -> pd.DataFrame:
    """The share of each variant's draws whose drawn label had probability below ``threshold``, and their shares."""
    rows = []
    for variant, d in draws.groupby("variant", sort=False):
        rare = np.exp(d["log_prob"]) < threshold
        rows.append({"method": f"SMP-{variant}", f"share of draws with p(Y | X) < {threshold:g}": rare.mean(),
                     **{f"their share of {label}": d.loc[rare, column].sum() / d[column].sum()
                        for column, label in (("score_sq", "E||s||^2"), ("step_sq", "E||u||^2"),
                                              ("output_sq", "E mean (J u)^2"))}})
    return pd.DataFrame(rows).set_index("method")


def step_law_numbers(draws: pd.DataFrame, by_group: pd.DataFrame, tails: pd.DataFrame, surprise: pd.DataFrame,
                     largest: pd.DataFrame, sets: pd.DataFrame, threshold: float = 2.0) -> dict[str, float]:
    """The numbers the chapter's prose quotes of the tables of the step law (``sets``: :func:`step_law_sets` of two
    sets; ``sets_pooled_within``: observed values within ``threshold`` standard errors of the pooled prediction)."""
    whole = draws.groupby("variant")[["output_sq", "step_sq"]].mean()
    per_unit = whole["output_sq"] / whole["step_sq"]
    ridge = by_group.loc[("SMP-fixed-diag", "diag Fisher below ridge")]
    per_layer = by_group["output change per ||u||^2"].unstack("method")
    per_layer = per_layer[per_layer.index.str.startswith("layer ")]
    layer_ratio = per_layer["SMP-fixed-diag"] / per_layer["SMP-fixed-kfac"]
    held = surprise[["their share of E||u||^2", "their share of E mean (J u)^2"]].to_numpy()
    top = tails["share of the largest 1.0%"]
    top_diag, top_none = (set(largest.loc[f"SMP-{v}", "training image"]) for v in ("fixed-diag", "none"))
    pooled = sets.xs("pooled", level="set")
    z = np.array([(pooled[f"{c}: observed / predicted"] - 1) * pooled[f"{c}: predicted"] / pooled[f"{c}: predicted se"]
                  for c in VARIANCES])
    difference = sets.xs("difference (se)", level="set")[[f"{c}: predicted" for c in VARIANCES]].to_numpy()
    numbers = {"per_unit_ratio": per_unit["fixed-diag"] / per_unit["fixed-kfac"],
               "step_ratio": whole.loc["fixed-kfac", "step_sq"] / whole.loc["fixed-diag", "step_sq"],
               "layer_ratio_min": layer_ratio.min(), "layer_ratio_max": layer_ratio.max(),
               "diag_alignment": per_unit["fixed-diag"] / per_unit["none"],
               "kfac_alignment": per_unit["fixed-kfac"] / per_unit["none"],
               "ridge_step_share": ridge["share of E||u||^2"],
               "ridge_output_share": ridge["output change alone / whole"],
               "top_share_min": top.min(), "top_share_max": top.max(),
               "surprise_share": surprise.filter(like="share of draws with").iloc[0, 0],
               "surprise_held_min": held.min(), "surprise_held_max": held.max(),
               "sets_difference_min": np.nanmin(difference), "sets_difference_max": np.nanmax(difference)}
    return {**{k: float(v) for k, v in numbers.items()}, "top_overlap": len(top_diag & top_none),
            "top_count": len(top_diag), "sets_pooled_within": int((np.abs(z) <= threshold).sum()),
            "sets_pooled_cells": z.size}


def linearised_against_actual(theta_map: torch.Tensor, thetas: torch.Tensor, x_eval: torch.Tensor,
                              device: torch.device | None = None) -> pd.DataFrame:
    """Per kept chain of a run, on ``x_eval``: its share of the logit variance, how far it moved, and the actual and
    the linearised change of its logits; largest share first."""
    device = device or mr.default_device()
    net, x, theta0 = _lenet(device), x_eval.to(device).reshape(-1, *mr.INPUT_SHAPE), theta_map.to(device)
    kept = torch.isfinite(thetas).all(1)
    chains, thetas = kept.nonzero().reshape(-1).tolist(), thetas[kept].to(device)

    def logits(flat):
        return torch.func.functional_call(net.module, net.layout.unflatten(flat), (x,))

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


def storage_per_chain() -> dict[str, int]:
    """How many numbers one chain's preconditioner holds for LeNet-5, per structure."""
    model = _lenet()
    return {"diag": model.layout.dim, "kfac": sum(la.n_out**2 + la.n_cols**2 for la in kronecker_layers(model)),
            "block": sum((s.stop - s.start) ** 2 for s in model.layout.block_slices), "dense": model.layout.dim**2}


def comparison(kfac: dict[str, pd.DataFrame], mnist: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """:func:`structure_table` of the KFAC runs' means with the MNIST chapter's rows they lack, in the book's order."""
    parts = [pd.concat([kfac[key], mnist[key][~mnist[key].index.isin(kfac[key].index)]])
             for key in ("scores", "variances", "elapsed")]
    table = structure_table(*parts)
    order = ["MAP", "SMP-none"] + [f"SMP-{s}-{t}" for s in KFAC_STRATEGIES for t in ("diag", "kfac")]
    return table.reindex([name for name in order if name in table.index])


def precision_verdict(precision: pd.DataFrame, ridge: float) -> str:
    """What :func:`kfac_statistic_precision` says, in Markdown."""
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


def chain_check_text(chains: pd.DataFrame) -> str:
    """What :func:`linearised_against_actual` says of the largest chains (rows ``(method, rank)``), in Markdown."""
    actual, linear = "actual mean (f - f_0)^2", "linearised mean (J (theta - theta_0))^2"
    top = chains.loc[("SMP-fixed-diag", 0)]
    ratio = chains[actual] / chains[linear]
    others = ratio.drop(index=("SMP-fixed-diag", 0))
    distance = top["||theta - theta_0||^2"] / chains.loc["SMP-fixed-diag", "||theta - theta_0||^2"].iloc[1:]
    return (f"The fixed-diag chain with the largest share ({top['share of the logit variance']:.0%} of the logit "
            f"variance on these images) moved at most {top['largest move']:.3g} from the MAP in any coordinate, "
            f"{distance.min():.1f} to {distance.max():.1f} times as far (in squared distance) as the next "
            f"{len(distance)}. Its actual squared logit change is {top[actual]:.3g} and the linearised one "
            f"{top[linear]:.3g}, a ratio of {ratio.loc[('SMP-fixed-diag', 0)]:.2f}. For the other chains of the "
            f"table the two agree within a factor {np.maximum(others, 1 / others).max():.3g}.")


def answer(findings: pd.DataFrame, replicates: int) -> str:
    """The chapter's answer from :func:`kfac_against_diag`'s rows, and its evidence (``replicates`` runs)."""
    n_less = int((findings["kfac less dispersed (smaller MI)"] == "yes").sum())
    n_lower = int((findings["kfac lower NLL"] == "yes").sum())
    evidence = ("in one run, whose spread over runs is not measured" if replicates == 1
                else f"in the means of {replicates} runs")
    return (("It does" if n_less == len(findings) else "Partly" if n_less else "It does not")
            + f", {evidence}: with {n_less} of the {len(findings)} temporal strategies the KFAC run is less "
            f"dispersed (smaller mutual information) than the diagonal one, and with {n_lower} its test NLL is "
            "smaller.")


def compute(ctx) -> None:
    """The MNIST KFAC chapter's results (:mod:`smp_book.pipeline`)."""
    from . import plots

    cfg, ridge = ctx.config, ctx.config["ridge"]
    mnist = ctx.read("mnist")  # first: it fits the MAP and runs the diagonal variants this chapter reuses
    device = mr.default_device()
    data, provenance = mr.load_data(cfg)
    map_fit = mr.chapter_map(cfg, data, device, use_cache=ctx.use_cache, progress=ctx.progress)
    theta_map = map_fit["theta"]

    at_ridge = ctx.table("directions_at_the_ridge", directions_at_the_ridge(theta_map, data, ridge, device)).loc["all"]
    precision = ctx.table("kfac_statistic_precision", kfac_statistic_precision(theta_map, data, ridge, device=device))
    runs = mr.run_replicates(cfg, theta_map, data, device, use_cache=ctx.use_cache, progress=ctx.progress)
    summary = mr.summarise(runs["tables"])
    for key, df in {**summary, "diverged": runs["diverged"]}.items():
        ctx.table(key, df)
    divergence = ctx.table("divergence", runs["divergence"], index=False)
    parts = ("scores", "variances", "elapsed")
    theirs = {key: mnist.table(f"{key}_mean") for key in (*parts, "tails")}
    table = ctx.table("comparison", comparison({k: summary[f"{k}_mean"] for k in parts}, theirs))
    findings = ctx.table("findings", kfac_against_diag(table))

    # the law of one step at the MAP: two independent sets of draws, against the runs
    groups = step_law_groups(theta_map, data, ridge, device)
    sets = {f"set {i}": step_law_at_map(cfg, theta_map, data, device, ctx.use_cache, ctx.progress, draw_set=i,
                                        groups=groups) for i in (0, 1)}
    for name, draws in zip(RAW_FILES, sets.values(), strict=True):
        draws.to_csv(ctx.folder / name, index=False, compression={"method": "gzip", "mtime": 0})
    draws, observed = sets["set 0"], table[list(VARIANCES)].copy()
    shares = pd.concat([summary["tails_mean"], theirs["tails"]])["largest_chain_share"]
    observed["largest_chain_share"] = shares[~shares.index.duplicated()].reindex(observed.index)
    ctx.table("step_law_prediction", step_law_prediction(draws, cfg, observed))
    set_table = ctx.table("step_law_sets", step_law_sets(sets, cfg, observed))
    x_eval, chains = data["test"][0][: cfg["step_law_eval"]], {}
    for name, run_cfg in (("fixed-diag", study_config("mnist", ctx.scale)), ("fixed-kfac", cfg)):  # replicate 0
        run = cached(run_cfg.get("study", "mnist"), mr.run_key(run_cfg, name, 0, mr.smp_path(device)),
                     lambda c=run_cfg, n=name: mr.run_variant(c, n, theta_map, data, mr.study_variants(c).index(n),
                                                              device, None, ctx.progress), enabled=ctx.use_cache)
        chains[f"SMP-{name}"] = linearised_against_actual(theta_map, run.theta, x_eval, device).head(3)
    chains = ctx.table("step_law_largest_chains", pd.concat(chains, names=["method", "rank"]))
    numbers = step_law_numbers(
        draws, ctx.table("step_law_by_group", step_law_by_group(draws, groups)),
        ctx.table("step_law_tails", step_law_tails(draws)), ctx.table("step_law_surprise", step_law_surprise(draws)),
        ctx.table("step_law_largest", pd.concat({f"SMP-{v}": largest_steps(draws, v) for v in STEP_LAW_VARIANTS},
                                                names=["method"])), set_table)
    ctx.figure("calibration_kfac", plots.calibration_all({n: e["curve"] for n, e in runs["figure_evals"].items()},
                                                         "Calibration, MNIST, KFAC"))

    # the numbers the prose quotes
    m, lv, pv, seconds = theirs["scores"], table["logits_variance"], table["params_variance"], table["seconds"]
    diagonal = [f"SMP-{s}-diag" for s in KFAC_STRATEGIES]
    diag_mi = m.loc[diagonal, "mutual_info"] / m.loc["SMP-none", "mutual_info"]
    time_ratio = pd.Series({s: seconds[f"SMP-{s}-kfac"] / seconds[f"SMP-{s}-diag"] for s in KFAC_STRATEGIES})
    top_shares = mnist.table("tails_replicates")["largest_chain_share"].xs("SMP-fixed-diag", level="method")
    values = {key: cfg[key] for key in ("n_train", "n_val", "n_chains", "n_steps", "ridge", "period", "ema_refresh",
                                        "step_law_draws", "step_law_eval")}
    values.update({f"tau_{variant.split('-')[0]}": tau for variant, tau in cfg["tau"].items()})
    values.update({f"storage_{structure}": count for structure, count in storage_per_chain().items()})
    values.update({f"mi_ratio_{s}": findings.loc[s, "mi_kfac_over_diag"] for s in KFAC_STRATEGIES})
    values.update(numbers, n_fisher_periodic=cfg["n_fisher_periodic"] or cfg["n_val"],
                  replicates=cfg["smp_replicates"], mnist_replicates=mnist.config["smp_replicates"],
                  chain_steps=cfg["n_chains"] * cfg["n_steps"], mean_chain_share=1 / cfg["n_chains"],
                  r_ratio=mr.r_ratio(cfg), device=str(device), threads=torch.get_num_threads(),
                  diag_share_zero=at_ridge["diag: share exactly zero"],
                  diag_share_below_ridge=at_ridge["diag: share below ridge"],
                  inactive_units=at_ridge["units with zero G row"], precision_text=precision_verdict(precision, ridge),
                  diag_mi_over_none_min=diag_mi.min(), diag_mi_over_none_max=diag_mi.max(),
                  diag_nll_above_map=int((m.loc[diagonal, "nll"] > m.loc["MAP", "nll"]).sum()),
                  map_nll_gap=abs(m.loc["MAP", "nll"] - summary["scores_mean"].loc["MAP", "nll"]),
                  time_ratio_min=time_ratio.min(), time_ratio_max=time_ratio.max(),
                  diverged_chains=int(divergence["diverged"].sum()),
                  largest_move=divergence["largest_move_of_a_kept_chain"].max(),
                  answer=answer(findings, cfg["smp_replicates"]),
                  fixed_kfac_lv_over_none=lv["SMP-fixed-kfac"] / lv["SMP-none"],
                  fixed_diag_lv_over_none=lv["SMP-fixed-diag"] / lv["SMP-none"],
                  fixed_kfac_pv_over_diag=pv["SMP-fixed-kfac"] / pv["SMP-fixed-diag"],
                  diag_top_chain_share_min=top_shares.min(), diag_top_chain_share_max=top_shares.max(),
                  chain_text=chain_check_text(chains))
    for key, value in values.items():
        ctx.value(key, value)
    ctx.record(seeds={"split": cfg["split_seed"], "map": map_fit["seed"],
                      "smp": {f"replicate_{r}": {v: mr.smp_seed(cfg, i, r) for i, v in enumerate(cfg["variants"])}
                              for r in range(cfg["smp_replicates"])},
                      "step_law": [step_law_seed(cfg, 0), step_law_seed(cfg, 1)]},
               device=str(device), data=provenance, r_ratio=mr.r_ratio(cfg), smp_path=mr.smp_path(device),
               raw_files=list(RAW_FILES))
