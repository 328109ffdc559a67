"""``support=replay`` in gbc's AReaL engine (issue 61; docs/areal.md, "The sampler's kept
set"): the rollout's kept set rebuilt from AReaL's generation config (``gconfig.top_k`` /
``top_p`` / ``temperature``, SGLang's joint rule, ties "first") in every pass
(``support_set=per_pass``; the default, one set per rollout: tests/test_areal_support_set.py),
and SGLang's
full-vocabulary rollout log-probs moved onto it (``logprobs - log_kept_mass``) before AReaL's
``compute_advantages``. ``support=kept_mass`` is refused (SGLang's log-probs are the full
vocabulary's already: nothing to correct).

The rollouts are drawn from the tiny model itself by a stand-in for SGLang's PyTorch sampler
(float64: SGLang's rule on the temperature-scaled logits, ``gbc_reference.kept_set``), which
records the sampled token's full-vocabulary log-prob as SGLang returns it. Runs in AReaL's venv
(``make compat ONLY=areal``); skipped where AReaL is not installed.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

areal = pytest.importorskip("areal", reason="AReaL runs in its own venv: make compat ONLY=areal")

from conftest import spawn_gloo  # noqa: E402
from test_areal import _compare, _init, _params, _rs, make_config  # noqa: E402

V = 1000
T = 0.8                      # gconfig.temperature = actor.temperature = ref.temperature
TOP_K, TOP_P = 50, 0.9       # on this model top_k binds on about a third of the rows
P, R, N = 4, 8, 8            # prompt and response tokens, trajectories


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny untied Qwen2 whose head is sharp enough that top-k and top-p both cut (its
    lm_head times 16), a reference model unlike it, and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = str(tmp_path_factory.mktemp("tiny_areal_support"))
    vocab = {f"t{i}": i for i in range(V - 2)}
    vocab["<pad>"], vocab["<eos>"] = V - 2, V - 1
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, eos_token_id=V - 1, pad_token_id=V - 2)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(16.0)
    paths = []
    for name, noise in (("policy", 0.0), ("ref", 0.05)):
        p = os.path.join(path, name)
        PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>",
                                eos_token="<eos>").save_pretrained(p)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for w in model.parameters():
                w.add_(noise * torch.randn(w.shape, generator=g))
        model.save_pretrained(p)
        paths.append(p)
    return tuple(paths)


@torch.no_grad()
def sglang_rollouts(path, seed=0):
    """``N`` RLVR trajectories (AReaL's ``RLVRWorkflow`` keys) whose responses are sampled from
    the model at ``path`` as SGLang's PyTorch sampler does (temperature, then top-k and top-p
    on the full distribution, intersected; exactly k, lowest ids first), and whose
    ``logprobs`` are SGLang's: the sampled token's log-prob over the full vocabulary."""
    import gbc_reference as ref
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    batch = []
    for i in range(N):
        ids = torch.randint(0, V - 2, (P,), generator=g)
        lp = torch.zeros(P + R)
        for t in range(R):
            z = model(ids[None]).logits[0, -1] / T
            keep = ref.kept_set(z, TOP_K, TOP_P, 0.0, "first", "sglang")
            y = torch.multinomial(torch.softmax(z.masked_fill(~keep, float("-inf")), -1), 1,
                                  generator=g)
            lp[P + t] = torch.log_softmax(z, -1)[y].float()
            ids = torch.cat([ids, y])
        ver = torch.full((P + R,), -1, dtype=torch.int32)
        ver[P:] = 0
        traj = dict(input_ids=ids.int(), loss_mask=torch.cat([torch.zeros(P),
                                                              torch.ones(R)]).int(),
                    logprobs=lp, versions=ver, attention_mask=torch.ones(P + R, dtype=torch.bool),
                    rewards=torch.tensor(float((i * 7 + seed) % 3 == 0)))
        batch.append({k: v.unsqueeze(0) for k, v in traj.items()})
    return batch


@torch.no_grad()
def replay_by_hand(path, batch):
    """Per trajectory, run alone in float64: the log-probs over the kept set rebuilt from the
    model's own logits (``gbc_reference.truncation_support_ids``, SGLang's rule at ``T``) and
    ``log_kept_mass``, aligned as AReaL's rolled log-probs."""
    import gbc_reference as ref
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    seen = []
    model.lm_head.register_forward_pre_hook(lambda m, a: seen.append(a[0][0]))
    W = model.lm_head.weight
    logp, lkm = [], []
    for traj in batch:
        ids = traj["input_ids"][0].long()
        model(ids[None])
        h, y = seen.pop(), torch.roll(ids, -1)
        sup = ref.truncation_support_ids(h, W, y, temperature=T, top_k=TOP_K, top_p=TOP_P,
                                         ties="first", rule="sglang")
        lp, _, lk = ref.fused_linear_logprobs(h, W, y, temperature=T, support_ids=sup,
                                              return_log_kept_mass=True)
        logp.append(lp.float()[None])
        lkm.append(lk.float()[None])
    return logp, lkm


