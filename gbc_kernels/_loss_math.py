"""The per-token GRPO policy-loss math (docs/math.md §1-§3, §10, §12) in PyTorch, with its
analytic derivative: :func:`loss_terms` composes the entries of :mod:`gbc_kernels.objectives`
(ratio level, objective, token terms, masks, KL form) and the aggregation weights.

Every backend calls this once per chunk of tokens (the Triton and C++ backends carry their own
copies of the token-local PPO formulas, each tested against ``gbc_reference``). Inputs are 1-d
over the masked tokens. For each token the result holds the loss term ``l`` and
``dl/dlogp`` (``dl/dH`` is the constant ``-entropy_coef`` on active tokens); ties follow
PyTorch's autograd conventions, so the result equals autograd on the reference formulas
(``tests/objectives/`` holds each entry and the composition to that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .config import PolicyLossConfig
from .objectives import (COV_MODES, OBJECTIVES, RATIO_LEVELS, Tokens, _seg_mean, _seg_sum,
                         clamped_log_ratio, kl_term, native_ok, token_terms)


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
    ``cfg.needs_sequence``; ``emask``: the entropy-quantile mask, when ``cfg.needs_batch``.
    ``sp``: the sequence-parallel group (``sequence_parallel._Group``; None: off); then ``seq``
    are the row ids ``0 .. B - 1`` (the same sequences on every rank) and ``cnt`` each row's
    masked-in tokens over the group's ranks."""

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
    sp: object = None                         # sequence parallel (None: off)
    cnt: Optional[torch.Tensor] = None        # [B] tokens per sequence over the group (sp)

    _PER_TOKEN = ("adv", "old", "ref", "tscale", "klw", "is_ratio", "sampling", "w_pg", "w_kl",
                  "w_ent", "emask", "cov_sel", "itemp")

    def _select(self, sel, seq, n_seq) -> "TokenInputs":
        """The per-token fields indexed by ``sel`` (a slice or an index tensor)."""
        kw = {f: None if getattr(self, f) is None else getattr(self, f)[sel]
              for f in self._PER_TOKEN}
        return TokenInputs(**kw, seq=seq, n_seq=n_seq, norms=self.norms, sp=self.sp)

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
        return (native_ok(cfg) and not cfg.needs_sequence and not cfg.needs_batch
                and self.is_ratio is None and cfg.kl_agg is None and cfg.entropy_agg is None
                and cfg.log_ratio_clamp is None and self.itemp is None)


@dataclass
class LossTerms:
    """What :func:`loss_terms` returns: the weighted loss and its derivatives, and the metric
    inputs."""

    loss_sum: torch.Tensor      # sum over tokens of the aggregation-weighted loss (0-d)
    g: torch.Tensor             # dL/dlogp per token
    gH: Optional[torch.Tensor]  # dL/dH per token (None without entropy bonus)
    terms: TokenTerms


def local_ids(ids: torch.Tensor, with_lengths: bool = False):
    """Non-decreasing ids -> (the ids renumbered 0 .. n - 1, n), and with ``with_lengths`` the
    count of each id as a list. One host sync (the counts)."""
    if ids.numel() == 0:
        return (ids, 0, []) if with_lengths else (ids, 0)
    _, inverse, counts = torch.unique_consecutive(ids, return_inverse=True, return_counts=True)
    lengths = counts.tolist()
    return (inverse, len(lengths), lengths) if with_lengths else (inverse, len(lengths))


def per_token_is_ratio(is_ratio, mask, cfg: PolicyLossConfig, sp=None):
    """The importance ratio as the loss takes it, ``[B, T]``: a per-token one as it is; a
    per-sequence ``[B, 1]`` one multiplies each token of its sequence (broadcast), except under
    an objective that takes it once per sequence (``is_ratio_once``: vespo, whose sequence
    weight adds ``Σ_t log r_t`` over the masked tokens): there the ratio goes whole on the
    sequence's first masked-in token and 1 (``log 1 = 0``) on the others (TRL's
    ``sequence_*`` modes). ``sp`` (sequence parallel): on the first masked-in token of the lowest
    rank holding tokens of the sequence (one token of the whole sequence)."""
    if is_ratio is None or (is_ratio.shape[-1] == mask.shape[-1]
                            and (sp is None or is_ratio.shape[-1] != 1)):
        return is_ratio         # split sequences: [B, 1] per sequence even where T_r = 1
    if not OBJECTIVES[cfg.objective].is_ratio_once:
        return is_ratio.expand(mask.shape)
    first = mask.int().argmax(dim=-1, keepdim=True)        # 0 for an empty row: masked out
    ones = torch.ones(mask.shape, dtype=is_ratio.dtype, device=is_ratio.device)
    once = ones.clone().scatter_(1, first, is_ratio)
    return once if sp is None else torch.where(sp.first_owner(mask)[:, None], once, ones)


