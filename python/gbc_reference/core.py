"""The math of docs/math.md, written plainly: full logits, log_softmax, autograd.

Section numbers (§) are those of ``docs/math.md``. Float64 inputs are computed
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
    # the counts when the call passes no num_items_in_batch / num_seqs_in_batch (§1)
    token_count: Optional[float] = None        # token-mean's N_tok (None: the mask's tokens)
    seq_count: str = "rows"                    # B: "rows" (every row) | "nonempty" (verl's)
    temperature: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_ratio_correction: bool = False     # kl *= r (TRL's use_bias_correction_kl)
    entropy_coef: float = 0.0
    ar_alpha: float = 0.0
    lopti_eta: Optional[float] = None
    # §10: the objectives of today's trainers
    importance_sampling_level: str = "token"   # "token" | "sequence" (GSPO)
    objective: str = "ppo_clip"                # "ppo_clip" | "cispo" | "sapo" | "vespo"
    delta: Optional[float] = None              # two-sided clip of ppo_clip
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: Optional[float] = None
    kl_agg: Optional[str] = None               # None: aggregated with the policy term
    entropy_agg: Optional[str] = None
    return_entropy: bool = False               # the entropy metric without an entropy term
    logit_softcap: Optional[float] = None      # Gemma-2/3: logits = c tanh(x / c)
    logits_dtype: Optional[object] = None      # None | torch.float32 | "input": see _logits
    # §12: the objectives of verl, OpenRLHF and the other trainers
    cispo_min: Optional[float] = None          # cispo's weight clamp(r, cispo_min, eps_high)
    dppo_divergence: str = "tv"                # "tv" | "binary_kl"
    log_ratio_clamp: Optional[float] = None    # logp - old_logp clamped to +-c per token
    log_ratio_penalty: float = 0.0             # + beta/2 (logp - old_logp)^2 (verl dro)
    kl_clamp: Optional[float] = None           # the KL value clamped to +-c (OpenRLHF: 10)
    kl_log_ratio_clamp: Optional[float] = None # ref_logp - logp clamped to +-c first (NeMo-RL)
    kl_unbiased_gradient: bool = False         # OpenRLHF's straight-through IS-weighted k2 grad
    cov_mode: Optional[str] = None             # "clip" (Clip-Cov) | "kl" (KL-Cov)
    cov_ratio: float = 2e-4
    cov_lb: float = 1.0
    cov_ub: float = 5.0
    cov_kl_coef: float = 0.1
    normalise_all_terms: bool = False          # num_items / num_seqs normalise every term

    @classmethod
    def preset(cls, loss_type, **options):
        """TRL's loss_type as a config (see gbc_kernels.config.TRL_LOSS_TYPES)."""
        if ":" in loss_type:      # another trainer's names (gbc_kernels.config.TRAINER_PRESETS)
            from gbc_kernels.config import TRAINER_PRESETS
            d = dict(TRAINER_PRESETS[loss_type])
        else:
            d = dict(_TRL_LOSS_TYPES[loss_type], entropy_agg="token-mean")
        d.update(options)
        return cls(**d)


_TRL_LOSS_TYPES = {
    "grpo": dict(loss_agg="seq-mean-token-mean"),
    "bnpo": dict(loss_agg="token-mean"),
    "dr_grpo": dict(loss_agg="seq-mean-token-sum-norm"),
    "dapo": dict(loss_agg="token-mean"),
    "cispo": dict(objective="cispo", loss_agg="token-mean"),
    "sapo": dict(objective="sapo", loss_agg="seq-mean-token-mean"),
    "luspo": dict(loss_agg="seq-mean-token-sum"),
    "vespo": dict(objective="vespo", loss_agg="token-mean"),
}

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


def _per_token_temperature(temperature, shape):
    """A float as it is; a tensor of ``shape`` or a leading part of it (``[B]`` for ``[B, T]``)
    or with 1s (``[B, 1]``), broadcast to ``shape``."""
    if not isinstance(temperature, torch.Tensor):
        return temperature
    t = temperature
    if t.dim() < len(shape):
        t = t.reshape(*t.shape, *([1] * (len(shape) - t.dim())))
    return t.expand(*shape)


