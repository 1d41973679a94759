"""The step watch: it changes no number of a run, and what it records is what the run did."""

import dataclasses

import pytest
import torch

from smp_core.fisher import kronecker_layers
from smp_core.models import as_chain_model, toy_mlp
from smp_core.preconditioners import PreconditionerState, build_preconditioner, preconditioner_from_name
from smp_core.recursion import run_smp
from smp_core.watch import _kfac_ridge_share, default_groups, watch


def _toy(seed=5):
    torch.manual_seed(0)
    net = toy_mlp().double()
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(60, 2, generator=gen, dtype=torch.float64) * 2 - 1
    theta0 = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return net, x, theta0


def _build(net, name, period=10):
    model = as_chain_model(net)
    layers = kronecker_layers(model) if name.endswith("kfac") else ()
    return preconditioner_from_name(name, dim=model.layout.dim, blocks=model.layout.block_slices,
                                    layers=layers, ridge=1e-3, period=period)


@pytest.mark.parametrize("name", ["periodic-kfac", "fixed-kfac", "ema-dense"])
def test_a_watched_run_retraces_the_run_bit_for_bit(name):
    net, x, theta0 = _toy()
    kwargs = dict(tau=0.3, n_steps=30, n_chains=7, seed=11, progress=False, check_every=10)
    plain = run_smp(net, "bernoulli", x, preconditioner=_build(net, name), **kwargs)
    wrapped, record = watch(_build(net, name), theta0, steps=range(1, 31), capture_at=[10, 20])
    watched = run_smp(net, "bernoulli", x, preconditioner=wrapped, **kwargs)
    assert torch.equal(plain.theta, watched.theta)
    table = record.table()
    groups = default_groups(wrapped)
    assert len(table) == 30 * 7 * len(groups)
    # the last watched step's move is the run's final distance from theta0, group by group
    last = table[table.step == 30]
    for name_, idx in groups.items():
        expected = (watched.theta[:, idx] - theta0[idx]).abs().amax(1)
        got = torch.tensor(last[last.group == name_].sort_values("chain")["move"].to_numpy())
        assert torch.allclose(got, expected.double(), rtol=0, atol=1e-15)
    assert sorted(record.captured) == [10, 20]
    assert (table.score_norm > 0).all()
    if name.endswith("kfac") and not name.startswith("ema"):
        assert table.ridge_share.between(0, 1).all()
    if name == "periodic-kfac":  # recomputed at the chains' own parameters: a new factor
        before, after = record.captured[10]
        assert not torch.equal(before.factor[2], after.factor[2])
        assert after.factor[2].shape[0] == 7  # one factor per chain after the first recomputation
    if name == "ema-dense":  # the EMA folds the score in place: "before" must be the state before
        before, after = record.captured[10]
        assert not torch.equal(before.stat[0], after.stat[0])
        # the fold of one score: after = beta before + (1 - beta) s s^T, with s the step's score
        fold = after.stat[0] - wrapped.hyper["beta"] * before.stat[0]
        assert torch.all(torch.linalg.matrix_rank(fold, rtol=1e-6) == 1)
    # a wrapped preconditioner run again starts counting at step 1 (init resets the count)
    again = run_smp(net, "bernoulli", x, preconditioner=wrapped, **kwargs)
    assert torch.equal(again.theta, plain.theta) and record.step == 31


def test_a_users_solve_without_out_keeps_working():
    # the recursion passes out= only to a solve that takes it; the wrapper must do the same
    net, x, theta0 = _toy()
    inner = _build(net, "fixed-dense")
    plain_solve = inner.solve
    user = dataclasses.replace(inner, solve=lambda state, v: plain_solve(state, v))
    kwargs = dict(tau=0.3, n_steps=12, n_chains=4, seed=3, progress=False)
    plain = run_smp(net, "bernoulli", x, preconditioner=user, **kwargs)
    wrapped, record = watch(user, theta0, steps=[12])
    watched = run_smp(net, "bernoulli", x, preconditioner=wrapped, **kwargs)
    assert torch.equal(plain.theta, watched.theta) and len(record.table()) > 0


def test_the_step_norm_is_the_norm_of_the_preconditioned_score():
    # with P = I (none) the step is the score itself; with fixed-diag P^{-1} s, element by element
    net, x, theta0 = _toy()
    wrapped, record = watch(_build(net, "none"), theta0, steps=[1, 2, 3], groups={"all": slice(None)})
    run_smp(net, "bernoulli", x, preconditioner=wrapped, tau=0.3, n_steps=3, n_chains=5, seed=2, progress=False)
    table = record.table()
    assert len(table) == 15
    assert torch.allclose(torch.tensor(table.step_norm.to_numpy()), torch.tensor(table.score_norm.to_numpy()))
    # fixed-diag with a huge ridge: P^{-1} = 1 / (F + 1e6) ~ 1e-6, so the step is about 1e-6 the score
    model = as_chain_model(net)
    big = build_preconditioner("diag", "fixed", dim=model.layout.dim, ridge=1e6)
    wrapped, record = watch(big, theta0, steps=[1, 2])
    run_smp(net, "bernoulli", x, preconditioner=wrapped, tau=0.3, n_steps=2, n_chains=5, seed=2, progress=False)
    ratio = record.table().eval("step_norm / score_norm")
    assert ratio.between(0.999e-6, 1e-6).all()


