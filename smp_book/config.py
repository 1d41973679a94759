"""Every run size of the book in one table: scales ``ci``, ``laptop`` and ``paper``.

* ``ci``: the whole test suite, notebooks included, in minutes on 2 CPU cores.
* ``laptop``: the committed results of the book (``results/laptop/``), hours to recompute on a 2-core
  machine (``make reproduce SCALE=laptop``; each manifest records its wall time).
* ``paper``: the paper's settings (Sections 3.2 and 3.3).

Settings the paper states are marked with a comment; the rest are our choices, stated in the book.
"""

from __future__ import annotations

import math
from copy import deepcopy
from typing import Any

SCALES = ("ci", "laptop", "paper")

# Section 3.2.3: tau per structure, lambda, beta, T; model-expected Fisher over the training set.
TOY_VARIANTS = ["none", *(f"{strategy}-{structure}" for strategy in ("fixed", "ema", "periodic")
                          for structure in ("diag", "block", "dense"))]  # fixed-diag, fixed-block, ..., periodic-dense
TOY_TAU = {"none": 1.0, "diag": 0.3, "block": 0.3, "dense": 0.1}  # paper
# Beyond the paper (notebooks/toy_kfac.md): Kronecker-factored blocks, one per layer. tau is ours: the
# paper's value for the other per-layer blocks (block), since KFAC keeps one block per layer too.
TOY_KFAC_VARIANTS = ["fixed-kfac", "ema-kfac", "periodic-kfac"]
TOY_TAU["kfac"] = 0.3  # ours


def toy_tau(variant: str) -> float:
    """The paper's tau for a toy variant name such as ``"ema-block"`` (ours for kfac)."""
    return TOY_TAU["none" if variant == "none" else variant.split("-")[1]]


def _taus(names: list[str], tau) -> dict[str, Any]:
    """The settings ``variants`` and ``tau`` (a variant's tau by its name) of the variants ``names``."""
    return {"variants": list(names), "tau": {v: tau(v) for v in names}}


_TOY_PAPER: dict[str, Any] = {
    "n_train": 500,  # paper
    "n_test": 5000,  # paper
    "grid_per_axis": 101,  # our choice (figures only)
    "nuts_warmup": 1000,  # paper
    "nuts_samples": 1000,  # paper
    "nuts_target_accept": 0.95,  # paper
    "n_chains": 1000,  # paper (S)
    "n_steps": 5000,  # paper (K)
    "ridge": 1e-4,  # paper (lambda)
    "beta": 0.98,  # paper
    "period": 500,  # paper (T)
    "ema_init": "fisher",  # our choice: the EMA starts at the fixed strategy's Fisher at theta_0
    "n_bins": 10,  # paper (J)
    "replicates": 5,  # ours: the paper reports one run
    "seed": 2026,
    **_taus(TOY_VARIANTS, toy_tau),  # paper
}

TOY: dict[str, dict[str, Any]] = {
    "paper": _TOY_PAPER,
    "laptop": dict(_TOY_PAPER),  # the toy is cheap: the laptop book runs it at the paper's scale
    "ci": {**_TOY_PAPER, "n_test": 1000, "grid_per_axis": 31, "nuts_warmup": 100, "nuts_samples": 100,
           "n_chains": 100, "n_steps": 300, "replicates": 2},
}

# Section 3.3: MAP then SMP; tau per variant; empirical diagonal Fisher from the validation set.
MNIST_VARIANTS = ["none", "fixed-diag", "ema-diag", "periodic-diag"]
MNIST_TAU = {"none": 1.0, "fixed-diag": 0.05, "ema-diag": 0.08, "periodic-diag": 0.05}  # paper
MNIST_KFAC_VARIANTS = ["fixed-kfac", "ema-kfac", "periodic-kfac"]

