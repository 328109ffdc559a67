"""The policy objectives, the per-token terms beside them, the ratio levels and the KL forms:
one entry each, keyed by the config's name (docs/math.md §1, §10, §12).

Each entry holds its value and its derivatives, what it needs, the checks of its parameters,
and the attributes the rest of the library asks instead of branching on a name. A new
objective is one function here (plus its Triton / C++ copy if the native kernels should run it,
its ``gbc_reference`` formula and its case in ``tests/objectives/``)::

    @register_objective("mine", needs_sequence=False)
    def _mine(cfg, x: Tokens) -> Out:
        pg = ...                    # the policy term per token
        return Out(pg, d_lw=..., d_direct=...)

Other trainers' names (presets in ``config.TRAINER_PRESETS``): GSPO is the ``sequence`` /
``sequence_token`` ratio level, verl's ``gpg`` is ``reinforce``, ``geo_mean`` is ``gmpo``,
``dro`` is ``reinforce`` with the ``log_ratio_penalty`` token term, ``clip_cov`` / ``kl_cov``
are :data:`COV_MODES`.

Derivatives follow PyTorch's autograd conventions, so that a hand derivative equals autograd on
the value (``tests/objectives/`` holds every entry to that): ``clamp`` passes the gradient on
the closed interval; ``max(x1, x2)`` splits a tie in half; detached factors are ``.detach()``-ed
in the value too. Everything is 1-d over the masked tokens, with no host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable, Dict, Optional, Tuple

import torch

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------

def _seg_sum(x, seq, n, sp=None):
    """The sum of ``x`` over each sequence ``0 .. n - 1``; with ``sp`` (sequence parallel: the
    sequences split over ranks) over every rank's tokens of it."""
    s = x.new_zeros((n,) + tuple(x.shape[1:])).index_add_(0, seq, x)
    return s if sp is None else sp.sum(s)


def _seg_mean(x, seq, n_seq, cnt, sp=None):
    """Each token's sequence mean of ``x`` (``cnt``: tokens per sequence; an empty one: 1)."""
    return (_seg_sum(x, seq, n_seq, sp) / cnt.clamp(min=1.0))[seq]


def _choose(cond, a: float, b: float, like: Tensor) -> Tensor:
    """``where(cond, a, b)`` in ``like``'s dtype (two Python floats would give float32)."""
    return torch.where(cond, like.new_tensor(a), like.new_tensor(b))


def _pick(pg1, pg2, d1, d2):
    """-min(x1, x2) = max(pg1, pg2) and its derivative, ties split in half (autograd's rule
    for torch.minimum)."""
    pg = torch.maximum(pg1, pg2)
    d = torch.where(pg1 > pg2, d1, torch.where(pg1 < pg2, d2, 0.5 * (d1 + d2)))
    return pg, d


def clamped_log_ratio(logp, old, cfg):
    """``logp - old`` with ``cfg.log_ratio_clamp`` applied, and the clamp's gradient mask (None
    without a clamp)."""
    lr = logp - old
    if cfg.log_ratio_clamp is None:
        return lr, None
    c = cfg.log_ratio_clamp
    return lr.clamp(-c, c), ((lr >= -c) & (lr <= c)).to(logp.dtype)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _positive(cfg, name, optional=False):
    v = getattr(cfg, name)
    if v is None and optional:
        return
    if not (_is_number(v) and v > 0 and math.isfinite(v)):
        want = "None or a finite float > 0" if optional else "a finite float > 0"
        raise ValueError(f"{name}: expected {want}, got {v!r}")


def _finite(cfg, name):
    v = getattr(cfg, name)
    if not (_is_number(v) and math.isfinite(v)):
        raise ValueError(f"{name}: expected a finite float, got {v!r}")


def _never(cfg) -> bool:
    return False


# ---------------------------------------------------------------------------------------------
# policy objectives
# ---------------------------------------------------------------------------------------------

