"""More SMP streams at the paper's scale: the MNIST chapter's run again with other chains of the same seed.

Stream ``j`` is chains ``100 j`` to ``100 j + 99`` of the committed run's seeds and settings (stream 0), from one
refit of its MAP's seed saved as ``results/paper/mnist_streams/map.pt`` (the MNIST chapter says why). A run
checkpoints under ``--work`` and resumes; once done it writes ``results/paper/mnist_streams/<variant>/stream_<j>/``.

    python -m smp_book.paper_streams --variant fixed-diag --stream 1 --threads 1
    python -m smp_book.paper_streams --map-scores  # the saved MAP's own row, once
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import pandas as pd
import torch

from . import mnist_runs
from .config import MNIST_VARIANTS
from .machine import environment, git_revision
from .pipeline import RESULTS, stale_reason, study_config
from .results import Results

WORK = Path(os.environ.get("SMP_BOOK_WORK", Path.home() / ".cache" / "smp-book" / "paper_streams"))
CPU = torch.device("cpu")


def run_stream(variant: str, stream: int, work: Path = WORK, root: Path = RESULTS,
               progress: bool = True, checkpoint_every: int = 10_000) -> Path:
    """Stream ``stream`` (chains ``100 stream`` onwards) of ``variant`` at the paper scale; returns its folder."""
    if stream < 1 or checkpoint_every < 1:
        raise ValueError(f"stream ({stream}) and checkpoint_every ({checkpoint_every}) must be positive (stream 0 is "
                         "the committed run)")
    cfg, committed, streams = study_config("mnist", "paper"), root / "paper" / "mnist", root / "paper" / "mnist_streams"
    if (why := stale_reason(committed, cfg)) is not None:
        raise ValueError(f"the committed paper-scale run cannot be extended: {why}")
    out = streams / variant / f"stream_{stream}"
    if (out / "manifest.json").exists():
        print(f"{out} is there already")
        return out
    load_start, started = os.getloadavg(), time.perf_counter()
    manifest = json.loads((committed / "manifest.json").read_text())
    map_seed, seed = manifest["seeds"]["map"], manifest["seeds"]["smp"]["replicate_0"][variant]
    index = mnist_runs.study_variants(cfg).index(variant)
    if (chapter_seed := mnist_runs.smp_seed(cfg, index)) != seed:
        raise ValueError(f"the committed run's seed of {variant} is {seed}, not the chapter's {chapter_seed}")
    data, _ = mnist_runs.load_data(cfg)
    if (saved := streams / "map.pt").exists():
        fit = torch.load(saved, weights_only=False)
    else:  # refit with the committed run's torch threads
        threads, map_threads = torch.get_num_threads(), manifest["environment"]["torch_threads"]
        torch.set_num_threads(map_threads)
        try:
            fit = mnist_runs.fit_map({**cfg, "seed": map_seed}, data, CPU, progress=progress,
                                      cache_root=str(work / f"map-threads-{map_threads}"))
        finally:
            torch.set_num_threads(threads)
        fit = {"theta": fit["theta"], "history": fit["history"], "seed": map_seed, "threads": map_threads,
               "environment": environment()}
        saved.parent.mkdir(parents=True, exist_ok=True)
        torch.save(fit, saved)
    theirs, ours = (h["val_loss"].iloc[-1] for h in (Results(committed).table("map_history"), fit["history"]))
    work.mkdir(parents=True, exist_ok=True)
    cfg = {**cfg, "checkpoint_every": checkpoint_every}  # where to resume from; the draws do not depend on it
    first, name = cfg["n_chains"] * stream, f"SMP-{variant}"
    res = mnist_runs.run_variant(cfg, variant, fit["theta"], data, index, CPU, progress=progress,
                                 checkpoint=work / f"{variant}-stream{stream}.checkpoint.pt", first_chain=first)
    tables = mnist_runs.tables({name: mnist_runs.evaluate(res.theta[~res.diverged], data, device=CPU)},
                               {name: res.elapsed})
    save(out, tables, {
        "git": git_revision(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {**cfg, "variant": variant},  # its tau: config["tau"][variant]
        "seeds": {"map": map_seed, "smp": seed, "chains": [first, first + cfg["n_chains"] - 1]},
        "map": {"seed": map_seed, "val_loss": float(ours), "committed_val_loss": float(theirs),
                "same_as_committed": bool(abs(theirs - ours) <= 1e-6), "file": str(saved.relative_to(root))},
        "diverged_chains": int(res.n_diverged), "wall_time_s": round(time.perf_counter() - started, 1),
        "load_average": {"start": load_start[0], "end": os.getloadavg()[0]},
        "timing_note": "the wall time of the last invocation only (a run resumes from its checkpoints): not for "
                       "comparisons",
        "environment": environment(),
    })
    print(f"wrote {out}")
    return out


def save(out: Path, tables: dict[str, pd.DataFrame], record: dict) -> None:
    """A stream's folder: its tables as CSV and a manifest of ``record`` with the tables' layouts (for
    :class:`smp_book.results.Results`)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, df in tables.items():
        df.to_csv(out / f"{name}.csv")
    layouts = {name: {"index": df.index.nlevels, "header": df.columns.nlevels} for name, df in tables.items()}
    (out / "manifest.json").write_text(json.dumps({"tables": layouts, **record}, indent=2, default=str))


def map_scores(root: Path = RESULTS) -> Path:
    """The test scores of the streams' saved MAP, ``mnist_streams/map_scores.csv``: the MAP row of every stream
    beyond the first."""
    if not (saved := root / "paper" / "mnist_streams" / "map.pt").exists():
        raise FileNotFoundError(f"{saved}: no saved MAP yet (the first stream run saves it)")
    data, _ = mnist_runs.load_data(study_config("mnist", "paper"))
    theta = torch.load(saved, weights_only=False)["theta"]
    tables = mnist_runs.tables({"MAP": mnist_runs.evaluate(theta[None], data, device=CPU)}, {"MAP": 0.0})
    out = saved.with_name("map_scores.csv")
    tables["scores"].to_csv(out)
    print(f"wrote {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=MNIST_VARIANTS)
    parser.add_argument("--stream", type=int, help="chains 100 STREAM to 100 STREAM + 99")
    parser.add_argument("--map-scores", action="store_true", help="only score the saved MAP on the test set")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--work", type=Path, default=WORK, help="checkpoints and the MAP cache")
    parser.add_argument("--checkpoint-every", type=int, default=10_000, help="steps between checkpoints")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.map_scores:
        map_scores()
    elif args.variant is None or args.stream is None:
        parser.error("--variant and --stream are needed (or --map-scores)")
    else:
        run_stream(args.variant, args.stream, args.work, checkpoint_every=args.checkpoint_every)


if __name__ == "__main__":
    main()
