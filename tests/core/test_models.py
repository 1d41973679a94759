import pytest
import torch
from torch import nn
from torch.func import functional_call

from smp_core.fused import fused_unavailable
from smp_core.layout import ParamLayout
from smp_core.models import (
    FunctionalChainModel,
    MLPChainModel,
    SequentialChainModel,
    as_chain_model,
    lenet5,
    predict,
    toy_mlp,
)


def test_parameter_counts_of_the_paper_networks():
    assert ParamLayout.from_module(toy_mlp()).dim == 20
    assert ParamLayout.from_module(lenet5()).dim == 47_154


def test_lenet5_with_dropout_has_the_same_parameter_vector():
    """MC dropout's LeNet-5: a Dropout before each fully connected layer, the same parameters in the same
    order, and in eval mode the same function of the flat vector as the paper's network."""
    plain, dropped = lenet5(), lenet5(dropout=0.25)
    assert not any(isinstance(m, nn.Dropout) for m in plain)
    assert [m.p for m in dropped if isinstance(m, nn.Dropout)] == [0.25] * 3
    assert [type(m) for m in dropped if not isinstance(m, nn.Dropout)] == [type(m) for m in plain]
    assert [p.shape for p in dropped.parameters()] == [p.shape for p in plain.parameters()]
    theta = torch.nn.utils.parameters_to_vector(plain.parameters())
    torch.nn.utils.vector_to_parameters(theta, dropped.parameters())
    x = torch.rand(5, 1, 28, 28)
    torch.testing.assert_close(dropped.eval()(x), plain.eval()(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="dropout must be a probability"):
        lenet5(dropout=1.0)


def test_layout_blocks_tile_the_vector():
    layout = ParamLayout.from_module(lenet5())
    sizes = [b.stop - b.start for b in layout.block_slices]
    assert sizes == [150, 6, 2400, 16, 32768, 128, 10752, 84, 840, 10]
    assert layout.names[0] == "0.weight"


class Residual(nn.Module):
    """A module the sequential paths cannot batch (skip connection)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) + x)


class DoubledReLU(nn.ReLU):
    """A subclass that changes forward: must not take the hand-derived ReLU path."""

    def forward(self, x):
        return 2 * super().forward(x)


def _with_head(features, shape, n_out=2):
    """``features`` followed by Flatten and a Linear layer sized to its output for inputs of ``shape``."""
    with torch.no_grad():
        n_in = features(torch.zeros(1, *shape)).numel()
    return nn.Sequential(*features, nn.Flatten(), nn.Linear(n_in, n_out))


def _reference_vjp(module, layout, theta, x, cot):
    grads = []
    for t, xi, ci in zip(theta, x, cot, strict=True):
        t = t.clone().requires_grad_(True)
        out = functional_call(module, layout.unflatten(t), (xi.unsqueeze(0),)).reshape(-1)
        grads.append(torch.autograd.grad(out, t, ci)[0])
    return torch.stack(grads)


@pytest.mark.parametrize(
    "module, shape, cls",
    [
        (toy_mlp(), (2,), MLPChainModel),
        (nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2)), (4,), MLPChainModel),
        (lenet5(), (1, 28, 28), SequentialChainModel),
        (nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 16, 4)),
         (2, 8, 8), SequentialChainModel),
        # a second convolution (its input gradient), dilation, padding, no biases, average pooling
        (nn.Sequential(nn.Conv2d(1, 2, 3), nn.GELU(), nn.Conv2d(2, 3, (3, 2), padding=(2, 1), dilation=2, bias=False),
                       nn.AvgPool2d(2), nn.Flatten(), nn.Linear(36, 2, bias=False)),
         (1, 10, 9), SequentialChainModel),
        # a leading Flatten (nothing to pull back below the first Linear), in-place activations,
        # stride together with dilation
        (nn.Sequential(nn.Flatten(), nn.Linear(12, 3), nn.ReLU(inplace=True), nn.Linear(3, 2), nn.Tanh()),
         (3, 4), SequentialChainModel),
        (nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, dilation=2, padding=1), nn.ReLU(inplace=True),
                       nn.MaxPool2d(2, stride=1), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)),
         (2, 11, 11), SequentialChainModel),
        # max-pooling with padding, ceil mode and dilation (the ATen kernels called directly), sigmoid,
        # identity, and an activation subclass that must fall back to autograd
        (_with_head(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Sigmoid(),
                                  nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True),
                                  nn.Identity(), nn.Conv2d(2, 2, 2), DoubledReLU(),
                                  nn.MaxPool2d((2, 3), stride=(1, 2), dilation=(2, 1))), (1, 11, 12)),
         (1, 11, 12), SequentialChainModel),
        (nn.Sequential(nn.Linear(3, 4), DoubledReLU(), nn.Linear(4, 2)), (3,), SequentialChainModel),
        (Residual(), (3,), FunctionalChainModel),
    ],
)
def test_chain_model_matches_autograd_per_row(module, shape, cls, generator):
    model = as_chain_model(module, shape)
    # the compiled kernel of smp_core.fused (a SequentialChainModel) takes MLPs too, where it is built
    kernel = cls is MLPChainModel and fused_unavailable() is None
    assert isinstance(model, SequentialChainModel if kernel else cls)
    _matches_autograd(model, module, shape, generator)
    if type(model) is not cls:  # as_chain_model took the compiled kernel: the batched torch model as well
        _matches_autograd(cls(module, shape), module, shape, generator)


def _matches_autograd(model, module, shape, generator):
    rows = 5
    theta = model.layout.flatten(module) + 0.1 * torch.randn(rows, model.layout.dim, generator=generator)
    x = torch.randn(rows, *shape, generator=generator)
    out, ctx = model.forward(theta, x)
    full = predict(model, theta, x)  # (rows, rows, m): every sample at every input
    assert torch.allclose(out, torch.stack([full[i, i] for i in range(rows)]), atol=1e-5)
    cot = torch.randn(out.shape, generator=generator)
    expected = _reference_vjp(module, model.layout, theta, x, cot)
    assert torch.allclose(model.vjp(ctx, cot, retain=True), expected, atol=1e-5, rtol=1e-4)
    buffer = torch.full((rows, model.layout.dim), float("nan"))
    assert model.vjp(ctx, cot, out=buffer) is buffer  # written into a work buffer, every entry
    assert torch.allclose(buffer, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk", [1 << 18, 7])  # 7 elements: one chain per chunk of outer products
@pytest.mark.parametrize("scales", ["identity", "shared", "per-chain"])
def test_fused_update_equals_the_score_then_the_update(scales, chunk, generator, monkeypatch):
    import smp_core.models as models

    monkeypatch.setattr(models, "_OUTER_CHUNK_ELEMENTS", chunk)
    module = _with_head(nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(3, 2, 2, bias=False)),
                        (1, 9, 9), n_out=3)
    model = SequentialChainModel(module, (1, 9, 9))  # the batched torch model (test_fused.py: the kernel)
    rows, dim = 4, model.layout.dim
    theta = model.layout.flatten(module) + 0.1 * torch.randn(rows, dim, generator=generator)
    x = torch.randn(rows, 1, 9, 9, generator=generator)
    cot = torch.randn(rows, 3, generator=generator)
    diagonal = {"identity": None, "shared": torch.rand(1, dim, generator=generator) + 0.5,
                "per-chain": torch.rand(rows, dim, generator=generator) + 0.5}[scales]
    out, ctx = model.forward(theta, x)
    score = model.vjp(ctx, cot, retain=True)
    expected = theta + 0.3 * (score if diagonal is None else diagonal * score)
    fused = theta.clone()
    _, ctx = model.forward(fused, x)
    model.vjp_update_(ctx, cot, fused, 0.3, diagonal)
    assert torch.allclose(fused, expected, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(fused, theta)  # every chain moved


def test_chain_model_errors():
    model = as_chain_model(toy_mlp())
    with pytest.raises(ValueError, match="one input per chain row"):
        model.forward(torch.zeros(3, 20), torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"shape \(B, 20\)"):
        model.forward(torch.zeros(3, 19), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="input_shape is needed"):
        as_chain_model(lenet5())
    with pytest.raises(TypeError, match="torch.nn.Module"):
        as_chain_model("not a module")


def test_a_bare_linear_layer_needs_no_input_shape(generator):
    """A linear model (one nn.Linear, not in a Sequential) is taken as it is: its inputs are vectors of
    in_features (it asked for input_shape), and its outputs and scores are the layer's."""
    layer = nn.Linear(3, 2)
    model = as_chain_model(layer)
    assert isinstance(model, FunctionalChainModel)  # the general path (vmap of the module)
    assert tuple(model.input_shape) == (3,) and model.layout.dim == 8
    theta = model.layout.flatten(layer).expand(4, 8).contiguous()
    x = torch.randn(4, 3, generator=generator)
    out, _ = model.forward(theta, x)
    torch.testing.assert_close(out, layer(x))


@pytest.mark.parametrize(
    "layer, in_shape",
    [
        (nn.Conv2d(6, 16, 5), (4, 6, 12, 12)),  # LeNet-5's second convolution
        (nn.Conv2d(2, 3, (3, 2), padding=(2, 1), dilation=2, stride=(2, 1)), (3, 2, 10, 9)),
        (nn.Conv2d(1, 2, 3, stride=3), (2, 1, 7, 8)),  # stride larger than needed: rows left out
        # the same channels and input size as the row above, other stride and dilation: another index map
        (nn.Conv2d(1, 2, 3, stride=2, dilation=2), (2, 1, 7, 8)),
        (nn.Conv2d(1, 2, 3, padding=1), (2, 1, 5, 6)),  # padded to 7 x 8, like the rows above
    ],
)
def test_col2im_paths_agree_to_the_bit_and_are_the_adjoint_of_im2col(layer, in_shape, generator):
    from smp_core.models import _col2im_indexed, _col2im_strided, _im2col

    h = torch.randn(in_shape, generator=generator)
    cols, _ = _im2col(h, layer)
    upstream = torch.randn(cols.shape, generator=generator)
    indexed = _col2im_indexed(upstream, torch.Size(in_shape), layer)
    strided = _col2im_strided(upstream, torch.Size(in_shape), layer)
    assert torch.equal(indexed, strided)
    # adjoint: <im2col(h), u> = <h, col2im(u)>
    assert torch.allclose((cols * upstream).sum(), (h * indexed).sum(), rtol=1e-5)


class _ScaledLinear(nn.Linear):
    """A Linear subclass that changes forward: the hand-batched models must not take it."""

    def forward(self, x):
        return nn.functional.linear(x, 2 * self.weight, self.bias)


@pytest.mark.parametrize("module, shape", [
    (nn.Sequential(_ScaledLinear(3, 4), nn.Tanh(), nn.Linear(4, 2)), (3,)),
    (nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), _ScaledLinear(8, 2)), (1, 4, 4)),
])
def test_subclasses_of_layers_with_parameters_take_the_general_path(module, shape, generator):
    model = as_chain_model(module, shape)
    assert isinstance(model, FunctionalChainModel)
    theta = model.layout.flatten(module).expand(3, -1)
    x = torch.randn(3, *shape, generator=generator)
    out, _ = model.forward(theta, x)
    assert torch.allclose(out, module(x), atol=1e-6)


def test_training_mode_randomness_is_refused_by_predict():
    from smp_core.models import check_deterministic, predict

    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Dropout(0.3), nn.Linear(4, 2))
    model = as_chain_model(net)
    theta = model.layout.flatten(net)[None]
    with pytest.raises(ValueError, match="Dropout layers in training mode.*call module.eval"):
        predict(model, theta, torch.rand(5, 3))
    net.eval()
    check_deterministic(model)
    assert predict(model, theta, torch.rand(5, 3)).shape == (1, 5, 2)
    check_deterministic(nn.Sequential(nn.Linear(3, 1)))  # training mode without such layers is fine
    with pytest.raises(ValueError, match="BatchNorm2d, RReLU"):
        check_deterministic(nn.Sequential(nn.BatchNorm2d(2), nn.RReLU()))
