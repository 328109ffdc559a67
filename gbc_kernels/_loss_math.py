"""The per-token GRPO policy-loss math (docs/math.md §1-§3) in PyTorch, with its analytic
derivative.

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

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .config import PolicyLossConfig


@dataclass
class TokenTerms:
    """Per-token metric inputs of one call or chunk (1-d over its masked tokens)."""

    ratio: torch.Tensor                     # the importance ratio (per token or its sequence's)
    adv: torch.Tensor                       # A-hat after AR, token_scale and the phase mask
    ar: torch.Tensor
    p_old: torch.Tensor
    kl: Optional[torch.Tensor]              # weighted estimator value (None when kl_coef == 0)
    emask: Optional[torch.Tensor] = None    # entropy-quantile mask (None when off)
    dropped: Optional[torch.Tensor] = None  # dropped by the off-policy mask (None when off)
    phi_seq_sum: Optional[torch.Tensor] = None   # vespo: sum over sequences of mean_t phi (0-d)
    clip_seq_low: Optional[torch.Tensor] = None  # sequence level: sequences clipped (0-d counts)
    clip_seq_high: Optional[torch.Tensor] = None


@dataclass
class TokenInputs:
    """Everything per token that is not differentiated, compacted to the masked tokens (1-d,
    compute dtype), with the aggregation weight of each term and the sequence of each token.

    ``seq``: local sequence ids (non-decreasing, 0 .. n_seq - 1), needed when
    ``cfg.needs_sequence``; ``emask``: the entropy-quantile mask, when ``cfg.needs_batch``."""

    adv: torch.Tensor
    old: Optional[torch.Tensor]
    ref: Optional[torch.Tensor]
    tscale: Optional[torch.Tensor]
    klw: Optional[torch.Tensor]
    is_ratio: Optional[torch.Tensor]
    sampling: Optional[torch.Tensor]
    w_pg: torch.Tensor
    w_kl: torch.Tensor
    w_ent: torch.Tensor
    seq: Optional[torch.Tensor] = None
    n_seq: int = 0
    emask: Optional[torch.Tensor] = None
    seq_lengths: Optional[list] = None    # tokens per sequence (host), for the chunk plan

    _PER_TOKEN = ("adv", "old", "ref", "tscale", "klw", "is_ratio", "sampling", "w_pg", "w_kl",
                  "w_ent", "emask")

    def _select(self, sel, seq, n_seq) -> "TokenInputs":
        """The per-token fields indexed by ``sel`` (a slice or an index tensor)."""
        kw = {f: None if getattr(self, f) is None else getattr(self, f)[sel]
              for f in self._PER_TOKEN}
        return TokenInputs(**kw, seq=seq, n_seq=n_seq)

    def slice(self, s: int, e: int, n_seq: int = 0) -> "TokenInputs":
        """Tokens ``[s, e)``; with sequences, ``n_seq`` whole sequences starting at ``seq[s]``."""
        seq = None if self.seq is None else self.seq[s:e] - self.seq[s]
        return self._select(slice(s, e), seq, n_seq)

    def take(self, index: torch.Tensor) -> "TokenInputs":
        """The tokens ``index`` (sorted; whole sequences when there are sequences)."""
        seq, n_seq = (None, 0) if self.seq is None else local_ids(self.seq[index])
        return self._select(index, seq, n_seq)

    def native_ok(self, cfg: PolicyLossConfig) -> bool:
        """The one-pass C++ / Triton token kernels cover this call: the token-local PPO loss
        of §1-§3 with one aggregation for every term."""
        return (cfg.objective == "ppo_clip" and cfg.delta is None and not cfg.needs_sequence
                and not cfg.needs_batch and self.is_ratio is None and cfg.kl_agg is None
                and cfg.entropy_agg is None)


@dataclass
class LossTerms:
    """What :func:`loss_terms` returns: the weighted loss and its derivatives, and the metric
    inputs."""

    loss_sum: torch.Tensor      # sum over tokens of the aggregation-weighted loss (0-d)
    g: torch.Tensor             # dL/dlogp per token
    gH: Optional[torch.Tensor]  # dL/dH per token (None without entropy bonus)
    terms: TokenTerms


def kl_value_and_grad(logp, ref_logp, estimator):
    """KL estimator k(logp, ref_logp) and dk/dlogp, delta = ref_logp - logp (docs/math.md §1)."""
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


def local_ids(ids: torch.Tensor, with_lengths: bool = False):
    """Non-decreasing ids -> (the ids renumbered 0 .. n - 1, n), and with ``with_lengths`` the
    count of each id as a list. One host sync (the counts)."""
    if ids.numel() == 0:
        return (ids, 0, []) if with_lengths else (ids, 0)
    _, inverse, counts = torch.unique_consecutive(ids, return_inverse=True, return_counts=True)
    lengths = counts.tolist()
    return (inverse, len(lengths), lengths) if with_lengths else (inverse, len(lengths))


def _seg_sum(x, seq, n):
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, seq, x)


def _choose(cond, a: float, b: float, like: torch.Tensor) -> torch.Tensor:
    """``where(cond, a, b)`` in ``like``'s dtype (two Python floats would give float32)."""
    return torch.where(cond, like.new_tensor(a), like.new_tensor(b))


