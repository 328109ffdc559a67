"""gbc's fused loss inside SkyRL 0.3.0's policy worker (docs/skyrl.md).

:class:`GBCPolicyWorkerMixin` replaces the worker's training micro-step
(``PolicyWorkerBase._forward_backward_micro``: logits -> ``logprobs_from_logits`` ->
``chunked_entropy_from_logits`` -> registered loss) by gbc's fused loss from the final hidden
states and the lm_head inside the model's forward (:func:`gbc_kernels.integrations.hf.
policy_loss_through_forward`; no ``[tokens, V]`` logits), and its no-grad log-prob pass
(old policy; :class:`GBCRefWorkerMixin`: the reference) by gbc's row passes. The loss is SkyRL's
(the table of :mod:`.losses`); metrics are SkyRL's, from its own functions on gbc's log-probs.
The four methods run through :class:`gbc_kernels.methods.MethodOptions`: AR in the loss, Lopti
as two optimizer steps of SkyRL's own step, critical-token KL from the reference worker's pass
(its weights travel in SkyRL's training batch as :data:`KL_WEIGHT_KEY`, :mod:`.trainer`),
NTHR from what SkyRL's own old-log-prob pass keeps (:meth:`GBCPolicyWorkerMixin.forward`),
scored once the advantages exist, with no second forward. Under SkyRL's Ulysses sequence
parallelism (packed micro-batches) each SP rank runs its slice through the head, the loss's
sequence terms reduced over the SP group (:class:`_UlyssesSlice`, docs/skyrl.md "Long
context"). Under SkyRL 0.4's ``trainer.algorithm.enable_sample_support_replay`` every pass
(the update, the old policy's, the reference's at the policy's temperature) is over each
token's recorded support (:func:`replay_support_ids`: SkyRL's ``rollout_sample_support`` as
gbc's ``support_ids``; docs/skyrl.md "The sampler's support"; the whole batch's support checked
before its first micro-batch, :func:`check_replay_batch`), and so are the methods that read
a distribution: NTHR's error vectors (:class:`gbc_kernels.methods.NTHRBatch` keeps each
micro-batch's support beside its rows) and critical-token KL's
certainty (the reference's distribution over each token's support).
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Optional

import torch

from gbc_kernels import methods, value_checks_enabled
from gbc_kernels.integrations import hf

from . import losses

ENV = "GBC_SKYRL"                  # "1" in gbc's workers' runtime environment (set by enable())
OPTIONS_ENV = "GBC_SKYRL_OPTIONS"  # "ar_alpha=0.3,lopti_eta=0.5": the method options

# the fields gbc adds to SkyRL's training batch (TrainingInputBatch -> the worker's Experience
# ``info``, :func:`carry_fields`): critical-token KL's weights (the reference worker's pass),
# NTHR's group ids (SkyRL's ``uids``) and NTHR's token scales (the policy worker's, per
# mini-batch)
KL_WEIGHT_KEY = "gbc_kl_weight"
GROUP_KEY = "gbc_group"
SCALE_KEY = "gbc_token_scale"
CARRIED = (KL_WEIGHT_KEY, SCALE_KEY)


def method_options(text: Optional[str] = None) -> methods.MethodOptions:
    """The method options of ``text`` (default: the ``GBC_SKYRL_OPTIONS`` variable), each
    typed and checked by :meth:`gbc_kernels.methods.MethodOptions.parse`."""
    text = os.environ.get(OPTIONS_ENV, "") if text is None else text
    return methods.MethodOptions.parse(text, OPTIONS_ENV)


def carry_fields():
    """SkyRL's ``BaseBatchIterator.batch_to_experience`` (the training micro-batch -> its
    ``Experience``, which keeps a fixed set of fields) that also carries gbc's fields
    (:data:`CARRIED`) in the experience's ``info``; idempotent."""
    from skyrl.backends.skyrl_train.workers import worker_utils

    cls = worker_utils.BaseBatchIterator
    original = cls.__dict__["batch_to_experience"].__func__
    if getattr(original, "_gbc_carries", False):
        return

    def batch_to_experience(batch):
        exp = original(batch)
        fields = {}
        for key in CARRIED:
            value = batch.get(key) if key in batch.keys() else None
            if value is not None:
                fields[key] = value
                exp.info = {**(exp.info or {}), key: value}
        if _RECORDED is not None:
            _RECORDED.append(fields)
        return exp

    batch_to_experience._gbc_carries = True
    cls.batch_to_experience = staticmethod(batch_to_experience)


# while gbc's Megatron policy worker runs SkyRL's forward_backward: each micro-batch's carried
# fields, in the order SkyRL made its experiences (:func:`recording`)
_RECORDED: Optional[list] = None


@contextlib.contextmanager
def recording():
    """While open, :func:`carry_fields`' ``batch_to_experience`` also records each
    experience's carried fields, in order (SkyRL's Megatron worker turns each experience into
    a micro-batch dict of its own keys: :func:`take_recorded` gives the fields to them)."""
    global _RECORDED
    previous, _RECORDED = _RECORDED, []
    try:
        yield
    finally:
        _RECORDED = previous


def take_recorded() -> Optional[list]:
    """The fields recorded since the last call (None outside :func:`recording`)."""
    global _RECORDED
    if _RECORDED is None:
        return None
    out, _RECORDED = _RECORDED, []
    return out


def row_keys(sequences: torch.Tensor, attention_mask: torch.Tensor) -> list:
    """One key per row of a SkyRL batch: its token ids and attention mask. Two rows share a key
    only when they are the same padded sequence (then their forwards are equal), so the key
    finds a sample's row of the old-log-prob pass in a training mini-batch."""
    import hashlib

    seq = sequences.detach().cpu().long().numpy()
    attn = attention_mask.detach().cpu().to(torch.int8).numpy()
    return [hashlib.blake2b(seq[i].tobytes() + attn[i].tobytes(), digest_size=16).digest()
            for i in range(seq.shape[0])]


