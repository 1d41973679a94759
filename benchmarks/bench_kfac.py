"""Wall time of the Kronecker-factored (kfac) preconditioners beside the block and dense ones.

Usage (from the repository root)::

    .venv/bin/python benchmarks/bench_kfac.py                      # toy S=1000, K=5000; LeNet S=10 and 100
    .venv/bin/python benchmarks/bench_kfac.py --toy-steps 1000 --lenet-chains 10
    .venv/bin/python benchmarks/bench_kfac.py --smoke               # every table at tiny sizes (seconds)

Prints markdown tables:

* the toy network (d = 20) at the paper's S and K: seconds of ``run_smp`` (Fisher set-up included)
  for the block, dense and kfac structures with each temporal strategy, from a MAP start
  (``bench_recursion.fit_toy_start``), at the paper's tau (0.3 for block and kfac, 0.1 for dense);
* LeNet-5 (d = 47,154, random inputs): milliseconds per SMP step (score of S chains, solve and
  update; the difference of two run lengths, fastest of three) for fixed-diag and the kfac
  strategies, with the empirical Fisher of 600 examples, and ``ema-kfac`` factorised every
  ``--ema-refresh`` steps; dense and block do not fit in memory there (see the stored numbers per
  chain, printed first).

The process opts in to ``smp_core.memory.retain_freed_memory()`` (as the MNIST study does on a CPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recursion import bench_lenet, fit_toy_start  # noqa: E402

from smp_book.machine import cpu_model  # noqa: E402
from smp_book.toy import make_toy_data  # noqa: E402
from smp_core import lenet5, run_smp, toy_mlp  # noqa: E402
from smp_core.fisher import structure_for  # noqa: E402
from smp_core.memory import retain_freed_memory  # noqa: E402
from smp_core.models import SequentialChainModel, as_chain_model  # noqa: E402
from smp_core.preconditioners import STRATEGIES, ema  # noqa: E402

TAU = {"block": 0.3, "dense": 0.1, "kfac": 0.3}
# --smoke: tiny sizes in place of the defaults (options given on the command line still apply)
SMOKE = {"toy_chains": 4, "toy_steps": 10, "fit_steps": 20, "lenet_chains": [2], "lenet_steps": 2, "ema_refresh": 2,
         "lenet_fisher_examples": 16, "repeats": 1}


def stored_numbers(model) -> dict[str, int]:
    return {name: structure_for(model, name).stat_numel() for name in ("diag", "block", "dense", "kfac")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--toy-chains", type=int, default=1000)
    parser.add_argument("--toy-steps", type=int, default=5000)
    parser.add_argument("--lenet-chains", type=int, nargs="*", default=[10, 100])
    parser.add_argument("--lenet-steps", type=int, default=20)
    parser.add_argument("--ema-refresh", type=int, default=10)
    parser.add_argument("--fit-steps", type=int, default=1500, help="Adam steps of the toy network's MAP start")
    parser.add_argument("--lenet-fisher-examples", type=int, default=600, help="the LeNet runs' empirical Fisher data")
    parser.add_argument("--repeats", type=int, default=3, help="LeNet: runs of each length (the fastest is taken)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--smoke", action="store_true", help="every table at tiny sizes, in seconds (times: noise)")
    args = parser.parse_args()
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
        print("Smoke run: tiny sizes, to check that the script runs end to end; the times mean nothing.\n")
    torch.set_num_threads(args.threads)
    retained = retain_freed_memory()  # what the MNIST study does on a CPU (run_smp leaves the allocator alone)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; {args.threads} threads; "
          f"retain_freed_memory() in force: {retained}\n")

    toy, lenet = as_chain_model(toy_mlp()), SequentialChainModel(lenet5(), (1, 28, 28))
    print("Numbers in one chain's Fisher statistic\n")
    print("| structure | toy MLP (d = 20) | LeNet-5 (d = 47,154) |\n| --- | ---: | ---: |")
    a, b = stored_numbers(toy), stored_numbers(lenet)
    for name in a:
        print(f"| {name} | {a[name]:,} | {b[name]:,} |")

    print(f"\nToy network, S = {args.toy_chains}, K = {args.toy_steps}: seconds of run_smp\n")
    print("| strategy | block | dense | kfac |\n| --- | ---: | ---: | ---: |", flush=True)
    x, y = make_toy_data(500, seed=0)
    net = fit_toy_start(x, y, args.fit_steps)
    for strategy in STRATEGIES:
        cells = []
        for structure in ("block", "dense", "kfac"):
            res = run_smp(net, "bernoulli", x, preconditioner=f"{strategy}-{structure}", tau=TAU[structure],
                          n_steps=args.toy_steps, n_chains=args.toy_chains, seed=0, progress=False)
            cells.append(f"{res.elapsed:.1f}" + (f" ({res.n_diverged} diverged)" if res.n_diverged else ""))
        print(f"| {strategy} | " + " | ".join(cells) + " |", flush=True)

    print(f"\nLeNet-5: milliseconds per SMP step ({args.lenet_steps} steps, fastest of {args.repeats})\n")
    print("| variant | " + " | ".join(f"S = {s}" for s in args.lenet_chains) + " |\n| --- |"
          + " ---: |" * len(args.lenet_chains), flush=True)
    variants = ("fixed-diag", "fixed-kfac", "periodic-kfac", "ema-kfac",
                (f"ema-kfac, ema_refresh = {args.ema_refresh}",
                 {"preconditioner": ema("kfac", refresh=args.ema_refresh)}))
    table = {s: dict(bench_lenet(s, args.lenet_steps, variants=variants, repeats=args.repeats,
                                 n_fisher=args.lenet_fisher_examples)) for s in args.lenet_chains}
    for name in table[args.lenet_chains[0]]:
        print(f"| {name} | " + " | ".join(f"{table[s][name]:.1f}" for s in args.lenet_chains) + " |")
    print("\n(periodic-kfac recomputes every T = 500 steps, so these steps reuse the factors of theta_0 as "
          "fixed-kfac does; its recomputation is one pass over the Fisher data per chain. ema-kfac "
          "eigendecomposes its factors at every step; with ema_refresh = m every m steps, so the steps "
          "timed should be a multiple of m: the default 20 steps hold two refreshes of m = 10)")


if __name__ == "__main__":
    main()