def _pick(pg1, pg2, d1, d2):
    """-min(x1, x2) = max(pg1, pg2) and its derivative, ties split in half (autograd's rule
    for torch.minimum)."""
    pg = torch.maximum(pg1, pg2)
    d = torch.where(pg1 > pg2, d1, torch.where(pg1 < pg2, d2, 0.5 * (d1 + d2)))
    return pg, d


def per_token_is_ratio(is_ratio, mask, cfg: PolicyLossConfig):
    """The importance ratio as the loss takes it, ``[B, T]``: a per-token one as it is; a
    per-sequence ``[B, 1]`` one multiplies each token of its sequence (broadcast), except under
    vespo, whose sequence weight adds ``Σ_t log r_t`` over the masked tokens: there the ratio
    goes whole on the sequence's first masked-in token and 1 (``log 1 = 0``) on the others, so
    that it enters the weight once (TRL's ``sequence_*`` modes)."""
    if is_ratio is None or is_ratio.shape[-1] == mask.shape[-1]:
        return is_ratio
    if cfg.objective != "vespo":
        return is_ratio.expand(mask.shape)
    first = mask.int().argmax(dim=-1, keepdim=True)        # 0 for an empty row: masked out
    return torch.ones(mask.shape, dtype=is_ratio.dtype, device=is_ratio.device).scatter_(
        1, first, is_ratio)


def gamma_log_weight(log_ratio, is_ratio, seq, n_seq):
    """VESPO's clamped sequence log-weight per sequence (docs/math.md)."""
    lower = math.log(1e-8)
    s = _seg_sum(log_ratio.clamp(-20.0, 20.0), seq, n_seq)
    if is_ratio is not None:
        s = s + _seg_sum(torch.log(is_ratio).clamp(lower, 20.0), seq, n_seq)
    return s.clamp(lower, 20.0)


