"""run_smp against an independent JAX implementation of the toy recursion (``jax_reference.py``), side by side.

Usage (from the repository root)::

    .venv/bin/python benchmarks/bench_jax.py                 # S = 1000, K = 5000, the 10 toy variants, 3 repeats
    .venv/bin/python benchmarks/bench_jax.py --variants none ema-block --repeats 5
    .venv/bin/python benchmarks/bench_jax.py --smoke          # tiny sizes (seconds; the times are noise)

Every measurement is a fresh process pinned to ``--threads`` cores (``os.sched_setaffinity``, which binds
torch's and XLA's thread pools alike), and the two implementations alternate: repeat ``r`` runs run_smp first
when ``r`` is even and JAX first when it is odd, so that a drift of the machine's speed falls on both. Each
process fits the same start (``bench_recursion.fit_toy_start``), warms up (run_smp: a 20-step run; JAX: two
chunks of the run, which compiles them and the periodic Fisher's recomputation) and then times one whole run:
run_smp's ``elapsed`` (the Fisher's set-up included) and JAX's wall time to the last result (its own Fisher
included, its compilation not). The settings are the toy chapter's: the paper's tau per structure, ridge 1e-4,
beta 0.98, T = 500, the model-expected Fisher of the 500 training points. The table gives the median over the
repeats and the ratio run_smp / JAX (above 1: run_smp is slower); the load average before and after says whether
anything else ran (the script first waits, up to ``--settle`` seconds, for the 1-minute average to forget work that
just ended), and a run that found other work on the machine is marked as not for comparisons. The
two do not do quite the same work: run_smp also draws each chain from its own random stream and checks every
50 steps for diverged chains (the column "chains lost" sums, over the repeats, run_smp's diverged chains and
the reference's non-finite ones).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TAU = {"none": 1.0, "diag": 0.3, "block": 0.3, "dense": 0.1}  # Section 3.2.3
VARIANTS = ["none", "fixed-diag", "fixed-block", "fixed-dense", "ema-diag", "ema-block", "ema-dense",
            "periodic-diag", "periodic-block", "periodic-dense"]
SMOKE = {"chains": 8, "steps": 20, "repeats": 1, "fit_steps": 20, "variants": ["ema-block"], "settle": 0}


def one(implementation: str, variant: str, chains: int, steps: int, fit_steps: int) -> dict:
    """Time one whole run of ``variant`` in this process (see the module's docstring)."""
    sys.path.insert(0, str(HERE))
    from bench_recursion import fit_toy_start

    from smp_book.toy import make_toy_data

    x, y = make_toy_data(500, seed=0)
    net = fit_toy_start(x, y, fit_steps)
    tau = TAU[variant.split("-")[-1]]
    if implementation == "run_smp":
        from smp_core import run_smp

        def timed(k):
            return run_smp(net, "bernoulli", x, preconditioner=variant, tau=tau, n_steps=k, n_chains=chains, seed=0,
                           progress=False)

        timed(min(steps, 20))
        result = timed(steps)
        return {"seconds": result.elapsed, "diverged": int(result.n_diverged)}
    import jax_reference as jr

    from smp_core.models import as_chain_model

    theta0 = as_chain_model(net).layout.flatten(net).detach().numpy()
    chunk = 500 if variant.startswith("periodic") else jr.CHUNK

    def timed(k):
        return jr.run(variant, x.numpy(), theta0, tau=tau, n_steps=k, n_chains=chains, seed=0)

    timed(min(steps, 2 * chunk))  # compiles the chunk and, for periodic, the Fisher's recomputation
    if steps > chunk and steps % chunk:
        timed(steps % chunk)  # and the last, shorter chunk
    result = timed(steps)
    return {"seconds": result["seconds"], "diverged": result["non_finite"]}


def measure(implementation, variant, args) -> dict:
    command = [sys.executable, __file__, "--one", implementation, variant, "--chains", str(args.chains),
               "--steps", str(args.steps), "--fit-steps", str(args.fit_steps), "--threads", str(args.threads)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # as smp_book.nuts: never a GPU, which run_smp does not use here
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{implementation} {variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chains", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--variants", nargs="*", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fit-steps", type=int, default=1500, help="Adam steps of the toy network's start")
    parser.add_argument("--threads", type=int, default=2, help="cores each measured process is pinned to")
    parser.add_argument("--csv", default=None, help="also save the table as CSV in this folder")
    parser.add_argument("--settle", type=float, default=300,
                        help="seconds at most to wait for the load average to fall before timing")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, in seconds (the times are noise)")
    parser.add_argument("--one", nargs=2, metavar=("IMPLEMENTATION", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("chains", "steps", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: at least 1, got {getattr(args, name)}")
    if args.threads > len(os.sched_getaffinity(0)):
        parser.error(f"--threads: this process may run on {len(os.sched_getaffinity(0))} cores, not {args.threads}")
    if args.one:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.threads])
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(one(*args.one, args.chains, args.steps, args.fit_steps)))
        return 0
    if args.smoke:
        defaults = parser.parse_args([])
        for key, value in SMOKE.items():
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)

    sys.path.insert(0, str(HERE))
    import jax
    import torch
    from tables import Tables

    from smp_book.machine import cpu_model

    machine = (f"{cpu_model()} ({os.cpu_count()} cores), {args.threads} pinned per process; torch {torch.__version__}, "
               f"jax {jax.__version__}")
    print(machine)
    # the 1-minute load average remembers work that just ended (about a minute to halve): wait for it to settle
    limit, waited = os.cpu_count() - args.threads + 0.5, time.perf_counter()
    while os.getloadavg()[0] > limit and time.perf_counter() - waited < args.settle:
        time.sleep(5)
    print(f"waited {time.perf_counter() - waited:.0f} s for the load average to settle", file=sys.stderr)
    load_start, started = os.getloadavg()[0], time.perf_counter()
    times: dict[str, dict[str, list[float]]] = {v: {"run_smp": [], "JAX": []} for v in args.variants}
    diverged: dict[str, dict[str, int]] = {v: {} for v in args.variants}
    for r in range(args.repeats):
        for variant in args.variants:
            order = ("run_smp", "JAX") if r % 2 == 0 else ("JAX", "run_smp")
            for implementation in order:
                got = measure("run_smp" if implementation == "run_smp" else "jax", variant, args)
                times[variant][implementation].append(got["seconds"])
                diverged[variant][implementation] = diverged[variant].get(implementation, 0) + got["diverged"]
                print(f"repeat {r + 1}/{args.repeats} {variant} {implementation}: {got['seconds']:.2f} s",
                      file=sys.stderr, flush=True)
    load_end = os.getloadavg()[0]
    # busy cores besides the pinned ones: the load this process found, or what was left at the end
    loaded = max(load_start, load_end - args.threads) > limit
    out = Tables(args.csv, machine=machine)
    note = "; LOADED (other work ran): not for comparisons" if loaded else ""
    out.start("jax", f"Toy recursion, S = {args.chains}, K = {args.steps}: seconds, the median of {args.repeats} "
              f"repeat(s); load average {load_start:.1f} before, {load_end:.1f} after{note}",
              ["variant", "run_smp s", "JAX s", "run_smp / JAX", "chains lost (run_smp, JAX)"])
    for variant in args.variants:
        ours, theirs = (statistics.median(times[variant][i]) for i in ("run_smp", "JAX"))
        out.row(variant, f"{ours:.2f}", f"{theirs:.2f}", f"{ours / theirs:.2f}",
                f"{diverged[variant]['run_smp']}, {diverged[variant]['JAX']}")
    out.save()
    print(f"\n{time.perf_counter() - started:.0f} s in all", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