_MNIST_PAPER: dict[str, Any] = {
    "n_train": 54_000, "n_val": 6_000, "n_test": 10_000,  # paper
    "map_epochs": 20, "map_batch": 48, "map_lr": 1e-3, "map_weight_decay": 1e-3,  # paper
    "n_chains": 100,  # paper (S)
    "n_steps": 1_000_000,  # paper (K)
    "ridge": 1e-4, "period": 500,  # paper
    "n_fisher_periodic": None,  # None: the whole validation set, as the paper
    "checkpoint_every": 50_000,  # ours: resumable long runs
    # ours: independent SMP runs (other seeds, the same MAP) per variant; the paper reports one run.
    # One here: at K = 10^6 a replicate is hours of CPU (the laptop scale measures the spread).
    "smp_replicates": 1,
    "split_seed": 0, "seed": 2026,
    **_taus(MNIST_VARIANTS, MNIST_TAU.get),  # paper
}

# ours, at the paper scale: the MAP with the lowest validation loss after its last epoch among five seeds (those of
# the MAP-seeds chapter, seed + 100 m), a rule that looks at no SMP result; the paper names no seed. The laptop and
# ci scales start from the seed's MAP (mnist_study.chapter_map). The SMP seeds stay seed's. Periodic's Fisher from
# the first 1,000 validation images (ours; the paper: all 6,000): on the 2-core CPU the book is computed on, one
# recomputation over 6,000 takes 19 s by layers (benchmarks/mnist_cpu.md), so the 2,000 of K = 10^6 would take
# about 10.6 hours, against the four variants' 3.4 hours of steps.
_MNIST_PAPER_SCALE = {**_MNIST_PAPER, "select_map_from_seeds": [_MNIST_PAPER["seed"] + 100 * m for m in range(5)],
                      "n_fisher_periodic": 1_000}

MNIST: dict[str, dict[str, Any]] = {
    "paper": _MNIST_PAPER_SCALE,
    # laptop: the paper's data, MAP and S, but K = 10^4 (r_K^2 / r_0^2 = 84 % instead of 5 %), the periodic Fisher
    # from the first 500 validation images and 3 SMP replicates, so that the chapter runs in about 30 minutes on
    # 2 cores (MAP 3 min, then about 8 min per replicate of the 4 variants).
    "laptop": {**_MNIST_PAPER, "n_steps": 10_000, "n_fisher_periodic": 500, "checkpoint_every": 2_000,
               "smp_replicates": 3},
    "ci": {**_MNIST_PAPER, "n_train": 2_000, "n_val": 500, "n_test": 1_000, "map_epochs": 2, "n_chains": 8,
           "n_steps": 200, "period": 50, "checkpoint_every": None, "smp_replicates": 2},
}

# Beyond the paper (notebooks/mnist_growth.md): one run per MNIST variant, extended through a grid of K (each run
# resumes from its checkpoint at the next K), to see how the dispersion grows with K. The MAP and every SMP setting
# but S and K are those of the MNIST study at the same scale.
_GROWTH_GRID = [1_000, 3_000, 10_000, 30_000, 100_000, 300_000, 1_000_000]


def _growth(scale: str, **changes: Any) -> dict[str, Any]:
    return {**{k: v for k, v in MNIST[scale].items() if k not in ("n_steps", "smp_replicates")}, **changes}


MNIST_GROWTH: dict[str, dict[str, Any]] = {
    "paper": _growth("paper", growth_steps=_GROWTH_GRID),  # the paper's S and K: hours, best on a GPU
    # laptop: 10 chains (jackknife errors over them) to K = 10^5, about 13 minutes on 2 cores; the periodic
    # Fisher's recomputation (every T = 500 steps, 500 images) is most of that time.
    "laptop": _growth("laptop", n_chains=10, growth_steps=_GROWTH_GRID[:5]),
    "ci": _growth("ci", n_chains=4, growth_steps=[50, 100, 200]),
}

