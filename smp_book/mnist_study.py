"""The MNIST study of Section 3.3: MAP LeNet-5, the four SMP variants, tables and figures.

The chapters that build on it have modules of their own: :mod:`smp_book.mnist_seeds_study`,
:mod:`smp_book.mnist_growth_study`, :mod:`smp_book.mnist_kfac_study`.

Runs on CUDA when a GPU is present and on the CPU otherwise, with no code change.
"""

from __future__ import annotations

import numpy as np
import torch

from smp_core.recursion import residual_variance_ratio

from .machine import cpu_model
from .mnist_runs import (
    DIAGONAL_METHODS,
    FULL_SIZES,
    PAPER_RESULTS,
    ambiguous_three,
    chapter_map,
    default_device,
    fisher_zero_fraction,
    load_data,
    r_ratio,
    run_replicates,
    smp_path,
    smp_seed,
    study_variants,
    summarise,
    top_probabilities,
    variant_index,
)


def ambiguous_three_figure(evals: dict[str, dict], image: torch.Tensor, index: int):
    """The test image ``index`` (``image``, ``(28, 28)``) beside the mean predicted class probabilities
    of every method of ``evals`` (bars), with the spread over the samples as black lines (10th to 90th
    percentile)."""
    import matplotlib.pyplot as plt

    columns = 3  # legible at the text column's width: three panels a row
    rows = -(-(len(evals) + 1) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(9, 2.9 * rows), squeeze=False)
    axes = axes.ravel()
    for ax in axes[len(evals) + 1:]:
        ax.axis("off")
    axes[0].imshow(image, cmap="gray_r")
    axes[0].set_title(f"test image {index} (label 3)")
    axes[0].axis("off")
    for ax, (name, ev) in zip(axes[1:len(evals) + 1], evals.items(), strict=True):
        p = ev["probs"][:, index].numpy()
        lo, hi = np.percentile(p, [10, 90], axis=0)
        # a skewed sample can have its mean outside [q10, q90]: draw the interval as lines, not error bars
        ax.bar(range(10), p.mean(0), color="tab:blue", alpha=0.7)
        ax.vlines(range(10), lo, hi, color="black", linewidth=1)
        ax.set_xticks(range(10))
        ax.set_ylim(0, 1)
        ax.set_title(name, fontsize=11)
    fig.tight_layout()
    return fig


def paper_scale_note(scale: str, paper_run=None) -> str:
    """What the chapter says of the paper-scale results: that they are the chapter's own (at
    ``scale == "paper"``), where they were computed (``paper_run``, from :func:`paper_scale_results`),
    or plainly that none exist yet."""
    if scale == "paper":
        return "This chapter runs at the paper scale: the table above holds the paper-scale results."
    if paper_run is None:
        return (f"No paper-scale results exist yet: `{PAPER_RESULTS}/` holds no complete run with the paper "
                "scale's settings (it needs a GPU, or hours of CPU per variant; `make bench` projects the CPU "
                "time).")
    manifest = paper_run.manifest
    device = manifest.get("environment", {}).get("device") or manifest.get("device", "an unrecorded device")
    replicates = manifest["config"].get("smp_replicates", 1)
    return (f"The paper scale ($K$ = {manifest['config']['n_steps']:,}, $S$ = {manifest['config']['n_chains']}, "
            f"{replicates} replicate{'' if replicates == 1 else 's'}), computed on {device} "
            f"in {manifest.get('wall_time_s', float('nan')):,.0f} s:")


