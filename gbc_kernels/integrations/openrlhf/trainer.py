"""The hooks :func:`gbc_kernels.integrations.openrlhf.enable` patches into OpenRLHF and their
state: ``Actor.forward``'s no-grad passes, the replay buffer's ``append``,
``ActorPPOTrainer.ppo_train`` (the start-up checks and NTHR's pass) and its
``training_step`` (the fused loss and the methods); docs/openrlhf.md.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import torch
from torch.nn.utils.rnn import pad_sequence

from gbc_kernels import methods
from .. import hf, patching
from .actor import (_inner_model, _position_ids, _ring_group, fused_action_log_probs,
                    fused_actor_loss, packed_rows)
from .losses import ENV_OPTIONS, _get, rollout_truncation


# what the experience carries for gbc, in its ``info`` (split and merged with the samples)
INDEX_KEY, SCALE_KEY, KL_WEIGHT_KEY = "gbc_index", "gbc_nthr_scale", "gbc_kl_weight"
KEPT_MASS_KEY = "gbc_log_kept_mass"          # support=kept_mass: the old policy's LSE_S - LSE_V
# support=replay, one set per rollout: each sample's kept ids as the old-policy pass built
# them, in methods.compact_support_ids' form trimmed to the sample ([t + its ids], int32), and
# its t (the experience maker's micro-batch width)
SUPPORT_IDS_KEY, SUPPORT_T_KEY = "gbc_support_ids", "gbc_support_ids_t"
GBC_INFO_KEYS = (INDEX_KEY, SCALE_KEY, KL_WEIGHT_KEY, KEPT_MASS_KEY, SUPPORT_IDS_KEY,
                 SUPPORT_T_KEY)

# the attribute of a model that holds the OpenRLHF arguments its strategy prepared it with
# (the sampling settings the no-grad passes rebuild the sampler's kept set from)
ARGS_ATTR = "gbc_args"

# the attribute of a replay-buffer sample that holds NTHR's inputs kept from the experience
# maker's actor pass (a methods.NTHRKeptRow; not an Experience field: it stays on the sample)
KEPT_ATTR = "gbc_nthr_kept"

_STATE = SimpleNamespace(options={}, methods=methods.MethodOptions(), nthr_heads=None,
                         nthr_pending=[], kept_mass_pending=[], kept_mass_actor=False,
                         support_pending=[], support_actor=False, support_given=None)
_PATCHES = patching.Patches()


def _is_reference(actor) -> bool:
    """Whether this ``Actor`` is the reference model: a DeepSpeed engine without an optimizer,
    or marked ``gbc_reference``."""
    mark = getattr(actor, "gbc_reference", None)
    if mark is not None:
        return bool(mark)
    engine = getattr(actor, "model", None)
    return hasattr(engine, "module") and hasattr(engine, "optimizer") and engine.optimizer is None


def support_truncation(actor, args=None):
    """The sampler's kept-set settings (``support=...``) for a pass of ``actor``: from ``args``
    or the OpenRLHF arguments its strategy prepared it with (:data:`ARGS_ATTR`), at the
    actor's temperature; None when ``support`` is off. Refused by name when there are none."""
    opts = _STATE.methods
    if opts.support is None:
        return None
    args = getattr(actor, ARGS_ATTR, None) if args is None else args
    if args is None:
        raise ValueError(f"support={opts.support}: this Actor carries no OpenRLHF arguments "
                         f"(the rollout's rollout.top_p and rollout.temperature, which the kept "
                         f"set is rebuilt from): enable() must run before OpenRLHF's strategy "
                         f"prepares the model (with Ray: the workers' worker_process_setup_hook), "
                         f"or set actor.{ARGS_ATTR} = args")
    return rollout_truncation(args, opts, getattr(actor, "temperature", 1.0))