@dataclass
class Tokens:
    """An objective's inputs, per masked token (1-d). ``a``: A-hat (after AR, token_scale and
    the Lopti phase mask); ``adv``: the raw advantage, whose sign picks a side; ``log_ratio``:
    ``logp - old`` (clamped by ``log_ratio_clamp``); ``ratio``: ``exp(lw)``, the importance
    weight of the ratio level; ``seq``/``n_seq``/``cnt``: sequence ids, count and tokens per
    sequence (when ``needs_sequence``); ``sp``: the sequence-parallel group whose ranks hold
    the other tokens of each sequence (None: this call holds them all), passed to
    :func:`_seg_sum`."""

    a: Tensor
    adv: Tensor
    logp: Tensor
    old: Tensor
    log_ratio: Tensor
    ratio: Tensor
    is_ratio: Optional[Tensor] = None
    seq: Optional[Tensor] = None
    n_seq: int = 0
    cnt: Optional[Tensor] = None
    sp: object = None


@dataclass
class Out:
    """An objective's policy term ``pg`` per token and its derivatives: ``d_lw`` through the
    log importance weight ``lw``, ``d_direct`` through ``logp`` itself (None: 0), ``d_seq``
    through each token's ``log_ratio`` inside a sequence statistic, as a vector-Jacobian
    product: ``d/dlog_ratio_s sum_t w_t pg_t = mean_{t in s's sequence}(w_t pg_t) * d_seq_s``
    for any per-token weights ``w``. ``flags``: its own clip flags (low, high) for the metrics;
    ``phi_seq_sum``: vespo's sum over sequences of the mean weight."""

    pg: Tensor
    d_lw: Tensor
    d_direct: Optional[Tensor] = None
    d_seq: Optional[Tensor] = None
    flags: Optional[Tuple[Tensor, Tensor]] = None
    phi_seq_sum: Optional[Tensor] = None


def _no_flags(a, r, cfg):
    none = torch.zeros_like(r, dtype=torch.bool)
    return none, none


@dataclass(frozen=True)
class Objective:
    """One policy objective.

    fn(cfg, x: Tokens) -> Out. levels: the importance-sampling levels it takes (one that
    defines its own ratio, or none, takes ``token`` only). needs_sequence: a token's term
    depends on its sequence. weights_is_ratio: the rollout ``is_ratio`` multiplies its term
    (False: ``fn`` takes it in itself). is_ratio_once: a per-sequence ``is_ratio`` enters the
    sequence once (on its first token) rather than on every token. native(cfg): the one-pass
    C++ / Triton token kernels compute it. clip_flags(a, r, cfg): the tokens its hard clip acts
    on, (low, high). options: the config fields only this objective reads, {name: what it is}
    (refused with any other objective). check(cfg): its parameter values (run whatever the
    objective, so that a bad value is refused even before it is used); check_chosen(cfg): the
    combinations it refuses when chosen. reports_phi_mean: the ``phi_mean`` metric."""

    name: str
    fn: Callable
    levels: Tuple[str, ...] = ("token", "sequence", "sequence_token")
    needs_sequence: bool = False
    weights_is_ratio: bool = True
    is_ratio_once: bool = False
    native: Callable = _never
    clip_flags: Callable = _no_flags
    options: Tuple[Tuple[str, str], ...] = ()
    check: Optional[Callable] = None
    check_chosen: Optional[Callable] = None
    reports_phi_mean: bool = False


OBJECTIVES: Dict[str, Objective] = {}


def register_objective(name: str, **attrs):
    """Add ``fn`` to :data:`OBJECTIVES` under ``name`` (verl's ``@register_policy_loss``)."""
    def deco(fn):
        OBJECTIVES[name] = Objective(name, fn, **attrs)
        return fn
    return deco


def _ppo_flags(a, r, cfg):
    rc = r if cfg.delta is None else r.clamp(max=cfg.delta)
    return (a < 0) & (rc < 1.0 - cfg.epsilon_low), (a > 0) & (rc > 1.0 + cfg.epsilon_high)


def _ppo_check(cfg):
    if cfg.delta is not None and not (_is_number(cfg.delta) and cfg.delta > 0
                                      and math.isfinite(cfg.delta)):
        raise ValueError(f"delta: expected None or a finite float > 0, got {cfg.delta!r}")
    if cfg.clip_ratio_c is not None and not math.isfinite(cfg.clip_ratio_c):
        raise ValueError(f"clip_ratio_c: expected None or a finite float (None turns the "
                         f"dual clip off), got {cfg.clip_ratio_c!r}")


def _ppo_check_chosen(cfg):
    if cfg.clip_ratio_c is not None and not cfg.clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c: expected None or a float > 1, got {cfg.clip_ratio_c!r}")


