"""One LeNet-5 SMP step at two git revisions of smp_core, measured in alternation.

Usage (from the repository root)::

    .venv/bin/python benchmarks/bench_revisions.py --base bc454ff            # base revision against the working tree
    .venv/bin/python benchmarks/bench_revisions.py --base HEAD~3 --rounds 6 --variants none ema-diag

On a shared or virtual machine the speed of the same code drifts by tens of percent over minutes, so
two timings taken at different times do not compare two implementations. This script checks the
base revision out into a temporary git worktree and, round after round, runs the same measurement in
a fresh process for the base and then for the working tree, so that both see the same conditions;
it prints the fastest and the median round of each. The measurement is that of
``bench_mnist.py``: the difference of two ``run_smp`` calls of different lengths (the Fisher set-up
cancels), each the faster of two, divided by the extra steps; random inputs, S = 100 chains.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Runs in a fresh process with the revision's checkout first on sys.path; prints ms per step as JSON.
PROBE = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from smp_core import lenet5, run_smp
torch.set_num_threads(int(sys.argv[3]))
torch.manual_seed(0)
net, steps = lenet5(), int(sys.argv[4])
x, y = torch.rand(2000, 1, 28, 28), torch.randint(0, 10, (2000,))
result = {}
for variant in sys.argv[2].split(","):
    kw = dict(preconditioner=variant, tau=0.05, n_chains=100, seed=0, progress=False, input_shape=(1, 28, 28),
              fisher="empirical", fisher_data=(x[:300], y[:300]), period=10**9)
    run_smp(net, "categorical", x, n_steps=3, **kw)
    short = min(run_smp(net, "categorical", x, n_steps=5, **kw).elapsed for _ in range(2))
    long = min(run_smp(net, "categorical", x, n_steps=5 + steps, **kw).elapsed for _ in range(2))
    result[variant] = 1000 * (long - short) / steps
print(json.dumps(result))
"""


def _probe(checkout: Path, variants: list[str], threads: int, steps: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(checkout), ",".join(variants), str(threads), str(steps)],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the measurement failed in {checkout}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="git revision to compare the working tree with")
    parser.add_argument("--variants", nargs="*", default=["none", "fixed-diag", "ema-diag", "periodic-diag"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    from smp_book.results import cpu_model  # the working tree's

    print(f"{cpu_model()}, {args.threads} threads; base {args.base} ({rev}) against the working tree, "
          f"{args.rounds} alternating rounds of {args.steps} steps, S = 100\n")
    times: dict[str, list[dict[str, float]]] = {"base": [], "working tree": []}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), rev], cwd=ROOT, check=True)
        try:
            for _ in range(args.rounds):
                times["base"].append(_probe(base, args.variants, args.threads, args.steps))
                times["working tree"].append(_probe(ROOT, args.variants, args.threads, args.steps))
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
