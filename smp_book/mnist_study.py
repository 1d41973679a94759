"""The MNIST study of Section 3.3: MAP LeNet-5, the four SMP variants, tables, figures and claims.

Runs on CUDA when a GPU is present and on the CPU otherwise, with no code change.
"""

from __future__ import annotations

import math
import numbers
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from smp_core import metrics
from smp_core.fisher import estimate_fisher, fisher_vectors, kronecker_layers
from smp_core.fused import FusedSequentialChainModel
from smp_core.memory import retain_freed_memory
from smp_core.models import as_chain_model, lenet5, predict
from smp_core.preconditioners import build_preconditioner, ema_refresh_applies, preconditioner_from_name
from smp_core.recursion import Fisher, RunOptions, residual_variance_ratio, run_smp

from .config import MNIST_TAU, MNIST_VARIANTS
from .mnist import mnist_tensors
from .results import cached, code_hash, config_key, summarise_replicates, variance_components

INPUT_SHAPE = (1, 28, 28)
FULL_SIZES = (54_000, 6_000, 10_000)  # train, validation, test: the paper's split of MNIST
DIAGONAL_METHODS = tuple(f"SMP-{v}" for v in MNIST_VARIANTS if v != "none")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_data(cfg: dict[str, Any], data_dir: str = "data") -> tuple[dict, dict[str, Any]]:
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

    Weight decay is coupled L2 (``torch.optim.Adam(weight_decay=...)``, the gradient of
    ``wd/2 ||theta||^2`` added to that of the mean NLL of the batch), as Flux's
    ``OptimiserChain(WeightDecay, Adam)``. Returns the flat parameters, the validation loss and
    accuracy per epoch and the training time.

    ``cfg["map_dropout"] = p > 0`` (beyond the paper: the MC dropout baseline) trains
    ``lenet5(dropout=p)`` instead, with the same seed, initial weights and minibatch order; the
    validation loss is then that of the network in eval mode (dropout off). Without the key, the
    paper's network.
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
    history = []
    started = time.perf_counter()
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
    key = {k: cfg[k] for k in ("n_train", "n_val", "n_test", "split_seed", "seed") if k in cfg}
    key.update({k: v for k, v in cfg.items() if k.startswith("map_")}, part="map", code=code_hash(__name__))
    return key


def fit_map(cfg: dict[str, Any], data: dict, device: torch.device | None = None, use_cache: bool = True,
            progress: bool = True, cache_root: str = ".cache") -> dict[str, Any]:
    """:func:`train_map`, reused from ``<cache_root>/mnist/`` by :func:`map_key` (shared by the MNIST chapters)."""
    return cached("mnist", map_key(cfg), lambda: train_map(cfg, data, device, progress), root=cache_root,
                  enabled=use_cache)


def validation_fisher_diagonal(theta0: torch.Tensor, data: dict, device: torch.device | None = None
                               ) -> torch.Tensor:
    """The diagonal of the empirical Fisher at ``theta0`` over the whole validation set (the fixed
    preconditioners' data; the periodic strategy uses its first ``n_fisher_periodic`` images), Section
    3.3.3: the mean squared score of the observed labels, as a ``(d,)`` tensor on the CPU."""
    device = device or default_device()
    model = as_chain_model(lenet5().to(device), INPUT_SHAPE)
    xv, yv = (t.to(device) for t in data["val"])
    (diag,) = estimate_fisher(model, _categorical(), theta0.to(device)[None], xv, yv, kind="empirical",
                              structure="diag")
    return diag.reshape(-1).cpu()


def fisher_zero_mask(theta0: torch.Tensor, data: dict, device: torch.device | None = None) -> torch.Tensor:
    """Where the diagonal of the empirical Fisher at ``theta0`` over the validation set is exactly zero
    (a ``(d,)`` boolean tensor on the CPU)."""
    return validation_fisher_diagonal(theta0, data, device) == 0


def fisher_zero_fraction(theta0: torch.Tensor, data: dict, device: torch.device | None = None) -> float:
    """Fraction of exact zeros on the diagonal of the empirical Fisher at ``theta0`` over the validation set."""
    return float(fisher_zero_mask(theta0, data, device).double().mean())


def _categorical():
    from smp_core.likelihoods import Categorical

    return Categorical()


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
    """tau of ``variant``: ``cfg["tau"]`` (the KFAC study) or else the paper's (``MNIST_TAU``)."""
    taus = {**MNIST_TAU, **cfg.get("tau", {})}
    if variant not in taus:
        raise KeyError(f"no tau for the MNIST variant {variant!r}; known: {sorted(taus)}")
    return taus[variant]


def smp_seed(cfg: dict[str, Any], index: int, replicate: int = 0) -> int:
    """The seed of SMP variant number ``index`` (its place in :func:`study_variants`) in one replicate.

    Replicate 0 keeps the seeds of the study's single run (``seed + 10 + index``); replicate ``r``
    adds ``1000 r``, as the toy study's replicates do. A study with a ``seed_offset`` (the KFAC one)
    numbers its variants after the paper's four, so that it draws other random numbers.
    """
    return cfg["seed"] + 10 + cfg.get("seed_offset", 0) + index + 1000 * replicate


def run_key(cfg: dict[str, Any], variant: str, replicate: int, path: str) -> dict[str, Any]:
    """The cache key of one SMP run: its scale's settings, the variant, the replicate, the code it runs
    (:func:`~smp_book.results.code_hash`) and :func:`smp_path`. The number of
    replicates is left out, so that asking for more replicates reuses the ones already run, and so are
    the ``step_law_*`` settings, which no run uses (:func:`step_law_at_map`)."""
    settings = {k: v for k, v in cfg.items() if k != "smp_replicates" and not k.startswith("step_law_")}
    return {**settings, "part": variant, "replicate": replicate, "code": code_hash(__name__), "smp_path": path}


def run_variant(cfg: dict[str, Any], variant: str, theta0: torch.Tensor, data: dict, index: int,
                device: torch.device | None = None, checkpoint=None, progress: bool = True, replicate: int = 0,
                preconditioner=None, n_steps: int | None = None):
    """One SMP variant from theta_0 = MAP; the empirical Fisher (of the variant's structure) from the
    validation set.

    ``index`` is the variant's place in :func:`study_variants` and, with ``replicate``, sets its seed
    (:func:`smp_seed`); tau is :func:`variant_tau`; an EMA variant refactorises its statistic every
    ``cfg["ema_refresh"]`` steps when the study sets it (the KFAC study; the diagonal EMA ignores it):
    :func:`variant_preconditioner`. ``preconditioner``: one to use instead (that one wrapped by
    a wrapped preconditioner, say); ``n_steps``: stop before ``cfg["n_steps"]``.
    """
    device = device or default_device()
    net = lenet5().to(device)
    x = data["train"][0].to(device)
    xv, yv = (t.to(device) for t in data["val"])
    n_fisher = cfg.get("n_fisher_periodic") if variant.startswith("periodic") else None
    fisher_data = (xv[:n_fisher], yv[:n_fisher]) if n_fisher else (xv, yv)
    return run_smp(net, "categorical", x, theta0=theta0.to(device),
                   preconditioner=variant_preconditioner(cfg, variant) if preconditioner is None else preconditioner,
                   tau=variant_tau(cfg, variant), n_steps=cfg["n_steps"] if n_steps is None else n_steps,
                   n_chains=cfg["n_chains"], seed=smp_seed(cfg, index, replicate),
                   fisher=Fisher("empirical", *fisher_data), progress=progress,
                   options={"checkpoint": checkpoint, "checkpoint_every": cfg.get("checkpoint_every")})


