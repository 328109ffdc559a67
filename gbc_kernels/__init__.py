"""gbc_kernels: fused linear -> log-softmax -> GRPO policy-loss kernels with the token-level
gradient-balance fixes AR, Lopti, NTHR and critical-token KL, without materialising logits.

The math is defined by ``gbc_reference`` (python/gbc_reference) and ``docs/math.md``.
"""

from .config import (BACKENDS, PolicyLossConfig, LOSS_AGG_ALIASES, LOSS_AGG_MODES,
                     KL_ESTIMATORS)
from ._validate import value_checks_enabled
from .ops import (TokenStats, fused_linear_logprobs, fused_linear_policy_loss, policy_loss,
                  token_stats)
from .transforms import advantage_reweight, critical_kl_weight, group_advantages, lopti_split
from .nthr import NTHRResult, nthr_scale
from .lopti import lopti_grad_share_low, lopti_phases
from .module import FusedLinearPolicyLoss
from . import methods
from .methods import MethodOptions
from .vocab_parallel import VocabParallel
from .sequence_parallel import SequenceParallel
from .truncation import SamplerTruncation

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "PolicyLossConfig", "LOSS_AGG_ALIASES", "LOSS_AGG_MODES", "KL_ESTIMATORS",
    "TokenStats", "fused_linear_logprobs", "fused_linear_policy_loss", "policy_loss",
    "token_stats", "advantage_reweight", "critical_kl_weight", "group_advantages",
    "lopti_split", "NTHRResult", "nthr_scale", "lopti_phases", "lopti_grad_share_low",
    "FusedLinearPolicyLoss", "methods", "MethodOptions", "value_checks_enabled",
    "VocabParallel", "SequenceParallel", "SamplerTruncation",
]
