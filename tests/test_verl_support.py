"""``support=replay`` / ``support=kept_mass`` (the sampler's kept set rebuilt from verl's rollout
settings, issue 61) in gbc's verl 0.9.1 FSDP and Megatron engines and verl's trainers as gbc
patches them.

The rollouts are drawn here by a sampler that applies verl's settings to the same tiny model:
each response token from the truncated softmax of the model's own float64 logits at the rollout
temperature (``gbc_reference.kept_set``: vLLM's rule, or SGLang's), its log-prob recorded as that
engine returns it (vLLM ``processed_logprobs``: normalised over the kept set; SGLang: the full
vocabulary's). What runs then is verl's and gbc's: gbc's engine on verl's FSDP2
``FSDPEngineWithLMHead`` (its micro-batching, packing, ``ppo_loss``); verl's own trainer
modules (``ray_trainer``, the v1 ``trainer_base`` / ``trainer_sync``, imported as
tests/test_switch_on.py imports them, their rollout-server dependencies empty stand-ins), patched
by ``enable()`` as in a run: the legacy ``RayPPOTrainer._compute_old_log_prob``, the v1
``PPOTrainer._compute_old_log_prob`` / ``_compute_advantage``, both trainers' ``__init__``,
verl's ``compute_rollout_correction_and_add_to_batch``. Stand-ins (said here): verl's worker
module (``ActorRolloutRefWorker.init_model`` builds gbc's engine, ``compute_log_prob`` is
``TrainingWorker.infer_batch``'s call of it with its defaults; gbc's ``_patch_worker`` patches
it as it patches verl's), the trainer objects (built with ``object.__new__``: verl's ``__init__``
starts Ray; gbc's check in it is run as the wrap runs it), the v1 trainer's transfer queue (a
dict of each sample's fields, which the worker group fills with the worker's outputs as verl's
``tqbridge`` does), verl's advantage estimator (after the correction), the CPU platform of
tests/test_verl_engine.py; the Megatron part runs tests/test_verl_megatron.py's harness
(``bshd``) and tests/test_verl_megatron_cp.py's packed-attention model (``thd``, context
parallelism).

Oracles: float64 gbc_reference over the reference kept set (``truncation_support_ids``) on the
plain HF model's hidden states; verl's stock engine step with its logits restricted to that set
by hand; verl's stock rollout-correction function fed the corrected log-probs by hand.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import types

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import spawn_gloo  # noqa: E402

pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")
pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")

from test_other_trainers import verl_actor_config  # noqa: E402
from test_verl_engine import _forward_backward, build_engine, verl_on_cpu  # noqa: E402

V, H = 131, 32
T_ROLL = 0.7                       # the rollout temperature
VLLM = dict(name="vllm", top_k=-1, top_p=0.9)           # verl's default top_k, a top-p cut
SGLANG = dict(name="sglang", top_k=20, top_p=0.95)
RC = dict(rollout_is="token", rollout_is_threshold=1e6, rollout_rs="token_k1",
          rollout_rs_threshold="0.97_1.03", bypass_mode=False)


def per_pass(mode):
    """``EngineOptions(support=mode)``, ``replay`` with the set rebuilt in each pass
    (``support_set=per_pass``: these tests check that rebuild; one kept set per rollout,
    the default: tests/test_verl_support_set.py)."""
    from gbc_kernels.integrations.verl import engine as ve

    return ve.EngineOptions(support=mode,
                            **({"support_set": "per_pass"} if mode == "replay" else {}))


def make_model_dir(path):
    """A tiny Qwen2 whose logits are spread (initializer_range 0.15) so that top-k / top-p cut
    a visible mass, and a word-level tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, initializer_range=0.15)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="t0",
                            eos_token="t1").save_pretrained(path)
    return str(path)


def rollout_config(**over):
    from omegaconf import OmegaConf

    return OmegaConf.create(dict(dict(temperature=T_ROLL, logprobs_mode="processed_logprobs",
                                      calculate_log_probs=True, do_sample=True), **over))


def trainer_config(rollout, rc=RC, strategy="fsdp"):
    from omegaconf import OmegaConf

    return OmegaConf.create(dict(
        actor_rollout_ref=dict(rollout=rollout, actor=dict(strategy=strategy, use_kl_loss=True,
                                                           calculate_sum_pi_squared=False,
                                                           megatron=dict(
                                                               tensor_model_parallel_size=2)),
                               ref=dict(strategy=strategy)),
        algorithm=dict(rollout_correction=rc, use_kl_in_reward=False)))


# -------------------------------------------------------------------------------- the sampler
@torch.no_grad()
def sample_rollouts(model_dir, settings, B=8, Lp=5, Lr=7, seed=0):
    """verl's padded rollout batch (left-padded prompts, right-padded responses) drawn by a
    sampler applying ``settings`` at ``T_ROLL`` to the model's float64 logits, with the
    engine's log-prob of each response token (``rollout_log_probs``)."""
    import gbc_reference as ref
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager").double()
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(2, Lp + 1, (B,), generator=g)
    rlens = torch.randint(3, Lr + 1, (B,), generator=g)
    rlens[0] = Lr
    rule = settings["name"]
    k = settings["top_k"] if settings["top_k"] > 0 else None
    prompts = torch.zeros(B, Lp, dtype=torch.long)
    responses = torch.zeros(B, Lr, dtype=torch.long)
    logps = torch.zeros(B, Lr)
    attn = torch.zeros(B, Lp + Lr, dtype=torch.long)
    for b in range(B):
        p = int(plens[b])
        seq = torch.randint(2, V, (p,), generator=g)
        prompts[b, Lp - p:] = seq
        for t in range(int(rlens[b])):
            logits = model(input_ids=seq[None]).logits[0, -1] / T_ROLL
            keep = ref.kept_set(logits, k, settings["top_p"], rule=rule)
            lq = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), -1)
            y = int(torch.multinomial(lq.exp(), 1, generator=g))
            lp = lq[y] if rule == "vllm" else torch.log_softmax(logits, -1)[y]
            responses[b, t], logps[b, t] = y, float(lp)
            seq = torch.cat([seq, torch.tensor([y])])
        attn[b, Lp - p:Lp + int(rlens[b])] = 1
    gen = torch.Generator().manual_seed(seed + 1)
    reward = (torch.rand(B, generator=gen) < 0.5).float()
    reward[0], reward[1] = 1.0, 0.0
    adv = ((reward - reward.mean()) / (reward.std() + 1e-6))[:, None].expand(B, Lr)
    rmask = attn[:, Lp:].clone()
    return dict(input_ids=torch.cat([prompts, responses], 1), attention_mask=attn,
                position_ids=(attn.cumsum(1) - 1).clamp(min=0), prompts=prompts,
                responses=responses, response_mask=rmask, rollout_log_probs=logps * rmask,
                advantages=(adv * rmask).contiguous())


