"""One kept set per rollout (issue 66: ``support=replay`` with ``support_set=rollout``, the
default) in gbc's verl 0.9.1 engines and verl's legacy trainer as gbc patches them.

The set is built once, by the old-policy pass (``compute_log_prob`` with entropy on gbc's actor
engine, ``return_support_ids``), returned as ``gbc_support_ids`` and put in the trainer's batch
by gbc's copy of ``RayPPOTrainer._compute_old_log_prob``; verl's own ``_compute_ref_log_prob``
and ``_update_actor`` (its ``TrainingWorker.train_mini_batch``: mini-batches, shuffle, epochs;
its engine's micro-batching) carry it to the reference pass and every update, which replay it
as ``support_ids``. What runs is verl's: its trainer methods, its worker's ``train_mini_batch``
/ ``train_batch`` / ``infer_batch`` (verl's functions on a stand-in worker object: the Ray layer
is not started), its FSDP2 engine under gbc's. Stand-ins as in tests/test_verl_support.py (the
rollout sampler applying verl's settings to the model's float64 logits, the CPU platform).

Oracles: the float64 kept set of the rollout's policy (``gbc_reference.truncation_support_ids``)
and log-probs over it (``gbc_reference``); verl's stock engine through the same trainer flow
whose logits are cut by hand, in every pass, to that set, carried in its own batch.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import types

import pytest
import torch

from gbc_kernels import methods

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import spawn_gloo  # noqa: E402

pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")
pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")

from test_other_trainers import verl_actor_config  # noqa: E402
from test_verl_engine import _params, build_engine, verl_on_cpu  # noqa: E402
from test_verl_support import (RC, T_ROLL, VLLM, make_model_dir, reference,  # noqa: E402
                               rollout_config, sample_rollouts, trainer_config,
                               verl_trainer_modules)

B = 8
EPOCHS, MINI = 2, 2          # ppo_epochs, ppo_mini_batch_size (x rollout.n 2: 2 mini-batches)


def _members(ids, V):
    """Kept ids ``[..., K]`` (``-1`` padded) as membership ``[..., V]``."""
    m = torch.zeros(*ids.shape[:-1], V + 1, dtype=torch.bool)
    m.scatter_(-1, (ids.long() + 1).clamp(min=0), True)
    return m[..., 1:]


def check_seen_ids(seen_ids, f, oracle_ids, V):
    """The ids each update micro-batch read (``seen_ids``: per sequence, by its tokens, one
    entry per epoch), row by row through verl's shuffle and split, are that sequence's oracle
    set at its response tokens."""
    P = f["prompts"].shape[1]
    rows = {}
    for b in range(B):
        keep = f["attention_mask"][b].bool()
        rows[tuple(f["input_ids"][b][keep].tolist())] = b
    assert set(seen_ids) == set(rows)
    valid = f["attention_mask"][:, P:].bool()
    oracle = _members(oracle_ids, V)
    for seq, seen in seen_ids.items():
        b = rows[seq]
        assert len(seen) == EPOCHS
        for ids in seen:
            T = ids.shape[0]
            assert torch.equal(_members(ids, V)[valid[b, :T]], oracle[b, :T][valid[b, :T]])


def megatron_layout(tp, sp, thd, cp):
    """A Megatron layout's model builder and engine settings: packed ``thd`` on
    tests/test_verl_megatron_cp.py's packed-attention model, else ``bshd`` on
    tests/test_verl_megatron.py's."""
    if thd:
        from test_verl_megatron_cp import _model

        return (functools.partial(_model, tp, sp, cp=cp),
                dict(use_remove_padding=True, context_parallel_size=cp))
    assert cp == 1          # verl's bshd step asserts context parallel 1
    from test_verl_megatron import _setup

    return functools.partial(_setup, tp, sp), {}


