"""TRL drop-in: ``GBCGRPOTrainer`` computes ``GRPOTrainer``'s loss with the fused kernel.

The policy's final hidden states and its ``lm_head`` go straight into
:func:`gbc_kernels.fused_linear_policy_loss`; no logits are formed. TRL's own options keep their
meaning (``loss_type``, ``beta``, ``epsilon``, ``epsilon_high``, ``temperature``, gradient
accumulation, ``num_items_in_batch``), so with every ``gbc_*`` option off the loss and its
gradients are TRL's. The ``gbc_*`` options add the token-level methods:

* ``gbc_ar_alpha``: Advantage Reweighting (SPEC §2) with TRL's ``old_per_token_logps`` (the
  current log-probs, detached, when TRL skips the old-policy pass).
* ``gbc_lopti_eta``: Lopti (SPEC §3). Every training step runs the low phase, an optimizer step
  (with TRL's gradient clipping), then the high phase; the Trainer's own optimizer step follows.
  The learning-rate schedule advances once per training step.
* ``gbc_nthr``: NTHR (SPEC §4) from the rollout policy's hidden states, computed right after
  TRL scores the completions. A completion counts as correct when its advantage is > 0 (for
  binary rewards: reward 1 in a mixed group), and a group is ``num_generations`` consecutive
  completions, as TRL's sampler lays them out.
* ``gbc_critical_kl_exponent``: critical-token KL weights (SPEC §5) from the reference model's
  certainty, multiplied into TRL's k3 KL term (``beta`` must be > 0).

Options whose objective the fused loss cannot reproduce raise a ``ValueError`` when the trainer
is built; they are never silently changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from trl import GRPOConfig, GRPOTrainer

import gbc_kernels as gbc
from . import hf

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes",
                    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


@dataclass
class GBCGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the gbc_kernels options (all off by default)."""

    gbc_ar_alpha: float = field(default=0.0, metadata={
        "help": "Advantage Reweighting alpha: advantages scaled by alpha*p_old + 1 - alpha (0 = off)."})
    gbc_lopti_eta: Optional[float] = field(default=None, metadata={
        "help": "Lopti threshold eta: two updates per step, tokens with p_old < eta first (None = off)."})
    gbc_lopti_order: str = field(default="low-first", metadata={
        "help": "'low-first' (the paper's) or 'high-first' (its failing ablation)."})
    gbc_nthr: bool = field(default=False, metadata={
        "help": "NTHR: soften the penalty of wrong-answer tokens aligned with the correct answers."})
    gbc_nthr_beta: float = field(default=1.0, metadata={"help": "NTHR threshold factor beta."})
    gbc_nthr_eta: Optional[float] = field(default=None, metadata={
        "help": "NTHR scale of selected tokens; None = 'auto' (2*|0.5 - p|, the paper's)."})
    gbc_critical_kl_exponent: Optional[float] = field(default=None, metadata={
        "help": "Critical-token KL exponent gamma (paper: 150); None = off. Needs beta > 0."})
    gbc_critical_kl_certainty: str = field(default="max_prob", metadata={
        "help": "Certainty of the reference model: 'max_prob' or 'entropy'."})
    gbc_critical_kl_temperature: float = field(default=1.0, metadata={
        "help": "Temperature of the reference distribution the certainty is measured on."})
    gbc_critical_kl_intercept: float = field(default=0.0, metadata={
        "help": "Intercept c of the weight (1 - c) * J**gamma + c."})
    gbc_backend: str = field(default="auto", metadata={
        "help": "gbc_kernels backend: 'auto', 'triton', 'cpu' or 'torch'."})


class _Options:
    """The gbc options of ``args``: a :class:`GBCGRPOConfig`, or a plain ``GRPOConfig`` (then
    every gbc option has its default, off)."""

    def __init__(self, args):
        self._args = args

    def __getattr__(self, name):
        if name.startswith("gbc_"):
            default = GBCGRPOConfig.__dataclass_fields__[name].default
            return getattr(self._args, name, default)
        return getattr(self._args, name)


