"""Bad input to the library's public callables: a clear error that names the argument, before any work.

One table of (callable, bad argument, expected error); the neighbours of each case (wrong type, wrong shape, NaN
or infinite, out of range, a string for a number, a state or model from elsewhere) sit beside it. The checks of
``run_smp``'s counts and options are in ``test_recursion.py``, those of the preconditioners' settings in
``test_preconditioners.py``.
"""

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import smp_core
from smp_core import (
    SMP,
    Bernoulli,
    Categorical,
    Fisher,
    Gaussian,
    ParamLayout,
    RunOptions,
    Structure,
    add_gaussian_tail,
    as_chain_model,
    build_preconditioner,
    choose_tau,
    estimate_fisher,
    fisher_vectors,
    gaussian_tail,
    get_likelihood,
    lenet5,
    preconditioner_from_name,
    predict,
    predictive_nll,
    residual_variance_ratio,
    run_smp,
    tail_variance,
    toy_mlp,
)
from smp_core.preconditioners import Diagonal, ema, fixed, make_structure, periodic


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


X = torch.randn(20, 3)
KW = dict(n_steps=3, n_chains=2, progress=False)


def _sampler(**kw):
    return SMP(_net(), "bernoulli", X, tau=0.3, **kw)


CASES = [
    # the Fisher's data
    ("run_smp fisher", lambda: run_smp(_net(), "bernoulli", X, preconditioner="fixed-diag",
                                       fisher=Fisher("empirical", torch.randn(5, 7), torch.ones(5)), **KW),
     ValueError, r"fisher: the Fisher's inputs have shape \(5, 7\).*\(3,\)"),
    ("run_smp fisher", lambda: run_smp(_net(), "bernoulli", X, preconditioner="fixed-diag",
                                       fisher=Fisher("empirical", torch.randn(5, 3), torch.ones(4)), **KW),
     ValueError, r"fisher: the Fisher's y has shape \(4,\)"),
    # the likelihood
    ("Gaussian sigma", lambda: Gaussian(math.inf), ValueError, "sigma.*finite number > 0, got inf"),
    ("Gaussian sigma", lambda: Gaussian(math.nan), ValueError, "sigma.*finite number > 0"),
    ("Gaussian sigma", lambda: Gaussian(0.0), ValueError, "sigma.*finite number > 0"),
    ("Gaussian sigma", lambda: Gaussian(-1.0), ValueError, "sigma.*finite number > 0"),
    ("Gaussian sigma", lambda: Gaussian("0.3"), ValueError, "sigma.*finite number > 0, got '0.3'"),
    ("Gaussian sigma", lambda: Gaussian(True), ValueError, "sigma.*finite number > 0, got True"),
    ("Gaussian sigma", lambda: Gaussian(None), ValueError, "sigma.*finite number > 0, got None"),
    ("run_smp likelihood", lambda: run_smp(_net(), "gaussian", X, **KW), ValueError,
     r"'gaussian' needs its noise standard deviation: pass smp_core.Gaussian\(sigma\)"),
    ("get_likelihood", lambda: get_likelihood("gaussian"), ValueError, r"smp_core.Gaussian\(sigma\)"),
    ("get_likelihood", lambda: get_likelihood("poisson"), ValueError, "unknown likelihood 'poisson'"),
    # the preconditioner's factories
    ("fixed structure", lambda: fixed(None), TypeError, "structure must be one of"),
    ("fixed structure", lambda: fixed(3), TypeError, "structure must be one of"),
    ("fixed structure", lambda: fixed("kron"), ValueError, "unknown preconditioner structure 'kron'"),
    ("fixed ridge", lambda: fixed("diag", ridge="1e-3"), ValueError, "ridge lambda must be a finite number"),
    ("fixed ridge", lambda: fixed("diag", ridge=math.inf), ValueError, "ridge lambda must be a finite number"),
    ("fixed ridge", lambda: fixed("diag", ridge=-1.0), ValueError, "ridge lambda must be a finite number >= 0"),
    ("ema beta", lambda: ema("diag", beta="0.9"), ValueError, "beta must lie in"),
    ("ema structure", lambda: ema(None), TypeError, "structure must be one of"),
    ("periodic period", lambda: periodic("diag", period="500"), ValueError, "period T must be a positive integer"),
    ("periodic period", lambda: periodic("diag", period=2.5), ValueError, "period T must be a positive integer"),
    # x_train
    ("run_smp x_train", lambda: run_smp(_net(), "bernoulli", torch.randn(20), **KW), ValueError,
     r"x_train must have shape \(N, \*one input's shape\)"),
    # SMP.advance: its own settings, and a state from elsewhere
    ("advance trace_every", lambda: _sampler().advance(_sampler().init(n_chains=2), 3, trace_every=0),
     ValueError, "trace_every must be a whole number >= 1, got 0"),
    ("advance trace_every", lambda: _sampler().advance(_sampler().init(n_chains=2), 3, trace_every=-1),
     ValueError, "trace_every must be a whole number >= 1"),
    ("advance trace_every", lambda: _sampler().advance(_sampler().init(n_chains=2), 3, trace_every=2.5),
     ValueError, "trace_every must be a whole number >= 1"),
    ("advance cuda_graph", lambda: _sampler().advance(_sampler().init(n_chains=2), 3, cuda_graph="yes"),
     TypeError, "cuda_graph must be True, False or None"),
    ("advance on_check", lambda: _sampler().advance(_sampler().init(n_chains=2), 3, on_check=5),
     TypeError, "on_check must be a function"),
    ("advance until", lambda: _sampler().advance(_sampler().init(n_chains=2), "3"), ValueError,
     r"until \(the step to advance to\) must be a whole number"),
    ("advance state", lambda: _sampler().advance({"theta": torch.zeros(2, 21)}, 3), TypeError,
     "state must be an SMPState"),
    ("advance state", lambda: _sampler().advance(
        SMP(nn.Sequential(nn.Linear(3, 1)), "bernoulli", X).init(n_chains=2), 3), ValueError,
     "state does not come from this sampler: its theta has shape \\(2, 4\\).*d = 21"),
    ("advance state", lambda: _sampler(preconditioner="ema-diag").advance(_sampler().init(n_chains=2), 3),
     ValueError, "state does not come from this sampler: its preconditioner state does not fit the ema-diag"),
    # predict
    ("predict model", lambda: predict("net", torch.zeros(2, 21), X), TypeError, "model must be a torch.nn.Module"),
    ("predict x", lambda: predict(_net(), torch.zeros(2, 21), torch.randn(4, 5)), ValueError,
     r"cannot take inputs of shape \(5,\) \(one input, as x's rows have it\)"),
    ("predict x", lambda: predict(_net(), torch.zeros(2, 21), np.zeros((4, 3))), ValueError,
     "x must be a tensor of inputs"),
    ("predict theta", lambda: predict(_net(), torch.zeros(2, 20), X), ValueError, r"theta must have shape \(S, 21\)"),
    ("predict batch_size", lambda: predict(_net(), torch.zeros(2, 21), X, batch_size=0), ValueError,
     "batch_size must be a whole number >= 1"),
    # the Gaussian tail
    ("add_gaussian_tail result", lambda: add_gaussian_tail("result", _net(), "bernoulli", X), TypeError,
     "result must be the SMPResult of run_smp"),
    ("add_gaussian_tail k_to", lambda: add_gaussian_tail(_run(), _net(), "bernoulli", X, k_to=2), ValueError,
     r"the step the tail ends at must be an integer >= 3"),
    ("add_gaussian_tail n_scores", lambda: add_gaussian_tail(_run(), _net(), "bernoulli", X, n_scores=0),
     ValueError, "n_scores must be a whole number >= 1"),
    ("add_gaussian_tail x_train", lambda: add_gaussian_tail(_run(), _net(), "bernoulli", torch.randn(20, 5)),
     ValueError, r"x_train has inputs of shape \(5,\), the model expects \(3,\)"),
    ("gaussian_tail tau", lambda: gaussian_tail(_net(), "bernoulli", X, *_tail_args(), tau=-1.0, k_from=3),
     ValueError, "tau must be a positive finite number"),
    ("gaussian_tail k_from", lambda: gaussian_tail(_net(), "bernoulli", X, *_tail_args(), tau=1.0, k_from=-1),
     ValueError, "the step the tail starts from must be a non-negative integer"),
    ("tail_variance n_obs", lambda: tail_variance(-1, 5), ValueError, "N must be a non-negative integer"),
    ("tail_variance tau", lambda: tail_variance(10, 5, None, "1"), ValueError, "tau"),
    ("residual_variance_ratio", lambda: residual_variance_ratio("10", 5), ValueError,
     r"n_obs \(N\) must be a whole number >= 0"),
    ("residual_variance_ratio", lambda: residual_variance_ratio(10, math.nan), ValueError,
     r"n_steps \(K\) must be a whole number >= 0"),
    # models and layouts
    ("as_chain_model module", lambda: as_chain_model("net"), TypeError, "expected a torch.nn.Module"),
    ("as_chain_model input_shape", lambda: as_chain_model(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten()), "28"),
     ValueError, "input_shape must be a tuple of positive integers"),
    ("as_chain_model input_shape", lambda: as_chain_model(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten()),
                                                          (1, 0, 5)), ValueError, "input_shape must be a tuple"),
    ("lenet5 dropout", lambda: lenet5("0.5"), ValueError, "dropout"),
    ("lenet5 dropout", lambda: lenet5(1.0), ValueError, "dropout"),
    ("toy_mlp", lambda: toy_mlp(3), TypeError, "takes 0 positional arguments"),
    ("ParamLayout module", lambda: ParamLayout.from_module("net"), TypeError, "module must be a torch.nn.Module"),
    ("ParamLayout module", lambda: ParamLayout.from_module(nn.ReLU()), ValueError, "the module has no parameters"),
    # the Fisher
    ("estimate_fisher x", lambda: estimate_fisher(as_chain_model(_net()), "bernoulli", torch.zeros(2, 21),
                                                  torch.randn(5, 7)), ValueError,
     r"the Fisher data x has inputs of shape \(7,\), the model takes inputs of shape \(3,\)"),
    ("estimate_fisher structure", lambda: estimate_fisher(as_chain_model(_net()), "bernoulli", torch.zeros(2, 21), X,
                                                          structure="kron"), ValueError,
     "unknown preconditioner structure 'kron'"),
    ("estimate_fisher theta", lambda: estimate_fisher(as_chain_model(_net()), "bernoulli", torch.zeros(2, 5), X),
     ValueError, r"theta must have shape \(B, 21\)"),
    ("estimate_fisher kind", lambda: estimate_fisher(as_chain_model(_net()), "bernoulli", torch.zeros(2, 21), X,
                                                     kind="observed"), ValueError, "unknown Fisher kind 'observed'"),
    ("fisher_vectors x", lambda: fisher_vectors(as_chain_model(_net()), "bernoulli", torch.zeros(2, 21),
                                                torch.randn(5, 3)), ValueError, "x has 5 rows but theta has 2"),
    ("Fisher kind", lambda: run_smp(_net(), "bernoulli", X, fisher=Fisher("observed"), **KW), ValueError,
     "fisher must be 'model' .*or 'empirical', got 'observed'"),
    # preconditioners by name and by structure
    ("preconditioner_from_name", lambda: preconditioner_from_name(3), TypeError, "name must be a string"),
    ("preconditioner_from_name", lambda: preconditioner_from_name("fixed-kron"), ValueError,
     "unknown preconditioner structure 'kron'"),
    ("build_preconditioner strategy", lambda: build_preconditioner("diag", "weekly", dim=5), ValueError,
     "unknown temporal strategy 'weekly'"),
    ("build_preconditioner dim", lambda: build_preconditioner("diag", "fixed", dim=-1), ValueError,
     "dim, the number of parameters d, must be a whole number >= 1"),
    ("Structure name", lambda: make_structure("kron", 5), ValueError, "unknown preconditioner structure 'kron'"),
    ("Structure itself", lambda: Structure("diag", 5), TypeError, "make_structure"),
    ("Structure dim", lambda: Diagonal(2.5), ValueError, "dim, the number of parameters d"),
    ("RunOptions", lambda: RunOptions(check_every=0).checked(), ValueError, "check_every"),
    # likelihoods' responses
    ("Bernoulli y", lambda: Bernoulli().log_prob(torch.zeros(3, 1), torch.tensor([0.0, 2.0, 1.0])), ValueError,
     "must be 0 or 1"),
    ("Categorical y", lambda: Categorical().log_prob(torch.zeros(3, 2), torch.tensor([0, 5, 1])), ValueError,
     r"integer class labels in \[0, 2\)"),
    # the initial state
    ("SMP seed", lambda: _sampler().init(n_chains=2, seed=-1), ValueError, r"seed must be in \[0, 2\*\*63\)"),
    ("SMP theta0", lambda: _sampler().init(theta0=torch.zeros(5), n_chains=2), ValueError,
     "theta0 has 5 entries, the model has d = 21"),
    ("SMP model", lambda: SMP("net", "bernoulli", X), TypeError, "model must be a torch.nn.Module"),
    # held-out scores and the choice of tau (more in test_tuning.py)
    ("predictive_nll y", lambda: predictive_nll(_net(), "bernoulli", torch.zeros(2, 21), X, torch.zeros(5)),
     ValueError, r"y must hold one response per row of x \(20\)"),
    ("choose_tau taus", lambda: choose_tau(_net(), "bernoulli", X, X, torch.zeros(20), []), ValueError,
     "taus must be a non-empty sequence"),
]