@register_objective("ppo_clip", native=lambda cfg: cfg.delta is None, clip_flags=_ppo_flags,
                    options=(("delta", "the two-sided clip"), ("clip_ratio_c", "the dual clip")),
                    check=_ppo_check, check_chosen=_ppo_check_chosen)
def _ppo_clip(cfg, x: Tokens) -> Out:
    """PPO / DAPO clip ``max(-A r1, -A clamp(r, 1 - eps_low, 1 + eps_high))``, ``r1 =
    min(r, delta)`` (INTELLECT-2's two-sided clip), and the dual clip ``min(., -A c)`` for
    ``A < 0``."""
    ratio, a = x.ratio, x.a
    zeros = torch.zeros_like(x.logp)
    lo, hi = 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high
    if cfg.delta is None:
        r1, dr1 = ratio, ratio
    else:                                 # clamp(max=delta) passes the gradient at delta
        r1, dr1 = ratio.clamp(max=cfg.delta), torch.where(ratio <= cfg.delta, ratio, zeros)
    r2 = ratio.clamp(lo, hi)
    dr2 = torch.where((ratio >= lo) & (ratio <= hi), ratio, zeros)
    pg, d_lw = _pick(-a * r1, -a * r2, -a * dr1, -a * dr2)
    if cfg.clip_ratio_c is not None:
        pg_dual = -a * cfg.clip_ratio_c
        dual = (a < 0) & (pg_dual < pg)
        pg = torch.where(dual, pg_dual, pg)
        d_lw = torch.where(dual, zeros, d_lw)
    return Out(pg, d_lw)


def _cispo_flags(a, r, cfg):
    none = torch.zeros_like(r, dtype=torch.bool)
    low = none if cfg.cispo_min is None else (a < 0) & (r < cfg.cispo_min)
    return low, (a > 0) & (r > cfg.epsilon_high)


def _cispo_check_chosen(cfg):
    v = cfg.cispo_min
    if v is not None and not (_is_number(v) and 0.0 <= v <= cfg.epsilon_high):
        raise ValueError(f"cispo_min: expected None or a float in [0, epsilon_high="
                         f"{cfg.epsilon_high}], got {cfg.cispo_min!r}")


@register_objective("cispo", clip_flags=_cispo_flags,
                    options=(("cispo_min", "the lower bound of cispo's weight"),),
                    check_chosen=_cispo_check_chosen)
def _cispo(cfg, x: Tokens) -> Out:
    """CISPO: ``-sg(clamp(r, cispo_min, epsilon_high)) A logp``."""
    c = x.ratio.detach().clamp(min=cfg.cispo_min, max=cfg.epsilon_high)
    return Out(-c * x.a * x.logp, torch.zeros_like(x.logp), -c * x.a)


def _sapo_check(cfg):
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        _positive(cfg, name)


@register_objective("sapo", check=_sapo_check)
def _sapo(cfg, x: Tokens) -> Out:
    """SAPO's soft gate ``-sigmoid(k (r - 1)) 4 / k A``, ``k`` by the sign of A."""
    kappa = _choose(x.adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg, x.logp)
    sg = torch.sigmoid(kappa * (x.ratio - 1.0))
    pg = -sg * (4.0 / kappa) * x.a
    d_lw = -4.0 * x.a * sg * (1.0 - sg) * x.ratio      # d/dlw of -4/k sigma(k (e^lw - 1)) a
    return Out(pg, d_lw)


@register_objective("reinforce", levels=("token",))
def _reinforce(cfg, x: Tokens) -> Out:
    """REINFORCE / GPG: ``-A logp``."""
    return Out(-x.a * x.logp, torch.zeros_like(x.logp), -x.a)


@register_objective("unclipped")
def _unclipped(cfg, x: Tokens) -> Out:
    """PPO's surrogate without a clip, ``-A r`` (verl kl_cov's base)."""
    pg = -x.a * x.ratio
    return Out(pg, pg)


DPPO_DIVERGENCES = ("tv", "binary_kl")


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


def _dppo_check(cfg):
    if cfg.dppo_divergence not in DPPO_DIVERGENCES:
        raise ValueError(f"dppo_divergence: expected one of {DPPO_DIVERGENCES}, got "
                         f"{cfg.dppo_divergence!r}")


def _dppo_check_chosen(cfg):
    if cfg.clip_ratio_c is not None and not cfg.clip_ratio_c > 0:
        raise ValueError(f"clip_ratio_c: dppo's truncation expects a float > 0, got "
                         f"{cfg.clip_ratio_c!r}")