def _where(cond, t):
    return None if t is None else torch.where(cond, t, 0.0)


def _times(t, w):
    return None if t is None else t * w


def _ratio_level(logp, ti: TokenInputs, cfg: PolicyLossConfig, phase):
    """A-hat (AR, token_scale, the Lopti phase's mask ``active``), the log-ratios and the
    importance weight of the ratio level: the objective's :class:`Tokens`, and ``back`` (dL/dlw
    -> dL/dlog_ratio) and ``lr_in`` (log_ratio_clamp's gradient mask)."""
    old = logp if ti.old is None else ti.old
    p_old = torch.exp(old)
    ar = cfg.ar_alpha * p_old + (1.0 - cfg.ar_alpha) if cfg.ar_alpha != 0.0 \
        else torch.ones_like(p_old)
    a = ti.adv * ar
    if ti.tscale is not None:
        a = a * ti.tscale
    active = None
    if phase is not None:
        low = p_old < cfg.lopti_eta
        active = low if phase == "low" else ~low
        a = torch.where(active, a, 0.0)
    cnt = None
    if cfg.needs_sequence:
        cnt = ti.cnt.to(logp.dtype) if ti.cnt is not None else \
            _seg_sum(torch.ones_like(logp), ti.seq, ti.n_seq, ti.sp)
    log_ratio, lr_in = clamped_log_ratio(logp, old, cfg)
    lw, back = RATIO_LEVELS[cfg.importance_sampling_level].fn(log_ratio, ti.seq, ti.n_seq, cnt,
                                                              ti.sp)
    x = Tokens(a, ti.adv, logp, old, log_ratio, torch.exp(lw), ti.is_ratio, ti.seq, ti.n_seq,
               cnt, ti.sp)
    return x, ar, p_old, active, back, lr_in


def _policy_mask(x: Tokens, ti: TokenInputs, cfg: PolicyLossConfig):
    """The tokens the policy term keeps (None: all), §10 §12: the off-policy sequence mask, the
    entropy quantile, Clip-Cov's dropped tokens; and those the off-policy mask dropped."""
    keep = dropped = None
    if cfg.off_policy_mask_threshold is not None:
        sampling = x.old if ti.sampling is None else ti.sampling
        drift = torch.nan_to_num(sampling - x.logp, nan=0.0)
        mean = _seg_mean(drift, x.seq, x.n_seq, x.cnt, x.sp)
        keep = (x.adv >= 0) | (mean <= cfg.off_policy_mask_threshold)
        dropped = ~keep
    if ti.emask is not None:
        keep = ti.emask if keep is None else keep & ti.emask
    if cfg.cov_mode is not None and COV_MODES[cfg.cov_mode].drops:
        keep = ~ti.cov_sel if keep is None else keep & ~ti.cov_sel
    return keep, dropped


def _kl(logp, x: Tokens, ti: TokenInputs, cfg: PolicyLossConfig, active):
    """The KL term's value per token and its weighted derivatives: (kl, wk, wk dk, wk dk/dlw
    or None), ``wk`` the KL's aggregation weight times ``kl_coef`` and ``kl_weight``."""
    kl, dk, kl_lw = kl_term(logp, ti.ref, x.old, x.ratio, cfg)
    if ti.klw is not None:
        kl, dk = kl * ti.klw, dk * ti.klw
        kl_lw = None if kl_lw is None else kl_lw * ti.klw
    wk = ti.w_kl * cfg.kl_coef
    if active is not None:
        wk = torch.where(active, wk, 0.0)
    return kl, wk, wk * dk, None if kl_lw is None else wk * kl_lw


