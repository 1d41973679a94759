"""One SMP run split over processes: each rank runs its share of the chains, rank 0 gathers them.

SMP's chains are independent and chain ``i`` draws from its own random stream of ``(seed, i)``
(:mod:`smp_core.streams`), so ``S`` chains split over ``W`` processes give the samples of one
process running all ``S``: bit for bit or to rounding, as :mod:`smp_core.streams` lists (bit for
bit for ``none`` and ``diag`` on the ``nn.Sequential`` networks that ``smp_core`` batches by hand).
Start it with ``torchrun`` (one machine or several, with its
rendezvous)::

    torchrun --nproc_per_node=2 my_run.py          # my_run.py calls run_smp_sharded(...)

Each rank needs ``torch.distributed`` initialised: :func:`run_smp_sharded` does it from torchrun's
environment when it is not (``gloo`` on a CPU, ``nccl`` when CUDA is available). On a GPU machine each
rank should run on its own device (``torch.cuda.set_device(local_rank)``, the model and data there).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .preconditioners import PreconditionerState
from .recursion import RunOptions, SMPResult, _as_count, run_smp


def shard(n_chains: int, world_size: int, rank: int) -> tuple[int, int]:
    """The chains ``[lo, hi)`` of rank ``rank`` when ``n_chains`` chains are split over ``world_size``
    ranks as evenly as possible (the first ``n_chains % world_size`` ranks take one more)."""
    n_chains = _as_count("n_chains (S)", n_chains, 1)
    world_size = _as_count("world_size", world_size, 1)
    if world_size > n_chains:
        raise ValueError(f"world_size: {world_size} processes for {n_chains} chains leave some without a chain")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    base, extra = divmod(n_chains, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def _init_from_environment() -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("torch.distributed is not initialised and RANK / WORLD_SIZE are not set: start the "
                           "script with torchrun, or call torch.distributed.init_process_group first")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def _merge_state(states: list[PreconditionerState], sizes: list[int]) -> PreconditionerState:
    """The ranks' preconditioner states as one: a tensor with one row per chain is concatenated; one shared by
    the chains (leading size 1 and the same on every rank up to rounding, as a fixed preconditioner's,
    which each rank computes) is kept once, rank 0's."""

    def merge(parts: list[tuple]) -> tuple:
        out = []
        for pieces in zip(*parts, strict=True):
            first = pieces[0]
            if not isinstance(first, torch.Tensor) or first.ndim == 0:
                out.append(first)
            elif all(p.shape[0] == 1 for p in pieces) and all(torch.allclose(first, p) for p in pieces[1:]):
                out.append(first)
            elif all(p.shape[0] == n for p, n in zip(pieces, sizes, strict=True)):
                out.append(torch.cat(pieces))
            else:
                raise ValueError("the ranks' preconditioner states neither share a tensor nor hold one row per chain")
        return tuple(out)

    return PreconditionerState(merge([s.stat for s in states]), merge([s.factor for s in states]))


def _to_cpu(result: SMPResult) -> SMPResult:
    def cpu(t):
        return t.cpu() if isinstance(t, torch.Tensor) else t

    state = PreconditionerState(tuple(cpu(t) for t in result.precond_state.stat),
                                tuple(cpu(t) for t in result.precond_state.factor))
    return dataclasses.replace(result, theta=result.theta.cpu(), diverged=result.diverged.cpu(),
                               diverged_step=result.diverged_step.cpu(), trace=cpu(result.trace),
                               precond_state=state)


def gather_results(parts: list[SMPResult], first_chain: int = 0) -> SMPResult:
    """The results of consecutive shards of one run (chain order) as the result of the whole run: chains
    concatenated, the wall time of the slowest shard, the config of the whole run."""
    if not parts:
        raise ValueError("parts: no results to gather")
    sizes = [p.diverged.numel() for p in parts]
    first = parts[0]
    trace = None if first.trace is None else torch.cat([p.trace for p in parts], dim=1)
    config = {**first.config, "n_chains": sum(sizes), "first_chain": first_chain, "ranks": len(parts),
              "elapsed_per_rank": [p.elapsed for p in parts]}
    return dataclasses.replace(
        first, theta=torch.cat([p.theta for p in parts]), diverged=torch.cat([p.diverged for p in parts]),
        diverged_step=torch.cat([p.diverged_step for p in parts]), trace=trace,
        elapsed=max(p.elapsed for p in parts), config=config,
        precond_state=_merge_state([p.precond_state for p in parts], sizes))


def run_smp_sharded(model, likelihood, x_train, theta0: torch.Tensor | None = None, *, n_chains: int = 100,
                    options: RunOptions | dict | None = None, gather: bool = True,
                    **kwargs: Any) -> SMPResult | None:
    """:func:`~smp_core.recursion.run_smp` with its ``n_chains`` chains split over the ranks of
    ``torch.distributed`` (every rank calls it with the same arguments).

    Rank ``r`` runs the chains :func:`shard` gives it, as chains ``first_chain + lo, ...`` of the same
    seed, so that together they are the single-process run. A checkpoint path in ``options`` becomes one
    file per rank (``<path>.rank<r>-of-<W>``), each resumed by its own rank. With ``gather=True`` rank 0
    returns the whole run's :class:`~smp_core.recursion.SMPResult` (on the CPU) and the other ranks
    ``None``; with ``gather=False`` each rank returns its own shard's result. Other keyword arguments go
    to ``run_smp``; ``progress`` is shown on rank 0 only. One difference from a single process: a rank
    whose chains all diverge raises :class:`~smp_core.recursion.DivergenceError` (and torchrun stops
    the job) where one process would go on with the other ranks' chains.
    """
    _init_from_environment()
    rank, world = dist.get_rank(), dist.get_world_size()
    lo, hi = shard(n_chains, world, rank)
    if options is None:
        options = RunOptions()
    elif isinstance(options, dict):
        options = RunOptions(**options)
    if not isinstance(options, RunOptions):
        raise TypeError(f"options must be a smp_core.RunOptions or a dict, got {type(options).__name__}")
    checkpoint = options.checkpoint
    if checkpoint is not None:
        checkpoint = Path(checkpoint).with_name(f"{Path(checkpoint).name}.rank{rank}-of-{world}")
    first_chain = _as_count("first_chain", options.first_chain, 0)
    mine = dataclasses.replace(options, first_chain=first_chain + lo, checkpoint=checkpoint)
    kwargs["progress"] = bool(kwargs.get("progress", True)) and rank == 0
    result = run_smp(model, likelihood, x_train, theta0, n_chains=hi - lo, options=mine, **kwargs)
    if not gather:
        return result
    parts = [None] * world if rank == 0 else None
    dist.gather_object(_to_cpu(result), parts, dst=0)
    return gather_results(parts, first_chain) if rank == 0 else None
