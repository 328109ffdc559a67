"""gbc's verl 0.9.1 integration through the REAL transfer queue of verl's v1 trainer (its
default, ``trainer.use_v1=True``): the ``transfer_queue`` package (PyPI ``TransferQueue``, the
release requirements-dev.txt pins), started here on the CPU, not tests/test_verl_support.py's
stand-in dict.

The queue: Ray started locally (``ray.init(address="local")``, no dashboard), ``tq.init()``
with the package's default config (its ``TransferQueueController`` and two ``SimpleStorage``
units as Ray actors, the data moved over ZMQ), torn down after (``tq.close()``,
``ray.shutdown()``); started once for the module, in the spawned gloo process the FSDP engines
need (one module-scoped fixture).

What runs on it is verl's: its v1 trainer's own ``PPOTrainer._compute_old_log_prob`` /
``_compute_ref_log_prob`` / ``_compute_advantage`` / ``_update_actor`` (gbc's patches by
``enable()``, its ``tq`` the real package), its worker group's dispatch and collect at one
data-parallel rank (``BatchData.chunk`` / ``concat``: the ``KVBatchMeta`` turned into the
queue's ``BatchMeta`` and back), its ``ActorRolloutRefWorker.compute_log_prob`` /
``compute_ref_log_prob`` / ``update_actor`` with their ``@register`` (``tqbridge``: the rank
reads its fields from the queue and puts its outputs back), its ``TrainingWorker`` methods
(tests/test_verl_support_set.py's ``_worker``) on gbc's FSDP2 engine. The rollout is put in
the queue as verl's v1 agent loop puts it (one key per sample, its fields unpadded, verl's
``list_of_dict_to_tensordict``). Stand-ins (said here): the worker objects (built with
``object.__new__``: no Ray actor per worker, no profiler), the trainer object (verl's
``__init__`` builds the whole run; gbc's check in it is run as the wrap runs it), verl's
advantage estimator (the rollout's advantages, as in tests/test_verl_support.py), the rollout
sampler and CPU platform of tests/test_verl_support.py.

Checked against what tests/test_verl_support.py and tests/test_verl_support_set.py check
through the stand-in queue and verl's legacy trainer: ``support=kept_mass``: the corrected
rollout log-probs verl's rollout correction is fed, its IS weights, rejection mask and metrics
equal the legacy trainer's (and the stand-in queue's); ``support=replay`` with one kept set per
rollout: the ``gbc_support_ids`` read back from the queue are, row by row, those the old-policy
pass built (int32, nested per sequence), the float64 oracle's kept set, and the reference pass
and the update (2 epochs x 2 shuffled mini-batches) that read them from the queue replay it:
the float64 log-probs over that set, and the parameters of verl's stock update whose logits
are cut to it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import spawn_gloo  # noqa: E402

pytest.importorskip("transfer_queue", reason="the TransferQueue package (verl's v1 trainer's "
                    "transfer queue, pinned in requirements-dev.txt) is not installed")
pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")
pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")

from test_other_trainers import verl_actor_config  # noqa: E402
from test_verl_engine import _params, build_engine, verl_on_cpu  # noqa: E402
from test_verl_support import (RC, T_ROLL, V, VLLM, _step, make_model_dir,  # noqa: E402
                               reference, sample_rollouts, verl_trainer_modules)
from test_verl_support_set import (B, EPOCHS, _config, _flow, _Group,  # noqa: E402
                                   _members, _record_forced, _worker, check_seen_ids)

TQ_VERSION = "0.1.11"           # the release requirements-dev.txt pins
# the order verl's _balance_batch could leave the kept_mass batch in (KVBatchMeta.reorder):
# the queue returns each key's row wherever it stands
PERM = [5, 2, 7, 0, 3, 6, 1, 4]


# ------------------------------------------------------------------------------ the queue
@contextlib.contextmanager
def _real_queue():
    """Ray on this machine and the transfer queue on it, as ``tq.init()`` starts it (its
    default config: the controller and two SimpleStorage units, Ray actors of one logical CPU
    each); closed and Ray shut down after."""
    import importlib.metadata as md
    import logging

    import ray
    import transfer_queue as tq

    for name in list(logging.root.manager.loggerDict):     # its per-get thread-count warning
        if name.startswith("transfer_queue"):
            logging.getLogger(name).setLevel(logging.ERROR)
    t0 = time.monotonic()
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 1024 ** 2)
    info = {}
    try:
        conf = tq.init()
        info.update(version=md.version("TransferQueue"),
                    backend=str(conf.backend.storage_backend),
                    units=int(conf.backend.SimpleStorage.num_data_storage_units),
                    actors=sorted(a["name"] for a in ray.util.list_named_actors(
                        all_namespaces=True) if a["name"].startswith("TransferQueue")),
                    start_s=time.monotonic() - t0)
        yield tq, info
    finally:
        tq.close()
        try:
            ray.get_actor("TransferQueueController", namespace="transfer_queue")
            info["controller_after_close"] = True
        except ValueError:
            info["controller_after_close"] = False
        ray.shutdown()
        info["ray_after_shutdown"] = ray.is_initialized()


def _put_rollout(tq, fields, prefix):
    """The rollout in the queue as verl's v1 agent loop puts it
    (``AgentLoopWorkerTQ._agent_loop_postprocess``): one key per sample, its fields unpadded
    (``prompts``, ``responses``, ``input_ids``, ``attention_mask``, ``position_ids``,
    ``response_mask``, ``loss_mask``, ``rollout_log_probs``, ``rm_scores``), batched by verl's
    ``list_of_dict_to_tensordict``; ``uid`` the group as tests/test_verl_support.py's stand-in
    queue holds it. Returns the keys, by row of ``fields``, and their tags."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    n, Lp = fields["prompts"].shape
    rows, keys, tags = [], [], []
    for b in range(n):
        keep = fields["attention_mask"][b].bool()
        p, r = int(keep[:Lp].sum()), int(keep[Lp:].sum())
        prompts, responses = fields["prompts"][b, Lp - p:], fields["responses"][b, :r]
        input_ids = torch.cat([prompts, responses])
        rm_scores = torch.zeros(r)
        rm_scores[-1] = float(b % 2)
        rows.append(dict(prompts=prompts, responses=responses, input_ids=input_ids,
                         attention_mask=torch.ones_like(input_ids),
                         position_ids=fields["position_ids"][b][keep],
                         response_mask=fields["response_mask"][b, :r],
                         loss_mask=fields["response_mask"][b, :r],
                         rollout_log_probs=fields["rollout_log_probs"][b, :r].float(),
                         rm_scores=rm_scores, uid=torch.tensor(b // 2)))
        keys.append(f"{prefix}{b // 2}_{b % 2}_0")        # verl's {uid}_{session}_{index}
        tags.append(dict(status="success", prompt_len=p, response_len=r, seq_len=p + r))
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(rows),
                    tags=tags)
    return keys, tags


class _QueueGroup:
    """verl's worker groups as its v1 trainer calls them, at one data-parallel rank: verl's
    dispatch (``BatchData(meta).chunk``: the ``KVBatchMeta`` as the queue's ``BatchMeta``),
    verl's own ``ActorRolloutRefWorker`` method with its ``@register`` (``tqbridge``: the
    rank's fields read from the queue, its outputs put there), verl's collect
    (``BatchData(...).concat``). The actor's ``infer_batch`` outputs are recorded (``built``)
    and, with ``drop``, a field is dropped from them (a worker that does not return it)."""

    def __init__(self, actor, ref=None, drop=()):
        from verl.workers import engine_workers as ew

        self.cls, self.built, self.keys = ew.ActorRolloutRefWorker, [], []
        w = object.__new__(ew.ActorRolloutRefWorker)       # no Ray actor, no profiler
        w.actor, w.ref, w.enable_routing_replay, w.profiler = actor, ref, False, None
        w._Worker__collect_dp_rank = {"actor": True, "ref": True}
        self.worker = w
        infer = actor.infer_batch

        def infer_batch(data):
            out = infer(data)
            self.built.append({k: out[k].clone() for k in out.keys()
                               if isinstance(out.get(k), torch.Tensor)})
            for k in drop:
                if k in out.keys():
                    del out[k]
            return out

        actor.infer_batch = infer_batch

    def _call(self, name, meta):
        from verl.protocol import BatchData

        self.keys.append((name, list(meta.keys)))
        (chunk,) = BatchData(meta).chunk(chunks=1)
        out = getattr(self.cls, name)(self.worker, chunk)
        return BatchData([out]).concat()

    def compute_log_prob(self, meta):
        return self._call("compute_log_prob", meta)

    def compute_ref_log_prob(self, meta):
        return self._call("compute_ref_log_prob", meta)

    def update_actor(self, meta):
        return self._call("update_actor", meta)


def _v1_trainer(trainer_sync, config, group):
    trainer = object.__new__(trainer_sync.PPOTrainerSync)
    trainer.config, trainer.actor_rollout_wg, trainer.ref_policy_wg = config, group, group
    trainer.ref_in_actor, trainer.distillation_config = False, None
    return trainer


def _v1_config(rc=RC):
    from omegaconf import OmegaConf

    return OmegaConf.merge(_config(), OmegaConf.create(dict(algorithm=dict(
        rollout_correction=rc, adv_estimator="grpo", gamma=1.0, lam=1.0,
        norm_adv_by_std_in_grpo=True))))


def _estimator(fields, rows):
    """verl's advantage estimator, after the correction: the rollout's advantages (``rows``:
    each queue row's row of ``fields``)."""

    def estimator(data, **kw):
        T = data.batch["response_mask"].shape[1]
        data.batch["advantages"] = fields["advantages"][rows, :T].clone()
        data.batch["returns"] = data.batch["advantages"]
        return data

    return estimator


def _padded(td, key, rows, T, value=0):
    """``td[key]`` (nested per response, in the queue's row order) as ``[B, T]`` in the order
    of ``fields`` (``rows``: each queue row's ``fields`` row)."""
    got = td[key]
    got = got.to_padded_tensor(value, output_size=(len(rows), T)) if got.is_nested else got
    out = torch.full((len(rows), T), value, dtype=got.dtype)
    out[rows] = got
    return out


# -------------------------------------------------------------------------------- the runs
def _kept_mass(tq, mods, model_dir):
    """``support=kept_mass`` (vLLM): tests/test_verl_support.py's step (verl's legacy trainer,
    its v1 trainer over the stand-in queue, verl's stock correction fed by hand), then verl's
    v1 old-policy pass and advantage step over the real queue on the same engine; every call
    of verl's ``compute_rollout_correction_and_rejection_mask`` recorded (what gbc feeds it)."""
    from verl.trainer.ppo import rollout_corr_helper as rch
    from transfer_queue import KVBatchMeta

    from gbc_kernels.integrations.verl import engine as ve

    _, trainer_base, trainer_sync = mods
    fields = sample_rollouts(model_dir, VLLM, seed=3)
    ref64 = reference(model_dir, fields, VLLM)
    stock, calls = rch.compute_rollout_correction_and_rejection_mask, []
    sig = inspect.signature(stock)

    def spy(*args, **kwargs):
        a = sig.bind(*args, **kwargs).arguments
        calls.append({k: a[k].clone() for k in ("old_log_prob", "rollout_log_prob",
                                                  "response_mask")})
        return stock(*args, **kwargs)

    rch.compute_rollout_correction_and_rejection_mask = spy
    try:
        legacy = _step("kept_mass", VLLM, model_dir, fields, ref64, mods)
        n_legacy = len(calls)         # the legacy trainer's, the stand-in queue's, the hand's
        trainer_base.tq = tq          # _step's v1 pass left its stand-in queue there
        config = _v1_config()
        ve.check_trainer(config)
        out = {"fields": fields, "ref": ref64, "n_legacy_calls": n_legacy,
               "legacy": {k: v for k, v in legacy.items() if k not in ("engine", "batch")}}
        for name, drop, perm in (("real", (), None), ("reordered", (), PERM),
                                 ("bare", (ve.LOG_KEPT_MASS_KEY,), None)):
            group = _QueueGroup(_worker(legacy["engine"], None), drop=drop)
            trainer = _v1_trainer(trainer_sync, config, group)
            keys, tags = _put_rollout(tq, fields, f"{name}-")
            meta = KVBatchMeta(keys=list(keys), tags=list(tags), partition_id="train",
                               extra_info={"temperature": T_ROLL})
            if perm is not None:
                meta.reorder(perm)
            rows = [keys.index(k) for k in meta.keys]
            n_before = len(calls)
            trainer_base.compute_advantage_for_multi_trajectories = _estimator(fields, rows)
            metrics = {}
            meta = trainer._compute_old_log_prob(meta, metrics)
            try:
                trainer._compute_advantage(meta, metrics)
            except ValueError as exc:
                out[name] = {"refused": str(exc)}
                continue
            assert meta.keys == [keys[r] for r in rows]
            T = fields["responses"].shape[1]
            got = tq.kv_batch_get(keys=meta.keys, partition_id="train", select_fields=[
                "rollout_is_weights", "response_mask", "rollout_log_probs",
                ve.LOG_KEPT_MASS_KEY])
            out[name] = dict(
                rows=rows, metrics=metrics, calls=calls[n_before:],
                weights=_padded(got, "rollout_is_weights", rows, T),
                rs_mask=_padded(got, "response_mask", rows, T),
                rollout=_padded(got, "rollout_log_probs", rows, T),
                kept_queue=[got[ve.LOG_KEPT_MASS_KEY][i].clone() for i in range(B)],
                kept_built=list(group.built[0][ve.LOG_KEPT_MASS_KEY].unbind()),
                kept_queue_type=(got[ve.LOG_KEPT_MASS_KEY].is_nested,
                                 got[ve.LOG_KEPT_MASS_KEY].dtype),
                dispatched=group.keys)
    finally:
        rch.compute_rollout_correction_and_rejection_mask = stock
    return out


def _replay(tq, mods, model_dir):
    """``support=replay``, one kept set per rollout: verl's v1 trainer's old-policy pass,
    reference pass, advantage step and actor update over the real queue (gbc's engines for the
    actor and the reference); then tests/test_verl_support_set.py's stock flow (verl's stock
    engines, every pass's logits cut to the float64 oracle's set) for the update's oracle."""
    from transfer_queue import KVBatchMeta
    from verl.workers.utils.losses import ppo_loss

    from gbc_kernels.integrations.verl import engine as ve

    _, trainer_base, trainer_sync = mods
    fields = sample_rollouts(model_dir, VLLM, B=B, seed=3)
    fields["V"] = V
    ref64 = reference(model_dir, fields, VLLM)
    options = ve.EngineOptions(support="replay")
    ve.enable(options)
    config = _v1_config(rc=None)        # the legacy flow's update: no rollout correction
    ve.check_trainer(config)
    loss_fn = functools.partial(ppo_loss, config=verl_actor_config(
        "vanilla", "token-mean", "low_var_kl", entropy_coeff=0.0))
    engines = {}
    for role in ("actor", "ref"):
        engines[role] = build_engine(model_dir, lr=0.5, optimizer="SGD", options=options)
        engines[role].gbc_attach_rollout(config.actor_rollout_ref.rollout, role)
    seen = _record_forced(engines["actor"])
    group = _QueueGroup(_worker(engines["actor"], loss_fn), _worker(engines["ref"], None))
    trainer = _v1_trainer(trainer_sync, config, group)
    keys, tags = _put_rollout(tq, fields, "replay-")
    trainer_base.compute_advantage_for_multi_trajectories = _estimator(fields, list(range(B)))
    meta = KVBatchMeta(keys=list(keys), tags=list(tags), partition_id="train",
                       extra_info={"temperature": T_ROLL})
    metrics = {}
    meta = trainer._compute_old_log_prob(meta, metrics)
    queued = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=[
        ve.SUPPORT_IDS_KEY, "input_ids", "prompts", "responses"])
    meta = trainer._compute_ref_log_prob(meta, metrics)
    meta = trainer._compute_advantage(meta, metrics)
    before = _params(engines["actor"])
    meta = trainer._update_actor(meta, metrics)
    T = fields["responses"].shape[1]
    got = tq.kv_batch_get(keys=keys, partition_id="train",
                          select_fields=["ref_log_prob", "old_log_probs"])
    ids = queued[ve.SUPPORT_IDS_KEY]
    out = dict(fields=fields, ref=ref64, dispatched=group.keys,
               built=list(group.built[0][ve.SUPPORT_IDS_KEY].unbind()),
               queued=[ids[i].clone() for i in range(B)],
               queued_type=(ids.is_nested, ids.layout, ids.dtype),
               grid=ve.support_ids_of(queued, T),
               old=_padded(got, "old_log_probs", list(range(B)), T),
               ref_log_prob=_padded(got, "ref_log_prob", list(range(B)), T),
               metrics={k: v for k, v in metrics.items() if "gbc_support" in k},
               params=_params(engines["actor"]), params_before=before,
               forced=seen["forced"], seen_ids=seen["ids"])
    out["stock"] = _flow(mods, model_dir, fields, ve.EngineOptions(),
                         stock_ids=ref64["ids"].to(torch.int32))
    ve.disable()
    return out


# ------------------------------------------------------------------ critical-token KL
GAMMA, INTERCEPT, CERTAINTY_T = 0.5, 0.1, 0.5    # critical_kl_exponent / _intercept / _temperature


def _critical_options():
    from gbc_kernels.integrations.verl import engine as ve

    return ve.EngineOptions(critical_kl_exponent=GAMMA, critical_kl_intercept=INTERCEPT,
                            critical_kl_temperature=CERTAINTY_T)


@torch.no_grad()
def _critical_oracle(model_dir, fields):
    """float64 gbc_reference on the plain HF model (the reference's weights): the certainty
    ``J_max_prob`` at ``CERTAINTY_T`` of each response position, the weights
    ``((1 - c)·J^γ + c) · response_mask`` and the log-probs at the rollout temperature."""
    import gbc_reference as ref
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager").double()
    n, Lp = fields["prompts"].shape
    T = fields["responses"].shape[1]
    hidden = torch.zeros(n, T, model.config.hidden_size, dtype=torch.float64)
    for b in range(n):
        keep = fields["attention_mask"][b].bool()
        out = model.model(input_ids=fields["input_ids"][b][keep][None]).last_hidden_state[0]
        p, r = int(keep[:Lp].sum()), int(keep[Lp:].sum())
        hidden[b, :r] = out[p - 1:p - 1 + r]
    st = ref.token_stats(hidden, model.lm_head.weight.detach(), fields["responses"],
                         temperature=T_ROLL, certainty="max_prob",
                         certainty_temperature=CERTAINTY_T)
    mask = fields["response_mask"].double()
    return dict(weight=ref.critical_kl_weight(st.certainty, GAMMA, INTERCEPT) * mask,
                logp=st.logp, certainty=st.certainty)


def _record_update(engine):
    """Each update micro-batch's loss (in call order) and the KL weights its loss read, at the
    masked-in response tokens, by sequence (its token ids as the key)."""
    seen = {"losses": [], "weights": []}
    step, inputs = engine._gbc_train_step, engine._gbc_loss_inputs

    def train_step(micro_batch, loss_function):
        loss, out = step(micro_batch, loss_function)
        seen["losses"].append(float(out["loss"]))
        return loss, out

    def loss_inputs(micro_batch, loss_function, valid):
        kw = inputs(micro_batch, loss_function, valid)
        rows = {}
        for seq, w, m in zip(micro_batch["input_ids"].unbind(), kw["kl_weight"], kw["mask"]):
            rows[tuple(seq.tolist())] = w.detach().cpu()[m.cpu()].clone()
        seen["weights"].append(rows)
        return kw

    engine._gbc_train_step, engine._gbc_loss_inputs = train_step, loss_inputs
    return seen


def _critical_engines(model_dir, options, config, ref_gbc=True):
    """The actor's and the reference's engine (gbc's; the reference verl's stock one with
    ``ref_gbc=False``), as verl's worker builds them, and the actor's update recorder."""
    from verl.workers.utils.losses import ppo_loss

    loss_fn = functools.partial(ppo_loss, config=verl_actor_config(
        "vanilla", "token-mean", "low_var_kl", entropy_coeff=0.0))
    engines = {}
    for role, gbc in (("actor", True), ("ref", ref_gbc)):
        engines[role] = build_engine(model_dir, gbc=gbc, lr=0.5, optimizer="SGD",
                                     options=options)
        if gbc:
            engines[role].gbc_attach_rollout(config.actor_rollout_ref.rollout, role)
    seen = _record_update(engines["actor"])
    return (_worker(engines["actor"], loss_fn), _worker(engines["ref"], None), engines["actor"],
            seen)


def _critical_legacy(mods, model_dir, fields, options, config):
    """verl's legacy ``RayPPOTrainer`` (gbc's patches): old-policy pass, reference pass (gbc's
    ``compute_ref_log_prob``: ``gbc_kl_weight`` in the batch), the actor update."""
    from verl import DataProto

    from gbc_kernels.integrations.verl import engine as ve

    actor, ref, engine, seen = _critical_engines(model_dir, options, config)
    group = _Group(actor, ref)
    trainer = object.__new__(mods[0].RayPPOTrainer)
    trainer.config, trainer.actor_rollout_wg, trainer.ref_policy_wg = config, group, group
    trainer.ref_in_actor, trainer.distillation_config = False, None
    batch = DataProto.from_dict(tensors={k: v.clone() for k, v in fields.items()},
                                meta_info={"temperature": T_ROLL})
    old, _ = trainer._compute_old_log_prob(batch)
    old.batch.pop("entropys")
    batch = batch.union(old)
    ref_out = trainer._compute_ref_log_prob(batch)
    batch = batch.union(ref_out)
    from verl.utils.metric import reduce_metrics

    # as the legacy trainer's fit logs them (the v1 trainer's _update_actor reduces its own)
    metrics = reduce_metrics(trainer._update_actor(batch).meta_info["metrics"])
    return dict(weight=ref_out.batch[ve.KL_WEIGHT_KEY].clone(),
                ref_log_prob=ref_out.batch["ref_log_prob"].clone(), params=_params(engine),
                losses=seen["losses"], seen=seen["weights"],
                kl_loss=metrics.get("actor/kl_loss"), pg_loss=metrics.get("actor/pg_loss"))


def _critical_v1(tq, mods, model_dir, fields, options, config, prefix, ref_gbc=True,
                 update=True):
    """verl's v1 ``PPOTrainer`` over the real queue (gbc's patches): old-policy pass, reference
    pass (gbc's wrap: ``gbc_kl_weight`` put in the queue), advantage step, actor update; a
    refused reference pass is returned as ``{"refused": message}``."""
    from transfer_queue import KVBatchMeta

    from gbc_kernels.integrations.verl import engine as ve

    _, trainer_base, trainer_sync = mods
    actor, ref, engine, seen = _critical_engines(model_dir, options, config, ref_gbc)
    group = _QueueGroup(actor, ref)
    trainer = _v1_trainer(trainer_sync, config, group)
    keys, tags = _put_rollout(tq, fields, prefix)
    trainer_base.compute_advantage_for_multi_trajectories = _estimator(fields, list(range(B)))
    meta = KVBatchMeta(keys=list(keys), tags=list(tags), partition_id="train",
                       extra_info={"temperature": T_ROLL})
    metrics = {}
    meta = trainer._compute_old_log_prob(meta, metrics)
    try:
        meta = trainer._compute_ref_log_prob(meta, metrics)
    except ValueError as exc:
        return {"refused": str(exc), "dispatched": [n for n, _ in group.keys],
                "extra_info": dict(meta.extra_info)}
    out = {"extra_info_after_ref": sorted(meta.extra_info)}
    meta = trainer._compute_advantage(meta, metrics)
    out["update_fields"] = sorted(meta.fields or [])
    if update:
        trainer._update_actor(meta, metrics)
    T = fields["responses"].shape[1]
    got = tq.kv_batch_get(keys=keys, partition_id="train",
                          select_fields=[ve.KL_WEIGHT_KEY, "ref_log_prob"])
    w = got[ve.KL_WEIGHT_KEY]
    out.update(dispatched=[n for n, _ in group.keys],
               queued_type=(w.is_nested, w.dtype),
               queued_lengths=w.offsets().diff().tolist() if w.is_nested else None,
               weight=_padded(got, ve.KL_WEIGHT_KEY, list(range(B)), T),
               ref_log_prob=_padded(got, "ref_log_prob", list(range(B)), T),
               params=_params(engine), losses=seen["losses"], seen=seen["weights"],
               kl_loss=metrics.get("actor/kl_loss"), pg_loss=metrics.get("actor/pg_loss"))
    return out


def _critical_kl(tq, mods, model_dir):
    """``critical_kl_exponent``: the legacy trainer's step, then the v1 trainer's over the real
    queue (same rollout, same fresh engines); and the v1 reference pass refused with a stock
    reference engine and without ``use_kl_loss``."""
    from omegaconf import OmegaConf

    from gbc_kernels.integrations.verl import engine as ve

    fields = sample_rollouts(model_dir, VLLM, B=B, seed=5)
    options = _critical_options()
    ve.enable(options)
    config = _v1_config(rc=None)
    ve.check_trainer(config)
    t0 = time.monotonic()
    out = {"fields": fields, "oracle": _critical_oracle(model_dir, fields)}
    out["legacy"] = _critical_legacy(mods, model_dir, fields, options, config)
    out["v1"] = _critical_v1(tq, mods, model_dir, fields, options, config, "ckl-")
    out["stock_ref"] = _critical_v1(tq, mods, model_dir, fields, options, config, "ckl-stock-",
                                    ref_gbc=False, update=False)
    no_kl = OmegaConf.merge(config, OmegaConf.create(
        dict(actor_rollout_ref=dict(actor=dict(use_kl_loss=False)))))
    out["no_kl_loss"] = _critical_v1(tq, mods, model_dir, fields, options, no_kl, "ckl-nokl-",
                                     update=False)
    out["runs_s"] = time.monotonic() - t0
    ve.disable()
    return out


def _tq_worker(rank, world, model_dir):
    verl_on_cpu()
    mods = verl_trainer_modules()
    import transfer_queue

    results = {"bound": mods[1].tq is transfer_queue}     # verl's v1 trainer's own tq
    with _real_queue() as (tq, info):
        results["queue"] = info
        t0 = time.monotonic()
        results["kept_mass"] = _kept_mass(tq, mods, model_dir)
        results["replay"] = _replay(tq, mods, model_dir)
        try:        # a failed critical-KL run fails its own tests, not the others'
            results["critical_kl"] = _critical_kl(tq, mods, model_dir)
        except Exception:       # noqa: BLE001 - reported by _critical_run
            import traceback

            results["critical_kl"] = {"error": traceback.format_exc()}
            from gbc_kernels.integrations.verl import engine as ve
            ve.disable()
        info["runs_s"] = time.monotonic() - t0
    return results


_FAILED = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if "error" in _FAILED:           # a failed start is not retried for every test
        raise _FAILED["error"]
    model_dir = make_model_dir(tmp_path_factory.mktemp("verl_tq") / "m")
    try:
        return spawn_gloo(1, _tq_worker, model_dir)[0]
    except Exception as exc:
        _FAILED["error"] = exc
        raise


# ---------------------------------------------------------------------------------- checks
def test_real_queue_started_and_torn_down(runs):
    """The queue is the installed TransferQueue release, bound by verl's v1 trainer module
    (not a stand-in): its controller and two SimpleStorage units as Ray actors, every batch
    dispatched to the worker as verl dispatches it; closed and Ray shut down after."""
    q = runs["queue"]
    print(f"\nTransferQueue {q['version']}: started in {q['start_s']:.1f} s, passes "
          f"{q['runs_s']:.1f} s")
    assert runs["bound"]
    assert q["version"] == TQ_VERSION and q["backend"] == "SimpleStorage" and q["units"] == 2
    assert q["actors"] == ["TransferQueueController", "TransferQueueStorageUnit#0",
                           "TransferQueueStorageUnit#1"], q["actors"]
    assert q["controller_after_close"] is False and q["ray_after_shutdown"] is False
    assert [n for n, _ in runs["replay"]["dispatched"]] == [
        "compute_log_prob", "compute_ref_log_prob", "update_actor"]


def _fed(run, like):
    """What verl's rollout correction was fed in ``run`` (its one call): the rollout and old
    log-probs, in the rows of ``fields`` (``like``'s shape)."""
    assert len(run["calls"]) == 1
    call, rows = run["calls"][0], run["rows"]
    T = call["rollout_log_prob"].shape[1]
    corrected, old = torch.zeros_like(like), torch.zeros_like(like)
    corrected[rows, :T] = call["rollout_log_prob"]
    old[rows, :T] = call["old_log_prob"]
    return corrected, old, T


def _kept_mass_checks(got, r, exact):
    legacy, f = r["legacy"], r["fields"]
    mask = f["response_mask"].bool()
    # the kept mass through the queue: row by row the worker's, in the queue's row order
    assert got["kept_queue_type"] == (True, torch.float32)
    assert len(got["kept_queue"]) == len(got["kept_built"]) == f["responses"].shape[0]
    for a, b in zip(got["kept_queue"], got["kept_built"]):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    # what verl's correction was fed: the oracle's (+ log m) within float32, and the legacy
    # trainer's
    corrected, old, T = _fed(got, f["rollout_log_probs"])
    oracle = f["rollout_log_probs"].double() + r["ref"]["kept"]
    assert float((corrected.double() - oracle)[mask].abs().max()) < 2e-5
    assert float((old.double() - r["ref"]["full"])[mask].abs().max()) < 2e-5
    want = f["rollout_log_probs"] + legacy["kept"]
    close = torch.equal if exact else functools.partial(torch.allclose, rtol=0, atol=2e-6)
    assert close(old[mask], legacy["old"][mask])
    assert close(corrected[mask], want[mask])
    # verl's IS weights, rejection mask, metrics: the legacy trainer's
    assert close(got["weights"], legacy["weights"][:, :T])
    assert torch.equal(got["rs_mask"].bool(), legacy["rs_mask"][:, :T].bool())
    assert bool(got["rs_mask"][mask].bool().all())        # none rejected once corrected
    assert torch.equal(got["rollout"][mask], f["rollout_log_probs"][mask])    # left as it was
    rc = {k: v for k, v in legacy["metrics"].items() if k.startswith("rollout_corr/")}
    assert "rollout_corr/gbc_kept_mass_mean" in rc and len(rc) > 5
    for k, v in rc.items():
        tol = 2e-3 if k.endswith("rollout_is_std") else (1e-6 if exact else 1e-5) * max(1.0,
                                                                                       abs(v))
        assert abs(got["metrics"][k] - v) <= tol, (k, got["metrics"][k], v)
    assert abs(got["metrics"]["rollout_corr/rollout_is_mean"] - 1) < 1e-5


def test_kept_mass_through_the_queue_equals_legacy(runs):
    """``support=kept_mass``: verl's v1 ``_compute_old_log_prob`` puts the worker's
    ``gbc_log_kept_mass`` in the real queue, which returns it row by row as the worker built it
    (float32, nested per sequence); gbc's wrap of ``_compute_advantage`` reads it back, and
    verl's rollout correction is fed the legacy trainer's corrected rollout log-probs (``+ log
    m``: the float64 oracle's within float32) and old log-probs bit for bit, so its IS weights
    and rejection mask are the legacy trainer's (and the stand-in queue's) bit for bit and its
    ``rollout_corr/*`` metrics the legacy trainer's; the queue's ``rollout_log_probs`` are left
    as they were."""
    r = runs["kept_mass"]
    assert r["n_legacy_calls"] == 3    # the legacy trainer's, the stand-in queue's, the hand's
    got = r["real"]
    _kept_mass_checks(got, r, exact=True)
    assert torch.equal(got["weights"], r["legacy"]["v1"]["weights"])
    assert got["metrics"]["rollout_corr/rollout_is_mean"] == \
        r["legacy"]["metrics"]["rollout_corr/rollout_is_mean"]


def test_kept_mass_through_the_queue_reordered(runs):
    """The same batch reordered before the old-policy pass, as verl's ``_balance_batch``
    reorders its ``KVBatchMeta``: the queue returns each key's fields (the rollout's, the
    worker's ``gbc_log_kept_mass``) in the batch's new order, and each sample's correction is
    its own (the worker's micro-batches differ: float32 rounding, not bit for bit)."""
    r = runs["kept_mass"]
    got = r["reordered"]
    assert got["rows"] == PERM
    _kept_mass_checks(got, r, exact=False)


def test_kept_mass_refused_when_the_queue_has_none(runs):
    """A worker whose old-policy pass puts no ``gbc_log_kept_mass`` in the real queue (the
    queue's ``kv_batch_get`` leaves a field no sample has out, raising nothing): verl's v1
    rollout correction is refused naming the option, never run on the uncorrected log-probs."""
    msg = runs["kept_mass"]["bare"]["refused"]
    assert msg.startswith("GBC_VERL_OPTIONS: support=kept_mass: verl's rollout correction got "
                          "no 'gbc_log_kept_mass'"), msg


def test_replay_support_ids_round_trip_row_by_row(runs):
    """One kept set per rollout: the ``gbc_support_ids`` verl's v1 old-policy pass put in the
    real queue come back, row by row, as the worker built them: int32, nested per sequence
    (``[j, K]`` a row: the sequence's length, the widest set), bit for bit; read at the
    response positions (as gbc's later passes read them) they are the float64 oracle's kept
    set at every response token, ``-1`` past each response."""
    r = runs["replay"]
    f, ref64 = r["fields"], r["ref"]
    assert r["queued_type"] == (True, torch.jagged, torch.int32)
    lengths = f["attention_mask"].sum(1).tolist()
    assert len(r["queued"]) == len(r["built"]) == B
    for b, (q, built) in enumerate(zip(r["queued"], r["built"])):
        assert q.dtype == built.dtype == torch.int32
        assert q.shape == built.shape and q.shape[0] == lengths[b], (b, q.shape, built.shape)
        assert torch.equal(q, built), b
    grid = r["grid"]
    assert grid.dtype == torch.int32 and grid.shape[:2] == f["responses"].shape
    valid = f["attention_mask"][:, f["prompts"].shape[1]:].bool()
    assert torch.equal(_members(grid, V)[valid], _members(ref64["ids"], V)[valid])
    assert (grid[~valid] == -1).all()
    m = f["response_mask"].bool()
    assert float((r["old"].double() - ref64["over"]).abs()[m].max()) < 2e-5


def test_replay_reference_pass_reads_the_set_from_the_queue(runs):
    """verl's v1 ``_compute_ref_log_prob``: the reference worker reads the old-policy pass's
    ids from the queue (verl's ``tqbridge``) and replays them; its ``ref_log_prob`` in the queue
    is the float64 log-prob over the rollout's kept set (the reference's weights are the
    rollout policy's here), and the stock reference pass's cut to that set."""
    r = runs["replay"]
    m = r["fields"]["response_mask"].bool()
    assert float((r["ref_log_prob"].double() - r["ref"]["over"]).abs()[m].max()) < 2e-5
    stock = r["stock"]["ref"]
    assert float((r["ref_log_prob"] - stock[:, :r["ref_log_prob"].shape[1]]).abs()[m].max()) \
        < 2e-5


def test_replay_update_reads_the_set_from_the_queue(runs):
    """verl's v1 ``_update_actor`` (2 epochs x 2 shuffled mini-batches, SGD lr 0.5): each update
    micro-batch's ids, read from the queue through verl's worker and split, are row by row that
    sequence's oracle set, no target forced into it; the update ends in the parameters of
    verl's stock update (legacy trainer) whose logits are cut in every pass to the float64 set
    of the rollout policy."""
    r = runs["replay"]
    check_seen_ids(r["seen_ids"], r["fields"], r["ref"]["ids"], V)
    shares = [v for _, v in r["forced"]]
    assert len(shares) >= EPOCHS * 2 and max(shares) == 0.0, shares
    logged = [v for k, v in r["metrics"].items() if k.endswith("gbc_support_forced_frac")]
    assert logged == [0.0], r["metrics"]       # verl's update metrics, as the trainer logs them
    got, want = r["params"], r["stock"]["params"]
    top = max(float(w.abs().max()) for w in want.values())
    for n in want:
        assert float((got[n] - want[n]).abs().max()) <= 5e-5 * top, n
    moved = max(float((got[n] - r["params_before"][n]).abs().max()) for n in got)
    assert moved > 100 * 5e-5 * top, moved          # the update moved the policy


def _critical_run(runs):
    r = runs["critical_kl"]
    if "error" in r:
        pytest.fail("the critical-KL run failed:\n" + r["error"][-3000:], pytrace=False)
    return r


def test_critical_kl_weights_through_the_queue_equal_legacy(runs):
    """``critical_kl_exponent`` under verl's v1 trainer: gbc's wrap of its
    ``_compute_ref_log_prob`` asks the reference worker (through the batch's ``extra_info``,
    taken off again after the pass) for the weights; the worker puts them in the real queue and
    gbc puts them back per response token, times the response mask: float32, nested per
    response. Row by row they are the legacy trainer's ``gbc_kl_weight`` (bit for bit: the same
    engine, the same micro-batches), and the float64 oracle's ``((1 - c)·J^γ + c)·mask`` of the
    reference model's certainty; ``ref_log_prob`` as well."""
    from gbc_kernels.integrations.verl import engine as ve

    r = _critical_run(runs)
    f, oracle, legacy, v1 = r["fields"], r["oracle"], r["legacy"], r["v1"]
    print(f"\ncritical KL: legacy + v1 + refusals {r['runs_s']:.1f} s")
    assert v1["dispatched"] == ["compute_log_prob", "compute_ref_log_prob", "update_actor"]
    assert ve.CERTAINTY_KEY not in v1["extra_info_after_ref"], v1["extra_info_after_ref"]
    assert ve.KL_WEIGHT_KEY in v1["update_fields"], v1["update_fields"]
    assert v1["queued_type"] == (True, torch.float32)
    assert v1["queued_lengths"] == f["response_mask"].sum(1).tolist()
    mask = f["response_mask"].bool()
    assert legacy["weight"].dtype == torch.float32
    for b in range(B):
        assert torch.equal(v1["weight"][b], legacy["weight"][b]), b
        assert torch.equal(v1["ref_log_prob"][b][mask[b]], legacy["ref_log_prob"][b][mask[b]]), b
    assert (v1["weight"][~mask] == 0).all()
    # the float64 oracle: weights spread (the test can tell them apart), the intercept's floor
    want = oracle["weight"]
    assert float(want[mask].std()) > 1e-2 and float(want[mask].min()) >= INTERCEPT
    err = (v1["weight"].double() - want).abs()
    assert float(err[mask].max()) <= 2e-6 + 1e-5 * float(want[mask].abs().max()), \
        float(err[mask].max())
    assert float((v1["ref_log_prob"].double() - oracle["logp"]).abs()[mask].max()) < 2e-5


def test_critical_kl_update_through_the_queue_equals_legacy(runs):
    """verl's v1 ``_update_actor`` (2 epochs x 2 shuffled mini-batches, SGD lr 0.5) reads
    ``gbc_kl_weight`` from the queue: each update micro-batch's KL term gets, sequence by
    sequence, the weights of the reference pass (the legacy update's, the oracle's within
    float32); every micro-batch's loss, verl's ``actor/kl_loss`` and ``actor/pg_loss`` and the
    parameters after the update are the legacy trainer's."""
    r = _critical_run(runs)
    f, legacy, v1 = r["fields"], r["legacy"], r["v1"]
    mask = f["response_mask"].bool()
    rows = {}
    for b in range(B):
        keep = f["attention_mask"][b].bool()
        rows[tuple(f["input_ids"][b][keep].tolist())] = b
    for run in (legacy, v1):
        assert len(run["seen"]) == len(run["losses"]) >= EPOCHS * 2
        reads = {}
        for mb in run["seen"]:
            for seq, w in mb.items():
                reads.setdefault(seq, []).append(w)
        assert set(reads) == set(rows)
        for seq, ws in reads.items():
            b = rows[seq]
            assert len(ws) == EPOCHS
            for w in ws:
                assert torch.equal(w, legacy["weight"][b][mask[b]]), b
    assert len(v1["losses"]) == len(legacy["losses"])
    for a, b in zip(v1["losses"], legacy["losses"]):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), (v1["losses"], legacy["losses"])
    for k in ("kl_loss", "pg_loss"):
        assert v1[k] is not None and legacy[k] is not None, k
    assert abs(float(v1["kl_loss"]) - float(legacy["kl_loss"])) <= 1e-6 * max(
        1e-3, abs(float(legacy["kl_loss"])))
    got, want = v1["params"], legacy["params"]
    top = max(float(w.abs().max()) for w in want.values())
    for n in want:
        assert float((got[n] - want[n]).abs().max()) <= 1e-6 * top, n


def test_critical_kl_refused_without_gbc_reference_or_kl_loss(runs):
    """Still refused by name under verl's v1 trainer: a reference worker that is not gbc's
    engine (verl's stock FSDP engine: the queue gets no ``gbc_kl_weight``) — never an update
    with unweighted KL; ``use_kl_loss=False`` (no KL term to weight) before the reference
    worker is called."""
    r = _critical_run(runs)
    stock = r["stock_ref"]
    assert stock["refused"].startswith("critical_kl_exponent: the reference pass returned no "
                                       "KL weights"), stock["refused"]
    assert stock["dispatched"] == ["compute_log_prob", "compute_ref_log_prob"]
    no_kl = r["no_kl_loss"]
    assert no_kl["refused"].startswith("critical_kl_exponent: verl's actor has no KL loss "
                                       "term"), no_kl["refused"]
    assert no_kl["dispatched"] == ["compute_log_prob"]
    from gbc_kernels.integrations.verl import engine as ve
    assert ve.CERTAINTY_KEY not in no_kl["extra_info"]