@register_objective("dppo", levels=("token",),
                    options=(("clip_ratio_c", "dppo's truncation"),
                             ("dppo_divergence", "the divergence of dppo's trust region")),
                    check=_dppo_check, check_chosen=_dppo_check_chosen)
def _dppo(cfg, x: Tokens) -> Out:
    """DPPO: ``-A sg(min(r, clip_ratio_c)) logp`` on the tokens inside the trust region."""
    r = x.ratio.detach()
    c = r if cfg.clip_ratio_c is None else r.clamp(max=cfg.clip_ratio_c)
    valid = dppo_valid(x.logp, x.old, x.adv, cfg)
    w = torch.where(valid, -c * x.a, torch.zeros_like(x.logp))
    return Out(w * x.logp, torch.zeros_like(x.logp), w,
               flags=((x.adv <= 0) & ~valid, (x.adv > 0) & ~valid))


@register_objective("gmpo", levels=("token",), needs_sequence=True, weights_is_ratio=False)
def _gmpo(cfg, x: Tokens) -> Out:
    """GMPO (verl geo_mean): ``-A R``, ``R`` the sequence's geometric mean of the token ratios,
    each log-ratio clipped to ``[-epsilon_low, epsilon_high]`` on the side of A's sign; with
    ``is_ratio``, times the sequence's geometric mean of it."""
    seq, n_seq, cnt, log_ratio = x.seq, x.n_seq, x.cnt, x.log_ratio
    zeros = torch.zeros_like(x.logp)
    sgn = torch.sign(x.adv)
    clamped = log_ratio.clamp(-cfg.epsilon_low, cfg.epsilon_high)
    inside = (log_ratio >= -cfg.epsilon_low) & (log_ratio <= cfg.epsilon_high)
    x1, x2 = sgn * log_ratio, sgn * clamped
    # sgn * min(sgn lr, sgn clamp(lr)), its derivative in lr: ties split (torch.minimum)
    c = sgn * torch.minimum(x1, x2)
    one = torch.ones_like(x.logp)
    dc = torch.where(x1 < x2, one, torch.where(x1 > x2, inside.to(x.logp.dtype),
                                               0.5 * (one + inside.to(x.logp.dtype))))
    dc = torch.where(sgn == 0, zeros, dc)
    R = torch.exp(_seg_mean(c, seq, n_seq, cnt, x.sp))
    if x.is_ratio is not None:            # verl: the sequence's geometric mean of is_ratio
        R = R * torch.exp(_seg_mean(torch.log(x.is_ratio + 1e-10), seq, n_seq, cnt, x.sp))
    return Out(-x.a * R, zeros, d_seq=dc,
               flags=((x.adv < 0) & ~inside, (x.adv > 0) & ~inside))


def gamma_log_weight(log_ratio, is_ratio, seq, n_seq, sp=None):
    """VESPO's clamped sequence log-weight per sequence (docs/math.md)."""
    lower = math.log(1e-8)
    s = log_ratio.clamp(-20.0, 20.0)
    if is_ratio is not None:
        s = s + torch.log(is_ratio).clamp(lower, 20.0)
    return _seg_sum(s, seq, n_seq, sp).clamp(lower, 20.0)


