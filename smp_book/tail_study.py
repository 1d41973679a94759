"""The Gaussian-tail study (``notebooks/toy_tail.md``; beyond the paper): hybrid sampling against the recursion.

On each toy replicate (the toy study's data and NUTS-mean) one run of the recursion per SMP variant stops at every
``K0`` of ``cfg["tail_from"]`` and resumes from a checkpoint, so that ``hybrid from K0`` (``theta_K0`` plus the
Gaussian tail to ``K``, :func:`smp_core.tail.add_gaussian_tail`), the ``recursion`` to ``K`` (the toy chapter's
own chains: the stops fall on its divergence checks) and the ``recursion + tail to inf`` share each chain's
first ``K0`` steps, and the two tails can be compared chain for chain. MNIST: :mod:`smp_book.mnist_tail_study`.
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
from smp_core.recursion import residual_variance_ratio, run_smp
from smp_core.tail import add_gaussian_tail

from .config import TOY_VARIANTS
from .tails import CHECK_EVERY, RECURSION, TO_INFINITY, TOLERANCE, _tail_ratio, tail_seed
from .toy import make_toy_data, one_class_brier, replicate_seeds, toy_preconditioner

PREDICTIVE_COLUMNS = {"accuracy": "accuracy", "nll": "NLL", "ece": "ECE", "mutual_info": "MI",
                      "logits_variance": "logit variance", "seconds": "seconds"}


def sampler_names(tail_from) -> list[str]:
    """The rows of one variant, in order: the hybrids (ascending K0), the recursion, the tail to infinity."""
    return [f"hybrid from {k}" for k in sorted(tail_from)] + [RECURSION, TO_INFINITY]


def _logits(theta: torch.Tensor, x_test: torch.Tensor) -> torch.Tensor:
    """``(S, n)`` test logits of the toy MLP; NaN rows (diverged chains) give NaN rows."""
    alive = torch.isfinite(theta).all(1)
    logits = torch.full((theta.shape[0], x_test.shape[0]), math.nan)
    logits[alive] = predict(as_chain_model(toy_mlp()), theta[alive].float(), x_test)[..., 0]
    return logits


def _scores(theta: torch.Tensor, logits: torch.Tensor, y_test: torch.Tensor, n_bins: int) -> dict[str, float]:
    """Appendix A's scores (one-class Brier, as the toy tables) and the variances of the finite chains
    (``logits``: the test logits of every chain)."""
    alive = torch.isfinite(theta).all(1)
    probs = metrics.binary_probs(torch.sigmoid(logits[alive].double()))
    scores = metrics.all_scores(probs, y_test.long(), n_bins=n_bins)
    scores["brier"] = one_class_brier(scores["brier"])
    return {**scores, "logits_variance": metrics.logits_variance(logits[alive]),
            "params_variance": metrics.params_variance(theta[alive])}


def run_replicate(cfg: dict[str, Any], replicate: int, progress: bool = False) -> dict[str, Any]:
    """Every variant of ``cfg["variants"]`` on one toy replicate: ``scores`` (per variant and sampler of
    :func:`sampler_names`: the scores, and ``seconds``, the recursion's to its stop plus the tail's), ``ratios``
    (per variant and ``K0``: the hybrid's tail variance over the recursion's, in parameters and in logits),
    ``diverged`` and the seeds."""
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
    names, scores, ratios, diverged = sampler_names(stops), [], [], {}
    for variant in cfg["variants"]:
        seed, method, net = seeds["smp"] + TOY_VARIANTS.index(variant), f"SMP-{variant}", toy_mlp()
        samples, seconds, theta_at = {}, {}, {}  # by sampler name; theta_at: the recursion's chains at each stop
        with tempfile.TemporaryDirectory() as tmp:
            for k in [*stops, n_steps]:
                res = run_smp(net, "bernoulli", x, theta0=theta_hat, preconditioner=toy_preconditioner(cfg, variant),
                              tau=cfg["tau"][variant], n_steps=k, n_chains=cfg["n_chains"], seed=seed,
                              options={"checkpoint": Path(tmp) / "run.pt"}, progress=progress)
                started, name = time.perf_counter(), TO_INFINITY if k == n_steps else f"hybrid from {k}"
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # diverged chains are counted below
                    samples[name] = add_gaussian_tail(res, net, "bernoulli", x, k_to=None if k == n_steps else n_steps,
                                                      n_scores=cfg["tail_scores"],
                                                      seed=tail_seed(seeds["smp"], variant, k))
                seconds[name], theta_at[k] = res.elapsed + (time.perf_counter() - started), res.theta
        samples[RECURSION], seconds[RECURSION], diverged[method] = res.theta, res.elapsed, res.n_diverged
        logits = {name: _logits(samples[name], x_test) for name in names}
        scores += [{"method": method, "sampler": name, **_scores(samples[name], logits[name], y_test, cfg["n_bins"]),
                    "seconds": seconds[name]} for name in names]
        recursion = samples[RECURSION]
        for k, name in zip(stops, names[:-2], strict=True):  # the hybrids
            keep = torch.isfinite(recursion).all(1) & torch.isfinite(samples[name]).all(1)
            start = theta_at[k][keep]
            ratios.append({"method": method, "tail_from": k,
                           "params": _tail_ratio(samples[name][keep], recursion[keep], start),
                           "logits": _tail_ratio(logits[name][keep], logits[RECURSION][keep], _logits(start, x_test))})
    return {"replicate": replicate, "seeds": seeds, "scores": scores, "ratios": ratios, "diverged": diverged,
            "threads": torch.get_num_threads(), "created": time.strftime("%Y-%m-%d %H:%M:%S")}


def tables(runs: list[dict[str, Any]]) -> dict[str, pd.DataFrame]:
    """Means and standard deviations over replicates, and every replicate's rows: ``scores_*`` indexed by
    (method, sampler) and ``ratios_*`` by (method, tail_from)."""
    out = {}
    for name, keys in (("scores", ["method", "sampler"]), ("ratios", ["method", "tail_from"])):
        frame = pd.DataFrame([{**row, "replicate": run["replicate"]} for run in runs for row in run[name]])
        grouped = frame.drop(columns="replicate").groupby(keys, sort=False)
        out[f"{name}_mean"], out[f"{name}_std"] = grouped.mean(), grouped.std(ddof=1)
        out[f"{name}_replicates"] = frame.set_index(["replicate", *keys])
    return out


def agreement(ratios_mean: pd.DataFrame, tolerance: float = TOLERANCE) -> pd.DataFrame:
    """Per variant and space: the smallest ``K0`` from which on (it and every larger one) the hybrid's tail
    variance is within a factor ``tolerance`` of the recursion's (``None`` when not even the largest is)."""
    rows = []
    for method, group in ratios_mean.groupby(level="method", sort=False):
        group, row = group.droplevel("method").sort_index(), {"method": method}
        for space in ("logits", "params"):
            ok = (np.abs(np.log(group[space])) <= np.log(tolerance)).to_numpy()
            agreeing = group.index[np.logical_and.accumulate(ok[::-1])[::-1]]  # the K0 from which on all agree
            row[f"agrees in {space} from K0"] = int(agreeing[0]) if len(agreeing) else None
        rows.append(row)
    return pd.DataFrame(rows).set_index("method").astype("Int64")


