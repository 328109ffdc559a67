"""gbc inside verl 0.9.1's Megatron engine (``MegatronEngineWithLMHead``): the loss and the
log-prob passes from the last pipeline stage's hidden states and the output layer's
``[V/tp, H]`` shard, over gbc's vocab-parallel path (:mod:`gbc_kernels.integrations.megatron`),
without the ``[tokens, V/tp]`` logits (docs/megatron.md).

verl's step stays verl's: its micro-batching, megatron's pipeline schedule, the packing and
unpacking of ``model_forward`` (``thd`` or ``bshd``), the ``num_micro_batch`` scaling and the
``calculate_per_token_loss`` branch of its ``postprocess_micro_batch_func``. During gbc's forward
step the model's output layer (``GPTModel.output_layer``) hands back its input — gathered along
the sequence under sequence parallelism, as megatron's layer gathers it — in place of the
logits; verl packs those hidden states like logits, and gbc's ``_lm_head_logits_processor``
projects only the response rows. The training loss replaces ``ppo_loss``'s value in
``postprocess_micro_batch_func``; verl's metrics come from its own ``ppo_loss`` on gbc's detached
per-token values. Under context parallelism (``thd`` only) each rank's own tokens go into the
loss, whose sequence terms are reduced over the CP group (docs/megatron.md, "Long context").
With NTHR on, verl's old-log-prob pass also keeps NTHR's inputs on the last stage (each CP
rank's response rows summed over the CP group), scored before the update (:mod:`.engine`).
Switched on with the FSDP engine (``GBC_VERL_ENGINE=1``, :func:`enable`).
"""

from __future__ import annotations

import contextlib
import types
from typing import Optional

import torch

from gbc_kernels import methods
from gbc_kernels.integrations import megatron as M
from gbc_kernels.integrations import verl as gv
from gbc_kernels.integrations.verl.engine import (
    BATCH_SELECTING_MODES, CERTAINTY_KEY, KL_WEIGHT_KEY, LOG_KEPT_MASS_KEY, NTHR_ROW_KEY,
    SUPPORT_REF_KEY, EngineMethods, _flag, _is_ppo_loss, _lengths, _rng_state, _temperature,
    engine_class)
from gbc_kernels.sequence_parallel import whole_loss


def _check_config(engine):
    """verl's Megatron options gbc cannot honour: refused by name (engine start-up and each
    ``forward_backward_batch``)."""
    ec, mc = engine.engine_config, engine.model_config
    if getattr(ec, "dynamic_context_parallel", False):
        raise ValueError("dynamic_context_parallel: gbc's engine maps megatron's static "
                         "context-parallel layout only (context_parallel_size); set it to False")
    if (ec.context_parallel_size or 1) > 1:
        if not ec.use_remove_padding:
            raise ValueError(f"context_parallel_size: {ec.context_parallel_size} runs in the "
                             f"packed layout only (verl packs for context parallelism in thd; "
                             f"its bshd step asserts context_parallel_size 1); set "
                             f"use_remove_padding=True")
    if getattr(getattr(mc, "mtp", None), "enable", False):
        raise ValueError("mtp.enable: gbc's engine computes the next-token head only; set "
                         "actor_rollout_ref.model.mtp.enable=False")
    qat = getattr(ec, "qat", None)
    if qat is not None and getattr(qat, "enable", False):
        raise ValueError("qat.enable: gbc reads the output layer's weight directly, past its "
                         "quantiser; set it to False")


def _check_cp_loss(loss_function, cp_size):
    """Under context parallelism each rank's loss sees its own tokens: Clip-Cov / KL-Cov,
    which pick tokens from the whole batch, are refused in verl's words."""
    mode = getattr(loss_function.keywords["config"].policy_loss, "loss_mode", "vanilla")
    if mode in BATCH_SELECTING_MODES:
        raise ValueError(f"policy_loss.loss_mode: {mode!r} selects tokens from the whole batch "
                         "(Clip-Cov at random, KL-Cov by covariance rank), which gbc's loss "
                         f"under context parallelism (context_parallel_size={cp_size}) does "
                         "not reproduce; choose another loss_mode or set "
                         "context_parallel_size=1")


