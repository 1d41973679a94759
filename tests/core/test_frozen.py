"""Parameters with requires_grad=False are frozen: never sampled, left out of the layout."""

import pytest
import torch
from torch import nn

from smp_core import add_gaussian_tail, as_chain_model, predict
from smp_core.preconditioners import preconditioner_from_name
from smp_core.recursion import run_smp


def _pretrained_and_head():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    for p in net[0].parameters():
        p.requires_grad_(False)
    head = nn.Sequential(nn.Linear(4, 1)).double()
    head.load_state_dict({"0.weight": net[2].weight.detach(), "0.bias": net[2].bias.detach()})
    return net, head


@pytest.mark.parametrize("name", ["none", "fixed-diag", "ema-block", "fixed-dense", "periodic-kfac"])
def test_a_frozen_body_runs_as_its_head_alone_on_the_bodys_features(name):
    net, head = _pretrained_and_head()
    x = torch.rand(40, 2, dtype=torch.float64) * 2 - 1
    features = torch.tanh(net[0](x)).detach()
    frozen_before = [p.clone() for p in net[0].parameters()]
    kw = dict(tau=0.3, n_steps=30, n_chains=6, seed=5, progress=False,
              preconditioner=preconditioner_from_name(name, period=10, ridge=0.01))
    whole = run_smp(net, "bernoulli", x, **kw)
    alone = run_smp(head, "bernoulli", features, **kw)
    assert whole.theta.shape == (6, 5) and whole.config["d"] == 5
    assert torch.allclose(whole.theta, alone.theta, rtol=1e-10, atol=1e-12)
    assert all(torch.equal(a, b) for a, b in zip(frozen_before, net[0].parameters(), strict=True))
    # predictions and the Gaussian tail take the same five coordinates
    chain = as_chain_model(net)
    assert torch.allclose(predict(chain, whole.theta, x), predict(as_chain_model(head), alone.theta, features))
    tail = add_gaussian_tail(whole, net, "bernoulli", x, k_to=100, n_scores=20, seed=1)
    tail_alone = add_gaussian_tail(alone, head, "bernoulli", features, k_to=100, n_scores=20, seed=1)
    assert torch.allclose(tail, tail_alone, rtol=1e-10, atol=1e-12)


def test_a_module_with_every_parameter_frozen_is_refused():
    net = nn.Linear(2, 1)
    net.requires_grad_(False)
    with pytest.raises(ValueError, match="every parameter of the module has requires_grad=False"):
        run_smp(net, "bernoulli", torch.rand(5, 2), n_steps=2, n_chains=2, progress=False)


def test_kfac_refuses_a_partly_frozen_layer():
    net = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    net[2].bias.requires_grad_(False)
    with pytest.raises(ValueError, match="'2' is partly frozen"):
        run_smp(net, "bernoulli", torch.rand(5, 2), preconditioner="fixed-kfac", n_steps=2, n_chains=2,
                progress=False)
    assert run_smp(net, "bernoulli", torch.rand(5, 2), preconditioner="fixed-diag", n_steps=2, n_chains=2,
                   progress=False).theta.shape == (2, 12)
