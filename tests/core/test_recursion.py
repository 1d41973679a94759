"""The recursion of Algorithm 1 against closed forms, with Monte-Carlo z-scores over many chains."""

import math
import warnings

import pytest
import torch
from torch import nn

from smp_core.fisher import kronecker_layers
from smp_core.likelihoods import Gaussian, get_likelihood
from smp_core.models import MLPChainModel, as_chain_model, toy_mlp
from smp_core.preconditioners import preconditioner_from_name
from smp_core.recursion import SMP, DivergenceError, Fisher, residual_variance_ratio, run_smp

Z_MAX = 4.5  # two-sided p = 7e-6 per z-score: family-wise false alarm about 2e-3 over the ~300 z-scores here


def _with(kw, **options):
    """``kw`` with more run options (fields of smp_core.RunOptions) merged into its ``options``."""
    return {**kw, "options": {**kw.get("options", {}), **options}}


def _linear_gaussian(generator, n=8, sigma=0.5):
    net = nn.Sequential(nn.Linear(2, 1)).double()
    x = torch.randn(n, 2, generator=generator, dtype=torch.float64)
    design = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], dim=1)  # (w1, w2, b) order
    fisher = design.T @ design / n / sigma**2
    return net, x, fisher, Gaussian(sigma)


def _z_mean_and_covariance(samples, theta0, expected_cov):
    """z-scores of the sample mean against theta0 and of the covariance (centred at the known mean)."""
    s = samples.shape[0]
    dev = samples - theta0
    z_mean = dev.mean(0) / (dev.std(0) / math.sqrt(s))
    products = dev.unsqueeze(2) * dev.unsqueeze(1)  # (S, d, d)
    z_cov = (products.mean(0) - expected_cov) / (products.std(0) / math.sqrt(s))
    return z_mean, z_cov


def _assert_linear_gaussian_moments(result, net, name, fisher, score_fisher, tau, n_steps, n_obs, ridge):
    """theta_K - theta_0 of the linear-Gaussian model against mean 0 and covariance
    tau^2 sum_k (n_obs + k)^-2 P^-1 F_s P^-1 (z-scores): F_s the Fisher of the covariates' law, P = I for "none",
    else the structure's part of ``fisher`` (the preconditioner's data) plus the ridge."""
    c_k = tau**2 * sum((n_obs + k) ** -2.0 for k in range(1, n_steps + 1))
    if name == "none":
        expected = c_k * score_fisher
    else:
        structure = name.split("-")[1]
        kept = {"diag": torch.eye(3, dtype=torch.bool), "dense": torch.ones(3, 3, dtype=torch.bool),
                "kfac": torch.ones(3, 3, dtype=torch.bool),
                "block": torch.block_diag(torch.ones(2, 2), torch.ones(1, 1)).bool()}[structure]
        p_inv = torch.linalg.inv(fisher * kept + ridge * torch.eye(3, dtype=torch.float64))
        expected = c_k * p_inv @ score_fisher @ p_inv
    theta0 = net[0].weight.detach().reshape(-1).tolist() + net[0].bias.detach().tolist()
    z_mean, z_cov = _z_mean_and_covariance(result.theta, torch.tensor(theta0, dtype=torch.float64), expected)
    assert z_mean.abs().max() < Z_MAX, z_mean
    assert z_cov.abs().max() < Z_MAX, z_cov


@pytest.mark.parametrize("name, cuda_graph", [
    ("none", False), ("fixed-diag", False), ("fixed-block", False), ("fixed-dense", False),
    ("periodic-diag", False), ("periodic-block", False), ("periodic-dense", False),
    # beyond the paper: KFAC, exact here (a single linear layer with a Gaussian response: the Fisher
    # is (I / sigma^2) (x) mean([x, 1][x, 1]^T))
    ("fixed-kfac", False), ("periodic-kfac", False),
    # blocks of steps from pre-drawn noise (what a CUDA graph replays; uncaptured on a CPU)
    ("none", True), ("fixed-diag", True), ("periodic-diag", True),
    # the compiled whole step of smp_core.fused (None: the default, which takes it on a CPU)
    ("none", None), ("fixed-diag", None), ("periodic-diag", None)])
def test_linear_gaussian_moments_match_the_closed_form(name, cuda_graph, generator):
    # For y = theta^T [x, 1] + sigma eps the score is [x, 1] eps / sigma and the model-expected Fisher I
    # is exact and constant, so with P fixed (or recomputed: still I) the increments are independent of
    # theta: theta_K - theta_0 = sum_k tau/(N+k) P^-1 s_k, mean 0 and covariance
    # tau^2 sum_k (N+k)^-2 P^-1 I P^-1 (P = I for "none", I + lambda Id otherwise).
    net, x, fisher, lik = _linear_gaussian(generator)
    tau, n_steps, n_chains, ridge = 0.7, 150, 4000, 1e-3
    model = net
    if cuda_graph is None:
        from smp_core.fused import FusedSequentialChainModel, fused_unavailable

        if fused_unavailable() is not None:
            pytest.skip(f"no fused kernel: {fused_unavailable()}")
        model = FusedSequentialChainModel(net, (2,))
    result = run_smp(model, lik, x, tau=tau, n_steps=n_steps, n_chains=n_chains, seed=11, progress=False,
                     preconditioner=preconditioner_from_name(name, ridge=ridge, period=40),
                     options=dict(cuda_graph=cuda_graph))
    assert result.n_diverged == 0
    assert result.config.get("step_blocks", False) is (cuda_graph is not False)
    n = x.shape[0]
    _assert_linear_gaussian_moments(result, net, name, fisher, fisher, tau, n_steps, n, ridge)


