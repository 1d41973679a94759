"""Known-value tests of smp_core.metrics (the paper's Appendix A metrics, the variance tables and the regression
scores)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import smp_core.metrics as metrics_module
from smp_core.metrics import (
    NLL_FLOOR,
    REGRESSION_SCORE_KEYS,
    SCORE_KEYS,
    accuracy,
    all_scores,
    binary_probs,
    brier,
    calibration_curve,
    crps,
    ece,
    epistemic_std,
    expected_entropy,
    gaussian_nll,
    interval_coverage,
    interval_width,
    jackknife_se,
    logits_variance,
    mutual_information,
    mutual_information_per_sample,
    n_trimmed,
    nll,
    params_variance,
    pit,
    predictive,
    predictive_entropy,
    predictive_mean,
    predictive_quantile,
    regression_scores,
    rmse,
    trimmed_mutual_information,
)


def _t(rows, dtype=torch.float64):
    return torch.tensor(rows, dtype=dtype)


def _dirichlet(shape, gen, concentration=1.0):
    """Random probability vectors along the last axis (normalised Gamma draws)."""
    g = torch._standard_gamma(torch.full(shape, concentration, dtype=torch.float64), generator=gen)
    return g / g.sum(-1, keepdim=True)


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


def test_binary_probs_and_predictive():
    p = _t([[0.2, 1.0], [0.6, 0.0]])  # (S=2, N=2) probabilities of class 1
    b = binary_probs(p)
    assert b.shape == (2, 2, 2)
    torch.testing.assert_close(b[..., 1], p)
    torch.testing.assert_close(b[..., 0], 1 - p)
    torch.testing.assert_close(predictive(b), _t([[0.6, 0.4], [0.5, 0.5]]))
    assert predictive(b.float()).dtype == torch.float64


# ----------------------------------------------------------------------------------------------
# Accuracy, Brier, NLL
# ----------------------------------------------------------------------------------------------


def test_accuracy_uses_argmax_of_the_sample_mean():
    # Point 0: two of three samples vote class 1, but f_hat = (0.633, 0.367) picks class 0.
    # Point 1: every sample says class 1.
    probs = _t([
        [[0.45, 0.55], [0.1, 0.9]],
        [[0.45, 0.55], [0.2, 0.8]],
        [[1.00, 0.00], [0.3, 0.7]],
    ])
    assert accuracy(probs, torch.tensor([0, 1])) == 1.0
    assert accuracy(probs, torch.tensor([1, 1])) == 0.5
    assert accuracy(probs, torch.tensor([1, 0])) == 0.0


def test_brier_sums_over_classes():
    probs = _t([[[0.7, 0.2, 0.1], [0.2, 0.5, 0.3]]])
    labels = torch.tensor([0, 2])
    # point 0: 0.3^2 + 0.2^2 + 0.1^2 = 0.14 ; point 1: 0.2^2 + 0.5^2 + 0.7^2 = 0.78 ; mean 0.46
    assert brier(probs, labels) == pytest.approx(0.46, abs=1e-12)
    # the Brier score of f_hat, not the mean of the per-sample Brier scores
    two = _t([[[1.0, 0.0]], [[0.0, 1.0]]])
    assert brier(two, torch.tensor([0])) == pytest.approx(0.5, abs=1e-12)  # (0.5^2 + 0.5^2), not 1.0


def test_nll_equals_cross_entropy_for_a_point_estimate():
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(500, 7, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 7, (500,), generator=gen)
    probs = torch.softmax(logits, -1).unsqueeze(0)
    assert nll(probs, labels) == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-12)
    # float32 inputs are computed in float64 internally
    assert nll(probs.float(), labels) == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-5)


def test_nll_of_the_sample_mean_and_floor():
    probs = _t([[[0.2, 0.8]], [[0.6, 0.4]]])  # f_hat = (0.4, 0.6)
    assert nll(probs, torch.tensor([1])) == pytest.approx(-math.log(0.6), rel=1e-12)
    hard = _t([[[1.0, 0.0], [0.5, 0.5]]])  # true class of point 0 has probability 0
    value = nll(hard, torch.tensor([1, 0]))
    assert math.isfinite(value)
    assert value == pytest.approx((-math.log(NLL_FLOOR) + math.log(2)) / 2, rel=1e-12)


# ----------------------------------------------------------------------------------------------
# Entropies, mutual information, epistemic std
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", [2, 3, 10])
def test_entropy_of_uniform_is_log_c(c):
    probs = torch.full((4, 5, c), 1.0 / c, dtype=torch.float64)
    assert predictive_entropy(probs) == pytest.approx(math.log(c), rel=1e-12)
    assert expected_entropy(probs) == pytest.approx(math.log(c), rel=1e-12)
    assert mutual_information(probs) == pytest.approx(0.0, abs=1e-12)


def test_mutual_information_zero_for_one_or_identical_samples():
    gen = torch.Generator().manual_seed(1)
    one = _dirichlet((1, 50, 4), gen)
    assert mutual_information(one) == 0.0
    assert predictive_entropy(one) == pytest.approx(expected_entropy(one), rel=1e-14)
    same = one.expand(6, -1, -1).clone()
    assert mutual_information(same) == pytest.approx(0.0, abs=1e-14)
    assert epistemic_std(same) == pytest.approx(0.0, abs=1e-14)


def test_mutual_information_is_difference_of_entropies_and_nonnegative():
    gen = torch.Generator().manual_seed(2)
    probs = _dirichlet((5, 200, 3), gen, concentration=0.5)
    mi, h_pred, h_exp = mutual_information(probs), predictive_entropy(probs), expected_entropy(probs)
    assert mi == pytest.approx(h_pred - h_exp, abs=1e-12)
    assert mi > 0.01
    assert (mutual_information(probs, per_point=True) >= 0).all()


def test_mutual_information_hand_case_with_zero_probabilities():
    # two confident samples that disagree: H_pred = log 2, H_exp = 0 (0 log 0 = 0, no NaN), MI = log 2
    probs = _t([[[1.0, 0.0]], [[0.0, 1.0]]])
    assert expected_entropy(probs) == 0.0
    assert predictive_entropy(probs) == pytest.approx(math.log(2), rel=1e-14)
    assert mutual_information(probs) == pytest.approx(math.log(2), rel=1e-14)


def test_mutual_information_splits_exactly_over_the_samples():
    # MI = (1/S) sum_l KL(f_l || f_hat), also with exact zeros in some samples (0 log 0 = 0)
    gen = torch.Generator().manual_seed(3)
    probs = _dirichlet((7, 120, 4), gen, concentration=0.3)
    probs[2, :10] = _t([1.0, 0.0, 0.0, 0.0])
    parts = mutual_information_per_sample(probs)
    assert parts.shape == (7,)
    assert (parts >= 0).all()
    assert float(parts.mean()) == pytest.approx(mutual_information(probs), rel=1e-12)
    # the hand case: two confident samples that disagree are each log 2 from the predictive (1/2, 1/2)
    hand = mutual_information_per_sample(_t([[[1.0, 0.0]], [[0.0, 1.0]]]))
    assert hand.tolist() == pytest.approx([math.log(2), math.log(2)], rel=1e-14)
    assert mutual_information_per_sample(probs[:1]).tolist() == [0.0]


def test_trimmed_mutual_information_leaves_out_the_excursions():
    gen = torch.Generator().manual_seed(4)
    base = _dirichlet((1, 200, 3), gen)
    # 18 samples near the base and 2 far off: the trimmed summary should see only the 18
    near = base * 0.98 + 0.02 * _dirichlet((18, 200, 3), gen)
    far = _dirichlet((2, 200, 3), gen, concentration=0.2)
    probs = torch.cat([near[:7], far[:1], near[7:], far[1:]])
    parts = mutual_information_per_sample(probs)
    assert set(parts.argsort()[-2:].tolist()) == {7, 19}
    assert trimmed_mutual_information(probs, trim=0.1) == pytest.approx(mutual_information(near), rel=1e-12)
    assert trimmed_mutual_information(probs, trim=0.1) < 0.05 * mutual_information(probs)
    # trim 0 (and a trim too small to leave out one sample) is the mutual information itself
    assert trimmed_mutual_information(probs, trim=0.0) == mutual_information(probs)
    assert trimmed_mutual_information(probs, trim=0.04) == mutual_information(probs)
    # floor(trim * S) without floating-point loss: 0.29 * 100 leaves out 29 samples, not 28
    hundred = _dirichlet((100, 5, 3), gen)
    kept = mutual_information_per_sample(hundred).argsort()[:71]
    assert trimmed_mutual_information(hundred, trim=0.29) == mutual_information(hundred[kept])
    for bad in (1.0, -0.1, math.nan):
        with pytest.raises(ValueError, match="trim must be a fraction in"):
            trimmed_mutual_information(probs, trim=bad)
    for bad in (True, "0.1", None):
        with pytest.raises(ValueError, match="trim must be a real number"):
            trimmed_mutual_information(probs, trim=bad)
    # numpy and other real scalars are fractions too; a trim just below 1 keeps one sample
    import numpy as np

    assert trimmed_mutual_information(probs, trim=np.float32(0.1)) == trimmed_mutual_information(probs, trim=0.1)
    assert trimmed_mutual_information(probs, trim=1 - 1e-12) == 0.0
    assert [n_trimmed(100, t) for t in (0.0, 0.01, 0.1, 0.29, 0.999)] == [0, 1, 10, 29, 99]
    assert n_trimmed(8, 0.1) == 0 and n_trimmed(1, 0.5) == 0
    with pytest.raises(ValueError, match="n_samples must be a positive integer"):
        n_trimmed(0, 0.1)


def test_trimmed_mutual_information_is_never_above_the_mutual_information():
    # MI_kept <= mean of the kept parts <= MI, for any data; ties are broken by sample order
    gen = torch.Generator().manual_seed(5)
    for concentration in (0.1, 1.0, 10.0):
        probs = _dirichlet((12, 40, 5), gen, concentration)
        mi = mutual_information(probs)
        for trim in (0.1, 0.25, 0.5, 0.9):
            assert trimmed_mutual_information(probs, trim) <= mi + 1e-15
    # ties (given parts): a stable sort, so the last of the tied samples is left out first
    probs = _dirichlet((5, 30, 3), gen)
    tied = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    assert trimmed_mutual_information(probs, trim=0.2, parts=tied) == mutual_information(probs[[0, 1, 2, 3]])
    assert trimmed_mutual_information(probs, trim=0.4, parts=tied) == mutual_information(probs[[0, 1, 2]])
    assert mutual_information(probs[[0, 1, 2, 3]]) != mutual_information(probs[[0, 2, 3, 4]])


def test_epistemic_std_hand_case_uses_population_std():
    # point 0: samples (0.2, 0.8), (0.6, 0.4): mean (0.4, 0.6), population std 0.2 in both classes
    # (the 1/(S-1) estimator would give 0.2828); point 1: identical samples, std 0. Mean 0.1.
    probs = _t([
        [[0.2, 0.8], [0.3, 0.7]],
        [[0.6, 0.4], [0.3, 0.7]],
    ])
    assert epistemic_std(probs) == pytest.approx(0.1, abs=1e-12)
    torch.testing.assert_close(epistemic_std(probs, per_point=True), _t([0.2, 0.0]))
    # classes averaged: three classes with stds 0.3, 0.1, 0.2 -> 0.2
    three = _t([[[0.1, 0.5, 0.4]], [[0.7, 0.3, 0.0]]])
    assert epistemic_std(three) == pytest.approx(0.2, abs=1e-12)
    assert epistemic_std(three[:1]) == 0.0


# ----------------------------------------------------------------------------------------------
# ECE and calibration curve
# ----------------------------------------------------------------------------------------------


def test_ece_hand_case():
    # confidences 0.55 (right), 0.65 (wrong), 0.65 (right), 0.95 (right) with 10 bins:
    # bin [0.5,0.6): |1 - 0.55| = 0.45 (n=1); bin [0.6,0.7): |0.5 - 0.65| = 0.15 (n=2);
    # bin [0.9,1.0]: |1 - 0.95| = 0.05 (n=1). ECE = (0.45 + 2 * 0.15 + 0.05) / 4 = 0.2.
    p1 = _t([[0.55, 0.65, 0.35, 0.05]])  # probability of class 1
    labels = torch.tensor([1, 0, 0, 0])
    probs = binary_probs(p1)
    assert ece(probs, labels) == pytest.approx(0.2, abs=1e-12)
    # with a single bin: |acc - conf| = |0.75 - 0.7| = 0.05
    assert ece(probs, labels, n_bins=1) == pytest.approx(0.05, abs=1e-12)


def test_calibration_curve_hand_case_and_edges():
    p1 = _t([[0.55, 0.65, 0.35, 0.05, 1.0, 0.5]])
    labels = torch.tensor([1, 0, 0, 0, 1, 1])
    curve = calibration_curve(binary_probs(p1), labels, n_bins=10)
    torch.testing.assert_close(curve.edges, torch.linspace(0, 1, 11, dtype=torch.float64))
    # conf 0.5 (tie -> class 0, wrong) lands in [0.5, 0.6); conf 1.0 lands in the top bin
    assert curve.counts.tolist() == [0, 0, 0, 0, 0, 2, 2, 0, 0, 2]
    assert curve.counts.sum().item() == 6
    assert curve.confidence[5].item() == pytest.approx(0.525)
    assert curve.accuracy[5].item() == pytest.approx(0.5)
    assert curve.confidence[9].item() == pytest.approx(0.975)
    assert curve.accuracy[9].item() == pytest.approx(1.0)
    assert torch.isnan(curve.confidence[:5]).all() and torch.isnan(curve.accuracy[7:9]).all()
    assert curve.ece == pytest.approx(ece(binary_probs(p1), labels))
    torch.testing.assert_close(curve.centers[0], torch.tensor(0.05, dtype=torch.float64))


def test_calibration_curve_counts_sum_to_n():
    gen = torch.Generator().manual_seed(3)
    probs = _dirichlet((3, 1000, 5), gen)
    labels = torch.randint(0, 5, (1000,), generator=gen)
    for n_bins in (1, 7, 15):
        curve = calibration_curve(probs, labels, n_bins)
        assert curve.counts.shape == (n_bins,) and curve.counts.sum().item() == 1000


def test_ece_near_zero_for_labels_drawn_from_the_predictive():
    """Labels drawn from f_hat make the predictive perfectly calibrated: ECE is only sampling noise.

    Tolerance: condition on the probabilities (the bins are then fixed). In bin k with n_k points,
    acc(B_k) - conf(B_k) is the mean of n_k independent terms 1(y_i = pred_i) - c_i, each with mean 0
    and range in an interval of length 1. Hoeffding: P(|acc - conf| > t_k) <= 2 exp(-2 n_k t_k^2);
    with t_k = sqrt(log(2J/delta) / (2 n_k)) and a union bound over the J bins, with probability
    >= 1 - delta, ECE <= sum_k (n_k/N) t_k = sqrt(log(2J/delta)/2) * sum_k sqrt(n_k) / N
    <= sqrt(log(2J/delta)/2) * sqrt(J/N) (Cauchy-Schwarz). For J = 10, N = 200000, delta = 1e-6 this is
    2.90 * 0.00707 = 0.0205 (the expected ECE is <= sqrt(J/N)/2 = 0.0035).
    """
    gen = torch.Generator().manual_seed(4)
    n, n_bins, delta = 200_000, 10, 1e-6
    probs = _dirichlet((4, n, 3), gen, concentration=0.7)
    f_hat = probs.mean(0)
    labels = torch.multinomial(f_hat, 1, generator=gen).squeeze(1)
    tol = math.sqrt(math.log(2 * n_bins / delta) / 2) * math.sqrt(n_bins / n)
    assert tol == pytest.approx(0.0205, abs=5e-4)
    assert ece(probs, labels, n_bins) < tol
    # Negative control: the same labels scored against a sharpened predictive (f_hat^3, renormalised,
    # i.e. over-confident) give an ECE far above the tolerance, so the check above can fail.
    sharp = f_hat**3 / (f_hat**3).sum(-1, keepdim=True)
    assert ece(sharp.unsqueeze(0), labels, n_bins) > 5 * tol


# ----------------------------------------------------------------------------------------------
# all_scores
# ----------------------------------------------------------------------------------------------


def test_all_scores_keys_and_values():
    gen = torch.Generator().manual_seed(5)
    probs = _dirichlet((3, 100, 4), gen).float()
    labels = torch.randint(0, 4, (100,), generator=gen)
    scores = all_scores(probs, labels, n_bins=5)
    assert list(scores) == [
        "accuracy", "brier", "nll", "ece", "pred_entropy", "exp_entropy", "mutual_info", "epistemic_std"]
    assert tuple(scores) == SCORE_KEYS
    assert all(type(v) is float for v in scores.values())
    assert scores["accuracy"] == accuracy(probs, labels)
    assert scores["ece"] == ece(probs, labels, n_bins=5)
    assert scores["mutual_info"] == pytest.approx(scores["pred_entropy"] - scores["exp_entropy"], abs=1e-12)


# ----------------------------------------------------------------------------------------------
# Variance tables
# ----------------------------------------------------------------------------------------------


def test_params_variance_matches_torch_var():
    gen = torch.Generator().manual_seed(6)
    theta = torch.randn(20, 13, generator=gen) * torch.linspace(0.1, 3, 13)
    assert params_variance(theta) == pytest.approx(torch.var(theta.double(), dim=0).mean().item(), rel=1e-12)
    # unbiased 1/(S-1) estimator: samples 0 and 2 in one dimension give variance 2 (not 1)
    assert params_variance(_t([[0.0], [2.0]])) == pytest.approx(2.0)
    assert math.isnan(params_variance(theta[:1]))


def test_logits_variance_matches_torch_var():
    gen = torch.Generator().manual_seed(7)
    logits3 = torch.randn(8, 30, 5, generator=gen, dtype=torch.float64)
    logits2 = logits3[..., 0]
    assert logits_variance(logits3) == pytest.approx(torch.var(logits3, dim=0).mean().item(), rel=1e-12)
    assert logits_variance(logits2) == pytest.approx(torch.var(logits2, dim=0).mean().item(), rel=1e-12)
    assert logits_variance(_t([[1.0, 5.0], [3.0, 5.0]])) == pytest.approx(1.0)  # (2 + 0) / 2
    assert math.isnan(logits_variance(logits3[:1]))
    assert math.isnan(logits_variance(logits2[:1]))


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

_GOOD = _t([[[0.3, 0.7], [0.9, 0.1]]])


@pytest.mark.parametrize(
    ("probs", "labels", "match"),
    [
        (_GOOD[0], torch.tensor([0, 1]), r"shape \(S, N, C\)"),
        (_GOOD, torch.tensor([0, 1, 1]), r"3 entries but probs has N=2"),
        (_GOOD, torch.tensor([[0, 1]]), r"labels must have shape \(N,\)"),
        (_GOOD, torch.tensor([0, 2]), r"labels out of range"),
        (_GOOD, torch.tensor([-1, 0]), r"labels out of range"),
        (_GOOD, torch.tensor([0.0, 0.5]), r"integer class indices"),
        (_t([[[0.3, math.nan], [0.9, 0.1]]]), torch.tensor([0, 1]), r"NaN or infinite"),
        (_t([[[0.3, math.inf], [0.9, 0.1]]]), torch.tensor([0, 1]), r"NaN or infinite"),
        (_t([[[0.3, 0.6], [0.9, 0.1]]]), torch.tensor([0, 1]), r"do not sum to 1"),
        (_t([[[1.2, -0.2], [0.9, 0.1]]]), torch.tensor([0, 1]), r"negative probabilities"),
        (_t([[[1.0], [1.0]]]), torch.tensor([0, 0]), r"at least 2 classes"),
    ],
)
def test_validation_errors(probs, labels, match):
    with pytest.raises(ValueError, match=match):
        all_scores(probs, labels)


def test_validation_errors_without_labels_and_variances():
    with pytest.raises(ValueError, match=r"do not sum to 1"):
        predictive_entropy(torch.randn(2, 3, 4, dtype=torch.float64).abs())
    with pytest.raises(ValueError, match=r"n_bins must be a positive integer"):
        ece(_GOOD, torch.tensor([0, 1]), n_bins=0)
    with pytest.raises(ValueError, match=r"p must have shape \(S, N\)"):
        binary_probs(torch.rand(2, 3, 1))
    with pytest.raises(ValueError, match=r"probabilities in \[0, 1\]"):
        binary_probs(_t([[0.5, 1.5]]))
    with pytest.raises(ValueError, match=r"theta must have shape \(S, d\)"):
        params_variance(torch.zeros(3))
    with pytest.raises(ValueError, match=r"logits contains NaN or infinite"):
        logits_variance(_t([[0.0, math.inf], [1.0, 2.0]]))
    with pytest.raises(ValueError, match=r"logits must have shape \(S, N\) or \(S, N, C\)"):
        logits_variance(torch.zeros(2, 3, 4, 5))
    with pytest.raises(ValueError, match=r"floor must be in"):
        nll(_GOOD, torch.tensor([0, 1]), floor=0.0)


def test_jackknife_se_of_the_mean_is_the_standard_error():
    x = torch.randn(12, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    se = jackknife_se(x, lambda s: s[:, 0].mean())
    assert se == pytest.approx(float(x[:, 0].std(correction=1)) / math.sqrt(12), rel=1e-12)
    assert math.isnan(jackknife_se(x[:2], lambda s: s.mean()))


def test_jackknife_se_of_the_variance_matches_its_monte_carlo_truth():
    # S = 10 Gaussian chains, one coordinate: the squared jackknife SE of the unbiased variance has the
    # mean 4 s1/S + 4 s2/(S(S-2)) (Hoeffding components s1 = Var h1 = 1/2, s2 = Var h2 = 1 for the kernel
    # (x-y)^2/2 of N(0,1) data), that is 2/(S-2)
    gen = torch.Generator().manual_seed(1)
    n_chains, reps = 10, 4000
    sq = torch.tensor([jackknife_se(torch.randn(n_chains, 1, dtype=torch.float64, generator=gen), params_variance)
                       ** 2 for _ in range(reps)])
    truth = 2 / (n_chains - 2)
    z = (sq.mean() - truth) / (sq.std() / math.sqrt(reps))
    assert abs(z) < 4, (float(sq.mean()), truth)


# ----------------------------------------------------------------------------------------------
# Regression (the Gaussian mixture predictive)
# ----------------------------------------------------------------------------------------------


def _mixture_means(n_samples=7, n_points=5, outputs=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n_samples, n_points, outputs, dtype=torch.float64, generator=gen)


def _mixture_cdf(x, mu, sigma):
    from scipy.stats import norm
    return float(norm.cdf((x - mu) / sigma).mean())


def test_gaussian_nll_of_one_sample_is_the_gaussian_log_density():
    mu = _mixture_means(1, 6, 2)
    y = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = -torch.distributions.Normal(mu[0], 0.7).log_prob(y).sum(-1)
    assert torch.allclose(gaussian_nll(mu, y, 0.7, per_point=True), expected, rtol=1e-12)
    assert gaussian_nll(mu, y, 0.7) == pytest.approx(expected.mean().item(), rel=1e-12)


def test_gaussian_nll_of_a_mixture_against_scipy_and_far_from_every_component():
    from scipy.stats import norm
    mu, sigma = _mixture_means(7, 5), 0.3
    y = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)
    expected = [-math.log(norm.pdf(float(y[i]), mu[:, i, 0].numpy(), sigma).mean()) for i in range(5)]
    assert gaussian_nll(mu, y, sigma, per_point=True).tolist() == pytest.approx(expected, rel=1e-12)
    # 300 sigma from every mean: each density underflows, the log-sum-exp does not
    far = torch.full((5,), 100.0, dtype=torch.float64)
    one = gaussian_nll(torch.zeros(1, 5, 1, dtype=torch.float64), far, sigma)
    assert one == pytest.approx(0.5 * (100 / sigma) ** 2 + 0.5 * math.log(2 * math.pi) + math.log(sigma), rel=1e-12)
    assert math.isfinite(gaussian_nll(mu, far, sigma))


def test_gaussian_nll_of_several_outputs_is_a_mixture_of_products():
    # S > 1 and m > 1: the predictive is (1/S) sum_l prod_j N(y_j; mu_lj, sigma^2), not a product of per-output mixtures
    from scipy.stats import norm
    mu, sigma = _mixture_means(6, 4, 3), 0.8
    y = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    expected = -np.log(np.mean(np.prod(norm.pdf(y.numpy()[None], mu.numpy(), sigma), axis=-1), axis=0))
    assert gaussian_nll(mu, y, sigma, per_point=True).tolist() == pytest.approx(expected.tolist(), rel=1e-12)


def test_pit_is_the_mixture_cdf_at_the_response():
    mu, sigma = _mixture_means(8, 6), 0.35
    y = torch.linspace(-1.5, 1.5, 6, dtype=torch.float64)
    expected = [_mixture_cdf(float(y[i]), mu[:, i, 0].numpy(), sigma) for i in range(6)]
    assert pit(mu, y, sigma).tolist() == pytest.approx(expected, rel=1e-12)


def test_regression_metrics_at_extremes():
    """A one-element tensor sigma is a number; a tiny q gives a finite quantile; a spread of 1e19 sigma takes the
    pairwise route of the CRPS instead of overflowing the quadrature's node count."""
    from scipy.stats import norm
    mu = _mixture_means(5, 3)
    assert gaussian_nll(mu, torch.zeros(3), torch.tensor(0.5)) == gaussian_nll(mu, torch.zeros(3), 0.5)
    tiny = predictive_quantile(mu[:1], 1.0, 1e-18)
    assert torch.isfinite(tiny).all()
    assert tiny.tolist() == pytest.approx((mu[0, :, 0] + norm.ppf(1e-18)).tolist(), rel=1e-9)
    wide = torch.tensor([[[0.0]], [[10.0]]], dtype=torch.float64)
    assert math.isfinite(crps(wide, torch.zeros(1), 1e-18))