# Beyond the paper (notebooks/mnist_kfac.md): the MNIST study with Kronecker-factored preconditioners in place of the
# diagonal ones: the same MAP, data, S, K, lambda, T and Fisher data; tau is ours, the paper's diagonal value for the
# same strategy, so that only the structure changes. Seeds follow the four variants of the MNIST study (seed_offset).
# ema_refresh (ours): the EMA's factors are eigendecomposed every 50 steps (1 / (1 - beta), the EMA's memory) instead
# of every step, which costs more than the rest of the step for LeNet-5's 257 x 257 input factor
# (benchmarks/bench_kfac.py).
_MNIST_KFAC_CHANGES: dict[str, Any] = {
    "variants": MNIST_KFAC_VARIANTS,
    # ours: the paper's diagonal tau for the same strategy (the diagonal variants' own are kept beside them)
    "tau": {**MNIST_TAU, **{v: MNIST_TAU[v.replace("kfac", "diag")] for v in MNIST_KFAC_VARIANTS}},
    "ema_refresh": 50,  # ours
    "seed_offset": len(MNIST_VARIANTS),
}
MNIST_KFAC: dict[str, dict[str, Any]] = {
    "paper": {**_MNIST_PAPER_SCALE, **_MNIST_KFAC_CHANGES},
    # laptop: the MNIST laptop settings (K = 10^4) with one replicate: each kfac run takes 7 to 21 times a diagonal
    # one on 2 cores (594, 1221 and 719 s for fixed, EMA and periodic)
    "laptop": {**MNIST["laptop"], **_MNIST_KFAC_CHANGES, "smp_replicates": 1},
    "ci": {**MNIST["ci"], **_MNIST_KFAC_CHANGES},
}

# Beyond the paper (notebooks/mnist_seeds.md): the MNIST study's four SMP variants, in the MNIST study's smp_replicates
# replicates (3 at laptop: about 8 minutes per MAP and replicate), from each of map_seeds MAPs trained with the same
# settings and the seeds seed + 100 m (MAP 0 is the MNIST chapter's at the laptop and ci scales, with its runs; the
# MAPs are the MNIST baselines chapter's ensemble members, so they are shared): how much the paper's verdicts depend
# on the training run of the MAP, and how much on the SMP random stream. The number of MAPs is ours (5, as the
# ensemble).
MNIST_SEEDS: dict[str, dict[str, Any]] = {
    scale: {**{k: v for k, v in settings.items() if k != "select_map_from_seeds"},
            "map_seeds": 2 if scale == "ci" else 5}
    for scale, settings in MNIST.items()}

# Beyond the paper: the toy study's settings, data and NUTS (the same seeds), with the KFAC variants.
TOY_KFAC: dict[str, dict[str, Any]] = {scale: {**settings, **_taus(TOY_KFAC_VARIANTS, toy_tau)}
                                       for scale, settings in TOY.items()}

# Beyond the paper (notebooks/toy_tail.md): the Gaussian tail of smp_core.tail (hybrid sampling) against the
# recursion itself. The toy study's data, NUTS, S, K and SMP settings and the same chain seeds (so the recursion's
# rows are the toy chapter's runs); each run stops at every K0 of tail_from, where the tail to K is drawn, and goes
# on to K, where the tail to infinity is drawn. All ours: the K0 grid, M (tail_scores) and the replicates (three at
# the laptop scale, about 6 minutes on 2 cores).
_TAIL_CHANGES: dict[str, Any] = {"tail_from": [50, 500, 1000], "tail_scores": 1000, "replicates": 3}
TOY_TAIL: dict[str, dict[str, Any]] = {
    scale: {**settings, "variants": TOY_VARIANTS,
            **({"tail_from": [50, 100], "tail_scores": 100, "replicates": 2} if scale == "ci" else _TAIL_CHANGES)}
    for scale, settings in TOY.items()}

