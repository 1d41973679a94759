import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

import smp_core.fisher as fisher_module
from smp_core.fisher import _fisher_example_by_example as example_by_example
from smp_core.fisher import estimate_fisher
from smp_core.likelihoods import Bernoulli, Categorical, Gaussian
from smp_core.models import as_chain_model, toy_mlp
from smp_core.preconditioners import KFAC, Blocks, make_structure


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
    struct = Blocks(20, model.layout.block_slices)
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_virtual_rows_equal_the_by_layers_path_and_the_cpu():
    from smp_core import lenet5
    from smp_core.fisher import diagonal_empirical_fisher_by_layers

    torch.manual_seed(0)
    net = lenet5()
    cpu_model = as_chain_model(net, (1, 28, 28))
    theta = cpu_model.layout.flatten(net) + 0.01 * torch.randn(40, cpu_model.layout.dim)
    x, y = torch.rand(100, 1, 28, 28), torch.randint(0, 10, (100,))
    model = as_chain_model(lenet5().cuda(), (1, 28, 28))
    (gpu,) = fisher_module.estimate_fisher(model, Categorical(), theta.cuda(), x.cuda(), y.cuda(), kind="empirical",
                                           structure="diag")
    (layers,) = diagonal_empirical_fisher_by_layers(model, Categorical(), theta.cuda(), x.cuda(), y.cuda())
    (cpu,) = fisher_module.estimate_fisher(cpu_model, Categorical(), theta, x, y, kind="empirical", structure="diag")
    torch.testing.assert_close(gpu, layers, rtol=1e-4, atol=1e-6 * float(layers.abs().max()))
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-6 * float(cpu.abs().max()))


def test_a_gpu_keeps_the_virtual_rows_where_a_cpu_takes_the_examples_one_at_a_time():
    from smp_core.fisher import _MIN_VIRTUAL_BATCH, _path

    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device name: no GPU is needed to decide
    assert _path(100, 14, 6000, cpu) == "one example at a time"  # LeNet-5's passes at 2^26 elements
    assert _path(100, 14, 6000, cuda) == "virtual rows"
    assert _path(100, _MIN_VIRTUAL_BATCH, 6000, cpu) == _path(1, 1, 6000, cpu) == "virtual rows"
    assert _path(100, 5, 5, cpu) == "virtual rows"  # every example in one pass


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


# --- kfac -----------------------------------------------------------------------------------------


def _cotangents(lik, out, y, kind):
    """What is pulled back from the output ``out`` (one example): the residual (empirical Fisher) or
    the columns of ``L`` with ``L L^T`` the likelihood's output Fisher (model-expected)."""
    if kind == "empirical":
        return [lik.residual(out.detach(), y)]
    factor = lik.fisher_factor(out.detach())
    return [factor[..., c] for c in range(factor.shape[-1])]


def _exact_layer_blocks(model, lik, theta, x, y, kind):
    """The exact Fisher (one chain) by per-example autograd, dense ``(d, d)``."""
    dense = torch.zeros(model.layout.dim, model.layout.dim, dtype=theta.dtype)
    for i in range(x.shape[0]):
        t = theta.clone().requires_grad_(True)
        out = functional_call(model.module, model.layout.unflatten(t), (x[i : i + 1],)).reshape(1, -1)
        cotangents = _cotangents(lik, out, y[i : i + 1], kind)
        for c, cot in enumerate(cotangents):
            (grad,) = torch.autograd.grad(out, t, cot, retain_graph=c < len(cotangents) - 1)
            dense += torch.outer(grad, grad) / x.shape[0]
    return dense


@pytest.mark.parametrize(
    "module, shape, lik, kind",
    [
        (toy_mlp().double(), (2,), Bernoulli(), "model"),
        (nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3, bias=False)).double(), (3,), Categorical(), "model"),
        (nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double(), (3,), Categorical(), "empirical"),
        # convolutions with one output position each: linear layers on their patch, so exact too
        (nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 2, 1), nn.Flatten(), nn.Linear(2, 3)).double(),
         (2, 3, 3), Categorical(), "empirical"),
    ],
)
def test_kfac_of_one_example_is_the_exact_fisher_on_each_layer(module, shape, lik, kind, generator):
    # for one example the layer's Fisher block is (g g^T) (x) (a a^T): KFAC loses nothing there
    from smp_core.fisher import kronecker_layers

    model = as_chain_model(module, shape)
    theta = model.layout.flatten(module) + 0.3 * torch.randn(model.layout.dim, generator=generator, dtype=torch.float64)
    x = torch.randn(1, *shape, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 2, (1,), generator=generator)
    stat = estimate_fisher(model, lik, theta, x, y, kind=kind, structure="kfac")
    struct = KFAC(model.layout.dim, kronecker_layers(model))
    kron = struct.to_dense(stat)[0]
    exact = _exact_layer_blocks(model, lik, theta, x, y, kind)
    for layer in struct.layers:
        idx = layer.positions()
        assert torch.allclose(kron[idx][:, idx], exact[idx][:, idx], rtol=1e-8, atol=1e-12)
    mask = torch.zeros_like(exact, dtype=torch.bool)
    for layer in struct.layers:
        idx = layer.positions()
        mask[idx[:, None], idx[None, :]] = True
    assert (kron[~mask] == 0).all() and exact[~mask].abs().max() > 0  # the cross-layer terms are dropped