@torch.no_grad()
def reference(model_dir, fields, settings):
    """float64 gbc_reference of the old / reference pass on the plain HF model: the log-probs
    over the whole vocabulary and over the reference kept set, and ``log_kept_mass``."""
    import gbc_reference as ref
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager").double()
    B, Lp = fields["prompts"].shape
    T = fields["responses"].shape[1]
    hidden = torch.zeros(B, T, H, dtype=torch.float64)
    for b in range(B):
        keep = fields["attention_mask"][b].bool()
        out = model.model(input_ids=fields["input_ids"][b][keep][None]).last_hidden_state[0]
        p, r = int(keep[:Lp].sum()), int(keep[Lp:].sum())
        hidden[b, :r] = out[p - 1:p - 1 + r]
    w, y = model.lm_head.weight.detach(), fields["responses"]
    k = settings["top_k"] if settings["top_k"] > 0 else None
    ids = ref.truncation_support_ids(hidden, w, y, temperature=T_ROLL, top_k=k,
                                     top_p=settings["top_p"], rule=settings["name"])
    full = ref.fused_linear_logprobs(hidden, w, y, temperature=T_ROLL)[0]
    over, _, kept = ref.fused_linear_logprobs(hidden, w, y, temperature=T_ROLL, support_ids=ids,
                                              return_log_kept_mass=True)
    return dict(full=full, over=over, kept=kept, ids=ids)


# ------------------------------------------------- verl's worker and trainer, as gbc patches them
def verl_trainer_modules():
    """verl 0.9.1's trainer modules (``ray_trainer``, the v1 ``trainer_base`` and
    ``trainer_sync``), imported as tests/test_switch_on.py does: its rollout-server packages
    and ``torchdata`` / ``transfer_queue`` are empty stand-ins here (nothing of theirs runs;
    this process only)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "verl_server_deps", os.path.join(HERE, "standins", "verl_server_deps.py"))
    deps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(deps)
    deps.install()
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.v1 import trainer_base, trainer_sync

    return ray_trainer, trainer_base, trainer_sync


def worker_stand_in(model_dir, options):
    """A stand-in of verl's ``engine_workers`` module: ``ActorRolloutRefWorker.init_model``
    builds gbc's FSDP engine for the actor (as the real one does through verl's registry),
    ``compute_log_prob`` is ``TrainingWorker.infer_batch``'s call of the engine with the
    worker's defaults; gbc's ``_patch_worker`` patches it as it patches verl's."""
    from verl.utils import tensordict_utils as tu

    class TrainingWorker:
        def __init__(self, engine):
            self.engine = engine

        def train_mini_batch(self, data):
            raise NotImplementedError

        def infer_batch(self, data):      # verl's defaults, eval mode, the engine, its output
            for key, val in dict(use_remove_padding=True, use_dynamic_bsz=False,
                                 max_token_len_per_gpu=64, micro_batch_size_per_gpu=4,
                                 use_fused_kernels=False).items():
                if key not in data.keys():
                    tu.assign_non_tensor(data, **{key: val})
            with self.engine.eval_mode():
                out = self.engine.infer_batch(data, loss_function=None)
            return tu.get_tensordict(tensor_dict=out["model_output"],
                                     non_tensor_dict={"metrics": {"mfu": 0.0}})

    class ActorRolloutRefWorker:
        def __init__(self, config, role):
            self.config, self.role, self.actor, self.ref = config, role, None, None

        def init_model(self):
            self.actor = TrainingWorker(build_engine(model_dir, lr=0.5, optimizer="SGD",
                                                     options=options))

        def compute_log_prob(self, data):
            return self.actor.infer_batch(data)

    return types.SimpleNamespace(TrainingWorker=TrainingWorker,
                                 ActorRolloutRefWorker=ActorRolloutRefWorker)


class _Meta:
    """A stand-in ``KVBatchMeta``: the batch's keys in the transfer queue."""

    def __init__(self, keys, partition_id="train"):
        self.keys, self.partition_id, self.extra_info = list(keys), partition_id, {}

    def __len__(self):
        return len(self.keys)


class _TransferQueue:
    """A stand-in transfer queue: each sample's fields by key (``kv_batch_get`` returns the
    fields every asked sample has, nested as verl's are)."""

    def __init__(self):
        self.rows = {}

    def kv_batch_put(self, keys, partition_id, fields):
        for f in fields.keys():
            v = fields[f]
            for k, row in zip(keys, v.unbind() if v.is_nested else list(v)):
                self.rows.setdefault(k, {})[f] = row
        return _Meta(keys, partition_id)

    def kv_batch_get(self, keys, partition_id, select_fields):
        from tensordict import TensorDict

        out = {}
        for f in select_fields:
            if all(f in self.rows[k] for k in keys):
                vals = [self.rows[k][f] for k in keys]
                out[f] = (torch.nested.as_nested_tensor(vals, layout=torch.jagged)
                          if vals[0].dim() else torch.stack(vals))
        return TensorDict(out, batch_size=[len(keys)])


def _padded_td(fields, keys=("input_ids", "attention_mask", "position_ids", "prompts",
                              "responses", "response_mask")):
    from tensordict import TensorDict

    B = fields["responses"].shape[0]
    return TensorDict({k: fields[k].clone() for k in keys}, batch_size=[B])


