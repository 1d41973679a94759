"""The synthetic 2-D binary classification problem of Section 3.2.1 of the paper ("Toy example").

Covariates are uniform on the square ``[-1, 1]^2`` and labels follow the equation of Section 3.2.1
(Data generation and network architecture)::

    Y_i ~ Bernoulli(p_true(X_i)),    p_true(x) = sigma(20 * (0.5 - ||x||_2^2)),

with ``sigma`` the logistic function: a circular decision boundary ``||x||_2^2 = 0.5`` with
confident labels inside (``Y = 1``) and outside (``Y = 0``). The paper uses ``N_train = 500``
training points and ``N_test = 5000`` test points.

Seed scheme. :func:`make_toy_data` draws from one ``torch.Generator`` seeded with ``seed``
(``torch.Generator().manual_seed(seed)``, CPU), never from the global torch RNG: first the
``2 n`` uniforms of the covariates (``torch.rand((n, 2))``, row-major), then the ``n`` label
draws (``torch.bernoulli``). The result depends only on ``(n, seed)``; data sets of different
sizes with the same seed are *not* prefixes of one another, so take the training and test sets
from different seeds (the notebooks use ``seed=0`` for training and ``seed=1`` for test).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from smp_core import metrics
from smp_core.models import as_chain_model, predict, toy_mlp
from smp_core.preconditioners import STRATEGIES, preconditioner_from_name
from smp_core.recursion import residual_variance_ratio, run_smp

from .config import TOY_VARIANTS
from .summaries import summarise_replicates


def p_true(x):
    """True class-1 probability ``sigma(20 (0.5 - ||x||_2^2))`` of Section 3.2.1 of the paper.

    ``x`` has shape ``(..., 2)``; the result has shape ``(...)``. A ``torch.Tensor`` gives a
    tensor (same dtype and device), anything else a NumPy array.
    """
    if isinstance(x, torch.Tensor):
        return torch.sigmoid(20.0 * (0.5 - (x * x).sum(dim=-1)))
    x = np.asarray(x, dtype=float)
    z = 20.0 * (0.5 - (x * x).sum(axis=-1))
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # the logistic function, without overflow warnings


def make_toy_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points of the toy problem (Section 3.2.1, ``Y_i ~ Bernoulli(p_true(X_i))``).

    Returns ``x`` float32 ``(n, 2)``, uniform on ``[-1, 1]^2``, and ``y`` float32 ``(n,)`` in
    ``{0, 1}``. Deterministic in ``(n, seed)``: see the module docstring for the seed scheme.
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    gen = torch.Generator().manual_seed(int(seed))
    x = torch.rand((n, 2), generator=gen, dtype=torch.float32) * 2.0 - 1.0
    y = torch.bernoulli(p_true(x), generator=gen).to(torch.float32)
    return x, y


def make_grid(n_per_axis: int = 101) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A regular grid over ``[-1, 1]^2`` for the function-space plots of Section 3.2.2.

    Returns ``xx`` and ``yy`` of shape ``(n_per_axis, n_per_axis)`` (``meshgrid`` with
    ``indexing="xy"``: ``xx[i, j]`` is the ``j``-th abscissa, ``yy[i, j]`` the ``i``-th ordinate,
    ready for ``plt.contourf(xx, yy, z.reshape(xx.shape))``) and ``points`` of shape
    ``(n_per_axis ** 2, 2)``, the rows ``(xx.ravel()[k], yy.ravel()[k])``. All float32.
    """
    if n_per_axis < 2:
        raise ValueError(f"n_per_axis must be at least 2, got {n_per_axis}")
    axis = torch.linspace(-1.0, 1.0, n_per_axis, dtype=torch.float32)
    yy, xx = torch.meshgrid(axis, axis, indexing="ij")
    return xx, yy, torch.stack([xx.reshape(-1), yy.reshape(-1)], dim=1)


