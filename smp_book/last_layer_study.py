"""Beyond the paper: SMP on LeNet-5's last layer(s) only, beside the whole network (``notebooks/last_layer.md``).

The paper stops at diagonal preconditioners for MNIST because block and dense ones do not fit 47,154
parameters. On a subset of the weights they fit again. This study freezes LeNet-5 at the MNIST
chapter's MAP except for its last layer (d = 850) or its last two layers (d = 11,686), runs every
preconditioner that fits with every strategy, and scores the samples as the MNIST baselines chapter
scores its methods (the test set and the rotated test sets, the paper's metrics), beside the
whole-network SMP runs and the baselines of that chapter and a last-layer Laplace approximation fitted
with laplace-torch as its users run it.

Frozen layers are the same for every sample, so the study computes their output (the features) once
per image and runs SMP on the sampled layers alone, fed with the features: the same recursion, the same
random numbers and the same samples as SMP on the whole network with the other layers frozen
(``requires_grad=False``), which a test checks, at a fraction of the cost.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from smp_core.fisher import kronecker_layers
from smp_core.models import as_chain_model, lenet5, predict
from smp_core.preconditioners import ema_refresh_applies, preconditioner_from_name
from smp_core.recursion import Fisher, run_smp

from . import mnist_baseline_study as mbs
from . import mnist_study as ms
from .config import MNIST_TAU, get_config

SUBSETS = {"last layer": 1, "last two layers": 2}  # the sampled fully connected layers, counted from the output
PREFIX = {"last layer": "LL", "last two layers": "LL2"}
# Per subset, the structures run. For the last two layers a dense or block statistic is 11,686^2 or 10,836^2
# numbers, 0.5 GB in float32: per chain for the EMA and periodic strategies (50 GB for S = 100), and once,
# shared, for the fixed one, where instead every step multiplies each chain's score by that matrix (about
# 1.4e10 multiply-adds per step for S = 100, hours at K = 10^4 on two cores).
STRUCTURES = {"last layer": ["diag", "block", "dense", "kfac"], "last two layers": ["diag", "kfac"]}
STRATEGIES = ["fixed", "ema", "periodic"]
SEED_OFFSET = 3000  # the chains draw other random numbers than the whole-network runs
LAPLACE = "LL Laplace (laplace-torch)"


def config(scale: str) -> dict[str, Any]:
    """The MNIST baselines chapter's settings (data, MAP, S, K, lambda, T, the periodic Fisher's images, the
    rotated test sets) with the subsets, structures and strategies run here. tau (ours) is the paper's
    MNIST value of the diagonal with the same strategy for every structure, so that only the structure
    and the subset change; the EMA of block, dense and kfac refactorises every 50 steps (1 / (1 - beta)),
    as in the MNIST KFAC chapter."""
    base = get_config("mnist_baselines", scale)
    keep = ("n_train", "n_val", "n_test", "split_seed", "seed", "n_chains", "n_steps", "ridge", "period",
            "n_fisher_periodic", "shift_angles", "shift_images", "ensemble_members")
    return {"study": "last_layer", "scale": scale, **{k: base[k] for k in keep},
            **{k: v for k, v in base.items() if k.startswith("map_")},
            "subsets": SUBSETS, "structures": STRUCTURES, "strategies": STRATEGIES, "ema_refresh": 50,
            "tau": {s: MNIST_TAU[f"{s}-diag"] for s in STRATEGIES} | {"none": MNIST_TAU["none"]},
            "laplace": {"hessian_structure": "full", "prior_precision": "marglik", "n_samples": base["n_chains"]}}


def variants(cfg: dict[str, Any]) -> list[tuple[str, str]]:
    """``(subset, variant)`` of every run, in order: per subset ``none`` then every strategy and structure."""
    return [(subset, v) for subset in cfg["subsets"]
            for v in ["none"] + [f"{s}-{t}" for t in cfg["structures"][subset] for s in cfg["strategies"]]]


def split(theta_map: torch.Tensor, layers: int) -> tuple[nn.Sequential, nn.Sequential]:
    """LeNet-5 at ``theta_map`` cut before its last ``layers`` fully connected layers: ``(body, head)``."""
    net = lenet5()
    torch.nn.utils.vector_to_parameters(theta_map.to(torch.float32), net.parameters())
    linear = [i for i, m in enumerate(net) if isinstance(m, nn.Linear)]
    cut = linear[-layers]
    return net[:cut].eval(), net[cut:]


def features(body: nn.Module, sets: dict[Any, tuple[torch.Tensor, torch.Tensor]], batch: int = 5000):
    """``{name: (body(x), y)}``: the frozen layers' output for every set, computed once."""
    with torch.no_grad():
        return {k: (torch.cat([body(xb) for xb in x.split(batch)]), y) for k, (x, y) in sets.items()}


