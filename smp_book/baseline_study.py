"""Beyond the paper: SMP beside the Laplace approximation and a deep ensemble on the toy example.

The paper (Section 4.5) names as its first limitation that SMP was not compared with the approximate
methods used in practice. On the toy example NUTS gives the local Bayesian posterior under the prior
``N(0, I)``, so every approximation can be judged against it, in the same units:

* ``MAP``: the maximum of the same posterior, found by L-BFGS from NUTS-mean (NUTS's basin);
* ``Laplace-<structure>``: ``N(MAP, (N GGN + I)^-1)`` with the prior's precision 1 and the GGN restricted
  to ``diag``, ``block``, ``kfac`` or ``dense`` (the SMP preconditioner structures; laplace-torch's
  ``diag``, ``kron`` and ``full``, the book's own ``block``: :func:`smp_book.baselines.fit_laplace`;
  laplace-torch's ``kron`` keeps each layer's bias in a block of its own, SMP's ``kfac`` does not),
  predicting with the network linearised at the MAP (:func:`smp_book.baselines.linearised_logits`);
  ``Laplace-dense-nn`` predicts with the network itself at the same draws;
* ``Ensemble``: MAPs of the same posterior from random starts (a deep ensemble with the prior as weight
  decay), one sample per member;
* the toy chapter's ``NUTS``, ``NUTS-mean``, ``SMP-none`` and ``SMP-ema-block`` on the same replicates
  (the same seeds, so the same chains), and the same two SMP variants with the same chain seeds started
  from the MAP instead of NUTS-mean (``SMP-<variant> from MAP``), which separates the start point from
  the recursion's own spread;
* ``NUTS, second chain`` (:data:`SECOND_NUTS`): NUTS again on the same data from the same start with
  other random numbers. It is not a method but the reference's own Monte Carlo noise: its distance
  from ``NUTS`` is what a second run of the reference shows (:func:`beyond_nuts_noise`). A method
  with as many independent exact draws would come closer (NUTS's draws are autocorrelated), so the
  yardstick is conservative: a distance resolved beyond it is the method's.

Agreement with NUTS is measured on the figure grid, which covers the input square uniformly as the test
inputs do: the mean absolute difference of the predictive probability (the total variation between two
Bernoulli predictives), and the correlation of the mutual-information surfaces (whether a method puts its
epistemic uncertainty where NUTS does).
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
from .summaries import paired_lead
from .toy import make_grid, make_toy_data

AGREEMENT_COLUMNS = ["tv_to_nuts", "mi_surface_corr", "mi_over_nuts"]
SECOND_NUTS = "NUTS, second chain"
NOT_RANKED = ("NUTS", "NUTS-mean", "MAP", SECOND_NUTS)  # the reference, point estimates, the reference again


def baseline_seeds(base_seed: int, replicate: int) -> dict[str, int]:
    """Seeds of the baselines of one replicate, apart from :func:`smp_book.toy_study.replicate_seeds`
    (which uses offsets 0 to 2 and 10 onwards): Laplace draws, member ``j`` of the ensemble adds ``j``,
    and the second NUTS chain."""
    s = base_seed + 1000 * replicate
    return {"laplace": s + 100, "ensemble": s + 200, "nuts_second": s + 300}


def laplace_rows(structures) -> dict[str, tuple[str, str]]:
    """Row name -> (structure, predictive): the linearised predictive for every structure, then the
    network's own predictive for ``dense``."""
    rows = {f"Laplace-{s}": (s, "glm") for s in structures}
    if "dense" in structures:
        rows["Laplace-dense-nn"] = ("dense", "nn")
    return rows