def _cpu_flags() -> set:
    """This CPU's feature flags, from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.partition(":")[2].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


def _float32_mode(logits_dtype, hidden: torch.Tensor) -> bool:
    """Whether the logits are the float32 head's: ``logits_dtype`` torch.float32 (or the
    trainers' string "float32"); ``"input"``: no; None: per device — yes for bf16/fp16
    ``hidden`` on a CPU without matmul units for that dtype (avx512_bf16 / amx_bf16,
    avx512_fp16 / amx_fp16), no on one with them and on a GPU."""
    if isinstance(logits_dtype, str) and logits_dtype.strip().lower() == "input":
        return False
    if logits_dtype is None:
        units = {torch.bfloat16: ("avx512_bf16", "amx_bf16"),
                 torch.float16: ("avx512_fp16", "amx_fp16")}.get(hidden.dtype)
        return (hidden.device.type == "cpu" and units is not None
                and not any(f in _cpu_flags() for f in units))
    if logits_dtype is torch.float32 or str(logits_dtype).lower() in ("float32", "torch.float32"):
        return True
    raise ValueError(f"logits_dtype: expected None, torch.float32 or \"input\", "
                     f"got {logits_dtype!r}")


def _logits(hidden, weight, bias, temperature, softcap=None, logits_dtype=None):
    """z = (hidden @ weight.T + bias) / temperature, in float32 (float64 for float64 inputs).
    With final-logit soft-capping (Gemma-2/3): z = softcap * tanh(x / softcap) / temperature.
    ``temperature``: a float, or per token (a tensor over hidden's leading dims, or a leading
    part of them).

    ``logits_dtype=torch.float32`` (the "float32 head" of the fast paths): the logits are the
    exact products of the operands' own (bf16/fp16) values, so this reference evaluates them,
    and everything after them, in float64 on those same values: what float32 mode is measured
    against."""
    dt = torch.float64 if _float32_mode(logits_dtype, hidden) else _compute_dtype(hidden)
    z = hidden.to(dt) @ weight.to(dt).T
    if bias is not None:
        z = z + bias.to(dt)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        temperature = _per_token_temperature(temperature, hidden.shape[:-1]).to(dt)[..., None]
    return z / temperature


def _gather(logprobs_all, targets):
    return logprobs_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _entropy(logprobs_all):
    return -(logprobs_all.exp() * logprobs_all).sum(-1)


def support_members(support_ids, targets, V):
    """§16: the sampler's support as a ``[..., V]`` bool mask: the ids of ``support_ids``
    (``targets.shape + (k,)``, ``-1`` padding, duplicates counting once) and the target
    itself (always a member); and ``forced``: whether the target was missing from its row."""
    if support_ids.shape[:-1] != targets.shape:
        raise ValueError(f"support_ids: expected shape {list(targets.shape)} + [k], "
                         f"got {list(support_ids.shape)}")
    if bool(((support_ids < -1) | (support_ids >= V)).any()):
        raise ValueError(f"support_ids: expected ids in [-1, {V}), got one outside")
    ids = support_ids.long()
    members = torch.zeros(*targets.shape, V + 1, dtype=torch.bool, device=targets.device)
    members.scatter_(-1, torch.where(ids < 0, V, ids), True)        # -1 -> a spare column
    members = members[..., :V]
    forced = ~members.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    members.scatter_(-1, targets.long().unsqueeze(-1), True)
    return members, forced


def _over_support(z, members):
    """log q over the support (``-inf`` off it): ``z`` restricted to the members, softmaxed."""
    return torch.log_softmax(z.masked_fill(~members, float("-inf")), dim=-1)


def _entropy_on(logq, members):
    """-sum_{j in S} q_j log q_j (the terms off the support are 0, not 0 * -inf, and so are
    their gradients)."""
    logq = torch.where(members, logq, torch.zeros_like(logq))
    return -torch.where(members, logq.exp() * logq, torch.zeros_like(logq)).sum(-1)


def fused_linear_logprobs(hidden, weight, targets, bias=None, temperature=1.0,
                          return_entropy=False, backend="auto", logit_softcap=None,
                          return_sum_p2=False, logits_dtype=None, support_ids=None,
                          return_log_kept_mass=False):
    """logp[n] = log_softmax(z[n])[targets[n]]; entropy[n] = H(softmax(z[n])); with
    return_sum_p2 also sum_v p_v^2 (no gradient). Shapes [...].

    ``support_ids`` (§16): the softmax over each row's support ``S`` (the target always a
    member) instead of the vocabulary; entropy and sum_p2 over ``S`` too.
    ``return_log_kept_mass``: also ``LSE_S - LSE_V`` (no gradient; 0 without a support), the
    last output."""
    z = _logits(hidden, weight, bias, temperature, logit_softcap, logits_dtype)
    logprobs_all = torch.log_softmax(z, dim=-1)
    if support_ids is not None:
        members, _ = support_members(support_ids, targets, weight.shape[0])
        full = logprobs_all
        logprobs_all = _over_support(z, members)
        entropy = _entropy_on(logprobs_all, members) if return_entropy else None
        kept = (full.detach() - logprobs_all.detach())      # LSE_S - LSE_V at any member
        kept = _gather(kept, targets)
    else:
        entropy = _entropy(logprobs_all) if return_entropy else None
        kept = torch.zeros(targets.shape, dtype=z.dtype, device=z.device)
    logp = _gather(logprobs_all, targets)
    out = (logp, entropy)
    if return_sum_p2:
        out += ((logprobs_all.detach().exp() ** 2).sum(-1),)
    if return_log_kept_mass:
        out += (kept,)
    return out


class TokenStats(NamedTuple):
    logp: torch.Tensor
    entropy: torch.Tensor
    certainty: Optional[torch.Tensor]
    sum_p2: Optional[torch.Tensor] = None


@torch.no_grad()
def token_stats(hidden, weight, targets, bias=None, temperature=1.0, certainty=None,
                certainty_temperature=1.0, backend="auto", logit_softcap=None,
                logits_dtype=None, support_ids=None):
    """Per-token logp and entropy at ``temperature``, and the certainty J of §5 at
    ``certainty_temperature``:

        J_entropy  = 1 - H(pi) / log V
        J_max_prob = 1 + log max_v pi(v) / log V

    ``support_ids`` (§16): everything over each token's support ``S``, J normalised by
    ``log |S|`` (1 where ``|S| = 1``).
    """
    z = _logits(hidden, weight, bias, temperature, logit_softcap, logits_dtype)
    members = None
    if support_ids is not None:
        members, _ = support_members(support_ids, targets, weight.shape[0])
        logprobs_all = _over_support(z, members)
        entropy = _entropy_on(logprobs_all, members)
    else:
        logprobs_all = torch.log_softmax(z, dim=-1)
        entropy = _entropy(logprobs_all)
    logp = _gather(logprobs_all, targets)
    cert = None
    if certainty is not None:
        z_w = _logits(hidden, weight, bias, certainty_temperature, logit_softcap, logits_dtype)
        if members is None:
            lp_w, h_w = torch.log_softmax(z_w, dim=-1), None
            log_n = math.log(weight.shape[0])
        else:
            lp_w = _over_support(z_w, members)
            h_w = _entropy_on(lp_w, members)
            log_n = torch.log(members.sum(-1).clamp(min=2).to(z_w.dtype))
        if certainty == "entropy":
            cert = 1.0 - (_entropy(lp_w) if h_w is None else h_w) / log_n
        elif certainty == "max_prob":
            cert = 1.0 + lp_w.max(dim=-1).values / log_n
        else:
            raise ValueError(f"certainty: expected None, 'entropy' or 'max_prob', got {certainty!r}")
        if members is not None:
            cert = torch.where(members.sum(-1) > 1, cert, torch.ones_like(cert))
    sum_p2 = (logprobs_all.exp() ** 2).sum(-1)
    return TokenStats(logp.float(), entropy.float(), None if cert is None else cert.float(),
                      sum_p2.float())


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


def kl_penalty(logp, ref_logp, cfg, old_logp=None):
    """§1, §12: the KL term's estimator with its clamp and its gradient form, by autograd:
    ``kl_clamp`` clamps the value; a ``+`` suffix (verl) keeps the value and takes the
    gradient of k2 = (logp - ref)^2 / 2; ``kl_unbiased_gradient`` (OpenRLHF) takes the gradient
    of w (logp - ref)^2 / 2, w = min(exp(logp - old_logp), 10) detached."""
    lp = logp
    if cfg.kl_log_ratio_clamp is not None:      # delta = ref - logp clamped: logp moved inside
        c = cfg.kl_log_ratio_clamp
        lp = ref_logp - (ref_logp - logp).clamp(-c, c)
    val = kl_estimate(lp, ref_logp, cfg.kl_estimator.rstrip("+"))
    if cfg.kl_clamp is not None:
        val = val.clamp(-cfg.kl_clamp, cfg.kl_clamp)
    w = None
    if cfg.kl_estimator.endswith("+"):
        w = 1.0
    elif cfg.kl_unbiased_gradient:
        old = logp.detach() if old_logp is None else old_logp
        w = (logp - old).exp().clamp(max=10.0).detach()
    if w is None:
        return val
    surrogate = w * 0.5 * (logp - ref_logp) ** 2
    return val.detach() + surrogate - surrogate.detach()


def kl_estimate(logp, ref_logp, estimator):
    """§1 KL estimators of KL(pi || pi_ref) at the sampled token, delta = ref_logp - logp."""
    delta = ref_logp - logp
    if estimator == "abs":
        return delta.abs()
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


def gamma_weights(advantages, log_ratio, mask, is_ratio, cfg):
    """§10 VESPO: phi = exp(lambda + k log w - lambda w), w the sequence's importance weight
    exp(sum_t m clamp(logp - old_logp, +-20) [+ sum_t m clamp(log is_ratio, log 1e-8, 20)]),
    log w clamped to [log 1e-8, 20]; (k, lambda) by the sign of A (A >= 0: the _pos pair).
    No gradient: phi only scales the gradient of -A logp."""
    m = mask.bool()
    lower = math.log(1e-8)
    zero = torch.zeros_like(log_ratio)
    seq = torch.where(m, log_ratio.clamp(-20.0, 20.0), zero).sum(-1, keepdim=True)
    if is_ratio is not None:
        log_is = torch.log(is_ratio).clamp(lower, 20.0)
        if is_ratio.shape[-1] == 1:         # one ratio per sequence: it enters the weight once
            seq = seq + log_is
        else:
            seq = seq + torch.where(m, log_is, zero).sum(-1, keepdim=True)
    log_w = seq.clamp(lower, 20.0)
    pos = advantages >= 0
    k = torch.where(pos, log_w.new_tensor(cfg.vespo_k_pos), log_w.new_tensor(cfg.vespo_k_neg))
    lam = torch.where(pos, log_w.new_tensor(cfg.vespo_lambda_pos),
                      log_w.new_tensor(cfg.vespo_lambda_neg)).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).detach()


def entropy_quantile_mask(entropy, mask, quantile):
    """§10 top_entropy_quantile = q: tokens whose entropy is >= the (1 - q) quantile (linear
    interpolation, torch.quantile) of the masked tokens' entropies."""
    m = mask.bool()
    # in the entropies' own precision (float64 stays float64): a threshold rounded to float32
    # can land above the float64 entropy it equals, and drop that token
    values = entropy.detach()[m]
    if values.dtype not in (torch.float32, torch.float64):
        values = values.float()
    if values.numel() == 0:
        return torch.zeros_like(m)
    threshold = torch.quantile(values, 1.0 - quantile)
    return (entropy.detach() >= threshold.to(entropy.dtype)) & m


