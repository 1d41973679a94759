"""Beyond the paper: SMP on LeNet-5's last layer(s) only, beside the whole network (``notebooks/last_layer.md``).

The paper stops at diagonal preconditioners for MNIST because block and dense ones do not fit 47,154
parameters; on a subset of the weights they fit again. This study freezes LeNet-5 at the MNIST chapter's MAP
except for its last layer (d = 850) or last two layers (d = 11,686), runs every preconditioner that fits with
every strategy (:mod:`smp_book.last_layer_runs`: SMP on the frozen layers' output, computed once) and scores
the samples as the MNIST baselines chapter scores its methods (the test set and the rotated test sets, the
paper's metrics), beside that chapter's whole-network SMP runs and baselines and a last-layer Laplace
approximation fitted with laplace-torch as its users run it.
"""

from __future__ import annotations

import time
from functools import partial
from itertools import groupby
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from smp_core.models import as_chain_model, lenet5, predict

from . import mnist_runs as mr
from . import shifted
from .config import MNIST_TAU, get_config
from .last_layer_runs import PREFIX, SEED_OFFSET, STRATEGIES, STRUCTURES, SUBSETS, features, run, split, variants
from .pipeline import CACHE, cached, code_hash

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
    chosen = {"select_map_from_seeds": base["select_map_from_seeds"]} if "select_map_from_seeds" in base else {}
    return {"study": "last_layer", "scale": scale, **{k: base[k] for k in keep}, **chosen,
            **{k: v for k, v in base.items() if k.startswith("map_")},
            "subsets": SUBSETS, "structures": STRUCTURES, "strategies": STRATEGIES, "ema_refresh": 50,
            "tau": {s: MNIST_TAU[f"{s}-diag"] for s in STRATEGIES} | {"none": MNIST_TAU["none"]},
            "laplace": {"hessian_structure": "full", "prior_precision": "marglik", "n_samples": base["n_chains"]}}


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
    started = time.perf_counter()
    la = Laplace(net, "classification", subset_of_weights="last_layer",
                 hessian_structure=cfg["laplace"]["hessian_structure"])
    la.fit(DataLoader(TensorDataset(*data["train"]), batch_size=500))
    la.optimize_prior_precision(method=cfg["laplace"]["prior_precision"])
    generator = torch.Generator().manual_seed(cfg["seed"] + SEED_OFFSET - 1)
    draws = la.sample(n_samples=cfg["laplace"]["n_samples"], generator=generator).detach()
    return {"theta": draws, "prior_precision": float(la.prior_precision.reshape(-1)[0]),
            "seconds": time.perf_counter() - started, "la": la}


def run_study(cfg: dict[str, Any], data: dict, use_cache: bool = True, progress: bool = True,
              cache_root: str | Path = CACHE) -> dict[str, Any]:
    """Every run of :func:`~smp_book.last_layer_runs.variants` (cached by :func:`~smp_book.last_layer_runs.run`)
    and the Laplace approximation (cached by the config and this module's code in ``<cache_root>/last_layer/``),
    evaluated with the MAP on the test set and the rotated sets (:func:`smp_book.shifted.evaluate`). Returns
    ``evals`` by method, the MAP's (``map_eval``, for the paired comparisons), ``runs`` (one row per run:
    subset, variant, d, seconds, diverged chains) and the Laplace fit's prior precision."""
    theta_map = mr.chapter_map({**cfg, "study": "mnist"}, data, torch.device("cpu"), use_cache=use_cache,
                               progress=progress, cache_root=cache_root)["theta"].cpu()
    sets = shifted.test_sets(cfg, data)
    chain = as_chain_model(lenet5(), mr.INPUT_SHAPE)
    map_probs = torch.softmax(predict(chain, theta_map[None], sets[0][0]).double(), -1)
    three = mr.ambiguous_three(map_probs, data["test"][1])
    map_eval = shifted.evaluate(partial(predict, chain, theta_map[None]), sets, three)
    evals, rows = {}, []
    for subset, runs in groupby(enumerate(variants(cfg)), key=lambda indexed: indexed[1][0]):  # subset by subset
        body, head = split(theta_map, cfg["subsets"][subset])
        feats = features(body, {**sets, "train": data["train"], "val": data["val"]})
        model, test_feats = as_chain_model(head), {a: feats[a] for a in sets}
        for index, (_, variant) in runs:
            name = f"{PREFIX[subset]} SMP-{variant}"
            out = run(cfg, subset, variant, index, head, feats, use_cache, progress, cache_root)
            evals[name] = shifted.evaluate(partial(predict, model, out["theta"]), test_feats, three)
            rows.append({"subset": subset, "variant": variant, "method": name, "d": model.layout.dim,
                         "seconds": out["seconds"], "diverged": out["diverged"]})
    body, head = split(theta_map, 1)
    feats, model = features(body, sets), as_chain_model(head)
    la = cached("last_layer", {**cfg, "method": LAPLACE, "code": code_hash(__name__)},
                lambda: {k: v for k, v in fit_laplace(cfg, theta_map, data).items() if k != "la"}, root=cache_root,
                enabled=use_cache)
    evals[LAPLACE] = shifted.evaluate(partial(predict, model, la["theta"]), feats, three)
    rows.append({"subset": "last layer", "variant": "Laplace", "method": LAPLACE, "d": model.layout.dim,
                 "seconds": la["seconds"], "diverged": 0})
    return {"evals": evals, "map_eval": map_eval, "runs": pd.DataFrame(rows).set_index("method"),
            "prior_precision": la["prior_precision"]}