# ---------------------------------------------------- verl's worker functions on a stand-in
def _worker(engine, loss_fn):
    """verl's ``TrainingWorker`` methods (``train_mini_batch``, ``train_batch``,
    ``infer_batch``, ``_postprocess_output``) on a stand-in object holding gbc's (or verl's)
    engine, its loss and configs, and no profiler or Ray; gbc's worker patches put on them
    as ``enable()`` puts them on verl's."""
    from verl.workers import engine_workers as ew

    from gbc_kernels.integrations.verl import engine as ve

    class Flops:
        def estimate_flops(self, *args, **kwargs):
            return 0.0, 1.0

    class TrainingWorker:
        train_mini_batch = ew.TrainingWorker.train_mini_batch
        train_batch = ew.TrainingWorker.train_batch
        infer_batch = ew.TrainingWorker.infer_batch
        _postprocess_output = ew.TrainingWorker._postprocess_output

    dev = ew.get_torch_device()
    if not hasattr(dev, "max_memory_reserved"):       # the CPU platform's stand-in device
        ew.get_torch_device = lambda: types.SimpleNamespace(
            max_memory_allocated=lambda: 0, max_memory_reserved=lambda: 0)
    ve._patch_worker(types.SimpleNamespace(TrainingWorker=TrainingWorker,
                                           ActorRolloutRefWorker=type("H", (), {
                                               "init_model": lambda self: None})))
    w = object.__new__(TrainingWorker)
    ec = engine.engine_config
    for k, v in dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                     infer_micro_batch_size_per_gpu=4, max_token_len_per_gpu=64,
                     infer_max_token_len_per_gpu=64, use_fused_kernels=False).items():
        object.__setattr__(ec, k, v)
    w.engine, w.loss_fn, w.engine_config = engine, loss_fn, ec
    w.model_config = {"use_remove_padding": True}
    w.profiler = types.SimpleNamespace(step=lambda: None, rank=0, check_enable=lambda: False,
                                       check_this_step=lambda: False,
                                       check_this_rank=lambda: False)
    w.flops_counter, w.device_name = Flops(), "cpu"
    return w


class _Group:
    """verl's worker groups as the trainer calls them (one rank)."""

    def __init__(self, actor, ref):
        self.actor, self.ref = actor, ref

    @staticmethod
    def _tokens(data):
        from verl.utils import tensordict_utils as tu

        if tu.get(data, "global_token_num") is None:      # the trainer's meta_info in a run
            tu.assign_non_tensor(data, global_token_num=data["input_ids"].offsets().diff()
                                 .tolist())
        return data

    def compute_log_prob(self, data):
        return self.actor.infer_batch(self._tokens(data))

    def compute_ref_log_prob(self, data):
        return self.ref.infer_batch(self._tokens(data))

    def update_actor(self, data):
        return self.actor.train_mini_batch(data)


def _config(**actor):
    from omegaconf import OmegaConf

    return OmegaConf.merge(trainer_config(rollout_config(**VLLM)), OmegaConf.create(dict(
        actor_rollout_ref=dict(
            rollout=dict(n=2, multi_turn=dict(enable=False)),
            actor=dict(dict(loss_agg_mode="token-mean", loss_scale_factor=None,
                            calculate_entropy=False, entropy_coeff=0.0,
                            ppo_mini_batch_size=MINI, ppo_epochs=EPOCHS, data_loader_seed=7,
                            shuffle=True), **actor)))))


def _record_forced(engine):
    """Each scored micro-batch's ``support_forced_frac`` (with the Lopti phase) and the kept
    ids its update read, per sequence (its token ids as the key)."""
    from gbc_kernels.integrations.verl import engine as ve

    seen = {"forced": [], "ids": {}}
    metrics, inputs = engine._gbc_metrics, engine._gbc_loss_inputs

    def gbc_metrics(loss_function, micro_batch, model_output, rng, gbc_m):
        seen["forced"].append((engine._gbc_phase, float(gbc_m["support_forced_frac"])))
        return metrics(loss_function, micro_batch, model_output, rng, gbc_m)

    def loss_inputs(micro_batch, loss_function, valid):
        kw = inputs(micro_batch, loss_function, valid)
        ids = kw.get("support_ids")
        if ids is not None:
            for seq, row in zip(micro_batch["input_ids"].unbind(), ids.cpu()):
                seen["ids"].setdefault(tuple(seq.tolist()), []).append(row)
        return kw

    engine._gbc_metrics, engine._gbc_loss_inputs = gbc_metrics, loss_inputs
    return seen


def _stock_cut(engines, V):
    """verl's stock forward step (of each of ``engines``) whose logits are cut, at every
    response row, to the kept ids its own batch carries (``gbc_support_ids``, read as gbc reads
    them) plus the target."""
    from verl.workers.engine.fsdp import transformer_impl as ti
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from gbc_kernels.integrations import verl as gv
    from gbc_kernels.integrations.verl import engine as ve

    scale, current = ti._scale_logits_by_temperature, {}

    def stepper(engine):
        def forward_step(micro_batch, loss_function, forward_only):
            current["mb"] = micro_batch
            return FSDPEngineWithLMHead.forward_step(engine, micro_batch, loss_function,
                                                     forward_only)
        return forward_step

    def cut(logits, temperature, *, is_unit_temperature):
        l = scale(logits, temperature, is_unit_temperature=is_unit_temperature)
        mb = current["mb"]
        plens, rlens, T = ve._lengths(mb)
        pos, valid = gv.response_rows(plens, rlens, T)
        member = _members(ve.support_ids_of(mb, T), V)
        target = mb["input_ids"].values()[pos + 1]
        member.scatter_(-1, target.unsqueeze(-1), True)
        rows = torch.ones(l.shape[-2], V, dtype=torch.bool)
        rows[pos[valid]] = member[valid]
        keep = rows.view(l.shape)
        return torch.where(keep, l, torch.full_like(l, -1e4))

    for engine in engines:
        engine.forward_step = stepper(engine)
    ti._scale_logits_by_temperature = cut
    return lambda: (setattr(ti, "_scale_logits_by_temperature", scale),
                    [e.__dict__.pop("forward_step", None) for e in engines])


