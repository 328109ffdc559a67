"""gbc's Megatron head inside SkyRL 0.3 / 0.4's ``MegatronModelWrapper`` (docs/skyrl.md).

:class:`GBCMegatronModelWrapper` runs SkyRL's own ``forward`` (the no-grad log-prob pass) and
``forward_backward_mini_batch`` (the training step): its micro-batching, its ``forward_step``
(``remove_left_padding``, the model call, ``recover_left_padding``), megatron's schedules and
backward. Two things change: while SkyRL's ``forward_step`` runs the model, the last stage's
output layer returns its (sequence-gathered) input in place of the ``[B, S, V/tp]`` logits
(:func:`gbc_kernels.integrations.megatron.output_layer_hidden`, the mechanism of gbc's verl
engine); and the function SkyRL hands the schedule for those outputs (its ``loss_func`` /
``collection_func``) is gbc's: :func:`gbc_kernels.integrations.megatron.policy_loss` /
``logprobs`` on the response rows and this rank's ``[V/tp, H]`` shard (TP, SP, PP as there).
The loss is SkyRL's registered loss through gbc's table (:mod:`.losses`), scaled as SkyRL's
wrapper scales it; the metrics are SkyRL's (:func:`.worker.step_metrics`). Under SkyRL 0.4's
``trainer.algorithm.enable_sample_support_replay`` the loss and the log-prob passes (old policy,
reference) are over each token's recorded support (:func:`_support_ids`: the micro-batch's
``rollout_sample_support`` as gbc's ``support_ids``, docs/skyrl.md "The sampler's support"),
and so are NTHR's scores (the old-policy pass keeps the support with its rows) and
critical-token KL's certainty (the reference pass's).
"""

from __future__ import annotations

import contextlib
import functools
import types

from typing import NamedTuple

import torch

from gbc_kernels.integrations import megatron as gbc_megatron
from gbc_kernels.sequence_parallel import owned_sum, whole_loss

from . import losses
from .worker import (CARRIED, KL_WEIGHT_KEY, OPTIONS_ENV, SUPPORT_FIELD, _check_sft,
                     check_config, keep_rows, loss_fn_outputs, lopti_terms, method_fields,
                     method_options, replay_support_ids, row_keys, step_metrics, take_recorded,
                     unsplit_loss_value)

WRAPPER_MODULE = "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper"


CP_PADDED = (
    "trainer.policy.megatron_config.context_parallel_size={cp} with "
    "trainer.remove_microbatch_padding=false: gbc's SkyRL Megatron wrapper runs context "
    "parallelism on SkyRL's packed micro-batches only (SkyRL's padded path hands its log-prob "
    "functions no context-parallel group): set trainer.remove_microbatch_padding=true")
CP_COV = (
    "trainer.algorithm.policy_loss_type: clip_cov / kl_cov select tokens from the whole "
    "micro-batch, which gbc's loss under context parallelism "
    "(trainer.policy.megatron_config.context_parallel_size={cp}) does not reproduce: choose "
    "another policy_loss_type or set context_parallel_size=1")


def check_megatron_config(cfg, options=None, is_vlm=False):
    """Refuse, naming SkyRL's option, what gbc's Megatron wrapper does not run (``cfg``:
    SkyRL's ``trainer`` config); then the loss table's checks (:func:`.worker.check_config`).
    Returns the method options."""
    losses.check_skyrl_version()
    opts = method_options() if options is None else options
    if losses.get(cfg, "fused_lm_head_logprob", False):
        raise ValueError("trainer.fused_lm_head_logprob=true: SkyRL's own fused LM head; gbc's "
                         "head already forms no logits (set false)")
    if losses.get(cfg, "policy.megatron_config.mtp_num_layers", None):
        raise ValueError("trainer.policy.megatron_config.mtp_num_layers: SkyRL's MTP draft loss "
                         "needs the main logits, which gbc's head never forms (unset it)")
    cp = losses.get(cfg, "policy.megatron_config.context_parallel_size", 1) or 1
    if cp > 1:
        if not losses.get(cfg, "remove_microbatch_padding", True):
            raise ValueError(CP_PADDED.format(cp=cp))
        if losses.get(cfg, "algorithm.policy_loss_type", None) in ("clip_cov", "kl_cov"):
            raise ValueError(CP_COV.format(cp=cp))
    rank = losses.get(cfg, "policy.model.lora.rank", 0) or 0
    if rank > 0:
        raise ValueError(f"trainer.policy.model.lora.rank={rank}: LoRA on the Megatron backend "
                         f"is not run by gbc's wrapper (set 0)")
    if is_vlm:
        raise ValueError("model: gbc's SkyRL Megatron wrapper runs text-only causal LMs "
                         "(a vision-language model given)")
    return check_config(cfg, opts, ulysses=False)


