"""Every benchmark script in benchmarks/ runs end to end: each `bench_*.py --smoke` (all its tables at tiny
sizes, in seconds) exits with status 0, and none is left out of this list or of the Makefile's `make bench`.

Left out: benchmarks/time_fresh_clone.sh. It times `make test` and `make book` in fresh clones (about an
hour on 2 cores, and `make book` fetches MNIST and MathJax), so it has no smoke size, and it is not Python.
And benchmarks/gpu_checks.sh, which needs a GPU; its bench_mnist.py options (whole runs, a budget) run at smoke
size here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

# every benchmarks/bench_*.py (test_every_benchmark_is_listed checks that none is missing)
SCRIPTS = [
    "bench_baselines.py",
    "bench_cost.py",
    "bench_jax.py",
    "bench_kfac.py",
    "bench_metrics.py",
    "bench_mnist.py",
    "bench_recursion.py",
    "bench_revisions.py",
    "bench_scaling.py",
    "bench_statistic_dtype.py",
]
# seconds per smoke run; each takes a few seconds to about twenty on 2 cores
TIMEOUT = 180


@pytest.fixture(scope="module", autouse=True)
def _compiled_kernel():
    """Build the compiled kernel of smp_core.fused here when it is not cached yet (about a minute), so that the
    build does not count against the time limit of whichever script first runs LeNet-5 on the CPU."""
    from smp_core.fused import fused_unavailable

    fused_unavailable()


def test_every_benchmark_is_listed():
    found = sorted(p.name for p in BENCHMARKS.glob("bench_*.py"))
    assert found == sorted(SCRIPTS), (
        f"benchmarks/bench_*.py and SCRIPTS in {Path(__file__).name} differ: add a --smoke run of every new "
        f"benchmark to SCRIPTS (not listed: {sorted(set(found) - set(SCRIPTS))}; "
        f"listed but missing: {sorted(set(SCRIPTS) - set(found))})")


def test_make_bench_runs_every_benchmark():
    match = re.search(r"^BENCHMARKS \?= (.+)$", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
    assert match, "the Makefile has no BENCHMARKS ?= line"
    listed = sorted(f"bench_{name}.py" for name in match.group(1).split())
    assert listed == sorted(SCRIPTS), "the Makefile's BENCHMARKS (make bench, make bench-smoke) and SCRIPTS differ"


# bench_mnist.py --smoke with a budget that no whole run fits (test_a_whole_run_that_overruns_its_budget...)
OVERRUN = ("bench_mnist.py", "--budget-s", "0")


def _smoke(script: str, *options: str) -> subprocess.CompletedProcess | str:
    """``script --smoke options`` run to its end, or why it did not end (ran past TIMEOUT)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        return subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke", *options], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as error:
        stderr = error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else error.stderr or ""
        return f"{script} --smoke ran past {TIMEOUT} s; stderr ends:\n{stderr[-3000:]}"


@pytest.fixture(scope="module")
def smoke_runs(_compiled_kernel):
    """Every script's smoke run, two at a time (most of each is starting Python and importing torch and JAX, one
    core's work): a future per script, which its test waits for."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {run: pool.submit(_smoke, *run) for run in [(script,) for script in SCRIPTS] + [OVERRUN]}


@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke_run(script, smoke_runs):
    done = smoke_runs[(script,)].result()
    if isinstance(done, str):
        pytest.fail(done)
    assert done.returncode == 0, (
        f"{script} --smoke exited with status {done.returncode}; stderr ends:\n{done.stderr[-3000:]}")
    assert "|---" in done.stdout or "| ---" in done.stdout, f"{script} --smoke printed no table:\n{done.stdout}"


def test_a_whole_run_that_overruns_its_budget_is_left_out_and_said_so(smoke_runs):
    done = smoke_runs[OVERRUN].result()
    if isinstance(done, str):
        pytest.fail(done)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| cpu | SMP-")]
    assert any("SMP-periodic-diag | left out: projected" in line for line in rows[-2:]), done.stdout


def test_the_committed_benchmark_tables_read_as_the_book_reads_them():
    """how_to_run and the MNIST chapter read these CSVs; a renamed table would show 'Not measured'."""
    from smp_book.show import benchmark

    gpu = benchmark("gpu_h200", "runs", index=["device", "variant"], measured="seconds")
    assert list(gpu.index) == [("cuda", "SMP-none")] and float(gpu.loc[("cuda", "SMP-none"), "seconds"]) > 0
    steps = benchmark("gpu_h200", "steps", index=["device", "variant"])
    assert len(steps) == 8 and {"step run by", "ms / step"} <= set(steps.columns)
    assert steps.attrs["heading"].startswith("SMP step, LeNet-5")
    scaling = benchmark("scaling", "scaling", index=["ranks"])
    assert list(scaling.index) == ["1", "2"] and "chain-steps / s" in scaling.columns
    assert benchmark("gpu_h200", "missing") is None and benchmark("nowhere", "runs") is None


def test_a_benchmark_saves_each_table_as_csv(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    from tables import Tables

    out = Tables(tmp_path / "t", machine="this CPU")
    out.start("steps", "SMP step, S = 3", ["variant", "ms / step"])
    out.row("SMP-none", "2.64")
    out.save()
    printed = capsys.readouterr().out
    assert "| variant | ms / step |\n|---|---|\n| SMP-none | 2.64 |" in printed
    assert (tmp_path / "t" / "steps.csv").read_text().splitlines() == ["variant,ms / step", "SMP-none,2.64"]