def run_replicates(cfg: dict[str, Any], theta_map: torch.Tensor, data: dict, device: torch.device | None = None,
                   use_cache: bool = True, progress: bool = True, cache_root: str = ".cache") -> dict[str, Any]:
    """Every SMP variant (:func:`study_variants`) in each of ``cfg["smp_replicates"]`` replicates from
    the same MAP, evaluated.

    Each run is cached in ``<cache_root>/<study>/`` (``mnist`` or ``mnist_kfac``) by :func:`run_key`
    and, while it runs, saves a
    checkpoint beside it every ``cfg["checkpoint_every"]`` steps to resume from (deleted once the
    run is in the cache). Returns
    ``tables``: :func:`tables` per replicate (MAP row included); ``diverged``: the diverged chains
    per replicate (rows) and variant (columns), which every metric leaves out; ``divergence``: the
    check steps that stopped them and the largest move of a kept chain, per replicate and variant
    (:func:`divergence_record`); ``figure_evals``:
    the :func:`evaluate` results of the first replicate (with the test-set probabilities; the later
    replicates keep only the tables).
    """
    device = device or default_device()
    path = smp_path(device)
    variants, folder = study_variants(cfg), cfg.get("study", "mnist")
    map_eval = evaluate(theta_map[None], data, device=device)
    per_replicate, diverged, divergence, figure_evals = [], {}, [], None
    for r in range(cfg["smp_replicates"]):
        evals, elapsed = {"MAP": map_eval}, {"MAP": 0.0}
        for i, variant in enumerate(variants):
            key = run_key(cfg, variant, r, path)
            checkpoint = Path(cache_root) / folder / f"{config_key(key)}.checkpoint.pt" if use_cache else None

            def compute(variant=variant, i=i, r=r, checkpoint=checkpoint):
                return run_variant(cfg, variant, theta_map, data, i, device, checkpoint, progress, replicate=r)

            res = cached(folder, key, compute, root=cache_root, enabled=use_cache)
            if checkpoint is not None:
                # the run is in the cache now, and K is part of its key: nothing will resume from this file
                checkpoint.unlink(missing_ok=True)
            name = f"SMP-{variant}"
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
            "caught_at_steps": " ".join(map(str, steps)),
            "steps_modulo_T": " ".join(str(k % period) for k in steps),
            "largest_move_of_a_kept_chain": largest}


def variant_preconditioner(cfg: dict[str, Any], variant: str):
    """The :class:`~smp_core.preconditioners.Preconditioner` that :func:`run_variant` builds from the
    variant's name for LeNet-5 (the same settings: ridge, T, ``ema_refresh``)."""
    model = as_chain_model(lenet5(), INPUT_SHAPE)
    refresh = cfg.get("ema_refresh", 1) if ema_refresh_applies(variant) else 1
    layers = kronecker_layers(model) if variant.endswith("-kfac") else ()
    return preconditioner_from_name(variant, dim=model.layout.dim, blocks=model.layout.block_slices, layers=layers,
                                    ridge=cfg["ridge"], period=cfg["period"], ema_init="fisher", ema_refresh=refresh)


def map_seed(cfg: dict[str, Any], member: int) -> int:
    """The seed of MAP number ``member`` of a set trained with the same settings: ``seed + 100 member``
    (MAP 0 is the study's own; the MNIST baselines chapter's ensemble and the MAP-seeds chapter use
    these, so they share the MAPs)."""
    return cfg["seed"] + 100 * member


def run_map_seeds(cfg: dict[str, Any], data: dict, device: torch.device | None = None, use_cache: bool = True,
                  progress: bool = True, cache_root: str = ".cache") -> dict[str, Any]:
    """Beyond the paper: the four SMP variants in ``cfg["smp_replicates"]`` replicates from each of
    ``cfg["map_seeds"]`` MAPs.

    MAP ``m`` is trained with the MNIST study's settings and the seed :func:`map_seed` (``m = 0``: the
    MNIST chapter's MAP), and its variants run as that chapter's replicates with the MAP's seed
    (:func:`run_replicates`), so MAP 0's runs are the MNIST chapter's and every MAP and run is shared
    through ``<cache_root>/mnist/``. Between MAPs the spread is that of the MAP's training run (initial
    weights and minibatch order) together with the SMP random stream; between the replicates of one
    MAP, that of the stream alone.

    Returns ``runs`` (per MAP, :func:`tables` per replicate), ``tables`` (per MAP, the mean over its
    replicates of each table), ``diverged`` (chains per MAP and variant, summed over its replicates)
    and ``maps`` (per MAP: its seed, training seconds and test accuracy and NLL).
    """
    settings = {**{k: v for k, v in cfg.items() if k != "map_seeds"}, "study": "mnist"}
    runs_per_map, per_map, diverged, maps = [], [], [], []
    for m in range(cfg["map_seeds"]):
        member = {**settings, "seed": map_seed(cfg, m)}
        fit = fit_map(member, data, device, use_cache=use_cache, progress=progress, cache_root=cache_root)
        runs = run_replicates(member, fit["theta"], data, device, use_cache, progress, cache_root)
        runs_per_map.append(runs["tables"])
        means = summarise_replicates(runs["tables"])
        per_map.append({name: means[f"{name}_mean"] for name in runs["tables"][0]})
        diverged.append(runs["diverged"].sum().rename(m))
        scores = runs["tables"][0]["scores"].loc["MAP"]
        maps.append({"map": m, "seed": member["seed"], "map_seconds": fit["seconds"],
                     "accuracy": scores["accuracy"], "nll": scores["nll"]})
    diverged_table = pd.DataFrame(diverged)
    diverged_table.index.name = "map"
    return {"runs": runs_per_map, "tables": per_map, "diverged": diverged_table,
            "maps": pd.DataFrame(maps).set_index("map")}


def least_dispersed_per_map(per_map: list[dict[str, pd.DataFrame]], variants=None) -> pd.DataFrame:
    """Per MAP, the mutual information of each diagonal variant and the one with the smallest (the
    paper's claim: periodic least)."""
    variants = list(variants or DIAGONAL_METHODS)
    table = pd.DataFrame([t["scores"].loc[variants, "mutual_info"] for t in per_map]).reset_index(drop=True)
    table.index.name = "map"
    table["least"] = table[variants].idxmin(axis=1)
    return table


def values_per_run(runs_per_map: list[list[dict[str, pd.DataFrame]]], table: str, column: str,
                   variants=None) -> pd.DataFrame:
    """One column of one of the :func:`tables` (e.g. ``"tails"``, ``"mi_largest_chain_share"``) for each
    variant (columns; the diagonal ones by default) in every run, indexed by ``(map, replicate)``."""
    variants = list(variants or DIAGONAL_METHODS)
    rows = {(m, r): t[table].loc[variants, column] for m, runs in enumerate(runs_per_map) for r, t in enumerate(runs)}
    out = pd.DataFrame.from_dict(rows, orient="index")
    out.index = pd.MultiIndex.from_tuples(out.index, names=["map", "replicate"])
    return out


