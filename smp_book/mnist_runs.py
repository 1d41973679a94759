"""The MNIST runs the chapters share: the data, the MAP LeNet-5, one SMP run per variant, its evaluation.

The MNIST chapter (:mod:`smp_book.mnist_study`) and the chapters that build on it (seeds, growth, KFAC,
tail, baselines, last layer) call these; each expensive leaf (a MAP fit, one SMP run) is cached by
:func:`smp_book.pipeline.cached`. Runs on CUDA when a GPU is present and on the CPU otherwise.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from smp_core import metrics
from smp_core.fisher import estimate_fisher, kronecker_layers
from smp_core.fused import FusedSequentialChainModel
from smp_core.likelihoods import Categorical
from smp_core.memory import retain_freed_memory
from smp_core.models import as_chain_model, lenet5, predict
from smp_core.preconditioners import ema_refresh_applies, preconditioner_from_name
from smp_core.recursion import Fisher, residual_variance_ratio, run_smp

from .config import MNIST_VARIANTS
from .mnist import mnist_tensors
from .pipeline import CACHE, DATA, RESULTS, cached, code_hash, config_key, stale_reason, study_config
from .results import Results
from .summaries import summarise_replicates

INPUT_SHAPE = (1, 28, 28)
FULL_SIZES = (54_000, 6_000, 10_000)  # train, validation, test: the paper's split of MNIST
DIAGONAL_METHODS = tuple(f"SMP-{v}" for v in MNIST_VARIANTS if v != "none")
TRIM = 0.1  # the share of chains :func:`mutual_information_tail` trims by default
# Where the paper-scale results of this study are, once a run at the paper scale has written them
# (``python -m smp_book.reproduce --scale paper --only mnist`` and its folder copied here).
PAPER_RESULTS = RESULTS / "paper" / "mnist"
_categorical = Categorical  # the likelihood of the empirical Fisher (smp_book.mnist_kfac_study's too)


def map_seed(cfg: dict[str, Any], member: int) -> int:
    """The seed of MAP number ``member`` of a set trained with the same settings: ``seed + 100 member``
    (MAP 0 is the study's own; the MNIST baselines chapter's ensemble and the MAP-seeds chapter use
    these, so they share the MAPs)."""
    return cfg["seed"] + 100 * member


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_data(cfg: dict[str, Any], data_dir: str | Path = DATA) -> tuple[dict, dict[str, Any]]:
    """The three MNIST sets at the sizes of ``cfg`` (:func:`smp_book.mnist.mnist_tensors`, split by
    ``cfg["split_seed"]``): at the paper's sizes the whole sets, the test set in its official order;
    at smaller ones (the ``ci`` scale) the first entries of the seeded orders. Returns ``(data, provenance)``."""
    sizes = (cfg["n_train"], cfg["n_val"], cfg["n_test"])
    return mnist_tensors(data_dir, seed=cfg["split_seed"], subset=None if sizes == FULL_SIZES else sizes)


def method_names(variants=MNIST_VARIANTS) -> list[str]:
    return ["MAP"] + [f"SMP-{v}" for v in variants]


def train_map(cfg: dict[str, Any], data: dict, device: torch.device | None = None,
              progress: bool = True) -> dict[str, Any]:
    """MAP estimate (Section 3.3.2): NLL + L2 weight decay, Adam, batch 48, lr 1e-3, a fixed number of epochs.

    Weight decay is coupled L2 (``torch.optim.Adam(weight_decay=...)``, the gradient of ``wd/2 ||theta||^2``
    added to that of the mean NLL of the batch), as Flux's ``OptimiserChain(WeightDecay, Adam)``. Returns the
    flat parameters, the validation loss and accuracy per epoch and the training time.

    ``cfg["map_dropout"] = p > 0`` (beyond the paper: the MC dropout baseline) trains ``lenet5(dropout=p)``
    instead, with the same seed, initial weights and minibatch order; the validation loss is then that of
    the network in eval mode (dropout off). Without the key, the paper's network.
    """
    device = device or default_device()
    if device.type == "cpu":
        retain_freed_memory()
    torch.manual_seed(cfg["seed"])
    net = lenet5(cfg.get("map_dropout", 0.0)).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=cfg["map_lr"], weight_decay=cfg["map_weight_decay"])
    x, y = (t.to(device) for t in data["train"])
    xv, yv = (t.to(device) for t in data["val"])
    gen = torch.Generator().manual_seed(cfg["seed"])
    history, started = [], time.perf_counter()
    for epoch in tqdm(range(cfg["map_epochs"]), desc="MAP epochs", disable=not progress):
        net.train()
        order = torch.randperm(len(y), generator=gen).to(device)
        total = 0.0
        for idx in order.split(cfg["map_batch"]):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        net.eval()
        with torch.no_grad():
            logits = torch.cat([net(b) for b in xv.split(2000)])
            history.append({"epoch": epoch + 1, "train_loss": total / len(y),
                            "val_loss": float(F.cross_entropy(logits, yv)),
                            "val_accuracy": float((logits.argmax(1) == yv).float().mean())})
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).cpu()
    return {"theta": theta, "history": pd.DataFrame(history), "seconds": time.perf_counter() - started}


def map_key(cfg: dict[str, Any]) -> dict[str, Any]:
    """The cache key of the MAP fit: the data sizes and split, the seed, the ``map_*`` settings."""
    return {**{k: cfg[k] for k in ("n_train", "n_val", "n_test", "split_seed", "seed") if k in cfg},
            **{k: v for k, v in cfg.items() if k.startswith("map_")}, "part": "map", "code": code_hash(__name__)}


def fit_map(cfg: dict[str, Any], data: dict, device: torch.device | None = None, use_cache: bool = True,
            progress: bool = True, cache_root: str | Path = CACHE) -> dict[str, Any]:
    """:func:`train_map`, reused from ``<cache_root>/mnist/`` by :func:`map_key` (shared by the MNIST chapters)."""
    return cached("mnist", map_key(cfg), lambda: train_map(cfg, data, device, progress), root=cache_root,
                  enabled=use_cache)


def chapter_map(cfg: dict[str, Any], data: dict, device: torch.device | None = None, use_cache: bool = True,
                progress: bool = True, cache_root: str | Path = CACHE) -> dict[str, Any]:
    """The MAP the MNIST chapters start from: :func:`fit_map` for ``cfg["seed"]`` or, where
    ``cfg["select_map_from_seeds"]`` lists seeds (the paper scale), the fit among theirs with the lowest
    validation loss after the last epoch, a rule that looks at no SMP result. Each candidate is fitted as
    for its own seed (so shared with the MAP-seeds and baselines chapters). Returns :func:`fit_map`'s dict
    with ``seed`` (the MAP's) and ``candidates`` (``seed`` and ``val_loss`` per candidate; one row
    without a choice)."""
    seeds = cfg.get("select_map_from_seeds") or [cfg["seed"]]
    if len(set(seeds)) != len(seeds) or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ValueError(f"select_map_from_seeds must list distinct integer seeds, got {seeds!r}")
    fits = [fit_map({**cfg, "seed": seed}, data, device, use_cache=use_cache, progress=progress,
                    cache_root=cache_root) for seed in seeds]
    candidates = pd.DataFrame({"seed": seeds, "val_loss": [float(f["history"]["val_loss"].iloc[-1]) for f in fits]})
    if not np.isfinite(candidates["val_loss"]).all():
        raise ValueError(f"a MAP to choose from has a non-finite validation loss:\n{candidates}")
    best = int(candidates["val_loss"].idxmin())
    return {**fits[best], "seed": seeds[best], "candidates": candidates}


def validation_fisher_diagonal(theta0: torch.Tensor, data: dict, device: torch.device | None = None) -> torch.Tensor:
    """The diagonal of the empirical Fisher at ``theta0`` over the whole validation set (the fixed
    preconditioners' data; the periodic strategy uses its first ``n_fisher_periodic`` images), Section
    3.3.3: the mean squared score of the observed labels, as a ``(d,)`` tensor on the CPU."""
    device = device or default_device()
    model = as_chain_model(lenet5().to(device), INPUT_SHAPE)
    xv, yv = (t.to(device) for t in data["val"])
    (diag,) = estimate_fisher(model, Categorical(), theta0.to(device)[None], xv, yv, kind="empirical", structure="diag")
    return diag.reshape(-1).cpu()


def fisher_zero_mask(theta0: torch.Tensor, data: dict, device: torch.device | None = None) -> torch.Tensor:
    """Where :func:`validation_fisher_diagonal` is exactly zero (a ``(d,)`` boolean tensor on the CPU)."""
    return validation_fisher_diagonal(theta0, data, device) == 0


def fisher_zero_fraction(theta0: torch.Tensor, data: dict, device: torch.device | None = None) -> float:
    """The fraction of exact zeros of :func:`validation_fisher_diagonal` (:func:`fisher_zero_mask`)."""
    return float(fisher_zero_mask(theta0, data, device).double().mean())


def smp_path(device: torch.device) -> str:
    """How the recursion runs the LeNet-5 step on ``device`` by default. It decides the order of the
    random numbers (step blocks draw theirs per block), so it belongs in every SMP cache key."""
    if torch.device(device).type == "cuda":
        return "blocks of steps replayed as CUDA graphs"
    if isinstance(as_chain_model(lenet5(), INPUT_SHAPE), FusedSequentialChainModel):
        return "blocks of steps, each whole step in the compiled CPU kernel"
    return "batched torch model, step by step"


def study_variants(cfg: dict[str, Any]) -> list[str]:
    """The SMP variants of a study: ``cfg["variants"]`` (the KFAC study) or the paper's four."""
    return list(cfg.get("variants", MNIST_VARIANTS))


def variant_tau(cfg: dict[str, Any], variant: str) -> float:
    """tau of ``variant``: ``cfg["tau"]`` (the paper's unless a chapter's parameters change it)."""
    if variant not in cfg["tau"]:
        raise KeyError(f"no tau for the MNIST variant {variant!r}; known: {sorted(cfg['tau'])}")
    return cfg["tau"][variant]


def variant_index(cfg: dict[str, Any], variant: str) -> int:
    """The number of ``variant`` in its seed (:func:`smp_seed`): its place among the paper's four, so that a
    chapter run on some of them draws the same numbers for each, else its place in :func:`study_variants`."""
    return MNIST_VARIANTS.index(variant) if variant in MNIST_VARIANTS else study_variants(cfg).index(variant)


def smp_seed(cfg: dict[str, Any], index: int, replicate: int = 0) -> int:
    """The seed of SMP variant number ``index`` (:func:`variant_index`) in one replicate: ``seed + 10 + index``
    in replicate 0 (the study's single run), plus ``1000 r`` in replicate ``r``, as the toy study's replicates.
    A study with a ``seed_offset`` (the KFAC one) numbers its variants after the paper's four, so that it
    draws other random numbers."""
    return cfg["seed"] + 10 + cfg.get("seed_offset", 0) + index + 1000 * replicate


def run_key(cfg: dict[str, Any], variant: str, replicate: int, path: str) -> dict[str, Any]:
    """The cache key of one SMP run: its scale's settings, the variant, the replicate, the code it runs
    (:func:`~smp_book.pipeline.code_hash`) and :func:`smp_path`. The number of replicates is left out, so
    that asking for more replicates reuses the ones already run."""
    settings = {k: v for k, v in cfg.items() if k != "smp_replicates"}
    return {**settings, "part": variant, "replicate": replicate, "code": code_hash(__name__), "smp_path": path}


def run_variant(cfg: dict[str, Any], variant: str, theta0: torch.Tensor, data: dict, index: int,
                device: torch.device | None = None, checkpoint=None, progress: bool = True, replicate: int = 0,
                first_chain: int = 0):
    """One SMP variant from theta_0 = MAP; the empirical Fisher (of the variant's structure) from the
    validation set (the periodic variants: its first ``cfg["n_fisher_periodic"]`` images, where set).

    ``index`` (:func:`variant_index`) and ``replicate`` set its seed (:func:`smp_seed`); tau is
    :func:`variant_tau`; the preconditioner :func:`variant_preconditioner`. ``checkpoint``: a file to save to
    every ``cfg["checkpoint_every"]`` steps and resume from; ``first_chain``: run chains ``first_chain, ...``
    of the seed's streams (another stream of the same run, :mod:`smp_book.paper_streams`).
    """
    device = device or default_device()
    net = lenet5().to(device)
    x = data["train"][0].to(device)
    xv, yv = (t.to(device) for t in data["val"])
    n_fisher = cfg.get("n_fisher_periodic") if variant.startswith("periodic") else None
    fisher_data = (xv[:n_fisher], yv[:n_fisher]) if n_fisher else (xv, yv)
    return run_smp(net, "categorical", x, theta0=theta0.to(device), preconditioner=variant_preconditioner(cfg, variant),
                   tau=variant_tau(cfg, variant), n_steps=cfg["n_steps"], n_chains=cfg["n_chains"],
                   seed=smp_seed(cfg, index, replicate), fisher=Fisher("empirical", *fisher_data), progress=progress,
                   options={"checkpoint": checkpoint, "checkpoint_every": cfg.get("checkpoint_every"),
                            "first_chain": first_chain})


def variant_preconditioner(cfg: dict[str, Any], variant: str):
    """The :class:`~smp_core.preconditioners.Preconditioner` of ``variant`` for LeNet-5 (ridge, T and, for an
    EMA variant where the study sets it, the KFAC study, ``cfg["ema_refresh"]``: the steps between
    refactorisations of its statistic; the diagonal EMA ignores it)."""
    model = as_chain_model(lenet5(), INPUT_SHAPE)
    refresh = cfg.get("ema_refresh", 1) if ema_refresh_applies(variant) else 1
    layers = kronecker_layers(model) if variant.endswith("-kfac") else ()
    return preconditioner_from_name(variant, dim=model.layout.dim, blocks=model.layout.block_slices, layers=layers,
                                    ridge=cfg["ridge"], period=cfg["period"], ema_init="fisher", ema_refresh=refresh)


def run_replicates(cfg: dict[str, Any], theta_map: torch.Tensor, data: dict, device: torch.device | None = None,
                   use_cache: bool = True, progress: bool = True, cache_root: str | Path = CACHE) -> dict[str, Any]:
    """Every SMP variant (:func:`study_variants`) in each of ``cfg["smp_replicates"]`` replicates from the
    same MAP, evaluated.

    Each run is cached in ``<cache_root>/<study>/`` (``mnist`` or ``mnist_kfac``) by :func:`run_key` and,
    while it runs, saves a checkpoint beside it every ``cfg["checkpoint_every"]`` steps to resume from
    (deleted once the run is in the cache). Returns ``tables``: :func:`tables` per replicate (MAP row
    included); ``diverged``: the diverged chains per replicate (rows) and variant (columns), which every
    metric leaves out; ``divergence``: :func:`divergence_record` per replicate and variant; ``figure_evals``:
    the :func:`evaluate` results of the first replicate (the later ones drop the test-set probabilities).
    """
    device = device or default_device()
    path, variants, folder = smp_path(device), study_variants(cfg), cfg.get("study", "mnist")
    map_eval = evaluate(theta_map[None], data, device=device)
    per_replicate, diverged, divergence, figure_evals = [], {}, [], None
    for r in range(cfg["smp_replicates"]):
        evals, elapsed = {"MAP": map_eval}, {"MAP": 0.0}
        for variant in variants:
            key, name = run_key(cfg, variant, r, path), f"SMP-{variant}"
            checkpoint = Path(cache_root) / folder / f"{config_key(key)}.checkpoint.pt" if use_cache else None
            res = cached(folder, key, partial(run_variant, cfg, variant, theta_map, data, variant_index(cfg, variant),
                                              device, checkpoint, progress, replicate=r),
                         root=cache_root, enabled=use_cache)
            if checkpoint is not None:
                # the run is in the cache now, and K is part of its key: nothing will resume from this file
                checkpoint.unlink(missing_ok=True)
            elapsed[name], diverged[(r, name)] = res.elapsed, res.n_diverged
            divergence.append(divergence_record(res, theta_map, r, name, cfg["period"]))
            evals[name] = evaluate(res.theta[~res.diverged], data, device=device)
            if r > 0:
                evals[name].pop("probs")  # the figures show the first replicate only
        per_replicate.append(tables(evals, elapsed))
        figure_evals = figure_evals or evals
    diverged = pd.Series(diverged, name="diverged chains").unstack()[[f"SMP-{v}" for v in variants]]
    diverged.index.name = "replicate"
    return {"tables": per_replicate, "diverged": diverged, "divergence": pd.DataFrame(divergence),
            "figure_evals": figure_evals}


def divergence_record(result, theta0: torch.Tensor, replicate: int, method: str, period: int) -> dict[str, Any]:
    """One run's divergences: how many chains were stopped, the check steps that caught them, those
    steps modulo the period ``T`` of the periodic strategy (the steps since the last recomputation), and
    the largest move (max-norm) of a kept chain from ``theta0``, against the divergence threshold."""
    steps = sorted(int(k) for k in result.diverged_step[result.diverged].tolist())
    kept = result.theta[~result.diverged]
    largest = float((kept.cpu() - theta0.cpu()).abs().max()) if kept.shape[0] else float("nan")
    return {"replicate": replicate, "method": method, "diverged": len(steps),
            "caught_at_steps": " ".join(map(str, steps)), "steps_modulo_T": " ".join(str(k % period) for k in steps),
            "largest_move_of_a_kept_chain": largest}


def logits_on_test_set(theta: torch.Tensor, data: dict, device: torch.device | None = None) -> torch.Tensor:
    """The LeNet-5 logits ``(S, n_test, 10)`` of parameter samples ``theta`` ``(S, d)`` on the test set (on the CPU)."""
    device = device or default_device()
    model = as_chain_model(lenet5().to(device), INPUT_SHAPE)
    return predict(model, theta.to(device), data["test"][0].to(device), batch_size=2500).cpu()


def evaluate(theta: torch.Tensor, data: dict, n_bins: int = 10, device: torch.device | None = None) -> dict:
    """Scores, variances, calibration curve, test-set class probabilities and tail shares of parameter samples."""
    yt = data["test"][1]
    logits = logits_on_test_set(theta, data, device)  # (S, n, 10)
    probs = torch.softmax(logits.double(), dim=-1)
    return {"scores": metrics.all_scores(probs, yt, n_bins=n_bins),
            "variances": {"params_variance": metrics.params_variance(theta.cpu()),
                          "logits_variance": metrics.logits_variance(logits)},
            "curve": metrics.calibration_curve(probs, yt, n_bins=n_bins), "probs": probs.float(),
            "tail": {**largest_chain_shares(logits), **mutual_information_tail(probs)}}


def largest_chain_shares(logits: torch.Tensor) -> dict[str, float]:
    """How much of the logit variance (:func:`smp_core.metrics.logits_variance`) the most deviant
    chains carry: chain ``b`` adds ``mean_{n,c} (g_b - mean_b' g_b')^2 / (S - 1)``, and the shares of
    the largest one and the largest two are returned (NaN for one sample). With ``S = 100`` chains
    of equal weight a share is about 0.01; a share near 1 means the variance is one chain's excursion.
    """
    if logits.shape[0] < 2:
        return {"largest_chain_share": float("nan"), "largest_two_share": float("nan")}
    logits = logits.double()
    per_chain = ((logits - logits.mean(0)) ** 2).flatten(1).mean(1)
    top = per_chain.sort(descending=True).values / per_chain.sum()
    return {"largest_chain_share": float(top[0]), "largest_two_share": float(top[:2].sum())}


def mutual_information_tail(probs: torch.Tensor, trim: float = TRIM) -> dict[str, float]:
    """How much of the test-set mutual information its most deviant chains carry, and what is left
    without them: the largest chain's share of :func:`smp_core.metrics.mutual_information_per_sample`
    (a few times ``1/S`` when the chains spread alike, near 1 when the mutual information is one
    chain's excursion) and :func:`smp_core.metrics.trimmed_mutual_information` with ``trim`` (NaN for one sample).
    """
    if probs.shape[0] < 2:
        return {"mi_largest_chain_share": float("nan"), "trimmed_mutual_info": float("nan")}
    parts = metrics.mutual_information_per_sample(probs)
    total, largest = float(parts.sum()), float(parts.max())
    # identical chains: the parts (in nats, each at most log C) are rounding of about 1e-16; no share means anything
    return {"mi_largest_chain_share": largest / total if total > 1e-12 else float("nan"),
            "trimmed_mutual_info": metrics.trimmed_mutual_information(probs, trim, parts=parts)}


def ambiguous_three(map_probs: torch.Tensor, labels: torch.Tensor) -> int:
    """The rule for the figure: the test image labelled 3 with the highest MAP predictive entropy."""
    p = map_probs[0].double()
    entropy = -(torch.special.xlogy(p, p)).sum(-1)
    entropy[labels != 3] = -1.0
    return int(entropy.argmax())


def tables(evals: dict[str, dict], elapsed: dict[str, float]) -> dict[str, pd.DataFrame]:
    """One replicate's tables, a row per method of ``evals``: scores, variances, seconds (``elapsed``), tails."""
    names = pd.Index(list(evals), name="method")
    return {"scores": pd.DataFrame([evals[n]["scores"] for n in names], index=names)[list(metrics.SCORE_KEYS)],
            "variances": pd.DataFrame([evals[n]["variances"] for n in names], index=names),
            "elapsed": pd.DataFrame({"seconds": [elapsed[n] for n in names]}, index=names),
            "tails": pd.DataFrame([evals[n]["tail"] for n in names], index=names)}


def summarise(per_replicate: list[dict[str, pd.DataFrame]]) -> dict[str, pd.DataFrame]:
    """Mean and standard deviation over the SMP replicates of every cell of :func:`tables`
    (:func:`smp_book.summaries.summarise_replicates`). Every replicate starts from the same MAP, so the
    MAP row has no spread to show: its standard deviation is NaN, not a misleading zero; the spread
    of the SMP rows is that of the SMP random stream alone (one MAP, one data split)."""
    out = summarise_replicates(per_replicate)
    for name, table in out.items():
        if name.endswith("_std") and "MAP" in table.index:
            table.loc["MAP"] = np.nan
    return out


def r_ratio(cfg: dict[str, Any]) -> float:
    return residual_variance_ratio(cfg["n_train"], cfg["n_steps"])


def top_probabilities(evals: dict[str, dict], index: int) -> pd.DataFrame:
    """Mean predicted class probabilities (over samples) of every method for one test image."""
    return pd.DataFrame({name: ev["probs"][:, index].mean(0).numpy() for name, ev in evals.items()},
                        index=[str(c) for c in range(10)]).T.astype(np.float64)


def paper_scale_results(folder: str | Path = PAPER_RESULTS):
    """The paper-scale results of this study (:class:`smp_book.results.Results`) when a complete folder
    of them holds the paper scale's current settings, else ``None``: they are only read here, never computed
    (at ``K = 10^6`` they take hours)."""
    folder = Path(folder)
    if stale_reason(folder, study_config("mnist", "paper")) is not None:
        return None
    res = Results(folder)
    return res if res.manifest.get("scale") == "paper" and res.has("scores_mean") else None
