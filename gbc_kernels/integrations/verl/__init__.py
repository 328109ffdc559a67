"""verl 0.9.1: its actor config as a :class:`gbc_kernels.PolicyLossConfig`
(:func:`policy_loss_config`, :func:`batch_normalisers`), gbc's loss in verl's policy-loss
registry (:func:`register`), and the two helpers by which NTHR and critical-token KL enter
verl's batch there (:func:`scale_advantages`, :func:`weighted_kl_penalty`); docs/verl.md.
"""

from __future__ import annotations

import contextlib
import math
import dataclasses
from typing import Optional

import torch

import gbc_kernels as gbc
from gbc_kernels import methods

VERL_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")
# verl 0.9.1's registered policy losses that gbc reproduces (TRAINER_PRESETS "verl:<mode>");
# bypass_mode (its rollout-correction dispatcher) is refused
VERL_LOSS_MODES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov",
                   "geo_mean", "dro", "cispo")
# verl's kl_loss_type names -> gbc's kl_estimator ("k3" is verl's clamped low_var_kl; a "+"
# on k2 / mse is k2 itself, its gradient being k2's already)
VERL_KL_TYPES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2",
                 "low_var_kl": "low_var_kl", "k3": "low_var_kl",
                 "kl+": "k1+", "k1+": "k1+", "abs+": "abs+", "mse+": "k2", "k2+": "k2",
                 "low_var_kl+": "low_var_kl+", "k3+": "low_var_kl+"}
# a loss mode's own options: (verl's option, verl's default, gbc's field); verl reads
# ``policy_loss.x`` as "x if x is not None else default"
MODE_OPTIONS = {
    "vanilla": [("clip_ratio_c", 3.0, "clip_ratio_c")],
    "dppo_tv": [("clip_ratio_c", 20.0, "clip_ratio_c")],
    "dppo_kl": [("clip_ratio_c", 20.0, "clip_ratio_c")],
    "sapo": [("tau_pos", 1.0, "sapo_temperature_pos"), ("tau_neg", 1.05, "sapo_temperature_neg")],
    "clip_cov": [("policy_loss.clip_cov_ratio", 0.0002, "cov_ratio"),
                 ("policy_loss.clip_cov_lb", 1.0, "cov_lb"),
                 ("policy_loss.clip_cov_ub", 5.0, "cov_ub")],
    "kl_cov": [("policy_loss.kl_cov_ratio", 0.0002, "cov_ratio"),
               ("policy_loss.ppo_kl_coef", 1.0, "cov_kl_coef")],
    "dro": [("policy_loss.dro_beta", None, "log_ratio_penalty")],
}
# verl's actor options the mapping reads (a bad value in any of them is refused naming it)
VERL_OPTION_NAMES = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "use_kl_loss",
                     "kl_loss_type", "kl_loss_coef", "entropy_coeff", "loss_agg_mode",
                     "loss_scale_factor", "policy_loss.loss_mode") + tuple(dict.fromkeys(
                         o for rows in MODE_OPTIONS.values() for o, _, _ in rows))