def dispersion_per_run(runs_per_map: list[list[dict[str, pd.DataFrame]]], variants=None,
                       measure: str = "mutual_info") -> pd.DataFrame:
    """The test-set dispersion of each diagonal variant in every run, indexed by ``(map, replicate)``,
    with the natural logarithms of periodic over fixed and of periodic over EMA (below 0: periodic
    disperses less) and the least dispersed variant of the run.

    ``measure`` is ``"mutual_info"`` (the paper's mutual information, from the scores table) or
    ``"trimmed_mutual_info"`` (the same without the most deviant chains, :func:`mutual_information_tail`,
    from the tails table)."""
    variants = list(variants or DIAGONAL_METHODS)
    table_of = {"mutual_info": "scores", "trimmed_mutual_info": "tails"}
    if measure not in table_of:
        raise ValueError(f"measure must be one of {sorted(table_of)}, got {measure!r}")
    table = values_per_run(runs_per_map, table_of[measure], measure, variants)
    periodic, fixed, ema = "SMP-periodic-diag", "SMP-fixed-diag", "SMP-ema-diag"
    if {periodic, fixed, ema} <= set(variants):
        table["log periodic/fixed"] = np.log(table[periodic] / table[fixed])
        table["log periodic/EMA"] = np.log(table[periodic] / table[ema])
    table["least"] = table[variants].idxmin(axis=1)
    return table


def map_or_stream(per_run: pd.DataFrame) -> pd.DataFrame:
    """How much of the spread of each run's dispersion comes from the MAP and how much from the SMP random
    stream: :func:`smp_book.results.variance_components` of the log mutual information of each variant and
    of the log ratios of :func:`dispersion_per_run`, the MAPs as groups (``sd_map``, ``sd_stream``,
    ``map_share``; ``p_value`` tests for no difference between MAPs)."""
    logged = {}
    for column in per_run.columns.drop("least"):
        if column.startswith("log "):  # a log ratio already
            logged[column] = per_run[column]
        else:
            logged[f"log {column}"] = np.log(per_run[column])
    out = variance_components(pd.DataFrame(logged))
    return out.rename(columns={"sd_group": "sd_map", "sd_within": "sd_stream", "group_share": "map_share"})


def logits_on_test_set(theta: torch.Tensor, data: dict, device: torch.device | None = None) -> torch.Tensor:
    """The LeNet-5 logits ``(S, n_test, 10)`` of parameter samples ``theta`` ``(S, d)`` on the test set (on the CPU)."""
    device = device or default_device()
    model = as_chain_model(lenet5().to(device), INPUT_SHAPE)
    return predict(model, theta.to(device), data["test"][0].to(device), batch_size=2500).cpu()


def evaluate(theta: torch.Tensor, data: dict, n_bins: int = 10, device: torch.device | None = None) -> dict:
    """Scores, variances, calibration curve and test-set class probabilities of parameter samples."""
    yt = data["test"][1]
    logits = logits_on_test_set(theta, data, device)  # (S, n, 10)
    probs = torch.softmax(logits.double(), dim=-1)
    return {
        "scores": metrics.all_scores(probs, yt, n_bins=n_bins),
        "variances": {"params_variance": metrics.params_variance(theta.cpu()),
                      "logits_variance": metrics.logits_variance(logits)},
        "curve": metrics.calibration_curve(probs, yt, n_bins=n_bins),
        "probs": probs.float(),
        "tail": {**largest_chain_shares(logits), **mutual_information_tail(probs)},
    }


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


TRIM = 0.1
"""The fraction of chains :func:`mutual_information_tail` leaves out of its trimmed mutual information
(ours: 10 of the paper's S = 100 chains)."""


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
    # identical chains: the parts (in nats, each at most log C) are rounding of about 1e-16, and their
    # shares mean nothing
    spread = total > 1e-12
    return {"mi_largest_chain_share": largest / total if spread else float("nan"),
            "trimmed_mutual_info": metrics.trimmed_mutual_information(probs, trim, parts=parts)}


def ambiguous_three(map_probs: torch.Tensor, labels: torch.Tensor) -> int:
    """The rule for the figure: the test image labelled 3 with the highest MAP predictive entropy."""
    p = map_probs[0].double()
    entropy = -(torch.special.xlogy(p, p)).sum(-1)
    entropy[labels != 3] = -1.0
    return int(entropy.argmax())


def tables(evals: dict[str, dict], elapsed: dict[str, float]) -> dict[str, pd.DataFrame]:
    names = list(evals)
    scores = pd.DataFrame([evals[n]["scores"] for n in names], index=names)[list(metrics.SCORE_KEYS)]
    variances = pd.DataFrame([evals[n]["variances"] for n in names], index=names)
    el = pd.DataFrame({"seconds": [elapsed[n] for n in names]}, index=names)
    tails = pd.DataFrame([evals[n]["tail"] for n in names], index=names)
    for df in (scores, variances, el, tails):
        df.index.name = "method"
    return {"scores": scores, "variances": variances, "elapsed": el, "tails": tails}


def summarise(per_replicate: list[dict[str, pd.DataFrame]]) -> dict[str, pd.DataFrame]:
    """Mean and standard deviation over the SMP replicates of every cell of :func:`tables`
    (:func:`smp_book.results.summarise_replicates`). Every replicate starts from the same MAP, so the
    MAP row has no spread to show: its standard deviation is NaN, not a misleading zero; the spread
    of the SMP rows is that of the SMP random stream alone (one MAP, one data split)."""
    out = summarise_replicates(per_replicate)
    for name, table in out.items():
        if name.endswith("_std") and "MAP" in table.index:
            table.loc["MAP"] = np.nan
    return out


def claims(scores: pd.DataFrame, variances: pd.DataFrame,
           replicates: list[tuple[pd.DataFrame, pd.DataFrame]] | None = None) -> pd.DataFrame:
    """The conclusions of Section 3.3.4, judged by stated criteria on our numbers.

    ``scores`` and ``variances`` are the tables the verdicts are judged on (with replicates, their
    means). ``replicates``, a list of ``(scores, variances)`` of single runs, adds a column
    ``replicates`` that counts the verdicts each run alone gets (e.g. ``holds 2, does not hold 1``):
    how much a verdict depends on the random stream.
    """
    table = _claims(scores, variances)
    if replicates:
        per_run = [_claims(s, v)["verdict"].tolist() for s, v in replicates]
        table["replicates"] = [verdict_counts(col) for col in zip(*per_run, strict=True)]
    return table


def verdict_counts(verdicts) -> str:
    """``["holds", "does not hold", "holds"]`` -> ``"holds 2, does not hold 1"`` (most frequent first;
    a tie in the order the verdicts first appear, i.e. of the replicates)."""
    return ", ".join(f"{v} {n}" for v, n in Counter(verdicts).most_common())