def _v1_pass(mods, config, worker, fields, with_kept=True):
    """verl's v1 trainer (its default): its own ``PPOTrainer._compute_old_log_prob`` and
    ``_compute_advantage`` (gbc's patches on them by ``enable()``) over a stand-in transfer
    queue holding the rollout as verl's v1 trainer does (nested per response); the worker
    group's ``compute_log_prob`` runs the worker on the batch and puts every output field in
    the queue (what verl's ``tqbridge`` does). Returns the queue and the trainer's metrics."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, response_to_nested

    from gbc_kernels.integrations.verl import engine as ve

    _, trainer_base, trainer_sync = mods
    tq = _TransferQueue()
    trainer_base.tq = tq
    B = fields["responses"].shape[0]
    keys = [f"s{b}" for b in range(B)]
    rlens = fields["attention_mask"][:, fields["prompts"].shape[1]:].sum(1).tolist()
    rmask = torch.nested.as_nested_tensor([fields["response_mask"][b, :n]
                                           for b, n in enumerate(rlens)], layout=torch.jagged)
    tq.kv_batch_put(keys, "train", _padded_td(fields, ()).update({
        "uid": torch.arange(B) // 2, "response_mask": rmask,
        "rm_scores": response_to_nested(torch.zeros(B, fields["responses"].shape[1]), rmask),
        "responses": response_to_nested(fields["responses"], rmask),
        "rollout_log_probs": response_to_nested(fields["rollout_log_probs"], rmask)}))

    class WorkerGroup:
        def compute_log_prob(self, meta):
            assert meta.keys == keys
            td = left_right_2_no_padding(_padded_td(fields))
            tu.assign_non_tensor(td, **meta.extra_info)
            out = worker.compute_log_prob(td)
            tq.kv_batch_put(meta.keys, meta.partition_id, out.select(*[
                k for k in out.keys() if isinstance(out.get(k), torch.Tensor)
                and (with_kept or k != ve.LOG_KEPT_MASS_KEY)]))
            return meta

    def estimator(data, **kw):      # verl's advantage estimator, after the correction: stubbed
        data.batch["advantages"] = torch.zeros_like(data.batch["response_mask"], dtype=torch.float)
        data.batch["returns"] = data.batch["advantages"]
        return data

    trainer_base.compute_advantage_for_multi_trajectories = estimator
    trainer = object.__new__(trainer_sync.PPOTrainerSync)
    trainer.config, trainer.actor_rollout_wg = config, WorkerGroup()
    metrics = {}
    meta = trainer._compute_old_log_prob(_Meta(keys), metrics)
    trainer._compute_advantage(meta, metrics)
    return tq, keys, metrics


def _masked_mean(x, mask):
    m = mask.bool()
    return float(x[m].double().mean())


def _step(mode, settings, model_dir, fields, ref64, mods):
    """One trainer step's passes under ``mode``: the worker starts (gbc's engine gets the
    rollout settings), the trainer's start-up check, verl's legacy trainer's old-policy pass
    and rollout correction, the same in verl's v1 trainer; and verl's stock correction with
    the corrected log-probs put in by hand."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo import rollout_corr_helper as rch
    from verl.workers.utils.padding import response_to_nested

    from gbc_kernels.integrations.verl import engine as ve

    ray_trainer = mods[0]
    opts = per_pass(mode)
    ve.enable(opts)             # verl's trainers and rollout correction patched (imported)
    rollout = rollout_config(**settings)
    config = OmegaConf.merge(trainer_config(rollout), OmegaConf.create(dict(
        algorithm=dict(adv_estimator="grpo", gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True),
        actor_rollout_ref=dict(rollout=dict(n=2), actor=dict(loss_agg_mode="token-mean",
                                                             loss_scale_factor=None)))))
    worker_mod = worker_stand_in(model_dir, opts)
    ve._patch_worker(worker_mod)
    worker = worker_mod.ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout")
    worker.init_model()
    engine = worker.actor.engine
    assert engine._gbc_support_role == "actor"
    ve.check_trainer(config)         # what gbc's wrap of the trainers' __init__ runs first
    # verl's legacy trainer: its _compute_old_log_prob (gbc's where it needs the kept mass)
    trainer = object.__new__(ray_trainer.RayPPOTrainer)
    trainer.config, trainer.actor_rollout_wg = config, worker
    batch = DataProto.from_dict(tensors={k: v.clone() for k, v in fields.items()},
                                meta_info={"temperature": T_ROLL})
    old, _ = trainer._compute_old_log_prob(batch)
    out = {"old": old.batch["old_log_probs"].clone()}
    if ve.LOG_KEPT_MASS_KEY in old.batch.keys():
        out["kept"] = old.batch[ve.LOG_KEPT_MASS_KEY].clone()
    batch = batch.union(old)
    rc = OmegaConf.create(RC)
    batch, metrics = rch.compute_rollout_correction_and_add_to_batch(batch, rc)
    assert ve.LOG_KEPT_MASS_KEY not in batch.batch.keys()
    assert torch.equal(batch.batch["rollout_log_probs"], fields["rollout_log_probs"])
    out.update(weights=batch.batch["rollout_is_weights"].clone(), metrics=metrics,
               rs_mask=batch.batch["response_mask"].clone())
    # verl's v1 trainer on the same rollout: the same weights and mask, its queue's
    # rollout_log_probs left as they are
    tq, keys, v1_metrics = _v1_pass(mods, config, worker, fields)
    rmask = tq.kv_batch_get(keys, "train", ["response_mask"])["response_mask"]
    got = tq.kv_batch_get(keys, "train", ["rollout_is_weights", "response_mask",
                                          "rollout_log_probs"])
    out["v1"] = dict(
        weights=got["rollout_is_weights"].to_padded_tensor(0.0),
        rs_mask=got["response_mask"].to_padded_tensor(0),
        rollout_unchanged=torch.equal(
            got["rollout_log_probs"].values(),
            response_to_nested(fields["rollout_log_probs"], rmask).values()),
        metrics=v1_metrics)
    # verl's stock correction, the corrected log-probs put in by hand
    old_hand = ref64["over"] if mode == "replay" else ref64["full"]
    sampler = fields["rollout_log_probs"].double()
    if mode == "kept_mass":
        sampler = sampler + ref64["kept"]
    elif mode == "replay" and settings["name"] == "sglang":
        sampler = sampler - ref64["kept"]
    w, m, met = rch.compute_rollout_correction_and_rejection_mask(
        old_hand.float(), sampler.float(), fields["response_mask"],
        **{k: v for k, v in RC.items() if k != "bypass_mode"})
    out["hand"] = dict(weights=w.batch["rollout_is_weights"], rs_mask=m, metrics=met)
    out["engine"] = engine
    out["batch"] = batch
    if mode == "kept_mass" and settings["name"] == "vllm":
        # a v1 worker whose pass returned no gbc_log_kept_mass: refused, never uncorrected
        try:
            _v1_pass(mods, config, worker, fields, with_kept=False)
            out["v1_refused"] = None
        except ValueError as exc:
            out["v1_refused"] = str(exc)
    return out


def _startup_refusals(mods):
    """verl's trainers refuse a bad ``support`` setting when they are built (gbc's wrap of
    their ``__init__``, before verl's own)."""
    from gbc_kernels.integrations.verl import engine as ve

    ray_trainer, _, trainer_sync = mods
    ve.enable(ve.EngineOptions(support="kept_mass"))
    config = trainer_config(rollout_config(**VLLM), rc=None)
    got = {}
    for name, build in (
            ("v0", lambda: ray_trainer.RayPPOTrainer(config=config, tokenizer=None,
                                                     role_worker_mapping={},
                                                     resource_pool_manager=None)),
            ("v1", lambda: trainer_sync.PPOTrainerSync(config=config))):
        try:
            build()
            got[name] = None
        except ValueError as exc:
            got[name] = str(exc)
    return got


