"""OpenRLHF 0.11.2 without ``[N, V]`` logits: the actor's loss and no-grad log-prob passes, its
arguments as a ``PolicyLossConfig``, and AR, Lopti, NTHR and critical-token KL inside its own
loop, patched in by :func:`enable` (docs/openrlhf.md).
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from typing import NamedTuple, Optional

import torch
from torch.nn.utils.rnn import pad_sequence

import gbc_kernels as gbc
from gbc_kernels import methods
from .. import hf, patching
from ..releases import TESTED, check_release, installed

POLICY_LOSS_TYPES = ("ppo", "gspo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_LEVELS = ("off", "token", "seq")


def _get(ns, path, default=None):
    """``args.actor.dual_clip`` as ``_get(args, "actor.dual_clip")`` (namespaces or dicts)."""
    for part in path.split("."):
        ns = ns.get(part) if isinstance(ns, dict) else getattr(ns, part, None)
        if ns is None:
            return default
    return ns


# gbc's field -> the OpenRLHF option it comes from (errors name the option the user set)
OPTION_NAMES = {"epsilon_low": "actor.eps_clip_low_high", "epsilon_high": "actor.eps_clip_low_high",
                "clip_ratio_c": "actor.dual_clip", "kl_coef": "algo.kl.init_coef",
                "entropy_coef": "actor.entropy_coef", "temperature": "temperature"}


def policy_loss_config(args, kl_coef: Optional[float] = None, temperature: float = 1.0,
                       **gbc_options) -> "gbc.PolicyLossConfig":
    """The config of OpenRLHF's actor loss for its parsed ``args`` (docs/openrlhf.md);
    ``kl_coef``: the step's ``kl_ctl`` (default ``algo.kl.init_coef``); ``gbc_options``: more
    gbc fields. A bad value is refused naming OpenRLHF's option."""
    plt = _get(args, "actor.policy_loss_type", "ppo")
    if plt not in POLICY_LOSS_TYPES:
        raise ValueError(f"actor.policy_loss_type: gbc reproduces OpenRLHF's {POLICY_LOSS_TYPES}, "
                         f"got {plt!r}")
    e = _get(args, "actor.eps_clip", 0.2)
    eps = _get(args, "actor.eps_clip_low_high", (e, e))
    if isinstance(eps, (str, bytes)) or not hasattr(eps, "__len__") or len(eps) != 2:
        raise ValueError(f"actor.eps_clip_low_high: expected a pair (low, high) of floats, got "
                         f"{eps!r}")
    agg_mode = _get(args, "actor.loss_agg_mode", "token-mean")
    if agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"actor.loss_agg_mode: expected one of {LOSS_AGG_MODES}, got "
                         f"{agg_mode!r}")
    # the values are checked by PolicyLossConfig, its errors renamed to OpenRLHF's options
    opts = dict(epsilon_low=eps[0], epsilon_high=eps[1], temperature=temperature,
                clip_ratio_c=_get(args, "actor.dual_clip"))
    if plt == "ppo":
        opts["loss_agg"] = agg_mode
    init = methods.finite_number("algo.kl.init_coef", _get(args, "algo.kl.init_coef", 0.0), 0.0)
    coef = init if kl_coef is None else methods.finite_number("kl_ctl", float(kl_coef), 0.0)
    if bool(_get(args, "algo.kl.use_loss", False)) and init > 0 and coef:
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
        opts.update(kl_coef=coef, kl_estimator=est, kl_clamp=10.0,
                    kl_unbiased_gradient=unbiased, kl_agg="token-mean")
    ent = _get(args, "actor.entropy_coef")
    if ent:
        opts.update(entropy_coef=ent, entropy_agg="token-mean")
    elif ent is not None:
        opts["return_entropy"] = True          # OpenRLHF logs the entropy with a 0 coefficient
    opts.update(gbc_options)
    names = dict(OPTION_NAMES, kl_coef="kl_ctl" if kl_coef is not None else "algo.kl.init_coef")
    for field in gbc_options:           # a gbc option keeps gbc's name
        names.pop(field, None)
    try:
        return gbc.PolicyLossConfig.preset(f"openrlhf:{plt}", **opts)
    except (TypeError, ValueError) as exc:
        raise methods.in_trainer_words(exc, names) from None


def batch_normalisers(loss_batch_info: Optional[dict]) -> dict:
    """``num_items_in_batch`` / ``num_seqs_in_batch`` from OpenRLHF's ``loss_batch_info``:
    ``batch_num_tokens / dp_size``, ``global_batch_size / dp_size`` (None: the call's own)."""
    info = loss_batch_info or {}
    dp = info.get("dp_size") or 1
    return {ours: info[theirs] / dp for ours, theirs in (("num_items_in_batch", "batch_num_tokens"),
            ("num_seqs_in_batch", "global_batch_size")) if info.get(theirs) is not None}


def is_correction(args, old_log_probs, rollout_log_probs, action_mask):
    """OpenRLHF's train/rollout importance-sampling correction of ``PolicyLoss`` (``ppo`` only)
    as the fused loss's per-token ``is_ratio``: the gated statistic per token or sequence clamps
    (``clip``) or drops (``mask``) the ratio ``old / rollout``. Returns ``(is_ratio or None,
    metrics)`` (``vllm_kl``, ``is_filter_ratio``). No gradient."""
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
        is_log, seq = old_log_probs - rollout_log_probs, level == "seq"
        token_is = is_log.exp()
        if gating == "ratio":                # at seq level: the ratio's geometric mean
            stat = (mmean(is_log, -1).unsqueeze(-1) if seq else is_log).exp()
        else:
            p, q = (x.exp().clamp(1e-6, 1 - 1e-6) for x in (rollout_log_probs, old_log_probs))
            stat = (p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
                    if gating == "binary_kl" else (p - q).abs())
            stat = mmean(stat, -1).unsqueeze(-1) if seq else stat
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
    return getattr(hf.unwrap(actor), "model", actor)


