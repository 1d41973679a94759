"""How SMP's cost grows with the chains S and the network's size, beside minibatch training of the same network.

Usage (from the repository root, with nothing else running on the machine)::

    .venv/bin/python benchmarks/bench_cost.py                        # S = 10, 100, 1000; the three networks
    .venv/bin/python benchmarks/bench_cost.py --chains 10 100 --networks LeNet-5 CNN
    .venv/bin/python benchmarks/bench_cost.py --csv benchmarks/cost  # also saved for the book
    .venv/bin/python benchmarks/bench_cost.py --smoke                # tiny sizes (seconds)

Networks: LeNet-5 (``smp_core.lenet5``, 47k parameters, 28x28 grey inputs), a plain CNN of about 0.5M
parameters and a ResNet-style network of about 5M (four stages of two residual blocks, GroupNorm, no
batch statistics), both on 32x32 colour inputs; the inputs are uniform noise and the labels random (the
cost of a step does not depend on the values). LeNet-5 and the CNN are ``nn.Sequential`` and take the
compiled CPU kernel of ``smp_core.fused``; the ResNet takes the general path (``vmap`` over
``functional_call``).

Each cell runs in a fresh process with ``--threads`` torch threads, float32, ``fixed-diag`` (the MNIST
chapter's element-wise path) at the MNIST tau. The SMP step time is the difference of two ``run_smp`` runs of
different lengths (the Fisher set-up cancels), each the fastest of ``--repeats``, divided by the extra steps,
which are chosen so that the difference lasts about ``--seconds``. The memory is the process's peak resident
set during the runs minus its resident set just before them (network, inputs and torch already loaded).
A cell whose chains' parameters alone (S x d x 4 bytes) times 4 (the chains, their scores and the step's
buffers) would pass ``--max-gb`` (default: 60 % of this machine's memory) is left out, and the table says so.

Beside it, one step of minibatch training of the same network (Adam, batch 128, forward, backward and
update), the fastest of ``--repeats`` timings of ``--train-batches`` batches. One SMP step evaluates one
example's gradient per chain, so the tables compare the SMP step divided by S with the training step divided
by 128. The last table sets the paper's budget (S = 100, K = 10^6: 10^8 example-gradients) beside training a
5-member ensemble for 20 epochs of 54,000 images (5.4 x 10^6 example-gradients), both from these timings:
projections, labelled so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tables import Tables  # noqa: E402

SMOKE = {"chains": [2], "networks": ["LeNet-5"], "seconds": 0.05, "repeats": 1, "train_batches": 2,
         "train_batch": 8}
PAPER_CHAINS, PAPER_STEPS = 100, 1_000_000
ENSEMBLE, EPOCHS, TRAIN_IMAGES = 5, 20, 54_000


def networks():
    """name -> (a function building the network, one input's shape)."""
    import torch.nn as nn

    from smp_core import lenet5

    def cnn() -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(128 * 4 * 4, 192), nn.ReLU(), nn.Linear(192, 10))

    class Block(nn.Module):
        def __init__(self, c_in: int, c_out: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
            self.norm1 = nn.GroupNorm(8, c_out)
            self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
            self.norm2 = nn.GroupNorm(8, c_out)
            self.skip = (nn.Identity() if stride == 1 and c_in == c_out else
                         nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.GroupNorm(8, c_out)))

        def forward(self, x):
            h = self.norm1(self.conv1(x)).relu()
            return (self.norm2(self.conv2(h)) + self.skip(x)).relu()

    def resnet() -> nn.Sequential:
        layers, c_in = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.GroupNorm(8, 64), nn.ReLU()], 64
        for c_out, stride in ((64, 1), (128, 2), (256, 2), (256, 2)):
            layers += [Block(c_in, c_out, stride), Block(c_out, c_out, 1)]
            c_in = c_out
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, 10))

    return {"LeNet-5": (lenet5, (1, 28, 28)), "CNN": (cnn, (3, 32, 32)), "ResNet": (resnet, (3, 32, 32))}


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_smp(name: str, chains: int, seconds: float, repeats: int) -> dict:
    """In this process: ms per SMP step of ``name`` with ``chains`` chains, and the memory the runs added."""
    import torch

    from smp_book.config import MNIST_TAU
    from smp_core import Fisher, run_smp

    build, shape = networks()[name]
    torch.manual_seed(0)
    net = build()
    x = torch.rand(512, *shape)
    y = torch.randint(0, 10, (512,))
    kw = dict(preconditioner="fixed-diag", tau=MNIST_TAU["fixed-diag"], n_chains=chains, seed=0, progress=False,
              fisher=Fisher("empirical", x[:8], y[:8]))
    before = _resident_mb()
    base = 3
    run_smp(net, "categorical", x, n_steps=base, **kw)  # warm-up: builds the kernel, fills the caches
    rough = (run_smp(net, "categorical", x, n_steps=2 * base, **kw).elapsed
             - run_smp(net, "categorical", x, n_steps=base, **kw).elapsed) / base
    extra = max(3, min(2000, round(seconds / max(rough, seconds / 2000))))
    short = min(run_smp(net, "categorical", x, n_steps=base, **kw).elapsed for _ in range(repeats))
    long = min(run_smp(net, "categorical", x, n_steps=base + extra, **kw).elapsed for _ in range(repeats))
    return {"ms": 1000 * max(long - short, 0.0) / extra, "steps": extra, "added_mb": _peak_mb() - before}


