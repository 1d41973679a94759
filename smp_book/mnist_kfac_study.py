"""The MNIST KFAC chapter: the kfac preconditioners beside the diagonal ones."""

from __future__ import annotations

import pandas as pd
import torch

from smp_core.fisher import structure_for
from smp_core.models import as_chain_model, lenet5

from . import mnist_runs as mr

KFAC_STRATEGIES = ("fixed", "ema", "periodic")


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


def storage_per_chain() -> dict[str, int]:
    """How many numbers one chain's preconditioner holds for LeNet-5, per structure."""
    model = as_chain_model(lenet5(), mr.INPUT_SHAPE)
    return {name: structure_for(model, name).stat_numel() for name in ("diag", "kfac", "block", "dense")}


def comparison(kfac: dict[str, pd.DataFrame], mnist: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """:func:`structure_table` of the KFAC runs' means with the MNIST chapter's rows they lack, in the book's order."""
    parts = [pd.concat([kfac[key], mnist[key][~mnist[key].index.isin(kfac[key].index)]])
             for key in ("scores", "variances", "elapsed")]
    table = structure_table(*parts)
    order = ["MAP", "SMP-none"] + [f"SMP-{s}-{t}" for s in KFAC_STRATEGIES for t in ("diag", "kfac")]
    return table.reindex([name for name in order if name in table.index])


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

    fisher_diagonal = mr.validation_fisher_diagonal(theta_map, data, device)  # the fixed diagonal's, at the MAP
    runs = mr.run_replicates(cfg, theta_map, data, device, use_cache=ctx.use_cache, progress=ctx.progress)
    summary = mr.summarise(runs["tables"])
    for key, df in {**summary, "diverged": runs["diverged"]}.items():
        ctx.table(key, df)
    divergence = ctx.table("divergence", runs["divergence"], index=False)
    parts = ("scores", "variances", "elapsed")
    theirs = {key: mnist.table(f"{key}_mean") for key in parts}
    table = ctx.table("comparison", comparison({k: summary[f"{k}_mean"] for k in parts}, theirs))
    findings = ctx.table("findings", kfac_against_diag(table))

    ctx.figure("calibration_kfac", plots.calibration_all({n: e["curve"] for n, e in runs["figure_evals"].items()},
                                                         "Calibration, MNIST, KFAC"))

    # the numbers the prose quotes
    m, lv, pv, seconds = theirs["scores"], table["logits_variance"], table["params_variance"], table["seconds"]
    diagonal = [f"SMP-{s}-diag" for s in KFAC_STRATEGIES]
    diag_mi = m.loc[diagonal, "mutual_info"] / m.loc["SMP-none", "mutual_info"]
    time_ratio = pd.Series({s: seconds[f"SMP-{s}-kfac"] / seconds[f"SMP-{s}-diag"] for s in KFAC_STRATEGIES})
    values = {key: cfg[key] for key in ("n_train", "n_val", "n_chains", "n_steps", "ridge", "period", "ema_refresh")}
    values.update({f"tau_{variant.split('-')[0]}": tau for variant, tau in cfg["tau"].items()})
    values.update({f"storage_{structure}": count for structure, count in storage_per_chain().items()})
    values.update({f"mi_ratio_{s}": findings.loc[s, "mi_kfac_over_diag"] for s in KFAC_STRATEGIES})
    values.update(n_fisher_periodic=cfg["n_fisher_periodic"] or cfg["n_val"],
                  replicates=cfg["smp_replicates"], mnist_replicates=mnist.config["smp_replicates"],
                  mean_chain_share=1 / cfg["n_chains"],
                  r_ratio=mr.r_ratio(cfg), device=str(device), threads=torch.get_num_threads(),
                  diag_share_zero=float((fisher_diagonal == 0).double().mean()),
                  diag_share_below_ridge=float((fisher_diagonal < ridge).double().mean()),
                  diag_mi_over_none_min=diag_mi.min(), diag_mi_over_none_max=diag_mi.max(),
                  diag_nll_above_map=int((m.loc[diagonal, "nll"] > m.loc["MAP", "nll"]).sum()),
                  map_nll_gap=abs(m.loc["MAP", "nll"] - summary["scores_mean"].loc["MAP", "nll"]),
                  time_ratio_min=time_ratio.min(), time_ratio_max=time_ratio.max(),
                  diverged_chains=int(divergence["diverged"].sum()),
                  largest_move=divergence["largest_move_of_a_kept_chain"].max(),
                  answer=answer(findings, cfg["smp_replicates"]),
                  fixed_kfac_lv_over_none=lv["SMP-fixed-kfac"] / lv["SMP-none"],
                  fixed_diag_lv_over_none=lv["SMP-fixed-diag"] / lv["SMP-none"],
                  fixed_kfac_pv_over_diag=pv["SMP-fixed-kfac"] / pv["SMP-fixed-diag"])
    for key, value in values.items():
        ctx.value(key, value)
    ctx.record(seeds={"split": cfg["split_seed"], "map": map_fit["seed"],
                      "smp": {f"replicate_{r}": {v: mr.smp_seed(cfg, i, r) for i, v in enumerate(cfg["variants"])}
                              for r in range(cfg["smp_replicates"])}},
               device=str(device), data=provenance, r_ratio=mr.r_ratio(cfg), smp_path=mr.smp_path(device))
