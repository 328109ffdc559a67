"""``GBCGRPOTrainer``: ``trl.GRPOTrainer`` with its loss computed from the policy's hidden
states and ``lm_head``, no logits, and AR, Lopti, NTHR and critical-token KL in its step;
docs/trl.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import PurePath
from types import ModuleType
from typing import Optional

import torch
from trl import GRPOConfig, GRPOTrainer

import gbc_kernels as gbc
from gbc_kernels import methods
from .. import hf
from .config import (NUM_ITEMS_LOSS_TYPES, PPO_LOSS_TYPES, _in_trl_words, _Options,
                     _unsupported, check_trl_version, method_options, support_truncation)


# the inputs of a vision-language model's forward that TRL's batches carry (num_images and
# num_tiles only slice them into micro-batches; over a whole batch every slice is the whole)
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes",
                    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _model_inputs(batch) -> dict:
    """The multimodal inputs of ``batch`` for the model's forward over the whole batch, as
    TRL's ``_get_per_token_logps_and_entropies`` gives them (empty for text)."""
    return {k: batch[k] for k in _MULTIMODAL_KEYS if batch.get(k) is not None}


def _logit_scale(model) -> float:
    """The factor transformers models multiply their logits by (1.0 for most), read as TRL's
    fused head reads it; with final-logit soft-capping too, refused (their order is unknown)."""
    cfg = model.config.get_text_config()
    scale = next((getattr(cfg, k) for k in ("logit_scale", "output_multiplier",
                                             "lm_head_multiplier")
                  if getattr(cfg, k, None) is not None), None)
    if scale is None and getattr(cfg, "logits_scaling", None) is not None:
        scale = (cfg.logits_scaling if cfg.model_type == "hyperclovax"
                 else 1.0 / cfg.logits_scaling)
    scale = 1.0 if scale is None else float(scale)
    if not scale > 0:
        raise ValueError(f"model: logit scale {scale} is not supported (expected > 0)")
    if scale != 1.0 and hf.logit_softcap(model) is not None:
        raise ValueError(f"model: a logit scale ({scale}) together with final_logit_softcapping "
                         "is not supported")
    return scale


# Unsloth's packages and the folder its generated trainers live in (module or directory names)
_UNSLOTH_PACKAGES = ("unsloth", "unsloth_zoo", "unsloth_compiled_cache")


def _unsloth_name(name) -> bool:
    """A module or directory of Unsloth's: ``unsloth``, ``unsloth_zoo``, the compiled cache
    (``unsloth_compiled_cache``) and the trainers generated there (``UnslothGRPOTrainer``, any
    ``Unsloth*Trainer``). Only those names: a user's folder such as ``~/venvs/unsloth-env`` is
    not Unsloth's."""
    name = str(name or "")
    return name in _UNSLOTH_PACKAGES or (name.startswith("Unsloth") and name.endswith("Trainer"))


def _from_unsloth(obj) -> bool:
    """``obj`` (a class, a function, an instance) was defined by Unsloth: its module, or for a
    function its file (a ``functools.wraps`` wrapper keeps TRL's ``__module__``), is Unsloth's."""
    if isinstance(obj, ModuleType):     # a lazy module's __getattr__ may import on a lookup
        return False
    try:
        if _unsloth_name(str(getattr(obj, "__module__", None) or "").split(".")[0]):
            return True
        code = getattr(getattr(obj, "__func__", obj), "__code__", None)
        return code is not None and any(map(_unsloth_name,
                                            PurePath(code.co_filename).parts[:-1]))
    except Exception:                   # a lazy object that cannot answer is not Unsloth's
        return False


def _unsloth_patches(trainer_cls, args=None) -> list:
    """What shows that Unsloth has patched TRL or transformers in this process (empty: nothing):
    ``unsloth`` imported; a class of Unsloth's among ``trainer_cls``'s or the config's bases, or
    an attribute of those bases (transformers' ``Trainer`` and ``TrainingArguments`` among them)
    replaced by Unsloth's; a name of a loaded ``trl`` module now bound to Unsloth's object."""
    found = []
    if sys.modules.get("unsloth") is not None:
        found.append("the unsloth package is imported")
    trl_base = next((c for c in trainer_cls.__mro__ if c.__name__.endswith("GRPOTrainer")
                     and not issubclass(c, GBCGRPOTrainer)), None)
    if trl_base is not None and trl_base.__module__ != "trl.trainer.grpo_trainer":
        found.append(f"{trainer_cls.__name__}'s base is {trl_base.__module__}."
                     f"{trl_base.__qualname__}, not TRL's GRPOTrainer")
    for cls in (trainer_cls, GRPOConfig if args is None else type(args)):
        base = next((c for c in cls.__mro__ if _from_unsloth(c)), None)
        if base is not None:
            found.append(f"{cls.__name__} subclasses {base.__module__}.{base.__qualname__}")
        found += [f"{c.__module__}.{c.__qualname__}.{key}" for c in cls.__mro__
                  if c is not object and not _from_unsloth(c)
                  for key, value in list(vars(c).items()) if _from_unsloth(value)]
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "trl" or name.startswith("trl.")):
            found += [f"{name}.{key}" for key, value in list(vars(module).items())
                      if _from_unsloth(value)]
    found = list(dict.fromkeys(found))
    found.sort(key=lambda f: "GRPOTrainer" not in f)  # the trainer's rebinding first
    return found