def _strategy_prepare(self, *models):
    """``DeepspeedStrategy.prepare`` that first hands each model the strategy's arguments
    (:data:`ARGS_ATTR`): the sampling settings of ``support``'s no-grad passes."""
    for item in models:
        model = item[0] if isinstance(item, tuple) else item
        if model is not None:
            setattr(model, ARGS_ATTR, self.args)
    return _PATCHES.original(type(self), "prepare")(self, *models)


def _pending_inputs(sequences, action_mask, attention_mask):
    return [t.detach().cpu() for t in (sequences, action_mask, attention_mask)]


def _actor_forward(self, sequences, action_mask=None, attention_mask=None, *args, **kwargs):
    """``Actor.forward`` with the no-grad log-prob pass fused (the reference model's, with
    critical-token KL: ``[B, T, 2]``, unpacked by the buffer's ``append``). Under ``support``
    the pass rebuilds the sampler's kept set: ``replay`` with one set per rollout (the
    default), the policy's pass (the experience maker's old-policy pass) builds it, scores
    over it and keeps its ids until the buffer's ``append`` takes them; the reference pass
    scores over the ids the driver handed its worker (:func:`_worker_forward`; none:
    :data:`REFERENCE_REFUSAL`); ``replay`` with ``support_set=per_pass``, the
    log-probs over the set each pass rebuilds (policy and reference); ``kept_mass``, the
    policy's pass also keeps its ``log_kept_mass`` until the buffer's ``append`` takes it."""
    rest = {k: v for k, v in kwargs.items() if k not in ("ring_attn_group", "packed_seq_lens")}
    plain = (action_mask is not None and not args and not torch.is_grad_enabled()
             and all(v is None or v is False for v in rest.values()))
    reference = _is_reference(self)
    weights = _STATE.methods.critical_kl_exponent is not None and reference
    support = _STATE.methods.support
    if plain:
        keep = None
        if _STATE.methods.nthr and not reference:     # the experience maker's actor pass
            if _STATE.nthr_heads is None:
                _STATE.nthr_heads = methods.NTHRHeadRows("cpu")
            keep = (_STATE.nthr_heads, [])
        kept_mass = support == "kept_mass" and not reference
        one_set = _STATE.methods.one_set_per_rollout
        build = one_set and not reference
        given = None
        if one_set and reference:         # the actor's set, handed over by the driver
            given = _STATE.support_given
            if given is None:
                raise ValueError(REFERENCE_REFUSAL)
            if tuple(given.shape[:2]) != tuple(action_mask.shape):
                raise ValueError(f"{ONE_SET}: the kept ids handed to the reference pass are "
                                 f"for {list(given.shape[:2])} action tokens, this micro-batch "
                                 f"has {list(action_mask.shape)}")
            given = given.to(action_mask.device)
        tr = None if support is None or given is not None or \
            (reference and support == "kept_mass") else support_truncation(self)
        out = fused_action_log_probs(self, sequences, action_mask, attention_mask,
                                     options=_STATE.methods if weights else None,
                                     ring_attn_group=kwargs.get("ring_attn_group"),
                                     packed_seq_lens=kwargs.get("packed_seq_lens"),
                                     nthr_keep=keep, logits_dtype=_STATE.methods.logits_dtype,
                                     sampler_truncation=tr, over_support=not kept_mass,
                                     return_log_kept_mass=kept_mass, return_support_ids=build,
                                     support_ids=given)
        if build:                                     # until the buffer's append takes them
            out, ids = out
            _STATE.support_actor = True
            _STATE.support_pending.append((_pending_inputs(
                sequences, action_mask, attention_mask), ids.detach().cpu()))
        if kept_mass:                                 # until the buffer's append takes it
            out, lk = out
            _STATE.kept_mass_actor = True
            _STATE.kept_mass_pending.append((_pending_inputs(
                sequences, action_mask, attention_mask), lk.detach().cpu()))
        if keep is not None:                          # until the buffer's append takes it
            _STATE.nthr_pending.append((_pending_inputs(
                sequences, action_mask, attention_mask), keep[1]))
        return out
    if weights:
        raise ValueError("critical_kl_exponent: the reference model's pass is not the plain "
                         "no-grad one (outputs, entropy or multimodal inputs requested): its "
                         "weights cannot be computed there")
    if support is not None and action_mask is not None:
        raise ValueError(f"support={support}: this log-prob pass is not the plain no-grad one "
                         f"(a gradient, outputs, entropy or multimodal inputs requested): the "
                         f"sampler's kept set is rebuilt in gbc's passes only")
    forward = _PATCHES.original(type(self), "forward")
    return forward(self, sequences, action_mask, attention_mask, *args, **kwargs)