def test_kfac_of_a_linear_gaussian_model_is_its_whole_fisher(generator):
    # y = W [x, 1] + sigma eps: the model-expected Fisher is (I / sigma^2) (x) mean([x, 1][x, 1]^T) for any n
    module = nn.Sequential(nn.Linear(3, 2)).double()
    model = as_chain_model(module)
    x = torch.randn(40, 3, generator=generator, dtype=torch.float64)
    theta = model.layout.flatten(module)
    kfac = estimate_fisher(model, Gaussian(0.4), theta, x, kind="model", structure="kfac")
    (dense,) = estimate_fisher(model, Gaussian(0.4), theta, x, kind="model", structure="dense")
    struct = KFAC(model.layout.dim, fisher_module.kronecker_layers(model))
    assert torch.allclose(struct.to_dense(kfac), dense, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["model", "empirical"])
def test_kfac_factors_of_a_convolution_by_brute_force(kind, generator):
    # KFAC-expand for Conv2d: A = mean over examples and positions of a_it a_it^T (patches, a 1 for the
    # bias), G = (1/n) sum over examples, positions and columns c of g_itc g_itc^T; here from F.unfold and
    # an autograd pass through a hand-written conv, per example and chain
    module = _cnn(False).double()
    model = as_chain_model(module, (2, 8, 8))
    theta = model.layout.flatten(module) + 0.2 * torch.randn(2, model.layout.dim, generator=generator,
                                                             dtype=torch.float64)
    n = 5
    x = torch.randn(n, 2, 8, 8, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 4, (n,), generator=generator)
    lik = Categorical()
    stat = estimate_fisher(model, lik, theta, x, y, kind=kind, structure="kfac")
    for chain in range(2):
        params = model.layout.unflatten(theta[chain])
        a_sum, g_sum = torch.zeros(19, 19, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.float64)
        for i in range(n):
            patches = nn.functional.unfold(x[i : i + 1], 3, padding=1, stride=2)[0].T  # (T, 18)
            patches = torch.cat([patches, torch.ones(patches.shape[0], 1, dtype=torch.float64)], dim=1)
            a_sum += patches.T @ patches / patches.shape[0]
            pre = (patches @ torch.cat([params["0.weight"].reshape(3, -1), params["0.bias"][:, None]], 1).T)
            pre = pre.T.reshape(1, 3, 4, 4).detach().requires_grad_(True)
            tail = nn.Sequential(*list(module)[1:])  # its layer i is the module's layer i + 1
            renamed = {f"{int(k.split('.')[0]) - 1}.{k.split('.')[1]}": v for k, v in params.items()
                       if not k.startswith("0.")}
            out = functional_call(tail, renamed, (pre,))
            cotangents = _cotangents(lik, out, y[i : i + 1], kind)
            for c, cot in enumerate(cotangents):
                (g,) = torch.autograd.grad(out, pre, cot, retain_graph=c < len(cotangents) - 1)
                g = g[0].reshape(3, -1).T  # (T, 3)
                g_sum += g.T @ g
        assert torch.allclose(stat[0][chain], a_sum / n, rtol=1e-10, atol=1e-12)
        assert torch.allclose(stat[1][chain], g_sum / n, rtol=1e-8, atol=1e-12)
    # one chain at a time gives the same rows, and so do batches of 2 examples (sums across batches)
    alone = estimate_fisher(model, lik, theta[1], x, y, kind=kind, structure="kfac")
    assert all(torch.allclose(m[1:], one, rtol=1e-12, atol=0) for m, one in zip(stat, alone, strict=True))
    batched = fisher_module.kronecker_fisher(model, lik, theta, x, y, kind=kind, batch_size=2)
    assert all(torch.allclose(m, b, rtol=1e-10, atol=1e-14) for m, b in zip(stat, batched, strict=True))