def _inner(model):
    while hasattr(model, "module"):
        model = model.module
    return model


@contextlib.contextmanager
def _gbc_head(make_func):
    """While open, SkyRL's wrapper's schedule (``get_forward_backward_func`` of its module)
    runs SkyRL's ``forward_step`` with the output layer giving hidden states, and hands the
    schedule ``make_func(hidden, data=, state=)`` in place of SkyRL's own function of the
    logits (on the last pipeline stage)."""
    import importlib

    module = importlib.import_module(WRAPPER_MODULE)
    original = module.get_forward_backward_func

    def get_forward_backward_func(*args, **kwargs):
        schedule = original(*args, **kwargs)

        def run(*a, forward_step_func, **kw):
            def forward_step(batch_iter, model):
                with gbc_megatron.output_layer_hidden(_inner(model)) as state:
                    outputs, func = forward_step_func(batch_iter, model)
                if state is None:           # not the last stage: the schedule sends outputs
                    return outputs, func
                return outputs, functools.partial(make_func, data=func.keywords["data"],
                                                  state=state)

            return schedule(*a, forward_step_func=forward_step, **kw)

        return run

    module.get_forward_backward_func = get_forward_backward_func
    try:
        yield
    finally:
        module.get_forward_backward_func = original


class _ContextParallel(NamedTuple):
    group: object            # the context-parallel process group
    own: torch.Tensor        # [B, T] bool: the response positions this rank holds


def _rows(hidden, data):
    """The response rows ``[T, B, H]`` of the model's hidden states (row ``t`` predicting token
    ``t + 1``), their labels ``[B, T]``, which of them SkyRL computes (``[B, T]`` bool; None:
    all) and, under context parallelism, the group and the positions this rank holds (else
    None). Padded: SkyRL's de-padded ``[B, S, H]``. Packed
    (``trainer.remove_microbatch_padding``): SkyRL's ``[1, N, H]`` stream, sequence ``i`` from
    ``packed_seq_params.cu_seqlens_q_padded[i]``; SkyRL's packed log-probs exist where both the
    token and the one before it are real. Under context parallelism this rank's stream holds
    ``N / cp`` positions: 2 of every sequence's ``2 cp`` chunks, placed by SkyRL's own map
    (``_packed_cp_rank_and_local_indices``); a row it does not hold is row 0 here."""
    from megatron.core import parallel_state as mpu

    T = int(data["num_actions"])
    labels = data["sequences"][:, -T:]
    psp = data.get("packed_seq_params")
    cp = mpu.get_context_parallel_world_size()
    if psp is None:
        if cp > 1:
            raise ValueError(CP_PADDED.format(cp=cp))
        return hidden[:, -T - 1:-1].transpose(0, 1), labels, None, None
    if data.get("sub_seq_lengths_list") is not None:
        raise ValueError("sub_seq_lengths: SkyRL's mini-batch packing (several sequences per "
                         "row) is not run by gbc's SkyRL Megatron wrapper")
    attn = data["attention_mask"].bool()
    cu = psp.cu_seqlens_q_padded.to(attn.device).long()
    at = (attn.long().cumsum(-1) - 1)[:, -T - 1:-1]          # [B, T]: offsets in the segments
    valid = attn[:, -T - 1:-1] & attn[:, -T:]
    at = torch.where(valid, at, torch.zeros_like(at))
    at = cu[:-1, None] + at                                   # [B, T]: packed positions
    flat = hidden.reshape(-1, hidden.shape[-1])
    if cp == 1:
        return flat[at.t()], labels, valid, None
    from skyrl.backends.skyrl_train.distributed.megatron.model_utils import (
        _packed_cp_rank_and_local_indices, _packed_sequence_indices)

    cu, _, seq, offset, lens = _packed_sequence_indices(cu, int(cu[-1]), attn.device)
    rank, local = _packed_cp_rank_and_local_indices(cu, seq, offset, lens, cp)
    own = valid & (rank[at] == mpu.get_context_parallel_rank())
    local = torch.where(own, local[at], torch.zeros_like(at))
    return flat[local.t()], labels, valid, _ContextParallel(mpu.get_context_parallel_group(),
                                                            own)


