"""Token-level advantage transforms and weights: AR (§2), Lopti's split (§3), critical-token KL
weights (§5), and GRPO's group-normalised advantages."""

from __future__ import annotations

import torch

from . import _validate as V


def advantage_reweight(advantages, old_logp, alpha):
    """docs/math.md §2: ``A * (alpha * exp(old_logp) + 1 - alpha)``. advantages [B] or [B, T];
    old_logp [B, T]. Returns [B, T] (no gradient through old_logp)."""
    V.check_tensor("old_logp", old_logp, floating=True, dims=(2,))
    V.check_tensor("advantages", advantages, floating=True, dims=(1, 2), device=old_logp.device)
    B, T = old_logp.shape
    if tuple(advantages.shape) not in ((B,), (B, T)):
        raise ValueError(f"advantages: expected shape [{B}] or [{B}x{T}] (from old_logp), got "
                         f"{list(advantages.shape)}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: expected a float in [0, 1], got {alpha!r}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    return advantages * (alpha * old_logp.detach().exp() + (1.0 - alpha))


def lopti_split(old_logp, mask, eta):
    """docs/math.md §3: ``(low, high)`` bool masks; low = masked tokens with ``exp(old_logp) < eta``
    (strict), high = the remaining masked tokens."""
    V.check_tensor("old_logp", old_logp, floating=True)
    V.check_tensor("mask", mask, shape=tuple(old_logp.shape), device=old_logp.device)
    if not 0.0 < eta <= 1.0:
        raise ValueError(f"eta: expected a float in (0, 1], got {eta!r}")
    m = mask if mask.dtype == torch.bool else mask != 0
    low = (old_logp.detach().exp() < eta) & m
    return low, m & ~low


def critical_kl_weight(certainty, exponent=150.0, intercept=0.0):
    """docs/math.md §5: ``w_kl = (1 - c) * J**gamma + c`` (J clamped at 0 from below; no
    gradient)."""
    V.check_tensor("certainty", certainty, floating=True)
    if not exponent > 0:
        raise ValueError(f"exponent: expected a float > 0, got {exponent!r}")
    if not 0.0 <= intercept <= 1.0:
        raise ValueError(f"intercept: expected a float in [0, 1], got {intercept!r}")
    j = certainty.detach().float().clamp(min=0.0)
    return (1.0 - intercept) * j.pow(exponent) + intercept


def group_advantages(rewards, group_ids, scale="std"):
    """GRPO advantages: ``(r - mean_g) / (std_g + 1e-6)`` over each group of responses.

    rewards: [B] float; group_ids: [B] integer (groups may be non-contiguous and of different
    sizes). ``std_g`` is the unbiased standard deviation, as in TRL and verl; a group of one
    response has std 0. ``scale=None``: no division (Dr. GRPO).
    """
    V.check_tensor("rewards", rewards, floating=True, dims=(1,))
    V.check_tensor("group_ids", group_ids, shape=tuple(rewards.shape), integer=True,
                   device=rewards.device)
    if scale not in ("std", None):
        raise ValueError(f"scale: expected 'std' or None, got {scale!r}")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    _, inv = torch.unique(group_ids, return_inverse=True)
    G = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inv, r) / count
    centred = r - mean[inv]
    if scale is None:
        return centred
    ss = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inv, centred * centred)
    std = (ss / (count - 1).clamp(min=1.0)).sqrt()
    return centred / (std[inv] + 1e-6)
