import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("jax")
pytest.importorskip("numpyro")

import jax  # noqa: E402

from smp_book.nuts import (  # noqa: E402
    HIDDEN_UNIT_PERMUTATIONS,
    align_hidden_units,
    check_nuts_mean,
    find_map,
    log_posterior,
    mlp_logits_jax,
    nuts_mean_passes,
    permute_hidden_units,
    predict_logits,
    run_nuts,
)
from smp_book.toy import make_toy_data  # noqa: E402
from smp_core.layout import ParamLayout  # noqa: E402
from smp_core.models import toy_mlp  # noqa: E402


def _torch_logits(net, theta, x):
    ParamLayout.from_module(net).load_into(net, torch.as_tensor(theta, dtype=torch.float32))
    with torch.no_grad():
        return net(torch.as_tensor(x, dtype=torch.float32)).reshape(-1).numpy()


def test_jax_network_matches_torch_toy_mlp():
    rng = np.random.default_rng(0)
    net = toy_mlp()
    assert ParamLayout.from_module(net).dim == 20
    for scale in (0.5, 1.0, 2.0, 2.0, 3.0):
        theta = (scale * rng.standard_normal(20)).astype(np.float32)
        x = rng.uniform(-1.5, 1.5, size=(64, 2)).astype(np.float32)
        expected = _torch_logits(net, theta, x)
        got = np.asarray(mlp_logits_jax(theta, x))
        assert got.shape == (64,)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
        # The float64 path used by the sampler agrees as well.
        np.testing.assert_allclose(predict_logits(theta, x)[0], expected, rtol=0, atol=1e-5)


def test_batched_theta():
    rng = np.random.default_rng(1)
    thetas = rng.standard_normal((5, 20)).astype(np.float32)
    x = rng.uniform(-1, 1, size=(7, 2)).astype(np.float32)
    batched = np.asarray(mlp_logits_jax(thetas, x))
    assert batched.shape == (5, 7)
    for s in range(5):
        np.testing.assert_allclose(batched[s], np.asarray(mlp_logits_jax(thetas[s], x)), atol=1e-6)


def test_gelu_variant_matters():
    # The tanh-approximate GELU is the one matched above; an exact-GELU net must give other logits.
    rng = np.random.default_rng(2)
    theta = (2.0 * rng.standard_normal(20)).astype(np.float32)
    x = rng.uniform(-1, 1, size=(256, 2)).astype(np.float32)
    exact = nn.Sequential(nn.Linear(2, 3), nn.GELU(), nn.Linear(3, 2), nn.GELU(), nn.Linear(2, 1))
    diff = np.abs(np.asarray(mlp_logits_jax(theta, x)) - _torch_logits(exact, theta, x)).max()
    assert diff > 1e-4


def test_log_posterior_matches_direct_formula():
    rng = np.random.default_rng(3)
    x, y = make_toy_data(50, seed=3)
    theta = rng.standard_normal(20)
    g = _torch_logits(toy_mlp(), theta, x).astype(np.float64)
    yy = y.numpy().astype(np.float64)
    loglik = np.sum(yy * g - np.logaddexp(0.0, g))
    logprior = -0.5 * theta @ theta - 10 * np.log(2 * np.pi)
    with jax.enable_x64(True):
        lp = float(log_posterior(theta, np.asarray(x, np.float64), yy))
    assert lp == pytest.approx(loglik + logprior, abs=1e-3)


def test_hidden_unit_permutations_are_exact_symmetries():
    rng = np.random.default_rng(4)
    theta = rng.standard_normal(20)
    x = rng.uniform(-1, 1, size=(32, 2))
    base = predict_logits(theta, x)[0]
    assert len(HIDDEN_UNIT_PERMUTATIONS) == 12
    permuted = np.stack([permute_hidden_units(theta, p1, p2) for p1, p2 in HIDDEN_UNIT_PERMUTATIONS])
    assert len({tuple(np.round(t, 12)) for t in permuted}) == 12
    np.testing.assert_allclose(predict_logits(permuted, x), np.broadcast_to(base, (12, 32)), atol=1e-10)
    # Relabelling recovers the original from noisy permuted copies.
    noisy = permuted + 0.01 * rng.standard_normal(permuted.shape)
    aligned, labels = align_hidden_units(noisy, reference=theta)
    np.testing.assert_allclose(aligned, np.broadcast_to(theta, aligned.shape), atol=0.05)
    assert labels[0] == 0 and len(set(labels.tolist())) == 12


@pytest.fixture(scope="module")
def toy200():
    x, y = make_toy_data(200, seed=0)
    return x.numpy(), y.numpy()


@pytest.fixture(scope="module")
def map200(toy200):
    x, y = toy200
    return find_map(x, y, seed=0)


