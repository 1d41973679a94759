"""What a float64 statistic costs: a preconditioner's ``statistic_dtype=torch.float64`` against the chains' float32.

Usage (from the repository root)::

    .venv/bin/python benchmarks/bench_statistic_dtype.py                  # toy S=1000, K=2000; wider MLP S=50, K=200
    .venv/bin/python benchmarks/bench_statistic_dtype.py --toy-steps 500 --wide-steps 50
    .venv/bin/python benchmarks/bench_statistic_dtype.py --smoke     # every table at tiny sizes (seconds)

Prints markdown tables of the seconds of ``run_smp`` (Fisher set-up included), fastest of
``--repeats`` runs, for the block, dense and kfac preconditioners with each temporal strategy,
with the statistic in float32 (the default: the chains' dtype) and in float64, and their ratio:

* the toy network (d = 20) from a MAP start (``bench_recursion.fit_toy_start``) at the toy chapters'
  tau (``smp_book.config.TOY_TAU``: the paper's 0.3 for block and 0.1 for dense, our 0.3 for kfac);
* a wider MLP 2-16-16-1 (d = 337) fitted to the same data, where the block and dense statistics are
  larger (its largest block 256 x 256); dense is left out there (a 337 x 337 Cholesky per chain and
  step), tau 0.1.

The column ``warned (f32)`` counts the RuntimeWarnings of failed float32 factorisations (see
``smp_core.preconditioners._redo_failed``): runs where the float32 statistic came out indefinite by
more than the ridge. The process opts in to ``smp_core.memory.retain_freed_memory()``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recursion import fit_toy_start  # noqa: E402

from smp_book.config import TOY_TAU  # noqa: E402
from smp_book.machine import cpu_model  # noqa: E402
from smp_book.toy import make_toy_data  # noqa: E402
from smp_core import run_smp  # noqa: E402
from smp_core.memory import retain_freed_memory  # noqa: E402
from smp_core.preconditioners import STRATEGIES, preconditioner_from_name  # noqa: E402

# --smoke: tiny sizes in place of the defaults (options given on the command line still apply)
SMOKE = {"toy_chains": 4, "toy_steps": 10, "wide_chains": 2, "wide_steps": 5, "fit_steps": 20, "repeats": 1}

def fit_wide_start(x, y, steps=1500):
    """A 2-16-16-1 tanh MLP fitted to the toy data (prior N(0, I)), as a larger network's start."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(net(x)[:, 0], y, reduction="sum")
        loss = loss + 0.5 * sum((p**2).sum() for p in net.parameters())
        loss.backward()
        opt.step()
    return net


def timed(net, x, name, tau, n_chains, n_steps, dtype, repeats):
    """Fastest of ``repeats`` runs (seconds) and the number of factorisation warnings of the first."""
    best, warned = float("inf"), 0
    for i in range(repeats):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            started = time.perf_counter()
            run_smp(net, "bernoulli", x, preconditioner=preconditioner_from_name(name, statistic_dtype=dtype), tau=tau,
                    n_steps=n_steps, n_chains=n_chains, seed=0, progress=False)
            best = min(best, time.perf_counter() - started)
        if i == 0:
            warned = sum("indefinite by more than the ridge" in str(w.message) for w in caught)
    return best, warned


def table(title, net, x, structures, taus, n_chains, n_steps, repeats):
    print(f"\n{title} (S = {n_chains}, K = {n_steps}; seconds, fastest of {repeats})\n")
    print("| preconditioner | float32 statistic | float64 statistic | ratio | warned (f32) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for structure in structures:
        for strategy in STRATEGIES:
            name = f"{strategy}-{structure}"
            single, warned = timed(net, x, name, taus[structure], n_chains, n_steps, None, repeats)
            double, _ = timed(net, x, name, taus[structure], n_chains, n_steps, torch.float64, repeats)
            print(f"| {name} | {single:.2f} | {double:.2f} | {double / single:.2f} | {warned} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--toy-chains", type=int, default=1000)
    parser.add_argument("--toy-steps", type=int, default=2000)
    parser.add_argument("--wide-chains", type=int, default=50)
    parser.add_argument("--wide-steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--fit-steps", type=int, default=1500, help="Adam steps of the networks' MAP starts")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--smoke", action="store_true", help="every table at tiny sizes, in seconds (times: noise)")
    args = parser.parse_args()
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
        print("Smoke run: tiny sizes, to check that the script runs end to end; the times mean nothing.\n")
    torch.set_num_threads(args.threads)
    retained = retain_freed_memory()  # an explicit opt-in: run_smp leaves the allocator alone
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; {args.threads} threads; "
          f"retain_freed_memory() in force: {retained}")
    x, y = make_toy_data(500, seed=0)
    table("Toy network, d = 20", fit_toy_start(x, y, args.fit_steps), x, ("block", "dense", "kfac"), TOY_TAU,
          args.toy_chains, args.toy_steps, args.repeats)
    table("MLP 2-16-16-1, d = 337", fit_wide_start(x, y, args.fit_steps), x, ("block", "kfac"),
          {"block": 0.1, "kfac": 0.1}, args.wide_chains, args.wide_steps, args.repeats)


if __name__ == "__main__":
    main()