def _entropy(ti: TokenInputs, cfg: PolicyLossConfig, active):
    """dL/dH per token (None without entropy bonus): on the phase's and the quantile's
    tokens."""
    if cfg.entropy_coef == 0.0:
        return None
    on = active
    if ti.emask is not None:
        on = ti.emask if on is None else on & ti.emask
    gH = -cfg.entropy_coef * ti.w_ent
    return gH if on is None else torch.where(on, gH, 0.0)


def _metric_inputs(x: Tokens, out, ar, p_old, kl, ti, dropped, cfg) -> TokenTerms:
    clip_seq = (None, None)
    if RATIO_LEVELS[cfg.importance_sampling_level].needs_sequence:   # TRL counts sequences
        dt = x.logp.dtype
        lo, hi = clip_flags(x.a, x.ratio, cfg)   # one reduction for both (split sequences)
        flagged = _seg_sum(torch.stack([lo, hi], 1).to(dt), x.seq, x.n_seq, x.sp) > 0
        clip_seq = tuple(flagged.sum(0).to(dt).unbind(0))
    return TokenTerms(x.ratio, x.a, ar, p_old, kl, ti.emask, dropped, out.phi_seq_sum,
                      *clip_seq, *(out.flags or (None, None)), ti.cov_sel, x.logp - x.old)


def loss_terms(logp, entropy, ti: TokenInputs, cfg: PolicyLossConfig,
               phase: Optional[str]) -> LossTerms:
    """The loss of docs/math.md §1-§3, §10 and §12 over masked tokens (1-d), its derivative in
    ``logp`` and in the entropy, with the aggregation weights applied: ratio level ->
    objective (:data:`OBJECTIVES`) and token terms -> masks -> terms -> aggregation.

    The policy term is a function of the log importance weight ``lw`` (the token's
    ``logp - old`` or its sequence's mean) and of ``logp`` directly; its derivative is kept in
    those two parts (``d_lw``, ``d_direct``) and taken back to ``logp`` by the level's
    ``back``: at sequence level ``dL/dlogp_s = d_direct_s + (1 / n_b) sum_{t in b} d_lw_t``,
    which is why a sequence-level loss needs its whole sequence before any gradient.
    """
    x, ar, p_old, active, back, lr_in = _ratio_level(logp, ti, cfg, phase)
    obj = OBJECTIVES[cfg.objective]
    out = obj.fn(cfg, x)
    pg, d_lw, d_direct = out.pg, out.d_lw, out.d_direct
    pen, d_pen = token_terms(x.log_ratio, cfg, ti.cov_sel)   # derivatives in the log-ratio
    if pen is not None and active is not None:
        pen, d_pen = _where(active, pen), _where(active, d_pen)
    if ti.is_ratio is not None and obj.weights_is_ratio:
        pg, d_lw, d_direct, pen, d_pen = (_times(t, ti.is_ratio)
                                          for t in (pg, d_lw, d_direct, pen, d_pen))
    keep, dropped = _policy_mask(x, ti, cfg)
    if keep is not None:
        pg, d_lw, d_direct, pen, d_pen = (_where(keep, t) for t in (pg, d_lw, d_direct, pen, d_pen))

    wpg = ti.w_pg * pg
    loss_sum = wpg.sum()
    g_lw = ti.w_pg * d_lw
    g = torch.zeros_like(logp) if d_direct is None else ti.w_pg * d_direct
    g_tok = None                          # through each token's own (clamped) log-ratio
    if pen is not None:
        loss_sum = loss_sum + (ti.w_pg * pen).sum()
        g_tok = ti.w_pg * d_pen
    if out.d_seq is not None:             # d/dlr_s sum_t w_t pg_t = mean_b(w pg) * d_seq_s
        gm = _seg_mean(wpg, x.seq, x.n_seq, x.cnt, x.sp) * out.d_seq
        g_tok = gm if g_tok is None else g_tok + gm
    kl = None
    if cfg.kl_coef != 0.0:
        kl, wk, g_kl, g_kl_lw = _kl(logp, x, ti, cfg, active)
        loss_sum = loss_sum + (wk * kl).sum()
        g = g + g_kl
        if g_kl_lw is not None:
            g_lw = g_lw + g_kl_lw
    g_lw = back(g_lw)
    if g_tok is not None:
        g_lw = g_lw + g_tok
    g = g + (g_lw if lr_in is None else g_lw * lr_in)
    gH = _entropy(ti, cfg, active)
    if gH is not None:
        loss_sum = loss_sum + (gH * entropy).sum()
    terms = _metric_inputs(x, out, ar, p_old, kl, ti, dropped, cfg)
    return LossTerms(loss_sum, g, gH, terms)