def check_config(cfg, options: Optional[methods.MethodOptions] = None,
                 ulysses: bool = True) -> methods.MethodOptions:
    """Refuse, naming SkyRL's option, a trainer config (``cfg``: SkyRL's ``trainer`` section)
    or method options (default: ``GBC_SKYRL_OPTIONS``) gbc's worker cannot honour: the loss
    table's refusals (:func:`.losses.policy_loss_config`) and, with ``ulysses`` (the FSDP
    worker), Ulysses SP on padded micro-batches or with Clip-Cov / KL-Cov. Returns the
    options."""
    opts = method_options() if options is None else options
    algo = losses.get(cfg, "algorithm")
    if algo is None:
        raise ValueError("cfg: expected SkyRL's trainer config (with .algorithm)")
    # ulysses=False: the Megatron wrapper's check (.megatron.check_megatron_config)
    megatron = not ulysses or losses.get(cfg, "strategy", "fsdp") == "megatron"
    losses.check_algorithm(algo, "megatron" if megatron else "fsdp")
    cfg_loss = losses.policy_loss_config(algo, kl_entropy_weight=1.0, **opts.loss_options())
    opts.check_loss(cfg_loss.kl_coef, "trainer.algorithm.use_kl_loss=true and kl_loss_coef",
                    names={"critical_kl_exponent": f"{OPTIONS_ENV}: critical_kl_exponent"})
    for worker in ("policy", "ref"):
        sp = losses.get(cfg, f"{worker}.sequence_parallel_size", 1)
        if not ulysses or sp in (None, 1):
            continue
        if not losses.get(cfg, "remove_microbatch_padding", True):
            raise ValueError(SP_PADDED.format(option=f"trainer.{worker}.sequence_parallel_size",
                                              sp=sp))
        if worker == "policy" and algo.policy_loss_type in ("clip_cov", "kl_cov"):
            raise ValueError(SP_COV.format(sp=sp))
    return opts


# SkyRL 0.4's sample-support replay (trainer.algorithm.enable_sample_support_replay): the
# batch's field, and its messages (skyrl.backends.skyrl_train.utils.sample_support_replay,
# workers/model_wrapper.py)
SUPPORT_FIELD = "rollout_sample_support"
SUPPORT_NO_LOSS_MASK = "sample-support replay is enabled but the microbatch has no loss mask"
SUPPORT_MISSING_ROW = ("sample-support replay requires captured support for every loss-active "
                       "token")


