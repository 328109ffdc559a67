"""gbc's head inside AReaL 1.0.4's FSDP PPO actor (docs/areal.md).

:class:`GBCFSDPPPOActor` is AReaL's ``FSDPPPOActor`` with one change: the model runs to its
final norm, and the lm_head's forward computes, from the hidden states and the head's weight,
the log-probs (and entropy) of the packed micro-batch's rolled labels with gbc's fused pass
(:func:`gbc_kernels.fused_linear_logprobs`), chunk by chunk: no ``[N, V]`` logits. AReaL's
own code does everything else — micro-batching and packing, Ulysses sequence parallelism, its
loss functions (``grpo_loss_fn`` and what it calls, with every ``PPOActorConfig`` option), its
token-mean scaling, its metrics — on those log-probs, so the update and the ``compute_logp``
passes (old policy, proximal policy, reference) equal AReaL's on the same batch.

The method options (``GBC_AREAL_OPTIONS``, :func:`gbc_kernels.integrations.areal.enable`)
act on the advantages AReaL's loss receives (:mod:`.losses`); Lopti runs two of AReaL's
``train_batch`` updates per minibatch (:meth:`GBCFSDPPPOActor.train_batch`).
"""

from __future__ import annotations

import os

import torch
from areal.engine.fsdp_engine import FSDPPPOActor

from gbc_kernels import fused_linear_logprobs, methods
from gbc_kernels.integrations import hf

from .losses import (KL_WEIGHT_KEY, OPTIONS_ENV, check_engine, check_options, is_reference,
                     lopti_train_stats, method_loss_fn, options_from_env, silent_stats)


