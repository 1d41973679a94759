"""MNIST carried to the paper's K by the Gaussian tail (``notebooks/mnist_tail.md``; beyond the paper).

Replicate 0 of each variant of the MNIST chapter (its run, from the shared cache ``.cache/mnist/``)
is carried on by the Gaussian tail of :mod:`smp_core.tail` to the paper's ``K' = 10^6`` and to
infinity, and the tail is checked against the recursion on the same chains: stopped at ``K0``, the
tail from ``K0`` to ``K`` is compared with the recursion's own steps ``theta_K - theta_K0``
(:func:`mnist_tails`), as the toy tail chapter does (:mod:`smp_book.tail_study`). :func:`compute`
writes the chapter's results (:mod:`smp_book.pipeline`).
"""

from __future__ import annotations

import time
import warnings
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


def config(scale: str) -> dict[str, Any]:
    """The chapter's settings: the MNIST chapter's (``get_config("mnist", scale)``, whose runs it carries
    on) with the tail's own under ``"tail"`` (``get_config("mnist_tail", scale)``)."""
    return {**get_config("mnist", scale), "tail": get_config("mnist_tail", scale)}


def ratio_jackknife_se(hybrid: torch.Tensor, recursion: torch.Tensor, start: torch.Tensor) -> float:
    """Jackknife standard error over the chains (first axis) of :func:`_tail_ratio`: the ratio's
    Monte Carlo error from the chains of one run (:func:`smp_core.metrics.jackknife_se`)."""
    joined = torch.stack([hybrid.double(), recursion.double(), start.double()], dim=1)
    return metrics.jackknife_se(joined, lambda rows: _tail_ratio(rows[:, 0], rows[:, 1], rows[:, 2]))


def sampler_names(tail_cfg: dict[str, Any], n_steps: int) -> list[str]:
    """The rows of one MNIST variant: the check (hybrid from ``check_from`` to the run's ``K``), the
    recursion at ``K``, and the run carried on by the tail to ``tail_to`` and to infinity."""
    return [f"hybrid from {tail_cfg['check_from']:,} to {n_steps:,}", RECURSION,
            f"recursion + tail to {tail_cfg['tail_to']:,}", TO_INFINITY]


def _scores(theta: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, n_bins: int = 10) -> dict:
    """The MNIST chapter's scores and variances (as :func:`smp_book.mnist_study.evaluate`) of the
    finite rows of ``theta`` with their test logits ``(S, n, 10)``."""
    alive = torch.isfinite(theta).all(1)
    probs = torch.softmax(logits[alive].double(), dim=-1)
    return {**metrics.all_scores(probs, labels, n_bins=n_bins),
            "params_variance": metrics.params_variance(theta[alive].cpu()),
            "logits_variance": metrics.logits_variance(logits[alive])}