def _masked_head(engine):
    """AReaL's stock engine with its logits restricted to the kept set rebuilt from themselves
    (``gbc_reference.kept_set`` on ``logits / T``, SGLang's rule; the rolled label always a
    member) and ``-1e30`` elsewhere: AReaL's own ``gather_logprobs_entropy`` then gives the
    log-probs and entropy over the set, and their gradients: the policy of ``support=replay``
    put into AReaL's stock update by hand."""
    import gbc_reference as ref

    inner = engine.model
    ids = {}

    def keep_ids(module, args, kwargs):
        ids["x"] = kwargs.get("input_ids", args[0] if args else None)

    def mask(module, args, out):
        z = out.detach().double() / T
        keep = ref.kept_set(z, TOP_K, TOP_P, 0.0, "first", "sglang")
        y = torch.roll(ids["x"], -1, -1).reshape(keep.shape[:-1])
        keep.scatter_(-1, y.long().unsqueeze(-1).to(keep.device), True)
        return torch.where(keep, out, torch.full_like(out, -1e30))

    inner.register_forward_pre_hook(keep_ids, with_kwargs=True)
    inner.lm_head.register_forward_hook(mask)


# decoupled PPO with clamp rejection sampling (behave_imp_weight exists), a KL reward against a
# reference model, 2 minibatches (the second update's kept set is rebuilt at new parameters),
# one trajectory per micro-batch (each runs alone, as the float64 oracle runs it)
CONFIGS = {
    "decoupled": dict(use_decoupled_loss=True, eps_clip_higher=0.28, c_clip=2.0,
                      rejection_sampling=_rs(level="token", action="clamp", metric="ratio",
                                             upper=2.0)),
    "coupled-recompute": dict(recompute_logprob=True),
}


def _cfg(name, **kw):
    from areal.api.cli_args import MicroBatchSpec

    return dict(CONFIGS[name], temperature=T, kl_ctl=0.1, ppo_n_minibatches=2,
                mb_spec=MicroBatchSpec(max_tokens_per_mb=P + R), **kw)


def _experiment(policy, ref_path, cfg_kw, gconfig=None, rollout="sglang:d1",
                sampling_backend="pytorch", **extra):
    import types

    from areal.api.cli_args import GenerationHyperparameters

    exp = dict(actor=make_config(policy, **cfg_kw),
               ref=make_config(ref_path, **dict(cfg_kw, optimizer=None)),
               gconfig=gconfig or GenerationHyperparameters(top_k=TOP_K, top_p=TOP_P,
                                                            temperature=T),
               rollout=types.SimpleNamespace(backend=rollout),
               sglang=types.SimpleNamespace(sampling_backend=sampling_backend))
    exp.update(extra)
    return types.SimpleNamespace(**exp)


