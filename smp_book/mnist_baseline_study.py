"""Beyond the paper: SMP on MNIST beside Laplace approximations and a deep ensemble.

The paper compares its MNIST SMP variants only with the MAP (Section 3.3; its Section 4.5 names the
missing comparison with other approximate methods). This study puts them beside the methods a
practitioner would reach for, at the same MAP LeNet-5 and on the same test set:

* the MNIST chapter's MAP and its four SMP runs (replicate 0: the same cache keys, so the runs are
  shared with that chapter);
* the Laplace approximation at the MAP, laplace-torch's as its users run it
  (:func:`smp_book.baselines.fit_laplace`), with the GGN kept ``diag`` or ``kfac`` (laplace-torch's
  ``kron``), under two prior precisions: the MAP's own, ``N * weight decay`` (the MAP minimised the mean
  NLL plus ``wd/2 |theta|^2``, i.e. the sum of the NLL plus ``N wd/2 |theta|^2``), and the one that
  maximises the Laplace evidence (laplace-torch's ``optimize_prior_precision(method="marglik")``);
  each with the linearised ("GLM") predictive and, at the MAP's prior, the network's own;
* a deep ensemble of ``M`` MAPs from random starts (member 0 is the MAP at the laptop and ci scales; at
  the paper scale the MAP is the member with the lowest validation loss);
* MC dropout (Gal and Ghahramani 2016): LeNet-5 with dropout before each fully connected layer,
  trained with the MAP's settings, the config's seed and minibatch order for every rate of ``dropout_rates``; the
  rate whose MC predictive (``S = n_chains`` passes) has the lowest NLL on the validation set
  predicts (:func:`select_dropout`).

Every method is scored on the whole test set with the paper's metrics and on the first
``shift_images`` test images rotated by each of ``shift_angles`` degrees (a distribution shift, as
Ovadia et al. 2019). Differences in NLL and Brier score between two methods get a standard error
paired over the test images: it measures the test set's sampling error, not the spread over
training runs (one MAP, one SMP run, one ensemble here).
"""

from __future__ import annotations

import time
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


def mnist_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The MNIST study's config inside this study's: the keys of the MAP and SMP runs' caches."""
    return {**{k: v for k, v in cfg.items() if k not in MNIST_BASELINE_KEYS}, "study": "mnist"}


def weight_decay_prior(cfg: dict[str, Any]) -> float:
    """``alpha = N * wd``: coupled weight decay ``wd`` on the mean NLL of ``N`` examples is the prior
    ``N(0, I / (N wd))`` on the sum (:func:`smp_book.mnist_study.train_map`)."""
    return cfg["n_train"] * cfg["map_weight_decay"]


def ensemble_seed(cfg: dict[str, Any], member: int) -> int:
    """The MAP seed of ensemble member ``member``; member 0 is the MNIST chapter's MAP itself at the laptop
    and ci scales (at the paper scale that MAP is the member with the lowest validation loss,
    :func:`smp_book.mnist_study.chapter_map`)."""
    return mr.map_seed(cfg, member)


def dropout_seed(cfg: dict[str, Any], part: str) -> int:
    """The seed of MC dropout's masks: ``seed + 600`` on the validation set (the choice of the rate),
    ``seed + 601`` on the test sets."""
    return cfg["seed"] + {"validation": 600, "test": 601}[part]


def dropout_settings(cfg: dict[str, Any], rate: float) -> dict[str, Any]:
    """The MNIST settings of the LeNet-5 trained with dropout ``rate`` (its own MAP cache key)."""
    return {**mnist_settings(cfg), "map_dropout": float(rate)}


def laplace_seed(cfg: dict[str, Any], structure: str, prior: str) -> int:
    """The seed of the draws of one Laplace posterior (shared by its linearised and ``-nn`` rows, which
    so predict from the same draws): ``seed + 500 + 10 * (structure's place) + (prior's place)``."""
    return cfg["seed"] + 500 + 10 * cfg["laplace_structures"].index(structure) + PRIORS.index(prior)