def mnist_tails(cfg: dict[str, Any], tail_cfg: dict[str, Any], theta_map: torch.Tensor, data: dict,
                device: torch.device | None = None, use_cache: bool = True, cache_root: str | Path = CACHE,
                progress: bool = False) -> dict[str, Any]:
    """Replicate 0 of each MNIST variant (the MNIST chapter's run, from its cache when there) carried
    on by the Gaussian tail, and a check of the tail against the recursion on the same chains.

    * ``recursion``: the MNIST chapter's run to ``K = cfg["n_steps"]`` (cache ``<cache_root>/mnist``);
    * ``recursion + tail to K'`` (``tail_cfg["tail_to"]``, the paper's ``10^6``) and to infinity;
    * the check: the same chains stopped at ``K0 = tail_cfg["check_from"]`` (a run with the same seed
      to ``K0``; its steps are the first ``K0`` of the chapter's run), then the tail from ``K0`` to
      ``K``. Its ratios to the recursion's own steps ``theta_K - theta_K0`` (parameters and test
      logits, as :func:`smp_book.tail_study.run_replicate`) tell how far the tail can be trusted
      for this variant.

    A cached chapter run made before :class:`~smp_core.recursion.SMPResult` kept its preconditioner
    state is run again (with a warning) and cached under ``mnist_tail/``; the chapter's cache is
    left as it is.

    Returns ``rows`` (one per variant and sampler: scores, variances, seconds), ``ratios`` (with the
    chains they use and jackknife standard errors over those chains) and ``diverged``.
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
    rows, ratios, diverged = [], [], {}
    for index, variant in enumerate(mr.study_variants(cfg)):
        key = mr.run_key(cfg, variant, 0, path)

        def chapter_run(variant=variant, index=index):
            return mr.run_variant(cfg, variant, theta_map, data, index, device, None, progress)

        res = cached(folder, key, chapter_run, root=cache_root, enabled=use_cache)
        if res.precond_state is None:  # cached before SMPResult kept its state: the same run again, kept apart
            warnings.warn(f"the cached {folder} run of {variant} has no preconditioner state (it predates "
                          "smp_core.tail): running it again, cached under mnist_tail/", stacklevel=2)
            res = cached("mnist_tail", {**key, "part": f"{variant} with its state"}, chapter_run, root=cache_root,
                         enabled=use_cache)
        short = cached("mnist_tail", {**mr.run_key(check_cfg, variant, 0, path), "part": f"{variant} check"},
                       lambda variant=variant, index=index: mr.run_variant(
                           check_cfg, variant, theta_map, data, index, device, None, progress),
                       root=cache_root, enabled=use_cache)
        samples, seconds = {RECURSION: res.theta}, {RECURSION: res.elapsed}
        for name, run, k_to in ((names[0], short, n_steps), (names[2], res, tail_cfg["tail_to"]),
                                (names[3], res, None)):
            seed = tail_seed(mr.smp_seed(cfg, index), f"{variant} to {k_to}", run.config["n_steps"])
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # diverged chains are counted below
                samples[name] = add_gaussian_tail(run, lenet5().to(device), "categorical", x_train, k_to=k_to,
                                                  n_scores=tail_cfg["tail_scores"], seed=seed)
            seconds[name] = run.elapsed + time.perf_counter() - started
        diverged[f"SMP-{variant}"] = res.n_diverged
        logits = {name: mr.logits_on_test_set(torch.nan_to_num(samples[name]), data, device) for name in names}
        for name in names:
            rows.append({"method": f"SMP-{variant}", "sampler": name,
                         **_scores(samples[name].cpu(), logits[name], labels), "seconds": seconds[name]})
        # chains finite at K0 and at K in both samplers (a chain that diverges after K0 is left out of both)
        keep = (torch.isfinite(res.theta).all(1) & torch.isfinite(samples[names[0]]).all(1)
                & torch.isfinite(short.theta).all(1)).cpu()
        start = short.theta.cpu()[keep]
        start_logits = mr.logits_on_test_set(start, data, device)
        pairs = {"params": (samples[names[0]].cpu()[keep], res.theta.cpu()[keep], start),
                 "logits": (logits[names[0]][keep], logits[RECURSION][keep], start_logits)}
        row = {"method": f"SMP-{variant}", "tail_from": check_from, "chains": int(keep.sum())}
        for space, (hybrid, recursion, begin) in pairs.items():
            row[space] = _tail_ratio(hybrid, recursion, begin)
            row[f"{space}_se"] = ratio_jackknife_se(hybrid, recursion, begin)
        ratios.append(row)
    return {"rows": rows, "ratios": ratios, "diverged": diverged, "seeds": {
        v: mr.smp_seed(cfg, i) for i, v in enumerate(mr.study_variants(cfg))}}


def check_table(ratios: pd.DataFrame, tolerance: float = TOLERANCE) -> pd.DataFrame:
    """The check per variant: the tail ratios from ``K0`` with their jackknife errors, and whether the
    logit ratio is within a factor ``tolerance`` of one (the toy chapter's criterion)."""
    check = ratios.droplevel("tail_from").rename(columns={
        "params": "ratio (params)", "params_se": "se (params)", "logits": "ratio (logits)", "logits_se": "se (logits)"})
    check[f"within {tolerance}"] = np.abs(np.log(check["ratio (logits)"])) <= np.log(tolerance)
    return check


SHOWN = {"nll": "NLL", "ece": "ECE", "mutual_info": "MI", "logits_variance": "logit variance", "accuracy": "accuracy"}


def beside_paper(scores: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    """Per variant: the paper's row at ``K = 10^6`` (Tables ex2_scores and ex2_variances), then the
    recursion and the tail rows of ``names`` (all but the check's)."""
    paper = paper_table("ex2_scores").join(paper_table("ex2_variances"))
    rows = []
    for method in scores.index.get_level_values("method").unique():
        rows.append({"method": method, "sampler": PAPER_ROW, **{label: paper.loc[method, col]
                                                               for col, label in SHOWN.items()}})
        for name in names[1:]:
            rows.append({"method": method, "sampler": name,
                         **{label: scores.loc[(method, name), col] for col, label in SHOWN.items()}})
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
    """The MNIST tail chapter's results (:mod:`smp_book.pipeline`): the MAP and the MNIST chapter's runs
    (from the shared caches), the tails and the check (:func:`mnist_tails`), the tables beside the
    paper and the numbers the prose quotes."""
    settings = dict(ctx.config)
    tail_cfg = settings.pop("tail")
    cfg = settings  # the MNIST chapter's settings, so that its runs are found in the cache
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
    diverged = pd.Series(result["diverged"], name="diverged chains").to_frame()
    diverged.index.name = "method"
    ctx.table("diverged", diverged)

    n_obs, k, k0, k_to = cfg["n_train"], cfg["n_steps"], tail_cfg["check_from"], tail_cfg["tail_to"]
    within = check[f"within {TOLERANCE}"]
    trusted, others = list(check.index[within]), list(check.index[~within])
    ctx.value("trusted", ", ".join(trusted) or "none")
    ctx.value("others", ", ".join(others) or "none")
    ctx.value("n_trusted", len(trusted))
    ctx.value("n_variants", len(check))
    ctx.value("verdict", verdict(trusted, others, {m: scores.loc[(m, names[2]), "mutual_info"] for m in trusted},
                                 paper_table("ex2_scores")["mutual_info"], k_to))
    ctx.value("tolerance", TOLERANCE)
    ctx.value("device", str(device))
    ctx.value("n_train", n_obs)
    ctx.value("n_chains", cfg["n_chains"])
    ctx.value("n_steps", k)
    ctx.value("check_from", k0)
    ctx.value("tail_to", k_to)
    ctx.value("tail_scores", tail_cfg["tail_scores"])
    ctx.value("diverged", int(diverged.to_numpy().sum()))
    ctx.value("left_after_check", residual_variance_ratio(n_obs, k0))
    ctx.value("left_after_k", residual_variance_ratio(n_obs, k))
    ctx.value("left_after_tail_to", residual_variance_ratio(n_obs, k_to))
    ctx.value("v_ratio", tail_variance(n_obs, k, k_to) / tail_variance(n_obs, k0, k))
    ctx.record(seeds=result["seeds"], device=str(device), data=provenance["source"])
