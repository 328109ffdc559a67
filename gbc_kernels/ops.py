"""The public functions of docs/math.md §7: validation, dispatch to a backend, autograd glue."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import torch

from . import _validate as V
from . import sequence_parallel as _sp
from . import vocab_parallel as _vp
from ._fused import (FusedLogprobsFunction, FusedPolicyLossFunction, LossInputs, stats_sweep,
                     gathered_threshold, n_seq_nonempty, token_inputs, with_batch_masks)
from ._loss_math import (Norms, certainty_from_stats, empty_metrics, logp_grad_norm, loss_terms,
                         per_token_is_ratio, policy_metrics)
from ._validate import no_double_backward as _no_double_backward
from ._validate import check_lm_head as _check_lm_head, check_temperature as _check_temperature
from ._validate import as_mask as _mask
from .backends import get_backend
from .config import PHASES, PolicyLossConfig, resolve_logits_dtype


# docs/math.md §3, §13: a loss with Lopti on and no phase would be a plain update
LOPTI_NEEDS_PHASE = ("phase: config.lopti_eta={eta} asks for Lopti's two updates, and a loss "
                     "without a phase would be a plain one; pass phase='low' then 'high' with an "
                     "optimizer step after each (gbc.methods.run_lopti runs them), or set "
                     "lopti_eta=None")


def _check_phase(phase, cfg):
    if phase not in PHASES:
        raise ValueError(f"phase: expected None, 'low' or 'high', got {phase!r}")
    if phase is not None and cfg.lopti_eta is None:
        raise ValueError(f"phase: phase={phase!r} needs config.lopti_eta (Lopti's probability "
                         "threshold), got lopti_eta=None")
    if phase is None and cfg.lopti_eta is not None:
        raise ValueError(LOPTI_NEEDS_PHASE.format(eta=cfg.lopti_eta))


def _norms(num_items_in_batch, num_seqs_in_batch):
    """The call's batch normalisers, checked (docs/math.md §1, loss_agg)."""
    _check_num_items(num_items_in_batch)
    _check_num_items(num_seqs_in_batch, "num_seqs_in_batch")
    return Norms(num_items_in_batch, num_seqs_in_batch)


def _check_num_items(num_items_in_batch, name="num_items_in_batch"):
    """None, a finite number > 0 (not a bool), or a 1-element tensor holding one (checked on
    the device without a host sync off the CPU)."""
    if num_items_in_batch is None:
        return
    if isinstance(num_items_in_batch, torch.Tensor):
        t = num_items_in_batch
        if t.numel() != 1:
            raise ValueError(f"{name}: expected a number or a 1-element tensor, got "
                             f"shape {list(t.shape)}")
        if t.device.type == "meta":
            raise ValueError(f"{name}: expected a tensor with data, got one on the meta device")
        if t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"{name}: expected a real count, got a {t.dtype} tensor")
        if not V.value_checks_enabled():
            return
        if t.device.type == "cpu":
            v = float(t)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name}: expected a finite count > 0, got {v}")
        else:   # no host sync: a device-side assertion
            x = t.reshape(()).float()
            torch._assert_async((x > 0) & torch.isfinite(x),
                                f"{name}: expected a finite count > 0")
        return
    if (isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float))
            or not (num_items_in_batch > 0 and math.isfinite(num_items_in_batch))):
        raise ValueError(f"{name}: expected a finite number > 0, got {num_items_in_batch!r}")


def _check_per_token(B, T, device, mask, advantages, old_logp, ref_logp, token_scale, kl_weight,
                     cfg, is_ratio=None, sampling_logp=None, checks=None, sp=None):
    """Shape/dtype/device checks now; value checks queued on ``checks`` (V.Checks). Returns the
    ``[B, T]`` advantages and the ``[B, T]`` importance ratio (or None) the loss takes."""
    if advantages is None:
        raise ValueError("advantages: expected a [B] or [B, T] tensor, got None")
    V.check_tensor("advantages", advantages, floating=True, device=device, dims=(1, 2))
    if tuple(advantages.shape) not in ((B,), (B, T)):
        raise ValueError(f"advantages: expected shape [{B}] or [{B}x{T}], got "
                         f"[{'x'.join(map(str, advantages.shape))}]")
    for name, t in (("old_logp", old_logp), ("ref_logp", ref_logp),
                    ("token_scale", token_scale), ("kl_weight", kl_weight),
                    ("sampling_logp", sampling_logp)):
        if t is not None:
            V.check_tensor(name, t, shape=(B, T), floating=True, device=device)
    if is_ratio is not None:
        V.check_tensor("is_ratio", is_ratio, floating=True, device=device, dims=(2,))
        if tuple(is_ratio.shape) not in ((B, T), (B, 1)):
            raise ValueError(f"is_ratio: expected shape [{B}x{T}] (per token) or [{B}x1] (per "
                             f"sequence), got [{'x'.join(map(str, is_ratio.shape))}]")
    if cfg.kl_coef != 0.0 and ref_logp is None:
        raise ValueError(f"ref_logp: required when config.kl_coef != 0 (got kl_coef="
                         f"{cfg.kl_coef}), got None")
    adv_bt = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    kl_on = cfg.kl_coef != 0.0
    ref, klw = (ref_logp, kl_weight) if kl_on else (None, None)
    is_ratio_in = is_ratio
    if is_ratio is not None:
        is_ratio = is_ratio.expand(B, T)     # checked where it applies: the masked-in tokens
    V.check_many([("advantages", adv_bt.expand(B, T), "finite"), ("old_logp", old_logp, "finite"),
                  ("ref_logp", ref, "finite"), ("token_scale", token_scale, "finite"),
                  ("kl_weight", klw, "finite"), ("is_ratio", is_ratio, "finite"),
                  ("sampling_logp", sampling_logp, "finite_or_nan"),
                  ("old_logp", old_logp, "logprob"), ("ref_logp", ref, "logprob"),
                  ("sampling_logp", sampling_logp, "logprob"), ("is_ratio", is_ratio, "nonneg")],
                 mask, checks)
    if sampling_logp is not None and cfg.off_policy_mask_threshold is None:
        raise ValueError("sampling_logp: only used by the off-policy mask; expected None when "
                         "config.off_policy_mask_threshold is None")
    return adv_bt.expand(B, T), per_token_is_ratio(is_ratio_in, mask, cfg, sp)


def fused_linear_policy_loss(hidden, weight, targets, mask, advantages, old_logp=None,
                             ref_logp=None, bias=None, token_scale=None, kl_weight=None,
                             config=None, phase=None, num_items_in_batch=None, backend="auto",
                             vocab_parallel=None, is_ratio=None, sampling_logp=None,
                             data_parallel_group=None, num_seqs_in_batch=None,
                             temperature=None, token_out=None, sequence_parallel=None,
                             logits_dtype=None, support_ids=None, sampler_truncation=None,
                             return_support_ids=False):
    """GRPO policy loss (docs/math.md §1-§3, §6, §10, §12) from hidden states, without the
    logits.

    Computes, for ``z = (hidden @ weight.T + bias) / temperature`` one chunk of rows at a time::

        logp = log_softmax(z).gather(-1, targets)
        loss = aggregate(pg(logp, old_logp, A-hat) + kl_coef * w_kl * kl - entropy_coef * H)

    hidden: [B, T, H]; weight: [V, H]; bias: [V] or None; targets, mask: [B, T];
    advantages: [B] or [B, T]; old_logp, ref_logp, token_scale, kl_weight: [B, T] or None.
    is_ratio: [B, T] (per token), [B, 1] (per sequence) or None, the rollout engine's
    importance weight pi_old / pi_sampler (TRL's vLLM correction): multiplies the policy term
    (vespo: enters phi's sequence weight, a per-sequence ratio once).
    sampling_logp: [B, T] or None, the sampler's log-probs the off-policy mask measures drift
    from (default: old_logp).
    num_items_in_batch, num_seqs_in_batch: the token count of ``token-mean`` and the sequence
    count of the sequence modes (default: this call's masked tokens, and B), for a loss whose
    batch is split over micro-batches or ranks (TRL's num_items_in_batch, verl's
    global_batch_info).
    temperature: None (the config's), a float, or a tensor ``[B]`` (per sequence) or
    ``[B, T]`` (per token): the logits of each token are divided by its own temperature.
    data_parallel_group: the process group (or ``"world"``) the batch is split over; the
    batch-global entropy quantile (``top_entropy_quantile < 1``) is then taken over every
    rank's tokens, as TRL does (None: this process's tokens only).
    Returns ``(loss, metrics)``: a 0-d float32 loss whose gradient flows to hidden, weight and
    bias, and a dict of detached 0-d float32 metrics (docs/math.md §7).

    ``vocab_parallel=VocabParallel(group, start, end)``: ``weight``/``bias`` are this rank's rows
    ``[start, end)`` of the lm_head, ``targets`` are global ids (docs/math.md §9).

    ``token_out``: a dict that receives the forward's per-token values, detached float32
    ``[B, T]`` with 0 outside ``mask``: ``"logp"`` and ``"sum_p2"`` (``Σ_v p_v²``, which the
    row passes compute for ``grad_share_low``) always, ``"entropy"`` when the loss computed it
    (an entropy term, the entropy quantile or ``return_entropy``). A trainer logs its own
    metrics from them (e.g. verl's, through its own functions) without another pass.

    ``sequence_parallel=SequenceParallel(group)``: the tokens of each sequence are split over
    ``group``'s ranks (docs/distributed.md, "Sequence and context parallelism"): every rank
    passes rows for the same B sequences, each token masked in on the one rank that holds it.
    The sequence-level quantities are summed over the group; the loss is this rank's share
    (the ranks' losses and gradients add up to those of the whole sequences) and the metrics
    are the whole batch's, the same on every rank.

    ``support_ids``: None (the whole vocabulary), or the sampler's kept ids of each token,
    ``[B, T, k]`` integer, ``-1`` padded (docs/math.md, "The sampler's support"): the
    log-probs, entropy and gradients over each token's support (its target always a member);
    the metric ``support_forced_frac`` (the share of masked-in tokens whose target was missing
    from its ids) and ``token_out["log_kept_mass"]`` (``LSE_S - LSE_V`` per token, no
    gradient). Under ``vocab_parallel`` the members may lie on any rank (the support's
    statistics join the per-chunk all_gather); under ``sequence_parallel``
    ``support_forced_frac`` is the whole sequences', the same on every rank.
    ``sampler_truncation``: None, or ``SamplerTruncation(top_k, top_p, min_p)``: the support
    rebuilt in the row pass from each row's own logits at the call's temperature by the
    sampler's rule (docs/math.md, "The sampler's kept set, recomputed"); the same outputs as
    ``support_ids``. Not together with ``support_ids``. ``return_support_ids=True`` (with
    ``sampler_truncation``): returns ``(loss, metrics, support_ids)``, the set this pass built
    (``[B, T, K]`` int32, ``-1`` padded, the target not forced in), for the later passes to
    replay as ``support_ids`` (docs/math.md, "One kept set per rollout": the update is the
    pass that builds it where a trainer runs no old-policy pass).

    ``logits_dtype``: None (the config's ``logits_dtype``), ``torch.float32`` / ``"float32"``
    (the chunks' logits in float32 from the bf16/fp16 operands) or ``"input"`` (in the
    operands' dtype); a config's None resolves per device: float32 on a CPU, the operands'
    dtype on a GPU (docs/kernels.md, "Precision").
    """
    if token_out is not None and not isinstance(token_out, dict):
        raise TypeError(f"token_out: expected None or a dict, got {type(token_out).__name__}")
    if not isinstance(return_support_ids, bool):
        raise TypeError(f"return_support_ids: expected a bool, got {return_support_ids!r}")
    cfg = with_logits_dtype(PolicyLossConfig.coerce(config), logits_dtype)
    V.check_backend(backend)
    _check_lm_head(hidden, weight, bias)
    cfg = _resolved(cfg, hidden)
    V.check_tensor("hidden", hidden, dims=(3,))
    B, T, H = hidden.shape
    device = hidden.device
    V.check_tensor("targets", targets, shape=(B, T), integer=True, device=device)
    checks = V.Checks()      # value checks: resolved by the chunk loop's one host transfer
    m = _mask(mask, B, T, device, checks)
    _check_phase(phase, cfg)
    norms = _norms(num_items_in_batch, num_seqs_in_batch)
    sp = _resolve_sp(sequence_parallel, cfg, B, device, checks)
    adv, is_ratio = _check_per_token(B, T, device, m, advantages, old_logp, ref_logp,
                                     token_scale, kl_weight, cfg, is_ratio, sampling_logp, checks,
                                     sp)
    threshold_fn = _threshold_fn(data_parallel_group, cfg, sp)
    inv_temp = None
    if temperature is not None:
        temp = _temperature(temperature, (B, T), device, m, checks)
        if isinstance(temp, torch.Tensor):
            inv_temp = (1.0 / temp).reshape(-1)
        elif temp != cfg.temperature:
            cfg = dataclasses.replace(cfg, temperature=temp)
    sl, vocab = _vp.resolve(vocab_parallel, weight, bias, device)
    safe_targets = V.check_targets(targets, vocab, m, checks=checks)
    be = get_backend(backend, device, hidden.dtype)
    flat_targets, forced = safe_targets.reshape(-1), None
    if support_ids is not None or sampler_truncation is not None:
        be, flat_targets, forced = _support(support_ids, safe_targets, vocab, m, checks, sl, be,
                                            kept_mass=token_out is not None,
                                            truncation=sampler_truncation)
    _keep_support_ids(return_support_ids, be, sampler_truncation, sl)
    inp = LossInputs(flat_targets, m, adv, old_logp, ref_logp, token_scale,
                     kl_weight if cfg.kl_coef != 0.0 else None, cfg, phase, norms,
                     be, is_ratio, sampling_logp,
                     threshold_fn, checks, sl, inv_temp, want_sum_p2=token_out is not None,
                     sp=sp)
    loss = FusedPolicyLossFunction.apply(hidden.reshape(B * T, H), weight, bias, inp)
    metrics = inp.metrics
    if sampler_truncation is not None:
        forced = be.forced
    if forced is not None:
        counts = torch.stack([(forced & m.reshape(-1)).sum(), m.sum()]).float()
        if sp is not None:                        # the whole sequences' share, on every rank
            counts = sp.sum(counts)
        metrics = dict(metrics, support_forced_frac=counts[0] / counts[1].clamp(min=1))
    if token_out is not None:
        token_out["logp"] = inp.logp
        if inp.entropy is not None:
            token_out["entropy"] = inp.entropy
        token_out["sum_p2"] = inp.sum_p2
        if forced is not None:
            token_out["log_kept_mass"] = be.log_kept_mass.view(B, T) * m
    if return_support_ids:
        return loss, metrics, be.kept.view(B, T, be.kept.shape[-1])
    return loss, metrics


def _support(support_ids, targets, vocab, mask=None, checks=None, vp=None, backend=None,
             kept_mass=True, truncation=None, over_support=True):
    """``(backend, flat targets, forced)`` of a call with ``support_ids``
    (:mod:`gbc_kernels.support`): the backend wrapped to score each row over its support, the
    ``[N, 2 + K]`` rows it reads, and ``forced`` ``[N]`` (the target missing from its ids).
    With ``truncation`` (:mod:`gbc_kernels.truncation`) the support is rebuilt in the row pass:
    ``[N, 2]`` rows, and ``forced`` None (the backend's ``forced`` once the sweep has run)."""
    from . import support as _S

    if truncation is not None:
        from . import truncation as _T

        if support_ids is not None:
            raise ValueError("sampler_truncation: pass either support_ids (the kept ids the "
                             "engine recorded) or sampler_truncation (rebuild them from the "
                             "sampling settings), not both")
        tr = _T.check(truncation, vp)
        y = targets.reshape(-1)
        pos = torch.arange(y.shape[0], device=y.device).unsqueeze(1)
        return (_T.TruncationBackend(backend, y.shape[0], y.device, tr, kept_mass, vp,
                                     over_support),
                torch.cat([y.long().unsqueeze(1), pos], 1), None)
    ids = _S.check_support_ids(support_ids, targets, vocab, mask, checks)
    y = targets.reshape(-1)
    cols, forced = _S.members(ids.reshape(y.shape[0], ids.shape[-1]), y)
    return (_S.SupportBackend(backend, y.shape[0], y.device, kept_mass, vp, over_support),
            _S.flat_targets(y, cols), forced)


def _resolved(cfg: PolicyLossConfig, hidden) -> PolicyLossConfig:
    """``cfg`` with its ``logits_dtype`` resolved for ``hidden``'s dtype and device
    (:func:`gbc_kernels.config.resolve_logits_dtype`: None or torch.float32)."""
    ld = resolve_logits_dtype(cfg.logits_dtype, hidden.dtype, hidden.device)
    return cfg if ld is cfg.logits_dtype else dataclasses.replace(cfg, logits_dtype=ld)


def with_logits_dtype(cfg: PolicyLossConfig, logits_dtype) -> PolicyLossConfig:
    """``cfg`` with the call's ``logits_dtype`` argument (None: the config's own); a call that
    asks for another mode than its config's is refused."""
    ld = V.check_logits_dtype(logits_dtype)
    if ld is None or ld == cfg.logits_dtype:
        return cfg
    if cfg.logits_dtype is not None:
        raise ValueError(f"logits_dtype: {ld} differs from config.logits_dtype "
                         f"{cfg.logits_dtype}; set one of them")
    return dataclasses.replace(cfg, logits_dtype=ld)


def _temperature(temperature, shape, device, mask=None, checks=None, name="temperature"):
    """A temperature as the sweeps take it: a float (checked), or a tensor per row — shape
    ``shape`` (per token), a leading part of it (``[B]`` for ``[B, T]``: per sequence) or
    ``shape`` with 1s (``[B, 1]``) — as a float32 tensor of ``shape``, its values checked (on the
    masked-in positions; queued on ``checks``: no host sync of its own)."""
    if not isinstance(temperature, torch.Tensor):
        _check_temperature(name, temperature)
        return float(temperature)
    V.check_tensor(name, temperature, floating=True, device=device)
    t = temperature
    if t.dim() < len(shape) and tuple(t.shape) == tuple(shape[:t.dim()]):
        t = t.reshape(*t.shape, *([1] * (len(shape) - t.dim())))
    if t.dim() != len(shape) or any(a not in (1, b) for a, b in zip(t.shape, shape)):
        raise ValueError(f"{name}: expected a float or a tensor of shape "
                         f"[{'x'.join(map(str, shape))}] (per token) or a leading part of it "
                         f"(per sequence), got [{'x'.join(map(str, temperature.shape))}]")
    t = t.expand(*shape).float()
    if mask is None:
        mask = torch.ones(shape, dtype=torch.bool, device=device)
    V.check_many([(name, t, "temperature")], mask, checks)
    return t


def _check_softcap(softcap):
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0
                                    and math.isfinite(softcap)):
        raise ValueError(f"logit_softcap: expected None or a finite float > 0, got {softcap!r}")


def _threshold_fn(data_parallel_group, cfg, sp=None):
    if (data_parallel_group is None and sp is None) or not cfg.entropy_quantile_on:
        return None
    return gathered_threshold(data_parallel_group, sp)


def _resolve_sp(sequence_parallel, cfg, B, device, checks):
    """The checked sequence-parallel group (None: off); the options it cannot run refused."""
    sp = _sp.resolve(sequence_parallel, B, device, checks)
    if sp is not None:
        _sp.refuse(cfg)
    return sp