def _position_ids(attention_mask):
    """OpenRLHF's positions for left-padded, unpacked sequences (``Actor.forward``)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill_(attention_mask == 0, 1)


class PackedRows(NamedTuple):
    """OpenRLHF's packed samples (``ds.packing_samples``) of one forward, on this rank, and
    where its tokens sit in the loss's rows (docs/openrlhf.md, "Long context"): the model runs
    on ``input_ids`` / ``position_ids`` ``[1, n]`` (this rank's slice of the packed stream
    under ring attention); local position ``p[i]`` predicts action ``[b[i], j[i]]`` of the
    padded ``[B, T]`` batch and fills column ``c[i]`` of row ``b[i]`` of the loss's rows
    ``[B, width]`` (this rank's tokens of each sequence, in order)."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    p: torch.Tensor
    b: torch.Tensor
    j: torch.Tensor
    c: torch.Tensor
    width: int
    shape: tuple                        # (B, T): the padded action batch
    group: object                       # the ring-attention group, or None

    def rows(self, x, fill=0.0):
        """``[B, T]`` (or ``[B]`` / ``[B, 1]``: as is) -> the loss's rows ``[B, width]``."""
        if x is None or x.dim() < 2 or x.shape[-1] == 1:
            return x
        out = x.new_full((self.shape[0], self.width), fill)
        out[self.b, self.c] = x[self.b, self.j]
        return out

    def mask(self):
        out = torch.zeros(self.shape[0], self.width, dtype=torch.bool, device=self.b.device)
        out[self.b, self.c] = True
        return out

    def hidden(self, h):
        """The packed hidden states ``[1, n, H]`` -> the loss's rows ``[B, width, H]``."""
        out = h.new_zeros(self.shape[0], self.width, h.shape[-1])
        return out.index_put((self.b, self.c), h[0, self.p])

    def flat_hidden(self, h):
        """This rank's action positions' hidden states, ``[1, k, H]`` (no-grad passes)."""
        return h[:, self.p]

    def scatter(self, values):
        """Per-token values ``[..., k]`` (this rank's tokens) -> ``[B, T]`` (0 elsewhere), summed
        over the ring group: every rank gets the whole batch's, as OpenRLHF's gather."""
        out = torch.zeros(self.shape, dtype=values.dtype, device=values.device)
        out[self.b, self.j] = values.reshape(-1)
        if self.group is not None:
            import torch.distributed as dist
            dist.all_reduce(out, group=self.group)
        return out


def check_actions(sequences, attention_mask, action_mask) -> None:
    """The actions of a padded batch where OpenRLHF's step puts them: ``action_mask`` ``[B, T]``
    over the last ``T`` tokens of ``sequences`` ``[B, S]``, each predicted by the position before
    it (``T <= S - 1``), every marked action a token of its sequence (``attention_mask`` 1 there;
    a value check, off under ``GBC_VALIDATE=0``). Refused naming ``action_mask``."""
    if not isinstance(action_mask, torch.Tensor) or action_mask.dim() != 2:
        got = (list(action_mask.shape) if isinstance(action_mask, torch.Tensor)
               else type(action_mask).__name__)
        raise ValueError(f"action_mask: expected a [B, T] tensor, got {got}")
    (B, S), (b, T) = sequences.shape, action_mask.shape
    if b != B or not 0 < T < S:
        raise ValueError(f"action_mask: expected shape [{B}, T] with 1 <= T <= {S - 1} (the "
                         f"actions are the last T tokens of sequences [{B}, {S}], each "
                         f"predicted by the position before it: sequences[:, 1:]), got "
                         f"[{'x'.join(map(str, action_mask.shape))}]")
    if attention_mask is None or not gbc.value_checks_enabled():
        return
    outside = action_mask.bool() & ~attention_mask[:, S - T:].to(action_mask.device).bool()
    if bool(outside.any()):
        i, j = (int(x) for x in outside.nonzero()[0])
        raise ValueError(f"action_mask: marks an action outside its sequence at index [{i}, {j}] "
                         f"(attention_mask[{i}, {S - T + j}] is 0: no token there)")


def packed_rows(sequences, attention_mask, action_mask, ring_attn_group=None,
                packed_seq_lens=None, checked: bool = False) -> PackedRows:
    """OpenRLHF's packing of a padded batch (its own ``unpad_and_slice_tensor``, which also
    gives the ring attention the stream's ``cu_seqlens``) and the map of this rank's tokens to
    the loss's rows. ``action_mask`` is checked (:func:`check_actions`) unless ``checked``."""
    if attention_mask is None:
        raise ValueError("attention_mask: ds.packing_samples packs the batch by its attention "
                         "mask (the packed sequences' boundaries); got None")
    if packed_seq_lens is not None:
        raise ValueError("packed_seq_lens: OpenRLHF's Actor.forward takes the packed sequences' "
                         "boundaries from attention_mask and ignores packed_seq_lens; gbc "
                         "refuses a value it would ignore (pass None)")
    if tuple(attention_mask.shape) != tuple(sequences.shape):
        raise ValueError(f"attention_mask: expected the shape of sequences "
                         f"{list(sequences.shape)}, got {list(attention_mask.shape)}")
    if not checked:
        check_actions(sequences, attention_mask, action_mask)
    from openrlhf.models.ring_attn_utils import unpad_and_slice_tensor

    (B, S), T = sequences.shape, action_mask.shape[1]
    ids, pos, _, _, indices = unpad_and_slice_tensor(sequences, attention_mask, ring_attn_group)
    n, rank = ids.shape[1], 0
    if ring_attn_group is not None:
        import torch.distributed as dist
        rank = dist.get_rank(group=ring_attn_group)
    g = torch.arange(rank * n, (rank + 1) * n, device=ids.device)
    real = g < indices.numel()                      # the ring's padding predicts nothing
    p = torch.arange(n, device=ids.device)[real]
    flat = indices.to(ids.device)[g[real]]
    b, j = flat // S, flat % S - (S - 1 - T)        # position s predicts action s - (S-1-T)
    inside = (j >= 0) & (j < T)
    keep = inside.clone()
    keep[inside] = action_mask.to(ids.device).bool()[b[inside], j[inside]]
    p, b, j = p[keep], b[keep], j[keep]
    c = torch.arange(b.numel(), device=b.device) - torch.searchsorted(b, b)   # b ascends
    width = int(c.max()) + 1 if c.numel() else 1
    return PackedRows(ids, pos, p, b, j, c, width, (B, T), ring_attn_group)


def _check_packed_per_token(shape, advantages, **per_token) -> None:
    """The per-token fields' shapes before the packed path moves them to the loss's rows (an
    index error there, or a silent misfit): the checks and messages of the padded path's loss
    (gbc's names, the caller's words outside)."""
    B, T = shape
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) not in ((B,), (B, T)):
        got = ("x".join(map(str, advantages.shape)) if isinstance(advantages, torch.Tensor)
               else type(advantages).__name__)
        raise ValueError(f"advantages: expected shape [{B}] or [{B}x{T}], got [{got}]")
    for name, t in per_token.items():
        if t is None:
            continue
        if name == "is_ratio":
            if tuple(t.shape) not in ((B, T), (B, 1)):
                raise ValueError(f"is_ratio: expected shape [{B}x{T}] (per token) or [{B}x1] "
                                 f"(per sequence), got [{'x'.join(map(str, t.shape))}]")
        elif tuple(t.shape) != (B, T):
            word = {"old": "old_logp", "ref": "ref_logp"}.get(name, name)
            raise ValueError(f"{word}: expected shape [{B}x{T}], got "
                             f"[{'x'.join(map(str, t.shape))}]")


def _ring_group(actor, args, ring_attn_group):
    """The ring-attention group after the checks: packed samples only, of ``ds.ring_attn_size``."""
    if ring_attn_group is None:
        size = int(_get(args, "ds.ring_attn_size", 1) or 1) if args is not None else 1
        if size > 1:
            raise ValueError(f"ds.ring_attn_size: {size} > 1 but no ring_attn_group was given "
                             "(the strategy's ring_attn_group)")
        return None
    import torch.distributed as dist

    size = dist.get_world_size(group=ring_attn_group)
    want = _get(args, "ds.ring_attn_size") if args is not None else None
    if want is not None and int(want) != size:
        raise ValueError(f"ds.ring_attn_size: {want}, but the ring_attn_group has {size} ranks")
    if not getattr(actor, "packing_samples", False):
        raise ValueError("ds.ring_attn_size > 1 requires ds.packing_samples (OpenRLHF's Actor "
                         "uses the ring group only for packed samples)")
    return ring_attn_group if size > 1 else None


# gbc's (and hf's) argument names -> the Experience's fields, for the errors of the fused loss
# (``old_logp`` is not mapped: it is action_log_probs or, under GSPO's is_correction,
# rollout_log_probs)
EXPERIENCE_NAMES = {"input_ids": "experience.sequences",
                    "attention_mask": "experience.attention_mask",
                    "mask": "experience.action_mask", "action_mask": "experience.action_mask",
                    "advantages": "experience.advantages",
                    "ref_logp": "experience.base_action_log_probs"}


@methods.in_callers_words(EXPERIENCE_NAMES)
def fused_actor_loss(actor, experience, args, kl_ctl: float = 0.0, loss_batch_info=None,
                     temperature: Optional[float] = None, token_scale=None, kl_weight=None,
                     phase=None, ring_attn_group=None, token_out: Optional[dict] = None,
                     **gbc_options):
    """The loss ``ActorPPOTrainer.training_step`` backpropagates (policy, KL, entropy and MoE
    terms) for an ``Experience``, without logits. Returns ``(loss, metrics)``: OpenRLHF's
    logged metrics and gbc's (``gbc/...``). With ``actor.packing_samples`` the model runs on
    OpenRLHF's packed samples; ``ring_attn_group`` (the strategy's, ``ds.ring_attn_size > 1``):
    this rank's slice of them, and the loss's gradient is this rank's share times the ring size
    (DeepSpeed averages it over the ring's ranks), its value the whole batch's. ``token_out``:
    a dict that receives the per-token ``logp`` (and ``entropy`` when computed), ``[B, T]``
    float32 in OpenRLHF's layout, the whole batch's on every ring rank."""
    seq, am, mask = experience.sequences, experience.attention_mask, experience.action_mask
    check_actions(seq, am, mask)                # before anything is computed, on both paths
    T = mask.shape[1]
    group = _ring_group(actor, args, ring_attn_group)
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
    aux = float(_get(args, "actor.aux_loss_coef", 0.0) or 0.0) > 1e-8
    model = _inner_model(actor)
    ref = experience.base_action_log_probs if cfg.kl_coef else None
    kl_weight = kl_weight if cfg.kl_coef else None
    if phase is not None and token_out is None:      # Lopti: the logged terms need them
        token_out = {}
    if getattr(actor, "packing_samples", False):
        pk = packed_rows(seq, am, mask, group, checked=True)
        _check_packed_per_token(pk.shape, experience.advantages, old=ratio_base, ref=ref,
                                token_scale=token_scale, kl_weight=kl_weight, is_ratio=coef)
        rows = pk.rows
        if group is not None:
            norms["sequence_parallel"] = gbc.SequenceParallel(group)
        own = None if token_out is None else {}
        out = hf.packed_policy_loss_through_forward(
            model, pk.input_ids, pk.position_ids, pk.hidden, rows(seq[:, -T:], 0), pk.mask(),
            rows(experience.advantages), old_logp=rows(ratio_base), ref_logp=rows(ref),
            config=cfg, token_scale=rows(token_scale, 1.0), kl_weight=rows(kl_weight),
            phase=phase, is_ratio=rows(coef), return_outputs=aux, token_out=own, **norms)
        if token_out is not None:
            token_out.update({k: pk.scatter(v[pk.b, pk.c]) for k, v in own.items()})
    else:
        out = hf.policy_loss_through_forward(
            model, seq, am, T, m, experience.advantages, old_logp=ratio_base, ref_logp=ref,
            config=cfg, token_scale=token_scale, kl_weight=kl_weight, phase=phase,
            is_ratio=coef, return_outputs=aux, token_out=token_out,
            model_kwargs={"position_ids": _position_ids(am)}, **norms)
    loss, metrics = out[0], out[1]
    norms.pop("sequence_parallel", None)
    if group is not None:         # value: the batch's; gradient: the share x the ring's size
        import torch.distributed as dist

        whole = loss.detach().clone()
        dist.all_reduce(whole, group=group)
        scaled = loss * dist.get_world_size(group=group)
        loss = scaled + (whole - scaled).detach()
    policy_value = loss.detach().float()          # the batch's policy loss (this phase's)
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
        if phase is not None:
            # Lopti: the phase's loss counts its own tokens; the logged terms are the batch's
            # without the split (every token, the same normalisers) at this call's parameters,
            # from the per-token values the sweep returned (no vocabulary work)
            unsplit, _ = gbc.policy_loss(
                token_out["logp"], m, experience.advantages, old_logp=ratio_base,
                ref_logp=ref, entropy=token_out.get("entropy"), token_scale=token_scale,
                kl_weight=kl_weight, config=dataclasses.replace(cfg, lopti_eta=None),
                is_ratio=coef, **norms)
            actor_loss = actor_loss + (unsplit.float() - policy_value)
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
                           temperature: Optional[float] = None, backend: str = "auto",
                           options: Optional[methods.MethodOptions] = None,
                           ring_attn_group=None, packed_seq_lens=None,
                           nthr_keep: Optional[tuple] = None, logits_dtype=None):
    """``Actor.forward``'s no-grad action log-probs without logits: ``[B, T]`` float32, 0 where
    ``action_mask`` is; ``options`` with ``critical_kl_exponent`` (the reference model's
    pass): ``[B, T, 2]``, the log-probs and the critical-token KL weights. Packed samples
    (``actor.packing_samples``) and ring attention (``ring_attn_group``) as ``Actor.forward``
    runs them: every ring rank returns the whole batch's values. ``nthr_keep``: ``(heads,
    rows)``, a :class:`gbc_kernels.methods.NTHRHeadRows` and a list: the pass also keeps NTHR's
    inputs, the head's rows of the action tokens' ids into ``heads`` and one
    :class:`gbc_kernels.methods.NTHRKeptRow` per sample (on ``heads.device``) into ``rows``
    (under ring attention every ring rank keeps whole responses). ``logits_dtype``: the loss's
    (docs/kernels.md, "Precision"; ``options``' own when given)."""
    T = action_mask.shape[1]
    temp = getattr(actor, "temperature", 1.0) if temperature is None else temperature
    group = _ring_group(actor, None, ring_attn_group)
    valid = action_mask.bool()
    opts = options or methods.MethodOptions(logits_dtype=logits_dtype)
    if nthr_keep is not None and opts.critical_kl_exponent is not None:
        raise ValueError("nthr_keep: the reference model's pass (critical_kl_exponent) keeps "
                         "nothing for NTHR")

    def keep_head(head, cap):
        if nthr_keep is not None:
            nthr_keep[0].add(sequences[:, -T:][valid], head, cap, temp)

    if getattr(actor, "packing_samples", False):
        pk = packed_rows(sequences, attention_mask, action_mask, group, packed_seq_lens)
        targets = sequences[:, -T:][pk.b, pk.j][None]

        def compute(h, head, cap):
            keep_head(head, cap)
            flat = pk.flat_hidden(h)
            ref = methods.reference_stats(flat, head.weight, targets, opts, head.bias,
                                          temperature=temp, logit_softcap=cap, backend=backend)
            if nthr_keep is None:
                return ref, None
            if group is None:
                return ref, flat[0]
            full = flat.new_zeros(*action_mask.shape, flat.shape[-1])   # whole responses
            full[pk.b, pk.j] = flat[0]
            import torch.distributed as dist
            dist.all_reduce(full, group=group)
            return ref, full

        ref, hidden = hf.in_head(_inner_model(actor), pk.input_ids, None, None,
                                 {"position_ids": pk.position_ids}, compute)
        logp = pk.scatter(ref.ref_logp.float())
        if nthr_keep is not None:
            if group is None:            # this rank's tokens are the whole batch's, in order
                hidden = [hidden[pk.b == b] for b in range(len(valid))]
            _keep_rows(nthr_keep, valid, hidden, logp)
        return logp if ref.kl_weight is None else torch.stack(
            (logp, pk.scatter(ref.kl_weight.float())), -1)
    if packed_seq_lens is not None:
        raise ValueError("packed_seq_lens: given without ds.packing_samples (OpenRLHF's Actor "
                         "ignores it)")
    kwargs = {"position_ids": _position_ids(attention_mask)}
    if nthr_keep is None:
        ref = hf.reference_pass(
            _inner_model(actor), sequences, attention_mask, sequences[:, -T:], temperature=temp,
            backend=backend, completion_len=T, options=opts, model_kwargs=kwargs)
    else:
        def compute(h, head, cap):
            keep_head(head, cap)
            return methods.reference_stats(h, head.weight, sequences[:, -T:], opts, head.bias,
                                           temperature=temp, logit_softcap=cap,
                                           backend=backend), h

        ref, hidden = hf.in_head(_inner_model(actor), sequences, attention_mask, T, kwargs,
                                 compute)
        _keep_rows(nthr_keep, valid, hidden, ref.ref_logp)
    m = action_mask.to(ref.ref_logp.dtype)
    return ref.ref_logp * m if ref.kl_weight is None else torch.stack(
        (ref.ref_logp * m, ref.kl_weight * m), -1)


def _keep_rows(nthr_keep, valid, hidden, logp):
    """One :class:`gbc_kernels.methods.NTHRKeptRow` per sample: its valid columns, their
    hidden states (``hidden``: ``[B, T, H]``, or per sample ``[n, H]``) and log-probs."""
    heads, out = nthr_keep
    for b in range(len(valid)):
        cols = valid[b].nonzero().squeeze(1)
        h = hidden[b] if isinstance(hidden, list) else hidden[b, cols]
        if h.shape[0] != cols.numel():
            raise RuntimeError("nthr_keep: the packed tokens do not match action_mask")
        out.append(methods.NTHRKeptRow(cols.to(heads.device, torch.int32),
                                       h.to(heads.device), logp[b, cols].float().to(heads.device),
                                       heads))


ENV_OPTIONS = "GBC_OPENRLHF_OPTIONS"
METHOD_OPTIONS = tuple(f.name for f in dataclasses.fields(methods.MethodOptions))
# what the experience carries for gbc, in its ``info`` (split and merged with the samples)
INDEX_KEY, SCALE_KEY, KL_WEIGHT_KEY = "gbc_index", "gbc_nthr_scale", "gbc_kl_weight"
GBC_INFO_KEYS = (INDEX_KEY, SCALE_KEY, KL_WEIGHT_KEY)

# the attribute of a replay-buffer sample that holds NTHR's inputs kept from the experience
# maker's actor pass (a methods.NTHRKeptRow; not an Experience field: it stays on the sample)
KEPT_ATTR = "gbc_nthr_kept"

_STATE = SimpleNamespace(options={}, methods=methods.MethodOptions(), nthr_heads=None,
                         nthr_pending=[])
_PATCHES = patching.Patches()


def parse_options(text: Optional[str]) -> dict:
    """:data:`ENV_OPTIONS`'s ``"lopti_eta=0.5,nthr=true"`` -> keyword options (a method option
    typed as ``GBC_VERL_OPTIONS`` types it, :data:`gbc_kernels.methods.OPTION_KINDS`)."""
    words = {"none": None, "null": None, "true": True, "false": False}
    out = {}
    for name, value in methods.parse_items(text, ENV_OPTIONS).items():
        if name in methods.OPTION_KINDS:
            kind, what = methods.OPTION_KINDS[name]
            try:
                out[name] = kind(value)
            except ValueError:
                raise ValueError(f"{ENV_OPTIONS}: {name} expects {what}, got {value!r}") from None
            continue
        try:
            out[name] = words[value.lower()] if value.lower() in words else (
                int(value) if value.lstrip("+-").isdigit() else float(value))
        except ValueError:
            out[name] = value
    return out


def split_options(options: dict):
    """``enable``'s options -> ``(MethodOptions, other PolicyLossConfig fields)``, validated."""
    loss_fields = {f.name for f in dataclasses.fields(gbc.PolicyLossConfig)}
    method_kw = {k: v for k, v in options.items() if k in METHOD_OPTIONS}
    loss_kw = {k: v for k, v in options.items() if k not in METHOD_OPTIONS}
    for name in loss_kw:
        if name not in loss_fields:
            raise ValueError(f"{name}: not an option of the OpenRLHF drop-in (method options: "
                             f"{list(METHOD_OPTIONS)}; or a PolicyLossConfig field)")
        if name in ("temperature", "logit_softcap"):    # the no-grad passes would not see it
            raise ValueError(f"{name}: set on OpenRLHF's actor / model (its old-policy and "
                             f"reference passes use it too), not through enable()")
    opts = methods.MethodOptions.from_kwargs(**method_kw)
    gbc.PolicyLossConfig(**loss_kw, **opts.loss_options())           # validates the rest
    return opts, loss_kw


def _is_reference(actor) -> bool:
    """Whether this ``Actor`` is the reference model: a DeepSpeed engine without an optimizer,
    or marked ``gbc_reference``."""
    mark = getattr(actor, "gbc_reference", None)
    if mark is not None:
        return bool(mark)
    engine = getattr(actor, "model", None)
    return hasattr(engine, "module") and hasattr(engine, "optimizer") and engine.optimizer is None


def _actor_forward(self, sequences, action_mask=None, attention_mask=None, *args, **kwargs):
    """``Actor.forward`` with the no-grad log-prob pass fused (the reference model's, with
    critical-token KL: ``[B, T, 2]``, unpacked by the buffer's ``append``)."""
    rest = {k: v for k, v in kwargs.items() if k not in ("ring_attn_group", "packed_seq_lens")}
    plain = (action_mask is not None and not args and not torch.is_grad_enabled()
             and all(v is None or v is False for v in rest.values()))
    reference = _is_reference(self)
    weights = _STATE.methods.critical_kl_exponent is not None and reference
    if plain:
        keep = None
        if _STATE.methods.nthr and not reference:     # the experience maker's actor pass
            if _STATE.nthr_heads is None:
                _STATE.nthr_heads = methods.NTHRHeadRows("cpu")
            keep = (_STATE.nthr_heads, [])
        out = fused_action_log_probs(self, sequences, action_mask, attention_mask,
                                     options=_STATE.methods if weights else None,
                                     ring_attn_group=kwargs.get("ring_attn_group"),
                                     packed_seq_lens=kwargs.get("packed_seq_lens"),
                                     nthr_keep=keep, logits_dtype=_STATE.methods.logits_dtype)
        if keep is not None:                          # until the buffer's append takes it
            _STATE.nthr_pending.append(([t.detach().cpu() for t in (
                sequences, action_mask, attention_mask)], keep[1]))
        return out
    if weights:
        raise ValueError("critical_kl_exponent: the reference model's pass is not the plain "
                         "no-grad one (outputs, entropy or multimodal inputs requested): its "
                         "weights cannot be computed there")
    forward = _PATCHES.original(type(self), "forward")
    return forward(self, sequences, action_mask, attention_mask, *args, **kwargs)


def _buffer_append(self, experience):
    """``NaiveReplayBuffer.append`` that first keeps NTHR's ``Experience.index`` and the
    critical-token KL weights in the experience's ``info`` (split with its samples)."""
    opts = _STATE.methods
    base = experience.base_action_log_probs
    if isinstance(base, torch.Tensor) and base.dim() == 3:
        experience.base_action_log_probs = base[..., 0].contiguous()
        experience.info[KL_WEIGHT_KEY] = base[..., 1].contiguous()
    elif opts.critical_kl_exponent is not None:
        raise ValueError("critical_kl_exponent: the experience carries no critical-token KL "
                         "weights (the reference model's workers must run enable() with the "
                         f"same options, e.g. through {ENV_OPTIONS}; and OpenRLHF must keep "
                         "the reference log-probs: algo.kl.use_loss)")
    kept = None
    if opts.nthr:
        if experience.index is None:
            raise ValueError("nthr: the experience has no Experience.index (NTHR's groups); "
                             "OpenRLHF drops it when it rebalances samples "
                             "(train.dynamic_batch_enable)")
        experience.info[INDEX_KEY] = torch.as_tensor(experience.index, dtype=torch.long)
        kept = _take_pending(experience)
    out = _PATCHES.original(type(self), "append")(self, experience)
    if kept is not None:         # the new samples are the buffer's last ones (its limit aside)
        new = self.items[max(0, len(self.items) - len(kept)):]
        for item, row in zip(new, kept[len(kept) - len(new):]):
            setattr(item, KEPT_ATTR, row)
    return out


def _take_pending(experience):
    """The rows the actor's pass kept for exactly this experience's samples (its sequences
    and masks; the experience maker's micro-batch), or None."""
    seqs = [experience.sequences, experience.action_mask, experience.attention_mask]
    if any(not isinstance(t, torch.Tensor) for t in seqs):
        return None
    seqs = [t.detach().cpu() for t in seqs]
    for k, (saw, rows) in enumerate(_STATE.nthr_pending):
        if all(a.shape == b.shape and torch.equal(a.to(b.dtype), b)
               for a, b in zip(saw, seqs)):
            del _STATE.nthr_pending[k]
            return rows
    return None


def check_trainer(trainer) -> None:
    """Refuse, naming them, the OpenRLHF settings the enabled methods cannot run with."""
    opts, args, strategy = _STATE.methods, trainer.args, trainer.strategy
    dynamic = bool(_get(args, "train.dynamic_batch_enable", False))
    if opts.lopti_eta is not None:
        gas = int(getattr(strategy, "accumulated_gradient", 1) or 1)
        if gas > 1:
            raise ValueError(f"lopti_eta: DeepSpeed steps only every train.batch_size / "
                             f"(train.micro_batch_size x data-parallel size) = {gas} > 1 "
                             f"micro-batches, which merges Lopti's two steps (set "
                             f"train.micro_batch_size so that it is 1)")
        if dynamic:
            raise ValueError("lopti_eta: train.dynamic_batch_enable chooses its own optimizer "
                             "steps; Lopti needs one per phase")
    if dynamic and (opts.nthr or opts.critical_kl_exponent is not None):
        name = "nthr" if opts.nthr else "critical_kl_exponent"
        raise ValueError(f"{name}: train.dynamic_batch_enable rebalances the samples and drops "
                         f"what the method carries on the experience")
    if opts.nthr and int(_get(args, "ds.tensor_parallel_size", 1) or 1) > 1:
        raise ValueError("nthr: ds.tensor_parallel_size > 1: NTHR's pass takes the whole "
                         "lm_head on one rank")
    opts.check_loss(bool(_get(args, "algo.kl.use_loss", False))
                    and _get(args, "algo.kl.init_coef", 0.0), "algo.kl.use_loss and init_coef")


@torch.no_grad()
def nthr_pass(trainer) -> dict:
    """NTHR's token scales for the rank's whole replay buffer, before the update's first step
    (OpenRLHF shuffles its samples afterwards), groups ``Experience.index //
    rollout.n_samples_per_prompt`` merged over data-parallel ranks (docs/openrlhf.md). The
    old policy's hidden states and log-probs are those the experience maker's actor pass kept
    (no forward) when every sample, on every rank, has them; else one no-grad actor pass over
    the buffer (metric ``gbc/nthr_second_forward``). Each sample's scale goes into its
    ``info[SCALE_KEY]``; returns NTHR's metrics."""
    items = trainer.replay_buffer.items
    if not items:
        return {}
    if any(INDEX_KEY not in it.info for it in items):
        raise ValueError("nthr: the replay buffer's samples carry no Experience.index (enable() "
                         "must run in this process before the experience is appended)")
    n = int(_get(trainer.args, "rollout.n_samples_per_prompt", 1) or 1)
    actor = trainer.actor
    model, temperature = _inner_model(actor), getattr(actor, "temperature", 1.0)
    device = next(model.parameters()).device
    mesh = getattr(trainer.strategy, "ds_device_mesh", None)
    group = methods.data_parallel_group(None if mesh is None else mesh["dp"].get_group())
    kept = [getattr(it, KEPT_ATTR, None) for it in items]
    heads = kept[0].heads if kept[0] is not None else None
    usable = (heads is not None and not heads.stale
              and heads.temperatures == {float(temperature)}
              and all(k is not None and k.heads is heads and torch.equal(
                  k.cols.long(), it.action_mask.reshape(-1).nonzero().squeeze(1).cpu())
                      for k, it in zip(kept, items)))
    targets = [it.sequences[-it.action_mask.shape[-1]:] for it in items]
    extra = {}
    if methods.every_rank(usable, group):
        batch = methods.NTHRBatch(torch.cat([y[k.cols.long()] for k, y in zip(kept, targets)]),
                                  group, logits_dtype=_STATE.methods.logits_dtype)
        batch.add_kept(kept, targets, heads, device)
        extra["gbc/nthr_kept_mb"] = (heads.nbytes() + sum(k.nbytes() for k in kept)) / 2 ** 20
    else:
        batch = methods.NTHRBatch(torch.cat(targets), group,
                                  logits_dtype=_STATE.methods.logits_dtype)
        _nthr_forward(trainer, items, batch, group, model, temperature, device)
    extra["gbc/nthr_second_forward"] = float(not batch.tokens)
    mask, adv = (pad_sequence([getattr(it, k) for it in items], batch_first=True)
                 for k in ("action_mask", "advantages"))
    gids = torch.stack([torch.as_tensor(it.info[INDEX_KEY]).reshape(()) for it in items]) // n
    res, metrics = batch.result(mask, gids, adv, _STATE.methods)
    for k, it in enumerate(items):
        it.info[SCALE_KEY] = res.scale[k, :it.action_mask.shape[-1]].float().to(
            it.action_mask.device)
    return {**{f"gbc/{k}": float(v) for k, v in metrics.items()}, **extra}


