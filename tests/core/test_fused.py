"""The compiled CPU kernel (smp_core.fused) against the batched torch model it replaces.

Every test compares the kernel with :class:`SequentialChainModel` (whose hand-derived passes are
themselves tested against autograd in test_models.py) in float64, where the two differ only by the
order of the sums: forward pass, vector-Jacobian product, every element-wise rule, and the whole
step (forward, response from the same noise, residual, backward, update).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from smp_core import lenet5, run_smp
from smp_core.fused import FusedSequentialChainModel, fused_supported, fused_unavailable
from smp_core.likelihoods import get_likelihood
from smp_core.models import SequentialChainModel, as_chain_model
from smp_core.preconditioners import (
    IDENTITY_RULE,
    STORED_INVERSE_RULE,
    Blocks,
    Dense,
    ElementwiseRule,
    MatrixRule,
    ema_diagonal_rule,
    preconditioner_from_name,
)
from smp_core.recursion import DivergenceError, Fisher

pytestmark = pytest.mark.skipif(fused_unavailable() is not None, reason=f"no fused kernel: {fused_unavailable()}")

TOL = dict(rtol=1e-10, atol=1e-12)


def _with(kw, **options):
    """``kw`` with more run options (fields of smp_core.RunOptions) merged into its ``options``."""
    return {**kw, "options": {**kw.get("options", {}), **options}}


def _networks():
    torch.manual_seed(0)
    odd = nn.Sequential(  # padding, stride, dilation, ceil_mode, no biases, every activation
        nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=False), nn.Tanh(),
        nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True),
        nn.Conv2d(3, 4, 2, dilation=2), nn.Sigmoid(), nn.Flatten(),
        nn.Linear(16, 5, bias=False), nn.Identity(), nn.ReLU(), nn.Linear(5, 2))
    return {
        "lenet5": (lenet5().double(), (1, 28, 28), 10),
        "odd": (odd.double(), (2, 11, 11), 2),
        "mlp": (nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)).double(), (4,), 1),
        "relu-mlp": (nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1)).double(), (4,), 1),
        "gelu-mlp": (nn.Sequential(nn.Linear(2, 5), nn.GELU(approximate="tanh"), nn.Linear(5, 3), nn.GELU(),
                                   nn.Linear(3, 2)).double(), (2,), 2),
        "maxpool-overhang": (nn.Sequential(nn.Conv2d(1, 2, 2), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
                                           nn.Flatten(), nn.Linear(2 * 4 * 4, 3)).double(), (1, 8, 8), 3),
    }


NETWORKS = _networks()


# float32: the other register block of the kernel's matrix products (8 lanes; 16 or 32 by the processor); the two
# implementations then differ by float32 rounding of sums taken in another order, relative to the
# largest term of those sums (the networks here have activations in the hundreds)
REL32 = 3e-5


def _assert_close(mine, ref, dtype):
    if dtype == torch.float64:
        assert torch.allclose(mine, ref, **TOL)
    else:
        assert (mine - ref).abs().max() <= REL32 * ref.abs().max(), ((mine - ref).abs().max(), ref.abs().max())


def _pair(name, n_chains=4, seed=0, dtype=torch.float64):
    net, shape, out_dim = NETWORKS[name]
    net = net.to(dtype)
    fused, batched = FusedSequentialChainModel(net, shape), SequentialChainModel(net, shape)
    gen = torch.Generator().manual_seed(seed)
    theta0 = fused.layout.flatten(net)
    theta = (theta0 + 0.3 * torch.randn(n_chains, theta0.numel(), generator=gen, dtype=dtype)).contiguous()
    x = torch.randn(n_chains, *shape, generator=gen, dtype=dtype)
    NETWORKS[name][0].double()
    return fused, batched, theta, x, gen


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(NETWORKS))
def test_forward_and_vjp_equal_the_batched_model(name, dtype):
    fused, batched, theta, x, gen = _pair(name, dtype=dtype)
    out, ctx = fused.forward(theta, x)
    ref_out, ref_ctx = batched.forward(theta, x)
    assert out.shape == ref_out.shape == (theta.shape[0], NETWORKS[name][2]) and out.dtype == dtype
    _assert_close(out, ref_out, dtype)
    cotangent = torch.randn(out.shape, generator=gen, dtype=dtype)
    grad = fused.vjp(ctx, cotangent)
    assert grad.abs().max() > 0
    _assert_close(grad, batched.vjp(ref_ctx, cotangent), dtype)
    buffer = torch.full_like(grad, float("nan"))
    assert fused.vjp(ctx, cotangent, out=buffer) is buffer and torch.equal(buffer, grad)


def _rules(theta, gen):
    d, s, dtype = theta.shape[1], theta.shape[0], theta.dtype
    shared = torch.rand(1, d, generator=gen, dtype=dtype) + 0.5
    per_chain = torch.rand(s, d, generator=gen, dtype=dtype) + 0.5
    # beta close to 1: 1 - beta must be taken in double precision (in float32, 1 - float(0.999) is off by 1e-5)
    return {"identity": (IDENTITY_RULE, ()), "shared-scale": (STORED_INVERSE_RULE, (shared,)),
            "per-chain-scale": (STORED_INVERSE_RULE, (per_chain,)),
            "ema": (ema_diagonal_rule(0.999, 1e-3), (torch.rand(s, d, generator=gen, dtype=dtype),))}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rule_name", ["identity", "shared-scale", "per-chain-scale", "ema"])
@pytest.mark.parametrize("name", list(NETWORKS))
def test_every_rule_steps_like_the_batched_model(name, rule_name, dtype):
    fused, batched, theta, x, gen = _pair(name, dtype=dtype)
    rule, tensors = _rules(theta, gen)[rule_name]
    cotangent = torch.randn(theta.shape[0], NETWORKS[name][2], generator=gen, dtype=dtype)
    mine, mine_tensors = theta.clone(), tuple(t.clone() for t in tensors)
    ref, ref_tensors = theta.clone(), tuple(t.clone() for t in tensors)
    fused.vjp_apply_(fused.forward(mine, x)[1], cotangent, mine, rule, mine_tensors, 0.05)
    batched.vjp_apply_(batched.forward(ref, x)[1], cotangent, ref, rule, ref_tensors,
                       torch.tensor(0.05, dtype=dtype))  # a 0-d tensor step size, as in the blocks
    assert (mine - theta).abs().max() > 1e-4
    _assert_close(mine, ref, dtype)
    for a, b in zip(mine_tensors, ref_tensors, strict=True):
        _assert_close(a, b, dtype)


def _padded_and_direct(dtype):
    """One network twice: a padded convolution (the patch-matrix path) on x, and the same convolution unpadded on x
    with zeros around it (the direct path: stride 1, no padding, output rows of 16, whole vectors of either dtype)."""
    torch.manual_seed(3)
    padded = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                           nn.Linear(3 * 8 * 8, 4)).to(dtype)
    direct = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(3 * 8 * 8, 4))
    direct.load_state_dict(padded.state_dict())
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 2, 16, 16, generator=gen, dtype=dtype)
    fused = FusedSequentialChainModel(padded, (2, 16, 16)), FusedSequentialChainModel(direct.to(dtype), (2, 18, 18))
    theta = fused[0].layout.flatten(padded) + 0.3 * torch.randn(5, fused[0].layout.dim, generator=gen, dtype=dtype)
    return fused, (x, nn.functional.pad(x, (1, 1, 1, 1))), theta.contiguous(), gen


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rule_name", ["identity", "shared-scale", "per-chain-scale", "ema"])
def test_a_direct_convolution_gives_the_patch_matrix_numbers_bit_for_bit(rule_name, dtype):
    # the kernel convolves without a patch matrix where it can (direct_conv in the kernel's source); it sums the same
    # products in the same order, so the two paths agree bit for bit, as the docs of fused_sequential.cpp say
    (padded, direct), (x, x_padded), theta, gen = _padded_and_direct(dtype)
    out, ctx = padded.forward(theta, x)
    out_direct, ctx_direct = direct.forward(theta, x_padded)
    assert torch.equal(out, out_direct)
    rule, tensors = _rules(theta, gen)[rule_name]
    cotangent = torch.randn(out.shape, generator=gen, dtype=dtype)
    results = []
    for model, context in ((padded, ctx), (direct, ctx_direct)):
        stepped, state = theta.clone(), tuple(t.clone() for t in tensors)
        model.vjp_apply_(context, cotangent, stepped, rule, state, 0.05)
        results.append((stepped, state))
    (mine, mine_state), (ref, ref_state) = results
    assert (mine - theta).abs().max() > 1e-4 and torch.equal(mine, ref)
    assert all(torch.equal(a, b) for a, b in zip(mine_state, ref_state, strict=True))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_two_by_two_pooling_takes_the_first_maximum_of_a_tie_and_keeps_a_nan(dtype):
    # the kernel pools 2x2 windows of stride 2 eight and four at a time in float32 (12 here); ties and NaNs follow
    # ATen's rule there too. Small integers make every sum exact, so the kernel and the batched model must agree bit
    # for bit; the gradient of the convolution's weights shows which input of a tie took the pooled gradient (which
    # of two NaNs took it does not show: a zero gradient times a NaN input is NaN).
    net = nn.Sequential(nn.Conv2d(2, 1, 1), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2 * 12, 3)).to(dtype)
    fused, batched = FusedSequentialChainModel(net, (2, 4, 24)), SequentialChainModel(net, (2, 4, 24))
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, 2, (4, 2, 4, 24), generator=gen).to(dtype)  # out = x0 + x1 in {0, 1, 2}: ties everywhere
    x[2, 1, 3, 23] = float("nan")  # chain 2: a NaN last in its window (a rule without NaNs keeps the maximum)
    x[3, 0, 0, 8] = x[3, 1, 1, 9] = float("nan")  # chain 3: the first and the last of one window
    theta = torch.randint(-2, 3, (4, fused.layout.dim), generator=gen).to(dtype)
    theta[:, :3] = torch.tensor([1.0, 1.0, 0.0], dtype=dtype)  # conv weights 1, 1, bias 0
    out, ctx = fused.forward(theta, x)
    ref, ref_ctx = batched.forward(theta, x)
    assert torch.equal(out[:2], ref[:2]) and torch.isnan(out[2:]).all() and torch.isnan(ref[2:]).all()
    cotangent = torch.randint(-3, 4, out.shape, generator=gen).to(dtype)
    grad, ref_grad = fused.vjp(ctx, cotangent), batched.vjp(ref_ctx, cotangent)
    assert torch.equal(grad[:2], ref_grad[:2])
    assert torch.equal(torch.isnan(grad[2:]), torch.isnan(ref_grad[2:]))


def test_the_float32_ema_statistic_takes_one_minus_beta_in_double():
    # stat = 0, so the new statistic is (1 - beta) s^2 alone; in float32, 1 - float32(0.999) is 1.3e-5
    # off (relative), which an entry-wise comparison at 2e-6 sees (the small ReLU MLP's scores are exact to
    # ~1e-7; a tanh one's are not: the kernel's float tanh is within 4 units in the last place of torch's)
    fused, batched, theta, x, gen = _pair("relu-mlp", dtype=torch.float32)
    rule = ema_diagonal_rule(0.999, 1e-3)
    cotangent = torch.randn(theta.shape[0], 1, generator=gen)
    stats = [torch.zeros_like(theta), torch.zeros_like(theta)]
    fused.vjp_apply_(fused.forward(theta.clone(), x)[1], cotangent, theta.clone(), rule, (stats[0],), 0.05)
    batched.vjp_apply_(batched.forward(theta.clone(), x)[1], cotangent, theta.clone(), rule, (stats[1],), 0.05)
    big = stats[1] > 1e-3 * stats[1].max()
    assert big.sum() > 20
    assert torch.allclose(stats[0][big], stats[1][big], rtol=2e-6, atol=0)


@pytest.mark.parametrize("rule_name", ["identity", "shared-scale", "ema"])
@pytest.mark.parametrize("name, lik_name", [("lenet5", "categorical"), ("odd", "gaussian"), ("mlp", "bernoulli"),
                                            ("maxpool-overhang", "categorical"), ("gelu-mlp", "categorical")])
def test_whole_step_equals_forward_response_residual_and_rule(name, lik_name, rule_name):
    fused, batched, theta, x, gen = _pair(name, n_chains=6)
    lik = get_likelihood(lik_name, **({"sigma": 0.7} if lik_name == "gaussian" else {}))
    rule, tensors = _rules(theta, gen)[rule_name]
    noise = lik.draw_noise((theta.shape[0],), fused.out_dim, gen, "cpu", torch.float64)
    mine, mine_tensors = theta.clone(), tuple(t.clone() for t in tensors)
    assert fused.step_(mine, x, lik, noise, rule, mine_tensors, torch.tensor(0.05, dtype=torch.float64))
    ref, ref_tensors = theta.clone(), tuple(t.clone() for t in tensors)
    out, ctx = batched.forward(ref, x)
    batched.vjp_apply_(ctx, lik.residual(out, lik.sample_from_noise(out, noise)), ref, rule, ref_tensors, 0.05)
    assert (mine - theta).abs().max() > 1e-6
    assert torch.allclose(mine, ref, **TOL)
    for a, b in zip(mine_tensors, ref_tensors, strict=True):
        assert torch.allclose(a, b, **TOL)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rule_name", ["identity", "per-chain-scale", "ema"])
@pytest.mark.parametrize("name, lik_name", [("odd", "gaussian"), ("mlp", "bernoulli"), ("gelu-mlp", "categorical")])
def test_a_block_of_steps_is_its_steps_one_by_one_bit_for_bit(name, lik_name, rule_name, dtype):
    # each chain's steps run back to back on one thread: the same operations on the same numbers as one
    # call of step_ per step (chains are independent), so the results are equal bit for bit
    fused, _, theta, _, gen = _pair(name, n_chains=5, dtype=dtype)
    lik = get_likelihood(lik_name, **({"sigma": 0.7} if lik_name == "gaussian" else {}))
    rule, tensors = _rules(theta, gen)[rule_name]
    n = 7
    x_train = torch.randn(11, *NETWORKS[name][1], generator=gen, dtype=dtype)
    draws = torch.randint(0, 11, (n, theta.shape[0]), generator=gen)
    noise = lik.draw_noise((n, theta.shape[0]), fused.out_dim, gen, "cpu", dtype)
    gammas = (0.5 / (100 + torch.arange(1, n + 1, dtype=torch.float64))).to(dtype)
    block, block_tensors = theta.clone(), tuple(t.clone() for t in tensors)
    assert fused.steps_(block, x_train, draws, lik, noise, rule, block_tensors, gammas)
    one, one_tensors = theta.clone(), tuple(t.clone() for t in tensors)
    for j in range(n):
        assert fused.step_(one, x_train[draws[j]], lik, noise[j], rule, one_tensors, gammas[j])
    assert (block - theta).abs().max() > 1e-4
    assert torch.equal(block, one)
    for a, b in zip(block_tensors, one_tensors, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="draws of shape"):
        fused.steps_(block, x_train, draws[:, :2], lik, noise, rule, block_tensors, gammas)
    with pytest.raises(RuntimeError, match="a draw indexes row 11 of 11"):
        fused.steps_(block, x_train, torch.full_like(draws, 11), lik, noise, rule, block_tensors, gammas)


def _matrices(fused, structure_name, chains, gen, dtype=torch.float64):
    """A MatrixRule of the block or dense structure with random symmetric positive definite matrices, one per
    chain or shared."""
    d = fused.layout.dim
    structure = Blocks(d, tuple(fused.layout.block_slices)) if structure_name == "block" else Dense(d)
    slices = structure.blocks if structure_name == "block" else (slice(0, d),)
    factors = []
    for b in slices:
        a = torch.randn(chains, b.stop - b.start, b.stop - b.start, generator=gen, dtype=dtype)
        factors.append(a @ a.transpose(1, 2) / a.shape[1] + torch.eye(a.shape[1], dtype=dtype))
    return MatrixRule(structure), tuple(factors)


@pytest.mark.parametrize("structure_name, chains", [("block", 1), ("block", 6), ("dense", 1), ("dense", 6)])
@pytest.mark.parametrize("name, lik_name", [("gelu-mlp", "categorical"), ("odd", "gaussian")])
def test_stored_matrices_step_like_the_score_then_the_matrices(name, lik_name, structure_name, chains):
    # mode 4 of the whole step: the score formed, then theta += gamma g M_b for every block (one matrix per
    # block shared by the chains, or one per chain), against the batched model's score and the structure's apply
    fused, batched, theta, x, gen = _pair(name, n_chains=6)
    lik = get_likelihood(lik_name, **({"sigma": 0.7} if lik_name == "gaussian" else {}))
    rule, factors = _matrices(fused, structure_name, chains, gen)
    assert fused.takes_whole_step(lik, rule, "cpu", torch.float64)
    noise = lik.draw_noise((theta.shape[0],), fused.out_dim, gen, "cpu", torch.float64)
    mine = theta.clone()
    # a transposed (column-major) matrix, as cholesky_inverse returns them, is read by its values
    assert fused.step_(mine, x, lik, noise, rule, tuple(f.transpose(1, 2) for f in factors), 0.05)
    out, ctx = batched.forward(theta, x)
    score = batched.vjp(ctx, lik.residual(out, lik.sample_from_noise(out, noise)))
    ref = theta + 0.05 * rule.structure.apply(factors, score)
    assert (mine - theta).abs().max() > 1e-4
    assert torch.allclose(mine, ref, **TOL)
    # a block of steps is its steps one by one, bit for bit
    n, x_train = 5, torch.randn(9, *NETWORKS[name][1], generator=gen, dtype=torch.float64)
    draws = torch.randint(0, 9, (n, theta.shape[0]), generator=gen)
    noises = lik.draw_noise((n, theta.shape[0]), fused.out_dim, gen, "cpu", torch.float64)
    gammas = 0.3 / (50 + torch.arange(1, n + 1, dtype=torch.float64))
    block, one = theta.clone(), theta.clone()
    assert fused.steps_(block, x_train, draws, lik, noises, rule, factors, gammas)
    for j in range(n):
        assert fused.step_(one, x_train[draws[j]], lik, noises[j], rule, factors, gammas[j])
    assert torch.equal(block, one)


def _ema_step_both_ways(fused, batched, theta, x, lik, rule, stats, gen):
    """One step of the EMA matrices rule from ``theta`` and ``stats``: by the kernel, and by the structure's
    solve and update on the batched model's score. Returns both thetas and statistics."""
    noise = lik.draw_noise((theta.shape[0],), fused.out_dim, gen, "cpu", theta.dtype)
    mine, mine_stats = theta.clone(), tuple(m.clone() for m in stats)
    assert fused.step_(mine, x, lik, noise, rule, mine_stats, 0.05)
    out, ctx = batched.forward(theta, x)
    score = batched.vjp(ctx, lik.residual(out, lik.sample_from_noise(out, noise)))
    ref, ref_stats = theta.clone(), tuple(m.clone() for m in stats)
    rule.apply_(ref, score, ref_stats, 0.05)
    return mine, mine_stats, ref, ref_stats