def _flow(mods, model_dir, fields, options, stock_ids=None):
    """One trainer step through verl's legacy ``RayPPOTrainer`` (gbc's patches by
    ``enable(options)``): old-policy pass, reference pass, the actor update (``EPOCHS`` epochs
    of shuffled mini-batches; Lopti's two phases each with ``lopti_eta``). ``stock_ids``: verl's stock
    engines instead, the batch carrying these ids and every pass's logits cut to them."""
    from verl import DataProto
    from verl.workers.utils.losses import ppo_loss

    from gbc_kernels.integrations.verl import engine as ve

    ray_trainer = mods[0]
    ve.enable(options)
    config = _config()
    ve.check_trainer(config)          # what gbc's wrap of the trainer's __init__ runs first
    cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl", entropy_coeff=0.0)
    loss_fn = functools.partial(ppo_loss, config=cfg)
    gbc = stock_ids is None
    engines = {}
    for role in ("actor", "ref"):
        engines[role] = build_engine(model_dir, gbc=gbc, lr=0.5, optimizer="SGD",
                                     options=options)
        if gbc:
            engines[role].gbc_attach_rollout(config.actor_rollout_ref.rollout, role)
    seen = _record_forced(engines["actor"]) if gbc else None
    undo = [] if gbc else [_stock_cut(list(engines.values()), fields["V"])]
    try:
        group = _Group(_worker(engines["actor"], loss_fn), _worker(engines["ref"], None))
        trainer = object.__new__(ray_trainer.RayPPOTrainer)
        trainer.config, trainer.actor_rollout_wg, trainer.ref_policy_wg = config, group, group
        trainer.ref_in_actor, trainer.distillation_config = False, None
        tensors = {k: v.clone() for k, v in fields.items() if k != "V"}
        batch = DataProto.from_dict(tensors=tensors, meta_info={"temperature": T_ROLL})
        if not gbc:
            batch.batch[ve.SUPPORT_IDS_KEY] = stock_ids.clone()
        out = {}
        old, _ = trainer._compute_old_log_prob(batch)
        out["old"] = old.batch["old_log_probs"].clone()
        if ve.SUPPORT_IDS_KEY in old.batch.keys():
            # verl's batch carries the compact form: [B, 1 + T + M], T first
            carried = old.batch[ve.SUPPORT_IDS_KEY].clone()
            out["compact"] = carried
            out["ids"] = methods.expand_support_ids(carried, fields["responses"].shape[1])
        old.batch.pop("entropys")
        batch = batch.union(old)
        out["batch_keys"] = sorted(batch.batch.keys())
        ref = trainer._compute_ref_log_prob(batch)
        out["ref"] = ref.batch["ref_log_prob"].clone()
        batch = batch.union(ref)
        metrics = trainer._update_actor(batch).meta_info["metrics"]
        out["metrics"] = {k: v for k, v in metrics.items() if "gbc_support" in k}
        out["params"] = _params(engines["actor"])
        if seen is not None:
            out["forced"], out["seen_ids"] = seen["forced"], seen["ids"]
        # the update of a batch that lacks the old-policy pass's ids: refused, never rebuilt
        if gbc and options.one_set_per_rollout and options.lopti_eta is None:
            bare = DataProto.from_dict(tensors={k: v.clone() for k, v in batch.batch.items()
                                                if k != ve.SUPPORT_IDS_KEY},
                                       meta_info={"temperature": T_ROLL})
            try:
                trainer._update_actor(bare)
                out["refused"] = None
            except ValueError as exc:
                out["refused"] = str(exc)
    finally:
        for u in undo:
            u()
    return out