def remaining_variance(cfg: dict[str, Any]) -> pd.DataFrame:
    """The share of the limiting variance, ``r_K0^2 / r_0^2`` (Section 3.2.3), left at each stop and at ``K``."""
    stops = [*sorted(cfg["tail_from"]), cfg["n_steps"]]
    return pd.DataFrame({"K0": stops, "r_K0^2 / r_0^2": [residual_variance_ratio(cfg["n_train"], k)
                                                         for k in stops]}).set_index("K0")


def ratios_shown(mean: pd.DataFrame, std: pd.DataFrame, digits: int = 3) -> pd.DataFrame:
    """The tail ratios as ``mean ± sd`` texts (no spread where the sd is NaN), one row per variant in their
    order, one column per space and ``K0``."""
    text = mean.map(lambda v: f"{v:.{digits}f}") + std.reindex(mean.index).map(
        lambda v: "" if np.isnan(v) else f" ± {v:.{digits}f}")
    return text[["params", "logits"]].unstack("tail_from").reindex(mean.index.unique("method"))


def agreement_groups(agree: pd.DataFrame, tail_from, space: str = "logits") -> dict[str, list[str]]:
    """The variants of :func:`agreement` that agree in ``space`` from the first stop on (``"first"``),
    only from a later one (``"later"``) and not even from the last (``"never"``)."""
    col = agree[f"agrees in {space} from K0"]
    first, never = (col == min(tail_from)).fillna(False).to_numpy(bool), col.isna().to_numpy(bool)
    return {"first": list(agree.index[first]), "later": list(agree.index[~first & ~never]),
            "never": list(agree.index[never])}


