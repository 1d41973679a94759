"""The MAP-seeds chapter's results: what its compute writes, and the findings on the chains' excursions."""

import json

import numpy as np
import pandas as pd
import torch

from smp_book import mnist_seeds_study as mss
from smp_book import mnist_study as ms
from smp_book.pipeline import Context


def _tiny_mnist(seed=0):
    gen = torch.Generator().manual_seed(seed)

    def part(n):
        return torch.rand(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)

    return {"train": part(40), "val": part(20), "test": part(30)}


def _runs(mi: dict[str, list[float]], index) -> pd.DataFrame:
    table = pd.DataFrame(mi, index=pd.MultiIndex.from_tuples(index, names=["map", "replicate"]))
    table["log periodic/fixed"] = np.log(table["SMP-periodic-diag"] / table["SMP-fixed-diag"])
    table["log periodic/EMA"] = np.log(table["SMP-periodic-diag"] / table["SMP-ema-diag"])
    table["least"] = table[list(ms.DIAGONAL_METHODS)].idxmin(axis=1)
    return table


def test_excursions_tell_when_periodic_least_rests_on_a_few_fixed_chains():
    index = [(0, 0), (0, 1), (1, 0), (1, 1)]
    # by the MI periodic is least in the two runs of MAP 0, where one fixed chain carries most of fixed's MI
    per_run = _runs({"SMP-fixed-diag": [0.08, 0.07, 0.02, 0.03], "SMP-ema-diag": [0.5, 0.5, 0.5, 0.5],
                     "SMP-periodic-diag": [0.05, 0.05, 0.05, 0.05]}, index)
    trimmed = _runs({"SMP-fixed-diag": [0.010, 0.012, 0.011, 0.020], "SMP-ema-diag": [0.45, 0.45, 0.45, 0.45],
                     "SMP-periodic-diag": [0.04, 0.04, 0.04, 0.04]}, index)
    shares = pd.DataFrame({"SMP-fixed-diag": [0.6, 0.5, 0.1, 0.2], "SMP-ema-diag": 0.02,
                           "SMP-periodic-diag": 0.05}, index=per_run.index)
    found = mss.excursions(per_run, trimmed, shares, 10)
    assert found["excursion"] and found["bulk_fixed_least"]
    assert "exactly in the runs" in found["conclusion"]
    text = "\n".join(found["lines"])
    assert "least dispersed in 2 of 4 runs (MAP 0 2 of 2)" in text
    assert "50% to 60%" in text and "10% to 20%" in text
    assert "SMP-fixed-diag 4 (of 4)" in text
    # the MAPs' split appears with two replicates or more
    split = mss.map_or_stream(per_run)
    with_split = mss.excursions(per_run, trimmed, shares, 10, split, mss.map_or_stream(trimmed))
    assert any(line.startswith("The stream's standard deviation") for line in with_split["lines"])
    # a run where a small fixed share still leaves periodic least breaks the pattern
    overlapping = shares.assign(**{"SMP-fixed-diag": [0.6, 0.1, 0.5, 0.2]})
    found = mss.excursions(per_run, trimmed, overlapping, 10)
    assert not found["excursion"] and "not exactly those" in found["conclusion"]
    # nothing left out: no verdict on the bulk of the chains
    found = mss.excursions(per_run, per_run, shares, 0)
    assert found["bulk_fixed_least"] is None and "no verdict" in found["conclusion"]


def test_compute_writes_the_chapters_tables_values_and_figures(tmp_path, monkeypatch):
    """compute(ctx) at tiny settings: every table the chapter shows (and the summary chapter reads), its
    figures, its values without NaN, and the seeds in the manifest entries."""
    from smp_book.config import get_config

    cfg = {**get_config("mnist_seeds", "ci"), "n_train": 40, "n_val": 20, "n_test": 30, "map_epochs": 1,
           "n_chains": 10, "n_steps": 30, "period": 10}
    monkeypatch.setattr(ms, "load_data", lambda cfg, data_dir="data": (_tiny_mnist(2), {"source": "tiny"}))
    folder = tmp_path / "out"
    folder.mkdir()
    ctx = Context("mnist_seeds", "ci", cfg, folder, tmp_path, use_cache=False)
    mss.compute(ctx)
    for name in ("maps", "diverged", "scores_mean", "scores_std", "scores_replicates", "least_dispersed",
                 "per_run", "least_per_run", "map_or_stream", "mi_largest_chain_share", "per_run_trimmed",
                 "map_or_stream_trimmed"):
        assert (folder / f"{name}.csv").exists(), name
    assert sorted(ctx.figures) == ["least_dispersed", "periodic_ratio_per_run", "periodic_ratio_trimmed"]
    values = ctx.values
    assert values["n_maps"] == 2 and values["n_runs"] == 4 and values["n_left_out"] == 1
    assert all(not (isinstance(v, float) and np.isnan(v)) for v in values.values())
    json.dumps(values)
    assert values["excursion_lines"].startswith("- The largest chain's share")
    assert set(ctx.manifest["seeds"]["maps"]) == {"map_0", "map_1"}
    least = pd.read_csv(folder / "least_dispersed.csv", index_col="map")
    assert list(least.index) == [0, 1] and set(least["least"]) <= set(ms.DIAGONAL_METHODS)


def test_compute_with_one_replicate_leaves_the_split_out(tmp_path, monkeypatch):
    """One replicate per MAP (the paper scale): no analysis of variance, and with S = 3 no chain trimmed."""
    from smp_book.config import get_config

    cfg = {**get_config("mnist_seeds", "ci"), "n_train": 40, "n_val": 20, "n_test": 30, "map_epochs": 1,
           "n_chains": 3, "n_steps": 20, "period": 10, "smp_replicates": 1}
    monkeypatch.setattr(ms, "load_data", lambda cfg, data_dir="data": (_tiny_mnist(3), {"source": "tiny"}))
    folder = tmp_path / "out"
    folder.mkdir()
    ctx = Context("mnist_seeds", "ci", cfg, folder, tmp_path, use_cache=False)
    mss.compute(ctx)
    assert not (folder / "map_or_stream.csv").exists() and not (folder / "map_or_stream_trimmed.csv").exists()
    assert "cannot be told apart" in ctx.values["split_text"]
    assert "leaves none out" in ctx.values["bulk_answer"]