def _legacy_worker(rank, world, model_dir):
    verl_on_cpu()
    mods = verl_trainer_modules()
    from gbc_kernels.integrations.verl import engine as ve

    from test_verl_support import V

    fields = sample_rollouts(model_dir, VLLM, B=B, seed=3)
    fields["V"] = V
    ref64 = reference(model_dir, fields, VLLM)
    res = {"fields": fields, "ref64": ref64}
    rollout = ve.EngineOptions(support="replay")
    per_pass = ve.EngineOptions(support="replay", support_set="per_pass")
    res["rollout"] = _flow(mods, model_dir, fields, rollout)
    res["per_pass"] = _flow(mods, model_dir, fields, per_pass)
    res["stock"] = _flow(mods, model_dir, fields, ve.EngineOptions(),
                         stock_ids=ref64["ids"].to(torch.int32))
    res["lopti_rollout"] = _flow(mods, model_dir, fields, ve.EngineOptions(
        support="replay", lopti_eta=0.5))
    res["lopti_per_pass"] = _flow(mods, model_dir, fields, ve.EngineOptions(
        support="replay", support_set="per_pass", lopti_eta=0.5))
    ve.disable()
    return res


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    model_dir = make_model_dir(tmp_path_factory.mktemp("verl_support_set") / "m")
    return spawn_gloo(1, _legacy_worker, model_dir)[0]


def _forced_share(fields, ids):
    """The share of masked-in response tokens whose target is outside ``ids``."""
    m = fields["response_mask"].bool()
    y = fields["responses"]
    inside = (ids == y.unsqueeze(-1)).any(-1)
    return float((~inside & m).sum()) / float(m.sum())


def test_old_pass_builds_the_set_and_the_batch_carries_it(legacy):
    """verl's old-policy pass (gbc's ``_compute_old_log_prob``) puts ``gbc_support_ids`` in the
    trainer's batch (compact, ``methods.compact_support_ids``; expanded here to ``[B, T, K]``): in every response token's row the float64 oracle's
    kept set of the rollout policy (``truncation_support_ids``), ``-1`` past each response;
    its log-probs are over that set. ``support_set=per_pass`` adds no ids."""
    from gbc_kernels.integrations.verl import engine as ve

    r, f, ref64 = legacy["rollout"], legacy["fields"], legacy["ref64"]
    V = f["V"]
    ids = r["ids"]
    assert ids.dtype == torch.int32 and ids.shape[:2] == f["responses"].shape
    compact = r["compact"]
    assert compact.dtype == torch.int32 and compact.dim() == 2
    assert compact.shape[1] < 1 + ids.shape[1] * (1 + ids.shape[2])   # smaller than padded
    assert ve.SUPPORT_IDS_KEY in r["batch_keys"]
    valid = f["attention_mask"][:, f["prompts"].shape[1]:].bool()
    assert torch.equal(_members(ids, V)[valid], _members(ref64["ids"], V)[valid])
    assert (ids[~valid] == -1).all()
    m = f["response_mask"].bool()
    assert float((r["old"] - ref64["over"]).abs()[m].max()) < 2e-5
    assert "ids" not in legacy["per_pass"]
    assert ve.SUPPORT_IDS_KEY not in legacy["per_pass"]["batch_keys"]


def test_reference_pass_scores_the_old_pass_set(legacy):
    """verl's own ``_compute_ref_log_prob`` on the batch: the reference engine replays the
    old-policy pass's ids (its weights are the rollout policy's here), so ``ref_log_prob`` is
    the float64 log-prob over the rollout's kept set, and equals verl's stock reference pass
    whose logits are cut to that set."""
    r, f, ref64 = legacy["rollout"], legacy["fields"], legacy["ref64"]
    m = f["response_mask"].bool()
    assert float((r["ref"] - ref64["over"]).abs()[m].max()) < 2e-5
    assert float((r["ref"] - legacy["stock"]["ref"]).abs()[m].max()) < 2e-5


def test_update_epochs_equal_stock_over_the_rollout_set(legacy):
    """verl's ``_update_actor`` (2 epochs x 2 shuffled mini-batches, SGD lr 0.5: the policy
    moves between them): gbc's update replays the old-policy pass's set in every mini-batch
    and epoch, ending in the parameters of verl's stock update whose logits are cut in every
    pass to the float64 set of the rollout policy; the ids each update micro-batch read are,
    row by row through verl's shuffle and split, that sequence's oracle set."""
    r, f, ref64 = legacy["rollout"], legacy["fields"], legacy["ref64"]
    got, want = r["params"], legacy["stock"]["params"]
    top = max(float(w.abs().max()) for w in want.values())
    for n in want:
        assert float((got[n] - want[n]).abs().max()) <= 5e-5 * top, n
    # the per_pass update ends elsewhere (its later mini-batches rebuild the set)
    assert max(float((legacy["per_pass"]["params"][n] - want[n]).abs().max())
               for n in want) > 1e-4
    check_seen_ids(r["seen_ids"], f, ref64["ids"], f["V"])


