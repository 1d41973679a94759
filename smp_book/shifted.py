"""MNIST methods scored on the test set and on rotated copies of it (the baselines and last-layer chapters).

Leads between methods are paired over the test images: they measure the test set's sampling error, not
the spread over training runs.
"""

from __future__ import annotations

import time
from typing import Any

import pandas as pd
import torch
from torchvision.transforms.v2 import functional as TF

from smp_core import metrics

from .summaries import paired_lead


def rotate(images: torch.Tensor, degrees: float) -> torch.Tensor:
    """``images`` ``(n, 1, 28, 28)`` rotated anticlockwise by ``degrees`` (bilinear, the corners filled with 0)."""
    return TF.rotate(images, float(degrees), interpolation=TF.InterpolationMode.BILINEAR, fill=0.0)


def test_sets(cfg: dict[str, Any], data: dict) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``{angle: (images, labels)}``: the whole test set at 0 and the first ``shift_images`` rotated."""
    x, y = data["test"]
    n = min(cfg["shift_images"], len(y))
    sets = {0: (x, y)}
    sets.update({int(a): (rotate(x[:n], a), y[:n]) for a in cfg["shift_angles"]})
    return sets


def evaluate(logits_of, sets: dict[int, tuple[torch.Tensor, torch.Tensor]], three: int, n_bins: int = 10) -> dict:
    """Scores of one method on every test set, from ``logits_of(x) -> (S, n, 10)``.

    Returns the paper's scores on every set (``shift``, by angle; ``scores`` = angle 0), the per-image
    NLL and Brier score on every set (for paired standard errors), the logit variance, calibration
    curve and mean class probabilities of test image ``three`` (the MNIST chapter's ambiguous 3) on
    the whole test set, and the seconds the predictions took.
    """
    started = time.perf_counter()
    out: dict[str, Any] = {"shift": {}, "per_image": {}}
    for angle, (x, y) in sets.items():
        logits = logits_of(x)
        probs = torch.softmax(logits.double(), dim=-1)
        out["shift"][angle] = metrics.all_scores(probs, y, n_bins=n_bins)
        mean = metrics.predictive(probs)
        truth = mean.gather(1, y[:, None])[:, 0]
        out["per_image"][angle] = {"nll": -torch.log(truth.clamp_min(metrics.NLL_FLOOR)),
                                   "brier": ((mean - torch.nn.functional.one_hot(y, mean.shape[1])) ** 2).sum(1)}
        if angle == 0:
            out["scores"] = out["shift"][0]
            out["logits_variance"] = metrics.logits_variance(logits)
            out["curve"] = metrics.calibration_curve(probs, y, n_bins=n_bins)
            out["three_probs"] = mean[three].float()
    out["n_samples"] = int(logits.shape[0])
    out["predict_seconds"] = time.perf_counter() - started
    return out


def tables(study: dict[str, Any]) -> dict[str, pd.DataFrame]:
    """The chapter's tables from :func:`run_study`.

    ``scores``: the paper's metrics on the whole test set, the logit variance and the seconds to fit
    and to predict (the test set and the rotated sets); ``shift``: accuracy, NLL, Brier score and ECE
    per method and angle (0 is the whole test set); ``three``: the mean class probabilities of the
    ambiguous 3; ``laplace``: the Laplace fits; ``dropout``: MC dropout's choice of rate.
    """
    evals = study["evals"]
    names = list(evals)
    scores = pd.DataFrame([evals[n]["scores"] for n in names], index=names)[list(metrics.SCORE_KEYS)]
    scores["logits_variance"] = [evals[n]["logits_variance"] for n in names]
    scores["fit_seconds"] = [study["fit_seconds"][n] for n in names]
    scores["predict_seconds"] = [evals[n]["predict_seconds"] for n in names]
    scores.index.name = "method"
    shift = pd.DataFrame([{"method": n, "angle": a, **{k: s[k] for k in ("accuracy", "nll", "brier", "ece")}}
                          for n in names for a, s in evals[n]["shift"].items()]).set_index(["method", "angle"])
    three = pd.DataFrame({n: evals[n]["three_probs"].double().numpy() for n in names}).T
    three.index.name, three.columns.name = "method", "class"
    out = {"scores": scores, "shift": shift, "three": three}
    if study["laplace"] is not None:
        out["laplace"] = study["laplace"]
    if study.get("dropout") is not None:
        out["dropout"] = study["dropout"]
    return out


def leads_over(evals: dict[str, dict], reference: str = "MAP", metric: str = "nll") -> pd.DataFrame:
    """``method x angle``: by how many standard errors each method's mean per-image ``metric`` is
    below the ``reference``'s (paired over the test images; positive: better than the reference,
    NaN for the reference itself)."""

    angles = list(evals[reference]["per_image"])
    table = pd.DataFrame(
        {angle: {name: (float("nan") if name == reference else paired_lead(
            (evals[reference]["per_image"][angle][metric] - e["per_image"][angle][metric]).double().numpy()))
            for name, e in evals.items()} for angle in angles})
    table.index.name, table.columns.name = "method", "angle"
    return table


def rotation_figure(shift: pd.DataFrame, methods: list[str]):
    """Accuracy, NLL and ECE of ``methods`` against the rotation angle (``shift``: :func:`tables`'
    ``shift``); the ``-nn`` rows, off the scale, are left to the table."""
    import matplotlib.pyplot as plt

    shift = shift.reset_index()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, metric in zip(axes, ("accuracy", "nll", "ece"), strict=True):
        for name in methods:
            if name.endswith("-nn (wd)"):
                continue
            rows = shift[shift["method"] == name]
            style = "-" if name.startswith(("SMP", "MAP")) else "--"
            ax.plot(rows["angle"], rows[metric], style, marker="o", label=name)
        ax.set_xlabel("rotation (degrees)")
        ax.set_title(metric)
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    return fig
