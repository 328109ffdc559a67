"""OpenRLHF's ``Actor`` without ``[N, V]`` logits: the loss of its training step
(:func:`fused_actor_loss`) and its no-grad log-prob passes (:func:`fused_action_log_probs`),
padded or packed (``ds.packing_samples``, ring attention: :class:`PackedRows`);
docs/openrlhf.md.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch

import gbc_kernels as gbc
from gbc_kernels import methods
from .. import hf
from .losses import _get, batch_normalisers, is_correction, policy_loss_config


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

    def row_ids(self, ids):
        """Kept ids ``[B, T, K]`` (OpenRLHF's layout) -> the loss's rows ``[B, width, K]``
        (``-1`` where no token sits)."""
        out = ids.new_full((self.shape[0], self.width, ids.shape[-1]), -1)
        out[self.b, self.c] = ids[self.b, self.j]
        return out

    def scatter_ids(self, ids):
        """This rank's tokens' kept ids ``[1, k, K]`` -> ``[B, T, K]`` int32 (``-1`` elsewhere
        and in the padding), gathered over the ring group (``K`` the group's widest)."""
        K = torch.tensor(ids.shape[-1], device=ids.device)
        if self.group is not None:
            import torch.distributed as dist
            dist.all_reduce(K, op=dist.ReduceOp.MAX, group=self.group)
        ids = torch.nn.functional.pad(ids[0].long(), (0, int(K) - ids.shape[-1]), value=-1)
        out = torch.zeros(*self.shape, int(K), dtype=torch.long, device=ids.device)
        out[self.b, self.j] = ids + 1                   # 0 where no rank wrote: -1 below
        if self.group is not None:
            dist.all_reduce(out, group=self.group)
        return (out - 1).to(torch.int32)

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
    a value check, off under ``GBC_VALIDATE=0``). Refused naming ``action_mask``; an
    ``attention_mask`` of another shape than ``sequences`` (always checked) naming
    ``attention_mask``."""
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
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or tuple(attention_mask.shape) != (B, S)):
        got = (list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor)
               else type(attention_mask).__name__)
        raise ValueError(f"attention_mask: expected the shape of sequences {[B, S]}, got {got}")
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
                     sampler_truncation=None, log_kept_mass=None, support_ids=None,
                     **gbc_options):
    """The loss ``ActorPPOTrainer.training_step`` backpropagates (policy, KL, entropy and MoE
    terms) for an ``Experience``, without logits. Returns ``(loss, metrics)``: OpenRLHF's
    logged metrics and gbc's (``gbc/...``). With ``actor.packing_samples`` the model runs on
    OpenRLHF's packed samples; ``ring_attn_group`` (the strategy's, ``ds.ring_attn_size > 1``):
    this rank's slice of them, and the loss's gradient is this rank's share times the ring size
    (DeepSpeed averages it over the ring's ranks), its value the whole batch's. ``token_out``:
    a dict that receives the per-token ``logp`` (and ``entropy`` when computed), ``[B, T]``
    float32 in OpenRLHF's layout, the whole batch's on every ring rank.

    The sampler's kept set (docs/openrlhf.md, "The sampler's kept set"): ``sampler_truncation``
    (a :class:`gbc_kernels.SamplerTruncation`, ``support=replay``): the policy's log-probs,
    entropy and gradients over the set rebuilt from its own logits (metric
    ``gbc/support_forced_frac``); ``log_kept_mass`` (``[B, T]``, ``support=kept_mass``): the
    old policy's ``LSE_S - LSE_V``, added to ``experience.rollout_log_probs`` (vLLM's processed
    log-probs) wherever OpenRLHF's correction reads them (the train/rollout ratio, its gates and
    ``vllm_kl``, GSPO's ratio base). ``support_ids`` (``[B, T, K]``, ``-1`` padded, in
    OpenRLHF's layout also for packed samples; one set per rollout, ``support=replay``): over
    exactly the set the old-policy pass built (:func:`fused_action_log_probs`'
    ``return_support_ids``), through the support route; ``gbc/support_forced_frac`` is then
    the share of targets outside that set. Not with ``sampler_truncation``."""
    seq, am, mask = experience.sequences, experience.attention_mask, experience.action_mask
    check_actions(seq, am, mask)                # before anything is computed, on both paths
    T = mask.shape[1]
    group = _ring_group(actor, args, ring_attn_group)
    temp = getattr(actor, "temperature", 1.0) if temperature is None else temperature
    cfg = policy_loss_config(args, kl_coef=kl_ctl, temperature=temp, **gbc_options)
    old = experience.action_log_probs
    rollout = _kept_mass_rollout(args, getattr(experience, "rollout_log_probs", None),
                                 log_kept_mass, mask)
    coef, is_metrics = is_correction(args, old, rollout, mask)
    ratio_base = old
    if cfg.importance_sampling_level == "sequence" and \
            _get(args, "algo.advantage.is_correction_level", "off") != "off":
        ratio_base = rollout                          # OpenRLHF's GSPO against the rollout
    if sampler_truncation is not None:
        if support_ids is not None:
            raise ValueError("support_ids: pass either support_ids (the rollout's kept set, "
                             "built by the old-policy pass) or sampler_truncation (a set "
                             "rebuilt here), not both")
        gbc.truncation.check(sampler_truncation)
        gbc_support = {"sampler_truncation": sampler_truncation}
    elif support_ids is not None:
        _check_ids(support_ids, mask)
        gbc_support = {"support_ids": support_ids.to(mask.device, torch.int32).masked_fill(
            ~mask.bool()[..., None], -1)}
    else:
        gbc_support = {}
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
        if "support_ids" in gbc_support:
            gbc_support["support_ids"] = pk.row_ids(gbc_support["support_ids"])
        if group is not None:
            norms["sequence_parallel"] = gbc.SequenceParallel(group)
        own = None if token_out is None else {}
        out = hf.packed_policy_loss_through_forward(
            model, pk.input_ids, pk.position_ids, pk.hidden, rows(seq[:, -T:], 0), pk.mask(),
            rows(experience.advantages), old_logp=rows(ratio_base), ref_logp=rows(ref),
            config=cfg, token_scale=rows(token_scale, 1.0), kl_weight=rows(kl_weight),
            phase=phase, is_ratio=rows(coef), return_outputs=aux, token_out=own, **norms,
            **gbc_support)
        if token_out is not None:
            token_out.update({k: pk.scatter(v[pk.b, pk.c]) for k, v in own.items()})
    else:
        out = hf.policy_loss_through_forward(
            model, seq, am, T, m, experience.advantages, old_logp=ratio_base, ref_logp=ref,
            config=cfg, token_scale=token_scale, kl_weight=kl_weight, phase=phase,
            is_ratio=coef, return_outputs=aux, token_out=token_out,
            model_kwargs={"position_ids": _position_ids(am)}, **norms, **gbc_support)
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
    om.update({f"gbc/{k}": v for k, v in metrics.items() if k not in _methods_off(cfg)})
    return loss, om


# the fused loss's metrics of a method, logged only where the method runs (AR: ar_alpha > 0;
# Lopti: lopti_eta set); with it off they would describe an update that did not happen
AR_METRICS = ("ar_weight_mean",)
LOPTI_METRICS = ("low_frac", "grad_share_low", "grad_norm_sum")


def _methods_off(cfg) -> tuple:
    """The names of the fused loss's metrics whose method ``cfg`` does not run."""
    return (() if cfg.ar_alpha else AR_METRICS) + \
        (() if cfg.lopti_eta is not None else LOPTI_METRICS)


def _kept_mass_rollout(args, rollout, log_kept_mass, mask):
    """The rollout log-probs OpenRLHF's correction reads: vLLM's processed ones, moved by the
    old policy's ``log_kept_mass`` when given (``support=kept_mass``)."""
    if log_kept_mass is None:
        return rollout
    level = _get(args, "algo.advantage.is_correction_level", "off")
    if level == "off":
        raise ValueError("log_kept_mass: algo.advantage.is_correction_level is 'off': OpenRLHF "
                         "compares nothing against the sampler's log-probs, there is no ratio "
                         "to correct (support=kept_mass needs the correction on)")
    if rollout is None:
        raise ValueError("experience.rollout_log_probs: required with log_kept_mass "
                         "(support=kept_mass moves vLLM's processed log-probs)")
    if not isinstance(log_kept_mass, torch.Tensor) or \
            tuple(log_kept_mass.shape) != tuple(mask.shape):
        got = (list(log_kept_mass.shape) if isinstance(log_kept_mass, torch.Tensor)
               else type(log_kept_mass).__name__)
        raise ValueError(f"log_kept_mass: expected the action mask's shape "
                         f"{list(mask.shape)}, got {got}")
    lk = log_kept_mass.to(rollout.device) * mask.to(rollout.device)
    return methods.corrected_sampler_logp(rollout, lk, "kept_mass", normalised=True)


def _head_stats(h, head, targets, opts, temp, cap, backend, truncation=None,
                over_support=True, kept_mass=False, support_ids=None, build_ids=False):
    """The no-grad pass's statistics on the hidden states ``h``: ``(ReferenceStats, log
    kept mass, the built kept ids or None)``. ``truncation``: over the kept set rebuilt from
    these logits (``over_support``) or, with ``kept_mass``, the whole vocabulary's log-probs
    (bit for bit) and the set's ``LSE_S - LSE_V`` from the same pass; with ``build_ids``, over
    the set built here, whose ids (``h.shape[:-1] + (K,)``, ``-1`` padded) come back.
    ``support_ids``: over that given set (one set per rollout's later passes)."""
    if build_ids:
        if opts.critical_kl_exponent is not None:
            raise ValueError("return_support_ids: the reference model's pass "
                             "(critical_kl_exponent) does not build the kept set (the "
                             "old-policy pass does; the reference replays it as support_ids)")
        st = gbc.token_stats(h, head.weight, targets, head.bias, temperature=temp,
                             backend=backend, logit_softcap=cap,
                             logits_dtype=opts.logits_dtype, sampler_truncation=truncation,
                             return_support_ids=True)
        return methods.ReferenceStats(st.logp, None, None), st.support_ids
    if support_ids is not None:
        return methods.reference_stats(h, head.weight, targets, opts, head.bias,
                                       temperature=temp, logit_softcap=cap, backend=backend,
                                       support_ids=support_ids), None
    if not kept_mass:
        extra = {} if truncation is None else dict(sampler_truncation=truncation,
                                                   over_support=over_support)
        return methods.reference_stats(h, head.weight, targets, opts, head.bias,
                                       temperature=temp, logit_softcap=cap, backend=backend,
                                       **extra), None
    if opts.critical_kl_exponent is not None:
        raise ValueError("return_log_kept_mass: the reference model's pass (critical_kl_exponent) "
                         "returns no kept mass")
    st = gbc.token_stats(h, head.weight, targets, head.bias, temperature=temp, backend=backend,
                         logit_softcap=cap, logits_dtype=opts.logits_dtype,
                         sampler_truncation=truncation, over_support=over_support,
                         return_log_kept_mass=True)
    return methods.ReferenceStats(st.logp, None, None), st.log_kept_mass


