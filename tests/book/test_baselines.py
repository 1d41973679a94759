"""The Laplace approximation against models where it is known exactly, and its linearised predictive.

* Bayesian linear regression (Gaussian likelihood, prior ``N(0, I / alpha)``): the posterior is exactly
  ``N(m, (Z^T Z / sigma^2 + alpha I)^-1)``, so the Laplace precision must equal that matrix and the
  draws must have its moments (z-scores against Monte Carlo standard errors).
* Logistic regression: the GGN is the Hessian of the negative log likelihood, so the precision must
  equal the Hessian of the negative log posterior (autograd).
* MC dropout through a linear read-out of a dropped-out layer: the mean and variance of the logits
  over masks are known in closed form (z-scores against Monte Carlo standard errors).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from smp_book import baselines
from smp_core import as_chain_model, get_likelihood, predict, toy_mlp
from smp_core.fisher import kronecker_fisher, structure_for


def _design(n=200, p=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, p, generator=g, dtype=torch.float64)
    return x, torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], dim=1), g  # layout order: weight, bias


def _linear_posterior(sigma=0.7, alpha=2.0, n=200, p=3, seed=0):
    """x, the model, the exact posterior mean and covariance of Bayesian linear regression."""
    x, z, g = _design(n, p, seed)
    w_true = torch.tensor([1.0, -2.0, 0.5, 0.3], dtype=torch.float64)
    y = z @ w_true + sigma * torch.randn(n, generator=g, dtype=torch.float64)
    precision = z.T @ z / sigma**2 + alpha * torch.eye(p + 1, dtype=torch.float64)
    cov = torch.linalg.inv(precision)
    mean = cov @ (z.T @ y) / sigma**2
    return x, nn.Sequential(nn.Linear(p, 1)).double(), mean, cov, precision


def test_linear_gaussian_precision_is_exact_for_every_structure():
    sigma, alpha = 0.7, 2.0
    x, net, mean, _, precision = _linear_posterior(sigma, alpha)
    lik = get_likelihood("gaussian", sigma=sigma)
    dense = baselines.fit_laplace(net, lik, mean, x, prior_precision=alpha, structure="dense")
    torch.testing.assert_close(dense.precision, precision, rtol=1e-10, atol=1e-10)
    # one output: KFAC's G (x) A is the layer's Fisher block exactly, and the layer is one block
    kfac = baselines.fit_laplace(net, lik, mean, x, prior_precision=alpha, structure="kfac")
    torch.testing.assert_close(kfac.precision, precision, rtol=1e-10, atol=1e-10)
    diag = baselines.fit_laplace(net, lik, mean, x, prior_precision=alpha, structure="diag")
    torch.testing.assert_close(diag.precision, precision.diagonal(), rtol=1e-10, atol=1e-10)
    block = baselines.fit_laplace(net, lik, mean, x, prior_precision=alpha, structure="block")
    expected = precision.clone()
    expected[:3, 3] = expected[3, :3] = 0  # weight and bias are separate blocks
    torch.testing.assert_close(block.precision, expected, rtol=1e-10, atol=1e-10)
    assert (dense.n_data, dense.prior_precision, dense.structure) == (200, alpha, "dense")


def test_draws_have_the_exact_posterior_moments():
    """z-scores of the sample mean and covariance against the exact posterior, with a check that the
    same statistics reject a wrong covariance (the precision itself)."""
    x, net, mean, cov, precision = _linear_posterior()
    lp = baselines.fit_laplace(net, get_likelihood("gaussian", sigma=0.7), mean, x, prior_precision=2.0)
    n = 40_000
    draws = lp.sample(n, torch.Generator().manual_seed(1)).double()
    centred = draws - mean
    z_mean = centred.mean(0) / (cov.diagonal() / n).sqrt()
    assert z_mean.abs().max() < 4.5, z_mean

    def cov_z(truth):
        prods = centred[:, :, None] * centred[:, None, :]  # mean known: unbiased without ddof
        se = ((truth.diagonal()[:, None] * truth.diagonal()[None, :] + truth**2) / n).sqrt()
        return (prods.mean(0) - truth) / se

    assert cov_z(cov).abs().max() < 4.5  # 10 distinct entries
    assert cov_z(torch.linalg.inv(precision) * 1.1).abs().max() > 10  # a 10 % wrong covariance is caught
    torch.testing.assert_close(lp.covariance(), cov, rtol=1e-9, atol=1e-12)


def test_diag_draws_have_the_diagonal_variances():
    x, net, mean, _, precision = _linear_posterior()
    lp = baselines.fit_laplace(net, get_likelihood("gaussian", sigma=0.7), mean, x, prior_precision=2.0,
                               structure="diag")
    n = 40_000
    draws = lp.sample(n, torch.Generator().manual_seed(2)).double()
    var_true = 1 / precision.diagonal()
    z = ((draws - mean) ** 2).mean(0) - var_true
    z = z / (var_true * math.sqrt(2 / n))
    assert z.abs().max() < 4.5, z
    off = torch.corrcoef(draws.T) - torch.eye(4, dtype=torch.float64)
    assert off.abs().max() < 4.5 / math.sqrt(n)  # independent coordinates: correlations ~ N(0, 1/n)


def test_ggn_is_the_hessian_for_logistic_regression():
    x, z, g = _design(300, 2, seed=3)
    y = (torch.rand(300, generator=g, dtype=torch.float64) < torch.sigmoid(z @ torch.tensor(
        [1.5, -1.0, 0.2], dtype=torch.float64))).double()
    alpha = 0.5
    theta = torch.tensor([1.2, -0.8, 0.1], dtype=torch.float64)  # any point: the GGN is exact for a linear model

    def neg_log_posterior(t):
        logits = z @ t
        return -(y * logits - torch.nn.functional.softplus(logits)).sum() + alpha * t @ t / 2

    hessian = torch.autograd.functional.hessian(neg_log_posterior, theta)
    net = nn.Sequential(nn.Linear(2, 1)).double()
    lp = baselines.fit_laplace(net, "bernoulli", theta, x, prior_precision=alpha)
    torch.testing.assert_close(lp.precision, hessian, rtol=1e-9, atol=1e-9)


def test_structures_of_a_network_nest():
    """For the toy MLP: the diag and block precisions are the diagonal and the blocks of the dense one."""
    x, _, _ = _design(100, 2, seed=4)
    net = toy_mlp()
    theta = 0.7 * torch.randn(20, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    fits = {s: baselines.fit_laplace(net, "bernoulli", theta, x, prior_precision=1.0, structure=s)
            for s in baselines.LAPLACE_STRUCTURES}
    dense = fits["dense"].precision
    torch.testing.assert_close(fits["diag"].precision, dense.diagonal(), rtol=1e-10, atol=1e-12)
    mask = torch.zeros(20, 20, dtype=torch.bool)
    for block in structure_for(as_chain_model(net), "block").blocks:
        mask[block, block] = True
    torch.testing.assert_close(fits["block"].precision, torch.where(mask, dense, 0), rtol=1e-10, atol=1e-12)
    # kfac: N times the Kronecker-factored Fisher of every layer, plus the prior's precision exactly once
    model = as_chain_model(net)
    shape = structure_for(model, "kfac")
    stat = kronecker_fisher(model, get_likelihood("bernoulli"), theta[None], x, structure=shape)
    expected = 100 * shape.to_dense(stat)[0] + torch.eye(20, dtype=torch.float64)
    torch.testing.assert_close(fits["kfac"].precision, expected, rtol=1e-12, atol=1e-12)


def test_same_generator_same_draws():
    x, net, mean, _, _ = _linear_posterior()
    lp = baselines.fit_laplace(net, get_likelihood("gaussian"), mean, x, prior_precision=1.0)
    a = lp.sample(5, torch.Generator().manual_seed(9))
    b = lp.sample(5, torch.Generator().manual_seed(9))
    assert torch.equal(a, b) and a.dtype == mean.dtype


def test_linearised_logits():
    x, _, _ = _design(50, 2, seed=6)
    net = toy_mlp()
    model = as_chain_model(net)
    theta = 0.7 * torch.randn(20, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    out = predict(model, theta[None], x)
    # at the point of linearisation: the network itself
    torch.testing.assert_close(baselines.linearised_logits(net, theta, theta[None], x), out, rtol=0, atol=1e-12)
    # a first-order expansion: the error shrinks like eps^2 (by 100 when eps shrinks by 10)
    v = torch.randn(1, 20, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    errors = []
    for eps in (1e-2, 1e-3):
        lin = baselines.linearised_logits(net, theta, theta + eps * v, x, batch_size=7)
        errors.append((predict(model, theta + eps * v, x) - lin).abs().max().item())
    assert errors[0] > 0 and 50 < errors[0] / errors[1] < 200, errors
    # a linear network with several outputs: linearisation is exact, shape (S, n, m)
    lin_net = nn.Sequential(nn.Linear(2, 3)).double()
    samples = torch.randn(4, 9, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    lin = baselines.linearised_logits(lin_net, samples[0], samples, x)
    torch.testing.assert_close(lin, predict(as_chain_model(lin_net), samples, x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("prior", [0, -1.0, float("nan"), float("inf"), "1"])
def test_bad_prior_precision(prior):
    x, net, mean, _, _ = _linear_posterior()
    with pytest.raises(ValueError, match="prior_precision"):
        baselines.fit_laplace(net, get_likelihood("gaussian"), mean, x, prior_precision=prior)


def test_bad_inputs_name_the_problem(monkeypatch):
    x, net, mean, _, _ = _linear_posterior()
    lik = get_likelihood("gaussian")
    with pytest.raises(ValueError, match="unknown Laplace structure"):
        baselines.fit_laplace(net, lik, mean, x, prior_precision=1.0, structure="full")
    with pytest.raises(ValueError, match=r"theta_map must have shape \(4,\)"):
        baselines.fit_laplace(net, lik, mean[:3], x, prior_precision=1.0)
    with pytest.raises(ValueError, match="theta_map contains NaN"):
        baselines.fit_laplace(net, lik, mean * float("nan"), x, prior_precision=1.0)
    for structure in ("dense", "diag"):  # the diagonal's layer-by-layer path too
        with pytest.raises(ValueError, match="NaN or infinite"):
            baselines.fit_laplace(net, lik, mean, x * float("nan"), prior_precision=1.0, structure=structure)
        with pytest.raises(ValueError, match="at least one training input"):
            baselines.fit_laplace(net, lik, mean, x[:0], prior_precision=1.0, structure=structure)
    monkeypatch.setattr(baselines, "MAX_DENSE_DIM", 2)  # the weight block has 3 rows
    for structure in ("block", "dense"):
        with pytest.raises(ValueError, match="use structure='diag' or 'kfac'"):
            baselines.fit_laplace(net, lik, mean, x, prior_precision=1.0, structure=structure)
    assert baselines.fit_laplace(net, lik, mean, x, prior_precision=1.0, structure="diag").precision.shape == (4,)
    kfac = baselines.fit_laplace(net, lik, mean, x, prior_precision=1.0, structure="kfac")
    assert kfac.sample(3).shape == (3, 4)  # never forms the matrix ...
    with pytest.raises(ValueError, match="not formed"):
        kfac.covariance()  # ... which is refused when asked for
    monkeypatch.setattr(baselines, "MAX_DENSE_DIM", 10_000)
    shape = structure_for(as_chain_model(net), "dense")
    lp = baselines.LaplacePosterior(mean, shape, (-torch.eye(4, dtype=torch.float64)[None],), 1.0, 200)
    with pytest.raises(ValueError, match="not positive definite"):
        lp.sample(3)
    with pytest.raises(ValueError, match="negative eigenvalue"):
        lp.log_det_precision()
    with pytest.raises(ValueError, match="n_samples"):
        lp.sample(0)
    with pytest.raises(ValueError, match=r"samples must have shape \(S, 4\)"):
        baselines.linearised_logits(net, mean, mean, x)
    with pytest.raises(ValueError, match="batch_size"):
        baselines.linearised_logits(net, mean, mean[None], x, batch_size=0)
    fit = baselines.fit_laplace(net, lik, mean, x, prior_precision=1.0)
    with pytest.raises(ValueError, match="prior_precision"):
        fit.with_prior_precision(0.0)
    with pytest.raises(ValueError, match="log_likelihood must be finite"):
        fit.log_marginal_likelihood(float("nan"))
    with pytest.raises(ValueError, match="bounds"):
        baselines.optimise_prior_precision(fit, bounds=(1.0, 0.5))
    with pytest.raises(ValueError, match="widen the bounds"):
        baselines.optimise_prior_precision(fit, bounds=(1e-6, 1e-3))
    with pytest.raises(ValueError, match=r"x has 200 rows but y has 3"):
        baselines.log_likelihood(net, lik, mean, x, torch.zeros(3, dtype=torch.float64))


def _mlp_fit(structure, n=150, classes=3, seed=10):
    """A Laplace fit of a small two-layer categorical MLP at a random point (any point has a GGN)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g, dtype=torch.float64)
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, classes)).double()
    theta = 0.8 * torch.randn(as_chain_model(net).layout.dim, generator=g, dtype=torch.float64)
    return baselines.fit_laplace(net, "categorical", theta, x, prior_precision=0.5, structure=structure)