@pytest.mark.parametrize(
    "module, shape, match",
    [
        (_Twice(), (3,), "called once"),
        (nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)), (3,), "outside Linear and Conv2d"),
        (nn.Sequential(nn.Conv2d(2, 2, 3, groups=2), nn.Flatten(), nn.Linear(8, 2)), (2, 4, 4), "groups"),
        # rows that are not the examples: the hand-batched MLP takes inputs of 3 values
        (nn.Sequential(nn.Linear(3, 2)), (4, 3), r"inputs of shape \(4, 3\), the model takes inputs of shape \(3,\)"),
        (nn.Sequential(_DoubledLinear(3, 4), nn.Tanh(), nn.Linear(4, 2)), (3,), "subclass"),
    ],
)
def test_kfac_refuses_what_it_cannot_factor_with_a_clear_error(module, shape, match, generator):
    model = as_chain_model(module, shape)
    x = torch.randn(6, *shape, generator=generator)
    with pytest.raises(ValueError, match=match):
        estimate_fisher(model, Categorical(), model.layout.flatten(module), x, structure="kfac")


def test_kfac_leaves_the_modules_buffers_alone(generator):
    # a user's module (not an nn.Sequential the models batch by hand) that updates a buffer as it runs
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls += 1
            return self.b(torch.tanh(self.a(x)))

    module = Net()
    model = as_chain_model(module, (3,))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    stat = estimate_fisher(model, Categorical(), model.layout.flatten(module), torch.randn(8, 3, generator=generator),
                           structure="kfac")
    assert len(stat) == 4 and all(torch.isfinite(m).all() for m in stat)
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("lik, outputs", [(Categorical(), 3), (Gaussian(0.7), 2), (Bernoulli(), 1)])
@pytest.mark.parametrize("chains", [1, 2])
def test_model_expected_diagonal_by_layers_equals_the_general_path(lik, outputs, chains, generator):
    """The model-expected (GGN) diagonal layer by layer against the per-example vectors of fisher_vectors."""
    from smp_core.fisher import diagonal_fisher_by_layers

    torch.manual_seed(1234)  # the layers' initialisation: not whatever the tests run before left (a dead ReLU)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, outputs)).double()
    model = as_chain_model(net, (1, 6, 6))
    theta = model.layout.flatten(net) + 0.3 * torch.randn(chains, model.layout.dim, generator=generator,
                                                          dtype=torch.float64)
    x = torch.rand(23, 1, 6, 6, generator=generator, dtype=torch.float64)
    (general,) = estimate_fisher(model, lik, theta, x, kind="model", structure="diag")
    (by_layers,) = diagonal_fisher_by_layers(model, lik, theta, x, kind="model", batch_size=5)
    torch.testing.assert_close(by_layers, general, rtol=1e-10, atol=1e-13)
    assert (general > 0).sum() >= 10  # not trivially zero (the ReLU silences some units)
    with pytest.raises(ValueError, match="needs labels"):
        diagonal_fisher_by_layers(model, lik, theta, x, kind="empirical")
    with pytest.raises(ValueError, match="unknown Fisher kind"):
        diagonal_fisher_by_layers(model, lik, theta, x, kind="observed")


@pytest.mark.parametrize("structure", ["diag", "dense", "kfac"])
def test_the_empirical_fisher_refuses_labels_its_likelihood_cannot_have(structure):
    """A label in {-1, +1} for a Bernoulli, or 1.7 for a categorical, gave a finite, wrong Fisher."""
    x = torch.rand(12, 2)
    binary = as_chain_model(toy_mlp())
    theta = binary.layout.flatten(binary.module)
    with pytest.raises(ValueError, match="0 or 1"):
        estimate_fisher(binary, Bernoulli(), theta, x, torch.tensor([1.0, -1.0]).repeat(6),
                        kind="empirical", structure=structure)
    three = as_chain_model(nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)))
    theta3 = three.layout.flatten(three.module)
    with pytest.raises(ValueError, match="integer class labels"):
        estimate_fisher(three, Categorical(), theta3, x, torch.full((12,), 1.7), kind="empirical",
                        structure=structure)
    with pytest.raises(ValueError, match="one output per class"):
        estimate_fisher(binary, Categorical(), theta, x, kind="model", structure=structure)
    dropout = as_chain_model(nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Dropout(0.2), nn.Linear(4, 3)))
    with pytest.raises(ValueError, match="Dropout layers in training mode"):
        estimate_fisher(dropout, Categorical(), dropout.layout.flatten(dropout.module), x, kind="model",
                        structure=structure)


