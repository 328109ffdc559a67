"""The hooks gbc puts on verl 0.9.1's trainers (the driver process: verl's ``TaskRunner``),
installed by :func:`gbc_kernels.integrations.verl.engine.enable` (:func:`patch_trainers`);
docs/verl.md:

* start-up: both trainers' ``__init__`` check ``support`` against the whole trainer config
  (:func:`check_trainer`, :func:`trainer_support_plan`: what the rollout config alone, which
  the workers see, cannot tell: whether verl's rollout correction runs);
* the legacy ``RayPPOTrainer``: its reference pass with the critical-token KL weights
  (:func:`compute_ref_log_prob`) and its old-policy pass with ``gbc_log_kept_mass``
  (:func:`compute_old_log_prob`);
* the v1 ``PPOTrainer``: its reference pass with the critical-token KL weights through the
  transfer queue (:func:`v1_put_kl_weights`); ``_compute_advantage`` keeps its batch's
  meta in reach of the rollout correction, which reads ``gbc_log_kept_mass`` from the transfer
  queue (:func:`v1_log_kept_mass`);
* verl's ``compute_rollout_correction_and_add_to_batch`` (``rollout_corr_helper`` and the v1
  trainer's binding of it) fed the rollout's log-probs as ``support`` needs them.

The engines' side (the worker's hooks, the registry) is :mod:`.engine`; what both share (the
options, the support plan of the rollout config, the switch's state) is :mod:`.options`, so
that neither imports the other at load time.
"""
from __future__ import annotations

import contextvars
import functools
import sys
from typing import Optional

import torch

from gbc_kernels import methods
from gbc_kernels.integrations.verl.options import (
    CERTAINTY_KEY, ENV_OPTIONS, KL_WEIGHT_KEY, LOG_KEPT_MASS_KEY, REFERENCE_PASS_FIELDS, ROLLOUT,
    SUPPORT_IDS_KEY, EngineOptions, SupportPlan, _OPTIONS, _PATCHES, _cfg, _check_nthr,
    _on_import, padded_support_ids, support_plan)

# where verl 0.9.1 defines what gbc wraps here (imported by verl's own processes; patched on
# import when they are not loaded yet)
TRAINER_MODULE = "verl.trainer.ppo.ray_trainer"
V1_TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"
CORRECTION_MODULE = "verl.trainer.ppo.rollout_corr_helper"


def trainer_support_plan(config, options) -> Optional[SupportPlan]:
    """:func:`support_plan` from the trainer's whole config (``actor_rollout_ref``,
    ``algorithm``), which also checks the rollout correction the mode feeds: ``kept_mass``
    needs verl's rollout correction to run (``calculate_log_probs``, ``algorithm.
    rollout_correction`` with ``rollout_is`` or ``rollout_rs``, not ``bypass_mode``); one kept
    set per rollout (``replay``'s default) needs verl's old-policy pass to build it (refused
    under ``bypass_mode``, naming ``support_set=per_pass``); NTHR is refused under ``replay``
    (its scores are the full vocabulary's)."""
    arr = _cfg(config, "actor_rollout_ref")
    rollout = _cfg(arr, "rollout")
    tp = []
    # the reference pass rebuilds the set under replay only (kept_mass's is the full
    # vocabulary's), and runs where verl uses a reference
    uses_ref = options.support == "replay" and (
        _cfg(_cfg(arr, "actor"), "use_kl_loss", False)
        or _cfg(_cfg(config, "algorithm"), "use_kl_in_reward", False))
    for role in ("actor", "ref") if uses_ref else ("actor",):
        part = _cfg(arr, role)
        if _cfg(part, "strategy") == "megatron":
            tp.append((f"actor_rollout_ref.{role}.megatron.tensor_model_parallel_size",
                       _cfg(_cfg(part, "megatron"), "tensor_model_parallel_size", 1)))
    plan = support_plan(options, rollout, tp)
    if plan is None:
        return None
    _check_nthr(options, plan)
    said = f"{ENV_OPTIONS} support={plan.mode}"
    rc = _cfg(_cfg(config, "algorithm"), "rollout_correction")
    if plan.one_set and rc is not None and _cfg(rc, "bypass_mode", False):
        raise ValueError(f"algorithm.rollout_correction.bypass_mode=True: {plan.said} scores "
                         f"every pass over the kept set verl's old-policy pass builds, and in "
                         f"bypass mode verl runs no old-policy pass (old_log_probs are the "
                         f"rollout's); the update cannot build it either (its later "
                         f"mini-batches and epochs score a policy that has moved); set "
                         f"support_set=per_pass in {ENV_OPTIONS} (each pass rebuilds the set "
                         f"from the model it scores), or bypass_mode=False")
    if plan.mode == "kept_mass":
        if not _cfg(rollout, "calculate_log_probs", False):
            raise ValueError(f"{ROLLOUT}.calculate_log_probs=False: {said} moves the rollout's "
                             f"log-probs in verl's rollout correction, and without them the "
                             f"correction does not run; set {ROLLOUT}.calculate_log_probs=True "
                             f"with algorithm.rollout_correction.rollout_is / rollout_rs, or "
                             f"unset support")
        if rc is None or _cfg(rc, "bypass_mode", False) or (
                _cfg(rc, "rollout_is") is None and _cfg(rc, "rollout_rs") is None):
            what = ("None" if rc is None else "bypass_mode=True" if _cfg(rc, "bypass_mode", False)
                    else "rollout_is=None and rollout_rs=None")
            raise ValueError(f"algorithm.rollout_correction: {what}: {said} corrects the "
                             f"importance weights / rejection mask verl's rollout correction "
                             f"computes from rollout_log_probs, and it computes none; set "
                             f"algorithm.rollout_correction.rollout_is or rollout_rs "
                             f"(bypass_mode=False), or unset support")
    return plan