# Beyond the paper (notebooks/mnist_tail.md): the MNIST study's runs (replicate 0, the same cache) carried on by the
# Gaussian tail to the paper's K = 10^6 and to infinity, and checked against the recursion on the same chains from
# check_from (a multiple of 50, a fifth of K) to K. These keys only; the MNIST settings are get_config("mnist",
# scale). All ours. At the paper scale the run already reaches 10^6: that row is the recursion itself.
MNIST_TAIL: dict[str, dict[str, Any]] = {
    scale: {"check_from": check_from, "tail_to": 1_000_000, "tail_scores": tail_scores}
    for scale, check_from, tail_scores in [("paper", 200_000, 1000), ("laptop", 2_000, 1000), ("ci", 100, 20)]}

# Beyond the paper (notebooks/toy_baselines.md): the approximate methods the paper leaves out (its Section 4.5)
# beside NUTS and SMP on the toy chapter's replicates (the same data, NUTS, NUTS-mean and, for SMP-none and
# SMP-ema-block, the same chains). All ours: a MAP under NUTS's prior N(0, I) from NUTS-mean (L-BFGS, so in NUTS's
# basin); Laplace approximations at it with the prior's precision and the model-expected GGN of every structure,
# S samples each; a deep ensemble of MAPs from random starts (Lakshminarayanan et al. use 5 members; 10 cost
# seconds here).
_BASELINE_CHANGES: dict[str, Any] = {"smp_variants": ["none", "ema-block"], "prior_precision": 1.0,
                                     "laplace_structures": ["diag", "block", "kfac", "dense"],
                                     "ensemble_members": 10}
TOY_BASELINES: dict[str, dict[str, Any]] = {
    scale: {**settings, **_BASELINE_CHANGES, **({"ensemble_members": 4} if scale == "ci" else {})}
    for scale, settings in TOY.items()}

# Beyond the paper (notebooks/mnist_baselines.md): the MNIST study's MAP and SMP runs (replicate 0, the same
# cache) beside Laplace approximations at the MAP and a deep ensemble, on the test set and on rotated test
# images (a distribution shift, as Ovadia et al. 2019). All ours: the structures (laplace-torch's diag and
# kron, which never form a d x d matrix), the prior precision (the MAP's own, N * weight decay, and the one
# laplace-torch's marginal-likelihood optimiser finds from it), S = n_chains Laplace draws, 5 ensemble
# members (Lakshminarayanan et al.), MC dropout's grid of dropout rates (one LeNet-5 trained per rate with
# the MAP's settings, the rate chosen by the validation NLL of S = n_chains passes; Gal and Ghahramani
# 2016), the angles and the number of rotated images.
MNIST_BASELINE_KEYS = ("laplace_structures", "ensemble_members", "dropout_rates", "shift_angles", "shift_images")
_MNIST_BASELINE_CHANGES: dict[str, Any] = {"laplace_structures": ["diag", "kfac"], "ensemble_members": 5,
                                           "dropout_rates": [0.1, 0.25, 0.5], "shift_angles": [30, 60]}
MNIST_BASELINES: dict[str, dict[str, Any]] = {
    "paper": {**MNIST["paper"], **_MNIST_BASELINE_CHANGES, "shift_images": 10_000},
    "laptop": {**MNIST["laptop"], **_MNIST_BASELINE_CHANGES, "shift_images": 2_000},
    "ci": {**MNIST["ci"], **_MNIST_BASELINE_CHANGES, "ensemble_members": 2, "dropout_rates": [0.1, 0.5],
           "shift_angles": [45], "shift_images": 200},
}