def _final_loss(loss, entropy, cp, algo, loss_mask, weight):
    """SkyRL's ``final_loss`` metric of a micro-batch: the loss's value; under context
    parallelism SkyRL's per-rank value, whose entropy term is the rank's own tokens' share
    (SkyRL's packed entropy for the loss; its KL and policy terms are whole): the whole loss
    with the other ranks' entropy share taken out. Under SkyRL 0.4's sample-support replay its
    entropy is the support's, all-gathered over the group with the log-probs: the whole loss.
    ``weight``: the loss's KL / entropy weight."""
    value = loss.item()
    if (cp is None or not losses.get(algo, "use_entropy_loss", False)
            or losses.sample_support_replay(algo)):
        return value
    from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean

    ent = _whole(entropy, cp).to(loss_mask.dtype)
    others = masked_mean(ent.masked_fill(cp.own, 0.0), loss_mask)
    return value + float(algo.entropy_loss_coef) * others.item() * weight


def _whole(values, cp):
    """Per-position values of this rank's rows -> every position's (summed over the CP group:
    each position has one owner); as they are without context parallelism."""
    if cp is None or values is None:
        return values
    return owned_sum(values, cp.own, cp.group)


# SkyRL 0.4's Megatron messages (skyrl.backends.skyrl_train.utils.sample_support_replay's
# compute_sample_support_scores)
SUPPORT_NO_LOSS_MASK = "sample-support replay requires the response loss mask"


def _support_ids(algo, data, T):
    """Under SkyRL 0.4's ``enable_sample_support_replay`` (else None): the micro-batch's
    ``rollout_sample_support`` as gbc's ``support_ids [B, T, k]`` of its ``[B, T]`` response
    columns (:func:`.worker.replay_support_ids`: SkyRL's alignment, one map for the padded and
    the packed layouts; under context parallelism every rank reads the whole micro-batch's,
    its own tokens masked in). Refused as SkyRL's Megatron wrapper refuses: no support (its
    message for the Megatron forward), no loss mask, controller-packed rows of several
    sequences, a loss-active token whose row holds no id."""
    if not losses.sample_support_replay(algo):
        return None
    from skyrl.backends.skyrl_train.utils.sample_support_replay import (
        missing_sample_support_message, reject_unsupported_sample_support_packing)

    support = data.get(SUPPORT_FIELD)
    if support is None:
        raise ValueError(missing_sample_support_message("Megatron"))
    reject_unsupported_sample_support_packing(data.get("sub_seq_lengths_list"))
    loss_mask = data.get("loss_mask")
    if loss_mask is None:
        raise ValueError(SUPPORT_NO_LOSS_MASK)
    return replay_support_ids(support, loss_mask, data["attention_mask"], T)


def _head(state):
    return dict(output_bias=state["bias"], tp_group=state["tp_group"],
                hidden_gathered=state["gathered"])


def _attach(micro_batches, recorded):
    """The fields gbc carries (:data:`.worker.CARRIED`: NTHR's scales, critical-token KL's
    weights), recorded per experience while SkyRL's Megatron worker made its micro-batch dicts
    (:func:`.worker.recording`), into those dicts (same order): rows SkyRL padded a micro-batch
    with (``_pad_microbatch_to_size``) and SkyRL's padding micro-batches get zeros, as SkyRL
    pads its own fields."""
    if recorded is None:
        return
    if len(recorded) != len(micro_batches):
        raise ValueError(f"{OPTIONS_ENV}: {len(recorded)} micro-batches carried gbc's fields "
                         f"for SkyRL's {len(micro_batches)}: the micro-batches are not the "
                         f"worker's experiences")
    keys = [k for k in CARRIED if any(k in r for r in recorded)]
    for mb, fields in zip(micro_batches, recorded):
        B, T = mb["sequences"].shape[0], int(mb["num_actions"])
        for key in keys:
            value = fields.get(key)
            if value is None:
                if mb["loss_mask"].any():
                    raise ValueError(f"{OPTIONS_ENV}: a micro-batch with loss tokens carries "
                                     f"no '{key}'")
                value = torch.zeros(0, T)
            value = value.to(mb["sequences"].device)
            if value.shape[0] < B:
                value = torch.cat([value, value.new_zeros(B - value.shape[0], T)])
            mb[key] = value


