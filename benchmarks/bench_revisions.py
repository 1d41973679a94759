"""One LeNet-5 SMP step at two git revisions of smp_core, measured in alternation.

Usage (from the repository root)::

    .venv/bin/python benchmarks/bench_revisions.py                          # HEAD against the working tree
    .venv/bin/python benchmarks/bench_revisions.py --base bc454ff            # base revision against the working tree
    .venv/bin/python benchmarks/bench_revisions.py --base HEAD~3 --rounds 6 --variants none ema-diag
    .venv/bin/python benchmarks/bench_revisions.py --smoke                  # HEAD, tiny sizes (seconds)

On a shared or virtual machine the speed of the same code drifts by tens of percent over minutes, so
two timings taken at different times do not compare two implementations. This script checks the
base revision out into a temporary git worktree and, round after round, runs the same measurement in
a fresh process for the base and then for the working tree, so that both see the same conditions;
it prints the fastest and the median round of each. The measurement is that of
``bench_mnist.py``: the difference of two ``run_smp`` calls of different lengths (the Fisher set-up
cancels), each the faster of two, divided by the extra steps; random inputs, S = 100 chains. Both
processes opt in to ``smp_core.memory.retain_freed_memory()`` where the revision has it (before it,
``run_smp`` set the allocator itself), so both run with the same allocator setting.

The base builds its own copy of the compiled kernel of ``smp_core.fused`` (about a minute, in the
temporary folder): torch's build folder records the source's path, so sharing the working tree's would
rebuild it at every switch. ``--smoke`` (HEAD unless ``--base`` is given; 2 chains, 2 steps, one
round) turns the kernel off in both (``SMP_CORE_FUSED=0``) so that nothing is built; outside a git
checkout it prints why it cannot run and exits with status 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# --smoke: tiny sizes in place of the defaults (options given on the command line still apply)
SMOKE = {"rounds": 1, "steps": 2, "chains": 2, "images": 64, "fisher_examples": 16}

# Runs in a fresh process with the revision's checkout first on sys.path; prints ms per step as JSON.
# It takes run_smp's keywords of either interface: input_shape= and fisher_data= (up to the split of
# smp_book), or a Fisher and the settings in the preconditioner (since).
PROBE = r"""
import inspect, json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
import smp_core
from smp_core import lenet5, run_smp
if not Path(smp_core.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()):
    raise SystemExit(f"smp_core came from {smp_core.__file__}, not from the checkout {sys.argv[1]}")
try:
    from smp_core.memory import retain_freed_memory
    retain_freed_memory()  # an explicit opt-in since run_smp stopped setting it
except ImportError:
    pass
cfg = json.loads(sys.argv[2])
torch.set_num_threads(cfg["threads"])
torch.manual_seed(0)
net, steps = lenet5(), cfg["steps"]
x, y = torch.rand(cfg["images"], 1, 28, 28), torch.randint(0, 10, (cfg["images"],))
fisher_data = (x[: cfg["fisher_examples"]], y[: cfg["fisher_examples"]])
if "fisher_data" in inspect.signature(run_smp).parameters:
    def settings(variant):
        return dict(preconditioner=variant, input_shape=(1, 28, 28), fisher="empirical", fisher_data=fisher_data,
                    period=10**9)
else:
    from smp_core.preconditioners import preconditioner_from_name
    def settings(variant):
        return dict(preconditioner=preconditioner_from_name(variant, period=10**9),
                    fisher=smp_core.Fisher("empirical", *fisher_data))
result = {}
for variant in cfg["variants"]:
    kw = dict(tau=0.05, n_chains=cfg["chains"], seed=0, progress=False, **settings(variant))
    run_smp(net, "categorical", x, n_steps=3, **kw)
    short = min(run_smp(net, "categorical", x, n_steps=5, **kw).elapsed for _ in range(2))
    long = min(run_smp(net, "categorical", x, n_steps=5 + steps, **kw).elapsed for _ in range(2))
    result[variant] = 1000 * (long - short) / steps
print(json.dumps(result))
"""


def _probe(checkout: Path, cfg: dict, env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(checkout), json.dumps(cfg)], cwd=checkout,
                         env={**os.environ, **env}, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the measurement failed in {checkout}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision to compare the working tree with (HEAD)")
    parser.add_argument("--variants", nargs="*", default=["none", "fixed-diag", "ema-diag", "periodic-diag"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--chains", type=int, default=100)
    parser.add_argument("--images", type=int, default=2000, help="random inputs the covariates are drawn from")
    parser.add_argument("--fisher-examples", type=int, default=300, help="of them, the empirical Fisher's data")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true",
                        help="HEAD against the working tree at tiny sizes, without the compiled kernel (seconds)")
    args = parser.parse_args()
    env: dict[str, str] = {}
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
        env["SMP_CORE_FUSED"] = "0"
        print("Smoke run: tiny sizes, compiled kernel off in both (SMP_CORE_FUSED=0), to check that the script "
              "runs end to end; the times mean nothing.\n")
    found = subprocess.run(["git", "rev-parse", "--short", "--verify", f"{args.base}^{{commit}}"], cwd=ROOT,
                           capture_output=True, text=True)
    if found.returncode:
        reason = found.stderr.strip() or "git rev-parse failed"
        if args.smoke:
            print(f"Skipped: no git revision {args.base!r} to compare with in {ROOT} ({reason})")
            return
        raise SystemExit(f"no git revision {args.base!r} in {ROOT}: {reason}")
    rev = found.stdout.strip()
    from smp_book.machine import cpu_model  # the working tree's

    cfg = {"variants": args.variants, "threads": args.threads, "steps": args.steps, "chains": args.chains,
           "images": args.images, "fisher_examples": args.fisher_examples}
    print(f"{cpu_model()}, {args.threads} threads; base {args.base} ({rev}) against the working tree, "
          f"{args.rounds} alternating rounds of {args.steps} steps, S = {args.chains}\n")
    times: dict[str, list[dict[str, float]]] = {"base": [], "working tree": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        # the base's kernel is built apart from the working tree's (see the module docstring)
        base_env = {"TORCH_EXTENSIONS_DIR": str(Path(tmp) / "torch_extensions"), **env}
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), rev], cwd=ROOT, check=True)
        try:
            for _ in range(args.rounds):
                times["base"].append(_probe(base, cfg, base_env))
                times["working tree"].append(_probe(ROOT, cfg, env))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    print("| variant | base: fastest (ms) | base: median (ms) | working tree: fastest (ms) | "
          "working tree: median (ms) | median ratio |")
    print("|---|---|---|---|---|---|")
    for variant in args.variants:
        b = [r[variant] for r in times["base"]]
        w = [r[variant] for r in times["working tree"]]
        print(f"| SMP-{variant} | {min(b):.2f} | {statistics.median(b):.2f} | {min(w):.2f} | "
              f"{statistics.median(w):.2f} | {statistics.median(w) / statistics.median(b):.2f} |")


if __name__ == "__main__":
    main()
