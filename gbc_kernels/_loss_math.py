"""The per-token GRPO policy-loss math of SPEC §1-§3 in PyTorch, with its analytic derivative.

Every backend calls this once per chunk of tokens (the Triton and C++ backends carry their own
copies of the same formulas, each tested against ``gbc_reference``). Inputs are 1-d over tokens;
``valid`` marks the tokens with ``m = 1`` (None: all of them, as after row compaction).

For each token the function returns the loss term ``l`` and ``dl/dlogp`` (``dl/dH`` is the
constant ``-entropy_coef`` on active tokens). Ties follow PyTorch's autograd conventions, so the
result equals autograd on the reference formulas:
* ``clamp`` passes the gradient on the closed interval ``[lo, hi]``;
* ``max(unclipped, clipped)``: when both are equal, both derivatives are equal too (or ``A = 0``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .config import PolicyLossConfig


@dataclass
class TokenTerms:
    loss: torch.Tensor          # l per token, 0 where not valid
    dlogp: torch.Tensor         # dl/dlogp per token
    dentropy: torch.Tensor      # dl/dH per token
    ratio: torch.Tensor
    adv: torch.Tensor           # A-hat after AR, token_scale and the phase mask
    ar: torch.Tensor
    p_old: torch.Tensor
    kl: Optional[torch.Tensor]  # weighted estimator value (None when kl_coef == 0)


def kl_value_and_grad(logp, ref_logp, estimator):
    """KL estimator k(logp, ref_logp) and dk/dlogp, delta = ref_logp - logp (SPEC §1)."""
    delta = ref_logp - logp
    if estimator == "k1":
        return -delta, torch.ones_like(delta)
    if estimator == "k2":
        return 0.5 * delta * delta, -delta
    if estimator == "k3":
        e = torch.exp(delta)
        return e - delta - 1.0, 1.0 - e
    # low_var_kl (verl): delta clamped to +-20, the value to +-10; clamp passes gradient inside
    d = delta.clamp(-20.0, 20.0)
    e = torch.exp(d)
    raw = e - d - 1.0
    val = raw.clamp(-10.0, 10.0)
    inside = (delta >= -20.0) & (delta <= 20.0) & (raw >= -10.0) & (raw <= 10.0)
    return val, torch.where(inside, 1.0 - e, torch.zeros_like(e))


def token_terms(logp, entropy, adv, old_logp, ref_logp, token_scale, kl_weight, valid,
                cfg: PolicyLossConfig, phase: Optional[str]) -> TokenTerms:
    zeros = torch.zeros_like(logp)
    old = logp if old_logp is None else old_logp
    p_old = torch.exp(old)
    ar = cfg.ar_alpha * p_old + (1.0 - cfg.ar_alpha) if cfg.ar_alpha != 0.0 else torch.ones_like(p_old)
    a = adv * ar
    if token_scale is not None:
        a = a * token_scale
    active = valid
    if phase is not None:
        low = p_old < cfg.lopti_eta
        sel = low if phase == "low" else ~low
        active = sel if valid is None else sel & valid
    if active is not None:
        a = torch.where(active, a, zeros)

    ratio = torch.exp(logp - old)
    lo, hi = 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high
    pg_unclipped = -a * ratio
    pg_clipped = -a * ratio.clamp(lo, hi)
    use_unclipped = pg_unclipped >= pg_clipped
    in_range = (ratio >= lo) & (ratio <= hi)
    pg = torch.where(use_unclipped, pg_unclipped, pg_clipped)
    dpg = torch.where(use_unclipped | in_range, pg_unclipped, zeros)   # d(-a r)/dlogp = -a r
    if cfg.clip_ratio_c is not None:
        pg_dual = -a * cfg.clip_ratio_c
        dual = (a < 0) & (pg_dual < pg)
        pg = torch.where(dual, pg_dual, pg)
        dpg = torch.where(dual, zeros, dpg)

    loss, dlogp = pg, dpg
    kl = None
    if cfg.kl_coef != 0.0:
        kl, dkl = kl_value_and_grad(logp, ref_logp, cfg.kl_estimator)
        if cfg.kl_ratio_correction:       # d(r k)/dlogp = r k + r dk (dr/dlogp = r)
            kl, dkl = ratio * kl, ratio * (kl + dkl)
        if kl_weight is not None:
            kl, dkl = kl * kl_weight, dkl * kl_weight
        if active is not None:
            loss = loss + cfg.kl_coef * torch.where(active, kl, zeros)
            dlogp = dlogp + cfg.kl_coef * torch.where(active, dkl, zeros)
        else:
            loss, dlogp = loss + cfg.kl_coef * kl, dlogp + cfg.kl_coef * dkl
    dent = zeros
    if cfg.entropy_coef != 0.0:
        dent = torch.full_like(logp, -cfg.entropy_coef)
        if active is not None:
            dent = torch.where(active, dent, zeros)
        loss = loss + dent * entropy
    if valid is not None:
        loss = torch.where(valid, loss, zeros)
        dlogp = torch.where(valid, dlogp, zeros)
    return TokenTerms(loss, dlogp, dent, ratio, a, ar, p_old, kl)


def aggregation_weights(mask: torch.Tensor, cfg: PolicyLossConfig, num_items_in_batch,
                        dtype=torch.float32) -> torch.Tensor:
    """w[b, t] such that the aggregated loss is sum(w * l) (SPEC §1 loss_agg). No host sync."""
    m = mask.to(dtype)
    B = mask.shape[0]
    agg = cfg.loss_agg
    if agg == "token-mean":
        if num_items_in_batch is None:
            n = m.sum()
        else:
            n = torch.as_tensor(num_items_in_batch, dtype=dtype, device=mask.device)
        return m / n.clamp(min=1.0)
    if agg == "seq-mean-token-mean":
        return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * B)
    if agg == "seq-mean-token-sum":
        return m / B
    return m / (B * cfg.max_len)   # seq-mean-token-sum-norm


def logp_grad_norm(g, logp, sum_p2, inv_temp):
    """SPEC §6: the norm of the logp part of dL/dz per token, |g| / tau * ||onehot - p||, with
    ||onehot - p||^2 = 1 - 2 p + sum_v p_v^2."""
    p = torch.exp(logp)
    return g.abs() * inv_temp * (1.0 - 2.0 * p + sum_p2).clamp(min=0.0).sqrt()


def policy_metrics(terms: TokenTerms, valid, cfg: PolicyLossConfig, entropy=None,
                   grad_norm=None) -> dict:
    """SPEC §7 metrics: detached 0-d float32 tensors, means over the tokens with m = 1.

    ``grad_norm`` is the per-token norm of §6 (None: ``grad_share_low`` is not reported).
    """
    def masked_sum(x):
        x = x.float()
        return (x if valid is None else torch.where(valid, x, torch.zeros_like(x))).sum()

    n = (torch.tensor(float(terms.ratio.numel()), device=terms.ratio.device) if valid is None
         else valid.sum().float()).clamp(min=1.0)
    a, r = terms.adv, terms.ratio
    low = terms.p_old < cfg.metric_eta
    out = {
        "clip_frac_low": masked_sum((a < 0) & (r < 1.0 - cfg.epsilon_low)) / n,
        "clip_frac_high": masked_sum((a > 0) & (r > 1.0 + cfg.epsilon_high)) / n,
        "ratio_mean": masked_sum(r) / n,
        "ar_weight_mean": masked_sum(terms.ar) / n,
        "low_frac": masked_sum(low) / n,
    }
    if terms.kl is not None:
        out["kl"] = masked_sum(terms.kl) / n
    if entropy is not None:
        out["entropy"] = masked_sum(entropy) / n
    if grad_norm is not None:
        total = masked_sum(grad_norm)
        share = masked_sum(torch.where(low, grad_norm, torch.zeros_like(grad_norm)))
        out["grad_share_low"] = torch.where(total > 0, share / total.clamp(min=1e-38),
                                            torch.zeros_like(total))
        out["grad_norm_sum"] = total
    return {k: v.detach().float() for k, v in out.items()}