@pytest.mark.parametrize("structure", baselines.LAPLACE_STRUCTURES)
def test_spectrum_and_log_det_match_the_dense_precision(structure):
    """The eigenvalues and log-determinant from the structure (the Kronecker factors' eigenvalues for
    kfac) against those of the d x d precision formed independently by ``Structure.to_dense``."""
    fit = _mlp_fit(structure)
    precision = fit.precision if structure != "diag" else torch.diag(fit.precision)
    expected = torch.linalg.eigvalsh(precision)
    got = torch.sort(fit.ggn_eigenvalues() + fit.prior_precision).values
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    assert fit.log_det_precision() == pytest.approx(float(torch.linalg.slogdet(precision)[1]), rel=1e-12)
    other = fit.with_prior_precision(3.0)
    assert other.prior_precision == 3.0 and fit.prior_precision == 0.5
    shift = 2.5 * (torch.eye(fit.dim, dtype=torch.float64) if structure != "diag" else 1)
    torch.testing.assert_close(other.precision, fit.precision + shift, rtol=1e-12, atol=1e-12)


def _cnn_fit(structure, n=80, seed=12):
    """A Laplace fit of a small categorical CNN (a convolution, then a linear layer) at a random point."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 5, 5, generator=g, dtype=torch.float64)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 3 * 3, 3)).double()
    theta = 0.8 * torch.randn(as_chain_model(net, (1, 5, 5)).layout.dim, generator=g, dtype=torch.float64)
    return baselines.fit_laplace(net, "categorical", theta, x, prior_precision=0.5, structure=structure,
                                 input_shape=(1, 5, 5))


@pytest.mark.parametrize("fit_of, structure", [(_mlp_fit, "kfac"), (_cnn_fit, "kfac"), (_cnn_fit, "block")])
def test_structured_draws_have_the_covariance_of_the_formed_precision(fit_of, structure):
    """Draws through the factors' eigenvectors (kfac) or per-block Cholesky factors (block) against the
    inverse of the precision formed entry by entry: z-scores of every covariance entry (40,000 draws),
    with a check that a 10 % wrong covariance is caught."""
    fit = fit_of(structure)
    cov = fit.covariance()  # Cholesky inverse of the formed precision (N (G (x) A) + alpha I for kfac)
    n = 40_000
    centred = fit.sample(n, torch.Generator().manual_seed(11)) - fit.mean
    z_mean = centred.mean(0) / (cov.diagonal() / n).sqrt()
    assert z_mean.abs().max() < 5, z_mean

    def cov_z(truth):
        prods = centred[:, :, None] * centred[:, None, :]
        se = ((truth.diagonal()[:, None] * truth.diagonal()[None, :] + truth**2) / n).sqrt()
        return (prods.mean(0) - truth) / se

    assert cov_z(cov).abs().max() < 5.5  # at most 35 * 36 / 2 = 630 distinct entries
    assert cov_z(cov * 1.1).abs().max() > 10


def test_kfac_draws_do_not_depend_on_the_eigenvectors_signs(monkeypatch):
    """Eigensolvers (the CPU's, CUDA's) may return an eigenvector or its negative: the kfac draws, through
    the symmetric root of the precision, must be the same either way (the draws through the eigenbasis
    itself were not, and differed between the CPU and a GPU)."""
    fit = _mlp_fit("kfac")
    expected = fit.sample(9, torch.Generator().manual_seed(5))
    eigh = torch.linalg.eigh

    def flipped(matrix):
        values, vectors = eigh(matrix)
        signs = torch.where(torch.arange(vectors.shape[-1]) % 2 == 0, -1.0, 1.0).to(vectors)
        return values, vectors * signs

    monkeypatch.setattr(torch.linalg, "eigh", flipped)
    again = baselines.LaplacePosterior(fit.mean, fit.shape, fit.ggn, fit.prior_precision, fit.n_data)
    torch.testing.assert_close(again.sample(9, torch.Generator().manual_seed(5)), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("structure", baselines.LAPLACE_STRUCTURES)
def test_draws_on_cuda_equal_those_on_the_cpu(structure):
    """The same seed gives the same draws on either device (z is drawn on the CPU)."""
    fit = _mlp_fit(structure)
    cuda = baselines.LaplacePosterior(fit.mean.cuda(), fit.shape, tuple(t.cuda() for t in fit.ggn),
                                      fit.prior_precision, fit.n_data)
    a = fit.sample(7, torch.Generator().manual_seed(3))
    b = cuda.sample(7, torch.Generator().manual_seed(3))
    assert b.device.type == "cuda"
    torch.testing.assert_close(b.cpu(), a, rtol=1e-9, atol=1e-9)


def test_log_likelihood_gradient():
    """Logistic regression: X^T (y - sigmoid(X theta)) in closed form; Bayesian linear regression at its
    exact MAP: the gradient of the log likelihood is alpha theta (a stationary log posterior)."""
    x, z, g = _design(120, 2, seed=13)
    y = (torch.rand(120, generator=g, dtype=torch.float64) < 0.4).double()
    theta = torch.tensor([0.7, -0.3, 0.2], dtype=torch.float64)
    net = nn.Sequential(nn.Linear(2, 1)).double()
    got = baselines.log_likelihood_gradient(net, "bernoulli", theta, x, y, batch_size=50)
    torch.testing.assert_close(got, z.T @ (y - torch.sigmoid(z @ theta)), rtol=1e-12, atol=1e-12)
    x, net, mean, _, _ = _linear_posterior(sigma=0.7, alpha=2.0)
    _, z, g = _design(200, 3, seed=0)
    y = z @ torch.tensor([1.0, -2.0, 0.5, 0.3], dtype=torch.float64) + 0.7 * torch.randn(200, generator=g,
                                                                                         dtype=torch.float64)
    grad = baselines.log_likelihood_gradient(net, get_likelihood("gaussian", sigma=0.7), mean, x, y[:, None])
    torch.testing.assert_close(grad, 2.0 * mean, rtol=1e-9, atol=1e-9)


def test_marginal_likelihood_is_exact_for_bayesian_linear_regression():
    """For a linear-Gaussian model at its exact MAP the Laplace evidence is the exact evidence
    ``log N(y | 0, sigma^2 I + Z Z^T / alpha)``, for dense and (one output) kfac."""
    sigma, alpha = 0.7, 2.0
    x, z, g = _design(200, 3, seed=0)
    w_true = torch.tensor([1.0, -2.0, 0.5, 0.3], dtype=torch.float64)
    y = z @ w_true + sigma * torch.randn(200, generator=g, dtype=torch.float64)
    precision = z.T @ z / sigma**2 + alpha * torch.eye(4, dtype=torch.float64)
    mean = torch.linalg.solve(precision, z.T @ y) / sigma**2
    net = nn.Sequential(nn.Linear(3, 1)).double()
    lik = get_likelihood("gaussian", sigma=sigma)
    covariance = sigma**2 * torch.eye(200, dtype=torch.float64) + z @ z.T / alpha
    exact = float(torch.distributions.MultivariateNormal(torch.zeros(200, dtype=torch.float64), covariance).log_prob(y))
    log_lik = baselines.log_likelihood(net, lik, mean, x, y[:, None])
    hand = float(torch.distributions.Normal(z @ mean, sigma).log_prob(y).sum())
    assert log_lik == pytest.approx(hand, rel=1e-12)
    for structure in ("dense", "kfac"):
        fit = baselines.fit_laplace(net, lik, mean, x, prior_precision=alpha, structure=structure)
        assert fit.log_marginal_likelihood(log_lik) == pytest.approx(exact, rel=1e-10)
    # the diagonal drops the correlations: its evidence is another number
    diag = baselines.fit_laplace(net, lik, mean, x, prior_precision=alpha, structure="diag")
    assert abs(diag.log_marginal_likelihood(log_lik) - exact) > 1e-3


@pytest.mark.parametrize("structure", ["diag", "kfac"])
def test_optimised_prior_precision_is_mackays_fixed_point(structure):
    """At the maximum of the evidence in alpha (theta* fixed): alpha |theta*|^2 = gamma, the effective
    number of parameters sum_i N lambda_i / (N lambda_i + alpha), and the evidence is below it on either side."""
    fit = _mlp_fit(structure)
    log_lik = -100.0
    alpha = baselines.optimise_prior_precision(fit)
    eig = fit.ggn_eigenvalues()
    gamma = float((eig / (eig + alpha)).sum())
    assert alpha * float(fit.mean.square().sum()) == pytest.approx(gamma, rel=1e-6)
    best = fit.with_prior_precision(alpha).log_marginal_likelihood(log_lik)
    for factor in (0.9, 1.1):
        assert fit.with_prior_precision(alpha * factor).log_marginal_likelihood(log_lik) < best


def _dropout_net(p=0.3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Dropout(p), nn.Linear(6, 2)).double()


def test_mc_dropout_has_the_closed_form_mean_and_variance():
    """Through ``W2 (m * h) / (1 - p) + b2`` with ``m_j ~ Bernoulli(1 - p)`` the logits have mean
    ``W2 h + b2`` (the network in eval mode) and variance ``sum_j W2_cj^2 h_j^2 p / (1 - p)``; both
    checked with z-scores (4,000 passes, 5 inputs x 2 logits) against Monte Carlo standard errors."""
    p, n_samples = 0.3, 4000
    net = _dropout_net(p)
    theta = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    logits = baselines.mc_dropout_logits(net, theta, x, n_samples, torch.Generator().manual_seed(2))
    assert logits.shape == (n_samples, 5, 2)
    with torch.no_grad():
        h = torch.tanh(net[0](x))  # (5, 6)
        exact_mean = net.eval()(x)
        exact_var = (net[3].weight[None] ** 2 * h[:, None, :] ** 2).sum(-1) * p / (1 - p)  # (5, 2)
    mean, var = logits.mean(0), logits.var(0)
    z_mean = (mean - exact_mean) / (exact_var / n_samples).sqrt()
    fourth = ((logits - mean) ** 4).mean(0)
    z_var = (var - exact_var) / ((fourth - var**2) / n_samples).sqrt()
    assert z_mean.abs().max() < 4.0 and z_var.abs().max() < 4.0, (z_mean, z_var)
    # a wrong keep-probability (scaling by 1/p instead of 1/(1-p)) would be far outside
    assert ((var - exact_var * (1 - p) ** 2 / p**2) / ((fourth - var**2) / n_samples).sqrt()).abs().max() > 10


def test_mc_dropout_is_reproducible_and_leaves_the_module_as_it_was():
    net = _dropout_net().train()
    before = [q.detach().clone() for q in net.parameters()]
    theta = 1 + torch.nn.utils.parameters_to_vector(net.parameters()).detach()  # not the module's own values
    x = torch.randn(7, 4, dtype=torch.float64).repeat(2, 1)  # every input twice
    a = baselines.mc_dropout_logits(net, theta, x, 3, torch.Generator().manual_seed(5), batch_size=4)
    b = baselines.mc_dropout_logits(net, theta, x, 3, torch.Generator().manual_seed(5))
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # one dropout layer: the same masks whatever the batch size
    assert not torch.equal(a[:, :7], a[:, 7:])  # each input gets its own mask
    assert not torch.equal(a[0], a[1])  # each pass too
    assert all(torch.equal(q, r) for q, r in zip(net.parameters(), before, strict=True))
    assert net.training and all(m.training for m in net) and not any(m._forward_hooks for m in net)
    with torch.no_grad():  # the passes ran at theta: their mean is the eval-mode network at theta, within
        # the closed-form standard error of test_mc_dropout_has_the_closed_form_mean_and_variance
        torch.nn.utils.vector_to_parameters(theta, net.parameters())
        h = torch.tanh(net[0](x))
        exact_var = (net[3].weight[None] ** 2 * h[:, None, :] ** 2).sum(-1) * 0.3 / 0.7  # p = 0.3
        z = (a.mean(0) - net.eval()(x)) / (exact_var / a.shape[0]).sqrt()
        assert z.abs().max() < 4.5, z


def test_mc_dropout_bad_inputs_name_the_problem():
    net = _dropout_net()
    theta = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
    x, g = torch.randn(3, 4, dtype=torch.float64), torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="no nn.Dropout layer"):
        baselines.mc_dropout_logits(toy_mlp().double(), torch.zeros(20, dtype=torch.float64), x[:, :2], 2, g)
    with pytest.raises(ValueError, match="only element-wise nn.Dropout"):
        baselines.mc_dropout_logits(nn.Sequential(nn.Linear(4, 2), nn.Dropout1d(0.5)), torch.zeros(10), x.float(), 2, g)
    with pytest.raises(ValueError, match="theta must have shape"):
        baselines.mc_dropout_logits(net, theta[:-1], x, 2, g)
    with pytest.raises(ValueError, match="n_samples must be a positive integer"):
        baselines.mc_dropout_logits(net, theta, x, 0, g)
    with pytest.raises(ValueError, match="NaN"):
        baselines.mc_dropout_logits(net, theta, x * float("nan"), 2, g)
    with pytest.raises(ValueError, match="generator"):
        baselines.mc_dropout_logits(net, theta, x, 2, None)
    with pytest.raises(ValueError, match="dropout probabilities"):
        baselines.mc_dropout_logits(nn.Sequential(nn.Dropout(1.0), nn.Linear(4, 2)), torch.zeros(10), x.float(), 2, g)


def test_mc_dropout_through_two_layers_is_unbiased():
    """Two dropout layers between linear maps: every mask is independent, so the mean of the logits over
    masks is still the network in eval mode (z-scores over 4,000 passes, 6 inputs x 3 logits)."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(4, 7), nn.Dropout(0.2), nn.Linear(7, 5), nn.Dropout(0.4), nn.Linear(5, 3)).double()
    theta = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    logits = baselines.mc_dropout_logits(net, theta, x, 4000, torch.Generator().manual_seed(7))
    with torch.no_grad():
        exact = net.eval()(x)
    z = (logits.mean(0) - exact) / (logits.var(0) / 4000).sqrt()
    assert z.abs().max() < 4.0, z
    assert (logits.var(0) > 0).all()