def test_crps_of_one_sample_is_the_gaussian_closed_form():
    from scipy.stats import norm
    mu, sigma = _mixture_means(1, 8), 0.4
    y = torch.linspace(-2.0, 2.0, 8, dtype=torch.float64)
    z = (y.numpy() - mu[0, :, 0].numpy()) / sigma
    expected = sigma * (z * (2 * norm.cdf(z) - 1) + 2 * norm.pdf(z) - 1 / math.sqrt(math.pi))
    assert crps(mu, y, sigma, per_point=True).tolist() == pytest.approx(expected.tolist(), rel=1e-10)


def test_crps_of_a_mixture_is_the_integral_of_the_squared_cdf_difference(monkeypatch):
    # CRPS(F, y) = integral (F(x) - 1{x >= y})^2 dx, by quadrature against the closed form
    from scipy.integrate import quad
    mu, sigma = _mixture_means(6, 4), 0.5
    y = torch.tensor([-0.3, 0.1, 2.5, -4.0], dtype=torch.float64)
    closed = crps(mu, y, sigma, per_point=True)
    for i in range(4):
        m, yi = mu[:, i, 0].numpy(), float(y[i])
        left = quad(lambda x, m=m: _mixture_cdf(x, m, sigma) ** 2, -np.inf, yi, epsabs=1e-12)[0]
        right = quad(lambda x, m=m: (1 - _mixture_cdf(x, m, sigma)) ** 2, yi, np.inf, epsabs=1e-12)[0]
        assert float(closed[i]) == pytest.approx(left + right, rel=1e-7, abs=1e-10)
    # the pairwise term in chunks of one point gives the same numbers
    monkeypatch.setattr(metrics_module, "_CRPS_PAIR_CHUNK", 1)
    assert torch.allclose(crps(mu, y, sigma, per_point=True), closed, rtol=1e-13, atol=0)