# Beyond the paper (notebooks/regression.md; smp_book.regression_study): a one-dimensional regression whose data
# leave a gap, SMP beside NUTS, the MAP and the linearised Laplace approximation. The paper has no regression, so
# every setting is ours and the paper scale is the laptop's: 120 points of sin 2x + 0.3 x on [-3, -1] and [1, 3]
# with sigma = 0.1 known, 1000 new points in range and 500 in the gap; one hidden layer of 50 tanh units (d = 151)
# and the prior N(0, I) (alpha = 1); the MAP by L-BFGS from 4 starts; NUTS with 4 chains from the MAP (jittered by
# 0.1), 1000 warm-up steps and 1000 draws each, target acceptance 0.9; SMP from the MAP with S = 200 and K = 2000,
# lambda = 1e-4 (the paper's) and, for the kfac and dense structures, also 1; every setting at every tau of a grid
# (tau = 1e-3 to 3) on which the spread of the diagonal and ridge-1 settings crosses NUTS's in range (none's is 1.3
# times NUTS's at 1e-3; kfac and dense with lambda = 1e-4 stay about 10^4 times above it even there, and diverge at
# large tau); the kfac and dense statistics in float64 (the Fisher's eigenvalues span more than float32 resolves
# against lambda = 1e-4); five data sets; on the first, the MAP, NUTS and Laplace again under the priors
# N(0, I / alpha), alpha = 0.25 and 4.
REGRESSION_VARIANTS = [["none", 1e-4], ["fixed-diag", 1e-4], ["ema-diag", 1e-4], ["fixed-kfac", 1e-4],
                       ["fixed-kfac", 1.0], ["fixed-dense", 1e-4], ["fixed-dense", 1.0]]
_REGRESSION_LAPTOP: dict[str, Any] = {
    "n_train": 120, "n_in": 1000, "n_gap": 500, "grid_points": 401, "noise": 0.1, "hidden": 50,
    "prior_precision": 1.0, "map_restarts": 4, "level": 0.9,
    "nuts_chains": 4, "nuts_warmup": 1000, "nuts_samples": 1000, "nuts_target_accept": 0.9,
    "nuts_max_tree_depth": 10, "nuts_init_jitter": 0.1,
    "n_chains": 200, "n_steps": 2000, "ridge": 1e-4, "statistic_dtype": "float64",
    "smp_variants": REGRESSION_VARIANTS, "tau_grid": [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0],
    "data_sets": 5, "seed": 2026, "prior_sensitivity": [0.25, 4.0],
}
REGRESSION: dict[str, dict[str, Any]] = {
    "paper": _REGRESSION_LAPTOP,
    "laptop": dict(_REGRESSION_LAPTOP),
    "ci": {**_REGRESSION_LAPTOP, "n_train": 40, "n_in": 200, "n_gap": 100, "grid_points": 81, "map_restarts": 1,
           "nuts_chains": 2, "nuts_warmup": 100, "nuts_samples": 100, "n_chains": 30, "n_steps": 100,
           "tau_grid": [0.1, 1.0], "data_sets": 2, "prior_sensitivity": [4.0]},
}

_TABLES = {"toy": TOY, "toy_baselines": TOY_BASELINES, "toy_kfac": TOY_KFAC, "toy_tail": TOY_TAIL, "mnist": MNIST,
           "mnist_baselines": MNIST_BASELINES, "mnist_growth": MNIST_GROWTH, "mnist_kfac": MNIST_KFAC,
           "mnist_seeds": MNIST_SEEDS, "mnist_tail": MNIST_TAIL, "regression": REGRESSION}


def get_config(study: str, scale: str) -> dict[str, Any]:
    """The settings of one study (``"toy"``, ``"toy_baselines"``, ``"toy_kfac"``, ``"toy_tail"``, ``"mnist"``,
    ``"mnist_baselines"``, ``"mnist_growth"``, ``"mnist_kfac"``, ``"mnist_seeds"``, ``"mnist_tail"`` or
    ``"regression"``) at one scale, as a fresh dict."""
    if study not in _TABLES:
        raise ValueError(f"unknown study {study!r}; choose one of {sorted(_TABLES)}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {SCALES}")
    return {"study": study, "scale": scale, **deepcopy(_TABLES[study][scale])}


