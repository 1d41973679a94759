import json
import math

import numpy as np
import pandas as pd
import pytest

from smp_book.results import cached, config_key, summarise_replicates, variance_components, write_manifest


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
    with pytest.raises(RuntimeError, match="another config"):
        cached("study", {"c": 3}, compute, root=tmp_path)


def test_manifest_records_config_seeds_and_versions(tmp_path):
    path = write_manifest(tmp_path, {"n": 3}, {"smp": 7}, 1.234, study="x")
    manifest = json.loads(path.read_text())
    assert manifest["config"] == {"n": 3} and manifest["seeds"] == {"smp": 7}
    assert manifest["wall_time_s"] == 1.23 and manifest["study"] == "x"
    assert manifest["environment"]["packages"]["torch"]
    assert manifest["environment"]["cpu_model"]
    assert "git" in manifest


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


def test_code_hash_follows_the_code_not_its_prose(tmp_path, monkeypatch):
    from smp_book import results

    book, core = tmp_path / "smp_book", tmp_path / "smp_core"
    book.mkdir(), core.mkdir(), (core / "csrc").mkdir()
    (core / "recursion.py").write_text("def step(x):\n    return x + 1\n")
    (core / "tail.py").write_text("def tail(x):\n    return x\n")
    (book / "study.py").write_text('"""A study."""\nfrom smp_core.recursion import step\nfrom .helper import h\n\n'
                                   'def run():\n    from . import plots\n    return step(h())  # note\n')
    (book / "plots.py").write_text("def draw():\n    return 0\n")
    (book / "helper.py").write_text("def h():\n    return 1\n")
    (book / "other.py").write_text("def o():\n    return 2\n")
    monkeypatch.setattr(results, "_BOOK", book)
    monkeypatch.setattr(results, "_CORE", core)

    def fresh():
        results.code_hash.cache_clear()
        return results.code_hash("smp_book.study")

    base = fresh()
    (book / "study.py").write_text('"""Another docstring."""\nfrom smp_core.recursion import step\n'
                                   'from .helper import h\n\ndef run():\n'
                                   '    from . import plots\n    return step(h())\n')
    (book / "other.py").write_text("def o():\n    return 3\n")  # not imported by the study
    (core / "tail.py").write_text("def tail(x):\n    return 2 * x\n")  # a library module it does not import
    (book / "plots.py").write_text("def draw():\n    return 1\n")  # presentation: no number depends on it
    assert fresh() == base
    (book / "helper.py").write_text("def h():\n    return 2\n")  # imported: the results change
    assert fresh() != base
    (book / "helper.py").write_text("def h():\n    return 1\n")
    assert fresh() == base
    (core / "recursion.py").write_text("def step(x):\n    return x + 2\n")  # the library code it calls
    assert fresh() != base
    results.code_hash.cache_clear()


def test_code_hash_follows_the_settings_a_study_imports(tmp_path, monkeypatch):
    """A study depends on the names it imports from config.py: their values, and a function's code with the
    values it reads; get_config's tables reach the cache keys as the config itself, so editing another
    study's or another scale's settings keeps the hash."""
    from smp_book import results

    book, core = tmp_path / "smp_book", tmp_path / "smp_core"
    book.mkdir(), core.mkdir(), (core / "csrc").mkdir()
    settings = ('TAU = {"a": 1.0}\nOTHER = [1, 2]\nTABLES = {"toy": {"ci": {"k": 1}, "paper": {"k": 2}}}\n\n'
                'def tau(v):\n    """Doc."""\n    return TAU[v]\n\n'
                'def get_config(study, scale):\n    return dict(TABLES[study][scale])\n')
    (book / "config.py").write_text(settings)
    (book / "study.py").write_text("from .config import get_config, tau\n\ndef run():\n    return tau('a')\n")
    monkeypatch.setattr(results, "_BOOK", book)
    monkeypatch.setattr(results, "_CORE", core)

    def fresh(text):
        (book / "config.py").write_text(text)
        results.code_hash.cache_clear()
        return results.code_hash("smp_book.study")

    base = fresh(settings)
    assert fresh(settings.replace('"paper": {"k": 2}', '"paper": {"k": 3}')) == base  # a table get_config reads
    assert fresh(settings.replace("OTHER = [1, 2]", "OTHER = [1, 3]")) == base  # not imported, not read
    assert fresh(settings.replace('"""Doc."""', '"""Other doc."""')) == base
    assert fresh(settings.replace('{"a": 1.0}', '{"a": 2.0}')) != base  # read by the imported tau
    assert fresh(settings.replace("return TAU[v]", "return 2 * TAU[v]")) != base
    assert fresh(settings.replace("dict(TABLES[study][scale])", "{**TABLES[study][scale]}")) != base
    settings += "\ndef twice(v):\n    return 2 * tau(v)\n"
    (book / "study.py").write_text("from .config import twice\n\ndef run():\n    return twice('a')\n")
    calls = fresh(settings)
    assert fresh(settings.replace('{"a": 1.0}', '{"a": 2.0}')) != calls  # read by tau, which twice calls
    for study in ("from . import config\n\ndef run():\n    return config.tau('a')\n",
                  "from .config import *\n\ndef run():\n    return tau('a')\n"):
        (book / "study.py").write_text(study)
        whole = fresh(settings)  # the module itself imported: all of it counts
        assert fresh(settings.replace("OTHER = [1, 2]", "OTHER = [1, 3]")) != whole
    results.code_hash.cache_clear()
