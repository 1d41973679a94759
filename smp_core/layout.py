"""Flat parameter vectors and the layout that names their slices.

SMP runs ``S`` chains of a network with ``d`` parameters as one ``(S, d)`` tensor. A
:class:`ParamLayout` records which slice of the flat vector is which parameter of the
``torch.nn.Module`` (in ``named_parameters()`` order, the order
``torch.nn.utils.parameters_to_vector`` uses), so that block-diagonal preconditioners
(Section 3.1.1 of the paper: one block per layer weight and per layer bias) and
per-layer reporting need no knowledge of the network. Parameters with ``requires_grad=False`` are
frozen: they are not in the layout, so SMP leaves them where they are (last-layer SMP on a
pretrained network, say).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamEntry:
    """One named parameter tensor inside the flat vector: ``flat[start:stop].view(shape)``."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ParamLayout:
    """Names, shapes and offsets of every sampled parameter (``requires_grad=True``) in the flat vector."""

    entries: tuple[ParamEntry, ...]

    @classmethod
    def from_module(cls, module: nn.Module) -> ParamLayout:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        entries, offset = [], 0
        for name, param in module.named_parameters():
            if not param.requires_grad:
                continue
            n = param.numel()
            entries.append(ParamEntry(name, tuple(param.shape), offset, offset + n))
            offset += n
        if not entries:
            frozen = any(True for _ in module.parameters())
            raise ValueError("every parameter of the module has requires_grad=False: there is nothing for SMP to "
                             "sample" if frozen else "the module has no parameters: there is nothing for SMP to sample")
        return cls(tuple(entries))

    @property
    def dim(self) -> int:
        """Total number of parameters ``d``."""
        return self.entries[-1].stop

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    @property
    def block_slices(self) -> tuple[slice, ...]:
        """One slice per weight and per bias tensor, the blocks of the block-diagonal preconditioner."""
        return tuple(slice(e.start, e.stop) for e in self.entries)

    def flatten(self, module: nn.Module) -> torch.Tensor:
        """The module's current sampled parameters as one detached flat vector of length ``d``."""
        params = dict(module.named_parameters())
        return torch.cat([params[e.name].detach().reshape(-1) for e in self.entries])

    def split(self, theta: torch.Tensor) -> list[torch.Tensor]:
        """Views of a batch ``theta`` of shape ``(B, d)`` as ``(B, *shape)`` tensors, one per entry."""
        batch = theta.shape[:-1]
        return [theta[..., e.start : e.stop].reshape(*batch, *e.shape) for e in self.entries]

    def unflatten(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        """A ``{name: tensor}`` dict for ``torch.func.functional_call`` from one flat vector ``(d,)``."""
        if theta.shape != (self.dim,):
            raise ValueError(f"expected a flat parameter vector of shape ({self.dim},), got {tuple(theta.shape)}")
        return {e.name: theta[e.start : e.stop].view(e.shape) for e in self.entries}

    def load_into(self, module: nn.Module, theta: torch.Tensor) -> nn.Module:
        """Copy a flat vector ``(d,)`` into the module's sampled parameters (in place) and return the module."""
        params = self.unflatten(theta)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name in params:
                    p.copy_(params[name])
        return module


def group_indices(name: str, group, dim: int) -> torch.Tensor:
    """The flat indices (a ``long`` tensor on the CPU) of one named group of parameters: a slice, integer
    indices or a boolean mask of ``dim`` entries. Raises a ``ValueError`` naming the group for a float
    tensor (a 0/1 mask in floats would be read as the indices 0 and 1), a mask of the wrong length,
    no indices, or indices outside ``[0, dim)``."""
    idx = torch.arange(dim)[group] if isinstance(group, slice) else torch.as_tensor(group).reshape(-1).cpu()
    if idx.numel() and (idx.is_floating_point() or idx.is_complex()):  # (an empty list comes as float32)
        raise ValueError(f"group {name!r} must be integer indices, a slice or a boolean mask, got {idx.dtype}")
    if idx.dtype == torch.bool:
        if idx.numel() != dim:
            raise ValueError(f"group {name!r}: a boolean mask must have {dim} entries, got {idx.numel()}")
        idx = idx.nonzero().reshape(-1)
    idx = idx.long()
    if idx.numel() == 0 or int(idx.min()) < 0 or int(idx.max()) >= dim:
        raise ValueError(f"group {name!r} must hold indices in [0, {dim}), got {idx.numel()} of them"
                         + (f" from {int(idx.min())} to {int(idx.max())}" if idx.numel() else ""))
    return idx
