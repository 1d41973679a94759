"""Predictive metrics of the paper (Section 3.1.2 and Appendix A "Predictive metrics").

Every function is a pure function on torch tensors (no I/O, no plotting) and computes in
``float64`` whatever the input dtype or device (so not on Apple's MPS, which has no float64).

Conventions:

* ``probs`` has shape ``(S, N, C)``: ``probs[l, i, j] = f_{theta^(l)}(j | x_i)``, the predictive
  probability of class ``j`` at test point ``x_i`` under parameter sample ``theta^(l)``. A point
  estimate (MAP, NUTS-mean) is ``S = 1``: use ``probs.unsqueeze(0)`` on an ``(N, C)`` tensor.
  Binary problems use two-class vectors (``C = 2``); :func:`binary_probs` builds them from the
  probabilities of class 1.
* ``labels`` has shape ``(N,)`` and holds integer class indices in ``[0, C)`` (int64; other
  integer dtypes, and floating tensors with whole values such as Bernoulli draws, are converted).
* The predictive distribution is the sample average (Section 3.1.2)::

      f_hat(j | x_i) = (1/S) sum_l f_{theta^(l)}(j | x_i),

  computed by :func:`predictive`.

Scalar metrics are returned as Python floats; :func:`all_scores` collects the eight metrics of
the paper's score tables. :func:`params_variance` and :func:`logits_variance` give the two
columns of the paper's variance tables (``NaN`` for a point estimate, as printed there).

Regression (beyond the paper, whose examples are classifications): with a Gaussian likelihood of
known noise ``sigma`` (a number, or a one-element tensor) the predictive is the mixture
``(1/S) sum_l N(y; g(x_i, theta^(l)), sigma^2)``;
``means`` of shape ``(S, N, m)`` (as :func:`~smp_core.models.predict` returns) holds its component means.
:func:`regression_scores` collects its RMSE, NLL, CRPS, interval coverage and width;
:func:`pit` gives the values for a regression reliability diagram.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

__all__ = [
    "CalibrationCurve",
    "NLL_FLOOR",
    "PROB_SUM_TOL",
    "REGRESSION_SCORE_KEYS",
    "SCORE_KEYS",
    "accuracy",
    "all_scores",
    "binary_probs",
    "brier",
    "calibration_curve",
    "crps",
    "ece",
    "epistemic_std",
    "expected_entropy",
    "gaussian_nll",
    "interval_coverage",
    "interval_width",
    "jackknife_se",
    "logits_variance",
    "mutual_information",
    "mutual_information_per_sample",
    "n_trimmed",
    "nll",
    "params_variance",
    "pit",
    "predictive",
    "predictive_entropy",
    "predictive_mean",
    "predictive_quantile",
    "regression_scores",
    "rmse",
    "trimmed_mutual_information",
]

NLL_FLOOR = 1e-12
"""Smallest predictive probability used inside the log of :func:`nll` (so at most ``-log(1e-12) ~ 27.6``
per point instead of ``inf``)."""

PROB_SUM_TOL = 1e-4
"""Largest accepted deviation of ``sum_j probs[l, i, j]`` from 1."""

SCORE_KEYS = (
    "accuracy", "brier", "nll", "ece", "pred_entropy", "exp_entropy", "mutual_info", "epistemic_std",
)
"""The keys of :func:`all_scores`, in the column order of the paper's score tables."""


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _check_probs(probs: torch.Tensor) -> torch.Tensor:
    """Validates an ``(S, N, C)`` probability tensor and returns it detached in float64."""
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"probs must be a torch.Tensor, got {type(probs).__name__}")
    if probs.ndim != 3:
        raise ValueError(
            f"probs must have shape (S, N, C) (samples x points x classes), got ndim={probs.ndim} "
            f"shape {tuple(probs.shape)}; for a point estimate use probs.unsqueeze(0), for binary "
            "probabilities of class 1 use binary_probs")
    s, n, c = probs.shape
    if s < 1 or n < 1:
        raise ValueError(f"probs needs at least one sample and one point, got shape {tuple(probs.shape)}")
    if c < 2:
        raise ValueError(f"probs needs at least 2 classes (binary problems use C=2, see binary_probs), "
                         f"got C={c}")
    if not probs.dtype.is_floating_point:
        raise ValueError(f"probs must be a floating-point tensor, got dtype {probs.dtype}")
    p = probs.detach().to(torch.float64)
    if not torch.isfinite(p).all():
        raise ValueError("probs contains NaN or infinite values")
    if (p < 0).any():
        raise ValueError(f"probs contains negative probabilities (min {p.min().item():.3g})")
    dev = (p.sum(dim=-1) - 1.0).abs().max().item()
    if dev > PROB_SUM_TOL:
        raise ValueError(
            f"probs do not sum to 1 along the class dimension (last axis) within {PROB_SUM_TOL:g}: "
            f"largest deviation {dev:.3g}; pass probabilities (e.g. softmax of logits), not logits")
    return p


