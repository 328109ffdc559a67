"""gbc's AReaL engine (gbc_kernels.integrations.areal, docs/areal.md) against AReaL 1.0.4's own
FSDP PPO actor: the same checkpoint, the same RLVR-shaped batch, AReaL's own compute_logp ->
compute_advantages -> ppo_update, on gloo with FSDP2 and ``attn_impl="sdpa"``; the proximal
log-probs, every metric AReaL logs and every parameter after the update must agree.

AReaL pins torch<2.11 and transformers<=5.3: its tests run in its own venv (``make compat
ONLY=areal``, compat/sets/areal-1.0.4.txt; CI runs that row); where AReaL is not installed
this file is skipped.
"""

from __future__ import annotations

import os

# AReaL wraps its log-prob gathers in torch.compile at import; on a CPU machine without a
# warm inductor cache that compiles C++ for minutes. Eager runs the same math.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

areal = pytest.importorskip("areal", reason="AReaL runs in its own venv: make compat ONLY=areal")

from conftest import logits_dtypes_seen, spawn_gloo  # noqa: E402

V = 1000
SKIP_STATS = ("time", "perf", "vocab_min_logits", "vocab_max_logits")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny untied Qwen2 and a word-level tokenizer (AReaL loads both from ``path``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = str(tmp_path_factory.mktemp("tiny_areal"))
    vocab = {f"t{i}": i for i in range(V - 2)}
    vocab["<pad>"], vocab["<eos>"] = V - 2, V - 1
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>",
                            eos_token="<eos>").save_pretrained(path)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, eos_token_id=V - 1, pad_token_id=V - 2)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def make_config(path, **kw):
    from areal.api.cli_args import MicroBatchSpec, NormConfig, OptimizerConfig, PPOActorConfig

    base = dict(experiment_name="gbc", trial_name="t0", path=path, attn_impl="sdpa",
                dtype="float32", optimizer_dtype="float32", backend="fsdp:d1",
                optimizer=OptimizerConfig(type="sgd", lr=0.5, weight_decay=0.0,
                                          gradient_clipping=1e9,
                                          lr_scheduler_type="constant"),
                mb_spec=MicroBatchSpec(n_mbs=2), ppo_n_minibatches=1, eps_clip=0.2,
                kl_ctl=0.0, reward_norm=NormConfig(mean_level="group", std_level="group",
                                                   group_size=4),
                adv_norm=NormConfig(mean_level="batch", std_level="batch"))
    base.update(kw)
    return PPOActorConfig(**base)


def make_batch(seed, n=8):
    """``n`` trajectories with the keys of AReaL's RLVRWorkflow: prompt then response, the
    behaviour policy's (stale) log-probs on the response, versions, a 0/1 reward."""
    g = torch.Generator().manual_seed(seed)
    batch = []
    for i in range(n):
        P, R = 3 + i % 3, 5 + (3 * i) % 6
        ids = torch.randint(0, V - 2, (P + R,), generator=g, dtype=torch.int32)
        lp = torch.zeros(P + R)
        lp[P:] = torch.randn(R, generator=g) - 6.9       # about log(1/V), spread
        ver = torch.full((P + R,), -1, dtype=torch.int32)
        ver[P:] = 0
        traj = dict(input_ids=ids, loss_mask=torch.cat([torch.zeros(P), torch.ones(R)]).int(),
                    logprobs=lp, versions=ver, attention_mask=torch.ones(P + R, dtype=torch.bool),
                    rewards=torch.tensor(float((i * 7 + seed) % 3 == 0)))
        batch.append({k: v.unsqueeze(0) for k, v in traj.items()})
    return batch


def _rs(**kw):
    from areal.api.cli_args import RejectionSamplingConfig

    return RejectionSamplingConfig(**kw)


# AReaL's loss options, each run through its own grpo_loss_fn on both engines
VARIANTS = {
    "decoupled-clamp-dual-clip-2-minibatches": dict(
        use_decoupled_loss=True, eps_clip_higher=0.28, c_clip=2.0, ppo_n_minibatches=2,
        rejection_sampling=_rs(level="token", action="clamp", metric="ratio", upper=2.0)),
    "decoupled-token-mask-kl3": dict(
        use_decoupled_loss=True, prox_logp_method="metrics",
        rejection_sampling=_rs(level="token", action="mask", metric="kl_k3", upper=0.5)),
    "decoupled-gspo-sequence-mask": dict(
        use_decoupled_loss=True, importance_sampling_level="sequence",
        rejection_sampling=_rs(level="sequence", action="mask", metric="ratio", upper=1.5)),
    "decoupled-loglinear": dict(use_decoupled_loss=True, prox_logp_method="loglinear"),
    "coupled-recompute-m2po": dict(recompute_logprob=True, m2_threshold=0.04),
    "coupled-sapo": dict(use_sapo_loss=True, sapo_tau_pos=1.0, sapo_tau_neg=1.05),
    "coupled-clip-temperature": dict(eps_clip=0.1, temperature=0.7),
}


def _params(engine):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in engine.model.named_parameters()}


