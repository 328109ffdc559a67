"""OpenRLHF 0.11.2 with one kept set per rollout (issue 66): ``support=replay``'s default
(``support_set`` None or ``"rollout"``). The experience maker's actor pass (the old policy, the
patched ``Actor.forward``) builds the sampler's kept set from its own logits
(``return_support_ids``), the replay buffer's ``append`` stores its ids in each sample's
``info`` (through OpenRLHF's split, shuffle and collate), and every update of every epoch and
both of Lopti's phases score exactly that set (``support_ids``, the support route), against
OpenRLHF's stock step (its ``PolicyLoss`` and ``aggregate_loss``) fed the log-probs over the
set ``gbc_reference.kept_set`` builds from the float64 logits of the policy that sampled.
``support_set=per_pass`` (each pass rebuilds the set from the model it scores) is kept, and
measured beside it: its forced share grows as the policy moves, one set per rollout's stays
the building pass's. The rollouts and references are test_openrlhf_support's.
"""

from __future__ import annotations

import copy
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

import test_openrlhf as T_
import test_openrlhf_support as S
from test_openrlhf import ORL, tiny_model
from test_openrlhf_support import (B, P, TEMP, TOP_P, MODE_ARGS, _enable, _sgd,
                                   make_experience, methods_off, ref64, sample_rollouts,
                                   sargs, trainer)  # noqa: F401 (methods_off: a fixture)

import gbc_reference as R  # noqa: E402
from gbc_kernels.integrations import openrlhf as gorl  # noqa: E402
from gbc_kernels.integrations.openrlhf import trainer as gtrainer  # noqa: E402

# the modes without a reference model (with one: test_reference_scores_the_actors_set)
ROLLOUT_ARGS = {k: v for k, v in MODE_ARGS.items() if "kl" not in v}
ROLLOUT_ARGS["ppo-token-mask-entropy"] = dict(entropy_coef=0.01, is_level="token")
MB, EPOCHS = 4, 2                   # OpenRLHF's micro-batch (sample_batch_size) and max_epochs


def _z64(model, exp):
    """The float64 logits of ``model`` at the actions, at the rollout temperature."""
    m64 = copy.deepcopy(model).double()
    m64.config._attn_implementation = "eager"
    am, Tn = exp.attention_mask, exp.action_mask.shape[1]
    pos = (am.long().cumsum(-1) - 1).masked_fill(am == 0, 1)
    with torch.no_grad():
        z = m64(exp.sequences, attention_mask=am, position_ids=pos).logits[:, -Tn - 1:-1]
    return z.double() / TEMP


def _as_mask(ids, vocab=T_.V):
    """Kept ids ``[B, T, K]`` (``-1`` padded) as a ``[B, T, V]`` bool mask."""
    out = torch.zeros(*ids.shape[:2], vocab + 1, dtype=torch.bool)
    out.scatter_(-1, ids.long().masked_fill(ids < 0, vocab), True)
    return out[..., :vocab]


def over_set(model, keep):
    """An ``Actor``-like callable for ``openrlhf_loss``: the policy's log-probs (and entropy)
    with autograd over the FIXED set ``keep`` ``[B, T, V]`` (the target forced in), from full
    logits: the stock step over the rollout's set."""
    def call(sequences, action_mask, attention_mask=None, return_output=False,
             return_entropy=False):
        Tn = action_mask.shape[1]
        pos = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        z = model(sequences, attention_mask=attention_mask,
                  position_ids=pos).logits[:, -Tn - 1:-1].float() / TEMP
        y = sequences[:, -Tn:]
        k = keep[:, :Tn].scatter(-1, y[..., None], True)
        q = z.masked_fill(~k, float("-inf")).log_softmax(-1)
        logp = q.gather(-1, y[..., None])[..., 0]
        ent = -(q.exp() * q.masked_fill(~k, 0.0)).sum(-1)
        return (logp, type("O", (), {"entropy": ent})()) if return_output else logp
    return call


def _rows(batch, exp):
    """Which samples of the rollout ``exp`` a collated micro-batch holds (by their prompts)."""
    return torch.tensor([int((exp.sequences[:, :P] == row[:P]).all(-1).nonzero()[0])
                         for row in batch.sequences])


