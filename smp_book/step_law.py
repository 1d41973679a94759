"""The law of one step of the recursion at a fixed point (beyond the paper).

A step of Algorithm 1 adds ``gamma_k u``, ``u = P^{-1} s``, ``s`` the score of one observation drawn as the recursion
draws it (eq. 2.14). While ``theta`` and ``P`` stay put, a run's variance is ``tail_variance(N, 0, K, tau)`` times the
step's covariance (:func:`predicted_variances`); :func:`top_share` shows how heavy the step's tail is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from smp_core.layout import group_indices
from smp_core.likelihoods import check_output_dim, get_likelihood
from smp_core.models import ChainModel, as_chain_model, check_deterministic
from smp_core.preconditioners import Preconditioner, PreconditionerState
from smp_core.recursion import check_training_inputs
from smp_core.tail import tail_variance


def draw_steps(model: nn.Module | ChainModel, likelihood, x_train: torch.Tensor, theta: torch.Tensor,
               preconditioner: Preconditioner, precond_state: PreconditionerState, *, n_draws: int,
               groups: Mapping[str, torch.Tensor | slice] | None = None, x_eval: torch.Tensor | None = None,
               seed: int | torch.Generator = 0, batch: int = 100, jvp_batch: int = 10,
               input_shape: tuple[int, ...] | None = None, progress: bool = False) -> pd.DataFrame:
    """``n_draws`` independent steps ``u = P^{-1} s`` at ``theta`` (``(d,)``), one row each.

    ``model``, ``likelihood``, ``x_train``, ``input_shape`` as for :func:`~smp_core.recursion.run_smp`;
    ``precond_state`` holds one ``P``; ``groups``: name -> indices, slice or boolean mask; ``batch`` scores are drawn
    together (the draws of a seed depend on it and on the device). Columns: ``row`` (the drawn covariate),
    ``log_prob`` (of the drawn response), ``score_sq`` (``||s||^2``), ``step_sq`` (``||u||^2``), with ``x_eval``
    ``output_sq`` (``mean_{x, c} (J_x u)_c^2``, by Jacobian-vector products), and each per group (``u`` cut to it).
    """
    check_deterministic(model)  # before wrapping: a training-mode batch norm fails on the probe input
    net = as_chain_model(model, input_shape)
    lik = get_likelihood(likelihood)
    dim = net.layout.dim
    if theta.shape != (dim,):
        raise ValueError(f"theta must be one flat parameter vector of shape ({dim},), got {tuple(theta.shape)}")
    if not bool(torch.isfinite(theta).all()):
        raise ValueError("theta has non-finite entries")
    for name, value in (("n_draws", n_draws), ("batch", batch), ("jvp_batch", jvp_batch)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    device, dtype = theta.device, theta.dtype
    x_train = x_train.to(device=device, dtype=dtype)
    check_training_inputs(net, x_train)
    check_output_dim(lik, getattr(net, "out_dim", None))
    masks = {f"[{name}]": torch.zeros(dim, dtype=dtype, device=device).index_fill_(
        0, group_indices(name, g, dim).to(device), 1.0) for name, g in (groups or {}).items()}
    parts = (*tuple(getattr(precond_state, "stat", ()) or ()), *tuple(getattr(precond_state, "factor", ()) or ()))
    per_chain = [tuple(t.shape) for t in parts if isinstance(t, torch.Tensor) and t.ndim > 0 and t.shape[0] != 1]
    if per_chain:
        raise ValueError(f"the preconditioner state holds one P per chain {per_chain}: pass state.of_chain(i)")
    if x_eval is not None:
        x_eval = x_eval.to(device=device, dtype=dtype)
        if x_eval.ndim < 1 or x_eval.shape[0] == 0 or x_eval[0].numel() != math.prod(net.input_shape):
            raise ValueError(f"x_eval must hold inputs of {math.prod(net.input_shape)} values each, one per row; "
                             f"got shape {tuple(x_eval.shape)}")
        if not bool(torch.isfinite(x_eval).all()):
            raise ValueError("x_eval has non-finite entries")
        x_eval = x_eval.reshape(x_eval.shape[0], *net.input_shape)

        def outputs_of(flat: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(net.module, net.layout.unflatten(flat), (x_eval,))

        def output_sq(u: torch.Tensor) -> torch.Tensor:  # mean_{x, c} (J_x u)_c^2 per row of u
            change = [torch.func.vmap(lambda v: torch.func.jvp(outputs_of, (theta,), (v,))[1])(u[i:i + jvp_batch])
                      for i in range(0, u.shape[0], jvp_batch)]
            return torch.cat([c.square().flatten(1).mean(1) for c in change]).cpu()

    gen = seed if isinstance(seed, torch.Generator) else torch.Generator(device=device).manual_seed(int(seed))
    frames, done = [], 0
    bar = tqdm(total=n_draws, disable=not progress, desc="step law", mininterval=1.0)
    while done < n_draws:
        b = min(batch, n_draws - done)
        index = torch.randint(x_train.shape[0], (b,), generator=gen, device=device)
        out, ctx = net.forward(theta[None].expand(b, dim).contiguous(), x_train.index_select(0, index))
        response = lik.sample(out, gen)
        log_prob = lik.log_prob(out, response)
        score = net.vjp(ctx, lik.residual(out, response))
        step = preconditioner.solve(precond_state, score)
        if not bool(torch.isfinite(step).all()):
            raise ValueError(f"a step u = P^{{-1}} s is not finite (draws {done} to {done + b - 1})")
        record = {"log_prob": log_prob.detach().cpu()}
        with torch.no_grad():
            for suffix, mask in (("", None), *masks.items()):  # the whole step, then cut to each group
                s, u = (score, step) if mask is None else (score * mask, step * mask)
                record[f"score_sq{suffix}"] = s.square().sum(1).cpu()
                record[f"step_sq{suffix}"] = u.square().sum(1).cpu()
                if x_eval is not None:
                    record[f"output_sq{suffix}"] = output_sq(u)
        frames.append(pd.DataFrame({"row": index.cpu().numpy(), **{k: v.double().numpy() for k, v in record.items()}}))
        done += b
        bar.update(b)
    bar.close()
    return pd.concat(frames, ignore_index=True).rename_axis("draw")


def predicted_variances(draws: pd.DataFrame, n_obs: int, n_steps: int, tau: float, dim: int,
                        group: str | None = None) -> dict[str, float]:
    """The ``params_variance`` (``v E||u||^2 / dim``) and ``logits_variance`` (``v E output_sq``) of a run of
    ``n_steps`` steps that stayed where the steps were drawn, with their standard errors (``*_se``); ``group``: that
    group's columns (``dim`` its size)."""
    if len(draws) < 2:
        raise ValueError("need at least 2 draws for a standard error")
    v = tail_variance(n_obs, 0, n_steps, tau)
    suffix = "" if group is None else f"[{group}]"
    result = {}
    for name, column, scale in (("params_variance", "step_sq", 1.0 / dim), ("logits_variance", "output_sq", 1.0)):
        if column + suffix not in draws:
            if column == "step_sq":
                raise ValueError(f"no column {column + suffix!r} in the draws")
            continue
        values = draws[column + suffix].to_numpy()
        result[name] = v * scale * float(values.mean())
        result[f"{name}_se"] = v * scale * float(values.std(ddof=1)) / math.sqrt(len(values))
    return result


def top_share(values, fraction: float) -> float:
    """The share of ``sum(values)`` held by the largest ``ceil(fraction n)`` of the ``n`` values (non-negative)."""
    values = torch.tensor(pd.Series(values).to_numpy(dtype="float64", copy=True))
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    if values.numel() == 0 or bool((values < 0).any()) or not bool(torch.isfinite(values).all()):
        raise ValueError("values must be a non-empty set of finite, non-negative numbers")
    total = float(values.sum())
    if total == 0.0:
        return float("nan")
    top = max(1, math.ceil(fraction * values.numel() - 1e-9))  # (0.07 * 100 is 7.000000000000001)
    return float(values.sort(descending=True).values[:top].sum()) / total
