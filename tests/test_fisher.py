import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

import smp_core.fisher as fisher_module
from smp_core.fisher import _fisher_example_by_example as example_by_example
from smp_core.fisher import estimate_fisher
from smp_core.likelihoods import Bernoulli, Categorical, Gaussian
from smp_core.models import as_chain_model, toy_mlp
from smp_core.preconditioners import Structure


def _jacobian(model, theta, x):
    """d g(x_i, theta) / d theta for every input: (n, m, d), by torch.func.jacrev."""

    def g(t):
        return functional_call(model.module, model.layout.unflatten(t), (x,)).reshape(x.shape[0], -1)

    return jacrev(g)(theta)


def test_model_expected_fisher_bernoulli_matches_the_papers_formula(generator):
    # Section 3.2.3: I = 1/N sum p (1 - p) grad g grad g^T
    model = as_chain_model(toy_mlp().double())
    theta = model.layout.flatten(model.module)
    x = torch.rand(40, 2, generator=generator, dtype=torch.float64) * 2 - 1
    jac = _jacobian(model, theta, x)[:, 0, :]
    p = torch.sigmoid(functional_call(model.module, model.layout.unflatten(theta), (x,))[:, 0])
    expected = torch.einsum("n,ni,nj->ij", p * (1 - p), jac, jac) / x.shape[0]
    (dense,) = estimate_fisher(model, Bernoulli(), theta, x, kind="model", structure="dense", max_rows=7)
    assert torch.allclose(dense[0], expected, atol=1e-12)
    (diag,) = estimate_fisher(model, Bernoulli(), theta, x, kind="model", structure="diag")
    assert torch.allclose(diag[0], torch.diagonal(expected), atol=1e-12)
    blocks = estimate_fisher(model, Bernoulli(), theta, x, kind="model", structure="block")
    struct = Structure("block", 20, model.layout.block_slices)
    assert torch.allclose(struct.to_dense(blocks)[0], expected * (struct.to_dense(blocks)[0] != 0), atol=1e-12)
    assert len(blocks) == 6


def test_model_expected_fisher_categorical_is_the_expected_score_outer_product(generator):
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    model = as_chain_model(net)
    theta = model.layout.flatten(net)
    x = torch.randn(10, 3, generator=generator, dtype=torch.float64)
    jac = _jacobian(model, theta, x)  # (n, m, d)
    pi = torch.softmax(net(x), -1)
    lam = torch.diag_embed(pi) - pi.unsqueeze(-1) * pi.unsqueeze(-2)
    expected = torch.einsum("nmi,nmk,nkj->ij", jac, lam, jac) / x.shape[0]
    (dense,) = estimate_fisher(model, Categorical(), theta, x, kind="model", structure="dense")
    assert torch.allclose(dense[0], expected, atol=1e-12)


def test_empirical_fisher_is_the_mean_squared_observed_score(generator):
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3)).double()
    model = as_chain_model(net)
    theta = model.layout.flatten(net)
    x = torch.randn(12, 3, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (12,), generator=generator)
    scores = []
    for xi, yi in zip(x, y, strict=True):
        t = theta.clone().requires_grad_(True)
        logp = torch.log_softmax(functional_call(net, model.layout.unflatten(t), (xi[None],)), -1)[0, yi]
        scores.append(torch.autograd.grad(logp, t)[0])
    scores = torch.stack(scores)
    (diag,) = estimate_fisher(model, Categorical(), theta, x, y, kind="empirical", structure="diag")
    assert torch.allclose(diag[0], (scores**2).mean(0), atol=1e-12)


def test_per_chain_fisher_equals_one_chain_at_a_time(generator):
    model = as_chain_model(toy_mlp().double())
    thetas = model.layout.flatten(model.module) + 0.3 * torch.randn(3, 20, generator=generator, dtype=torch.float64)
    x = torch.rand(25, 2, generator=generator, dtype=torch.float64)
    (together,) = estimate_fisher(model, Bernoulli(), thetas, x, structure="dense", max_rows=16)
    for c in range(3):
        (alone,) = estimate_fisher(model, Bernoulli(), thetas[c], x, structure="dense")
        assert torch.allclose(together[c], alone[0], atol=1e-12)


