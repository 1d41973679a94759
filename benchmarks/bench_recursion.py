"""Wall time of the SMP recursion: the toy example at paper scale and one LeNet-5 step.

Usage (from the repository root)::

    .venv/bin/python benchmarks/bench_recursion.py            # toy S=1000, K=5000, all 10 variants; LeNet S=100
    .venv/bin/python benchmarks/bench_recursion.py --steps 500 --variants none ema-block
    .venv/bin/python benchmarks/bench_recursion.py --smoke     # every table at tiny sizes (seconds)

Prints a markdown table. Times are wall-clock seconds of ``run_smp`` (Fisher set-up included) with
``torch.set_num_threads(--threads)``; the LeNet figure is milliseconds per recursion step (score of
S chains, preconditioner solve and update), measured after a warm-up. The last table is the floor
that a per-step factorisation puts under the EMA variants: one batched Cholesky factorisation and
solve of S symmetric positive-definite n x n matrices (LAPACK through torch), times K steps.
Between them, a LeNet step split into its parts, the LeNet step with and without the allocator
setting of ``smp_core.memory`` (fresh processes), and the two forms of the batched matrix-vector
product of its fully connected layers. The process opts in to that allocator setting
(``retain_freed_memory()``, as the MNIST study does on a CPU; ``run_smp`` leaves the allocator alone),
so that the LeNet figures are those of the study's runs.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from smp_book.machine import cpu_model
from smp_book.toy import make_toy_data
from smp_core import Fisher, lenet5, run_smp, toy_mlp
from smp_core.memory import retain_freed_memory

# The paper's step-size scales (Section 3.2.3) and the targets of issue 2 (seconds, this 2-core CPU).
TOY_VARIANTS = {
    "none": (1.0, 1.0),
    "fixed-diag": (0.3, None), "fixed-block": (0.3, None), "fixed-dense": (0.1, None),
    "ema-diag": (0.3, None), "ema-block": (0.3, 2.0), "ema-dense": (0.1, 3.0),
    "periodic-diag": (0.3, None), "periodic-block": (0.3, None), "periodic-dense": (0.1, 2.0),
}
PAPER_SECONDS = {  # Table ex1_elapsed, 6 CPU threads (Julia)
    "none": 107.4, "fixed-diag": 145.9, "fixed-block": 150.4, "fixed-dense": 162.3, "ema-diag": 149.1,
    "ema-block": 163.4, "ema-dense": 186.2, "periodic-diag": 252.7, "periodic-block": 260.4,
    "periodic-dense": 286.6,
}
# --smoke: tiny sizes in place of the defaults (options given on the command line still apply)
SMOKE = {"chains": 4, "steps": 10, "fit_steps": 20, "lenet_chains": 2, "lenet_steps": 2, "lenet_fisher_examples": 16,
         "repeats": 1, "blocks": 1, "block_calls": 2, "cholesky_repeats": 2}


def fit_toy_start(x, y, steps=1500):
    """A MAP estimate of the toy network (prior N(0, I)) to start from, as a stand-in for NUTS-mean."""
    torch.manual_seed(0)
    net = toy_mlp()
    opt = torch.optim.Adam(net.parameters(), lr=0.03)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(net(x)[:, 0], y, reduction="sum")
        loss = loss + 0.5 * sum((p**2).sum() for p in net.parameters())
        loss.backward()
        opt.step()
    return net


def bench_toy(variants, n_chains, n_steps, fit_steps=1500):
    x, y = make_toy_data(500, seed=0)
    net = fit_toy_start(x, y, fit_steps)
    rows = []
    for name in variants:
        tau, target = TOY_VARIANTS[name]
        res = run_smp(net, "bernoulli", x, preconditioner=name, tau=tau, n_steps=n_steps, n_chains=n_chains,
                      seed=0, progress=False)
        rows.append((name, tau, res.elapsed, target, res.n_diverged))
    return rows


def bench_lenet(n_chains, n_steps, variants=("none", "fixed-diag", "ema-diag", "periodic-diag"), repeats=3,
                n_fisher=600):
    """Milliseconds per LeNet-5 step of each variant: the difference of two run lengths, each the fastest of
    ``repeats`` runs, with the empirical Fisher of ``n_fisher`` of the random inputs."""
    torch.manual_seed(0)
    net = lenet5()
    x = torch.rand(2000, 1, 28, 28)
    y = torch.randint(0, 10, (2000,))
    rows = []
    for variant in variants:
        # a variant is a preconditioner name, or (label, run_smp keyword arguments with its preconditioner)
        name, options = (variant, {"preconditioner": variant}) if isinstance(variant, str) else variant
        kw = dict(tau=0.05, n_chains=n_chains, seed=0, progress=False,
                  fisher=Fisher("empirical", x[:n_fisher], y[:n_fisher]), **options)
        run_smp(net, "categorical", x, n_steps=3, **kw)  # warm-up
        # the fastest of `repeats` runs of each length: the least disturbed by other work on the machine
        t_short = min(run_smp(net, "categorical", x, n_steps=5, **kw).elapsed for _ in range(repeats))
        t_long = min(run_smp(net, "categorical", x, n_steps=5 + n_steps, **kw).elapsed for _ in range(repeats))
        rows.append((name, 1000 * (t_long - t_short) / n_steps))
    return rows


def _best_of(fn, repeats, inner):
    """Milliseconds per call of ``fn``: the fastest of ``repeats`` blocks of ``inner`` calls (after a warm-up).

    The fastest block is the least disturbed by other work on a shared machine.
    """
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - started) / inner)
    return 1000 * best


def bench_lenet_parts(n_chains, repeats=5, inner=50):
    """One LeNet-5 step split into its parts (ms): forward, score (vjp), and the parameter update."""
    from smp_core.likelihoods import Categorical
    from smp_core.models import as_chain_model

    torch.manual_seed(0)
    net = lenet5()
    model = as_chain_model(net, (1, 28, 28))
    theta = model.layout.flatten(net).expand(n_chains, -1).clone()
    x = torch.rand(n_chains, 1, 28, 28)
    lik, gen = Categorical(), torch.Generator().manual_seed(0)
    buf = torch.empty_like(theta)
    out, _ = model.forward(theta, x)
    cot = lik.residual(out, lik.sample(out, gen))

    def score():
        _, ctx = model.forward(theta, x)
        model.vjp(ctx, cot, out=buf)

    forward = _best_of(lambda: model.forward(theta, x), repeats, inner)
    return [("forward", forward), ("score (vjp)", _best_of(score, repeats, inner) - forward),
            ("theta += gamma s", _best_of(lambda: theta.add_(buf, alpha=1e-9), repeats, inner))]


def bench_matvec(n_chains, shapes=((128, 256), (84, 128), (10, 84)), repeats=5, inner=50):
    """Milliseconds for ``W_b h_b`` over ``n_chains`` chains, column form against row form."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n_out, n_in in shapes:
        w = torch.randn(n_chains, n_out, n_in, generator=gen)
        h = torch.randn(n_chains, n_in, generator=gen)
        column = _best_of(lambda w=w, h=h: torch.bmm(w, h.unsqueeze(-1)), repeats, inner)
        row = _best_of(lambda w=w, h=h: torch.bmm(h.unsqueeze(1), w.transpose(1, 2)), repeats, inner)
        rows.append((n_out, n_in, column, row))
    return rows


