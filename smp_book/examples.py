"""The checks and bookkeeping of the chapter "Using SMP on your own model" (``notebooks/usage.md``).

That chapter is a tutorial of the :mod:`smp_core` API, so the calls a user writes (building a model,
:func:`smp_core.run_smp`, :func:`smp_core.tail.add_gaussian_tail`, :mod:`smp_core.metrics`) stay in the notebook;
what is here checks their answers or prepares them:

* :func:`least_squares_linear` and :func:`linear_gaussian_check`: a linear-Gaussian regression started at least
  squares, whose SMP has a closed-form mean and covariance at every ``K`` (and at ``K = infinity``), by z-scores;
* :func:`fit_map`: the MAP of a network under a ``N(0, I / alpha)`` prior (Adam, then L-BFGS in float64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd
import torch
from scipy.special import polygamma
from torch import nn

from smp_core.likelihoods import get_likelihood
from smp_core.models import as_chain_model
from smp_core.recursion import SMPResult

# P(|Z| >= 3) for a standard normal Z
P_BEYOND_3 = math.erfc(3 / math.sqrt(2))


def least_squares_linear(x: torch.Tensor, y: torch.Tensor) -> tuple[nn.Linear, torch.Tensor]:
    """``nn.Linear(p, 1)`` holding the least-squares fit of ``y`` on ``x`` (``(N, p)``, ``(N,)``), and the
    design ``(x, 1)`` ``(N, p + 1)`` in float64: the weights' columns, then the bias's, the order of the
    module's flattened parameters."""
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ValueError(f"x must be (N, p) and y (N,), got {tuple(x.shape)} and {tuple(y.shape)}")
    design = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1).double()
    solution = torch.linalg.lstsq(design, y.double()[:, None]).solution[:, 0]
    linear = nn.Linear(x.shape[1], 1)
    nn.utils.vector_to_parameters(solution.float(), linear.parameters())  # the weights, then the bias
    return linear, design


def chance_beyond_3(n_checks: int) -> float:
    """The probability that one or more of ``n_checks`` independent standard normals reach ``|z| >= 3``."""
    return 1 - (1 - P_BEYOND_3) ** n_checks


def verdict(worst: float, n_checks: int) -> str:
    """What the largest ``|z|`` of ``n_checks`` z-scores of a sampler against its closed form says."""
    if worst < 3:
        return "every z within 3: the recursion and the tail give the closed form's mean and covariance"
    if worst < 4:
        return (f"a z between 3 and 4: borderline (one or more such values in about one table of "
                f"{1 / chance_beyond_3(n_checks):.0f} by chance), not yet an error")
    return "a z beyond 4: the recursion, the Fisher or the tail does not give the closed form"


@dataclass
class LinearGaussianCheck:
    """The result of :func:`linear_gaussian_check`.

    ``table``: per group of draws (the chains at ``K``, the tail alone, both) and parameter, the observed and expected
    standard deviations, the z-scores of the variance and of the mean, and (at ``K = infinity``) the flat-prior
    Bayesian posterior's standard deviation. ``z``: every z-score (the means', the variances' and the covariances');
    ``worst``: the largest ``|z|``. ``share_at_k``: the share of the limiting variance that the chains at ``K`` hold;
    ``bayes_ratio``: ``N sum_{k >= 1} (N + k)^-2``, SMP's limiting variance over the Bayesian one (at ``tau = 1``);
    ``variance_se``: the relative standard error of a sample variance of the ``S`` draws, ``sqrt(2 / (S - 1))``.
    """

    table: pd.DataFrame
    z: list[float] = field(repr=False)
    worst: float
    share_at_k: float
    bayes_ratio: float
    variance_se: float

    @property
    def n_checks(self) -> int:
        return len(self.z)

    @property
    def verdict(self) -> str:
        return verdict(self.worst, self.n_checks)

    def shown(self, digits: int = 4) -> pd.DataFrame:
        """:attr:`table` rounded for display, the Bayes column left blank where it does not apply."""
        table = self.table.round(digits).astype(object)
        return table.where(table.notna(), "")

    def report(self) -> str:
        return (f"the chains at K hold {self.share_at_k:.1%} of the limiting variance; N sum_(k >= 1) (N + k)^-2 = "
                f"{self.bayes_ratio:.4f} (SMP at infinity over the Bayes variance)\n"
                f"largest |z| over the {self.n_checks} checks (means, variances and covariances): {self.worst:.2f}\n"
                f"{self.verdict}")

    def values(self) -> dict[str, float]:
        """The numbers the chapter's prose quotes (for ``myst_nb.glue``)."""
        return {"share_at_k": self.share_at_k, "bayes_ratio": self.bayes_ratio, "variance_se": self.variance_se,
                "n_checks": self.n_checks, "worst": self.worst, "p_beyond_3": P_BEYOND_3,
                "one_in": round(1 / chance_beyond_3(self.n_checks))}


