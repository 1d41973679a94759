"""Wall time of the MNIST baselines' predictive: MC dropout with and without its shortcut, and an ensemble.

Usage (from the repository root)::

    .venv/bin/python benchmarks/bench_baselines.py                 # CPU, and CUDA when present
    .venv/bin/python benchmarks/bench_baselines.py --images 10000 --passes 100
    .venv/bin/python benchmarks/bench_baselines.py --smoke        # every row at tiny sizes (seconds)

Prints a markdown table. ``smp_book.baselines.mc_dropout_logits`` on LeNet-5 with dropout (p = 0.25
before each fully connected layer, the MNIST baselines chapter's network) is timed twice on the same
weights, inputs and generator seed: as the plain ``nn.Sequential`` it is (the convolutions before the
first dropout run once per batch, then only the fully connected layers per pass) and wrapped in a
subclass of ``nn.Sequential`` that the shortcut does not split (every layer on every pass, as before
the shortcut). Both give the same samples; the table says whether they were equal. For scale, the
last row is the ensemble's predictive: one forward pass of LeNet-5 per member (``--members``, the
chapter's 5). Weights are LeNet-5's initial ones and inputs uniform noise of MNIST's shape: the time
does not depend on their values. Each time is the fastest of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import time

import torch

from smp_book.baselines import mc_dropout_logits
from smp_book.machine import cpu_model
from smp_core import lenet5

# --smoke: tiny sizes in place of the defaults (options given on the command line still apply)
SMOKE = {"images": 64, "passes": 3, "members": 2, "batch_size": 32, "repeats": 1}


class _Unsplit(torch.nn.Sequential):
    """LeNet-5's layers in a subclass of ``nn.Sequential``: mc_dropout_logits then runs every layer each pass."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _fastest(fn, device, repeats):
    best, out = float("inf"), None
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return best, out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", nargs="+", default=None, help="default: cpu, and cuda when present")
    parser.add_argument("--images", type=int, default=10_000, help="test images (MNIST's test set: 10,000)")
    parser.add_argument("--passes", type=int, default=100, help="MC dropout passes S (the chapter: 100)")
    parser.add_argument("--members", type=int, default=5, help="ensemble members (the chapter: 5)")
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="every row at tiny sizes, in seconds (times: noise)")
    args = parser.parse_args()
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
        print("Smoke run: tiny sizes, to check that the script runs end to end; the times mean nothing.\n")
    torch.set_num_threads(args.threads)
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(f"torch {torch.__version__}, {args.threads} CPU threads, {cpu_model()}, GPU: {gpu}, "
          f"{args.images} images, S = {args.passes} passes, batch {args.batch_size}\n")
    print("| device | predictive | seconds | same samples as every layer each pass |")
    print("|---|---|---|---|")
    for name in devices:
        device = torch.device(name)
        torch.manual_seed(0)
        net = lenet5(dropout=0.25).to(device)
        theta = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
        x = torch.rand(args.images, 1, 28, 28, generator=torch.Generator().manual_seed(1)).to(device)

        def dropout(module, theta=theta, x=x):
            return lambda: mc_dropout_logits(module, theta, x, args.passes, torch.Generator().manual_seed(2),
                                             batch_size=args.batch_size)

        split_seconds, split = _fastest(dropout(net), device, args.repeats)
        every_seconds, every = _fastest(dropout(_Unsplit(*net)), device, args.repeats)
        same = "yes" if torch.equal(split, every) else f"no (largest difference {(split - every).abs().max():.2e})"
        print(f"| {name} | MC dropout, convolutions once per batch (default) | {split_seconds:.2f} | {same} |")
        print(f"| {name} | MC dropout, every layer each pass | {every_seconds:.2f} | |", flush=True)
        plain = lenet5().to(device).eval()

        def ensemble(plain=plain, x=x):
            with torch.no_grad():
                return [torch.cat([plain(xb) for xb in x.split(args.batch_size)]) for _ in range(args.members)]

        seconds, _ = _fastest(ensemble, device, args.repeats)
        print(f"| {name} | ensemble of {args.members}, one pass per member | {seconds:.2f} | |", flush=True)


if __name__ == "__main__":
    main()
