"""Beyond the paper: Kronecker-factored (KFAC) preconditioners on the toy example (``notebooks/toy_kfac.md``).

The toy chapter's replicates (the same data, NUTS and NUTS-mean) with the three KFAC variants
``fixed-kfac``, ``ema-kfac`` and ``periodic-kfac`` (:data:`smp_book.config.TOY_KFAC_VARIANTS`), whose
chains draw other random numbers than the paper's ten variants (``seed_offset = len(TOY_VARIANTS)``,
see :func:`smp_book.toy.run_replicate`). The ``block`` and ``dense`` rows they are compared with
are the toy chapter's results at the same scale.
"""

from __future__ import annotations

import pandas as pd

from . import toy
from .config import TOY_TAU, TOY_VARIANTS

SEED_OFFSET = len(TOY_VARIANTS)  # the KFAC chains' seeds follow the paper's ten variants'
STRUCTURES = ("diag", "block", "dense", "kfac")
KFAC_EMA = "unit-trace factors and trace EMA"  # in the cache key: the EMA's form (see the chapter)


def stored_numbers() -> pd.DataFrame:
    """The numbers in one chain's Fisher statistic per structure, for the toy MLP and LeNet-5 (from the
    layer shapes; nothing is allocated)."""
    from smp_core.fisher import structure_for
    from smp_core.models import SequentialChainModel, as_chain_model, lenet5, toy_mlp

    def stored(model):
        return {name: structure_for(model, name).stat_numel() for name in STRUCTURES}

    sizes = {"toy MLP (d = 20)": stored(as_chain_model(toy_mlp())),
             "LeNet-5 (d = 47,154)": stored(SequentialChainModel(lenet5(), (1, 28, 28)))}
    return pd.DataFrame(sizes).rename_axis("structure")


def compute(ctx) -> None:
    """The chapter's results (:mod:`smp_book.pipeline`): the stored numbers per structure, every replicate
    (NUTS and the KFAC variants, cached by config and replicate under ``.cache/toy_kfac/``), the KFAC
    tables with their spread, the comparison with the toy chapter's ``block`` and ``dense`` rows, the
    findings per strategy, the four-panel figures of the first replicate and the numbers the prose
    quotes."""
    from . import plots
    from .pipeline import cached, code_hash

    cfg = ctx.config
    sizes = ctx.table("stored_numbers", stored_numbers())
    runs = [cached("toy_kfac", {**cfg, "replicate": r, "code": code_hash(__name__),
                                "seed_offset": SEED_OFFSET, "kfac_ema": KFAC_EMA},
                   lambda r=r: toy.run_replicate(cfg, r, variants=cfg["variants"], progress=ctx.progress,
                                                seed_offset=SEED_OFFSET), enabled=ctx.use_cache)
            for r in range(cfg["replicates"])]
    summary = toy.summarise(runs)
    for key in ("scores", "variances", "elapsed"):
        for part in ("mean", "std", "replicates"):
            ctx.table(f"{key}_{part}", summary[f"{key}_{part}"])
    ctx.table("diverged", pd.DataFrame([r["diverged"] for r in runs]).rename_axis("replicate"))

    # block and dense from the toy chapter, on the same replicates (the same data and NUTS)
    toy_res = ctx.read("toy")
    toy_tables = {key: toy_res.table(f"{key}_mean") for key in ("scores", "variances", "elapsed")}
    nuts_gap = (toy_tables["scores"].loc["NUTS"] - summary["scores_mean"].loc["NUTS"]).abs().max()
    toy_rows = {key: df[~df.index.isin(summary[f"{key}_mean"].index)] for key, df in toy_tables.items()}
    comparison = toy.structure_comparison(*(pd.concat([summary[f"{key}_mean"], toy_rows[key]])
                                           for key in ("scores", "variances", "elapsed")))
    ctx.table("comparison", comparison)
    found = ctx.table("findings", toy.structure_findings(comparison))

    first = runs[0]
    gx, gy = first["grid"]
    for name in summary["scores_mean"].index:
        if name.startswith("SMP-"):
            ev = first["evals"][name]
            ctx.figure(f"four_panel_{name}", plots.four_panel(gx, gy, ev.surfaces, ev.curve, f"{name} (toy example)",
                                                              train=first["train"]))

    lenet_dense = int(sizes.loc["dense", "LeNet-5 (d = 47,154)"])
    values = {"replicates": len(runs), "n_chains": cfg["n_chains"], "n_steps": cfg["n_steps"],
              "period": cfg["period"], "tau_kfac": TOY_TAU["kfac"], "tau_block": TOY_TAU["block"],
              "lenet_dense_numbers": lenet_dense, "lenet_dense_gb": lenet_dense * 4 / 1e9,
              "lenet_kfac_numbers": int(sizes.loc["kfac", "LeNet-5 (d = 47,154)"]),
              "nuts_gap": nuts_gap, "n_structures": len(comparison.index.unique(level="structure"))}
    for strategy, row in found.iterrows():
        values[f"closest_mi_{strategy}"] = row["closest to NUTS by MI"]
        values[f"kfac_rank_mi_{strategy}"] = row["kfac rank by MI distance"]
        values[f"lowest_nll_{strategy}"] = row["lowest NLL"]
        values[f"kfac_rank_nll_{strategy}"] = row["kfac rank by NLL"]
        values[f"kfac_mi_over_nuts_{strategy}"] = comparison.loc[(strategy, "kfac"), "mi_over_nuts"]
    for name, value in values.items():
        ctx.value(name, value)
    ctx.record(seeds={f"replicate_{r['replicate']}": r["seeds"] for r in runs}, seed_offset=SEED_OFFSET,
               nuts_wall_time_s=[r["elapsed"]["NUTS"] for r in runs])