def _claims(scores: pd.DataFrame, variances: pd.DataFrame) -> pd.DataFrame:
    s, v = scores, variances
    rows = []

    def add(claim, criterion, verdict, evidence):
        rows.append({"claim": claim, "criterion": criterion, "verdict": verdict, "evidence": evidence})

    acc_gap = abs(s.loc["SMP-none", "accuracy"] - s.loc["MAP", "accuracy"])
    nll_gap = abs(s.loc["SMP-none", "nll"] - s.loc["MAP", "nll"])
    add("SMP-none predicts like MAP (same accuracy, Brier, NLL, ECE)",
        "accuracy within 0.002 and NLL within 0.005 of MAP",
        "holds" if acc_gap <= 0.002 and nll_gap <= 0.005 else ("partly" if acc_gap <= 0.005 else "does not hold"),
        f"accuracy {s.loc['SMP-none', 'accuracy']:.4f} vs {s.loc['MAP', 'accuracy']:.4f}; NLL "
        f"{s.loc['SMP-none', 'nll']:.4f} vs {s.loc['MAP', 'nll']:.4f}")
    mi = s.loc["SMP-none", "mutual_info"]
    add("SMP-none collapses to a point estimate (tiny MI and epistemic std)",
        "MI < 0.005 and epistemic std < 0.005",
        "holds" if mi < 0.005 and s.loc["SMP-none", "epistemic_std"] < 0.005 else "does not hold",
        f"MI {mi:.5f}, epistemic std {s.loc['SMP-none', 'epistemic_std']:.5f}")
    diag = DIAGONAL_METHODS
    over = [s.loc[d, "mutual_info"] > 10 * max(mi, 1e-6) and s.loc[d, "nll"] > s.loc["MAP", "nll"] for d in diag]
    add("The diagonal variants over-disperse: much larger MI and worse NLL than MAP and SMP-none",
        "for each diagonal variant MI > 10x SMP-none's and NLL > MAP's (partly: some of them)",
        "holds" if all(over) else ("partly" if any(over) else "does not hold"),
        "; ".join(f"{d}: MI {s.loc[d, 'mutual_info']:.4f}, NLL {s.loc[d, 'nll']:.4f}" for d in diag))
    least = min(diag, key=lambda d: s.loc[d, "mutual_info"])
    add("Periodic recomputation over-disperses least among the diagonal variants",
        "SMP-periodic-diag has the smallest MI of the three",
        "holds" if least == "SMP-periodic-diag" else "does not hold",
        f"smallest MI: {least}")
    big = [v.loc[d, "params_variance"] < 1e-3 and v.loc[d, "logits_variance"] > 1.0 for d in diag]
    add("Diagonal variants: tiny parameter variance (< 1e-3) but large logit variance (> 1)",
        "both, for each diagonal variant (partly: some)",
        "holds" if all(big) else ("partly" if any(big) else "does not hold"),
        "; ".join(f"{d}: params {v.loc[d, 'params_variance']:.2e}, logits {v.loc[d, 'logits_variance']:.3f}"
                  for d in diag))
    return pd.DataFrame(rows)


def r_ratio(cfg: dict[str, Any]) -> float:
    return residual_variance_ratio(cfg["n_train"], cfg["n_steps"])


def top_probabilities(evals: dict[str, dict], index: int) -> pd.DataFrame:
    """Mean predicted class probabilities (over samples) of every method for one test image."""
    return pd.DataFrame({name: ev["probs"][:, index].mean(0).numpy() for name, ev in evals.items()},
                        index=[str(c) for c in range(10)]).T.astype(np.float64)


# ----------------------------------------------------------------------------------------------
# Beyond the paper: how the dispersion grows with K (notebooks/mnist_growth.md)


def reached_share(n_obs: int, n_steps: int) -> float:
    """``1 - r_K^2 / r_0^2``: the share of the limiting variance that ``K`` steps reach when the
    chains stay where one Fisher describes them. There the increments ``gamma_k P^{-1} s_k`` are
    uncorrelated with covariance ``gamma_k^2 P^{-1} F P^{-1}``, so ``Var(theta_K)`` is the constant
    ``tau^2 P^{-1} F P^{-1}`` times ``sum_{k <= K} (N + k)^{-2}``: this share of its limit."""
    return 1.0 - residual_variance_ratio(n_obs, n_steps)


def growth_key(cfg: dict[str, Any], variant: str, path: str) -> dict[str, Any]:
    """The key of one growth run (one checkpoint, extended through the grid of K): the settings
    without the grid, so that a longer grid extends the same run."""
    settings = {k: v for k, v in cfg.items() if k not in ("growth_steps", "n_steps", "smp_replicates")}
    return {**settings, "part": f"growth-{variant}", "code": code_hash(__name__), "smp_path": path}


def growth_point(theta: torch.Tensor, data: dict, zero_mask: torch.Tensor,
                 device: torch.device | None = None) -> dict[str, float]:
    """The dispersion of the samples ``theta`` ``(S, d)`` on the test set, each with its jackknife
    standard error over the chains (:func:`smp_core.metrics.jackknife_se`): parameter variance (also
    split into the coordinates where the Fisher diagonal at the MAP is exactly zero, ``zero_mask``,
    and the others), logit variance and mutual information; and NLL, accuracy and the largest chain's
    share of the logit variance."""
    yt = data["test"][1]
    logits = logits_on_test_set(theta, data, device).double()
    probs = torch.softmax(logits, dim=-1)
    theta = theta.cpu().double()
    zero_mask = zero_mask.cpu()
    row = {
        "params_variance": metrics.params_variance(theta),
        "params_variance_se": metrics.jackknife_se(theta, metrics.params_variance),
        "params_variance_zero_fisher": metrics.params_variance(theta[:, zero_mask]) if zero_mask.any() else np.nan,
        "params_variance_other": metrics.params_variance(theta[:, ~zero_mask]) if (~zero_mask).any() else np.nan,
        "logits_variance": metrics.logits_variance(logits),
        "logits_variance_se": metrics.jackknife_se(logits, metrics.logits_variance),
        "mutual_info": metrics.mutual_information(probs),
        "mutual_info_se": metrics.jackknife_se(probs, metrics.mutual_information),
        "nll": metrics.nll(probs, yt),
        "accuracy": metrics.accuracy(probs, yt),
    }
    row["largest_chain_share"] = largest_chain_shares(logits)["largest_chain_share"]
    return row


def run_growth(cfg: dict[str, Any], variant: str, theta0: torch.Tensor, data: dict, index: int,
               zero_mask: torch.Tensor, device: torch.device | None = None, use_cache: bool = True,
               progress: bool = True, cache_root: str = ".cache") -> pd.DataFrame:
    """One SMP run of ``variant`` (:func:`run_variant`, seeds of replicate 0) extended through the
    grid ``cfg["growth_steps"]`` of K, with :func:`growth_point` at every K.

    The step size ``tau / (N + k)`` does not depend on K, so the samples at a K of the grid are those
    of a run of exactly K steps: the run resumes from its own checkpoint at each K (in
    ``<cache_root>/mnist_growth/``, or a temporary folder without the cache) rather than starting
    again. Each row is cached by its K, so that a rerun, or a grid with larger K appended, redoes
    nothing; a K inserted below one already run cannot be had from the checkpoint (``run_smp`` then
    raises: delete the checkpoint to start the run again). Every K must be a multiple of
    ``run_smp``'s ``check_every`` (50): the run is resumed at whole blocks of steps, so that its
    divergence checks are those of a run of K steps.
    """
    device = device or default_device()
    grid = list(cfg["growth_steps"])
    if not grid or any(b <= a for a, b in zip(grid, grid[1:], strict=False)) or grid[0] < 1:
        raise ValueError(f"growth_steps must be increasing positive step counts, got {grid}")
    block = RunOptions().check_every
    if any(k % block for k in grid):
        raise ValueError(f"every K of growth_steps must be a multiple of {block} (run_smp's check_every), got {grid}")
    key = growth_key(cfg, variant, smp_path(device))
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(cache_root) / "mnist_growth" if use_cache else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        checkpoint = folder / f"{config_key(key)}.checkpoint.pt"
        for n_steps in grid:
            def compute(n_steps=n_steps):
                res = run_variant({**cfg, "n_steps": n_steps}, variant, theta0, data, index, device, checkpoint,
                                  progress=progress)
                point = growth_point(res.theta[~res.diverged], data, zero_mask, device)
                return {"K": n_steps, "reached_share": reached_share(cfg["n_train"], n_steps),
                        "seconds": res.elapsed, "diverged": res.n_diverged, **point}

            rows.append(cached("mnist_growth", {**key, "n_steps": n_steps}, compute, root=cache_root,
                               enabled=use_cache))
    table = pd.DataFrame(rows).set_index("K")
    table.insert(0, "method", f"SMP-{variant}")
    return table