def run_variant(cfg: dict[str, Any], head: nn.Module, feats: dict, variant: str, index: int,
                progress: bool = True, checkpoint=None):
    """SMP on the sampled layers ``head`` from their MAP values, fed with the features of the training set;
    the empirical Fisher from the validation set's features (the periodic strategy: its first
    ``n_fisher_periodic``), as the MNIST chapter takes it."""
    model = as_chain_model(head)
    theta0 = torch.nn.utils.parameters_to_vector(head.parameters()).detach()
    strategy = variant.split("-")[0]
    refresh = cfg["ema_refresh"] if ema_refresh_applies(variant) else 1
    layers = kronecker_layers(model) if variant.endswith("-kfac") else ()
    precond = preconditioner_from_name(variant, dim=model.layout.dim, blocks=model.layout.block_slices,
                                       layers=layers, ridge=cfg["ridge"], period=cfg["period"], ema_init="fisher",
                                       ema_refresh=refresh)
    fv, yv = feats["val"]
    n_fisher = cfg.get("n_fisher_periodic") if strategy == "periodic" else None
    fisher = Fisher("empirical", fv[:n_fisher], yv[:n_fisher]) if n_fisher else Fisher("empirical", fv, yv)
    return run_smp(head, "categorical", feats["train"][0], theta0=theta0, preconditioner=precond,
                   tau=cfg["tau"][strategy if variant != "none" else "none"], n_steps=cfg["n_steps"],
                   n_chains=cfg["n_chains"], seed=cfg["seed"] + SEED_OFFSET + index, fisher=fisher,
                   progress=progress, options={"checkpoint": checkpoint})


def fit_laplace(cfg: dict[str, Any], theta_map: torch.Tensor, data: dict) -> dict[str, Any]:
    """The last-layer Laplace approximation with laplace-torch as its users run it: ``Laplace(model,
    "classification", subset_of_weights="last_layer", hessian_structure=...)``, fitted on the training
    set, the prior precision by maximising the marginal likelihood, ``n_samples`` draws of the last
    layer. The network is linear in its last layer, so these draws give laplace-torch's linearised (GLM)
    predictive with Monte Carlo link approximation (``link_approx="mc"``) exactly. Returns the draws
    ``(S, 850)``, the prior precision, the seconds and the fitted ``Laplace`` object (``la``)."""
    from laplace import Laplace
    from torch.utils.data import DataLoader, TensorDataset

    net = lenet5()
    torch.nn.utils.vector_to_parameters(theta_map.to(torch.float32), net.parameters())
    x, y = data["train"]
    started = time.perf_counter()
    la = Laplace(net, "classification", subset_of_weights="last_layer",
                 hessian_structure=cfg["laplace"]["hessian_structure"])
    la.fit(DataLoader(TensorDataset(x, y), batch_size=500))
    la.optimize_prior_precision(method=cfg["laplace"]["prior_precision"])
    generator = torch.Generator().manual_seed(cfg["seed"] + SEED_OFFSET - 1)
    draws = la.sample(n_samples=cfg["laplace"]["n_samples"], generator=generator).detach()
    return {"theta": draws, "prior_precision": float(la.prior_precision.reshape(-1)[0]),
            "seconds": time.perf_counter() - started, "la": la}