def test_find_map_improves_log_posterior(toy200, map200):
    x, y = toy200
    res = map200
    assert res.theta.shape == (20,)
    starts = 0.5 * np.random.default_rng(0).standard_normal((4, 20))  # find_map's restarts for seed 0
    with jax.enable_x64(True):
        lp_starts = np.asarray(log_posterior(starts, x.astype(np.float64), y.astype(np.float64)))
        lp_map = float(log_posterior(res.theta, x.astype(np.float64), y.astype(np.float64)))
        grad = np.asarray(jax.grad(log_posterior)(res.theta, x.astype(np.float64), y.astype(np.float64)))
    assert np.all(res.restart_log_posteriors > lp_starts + 1.0)
    assert lp_map == pytest.approx(res.log_posterior, abs=1e-6)
    assert lp_map > lp_starts.max() + 10.0
    assert res.log_posterior == pytest.approx(res.restart_log_posteriors.max())
    assert np.abs(grad).max() < 1e-2
    # The MAP classifies the training data well.
    acc = np.mean((predict_logits(res.theta, x)[0] > 0) == (y > 0.5))
    assert acc > 0.85


@pytest.fixture(scope="module")
def nuts200(toy200, map200):
    x, y = toy200
    return run_nuts(x, y, seed=0, num_warmup=150, num_samples=150, init=map200.theta)


def test_short_nuts_run(toy200, map200, nuts200):
    x, y = toy200
    res = nuts200
    assert res.samples.shape == (150, 20) and res.raw_samples.shape == (150, 20)
    assert np.all(np.isfinite(res.samples))
    np.testing.assert_array_equal(res.init, map200.theta)
    d = res.diagnostics
    assert d["num_divergences"] <= 3
    assert 0.7 < d["mean_accept_prob"] <= 1.0
    assert 1 <= d["max_tree_depth_reached"] <= d["max_tree_depth"]
    assert 0 <= d["num_max_tree_depth_hits"] <= 150
    for key, value in d.items():
        assert np.isfinite(value), key
    assert list(d) == [
        "num_divergences", "num_warmup_divergences", "mean_accept_prob", "step_size", "max_tree_depth",
        "max_tree_depth_reached", "num_max_tree_depth_hits", "mean_num_steps", "min_ess_params", "median_ess_params",
        "max_rhat_params", "min_ess_params_raw", "num_relabelled", "min_ess_logits", "median_ess_logits",
        "max_rhat_logits", "warmup_time_s", "sampling_time_s", "wall_time_s"]  # the columns of the tables
    assert 1 < d["min_ess_params"] <= d["median_ess_params"] and d["min_ess_logits"] <= d["median_ess_logits"]
    assert d["wall_time_s"] > 0
    assert d["num_relabelled"] == np.sum(res.labels != 0)
    # Relabelling changes no draw's predictions.
    np.testing.assert_allclose(predict_logits(res.samples, x[:20]), predict_logits(res.raw_samples, x[:20]),
                               atol=1e-9)
    # The NUTS-mean point estimate predicts well on the training data and passes the check.
    acc_mean = np.mean((predict_logits(res.samples.mean(axis=0), x)[0] > 0) == (y > 0.5))
    assert acc_mean > 0.8
    metrics = check_nuts_mean(res.samples, x, y)
    assert nuts_mean_passes(metrics) and metrics["accuracy_ensemble"] > 0.8


def test_check_nuts_mean_flags_mixed_modes(toy200, map200):
    x, y = toy200
    # An "ensemble" of exact relabellings of the MAP predicts like the MAP, but its mean does not.
    mixed = np.stack([permute_hidden_units(map200.theta, p1, p2) for p1, p2 in HIDDEN_UNIT_PERMUTATIONS])
    metrics = check_nuts_mean(mixed, x, y)
    assert not nuts_mean_passes(metrics)
    assert metrics["accuracy_mean"] < metrics["accuracy_ensemble"]
    # A single basin passes.
    assert nuts_mean_passes(check_nuts_mean(map200.theta[None], x, y))


def test_jax_programs_read_from_the_compilation_cache_give_the_same_numbers(tmp_path):
    """smp_book keeps JAX's compiled programs in a persistent cache: a second process reads every program the
    first compiled (it writes none) and gets bitwise the first's numbers (the package's docstring promises it)."""
    import os
    import subprocess
    import sys

    script = ("import smp_book, jax, numpy as np\n"
              "from smp_book.nuts import _cpu64, log_posterior\n"
              "with _cpu64():\n"
              "    x = np.random.default_rng(0).normal(size=(50, 2)); y = (x[:, 0] > 0).astype(float)\n"
              "    f = jax.jit(jax.value_and_grad(lambda t: log_posterior(t, x, y, 1.0)))\n"
              "    v, g = f(np.linspace(-1, 1, 20))\n"
              "print(np.asarray(g).tobytes().hex(), float(v).hex())\n")
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax")}
    numbers, written = [], []
    for _ in range(2):
        numbers.append(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                      check=True).stdout)
        written.append(sorted(p.name for p in (tmp_path / "jax").iterdir()))
    assert written[0], "the first process wrote no compiled program"
    assert written[1] == written[0], "the second process compiled a program the cache did not hold"
    assert numbers[0] == numbers[1]