def _vespo_check(cfg):
    for name in ("vespo_k_pos", "vespo_k_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
        _finite(cfg, name)
    for name in ("vespo_lambda_pos", "vespo_lambda_neg"):
        v = getattr(cfg, name)
        if not v > 0:            # TRL clamps the rate at 1e-4: 0 and -1 would give the same
            raise ValueError(f"{name}: expected a float > 0 (VESPO's gamma rate; TRL clamps "
                             f"it at 1e-4, so a value <= 0 has no meaning of its own), "
                             f"got {v!r}")


@register_objective("vespo", levels=("token", "sequence"), needs_sequence=True,
                    weights_is_ratio=False, is_ratio_once=True, check=_vespo_check,
                    reports_phi_mean=True)
def _vespo(cfg, x: Tokens) -> Out:
    """VESPO: ``-phi A logp``, ``phi`` TRL's gamma weight of the sequence log-ratio (detached),
    shape ``k`` and rate ``lambda`` by the sign of A."""
    seq, n_seq = x.seq, x.n_seq
    log_w = gamma_log_weight(x.log_ratio.detach(), x.is_ratio, seq, n_seq, x.sp)[seq]
    pos = x.adv >= 0
    k = _choose(pos, cfg.vespo_k_pos, cfg.vespo_k_neg, x.logp)
    lam = _choose(pos, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg, x.logp).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    phi = phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return Out(-phi * x.a * x.logp, torch.zeros_like(x.logp), -phi * x.a,
               phi_seq_sum=(_seg_sum(phi, seq, n_seq, x.sp) / x.cnt.clamp(min=1.0)).sum())


def exclusive_options():
    """{config field: ((objective, what it is), ...)}: the fields only some objectives read."""
    out: Dict[str, list] = {}
    for obj in OBJECTIVES.values():
        for field, what in obj.options:
            out.setdefault(field, []).append((obj.name, what))
    return out


# ---------------------------------------------------------------------------------------------
# ratio levels
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RatioLevel:
    """How the log importance weight ``lw`` comes from the token log-ratios: fn(log_ratio,
    seq, n_seq, cnt, sp=None) -> (lw, back), ``back(g)`` the vector-Jacobian product taking
    ``dL/dlw`` per token to ``dL/dlog_ratio`` per token (``sp``: see :class:`Tokens`)."""

    name: str
    fn: Callable
    needs_sequence: bool


RATIO_LEVELS: Dict[str, RatioLevel] = {}


def register_level(name, needs_sequence):
    def deco(fn):
        RATIO_LEVELS[name] = RatioLevel(name, fn, needs_sequence)
        return fn
    return deco


@register_level("token", needs_sequence=False)
def _token_level(log_ratio, seq, n_seq, cnt, sp=None):
    """One ratio per token."""
    return log_ratio, lambda g: g


@register_level("sequence", needs_sequence=True)
def _sequence_level(log_ratio, seq, n_seq, cnt, sp=None):
    """GSPO: the sequence's mean log-ratio, gradient through the mean (split sequences: the
    sum of every rank's ``dL/dlw`` over the sequence)."""
    return (_seg_mean(log_ratio, seq, n_seq, cnt, sp),
            lambda g: _seg_mean(g, seq, n_seq, cnt, sp))


@register_level("sequence_token", needs_sequence=True)
def _sequence_token_level(log_ratio, seq, n_seq, cnt, sp=None):
    """verl's GSPO-token: the sequence's mean (clamped at 10 above) as value, each token's own
    gradient."""
    lw = _seg_mean(log_ratio, seq, n_seq, cnt, sp)
    st_in = (lw <= 10.0).to(log_ratio.dtype)
    return lw.clamp(max=10.0), lambda g: g * st_in


# ---------------------------------------------------------------------------------------------
# per-token terms beside the objective, and the batch selections (Clip-Cov / KL-Cov)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenTerm:
    """A term added to the policy term per token, a function of the token's log-ratio:
    fn(log_ratio, cfg, sel) -> (value, d value / d log_ratio); on(cfg): it is switched on."""

    name: str
    fn: Callable
    on: Callable
    check: Optional[Callable] = None


TOKEN_TERMS: Dict[str, TokenTerm] = {}


def register_term(name, on, check=None):
    def deco(fn):
        TOKEN_TERMS[name] = TokenTerm(name, fn, on, check)
        return fn
    return deco


def _penalty_check(cfg):
    v = cfg.log_ratio_penalty
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"log_ratio_penalty: expected a finite float >= 0, got {v!r}")


@register_term("log_ratio_penalty", on=lambda cfg: cfg.log_ratio_penalty != 0.0,
               check=_penalty_check)
def _log_ratio_penalty(lr, cfg, sel):
    """``beta / 2 (logp - old)^2`` (verl dro, ROLL kimi15, prime-rl's kl_tau)."""
    return 0.5 * cfg.log_ratio_penalty * lr * lr, cfg.log_ratio_penalty * lr


@register_term("kl_cov", on=lambda cfg: cfg.cov_mode == "kl")
def _kl_cov_term(lr, cfg, sel):
    """KL-Cov: ``cov_kl_coef |logp - old|`` on the selected tokens."""
    zeros = torch.zeros_like(lr)
    return (torch.where(sel, cfg.cov_kl_coef * lr.abs(), zeros),
            torch.where(sel, cfg.cov_kl_coef * torch.sign(lr), zeros))


