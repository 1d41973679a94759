"""Replay a cached MNIST SMP run whose chains were stopped, and write what their steps looked like.

The run is read from the study's cache (it must have been run, by its chapter, with the same code and
data); :func:`smp_core.mnist_study.replay_divergences` runs it again with its preconditioner watched
(:mod:`smp_core.watch`: no number changes) up to the last check that stopped a chain, and fails if the
replay does not stop the same chains at the same checks. Written to ``--out`` (default
``results/<scale>/<study>/replay_<variant>_r<replicate>/``):

* ``stopped_chains.csv``: per stopped chain, the first step at which a layer went non-finite, its
  largest move and step norm before, against the kept chains' (:func:`~smp_core.mnist_study.stopped_chains`);
* ``trajectory.csv``: per watched step and layer, the stopped chains' score and step norms, move and
  (kfac) share of the step at the ridge, beside the median and the largest over the kept chains;
* ``factorisations.csv``: at each recomputation before a catch, for the chains stopped at the next check,
  whether their statistic and factor are finite and whether ``eigh`` fails on each Kronecker factor
  (:func:`~smp_core.mnist_study.factorisation_checks`);
* ``spectra.csv``: eigenvalue products below the ridge and zero rows of the factors, per layer, for
  those chains and as the median over the kept chains (:func:`~smp_core.mnist_study.factor_spectra`);
* ``manifest.json``.

The run is looked up under the current code's cache key (``mnist_study.run_key``): a run made
before a change of that key (``VARIANT_VERSIONS``) is not found. The committed
``results/laptop/mnist_kfac/replay_before_fix/`` therefore comes from this tool at git d07eb4b,
before the kfac factorisation's float64 retry, and is not reproduced by it at later commits.

``--save-stats FILE`` also saves the stopped chains' statistics at those recomputations (a
``torch.save`` of ``{(step, chain): (A_1, G_1, A_2, G_2, ...)}``).

Usage (from the repository root; a periodic-kfac laptop run takes about as long as the run did)::

    python tools/replay_divergences.py --study mnist_kfac --variant periodic-kfac --scale laptop
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smp_core import mnist_study as ms  # noqa: E402
from smp_core.config import get_config  # noqa: E402
from smp_core.results import cached, write_manifest  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", default="mnist_kfac", help="mnist or mnist_kfac")
    parser.add_argument("--variant", default="periodic-kfac")
    parser.add_argument("--scale", default="laptop")
    parser.add_argument("--replicate", type=int, default=0)
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--out", default=None)
    parser.add_argument("--save-stats", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    cfg = get_config(args.study, args.scale)
    variants = ms.study_variants(cfg)
    if args.variant not in variants:
        parser.error(f"the {args.study} study has no variant {args.variant!r}; it has {variants}")
    data, _ = ms.load_data(cfg, args.data_dir)
    device = ms.default_device()
    theta_map = ms.fit_map(cfg, data, device, True)["theta"]
    key = ms.run_key(cfg, args.variant, args.replicate, ms.smp_path(device))

    def not_cached():
        raise SystemExit(f"no cached {args.variant} run (replicate {args.replicate}) of the {args.study} study at "
                         f"scale {args.scale} for this code: run its chapter first")

    result = cached(cfg.get("study", "mnist"), key, not_cached)
    autopsy = ms.replay_divergences(cfg, args.variant, theta_map, data, variants.index(args.variant), result,
                                    replicate=args.replicate, device=device)
    if autopsy is None:
        print(f"no chain of the {args.variant} run was stopped: nothing to replay")
        return
    out = Path(args.out or f"results/{args.scale}/{args.study}/replay_{args.variant}_r{args.replicate}")
    out.mkdir(parents=True, exist_ok=True)
    summary = ms.stopped_chains(autopsy)
    summary.to_csv(out / "stopped_chains.csv", index=False)
    steps = autopsy["steps"]
    columns = [c for c in ("score_norm", "step_norm", "move", "ridge_share") if c in steps]
    stopped = steps[steps.diverged_step >= 0]
    kept = steps[steps.diverged_step < 0].groupby(["step", "group"])[columns]
    trajectory = pd.concat([stopped.assign(chain=stopped["chain"].astype(str))[["step", "chain", "group", *columns]],
                            kept.median().reset_index().assign(chain="kept median"),
                            kept.max().reset_index().assign(chain="kept max")], ignore_index=True)
    trajectory.sort_values(["step", "group", "chain"]).to_csv(out / "trajectory.csv", index=False)
    autopsy["factorisations"].to_csv(out / "factorisations.csv", index=False)
    spectra = autopsy["spectra"]
    if len(spectra):
        stopped_ids = set(summary["chain"])
        mine = spectra[spectra.chain.isin(stopped_ids)].assign(chain=lambda t: t["chain"].astype(str))
        others = spectra[~spectra.chain.isin(stopped_ids | {-1})]
        medians = others.groupby(["step", "when", "layer"]).median(numeric_only=True).drop(columns="chain")
        spectra = pd.concat([mine, medians.reset_index().assign(chain="kept median")], ignore_index=True)
    spectra.to_csv(out / "spectra.csv", index=False)
    if args.save_stats:
        torch.save(autopsy["stopped_stats"], args.save_stats)
    write_manifest(out, {"study": args.study, "variant": args.variant, "scale": args.scale,
                         "replicate": args.replicate, "run_key": key, "caught": autopsy["caught"]},
                   {"smp": ms.smp_seed(cfg, variants.index(args.variant), args.replicate)},
                   time.perf_counter() - started, device=str(device))
    print(summary.to_string(index=False))
    print(autopsy["factorisations"].to_string(index=False))
    print(f"written to {out}/")


if __name__ == "__main__":
    main()
