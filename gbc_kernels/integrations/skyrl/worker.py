"""gbc's fused loss inside SkyRL 0.3.0's policy worker (docs/skyrl.md).

:class:`GBCPolicyWorkerMixin` replaces the worker's training micro-step
(``PolicyWorkerBase._forward_backward_micro``: logits -> ``logprobs_from_logits`` ->
``chunked_entropy_from_logits`` -> registered loss) by gbc's fused loss from the final hidden
states and the lm_head inside the model's forward (:func:`gbc_kernels.integrations.hf.
policy_loss_through_forward`; no ``[tokens, V]`` logits), and its no-grad log-prob pass
(old policy; :class:`GBCRefWorkerMixin`: the reference) by gbc's row passes. The loss is SkyRL's
(the table of :mod:`.losses`); metrics are SkyRL's, from its own functions on gbc's log-probs.
AR and Lopti (two optimizer steps of SkyRL's own step) run through
:class:`gbc_kernels.methods.MethodOptions`; NTHR and critical-token KL are refused
(:data:`REFUSED`).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from gbc_kernels import methods
from gbc_kernels.integrations import hf

from . import losses

ENV = "GBC_SKYRL"                  # "1" in gbc's workers' runtime environment (set by enable())
OPTIONS_ENV = "GBC_SKYRL_OPTIONS"  # "ar_alpha=0.3,lopti_eta=0.5": the method options

# the method options SkyRL's flow cannot honour, and why
REFUSED = {
    "nthr": "SkyRL computes the old policy's log-probs before the advantages (and in another "
            "call than the update); NTHR's scores need both in one pass over the old policy's "
            "hidden states",
    "critical_kl_exponent": "the reference worker's output reaches the policy worker as "
                            "base_action_log_probs only; the critical-token KL weights would "
                            "need a field of their own in SkyRL's training batch",
}


def method_options(text: Optional[str] = None) -> methods.MethodOptions:
    """The method options of ``text`` (default: the ``GBC_SKYRL_OPTIONS`` variable), each
    typed and checked by :meth:`gbc_kernels.methods.MethodOptions.parse`; an option of
    :data:`REFUSED` is refused naming it."""
    text = os.environ.get(OPTIONS_ENV, "") if text is None else text
    opts = methods.MethodOptions.parse(text, OPTIONS_ENV)
    for option, why in REFUSED.items():
        if getattr(opts, option) not in (False, None):
            raise ValueError(f"{OPTIONS_ENV}: {option} is not run inside SkyRL: {why}")
    return opts


def check_config(cfg, options: Optional[methods.MethodOptions] = None) -> methods.MethodOptions:
    """Refuse, naming SkyRL's option, a trainer config (``cfg``: SkyRL's ``trainer`` section)
    or method options (default: ``GBC_SKYRL_OPTIONS``) gbc's worker cannot honour: the loss
    table's refusals (:func:`.losses.policy_loss_config`), sequence parallelism. Returns the
    options."""
    opts = method_options() if options is None else options
    algo = losses.get(cfg, "algorithm")
    if algo is None:
        raise ValueError("cfg: expected SkyRL's trainer config (with .algorithm)")
    losses.policy_loss_config(algo, kl_entropy_weight=1.0, **opts.loss_options())
    sp = losses.get(cfg, "policy.sequence_parallel_size", 1)
    if sp not in (None, 1):
        raise ValueError(f"trainer.policy.sequence_parallel_size={sp}: gbc's SkyRL worker runs "
                         f"without Ulysses sequence parallelism (set 1)")
    return opts


def _position_ids(attention_mask):
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)


def _check_wrapper(wrapper, num_actions, experience=None):
    """Refuse what the fused path does not run, naming SkyRL's option; returns T."""
    if getattr(wrapper, "sequence_parallel_size", 1) > 1:
        raise ValueError("trainer.policy.sequence_parallel_size: gbc's SkyRL worker runs "
                         "without Ulysses sequence parallelism (set 1)")
    if getattr(wrapper, "is_vlm", False) or (experience is not None and (
            getattr(experience, "pixel_values", None) is not None
            or getattr(experience, "image_grid_thw", None) is not None)):
        raise ValueError("model: gbc's SkyRL worker runs text-only causal LMs "
                         "(vision inputs given)")
    if isinstance(num_actions, (list, tuple)):
        if len(set(num_actions)) != 1:
            raise ValueError("response_length: gbc's SkyRL worker takes one response length "
                             "per micro-batch")
        num_actions = num_actions[0]
    return int(num_actions)


def _check_sft(options, loss_type):
    """AR and Lopti act on RL advantages: refused on SkyRL's SFT loss."""
    if loss_type == "cross_entropy":
        for name in ("ar_alpha", "lopti_eta"):
            if getattr(options, name) not in (0.0, None):
                raise ValueError(f"{OPTIONS_ENV}: {name} acts on RL advantages; SkyRL's "
                                 f"cross_entropy (SFT) loss has none")


