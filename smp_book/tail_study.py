"""The Gaussian-tail study (``notebooks/toy_tail.md``; beyond the paper): hybrid sampling against the recursion.

:func:`compute` writes the chapter's results (:mod:`smp_book.pipeline`); the MNIST counterpart is
:mod:`smp_book.mnist_tail_study`.

For each toy replicate (the toy study's data, NUTS and NUTS-mean) and each SMP variant, one run of
the recursion stops at every ``K0`` of ``cfg["tail_from"]`` and goes on to ``K`` from a
checkpoint, so the hybrid samples and the recursion share their chains' first ``K0`` steps:

* ``hybrid from K0``: ``theta_K0`` plus the Gaussian tail from ``K0`` to ``K``
  (:func:`smp_core.tail.add_gaussian_tail`), the draw that replaces steps ``K0 + 1, ..., K``;
* ``recursion``: the recursion run to ``K`` (the toy chapter's own run: the same seed, and the
  stops fall on its divergence checks, so the random stream is unbroken);
* ``recursion + tail to inf``: ``theta_K`` plus the tail from ``K`` to infinity, what truncation at
  ``K`` leaves out by the same approximation.

Because the chains are shared, ``theta_K - theta_K0`` (the recursion's own tail) and the hybrid's
normal draw can be compared chain for chain; :func:`tail_ratios` does that in parameter and in
logit space.
"""

from __future__ import annotations

import math
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from smp_core import metrics
from smp_core.models import as_chain_model, predict, toy_mlp
from smp_core.recursion import run_smp
from smp_core.tail import add_gaussian_tail

from .config import TOY_VARIANTS
from .tails import CHECK_EVERY, RECURSION, TO_INFINITY, TOLERANCE, _tail_ratio, tail_seed
from .toy import make_toy_data, one_class_brier, replicate_seeds, toy_preconditioner

SCORE_COLUMNS = ["accuracy", "brier", "nll", "ece", "mutual_info", "logits_variance", "params_variance", "seconds"]


def hybrid_name(k_from: int) -> str:
    return f"hybrid from {k_from}"


def sampler_names(tail_from) -> list[str]:
    """The rows of one variant, in order: the hybrids (ascending K0), the recursion, the tail to infinity."""
    return [hybrid_name(k) for k in sorted(tail_from)] + [RECURSION, TO_INFINITY]


def _logits(theta: torch.Tensor, x_test: torch.Tensor) -> torch.Tensor:
    """``(S, n)`` test logits of the toy MLP; NaN rows (diverged chains) give NaN rows."""
    alive = torch.isfinite(theta).all(1)
    logits = torch.full((theta.shape[0], x_test.shape[0]), math.nan)
    logits[alive] = predict(as_chain_model(toy_mlp()), theta[alive].float(), x_test)[..., 0]
    return logits


def _scores(theta: torch.Tensor, logits: torch.Tensor, y_test: torch.Tensor, n_bins: int) -> dict[str, float]:
    """Appendix A's scores (one-class Brier, as the toy tables) and the variances of the chains
    whose parameters are finite (``logits``: their test logits, every row)."""
    alive = torch.isfinite(theta).all(1)
    probs = metrics.binary_probs(torch.sigmoid(logits[alive].double()))
    scores = metrics.all_scores(probs, y_test.long(), n_bins=n_bins)
    scores["brier"] = float(one_class_brier(pd.Series([scores["brier"]])).iloc[0])
    scores["logits_variance"] = metrics.logits_variance(logits[alive])
    scores["params_variance"] = metrics.params_variance(theta[alive])
    return scores


