"""The Laplace approximation against models where it is known exactly, and its linearised predictive.

``diag``, ``kfac`` and ``dense`` are laplace-torch's (:class:`smp_book.baselines.TorchLaplace`); what is
tested here is that the book uses it rightly (the likelihood, the Bernoulli network as two classes, the
prior, the draws from our generator) and that the book's own ``block`` agrees with it.

* Bayesian linear regression (Gaussian likelihood, prior ``N(0, I / alpha)``): the posterior is exactly
  ``N(m, (Z^T Z / sigma^2 + alpha I)^-1)``, so the precision must equal that matrix, the draws must have
  its moments (z-scores against Monte Carlo standard errors) and the evidence must be the exact one.
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
from smp_core.fisher import structure_for


def _precision(fit) -> torch.Tensor:
    """The ``(d, d)`` posterior precision of a fit, formed: laplace-torch's for ``diag``, ``kfac`` and
    ``dense``, the book's for ``block``."""
    if isinstance(fit, baselines.BlockLaplace):
        return fit.precision
    fit._set_prior()
    p = fit.la.posterior_precision
    return {"diag": torch.diag, "kfac": lambda m: m.to_matrix(), "dense": lambda m: m}[fit.structure](p)


def _design(n=200, p=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, p, generator=g, dtype=torch.float64)
    return x, torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], dim=1), g  # layout order: weight, bias


def _linear_posterior(sigma=0.7, alpha=2.0, n=200, p=3, seed=0):
    """x, y, the model, the exact posterior mean, covariance and precision of Bayesian linear regression."""
    x, z, g = _design(n, p, seed)
    w_true = torch.tensor([1.0, -2.0, 0.5, 0.3], dtype=torch.float64)
    y = z @ w_true + sigma * torch.randn(n, generator=g, dtype=torch.float64)
    precision = z.T @ z / sigma**2 + alpha * torch.eye(p + 1, dtype=torch.float64)
    cov = torch.linalg.inv(precision)
    mean = cov @ (z.T @ y) / sigma**2
    return x, y, nn.Sequential(nn.Linear(p, 1)).double(), mean, cov, precision


