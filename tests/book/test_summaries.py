import math

import numpy as np
import pandas as pd
import pytest

from smp_book.pipeline import cached, config_key
from smp_book.summaries import summarise_replicates, variance_components


def test_cache_reuses_by_config_and_refuses_collisions(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return {"value": len(calls)}

    cfg = {"a": 1, "b": [1, 2]}
    assert cached("study", cfg, compute, root=tmp_path) == {"value": 1}
    assert cached("study", dict(reversed(list(cfg.items()))), compute, root=tmp_path) == {"value": 1}
    assert len(calls) == 1
    assert cached("study", {"a": 2, "b": [1, 2]}, compute, root=tmp_path) == {"value": 2}
    # a file under this config's key that holds another config is never overwritten
    import torch

    torch.save({"config": {"other": True}, "value": 0}, tmp_path / "study" / f"{config_key({'c': 3})}.pt")
    with pytest.raises(RuntimeError, match="another key"):
        cached("study", {"c": 3}, compute, root=tmp_path)


def _table(values, methods=("b", "a")):
    df = pd.DataFrame({"x": values}, index=list(methods))
    df.index.name = "method"
    return df


def test_summarise_replicates_mean_std_and_order():
    reps = [{"t": _table([1.0, 10.0])}, {"t": _table([2.0, 30.0])}, {"t": _table([6.0, 20.0])}]
    out = summarise_replicates(reps)
    assert list(out["t_mean"].index) == ["b", "a"]  # the first replicate's row order, not sorted
    assert out["t_mean"].loc["b", "x"] == pytest.approx(3.0)
    assert out["t_std"].loc["b", "x"] == pytest.approx(np.std([1.0, 2.0, 6.0], ddof=1))
    assert out["t_std"].loc["a", "x"] == pytest.approx(10.0)
    assert out["t_replicates"].loc[(2, "a"), "x"] == 20.0
    one = summarise_replicates(reps[:1])
    assert one["t_mean"].loc["a", "x"] == 10.0 and math.isnan(one["t_std"].loc["a", "x"])
    with pytest.raises(ValueError, match="no replicates"):
        summarise_replicates([])


def test_variance_components_by_hand():
    """Groups (1, 3) and (5, 7): MS_between = 2 ((2 - 4)^2 + (6 - 4)^2) = 16, MS_within = 4 / 2 = 2, so
    sigma_group^2 = (16 - 2) / 2 = 7, F = 8 on (1, 2) degrees of freedom: P(F > 8) = 1 - sqrt(8 / 10)."""
    values = pd.DataFrame({"y": [1.0, 3.0, 5.0, 7.0]},
                          index=pd.MultiIndex.from_product([["a", "b"], [0, 1]], names=["map", "replicate"]))
    row = variance_components(values).loc["y"]
    assert row["mean"] == pytest.approx(4.0)
    assert row["sd_group"] == pytest.approx(math.sqrt(7.0)) and row["sd_within"] == pytest.approx(math.sqrt(2.0))
    assert row["group_share"] == pytest.approx(7.0 / 9.0) and row["F"] == pytest.approx(8.0)
    assert row["p_value"] == pytest.approx(1 - math.sqrt(0.8))  # F(1, 2): P(F > x) = 1 - sqrt(x / (x + 2))
    # equal group means: MS_between = 0 < MS_within = 2, the estimate of sigma_group^2 (-1) is cut to 0
    same = variance_components(values.assign(y=[1.0, 3.0, 3.0, 1.0])).loc["y"]
    assert same["sd_group"] == 0.0 and same["group_share"] == 0.0 and same["F"] == 0.0 and same["p_value"] == 1.0
    # no spread at all: nothing to test
    flat = variance_components(values.assign(y=2.0)).loc["y"]
    assert flat["sd_within"] == 0.0 and math.isnan(flat["F"]) and math.isnan(flat["p_value"])


def test_variance_components_are_unbiased_and_the_test_has_its_level():
    """1,000 simulated designs (5 groups x 3 replicates, one column each): the estimates of both variances
    average to the truth (z-scores against their Monte Carlo standard errors); with no group effect the
    test rejects at 5 % in 5 % of designs (binomial standard error), with a large one nearly always."""
    rng = np.random.default_rng(0)
    n_designs, n_groups, r = 1000, 5, 3
    index = pd.MultiIndex.from_product([range(n_groups), range(r)], names=["map", "replicate"])

    def designs(sd_group):
        y = rng.normal(size=(n_groups, 1, n_designs)) * sd_group + rng.normal(size=(n_groups, r, n_designs))
        return variance_components(pd.DataFrame(y.reshape(n_groups * r, n_designs), index=index))

    effect = designs(0.8)
    var_group = (effect["F"] - 1) * effect["sd_within"] ** 2 / r  # the untruncated estimate
    for estimate, truth in ((var_group, 0.64), (effect["sd_within"] ** 2, 1.0)):
        z = (estimate.mean() - truth) / (estimate.std() / math.sqrt(n_designs))
        assert abs(z) < 4, z
    null = designs(0.0)
    rejected = (null["p_value"] < 0.05).mean()
    assert abs(rejected - 0.05) / math.sqrt(0.05 * 0.95 / n_designs) < 4, rejected
    assert (designs(5.0)["p_value"] < 0.05).mean() > 0.95


def test_variance_components_bad_input_names_the_problem():
    index = pd.MultiIndex.from_tuples([(0, 0), (0, 1), (1, 0)], names=["map", "replicate"])
    with pytest.raises(ValueError, match="balanced design"):
        variance_components(pd.DataFrame({"y": [1.0, 2.0, 3.0]}, index=index))
    with pytest.raises(ValueError, match="MultiIndex"):
        variance_components(pd.DataFrame({"y": [1.0, 2.0]}))
    full = pd.MultiIndex.from_product([[0, 1], [0, 1]], names=["map", "replicate"])
    with pytest.raises(ValueError, match="NaN"):
        variance_components(pd.DataFrame({"y": [1.0, np.nan, 2.0, 3.0]}, index=full))