def method_names(cfg: dict[str, Any]) -> list[str]:
    """The rows of the tables, in order."""
    names = mr.method_names()
    for structure in cfg["laplace_structures"]:
        names += [f"Laplace-{structure} (wd)", f"Laplace-{structure} (evidence)", f"Laplace-{structure}-nn (wd)"]
    if cfg.get("dropout_rates"):
        names.append(DROPOUT)
    return names + [f"Ensemble ({cfg['ensemble_members']})"]


def fit_laplaces(cfg: dict[str, Any], theta_map: torch.Tensor, data: dict,
                 device: torch.device | None = None) -> tuple[dict[str, Any], pd.DataFrame]:
    """The Laplace posteriors ``{"<structure> (<prior>)": posterior}`` (laplace-torch's, through
    :func:`smp_book.baselines.fit_laplace`) and a table of their prior precision, the log likelihood at the
    MAP (the sum over the training set), laplace-torch's log evidence, the effective number of parameters
    ``gamma = sum_i lambda_i / (lambda_i + alpha)`` (``lambda_i`` the eigenvalues of the GGN summed over the
    training set), the fraction of flat directions (eigenvalues at most 1e-10 of the largest, where the
    posterior is the prior), MacKay's ratio ``gamma / (alpha |theta_MAP|^2)`` (1 where the evidence is
    largest in ``alpha``, so it says whether laplace-torch's optimiser got there), the norm of the gradient
    of the log posterior at the MAP under that prior (0 at a stationary point, which the approximation
    assumes; Adam's 20 epochs need not reach one, and the evidence's alpha is not the one the MAP was
    fitted with) and the fitting seconds. The evidence's prior is laplace-torch's
    ``optimize_prior_precision(method="marglik")`` from the weight-decay prior, with its defaults."""
    device = device or mr.default_device()
    net = lenet5().to(device)
    x, y = (t.to(device) for t in data["train"])
    if x.shape[0] != cfg["n_train"]:
        raise ValueError(f"the config says n_train = {cfg['n_train']}, the data has {x.shape[0]} training images")
    theta = theta_map.to(device)
    sq_norm = float(theta.double().square().sum())
    started = time.perf_counter()
    log_lik = baselines.log_likelihood(net, "categorical", theta, x, y, input_shape=mr.INPUT_SHAPE)
    log_lik_seconds = time.perf_counter() - started
    grad = baselines.log_likelihood_gradient(net, "categorical", theta, x, y, input_shape=mr.INPUT_SHAPE).double()
    posteriors, rows = {}, []

    def now() -> float:  # the seconds of a GPU's work, not of its queueing
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    for structure in cfg["laplace_structures"]:
        started = now()
        base = baselines.fit_laplace(net, "categorical", theta, x, y, prior_precision=weight_decay_prior(cfg),
                                     structure=structure, input_shape=mr.INPUT_SHAPE)
        eigenvalues = base.ggn_eigenvalues()
        fit_seconds = now() - started
        started = now()
        best = base.optimise_prior_precision()
        search_seconds = now() - started
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


def select_dropout(cfg: dict[str, Any], data: dict, device: torch.device | None = None, use_cache: bool = True,
                   progress: bool = True, cache_root: str | Path = CACHE) -> pd.DataFrame:
    """Train LeNet-5 with every dropout rate of ``cfg["dropout_rates"]`` (:func:`dropout_settings`; the
    MAP's settings and the config's seed, cached with the MNIST chapter's MAPs) and score each one's MC predictive
    (``S = n_chains`` passes, masks from :func:`dropout_seed` ``"validation"``) on the validation set.

    Returns one row per rate: the validation NLL and accuracy of the MC predictive, the seconds of the
    training and of the validation passes, and ``selected`` (the lowest NLL; the first on a tie).
    """
    device = device or mr.default_device()
    xv, yv = data["val"]
    rows = []
    for rate in cfg["dropout_rates"]:
        fit = mr.fit_map(dropout_settings(cfg, rate), data, device, use_cache=use_cache, progress=progress,
                         cache_root=cache_root)
        started = time.perf_counter()
        masks = torch.Generator().manual_seed(dropout_seed(cfg, "validation"))
        logits = baselines.mc_dropout_logits(lenet5(rate).to(device), fit["theta"].to(device), xv.to(device),
                                             cfg["n_chains"], masks)
        probs = torch.softmax(logits.cpu().double(), dim=-1)
        scores = metrics.all_scores(probs, yv)
        rows.append({"dropout": float(rate), "val_nll": scores["nll"], "val_accuracy": scores["accuracy"],
                     "train_seconds": fit["seconds"], "val_seconds": time.perf_counter() - started})
    table = pd.DataFrame(rows).set_index("dropout")
    table["selected"] = table.index == table["val_nll"].idxmin()
    return table