def token_terms(log_ratio, cfg, sel):
    """The sum of the switched-on :data:`TOKEN_TERMS` and its derivative (None, None: none)."""
    pen, d_pen = None, None
    for term in TOKEN_TERMS.values():
        if term.on(cfg):
            v, d = term.fn(log_ratio, cfg, sel)
            pen, d_pen = (v, d) if pen is None else (pen + v, d_pen + d)
    return pen, d_pen


@dataclass(frozen=True)
class CovMode:
    """Clip-Cov / KL-Cov (verl 0.9.1 ``clip_cov`` / ``kl_cov``): pick(cov, k, logp, adv, old,
    cfg) -> the selected token indices; drops: the policy term is dropped on them (else the
    ``kl_cov`` term acts there)."""

    name: str
    pick: Callable
    drops: bool
    check_chosen: Optional[Callable] = None


def _clip_cov_pick(cov, k, logp, adv, old, cfg):
    """``k`` tokens drawn at random (``torch.randperm`` on the default CPU generator, as verl)
    among those with ``cov_lb < cov < cov_ub`` that PPO's clip has not already clipped."""
    r = torch.exp(clamped_log_ratio(logp, logp if old is None else old, cfg)[0])
    clipped = -adv * r.clamp(1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high) > -adv * r
    cand = ((cov < cfg.cov_ub) & (cov > cfg.cov_lb) & ~clipped).nonzero().squeeze(1)
    if cand.numel():
        cand = cand[torch.randperm(cand.numel())[:min(k, cand.numel())].to(cand.device)]
    return cand


def _clip_cov_check(cfg):
    if cfg.objective != "ppo_clip":
        raise ValueError(f"cov_mode: 'clip' drops tokens that PPO's clip left in; "
                         f"expected objective='ppo_clip', got objective={cfg.objective!r}")


COV_MODES: Dict[str, CovMode] = {
    "clip": CovMode("clip", _clip_cov_pick, True, _clip_cov_check),
    "kl": CovMode("kl", lambda cov, k, *_: torch.topk(cov, min(k, cov.numel()),
                                                      largest=True).indices, False),
}


def cov_selection(logp: Tensor, adv: Tensor, old: Optional[Tensor], cfg) -> Tensor:
    """The Clip-Cov / KL-Cov tokens among the call's masked tokens (docs/math.md §12), by the
    covariance ``(A - mean A)(logp - mean logp)`` of the raw advantage and the current log-prob:
    ``max(1, int(cov_ratio N))`` of them, picked by the mode."""
    n = logp.numel()
    sel = torch.zeros(n, dtype=torch.bool, device=logp.device)
    if n == 0:
        return sel
    cov = (adv - adv.mean()) * (logp - logp.mean())
    k = max(int(cfg.cov_ratio * n), 1)
    return sel.index_fill_(0, COV_MODES[cfg.cov_mode].pick(cov, k, logp, adv, old, cfg), True)


def _cov_check(cfg):
    if not (_is_number(cfg.cov_ratio) and 0.0 < cfg.cov_ratio <= 1.0):
        raise ValueError(f"cov_ratio: expected a float in (0, 1], got {cfg.cov_ratio!r}")
    if not (math.isfinite(cfg.cov_lb) and math.isfinite(cfg.cov_ub)
            and cfg.cov_lb < cfg.cov_ub):
        raise ValueError(f"cov_lb, cov_ub: expected finite floats with cov_lb < cov_ub, got "
                         f"cov_lb={cfg.cov_lb!r}, cov_ub={cfg.cov_ub!r}")
    if not math.isfinite(cfg.cov_kl_coef):
        raise ValueError(f"cov_kl_coef: expected a finite float, got {cfg.cov_kl_coef!r}")


# ---------------------------------------------------------------------------------------------
# KL forms
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KLForm:
    """One KL estimator ``k(delta)``, ``delta = ref_logp - logp``: fn(delta) -> (value,
    d value / d logp). input_clamp, value_clamp: fixed clamps of ``delta`` and of the value
    (low_var_kl's 20 and 10); straight_through: the ``+`` form (the value, k2's gradient);
    native: the one-pass C++ / Triton kernels compute it (by its index in
    ``config.KL_ESTIMATORS``)."""

    name: str
    fn: Callable
    input_clamp: Optional[float] = None
    value_clamp: Optional[float] = None
    straight_through: bool = False
    native: bool = False


