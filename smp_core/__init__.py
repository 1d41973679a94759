"""smp_core: score-based martingale posteriors (SMP) for neural networks in PyTorch.

The reference implementation of *Score-Based Martingale Posteriors for Deep Neural Networks*
(Zhumekenov, Jasra, Maama, Tempone). Start with :func:`run_smp`.
"""

from . import metrics
from .fisher import estimate_fisher, fisher_vectors
from .layout import ParamLayout
from .likelihoods import Bernoulli, Categorical, Gaussian, get_likelihood
from .models import ChainModel, as_chain_model, lenet5, predict, toy_mlp
from .preconditioners import Preconditioner, Structure, build_preconditioner, preconditioner_from_name
from .recursion import DivergenceError, SMPResult, residual_variance_ratio, run_smp
from .tail import add_gaussian_tail, gaussian_tail, tail_variance

__all__ = [
    "Bernoulli", "Categorical", "ChainModel", "DivergenceError", "Gaussian", "ParamLayout", "Preconditioner",
    "SMPResult", "Structure", "add_gaussian_tail", "as_chain_model", "build_preconditioner", "estimate_fisher",
    "fisher_vectors", "gaussian_tail", "get_likelihood", "lenet5", "metrics", "predict", "preconditioner_from_name",
    "residual_variance_ratio", "run_smp", "tail_variance", "toy_mlp",
]
__version__ = "0.1.0"