@pytest.mark.parametrize("structure", ["diag", "dense"])
def test_empirical_fisher_of_a_multi_output_gaussian_for_several_chains(structure, generator):
    # y of shape (n, m): each chain's rows must pair with the same responses as its inputs
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model = as_chain_model(net)
    thetas = model.layout.flatten(net) + 0.3 * torch.randn(3, model.layout.dim, generator=generator,
                                                             dtype=torch.float64)
    x = torch.randn(10, 3, generator=generator, dtype=torch.float64)
    y = torch.randn(10, 2, generator=generator, dtype=torch.float64)
    lik = Gaussian(0.5)
    (together,) = estimate_fisher(model, lik, thetas, x, y, kind="empirical", structure=structure)
    for c in range(3):
        scores = []
        for xi, yi in zip(x, y, strict=True):
            t = thetas[c].clone().requires_grad_(True)
            out = functional_call(net, model.layout.unflatten(t), (xi[None],))
            scores.append(torch.autograd.grad(lik.log_prob(out, yi[None]).sum(), t)[0])
        scores = torch.stack(scores)
        expected = (scores**2).mean(0) if structure == "diag" else scores.T @ scores / len(scores)
        assert torch.allclose(together[c], expected, atol=1e-12)


def test_fisher_errors():
    model = as_chain_model(toy_mlp())
    theta = model.layout.flatten(model.module)
    with pytest.raises(ValueError, match="needs labels"):
        estimate_fisher(model, Bernoulli(), theta, torch.zeros(3, 2), kind="empirical", structure="diag")
    with pytest.raises(ValueError, match="NaN"):
        estimate_fisher(model, Bernoulli(), theta, torch.full((3, 2), float("nan")), structure="diag")
    with pytest.raises(ValueError, match="unknown Fisher kind"):
        estimate_fisher(model, Bernoulli(), theta, torch.zeros(3, 2), kind="observed", structure="diag")


@pytest.mark.parametrize("structure", ["diag", "block", "dense"])
@pytest.mark.parametrize("kind", ["model", "empirical"])
def test_example_by_example_path_equals_virtual_rows(structure, kind, generator, monkeypatch):
    # many chains of a large model take the examples one at a time; the result must not change
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)).double()
    model = as_chain_model(net, (1, 6, 6))
    thetas = model.layout.flatten(net) + 0.3 * torch.randn(4, model.layout.dim, generator=generator,
                                                             dtype=torch.float64)
    x = torch.rand(40, 1, 6, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (40,), generator=generator)
    calls = []
    monkeypatch.setattr(fisher_module, "_fisher_example_by_example",
                        lambda *a: calls.append(1) or example_by_example(*a))
    # the empirical diagonal would take the by-layers path (tested on its own below): this test is for the others
    monkeypatch.setattr(fisher_module, "diagonal_empirical_fisher_by_layers", lambda *a, **k: None)
    batched = estimate_fisher(model, Categorical(), thetas, x, y, kind=kind, structure=structure)
    assert not calls  # 40 examples x 4 chains fit in one virtual batch
    one_by_one = estimate_fisher(model, Categorical(), thetas, x, y, kind=kind, structure=structure, max_rows=8)
    assert calls  # 8 rows for 4 chains: 2 examples per pass, below the threshold
    assert len(batched) == len(one_by_one)
    for a, b in zip(batched, one_by_one, strict=True):
        assert a.shape[0] == 4
        assert torch.allclose(a, b, atol=1e-12)


class _TiedDecoder(nn.Module):
    """An encoder whose weight is used again, transposed, outside the layer (weight tying)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(3, 2)

    def forward(self, x):
        return nn.functional.linear(torch.tanh(self.enc(x)), self.enc.weight.t())


class _DoubledLinear(nn.Linear):
    def forward(self, x):
        return nn.functional.linear(x, 2 * self.weight, self.bias)


class _Twice(nn.Module):
    """One Linear layer used twice per input (shared weights): the by-layers path must decline."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.a(torch.tanh(self.a(x)))))


def _cnn(in_place):
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, stride=2), nn.ReLU(inplace=in_place),
                         nn.Conv2d(3, 2, (3, 2), dilation=(1, 2), bias=False), nn.ReLU(), nn.Flatten(),
                         nn.Linear(2 * 2 * 2, 4))