@pytest.mark.parametrize("structure", ["diag", "block", "dense", "kfac"])
@pytest.mark.parametrize("kind", ["model", "empirical"])
@pytest.mark.parametrize("max_rows", [2**16, 8])  # virtual rows, and one example at a time
def test_a_float64_statistic_sums_the_float32_vectors_in_float64(structure, kind, max_rows, generator):
    """``dtype=torch.float64``: the statistic of float32 parameters comes back in float64; it is the
    float32 path's statistic up to float32 rounding, and exactly the float64 sum of the float32
    per-example vectors (the reference builds that sum by hand) except where the statistic comes from
    another path: kfac's factors, and the empirical diagonal by layers, which sums in float32 and casts."""
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    model = as_chain_model(net, (1, 6, 6))
    thetas = model.layout.flatten(net) + 0.3 * torch.randn(2, model.layout.dim, generator=generator)
    x = torch.rand(20, 1, 6, 6, generator=generator)
    y = torch.randint(0, 3, (20,), generator=generator)
    lik = Categorical()
    single = estimate_fisher(model, lik, thetas, x, y, kind=kind, structure=structure, max_rows=max_rows)
    double = estimate_fisher(model, lik, thetas, x, y, kind=kind, structure=structure, max_rows=max_rows,
                             dtype=torch.float64)
    assert all(t.dtype == torch.float32 for t in single) and all(t.dtype == torch.float64 for t in double)
    for a, b in zip(single, double, strict=True):
        torch.testing.assert_close(b.float(), a, rtol=1e-4, atol=1e-6)
    if structure == "kfac" or (structure, kind) == ("diag", "empirical"):
        return  # (kfac casts its sums like the others; the empirical diagonal by layers sums, then casts)
    vectors = fisher_module.fisher_vectors(model, lik, thetas.repeat_interleave(20, 0), x.repeat(2, 1, 1, 1),
                                           y.repeat(2), kind).reshape(2, -1, model.layout.dim).double()
    reference = make_structure(structure, model.layout.dim, blocks=model.layout.block_slices).outer_sum(vectors)
    for a, b in zip(reference, double, strict=True):
        torch.testing.assert_close(b, a / 20, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", ["model", "empirical"])
def test_kfac_factors_in_float64_are_sums_of_float64_products(kind, generator):
    """kronecker_fisher(dtype=float64) casts each batch's inputs and output gradients before their
    products: the first layer's A is the float64 mean of [x, 1] [x, 1]^T, and the last layer's G (its
    output is the network's) the float64 mean of the likelihood's float32 cotangents squared, to
    float64 precision (a float32 product added into a float64 factor is off by about 1e-7)."""
    torch.manual_seed(0)
    net = toy_mlp()
    model = as_chain_model(net)
    theta = model.layout.flatten(net)[None]
    x = torch.rand(50, 2, generator=generator) * 2 - 1
    y = torch.randint(0, 2, (50,), generator=generator).float()
    lik = Bernoulli()
    factors = estimate_fisher(model, lik, theta, x, y, kind=kind, structure="kfac", dtype=torch.float64)
    ones = torch.cat([x, torch.ones(50, 1)], dim=1).double()
    torch.testing.assert_close(factors[0][0], ones.T @ ones / 50, rtol=1e-13, atol=1e-15)
    out = net(x).detach()
    cotangent = lik.residual(out, y) if kind == "empirical" else lik.fisher_factor(out)[..., 0]
    g = cotangent.reshape(50, -1).double()
    torch.testing.assert_close(factors[-1][0], g.T @ g / 50, rtol=1e-13, atol=1e-15)
    with pytest.raises(ValueError, match="dtype must be"):
        estimate_fisher(model, lik, theta, x, y, kind=kind, structure="kfac", dtype="float16")
    for structure in ("kfac", "dense"):  # float64 parameters, a float32 sum: refused, not rounded
        with pytest.raises(ValueError, match="coarser than theta's"):
            estimate_fisher(as_chain_model(toy_mlp().double()), lik, theta.double(), x.double(), y, kind=kind,
                            structure=structure, dtype=torch.float32)
    assert estimate_fisher(model, lik, theta, x, y, kind=kind, structure="dense", dtype="float64")[0].dtype \
        == torch.float64