def run_replicate(cfg: dict[str, Any], replicate: int, progress: bool = True) -> dict[str, Any]:
    """The toy chapter's replicate (data, NUTS, NUTS-mean, the SMP variants of ``cfg["smp_variants"]``)
    with the baselines and the same SMP variants from the MAP added to its ``evals``, ``elapsed`` and
    ``seeds``.

    Seconds: a Laplace row counts the MAP fit, its own GGN and draws (not the evaluation); the rows of
    one structure share its draws (``Laplace-dense`` and ``Laplace-dense-nn`` differ only in the
    predictive). The ensemble counts its members' fits.

    The row :data:`SECOND_NUTS` is a second NUTS chain with the first's settings, data and start (the
    same MAP) and the seed ``nuts_second``, its draws relabelled towards the first chain's mean
    (:func:`relabel_towards`); its diagnostics, NUTS-mean check, that relabelling and the distance
    between the two means are in ``run["second_nuts"]``.
    """
    from .nuts import check_nuts_mean, find_map, run_nuts

    run = toy.run_replicate(cfg, replicate, variants=cfg["smp_variants"], progress=progress)
    seeds = {**run["seeds"], **baseline_seeds(cfg["seed"], replicate)}
    x_np, y_np = run["train"]
    x = torch.as_tensor(x_np, dtype=torch.float64)
    x_test, y_test = make_toy_data(cfg["n_test"], run["seeds"]["test"])  # as toy.run_replicate made them
    gx, _, grid = make_grid(cfg["grid_per_axis"])
    shape = tuple(gx.shape)
    prior_scale = cfg["prior_precision"] ** -0.5

    def evaluate(samples, logits_of=None):
        return toy.evaluate(samples, x_test, y_test, grid, shape, cfg["n_bins"], logits_of=logits_of)

    second = run_nuts(x_np, y_np, seed=seeds["nuts_second"], num_warmup=cfg["nuts_warmup"],
                      num_samples=cfg["nuts_samples"], target_accept_prob=cfg["nuts_target_accept"],
                      init=run["nuts_init"], x_eval=x_test.numpy())
    samples, labelling, distance = relabel_towards(second.samples, run["theta_hat"])
    run["evals"] = {"NUTS": run["evals"].pop("NUTS"),  # the tables list it right below NUTS
                    SECOND_NUTS: evaluate(torch.as_tensor(samples, dtype=torch.float32)), **run["evals"]}
    run["elapsed"] = {"NUTS": run["elapsed"].pop("NUTS"), SECOND_NUTS: second.diagnostics.wall_time_s,
                      **run["elapsed"]}
    run["second_nuts"] = {"diagnostics": second.diagnostics.summary(),
                          "nuts_mean_check": check_nuts_mean(samples, x_np, y_np, raise_error=False),
                          "labelling": labelling, "distance_between_means": distance}

    started = time.perf_counter()
    fit = find_map(x_np, y_np, seed=0, starts=run["theta_hat"][None], prior_scale=prior_scale)
    map_seconds = time.perf_counter() - started
    theta_map = torch.as_tensor(fit.theta, dtype=torch.float64)
    run["evals"]["MAP"] = evaluate(theta_map[None])
    run["elapsed"]["MAP"] = map_seconds
    for i, variant in enumerate(cfg["smp_variants"]):  # the same chains as from NUTS-mean; only theta_0 moves
        res = toy.run_variant(cfg, x.float(), theta_map.float(), variant, toy.variant_seed(run["seeds"], variant, i),
                             progress)
        name = f"SMP-{variant} from MAP"
        run["elapsed"][name] = res.elapsed
        run["diverged"][name] = res.n_diverged
        run["evals"][name] = evaluate(res.theta[~res.diverged])
    net = toy_mlp().double()
    draws: dict[str, tuple[torch.Tensor, float]] = {}  # structure -> (samples, seconds): shared by its rows
    for i, structure in enumerate(cfg["laplace_structures"]):
        started = time.perf_counter()
        posterior = fit_laplace(net, "bernoulli", theta_map, x, torch.as_tensor(y_np), structure=structure,
                                prior_precision=cfg["prior_precision"])
        samples = posterior.sample(cfg["n_chains"], torch.Generator().manual_seed(seeds["laplace"] + i))
        draws[structure] = samples, map_seconds + time.perf_counter() - started
    for name, (structure, predictive) in laplace_rows(cfg["laplace_structures"]).items():
        samples, run["elapsed"][name] = draws[structure]
        logits_of = None
        if predictive == "glm":
            def logits_of(points, samples=samples):
                return linearised_logits(net, theta_map, samples, points.double())[..., 0]
        run["evals"][name] = evaluate(samples, logits_of)

    started = time.perf_counter()
    members = [find_map(x_np, y_np, seed=seeds["ensemble"] + j, num_restarts=1, prior_scale=prior_scale)
               for j in range(cfg["ensemble_members"])]
    run["elapsed"]["Ensemble"] = time.perf_counter() - started
    run["evals"]["Ensemble"] = evaluate(torch.as_tensor(np.stack([m.theta for m in members])))
    run["seeds"] = seeds
    run["map"] = {"log_posterior": fit.log_posterior, "converged": fit.converged,
                  "distance_from_nuts_mean": float(np.linalg.norm(fit.theta - run["theta_hat"]))}
    run["ensemble_log_posteriors"] = [m.log_posterior for m in members]
    return run


