import math

import numpy as np
import pytest
import torch

from smp_book.toy import make_grid, make_toy_data, p_true


def test_p_true_values_and_backends():
    x = torch.tensor([[0.0, 0.0], [0.5, 0.5], [1.0, 1.0]])
    expected = torch.sigmoid(20 * (0.5 - torch.tensor([0.0, 0.5, 2.0])))
    torch.testing.assert_close(p_true(x), expected)
    assert p_true(x)[1].item() == pytest.approx(0.5)  # on the boundary ||x||^2 = 0.5
    np.testing.assert_allclose(p_true(x.numpy()), expected.numpy(), rtol=1e-6, atol=1e-7)
    assert isinstance(p_true(x.numpy()), np.ndarray)


def test_shapes_dtypes_and_range():
    x, y = make_toy_data(500, seed=0)
    assert x.shape == (500, 2) and y.shape == (500,)
    assert x.dtype == torch.float32 and y.dtype == torch.float32
    assert x.min() >= -1 and x.max() <= 1
    assert set(y.unique().tolist()) <= {0.0, 1.0}
    # Uniform on the square: every quadrant is populated.
    for sx in (-1, 1):
        for sy in (-1, 1):
            assert ((sx * x[:, 0] > 0) & (sy * x[:, 1] > 0)).sum() > 50


def test_reproducible_by_seed_and_seeds_differ():
    x1, y1 = make_toy_data(300, seed=7)
    x2, y2 = make_toy_data(300, seed=7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    x3, y3 = make_toy_data(300, seed=8)
    assert not torch.equal(x1, x3)
    assert not torch.equal(y1, y3)


def test_global_rng_untouched():
    torch.manual_seed(0)
    a = torch.rand(3)
    torch.manual_seed(0)
    make_toy_data(100, seed=3)
    assert torch.equal(torch.rand(3), a)


def test_label_frequency_matches_p_true():
    # Given x, sum(y) has mean sum(p) and variance sum(p (1 - p)) (independent Bernoullis; the
    # binomial standard error with unequal p). A z-score beyond 4 has probability < 1e-4.
    for seed in (0, 1, 2):
        x, y = make_toy_data(20_000, seed=seed)
        p = p_true(x).double()
        z = (y.double().sum() - p.sum()) / torch.sqrt((p * (1 - p)).sum())
        assert abs(z.item()) < 4.0, (seed, z.item())
        # And the class-1 fraction is near the probability that ||X||^2 < 0.5 for X ~ U[-1,1]^2,
        # pi * 0.5 / 4 = 0.3927 (up to the smooth boundary, which is nearly symmetric).
        assert abs(y.mean().item() - math.pi / 8) < 0.02


def test_labels_inside_and_outside_the_circle():
    x, y = make_toy_data(5000, seed=0)
    r2 = (x * x).sum(1)
    assert y[r2 < 0.3].mean() > 0.95
    assert y[r2 > 0.7].mean() < 0.05


def test_grid():
    xx, yy, points = make_grid(101)
    assert xx.shape == yy.shape == (101, 101)
    assert points.shape == (101 * 101, 2)
    assert points.min() == -1 and points.max() == 1
    torch.testing.assert_close(points[:, 0], xx.reshape(-1))
    torch.testing.assert_close(points[:, 1], yy.reshape(-1))
    assert torch.all(xx[:, 1:] > xx[:, :-1]) and torch.all(yy[1:, :] > yy[:-1, :])
    assert make_grid(5)[2].shape == (25, 2)
    with pytest.raises(ValueError):
        make_grid(1)
