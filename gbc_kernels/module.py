"""nn.Module wrapper of the fused loss."""

from __future__ import annotations

import torch

from .config import PolicyLossConfig
from .ops import fused_linear_policy_loss


class FusedLinearPolicyLoss(torch.nn.Module):
    """``loss, metrics = FusedLinearPolicyLoss(cfg)(hidden, weight, targets, mask, advantages,
    ...)``: :func:`gbc_kernels.fused_linear_policy_loss` with a fixed config and backend."""

    def __init__(self, config: PolicyLossConfig = None, backend: str = "auto"):
        super().__init__()
        self.config = config if config is not None else PolicyLossConfig()
        self.backend = backend

    def forward(self, hidden, weight, targets, mask, advantages, old_logp=None, ref_logp=None,
                bias=None, token_scale=None, kl_weight=None, phase=None,
                num_items_in_batch=None, is_ratio=None, sampling_logp=None,
                data_parallel_group=None, num_seqs_in_batch=None):
        return fused_linear_policy_loss(hidden, weight, targets, mask, advantages,
                                        old_logp=old_logp, ref_logp=ref_logp, bias=bias,
                                        token_scale=token_scale, kl_weight=kl_weight,
                                        config=self.config, phase=phase,
                                        num_items_in_batch=num_items_in_batch,
                                        backend=self.backend, is_ratio=is_ratio,
                                        sampling_logp=sampling_logp,
                                        data_parallel_group=data_parallel_group,
                                        num_seqs_in_batch=num_seqs_in_batch)

    def extra_repr(self) -> str:
        return f"config={self.config}, backend={self.backend!r}"
