"""Contract suite run over every structure x temporal strategy."""

import itertools
import warnings

import pytest
import torch

import smp_core.preconditioners as preconditioners_module
from smp_core.preconditioners import (
    KFAC,
    STRATEGIES,
    STRUCTURE_TYPES,
    STRUCTURES,
    Blocks,
    Dense,
    Diagonal,
    KroneckerLayer,
    build_preconditioner,
    make_structure,
    preconditioner_from_name,
)

DIM = 7
BLOCKS = (slice(0, 3), slice(3, 4), slice(4, 7))
RIDGE = 1e-2
VARIANTS = [("none", None)] + list(itertools.product([s for s in STRUCTURES[1:] if s != "kfac"], STRATEGIES))
# kfac: a 2 x 2 weight (entries 0-3) with its bias (4-5), then a 1 x 1 weight (6) without a bias
LAYERS = (KroneckerLayer(slice(0, 4), slice(4, 6), 2, 2), KroneckerLayer(slice(6, 7), None, 1, 1))


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


def _init_and_three_updates(pre, theta0, curvature, generator):
    """``init`` at ``theta0``, then ``update`` after steps 1-3 with random scores: the state and the scores."""
    state = pre.init(theta0, curvature)
    scores = []
    for k in range(1, 4):
        s = torch.randn(*theta0.shape, generator=generator, dtype=torch.float64)
        scores.append(s)
        state = pre.update(state, k, theta0 + k, s, curvature)
    return state, scores


