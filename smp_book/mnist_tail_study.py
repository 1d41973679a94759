"""MNIST carried to the paper's K by the Gaussian tail (``notebooks/mnist_tail.md``; beyond the paper).

Replicate 0 of each variant of the MNIST chapter (its run, from the shared cache ``.cache/mnist/``) is carried
on by the Gaussian tail of :mod:`smp_core.tail` to the paper's ``K' = 10^6`` and to infinity, and the tail is
checked against the recursion on the same chains: stopped at ``K0``, the tail from ``K0`` to ``K`` is compared
with the recursion's own steps ``theta_K - theta_K0`` (:func:`mnist_tails`), as the toy tail chapter does
(:mod:`smp_book.tail_study`). :func:`compute` writes the chapter's results (:mod:`smp_book.pipeline`).
"""

from __future__ import annotations

import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from smp_core import metrics
from smp_core.models import lenet5
from smp_core.recursion import residual_variance_ratio
from smp_core.tail import add_gaussian_tail, tail_variance

from . import mnist_runs as mr
from .config import get_config
from .paper import paper_table
from .pipeline import CACHE, cached
from .tails import CHECK_EVERY, RECURSION, TO_INFINITY, TOLERANCE, _tail_ratio, tail_seed

PAPER_ROW = "paper (K = 10^6)"
SHOWN = {"nll": "NLL", "ece": "ECE", "mutual_info": "MI", "logits_variance": "logit variance", "accuracy": "accuracy"}


def config(scale: str) -> dict[str, Any]:
    """The MNIST chapter's settings (``get_config("mnist", scale)``, whose runs it carries on) with the
    tail's own under ``"tail"`` (``get_config("mnist_tail", scale)``)."""
    return {**get_config("mnist", scale), "tail": get_config("mnist_tail", scale)}


def sampler_names(tail_cfg: dict[str, Any], n_steps: int) -> list[str]:
    """The rows of one MNIST variant: the check (hybrid from ``check_from`` to the run's ``K``), the
    recursion at ``K``, and the run carried on by the tail to ``tail_to`` and to infinity."""
    return [f"hybrid from {tail_cfg['check_from']:,} to {n_steps:,}", RECURSION,
            f"recursion + tail to {tail_cfg['tail_to']:,}", TO_INFINITY]