def growth_against_linear(table: pd.DataFrame, column: str) -> pd.Series:
    """``column`` at each K over its value at the first K, divided by the same ratio of
    :func:`reached_share`: 1 where the variance grows as one Fisher predicts, above 1 where it grows
    faster (the chains reach where the Fisher at the start no longer describes them)."""
    first = table.index[0]
    return (table[column] / table.loc[first, column]) / (table["reached_share"] / table.loc[first, "reached_share"])


def least_dispersed(growth: pd.DataFrame, column: str = "mutual_info", variants=DIAGONAL_METHODS) -> pd.DataFrame:
    """Per K, the diagonal variant with the smallest ``column`` and the z-score of its lead over the
    runner-up (their difference over the root sum of the squared jackknife standard errors)."""
    rows = []
    for n_steps, at_k in growth[growth["method"].isin(variants)].groupby(level="K"):
        ranked = at_k.sort_values(column)
        first, second = ranked.iloc[0], ranked.iloc[1]
        se = float(np.hypot(first[f"{column}_se"], second[f"{column}_se"]))
        rows.append({"K": n_steps, "least": first["method"], "runner_up": second["method"],
                     "lead_z": (second[column] - first[column]) / se if se > 0 else np.nan})
    return pd.DataFrame(rows).set_index("K")


def growth_summary(growth: pd.DataFrame, zero_fraction: float) -> pd.DataFrame:
    """Per method, from the first to the last K of the grid: how many fold the parameter variance,
    the logit variance and the mutual information grew, each with a standard error, the growth one
    Fisher predicts (of the reached share), the largest chain's share of the logit variance at the
    last K and the share of the parameter variance that the zero-Fisher coordinates (a
    ``zero_fraction`` of all) carry there.

    The standard error of a ratio ``b / a`` is ``(b / a) sqrt((se_a / a)^2 + (se_b / b)^2)`` from the
    jackknife errors of its two ends, taken as independent: most of the variance at the last K comes
    from the steps after the first K."""
    rows = []
    for method, t in growth.groupby("method", sort=False):
        first, last = t.index[0], t.index[-1]
        row = {"method": method, "from K": first, "to K": last,
               "one-Fisher growth": t.loc[last, "reached_share"] / t.loc[first, "reached_share"]}
        for column in ("params_variance", "logits_variance", "mutual_info"):
            a, b = t.loc[first, column], t.loc[last, column]
            row[f"{column} growth"] = b / a
            if f"{column}_se" in t:
                row[f"{column} growth se"] = b / a * float(np.hypot(t.loc[first, f"{column}_se"] / a,
                                                                     t.loc[last, f"{column}_se"] / b))
        if "largest_chain_share" in t:
            row["largest chain share"] = t.loc[last, "largest_chain_share"]
        row["zero-Fisher share of params variance"] = (zero_fraction * t.loc[last, "params_variance_zero_fisher"]
                                                       / t.loc[last, "params_variance"])
        rows.append(row)
    return pd.DataFrame(rows).set_index("method")


# ----------------------------------------------------------------------------------------------
# Beyond the paper: Kronecker-factored preconditioners on MNIST (notebooks/mnist_kfac.md)


def structure_table(scores: pd.DataFrame, variances: pd.DataFrame, elapsed: pd.DataFrame) -> pd.DataFrame:
    """One row per method (rows of the MNIST and KFAC studies may be concatenated): accuracy, NLL, ECE,
    mutual information, logit and parameter variance, and seconds; with each variant's strategy and
    structure (``MAP`` and ``SMP-none`` have none)."""
    table = scores[["accuracy", "nll", "ece", "mutual_info"]].join(variances[["logits_variance", "params_variance"]])
    table = table.join(elapsed[["seconds"]])
    parts = [name.removeprefix("SMP-").split("-") if name.count("-") == 2 else ["", ""] for name in table.index]
    table.insert(0, "structure", [p[1] for p in parts])
    table.insert(0, "strategy", [p[0] for p in parts])
    return table


def kfac_against_diag(table: pd.DataFrame) -> pd.DataFrame:
    """Per temporal strategy with both a ``diag`` and a ``kfac`` row in ``table`` (:func:`structure_table`):
    the ratios kfac / diag of the mutual information and of the logit variance, both NLLs beside MAP's,
    and two verdicts judged on these numbers: does KFAC over-disperse less (smaller MI), and does it
    predict better (smaller NLL)?"""
    rows = []
    for strategy in ("fixed", "ema", "periodic"):
        diag, kfac = f"SMP-{strategy}-diag", f"SMP-{strategy}-kfac"
        if diag not in table.index or kfac not in table.index:
            continue
        d, k = table.loc[diag], table.loc[kfac]
        rows.append({
            "strategy": strategy,
            "mi_kfac_over_diag": k["mutual_info"] / d["mutual_info"],
            "logits_variance_kfac_over_diag": k["logits_variance"] / d["logits_variance"],
            "nll_diag": d["nll"], "nll_kfac": k["nll"],
            "nll_map": table.loc["MAP", "nll"] if "MAP" in table.index else np.nan,
            "kfac less dispersed (smaller MI)": "yes" if k["mutual_info"] < d["mutual_info"] else "no",
            "kfac lower NLL": "yes" if k["nll"] < d["nll"] else "no",
        })
    return pd.DataFrame(rows).set_index("strategy") if rows else pd.DataFrame()