def _support_worker(rank, world, model_dir):
    verl_on_cpu()
    mods = verl_trainer_modules()
    from verl.workers.engine.fsdp import transformer_impl as ti
    from verl.workers.utils.losses import ppo_loss

    import gbc_reference as ref

    results = {"startup": _startup_refusals(mods)}
    for name, settings in (("vllm", VLLM), ("sglang", SGLANG)):
        fields = sample_rollouts(model_dir, settings, seed=3 if name == "vllm" else 5)
        ref64 = reference(model_dir, fields, settings)
        modes = (None, "kept_mass", "replay") if name == "vllm" else (None, "replay")
        runs = {m: _step(m, settings, model_dir, fields, ref64, mods) for m in modes}
        res = {"fields": fields, "ref": ref64}
        for m, run in runs.items():
            res[m] = {k: v for k, v in run.items() if k not in ("engine", "batch")}
            res[m]["ratio_mean"] = _masked_mean(run["weights"], fields["response_mask"])
        if name == "vllm":
            # the update: gbc's replay step against verl's stock step whose logits are cut to
            # the reference kept set by hand; kept_mass's step is the step without a mode
            cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl", entropy_coeff=0.01)
            loss_fn = functools.partial(ppo_loss, config=cfg)
            plain = runs[None]["engine"]
            data = {m: _update_batch(runs[m]["batch"]) for m in ("replay", "kept_mass")}
            steps = {"replay": _forward_backward(runs["replay"]["engine"], data["replay"],
                                                 loss_fn, False),
                     "plain_replay_batch": _forward_backward(plain, data["replay"], loss_fn,
                                                             False),
                     "kept_mass": _forward_backward(runs["kept_mass"]["engine"],
                                                    data["kept_mass"], loss_fn, False),
                     "plain_kept_mass_batch": _forward_backward(plain, data["kept_mass"],
                                                                loss_fn, False)}
            scale = ti._scale_logits_by_temperature

            def cut(logits, temperature, *, is_unit_temperature):
                l = scale(logits, temperature, is_unit_temperature=is_unit_temperature)
                keep = ref.kept_set(l.detach().double(), None, VLLM["top_p"])
                return torch.where(keep, l, torch.full_like(l, -1e4))

            ti._scale_logits_by_temperature = cut
            try:
                steps["stock_cut"] = _forward_backward(runs["replay"]["engine"],
                                                       data["replay"], loss_fn, True)
            finally:
                ti._scale_logits_by_temperature = scale
            res["steps"] = steps
        results[name] = res
    return results


def _update_batch(batch):
    """The actor update's batch from the trainer's: verl's packing of its padded tensors with
    the old / reference log-probs and the rollout IS weights, the worker's keys."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    b = batch.batch
    B = b["responses"].shape[0]
    keys = ("input_ids", "attention_mask", "position_ids", "prompts", "responses",
            "response_mask", "old_log_probs", "advantages", "rollout_is_weights")
    td = TensorDict({k: b[k] for k in keys}, batch_size=[B])
    td["ref_log_prob"] = (b["old_log_probs"] - 0.05).contiguous()
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=T_ROLL, calculate_entropy=True, global_batch_size=B,
                         use_remove_padding=True, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=4, max_token_len_per_gpu=64,
                         use_fused_kernels=False)
    return td


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model_dir = make_model_dir(tmp_path_factory.mktemp("verl_support") / "m")
    return spawn_gloo(1, _support_worker, model_dir)[0]


def _close(a, b, tol):
    return float((a.double() - b.double()).abs().max()) <= tol


def test_old_pass_equals_reference(runs):
    """The old-policy pass through verl's own ``RayPPOTrainer._compute_old_log_prob`` (gbc's
    copy of it where the kept mass is returned): ``replay`` scores over the reference kept set;
    ``kept_mass`` is the full vocabulary's bit for bit (as without support) with
    ``gbc_log_kept_mass`` = the reference's ``LSE_S - LSE_V``."""
    r = runs["vllm"]
    mask = r["fields"]["response_mask"].bool()
    ref64 = r["ref"]
    assert _close(r[None]["old"][mask], ref64["full"][mask], 2e-5)
    assert _close(r["replay"]["old"][mask], ref64["over"][mask], 2e-5)
    assert torch.equal(r["kept_mass"]["old"], r[None]["old"])
    assert _close(r["kept_mass"]["kept"][mask], ref64["kept"][mask], 2e-5)
    assert float(ref64["kept"][mask].exp().mean()) < 0.98       # a visible cut
    # SGLang: replay over SGLang's rule, with log_kept_mass for its full-vocabulary log-probs
    s = runs["sglang"]
    m = s["fields"]["response_mask"].bool()
    assert _close(s["replay"]["old"][m], s["ref"]["over"][m], 2e-5)
    assert _close(s["replay"]["kept"][m], s["ref"]["kept"][m], 2e-5)


def test_rollout_correction_equals_stock_with_corrected_logprobs(runs):
    """verl's ``compute_rollout_correction_and_add_to_batch`` as gbc wraps it equals verl's
    stock ``compute_rollout_correction_and_rejection_mask`` fed the float64 reference old
    log-probs and the sampler's log-probs corrected by hand (``kept_mass``: ``+ log m``;
    ``replay`` against SGLang: ``- log m``): IS weights, rejection mask, metrics. verl's v1
    trainer (its own old-policy pass and advantage step over the transfer queue) gives the
    legacy trainer's weights and mask, its queue's ``rollout_log_probs`` untouched."""
    for name, modes in (("vllm", (None, "kept_mass", "replay")), ("sglang", (None, "replay"))):
        for mode in modes:
            got, hand = runs[name][mode], runs[name][mode]["hand"]
            mask = runs[name]["fields"]["response_mask"].bool()
            assert _close(got["weights"][mask], hand["weights"][mask], 5e-5), (name, mode)
            assert torch.equal(got["rs_mask"], hand["rs_mask"]), (name, mode)
            for k, v in hand["metrics"].items():
                # verl's std is sqrt(E[w^2] - E[w]^2) in float32: sqrt of rounding noise when
                # every weight is ~1
                tol = 2e-3 if k.endswith("rollout_is_std") else 1e-4 * max(1.0, abs(v))
                assert abs(got["metrics"][k] - v) <= tol, (name, mode, k, got["metrics"][k], v)
            v1 = got["v1"]
            T = v1["weights"].shape[1]
            assert torch.equal(v1["weights"], got["weights"][:, :T]), (name, mode)
            assert torch.equal(v1["rs_mask"].bool(), got["rs_mask"][:, :T].bool()), (name, mode)
            assert v1["rollout_unchanged"]
            assert v1["metrics"]["rollout_corr/rollout_is_mean"] == \
                got["metrics"]["rollout_corr/rollout_is_mean"]