@pytest.mark.parametrize("name", ["none", "fixed-diag", "fixed-dense"])
def test_covariates_from_another_pool_than_the_fishers_data(name, generator):
    # Beyond the paper's empirical design: covariates resampled from a pool q (x_train) while the preconditioner's
    # Fisher comes from other inputs (fisher_data) and the step size from n_obs. For the linear-Gaussian model the
    # increments are still independent of theta, so theta_K - theta_0 has mean 0 and covariance
    # tau^2 sum_k (n_obs + k)^-2 P^-1 F_q P^-1, with F_q the pool's Fisher and P the Fisher data's plus the ridge.
    net, x, fisher, lik = _linear_gaussian(generator)
    pool = 3.0 * torch.randn(20, 2, generator=generator, dtype=torch.float64) + 1.0
    pool_design = torch.cat([pool, torch.ones(20, 1, dtype=torch.float64)], dim=1)
    pool_fisher = pool_design.T @ pool_design / 20 / lik.sigma**2
    tau, n_steps, n_chains, ridge, n_obs = 0.7, 150, 4000, 1e-3, x.shape[0]
    result = run_smp(net, lik, pool, tau=tau, n_steps=n_steps, n_chains=n_chains, seed=12, n_obs=n_obs, progress=False,
                     preconditioner=preconditioner_from_name(name, ridge=ridge), fisher=Fisher("model", x))
    assert result.n_diverged == 0
    _assert_linear_gaussian_moments(result, net, name, fisher, pool_fisher, tau, n_steps, n_obs, ridge)


@pytest.mark.parametrize("name, refresh", [("ema-block", 1), ("ema-kfac", 1), ("periodic-kfac", 1),
                                           ("ema-kfac", 7)])
def test_martingale_mean_of_the_toy_network(name, refresh):
    # E[theta_K] = theta_0 for a non-linear network and a preconditioner that changes every step (EMA)
    # or every T steps at the current parameters (periodic), per chain; also for an EMA factorised only
    # every 7 steps (ema_refresh), whose solve lags its statistic.
    torch.manual_seed(0)
    net = toy_mlp().double()
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(100, 2, generator=gen, dtype=torch.float64) * 2 - 1
    result = run_smp(net, "bernoulli", x, tau=0.3, n_steps=60, n_chains=3000,
                     seed=3, progress=False, preconditioner=preconditioner_from_name(name, period=20,
                                                                                     ema_refresh=refresh))
    assert result.config.get("ema_refresh", 1) == refresh
    theta0 = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    # At tau = 0.3 a chain in a few thousand runs away (over seeds 0-7: 0 to 2 of 3000 per run, with any
    # random streams); those are stopped and left out, and the mean is judged over the rest.
    assert result.n_diverged <= 6
    dev = result.samples() - theta0
    z = dev.mean(0) / (dev.std(0) / math.sqrt(dev.shape[0]))
    assert dev.std(0).min() > 0
    assert z.abs().max() < Z_MAX, z


def test_the_recursion_climbs_the_log_likelihood():
    # One input with P(Y=1) = sigmoid(2.2) = 0.9: the chains that draw Y=1 (about 90 %) must move the
    # logit up, towards the drawn response. A sign error (descending the log-likelihood) moves 90 % down.
    net = nn.Sequential(nn.Linear(1, 1)).double()
    with torch.no_grad():
        net[0].weight.fill_(1.0)
        net[0].bias.fill_(1.2)
    x = torch.ones(1, 1, dtype=torch.float64)
    result = run_smp(net, "bernoulli", x, tau=1.0, n_steps=1, n_chains=2000, seed=0, progress=False)
    logit = result.theta[:, 0] * 1.0 + result.theta[:, 1]
    up = (logit > 2.2).double().mean()
    # binomial count of Y=1 draws: mean 0.9, sd sqrt(0.09 / 2000) = 0.0067
    assert abs(up - 0.9) < Z_MAX * math.sqrt(0.9 * 0.1 / 2000)


def test_reproducible_from_the_seed():
    net = toy_mlp()
    x = torch.rand(50, 2) * 2 - 1
    kw = dict(preconditioner="ema-diag", tau=0.3, n_steps=30, n_chains=20, progress=False)
    a = run_smp(net, "bernoulli", x, seed=1, **kw)
    b = run_smp(net, "bernoulli", x, seed=1, **kw)
    c = run_smp(net, "bernoulli", x, seed=2, **kw)
    assert torch.equal(a.theta, b.theta)
    assert not torch.equal(a.theta, c.theta)
    assert len(set(map(tuple, a.theta.tolist()))) == 20  # chains differ from one another


def test_divergence_is_detected_reported_and_never_averaged():
    net = toy_mlp()
    x = torch.rand(50, 2) * 2 - 1
    base = run_smp(net, "bernoulli", x, tau=1.0, n_steps=100, n_chains=200, seed=4, progress=False)
    theta0 = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    threshold = float((base.theta - theta0).abs().amax(1).median())
    with pytest.warns(UserWarning, match="diverged"):
        res = run_smp(net, "bernoulli", x, tau=1.0, n_steps=100, n_chains=200, seed=4, progress=False,
                      options=dict(check_every=10, divergence_threshold=threshold))
    assert 0 < res.n_diverged < 200
    assert torch.isnan(res.theta[res.diverged]).all()
    assert torch.isfinite(res.theta[~res.diverged]).all()
    assert (res.diverged_step[res.diverged] > 0).all()
    with pytest.warns(UserWarning, match="left out"):
        assert res.samples().shape == (200 - res.n_diverged, 20)
    with pytest.raises(DivergenceError, match="tau = 1000000.0 is too large"):
        run_smp(net, "bernoulli", x, preconditioner="fixed-diag", tau=1e6, n_steps=50, n_chains=8, seed=0,
                progress=False)


@pytest.mark.parametrize("name", ["ema-diag", "ema-dense", "ema-kfac", "none"])
def test_frozen_chains_with_a_nan_preconditioner_stay_frozen(name):
    # a diverged chain's EMA statistic is NaN; the frozen chain must stay exactly at theta0 and
    # the NaN must not reach the other chains
    net = toy_mlp()
    model, lik = as_chain_model(net), get_likelihood("bernoulli")
    x = torch.rand(50, 2) * 2 - 1
    layers = kronecker_layers(model) if name.endswith("kfac") else ()
    precond = preconditioner_from_name(name, dim=20, layers=layers, ema_init="identity")
    theta0 = model.layout.flatten(net).expand(8, 20).clone()
    sampler = SMP(model, lik, x, preconditioner=precond, tau=0.3)
    state = sampler.init(theta0, n_chains=8, seed=0)
    for m in state.precond.stat:
        m[2] = float("nan")
    state.diverged_step[2] = 0
    sampler.advance(state, 40, check_every=10)
    assert torch.equal(state.theta[2], theta0[2])
    others = torch.arange(8) != 2
    assert torch.isfinite(state.theta[others]).all()
    assert (state.theta[others] != theta0[others]).any(1).all()
    assert (state.diverged_step[others] < 0).all()