def _k1(delta):
    """``-delta = logp - ref_logp``."""
    return -delta, torch.ones_like(delta)


def _k2(delta):
    """``delta^2 / 2``."""
    return 0.5 * delta * delta, -delta


def _k3(delta):
    """``exp(delta) - delta - 1`` (Schulman's k3)."""
    e = torch.exp(delta)
    return e - delta - 1.0, 1.0 - e


def _abs(delta):
    """``|delta|``; d|x|/dx = sign(x), 0 at 0 (autograd's)."""
    return delta.abs(), -torch.sign(delta)


_KL_BASE = (KLForm("k1", _k1, native=True), KLForm("k2", _k2, native=True),
            KLForm("k3", _k3, native=True),
            KLForm("low_var_kl", _k3, input_clamp=20.0, value_clamp=10.0, native=True),
            KLForm("abs", _abs))
# the "+" forms (verl): the estimator's value with the gradient of k2 (straight-through)
KL_FORMS: Dict[str, KLForm] = {
    **{k.name: k for k in _KL_BASE},
    **{k.name + "+": KLForm(k.name + "+", k.fn, k.input_clamp, k.value_clamp, True)
       for k in _KL_BASE},
}
KL_BASE_NAMES = tuple(k.name for k in _KL_BASE)


def kl_value_and_grad(logp, ref_logp, estimator, clamp=None, input_clamp=None,
                      straight_through=None):
    """KL estimator k(logp, ref_logp) and dk/dlogp, delta = ref_logp - logp (docs/math.md §1,
    §12). ``input_clamp``: delta clamped to ``[-c, c]`` first; ``clamp``: the value clamped to
    ``[-clamp, clamp]`` (each passes the gradient inside only; an entry's own clamps, as
    ``low_var_kl``'s 20 and 10, replace these). ``straight_through = w`` (a ``+`` estimator: 1;
    OpenRLHF's unbiased gradient: the clamped ratio): the value kept, the gradient ``w (logp -
    ref_logp)``, k2's, weighted."""
    form = KL_FORMS[estimator]
    if form.input_clamp is not None:
        input_clamp, clamp = form.input_clamp, form.value_clamp
    delta = ref_logp - logp
    d_in = None
    if input_clamp is not None:
        d_in = (delta >= -input_clamp) & (delta <= input_clamp)
        delta = delta.clamp(-input_clamp, input_clamp)
    val, grad = form.fn(delta)
    if d_in is not None:
        grad = torch.where(d_in, grad, torch.zeros_like(grad))
    if clamp is not None:
        inside = (val >= -clamp) & (val <= clamp)
        val, grad = val.clamp(-clamp, clamp), torch.where(inside, grad, torch.zeros_like(grad))
    if straight_through is not None:
        grad = straight_through * (logp - ref_logp)
    return val, grad


def kl_term(logp, ref, old, ratio, cfg):
    """The KL term per token before its weights: (value, d/dlogp, d/dlw or None), with the
    config's :data:`KL_OPTIONS` applied (the ratio correction's ``r k`` is a function of the
    log importance weight ``lw``, ``ratio = exp(lw)``, too)."""
    st = 1.0 if KL_FORMS[cfg.kl_estimator].straight_through else None
    if cfg.kl_unbiased_gradient:          # OpenRLHF: w = min(exp(logp - old), 10), detached
        st = torch.exp(logp - old).clamp(max=10.0).detach()
    kl, dk = kl_value_and_grad(logp, ref, cfg.kl_estimator, cfg.kl_clamp,
                               cfg.kl_log_ratio_clamp, st)
    if not cfg.kl_ratio_correction:
        return kl, dk, None
    kl, dk = ratio * kl, ratio * dk       # r k: d/dlw = r k, d/dlogp directly = r dk
    return kl, dk, kl


@dataclass(frozen=True)
class KLOption:
    """An option acting on every KL form: on(cfg), check(cfg) (its value, always),
    check_chosen(cfg) (the combinations it refuses when on) and native (the one-pass kernels
    compute it). Its math is a step of :func:`kl_value_and_grad` / :func:`kl_term`."""

    name: str
    on: Callable
    check: Optional[Callable] = None
    check_chosen: Optional[Callable] = None
    native: bool = False


