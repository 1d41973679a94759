"""The MNIST MAP-seeds chapter: every variant from several MAPs, and what moves the dispersion."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import torch

from .mnist_study import DIAGONAL_METHODS, fit_map, run_replicates
from .results import summarise_replicates, variance_components


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
