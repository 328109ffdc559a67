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
from typing import NamedTuple, Optional

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
    flag_low: Optional[torch.Tensor] = None      # dppo, gmpo: their own clip flags per token
    flag_high: Optional[torch.Tensor] = None
    cov_sel: Optional[torch.Tensor] = None       # Clip-Cov / KL-Cov: the selected tokens
    log_ratio: Optional[torch.Tensor] = None     # logp - old_logp per token, before any clamp


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
    cov_sel: Optional[torch.Tensor] = None   # Clip-Cov / KL-Cov selection, when cfg.cov_mode
    norms: object = None                      # the call's batch normalisers (Norms)
    itemp: Optional[torch.Tensor] = None      # per-token 1/temperature (None: the config's)

    _PER_TOKEN = ("adv", "old", "ref", "tscale", "klw", "is_ratio", "sampling", "w_pg", "w_kl",
                  "w_ent", "emask", "cov_sel", "itemp")

    def _select(self, sel, seq, n_seq) -> "TokenInputs":
        """The per-token fields indexed by ``sel`` (a slice or an index tensor)."""
        kw = {f: None if getattr(self, f) is None else getattr(self, f)[sel]
              for f in self._PER_TOKEN}
        return TokenInputs(**kw, seq=seq, n_seq=n_seq, norms=self.norms)

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
                and cfg.entropy_agg is None and cfg.log_ratio_clamp is None
                and cfg.log_ratio_penalty == 0.0 and cfg.kl_estimator in NATIVE_KL
                and cfg.kl_clamp is None and cfg.kl_log_ratio_clamp is None
                and not cfg.kl_unbiased_gradient
                and self.itemp is None)


@dataclass
class LossTerms:
    """What :func:`loss_terms` returns: the weighted loss and its derivatives, and the metric
    inputs."""

    loss_sum: torch.Tensor      # sum over tokens of the aggregation-weighted loss (0-d)
    g: torch.Tensor             # dL/dlogp per token
    gH: Optional[torch.Tensor]  # dL/dH per token (None without entropy bonus)
    terms: TokenTerms


# the estimators the one-pass C++ / Triton token kernels know (by their index in this tuple)
NATIVE_KL = ("k1", "k2", "k3", "low_var_kl")


def kl_value_and_grad(logp, ref_logp, estimator, clamp=None, input_clamp=None,
                      straight_through=None):
    """KL estimator k(logp, ref_logp) and dk/dlogp, delta = ref_logp - logp (docs/math.md §1,
    §12). ``input_clamp``: delta clamped to ``[-c, c]`` first; ``clamp``: the value clamped to
    ``[-clamp, clamp]`` (each passes the gradient inside only; ``low_var_kl`` is ``k3`` with 20
    and 10). ``straight_through = w`` (a ``+`` estimator: 1; OpenRLHF's unbiased gradient: the
    clamped ratio): the value kept, the gradient ``w (logp - ref_logp)``, k2's, weighted."""
    base = estimator.rstrip("+")
    if base == "low_var_kl":
        base, input_clamp, clamp = "k3", 20.0, 10.0
    delta = ref_logp - logp
    d_in = None
    if input_clamp is not None:
        d_in = (delta >= -input_clamp) & (delta <= input_clamp)
        delta = delta.clamp(-input_clamp, input_clamp)
    if base == "k1":
        val, grad = -delta, torch.ones_like(delta)
    elif base == "k2":
        val, grad = 0.5 * delta * delta, -delta
    elif base == "k3":
        e = torch.exp(delta)
        val, grad = e - delta - 1.0, 1.0 - e
    else:                                  # abs: d|x|/dx = sign(x), 0 at 0 (autograd's)
        val, grad = delta.abs(), -torch.sign(delta)
    if d_in is not None:
        grad = torch.where(d_in, grad, torch.zeros_like(grad))
    if clamp is not None:
        inside = (val >= -clamp) & (val <= clamp)
        val, grad = val.clamp(-clamp, clamp), torch.where(inside, grad, torch.zeros_like(grad))
    if straight_through is not None:
        grad = straight_through * (logp - ref_logp)
    return val, grad


def clamped_log_ratio(logp, old, cfg: PolicyLossConfig):
    """``logp - old`` with ``cfg.log_ratio_clamp`` applied, and the clamp's gradient mask (None
    without a clamp)."""
    lr = logp - old
    if cfg.log_ratio_clamp is None:
        return lr, None
    c = cfg.log_ratio_clamp
    return lr.clamp(-c, c), ((lr >= -c) & (lr <= c)).to(logp.dtype)


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