def _wrapper_methods(base):
    """gbc's ``__init__``, ``forward`` and ``forward_backward_mini_batch`` over SkyRL's
    (``base``: its ``MegatronModelWrapper`` methods)."""

    def __init__(self, config, actor_module, actor_optimizer=None, policy_loss_fn=None,
                 is_vlm=False):
        self.gbc_options = check_megatron_config(config, is_vlm=is_vlm)
        # set by gbc's workers for the length of a call: the Lopti phase, NTHR's rows being
        # kept by the old-log-prob pass, the reference pass's options (critical-token KL) and
        # the KL weights it gives (row key -> [T])
        self.gbc_phase = self.gbc_keeping = self.gbc_reference = self.gbc_ref_weights = None
        base["__init__"](self, config, actor_module, actor_optimizer, policy_loss_fn, is_vlm)

    def forward(self, micro_batches, seq_len, micro_batch_size, temperature=1.0):
        """SkyRL's no-grad log-prob pass by gbc's row pass (:func:`gbc_kernels.integrations.
        megatron.logprobs`): the ``[B, T]`` response log-probs, no logits. With
        :attr:`gbc_keeping` set (NTHR, the old-log-prob pass) each micro-batch's rows are kept
        too; with :attr:`gbc_reference` set (critical-token KL, the reference pass) the same
        sweep gives the KL weights, into :attr:`gbc_ref_weights` by row key."""
        def collect(hidden, data, state):
            h, y, valid, cp = _rows(hidden, data)
            weight, ref, keep = state["weight"], self.gbc_reference, self.gbc_keeping
            h = h.to(weight.dtype)
            seq, attn = data["sequences"], data["attention_mask"]
            mask = None if cp is None else cp.own
            support = _support_ids(self.cfg.algorithm, data, y.shape[1])
            if ref is not None:
                st = gbc_megatron.reference_stats(h, weight, y, ref, mask,
                                                  temperature=temperature,
                                                  support_ids=support, **_head(state))
                logp, kl_weight = _whole(st.ref_logp, cp), _whole(st.kl_weight, cp)
                if valid is not None:
                    kl_weight = kl_weight.masked_fill(~valid, 0.0)
                self.gbc_ref_weights.update(zip(row_keys(seq, attn), kl_weight.float().cpu()))
            else:
                logp = _whole(gbc_megatron.logprobs(h, weight, y, mask, temperature=temperature,
                                                    return_entropy=False,
                                                    logits_dtype=self.gbc_options.logits_dtype,
                                                    support_ids=support, **_head(state)).logp,
                              cp)
            if keep is not None:       # every CP rank keeps the whole rows (each from its owner)
                real = attn[:, -y.shape[1]:].bool()
                keep_rows(keep, seq, attn, _whole(h.transpose(0, 1), cp), y,
                          real if valid is None else real & valid,
                          types.SimpleNamespace(weight=weight, bias=state["bias"]), None,
                          temperature, logp,
                          vocab_parallel=gbc_megatron.vocab_parallel(weight, state["tp_group"]),
                          support_ids=support)
            logp = logp if valid is None else logp.masked_fill(~valid, 0.0)
            return torch.tensor(0.0, device=hidden.device), {"log_probs": logp}

        with _gbc_head(collect):
            return base["forward"](self, micro_batches, seq_len, micro_batch_size, temperature)

    def forward_backward_mini_batch(self, micro_batches, seq_len, micro_batch_size,
                                    temperature=1.0, loss_fn=None, loss_fn_config=None,
                                    forward_only=False, **kwargs):
        """SkyRL's training step (or its loss-only pass) with gbc's fused loss in place of
        SkyRL's ``loss_func``: the same loss value, scaling, metrics and gradients
        (``kwargs``: SkyRL 0.4's ``return_per_token_outputs``)."""
        from megatron.core import parallel_state as mpu

        algo = self.cfg.algorithm
        loss_type = loss_fn if loss_fn is not None else algo.policy_loss_type
        opts = self.gbc_options
        _check_sft(opts, loss_type)
        if loss_fn_config:
            raise ValueError("loss_fn_config: per-call loss overrides are not run by gbc's "
                             "SkyRL Megatron wrapper; set them in trainer.algorithm")
        if getattr(gbc_megatron_config(self), "mtp_num_layers", None):
            raise ValueError("trainer.policy.megatron_config.mtp_num_layers: SkyRL's MTP draft "
                             "loss needs the main logits, which gbc's head never forms")
        sft = loss_type == "cross_entropy"
        _attach(micro_batches, take_recorded())
        phase = self.gbc_phase

        def loss_func(hidden, data, state):
            nmb = data["num_microbatches"]
            nreal = data.get("num_real_microbatches", nmb)
            dp = mpu.get_data_parallel_world_size(with_context_parallel=False)
            # SkyRL: policy * nmb * dp + (kl - entropy terms) * nmb / max(1, nreal)
            cfg = losses.policy_loss_config(
                algo, loss_type, kl_entropy_weight=None if sft else 1.0 / (dp * max(1, nreal)),
                temperature=temperature, return_entropy=not sft, **opts.loss_options())
            loss_mask = data["loss_mask"]
            old, base_lp = data["old_action_log_probs"], data["base_action_log_probs"]
            call, _ = losses.policy_loss_inputs(algo, loss_type, loss_mask, data["advantages"],
                                                old, data["rollout_action_logprobs"])
            scale, kl_weight = method_fields(data, opts, cfg, loss_mask.device)
            h, y, _, cp = _rows(hidden, data)      # packed: the loss mask's rows are real
            mask, whole_call = call["mask"], call
            extra = {}
            support = _support_ids(algo, data, y.shape[1])
            if support is not None:     # SkyRL 0.4's replay: over each token's support
                extra["support_ids"] = support
            if cp is not None:      # the whole micro-batch's normalisers, this rank's tokens
                if cfg.cov_mode is not None:
                    raise ValueError(CP_COV.format(cp=mpu.get_context_parallel_world_size()))
                call = dict(call, mask=mask.bool() & cp.own)
                extra["context_parallel"] = cp.group
            out = gbc_megatron.policy_loss(h.to(state["weight"].dtype), state["weight"], y,
                                           config=cfg, return_entropy=not sft,
                                           ref_logp=base_lp if cfg.kl_coef else None,
                                           token_scale=scale, kl_weight=kl_weight, phase=phase,
                                           **call, **extra, **_head(state))
            # under CP: the whole loss's value, the gradient of this rank's tokens (SkyRL's
            # all-gather of the log-probs gives each rank its own tokens' gradient)
            loss = out.loss if cp is None else whole_loss(out.loss, cp.group)
            token_out = {"logp": _whole(out.logp, cp), "entropy": _whole(out.entropy, cp)}
            logp, m = step_metrics(algo, loss_type, token_out, mask, loss_mask,
                                   data["advantages"], old, base_lp,
                                   data["rollout_action_logprobs"], opts, phase, scale)
            rmask = data.get("response_mask")            # SkyRL 0.4; 0.3: "action_mask"
            rmask = data.get("action_mask") if rmask is None else rmask
            outputs = loss_fn_outputs(logp, rmask, sft, loss_mask,
                                      kwargs.get("return_per_token_outputs", True))
            if sft:
                metrics = {"loss": m.pop("policy_loss"), "response_length": data["num_actions"],
                           "loss_fn_outputs": outputs}
            else:
                metrics = {"final_loss": _final_loss(loss, out.entropy, cp, algo, loss_mask,
                                                     1.0 / (dp * max(1, nreal))),
                           "loss_fn_outputs": outputs, **m}
                if support is not None:     # the share of loss tokens the sampler's row lacked
                    metrics["gbc_support_forced_frac"] = float(
                        out.metrics["support_forced_frac"])
                if phase is not None:     # Lopti: the batch's terms without the split
                    _, whole_m = step_metrics(algo, loss_type, token_out, mask, loss_mask,
                                              data["advantages"], old, base_lp,
                                              data["rollout_action_logprobs"], opts, None,
                                              scale)
                    final = metrics["final_loss"] + unsplit_loss_value(
                        token_out, whole_call, cfg, base_lp if cfg.kl_coef else None, scale,
                        kl_weight) - loss.item()
                    metrics = lopti_terms(metrics, whole_m, final)
            return loss * (nmb * dp), metrics

        with _gbc_head(loss_func):
            return base["forward_backward_mini_batch"](
                self, micro_batches, seq_len, micro_batch_size, temperature, loss_fn,
                loss_fn_config, forward_only, **kwargs)

    return dict(__init__=__init__, forward=forward,
                forward_backward_mini_batch=forward_backward_mini_batch)