def test_forced_share_same_in_every_pass_not_growing(legacy):
    """``support_forced_frac`` under one kept set per rollout is the share of tokens outside
    the set the old-policy pass built, the same in every mini-batch and epoch and in Lopti's
    second phase as in its first; under ``per_pass`` the moved policy's rebuilt sets drift
    (forced share growing past the rollout's), the behaviour one set per rollout removes."""
    f, ref64 = legacy["fields"], legacy["ref64"]
    base = _forced_share(f, ref64["ids"])
    for name in ("rollout", "lopti_rollout"):
        forced = legacy[name]["forced"]
        assert len(forced) >= EPOCHS * 2
        shares = [v for _, v in forced]
        # each micro-batch's share of its own tokens: the batch's is 0, so each is 0 too
        assert base == 0.0 and max(shares) == 0.0, (name, shares)
    phases = {p for p, _ in legacy["lopti_rollout"]["forced"]}
    assert phases == {"low", "high"}
    for name in ("per_pass", "lopti_per_pass"):
        shares = [v for _, v in legacy[name]["forced"]]
        assert shares[0] == 0.0 and max(shares) > 0.02, (name, shares)
    print("\nforced share per scored micro-batch:",
          {n: [round(v, 3) for _, v in legacy[n]["forced"]]
           for n in ("rollout", "per_pass", "lopti_rollout", "lopti_per_pass")})


def test_update_without_the_old_pass_ids_is_refused(legacy):
    """An update whose batch has no ``gbc_support_ids`` under one kept set per rollout is
    refused naming the options and what to set, never scored over a rebuilt set."""
    msg = legacy["rollout"]["refused"]
    assert msg is not None and msg.startswith(
        "GBC_VERL_OPTIONS support=replay with support_set=rollout (the default): the actor "
        "update scores the kept set verl's old-policy pass built, and its batch has no "
        "'gbc_support_ids' field"), msg
    assert "set support_set=per_pass in GBC_VERL_OPTIONS" in msg


# ------------------------------------------------------------------------- refusals at start
def test_bypass_mode_refused_at_start_for_one_set_per_rollout():
    """verl's bypass mode runs no old-policy pass: one kept set per rollout is refused by the
    trainers' start-up check naming ``bypass_mode`` and ``support_set=per_pass``; per-pass
    rebuild is accepted there."""
    from gbc_kernels.integrations.verl import engine as ve
    from gbc_kernels.integrations.verl import trainer as vt

    config = trainer_config(rollout_config(**VLLM), rc=dict(RC, bypass_mode=True))
    for opts in (ve.EngineOptions(support="replay"),
                 ve.EngineOptions.parse("support=replay,support_set=rollout")):
        with pytest.raises(ValueError, match="^" + re.escape(
                "algorithm.rollout_correction.bypass_mode=True: GBC_VERL_OPTIONS "
                "support=replay with support_set=rollout (the default) scores every pass over "
                "the kept set verl's old-policy pass builds")) as e:
            vt.trainer_support_plan(config, opts)
        assert "set support_set=per_pass in GBC_VERL_OPTIONS" in str(e.value)
    plan = vt.trainer_support_plan(config, ve.EngineOptions.parse(
        "support=replay,support_set=per_pass"))
    assert plan.mode == "replay" and not plan.one_set


@pytest.mark.parametrize("text,match", [
    ("support=replay,support_set=perpass",
     "GBC_VERL_OPTIONS: support_set: expected one of ('rollout', 'per_pass') or None (off), "
     "got 'perpass'"),
    ("support=kept_mass,support_set=rollout",
     "GBC_VERL_OPTIONS: support_set: 'rollout' chooses which kept set the passes of "
     "support=replay score; support is 'kept_mass'"),
    ("support_set=per_pass", "GBC_VERL_OPTIONS: support_set: 'per_pass' chooses"),
])
def test_support_set_spelled_wrong_refused(text, match):
    """``GBC_VERL_OPTIONS``' ``support_set``: a value other than ``rollout`` / ``per_pass``,
    or set without ``support=replay``, is refused naming the option."""
    from gbc_kernels.integrations.verl import engine as ve

    with pytest.raises(ValueError, match="^" + re.escape(match)):
        ve.EngineOptions.parse(text)


def test_plan_of_each_support_set():
    """The default is one kept set per rollout: the old-policy pass returns its ids, later
    passes replay them (refused without); ``per_pass`` rebuilds in every pass."""
    from gbc_kernels.integrations.verl import engine as ve

    rollout = rollout_config(**VLLM)
    plan = ve.support_plan(ve.EngineOptions(support="replay"), rollout)
    assert plan.one_set and plan.old_pass_kwargs()["return_support_ids"] is True
    ids = torch.zeros(1, 2, 3, dtype=torch.int32)
    assert plan.scored_kwargs(ids)["support_ids"] is ids
    with pytest.raises(ValueError, match="the reference pass scores the kept set"):
        plan.scored_kwargs(None, "the reference pass")
    pp = ve.support_plan(ve.EngineOptions(support="replay", support_set="per_pass"), rollout)
    assert not pp.one_set and "return_support_ids" not in pp.old_pass_kwargs()
    assert pp.scored_kwargs(None) == {"sampler_truncation": pp.truncation}


# ------------------------------------------------------------------- gbc's Megatron engine
HAND_K = 12         # MEGATRON's top_k: the widest kept set


def _recording(processor):
    """``processor`` (:func:`_cut_processor`'s hand cut) whose forward-only passes also return
    the hand's kept set of the whole vocabulary at each row, before it forces the target in:
    ``HAND_K`` per-token outputs ``hand_id_k`` (the set's ids in order, ``-1`` padded) that verl's
    own unpacking (``thd`` or ``bshd``, gathered over the context-parallel group) carries to the
    response grid, an oracle of the built ids' layout independent of gbc's row mapping."""
    import gbc_reference as ref

    def wrapped(self, logits, label, temperature, **kw):
        seen, kept_set = [], ref.kept_set

        def record(*args, **kwargs):
            keep = kept_set(*args, **kwargs)
            seen.append(keep.clone())           # the hand then scatters the target into it
            return keep

        ref.kept_set = record
        try:
            ret = processor(self, logits, label, temperature, **kw)
        finally:
            ref.kept_set = kept_set
        if kw.get("logits_processor_func") is None:
            keep = seen[-1].reshape(*label.shape, -1)
            V = keep.shape[-1]
            ids = torch.where(keep, torch.arange(V), V).sort(-1).values[..., :HAND_K]
            ids = torch.where(ids < V, ids, -1).to(logits.dtype)
            for k in range(HAND_K):
                ret[f"hand_id_{k}"] = ids[..., k]
        return ret

    return wrapped


def _megatron_worker(rank, world, tp, sp, thd, cp=1):
    """At TP ``tp`` (+ sequence parallelism ``sp``) and context parallel ``cp``, in the packed
    ``thd`` layout (``use_remove_padding=True``; tests/test_verl_megatron_cp.py's model, whose
    core attention is the packed stand-in; context parallelism is thd only) or the padded
    ``bshd`` one: gbc's old-policy pass builds the set (``gbc_support_ids`` in its output, nested
    per sequence as the v1 trainer's transfer queue holds it), then the reference pass and the
    update replay it from the batch; verl's stock engine runs the same passes with its logits
    cut by hand to the kept set of the whole (gathered) vocabulary, its old pass returning that
    set (``hand_ids``, :func:`_recording`)."""
    from test_verl_megatron import (_batch, _engine, _grads, _infer, _loss_fn, _metric_values,
                                    _padded, _responses)
    from test_verl_support import MEGATRON, _cut_processor
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    from verl.workers.utils.padding import no_padding_2_padding

    from gbc_kernels.integrations.verl import engine as ve

    assert MEGATRON["top_k"] == HAND_K
    rollout = rollout_config(**MEGATRON)
    setup, config = megatron_layout(tp, sp, thd, cp)

    def passes(engine, ids=None):
        res = {}
        data = _batch(seed=7)
        o = _infer(engine, data, calculate_entropy=True)
        res["old"] = _responses(o, "log_probs", data)
        built = o["model_output"].get(ve.SUPPORT_IDS_KEY)
        if built is not None:
            view = _batch(seed=7)
            view[ve.SUPPORT_IDS_KEY] = built
            res["ids"] = ve.support_ids_of(view, ve._lengths(view)[2])
            res["valid"] = ve._Rows(view, False).valid
            ids = built
        if "hand_id_0" in o["model_output"]:        # the hand's set, by verl's unpacking
            res["targets"] = _padded(data["responses"])
            res["mask"] = _padded(data["response_mask"]).bool()
            res["hand_ids"] = torch.stack(
                [(no_padding_2_padding(o["model_output"][f"hand_id_{k}"] + 1, data) - 1)
                 .round().long() for k in range(HAND_K)], -1)
        data = _batch(seed=7)
        if ids is not None:
            data[ve.SUPPORT_IDS_KEY] = ids
        res["ref"] = _responses(_infer(engine, data, calculate_entropy=False), "log_probs",
                                data)
        data = _batch(seed=7)
        if ids is not None:
            data[ve.SUPPORT_IDS_KEY] = ids
        torch.manual_seed(1234)
        o = engine.forward_backward_batch(data, _loss_fn(), forward_only=False)
        res["step"] = dict(loss=float(sum(o["loss"])), metrics=_metric_values(o["metrics"]))
        return res

    out = {}
    model = setup()
    engine = _engine(model, options=ve.EngineOptions(support="replay"), **config)
    engine.gbc_attach_rollout(rollout, "actor")
    out["rollout"] = passes(engine)
    out["rollout"]["grads"] = _grads(model)
    stock = MegatronEngineWithLMHead._lm_head_logits_processor
    model = setup()
    engine = _engine(model, gbc=False, **config)
    MegatronEngineWithLMHead._lm_head_logits_processor = _recording(
        _cut_processor(stock, MEGATRON, tp))
    try:
        out["cut"] = passes(engine)
        out["cut"]["grads"] = _grads(model)
    finally:
        MegatronEngineWithLMHead._lm_head_logits_processor = stock
    return out