def off_policy_mask(advantages, logp, sampling_logp, mask, threshold):
    """§10 off-policy sequence mask (DeepSeek-V3.2): keep a token unless its advantage is < 0
    and its sequence's mean of sampling_logp - logp (NaN counted as 0) exceeds the threshold."""
    m = mask.bool()
    drift = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)
    drift = torch.where(m, drift, torch.zeros_like(drift))
    mean = drift.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    return (advantages >= 0) | (mean <= threshold)


def cov_selection(A, logp, old, mask, cfg):
    """§12 Clip-Cov / KL-Cov (verl 0.9.1 clip_cov / kl_cov): cov = (A - mean A)(logp - mean
    logp) over the masked tokens. kl: the top max(1, int(cov_ratio N)) tokens by cov. clip:
    that many drawn by torch.randperm among the tokens with cov_lb < cov < cov_ub that PPO's
    clip has not clipped (candidates in row-major order)."""
    m = mask.bool()
    sel = torch.zeros_like(m)
    n = int(m.sum())
    if n == 0:
        return sel
    a, lp = A.detach(), logp.detach()
    cov = (a - a[m].mean()) * (lp - lp[m].mean())
    k = max(int(cfg.cov_ratio * n), 1)
    if cfg.cov_mode == "kl":
        flat = m.reshape(-1).nonzero().squeeze(1)
        top = torch.topk(cov.reshape(-1)[flat], min(k, n), largest=True).indices
        sel.view(-1)[flat[top]] = True
        return sel
    lr = lp - old
    if cfg.log_ratio_clamp is not None:
        lr = lr.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    r = lr.exp()
    clipped = -a * r.clamp(1 - cfg.epsilon_low, 1 + cfg.epsilon_high) > -a * r
    cand = (m & (cov < cfg.cov_ub) & (cov > cfg.cov_lb) & ~clipped).reshape(-1).nonzero()
    cand = cand.squeeze(1)
    if cand.numel():
        cand = cand[torch.randperm(cand.numel())[:min(k, cand.numel())]]
    sel.view(-1)[cand] = True
    return sel