def _check_labels(labels: torch.Tensor, n: int, c: int, device: torch.device) -> torch.Tensor:
    """Validates ``(N,)`` integer class labels in ``[0, C)`` and returns them as int64 on ``device``."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.ndim != 1:
        raise ValueError(f"labels must have shape (N,), got ndim={labels.ndim} shape {tuple(labels.shape)}")
    if labels.shape[0] != n:
        raise ValueError(f"labels has {labels.shape[0]} entries but probs has N={n} points")
    if labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(f"labels must hold integer class indices, got dtype {labels.dtype}")
    if labels.dtype.is_floating_point:
        if not torch.isfinite(labels).all() or (labels != labels.round()).any():
            raise ValueError("labels must hold integer class indices; got non-integer floating-point values")
    y = labels.detach().to(device=device, dtype=torch.int64)
    if (y < 0).any() or (y >= c).any():
        raise ValueError(
            f"labels out of range: class indices must lie in [0, {c}) for C={c} classes, "
            f"got min {y.min().item()} max {y.max().item()}")
    return y


def _check_n_bins(n_bins: int) -> int:
    if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}")
    return n_bins


def _check_samples(x: torch.Tensor, name: str, ndims: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim not in ndims:
        shapes = {2: "(S, d)" if name == "theta" else "(S, N)", 3: "(S, N, C)"}
        allowed = " or ".join(shapes[k] for k in ndims)
        raise ValueError(f"{name} must have shape {allowed}, got ndim={x.ndim} shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)})")
    x = x.detach().to(torch.float64)
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return x


def _entropy(p: torch.Tensor) -> torch.Tensor:
    """``-sum_j p_j log p_j`` over the last axis with ``0 log 0 = 0`` (natural log)."""
    return -torch.special.xlogy(p, p).sum(dim=-1)


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------


def binary_probs(p: torch.Tensor) -> torch.Tensor:
    """Two-class probability vectors from probabilities of class 1.

    For the binary likelihood (eq. 2.7) with ``p = P(Y = 1 | x) = sigmoid(g)`` the metrics use
    the vector ``(1 - p, p)``, so class 0 and class 1 match the labels 0 and 1.

    Args:
        p: ``(S, N)`` probabilities of class 1, values in ``[0, 1]``.

    Returns:
        ``(S, N, 2)`` tensor ``[..., 0] = 1 - p`` and ``[..., 1] = p``, in ``p``'s floating dtype
        (float64 for an integer input).

    Raises:
        ValueError: if ``p`` is not 2-D, contains NaN/inf, or has values outside ``[0, 1]``.
    """
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"p must be a torch.Tensor, got {type(p).__name__}")
    if p.ndim != 2:
        raise ValueError(f"p must have shape (S, N) (probabilities of class 1), got ndim={p.ndim} "
                         f"shape {tuple(p.shape)}")
    if not p.dtype.is_floating_point:
        p = p.to(torch.float64)
    if not torch.isfinite(p).all():
        raise ValueError("p contains NaN or infinite values")
    if p.numel() and ((p < 0).any() or (p > 1).any()):
        raise ValueError(f"p must hold probabilities in [0, 1], got min {p.min().item():.3g} "
                         f"max {p.max().item():.3g}")
    return torch.stack([1 - p, p], dim=-1)


def predictive(probs: torch.Tensor) -> torch.Tensor:
    """Sample-averaged predictive distribution ``f_hat`` (Section 3.1.2).

    ``f_hat(j | x_i) = (1/S) sum_{l=1}^S f_{theta^(l)}(j | x_i)``.

    Args:
        probs: ``(S, N, C)`` per-sample predictive probabilities.

    Returns:
        ``(N, C)`` float64 tensor of predictive probabilities.

    Raises:
        ValueError: on a malformed ``probs`` (see module docstring).
    """
    return _check_probs(probs).mean(dim=0)


# --------------------------------------------------------------------------------------------------
# Appendix A metrics
# --------------------------------------------------------------------------------------------------


def accuracy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Accuracy of the predictive mode (Appendix A, higher is better).

    ``Acc = (1/N) sum_i 1( argmax_j f_hat(j | x_i) = y_i )``. The argmax is taken of the
    sample-averaged predictive ``f_hat`` (not a majority vote over samples); ties go to the
    lowest class index.

    Args:
        probs: ``(S, N, C)`` per-sample predictive probabilities.
        labels: ``(N,)`` integer class labels in ``[0, C)``.

    Returns:
        The fraction of correctly classified points, in ``[0, 1]``.

    Raises:
        ValueError: on malformed ``probs`` or ``labels``.
    """
    f_hat = predictive(probs)
    y = _check_labels(labels, f_hat.shape[0], f_hat.shape[1], f_hat.device)
    return (f_hat.argmax(dim=-1) == y).to(torch.float64).mean().item()


