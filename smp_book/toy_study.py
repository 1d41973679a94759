"""The toy study of Section 3.2: data, NUTS, NUTS-mean, the 10 SMP variants, tables and figures (the verdicts
on the paper's claims are the register's: :mod:`smp_book.register`)."""

from __future__ import annotations

import pandas as pd

from .config import TOY_VARIANTS
from .toy import run_replicate, summarise


def compute(ctx) -> None:
    """The toy chapter's results (:mod:`smp_book.pipeline`): every replicate (NUTS and the ten SMP
    variants, cached by config and replicate under ``.cache/toy/``), the paper's three tables with
    their spread over replicates, NUTS's diagnostics, the figures of the first replicate, the
    numbers the prose quotes."""
    from . import plots
    from .nuts import nuts_mean_passes
    from .pipeline import cached, code_hash

    cfg = ctx.config
    runs = [cached("toy", {**cfg, "replicate": r, "variants": TOY_VARIANTS, "code": code_hash(__name__)},
                   lambda r=r: run_replicate(cfg, r, progress=ctx.progress), enabled=ctx.use_cache)
            for r in range(cfg["replicates"])]
    summary = summarise(runs)
    for key in ("scores", "variances", "elapsed"):
        for part in ("mean", "std", "replicates"):
            ctx.table(f"{key}_{part}", summary[f"{key}_{part}"])
    diagnostics = pd.DataFrame([{"replicate": r["replicate"], **r["nuts_diagnostics"], **r["nuts_mean_check"],
                                 "passed": nuts_mean_passes(r["nuts_mean_check"])} for r in runs])
    ctx.table("nuts_diagnostics", diagnostics.set_index("replicate"))
    ctx.table("diverged", pd.DataFrame([r["diverged"] for r in runs]).rename_axis("replicate"))

    first = runs[0]
    gx, gy = first["grid"]
    for name, ev in first["evals"].items():
        ctx.figure(f"four_panel_{name}", plots.four_panel(gx, gy, ev.surfaces, ev.curve, f"{name} (toy example)",
                                                          train=first["train"]))
    ctx.figure("calibration_all", plots.calibration_all({n: e.curve for n, e in first["evals"].items()},
                                                        "Calibration, toy example", xlim=(0.45, 1.0)))
    m = summary["scores_mean"]
    values = {"replicates": len(runs), "r_ratio": first["r_ratio"], "n_train": cfg["n_train"],
              "n_steps": cfg["n_steps"], "threads": first["threads"], "crossed": int((~diagnostics["passed"]).sum()),
              "nuts_accuracy": m.loc["NUTS", "accuracy"], "accuracy_bar": m.loc["NUTS", "accuracy"] - 0.005,
              "nuts_mean_accuracy": m.loc["NUTS-mean", "accuracy"], "ema_block_nll": m.loc["SMP-ema-block", "nll"],
              "ema_block_ece": m.loc["SMP-ema-block", "ece"], "nuts_nll": m.loc["NUTS", "nll"],
              "nuts_ece": m.loc["NUTS", "ece"]}
    for name, value in values.items():
        ctx.value(name, value)
    ctx.record(seeds={f"replicate_{r['replicate']}": r["seeds"] for r in runs},
               nuts_wall_time_s=[r["elapsed"]["NUTS"] for r in runs])