def run_study(cfg: dict[str, Any], data: dict, use_cache: bool = True, progress: bool = True,
              cache_root: str = ".cache") -> dict[str, Any]:
    """Every run of :func:`variants` and the Laplace approximation, each cached by the config and its name
    in ``<cache_root>/last_layer/``, evaluated on the test set and the rotated sets
    (:func:`smp_book.mnist_baseline_study.evaluate`). Returns ``evals`` by method, ``runs`` (one row per
    run: subset, variant, d, seconds, diverged chains) and the Laplace fit's prior precision."""
    from .results import cached, code_hash

    fit = ms.fit_map({**cfg, "study": "mnist"}, data, torch.device("cpu"), use_cache=use_cache,
                     progress=progress, cache_root=cache_root)
    theta_map = fit["theta"].cpu()
    sets = mbs.test_sets(cfg, data)
    chain = as_chain_model(lenet5(), ms.INPUT_SHAPE)
    map_probs = torch.softmax(predict(chain, theta_map[None], sets[0][0]).double(), -1)
    three = ms.ambiguous_three(map_probs, data["test"][1])

    def key(name):
        return {**cfg, "method": name, "code": code_hash(__name__)}

    evals, rows = {}, []
    for subset, n_layers in cfg["subsets"].items():
        body, head = split(theta_map, n_layers)
        feats = features(body, {**{a: s for a, s in sets.items()}, "train": data["train"], "val": data["val"]})
        model = as_chain_model(head)
        test_feats = {a: feats[a] for a in sets}
        for index, (sub, variant) in enumerate(variants(cfg)):
            if sub != subset:
                continue
            name = f"{PREFIX[subset]} SMP-{variant}"

            def compute(variant=variant, index=index, head=head, feats=feats, model=model, test_feats=test_feats):
                res = run_variant(cfg, head, feats, variant, index, progress)
                kept = res.theta[~res.diverged]
                return {"eval": mbs.evaluate(lambda f: predict(model, kept, f), test_feats, three),
                        "seconds": res.elapsed, "diverged": int(res.n_diverged)}

            out = cached("last_layer", key(name), compute, root=cache_root, enabled=use_cache)
            evals[name] = out["eval"]
            rows.append({"subset": subset, "variant": variant, "method": name, "d": model.layout.dim,
                         "seconds": out["seconds"], "diverged": out["diverged"]})
    body, head = split(theta_map, 1)
    feats = features(body, dict(sets))
    model = as_chain_model(head)

    def laplace():
        fitted = fit_laplace(cfg, theta_map, data)
        return {"eval": mbs.evaluate(lambda f: predict(model, fitted["theta"], f), feats, three),
                "seconds": fitted["seconds"], "prior_precision": fitted["prior_precision"]}

    la = cached("last_layer", key(LAPLACE), laplace, root=cache_root, enabled=use_cache)
    evals[LAPLACE] = la["eval"]
    rows.append({"subset": "last layer", "variant": "Laplace", "method": LAPLACE, "d": model.layout.dim,
                 "seconds": la["seconds"], "diverged": 0})
    return {"evals": evals, "runs": pd.DataFrame(rows).set_index("method"),
            "prior_precision": la["prior_precision"], "map_seconds": fit.get("seconds", np.nan)}