class GBCFSDPPPOActor(FSDPPPOActor):
    """AReaL's FSDP PPO actor with gbc's head (module docstring). Reads its method options
    from ``GBC_AREAL_OPTIONS`` when built (AReaL's single controller builds it in its worker
    processes, which :meth:`as_controller` gives the options)."""

    def __init__(self, config):
        self.gbc_options = options_from_env()
        check_options(config, self.gbc_options)
        # the reference engine (AReaL's ref config, marked by enable(config)) gives
        # critical-token KL's weights in its compute_logp
        self._gbc_certainty = (self.gbc_options.critical_kl_exponent is not None
                               and is_reference(config))
        self._gbc_side = None
        super().__init__(config)

    # -- critical-token KL: the reference pass's weights, the reward's KL term ---------------
    def compute_logp(self, data, *args, **kwargs):
        """AReaL's ``compute_logp``; in the reference engine under critical-token KL, each
        trajectory of ``data`` also receives ``gbc_kl_weight`` (``[1, S]``, aligned as the
        log-probs): ``(1 - c) J^gamma + c`` from the same streaming pass (docs/methods.md)."""
        if not self._gbc_certainty or not isinstance(data, list):
            return super().compute_logp(data, *args, **kwargs)
        from areal.utils.data import concat_batch, split_batch

        logps = super().compute_logp(data, *args, **kwargs)
        weights = split_batch(self._gbc_kl_weights, concat_batch(data)[1])
        for traj, w in zip(data, weights):
            traj[KL_WEIGHT_KEY] = w
        return logps

    def forward_batch(self, input_, output_seqlens=None, aggregate_fn=torch.cat):
        """AReaL's ``forward_batch``; with the certainty weights wanted, they are collected
        beside the log-probs and reordered and padded the same way (AReaL's own
        ``reorder_and_pad_outputs``), into ``self._gbc_kl_weights``."""
        if not self._gbc_certainty:
            return super().forward_batch(input_, output_seqlens, aggregate_fn)
        from areal.engine import fsdp_engine

        real, got = fsdp_engine.reorder_and_pad_outputs, {}
        self._gbc_side = []

        def both(outputs, seqlens, mb_list, agg=torch.cat):
            got["w"] = real(self._gbc_side, seqlens, mb_list, agg)
            return real(outputs, seqlens, mb_list, agg)

        fsdp_engine.reorder_and_pad_outputs = both
        try:
            result = super().forward_batch(input_, output_seqlens, aggregate_fn)
        finally:
            fsdp_engine.reorder_and_pad_outputs = real
            self._gbc_side = None
        self._gbc_kl_weights = got["w"]
        return result

    def compute_advantages(self, data, *args, **kwargs):
        """AReaL's ``compute_advantages``; under critical-token KL its per-token KL reward
        ``-kl_ctl * kl_estimator(old_logp, ref_logp)`` is multiplied by the reference pass's
        weights (``gbc_kl_weight`` in every trajectory: refused by name when a trajectory has
        none, never an unweighted KL)."""
        if self.gbc_options.critical_kl_exponent is None:
            return super().compute_advantages(data, *args, **kwargs)
        missing = [i for i, t in enumerate(data) if KL_WEIGHT_KEY not in t]
        if missing:
            raise ValueError(f"{OPTIONS_ENV}: critical_kl_exponent: trajectory {missing[0]} "
                             "has no certainty weights from the reference engine's "
                             "compute_logp (AReaL's trainer runs it when actor.kl_ctl > 0 "
                             "and a ref config is set; enable(config) marks that engine)")
        actor = self.actor
        real_fn, real_est = actor._compute_advantages, actor.kl_estimator

        def weighted(batch):
            w = batch[KL_WEIGHT_KEY].float()
            actor.kl_estimator = lambda logp, base: real_est(logp, base) * w.to(logp.device)
            try:
                return real_fn(batch)
            finally:
                actor.kl_estimator = real_est

        actor._compute_advantages = weighted
        try:
            return super().compute_advantages(data, *args, **kwargs)
        finally:
            del actor._compute_advantages

    @classmethod
    def as_controller(cls, config, scheduler):
        """AReaL's controller for this class, with this process's ``GBC_AREAL_OPTIONS`` put
        into every scheduling spec's ``env_vars``: the worker processes that build the engine
        read the options the controller was switched on with."""
        options = options_from_env()
        check_options(config, options)
        if options.critical_kl_exponent is not None:
            raise ValueError(f"{OPTIONS_ENV}: critical_kl_exponent="
                             f"{options.critical_kl_exponent}: the certainty weights travel "
                             "in the trajectories, which AReaL's single controller serialises "
                             "to its workers; run under AReaL's SPMD launcher")
        text = os.environ.get(OPTIONS_ENV, "")
        for spec in getattr(config, "scheduling_spec", ()) or ():
            spec.env_vars = {**(spec.env_vars or {}), OPTIONS_ENV: text}
        return super().as_controller(config, scheduler)

    def initialize(self, *args, **kwargs):
        check_engine(self)
        return super().initialize(*args, **kwargs)

    # -- Lopti: two updates per AReaL minibatch ----------------------------------------------
    def train_batch(self, input_, loss_fn, loss_weight_fn):
        """AReaL's ``train_batch`` (one optimizer step on ``input_``, a minibatch of AReaL's
        ``ppo_update``); under Lopti, one per phase (low then high by default), each on the
        same minibatch with the same proximal log-probs (the split stays fixed, the second
        update's ratio carries the first's drift). AReaL's metrics of the minibatch are logged
        once, from the unsplit loss at the first update's parameters (the batch's terms, as
        without Lopti); the statistics returned: :func:`.losses.lopti_train_stats`."""
        phases = self.gbc_options.phases
        if phases == (None,) or not isinstance(input_, dict) or "advantages" not in input_:
            return super().train_batch(input_, loss_fn, loss_weight_fn)
        stats = []
        for i, phase in enumerate(phases):
            self._gbc_phase = (phase, i == 0)
            try:
                stats.append(super().train_batch(dict(input_), loss_fn, loss_weight_fn))
            finally:
                self._gbc_phase = None
        return lopti_train_stats(phases, stats)

    # -- AReaL's loop over micro-batches, with gbc's head --------------------------------------
    def forward_backward_batch(self, mb_list, process_output_fn, forward_only=False):
        """AReaL's ``FSDPEngine.forward_backward_batch`` (tree training refused at
        :meth:`initialize`), the model's forward run with the lm_head's forward replaced by
        gbc's fused log-prob pass over this rank's rows; ``process_output_fn`` receives
        ``[N, 1]`` zeros tied to that pass in place of the logits, and the log-probs come from
        :meth:`_gbc_rows`."""
        from areal.utils.perf_tracer import trace_scope

        for mb_item in mb_list:
            inputs, ctx = self._prepare_mb_inputs(mb_item)
            labels = inputs.get("rolled_input_ids",
                                torch.roll(inputs["input_ids"], shifts=-1, dims=-1))
            labels = labels.reshape(-1)
            inner = hf.unwrap(self.model)
            captured = {}

            def head_forward(hidden, *args, **kwargs):
                head = hf.lm_head(inner)          # as FSDP2 holds it during this forward
                h = hidden.reshape(-1, hidden.shape[-1]).to(head.weight.dtype)
                if self._gbc_side is not None:    # the reference pass, with its weights
                    st = methods.reference_stats(
                        h, head.weight, labels.to(h.device), self.gbc_options, head.bias,
                        temperature=self.config.temperature,
                        logit_softcap=hf.logit_softcap(inner))
                    captured["rows"] = (st.ref_logp, None)
                    captured["kl_weight"] = st.kl_weight
                    return hidden[..., :1] * 0
                logp, entropy = fused_linear_logprobs(
                    h, head.weight, labels.to(h.device), head.bias,
                    temperature=self.config.temperature, return_entropy=not forward_only,
                    logit_softcap=hf.logit_softcap(inner),
                    logits_dtype=self.gbc_options.logits_dtype)
                captured["rows"] = (logp, entropy)
                stand_in = hidden[..., :1] * 0
                return stand_in + (logp.sum() * 0).to(hidden.dtype) if logp.requires_grad \
                    else stand_in

            with trace_scope("fsdp_engine.forward"), hf.replaced_head_forward(inner,
                                                                               head_forward):
                outputs = self.model(**inputs)
            if "rows" not in captured:
                raise RuntimeError("model: its forward did not call its lm_head")
            self._gbc_captured = captured["rows"]
            self._gbc_captured_weight = captured.get("kl_weight")
            loss = process_output_fn(outputs.logits.squeeze(0), ctx.to_dict())
            self._gbc_captured = self._gbc_captured_weight = None
            if not forward_only and loss is not None:
                with trace_scope("fsdp_engine.backward"):
                    loss.backward()

    def _gbc_rows(self, ctx):
        """This micro-batch's log-probs and entropy as AReaL's ``_compute_logprobs_entropy``
        returns them: gathered over the Ulysses group, its padding and the micro-batch's
        padding removed."""
        logp, entropy = self._gbc_captured
        if self.parallel_helper.sp_size > 1:
            logp = self._sp_all_gather(logp)
            entropy = None if entropy is None else self._sp_all_gather(entropy)
            if ctx.ulysses_pad_size > 0:
                logp = logp[:-ctx.ulysses_pad_size]
                entropy = None if entropy is None else entropy[:-ctx.ulysses_pad_size]
        if ctx.pad_length > 0:
            logp = logp[:-ctx.pad_length]
            entropy = None if entropy is None else entropy[:-ctx.pad_length]
        return logp, entropy

    def _compute_logprobs_and_loss(self, logits, ctx, loss_fn, loss_weight_fn,
                                   total_loss_weight, loss_multiplier=1.0):
        """AReaL's (same scaling: the micro-batch's loss weight over the batch's, times
        ``loss_multiplier``), on gbc's log-probs; the loss function gets no per-token min/max
        logits (``vocab_min_logits`` / ``vocab_max_logits``: None, so AReaL logs neither)."""
        local_weight = loss_weight_fn(ctx.mb_input)
        if local_weight == 0:
            return logits.mean() * 0.0
        logp, entropy = self._gbc_rows(ctx)
        kw = dict(vocab_min_logits=None, vocab_max_logits=None)
        phase, log = getattr(self, "_gbc_phase", None) or (None, True)
        if phase is None:
            loss = method_loss_fn(loss_fn, self.gbc_options)(logp, entropy, ctx.mb_input, **kw)
        else:
            if log:         # AReaL's metrics: the batch's terms, once per minibatch
                with torch.no_grad():
                    method_loss_fn(loss_fn, self.gbc_options)(logp.detach(), entropy,
                                                              ctx.mb_input, **kw)
            with silent_stats():
                loss = method_loss_fn(loss_fn, self.gbc_options, phase)(
                    logp, entropy, ctx.mb_input, **kw)
        # the stand-in keeps FSDP2's hooks on the forward's output in the backward graph
        loss = loss + logits.float().sum() * 0
        return loss * (local_weight / total_loss_weight * loss_multiplier)

    def _compute_forward_result(self, logits, ctx):
        """``compute_logp``'s rows: gbc's log-probs of the micro-batch (and, in the reference
        pass under critical-token KL, its weights, trimmed the same way, collected aside)."""
        if self._gbc_side is not None:
            logp, weight = self._gbc_captured
            self._gbc_captured = (self._gbc_captured_weight, None)
            self._gbc_side.append(self._gbc_rows(ctx)[0])
            self._gbc_captured = (logp, weight)
        return self._gbc_rows(ctx)[0]
