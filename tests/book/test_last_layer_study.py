"""The last-layer study: SMP on features equals SMP on the whole network with the other layers frozen;
laplace-torch's last-layer draws; the verdicts' criteria."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from smp_book import last_layer_runs as llr
from smp_book import last_layer_study as lls
from smp_core.models import as_chain_model, lenet5, predict
from smp_core.recursion import Fisher, run_smp

INPUT_SHAPE = (1, 28, 28)


@pytest.fixture(scope="module")
def tiny():
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():  # the network's initial weights from a seed, not from whatever ran before
        torch.manual_seed(0)
        theta = torch.nn.utils.parameters_to_vector(lenet5().parameters()).detach() * 3  # away from zero
    data = {"train": (torch.rand(40, 1, 28, 28, generator=g), torch.randint(0, 10, (40,), generator=g)),
            "val": (torch.rand(30, 1, 28, 28, generator=g), torch.randint(0, 10, (30,), generator=g))}
    return theta, data


@pytest.mark.parametrize("layers", [1, 2])
def test_body_then_head_is_the_network(tiny, layers):
    theta, data = tiny
    body, head = llr.split(theta, layers)
    x = data["val"][0]
    whole = predict(as_chain_model(lenet5(), INPUT_SHAPE), theta[None], x)[0]
    with torch.no_grad():
        assert torch.allclose(head(body(x)), whole, atol=1e-5)


@pytest.mark.parametrize(("layers", "variant"), [(1, "fixed-diag"), (1, "ema-kfac"), (2, "periodic-diag")])
def test_smp_on_features_equals_smp_on_the_frozen_network(tiny, layers, variant):
    """The study's shortcut: the same chains as SMP on LeNet-5 with all but the last layer frozen, in float64."""
    theta, data = tiny
    data = {k: (x.double(), y) for k, (x, y) in data.items()}
    body, head = llr.split(theta, layers)
    body, head = body.double(), head.double()
    feats = llr.features(body, data)
    cfg = {"ridge": 1e-4, "period": 5, "ema_refresh": 3, "n_fisher_periodic": 10, "n_steps": 12, "n_chains": 4,
           "seed": 7, "tau": {"fixed": 0.05, "ema": 0.08, "periodic": 0.05, "none": 1.0}}
    short = llr.run_variant(cfg, head, feats, variant, index=0, progress=False)

    net = lenet5().double()
    torch.nn.utils.vector_to_parameters(theta.double(), net.parameters())
    cut = len(net) - len(head)
    for p in net[:cut].parameters():
        p.requires_grad_(False)
    model = as_chain_model(net, INPUT_SHAPE)
    theta0 = torch.nn.utils.parameters_to_vector(net[cut:].parameters()).detach()
    from smp_core.fisher import kronecker_layers
    from smp_core.preconditioners import preconditioner_from_name

    precond = preconditioner_from_name(variant, dim=model.layout.dim, blocks=model.layout.block_slices,
                                       layers=kronecker_layers(model) if variant.endswith("kfac") else (),
                                       ridge=1e-4, period=5, ema_init="fisher",
                                       ema_refresh=3 if "ema" in variant else 1)
    xv, yv = data["val"]
    n_fisher = 10 if variant.startswith("periodic") else None  # the periodic Fisher's first images
    full = run_smp(net, "categorical", data["train"][0], theta0=theta0, preconditioner=precond,
                   tau=cfg["tau"][variant.split("-")[0]], n_steps=12, n_chains=4, seed=cfg["seed"] + llr.SEED_OFFSET,
                   fisher=Fisher("empirical", xv[:n_fisher], yv[:n_fisher]), progress=False)
    d = {1: 850, 2: 128 * 84 + 84 + 850}[layers]
    assert short.theta.shape == full.theta.shape == (4, d)
    assert short.theta.dtype == torch.float64
    # The two routes round differently (features computed once against the whole network at each step), and the
    # EMA-KFAC's eigendecompositions amplify that to about 1e-11 of the chains' largest move (8e-11 of 8.5, measured
    # at one and two threads; 1e-15 for the diagonals): 1e-8 of it leaves a margin of 1000 and still catches any
    # other update. The chains move by 5 to 8.5 from this fixture's seeded start.
    moved = (full.theta - theta0).abs().max()
    assert moved > 0.1  # the chains moved
    assert (short.theta - full.theta).abs().max() <= 1e-8 * moved