def verdicts(scores: pd.DataFrame, shift: pd.DataFrame, ensemble: str, worst: int) -> pd.DataFrame:
    """The chapter's three questions per method (ours, fixed before the laptop run); the MAP and the
    ensemble set the bars, so their rows are marked ``reference`` and left unjudged:

    * ``non_degenerate``: its mutual information on the test set is at least a tenth of the deep
      ensemble's (the MAP's is zero; SMP-none's on the whole network about a hundredth of it);
    * ``calibrated``: its ECE on the test set is at most twice the larger of the MAP's and the ensemble's;
    * ``helps_under_shift``: its NLL on the images rotated by the largest angle is below the MAP's.
    """
    mi_bar = scores.loc[ensemble, "mutual_info"] / 10
    ece_bar = 2 * max(scores.loc[ensemble, "ece"], scores.loc["MAP", "ece"])
    nll_worst = shift["nll"].xs(worst, level="angle")
    out = pd.DataFrame({"mutual_info": scores["mutual_info"], "ece": scores["ece"],
                        f"nll_at_{worst}": nll_worst.reindex(scores.index)})
    out["non_degenerate"] = out["mutual_info"] >= mi_bar
    out["calibrated"] = out["ece"] <= ece_bar
    out["helps_under_shift"] = out[f"nll_at_{worst}"] < nll_worst["MAP"]
    out["all_three"] = out["non_degenerate"] & out["calibrated"] & out["helps_under_shift"]
    reference = out.index.isin(["MAP", ensemble])
    out = out.astype({c: object for c in ("non_degenerate", "calibrated", "helps_under_shift", "all_three")})
    out.loc[reference, ["non_degenerate", "calibrated", "helps_under_shift", "all_three"]] = "reference"
    out.index.name = "method"
    return out


def compute(ctx) -> None:
    """The chapter's results (:mod:`smp_book.chapters`): the runs, the scores beside the MNIST baselines
    chapter's methods (read from its results), the verdicts, the rotation figure and the prose's numbers."""
    cfg = ctx.config
    data, _ = ms.load_data(cfg)
    study = run_study(cfg, data, use_cache=ctx.use_cache, progress=ctx.progress)
    ours = mbs.tables({**study, "fit_seconds": {m: study["runs"].loc[m, "seconds"] for m in study["evals"]},
                       "laplace": None})
    base = ctx.read("mnist_baselines")
    ensemble = f"Ensemble ({cfg['ensemble_members']})"
    base_scores = base.table("scores")
    # the baselines chapter's Laplace approximation with the lowest test NLL (of those that linearise)
    laplaces = [m for m in base_scores.index if m.startswith("Laplace-") and "-nn" not in m]
    best_laplace = base_scores.loc[laplaces, "nll"].idxmin()
    whole = [m for m in base_scores.index if m == "MAP" or m.startswith("SMP-")
             or m in (best_laplace, "MC dropout", ensemble)]
    scores = pd.concat([base_scores.loc[whole], ours["scores"]])
    shift = pd.concat([base.table("shift").loc[whole], ours["shift"]])
    ctx.table("runs", study["runs"])
    ctx.table("scores", scores)
    ctx.table("shift", shift)
    worst = max(cfg["shift_angles"])
    judged = ctx.table("verdicts", verdicts(scores, shift, ensemble, worst))
    smp_ll = [m for m in ours["scores"].index if m.startswith("LL") and m != LAPLACE]
    best = [m for m in smp_ll if judged.loc[m, "all_three"] not in ("reference", False)]
    shown_methods = ["MAP", ensemble, "SMP-fixed-diag"] + best[:4] + [LAPLACE]
    ctx.figure("rotation", mbs.rotation_figure(shift, list(dict.fromkeys(shown_methods))))
    ctx.value("passing", ", ".join(best) if best else "none")
    ctx.value("best_laplace", best_laplace)
    ctx.value("n_passing", len(best))
    ctx.value("n_runs", len(smp_ll))
    ctx.value("prior_precision", study["prior_precision"])
    ctx.value("worst_angle", worst)
    ctx.value("n_steps", cfg["n_steps"])
    ctx.value("n_chains", cfg["n_chains"])
    seconds = ctx.value("smp_seconds", float(study["runs"].loc[smp_ll, "seconds"].sum()))
    # what K = 10^6 would cost: the step count scales the recursion's time (the Fisher's recomputations too)
    factor = ctx.value("paper_scale_factor", 1_000_000 / cfg["n_steps"])
    ctx.value("paper_scale_hours", seconds * factor / 3600)