def policy_loss_config(actor_config, response_length: Optional[int] = None,
                       **gbc_options) -> "gbc.PolicyLossConfig":
    """The config that reproduces verl 0.9.1's ``ppo_loss`` with verl's default
    ``global_batch_info`` for ``actor_config`` (``ActorConfig``, an OmegaConf node or a dict;
    the options read: :data:`VERL_OPTION_NAMES`); a global batch enters through
    :func:`batch_normalisers`. ``gbc_options``: gbc fields on top (``ar_alpha``, ...).
    ``response_length``: T, for ``seq-mean-token-sum-norm`` without ``loss_scale_factor``. A
    bad value or an option gbc cannot honour: a ValueError naming verl's option (math.md §12)."""
    names = {}                        # gbc field -> the verl option(s) it comes from

    def num(name, value, field=None, optional=False):
        if not (optional and value is None):
            methods.finite_number(name, value, kind="a finite number")
        if field is not None:
            names[field] = f"{name}={value!r}"
        return value

    policy_loss = _cfg_get(actor_config, "policy_loss", None)
    mode = _cfg_get(policy_loss, "loss_mode", "vanilla")
    if mode not in VERL_LOSS_MODES:
        raise ValueError(f"policy_loss.loss_mode: gbc reproduces verl's {VERL_LOSS_MODES}, got "
                         f"{mode!r}" + (" (verl's rollout-correction dispatcher: set "
                                        "rollout_is_weights and a loss mode instead)"
                                        if mode == "bypass_mode" else ""))
    clip = num("clip_ratio", _cfg_get(actor_config, "clip_ratio", 0.2))
    low = num("clip_ratio_low", _cfg_get(actor_config, "clip_ratio_low"), optional=True)
    high = num("clip_ratio_high", _cfg_get(actor_config, "clip_ratio_high"), optional=True)
    low_name = "clip_ratio" if low is None else "clip_ratio_low"
    high_name = "clip_ratio" if high is None else "clip_ratio_high"
    low = clip if low is None else low
    high = clip if high is None else high
    opts = {}
    if mode in ("vanilla", "dppo_tv", "dppo_kl", "gspo", "clip_cov", "geo_mean"):
        opts.update(epsilon_low=num(low_name, low, "epsilon_low"),
                    epsilon_high=num(high_name, high, "epsilon_high"))
    if mode == "cispo":
        opts.update(epsilon_high=1.0 + high, cispo_min=1.0 - low)
        names.update(epsilon_high=f"{high_name}={high!r}",
                     cispo_min=[f"{low_name}={low!r}", f"{high_name}={high!r}"])
    for option, default, field in MODE_OPTIONS.get(mode, ()):
        parent, _, key = option.rpartition(".")
        value = _cfg_get(policy_loss if parent else actor_config, key, None if parent else default)
        value = default if value is None and parent else value
        opts[field] = num(option, value, field, optional=default is None)
    if mode == "dro" and not (opts["log_ratio_penalty"] or 0) > 0:
        raise ValueError(f"policy_loss.dro_beta: verl's dro needs a positive dro_beta, got "
                         f"{opts['log_ratio_penalty']!r}")
    agg_mode = _cfg_get(actor_config, "loss_agg_mode", "token-mean")
    if agg_mode not in VERL_AGG_MODES:
        raise ValueError(f"loss_agg_mode: expected one of {VERL_AGG_MODES}, got {agg_mode!r}")
    agg = "token-mean" if agg_mode == "token-sum" else agg_mode
    if agg_mode == "token-sum":
        opts["token_count"] = 1.0         # a token-mean over one "token": the sum
    # verl's agg_loss counts the sequences with a masked-in token; its geo_mean takes the
    # plain mean over every row of the call
    opts["seq_count"] = "rows" if mode == "geo_mean" else "nonempty"
    max_len = None
    if agg_mode == "seq-mean-token-sum-norm":
        # verl's ppo_loss copies loss_scale_factor into global_batch_info; agg_loss reads it there
        info = _cfg_get(actor_config, "global_batch_info", None) or {}
        max_len = _cfg_get(info, "loss_scale_factor", None)
        name = "global_batch_info.loss_scale_factor"
        if max_len is None:
            max_len, name = _cfg_get(actor_config, "loss_scale_factor", None), "loss_scale_factor"
        if max_len is None:
            max_len, name = response_length, "response_length"
        if max_len is None:
            raise ValueError("response_length: loss_agg_mode='seq-mean-token-sum-norm' without "
                             "loss_scale_factor divides by the response length T; pass it")
        num(name, max_len, "max_len")
    kl_on = _cfg_get(actor_config, "use_kl_loss", False)
    if not isinstance(kl_on, bool):
        raise ValueError(f"use_kl_loss: expected a bool, got {type(kl_on).__name__} {kl_on!r}")
    ent = num("entropy_coeff", _cfg_get(actor_config, "entropy_coeff", 0.0), "entropy_coef")
    if kl_on:
        kl_type = _cfg_get(actor_config, "kl_loss_type", "low_var_kl")
        if not isinstance(kl_type, str) or kl_type not in VERL_KL_TYPES:
            raise ValueError(f"kl_loss_type: gbc reproduces verl's {tuple(VERL_KL_TYPES)}, got "
                             f"{kl_type!r}")
        opts.update(kl_coef=num("kl_loss_coef", _cfg_get(actor_config, "kl_loss_coef", 0.001),
                                "kl_coef"),
                    kl_estimator=VERL_KL_TYPES[kl_type])
    opts["entropy_coef"] = ent
    if mode in ("sapo", "geo_mean"):
        # the policy term has its own aggregation there (seq-mean-token-mean; geo_mean: the
        # plain mean over the call's sequences); the KL and entropy terms keep loss_agg_mode
        if mode == "geo_mean" and agg != "token-mean" and (kl_on or ent):
            raise ValueError(f"loss_agg_mode: verl's geo_mean averages its policy term over "
                             f"every row of the micro-batch while its KL/entropy terms take "
                             f"loss_agg_mode={agg_mode!r} over the sequences with a masked-in "
                             f"token (or the global batch); gbc has one sequence count per "
                             f"call: use loss_agg_mode='token-mean' or 'token-sum' with "
                             f"geo_mean and a KL or entropy term")
        opts.update(kl_agg=agg if kl_on else None, entropy_agg=agg if ent else None,
                    normalise_all_terms=True)
    else:
        opts["loss_agg"] = agg
    opts["max_len"] = max_len
    opts.update(gbc_options)
    for field in gbc_options:         # a gbc option keeps gbc's name in errors
        names.pop(field, None)
    try:
        return gbc.PolicyLossConfig.preset(f"verl:{mode}", **opts)
    except (ValueError, TypeError) as err:
        raise methods.in_trainer_words(err, names) from None


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def batch_normalisers(actor_config, mask: torch.Tensor, global_batch_info=None) -> dict:
    """``num_items_in_batch`` / ``num_seqs_in_batch`` of one call as verl's ``agg_loss`` takes
    them from ``global_batch_info`` (default: ``actor_config.global_batch_info``): token-mean
    ``batch_num_tokens / dp_size``, token-sum ``1 / dp_size``, the sequence modes
    ``global_batch_size / dp_size``; what it lacks is the call's own count, as
    :func:`policy_loss_config` alone takes it (docs/math.md §12). No host sync."""
    info = dict(global_batch_info if global_batch_info is not None
                else (_cfg_get(actor_config, "global_batch_info", None) or {}))
    dp = info.get("dp_size")
    dp = 1 if dp is None else dp
    if not (_is_real(dp) and dp >= 1 and float(dp).is_integer()):
        raise ValueError(f"global_batch_info.dp_size: expected an int >= 1, got {dp!r}")
    for name in ("batch_num_tokens", "global_batch_size"):
        v = info.get(name)
        if v is not None and not isinstance(v, torch.Tensor) and not (
                _is_real(v) and v > 0 and math.isfinite(v)):
            raise ValueError(f"global_batch_info.{name}: expected None or a number > 0, "
                             f"got {v!r}")
    agg_mode = _cfg_get(actor_config, "loss_agg_mode", "token-mean")
    mode = _cfg_get(_cfg_get(actor_config, "policy_loss", None), "loss_mode", "vanilla")
    items = seqs = None
    if agg_mode == "token-mean":
        n = info.get("batch_num_tokens")
        if n is None and dp > 1:
            raise ValueError("global_batch_info: batch_num_tokens is required when dp_size > 1")
        items = None if n is None else n / dp
    elif agg_mode == "token-sum":
        items = 1.0 / dp
    if (agg_mode.startswith("seq-mean") and mode != "geo_mean") or mode == "sapo":
        gbs = info.get("global_batch_size")
        if gbs is None and dp > 1:
            raise ValueError("global_batch_info: global_batch_size is required when dp_size > 1")
        seqs = (mask.bool().any(-1).sum().clamp(min=1) if gbs is None else gbs / dp)
    return dict(num_items_in_batch=items, num_seqs_in_batch=seqs)