def _allocator_probe(n_chains, n_steps, retain, repeats=3, n_fisher=600):
    """Run in a subprocess: ms per LeNet-5 step (none) and minor page faults per step, one line.

    ``retain``: call ``smp_core.memory.retain_freed_memory()`` first (``run_smp`` does not); the line
    ends with whether its setting is in force."""
    import resource

    applied = retain_freed_memory() if retain else False
    ms = bench_lenet(n_chains, n_steps, variants=("none",), repeats=repeats, n_fisher=n_fisher)[0][1]
    torch.manual_seed(0)
    x = torch.rand(2000, 1, 28, 28)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run_smp(lenet5(), "categorical", x, preconditioner="none", n_steps=n_steps, n_chains=n_chains, seed=0,
            progress=False)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / n_steps
    print(f"{ms} {faults} {int(applied)}")


def bench_allocator(n_chains, n_steps, threads, runs=3, repeats=3, n_fisher=600):
    """The LeNet step with glibc's default allocator thresholds and with smp_core.memory's, in fresh processes."""
    import subprocess
    import sys

    rows = []
    for label, retain in (("glibc default (adaptive)", False), ("retain_freed_memory() (smp_core.memory)", True)):
        for _ in range(runs):
            command = [sys.executable, __file__, "--allocator-probe", "--lenet-chains", str(n_chains), "--lenet-steps",
                       str(n_steps), "--threads", str(threads), "--repeats", str(repeats),
                       "--lenet-fisher-examples", str(n_fisher)] + (["--retain-freed-memory"] if retain else [])
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"the allocator probe failed:\n{done.stderr[-3000:]}")
            ms, faults, applied = done.stdout.split()[-3:]
            # not in force where SMP_RETAIN_FREED_MEMORY=0 or without glibc: the row says so
            shown = label if applied == str(int(retain)) else f"{label}, not in force here"
            rows.append((shown, float(ms), float(faults)))
    return rows