def brier(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Multiclass Brier score (Appendix A, lower is better).

    ``Brier = (1/N) sum_i sum_{j in Y} ( f_hat(j | x_i) - 1(y_i = j) )^2``: summed (not
    averaged) over classes, so it lies in ``[0, 2]``.

    Args:
        probs: ``(S, N, C)`` per-sample predictive probabilities.
        labels: ``(N,)`` integer class labels in ``[0, C)``.

    Returns:
        The Brier score.

    Raises:
        ValueError: on malformed ``probs`` or ``labels``.
    """
    f_hat = predictive(probs)
    y = _check_labels(labels, f_hat.shape[0], f_hat.shape[1], f_hat.device)
    onehot = torch.nn.functional.one_hot(y, f_hat.shape[1]).to(torch.float64)
    return ((f_hat - onehot) ** 2).sum(dim=-1).mean().item()


def nll(probs: torch.Tensor, labels: torch.Tensor, floor: float = NLL_FLOOR) -> float:
    """Negative log-likelihood of the predictive distribution (Appendix A, lower is better).

    ``NLL = -(1/N) sum_i log f_hat(y_i | x_i)``.

    Unlike the bare formula, ``f_hat(y_i | x_i)`` is clamped from below at ``floor`` (default
    ``1e-12``, in float64) before the log, so a point given probability 0 contributes
    ``-log(floor) ~ 27.6`` instead of making the NLL infinite. Above the floor the value is
    exact; for ``S = 1`` it equals ``torch.nn.functional.cross_entropy`` on the logits.

    Args:
        probs: ``(S, N, C)`` per-sample predictive probabilities.
        labels: ``(N,)`` integer class labels in ``[0, C)``.
        floor: the probability floor inside the log; must be in ``(0, 1]``.

    Returns:
        The mean negative log predictive probability of the true labels (natural log).

    Raises:
        ValueError: on malformed ``probs``, ``labels`` or ``floor``.
    """
    if not (0 < floor <= 1):
        raise ValueError(f"floor must be in (0, 1], got {floor}")
    f_hat = predictive(probs)
    y = _check_labels(labels, f_hat.shape[0], f_hat.shape[1], f_hat.device)
    p_true = f_hat.gather(1, y.unsqueeze(1)).squeeze(1)
    return (-torch.log(p_true.clamp_min(floor))).mean().item()


@dataclass(frozen=True)
class CalibrationCurve:
    """Data of a reliability diagram (calibration plot), one entry per confidence bin.

    Attributes:
        edges: ``(J + 1,)`` float64 bin edges ``linspace(0, 1, J + 1)``; bin ``k`` is
            ``[edges[k], edges[k + 1])``, the top bin is closed, ``[edges[J-1], 1]``.
        counts: ``(J,)`` int64 number of points ``|B_k|`` in each bin (they sum to ``N``).
        confidence: ``(J,)`` float64 mean confidence ``conf(B_k)``; NaN for empty bins.
        accuracy: ``(J,)`` float64 fraction of correct predictions ``acc(B_k)``; NaN for empty bins.
        n_points: the number of test points ``N``.
    """

    edges: torch.Tensor
    counts: torch.Tensor
    confidence: torch.Tensor
    accuracy: torch.Tensor
    n_points: int

    @property
    def centers(self) -> torch.Tensor:
        """``(J,)`` bin midpoints, e.g. for the bars of a reliability diagram."""
        return 0.5 * (self.edges[:-1] + self.edges[1:])

    @property
    def gap(self) -> torch.Tensor:
        """``(J,)`` ``acc(B_k) - conf(B_k)`` (NaN for empty bins); positive means under-confident."""
        return self.accuracy - self.confidence

    @property
    def ece(self) -> float:
        """``sum_k |B_k| / N * |acc(B_k) - conf(B_k)|`` over the non-empty bins (Appendix A)."""
        nonempty = self.counts > 0
        w = self.counts[nonempty].to(torch.float64) / self.n_points
        return (w * self.gap[nonempty].abs()).sum().item()


def calibration_curve(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 10) -> CalibrationCurve:
    """Per-bin confidence and accuracy of the predictive distribution (the ECE binning).

    Each point gets confidence ``c_i = max_j f_hat(j | x_i)`` and prediction
    ``argmax_j f_hat(j | x_i)`` (ties to the lowest index). The ``J = n_bins`` equal-width bins
    on ``[0, 1]`` have edges ``linspace(0, 1, J + 1)``; bin ``k`` holds ``edges[k] <= c < edges[k+1]``
    and the top bin also includes ``c = 1.0``.

    Args:
        probs: ``(S, N, C)`` per-sample predictive probabilities.
        labels: ``(N,)`` integer class labels in ``[0, C)``.
        n_bins: the number of bins ``J``.

    Returns:
        A :class:`CalibrationCurve` with the bin edges, counts ``|B_k|``, mean confidences
        ``conf(B_k)`` and accuracies ``acc(B_k)`` (NaN where a bin is empty).

    Raises:
        ValueError: on malformed ``probs``, ``labels`` or ``n_bins``.
    """
    n_bins = _check_n_bins(n_bins)
    f_hat = predictive(probs)
    n, c = f_hat.shape
    y = _check_labels(labels, n, c, f_hat.device)
    conf, pred = f_hat.max(dim=-1)
    correct = (pred == y).to(torch.float64)
    edges = torch.linspace(0.0, 1.0, n_bins + 1, dtype=torch.float64, device=f_hat.device)
    # right=True: index k with edges[k-1] <= conf < edges[k]; conf = 1.0 gives J + 1, folded into bin J - 1.
    idx = (torch.bucketize(conf, edges, right=True) - 1).clamp(0, n_bins - 1)
    counts = torch.bincount(idx, minlength=n_bins)
    sum_conf = torch.zeros(n_bins, dtype=torch.float64, device=f_hat.device).index_add_(0, idx, conf)
    sum_acc = torch.zeros(n_bins, dtype=torch.float64, device=f_hat.device).index_add_(0, idx, correct)
    cnt = counts.to(torch.float64)
    nan = torch.full_like(cnt, math.nan)
    mean_conf = torch.where(counts > 0, sum_conf / cnt.clamp_min(1), nan)
    mean_acc = torch.where(counts > 0, sum_acc / cnt.clamp_min(1), nan)
    return CalibrationCurve(edges=edges, counts=counts, confidence=mean_conf, accuracy=mean_acc, n_points=n)


def ece(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 10) -> float:
    """Expected calibration error (Appendix A, lower is better).

    ``ECE = sum_{k=1}^J |B_k| / N * |acc(B_k) - conf(B_k)|`` with the confidence
    ``max_j f_hat(j | x)`` binned into ``J = n_bins`` equal-width bins on ``[0, 1]`` (top bin
    closed at 1.0); empty bins contribute nothing. See :func:`calibration_curve` for the binning.

    Args:
        probs: ``(S, N, C)`` per-sample predictive probabilities.
        labels: ``(N,)`` integer class labels in ``[0, C)``.
        n_bins: the number of bins ``J``.

    Returns:
        The ECE, in ``[0, 1]``.

    Raises:
        ValueError: on malformed ``probs``, ``labels`` or ``n_bins``.
    """
    return calibration_curve(probs, labels, n_bins).ece


def predictive_entropy(probs: torch.Tensor, per_point: bool = False) -> float | torch.Tensor:
    """Predictive entropy ``H_pred``: total uncertainty (Appendix A).

    ``H_pred = (1/N) sum_i ( -sum_j f_hat(j | x_i) log f_hat(j | x_i) )`` with the natural log
    and ``0 log 0 = 0`` (``torch.special.xlogy``). Equals ``log C`` for uniform predictions.

    Args:
        probs: ``(S, N, C)`` per-sample predictive probabilities.
        per_point: return the ``(N,)`` per-point entropies instead of their mean (for maps).

    Returns:
        The mean predictive entropy in nats, or an ``(N,)`` float64 tensor if ``per_point``.

    Raises:
        ValueError: on a malformed ``probs``.
    """
    h = _entropy(predictive(probs))
    return h if per_point else h.mean().item()


def expected_entropy(probs: torch.Tensor, per_point: bool = False) -> float | torch.Tensor:
    """Expected entropy ``H_exp``: average aleatoric uncertainty (Appendix A).

    ``H_exp = (1/N) sum_i (1/S) sum_l ( -sum_j f_{theta^(l)}(j | x_i) log f_{theta^(l)}(j | x_i) )``
    with the natural log and ``0 log 0 = 0``.

    Args:
        probs: ``(S, N, C)`` per-sample predictive probabilities.
        per_point: return the ``(N,)`` per-point values (averaged over samples) instead of their mean.

    Returns:
        The mean expected entropy in nats, or an ``(N,)`` float64 tensor if ``per_point``.

    Raises:
        ValueError: on a malformed ``probs``.
    """
    h = _entropy(_check_probs(probs)).mean(dim=0)
    return h if per_point else h.mean().item()


def mutual_information(probs: torch.Tensor, per_point: bool = False) -> float | torch.Tensor:
    """Mutual information ``MI = H_pred - H_exp``: epistemic uncertainty (Appendix A).

    Computed per point as ``H(f_hat(. | x_i)) - (1/S) sum_l H(f_{theta^(l)}(. | x_i))`` and then
    averaged over points, which equals ``H_pred - H_exp``. Each per-point difference is
    ``>= 0`` by concavity of the entropy (Jensen); it is clamped at 0, which only removes
    floating-point rounding (of order 1e-16). It is 0 for ``S = 1`` and for identical samples.

    Args:
        probs: ``(S, N, C)`` per-sample predictive probabilities.
        per_point: return the ``(N,)`` per-point values instead of their mean (for maps).

    Returns:
        The mean mutual information in nats, or an ``(N,)`` float64 tensor if ``per_point``.

    Raises:
        ValueError: on a malformed ``probs``.
    """
    p = _check_probs(probs)
    mi = (_entropy(p.mean(dim=0)) - _entropy(p).mean(dim=0)).clamp_min(0.0)
    return mi if per_point else mi.mean().item()


def mutual_information_per_sample(probs: torch.Tensor) -> torch.Tensor:
    """Each sample's part of the mutual information: ``c_l = (1/N) sum_i KL(f_l(. | x_i) || f_hat(. | x_i))``.

    The mutual information of Appendix A splits exactly over the samples, because
    ``sum_j f_hat(j | x) log f_hat(j | x) = (1/S) sum_l sum_j f_l(j | x) log f_hat(j | x)``::

        MI = H_pred - H_exp = (1/N) sum_i (1/S) sum_l KL(f_l(. | x_i) || f_hat(. | x_i)) = (1/S) sum_l c_l.

    So ``c_l`` says how far sample (chain) ``l`` alone is from the predictive, and a ``c_l`` that is
    most of ``sum_l c_l`` says that the mutual information is one chain's excursion, not a spread of
    all the chains. (``0 log 0 = 0``; where ``f_hat(j | x) = 0`` every ``f_l(j | x)`` is 0 too.)

    Args:
        probs: ``(S, N, C)`` per-sample predictive probabilities.

    Returns:
        An ``(S,)`` float64 tensor of values ``>= 0`` (clamped at 0 against rounding) whose mean is
        :func:`mutual_information`; zeros for ``S = 1``.

    Raises:
        ValueError: on a malformed ``probs``.
    """
    p = _check_probs(probs)
    p_hat = p.mean(dim=0, keepdim=True)
    kl = (torch.special.xlogy(p, p) - torch.special.xlogy(p, p_hat)).sum(dim=-1)  # (S, N)
    return kl.mean(dim=1).clamp_min(0.0)


def n_trimmed(n_samples: int, trim: float) -> int:
    """How many of ``n_samples`` samples :func:`trimmed_mutual_information` leaves out: ``floor(trim * S)``
    (computed without floating-point loss: ``0.29 * 100`` is ``28.999...96``), at most ``S - 1``.

    Raises:
        ValueError: if ``trim`` is not a real number in ``[0, 1)`` or ``n_samples < 1``.
    """
    if isinstance(trim, bool) or not isinstance(trim, numbers.Real):
        raise ValueError(f"trim must be a real number (a fraction in [0, 1)), got {type(trim).__name__} {trim!r}")
    if not 0.0 <= float(trim) < 1.0:
        raise ValueError(f"trim must be a fraction in [0, 1), got {float(trim)!r}")
    if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral) or n_samples < 1:
        raise ValueError(f"n_samples must be a positive integer, got {n_samples!r}")
    return min(math.floor(float(trim) * int(n_samples) + 1e-9), int(n_samples) - 1)


def trimmed_mutual_information(probs: torch.Tensor, trim: float = 0.1,
                               parts: torch.Tensor | None = None) -> float:
    """Mutual information without the most deviant samples: a dispersion summary that a few chains'
    excursions do not dominate (ours, not the paper's).

    The :func:`n_trimmed` ``= floor(trim * S)`` samples with the largest parts
    :func:`mutual_information_per_sample` (computed with all samples; a stable sort, so of tied samples
    the later ones go first) are left out, and :func:`mutual_information` of the ``K`` kept samples is
    returned, with the predictive re-formed from them. ``trim = 0`` gives the mutual information itself.

    It is never larger than the mutual information: for any distribution ``q``,
    ``(1/K) sum_{l kept} KL(f_l || q) = MI_kept + KL(f_hat_kept || q)``, so with ``q = f_hat`` of all
    samples ``MI_kept <= (1/K) sum_{l kept} c_l <= (1/S) sum_l c_l = MI``. It measures how far the
    typical samples spread, which is another quantity than the mutual information: it drops a
    variant's occasional large excursions by design. Compare it only between sample sets of the same
    size trimmed by the same fraction. The samples to leave out are chosen on the same points as it is
    measured on.

    Args:
        probs: ``(S, N, C)`` per-sample predictive probabilities.
        trim: the fraction of samples to leave out, in ``[0, 1)``; at least one sample is kept.
        parts: :func:`mutual_information_per_sample` of ``probs`` when already computed (not checked).

    Returns:
        The mean mutual information of the kept samples, in nats.

    Raises:
        ValueError: on a malformed ``probs`` or a ``trim`` that is not a fraction in ``[0, 1)``.
    """
    p = _check_probs(probs)
    n_drop = n_trimmed(p.shape[0], trim)
    if n_drop == 0:
        return mutual_information(p)
    parts = mutual_information_per_sample(p) if parts is None else parts
    keep = parts.argsort(stable=True)[: p.shape[0] - n_drop]
    return mutual_information(p[keep])


def epistemic_std(probs: torch.Tensor, per_point: bool = False) -> float | torch.Tensor:
    """Epistemic standard deviation of the predictive probabilities (Appendix A).

    ::

        EpistemicStd = (1/N) sum_i (1/C) sum_j sqrt((1/S) sum_l (f_{theta^(l)}(j|x_i) - f_hat(j|x_i))^2).

    This is the population (``1/S``, not ``1/(S-1)``) standard deviation across samples, averaged over
    classes and then over points. It is 0 for ``S = 1``.

    Args:
        probs: ``(S, N, C)`` per-sample predictive probabilities.
        per_point: return the ``(N,)`` class-averaged values instead of their mean (for maps).

    Returns:
        The epistemic standard deviation, or an ``(N,)`` float64 tensor if ``per_point``.

    Raises:
        ValueError: on a malformed ``probs``.
    """
    p = _check_probs(probs)
    sd = ((p - p.mean(dim=0)) ** 2).mean(dim=0).sqrt().mean(dim=-1)
    return sd if per_point else sd.mean().item()


def all_scores(probs: torch.Tensor, labels: torch.Tensor, n_bins: int = 10) -> dict[str, float]:
    """The eight predictive metrics of the paper's score tables (Appendix A).

    Args:
        probs: ``(S, N, C)`` per-sample predictive probabilities.
        labels: ``(N,)`` integer class labels in ``[0, C)``.
        n_bins: the number of ECE bins ``J``.

    Returns:
        A dict of Python floats with keys, in order, ``accuracy``, ``brier``, ``nll``, ``ece``,
        ``pred_entropy``, ``exp_entropy``, ``mutual_info``, ``epistemic_std``.

    Raises:
        ValueError: on malformed ``probs``, ``labels`` or ``n_bins``.
    """
    p = _check_probs(probs)  # validate once; the float64 copy passes the checks again cheaply
    return {
        "accuracy": accuracy(p, labels),
        "brier": brier(p, labels),
        "nll": nll(p, labels),
        "ece": ece(p, labels, n_bins),
        "pred_entropy": predictive_entropy(p),
        "exp_entropy": expected_entropy(p),
        "mutual_info": mutual_information(p),
        "epistemic_std": epistemic_std(p),
    }


# --------------------------------------------------------------------------------------------------
# Regression (beyond the paper): the predictive of a Gaussian likelihood
# --------------------------------------------------------------------------------------------------

REGRESSION_SCORE_KEYS = ("rmse", "nll", "crps", "coverage", "interval_width")
"""The keys of :func:`regression_scores`, in order."""

_CRPS_PAIR_CHUNK = 2**22  # elements (pairs or CDF evaluations) held at once by the CRPS's second term


def _check_means(means: torch.Tensor) -> torch.Tensor:
    """Validates ``(S, N, m)`` network outputs (the Gaussian means) and returns them in float64."""
    if not isinstance(means, torch.Tensor):
        raise TypeError(f"means must be a torch.Tensor, got {type(means).__name__}")
    if means.ndim != 3:
        raise ValueError(f"means must have shape (S, N, m) (samples x points x outputs, as smp_core.predict "
                         f"returns), got ndim={means.ndim} shape {tuple(means.shape)}; for a point estimate use "
                         "means.unsqueeze(0)")
    if means.numel() == 0:
        raise ValueError(f"means is empty (shape {tuple(means.shape)})")
    if not means.dtype.is_floating_point:
        raise ValueError(f"means must be a floating-point tensor, got dtype {means.dtype}")
    x = means.detach().to(torch.float64)
    if not torch.isfinite(x).all():
        raise ValueError("means contains NaN or infinite values")
    return x


def _check_targets(y: torch.Tensor, n: int, m: int, device: torch.device) -> torch.Tensor:
    """Validates responses ``(N,)`` (one output) or ``(N, m)`` and returns them as ``(N, m)`` float64."""
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"y must be a torch.Tensor, got {type(y).__name__}")
    if tuple(y.shape) == (n,) and m == 1:
        y = y[:, None]
    if tuple(y.shape) != (n, m):
        allowed = f"({n},) or ({n}, 1)" if m == 1 else f"({n}, {m})"
        raise ValueError(f"y must have shape {allowed} to match means (S, {n}, {m}), got {tuple(y.shape)}")
    if y.dtype == torch.bool or y.is_complex():
        raise ValueError(f"y must hold real responses, got dtype {y.dtype}")
    y = y.detach().to(device=device, dtype=torch.float64)
    if not torch.isfinite(y).all():
        raise ValueError("y contains NaN or infinite values")
    return y


def _check_sigma(sigma) -> float:
    if isinstance(sigma, torch.Tensor) and sigma.numel() == 1 and sigma.dtype.is_floating_point:
        sigma = float(sigma)
    if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real) or not math.isfinite(sigma) or not sigma > 0:
        raise ValueError(f"sigma (the Gaussian noise standard deviation) must be a positive finite number, "
                         f"got {sigma!r}")
    return float(sigma)


def _check_level(level, name: str = "level") -> float:
    if isinstance(level, bool) or not isinstance(level, numbers.Real) or not 0 < level < 1:
        raise ValueError(f"{name} must lie strictly between 0 and 1 (e.g. 0.9 for a 90 % interval), got {level!r}")
    return float(level)


def _one_output(means: torch.Tensor, lead: str) -> torch.Tensor:
    """Validated ``(S, N, 1)`` means in float64; ``lead`` starts the message for more than one output."""
    mu = _check_means(means)
    if mu.shape[2] != 1:
        raise ValueError(f"{lead} one output per point; means has m={mu.shape[2]} outputs "
                         "(score each output separately: means[..., j:j+1], y[:, j])")
    return mu


def _univariate(means: torch.Tensor, y: torch.Tensor, sigma, what: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(S, N)`` means and ``(N,)`` responses of a one-output regression, for the univariate scores."""
    mu = _one_output(means, f"{what} is defined for")
    return mu[..., 0], _check_targets(y, mu.shape[1], 1, mu.device)[:, 0], _check_sigma(sigma)


def _normal_cdf(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.erfc(-z / math.sqrt(2.0))


def _normal_pdf(z: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def predictive_mean(means: torch.Tensor) -> torch.Tensor:
    """The regression predictive's mean ``(1/S) sum_l g(x_i, theta^(l))``, ``(N, m)`` float64.

    The Gaussian likelihood's predictive is the mixture ``(1/S) sum_l N(y; g(x_i, theta^(l)),
    sigma^2 I)``, the regression counterpart of the sample average of Section 3.1.2; its mean does
    not depend on ``sigma``.

    Args:
        means: ``(S, N, m)`` network outputs, one row per parameter sample (``smp_core.predict``).

    Raises:
        ValueError: on a malformed ``means``.
    """
    return _check_means(means).mean(dim=0)


def rmse(means: torch.Tensor, y: torch.Tensor) -> float:
    """Root mean squared error of the predictive mean, ``sqrt(1/(N m) sum_i ||y_i - mean_i||^2)``.

    Args:
        means: ``(S, N, m)`` network outputs (``S = 1`` for a point estimate).
        y: ``(N,)`` (one output) or ``(N, m)`` responses.

    Raises:
        ValueError: on malformed ``means`` or ``y``.
    """
    mu = predictive_mean(means)
    target = _check_targets(y, mu.shape[0], mu.shape[1], mu.device)
    return ((target - mu) ** 2).mean().sqrt().item()


def gaussian_nll(means: torch.Tensor, y: torch.Tensor, sigma: float, per_point: bool = False) -> float | torch.Tensor:
    """Negative log predictive density of the Gaussian mixture predictive (lower is better).

    ``-(1/N) sum_i log[(1/S) sum_l N(y_i; g(x_i, theta^(l)), sigma^2 I_m)]``, the regression
    analogue of the paper's NLL (Appendix A), in nats per point (summed over the ``m`` outputs of a
    point), computed with a log-sum-exp so that no density underflows.

    Args:
        means: ``(S, N, m)`` network outputs; ``S = 1`` gives a point estimate's plug-in NLL.
        y: ``(N,)`` (one output) or ``(N, m)`` responses.
        sigma: the noise standard deviation of the Gaussian likelihood.
        per_point: return the ``(N,)`` per-point values instead of their mean.

    Raises:
        ValueError: on malformed ``means``, ``y`` or ``sigma``.
    """
    mu = _check_means(means)
    s, n, m = mu.shape
    target = _check_targets(y, n, m, mu.device)
    sigma = _check_sigma(sigma)
    z = (target[None] - mu) / sigma
    log_density = -0.5 * (z * z).sum(dim=-1) - m * (0.5 * math.log(2 * math.pi) + math.log(sigma))  # (S, N)
    value = -(torch.logsumexp(log_density, dim=0) - math.log(s))
    return value if per_point else value.mean().item()


def pit(means: torch.Tensor, y: torch.Tensor, sigma: float) -> torch.Tensor:
    """Probability integral transform ``u_i = F_i(y_i) = (1/S) sum_l Phi((y_i - g(x_i, theta^(l))) / sigma)``.

    ``F_i`` is the predictive's CDF at point ``i``. For responses drawn from the predictive itself the
    ``u_i`` are uniform on ``[0, 1]``: a histogram of them is the regression reliability diagram
    (U-shaped: over-confident; hump-shaped: under-confident).

    Args:
        means: ``(S, N, 1)`` network outputs of a one-output regression.
        y: ``(N,)`` or ``(N, 1)`` responses.
        sigma: the noise standard deviation.

    Returns:
        ``(N,)`` float64 values in ``[0, 1]``.

    Raises:
        ValueError: on malformed input or more than one output.
    """
    mu, target, sigma = _univariate(means, y, sigma, "the PIT")
    return _normal_cdf((target[None] - mu) / sigma).mean(dim=0)


def interval_coverage(means: torch.Tensor, y: torch.Tensor, sigma: float, level: float = 0.9) -> float:
    """Share of responses inside the predictive's central ``level`` interval (nominal: ``level``).

    The central interval ``[F_i^{-1}((1 - level)/2), F_i^{-1}((1 + level)/2)]`` of the mixture CDF
    ``F_i`` (continuous and increasing) holds ``y_i`` exactly when ``(1 - level)/2 <= u_i <= (1 + level)/2``
    for the PIT ``u_i`` (:func:`pit`), so no quantile is inverted. Under a calibrated predictive the
    count is Binomial(N, level): a standard error ``sqrt(level (1 - level) / N)``.

    Args:
        means: ``(S, N, 1)`` network outputs of a one-output regression.
        y: ``(N,)`` or ``(N, 1)`` responses.
        sigma: the noise standard deviation.
        level: the nominal coverage, in ``(0, 1)``.

    Raises:
        ValueError: on malformed input, more than one output, or a level outside ``(0, 1)``.
    """
    level = _check_level(level)
    u = pit(means, y, sigma)
    return ((u >= (1 - level) / 2) & (u <= (1 + level) / 2)).to(torch.float64).mean().item()


def predictive_quantile(means: torch.Tensor, sigma: float, q: float, tol: float = 1e-10) -> torch.Tensor:
    """``F_i^{-1}(q)`` of the Gaussian mixture predictive at every point, ``(N,)`` float64.

    The mixture's quantile has no closed form. ``F_i`` is increasing and the bracket
    ``[min_l mu_l + sigma Phi^{-1}(q), max_l mu_l + sigma Phi^{-1}(q)]`` holds the quantile (each
    component's ``q``-quantile bounds the mixture's); Newton steps on ``F_i(x) = q`` with the mixture's
    density, replaced by the bracket's midpoint whenever a step would leave the bracket (which shrinks
    at every iteration), converge at every point; they stop once every step is below ``tol sigma``, or
    every bracket narrower than it.

    Args:
        means: ``(S, N, 1)`` network outputs of a one-output regression.
        sigma: the noise standard deviation.
        q: the probability, in ``(0, 1)``.
        tol: the accuracy, relative to ``sigma``.

    Raises:
        ValueError: on malformed ``means``, ``sigma`` or ``q``, or more than one output.
    """
    mu = _one_output(means, "quantiles are defined for")
    mu, sigma, q = mu[..., 0], _check_sigma(sigma), _check_level(q, "q")
    shift = sigma * torch.special.ndtri(torch.tensor(q, dtype=torch.float64)).item()
    low, high = mu.min(dim=0).values + shift, mu.max(dim=0).values + shift
    x = (mu.mean(dim=0) + shift).clamp(low, high)
    for _ in range(200):
        z = (x[None] - mu) / sigma
        below = _normal_cdf(z).mean(dim=0) - q
        low, high = torch.where(below < 0, x, low), torch.where(below < 0, high, x)
        newton = x - below * sigma / _normal_pdf(z).mean(dim=0)
        inside = torch.isfinite(newton) & (newton >= low) & (newton <= high)
        moved = torch.where(inside, newton, 0.5 * (low + high))
        # one host synchronisation per iteration: the largest step and the widest bracket together
        step, bracket = torch.stack([(moved - x).abs().max(), (high - low).max()]).tolist()
        x = moved
        if min(step, bracket) <= tol * sigma:
            break
    return x


def interval_width(means: torch.Tensor, sigma: float, level: float = 0.9) -> float:
    """Mean width of the predictive's central ``level`` interval over the points (sharpness: smaller
    is sharper, at the coverage :func:`interval_coverage` reports).

    Args:
        means: ``(S, N, 1)`` network outputs of a one-output regression.
        sigma: the noise standard deviation.
        level: the interval's probability, in ``(0, 1)``.

    Raises:
        ValueError: on malformed input, more than one output, or a level outside ``(0, 1)``.
    """
    level = _check_level(level)
    upper = predictive_quantile(means, sigma, (1 + level) / 2)
    lower = predictive_quantile(means, sigma, (1 - level) / 2)
    return (upper - lower).mean().item()


def _crps_kernel(diff: torch.Tensor, scale: float) -> torch.Tensor:
    """``E|D|`` for ``D ~ N(diff, scale^2)``: ``diff (2 Phi(diff/scale) - 1) + 2 scale phi(diff/scale)``."""
    z = diff / scale
    return diff * (2 * _normal_cdf(z) - 1) + 2 * scale * _normal_pdf(z)


def _mixture_mean_abs_difference(mu: torch.Tensor, sigma: float) -> torch.Tensor:
    """``E|Y - Y'|`` per point for ``Y, Y'`` independent draws of the mixture ``(1/S) sum_l N(mu_l, sigma^2)``;
    ``mu`` ``(S, n)``, returns ``(n,)``.

    Two exact routes, the cheaper per point: the pairwise sum ``(1/S^2) sum_{l,l'} A(mu_l - mu_l', sqrt(2)
    sigma)`` (``S^2`` kernels), or ``2 integral F (1 - F)`` by the trapezoid rule on the components' range
    padded by ``10 sigma``, with ``G`` nodes at most ``sigma / 3`` apart (``S G`` CDF evaluations). ``F (1 - F)``
    is smooth on the scale ``sigma`` and negligible (below ``1e-23``) at the padded ends, where the
    trapezoid rule is exact to rounding (tested against the pairwise sum); it is used where ``G <= S``."""
    s, n = mu.shape
    pad, spacing = 10.0 * sigma, sigma / 3.0
    nodes = torch.ceil((mu.max(dim=0).values - mu.min(dim=0).values + 2 * pad) / spacing) + 1  # float64: no overflow
    by_quadrature = nodes <= s
    out = torch.empty(n, dtype=torch.float64, device=mu.device)
    pairwise = (~by_quadrature).nonzero().ravel()
    for chunk in pairwise.split(max(1, _CRPS_PAIR_CHUNK // (s * s))):
        block = mu[:, chunk]
        out[chunk] = _crps_kernel(block[:, None] - block[None], math.sqrt(2.0) * sigma).mean(dim=(0, 1))
    quadrature = by_quadrature.nonzero().ravel()
    if quadrature.numel():
        g = int(nodes[quadrature].max())
        fractions = torch.linspace(0.0, 1.0, g, dtype=torch.float64, device=mu.device)
        for chunk in quadrature.split(max(1, _CRPS_PAIR_CHUNK // (s * g))):
            block = mu[:, chunk]
            low, high = block.min(dim=0).values - pad, block.max(dim=0).values + pad
            z = low[:, None] + (high - low)[:, None] * fractions                      # (n_chunk, G)
            cdf = _normal_cdf((z[None] - block[:, :, None]) / sigma).mean(dim=0)
            out[chunk] = 2 * (cdf * (1 - cdf)).sum(dim=-1) * (high - low) / (g - 1)
    return out


def crps(means: torch.Tensor, y: torch.Tensor, sigma: float, per_point: bool = False) -> float | torch.Tensor:
    """Continuous ranked probability score of the Gaussian mixture predictive (lower is better).

    ``CRPS(F, y) = E|Y - y| - (1/2) E|Y - Y'|`` for ``Y, Y'`` independent draws of the predictive ``F``
    (Gneiting and Raftery, 2007), in the response's units; for the equally weighted mixture of
    ``N(mu_l, sigma^2)`` both expectations are closed forms (Grimit et al., 2006)::

        CRPS = (1/S) sum_l A(y - mu_l, sigma) - (1/(2 S^2)) sum_{l,l'} A(mu_l - mu_l', sqrt(2) sigma),

    with ``A(m, s) = m (2 Phi(m/s) - 1) + 2 s phi(m/s)`` the mean of ``|N(m, s^2)|``. The pairwise term
    costs ``S^2`` kernels per point; where the components span less than about ``S sigma / 3``, it is
    computed instead as ``2 integral F (1 - F)`` by a trapezoid rule that is exact to rounding for this
    smooth integrand (``_mixture_mean_abs_difference``), which costs ``S`` CDFs per node. Memory: work is
    chunked over points, not samples, so a point on the pairwise route holds a few ``S x S`` float64
    temporaries (about 0.8 GB each for ``S = 10^4``). For ``S = 1`` the score is the Gaussian's
    ``sigma [z (2 Phi(z) - 1) + 2 phi(z) - 1/sqrt(pi)]``, ``z = (y - mu)/sigma``.

    References: T. Gneiting and A. E. Raftery, Strictly proper scoring rules, prediction, and estimation,
    JASA 102 (2007) 359-378; E. P. Grimit, T. Gneiting, V. J. Berrocal and N. A. Johnson, The continuous
    ranked probability score for circular variables and its application to mesoscale forecast ensemble
    verification, QJRMS 132 (2006) 2925-2942.

    Args:
        means: ``(S, N, 1)`` network outputs of a one-output regression.
        y: ``(N,)`` or ``(N, 1)`` responses.
        sigma: the noise standard deviation.
        per_point: return the ``(N,)`` per-point values instead of their mean.

    Raises:
        ValueError: on malformed input or more than one output.
    """
    mu, target, sigma = _univariate(means, y, sigma, "the CRPS")
    to_target = _crps_kernel(target[None] - mu, sigma).mean(dim=0)  # (N,)
    value = to_target - 0.5 * _mixture_mean_abs_difference(mu, sigma)
    return value if per_point else value.mean().item()


def regression_scores(means: torch.Tensor, y: torch.Tensor, sigma: float, level: float = 0.9) -> dict[str, float]:
    """The regression predictive's scores (beyond the paper, whose examples are classifications).

    Args:
        means: ``(S, N, 1)`` network outputs of a one-output regression (``smp_core.predict``).
        y: ``(N,)`` or ``(N, 1)`` responses.
        sigma: the Gaussian likelihood's noise standard deviation.
        level: the central interval's nominal coverage.

    Returns:
        A dict of Python floats with keys, in order, ``rmse`` (:func:`rmse`), ``nll``
        (:func:`gaussian_nll`), ``crps`` (:func:`crps`), ``coverage`` (:func:`interval_coverage` at
        ``level``) and ``interval_width`` (:func:`interval_width` at ``level``).

    Raises:
        ValueError: on malformed input, more than one output, or a level outside ``(0, 1)``.
    """
    mu = _one_output(means, "regression_scores needs")  # every check up front, before any score is computed
    _check_targets(y, mu.shape[1], 1, mu.device)
    _check_sigma(sigma)
    _check_level(level)
    return {
        "rmse": rmse(mu, y),
        "nll": gaussian_nll(mu, y, sigma),
        "crps": crps(mu, y, sigma),
        "coverage": interval_coverage(mu, y, sigma, level),
        "interval_width": interval_width(mu, sigma, level),
    }


# --------------------------------------------------------------------------------------------------
# Variance tables
# --------------------------------------------------------------------------------------------------


def params_variance(theta: torch.Tensor) -> float:
    """Mean parameter variance: the "Params variance" column of the paper's variance tables.

    ``(1/d) sum_k Var_l(theta^(l)_k)`` with the unbiased sample variance
    ``Var_l(z) = 1/(S-1) sum_l (z_l - z_bar)^2``. The paper does not state the estimator; the
    ``1/(S-1)`` one is chosen because it is the default of Julia's ``var``, which the paper's
    Julia code would use (for ``S = 1000`` samples the two estimators differ by 0.1%).

    Args:
        theta: ``(S, d)`` parameter samples, one flat parameter vector per row.

    Returns:
        The variance averaged over the ``d`` dimensions; NaN for ``S = 1`` (a point estimate, as
        printed in the paper).

    Raises:
        ValueError: if ``theta`` is not 2-D, is empty, or contains NaN/inf.
    """
    x = _check_samples(theta, "theta", (2,))
    if x.shape[0] < 2:
        return math.nan
    return x.var(dim=0, correction=1).mean().item()


def logits_variance(logits: torch.Tensor) -> float:
    """Mean logit variance: the "Logits variance" column of the paper's variance tables.

    The variance across samples of the network outputs (logits, before the sigmoid/softmax),
    averaged over test points (and over output units for ``(S, N, C)``), with the same
    unbiased ``1/(S-1)`` estimator as :func:`params_variance`. The logits are taken as given,
    with no re-centering of the softmax's shift invariance.

    Args:
        logits: ``(S, N)`` (one logit per point, binary) or ``(S, N, C)`` network outputs.

    Returns:
        The mean variance; NaN for ``S = 1`` (a point estimate, as printed in the paper).

    Raises:
        ValueError: if ``logits`` is not 2-D or 3-D, is empty, or contains NaN/inf.
    """
    x = _check_samples(logits, "logits", (2, 3))
    if x.shape[0] < 2:
        return math.nan
    return x.var(dim=0, correction=1).mean().item()


def jackknife_se(samples: torch.Tensor, statistic) -> float:
    """Jackknife standard error of ``statistic(samples)`` over the first axis (the ``S`` samples).

    ``sqrt((S-1)/S sum_l (t_(l) - t_bar)^2)`` where ``t_(l)`` is the statistic of the samples with
    sample ``l`` left out (Efron and Stein, 1981). It gives a Monte Carlo error to a metric of a few
    independent chains (the variances, the mutual information) without rerunning them. For the
    sample mean it equals ``s / sqrt(S)`` exactly. In general its square is conservative in
    expectation (the Efron-Stein inequality); for the unbiased variance of Gaussian samples its
    square has exactly the mean ``2 sigma^4 / (S - 2)``, the variance of that statistic for
    ``S - 1`` samples (with heavier tails than the Gaussian's it is larger).

    Args:
        samples: ``(S, ...)`` with ``S >= 2`` (e.g. ``(S, d)`` parameters or ``(S, N, C)`` probabilities).
        statistic: a function of such a tensor with ``S - 1`` rows that returns a float.

    Returns:
        The standard error; NaN for ``S < 3`` (one left-out value per sample is too few to vary).
    """
    if samples.ndim < 1:
        raise ValueError("samples must have a leading axis of samples")
    n = samples.shape[0]
    if n < 3:
        return math.nan
    keep = torch.ones(n, dtype=torch.bool, device=samples.device)
    values = []
    for left_out in range(n):
        keep[left_out] = False
        values.append(float(statistic(samples[keep])))
        keep[left_out] = True
    t = torch.tensor(values, dtype=torch.float64)
    return math.sqrt((n - 1) / n * float(((t - t.mean()) ** 2).sum()))