# (ranks, tp, sequence parallel, thd, cp) of each layout; each a spawned gloo run
MEGATRON_LAYOUTS = {"bshd_tp2_sp": (2, 2, True, False, 1),
                    "thd_tp2_sp": (2, 2, True, True, 1),
                    "thd_cp2": (2, 1, False, True, 2)}


@pytest.fixture(scope="module", params=list(MEGATRON_LAYOUTS))
def megatron_runs(request):
    pytest.importorskip("megatron.core")
    pytest.importorskip("verl.workers.engine.megatron.transformer_impl")
    world, *args = MEGATRON_LAYOUTS[request.param]
    return spawn_gloo(world, _megatron_worker, *args)


def test_megatron_reference_and_update_replay_the_old_pass_set(megatron_runs):
    """gbc's Megatron engine in each layout — the padded ``bshd`` and the packed ``thd``
    (``use_remove_padding=True``, verl's default) at TP 2 with sequence parallelism, ``thd`` at
    context parallel 2 (each rank its own load-balanced chunks; the ids joined over the CP
    group) — on a float64 tiny ``GPTModel``: the old-policy pass returns its kept set
    (``gbc_support_ids``, nested per sequence like ``log_probs``: each response token's row
    holds the ids of the hand's kept set at that token, read back through verl's own unpacking;
    the same on every rank; non-empty in the valid rows, empty elsewhere), and the reference
    pass and the update that read it from their batch equal verl's stock engine whose logits
    are cut by hand to the kept set of the whole vocabulary: log-probs, loss, verl's metrics,
    every gradient (the batch's random targets outside the set forced in by both); gbc's
    ``support_forced_frac`` is each micro-batch's share of targets outside the hand's set."""
    from test_verl_megatron import VP
    from test_verl_support import _mclose

    ids0 = megatron_runs[0]["rollout"]["ids"]
    for r, out in enumerate(megatron_runs):
        got, want = out["rollout"], out["cut"]
        assert torch.equal(got["ids"], ids0), r
        valid = got["valid"]
        size = (got["ids"] >= 0).sum(-1)
        assert (size[valid] >= 1).all() and (size[~valid] == 0).all(), r
        assert int(size[valid].max()) <= HAND_K and (size[valid] < HAND_K).any(), r  # top_p
        hand = want["hand_ids"]
        assert hand.shape[:2] == got["ids"].shape[:2], r
        assert torch.equal(_members(got["ids"], VP)[valid], _members(hand, VP)[valid]), r
        for p in ("old", "ref"):
            _mclose(got[p], want[p], 1e-6, f"rank {r} {p}")
        assert abs(got["step"]["loss"] - want["step"]["loss"]) < 1e-7, r
        for k, v in want["step"]["metrics"].items():
            _mclose(torch.tensor(v), torch.tensor(got["step"]["metrics"][k]), 1e-5,
                    f"rank {r} {k}")
        # gbc's forced share: each update micro-batch's (2 rows, in order) masked-in targets
        # outside the hand's set
        T = hand.shape[1]
        mask = want["mask"][:, :T]
        forced = ~(hand == want["targets"][:, :T, None]).any(-1) & mask
        shares = [float(forced[i:i + 2].sum()) / max(1.0, float(mask[i:i + 2].sum()))
                  for i in range(0, forced.shape[0], 2)]
        assert any(x > 0 for x in shares), shares
        assert got["step"]["metrics"]["actor/gbc_support_forced_frac"] == pytest.approx(
            shares), r
        for k in want["grads"]:
            _mclose(got["grads"][k], want["grads"][k], 1e-6, f"rank {r} grad {k}")


