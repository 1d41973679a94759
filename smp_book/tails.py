"""What the two Gaussian-tail chapters (toy and MNIST) share: the stops, the seeds of the tails, the ratio."""

from __future__ import annotations

import hashlib

import torch

CHECK_EVERY = 50  # run_smp's default check_every: a stop elsewhere would move the divergence checks


RECURSION, TO_INFINITY = "recursion", "recursion + tail to inf"


TOLERANCE = 1.25  # the agreement criterion of :func:`agreement` (ours, set before the runs)


def tail_seed(smp_seed: int, variant: str, k_from: int) -> int:
    """The seed of one tail draw: a hash of the replicate's SMP seed, the variant and ``K0``, so that no
    two tails share random numbers (nor any other seed of the toy study, which are small integers)."""
    digest = hashlib.sha256(f"{smp_seed}/tail/{variant}/{k_from}".encode()).hexdigest()
    return int(digest[:15], 16)


def _tail_ratio(hybrid: torch.Tensor, recursion: torch.Tensor, start: torch.Tensor) -> float:
    """``sum Var(hybrid - start) / sum Var(recursion - start)`` over the columns (chains in rows)."""
    return float((hybrid - start).var(0).sum() / (recursion - start).var(0).sum())