def relabel_towards(samples: np.ndarray, reference: np.ndarray) -> tuple[np.ndarray, int, float]:
    """A NUTS chain's draws relabelled by the one hidden-unit permutation that brings their mean
    closest to ``reference`` (the first chain's mean), that permutation's index into
    :data:`smp_book.nuts.HIDDEN_UNIT_PERMUTATIONS` and the distance left between the two means.

    :func:`smp_book.nuts.run_nuts` relabels each chain towards its own most frequent labelling, so two
    chains of one basin can come back as permuted copies of each other; a common permutation of every
    draw changes no prediction and no variance, only which copy the mean is."""
    from .nuts import HIDDEN_UNIT_PERMUTATIONS, permute_hidden_units

    reference = np.asarray(reference, dtype=np.float64)
    copies = np.stack([permute_hidden_units(samples.mean(axis=0), p1, p2) for p1, p2 in HIDDEN_UNIT_PERMUTATIONS])
    distances = np.linalg.norm(copies - reference, axis=1)
    best = int(distances.argmin())
    return permute_hidden_units(samples, *HIDDEN_UNIT_PERMUTATIONS[best]), best, float(distances[best])


def agreement(run: dict[str, Any]) -> pd.DataFrame:
    """Per method, its agreement with NUTS on the figure grid: ``tv_to_nuts`` (mean ``|p - p_NUTS|`` of the
    predictive probability), ``mi_surface_corr`` (Pearson correlation of the mutual-information surfaces;
    NaN for a point estimate, whose MI is zero everywhere) and ``mi_over_nuts`` (mean MI over NUTS's)."""
    ref = run["evals"]["NUTS"].surfaces
    rows = {}
    for name, ev in run["evals"].items():
        mi = ev.surfaces["mi"].ravel().astype(np.float64)
        ref_mi = ref["mi"].ravel().astype(np.float64)
        corr = np.nan if mi.std() < 1e-12 else float(np.corrcoef(mi, ref_mi)[0, 1])
        rows[name] = {"tv_to_nuts": float(np.abs(ev.surfaces["prob"] - ref["prob"]).astype(np.float64).mean()),
                      "mi_surface_corr": corr, "mi_over_nuts": float(mi.mean() / ref_mi.mean())}
    out = pd.DataFrame.from_dict(rows, orient="index")[AGREEMENT_COLUMNS]
    out.index.name = "method"
    return out


def summarise(runs: list[dict[str, Any]]) -> dict[str, pd.DataFrame]:
    """Mean, standard deviation and stacked replicates of the toy tables and the agreement table."""
    from .summaries import summarise_replicates

    return summarise_replicates([{**toy.tables(r), "agreement": agreement(r)} for r in runs])


