"""The Gaussian-tail study (``notebooks/toy_tail.md``; beyond the paper): hybrid sampling against the recursion.

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

import hashlib
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

from .config import TOY_VARIANTS, toy_tau
from .toy import make_toy_data
from .toy_study import one_class_brier, replicate_seeds, toy_preconditioner

CHECK_EVERY = 50  # run_smp's default check_every: a stop elsewhere would move the divergence checks
RECURSION, TO_INFINITY = "recursion", "recursion + tail to inf"
SCORE_COLUMNS = ["accuracy", "brier", "nll", "ece", "mutual_info", "logits_variance", "params_variance", "seconds"]


def tail_seed(smp_seed: int, variant: str, k_from: int) -> int:
    """The seed of one tail draw: a hash of the replicate's SMP seed, the variant and ``K0``, so that no
    two tails share random numbers (nor any other seed of the toy study, which are small integers)."""
    digest = hashlib.sha256(f"{smp_seed}/tail/{variant}/{k_from}".encode()).hexdigest()
    return int(digest[:15], 16)


def hybrid_name(k_from: int) -> str:
    return f"hybrid from {k_from}"


def sampler_names(tail_from) -> list[str]:
    """The rows of one variant, in order: the hybrids (ascending K0), the recursion, the tail to infinity."""
    return [hybrid_name(k) for k in sorted(tail_from)] + [RECURSION, TO_INFINITY]


def _logits(theta: torch.Tensor, x_test: torch.Tensor) -> torch.Tensor:
    """``(S, n)`` test logits of the toy MLP; NaN rows (diverged chains) give NaN rows."""
    return predict(as_chain_model(toy_mlp()), theta.float(), x_test)[..., 0]


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


def _tail_ratio(hybrid: torch.Tensor, recursion: torch.Tensor, start: torch.Tensor) -> float:
    """``sum Var(hybrid - start) / sum Var(recursion - start)`` over the columns (chains in rows)."""
    return float((hybrid - start).var(0).sum() / (recursion - start).var(0).sum())


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
                              tau=toy_tau(variant), n_steps=k, n_chains=cfg["n_chains"], seed=seeds["smp"] + index,
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


def agreement(ratios_mean: pd.DataFrame, tolerance: float = 1.25) -> pd.DataFrame:
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


# ---------------------------------------------------------------------------------------------
# MNIST (notebooks/mnist_tail.md): the MNIST chapter's runs carried on by the tail
# ---------------------------------------------------------------------------------------------


def ratio_jackknife_se(hybrid: torch.Tensor, recursion: torch.Tensor, start: torch.Tensor) -> float:
    """Jackknife standard error over the chains (first axis) of :func:`_tail_ratio`: the ratio's
    Monte Carlo error from the chains of one run (:func:`smp_core.metrics.jackknife_se`)."""
    joined = torch.stack([hybrid.double(), recursion.double(), start.double()], dim=1)
    return metrics.jackknife_se(joined, lambda rows: _tail_ratio(rows[:, 0], rows[:, 1], rows[:, 2]))


def mnist_sampler_names(tail_cfg: dict[str, Any], n_steps: int) -> list[str]:
    """The rows of one MNIST variant: the check (hybrid from ``check_from`` to the run's ``K``), the
    recursion at ``K``, and the run carried on by the tail to ``tail_to`` and to infinity."""
    return [f"hybrid from {tail_cfg['check_from']:,} to {n_steps:,}", RECURSION,
            f"recursion + tail to {tail_cfg['tail_to']:,}", TO_INFINITY]


def _mnist_scores(theta: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, n_bins: int = 10) -> dict:
    """The MNIST chapter's scores and variances (as :func:`smp_book.mnist_study.evaluate`) of the
    finite rows of ``theta`` with their test logits ``(S, n, 10)``."""
    alive = torch.isfinite(theta).all(1)
    probs = torch.softmax(logits[alive].double(), dim=-1)
    return {**metrics.all_scores(probs, labels, n_bins=n_bins),
            "params_variance": metrics.params_variance(theta[alive].cpu()),
            "logits_variance": metrics.logits_variance(logits[alive])}


def mnist_tails(cfg: dict[str, Any], tail_cfg: dict[str, Any], theta_map: torch.Tensor, data: dict,
                device: torch.device | None = None, use_cache: bool = True, cache_root: str = ".cache",
                progress: bool = False) -> dict[str, Any]:
    """Replicate 0 of each MNIST variant (the MNIST chapter's run, from its cache when there) carried
    on by the Gaussian tail, and a check of the tail against the recursion on the same chains.

    * ``recursion``: the MNIST chapter's run to ``K = cfg["n_steps"]`` (cache ``<cache_root>/mnist``);
    * ``recursion + tail to K'`` (``tail_cfg["tail_to"]``, the paper's ``10^6``) and to infinity;
    * the check: the same chains stopped at ``K0 = tail_cfg["check_from"]`` (a run with the same seed
      to ``K0``; its steps are the first ``K0`` of the chapter's run), then the tail from ``K0`` to
      ``K``. Its ratios to the recursion's own steps ``theta_K - theta_K0`` (parameters and test
      logits, as :func:`run_replicate`) tell how far the tail can be trusted for this variant.

    A cached chapter run made before :class:`~smp_core.recursion.SMPResult` kept its preconditioner
    state is run again (with a warning) and cached under ``mnist_tail/``; the chapter's cache is
    left as it is.

    Returns ``rows`` (one per variant and sampler: scores, variances, seconds), ``ratios`` (with the
    chains they use and jackknife standard errors over those chains) and ``diverged``.
    """
    from smp_core.models import lenet5

    from . import mnist_study as ms
    from .results import cached

    device = device or ms.default_device()
    n_steps, check_from = cfg["n_steps"], tail_cfg["check_from"]
    if not 0 < check_from < n_steps or check_from % CHECK_EVERY:
        raise ValueError(f"check_from must be a multiple of {CHECK_EVERY} (a divergence check, so that the "
                         f"checks are the chapter run's) in (0, K = {n_steps}), got {check_from}")
    x_train, labels = data["train"][0].to(device), data["test"][1]
    path, folder = ms.smp_path(device), cfg.get("study", "mnist")
    names = mnist_sampler_names(tail_cfg, n_steps)
    check_cfg = {**cfg, "n_steps": check_from, "checkpoint_every": None}
    rows, ratios, diverged = [], [], {}
    for index, variant in enumerate(ms.study_variants(cfg)):
        key = ms.run_key(cfg, variant, 0, path)

        def chapter_run(variant=variant, index=index):
            return ms.run_variant(cfg, variant, theta_map, data, index, device, None, progress)

        res = cached(folder, key, chapter_run, root=cache_root, enabled=use_cache)
        if res.precond_state is None:  # cached before SMPResult kept its state: the same run again, kept apart
            warnings.warn(f"the cached {folder} run of {variant} has no preconditioner state (it predates "
                          "smp_core.tail): running it again, cached under mnist_tail/", stacklevel=2)
            res = cached("mnist_tail", {**key, "part": f"{variant} with its state"}, chapter_run, root=cache_root,
                         enabled=use_cache)
        short = cached("mnist_tail", {**ms.run_key(check_cfg, variant, 0, path), "part": f"{variant} check"},
                       lambda variant=variant, index=index: ms.run_variant(
                           check_cfg, variant, theta_map, data, index, device, None, progress),
                       root=cache_root, enabled=use_cache)
        samples, seconds = {RECURSION: res.theta}, {RECURSION: res.elapsed}
        for name, run, k_to in ((names[0], short, n_steps), (names[2], res, tail_cfg["tail_to"]),
                                (names[3], res, None)):
            seed = tail_seed(ms.smp_seed(cfg, index), f"{variant} to {k_to}", run.config["n_steps"])
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # diverged chains are counted below
                samples[name] = add_gaussian_tail(run, lenet5().to(device), "categorical", x_train, k_to=k_to,
                                                  n_scores=tail_cfg["tail_scores"], seed=seed)
            seconds[name] = run.elapsed + time.perf_counter() - started
        diverged[f"SMP-{variant}"] = res.n_diverged
        logits = {name: ms.logits_on_test_set(torch.nan_to_num(samples[name]), data, device) for name in names}
        for name in names:
            rows.append({"method": f"SMP-{variant}", "sampler": name,
                         **_mnist_scores(samples[name].cpu(), logits[name], labels), "seconds": seconds[name]})
        # chains finite at K0 and at K in both samplers (a chain that diverges after K0 is left out of both)
        keep = (torch.isfinite(res.theta).all(1) & torch.isfinite(samples[names[0]]).all(1)
                & torch.isfinite(short.theta).all(1)).cpu()
        start = short.theta.cpu()[keep]
        start_logits = ms.logits_on_test_set(start, data, device)
        pairs = {"params": (samples[names[0]].cpu()[keep], res.theta.cpu()[keep], start),
                 "logits": (logits[names[0]][keep], logits[RECURSION][keep], start_logits)}
        row = {"method": f"SMP-{variant}", "tail_from": check_from, "chains": int(keep.sum())}
        for space, (hybrid, recursion, begin) in pairs.items():
            row[space] = _tail_ratio(hybrid, recursion, begin)
            row[f"{space}_se"] = ratio_jackknife_se(hybrid, recursion, begin)
        ratios.append(row)
    return {"rows": rows, "ratios": ratios, "diverged": diverged, "seeds": {
        v: ms.smp_seed(cfg, i) for i, v in enumerate(ms.study_variants(cfg))}}