def _seg_mean(x, seq, n_seq, cnt):
    return (_seg_sum(x, seq, n_seq) / cnt.clamp(min=1.0))[seq]


def _objective(obj, cfg, a, adv_raw, logp, old, log_ratio, ratio, ti, seq, n_seq, cnt):
    """The policy term ``pg`` per token and its derivative in two parts, ``d_lw`` (through the
    log importance weight) and ``d_direct`` (through ``logp`` itself, None when 0), with what
    the objective adds to the metrics. docs/math.md §1, §10, §12."""
    zeros = torch.zeros_like(logp)
    d_direct = None
    extra = {}
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
    elif obj == "cispo":                  # detached weight, two-sided with cispo_min
        c = ratio.clamp(min=cfg.cispo_min, max=cfg.epsilon_high)
        pg, d_lw, d_direct = -c * a * logp, zeros, -c * a
    elif obj == "sapo":
        kappa = _choose(adv_raw > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg, logp)
        sg = torch.sigmoid(kappa * (ratio - 1.0))
        pg = -sg * (4.0 / kappa) * a
        d_lw = -4.0 * a * sg * (1.0 - sg) * ratio      # d/dlw of -4/k sigma(k (e^lw - 1)) a
    elif obj == "reinforce":
        pg, d_lw, d_direct = -a * logp, zeros, -a
    elif obj == "unclipped":
        pg = -a * ratio
        d_lw = pg
    elif obj == "dppo":
        c = ratio if cfg.clip_ratio_c is None else ratio.clamp(max=cfg.clip_ratio_c)
        valid = dppo_valid(logp, old, adv_raw, cfg)
        w = torch.where(valid, -c * a, zeros)
        pg, d_lw, d_direct = w * logp, zeros, w
        extra["flags"] = ((adv_raw <= 0) & ~valid, (adv_raw > 0) & ~valid)
    elif obj == "gmpo":
        sgn = torch.sign(adv_raw)
        clamped = log_ratio.clamp(-cfg.epsilon_low, cfg.epsilon_high)
        inside = (log_ratio >= -cfg.epsilon_low) & (log_ratio <= cfg.epsilon_high)
        x1, x2 = sgn * log_ratio, sgn * clamped
        # sgn * min(sgn lr, sgn clamp(lr)), its derivative in lr: ties split (torch.minimum)
        c = sgn * torch.minimum(x1, x2)
        one = torch.ones_like(logp)
        dc = torch.where(x1 < x2, one, torch.where(x1 > x2, inside.to(logp.dtype),
                                                   0.5 * (one + inside.to(logp.dtype))))
        dc = torch.where(sgn == 0, zeros, dc)
        R = torch.exp(_seg_mean(c, seq, n_seq, cnt))
        if ti.is_ratio is not None:       # verl: the sequence's geometric mean of is_ratio
            R = R * torch.exp(_seg_mean(torch.log(ti.is_ratio + 1e-10), seq, n_seq, cnt))
        pg, d_lw = -a * R, zeros
        extra["gmpo_dc"] = dc
        extra["flags"] = ((adv_raw < 0) & ~inside, (adv_raw > 0) & ~inside)
    else:   # vespo
        log_w = gamma_log_weight(log_ratio, ti.is_ratio, seq, n_seq)[seq]
        pos = adv_raw >= 0
        k = _choose(pos, cfg.vespo_k_pos, cfg.vespo_k_neg, logp)
        lam = _choose(pos, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg, logp).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        phi = phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        pg, d_lw, d_direct = -phi * a * logp, zeros, -phi * a
        extra["phi_seq_sum"] = (_seg_sum(phi, seq, n_seq) / cnt.clamp(min=1.0)).sum()
    return pg, d_lw, d_direct, extra


def dppo_valid(logp, old, adv_raw, cfg):
    """DPPO's binary trust region (verl 0.9.1 ``dppo_tv`` / ``dppo_kl``): the tokens whose
    sampled-token probability ``p`` stayed within the divergence bound of ``p_old``, one-sided
    by the sign of the advantage (A > 0: bounded above by epsilon_high; A <= 0: by
    epsilon_low)."""
    p, p_old = torch.exp(logp), torch.exp(old)
    if cfg.dppo_divergence == "tv":
        pos = (p - p_old) <= cfg.epsilon_high
        neg = (p - p_old) >= -cfg.epsilon_low
    else:
        bkl = p_old * (old - logp) + (1.0 - p_old) * torch.log((1.0 - p_old + 1e-8)
                                                               / (1.0 - p + 1e-8))
        pos = (bkl <= cfg.epsilon_high) | (p <= p_old)
        neg = (bkl <= cfg.epsilon_low) | (p >= p_old)
    return torch.where(adv_raw > 0, pos, neg)