class _NotSplit(nn.Sequential):
    """The same layers and parameter names as an ``nn.Sequential``, but a subclass: never split."""


def test_mc_dropout_runs_the_layers_before_the_first_dropout_once_and_draws_the_same_samples():
    """LeNet-5 with three dropout layers: the plain ``nn.Sequential`` runs its convolutions once per batch
    (counted by a hook), and gives exactly the samples of the generic path (every layer on every pass),
    batch by batch and pass by pass."""
    from smp_core.models import lenet5

    torch.manual_seed(3)
    net = lenet5(dropout=0.25)
    generic = _NotSplit(*net)
    assert baselines._split_before_first_dropout(net)[0] is not None
    assert baselines._split_before_first_dropout(generic) == (None, None)
    theta = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
    x = torch.rand(11, 1, 28, 28, generator=torch.Generator().manual_seed(8))
    calls, conv_forward = [], net[0].forward

    def counted(inputs):  # an instance attribute, not a hook: a hook would turn the shortcut off
        calls.append(1)
        return conv_forward(inputs)

    net[0].forward = counted
    fast = baselines.mc_dropout_logits(net, theta, x, 4, torch.Generator().manual_seed(9), batch_size=4)
    del net[0].forward
    assert len(calls) == 3  # 3 batches, not 4 passes x 3 batches
    slow = baselines.mc_dropout_logits(generic, theta, x, 4, torch.Generator().manual_seed(9), batch_size=4)
    torch.testing.assert_close(fast, slow, rtol=0, atol=0)
    assert not torch.equal(fast[0], fast[1])