# support=replay with one set per rollout, as its refusals name it
ONE_SET = "support=replay, support_set=rollout (the default)"
# ... a reference pass that was handed no kept ids
REFERENCE_REFUSAL = (
    f"{ONE_SET}: the reference model's pass was handed no kept ids: it scores the set the "
    "actor's old-policy pass built, which gbc's patched RemoteExperienceMaker._dispatch_forward "
    "(the driver) takes from the actor workers' results and hands to the reference workers; "
    "enable() must run in the driver process with the same options (e.g. through "
    f"{ENV_OPTIONS}) before OpenRLHF's experience maker dispatches, and the reference pass "
    "must be the experience maker's; or set support_set=per_pass (each pass rebuilds the set "
    "from the model it scores) or algo.kl.init_coef=0 (no reference model)")

# the per-sample keyword arguments gbc's driver adds to the workers' forward under one set per
# rollout with a reference model: the actor's (return the kept ids beside the log-probs) and
# the reference's (each micro-batch's ids, compact_support_ids' form); the attribute of the
# experience maker that holds the actor's ids until the reference's dispatch
RETURN_IDS_KWARG, GIVEN_IDS_KWARG = "gbc_return_support_ids", "gbc_support_ids"
DRIVER_IDS_ATTR = "gbc_support_ids"


def _worker_forward(forward, *args, gbc_return_support_ids=False, gbc_support_ids=None,
                    **kwargs):
    """An OpenRLHF Ray worker's ``forward`` (``forward``, bound) under one set per rollout
    with a reference model, installed on the worker by :func:`_install_worker_forward`. The
    actor worker's (``gbc_return_support_ids``): ``(log-probs, compact ids)``, the ids the
    patched ``Actor.forward`` just built (also kept for the buffer's ``append``); the
    reference worker's (``gbc_support_ids``, compact): the log-probs over those ids."""
    if gbc_support_ids is not None:
        _STATE.support_given = methods.expand_support_ids(torch.as_tensor(gbc_support_ids))
        try:
            return forward(*args, **kwargs)
        finally:
            _STATE.support_given = None
    if not gbc_return_support_ids:
        return forward(*args, **kwargs)
    n = len(_STATE.support_pending)
    out = forward(*args, **kwargs)
    if not _STATE.methods.one_set_per_rollout or len(_STATE.support_pending) != n + 1:
        raise ValueError(f"{ONE_SET}: the actor worker's forward built no kept set (its "
                         f"patched Actor.forward did not run the plain no-grad pass with one "
                         f"set per rollout): enable() must run in the Ray workers with the "
                         f"driver's options (e.g. through {ENV_OPTIONS})")
    return out, methods.compact_support_ids(_STATE.support_pending[-1][1])


def _install_worker_forward(worker):
    """Run on an OpenRLHF Ray worker (Ray's ``__ray_call__``, from the driver): its
    ``forward`` (what ``execute_batch`` looks up) becomes :func:`_worker_forward` over its
    own, once."""
    if getattr(worker, "gbc_own_forward", None) is None:
        worker.gbc_own_forward = worker.forward
        worker.forward = functools.partial(_worker_forward, worker.gbc_own_forward)
    return True


