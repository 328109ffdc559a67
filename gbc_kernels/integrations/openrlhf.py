"""OpenRLHF 0.11.2: the actor's loss and its log-prob passes without ``[N, V]`` logits.

OpenRLHF's ``Actor.forward`` (``openrlhf/models/actor.py``) copies the logits to float32,
divides them by the temperature and takes ``compute_entropy`` and ``log_probs_from_logits`` over
them, for the training pass, the old-policy pass and the reference pass. This module replaces
both uses:

* **one stage** (the training step): :func:`fused_actor_loss` computes what
  ``ActorPPOTrainer.training_step`` builds from the actor's output — ``PolicyLoss`` (``ppo`` and
  ``gspo``, ``eps_clip_low_high``, ``dual_clip``, its importance-sampling correction levels,
  modes and gates), the KL loss (``compute_approx_kl``: k1/k2/k3 with OpenRLHF's ±10 clamp and
  ``unbiased_gradient``), the entropy loss, and the aggregation with ``loss_batch_info`` — as one
  fused loss through the model's lm_head (:func:`gbc_kernels.integrations.hf.
  policy_loss_through_forward`, so DeepSpeed ZeRO-3 gathers the head as usual), with AR, Lopti
  (two optimizer steps per ``training_step``), NTHR (scales from one pass over the replay
  buffer before the update) and critical-token KL (weights from the reference pass) on top,
  the rules from :mod:`gbc_kernels.methods` (docs/openrlhf.md);
* **two stages** (the no-grad passes): :func:`fused_action_log_probs` gives
  ``Actor.forward(sequences, action_mask, attention_mask)``'s action log-probs from the hidden
  states and the head (``fused_linear_logprobs``), no logits.

:func:`policy_loss_config` is the one mapping from OpenRLHF's arguments to
:class:`gbc_kernels.PolicyLossConfig`; an option gbc cannot honour is refused naming it.
:func:`enable` switches both on in a process; with Ray, every worker runs it through
``runtime_env={"worker_process_setup_hook": "gbc_kernels.integrations.openrlhf.enable"}``
and reads its options from ``GBC_OPENRLHF_OPTIONS``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from types import SimpleNamespace
from typing import Optional

import torch

import gbc_kernels as gbc
from gbc_kernels import methods
from . import hf

POLICY_LOSS_TYPES = ("ppo", "gspo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_LEVELS = ("off", "token", "seq")


def _get(ns, path, default=None):
    """``args.actor.dual_clip`` as ``_get(args, "actor.dual_clip")`` (namespaces or dicts)."""
    cur = ns
    for part in path.split("."):
        if cur is None:
            return default
        cur = cur.get(part, None) if isinstance(cur, dict) else getattr(cur, part, None)
    return default if cur is None else cur


# gbc's field -> the OpenRLHF option it comes from (errors name the option the user set)
OPTION_NAMES = {"epsilon_low": "actor.eps_clip_low_high", "epsilon_high": "actor.eps_clip_low_high",
                "clip_ratio_c": "actor.dual_clip", "kl_coef": "algo.kl.init_coef",
                "entropy_coef": "actor.entropy_coef", "temperature": "temperature"}


def _number(name, value, nonneg=False):
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) \
        and math.isfinite(value) and (value >= 0 or not nonneg)
    if not ok:
        want = "a finite float" + (" >= 0" if nonneg else "")
        raise ValueError(f"{name}: expected {want}, got {type(value).__name__} {value!r}")
    return float(value)


def policy_loss_config(args, kl_coef: Optional[float] = None, temperature: float = 1.0,
                       **gbc_options) -> "gbc.PolicyLossConfig":
    """The :class:`gbc_kernels.PolicyLossConfig` of OpenRLHF 0.11.2's actor loss for ``args``
    (its parsed arguments: ``actor.eps_clip_low_high`` (or ``actor.eps_clip``),
    ``actor.dual_clip``, ``actor.policy_loss_type``, ``actor.loss_agg_mode``,
    ``actor.entropy_coef``, ``algo.kl.use_loss``/``estimator``/``unbiased_gradient``/
    ``init_coef``). ``kl_coef``: the step's KL coefficient (``kl_ctl``; default
    ``algo.kl.init_coef``); ``temperature``: the actor's. ``gbc_options`` add gbc's fields
    (e.g. ``ar_alpha``). A bad value is refused naming OpenRLHF's option.

    OpenRLHF's policy term (``preset("openrlhf:ppo")`` / ``"openrlhf:gspo"``): PPO clip with
    the log-ratio clamped to ±20, or GSPO's sequence ratio (always per-sequence aggregated);
    its KL and entropy terms are token means over the batch normalisers (``aggregate_loss``'s
    default), so they get their own aggregation with ``normalise_all_terms``.
    """
    plt = _get(args, "actor.policy_loss_type", "ppo")
    if plt not in POLICY_LOSS_TYPES:
        raise ValueError(f"actor.policy_loss_type: gbc reproduces OpenRLHF's {POLICY_LOSS_TYPES}, "
                         f"got {plt!r}")
    eps = _get(args, "actor.eps_clip_low_high")
    if eps is None:
        e = _get(args, "actor.eps_clip", 0.2)
        eps = (e, e)
    if isinstance(eps, (str, bytes)) or not hasattr(eps, "__len__") or len(eps) != 2:
        raise ValueError(f"actor.eps_clip_low_high: expected a pair (low, high) of floats, got "
                         f"{eps!r}")
    low, high = (_number("actor.eps_clip_low_high", x) for x in eps)
    agg_mode = _get(args, "actor.loss_agg_mode", "token-mean")
    if agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"actor.loss_agg_mode: expected one of {LOSS_AGG_MODES}, got "
                         f"{agg_mode!r}")
    dual = _get(args, "actor.dual_clip")
    opts = dict(epsilon_low=low, epsilon_high=high,
                clip_ratio_c=None if dual is None else _number("actor.dual_clip", dual),
                temperature=_number("temperature", temperature))
    if plt == "ppo":
        opts["loss_agg"] = "token-mean" if agg_mode == "token-mean" else "seq-mean-token-mean"
    init = _number("algo.kl.init_coef", _get(args, "algo.kl.init_coef", 0.0), nonneg=True)
    coef = init if kl_coef is None else _number("kl_ctl", float(kl_coef), nonneg=True)
    if bool(_get(args, "algo.kl.use_loss", False)) and init > 0 and coef:
        est = _get(args, "algo.kl.estimator", "k1")
        if est not in KL_ESTIMATORS:
            raise ValueError(f"algo.kl.estimator: expected one of {KL_ESTIMATORS}, got {est!r}")
        unbiased = bool(_get(args, "algo.kl.unbiased_gradient", False))
        if unbiased and plt == "gspo" and _get(args, "algo.advantage.is_correction_level",
                                               "off") != "off":
            raise ValueError("algo.kl.unbiased_gradient: with actor.policy_loss_type='gspo' and "
                             "an is_correction_level, gbc measures GSPO's ratio against the "
                             "rollout log-probs, while OpenRLHF weights the KL gradient by the "
                             "ratio to the old ones: not expressible in one call")
        opts.update(kl_coef=coef, kl_estimator=est, kl_clamp=10.0,
                    kl_unbiased_gradient=unbiased, kl_agg="token-mean")
    ent = _get(args, "actor.entropy_coef")
    if ent:
        opts.update(entropy_coef=_number("actor.entropy_coef", ent), entropy_agg="token-mean")
    elif ent is not None:
        opts["return_entropy"] = True          # OpenRLHF logs the entropy with a 0 coefficient
    opts.update(gbc_options)
    names = dict(OPTION_NAMES, kl_coef="kl_ctl" if kl_coef is not None else "algo.kl.init_coef")
    try:
        return gbc.PolicyLossConfig.preset(f"openrlhf:{plt}", **opts)
    except (TypeError, ValueError) as exc:
        field, _, rest = str(exc).partition(":")
        if field not in names or field in gbc_options:
            raise
        raise ValueError(f"{names[field]}:{rest} (gbc's {field})") from None


def batch_normalisers(loss_batch_info: Optional[dict]) -> dict:
    """``num_items_in_batch`` / ``num_seqs_in_batch`` from OpenRLHF's ``loss_batch_info``
    (``dp_size``, ``batch_num_tokens``, ``global_batch_size``; ``get_loss_batch_info``):
    ``aggregate_loss`` divides by ``batch_num_tokens / dp_size`` (token level) or
    ``global_batch_size / dp_size`` (sample level). None: the call's own tokens and its
    non-empty sequences (OpenRLHF's ``masked_mean``), counted by the caller."""
    if not loss_batch_info:
        return {}
    dp = loss_batch_info.get("dp_size") or 1
    out = {}
    n = loss_batch_info.get("batch_num_tokens")
    if n is not None:
        out["num_items_in_batch"] = n / dp
    g = loss_batch_info.get("global_batch_size")
    if g is not None:
        out["num_seqs_in_batch"] = g / dp
    return out


def is_correction(args, old_log_probs, rollout_log_probs, action_mask):
    """OpenRLHF's train/rollout importance-sampling correction of ``PolicyLoss`` (``ppo`` only),
    as the per-token weight the fused loss takes (``is_ratio``): the gated statistic per unit
    (a token, or a sequence's mean) clamps (``clip``) or drops (``mask``) the token ratio
    ``old / rollout``. Returns ``(is_ratio or None, metrics)`` with OpenRLHF's ``vllm_kl`` and
    ``is_filter_ratio``. No gradient."""
    level = _get(args, "algo.advantage.is_correction_level", "off")
    if level not in IS_LEVELS:
        raise ValueError(f"algo.advantage.is_correction_level: expected one of {IS_LEVELS}, got "
                         f"{level!r}")
    if level == "off" or _get(args, "actor.policy_loss_type", "ppo") != "ppo":
        return None, {}
    if rollout_log_probs is None:
        raise ValueError("rollout_log_probs: required with algo.advantage.is_correction_level="
                         f"{level!r}")
    mode = _get(args, "algo.advantage.is_correction_mode", "mask")
    gating = _get(args, "algo.advantage.is_correction_gating", "ratio")
    low, high = _get(args, "algo.advantage.is_correction_threshold", (0.5, 5.0))
    m = action_mask.to(old_log_probs.dtype)

    def mmean(x, dim=None):
        return (x * m).sum(dim=dim) / m.sum(dim=dim)

    with torch.no_grad():
        is_log = old_log_probs - rollout_log_probs
        token_is = is_log.exp()
        seq = level == "seq"
        if gating == "ratio":
            stat = (mmean(is_log, -1).unsqueeze(-1) if seq else is_log).exp()
        else:
            p = rollout_log_probs.exp().clamp(1e-6, 1 - 1e-6)
            q = old_log_probs.exp().clamp(1e-6, 1 - 1e-6)
            stat = (p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
                    if gating == "binary_kl" else (p - q).abs())
            if seq:
                stat = mmean(stat, -1).unsqueeze(-1)
        if mode == "clip":
            coef, filtered = stat.clamp(min=low, max=high), (stat < low) | (stat > high)
        else:
            keep = (stat >= low) & (stat <= high)
            coef, filtered = torch.where(keep, token_is, torch.zeros_like(token_is)), ~keep
        coef = coef.expand_as(old_log_probs)
        frac = filtered.float().mean() if seq else mmean(filtered.float())
        vllm_kl = mmean(rollout_log_probs - old_log_probs)
    return coef, {"vllm_kl": vllm_kl, "is_filter_ratio": frac}


def _inner_model(actor):
    """The transformers model inside OpenRLHF's ``Actor`` (itself maybe a DeepSpeed engine)."""
    while hasattr(actor, "module") and isinstance(actor.module, torch.nn.Module) \
            and not hasattr(actor, "model"):
        actor = actor.module
    return getattr(actor, "model", actor)


def _position_ids(attention_mask):
    """OpenRLHF's positions for left-padded, unpacked sequences (``Actor.forward``)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill_(attention_mask == 0, 1)


def fused_actor_loss(actor, experience, args, kl_ctl: float = 0.0, loss_batch_info=None,
                     temperature: Optional[float] = None, token_scale=None, kl_weight=None,
                     phase=None, **gbc_options):
    """The loss ``ActorPPOTrainer.training_step`` backpropagates — ``PolicyLoss`` +
    ``kl_ctl * kl_loss`` − ``entropy_coef * entropy_loss`` (+ the MoE balancing loss) — computed
    through the actor's lm_head without logits. ``experience``: OpenRLHF's ``Experience``
    (``sequences``, ``attention_mask``, ``action_mask``, ``action_log_probs``, ``advantages``,
    ``base_action_log_probs``, ``rollout_log_probs``). Returns ``(loss, metrics)``: the metrics
    OpenRLHF logs for the step (``policy_loss``, ``ppo_clip_ratio``, ``ppo_kl``, ``kl``,
    ``entropy_loss``, ``vllm_kl``, ``is_filter_ratio`` as they apply) and gbc's.

    Packed samples (``packing_samples``), ring attention and multimodal inputs are refused.
    """
    if getattr(actor, "packing_samples", False):
        raise ValueError("actor.packing_samples: the fused OpenRLHF loss takes padded batches; "
                         "packed samples (flash-attn varlen) are not supported")
    seq, am, mask = experience.sequences, experience.attention_mask, experience.action_mask
    T = mask.shape[1]
    temp = getattr(actor, "temperature", 1.0) if temperature is None else temperature
    cfg = policy_loss_config(args, kl_coef=kl_ctl, temperature=temp, **gbc_options)
    old = experience.action_log_probs
    coef, is_metrics = is_correction(args, old, getattr(experience, "rollout_log_probs", None),
                                     mask)
    ratio_base = old
    if cfg.importance_sampling_level == "sequence" and \
            _get(args, "algo.advantage.is_correction_level", "off") != "off":
        ratio_base = experience.rollout_log_probs     # OpenRLHF's GSPO against the rollout
    norms = batch_normalisers(loss_batch_info)
    m = mask.bool()
    if "num_seqs_in_batch" not in norms:
        norms["num_seqs_in_batch"] = m.any(-1).sum().clamp(min=1)
    aux = float(_get(args, "actor.aux_loss_coef", 0.0) or 0.0) > 1e-8
    model = _inner_model(actor)
    out = hf.policy_loss_through_forward(
        model, seq, am, T, m, experience.advantages, old_logp=ratio_base,
        ref_logp=experience.base_action_log_probs if cfg.kl_coef else None, config=cfg,
        token_scale=token_scale, kl_weight=kl_weight if cfg.kl_coef else None, phase=phase,
        is_ratio=coef, return_outputs=aux,
        model_kwargs={"position_ids": _position_ids(am)}, **norms)
    loss, metrics = out[0], out[1]
    if aux:
        loss = loss + out[2].aux_loss * float(_get(args, "actor.aux_loss_coef"))
    # OpenRLHF's logged values, from gbc's per-token means: a term aggregated over the batch
    # normalisers is its local mean times (local tokens / normaliser)
    with torch.no_grad():
        n_local = m.sum().to(torch.float32)
        scale = n_local / torch.as_tensor(norms.get("num_items_in_batch", n_local),
                                          dtype=torch.float32).clamp(min=1e-12)
        om = {"ppo_clip_ratio": metrics["clip_frac_low"] + metrics["clip_frac_high"]}
        lr_mean = metrics["log_ratio_mean"]
        if ratio_base is not old:          # gbc measured against the rollout: back to old
            lr_mean = lr_mean - ((old - ratio_base) * m).sum() / n_local.clamp(min=1)
        om["ppo_kl"] = -lr_mean
        actor_loss = loss.detach().float()
        if cfg.kl_coef:
            om["kl"] = metrics["kl"] * scale
            actor_loss = actor_loss - cfg.kl_coef * om["kl"]
        if "entropy" in metrics:
            om["entropy_loss"] = metrics["entropy"] * scale
            actor_loss = actor_loss + cfg.entropy_coef * om["entropy_loss"]
        om["policy_loss"] = actor_loss
        om.update(is_metrics)
    om.update({f"gbc/{k}": v for k, v in metrics.items()})
    return loss, om


def _pass_inputs(actor, sequences, action_mask, attention_mask, temperature):
    """(model, the hidden states predicting the actions, lm_head, temperature) of a no-grad
    pass of ``actor``."""
    model = _inner_model(actor)
    h = hf.hidden_states_through_forward(model, sequences, attention_mask, action_mask.shape[1],
                                         position_ids=_position_ids(attention_mask))
    temp = getattr(actor, "temperature", 1.0) if temperature is None else temperature
    return model, h, hf.lm_head(model), temp


@torch.no_grad()
def fused_action_log_probs(actor, sequences, action_mask, attention_mask,
                           temperature: Optional[float] = None, backend: str = "auto"):
    """``Actor.forward(sequences, action_mask, attention_mask)``'s action log-probs (the
    old-policy and reference passes) from the decoder's hidden states and the lm_head: ``[B, T]``
    float32, zero where ``action_mask`` is 0, as OpenRLHF returns them. No ``[B, L, V]``
    logits."""
    model, h, head, temp = _pass_inputs(actor, sequences, action_mask, attention_mask,
                                        temperature)
    T = action_mask.shape[1]
    logp = gbc.token_stats(h, head.weight, sequences[:, -T:], head.bias, temperature=temp,
                           backend=backend, logit_softcap=hf.logit_softcap(model)).logp
    return logp * action_mask.to(logp.dtype)


@torch.no_grad()
def fused_reference_pass(actor, sequences, action_mask, attention_mask, options,
                         temperature: Optional[float] = None, backend: str = "auto"):
    """The reference model's pass with critical-token KL (docs/math.md §5): ``(ref_logp,
    kl_weight)``, both ``[B, T]`` float32 and zero where ``action_mask`` is 0, from one
    streaming pass over the vocabulary (:func:`gbc_kernels.methods.reference_stats`)."""
    model, h, head, temp = _pass_inputs(actor, sequences, action_mask, attention_mask,
                                        temperature)
    T = action_mask.shape[1]
    st = methods.reference_stats(h, head.weight, sequences[:, -T:], options, bias=head.bias,
                                 temperature=temp, backend=backend,
                                 logit_softcap=hf.logit_softcap(model))
    m = action_mask.to(st.ref_logp.dtype)
    return st.ref_logp * m, st.kl_weight * m


ENV_OPTIONS = "GBC_OPENRLHF_OPTIONS"
METHOD_OPTIONS = tuple(f.name for f in dataclasses.fields(methods.MethodOptions))
# what the experience carries for gbc, in its ``info`` (split and merged with the samples)
INDEX_KEY, SCALE_KEY, KL_WEIGHT_KEY = "gbc_index", "gbc_nthr_scale", "gbc_kl_weight"
GBC_INFO_KEYS = (INDEX_KEY, SCALE_KEY, KL_WEIGHT_KEY)

_STATE = SimpleNamespace(options={}, methods=methods.MethodOptions(), originals={})


def parse_options(text: Optional[str]) -> dict:
    """``"lopti_eta=0.5,nthr=true"`` (the form :data:`ENV_OPTIONS` carries to Ray workers) ->
    keyword options (numbers, ``true``/``false``, ``none``, else strings). A repeated option is
    refused."""
    out = {}
    for name, value in methods.parse_items(text, ENV_OPTIONS).items():
        low = value.lower()
        if low in ("none", "null"):
            out[name] = None
        elif low in ("true", "false"):
            out[name] = low == "true"
        else:
            try:
                out[name] = int(value) if value.lstrip("+-").isdigit() else float(value)
            except ValueError:
                out[name] = value
    return out


def split_options(options: dict):
    """``enable``'s keyword options -> ``(MethodOptions, loss options)``: the method options
    (verl's engine names, :class:`gbc_kernels.methods.MethodOptions`) and any other
    :class:`gbc_kernels.PolicyLossConfig` field; both validated, an unknown name refused."""
    loss_fields = {f.name for f in dataclasses.fields(gbc.PolicyLossConfig)}
    method_kw = {k: v for k, v in options.items() if k in METHOD_OPTIONS}
    loss_kw = {k: v for k, v in options.items() if k not in METHOD_OPTIONS}
    for name in loss_kw:
        if name not in loss_fields:
            raise ValueError(f"{name}: not an option of the OpenRLHF drop-in (method options: "
                             f"{list(METHOD_OPTIONS)}; or a PolicyLossConfig field)")
    opts = methods.MethodOptions.from_kwargs(**method_kw)
    gbc.PolicyLossConfig(**loss_kw, **opts.loss_options())           # validates the rest
    return opts, loss_kw


def _is_reference(actor) -> bool:
    """Whether this ``Actor`` is OpenRLHF's reference model: a DeepSpeed engine built without
    an optimizer (``strategy.prepare(ref, is_rlhf=True)``), or marked ``gbc_reference``."""
    mark = getattr(actor, "gbc_reference", None)
    if mark is not None:
        return bool(mark)
    engine = getattr(actor, "model", None)
    return hasattr(engine, "module") and hasattr(engine, "optimizer") and engine.optimizer is None


def _actor_forward(self, sequences, action_mask=None, attention_mask=None, return_output=False,
                   allgather_logits=False, return_logprobs=False, ring_attn_group=None,
                   packed_seq_lens=None, return_entropy=False, **mm_inputs):
    """``Actor.forward`` with the no-grad action log-prob pass fused; every other use goes to
    OpenRLHF's own forward. With critical-token KL on, the reference model's pass returns
    ``[B, T, 2]``: its log-probs and the KL weights (unpacked where the experience reaches the
    replay buffer)."""
    plain = (action_mask is not None and not return_output and not return_logprobs
             and not allgather_logits and not return_entropy and not mm_inputs
             and ring_attn_group is None and not getattr(self, "packing_samples", False)
             and not torch.is_grad_enabled())
    if plain:
        if _STATE.methods.critical_kl_exponent is not None and _is_reference(self):
            return torch.stack(fused_reference_pass(self, sequences, action_mask,
                                                    attention_mask, _STATE.methods), -1)
        return fused_action_log_probs(self, sequences, action_mask, attention_mask)
    if _STATE.methods.critical_kl_exponent is not None and _is_reference(self):
        raise ValueError("critical_kl_exponent: the reference model's pass is not the plain "
                         "padded one (ring attention, packed samples or multimodal inputs): "
                         "its weights cannot be computed there")
    return _STATE.originals["forward"][2](
        self, sequences, action_mask, attention_mask=attention_mask, return_output=return_output,
        allgather_logits=allgather_logits, return_logprobs=return_logprobs,
        ring_attn_group=ring_attn_group, packed_seq_lens=packed_seq_lens,
        return_entropy=return_entropy, **mm_inputs)


def _buffer_append(self, experience):
    """``NaiveReplayBuffer.append`` that first keeps what gbc's methods need in the
    experience's ``info`` (split and merged with its samples): NTHR's ``Experience.index``
    (dropped by OpenRLHF's split), the critical-token KL weights the reference pass packed."""
    opts = _STATE.methods
    base = experience.base_action_log_probs
    if isinstance(base, torch.Tensor) and base.dim() == 3:
        experience.base_action_log_probs = base[..., 0].contiguous()
        experience.info[KL_WEIGHT_KEY] = base[..., 1].contiguous()
    elif opts.critical_kl_exponent is not None:
        raise ValueError("critical_kl_exponent: the experience carries no critical-token KL "
                         "weights (the reference model's workers must run enable() with the "
                         f"same options, e.g. through {ENV_OPTIONS}; and OpenRLHF must keep "
                         "the reference log-probs: algo.kl.use_loss)")
    if opts.nthr:
        if experience.index is None:
            raise ValueError("nthr: the experience has no Experience.index (NTHR's groups); "
                             "OpenRLHF drops it when it rebalances samples "
                             "(train.dynamic_batch_enable)")
        experience.info[INDEX_KEY] = torch.as_tensor(experience.index, dtype=torch.long)
    return _STATE.originals["append"][2](self, experience)


def _dp_group(strategy):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    mesh = getattr(strategy, "ds_device_mesh", None)
    return mesh["dp"].get_group() if mesh is not None else "world"


def check_trainer(trainer) -> None:
    """Refuse, naming them, the OpenRLHF settings the enabled methods cannot run with (called
    before the first step of each update)."""
    opts, args, strategy = _STATE.methods, trainer.args, trainer.strategy
    dynamic = bool(_get(args, "train.dynamic_batch_enable", False))
    if opts.lopti_eta is not None:
        gas = int(getattr(strategy, "accumulated_gradient", 1) or 1)
        if gas > 1:
            raise ValueError(
                f"lopti_eta: Lopti takes an optimizer step after each phase of a micro-batch, "
                f"and DeepSpeed steps only at gradient-accumulation boundaries; here "
                f"train.batch_size / (train.micro_batch_size x data-parallel size) = {gas} > 1 "
                f"would merge the phases (set train.micro_batch_size so that it is 1)")
        if dynamic:
            raise ValueError("lopti_eta: train.dynamic_batch_enable chooses its own optimizer "
                             "steps; Lopti needs one per phase")
    if opts.nthr or opts.critical_kl_exponent is not None:
        name = "nthr" if opts.nthr else "critical_kl_exponent"
        if dynamic:
            raise ValueError(f"{name}: train.dynamic_batch_enable rebalances the samples and "
                             f"drops what the method carries on the experience")
    if opts.nthr and (int(_get(args, "ds.ring_attn_size", 1) or 1) > 1
                      or int(_get(args, "ds.tensor_parallel_size", 1) or 1) > 1):
        raise ValueError("nthr: ds.ring_attn_size / ds.tensor_parallel_size > 1: NTHR's pass "
                         "takes whole sequences on one rank")
    if opts.critical_kl_exponent is not None:
        if not bool(_get(args, "algo.kl.use_loss", False)) or \
                not _get(args, "algo.kl.init_coef", 0.0):
            raise ValueError("critical_kl_exponent: the loss has no KL term to weight (set "
                             "algo.kl.use_loss and algo.kl.init_coef > 0)")


@torch.no_grad()
def nthr_pass(trainer) -> dict:
    """NTHR's token scales (docs/math.md §4) for the rank's whole replay buffer, before the
    update's first optimizer step (OpenRLHF shuffles its samples afterwards): the old policy's
    hidden states and log-sum-exp (the actor before the update: in OpenRLHF's loop the policy
    that gave ``action_log_probs``),
    groups ``Experience.index // rollout.n_samples_per_prompt`` (a group split over
    data-parallel ranks is merged), correct responses by
    :func:`gbc_kernels.methods.correct_from_advantages`. Each sample's scale goes into its
    ``info`` (``gbc_nthr_scale``). Returns NTHR's metrics."""
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch

    items = trainer.replay_buffer.items
    if not items:
        return {}
    if any(INDEX_KEY not in it.info for it in items):
        raise ValueError("nthr: the replay buffer's samples carry no Experience.index (enable() "
                         "must run in this process before the experience is appended)")
    n = int(_get(trainer.args, "rollout.n_samples_per_prompt", 1) or 1)
    actor = trainer.actor
    model = _inner_model(actor)
    device = next(model.parameters()).device
    mb = max(1, int(getattr(trainer.replay_buffer, "sample_batch_size", 0) or len(items)))
    parts = []
    was_training = actor.training
    actor.eval()
    try:
        for i in range(0, len(items), mb):
            exp = make_experience_batch(items[i:i + mb])
            seq, am = exp.sequences.to(device), exp.attention_mask.to(device)
            mask = exp.action_mask.to(device).bool()
            T = mask.shape[1]
            h = hf.hidden_states_through_forward(model, seq, am, T,
                                                 position_ids=_position_ids(am))
            parts.append((h, seq[:, -T:], mask, exp.advantages.to(device).float()))
    finally:
        actor.train(was_training)
    Tm = max(p[2].shape[1] for p in parts)

    def cat(k):                              # right-pad every part to Tm, then stack
        out = []
        for p in parts:
            x = p[k].new_zeros((p[k].shape[0], Tm) + tuple(p[k].shape[2:]))
            x[:, :p[k].shape[1]] = p[k]
            out.append(x)
        return torch.cat(out)

    hidden, targets, mask, adv = (cat(k) for k in range(4))
    gids = torch.stack([torch.as_tensor(it.info[INDEX_KEY]).reshape(()) for it in items]) // n
    head = hf.lm_head(model)
    params = [p for p in (head.weight, head.bias) if p is not None and hasattr(p, "ds_id")]
    if params:                               # ZeRO-3: the head exists only when gathered
        import deepspeed
        gather = deepspeed.zero.GatheredParameters(params)
    else:
        gather = contextlib.nullcontext()
    with gather:
        head = hf.lm_head(model)
        res = methods.nthr_token_scale(
            hidden, head.weight, targets, mask, gids.to(device), adv, _STATE.methods,
            bias=head.bias, temperature=getattr(actor, "temperature", 1.0),
            logit_softcap=hf.logit_softcap(model),
            data_parallel_group=_dp_group(trainer.strategy))
    for k, it in enumerate(items):
        it.info[SCALE_KEY] = res.scale[k, :it.action_mask.shape[-1]].float().to(
            it.action_mask.device)
    return {f"gbc/{k}": float(v) for k, v in methods.nthr_metrics(res, adv, mask).items()}


def _ppo_train(self, kl_ctl: float):
    """``ActorPPOTrainer.ppo_train`` after gbc's start-up checks and NTHR's pass."""
    check_trainer(self)
    extra = nthr_pass(self) if _STATE.methods.nthr else {}
    status = _STATE.originals["ppo_train"][2](self, kl_ctl)
    status.update(extra)
    return status


def _patch(key, cls, attr, fn):
    if key not in _STATE.originals:
        _STATE.originals[key] = (cls, attr, getattr(cls, attr))
        setattr(cls, attr, fn)


def enable(actor_cls=None, trainer_cls=None, buffer_cls=None, **options) -> None:
    """Switch the fused paths and gbc's methods on in this process: OpenRLHF's
    ``Actor.forward`` takes the fused no-grad log-prob pass, ``ActorPPOTrainer.training_step``
    computes its loss with :func:`fused_actor_loss`, and the methods run (docs/openrlhf.md).

    ``options``: the method options of :class:`gbc_kernels.methods.MethodOptions` (verl's
    engine names: ``ar_alpha``, ``lopti_eta``, ``lopti_order``, ``nthr``, ``nthr_beta``,
    ``nthr_eta``, ``critical_kl_exponent``, ``critical_kl_intercept``,
    ``critical_kl_certainty``, ``critical_kl_temperature``) and any other
    :class:`gbc_kernels.PolicyLossConfig` field; none given: read from the environment variable
    :data:`ENV_OPTIONS` (``"lopti_eta=0.5,nthr=true"``), the way Ray workers get them
    (``runtime_env={"env_vars": {...}, "worker_process_setup_hook":
    "gbc_kernels.integrations.openrlhf.enable"}``). Settings a method cannot run with are
    refused before the first step (:func:`check_trainer`). ``actor_cls`` / ``trainer_cls`` /
    ``buffer_cls`` default to OpenRLHF's ``Actor``, ``ActorPPOTrainer`` (needs vLLM; False:
    leave it) and ``NaiveReplayBuffer``."""
    if not options:
        options = parse_options(os.environ.get(ENV_OPTIONS))
    opts, loss_options = split_options(options)
    _STATE.methods, _STATE.options = opts, loss_options
    if actor_cls is None:
        from openrlhf.models import Actor as actor_cls
    _patch("forward", actor_cls, "forward", _actor_forward)
    if trainer_cls is None:
        try:
            from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer as trainer_cls
        except ImportError:        # OpenRLHF's Ray trainer needs vLLM: not on a CPU machine
            trainer_cls = None
    if trainer_cls:                                                  # False: leave it
        _patch("training_step", trainer_cls, "training_step", training_step)
        _patch("ppo_train", trainer_cls, "ppo_train", _ppo_train)
    if opts.nthr or opts.critical_kl_exponent is not None:
        if buffer_cls is None:
            from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer as buffer_cls
        _patch("append", buffer_cls, "append", _buffer_append)


def disable(actor_cls=None, trainer_cls=None, buffer_cls=None) -> None:
    """Undo :func:`enable` (every patched class gets its own method back)."""
    for key in list(_STATE.originals):
        cls, attr, fn = _STATE.originals.pop(key)
        setattr(cls, attr, fn)
    _STATE.methods, _STATE.options = methods.MethodOptions(), {}


def _info_rows(experience, key, T, fill):
    """A per-sample ``[T]`` row kept in ``experience.info`` (a list after OpenRLHF's merge),
    padded / cut to the batch's ``T``: ``[B, T]`` float32, or None."""
    rows = experience.info.get(key)
    if rows is None:
        return None
    device = experience.action_mask.device
    if isinstance(rows, torch.Tensor) and rows.dim() == 2:
        rows = list(rows)
    out = torch.full((len(rows), T), float(fill), dtype=torch.float32, device=device)
    for i, r in enumerate(rows):
        r = torch.as_tensor(r)[:T]
        out[i, :r.shape[0]] = r.to(device=device, dtype=torch.float32)
    return out


def _restore_schedule(scheduler, state):
    """Put a learning-rate scheduler (and its optimizer's rates) back to ``state``."""
    scheduler.load_state_dict(state)
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


def training_step(self, experience, kl_ctl: float, step: int, loss_batch_info=None):
    """``ActorPPOTrainer.training_step`` with the fused loss: the same loss normalisation
    (``get_loss_batch_info``), backward and optimizer step through OpenRLHF's strategy, EMA and
    logged metrics; the actor's logits are never formed. With Lopti, two optimizer steps (one
    per phase, the order ``lopti_order``), both against the experience's
    ``action_log_probs``; the learning-rate scheduler advances once. NTHR's token scales and
    the critical-token KL weights come from the experience (:func:`nthr_pass`, the reference
    pass)."""
    from openrlhf.utils.loss_utils import get_loss_batch_info

    opts = _STATE.methods
    check_trainer(self)
    self.actor.train()
    dynamic = bool(_get(self.args, "train.dynamic_batch_enable", False))
    if loss_batch_info is None:
        loss_batch_info = get_loss_batch_info(self.strategy, experience.action_mask,
                                              replay_buffer=self.replay_buffer, step=step,
                                              dynamic_batch=dynamic)
    if getattr(experience, "mm_train_inputs", None) and getattr(self.actor, "is_vlm", False):
        raise ValueError("experience.mm_train_inputs: multimodal inputs are not supported by the "
                         "fused OpenRLHF loss yet")
    T = experience.action_mask.shape[1]
    token_scale = _info_rows(experience, SCALE_KEY, T, 1.0) if opts.nthr else None
    if opts.nthr and token_scale is None:
        raise ValueError("nthr: the experience carries no NTHR scales (computed by the patched "
                         "ActorPPOTrainer.ppo_train, or nthr_pass(trainer), before the update)")
    kl_weight = None
    if opts.critical_kl_exponent is not None:
        kl_weight = _info_rows(experience, KL_WEIGHT_KEY, T, 0.0)
        if kl_weight is None:
            raise ValueError("critical_kl_exponent: the experience carries no critical-token KL "
                             "weights (the reference pass stores them; see enable())")
    for key in GBC_INFO_KEYS:
        experience.info.pop(key, None)
    if dynamic and float(_get(self.args, "actor.aux_loss_coef", 0.0) or 0.0) > 1e-8:
        raise ValueError("train.dynamic_batch_enable with actor.aux_loss_coef: the MoE loss's "
                         "dynamic scale is not supported by the fused OpenRLHF loss")
    do_step = not dynamic or self.replay_buffer.dynamic_optimizer_step[step]
    phases = opts.phases
    results = []
    for i, phase in enumerate(phases):
        loss, m = fused_actor_loss(self.actor, experience, self.args, kl_ctl, loss_batch_info,
                                   token_scale=token_scale, kl_weight=kl_weight, phase=phase,
                                   **opts.loss_options(), **_STATE.options)
        self.strategy.backward(loss, self.actor, self.actor_optim)
        if do_step:
            last = i == len(phases) - 1
            sched = self.actor_scheduler
            keep = None if last or sched is None else sched.state_dict()
            self.strategy.optimizer_step(self.actor_optim, self.actor, sched, name="actor")
            if keep is not None:                 # one scheduler step per batch
                _restore_schedule(sched, keep)
        results.append(m)
    metrics = dict(results[0])
    if len(results) > 1:         # the loss terms of the two phases add up to the batch's
        for k in ("policy_loss", "kl", "entropy_loss"):
            if k in metrics:
                metrics[k] = results[0][k] + results[1][k]
        if all("gbc/grad_norm_sum" in r for r in results):
            share = methods.lopti_grad_share_low(
                [(None, {"grad_norm_sum": r["gbc/grad_norm_sum"]}) for r in results],
                opts.lopti_order)
            metrics["gbc/lopti_grad_share_low"] = torch.tensor(share)
    if do_step and self.ema_model:
        self.strategy.moving_average(self.actor, self.ema_model, self.ema_beta, "cuda")
    for k in ("ppo_clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio", "kl"):
        if k in metrics:
            experience.info[k] = metrics[k].detach()
    # OpenRLHF's status: 0-d tensors weighted by token, per-sample tensors by sample, meta as is
    out = {"policy_loss": metrics["policy_loss"]}
    weights = {"policy_loss": "token"}
    if "entropy_loss" in metrics:
        out["entropy_loss"], weights["entropy_loss"] = metrics["entropy_loss"], "token"
    out["actor_lr"], weights["actor_lr"] = self.actor_scheduler.get_last_lr()[0], None
    if do_step:
        out["actor_grad_norm"] = self.strategy.get_grad_norm(self.actor)
        weights["actor_grad_norm"] = None
    for k, v in list(experience.info.items()) + [(k, v) for k, v in metrics.items()
                                                  if k.startswith("gbc/")]:
        if isinstance(v, torch.Tensor):
            out[k], weights[k] = v, "token" if v.dim() == 0 else "sample"
        elif isinstance(v, list):
            out[k], weights[k] = torch.tensor(v, dtype=torch.float), "sample"
    for f in dataclasses.fields(type(experience)):
        if f.name in {"rewards", "scores"} or not type(experience).is_episode_tensor_field(f.name):
            continue
        value = getattr(experience, f.name)
        if isinstance(value, torch.Tensor) and f.name not in out:
            out[f.name], weights[f.name] = value, "sample"
    mask = experience.action_mask
    return {"metrics": out, "weights": weights, "num_samples": float(mask.shape[0]),
            "num_action_tokens": float(mask.sum().item())}