def test_mc_dropout_with_weights_tied_across_the_first_dropout_takes_the_generic_path():
    torch.manual_seed(5)
    first, last = nn.Linear(3, 3), nn.Linear(3, 3)
    last.weight = first.weight
    net = nn.Sequential(first, nn.Tanh(), nn.Dropout(0.5), last).double()
    assert baselines._split_before_first_dropout(net) == (None, None)
    nested = nn.Sequential(nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)), nn.Dropout(0.5), nn.Linear(3, 2))
    assert baselines._split_before_first_dropout(nested) == (None, None)
    theta = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
    x = torch.randn(4, 3, dtype=torch.float64)
    a = baselines.mc_dropout_logits(net, theta, x, 5, torch.Generator().manual_seed(1))
    b = baselines.mc_dropout_logits(_NotSplit(*net), theta, x, 5, torch.Generator().manual_seed(1))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


class _Noise(nn.Module):
    """A layer of the user's own that draws random numbers even in eval mode."""

    def forward(self, x):
        return x + torch.randn_like(x)


def test_mc_dropout_keeps_every_pass_where_the_shortcut_could_change_the_result():
    """Hooks on the parent or on a layer before the first dropout, and layers that are not torch.nn's own
    (which might be random in eval mode), take the generic path: here a noise layer before the dropout
    makes the passes differ even with p = 0."""
    torch.manual_seed(6)
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Dropout(0.5), nn.Linear(4, 2))
    assert baselines._split_before_first_dropout(plain)[0] is not None
    for hooked in (plain, plain[0]):
        handle = hooked.register_forward_hook(lambda module, inputs, output: output + 1)
        assert baselines._split_before_first_dropout(plain) == (None, None)
        handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, inputs: None)
    assert baselines._split_before_first_dropout(plain) == (None, None)
    handle.remove()
    noisy = nn.Sequential(nn.Linear(3, 4), _Noise(), nn.Dropout(0.0), nn.Linear(4, 2))
    assert baselines._split_before_first_dropout(noisy) == (None, None)
    theta = torch.nn.utils.parameters_to_vector(noisy.parameters()).detach()
    logits = baselines.mc_dropout_logits(noisy, theta, torch.randn(5, 3), 2, torch.Generator().manual_seed(0))
    assert not torch.equal(logits[0], logits[1])
