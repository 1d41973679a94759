import math

import pytest
import torch

from smp_core.likelihoods import Bernoulli, Categorical, Gaussian, get_likelihood


def _autograd_residual(lik, out, y):
    out = out.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(lik.log_prob(out, y).sum(), out)
    return grad


@pytest.mark.parametrize("lik, m", [(Bernoulli(), 1), (Categorical(), 4), (Gaussian(0.7), 3)])
def test_residual_is_the_gradient_of_the_log_likelihood(lik, m, generator):
    out = torch.randn(6, m, generator=generator, dtype=torch.float64)
    y = lik.sample(out, generator)
    assert torch.allclose(lik.residual(out, y), _autograd_residual(lik, out, y), atol=1e-10)


def _expected_outer_residual(lik, out):
    """E_y[r r^T] by exact enumeration (Bernoulli, categorical) or closed form (Gaussian)."""
    if isinstance(lik, Bernoulli):
        ys = [torch.zeros(out.shape[0], dtype=out.dtype), torch.ones(out.shape[0], dtype=out.dtype)]
        probs = lik.probs(out)
        weights = [probs[:, 0], probs[:, 1]]
    elif isinstance(lik, Categorical):
        ys = [torch.full((out.shape[0],), c, dtype=torch.long) for c in range(out.shape[1])]
        probs = lik.probs(out)
        weights = [probs[:, c] for c in range(out.shape[1])]
    else:
        return torch.eye(out.shape[1], dtype=out.dtype).expand(out.shape[0], -1, -1) / lik.sigma**2
    total = 0
    for y, w in zip(ys, weights, strict=True):
        r = lik.residual(out, y)
        total = total + w[:, None, None] * r.unsqueeze(-1) * r.unsqueeze(-2)
    return total


@pytest.mark.parametrize("lik, m", [(Bernoulli(), 1), (Categorical(), 5), (Gaussian(2.0), 2)])
def test_fisher_factor_squares_to_the_output_fisher(lik, m, generator):
    out = torch.randn(7, m, generator=generator, dtype=torch.float64)
    factor = lik.fisher_factor(out)
    assert torch.allclose(factor @ factor.transpose(1, 2), _expected_outer_residual(lik, out), atol=1e-10)


def test_samples_follow_the_model(generator):
    # z-test of class frequencies against the model's probabilities: n draws per class,
    # standard error sqrt(p (1 - p) / n); |z| < 4.5 for each of 4 + 1 cells.
    n = 40_000
    logits = torch.tensor([0.3, -1.0, 1.2, 0.0])
    draws = Categorical().sample(logits.expand(n, 4), generator)
    p = torch.softmax(logits, 0)
    freq = torch.bincount(draws, minlength=4).double() / n
    z = (freq - p) / torch.sqrt(p * (1 - p) / n)
    assert z.abs().max() < 4.5
    yb = Bernoulli().sample(torch.full((n, 1), 0.8), generator)
    pb = torch.sigmoid(torch.tensor(0.8))
    assert abs((yb.mean() - pb) / math.sqrt(pb * (1 - pb) / n)) < 4.5


