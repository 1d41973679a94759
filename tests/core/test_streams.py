"""Random streams per chain: chain i's trajectory depends only on the seed and i."""

import math

import pytest
import torch
from torch import nn

from smp_core.likelihoods import get_likelihood
from smp_core.models import toy_mlp
from smp_core.preconditioners import preconditioner_from_name
from smp_core.recursion import run_smp
from smp_core.streams import COVARIATE, RESPONSE, ChainStreams, check_seed, mix64


def _with(kw, **options):
    """``kw`` with more run options (fields of smp_core.RunOptions) merged into its ``options``."""
    return {**kw, "options": {**kw.get("options", {}), **options}}


def _splitmix64(z: int) -> int:
    m = 2**64
    z = (z + 0x9E3779B97F4A7C15) % m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % m
    return z ^ (z >> 31)


def test_mix64_is_splitmix64_in_wrapping_int64():
    values = [0, 1, -1, 2**63 - 1, -(2**63), 123456789, -987654321] + list(range(-500, 500, 7))
    got = mix64(torch.tensor(values)).tolist()
    assert [g % 2**64 for g in got] == [_splitmix64(v % 2**64) for v in values]


def test_uniforms_normals_and_covariates_have_their_laws():
    s = ChainStreams(7, 0, 50)
    n = 4000 * 50
    u = s.uniforms(RESPONSE, 1, 4000, 1, "cpu").flatten()
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) / math.sqrt(1 / 12 / n) < 4.5
    assert abs(float((u ** 2).mean()) - 1 / 3) / math.sqrt((1 / 5 - 1 / 9) / n) < 4.5
    z = s.normals(RESPONSE, 1, 4000, 1, "cpu").flatten()
    assert abs(float(z.mean())) / math.sqrt(1 / n) < 4.5
    assert abs(float((z ** 2).mean()) - 1) / math.sqrt(2 / n) < 4.5
    idx = s.covariates(1, 4000, 7, "cpu").flatten()
    counts = torch.bincount(idx, minlength=7).double()
    chi2 = float(((counts - n / 7) ** 2 / (n / 7)).sum())
    assert chi2 < 6 + 4.5 * math.sqrt(12)  # 6 degrees of freedom: mean 6, sd sqrt(12)
    # neighbouring chains, steps and purposes are uncorrelated
    a = s.uniforms(COVARIATE, 1, 4000, 1, "cpu")[..., 0]
    for other in (a[:, 1:], a[1:], s.uniforms(RESPONSE, 1, 4000, 1, "cpu")[..., 0]):
        x, y = a[: other.shape[0], : other.shape[1]].flatten(), other.flatten()
        r = float(torch.corrcoef(torch.stack([x, y]))[0, 1])
        assert abs(r) * math.sqrt(x.numel()) < 4.5


def test_a_chains_draws_do_not_depend_on_the_other_chains_or_the_blocks():
    whole = ChainStreams(3, 0, 10)
    part = ChainStreams(3, 4, 5)
    assert torch.equal(whole.uniforms(RESPONSE, 1, 12, 3, "cpu")[:, 4:9], part.uniforms(RESPONSE, 1, 12, 3, "cpu"))
    one_go = whole.covariates(1, 12, 30, "cpu")
    assert torch.equal(one_go, torch.cat([whole.covariates(1, 5, 30, "cpu"), whole.covariates(6, 7, 30, "cpu")]))
    assert not torch.equal(one_go, ChainStreams(4, 0, 10).covariates(1, 12, 30, "cpu"))


def test_seeds_are_integers_in_range():
    import numpy as np

    assert check_seed(np.int64(5)) == 5 and check_seed(torch.tensor(5)) == 5
    for bad in (1.5, 5.0, True, -1, 2**63, "3", torch.Generator(), np.float64(2)):
        with pytest.raises(ValueError, match="seed"):
            check_seed(bad)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 3)).double()