def _unsupported(args) -> list[str]:
    """TRL options whose objective the fused loss does not reproduce, as error lines."""
    args = _Options(args)
    bad = []
    if args.loss_type not in SUPPORTED_LOSS_TYPES:
        bad.append(f"loss_type={args.loss_type!r}: expected one of {SUPPORTED_LOSS_TYPES}")
    if args.importance_sampling_level != "token":
        bad.append(f"importance_sampling_level={args.importance_sampling_level!r}: "
                   "expected 'token' (sequence-level ratios are not fused)")
    if args.delta is not None:
        bad.append(f"delta={args.delta!r}: expected None (two-sided clipping is not fused; "
                   "gbc's dual clip is verl's clip_ratio_c)")
    if args.top_entropy_quantile < 1.0:
        bad.append(f"top_entropy_quantile={args.top_entropy_quantile!r}: expected 1.0")
    if args.off_policy_mask_threshold is not None:
        bad.append(f"off_policy_mask_threshold={args.off_policy_mask_threshold!r}: expected None")
    if args.use_adaptive_entropy:
        bad.append("use_adaptive_entropy=True: expected False")
    if args.entropy_coef != 0.0 and args.loss_type != "bnpo":
        bad.append(f"entropy_coef={args.entropy_coef!r} with loss_type={args.loss_type!r}: TRL "
                   "averages the entropy bonus over tokens whatever the loss type, the fused "
                   "loss aggregates it like the policy term; they agree only for 'bnpo'")
    if args.gbc_lopti_eta is not None and args.gradient_accumulation_steps != 1:
        bad.append(f"gbc_lopti_eta with gradient_accumulation_steps="
                   f"{args.gradient_accumulation_steps}: Lopti steps the optimizer between its "
                   "two phases, so expected gradient_accumulation_steps=1")
    if args.gbc_lopti_order not in ("low-first", "high-first"):
        bad.append(f"gbc_lopti_order={args.gbc_lopti_order!r}: expected 'low-first' or "
                   "'high-first'")
    if args.gbc_critical_kl_exponent is not None and args.beta == 0.0:
        bad.append("gbc_critical_kl_exponent with beta=0.0: there is no KL term to weight; "
                   "expected beta > 0")
    if args.gbc_critical_kl_certainty not in ("max_prob", "entropy"):
        bad.append(f"gbc_critical_kl_certainty={args.gbc_critical_kl_certainty!r}: expected "
                   "'max_prob' or 'entropy'")
    if args.gbc_nthr:
        local = args.per_device_train_batch_size * args.steps_per_generation
        if args.num_generations and local % args.num_generations:
            bad.append(f"gbc_nthr with per_device_train_batch_size * steps_per_generation = "
                       f"{local}, not a multiple of num_generations={args.num_generations}: "
                       "NTHR needs every group's completions on the same process")
    if not 0.0 <= args.gbc_ar_alpha <= 1.0:
        bad.append(f"gbc_ar_alpha={args.gbc_ar_alpha!r}: expected a float in [0, 1]")
    if args.gbc_lopti_eta is not None and not 0.0 < args.gbc_lopti_eta <= 1.0:
        bad.append(f"gbc_lopti_eta={args.gbc_lopti_eta!r}: expected None or a float in (0, 1]")
    if args.gbc_nthr_eta is not None and not args.gbc_nthr_eta >= 0.0:
        bad.append(f"gbc_nthr_eta={args.gbc_nthr_eta!r}: expected None ('auto') or a float >= 0")
    if args.gbc_critical_kl_exponent is not None and not args.gbc_critical_kl_exponent > 0.0:
        bad.append(f"gbc_critical_kl_exponent={args.gbc_critical_kl_exponent!r}: expected None "
                   "or a float > 0")
    if not args.gbc_critical_kl_temperature > 0.0:
        bad.append(f"gbc_critical_kl_temperature={args.gbc_critical_kl_temperature!r}: "
                   "expected a float > 0")
    if args.gbc_backend not in ("auto", "triton", "cpu", "torch"):
        bad.append(f"gbc_backend={args.gbc_backend!r}: expected 'auto', 'triton', 'cpu' or 'torch'")
    return bad