@pytest.mark.parametrize("structure_name", ["block", "dense"])
@pytest.mark.parametrize("name, lik_name", [("gelu-mlp", "categorical"), ("odd", "gaussian")])
def test_ema_matrices_step_like_the_solve_then_the_update(name, lik_name, structure_name):
    # mode 5: theta += gamma (I_k + ridge I)^{-1} s per block (Cholesky), then I_{k+1} = beta I_k + (1 - beta) s s^T,
    # against the structure's solve and EMA update on the batched model's score; an MLP runs its chains in the
    # lanes of a vector (6 chains: a last, partial group), another network chain by chain
    fused, batched, theta, x, gen = _pair(name, n_chains=6)
    lik = get_likelihood(lik_name, **({"sigma": 0.7} if lik_name == "gaussian" else {}))
    _, stats = _matrices(fused, structure_name, 6, gen)
    rule = MatrixRule(_matrices(fused, structure_name, 1, gen)[0].structure, (0.9, 1e-3))
    assert rule.covers_update and fused.takes_whole_step(lik, rule, "cpu", torch.float64)
    mine, mine_stats, ref, ref_stats = _ema_step_both_ways(fused, batched, theta, x, lik, rule, stats, gen)
    assert (mine - theta).abs().max() > 1e-4
    assert torch.allclose(mine, ref, **TOL)
    for a, b in zip(mine_stats, ref_stats, strict=True):
        assert torch.allclose(a, b, **TOL)
    # a block of steps is its steps one by one, bit for bit
    n, x_train = 5, torch.randn(9, *NETWORKS[name][1], generator=gen, dtype=torch.float64)
    draws = torch.randint(0, 9, (n, 6), generator=gen)
    noises = lik.draw_noise((n, 6), fused.out_dim, gen, "cpu", torch.float64)
    gammas = 0.3 / (50 + torch.arange(1, n + 1, dtype=torch.float64))
    block, block_stats = theta.clone(), tuple(m.clone() for m in stats)
    one, one_stats = theta.clone(), tuple(m.clone() for m in stats)
    assert fused.steps_(block, x_train, draws, lik, noises, rule, block_stats, gammas)
    for j in range(n):
        assert fused.step_(one, x_train[draws[j]], lik, noises[j], rule, one_stats, gammas[j])
    assert torch.equal(block, one)
    for a, b in zip(block_stats, one_stats, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("structure_name", ["block", "dense"])
@pytest.mark.parametrize("chains", [1, 9])
def test_ema_matrices_in_float32_step_like_the_solve_then_the_update(structure_name, chains):
    # float32 lanes: eight chains a group, so 9 chains are a full group and a partial one; one chain's
    # statistic is read with stride 0. Sums in another order than the batched model's: a relative 1e-4 of the
    # step, and of the statistic's scale
    fused, batched, theta, x, gen = _pair("gelu-mlp", n_chains=chains, dtype=torch.float32)
    lik = get_likelihood("categorical")
    structure_rule, stats = _matrices(fused, structure_name, chains, gen, dtype=torch.float32)
    rule = MatrixRule(structure_rule.structure, (0.9, 1e-3))
    mine, mine_stats, ref, ref_stats = _ema_step_both_ways(fused, batched, theta, x, lik, rule, stats, gen)
    step = (ref - theta).abs().max()
    assert step > 1e-3 and (mine - ref).abs().max() <= 1e-4 * step
    for a, b in zip(mine_stats, ref_stats, strict=True):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()


@pytest.mark.parametrize("structure_name", ["block", "dense"])
@pytest.mark.parametrize("name, lik_name", [("gelu-mlp", "categorical"), ("odd", "gaussian")])
def test_an_indefinite_ema_statistic_is_solved_in_double_and_warns(name, lik_name, structure_name):
    # rounding can leave a float32 statistic indefinite by more than the ridge: the kernel's Cholesky fails
    # and the solve is redone in double from the eigendecomposition (negative eigenvalues set to 0), with
    # smp_core.preconditioners' warning; a non-finite statistic gives NaN (the chain's divergence), silently.
    # Ten chains: six positive definite statistics, three indefinite ones and a NaN; an MLP runs them in the
    # lanes of a vector (a first group mixing good and failing lanes, a last, partial one), another network
    # chain by chain
    fused, batched, theta, x, gen = _pair(name, n_chains=10, dtype=torch.float32)
    lik = get_likelihood(lik_name, **({"sigma": 0.7} if lik_name == "gaussian" else {}))
    structure_rule, good = _matrices(fused, structure_name, 10, gen, dtype=torch.float32)
    rule = MatrixRule(structure_rule.structure, (0.9, 1e-3))
    stats = []
    for block in good:
        n = block.shape[1]
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
        values = torch.linspace(-0.5, 2.0, n, dtype=torch.float64)
        stat = block.clone()
        stat[6:] = ((q * values) @ q.T).float()
        stat[9, 0, 0] = float("nan")
        stats.append(stat)
    noise = lik.draw_noise((10,), fused.out_dim, gen, "cpu", torch.float32)
    mine, mine_stats = theta.clone(), tuple(m.clone() for m in stats)
    with pytest.warns(RuntimeWarning, match="indefinite by more than the ridge"):
        assert fused.step_(mine, x, lik, noise, rule, mine_stats, 0.05)
    out, ctx = batched.forward(theta, x)
    score = batched.vjp(ctx, lik.residual(out, lik.sample_from_noise(out, noise)))
    ref, ref_stats = theta.clone(), tuple(m.clone() for m in stats)
    with pytest.warns(RuntimeWarning, match="indefinite by more than the ridge"):
        rule.apply_(ref, score, ref_stats, 0.05)
    assert torch.isnan(mine[9]).all() and torch.isnan(ref[9]).all()
    # float32 scores and steps of another order of sums: a relative 1e-4 of the step
    step = (ref[:9] - theta[:9]).abs().max()
    assert step > 1e-3 and (mine[:9] - ref[:9]).abs().max() <= 1e-4 * step


def test_the_float_tanh_of_the_mlp_lanes_is_within_four_units_in_the_last_place():
    # the MLP kernel's float32 tanh is a rational approximation (Eigen's, which XLA uses): against the
    # correctly rounded tanh (float64, rounded) on a fine grid, tiny and huge values, NaN and the infinities
    net = nn.Sequential(nn.Linear(1, 1), nn.Tanh())
    with torch.no_grad():
        net[0].weight.fill_(1.0)
        net[0].bias.zero_()
    model = FusedSequentialChainModel(net, (1,))
    x = torch.cat([torch.linspace(-12, 12, 200_001), torch.logspace(-8, 0, 10_001), -torch.logspace(-8, 0, 10_001)])
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    x = torch.cat([x, special]).unsqueeze(1)
    out, _ = model.forward(model.layout.flatten(net).expand(x.shape[0], -1).contiguous(), x)
    ref = torch.tanh(x.double()).float()
    ulp = torch.nextafter(ref.abs(), torch.tensor(float("inf"))) - ref.abs()
    finite = torch.isfinite(x[:, 0])
    assert ((out - ref).abs()[finite] <= 4 * ulp[finite]).all()
    assert torch.isnan(out[-4]).all() and (out[-3:-1, 0] - torch.tensor([1.0, -1.0])).abs().max() <= 3e-7
    assert out[-1, 0] == 0


def test_every_class_is_drawn_at_its_softmax_probability():
    # the kernel's inverse-CDF draw of a categorical response, through the step it makes: with one
    # Linear layer of zero weights and a bias b, the step moves b by gamma (e_y - softmax(b)), so the
    # class drawn is the argmax of the change. z-test of each class frequency against softmax(b).
    net = nn.Sequential(nn.Linear(3, 4)).double()
    with torch.no_grad():
        net[0].weight.zero_()
        net[0].bias.copy_(torch.tensor([0.5, -1.0, 0.0, 1.2]))
    model, lik = FusedSequentialChainModel(net, (3,)), get_likelihood("categorical")
    n = 40_000
    gen = torch.Generator().manual_seed(3)
    theta = model.layout.flatten(net).expand(n, -1).contiguous()
    before = theta.clone()
    assert model.step_(theta, torch.randn(n, 3, generator=gen, dtype=torch.float64), lik,
                       lik.draw_noise((n,), 4, gen, "cpu", torch.float64), IDENTITY_RULE, (), 1.0)
    drawn = (theta - before)[:, -4:].argmax(1)
    p = torch.softmax(net[0].bias.detach(), 0)
    freq = torch.bincount(drawn, minlength=4).double() / n
    z = (freq - p) / torch.sqrt(p * (1 - p) / n)
    assert z.abs().max() < 4.5, z


def test_nan_parameters_stay_visible():
    # ReLU and max-pooling must pass a NaN on (as torch does), so that a diverged chain is seen
    fused, _, theta, x, _ = _pair("lenet5")
    theta[1, :5] = float("nan")
    out, _ = fused.forward(theta, x)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2, 3]]).all()
    lik = get_likelihood("categorical")
    noise = torch.rand(theta.shape[0], dtype=torch.float64)
    assert fused.step_(theta, x, lik, noise, IDENTITY_RULE, (), 0.1)
    assert torch.isnan(theta[1, 5:]).any() and torch.isfinite(theta[[0, 2, 3]]).all()  # the step spread it