def _temperature(cfg):
    t = cfg.algorithm.temperature
    return 1.0 if t is None else float(t)


class GBCPolicyWorkerMixin:
    """Put before SkyRL's policy worker class (``class W(GBCPolicyWorkerMixin,
    FSDPPolicyWorkerBase)``): its training step and no-grad pass run gbc's."""

    _gbc_options: Optional[methods.MethodOptions] = None
    _gbc_phase: Optional[str] = None

    def __init__(self, *args, **kwargs):
        cfg = kwargs.get("cfg", args[0] if args else None)
        self._gbc_options = check_config(cfg)      # before SkyRL's own look-ups
        super().__init__(*args, **kwargs)

    @property
    def gbc_options(self) -> methods.MethodOptions:
        if self._gbc_options is None:
            self._gbc_options = method_options()
        return self._gbc_options

    def forward_backward(self, data, loss_fn=None, loss_fn_config=None):
        """SkyRL's ``forward_backward``; under Lopti, the first phase's forward-backward and
        optimizer step run here and the second phase's forward-backward returns (SkyRL's
        trainer then takes its optimizer step): two optimizer steps of SkyRL's own step,
        with the old log-probs of the batch fixed for both."""
        _check_sft(self.gbc_options, loss_fn or self.cfg.algorithm.policy_loss_type)
        phases = self.gbc_options.phases
        if phases == (None,):
            return super().forward_backward(data, loss_fn, loss_fn_config)
        first, second = phases
        self._gbc_phase = first
        try:
            out1 = super().forward_backward(data, loss_fn, loss_fn_config)
            self.optim_step()
            self._gbc_phase = second
            out2 = super().forward_backward(data, loss_fn, loss_fn_config)
        finally:
            self._gbc_phase = None
        out2.metrics.update({f"gbc_lopti_{first}/{k}": v for k, v in out1.metrics.items()})
        return out2

    def _forward_backward_micro(self, experience, microbatch_weight, loss_fn=None,
                                loss_fn_config=None):
        from skyrl.backends.skyrl_train.utils.ppo_utils import compute_approx_kl
        from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean
        from skyrl.backends.skyrl_train.workers.worker_utils import (
            compute_minibatch_rollout_logprob_diff_metrics)

        _check_sft(self.gbc_options, loss_fn or self.cfg.algorithm.policy_loss_type)
        if loss_fn_config is not None:
            raise ValueError("loss_fn_config: per-call loss overrides are not run by gbc's "
                             "SkyRL worker; set them in trainer.algorithm")
        self.model.train()
        experience.to_device(torch.cuda.current_device())
        algo = self.cfg.algorithm
        loss_type = loss_fn if loss_fn is not None else algo.policy_loss_type
        sft = loss_type == "cross_entropy"
        T = _check_wrapper(self.model, experience.num_actions, experience)
        dp = self.mesh_rank.dp_size
        opts = self.gbc_options
        cfg = losses.policy_loss_config(
            algo, loss_type, kl_entropy_weight=None if sft else microbatch_weight / dp,
            temperature=_temperature(self.cfg), return_entropy=not sft, **opts.loss_options())
        loss_mask = experience.loss_mask
        call, _ = losses.policy_loss_inputs(algo, loss_type, loss_mask, experience.advantages,
                                            experience.action_log_probs,
                                            experience.rollout_logprobs)
        token_out = {}
        loss, _ = _policy_loss(self.model, experience.sequences, experience.attention_mask, T,
                               call, ref_logp=experience.base_action_log_probs
                               if cfg.kl_coef else None, config=cfg, phase=self._gbc_phase,
                               token_out=token_out)
        self.strategy.backward(loss * dp, self.model, self.optimizer)

        mask = call["mask"]
        lp = token_out["logp"].to(call["advantages"].dtype)
        logp = torch.where(mask, lp, torch.full_like(lp, float("nan")))
        lp0 = torch.where(mask, logp, torch.zeros_like(logp))
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

            adv = experience.advantages if sft else methods.loss_advantages(
                experience.advantages, experience.action_log_probs, opts, self._gbc_phase)
            policy_loss, loss_metrics = PolicyLossRegistry.get(loss_type)(
                lp0, experience.action_log_probs, adv, config=algo,
                loss_mask=loss_mask, rollout_logprobs=experience.rollout_logprobs)
        outputs = self._gbc_outputs(logp, experience, sft, loss_mask)
        if sft:
            return {"loss": policy_loss.item(), "response_length": experience.num_actions,
                    "lr": self.scheduler.get_last_lr()[0], "loss_fn_outputs": outputs}
        status = {"final_loss": loss.item(), "policy_loss": policy_loss.item(),
                  "policy_entropy": masked_mean(token_out["entropy"].to(lp0.dtype),
                                                loss_mask).item(),
                  "response_length": experience.num_actions,
                  "policy_lr": self.scheduler.get_last_lr()[0], "loss_fn_outputs": outputs}
        for k, v in loss_metrics.items():
            status["loss_metrics/" + k] = v
        if algo.use_kl_loss:
            kl = compute_approx_kl(lp0, experience.base_action_log_probs, loss_mask=loss_mask,
                                   kl_estimator_type=algo.kl_estimator_type)
            status["policy_kl"] = masked_mean(kl, loss_mask, dim=-1).mean().item()
        status.update(compute_minibatch_rollout_logprob_diff_metrics(
            lp0, experience.rollout_logprobs, loss_mask))
        return status

    @staticmethod
    def _gbc_outputs(logp, experience, sft, loss_mask):
        """SkyRL's per-sequence ``loss_fn_outputs``; gbc computes no log-prob outside the loss
        mask: NaN there."""
        am = experience.action_mask
        lens = (am.sum(-1) if am is not None else (loss_mask > 0).sum(-1)).long().tolist()
        lp = logp.detach().cpu()
        el = (-lp * loss_mask.cpu()).nan_to_num(0.0) if sft else None
        out = []
        for i, n in enumerate(lens):
            row = {"logprobs": lp[i, -n:].tolist() if n > 0 else []}
            if sft:
                row["elementwise_loss"] = el[i, -n:].tolist() if n > 0 else []
            out.append(row)
        return out

    def _forward_micro_batch(self, micro_batch):
        return _no_grad_logprobs(self, micro_batch, _temperature(self.cfg))