def _run(actor, ref, batch, by_hand=None):
    """AReaL's trainer's order: the reference's and the actor's compute_logp (or, ``by_hand``,
    the float64 ones put in), compute_advantages, ppo_update."""
    import copy

    from areal.utils import stats_tracker

    batch = copy.deepcopy(batch)
    if by_hand is None:
        if ref is not None:
            for traj, lp in zip(batch, ref.compute_logp(batch)):
                traj["ref_logp"] = lp
        for traj, lp in zip(batch, actor.compute_logp(batch)):
            traj["prox_logp"] = lp
    else:
        for traj, rl, pl in zip(batch, by_hand["ref"], by_hand["prox"]):
            traj["ref_logp"], traj["prox_logp"] = rl, pl
    stats_tracker.export_all(reset=True)
    adv = actor.compute_advantages(batch)
    behaviour = [t["logprobs"].clone() for t in adv]          # rolled, as the loss sees it
    stats_tracker.export_all(reset=True)
    actor.ppo_update(adv)
    return dict(stats=stats_tracker.export_all(reset=True), params=_params(actor),
                prox=[t["prox_logp"] for t in batch], ref=[t.get("ref_logp") for t in batch],
                behaviour=behaviour, kept=[t.get("gbc_log_kept_mass") for t in batch])


def _worker_replay(rank, world, paths, config, batch):
    from areal.api.alloc_mode import ModelAllocation
    from areal.engine.fsdp_engine import FSDPPPOActor
    from areal.trainer.rl_trainer import PPOTrainer

    import gbc_kernels
    from gbc_kernels.integrations import areal as gbc_areal

    policy, ref_path = paths
    os.environ["AREAL_SPMD_MODE"] = "1"
    cfg_kw = _cfg(config)
    out = {}
    # gbc: AReaL's own loading path after enable(experiment, support="replay")
    exp = _experiment(policy, ref_path, cfg_kw)
    gbc_areal.enable(exp, support="replay", support_set="per_pass")
    alloc = ModelAllocation.from_str("fsdp:d1", name="actor")
    ref = _init(PPOTrainer._create_train_engine(None, exp.ref, alloc))
    actor = _init(PPOTrainer._create_train_engine(None, exp.actor, alloc))
    want = gbc_kernels.SamplerTruncation(top_k=TOP_K, top_p=TOP_P, ties="first", rule="sglang")
    out["truncation"] = (type(actor).__name__, actor._gbc_truncation == want,
                         ref._gbc_truncation == want)
    out["gbc"] = _run(actor, ref, batch)
    ref.destroy()
    actor.destroy()
    gbc_areal.disable()
    # by hand: float64 proximal / reference log-probs over the kept set, the rollout's log-probs
    # moved by the float64 kept mass, AReaL's stock actor with its logits restricted to the set
    prox, lkm = replay_by_hand(policy, batch)
    ref_lp, _ = replay_by_hand(ref_path, batch)
    hand_batch = []
    for traj, lk in zip(batch, lkm):
        traj = dict(traj)
        traj["logprobs"] = traj["logprobs"] - torch.roll(lk, 1, -1) * traj["loss_mask"]
        hand_batch.append(traj)
    stock = FSDPPPOActor(make_config(policy, **cfg_kw))
    stock.create_process_group()
    _init(stock)
    _masked_head(stock)
    out["by_hand"] = _run(stock, None, hand_batch, by_hand=dict(prox=prox, ref=ref_lp))
    out["by_hand"]["kept"] = lkm
    stock.destroy()
    # neither mode: gbc's actor, support off (AReaL's own numbers), on the same rollouts
    os.environ[gbc_areal.OPTIONS_ENV] = ""
    plain = gbc_areal.GBCFSDPPPOActor(make_config(policy, **cfg_kw))
    plain.create_process_group()
    _init(plain)
    out["plain"] = _run(plain, None, batch)
    plain.destroy()
    return out