def loss_terms(logp, entropy, ti: TokenInputs, cfg: PolicyLossConfig,
               phase: Optional[str]) -> LossTerms:
    """The loss of docs/math.md §1-§3 and §10 over masked tokens (1-d), its derivative in
    ``logp`` and in the entropy, with the aggregation weights applied.

    The policy term is a function of the log importance weight ``lw`` (the token's
    ``logp - old`` or its sequence's mean) and, for cispo and vespo, of ``logp`` directly; its
    derivative is kept in those two parts, ``d_lw`` and ``d_direct``. At sequence level
    ``dL/dlogp_s = d_direct_s + (1 / n_b) sum_{t in b} d_lw_t`` (the mean's derivative), which
    is why a sequence-level loss needs its whole sequence before any gradient.
    """
    zeros = torch.zeros_like(logp)
    adv_raw = ti.adv
    old = logp if ti.old is None else ti.old
    p_old = torch.exp(old)
    ar = cfg.ar_alpha * p_old + (1.0 - cfg.ar_alpha) if cfg.ar_alpha != 0.0 \
        else torch.ones_like(p_old)
    a = adv_raw * ar
    if ti.tscale is not None:
        a = a * ti.tscale
    active = None
    if phase is not None:
        low = p_old < cfg.lopti_eta
        active = low if phase == "low" else ~low
        a = torch.where(active, a, zeros)

    seq, n_seq = ti.seq, ti.n_seq
    cnt = None
    if cfg.needs_sequence:
        cnt = _seg_sum(torch.ones_like(logp), seq, n_seq)
    log_ratio = logp - old
    sequence_level = cfg.importance_sampling_level == "sequence"
    if sequence_level:
        lw = (_seg_sum(log_ratio, seq, n_seq) / cnt.clamp(min=1.0))[seq]
    else:
        lw = log_ratio
    ratio = torch.exp(lw)

    d_direct = None                       # dl/dlogp not through lw (cispo, vespo)
    phi_seq_sum = None
    obj = cfg.objective
    if obj == "ppo_clip":
        lo, hi = 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high
        if cfg.delta is None:
            r1, dr1 = ratio, ratio
        else:                             # clamp(max=delta) passes the gradient at delta
            r1, dr1 = ratio.clamp(max=cfg.delta), torch.where(ratio <= cfg.delta, ratio, zeros)
        r2 = ratio.clamp(lo, hi)
        dr2 = torch.where((ratio >= lo) & (ratio <= hi), ratio, zeros)
        pg, d_lw = _pick(-a * r1, -a * r2, -a * dr1, -a * dr2)
        if cfg.clip_ratio_c is not None:
            pg_dual = -a * cfg.clip_ratio_c
            dual = (a < 0) & (pg_dual < pg)
            pg = torch.where(dual, pg_dual, pg)
            d_lw = torch.where(dual, zeros, d_lw)
    elif obj == "cispo":
        c = ratio.clamp(max=cfg.epsilon_high)          # detached weight
        pg, d_lw, d_direct = -c * a * logp, zeros, -c * a
    elif obj == "sapo":
        kappa = _choose(adv_raw > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg, logp)
        sg = torch.sigmoid(kappa * (ratio - 1.0))
        pg = -sg * (4.0 / kappa) * a
        d_lw = -4.0 * a * sg * (1.0 - sg) * ratio      # d/dlw of -4/k sigma(k (e^lw - 1)) a
    else:   # vespo
        log_w = gamma_log_weight(log_ratio, ti.is_ratio, seq, n_seq)[seq]
        pos = adv_raw >= 0
        k = _choose(pos, cfg.vespo_k_pos, cfg.vespo_k_neg, logp)
        lam = _choose(pos, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg, logp).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        phi = phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        pg, d_lw, d_direct = -phi * a * logp, zeros, -phi * a
        phi_seq_sum = (_seg_sum(phi, seq, n_seq) / cnt.clamp(min=1.0)).sum()
    if ti.is_ratio is not None and obj != "vespo":
        pg, d_lw = pg * ti.is_ratio, d_lw * ti.is_ratio
        d_direct = None if d_direct is None else d_direct * ti.is_ratio

    # the policy term's masks (§10)
    keep = None
    dropped = None
    if cfg.off_policy_mask_threshold is not None:
        sampling = old if ti.sampling is None else ti.sampling
        drift = torch.nan_to_num(sampling - logp, nan=0.0)
        mean = (_seg_sum(drift, seq, n_seq) / cnt.clamp(min=1.0))[seq]
        keep = (adv_raw >= 0) | (mean <= cfg.off_policy_mask_threshold)
        dropped = ~keep
    if ti.emask is not None:
        keep = ti.emask if keep is None else keep & ti.emask
    if keep is not None:
        pg, d_lw = torch.where(keep, pg, zeros), torch.where(keep, d_lw, zeros)
        d_direct = None if d_direct is None else torch.where(keep, d_direct, zeros)

    loss_sum = (ti.w_pg * pg).sum()
    g_lw = ti.w_pg * d_lw
    g = zeros if d_direct is None else ti.w_pg * d_direct
    kl = None
    if cfg.kl_coef != 0.0:
        kl, dk = kl_value_and_grad(logp, ti.ref, cfg.kl_estimator)
        kl_lw = None
        if cfg.kl_ratio_correction:       # r k: d/dlw = r k, d/dlogp directly = r dk
            kl, dk = ratio * kl, ratio * dk
            kl_lw = kl
        if ti.klw is not None:
            kl, dk = kl * ti.klw, dk * ti.klw
            kl_lw = None if kl_lw is None else kl_lw * ti.klw
        wk = ti.w_kl * cfg.kl_coef
        if active is not None:
            wk = torch.where(active, wk, zeros)
        loss_sum = loss_sum + (wk * kl).sum()
        g = g + wk * dk
        if kl_lw is not None:
            g_lw = g_lw + wk * kl_lw
    if sequence_level:
        g = g + (_seg_sum(g_lw, seq, n_seq) / cnt.clamp(min=1.0))[seq]
    else:
        g = g + g_lw
    gH = None
    if cfg.entropy_coef != 0.0:
        on = active
        if ti.emask is not None:
            on = ti.emask if on is None else on & ti.emask
        gH = -cfg.entropy_coef * ti.w_ent
        if on is not None:
            gH = torch.where(on, gH, zeros)
        loss_sum = loss_sum + (gH * entropy).sum()
    clip_seq = (None, None)
    if sequence_level:                  # TRL's clip fractions count sequences at this level
        clip_seq = tuple((_seg_sum(f.to(logp.dtype), seq, n_seq) > 0).sum().to(logp.dtype)
                         for f in clip_flags(a, ratio, cfg))
    terms = TokenTerms(ratio, a, ar, p_old, kl, ti.emask, dropped, phi_seq_sum, *clip_seq)
    return LossTerms(loss_sum, g, gH, terms)