def _critical_kl_metadata(trainer, opts) -> dict:
    """The reference pass's metadata that asks gbc's reference engine for the critical-token
    KL weights (``CERTAINTY_KEY``: the options of :data:`REFERENCE_PASS_FIELDS`); refused
    without verl's KL loss term to weight."""
    actor = trainer.config.actor_rollout_ref.actor
    if not actor.get("use_kl_loss", False):
        raise ValueError("critical_kl_exponent: verl's actor has no KL loss term to weight "
                         "(set actor_rollout_ref.actor.use_kl_loss=True)")
    return {CERTAINTY_KEY: {k: getattr(opts, k) for k in REFERENCE_PASS_FIELDS}}


def _no_kl_weights():
    return ValueError("critical_kl_exponent: the reference pass returned no KL weights; the "
                      "reference worker must run gbc's engine (GBC_VERL_ENGINE in every "
                      "worker, on an FSDP or Megatron reference)")


def compute_ref_log_prob(trainer, batch):
    """verl 0.9.1's ``RayPPOTrainer._compute_ref_log_prob`` that also returns the critical-token
    KL weights ``gbc_kl_weight`` from the same reference pass (verl's own without
    ``critical_kl_exponent``)."""
    opts = _OPTIONS.get("current") or EngineOptions()
    if opts.critical_kl_exponent is None:
        return _PATCHES.original(type(trainer), "_compute_ref_log_prob")(trainer, batch)
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    batch_td = left_right_2_no_padding(batch.to_tensordict())
    metadata = {"calculate_entropy": False, "compute_loss": False,
                **_critical_kl_metadata(trainer, opts)}
    if trainer.ref_in_actor:
        metadata["no_lora_adapter"] = True
    tu.assign_non_tensor(batch_td, **metadata)
    if trainer.ref_in_actor:
        output = trainer.actor_rollout_wg.compute_log_prob(batch_td)
    else:
        output = trainer.ref_policy_wg.compute_ref_log_prob(batch_td)
    weight = tu.get(output, KL_WEIGHT_KEY)
    if weight is None:
        raise _no_kl_weights()
    log_probs = no_padding_2_padding(tu.get(output, "log_probs"), batch_td)
    weight = no_padding_2_padding(weight, batch_td).float()
    return DataProto.from_tensordict(tu.get_tensordict(
        {"ref_log_prob": log_probs.float(), KL_WEIGHT_KEY: weight * batch.batch["response_mask"]}))


