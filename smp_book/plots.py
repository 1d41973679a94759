"""Figures of the book (matplotlib). Functions take summaries computed elsewhere and return figures."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def save(fig, folder: Path, name: str) -> None:
    """Save a figure as PNG under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    fig.savefig(folder / f"{name}.png", dpi=110, bbox_inches="tight")


def reliability(ax, curve, label: str | None = None, **kw) -> None:
    """Plot one calibration curve (accuracy vs mean confidence per non-empty bin)."""
    conf = np.asarray(curve.confidence, dtype=float)
    acc = np.asarray(curve.accuracy, dtype=float)
    keep = np.asarray(curve.counts) > 0
    ax.plot(conf[keep], acc[keep], marker="o", ms=3, label=label, **kw)


def four_panel(grid_x, grid_y, surfaces: dict[str, np.ndarray], curve, title: str, train=None):
    """The paper's toy figure: predicted probability, calibration, mutual information, expected entropy."""
    fig, axes = plt.subplots(2, 2, figsize=(9, 7.5))
    panels = [("prob", "predicted probability", axes[0, 0], "RdBu_r", (0, 1)),
              ("mi", "mutual information", axes[1, 0], "viridis", None),
              ("exp_entropy", "expected entropy", axes[1, 1], "magma", None)]
    for key, label, ax, cmap, lims in panels:
        vmin, vmax = lims if lims else (0, max(float(np.nanmax(surfaces[key])), 1e-6))
        im = ax.contourf(grid_x, grid_y, surfaces[key], levels=21, cmap=cmap, vmin=vmin, vmax=vmax)
        circle = plt.Circle((0, 0), np.sqrt(0.5), fill=False, ls="--", color="k", lw=0.8)
        ax.add_patch(circle)
        if train is not None and key == "prob":
            x, y = train
            ax.scatter(x[:, 0], x[:, 1], c=y, cmap="RdBu_r", s=4, edgecolors="k", linewidths=0.2)
        ax.set_title(label)
        ax.set_aspect("equal")
        fig.colorbar(im, ax=ax, shrink=0.8)
    ax = axes[0, 1]
    ax.plot([0, 1], [0, 1], "k--", lw=0.8)
    reliability(ax, curve)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_title("calibration")
    ax.set_xlim(0.45, 1.0)
    ax.set_ylim(0.0, 1.02)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def calibration_all(curves: dict, title: str, xlim=(0.0, 1.0)):
    """Calibration curves of every method on one plot."""
    fig, ax = plt.subplots(figsize=(6.5, 6))
    ax.plot([0, 1], [0, 1], "k--", lw=0.8, label="perfect calibration")
    for name, curve in curves.items():
        reliability(ax, curve, label=name, lw=1)
    ax.set_xlim(*xlim)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def surfaces_side_by_side(grid_x, grid_y, surfaces: dict[str, np.ndarray], title: str, cmap: str = "viridis",
                          ncols: int = 4):
    """One surface per method (e.g. the mutual information), each with its own colour scale, so that
    the panels compare where a quantity is large rather than how large it is."""
    n = len(surfaces)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.3 * ncols, 3.0 * nrows), squeeze=False)
    for ax, (name, surface) in zip(axes.flat, surfaces.items(), strict=False):
        top = max(float(np.nanmax(surface)), 1e-6)
        im = ax.contourf(grid_x, grid_y, surface, levels=21, cmap=cmap, vmin=0, vmax=top)
        ax.add_patch(plt.Circle((0, 0), np.sqrt(0.5), fill=False, ls="--", color="w", lw=0.8))
        ax.set_title(f"{name}\nmean {float(np.nanmean(surface)):.3g}", fontsize=9)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, shrink=0.8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _log_axis_if_wide(ax, values) -> None:
    """A log x axis when the positive finite ``values`` span more than a factor 50."""
    positive = values[np.isfinite(values) & (values > 0)]
    if positive.size and positive.max() / positive.min() > 50:
        ax.set_xscale("log")


def beside_paper(mean, std, paper, title: str, ncols: int = 3):
    """One panel per metric that both tables have: per method (rows), the paper's value (a cross) and ours
    (a dot with a bar of plus or minus one standard deviation over the replicates, where there are several).
    A metric whose positive values span more than a factor 50 is drawn on a log axis (where a spread
    reaching below zero runs to the axis' edge)."""
    import math

    metrics = [c for c in mean.columns if c in paper.columns]
    methods = list(mean.index)
    ncols = max(1, min(ncols, len(metrics)))
    nrows = math.ceil(len(metrics) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 0.28 * len(methods) * nrows + 1.2 * nrows),
                             squeeze=False, sharey=True)
    y = np.arange(len(methods))
    for ax, metric in zip(axes.flat, metrics, strict=False):
        ours = mean[metric].to_numpy(dtype=float)
        spread = std[metric].reindex(mean.index).to_numpy(dtype=float) if std is not None else np.zeros_like(ours)
        theirs = paper[metric].reindex(mean.index).to_numpy(dtype=float)
        ax.errorbar(ours, y, xerr=np.nan_to_num(spread), fmt="o", ms=4, color="tab:blue", label="ours", capsize=2)
        ax.plot(theirs, y, "x", color="tab:red", ms=6, label="paper")
        _log_axis_if_wide(ax, np.concatenate([ours, theirs]))
        ax.set_title(metric, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_yticks(y)
        ax.set_yticklabels(methods, fontsize=8)
        ax.invert_yaxis()
    axes.flat[0].legend(fontsize=8, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def sensitivity(table, ours: str, marks: dict | None = None):
    """One panel per gap metric of :func:`smp_book.toy_gaps_study.sensitivity`, stacked: per setting (rows),
    our mean with a bar of plus or minus one standard deviation over the replicates; the paper's value as a
    red line and the paper-faithful mean as a grey dashed one; ``marks`` ``{metric: (value, label)}`` adds a
    green dotted line to a panel. A metric whose values span more than a factor 50 is drawn on a log axis."""
    metrics = list(dict.fromkeys(table.index.get_level_values("metric")))
    sizes = [len(table.xs(m, level="metric")) for m in metrics]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(7.5, 0.26 * sum(sizes) + 0.9 * len(metrics)),
                             gridspec_kw={"height_ratios": sizes}, squeeze=False)
    for ax, metric in zip(axes[:, 0], metrics, strict=True):
        part = table.xs(metric, level="metric")
        y = np.arange(len(part))
        mean = part["mean"].to_numpy(dtype=float)
        ax.errorbar(mean, y, xerr=np.nan_to_num(part["sd"].to_numpy(dtype=float)), fmt="o", ms=4,
                    color="tab:blue", capsize=2)
        ax.axvline(float(part["paper"].iloc[0]), color="tab:red", lw=1.2, label="paper")
        ax.axvline(float(part.loc[ours, "mean"]), color="grey", ls="--", lw=1, label=ours)
        if marks and metric in marks:
            ax.axvline(marks[metric][0], color="tab:green", ls=":", lw=1.5, label=marks[metric][1])
            ax.legend(fontsize=7, loc="best")
        _log_axis_if_wide(ax, np.concatenate([mean, part["paper"].to_numpy(dtype=float)]))
        ax.set_yticks(y)
        ax.set_yticklabels(part.index, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(metric, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0, 0].legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig
