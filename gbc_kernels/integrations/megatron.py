"""gbc on megatron-core's tensor-parallel output layer (docs/megatron.md; docs/math.md §9,
docs/methods.md).

One processor for the last pipeline stage: megatron's final hidden states ``[S, B, H]``
(sequence-first) and this rank's ``[V/tp, H]`` shard of the output layer (its
``ColumnParallelLinear`` weight, or the shared embedding of a tied model) in; gbc's fused policy
loss, the per-token log-probs, entropy and ``sum_p2 = sum_v p_v^2`` out, over gbc's
vocab-parallel path on the tensor-parallel group. No ``[tokens, V/tp]`` logits are formed, and
only response rows (``mask``) are projected.

* **Vocabulary**: rank ``r`` holds rows ``[r V/tp, (r+1) V/tp)`` of megatron's padded vocabulary
  (``make_vocab_size_divisible_by x tp``). The padded rows are real logits, as in megatron-core's
  ``vocab_parallel_cross_entropy``: they enter the softmax, the entropy and ``sum_p2``.
* **Sequence parallelism** (``sequence_parallel=True``): ``hidden_states`` is this rank's
  ``[S/tp, B, H]`` part; it is gathered along the sequence with megatron's own
  ``gather_from_sequence_parallel_region``, as the output layer gathers them; gbc's
  vocab-parallel path leaves ``d hidden`` partial (``VocabParallel(reduce_hidden_grad=False)``:
  this shard's part) and the gather's backward reduce-scatters the parts, as megatron's head.
* **Layout**: the per-token inputs (``labels``, ``mask``, advantages, ``old_logp`` ...) and
  outputs are batch-first ``[B, S]``, megatron's label layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

import gbc_kernels as gbc
from gbc_kernels import methods
from gbc_kernels import truncation as _truncation
from gbc_kernels.config import PolicyLossConfig
from gbc_kernels.ops import with_logits_dtype

# gbc's argument names -> this module's, for the errors raised inside gbc's calls
_NAMES = {"hidden": "hidden_states", "weight": "output_weight", "bias": "output_bias",
          "targets": "labels", "vocab_parallel": "output_weight",
          "vocab_parallel.group": "tp_group", "weight_grad_into": "output_weight.main_grad"}
# under context parallelism gbc's sequence_parallel is the caller's context_parallel group
_CP_NAMES = {**_NAMES, "sequence_parallel": "context_parallel",
             "sequence_parallel.group": "context_parallel"}


class HeadOutput(NamedTuple):
    """What the processor returns. ``loss``: 0-d float32 (None for :func:`logprobs`);
    ``metrics``: gbc's detached metrics (empty for :func:`logprobs`); ``logp``, ``entropy``,
    ``sum_p2``: float32 ``[B, S]``, 0 outside ``mask`` (``entropy``/``sum_p2`` None unless
    asked). ``log_kept_mass``: ``LSE_S - LSE_V`` ``[B, S]`` (no gradient, 0 outside ``mask``)
    with ``support_ids`` or ``sampler_truncation`` (:func:`policy_loss` always,
    :func:`logprobs` when asked), else None. ``support_ids``: the kept set the call built
    (:func:`logprobs` with ``sampler_truncation`` and ``return_support_ids``), int32
    ``[B, S, K]``, ``-1`` padded, only ``-1`` in the rows outside ``mask``; else None."""

    loss: Optional[torch.Tensor]
    metrics: dict
    logp: torch.Tensor
    entropy: Optional[torch.Tensor]
    sum_p2: Optional[torch.Tensor]
    log_kept_mass: Optional[torch.Tensor] = None
    support_ids: Optional[torch.Tensor] = None


@dataclasses.dataclass
class ProcessorOutput:
    """What :func:`output_processor` returns, under the names verl's fused forward reads and
    rewrites in place (its ``CausalLMOutputForPPO`` fields): ``log_probs``, ``entropy`` (None
    unless asked) and ``sum_p2`` (None unless asked), ``[B, S]`` float32."""

    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor] = None
    sum_p2: Optional[torch.Tensor] = None
    loss: Optional[torch.Tensor] = None


def _tp_group(tp_group):
    if tp_group is not None:
        return tp_group
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise ValueError("tp_group: expected the tensor-parallel process group, got None and "
                         "megatron's model parallelism is not initialised")
    return parallel_state.get_tensor_model_parallel_group()


def _head(hidden_states, output_weight, output_bias, labels, tp_group, sequence_parallel,
          hidden_gathered=False):
    """``(hidden [S, B, H] on every rank, VocabParallel or None)`` after the checks."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        raise ValueError("hidden_states: expected megatron's sequence-first [S, B, H] tensor, "
                         f"got {_shape(hidden_states)}")
    if not isinstance(output_weight, torch.Tensor) or output_weight.dim() != 2:
        raise ValueError("output_weight: expected this rank's [V/tp, H] output-layer shard, "
                         f"got {_shape(output_weight)}")
    if output_weight.shape[1] != hidden_states.shape[2]:
        raise ValueError(f"output_weight: expected [V/tp, {hidden_states.shape[2]}] (H of "
                         f"hidden_states), got {list(output_weight.shape)}")
    for name, flag in (("sequence_parallel", sequence_parallel),
                       ("hidden_gathered", hidden_gathered)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {flag!r}")
    if sequence_parallel and hidden_gathered:
        raise ValueError("hidden_gathered: expected False with sequence_parallel=True (the "
                         "processor gathers this rank's part itself), got True")
    group = _tp_group(tp_group)
    sp = sequence_parallel and dist.get_world_size(group) > 1
    if sp:      # megatron's gather: its backward reduce-scatters gbc's partial d hidden
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        hidden_states = gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=True, group=group)
    S, B = hidden_states.shape[:2]
    if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != (B, S):
        what = " (S gathered over the tensor-parallel group)" if sequence_parallel else ""
        raise ValueError(f"labels: expected [B, S] = [{B}, {S}] (batch-first, as hidden_states "
                         f"[S, B, H]{what}), got {_shape(labels)}")
    return hidden_states, vocab_parallel(output_weight, group,
                                         reduce_hidden_grad=not (sp or hidden_gathered))