class GBCRefWorkerMixin:
    """Put before SkyRL's reference worker class: its log-prob pass runs gbc's."""

    def _forward_micro_batch(self, micro_batch):
        return _no_grad_logprobs(self, micro_batch, 1.0)


def _policy_loss(wrapper, seq, attn, T, call, **kwargs):
    """gbc's fused loss inside the wrapped model's forward, on SkyRL's layout: padded rows, or
    (``trainer.remove_microbatch_padding``) the micro-batch packed into one row at its
    per-sequence positions without an attention mask, as ``HFModelWrapper.forward`` runs it
    (flash-attention's varlen kernels find the sequences' boundaries)."""
    if not getattr(wrapper, "remove_microbatch_padding", False):
        return hf.policy_loss_through_forward(
            wrapper.model, seq, attn, T, model_kwargs={"position_ids": _position_ids(attn)},
            **call, **kwargs)
    hf.check_forward_inputs(hf.unwrap(wrapper.model), seq, attn, T, "response_length")
    pk = hf.pack_padded(seq, attn, T, call["mask"])
    return hf.packed_policy_loss_through_forward(wrapper.model, pk.input_ids, pk.position_ids,
                                                 pk.hidden, seq[:, -T:], **call, **kwargs)


def _no_grad_logprobs(worker, micro_batch, temperature):
    """SkyRL's ``_forward_micro_batch`` by gbc's row passes: ``[B, T]`` log-probs of the
    responses (float32), no logits. Packed (``trainer.remove_microbatch_padding``): SkyRL's
    packed values — the log-prob of the packed stream's next token, 0 where the token before
    is padding."""
    import gbc_kernels as gbc
    from skyrl.backends.skyrl_train.training_batch import TrainingOutputBatch

    micro_batch.to(torch.cuda.current_device())
    worker.model.eval()
    T = _check_wrapper(worker.model, micro_batch.metadata["response_length"])
    if micro_batch.get("pixel_values", None) is not None:
        raise ValueError("model: gbc's SkyRL worker runs text-only causal LMs (vision inputs "
                         "given)")
    seq, attn = micro_batch["sequences"], micro_batch["attention_mask"]
    if getattr(worker.model, "remove_microbatch_padding", False):
        hf.check_forward_inputs(hf.unwrap(worker.model.model), seq, attn, T, "response_length")
        pk = hf.pack_padded(seq, attn, T)

        def compute(h, head, cap):
            st = gbc.token_stats(pk.hidden(h), head.weight, pk.rolled, head.bias,
                                 temperature=temperature, logit_softcap=cap)
            return st.logp.masked_fill(~pk.valid, 0.0)

        with torch.no_grad():
            logp = hf.in_head(worker.model.model, pk.input_ids, None, None,
                              {"position_ids": pk.position_ids}, compute)
    else:
        logp, _ = hf.logprobs_through_forward(
            worker.model.model, seq, attn, T, temperature=temperature,
            model_kwargs={"position_ids": _position_ids(attn)})
    out = TrainingOutputBatch({"output": logp.to("cpu")})
    out.metadata = micro_batch.metadata
    return out