def _step(cls, path, cfg_kw, seed, prox_shift=0.0, ar_alpha=None, options=""):
    """One AReaL RL step (compute_logp, compute_advantages, ppo_update) with actor class
    ``cls``; ``prox_shift`` moves the proximal log-probs (a stale proximal policy: clips and
    dual clips fire); ``ar_alpha``: AR applied by hand to the advantages (the oracle)."""
    from areal.api.io_struct import FinetuneSpec
    from areal.utils import stats_tracker

    from gbc_kernels.integrations.areal import OPTIONS_ENV

    os.environ[OPTIONS_ENV] = options
    eng = cls(make_config(path, **cfg_kw))
    eng.create_process_group()
    eng.initialize(addr=None, ft_spec=FinetuneSpec(total_train_epochs=1, dataset_size=8,
                                                   train_batch_size=8))
    batch = make_batch(seed)
    with logits_dtypes_seen() as seen:
        prox = eng.compute_logp(batch)
    g = torch.Generator().manual_seed(99)
    for traj, lp in zip(batch, prox):
        traj["prox_logp"] = lp + prox_shift * torch.randn(lp.shape, generator=g)
    adv = eng.compute_advantages(batch)
    if ar_alpha is not None:
        for traj in adv:
            p = torch.exp(traj["prox_logp"])
            traj["advantages"] = traj["advantages"] * (ar_alpha * p + 1 - ar_alpha)
    stats_tracker.export_all(reset=True)
    with logits_dtypes_seen() as seen_update:
        eng.ppo_update(adv)
    stats = stats_tracker.export_all(reset=True)
    params = _params(eng)
    eng.destroy()
    return dict(prox=[p.clone() for p in prox], stats=stats, params=params,
                seen=seen + seen_update)


def _compare(ours, theirs, start=None, skip=()):
    worst = max((a - b).abs().max().item() for a, b in zip(ours["prox"], theirs["prox"]))
    assert worst < 1e-5, worst
    s0, s1 = theirs["stats"], ours["stats"]
    want = {k for k in s0 if not any(x in k for x in SKIP_STATS + skip)}
    have = {k for k in s1 if not any(x in k for x in SKIP_STATS + skip)}
    assert want == have, (sorted(want - have), sorted(have - want))
    bad = {k: (s0[k], s1[k]) for k in want
           if abs(s0[k] - s1[k]) > 1e-4 * max(1.0, abs(s0[k]))}
    assert not bad, bad
    assert not [k for k in s1 if "vocab_m" in k]      # documented: not logged by gbc
    for n, p in theirs["params"].items():
        torch.testing.assert_close(ours["params"][n], p, rtol=1e-4, atol=1e-6, msg=n)
    if start is not None:
        moved = max((theirs["params"][n] - start[n]).abs().max().item() for n in start)
        assert moved > 1e-3, moved


def _worker_variants(rank, world, path, cfg_kw, seed, prox_shift):
    from areal.engine.fsdp_engine import FSDPPPOActor

    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    theirs = _step(FSDPPPOActor, path, cfg_kw, seed, prox_shift)
    ours = _step(GBCFSDPPPOActor, path, cfg_kw, seed, prox_shift)
    return theirs, ours


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_update_equals_areals_own(tiny, variant):
    """Every loss option through AReaL's own grpo_loss_fn: the proximal log-probs, every
    metric AReaL logs (but its per-token min/max logits) and every parameter after the update
    equal AReaL's stock actor's; the update moved the parameters."""
    from transformers import AutoModelForCausalLM

    shift = 0.7 if VARIANTS[variant].get("use_decoupled_loss") else 0.0
    theirs, ours = spawn_gloo(1, _worker_variants, tiny, VARIANTS[variant], 1, shift)[0]
    start = dict(AutoModelForCausalLM.from_pretrained(tiny).named_parameters())
    _compare(ours, theirs, {n: p.detach() for n, p in start.items()})
    s = theirs["stats"]
    if variant.startswith("decoupled-clamp"):      # the clip, the dual clip and RS all acted
        assert s["ppo_actor/update/clip_ratio/avg"] > 0
        assert s["ppo_actor/update/dual_clip_ratio/avg"] > 0
    if "mask" in variant:
        assert s["ppo_actor/update/rs_filtered_fraction"] > 0
    assert set(ours["seen"]) == {None} and len(ours["seen"]) >= 2


def _worker_ar(rank, world, path):
    from areal.engine.fsdp_engine import FSDPPPOActor

    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    cfg = dict(use_decoupled_loss=True, eps_clip_higher=0.28,
               rejection_sampling=_rs(level="token", action="clamp", metric="ratio", upper=2.0))
    by_hand = _step(FSDPPPOActor, path, cfg, 3, 0.5, ar_alpha=0.3)
    plain = _step(FSDPPPOActor, path, cfg, 3, 0.5)
    ours = _step(GBCFSDPPPOActor, path, cfg, 3, 0.5, options="ar_alpha=0.3")
    return by_hand, plain, ours


