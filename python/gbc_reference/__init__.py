"""gbc_reference: the plain implementation that defines the math of gbc_kernels.

Everything here is written the obvious way: full ``[B, T, V]`` logits, ``torch.log_softmax``
and autograd. It is slow and memory-hungry on purpose; it exists so that a reader can learn the
formulas of ``docs/math.md`` from code, and so that every fast path of ``gbc_kernels`` can be tested
against it. It imports nothing from ``gbc_kernels``.

The API mirrors ``gbc_kernels`` name for name (``backend`` arguments are accepted and ignored).
"""

from .core import (
    PolicyLossConfig,
    TokenStats,
    NTHRResult,
    advantage_reweight,
    critical_kl_weight,
    fused_linear_logprobs,
    fused_linear_policy_loss,
    group_advantages,
    kl_estimate,
    lopti_split,
    nthr_scale,
    policy_loss,
    token_stats,
)
from .sampler import kept_set, truncation_support_ids

__all__ = [
    "PolicyLossConfig",
    "TokenStats",
    "NTHRResult",
    "advantage_reweight",
    "critical_kl_weight",
    "fused_linear_logprobs",
    "fused_linear_policy_loss",
    "group_advantages",
    "kl_estimate",
    "lopti_split",
    "nthr_scale",
    "policy_loss",
    "token_stats",
    "kept_set",
    "truncation_support_ids",
]