def run_replicate(cfg: dict[str, Any], replicate: int, progress: bool = False) -> dict[str, Any]:
    """Every variant of ``cfg["variants"]`` on one toy replicate: the rows of :func:`sampler_names`.

    Returns ``rows`` (one dict per variant and sampler: the scores of :func:`_scores`, ``seconds``:
    the recursion's seconds to its stop plus the tail's), ``ratios`` (per variant and ``K0``: the
    hybrid's tail variance over the recursion's, in parameters and in logits), ``diverged`` and the
    seeds.
    """
    from .nuts import run_nuts

    n_steps, stops = cfg["n_steps"], sorted(cfg["tail_from"])
    if not stops or stops[-1] >= n_steps or stops[0] < 1 or any(k % CHECK_EVERY for k in stops):
        raise ValueError(f"every K0 of tail_from must be a multiple of {CHECK_EVERY} (a divergence check, so that "
                         f"the checks are the full run's) in [1, K = {n_steps}), got {stops}")
    seeds = replicate_seeds(cfg["seed"], replicate)
    x, y = make_toy_data(cfg["n_train"], seeds["train"])
    x_test, y_test = make_toy_data(cfg["n_test"], seeds["test"])
    nuts = run_nuts(x.numpy(), y.numpy(), seed=seeds["nuts"], num_warmup=cfg["nuts_warmup"],
                    num_samples=cfg["nuts_samples"], target_accept_prob=cfg["nuts_target_accept"])
    theta_hat = torch.as_tensor(nuts.samples, dtype=torch.float32).mean(0)
    rows, ratios, diverged = [], [], {}
    for variant in cfg["variants"]:
        index = TOY_VARIANTS.index(variant)  # the toy chapter's seed for this variant
        net = toy_mlp()
        samples: dict[str, torch.Tensor] = {}
        seconds: dict[str, float] = {}
        starts: dict[int, torch.Tensor] = {}
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = Path(tmp) / "run.pt"
            for k in [*stops, n_steps]:
                res = run_smp(net, "bernoulli", x, theta0=theta_hat, preconditioner=toy_preconditioner(cfg, variant),
                              tau=cfg["tau"][variant], n_steps=k, n_chains=cfg["n_chains"], seed=seeds["smp"] + index,
                              options={"checkpoint": checkpoint}, progress=progress)
                started = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # diverged chains are counted below
                    tail = add_gaussian_tail(res, net, "bernoulli", x, k_to=None if k == n_steps else n_steps,
                                             n_scores=cfg["tail_scores"], seed=tail_seed(seeds["smp"], variant, k))
                tail_seconds = time.perf_counter() - started
                name = TO_INFINITY if k == n_steps else hybrid_name(k)
                samples[name], seconds[name] = tail, res.elapsed + tail_seconds
                starts[k] = res.theta
            samples[RECURSION], seconds[RECURSION] = res.theta, res.elapsed
        diverged[f"SMP-{variant}"] = res.n_diverged
        logits = {name: _logits(samples[name], x_test) for name in sampler_names(stops)}
        for name in sampler_names(stops):
            scores = _scores(samples[name], logits[name], y_test, cfg["n_bins"])
            rows.append({"method": f"SMP-{variant}", "sampler": name, **scores, "seconds": seconds[name]})
        for k in stops:
            hybrid, recursion = samples[hybrid_name(k)], samples[RECURSION]
            keep = torch.isfinite(recursion).all(1) & torch.isfinite(hybrid).all(1)
            start = starts[k][keep]
            ratios.append({
                "method": f"SMP-{variant}", "tail_from": k,
                "params": _tail_ratio(hybrid[keep], recursion[keep], start),
                "logits": _tail_ratio(logits[hybrid_name(k)][keep], logits[RECURSION][keep],
                                      _logits(start, x_test)),
            })
    return {"replicate": replicate, "seeds": seeds, "rows": rows, "ratios": ratios, "diverged": diverged,
            "threads": torch.get_num_threads(), "created": time.strftime("%Y-%m-%d %H:%M:%S")}


def tables(runs: list[dict[str, Any]]) -> dict[str, pd.DataFrame]:
    """Means and standard deviations over replicates: ``scores`` indexed by (method, sampler) and
    ``ratios`` by (method, tail_from)."""
    scores = pd.DataFrame([{**row, "replicate": run["replicate"]} for run in runs for row in run["rows"]])
    ratios = pd.DataFrame([{**row, "replicate": run["replicate"]} for run in runs for row in run["ratios"]])
    out = {}
    for name, frame, keys in (("scores", scores, ["method", "sampler"]), ("ratios", ratios, ["method", "tail_from"])):
        grouped = frame.drop(columns="replicate").groupby(keys, sort=False)
        out[f"{name}_mean"], out[f"{name}_std"] = grouped.mean(), grouped.std(ddof=1)
        out[f"{name}_replicates"] = frame.set_index(["replicate", *keys])
    return out