def test_ar_equals_areals_step_on_ars_advantages(tiny):
    """AR through gbc's engine = AReaL's stock step on advantages times
    ``0.3 exp(prox_logp) + 0.7`` (applied by hand); and it acts (differs from the plain
    step). AReaL's ``advantages`` metric (logged before the loss) stays the advantages
    AReaL computed: gbc weights them inside the loss."""
    by_hand, plain, ours = spawn_gloo(1, _worker_ar, tiny)[0]
    _compare(ours, by_hand, skip=("ppo_actor/advantages/",))
    for k in ("ppo_actor/advantages/max", "ppo_actor/advantages/min"):
        assert ours["stats"][k] == plain["stats"][k]
    diff = max((plain["params"][n] - ours["params"][n]).abs().max().item()
               for n in plain["params"])
    assert diff > 1e-4, diff


def _lopti_by_hand(path, cfg_kw, seed, shift, eta):
    """AReaL's stock actor, Lopti applied by hand: two ppo_update calls on the same batch and
    proximal log-probs, the advantages zeroed outside the low tokens (``exp(prox_logp) <
    eta``), then outside the high ones."""
    import copy

    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPPPOActor
    from areal.utils import stats_tracker

    eng = FSDPPPOActor(make_config(path, **cfg_kw))
    eng.create_process_group()
    eng.initialize(addr=None, ft_spec=FinetuneSpec(1, 8, 8))
    batch = make_batch(seed)
    prox = eng.compute_logp(batch)
    g = torch.Generator().manual_seed(99)
    for traj, lp in zip(batch, prox):
        traj["prox_logp"] = lp + shift * torch.randn(lp.shape, generator=g)
    adv = eng.compute_advantages(batch)
    counts = {}
    stats_tracker.export_all(reset=True)
    for phase in ("low", "high"):
        data = copy.deepcopy(adv)
        counts[phase] = 0
        for traj in data:
            low = torch.exp(traj["prox_logp"]) < eta
            keep = low if phase == "low" else ~low
            counts[phase] += int((keep & (traj["loss_mask"] > 0)).sum())
            traj["advantages"] = torch.where(keep, traj["advantages"],
                                             torch.zeros_like(traj["advantages"]))
        eng.ppo_update(data)
    stats_tracker.export_all(reset=True)
    params = _params(eng)
    eng.destroy()
    return dict(params=params, counts=counts)


LOPTI_CFG = dict(use_decoupled_loss=True, eps_clip_higher=0.28, c_clip=2.0,
                 rejection_sampling=_rs(level="token", action="clamp", metric="ratio", upper=2.0))


def _worker_lopti(rank, world, path, order):
    from areal.engine.fsdp_engine import FSDPPPOActor

    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    eta = 0.001                      # about the tiny model's median token probability
    by_hand = _lopti_by_hand(path, LOPTI_CFG, 4, 0.5, eta) if order == "low-first" else None
    plain = _step(FSDPPPOActor, path, LOPTI_CFG, 4, 0.5)
    ours = _step(GBCFSDPPPOActor, path, LOPTI_CFG, 4, 0.5,
                 options=f"lopti_eta={eta},lopti_order={order}")
    return by_hand, plain, ours


def test_lopti_two_updates_equal_areals_stock_updates_by_hand(tiny):
    """Lopti through gbc's actor (low first) = AReaL's stock ppo_update twice, on the low then
    the high tokens' advantages (both groups non-empty); the metrics AReaL logs are the
    batch's terms, equal to the step without Lopti (but the gradient norms); the parameters
    differ from that step's."""
    by_hand, plain, ours = spawn_gloo(1, _worker_lopti, tiny, "low-first")[0]
    assert min(by_hand["counts"].values()) > 10, by_hand["counts"]
    for n, p in by_hand["params"].items():
        torch.testing.assert_close(ours["params"][n], p, rtol=1e-4, atol=1e-6, msg=n)
    _compare(dict(ours, params=plain["params"]), plain, skip=("grad_norm", "lopti_"))
    s = ours["stats"]
    assert s["ppo_actor/update/lopti_low_grad_norm"] > 0
    assert s["ppo_actor/update/lopti_high_grad_norm"] > 0
    diff = max((plain["params"][n] - ours["params"][n]).abs().max().item()
               for n in plain["params"])
    assert diff > 1e-4, diff


def test_lopti_order_is_honoured(tiny):
    """``lopti_order=high-first`` runs the high tokens' update first: another result."""
    _, _, low_first = spawn_gloo(1, _worker_lopti, tiny, "low-first")[0]
    _, _, high_first = spawn_gloo(1, _worker_lopti, tiny, "high-first")[0]
    diff = max((low_first["params"][n] - high_first["params"][n]).abs().max().item()
               for n in low_first["params"])
    assert diff > 1e-6, diff


def _init(engine):
    from areal.api.io_struct import FinetuneSpec

    engine.initialize(addr=None, ft_spec=FinetuneSpec(1, 8, 8))
    return engine