@torch.no_grad()
def fused_action_log_probs(actor, sequences, action_mask, attention_mask,
                           temperature: Optional[float] = None, backend: str = "auto",
                           options: Optional[methods.MethodOptions] = None,
                           ring_attn_group=None, packed_seq_lens=None,
                           nthr_keep: Optional[tuple] = None, logits_dtype=None,
                           sampler_truncation=None, over_support: bool = True,
                           return_log_kept_mass: bool = False, support_ids=None,
                           return_support_ids: bool = False):
    """``Actor.forward``'s no-grad action log-probs without logits: ``[B, T]`` float32, 0 where
    ``action_mask`` is; ``options`` with ``critical_kl_exponent`` (the reference model's
    pass): ``[B, T, 2]``, the log-probs and the critical-token KL weights. Packed samples
    (``actor.packing_samples``) and ring attention (``ring_attn_group``) as ``Actor.forward``
    runs them: every ring rank returns the whole batch's values. ``nthr_keep``: ``(heads,
    rows)``, a :class:`gbc_kernels.methods.NTHRHeadRows` and a list: the pass also keeps NTHR's
    inputs, the head's rows of the action tokens' ids into ``heads`` and one
    :class:`gbc_kernels.methods.NTHRKeptRow` per sample (on ``heads.device``) into ``rows``
    (under ring attention every ring rank keeps whole responses). ``logits_dtype``: the loss's
    (docs/kernels.md, "Precision"; ``options``' own when given).

    ``sampler_truncation`` (a :class:`gbc_kernels.SamplerTruncation`): the sampler's kept set
    rebuilt from this model's logits at the pass's temperature; the log-probs (and
    critical-token KL weights) over it (``support=replay``), or with ``over_support=False`` the
    whole vocabulary's, bit for bit the pass without it. ``return_log_kept_mass=True`` (needs
    ``sampler_truncation``; ``support=kept_mass``'s old-policy pass): returns ``(log-probs,
    log_kept_mass)``, the second ``LSE_S - LSE_V`` per action ``[B, T]`` float32 (0 where
    ``action_mask`` is), from the same pass.

    One kept set per rollout (docs/openrlhf.md, "The sampler's kept set"):
    ``return_support_ids=True`` (needs ``sampler_truncation``; the old-policy pass, which
    builds the set): returns ``(log-probs, support_ids)``, the log-probs over the set built
    here and its ids ``[B, T, K]`` int32, ``-1`` padded (the target not forced in; rows
    ``action_mask`` leaves out hold only ``-1``), in OpenRLHF's layout also for packed
    samples (every ring rank gets the whole batch's). ``support_ids`` (those ids; not with
    ``sampler_truncation``): the log-probs (and critical-token KL weights) over exactly that
    set, through the support route."""
    T = action_mask.shape[1]
    temp = getattr(actor, "temperature", 1.0) if temperature is None else temperature
    group = _ring_group(actor, None, ring_attn_group)
    valid = action_mask.bool()
    opts = options or methods.MethodOptions(logits_dtype=logits_dtype)
    if nthr_keep is not None and opts.critical_kl_exponent is not None:
        raise ValueError("nthr_keep: the reference model's pass (critical_kl_exponent) keeps "
                         "nothing for NTHR")
    if sampler_truncation is not None:
        gbc.truncation.check(sampler_truncation)
    elif return_log_kept_mass:
        raise ValueError("return_log_kept_mass: needs sampler_truncation (the kept set whose "
                         "mass it is)")
    if return_support_ids and (sampler_truncation is None or return_log_kept_mass
                               or nthr_keep is not None or not over_support):
        raise ValueError("return_support_ids: needs sampler_truncation (the kept set built in "
                         "this pass, scored over it: over_support) and neither "
                         "return_log_kept_mass nor nthr_keep")
    if support_ids is not None:
        if sampler_truncation is not None or nthr_keep is not None:
            raise ValueError("support_ids: pass either support_ids (the rollout's kept set, "
                             "built by the old-policy pass) or sampler_truncation (a set "
                             "rebuilt here), not both; and not with nthr_keep")
        _check_ids(support_ids, action_mask)
    if nthr_keep is not None and sampler_truncation is not None and over_support:
        raise ValueError("nthr_keep: NTHR keeps the whole vocabulary's log-probs; not with "
                         "sampler_truncation over the kept set (over_support=False for the "
                         "kept mass only)")

    def stats(h, head, cap, targets, ids=None):
        return _head_stats(h, head, targets, opts, temp, cap, backend, sampler_truncation,
                           over_support, return_log_kept_mass, ids, return_support_ids)

    def keep_head(head, cap):
        if nthr_keep is not None:
            nthr_keep[0].add(sequences[:, -T:][valid], head, cap, temp)

    if getattr(actor, "packing_samples", False):
        pk = packed_rows(sequences, attention_mask, action_mask, group, packed_seq_lens)
        targets = sequences[:, -T:][pk.b, pk.j][None]
        flat_ids = None if support_ids is None else \
            support_ids.to(pk.b.device)[pk.b, pk.j][None].to(torch.int32)

        def compute(h, head, cap):
            keep_head(head, cap)
            flat = pk.flat_hidden(h)
            ref, kept = stats(flat, head, cap, targets, flat_ids)
            if nthr_keep is None:
                return ref, kept, None
            if group is None:
                return ref, kept, flat[0]
            full = flat.new_zeros(*action_mask.shape, flat.shape[-1])   # whole responses
            full[pk.b, pk.j] = flat[0]
            import torch.distributed as dist
            dist.all_reduce(full, group=group)
            return ref, kept, full

        ref, kept, hidden = hf.in_head(_inner_model(actor), pk.input_ids, None, None,
                                       {"position_ids": pk.position_ids}, compute)
        logp = pk.scatter(ref.ref_logp.float())
        if nthr_keep is not None:
            if group is None:            # this rank's tokens are the whole batch's, in order
                hidden = [hidden[pk.b == b] for b in range(len(valid))]
            _keep_rows(nthr_keep, valid, hidden, logp)
        out = logp if ref.kl_weight is None else torch.stack(
            (logp, pk.scatter(ref.kl_weight.float())), -1)
        if return_support_ids:
            return out, pk.scatter_ids(kept)
        return (out, pk.scatter(kept.float())) if return_log_kept_mass else out
    if packed_seq_lens is not None:
        raise ValueError("packed_seq_lens: given without ds.packing_samples (OpenRLHF's Actor "
                         "ignores it)")
    kwargs = {"position_ids": _position_ids(attention_mask)}
    kept = None
    if nthr_keep is None and sampler_truncation is None and support_ids is None:
        ref = hf.reference_pass(
            _inner_model(actor), sequences, attention_mask, sequences[:, -T:], temperature=temp,
            backend=backend, completion_len=T, options=opts, model_kwargs=kwargs)
    else:
        ids = None if support_ids is None else support_ids.to(sequences.device, torch.int32)

        def compute(h, head, cap):
            keep_head(head, cap)
            return stats(h, head, cap, sequences[:, -T:], ids), h

        (ref, kept), hidden = hf.in_head(_inner_model(actor), sequences, attention_mask, T,
                                         kwargs, compute)
        if nthr_keep is not None:
            _keep_rows(nthr_keep, valid, hidden, ref.ref_logp)
    m = action_mask.to(ref.ref_logp.dtype)
    out = ref.ref_logp * m if ref.kl_weight is None else torch.stack(
        (ref.ref_logp * m, ref.kl_weight * m), -1)
    if return_support_ids:
        return out, kept.to(torch.int32).masked_fill(~valid[..., None].to(kept.device), -1)
    return (out, kept.float() * m) if return_log_kept_mass else out


def _check_ids(support_ids, action_mask) -> None:
    """Kept ids for ``action_mask`` ``[B, T]``: an integer tensor ``[B, T, K]``, refused
    naming ``support_ids`` (the values are the support route's to check)."""
    B, T = action_mask.shape
    if not isinstance(support_ids, torch.Tensor) or support_ids.dtype not in (
            torch.int32, torch.int64) or support_ids.dim() != 3 or \
            tuple(support_ids.shape[:2]) != (B, T):
        got = (f"{support_ids.dtype} {list(support_ids.shape)}"
               if isinstance(support_ids, torch.Tensor) else type(support_ids).__name__)
        raise ValueError(f"support_ids: expected an int32/int64 tensor [{B}, {T}, K] (the "
                         f"action mask's shape and the kept ids, -1 padded), got {got}")


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
