"""Wall time of the MNIST study's pieces: one MAP epoch, one SMP step, and what K = 10^6 costs.

Usage (from the repository root; MNIST is fetched by the offline loader when missing)::

    .venv/bin/python benchmarks/bench_mnist.py                   # CPU, and CUDA when present
    .venv/bin/python benchmarks/bench_mnist.py --devices cpu --map-batches 300
    .venv/bin/python benchmarks/bench_mnist.py --smoke           # every table at tiny sizes (seconds)

Prints markdown tables. The MAP epoch time is measured on ``--map-batches`` batches of 48 (the
paper's batch size) and scaled to the 54,000 training images; the SMP step is the difference of
two ``run_smp`` calls of different lengths (so the Fisher set-up cancels; each the fastest of
three runs), divided by the extra steps. On a CPU it is timed twice: the default, the whole step
run by the compiled kernel of ``smp_core.fused``, and the batched torch model it replaces (one
kernel per layer for all chains, step by step). On a GPU also twice: step by step and in blocks
of 50 steps replayed as CUDA graphs (``run_smp(options={"cuda_graph": ...})``). The paper-scale SMP-none time
(S = 100, K = 10^6, 10^8 score evaluations) is that step time times 10^6: a projection, labelled as
such, not a measured run. The next table times one periodic recomputation of the diagonal empirical Fisher for every
chain (``--fisher-examples`` validation images) by the three paths of ``smp_core.fisher``: virtual
rows (theta copied per example), one example at a time for all chains, and by layers (per chain,
one batched forward and backward pass of the module), then by ``estimate_fisher``, whichever of them it
takes.
The process opts in to ``smp_core.memory.retain_freed_memory()`` on a CPU, as the MNIST study does.

``--full-steps K`` adds a measured run (not a projection) of each of ``--full-variants`` at K steps with the
paper's tau (S = ``--chains``, theta_0 the initial weights, the Fisher from the largest of ``--val-images`` and
``--fisher-examples`` validation images), timed from start to end: the Fisher set-up and, for a periodic variant,
its recomputations included. A run whose projection (its measured step time times K, plus the Fisher at theta_0
and, for a periodic variant, K / 500 recomputations, each at the time ``estimate_fisher`` took in the Fisher
table) would end after ``--budget-s`` seconds from the start of the script is left out, and the table says so.

With ``--smoke`` every table runs at tiny sizes; the images are MNIST's when ``data/`` holds them
(never downloaded then) and otherwise uniform noise of MNIST's shape and random labels (the times do
not depend on the values), so that the smoke run works offline; the header says which.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tables import Tables

import smp_core.fisher as fisher_module
from smp_book.config import MNIST_TAU
from smp_book.machine import cpu_model
from smp_book.mnist import mnist_tensors
from smp_core import Fisher, as_chain_model, lenet5, run_smp
from smp_core.fused import fused_unavailable
from smp_core.likelihoods import Categorical
from smp_core.memory import retain_freed_memory
from smp_core.models import SequentialChainModel
from smp_core.preconditioners import Diagonal

PAPER_SMP_NONE_SECONDS = 4130.18  # Table ex2_elapsed, 6 CPU threads (Julia)
MODE_NAMES = {"compiled": "compiled kernel (CPU default)", "batched": "batched torch, one by one",
              "graphs": "CUDA graphs"}
# --smoke: tiny sizes in place of the defaults (options given on the command line still apply)
SMOKE = {"chains": 2, "steps": 2, "map_batches": 2, "map_warmup": 1, "val_images": 16, "fisher_examples": 8,
         "repeats": 1, "full_steps": 4, "full_variants": ["none", "periodic-diag"]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_map_epoch(x, y, device, n_batches, batch=48, n_train=54_000, warmup=20):
    torch.manual_seed(0)
    net = lenet5().to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=1e-3)
    x, y = x.to(device), y.to(device)
    order = torch.randperm(len(y)).to(device)
    batches = list(order.split(batch))

    def run(some):
        for idx in some:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()

    run(batches[:warmup])
    _sync(device)
    timed = batches[warmup : warmup + n_batches]
    if len(timed) < n_batches:
        raise ValueError(f"only {len(timed)} batches after the warm-up; load more training images")
    started = time.perf_counter()
    run(timed)
    _sync(device)
    per_batch = (time.perf_counter() - started) / len(timed)
    return per_batch * (n_train / batch)


def bench_smp_step(x, xv, yv, device, variant, n_chains, n_steps, mode, repeats=3):
    """Seconds per step. ``mode``: "compiled" (the CPU default: the whole step in the kernel of
    smp_core.fused), "batched" (the batched torch model, step by step: the CPU path without the
    kernel, and the GPU default without graphs) or "graphs" (CUDA graphs)."""
    net = lenet5().to(device)
    cuda_graph = {"compiled": None, "batched": False, "graphs": True}[mode]
    if mode == "batched":
        net = SequentialChainModel(net, (1, 28, 28))
    kw = dict(preconditioner=variant, tau=0.05, n_chains=n_chains, seed=0, progress=False,
              fisher=Fisher("empirical", xv, yv), options={"cuda_graph": cuda_graph})
    x = x.to(device)
    # with CUDA graphs the first block of 50 steps is the warm-up and the second is captured: both
    # runs include them, so that the difference is replays only
    base = 105 if mode == "graphs" else 5
    run_smp(net, "categorical", x, n_steps=base, **kw)  # warm-up
    # the fastest of `repeats` runs of each length: the least disturbed by other work on the machine
    short = min(run_smp(net, "categorical", x, n_steps=base, **kw).elapsed for _ in range(repeats))
    long = min(run_smp(net, "categorical", x, n_steps=base + n_steps, **kw).elapsed for _ in range(repeats))
    return (long - short) / n_steps


def full_run(x, xv, yv, device, variant, n_chains, n_steps):
    """Wall seconds of one whole run of ``variant`` at ``n_steps`` steps (paper's tau), and its diverged chains."""
    net = lenet5().to(device)
    _sync(device)
    started = time.perf_counter()
    result = run_smp(net, "categorical", x.to(device), preconditioner=variant, tau=MNIST_TAU[variant],
                     n_steps=n_steps, n_chains=n_chains, seed=0, progress=False,
                     fisher=Fisher("empirical", xv.to(device), yv.to(device)))
    _sync(device)
    return time.perf_counter() - started, result.n_diverged


def _virtual_rows(model, lik, theta, x, y):
    """estimate_fisher with the threshold for one example at a time set to 0: it then pairs chains and examples."""
    default = fisher_module._MIN_VIRTUAL_BATCH
    try:
        fisher_module._MIN_VIRTUAL_BATCH = 0
        return fisher_module.estimate_fisher(model, lik, theta, x, y, kind="empirical", structure="diag")
    finally:
        fisher_module._MIN_VIRTUAL_BATCH = default


def bench_fisher(xv, yv, device, n_chains, n_examples):
    """Seconds for the per-chain diagonal empirical Fisher over ``n_examples``, by each path of smp_core.fisher."""
    torch.manual_seed(0)
    net = lenet5().to(device)
    model = as_chain_model(net, (1, 28, 28))
    theta = model.layout.flatten(net) + 0.01 * torch.randn(n_chains, model.layout.dim, device=device)
    x, y = xv[:n_examples].to(device), yv[:n_examples].to(device)
    lik, diag = Categorical(), Diagonal(model.layout.dim)
    paths = {
        # every chain paired with every example of a batch, one backward pass (theta copied per example);
        # with one chain estimate_fisher takes the by-layers path instead, so this row needs several
        "virtual rows": lambda t, xs, ys: _virtual_rows(model, lik, t, xs, ys),
        # one example at a time for all chains (the general path for large models)
        "one example at a time": lambda t, xs, ys: fisher_module._fisher_example_by_example(
            model, lik, t, xs, ys, "empirical", diag, t.dtype),
        # per chain, all examples in one forward and backward pass of the module (what estimate_fisher
        # takes for LeNet-5 from about 45 chains up, and for one chain)
        "by layers": lambda t, xs, ys: fisher_module.diagonal_empirical_fisher_by_layers(model, lik, t, xs, ys),
        # whichever path estimate_fisher itself takes here: what a run's recomputations cost
        "estimate_fisher (its own choice)": lambda t, xs, ys: fisher_module.estimate_fisher(
            model, lik, t, xs, ys, kind="empirical", structure="diag"),
    }
    if n_chains < 2:
        del paths["virtual rows"]
    rows = []
    for name, run in paths.items():
        run(theta[:2], x[:4], y[:4])  # warm-up
        _sync(device)
        started = time.perf_counter()
        run(theta, x, y)
        _sync(device)
        rows.append((name, time.perf_counter() - started))
    return rows


def load_data(n_train, n_val, smoke):
    """``(x, y), (xv, yv), source``: the first training and validation images of the paper's split; in a
    smoke run, MNIST only when ``data/`` holds it (no download), otherwise a random stand-in."""
    try:
        data, _ = mnist_tensors("data", seed=0, subset=(n_train, n_val, 0), **({"download": False} if smoke else {}))
        return data["train"], data["val"], "MNIST (data/)"
    except RuntimeError:
        if not smoke:
            raise
    gen = torch.Generator().manual_seed(0)
    n = n_train + n_val
    x, y = torch.rand(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:]), "random stand-in for MNIST (no MNIST in data/)"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", nargs="*", default=None, help="default: cpu, and cuda when available")
    parser.add_argument("--chains", type=int, default=100)
    parser.add_argument("--steps", type=int, default=200, help="a multiple of 50 (the CUDA-graph block)")
    parser.add_argument("--map-batches", type=int, default=200)
    parser.add_argument("--map-warmup", type=int, default=20, help="MAP batches run before the timed ones")
    parser.add_argument("--val-images", type=int, default=600, help="validation images: the SMP runs' Fisher data")
    parser.add_argument("--repeats", type=int, default=3, help="SMP runs of each length (the fastest is taken)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fisher-examples", type=int, default=200)
    parser.add_argument("--variants", nargs="*", default=["none", "fixed-diag", "ema-diag", "periodic-diag"])
    parser.add_argument("--full-steps", type=int, default=0, help="K of the measured whole runs (0: none)")
    parser.add_argument("--full-variants", nargs="*", default=["none"], help="variants of the measured whole runs")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="leave out a whole run projected to end later than this many seconds from the start")
    parser.add_argument("--csv", type=Path, default=None, help="also save each table as DIR/<table>.csv")
    parser.add_argument("--smoke", action="store_true",
                        help="every table at tiny sizes, in seconds (times mean nothing); offline")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
        print("Smoke run: tiny sizes, to check that the script runs end to end; the times mean nothing.\n")
    for name in ("chains", "steps", "map_batches", "val_images", "repeats", "threads", "fisher_examples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    if args.full_steps < 0:
        parser.error(f"--full-steps: must be at least 0, got {args.full_steps}")
    unknown = [v for v in args.variants + args.full_variants if v not in MNIST_TAU]
    if unknown:
        parser.error(f"--variants/--full-variants: unknown {unknown}; known: {', '.join(MNIST_TAU)}")
    if args.full_steps and not set(args.full_variants) <= set(args.variants):
        parser.error("--full-variants: each must be among --variants (its step time decides whether it fits)")
    if not args.budget_s >= 0:  # NaN too
        parser.error(f"--budget-s: must be a number of seconds >= 0, got {args.budget_s}")
    torch.set_num_threads(args.threads)
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    retained = retain_freed_memory() if "cpu" in devices else False  # as the MNIST study on a CPU
    (x, y), (xv, yv), source = load_data(48 * (args.map_batches + args.map_warmup),
                                         max(args.val_images, args.fisher_examples), args.smoke)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(f"torch {torch.__version__}, {args.threads} CPU threads, {cpu_model()}, GPU: {gpu}, "
          f"retain_freed_memory() in force: {retained}, {time.strftime('%Y-%m-%d')}\nImages: {source}\n")
    out = Tables(args.csv, machine=f"torch {torch.__version__}, {args.threads} CPU threads, {cpu_model()}, GPU: {gpu}")
    out.start("map_epoch", "MAP epoch", ["device", "MAP epoch (s, 54,000 images)"])
    for name in devices:
        seconds = bench_map_epoch(x, y, torch.device(name), args.map_batches, warmup=args.map_warmup)
        out.row(name, f"{seconds:.1f}")
    out.start("steps", f"SMP step, LeNet-5 (d = 47,154), S = {args.chains}; periodic variants recompute the Fisher "
              "every 500 steps, not included here",
              ["device", "variant", "step run by", "ms / step", "K = 10^6 (s, projected)", "paper, SMP-none (s)"])
    xf, yf = xv[: args.val_images], yv[: args.val_images]
    step_seconds = {}
    for name in devices:
        # on a GPU, the step-by-step loop and blocks of 50 steps replayed as CUDA graphs; on a CPU, the
        # compiled kernel (the default) and the batched torch model it replaces
        modes = ["batched", "graphs"] if name.startswith("cuda") else ["compiled", "batched"]
        for variant in args.variants:
            for mode in modes:
                if mode == "compiled" and fused_unavailable() is not None:
                    out.row(name, f"SMP-{variant}", "compiled kernel", f"not available: {fused_unavailable()}", "", "")
                    continue
                step = bench_smp_step(x, xf, yf, torch.device(name), variant, args.chains, args.steps, mode,
                                      args.repeats)
                step_seconds[(name, variant)] = min(step, step_seconds.get((name, variant), float("inf")))
                paper = f"{PAPER_SMP_NONE_SECONDS:.0f}" if variant == "none" else ""
                out.row(name, f"SMP-{variant}", MODE_NAMES[mode], f"{1000 * step:.2f}", f"{step * 1e6:.0f}", paper)
    out.start("fisher", f"Diagonal empirical Fisher of S = {args.chains} chains over {args.fisher_examples} "
              "validation images", ["device", "path", "seconds"])
    fisher_seconds = {}
    for name in devices:
        for path, seconds in bench_fisher(xv, yv, torch.device(name), args.chains, args.fisher_examples):
            fisher_seconds[(name, path)] = seconds * len(xv) / args.fisher_examples
            out.row(name, path, f"{seconds:.2f}")
    if not args.full_steps:
        out.save()
        return
    out.start("runs", f"Whole runs, measured: S = {args.chains}, K = {args.full_steps:,}, the paper's tau, the Fisher "
              f"from {len(xv)} validation images (set-up and periodic recomputations included)",
              ["device", "variant", "seconds", "diverged chains", "paper, SMP-none (s)"])
    for name in devices:
        for variant in args.full_variants:
            projected = max(0.0, step_seconds[(name, variant)]) * args.full_steps
            fisher = fisher_seconds[(name, "estimate_fisher (its own choice)")]
            if variant != "none":  # the Fisher at theta_0, and periodic's recomputations every 500 steps
                projected += fisher * (1 + (args.full_steps // 500 if variant.startswith("periodic") else 0))
            left = args.budget_s - (time.perf_counter() - started)
            if projected > left:
                out.row(name, f"SMP-{variant}", f"left out: projected {projected:.0f} s, {max(left, 0):.0f} s of "
                        "the budget left", "", "")
                continue
            seconds, diverged = full_run(x, xv, yv, torch.device(name), variant, args.chains, args.full_steps)
            paper = f"{PAPER_SMP_NONE_SECONDS:.0f}" if variant == "none" else ""
            out.row(name, f"SMP-{variant}", f"{seconds:.1f}", diverged, paper)
    out.save()


if __name__ == "__main__":
    main()