def test_a_diverging_run_is_caught():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 3))
    x = torch.rand(20, 1, 6, 6)
    kw = dict(n_steps=40, n_chains=5, seed=0, progress=False, options=dict(check_every=10))
    with pytest.raises(DivergenceError, match="all 5 chains diverged by step 10"):
        run_smp(net, "categorical", x, tau=1e6, **kw)
    assert run_smp(net, "categorical", x, tau=0.5, **kw).config["step_blocks"] is True


def test_default_cpu_run_takes_the_whole_step_and_matches_the_torch_path(monkeypatch):
    calls = []
    whole_steps = FusedSequentialChainModel.steps_

    def counted(self, theta, x_train, draws, *args):
        done = whole_steps(self, theta, x_train, draws, *args)
        calls.extend([done] * draws.shape[0])
        return done

    monkeypatch.setattr(FusedSequentialChainModel, "steps_", counted)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 3)).double()
    x, y = torch.rand(30, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (30,))
    for name in ["none", "fixed-diag", "periodic-diag", "ema-diag", "fixed-block", "periodic-dense"]:
        kw = dict(tau=0.5, n_steps=30, n_chains=5, seed=2, progress=False,
                  preconditioner=preconditioner_from_name(name, period=7), fisher=Fisher("empirical", x, y),
                  options=dict(check_every=10))
        calls.clear()
        default = run_smp(net, "categorical", x, **kw)
        assert isinstance(as_chain_model(net, (1, 6, 6)), FusedSequentialChainModel)
        assert default.config["step_blocks"] is True and default.config["compiled_step"] is True
        assert len(calls) == 30 and all(calls)  # every step, taken by the kernel
        with monkeypatch.context() as patch:
            patch.setenv("SMP_CORE_FUSED", "0")
            plain_model = as_chain_model(net, (1, 6, 6))
            assert type(plain_model) is SequentialChainModel
            torch_path = run_smp(plain_model, "categorical", x, **_with(kw, cuda_graph=True))
        assert ((default.theta - plain_model.layout.flatten(net)).abs().amax(1) > 1e-3).all()  # every chain moved
        assert torch.allclose(default.theta, torch_path.theta, rtol=1e-9, atol=1e-11), name