def response_rows(prompt_lens: torch.Tensor, response_lens: torch.Tensor,
                  max_response_len: Optional[int] = None, starts=None):
    """``(index [B, T], valid [B, T])``: the position in verl's packed layout (prompt then
    response per sequence, concatenated) whose output predicts response token ``t`` of sequence
    ``b`` (verl's ``no_padding_2_padding`` rule); padding positions point at 0. ``starts``
    ``[B]``: where each sequence begins in another layout (padded rows, megatron's
    ``cu_seqlens_q_padded``; default: packed end to end)."""
    plens, rlens = prompt_lens.long(), response_lens.long()
    if bool((plens <= 0).any()):
        raise ValueError("prompt_lens: every sequence needs a prompt token (its first response "
                         "token is predicted from the last prompt position)")
    if starts is None:
        lens = plens + rlens
        starts = lens.cumsum(0) - lens
    T = int(rlens.max()) if max_response_len is None else int(max_response_len)
    t = torch.arange(T, device=plens.device)
    valid = t[None] < rlens[:, None]
    index = starts[:, None] + plens[:, None] - 1 + t[None]
    return torch.where(valid, index, torch.zeros_like(index)), valid


# gbc's argument names -> verl's (its ppo_loss's and its batch keys), for gbc's errors
VERL_NAMES = {"logp": "log_prob", "mask": "response_mask", "old_logp": "old_log_prob",
              "ref_logp": "ref_log_prob", "is_ratio": "rollout_is_weights"}