@pytest.mark.parametrize("name", ["fixed-diag", "periodic-diag"])
def test_fused_diagonal_update_equals_solve_then_add(name):
    # fixed and periodic diag fuse P^{-1} s into the parameter update; the plain path (solve, then
    # add) must give the same chains up to rounding, and frozen chains fall back to it
    import dataclasses

    net = toy_mlp()
    x = torch.rand(50, 2) * 2 - 1
    kw = dict(dim=20, ridge=1e-2, period=7)
    fused = preconditioner_from_name(name, **kw)
    assert fused.elementwise is not None
    plain = dataclasses.replace(fused, elementwise_step=False)
    run = dict(tau=0.3, n_steps=40, n_chains=12, seed=5, progress=False, options=dict(check_every=10))
    a = run_smp(net, "bernoulli", x, preconditioner=fused, **run)
    b = run_smp(net, "bernoulli", x, preconditioner=plain, **run)
    assert not torch.equal(a.theta, a.theta[:1].expand_as(a.theta))  # the chains moved apart
    assert torch.allclose(a.theta, b.theta, rtol=1e-5, atol=1e-6)


class _Forwarding:
    """A chain model that forwards the protocol (forward, vjp) to another and declares no fast path of it."""

    def __init__(self, inner):
        self.inner, self.layout, self.out_dim, self.module = inner, inner.layout, inner.out_dim, inner.module
        self.input_shape = inner.input_shape

    def forward(self, theta, xb):
        return self.inner.forward(theta, xb)

    def vjp(self, ctx, cotangent, retain=False, out=None):
        return self.inner.vjp(ctx, cotangent, retain, out)


@pytest.mark.parametrize("chunk", [1 << 18, 7])  # 7 elements: the outer products one chain at a time
@pytest.mark.parametrize("name", ["none", "fixed-diag", "periodic-diag", "ema-diag"])
def test_fused_score_and_update_equal_the_plain_recursion(name, chunk, monkeypatch):
    # for a SequentialChainModel the recursion never forms the score for these preconditioners
    # (vjp_apply_; for ema-diag the statistic is updated on the way); hiding that method gives the
    # plain path (score, solve, add, update), which must agree up to rounding
    import smp_core.models as models
    from smp_core.models import SequentialChainModel

    monkeypatch.setattr(models, "_OUTER_CHUNK_ELEMENTS", chunk)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 3))
    model = SequentialChainModel(net, (1, 6, 6))  # the batched torch model (test_fused.py: the compiled kernel)
    x, y = torch.rand(30, 1, 6, 6), torch.randint(0, 3, (30,))
    kw = dict(tau=0.5, n_steps=40, n_chains=10, seed=2, progress=False,
              preconditioner=preconditioner_from_name(name, period=15), fisher=Fisher("empirical", x, y),
              options=dict(check_every=10))
    fused = run_smp(model, "categorical", x, **kw)
    plain = run_smp(_Forwarding(model), "categorical", x, **kw)
    theta0 = model.layout.flatten(net)
    assert ((fused.theta - theta0).abs().amax(1) > 1e-3).all()  # every chain moved
    assert torch.allclose(fused.theta, plain.theta, rtol=1e-4, atol=1e-5)


def test_non_contiguous_theta0_and_objects_without_out_arguments():
    net = toy_mlp()
    x = torch.rand(40, 2) * 2 - 1
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    theta0 = flat.expand(6, 20).T.contiguous().T  # (6, 20) with transposed strides
    assert not theta0.is_contiguous()
    kw = dict(preconditioner="fixed-diag", tau=0.3, n_steps=30, n_chains=6, seed=3, progress=False)
    reference = run_smp(net, "bernoulli", x, theta0=theta0.contiguous(), **kw)
    assert torch.equal(run_smp(net, "bernoulli", x, theta0=theta0, **kw).theta, reference.theta)

    class OldStyleModel:  # a user's chain model written before vjp took out=
        def __init__(self, inner):
            self.inner, self.layout, self.out_dim, self.module = inner, inner.layout, inner.out_dim, inner.module

        def forward(self, theta, xb):
            return self.inner.forward(theta, xb)

        def vjp(self, ctx, cotangent, retain=False):
            return self.inner.vjp(ctx, cotangent, retain)

    # the batched torch model (not the compiled whole step, which rounds the step in another order)
    batched = run_smp(MLPChainModel(net), "bernoulli", x, theta0=theta0.contiguous(), **kw)
    old = run_smp(OldStyleModel(MLPChainModel(net)), "bernoulli", x, theta0=theta0, **kw)
    assert torch.equal(old.theta, batched.theta)


def test_checkpoint_resumes_and_extends_a_run(tmp_path):
    net = toy_mlp()
    x = torch.rand(50, 2) * 2 - 1
    kw = dict(tau=0.1, n_chains=16, seed=9, progress=False,
              preconditioner=preconditioner_from_name("periodic-dense", period=20), options=dict(check_every=25))
    full = run_smp(net, "bernoulli", x, n_steps=100, **kw)
    path = tmp_path / "run.pt"
    run_smp(net, "bernoulli", x, n_steps=50, **_with(kw, checkpoint=path, checkpoint_every=25))
    first_saved = torch.load(path, weights_only=False)["elapsed"]
    resumed = run_smp(net, "bernoulli", x, n_steps=100, **_with(kw, checkpoint=path))
    assert torch.equal(full.theta, resumed.theta)
    # the elapsed time of a resumed run includes the time spent before the resume
    saved = torch.load(path, weights_only=False)["elapsed"]
    assert resumed.elapsed >= saved > first_saved > 0
    with pytest.raises(ValueError, match="other settings"):
        run_smp(net, "bernoulli", x, n_steps=100, **_with({**kw, "tau": 0.2}, checkpoint=path))
    with pytest.raises(ValueError, match="beyond n_steps"):
        run_smp(net, "bernoulli", x, n_steps=10, **_with(kw, checkpoint=path))