def reference_forward(worker, data, options):
    """SkyRL's Megatron reference ``forward`` (``_forward_logprobs``: its micro-batching,
    token-based batching and reordering) with critical-token KL's weights from the same sweep
    (``options``: the method options): each sample's ``loss_fn_outputs`` carries them under
    :data:`.worker.KL_WEIGHT_KEY` beside ``logprobs``, found by row key. A stage before the
    last, which SkyRL gives a dummy ``[1, 1]`` of log-probs, gives zeros of that shape."""
    from megatron.core import parallel_state as mpu
    from skyrl.backends.skyrl_train.distributed.dispatch import WorkerOutput

    model = worker.model
    model.gbc_reference, model.gbc_ref_weights = options, {}
    try:
        logp = worker._forward_logprobs(data)
        found = model.gbc_ref_weights
    finally:
        model.gbc_reference = model.gbc_ref_weights = None
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        keys = row_keys(data["sequences"], data["attention_mask"])
        missing = sum(k not in found for k in keys)
        if missing:
            raise ValueError(f"{OPTIONS_ENV}: critical_kl_exponent: {missing} rows of the "
                             f"reference batch got no KL weights from the reference pass")
        weight = torch.stack([found[k] for k in keys])
    else:
        weight = torch.zeros_like(logp, dtype=torch.float32)
    return WorkerOutput(loss_fn_outputs=[
        {"logprobs": logp[i].tolist(), KL_WEIGHT_KEY: weight[i].tolist()}
        for i in range(logp.shape[0])], metrics={})


