"""The JAX reference of the toy recursion (benchmarks/jax_reference.py) against ``run_smp``: two independent
implementations, each with its own random numbers, so they are compared in distribution. Per variant, seven
statistics of the S chains at K, each a mean over chains with its Monte Carlo standard error from the
chains themselves: the parameter variance of each of the six blocks (the mean over chains of
``|theta_l,b - mean_b|^2``) and the summed variance of the logit at five inputs. Their difference over the
standard error of the difference is a z-score; with 7 statistics x 10 variants, |z| < 4 leaves a false alarm
rate of about 0.5 % for a run where both implementations agree.

Over K = 200 steps from near a MAP the periodic Fisher barely moves, so the comparison in distribution cannot
tell periodic from fixed; a second, deterministic test checks the recomputation itself: the reference's
``P_{K+1}^{-1}`` per chain against the inverse of smp_core's Fisher estimate at the reference's own theta_K."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from smp_book.toy import make_toy_data
from smp_core import preconditioners as pc
from smp_core import run_smp, toy_mlp
from smp_core.fisher import estimate_fisher, structure_for
from smp_core.likelihoods import Bernoulli
from smp_core.models import as_chain_model, predict

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import jax_reference as jr  # noqa: E402

VARIANTS = ["none", "fixed-diag", "fixed-block", "fixed-dense", "ema-diag", "ema-block", "ema-dense",
            "periodic-diag", "periodic-block", "periodic-dense"]
TAU = {"none": 1.0, "diag": 0.3, "block": 0.3, "dense": 0.1}  # the paper's (Section 3.2.3)
S, K, PERIOD = 300, 200, 50  # PERIOD < K: periodic recomputes its Fisher (see the module's docstring)
Z = 4.0


def toy_start():
    """The toy's training inputs and a network near a MAP, where the paper's taus keep every chain finite."""
    x, y = make_toy_data(500, seed=0)
    torch.manual_seed(0)
    net = toy_mlp()
    opt = torch.optim.Adam(net.parameters(), lr=0.03)
    for _ in range(300):
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(net(x)[:, 0], y).backward()
        opt.step()
    return x, net


@pytest.fixture(scope="module")
def setup():
    return toy_start()


def _statistics(net, theta: torch.Tensor, points: torch.Tensor) -> list[tuple[str, float, float]]:
    """``(name, mean, standard error)`` over chains of each block's ``|theta_l,b - mean_b|^2`` and of the summed
    squared logit deviations at ``points``."""
    model = as_chain_model(net)
    logits = predict(model, theta, points)[..., 0].double()
    parts = [(f"parameter variance of block {b}", theta[:, block].double())
             for b, block in enumerate(model.layout.block_slices)] + [("logit variance", logits)]
    out = []
    for name, values in parts:
        q = ((values - values.mean(0)) ** 2).sum(1) * len(values) / (len(values) - 1)
        out.append((name, float(q.mean()), float(q.std() / len(q) ** 0.5)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_jax_reference_agrees_with_run_smp_in_distribution(setup, variant):
    x, net = setup
    tau = TAU[variant.split("-")[-1]]
    strategy, _, structure = variant.partition("-")
    precond = ("none" if variant == "none" else pc.periodic(structure, period=PERIOD) if strategy == "periodic"
               else getattr(pc, strategy)(structure))
    ours = run_smp(net, "bernoulli", x, preconditioner=precond, tau=tau, n_steps=K, n_chains=S, seed=1,
                   progress=False)
    theta0 = as_chain_model(net).layout.flatten(net).detach().numpy()
    ref = jr.run(variant, x.numpy(), theta0, tau=tau, n_steps=K, n_chains=S, seed=2, period=PERIOD)
    assert ours.n_diverged == 0 and ref["non_finite"] == 0
    points = torch.tensor([[0.0, 0.0], [0.7, 0.0], [0.0, -0.7], [0.9, 0.9], [-0.5, 0.5]])
    pairs = zip(_statistics(net, ours.samples(), points),
                _statistics(net, torch.tensor(ref["theta"]), points), strict=True)
    for (what, a, se_a), (_, b, se_b) in pairs:
        z = (a - b) / np.hypot(se_a, se_b)
        assert abs(z) < Z, f"{variant}: {what} {a:.4g} (run_smp) against {b:.4g} (JAX), z = {z:.2f}"


@pytest.mark.parametrize("structure", ["diag", "block", "dense"])
def test_the_jax_reference_recomputes_the_periodic_fisher_at_each_chains_theta(setup, structure):
    """After K = 2 T steps the reference holds, per chain, the inverse of ``F(theta_K) + lambda I``: checked against
    smp_core's model-expected Fisher at the reference's own theta_K (float32 on both sides: 1e-3 relative)."""
    x, net = setup
    model = as_chain_model(net)
    theta0 = model.layout.flatten(net).detach().numpy()
    ref = jr.run(f"periodic-{structure}", x.numpy(), theta0, tau=0.3, n_steps=2 * PERIOD, n_chains=4, seed=3,
                 period=PERIOD, ridge=1e-4)
    theta = torch.tensor(ref["theta"])
    assert not torch.equal(theta[0], theta[1])  # the chains moved apart: one Fisher each
    struct = structure_for(model, structure)
    p = struct.to_dense(estimate_fisher(model, Bernoulli(), theta, x, structure=struct)).double()
    expected = torch.linalg.inv(p + 1e-4 * torch.eye(p.shape[-1], dtype=p.dtype))
    held = ref["held"]
    got = (torch.diag_embed(torch.tensor(held)) if structure == "diag"
           else torch.stack([torch.block_diag(*(torch.tensor(m[c]) for m in held)) for c in range(len(theta))]))
    scale = expected.abs().amax(dim=(1, 2), keepdim=True)
    assert torch.allclose(got.double() / scale, expected / scale, rtol=0, atol=1e-3)