def check_no_unsloth(trainer_cls=None, args=None):
    """Raises ``RuntimeError`` when Unsloth has patched TRL in this process (docs/trl.md,
    "Unsloth"): whatever the import order, gbc's loss or the step around it would not be
    TRL's. A class with ``_gbc_unsloth_route = True`` (gbc's Unsloth trainer, which runs gbc's
    loss and passes on Unsloth's generated trainer and makes its own checks) is let through."""
    if getattr(trainer_cls, "_gbc_unsloth_route", False):
        return
    found = _unsloth_patches(GBCGRPOTrainer if trainer_cls is None else trainer_cls, args)
    if not found:
        return
    shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
    raise RuntimeError(
        f"GBCGRPOTrainer: Unsloth has patched TRL in this process ({shown}). Unsloth replaces "
        "trl.GRPOTrainer by its own rewritten trainer (UnslothGRPOTrainer, with its own "
        "compute_loss and log-prob passes): a GBCGRPOTrainer on it would run Unsloth's loss, "
        "and gbc's fused loss and every gbc_* option (AR, Lopti, NTHR, critical-token KL) "
        "would be bypassed. Importing gbc before unsloth does not help: Unsloth still replaces "
        "TRL's generation unwrap and gradient-checkpointing toggle and, once a model is loaded "
        "through FastLanguageModel, transformers.Trainer's training_step and training loop, "
        "which scale the loss gbc computes (on its CPU backend: GRPOConfig's __post_init__ and "
        "TRL's fused head). Inside Unsloth, use gbc's Unsloth trainer: `import unsloth` first, "
        "then `from gbc_kernels.integrations.unsloth import GBCUnslothGRPOTrainer` "
        "(docs/unsloth.md); or GBCGRPOTrainer in a process that does not import unsloth (the "
        "model loaded with transformers, LoRA with PEFT).")


# Lopti on-policy: the old policy's log-probs, fixed at the rollout for both updates
OLD_LOGP_KEY = "gbc_old_logp"
# NTHR on policy inside the update's forward: each completion's group (num_generations)
NTHR_GROUP_KEY = "gbc_nthr_group"
# gbc_support=replay, one kept set per rollout: the set the building pass kept for each token
# (the target not forced in) in the compact form, [B, 1 + T + M] int32 (methods.compact_support_ids:
# each token's count, then each sequence's ids); a key of TRL's batch, so that TRL's shuffle and
# split (shuffle_sequence_dict, split_tensor_dict: along B) carry it to each micro-batch
SUPPORT_IDS_KEY = "gbc_support_ids"


def _policy_loss_building_ids(model, input_ids, attention_mask, completion_len, mask,
                              advantages, old_logp=None, ref_logp=None, config=None,
                              unwrapped=None, return_outputs=True, model_kwargs=None,
                              old_policy=None, **loss_kwargs):
    """:func:`hf.policy_loss_through_forward` (same arguments, ``return_outputs`` True, no
    ``old_policy``) for the update that builds the rollout's kept set: the loss with
    ``sampler_truncation`` and ``return_support_ids`` (docs/trl.md, "The sampler's kept set").
    Returns ``(loss, metrics, (outputs, support_ids))``."""
    if old_policy is not None or not return_outputs:
        raise RuntimeError("gbc_support=replay: the update that builds the kept set takes no "
                           "old_policy and returns the forward's outputs")
    inner = hf.unwrap(model) if unwrapped is None else unwrapped
    T = hf.check_forward_inputs(inner, input_ids, attention_mask, completion_len)
    cfg = config
    cap = hf.logit_softcap(inner)
    if cap is not None and cfg.logit_softcap is None:
        cfg = dataclasses.replace(cfg, logit_softcap=cap)
    targets = input_ids[:, -T:]

    def compute(h):
        head = hf.lm_head(inner)          # the weight as the wrapper holds it right now
        with hf.targets_as_input_ids(input_ids, T, head, mask):
            out = gbc.fused_linear_policy_loss(
                h.to(head.weight.dtype), head.weight, targets, mask, advantages,
                old_logp=old_logp, ref_logp=ref_logp, bias=head.bias, config=cfg,
                return_support_ids=True, **loss_kwargs)
        return out, out[0]

    (loss, metrics, ids), outputs = hf._through_head(model, inner, input_ids, attention_mask, T,
                                                     compute, model_kwargs)
    loss = loss + (outputs.logits.float() * 0).sum()    # 0 to the value and every gradient
    return loss, metrics, (outputs, ids)


class GBCGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose loss is :func:`gbc_kernels.fused_linear_policy_loss`; ``args``:
    a :class:`GBCGRPOConfig` (a plain ``GRPOConfig``: every gbc option off)."""

    # NTHR on policy: scored inside the update's forward where it can be (_gbc_nthr_in_update);
    # False: always by a pass at the rollout (its scales are the same)
    _gbc_nthr_in_forward = True
    # True only on gbc's Unsloth trainer (check_no_unsloth lets it through; it checks its own)
    _gbc_unsloth_route = False

    def __init__(self, model, reward_funcs, args: Optional[GRPOConfig] = None, *a, **kw):
        check_no_unsloth(type(self), args)       # before anything is built (docs/trl.md)
        check_trl_version()
        if args is not None:
            self._gbc_check_args(args)
        super().__init__(model, reward_funcs, args, *a, **kw)
        if args is None:                 # TRL built its default GRPOConfig
            self._gbc_check_args(self.args)
        self.gbc_args = _Options(self.args)
        self.gbc_methods = method_options(self.args)
        self._gbc_check_model()
        # gbc_support: the sampler's kept set rebuilt from top_k / top_p / min_p (None: off)
        self._gbc_truncation = support_truncation(self.args)
        # gbc_support, during a rollout: its no-grad passes, (logp, log m, what TRL got)
        self._gbc_support_calls = None
        # replay with one set per rollout, during a rollout: "ids" (the built set), "ref" (the
        # placeholder TRL's reference pass got before any set was built: run again after it)
        self._gbc_rollout_set = None
        self._gbc_check_support()
        # Lopti's state: the phase, the window's kept micro-batches, the phases' gradient norms
        self._gbc_phase = self._gbc_reuse_inputs = self._gbc_last_inputs = None
        self._gbc_logged_loss = None       # Lopti: the first phase's unsplit loss, to log
        self._gbc_ref_calls = None       # critical KL: the rollout's no-grad passes' KL weights
        self._gbc_window, self._gbc_norms, self._gbc_first_norm = [], {}, None

    # ---------------------------------------------------------------- construction checks
    @staticmethod
    def _gbc_check_args(args):
        bad = _unsupported(args)
        if bad:
            raise ValueError("GBCGRPOTrainer: unsupported option(s):\n  " + "\n  ".join(bad))

    def _gbc_check_model(self):
        args = self.gbc_args
        unwrapped = self.accelerator.unwrap_model(self.model)
        hf.lm_head(unwrapped)
        hf.decoder(unwrapped)
        self._gbc_temperature = self.temperature / _logit_scale(unwrapped)
        self._gbc_softcap = hf.logit_softcap(unwrapped)
        if (args.gbc_critical_kl_exponent is not None and self.ref_model is None
                and not hasattr(unwrapped, "disable_adapter")):
            raise ValueError("gbc_critical_kl_exponent: needs a reference model (trainer.ref_model"
                             " is None and the model is not a PEFT model whose base serves as "
                             "the reference)")
        if args.gbc_lopti_eta is not None:
            from accelerate.utils import DistributedType
            if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
                raise ValueError("gbc_lopti_eta: not supported under DeepSpeed (its engine steps "
                                 "the optimizer inside backward)")

    def _gbc_check_support(self):
        """What only the built trainer shows that ``gbc_support`` cannot run: a user rollout
        (``rollout_func``: its sampler is unknown), a vLLM server whose log-probs are not the
        processed ones (asked on the main process, the answer shared so every process refuses
        alike)."""
        mode = self.gbc_methods.support
        if mode is None:
            return
        name = f"gbc_support={mode}"
        if getattr(self, "rollout_func", None) is not None:
            raise ValueError(f"{name}: rollout_func: a user rollout returns its own log-probs "
                             "from a sampler whose settings gbc cannot read; unset gbc_support")
        if self.use_vllm and self.vllm_mode == "server":
            from accelerate.utils import broadcast_object_list

            found = [None]
            if self.accelerator.is_main_process:
                info = self.vllm_generation.vllm_client.get_server_info()
                found[0] = (info.get("model_config") or {}).get("logprobs_mode")
            found = broadcast_object_list(found, from_process=0)[0]
            if found != "processed_logprobs":
                raise ValueError(
                    f"{name}: the vLLM server returns logprobs_mode={found!r} log-probs; the "
                    "kept set's correction needs processed_logprobs (after the temperature and "
                    "the filters, normalised over the kept set). Restart it with "
                    "`trl vllm-serve` (which sets --logprobs-mode processed_logprobs) without "
                    "overriding that flag")

    @_in_trl_words()
    def _gbc_config(self, entropy_coef: float, lopti: bool = True) -> gbc.PolicyLossConfig:
        """TRL's loss_type as gbc's preset, with TRL's options on the other axes. ``lopti=False``:
        Lopti's threshold off (an evaluation loss: both phases' terms, no update)."""
        args = self.gbc_args
        lt = args.loss_type
        return gbc.PolicyLossConfig.preset(
            lt, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
            max_len=args.max_completion_length if lt == "dr_grpo" else None,
            temperature=self._gbc_temperature, kl_coef=self.beta, kl_estimator="k3",
            kl_ratio_correction=bool(args.use_bias_correction_kl), entropy_coef=entropy_coef,
            ar_alpha=args.gbc_ar_alpha, lopti_eta=args.gbc_lopti_eta if lopti else None,
            importance_sampling_level=args.importance_sampling_level,
            delta=args.delta if lt in PPO_LOSS_TYPES else None,      # TRL ignores it elsewhere
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=args.vespo_lambda_neg,
            top_entropy_quantile=self.top_entropy_quantile,
            off_policy_mask_threshold=self.off_policy_mask_threshold,
            return_entropy=True,                     # TRL logs the entropy whatever the loss
            logit_softcap=self._gbc_softcap, logits_dtype=self.gbc_methods.logits_dtype)

    # ---------------------------------------------------------------- the no-grad passes
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                           logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False,
                                           **multimodal):
        """TRL's no-grad old-policy and reference passes by the training loss's row passes
        (an on-policy ratio is exactly 1), inside the model's forward; with gradients, the MoE
        aux loss or multimodal inputs: TRL's own pass (refused under ``gbc_support``). Under
        ``gbc_support``: :meth:`_gbc_support_pass`."""
        mode = self.gbc_methods.support
        if (torch.is_grad_enabled() or compute_aux_loss
                or any(v is not None for v in multimodal.values())):
            if mode is not None:
                raise ValueError(
                    f"gbc_support={mode}: this pass would run TRL's own log-probs (with "
                    "gradients, the MoE aux loss or images), which cannot rebuild the "
                    "sampler's kept set; not supported (a text model without the MoE aux "
                    "loss runs gbc's passes)")
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss,
                **multimodal)
        if mode == "replay" or (mode == "kept_mass" and self._gbc_support_calls == []):
            return self._gbc_support_pass(model, input_ids, attention_mask, logits_to_keep,
                                          compute_entropy)
        calls = self._gbc_ref_calls
        if calls is not None and not compute_entropy:
            # critical-token KL on: this may be TRL's reference pass; take the KL weights from
            # the same sweep (its log-probs are the same as without them)
            st = hf.reference_pass(
                model, input_ids, attention_mask, input_ids[:, -logits_to_keep:],
                temperature=self._gbc_temperature, backend=self.gbc_args.gbc_backend,
                completion_len=logits_to_keep, options=self.gbc_methods,
                unwrapped=self.accelerator.unwrap_model(model))
            calls.append(st.kl_weight)
            return st.ref_logp, None, None
        logp, entropy = hf.logprobs_through_forward(
            model, input_ids, attention_mask, logits_to_keep, temperature=self._gbc_temperature,
            return_entropy=compute_entropy, backend=self.gbc_args.gbc_backend,
            unwrapped=self.accelerator.unwrap_model(model),
            logits_dtype=self.gbc_methods.logits_dtype)
        if calls is not None:
            calls.append(None)
        return logp, entropy, None

    def _gbc_support_pass(self, model, input_ids, attention_mask, T, compute_entropy,
                          build=False):
        """A no-grad pass under ``gbc_support`` (docs/trl.md, "The sampler's kept set").
        ``replay``: the log-probs (and entropies; under critical-token KL, the reference's
        weights from its certainty over its kept set) over the kept set. One set per rollout
        (``gbc_support_set`` "rollout", the default): TRL's old-policy pass (or ``build``:
        gbc's own policy pass, :meth:`_gbc_rollout_set_passes`) builds it from the sampling
        policy's logits and keeps its ids in ``_gbc_rollout_set``; a later pass of the rollout
        replays them (``support_ids``: the reference's log-probs over the sampler's set); TRL's
        reference pass before any set (no old-policy pass) gets a placeholder and runs again
        once the set is built. ``per_pass``: the set rebuilt from this pass's own logits at
        the rollout temperature. ``kept_mass``, the rollout's old-policy
        pass (its first no-grad pass): the whole vocabulary's log-probs, bit for bit, and
        ``log m = LSE_S - LSE_V`` from the same sweep; TRL gets ``logp - log m``, so that its
        own ratio code (every ``vllm_importance_sampling_mode``, its ``sampling/*`` metrics)
        computes ``exp(old - (sampling + log m))``, and :meth:`_generate_and_score_completions`
        puts the true ``logp`` back."""
        opts, tr = self.gbc_methods, self._gbc_truncation
        unwrapped = self.accelerator.unwrap_model(model)
        targets = input_ids[:, -T:]
        crit = self._gbc_ref_calls
        kept_mass = opts.support == "kept_mass"
        # TRL's old-policy pass is the rollout's first no-grad pass when it runs
        old_pass = build or (self._gbc_support_calls == [] and self._gbc_trl_old_pass_runs())
        reference = (opts.support == "replay" and crit is not None and not compute_entropy
                     and not old_pass)
        hf.check_forward_inputs(unwrapped, input_ids, attention_mask, T)
        state = self._gbc_rollout_set          # None: per pass, or outside a rollout
        ids = None if state is None else state.get("ids")
        build = state is not None and old_pass
        if state is not None and not build and ids is None:
            # TRL's reference pass, no set built yet (TRL ran no old-policy pass): a
            # placeholder now, the pass again over the set once gbc's policy pass built it
            # (under PEFT this pass runs with the adapter disabled: the policy cannot run here)
            state["ref"] = torch.zeros(input_ids.shape[0], T, device=input_ids.device)
            for calls in (crit, self._gbc_support_calls):
                if calls is not None:
                    calls.append(None)
            return state["ref"], None, None
        # the set: replayed (support_ids), built here (kept in state) or rebuilt per pass
        kept = (dict(support_ids=ids) if ids is not None
                else dict(sampler_truncation=tr, return_support_ids=build))

        def compute(h, head, cap):
            with hf.targets_as_input_ids(input_ids, T, head):
                if reference:
                    return methods.reference_stats(
                        h, head.weight, targets, opts, head.bias,
                        temperature=self._gbc_temperature, logit_softcap=cap,
                        backend=self.gbc_args.gbc_backend, **kept)
                return gbc.token_stats(
                    h, head.weight, targets, head.bias, temperature=self._gbc_temperature,
                    backend=self.gbc_args.gbc_backend, logit_softcap=cap,
                    logits_dtype=opts.logits_dtype, return_log_kept_mass=True,
                    over_support=not kept_mass, **(dict(sampler_truncation=tr)
                                                    if kept_mass else kept))

        st = hf.in_head(model, input_ids, attention_mask, T, None, compute, unwrapped)
        if build:
            state["ids"] = st.support_ids
        if reference:
            crit.append(st.kl_weight)
            if self._gbc_support_calls is not None:
                self._gbc_support_calls.append((st.ref_logp, None, st.ref_logp))
            return st.ref_logp, None, None
        if crit is not None:
            crit.append(None)          # not a reference pass (or TRL asked for entropies)
        if kept_mass:
            shifted = st.logp - st.log_kept_mass
            self._gbc_support_calls.append((st.logp, st.log_kept_mass, shifted))
            return shifted, None, None
        if self._gbc_support_calls is not None:
            self._gbc_support_calls.append((st.logp, st.log_kept_mass, st.logp))
        return st.logp, (st.entropy if compute_entropy else None), None

    # ---------------------------------------------------------------- rollout: NTHR, critical KL
    def _generate_and_score_completions(self, inputs):
        """TRL's rollout, then gbc's no-grad passes over the whole generation batch: the old
        policy's (Lopti's fixed ``old_logp``, NTHR's scales). Critical-token KL's weights come
        from TRL's own reference pass (its last no-grad pass: ``beta != 0`` is checked)."""
        opts, args = self.gbc_methods, self.gbc_args
        crit = opts.critical_kl_exponent is not None
        self._gbc_ref_calls = [] if crit and self.model.training else None
        self._gbc_support_calls = [] if opts.support is not None else None
        self._gbc_rollout_set = {} if opts.one_set_per_rollout else None
        try:
            out = super()._generate_and_score_completions(inputs)
            if self._gbc_rollout_set is not None:
                self._gbc_rollout_set_passes(out)
        finally:
            ref_calls, self._gbc_ref_calls = self._gbc_ref_calls, None
            support_calls, self._gbc_support_calls = self._gbc_support_calls, None
            self._gbc_rollout_set = None
        if opts.support is not None:
            self._gbc_support_rollout(out, support_calls)
        if not self.model.training or not (opts.needs_old_pass or crit):
            return out
        model_kwargs = _model_inputs(out)
        completion_ids = out["completion_ids"]
        T = completion_ids.size(1)
        input_ids = torch.cat([out["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out \
            else out["completion_mask"]
        own_old = (opts.support == "replay" and opts.lopti_eta is not None
                   and out.get("old_per_token_logps") is None)
        if own_old and OLD_LOGP_KEY not in out:        # per pass (one set: already built)
            # Lopti's fixed old log-probs over the kept set, as the update's (hf's old-policy
            # pass is the vocabulary's; NTHR is refused under replay)
            with torch.no_grad():
                out[OLD_LOGP_KEY] = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, T)[0]
        if opts.needs_old_pass and not own_old:
            nthr = {}
            if opts.nthr:
                B, G = completion_ids.size(0), self.num_generations
                if B % G:
                    raise ValueError(f"gbc_nthr: this process holds {B} completions, not a "
                                     f"multiple of num_generations={G}; NTHR needs whole groups")
                nthr = dict(group_ids=torch.arange(B, device=completion_ids.device) // G,
                            advantages=out["advantages"], nthr=True, nthr_beta=opts.nthr_beta,
                            nthr_eta=opts.nthr_eta)
            # TRL's own old-policy log-probs when it computed them (num_iterations > 1, vLLM);
            # on-policy, this pass fixes them before Lopti's first update
            trl_old = out.get("old_per_token_logps")
            if self._gbc_nthr_in_update(trl_old, model_kwargs):
                # the update's one forward runs on this policy, each micro-batch whole groups:
                # NTHR there, from its hidden states (no pass here)
                out[NTHR_GROUP_KEY] = nthr["group_ids"]
                nthr = {}
            if nthr or opts.lopti_eta is not None:
                res = hf.old_policy_pass(                          # no-grad passes
                    self.accelerator.unwrap_model(self.model), input_ids, attention_mask,
                    completion_ids, mask, temperature=self._gbc_temperature,
                    backend=args.gbc_backend, completion_len=T, old_logp=trl_old,
                    model_kwargs=model_kwargs, logits_dtype=opts.logits_dtype, **nthr)
                if trl_old is None and opts.lopti_eta is not None:
                    out[OLD_LOGP_KEY] = res.old_logp
                if nthr:
                    out["gbc_token_scale"] = res.token_scale
                    self._gbc_log_nthr(res.nthr, out["advantages"], mask)
        if crit and ref_calls and ref_calls[-1] is not None:
            out["gbc_kl_weight"] = ref_calls[-1]          # no pass of our own
        elif crit:
            # TRL's reference pass ran its own forward (a vision-language batch): ours, on the
            # same reference TRL uses (PEFT: the "ref" adapter if loaded, else none)
            ref_model, ctx = self.ref_model, contextlib.nullcontext()
            if ref_model is None:
                from trl.trainer.utils import use_adapter
                ref_model = self.accelerator.unwrap_model(self.model)
                ctx = use_adapter(ref_model, "ref" if "ref" in ref_model.peft_config else None)
            with ctx:
                ref = hf.reference_pass(
                    ref_model, input_ids, attention_mask, completion_ids,
                    temperature=self._gbc_temperature, backend=args.gbc_backend,
                    completion_len=T, model_kwargs=model_kwargs, options=opts)
            out["gbc_kl_weight"] = ref.kl_weight
        return out

    def _gbc_rollout_set_passes(self, out):
        """One kept set per rollout, after TRL's rollout (docs/trl.md, "The sampler's kept
        set"): where TRL ran no old-policy pass and the set is needed before the update (TRL's
        reference pass ran on a placeholder; Lopti's fixed old log-probs), gbc's own no-grad
        pass of the policy builds it (the rollout's first scoring with the sampling weights;
        its log-probs are Lopti's ``gbc_old_logp``), then the reference pass runs again over
        it, on the reference TRL used (PEFT: the "ref" adapter if loaded, else none). The ids
        go into ``out`` compact (:data:`SUPPORT_IDS_KEY`); with none built here (no old-policy pass,
        ``beta = 0``, no Lopti) the update builds them (:meth:`_compute_loss`)."""
        state = self._gbc_rollout_set
        T = out["completion_ids"].size(1)
        input_ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention_mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        placeholder = state.get("ref")
        if placeholder is not None and out.get("ref_per_token_logps") is not placeholder:
            raise RuntimeError("gbc_support_set=rollout: TRL's rollout did not take its "
                               "reference log-probs from gbc's reference pass")
        own_old = (self.model.training and self.gbc_methods.lopti_eta is not None
                   and out.get("old_per_token_logps") is None)
        with torch.no_grad():
            if state.get("ids") is None and (placeholder is not None or own_old):
                logp = self._gbc_support_pass(self.model, input_ids, attention_mask, T, False,
                                              build=True)[0]
                if own_old:
                    out[OLD_LOGP_KEY] = logp
            if placeholder is not None:
                ref_model, ctx = self.ref_model, contextlib.nullcontext()
                if ref_model is None:
                    from trl.trainer.utils import use_adapter
                    inner = self.accelerator.unwrap_model(self.model)
                    ref_model = self.model
                    ctx = use_adapter(inner, "ref" if "ref" in inner.peft_config else None)
                with ctx:
                    out["ref_per_token_logps"] = self._gbc_support_pass(
                        ref_model, input_ids, attention_mask, T, False)[0]
        if state.get("ids") is not None:
            out[SUPPORT_IDS_KEY] = methods.compact_support_ids(state["ids"])

    def _gbc_trl_old_pass_runs(self) -> bool:
        """Whether TRL's rollout runs its old-policy pass (``grpo_trainer.py``, TRL 1.16: the
        generation not aligned with the optimizer steps, or vLLM's importance sampling)."""
        every = self.args.steps_per_generation * self.num_iterations
        return bool(self.args.gradient_accumulation_steps % every != 0
                    or (self.use_vllm and self.vllm_importance_sampling_correction))

    def _gbc_support_rollout(self, out, calls):
        """``gbc_support`` after TRL's rollout. ``kept_mass``: the old-policy pass's true
        log-probs back in ``old_per_token_logps`` (TRL's ratio was computed from ``logp - log
        m``: :meth:`_gbc_support_pass`) and the sampler's log-probs moved by ``log m``
        (:func:`methods.corrected_sampler_logp`) for the off-policy mask. Both modes log
        ``gbc/kept_mass``, the mean kept mass ``m`` over the response tokens under the old
        policy (the bias of the uncorrected ratio), when the old-policy pass ran."""
        mode = self.gbc_methods.support
        old = out.get("old_per_token_logps")
        first = calls[0] if calls else None
        if mode == "kept_mass":
            if old is None or first is None or first[2] is not old:
                raise RuntimeError("gbc_support=kept_mass: TRL's rollout did not take its "
                                   "importance-sampling ratio from gbc's old-policy pass")
            logp, lkm = first[0], first[1] * out["completion_mask"].to(first[1].dtype)
            out["old_per_token_logps"] = logp
            if out.get("sampling_per_token_logps") is not None:
                out["sampling_per_token_logps"] = methods.corrected_sampler_logp(
                    out["sampling_per_token_logps"], lkm, "kept_mass", normalised=True)
        if old is None or first is None or first[1] is None:
            return
        mask = out["completion_mask"] if "tool_mask" not in out \
            else out["completion_mask"] * out["tool_mask"]
        m = mask.to(torch.float32)
        local = torch.stack([(first[1].float().exp() * m).sum(), m.sum()])
        total = self.accelerator.gather(local).view(-1, 2).sum(0)
        mode_name = "train" if self.model.training else "eval"
        self._metrics[mode_name]["gbc/kept_mass"].append(
            (total[0] / total[1].clamp(min=1.0)).item())

    def _gbc_nthr_in_update(self, trl_old, model_kwargs) -> bool:
        """NTHR inside the update's forward rather than a pass at the rollout: on policy (TRL
        computed no old log-probs: ``num_iterations == 1``, no vLLM ones), no Lopti (its pass
        runs anyway and gives NTHR's scales with it), ``steps_per_generation == 1`` (the one
        micro-batch is this process's whole generation batch, so whole groups: TRL shuffles
        the rows before splitting them), a text-only batch (a vision-language batch keeps the
        pass; not done for it yet)."""
        opts = self.gbc_methods
        return (self._gbc_nthr_in_forward and opts.nthr and trl_old is None
                and opts.lopti_eta is None and self.args.steps_per_generation == 1
                and not model_kwargs)

    def _gbc_log_nthr(self, result, advantages, mask):
        frac = methods.nthr_metrics(result, advantages, mask)
        self._metrics["train"]["gbc/nthr_selected"].append(
            self.accelerator.gather(frac["nthr_selected_frac"]).mean().item())

    # ---------------------------------------------------------------- Lopti: two updates per step
    def _prepare_inputs(self, generation_batch):
        if self._gbc_reuse_inputs is not None:      # Lopti's second phase: a kept micro-batch
            return self._gbc_reuse_inputs
        inputs = super()._prepare_inputs(generation_batch)
        self._gbc_last_inputs = inputs
        return inputs

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Lopti: the first phase on every micro-batch of the accumulation window, an optimizer
        step at its end, the second phase over the same micro-batches, the Trainer's step."""
        if self.gbc_methods.lopti_eta is None:
            return super().training_step(model, inputs, num_items_in_batch)
        first, second = self.gbc_methods.phases
        try:
            self._gbc_phase = first
            loss = self._gbc_take_logged(super().training_step(model, inputs, num_items_in_batch))
            self._gbc_window.append((self._gbc_last_inputs, num_items_in_batch))
            if not self.accelerator.sync_gradients:
                return loss                          # more micro-batches in this window
            if self.args.max_grad_norm is not None and self.args.max_grad_norm > 0:
                first_norm = super()._clip_grad_norm(model)
            else:
                first_norm = self.accelerator.clip_grad_norm_(model.parameters(), float("inf"))
            self._gbc_first_norm = float(first_norm)
            self._metrics["train"][f"gbc/grad_norm_{first}"].append(self._gbc_first_norm)
            self.optimizer.step()
            model.zero_grad()
            self._gbc_phase = second
            window, self._gbc_window = self._gbc_window, []
            for k, (prepared, n_items) in enumerate(window):
                self._gbc_reuse_inputs = prepared
                self._step -= 1        # GRPOTrainer counts micro-batches; these are re-runs
                # under DDP, synchronise the gradients once, on the window's last backward
                sync = k == len(window) - 1
                ctx = contextlib.nullcontext() if sync else self.accelerator.no_sync(model)
                with ctx:        # logged: the first phase's (the batch's terms, no split)
                    super().training_step(model, None, n_items)
            low, high = self._gbc_norms.get("low"), self._gbc_norms.get("high")
            if low is not None and high is not None:    # the step's share over both updates
                self._metrics["train"]["gbc/grad_share_low"].append(methods.share_low(low, high))
            self._gbc_norms = {}
        except BaseException:
            self._gbc_window = []
            raise
        finally:
            self._gbc_phase = None
            self._gbc_reuse_inputs = None
        return loss

    def _gbc_take_logged(self, returned):
        """Lopti: the loss the Trainer logs for a micro-batch — the batch's without the split at
        the first phase's parameters (:meth:`_compute_loss`), not the phase's own."""
        logged, self._gbc_logged_loss = self._gbc_logged_loss, None
        return returned if logged is None else logged.to(returned.device, returned.dtype)

    # ------------------------------------------------ Lopti: the logged gradient norm of a step
    def _gbc_step_norm(self, second_norm):
        """Lopti's logged norm, sqrt(|g_first|^2 + |g_second|^2), each pre-clip (docs/trl.md)."""
        first, self._gbc_first_norm = self._gbc_first_norm, None
        if first is None or second_norm is None:
            return second_norm
        second = float(second_norm)
        phase = self.gbc_methods.phases[1]
        self._metrics["train"][f"gbc/grad_norm_{phase}"].append(second)
        return (first * first + second * second) ** 0.5

    def _clip_grad_norm(self, model):
        return self._gbc_step_norm(super()._clip_grad_norm(model))

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and self._gbc_first_norm is not None:   # max_grad_norm = 0
            grad_norm = self._gbc_step_norm(super()._get_grad_norm(model))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # ---------------------------------------------------------------- the loss
    def _compute_loss(self, model, inputs):
        args = self.gbc_args
        mode = "train" if self.model.training else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        T = completion_ids.size(1)
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs \
            else completion_mask * inputs["tool_mask"]

        token_scale = inputs.get("gbc_token_scale")
        old_policy, nthr = None, {}
        groups = inputs.get(NTHR_GROUP_KEY)
        if mode == "train" and groups is not None and token_scale is None:
            # NTHR in this forward (the rollout left it here: _gbc_nthr_in_update)
            counts = torch.unique(groups, return_counts=True)[1]
            if (counts != self.num_generations).any():
                raise RuntimeError("gbc_nthr: a micro-batch without whole groups reached "
                                   "NTHR's in-forward scoring")
            head_fn = hf.old_policy_head(
                completion_ids, mask, group_ids=groups, advantages=inputs["advantages"],
                temperature=self._gbc_temperature, nthr=True,
                nthr_beta=self.gbc_methods.nthr_beta, nthr_eta=self.gbc_methods.nthr_eta,
                backend=args.gbc_backend, logits_dtype=self.gbc_methods.logits_dtype)

            def old_policy(h, head, cap):
                nthr["pass"] = head_fn(h, head, cap)
                return nthr["pass"]
        old_logp = inputs.get("old_per_token_logps")
        if old_logp is None:
            old_logp = inputs.get(OLD_LOGP_KEY)
        if mode == "train" and self.gbc_methods.lopti_eta is not None and (
                self._gbc_phase is None or old_logp is None):
            raise RuntimeError("gbc_lopti_eta: a training loss outside Lopti's two updates or "
                               "without the rollout's old log-probs")
        is_ratio = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs["importance_sampling_ratio"].float()   # [B, T] or [B, 1]
        lt = args.loss_type
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_items = None
        if lt in NUM_ITEMS_LOSS_TYPES:
            # TRL: num_items_in_batch spans the generation batch; rescale it to one window
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * accumulation / args.steps_per_generation

        # the entropy bonus: TRL's coefficient (adaptive: applied only while the entropy of the
        # last window is at or below the target), a mean over the tokens it acts on, scaled for
        # accumulation only (the other loss types divide the whole loss below)
        coef = 0.0
        if self._entropy_bonus_enabled:
            coef = self.entropy_coef
            if self.use_adaptive_entropy and self._last_world_entropy > args.entropy_target:
                coef = 0.0
        coef_in_loss = coef / accumulation if lt in NUM_ITEMS_LOSS_TYPES else coef
        sampling = None
        if self.off_policy_mask_threshold is not None:
            sampling = inputs.get("sampling_per_token_logps")
        # the loss inside the model's forward: DDP, FSDP2, ZeRO-3 and PEFT see an ordinary
        # forward of the lm_head and route its gradients (hf.policy_loss_through_forward)
        extra = _model_inputs(inputs)           # a vision-language model's images
        if self.aux_loss_enabled:
            extra["output_router_logits"] = True
        # Lopti: the logged terms are the batch's without the split, from the first phase's
        # per-token values (the parameters the batch met); the second phase logs none of TRL's
        first_phase = (self._gbc_phase is not None
                       and self._gbc_phase == self.gbc_methods.phases[0])
        token_out = {} if first_phase else None
        ref_logp = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        dp_group = "world" if self.accelerator.num_processes > 1 else None
        support, builds = {}, False
        if self.gbc_methods.support == "replay":
            # one set per rollout: the batch's (the set TRL's split gave this micro-batch),
            # else this update builds it (the rollout's first scoring with the sampling
            # weights) and the micro-batch keeps it for Lopti's second phase and the next
            # iterations; per pass: rebuilt from this update's logits
            ids = inputs.get(SUPPORT_IDS_KEY) if self.gbc_methods.one_set_per_rollout else None
            if ids is not None:
                support["support_ids"] = methods.expand_support_ids(ids, T)
            else:
                support["sampler_truncation"] = self._gbc_truncation
                builds = self.gbc_methods.one_set_per_rollout
        through_forward = _policy_loss_building_ids if builds else hf.policy_loss_through_forward
        with self.accelerator.autocast():
            loss, metrics, outputs = through_forward(
                model, input_ids, attention_mask, T, mask, inputs["advantages"],
                old_logp=old_logp,
                ref_logp=ref_logp,
                config=self._gbc_config(coef_in_loss, lopti=self._gbc_phase is not None),
                unwrapped=self.accelerator.unwrap_model(model), return_outputs=True,
                model_kwargs=extra, token_scale=token_scale,
                kl_weight=inputs.get("gbc_kl_weight"), phase=self._gbc_phase,
                num_items_in_batch=num_items, backend=args.gbc_backend, is_ratio=is_ratio,
                sampling_logp=sampling, old_policy=old_policy, token_out=token_out,
                data_parallel_group=dp_group, **support)
        if builds:
            outputs, ids = outputs
            inputs[SUPPORT_IDS_KEY] = methods.compact_support_ids(ids)
        if "pass" in nthr:           # the micro-batch carries the scales its loss used
            inputs["gbc_token_scale"] = nthr["pass"].token_scale
            self._gbc_log_nthr(nthr["pass"].nthr, inputs["advantages"], mask)
        logged, trl_metrics = loss.detach(), metrics        # what TRL's names log
        if token_out is not None:
            # every completion token once, TRL's normalisers, no vocabulary work
            with torch.no_grad():
                logged, trl_metrics = gbc.policy_loss(
                    token_out["logp"], mask, inputs["advantages"], old_logp=old_logp,
                    ref_logp=ref_logp, entropy=token_out.get("entropy"),
                    token_scale=inputs.get("gbc_token_scale"),
                    kl_weight=inputs.get("gbc_kl_weight"),
                    config=self._gbc_config(coef_in_loss, lopti=False),
                    num_items_in_batch=num_items, is_ratio=is_ratio, sampling_logp=sampling,
                    data_parallel_group=dp_group)
        if lt not in NUM_ITEMS_LOSS_TYPES:
            loss = loss / accumulation
            logged = logged / accumulation
        log_trl = self._gbc_phase is None or first_phase
        if self._entropy_bonus_enabled and log_trl:
            self._gbc_entropy_bonus(mode, logged, trl_metrics, coef_in_loss, accumulation, mask)
        if self.aux_loss_enabled:
            # MoE load balancing, from the same forward, added as TRL adds it
            aux = outputs.aux_loss
            loss = loss + self.router_aux_loss_coef * aux / accumulation
            logged = logged + self.router_aux_loss_coef * aux.detach() / accumulation
            if log_trl:
                self._metrics[mode]["aux_loss"].append(
                    self.accelerator.gather_for_metrics(aux.detach()).mean().item())
        if first_phase:           # training_step returns it: the Trainer's logged loss
            self._gbc_logged_loss = logged.detach()
        self._gbc_log(mode, metrics, trl_metrics if log_trl else None)
        return loss

    def _gbc_entropy_bonus(self, mode, loss, metrics, coef_in_loss, accumulation, mask):
        """TRL's bookkeeping of the entropy bonus: its metric and adaptive coefficient."""
        args = self.gbc_args
        quantile = self.top_entropy_quantile < 1.0
        h_mean = metrics["entropy_top_mean"] if quantile else metrics["entropy"]
        total = loss.detach() * (1 if args.loss_type in NUM_ITEMS_LOSS_TYPES else accumulation)
        policy_loss = total + coef_in_loss * h_mean
        self._metrics[mode]["policy_loss"].append(
            self.accelerator.gather(policy_loss).nanmean().item())
        if self.use_adaptive_entropy and mode == "train":
            n = mask.sum().float()
            if quantile:
                n = n * metrics["entropy_mask_frac"]
            stats = torch.stack([h_mean * n, n]).detach()
            self._entropy_window_stats = (stats if self._entropy_window_stats is None
                                          else self._entropy_window_stats + stats)
            if self.accelerator.sync_gradients:
                window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
                if world_entropy <= args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta,
                                            args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta,
                                            args.entropy_coef_min)
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

    def _gbc_log(self, mode, metrics, trl_metrics=None):
        """The loss's metrics under TRL's names (from ``trl_metrics``; none when None: Lopti's
        second phase) and ``gbc/...`` (``metrics``: the phase's own under Lopti), one gather
        per micro-batch."""
        suffix = "" if self._gbc_phase is None else f"_{self._gbc_phase}"
        lt = self.gbc_args.loss_type
        named = {}
        if trl_metrics is not None:
            # TRL counts clipped tokens at token level, clipped sequences at sequence level
            seq = "_seq" if self.gbc_args.importance_sampling_level == "sequence" else ""
            low, high = trl_metrics["clip_frac_low" + seq], trl_metrics["clip_frac_high" + seq]
            if lt in PPO_LOSS_TYPES:
                named.update({"clip_ratio/low_mean": low, "clip_ratio/high_mean": high,
                              "clip_ratio/region_mean": low + high})
            elif lt == "cispo":
                named["cispo_clip_ratio"] = high
            elif lt == "vespo":
                named["vespo/phi_seq_mean"] = trl_metrics["phi_mean"]
            for name in ("kl", "entropy"):
                if name in trl_metrics:
                    named[name] = trl_metrics[name]
        # a method's metrics only when it runs (AR's weight mean is 1 without AR; Lopti's
        # token share and gradient split read as if it were on)
        opts = self.gbc_methods
        off = (() if opts.ar_alpha else ("ar_weight_mean",)) + (
            () if opts.lopti_eta is not None else ("grad_share_low", "low_frac"))
        for name in ("grad_share_low", "low_frac", "ar_weight_mean", "entropy_mask_frac",
                     "off_policy_frac", "ratio_mean", "log_ratio_mean", "support_forced_frac"):
            if name in metrics and name not in off:
                named[f"gbc/{name}{suffix}"] = metrics[name]
        if self._gbc_phase is not None and "grad_norm_sum" in metrics:
            named["grad_norm_sum"] = metrics["grad_norm_sum"]
        local = torch.stack([v.detach().float().reshape(()) for v in named.values()])
        values = self.accelerator.gather(local).view(-1, len(named)).mean(0).tolist()
        for key, value in zip(named, values):
            if key == "grad_norm_sum":     # summed over the window's micro-batches
                phase = self._gbc_phase
                self._gbc_norms[phase] = self._gbc_norms.get(phase, 0.0) + value
            else:
                self._metrics[mode][key].append(value)