def gbc_megatron_config(wrapper):
    """The megatron ``TransformerConfig`` of the wrapper's first model chunk."""
    from skyrl.backends.skyrl_train.distributed.megatron.megatron_utils import get_model_config

    return get_model_config(wrapper.actor_module[0])


_METHODS = ("__init__", "forward", "forward_backward_mini_batch")


def _skyrl_methods(cls):
    """SkyRL's own ``__init__``, ``forward`` and ``forward_backward_mini_batch`` of its
    wrapper class (kept aside by :func:`patch_wrapper` when it puts gbc's there)."""
    kept = cls.__dict__.get("_gbc_skyrl_methods")
    return dict(kept) if kept is not None else {k: cls.__dict__[k] for k in _METHODS}


def wrapper_class():
    """gbc's subclass of SkyRL's ``MegatronModelWrapper`` (its ``__init__``, ``forward`` and
    ``forward_backward_mini_batch`` gbc's over SkyRL's own, also after :func:`patch_wrapper`;
    everything else SkyRL's)."""
    import importlib

    cls = importlib.import_module(WRAPPER_MODULE).MegatronModelWrapper
    return type("GBCMegatronModelWrapper", (cls,), {
        "__doc__": "SkyRL's MegatronModelWrapper with gbc's Megatron head (docs/skyrl.md).",
        **_wrapper_methods(_skyrl_methods(cls))})


def patch_wrapper():
    """Put gbc's methods on SkyRL's ``MegatronModelWrapper`` itself (idempotent; SkyRL's own
    kept as ``_gbc_skyrl_methods``), so that SkyRL's Megatron workers, which build it by name,
    run gbc's head. Returns the class. Refused by name on a SkyRL release gbc's Megatron path
    is not tested on (:func:`.losses.check_skyrl_version`)."""
    import importlib

    losses.check_skyrl_version()
    cls = importlib.import_module(WRAPPER_MODULE).MegatronModelWrapper
    if getattr(cls, "_gbc_patched", False):
        return cls
    base = _skyrl_methods(cls)
    for name, fn in _wrapper_methods(base).items():
        setattr(cls, name, fn)
    cls._gbc_skyrl_methods = base
    cls._gbc_patched = True
    return cls