# Public callables whose bad input is tested in another file (the rest are in CASES above).
ELSEWHERE = {
    "run_smp": "test_recursion.py::test_bad_input_gets_a_clear_error and test_bad_objects_get_a_type_error...",
    "get_likelihood": "CASES", "metrics": "test_metrics.py (the shared checks of probs, labels, bins, sigma and level)",
    "preconditioners": "test_preconditioners.py (the factories' settings)",
    "SMPResult": "a result is made by run_smp, never by hand", "SMPState": "CASES: advance state",
    "ChainModel": "a protocol", "DivergenceError": "an exception", "Preconditioner": "CASES: fixed, ema, periodic",
}


def _run():
    return run_smp(_net(), "bernoulli", X, **KW)


def _tail_args():
    res = run_smp(_net(), "bernoulli", X, preconditioner="fixed-diag", **KW)
    return res.theta, res.preconditioner, res.precond_state


def test_the_table_covers_every_public_callable():
    named = {what.split()[0] for what, *_ in CASES} | set(ELSEWHERE)
    public = {name for name in smp_core.__all__ if not name.startswith("_")}
    assert public - named == set(), f"no bad-input case for {sorted(public - named)}"


@pytest.mark.parametrize("what, call, error, match", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_gets_a_clear_error_naming_the_argument(what, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_refused_advance_leaves_the_state_as_it_was():
    sampler = _sampler(preconditioner="ema-diag")
    state = sampler.init(n_chains=3, seed=1)
    theta, stat = state.theta.clone(), state.precond.stat[0].clone()
    for bad in (dict(trace_every=0), dict(cuda_graph="yes"), dict(on_check=1)):
        with pytest.raises((TypeError, ValueError)):
            sampler.advance(state, 5, **bad)
    assert state.step == 0 and torch.equal(state.theta, theta) and torch.equal(state.precond.stat[0], stat)


def test_predict_takes_the_module_and_leaves_out_rows_that_diverged():
    net = _net()
    theta = torch.randn(4, 21)
    from_chain_model = predict(as_chain_model(net), theta, X)
    assert torch.equal(predict(net, theta, X), from_chain_model)  # the same function_call per row
    theta[2] = math.nan
    with pytest.warns(UserWarning, match="1 of 4 rows of theta hold NaN"):
        kept = predict(net, theta, X)
    assert kept.shape == (3, 20, 1) and torch.equal(kept, from_chain_model[[0, 1, 3]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        predict(net, theta[[0, 1]], X)  # finite rows: no warning


def test_a_gaussian_run_records_its_sigma():
    net = _net()
    result = run_smp(net, smp_core.Gaussian(0.3), X, **KW)
    assert result.config["likelihood"] == "gaussian" and result.config["sigma"] == 0.3
    assert "sigma" not in run_smp(net, "bernoulli", X, **KW).config