def _nthr_forward(trainer, items, batch, group, model, temperature, device):
    """NTHR's own no-grad actor pass over the buffer, micro-batched as the buffer samples."""
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch

    actor = trainer.actor
    mb = max(1, int(getattr(trainer.replay_buffer, "sample_batch_size", 0) or len(items)))
    ring = _ring_group(actor, trainer.args, getattr(trainer.strategy, "ring_attn_group", None))
    was_training = actor.training
    actor.eval()
    try:
        for i in range(0, len(items), mb):
            exp = make_experience_batch(items[i:i + mb])
            seq, am = exp.sequences.to(device), exp.attention_mask.to(device)
            T = exp.action_mask.shape[1]
            rows, valid = range(i, i + len(seq)), exp.action_mask.to(device).bool()

            if getattr(actor, "packing_samples", False):
                pk = packed_rows(seq, am, exp.action_mask.to(device), ring)

                def add(h, head, softcap):      # packed: each token back at its column
                    full = h.new_zeros(len(seq), T, h.shape[-1])
                    full[pk.b, pk.j] = h[0, pk.p]
                    if ring is not None:        # NTHR compares whole responses: every ring
                        import torch.distributed as dist          # rank gets them all
                        dist.all_reduce(full, group=ring)
                    batch.add(rows, full, seq[:, -T:], valid, head, softcap, temperature)

                hf.in_head(model, pk.input_ids, None, None, {"position_ids": pk.position_ids},
                           add)
                continue

            def add(h, head, softcap):
                batch.add(rows, h, seq[:, -T:], valid, head, softcap, temperature)

            hf.in_head(model, seq, am, T, {"position_ids": _position_ids(am)}, add)
    finally:
        actor.train(was_training)


def _ppo_train(self, kl_ctl: float):
    """``ActorPPOTrainer.ppo_train`` after gbc's start-up checks and NTHR's pass."""
    check_trainer(self)
    try:
        extra = nthr_pass(self) if _STATE.methods.nthr else {}
        status = _PATCHES.original(type(self), "ppo_train")(self, kl_ctl)
    finally:
        _nthr_forget()               # the update changed the parameters
    status.update(extra)
    return status


# the OpenRLHF releases the drop-in is tested on (major.minor), and where its Ray trainer is
OPENRLHF_VERSIONS = TESTED["openrlhf"]
TRAINER_MODULE = "openrlhf.trainer.ray.ppo_actor"


def check_openrlhf_version(version: Optional[str] = None) -> str:
    """OpenRLHF's installed version, refused by name unless :data:`OPENRLHF_VERSIONS` (not
    installed: an ImportError)."""
    if version is None and installed("openrlhf") is None:
        raise ImportError("openrlhf: not installed; gbc's OpenRLHF drop-in (enable(), "
                          f"{ENV_OPTIONS}) patches its actor and trainer")
    return check_release("openrlhf", version,
                         why="gbc replaces methods of its Actor, ActorPPOTrainer and replay "
                             "buffer, which change between releases")


def _patch_trainer(cls):
    _PATCHES.set(cls, "training_step", training_step)
    _PATCHES.set(cls, "ppo_train", _ppo_train)


def enable(actor_cls=None, trainer_cls=None, buffer_cls=None, **options) -> None:
    """Patch OpenRLHF in this process (docs/openrlhf.md). ``options``: ``MethodOptions``'s and
    other ``PolicyLossConfig`` fields (none: :data:`ENV_OPTIONS`'s, errors naming it); the
    classes default to OpenRLHF's (``trainer_cls=False``: leave it). OpenRLHF's Ray trainer
    (its module imports vLLM) is patched now if imported, else right after its import. A bad
    option, OpenRLHF missing or a release outside :data:`OPENRLHF_VERSIONS` raises, and nothing
    is patched."""
    check_openrlhf_version()
    if options:
        opts, loss_options = split_options(options)
    else:
        try:
            opts, loss_options = split_options(parse_options(os.environ.get(ENV_OPTIONS)))
        except ValueError as exc:
            text = str(exc)
            raise ValueError(text if text.startswith(ENV_OPTIONS)
                             else f"{ENV_OPTIONS}: {text}") from None
    _STATE.methods, _STATE.options = opts, loss_options
    if actor_cls is None:
        from openrlhf.models import Actor as actor_cls
    _PATCHES.set(actor_cls, "forward", _actor_forward)
    if trainer_cls is None:
        _PATCHES.on_import(TRAINER_MODULE, lambda module: _patch_trainer(module.ActorPPOTrainer))
    elif trainer_cls:                                                # False: leave it
        _patch_trainer(trainer_cls)
    if opts.nthr or opts.critical_kl_exponent is not None:
        if buffer_cls is None:
            from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer as buffer_cls
        _PATCHES.set(buffer_cls, "append", _buffer_append)


def disable() -> None:
    """Undo :func:`enable` (every patched class gets its own method back)."""
    _PATCHES.undo()
    _STATE.methods, _STATE.options = methods.MethodOptions(), {}
    _nthr_forget()


