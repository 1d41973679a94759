"""Beyond the paper (notebooks/toy_baselines.md): SMP beside Laplace approximations and a deep ensemble on the
toy example, the comparison the paper (Section 4.5) names as its first limitation.

Every method is judged against NUTS's local posterior under the prior ``N(0, I)`` on the figure grid: the ``MAP``,
``Laplace-<structure>`` (:func:`smp_book.baselines.fit_laplace` at the MAP, the GGN in an SMP preconditioner
structure, predicting with the linearised network; ``Laplace-dense-nn`` with the network itself), the
``Ensemble`` of MAPs from random starts, the toy chapter's rows on its seeds, its SMP chains from the MAP, and
:data:`SECOND_NUTS`, NUTS again with other random numbers: the reference's own noise (:func:`beyond_nuts_noise`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pandas as pd
import torch

from smp_core.models import toy_mlp

from . import toy
from .baselines import fit_laplace, linearised_logits
from .summaries import paired_lead, summarise_replicates
from .toy import make_grid, make_toy_data

AGREEMENT_COLUMNS = ["tv_to_nuts", "mi_surface_corr", "mi_over_nuts"]
SECOND_NUTS = "NUTS, second chain"
NOT_RANKED = ("NUTS", "NUTS-mean", "MAP", SECOND_NUTS)  # the reference, point estimates, the reference again
DENSE_NLL = "dense Laplace: the linearised predictive has a lower NLL than the network's own (Immer et al. 2021)"


def baseline_seeds(base_seed: int, replicate: int) -> dict[str, int]:
    """Seeds of one replicate's baselines, apart from :func:`smp_book.toy.replicate_seeds` (offsets 0 to 2 and
    10 on): Laplace draws, the ensemble (member ``j`` adds ``j``) and the second NUTS chain."""
    s = base_seed + 1000 * replicate
    return {"laplace": s + 100, "ensemble": s + 200, "nuts_second": s + 300}


def run_replicate(cfg: dict[str, Any], replicate: int, progress: bool = True) -> dict[str, Any]:
    """The toy chapter's replicate with ``cfg["smp_variants"]``, then the second NUTS chain (the first's
    settings and start; its diagnostics in ``run["second_nuts"]``), the MAP, the same SMP chains from the MAP,
    the Laplace rows (seconds: the MAP fit, the GGN and the draws) and the ensemble."""
    from .nuts import check_nuts_mean, find_map, run_nuts

    run = toy.run_replicate(cfg, replicate, variants=cfg["smp_variants"], progress=progress)
    seeds = run["seeds"] = {**run["seeds"], **baseline_seeds(cfg["seed"], replicate)}
    x_np, y_np = run["train"]
    x = torch.as_tensor(x_np, dtype=torch.float64)
    x_test, y_test = make_toy_data(cfg["n_test"], seeds["test"])  # as toy.run_replicate made them
    gx, _, grid = make_grid(cfg["grid_per_axis"])
    prior_scale = cfg["prior_precision"] ** -0.5

    def evaluate(samples, logits_of=None):
        return toy.evaluate(samples, x_test, y_test, grid, tuple(gx.shape), cfg["n_bins"], logits_of=logits_of)

    second = run_nuts(x_np, y_np, seed=seeds["nuts_second"], num_warmup=cfg["nuts_warmup"],
                      num_samples=cfg["nuts_samples"], target_accept_prob=cfg["nuts_target_accept"],
                      init=run["nuts_init"], x_eval=x_test.numpy())
    samples, labelling, distance = relabel_towards(second.samples, run["theta_hat"])
    # the tables list the second chain right below NUTS
    evals = run["evals"] = {"NUTS": run["evals"].pop("NUTS"),
                            SECOND_NUTS: evaluate(torch.as_tensor(samples, dtype=torch.float32)), **run["evals"]}
    elapsed = run["elapsed"] = {"NUTS": run["elapsed"].pop("NUTS"), SECOND_NUTS: second.diagnostics["wall_time_s"],
                                **run["elapsed"]}
    run["second_nuts"] = {**second.diagnostics, **check_nuts_mean(samples, x_np, y_np),
                          "labelling": labelling, "distance_between_means": distance}

    started = time.perf_counter()
    fit = find_map(x_np, y_np, seed=0, starts=run["theta_hat"][None], prior_scale=prior_scale)
    map_seconds = time.perf_counter() - started
    theta_map = torch.as_tensor(fit.theta, dtype=torch.float64)
    evals["MAP"], elapsed["MAP"] = evaluate(theta_map[None]), map_seconds
    for i, variant in enumerate(cfg["smp_variants"]):  # the same chains as from NUTS-mean; only theta_0 moves
        res = toy.run_variant(cfg, x.float(), theta_map.float(), variant, toy.variant_seed(seeds, variant, i), progress)
        name = f"SMP-{variant} from MAP"
        elapsed[name], run["diverged"][name] = res.elapsed, res.n_diverged
        evals[name] = evaluate(res.theta[~res.diverged])

    net, draws = toy_mlp().double(), {}  # draws: structure -> (samples, seconds), shared by its rows
    for i, structure in enumerate(cfg["laplace_structures"]):
        started = time.perf_counter()
        posterior = fit_laplace(net, "bernoulli", theta_map, x, torch.as_tensor(y_np), structure=structure,
                                prior_precision=cfg["prior_precision"])
        samples = posterior.sample(cfg["n_chains"], torch.Generator().manual_seed(seeds["laplace"] + i))
        draws[structure] = samples, map_seconds + time.perf_counter() - started
    # the linearised predictive for every structure, then the network's own for dense
    rows = {f"Laplace-{s}": s for s in draws} | ({"Laplace-dense-nn": "dense"} if "dense" in draws else {})
    for name, structure in rows.items():
        samples, elapsed[name] = draws[structure]

        def linearised(points, samples=samples):
            return linearised_logits(net, theta_map, samples, points.double())[..., 0]

        evals[name] = evaluate(samples, None if name == "Laplace-dense-nn" else linearised)

    started = time.perf_counter()
    members = [find_map(x_np, y_np, seed=seeds["ensemble"] + j, num_restarts=1, prior_scale=prior_scale)
               for j in range(cfg["ensemble_members"])]
    elapsed["Ensemble"] = time.perf_counter() - started
    evals["Ensemble"] = evaluate(torch.as_tensor(np.stack([m.theta for m in members])))
    run["map"] = {"log_posterior": fit.log_posterior, "converged": fit.converged,
                  "distance_from_nuts_mean": float(np.linalg.norm(fit.theta - run["theta_hat"]))}
    run["ensemble_log_posteriors"] = [m.log_posterior for m in members]
    return run


def relabel_towards(samples: np.ndarray, reference: np.ndarray) -> tuple[np.ndarray, int, float]:
    """A NUTS chain's draws relabelled by the hidden-unit permutation that brings their mean closest to
    ``reference`` (two chains of one basin can come back as permuted copies; this changes no prediction), its
    index into :data:`smp_book.nuts.HIDDEN_UNIT_PERMUTATIONS` and the distance left."""
    from .nuts import HIDDEN_UNIT_PERMUTATIONS, permute_hidden_units

    reference = np.asarray(reference, dtype=np.float64)
    copies = np.stack([permute_hidden_units(samples.mean(axis=0), p1, p2) for p1, p2 in HIDDEN_UNIT_PERMUTATIONS])
    distances = np.linalg.norm(copies - reference, axis=1)
    best = int(distances.argmin())
    return permute_hidden_units(samples, *HIDDEN_UNIT_PERMUTATIONS[best]), best, float(distances[best])


def agreement(run: dict[str, Any]) -> pd.DataFrame:
    """Per method, its agreement with NUTS on the figure grid: ``tv_to_nuts`` (mean ``|p - p_NUTS|``),
    ``mi_surface_corr`` (correlation of the mutual-information surfaces; NaN for a point estimate, whose MI
    is zero everywhere) and ``mi_over_nuts`` (mean MI over NUTS's)."""
    ref = run["evals"]["NUTS"].surfaces
    ref_mi = ref["mi"].ravel().astype(np.float64)
    rows = {}
    for name, ev in run["evals"].items():
        mi = ev.surfaces["mi"].ravel().astype(np.float64)
        rows[name] = {"tv_to_nuts": float(np.abs(ev.surfaces["prob"] - ref["prob"]).astype(np.float64).mean()),
                      "mi_surface_corr": np.nan if mi.std() < 1e-12 else float(np.corrcoef(mi, ref_mi)[0, 1]),
                      "mi_over_nuts": float(mi.mean() / ref_mi.mean())}
    return pd.DataFrame.from_dict(rows, orient="index")[AGREEMENT_COLUMNS].rename_axis("method")


def summarise(runs: list[dict[str, Any]]) -> dict[str, pd.DataFrame]:
    """Mean, standard deviation and stacked replicates of the toy tables and the agreement table."""
    return summarise_replicates([{**toy.tables(r), "agreement": agreement(r)} for r in runs])


def findings(agree: pd.DataFrame, scores: pd.DataFrame, agree_replicates: pd.DataFrame | None = None,
             scores_replicates: pd.DataFrame | None = None, smp: str = "SMP-ema-block") -> pd.DataFrame:
    """Per criterion (ours, fixed before the runs; the last: which dense Laplace predictive has the lower NLL),
    the best method on the replicate means and ``smp``'s rank ("–": none) among those not :data:`NOT_RANKED`;
    given the ``*_replicates`` tables, the best's ``lead (se)`` over the runner-up (:func:`paired_lead`)."""
    methods = [m for m in agree.index if m not in NOT_RANKED]
    dense = ["Laplace-dense", "Laplace-dense-nn"]

    def criteria(a, s):
        out = {"closest predictive to NUTS (mean absolute difference of p)": a.loc[methods, "tv_to_nuts"],
               "MI surface most like NUTS's (highest correlation)": -a.loc[methods, "mi_surface_corr"],
               "amount of MI closest to NUTS's (absolute log of the MI ratio)":
                   np.log(a.loc[methods, "mi_over_nuts"]).abs(),
               "lowest test NLL": s.loc[methods, "nll"]}
        if set(dense) <= set(scores.index):
            out[DENSE_NLL] = s.loc[dense, "nll"]
        return out

    per_replicate = None if agree_replicates is None or scores_replicates is None else [
        criteria(agree_replicates.xs(r, level="replicate"), scores_replicates.xs(r, level="replicate"))
        for r in agree_replicates.index.unique(level="replicate")]
    rows = []
    for criterion, values in criteria(agree, scores).items():
        ranks, order = values.rank(method="min"), values.sort_values().index
        row = {"criterion": criterion, "best": order[0],
               f"{smp} rank": str(int(ranks[smp])) if smp in ranks and not np.isnan(ranks[smp]) else "–",
               "methods ranked": int(values.notna().sum())}
        if per_replicate is not None:
            lead = paired_lead(np.array([v[criterion][order[1]] - v[criterion][order[0]] for v in per_replicate]))
            row.update({"runner-up": order[1], "lead (se)": round(lead, 1), "resolved": "yes" if lead >= 2 else "no"})
        rows.append(row)
    return pd.DataFrame(rows).set_index("criterion")


def beyond_nuts_noise(agree_replicates: pd.DataFrame, reference: str = SECOND_NUTS) -> pd.DataFrame:
    """Per method but NUTS and distance from NUTS, the method's minus the ``reference``'s (the second chain's) on
    the same replicate of ``agreement_replicates``: its mean (``excess``; NaN where a point estimate has no
    value) and that mean in standard errors (``excess (se)``; below 2, within NUTS's own Monte Carlo noise)."""
    methods = agree_replicates.index.unique(level="method")
    if reference not in methods:
        raise KeyError(f"no {reference!r} rows in the agreement table: run the study with the second NUTS chain")
    distance = pd.DataFrame({
        "mean |p - p_NUTS|": agree_replicates["tv_to_nuts"],
        "1 - MI surface correlation": 1 - agree_replicates["mi_surface_corr"],
        # a point estimate has no MI: no ratio to judge
        "|log MI ratio|": np.log(agree_replicates["mi_over_nuts"].astype(np.float64).replace(0.0, np.nan)).abs(),
    })
    ref = distance.xs(reference, level="method")
    rows = {}  # method -> {(distance, "excess" or "excess (se)"): value}
    for method in [m for m in methods if m not in ("NUTS", reference)]:
        rows[method] = {}
        for criterion in distance.columns:
            excess = (distance[criterion].xs(method, level="method") - ref[criterion]).dropna()
            rows[method][(criterion, "excess")] = float(excess.mean())  # NaN when none is left
            rows[method][(criterion, "excess (se)")] = paired_lead(excess.to_numpy())
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("method")


def compute(ctx) -> None:
    """The chapter's results (:mod:`smp_book.pipeline`) from every replicate (cached under ``.cache/toy_baselines/``):
    tables, figures of the first replicate, the numbers the prose quotes, and a check against the toy chapter's."""
    from . import plots
    from .pipeline import cached, code_hash

    cfg = ctx.config
    runs = [cached("toy_baselines", {**cfg, "replicate": r, "code": code_hash("smp_book.baseline_study")},
                   lambda r=r: run_replicate(cfg, r, progress=ctx.progress), enabled=ctx.use_cache)
            for r in range(cfg["replicates"])]
    summary = summarise(runs)
    for name, table in summary.items():  # scores, variances, elapsed, agreement: mean, std, replicates
        ctx.table(name, table)
    a, s, seconds = summary["agreement_mean"], summary["scores_mean"], summary["elapsed_mean"]["seconds"]

    # the rows this study shares with the toy chapter: the same seeds, so the same numbers on one machine
    toy_scores = ctx.read("toy").table("scores_mean")
    same = [m for m in ("NUTS", "NUTS-mean", "SMP-none", "SMP-ema-block") if m in toy_scores.index]
    gap = (toy_scores.loc[same] - s.loc[same]).abs().max(axis=1)
    ctx.table("toy_check", gap.rename("largest difference of a mean score").to_frame())

    ctx.table("map_and_ensemble", pd.DataFrame([
        {"replicate": r["replicate"], **r["map"],
         "ensemble_log_posteriors": " ".join(f"{v:.1f}" for v in r["ensemble_log_posteriors"])} for r in runs
    ]).set_index("replicate"))
    gaps = [r["map"]["log_posterior"] - v for r in runs for v in r["ensemble_log_posteriors"]]
    ctx.table("second_nuts", pd.DataFrame([{"replicate": r["replicate"], **r["second_nuts"]} for r in runs])
              .set_index("replicate"))
    tv_noise = ctx.table("beyond_nuts_noise", beyond_nuts_noise(summary["agreement_replicates"]))[
        ("mean |p - p_NUTS|", "excess (se)")]
    found = ctx.table("findings", findings(a, s, summary["agreement_replicates"], summary["scores_replicates"]))

    first, (gx, gy) = runs[0], runs[0]["grid"]
    shown = ["NUTS", "SMP-none", "SMP-ema-block", "SMP-ema-block from MAP", "Ensemble", "Laplace-diag",
             "Laplace-kfac", "Laplace-dense"]
    ctx.figure("mutual_information", plots.surfaces_side_by_side(
        gx, gy, {n: first["evals"][n].surfaces["mi"] for n in shown}, "mutual information (toy example, replicate 0)"))
    ctx.figure("calibration_baselines", plots.calibration_all(
        {n: first["evals"][n].curve for n in shown}, "calibration (toy example, replicate 0)", xlim=(0.45, 1.0)))

    tv, spread = a["tv_to_nuts"], [m for m in a.index if m not in NOT_RANKED]
    best_laplace = tv[[m for m in spread if m.startswith("Laplace-") and not m.endswith("-nn")]].idxmin()
    reps = summary["agreement_replicates"]["tv_to_nuts"].unstack("replicate")  # method x replicate
    closest = found.loc["closest predictive to NUTS (mean absolute difference of p)"]
    smp = {"none": "SMP-none", "ema_block": "SMP-ema-block", "none_from_map": "SMP-none from MAP",
           "ema_block_from_map": "SMP-ema-block from MAP"}
    others = {"ensemble": "Ensemble", "second": SECOND_NUTS, "nuts_mean": "NUTS-mean", "map": "MAP"}
    values = {
        "replicates": len(runs), **{k: cfg[k] for k in ("n_chains", "n_steps", "ensemble_members", "prior_precision")},
        "nuts_iterations": cfg["nuts_warmup"] + cfg["nuts_samples"], "toy_gap": gap.max(), "members_total": len(gaps),
        "members_far": sum(g > 100 for g in gaps), "members_near": sum(abs(g) <= 1 for g in gaps),
        "methods_ranked": int(closest["methods ranked"]), "closest_method": closest["best"],
        "closest_runner_up": closest["runner-up"], "closest_lead": closest["lead (se)"],
        "ema_block_rank_tv": closest["SMP-ema-block rank"],
        "ema_block_rank_nll": found.loc["lowest test NLL", "SMP-ema-block rank"],
        "closest_tv": tv[spread].min(), **{f"{k}_tv": tv[m] for k, m in {**smp, **others}.items()},
        "best_laplace": best_laplace, "best_laplace_tv": tv[best_laplace],
        "second_corr": a.loc[SECOND_NUTS, "mi_surface_corr"], "second_mi_ratio": a.loc[SECOND_NUTS, "mi_over_nuts"],
        "within_noise": ", ".join(tv_noise[tv_noise < 2].index) or "none",
        "mi_over_nuts_list": ", ".join(f"{m} {a.loc[m, 'mi_over_nuts']:.2f}" for m in spread),
        "mi_corr_list": ", ".join(f"{m} {a.loc[m, 'mi_surface_corr']:.2f}" for m in spread),
        "dense_nll": s.loc["Laplace-dense", "nll"], "dense_nn_nll": s.loc["Laplace-dense-nn", "nll"],
        "dense_mi_ratio": a.loc["Laplace-dense", "mi_over_nuts"],
        "dense_nn_mi_ratio": a.loc["Laplace-dense-nn", "mi_over_nuts"],
        **{f"{k}_seconds": seconds[m] for k, m in (("nuts", "NUTS"), ("ema_block", "SMP-ema-block"),
                                                   ("dense", "Laplace-dense"), ("ensemble", "Ensemble"))},
        # SMP's mean |p - p_NUTS| minus the dense Laplace's, paired over the replicates, in standard errors
        **{f"{k}_vs_dense_lead": paired_lead(reps.loc[m] - reps.loc["Laplace-dense"]) for k, m in smp.items()},
    }
    for name, value in values.items():
        ctx.value(name, value)
    ctx.record(seeds={f"replicate_{r['replicate']}": r["seeds"] for r in runs},
               nuts_wall_time_s=[r["elapsed"]["NUTS"] for r in runs])
