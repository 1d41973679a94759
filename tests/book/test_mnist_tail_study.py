"""The MNIST Gaussian-tail study: its settings, the check table, and the tails of the MNIST chapter's runs
on a tiny problem (read from the chapter's cache, checked on the same chains)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from smp_book import mnist_runs as mr
from smp_book import mnist_tail_study as mt
from smp_book.config import SCALES, get_config
from smp_book.pipeline import config_key, study_config


@pytest.mark.parametrize("scale", SCALES)
def test_the_settings_are_the_mnist_chapters_with_the_tails(scale):
    cfg = study_config("mnist_tail", scale)
    assert cfg == {**get_config("mnist", scale), "tail": get_config("mnist_tail", scale)}
    assert cfg["study"] == "mnist"  # the chapter's runs are found in its cache folder


def test_check_table_judges_the_logit_ratio_within_the_factor():
    ratios = pd.DataFrame({"method": ["SMP-a", "SMP-b", "SMP-c"], "tail_from": [100] * 3, "chains": [3] * 3,
                           "params": [1.0, 1.0, 2.0], "params_se": [0.1, np.nan, 0.1],
                           "logits": [1.2, 0.7, 1.0], "logits_se": [0.1, 0.1, 0.1]}).set_index(["method", "tail_from"])
    check = mt.check_table(ratios)
    assert list(check.index) == ["SMP-a", "SMP-b", "SMP-c"]
    assert list(check["within 1.25"]) == [True, False, True]  # logits only
    assert {"ratio (params)", "se (params)", "ratio (logits)", "se (logits)"} <= set(check.columns)



def test_verdict_names_the_trusted_variants_beside_the_paper_and_warns_for_the_others():
    paper = pd.Series({"SMP-none": 0.0002, "SMP-ema-diag": 0.9079})
    text = mt.verdict(["SMP-none"], ["SMP-ema-diag"], {"SMP-none": 0.00088}, paper, 10**6)
    assert "1,000,000" in text and "SMP-none 0.00088 (paper 0.0002)" in text and "others (SMP-ema-diag)" in text
    assert "others" not in mt.verdict(["SMP-none"], [], {"SMP-none": 0.00088}, paper, 10**6)
    assert "no variant" in mt.verdict([], ["SMP-none"], {}, paper, 10**6)

def test_beside_paper_puts_the_papers_row_first():
    names = mt.sampler_names(get_config("mnist_tail", "ci"), 300)
    index = pd.MultiIndex.from_tuples([(m, n) for m in ("SMP-none", "SMP-ema-diag") for n in names],
                                      names=["method", "sampler"])
    scores = pd.DataFrame({c: np.arange(len(index), dtype=float) for c in mt.SHOWN}, index=index)
    beside = mt.beside_paper(scores, names)
    assert list(beside.index) == [(m, n) for m in ("SMP-none", "SMP-ema-diag") for n in [mt.PAPER_ROW, *names[1:]]]
    assert list(beside.columns) == list(mt.SHOWN.values()) and beside.notna().all().all()


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
    theta0 = torch.cat([p.detach().reshape(-1) for p in mr.lenet5().parameters()])
    kw = dict(device=torch.device("cpu"), progress=False, cache_root=str(tmp_path))
    # the MNIST chapter's replicate 0 in the cache first: the tail study must read it, not rerun it
    runs = ms.run_replicates({**cfg, "smp_replicates": 1}, theta0, data, **kw)
    cached_runs = sorted((tmp_path / "mnist").glob("*.pt"))
    result = mt.mnist_tails(cfg, tail_cfg, theta0, data, **kw)
    assert sorted((tmp_path / "mnist").glob("*.pt")) == cached_runs  # nothing new in the MNIST cache
    scores = pd.DataFrame(result["rows"]).set_index(["method", "sampler"])
    names = mt.sampler_names(tail_cfg, 100)
    assert list(scores.index) == [(m, n) for m in mr.method_names()[1:] for n in names]
    # the recursion rows are the MNIST chapter's runs
    chapter = runs["tables"][0]["scores"]
    for method in mr.method_names()[1:]:
        assert scores.loc[(method, mt.RECURSION), "nll"] == pytest.approx(chapter.loc[method, "nll"])
    ratios = pd.DataFrame(result["ratios"])
    assert (ratios[["params", "logits"]] > 0).all().all()
    assert list(ratios["tail_from"]) == [50] * 4 and (ratios["chains"] <= 3).all()
    # jackknife errors (NaN where a left-out pair of this tiny problem's saturated chains does not move)
    assert (ratios[["params_se", "logits_se"]] > 0).any().all()
    with pytest.raises(ValueError, match="check_from"):
        mt.mnist_tails(cfg, {**tail_cfg, "check_from": 120}, theta0, data, **kw)

    # the check's chains are the chapter's: its run to K0, continued from a checkpoint to K, is the chapter's run
    check_cfg = {**cfg, "n_steps": 50, "checkpoint_every": None}
    device = torch.device("cpu")
    mr.run_variant(check_cfg, "ema-diag", theta0, data, 2, device, tmp_path / "go_on.pt", False)
    continued = mr.run_variant(cfg, "ema-diag", theta0, data, 2, device, tmp_path / "go_on.pt", False)
    stored = torch.load(tmp_path / "mnist" / f"{config_key(mr.run_key(cfg, 'ema-diag', 0, ms.smp_path(device)))}.pt",
                        weights_only=False)
    torch.testing.assert_close(continued.theta, stored["value"].theta, equal_nan=True, rtol=0, atol=0)

    # a chapter run cached before SMPResult kept its state is run again under mnist_tail/, the original untouched
    path = tmp_path / "mnist" / f"{config_key(mr.run_key(cfg, 'none', 0, ms.smp_path(device)))}.pt"
    stale = torch.load(path, weights_only=False)
    stale["value"].precond_state = None
    torch.save(stale, path)
    before = path.read_bytes()
    with pytest.warns(UserWarning, match="no preconditioner state"):
        again = mt.mnist_tails(cfg, tail_cfg, theta0, data, **kw)
    assert path.read_bytes() == before
    assert pd.DataFrame(again["rows"]).equals(pd.DataFrame(result["rows"]).assign(
        seconds=pd.DataFrame(again["rows"])["seconds"]))  # the same numbers, only the seconds differ