@pytest.mark.parametrize("cls", list(STRUCTURE_TYPES.values()), ids=list(STRUCTURE_TYPES))
def test_every_structure_keeps_the_protocol(cls, generator):
    """The structure protocol, class by class: its name builds it, its statistic's size and identity, and
    P^{-1} v alike from factorize + apply, from solve and from the dense matrix it stands for."""
    struct = make_structure(cls.name, DIM, blocks=BLOCKS, layers=LAYERS)
    assert type(struct) is cls and cls.name in STRUCTURES
    eye = struct.identity(3, torch.float64)
    assert struct.stat_numel() == sum(m[0].numel() for m in eye)
    assert bool((struct.to_dense(eye).to(torch.float64) == torch.eye(DIM, dtype=torch.float64)).all())  # C = 1 or 3
    assert (struct.elementwise_rule("fixed", 0.9, RIDGE) is not None) == cls.elementwise
    assert not (cls.elementwise and cls.matrices) and (not cls.constant or cls.elementwise)
    # a random positive semi-definite statistic with one element per chain (kfac: random factors)
    if cls is KFAC:
        stat = tuple(torch.einsum("cij,ckj->cik", r, r) for r in (
            torch.randn(3, n, n, generator=generator, dtype=torch.float64)
            for layer in LAYERS for n in (layer.n_cols, layer.n_out)))
    else:
        stat = tuple(m / 5 for m in struct.outer_sum(_vectors(generator, 3))) if not cls.constant else ()
    v = torch.randn(3, DIM, generator=generator, dtype=torch.float64)
    ridge = 0.0 if cls.constant else RIDGE
    dense = struct.to_dense(stat).to(torch.float64) if stat else torch.eye(DIM, dtype=torch.float64).expand(3, -1, -1)
    expected = torch.linalg.solve(dense + ridge * torch.eye(DIM, dtype=torch.float64), v.unsqueeze(-1)).squeeze(-1)
    # a tolerance, not equality: a Cholesky solve, an explicit inverse and an eigendecomposition round apart
    torch.testing.assert_close(struct.apply(struct.factorize(stat, ridge), v), expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(struct.solve(stat, ridge, v), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("structure, strategy", VARIANTS)
def test_contract(structure, strategy, generator):
    chains = 4
    theta0 = torch.zeros(chains, DIM, dtype=torch.float64)
    fisher_vectors = {}

    def curvature(theta):
        v = _vectors(generator, theta.shape[0])
        fisher_vectors["last"] = v
        struct = make_structure(structure, DIM, blocks=BLOCKS)
        return tuple(m / v.shape[1] for m in struct.outer_sum(v))

    pre = _build(structure, strategy, period=2)
    state, scores = _init_and_three_updates(pre, theta0, curvature, generator)
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
        build_preconditioner("shampoo", "ema", dim=DIM)
    with pytest.raises(ValueError, match="needs the layers"):
        build_preconditioner("kfac", "ema", dim=DIM)
    with pytest.raises(ValueError, match="without gaps"):
        KFAC(DIM, (LAYERS[0], KroneckerLayer(slice(5, 6), None, 1, 1)))
    with pytest.raises(ValueError, match="2 x 3 entries"):
        KFAC(DIM, (KroneckerLayer(slice(0, 4), None, 2, 3),))
    with pytest.raises(ValueError, match="not from score vectors"):
        KFAC(DIM, LAYERS).outer_sum(torch.zeros(1, 2, DIM))
    with pytest.raises(ValueError, match="unknown temporal strategy"):
        build_preconditioner("diag", "weekly", dim=DIM)
    with pytest.raises(ValueError, match="unknown preconditioner"):
        preconditioner_from_name("ema_block", dim=DIM)
    with pytest.raises(ValueError, match="ridge"):
        build_preconditioner("diag", "fixed", dim=DIM, ridge=-1.0)
    with pytest.raises(ValueError, match="beta"):
        build_preconditioner("diag", "ema", dim=DIM, beta=1.0)
    with pytest.raises(ValueError, match="tile"):
        Blocks(DIM, (slice(0, 3), slice(4, 7)))
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
        return Diagonal(DIM).outer_sum(_vectors(generator, theta.shape[0]))

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


# --- kfac -----------------------------------------------------------------------------------------


def _kfac_brute_dense(a_g_pairs):
    """The (C, d, d) matrix of per-layer G (x) A blocks, placed by hand: entry (o, j) of the layer's
    ``[W, b]`` sits at ``weight.start + o * n_in + j`` (j < n_in) or ``bias.start + o``."""
    chains = a_g_pairs[0][0].shape[0]
    out = torch.zeros(chains, DIM, DIM, dtype=torch.float64)
    for layer, (a, g) in zip(LAYERS, a_g_pairs, strict=True):
        where = []
        for o in range(layer.n_out):
            where += [layer.weight.start + o * layer.n_in + j for j in range(layer.n_in)]
            if layer.bias is not None:
                where.append(layer.bias.start + o)
        for c in range(chains):
            kron = torch.kron(g[c], a[c])
            for r, i in enumerate(where):
                for q, j in enumerate(where):
                    out[c, i, j] = kron[r, q]
    return out


def _score_matrix(layer, s):
    w = s[:, layer.weight].reshape(s.shape[0], layer.n_out, layer.n_in)
    return w if layer.bias is None else torch.cat([w, s[:, layer.bias, None]], dim=2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kfac_contract(strategy, generator):
    chains = 3
    theta0 = torch.zeros(chains, DIM, dtype=torch.float64)
    last = {}

    def curvature(theta):
        pairs = []
        for layer in LAYERS:
            a = torch.randn(theta.shape[0], 4, layer.n_cols, generator=generator, dtype=torch.float64)
            g = torch.randn(theta.shape[0], 4, layer.n_out, generator=generator, dtype=torch.float64)
            pairs.append((a.transpose(1, 2) @ a / 4, g.transpose(1, 2) @ g / 4))
        last["pairs"] = pairs
        return tuple(m for pair in pairs for m in pair)

    pre = build_preconditioner("kfac", strategy, dim=DIM, layers=LAYERS, ridge=RIDGE, period=2)
    state, scores = _init_and_three_updates(pre, theta0, curvature, generator)
    pairs = [(a.expand(chains, -1, -1), g.expand(chains, -1, -1)) for a, g in last["pairs"]]
    if strategy == "ema":  # P = e (G^ (x) A^): e the EMA of |M|^2, A^ and G^ of M^T M / |M|^2 and M M^T / |M|^2
        beta = pre.hyper["beta"]

        def trace(m):
            return m.diagonal(dim1=1, dim2=2).sum(-1)[:, None, None]

        state_by_hand = [(trace(a) * trace(g), a / trace(a), g / trace(g)) for a, g in pairs]
        for s in scores:
            new = []
            for layer, (e, a_dir, g_dir) in zip(LAYERS, state_by_hand, strict=True):
                m = _score_matrix(layer, s)
                sq = m.square().sum((1, 2))[:, None, None]
                new.append((beta * e + (1 - beta) * sq, beta * a_dir + (1 - beta) * m.transpose(1, 2) @ m / sq,
                            beta * g_dir + (1 - beta) * m @ m.transpose(1, 2) / sq))
            state_by_hand = new
        pairs = [(a_dir, e * g_dir) for e, a_dir, g_dir in state_by_hand]
    matrix = _kfac_brute_dense(pairs) + RIDGE * torch.eye(DIM, dtype=torch.float64)
    assert torch.allclose(pre.dense_matrix(state).expand(chains, DIM, DIM), matrix, atol=1e-10)
    v = torch.randn(chains, DIM, generator=generator, dtype=torch.float64)
    expected = torch.linalg.solve(matrix, v.unsqueeze(-1)).squeeze(-1)
    v_before = v.clone()
    assert torch.allclose(pre.solve(state, v), expected, atol=1e-8, rtol=1e-6)
    assert torch.equal(v, v_before)


def test_kfac_solves_by_the_block_or_by_eigendecompositions_alike(generator, monkeypatch):
    struct = KFAC(DIM, LAYERS)
    stat = []
    for layer in LAYERS:
        a = torch.randn(5, 3, layer.n_cols, generator=generator, dtype=torch.float64)  # rank 3 or less
        g = torch.randn(5, 2, layer.n_out, generator=generator, dtype=torch.float64)
        stat += [a.transpose(1, 2) @ a, g.transpose(1, 2) @ g]
    v = torch.randn(5, DIM, generator=generator, dtype=torch.float64)
    matrix = struct.to_dense(tuple(stat)) + RIDGE * torch.eye(DIM, dtype=torch.float64)
    expected = torch.linalg.solve(matrix, v.unsqueeze(-1)).squeeze(-1)
    by_block = struct.solve(tuple(stat), RIDGE, v)
    monkeypatch.setattr(preconditioners_module, "_SMALL_KRONECKER", 0)
    by_eigen = struct.solve(tuple(stat), RIDGE, v)
    factored = struct.apply(struct.factorize(tuple(stat), RIDGE), v)
    for result in (by_block, by_eigen, factored):
        assert torch.allclose(result, expected, atol=1e-8, rtol=1e-6)


def test_kfac_ema_of_one_linear_example_is_its_kronecker_block(generator):
    # one example of a linear layer: the score's layer matrix is g [a, 1]^T, and one EMA step from zero
    # factors gives (1 - beta) (g g^T) (x) (a a^T) exactly, as the EMA of s s^T would
    layer = LAYERS[0]
    struct = KFAC(DIM, LAYERS)
    a = torch.cat([torch.randn(2, generator=generator, dtype=torch.float64), torch.ones(1, dtype=torch.float64)])
    g = 3.0 * torch.randn(2, generator=generator, dtype=torch.float64)
    s = torch.zeros(1, DIM, dtype=torch.float64)
    s[0, layer.weight] = torch.outer(g, a[:2]).reshape(-1)
    s[0, layer.bias] = g
    stat = tuple(torch.zeros(1, n, n, dtype=torch.float64) for n in (3, 2, 1, 1))
    struct.ema_update_(stat, s, beta=0.9)
    assert torch.allclose(torch.kron(stat[1][0], stat[0][0]),
                          0.1 * torch.kron(torch.outer(g, g), torch.outer(a, a)), atol=1e-12)
    assert torch.trace(stat[0][0]) == pytest.approx(1.0)  # A: the unit-trace direction
    assert torch.trace(stat[1][0]) == pytest.approx(0.1 * float(s.square().sum()))  # G carries e
    zero = torch.zeros(1, 1, 1, dtype=torch.float64)
    assert torch.equal(stat[2], zero) and torch.equal(stat[3], zero)  # a zero score leaves zero factors


def test_kfac_isolates_a_chain_with_non_finite_factors(generator):
    struct = KFAC(DIM, LAYERS)
    stat = [torch.eye(n, dtype=torch.float64).expand(4, n, n).clone() for n in (3, 2, 1, 1)]
    stat[0][1, 0, 0] = float("nan")
    v = torch.randn(4, DIM, generator=generator, dtype=torch.float64)
    for out in (struct.apply(struct.factorize(tuple(stat), RIDGE), v), struct.solve(tuple(stat), RIDGE, v)):
        assert torch.isnan(out[1, :6]).all()  # the chain's first layer
        assert torch.isfinite(out[[0, 2, 3]]).all()


def test_kfac_isolates_a_chain_whose_factor_lapack_cannot_decompose(generator, monkeypatch):
    """A finite factor on which eigh fails to converge (seen on one CPU for a chain blowing up between
    divergence checks) gives that chain NaN and leaves the other chains' solves exactly as they were."""
    struct = KFAC(DIM, LAYERS)
    factors = [torch.randn(4, n, n, generator=generator, dtype=torch.float64) for n in (3, 2, 1, 1)]
    stat = tuple(m @ m.mT + torch.eye(m.shape[-1], dtype=torch.float64) for m in factors)
    v = torch.randn(4, DIM, generator=generator, dtype=torch.float64)
    expected = struct.apply(struct.factorize(stat, RIDGE), v)
    real_eigh = torch.linalg.eigh
    marked = stat[1][2].clone()  # chain 2's G of the first layer: LAPACK "fails" on it

    def eigh(m):
        if any(torch.equal(x, marked) for x in (m if m.ndim == 3 else m[None])):
            raise torch.linalg.LinAlgError("linalg.eigh: the algorithm failed to converge")
        return real_eigh(m)

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    out = struct.apply(struct.factorize(stat, RIDGE), v)
    assert torch.isnan(out[2, :6]).all()  # the chain's first layer
    torch.testing.assert_close(out[2, 6:], expected[2, 6:], rtol=0, atol=0)
    torch.testing.assert_close(out[[0, 1, 3]], expected[[0, 1, 3]], rtol=1e-12, atol=1e-12)


def test_kfac_decomposes_in_float64_a_float32_factor_lapack_fails_on(generator, monkeypatch):
    """A finite float32 factor on which eigh fails (two chains of the MNIST KFAC laptop run) is decomposed
    in float64 and cast back: the chain keeps a finite solve, close to the one from float64 statistics, and
    the other chains' solves are exactly as they were."""
    struct = KFAC(DIM, LAYERS)
    factors = [torch.randn(4, n, n, generator=generator, dtype=torch.float64) for n in (3, 2, 1, 1)]
    stat64 = tuple(m @ m.mT + torch.eye(m.shape[-1], dtype=torch.float64) for m in factors)
    stat = tuple(m.float() for m in stat64)
    v = torch.randn(4, DIM, generator=generator, dtype=torch.float64)
    expected = struct.apply(struct.factorize(stat, RIDGE), v.float())
    real_eigh = torch.linalg.eigh
    marked = stat[1][2].clone()  # chain 2's G of the first layer: LAPACK "fails" on it in float32 only
    calls = []

    def eigh(m):
        if m.dtype == torch.float32 and any(torch.equal(x, marked) for x in (m if m.ndim == 3 else m[None])):
            raise torch.linalg.LinAlgError("linalg.eigh: the algorithm failed to converge")
        calls.append(m.dtype)
        return real_eigh(m)

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    out = struct.apply(struct.factorize(stat, RIDGE), v.float())
    assert torch.float64 in calls and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[[0, 1, 3]], expected[[0, 1, 3]], rtol=0, atol=0)
    exact = struct.apply(struct.factorize(stat64, RIDGE), v)
    torch.testing.assert_close(out[2].double(), exact[2], rtol=1e-4, atol=1e-5)


def test_kfac_decomposes_in_float64_a_float32_factor_that_comes_back_nan_without_an_error(generator, monkeypatch):
    """MKL's float32 eigh returned NaN without raising for two chains' factors in the MNIST KFAC laptop run:
    the NaN output is caught and that chain's factor decomposed in float64, the others untouched."""
    struct = KFAC(DIM, LAYERS)
    factors = [torch.randn(4, n, n, generator=generator, dtype=torch.float64) for n in (3, 2, 1, 1)]
    stat = tuple((m @ m.mT + torch.eye(m.shape[-1], dtype=torch.float64)).float() for m in factors)
    v = torch.randn(4, DIM, generator=generator)
    expected = struct.apply(struct.factorize(stat, RIDGE), v)
    real_eigh = torch.linalg.eigh

    def eigh(m):
        values, vectors = real_eigh(m)
        if m.dtype == torch.float32 and m.shape[-1] == 3:  # the first layer's A: chain 1 comes back NaN
            values, vectors = values.clone(), vectors.clone()
            (values[1] if m.ndim == 3 else values).fill_(float("nan"))
        return values, vectors

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    out = struct.apply(struct.factorize(stat, RIDGE), v)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[[0, 2, 3]], expected[[0, 2, 3]], rtol=0, atol=0)


def test_kfac_factors_on_which_mkl_float32_eigh_returns_nan():
    """The two output-gradient factors G of LeNet-5's third layer (128 x 128, float32) that stopped two chains
    of the MNIST KFAC laptop run (saved by tools/replay_divergences.py --save-stats from a first replay of
    that run, at git 1537d7b: chain 93 at step 4000, chain 22 at step 6500; the chapter's tables come from
    a second replay, at d07eb4b, which stopped the same chains at the same checks). With torch 2.14.1's MKL 2024.2 their
    float32 eigh returns NaN without an error; whatever this platform's LAPACK does, the factorisation must
    give finite eigenpairs that rebuild G."""
    from pathlib import Path

    from smp_core.preconditioners import _eigh_per_chain

    g = torch.load(Path(__file__).parent / "fixtures" / "kfac_g_float32_eigh_nan.pt")
    assert g.shape == (2, 128, 128) and g.dtype == torch.float32 and torch.isfinite(g).all()
    values, vectors, failed = _eigh_per_chain(g)
    assert not failed.any()
    assert torch.isfinite(values).all() and torch.isfinite(vectors).all()
    rebuilt = vectors.double() @ torch.diag_embed(values.double()) @ vectors.double().mT
    assert (rebuilt - g.double()).abs().max() < 1e-6 * g.abs().max()


def test_eigh_per_chain_flags_what_float64_cannot_decompose(generator, monkeypatch):
    """A non-finite element, and one whose float64 retry also comes back NaN, are flagged (the identity's
    decomposition in their place); the others keep their own eigenpairs."""
    from smp_core.preconditioners import _eigh_per_chain

    m = torch.randn(4, 3, 3, generator=generator)
    m = m @ m.mT + torch.eye(3)
    m[1, 1, 1] = float("nan")
    values, vectors, failed = _eigh_per_chain(m)
    assert failed.tolist() == [False, True, False, False]
    assert torch.equal(vectors[1], torch.eye(3)) and torch.isfinite(values).all()
    real_eigh, marked = torch.linalg.eigh, m[2].clone()

    def eigh(x):  # element 2 comes back NaN without an error, in float32 and in float64
        values, vectors = real_eigh(x)
        for i, xi in enumerate(x if x.ndim == 3 else x[None]):
            if torch.equal(xi.float(), marked):
                (values[i] if x.ndim == 3 else values).fill_(float("nan"))
        return values, vectors

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    values, vectors, failed = _eigh_per_chain(m[[0, 2, 3]])
    assert failed.tolist() == [False, True, False]
    torch.testing.assert_close(values[[0, 2]], real_eigh(m[[0, 3]])[0], rtol=0, atol=0)


def test_kfac_ema_keeps_the_fishers_trace_in_expectation(generator):
    # y = W [x, 1] + sigma eps with two outputs: the Fisher is exactly (I / sigma^2) (x) mean([x, 1][x, 1]^T),
    # and fixed-kfac holds it. Started there and fed scores simulated from the model at fixed theta, the EMA
    # must stay at the Fisher's trace in expectation, as ema-block and ema-dense do (E |s|^2 = tr F). Kept as
    # separate EMAs of the two factors, its trace would settle near (E |s|)^2 < E |s|^2 (0.6 tr F here).
    sigma, n, chains, steps, beta = 0.5, 30, 4000, 150, 0.9
    layer = KroneckerLayer(slice(0, 6), slice(6, 8), 2, 3)
    struct = KFAC(8, (layer,))
    x = torch.cat([torch.randn(n, 3, generator=generator, dtype=torch.float64),
                   torch.ones(n, 1, dtype=torch.float64)], dim=1)
    a_fisher, g_fisher = x.T @ x / n, torch.eye(2, dtype=torch.float64) / sigma**2
    trace_fisher = float(torch.trace(a_fisher) * torch.trace(g_fisher))
    # a deliberately unbalanced split of the same product: the EMA must not depend on it
    stat = (10.0 * a_fisher.expand(chains, 4, 4).clone(), 0.1 * g_fisher.expand(chains, 2, 2).clone())
    for _ in range(steps):
        rows = torch.randint(0, n, (chains,), generator=generator)
        residual = torch.randn(chains, 2, generator=generator, dtype=torch.float64) / sigma  # (y - mu) / sigma^2
        m = residual[:, :, None] * x[rows][:, None, :]  # (S, 2, 4) = [grad W, grad b]
        score = torch.cat([m[..., :3].reshape(chains, -1), m[..., 3]], dim=1)
        struct.ema_update_(stat, score, beta)
    traces = (stat[0].diagonal(dim1=1, dim2=2).sum(-1) * stat[1].diagonal(dim1=1, dim2=2).sum(-1))
    z = (traces.mean() - trace_fisher) / (traces.std() / chains**0.5)
    assert abs(float(z)) < 4.5, (float(traces.mean()), trace_fisher)


@pytest.mark.parametrize("structure", ["block", "dense", "kfac"])
def test_ema_refresh_solves_with_the_last_factorisation(structure, generator):
    # ema_refresh = 2: the statistic folds in every score (the same as the every-step EMA's), and the
    # solve after steps 1, 2 and 3 uses the factorisation of the statistic at steps 0, 2 and 2
    chains, refresh = 3, 2
    theta0 = torch.zeros(chains, DIM, dtype=torch.float64)
    pairs = []
    for layer in LAYERS:
        a = torch.randn(1, 4, layer.n_cols, generator=generator, dtype=torch.float64)
        g = torch.randn(1, 4, layer.n_out, generator=generator, dtype=torch.float64)
        pairs += [a.transpose(1, 2) @ a / 4, g.transpose(1, 2) @ g / 4]
    start = tuple(pairs) if structure == "kfac" else make_structure(structure, DIM, blocks=BLOCKS).outer_sum(
        _vectors(generator, 1))

    def curvature(theta):
        return tuple(m.clone() for m in start)

    kw = dict(dim=DIM, blocks=BLOCKS, layers=LAYERS, ridge=RIDGE)
    every_step = build_preconditioner(structure, "ema", **kw)
    refreshed = build_preconditioner(structure, "ema", ema_refresh=refresh, **kw)
    assert refreshed.hyper["ema_refresh"] == refresh and "ema_refresh" not in every_step.hyper
    state, state_every = refreshed.init(theta0, curvature), every_step.init(theta0, curvature)
    v = torch.randn(chains, DIM, generator=generator, dtype=torch.float64)
    last_refresh = every_step.dense_matrix(state_every)
    for k in range(1, 4):
        expected = torch.linalg.solve(last_refresh, v.unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(refreshed.solve(state, v), expected, atol=1e-8, rtol=1e-6), k
        s = torch.randn(chains, DIM, generator=generator, dtype=torch.float64)
        state = refreshed.update(state, k, theta0, s, curvature)
        state_every = every_step.update(state_every, k, theta0, s.clone(), curvature)
        assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(state.stat, state_every.stat, strict=True))
        if k % refresh == 0:
            last_refresh = every_step.dense_matrix(state_every)
    # at a refresh the factorisation is that of the current statistic: the every-step EMA's solve
    state = refreshed.update(state, 4, theta0, s, curvature)
    state_every = every_step.update(state_every, 4, theta0, s.clone(), curvature)
    assert torch.allclose(refreshed.solve(state, v), every_step.solve(state_every, v), atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("refresh, structure, strategy, match", [
    (0, "kfac", "ema", "positive integer"), (1.5, "kfac", "ema", "positive integer"),
    (5, "kfac", "fixed", "EMA of block, dense and kfac only"), (5, "diag", "ema", "element-wise"),
])
def test_ema_refresh_rejects_what_it_cannot_mean(refresh, structure, strategy, match):
    with pytest.raises(ValueError, match=match):
        build_preconditioner(structure, strategy, dim=DIM, blocks=BLOCKS, layers=LAYERS, ema_refresh=refresh)


def test_a_failed_float32_cholesky_is_redone_not_left_finite_and_wrong(generator):
    """A rank-5 float32 statistic with eigenvalues near 6e5 has, by rounding, negative eigenvalues far
    larger than the ridge: float32 Cholesky fails, and its factor used to give a finite answer about 100
    times off, with no error. The solve and the factorisation now invert the stored statistic's
    positive part in float64 exactly, as the kfac structure treats its factors (the reference below is
    that recipe computed independently; what rounding took from the statistic no recipe recovers);
    a non-finite chain gets NaN, alone."""
    n, ridge = 60, 1e-4
    a = torch.randn(n, 5, generator=generator) * 300
    stat = (a @ a.T)[None]  # float32
    ridged = stat + ridge * torch.eye(n)
    assert int(torch.linalg.cholesky_ex(ridged)[1]) != 0  # the case at hand
    values, vectors = torch.linalg.eigh(stat[0].double())
    reference = (vectors / (values.clamp_min(0) + ridge)) @ vectors.T  # (F_+ + ridge I)^-1
    v = torch.randn(3, n, generator=generator)
    struct = Dense(n)
    with pytest.warns(RuntimeWarning, match="statistic_dtype=torch.float64"):
        solved = struct.solve((stat,), ridge, v)
    with pytest.warns(RuntimeWarning, match="indefinite by more than the ridge"):
        factorised = struct.apply(struct.factorize((stat,), ridge), v)
    for out in (solved, factorised):
        torch.testing.assert_close(out.double(), v.double() @ reference, rtol=1e-4, atol=0)
    # per chain: chain 1 not finite, chain 0 as alone
    both = torch.stack([stat[0], torch.full((n, n), float("nan"))])
    with pytest.warns(RuntimeWarning, match="indefinite"):  # for the rounded chain (the NaN one alone: below)
        out = struct.solve((both,), ridge, v[:2])
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()
    torch.testing.assert_close(out[0].double(), v[0].double() @ reference, rtol=1e-4, atol=0)
    with warnings.catch_warnings():  # a diverged chain alone is the recursion's to report, not rounding
        warnings.simplefilter("error")
        assert torch.isnan(struct.solve((both[1:],), ridge, v[:1])).all()
    # and a matrix Cholesky takes is solved exactly as before
    good = torch.eye(n)[None] * 2
    torch.testing.assert_close(struct.solve((good,), ridge, v), v / (2 + ridge))


def _ema_of_mixed_scales(dtype_of_statistic, n_steps=400, dim=24, ridge=1e-4):
    """An EMA dense preconditioner (from the identity) fed float32 scores of two scales: along
    ``u = (1, ..., 1) / sqrt(d)`` near 1e4, orthogonal to it near 1e-1 per coordinate. Every entry of
    the statistic is then about 1e8 / d, which float32 rounds by about 0.2 at each update: far above the
    ridge and the small directions' eigenvalues (about 1e-2). Float64 rounds it by about 1e-9. Returns
    the preconditioner, its state, its solve of a vector orthogonal to ``u`` and the exact answer (the
    same EMA of the same float32 scores in float64, solved in float64)."""
    generator = torch.Generator().manual_seed(3)
    u = torch.ones(dim) / dim**0.5
    precond = build_preconditioner("dense", "ema", dim=dim, ridge=ridge, beta=0.98, ema_init="identity",
                                   statistic_dtype=dtype_of_statistic)
    theta0 = torch.zeros(1, dim)
    state = precond.init(theta0, None)
    exact = torch.eye(dim, dtype=torch.float64)[None]
    for k in range(1, n_steps + 1):
        small = 0.1 * torch.randn(1, dim, generator=generator)
        small -= (small @ u)[:, None] * u
        score = 1e4 * torch.randn(1, 1, generator=generator) * u + small  # float32, as the chains'
        state = precond.update(state, k, theta0, score, None)
        s64 = score.double()
        exact = 0.98 * exact + 0.02 * s64[:, :, None] * s64[:, None, :]
    v = torch.zeros(1, dim)
    v[0, 0], v[0, 1] = 1.0, -1.0  # orthogonal to u
    exact_solve = torch.linalg.solve(exact + ridge * torch.eye(dim, dtype=torch.float64), v.double()[..., None])
    return precond, state, precond.solve(state, v), exact_solve[..., 0]


def test_a_float64_statistic_keeps_the_small_directions_that_float32_rounds_away():
    """statistic_dtype=float64: the EMA statistic and its solve in float64 while the chains (scores,
    parameters, the returned step) stay float32; its solve agrees with the exact one (norm-wise). The
    same run with the chains' float32 statistic misses it by a wide margin (the reason for the option;
    this part checks that the case at hand is one rounding spoils)."""
    precond, state, solved, exact = _ema_of_mixed_scales(torch.float64)
    assert state.stat[0].dtype == torch.float64 and solved.dtype == torch.float32
    assert precond.hyper["statistic_dtype"] == "float64" and precond.statistic_dtype == torch.float64
    # norm-wise: the statistic's condition number is about 1e10, so even float64 solves agree to about 1e-6
    assert float((solved.double() - exact).norm() / exact.norm()) < 1e-4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the float32 statistic may be indefinite: it warns
        _, state32, solved32, _ = _ema_of_mixed_scales(None)
    assert state32.stat[0].dtype == torch.float32
    assert float((solved32.double() - exact).norm() / exact.norm()) > 0.1


@pytest.mark.parametrize("structure, strategy", [("block", "fixed"), ("dense", "periodic"), ("kfac", "ema"),
                                                 ("kfac", "fixed"), ("block", "ema")])
def test_statistic_dtype_changes_the_precision_not_the_preconditioner(generator, structure, strategy):
    """With a well-conditioned statistic, a float64 one gives the float32 one's solves to float32
    precision, in the input's dtype, for every strategy (the factorised and the direct solves, ema_refresh too)."""
    vectors = _vectors(generator, 1).float()
    stat = (vectors.transpose(1, 2) @ vectors / vectors.shape[1] + 0.5 * torch.eye(DIM),)
    if structure == "kfac":
        stat = tuple(m for layer in LAYERS for m in (torch.eye(layer.n_cols)[None] * 0.7, torch.eye(layer.n_out)[None]))
    elif structure == "block":
        stat = tuple(stat[0][:, b, b] for b in BLOCKS)
    theta0 = torch.zeros(2, DIM)
    score = torch.randn(2, DIM, generator=generator)
    v = torch.randn(2, DIM, generator=generator)
    for refresh in (1, 3) if strategy == "ema" else (1,):
        out = {}
        for dtype in (None, torch.float64):
            precond = build_preconditioner(structure, strategy, dim=DIM, blocks=BLOCKS, layers=LAYERS, ridge=RIDGE,
                                           period=2, ema_refresh=refresh, statistic_dtype=dtype)
            state = precond.init(theta0, lambda theta: tuple(m.clone() for m in stat))
            assert all(m.dtype == (dtype or torch.float32) for m in state.stat)
            state = precond.update(state, 2, theta0, score, lambda theta: tuple(m.clone() for m in stat))
            out[dtype] = precond.solve(state, v)
            assert out[dtype].dtype == torch.float32
        torch.testing.assert_close(out[torch.float64], out[None], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("structure, dtype, match", [
    ("diag", torch.float64, "sum of squares"), ("none", torch.float64, "not to 'none'"),
    ("dense", torch.float16, "float32, torch.float64 or None"), ("dense", "double precision", "or None"),
    ("block", 64, "or None"),
])
def test_statistic_dtype_rejects_what_it_cannot_mean(structure, dtype, match):
    with pytest.raises(ValueError, match=match):
        build_preconditioner(structure, "ema", dim=DIM, blocks=BLOCKS, statistic_dtype=dtype)


def test_statistic_dtype_takes_a_name():
    precond = build_preconditioner("dense", "fixed", dim=DIM, statistic_dtype="float64")
    assert precond.statistic_dtype == torch.float64
    assert "statistic_dtype" not in build_preconditioner("dense", "fixed", dim=DIM).hyper  # old keys unchanged


def test_the_rounding_warning_is_one_text_and_not_for_a_singular_statistic_without_a_ridge(generator):
    """The warning's text does not change with the counts (the warnings filter then shows it once per
    place, not once per count); a singular float32 statistic with ridge 0 gives infinity or NaN and no
    warning (no dtype would help it), and neither does a float64 statistic."""
    a = torch.randn(40, 5, generator=generator) * 300
    rank5 = (a @ a.T)[None]
    v = torch.randn(2, 40, generator=generator)
    struct = Dense(40)
    for stat in (rank5, torch.cat([rank5, 2 * rank5])):
        with pytest.warns(RuntimeWarning) as caught:
            struct.solve((stat,), 1e-4, v[: stat.shape[0]])
        assert [str(w.message) for w in caught] == [preconditioners_module.ROUNDED_STATISTIC_WARNING]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = struct.solve((rank5,), 0.0, v[:1])
        assert not torch.isfinite(out).all()
        struct.solve((rank5.double(),), 1e-4, v[:1].double())


def test_a_zero_pivot_is_redone_not_raised_for_the_whole_batch():
    """A statistic whose ridged matrix has an exact zero pivot ([[1, 1], [1, 1]]; met in a float32 Fisher
    with eigenvalues in the thousands, a small tanh regression network with sigma = 0.1): cholesky_ex's
    partial factor then holds a 0 on its diagonal, on which cholesky_inverse raised for the whole batch
    (a fixed dense run failed at its start with LinAlgError). Both the factorisation and the direct solve
    now redo that element from its positive part, leave the good element alone, and warn once."""
    ridge = 0.5
    zero_pivot = torch.tensor([[1.0, 1.0], [1.0, 1.0]]) - ridge * torch.eye(2)   # ridged: exactly [[1, 1], [1, 1]]
    good = torch.tensor([[2.0, 0.5], [0.5, 1.0]])
    stat = torch.stack([zero_pivot, good])
    positive_part = torch.tensor([[0.75, 0.75], [0.75, 0.75]], dtype=torch.float64)  # eigenvalues 1.5 and (-0.5 -> 0)
    expected = torch.stack([torch.linalg.inv(positive_part + ridge * torch.eye(2, dtype=torch.float64)),
                            torch.linalg.inv(good.double() + ridge * torch.eye(2, dtype=torch.float64))]).float()
    struct = Dense(2)
    with pytest.warns(RuntimeWarning, match="indefinite by more than the ridge"):
        (inverse,) = struct.factorize((stat,), ridge)
    torch.testing.assert_close(inverse, expected)
    v = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    with pytest.warns(RuntimeWarning, match="indefinite by more than the ridge"):
        solved = struct.solve((stat,), ridge, v)
    torch.testing.assert_close(solved, (expected @ v[:, :, None])[:, :, 0])


def test_of_chain_cuts_the_per_chain_tensors_and_keeps_the_shared_ones(generator):
    """A periodic state after a recomputation at per-chain parameters: its statistic and factor have
    one row per chain, while a fixed state's are shared (leading size 1). of_chain(i) gives chain i's
    rows (negative indices count from the end) and leaves shared tensors alone; a bad index is refused."""
    precond = build_preconditioner("block", "periodic", dim=DIM, blocks=BLOCKS, ridge=RIDGE, period=1)
    vectors = _vectors(generator, 3)

    def curvature(theta):
        return precond.structure.outer_sum(vectors[: theta.shape[0]])

    shared = precond.init(torch.zeros(3, DIM, dtype=torch.float64), curvature)  # one start: C = 1
    assert all(t.shape[0] == 1 for t in shared.stat)
    assert shared.of_chain(2) is shared  # every chain's
    state = precond.update(shared, 1, torch.randn(3, DIM, generator=generator, dtype=torch.float64), None, curvature)
    assert all(t.shape[0] == 3 for t in (*state.stat, *state.factor))
    one = state.of_chain(-1)
    for a, b in zip((*one.stat, *one.factor), (*state.stat, *state.factor), strict=True):
        assert torch.equal(a, b[2:3])
    v = torch.randn(1, DIM, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(precond.solve(one, v), precond.solve(state, v.expand(3, DIM))[2:3])
    for bad in (3, -4, 1.0, True):
        with pytest.raises(ValueError, match="chain must be an integer index"):
            state.of_chain(bad)