def test_linear_gaussian_precision_is_exact_for_every_structure():
    sigma, alpha = 0.7, 2.0
    x, y, net, mean, _, precision = _linear_posterior(sigma, alpha)
    lik = get_likelihood("gaussian", sigma=sigma)
    fits = {s: baselines.fit_laplace(net, lik, mean, x, y, prior_precision=alpha, structure=s)
            for s in baselines.LAPLACE_STRUCTURES}
    torch.testing.assert_close(_precision(fits["dense"]), precision, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(_precision(fits["diag"]), torch.diag(precision.diagonal()), rtol=1e-10, atol=1e-10)
    expected = precision.clone()
    expected[:3, 3] = expected[3, :3] = 0  # weight and bias are separate blocks ...
    torch.testing.assert_close(_precision(fits["block"]), expected, rtol=1e-10, atol=1e-10)
    # ... and laplace-torch's KFAC keeps them apart too; with one output it is exact within each
    torch.testing.assert_close(_precision(fits["kfac"]), expected, rtol=1e-10, atol=1e-10)
    assert all(f.prior_precision == alpha and f.structure == s for s, f in fits.items())


def test_block_is_the_blocks_of_laplace_torchs_full():
    """Where the two overlap: the book's ``block`` precision (one block per parameter tensor) is the
    block diagonal of laplace-torch's ``full`` one, for a categorical MLP and a CNN at a random point."""
    for fit_of in (_mlp_fit, _cnn_fit):
        block, full = fit_of("block"), _precision(fit_of("dense"))
        mask = torch.zeros_like(full, dtype=torch.bool)
        for b in block.shape.blocks:
            mask[b, b] = True
        torch.testing.assert_close(block.precision, torch.where(mask, full, 0), rtol=1e-10, atol=1e-10)


def test_draws_have_the_exact_posterior_moments():
    """z-scores of the sample mean and covariance against the exact posterior, with a check that the
    same statistics reject a wrong covariance (the precision itself)."""
    x, y, net, mean, cov, precision = _linear_posterior()
    lp = baselines.fit_laplace(net, get_likelihood("gaussian", sigma=0.7), mean, x, y, prior_precision=2.0)
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


def test_diag_draws_have_the_diagonal_variances():
    x, y, net, mean, _, precision = _linear_posterior()
    lp = baselines.fit_laplace(net, get_likelihood("gaussian", sigma=0.7), mean, x, y, prior_precision=2.0,
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
    """The Bernoulli network goes to laplace-torch as two classes with logits (0, g): the same model, so
    its full GGN must be the Hessian of the Bernoulli negative log likelihood."""
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
    lp = baselines.fit_laplace(net, "bernoulli", theta, x, y, prior_precision=alpha)
    torch.testing.assert_close(_precision(lp), hessian, rtol=1e-9, atol=1e-9)
    # the log likelihood laplace-torch's evidence uses is the Bernoulli one
    assert float(lp.la.log_likelihood) == pytest.approx(-float(neg_log_posterior(theta) - alpha * theta @ theta / 2),
                                                        rel=1e-10)


def test_same_generator_same_draws_as_laplace_torch():
    """The draws are laplace-torch's (``la.sample`` with the same generator, on the CPU), reproducible,
    in the mean's dtype, and do not change the network the user passed."""
    x, y, net, mean, _, _ = _linear_posterior()
    before = [p.detach().clone() for p in net.parameters()]
    for structure in ("diag", "kfac", "dense"):
        lp = baselines.fit_laplace(net, get_likelihood("gaussian", sigma=1.0), mean, x, y, prior_precision=1.0,
                                   structure=structure)
        a = lp.sample(5, torch.Generator().manual_seed(9))
        torch.testing.assert_close(a, lp.sample(5, torch.Generator().manual_seed(9)), rtol=0, atol=0)
        torch.testing.assert_close(a, lp.la.sample(5, generator=torch.Generator().manual_seed(9)), rtol=1e-12,
                                   atol=1e-12)
        assert a.dtype == mean.dtype
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before, strict=True))
    assert torch.get_default_dtype() == torch.float32  # the fit's float64 default is undone


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