def directions_at_the_ridge(theta0: torch.Tensor, data: dict, ridge: float,
                            device: torch.device | None = None) -> pd.DataFrame:
    """How many directions each preconditioner leaves at the ridge, per layer of LeNet-5.

    The empirical Fisher over the validation set at ``theta0``, as the fixed strategies build it: per
    layer, the share of the eigenvalues of ``P - ridge I`` below ``ridge``, for the diagonal (its
    entries) and for KFAC (the products ``lambda_G lambda_A`` of the eigenvalues of both factors). In
    such a direction ``P^{-1}`` is about ``1 / ridge`` (10^4 for the paper's lambda): the step there is
    the score times 10^4 whatever the curvature, which is where over-dispersion can come from. Also the
    output units whose ``G`` row is exactly zero on the validation set (units that never activate there).
    """
    device = device or default_device()
    model = as_chain_model(lenet5().to(device), INPUT_SHAPE)
    xv, yv = (t.to(device) for t in data["val"])
    theta = theta0.to(device)[None]
    (diag,) = estimate_fisher(model, _categorical(), theta, xv, yv, kind="empirical", structure="diag")
    factors = estimate_fisher(model, _categorical(), theta, xv, yv, kind="empirical", structure="kfac")
    rows = []
    for i, layer in enumerate(kronecker_layers(model)):
        a, g = factors[2 * i][0].double().cpu(), factors[2 * i + 1][0].double().cpu()
        products = torch.linalg.eigvalsh(g).clamp_min(0)[:, None] * torch.linalg.eigvalsh(a).clamp_min(0)[None, :]
        entries = torch.cat([diag[0, layer.weight].reshape(-1)]
                            + ([diag[0, layer.bias].reshape(-1)] if layer.bias is not None else [])).double().cpu()
        rows.append({"layer": i + 1, "shape [W, b]": f"{layer.n_out} x {layer.n_cols}", "parameters": entries.numel(),
                     "diag: share below ridge": float((entries < ridge).double().mean()),
                     "diag: share exactly zero": float((entries == 0).double().mean()),
                     "kfac: share below ridge": float((products < ridge).double().mean()),
                     "units with zero G row": int((g.diagonal() == 0).sum())})
    table = pd.DataFrame(rows).set_index("layer")
    total = table["parameters"].sum()
    weights = table["parameters"] / total
    table.loc["all"] = {"shape [W, b]": "", "parameters": total,
                        **{c: float((table[c] * weights).sum()) for c in table.columns if "share" in c},
                        "units with zero G row": int(table["units with zero G row"].sum())}
    return table


def kfac_statistic_precision(theta0: torch.Tensor, data: dict, ridge: float, n_scores: int = 200,
                             device: torch.device | None = None) -> pd.DataFrame:
    """Whether float32 rounding of the Fisher statistic changes the fixed-kfac preconditioner at ``theta0``.

    The chains, and by default their statistic, run in float32. This builds the fixed-kfac
    preconditioner of the KFAC chapter (the empirical Fisher over the validation set, ``ridge``) twice:
    its Kronecker factors summed, and eigendecomposed, in float32 and in float64 (``statistic_dtype``,
    beyond the paper). Per layer: the relative difference ``|P32^{-1} s - P64^{-1} s| / |P64^{-1} s|``
    on the layer's slice for the empirical scores ``s`` of the first ``n_scores`` validation images
    (median and largest); the largest eigenvalue of ``G (x) A`` (float32 rounds the statistic by about
    ``1e-7`` times it); and, from each preconditioner's own factor, the share of the directions whose
    eigenvalue product ``lambda_G lambda_A`` lies below the ridge (the directions at the ridge) and the
    smallest eigenvalues of ``A`` and ``G``.
    """
    device = device or default_device()
    model = as_chain_model(lenet5().to(device), INPUT_SHAPE)
    layers = kronecker_layers(model)
    xv, yv = (t.to(device) for t in data["val"])
    theta = theta0.to(device)[None]
    n_scores = min(n_scores, xv.shape[0])
    scores = fisher_vectors(model, _categorical(), theta.expand(n_scores, -1), xv[:n_scores], yv[:n_scores],
                            "empirical")[:, 0]
    factors, states, solved = {}, {}, {}
    for name, dtype in (("float32", None), ("float64", torch.float64)):
        factors[name] = estimate_fisher(model, _categorical(), theta, xv, yv, kind="empirical", structure="kfac",
                                        dtype=dtype)
        precond = build_preconditioner("kfac", "fixed", dim=model.layout.dim, layers=layers, ridge=ridge,
                                       statistic_dtype=dtype)
        states[name] = precond.init(theta, lambda t, name=name: factors[name])
        solved[name] = precond.solve(states[name], scores).double().cpu()
    rows = []
    for i, layer in enumerate(layers):
        idx = layer.positions()
        reference = solved["float64"][:, idx]
        rel = (solved["float32"][:, idx] - reference).norm(dim=1) / reference.norm(dim=1)
        # the eigenvalues of A and G (ascending) of each statistic, computed once
        spectra = {name: tuple(torch.linalg.eigvalsh(factors[name][2 * i + j][0].double().cpu()) for j in (0, 1))
                   for name in factors}
        eig_a, eig_g = spectra["float64"]
        row = {"layer": i + 1, "shape [W, b]": f"{layer.n_out} x {layer.n_cols}",
               "P^-1 s: relative difference, median": float(rel.median()),
               "P^-1 s: relative difference, largest": float(rel.max()),
               "largest eigenvalue of G (x) A": float(eig_a[-1] * eig_g[-1])}
        for name in factors:
            # the factor (U_A, U_G, 1 / (lambda_G lambda_A^T + ridge)): a product below the ridge has a scale
            # above 1 / (2 ridge)
            scale = states[name].factor[3 * i + 2][0].double().cpu()
            row[f"share below ridge ({name})"] = float((scale > 1.0 / (2.0 * ridge)).double().mean())
        for name, (eig_a, eig_g) in spectra.items():
            row[f"smallest eigenvalue of A ({name})"] = float(eig_a[0])
            row[f"smallest eigenvalue of G ({name})"] = float(eig_g[0])
        rows.append(row)
    return pd.DataFrame(rows).set_index("layer")


STEP_LAW_VARIANTS = ("none", "fixed-diag", "fixed-kfac")
STEP_LAW_BATCH = 100  # scores per batch of draw_steps


def step_law_key(cfg: dict[str, Any], variant: str, device: torch.device, draw_set: int = 0) -> dict[str, Any]:
    """The cache key of :func:`step_law_at_map` for one variant and set of draws: the MAP's key, the ridge,
    the draws, the evaluation images, the batch and the device type (both set the order of the random
    numbers) and the seed."""
    return {**map_key(cfg), "part": f"step law {variant}", "ridge": cfg["ridge"],
            "step_law_draws": cfg["step_law_draws"], "step_law_eval": cfg["step_law_eval"],
            "step_law_batch": STEP_LAW_BATCH, "device": torch.device(device).type,
            "seed": step_law_seed(cfg, draw_set), "code": code_hash(__name__)}


def step_law_seed(cfg: dict[str, Any], draw_set: int = 0) -> int:
    """The seed of set ``draw_set`` of drawn steps (``seed + 700 + draw_set``), the same for every variant:
    each preconditioner is applied to the same scores, so that the variants' draws are paired. Sets
    ``0, 1, ...`` are independent draws of the same law."""
    if isinstance(draw_set, bool) or not (isinstance(draw_set, numbers.Integral) and 0 <= draw_set < 100):
        raise ValueError(f"draw_set must be an integer in [0, 100), got {draw_set!r}")
    return cfg["seed"] + 700 + int(draw_set)