def verdicts(scores: pd.DataFrame, leads: pd.DataFrame, ensemble: str, worst: int) -> pd.DataFrame:
    """The chapter's three questions per method (ours); the MAP and the ensemble set the bars, so their rows are
    marked ``reference`` and left unjudged. ``non_degenerate``: its mutual information on the test set is at
    least a tenth of the deep ensemble's (the MAP's is zero; SMP-none's on the whole network about a hundredth
    of it). ``calibrated``: its test ECE is at most twice the larger of the MAP's and the ensemble's.
    ``helps_under_shift``: its NLL on the images rotated by the largest angle (``worst``) is below the MAP's by
    at least two standard errors of the difference, paired over the images (``leads``, method x angle, as
    :func:`smp_book.shifted.leads_over` gives them), the MNIST baselines chapter's bar."""
    out = pd.DataFrame({"mutual_info": scores["mutual_info"], "ece": scores["ece"],
                        f"nll_lead_at_{worst}": leads[worst].reindex(scores.index)})
    out["non_degenerate"] = out["mutual_info"] >= scores.loc[ensemble, "mutual_info"] / 10
    out["calibrated"] = out["ece"] <= 2 * max(scores.loc[ensemble, "ece"], scores.loc["MAP", "ece"])
    out["helps_under_shift"] = out[f"nll_lead_at_{worst}"] >= 2
    out["all_three"] = out["non_degenerate"] & out["calibrated"] & out["helps_under_shift"]
    judged = ["non_degenerate", "calibrated", "helps_under_shift", "all_three"]
    out = out.astype(dict.fromkeys(judged, object))
    out.loc[out.index.isin(["MAP", ensemble]), judged] = "reference"
    return out.rename_axis("method")


def compute(ctx) -> None:
    """The chapter's results (:mod:`smp_book.pipeline`): the runs, the scores beside the MNIST baselines
    chapter's methods (read from its results), the verdicts, the rotation figure and the prose's numbers."""
    cfg = ctx.config
    study = run_study(cfg, mr.load_data(cfg)[0], use_cache=ctx.use_cache, progress=ctx.progress)
    ours = shifted.tables({**study, "fit_seconds": study["runs"]["seconds"].to_dict(), "laplace": None})
    base = ctx.read("mnist_baselines")
    ensemble = f"Ensemble ({cfg['ensemble_members']})"
    base_scores = base.table("scores")
    # the baselines chapter's Laplace approximation with the lowest test NLL (of those that linearise)
    laplaces = [m for m in base_scores.index if m.startswith("Laplace-") and "-nn" not in m]
    best_laplace = base_scores.loc[laplaces, "nll"].idxmin()
    whole = [m for m in base_scores.index if m == "MAP" or m.startswith("SMP-")
             or m in (best_laplace, "MC dropout", ensemble)]
    ctx.table("runs", study["runs"])
    scores = ctx.table("scores", pd.concat([base_scores.loc[whole], ours["scores"]]))
    shift = ctx.table("shift", pd.concat([base.table("shift").loc[whole], ours["shift"]]))
    ours_leads = shifted.leads_over({"MAP": study["map_eval"], **study["evals"]}).drop(index="MAP")
    base_leads = base.table("nll_lead_over_map").rename(columns=int)
    leads = ctx.table("nll_lead_over_map", pd.concat([base_leads.loc[whole], ours_leads]))
    worst = max(cfg["shift_angles"])
    judged = ctx.table("verdicts", verdicts(scores, leads, ensemble, worst))
    smp_ll = [m for m in ours["scores"].index if m.startswith("LL") and m != LAPLACE]
    best = [m for m in smp_ll if judged.loc[m, "all_three"] not in ("reference", False)]
    shown_methods = ["MAP", ensemble, "SMP-fixed-diag"] + best[:4] + [LAPLACE]
    ctx.figure("rotation", shifted.rotation_figure(shift, list(dict.fromkeys(shown_methods))))
    seconds = float(study["runs"].loc[smp_ll, "seconds"].sum())
    factor = 1_000_000 / cfg["n_steps"]  # K = 10^6 scales the recursion's time (the Fisher's recomputations too)
    for name, value in {
        "passing": ", ".join(best) if best else "none", "best_laplace": best_laplace, "n_passing": len(best),
        "n_runs": len(smp_ll), "prior_precision": study["prior_precision"], "worst_angle": worst,
        "n_steps": cfg["n_steps"], "n_chains": cfg["n_chains"], "smp_seconds": seconds,
        "paper_scale_factor": factor, "paper_scale_hours": seconds * factor / 3600,
    }.items():
        ctx.value(name, value)
