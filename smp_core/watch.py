"""Watching chains step by step: where the steps of a chain come from (beyond the paper).

A run of Algorithm 1 reports only where its chains end and which were stopped for diverging
(:class:`~smp_core.recursion.SMPResult`). To see *why* a chain diverged, run the same
configuration again with the preconditioner wrapped by :func:`watch`: the wrapper changes no
number of the run (it calls the wrapped ``solve`` and ``update`` and only reads what they return),
so from the same seed the chains retrace their steps bit for bit, and it records, at the steps
asked for, per chain and per group of parameters (by default one group per layer):

* ``score_norm``: ``||s_k||`` of the group (the score of eq. 2.14);
* ``step_norm``: ``||P_k^{-1} s_k||`` of the group (the step before the factor ``tau / (N + k)``);
* ``move``: ``max |theta_k - theta_0|`` over the group after the step (the divergence check's
  measure, :func:`smp_core.recursion.advance_smp`);
* for a ``kfac`` preconditioner with a stored factorisation (``fixed``, ``periodic``, and the EMA
  with ``ema_refresh`` > 1), ``ridge_share``: the share of ``||P_k^{-1} s_k||^2`` that lies in the
  eigendirections ``u_G,i (x) u_A,j`` of ``G (x) A`` with ``lambda_G,i lambda_A,j < lambda`` (the
  ridge): there ``P^{-1}`` is between ``1 / (2 lambda)`` and ``1 / lambda``, whatever the curvature.

It also keeps, at the steps asked for (``capture_at``), the preconditioner's state just before and
just after its ``update`` (a periodic recomputation, say), moved to the CPU.

The wrapper has no element-wise rule, so the recursion takes its plain step-by-step path: for a
preconditioner that has no rule of its own (``block``, ``dense``, ``kfac``) that is the path the
original run took, and the replay is exact. For ``none`` and ``diag`` the original run may have
used the element-wise rule or step blocks, which draw or round differently: the watched run is
then a run of the same chain law, not a replay. It counts steps from the start (``init`` sets step 1): do not
resume it from a checkpoint. A chain stopped for diverging is put back at ``theta_0`` and stays there: its
rows after the check that stopped it (``SMPResult.diverged_step``) describe nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import pandas as pd
import torch

from .layout import group_indices
from .preconditioners import Preconditioner, PreconditionerState
from .recursion import _accepts_out


@dataclass
class StepWatch:
    """What :func:`watch` recorded. ``rows``: one per watched step, chain and group (see
    :meth:`table`); ``captured[k]``: ``(before, after)`` the preconditioner's update at step ``k``."""

    groups: dict[str, torch.Tensor]
    steps: frozenset[int]
    capture_at: frozenset[int]
    theta0: torch.Tensor
    step: int = 1  # the step whose score the next solve receives
    rows: list[dict] = field(default_factory=list)
    captured: dict[int, tuple[PreconditionerState, PreconditionerState]] = field(default_factory=dict)
    _pending: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def table(self) -> pd.DataFrame:
        """The records as a table: ``step``, ``chain``, ``group``, ``score_norm``, ``step_norm``,
        ``move`` and (kfac with a stored factor) ``ridge_share``."""
        return pd.DataFrame(self.rows)


def _kfac_ridge_share(precond: Preconditioner, state: PreconditionerState, v: torch.Tensor,
                      ridge: float) -> dict[int, torch.Tensor]:
    """Per kfac layer, ``(S,)`` share of ``||P^{-1} v||^2`` in the directions whose eigenvalue product
    ``lambda_G lambda_A`` is below the ridge, from the stored factor ``(U_A, U_G, 1 / (products + ridge))``."""
    shares = {}
    factor = state.factor
    for i, layer in enumerate(precond.structure.layers):
        u_a, u_g, scale = factor[3 * i], factor[3 * i + 1], factor[3 * i + 2]
        # the step in the eigenbasis (in the factor's dtype: float64 with statistic_dtype)
        coeff = (u_g.transpose(1, 2) @ layer.matrix(v.to(u_a.dtype)) @ u_a) * scale
        energy = coeff.square()
        at_ridge = scale > 1.0 / (2.0 * ridge)  # products < ridge
        total = energy.sum((1, 2))
        shares[i] = (energy * at_ridge).sum((1, 2)) / total.clamp_min(torch.finfo(total.dtype).tiny)
    return shares