def _dispatch_forward(self, group, sync_condition, **kwargs):
    """``RemoteExperienceMaker._dispatch_forward`` (the driver) under one set per rollout with a
    reference model: the actor group's forward also returns each micro-batch's kept ids
    (OpenRLHF gets its log-prob results as before: every worker's list, ring-attention and
    tensor-parallel copies included), which are handed, per micro-batch, to the reference
    group's forward (``initial_model_group``, dispatched after the actor's: the driver waits
    for the actor's results first). Otherwise OpenRLHF's own."""
    own = _PATCHES.original(type(self), "_dispatch_forward")
    reference = getattr(self, "initial_model_group", None)
    if not _STATE.methods.one_set_per_rollout or reference is None or group is None or \
            group not in (self.actor_model_group, reference):
        return own(self, group, sync_condition, **kwargs)
    import ray

    n = len(next(iter(kwargs.values())))
    ray.get(_on_workers(group))
    if group is self.actor_model_group:
        self.__dict__.pop(DRIVER_IDS_ATTR, None)
        refs = own(self, group, sync_condition, **kwargs, **{RETURN_IDS_KWARG: [True] * n})
        results = ray.get(refs)
        args = self.strategy.args
        dup = int(_get(args, "ds.ring_attn_size", 1) or 1) * \
            int(_get(args, "ds.tensor_parallel_size", 1) or 1)
        ids = [c for chunk in results[::dup] for _, c in chunk]
        if len(ids) != n:
            raise ValueError(f"{ONE_SET}: the actor workers returned kept ids for {len(ids)} "
                             f"micro-batches, not the {n} dispatched")
        setattr(self, DRIVER_IDS_ATTR, ids)
        return [ray.put([logp for logp, _ in chunk]) for chunk in results]
    ids = self.__dict__.pop(DRIVER_IDS_ATTR, None)
    if ids is None or len(ids) != n:
        raise ValueError(f"{ONE_SET}: the reference group's forward was dispatched without "
                         f"the actor group's kept ids for its {n} micro-batches (gbc hands "
                         f"them over in OpenRLHF 0.11.2's make_experience order: the actor's "
                         f"forward first)")
    return own(self, group, sync_condition, **kwargs, **{GIVEN_IDS_KWARG: ids})


def _on_workers(group):
    """:func:`_install_worker_forward` on each of ``group``'s workers (Ray's ``__ray_call__``);
    the refs."""
    try:
        return group.async_run_method("__ray_call__", _install_worker_forward)
    except AttributeError as exc:
        raise ValueError(f"{ONE_SET}: OpenRLHF's Ray workers have no __ray_call__ ({exc}): "
                         f"gbc hands the actor's kept ids to the reference model's workers "
                         f"through it; set support_set=per_pass or algo.kl.init_coef=0") \
            from None


def _compact_rows(ids):
    """Kept ids ``[B, t, K]`` -> each sample's row of ``methods.compact_support_ids`` trimmed
    to its own ids (a list of ``[1 + t + m_b]`` int32) and the list of ``t``: the ``info``
    entries :data:`SUPPORT_IDS_KEY`, :data:`SUPPORT_T_KEY` (split per sample by the buffer)."""
    c = methods.compact_support_ids(ids)
    t = ids.shape[1]
    total = c[:, 1:1 + t].sum(-1)
    return [c[b, :1 + t + int(total[b])].clone() for b in range(len(c))], [t] * len(c)


def _info_support_ids(experience, T):
    """The kept ids the experience carries (:data:`SUPPORT_IDS_KEY`, one row per sample,
    merged by the buffer's collate) as ``support_ids`` ``[B, T, K]`` int32 (missing: refused)."""
    rows, ts = experience.info.get(SUPPORT_IDS_KEY), experience.info.get(SUPPORT_T_KEY)
    B = experience.action_mask.shape[0]
    if rows is None or ts is None:
        raise ValueError(f"{ONE_SET}: the experience carries no kept ids (the "
                         f"experience maker's actor pass in this process builds them and the "
                         f"replay buffer's append stores them: enable() must run in this "
                         f"process with the same options, e.g. through {ENV_OPTIONS})")
    ts = [int(t) for t in torch.as_tensor(ts).reshape(-1)]
    if len(rows) != B or len(ts) != B:
        raise ValueError(f"{ONE_SET}: the experience carries kept ids for "
                         f"{len(rows)} samples, not its {B}")
    parts = []
    for r, t in zip(rows, ts):
        ids = methods.expand_support_ids(torch.as_tensor(r).reshape(1, -1), t)[:, :T]
        parts.append(torch.nn.functional.pad(ids, (0, 0, 0, T - ids.shape[1]), value=-1))
    return methods.join_support_ids(parts).to(experience.action_mask.device)


