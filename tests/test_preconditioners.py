"""Contract suite run over every structure x temporal strategy."""

import itertools

import pytest
import torch

from smp_core.preconditioners import (
    STRATEGIES,
    STRUCTURES,
    Structure,
    build_preconditioner,
    preconditioner_from_name,
)

DIM = 7
BLOCKS = (slice(0, 3), slice(3, 4), slice(4, 7))
RIDGE = 1e-2
VARIANTS = [("none", None)] + list(itertools.product(STRUCTURES[1:], STRATEGIES))


def _vectors(generator, chains, n=5):
    return torch.randn(chains, n, DIM, generator=generator, dtype=torch.float64)


def _brute_dense(structure, vectors):
    """The dense (C, d, d) matrix mean(v v^T) with the structure's zero pattern, built by hand."""
    full = torch.einsum("cni,cnj->cij", vectors, vectors) / vectors.shape[1]
    mask = torch.zeros(DIM, DIM, dtype=torch.bool)
    if structure == "dense":
        mask[:] = True
    elif structure == "diag":
        mask = torch.eye(DIM, dtype=torch.bool)
    else:
        for b in BLOCKS:
            mask[b, b] = True
    return full * mask


def _build(structure, strategy, **kw):
    return build_preconditioner(structure, strategy, dim=DIM, blocks=BLOCKS, ridge=RIDGE, **kw)


