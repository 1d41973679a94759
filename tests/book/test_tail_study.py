"""The Gaussian-tail study: its agreement rule on hand-made ratios, and one tiny replicate end to end."""

from __future__ import annotations

import pandas as pd
import pytest

from smp_book import tail_study as tl
from smp_book.config import get_config
from smp_book.results import config_key


def _ratios(values: dict[str, list[float]], grid=(50, 500, 1000)) -> pd.DataFrame:
    rows = [{"method": m, "tail_from": k, "logits": v, "params": v} for m, vs in values.items()
            for k, v in zip(grid, vs, strict=True)]
    return pd.DataFrame(rows).set_index(["method", "tail_from"])


def test_agreement_is_the_first_k0_from_which_every_ratio_is_within_the_factor():
    agree = tl.agreement(_ratios({
        "SMP-a": [1.0, 1.1, 0.9],   # everywhere
        "SMP-b": [0.5, 1.2, 0.85],  # from 500
        "SMP-c": [1.0, 0.5, 1.0],   # disagrees at 500: only from 1000
        "SMP-d": [1.0, 1.0, 1.3],   # not at the largest K0: none
    }))
    col = agree["agrees in logits from K0"]
    assert col["SMP-a"] == 50 and col["SMP-b"] == 500 and col["SMP-c"] == 1000
    assert pd.isna(col["SMP-d"])


def test_sampler_names_order():
    assert tl.sampler_names([500, 50]) == ["hybrid from 50", "hybrid from 500", tl.RECURSION, tl.TO_INFINITY]


@pytest.mark.parametrize("tail_from", [[100], [0], []])
def test_stops_must_lie_inside_the_run(tail_from):
    cfg = {**get_config("toy_tail", "ci"), "n_steps": 100, "tail_from": tail_from}
    with pytest.raises(ValueError, match="tail_from"):
        tl.run_replicate(cfg, 0)


@pytest.mark.slow
def test_one_tiny_replicate():
    cfg = {**get_config("toy_tail", "ci"), "n_train": 60, "n_test": 50, "nuts_warmup": 30, "nuts_samples": 30,
           "n_chains": 6, "n_steps": 100, "tail_from": [50], "tail_scores": 10, "variants": ["none", "ema-block"]}
    run = tl.run_replicate(cfg, 0)
    summary = tl.tables([run])
    scores = summary["scores_mean"]
    assert list(scores.index) == [(f"SMP-{v}", s) for v in cfg["variants"] for s in tl.sampler_names([50])]
    assert scores.notna().all().all()
    ratios = summary["ratios_mean"]
    assert list(ratios.index) == [("SMP-none", 50), ("SMP-ema-block", 50)]
    assert (ratios > 0).all().all()


def _tiny_mnist(seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)

    def part(n):
        return torch.rand(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)

    return {"train": part(400), "val": part(20), "test": part(30)}


@pytest.mark.slow
def test_mnist_tails_reuse_the_mnist_runs_and_check_on_the_same_chains(tmp_path):
    import torch

    from smp_book import mnist_study as ms

    cfg = {**get_config("mnist", "ci"), "n_train": 400, "n_chains": 3, "n_steps": 100}
    tail_cfg = {**get_config("mnist_tail", "ci"), "check_from": 50, "tail_scores": 4}
    data = _tiny_mnist(1)
    torch.manual_seed(0)
    theta0 = torch.cat([p.detach().reshape(-1) for p in ms.lenet5().parameters()])
    kw = dict(device=torch.device("cpu"), progress=False, cache_root=str(tmp_path))
    # the MNIST chapter's replicate 0 in the cache first: the tail study must read it, not rerun it
    runs = ms.run_replicates({**cfg, "smp_replicates": 1}, theta0, data, **kw)
    cached_runs = sorted((tmp_path / "mnist").glob("*.pt"))
    result = tl.mnist_tails(cfg, tail_cfg, theta0, data, **kw)
    assert sorted((tmp_path / "mnist").glob("*.pt")) == cached_runs  # nothing new in the MNIST cache
    scores = pd.DataFrame(result["rows"]).set_index(["method", "sampler"])
    names = tl.mnist_sampler_names(tail_cfg, 100)
    assert list(scores.index) == [(m, n) for m in ms.method_names()[1:] for n in names]
    # the recursion rows are the MNIST chapter's runs
    chapter = runs["tables"][0]["scores"]
    for method in ms.method_names()[1:]:
        assert scores.loc[(method, tl.RECURSION), "nll"] == pytest.approx(chapter.loc[method, "nll"])
    ratios = pd.DataFrame(result["ratios"])
    assert (ratios[["params", "logits"]] > 0).all().all()
    assert list(ratios["tail_from"]) == [50] * 4 and (ratios["chains"] <= 3).all()
    # jackknife errors (NaN where a left-out pair of this tiny problem's saturated chains does not move)
    assert (ratios[["params_se", "logits_se"]] > 0).any().all()
    with pytest.raises(ValueError, match="check_from"):
        tl.mnist_tails(cfg, {**tail_cfg, "check_from": 120}, theta0, data, **kw)

    # the check's chains are the chapter's: its run to K0, continued from a checkpoint to K, is the chapter's run
    check_cfg = {**cfg, "n_steps": 50, "checkpoint_every": None}
    device = torch.device("cpu")
    ms.run_variant(check_cfg, "ema-diag", theta0, data, 2, device, tmp_path / "go_on.pt", False)
    continued = ms.run_variant(cfg, "ema-diag", theta0, data, 2, device, tmp_path / "go_on.pt", False)
    stored = torch.load(tmp_path / "mnist" / f"{config_key(ms.run_key(cfg, 'ema-diag', 0, ms.smp_path(device)))}.pt",
                        weights_only=False)
    torch.testing.assert_close(continued.theta, stored["value"].theta, equal_nan=True, rtol=0, atol=0)

    # a chapter run cached before SMPResult kept its state is run again under mnist_tail/, the original untouched
    path = tmp_path / "mnist" / f"{config_key(ms.run_key(cfg, 'none', 0, ms.smp_path(device)))}.pt"
    stale = torch.load(path, weights_only=False)
    stale["value"].precond_state = None
    torch.save(stale, path)
    before = path.read_bytes()
    with pytest.warns(UserWarning, match="no preconditioner state"):
        again = tl.mnist_tails(cfg, tail_cfg, theta0, data, **kw)
    assert path.read_bytes() == before
    assert pd.DataFrame(again["rows"]).equals(pd.DataFrame(result["rows"]).assign(
        seconds=pd.DataFrame(again["rows"])["seconds"]))  # the same numbers, only the seconds differ