def test_sampler_ratio_mean_moves_from_kept_mass_to_one(runs):
    """Issue 61's measurement: exp(old − sampler) over the response tokens (verl's
    ``rollout_corr/rollout_is_mean``, untruncated) is the kept mass without a mode and 1 within
    float32 noise with either; verl's token_k1 rejection (0.97, 1.03) drops most tokens without
    a mode and none with one. SGLang's full-vocabulary log-probs: 1 without a mode and with
    replay (its log-probs moved onto the kept set)."""
    r = runs["vllm"]
    mask = r["fields"]["response_mask"].bool()
    kept = float(r["ref"]["kept"][mask].exp().mean())
    means = {m: r[m]["ratio_mean"] for m in (None, "kept_mass", "replay")}
    print(f"\nverl vLLM top_p={VLLM['top_p']} T={T_ROLL}: sampler-ratio mean without "
          f"{means[None]:.5f} (kept mass {kept:.5f}), kept_mass {means['kept_mass']:.7f}, "
          f"replay {means['replay']:.7f}")
    assert abs(means[None] - kept) < 1e-4 and means[None] < 1 - 0.02
    assert abs(means["kept_mass"] - 1) < 1e-5 and abs(means["replay"] - 1) < 1e-5
    for m in (None, "kept_mass", "replay"):
        assert r[m]["metrics"]["rollout_corr/rollout_is_mean"] == pytest.approx(
            r[m]["ratio_mean"], rel=1e-5)
    assert r[None]["rs_mask"][mask].float().mean() < 0.5
    assert bool(r["kept_mass"]["rs_mask"][mask].all()) and bool(r["replay"]["rs_mask"][mask].all())
    assert r["kept_mass"]["metrics"]["rollout_corr/gbc_kept_mass_mean"] == pytest.approx(
        kept, abs=1e-4)
    s = runs["sglang"]
    m = s["fields"]["response_mask"].bool()
    print(f"verl SGLang top_k={SGLANG['top_k']} top_p={SGLANG['top_p']}: without "
          f"{s[None]['ratio_mean']:.7f}, replay {s['replay']['ratio_mean']:.7f}")
    assert abs(s[None]["ratio_mean"] - 1) < 1e-5 and abs(s["replay"]["ratio_mean"] - 1) < 1e-5
    assert float(s["ref"]["kept"][m].exp().mean()) < 0.98


def test_replay_update_equals_stock_step_over_the_kept_set(runs):
    """The actor update under ``replay`` (gbc's fused loss over the set rebuilt from each
    micro-batch's logits) equals verl's stock engine step whose temperature-scaled logits are
    cut to the reference kept set by hand: loss, every gradient, verl's metrics; no target
    forced into the set. ``kept_mass`` leaves the update as it is without a mode."""
    steps = runs["vllm"]["steps"]
    (l0, m0, g0), (l1, m1, g1) = steps["stock_cut"], steps["replay"]
    assert abs(l0 - l1) <= 2e-5 * max(1.0, abs(l0))
    assert m1["actor/gbc_support_forced_frac"] == [0.0] * len(m1["actor/gbc_support_forced_frac"])
    for k in m0:
        for a, b in zip(m0[k], m1[k]):
            assert abs(a - b) <= 2e-5 * max(1.0, abs(a)) + 1e-6, (k, a, b)
    top = max(float(g.abs().max()) for g in g0.values())
    for n in g0:
        assert float((g0[n] - g1[n]).abs().max()) <= 2e-5 * top, n
    (l2, _, g2), (l3, _, g3) = steps["kept_mass"], steps["plain_kept_mass_batch"]
    assert l2 == l3 and all(torch.equal(g2[n], g3[n]) for n in g2)
    assert abs(l1 - steps["plain_replay_batch"][0]) > 1e-4      # replay moved the loss


def test_trainers_refuse_at_start_and_without_kept_mass(runs):
    """verl's own ``RayPPOTrainer`` and v1 ``PPOTrainerSync`` refuse ``support=kept_mass``
    without a rollout correction when they are built (gbc's check before verl's init); verl's
    v1 trainer whose worker returned no ``gbc_log_kept_mass`` (not gbc's engine) refuses the
    correction naming the option, never runs it uncorrected."""
    for name in ("v0", "v1"):
        assert runs["startup"][name].startswith(
            "algorithm.rollout_correction: None: GBC_VERL_OPTIONS support=kept_mass"), \
            runs["startup"][name]
    assert runs["vllm"]["kept_mass"]["v1_refused"].startswith(
        "GBC_VERL_OPTIONS: support=kept_mass: verl's rollout correction got no "
        "'gbc_log_kept_mass'"), runs["vllm"]["kept_mass"]["v1_refused"]


# ------------------------------------------------------------------------------- refusals
def _plan(options="support=replay", trainer=False, rc=RC, strategy="fsdp", **rollout):
    from gbc_kernels.integrations.verl import engine as ve

    opts = ve.EngineOptions.parse(options)
    r = rollout_config(**dict(VLLM, **rollout))
    if trainer:
        return ve.trainer_support_plan(trainer_config(r, rc, strategy), opts)
    return ve.support_plan(opts, r)


def test_options_and_plan():
    """``GBC_VERL_OPTIONS`` takes ``support`` / ``support_ties`` (the registry route refuses
    them, tests/test_support_options.py); the plan maps verl's rollout settings: top_k -1 / 0:
    no bound, vLLM's rule with ties "first" (vLLM 0.24's Triton sampler), SGLang's rule with
    its full-vocabulary log-probs."""
    from gbc_kernels.integrations.verl import engine as ve

    assert ve.EngineOptions.parse("") == ve.EngineOptions()
    p = _plan()
    assert (p.mode, p.normalised, p.corrects_sampler) == ("replay", True, False)
    assert (p.truncation.top_k, p.truncation.top_p, p.truncation.ties, p.truncation.rule) == \
        (None, 0.9, "first", "vllm")
    assert _plan("support=kept_mass,support_ties=all", top_k=0, top_p=0.5).truncation.ties == "all"
    p = _plan(name="sglang", top_k=20)
    assert (p.normalised, p.corrects_sampler, p.truncation.rule) == (False, True, "sglang")
    assert _plan("") is None and _plan("support=off") is None
    assert _plan("support=kept_mass", trainer=True).mode == "kept_mass"
    # replay without verl's rollout correction: the policy over the set, nothing to move
    assert _plan(trainer=True, rc=None, calculate_log_probs=False).mode == "replay"


