"""Checkpoints of a run: written atomically, resumed only by the same run (settings, data, network)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from .models import ChainModel
from .preconditioners import PreconditionerState
from .streams import ChainStreams


def config_key(config: dict[str, Any]) -> str:
    """A short, stable hash of a JSON-serialisable config."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def tensor_sha(t: torch.Tensor | None) -> str | None:
    return None if t is None else hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def inputs_fingerprint(net: ChainModel, likelihood, fisher_x: torch.Tensor, fisher_y: torch.Tensor | None
                       ) -> dict[str, str]:
    """What a checkpoint's key leaves out, kept beside it to refuse resuming another run: the network
    (its modules' types and settings as ``repr`` shows them, so a GELU network is not a Tanh one with the
    same parameter count, and the values of its frozen parameters and buffers, which the chains do not
    hold), the likelihood's parameters (a Gaussian's ``sigma``) and the Fisher data."""
    module = getattr(net, "module", None)
    network = repr(module) + "|" + ",".join(f"{type(m).__module__}.{type(m).__qualname__}"
                                            for m in (module.modules() if module is not None else ()))
    if module is not None:
        fixed = [(n, t) for n, t in module.named_parameters() if not t.requires_grad] + list(module.named_buffers())
        network += "|" + ",".join(f"{n}:{tensor_sha(t)}" for n, t in fixed)
    lik = json.dumps({"name": likelihood.name, **{k: v for k, v in vars(likelihood).items()
                                                 if isinstance(v, int | float | str)}}, sort_keys=True)
    return {"network": hashlib.sha256(network.encode()).hexdigest(), "likelihood": lik,
            "fisher_data": f"{tensor_sha(fisher_x)}/{tensor_sha(fisher_y)}"}


def save_checkpoint(path: Path, state, settings: dict[str, Any], inputs: dict[str, str], elapsed: float) -> None:
    """Write ``state`` (an :class:`~smp_core.recursion.SMPState`) to ``path`` through a temporary file, with
    the run's ``settings`` (JSON-serialisable, their key) and ``inputs`` (``inputs_fingerprint``)."""
    payload = {
        "elapsed": elapsed, "key": config_key(settings), "settings": settings, "inputs": inputs,
        "theta": state.theta.cpu(), "theta0": state.theta0.cpu(),
        "stat": [t.cpu() for t in state.precond.stat], "factor": [t.cpu() for t in state.precond.factor],
        "step": state.step, "diverged_step": state.diverged_step.cpu(),
        "streams": tuple(state.streams), "trace": state.trace, "trace_steps": state.trace_steps,
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, settings: dict[str, Any], inputs: dict[str, str], device: torch.device
                    ) -> dict[str, Any]:
    """The fields of the :class:`~smp_core.recursion.SMPState` saved at ``path``; a ``ValueError`` naming
    what differs (and the file left as it is) when it belongs to a run with other settings or inputs."""
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if payload.get("key") != config_key(settings):
        saved = payload.get("settings", {})
        differ = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
        raise ValueError(f"the checkpoint {path} belongs to a run with other settings ({', '.join(differ)}); "
                         "delete it or choose another checkpoint path (nothing was overwritten)")
    differ = [name for name in inputs if payload["inputs"].get(name) != inputs[name]]
    if differ:
        raise ValueError(f"the checkpoint {path} belongs to a run with another {' and '.join(differ)}; delete "
                         "it or choose another checkpoint path (nothing was overwritten)")
    return dict(
        theta=payload["theta"].to(device), theta0=payload["theta0"].to(device),
        precond=PreconditionerState(tuple(t.to(device) for t in payload["stat"]),
                                    tuple(t.to(device) for t in payload["factor"])),
        step=payload["step"], diverged_step=payload["diverged_step"].to(device),
        streams=ChainStreams(*payload["streams"]), trace=payload["trace"], trace_steps=payload["trace_steps"],
        elapsed_before=payload["elapsed"],
    )