def _response(batch, t):
    """``t`` (rolled, as AReaL's log-probs) on the response tokens."""
    return torch.cat([x[0, P - 1:P + R - 1] for x in t])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_replay_equals_areals_stock_step_over_the_kept_set_by_hand(tiny, config):
    """``enable(experiment, support="replay")`` then AReaL's trainer's engines and order: the
    reference and proximal log-probs equal float64 ones over the kept set rebuilt from each
    model's own logits (SGLang's rule at gconfig's temperature; the reference's set its own);
    under the decoupled loss the behaviour log-probs become SGLang's minus the kept mass of the
    actor's pass (equal to the float64 kept mass); the whole step (KL reward, behave weight,
    clip, two minibatches) equals AReaL's stock step with those log-probs put in and its logits
    restricted to the set, and differs from the step without support. The sampler ratio
    AReaL logs (``behave_imp_weight``, the decoupled config) is 1 without support (SGLang's
    log-probs are full-vocabulary, as the policy's) and 1 under replay; replay without moving
    SGLang's log-probs would give the mean of ``1 / kept mass``."""
    batch = sglang_rollouts(tiny[0])
    res = spawn_gloo(1, _worker_replay, tiny, config, batch)[0]
    ours, hand, plain = res["gbc"], res["by_hand"], res["plain"]
    assert res["truncation"] == ("GBCFSDPPPOActor", True, True)
    for name in ("ref", "prox"):       # every position but the last: its label is packing's
        worst = max((a - b)[:, :-1].abs().max().item() for a, b in zip(ours[name], hand[name]))
        assert worst < 1e-5, (name, worst)
    _compare(dict(ours, prox=[0 * t for t in hand["prox"]]),
             dict(hand, prox=[0 * t for t in hand["prox"]]), skip=("gbc_support",))
    diff = max((plain["params"][n] - ours["params"][n]).abs().max().item()
               for n in plain["params"])
    assert diff > 1e-5, diff
    lk = _response(batch, hand["kept"])
    assert 0.5 < lk.exp().mean() < 0.97 and (lk < -1e-3).float().mean() > 0.5
    raw = _response(batch, [torch.roll(t["logprobs"], -1, -1) for t in batch])
    if config != "decoupled":
        assert all(k is None for k in ours["kept"])      # no correction: AReaL drops them
        return
    torch.testing.assert_close(_response(batch, ours["kept"]), lk, rtol=0, atol=1e-5)
    torch.testing.assert_close(_response(batch, ours["behaviour"]), raw - lk, rtol=0,
                               atol=1e-5)
    key = "ppo_actor/update/behave_imp_weight/avg"
    off, replay = plain["stats"][key], ours["stats"][key]
    unmoved = torch.exp(_response(batch, ours["prox"]) - raw).mean().item()
    print(f"\nAReaL sampler ratio (behave_imp_weight) mean over {lk.numel()} response tokens: "
          f"off {off:.7f} (|1 - x| {abs(1 - off):.1e}), kept_mass refused, replay {replay:.7f} "
          f"(|1 - x| {abs(1 - replay):.1e}); replay with SGLang's log-probs unmoved {unmoved:.4f}; "
          f"mean kept mass {lk.exp().mean().item():.4f}, mean 1/kept mass "
          f"{(-lk).exp().mean().item():.4f}")
    assert abs(off - 1) < 1e-4 and abs(replay - 1) < 1e-4, (off, replay)
    assert unmoved > 1.05 and abs(unmoved - (-lk).exp().mean().item()) < 1e-3, unmoved


# ---- refused by name ---------------------------------------------------------------------

@pytest.fixture
def switched(monkeypatch):
    from gbc_kernels.integrations import areal as gbc_areal

    monkeypatch.setenv("AREAL_SPMD_MODE", "1")
    yield gbc_areal
    gbc_areal.disable()


def _gc(**kw):
    from areal.api.cli_args import GenerationHyperparameters

    return GenerationHyperparameters(**{**dict(top_k=TOP_K, top_p=TOP_P, temperature=T), **kw})


@pytest.mark.parametrize("case,match", [
    ("kept_mass", r"support=kept_mass: AReaL 1\.0\.4 rolls out with SGLang, whose log-probs .* "
                  r"over the full vocabulary already"),
    ("no experiment", r"support=replay needs enable\(config, \.\.\.\) with AReaL's experiment"),
    ("vllm", r"support=replay with rollout.backend='vllm:d1': .* vLLM's raw ones"),
    ("greedy", r"support=replay with gconfig.greedy=True"),
    ("penalty", r"support=replay with gconfig.frequency_penalty=0.5"),
    ("actor temperature", r"support=replay: actor.temperature=1.0 differs from "
                          r"gconfig.temperature=0.8"),
    ("ref temperature", r"support=replay: ref.temperature=1.0 differs from gconfig"),
    ("teacher", r"support=replay with a teacher"),
    ("no truncation", r"support=replay: the rollout samples without truncation"),
    ("bad top_p", r"support=replay: top_p: expected a float in \(0, 1\]"),
    ("coupled", r"support=replay with recompute_logprob=false without use_decoupled_loss"),
    ("loglinear", r"support=replay with prox_logp_method='loglinear'"),
    ("nthr", r"support=replay with nthr=true"),
    ("ties alone", r"support_ties=all: the tie rule of the rebuilt kept set"),
])
def test_bad_settings_stop_enable_by_name(tiny, switched, case, match):
    """Each refusal stops ``enable(experiment, ...)`` before anything is patched."""
    import areal.engine as areal_engine

    before = areal_engine.FSDPPPOActor
    opts = dict(support="replay")
    actor_kw = dict(coupled=dict(use_decoupled_loss=False, rejection_sampling=None),
                    loglinear=dict(prox_logp_method="loglinear"),
                    nthr=dict(recompute_logprob=True))
    actor_kw["actor temperature"] = dict(temperature=1.0)
    gconfigs = {"greedy": _gc(greedy=True), "penalty": _gc(frequency_penalty=0.5),
                "no truncation": _gc(top_k=int(1e8), top_p=1.0), "bad top_p": _gc(top_p=1.5)}
    exp = _experiment(*tiny, {**_cfg("decoupled"), **actor_kw.get(case, {})},
                      gconfig=gconfigs.get(case),
                      rollout="vllm:d1" if case == "vllm" else "sglang:d1",
                      **({"teacher": object()} if case == "teacher" else {}))
    if case == "ref temperature":
        exp.ref.temperature = 1.0
    if case == "no experiment":
        exp = None
    elif case == "kept_mass":
        opts = dict(support="kept_mass")
    elif case == "ties alone":
        opts = dict(support_ties="all")
    elif case == "nthr":
        opts["nthr"] = True
    with pytest.raises(ValueError, match=match):
        switched.enable(exp, **opts)
    assert areal_engine.FSDPPPOActor is before and switched.ENV not in os.environ


def test_engine_refuses_what_enable_would(tiny, monkeypatch):
    """AReaL's workers build the engine from the environment: kept_mass, replay without the
    sampling settings enable(config) writes, and an engine temperature other than the
    rollout's are refused where it is built, naming the option."""
    from gbc_kernels.integrations.areal import OPTIONS_ENV, SAMPLER_ENV
    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    cfg = make_config(tiny[0], **_cfg("decoupled"))
    monkeypatch.setenv(OPTIONS_ENV, "support=kept_mass")
    with pytest.raises(ValueError, match="support=kept_mass: AReaL 1.0.4 rolls out with SGLang"):
        GBCFSDPPPOActor(cfg)
    monkeypatch.setenv(OPTIONS_ENV, "support=replay")
    monkeypatch.delenv(SAMPLER_ENV, raising=False)
    with pytest.raises(ValueError, match=f"support=replay: no rollout sampling settings "
                                         f"\\({SAMPLER_ENV}\\)"):
        GBCFSDPPPOActor(cfg)
    monkeypatch.setenv(SAMPLER_ENV, "top_k=50,top_p=0.9,min_p=0.0,ties=first,temperature=1.0")
    with pytest.raises(ValueError, match="this engine's temperature=0.8 differs from the "
                                         "rollout's gconfig.temperature=1.0"):
        GBCFSDPPPOActor(cfg)


def test_enable_hands_the_settings_to_the_engines(tiny, switched):
    """The settings reach the engine (SGLang's rule; ties "first", or ``support_ties``; a
    ``top_k`` of -1 no bound); an experiment whose SGLang samples with its default backend
    (FlashInfer) is warned about; a later ``enable()`` without support clears them."""
    from gbc_kernels import SamplerTruncation
    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    kw = _cfg("decoupled")
    exp = _experiment(*tiny, kw, gconfig=_gc(top_k=-1))
    switched.enable(exp, support="replay", support_ties="all", support_set="per_pass")
    assert os.environ[switched.SAMPLER_ENV] == \
        "top_k=none,top_p=0.9,min_p=0.0,ties=all,temperature=0.8"
    assert GBCFSDPPPOActor(exp.actor)._gbc_truncation == SamplerTruncation(
        top_p=TOP_P, ties="all", rule="sglang")
    with pytest.warns(UserWarning, match="sglang.sampling_backend=None"):
        switched.enable(_experiment(*tiny, kw, sampling_backend=None), support="replay",
                        support_set="per_pass")
    assert GBCFSDPPPOActor(exp.actor)._gbc_truncation == SamplerTruncation(
        top_k=TOP_K, top_p=TOP_P, ties="first", rule="sglang")
    switched.enable(exp, ar_alpha=0.1)
    assert switched.SAMPLER_ENV not in os.environ
    assert GBCFSDPPPOActor(exp.actor)._gbc_truncation is None


def test_single_controller(tiny, switched):
    """AReaL's single controller: coupled with ``recompute_logprob`` (AReaL replaces the
    rollout's log-probs; nothing travels in the trajectories) runs, the specs carrying the
    options and the settings; the decoupled loss is refused (the kept mass would travel in
    the trajectories, which it serialises)."""
    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    exp = _experiment(*tiny, _cfg("coupled-recompute"))
    switched.enable(exp, support="replay", support_set="per_pass")
    GBCFSDPPPOActor.as_controller(exp.actor, None)
    assert all(s.env_vars[switched.OPTIONS_ENV] == "support=replay,support_set=per_pass" and
               s.env_vars[switched.SAMPLER_ENV].startswith("top_k=50,top_p=0.9")
               for s in exp.actor.scheduling_spec)
    exp = _experiment(*tiny, _cfg("decoupled"))
    switched.enable(exp, support="replay", support_set="per_pass")
    with pytest.raises(ValueError, match="support=replay: under use_decoupled_loss the kept "
                                         "mass that moves the rollout's log-probs travels in "
                                         "the trajectories, which AReaL's single controller"):
        GBCFSDPPPOActor.as_controller(exp.actor, None)


def _worker_whole_vocab(rank, world, path):
    from gbc_kernels.integrations.areal import OPTIONS_ENV, SAMPLER_ENV
    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    os.environ[OPTIONS_ENV] = "support=replay"
    os.environ[SAMPLER_ENV] = f"top_k={V},top_p=1.0,min_p=0.0,ties=first,temperature={T}"
    eng = GBCFSDPPPOActor(make_config(path, **_cfg("decoupled")))
    eng.create_process_group()
    try:
        _init(eng)
    except ValueError as err:
        return str(err)
    finally:
        eng.destroy()
    return None


def test_top_k_over_the_vocabulary_is_refused_at_initialize(tiny):
    """``gconfig.top_k`` at or above the model's vocabulary with ``top_p`` 1 keeps every token:
    nothing to replay, refused once the model is loaded."""
    err = spawn_gloo(1, _worker_whole_vocab, tiny[0])[0]
    assert err is not None and f"gconfig.top_k={V} >= the model's vocabulary ({V})" in err