# ------------------------------------------------------- Ulysses sequence parallelism (FSDP)
ULYSSES = dict(name="vllm", top_k=20, top_p=0.9)


def _ulysses_worker(rank, world, model_dir, sp):
    """At Ulysses SP ``sp`` (tests/test_verl_ulysses.py's harness): the old-policy pass builds
    the set (each rank its own positions', joined over the SP group), the trainer's padded
    ``[B, T, K]`` form of it (gbc's ``_compute_old_log_prob``'s) goes into the update batch,
    and one update replays it."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from gbc_kernels.integrations.verl import engine as ve
    from test_verl_engine import make_batch
    from test_verl_ulysses import _forward_backward as sp_forward_backward
    from test_verl_ulysses import build_engine as sp_engine

    engine = sp_engine(model_dir, sp, lr=0.5, optimizer="SGD")
    type(engine).gbc_options = ve.EngineOptions(support="replay")
    engine.gbc_attach_rollout(rollout_config(**ULYSSES), "actor")
    cfg = verl_actor_config("gspo", "seq-mean-token-mean", "low_var_kl", entropy_coeff=0.01)
    loss_fn = functools.partial(ppo_loss, config=cfg)
    data = make_batch(21, 6, temperature=0.8, lengths=(7, 9))
    td = data.clone()
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False)
    with engine.eval_mode():
        o = engine.infer_batch(td, loss_function=None)["model_output"]
    ids = ve.padded_support_ids(o[ve.SUPPORT_IDS_KEY], data)
    out = {"ids": ids, "old": no_padding_2_padding(o["log_probs"], data),
           "responses": data["responses"], "mask": data["response_mask"]}
    data[ve.SUPPORT_IDS_KEY] = ids
    out["step"] = sp_forward_backward(engine, data, loss_fn, False)
    return out


@pytest.fixture(scope="module")
def ulysses_runs(tmp_path_factory):
    from test_verl_engine import make_model_dir as plain_model_dir

    model_dir = plain_model_dir(tmp_path_factory.mktemp("verl_support_set_sp") / "m")
    return spawn_gloo(2, _ulysses_worker, model_dir, 2), spawn_gloo(1, _ulysses_worker,
                                                                     model_dir, 1)[0]


def test_ulysses_sp2_builds_and_replays_the_set_of_sp1(ulysses_runs):
    """Under Ulysses SP 2 the old-policy pass's set (each rank builds its own positions', the
    SP group joins them) is SP 1's on every rank; the update replaying it equals SP 1's (loss,
    verl's metrics, every gradient), its ``support_forced_frac`` the share of response tokens
    outside the built set."""
    from test_verl_engine import V

    sp2, sp1 = ulysses_runs
    T = sp1["ids"].shape[1]
    resp = sp1["responses"][:, :T]
    mask = (sp1["mask"][:, :T] > 0)
    forced = ~(sp1["ids"] == resp.unsqueeze(-1)).any(-1) & mask
    # micro-batches of 2 rows in order (make_batch: micro=2, no dynamic batch sizes)
    shares = [float(forced[i:i + 2].sum()) / max(1.0, float(mask[i:i + 2].sum()))
              for i in range(0, forced.shape[0], 2)]
    assert any(0 < x < 1 for x in shares)                    # random targets: some forced
    (l0, m0, g0) = sp1["step"]
    assert m0["actor/gbc_support_forced_frac"] == pytest.approx(shares)
    for r, got in enumerate(sp2):
        assert torch.equal(_members(got["ids"], V), _members(sp1["ids"], V)), r
        assert float((got["old"] - sp1["old"]).abs().max()) <= 2e-5, r
        l1, m1, g1 = got["step"]
        assert abs(l0 - l1) <= 2e-5 * max(1.0, abs(l0)), r
        for k in m0:
            for a, b in zip(m0[k], m1[k]):
                assert abs(a - b) <= 2e-5 * max(1.0, abs(a)) + 1e-6, (r, k, a, b)
        top = max(float(g.abs().max()) for g in g0.values())
        for n in g0:
            assert float((g0[n] - g1[n]).abs().max()) <= 2e-5 * top, (r, n)