def _buffer_append(self, experience):
    """``NaiveReplayBuffer.append`` that first keeps NTHR's ``Experience.index``, the
    critical-token KL weights, ``support=kept_mass``'s kept mass and one set per rollout's
    kept ids in the experience's ``info`` (split with its samples)."""
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
    if opts.support == "kept_mass":
        lk = _take_pending(experience, _STATE.kept_mass_pending)
        if lk is not None:
            experience.info[KEPT_MASS_KEY] = lk.float()
        elif _STATE.kept_mass_actor:      # the policy's process (a critic's never scores)
            raise ValueError("support=kept_mass: the experience's samples were not scored by "
                             "this process's actor pass (the experience maker's, which keeps "
                             "their log_kept_mass; OpenRLHF must not rebalance the samples: "
                             "train.dynamic_batch_enable)")
    if opts.one_set_per_rollout:
        ids = _take_pending(experience, _STATE.support_pending)
        if ids is not None:
            experience.info[SUPPORT_IDS_KEY], experience.info[SUPPORT_T_KEY] = _compact_rows(ids)
        elif _STATE.support_actor:        # the policy's process (a critic's never scores)
            raise ValueError(f"{ONE_SET}: the experience's samples were not scored by "
                             "this process's actor pass (the experience maker's old-policy "
                             "pass, which builds their kept set; OpenRLHF must not rebalance "
                             "the samples: train.dynamic_batch_enable)")
    out = _PATCHES.original(type(self), "append")(self, experience)
    if kept is not None:         # the new samples are the buffer's last ones (its limit aside)
        new = self.items[max(0, len(self.items) - len(kept)):]
        for item, row in zip(new, kept[len(kept) - len(new):]):
            setattr(item, KEPT_ATTR, row)
    return out


def _take_pending(experience, pending=None):
    """What the actor's pass kept for exactly this experience's samples (its sequences and
    masks; the experience maker's micro-batch), or None: NTHR's rows (``pending`` None), or
    from ``pending`` (e.g. ``_STATE.kept_mass_pending``)."""
    pending = _STATE.nthr_pending if pending is None else pending
    seqs = [experience.sequences, experience.action_mask, experience.attention_mask]
    if any(not isinstance(t, torch.Tensor) for t in seqs):
        return None
    seqs = [t.detach().cpu() for t in seqs]
    for k, (saw, rows) in enumerate(pending):
        if all(a.shape == b.shape and torch.equal(a.to(b.dtype), b)
               for a, b in zip(saw, seqs)):
            del pending[k]
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
    if opts.support is not None:
        support_truncation(trainer.actor, args)          # the rollout's settings, checked
        if int(_get(args, "ds.tensor_parallel_size", 1) or 1) > 1:
            raise ValueError(f"support={opts.support}: ds.tensor_parallel_size > 1: the kept "
                             f"set's top-p cut (no top-k bound) needs each row's whole "
                             f"vocabulary on one rank")
    if opts.support == "kept_mass":
        level = _get(args, "algo.advantage.is_correction_level", "off")
        if level == "off":
            raise ValueError("support=kept_mass: algo.advantage.is_correction_level is 'off': "
                             "OpenRLHF compares nothing against the sampler's log-probs (and "
                             "asks vLLM for none), there is no ratio to correct; set "
                             "--algo.advantage.is_correction_level token|seq or use "
                             "support=replay")
        if dynamic:
            raise ValueError("support=kept_mass: train.dynamic_batch_enable rebalances the "
                             "samples over the ranks after the actor's pass that computed "
                             "their log_kept_mass")
    if opts.one_set_per_rollout:
        if dynamic:
            raise ValueError(f"{ONE_SET}: train.dynamic_batch_enable rebalances the "
                             "samples over the ranks after the actor's pass that built their "
                             "kept sets; set support_set=per_pass or turn it off")
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


