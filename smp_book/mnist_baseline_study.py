"""Beyond the paper: SMP on MNIST beside Laplace approximations, MC dropout and a deep ensemble.

The paper compares its MNIST SMP variants only with the MAP (Section 3.3; its Section 4.5 names the missing
comparison with other approximate methods). This study puts them beside the methods a practitioner would
reach for, at the same MAP LeNet-5 and on the same test set:

* the MNIST chapter's MAP and its four SMP runs (replicate 0, under the same cache keys: the same runs);
* laplace-torch's Laplace approximation at the MAP (:func:`smp_book.baselines.fit_laplace`), its GGN kept
  ``diag`` or ``kfac`` (``kron``), under the MAP's own prior precision (:func:`weight_decay_prior`) and the
  one that maximises the evidence; each with the linearised ("GLM") predictive and, at the MAP's prior, the
  network's own;
* a deep ensemble of ``M`` MAPs from random starts (member 0 is the MAP but at the paper scale, where the
  MAP is the member with the lowest validation loss);
* MC dropout (Gal and Ghahramani 2016): LeNet-5 with dropout before each fully connected layer, trained as
  the MAP for every rate of ``dropout_rates``; the rate with the lowest validation NLL predicts.

Every method is scored on the whole test set with the paper's metrics and on the first ``shift_images`` test
images rotated by each of ``shift_angles`` degrees (a distribution shift, as Ovadia et al. 2019). Differences
in NLL and Brier score get a standard error paired over the test images: it measures the test set's sampling
error, not the spread over training runs (one MAP, one SMP run, one ensemble here).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import cache, partial
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from smp_core import metrics
from smp_core.models import as_chain_model, lenet5, predict

from . import baselines, shifted
from . import mnist_runs as mr
from .config import MNIST_BASELINE_KEYS
from .pipeline import CACHE, cached, code_hash
from .summaries import paired_lead

PRIORS = ("wd", "evidence")  # the MAP's prior precision and the evidence-maximising one
DROPOUT = "MC dropout"  # the row of MC dropout, at the rate chosen on the validation set
ensemble_seed = mr.map_seed  # member m's MAP seed (member 0's is the MNIST chapter's MAP but at the paper scale)


def mnist_settings(cfg: dict[str, Any], dropout: float | None = None) -> dict[str, Any]:
    """The MNIST study's config inside this study's (the keys of the MAP and SMP runs' caches); with a
    ``dropout`` rate, the settings of the LeNet-5 trained with that dropout (its own MAP cache key)."""
    settings = {**{k: v for k, v in cfg.items() if k not in MNIST_BASELINE_KEYS}, "study": "mnist"}
    return settings if dropout is None else {**settings, "map_dropout": float(dropout)}


def weight_decay_prior(cfg: dict[str, Any]) -> float:
    """``alpha = N * wd``: coupled weight decay ``wd`` on the mean NLL of ``N`` examples (the MAP minimised
    the mean NLL plus ``wd/2 |theta|^2``) is the prior ``N(0, I / (N wd))`` on the summed NLL."""
    return cfg["n_train"] * cfg["map_weight_decay"]


def draw_seeds(cfg: dict[str, Any]) -> dict[str, dict[str, int]]:
    """The seeds of the baselines' own draws: each Laplace posterior's samples (``"<structure> (<prior>)"``,
    shared by its linearised and ``-nn`` rows) and MC dropout's masks on the validation set (to choose the
    rate) and on the test sets."""
    structures = cfg["laplace_structures"]
    laplace = {f"{st} ({pr})": cfg["seed"] + 500 + 10 * structures.index(st) + PRIORS.index(pr)
               for st in structures for pr in PRIORS}
    return {"laplace": laplace, "dropout_masks": {"validation": cfg["seed"] + 600, "test": cfg["seed"] + 601}}


def method_names(cfg: dict[str, Any]) -> list[str]:
    """The rows of the tables, in order."""
    names = mr.method_names()
    for structure in cfg["laplace_structures"]:
        names += [f"Laplace-{structure} (wd)", f"Laplace-{structure} (evidence)", f"Laplace-{structure}-nn (wd)"]
    if cfg.get("dropout_rates"):
        names.append(DROPOUT)
    return names + [f"Ensemble ({cfg['ensemble_members']})"]


def fit_laplaces(cfg: dict[str, Any], theta_map: torch.Tensor, data: dict,
                 device: torch.device) -> tuple[dict[str, Any], pd.DataFrame]:
    """The Laplace posteriors ``{"<structure> (<prior>)": posterior}`` (the evidence's prior by laplace-torch's
    ``optimize_prior_precision(method="marglik")`` from the weight-decay prior) and a table of their prior
    precision ``alpha``, the summed log likelihood at the MAP, the log evidence, the effective number of
    parameters ``gamma = sum_i lambda_i / (lambda_i + alpha)`` (``lambda_i`` the summed GGN's eigenvalues), the
    fraction of flat directions (``lambda_i <= 1e-10 max lambda``), MacKay's ratio ``gamma / (alpha |theta|^2)``
    (1 at the evidence's maximum in ``alpha``), the norm of the log posterior's gradient at the MAP (0 at the
    stationary point the approximation assumes) and the seconds of the fit."""
    x, y = (t.to(device) for t in data["train"])
    if x.shape[0] != cfg["n_train"]:
        raise ValueError(f"the config says n_train = {cfg['n_train']}, the data has {x.shape[0]} training images")
    theta = theta_map.to(device)
    args = (lenet5().to(device), "categorical", theta, x, y)  # the network, its likelihood, the MAP, the data
    started = time.perf_counter()
    log_lik = baselines.log_likelihood(*args, input_shape=mr.INPUT_SHAPE)
    log_lik_seconds = time.perf_counter() - started
    grad = baselines.log_likelihood_gradient(*args, input_shape=mr.INPUT_SHAPE).double()
    sq_norm, posteriors, rows = float(theta.double().square().sum()), {}, []

    def now() -> float:  # the seconds of a GPU's work, not of its queueing
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    for structure in cfg["laplace_structures"]:
        started = now()
        base = baselines.fit_laplace(*args, prior_precision=weight_decay_prior(cfg), structure=structure,
                                     input_shape=mr.INPUT_SHAPE)
        eigenvalues = base.ggn_eigenvalues()
        fitted = now()
        best = base.optimise_prior_precision()
        fit_seconds, search_seconds = fitted - started, now() - fitted
        for prior, post in (("wd", base), ("evidence", best)):
            a = post.prior_precision
            gamma = float((eigenvalues / (eigenvalues + a)).sum())
            rows.append({"structure": structure, "prior": prior, "prior_precision": a, "log_likelihood": log_lik,
                         "log_evidence": post.log_marginal_likelihood(), "effective_parameters": gamma,
                         "flat_fraction": float((eigenvalues <= 1e-10 * eigenvalues.max()).double().mean()),
                         "mackay_ratio": gamma / (a * sq_norm),
                         "gradient_norm": float((grad - a * theta.double()).norm()),
                         "seconds": log_lik_seconds + fit_seconds + (search_seconds if prior == "evidence" else 0.0)})
            posteriors[f"{structure} ({prior})"] = post
    return posteriors, pd.DataFrame(rows).set_index(["structure", "prior"])


def select_dropout(cfg: dict[str, Any], data: dict, device: torch.device, use_cache: bool = True,
                   progress: bool = True, cache_root: str | Path = CACHE) -> pd.DataFrame:
    """Train LeNet-5 with every rate of ``cfg["dropout_rates"]`` (cached with the MNIST chapter's MAPs) and score
    its MC predictive (``S = n_chains`` passes) on the validation set: per rate the NLL and accuracy, the seconds
    of the training and of the passes, and ``selected`` (the lowest NLL, the first on a tie)."""
    xv, yv = data["val"]
    rows = []
    for rate in cfg["dropout_rates"]:
        fit = mr.fit_map(mnist_settings(cfg, rate), data, device, use_cache=use_cache, progress=progress,
                         cache_root=cache_root)
        started = time.perf_counter()
        masks = torch.Generator().manual_seed(draw_seeds(cfg)["dropout_masks"]["validation"])
        logits = baselines.mc_dropout_logits(lenet5(rate).to(device), fit["theta"].to(device), xv.to(device),
                                             cfg["n_chains"], masks)
        scores = metrics.all_scores(torch.softmax(logits.cpu().double(), dim=-1), yv)
        rows.append({"dropout": float(rate), "val_nll": scores["nll"], "val_accuracy": scores["accuracy"],
                     "train_seconds": fit["seconds"], "val_seconds": time.perf_counter() - started})
    table = pd.DataFrame(rows).set_index("dropout")
    table["selected"] = table.index == table["val_nll"].idxmin()
    return table


def run_study(cfg: dict[str, Any], data: dict, device: torch.device, use_cache: bool = True, progress: bool = True,
              cache_root: str | Path = CACHE) -> dict[str, Any]:
    """Fit and score every method of :func:`method_names`. The MAPs (the ensemble's and MC dropout's too) and
    the SMP runs are cached with the MNIST chapter's, in ``<cache_root>/mnist/``; each method's scores, the
    Laplace table and MC dropout's choice in ``<cache_root>/mnist_baselines/``. Returns ``evals``
    (:func:`smp_book.shifted.evaluate` per method), ``fit_seconds`` (MC dropout's: every rate's training and
    validation), ``laplace`` (:func:`fit_laplaces`' table), ``dropout`` (:func:`select_dropout`'s), the MAP
    fit and the ambiguous 3."""
    mnist_cfg = mnist_settings(cfg)
    fit = mr.chapter_map(mnist_cfg, data, device, use_cache=use_cache, progress=progress, cache_root=cache_root)
    theta_map = fit["theta"]
    chain = as_chain_model(lenet5().to(device), mr.INPUT_SHAPE)
    net = lenet5().to(device)
    sets = shifted.test_sets(cfg, data)
    map_probs = torch.softmax(predict(chain, theta_map[None].to(device), sets[0][0].to(device)).cpu().double(), -1)
    three = mr.ambiguous_three(map_probs, data["test"][1])
    path, seeds = mr.smp_path(device), draw_seeds(cfg)
    store = partial(cached, "mnist_baselines", root=cache_root, enabled=use_cache)
    fit_map = partial(mr.fit_map, data=data, device=device, use_cache=use_cache, progress=False, cache_root=cache_root)
    laplace_fits = cache(lambda: fit_laplaces(cfg, theta_map, data, device))  # once, where a Laplace row is needed

    def key(name: str) -> dict[str, Any]:
        # each method's key holds the settings it depends on: MC dropout's grid only in MC dropout's
        settings = cfg if name.startswith(DROPOUT) else {k: v for k, v in cfg.items() if k != "dropout_rates"}
        return {**settings, "method": name, "code": code_hash(__name__), "smp_path": path}

    def score(logits_of) -> dict:  # logits_of(x), or parameter samples of the network's own predictive
        if isinstance(logits_of, torch.Tensor):
            return score(partial(predict, chain, logits_of.to(device)))
        return shifted.evaluate(lambda x: logits_of(x.to(device)).cpu(), sets, three)

    laplace = store(key("Laplace fits"), lambda: laplace_fits()[1]) if cfg["laplace_structures"] else None
    choose_rate = partial(select_dropout, cfg, data, device, use_cache, progress, cache_root)
    dropout = store(key(f"{DROPOUT} selection"), choose_rate) if cfg.get("dropout_rates") else None

    def method(name: str) -> tuple[Callable[[], dict], float]:
        """``(compute, fit seconds)`` of one row; ``compute()`` scores it (not called where its scores are cached)."""
        if name == "MAP":
            return partial(score, theta_map[None]), fit["seconds"]
        if name.startswith("SMP-"):
            variant = name.removeprefix("SMP-")
            index = mr.study_variants(mnist_cfg).index(variant)
            run = cached("mnist", mr.run_key(mnist_cfg, variant, 0, path),
                         lambda: mr.run_variant(mnist_cfg, variant, theta_map, data, index, device, None, progress),
                         root=cache_root, enabled=use_cache)
            return partial(score, run.theta[~run.diverged]), run.elapsed
        if name.startswith("Laplace-"):
            label, prior = name.removeprefix("Laplace-").removesuffix(")").split(" (")
            structure = label.removesuffix("-nn")
            posterior = f"{structure} ({prior})"

            def laplace_scores() -> dict:
                gen = torch.Generator().manual_seed(seeds["laplace"][posterior])
                samples = laplace_fits()[0][posterior].sample(cfg["n_chains"], gen).to(device)
                if label.endswith("-nn"):
                    return score(samples)
                return score(lambda x: baselines.linearised_logits(net, theta_map.to(device), samples, x,
                                                                    input_shape=mr.INPUT_SHAPE))

            return laplace_scores, float(laplace.loc[(structure, prior), "seconds"])
        if name == DROPOUT:
            rate = float(dropout.index[dropout["selected"]][0])

            def dropout_scores() -> dict:
                theta, dropped = fit_map(mnist_settings(cfg, rate))["theta"].to(device), lenet5(rate).to(device)
                return score(lambda x: baselines.mc_dropout_logits(
                    dropped, theta, x, cfg["n_chains"], torch.Generator().manual_seed(seeds["dropout_masks"]["test"])))

            return dropout_scores, float(dropout["train_seconds"].sum() + dropout["val_seconds"].sum())
        # the ensemble: the MAPs of the ensemble seeds
        members = [fit_map({**mnist_cfg, "seed": ensemble_seed(cfg, m)}) for m in range(cfg["ensemble_members"])]
        return partial(score, torch.stack([m["theta"] for m in members])), float(sum(m["seconds"] for m in members))

    evals, fit_seconds = {}, {}
    for name in tqdm(method_names(cfg), desc="methods", disable=not progress):
        compute, fit_seconds[name] = method(name)
        evals[name] = store(key(name), compute)
    return {"evals": evals, "fit_seconds": fit_seconds, "laplace": laplace, "dropout": dropout, "map": fit,
            "three": three}


def findings(evals: dict[str, dict], resolved_at: float = 2.0) -> pd.DataFrame:
    """Per test set (angle) and metric (NLL, Brier score): the best method, the runner-up and the best SMP
    variant (when it is neither), each lead in standard errors of the mean per-image difference (paired over
    the test images: the test set's sampling error only), resolved from ``resolved_at``."""
    rows = []
    for angle in next(iter(evals.values()))["per_image"]:
        for metric in ("nll", "brier"):
            per_image = {n: e["per_image"][angle][metric].double() for n, e in evals.items()}
            ranked = sorted(per_image, key=lambda n: float(per_image[n].mean()))
            best = ranked[0]
            smp = [n for n in ranked if n.startswith("SMP-")]
            comparisons = [("runner-up", ranked[1])]
            if smp and smp[0] not in ranked[:2]:  # the best SMP variant, unless it is one of the two
                comparisons.append(("best SMP", smp[0]))
            for what, other in comparisons:
                lead = paired_lead((per_image[other] - per_image[best]).numpy())
                rows.append({"angle": angle, "metric": metric, "best": best,
                             "best_value": float(per_image[best].mean()), "compared": what, "other": other,
                             "other_value": float(per_image[other].mean()), "lead_se": lead,
                             "resolved": bool(lead >= resolved_at)})
    return pd.DataFrame(rows)


CALIBRATION_SHOWN = ("MAP", "SMP-none", "SMP-periodic-diag", "Laplace-diag (evidence)", "Laplace-kfac (wd)",
                     "Laplace-kfac (evidence)", DROPOUT)
"""The methods of the calibration figure (with the ensemble), where they are among the study's rows."""


def compute(ctx) -> None:
    """The chapter's results (:mod:`smp_book.pipeline`): :func:`run_study`'s tables (the Laplace one with the
    prior's term ``alpha |theta_MAP|`` beside the gradient norm), the MAP and SMP rows' distance from the MNIST
    chapter's, the findings, the NLL leads over the MAP, two figures and the numbers the prose quotes."""
    from . import plots

    cfg = ctx.config
    device = mr.default_device()
    data, provenance = mr.load_data(cfg)
    study = run_study(cfg, data, device, use_cache=ctx.use_cache, progress=ctx.progress)
    out = shifted.tables(study)
    theta_map = study["map"]["theta"]
    norm = float(theta_map.double().norm())
    out["laplace"] = out["laplace"].assign(prior_term=out["laplace"]["prior_precision"] * norm)
    for name, table in out.items():
        ctx.table(name, table)
    s = out["scores"]

    # the MAP and SMP rows are the MNIST chapter's replicate 0: how far from its result files
    theirs = ctx.read("mnist").table("scores_replicates").loc[0]
    same = [m for m in mr.method_names() if m in theirs.index and m in s.index]
    gap = (theirs.loc[same] - s.loc[same, theirs.columns]).abs().max(axis=1).rename("largest_difference")
    ctx.table("mnist_chapter_gap", gap.to_frame())

    found = ctx.table("findings", findings(study["evals"]), index=False)
    ctx.table("nll_lead_over_map", shifted.leads_over(study["evals"]))
    shown = [n for n in (*CALIBRATION_SHOWN, f"Ensemble ({cfg['ensemble_members']})") if n in study["evals"]]
    ctx.figure("calibration_baselines", plots.calibration_all({n: study["evals"][n]["curve"] for n in shown},
                                                              "Calibration, MNIST test set"))
    ctx.figure("rotation", shifted.rotation_figure(out["shift"], list(s.index)))

    smp, worst = [m for m in s.index if m.startswith("SMP-")], max(cfg["shift_angles"])
    nll = out["shift"]["nll"].unstack("angle")
    wd = out["laplace"].xs("wd", level="prior").iloc[0]  # the first structure's, under the MAP's prior
    values = {
        **{k: cfg[k] for k in ("n_train", "n_val", "n_test", "n_chains", "n_steps", "ensemble_members",
                               "map_weight_decay")},
        "dim": theta_map.numel(), "angles": " and ".join(str(a) for a in cfg["shift_angles"]), "worst_angle": worst,
        "shift_images": min(cfg["shift_images"], cfg["n_test"]),
        "dropout_rates": ", ".join(f"{r:g}" for r in cfg.get("dropout_rates", [])),
        "wd_prior": weight_decay_prior(cfg), "mnist_chapter_gap": float(gap.max()) if len(gap) else float("nan"),
        "ambiguous_index": study["three"], "ambiguous_label": int(data["test"][1][study["three"]]),
        "map_nll": s.loc["MAP", "nll"], "best_nll_method": s["nll"].idxmin(), "best_nll": s["nll"].min(),
        "best_smp": s.loc[smp, "nll"].idxmin(), "best_smp_nll": s.loc[smp, "nll"].min(),
        "best_shift_method": nll[worst].idxmin(), "best_shift_nll": nll[worst].min(),
        "map_shift_nll": nll.loc["MAP", worst],
        "best_smp_shift": nll.loc[smp, worst].idxmin(), "best_smp_shift_nll": nll.loc[smp, worst].min(),
        "resolved_findings": int(found["resolved"].sum()), "findings": len(found),
        "theta_norm": norm, "wd_gradient_norm": wd["gradient_norm"], "wd_prior_term": wd["prior_term"],
        "wd_gradient_ratio": wd["gradient_norm"] / wd["prior_term"],
        "wd_gradient_per_image": wd["gradient_norm"] / cfg["n_train"],
    }
    if "dropout" in out:
        values["dropout_rate"] = float(out["dropout"].index[out["dropout"]["selected"]][0])
    for name, value in values.items():
        ctx.value(name, value)
    mnist_cfg = mnist_settings(cfg)
    ctx.record(seeds={"split": cfg["split_seed"], "map": study["map"]["seed"],
                      "ensemble": [ensemble_seed(cfg, m) for m in range(cfg["ensemble_members"])],
                      "smp": {v: mr.smp_seed(mnist_cfg, i) for i, v in enumerate(mr.study_variants(mnist_cfg))},
                      **draw_seeds(cfg)},
               device=str(device), data=provenance, ambiguous_three=study["three"])