def test_checkpoint_resumes_a_fused_ema_run(tmp_path):
    # ema-diag on a hand-batched CNN updates its statistic in place inside the backward pass: a run
    # saved half-way and resumed must equal the uninterrupted run to the bit
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 3))
    x, y = torch.rand(30, 1, 6, 6), torch.randint(0, 3, (30,))
    kw = dict(preconditioner="ema-diag", tau=0.05, n_chains=6, seed=4, progress=False, fisher=Fisher("empirical", x, y),
              options=dict(check_every=10))
    full = run_smp(net, "categorical", x, n_steps=60, **kw)
    path = tmp_path / "ema.pt"
    run_smp(net, "categorical", x, n_steps=30, **_with(kw, checkpoint=path, checkpoint_every=10))
    resumed = run_smp(net, "categorical", x, n_steps=60, **_with(kw, checkpoint=path))
    assert full.n_diverged == 0
    assert torch.equal(full.theta, resumed.theta)
    assert not torch.equal(full.theta[0], full.theta[1])


def test_a_rule_that_updates_a_shared_state_is_refused():
    from smp_core.preconditioners import ema_diagonal_rule

    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3))
    model = as_chain_model(net, (1, 6, 6))
    theta = model.layout.flatten(net).expand(4, -1).clone()
    out, ctx = model.forward(theta, torch.rand(4, 1, 6, 6))
    with pytest.raises(ValueError, match="one state row per chain"):
        model.vjp_apply_(ctx, torch.randn(4, 3), theta, ema_diagonal_rule(0.9, 1e-4),
                         (torch.ones(1, model.layout.dim),), 0.1)


def _small_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 3)).double()


def _reference_loop(model, lik, x, theta0, precond, curvature, *, tau, n_steps, seed):
    """Algorithm 1 written out plainly (score, solve, add, update at every step), each step's random
    numbers drawn from the chains' streams one step at a time."""
    from smp_core.streams import ChainStreams

    theta, streams, n = theta0.clone(), ChainStreams(seed, 0, theta0.shape[0]), x.shape[0]
    pstate = precond.init(theta0, curvature)
    for k in range(1, n_steps + 1):
        row = streams.covariates(k, 1, n, theta.device)[0]
        eps = streams.response_noise(lik, k, 1, model.out_dim, theta.device, theta.dtype)[0]
        out, ctx = model.forward(theta, x[row])
        score = model.vjp(ctx, lik.residual(out, lik.sample_from_noise(out, eps)))
        theta += tau / (n + k) * precond.solve(pstate, score)
        pstate = precond.update(pstate, k, theta, score, curvature)
    return theta


@pytest.mark.parametrize("network", ["cnn", "mlp", "kernel-mlp"])
@pytest.mark.parametrize("name", ["none", "fixed-diag", "periodic-diag", "ema-diag", "fixed-dense", "periodic-block",
                                  "ema-block", "ema-dense"])
def test_step_blocks_equal_the_plain_recursion_on_the_same_noise(name, network):
    # The blocks (the compiled whole steps where the kernel is built, the fused backward pass for the CNN,
    # score + rule for the batched MLP, a tensor step size, the preconditioner updated only between blocks)
    # and the run's step-by-step loop against the plain recursion: all three draw the same random numbers.
    # Blocks end at checks (every 10), periodic updates (every 7) and trace rows (every 4).
    from smp_core.fisher import estimate_fisher

    if network == "cnn":
        net, lik_name, shape = _small_cnn(), "categorical", (1, 6, 6)
        x = torch.rand(30, 1, 6, 6, dtype=torch.float64)
        y = torch.randint(0, 3, (30,))
    else:
        torch.manual_seed(0)
        net, lik_name, shape = toy_mlp().double(), "bernoulli", None
        x = torch.rand(30, 2, dtype=torch.float64) * 2 - 1
        y = torch.randint(0, 2, (30,)).double()
    model = MLPChainModel(net) if network == "mlp" else as_chain_model(net, shape)
    lik = get_likelihood(lik_name)
    assert hasattr(model, "vjp_apply_") is (network != "mlp")
    n_steps, n_chains, tau = 30, 5, 0.5
    kw = dict(tau=tau, n_steps=n_steps, n_chains=n_chains, seed=2, progress=False,
              preconditioner=preconditioner_from_name(name, period=7), fisher=Fisher("empirical", x, y),
              options=dict(check_every=10, trace_every=4))
    blocks = run_smp(model, lik, x, **_with(kw, cuda_graph=True))
    precond = preconditioner_from_name(name, dim=model.layout.dim, period=7, blocks=model.layout.block_slices)
    theta0 = model.layout.flatten(net).expand(n_chains, -1).contiguous()

    def curvature(theta):
        return estimate_fisher(model, lik, theta, x, y, kind="empirical", structure=precond.structure)

    reference = _reference_loop(model, lik, x, theta0, precond, curvature if precond.needs_curvature else None,
                                tau=tau, n_steps=n_steps, seed=2)
    loop = run_smp(model, lik, x, **_with(kw, cuda_graph=False))
    assert blocks.config["step_blocks"] is True and "step_blocks" not in loop.config
    assert ((blocks.theta - theta0).abs().amax(1) > 1e-3).all()  # every chain moved
    assert torch.allclose(blocks.theta, reference, rtol=1e-9, atol=1e-11)
    assert torch.allclose(loop.theta, reference, rtol=1e-9, atol=1e-11)
    assert blocks.trace_steps == list(range(4, n_steps + 1, 4))