def replay_support_ids(support, loss_mask, attention_mask, T: int) -> torch.Tensor:
    """SkyRL's ``rollout_sample_support`` of a micro-batch (a ``PackedTensor``: ``values`` int32
    ``[sum_b len_b, k]``, ``-1`` padded, one segment of ``len_b`` rows per sequence, row ``j``
    the sampler's support of response token ``j``) as gbc's ``support_ids [B, T, k]`` (int64)
    of the worker's ``[B, T]`` response columns: SkyRL's alignment
    (``align_sample_support_row_ids`` in its left-padded batch) puts row ``j`` of sequence ``b``
    at the logit that predicts column ``T - len_b + j``; columns without a row get ``-1``.
    Refused as SkyRL refuses: no support or no ``loss_mask`` given, a sequence whose support
    covers all its real tokens, and a loss-active token (``loss_mask != 0``) whose row holds no
    id (SkyRL's ``valid_mask``; its message). The padded and the packed layouts share the
    ``[B, T]`` columns, so one map serves both."""
    from skyrl.backends.skyrl_train.utils.sample_support_replay import (
        missing_sample_support_message)

    if support is None:
        raise ValueError(missing_sample_support_message("FSDP"))
    if loss_mask is None:
        raise ValueError(SUPPORT_NO_LOSS_MASK)
    B = attention_mask.shape[0]
    device = attention_mask.device
    values = support.values.to(device)
    cu = support.cu_seqlens.to(device=device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    if lens.numel() != B:
        raise ValueError(f"{SUPPORT_FIELD}: {lens.numel()} segments for a micro-batch of {B} "
                         f"sequences")
    real = attention_mask.long().sum(-1)
    if B and bool((lens >= real).any()):
        raise ValueError(
            f"{SUPPORT_FIELD}: a trajectory whose support covers all of its real tokens has no "
            f"position that predicts its first response token, got lengths {lens.tolist()} "
            f"for trajectories {real.tolist()}")
    k = values.shape[1]
    j = torch.arange(T, device=device)[None] - (T - lens[:, None])      # [B, T] row in segment
    have = j >= 0
    if values.shape[0]:
        rows = (cu[:-1, None] + j).clamp(min=0, max=values.shape[0] - 1)
        ids = values.index_select(0, rows.reshape(-1)).reshape(B, T, k).long()
        ids = ids.masked_fill(~have[..., None], -1)
    else:
        ids = torch.full((B, T, k), -1, dtype=torch.long, device=device)
    if bool(((loss_mask.to(device) != 0) & ~(ids >= 0).any(-1)).any()):
        raise ValueError(SUPPORT_MISSING_ROW)
    return ids


def _replays(cfg) -> bool:
    return losses.sample_support_replay(cfg.algorithm)


def vocab_size(worker) -> Optional[int]:
    """V of the worker's head, as its passes check ``support_ids`` against it: the FSDP
    worker's lm_head rows (``out_features``: the whole head, sharded or not), the Megatron
    worker's padded vocabulary (the model chunk's ``vocab_size``, or its output layer's
    ``output_size``: every tensor-parallel shard's rows); None where the model shows none."""
    chunks = getattr(worker, "actor_module", None)
    if chunks:                                                      # Megatron
        inner = chunks[-1]
        while hasattr(inner, "module"):
            inner = inner.module
        n = getattr(inner, "vocab_size", None)
        if n is None:
            n = getattr(getattr(inner, "output_layer", None), "output_size", None)
        return None if n is None else int(n)
    model = getattr(getattr(worker, "model", None), "model", None)    # FSDP: HFModelWrapper
    if model is None:
        return None
    head = hf.unwrap(model).get_output_embeddings()
    if head is None:
        return None
    n = getattr(head, "out_features", None)
    if n is None:
        weight = getattr(getattr(head, "base_layer", head), "weight", None)
        n = None if weight is None else weight.shape[0]
    return None if n is None else int(n)


def check_replay_batch(worker, data, loss_tokens: bool) -> None:
    """Under SkyRL 0.4's replay, the whole batch's ``rollout_sample_support`` (``data``: the
    ``TrainingInputBatch`` a worker's ``forward_backward`` / ``forward`` gets) checked before
    its first micro-batch, as each micro-batch's pass would check its own: SkyRL's refusals
    (:func:`replay_support_ids`: a loss-active token without support, ...) and gbc's value
    check of the ids, ``[-1, V)`` on the tokens the pass scores (``loss_tokens``: the training
    step's, the loss mask's; else every response token's: the no-grad passes'), refused naming
    ``support_ids``, the range, the id and where it sits in the batch. A refusal in a later
    micro-batch would come after the earlier ones' gradients were accumulated (and, under
    Lopti, before or after its first optimizer step); here it changes nothing. A batch without
    the field or the loss mask is left to the first micro-batch (SkyRL's message for the
    strategy, before anything is computed)."""
    if not _replays(worker.cfg):
        return
    keys = set(data.keys())
    support = data[SUPPORT_FIELD] if SUPPORT_FIELD in keys else None
    loss_mask = data["loss_mask"] if "loss_mask" in keys else None
    T = (getattr(data, "metadata", None) or {}).get("response_length")
    if support is None or loss_mask is None or T is None:
        return
    T = int(T)
    attn = data["attention_mask"]
    ids = replay_support_ids(support, loss_mask, attn, T)
    V = vocab_size(worker)
    if V is None or not value_checks_enabled():     # GBC_VALIDATE=0: as the fused loss
        return
    bad = (ids < -1) | (ids >= V)
    if loss_tokens:
        bad &= (loss_mask.to(ids.device) != 0)[..., None]
    if not bool(bad.any()):
        return
    b, t, j = (int(x) for x in bad.nonzero()[0])
    cu = support.cu_seqlens.long()
    r = t - (T - int(cu[b + 1] - cu[b]))
    which = "masked-in tokens (the loss mask's)" if loss_tokens else "the response tokens"
    raise ValueError(
        f"support_ids: expected ids in [-1, {V}) (-1: padding) on {which}, got "
        f"{int(ids[b, t, j])} at index [{b}, {t}, {j}] of the batch's support "
        f"({SUPPORT_FIELD}: sequence {b}'s row {r}, values row {int(cu[b]) + r}, slot {j}); "
        f"checked for the whole batch before its first micro-batch: nothing was computed")


SP_PADDED = (
    "{option}={sp} with trainer.remove_microbatch_padding=false: gbc's SkyRL workers run "
    "Ulysses sequence parallelism on SkyRL's packed micro-batches only (SkyRL's default, "
    "trainer.remove_microbatch_padding=true; SkyRL's own critic requires it too): set "
    "trainer.remove_microbatch_padding=true")
SP_COV = (
    "trainer.algorithm.policy_loss_type: clip_cov / kl_cov select tokens from the whole "
    "micro-batch (Clip-Cov at random, KL-Cov by covariance rank), which gbc's loss under "
    "Ulysses sequence parallelism (trainer.policy.sequence_parallel_size={sp}) does not "
    "reproduce: choose another policy_loss_type or set trainer.policy.sequence_parallel_size=1")


class _UlyssesSlice:
    """SkyRL's Ulysses sequence parallelism on a packed micro-batch (``HFModelWrapper.forward``
    with ``sequence_parallel_size > 1``): the packed stream ``pk`` (:func:`hf.pack_padded`) is
    padded to a multiple of the SP size and this rank runs its slice (SkyRL's
    ``ulysses_pad_and_slice_inputs``); :meth:`hidden` maps the slice's hidden states to the
    ``[B, T]`` rows this rank holds (:attr:`owned`; row 0 elsewhere)."""

    def __init__(self, pk, group, size):
        import torch.distributed as dist
        from skyrl.backends.skyrl_train.distributed.ulysses.utils import (
            ulysses_pad_and_slice_inputs)

        self.group, self.size = group, size
        self.input_ids, self.position_ids, _, _ = ulysses_pad_and_slice_inputs(
            pk.input_ids, pk.position_ids, None, size)
        n = self.input_ids.shape[1]
        start = dist.get_rank(group) * n
        here = (pk.index >= start) & (pk.index < start + n)
        self.owned = pk.valid & here
        self.index = torch.where(self.owned, pk.index - start, torch.zeros_like(pk.index))

    def hidden(self, h):
        """The slice's hidden states ``[1, n, H]`` -> ``[B, T, H]`` (row 0 where not owned)."""
        return h[0, self.index]

    def whole(self, values):
        """This rank's ``[B, T]`` values at :attr:`owned` -> every position's (SP group sum)."""
        from gbc_kernels.sequence_parallel import owned_sum

        return owned_sum(values, self.owned, self.group)


def _sp_group(wrapper, option):
    """SkyRL's Ulysses SP group of the wrapped model, or None (size 1). Refuses the padded
    layout under SP (:data:`SP_PADDED`) naming ``option``."""
    sp = int(getattr(wrapper, "sequence_parallel_size", 1) or 1)
    if sp <= 1:
        return None
    if not getattr(wrapper, "remove_microbatch_padding", False):
        raise ValueError(SP_PADDED.format(option=option, sp=sp))
    from skyrl.backends.skyrl_train.distributed.ulysses.utils import (
        get_ulysses_sequence_parallel_group)

    group = get_ulysses_sequence_parallel_group()
    if group is None:
        raise ValueError(f"{option}={sp}: SkyRL's Ulysses group is not set (its worker's "
                         f"init_model sets it)")
    return group


def _position_ids(attention_mask):
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)