def run_study(cfg: dict[str, Any], data: dict, device: torch.device | None = None, use_cache: bool = True,
              progress: bool = True, cache_root: str | Path = CACHE) -> dict[str, Any]:
    """Fit and score every method of :func:`method_names`.

    The MAP, the ensemble's other MAPs and the SMP runs come from (or go to) the MNIST chapter's cache
    (``<cache_root>/mnist/``); every method's scores and the table of Laplace fits are cached in
    ``<cache_root>/mnist_baselines/`` by the whole config and the method's name. The Laplace
    posteriors are fitted only when a Laplace row is not in the cache.

    Returns ``evals`` (:func:`evaluate` per method), ``fit_seconds`` per method (MAP training, the SMP
    run, the Laplace fit with the log likelihood and, for ``evidence``, the search for alpha; the
    ensemble's trainings; MC dropout's trainings at every rate of its grid and its validation passes),
    ``laplace`` (the table of :func:`fit_laplaces`), ``dropout`` (the table of :func:`select_dropout`),
    the MAP fit and the index of the ambiguous 3.
    """
    device = device or mr.default_device()
    mnist_cfg = mnist_settings(cfg)
    fit = mr.chapter_map(mnist_cfg, data, device, use_cache=use_cache, progress=progress, cache_root=cache_root)
    theta_map = fit["theta"]
    chain = as_chain_model(lenet5().to(device), mr.INPUT_SHAPE)
    net = lenet5().to(device)
    sets = shifted.test_sets(cfg, data)
    map_probs = torch.softmax(predict(chain, theta_map[None].to(device), sets[0][0].to(device)).cpu().double(), -1)
    three = mr.ambiguous_three(map_probs, data["test"][1])
    path = mr.smp_path(device)
    names = method_names(cfg)

    def key(name: str) -> dict[str, Any]:
        # each method's key holds the settings it depends on: MC dropout's grid only in MC dropout's
        settings = cfg if name.startswith(DROPOUT) else {k: v for k, v in cfg.items() if k != "dropout_rates"}
        return {**settings, "method": name, "code": code_hash(__name__), "smp_path": path}

    def score(theta_or_logits) -> dict:
        if isinstance(theta_or_logits, torch.Tensor):  # parameter samples: the network's own predictive
            theta = theta_or_logits.to(device)
            return shifted.evaluate(lambda x: predict(chain, theta, x.to(device)).cpu(), sets, three)
        return shifted.evaluate(lambda x: theta_or_logits(x.to(device)).cpu(), sets, three)

    laplace: dict[str, Any] = {}

    def laplace_fits():
        if not laplace:
            laplace["posteriors"], laplace["table"] = fit_laplaces(cfg, theta_map, data, device)
        return laplace["posteriors"], laplace["table"]

    laplace_table = None
    if cfg["laplace_structures"]:
        laplace_table = cached("mnist_baselines", key("Laplace fits"), lambda: laplace_fits()[1], root=cache_root,
                               enabled=use_cache)
    dropout_table = None
    if cfg.get("dropout_rates"):
        dropout_table = cached("mnist_baselines", key(f"{DROPOUT} selection"),
                               lambda: select_dropout(cfg, data, device, use_cache, progress, cache_root),
                               root=cache_root, enabled=use_cache)
    evals, fit_seconds = {}, {}
    for name in tqdm(names, desc="methods", disable=not progress):
        if name == "MAP":
            compute = lambda: score(theta_map[None])  # noqa: E731
            fit_seconds[name] = fit["seconds"]
        elif name.startswith("SMP-"):
            variant = name.removeprefix("SMP-")
            index = mr.study_variants(mnist_cfg).index(variant)
            run = cached("mnist", mr.run_key(mnist_cfg, variant, 0, path),
                         lambda variant=variant, index=index: mr.run_variant(mnist_cfg, variant, theta_map, data, index,
                                                                             device, None, progress, replicate=0),
                         root=cache_root, enabled=use_cache)
            compute = lambda run=run: score(run.theta[~run.diverged])  # noqa: E731
            fit_seconds[name] = run.elapsed
        elif name.startswith("Laplace-"):
            label, prior = name.removeprefix("Laplace-").removesuffix(")").split(" (")
            structure, own_network = label.removesuffix("-nn"), label.endswith("-nn")
            seed = laplace_seed(cfg, structure, prior)

            def compute(structure=structure, prior=prior, own_network=own_network, seed=seed):
                post = laplace_fits()[0][f"{structure} ({prior})"]
                samples = post.sample(cfg["n_chains"], torch.Generator().manual_seed(seed)).to(device)
                if own_network:
                    return score(samples)
                return score(lambda x: baselines.linearised_logits(net, theta_map.to(device), samples, x,
                                                                    input_shape=mr.INPUT_SHAPE))

            fit_seconds[name] = float(laplace_table.loc[(structure, prior), "seconds"])
        elif name == DROPOUT:
            rate = float(dropout_table.index[dropout_table["selected"]][0])

            def compute(rate=rate):
                theta = mr.fit_map(dropout_settings(cfg, rate), data, device, use_cache=use_cache, progress=False,
                                   cache_root=cache_root)["theta"].to(device)
                dropped = lenet5(rate).to(device)
                return score(lambda x: baselines.mc_dropout_logits(
                    dropped, theta, x, cfg["n_chains"], torch.Generator().manual_seed(dropout_seed(cfg, "test"))))

            fit_seconds[name] = float(dropout_table["train_seconds"].sum() + dropout_table["val_seconds"].sum())
        else:  # the ensemble: the MAPs of the ensemble seeds (member 0 the chapter's MAP at the laptop scale)
            members, seconds = [], []
            for m in range(cfg["ensemble_members"]):
                member = mr.fit_map({**mnist_cfg, "seed": ensemble_seed(cfg, m)}, data, device, use_cache=use_cache,
                                    progress=False, cache_root=cache_root)
                members.append(member["theta"].to(theta_map.device))
                seconds.append(member["seconds"])
            compute = lambda members=members: score(torch.stack(members))  # noqa: E731
            fit_seconds[name] = float(sum(seconds))
        evals[name] = cached("mnist_baselines", key(name), compute, root=cache_root, enabled=use_cache)
    return {"evals": evals, "fit_seconds": fit_seconds, "laplace": laplace_table, "dropout": dropout_table,
            "map": fit, "three": three}