@pytest.mark.parametrize("lik, m", [(Bernoulli(), 1), (Categorical(), 4), (Gaussian(1.0), 2)])
def test_a_non_finite_row_does_not_stop_the_others(lik, m):
    # a chain that blew up between two divergence checks has NaN or infinite outputs: its draw may be
    # anything, but the batch must not fail and the finite rows must draw exactly what they would alone
    out = torch.randn(6, m, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    bad = out.clone()
    bad[1], bad[4, 0] = float("nan"), float("inf")
    clean = lik.sample(out, torch.Generator().manual_seed(1))
    mixed = lik.sample(bad, torch.Generator().manual_seed(1))
    keep = torch.tensor([True, False, True, True, False, True])
    assert torch.equal(mixed[keep], clean[keep])
    if isinstance(lik, Categorical):
        assert ((mixed >= 0) & (mixed < m)).all()


def test_samples_from_noise_follow_the_model(generator):
    # the draw the step blocks use: uniforms or normals first, then a deterministic transform.
    # z-tests as above; the Gaussian's mean and variance against g and sigma^2 (variance of s^2 is
    # 2 sigma^4 / n for normal data).
    n = 40_000
    logits = torch.tensor([0.3, -1.0, 1.2, 0.0, -3.0])
    lik = Categorical()
    draws = lik.sample_from_noise(logits.expand(n, 5), lik.draw_noise((n,), 5, generator))
    assert draws.dtype == torch.long
    p = torch.softmax(logits, 0)
    freq = torch.bincount(draws, minlength=5).double() / n
    assert (((freq - p) / torch.sqrt(p * (1 - p) / n)).abs() < 4.5).all()
    # a uniform at or above the cumulative total (which rounding can leave just below 1) gives the last class
    above_one = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    edge = lik.sample_from_noise(torch.zeros(4, 5), torch.stack([torch.tensor(0.0), torch.tensor(0.5),
                                                                 torch.tensor(1.0), above_one]))
    assert edge.tolist() == [0, 2, 4, 4]

    bern = Bernoulli()
    yb = bern.sample_from_noise(torch.full((n, 1), 0.8), bern.draw_noise((n,), 1, generator))
    pb = torch.sigmoid(torch.tensor(0.8))
    assert abs((yb.mean() - pb) / math.sqrt(pb * (1 - pb) / n)) < 4.5

    gauss = Gaussian(0.7)
    mean = torch.tensor([[1.0, -2.0]])
    noise = gauss.draw_noise((n,), 2, generator, dtype=torch.float64)
    assert noise.shape == (n, 2)
    yg = gauss.sample_from_noise(mean.double().expand(n, 2), noise)
    assert (((yg.mean(0) - mean) / (0.7 / math.sqrt(n))).abs() < 4.5).all()
    assert (((yg.var(0) - 0.49) / (0.49 * math.sqrt(2 / n))).abs() < 4.5).all()


def test_likelihood_errors():
    with pytest.raises(ValueError, match="unknown likelihood"):
        get_likelihood("poisson")
    with pytest.raises(ValueError, match="finite number > 0"):
        Gaussian(0.0)
    with pytest.raises(ValueError, match="class labels"):
        Categorical().log_prob(torch.zeros(2, 3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="0 or 1"):
        Bernoulli().log_prob(torch.zeros(2, 1), torch.tensor([0.0, 2.0]))


def test_gaussian_log_prob_keeps_float64():
    """The density's constant must not be rounded to float32 (it once was, by 4e-8 per point)."""
    out = torch.linspace(-2, 2, 50, dtype=torch.float64)[:, None]
    y = torch.linspace(1, -1, 50, dtype=torch.float64)
    got = get_likelihood("gaussian", sigma=0.7).log_prob(out, y)
    expected = torch.distributions.Normal(out[:, 0], 0.7).log_prob(y)
    torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-14)


def test_responses_and_output_sizes_are_checked():
    from smp_core.likelihoods import check_output_dim, check_responses

    bern, cat, gauss = Bernoulli(), Categorical(), Gaussian(0.5)
    check_responses(bern, torch.tensor([0.0, 1.0, 1.0]), 1)
    check_responses(cat, torch.tensor([0, 2, 1]), 3)
    check_responses(gauss, torch.randn(4, 2), 2)
    bad = [
        (bern, torch.tensor([-1.0, 1.0]), 1, "0 or 1"),  # labels in {-1, +1}
        (bern, torch.tensor([5.0, 5.0]), 1, "0 or 1"),
        (bern, torch.tensor([[0.0], [1.0]]), 1, "shape \\(n,\\)"),
        (cat, torch.tensor([1.7, 0.0]), 3, "integer class labels in \\[0, 3\\), got torch.float32"),
        (cat, torch.tensor([0, 3]), 3, "got torch.int64 in \\[0, 3\\]"),
        (cat, torch.tensor([-1, 0]), 3, "integer class labels"),
        (gauss, torch.randn(4, 3), 2, "2 value\\(s\\) per example"),
        (gauss, torch.tensor([[0.0, float("nan")]]), 2, "NaN"),
        (bern, torch.tensor([0.0, 1.0]), 2, "Bernoulli likelihood needs a network with one output"),
        (cat, torch.tensor([0, 0]), 1, "categorical likelihood needs a network with one output per class"),
    ]
    for lik, y, out_dim, match in bad:
        with pytest.raises(ValueError, match=match):
            check_responses(lik, y, out_dim)
    check_output_dim(gauss, 1)
    check_output_dim(object(), 1)  # a user's likelihood without a built-in name is not judged