def _check_wrapper(wrapper, num_actions, experience=None):
    """Refuse what the fused path does not run, naming SkyRL's option; returns T."""
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
    """The methods act on RL advantages (and critical-token KL on the KL term): refused on
    SkyRL's SFT loss."""
    if loss_type == "cross_entropy":
        for name in ("ar_alpha", "lopti_eta", "nthr", "critical_kl_exponent"):
            if getattr(options, name) not in (0.0, None, False):
                raise ValueError(f"{OPTIONS_ENV}: {name} acts on RL advantages; SkyRL's "
                                 f"cross_entropy (SFT) loss has none")


def _temperature(cfg):
    t = cfg.algorithm.temperature
    return 1.0 if t is None else float(t)


def step_metrics(algo, loss_type, token_out, mask, loss_mask, advantages, old_log_probs,
                 base_log_probs, rollout_logprobs, options, phase=None, scale=None):
    """``(logp, metrics)`` of one micro-batch of gbc's step, as SkyRL's workers report them:
    ``logp`` the ``[B, T]`` log-probs (``token_out["logp"]`` in the advantages' dtype, NaN
    outside ``mask``); ``policy_loss`` and ``loss_metrics/*`` by SkyRL's registered loss
    ``loss_type`` on them (the methods' advantages: AR/Lopti's, NTHR's token ``scale``; the
    random state left as it was), ``policy_entropy`` (masked mean of
    ``token_out["entropy"]``; RL only), ``policy_kl`` (SkyRL's ``compute_approx_kl``, 0.0
    without ``use_kl_loss``; RL only) and SkyRL's rollout log-prob diff metrics. Shared by
    the FSDP worker and the Megatron wrapper (:mod:`.megatron`)."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import (PolicyLossRegistry,
                                                            compute_approx_kl)
    from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean
    from skyrl.backends.skyrl_train.workers.worker_utils import (
        compute_minibatch_rollout_logprob_diff_metrics)

    sft = loss_type == "cross_entropy"
    lp = token_out["logp"].to(advantages.dtype)
    logp = torch.where(mask, lp, torch.full_like(lp, float("nan")))
    lp0 = torch.where(mask, logp, torch.zeros_like(logp))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        adv = advantages if sft else methods.loss_advantages(advantages, old_log_probs,
                                                             options, phase)
        if scale is not None:    # NTHR's scale of a token's loss: of its advantage here
            adv = adv * scale.to(adv.dtype)
        policy_loss, loss_metrics = PolicyLossRegistry.get(loss_type)(
            lp0, old_log_probs, adv, config=algo, loss_mask=loss_mask,
            rollout_logprobs=rollout_logprobs)
    out = {"policy_loss": policy_loss.item()}
    if sft:
        return logp, out
    out["policy_entropy"] = masked_mean(token_out["entropy"].to(lp0.dtype), loss_mask).item()
    if losses.get(algo, "use_kl_loss", False):
        kl = compute_approx_kl(lp0, base_log_probs, loss_mask=loss_mask,
                               kl_estimator_type=algo.kl_estimator_type)
        out["policy_kl"] = masked_mean(kl, loss_mask, dim=-1).mean().item()
    else:
        out["policy_kl"] = 0.0
    for k, v in loss_metrics.items():
        out["loss_metrics/" + k] = v
    out.update(compute_minibatch_rollout_logprob_diff_metrics(lp0, rollout_logprobs, loss_mask))
    return logp, out


# Lopti: a phase's micro-step logs the batch's terms without the split under SkyRL's names and
# its own (the phase's step) under this prefix; gbc's forward_backward sorts them (:func:`lopti_metrics`)
PHASE_KEY = "gbc_phase/"


def unsplit_loss_value(token_out, call, cfg, ref_logp=None, token_scale=None,
                       kl_weight=None) -> float:
    """Lopti: the value gbc's loss has without the split (every loss token once, the same
    normalisers; AR's and NTHR's weights as in the phase), from the per-token values the
    phase's sweep returned (``token_out``: ``logp``, ``entropy``, every position's), no
    vocabulary work; the random state left as it was."""
    import dataclasses

    import gbc_kernels as gbc

    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        value, _ = gbc.policy_loss(token_out["logp"], **call, ref_logp=ref_logp,
                                   entropy=token_out.get("entropy"), token_scale=token_scale,
                                   kl_weight=kl_weight,
                                   config=dataclasses.replace(cfg, lopti_eta=None))
    return float(value)


def lopti_terms(status, unsplit, final_loss):
    """A Lopti phase's micro-step metrics: the phase's own terms (``status``) kept under
    :data:`PHASE_KEY`, SkyRL's names given the batch's terms without the split (``unsplit``:
    :func:`step_metrics` with no phase; ``final_loss``: :func:`unsplit_loss_value`'s, as SkyRL
    reports it)."""
    out = dict(status)
    for k, v in dict(unsplit, final_loss=final_loss).items():
        if k in status:
            out[PHASE_KEY + k] = status[k]
            out[k] = v
    return out


def lopti_metrics(first, second, m1, m2):
    """The metrics of gbc's Lopti step of SkyRL's ``forward_backward`` from its phases'
    (``m1`` then ``m2``, phases ``first`` / ``second``; :func:`lopti_terms`): each logged term
    the batch's without the split at the parameters before the first update (what the step
    without Lopti logs: every loss token once, SkyRL's normalisers), computed in the first
    phase; the rest (``policy_lr``, ...) the second phase's; each phase's own step under
    ``gbc_lopti_<phase>/``."""
    def own(m):
        return {**{k: v for k, v in m.items() if not k.startswith(PHASE_KEY)},
                **{k[len(PHASE_KEY):]: v for k, v in m.items() if k.startswith(PHASE_KEY)}}

    out = {k: v for k, v in m2.items() if not k.startswith(PHASE_KEY)}
    out.update({k[len(PHASE_KEY):]: m1[k[len(PHASE_KEY):]] for k in m1
                if k.startswith(PHASE_KEY)})
    out.update({f"gbc_lopti_{first}/{k}": v for k, v in own(m1).items()})
    out.update({f"gbc_lopti_{second}/{k}": v for k, v in own(m2).items()})
    return out


def response_mask(experience):
    """An experience's response mask: SkyRL 0.4's ``response_mask``, 0.3's ``action_mask``."""
    for name in ("response_mask", "action_mask"):
        value = getattr(experience, name, None)
        if value is not None:
            return value
    return None