def clip_flags(a, r, cfg: PolicyLossConfig):
    """Tokens outside the objective's hard clip range, (low, high): ppo_clip's
    ``[1 - epsilon_low, 1 + epsilon_high]`` (on ``min(r, delta)``, as TRL), cispo's cap
    ``epsilon_high``; sapo and vespo have none."""
    if cfg.objective == "ppo_clip":
        rc = r if cfg.delta is None else r.clamp(max=cfg.delta)
        return (a < 0) & (rc < 1.0 - cfg.epsilon_low), (a > 0) & (rc > 1.0 + cfg.epsilon_high)
    none = torch.zeros_like(r, dtype=torch.bool)
    if cfg.objective == "cispo":
        return none, (a > 0) & (r > cfg.epsilon_high)
    return none, none


def aggregation_weights(mask: torch.Tensor, agg: str, cfg: PolicyLossConfig, num_items_in_batch,
                        dtype=torch.float32) -> torch.Tensor:
    """w[b, t] such that the aggregated term is sum(w * l) (docs/math.md §1, loss_agg). No host
    sync."""
    m = mask.to(dtype)
    B = mask.shape[0]
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


def term_weights(mask, cfg: PolicyLossConfig, num_items_in_batch, dtype, emask=None):
    """Aggregation weights [B, T] of the policy, KL and entropy terms. A term without an
    aggregation of its own shares the policy term's; one with its own is normalised over the
    tokens it acts on (the mask; for the entropy bonus also the entropy quantile ``emask``),
    without ``num_items_in_batch``."""
    w_pg = aggregation_weights(mask, cfg.loss_agg, cfg, num_items_in_batch, dtype)
    w_kl = w_pg if cfg.kl_agg is None else aggregation_weights(mask, cfg.kl_agg, cfg, None,
                                                                dtype)
    w_ent = w_pg
    if cfg.entropy_agg is not None:
        w_ent = aggregation_weights(mask if emask is None else emask, cfg.entropy_agg, cfg, None,
                                    dtype)
    return w_pg, w_kl, w_ent


def logp_grad_norm(g, logp, sum_p2, inv_temp):
    """docs/math.md §6: the norm of the logp part of dL/dz per token,
    |g| / tau * ||onehot - p||, with ||onehot - p||^2 = 1 - 2 p + sum_v p_v^2."""
    p = torch.exp(logp)
    return g.abs() * inv_temp * (1.0 - 2.0 * p + sum_p2).clamp(min=0.0).sqrt()