def findings(evals: dict[str, dict], resolved_at: float = 2.0) -> pd.DataFrame:
    """Per test set (angle) and per metric (NLL, Brier score): the best method, the runner-up and the
    best SMP variant (when it is neither), each lead in standard errors of the mean per-image
    difference (paired over the test images, so it measures the test set's sampling error only),
    resolved from ``resolved_at``."""

    rows = []
    angles = list(next(iter(evals.values()))["per_image"])
    for angle in angles:
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


def highlights(cfg: dict[str, Any], out: dict[str, pd.DataFrame], over_map: pd.DataFrame, dim: int) -> str:
    """The chapter's main numbers as a Markdown list, from :func:`tables` (``out``), :func:`leads_over`
    (``over_map``) and the number of parameters ``dim``."""
    s, lap, shift = out["scores"], out["laplace"], out["shift"]
    ens, drop = f"Ensemble ({cfg['ensemble_members']})", DROPOUT
    dropout = out.get("dropout")
    smp = [m for m in s.index if m.startswith("SMP-")]
    glm = [m for m in s.index if m.startswith("Laplace-") and "-nn" not in m]
    worst = max(cfg["shift_angles"])
    nll = shift["nll"].unstack("angle")
    others = smp + glm + ([drop] if drop in s.index else []) + [ens]
    lines = [
        f"- Test NLL: MAP {s.loc['MAP', 'nll']:.4f}; the best SMP variant {s.loc[smp, 'nll'].idxmin()} "
        f"{s.loc[smp, 'nll'].min():.4f}; the best linearised Laplace {s.loc[glm, 'nll'].idxmin()} "
        f"{s.loc[glm, 'nll'].min():.4f}"
        + (f"; MC dropout (p = {float(dropout.index[dropout['selected']][0]):g}) {s.loc[drop, 'nll']:.4f}"
           if dropout is not None else "")
        + f"; the ensemble {s.loc[ens, 'nll']:.4f}.",
        f"- Accuracy: MAP {s.loc['MAP', 'accuracy']:.4f}, "
        + (f"MC dropout {s.loc[drop, 'accuracy']:.4f}, " if dropout is not None else "")
        + f"ensemble {s.loc[ens, 'accuracy']:.4f}; SMP "
        + ", ".join(f"{m.removeprefix('SMP-')} {s.loc[m, 'accuracy']:.4f}" for m in smp) + ".",
        f"- At {worst} degrees, NLL: MAP {nll.loc['MAP', worst]:.3f}, "
        + ", ".join(f"{m} {nll.loc[m, worst]:.3f}" for m in others) + ".",
        "- The prior that maximises the evidence: "
        + ", ".join(f"{st} alpha = {lap.loc[(st, 'evidence'), 'prior_precision']:.3g} (wd: "
                    f"{lap.loc[(st, 'wd'), 'prior_precision']:.3g}), gamma = "
                    f"{lap.loc[(st, 'evidence'), 'effective_parameters']:,.0f} of {dim:,}"
                    for st in lap.index.get_level_values("structure").unique()) + ".",
        f"- At {worst} degrees the MAP classifies {shift.loc[('MAP', worst), 'accuracy']:.1%} of the images "
        "correctly.",
        "- The network's own predictive at Laplace draws (wd prior): NLL "
        + ", ".join(f"{m} {s.loc[m, 'nll']:.3f}" for m in s.index if m.endswith("-nn (wd)"))
        + ", against the linearised " + ", ".join(f"{m} {s.loc[m, 'nll']:.4f}" for m in glm if m.endswith("(wd)"))
        + ".",
        "- NLL below the MAP's by 2 paired standard errors or more: " + "; ".join(
            f"at {a} degrees " + (", ".join(m for m in over_map.index if over_map.loc[m, a] >= 2) or "none")
            for a in over_map.columns) + ".",
        "- Seconds to fit: SMP " + ", ".join(f"{m.removeprefix('SMP-')} {s.loc[m, 'fit_seconds']:.0f}" for m in smp)
        + "; Laplace " + ", ".join(f"{m.removeprefix('Laplace-')} {s.loc[m, 'fit_seconds']:.0f}" for m in glm)
        + (f"; MC dropout {s.loc[drop, 'fit_seconds']:.0f} ({len(dropout)} trainings)" if dropout is not None else "")
        + f"; the ensemble {s.loc[ens, 'fit_seconds']:.0f} (MAP {s.loc['MAP', 'fit_seconds']:.0f}).",
    ]
    return "\n".join(lines)