@pytest.mark.parametrize("structure, strategy", VARIANTS)
def test_contract(structure, strategy, generator):
    chains = 4
    theta0 = torch.zeros(chains, DIM, dtype=torch.float64)
    fisher_vectors = {}

    def curvature(theta):
        v = _vectors(generator, theta.shape[0])
        fisher_vectors["last"] = v
        struct = Structure(structure, DIM, BLOCKS if structure == "block" else ())
        return tuple(m / v.shape[1] for m in struct.outer_sum(v))

    pre = _build(structure, strategy, period=2)
    state = pre.init(theta0, curvature)
    scores = []
    for k in range(1, 4):
        s = torch.randn(chains, DIM, generator=generator, dtype=torch.float64)
        scores.append(s)
        state = pre.update(state, k, theta0 + k, s, curvature)
    v = torch.randn(chains, DIM, generator=generator, dtype=torch.float64)
    out = pre.solve(state, v)
    assert out.shape == v.shape and torch.isfinite(out).all()
    if structure == "none":
        assert torch.equal(out, v)
        return
    # brute force: the matrix the preconditioner should hold, from the same scores
    if strategy == "ema":
        beta = pre.hyper["beta"]
        fisher = _brute_dense(structure, fisher_vectors["last"])
        for s in scores:
            fisher = beta * fisher + (1 - beta) * _brute_dense(structure, s.unsqueeze(1))
    else:  # fixed: the Fisher at theta0; periodic (T=2): recomputed after step 2 from new vectors
        fisher = _brute_dense(structure, fisher_vectors["last"])
    fisher = fisher.expand(chains, DIM, DIM)
    matrix = fisher + RIDGE * torch.eye(DIM, dtype=torch.float64)
    assert torch.allclose(pre.dense_matrix(state).expand(chains, DIM, DIM), matrix, atol=1e-10)
    assert torch.allclose(matrix, matrix.transpose(1, 2))
    assert (torch.linalg.eigvalsh(matrix) > 0).all()
    expected = torch.linalg.solve(matrix, v.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(out, expected, atol=1e-8, rtol=1e-6)
    # the same with a work buffer (pre-filled with NaN, which must not survive), and v untouched
    v_before = v.clone()
    buffer = torch.full_like(v, float("nan"))
    out_buffered = pre.solve(state, v, out=buffer)
    assert torch.allclose(out_buffered, expected, atol=1e-8, rtol=1e-6)
    assert torch.equal(v, v_before)


def test_fixed_shares_one_fisher_when_chains_start_together(generator):
    calls = []

    def curvature(theta):
        calls.append(theta.shape[0])
        return (torch.ones(theta.shape[0], DIM, dtype=torch.float64),)

    pre = _build("diag", "fixed")
    pre.init(torch.zeros(5, DIM, dtype=torch.float64), curvature)
    assert calls == [1]


def test_periodic_recomputes_every_T_steps():
    seen = []

    def curvature(theta):
        seen.append(float(theta[0, 0]))
        return (torch.ones(theta.shape[0], DIM),)

    pre = _build("diag", "periodic", period=3)
    state = pre.init(torch.zeros(2, DIM), curvature)
    for k in range(1, 8):
        state = pre.update(state, k, torch.full((2, DIM), float(k)), torch.zeros(2, DIM), curvature)
    assert seen == [0.0, 3.0, 6.0]  # theta_0, then theta_3 for P_4, theta_6 for P_7


def test_names_and_errors():
    assert preconditioner_from_name("SMP-ema-block", dim=DIM, blocks=BLOCKS).name == "ema-block"
    assert preconditioner_from_name("none", dim=DIM).name == "none"
    with pytest.raises(ValueError, match="unknown preconditioner structure"):
        build_preconditioner("kfac", "ema", dim=DIM)
    with pytest.raises(ValueError, match="unknown temporal strategy"):
        build_preconditioner("diag", "weekly", dim=DIM)
    with pytest.raises(ValueError, match="unknown preconditioner"):
        preconditioner_from_name("ema_block", dim=DIM)
    with pytest.raises(ValueError, match="ridge"):
        build_preconditioner("diag", "fixed", dim=DIM, ridge=-1.0)
    with pytest.raises(ValueError, match="beta"):
        build_preconditioner("diag", "ema", dim=DIM, beta=1.0)
    with pytest.raises(ValueError, match="tile"):
        Structure("block", DIM, (slice(0, 3), slice(4, 7)))
    with pytest.raises(ValueError, match="needs a Fisher"):
        build_preconditioner("diag", "fixed", dim=DIM).init(torch.zeros(1, DIM), None)


@pytest.mark.parametrize("gamma_kind", ["float", "tensor"])  # a 0-d tensor in the step blocks (CUDA graphs)
@pytest.mark.parametrize("rows", ["shared", "per-chain"])
@pytest.mark.parametrize("name", ["none", "fixed-diag", "periodic-diag", "ema-diag"])
def test_elementwise_rule_on_pieces_equals_solve_then_update(name, rows, gamma_kind, generator):
    # the rule applied to pieces of the vector (by parameter blocks and by chains, as the fused
    # model path cuts it) must give the step and the next state of solve() then update()
    if rows == "shared" and name == "ema-diag":
        pytest.skip("the EMA statistic always has one row per chain")
    chains = 4
    precond = preconditioner_from_name(name, dim=DIM, ridge=RIDGE, beta=0.9, period=3)
    theta0 = torch.randn(chains, DIM, generator=generator, dtype=torch.float64)

    def curvature(theta):
        return Structure("diag", DIM).outer_sum(_vectors(generator, theta.shape[0]))

    state = precond.init(theta0, curvature if precond.needs_curvature else None)
    if name != "none" and rows == "per-chain":  # chains with different statistics: the pieces must line up
        stat = state.stat[0].expand(chains, DIM) + torch.rand(chains, DIM, generator=generator, dtype=torch.float64)
        state = type(state)((stat,), () if not state.factor else (1.0 / (stat + RIDGE),))
        assert not torch.equal(stat[0], stat[1])
    score = torch.randn(chains, DIM, generator=generator, dtype=torch.float64)
    gamma = 0.3
    expected_theta = theta0 + gamma * precond.solve(state, score)
    expected_state = precond.update(type(state)(tuple(t.clone() for t in state.stat), state.factor), 1,
                                    expected_theta, score, curvature)

    rule = precond.elementwise
    assert rule is not None
    theta = theta0.clone()
    tensors = rule.tensors(state)
    step_size = gamma if gamma_kind == "float" else torch.tensor(gamma, dtype=torch.float64)
    for cols in (slice(0, 2), slice(2, 7)):
        for part in (slice(0, 1), slice(1, 4)):
            pieces = [t[:, cols] if t.shape[0] == 1 else t[part, cols] for t in tensors]
            rule.apply_(theta[part, cols], score[part, cols], pieces, step_size)
    assert torch.allclose(theta, expected_theta, rtol=1e-12, atol=1e-12)
    if rule.apply_outer_ is not None:  # a score given as outer products delta h^T
        delta = torch.randn(chains, 2, generator=generator, dtype=torch.float64)
        h = torch.randn(chains, 3, generator=generator, dtype=torch.float64)
        outer = (delta.unsqueeze(-1) * h.unsqueeze(1)).reshape(chains, 6)
        target = theta0[:, :6].clone().reshape(chains, 2, 3)
        rule.apply_outer_(target, delta, h, [], step_size)
        assert torch.allclose(target.reshape(chains, 6), theta0[:, :6] + gamma * outer, rtol=1e-12, atol=1e-12)
    if rule.covers_update:  # EMA: the statistic was updated in place
        assert torch.allclose(state.stat[0], expected_state.stat[0], rtol=1e-12, atol=1e-12)


def test_only_elementwise_preconditioners_have_a_rule():
    for structure, strategy in VARIANTS:
        precond = build_preconditioner(structure, strategy, dim=DIM, blocks=BLOCKS)
        assert (precond.elementwise is not None) == (structure in ("none", "diag"))
        # when update() can change the state: never, every T steps, or at any step (EMA)
        expected = {"fixed": 0, "periodic": 500, "ema": None}[strategy] if structure != "none" else 0
        assert precond.update_every == expected