def findings(agree: pd.DataFrame, scores: pd.DataFrame, agree_replicates: pd.DataFrame | None = None,
             scores_replicates: pd.DataFrame | None = None, smp: str = "SMP-ema-block") -> pd.DataFrame:
    """Judged on the replicate means: per criterion, the best method other than NUTS and where ``smp``
    ranks among the methods that have a spread (NUTS-mean and MAP, point estimates, and the second NUTS
    chain, the reference's own noise, are left out), as text
    ("–" where it has none), so that the table prints as it is stored.

    The criteria are ours, fixed before the runs: closest predictive to NUTS (``tv_to_nuts``), epistemic
    uncertainty where NUTS has it (``mi_surface_corr``), as much of it as NUTS (``|log mi_over_nuts|``),
    lowest test NLL. Given the per-replicate tables (``*_replicates`` of :func:`summarise`), the best is
    compared with the runner-up replicate by replicate: ``lead (se)`` is the mean paired difference over
    its standard error, and the lead counts as resolved from 2 standard errors on (one replicate: not
    resolved).
    """
    methods = [m for m in agree.index if m not in NOT_RANKED]

    def criteria(a, s):
        return {
            "closest predictive to NUTS (mean absolute difference of p)": a.loc[methods, "tv_to_nuts"],
            "MI surface most like NUTS's (highest correlation)": -a.loc[methods, "mi_surface_corr"],
            "amount of MI closest to NUTS's (absolute log of the MI ratio)":
                np.log(a.loc[methods, "mi_over_nuts"]).abs(),
            "lowest test NLL": s.loc[methods, "nll"],
        }

    per_replicate = None
    if agree_replicates is not None and scores_replicates is not None:
        per_replicate = [criteria(agree_replicates.xs(r, level="replicate"),
                                  scores_replicates.xs(r, level="replicate"))
                         for r in agree_replicates.index.unique(level="replicate")]
    rows = []
    for criterion, values in criteria(agree, scores).items():
        ranks = values.rank(method="min")
        order = values.sort_values().index
        row = {"criterion": criterion, "best": order[0],
               f"{smp} rank": str(int(ranks[smp])) if smp in ranks and not np.isnan(ranks[smp]) else "–",
               "methods ranked": int(values.notna().sum())}
        if per_replicate is not None:
            lead = paired_lead(np.array([v[criterion][order[1]] - v[criterion][order[0]] for v in per_replicate]))
            row.update({"runner-up": order[1], "lead (se)": round(lead, 1),
                        "resolved": "yes" if lead >= 2 else "no"})
        rows.append(row)
    glm, nn = "Laplace-dense", "Laplace-dense-nn"
    if glm in scores.index and nn in scores.index:
        best, other = (glm, nn) if scores.loc[glm, "nll"] < scores.loc[nn, "nll"] else (nn, glm)
        row = {"criterion": "dense Laplace: the linearised predictive has a lower NLL than the network's own "
                            "(Immer et al. 2021)", "best": best, f"{smp} rank": "–", "methods ranked": 2}
        if scores_replicates is not None:
            nll = scores_replicates["nll"].unstack("method")
            lead = paired_lead((nll[other] - nll[best]).to_numpy())
            row.update({"runner-up": other, "lead (se)": round(lead, 1), "resolved": "yes" if lead >= 2 else "no"})
        rows.append(row)
    return pd.DataFrame(rows).set_index("criterion")


def beyond_nuts_noise(agree_replicates: pd.DataFrame, reference: str = SECOND_NUTS) -> pd.DataFrame:
    """How far each method is from NUTS beyond what NUTS's own Monte Carlo noise puts between two chains.

    ``agree_replicates``: :func:`summarise`'s ``agreement_replicates`` (index ``(replicate, method)``),
    with a ``reference`` row (the second NUTS chain). Per method and criterion, the distance from NUTS
    (``tv_to_nuts``; ``1 - mi_surface_corr``; ``|log mi_over_nuts|``) minus the reference's on the same
    replicate, as the mean over the replicates (``excess``) and that mean over its standard error
    (``excess (se)``, :func:`paired_lead`). An excess below 2 standard errors means the replicates cannot
    tell the method from a second run of NUTS by that criterion. NUTS itself is left out; a criterion a
    method has no value for (a point estimate has no MI surface) is NaN.
    """
    distance = pd.DataFrame({
        "mean |p - p_NUTS|": agree_replicates["tv_to_nuts"],
        "1 - MI surface correlation": 1 - agree_replicates["mi_surface_corr"],
        # a point estimate has no MI: no ratio to judge
        "|log MI ratio|": np.log(agree_replicates["mi_over_nuts"].astype(np.float64).replace(0.0, np.nan)).abs(),
    })
    methods = [m for m in agree_replicates.index.unique(level="method") if m not in ("NUTS", reference)]
    if reference not in agree_replicates.index.unique(level="method"):
        raise KeyError(f"no {reference!r} rows in the agreement table: run the study with the second NUTS chain")
    ref = distance.xs(reference, level="method")
    rows = {}
    for method in methods:
        row = {}
        for criterion in distance.columns:
            excess = (distance[criterion].xs(method, level="method") - ref[criterion]).dropna()
            row[(criterion, "excess")] = float(excess.mean()) if len(excess) else float("nan")
            row[(criterion, "excess (se)")] = paired_lead(excess.to_numpy())
        rows[method] = row
    out = pd.DataFrame.from_dict(rows, orient="index")
    out.columns = pd.MultiIndex.from_tuples(out.columns)
    out.index.name = "method"
    return out


