"""Random streams per chain: chain ``i``'s draws depend only on the seed and ``i``.

Every random number of a run is a hash of ``(seed, chain, purpose, step, slot)`` (a counter-based
generator: SplitMix64's finaliser, four rounds), computed with int64 tensor arithmetic on the chains'
device. So chain ``i`` follows the same trajectory whether it runs among 10 chains or 10,000, in one
batch or split over processes, step by step or in blocks of steps, and after a resume from a
checkpoint: nothing but the step counter is state.

Which runs of chain ranges concatenate bit for bit, within one execution path (the list that
``tests/core/test_streams.py`` checks, and that any faster path must keep):

- bit for bit: ``none`` and the three ``diag`` preconditioners (fixed, EMA, periodic), in float64 (the
  dtype the test runs), on an ``nn.Sequential`` of ``Linear``, ``Conv2d``, ``ReLU`` / ``GELU`` / ``Tanh`` /
  ``Sigmoid`` / ``Identity``, ``MaxPool2d`` and ``Flatten`` layers, which ``smp_core`` batches by hand or runs
  compiled, so that each chain's arithmetic is its own;
- to rounding: every other module (on the general autograd path some kernels round by the batch's
  size: with ``LayerNorm`` and ``GELU`` the chains differed by 4e-16 relative after 25 steps), and the
  ``block``, ``dense`` and ``kfac`` preconditioners, whose shared statistic and batched linear algebra
  round by the batch's size (MKL picks its kernels by it): measured at most 3e-15 relative after 25
  float64 steps, and tested below 1e-12.

Across paths (step by step, blocks, the compiled step) the numbers drawn are the same and the
trajectories agree to rounding.

A purpose separates the uses of one step (the covariate's index, the response's noise, the Gaussian
tail's draws), so no two uses share a number.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # SplitMix64's constants, as signed int64
_C1 = 0xBF58476D1CE4E5B9 - 2**64
_C2 = 0x94D049BB133111EB - 2**64
_SEED_SALT = 0x2545F4914F6CDD1D  # sets a seed's key apart from any chain's index

COVARIATE, RESPONSE, TAIL_COVARIATE, TAIL_RESPONSE, TAIL_WEIGHT = range(5)
MAX_SEED = 2**63 - 1


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's step on int64 tensors: add the golden gamma, then its finaliser (wrapping
    arithmetic, as uint64 would)."""
    z = z + _GOLDEN
    z = (z ^ _srl(z, 30)) * _C1
    z = (z ^ _srl(z, 27)) * _C2
    return z ^ _srl(z, 31)


def check_seed(seed) -> int:
    """``seed`` as an ``int`` in ``[0, 2**63)``: Python and numpy integers (and 0-d integer tensors) are
    taken; bools, floats and ``torch.Generator`` objects are refused, with a ``ValueError`` that names it."""
    if isinstance(seed, torch.Tensor) and seed.ndim == 0 and not seed.is_floating_point() \
            and seed.dtype != torch.bool:
        seed = int(seed)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be an integer (chain i's random stream is a function of the seed and i), "
                         f"got {seed!r} of type {type(seed).__name__}")
    seed = int(seed)
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return seed


class ChainStreams(NamedTuple):
    """The random streams of chains ``first_chain, ..., first_chain + n_chains - 1`` under ``seed``."""

    seed: int
    first_chain: int
    n_chains: int

    def bits(self, purpose: int, first_step: int, n: int, width: int, device) -> torch.Tensor:
        """``(n, S, width)`` int64 hashes for steps ``first_step, ..., first_step + n - 1``."""
        key = mix64(mix64(torch.tensor(self.seed, dtype=torch.long, device=device)) ^ _SEED_SALT)
        chains = torch.arange(self.first_chain, self.first_chain + self.n_chains, device=device)
        z = mix64(key + chains)[None, :, None]  # the seed's key offset by the chain: no (seed, chain) symmetry
        z = mix64(z + (purpose << 40) + torch.arange(first_step, first_step + n, device=device)[:, None, None])
        return mix64(z + torch.arange(width, device=device))

    def covariates(self, first_step: int, n: int, n_data: int, device, purpose: int = COVARIATE) -> torch.Tensor:
        """``(n, S)`` indices uniform on ``0, ..., n_data - 1`` (bias below ``n_data / 2**63``)."""
        return torch.remainder(_srl(self.bits(purpose, first_step, n, 1, device)[..., 0], 1), n_data)

    def uniforms(self, purpose: int, first_step: int, n: int, width: int, device) -> torch.Tensor:
        """``(n, S, width)`` float64 uniforms on ``(0, 1)``: ``(j + 1/2) 2^-52`` for 52 random bits ``j``."""
        j = _srl(self.bits(purpose, first_step, n, width, device), 12)
        return (j.to(torch.float64) + 0.5) * 2.0**-52

    def normals(self, purpose: int, first_step: int, n: int, width: int, device) -> torch.Tensor:
        """``(n, S, width)`` float64 standard normals, ``sqrt(2) erfinv(2u - 1)`` of :meth:`uniforms`
        (``2u - 1`` is exact; ``torch.special.ndtri`` would round by the position in the batch)."""
        return torch.erfinv(2 * self.uniforms(purpose, first_step, n, width, device) - 1).mul_(math.sqrt(2))

    def response_noise(self, likelihood, first_step: int, n: int, out_dim: int, device, dtype,
                       purpose: int = RESPONSE) -> torch.Tensor:
        """The noise ``likelihood.sample_from_noise`` turns into responses, ``(n, S, ...)`` in ``dtype``."""
        u = self.uniforms(purpose, first_step, n, likelihood.noise_width(out_dim), device)
        return likelihood.noise_from_uniforms(u, dtype)


def has_noise(likelihood) -> bool:
    """Whether ``likelihood`` draws its responses from per-chain noise (every built-in one does)."""
    return all(hasattr(likelihood, name) for name in ("noise_width", "noise_from_uniforms", "sample_from_noise"))