def loss_fn_outputs(logp, action_mask, sft, loss_mask, per_token=True):
    """SkyRL's per-sequence ``loss_fn_outputs`` (``logprobs``; ``elementwise_loss`` for its
    SFT loss) of a micro-batch; gbc computes no log-prob outside the loss mask: NaN there.
    ``per_token=False`` (SkyRL 0.4's ``return_per_token_outputs=False``): one empty dict per
    row, as SkyRL's own worker gives."""
    if not per_token:
        return [{} for _ in range(logp.shape[0])]
    am = action_mask
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


def method_fields(fields, opts, cfg, device):
    """NTHR's token scales and critical-token KL's weights of a micro-batch (``fields``: what
    it carries from SkyRL's training batch, :data:`CARRIED`), None where the method is off;
    a method that is on and finds nothing stops, naming it."""
    scale = kl_weight = None
    if opts.nthr:
        scale = fields.get(SCALE_KEY)
        if scale is None:
            raise ValueError(f"{OPTIONS_ENV}: nthr: the micro-batch has no token scales "
                             f"('{SCALE_KEY}'; gbc's forward_backward adds them)")
        scale = scale.to(device)
    if opts.critical_kl_exponent is not None and cfg.kl_coef:
        kl_weight = fields.get(KL_WEIGHT_KEY)
        if kl_weight is None:
            raise ValueError(
                f"{OPTIONS_ENV}: critical_kl_exponent: the training batch has no "
                f"critical-token KL weights ('{KL_WEIGHT_KEY}', from gbc's reference "
                f"worker through gbc's trainer: call gbc_kernels.integrations.skyrl."
                f"enable() in the process that runs SkyRL's trainer)")
        kl_weight = kl_weight.to(device)
    return scale, kl_weight


def keep_rows(keep, seq, attn, rows, targets, valid, head, logit_softcap, temperature, logp,
              vocab_parallel=None, support_ids=None):
    """A micro-batch of SkyRL's old-log-prob pass into NTHR's kept rows (``keep``:
    :attr:`GBCMethodsMixin._gbc_keeping`): each row's key (:func:`row_keys` of ``seq`` /
    ``attn``) and its response rows ``rows [B, T, H]``, ``targets``, ``valid`` and the pass's
    ``logp`` ``[B, T]`` (:meth:`gbc_kernels.methods.NTHRBatch.add`; ``vocab_parallel``: the
    head is this rank's vocabulary slice). ``support_ids`` (SkyRL 0.4's replay: ``logp`` is
    then over each token's support): the micro-batch's ``[B, T, k]`` support, kept beside the
    rows (:meth:`gbc_kernels.methods.NTHRBatch.add`: NTHR then scored over it)."""
    start = len(keep["keys"])
    keep["keys"] += row_keys(seq, attn)
    keep["device"] = rows.device
    extra = {} if support_ids is None else {"support_ids": support_ids}
    keep["batch"].add(torch.arange(start, start + seq.shape[0]), rows, targets, valid, head,
                      logit_softcap, temperature, vocab_parallel=vocab_parallel, logp=logp,
                      **extra)


class GBCOptionsMixin:
    """The method options of a gbc SkyRL worker (FSDP or Megatron)."""

    _gbc_options: Optional[methods.MethodOptions] = None

    @property
    def gbc_options(self) -> methods.MethodOptions:
        """The method options (``GBC_SKYRL_OPTIONS`` in the worker's environment)."""
        if self._gbc_options is None:
            self._gbc_options = method_options()
        return self._gbc_options


class _UlyssesHeads(GBCOptionsMixin):
    _gbc_sp_option = "trainer.policy.sequence_parallel_size"     # SkyRL's option of the worker

    def _seq_parallel_monkey_patch(self, model, *args, **kwargs):
        """SkyRL's Ulysses set-up (the FSDP ``init_model``), after gbc's check that the SP
        size divides the model's heads (SkyRL asserts it there), naming SkyRL's option."""
        from gbc_kernels.sequence_parallel import check_heads

        check_heads(model.config, self.sequence_parallel_size,
                    self._gbc_sp_option)
        return super()._seq_parallel_monkey_patch(model, *args, **kwargs)


