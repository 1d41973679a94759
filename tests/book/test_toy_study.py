"""The toy study's tables and seeds."""

import pandas as pd
import pytest

from smp_book import show, toy
from smp_book import toy_study as ts
from smp_book.paper import paper_table


def test_beside_paper():
    ours = pd.DataFrame({"accuracy": [0.5]}, index=["NUTS"])
    table = show.beside_paper(ours, paper_table("ex1_scores"), ours * 0 + 0.01)
    assert table.loc["NUTS", ("accuracy", "paper")] == "0.9304"
    assert table.loc["NUTS", ("accuracy", "ours")] == "0.5000 ± 0.0100"
    # one replicate: the standard deviation is NaN and no spread is shown
    table = show.beside_paper(ours, paper_table("ex1_scores"), ours * float("nan"))
    assert table.loc["NUTS", ("accuracy", "ours")] == "0.5000"


def test_replicate_seeds_differ():
    a, b = toy.replicate_seeds(1, 0), toy.replicate_seeds(1, 1)
    assert set(a.values()).isdisjoint(b.values())


def test_toy_brier_is_the_one_class_score():
    import torch

    from smp_core import metrics

    p = torch.tensor([[0.9, 0.2, 0.6]])
    y = torch.tensor([1, 0, 0])
    two_class = metrics.brier(metrics.binary_probs(p), y)
    one_class = float(((p[0] - y) ** 2).mean())
    assert toy.one_class_brier(pd.Series([two_class]))[0] == pytest.approx(one_class)


def test_paper_variants_keep_their_seeds_and_others_may_not_share_them():
    seeds = toy.replicate_seeds(2026, 0)
    from smp_book.config import TOY_VARIANTS, get_config

    assert toy.variant_seed(seeds, "ema-block", 1) == seeds["smp"] + TOY_VARIANTS.index("ema-block")
    assert toy.variant_seed(seeds, "fixed-kfac", 1, seed_offset=10) == seeds["smp"] + 11
    with pytest.raises(ValueError, match="would share seeds"):  # before any NUTS run
        ts.run_replicate(get_config("toy", "ci"), 0, variants=["fixed-kfac", "none"])