def vocab_parallel(output_weight, tp_group=None, reduce_hidden_grad: bool = True):
    """The :class:`gbc_kernels.VocabParallel` of this rank's ``[V/tp, H]`` output-layer shard
    (rank ``r`` of ``tp_group`` holds rows ``[r V/tp, (r+1) V/tp)``; None: megatron's group);
    None at tensor parallel 1."""
    group = _tp_group(tp_group)
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if tp == 1:
        return None
    rows = output_weight.shape[0]
    return gbc.VocabParallel(group, rank * rows, (rank + 1) * rows,
                             reduce_hidden_grad=reduce_hidden_grad)


@contextlib.contextmanager
def output_layer_hidden(inner):
    """While open, the output layer of ``inner`` (megatron's ``GPTModel`` of the last pipeline
    stage) returns its input, sequence-gathered under sequence parallelism with megatron's
    ``gather_from_sequence_parallel_region`` (its backward reduce-scatters, as the layer's
    does), in place of the logits: the model's forward gives the final hidden states where
    it gave ``[.., V/tp]`` logits. Yields a dict filled by each call: ``weight`` (this rank's
    ``[V/tp, H]`` shard, or the shared embedding of a tied model), ``bias`` (None when the
    layer skips it), ``tp_group`` and ``gathered`` (pass as :func:`policy_loss`'s
    ``hidden_gathered``). On any other stage (no ``post_process``) nothing changes and the
    dict is None."""
    if not getattr(inner, "post_process", False):
        yield None
        return
    layer = inner.output_layer
    state = {"tp_group": layer.tp_group, "weight": None, "bias": None,
             "gathered": bool(getattr(layer, "sequence_parallel", False))}

    def head(hidden, weight=None, runtime_gather_output=None):
        if state["gathered"]:
            from megatron.core.tensor_parallel.mappings import (
                gather_from_sequence_parallel_region)
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=True, group=layer.tp_group)
        state["weight"] = layer.weight if weight is None else weight
        state["bias"] = None if layer.skip_bias_add else layer.bias
        return hidden, None

    layer.forward = head
    try:
        yield state
    finally:
        del layer.forward


def _refuse_context_parallel():
    """The loss's sequence terms need whole sequences; under context parallelism each rank
    holds part of every sequence."""
    import sys

    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        cp = ps.get_context_parallel_world_size()
        if cp > 1:
            raise ValueError(f"context_parallel_size: expected 1 for gbc's megatron policy_loss "
                             f"(each rank would hold part of every sequence), got {cp}; "
                             f"logprobs() runs under context parallelism")


def _shape(x):
    return list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


class _IntoMainGrad(torch.autograd.Function):
    """The output weight as it is; in backward, after gbc's sweep added ``d weight`` into its
    ``main_grad``, megatron's gradient-accumulation-fusion protocol (its
    ``LinearWithGradAccumulationAndAsyncCommunication``): a placeholder gradient and
    ``grad_added_to_main_grad = True``, so that DDP's hook does not add it again (zeros under
    ``zero_out_wgrad``, a tied embedding's weight, which the hook adds with the embedding's own
    gradient). A weight without ``grad_added_to_main_grad`` gets no gradient."""

    @staticmethod
    def forward(ctx, weight):
        ctx.set_materialize_grads(False)
        ctx.weight = weight
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        w = ctx.weight
        if grad is not None or not hasattr(w, "grad_added_to_main_grad"):
            return grad
        w.grad_added_to_main_grad = True
        fill = torch.zeros if getattr(w, "zero_out_wgrad", False) else torch.empty
        return fill(w.shape, dtype=w.dtype, device=w.device)


