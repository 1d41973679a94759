"""What the regression scores cost: the CRPS's second term by its two routes, and the quantiles.

Usage (from the repository root)::

    .venv/bin/python benchmarks/bench_metrics.py                 # S in {200, 1000, 2000}, N = 200 points
    .venv/bin/python benchmarks/bench_metrics.py --points 50 --samples 100 400
    .venv/bin/python benchmarks/bench_metrics.py --smoke           # every table at tiny sizes (seconds)

Prints markdown tables, fastest of ``--repeats`` calls, on the CPU in float64 (as the metrics compute):

* ``crps``: :func:`smp_core.metrics.crps` as it is (each point on the cheaper exact route: the trapezoid
  rule on ``2 int F (1 - F)`` where the components span little against ``S sigma``, the pairwise sum
  otherwise) against the pairwise sum for every point (``_crps_kernel`` over all ``S^2`` pairs, the
  route of every point before the trapezoid rule was added), for a narrow mixture (component means with
  standard deviation ``sigma / 2``, the posterior of a well-determined regression) and a wide one
  (``50 sigma``, an over-dispersed SMP run), and the largest relative difference of the two;
* ``predictive_quantile``: seconds and the number of Newton iterations (the largest over points is what
  the loop runs), for the same mixtures.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from smp_book.machine import cpu_model  # noqa: E402
from smp_core import metrics  # noqa: E402

# --smoke: tiny sizes in place of the defaults (options given on the command line still apply)
SMOKE = {"samples": [20], "points": 10, "repeats": 1}


def fastest(call, repeats):
    best, value = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        value = call()
        best = min(best, time.perf_counter() - start)
    return best, value


def pairwise_crps(means, y, sigma):
    """The CRPS with the pairwise sum for every point, in chunks of points as the metric computed it before."""
    mu = means[..., 0].double()
    s, n = mu.shape
    to_target = metrics._crps_kernel(y.double()[None] - mu, sigma).mean(dim=0)
    spread = torch.empty(n, dtype=torch.float64)
    step = max(1, metrics._CRPS_PAIR_CHUNK // (s * s))
    for start in range(0, n, step):
        block = mu[:, start:start + step]
        spread[start:start + step] = metrics._crps_kernel(block[:, None] - block[None], math.sqrt(2) * sigma).mean(
            dim=(0, 1))
    return to_target - 0.5 * spread


def newton_iterations(means, sigma, q):
    """Iterations of predictive_quantile's loop (counted by wrapping the density it evaluates once per iteration)."""
    count, density = [0], metrics._normal_pdf

    def counting(z):
        count[0] += 1
        return density(z)

    metrics._normal_pdf = counting
    try:
        metrics.predictive_quantile(means, sigma, q)
    finally:
        metrics._normal_pdf = density
    return count[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[200, 1000, 2000])
    parser.add_argument("--points", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="every table at tiny sizes, in seconds (times: noise)")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
        print("Smoke run: tiny sizes, to check that the script runs end to end; the times mean nothing.\n")
    sigma = 0.1
    print(f"CPU: {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"N = {args.points} points, sigma = {sigma}, fastest of {args.repeats}\n")
    print("| S | mixture | crps (s) | pairwise for every point (s) | speed-up | largest relative difference |"
          " quantile (s) | Newton iterations |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    gen = torch.Generator().manual_seed(0)
    for s in args.samples:
        for label, spread in (("narrow (sd sigma/2)", sigma / 2), ("wide (sd 50 sigma)", 50 * sigma)):
            means = spread * torch.randn(s, args.points, 1, dtype=torch.float64, generator=gen)
            y = torch.randn(args.points, dtype=torch.float64, generator=gen) * max(spread, sigma)
            routed_s, routed = fastest(lambda means=means, y=y: metrics.crps(means, y, sigma, per_point=True),
                                       args.repeats)
            pair_s, pair = fastest(lambda means=means, y=y: pairwise_crps(means, y, sigma), args.repeats)
            difference = float(((routed - pair).abs() / pair.abs()).max())
            quantile_s, _ = fastest(lambda means=means: metrics.predictive_quantile(means, sigma, 0.05), args.repeats)
            iterations = newton_iterations(means, sigma, 0.05)
            print(f"| {s} | {label} | {routed_s:.3f} | {pair_s:.3f} | {pair_s / routed_s:.1f} | {difference:.1e} | "
                  f"{quantile_s:.3f} | {iterations} |")


if __name__ == "__main__":
    main()