def replicate_seeds(base_seed: int, replicate: int) -> dict[str, int]:
    """The seeds of one replicate: training data, test data, NUTS, and SMP (variant i adds i)."""
    s = base_seed + 1000 * replicate
    return {"train": s, "test": s + 1, "nuts": s + 2, "smp": s + 10}


@dataclass
class Evaluation:
    """Predictive summaries of one method: scores, variances, calibration and grid surfaces."""

    scores: dict[str, float]
    variances: dict[str, float]
    curve: metrics.CalibrationCurve
    surfaces: dict[str, np.ndarray]


def evaluate(theta: torch.Tensor, x_test, y_test, grid_points, grid_shape, n_bins: int = 10,
             logits_of=None) -> Evaluation:
    """Metrics of Appendix A for parameter samples ``theta`` ``(S, 20)`` (S = 1 for a point estimate).

    ``logits_of(points) -> (S, n)``, when given, replaces the network's logits at the samples (e.g. the
    linearised network of :func:`smp_book.baselines.linearised_logits`); the parameter variance is still ``theta``'s.
    """
    model = as_chain_model(toy_mlp())
    theta = theta.to(torch.float32)
    if logits_of is None:
        def logits_of(points):
            return predict(model, theta, points)[..., 0]
    logits = logits_of(x_test)  # (S, n)
    probs = metrics.binary_probs(torch.sigmoid(logits.double()))
    labels = y_test.long()
    scores = metrics.all_scores(probs, labels, n_bins=n_bins)
    variances = {"params_variance": metrics.params_variance(theta), "logits_variance": metrics.logits_variance(logits)}
    curve = metrics.calibration_curve(probs, labels, n_bins=n_bins)
    grid_probs = metrics.binary_probs(torch.sigmoid(logits_of(grid_points).double()))
    per_point = {"prob": metrics.predictive(grid_probs)[:, 1],
                 "mi": metrics.mutual_information(grid_probs, per_point=True),
                 "exp_entropy": metrics.expected_entropy(grid_probs, per_point=True)}
    surfaces = {name: v.numpy().reshape(grid_shape).astype(np.float32) for name, v in per_point.items()}
    return Evaluation(scores, variances, curve, surfaces)


def variant_seed(seeds: dict[str, int], variant: str, position: int, seed_offset: int = 0) -> int:
    """The chain seed of an SMP variant at ``position`` of a list: ``seeds["smp"] + seed_offset + i``, with ``i``
    its place in the paper's ``TOY_VARIANTS`` if it is one (it then draws the toy chapter's chains in any list)."""
    index = TOY_VARIANTS.index(variant) if variant in TOY_VARIANTS else position
    return seeds["smp"] + seed_offset + index


def run_variant(cfg: dict[str, Any], x: torch.Tensor, theta0: torch.Tensor, variant: str, seed: int,
                progress: bool = True):
    """One SMP variant on the toy MLP from ``theta0`` with the study's settings and its ``tau`` (``cfg["tau"]``;
    the paper's for its structure unless a chapter's parameters change it)."""
    return run_smp(toy_mlp(), "bernoulli", x, theta0=theta0, preconditioner=toy_preconditioner(cfg, variant),
                   tau=cfg["tau"][variant], n_steps=cfg["n_steps"], n_chains=cfg["n_chains"], seed=seed,
                   progress=progress)


def toy_preconditioner(cfg: dict[str, Any], variant: str):
    """The preconditioner of a toy variant with the chapter's settings (ridge, beta, T, the EMA's start)."""
    return preconditioner_from_name(variant, ridge=cfg["ridge"], beta=cfg["beta"], period=cfg["period"],
                                    ema_init=cfg["ema_init"])


def nuts_init(seeds: dict[str, int], start: str) -> np.ndarray | None:
    """Where a replicate's NUTS chain starts: ``None`` for ``"map"`` (ours: :func:`smp_book.nuts.run_nuts` finds a
    MAP), or for ``"uniform"`` a draw uniform on ``[-2, 2]^20`` (Turing's default, the paper's) from the NUTS seed."""
    return np.random.default_rng(seeds["nuts"]).uniform(-2.0, 2.0, 20) if start == "uniform" else None


