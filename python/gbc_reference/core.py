"""The math of SPEC.md, written plainly: full logits, log_softmax, autograd.

Section numbers (§) refer to ``shared/SPEC.md`` / ``docs/math.md``. Float64 inputs are computed
in float64 (so ``torch.autograd.gradcheck`` works); everything else in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclass
class PolicyLossConfig:
    """Non-tensor options of the GRPO policy loss (§1-§3); same fields as gbc_kernels'."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    clip_ratio_c: Optional[float] = None
    loss_agg: str = "token-mean"
    max_len: Optional[int] = None
    temperature: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_ratio_correction: bool = False     # kl *= r (TRL's use_bias_correction_kl)
    entropy_coef: float = 0.0
    ar_alpha: float = 0.0
    lopti_eta: Optional[float] = None


_LOSS_AGG_ALIASES = {
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------
# Logits and log-probabilities
# ----------------------------------------------------------------------------------------------


def _logits(hidden, weight, bias, temperature):
    """z = (hidden @ weight.T + bias) / temperature, in float32 (float64 for float64 inputs)."""
    dt = _compute_dtype(hidden)
    z = hidden.to(dt) @ weight.to(dt).T
    if bias is not None:
        z = z + bias.to(dt)
    return z / temperature


def _gather(logprobs_all, targets):
    return logprobs_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _entropy(logprobs_all):
    return -(logprobs_all.exp() * logprobs_all).sum(-1)


def fused_linear_logprobs(hidden, weight, targets, bias=None, temperature=1.0,
                          return_entropy=False, backend="auto"):
    """logp[n] = log_softmax(z[n])[targets[n]]; entropy[n] = H(softmax(z[n])). Shapes [...]."""
    logprobs_all = torch.log_softmax(_logits(hidden, weight, bias, temperature), dim=-1)
    logp = _gather(logprobs_all, targets)
    entropy = _entropy(logprobs_all) if return_entropy else None
    return logp, entropy


class TokenStats(NamedTuple):
    logp: torch.Tensor
    entropy: torch.Tensor
    certainty: Optional[torch.Tensor]


@torch.no_grad()
def token_stats(hidden, weight, targets, bias=None, temperature=1.0, certainty=None,
                certainty_temperature=1.0, backend="auto"):
    """Per-token logp and entropy at ``temperature``, and the certainty J of §5 at
    ``certainty_temperature``:

        J_entropy  = 1 - H(pi) / log V
        J_max_prob = 1 + log max_v pi(v) / log V
    """
    logprobs_all = torch.log_softmax(_logits(hidden, weight, bias, temperature), dim=-1)
    logp = _gather(logprobs_all, targets)
    entropy = _entropy(logprobs_all)
    cert = None
    if certainty is not None:
        V = weight.shape[0]
        lp_w = torch.log_softmax(_logits(hidden, weight, bias, certainty_temperature), dim=-1)
        if certainty == "entropy":
            cert = 1.0 - _entropy(lp_w) / math.log(V)
        elif certainty == "max_prob":
            cert = 1.0 + lp_w.max(dim=-1).values / math.log(V)
        else:
            raise ValueError(f"certainty: expected None, 'entropy' or 'max_prob', got {certainty!r}")
    return TokenStats(logp.float(), entropy.float(), None if cert is None else cert.float())


# ----------------------------------------------------------------------------------------------
# Token-level transforms (§2, §3, §5) and advantages
# ----------------------------------------------------------------------------------------------


def advantage_reweight(advantages, old_logp, alpha):
    """§2: A * (alpha * p_old + 1 - alpha), p_old = exp(old_logp). Returns [B, T]."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    p_old = old_logp.detach().exp()
    return advantages * (alpha * p_old + (1.0 - alpha))


def lopti_split(old_logp, mask, eta):
    """§3: low = masked tokens with p_old < eta (strict), high = the other masked tokens."""
    m = mask.bool()
    low = (old_logp.detach().exp() < eta) & m
    return low, m & ~low


def critical_kl_weight(certainty, exponent=150.0, intercept=0.0):
    """§5: w_kl = (1 - c) * J**gamma + c."""
    return (1.0 - intercept) * certainty.clamp(min=0.0) ** exponent + intercept


def group_advantages(rewards, group_ids, scale="std"):
    """(r - mean_g) / (std_g + 1e-6), std unbiased as in TRL; scale=None: r - mean_g."""
    rewards = rewards.float() if rewards.dtype != torch.float64 else rewards
    out = torch.empty_like(rewards)
    for g in torch.unique(group_ids):
        sel = group_ids == g
        r = rewards[sel]
        centred = r - r.mean()
        if scale == "std":
            std = r.std() if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
            centred = centred / (std + 1e-6)
        out[sel] = centred
    return out


def kl_estimate(logp, ref_logp, estimator):
    """§1 KL estimators of KL(pi || pi_ref) at the sampled token, delta = ref_logp - logp."""
    delta = ref_logp - logp
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta ** 2
    if estimator == "k3":
        return torch.exp(delta) - delta - 1.0
    if estimator == "low_var_kl":
        d = delta.clamp(-20.0, 20.0)
        return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kl_estimator: unknown {estimator!r}")


# ----------------------------------------------------------------------------------------------
# The policy loss (§1-§3, §6)
# ----------------------------------------------------------------------------------------------


def _per_token_loss(logp, entropy, mask, advantages, old_logp, ref_logp, token_scale,
                    kl_weight, cfg, phase):
    """Returns the per-token loss l[b,t] (0 where m = 0) and the intermediates the metrics use."""
    m = mask.bool()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logp)
    old = logp.detach() if old_logp is None else old_logp
    p_old = old.exp()
    # §2 advantage reweighting, then the token scale (NTHR, §4)
    ar = cfg.ar_alpha * p_old + (1.0 - cfg.ar_alpha)
    adv = advantages * ar
    if token_scale is not None:
        adv = adv * token_scale
    # §3 Lopti phase mask: applied after AR
    active = m
    if phase is not None:
        low, high = lopti_split(old, m, cfg.lopti_eta)
        active = low if phase == "low" else high
    adv = torch.where(active, adv, torch.zeros_like(adv))

    ratio = torch.exp(logp - old)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    if cfg.clip_ratio_c is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.clip_ratio_c), pg)
    loss = pg
    kl = None
    if cfg.kl_coef != 0.0:
        kl = kl_estimate(logp, ref_logp, cfg.kl_estimator)
        if cfg.kl_ratio_correction:
            kl = kl * ratio
        if kl_weight is not None:
            kl = kl * kl_weight
        loss = loss + cfg.kl_coef * torch.where(active, kl, torch.zeros_like(kl))
    if cfg.entropy_coef != 0.0:
        loss = loss - cfg.entropy_coef * torch.where(active, entropy, torch.zeros_like(entropy))
    loss = torch.where(m, loss, torch.zeros_like(loss))
    return loss, dict(ratio=ratio, adv=adv, ar=ar, p_old=p_old, kl=kl)


def _aggregate(per_token, mask, cfg, num_items_in_batch):
    """The four loss_agg modes of §1."""
    agg = _LOSS_AGG_ALIASES.get(cfg.loss_agg, cfg.loss_agg)
    m = mask.to(per_token.dtype)
    B = per_token.shape[0]
    if agg == "token-mean":
        n = m.sum() if num_items_in_batch is None else torch.as_tensor(
            num_items_in_batch, dtype=per_token.dtype)
        return per_token.sum() / n.clamp(min=1.0)
    if agg == "seq-mean-token-mean":
        return (per_token.sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / B
    if agg == "seq-mean-token-sum":
        return per_token.sum() / B
    if agg == "seq-mean-token-sum-norm":
        return per_token.sum() / (B * cfg.max_len)
    raise ValueError(f"loss_agg: unknown {cfg.loss_agg!r}")


def _metrics(parts, logp, entropy, mask, cfg, grad_share_low, grad_norm_sum=None):
    m = mask.bool()
    n = m.sum().clamp(min=1).to(torch.float32)

    def masked_mean(x):
        return (torch.where(m, x, torch.zeros_like(x)).sum() / n).float().detach()

    ratio, adv = parts["ratio"], parts["adv"]
    eta = cfg.lopti_eta if cfg.lopti_eta is not None else 0.5
    out = {
        "clip_frac_low": masked_mean(((adv < 0) & (ratio < 1.0 - cfg.epsilon_low)).float()),
        "clip_frac_high": masked_mean(((adv > 0) & (ratio > 1.0 + cfg.epsilon_high)).float()),
        "ratio_mean": masked_mean(ratio),
        "ar_weight_mean": masked_mean(parts["ar"]),
        "low_frac": masked_mean((parts["p_old"] < eta).float()),
    }
    if parts["kl"] is not None:
        out["kl"] = masked_mean(parts["kl"])
    if entropy is not None:
        out["entropy"] = masked_mean(entropy)
    if grad_share_low is not None:
        out["grad_share_low"] = grad_share_low.float().detach()
    if grad_norm_sum is not None:
        out["grad_norm_sum"] = grad_norm_sum.float().detach()
    return out


def policy_loss(logp, mask, advantages, old_logp=None, ref_logp=None, entropy=None,
                token_scale=None, kl_weight=None, config=None, phase=None,
                num_items_in_batch=None):
    """GRPO policy loss from per-token log-probs ``logp`` [B, T] (§1-§3). Returns (loss, metrics).

    ``grad_share_low`` needs the full distribution and is only reported by
    ``fused_linear_policy_loss``.
    """
    cfg = config or PolicyLossConfig()
    per_token, parts = _per_token_loss(logp, entropy, mask, advantages, old_logp, ref_logp,
                                       token_scale, kl_weight, cfg, phase)
    loss = _aggregate(per_token, mask, cfg, num_items_in_batch)
    return loss, _metrics(parts, logp, entropy if cfg.entropy_coef != 0 else None, mask, cfg, None)


def fused_linear_policy_loss(hidden, weight, targets, mask, advantages, old_logp=None,
                             ref_logp=None, bias=None, token_scale=None, kl_weight=None,
                             config=None, phase=None, num_items_in_batch=None, backend="auto"):
    """The GRPO loss from hidden states [B, T, H] and lm_head weight [V, H], plainly:

        z = (hidden @ weight.T + bias) / temperature           # [B, T, V]
        logp = log_softmax(z).gather(targets)
        loss = policy_loss(logp, mask, advantages, ...)
    """
    cfg = config or PolicyLossConfig()
    m = mask.bool()
    safe_targets = torch.where(m, targets, torch.zeros_like(targets))
    logprobs_all = torch.log_softmax(_logits(hidden, weight, bias, cfg.temperature), dim=-1)
    logp = _gather(logprobs_all, safe_targets)
    entropy = _entropy(logprobs_all) if cfg.entropy_coef != 0.0 else None

    per_token, parts = _per_token_loss(logp, entropy, mask, advantages, old_logp, ref_logp,
                                       token_scale, kl_weight, cfg, phase)
    loss = _aggregate(per_token, mask, cfg, num_items_in_batch)

    # §6: the norm of the logp-part of dloss/dlogits per token is
    #     |g| / temperature * sqrt(1 - 2 p + sum_v p_v^2),  g = dloss/dlogp (entropy term excluded)
    with torch.enable_grad():
        logp_leaf = logp.detach().requires_grad_(True)
        ent_leaf = None if entropy is None else entropy.detach()
        pt, _ = _per_token_loss(logp_leaf, ent_leaf, mask, advantages, old_logp, ref_logp,
                                token_scale, kl_weight, cfg, phase)
        g, = torch.autograd.grad(_aggregate(pt, mask, cfg, num_items_in_batch), logp_leaf)
    probs = logprobs_all.detach().exp()
    p = logp.detach().exp()
    norm = g.abs() / cfg.temperature * (1.0 - 2.0 * p + (probs ** 2).sum(-1)).clamp(min=0).sqrt()
    norm = torch.where(m, norm, torch.zeros_like(norm))
    old = logp.detach() if old_logp is None else old_logp
    eta = cfg.lopti_eta if cfg.lopti_eta is not None else 0.5
    low = (old.exp() < eta) & m
    total = norm.sum()
    share = torch.where(total > 0, norm[low].sum() / torch.where(total > 0, total, 1.0),
                        torch.zeros_like(total))
    return loss, _metrics(parts, logp, entropy, mask, cfg, share, total)


# ----------------------------------------------------------------------------------------------
# NTHR (§4)
# ----------------------------------------------------------------------------------------------


class NTHRResult(NamedTuple):
    scale: torch.Tensor      # [B, T] float32
    selected: torch.Tensor   # [B, T] bool
    scores: torch.Tensor     # [B, T] float32, 0 outside scored tokens
    thresholds: dict         # group id -> tau_g (only groups with mixed correctness)


@torch.no_grad()
def nthr_scale(hidden, weight, targets, mask, group_ids, correct, bias=None, temperature=1.0,
               beta=1.0, eta="auto", backend="auto", logp=None):
    """§4 Negative Token Hidden Reward, with the full logits.

    For every group with both correct and incorrect responses:
      V*   = distinct masked target ids of the group
      e    = onehot_{V*}(y) - softmax(z)[V*]          (full-vocabulary normalisation)
      M+   = sum over correct tokens of e (x) h         [|V*|, H]
      s    = e^T M+ h                                    per masked token
      tau  = beta * min over correct responses of mean_t s
      incorrect tokens with s > tau get scale eta_g (2|0.5 - p| for eta="auto").

    ``logp`` (a shortcut of the fast path for the LSE) is accepted and ignored here.
    """
    B, T, H = hidden.shape
    dt = _compute_dtype(hidden)
    m = mask.bool()
    scale = torch.ones(B, T, dtype=torch.float32)
    selected = torch.zeros(B, T, dtype=torch.bool)
    scores = torch.zeros(B, T, dtype=torch.float32)
    thresholds = {}
    probs = torch.softmax(_logits(hidden, weight, bias, temperature), dim=-1)  # [B, T, V]
    correct = correct.bool()
    for g in torch.unique(group_ids).tolist():
        rows = (group_ids == g).nonzero().flatten().tolist()
        n_pos = sum(bool(correct[b]) for b in rows)
        if n_pos == 0 or n_pos == len(rows):
            continue
        vstar = torch.unique(torch.cat([targets[b][m[b]] for b in rows]))
        if vstar.numel() == 0:
            continue

        def error(b):  # [T_b, |V*|]
            y = targets[b][m[b]]
            onehot = (y.unsqueeze(-1) == vstar.unsqueeze(0)).to(dt)
            return onehot - probs[b][m[b]][:, vstar]

        m_plus = torch.zeros(vstar.numel(), H, dtype=dt)
        for b in rows:
            if correct[b]:
                m_plus += error(b).T @ hidden[b][m[b]].to(dt)
        anchors, row_scores = [], {}
        for b in rows:
            if not m[b].any():
                continue
            e, h = error(b), hidden[b][m[b]].to(dt)
            row_scores[b] = s = ((e @ m_plus) * h).sum(-1)
            scores[b][m[b]] = s.float()
            if correct[b]:
                anchors.append(s.mean())
        if not anchors:
            continue
        tau = beta * torch.stack(anchors).min()
        thresholds[g] = float(tau)
        p = n_pos / len(rows)
        eta_g = 2.0 * abs(0.5 - p) if eta == "auto" else float(eta)
        for b in rows:
            if not correct[b] and b in row_scores:
                sel = torch.zeros(T, dtype=torch.bool)
                sel[m[b]] = row_scores[b] > tau
                selected[b] = sel
                scale[b][sel] = eta_g
    return NTHRResult(scale, selected, scores, thresholds)