def check_buffer(trainer) -> None:
    """What ``training_step`` would refuse in one of the update's micro-batches, checked for
    the rank's whole replay buffer before the first (OpenRLHF's loop steps the optimizer
    after each accumulation window, so a refusal in a later micro-batch would come after
    earlier steps): under ``support=kept_mass``, a sample without the actor pass's
    ``log_kept_mass`` or without ``rollout_log_probs`` (what it moves); with one set per
    rollout, a sample without its kept ids; refused naming the sample."""
    one_set = _STATE.methods.one_set_per_rollout
    if _STATE.methods.support != "kept_mass" and not one_set:
        return
    buffer = getattr(trainer, "replay_buffer", None)
    items = list(getattr(buffer, "items", None) or ())
    for i, item in enumerate(items):
        where = (f"the replay buffer's sample {i} (of {len(items)}; checked for the whole "
                 f"buffer before the update's first training step)")
        key, what, done_by = ((SUPPORT_IDS_KEY, f"{ONE_SET}: the experience carries no kept ids",
                               "builds them") if one_set else
                              (KEPT_MASS_KEY, "support=kept_mass: the experience carries no "
                               "log_kept_mass", "computes it"))
        if (getattr(item, "info", None) or {}).get(key) is None:
            raise ValueError(
                f"{what}: {where} (the experience maker's actor pass in this process {done_by} "
                f"and the replay buffer's append stores {done_by.split()[-1]}: enable() must "
                f"run in this process with the same options, e.g. through {ENV_OPTIONS})")
        if one_set:
            continue
        if getattr(item, "rollout_log_probs", None) is None:
            raise ValueError(f"experience.rollout_log_probs: required with log_kept_mass "
                             f"(support=kept_mass moves vLLM's processed log-probs): {where} "
                             f"has none")


def _ppo_train(self, kl_ctl: float):
    """``ActorPPOTrainer.ppo_train`` after gbc's start-up checks (the whole replay buffer's
    included: :func:`check_buffer`) and NTHR's pass."""
    check_trainer(self)
    check_buffer(self)
    try:
        extra = nthr_pass(self) if _STATE.methods.nthr else {}
        status = _PATCHES.original(type(self), "ppo_train")(self, kl_ctl)
    finally:
        _nthr_forget()               # the update changed the parameters
    status.update(extra)
    return status


def _nthr_forget():
    """The parameters change (or gbc is switched off): what the actor's pass kept describes
    them no longer (NTHR's rows, the kept mass of samples never appended)."""
    if _STATE.nthr_heads is not None:
        _STATE.nthr_heads.stale = True
    _STATE.nthr_heads, _STATE.nthr_pending, _STATE.kept_mass_pending = None, [], []
    _STATE.support_pending, _STATE.support_given = [], None


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
    support = {}
    if opts.one_set_per_rollout:          # the set the old-policy pass built, every epoch
        support["support_ids"] = _info_support_ids(experience, T)
    elif opts.support == "replay":
        support["sampler_truncation"] = support_truncation(self.actor, self.args)
    elif opts.support == "kept_mass":
        support["log_kept_mass"] = _info_rows(experience, KEPT_MASS_KEY, T, 0.0,
                                              "support=kept_mass", (
            "log_kept_mass (the experience maker's actor pass in this process computes it and "
            "the replay buffer's append stores it: enable() must run in this process with the "
            f"same options, e.g. through {ENV_OPTIONS})"))
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
                                   **support, **opts.loss_options(), **_STATE.options)
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