@pytest.mark.parametrize("name, network, cuda_graph", [
    ("none", "mlp", False), ("fixed-diag", "mlp", False), ("ema-block", "mlp", False),
    ("periodic-dense", "mlp", False), ("ema-kfac", "mlp", False), ("fixed-diag", "mlp", True),
    ("none", "cnn", None), ("periodic-diag", "cnn", None), ("ema-diag", "cnn", False),
    ("fixed-diag", "gaussian", False), ("periodic-block", "cnn", None), ("fixed-diag", "layernorm-gelu", False),
    ("none", "layernorm-gelu", False),
])
def test_a_run_equals_its_chain_ranges_run_apart(name, network, cuda_graph):
    # S chains in one run against the concatenation of two runs over chains 0..6 and 7..S-1 with the same seed
    # (float64), on the step-by-step loop, the step blocks and the compiled step (cnn, None): bit for bit, or to
    # rounding, exactly as the list in smp_core.streams' docstring says
    if network == "layernorm-gelu":  # the general autograd path, with kernels that round by the batch's size
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(2, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 1)).double()
        lik, x = "bernoulli", torch.rand(30, 2, dtype=torch.float64) * 2 - 1
    elif network == "cnn":
        net, lik, x = _cnn(), "categorical", torch.rand(30, 1, 6, 6, dtype=torch.float64)
    elif network == "gaussian":
        net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        lik, x = get_likelihood("gaussian", sigma=0.3), torch.rand(30, 2, dtype=torch.float64)
    else:
        torch.manual_seed(0)
        net, lik, x = toy_mlp().double(), "bernoulli", torch.rand(30, 2, dtype=torch.float64) * 2 - 1
    kw = dict(tau=0.3, n_steps=25, seed=9, progress=False,
              preconditioner=preconditioner_from_name(name, period=10, ridge=0.01),
              options=dict(check_every=10, cuda_graph=cuda_graph))
    whole = run_smp(net, lik, x, n_chains=12, **kw)
    head = run_smp(net, lik, x, n_chains=7, **kw)
    tail = run_smp(net, lik, x, n_chains=5, **_with(kw, first_chain=7))
    assert whole.n_diverged == 0 and whole.config["first_chain"] == 0 and tail.config["first_chain"] == 7
    apart = torch.cat([head.theta, tail.theta])
    if (name == "none" or name.endswith("-diag")) and network != "layernorm-gelu":
        assert torch.equal(whole.theta, apart)
    else:
        # MKL's batched matrix products and eigh choose their kernels by the batch's size (a 9 x 9 batch of
        # 12 and one of 7 round differently, even on one thread), and so do LayerNorm's and GELU's: the
        # docstring's bound, 1e-12 relative to the largest entry after 25 steps (measured: at most 3e-15)
        assert (whole.theta - apart).abs().max() <= 1e-12 * whole.theta.abs().max()
    assert not torch.equal(head.theta[:5], tail.theta)  # the chains differ


def test_streams_of_other_seeds_share_no_chain():
    # (seed, chain) pairs must not collide: seed a's chain b is not seed b's chain a, nor chain s of seed s
    # the same stream for every s (a symmetric key would make both true)
    firsts = torch.cat([ChainStreams(seed, 0, 10).uniforms(RESPONSE, 1, 3, 2, "cpu").permute(1, 0, 2).reshape(10, -1)
                        for seed in range(10)])
    assert torch.unique(firsts, dim=0).shape[0] == 100
    a, b = ChainStreams(1, 0, 3).covariates(1, 50, 1000, "cpu"), ChainStreams(2, 0, 3).covariates(1, 50, 1000, "cpu")
    assert not torch.equal(a[:, 2], b[:, 1]) and not torch.equal(a[:, 1], b[:, 2])


def test_float32_classifier_noise_stays_below_one():
    from smp_core.likelihoods import Bernoulli

    u = torch.tensor([[0.5], [1 - 2.0**-60], [1 - 2.0**-30]], dtype=torch.float64)
    noise = Bernoulli().noise_from_uniforms(u, torch.float32)
    assert noise.dtype == torch.float32 and float(noise.max()) < 1.0
    assert bool(Bernoulli().sample_from_noise(torch.full((3, 1), 30.0), noise).eq(1).all())  # p = 1 in float32