def _v1_ref_log_prob(original):
    """The v1 trainer's ``_compute_ref_log_prob`` (verl's own without ``critical_kl_exponent``)
    whose reference pass also computes the critical-token KL weights: the batch's
    ``extra_info`` (the worker's metadata) asks gbc's reference engine for them, verl's worker
    puts them in the transfer queue beside ``log_probs`` (every output field goes there), and
    they are put back per response token, times the response mask (as the legacy trainer's
    :func:`compute_ref_log_prob`), as ``gbc_kl_weight``: the update reads every field of its
    keys from the queue, so its KL term gets them."""

    @functools.wraps(original)
    def _compute_ref_log_prob(self, batch, *args, **kwargs):
        opts = _OPTIONS.get("current") or EngineOptions()
        if opts.critical_kl_exponent is None:
            return original(self, batch, *args, **kwargs)
        metadata = _critical_kl_metadata(self, opts)
        batch.extra_info.update(metadata)
        try:
            out = original(self, batch, *args, **kwargs)
        finally:        # the metadata of this pass only, not of the passes after it
            for key in metadata:
                batch.extra_info.pop(key, None)
        v1_put_kl_weights(batch, sys.modules[V1_TRAINER_MODULE])
        return out

    return _compute_ref_log_prob


def v1_put_kl_weights(meta, module) -> None:
    """verl's v1 trainer: the reference worker's ``gbc_kl_weight`` of the batch ``meta`` (a
    ``KVBatchMeta``; in the transfer queue as the worker put it, per sequence like its
    ``log_probs``) put back in the queue per response token (verl's ``response_from_nested``,
    as its ``ref_log_prob``), float32, times the response mask; refused when the worker put
    none."""
    from tensordict import TensorDict

    tq = module.tq
    try:
        data = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id,
                               select_fields=[KL_WEIGHT_KEY, "response_mask"])
    except Exception as exc:        # noqa: BLE001 - the field is missing
        raise _no_kl_weights() from exc
    if KL_WEIGHT_KEY not in data.keys():
        raise _no_kl_weights()
    mask = data["response_mask"]
    weight = module.response_from_nested(data[KL_WEIGHT_KEY], mask)
    rows = [w.float() * m.to(torch.float32) for w, m in zip(weight.unbind(), mask.unbind())]
    weight = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    tq.kv_batch_put(keys=meta.keys, partition_id=meta.partition_id,
                    fields=TensorDict({KL_WEIGHT_KEY: weight}, batch_size=len(meta.keys)))


_UNCHECKED = object()        # _OPTIONS["plan"] unset: the trainer's config was never checked
_V1_BATCH = contextvars.ContextVar("gbc_verl_v1_batch", default=None)


def check_trainer(config) -> Optional[SupportPlan]:
    """The trainer's start-up check of ``support`` against its config
    (:func:`trainer_support_plan`); the plan is kept for the trainer's passes."""
    opts = _OPTIONS.get("current") or EngineOptions()
    plan = trainer_support_plan(config, opts)
    _OPTIONS["plan"] = plan
    return plan


def _trainer_plan() -> Optional[SupportPlan]:
    opts = _OPTIONS.get("current") or EngineOptions()
    plan = _OPTIONS.get("plan", _UNCHECKED)
    if plan is _UNCHECKED:
        if opts.support is None:
            return None
        raise ValueError(f"{ENV_OPTIONS}: support={opts.support}: verl's trainer was not checked "
                         f"by gbc at its start (RayPPOTrainer / PPOTrainer __init__, patched by "
                         f"enable() when GBC_VERL_ENGINE is set in the trainer's process: pass "
                         f"it through ray_kwargs.ray_init.runtime_env)")
    return plan