def agreement(ratios_mean: pd.DataFrame, tolerance: float = TOLERANCE) -> pd.DataFrame:
    """Per variant: the smallest ``K0`` of the grid from which on (that ``K0`` and every larger one)
    the hybrid's tail variance is within a factor ``tolerance`` of the recursion's, in logit and in
    parameter space (replicate means; ``None`` when not even the largest ``K0`` is). The factor 1.25
    is our criterion, set before the runs."""
    rows = []
    for method, group in ratios_mean.groupby(level="method", sort=False):
        group = group.droplevel("method").sort_index()
        row = {"method": method}
        for space in ("logits", "params"):
            ok = (np.abs(np.log(group[space])) <= np.log(tolerance)).to_numpy()
            # from the first K0 after the last disagreement (none when the largest K0 disagrees)
            bad = np.flatnonzero(~ok)
            first = 0 if len(bad) == 0 else int(bad[-1]) + 1
            row[f"agrees in {space} from K0"] = int(group.index[first]) if first < len(group) else None
        rows.append(row)
    return pd.DataFrame(rows).set_index("method").astype("Int64")


def remaining_variance(cfg: dict[str, Any]) -> pd.DataFrame:
    """The share of the limiting variance, ``r_K0^2 / r_0^2`` (Section 3.2.3), that remains at each stop
    ``K0`` of ``cfg["tail_from"]`` and at ``K``: how much of a chain's movement the tail from there supplies."""
    from smp_core.recursion import residual_variance_ratio

    stops = [*sorted(cfg["tail_from"]), cfg["n_steps"]]
    return pd.DataFrame({"K0": stops, "r_K0^2 / r_0^2": [residual_variance_ratio(cfg["n_train"], k)
                                                         for k in stops]}).set_index("K0")


def ratios_shown(mean: pd.DataFrame, std: pd.DataFrame, digits: int = 3) -> pd.DataFrame:
    """The tail ratios as ``mean ± sd`` texts, one row per variant (in their order) and one column per
    space and ``K0`` (no spread shown where the sd is NaN, as with one replicate)."""
    text = mean.map(lambda v: f"{v:.{digits}f}") + std.reindex(mean.index).map(
        lambda v: "" if np.isnan(v) else f" ± {v:.{digits}f}")
    methods = list(dict.fromkeys(mean.index.get_level_values("method")))
    return text[["params", "logits"]].unstack("tail_from").reindex(methods)


def agreement_groups(agree: pd.DataFrame, tail_from, space: str = "logits") -> dict[str, list[str]]:
    """The variants of :func:`agreement` that agree in ``space`` from the first stop on (``"first"``),
    only from a later one (``"later"``) and not even from the last (``"never"``)."""
    col = agree[f"agrees in {space} from K0"]
    first = (col == min(tail_from)).fillna(False).to_numpy(bool)
    never = col.isna().to_numpy(bool)
    return {"first": list(agree.index[first]), "later": list(agree.index[~first & ~never]),
            "never": list(agree.index[never])}


def short_names(methods) -> str:
    """``"none, fixed-diag"`` for ``["SMP-none", "SMP-fixed-diag"]``; ``"none"`` for no method."""
    return ", ".join(m.removeprefix("SMP-") for m in methods) or "none"


