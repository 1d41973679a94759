"""The growth chapter's results: what its compute writes, and the verdict and shares it states."""

import json
from types import SimpleNamespace

import numpy as np
import pandas as pd
import torch

from smp_book import mnist_growth_study as mgs
from smp_book import mnist_runs as mr
from smp_book import mnist_study as ms
from smp_book.pipeline import Context


def _tiny_mnist(seed=0):
    gen = torch.Generator().manual_seed(seed)

    def part(n):
        return torch.rand(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)

    return {"train": part(40), "val": part(20), "test": part(30)}


def _least(rows):
    return pd.DataFrame(rows, columns=["K", "least", "runner_up", "lead_z"]).set_index("K")


def test_periodic_verdict():
    held = _least([(100, "SMP-fixed-diag", "SMP-periodic-diag", 0.5), (200, "SMP-periodic-diag", "SMP-fixed-diag", 1.0),
                   (400, "SMP-periodic-diag", "SMP-fixed-diag", 2.5)])
    assert mgs.periodic_verdict(held) == ("SMP-periodic-diag has the smallest mutual information of the diagonal "
                                          "variants from K = 200 to the end of the grid (lead at K = 400: 2.5 "
                                          "standard errors of the chains).")
    near = _least([(100, "SMP-fixed-diag", "SMP-periodic-diag", 3.0),
                   (200, "SMP-periodic-diag", "SMP-fixed-diag", 1.2)])
    assert mgs.periodic_verdict(near).endswith("(lead at K = 200: 1.2 standard errors of the chains: within 2, not "
                                               "resolved by this run).")
    lost = _least([(100, "SMP-periodic-diag", "SMP-fixed-diag", 0.5), (200, "SMP-fixed-diag", "SMP-ema-diag", 3.0)])
    assert mgs.periodic_verdict(lost).startswith("SMP-periodic-diag does not have the smallest mutual information "
                                                 "at K = 200 (SMP-fixed-diag has, by 3.0")


def test_zero_fisher_share():
    growth = pd.DataFrame({"method": ["SMP-none", "SMP-none", "SMP-fixed-diag", "SMP-fixed-diag"],
                           "params_variance": [1.0, 2.0, 1.0, 4.0],
                           "params_variance_zero_fisher": [0.0, 1.0, 2.0, 2.0]},
                          index=pd.Index([50, 100, 50, 100], name="K"))
    share = mgs.zero_fisher_share(growth, 0.5, [50, 100])
    assert list(share.index) == ["SMP-none", "SMP-fixed-diag"] and list(share.columns) == [50, 100]
    assert share.loc["SMP-none", 100] == 0.25 and share.loc["SMP-fixed-diag", 50] == 1.0


def test_compute_writes_the_chapters_tables_values_and_figure(tmp_path, monkeypatch):
    """compute(ctx) at tiny settings, with the MNIST chapter's results at K = 100 standing in: every table
    the chapter shows (least_dispersed, which the summary chapter reads, included), its figure and its
    values without NaN."""
    from smp_book.config import get_config

    cfg = {**get_config("mnist_growth", "ci"), "n_train": 40, "n_val": 20, "n_test": 30, "map_epochs": 1,
           "n_chains": 3, "period": 10, "growth_steps": [50, 100]}
    monkeypatch.setattr(ms, "load_data", lambda cfg, data_dir="data": (_tiny_mnist(4), {"source": "tiny"}))
    methods = mr.method_names()
    scores = pd.DataFrame({"mutual_info": np.linspace(0.0, 0.3, 5), "nll": 0.5, "accuracy": 0.9},
                          index=pd.Index(methods, name="method"))
    variances = pd.DataFrame({"params_variance": 1e-5, "logits_variance": 1.0}, index=scores.index)
    mnist = SimpleNamespace(config={"n_steps": 100, "n_chains": 8},
                            table=lambda name: {"scores_mean": scores, "variances_mean": variances}[name])
    folder = tmp_path / "out"
    folder.mkdir()
    ctx = Context("mnist_growth", "ci", cfg, folder, tmp_path, use_cache=False)
    ctx.read = lambda study: mnist if study == "mnist" else None
    mgs.compute(ctx)
    for name in ("growth", "reached_share", "growth_against_linear", "growth_summary",
                 "zero_fisher_share", "least_dispersed", "mnist_comparison"):
        assert (folder / f"{name}.csv").exists(), name
    assert ctx.figures == ["growth"]
    growth = pd.read_csv(folder / "growth.csv", index_col=["method", "K"])
    assert growth.index.is_unique and set(mgs.SHOWN) <= set(growth.columns)  # one row per method and K
    least = pd.read_csv(folder / "least_dispersed.csv", index_col="K")
    assert list(least.index) == [50, 100]
    comparison = pd.read_csv(folder / "mnist_comparison.csv", index_col="method")
    assert list(comparison.index) == methods[1:] and "mutual_info (here)" in comparison.columns
    values = ctx.values
    assert values["first_k"] == 50 and values["last_k"] == 100 and values["mnist_on_grid"] == "yes"
    assert {"mi_growth_none", "mi_growth_fixed_diag", "mi_growth_ema_diag", "mi_growth_periodic_diag"} <= set(values)
    assert all(not (isinstance(v, float) and np.isnan(v)) for v in values.values())
    json.dumps(values)
    assert values["in_words"].count("\n- ") == len(methods) - 2