def response_rows(batch, data_format, shape, cu_seqlens_padded=None):
    """``(rows [B, T], valid [B, T])``: the row of verl's packed model output (``shape``:
    ``[1, nnz, ...]`` for ``thd``, sequence ``b`` from ``cu_seqlens_padded[b]``; ``[B, S, ...]``
    for ``bshd``) that predicts response token ``t`` of sequence ``b``, flattened; padding
    positions point at row 0."""
    plens, rlens, T = _lengths(batch)
    device = plens.device
    if data_format == "thd":
        if cu_seqlens_padded is None or cu_seqlens_padded.numel() != plens.numel() + 1:
            got = None if cu_seqlens_padded is None else tuple(cu_seqlens_padded.shape)
            raise ValueError(
                "use_remove_padding: a packed (thd) batch needs its "
                "packed_seq_params.cu_seqlens_q_padded, one offset per sequence plus the end "
                f"({plens.numel() + 1} values), got {got}")
        starts = cu_seqlens_padded[:-1].to(device).long()
    else:
        starts = torch.arange(shape[0], device=device) * shape[1]
    return gv.response_rows(plens, rlens, T, starts)


def cp_response_rows(batch, cu_seqlens_padded, cp_size, cp_rank):
    """``(rows [B, T], valid [B, T], own [B, T])`` under context parallelism in ``thd``: the row
    of this CP rank's packed output (``[1, nnz/cp, ...]``) predicting response token ``t`` of
    sequence ``b``, where ``own`` (that token's position sits on this rank; elsewhere the row
    is 0). megatron's load-balanced layout: sequence ``b``'s padded length, in ``2·cp`` chunks,
    starts at ``cu_seqlens_padded[b] / cp`` on every rank, rank ``r`` holding chunks ``r`` then
    ``2·cp - 1 - r``. ``valid``: the whole micro-batch's response tokens. A packing without
    ``cu_seqlens_padded``, or whose padded lengths are not positive multiples of ``2·cp``, is
    refused before anything is computed."""
    if cu_seqlens_padded is None:
        raise ValueError(
            f"use_remove_padding: under context_parallel_size={cp_size} a packed (thd) batch "
            "needs its packed_seq_params.cu_seqlens_q_padded (each sequence's padded offset), "
            "got None")
    lengths = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).long()
    bad = ((lengths % (2 * cp_size) != 0) | (lengths < 2 * cp_size)).nonzero().flatten()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(
            f"context_parallel_size: {cp_size} splits each packed sequence into 2·cp = "
            f"{2 * cp_size} load-balanced chunks, so each padded length must be a positive "
            f"multiple of {2 * cp_size} (verl pads each sequence so); "
            f"packed_seq_params.cu_seqlens_q_padded gives sequence {b} a padded length of "
            f"{int(lengths[b])}")
    pos, valid = response_rows(batch, "thd", None, torch.zeros_like(cu_seqlens_padded))
    cu = cu_seqlens_padded.to(pos.device).long()
    chunk = (cu[1:] - cu[:-1])[:, None] // (2 * cp_size)
    start = cu[:-1, None] // cp_size
    c = pos // chunk
    first, second = c == cp_rank, c == 2 * cp_size - 1 - cp_rank
    rows = torch.where(first, start + pos - cp_rank * chunk,
                       start + chunk + pos - c * chunk)
    own = valid & (first | second)
    return torch.where(own, rows, torch.zeros_like(rows)), valid, own


def _nthr_add(batch, index, h, y, logp, valid, own, state, temperature):
    """One micro-batch's response rows into NTHR's ``batch`` (:class:`methods.NTHRBatch`):
    ``h [T, B, H]``, ``y``, ``logp`` (the pass's log-probs), ``valid``, ``own`` ``[B, T]``.
    Under context parallelism each rank holds ``own`` of the positions: the hidden states,
    targets and log-probs of the whole micro-batch are summed over the CP group (each position
    has one owner, the others give 0; ``[B, T, H]`` and ``[B, T]``, never ``[tokens, V]``), so
    every CP rank adds the whole micro-batch, as at CP 1."""
    h = h.transpose(0, 1)
    cp = state["cp"]
    if cp is not None:
        import torch.distributed as dist

        zero = torch.zeros((), dtype=h.dtype, device=h.device)
        h = torch.where(own[..., None], h, zero)
        y = torch.where(own, y, torch.zeros_like(y))
        logp = torch.where(own, logp, torch.zeros_like(logp))
        for t in (h, y, logp):
            dist.all_reduce(t, group=cp[0])
    weight = state["weight"]
    batch.add(index, h.contiguous(), y, valid,
              types.SimpleNamespace(weight=weight, bias=state["bias"]), None, temperature,
              vocab_parallel=M.vocab_parallel(weight, state["tp_group"]), logp=logp)