def plot_logit_variance(mean: pd.DataFrame, std: pd.DataFrame, tail_from):
    """Bars of the test logits' variance per variant and sampler (:func:`sampler_names`), log scale."""
    import matplotlib.pyplot as plt

    samplers = sampler_names(tail_from)
    methods = list(dict.fromkeys(mean.index.get_level_values("method")))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(samplers)
    for j, sampler in enumerate(samplers):
        values = [mean.loc[(m, sampler), "logits_variance"] for m in methods]
        errors = [std.loc[(m, sampler), "logits_variance"] for m in methods]
        ax.bar(np.arange(len(methods)) + (j - (len(samplers) - 1) / 2) * width, values, width, yerr=errors,
               label=sampler, capsize=2)
    ax.set_xticks(np.arange(len(methods)), [m.removeprefix("SMP-") for m in methods], rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("logit variance (test points)")
    ax.legend(fontsize=8, ncol=2)
    ax.set_title("Hybrid samplers against the recursion (toy example; mean ± sd over replicates)")
    fig.tight_layout()
    return fig


PREDICTIVE_COLUMNS = {"accuracy": "accuracy", "nll": "NLL", "ece": "ECE", "mutual_info": "MI",
                      "logits_variance": "logit variance", "seconds": "seconds"}


def compute(ctx) -> None:
    """The toy tail chapter's results (:mod:`smp_book.pipeline`): every replicate (cached by config and
    replicate under ``.cache/toy_tail/``), the tail ratios and the agreement per variant, the
    predictive metrics of every sampler, the recursion rows against the toy chapter's own runs, the
    figure and the numbers the prose quotes."""
    from .pipeline import cached, code_hash

    cfg = ctx.config
    runs = [cached("toy_tail", {**cfg, "replicate": r, "code": code_hash(__name__)},
                   lambda r=r: run_replicate(cfg, r, progress=ctx.progress), enabled=ctx.use_cache)
            for r in range(cfg["replicates"])]
    summary = tables(runs)
    for key in ("scores", "ratios"):
        for part in ("mean", "std", "replicates"):
            ctx.table(f"{key}_{part}", summary[f"{key}_{part}"])
    diverged = pd.DataFrame([r["diverged"] for r in runs])
    diverged.index.name = "replicate"
    ctx.table("diverged", diverged)
    ctx.table("remaining", remaining_variance(cfg))
    ctx.table("ratios_shown", ratios_shown(summary["ratios_mean"], summary["ratios_std"]))
    agree = ctx.table("agreement", agreement(summary["ratios_mean"]))
    ctx.table("agreement_shown", agree.astype(object).where(agree.notna(), "none"))  # "none": not even from the last K0
    predictive = summary["scores_mean"][list(PREDICTIVE_COLUMNS)].rename(columns=PREDICTIVE_COLUMNS)
    ctx.table("predictive", predictive)
    ctx.figure("logit_variance_by_sampler", plot_logit_variance(
        summary["scores_mean"], summary["scores_std"].fillna(0), cfg["tail_from"]))

    # the recursion rows against the toy chapter's runs of the same replicates (same data, start, seeds)
    toy_rows = ctx.read("toy").table("scores_replicates")
    ours = summary["scores_replicates"].xs(RECURSION, level="sampler")
    common = ours.index.intersection(toy_rows.index)
    columns = list(toy_rows.columns)
    gap = (ours.loc[common, columns] - toy_rows.loc[common, columns]).abs().to_numpy().max() if len(common) else None
    ctx.value("toy_rows_compared", len(common))
    ctx.value("toy_gap", gap)

    groups = agreement_groups(agree, cfg["tail_from"])
    for name, methods in groups.items():
        ctx.value(f"agree_{name}", short_names(methods))
        ctx.value(f"n_agree_{name}", len(methods))
    ctx.value("n_variants", len(agree))
    ctx.value("tolerance", TOLERANCE)
    ctx.value("first_stop", min(cfg["tail_from"]))
    ctx.value("last_stop", max(cfg["tail_from"]))
    ctx.value("stops", ", ".join(str(k) for k in sorted(cfg["tail_from"])))
    ctx.value("replicates", len(runs))
    ctx.value("n_train", cfg["n_train"])
    ctx.value("n_chains", cfg["n_chains"])
    ctx.value("n_steps", cfg["n_steps"])
    ctx.value("tail_scores", cfg["tail_scores"])
    ctx.value("diverged", int(diverged.to_numpy().sum()))
    ctx.record(seeds={f"replicate_{r['replicate']}": r["seeds"] for r in runs}, threads=runs[0]["threads"])
