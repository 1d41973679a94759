"""One SMP run over 1, 2, ... processes (smp_core.distributed): chains per second, efficiency, memory per rank.

Usage (from the repository root, with nothing else running on the machine)::

    .venv/bin/python benchmarks/bench_scaling.py                   # LeNet-5, S = 100, K = 1000, 1 and 2 ranks
    .venv/bin/python benchmarks/bench_scaling.py --ranks 1 2 4 --steps 1000
    .venv/bin/python benchmarks/bench_scaling.py --smoke            # tiny sizes (seconds)

Each size starts ``torchrun --standalone --nproc_per_node=N`` on this machine, every rank with one
torch thread, on random MNIST-sized inputs (the step's cost does not depend on the pixels), with
``fixed-diag`` (the MNIST chapter's element-wise path: on a CPU the compiled kernel runs each chain's
step on one thread). It prints one markdown table: the slowest rank's wall time of ``run_smp_sharded``
(Fisher set-up and the gather included, process start-up not), chain-steps per second, the parallel
efficiency against one rank (speed-up / ranks), and the peak resident memory of the largest rank; each
size is run ``--repeats`` times and the fastest kept (the first run of a size can pay one-time costs:
21 s instead of 2 s was seen for one rank at K = 300).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tables import Tables  # noqa: E402

from smp_book.machine import cpu_model  # noqa: E402

SMOKE = {"chains": 8, "steps": 20, "train": 200, "ranks": [1, 2], "repeats": 1}

RANK_SCRIPT = textwrap.dedent("""
    import json, resource, sys, time
    import torch, torch.distributed as dist
    from smp_core import Fisher
    from smp_core.distributed import run_smp_sharded
    from smp_core.models import lenet5
    torch.set_num_threads(1)
    chains, steps, train, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.manual_seed(0)
    net = lenet5()
    x = torch.rand(train, 1, 28, 28)
    y = torch.randint(0, 10, (train,))
    dist.init_process_group("gloo")
    dist.barrier()
    start = time.perf_counter()
    run_smp_sharded(net, "categorical", x, n_chains=chains, n_steps=steps, preconditioner="fixed-diag", tau=0.05,
                    fisher=Fisher("empirical", x[:100], y[:100]), seed=0, progress=False)
    seconds = time.perf_counter() - start
    stats = [None] * dist.get_world_size()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    dist.all_gather_object(stats, {"seconds": seconds, "max_rss_mb": peak_mb})
    if dist.get_rank() == 0:
        open(out, "w").write(json.dumps(stats))
    dist.destroy_process_group()
""")


def run(ranks: int, chains: int, steps: int, train: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        script, out = Path(tmp) / "rank.py", Path(tmp) / "stats.json"
        script.write_text(RANK_SCRIPT)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={ranks}", str(script), str(chains), str(steps), str(train),
                               str(out)], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{ranks} rank(s) failed:\n{done.stderr[-3000:]}")
        stats = json.loads(out.read_text())
    return {"seconds": max(s["seconds"] for s in stats), "max_rss_mb": max(s["max_rss_mb"] for s in stats)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--chains", type=int, default=100)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--train", type=int, default=2000, help="training inputs the covariates are drawn from")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each size; the fastest is kept (the first can pay one-time costs)")
    parser.add_argument("--csv", type=Path, default=None, help="also save the table as DIR/scaling.csv")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check that the script runs")
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if 1 not in args.ranks:
        parser.error("--ranks: include 1, the reference of the efficiency")
    for name in ("chains", "steps", "train", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: must be at least 1, got {getattr(args, name)}")
    if min(args.ranks) < 1:
        parser.error(f"--ranks: each must be at least 1, got {args.ranks}")
    rows = {n: min((run(n, args.chains, args.steps, args.train) for _ in range(args.repeats)),
                   key=lambda row: row["seconds"]) for n in sorted(set(args.ranks))}
    base = args.chains * args.steps / rows[1]["seconds"]
    out = Tables(args.csv, machine=f"{cpu_model()}, {os.cpu_count()} logical CPUs")
    out.start("scaling", f"LeNet-5, S = {args.chains}, K = {args.steps}, fixed-diag, 1 torch thread per rank, "
              f"gloo, the fastest of {args.repeats} run(s) per size; {cpu_model()}, {os.cpu_count()} logical "
              "CPUs",
              ["ranks", "seconds", "chain-steps / s", "speed-up", "efficiency", "peak memory per rank (MB)"])
    for n, row in rows.items():
        speed = args.chains * args.steps / row["seconds"]
        out.row(n, f"{row['seconds']:.1f}", f"{speed:.0f}", f"{speed / base:.2f}", f"{speed / base / n:.2f}",
                f"{row['max_rss_mb']:.0f}")
    out.save()


if __name__ == "__main__":
    main()