def loss_terms(logp, entropy, ti: TokenInputs, cfg: PolicyLossConfig,
               phase: Optional[str]) -> LossTerms:
    """The loss of docs/math.md §1-§3, §10 and §12 over masked tokens (1-d), its derivative in
    ``logp`` and in the entropy, with the aggregation weights applied.

    The policy term is a function of the log importance weight ``lw`` (the token's
    ``logp - old`` or its sequence's mean) and, for cispo, vespo, reinforce and dppo, of
    ``logp`` directly; its derivative is kept in those two parts, ``d_lw`` and ``d_direct``.
    At sequence level ``dL/dlogp_s = d_direct_s + (1 / n_b) sum_{t in b} d_lw_t`` (the mean's
    derivative), which is why a sequence-level loss needs its whole sequence before any
    gradient; verl's ``sequence_token`` form takes each token's own ``d_lw`` instead.
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
    raw_log_ratio = logp - old
    log_ratio, lr_in = clamped_log_ratio(logp, old, cfg)    # lr_in: the clamp's gradient mask
    level = cfg.importance_sampling_level
    st_in = None                          # sequence_token: log s clamped at 10 above (verl)
    if level == "token":
        lw = log_ratio
    else:
        lw = _seg_mean(log_ratio, seq, n_seq, cnt)
        if level == "sequence_token":
            st_in = (lw <= 10.0).to(logp.dtype)
            lw = lw.clamp(max=10.0)
    ratio = torch.exp(lw)

    obj = cfg.objective
    pg, d_lw, d_direct, extra = _objective(obj, cfg, a, adv_raw, logp, old, log_ratio, ratio,
                                           ti, seq, n_seq, cnt)
    # per-token terms of the policy term beside the objective: verl dro's squared log-ratio,
    # KL-Cov's |log-ratio| on its selected tokens (derivatives in the log-ratio)
    pen, d_pen = None, None
    if cfg.log_ratio_penalty != 0.0:
        pen = 0.5 * cfg.log_ratio_penalty * log_ratio * log_ratio
        d_pen = cfg.log_ratio_penalty * log_ratio
    if cfg.cov_mode == "kl":
        sel = ti.cov_sel
        kc = torch.where(sel, cfg.cov_kl_coef * log_ratio.abs(), zeros)
        dkc = torch.where(sel, cfg.cov_kl_coef * torch.sign(log_ratio), zeros)
        pen, d_pen = (kc, dkc) if pen is None else (pen + kc, d_pen + dkc)
    if pen is not None and active is not None:
        pen, d_pen = torch.where(active, pen, zeros), torch.where(active, d_pen, zeros)
    if ti.is_ratio is not None and obj not in ("vespo", "gmpo"):
        pg, d_lw = pg * ti.is_ratio, d_lw * ti.is_ratio
        d_direct = None if d_direct is None else d_direct * ti.is_ratio
        if pen is not None:
            pen, d_pen = pen * ti.is_ratio, d_pen * ti.is_ratio

    # the policy term's masks (§10, §12)
    keep = None
    dropped = None
    if cfg.off_policy_mask_threshold is not None:
        sampling = old if ti.sampling is None else ti.sampling
        drift = torch.nan_to_num(sampling - logp, nan=0.0)
        mean = _seg_mean(drift, seq, n_seq, cnt)
        keep = (adv_raw >= 0) | (mean <= cfg.off_policy_mask_threshold)
        dropped = ~keep
    if ti.emask is not None:
        keep = ti.emask if keep is None else keep & ti.emask
    if cfg.cov_mode == "clip":
        keep = ~ti.cov_sel if keep is None else keep & ~ti.cov_sel
    if keep is not None:
        pg, d_lw = torch.where(keep, pg, zeros), torch.where(keep, d_lw, zeros)
        d_direct = None if d_direct is None else torch.where(keep, d_direct, zeros)
        if pen is not None:
            pen, d_pen = torch.where(keep, pen, zeros), torch.where(keep, d_pen, zeros)

    wpg = ti.w_pg * pg
    loss_sum = wpg.sum()
    g_lw = ti.w_pg * d_lw
    g = zeros if d_direct is None else ti.w_pg * d_direct
    g_tok = None                          # through each token's own (clamped) log-ratio
    if pen is not None:
        loss_sum = loss_sum + (ti.w_pg * pen).sum()
        g_tok = ti.w_pg * d_pen
    if obj == "gmpo":                     # d/dlr_s of sum_t w_t pg_t = (that sum) * c'_s / n_b
        gm = _seg_mean(wpg, seq, n_seq, cnt) * extra["gmpo_dc"]
        g_tok = gm if g_tok is None else g_tok + gm
    kl = None
    if cfg.kl_coef != 0.0:
        st = 1.0 if cfg.kl_estimator.endswith("+") else None
        if cfg.kl_unbiased_gradient:      # OpenRLHF: w = min(r, 10), detached
            st = torch.exp(raw_log_ratio).clamp(max=10.0)
        kl, dk = kl_value_and_grad(logp, ti.ref, cfg.kl_estimator, cfg.kl_clamp,
                                   cfg.kl_log_ratio_clamp, st)
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
    if level == "sequence":
        g_lw = _seg_mean(g_lw, seq, n_seq, cnt)
    elif st_in is not None:
        g_lw = g_lw * st_in
    if g_tok is not None:
        g_lw = g_lw + g_tok
    g = g + (g_lw if lr_in is None else g_lw * lr_in)
    gH = None
    if cfg.entropy_coef != 0.0:
        on = active
        if ti.emask is not None:
            on = ti.emask if on is None else on & ti.emask
        gH = -cfg.entropy_coef * ti.w_ent
        if on is not None:
            gH = torch.where(on, gH, zeros)
        loss_sum = loss_sum + (gH * entropy).sum()
    flags = extra.get("flags")
    clip_seq = (None, None)
    if level != "token":                # TRL's clip fractions count sequences at this level
        clip_seq = tuple((_seg_sum(f.to(logp.dtype), seq, n_seq) > 0).sum().to(logp.dtype)
                         for f in clip_flags(a, ratio, cfg))
    terms = TokenTerms(ratio, a, ar, p_old, kl, ti.emask, dropped, extra.get("phi_seq_sum"),
                       *clip_seq, *(flags or (None, None)), ti.cov_sel, raw_log_ratio)
    return LossTerms(loss_sum, g, gH, terms)


def clip_flags(a, r, cfg: PolicyLossConfig, terms: Optional[TokenTerms] = None):
    """Tokens outside the objective's hard clip range, (low, high): ppo_clip's
    ``[1 - epsilon_low, 1 + epsilon_high]`` (on ``min(r, delta)``, as TRL), cispo's cap
    ``epsilon_high`` (A > 0) and ``cispo_min`` (A < 0); dppo's trust region and gmpo's log-ratio
    clip come with ``terms`` (``flag_low``/``flag_high``); the others have none."""
    if terms is not None and terms.flag_low is not None:
        return terms.flag_low, terms.flag_high
    if cfg.objective == "ppo_clip":
        rc = r if cfg.delta is None else r.clamp(max=cfg.delta)
        return (a < 0) & (rc < 1.0 - cfg.epsilon_low), (a > 0) & (rc > 1.0 + cfg.epsilon_high)
    none = torch.zeros_like(r, dtype=torch.bool)
    if cfg.objective == "cispo":
        low = none if cfg.cispo_min is None else (a < 0) & (r < cfg.cispo_min)
        return low, (a > 0) & (r > cfg.epsilon_high)
    return none, none


class Norms(NamedTuple):
    """The batch normalisers of a call: ``items`` (``num_items_in_batch``, token-mean's count)
    and ``seqs`` (``num_seqs_in_batch``, the sequence modes' count); None: this call's own."""

    items: object = None
    seqs: object = None


def _count(value, dtype, device):
    return torch.as_tensor(value, dtype=dtype, device=device)


def aggregation_weights(mask: torch.Tensor, agg: str, cfg: PolicyLossConfig, norms,
                        dtype=torch.float32) -> torch.Tensor:
    """w[b, t] such that the aggregated term is sum(w * l) (docs/math.md §1, loss_agg). ``norms``
    (:class:`Norms` or None) replaces the token count of token-mean (default: ``cfg.token_count``,
    else the mask's tokens) and the sequence count B of the sequence modes (default by
    ``cfg.seq_count``: every row, or the rows with a masked-in token). No host sync."""
    norms = norms or Norms()
    m = mask.to(dtype)
    if agg == "token-mean":
        if norms.items is not None:
            return m / _count(norms.items, dtype, mask.device)
        if cfg.token_count is not None:
            return m / cfg.token_count
        return m / m.sum().clamp(min=1.0)
    if norms.seqs is not None:
        B = _count(norms.seqs, dtype, mask.device)
    elif cfg.seq_count == "nonempty":
        B = mask.any(-1).sum().to(dtype).clamp(min=1.0)
    else:
        B = mask.shape[0]
    if agg == "seq-mean-token-mean":
        return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * B)
    if agg == "seq-mean-token-sum":
        return m / B
    return m / (B * cfg.max_len)   # seq-mean-token-sum-norm


def own_norms(norms, cfg: PolicyLossConfig):
    """The normalisers of a term with its own aggregation: this call's (TRL), or the batch's
    when ``cfg.normalise_all_terms`` (verl's global_batch_info enters every term)."""
    return norms if cfg.normalise_all_terms else None


def term_weights(mask, cfg: PolicyLossConfig, norms, dtype, emask=None):
    """Aggregation weights [B, T] of the policy, KL and entropy terms. A term without an
    aggregation of its own shares the policy term's; one with its own is normalised over the
    tokens it acts on (the mask; for the entropy bonus also the entropy quantile ``emask``),
    without the batch normalisers unless ``cfg.normalise_all_terms``."""
    w_pg = aggregation_weights(mask, cfg.loss_agg, cfg, norms, dtype)
    own = own_norms(norms, cfg)
    w_kl = w_pg if cfg.kl_agg is None else aggregation_weights(mask, cfg.kl_agg, cfg, own, dtype)
    w_ent = w_pg
    if cfg.entropy_agg is not None:
        w_ent = aggregation_weights(mask if emask is None else emask, cfg.entropy_agg, cfg, own,
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
    flag_low, flag_high = clip_flags(a, r, cfg, terms)
    low = terms.p_old < cfg.metric_eta
    # the per-token means: one stacked sum and one division (a launch or two, not two each)
    # the native token kernels return the token ratio exp(logp - old) only
    log_ratio = terms.log_ratio if terms.log_ratio is not None else torch.log(r)
    means = {"clip_frac_low": flag_low, "clip_frac_high": flag_high, "ratio_mean": r,
             "log_ratio_mean": log_ratio, "ar_weight_mean": terms.ar, "low_frac": low}
    if terms.kl is not None:
        means["kl"] = terms.kl
    if entropy is not None:
        means["entropy"] = entropy
    if cfg.entropy_quantile_on:
        means["entropy_mask_frac"] = terms.emask
    if cfg.off_policy_mask_threshold is not None and terms.dropped is not None:
        means["off_policy_frac"] = terms.dropped
    if cfg.cov_mode is not None:
        means["cov_frac"] = terms.cov_sel
    rows = torch.stack([v.reshape(-1).to(torch.float32) for v in means.values()])
    out = dict(zip(means, (rows.sum(1) / n).unbind(0)))
    if cfg.importance_sampling_level != "token":
        zero = torch.zeros((), device=r.device)
        for name, count in (("clip_frac_low_seq", terms.clip_seq_low),
                            ("clip_frac_high_seq", terms.clip_seq_high)):
            out[name] = (zero if count is None else count) / max(n_seq_total, 1)
    if cfg.objective == "vespo":
        phi = terms.phi_seq_sum if terms.phi_seq_sum is not None else torch.zeros(())
        empty = n_seq_total - n_seq_nonempty
        out["phi_mean"] = (phi + empty) / max(n_seq_total, 1)
    if cfg.entropy_quantile_on:
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
    keys = ["clip_frac_low", "clip_frac_high", "ratio_mean", "log_ratio_mean", "ar_weight_mean",
            "low_frac", "grad_share_low", "grad_norm_sum"]
    if cfg.kl_coef != 0.0:
        keys.append("kl")
    if cfg.wants_entropy:
        keys.append("entropy")
    if cfg.entropy_quantile_on:
        keys += ["entropy_mask_frac", "entropy_top_mean"]
    if cfg.importance_sampling_level != "token":
        keys += ["clip_frac_low_seq", "clip_frac_high_seq"]
    if cfg.off_policy_mask_threshold is not None:
        keys.append("off_policy_frac")
    if cfg.cov_mode is not None:
        keys.append("cov_frac")
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