def _fixed_clamps(name):
    def check(cfg):
        if KL_FORMS[cfg.kl_estimator].input_clamp is not None:
            raise ValueError(f"{name}: kl_estimator={cfg.kl_estimator!r} clamps its input "
                             f"at +-20 and its value at +-10 already; use kl_estimator='k3' "
                             f"with {name}={getattr(cfg, name)!r}")
    return check


def _unbiased_check(cfg):
    if KL_FORMS[cfg.kl_estimator].straight_through:
        raise ValueError(f"kl_unbiased_gradient: kl_estimator={cfg.kl_estimator!r} already "
                         f"takes k2's gradient (with weight 1); use one of the two")


def _ratio_correction_check(cfg):
    if cfg.kl_unbiased_gradient or KL_FORMS[cfg.kl_estimator].straight_through:
        raise ValueError(f"kl_ratio_correction: the ratio-corrected KL and the "
                         f"straight-through gradient (kl_estimator={cfg.kl_estimator!r}, "
                         f"kl_unbiased_gradient={cfg.kl_unbiased_gradient}) each define "
                         f"the KL's gradient; use one")


KL_OPTIONS: Dict[str, KLOption] = {o.name: o for o in (
    KLOption("kl_log_ratio_clamp", lambda cfg: cfg.kl_log_ratio_clamp is not None,
             lambda cfg: _positive(cfg, "kl_log_ratio_clamp", True),
             _fixed_clamps("kl_log_ratio_clamp")),
    KLOption("kl_clamp", lambda cfg: cfg.kl_clamp is not None,
             lambda cfg: _positive(cfg, "kl_clamp", True), _fixed_clamps("kl_clamp")),
    KLOption("kl_unbiased_gradient", lambda cfg: cfg.kl_unbiased_gradient,
             check_chosen=_unbiased_check),
    KLOption("kl_ratio_correction", lambda cfg: cfg.kl_ratio_correction,
             check_chosen=_ratio_correction_check, native=True),
)}


# ---------------------------------------------------------------------------------------------
# the config's checks (PolicyLossConfig.__post_init__ calls these once the names are known)
# ---------------------------------------------------------------------------------------------

def check_values(cfg):
    """Every entry's parameter values, whatever is chosen."""
    for entry in (*OBJECTIVES.values(), *TOKEN_TERMS.values(), *KL_OPTIONS.values()):
        if entry.check is not None:
            entry.check(cfg)
    _cov_check(cfg)


def check_choice(cfg):
    """The combinations the chosen entries refuse: an objective's own option set with another
    objective, a level the objective does not take, and each chosen entry's own rules."""
    obj = OBJECTIVES[cfg.objective]
    defaults = {f.name: f.default for f in fields(cfg)}
    for field, owners in exclusive_options().items():
        value = getattr(cfg, field)
        if value != defaults[field] and cfg.objective not in [o for o, _ in owners]:
            what = " or ".join(f"{w} (objective={o!r})" for o, w in owners)
            raise ValueError(f"{field}: {what} only, got {field}={value!r} with "
                             f"objective={cfg.objective!r}")
    if cfg.importance_sampling_level not in obj.levels:
        raise ValueError(f"importance_sampling_level: objective={cfg.objective!r} defines "
                         f"its own ratio (or none); expected one of {obj.levels}, got "
                         f"importance_sampling_level={cfg.importance_sampling_level!r}")
    chosen = [obj] + [o for o in KL_OPTIONS.values() if o.on(cfg)]
    if cfg.cov_mode is not None:
        if cfg.importance_sampling_level != "token":
            raise ValueError(f"cov_mode: Clip-Cov and KL-Cov select tokens; expected "
                             f"importance_sampling_level='token', got "
                             f"{cfg.importance_sampling_level!r} with cov_mode={cfg.cov_mode!r}")
        chosen.append(COV_MODES[cfg.cov_mode])
    for entry in chosen:
        if entry.check_chosen is not None:
            entry.check_chosen(cfg)


def native_ok(cfg) -> bool:
    """The chosen objective, KL form and KL options are the one-pass kernels' (the token-local
    PPO loss of §1-§3 and the native estimators; no token term)."""
    return (OBJECTIVES[cfg.objective].native(cfg) and KL_FORMS[cfg.kl_estimator].native
            and not any(o.on(cfg) for o in KL_OPTIONS.values() if not o.native)
            and not any(t.on(cfg) for t in TOKEN_TERMS.values()))