def test_what_the_kernel_does_not_know_takes_the_general_path():
    fused, batched, theta, x, gen = _pair("odd")
    custom = ElementwiseRule(tensors=lambda state: (), apply_=lambda t, s, parts, g: t.add_(s, alpha=2 * float(g)))
    cotangent = torch.randn(theta.shape[0], 2, generator=gen, dtype=torch.float64)
    mine, ref = theta.clone(), theta.clone()
    fused.vjp_apply_(fused.forward(mine, x)[1], cotangent, mine, custom, (), 0.1)
    batched.vjp_apply_(batched.forward(ref, x)[1], cotangent, ref, custom, (), 0.1)
    assert torch.allclose(mine, ref, **TOL)

    class OwnLikelihood:
        name = "own"

    assert not fused.step_(theta, x, OwnLikelihood(), torch.zeros(theta.shape[0]), IDENTITY_RULE, (), 0.1)
    assert not fused.step_(theta, x, get_likelihood("bernoulli"), torch.zeros(theta.shape[0]), custom, (), 0.1)
    assert not fused.takes_whole_step(OwnLikelihood(), IDENTITY_RULE, "cpu")
    assert not fused.takes_whole_step(get_likelihood("bernoulli"), IDENTITY_RULE, "cuda")
    # the kernel computes in float32 and float64 only: half-precision chains take the torch path
    assert fused.takes_whole_step(get_likelihood("bernoulli"), IDENTITY_RULE, "cpu", torch.float64)
    assert not fused.takes_whole_step(get_likelihood("bernoulli"), IDENTITY_RULE, "cpu", torch.bfloat16)
    for layer in [nn.SiLU(), nn.AvgPool2d(2), nn.Dropout(0.1), nn.MaxPool2d(2, return_indices=True)]:
        net = nn.Sequential(nn.Conv2d(1, 2, 3), layer, nn.Flatten(), nn.Linear(18 if "Pool" in str(layer) else 72, 2))
        assert not fused_supported(net)
        if not isinstance(layer, nn.MaxPool2d):
            assert type(as_chain_model(net, (1, 8, 8))) is SequentialChainModel
    assert fused_supported(lenet5())