def mnist_tails(cfg: dict[str, Any], tail_cfg: dict[str, Any], theta_map: torch.Tensor, data: dict,
                device: torch.device | None = None, use_cache: bool = True, cache_root: str | Path = CACHE,
                progress: bool = False) -> dict[str, Any]:
    """Replicate 0 of each MNIST variant carried on by the Gaussian tail, and a check of the tail.

    * ``recursion``: the MNIST chapter's run to ``K = cfg["n_steps"]`` (cache ``<cache_root>/mnist``);
    * ``recursion + tail to K'`` (``tail_cfg["tail_to"]``, the paper's ``10^6``) and to infinity;
    * the check: the same chains stopped at ``K0 = tail_cfg["check_from"]`` (a run with the same seed), then
      the tail to ``K``, against the recursion's own steps (parameters and test logits, as
      :func:`smp_book.tail_study.run_replicate`): how far the tail can be trusted for this variant.

    A cached chapter run without preconditioner state (older than :class:`~smp_core.recursion.SMPResult`
    keeping it) is run again, with a warning, under ``mnist_tail/``; the chapter's cache is left as it is.

    Returns ``rows`` (per variant and sampler: scores and variances of the finite chains, seconds), ``ratios``
    (with the chains they use and jackknife standard errors over them), ``diverged`` and ``seeds``.
    """
    device = device or mr.default_device()
    n_steps, check_from = cfg["n_steps"], tail_cfg["check_from"]
    if not 0 < check_from < n_steps or check_from % CHECK_EVERY:
        raise ValueError(f"check_from must be a multiple of {CHECK_EVERY} (a divergence check, so that the "
                         f"checks are the chapter run's) in (0, K = {n_steps}), got {check_from}")
    x_train, labels = data["train"][0].to(device), data["test"][1]
    path, folder = mr.smp_path(device), cfg.get("study", "mnist")
    names = sampler_names(tail_cfg, n_steps)
    check_cfg = {**cfg, "n_steps": check_from, "checkpoint_every": None}
    keep = partial(cached, root=cache_root, enabled=use_cache)
    rows, ratios, diverged, seeds = [], [], {}, {}
    for index, variant in enumerate(mr.study_variants(cfg)):
        key, seeds[variant], method = mr.run_key(cfg, variant, 0, path), mr.smp_seed(cfg, index), f"SMP-{variant}"
        run_to = partial(partial, mr.run_variant, variant=variant, theta0=theta_map, data=data, index=index,
                         device=device, checkpoint=None, progress=progress)  # run_to(settings)(): the chapter's run
        res = keep(folder, key, run_to(cfg))
        if res.precond_state is None:
            warnings.warn(f"the cached {folder} run of {variant} has no preconditioner state (it predates "
                          "smp_core.tail): running it again, cached under mnist_tail/", stacklevel=2)
            res = keep("mnist_tail", {**key, "part": f"{variant} with its state"}, run_to(cfg))
        short = keep("mnist_tail", {**mr.run_key(check_cfg, variant, 0, path), "part": f"{variant} check"},
                     run_to(check_cfg))
        samples, seconds = {RECURSION: res.theta}, {RECURSION: res.elapsed}
        for name, run, k_to in ((names[0], short, n_steps), (names[2], res, tail_cfg["tail_to"]),
                                (names[3], res, None)):
            seed = tail_seed(seeds[variant], f"{variant} to {k_to}", run.config["n_steps"])
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # diverged chains are counted below
                samples[name] = add_gaussian_tail(run, lenet5().to(device), "categorical", x_train, k_to=k_to,
                                                  n_scores=tail_cfg["tail_scores"], seed=seed)
            seconds[name] = run.elapsed + time.perf_counter() - started
        diverged[method] = res.n_diverged
        logits = {name: mr.logits_on_test_set(torch.nan_to_num(samples[name]), data, device) for name in names}
        for name in names:  # scored as smp_book.mnist_study.evaluate scores them
            theta = samples[name].cpu()
            alive = torch.isfinite(theta).all(1)
            probs = torch.softmax(logits[name][alive].double(), dim=-1)
            rows.append({"method": method, "sampler": name, **metrics.all_scores(probs, labels, n_bins=10),
                         "params_variance": metrics.params_variance(theta[alive]),
                         "logits_variance": metrics.logits_variance(logits[name][alive]), "seconds": seconds[name]})
        # chains finite at K0 and at K in both samplers (a chain that diverges after K0 is left out of both)
        kept = (torch.isfinite(res.theta).all(1) & torch.isfinite(samples[names[0]]).all(1)
                & torch.isfinite(short.theta).all(1)).cpu()
        start = short.theta.cpu()[kept]
        pairs = {"params": (samples[names[0]].cpu()[kept], res.theta.cpu()[kept], start),
                 "logits": (logits[names[0]][kept], logits[RECURSION][kept],
                            mr.logits_on_test_set(start, data, device))}
        row = {"method": method, "tail_from": check_from, "chains": int(kept.sum())}
        for space, triple in pairs.items():  # the ratio and its jackknife error over the chains
            row[space] = _tail_ratio(*triple)
            row[f"{space}_se"] = metrics.jackknife_se(torch.stack([t.double() for t in triple], dim=1),
                                                      lambda r: _tail_ratio(r[:, 0], r[:, 1], r[:, 2]))
        ratios.append(row)
    return {"rows": rows, "ratios": ratios, "diverged": diverged, "seeds": seeds}


def check_table(ratios: pd.DataFrame, tolerance: float = TOLERANCE) -> pd.DataFrame:
    """The check per variant: the tail ratios from ``K0`` with their jackknife errors, and whether the
    logit ratio is within a factor ``tolerance`` of one (the toy chapter's criterion)."""
    check = ratios.droplevel("tail_from").rename(columns={
        "params": "ratio (params)", "params_se": "se (params)", "logits": "ratio (logits)", "logits_se": "se (logits)"})
    check[f"within {tolerance}"] = np.abs(np.log(check["ratio (logits)"])) <= np.log(tolerance)
    return check