def _logit_scale(model) -> float:
    """The factor transformers models multiply their logits by (1.0 for most), read as TRL's
    fused head reads it; final logit soft-capping cannot be fused and raises."""
    cfg = model.config.get_text_config()
    if getattr(cfg, "final_logit_softcapping", None) is not None:
        raise ValueError(f"model: final_logit_softcapping={cfg.final_logit_softcapping} is not "
                         "supported by the fused loss (tanh soft-capping of the logits)")
    scale = getattr(cfg, "logit_scale", None)
    if scale is None:
        scale = getattr(cfg, "output_multiplier", None)
    if scale is None:
        scale = getattr(cfg, "lm_head_multiplier", None)
    if scale is None and getattr(cfg, "logits_scaling", None) is not None:
        scale = (cfg.logits_scaling if cfg.model_type == "hyperclovax"
                 else 1.0 / cfg.logits_scaling)
    scale = 1.0 if scale is None else float(scale)
    if not scale > 0:
        raise ValueError(f"model: logit scale {scale} is not supported (expected > 0)")
    return scale


class GBCGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose loss is :func:`gbc_kernels.fused_linear_policy_loss`.

    Takes the same arguments; ``args`` may be a :class:`GBCGRPOConfig` (a plain ``GRPOConfig``
    means every gbc option off).
    """

    def __init__(self, model, reward_funcs, args: Optional[GRPOConfig] = None, *a, **kw):
        if args is not None:
            self._gbc_check_args(args)
        super().__init__(model, reward_funcs, args, *a, **kw)
        if args is None:                 # TRL built its default GRPOConfig
            self._gbc_check_args(self.args)
        self.gbc_args = _Options(self.args)
        self._gbc_check_model()
        self._gbc_phase = None
        self._gbc_reuse_inputs = None
        self._gbc_norms = {}

    # ---------------------------------------------------------------- construction checks
    @staticmethod
    def _gbc_check_args(args):
        bad = _unsupported(args)
        if bad:
            raise ValueError("GBCGRPOTrainer: unsupported option(s):\n  " + "\n  ".join(bad))

    def _gbc_check_model(self):
        args = self.gbc_args
        if self.aux_loss_enabled:
            raise ValueError("GBCGRPOTrainer: the MoE router auxiliary loss (router_aux_loss_coef "
                             "with output_router_logits) is not supported; set "
                             "router_aux_loss_coef=0")
        unwrapped = self.accelerator.unwrap_model(self.model)
        if hasattr(unwrapped, "peft_config"):
            raise ValueError("GBCGRPOTrainer: PEFT models are not supported yet")
        hf.lm_head(unwrapped)
        hf.decoder(unwrapped)
        self._gbc_temperature = self.temperature / _logit_scale(unwrapped)
        if args.gbc_critical_kl_exponent is not None and self.ref_model is None:
            raise ValueError("gbc_critical_kl_exponent: needs a separate reference model "
                             "(trainer.ref_model is None)")
        if args.gbc_lopti_eta is not None:
            from accelerate.utils import DistributedType
            if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
                raise ValueError("gbc_lopti_eta: not supported under DeepSpeed (its engine steps "
                                 "the optimizer inside backward)")

    def _gbc_config(self) -> gbc.PolicyLossConfig:
        args = self.gbc_args
        return gbc.PolicyLossConfig(
            epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
            loss_agg=args.loss_type,
            max_len=args.max_completion_length if args.loss_type == "dr_grpo" else None,
            temperature=self._gbc_temperature, kl_coef=self.beta, kl_estimator="k3",
            kl_ratio_correction=bool(args.use_bias_correction_kl),
            entropy_coef=self.entropy_coef if self._entropy_bonus_enabled else 0.0,
            ar_alpha=args.gbc_ar_alpha, lopti_eta=args.gbc_lopti_eta)

    # ---------------------------------------------------------------- rollout: NTHR, critical KL
    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        args = self.gbc_args
        crit = args.gbc_critical_kl_exponent is not None
        if not self.model.training or not (args.gbc_nthr or crit):
            return out
        if any(k in out for k in _MULTIMODAL_KEYS):
            raise ValueError("GBCGRPOTrainer: multimodal inputs are not supported")
        completion_ids = out["completion_ids"]
        T = completion_ids.size(1)
        input_ids = torch.cat([out["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out \
            else out["completion_mask"]
        if args.gbc_nthr:
            B, G = completion_ids.size(0), self.num_generations
            if B % G:
                raise ValueError(f"gbc_nthr: this process holds {B} completions, not a multiple "
                                 f"of num_generations={G}; NTHR needs whole groups")
            adv = out["advantages"]
            adv = adv if adv.dim() == 1 else adv[:, 0]
            group_ids = torch.arange(B, device=completion_ids.device) // G
            with torch.no_grad():
                res = hf.old_policy_pass(
                    self.accelerator.unwrap_model(self.model), input_ids, attention_mask,
                    completion_ids, mask, group_ids=group_ids, correct=adv > 0,
                    temperature=self._gbc_temperature, nthr=True, nthr_beta=args.gbc_nthr_beta,
                    nthr_eta="auto" if args.gbc_nthr_eta is None else args.gbc_nthr_eta,
                    backend=args.gbc_backend, completion_len=T,
                    # TRL's own old-policy log-probs when it computed them (num_iterations > 1,
                    # vLLM): NTHR then needs no pass over the vocabulary of its own
                    old_logp=out.get("old_per_token_logps"))
            out["gbc_token_scale"] = res.token_scale
            m = mask.float()
            selected = (res.nthr.selected.float() * m).sum() / m.sum().clamp(min=1.0)
            self._metrics["train"]["gbc/nthr_selected"].append(
                self.accelerator.gather(selected).mean().item())
        if crit:
            with torch.no_grad():
                ref = hf.reference_pass(
                    self.ref_model, input_ids, attention_mask, completion_ids,
                    temperature=self._gbc_temperature,
                    critical_kl_exponent=args.gbc_critical_kl_exponent,
                    certainty=args.gbc_critical_kl_certainty,
                    certainty_temperature=args.gbc_critical_kl_temperature,
                    intercept=args.gbc_critical_kl_intercept, backend=args.gbc_backend,
                    completion_len=T)
            out["gbc_kl_weight"] = ref.kl_weight
        return out

    # ---------------------------------------------------------------- Lopti: two updates per step
    def _prepare_inputs(self, generation_batch):
        if self._gbc_reuse_inputs is not None:      # Lopti's second phase: the same micro-batch
            return self._gbc_reuse_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self._gbc_phase is not None:
            self._gbc_reuse_inputs = inputs
        return inputs

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.gbc_args.gbc_lopti_eta is None:
            return super().training_step(model, inputs, num_items_in_batch)
        first, second = (("low", "high") if self.gbc_args.gbc_lopti_order == "low-first"
                         else ("high", "low"))
        try:
            self._gbc_phase = first
            loss_first = super().training_step(model, inputs, num_items_in_batch)
            if self.args.max_grad_norm is not None and self.args.max_grad_norm > 0:
                self._clip_grad_norm(model)
            self.optimizer.step()
            model.zero_grad()
            self._step -= 1        # GRPOTrainer counts micro-batches; this one is not done yet
            self._gbc_phase = second
            loss_second = super().training_step(model, inputs, num_items_in_batch)
            low, high = self._gbc_norms.get("low"), self._gbc_norms.get("high")
            if low is not None and high is not None:    # the step's share over both updates
                self._metrics["train"]["gbc/grad_share_low"].append(
                    low / (low + high) if low + high > 0 else 0.0)
        finally:
            self._gbc_norms = {}
            self._gbc_phase = None
            self._gbc_reuse_inputs = None
        return loss_first + loss_second

    # ---------------------------------------------------------------- the loss
    def _compute_loss(self, model, inputs):
        if any(k in inputs for k in _MULTIMODAL_KEYS):
            raise ValueError("GBCGRPOTrainer: multimodal inputs are not supported")
        args = self.gbc_args
        mode = "train" if self.model.training else "eval"
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        T = completion_ids.size(1)
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs \
            else completion_mask * inputs["tool_mask"]

        unwrapped = self.accelerator.unwrap_model(model)
        with self.accelerator.autocast():
            hidden = hf.hidden_states_through_forward(model, input_ids, attention_mask, T,
                                                      unwrapped=unwrapped)
        head = hf.lm_head(unwrapped)
        if hidden.dtype != head.weight.dtype:      # cast_lm_head_to_fp32, or autocast output
            hidden = hidden.to(head.weight.dtype)

        token_scale = inputs.get("gbc_token_scale")
        if self.use_vllm and self.vllm_importance_sampling_correction:
            # TRL multiplies the clipped policy term by the (non-negative) IS ratio; the clipped
            # term is positively homogeneous in the advantage, so the ratio is a token scale.
            ratio = inputs["importance_sampling_ratio"].expand_as(mask).float()
            token_scale = ratio if token_scale is None else token_scale * ratio
        num_items = None
        if args.loss_type == "dapo":
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = (num_items * self.current_gradient_accumulation_steps
                             / args.steps_per_generation)
        loss, metrics = gbc.fused_linear_policy_loss(
            hidden, head.weight, completion_ids, mask, inputs["advantages"],
            old_logp=inputs.get("old_per_token_logps"),
            ref_logp=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
            bias=head.bias, token_scale=token_scale, kl_weight=inputs.get("gbc_kl_weight"),
            config=self._gbc_config(), phase=self._gbc_phase,
            num_items_in_batch=num_items, backend=args.gbc_backend)
        if args.loss_type != "dapo" and mode == "train":
            loss = loss / self.current_gradient_accumulation_steps
        self._gbc_log(mode, metrics)
        return loss

    def _gbc_log(self, mode, metrics):
        """The loss's metrics under TRL's names (and ``gbc/...``), averaged over processes with
        one gather and one host sync per micro-batch."""
        suffix = "" if self._gbc_phase is None else f"_{self._gbc_phase}"
        named = {"clip_ratio/low_mean": metrics["clip_frac_low"],
                 "clip_ratio/high_mean": metrics["clip_frac_high"],
                 "clip_ratio/region_mean": metrics["clip_frac_low"] + metrics["clip_frac_high"]}
        for name in ("kl", "entropy"):
            if name in metrics:
                named[name] = metrics[name]
        for name in ("grad_share_low", "low_frac", "ar_weight_mean"):
            if name in metrics:
                named[f"gbc/{name}{suffix}"] = metrics[name]
        if self._gbc_phase is not None and "grad_norm_sum" in metrics:
            named["grad_norm_sum"] = metrics["grad_norm_sum"]
        local = torch.stack([v.detach().float().reshape(()) for v in named.values()])
        values = self.accelerator.gather(local).view(-1, len(named)).mean(0).tolist()
        for key, value in zip(named, values):
            if key == "grad_norm_sum":
                self._gbc_norms[self._gbc_phase] = value
            else:
                self._metrics[mode][key].append(value)