def compute(ctx) -> None:
    """The chapter's results (:mod:`smp_book.pipeline`): every replicate (cached by config and replicate
    under ``.cache/toy_baselines/``), the toy tables and the agreement table with their spread, the
    MAPs, the second NUTS chain, the distance beyond NUTS's own noise, the findings, the figures of the
    first replicate and the numbers the prose quotes. The toy chapter's results are read to check that
    the rows both studies compute (NUTS, NUTS-mean, SMP-none, SMP-ema-block) agree."""
    from . import plots
    from .pipeline import cached, code_hash

    cfg = ctx.config
    runs = [cached("toy_baselines", {**cfg, "replicate": r, "code": code_hash("smp_book.baseline_study")},
                   lambda r=r: run_replicate(cfg, r, progress=ctx.progress), enabled=ctx.use_cache)
            for r in range(cfg["replicates"])]
    summary = summarise(runs)
    for key in ("scores", "variances", "elapsed", "agreement"):
        for part in ("mean", "std", "replicates"):
            ctx.table(f"{key}_{part}", summary[f"{key}_{part}"])

    # the rows this study shares with the toy chapter: the same seeds, so the same numbers on one machine
    toy_scores = ctx.read("toy").table("scores_mean")
    same = [m for m in ("NUTS", "NUTS-mean", "SMP-none", "SMP-ema-block") if m in toy_scores.index]
    gap = (toy_scores.loc[same] - summary["scores_mean"].loc[same]).abs().max(axis=1)
    ctx.table("toy_check", gap.rename("largest difference of a mean score").to_frame())

    maps = pd.DataFrame([{"replicate": r["replicate"], **r["map"],
                          "ensemble_log_posteriors": " ".join(f"{v:.1f}" for v in r["ensemble_log_posteriors"])}
                         for r in runs]).set_index("replicate")
    ctx.table("map_and_ensemble", maps)
    gaps = [r["map"]["log_posterior"] - v for r in runs for v in r["ensemble_log_posteriors"]]
    second = pd.DataFrame([{"replicate": r["replicate"], **r["second_nuts"]["diagnostics"],
                            **r["second_nuts"]["nuts_mean_check"], "labelling": r["second_nuts"]["labelling"],
                            "distance_between_means": r["second_nuts"]["distance_between_means"]}
                           for r in runs]).set_index("replicate")
    ctx.table("second_nuts", second)
    noise = ctx.table("beyond_nuts_noise", beyond_nuts_noise(summary["agreement_replicates"]))
    found = ctx.table("findings", findings(summary["agreement_mean"], summary["scores_mean"],
                                           summary["agreement_replicates"], summary["scores_replicates"]))

    first = runs[0]
    gx, gy = first["grid"]
    shown = ["NUTS", "SMP-none", "SMP-ema-block", "SMP-ema-block from MAP", "Ensemble", "Laplace-diag",
             "Laplace-kfac", "Laplace-dense"]
    ctx.figure("mutual_information", plots.surfaces_side_by_side(
        gx, gy, {name: first["evals"][name].surfaces["mi"] for name in shown},
        "mutual information (toy example, replicate 0)"))
    ctx.figure("calibration_baselines", plots.calibration_all(
        {name: first["evals"][name].curve for name in shown}, "calibration (toy example, replicate 0)",
        xlim=(0.45, 1.0)))

    a, s, seconds = summary["agreement_mean"], summary["scores_mean"], summary["elapsed_mean"]["seconds"]
    reps = summary["agreement_replicates"]["tv_to_nuts"].unstack("replicate")  # method x replicate
    spread = [m for m in a.index if m not in NOT_RANKED]
    laplace = [m for m in spread if m.startswith("Laplace-") and not m.endswith("-nn")]
    best_laplace = a.loc[laplace, "tv_to_nuts"].idxmin()
    tv_noise = noise[("mean |p - p_NUTS|", "excess (se)")]
    closest = found.loc["closest predictive to NUTS (mean absolute difference of p)"]
    nll_row = found.loc["lowest test NLL"]
    values = {
        # settings
        "replicates": len(runs), "n_chains": cfg["n_chains"], "n_steps": cfg["n_steps"],
        "ensemble_members": cfg["ensemble_members"], "prior_precision": cfg["prior_precision"],
        "nuts_iterations": cfg["nuts_warmup"] + cfg["nuts_samples"],
        # the check against the toy chapter
        "toy_gap": gap.max(),
        # the ensemble's members
        "members_total": len(gaps), "members_far": sum(g > 100 for g in gaps),
        "members_near": sum(abs(g) <= 1 for g in gaps),
        # the findings
        "methods_ranked": int(closest["methods ranked"]),
        "closest_method": closest["best"], "closest_runner_up": closest["runner-up"],
        "closest_lead": closest["lead (se)"], "closest_resolved": "resolved" if closest["resolved"] == "yes"
        else "not resolved",
        "ema_block_rank_tv": closest["SMP-ema-block rank"], "ema_block_rank_nll": nll_row["SMP-ema-block rank"],
        # agreement with NUTS, replicate means
        "closest_tv": a.loc[spread, "tv_to_nuts"].min(),
        "ema_block_tv": a.loc["SMP-ema-block", "tv_to_nuts"], "none_tv": a.loc["SMP-none", "tv_to_nuts"],
        "best_laplace": best_laplace, "best_laplace_tv": a.loc[best_laplace, "tv_to_nuts"],
        "ensemble_tv": a.loc["Ensemble", "tv_to_nuts"],
        "second_tv": a.loc[SECOND_NUTS, "tv_to_nuts"], "second_corr": a.loc[SECOND_NUTS, "mi_surface_corr"],
        "second_mi_ratio": a.loc[SECOND_NUTS, "mi_over_nuts"],
        "within_noise": ", ".join(tv_noise[tv_noise < 2].index) or "none",
        "nuts_mean_tv": a.loc["NUTS-mean", "tv_to_nuts"], "map_tv": a.loc["MAP", "tv_to_nuts"],
        "none_from_map_tv": a.loc["SMP-none from MAP", "tv_to_nuts"],
        "ema_block_from_map_tv": a.loc["SMP-ema-block from MAP", "tv_to_nuts"],
        "mi_over_nuts_list": ", ".join(f"{m} {a.loc[m, 'mi_over_nuts']:.2f}" for m in spread),
        "mi_corr_list": ", ".join(f"{m} {a.loc[m, 'mi_surface_corr']:.2f}" for m in spread),
        # the dense Laplace's two predictives
        "dense_nll": s.loc["Laplace-dense", "nll"], "dense_nn_nll": s.loc["Laplace-dense-nn", "nll"],
        "dense_mi_ratio": a.loc["Laplace-dense", "mi_over_nuts"],
        "dense_nn_mi_ratio": a.loc["Laplace-dense-nn", "mi_over_nuts"],
        # seconds, replicate means
        "nuts_seconds": seconds["NUTS"], "ema_block_seconds": seconds["SMP-ema-block"],
        "dense_seconds": seconds["Laplace-dense"], "ensemble_seconds": seconds["Ensemble"],
    }
    # SMP's mean |p - p_NUTS| minus the dense Laplace's, paired over the replicates, in standard errors
    for key, m in (("none", "SMP-none"), ("ema_block", "SMP-ema-block"), ("none_from_map", "SMP-none from MAP"),
                   ("ema_block_from_map", "SMP-ema-block from MAP")):
        values[f"{key}_vs_dense_lead"] = paired_lead(reps.loc[m] - reps.loc["Laplace-dense"])
    for name, value in values.items():
        ctx.value(name, value)
    ctx.record(seeds={f"replicate_{r['replicate']}": r["seeds"] for r in runs},
               nuts_wall_time_s=[r["elapsed"]["NUTS"] for r in runs])