FUSED_PACKED_NAMES = dict(VERL_NAMES, hidden="hidden_packed", targets="input_ids_rolled",
                          old_logp="old_log_probs", temperature="temperature")


def fused_ppo_loss_packed(hidden_packed, weight, input_ids_rolled, prompt_lens, response_lens,
                          response_mask, old_log_probs, advantages, actor_config,
                          global_batch_info=None, ref_log_prob=None, rollout_is_weights=None,
                          bias=None, temperature=None, backend="auto", phase=None,
                          token_scale=None, kl_weight=None, **gbc_options):
    """verl's ``ppo_loss`` on the packed hidden states ``[(1,) nnz, H]`` of a
    ``use_remove_padding`` micro-batch, without logits. ``input_ids_rolled``: verl's
    ``input_ids_rmpad_rolled`` ``[nnz]``; per-response tensors ``[B, T]`` (``token_scale``,
    ``kl_weight``: NTHR's / critical-token KL's, as the fused loss takes them); ``phase``:
    Lopti's; ``temperature``: a float or verl's ``temperature_rmpad`` ``[nnz]``. Returns
    ``(loss, metrics)``."""
    h2 = hidden_packed.reshape(-1, hidden_packed.shape[-1])
    T = response_mask.shape[1]
    index, valid = response_rows(prompt_lens, response_lens, T)
    h = h2[index]                                     # [B, T, H]: rows, not logits
    targets = input_ids_rolled.reshape(-1)[index]
    mask = response_mask.bool() & valid
    temp = temperature
    if isinstance(temperature, torch.Tensor) and temperature.numel() == h2.shape[0]:
        temp = temperature.reshape(-1)[index]
    cfg = policy_loss_config(actor_config, response_length=T, **gbc_options)
    norms = batch_normalisers(actor_config, mask, global_batch_info)

    def packed_rows():          # the response tokens' positions in the packed layout
        rows = torch.zeros(h2.shape[0], dtype=torch.bool, device=index.device)
        return rows.index_fill_(0, index[mask], True)

    recheck = {"targets": lambda: methods.check_ids(
        "input_ids_rolled", input_ids_rolled.reshape(-1), weight.shape[0], packed_rows())}
    if temp is not temperature:
        recheck["temperature"] = lambda: methods.check_temperatures(
            "temperature", temperature.reshape(-1), packed_rows())
    with methods.in_callers_words(FUSED_PACKED_NAMES, recheck):
        return gbc.fused_linear_policy_loss(
            h, weight, targets, mask, advantages, old_logp=old_log_probs,
            ref_logp=ref_log_prob if cfg.kl_coef else None, bias=bias, config=cfg,
            is_ratio=rollout_is_weights, temperature=temp, backend=backend, phase=phase,
            token_scale=token_scale, kl_weight=kl_weight, **norms)