def measure_training(name: str, batch: int, batches: int, repeats: int) -> dict:
    """In this process: ms per minibatch step of Adam on ``name`` (batch ``batch``), the memory it added, and the
    network's parameter count."""
    import torch
    import torch.nn.functional as F

    build, shape = networks()[name]
    torch.manual_seed(0)
    net = build()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.rand(batch, *shape)
    y = torch.randint(0, 10, (batch,))
    before = _resident_mb()

    def run(n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            opt.step()
        return time.perf_counter() - started

    run(2)  # warm-up
    best = min(run(batches) for _ in range(repeats))
    return {"ms": 1000 * best / batches, "added_mb": _peak_mb() - before,
            "params": sum(p.numel() for p in net.parameters())}


def in_fresh_process(threads: int, *args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, __file__, "--measure", *map(str, args), "--threads", str(threads)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench_cost {' '.join(map(str, args))} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chains", type=int, nargs="+", default=[10, 100, 1000], help="values of S")
    parser.add_argument("--networks", nargs="+", default=["LeNet-5", "CNN", "ResNet"],
                        choices=["LeNet-5", "CNN", "ResNet"])
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every measuring process")
    parser.add_argument("--seconds", type=float, default=3.0, help="about how long the timed difference lasts")
    parser.add_argument("--repeats", type=int, default=3, help="timings of each length; the fastest is kept")
    parser.add_argument("--train-batch", type=int, default=128)
    parser.add_argument("--train-batches", type=int, default=10, help="minibatch steps per training timing")
    parser.add_argument("--max-gb", type=float,
                        default=0.6 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30,
                        help="leave out a cell whose chains' parameters times 4 would need more (GB)")
    parser.add_argument("--csv", type=Path, default=None, help="also save the tables under DIR")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check that the script runs")
    parser.add_argument("--measure", nargs="+", help=argparse.SUPPRESS)  # one cell, in a fresh process
    args = parser.parse_args(argv)
    if args.measure:
        import torch
        torch.set_num_threads(args.threads)
        kind, name, *rest = args.measure
        if kind == "smp":
            out = measure_smp(name, int(rest[0]), float(rest[1]), int(rest[2]))
        else:
            out = measure_training(name, int(rest[0]), int(rest[1]), int(rest[2]))
        print(json.dumps(out))
        return
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    for name in ("threads", "repeats", "train_batch", "train_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    if min(args.chains) < 1:
        parser.error(f"--chains: each must be at least 1, got {args.chains}")
    if not args.seconds > 0 or not args.max_gb > 0:
        parser.error("--seconds and --max-gb: must be positive")

    from smp_book.machine import cpu_model
    machine = f"{cpu_model()}, {args.threads} torch thread(s)"
    train = {name: in_fresh_process(args.threads, "train", name, args.train_batch, args.train_batches, args.repeats)
             for name in args.networks}
    params = {name: cell["params"] for name, cell in train.items()}
    smp = {}
    for name in args.networks:
        for s in sorted(set(args.chains)):
            need_gb = s * params[name] * 4 * 4 / 2**30
            smp[name, s] = (None if need_gb > args.max_gb else
                            in_fresh_process(args.threads, "smp", name, s, args.seconds, args.repeats))

    out = Tables(args.csv, machine=machine)
    out.start("steps", f"One SMP step (fixed-diag, float32) against S and the network, beside one minibatch step "
              f"of Adam (batch {args.train_batch}); {machine}",
              ["network", "parameters", "S", "ms / step", "ms / example-gradient", "training ms / example-gradient",
               "SMP / training", "memory added (MB)"])
    for name in args.networks:
        per_train = train[name]["ms"] / args.train_batch
        for s in sorted(set(args.chains)):
            cell = smp[name, s]
            if cell is None:
                need = s * params[name] * 4 / 2**30
                out.row(name, f"{params[name]:,}", s, f"left out: the chains' parameters alone are {need:.1f} GB",
                        "", f"{per_train:.3g}", "", "")
                continue
            per_smp = cell["ms"] / s
            out.row(name, f"{params[name]:,}", s, f"{cell['ms']:.3g}", f"{per_smp:.3g}", f"{per_train:.3g}",
                    f"{per_smp / per_train:.2g}", f"{cell['added_mb']:.0f}")

    batches = math.ceil(TRAIN_IMAGES / args.train_batch)
    out.start("budget", f"Projected hours: the paper's SMP budget (S = {PAPER_CHAINS}, K = 10^6) beside a "
              f"{ENSEMBLE}-member ensemble trained for {EPOCHS} epochs of {TRAIN_IMAGES:,} images (batch "
              f"{args.train_batch}), from the step times above; {machine}",
              ["network", "SMP hours", "ensemble hours", "SMP / ensemble"])
    for name in args.networks:
        ensemble = ENSEMBLE * EPOCHS * batches * train[name]["ms"] / 1000 / 3600
        cell = smp.get((name, PAPER_CHAINS))
        if cell is None:
            out.row(name, f"not measured at S = {PAPER_CHAINS}", f"{ensemble:.3g}", "")
            continue
        hours = PAPER_STEPS * cell["ms"] / 1000 / 3600
        out.row(name, f"{hours:.3g}", f"{ensemble:.3g}", f"{hours / ensemble:.2g}")
    out.save()


if __name__ == "__main__":
    main()