def test_step_blocks_are_reproducible_and_resume_from_a_checkpoint(tmp_path, monkeypatch):
    net = _small_cnn()
    x, y = torch.rand(30, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (30,))
    kw = dict(tau=0.3, n_chains=6, seed=4, progress=False,
              preconditioner=preconditioner_from_name("periodic-diag", period=20), fisher=Fisher("empirical", x, y),
              options=dict(check_every=10, cuda_graph=True))
    full = run_smp(net, "categorical", x, n_steps=60, **kw)
    assert torch.equal(full.theta, run_smp(net, "categorical", x, n_steps=60, **kw).theta)
    path = tmp_path / "blocks.pt"
    run_smp(net, "categorical", x, n_steps=30, **_with(kw, checkpoint=path, checkpoint_every=10))
    with monkeypatch.context() as patch:
        import smp_core.recursion as recursion

        def no_fresh_start(*args):
            raise AssertionError("the run started again instead of resuming")

        patch.setattr(recursion.SMP, "init", no_fresh_start)
        resumed = run_smp(net, "categorical", x, n_steps=60, **_with(kw, checkpoint=path))
    assert torch.equal(full.theta, resumed.theta)
    # the step-by-step loop draws the same random numbers: it resumes the blocks' checkpoint
    looped = run_smp(net, "categorical", x, n_steps=60, **_with(kw, cuda_graph=False, checkpoint=path))
    assert torch.allclose(looped.theta, full.theta, rtol=1e-9, atol=1e-11)


def test_step_blocks_on_a_cpu_only_when_asked():
    # (for a model without a compiled whole step)
    net = MLPChainModel(toy_mlp())
    x = torch.rand(40, 2) * 2 - 1
    kw = dict(preconditioner="fixed-diag", tau=0.3, n_steps=20, n_chains=4, seed=1, progress=False)
    default, loop = run_smp(net, "bernoulli", x, **kw), run_smp(net, "bernoulli", x, **_with(kw, cuda_graph=False))
    assert "step_blocks" not in default.config
    assert torch.equal(default.theta, loop.theta)
    assert run_smp(net, "bernoulli", x, **_with(kw, cuda_graph=True)).config["step_blocks"] is True
    with pytest.raises(ValueError, match="cuda_graph=True needs blocks of steps, but the 'ema-kfac'"):
        run_smp(net, "bernoulli", x, **_with({**kw, "preconditioner": "ema-kfac"}, cuda_graph=True))

    class OwnLikelihood:  # a user's likelihood written without the noise methods
        def __init__(self):
            self._inner = get_likelihood("bernoulli")

        def __getattr__(self, name):
            if name in ("noise_width", "noise_from_uniforms"):
                raise AttributeError(name)
            return getattr(self._inner, name)

    with pytest.raises(TypeError, match="OwnLikelihood has no noise_width / noise_from_uniforms"):
        run_smp(net, OwnLikelihood(), x, **kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("network, lik_name", [("cnn", "categorical"), ("mlp", "bernoulli"), ("mlp", "gaussian")])
def test_captured_blocks_equal_uncaptured_blocks_on_cuda(network, lik_name, monkeypatch):
    # the default (cuda_graph=None) takes the blocks on a GPU for these networks; a capture that fails
    # warns and goes on uncaptured, so the test also checks that every block length was captured
    from smp_core import fast_paths

    torch.manual_seed(0)
    if network == "cnn":
        net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 3)).cuda()
        x, y = torch.rand(30, 1, 6, 6, device="cuda"), torch.randint(0, 3, (30,), device="cuda")
    else:
        net = toy_mlp().cuda()
        x = torch.rand(30, 2, device="cuda") * 2 - 1
        y = torch.randint(0, 2, (30,), device="cuda").float()
        if lik_name == "gaussian":
            y = torch.randn(30, device="cuda")
    lik = get_likelihood(lik_name, **({"sigma": 1.0} if lik_name == "gaussian" else {}))
    captures = []
    capture = fast_paths.StepBlocks._capture

    def counted(self, *args):
        graph = capture(self, *args)
        captures.append(graph is not None)
        return graph

    monkeypatch.setattr(fast_paths.StepBlocks, "_capture", counted)
    for name in ("none", "fixed-diag", "periodic-diag", "ema-diag"):
        # ridge 1e-2: with the paper's 1e-4 some chains of the Gaussian MLP diverge (tiny Fisher entries)
        kw = dict(tau=0.3, n_steps=80, n_chains=6, seed=4, progress=False,
                  preconditioner=preconditioner_from_name(name, period=20, ridge=1e-2),
                  fisher=Fisher("empirical", x, y), options=dict(check_every=10))
        captures.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            captured = run_smp(net, lik, x, **kw)
        assert not [w for w in caught if "CUDA graph" in str(w.message).replace("CUDA Graph", "CUDA graph")], name
        assert captured.config["step_blocks"] is True
        assert captures and all(captures), name
        with monkeypatch.context() as patch:
            patch.setattr(fast_paths.StepBlocks, "_MAX_GRAPHS", 0)  # nothing is captured
            uncaptured = run_smp(net, lik, x, **kw)
        assert captured.n_diverged == 0
        assert not torch.equal(captured.theta, captured.theta[:1].expand_as(captured.theta))  # the chains moved
        assert torch.allclose(captured.theta, uncaptured.theta, rtol=1e-4, atol=1e-6), name


