import json

import pytest

from smp_core.results import cached, config_key, write_manifest


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