@dataclasses.dataclass
class VerlGBCOptions:
    """A registered loss's method options, the verl loss it reproduces and the Lopti phase
    :meth:`phase` sets."""

    method_options: methods.MethodOptions = dataclasses.field(
        default_factory=methods.MethodOptions)
    base_loss_mode: str = "vanilla"
    current_phase: Optional[str] = None

    ar_alpha = property(lambda self: self.method_options.ar_alpha)
    lopti_eta = property(lambda self: self.method_options.lopti_eta)
    phases = property(lambda self: self.method_options.phases, doc="Lopti's phases, in order.")

    @contextlib.contextmanager
    def phase(self, which: str):
        """Run one Lopti update (``"low"`` or ``"high"``, in :attr:`phases` order) inside."""
        if which not in ("low", "high"):
            raise ValueError(f"phase: expected 'low' or 'high', got {which!r}")
        if self.lopti_eta is None:
            raise ValueError("phase: needs lopti_eta (register(..., lopti_eta=0.5))")
        prev, self.current_phase = self.current_phase, which
        try:
            yield self
        finally:
            self.current_phase = prev


def _cfg_get(config, name, default=None):
    if config is None:
        return default
    if hasattr(config, "get"):
        return config.get(name, default)
    return getattr(config, name, default)


class _PolicyTermOnly:
    """verl's actor config as the registered loss sees it: no KL or entropy term (verl adds
    them outside), the reproduced loss mode and the call's ``loss_agg_mode``."""

    def __init__(self, config, loss_mode, loss_agg_mode):
        self._config, self._agg = config, loss_agg_mode
        pl = _cfg_get(config, "policy_loss", None)
        self._pl = {k: _cfg_get(pl, k, None) for k in
                    ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio",
                     "ppo_kl_coef", "dro_beta")}
        self._pl["loss_mode"] = loss_mode

    def get(self, name, default=None):
        over = {"policy_loss": self._pl, "use_kl_loss": False, "entropy_coeff": 0.0,
                "loss_agg_mode": self._agg}
        return over[name] if name in over else _cfg_get(self._config, name, default)


# gbc's metrics of a loss call that verl's engines and the registered loss log (as
# ``actor/gbc_<name>``), each only where what it describes runs, so that a logged metric reads as
# its method on: AR's weight with ar_alpha > 0; Lopti's split (``low_frac``, the gradient share of
# the low-probability tokens and the summed norm the step's share is built from) with lopti_eta;
# Clip-Cov / KL-Cov's selection and support's forced targets (reported by the loss only there)
GBC_METRICS = ("ar_weight_mean", "low_frac", "cov_frac", "grad_share_low", "grad_norm_sum",
               "support_forced_frac")
AR_METRICS = ("ar_weight_mean",)
LOPTI_METRICS = ("low_frac", "grad_share_low", "grad_norm_sum")


def method_metric_names(options: methods.MethodOptions, metrics, names=GBC_METRICS) -> tuple:
    """The names of ``names`` that a loss call's ``metrics`` holds and whose method runs under
    ``options``: AR's (:data:`AR_METRICS`) with ``ar_alpha`` > 0, Lopti's
    (:data:`LOPTI_METRICS`) with ``lopti_eta`` set; the others as the loss reports them."""
    off = set()
    if not options.ar_alpha:
        off.update(AR_METRICS)
    if options.lopti_eta is None:
        off.update(LOPTI_METRICS)
    return tuple(n for n in names if n in metrics and n not in off)


def make_policy_loss(options: VerlGBCOptions):
    """verl's registered-loss function for ``options.base_loss_mode``, gbc's methods on top."""

    def gbc_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                        advantages: torch.Tensor, response_mask: torch.Tensor,
                        loss_agg_mode: str = "token-mean", config=None,
                        rollout_is_weights: Optional[torch.Tensor] = None):
        if config is None:
            raise ValueError("config: verl's actor config is required (clip ratios, "
                             "global_batch_info)")
        if loss_agg_mode not in VERL_AGG_MODES:
            raise ValueError(f"loss_agg_mode: expected one of {VERL_AGG_MODES}, "
                             f"got {loss_agg_mode!r}")
        mask = response_mask.bool()
        view = _PolicyTermOnly(config, options.base_loss_mode, loss_agg_mode)
        cfg = policy_loss_config(view, response_length=mask.shape[1],
                                 **options.method_options.loss_options())
        with methods.in_callers_words(VERL_NAMES):
            loss, m = gbc.policy_loss(log_prob, mask, advantages, old_logp=old_log_prob,
                                      config=cfg, phase=options.current_phase,
                                      is_ratio=rollout_is_weights,
                                      **batch_normalisers(view, mask))
        with torch.no_grad():     # verl's ppo_kl (its vanilla clamps the log-ratio at +-20)
            lr = log_prob - old_log_prob
            if cfg.log_ratio_clamp is not None:
                lr = lr.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
            fm = mask.to(lr.dtype)
            ppo_kl = (-lr * fm).sum() / (fm.sum() + 1e-8)
        metrics = {"actor/ppo_kl": ppo_kl.item(),
                   "actor/pg_clipfrac": (m["clip_frac_low"] + m["clip_frac_high"]).item()}
        if options.base_loss_mode == "vanilla":
            with torch.no_grad():     # verl's dual-clip share, from its vanilla loss
                ratio = lr.exp()
                a = advantages if advantages.dim() == 2 else advantages[:, None]
                pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - cfg.epsilon_low,
                                                                1 + cfg.epsilon_high))
                lower = ((pg > -a * cfg.clip_ratio_c) & (a < 0)).to(lr.dtype)
                metrics["actor/pg_clipfrac_lower"] = ((lower * fm).sum()
                                                      / (fm.sum() + 1e-8)).item()
        # those policy_loss has, of the methods that run
        for name in method_metric_names(options.method_options, m,
                                        ("low_frac", "ar_weight_mean", "cov_frac")):
            metrics[f"actor/gbc_{name}"] = m[name].item()
        return loss, metrics

    return gbc_policy_loss