def test_residual_variance_ratio():
    assert residual_variance_ratio(500, 0) == pytest.approx(1.0)
    assert residual_variance_ratio(500, 5000) == pytest.approx(0.0910, abs=5e-4)  # the paper: about 9 %
    tail = 1 / (500 + 2_000_000 - 0.5)  # integral approximation of the sum beyond the brute-force range
    brute = (sum((500 + i) ** -2.0 for i in range(5001, 2_000_000)) + tail) / (
        sum((500 + i) ** -2.0 for i in range(1, 2_000_000)) + tail)
    assert residual_variance_ratio(500, 5000) == pytest.approx(brute, rel=1e-3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tau=0.0), "tau must be a positive"),
        (dict(tau=float("nan")), "tau must be a positive"),
        (dict(n_steps=0), r"n_steps \(K\) must be a whole number >= 1"),
        (dict(n_steps=2.5), r"n_steps \(K\) must be a whole number >= 1"),
        (dict(n_chains=0), r"n_chains \(S\) must be a whole number >= 1"),
        (dict(n_chains=True), r"n_chains \(S\) must be a whole number"),
        (dict(tau=True), "tau must be a positive"),  # not run as 1.0
        (dict(seed=1.5), "seed must be an integer"),  # not truncated
        (dict(seed=-1), r"seed must be in \[0, 2\*\*63\)"),
        (dict(seed=True), "seed must be an integer"),
        (dict(seed=torch.Generator()), "seed must be an integer"),
        (dict(options=dict(first_chain=-1)), "first_chain must be a whole number >= 0"),
        (dict(fisher="expected"), "fisher must be 'model'.*or 'empirical'"),  # refused even where unused
        (dict(options=dict(trace_every=0)), "trace_every must be a whole number >= 1"),
        (dict(options=dict(checkpoint_every=1.5)), "checkpoint_every must be a whole number >= 1"),
        (dict(preconditioner="ema_block"), "unknown preconditioner"),
        (dict(preconditioner="fixed-diag", fisher="empirical"), "needs labels"),
        (dict(preconditioner="fixed-kron"), "unknown preconditioner structure"),
        (dict(theta0=torch.zeros(19)), "d = 20 parameters"),
        (dict(theta0=torch.full((20,), float("nan"))), "theta0 contains NaN"),
        (dict(options=dict(check_every=0)), "check_every"),  # would loop for ever
        (dict(n_obs=-10), "n_obs"),  # gamma_k = tau / (N + k) negative for k < 10
        (dict(n_obs=2.5), "n_obs"),
        (dict(options=dict(divergence_threshold=float("nan"))), "divergence_threshold"),  # would switch it off
        (dict(options=dict(divergence_threshold=0.0)), "divergence_threshold"),
        (dict(n_obs=None, options=dict(check_every=2.5)), "check_every"),
    ],
)
def test_bad_input_gets_a_clear_error(kwargs, match):
    # (a preconditioner's own settings are checked where it is built: tests/core/test_preconditioners.py)
    x = torch.rand(10, 2)
    with pytest.raises(ValueError, match=match):
        run_smp(toy_mlp(), "bernoulli", x, **{"n_steps": 5, "n_chains": 2, "progress": False, **kwargs})


def test_bad_data_gets_a_clear_error():
    with pytest.raises(ValueError, match="NaN"):
        run_smp(toy_mlp(), "bernoulli", torch.full((10, 2), float("nan")), n_steps=5, progress=False)
    with pytest.raises(ValueError, match=r"inputs of shape \(3,\)"):
        run_smp(toy_mlp(), "bernoulli", torch.zeros(10, 3), n_steps=5, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_smp(toy_mlp(), "bernoulli", torch.zeros(10, 2), n_steps=5, n_chains=3, progress=False)


def test_bad_objects_get_a_type_error_and_arrays_are_taken():
    import numpy as np

    x, net = torch.rand(10, 2), toy_mlp()
    kw = dict(n_steps=3, n_chains=2, progress=False)
    for kwargs, match in [(dict(options=dict(check_evry=5)), r"unknown field\(s\) \['check_evry'\]"),
                          (dict(options=5), "options must be a smp_core.RunOptions or a dict"),
                          (dict(fisher=3), "fisher must be 'model', 'empirical' or a smp_core.Fisher"),
                          (dict(preconditioner=3), "preconditioner must be a name"),
                          (dict(progress="yes"), "progress must be True or False"),
                          (dict(options=dict(cuda_graph="no")), "cuda_graph must be True, False or None")]:
        with pytest.raises(TypeError, match=match):
            run_smp(net, "bernoulli", x, **{**kw, **kwargs})
    with pytest.raises(TypeError, match="x_train must be a tensor or an array, got str"):
        run_smp(net, "bernoulli", "data.csv", **kw)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        run_smp("net", "bernoulli", x, **kw)
    # a numpy array (or nested lists) for the data, numpy integers for counts and seeds: the same run
    same = run_smp(net, "bernoulli", x.numpy(), n_steps=np.int64(3), n_chains=np.int32(2), seed=np.uint8(0),
                   progress=False)
    assert torch.equal(same.theta, run_smp(net, "bernoulli", x, **kw).theta)
    # a preconditioner's settings are checked when it is built, even those its strategy does not use
    with pytest.raises(ValueError, match="ema_init must be 'fisher' or 'identity'"):
        preconditioner_from_name("fixed-diag", ema_init="zeros")
    for ridge in (float("inf"), float("nan"), True):  # P^-1 = 0 would move no chain; NaN would poison them
        with pytest.raises(ValueError, match="ridge"):
            preconditioner_from_name("fixed-diag", ridge=ridge)


def test_a_network_the_likelihood_cannot_use_is_refused():
    x = torch.rand(10, 2)
    two_outputs = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 2))
    # one logit's softmax is 1: every residual 0, every chain left at theta0 as if the posterior had no spread
    with pytest.raises(ValueError, match="categorical likelihood needs a network with one output per class"):
        run_smp(toy_mlp(), "categorical", x, n_steps=5, n_chains=2, progress=False)
    with pytest.raises(ValueError, match="Bernoulli likelihood needs a network with one output"):
        run_smp(two_outputs, "bernoulli", x, n_steps=5, n_chains=2, progress=False)


def test_training_mode_dropout_and_batch_norm_are_refused():
    x = torch.rand(10, 2)
    for layer in (nn.Dropout(0.5), nn.BatchNorm1d(3)):
        net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), layer, nn.Linear(3, 1))
        with pytest.raises(ValueError, match=f"{type(layer).__name__} layers in training mode.*eval"):
            run_smp(net, "bernoulli", x, n_steps=5, n_chains=2, progress=False)
        net.eval()
        with pytest.raises(ValueError, match="training mode"):
            net[2].train()  # one layer switched back is enough to refuse
            run_smp(net, "bernoulli", x, n_steps=5, n_chains=2, progress=False)
        net.eval()
        kw = dict(n_steps=20, n_chains=3, seed=1, progress=False,
                  options=dict(cuda_graph=False))  # step by step: one order of draws
        evaluated = run_smp(net, "bernoulli", x, **kw)
        if isinstance(layer, nn.Dropout):  # in eval mode dropout is the identity: the run without it
            plain = nn.Sequential(net[0], net[1], net[3])
            torch.testing.assert_close(evaluated.theta, run_smp(plain, "bernoulli", x, **kw).theta)