def _nthr_forget():
    """The parameters change (or gbc is switched off): what the actor's pass kept describes
    them no longer."""
    if _STATE.nthr_heads is not None:
        _STATE.nthr_heads.stale = True
    _STATE.nthr_heads, _STATE.nthr_pending = None, []


def _info_rows(experience, key, T, fill, option, what):
    """``experience.info[key]``'s per-sample rows as ``[B, T]`` float32 (missing: refused)."""
    rows = experience.info.get(key)
    if rows is None:
        raise ValueError(f"{option}: the experience carries no {what}")
    out = pad_sequence([torch.as_tensor(r)[:T].float() for r in rows], batch_first=True,
                       padding_value=fill)
    return torch.nn.functional.pad(out, (0, T - out.shape[1]), value=fill).to(
        experience.action_mask.device)


def training_step(self, experience, kl_ctl: float, step: int, loss_batch_info=None):
    """``ActorPPOTrainer.training_step`` with the fused loss (OpenRLHF's normalisation,
    strategy, EMA and status) and the methods: Lopti's two optimizer steps, NTHR's scales and
    the critical-token KL weights from the experience (docs/openrlhf.md)."""
    from openrlhf.utils.loss_utils import get_loss_batch_info

    opts = _STATE.methods
    check_trainer(self)
    self.actor.train()
    dynamic = bool(_get(self.args, "train.dynamic_batch_enable", False))
    if loss_batch_info is None:
        loss_batch_info = get_loss_batch_info(self.strategy, experience.action_mask,
                                              replay_buffer=self.replay_buffer, step=step,
                                              dynamic_batch=dynamic)
    if getattr(experience, "mm_train_inputs", None) and getattr(self.actor, "is_vlm", False):
        raise ValueError("experience.mm_train_inputs: multimodal inputs are not supported by the "
                         "fused OpenRLHF loss yet")
    T = experience.action_mask.shape[1]
    token_scale = _info_rows(experience, SCALE_KEY, T, 1.0, "nthr", (
        "NTHR scales (computed by the patched ActorPPOTrainer.ppo_train, or nthr_pass(trainer), "
        "before the update)")) if opts.nthr else None
    kl_weight = _info_rows(experience, KL_WEIGHT_KEY, T, 0.0, "critical_kl_exponent", (
        "critical-token KL weights (the reference pass stores them; see enable())")) \
        if opts.critical_kl_exponent is not None else None
    for key in GBC_INFO_KEYS:
        experience.info.pop(key, None)
    if dynamic and float(_get(self.args, "actor.aux_loss_coef", 0.0) or 0.0) > 1e-8:
        raise ValueError("train.dynamic_batch_enable with actor.aux_loss_coef: the MoE loss's "
                         "dynamic scale is not supported by the fused OpenRLHF loss")
    do_step = not dynamic or self.replay_buffer.dynamic_optimizer_step[step]
    sched = self.actor_scheduler

    def update(phase):
        loss, m = fused_actor_loss(self.actor, experience, self.args, kl_ctl, loss_batch_info,
                                   token_scale=token_scale, kl_weight=kl_weight, phase=phase,
                                   ring_attn_group=getattr(self.strategy, "ring_attn_group",
                                                           None),
                                   **opts.loss_options(), **_STATE.options)
        self.strategy.backward(loss, self.actor, self.actor_optim)
        if do_step:
            keep = None if phase == opts.phases[-1] or sched is None else sched.state_dict()
            self.strategy.optimizer_step(self.actor_optim, self.actor, sched, name="actor")
            if keep is not None:                 # one scheduler step per batch: put it back
                sched.load_state_dict(keep)
                for group, lr in zip(sched.optimizer.param_groups, sched.get_last_lr()):
                    group["lr"] = lr
        return m

    results = methods.each_phase(opts, update)
    # Lopti: each phase logs the batch's terms without the split at its parameters; the step
    # logs the first update's (the parameters the batch met, as a step without Lopti logs)
    metrics = dict(results[0])
    if len(results) > 1:
        share = methods.lopti_grad_share_low([(None, {k[4:]: v for k, v in r.items()
                                                      if k.startswith("gbc/")}) for r in results],
                                             opts.lopti_order)
        if share is not None:
            metrics["gbc/lopti_grad_share_low"] = torch.tensor(share)
    if do_step and self.ema_model:
        self.strategy.moving_average(self.actor, self.ema_model, self.ema_beta, "cuda")
    for k in ("ppo_clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio", "kl"):
        if k in metrics:
            experience.info[k] = metrics[k].detach()
    # OpenRLHF's status: 0-d tensors weighted by token, per-sample tensors by sample, meta as is
    out, weights = {"actor_lr": sched.get_last_lr()[0]}, {"actor_lr": None}
    if do_step:
        out["actor_grad_norm"] = self.strategy.get_grad_norm(self.actor)
        weights["actor_grad_norm"] = None
    logged = [(k, metrics[k]) for k in ("policy_loss", "entropy_loss") if k in metrics]
    for k, v in logged + list(experience.info.items()) + [
            (k, v) for k, v in metrics.items() if k.startswith("gbc/")]:
        if isinstance(v, torch.Tensor):
            out[k], weights[k] = v, "token" if v.dim() == 0 else "sample"
        elif isinstance(v, list):
            out[k], weights[k] = torch.tensor(v, dtype=torch.float), "sample"
    cls = type(experience)
    for f in dataclasses.fields(cls):
        value = getattr(experience, f.name)
        if (f.name not in {"rewards", "scores"} and cls.is_episode_tensor_field(f.name)
                and isinstance(value, torch.Tensor) and f.name not in out):
            out[f.name], weights[f.name] = value, "sample"
    mask = experience.action_mask
    return {"metrics": out, "weights": weights, "num_samples": float(mask.shape[0]),
            "num_action_tokens": float(mask.sum().item())}