@torch.no_grad()
def _certainty_by_hand(path, batch, gamma):
    """``J^gamma``, ``J = 1 + log max softmax(z) / log V``, in float64 from the full logits of
    each trajectory run alone, aligned as AReaL's rolled log-probs (row t: the logits that
    predict token t + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    out = []
    for traj in batch:
        z = model(traj["input_ids"].long()).logits[0]
        J = 1 + (z.max(-1).values - torch.logsumexp(z, -1)) / torch.log(torch.tensor(V * 1.0))
        out.append((J ** gamma).float()[None])
    return out


def _reference_model(path):
    """A reference model unlike the policy (the policy's weights plus noise, a sharper head),
    saved beside it with the same tokenizer."""
    import shutil

    from transformers import AutoModelForCausalLM

    ref_path = path.rstrip("/") + "_ref"
    if not os.path.exists(os.path.join(ref_path, "config.json")):
        shutil.copytree(path, ref_path, dirs_exist_ok=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
            model.lm_head.weight.mul_(3.0)
        model.save_pretrained(ref_path)
    return ref_path


def _worker_critical(rank, world, path, gamma):
    """AReaL's stock ref and actor, the KL reward weighted by hand (k1: a reference
    ``old - w (old - ref)`` gives ``w (old - ref)``), against gbc's ref and actor built by
    AReaL's own ``_create_train_engine`` after ``enable(experiment, critical_kl_exponent)``;
    and the stock step unweighted."""
    import copy
    import types

    from areal.api.alloc_mode import ModelAllocation
    from areal.api.cli_args import MicroBatchSpec
    from areal.engine.fsdp_engine import FSDPPPOActor
    from areal.trainer.rl_trainer import PPOTrainer
    from areal.utils import stats_tracker

    from gbc_kernels.integrations import areal as gbc_areal

    os.environ["AREAL_SPMD_MODE"] = "1"
    ref_path = _reference_model(path)
    # one trajectory per micro-batch: each runs alone, as the float64 oracle runs it
    kw = dict(recompute_logprob=True, kl_ctl=0.1, kl_estimator="k1",
              mb_spec=MicroBatchSpec(n_mbs=8))
    batch0 = make_batch(6)
    w_hand = _certainty_by_hand(ref_path, batch0, gamma)
    results = {}
    for name in ("plain", "by_hand", "gbc"):
        batch = copy.deepcopy(batch0)
        if name == "gbc":
            exp = types.SimpleNamespace(actor=make_config(path, **kw),
                                        ref=make_config(ref_path, **kw))
            gbc_areal.enable(exp, critical_kl_exponent=gamma)
            alloc = ModelAllocation.from_str("fsdp:d1", name="actor")
            ref = _init(PPOTrainer._create_train_engine(None, exp.ref, alloc))
            actor = _init(PPOTrainer._create_train_engine(None, exp.actor, alloc))
        else:
            ref, actor = (FSDPPPOActor(make_config(p, **kw)) for p in (ref_path, path))
            for e in (ref, actor):
                e.create_process_group()
                _init(e)
        for traj, lp in zip(batch, ref.compute_logp(batch)):
            traj["ref_logp"] = lp
        for traj, lp in zip(batch, actor.compute_logp(batch)):
            traj["prox_logp"] = lp
        if name == "by_hand":
            for traj, w in zip(batch, w_hand):
                old = traj["prox_logp"]
                traj["ref_logp"] = old - w * (old - traj["ref_logp"])
        stats_tracker.export_all(reset=True)
        actor.ppo_update(actor.compute_advantages(batch))
        results[name] = dict(stats=stats_tracker.export_all(reset=True), params=_params(actor),
                             prox=[t["prox_logp"] for t in batch],
                             w=[t.get(gbc_areal.KL_WEIGHT_KEY) for t in batch])
        ref.destroy()
        actor.destroy()
        if name == "gbc":
            gbc_areal.disable()
    return results, w_hand


def test_critical_kl_weights_areals_kl_reward(tiny):
    """Critical-token KL in AReaL: the reference engine's compute_logp gives the weights
    (``J^2``, max-prob certainty) beside ``ref_logp``, equal to a float64 full-logits
    evaluation; the actor's compute_advantages weights AReaL's KL reward by them: the step
    equals AReaL's stock step with the weighting applied by hand, and differs from the
    unweighted step."""
    res, w_hand = spawn_gloo(1, _worker_critical, tiny, 2.0)[0]
    for w, ref in zip(res["gbc"]["w"], w_hand):
        m = ref > 0
        torch.testing.assert_close(w[:, :ref.shape[1]], ref, rtol=0, atol=1e-5)
        assert m.all()
    spread = torch.cat([w.flatten() for w in w_hand])
    assert spread.max() > 1.5 * spread.min(), spread       # the weights differ by token
    _compare(res["gbc"], res["by_hand"])
    diff = max((res["plain"]["params"][n] - res["gbc"]["params"][n]).abs().max().item()
               for n in res["gbc"]["params"])
    assert diff > 1e-5, diff
    k = "ppo_actor/kl_rewards/avg"
    assert res["gbc"]["stats"][k] != res["plain"]["stats"][k]


def test_critical_kl_is_refused_without_its_kl_term_or_under_the_single_controller(tiny,
                                                                                  switched,
                                                                                  monkeypatch):
    import types

    exp = types.SimpleNamespace(actor=make_config(tiny, kl_ctl=0.0), ref=make_config(tiny))
    with pytest.raises(ValueError, match="no KL term to weight"):
        switched.enable(exp, critical_kl_exponent=2.0)
    exp = types.SimpleNamespace(actor=make_config(tiny, kl_ctl=0.1), ref=None)
    with pytest.raises(ValueError, match="no KL term to weight"):
        switched.enable(exp, critical_kl_exponent=2.0)
    monkeypatch.delenv("AREAL_SPMD_MODE")
    exp = types.SimpleNamespace(actor=make_config(tiny, kl_ctl=0.1), ref=make_config(tiny))
    with pytest.raises(ValueError, match="single controller"):
        switched.enable(exp, critical_kl_exponent=2.0)


def test_single_controller_refuses_critical_kl(tiny, monkeypatch):
    from gbc_kernels.integrations.areal import OPTIONS_ENV
    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    monkeypatch.setenv(OPTIONS_ENV, "critical_kl_exponent=2.0")
    with pytest.raises(ValueError, match="single controller"):
        GBCFSDPPPOActor.as_controller(make_config(tiny, kl_ctl=0.1), None)


def test_critical_kl_actor_refuses_trajectories_without_weights(tiny, monkeypatch):
    """The actor never runs an unweighted KL reward when critical-token KL is on."""
    from gbc_kernels.integrations.areal import OPTIONS_ENV
    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    monkeypatch.setenv(OPTIONS_ENV, "critical_kl_exponent=2.0")
    actor = GBCFSDPPPOActor(make_config(tiny, kl_ctl=0.1))
    with pytest.raises(ValueError, match="trajectory 0 has no certainty weights"):
        actor.compute_advantages(make_batch(1))


def _worker_float32(rank, world, path):
    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    cfg = dict(recompute_logprob=True)
    return (_step(GBCFSDPPPOActor, path, cfg, 5)["seen"],
            _step(GBCFSDPPPOActor, path, cfg, 5, options="logits_dtype=float32")["seen"])


def test_logits_dtype_reaches_every_pass(tiny):
    """``logits_dtype=float32`` reaches compute_logp and every micro-batch of the update (a
    float32 model: the numbers cannot show it, the sweeps' mode does)."""
    default, float32 = spawn_gloo(1, _worker_float32, tiny)[0]
    assert set(default) == {None} and set(float32) == {torch.float32}
    assert len(default) == len(float32) >= 4


def _worker_parallel(rank, world, path, backend):
    from areal.engine.fsdp_engine import FSDPPPOActor

    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    seed = 1 + (rank if backend == "fsdp:d2" else 0)      # Ulysses ranks share a batch
    cfg = dict(backend=backend, use_decoupled_loss=True, c_clip=2.0,
               rejection_sampling=_rs(level="token", action="clamp", metric="ratio", upper=2.0))
    return (_step(FSDPPPOActor, path, cfg, seed, 0.5),
            _step(GBCFSDPPPOActor, path, cfg, seed, 0.5))


@pytest.mark.parametrize("backend", ["fsdp:d2", "fsdp:d1c2"])
def test_two_ranks_equal_areals_own(tiny, backend):
    """2 gloo ranks, data parallel (each rank its own batch) and Ulysses sequence parallel
    (AReaL's ``c`` dimension: each rank a slice of every packed micro-batch, the log-probs
    all-gathered): gbc's step equals AReaL's on every rank; the ranks end in sync."""
    ranks = spawn_gloo(2, _worker_parallel, tiny, backend)
    for theirs, ours in ranks:
        _compare(ours, theirs)
    for n, p in ranks[0][1]["params"].items():
        assert torch.equal(p, ranks[1][1]["params"][n]), n


# ---- NTHR: scored from the actor's own compute_logp pass --------------------------------

def _one_row_per_mb():
    """make_batch's rows hold 8 to 15 tokens: at most 15 per micro-batch runs each alone, as
    the float64 oracle runs it (AReaL's packed micro-batches under sdpa on CPU let attention
    cross rows: the stock engine's numbers too)."""
    from areal.api.cli_args import MicroBatchSpec

    return MicroBatchSpec(max_tokens_per_mb=15)


NTHR_CFG = dict(recompute_logprob=True, ppo_n_minibatches=2, temperature=0.8)


def _grouped_batch(seed, groups=2, size=4):
    """AReaL's RLVR batch as its ``GroupedRolloutWorkflow`` gives it: one trajectory per
    prompt holding that prompt's ``size`` answers (rows padded to the longest)."""
    from areal.utils.data import concat_padded_tensors

    rows = make_batch(seed, n=groups * size)
    return [concat_padded_tensors(rows[i * size:(i + 1) * size]) for i in range(groups)]


@torch.no_grad()
def _nthr_by_hand(path, adv):
    """NTHR's scales in float64 from full logits (gbc_reference), of AReaL's stock
    ``compute_advantages`` output ``adv``: each row run alone through the checkpoint's model
    (the parameters of the compute_logp pass), its final hidden states, the rolled targets
    and loss mask, the trajectories as groups, correct = advantages averaging above 0."""
    import gbc_reference as ref
    from areal.utils.data import concat_padded_tensors
    from transformers import AutoModelForCausalLM

    from gbc_kernels import methods

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    seen = []
    model.lm_head.register_forward_pre_hook(lambda m, a: seen.append(a[0][0]))
    data = concat_padded_tensors(adv)
    ids, mask = data["input_ids"].long(), data["loss_mask"].bool()
    B, S = ids.shape
    hidden = torch.zeros(B, S, model.config.hidden_size, dtype=torch.float64)
    for b in range(B):
        n = int(data["attention_mask"][b].sum())
        model(ids[b:b + 1, :n])
        hidden[b, :n] = seen.pop()
    targets = torch.roll(ids, -1, -1)
    groups = torch.repeat_interleave(torch.arange(len(adv)),
                                     torch.tensor([t["input_ids"].shape[0] for t in adv]))
    correct = methods.correct_from_advantages(data["advantages"], mask)
    want = ref.nthr_scale(hidden, model.lm_head.weight, targets, mask, groups, correct,
                          temperature=NTHR_CFG["temperature"], beta=0.0)
    return want, mask


def _nthr_step(cls, path, backend, batch, options="", scale_by_hand=False):
    from areal.utils import stats_tracker
    from areal.utils.data import concat_padded_tensors

    from gbc_kernels.integrations.areal import NTHR_SCALE_KEY, OPTIONS_ENV

    os.environ[OPTIONS_ENV] = options
    eng = cls(make_config(path, backend=backend, mb_spec=_one_row_per_mb(), **NTHR_CFG))
    eng.create_process_group()
    _init(eng)
    for traj, lp in zip(batch, eng.compute_logp(batch)):
        traj["prox_logp"] = lp
    adv = eng.compute_advantages(batch)
    want = mask = None
    if scale_by_hand:
        want, mask = _nthr_by_hand(path, adv)
        first = 0
        for traj in adv:
            g, s = traj["advantages"].shape
            traj["advantages"] = traj["advantages"] * want.scale[first:first + g, :s].float()
            first += g
    scales = concat_padded_tensors(adv)[NTHR_SCALE_KEY] if options else None
    before = stats_tracker.export_all(reset=True)   # compute_advantages's (NTHR's metrics)
    eng.ppo_update(adv)
    out = dict(stats=stats_tracker.export_all(reset=True), before=before, params=_params(eng),
               prox=[t["prox_logp"] for t in batch], scales=scales, want=want, mask=mask)
    eng.destroy()
    return out


def _worker_nthr(rank, world, path, backend):
    import copy

    from areal.engine.fsdp_engine import FSDPPPOActor

    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    batch = _grouped_batch(2)                 # both prompts' groups mixed (rewards 0 and 1)
    return dict(
        by_hand=_nthr_step(FSDPPPOActor, path, backend, copy.deepcopy(batch),
                           scale_by_hand=True),
        plain=_nthr_step(FSDPPPOActor, path, backend, copy.deepcopy(batch)),
        gbc=_nthr_step(GBCFSDPPPOActor, path, backend, copy.deepcopy(batch),
                       options="nthr=true,nthr_beta=0"))


@pytest.mark.parametrize("backend,world", [("fsdp:d1", 1), ("fsdp:d1c2", 2)])
def test_nthr_from_areals_compute_logp_equals_the_method_by_hand(tiny, backend, world):
    """NTHR in AReaL: the actor's own compute_logp pass keeps the response tokens' hidden
    states (no other forward; under Ulysses gathered over the ranks), compute_advantages
    scores AReaL's trajectories as the groups once the advantages exist: the scales equal a
    float64 full-logits NTHR on the same batch (beta 0: on a random tiny model beta > 0
    selects no token), and the step (two minibatches) equals AReaL's stock step on the
    advantages times those scales, and differs from the plain step. AReaL's ``advantages``
    metric stays the advantages AReaL computed: gbc scales them inside the loss."""
    for res in spawn_gloo(world, _worker_nthr, tiny, backend):
        got, by_hand, plain = res["gbc"], res["by_hand"], res["plain"]
        want, m = by_hand["want"], by_hand["mask"]
        assert want.selected.any() and (want.scale[m] != 1).any()
        S = got["scales"].shape[1]
        torch.testing.assert_close(got["scales"][m[:, :S]].double(),
                                   want.scale[:, :S][m[:, :S]].double(), rtol=1e-5, atol=1e-5)
        _compare(got, by_hand, skip=("nthr_", "ppo_actor/advantages/"))
        for k in ("ppo_actor/advantages/avg", "ppo_actor/advantages/min"):
            assert got["stats"][k] == plain["stats"][k]    # AReaL's own, logged unscaled
        s = got["before"]
        assert 0 < s["ppo_actor/nthr_selected_frac"] <= 1
        assert s["ppo_actor/nthr_eta_mean"] == pytest.approx(
            want.scale[want.selected].mean().item(), rel=1e-5)
        diff = max((plain["params"][n] - got["params"][n]).abs().max().item()
                   for n in plain["params"])
        assert diff > 1e-5, diff


def _worker_nthr_refusals(rank, world, path):
    from gbc_kernels.integrations.areal import OPTIONS_ENV
    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    os.environ[OPTIONS_ENV] = "nthr=true,nthr_beta=0"
    eng = GBCFSDPPPOActor(make_config(path, **NTHR_CFG))
    eng.create_process_group()
    _init(eng)
    errors = {}

    def attempt(name, trained, scored=None, bump=False):
        for traj, lp in zip(trained, eng.compute_logp(trained)):
            traj["prox_logp"] = lp
        scored = trained if scored is None else scored
        for traj in scored:
            traj.setdefault("prox_logp", torch.zeros(traj["input_ids"].shape))
        if bump:
            eng.set_version(eng.get_version() + 1)
        try:
            eng.compute_advantages(scored)
        except ValueError as err:
            errors[name] = str(err)

    attempt("other batch", _grouped_batch(2), _grouped_batch(3))
    attempt("one answer each", make_batch(2))
    attempt("parameters changed", _grouped_batch(2), bump=True)
    b = _grouped_batch(2)
    attempt("first scoring", b)              # the pass's own batch: scored
    try:                                     # again, with no new pass: the rows were freed
        eng.compute_advantages(b)
    except ValueError as err:
        errors["scored twice"] = str(err)
    eng.destroy()
    # the reference engine (a PPOActorConfig without an optimizer, AReaL's default
    # recompute_logprob=false): built, its compute_logp keeps and tags nothing
    ref = GBCFSDPPPOActor(make_config(path, optimizer=None))
    ref.create_process_group()
    _init(ref)
    b = _grouped_batch(2)
    ref.compute_logp(b)
    errors["reference kept"] = ref._gbc_nthr is not None or any(
        "gbc_nthr_row" in t for t in b)
    ref.destroy()
    return errors


def test_nthr_refuses_rows_its_pass_did_not_keep(tiny):
    """NTHR's rows must belong to the samples being trained: trajectories another
    compute_logp pass (or none) kept, trajectories of one answer each (no group), and
    parameters changed since the pass are each refused by name. An engine that does not
    train (the reference: no optimizer) is built under NTHR and keeps nothing."""
    errors = spawn_gloo(1, _worker_nthr_refusals, tiny)[0]
    assert "trajectory 0 was not in this actor's last compute_logp pass" in \
        errors["other batch"]
    assert "every trajectory holds one answer" in errors["one answer each"]
    assert "the parameters changed (version 0 -> 1)" in errors["parameters changed"]
    assert "first scoring" not in errors
    assert "kept no compute_logp pass" in errors["scored twice"]
    assert errors["reference kept"] is False


@pytest.mark.parametrize("cfg_kw,match", [
    (dict(), "recompute_logprob=false without use_decoupled_loss"),
    (dict(use_decoupled_loss=True, prox_logp_method="loglinear"), "which this config skips"),
    (dict(recompute_logprob=True, importance_sampling_level="sequence"),
     "nthr=True with importance_sampling_level='sequence'"),
])
def test_nthr_config_without_its_pass_is_refused_by_the_engine(tiny, cfg_kw, match,
                                                               monkeypatch):
    """NTHR where AReaL runs no actor compute_logp pass (its default: the rollout's
    log-probs are used), where the proximal policy is interpolated, or under sequence-level
    importance sampling (a per-token scale averaged away): refused where the engine is built,
    naming AReaL's option; and under the single controller (the rows are tagged in the
    trajectories, which it serialises)."""
    from gbc_kernels.integrations.areal import OPTIONS_ENV
    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    monkeypatch.setenv(OPTIONS_ENV, "nthr=true")
    with pytest.raises(ValueError, match=match):
        GBCFSDPPPOActor(make_config(tiny, **cfg_kw))
    with pytest.raises(ValueError, match="nthr=True: NTHR's rows are tagged in the "
                                         "trajectories, which AReaL's single controller"):
        GBCFSDPPPOActor.as_controller(make_config(tiny, recompute_logprob=True), None)


# ---- the switch-on, through AReaL's own loading path ----------------------------------------

@pytest.fixture
def switched(monkeypatch):
    from gbc_kernels.integrations import areal as gbc_areal

    monkeypatch.setenv("AREAL_SPMD_MODE", "1")
    yield gbc_areal
    gbc_areal.disable()


def _worker_trainer_path(rank, world, path, options):
    from areal.api.alloc_mode import ModelAllocation
    from areal.trainer.rl_trainer import PPOTrainer

    from gbc_kernels.integrations import areal as gbc_areal

    os.environ["AREAL_SPMD_MODE"] = "1"
    gbc_areal.enable(**options)
    actor = PPOTrainer._create_train_engine(None, make_config(path),
                                            ModelAllocation.from_str("fsdp:d1", name="actor"))
    out = (type(actor).__module__, type(actor).__name__, actor.gbc_options.ar_alpha)
    gbc_areal.disable()
    return out


def test_enable_makes_areals_trainer_build_gbcs_actor(tiny):
    """``enable()`` then AReaL's own ``PPOTrainer._create_train_engine`` (the function that
    builds the actor and the reference engine) builds gbc's actor, with the options."""
    mod, name, alpha = spawn_gloo(1, _worker_trainer_path, tiny, dict(ar_alpha=0.25))[0]
    assert (mod, name, alpha) == ("gbc_kernels.integrations.areal.engine", "GBCFSDPPPOActor",
                                  0.25)


def test_single_controller_workers_get_the_class_and_the_options(tiny, switched):
    """AReaL's single controller sends its workers the class's import path and the actor
    config's scheduling specs: the path imports gbc's class (AReaL's own import_from_string)
    and the specs carry the options."""
    from areal.utils.dynamic_import import import_from_string

    switched.enable(ar_alpha=0.2)
    from areal.engine import FSDPPPOActor

    cfg = make_config(tiny)
    ctl = FSDPPPOActor.as_controller(cfg, None)
    cls = ctl.train_engine
    assert import_from_string(f"{cls.__module__}.{cls.__name__}") is cls
    assert cls.__name__ == "GBCFSDPPPOActor"
    assert all(s.env_vars[switched.OPTIONS_ENV] == "ar_alpha=0.2" for s in cfg.scheduling_spec)


@pytest.mark.parametrize("options,match", [
    (dict(ar_alpha=2.0), "GBC_AREAL_OPTIONS: ar_alpha: expected a float >= 0.0 and <= 1.0"),
    (dict(critical_kl_exponent=2.0), "critical_kl_exponent=2.0 needs enable\\(config"),
    (dict(logits_dtype="float16"), "logits_dtype"),
])
def test_bad_or_refused_option_stops_enable(switched, options, match):
    with pytest.raises(ValueError, match=match):
        switched.enable(**options)


@pytest.mark.parametrize("cfg_kw,match", [
    (dict(importance_sampling_level="sequence"), "importance_sampling_level='sequence'"),
    (dict(use_decoupled_loss=True, prox_logp_method="loglinear"), "loglinear"),
    (dict(enable_tree_training=True), "enable_tree_training"),
])
def test_option_ar_cannot_run_under_is_refused_by_the_engine(tiny, cfg_kw, match, monkeypatch):
    """Refused where the engine is built (AReaL's workers build it from the env), naming
    AReaL's option, before any model is loaded."""
    from gbc_kernels.integrations.areal import OPTIONS_ENV
    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    monkeypatch.setenv(OPTIONS_ENV, "ar_alpha=0.3")
    with pytest.raises(ValueError, match=match):
        GBCFSDPPPOActor(make_config(tiny, **cfg_kw))


def test_untested_release_is_refused_by_name(switched):
    from gbc_kernels.integrations.areal import check_areal_version

    import importlib.metadata

    assert importlib.metadata.version("areal").startswith("1.0.")
    assert check_areal_version() == importlib.metadata.version("areal")
    with pytest.raises(RuntimeError, match=r"areal 1\.1\.0: gbc's drop-in is tested on areal "
                                           r"1\.0\.x"):
        check_areal_version("1.1.0")


def test_enable_refuses_an_untested_release_before_patching(switched, monkeypatch):
    import areal.engine as areal_engine

    from gbc_kernels.integrations import releases

    before = areal_engine.FSDPPPOActor
    monkeypatch.setattr(releases, "installed", lambda d: "1.1.0" if d == "areal" else None)
    with pytest.raises(RuntimeError, match=r"^areal 1\.1\.0: gbc's drop-in is tested on"):
        switched.enable(ar_alpha=0.3)
    assert areal_engine.FSDPPPOActor is before          # nothing patched
    assert switched.ENV not in os.environ


def test_example_runs_gbcs_actor_through_areals_name(tmp_path):
    """examples/areal_grpo.py: two GRPO steps with AReaL's actor as AReaL's trainer names it
    (gbc's after enable()), AR, Lopti and NTHR on; every step logs finite metrics."""
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "examples", "areal_grpo.py"),
                          "--steps", "2", "--prompts", "2", "--group", "4"],
                         capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "actor: gbc_kernels.integrations.areal.engine.GBCFSDPPPOActor; options: " \
           "ar_alpha=0.3,lopti_eta=0.5,nthr=true" in out.stdout, out.stdout
    steps = re.findall(r"step (\d)/2: sampled reward ([\d.]+), actor_loss ([-+\d.e]+), "
                       r"entropy ([\d.]+), clip_ratio [\d.]+, nthr_selected_frac ([\d.]+)",
                       out.stdout)
    assert [s[0] for s in steps] == ["1", "2"], out.stdout
    assert all(torch.isfinite(torch.tensor([float(x) for x in s[1:]])).all() for s in steps)