def dppo_valid(logp, old, A, cfg):
    """§12 DPPO's binary trust region (verl dppo_tv / dppo_kl), one-sided by the sign of A."""
    p, p_old = logp.detach().exp(), old.exp()
    if cfg.dppo_divergence == "tv":
        pos, neg = (p - p_old) <= cfg.epsilon_high, (p - p_old) >= -cfg.epsilon_low
    else:
        bkl = p_old * (old - logp.detach()) + (1 - p_old) * torch.log(
            (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        pos = (bkl <= cfg.epsilon_high) | (p <= p_old)
        neg = (bkl <= cfg.epsilon_low) | (p >= p_old)
    return torch.where(A > 0, pos, neg)


def _per_token_loss(logp, entropy, mask, advantages, old_logp, ref_logp, token_scale,
                    kl_weight, cfg, phase, is_ratio=None, sampling_logp=None, cov_sel=None):
    """Per-token terms of §1-§3 and §10, each 0 where it does not act. Returns
    (policy, kl, entropy_term, parts): the loss is policy + kl_coef kl - entropy_coef entropy,
    each term aggregated on its own (``_aggregate_terms``)."""
    m = mask.bool()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    A = advantages.expand_as(logp)
    zero = torch.zeros_like(logp)
    old = logp.detach() if old_logp is None else old_logp
    old = torch.where(m, old, zero)            # garbage outside the mask never leaks
    p_old = old.exp()
    # §2 advantage reweighting, then the token scale (NTHR, §4)
    ar = cfg.ar_alpha * p_old + (1.0 - cfg.ar_alpha)
    adv = A * ar
    if token_scale is not None:
        adv = adv * token_scale
    # §3 Lopti phase mask: applied after AR
    active = m
    if phase is not None:
        low, high = lopti_split(old, m, cfg.lopti_eta)
        active = low if phase == "low" else high
    adv = torch.where(active, adv, zero)

    # the importance ratio: per token, or one per sequence (GSPO: exp of the masked mean)
    log_ratio = torch.where(m, logp - old, zero)
    if cfg.log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    n_b = m.sum(-1, keepdim=True).clamp(min=1)
    if cfg.importance_sampling_level == "sequence":
        lw = log_ratio.sum(-1, keepdim=True) / n_b
        lw = lw.expand_as(logp)
    elif cfg.importance_sampling_level == "sequence_token":
        # verl's GSPO-token: sg(sequence log-ratio) + lr - sg(lr), clamped at 10 above
        seq = (log_ratio.sum(-1, keepdim=True) / n_b).detach()
        lw = (seq + log_ratio - log_ratio.detach()).clamp(max=10.0)
    else:
        lw = log_ratio
    ratio = torch.exp(lw)
    if cfg.cov_mode is not None and cov_sel is None:
        cov_sel = cov_selection(A, logp, old, m, cfg)

    phi = None
    flags = None
    if cfg.objective == "ppo_clip":
        r1 = ratio if cfg.delta is None else ratio.clamp(max=cfg.delta)
        r2 = torch.clamp(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
        pg = -torch.minimum(adv * r1, adv * r2)
        if cfg.clip_ratio_c is not None:
            pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.clip_ratio_c), pg)
    elif cfg.objective == "cispo":
        pg = -ratio.clamp(min=cfg.cispo_min, max=cfg.epsilon_high).detach() * adv * logp
    elif cfg.objective == "reinforce":
        pg = -adv * logp
    elif cfg.objective == "unclipped":
        pg = -adv * ratio
    elif cfg.objective == "dppo":
        c = ratio if cfg.clip_ratio_c is None else ratio.clamp(max=cfg.clip_ratio_c)
        valid = dppo_valid(logp, old, A, cfg)
        flags = ((A <= 0) & ~valid, (A > 0) & ~valid)
        pg = -adv * c.detach() * logp * valid.to(logp.dtype)
    elif cfg.objective == "gmpo":
        sgn = torch.sign(A)
        clamped = log_ratio.clamp(-cfg.epsilon_low, cfg.epsilon_high)
        c = sgn * torch.minimum(sgn * log_ratio, sgn * clamped)
        R = torch.exp(torch.where(m, c, zero).sum(-1, keepdim=True) / n_b)
        if is_ratio is not None:
            log_is = torch.where(m, torch.log(is_ratio + 1e-10), zero)
            R = R * torch.exp(log_is.sum(-1, keepdim=True) / n_b)
        flags = ((A < 0) & (log_ratio != clamped), (A > 0) & (log_ratio != clamped))
        pg = -adv * R
    elif cfg.objective == "sapo":
        kappa = torch.where(A > 0, A.new_tensor(cfg.sapo_temperature_pos),
                            A.new_tensor(cfg.sapo_temperature_neg))
        pg = -torch.sigmoid(kappa * (ratio - 1.0)) * 4.0 / kappa * adv
    else:   # vespo
        phi = gamma_weights(A, log_ratio, m, is_ratio, cfg)
        pg = -phi * adv * logp
    # beside the objective, in the policy term: verl dro's squared log-ratio, KL-Cov's |lr|
    if cfg.log_ratio_penalty != 0.0:
        pg = pg + 0.5 * cfg.log_ratio_penalty * log_ratio ** 2
    if cfg.cov_mode == "kl":
        pg = pg + torch.where(cov_sel, cfg.cov_kl_coef * log_ratio.abs(), zero)
    if is_ratio is not None and cfg.objective not in ("vespo", "gmpo"):
        pg = pg * is_ratio

    # masks of the policy term (§10): off-policy sequences, the entropy quantile
    keep = m
    dropped = None
    if cfg.off_policy_mask_threshold is not None:
        sampling = old if sampling_logp is None else sampling_logp
        kept = off_policy_mask(A, logp, sampling, m, cfg.off_policy_mask_threshold)
        dropped = m & ~kept
        keep = keep & kept
    emask = m
    if cfg.top_entropy_quantile < 1.0:
        emask = entropy_quantile_mask(entropy, m, cfg.top_entropy_quantile)
        keep = keep & emask
    if cfg.cov_mode == "clip":
        keep = keep & ~cov_sel
    policy = torch.where(keep & active, pg, zero)

    kl = None
    kl_term = zero
    if cfg.kl_coef != 0.0:
        kl = kl_penalty(logp, ref_logp, cfg, old)
        if cfg.kl_ratio_correction:
            kl = kl * ratio                 # the importance ratio of the level, unclipped
        if kl_weight is not None:
            kl = kl * kl_weight
        kl_term = torch.where(active, kl, zero)
    ent_term = zero
    if cfg.entropy_coef != 0.0:
        ent_term = torch.where(active & emask, entropy, zero)
    parts = dict(ratio=ratio, adv=adv, ar=ar, p_old=p_old, kl=kl, phi=phi, A=A,
                 emask=emask if cfg.top_entropy_quantile < 1.0 else None, dropped=dropped,
                 flags=flags, cov_sel=cov_sel, log_ratio=torch.where(m, logp - old, zero))
    return policy, kl_term, ent_term, parts


def _aggregate(per_token, mask, agg, cfg, num_items_in_batch, num_seqs_in_batch=None):
    """The four loss_agg modes of §1 over ``mask``. N_tok: num_items_in_batch, else
    cfg.token_count, else the mask's tokens. B: num_seqs_in_batch, else by cfg.seq_count
    every row ("rows") or the rows with a token of ``mask`` ("nonempty", at least 1)."""
    agg = _LOSS_AGG_ALIASES.get(agg, agg)
    m = mask.to(per_token.dtype)
    if num_seqs_in_batch is not None:
        B = torch.as_tensor(num_seqs_in_batch, dtype=per_token.dtype)
    elif cfg.seq_count == "nonempty":
        B = (m.sum(-1) > 0).sum().to(per_token.dtype).clamp(min=1.0)
    elif cfg.seq_count == "rows":
        B = per_token.shape[0]
    else:
        raise ValueError(f"seq_count: unknown {cfg.seq_count!r}")
    if agg == "token-mean":
        if num_items_in_batch is not None:
            return per_token.sum() / torch.as_tensor(num_items_in_batch, dtype=per_token.dtype)
        if cfg.token_count is not None:
            return per_token.sum() / cfg.token_count
        return per_token.sum() / m.sum().clamp(min=1.0)
    if agg == "seq-mean-token-mean":
        return (per_token.sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / B
    if agg == "seq-mean-token-sum":
        return per_token.sum() / B
    if agg == "seq-mean-token-sum-norm":
        return per_token.sum() / (B * cfg.max_len)
    raise ValueError(f"loss_agg: unknown {agg!r}")


def _aggregate_terms(policy, kl, ent, mask, parts, cfg, num_items_in_batch,
                     num_seqs_in_batch=None):
    """loss = agg(policy) + kl_coef agg(kl) - entropy_coef agg(entropy). A term without an
    aggregation of its own (kl_agg / entropy_agg None) is summed into the policy term's; one
    with its own is normalised over the tokens it acts on (KL: the mask; the entropy bonus:
    the mask and the entropy quantile), without num_items_in_batch."""
    m = mask.bool()
    shared = policy
    loss = 0.0
    own = (num_items_in_batch, num_seqs_in_batch) if cfg.normalise_all_terms else (None, None)
    if cfg.kl_coef != 0.0:
        if cfg.kl_agg is None:
            shared = shared + cfg.kl_coef * kl
        else:
            loss = loss + cfg.kl_coef * _aggregate(kl, m, cfg.kl_agg, cfg, *own)
    if cfg.entropy_coef != 0.0:
        if cfg.entropy_agg is None:
            shared = shared - cfg.entropy_coef * ent
        else:
            emask = m if parts["emask"] is None else parts["emask"]
            loss = loss - cfg.entropy_coef * _aggregate(ent, emask, cfg.entropy_agg, cfg, *own)
    return _aggregate(shared, m, cfg.loss_agg, cfg, num_items_in_batch, num_seqs_in_batch) + loss


def _metrics(parts, logp, entropy, mask, cfg, grad_share_low, grad_norm_sum=None):
    m = mask.bool()
    n = m.sum().clamp(min=1).to(torch.float32)

    def masked_mean(x):
        return (torch.where(m, x, torch.zeros_like(x)).sum() / n).float().detach()

    ratio, adv = parts["ratio"], parts["adv"]
    eta = cfg.lopti_eta if cfg.lopti_eta is not None else 0.5
    # clipped: outside the objective's hard clip range (sapo and vespo have none)
    if cfg.objective == "ppo_clip":
        r = ratio if cfg.delta is None else ratio.clamp(max=cfg.delta)
        low = (adv < 0) & (r < 1.0 - cfg.epsilon_low)
        high = (adv > 0) & (r > 1.0 + cfg.epsilon_high)
    elif cfg.objective == "cispo":
        low = torch.zeros_like(m) if cfg.cispo_min is None else (adv < 0) & (ratio < cfg.cispo_min)
        high = (adv > 0) & (ratio > cfg.epsilon_high)
    elif parts["flags"] is not None:       # dppo: outside the trust region; gmpo: lr clipped
        low, high = parts["flags"]
    else:
        low = high = torch.zeros_like(m)
    out = {
        "clip_frac_low": masked_mean(low.float()),
        "clip_frac_high": masked_mean(high.float()),
        "ratio_mean": masked_mean(ratio),
        "log_ratio_mean": masked_mean(parts["log_ratio"]),   # logp - old_logp, no clamp
        "ar_weight_mean": masked_mean(parts["ar"]),
        "low_frac": masked_mean((parts["p_old"] < eta).float()),
    }
    if parts["kl"] is not None:
        out["kl"] = masked_mean(parts["kl"])
    if entropy is not None:
        out["entropy"] = masked_mean(entropy)
    if cfg.importance_sampling_level != "token":
        # TRL counts sequences at this level: the share of the B sequences with a clipped token
        out["clip_frac_low_seq"] = (low & m).any(-1).float().mean().detach()
        out["clip_frac_high_seq"] = (high & m).any(-1).float().mean().detach()
    if parts["phi"] is not None:
        # per sequence: the masked mean of phi (1 for a sequence without tokens), then the mean
        phi = torch.where(m, parts["phi"], torch.zeros_like(parts["phi"]))
        cnt = m.sum(-1)
        seq = torch.where(cnt > 0, phi.sum(-1) / cnt.clamp(min=1), torch.ones_like(phi[:, 0]))
        out["phi_mean"] = seq.mean().float().detach()
    if parts["emask"] is not None:
        out["entropy_mask_frac"] = masked_mean(parts["emask"].float())
        kept = parts["emask"].sum().clamp(min=1)
        out["entropy_top_mean"] = (torch.where(parts["emask"], entropy, torch.zeros_like(entropy))
                                   .sum() / kept).float().detach()
    if parts["dropped"] is not None:
        out["off_policy_frac"] = masked_mean(parts["dropped"].float())
    if parts["cov_sel"] is not None:
        out["cov_frac"] = masked_mean(parts["cov_sel"].float())
    if grad_share_low is not None:
        out["grad_share_low"] = grad_share_low.float().detach()
    if grad_norm_sum is not None:
        out["grad_norm_sum"] = grad_norm_sum.float().detach()
    return out


def _loss(logp, entropy, mask, advantages, old_logp, ref_logp, token_scale, kl_weight, cfg,
          phase, num_items_in_batch, is_ratio, sampling_logp, num_seqs_in_batch=None,
          cov_sel=None):
    if phase is None and cfg.lopti_eta is not None:
        raise ValueError(f"phase: config.lopti_eta={cfg.lopti_eta} asks for Lopti's two "
                         "updates (phase='low', then 'high'); a loss without a phase would be a "
                         "plain update")
    policy, kl, ent, parts = _per_token_loss(logp, entropy, mask, advantages, old_logp,
                                             ref_logp, token_scale, kl_weight, cfg, phase,
                                             is_ratio, sampling_logp, cov_sel)
    return _aggregate_terms(policy, kl, ent, mask, parts, cfg, num_items_in_batch,
                            num_seqs_in_batch), parts


def policy_loss(logp, mask, advantages, old_logp=None, ref_logp=None, entropy=None,
                token_scale=None, kl_weight=None, config=None, phase=None,
                num_items_in_batch=None, is_ratio=None, sampling_logp=None,
                num_seqs_in_batch=None, sum_p2=None, temperature=None):
    """GRPO policy loss from per-token log-probs ``logp`` [B, T] (§1-§3, §10). Returns
    (loss, metrics).

    ``grad_share_low`` (§6) needs ``sum_v p_v^2`` of the full distribution: reported when
    ``sum_p2`` [B, T] is given (``temperature``: the one ``logp`` was taken at).
    """
    cfg = config or PolicyLossConfig()
    args = (mask, advantages, old_logp, ref_logp, token_scale, kl_weight, cfg, phase,
            num_items_in_batch, is_ratio, sampling_logp, num_seqs_in_batch)
    loss, parts = _loss(logp, entropy, *args)
    wants_entropy = (cfg.entropy_coef != 0 or cfg.top_entropy_quantile < 1.0
                     or cfg.return_entropy)
    share = total = None
    if sum_p2 is not None:
        share, total = _grad_share_low(logp, entropy, args + (parts["cov_sel"],), sum_p2,
                                       1.0 if temperature is None else temperature)
    return loss, _metrics(parts, logp, entropy if wants_entropy else None, mask, cfg, share,
                          total)


def _grad_share_low(logp, entropy, args, sum_p2, temp):
    """§6: the norm of the logp-part of dloss/dlogits per token,
    ``|g| / temperature * sqrt(1 - 2 p + sum_v p_v^2)`` with ``g = dloss/dlogp`` (the entropy
    term excluded), and the share of its sum over the tokens with ``p_old < eta``. Returns
    ``(share, total)``."""
    mask, old_logp, cfg = args[0], args[2], args[6]
    m = mask.bool()
    with torch.enable_grad():
        logp_leaf = logp.detach().requires_grad_(True)
        ent_leaf = None if entropy is None else entropy.detach()
        g, = torch.autograd.grad(_loss(logp_leaf, ent_leaf, *args)[0], logp_leaf)
    p = logp.detach().exp()
    norm = (g.abs() / _per_token_temperature(temp, g.shape)
            * (1.0 - 2.0 * p + sum_p2.to(p.dtype)).clamp(min=0).sqrt())
    norm = torch.where(m, norm, torch.zeros_like(norm))
    old = logp.detach() if old_logp is None else old_logp
    eta = cfg.lopti_eta if cfg.lopti_eta is not None else 0.5
    low = (old.exp() < eta) & m
    total = norm.sum()
    share = torch.where(total > 0, norm[low].sum() / torch.where(total > 0, total, 1.0),
                        torch.zeros_like(total))
    return share, total


def fused_linear_policy_loss(hidden, weight, targets, mask, advantages, old_logp=None,
                             ref_logp=None, bias=None, token_scale=None, kl_weight=None,
                             config=None, phase=None, num_items_in_batch=None, backend="auto",
                             is_ratio=None, sampling_logp=None, num_seqs_in_batch=None,
                             temperature=None, support_ids=None, token_out=None):
    """The GRPO loss from hidden states [B, T, H] and lm_head weight [V, H], plainly:

        z = (hidden @ weight.T + bias) / temperature           # [B, T, V]
        logp = log_softmax(z).gather(targets)
        loss = policy_loss(logp, mask, advantages, ...)

    ``support_ids`` (§16): the softmax over each token's support instead (entropy too); the
    metric ``support_forced_frac``. ``token_out``: a dict that receives ``logp`` and, with
    ``support_ids``, ``log_kept_mass`` (0 on masked-out tokens).
    """
    cfg = config or PolicyLossConfig()
    m = mask.bool()
    safe_targets = torch.where(m, targets, torch.zeros_like(targets))
    temp = cfg.temperature if temperature is None else temperature     # float, [B] or [B, T]
    z = _logits(hidden, weight, bias, temp, cfg.logit_softcap, cfg.logits_dtype)
    logprobs_all = torch.log_softmax(z, dim=-1)
    wants_entropy = (cfg.entropy_coef != 0.0 or cfg.top_entropy_quantile < 1.0
                     or cfg.return_entropy)
    forced = kept = None
    if support_ids is not None:
        safe_ids = torch.where(m.unsqueeze(-1), support_ids, torch.full_like(support_ids, -1))
        members, forced = support_members(safe_ids, safe_targets, weight.shape[0])
        full = logprobs_all
        logprobs_all = _over_support(z, members)
        kept = torch.where(m, _gather(full.detach() - logprobs_all.detach(), safe_targets), 0.0)
        entropy = _entropy_on(logprobs_all, members) if wants_entropy else None
    else:
        entropy = _entropy(logprobs_all) if wants_entropy else None
    logp = _gather(logprobs_all, safe_targets)
    if token_out is not None:
        token_out["logp"] = torch.where(m, logp.detach(), 0.0).float()
        if kept is not None:
            token_out["log_kept_mass"] = kept.float()
    args = (mask, advantages, old_logp, ref_logp, token_scale, kl_weight, cfg, phase,
            num_items_in_batch, is_ratio, sampling_logp, num_seqs_in_batch)
    loss, parts = _loss(logp, entropy, *args)
    # the gradient pass of §6: the same random selection (Clip-Cov / KL-Cov)
    sum_p2 = (logprobs_all.detach().exp() ** 2).sum(-1)
    share, total = _grad_share_low(logp, entropy, args + (parts["cov_sel"],), sum_p2, temp)
    metrics = _metrics(parts, logp, entropy, mask, cfg, share, total)
    if forced is not None:
        n = m.sum().clamp(min=1).to(torch.float32)
        metrics["support_forced_frac"] = ((forced & m).sum() / n).float()
    return loss, metrics


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
               beta=1.0, eta="auto", backend="auto", logp=None, logit_softcap=None,
               logits_dtype=None, support_ids=None):
    """§4 Negative Token Hidden Reward, with the full logits.

    For every group with both correct and incorrect responses:
      V*   = distinct masked target ids of the group
      e    = onehot_{V*}(y) - softmax(z)[V*]          (full-vocabulary normalisation)
      M+   = sum over correct tokens of e (x) h         [|V*|, H]
      s    = e^T M+ h                                    per masked token
      tau  = beta * min over correct responses of mean_t s
      incorrect tokens with s > tau get scale eta_g (2|0.5 - p| for eta="auto").

    ``logp`` (a shortcut of the fast path for the LSE) is accepted and ignored here.
    ``support_ids`` (§16): softmax(z) over each token's support S instead, so
    e = onehot(y) - q on S and 0 off S (restricted to V*).
    """
    B, T, H = hidden.shape
    dt = torch.float64 if _float32_mode(logits_dtype, hidden) else _compute_dtype(hidden)
    m = mask.bool()
    scale = torch.ones(B, T, dtype=torch.float32)
    selected = torch.zeros(B, T, dtype=torch.bool)
    scores = torch.zeros(B, T, dtype=torch.float32)
    thresholds = {}
    z = _logits(hidden, weight, bias, temperature, logit_softcap, logits_dtype)   # [B, T, V]
    if support_ids is None:
        probs = torch.softmax(z, dim=-1)
    else:
        safe_targets = torch.where(m, targets, torch.zeros_like(targets))
        safe_ids = torch.where(m.unsqueeze(-1), support_ids, torch.full_like(support_ids, -1))
        members, _ = support_members(safe_ids, safe_targets, weight.shape[0])
        probs = _over_support(z, members).exp()                   # 0 off the support
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