def _whole_ids(ids, own, cp):
    """The kept ids a pass built ``[B, T, K]`` (``-1`` in the rows this rank does not own) ->
    the whole micro-batch's on every context-parallel rank (each position's from its owner,
    ``-1`` padded to the group's widest ``K``); as is at CP 1."""
    if cp is None:
        return ids
    import torch.distributed as dist

    k = torch.tensor([ids.shape[-1]], dtype=torch.long, device=ids.device)
    dist.all_reduce(k, op=dist.ReduceOp.MAX, group=cp[0])
    ids = torch.nn.functional.pad(ids, (0, int(k) - ids.shape[-1]), value=-1)
    out = torch.where(own[..., None], ids + 1, torch.zeros_like(ids))
    dist.all_reduce(out, group=cp[0])
    return out - 1


class GBCMegatronMixin(EngineMethods):
    """gbc's forward step on top of verl's ``MegatronEngineWithLMHead``."""

    _gbc_state: Optional[dict] = None     # the head of the forward in progress
    _gbc_nthr: Optional[methods.NTHRBatch] = None     # NTHR's pass in progress
    _gbc_fused_requested = False          # use_fused_kernels was set (gbc's head took it)
    _gbc_keeps_nthr = True      # its forward-only step keeps NTHR's inputs (.engine)

    # -- start-up and entry points ----------------------------------------------------------
    def initialize(self):
        _check_config(self)
        return super().initialize()

    def _gbc_tensor_parallel(self, role) -> list:
        return [(f"actor_rollout_ref.{role}.megatron.tensor_model_parallel_size",
                 int(getattr(self.engine_config, "tensor_model_parallel_size", 1) or 1))]

    def _maybe_enable_fused_kernels(self):
        """verl's fused forward (``use_fused_kernels=True``): gbc's head takes its place — the
        same job, log-probs and entropy without the logits, with every loss and method — so
        verl's patch is not installed and the option is switched off in the engine's config,
        as verl itself switches it off where its fused forward cannot run (the worker shares
        the config: its batches then ask for the unfused step, where gbc's head sits). Batches
        gbc's head does not take (SFT, distillation) are then refused naming the option, since
        verl's unfused step would form the logits the option was set to avoid."""
        if self.engine_config.use_fused_kernels:
            import logging

            logging.getLogger(__name__).warning(
                "use_fused_kernels: gbc's head takes the place of verl's fused forward "
                "(docs/megatron.md); the option is switched off in the engine config")
            self.engine_config.use_fused_kernels = False
            self._gbc_fused_requested = True

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        _check_config(self)
        self._gbc_pending = {}
        return super().forward_backward_batch(data, loss_function, forward_only)

    def _gbc_holds_head(self):
        from megatron.core import parallel_state as mpu
        return mpu.is_pipeline_last_stage(ignore_virtual=True)

    def _gbc_nthr_agree_group(self):
        """Every rank: the pipeline stages, tensor- and context-parallel ranks of a replica
        run NTHR's own pass together, and the replicas score together."""
        return "world"

    def _gbc_nthr_forward(self, view, batch):
        """verl's forward-only pass over ``view``: each micro-batch's response rows into
        ``batch`` (NTHR's pass, :meth:`EngineMethods.gbc_nthr_pass`) on the last pipeline stage,
        which alone gets the scales (the loss is there)."""
        from verl.utils import tensordict_utils as tu

        tu.assign_non_tensor(view, calculate_entropy=False, calculate_sum_pi_squared=False)
        self._gbc_nthr = batch
        try:
            self.infer_batch(view, loss_function=None)
        finally:
            self._gbc_nthr = None
        return self._gbc_holds_head()

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        batch = next(batch_iter)
        again = iter([batch])
        if logits_processor_func is None:      # forward only: log-probs (verl's for distillation)
            ours = "responses" in batch and not _flag(batch, "distillation_use_topk")
        else:                                  # training: ppo_loss (SFT, distillation: verl's)
            ours = _is_ppo_loss(logits_processor_func)
        if not ours:
            if self._gbc_fused_requested:
                raise ValueError("use_fused_kernels: gbc's engine computes the policy loss and "
                                 "its log-prob passes in place of verl's fused forward; this "
                                 "batch (SFT, distillation) would run verl's unfused head. Set "
                                 "actor_rollout_ref.model.use_fused_kernels=False, or unset "
                                 "GBC_VERL_ENGINE")
            return super().forward_step(again, model, logits_processor_func,
                                        postprocess_micro_batch_func)
        if _flag(batch, "distillation_use_topk"):
            raise ValueError("distillation: gbc's engine computes the policy loss only; unset "
                             "GBC_VERL_ENGINE for distillation runs")
        with self._gbc_head(model):
            return super().forward_step(again, model, logits_processor_func,
                                        postprocess_micro_batch_func)

    @contextlib.contextmanager
    def _gbc_head(self, model):
        """The last stage's output layer returns its (sequence-gathered) input in place of the
        logits; records its weight shard, the packing (``cu_seqlens_q_padded``) and the
        context-parallel group, size and rank (None at CP 1)."""
        from megatron.core import parallel_state as mpu
        from verl.utils.megatron_utils import unwrap_model

        from gbc_kernels.integrations.megatron import output_layer_hidden

        inner = unwrap_model(model)
        with output_layer_hidden(inner) as state:
            if state is None:                            # not the last pipeline stage
                yield
                return
            cp = mpu.get_context_parallel_world_size()
            state.update(cu=None, cp=(mpu.get_context_parallel_group(), cp,
                                      mpu.get_context_parallel_rank()) if cp > 1 else None)

            def packing(module, args, kwargs):
                psp = kwargs.get("packed_seq_params")
                state["cu"] = None if psp is None else psp.cu_seqlens_q_padded

            hook = inner.register_forward_pre_hook(packing, with_kwargs=True)
            self._gbc_state = state
            try:
                yield
            finally:
                hook.remove()
                self._gbc_state = None

    # -- the head: verl's logits processor, on hidden states --------------------------------
    def _lm_head_logits_processor(self, logits, label, temperature, *, calculate_sum_pi_squared,
                                  calculate_entropy, distillation_use_topk, distillation_only,
                                  logits_processor_func, batch, data_format):
        state = self._gbc_state
        if state is None:
            return super()._lm_head_logits_processor(
                logits, label, temperature, calculate_sum_pi_squared=calculate_sum_pi_squared,
                calculate_entropy=calculate_entropy, distillation_use_topk=distillation_use_topk,
                distillation_only=distillation_only, logits_processor_func=logits_processor_func,
                batch=batch, data_format=data_format)
        hidden = logits                  # [1, nnz, H] (thd) or [B, S, H] (bshd)
        device = hidden.device
        cp = state["cp"]
        if cp is None:
            rows, valid = response_rows(batch, data_format, hidden.shape, state["cu"])
            own = valid
        else:       # this rank's tokens of every sequence; the loss reduces over the CP group
            rows, valid, own = cp_response_rows(batch, state["cu"], cp[1], cp[2])
        weight = state["weight"]
        h = hidden.reshape(-1, hidden.shape[-1])[rows.t()]                # [T, B, H]
        h = h.to(weight.dtype) if h.dtype != weight.dtype else h
        y = label.reshape(-1)[rows]                                         # [B, T]
        common = dict(output_bias=state["bias"], tp_group=state["tp_group"],
                      hidden_gathered=state["gathered"])

        dest = torch.where(own, rows, label.numel()).reshape(-1)      # padding: a spare slot

        def packed(v, dtype=torch.float32):  # [B, T] -> verl's layout of the logits' rows,
            out = torch.zeros(label.numel() + 1, dtype=dtype, device=device)  # 0 elsewhere
            out.scatter_(0, dest, v.detach().to(dtype).reshape(-1))
            return out[:-1].view(label.shape)

        if logits_processor_func is not None:       # training: the fused loss
            if cp is not None:
                _check_cp_loss(logits_processor_func, cp[1])
            kw = self._gbc_loss_inputs(batch, logits_processor_func, valid)
            if cp is not None:      # the whole micro-batch's normalisers, the rank's tokens
                kw["mask"] = kw["mask"] & own
                kw["context_parallel"] = cp[0]
            rng = _rng_state()
            res = M.policy_loss(h, weight, y, return_entropy=kw["config"].wants_entropy,
                                **common, **kw)
            loss = res.loss
            if cp is not None:      # verl's value (the whole loss on every CP rank), and the
                loss = whole_loss(loss, cp[0])   # gradient of this rank's tokens, as verl's
            self._gbc_pending[id(batch)] = (loss, res.metrics, rng)
            ret = {"log_probs": packed(res.logp)}
            if calculate_entropy:
                ret["entropy"] = packed(res.entropy)
            return ret
        temp = _temperature(batch)
        backend = self.gbc_options.backend
        certainty = _flag(batch, CERTAINTY_KEY, None)
        # NTHR's inputs: its own pass, or verl's old-log-prob pass with NTHR on (kept)
        nthr = self._gbc_nthr
        if nthr is None and NTHR_ROW_KEY in batch.keys():
            nthr = self._gbc_keeping
        # the sampler's kept set (support): the old-policy pass's (one kept set per rollout:
        # built there, its ids returned), or the reference's (that set replayed, or rebuilt)
        plan = self._gbc_plan()
        old = plan is not None and self._gbc_old_pass(batch)
        support = plan.old_pass_kwargs() if old else self._gbc_scored(
            plan, batch, y.shape[1], "the reference pass", device)
        with torch.no_grad():
            if certainty is not None:      # the reference pass of critical-token KL
                options = methods.MethodOptions(**certainty)
                scored = {} if old else support
                st = M.reference_stats(h, weight, y, options, own, temperature=temp,
                                       backend=backend, **common, **scored)
                ret = {"log_probs": packed(st.ref_logp)}
                if st.kl_weight is not None:
                    ret[KL_WEIGHT_KEY] = packed(st.kl_weight)
                return ret
            flags = dict(temperature=temp, backend=backend,
                         logits_dtype=self.gbc_options.logits_dtype,
                         return_entropy=bool(calculate_entropy),
                         return_sum_p2=bool(calculate_sum_pi_squared), **common)
            res = M.logprobs(h, weight, y, own, **flags, **support)
            logp, entropy, sum_p2, kept = res.logp, res.entropy, res.sum_p2, res.log_kept_mass
            if nthr is not None:      # the same log-probs, the rows kept (no second head)
                _nthr_add(nthr, batch[NTHR_ROW_KEY], h, y, logp, valid, own, state, temp)
        ret = {}
        if res.support_ids is not None:     # the built set: each token's row of the kept ids
            ids = _whole_ids(res.support_ids, own, cp)
            ret[SUPPORT_REF_KEY] = packed(self._gbc_keep_ids(ids, valid), torch.long)
        ret["log_probs"] = packed(logp)
        if calculate_entropy:
            ret["entropy"] = packed(entropy)
        if calculate_sum_pi_squared:
            ret["sum_pi_squared"] = packed(sum_p2)
        if kept is not None:
            ret[LOG_KEPT_MASS_KEY] = packed(kept)
        return ret

    # -- the loss into megatron's schedule --------------------------------------------------
    def postprocess_micro_batch_func(self, output, data, forward_only, loss_function,
                                     local_cp_size=None):
        """verl's, with gbc's loss in place of ``ppo_loss``'s value (its ``num_micro_batch``
        scaling and ``calculate_per_token_loss`` branch unchanged) and verl's metrics from its
        own ``ppo_loss`` on gbc's detached values."""
        pending = getattr(self, "_gbc_pending", {}).pop(id(data), None)
        if pending is None:
            return super().postprocess_micro_batch_func(output, data, forward_only,
                                                        loss_function, local_cp_size)
        loss, gbc_metrics, rng = pending

        def gbc_loss(model_output, data, dp_group=None):
            return loss, self._gbc_metrics(loss_function, data, model_output, rng, gbc_metrics)

        return super().postprocess_micro_batch_func(output, data, forward_only, gbc_loss,
                                                    local_cp_size)


def _megatron_engine():
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    return MegatronEngineWithLMHead


def __getattr__(name):
    """``GBCMegatronEngineWithLMHead``: gbc's engine class on verl's (built on first use:
    importing verl's Megatron engine needs megatron-core)."""
    if name == "GBCMegatronEngineWithLMHead":
        cls = engine_class(_megatron_engine(), GBCMegatronMixin)
        globals()[name] = cls
        return cls
    raise AttributeError(name)