def test_laplace_torch_draws_the_last_layer_around_the_map(tiny):
    theta, data = tiny
    cfg = {"seed": 1, "laplace": {"hessian_structure": "full", "prior_precision": "marglik", "n_samples": 400}}
    fit = lls.fit_laplace(cfg, theta, data)
    draws = fit["theta"]
    last = theta[-850:]
    assert draws.shape == (400, 850) and torch.isfinite(draws).all() and fit["prior_precision"] > 0
    # the draws' mean is the MAP's last layer, within Monte Carlo error (z-scores of 400 draws per coordinate)
    z = (draws.mean(0) - last) / (draws.std(0) / 20)
    assert z.abs().max() < 5.5, z.abs().max()  # 850 coordinates: P(max |z| > 5.5) < 1e-5 under the truth
    # the draws' logits have laplace-torch's own linearised (GLM) variance: the parameter order of the draws
    # is the Linear layer's; 400 draws give each variance to about 7 % (sd), so 35 % is five sd
    body, head = llr.split(theta, 1)
    x = data["val"][0][:5]
    with torch.no_grad():
        logits = predict(as_chain_model(head), draws, body(x))  # (400, 5, 10)
    _, f_var = fit["la"]._glm_predictive_distribution(x)
    ratio = logits.var(0) / torch.diagonal(f_var, dim1=-2, dim2=-1)
    assert ((ratio > 0.65) & (ratio < 1.35)).all(), ratio


def test_verdicts_apply_the_stated_bars():
    scores = pd.DataFrame({"mutual_info": [0.0, 0.05, 0.006, 0.004, 0.2], "ece": [0.01, 0.02, 0.03, 0.05, 0.01]},
                          index=["MAP", "Ensemble (5)", "a", "b", "c"])
    leads = pd.DataFrame({0: [float("nan"), 9.0, 1.0, 1.0, 1.0], 60: [float("nan"), 30.0, 2.5, 1.9, 5.0]},
                         index=scores.index)
    v = lls.verdicts(scores, leads, "Ensemble (5)", 60)
    assert (v.loc[["MAP", "Ensemble (5)"], "all_three"] == "reference").all()  # they set the bars
    judged = v.loc[["a", "b", "c"]]
    assert list(judged["non_degenerate"]) == [True, False, True]  # bar: 0.005
    assert list(judged["calibrated"]) == [True, False, True]  # bar: 2 x 0.02
    assert list(judged["helps_under_shift"]) == [True, False, True]  # bar: 2 standard errors at 60 degrees
    assert list(judged["all_three"]) == [True, False, True]


def test_split_refuses_a_cut_that_lenet_does_not_have():
    theta = torch.nn.utils.parameters_to_vector(lenet5().parameters()).detach()
    for layers in (0, 4, 1.0, True):
        with pytest.raises(ValueError, match="layers must be an integer from 1 to 3"):
            llr.split(theta, layers)


def test_a_run_is_cached_by_what_it_starts_from(tiny, tmp_path, monkeypatch):
    """Another MAP (the sampled layers' start) or other features run again; the same ones are read back."""
    theta, data = tiny
    cfg = {"ridge": 1e-4, "period": 5, "ema_refresh": 3, "n_fisher_periodic": 10, "n_steps": 4, "n_chains": 2,
           "seed": 7, "tau": {"fixed": 0.05, "ema": 0.08, "periodic": 0.05, "none": 1.0}}
    calls = []
    original = llr.run_variant
    monkeypatch.setattr(llr, "run_variant", lambda *a, **k: calls.append(1) or original(*a, **k))

    def run(theta):
        body, head = llr.split(theta, 1)
        feats = llr.features(body, data)
        return llr.run(cfg, "last layer", "fixed-diag", 0, head, feats, progress=False, cache_root=tmp_path)

    first = run(theta)
    assert torch.equal(run(theta)["theta"], first["theta"]) and len(calls) == 1
    run(theta * 1.01)  # another MAP: other features and another start
    assert len(calls) == 2