def compute(ctx) -> None:
    """The MNIST chapter's results (:mod:`smp_book.pipeline`): the MAP (cached under ``.cache/mnist/``)
    with its training history, the fraction of zeros on the diagonal of the empirical Fisher, the
    replicates of the four SMP variants (:func:`run_replicates`), the paper's three tables per
    replicate and summarised, the chain shares, the two figures of the first replicate
    and the numbers the prose quotes. The device and the seeds go into the manifest."""
    from . import plots

    cfg = ctx.config
    device = default_device()
    data, provenance = load_data(cfg)
    map_fit = chapter_map(cfg, data, device, use_cache=ctx.use_cache, progress=ctx.progress)
    theta_map = map_fit["theta"]
    ctx.table("map_history", map_fit["history"], index=False)
    ctx.table("map_candidates", map_fit["candidates"], index=False)
    zero_fraction = fisher_zero_fraction(theta_map, data, device)

    runs = run_replicates(cfg, theta_map, data, device, use_cache=ctx.use_cache, progress=ctx.progress)
    per_replicate, figure_evals = runs["tables"], runs["figure_evals"]
    for key, df in per_replicate[0].items():  # the first replicate: the seeds of the study's single run
        ctx.table(key, df)
    summary = summarise(per_replicate)
    for key, df in summary.items():
        ctx.table(key, df)
    ctx.table("diverged", runs["diverged"])

    ctx.figure("calibration_all", plots.calibration_all({n: e["curve"] for n, e in figure_evals.items()},
                                                        "Calibration, MNIST"))
    three = ambiguous_three(figure_evals["MAP"]["probs"], data["test"][1])
    ctx.figure("ambiguous_three", ambiguous_three_figure(figure_evals, data["test"][0][three, 0], three))
    ctx.table("ambiguous_three", top_probabilities(figure_evals, three))

    m = summary["scores_mean"]
    path = smp_path(device)
    for key in ("n_train", "n_val", "n_test", "n_steps", "n_chains", "period", "map_epochs"):
        ctx.value(key, cfg[key])
    ctx.value("replicates", cfg["smp_replicates"])
    ctx.value("n_fisher_periodic", cfg["n_fisher_periodic"] or cfg["n_val"])
    ctx.value("dim", theta_map.numel())
    ctx.value("r_ratio", r_ratio(cfg))
    ctx.value("paper_r_ratio", residual_variance_ratio(FULL_SIZES[0], 1_000_000))
    ctx.value("fisher_zero_fraction", zero_fraction)
    ctx.value("map_seconds", map_fit["seconds"])
    ctx.value("map_seed", map_fit["seed"])
    ctx.value("threads", torch.get_num_threads())
    ctx.value("device", str(device))
    ctx.value("device_name", torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model())
    ctx.value("smp_path", path)
    sizes = provenance.get("sizes", {})
    ctx.value("data_description",
              "the MNIST files under data/MNIST/raw"
              + (" (their SHA-256 as the reference's)" if provenance.get("matches_reference") else "")
              + f", split with seed {cfg['split_seed']} into {sizes.get('train', cfg['n_train']):,} training, "
              f"{sizes.get('val', cfg['n_val']):,} validation and {sizes.get('test', cfg['n_test']):,} test images")
    ctx.value("ambiguous_index", three)
    ctx.value("map_accuracy", m.loc["MAP", "accuracy"])
    ctx.value("map_nll", m.loc["MAP", "nll"])
    if "SMP-none" in m.index:  # a chapter run on some variants (its parameters) leaves the others' values out
        ctx.value("none_accuracy", m.loc["SMP-none", "accuracy"])
        ctx.value("none_nll", m.loc["SMP-none", "nll"])
        ctx.value("none_mutual_info", m.loc["SMP-none", "mutual_info"])
    diagonal = [d for d in DIAGONAL_METHODS if d in m.index]
    if diagonal:
        ctx.value("diag_mutual_info_min", m.loc[diagonal, "mutual_info"].min())
        ctx.value("diag_mutual_info_max", m.loc[diagonal, "mutual_info"].max())
    ctx.value("diverged_chains", int(runs["diverged"].to_numpy().sum()))
    ctx.record(seeds={"split": cfg["split_seed"], "map": map_fit["seed"],
                      "smp": {f"replicate_{r}": {v: smp_seed(cfg, variant_index(cfg, v), r)
                                                  for v in study_variants(cfg)} for r in range(cfg["smp_replicates"])}},
               device=str(device), data=provenance, fisher_zero_fraction=zero_fraction, r_ratio=r_ratio(cfg),
               map_seconds=map_fit["seconds"], smp_path=path)