def test_a_checkpoint_of_another_network_or_fisher_data_is_refused(tmp_path):
    import numpy as np

    x = torch.rand(30, 2) * 2 - 1
    y = (x[:, 0] > 0).float()
    kw = dict(preconditioner="fixed-diag", tau=0.1, n_chains=4, seed=3, progress=False)
    gelu = toy_mlp()
    tanh = nn.Sequential(*[nn.Tanh() if isinstance(m, nn.GELU) else m for m in gelu])  # the same parameters
    path = tmp_path / "run.pt"
    resume = dict(check_every=10, checkpoint=path)
    fisher = Fisher("empirical", x, y)
    run_smp(gelu, "bernoulli", x, n_steps=20, fisher=fisher, options=resume, **kw)
    saved = path.read_bytes()
    with pytest.raises(ValueError, match="another network"):
        run_smp(tanh, "bernoulli", x, n_steps=40, fisher=fisher, options=resume, **kw)
    with pytest.raises(ValueError, match="another fisher_data"):
        run_smp(gelu, "bernoulli", x, n_steps=40, fisher=Fisher("empirical", x, 1 - y), options=resume, **kw)
    assert path.read_bytes() == saved  # nothing overwritten
    resumed = run_smp(gelu, "bernoulli", x, n_steps=40, fisher=fisher, options=resume, **kw)
    uninterrupted = run_smp(gelu, "bernoulli", x, n_steps=40, fisher=fisher, options=dict(check_every=10), **kw)
    assert torch.equal(resumed.theta, uninterrupted.theta)
    # nor under another seed, first chain or number of chains (a numpy integer seed is the same seed)
    for other, more in (({"seed": 4}, {}), ({}, {"first_chain": 1}), ({"n_chains": 5}, {})):
        with pytest.raises(ValueError, match="other settings"):
            run_smp(gelu, "bernoulli", x, n_steps=40, fisher=fisher, options={**resume, **more}, **{**kw, **other})
    again = run_smp(gelu, "bernoulli", x, n_steps=40, fisher=fisher, options=resume, **{**kw, "seed": np.int64(3)})
    assert torch.equal(again.theta, resumed.theta)
    gaussian = tmp_path / "gaussian.pt"
    net = nn.Sequential(nn.Linear(2, 1))
    run_smp(net, get_likelihood("gaussian", sigma=1.0), x, n_steps=10, n_chains=2, progress=False,
            options=dict(checkpoint=gaussian))
    with pytest.raises(ValueError, match=r"other settings \(sigma\)"):
        run_smp(net, get_likelihood("gaussian", sigma=2.0), x, n_steps=20, n_chains=2, progress=False,
                options=dict(checkpoint=gaussian))


def test_whole_numbers_of_any_type_are_taken_for_counts():
    import numpy as np

    x, net = torch.rand(10, 2), toy_mlp()
    kw = dict(n_steps=20, n_chains=2, seed=4, progress=False)
    reference = run_smp(net, "bernoulli", x, n_obs=10, **_with(kw, check_every=5))
    for n_obs, check_every in ((np.int64(10), np.int32(5)), (10.0, 5.0)):
        same = run_smp(net, "bernoulli", x, n_obs=n_obs, **_with(kw, check_every=check_every))
        assert torch.equal(same.theta, reference.theta) and same.config["n_obs"] == 10
    run_smp(toy_mlp(), "bernoulli", x, **kw, preconditioner=preconditioner_from_name("fixed-diag",
                                                                                     ridge=np.float32(1e-3)))
    run_smp(toy_mlp(), "bernoulli", x, **_with(kw, divergence_threshold=float("inf")))  # only non-finite chains stop


@pytest.mark.parametrize("name", ["fixed-dense", "ema-block", "periodic-kfac"])
def test_a_float64_statistic_runs_float32_chains_and_resumes(name, tmp_path):
    """``statistic_dtype=torch.float64``: the chains stay float32, the statistic (the Fisher included)
    is float64 and recorded in the config; with a ridge large enough that P^{-1} does not amplify
    rounding (with 1e-4, this Fisher's null space makes the steps up to 1e4 times the score, and the
    two runs part by more than rounding within 30 steps), the samples are the float32 statistic's up
    to rounding (same seed). A checkpoint resumes it, and a run with the float32 statistic does not
    take its checkpoint."""
    net = toy_mlp()
    x = torch.rand(40, 2, generator=torch.Generator().manual_seed(1)) * 2 - 1
    kw = dict(tau=0.05, n_chains=8, seed=4, progress=False)
    single = preconditioner_from_name(name, period=10, ridge=0.1)
    wide = preconditioner_from_name(name, period=10, ridge=0.1, statistic_dtype="float64")
    plain = run_smp(net, "bernoulli", x, n_steps=30, preconditioner=single, **kw)
    double = run_smp(net, "bernoulli", x, n_steps=30, preconditioner=wide, **kw)
    assert double.theta.dtype == torch.float32
    assert all(m.dtype == torch.float64 for m in double.precond_state.stat)
    assert double.config["statistic_dtype"] == "float64" and "statistic_dtype" not in plain.config
    torch.testing.assert_close(double.theta, plain.theta, rtol=1e-4, atol=1e-5)
    path = tmp_path / "run.pt"
    run_smp(net, "bernoulli", x, n_steps=20, preconditioner=wide, options=dict(checkpoint=path, checkpoint_every=10),
            **kw)
    resumed = run_smp(net, "bernoulli", x, n_steps=30, preconditioner=wide, options=dict(checkpoint=path), **kw)
    assert torch.equal(resumed.theta, double.theta)
    assert all(m.dtype == torch.float64 for m in resumed.precond_state.stat)
    with pytest.raises(ValueError, match="other settings"):
        run_smp(net, "bernoulli", x, n_steps=30, preconditioner=single, options=dict(checkpoint=path), **kw)