def _epochs(t, seed=0):
    """OpenRLHF's ``ppo_train`` as far as the update goes (its module imports vLLM): a
    ``DataLoader`` over the replay buffer, shuffled, ``collate_fn`` the buffer's own, for
    ``max_epochs``; each micro-batch through ``training_step``. Returns the micro-batches as
    collated (before the step took gbc's entries out of their ``info``)."""
    buf = t.replay_buffer
    buf.dynamic_batch, buf.packing_samples = False, False
    gorl.check_buffer(t)
    g = torch.Generator().manual_seed(seed)
    seen = []
    for _ in range(EPOCHS):
        loader = DataLoader(buf, batch_size=MB, shuffle=True, drop_last=True,
                            collate_fn=buf.collate_fn, generator=g)
        for step, batch in enumerate(loader):
            seen.append(copy.deepcopy(batch))
            gorl.training_step(t, batch, 0.05, step,
                               ORL.get_loss_batch_info(None, batch.action_mask))
    return seen


@pytest.fixture
def forced(monkeypatch):
    """``gbc/support_forced_frac`` of every fused loss call (each update, each Lopti phase)."""
    calls = []
    own = gtrainer.fused_actor_loss

    def recorded(*args, **kwargs):
        loss, m = own(*args, **kwargs)
        calls.append(float(m["gbc/support_forced_frac"]))
        return loss, m

    monkeypatch.setattr(gtrainer, "fused_actor_loss", recorded)
    return calls


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("case", sorted(ROLLOUT_ARGS))
def test_rollout_set_equals_the_stock_step_over_the_built_set(case, packing, methods_off,
                                                               forced):
    """One set per rollout (the default): the actor's pass scores over the set it builds
    (= float64 references) and its ids are vLLM's kept set of the sampling policy's float64
    logits; the buffer carries them through OpenRLHF's split, shuffle and collate (each
    micro-batch's ids are its own samples'); two epochs of updates equal OpenRLHF's stock
    steps in the same order whose every pass scores over that one set (the parameters), and
    every update's forced share is the building pass's (0: the sampled tokens are in it)."""
    args = sargs(**ROLLOUT_ARGS[case])
    rollout = sample_rollouts()
    _enable(support="replay")
    assert gorl._STATE.methods.one_set_per_rollout
    t = trainer(args, packing)
    exp, _ = make_experience(t, args, rollout)
    z = _z64(t.actor.model, exp)
    keep = R.kept_set(z, top_p=TOP_P)                     # the sampler's set, target not forced
    want = ref64(t.actor.model, exp)
    assert torch.allclose(exp.action_log_probs.double(), want.logp_s, atol=2e-6)
    built = gorl._info_support_ids(make_experience_batch_of(t), exp.action_mask.shape[1])
    got = _as_mask(built)
    m = exp.action_mask
    assert torch.equal(got[m], keep[m]) and not built[~m].ge(0).any()
    batches = _epochs(t)
    for b in batches:                                     # the ids travelled with their samples
        idx, Tn = _rows(b, exp), b.action_mask.shape[1]
        ids = gorl._info_support_ids(b, Tn)
        assert torch.equal(ids[..., :built.shape[-1]], built[idx, :Tn][..., :ids.shape[-1]])
    assert len(forced) == EPOCHS * (B // MB) and forced == [0.0] * len(forced)
    gorl.disable()
    model = tiny_model(0)
    for b in batches:                                     # the stock steps, the same order
        idx, Tn = _rows(b, exp), b.action_mask.shape[1]
        stock = copy.deepcopy(b)
        stock.info = {}
        stock.action_log_probs = want.logp_s[idx, :Tn].float() * b.action_mask
        loss, _ = T_.openrlhf_loss(over_set(model, keep[idx]), stock, args, 0.05,
                                   ORL.get_loss_batch_info(None, b.action_mask))
        loss.backward()
        _sgd(model)
        model.zero_grad(set_to_none=True)
    T_._close(t.actor.model, model)


def make_experience_batch_of(t):
    """The replay buffer's samples collated back in order (OpenRLHF's ``collate_fn``)."""
    t.replay_buffer.dynamic_batch, t.replay_buffer.packing_samples = False, False
    return t.replay_buffer.collate_fn(list(t.replay_buffer.items))


@pytest.mark.parametrize("support_set", ["rollout", "per_pass"])
def test_lopti_and_a_second_epoch_score_the_same_set(support_set, methods_off, forced,
                                                     record_property):
    """Lopti's two phases and a second epoch (max_epochs=2): with one set per rollout every
    pass's forced share is the building pass's (0); with ``support_set=per_pass`` each pass
    rebuilds the set from the moved policy and its forced share grows after the first
    update (the drift one set per rollout removes), measured here."""
    args = sargs(is_level="token")
    _enable(support="replay", lopti_eta=0.5,
            **({} if support_set == "rollout" else {"support_set": "per_pass"}))
    t = trainer(args)
    make_experience(t, args, sample_rollouts())
    _epochs(t)
    print(f"\nOpenRLHF forced share per pass (2 epochs x {B // MB} micro-batches x 2 Lopti "
          f"phases), support_set={support_set}: " + " ".join(f"{f:.3f}" for f in forced))
    record_property(f"forced_{support_set}", forced)
    assert len(forced) == EPOCHS * (B // MB) * 2
    if support_set == "rollout":
        assert forced == [forced[0]] * len(forced) and forced[0] == 0.0
    else:
        assert forced[0] == 0.0 and max(forced[1:]) > 0.05


# ----------------------------------------------- the reference model: OpenRLHF's own driver
@pytest.fixture
def driver():
    """OpenRLHF's ``experience_maker`` (the driver's ``RemoteExperienceMaker``) and its Ray
    worker classes (``RayActorGroup``, ``ReferenceModelActor``, ``PolicyModelActor``, as
    defined, without Ray's wrapper). Their package imports vLLM (no CPU build): a placeholder
    ``vllm`` while they are imported (only names used at import; no engine is built); the
    modules leave ``sys.modules`` afterwards."""
    stubs = {n: types.ModuleType(n) for n in ("vllm", "vllm.inputs", "vllm.utils")}
    stubs["vllm"].__version__ = "0.29.0"
    stubs["vllm.inputs"].TokensPrompt = dict
    stubs["vllm.utils"].random_uuid = lambda: "0"
    before = set(sys.modules)
    sys.modules.update(stubs)
    sys.path.insert(0, T_.os.path.join(T_.HERE, "standins"))
    try:
        import openrlhf.trainer.ppo_utils.experience_maker as em
        import openrlhf.trainer.ray.launcher as launcher
        import openrlhf.trainer.ray.ppo_actor as ppo_actor
        ns = SimpleNamespace(
            em=em, RayActorGroup=launcher.RayActorGroup,
            Reference=launcher.ReferenceModelActor.__ray_metadata__.modified_class
            .__ray_actor_class__,
            Policy=ppo_actor.PolicyModelActor.__ray_metadata__.modified_class
            .__ray_actor_class__)
    finally:
        sys.path.remove(T_.os.path.join(T_.HERE, "standins"))
    yield ns
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("vllm", "flash_attn", "ring_flash_attn") or \
                name.startswith(("openrlhf.trainer.ray", "openrlhf.trainer.ppo_utils.exp")):
            del sys.modules[name]


class _Ref:
    """A stand-in ``ray.ObjectRef``: the value itself."""

    def __init__(self, value):
        self.value = value


def _ray_get(refs, *_, **__):
    return [r.value for r in refs] if isinstance(refs, list) else refs.value


class _Handle:
    """A stand-in Ray actor handle: ``handle.method.remote(...)`` runs ``worker.method`` now
    (the object-ref arguments resolved, as Ray resolves them); ``__ray_call__.remote(fn, ...)``
    runs ``fn(worker, ...)``, Ray's semantics."""

    def __init__(self, worker):
        self._worker = worker

    def __getattr__(self, name):
        worker = self._worker

        def remote(*args, **kwargs):
            args = [a.value if isinstance(a, _Ref) else a for a in args]
            if name == "__ray_call__":
                return _Ref(args[0](worker, *args[1:], **kwargs))
            return _Ref(getattr(worker, name)(*args, **kwargs))
        return SimpleNamespace(remote=remote)


def _group(d, cls, attr, model, workers, dup):
    """OpenRLHF's ``RayActorGroup`` (its own ``async_run_method_batch``: the chunking over the
    workers, ``dup`` copies of each chunk as ring attention / tensor parallelism make) over
    in-process workers of ``cls`` (OpenRLHF's worker class: its ``execute_batch`` and
    ``forward``) holding ``model``."""
    group = object.__new__(d.RayActorGroup)
    group.duplicate_actors, group._actor_handlers = dup, []
    for _ in range(workers * dup):
        w = object.__new__(cls)
        setattr(w, attr, model)
        w.strategy = SimpleNamespace(ring_attn_group=None, is_rank_0=lambda: True)
        group._actor_handlers.append(_Handle(w))
    return group


def _micro_batches(exp, mb):
    return [ORL.Experience(sequences=exp.sequences[i:i + mb],
                           attention_mask=exp.attention_mask[i:i + mb],
                           action_mask=exp.action_mask[i:i + mb],
                           rewards=torch.zeros(len(exp.sequences[i:i + mb])), info={})
            for i in range(0, B, mb)]


@pytest.mark.parametrize("use_loss", [True, False], ids=["kl-loss", "kl-reward"])
@pytest.mark.parametrize("dup", [1, 2], ids=["dp", "ring-copies"])
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_reference_scores_the_actors_set(packing, dup, use_loss, methods_off, driver,
                                         monkeypatch):
    """One set per rollout with OpenRLHF's reference model, through OpenRLHF's own
    ``RemoteExperienceMaker.make_experience`` (the driver; gbc's patched
    ``_dispatch_forward``) and its ``RayActorGroup.async_run_method_batch`` /
    ``execute_batch`` into its own worker classes' ``forward`` (in process; two workers a group,
    and ``dup`` copies of each as under ring attention): the actor's log-probs are over the set
    the actor (the sampling policy) builds (= float64), the reference's over exactly that set
    (= the float64 logits of the reference model over the set ``gbc_reference.kept_set`` builds
    from the ACTOR's float64 logits; not the reference's own set), the reward KL (or the KL
    loss's reference log-probs) from those; the ids stay in the actor's process for the buffer.
    """
    import ray

    monkeypatch.setattr(ray, "get", _ray_get)
    monkeypatch.setattr(ray, "put", lambda v, *_, **__: _Ref(v))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    args = sargs(kl="k3", is_level="token")
    args.algo.kl.use_loss = use_loss
    rollout = sample_rollouts()
    _enable(support="replay")
    t, ref = trainer(args, packing), S.reference_actor(args, packing)
    margs = copy.deepcopy(args)
    margs.ds = SimpleNamespace(ring_attn_size=dup, tensor_parallel_size=1)
    margs.train.colocate_all = margs.train.colocate_critic_reward = False
    margs.train.colocate_actor_ref = True                 # the sync path, too
    margs.algo.advantage.estimator = "group_norm"
    maker = driver.em.RemoteExperienceMaker(
        _group(driver, driver.Policy, "actor", t.actor, 2, dup), None, None,
        _group(driver, driver.Reference, "model", ref, 2, dup), None,
        SimpleNamespace(args=margs), None)
    mb = 2
    out = maker.make_experience(_micro_batches(rollout, mb))
    assert len(out) == B // mb and gorl.DRIVER_IDS_ATTR not in vars(maker)
    assert len(gorl._STATE.support_pending) == (B // mb) * dup   # for the buffer's append
    got_old = torch.cat([e.action_log_probs for e in out])
    assert got_old.shape == rollout.action_mask.shape
    want_old = ref64(t.actor.model, rollout).logp_s
    assert torch.allclose(got_old.double(), want_old, atol=2e-6)
    keep = R.kept_set(_z64(t.actor.model, rollout), top_p=TOP_P)    # the actor's set
    y = rollout.sequences[:, -rollout.action_mask.shape[1]:]
    keep.scatter_(-1, y[..., None], True)
    z = _z64(ref.model, rollout)
    want_ref = (z.gather(-1, y[..., None])[..., 0] - z.masked_fill(~keep, float("-inf"))
                .logsumexp(-1)) * rollout.action_mask
    own = ref64(ref.model, rollout).logp_s                # the reference's own set differs
    assert (own - want_ref)[rollout.action_mask].abs().max() > 1e-3
    want_kl = ORL.compute_approx_kl(want_old, want_ref, kl_estimator="k3") \
        if not use_loss else torch.zeros_like(want_old)
    assert torch.allclose(torch.cat([e.kl for e in out]).double(), want_kl.double(), atol=1e-5)
    if use_loss:
        got_ref = torch.cat([e.base_action_log_probs for e in out])
        assert torch.allclose(got_ref.double(), want_ref, atol=2e-6)
    else:
        assert all(e.base_action_log_probs is None for e in out)


def test_driver_refusals_by_name(methods_off, driver, monkeypatch):
    """The patched driver refuses, by name, a reference dispatch without the actor group's
    ids (not OpenRLHF 0.11.2's order), ids handed for another micro-batch width, and an
    actor worker whose forward built no set (gbc not enabled there with one set per
    rollout)."""
    import ray

    monkeypatch.setattr(ray, "get", _ray_get)
    monkeypatch.setattr(ray, "put", lambda v, *_, **__: _Ref(v))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    args = sargs(kl="k3", is_level="token")
    rollout = sample_rollouts()
    _enable(support="replay")
    t, ref = trainer(args), S.reference_actor(args)
    margs = copy.deepcopy(args)
    margs.ds = SimpleNamespace(ring_attn_size=1, tensor_parallel_size=1)
    margs.algo.advantage.estimator = "group_norm"
    maker = driver.em.RemoteExperienceMaker(
        _group(driver, driver.Policy, "actor", t.actor, 1, 1), None, None,
        _group(driver, driver.Reference, "model", ref, 1, 1), None,
        SimpleNamespace(args=margs), None)
    kw = dict(sequences=[rollout.sequences], action_mask=[rollout.action_mask],
              attention_mask=[rollout.attention_mask])
    with pytest.raises(ValueError, match=r"^support=replay, support_set=rollout \(the "
                                         r"default\): the reference group's forward was "
                                         r"dispatched without the actor group's kept ids"):
        maker._dispatch_forward(maker.initial_model_group, False, **kw)
    worker = maker.initial_model_group._actor_handlers[0]._worker
    wide = gorl.methods.compact_support_ids(torch.zeros(B, 3, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^support=replay, support_set=rollout \(the "
                                         r"default\): the kept ids handed to the reference "
                                         r"pass are for \[8, 3\] action tokens"):
        worker.forward(rollout.sequences, rollout.action_mask, rollout.attention_mask,
                       gbc_support_ids=wide)
    _enable(support="replay", support_set="per_pass")     # the workers: not one set
    policy = maker.actor_model_group._actor_handlers[0]._worker
    assert gorl._install_worker_forward(policy) and gorl._install_worker_forward(policy)
    with pytest.raises(ValueError, match=r"^support=replay, support_set=rollout \(the "
                                         r"default\): the actor worker's forward built no "
                                         r"kept set"):
        policy.forward(rollout.sequences, rollout.action_mask, rollout.attention_mask,
                       gbc_return_support_ids=True)


# ------------------------------------------------------------------------------- refused
def test_rollout_set_refusals_by_name(methods_off, monkeypatch):
    """Where OpenRLHF cannot build the set first or carry it, one set per rollout says so,
    naming the option and what to set: a reference model (its pass runs in its own Ray worker
    beside the actor's that builds the set), train.dynamic_batch_enable (the samples change
    ranks after the actor's pass), a sample the actor pass did not score, a buffer without the
    ids (before the first micro-batch); and ``support_set`` misspelled (enable() and
    ``GBC_OPENRLHF_OPTIONS``) or without ``support=replay``. A reference model is not
    refused by the trainer (test_reference_scores_the_actors_set runs it), only a reference
    pass handed no kept ids (not the patched driver's dispatch)."""
    rollout = sample_rollouts()
    _enable(support="replay")
    kl = sargs(kl="k3", is_level="token")
    gorl.check_trainer(trainer(kl))
    with pytest.raises(ValueError, match=r"^support=replay, support_set=rollout \(the "
                                         r"default\): the reference model's pass was handed "
                                         r"no kept ids: .* enable\(\) must run in the driver "
                                         r"process .* set support_set=per_pass .* or "
                                         r"algo.kl.init_coef=0"), torch.no_grad():
        S.reference_actor(kl)(rollout.sequences, rollout.action_mask, rollout.attention_mask)
    dyn = sargs(is_level="token")
    dyn.train.dynamic_batch_enable = True
    t = trainer(dyn)
    with pytest.raises(ValueError, match=r"^support=replay, support_set=rollout \(the "
                                         r"default\): train.dynamic_batch_enable .* set "
                                         r"support_set=per_pass"):
        gorl.check_trainer(t)
    args = sargs(is_level="token")
    t = trainer(args)
    make_experience(t, args, rollout)                      # the policy's process
    other = sample_rollouts(seed=1)
    other.action_log_probs = other.rollout_log_probs
    with pytest.raises(ValueError, match=r"^support=replay, support_set=rollout \(the "
                                         r"default\): the experience's samples were not "
                                         r"scored by this process's actor pass"):
        T_._buffer(copy.deepcopy(other), B)
    del t.replay_buffer.items[B - 1].info[gorl.SUPPORT_IDS_KEY]
    with pytest.raises(ValueError, match=rf"^support=replay, support_set=rollout \(the "
                                         rf"default\): the experience carries no kept ids: the "
                                         rf"replay buffer's sample {B - 1} \(of {B}"):
        gorl.check_buffer(t)
    with pytest.raises(ValueError, match=r"^support=replay, support_set=rollout \(the "
                                         r"default\): the experience carries no kept ids"):
        gorl.training_step(t, copy.deepcopy(other), 0.0, 0)
    gorl.disable()
    for bad, match in ((dict(support="replay", support_set="per-pass"),
                        r"^support_set: expected one of \('rollout', 'per_pass'\)"),
                       (dict(support="kept_mass", support_set="rollout"), r"^support_set: ")):
        with pytest.raises(ValueError, match=match):
            _enable(**bad)
    monkeypatch.setenv(gorl.ENV_OPTIONS, "support=replay,support_set=rolout")
    with pytest.raises(ValueError, match=rf"^{gorl.ENV_OPTIONS}: support_set: expected one of"):
        _enable()
    with pytest.raises(ValueError, match=r"^support_ids: pass either support_ids"):
        gorl.fused_action_log_probs(
            t.actor, rollout.sequences, rollout.action_mask, rollout.attention_mask,
            sampler_truncation=gorl.rollout_truncation(args, gorl.methods.MethodOptions(
                support="replay"), TEMP),
            support_ids=torch.zeros(*rollout.action_mask.shape, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^support_ids: expected an int32/int64 tensor"):
        gorl.fused_action_log_probs(t.actor, rollout.sequences, rollout.action_mask,
                                    rollout.attention_mask, support_ids=torch.zeros(B, 3, 1))


# -------------------------------------------------------------------- the building blocks
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_passes_over_the_given_set(packing, methods_off):
    """``fused_action_log_probs``: ``return_support_ids`` builds the policy's set (the same
    ids packed as padded) and ``support_ids`` scores another model (a reference, critical-token
    KL weights beside) over exactly that set, against float64 full logits."""
    args = sargs()
    exp = sample_rollouts()
    tr = gorl.rollout_truncation(args, gorl.methods.MethodOptions(support="replay"), TEMP)
    policy = S.packed_actor(0, TEMP, packing)
    logp, ids = gorl.fused_action_log_probs(policy, exp.sequences, exp.action_mask,
                                            exp.attention_mask, sampler_truncation=tr,
                                            return_support_ids=True)
    _, padded = gorl.fused_action_log_probs(S.packed_actor(0, TEMP, False), exp.sequences,
                                            exp.action_mask, exp.attention_mask,
                                            sampler_truncation=tr, return_support_ids=True)
    K = max(ids.shape[-1], padded.shape[-1])
    pad = lambda x: torch.nn.functional.pad(x, (0, K - x.shape[-1]), value=-1)  # noqa: E731
    assert torch.equal(pad(ids), pad(padded))
    assert torch.allclose(logp.double(), ref64(policy.model, exp).logp_s, atol=2e-6)
    ref = S.packed_actor(3, TEMP, packing)
    keep = _as_mask(ids)
    y = exp.sequences[:, -exp.action_mask.shape[1]:]
    keep.scatter_(-1, y[..., None], True)
    z = _z64(ref.model, exp)
    want = (z.gather(-1, y[..., None])[..., 0] - z.masked_fill(~keep, float("-inf"))
            .logsumexp(-1)) * exp.action_mask
    got = gorl.fused_action_log_probs(ref, exp.sequences, exp.action_mask, exp.attention_mask,
                                      support_ids=ids)
    assert torch.allclose(got.double(), want, atol=2e-6)
    own = ref64(ref.model, exp).logp_s                    # the reference's own set differs
    assert (own - want)[exp.action_mask].abs().max() > 1e-3
    opts = gorl.methods.MethodOptions(critical_kl_exponent=2.0)
    both = gorl.fused_action_log_probs(ref, exp.sequences, exp.action_mask, exp.attention_mask,
                                       options=opts, support_ids=ids)
    assert both.shape == (*exp.action_mask.shape, 2)
    assert torch.allclose(both[..., 0], got, atol=1e-6)