def fused_linear_logprobs(hidden, weight, targets, bias=None, temperature=1.0,
                          return_entropy=False, backend="auto", vocab_parallel=None,
                          logit_softcap=None, return_sum_p2=False, weight_grad_into=None,
                          logits_dtype=None, support_ids=None, return_log_kept_mass=False,
                          sampler_truncation=None, over_support=True,
                          return_support_forced=False, return_support_ids=False):
    """Per-token ``log_softmax(z)[targets]`` (and the entropy of ``softmax(z)``) without logits.
    ``z = (hidden @ weight.T + bias) / temperature``; with ``logit_softcap = c`` (Gemma-2/3),
    ``z = c tanh((hidden @ weight.T + bias) / c) / temperature``.

    hidden: [..., H]; targets: [...] (every id in ``[0, V)``); temperature: a float, or a tensor
    of ``targets.shape`` (per token) or a leading part of it (``[B]`` for ``[B, T]`` targets:
    per sequence). Returns ``(logp, entropy)``, both float32 of shape ``targets.shape`` (entropy
    None unless ``return_entropy``), and with ``return_sum_p2=True`` a third output,
    ``sum_p2 = sum_v p_v^2`` (no gradient; verl's ``calculate_sum_pi_squared``).
    Differentiable in hidden, weight and bias through logp and entropy; the backward recomputes
    the logits.

    ``weight_grad_into``: None, or a float32 tensor of ``weight``'s shape (megatron-core's
    ``weight.main_grad``) that the backward adds ``d weight`` into, in place, summed in float32
    over the chunks: no ``[V, H]`` gradient or accumulator is allocated, and ``weight`` itself
    gets no gradient (None).

    ``logits_dtype``: ``torch.float32`` / ``"float32"`` (the float32 head's logits from
    bf16/fp16 operands, in both sweeps), ``"input"`` (the chunks' logits in the input's dtype)
    or None: per device, float32 on a CPU and the input's dtype on a GPU (docs/kernels.md,
    "Precision").

    ``support_ids``: None, or the sampler's kept ids ``targets.shape + (k,)``, ``-1`` padded:
    log-probs, entropy, ``sum_p2`` and gradients over each token's support, the target always
    a member (docs/math.md, "The sampler's support"). ``return_log_kept_mass=True``: a last
    output, ``LSE_S - LSE_V`` per token (no gradient; 0 without ``support_ids``).
    ``sampler_truncation``: None, or ``SamplerTruncation(top_k, top_p, min_p)``: the support
    rebuilt from each row's own logits at ``temperature`` by the sampler's rule (docs/math.md,
    "The sampler's kept set, recomputed"), as ``support_ids`` otherwise. Not with
    ``support_ids``. ``over_support=False`` (with either): the log-probs, entropy and gradients
    of the whole vocabulary (the call without a support, bit for bit) and only
    ``log_kept_mass`` the support's: the full-vocabulary policy and its kept mass in one pass.
    ``return_support_forced=True``: a last output, bool ``targets.shape``: the target was
    outside its support (forced in; what the loss's ``support_forced_frac`` counts); False
    without a support. ``return_support_ids=True`` (with ``sampler_truncation``): a last
    output, the kept set each token's row built, ``targets.shape + (K,)`` int32, ``-1``
    padded, ``K`` the widest set of the call, the target not forced in — the ids a later pass
    replays as ``support_ids`` (docs/math.md, "One kept set per rollout").
    """
    for name, flag in (("over_support", over_support),
                       ("return_support_forced", return_support_forced),
                       ("return_support_ids", return_support_ids)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {flag!r}")
    V.check_backend(backend)
    logits_dtype = V.check_logits_dtype(logits_dtype)
    _check_lm_head(hidden, weight, bias)
    logits_dtype = resolve_logits_dtype(logits_dtype, hidden.dtype, hidden.device)
    V.check_tensor("targets", targets, shape=hidden.shape[:-1], integer=True, device=hidden.device)
    for name, flag in (("return_entropy", return_entropy), ("return_sum_p2", return_sum_p2)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__} {flag!r}")
    temp = _temperature(temperature, tuple(targets.shape), hidden.device)
    if isinstance(temp, torch.Tensor):
        temp = temp.reshape(-1)
    _check_softcap(logit_softcap)
    if not isinstance(return_log_kept_mass, bool):
        raise TypeError(f"return_log_kept_mass: expected a bool, got "
                        f"{type(return_log_kept_mass).__name__} {return_log_kept_mass!r}")
    sl, vocab = _vp.resolve(vocab_parallel, weight, bias, hidden.device)
    safe = V.check_targets(targets, vocab).reshape(-1)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    be = get_backend(backend, hidden.device, hidden.dtype)
    forced = None
    if support_ids is not None or sampler_truncation is not None:
        be, safe, forced = _support(support_ids, safe.view(targets.shape), vocab, vp=sl,
                                    backend=be, kept_mass=return_log_kept_mass,
                                    truncation=sampler_truncation, over_support=over_support)
    _keep_support_ids(return_support_ids, be, sampler_truncation, sl)
    if weight_grad_into is not None:
        V.check_tensor("weight_grad_into", weight_grad_into, shape=tuple(weight.shape),
                       device=weight.device)
        if weight_grad_into.dtype != torch.float32 or not weight_grad_into.is_contiguous():
            raise TypeError(f"weight_grad_into: expected a contiguous float32 tensor (a float32 "
                            f"main_grad), got {weight_grad_into.dtype}"
                            f"{'' if weight_grad_into.is_contiguous() else ', not contiguous'}")
    logp, entropy, sum_p2 = FusedLogprobsFunction.apply(
        h2, weight, bias, safe, temp, return_entropy, be,
        None if logit_softcap is None else float(logit_softcap), sl, return_sum_p2,
        weight_grad_into, logits_dtype)
    out = (logp.view(targets.shape),
           entropy.view(targets.shape) if return_entropy else None)
    if return_sum_p2:
        out += (sum_p2.view(targets.shape),)
    if return_log_kept_mass:
        out += (be.log_kept_mass.view(targets.shape)
                if support_ids is not None or sampler_truncation is not None
                else torch.zeros(targets.shape, device=hidden.device),)
    if return_support_forced:
        if sampler_truncation is not None:
            forced = be.forced
        out += (forced.view(targets.shape) if forced is not None
                else torch.zeros(targets.shape, dtype=torch.bool, device=hidden.device),)
    if return_support_ids:
        out += (be.kept.view(*targets.shape, be.kept.shape[-1]),)
    return out


def _keep_support_ids(wanted, be, truncation, vp):
    """``return_support_ids``: needs ``sampler_truncation`` (the ids of ``support_ids`` are the
    caller's already); under vocab parallelism a top-k bound (without one each shard knows
    only its own members). Tells the backend to record the ids."""
    if not wanted:
        return
    if truncation is None:
        raise ValueError("return_support_ids: needs sampler_truncation (the kept set built in "
                         "this pass); with support_ids the ids are the caller's already")
    if vp is not None and truncation.top_k is None:
        raise ValueError("return_support_ids: under vocab_parallel needs a top_k bound in "
                         "sampler_truncation (without one each shard knows only its own "
                         "members)")
    be.keep_ids()


class TokenStats(NamedTuple):
    """Per-token statistics (float32, shape of targets): log-prob of the target, entropy and
    ``sum_p2 = sum_v p_v^2`` at ``temperature``; certainty J of docs/math.md §5 at
    ``certainty_temperature`` (None unless asked)."""

    logp: torch.Tensor
    entropy: torch.Tensor
    certainty: Optional[torch.Tensor]
    sum_p2: Optional[torch.Tensor] = None


class TokenStatsKeptMass(NamedTuple):
    """:class:`TokenStats` and ``log_kept_mass`` (``LSE_S - LSE_V``), what
    ``token_stats(..., return_log_kept_mass=True)`` returns."""

    logp: torch.Tensor
    entropy: torch.Tensor
    certainty: Optional[torch.Tensor]
    sum_p2: Optional[torch.Tensor]
    log_kept_mass: torch.Tensor


class TokenStatsSupport(NamedTuple):
    """:class:`TokenStatsKeptMass` and the kept set each row built (``support_ids``:
    ``targets.shape + (K,)`` int32, -1 padded, the target not forced in), what
    ``token_stats(..., sampler_truncation=..., return_support_ids=True)`` returns;
    ``log_kept_mass`` None unless ``return_log_kept_mass``."""

    logp: torch.Tensor
    entropy: torch.Tensor
    certainty: Optional[torch.Tensor]
    sum_p2: Optional[torch.Tensor]
    log_kept_mass: Optional[torch.Tensor]
    support_ids: torch.Tensor


CERTAINTY_KINDS = (None, "entropy", "max_prob")


def token_stats(hidden, weight, targets, bias=None, temperature=1.0, certainty=None,
                certainty_temperature=1.0, backend="auto", vocab_parallel=None,
                logit_softcap=None, logits_dtype=None, support_ids=None,
                sampler_truncation=None, return_log_kept_mass=False,
                over_support=True, return_support_ids=False) -> TokenStats:
    """No-grad per-token statistics, streaming over the vocabulary (docs/math.md §5, §7).

    certainty="entropy":  J = 1 - H(softmax(z_w)) / log V
    certainty="max_prob": J = 1 + log max_v softmax(z_w)_v / log V,  z_w = logits / certainty_temperature

    ``logits_dtype``: None (per device), ``torch.float32`` / ``"float32"`` or ``"input"``
    (docs/kernels.md, "Precision").

    ``support_ids``: None, or the sampler's kept ids ``targets.shape + (k,)`` (``-1``
    padded): ``logp``, ``entropy``, ``sum_p2`` and the certainty over each token's support
    (docs/math.md, "The sampler's support": J normalised by ``log |S|``, 1 where ``|S| = 1``).
    ``sampler_truncation``: None, or ``SamplerTruncation(...)``: the support rebuilt at
    ``temperature`` by the sampler's rule (the certainty over that support). Not with
    ``support_ids``. ``return_log_kept_mass=True``: a :class:`TokenStatsKeptMass` (the same
    fields and ``log_kept_mass``, ``LSE_S - LSE_V`` per token, 0 without a support), from the
    same pass.
    ``over_support=False``: every statistic the whole vocabulary's (bit for bit the call
    without a support) and only ``log_kept_mass`` the support's.
    ``return_support_ids=True`` (with ``sampler_truncation``): a :class:`TokenStatsSupport`,
    the kept set each row built as ``support_ids`` (``fused_linear_logprobs``' output of that
    name) — built once, in the pass that first scores the rollout with the sampling policy,
    and replayed by every later pass.
    """
    if not isinstance(over_support, bool):
        raise TypeError(f"over_support: expected a bool, got {over_support!r}")
    if not isinstance(return_support_ids, bool):
        raise TypeError(f"return_support_ids: expected a bool, got {return_support_ids!r}")
    if not isinstance(return_log_kept_mass, bool):
        raise TypeError(f"return_log_kept_mass: expected a bool, got "
                        f"{type(return_log_kept_mass).__name__} {return_log_kept_mass!r}")
    V.check_backend(backend)
    logits_dtype = V.check_logits_dtype(logits_dtype)
    _check_lm_head(hidden, weight, bias)
    logits_dtype = resolve_logits_dtype(logits_dtype, hidden.dtype, hidden.device)
    if certainty not in CERTAINTY_KINDS:
        raise ValueError(f"certainty: expected one of {CERTAINTY_KINDS}, got {certainty!r}")
    if certainty is not None:
        _check_temperature("certainty_temperature", certainty_temperature)
    V.check_tensor("targets", targets, shape=hidden.shape[:-1], integer=True, device=hidden.device)
    temp = _temperature(temperature, tuple(targets.shape), hidden.device)
    if isinstance(temp, torch.Tensor):
        temp = temp.reshape(-1)
    _check_softcap(logit_softcap)
    sl, vocab = _vp.resolve(vocab_parallel, weight, bias, hidden.device)
    safe = V.check_targets(targets, vocab).reshape(-1)
    h2 = hidden.detach().reshape(-1, hidden.shape[-1])
    b = None if bias is None else bias.detach()
    be = get_backend(backend, hidden.device, hidden.dtype)
    size = None
    if support_ids is not None or sampler_truncation is not None:
        be, safe, _ = _support(support_ids, safe.view(targets.shape), vocab, vp=sl, backend=be,
                               kept_mass=return_log_kept_mass, truncation=sampler_truncation,
                               over_support=over_support)
        size = (safe[:, 2:] >= 0).sum(1) if over_support else None    # |S|, target included
    _keep_support_ids(return_support_ids, be, sampler_truncation, sl)
    logp, entropy, _, extra, sum_p2 = stats_sweep(
        h2, weight.detach(), b, safe, be,
        temp, True, None if certainty is None else float(certainty_temperature),
        None if logit_softcap is None else float(logit_softcap), sl, want_sum_p2=True,
        logits_dtype=logits_dtype)
    if sampler_truncation is not None and over_support:
        size = be.size
    cert = None
    if certainty is not None and size is None:
        cert = certainty_from_stats(certainty, extra["entropy"], extra["zmax"], extra["lse"],
                                    vocab).view(targets.shape)
    elif certainty is not None:    # over the support: normalised by log |S|, 1 where |S| = 1
        log_s = torch.log(size.clamp(min=2).float())
        j = (1.0 - extra["entropy"] / log_s if certainty == "entropy"
             else 1.0 + (extra["zmax"] - extra["lse"]) / log_s)
        cert = torch.where(size > 1, j, 1.0).view(targets.shape)
    shape = targets.shape
    out = (logp.view(shape), entropy.view(shape), cert, sum_p2.view(shape))
    if return_support_ids:
        kept = be.log_kept_mass.view(shape) if return_log_kept_mass else None
        return TokenStatsSupport(*out, kept, be.kept.view(*shape, be.kept.shape[-1]))
    if not return_log_kept_mass:
        return TokenStats(*out)
    kept = (be.log_kept_mass.view(shape)
            if support_ids is not None or sampler_truncation is not None
            else torch.zeros(shape, device=hidden.device))
    return TokenStatsKeptMass(*out, kept)


class _PolicyLossFromLogp(torch.autograd.Function):
    """The loss of docs/math.md §1-§3, §10 given per-token log-probs, with the analytic
    derivative."""

    @staticmethod
    def forward(ctx, logp, entropy, args):
        (mask, adv, old, ref, tscale, klw, isr, sampling, cfg, phase, num_items, threshold_fn,
         holder, norm_of, sp) = args
        ct = torch.float64 if logp.dtype == torch.float64 else torch.float32
        idx = mask.reshape(-1).nonzero().squeeze(1)
        ti = token_inputs(mask, adv, old, ref, tscale, klw, isr, sampling, cfg, num_items, idx,
                          ct, sp=sp)
        lp = logp.detach().reshape(-1)[idx].to(ct)
        ent = None if entropy is None else entropy.detach().reshape(-1)[idx].to(ct)
        B = mask.shape[0]
        if idx.numel() or sp is not None:     # split sequences: every rank takes part
            ti = with_batch_masks(ti, ent, lp, cfg, mask, idx, ct, threshold_fn)
            lt = loss_terms(lp, ent, ti, cfg, phase)
            norm = None
            if norm_of is not None:          # docs/math.md §6, as the fused loss measures it
                p2, itemp = norm_of
                itemp = itemp.reshape(-1)[idx] if isinstance(itemp, torch.Tensor) else itemp
                norm = logp_grad_norm(lt.g, lp, p2.reshape(-1)[idx].to(ct), itemp)
            holder["metrics"] = policy_metrics(lt.terms, cfg, ent, norm, B, n_seq_nonempty(ti),
                                               sp)
            loss, g, gH = lt.loss_sum, lt.g, lt.gH
        else:
            if threshold_fn is not None:        # a collective: take part without tokens
                threshold_fn(lp, cfg.top_entropy_quantile)
            metrics = empty_metrics(cfg, logp.device, B)
            if norm_of is None:
                metrics.pop("grad_share_low"), metrics.pop("grad_norm_sum")
            holder["metrics"] = metrics
            loss, g, gH = torch.zeros((), dtype=ct, device=logp.device), lp, None

        def full(t):
            out = torch.zeros(mask.numel(), dtype=ct, device=logp.device)
            return out.index_copy_(0, idx, t).view_as(mask) if t is not None else out.view_as(mask)

        ctx.save_for_backward(full(g), full(gH))
        ctx.dtypes = (logp.dtype, None if entropy is None else entropy.dtype)
        return loss.to(torch.float32 if ct == torch.float32 else ct)

    @staticmethod
    def backward(ctx, grad):
        _no_double_backward()
        g, gH = ctx.saved_tensors
        dl = (g * grad).to(ctx.dtypes[0])
        dh = None if ctx.dtypes[1] is None else (gH * grad).to(ctx.dtypes[1])
        return dl, dh, None


def policy_loss(logp, mask, advantages, old_logp=None, ref_logp=None, entropy=None,
                token_scale=None, kl_weight=None, config=None, phase=None,
                num_items_in_batch=None, is_ratio=None, sampling_logp=None,
                data_parallel_group=None, num_seqs_in_batch=None, sum_p2=None,
                temperature=None, sequence_parallel=None):
    """The same GRPO loss for trainers that already have per-token ``logp`` [B, T].

    ``entropy`` [B, T] is needed when ``config.entropy_coef != 0`` or
    ``config.top_entropy_quantile < 1`` (its gradient flows back to it). Metrics as the fused
    loss, except ``grad_share_low`` (and ``grad_norm_sum``), which need the full distribution:
    reported when ``sum_p2`` [B, T] (``sum_v p_v^2``, from :func:`fused_linear_logprobs`) is
    given, with ``temperature`` (a float or a tensor [B] / [B, T]; default 1) the one ``logp``
    was taken at (used for that norm only, so refused without ``sum_p2``).
    ``sequence_parallel``: as in :func:`fused_linear_policy_loss` (this rank's share of the
    loss, the whole batch's metrics).
    """
    cfg = PolicyLossConfig.coerce(config)
    V.check_tensor("logp", logp, floating=True, dims=(2,))
    B, T = logp.shape
    device = logp.device
    checks = V.Checks()
    m = _mask(mask, B, T, device, checks)
    _check_phase(phase, cfg)
    norms = _norms(num_items_in_batch, num_seqs_in_batch)
    sp = _resolve_sp(sequence_parallel, cfg, B, device, checks)
    adv, is_ratio = _check_per_token(B, T, device, m, advantages, old_logp, ref_logp,
                                     token_scale, kl_weight, cfg, is_ratio, sampling_logp, checks,
                                     sp)
    if cfg.wants_entropy:
        if entropy is None:
            raise ValueError(f"entropy: required when config.entropy_coef != 0 or "
                             f"config.top_entropy_quantile < 1 (got entropy_coef="
                             f"{cfg.entropy_coef}, top_entropy_quantile="
                             f"{cfg.top_entropy_quantile}), got None")
        V.check_tensor("entropy", entropy, shape=(B, T), floating=True, device=device)
        V.check_finite("entropy", entropy, m, checks)
    elif entropy is not None:
        V.check_tensor("entropy", entropy, shape=(B, T), floating=True, device=device)
    norm_of = None
    if sum_p2 is None and temperature is not None:
        raise ValueError("temperature: used only for grad_share_low's norm, which needs sum_p2 "
                         "(logp is already at its temperature); pass sum_p2 too, or leave "
                         "temperature out")
    if sum_p2 is not None:
        V.check_tensor("sum_p2", sum_p2, shape=(B, T), floating=True, device=device)
        itemp = 1.0 / _temperature(1.0 if temperature is None else temperature, (B, T), device,
                                   m, checks)
        norm_of = (sum_p2.detach().float(), itemp)
    checks.resolve()
    holder = {}
    args = (m, adv, old_logp, ref_logp, token_scale,
            kl_weight if cfg.kl_coef != 0.0 else None, is_ratio, sampling_logp, cfg, phase,
            norms, _threshold_fn(data_parallel_group, cfg, sp), holder, norm_of, sp)
    loss = _PolicyLossFromLogp.apply(logp, entropy if cfg.wants_entropy else None, args)
    return loss, holder["metrics"]