def clip_flags(a, r, cfg: PolicyLossConfig, terms: Optional[TokenTerms] = None):
    """Tokens outside the objective's hard clip range, (low, high): the objective's
    ``clip_flags`` (ppo_clip's ``[1 - epsilon_low, 1 + epsilon_high]`` on ``min(r, delta)``, as
    TRL; cispo's cap ``epsilon_high`` (A > 0) and ``cispo_min`` (A < 0)); dppo's trust region and
    gmpo's log-ratio clip come with ``terms`` (``flag_low``/``flag_high``); the others have
    none."""
    if terms is not None and terms.flag_low is not None:
        return terms.flag_low, terms.flag_high
    return OBJECTIVES[cfg.objective].clip_flags(a, r, cfg)


class Norms(NamedTuple):
    """The batch normalisers of a call: ``items`` (``num_items_in_batch``, token-mean's count)
    and ``seqs`` (``num_seqs_in_batch``, the sequence modes' count); None: this call's own."""

    items: object = None
    seqs: object = None


def _count(value, dtype, device):
    return torch.as_tensor(value, dtype=dtype, device=device)


def aggregation_weights(mask: torch.Tensor, agg: str, cfg: PolicyLossConfig, norms,
                        dtype=torch.float32, sp=None) -> torch.Tensor:
    """w[b, t] such that the aggregated term is sum(w * l) (docs/math.md §1, loss_agg). ``norms``
    (:class:`Norms` or None) replaces the token count of token-mean (default: ``cfg.token_count``,
    else the mask's tokens) and the sequence count B of the sequence modes (default by
    ``cfg.seq_count``: every row, or the rows with a masked-in token). ``sp`` (sequence
    parallel): the counts taken from the mask are summed over the group's ranks (the tokens of
    the whole sequences). No host sync."""
    norms = norms or Norms()
    m = mask.to(dtype)

    def row_counts():                     # tokens per sequence, [B, 1]
        rows = m.sum(-1, keepdim=True)
        return rows if sp is None else sp.sum(rows)

    if agg == "token-mean":
        if norms.items is not None:
            return m / _count(norms.items, dtype, mask.device)
        if cfg.token_count is not None:
            return m / cfg.token_count
        total = m.sum()
        return m / (total if sp is None else sp.sum(total)).clamp(min=1.0)
    rows = row_counts() if agg == "seq-mean-token-mean" or (
        norms.seqs is None and cfg.seq_count == "nonempty" and sp is not None) else None
    if norms.seqs is not None:
        B = _count(norms.seqs, dtype, mask.device)
    elif cfg.seq_count == "nonempty":
        nonempty = mask.any(-1) if sp is None else rows.squeeze(-1) > 0
        B = nonempty.sum().to(dtype).clamp(min=1.0)
    else:
        B = mask.shape[0]
    if agg == "seq-mean-token-mean":
        return m / (rows.clamp(min=1.0) * B)
    if agg == "seq-mean-token-sum":
        return m / B
    return m / (B * cfg.max_len)   # seq-mean-token-sum-norm


def own_norms(norms, cfg: PolicyLossConfig):
    """The normalisers of a term with its own aggregation: this call's (TRL), or the batch's
    when ``cfg.normalise_all_terms`` (verl's global_batch_info enters every term)."""
    return norms if cfg.normalise_all_terms else None


def term_weights(mask, cfg: PolicyLossConfig, norms, dtype, emask=None, sp=None):
    """Aggregation weights [B, T] of the policy, KL and entropy terms. A term without an
    aggregation of its own shares the policy term's; one with its own is normalised over the
    tokens it acts on (the mask; for the entropy bonus also the entropy quantile ``emask``),
    without the batch normalisers unless ``cfg.normalise_all_terms``. ``sp``: see
    :func:`aggregation_weights`."""
    w_pg = aggregation_weights(mask, cfg.loss_agg, cfg, norms, dtype, sp)
    own = own_norms(norms, cfg)
    w_kl = w_pg if cfg.kl_agg is None else aggregation_weights(mask, cfg.kl_agg, cfg, own, dtype,
                                                               sp)
    w_ent = w_pg
    if cfg.entropy_agg is not None:
        w_ent = aggregation_weights(mask if emask is None else emask, cfg.entropy_agg, cfg, own,
                                    dtype, sp)
    return w_pg, w_kl, w_ent