def bench_cholesky(n_chains, sizes=(20, 6, 3, 2), repeats=200):
    """Milliseconds for one batched Cholesky factorisation + solve of ``n_chains`` matrices of each size."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        a = torch.randn(n_chains, n, 2 * n, generator=gen)
        m = a @ a.transpose(1, 2) / n + torch.eye(n)
        v = torch.randn(n_chains, n, 1, generator=gen)
        chol = torch.linalg.cholesky(m)
        times = []
        for fn in (lambda m=m: torch.linalg.cholesky_ex(m), lambda v=v, c=chol: torch.cholesky_solve(v, c)):
            for _ in range(5):
                fn()
            started = time.perf_counter()
            for _ in range(repeats):
                fn()
            times.append(1000 * (time.perf_counter() - started) / repeats)
        rows.append((n, *times))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chains", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--variants", nargs="*", default=list(TOY_VARIANTS))
    parser.add_argument("--fit-steps", type=int, default=1500, help="Adam steps of the toy network's MAP start")
    parser.add_argument("--lenet-chains", type=int, default=100)
    parser.add_argument("--lenet-steps", type=int, default=200)
    parser.add_argument("--lenet-fisher-examples", type=int, default=600, help="the LeNet runs' empirical Fisher data")
    parser.add_argument("--repeats", type=int, default=3,
                        help="LeNet: runs of each length (the fastest is taken), and processes per allocator setting")
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks of the parts and matvec tables")
    parser.add_argument("--block-calls", type=int, default=50, help="calls per timed block")
    parser.add_argument("--cholesky-repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-lenet", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="every table at tiny sizes, in seconds (times: noise)")
    parser.add_argument("--allocator-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--retain-freed-memory", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.allocator_probe:
        _allocator_probe(args.lenet_chains, args.lenet_steps, args.retain_freed_memory, args.repeats,
                         args.lenet_fisher_examples)
        return
    retained = retain_freed_memory()  # what the MNIST study does on a CPU (run_smp leaves the allocator alone)
    if args.smoke:
        print("Smoke run: tiny sizes, to check that the script runs end to end; the times mean nothing.\n")
    print(f"torch {torch.__version__}, {args.threads} threads, {cpu_model()} ({os.cpu_count()} cores), "
          f"retain_freed_memory() in force: {retained}, {time.strftime('%Y-%m-%d')}\n")
    print(f"Toy recursion: S = {args.chains}, K = {args.steps} (paper: 6 Julia threads)\n")
    print("| variant | tau | seconds | target (s) | paper (s) | diverged |")
    print("|---|---|---|---|---|---|")
    for name, tau, seconds, target, div in bench_toy(args.variants, args.chains, args.steps, args.fit_steps):
        tgt = "" if target is None else f"{target:.1f}"
        print(f"| SMP-{name} | {tau} | {seconds:.2f} | {tgt} | {PAPER_SECONDS[name]:.1f} | {div} |", flush=True)
    if not args.skip_lenet:
        print(f"\nLeNet-5 (d = 47,154), one recursion step, S = {args.lenet_chains} (target: 8 ms)\n")
        print("| variant | ms / step |")
        print("|---|---|")
        for name, ms in bench_lenet(args.lenet_chains, args.lenet_steps, repeats=args.repeats,
                                    n_fisher=args.lenet_fisher_examples):
            print(f"| SMP-{name} | {ms:.1f} |", flush=True)
        print(f"\nThe parts of one LeNet-5 step, S = {args.lenet_chains} (fastest of {args.blocks} blocks of "
              f"{args.block_calls} calls)\n")
        print("| part | ms |")
        print("|---|---|")
        for part, ms in bench_lenet_parts(args.lenet_chains, args.blocks, args.block_calls):
            print(f"| {part} | {ms:.2f} |", flush=True)
        print(f"\nOne LeNet-5 step (SMP-none, S = {args.lenet_chains}) in fresh processes, with glibc's adaptive "
              "allocator thresholds and with the fixed ones of smp_core.memory.retain_freed_memory() (an explicit "
              f"opt-in); {args.repeats} processes each\n")
        print("| allocator | ms / step | page faults / step |")
        print("|---|---|---|")
        for label, ms, faults in bench_allocator(args.lenet_chains, args.lenet_steps, args.threads, args.repeats,
                                                 args.repeats, args.lenet_fisher_examples):
            print(f"| {label} | {ms:.1f} | {faults:.0f} |", flush=True)
        print(f"\nBatched matrix-vector product W_b h_b of the fully connected layers, S = {args.lenet_chains}: "
              "column form bmm(W, h) against the row form bmm(h^T, W^T) that smp_core uses\n")
        print("| W (out x in) | column (ms) | row (ms) |")
        print("|---|---|---|")
        for n_out, n_in, column, row in bench_matvec(args.lenet_chains, repeats=args.blocks, inner=args.block_calls):
            print(f"| {n_out} x {n_in} | {column:.3f} | {row:.3f} |", flush=True)
    print(f"\nBatched Cholesky of S = {args.chains} SPD n x n matrices (the per-step cost of an EMA preconditioner)\n")
    print(f"| n | factorise (ms) | solve (ms) | x K = {args.steps} (s) |")
    print("|---|---|---|---|")
    for n, fact, solve in bench_cholesky(args.chains, repeats=args.cholesky_repeats):
        print(f"| {n} | {fact:.2f} | {solve:.2f} | {(fact + solve) * args.steps / 1000:.1f} |", flush=True)


if __name__ == "__main__":
    main()