def compute_old_log_prob(trainer, batch):
    """verl 0.9.1's ``RayPPOTrainer._compute_old_log_prob`` that also returns the old-policy
    pass's ``gbc_log_kept_mass`` (``[B, T]``) where the rollout correction takes it
    (:attr:`SupportPlan.corrects_sampler`) and, one kept set per rollout, the kept ids it
    built, ``gbc_support_ids`` (``methods.compact_support_ids``' form, ``[B, 1 + T + M]``
    int32: verl's batch carries ``4·(1 + M/T)`` bytes a token, not ``4·K``), which verl's ``union``
    puts in the batch its reference pass and update take; verl's own otherwise."""
    plan = _trainer_plan()
    if plan is None or not (plan.corrects_sampler or plan.one_set):
        return _PATCHES.original(type(trainer), "_compute_old_log_prob")(trainer, batch)
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    batch_td = left_right_2_no_padding(batch.to_tensordict())
    calculate_sum_pi_squared = trainer.config.actor_rollout_ref.actor.get(
        "calculate_sum_pi_squared", False)
    tu.assign_non_tensor(batch_td, calculate_entropy=True,
                         calculate_sum_pi_squared=calculate_sum_pi_squared, compute_loss=False)
    output = trainer.actor_rollout_wg.compute_log_prob(batch_td)
    result = {"old_log_probs": no_padding_2_padding(tu.get(output, "log_probs"),
                                                    batch_td).float(),
              "entropys": no_padding_2_padding(tu.get(output, "entropy"), batch_td).float()}
    for key, wanted in ((LOG_KEPT_MASS_KEY, plan.corrects_sampler),
                        (SUPPORT_IDS_KEY, plan.one_set)):
        got = tu.get(output, key)
        if not wanted:
            continue
        if got is None:
            raise ValueError(f"{plan.said}: the old-policy pass returned no {key!r}; the "
                             f"actor worker must run gbc's engine with the same {ENV_OPTIONS} "
                             f"(set it in every worker)")
        result[key] = (methods.compact_support_ids(padded_support_ids(got, batch_td))
                       if key == SUPPORT_IDS_KEY
                       else no_padding_2_padding(got, batch_td).float())
    routed_experts = tu.get(output, "routed_experts")
    if routed_experts is not None:
        result["routed_experts"] = routed_experts
    if calculate_sum_pi_squared:
        result["sum_pi_squared"] = no_padding_2_padding(tu.get(output, "sum_pi_squared"),
                                                        batch_td).float()
    mfu = tu.get(output, "metrics")["mfu"]
    return DataProto.from_tensordict(tu.get_tensordict(result)), mfu


def v1_log_kept_mass(meta, tq, response_from_nested, shape) -> Optional[torch.Tensor]:
    """verl's v1 trainer: the old-policy pass's ``gbc_log_kept_mass`` of the batch ``meta``
    (a ``KVBatchMeta``) from the transfer queue ``tq``, as the padded ``[B, T]`` ``shape`` of
    the rollout log-probs (None when the queue holds none)."""
    try:
        data = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id,
                               select_fields=[LOG_KEPT_MASS_KEY, "response_mask"])
    except Exception:        # noqa: BLE001 - the field is missing: refused by the caller
        return None
    if LOG_KEPT_MASS_KEY not in data.keys():
        return None
    kept = response_from_nested(data[LOG_KEPT_MASS_KEY], data["response_mask"])
    return torch.nested.to_padded_tensor(kept, 0.0, output_size=tuple(shape)).float()


def _kept_mass_of(batch, plan):
    """The old-policy pass's ``log_kept_mass`` ``[B, T]`` of a trainer batch: v0 carries it in
    the batch; v1 in the transfer queue (its batch's meta set by ``_compute_advantage``)."""
    if LOG_KEPT_MASS_KEY in batch.batch.keys():
        return batch.batch.pop(LOG_KEPT_MASS_KEY)
    meta, module = _V1_BATCH.get(), sys.modules.get(V1_TRAINER_MODULE)
    kept = None
    if meta is not None and module is not None:
        kept = v1_log_kept_mass(meta, module.tq, module.response_from_nested,
                                batch.batch["rollout_log_probs"].shape)
    if kept is None:
        raise ValueError(f"{ENV_OPTIONS}: support={plan.mode}: verl's rollout correction got no "
                         f"{LOG_KEPT_MASS_KEY!r} from the old-policy pass (gbc's engine returns "
                         f"it on the actor's compute_log_prob with entropy; verl's "
                         f"RayPPOTrainer / PPOTrainer hand it on as gbc patches them)")
    return kept