def short_names(methods) -> str:
    """``"none, fixed-diag"`` for ``["SMP-none", "SMP-fixed-diag"]``; ``"none"`` for no method."""
    return ", ".join(m.removeprefix("SMP-") for m in methods) or "none"


def plot_logit_variance(mean: pd.DataFrame, std: pd.DataFrame, tail_from):
    """Bars of the test logits' variance per variant and sampler (:func:`sampler_names`), log scale."""
    import matplotlib.pyplot as plt

    samplers, methods = sampler_names(tail_from), list(mean.index.unique("method"))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(samplers)
    for j, sampler in enumerate(samplers):
        rows = [(m, sampler) for m in methods]
        ax.bar(np.arange(len(methods)) + (j - (len(samplers) - 1) / 2) * width, mean.loc[rows, "logits_variance"],
               width, yerr=std.loc[rows, "logits_variance"], label=sampler, capsize=2)
    ax.set_xticks(np.arange(len(methods)), [m.removeprefix("SMP-") for m in methods], rotation=30, ha="right")
    ax.set(yscale="log", ylabel="logit variance (test points)",
           title="Hybrid samplers against the recursion (toy example; mean ± sd over replicates)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    return fig


def compute(ctx) -> None:
    """The toy tail chapter's results (:mod:`smp_book.pipeline`): every replicate (cached by config and
    replicate under ``.cache/toy_tail/``), the tables, the figure and the numbers the prose quotes."""
    from .pipeline import cached, code_hash

    cfg = ctx.config
    runs = [cached("toy_tail", {**cfg, "replicate": r, "code": code_hash(__name__)},
                   lambda r=r: run_replicate(cfg, r, progress=ctx.progress), enabled=ctx.use_cache)
            for r in range(cfg["replicates"])]
    summary = tables(runs)
    for name, table in summary.items():
        ctx.table(name, table)
    diverged = ctx.table("diverged", pd.DataFrame([r["diverged"] for r in runs]).rename_axis("replicate"))
    ctx.table("remaining", remaining_variance(cfg))
    ctx.table("ratios_shown", ratios_shown(summary["ratios_mean"], summary["ratios_std"]))
    agree = ctx.table("agreement", agreement(summary["ratios_mean"]))
    ctx.table("agreement_shown", agree.astype(object).where(agree.notna(), "none"))  # "none": not even from the last K0
    ctx.table("predictive", summary["scores_mean"][list(PREDICTIVE_COLUMNS)].rename(columns=PREDICTIVE_COLUMNS))
    ctx.figure("logit_variance_by_sampler", plot_logit_variance(
        summary["scores_mean"], summary["scores_std"].fillna(0), cfg["tail_from"]))

    # the recursion rows against the toy chapter's runs of the same replicates (same data, start, seeds)
    toy_rows = ctx.read("toy").table("scores_replicates")
    ours = summary["scores_replicates"].xs(RECURSION, level="sampler")
    common, columns = ours.index.intersection(toy_rows.index), list(toy_rows.columns)
    gap = (ours.loc[common, columns] - toy_rows.loc[common, columns]).abs().to_numpy().max() if len(common) else None
    stops = sorted(cfg["tail_from"])
    values = {"toy_rows_compared": len(common), "toy_gap": gap, "n_variants": len(agree), "tolerance": TOLERANCE,
              "first_stop": stops[0], "last_stop": stops[-1], "stops": ", ".join(map(str, stops)),
              "replicates": len(runs), "diverged": int(diverged.to_numpy().sum()),
              **{key: cfg[key] for key in ("n_train", "n_chains", "n_steps", "tail_scores")}}
    for name, methods in agreement_groups(agree, stops).items():
        values |= {f"agree_{name}": short_names(methods), f"n_agree_{name}": len(methods)}
    for name, value in values.items():
        ctx.value(name, value)
    ctx.record(seeds={f"replicate_{r['replicate']}": r["seeds"] for r in runs}, threads=runs[0]["threads"])