def test_ridge_share_against_a_dense_eigendecomposition():
    # P = G (x) A + lambda I built densely; the share of ||P^{-1} v||^2 in the eigendirections whose
    # eigenvalue of G (x) A is below lambda, computed without the Kronecker structure
    gen = torch.Generator().manual_seed(0)
    net = toy_mlp().double()
    model = as_chain_model(net)
    ridge = 0.05
    precond = build_preconditioner("kfac", "fixed", dim=model.layout.dim, layers=kronecker_layers(model),
                                   ridge=ridge)
    stat = []
    for layer in precond.structure.layers:
        for n in (layer.n_cols, layer.n_out):
            m = torch.randn(3, n, n, generator=gen, dtype=torch.float64)
            vals = torch.logspace(0, -3, n, dtype=torch.float64)  # from 1 down: some products below the ridge
            q, _ = torch.linalg.qr(m)
            stat.append(q @ torch.diag_embed(vals.expand(3, n)) @ q.transpose(1, 2))
    stat = tuple(stat)
    state = PreconditionerState(stat, precond.structure.factorize(stat, ridge))
    v = torch.randn(3, model.layout.dim, generator=gen, dtype=torch.float64)
    shares = _kfac_ridge_share(precond, state, v, ridge)
    for i, layer in enumerate(precond.structure.layers):
        a, g = stat[2 * i], stat[2 * i + 1]
        for c in range(3):
            kron = torch.kron(g[c], a[c])  # row-major [W, b] order
            vals, vecs = torch.linalg.eigh(kron)
            step = torch.linalg.solve(kron + ridge * torch.eye(kron.shape[0], dtype=kron.dtype),
                                      layer.matrix(v)[c].reshape(-1))
            coeff = vecs.T @ step
            expected = coeff[vals < ridge].square().sum() / coeff.square().sum()
            assert 0 < expected < 1
            assert torch.isclose(shares[i][c], expected, rtol=1e-9)


def test_bad_arguments_name_the_problem():
    net, _, theta0 = _toy()
    precond = _build(net, "fixed-diag")
    with pytest.raises(ValueError, match=">= 1"):
        watch(precond, theta0, steps=[0, 1])
    with pytest.raises(ValueError, match="theta0 has 3 parameters"):
        watch(precond, theta0[:3], steps=[1])
    with pytest.raises(ValueError, match="group 'w'"):
        watch(precond, theta0, steps=[1], groups={"w": torch.tensor([0, 99])})


def test_a_boolean_mask_group_is_the_same_as_its_indices():
    net, x, theta0 = _toy()
    mask = torch.zeros(20, dtype=torch.bool)
    mask[3:9] = True  # read as indices 0 and 1 before group_indices
    kwargs = dict(tau=0.3, n_steps=10, n_chains=3, seed=2, progress=False, check_every=10)
    tables = []
    for group in (mask, torch.arange(3, 9)):
        wrapped, record = watch(_build(net, "fixed-diag"), theta0, steps=range(1, 11), groups={"g": group})
        run_smp(net, "bernoulli", x, preconditioner=wrapped, **kwargs)
        tables.append(record.table())
    assert tables[0].equals(tables[1])
    with pytest.raises(ValueError, match="integer indices, a slice or a boolean mask"):
        watch(_build(net, "fixed-diag"), theta0, steps=[1], groups={"g": mask.float()})


def test_a_kfac_factor_kept_in_float64_is_watched():
    """statistic_dtype=float64 keeps the kfac factor in float64 while the scores are float32: the ridge
    share is computed in the factor's dtype (it raised a dtype error), and the run is unchanged."""
    torch.manual_seed(0)
    net = toy_mlp()
    x = torch.rand(40, 2, generator=torch.Generator().manual_seed(2)) * 2 - 1
    model = as_chain_model(net)
    theta0 = model.layout.flatten(net)

    def build():
        return build_preconditioner("kfac", "fixed", dim=model.layout.dim, layers=kronecker_layers(model), ridge=1e-3,
                                    statistic_dtype=torch.float64)

    kwargs = dict(tau=0.3, n_steps=5, n_chains=4, seed=1, progress=False)
    wrapped, record = watch(build(), theta0, steps=[1, 2])
    watched = run_smp(net, "bernoulli", x, preconditioner=wrapped, **kwargs)
    assert torch.equal(watched.theta, run_smp(net, "bernoulli", x, preconditioner=build(), **kwargs).theta)
    assert record.table().ridge_share.between(0, 1).all()