def run_replicate(cfg: dict[str, Any], replicate: int, variants=TOY_VARIANTS, progress: bool = True,
                  seed_offset: int = 0) -> dict[str, Any]:
    """One whole pipeline: new data, NUTS (from a MAP, or ``cfg["nuts_start"] = "uniform"``), NUTS-mean, every SMP
    variant (seeded by :func:`variant_seed`), evaluation. Variants other than the paper's, run on the same
    replicates, pass ``seed_offset = len(TOY_VARIANTS)`` so that their chains draw other random numbers.

    SMP starts from NUTS-mean, as in the paper, even where :func:`smp_book.nuts.check_nuts_mean` finds that it
    predicts far worse than the NUTS ensemble (a chain that crossed between modes): the replicate is kept, not
    replaced by a luckier seed, with a warning, and the check's metrics are in ``nuts_mean_check``. One NUTS chain
    of 2,000 iterations is chaotic in rounding, so which replicate crosses can differ between processors (JAX
    compiles for the host's CPU).
    """
    from .nuts import check_nuts_mean, nuts_mean_passes, run_nuts

    ours = [v for v in variants if v not in TOY_VARIANTS]
    if seed_offset == 0 and ours and len(ours) < len(variants):
        raise ValueError(f"variants {ours} would share seeds with the paper's variants in {list(variants)}: run them "
                         "apart with a seed_offset (see toy_kfac)")
    seeds = replicate_seeds(cfg["seed"], replicate)
    x, y = make_toy_data(cfg["n_train"], seeds["train"])
    x_test, y_test = make_toy_data(cfg["n_test"], seeds["test"])
    gx, gy, grid = make_grid(cfg["grid_per_axis"])

    def evaluated(theta):
        return evaluate(theta, x_test, y_test, grid, tuple(gx.shape), cfg["n_bins"])

    nuts = run_nuts(x.numpy(), y.numpy(), seed=seeds["nuts"], num_warmup=cfg["nuts_warmup"],
                    num_samples=cfg["nuts_samples"], target_accept_prob=cfg["nuts_target_accept"],
                    x_eval=x_test.numpy(), init=nuts_init(seeds, cfg.get("nuts_start", "map")))
    sanity = check_nuts_mean(nuts.samples, x.numpy(), y.numpy())
    if not nuts_mean_passes(sanity):
        warnings.warn(f"toy replicate {replicate}: NUTS-mean predicts much worse than the NUTS ensemble ({sanity}); "
                      "the chain probably crossed between modes. SMP still starts from NUTS-mean, as in the paper; "
                      "the replicate is kept and flagged in its nuts_mean_check", stacklevel=2)
    nuts_samples = torch.as_tensor(nuts.samples, dtype=torch.float32)
    theta_hat = nuts_samples.mean(0)

    evals = {"NUTS": evaluated(nuts_samples), "NUTS-mean": evaluated(theta_hat[None])}
    elapsed, diverged = {"NUTS": nuts.diagnostics["wall_time_s"], "NUTS-mean": 0.0}, {}
    for i, variant in enumerate(variants):
        res = run_variant(cfg, x, theta_hat, variant, variant_seed(seeds, variant, i, seed_offset), progress)
        name = f"SMP-{variant}"
        elapsed[name], diverged[name] = res.elapsed, res.n_diverged
        evals[name] = evaluated(res.theta[~res.diverged])
    return {
        "replicate": replicate, "seeds": seeds, "evals": evals, "elapsed": elapsed, "diverged": diverged,
        "nuts_diagnostics": nuts.diagnostics, "nuts_mean_check": sanity,
        "train": (x.numpy(), y.numpy()), "grid": (gx.numpy(), gy.numpy()), "theta_hat": theta_hat.numpy(),
        "nuts_init": nuts.init, "r_ratio": residual_variance_ratio(cfg["n_train"], cfg["n_steps"]),
        "threads": torch.get_num_threads(),
    }


