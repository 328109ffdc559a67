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
  policy_loss_through_forward`, so DeepSpeed ZeRO-3 gathers the head as usual), with AR, Lopti,
  NTHR and critical-token KL on top;
* **two stages** (the no-grad passes): :func:`fused_action_log_probs` gives
  ``Actor.forward(sequences, action_mask, attention_mask)``'s action log-probs from the hidden
  states and the head (``fused_linear_logprobs``), no logits.

:func:`policy_loss_config` is the one mapping from OpenRLHF's arguments to
:class:`gbc_kernels.PolicyLossConfig`; an option gbc cannot honour is refused naming it.
:func:`enable` switches both on in a process (``ActorPPOTrainer.training_step`` and
``Actor.forward``); with Ray, give it to every worker as
``runtime_env={"worker_process_setup_hook": "gbc_kernels.integrations.openrlhf.enable"}``.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Optional

import torch

import gbc_kernels as gbc
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


def policy_loss_config(args, kl_coef: Optional[float] = None, temperature: float = 1.0,
                       **gbc_options) -> "gbc.PolicyLossConfig":
    """The :class:`gbc_kernels.PolicyLossConfig` of OpenRLHF 0.11.2's actor loss for ``args``
    (its parsed arguments: ``actor.eps_clip_low_high`` (or ``actor.eps_clip``),
    ``actor.dual_clip``, ``actor.policy_loss_type``, ``actor.loss_agg_mode``,
    ``actor.entropy_coef``, ``algo.kl.use_loss``/``estimator``/``unbiased_gradient``/
    ``init_coef``). ``kl_coef``: the step's KL coefficient (``kl_ctl``; default
    ``algo.kl.init_coef``); ``temperature``: the actor's. ``gbc_options`` add the gbc methods.

    OpenRLHF's policy term: PPO clip with the log-ratio clamped to ±20 (``ppo``) or GSPO's
    sequence ratio, gradient through its mean (``gspo``, always per-sequence aggregated); its KL
    and entropy terms are always token means over the batch normalisers (``aggregate_loss``'s
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
    low, high = (float(x) for x in eps)
    agg_mode = _get(args, "actor.loss_agg_mode", "token-mean")
    if agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"actor.loss_agg_mode: expected one of {LOSS_AGG_MODES}, got "
                         f"{agg_mode!r}")
    dual = _get(args, "actor.dual_clip")
    opts = dict(epsilon_low=low, epsilon_high=high,
                clip_ratio_c=None if dual is None else float(dual),
                loss_agg="token-mean" if (agg_mode == "token-mean" and plt == "ppo")
                else "seq-mean-token-mean", normalise_all_terms=True,
                temperature=float(temperature))
    if plt == "ppo":
        opts["log_ratio_clamp"] = 20.0
    else:
        opts["importance_sampling_level"] = "sequence"
    coef = kl_coef if kl_coef is not None else _get(args, "algo.kl.init_coef", 0.0)
    if bool(_get(args, "algo.kl.use_loss", False)) and _get(args, "algo.kl.init_coef", 0.0) > 0 \
            and coef:
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
        opts.update(kl_coef=float(coef), kl_estimator=est, kl_clamp=10.0,
                    kl_unbiased_gradient=unbiased, kl_agg="token-mean")
    ent = _get(args, "actor.entropy_coef")
    if ent:
        opts.update(entropy_coef=float(ent), entropy_agg="token-mean")
    elif ent is not None:
        opts["return_entropy"] = True          # OpenRLHF logs the entropy with a 0 coefficient
    opts.update(gbc_options)
    return gbc.PolicyLossConfig(**opts)


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


@torch.no_grad()
def fused_action_log_probs(actor, sequences, action_mask, attention_mask,
                           temperature: Optional[float] = None, backend: str = "auto"):
    """``Actor.forward(sequences, action_mask, attention_mask)``'s action log-probs (the
    old-policy and reference passes) from the decoder's hidden states and the lm_head: ``[B, T]``
    float32, zero where ``action_mask`` is 0, as OpenRLHF returns them. No ``[B, L, V]``
    logits."""
    model = _inner_model(actor)
    T = action_mask.shape[1]
    h = hf.hidden_states_through_forward(model, sequences, attention_mask, T,
                                         position_ids=_position_ids(attention_mask))
    head = hf.lm_head(model)
    temp = getattr(actor, "temperature", 1.0) if temperature is None else temperature
    logp = gbc.token_stats(h, head.weight, sequences[:, -T:], head.bias, temperature=temp,
                           backend=backend, logit_softcap=hf.logit_softcap(model)).logp
    return logp * action_mask.to(logp.dtype)


_STATE = SimpleNamespace(options={}, originals={})


def _actor_forward(self, sequences, action_mask=None, attention_mask=None, return_output=False,
                   allgather_logits=False, return_logprobs=False, ring_attn_group=None,
                   packed_seq_lens=None, return_entropy=False, **mm_inputs):
    """``Actor.forward`` with the no-grad action log-prob pass fused; every other use goes to
    OpenRLHF's own forward."""
    plain = (action_mask is not None and not return_output and not return_logprobs
             and not allgather_logits and not return_entropy and not mm_inputs
             and ring_attn_group is None and not getattr(self, "packing_samples", False)
             and not torch.is_grad_enabled())
    if plain:
        return fused_action_log_probs(self, sequences, action_mask, attention_mask)
    return _STATE.originals["forward"](
        self, sequences, action_mask, attention_mask=attention_mask, return_output=return_output,
        allgather_logits=allgather_logits, return_logprobs=return_logprobs,
        ring_attn_group=ring_attn_group, packed_seq_lens=packed_seq_lens,
        return_entropy=return_entropy, **mm_inputs)


def enable(actor_cls=None, trainer_cls=None, **gbc_options) -> None:
    """Switch the fused paths on in this process: OpenRLHF's ``Actor.forward`` takes the fused
    no-grad log-prob pass, and ``ActorPPOTrainer.training_step`` computes its loss with
    :func:`fused_actor_loss` (``gbc_options``: the gbc methods, e.g. ``ar_alpha=0.3``). Call it
    before the trainer is built (with Ray: ``runtime_env={"worker_process_setup_hook":
    "gbc_kernels.integrations.openrlhf.enable"}``). ``actor_cls``/``trainer_cls`` default to
    OpenRLHF's classes (imported here)."""
    gbc.PolicyLossConfig(**{k: v for k, v in gbc_options.items()})     # validates the options
    _STATE.options = dict(gbc_options)
    if actor_cls is None:
        from openrlhf.models import Actor as actor_cls
    if "forward" not in _STATE.originals:
        _STATE.originals["forward"] = actor_cls.forward
        actor_cls.forward = _actor_forward
    if trainer_cls is None:
        try:
            from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer as trainer_cls
        except ImportError:        # OpenRLHF's Ray trainer needs vLLM: not on a CPU machine
            trainer_cls = None
    if trainer_cls and "training_step" not in _STATE.originals:      # False: leave it
        _STATE.originals["training_step"] = trainer_cls.training_step
        trainer_cls.training_step = training_step


def disable(actor_cls=None, trainer_cls=None) -> None:
    """Undo :func:`enable`."""
    if actor_cls is None and "forward" in _STATE.originals:
        from openrlhf.models import Actor as actor_cls
    if "forward" in _STATE.originals:
        actor_cls.forward = _STATE.originals.pop("forward")
    if "training_step" in _STATE.originals:
        if trainer_cls is None:
            from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer as trainer_cls
        trainer_cls.training_step = _STATE.originals.pop("training_step")


def training_step(self, experience, kl_ctl: float, step: int, loss_batch_info=None):
    """``ActorPPOTrainer.training_step`` with the fused loss: the same loss normalisation
    (``get_loss_batch_info``), backward and optimizer step through OpenRLHF's strategy, EMA and
    logged metrics; the actor's logits are never formed."""
    from openrlhf.utils.loss_utils import get_loss_batch_info

    self.actor.train()
    dynamic = bool(_get(self.args, "train.dynamic_batch_enable", False))
    if loss_batch_info is None:
        loss_batch_info = get_loss_batch_info(self.strategy, experience.action_mask,
                                              replay_buffer=self.replay_buffer, step=step,
                                              dynamic_batch=dynamic)
    if getattr(experience, "mm_train_inputs", None) and getattr(self.actor, "is_vlm", False):
        raise ValueError("experience.mm_train_inputs: multimodal inputs are not supported by the "
                         "fused OpenRLHF loss yet")
    loss, metrics = fused_actor_loss(self.actor, experience, self.args, kl_ctl, loss_batch_info,
                                     **_STATE.options)
    aux_scale = None
    if dynamic and float(_get(self.args, "actor.aux_loss_coef", 0.0) or 0.0) > 1e-8:
        aux_scale = self.replay_buffer.dynamic_sample_loss_scale[step]
    if aux_scale is not None:
        raise ValueError("train.dynamic_batch_enable with actor.aux_loss_coef: the MoE loss's "
                         "dynamic scale is not supported by the fused OpenRLHF loss")
    self.strategy.backward(loss, self.actor, self.actor_optim)
    do_step = not dynamic or self.replay_buffer.dynamic_optimizer_step[step]
    if do_step:
        self.strategy.optimizer_step(self.actor_optim, self.actor, self.actor_scheduler,
                                     name="actor")
        if self.ema_model:
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