def logp_grad_norm(g, logp, sum_p2, inv_temp):
    """docs/math.md §6: the norm of the logp part of dL/dz per token,
    |g| / tau * ||onehot - p||, with ||onehot - p||^2 = 1 - 2 p + sum_v p_v^2."""
    p = torch.exp(logp)
    return g.abs() * inv_temp * (1.0 - 2.0 * p + sum_p2).clamp(min=0.0).sqrt()


def policy_metrics(terms: TokenTerms, cfg: PolicyLossConfig, entropy=None, grad_norm=None,
                   n_seq_total: int = 0, n_seq_nonempty=None, sp=None) -> dict:
    """docs/math.md §7 metrics: detached 0-d float32 tensors, means over the masked tokens
    (``terms`` holds those only).

    ``grad_norm`` is the per-token norm of §6 (None: ``grad_share_low`` is not reported).
    ``n_seq_total`` (B) and ``n_seq_nonempty`` give vespo's ``phi_mean`` over all B sequences
    (a sequence without tokens has phi = 1). ``sp`` (sequence parallel): the token sums are
    summed over the group's ranks (one all_reduce), so every rank reports the whole batch's
    metrics; the sequence counts in ``terms`` are the group's already.
    """
    def masked_sum(x):
        return x.float().sum()

    a, r = terms.adv, terms.ratio
    # no host-to-device copy; split sequences: this rank's count, summed below
    n = torch.full((), float(r.numel() if sp is not None else max(r.numel(), 1)),
                   device=r.device)
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
    sums = [rows.sum(1)]
    if cfg.entropy_quantile_on:       # entropy_top_mean's two sums
        em = terms.emask
        sums.append(torch.stack([masked_sum(torch.where(em, entropy, torch.zeros_like(entropy))),
                                 masked_sum(em)]))
    if grad_norm is not None:         # grad_share_low's two sums
        gn = grad_norm.float()
        sums.append(torch.stack([gn, torch.where(low, gn, torch.zeros_like(gn))]).sum(1))
    if sp is not None:                # the group's tokens: one reduction of every sum
        sums = list(sp.sum(torch.cat(sums + [n.reshape(1)])).detach()
                    .split([len(x) for x in sums] + [1]))
        n = sums.pop().reshape(()).clamp(min=1.0)
    out = dict(zip(means, (sums[0] / n).unbind(0)))
    if cfg.importance_sampling_level != "token":
        zero = torch.zeros((), device=r.device)
        for name, count in (("clip_frac_low_seq", terms.clip_seq_low),
                            ("clip_frac_high_seq", terms.clip_seq_high)):
            out[name] = (zero if count is None else count) / max(n_seq_total, 1)
    if OBJECTIVES[cfg.objective].reports_phi_mean:
        phi = terms.phi_seq_sum if terms.phi_seq_sum is not None else torch.zeros(())
        empty = n_seq_total - n_seq_nonempty
        out["phi_mean"] = (phi + empty) / max(n_seq_total, 1)
    k = 1
    if cfg.entropy_quantile_on:
        top, kept = sums[k].unbind(0)
        out["entropy_top_mean"] = top / kept.clamp(min=1.0)
        k += 1
    if cfg.off_policy_mask_threshold is not None and terms.dropped is None:
        out["off_policy_frac"] = torch.zeros((), device=r.device)
    if grad_norm is not None:
        total, share = sums[k].unbind(0)
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
    if OBJECTIVES[cfg.objective].reports_phi_mean:
        out["phi_mean"] = z + (1.0 if n_seq_total else 0.0)
    return out


def certainty_from_stats(kind, entropy, zmax, lse, vocab):
    """docs/math.md §5: J_entropy = 1 - H / log V, J_max_prob = 1 + (max z - LSE) / log V."""
    log_v = math.log(vocab) if vocab > 1 else 1.0
    if kind == "entropy":
        return 1.0 - entropy / log_v
    return 1.0 + (zmax - lse) / log_v