def step_law_groups(theta0: torch.Tensor, data: dict, ridge: float, device: torch.device | None = None
                    ) -> dict[str, torch.Tensor]:
    """The parameter groups of :func:`step_law_at_map`: LeNet-5's five layers (weights and biases, the
    kfac layers) and the coordinates whose diagonal empirical Fisher at ``theta0`` over the validation
    set (the fixed preconditioners' data) is below ``ridge`` or not (boolean masks)."""
    device = device or default_device()
    model = as_chain_model(lenet5().to(device), INPUT_SHAPE)
    below = validation_fisher_diagonal(theta0, data, device) < ridge
    groups = {f"layer {i + 1}": layer.positions() for i, layer in enumerate(kronecker_layers(model))}
    groups.update({"diag Fisher below ridge": below, "diag Fisher at or above ridge": ~below})
    return groups


def step_law_at_map(cfg: dict[str, Any], theta_map: torch.Tensor, data: dict, device: torch.device | None = None,
                    use_cache: bool = True, progress: bool = True, cache_root: str = ".cache",
                    draw_set: int = 0) -> pd.DataFrame:
    """The law of one step at the MAP for the fixed diagonal and fixed KFAC preconditioners, and none.

    For each of :data:`STEP_LAW_VARIANTS`, the preconditioner a run of that variant starts with (the
    empirical Fisher over the validation set at the MAP, :func:`variant_preconditioner`; the identity
    for ``none``) and ``cfg["step_law_draws"]`` steps ``u = P^{-1} s`` drawn as the recursion draws
    them (:func:`smp_book.step_law.draw_steps`; the same scores for every variant,
    :func:`step_law_seed`), with their linearised change of the logits on the first
    ``cfg["step_law_eval"]`` test images, in total and per group of :func:`step_law_groups`. Cached
    under ``<cache_root>/mnist_kfac/`` by :func:`step_law_key`. ``draw_set`` ``1, 2, ...`` draws another,
    independent set of the same size (:func:`step_law_seed`). Returns the draws of every variant, with
    columns ``variant``, ``training_label`` (the drawn image's label in the training set; the label the
    score uses is drawn from the model, and ``log_prob`` is its log-probability) and those of ``draw_steps``.
    """
    from .step_law import draw_steps

    device = device or default_device()
    net = as_chain_model(lenet5().to(device), INPUT_SHAPE)
    x = data["train"][0].to(device)
    xv, yv = (t.to(device) for t in data["val"])
    x_eval = data["test"][0][: cfg["step_law_eval"]].to(device)
    theta = theta_map.to(device)
    frames, groups = [], {}  # the groups are computed once, and only if some variant is not cached
    for variant in STEP_LAW_VARIANTS:
        def compute(variant=variant):
            if not groups:
                groups.update(step_law_groups(theta_map, data, cfg["ridge"], device))
            precond = variant_preconditioner(cfg, variant)
            state = precond.init(theta[None], lambda t: estimate_fisher(net, _categorical(), t, xv, yv,
                                                                        kind="empirical", structure=precond.structure))
            return draw_steps(net, "categorical", x, theta, precond, state, n_draws=cfg["step_law_draws"],
                              groups=groups, x_eval=x_eval,
                              seed=step_law_seed(cfg, draw_set), batch=STEP_LAW_BATCH, progress=progress)

        draws = cached("mnist_kfac", step_law_key(cfg, variant, device, draw_set), compute, root=cache_root,
                       enabled=use_cache)
        labels = data["train"][1].numpy()[draws["row"].to_numpy()]
        frames.append(draws.assign(variant=variant, training_label=labels).reset_index())
    return pd.concat(frames, ignore_index=True)


def step_law_prediction(draws: pd.DataFrame, cfg: dict[str, Any], observed: pd.DataFrame) -> pd.DataFrame:
    """The variances a run of ``cfg["n_steps"]`` steps would show if ``theta`` and ``P`` stayed at the
    MAP (:func:`smp_book.step_law.predicted_variances` of the drawn steps), beside a run's.

    ``observed``: rows ``SMP-<variant>`` with ``params_variance``, ``logits_variance`` and (optional)
    ``largest_chain_share``. The predicted logit variance is over the evaluation images of the draws,
    the observed one over the whole test set.
    """
    from .step_law import predicted_variances

    dim = as_chain_model(lenet5(), INPUT_SHAPE).layout.dim
    rows = []
    for variant, d in draws.groupby("variant", sort=False):
        pred = predicted_variances(d, cfg["n_train"], cfg["n_steps"], variant_tau(cfg, variant), dim)
        name = f"SMP-{variant}"
        obs = observed.loc[name] if name in observed.index else pd.Series(dtype=float)
        row = {"method": name}
        for column in ("params_variance", "logits_variance"):
            row[f"{column}: predicted"] = pred[column]
            row[f"{column}: predicted se"] = pred[f"{column}_se"]
            row[f"{column}: observed"] = obs.get(column, float("nan"))
            row[f"{column}: observed / predicted"] = row[f"{column}: observed"] / pred[column]
        row["largest chain's share of the observed logit variance"] = obs.get("largest_chain_share", float("nan"))
        rows.append(row)
    return pd.DataFrame(rows).set_index("method")


def step_law_sets(sets: dict[str, pd.DataFrame], cfg: dict[str, Any], observed: pd.DataFrame) -> pd.DataFrame:
    """The predictions of :func:`step_law_prediction` from independent sets of draws (``name -> draws`` of
    :func:`step_law_at_map` with different ``draw_set``), and from all of them pooled, beside the runs.

    Rows ``(method, set)``; columns per variance: the prediction, its standard error, observed over
    predicted. For two sets, the rows ``"difference (se)"`` give the second set's prediction minus the
    first's over the standard error of that difference (the two sets are independent), stored in the
    ``: predicted`` columns: were the standard errors right, about normal. The variants' draws are
    paired, so these move together: a gross error in the standard errors shows, how much heavy tails
    make them too small does not.
    """
    if "pooled" in sets:
        raise ValueError("'pooled' names the pooled rows: give the sets other names")
    pooled = pd.concat(list(sets.values()), ignore_index=True)
    tables = {name: step_law_prediction(d, cfg, observed) for name, d in {**sets, "pooled": pooled}.items()}
    rows = []
    for method in tables["pooled"].index:
        for name, table in tables.items():
            rows.append({"method": method, "set": name,
                         **{f"{c}: {k}": table.loc[method, f"{c}: {k}"]
                            for c in ("params_variance", "logits_variance")
                            for k in ("predicted", "predicted se", "observed / predicted")}})
        if len(sets) == 2:
            first, second = (tables[name].loc[method] for name in sets)
            row = {"method": method, "set": "difference (se)"}
            for c in ("params_variance", "logits_variance"):
                se = math.hypot(first[f"{c}: predicted se"], second[f"{c}: predicted se"])
                row[f"{c}: predicted"] = (second[f"{c}: predicted"] - first[f"{c}: predicted"]) / se
            rows.append(row)
    return pd.DataFrame(rows).set_index(["method", "set"])