def _main_grad(weight, use):
    """The float32 ``main_grad`` gbc adds ``d weight`` into, or None (``use``: None = when the
    weight has one and needs a gradient)."""
    mg = getattr(weight, "main_grad", None)
    usable = isinstance(mg, torch.Tensor) and mg.dtype == torch.float32
    if use is None:
        use = usable and weight.requires_grad and torch.is_grad_enabled()
    elif not isinstance(use, bool):
        raise TypeError(f"main_grad: expected None or a bool, got {use!r}")
    elif use and not usable:
        got = None if mg is None else f"{_shape(mg)} {getattr(mg, 'dtype', '')}"
        raise ValueError(f"main_grad: True needs output_weight.main_grad, a float32 tensor "
                         f"(megatron's DDP with grad_reduce_in_fp32), got {got}")
    return mg if use else None


def policy_loss(hidden_states, output_weight, labels, mask, advantages, old_logp=None,
                ref_logp=None, token_scale=None, kl_weight=None, config=None, phase=None, *,
                output_bias=None, tp_group=None, sequence_parallel: bool = False,
                hidden_gathered: bool = False, return_entropy: bool = True,
                return_sum_p2: bool = False, backend="auto", main_grad: Optional[bool] = None,
                context_parallel=None, logits_dtype=None, sampler_truncation=None,
                **loss_kwargs) -> HeadOutput:
    """gbc's fused policy loss on megatron-core's output layer (docs/megatron.md).

    hidden_states: ``[S, B, H]`` of the last pipeline stage (under sequence parallelism this
    rank's ``[S/tp, B, H]``); output_weight: this rank's ``[V/tp, H]`` shard; output_bias: its
    ``[V/tp]`` bias or None. labels, mask: ``[B, S]``, global (padded-vocabulary) ids and the
    response mask; advantages ``[B]`` or ``[B, S]``; old_logp, ref_logp, token_scale (AR/NTHR),
    kl_weight (critical-token KL): ``[B, S]`` or None; config: a
    :class:`gbc_kernels.PolicyLossConfig`; phase: the Lopti phase. tp_group: the
    tensor-parallel group (None: megatron's). hidden_gathered: ``hidden_states`` were gathered
    along the sequence by the caller with megatron's ``gather_from_sequence_parallel_region``
    (as the sequence-parallel output layer gathers them): ``d hidden`` stays this shard's part,
    for that gather's reduce-scatter. ``loss_kwargs`` go to
    :func:`gbc_kernels.fused_linear_policy_loss` (``num_items_in_batch``, ``is_ratio`` ...).

    The loss, metrics, ``logp``, ``entropy`` and ``sum_p2`` come from one sweep (neither the
    entropy nor ``sum_p2`` costs a matmul).
    Gradients flow to ``hidden_states``, ``output_weight`` and ``output_bias``.

    context_parallel: None, or the context-parallel process group when each rank holds part of
    every sequence (labels and mask ``[B, S]`` for the same ``B`` sequences on every rank, the
    rank's own tokens masked in): the loss's sequence terms are reduced over it
    (:class:`gbc_kernels.SequenceParallel`) and the loss is the rank's share. Without it,
    megatron's context parallelism is refused (naming ``context_parallel_size``).

    main_grad: where ``d weight`` goes. None (default): into ``output_weight.main_grad`` when
    it has a float32 one (megatron's DDP with ``grad_reduce_in_fp32``, verl's default), else
    ``output_weight.grad``. Into ``main_grad``, the loss is :func:`gbc_kernels.policy_loss` on
    :func:`gbc_kernels.fused_linear_logprobs` (``weight_grad_into``): four matmuls per chunk
    (the logits recomputed in backward, where the upstream gradient is known) and no
    ``[V/tp, H]`` gradient or float32 accumulator; the weight gets megatron's placeholder
    gradient (:class:`_IntoMainGrad`). Otherwise gbc's one-sweep loss (three matmuls).

    logits_dtype: None (the config's) or ``torch.float32`` / ``"float32"``: each chunk's logits
    in float32 from the bf16 operands, on both routes (docs/kernels.md, "Precision").

    support_ids (a loss argument): None, or the sampler's kept ids ``[B, S, k]``, batch-first
    as ``labels``, ``-1`` padded (docs/math.md, "The sampler's support"): the log-probs,
    entropy, ``sum_p2`` and gradients over each token's support, on both routes, with tensor,
    sequence and context parallelism (under context parallelism each rank's rows carry their
    own tokens' ids, as its labels); the metric ``support_forced_frac`` (the whole sequences'
    under context parallelism) and ``log_kept_mass`` in the output.

    sampler_truncation: None, or a :class:`gbc_kernels.SamplerTruncation` (the rollout's
    ``top_k`` / ``top_p`` / ``min_p``): each token's support rebuilt in the row pass from its
    own logits at the loss's temperature by the sampler's rule (docs/math.md, "The sampler's
    kept set, recomputed"), with the same outputs as ``support_ids``, on both routes, with
    tensor, sequence and context parallelism. Not together with ``support_ids``; under tensor
    parallelism ``top_p < 1`` needs a ``top_k`` bound (refused naming ``top_p``).
    """
    for name in ("vocab_parallel", "token_out", "bias"):
        if name in loss_kwargs:
            raise ValueError(f"{name}: set by the megatron processor (from output_weight, "
                             f"output_bias and tp_group), got it as a loss argument")
    for name, flag in (("return_entropy", return_entropy), ("return_sum_p2", return_sum_p2)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {flag!r}")
    names = _NAMES
    if context_parallel is None:
        _refuse_context_parallel()
    else:
        loss_kwargs["sequence_parallel"] = gbc.SequenceParallel(context_parallel)
        names = _CP_NAMES       # gbc's sequence_parallel is the caller's context_parallel
    cfg = with_logits_dtype(PolicyLossConfig.coerce(config), logits_dtype)
    if return_entropy and not cfg.wants_entropy:
        cfg = dataclasses.replace(cfg, return_entropy=True)
    hidden, vp = _head(hidden_states, output_weight, output_bias, labels, tp_group,
                       sequence_parallel, hidden_gathered)
    tr = _check_truncation(sampler_truncation, loss_kwargs.get("support_ids"), vp)
    if tr is not None:
        loss_kwargs["sampler_truncation"] = tr
    into = _main_grad(output_weight, main_grad)
    if into is not None:
        return _loss_into_main_grad(hidden, output_weight, into, labels, mask, advantages,
                                    old_logp, ref_logp, token_scale, kl_weight, cfg, phase,
                                    output_bias, vp, return_entropy, return_sum_p2, backend,
                                    loss_kwargs, names)
    tok = {}
    with methods.in_callers_words(names):
        loss, metrics = gbc.fused_linear_policy_loss(
            hidden.transpose(0, 1), output_weight, labels, mask, advantages, old_logp, ref_logp,
            bias=output_bias, token_scale=token_scale, kl_weight=kl_weight, config=cfg,
            phase=phase, backend=backend, vocab_parallel=vp, token_out=tok, **loss_kwargs)
    return HeadOutput(loss, metrics, tok["logp"], tok.get("entropy") if return_entropy else None,
                      tok["sum_p2"] if return_sum_p2 else None, tok.get("log_kept_mass"))


def _loss_into_main_grad(hidden, weight, into, labels, mask, advantages, old_logp, ref_logp,
                         token_scale, kl_weight, cfg, phase, bias, vp, return_entropy,
                         return_sum_p2, backend, loss_kwargs, names=_NAMES):
    """:func:`policy_loss` with ``d weight`` added into ``into`` (megatron's ``main_grad``):
    the response rows' log-probs, entropy and ``sum_p2`` (gradient recomputed in backward),
    then the loss from them."""
    temp = loss_kwargs.pop("temperature", None)
    temp = cfg.temperature if temp is None else temp
    support_ids = loss_kwargs.pop("support_ids", None)
    tr = loss_kwargs.pop("sampler_truncation", None)
    w = _IntoMainGrad.apply(weight)
    m = _check_mask(mask, hidden, labels)
    with methods.in_callers_words(names):
        logp, entropy, sum_p2, kept, forced, _ = _rows_stats(
            hidden, w, bias, labels, m, temp, vp, cfg.wants_entropy, True, backend, into,
            cfg.logits_dtype, support_ids, True, tr)
        loss, metrics = gbc.policy_loss(logp, m, advantages, old_logp, ref_logp,
                                        entropy=entropy, token_scale=token_scale,
                                        kl_weight=kl_weight, config=cfg, phase=phase,
                                        sum_p2=sum_p2, temperature=temp, **loss_kwargs)
    if support_ids is not None:
        forced = ~(support_ids == labels.unsqueeze(-1)).any(-1)
    if forced is not None:
        metrics = dict(metrics, support_forced_frac=_forced_frac(
            forced, m, loss_kwargs.get("sequence_parallel")))
    return HeadOutput(loss, metrics, logp.detach(),
                      entropy.detach() if return_entropy else None,
                      sum_p2 if return_sum_p2 else None, kept)


def _forced_frac(forced, mask, sp):
    """``support_forced_frac`` as the one-sweep loss gives it: the share of masked-in tokens
    whose target is not in their support (``forced`` ``[B, S]``; under context parallelism the
    whole sequences')."""
    m = torch.ones_like(forced, dtype=torch.bool) if mask is None else mask
    forced = forced & m
    counts = torch.stack([forced.sum(), m.sum()]).float()
    if sp is not None:
        dist.all_reduce(counts, group=None if isinstance(sp.group, str) else sp.group)
    return counts[0] / counts[1].clamp(min=1)


def logprobs(hidden_states, output_weight, labels, mask=None, *, temperature=1.0,
             output_bias=None, tp_group=None, sequence_parallel: bool = False,
             hidden_gathered: bool = False, return_entropy: bool = True,
             return_sum_p2: bool = False, backend="auto", logits_dtype=None,
             support_ids=None, return_log_kept_mass: bool = False, sampler_truncation=None,
             over_support: bool = True, return_support_ids: bool = False) -> HeadOutput:
    """Per-token log-probs (and entropy, ``sum_p2``) on megatron-core's output layer, for the
    log-prob passes (old policy, reference) and verl's ``compute_log_prob``.

    Same inputs as :func:`policy_loss`; ``mask`` ``[B, S]`` (None: every position): only those
    rows are projected. temperature: a float, or a tensor ``[B]`` (per sequence) or ``[B, S]``.
    Differentiable through ``logp`` and ``entropy`` when autograd is on (the backward recomputes
    the logits of those rows); ``sum_p2`` has no gradient. Returns :class:`HeadOutput` with
    ``loss=None``. logits_dtype: None or ``torch.float32`` / ``"float32"`` (the mode of the
    loss these log-probs feed: docs/kernels.md, "Precision").

    support_ids: None, or the sampler's kept ids ``[B, S, k]`` (``-1`` padded; docs/math.md,
    "The sampler's support"): everything over each token's support (the target always a
    member); ``return_log_kept_mass=True`` fills ``log_kept_mass`` ``[B, S]``.
    sampler_truncation: None, or a :class:`gbc_kernels.SamplerTruncation`: the support rebuilt
    in the row pass from each token's own logits at ``temperature`` by the sampler's rule
    (docs/math.md, "The sampler's kept set, recomputed"), as ``support_ids`` otherwise; not
    together with ``support_ids``; under tensor parallelism ``top_p < 1`` needs a ``top_k``
    bound (refused naming ``top_p``). over_support=False (with either): the log-probs,
    entropy, ``sum_p2`` and gradients of the whole vocabulary (the call without a support, bit
    for bit) and only ``log_kept_mass`` the support's (``support=kept_mass``'s old-policy
    pass). return_support_ids=True (with ``sampler_truncation``): ``support_ids`` of the
    output, the set this pass built ``[B, S, K]`` (int32, ``-1`` padded, ``K`` the widest set
    of the call, the target not forced in; only ``-1`` in the rows outside ``mask``), the same
    on every tensor-parallel rank (there it needs a ``top_k`` bound): the ids the later passes
    replay as ``support_ids`` (docs/math.md, "One kept set per rollout").
    """
    for name, flag in (("return_entropy", return_entropy), ("return_sum_p2", return_sum_p2),
                       ("return_log_kept_mass", return_log_kept_mass),
                       ("over_support", over_support),
                       ("return_support_ids", return_support_ids)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {flag!r}")
    hidden, vp = _head(hidden_states, output_weight, output_bias, labels, tp_group,
                       sequence_parallel, hidden_gathered)
    tr = _check_truncation(sampler_truncation, support_ids, vp)
    mask = _check_mask(mask, hidden, labels)
    with methods.in_callers_words(_NAMES):
        logp, entropy, sum_p2, kept, _, ids = _rows_stats(
            hidden, output_weight, output_bias, labels, mask, temperature, vp, return_entropy,
            return_sum_p2, backend, logits_dtype=logits_dtype, support_ids=support_ids,
            want_kept=return_log_kept_mass, sampler_truncation=tr, over_support=over_support,
            want_ids=return_support_ids)
    return HeadOutput(None, {}, logp, entropy, sum_p2, kept, ids)


def output_processor(*, hidden_states, output_layer, labels, output_weight=None, context=None,
                     config=None, **_hook_arguments) -> ProcessorOutput:
    """gbc's :func:`logprobs` as megatron-core's output-processor hook (``GPTModel.forward(...,
    output_processor=, output_processor_context=)``, megatron-core 0.18 and later), with the
    contract of verl's ``fused_output_processor``: the last stage's ``hidden_states`` (this
    rank's part under sequence parallelism, gathered here as the output layer gathers it),
    ``output_layer`` (its ``[V/tp, H]`` weight, bias, tensor-parallel group and sequence
    parallelism) or ``output_weight`` (a tied model's shared embedding), ``labels [B, S]``,
    ``config`` (MuP: with ``use_mup`` the logits are scaled by ``mup_output_mult``, as
    megatron's ``_scale_logits`` scales them).

    ``context``: any object with ``temperature`` (verl's ``FusedOutputProcessorContext``), and
    optionally ``mask`` (``[B, S]``: only those rows projected; None: every row),
    ``return_entropy`` (default True), ``return_sum_p2`` (False), ``backend``. Returns
    :class:`ProcessorOutput`: ``log_probs`` and ``entropy`` ``[B, S]``, differentiable;
    ``∂hidden`` is this rank's part for the gather's reduce-scatter under sequence parallelism,
    the full gradient otherwise. Other hook arguments are accepted and unused."""
    del _hook_arguments
    weight = output_layer.weight if output_weight is None else output_weight
    bias = None if getattr(output_layer, "skip_bias_add", True) else output_layer.bias
    temperature = getattr(context, "temperature", 1.0)
    if getattr(config, "use_mup", False) and config.mup_output_mult != 1.0:
        temperature = temperature / config.mup_output_mult      # logits·m / T = logits / (T/m)
    names = {"output_bias": "output_layer.bias", "tp_group": "output_layer.tp_group",
             **{k: f"context.{k}" for k in ("mask", "temperature", "return_entropy",
                                             "return_sum_p2", "backend")}}
    if output_weight is None:
        names["output_weight"] = "output_layer.weight"
    with methods.in_callers_words(names):
        out = logprobs(hidden_states, weight, labels, getattr(context, "mask", None),
                       temperature=temperature, output_bias=bias, tp_group=output_layer.tp_group,
                       sequence_parallel=bool(getattr(output_layer, "sequence_parallel", False)),
                       return_entropy=getattr(context, "return_entropy", True),
                       return_sum_p2=getattr(context, "return_sum_p2", False),
                       backend=getattr(context, "backend", "auto"))
    return ProcessorOutput(out.logp, out.entropy, out.sum_p2)


def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none",
                         dist_process_group=None, *, hidden_gathered: bool = True,
                         backend="auto"):
    """verl's fused-forward kernel (``verl.utils.kernel.linear_cross_entropy``, what verl's
    legacy ``patch_fused_forward`` and its hook processor call) by gbc's vocab-parallel path:
    ``(log_probs, entropy)``, float32 ``[N]`` in the rows' order, differentiable in ``hidden``
    and ``weight``.

    hidden: ``[N, H]`` or megatron's ``[S, B, H]`` (then ``labels`` ``[B, S]`` is read in the
    same order; verl passes ``B = 1``); weight: this rank's ``[V/tp, H]`` shard of the group
    ``dist_process_group`` (None: one device); ``reduction``: ``"none"`` only.
    hidden_gathered: the hidden states were gathered along the sequence for sequence
    parallelism (verl's fused forward does), so ``∂hidden`` is this shard's part for the
    gather's reduce-scatter — verl's kernel's contract; False: the full gradient (one
    all-reduce), for hidden states that are the same on every rank."""
    if reduction != "none":
        raise ValueError(f"reduction: expected 'none' (per-token values), got {reduction!r}")
    if not isinstance(hidden_gathered, bool):
        raise TypeError(f"hidden_gathered: expected a bool, got {hidden_gathered!r}")
    given = labels
    if hidden.dim() == 3 and labels.dim() == 2 and labels.shape == hidden.shape[1::-1]:
        labels = labels.t()             # [B, S] labels for [S, B, H] hidden states
    vp = None
    if dist_process_group is not None and dist.get_world_size(dist_process_group) > 1:
        vp = vocab_parallel(weight, dist_process_group, reduce_hidden_grad=not hidden_gathered)
    names = {"targets": "labels", "vocab_parallel": "weight",
             "vocab_parallel.group": "dist_process_group"}
    recheck = {"targets": lambda: methods.check_ids("labels", given, _vocab(weight, vp))}
    with methods.in_callers_words(names, recheck):
        out = gbc.fused_linear_logprobs(hidden.reshape(-1, hidden.shape[-1]), weight,
                                        labels.reshape(-1), temperature=temperature,
                                        return_entropy=True, backend=backend, vocab_parallel=vp)
    return out[0], out[1]


def use_in_verl_fused_forward(sequence_parallel: bool):
    """Put :func:`linear_cross_entropy` in place of verl's kernel in verl's fused forward
    (``verl.models.mcore.model_forward_fused``, both its legacy patch and its hook processor):
    verl's stock Megatron engine with ``use_fused_kernels=True`` then computes its log-probs and
    entropy with gbc. ``sequence_parallel``: the model's (verl's fused forward gathers the
    hidden states only then, and ``∂hidden`` must be the full gradient otherwise). Returns a
    function that puts verl's kernel back."""
    import verl.models.mcore.model_forward_fused as fused

    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel: expected a bool, got {sequence_parallel!r}")
    original = fused.linear_cross_entropy

    def kernel(hidden, weight, labels, temperature=1.0, reduction="none",
               dist_process_group=None):
        return linear_cross_entropy(hidden, weight, labels, temperature, reduction,
                                    dist_process_group, hidden_gathered=sequence_parallel)

    fused.linear_cross_entropy = kernel

    def undo():
        fused.linear_cross_entropy = original

    return undo


def reference_stats(hidden_states, output_weight, labels, options, mask=None, *,
                    temperature=1.0, output_bias=None, tp_group=None,
                    sequence_parallel: bool = False, hidden_gathered: bool = False,
                    backend="auto", support_ids=None, sampler_truncation=None):
    """The reference pass of critical-token KL (docs/math.md §5) on megatron-core's output
    layer: :func:`gbc_kernels.methods.reference_stats` over the vocab-parallel path, no grad.
    Same inputs as :func:`logprobs`; ``options``: a :class:`gbc_kernels.methods.MethodOptions`
    (its ``critical_kl_*``). Returns ``methods.ReferenceStats`` with ``ref_logp``,
    ``kl_weight`` and ``certainty`` ``[B, S]`` (0 outside ``mask``; the last two None when
    ``critical_kl_exponent`` is None). The certainty's ``log V`` is over megatron's padded
    vocabulary (its padded rows are real logits). support_ids: None, or the sampler's kept
    ids ``[B, S, k]``: the reference over each token's support (SkyRL's replay), the certainty
    normalised by ``log |S|`` (docs/math.md, "The sampler's support"). sampler_truncation:
    None, or a :class:`gbc_kernels.SamplerTruncation`: the same over the support rebuilt from
    the reference's own logits at ``temperature`` (verl's replay); not together with
    ``support_ids``."""
    hidden, vp = _head(hidden_states, output_weight, output_bias, labels, tp_group,
                       sequence_parallel, hidden_gathered)
    tr = _check_truncation(sampler_truncation, support_ids, vp)
    mask = _check_mask(mask, hidden, labels)

    def stats(flat, y, temp, ids=None):
        extra = {} if ids is None else {"support_ids": ids}
        if tr is not None:
            extra["sampler_truncation"] = tr
        return methods.reference_stats(flat.detach(), output_weight, y, options, output_bias,
                                       temperature=temp, backend=backend, vocab_parallel=vp,
                                       **extra)

    with methods.in_callers_words(_NAMES):
        st = _select(hidden, labels, mask, temperature, _vocab(output_weight, vp), stats,
                     support_ids)
    return methods.ReferenceStats(*st)


def _check_mask(mask, hidden, labels):
    S, B = hidden.shape[:2]
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (B, S):
        raise ValueError(f"mask: expected None or [B, S] = [{B}, {S}], got {_shape(mask)}")
    return mask.to(labels.device).bool()


def _rows_stats(hidden, weight, bias, labels, mask, temperature, vp, want_entropy, want_sum_p2,
                backend, weight_grad_into=None, logits_dtype=None, support_ids=None,
                want_kept=False, sampler_truncation=None, over_support=True, want_ids=False):
    """``(logp, entropy, sum_p2, log_kept_mass, forced, ids)`` ``[B, S]`` of the rows in
    ``mask`` (every row when None); ``log_kept_mass`` None unless a support (``support_ids``
    or ``sampler_truncation``) and ``want_kept``; ``forced`` (bool: the target outside the
    rebuilt set) None unless ``sampler_truncation``; ``ids`` (``[B, S, K]``, the rebuilt set,
    ``-1`` outside ``mask``) None unless ``want_ids`` (refused without
    ``sampler_truncation``)."""
    want_kept = want_kept and (support_ids is not None or sampler_truncation is not None)
    support = {}
    if support_ids is not None or sampler_truncation is not None:
        support = {"return_log_kept_mass": want_kept, "over_support": over_support}
    if sampler_truncation is not None:
        support["sampler_truncation"] = sampler_truncation

    def stats(flat, y, temp, ids=None):
        extra = dict(support) if ids is None else dict(support, support_ids=ids)
        trunc = sampler_truncation is not None
        out = gbc.fused_linear_logprobs(flat, weight, y, bias=bias, temperature=temp,
                                        return_entropy=want_entropy, backend=backend,
                                        vocab_parallel=vp, return_sum_p2=want_sum_p2,
                                        weight_grad_into=weight_grad_into,
                                        logits_dtype=logits_dtype,
                                        return_support_forced=trunc,
                                        return_support_ids=want_ids, **extra)
        ids = None
        if want_ids:
            out, ids = out[:-1], out[-1]
        forced = out[-1] if trunc else None
        kept = out[-2] if trunc else out[-1]
        return (out[0], out[1], out[2] if want_sum_p2 else None,
                kept.detach() if want_kept else None, forced, ids)

    return _select(hidden, labels, mask, temperature, _vocab(weight, vp), stats, support_ids)


def _check_truncation(sampler_truncation, support_ids, vp):
    """``sampler_truncation`` checked before any pass (None: None): not together with
    ``support_ids``; gbc's rule under tensor parallelism (``vp``: top-p without a top-k bound
    refused naming ``top_p``), in this module's words."""
    if sampler_truncation is None:
        return None
    if support_ids is not None:
        raise ValueError("sampler_truncation: pass either support_ids (the kept ids the engine "
                         "recorded) or sampler_truncation (rebuild them from the sampling "
                         "settings), not both")
    try:
        return _truncation.check(sampler_truncation, vp)
    except ValueError as e:
        if vp is None or len(e.args) != 1 or not str(e.args[0]).startswith("top_p:"):
            raise
        tp = dist.get_world_size(vp.group)
        e.args = (e.args[0].replace("under vocab_parallel", f"under tensor parallel {tp}")
                  .replace("run without vocab_parallel", "run at tensor parallel 1"),)
        raise


def _vocab(weight, vp):
    """V of megatron's (padded) vocabulary: the ranks' equal shards (``vocab_parallel``)."""
    if vp is None:
        return weight.shape[0]
    return dist.get_world_size(vp.group) * (vp.end - vp.start)


def _select(hidden, labels, mask, temperature, vocab, stats, support_ids=None):
    """``stats(rows [N, H], labels [N], temperature)`` on the rows in ``mask`` (every row when
    None), selected in megatron's ``[S, B]`` order (no copy of the whole hidden states); its
    per-row outputs back as ``[B, S]`` (0 outside ``mask``; None stays None). A failed value
    check of the selected labels or temperatures is raised from the same check on the caller's
    ``[B, S]`` tensor (``vocab``: V), whose indices are the caller's. ``support_ids``
    ``[B, S, k]`` (or None): its rows travel with their labels, as ``stats``' fourth argument
    ``[N, k]``. An output ``[N, K]`` (the kept ids a pass built) comes back ``[B, S, K]``,
    ``-1`` in the rows outside ``mask``."""
    S, B, H = hidden.shape
    flat = hidden.reshape(S * B, H)
    y = labels.t().reshape(S * B)
    ids = None
    if support_ids is not None:
        _check_support_layout(support_ids, labels)
        ids = support_ids.transpose(0, 1).reshape(S * B, support_ids.shape[-1])
    temp = temperature
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(labels.device)
        if t.dim() == 1 and t.shape[0] == B:
            t = t[:, None].expand(B, S)
        if tuple(t.shape) != (B, S):
            raise ValueError(f"temperature: expected a float, [B] = [{B}] or [B, S] = "
                             f"[{B}, {S}], got {list(temperature.shape)}")
        temp = t.t().reshape(S * B)
    idx = None
    if mask is not None:
        idx = mask.t().reshape(S * B).nonzero().squeeze(1)
        flat, y = flat.index_select(0, idx), y.index_select(0, idx)
        if isinstance(temp, torch.Tensor):
            temp = temp.index_select(0, idx)
        if ids is not None:
            ids = ids.index_select(0, idx)

    def back(v):
        if v is None:
            return None
        if v.dim() == 2:        # kept ids [N, K]: -1 in the rows not scored
            if idx is not None:
                v = torch.full((S * B, v.shape[1]), -1, dtype=v.dtype,
                               device=v.device).index_copy(0, idx, v)
            return v.view(S, B, -1).transpose(0, 1).contiguous()
        if idx is not None:
            v = torch.zeros(S * B, dtype=v.dtype, device=v.device).index_copy(0, idx, v)
        return v.view(S, B).t().contiguous()

    rows = torch.ones(B, S, dtype=torch.bool, device=labels.device) if mask is None else mask

    def temperature_bs():
        t = temperature.to(labels.device)
        return t[:, None].expand(B, S) if t.dim() == 1 else t

    recheck = {"targets": lambda: methods.check_ids("labels", labels, vocab, rows)}
    if isinstance(temperature, torch.Tensor):
        recheck["temperature"] = lambda: methods.check_temperatures(
            "temperature", temperature_bs(), rows)
    if ids is not None:
        from gbc_kernels.support import check_support_ids

        recheck["support_ids"] = lambda: check_support_ids(support_ids, labels, vocab, rows)
    with methods.in_callers_words({"targets": "labels", "temperature": "temperature",
                                   "support_ids": "support_ids"}, recheck):
        out = stats(flat, y, temp) if ids is None else stats(flat, y, temp, ids)
    return tuple(back(v) for v in out)


def _check_support_layout(support_ids, labels):
    """``support_ids``: an integer tensor ``[B, S, k]`` (``labels.shape + (k,)``) on the labels'
    device; its values are checked where the selected rows are scored."""
    from ..support import check_layout

    check_layout(support_ids, labels, "[B, S, k], batch-first as labels; -1 padded")