def beside_paper(scores: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    """Per variant: the paper's row at ``K = 10^6`` (Tables ex2_scores and ex2_variances), then the
    recursion and the tail rows of ``names`` (all but the check's)."""
    paper = paper_table("ex2_scores").join(paper_table("ex2_variances"))
    rows = []
    for method in scores.index.get_level_values("method").unique():
        for sampler, table, at in [(PAPER_ROW, paper, method)] + [(n, scores, (method, n)) for n in names[1:]]:
            rows.append({"method": method, "sampler": sampler, **{label: table.loc[at, col]
                                                                 for col, label in SHOWN.items()}})
    return pd.DataFrame(rows).set_index(["method", "sampler"])


def verdict(trusted: list[str], others: list[str], mi: dict[str, float], paper_mi: pd.Series, k_to: int) -> str:
    """The chapter's answer after the count of variants whose check agrees: for those, their mutual
    information carried on by the tail to ``k_to`` (``mi``) beside the paper's; the others' tail rows
    are not to be trusted."""
    if not trusted:
        return "So no variant's tail rows are to be trusted at this scale."
    text = (f"For those, the mutual information carried on by the tail to {k_to:,} steps is "
            + "; ".join(f"{m} {mi[m]:.3g} (paper {paper_mi[m]:.3g})" for m in trusted) + ".")
    if others:
        text += f" The tail rows of the others ({', '.join(others)}) are not to be trusted."
    return text


def compute(ctx) -> None:
    """The chapter's results (:mod:`smp_book.pipeline`): the MAP and the MNIST chapter's runs (from the shared
    caches), the tails and the check (:func:`mnist_tails`), the tables beside the paper and the prose's numbers."""
    cfg = dict(ctx.config)  # the MNIST chapter's settings, so that its runs are found in the cache
    tail_cfg = cfg.pop("tail")
    device = mr.default_device()
    data, provenance = mr.load_data(cfg)
    theta_map = mr.chapter_map(cfg, data, device, ctx.use_cache, progress=ctx.progress)["theta"]
    result = mnist_tails(cfg, tail_cfg, theta_map, data, device, ctx.use_cache, progress=ctx.progress)
    names = sampler_names(tail_cfg, cfg["n_steps"])
    scores = ctx.table("scores", pd.DataFrame(result["rows"]).set_index(["method", "sampler"]))
    ratios = ctx.table("ratios", pd.DataFrame(result["ratios"]).set_index(["method", "tail_from"]))
    check = ctx.table("check", check_table(ratios))
    ctx.table("beside_paper", beside_paper(scores, names))
    seconds = scores["seconds"].unstack("sampler").reindex(check.index)[names]
    seconds[PAPER_ROW] = paper_table("ex2_elapsed").iloc[:, 0].reindex(seconds.index)
    ctx.table("seconds", seconds)
    diverged = ctx.table("diverged", pd.Series(result["diverged"], name="diverged chains").rename_axis("method")
                         .to_frame())

    n_obs, k, k0, k_to = cfg["n_train"], cfg["n_steps"], tail_cfg["check_from"], tail_cfg["tail_to"]
    within = check[f"within {TOLERANCE}"]
    trusted, others = list(check.index[within]), list(check.index[~within])
    mi = {m: scores.loc[(m, names[2]), "mutual_info"] for m in trusted}
    for name, value in {
        "trusted": ", ".join(trusted) or "none", "others": ", ".join(others) or "none",
        "n_trusted": len(trusted), "n_variants": len(check),
        "verdict": verdict(trusted, others, mi, paper_table("ex2_scores")["mutual_info"], k_to),
        "tolerance": TOLERANCE, "device": str(device), "n_train": n_obs, "n_chains": cfg["n_chains"],
        "n_steps": k, "check_from": k0, "tail_to": k_to, "tail_scores": tail_cfg["tail_scores"],
        "diverged": int(diverged.to_numpy().sum()), "left_after_check": residual_variance_ratio(n_obs, k0),
        "left_after_k": residual_variance_ratio(n_obs, k), "left_after_tail_to": residual_variance_ratio(n_obs, k_to),
        "v_ratio": tail_variance(n_obs, k, k_to) / tail_variance(n_obs, k0, k),
    }.items():
        ctx.value(name, value)
    ctx.record(seeds=result["seeds"], device=str(device), data=provenance["source"])