CALIBRATION_SHOWN = ("MAP", "SMP-none", "SMP-periodic-diag", "Laplace-diag (evidence)", "Laplace-kfac (wd)",
                     "Laplace-kfac (evidence)", DROPOUT)
"""The methods of the calibration figure (with the ensemble), where they are among the study's rows."""


def compute(ctx) -> None:
    """The chapter's results (:mod:`smp_book.pipeline`): every method fitted and scored
    (:func:`run_study`, cached under ``.cache/mnist/`` and ``.cache/mnist_baselines/``), the tables of
    :func:`tables` (the Laplace table with the prior's term ``alpha |theta_MAP|`` beside the gradient
    norm), how far the MAP and SMP rows are from the MNIST chapter's results, the findings, the NLL
    leads over the MAP, the two figures and the numbers the prose quotes. The device and the seeds
    go into the manifest."""
    from . import plots

    cfg = ctx.config
    device = mr.default_device()
    data, provenance = mr.load_data(cfg)
    study = run_study(cfg, data, device, use_cache=ctx.use_cache, progress=ctx.progress)
    out = shifted.tables(study)
    theta_map = study["map"]["theta"]
    norm = float(theta_map.double().norm())
    if "laplace" in out:
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
    over_map = ctx.table("nll_lead_over_map", shifted.leads_over(study["evals"]))
    shown = [n for n in (*CALIBRATION_SHOWN, f"Ensemble ({cfg['ensemble_members']})") if n in study["evals"]]
    ctx.figure("calibration_baselines", plots.calibration_all({n: study["evals"][n]["curve"] for n in shown},
                                                              "Calibration, MNIST test set"))
    ctx.figure("rotation", shifted.rotation_figure(out["shift"], list(s.index)))

    smp = [m for m in s.index if m.startswith("SMP-")]
    worst = max(cfg["shift_angles"])
    nll = out["shift"]["nll"].unstack("angle")
    ctx.value("what_this_shows", highlights(cfg, out, over_map, theta_map.numel()))
    for key in ("n_train", "n_val", "n_test", "n_chains", "n_steps", "ensemble_members", "map_weight_decay"):
        ctx.value(key, cfg[key])
    ctx.value("dim", theta_map.numel())
    ctx.value("angles", " and ".join(str(a) for a in cfg["shift_angles"]))
    ctx.value("worst_angle", worst)
    ctx.value("shift_images", min(cfg["shift_images"], cfg["n_test"]))
    ctx.value("dropout_rates", ", ".join(f"{r:g}" for r in cfg.get("dropout_rates", [])))
    ctx.value("wd_prior", weight_decay_prior(cfg))
    ctx.value("mnist_chapter_gap", float(gap.max()) if len(gap) else float("nan"))
    ctx.value("ambiguous_index", study["three"])
    ctx.value("ambiguous_label", int(data["test"][1][study["three"]]))
    ctx.value("map_nll", s.loc["MAP", "nll"])
    ctx.value("best_nll_method", s["nll"].idxmin())
    ctx.value("best_nll", s["nll"].min())
    ctx.value("best_smp", s.loc[smp, "nll"].idxmin())
    ctx.value("best_smp_nll", s.loc[smp, "nll"].min())
    ctx.value("best_shift_method", nll[worst].idxmin())
    ctx.value("best_shift_nll", nll[worst].min())
    ctx.value("map_shift_nll", nll.loc["MAP", worst])
    ctx.value("best_smp_shift", nll.loc[smp, worst].idxmin())
    ctx.value("best_smp_shift_nll", nll.loc[smp, worst].min())
    ctx.value("resolved_findings", int(found["resolved"].sum()))
    ctx.value("findings", len(found))
    if "laplace" in out:
        wd = out["laplace"].xs("wd", level="prior").iloc[0]
        ctx.value("theta_norm", norm)
        ctx.value("wd_gradient_norm", wd["gradient_norm"])
        ctx.value("wd_prior_term", wd["prior_term"])
        ctx.value("wd_gradient_ratio", wd["gradient_norm"] / wd["prior_term"])
        ctx.value("wd_gradient_per_image", wd["gradient_norm"] / cfg["n_train"])
    if "dropout" in out:
        ctx.value("dropout_rate", float(out["dropout"].index[out["dropout"]["selected"]][0]))
    mnist_cfg = mnist_settings(cfg)
    ctx.record(seeds={"split": cfg["split_seed"], "map": study["map"]["seed"],
                      "ensemble": [ensemble_seed(cfg, m) for m in range(cfg["ensemble_members"])],
                      "smp": {v: mr.smp_seed(mnist_cfg, i) for i, v in enumerate(mr.study_variants(mnist_cfg))},
                      "laplace": {f"{st} ({pr})": laplace_seed(cfg, st, pr)
                                  for st in cfg["laplace_structures"] for pr in PRIORS},
                      "dropout_masks": {part: dropout_seed(cfg, part) for part in ("validation", "test")}},
               device=str(device), data=provenance, ambiguous_three=study["three"])