@pytest.mark.parametrize(
    "module, shape, lik",
    [
        (_cnn(False), (2, 8, 8), Categorical()),
        (_cnn(True), (2, 8, 8), Categorical()),  # in-place ReLU after a recorded layer output
        (toy_mlp().double(), (2,), Bernoulli()),
        (nn.Sequential(nn.Linear(3, 5), nn.GELU(), nn.Linear(5, 3, bias=False)), (3,), Categorical()),
        (_cnn(False).double(), (2, 8, 8), Categorical()),
        (nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), (3,), Gaussian(0.7)),  # 2 outputs
    ],
)
@pytest.mark.parametrize("chains", [1, 3])
def test_diagonal_empirical_fisher_by_layers_equals_the_per_example_gradients(module, shape, lik, chains, generator):
    from smp_core.fisher import diagonal_empirical_fisher_by_layers

    dtype = next(module.parameters()).dtype
    model = as_chain_model(module, shape)
    theta = model.layout.flatten(module) + 0.3 * torch.randn(chains, model.layout.dim, generator=generator,
                                                             dtype=dtype)
    n = 13
    x = torch.randn(n, *shape, generator=generator, dtype=dtype)
    y = torch.randint(0, 2, (n,), generator=generator)
    if isinstance(lik, Gaussian):
        y = torch.randn(n, 2, generator=generator, dtype=dtype)
    # the reference: every per-example score by autograd, squared and averaged
    expected = torch.zeros(chains, model.layout.dim, dtype=dtype)
    for c in range(chains):
        for i in range(n):
            t = theta[c].clone().requires_grad_(True)
            out = functional_call(module, model.layout.unflatten(t), (x[i : i + 1],)).reshape(1, -1)
            (grad,) = torch.autograd.grad(lik.log_prob(out, y[i : i + 1]).sum(), t)
            expected[c] += grad * grad / n
    (diag,) = diagonal_empirical_fisher_by_layers(model, lik, theta, x, y, batch_size=5)  # batches of 5, 5, 3
    assert torch.allclose(diag, expected, rtol=1e-5, atol=1e-9)
    assert (diag > 0).sum() > model.layout.dim // 2  # not trivially zero
    # so few numbers allowed per pass that the examples go one at a time: the same result
    (small,) = diagonal_empirical_fisher_by_layers(model, lik, theta, x, y, max_elements=1)
    assert torch.allclose(small, expected, rtol=1e-5, atol=1e-9)
    if chains > 1 and isinstance(lik, Gaussian):
        return  # the virtual-rows path takes one label per example (a different matter)
    (general,) = fisher_module.estimate_fisher(model, lik, theta, x, y, kind="empirical", structure="diag")
    assert torch.allclose(general, expected, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("chains, max_rows, path", [(1, 2**16, "by layers"), (4, 8, "by layers"), (4, 2**16, "other")])
def test_estimate_fisher_takes_the_by_layers_path_for_one_chain_or_instead_of_one_example_at_a_time(
        chains, max_rows, path, generator, monkeypatch):
    module = _cnn(False)
    model = as_chain_model(module, (2, 8, 8))
    theta = model.layout.flatten(module).expand(chains, -1)
    x, y = torch.randn(40, 2, 8, 8, generator=generator), torch.randint(0, 4, (40,), generator=generator)
    calls = []
    original = fisher_module.diagonal_empirical_fisher_by_layers
    monkeypatch.setattr(fisher_module, "diagonal_empirical_fisher_by_layers",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    fisher_module.estimate_fisher(model, Categorical(), theta, x, y, kind="empirical", structure="diag",
                                  max_rows=max_rows)
    assert bool(calls) == (path == "by layers")
    calls.clear()
    fisher_module.estimate_fisher(model, Categorical(), theta, x, y, kind="model", structure="diag", max_rows=max_rows)
    assert not calls  # only the empirical Fisher


@pytest.mark.parametrize(
    "module, shape",
    [
        (_Twice(), (3,)),  # a layer that runs twice
        (nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)), (3,)),  # a parameter outside the layers
        (nn.Sequential(nn.Conv2d(2, 2, 3, groups=2), nn.Flatten(), nn.Linear(8, 2)), (2, 4, 4)),  # grouped conv
        (nn.Sequential(nn.Linear(3, 2)), (4, 3)),  # a linear layer on 2-D inputs per example
        (_TiedDecoder(), (3,)),  # a weight that also enters the output outside its layer's call
        (nn.Sequential(_DoubledLinear(3, 4), nn.Tanh(), nn.Linear(4, 2)), (3,)),  # a subclass changes forward
        # batch statistics would mix examples (train mode); in eval mode too it is not a hand-batched network
        (nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, affine=False), nn.Linear(4, 2)).eval(), (3,)),
    ],
)
def test_diagonal_empirical_fisher_by_layers_declines_what_it_cannot_do(module, shape, generator):
    from smp_core.fisher import diagonal_empirical_fisher_by_layers

    model = as_chain_model(module, shape)
    theta = model.layout.flatten(module).unsqueeze(0)
    x = torch.randn(6, *shape, generator=generator)
    y = torch.randint(0, 2, (6,), generator=generator)
    buffers = {k: v.clone() for k, v in module.state_dict().items()}
    assert diagonal_empirical_fisher_by_layers(model, Categorical(), theta, x, y) is None
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in buffers.items())  # the module is left alone


def test_diagonal_empirical_fisher_by_layers_declines_integer_inputs():
    from smp_core.fisher import diagonal_empirical_fisher_by_layers

    module = nn.Sequential(nn.Linear(3, 2))
    model = as_chain_model(module, (3,))
    x, y = torch.randint(0, 3, (5, 3)), torch.randint(0, 2, (5,))
    assert diagonal_empirical_fisher_by_layers(model, Categorical(), model.layout.flatten(module), x, y) is None
