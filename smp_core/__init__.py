"""smp_core: score-based martingale posteriors (SMP) for neural networks in PyTorch.

The reference implementation of *Score-Based Martingale Posteriors for Deep Neural Networks*
(Zhumekenov, Jasra, Maama, Tempone). Start with :func:`run_smp`, or drive :class:`SMP` step by step.
"""

from . import fused, metrics, preconditioners  # noqa: F401 - importing fused registers its compiled kernel
from .fisher import estimate_fisher, fisher_vectors
from .layout import ParamLayout
from .likelihoods import Bernoulli, Categorical, Gaussian, get_likelihood
from .models import ChainModel, as_chain_model, lenet5, predict, toy_mlp
from .preconditioners import Preconditioner, Structure, build_preconditioner, preconditioner_from_name
from .recursion import SMP, DivergenceError, Fisher, RunOptions, SMPResult, SMPState, residual_variance_ratio, run_smp
from .tail import add_gaussian_tail, gaussian_tail, tail_variance
from .tuning import choose_tau, predictive_nll

__all__ = [
    "add_gaussian_tail", "as_chain_model", "Bernoulli", "build_preconditioner", "Categorical", "ChainModel",
    "choose_tau", "DivergenceError", "estimate_fisher", "Fisher", "fisher_vectors", "Gaussian", "gaussian_tail",
    "get_likelihood", "lenet5", "metrics", "ParamLayout", "Preconditioner", "preconditioner_from_name",
    "preconditioners", "predict", "predictive_nll", "residual_variance_ratio", "run_smp", "RunOptions", "SMP",
    "SMPResult", "SMPState", "Structure", "tail_variance", "toy_mlp",
]
__version__ = "0.1.0"