class GBCMethodsMixin(GBCOptionsMixin):
    """The method layer of gbc's SkyRL policy workers, FSDP and Megatron alike (put before
    SkyRL's policy worker class): Lopti's two optimizer steps of SkyRL's own
    ``forward_backward``, NTHR's rows kept by SkyRL's old-log-prob ``forward`` and scored per
    training mini-batch. The backend's micro-step reads :attr:`_gbc_phase` and the carried
    fields; it adds a micro-batch's rows to :attr:`_gbc_keeping` (:func:`keep_rows`)."""

    _gbc_phase: Optional[str] = None
    # NTHR: the rows being kept during one call of SkyRL's old-log-prob pass
    # ({"batch": NTHRBatch, "keys": row keys, "device": where computed}), and what the calls
    # of the current batch kept (one per call: SkyRL runs that pass per mini-batch under
    # trainer.recompute_old_logprobs_per_minibatch), until a pass after an update
    _gbc_keeping: Optional[dict] = None
    _gbc_nthr_kept: Optional[list] = None
    _gbc_nthr_updated = True

    def _gbc_dp_group(self):
        """The data-parallel group NTHR's groups are gathered over."""
        raise NotImplementedError

    def _gbc_holds_head(self) -> bool:
        """Whether this rank computes the loss (Megatron: the last pipeline stage)."""
        return True

    def _gbc_agree_group(self):
        """The ranks that take NTHR's fallback branch together."""
        return self._gbc_dp_group()

    def forward(self, data, loss_fn=None, loss_fn_config=None, **kwargs):
        """SkyRL's ``forward`` (``kwargs``: SkyRL 0.4's ``return_per_token_outputs``). With
        NTHR on, its old-log-prob pass (no loss: the trainer's
        ``fwd_logprobs_values_reward``) also keeps NTHR's inputs of each row — the response
        hidden states, targets and log-probs, and once the head's rows of the batch's token ids
        (:class:`gbc_kernels.methods.NTHRBatch`) — for the updates of this batch
        (:meth:`forward_backward`); no second forward."""
        if loss_fn is None:         # the no-grad pass: the whole batch's support first
            check_replay_batch(self, data, loss_tokens=False)
        if loss_fn is not None or not self.gbc_options.nthr or not self._gbc_holds_head():
            return super().forward(data, loss_fn, loss_fn_config, **kwargs)
        T = int(data.metadata["response_length"])
        if self._gbc_nthr_updated or self._gbc_nthr_kept is None:   # a new batch's pass
            self._gbc_nthr_kept, self._gbc_nthr_updated = [], False
        # under SkyRL 0.4's replay the pass's log-probs are over each token's support, and
        # NTHR's scores too (the support kept with the rows)
        self._gbc_keeping = dict(batch=methods.NTHRBatch(data["sequences"][:, -T:],
                                                         self._gbc_dp_group()),
                                 keys=[], device=None)
        try:
            out = super().forward(data)
            self._gbc_nthr_kept.append(self._gbc_keeping)
        finally:
            self._gbc_keeping = None
        return out

    def offload_to_cpu(self, *args, **kwargs):
        """SkyRL's offload; what the old-log-prob pass kept for NTHR goes to the CPU too."""
        for kept in self._gbc_nthr_kept or ():
            kept["batch"].to("cpu")
        return super().offload_to_cpu(*args, **kwargs)

    @torch.no_grad()
    def _gbc_nthr_scales(self, data) -> dict:
        """NTHR's token scales of this rank's training mini-batch ``data`` from what SkyRL's
        old-log-prob pass kept (each row found by its :func:`row_keys`), into
        ``data["gbc_token_scale"]``; groups: ``data["gbc_group"]`` (SkyRL's ``uids``), each
        group's rows over the data-parallel ranks. Returns NTHR's metrics."""
        keys = row_keys(data["sequences"], data["attention_mask"])
        self._gbc_nthr_updated = True       # the next old-log-prob pass starts a new batch
        holds = self._gbc_holds_head()
        kept = source = None
        for entry in (self._gbc_nthr_kept or ()) if holds else ():   # the call with these rows
            where = {k: i for i, k in enumerate(entry["keys"])}
            source = [where.get(k) for k in keys]
            if None not in source:
                kept = entry
                break
        if not methods.every_rank(kept is not None or not holds, self._gbc_agree_group()):
            raise ValueError(
                f"{OPTIONS_ENV}: nthr: a row of this training mini-batch was not in this rank's "
                f"old-log-prob pass (SkyRL's policy forward before the advantages), whose hidden "
                f"states NTHR scores: SkyRL split the batch over the ranks otherwise than the "
                f"update, or ran no such pass for it: set trainer."
                f"recompute_old_logprobs_per_minibatch=true (SkyRL's default)")
        if GROUP_KEY not in data.keys() or data[GROUP_KEY] is None:
            raise ValueError(f"{OPTIONS_ENV}: nthr: the training batch has no '{GROUP_KEY}' "
                             f"(SkyRL's uids as group ids, added by gbc's trainer: call "
                             f"gbc_kernels.integrations.skyrl.enable() in the process that "
                             f"runs SkyRL's trainer)")
        if not holds:           # a Megatron stage before the last: no loss, no scales
            return {}
        batch = copy.copy(kept["batch"])          # the kept rows serve every mini-batch/epoch
        batch.temperatures = set(batch.temperatures)
        batch.take(torch.tensor(source, dtype=torch.long))
        batch.to(kept["device"])
        res, metrics = batch.result(data["loss_mask"], data[GROUP_KEY], data["advantages"],
                                    self.gbc_options)
        data[SCALE_KEY] = res.scale.float().cpu()
        out = {f"gbc_{k}": float(v) for k, v in metrics.items()}
        out["gbc_nthr_kept_mb"] = sum(e["batch"].nbytes() for e in self._gbc_nthr_kept) / 2 ** 20
        out["gbc_nthr_second_forward"] = 0.0
        return out

    def forward_backward(self, data, loss_fn=None, loss_fn_config=None, **kwargs):
        """SkyRL's ``forward_backward`` (``kwargs``: SkyRL 0.4's ``return_per_token_outputs``);
        with NTHR on, the mini-batch's token scales first
        (:meth:`_gbc_nthr_scales`); under Lopti, the first phase's forward-backward and
        optimizer step run here and the second phase's forward-backward returns (SkyRL's
        trainer then takes its optimizer step): two optimizer steps of SkyRL's own step,
        with the old log-probs of the batch fixed for both."""
        carry_fields()
        _check_sft(self.gbc_options, loss_fn or self.cfg.algorithm.policy_loss_type)
        # under replay the whole batch's support, before its first micro-batch (and Lopti's
        # first optimizer step): a refusal changes no gradient, parameter or optimizer state
        check_replay_batch(self, data, loss_tokens=True)
        nthr = self._gbc_nthr_scales(data) if self.gbc_options.nthr else {}
        phases = self.gbc_options.phases
        if phases == (None,):
            out = super().forward_backward(data, loss_fn, loss_fn_config, **kwargs)
            out.metrics.update(nthr)
            return out
        first, second = phases
        self._gbc_phase = first
        try:
            out1 = super().forward_backward(data, loss_fn, loss_fn_config, **kwargs)
            self.optim_step()
            self._gbc_phase = second
            out2 = super().forward_backward(data, loss_fn, loss_fn_config, **kwargs)
        finally:
            self._gbc_phase = None
        metrics = lopti_metrics(first, second, out1.metrics, out2.metrics)
        out2.metrics.clear()                # SkyRL's WorkerOutput is frozen; its dict is not
        out2.metrics.update(metrics, **nthr)
        return out2