@pytest.mark.parametrize("structure", ["diag", "kfac", "dense"])
def test_linearised_logits_have_laplace_torchs_glm_predictive(structure):
    """The linearised logits at draws ``theta_MAP + Sigma^{1/2} e_j`` (the columns of a square root of the
    covariance) have, exactly, laplace-torch's GLM predictive mean and covariance ``J Sigma J^T`` at
    every input: the book's GLM rows are laplace-torch's ``pred_type="glm"``."""
    fit = _mlp_fit(structure)
    x = torch.randn(6, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    f_mu, f_var = fit.la._glm_predictive_distribution(x)
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    root = torch.linalg.cholesky(torch.linalg.inv(_precision(fit)))  # Sigma = root root^T
    lin = baselines.linearised_logits(net, fit.mean, fit.mean + root.T, x)  # (d, n, m): one row per column
    centred = lin - baselines.linearised_logits(net, fit.mean, fit.mean[None], x)
    torch.testing.assert_close(lin.mean(0) - centred.mean(0), f_mu, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(torch.einsum("snc,snk->nck", centred, centred), f_var, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("prior", [0, -1.0, float("nan"), float("inf"), "1"])
def test_bad_prior_precision(prior):
    x, y, net, mean, _, _ = _linear_posterior()
    with pytest.raises(ValueError, match="prior_precision"):
        baselines.fit_laplace(net, get_likelihood("gaussian", sigma=1.0), mean, x, y, prior_precision=prior)


def test_bad_inputs_name_the_problem(monkeypatch):
    x, y, net, mean, _, _ = _linear_posterior()
    lik = get_likelihood("gaussian", sigma=1.0)
    with pytest.raises(ValueError, match="unknown Laplace structure"):
        baselines.fit_laplace(net, lik, mean, x, y, prior_precision=1.0, structure="full")
    with pytest.raises(ValueError, match=r"theta_map must have shape \(4,\)"):
        baselines.fit_laplace(net, lik, mean[:3], x, y, prior_precision=1.0)
    with pytest.raises(ValueError, match="theta_map contains NaN"):
        baselines.fit_laplace(net, lik, mean * float("nan"), x, y, prior_precision=1.0)
    with pytest.raises(ValueError, match="x has 200 rows but y has 3"):
        baselines.fit_laplace(net, lik, mean, x, y[:3], prior_precision=1.0)
    with pytest.raises(ValueError, match="batch_size"):
        baselines.fit_laplace(net, lik, mean, x, y, prior_precision=1.0, batch_size=0)
    for structure in ("dense", "block"):
        with pytest.raises(ValueError, match="NaN or infinite"):
            baselines.fit_laplace(net, lik, mean, x * float("nan"), y, prior_precision=1.0, structure=structure)
        with pytest.raises(ValueError, match="at least one training input"):
            baselines.fit_laplace(net, lik, mean, x[:0], y[:0], prior_precision=1.0, structure=structure)
    monkeypatch.setattr(baselines, "MAX_DENSE_DIM", 2)  # the weight block has 3 rows
    for structure in ("block", "dense"):
        with pytest.raises(ValueError, match="use structure='diag' or 'kfac'"):
            baselines.fit_laplace(net, lik, mean, x, y, prior_precision=1.0, structure=structure)
    kfac = baselines.fit_laplace(net, lik, mean, x, y, prior_precision=1.0, structure="kfac")
    assert kfac.sample(3).shape == (3, 4)  # never forms the matrix
    monkeypatch.setattr(baselines, "MAX_DENSE_DIM", 10_000)
    shape = structure_for(as_chain_model(net), "block")
    lp = baselines.BlockLaplace(mean, shape, (-torch.eye(3, dtype=torch.float64)[None], -torch.ones(1, 1, 1).double()),
                                1.0, 200)
    with pytest.raises(ValueError, match="not positive definite"):
        lp.sample(3)
    for fit in (lp, kfac):
        with pytest.raises(ValueError, match="n_samples"):
            fit.sample(0)
        with pytest.raises(ValueError, match="prior_precision"):
            fit.with_prior_precision(0.0)
    with pytest.raises(ValueError, match=r"samples must have shape \(S, 4\)"):
        baselines.linearised_logits(net, mean, mean, x)
    with pytest.raises(ValueError, match="batch_size"):
        baselines.linearised_logits(net, mean, mean[None], x, batch_size=0)
    with pytest.raises(ValueError, match=r"x has 200 rows but y has 3"):
        baselines.log_likelihood(net, lik, mean, x, torch.zeros(3, dtype=torch.float64))


def _mlp_fit(structure, n=150, classes=3, seed=10):
    """A Laplace fit of a small two-layer categorical MLP at a random point (any point has a GGN)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=g)
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, classes)).double()
    theta = 0.8 * torch.randn(as_chain_model(net).layout.dim, generator=g, dtype=torch.float64)
    return baselines.fit_laplace(net, "categorical", theta, x, y, prior_precision=0.5, structure=structure)


@pytest.mark.parametrize("structure", ["diag", "kfac", "dense"])
def test_spectrum_matches_the_formed_precision(structure):
    """The GGN's eigenvalues from laplace-torch's structure (the products of the Kronecker factors'
    eigenvalues for kron) plus alpha against those of the d x d precision laplace-torch forms, and
    another prior precision shares the curvature."""
    fit = _mlp_fit(structure)
    expected = torch.linalg.eigvalsh(_precision(fit))
    got = torch.sort(fit.ggn_eigenvalues() + fit.prior_precision).values
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-6)
    other = fit.with_prior_precision(3.0)
    assert other.prior_precision == 3.0 and fit.prior_precision == 0.5 and other.la is fit.la
    shift = 2.5 * torch.eye(expected.shape[0], dtype=torch.float64)
    torch.testing.assert_close(_precision(other), _precision(fit) + shift, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("structure", ["diag", "kfac", "dense"])
def test_spectrum_of_a_gaussian_likelihood_counts_its_sigma(structure):
    """laplace-torch keeps J^T J and multiplies by 1 / sigma^2 only in the precision: the eigenvalues
    must carry it (sigma = 0.7 here)."""
    x, y, net, mean, _, _ = _linear_posterior(sigma=0.7)
    fit = baselines.fit_laplace(net, get_likelihood("gaussian", sigma=0.7), mean, x, y, prior_precision=2.0,
                                structure=structure)
    expected = torch.linalg.eigvalsh(_precision(fit))
    torch.testing.assert_close(torch.sort(fit.ggn_eigenvalues() + 2.0).values, expected, rtol=1e-9, atol=1e-9)


def test_a_non_finite_ggn_is_refused():
    """A network that overflows at theta_map has no GGN there: said, not turned into the prior."""
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3))
    x = torch.randn(20, 2, generator=torch.Generator().manual_seed(0))
    theta = torch.full((as_chain_model(net).layout.dim,), 3e38)
    for structure in ("diag", "kfac", "dense"):
        with pytest.raises(ValueError, match="GGN at theta_map is not finite"):
            baselines.fit_laplace(net, "categorical", theta, x, torch.zeros(20, dtype=torch.long), prior_precision=1.0,
                                  structure=structure)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("structure", ["diag", "kfac", "dense"])
def test_laplace_torch_draws_on_cuda_equal_those_on_the_cpu(structure):
    """z is drawn on the CPU: the same seed gives the same draws from a fit on a GPU (up to the GGN's
    rounding there)."""
    fit = _mlp_fit(structure)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(150, 2, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (150,), generator=g)
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).double().cuda()
    cuda = baselines.fit_laplace(net, "categorical", fit.mean.cuda(), x.cuda(), y.cuda(), prior_precision=0.5,
                                 structure=structure)
    b = cuda.sample(7, torch.Generator().manual_seed(3))
    assert b.device.type == "cuda"
    torch.testing.assert_close(b.cpu(), fit.sample(7, torch.Generator().manual_seed(3)), rtol=1e-7, atol=1e-9)


def _cnn_fit(structure, n=80, seed=12):
    """A Laplace fit of a small categorical CNN (a convolution, then a linear layer) at a random point."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 25, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 3 * 3, 3)).double()
    theta = 0.8 * torch.randn(as_chain_model(net, (1, 5, 5)).layout.dim, generator=g, dtype=torch.float64)
    return baselines.fit_laplace(net, "categorical", theta, x, y, prior_precision=0.5, structure=structure,
                                 input_shape=(1, 5, 5))


@pytest.mark.parametrize("fit_of, structure", [(_mlp_fit, "kfac"), (_cnn_fit, "kfac"), (_cnn_fit, "block")])
def test_structured_draws_have_the_covariance_of_the_formed_precision(fit_of, structure):
    """Draws through each block's symmetric root (kfac) or per-block Cholesky factors (block) against the
    inverse of the precision formed entry by entry: z-scores of every covariance entry (40,000 draws),
    with a check that a 10 % wrong covariance is caught."""
    fit = fit_of(structure)
    cov = torch.linalg.inv(_precision(fit))
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
    the symmetric root of each block, must be the same either way."""
    expected = _mlp_fit("kfac").sample(9, torch.Generator().manual_seed(5))
    eigh = torch.linalg.eigh

    def flipped(matrix, *args, **kwargs):
        values, vectors = eigh(matrix, *args, **kwargs)
        signs = torch.where(torch.arange(vectors.shape[-1]) % 2 == 0, -1.0, 1.0).to(vectors)
        return values, vectors * signs

    monkeypatch.setattr(torch.linalg, "eigh", flipped)
    torch.testing.assert_close(_mlp_fit("kfac").sample(9, torch.Generator().manual_seed(5)), expected,
                               rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_block_draws_on_cuda_equal_those_on_the_cpu():
    """The same seed gives the same draws on either device (z is drawn on the CPU)."""
    fit = _mlp_fit("block")
    cuda = baselines.BlockLaplace(fit.mean.cuda(), fit.shape, tuple(t.cuda() for t in fit.ggn),
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
    x, y, net, mean, _, _ = _linear_posterior(sigma=0.7, alpha=2.0)
    grad = baselines.log_likelihood_gradient(net, get_likelihood("gaussian", sigma=0.7), mean, x, y[:, None])
    torch.testing.assert_close(grad, 2.0 * mean, rtol=1e-9, atol=1e-9)


def test_marginal_likelihood_is_exact_for_bayesian_linear_regression():
    """For a linear-Gaussian model at its exact MAP the Laplace evidence is the exact evidence
    ``log N(y | 0, sigma^2 I + Z Z^T / alpha)``: laplace-torch's, given our likelihood's sigma."""
    sigma, alpha = 0.7, 2.0
    x, y, net, mean, _, _ = _linear_posterior(sigma, alpha)
    _, z, _ = _design(200, 3, seed=0)
    lik = get_likelihood("gaussian", sigma=sigma)
    covariance = sigma**2 * torch.eye(200, dtype=torch.float64) + z @ z.T / alpha
    exact = float(torch.distributions.MultivariateNormal(torch.zeros(200, dtype=torch.float64), covariance).log_prob(y))
    assert baselines.log_likelihood(net, lik, mean, x, y[:, None]) == pytest.approx(
        float(torch.distributions.Normal(z @ mean, sigma).log_prob(y).sum()), rel=1e-12)
    fit = baselines.fit_laplace(net, lik, mean, x, y, prior_precision=alpha, structure="dense")
    assert fit.log_marginal_likelihood() == pytest.approx(exact, rel=1e-9)
    # the diagonal drops the correlations: its evidence is another number
    diag = baselines.fit_laplace(net, lik, mean, x, y, prior_precision=alpha, structure="diag")
    assert abs(diag.log_marginal_likelihood() - exact) > 1e-3


@pytest.mark.parametrize("structure", ["diag", "kfac", "dense"])
def test_optimised_prior_precision_is_near_mackays_fixed_point(structure):
    """laplace-torch's optimiser (100 Adam steps on log alpha, its defaults) ends near the maximum of the
    evidence in alpha (theta* fixed), where alpha |theta*|^2 = gamma, the effective number of parameters
    sum_i lambda_i / (lambda_i + alpha): measured within 0.4 % on this network; the bar is 2 %."""
    fit = _mlp_fit(structure)
    best = fit.optimise_prior_precision()
    eig, alpha = best.ggn_eigenvalues(), best.prior_precision
    gamma = float((eig / (eig + alpha)).sum())
    assert gamma / (alpha * float(fit.mean.square().sum())) == pytest.approx(1.0, abs=0.02)
    # the fit it started from keeps its prior's evidence and draws, though the two share laplace-torch's object
    again = _mlp_fit(structure)
    assert fit.log_marginal_likelihood() == again.log_marginal_likelihood()
    torch.testing.assert_close(fit.sample(3, torch.Generator().manual_seed(1)),
                               again.sample(3, torch.Generator().manual_seed(1)), rtol=0, atol=0)
    for factor in (0.5, 2.0):
        assert best.with_prior_precision(alpha * factor).log_marginal_likelihood() < best.log_marginal_likelihood()


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
    # one dropout layer: the same masks whatever the batch size. The logits agree to float64 rounding, not bit
    # for bit: the matrix products round by the batch's shape on some CPUs (8.9e-16 apart on an Intel Xeon),
    # while another mask would move a logit by about 0.1, far beyond this tolerance.
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
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