def one_class_brier(two_class_brier: pd.Series) -> pd.Series:
    """The paper's Brier score of the binary toy problem: ``mean (p - y)^2``, half the two-class sum.

    Appendix A sums ``(f(j | x) - 1{y = j})^2`` over both classes, which for two classes is
    ``2 (p - y)^2``. The paper's toy table cannot be that sum: in expectation it is at least twice
    the Bayes risk ``E[p_true (1 - p_true)] = 0.039`` here, i.e. 0.078, while the paper reports 0.050
    for NUTS. Its numbers match the one-class score ``(p - y)^2``, so the toy tables use that.
    """
    return two_class_brier / 2


def tables(run: dict[str, Any]) -> dict[str, pd.DataFrame]:
    """The three tables of one replicate, rows and columns named as the paper's."""
    evals, names = run["evals"], pd.Index(list(run["evals"]), name="method")
    scores = pd.DataFrame([e.scores for e in evals.values()], index=names)[list(metrics.SCORE_KEYS)]
    scores["brier"] = one_class_brier(scores["brier"])
    variances = pd.DataFrame([e.variances for e in evals.values()], index=names)[["params_variance", "logits_variance"]]
    elapsed = pd.DataFrame({"seconds": [run["elapsed"][n] for n in names]}, index=names)
    return {"scores": scores, "variances": variances, "elapsed": elapsed}


def summarise(runs: list[dict[str, Any]]) -> dict[str, pd.DataFrame]:
    """Mean and standard deviation over replicates of every cell of every table."""
    return summarise_replicates([tables(r) for r in runs])


def structure_comparison(mean: pd.DataFrame, var_mean: pd.DataFrame, elapsed: pd.DataFrame,
                         structures=("block", "dense", "kfac")) -> pd.DataFrame:
    """Per temporal strategy and structure, from the replicate means ``mean``, ``var_mean`` and ``elapsed`` (rows
    ``NUTS`` and ``SMP-<strategy>-<structure>``, possibly of several studies on the same replicates): accuracy, NLL,
    ECE, mutual information and logit variance as multiples of NUTS's, and seconds."""
    nuts_mi, nuts_lv = mean.loc["NUTS", "mutual_info"], var_mean.loc["NUTS", "logits_variance"]
    rows = []
    for strategy in STRATEGIES:
        for structure in structures:
            name = f"SMP-{strategy}-{structure}"
            if name in mean.index:
                rows.append({"strategy": strategy, "structure": structure, **mean.loc[name, ["accuracy", "nll", "ece"]],
                             "mi_over_nuts": mean.loc[name, "mutual_info"] / nuts_mi,
                             "logits_variance_over_nuts": var_mean.loc[name, "logits_variance"] / nuts_lv,
                             "seconds": elapsed.loc[name, "seconds"]})
    return pd.DataFrame(rows).set_index(["strategy", "structure"])


def structure_findings(comparison: pd.DataFrame) -> pd.DataFrame:
    """Per temporal strategy: the structure whose mutual information is closest to NUTS's (smallest
    ``|log(MI / MI_NUTS)|``), the one with the lowest NLL, and where KFAC ranks on each (1 = best)."""
    def kfac_rank(values: pd.Series) -> int | None:
        return int(values.rank(method="min")["kfac"]) if "kfac" in values.index else None

    rows = []
    for strategy, group in comparison.groupby(level="strategy", sort=False):
        group = group.droplevel("strategy")
        distance = np.log(group["mi_over_nuts"]).abs()
        rows.append({"strategy": strategy, "closest to NUTS by MI": distance.idxmin(),
                     "kfac rank by MI distance": kfac_rank(distance), "lowest NLL": group["nll"].idxmin(),
                     "kfac rank by NLL": kfac_rank(group["nll"])})
    return pd.DataFrame(rows).set_index("strategy")