def _rollout_correction(original):
    """verl's ``compute_rollout_correction_and_add_to_batch`` fed the rollout's log-probs as
    ``support`` needs them (:func:`gbc_kernels.methods.corrected_sampler_logp`: ``kept_mass``
    ``+ log_kept_mass``; ``replay`` against SGLang ``- log_kept_mass``); the batch keeps verl's
    ``rollout_log_probs``. Adds ``rollout_corr/gbc_kept_mass_mean``."""

    @functools.wraps(original)
    def compute_rollout_correction_and_add_to_batch(batch, rollout_corr_config):
        plan = _trainer_plan()
        if plan is None or not plan.corrects_sampler:
            if LOG_KEPT_MASS_KEY in batch.batch.keys():
                batch.batch.pop(LOG_KEPT_MASS_KEY)
            return original(batch, rollout_corr_config)
        kept = _kept_mass_of(batch, plan)
        sampler = batch.batch["rollout_log_probs"]
        mask = batch.batch["response_mask"].bool()      # before verl's rejection
        batch.batch["rollout_log_probs"] = methods.corrected_sampler_logp(
            sampler, kept.to(sampler.device), plan.mode, plan.normalised)
        try:
            out, metrics = original(batch, rollout_corr_config)
        finally:
            batch.batch["rollout_log_probs"] = sampler
        out.batch["rollout_log_probs"] = sampler
        if bool(mask.any()):
            metrics = dict(metrics)
            metrics["rollout_corr/gbc_kept_mass_mean"] = float(
                kept.to(mask.device).exp()[mask].mean())
        return out, metrics

    return compute_rollout_correction_and_add_to_batch


def _v1_advantage(original):
    """The v1 trainer's ``_compute_advantage`` with its batch's meta in reach of the rollout
    correction (:func:`_kept_mass_of`)."""

    @functools.wraps(original)
    def _compute_advantage(self, batch, *args, **kwargs):
        token = _V1_BATCH.set(batch)
        try:
            return original(self, batch, *args, **kwargs)
        finally:
            _V1_BATCH.reset(token)

    return _compute_advantage


def _checked_init(original):
    """A trainer's ``__init__`` that checks ``support`` against its config first
    (:func:`check_trainer`)."""

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        check_trainer(config)
        return original(self, config, *args, **kwargs)

    return __init__


def _patch_trainer(module):
    def _compute_ref_log_prob(self, batch):
        return compute_ref_log_prob(self, batch)

    def _compute_old_log_prob(self, batch):
        return compute_old_log_prob(self, batch)

    cls = module.RayPPOTrainer
    _PATCHES.set(cls, "_compute_ref_log_prob",
                 functools.wraps(cls._compute_ref_log_prob)(_compute_ref_log_prob))
    _PATCHES.set(cls, "_compute_old_log_prob",
                 functools.wraps(cls._compute_old_log_prob)(_compute_old_log_prob))
    _PATCHES.set(cls, "__init__", _checked_init(cls.__init__))


def _patch_correction(module):
    name = "compute_rollout_correction_and_add_to_batch"
    _PATCHES.set(module, name, _rollout_correction(getattr(module, name)))


def _patch_v1_trainer(module):
    cls = module.PPOTrainer
    _PATCHES.set(cls, "__init__", _checked_init(cls.__init__))
    _PATCHES.set(cls, "_compute_ref_log_prob", _v1_ref_log_prob(cls._compute_ref_log_prob))
    _PATCHES.set(cls, "_compute_advantage", _v1_advantage(cls._compute_advantage))
    _patch_correction(module)        # its own binding of verl's rollout-correction function


def patch_trainers():
    """Patch verl's trainers and its rollout-correction function, now where they are imported
    and on import otherwise (run by :func:`.engine.enable`; undone by :func:`.engine.disable`);
    each hook acts only when its options are on."""
    _on_import(TRAINER_MODULE, _patch_trainer)
    _on_import(CORRECTION_MODULE, _patch_correction)
    _on_import(V1_TRAINER_MODULE, _patch_v1_trainer)