def step_law_tails(draws: pd.DataFrame, fractions=(0.01, 0.001)) -> pd.DataFrame:
    """How heavy the tail of each variant's step law is: for the squared step ``||u||^2`` and the squared
    output change ``mean (J u)^2``, the mean, median, 99th percentile and largest draw, the mean over
    the median, and the share of the sum held by the largest ``fraction`` of the draws."""
    from .step_law import top_share

    rows = []
    for variant, d in draws.groupby("variant", sort=False):
        for column, label in (("step_sq", "||u||^2"), ("output_sq", "mean (J u)^2")):
            values = d[column]
            row = {"method": f"SMP-{variant}", "quantity": label, "mean": values.mean(), "median": values.median(),
                   "99th percentile": values.quantile(0.99), "largest": values.max(),
                   "mean / median": values.mean() / values.median()}
            for fraction in fractions:
                row[f"share of the largest {fraction:.1%}"] = top_share(values, fraction)
            rows.append(row)
    return pd.DataFrame(rows).set_index(["method", "quantity"])


def step_law_by_group(draws: pd.DataFrame, groups: dict[str, torch.Tensor]) -> pd.DataFrame:
    """Where each variant's steps go, per group of :func:`step_law_groups`: its share of ``E ||s||^2`` and
    of ``E ||u||^2`` (both add up to 1 over a partition), and ``E mean (J u_g)^2 / E mean (J u)^2``, the
    output change of the step cut to the group relative to the whole step's (not additive: the groups'
    changes can cancel or add up), and ``E mean (J u_g)^2 / E ||u_g||^2``, how much the outputs move per
    unit of squared step in the group: large where the step points along directions the network's
    outputs are sensitive to."""
    rows = []
    for variant, d in draws.groupby("variant", sort=False):
        for name, g in groups.items():
            g = torch.as_tensor(g)
            size = int(g.sum()) if g.dtype == torch.bool else g.numel()
            rows.append({"method": f"SMP-{variant}", "group": name, "parameters": size,
                         "share of E||s||^2": d[f"score_sq[{name}]"].mean() / d["score_sq"].mean(),
                         "share of E||u||^2": d[f"step_sq[{name}]"].mean() / d["step_sq"].mean(),
                         "output change alone / whole": d[f"output_sq[{name}]"].mean() / d["output_sq"].mean(),
                         "output change per ||u||^2": d[f"output_sq[{name}]"].mean() / d[f"step_sq[{name}]"].mean()})
    return pd.DataFrame(rows).set_index(["method", "group"])


def largest_steps(draws: pd.DataFrame, variant: str, n: int = 5) -> pd.DataFrame:
    """The ``n`` draws of ``variant`` with the largest output change: the drawn training image, its label
    in the training set, the model's probability of the label the score used (drawn from the model),
    the output change, its share of the sum over all draws, the squared step, the step's share
    on the coordinates whose diagonal Fisher is below the ridge, and the layer whose part of the step
    alone changes the outputs most."""
    d = draws[draws["variant"] == variant]
    layers = [c for c in d.columns if c.startswith("output_sq[layer ")]
    top = d.nlargest(n, "output_sq")
    return pd.DataFrame({
        "training image": top["row"].to_numpy(), "training label": top["training_label"].to_numpy(),
        "probability of the drawn label": np.exp(top["log_prob"].to_numpy()),
        "mean (J u)^2": top["output_sq"].to_numpy(),
        "share of the sum": (top["output_sq"] / d["output_sq"].sum()).to_numpy(),
        "||u||^2": top["step_sq"].to_numpy(),
        "share of ||u||^2 below the ridge": (top["step_sq[diag Fisher below ridge]"] / top["step_sq"]).to_numpy(),
        "layer changing the outputs most": [c[len("output_sq["):-1] for c in top[layers].idxmax(axis=1)],
    }, index=pd.RangeIndex(1, len(top) + 1, name="rank"))


def step_law_surprise(draws: pd.DataFrame, threshold: float = 0.5) -> pd.DataFrame:
    """How much of each variant's steps come from surprising labels: the share of the draws whose drawn
    label had model probability below ``threshold``, and those draws' share of ``E ||s||^2``, of
    ``E ||u||^2`` and of ``E mean (J u)^2``."""
    rows = []
    for variant, d in draws.groupby("variant", sort=False):
        rare = np.exp(d["log_prob"]) < threshold
        rows.append({"method": f"SMP-{variant}", f"share of draws with p(Y | X) < {threshold:g}": rare.mean(),
                     **{f"their share of {label}": d.loc[rare, column].sum() / d[column].sum()
                        for column, label in (("score_sq", "E||s||^2"), ("step_sq", "E||u||^2"),
                                              ("output_sq", "E mean (J u)^2"))}})
    return pd.DataFrame(rows).set_index("method")


def cached_run(cfg: dict[str, Any], variant: str, theta_map: torch.Tensor, data: dict,
               device: torch.device | None = None, use_cache: bool = True, progress: bool = True,
               cache_root: str = ".cache", replicate: int = 0):
    """One run of a study's variant (:func:`run_variant`), from the cache :func:`run_replicates` fills
    (``<cache_root>/<study>/``, :func:`run_key`), or run now and cached there."""
    device = device or default_device()
    index = study_variants(cfg).index(variant)
    def compute():
        return run_variant(cfg, variant, theta_map, data, index, device, None, progress, replicate=replicate)

    return cached(cfg.get("study", "mnist"), run_key(cfg, variant, replicate, smp_path(device)), compute,
                  root=cache_root, enabled=use_cache)


def linearised_against_actual(theta_map: torch.Tensor, thetas: torch.Tensor, x_eval: torch.Tensor,
                              device: torch.device | None = None) -> pd.DataFrame:
    """Per chain of a run, how far it moved and whether the linearised network describes its move.

    On the images ``x_eval``: the chain's share of the logit variance (its squared deviation from the
    chains' mean logits over the sum of all chains'), its largest move from the MAP (max-norm), its
    squared distance, the actual change of its logits from the MAP's, ``mean_{x, c} (f_l - f_0)^2``,
    and the linearised change ``mean_{x, c} (J (theta_l - theta_0))^2`` (a Jacobian-vector product),
    which is what :func:`step_law_at_map` measures step by step. Rows: chains left out by the run
    (NaN) are dropped; sorted by share, largest first.
    """
    device = device or default_device()
    module = lenet5().to(device)
    layout = as_chain_model(module, INPUT_SHAPE).layout
    x = x_eval.to(device).reshape(-1, *INPUT_SHAPE)
    theta0 = theta_map.to(device)
    kept = torch.isfinite(thetas).all(1)
    chains = kept.nonzero().reshape(-1).tolist()
    thetas = thetas[kept].to(device)

    def logits(flat):
        return torch.func.functional_call(module, layout.unflatten(flat), (x,))

    with torch.no_grad():
        base = logits(theta0)
        actual = torch.stack([logits(t) for t in thetas])  # (S, n, C)
        linear = torch.stack([torch.func.jvp(logits, (theta0,), (t - theta0,))[1] for t in thetas])
    deviation = (actual - actual.mean(0)).square().sum((1, 2))
    delta = thetas - theta0
    table = pd.DataFrame({
        "chain": chains, "share of the logit variance": (deviation / deviation.sum()).cpu().numpy(),
        "largest move": delta.abs().amax(1).cpu().numpy(),
        "||theta - theta_0||^2": delta.square().sum(1).cpu().numpy(),
        "actual mean (f - f_0)^2": (actual - base).square().flatten(1).mean(1).cpu().numpy(),
        "linearised mean (J (theta - theta_0))^2": linear.square().flatten(1).mean(1).cpu().numpy()})
    return table.sort_values("share of the logit variance", ascending=False).reset_index(drop=True)