def test_run_smp_sums_the_fisher_in_the_statistic_dtype_and_takes_the_chains_own_as_the_default(monkeypatch):
    """The Fisher itself is summed in float64 (not summed in float32 and cast: estimate_fisher is asked
    for dtype=float64); the chains' own dtype named explicitly is the default (same config, so the
    same checkpoints); a statistic coarser than the chains is refused."""
    import smp_core.recursion as recursion_module

    asked = []
    real = recursion_module.estimate_fisher
    monkeypatch.setattr(recursion_module, "estimate_fisher",
                        lambda *a, **k: asked.append(k.get("dtype")) or real(*a, **k))
    net = toy_mlp()
    x = torch.rand(20, 2, generator=torch.Generator().manual_seed(1)) * 2 - 1
    kw = dict(tau=0.05, n_steps=3, n_chains=2, seed=0, progress=False)

    def block(dtype):
        return preconditioner_from_name("fixed-block", statistic_dtype=dtype)

    run_smp(net, "bernoulli", x, preconditioner=block(torch.float64), **kw)
    assert asked == [torch.float64]
    same = run_smp(net, "bernoulli", x, preconditioner=block("float32"), **kw)
    assert asked[-1] is None and "statistic_dtype" not in same.config
    with pytest.raises(ValueError, match="coarser than the chains"):
        run_smp(net.double(), "bernoulli", x.double(), preconditioner=block(torch.float32), **kw)
    with pytest.raises(ValueError, match="statistic_dtype must be"):
        block("float16")


def test_the_step_level_interface_equals_run_smp():
    # SMP.init and SMP.advance driven from one's own loop (the README's example) give run_smp's samples
    torch.manual_seed(0)
    net, x = toy_mlp(), torch.rand(40, 2) * 2 - 1
    # (tau = 0.1: at 0.3 a few chains of this untrained network diverge, by the rounding of a Fisher whose
    # inverse amplifies it 10^4-fold, and a diverged chain's row is theta0 in the state, NaN in the result)
    sampler = SMP(net, "bernoulli", x, preconditioner="fixed-block", tau=0.1)
    state = sampler.init(n_chains=20, seed=0)
    for k in (25, 50, 75, 100):
        assert sampler.advance(state, k) is state and state.step == k
    whole = run_smp(net, "bernoulli", x, preconditioner="fixed-block", tau=0.1, n_steps=100, n_chains=20, seed=0,
                    progress=False)
    assert not whole.diverged.any()
    assert torch.equal(state.theta, whole.theta)
    assert torch.equal(sampler.result(state, 0.0, {}).theta, whole.theta)
    with pytest.raises(ValueError, match="until"):
        sampler.advance(state, 50)  # no going back


def test_inputs_the_module_cannot_take_are_named_before_torch_speaks():
    cnn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 26 * 26, 3))
    with pytest.raises(ValueError, match=r"cannot take inputs of shape \(1, 8, 8\)"):
        run_smp(cnn, "categorical", torch.rand(10, 1, 8, 8), n_steps=2, n_chains=2, progress=False)


def test_fisher_data_in_another_dtype_and_the_plain_loop_keeps_count():
    torch.manual_seed(0)
    net, x = toy_mlp(), torch.rand(30, 2) * 2 - 1
    y = (x[:, 0] > 0).float()
    wide = Fisher("empirical", x.double(), y.double())  # float64 Fisher data for float32 chains
    a = run_smp(net, "bernoulli", x, preconditioner="fixed-diag", tau=0.2, n_steps=10, n_chains=3, fisher=wide,
                progress=False)
    b = run_smp(net, "bernoulli", x, preconditioner="fixed-diag", tau=0.2, n_steps=10, n_chains=3,
                fisher=Fisher("empirical", x, y), progress=False)
    assert torch.equal(a.theta, b.theta)
    sampler = SMP(net, "bernoulli", x, preconditioner="none", tau=0.2)
    state = sampler.init(n_chains=3, seed=1)
    from smp_core.recursion import plain_steps

    plain_steps(sampler.net, sampler.likelihood, sampler.x_train, sampler.precond, None, state, 5, tau=0.2, n_obs=30)
    assert state.step == 5


def test_a_checkpoint_names_the_settings_that_differ_and_knows_a_frozen_body(tmp_path):
    torch.manual_seed(0)
    net, x = toy_mlp(), torch.rand(30, 2) * 2 - 1
    path = tmp_path / "run.pt"
    kw = dict(n_chains=3, seed=1, progress=False, options=dict(checkpoint=path))
    run_smp(net, "bernoulli", x, tau=0.2, n_steps=10, **kw)
    with pytest.raises(ValueError, match=r"other settings \(tau\)"):
        run_smp(net, "bernoulli", x, tau=0.3, n_steps=20, **kw)
    frozen = tmp_path / "frozen.pt"
    body = toy_mlp()
    body[0].requires_grad_(False)
    run_smp(body, "bernoulli", x, n_steps=10, n_chains=3, progress=False, options=dict(checkpoint=frozen))
    with torch.no_grad():
        body[0].weight.add_(1.0)  # another pretrained body, the same sampled parameters
    with pytest.raises(ValueError, match="another network"):
        run_smp(body, "bernoulli", x, n_steps=20, n_chains=3, progress=False, options=dict(checkpoint=frozen))


def test_a_fast_path_is_taken_only_where_the_model_declares_it():
    """The fast paths are declared (models.FusedBackward, models.WholeStep) and registered (fast_paths.PATHS):
    a chain model with methods of the same names that does not declare them runs the plain steps."""
    from smp_core import fast_paths
    from smp_core.models import FusedBackward, SequentialChainModel, WholeStep

    assert [path.name for path in fast_paths.PATHS] == ["blocks", "elementwise"]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3))
    model = SequentialChainModel(net, (1, 6, 6))
    assert isinstance(model, FusedBackward) and not isinstance(model, WholeStep)

    class Undeclared(_Forwarding):  # the same protocol and the hooks' names, none of them declared
        def vjp_apply_(self, *args):
            raise AssertionError("an undeclared hook was called")

        def takes_whole_step(self, *args):
            raise AssertionError("an undeclared hook was called")

        def step_(self, *args):
            raise AssertionError("an undeclared hook was called")

    x = torch.rand(20, 1, 6, 6)
    kw = dict(tau=0.5, n_steps=12, n_chains=3, seed=1, progress=False, preconditioner="ema-diag")
    assert torch.allclose(run_smp(Undeclared(model), "categorical", x, **kw).theta,
                          run_smp(model, "categorical", x, **kw).theta, rtol=1e-4, atol=1e-6)