def test_crps_quadrature_route_equals_the_pairwise_sum():
    """The second term of the CRPS by the trapezoid rule (points whose components span little against S sigma)
    equals the exact pairwise sum to rounding, for narrow, bimodal and spread-out mixtures; in one call some
    points take each route."""
    gen = torch.Generator().manual_seed(4)
    n_samples, sigma = 300, 0.2
    spreads = torch.tensor([0.01, 0.3, 1.0, 3.0, 10.0, 1000.0], dtype=torch.float64)   # narrow to wide
    mu = torch.randn(n_samples, len(spreads), dtype=torch.float64, generator=gen) * spreads
    mu[: n_samples // 3] += 4 * spreads                                                 # a second mode
    pairwise = metrics_module._crps_kernel(mu[:, None] - mu[None], math.sqrt(2) * sigma).mean(dim=(0, 1))
    nodes = torch.ceil((mu.max(0).values - mu.min(0).values + 20 * sigma) / (sigma / 3)) + 1
    assert (nodes <= n_samples).any() and (nodes > n_samples).any()                  # both routes are taken
    routed = metrics_module._mixture_mean_abs_difference(mu, sigma)
    torch.testing.assert_close(routed, pairwise, rtol=1e-12, atol=0)


def test_predictive_quantile_inverts_the_mixture_cdf():
    from scipy.stats import norm
    mu, sigma = _mixture_means(9, 6), 0.25
    for q in (0.05, 0.5, 0.975):
        quantile = predictive_quantile(mu, sigma, q)
        for i in range(6):
            assert _mixture_cdf(float(quantile[i]), mu[:, i, 0].numpy(), sigma) == pytest.approx(q, abs=1e-9)
    one = predictive_quantile(mu[:1], sigma, 0.9)
    assert one.tolist() == pytest.approx((mu[0, :, 0] + sigma * norm.ppf(0.9)).tolist(), abs=1e-12)
    assert interval_width(mu[:1], sigma, 0.9) == pytest.approx(2 * sigma * norm.ppf(0.95), rel=1e-10)


def test_interval_coverage_counts_the_points_between_the_quantiles():
    mu, sigma = _mixture_means(5, 400), 0.3
    y = 1.2 * torch.randn(400, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    low, high = predictive_quantile(mu, sigma, 0.05), predictive_quantile(mu, sigma, 0.95)
    inside = ((y >= low) & (y <= high)).double().mean().item()
    assert interval_coverage(mu, y, sigma, 0.9) == pytest.approx(inside, abs=1 / 400)  # a point on an edge at most


def test_pit_and_coverage_of_responses_drawn_from_the_predictive():
    # y_i drawn from the mixture itself: the PIT is uniform, so the coverage of each central interval is
    # Binomial(N, level) / N and the PIT's mean is 1/2 with variance 1/12
    gen = torch.Generator().manual_seed(3)
    n_points, n_samples, sigma = 20000, 4, 0.5
    mu = 2 * torch.randn(n_samples, n_points, 1, dtype=torch.float64, generator=gen)
    component = torch.randint(n_samples, (n_points,), generator=gen)
    y = mu[component, torch.arange(n_points), 0] + sigma * torch.randn(n_points, dtype=torch.float64, generator=gen)
    u = pit(mu, y, sigma)
    assert abs((u.mean().item() - 0.5) / math.sqrt(1 / 12 / n_points)) < 4
    for level in (0.5, 0.8, 0.95):
        z = (interval_coverage(mu, y, sigma, level) - level) / math.sqrt(level * (1 - level) / n_points)
        assert abs(z) < 4, (level, z)
    # a predictive too narrow by half covers too little, by far more than the Monte Carlo error
    z_narrow = (interval_coverage(mu, y, sigma / 2, 0.9) - 0.9) / math.sqrt(0.09 / n_points)
    assert z_narrow < -10


def test_rmse_and_regression_scores():
    mu = _t([[[1.0], [2.0]], [[3.0], [2.0]]])  # predictive means 2 and 2
    y = _t([2.0, 5.0])
    assert rmse(mu, y) == pytest.approx(math.sqrt(4.5))
    assert predictive_mean(mu)[:, 0].tolist() == [2.0, 2.0]
    scores = regression_scores(mu, y, 0.5, level=0.8)
    assert tuple(scores) == REGRESSION_SCORE_KEYS
    assert scores["nll"] == pytest.approx(gaussian_nll(mu, y, 0.5))
    assert scores["crps"] == pytest.approx(crps(mu, y, 0.5))
    assert scores["coverage"] == interval_coverage(mu, y, 0.5, 0.8)
    assert scores["interval_width"] == pytest.approx(interval_width(mu, 0.5, 0.8))
    assert rmse(torch.zeros(3, 2, 2), torch.ones(2, 2)) == pytest.approx(1.0)  # several outputs


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: gaussian_nll(torch.zeros(3, 4), torch.zeros(4), 1.0), r"means must have shape \(S, N, m\)"),
        (lambda: gaussian_nll(torch.zeros(3, 4, 1), torch.zeros(5), 1.0), r"y must have shape \(4,\) or \(4, 1\)"),
        (lambda: gaussian_nll(torch.zeros(3, 4, 2), torch.zeros(4), 1.0), r"y must have shape \(4, 2\)"),
        (lambda: gaussian_nll(torch.full((3, 4, 1), math.nan), torch.zeros(4), 1.0), r"means contains NaN"),
        (lambda: gaussian_nll(torch.zeros(3, 4, 1), torch.tensor([0.0, math.inf, 0, 0]), 1.0), r"y contains NaN"),
        (lambda: gaussian_nll(torch.zeros(3, 4, 1), torch.zeros(4), 0.0), r"sigma .* positive finite"),
        (lambda: crps(torch.zeros(3, 4, 1), torch.zeros(4), math.nan), r"sigma .* positive finite"),
        (lambda: crps(torch.zeros(3, 4, 1), torch.zeros(4), True), r"sigma .* positive finite"),
        (lambda: crps(torch.zeros(3, 4, 2), torch.zeros(4, 2), 1.0), r"one output per point; means has m=2"),
        (lambda: pit(torch.zeros(3, 4, 2), torch.zeros(4, 2), 1.0), r"one output per point"),
        (lambda: interval_coverage(torch.zeros(3, 4, 1), torch.zeros(4), 1.0, 1.0), r"level must lie strictly"),
        (lambda: interval_width(torch.zeros(3, 4, 1), 1.0, 0), r"level must lie strictly"),
        (lambda: predictive_quantile(torch.zeros(3, 4, 1), 1.0, 1.5), r"q must lie strictly"),
        (lambda: rmse(torch.zeros(3, 4, 1, dtype=torch.int64), torch.zeros(4)), r"floating-point"),
        (lambda: regression_scores(torch.zeros(3, 4, 2), torch.zeros(4, 2), 1.0), r"regression_scores needs one"),
        (lambda: regression_scores(torch.zeros(3, 4, 1), torch.zeros(4), 1.0, level=2.0), r"level must lie"),
    ],
)
def test_regression_validation_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