# The parameters a chapter takes besides ``scale`` (papermill's -p and -y), and the setting each one sets.
PARAMETERS: dict[str, dict[str, str]] = {
    "toy": {"tau": "tau", "n_chains": "n_chains", "n_steps": "n_steps", "replicates": "replicates", "seed": "seed",
            "nuts_start": "nuts_start"},
    "mnist": {"tau": "tau", "variants": "variants", "n_chains": "n_chains", "n_steps": "n_steps",
              "replicates": "smp_replicates", "seed": "seed", "map_seed": "select_map_from_seeds",
              "fisher_images": "n_fisher_periodic"},
}
_NOTEBOOK_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open"}


def with_parameters(study: str, config: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """``config`` changed by a chapter's ``params`` (:data:`PARAMETERS`; ``None``, or an empty ``tau``, keeps the
    scale's), each checked before any work: a name the chapter lacks or a bad value raises, naming it."""
    allowed = PARAMETERS.get(study, {})
    for name, value in (params or {}).items():
        if name not in allowed:
            raise ValueError(f"{name}: not a parameter of the {study} chapter; its parameters: scale, "
                             f"{', '.join(allowed) or 'no other'}")
        if value is None or (name == "tau" and not value):
            continue
        if name == "tau":
            if not isinstance(value, dict):
                raise TypeError(f"tau: a mapping from variant to tau is needed, got {value!r}")
            for variant, tau in value.items():
                plain = str(variant).removeprefix("SMP-")
                if plain not in config["tau"]:
                    raise ValueError(f"tau: unknown variant {variant!r}; known: {', '.join(config['variants'])}")
                if isinstance(tau, bool) or not isinstance(tau, int | float) or not math.isfinite(tau) or tau <= 0:
                    raise ValueError(f"tau: the tau of {variant!r} must be a positive finite number, got {tau!r}")
                config["tau"][plain] = float(tau)
        elif name == "variants":
            known = list(config.get("variants", config["tau"]))
            names = [str(v).removeprefix("SMP-") for v in value] if isinstance(value, list | tuple) else None
            if not names or any(v not in known for v in names) or len(set(names)) < len(names):
                raise ValueError(f"variants: a list of distinct variants among {', '.join(known)} is needed, "
                                 f"got {value!r}")
            config["variants"], config["tau"] = names, {v: config["tau"][v] for v in names}
        elif name == "nuts_start" and value not in ("map", "uniform"):
            raise ValueError(f"nuts_start: 'map' (ours) or 'uniform' (Turing's default) is needed, got {value!r}")
        elif name == "fisher_images" and not (isinstance(value, int) and not isinstance(value, bool)
                                              and 1 <= value <= config["n_val"]):
            raise ValueError(f"fisher_images: an integer from 1 to the {config['n_val']:,} validation images is "
                             f"needed, got {value!r}")
        elif name != "nuts_start" and (isinstance(value, bool) or not isinstance(value, int)
                                       or value < (0 if "seed" in name else 1)):
            raise ValueError(f"{name}: a {'non-negative' if 'seed' in name else 'positive'} integer is needed, "
                             f"got {value!r}")
        else:
            config[allowed[name]] = [value] if name == "map_seed" else value
    return config


def parameters(namespace: dict[str, Any], study: str | None = None) -> dict[str, Any]:
    """A chapter's parameters from its notebook's ``globals()`` right after the parameters cell (and the cell
    papermill injects after it): those of :data:`PARAMETERS` for ``study`` but ``scale``. Any other name
    refuses the run, naming the parameters the chapter defines (papermill itself only warns)."""
    allowed = {"scale", *PARAMETERS.get(study, {})}
    unknown = sorted(n for n, v in namespace.items() if not n.startswith("_") and n not in allowed | _NOTEBOOK_NAMES
                     and not callable(v) and type(v).__name__ != "module")
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)}: this chapter takes {', '.join(sorted(allowed))}")
    return {name: namespace[name] for name in sorted(allowed - {"scale"}) if name in namespace}