def default_groups(precond: Preconditioner) -> dict[str, torch.Tensor]:
    """One group per kfac layer (``layer 1``, ``layer 2``, ...) for a ``kfac`` preconditioner, one per
    block (``block 1``, ...) for a ``block`` one, else one group ``all``."""
    structure = precond.structure
    if structure.name == "kfac":
        return {f"layer {i + 1}": layer.positions() for i, layer in enumerate(structure.layers)}
    if structure.blocks:
        return {f"block {i + 1}": torch.arange(b.start, b.stop) for i, b in enumerate(structure.blocks)}
    return {"all": torch.arange(structure.dim)}


def watch(precond: Preconditioner, theta0: torch.Tensor, steps: Iterable[int], *,
          groups: Mapping[str, torch.Tensor | slice] | None = None,
          capture_at: Iterable[int] = ()) -> tuple[Preconditioner, StepWatch]:
    """Wrap ``precond`` so that a run records its steps (see the module docstring).

    Args:
        precond: the preconditioner of the run to watch.
        theta0: ``(d,)`` or ``(S, d)`` start of the run (``move`` is measured from it).
        steps: the steps ``k`` to record (``1 <= k``).
        groups: name -> indices, a slice or a boolean mask of the parameter vector; default :func:`default_groups`.
            With the ``kfac`` default the groups are the kfac layers, which ``ridge_share`` needs.
        capture_at: steps ``k`` at which to keep the preconditioner's state before and after ``update``.

    Returns:
        The wrapped preconditioner (pass it to :func:`~smp_core.recursion.run_smp` as
        ``preconditioner``) and the :class:`StepWatch` that fills as it runs.
    """
    steps, capture_at = frozenset(int(k) for k in steps), frozenset(int(k) for k in capture_at)
    if any(k < 1 for k in steps | capture_at):
        raise ValueError("watched and captured steps must be >= 1 (step k = 1 is the first)")
    dim = precond.structure.dim
    theta0 = theta0.detach()
    if theta0.shape[-1] != dim:
        raise ValueError(f"theta0 has {theta0.shape[-1]} parameters, the preconditioner {dim}")
    if groups is None:
        groups = default_groups(precond)
    index = {}
    for name, g in groups.items():
        index[name] = group_indices(name, g, dim).to(theta0.device)
    # ridge_share needs the groups to be the kfac layers, in order
    layer_groups = default_groups(precond) if precond.structure.name == "kfac" else {}
    kfac_layers = bool(layer_groups) and list(index) == list(layer_groups) and all(
        torch.equal(index[name].cpu(), idx) for name, idx in layer_groups.items())
    record = StepWatch(index, steps, capture_at, theta0)
    inner_init, inner_solve, inner_update = precond.init, precond.solve, precond.update
    takes_out = _accepts_out(inner_solve)  # a user's solve without out= stays without it

    def init(theta0_, curvature):
        record.step = 1  # a fresh run starts at step 1 (not so a run resumed from a checkpoint)
        return inner_init(theta0_, curvature)

    def solve(state, v, out=None):
        result = inner_solve(state, v, out=out) if out is not None and takes_out else inner_solve(state, v)
        k = record.step
        if k in steps:
            pending = {name: (v[:, idx].norm(dim=1), result[:, idx].norm(dim=1)) for name, idx in index.items()}
            if kfac_layers and state.factor:
                shares = _kfac_ridge_share(precond, state, v, precond.ridge)
                pending = {name: (*pending[name], shares[i]) for i, name in enumerate(index)}
            record._pending[k] = pending
        return result

    def copy(state):
        return PreconditionerState(*(tuple(t.detach().cpu().clone() for t in part) for part in state))

    def update(state, k, theta, score, curvature):
        # copied before the update: an EMA folds the score into its statistic in place
        before = copy(state) if k in capture_at else None
        new = inner_update(state, k, theta, score, curvature)
        if before is not None:
            record.captured[k] = (before, copy(new))
        pending = record._pending.pop(k, None)
        if pending is not None:
            for name, idx in index.items():
                move = (theta[:, idx] - theta0[..., idx]).abs().amax(1).tolist()
                values = [t.tolist() for t in pending[name]]  # one transfer per tensor, not per number
                for chain in range(theta.shape[0]):
                    row = {"step": k, "chain": chain, "group": name, "score_norm": values[0][chain],
                           "step_norm": values[1][chain], "move": move[chain]}
                    if len(values) > 2:
                        row["ridge_share"] = values[2][chain]
                    record.rows.append(row)
        record.step = k + 1
        return new

    wrapped = dataclasses.replace(precond, init=init, solve=solve, update=update, elementwise=None,
                                  update_every=None)
    return wrapped, record
