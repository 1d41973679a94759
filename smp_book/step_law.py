"""The law of one step of the recursion at a fixed point (beyond the paper).

At parameters ``theta`` with preconditioner ``P``, step ``k`` of Algorithm 1 adds ``gamma_k u`` with

    u = P^{-1} s,   s = grad_theta log f_theta(Y | X),   X ~ the training inputs, Y ~ f_theta(. | X),

the score of one observation drawn as the recursion draws it (eq. 2.14). :func:`draw_steps` draws
``n_draws`` such steps and records, for each, the squared norms ``||s||^2`` and ``||u||^2`` and, on
evaluation inputs ``x_eval``, the squared change of the linearised network's outputs,
``mean_{x, c} (J_x u)_c^2`` (a Jacobian-vector product per draw, so no ``d x d`` or Jacobian matrix is
formed). Each also per group of parameters (a layer, say), with ``u`` cut to the group.

Their means are traces of the step's covariance ``P^{-1} F P^{-1}`` (``F``, the model-expected Fisher
over the empirical design, is the covariance of ``s``):

    E ||u||^2 = tr(P^{-1} F P^{-1}),   E mean_{x, c} (J_x u)_c^2 = mean_x tr(J_x P^{-1} F P^{-1} J_x^T) / C.

While ``theta`` and ``P`` stay where they are (a fixed preconditioner, chains that stay near their
start), ``theta_K - theta_0 = sum_k gamma_k u_k`` is a sum of uncorrelated steps with covariance
``v P^{-1} F P^{-1}``, ``v = tail_variance(N, 0, K, tau)`` (see :mod:`smp_core.tail`), so
:func:`predicted_variances` gives the expected ``params_variance`` (the mean over coordinates) and
``logits_variance`` (the mean over test points and outputs) of a run of ``K`` steps, the two columns
of the paper's variance tables. The per-draw table shows what those means hide: how heavy the tail
of the step's law is (:func:`top_share`). A law whose mean rests on a few rare, large steps makes
runs whose variance rests on the few chains that drew one.
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


def _group_masks(groups: Mapping[str, torch.Tensor | slice] | None, dim: int,
                 device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    masks = {}
    for name, g in (groups or {}).items():
        idx = group_indices(name, g, dim)
        mask = torch.zeros(dim, dtype=dtype, device=device)
        mask[idx.to(device)] = 1.0
        masks[name] = mask
    return masks


def draw_steps(
    model: nn.Module | ChainModel,
    likelihood,
    x_train: torch.Tensor,
    theta: torch.Tensor,
    preconditioner: Preconditioner,
    precond_state: PreconditionerState,
    *,
    n_draws: int,
    groups: Mapping[str, torch.Tensor | slice] | None = None,
    x_eval: torch.Tensor | None = None,
    seed: int | torch.Generator = 0,
    batch: int = 100,
    jvp_batch: int = 10,
    input_shape: tuple[int, ...] | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """``n_draws`` independent steps ``u = P^{-1} s`` at ``theta`` (module docstring), one row each.

    Args:
        model, likelihood, x_train: as for :func:`~smp_core.recursion.run_smp` (the covariate is drawn from
            ``x_train``, the response from the model at ``theta``).
        theta: ``(d,)``, the point the steps start from.
        preconditioner, precond_state: ``P``; its ``solve`` is applied to each score (a state for
            one chain, or one shared by all, as the fixed strategies build it at a common start).
        n_draws: the number of steps drawn.
        groups: name -> indices, a slice or a boolean mask of the parameter vector; each group gets
            its own columns (groups may overlap).
        x_eval: inputs on which to measure the output change ``J_x u`` (e.g. test images); ``None``
            skips it.
        seed: an int or a ``torch.Generator`` on ``theta``'s device.
        batch: scores computed together (it sets the order of the random numbers, so the draws of
            a seed depend on it, and on the device); jvp_batch: steps whose output change is
            computed together.
        input_shape: as for :func:`~smp_core.recursion.run_smp` (the shape of one input of a CNN, say).
        progress: show a tqdm bar.

    The output change calls the module as it is: a module with dropout must be in ``eval()`` mode.

    Returns:
        A table with one row per draw and the columns ``row`` (the index of the drawn covariate in
        ``x_train``), ``log_prob`` (``log f_theta(Y | X)`` of the drawn response: very negative for a
        surprising one), ``score_sq``
        (``||s||^2``), ``step_sq`` (``||u||^2``), with ``x_eval`` ``output_sq``
        (``mean_{x, c} (J_x u)_c^2``), and per group ``score_sq[<group>]``, ``step_sq[<group>]`` and
        ``output_sq[<group>]`` (``u`` set to zero outside the group).
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
    check_output_dim(lik, getattr(net, "out_dim", None))  # (determinism was checked before wrapping)
    masks = _group_masks(groups, dim, device, dtype)
    parts = (*tuple(getattr(precond_state, "stat", ()) or ()), *tuple(getattr(precond_state, "factor", ()) or ()))
    per_chain = [tuple(t.shape) for t in parts if isinstance(t, torch.Tensor) and t.ndim > 0 and t.shape[0] != 1]
    if per_chain:
        raise ValueError(f"the preconditioner state holds one P per chain (leading sizes {per_chain}): pass one "
                         "chain's state (state.of_chain(i)) or a state shared by all chains, as the "
                         "fixed strategies build it at a common start")
    outputs = None
    if x_eval is not None:
        x_eval = x_eval.to(device=device, dtype=dtype)
        if x_eval.ndim < 1 or x_eval.shape[0] == 0 or x_eval[0].numel() != math.prod(net.input_shape):
            raise ValueError(f"x_eval must hold inputs of {math.prod(net.input_shape)} values each, one per "
                             f"row; got shape {tuple(x_eval.shape)}")
        if not bool(torch.isfinite(x_eval).all()):
            raise ValueError("x_eval has non-finite entries")
        x_eval = x_eval.reshape(x_eval.shape[0], *net.input_shape)
        module, layout = net.module, net.layout

        def outputs_of(flat: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(module, layout.unflatten(flat), (x_eval,))

        def output_change(directions: torch.Tensor) -> torch.Tensor:
            """``mean_{x, c} (J_x u)_c^2`` for each row ``u`` of ``directions``."""
            change = torch.func.vmap(lambda u: torch.func.jvp(outputs_of, (theta,), (u,))[1])(directions)
            return change.square().flatten(1).mean(1)

        outputs = output_change
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator(device=device).manual_seed(int(seed))
    rows: list[pd.DataFrame] = []
    done = 0
    bar = tqdm(total=n_draws, disable=not progress, desc="step law", mininterval=1.0)
    while done < n_draws:
        b = min(batch, n_draws - done)
        index = torch.randint(x_train.shape[0], (b,), generator=gen, device=device)
        start = theta[None].expand(b, dim).contiguous()
        out, ctx = net.forward(start, x_train.index_select(0, index))
        response = lik.sample(out, gen)
        log_prob = lik.log_prob(out, response)
        score = net.vjp(ctx, lik.residual(out, response))
        step = preconditioner.solve(precond_state, score)
        if step.shape != (b, dim):
            raise ValueError(f"the preconditioner's solve returned shape {tuple(step.shape)} for {b} scores")
        if not bool(torch.isfinite(step).all()):
            raise ValueError(f"a step u = P^{{-1}} s is not finite (draws {done} to {done + b - 1}): the "
                             "preconditioner's state cannot be solved at theta")
        record = {"row": index.cpu(), "log_prob": log_prob.detach().cpu(), "score_sq": score.square().sum(1).cpu(),
                  "step_sq": step.square().sum(1).cpu()}
        with torch.no_grad():
            if outputs is not None:
                record["output_sq"] = torch.cat([outputs(step[i:i + jvp_batch]) for i in range(0, b, jvp_batch)]).cpu()
            for name, mask in masks.items():
                cut = step * mask
                record[f"score_sq[{name}]"] = (score * mask).square().sum(1).cpu()
                record[f"step_sq[{name}]"] = cut.square().sum(1).cpu()
                if outputs is not None:
                    record[f"output_sq[{name}]"] = torch.cat(
                        [outputs(cut[i:i + jvp_batch]) for i in range(0, b, jvp_batch)]).cpu()
        frame = pd.DataFrame({k: v.numpy() if k == "row" else v.double().numpy() for k, v in record.items()})
        rows.append(frame)
        done += b
        bar.update(b)
    bar.close()
    table = pd.concat(rows, ignore_index=True)
    table.index.name = "draw"
    return table


def predicted_variances(draws: pd.DataFrame, n_obs: int, n_steps: int, tau: float, dim: int,
                        group: str | None = None) -> dict[str, float]:
    """What a run of ``n_steps`` steps from the drawn point would show, if ``theta`` and ``P`` stayed put.

    ``params_variance = v E||u||^2 / d`` (the mean over coordinates of the chains' variance) and
    ``logits_variance = v E mean_{x, c} (J_x u)_c^2`` (the mean over evaluation points and outputs),
    ``v = tail_variance(n_obs, 0, n_steps, tau)``, each with its Monte Carlo standard error
    (``*_se``: ``v`` times the standard deviation of the draws over ``sqrt(n_draws)``). ``group``: the
    columns of one group of :func:`draw_steps` (``dim`` is then the group's size).
    """
    if len(draws) < 2:
        raise ValueError("need at least 2 draws for a standard error")
    v = tail_variance(n_obs, 0, n_steps, tau)
    suffix = "" if group is None else f"[{group}]"
    result = {}
    for name, column, scale in (("params_variance", "step_sq", 1.0 / dim), ("logits_variance", "output_sq", 1.0)):
        key = column + suffix
        if key not in draws:
            if column == "step_sq":
                raise ValueError(f"no column {key!r} in the draws")
            continue
        values = draws[key].to_numpy()
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
