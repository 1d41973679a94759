import json
import math

import numpy as np
import pandas as pd
import pytest

from smp_core.results import cached, config_key, summarise_replicates, write_manifest


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
