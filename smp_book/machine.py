"""The machine and the code a result was computed on, for manifests and benchmark tables."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from .results import ROOT

PACKAGES = ("torch", "numpy", "jax", "jaxlib", "numpyro", "scipy", "pandas", "matplotlib", "laplace-torch",
            "curvlinops-for-pytorch", "smp_core")  # laplace-torch and curvlinops fit the baselines


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux), so that timings name their machine."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.processor() or platform.machine())


def environment() -> dict[str, Any]:
    """Package versions, Python, platform, device, processor, thread count and the load average now."""
    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    cpu = cpu_model()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu: {cpu}"
    return {"python": platform.python_version(), "platform": platform.platform(), "packages": versions,
            "device": device, "cuda": torch.cuda.is_available(), "torch_threads": torch.get_num_threads(),
            "cpu_model": cpu, "cpu_count": os.cpu_count()}


def git_revision() -> str:
    """The current commit, with ``-dirty`` when anything outside ``results/`` has uncommitted changes."""
    try:
        run = functools.partial(subprocess.run, capture_output=True, text=True, check=True, cwd=ROOT)
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!results"]).stdout.strip()
        return run(["git", "rev-parse", "HEAD"]).stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