def policy_metrics(terms: TokenTerms, cfg: PolicyLossConfig, entropy=None, grad_norm=None,
                   n_seq_total: int = 0, n_seq_nonempty=None) -> dict:
    """docs/math.md §7 metrics: detached 0-d float32 tensors, means over the masked tokens
    (``terms`` holds those only).

    ``grad_norm`` is the per-token norm of §6 (None: ``grad_share_low`` is not reported).
    ``n_seq_total`` (B) and ``n_seq_nonempty`` give vespo's ``phi_mean`` over all B sequences
    (a sequence without tokens has phi = 1).
    """
    def masked_sum(x):
        return x.float().sum()

    a, r = terms.adv, terms.ratio
    n = torch.full((), float(max(r.numel(), 1)), device=r.device)   # no host-to-device copy
    flag_low, flag_high = clip_flags(a, r, cfg)
    low = terms.p_old < cfg.metric_eta
    # the per-token means: one stacked sum and one division (a launch or two, not two each)
    means = {"clip_frac_low": flag_low, "clip_frac_high": flag_high, "ratio_mean": r,
             "ar_weight_mean": terms.ar, "low_frac": low}
    if terms.kl is not None:
        means["kl"] = terms.kl
    if entropy is not None:
        means["entropy"] = entropy
    if cfg.needs_batch:
        means["entropy_mask_frac"] = terms.emask
    if cfg.off_policy_mask_threshold is not None and terms.dropped is not None:
        means["off_policy_frac"] = terms.dropped
    rows = torch.stack([v.reshape(-1).to(torch.float32) for v in means.values()])
    out = dict(zip(means, (rows.sum(1) / n).unbind(0)))
    if cfg.importance_sampling_level == "sequence":
        zero = torch.zeros((), device=r.device)
        for name, count in (("clip_frac_low_seq", terms.clip_seq_low),
                            ("clip_frac_high_seq", terms.clip_seq_high)):
            out[name] = (zero if count is None else count) / max(n_seq_total, 1)
    if cfg.objective == "vespo":
        phi = terms.phi_seq_sum if terms.phi_seq_sum is not None else torch.zeros(())
        empty = n_seq_total - n_seq_nonempty
        out["phi_mean"] = (phi + empty) / max(n_seq_total, 1)
    if cfg.needs_batch:
        em = terms.emask
        out["entropy_top_mean"] = (masked_sum(torch.where(em, entropy, torch.zeros_like(entropy)))
                                   / masked_sum(em).clamp(min=1.0))
    if cfg.off_policy_mask_threshold is not None and terms.dropped is None:
        out["off_policy_frac"] = torch.zeros((), device=r.device)
    if grad_norm is not None:
        gn = grad_norm.float()
        total, share = torch.stack([gn, torch.where(low, gn, torch.zeros_like(gn))]).sum(1)
        out["grad_share_low"] = torch.where(total > 0, share / total.clamp(min=1e-38),
                                            torch.zeros_like(total))
        out["grad_norm_sum"] = total
    return {k: v.detach().float() for k, v in out.items()}


def concat_terms(parts, rows=None):
    """One TokenTerms from the chunks' (None when there are none). ``rows``: the token indices
    each part covers, when the parts are not in token order (they are put back in order)."""
    if not parts:
        return None
    inv = None
    if rows is not None:
        order = torch.cat(rows)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
    out = {}
    for f in TokenTerms.__dataclass_fields__:
        vals = [getattr(t, f) for t in parts]
        if vals[0] is None:
            out[f] = None
        elif f in ("phi_seq_sum", "clip_seq_low", "clip_seq_high"):
            out[f] = torch.stack(vals).sum()
        else:
            out[f] = torch.cat(vals) if inv is None else torch.cat(vals)[inv]
    return TokenTerms(**out)


def empty_metrics(cfg: PolicyLossConfig, device, n_seq_total: int = 0) -> dict:
    """The metrics of a call without any masked token: zeros (phi_mean: 1 with sequences)."""
    z = torch.zeros((), device=device, dtype=torch.float32)
    keys = ["clip_frac_low", "clip_frac_high", "ratio_mean", "ar_weight_mean", "low_frac",
            "grad_share_low", "grad_norm_sum"]
    if cfg.kl_coef != 0.0:
        keys.append("kl")
    if cfg.wants_entropy:
        keys.append("entropy")
    if cfg.needs_batch:
        keys += ["entropy_mask_frac", "entropy_top_mean"]
    if cfg.importance_sampling_level == "sequence":
        keys += ["clip_frac_low_seq", "clip_frac_high_seq"]
    if cfg.off_policy_mask_threshold is not None:
        keys.append("off_policy_frac")
    out = {k: z.clone() for k in keys}
    if cfg.objective == "vespo":
        out["phi_mean"] = z + (1.0 if n_seq_total else 0.0)
    return out


def certainty_from_stats(kind, entropy, zmax, lse, vocab):
    """docs/math.md §5: J_entropy = 1 - H / log V, J_max_prob = 1 + (max z - LSE) / log V."""
    log_v = math.log(vocab) if vocab > 1 else 1.0
    if kind == "entropy":
        return 1.0 - entropy / log_v
    return 1.0 + (zmax - lse) / log_v