# what the registry route cannot run, and what to use instead
REGISTRY_REFUSED = {
    "nthr": "NTHR's scores need the old policy's hidden states, which verl's registered loss "
            "never sees: use gbc's engine (GBC_VERL_ENGINE=1), or compute the scales and pass "
            "them in through scale_advantages()",
    "critical_kl_exponent": "verl adds its KL term outside the registered loss: use gbc's "
                            "engine (GBC_VERL_ENGINE=1), or weight verl's KL with "
                            "weighted_kl_penalty()",
    "logits_dtype": "the registered loss takes the log-probs verl's own head computed: use "
                    "gbc's engine (GBC_VERL_ENGINE=1), whose head computes them"}


def register(name: str = "gbc", base_loss_mode: str = "vanilla",
             **method_options) -> VerlGBCOptions:
    """Register gbc's policy loss with verl as ``name`` (select it with
    ``actor.policy_loss.loss_mode=<name>``, in a module verl's workers import), reproducing
    ``base_loss_mode``; AR and Lopti run, NTHR and critical-token KL are refused
    (:data:`REGISTRY_REFUSED`; docs/verl.md). Returns the options."""
    from verl.trainer.ppo.core_algos import register_policy_loss

    if base_loss_mode not in VERL_LOSS_MODES:
        raise ValueError(f"base_loss_mode: expected one of {VERL_LOSS_MODES}, got "
                         f"{base_loss_mode!r}")
    opts = methods.MethodOptions.from_kwargs(**method_options)
    for option, why in REGISTRY_REFUSED.items():
        if getattr(opts, option) not in (False, None):
            raise ValueError(f"{option}: not run by the registry route: {why}")
    options = VerlGBCOptions(opts, base_loss_mode)
    register_policy_loss(name)(make_policy_loss(options))
    return options


def scale_advantages(advantages: torch.Tensor, token_scale: torch.Tensor) -> torch.Tensor:
    """``advantages * token_scale`` (e.g. NTHR's ``res.scale``), for ``batch["advantages"]``."""
    if advantages.shape != token_scale.shape:
        raise ValueError(f"token_scale: expected shape {tuple(advantages.shape)} (the "
                         f"advantages'), got {tuple(token_scale.shape)}")
    return advantages * token_scale.to(advantages.dtype)


def weighted_kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                        kl_weight: Optional[torch.Tensor], kl_penalty: str = "low_var_kl"
                        ) -> torch.Tensor:
    """verl's per-token ``kl_penalty`` (its names) times the critical-token KL weights."""
    from verl.trainer.ppo.core_algos import kl_penalty as verl_kl_penalty

    kl = verl_kl_penalty(log_prob, ref_log_prob, kl_penalty)
    if kl_weight is None:
        return kl
    if kl_weight.shape != kl.shape:
        raise ValueError(f"kl_weight: expected shape {tuple(kl.shape)}, got "
                         f"{tuple(kl_weight.shape)}")
    return kl * kl_weight.to(kl.dtype)