class GBCPolicyWorkerMixin(GBCMethodsMixin, _UlyssesHeads):
    """Put before SkyRL's FSDP policy worker class (``class W(GBCPolicyWorkerMixin,
    FSDPPolicyWorkerBase)``): its training micro-step and no-grad pass run gbc's."""

    def __init__(self, *args, **kwargs):
        cfg = kwargs.get("cfg", args[0] if args else None)
        self._gbc_options = check_config(cfg)      # before SkyRL's own look-ups
        super().__init__(*args, **kwargs)

    def _gbc_dp_group(self):
        return methods.data_parallel_group(self.device_mesh.get_group("dp"))

    def _forward_backward_micro(self, experience, microbatch_weight, loss_fn=None,
                                loss_fn_config=None, return_per_token_outputs=True):
        _check_sft(self.gbc_options, loss_fn or self.cfg.algorithm.policy_loss_type)
        if loss_fn_config:
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
        scale, kl_weight = method_fields(experience.info or {}, opts, cfg, call["mask"].device)
        replay = {}
        if _replays(self.cfg):          # SkyRL 0.4: log-probs and entropy over the support
            replay["support_ids"] = replay_support_ids(
                getattr(experience, SUPPORT_FIELD, None), loss_mask, experience.attention_mask,
                T)
        token_out = {}
        loss, loss_m, whole = _policy_loss(
            self.model, experience.sequences, experience.attention_mask, T, call,
            ref_logp=experience.base_action_log_probs if cfg.kl_coef else None, config=cfg,
            phase=self._gbc_phase, token_scale=scale, kl_weight=kl_weight, token_out=token_out,
            **replay)
        self.strategy.backward(loss * dp, self.model, self.optimizer)
        token_out = {k: whole(v) for k, v in token_out.items()}

        logp, m = step_metrics(algo, loss_type, token_out, call["mask"], loss_mask,
                               experience.advantages, experience.action_log_probs,
                               experience.base_action_log_probs, experience.rollout_logprobs,
                               opts, self._gbc_phase, scale)
        outputs = loss_fn_outputs(logp, response_mask(experience), sft, loss_mask,
                                  return_per_token_outputs)
        if sft:
            return {"loss": m["policy_loss"], "response_length": experience.num_actions,
                    "lr": self.scheduler.get_last_lr()[0], "loss_fn_outputs": outputs}
        status = {"final_loss": loss.item(), "policy_loss": m.pop("policy_loss"),
                  "policy_entropy": m.pop("policy_entropy"),
                  "response_length": experience.num_actions,
                  "policy_lr": self.scheduler.get_last_lr()[0], "loss_fn_outputs": outputs}
        if not algo.use_kl_loss:
            m.pop("policy_kl")
        status.update(m)
        if replay:      # the share of loss tokens whose target the sampler's row lacked
            status["gbc_support_forced_frac"] = float(loss_m["support_forced_frac"])
        if self._gbc_phase is not None:     # Lopti: the batch's terms without the split
            _, whole_m = step_metrics(algo, loss_type, token_out, call["mask"], loss_mask,
                                      experience.advantages, experience.action_log_probs,
                                      experience.base_action_log_probs,
                                      experience.rollout_logprobs, opts, None, scale)
            final = status["final_loss"] + unsplit_loss_value(
                token_out, call, cfg,
                experience.base_action_log_probs if cfg.kl_coef else None, scale,
                kl_weight) - loss.item()
            status = lopti_terms(status, whole_m, final)
        return status

    def _forward_micro_batch(self, micro_batch):
        return _no_grad_logprobs(self, micro_batch, _temperature(self.cfg),
                                 keep=self._gbc_keeping, replay=_replays(self.cfg))


class GBCRefWorkerMixin(_UlyssesHeads):
    """Put before SkyRL's reference worker class: its log-prob pass runs gbc's; with
    critical-token KL on, the same pass gives the KL weights."""

    _gbc_sp_option = "trainer.ref.sequence_parallel_size"

    def forward(self, data):
        """SkyRL's reference ``forward``; with critical-token KL on, each sample's
        ``loss_fn_outputs`` also carries its weights under :data:`KL_WEIGHT_KEY` (beside
        ``logprobs``), from the same pass (:func:`gbc_kernels.methods.reference_stats`)."""
        check_replay_batch(self, data, loss_tokens=False)    # the whole batch's support first
        if self.gbc_options.critical_kl_exponent is None:
            return super().forward(data)
        from skyrl.backends.skyrl_train.distributed.dispatch import WorkerOutput
        from skyrl.backends.skyrl_train.workers.worker_utils import get_microbatch_iterator

        batches = get_microbatch_iterator(
            data, micro_batch_size=self.cfg.micro_forward_batch_size_per_gpu,
            max_tokens_per_microbatch=self.cfg.max_tokens_per_microbatch)
        out = batches.reorder_and_combine_batches(
            [self._forward_micro_batch(mb) for mb in batches])
        lp, w = out["output"].cpu(), out[KL_WEIGHT_KEY].cpu()
        return WorkerOutput(loss_fn_outputs=[
            {"logprobs": lp[i].tolist(), KL_WEIGHT_KEY: w[i].tolist()}
            for i in range(lp.shape[0])], metrics={})

    def _forward_micro_batch(self, micro_batch):
        opts = self.gbc_options
        # under SkyRL 0.4's replay the reference is scored over the sampler's support at the
        # policy's temperature (SkyRL's "support-conditioned KL"); else at temperature 1
        replay = _replays(self.cfg)
        return _no_grad_logprobs(self, micro_batch, _temperature(self.cfg) if replay else 1.0,
                                 reference=opts if opts.critical_kl_exponent is not None
                                 else None, replay=replay)


def _policy_loss(wrapper, seq, attn, T, call, **kwargs):
    """gbc's fused loss inside the wrapped model's forward, on SkyRL's layout: padded rows, or
    (``trainer.remove_microbatch_padding``) the micro-batch packed into one row at its
    per-sequence positions without an attention mask, as ``HFModelWrapper.forward`` runs it
    (flash-attention's varlen kernels find the sequences' boundaries); under Ulysses SP
    (packed only) this rank's slice of the packed stream, the loss's sequence terms reduced
    over the SP group (:class:`gbc_kernels.SequenceParallel`). Returns ``(loss, metrics,
    whole)``: ``whole`` maps a per-token output of the loss (``token_out``) to every
    position's. Under SP the loss has the whole micro-batch's value and, as SkyRL's gather of
    the log-probs does, the SP size times the rank's share's gradient."""
    if not getattr(wrapper, "remove_microbatch_padding", False):
        _sp_group(wrapper, "trainer.policy.sequence_parallel_size")     # refused under SP
        loss, metrics = hf.policy_loss_through_forward(
            wrapper.model, seq, attn, T, model_kwargs={"position_ids": _position_ids(attn)},
            **call, **kwargs)
        return loss, metrics, lambda v: v
    hf.check_forward_inputs(hf.unwrap(wrapper.model), seq, attn, T, "response_length")
    pk = hf.pack_padded(seq, attn, T, call["mask"])
    group = _sp_group(wrapper, "trainer.policy.sequence_parallel_size")
    if group is None:
        loss, metrics = hf.packed_policy_loss_through_forward(
            wrapper.model, pk.input_ids, pk.position_ids, pk.hidden, seq[:, -T:], **call,
            **kwargs)
        return loss, metrics, lambda v: v
    import gbc_kernels as gbc
    from gbc_kernels.sequence_parallel import whole_loss

    if kwargs["config"].cov_mode is not None:
        raise ValueError(SP_COV.format(sp=wrapper.sequence_parallel_size))
    sl = _UlyssesSlice(pk, group, wrapper.sequence_parallel_size)
    call = dict(call, mask=call["mask"].bool() & sl.owned)
    loss, metrics = hf.packed_policy_loss_through_forward(
        wrapper.model, sl.input_ids, sl.position_ids, sl.hidden, seq[:, -T:], **call,
        sequence_parallel=gbc.SequenceParallel(group), **kwargs)
    return whole_loss(loss, group, sl.size), metrics, sl.whole


def _no_grad_logprobs(worker, micro_batch, temperature, reference=None, keep=None,
                      replay=False):
    """SkyRL's ``_forward_micro_batch`` by gbc's row passes: ``[B, T]`` log-probs of the
    responses (float32), no logits. Packed (``trainer.remove_microbatch_padding``): SkyRL's
    packed values — the log-prob of the packed stream's next token, 0 where the token before
    is padding. ``reference``: the method options; the critical-token KL weights too
    (``KL_WEIGHT_KEY``, the same sweep). ``keep``: the old-log-prob pass's NTHR rows
    (:meth:`GBCPolicyWorkerMixin.forward`), this micro-batch's added. ``replay`` (SkyRL 0.4's
    ``enable_sample_support_replay``): over each token's support, the micro-batch's
    ``rollout_sample_support`` (:func:`replay_support_ids`)."""
    import gbc_kernels as gbc
    from skyrl.backends.skyrl_train.training_batch import TrainingOutputBatch

    micro_batch.to(torch.cuda.current_device())
    worker.model.eval()
    T = _check_wrapper(worker.model, micro_batch.metadata["response_length"])
    if micro_batch.get("pixel_values", None) is not None:
        raise ValueError("model: gbc's SkyRL worker runs text-only causal LMs (vision inputs "
                         "given)")
    seq, attn = micro_batch["sequences"], micro_batch["attention_mask"]
    targets = seq[:, -T:]
    inner = hf.unwrap(worker.model.model)
    hf.check_forward_inputs(inner, seq, attn, T, "response_length")
    packed = getattr(worker.model, "remove_microbatch_padding", False)
    group = _sp_group(worker.model, worker._gbc_sp_option)
    support = None
    if replay:
        support = replay_support_ids(micro_batch.get(SUPPORT_FIELD, None),
                                     micro_batch.get("loss_mask", None), attn, T)
    pk = hf.pack_padded(seq, attn, T) if packed else None
    sl = None if group is None else _UlyssesSlice(pk, group, worker.model.sequence_parallel_size)

    def compute(h, head, cap):
        rows, ys = ((sl.hidden(h) if sl is not None else pk.hidden(h), pk.rolled) if packed
                    else (h, targets))
        if reference is not None:       # under replay: the certainty over the support too
            st = methods.reference_stats(rows, head.weight, ys, reference, head.bias,
                                         temperature=temperature, logit_softcap=cap,
                                         support_ids=support)
            logp, weight = st.ref_logp, st.kl_weight
        else:
            logp = gbc.token_stats(rows, head.weight, ys, head.bias, temperature=temperature,
                                   logit_softcap=cap,
                                   logits_dtype=worker.gbc_options.logits_dtype,
                                   support_ids=support).logp
            weight = None
        if keep is not None:      # the response rows of this pass, for NTHR's scores
            valid = attn[:, -T:].bool() & (pk.valid if packed else True)
            # under Ulysses SP every rank of the group keeps the whole micro-batch's rows (each
            # position's hidden state and log-prob from the rank that holds it)
            whole = (lambda v: v) if sl is None else sl.whole
            keep_rows(keep, seq, attn, whole(rows), targets, valid, head, cap, temperature,
                      whole(logp), support_ids=support)
        if sl is not None:       # this rank's positions -> every position's
            logp = sl.whole(logp)
            weight = None if weight is None else sl.whole(weight)
        if packed:
            logp = logp.masked_fill(~pk.valid, 0.0)
            weight = None if weight is None else weight.masked_fill(~pk.valid, 0.0)
        return logp, weight

    with torch.no_grad():
        if packed:
            ids, pos = (pk.input_ids, pk.position_ids) if sl is None else (sl.input_ids,
                                                                          sl.position_ids)
            logp, weight = hf.in_head(worker.model.model, ids, None, None,
                                      {"position_ids": pos}, compute, inner)
        else:
            logp, weight = hf.in_head(worker.model.model, seq, attn, T,
                                      {"position_ids": _position_ids(attn)}, compute, inner)
    fields = {"output": logp.float().to("cpu")}
    if weight is not None:
        fields[KL_WEIGHT_KEY] = weight.float().to("cpu")
    out = TrainingOutputBatch(fields)
    out.metadata = micro_batch.metadata
    return out