def linear_gaussian_check(run: SMPResult, limit: torch.Tensor, design: torch.Tensor, noise: float,
                          start: nn.Module | torch.Tensor, tau: float | None = None) -> LinearGaussianCheck:
    """SMP of a linear-Gaussian model against its closed form.

    ``run``: :func:`smp_core.run_smp` of a linear model ``y = x^T w + b + noise * eps`` with the fixed dense
    preconditioner and the model-expected Fisher; ``limit``: ``run.theta`` plus the Gaussian tail to ``K = infinity``
    (:func:`smp_core.tail.add_gaussian_tail`); ``design``: the ``(N, d)`` rows ``(x_i, 1)`` in the order of the
    flattened parameters (named ``weight 1, ..., weight p, bias``); ``start``: the model the run started from, or its
    ``(d,)`` parameters. ``tau`` (default: the run's) is the step size of the closed form: a run with another has its
    variances off by ``(tau_run / tau)^2``.

    The scores of resampled pairs do not depend on ``theta``, so ``theta_K`` has mean ``theta_0`` and covariance
    ``tau^2 P^{-1} F P^{-1} sum_{k <= K} (N + k)^-2``, ``F = X^T X / (N sigma^2)``, ``P = F + lambda I``; the tail
    alone has mean 0 and the rest of the sum. Each variance's z-score uses the standard error of a sample variance of
    ``S`` normal draws, ``sigma_theta^2 sqrt(2 / (S - 1))``, each covariance's ``sqrt((S_ii S_jj + S_ij^2) / (S - 1))``,
    each mean's ``sigma_theta / sqrt(S)``. Diverged chains (NaN rows) are left out.
    """
    cfg = run.config
    n, dim = design.shape
    if cfg["n_obs"] != n or run.theta.shape[1] != dim or limit.shape != run.theta.shape:
        raise ValueError(f"a run of d = {run.theta.shape[1]} on N = {cfg['n_obs']} points and a tail of shape "
                         f"{tuple(limit.shape)} do not match a design of shape {tuple(design.shape)}")
    names = [f"weight {i + 1}" for i in range(dim - 1)] + ["bias"]
    design = design.double()
    fisher = design.T @ design / (n * noise**2)
    p_inv = torch.linalg.inv(fisher + cfg["ridge"] * torch.eye(dim, dtype=torch.float64))
    core = (cfg["tau"] if tau is None else tau) ** 2 * p_inv @ fisher @ p_inv
    sum_to_k = float(polygamma(1, n + 1) - polygamma(1, n + cfg["n_steps"] + 1))  # sum_{k <= K} (N + k)^-2
    sum_all = float(polygamma(1, n + 1))                                            # sum_{k >= 1} (N + k)^-2
    bayes = noise**2 * torch.diagonal(torch.linalg.inv(design.T @ design))
    theta0 = (as_chain_model(start).layout.flatten(start) if isinstance(start, nn.Module) else start).detach().double()
    kept = ~torch.isnan(limit).any(1)
    groups = ((f"SMP at K = {cfg['n_steps']}", run.theta, theta0, sum_to_k),
              ("the tail alone (K to infinity)", limit - run.theta, torch.zeros_like(theta0), sum_all - sum_to_k),
              ("SMP + tail (K = infinity)", limit, theta0, sum_all))  # the last: Bayes's sd beside it
    rows, z_all = {}, []
    upper = tuple(torch.triu_indices(dim, dim, offset=1))
    for g, (label, draws, centre, share) in enumerate(groups):
        draws = draws[kept].double()
        s = len(draws)
        sigma = core * share
        expected = sigma.diagonal()
        z_var = (draws.var(0) - expected) / (expected * math.sqrt(2 / (s - 1)))
        z_mean = (draws.mean(0) - centre) / (expected / s).sqrt()
        se_cov = ((expected[:, None] * expected[None, :] + sigma**2) / (s - 1)).sqrt()
        z_cov = ((torch.cov(draws.T) - sigma) / se_cov)[upper]
        z_all += [*z_mean.tolist(), *z_var.tolist(), *z_cov.tolist()]
        for i, name in enumerate(names):
            rows[(label, name)] = {"sd observed": draws[:, i].std().item(), "sd expected": expected[i].sqrt().item(),
                                   "z (variance)": z_var[i].item(), "z (mean)": z_mean[i].item(),
                                   "Bayes sd (flat prior)": bayes[i].sqrt().item() if g == len(groups) - 1
                                   else float("nan")}
    return LinearGaussianCheck(table=pd.DataFrame(rows).T, z=z_all, worst=max(abs(z) for z in z_all),
                               share_at_k=sum_to_k / sum_all, bayes_ratio=n * sum_all,
                               variance_se=math.sqrt(2 / (int(kept.sum()) - 1)))


def fit_map(net: nn.Module, likelihood, x: torch.Tensor, y: torch.Tensor, prior_precision: float, *,
            adam_steps: int = 0, lr: float = 1e-2, max_iter: int = 5000, tolerance_grad: float = 1e-9) -> float:
    """Fit ``net`` in place to the MAP under the prior ``N(0, I / prior_precision)``: ``adam_steps`` of Adam on the
    minus log posterior over ``N`` (in the network's dtype), then L-BFGS (strong Wolfe line search) in float64 on the
    minus log posterior ``-sum_i log f(y_i | x_i) + alpha |theta|^2 / 2``; the network is handed back in its own
    dtype. ``likelihood``: a name or a likelihood of :mod:`smp_core.likelihoods`. Returns the norm of the minus log
    posterior's gradient at the end (float64)."""
    lik = get_likelihood(likelihood)
    dtype = next(net.parameters()).dtype

    def minus_log_posterior(inputs, targets):
        return (-lik.log_prob(net(inputs), targets).sum()
                + prior_precision / 2 * sum((p**2).sum() for p in net.parameters()))

    opt = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(adam_steps):
        opt.zero_grad()
        (minus_log_posterior(x, y) / len(x)).backward()
        opt.step()
    net.double()
    x64, y64 = x.double(), y.double() if y.is_floating_point() else y
    lbfgs = torch.optim.LBFGS(net.parameters(), max_iter=max_iter, tolerance_grad=tolerance_grad,
                              tolerance_change=1e-15, line_search_fn="strong_wolfe")

    def closure():
        lbfgs.zero_grad()
        loss = minus_log_posterior(x64, y64)
        loss.backward()
        return loss

    lbfgs.step(closure)
    closure()
    gradient_norm = torch.cat([p.grad.flatten() for p in net.parameters()]).norm().item()
    lbfgs.zero_grad()
    net.to(dtype)
    return gradient_norm