def test_turned_off_by_the_environment_without_a_warning(monkeypatch):
    monkeypatch.setenv("SMP_CORE_FUSED", "0")
    assert fused_unavailable() == "turned off by SMP_CORE_FUSED=0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert type(as_chain_model(lenet5(), (1, 28, 28))) is SequentialChainModel


def test_bad_input_gets_a_clear_error():
    fused, _, theta, x, _ = _pair("odd")
    with pytest.raises(ValueError, match="FusedSequentialChainModel supports"):
        FusedSequentialChainModel(nn.Sequential(nn.Conv2d(1, 2, 3), nn.SiLU()), (1, 5, 5))
    with pytest.raises(ValueError):
        fused.forward(theta, x[:2])  # rows of theta and x differ
    with pytest.raises(ValueError, match="CPU inputs of 242 values"):
        fused.forward(theta, x.reshape(4, -1)[:, :200])
    _, ctx = fused.forward(theta, x)
    with pytest.raises(ValueError, match=r"cotangent must have shape \(4, 2\)"):
        fused.vjp(ctx, torch.zeros(4, 3, dtype=torch.float64))
    gaussian, bernoulli = get_likelihood("gaussian", sigma=1.0), get_likelihood("bernoulli")
    with pytest.raises(ValueError, match=r"shape \(4, 2\)"):
        fused.step_(theta, x, gaussian, torch.zeros(4, dtype=torch.float64), IDENTITY_RULE, (), 0.1)
    with pytest.raises(ValueError, match="needs one output"):
        fused.step_(theta, x, bernoulli, torch.zeros(4, dtype=torch.float64), IDENTITY_RULE, (), 0.1)
    flat_less = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Linear(4, 3))  # a Linear on a 4-D input
    with pytest.raises(ValueError, match="add nn.Flatten"):
        FusedSequentialChainModel(flat_less, (1, 6, 6))
    assert type(as_chain_model(flat_less, (1, 6, 6))) is SequentialChainModel
    with pytest.raises(ValueError, match="one state row per chain"):
        fused.vjp_apply_(fused.forward(theta, x)[1], torch.zeros(theta.shape[0], 2), theta, ema_diagonal_rule(0.9, 0.1),
                         (torch.ones(1, theta.shape[1], dtype=torch.float64),), 0.1)