REFUSALS = [
    (dict(top_p=1.0), "GBC_VERL_OPTIONS support=replay: actor_rollout_ref.rollout.top_k=-1 and "
                      "top_p=1.0: the rollout samples without truncation"),
    (dict(top_k=0, top_p=1.0), "GBC_VERL_OPTIONS support=replay: actor_rollout_ref.rollout"
                               ".top_k=0 and top_p=1.0"),
    (dict(top_p=0.0), r"actor_rollout_ref.rollout.top_p=0.0: expected a float in \(0, 1\]"),
    (dict(top_p=1.5), r"actor_rollout_ref.rollout.top_p=1.5: expected a float in \(0, 1\]"),
    (dict(name="hf"), "actor_rollout_ref.rollout.name='hf': GBC_VERL_OPTIONS support=replay "
                      "rebuilds the kept set by vLLM's or SGLang's"),
    (dict(logprobs_mode="raw_logprobs"), "actor_rollout_ref.rollout.logprobs_mode=raw_logprobs:"),
    (dict(options="support=kept_mass", name="sglang"),
     "GBC_VERL_OPTIONS support=kept_mass: actor_rollout_ref.rollout.name=sglang returns the full "
     "vocabulary's log-probs"),
    (dict(options="support_ties=all"), "GBC_VERL_OPTIONS: support_ties=all: set without support"),
    (dict(options="support=replay,nthr=1", trainer=True), "GBC_VERL_OPTIONS: nthr: NTHR's scores"),
    (dict(options="support=kept_mass", trainer=True, rc=None),
     "algorithm.rollout_correction: None: GBC_VERL_OPTIONS support=kept_mass"),
    (dict(options="support=kept_mass", trainer=True, rc=dict(RC, bypass_mode=True)),
     "algorithm.rollout_correction: bypass_mode=True"),
    (dict(options="support=kept_mass", trainer=True,
          rc=dict(RC, rollout_is=None, rollout_rs=None)),
     "algorithm.rollout_correction: rollout_is=None and rollout_rs=None"),
    (dict(options="support=kept_mass", trainer=True, calculate_log_probs=False),
     "actor_rollout_ref.rollout.calculate_log_probs=False: GBC_VERL_OPTIONS support=kept_mass"),
    (dict(trainer=True, strategy="megatron"),
     "actor_rollout_ref.rollout.top_p=0.9 without a top_k bound "
     r"\(actor_rollout_ref.rollout.top_k=-1\): under Megatron's tensor parallelism "
     r"\(actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"),
]


@pytest.mark.parametrize("kw,match", REFUSALS, ids=[m[:40] for _, m in REFUSALS])
def test_bad_settings_refused_by_name(kw, match):
    """Settings ``support`` cannot run exactly are refused at start-up (the trainer's and the
    worker's), naming verl's option or gbc's."""
    with pytest.raises(ValueError, match="^" + match):
        _plan(**kw)
    # under Megatron with a top-k bound the top-p cut is exact: accepted
    assert _plan(trainer=True, strategy="megatron", top_k=50).truncation.top_k == 50


TRAINER_ONLY = [
    (dict(calculate_log_probs=False), RC,
     "actor_rollout_ref.rollout.calculate_log_probs=False: GBC_VERL_OPTIONS support=kept_mass"),
    ({}, None, "algorithm.rollout_correction: None: GBC_VERL_OPTIONS support=kept_mass"),
    ({}, dict(RC, bypass_mode=True),
     "algorithm.rollout_correction: bypass_mode=True: GBC_VERL_OPTIONS support=kept_mass"),
]


@pytest.mark.parametrize("rollout,rc,match", TRAINER_ONLY, ids=["calculate_log_probs",
                                                                "no_correction", "bypass_mode"])
def test_rollout_correction_refused_by_the_trainer_not_the_worker(rollout, rc, match):
    """docs/verl.md, "Refused at start-up": the worker's check (gbc's wrap of
    ``ActorRolloutRefWorker.init_model``) sees the rollout config only, and starts a worker
    whose ``support=kept_mass`` would feed no rollout correction; the trainer's (gbc's wrap of
    the trainers' ``__init__``) sees the whole config and refuses it before verl's init,
    naming the field."""
    from gbc_kernels.integrations.verl import engine as ve
    from gbc_kernels.integrations.verl import trainer as vt

    r = rollout_config(**dict(VLLM, **rollout))
    ve._OPTIONS["current"] = ve.EngineOptions(support="kept_mass")
    try:
        started = []
        init_model = ve._support_on_init(lambda self: started.append("worker"))
        init_model(types.SimpleNamespace(config=types.SimpleNamespace(rollout=r)))
        assert started == ["worker"]
        # the wrap of the legacy RayPPOTrainer's and the v1 PPOTrainer's __init__ (the same)
        trainer_init = vt._checked_init(lambda self, config: started.append("trainer"))
        with pytest.raises(ValueError, match="^" + re.escape(match)):
            trainer_init(object(), trainer_config(r, rc))
        assert started == ["worker"]            # verl's init never ran
        trainer_init(object(), trainer_config(rollout_config(**VLLM)))     # a good config
        assert started == ["worker", "trainer"]
    finally:
        ve._OPTIONS.pop("current", None)
        ve._OPTIONS.pop("plan", None)


def test_engine_without_rollout_settings_refused():
    """An engine that never got the rollout's settings (built outside verl's
    ActorRolloutRefWorker) refuses ``support`` at its first step; one that did plans again
    when its options change."""
    from gbc_kernels.integrations.verl import engine as ve

    class Engine(ve.EngineMethods):
        gbc_options = ve.EngineOptions(support="replay")

    e = Engine()
    with pytest.raises(ValueError, match="^GBC_VERL_OPTIONS: support=replay: this engine has not "
                                         "got the rollout's sampling settings"):
        e._gbc_plan()
    assert e.gbc_attach_rollout(rollout_config(**VLLM)).mode == "replay"
    Engine.gbc_options = ve.EngineOptions(support="kept_mass")
    assert e._gbc_plan().mode == "kept_mass"
    Engine.gbc_options = ve.EngineOptions()
    assert e._gbc_plan() is None
    Engine.gbc_options = ve.EngineOptions(support="replay", nthr=True)
    with pytest.raises(ValueError, match="^GBC_VERL_OPTIONS: nthr: NTHR's scores"):
        e.gbc_attach_rollout(rollout_config(**VLLM))


# ------------------------------------------------------------------- gbc's Megatron engine
MEGATRON = dict(name="vllm", top_k=12, top_p=0.9)      # a top-k bound: exact under TP


def _cut_processor(stock_processor, settings, tp):
    """verl's stock ``_lm_head_logits_processor`` with this shard's logits cut by hand to the
    kept set of the whole vocabulary (gathered over the tensor-parallel group, the rule of
    gbc_reference on the temperature-scaled logits, the target always kept); forward-only
    passes also return the hand's ``log_kept_mass`` as ``hand_kept``."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    import gbc_reference as ref

    def processor(self, logits, label, temperature, **kw):
        group = parallel_state.get_tensor_model_parallel_group()
        shards = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(shards, logits.detach().contiguous(), group=group)
        t = temperature.clone()
        t[t <= 0] = 1e-8
        full = torch.cat(shards, -1).double() / t.unsqueeze(-1).double()
        keep = ref.kept_set(full, settings["top_k"], settings["top_p"])
        keep.scatter_(-1, label.long().unsqueeze(-1), True)
        kept = (torch.logsumexp(full.masked_fill(~keep, float("-inf")), -1)
                - torch.logsumexp(full, -1))
        n = logits.shape[-1]
        lo = parallel_state.get_tensor_model_parallel_rank() * n
        cut = torch.where(keep[..., lo:lo + n], logits, torch.full_like(logits, -1e4))
        ret = stock_processor(self, cut, label, temperature, **kw)
        if kw.get("logits_processor_func") is None:
            ret["hand_kept"] = kept.to(logits.dtype)
        return ret

    return processor


def _megatron_worker(rank, world, tp, sp, thd=False, cp=1):
    """At TP ``tp`` (+ sequence parallelism ``sp``) and context parallel ``cp``, in the packed
    ``thd`` layout (``use_remove_padding=True``; tests/test_verl_megatron_cp.py's model, whose
    core attention is the packed stand-in; context parallelism is thd only) or the padded
    ``bshd`` one (tests/test_verl_megatron.py's): gbc's engine under ``replay`` (the set rebuilt
    in each pass, ``support_set=per_pass``), ``kept_mass`` and neither; verl's stock engine
    plain and with its logits cut by hand to the kept set of the whole (gathered) vocabulary
    (:func:`_cut_processor`, recording that set: tests/test_verl_support_set.py's
    ``_recording``, also over the update's batch for the forced share); the start-up
    refusal of top-p without a top-k bound."""
    from test_verl_megatron import (_batch, _engine, _grads, _infer, _loss_fn, _metric_values,
                                    _padded, _responses)
    from test_verl_support_set import HAND_K, _recording, megatron_layout
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    from verl.workers.utils.padding import no_padding_2_padding

    from gbc_kernels.integrations.verl import engine as ve

    setup, config = megatron_layout(tp, sp, thd, cp)
    rollout = rollout_config(**MEGATRON)
    keys = ("log_probs", "entropy", "sum_pi_squared")
    out = {}

    def passes(engine, extra=()):
        res = {}
        for name, entropy in (("old", True), ("ref", False)):
            data = _batch(seed=7)
            o = _infer(engine, data, calculate_entropy=entropy)
            res[name] = {k: _responses(o, k, data) for k in keys + tuple(extra)
                         if k in o["model_output"]}
        return res

    def step(engine):
        data = _batch(seed=11)
        torch.manual_seed(1234)
        o = engine.forward_backward_batch(data, _loss_fn(), forward_only=False)
        return dict(loss=float(sum(o["loss"])), metrics=_metric_values(o["metrics"]))

    for mode in ("replay", "kept_mass", None):
        model = setup()
        engine = _engine(model, options=per_pass(mode), **config)
        engine.gbc_attach_rollout(rollout, "actor")       # what init_model hands it
        out[mode] = passes(engine, (ve.LOG_KEPT_MASS_KEY,))
        out[mode]["step"] = step(engine)
        out[mode]["step"]["grads"] = _grads(model)
    stock_processor = MegatronEngineWithLMHead._lm_head_logits_processor
    for name, processor in (("stock", stock_processor),
                            ("cut", _recording(_cut_processor(stock_processor, MEGATRON, tp)))):
        model = setup()
        engine = _engine(model, gbc=False, **config)
        MegatronEngineWithLMHead._lm_head_logits_processor = processor
        try:
            out[name] = passes(engine, ("hand_kept",))
            out[name]["step"] = step(engine)
            out[name]["step"]["grads"] = _grads(model)
            if name == "cut":   # the hand's set over the update's batch, by verl's unpacking
                data = _batch(seed=11)
                o = _infer(engine, data, calculate_entropy=False)["model_output"]
                out[name]["step"].update(
                    targets=_padded(data["responses"]),
                    mask=_padded(data["response_mask"]).bool(),
                    hand_ids=torch.stack(
                        [(no_padding_2_padding(o[f"hand_id_{k}"] + 1, data) - 1).round().long()
                         for k in range(HAND_K)], -1))
        finally:
            MegatronEngineWithLMHead._lm_head_logits_processor = stock_processor
    # start-up: top-p without a top-k bound under TP is refused in verl's words where the
    # engine rebuilds the set (not kept_mass's reference engine: its pass is the full
    # vocabulary's); at TP 1 (each rank the whole vocabulary) it is taken
    model = setup()
    unbounded = rollout_config(name="vllm", top_k=-1, top_p=0.9)
    engine = _engine(model, options=ve.EngineOptions(support="kept_mass"), **config)
    out["kept_mass_ref"] = engine.gbc_attach_rollout(unbounded, "ref").mode
    engine = _engine(model, options=ve.EngineOptions(support="replay"), **config)
    try:
        engine.gbc_attach_rollout(unbounded, "ref")
        out["refused"] = None
    except ValueError as exc:
        out["refused"] = str(exc)
    out["tp"] = tp
    out["old_mask"] = _padded(_batch(seed=7)["response_mask"]).bool()
    return out


# each layout (tests/test_verl_support_set.py's MEGATRON_LAYOUTS: ranks, tp, sequence
# parallel, thd, cp) a spawned gloo run: bshd and packed thd at TP 2 + SP, thd at CP 2
MEGATRON_LAYOUT_NAMES = ("bshd_tp2_sp", "thd_tp2_sp", "thd_cp2")


@pytest.fixture(scope="module", params=MEGATRON_LAYOUT_NAMES)
def megatron_runs(request):
    pytest.importorskip("megatron.core")
    pytest.importorskip("verl.workers.engine.megatron.transformer_impl")
    from test_verl_support_set import MEGATRON_LAYOUTS

    world, *args = MEGATRON_LAYOUTS[request.param]
    return spawn_gloo(world, _megatron_worker, *args)


def _mclose(a, b, tol, what):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol, msg=what)


def test_megatron_passes_equal_stock_over_the_kept_set(megatron_runs):
    """gbc's Megatron engine in each layout — the padded ``bshd`` and the packed ``thd``
    (``use_remove_padding=True``, verl's default) at TP 2 with sequence parallelism, ``thd`` at
    context parallel 2 (each rank its own load-balanced chunks, verl joining the outputs over
    the CP group) — on a float64 tiny GPTModel (padded vocabulary, top_k 12 / top_p 0.9 on its
    logits): ``replay``'s old-policy and reference passes (the set rebuilt in each,
    ``support_set=per_pass``) equal verl's stock engine's whose logits are cut by hand to the
    kept set of the whole (gathered) vocabulary (log_probs, entropy, sum_pi_squared);
    ``kept_mass``'s old pass is verl's plain one with ``gbc_log_kept_mass`` = the hand's
    ``LSE_S − LSE_V`` at every response token (read back through verl's own unpacking), its
    reference pass the plain one."""
    from gbc_kernels.integrations.verl import engine as ve

    for r, out in enumerate(megatron_runs):
        for p in ("old", "ref"):
            for k in out["cut"][p]:
                if k == "hand_kept":
                    continue
                _mclose(out["replay"][p][k], out["cut"][p][k], 1e-6, f"rank {r} replay {p} {k}")
                _mclose(out["kept_mass"][p][k], out["stock"][p][k], 1e-6,
                        f"rank {r} kept_mass {p} {k}")
                assert torch.equal(out["kept_mass"][p][k], out[None][p][k])
        assert ve.LOG_KEPT_MASS_KEY not in out["replay"]["old"]      # vLLM: nothing to move
        assert ve.LOG_KEPT_MASS_KEY not in out["kept_mass"]["ref"]
        kept = out["kept_mass"]["old"][ve.LOG_KEPT_MASS_KEY]
        _mclose(kept, out["cut"]["old"]["hand_kept"], 1e-6, f"rank {r} log_kept_mass")
        # a kept mass below 1 at most response tokens (0 off the response mask)
        mask = out["old_mask"][:, :kept.shape[1]]
        assert (kept[mask] < -1e-6).float().mean() > 0.5 and (kept[~mask] == 0).all(), r


def test_megatron_replay_update_equals_stock_step_over_the_kept_set(megatron_runs):
    """The ``replay`` update in each layout (gbc_mcore's loss with the kept set rebuilt in the
    row pass; under context parallelism each rank's own tokens) equals verl's stock Megatron
    step whose logits are cut by hand: loss, verl's metrics, every parameter's gradient; gbc's
    ``support_forced_frac`` is each micro-batch's share of targets outside the hand's set (the
    whole micro-batch's, on every rank); ``kept_mass``'s update is the plain one."""
    for r, out in enumerate(megatron_runs):
        got, want = out["replay"]["step"], out["cut"]["step"]
        assert abs(got["loss"] - want["loss"]) < 1e-7, r
        for k, v in want["metrics"].items():
            _mclose(torch.tensor(v), torch.tensor(got["metrics"][k]), 1e-5, f"rank {r} {k}")
        # each update micro-batch's (2 rows, in order) masked-in targets outside the hand's set
        hand = want["hand_ids"]
        T = hand.shape[1]
        mask = want["mask"][:, :T]
        forced = ~(hand == want["targets"][:, :T, None]).any(-1) & mask
        shares = [float(forced[i:i + 2].sum()) / max(1.0, float(mask[i:i + 2].sum()))
                  for i in range(0, forced.shape[0], 2)]
        assert any(x > 0 for x in shares), shares                       # random targets
        assert got["metrics"]["actor/gbc_support_forced_frac"] == pytest.approx(shares), r
        for k in want["grads"]:
            _mclose(got["grads"][k], want["grads"][k], 1e-6, f"rank {r} grad {k}")
        km, plain = out["kept_mass"]["step"], out[None]["step"]
        assert km["loss"] == plain["loss"]
        assert all(torch.equal(km["grads"][k], plain["grads"][k]) for k in plain["grads"])
        assert abs(got["loss"] - plain["loss"]) > 1e-4


def test_megatron_top_p_without_top_k_refused_at_start(megatron_runs):
    """Under Megatron's tensor parallelism top-p without a top-k bound is refused when the
    worker hands the engine the rollout settings, naming verl's options, where the engine
    rebuilds the set (``kept_mass``'s reference engine scores the whole vocabulary); at TP 1
    (the context-parallel layout: each rank the whole vocabulary) it is taken."""
    for out in megatron_runs:
        assert out["kept_mass_ref"] == "kept_mass"
        if out["tp"] == 1:
            assert out["refused"] is None
            continue
        assert out["refused"].startswith(
            "actor_rollout_ref.rollout.top_p=0.9 without a top_k bound "
            "(actor_rollout_ref.rollout.top_k=-1): under Megatron's tensor parallelism "
            "(actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2"), out["refused"]


# ------------------------------------------------------- Ulysses sequence parallelism (FSDP)
ULYSSES = dict(name="vllm", top_k=20, top_p=0.9)


def _ulysses_worker(rank, world, model_dir, sp):
    """At Ulysses SP ``sp`` (tests/test_verl_ulysses.py's harness): for each mode, the
    old-policy pass's outputs and one update's loss and gradients on the same batch."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from gbc_kernels.integrations.verl import engine as ve
    from test_verl_engine import make_batch
    from test_verl_ulysses import _forward_backward as sp_forward_backward
    from test_verl_ulysses import build_engine as sp_engine

    engine = sp_engine(model_dir, sp, lr=0.5, optimizer="SGD")
    cfg = verl_actor_config("gspo", "seq-mean-token-mean", "low_var_kl", entropy_coeff=0.01)
    loss_fn = functools.partial(ppo_loss, config=cfg)
    out = {}
    for mode in ("replay", "kept_mass"):
        type(engine).gbc_options = per_pass(mode)
        engine.gbc_attach_rollout(rollout_config(**ULYSSES), "actor")
        data = make_batch(21, 6, temperature=0.8, lengths=(7, 9))
        td = data.clone()
        tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=True,
                             compute_loss=False)
        with engine.eval_mode():
            o = engine.infer_batch(td, loss_function=None)["model_output"]
        out[mode] = {k: no_padding_2_padding(v, data) for k, v in o.items()}
        out[mode]["step"] = sp_forward_backward(engine, data, loss_fn, False)
    return out


@pytest.fixture(scope="module")
def ulysses_runs(tmp_path_factory):
    from test_verl_engine import make_model_dir as plain_model_dir

    model_dir = plain_model_dir(tmp_path_factory.mktemp("verl_support_sp") / "m")
    return spawn_gloo(2, _ulysses_worker, model_dir, 2), spawn_gloo(1, _ulysses_worker,
                                                                     model_dir, 1)[0]


def test_ulysses_sp2_equals_sp1(ulysses_runs):
    """Under Ulysses SP 2 each rank rebuilds the set for its own rows: the old-policy pass
    (``replay``: over the set; ``kept_mass``: the whole vocabulary's with
    ``gbc_log_kept_mass``) and the update (loss, verl's metrics with
    ``gbc_support_forced_frac`` over the whole sequences, every gradient) equal SP 1."""
    from gbc_kernels.integrations.verl import engine as ve

    sp2, sp1 = ulysses_runs
    assert ve.LOG_KEPT_MASS_KEY in sp1["kept_mass"]
    for r, got in enumerate(sp2):
        for mode in ("replay", "kept_mass"):
            for k, v in sp1[mode].items():
                if k == "step":
                    continue
                assert _close(got[mode][k], v, 2e-5), (r, mode, k)
            (l0, m0, g0), (l1, m1, g1) = sp1[mode]["step"], got[mode]["step"]
            assert abs(l0 - l1) <= 2e-5 * max(1.0, abs(l0)), (r, mode)
            for k in m0:
                for a, b in zip(m0[k], m1[k]):
                    assert abs(a - b) <= 2e-5 * max(1.0, abs(a)) + 1e-6, (r, mode, k, a, b)
            top = max(float(g.abs().max()) for g in g0.values())
            for n in g0:
                assert float((g0[n] - g1[n]).abs().max()) <= 2e-5 * top, (r, mode, n)
        assert got["replay"]["step"][1]["actor/gbc_support_forced_frac"][0] > 0
