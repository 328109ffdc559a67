"""OpenRLHF 0.11.2 with the sampler's kept set rebuilt from its rollout settings (issue 61):
``support=replay`` and ``support=kept_mass`` through ``enable()``, OpenRLHF's own
``DeepspeedStrategy.prepare`` (which hands the models their arguments), the patched
``Actor.forward`` (the experience maker's actor and reference passes), its
``NaiveReplayBuffer.append`` and ``training_step``, against OpenRLHF's stock step (its
``PolicyLoss`` with the train/rollout correction, ``compute_approx_kl``, ``aggregate_loss``) fed
the corrected log-probs by hand: the old and reference log-probs over the kept set and the
rollout log-probs moved by the kept mass, both from float64 full logits and
``gbc_reference.kept_set`` (vLLM's rule).

The rollouts are drawn by a stand-in for vLLM 0.29 with OpenRLHF's settings (``top_p``,
``temperature``; no top-k, no min-p) on the same tiny model: each token sampled from the
softmax of the model's own float32 logits renormalised over the kept set, its processed
log-prob (``logprobs_mode="processed_logprobs"``) recorded. The sampler-ratio means with
neither mode, ``kept_mass`` and ``replay`` are printed (``pytest -s``) and in
docs/openrlhf.md.
"""

from __future__ import annotations

import copy
import sys
import types
from types import SimpleNamespace

import pytest
import torch

import test_openrlhf as T_
from test_openrlhf import ORL, make_actor, openrlhf_loss, tiny_model
from test_openrlhf_packing import packed_actor

import gbc_reference as R  # noqa: E402
from gbc_kernels.integrations import openrlhf as gorl  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import make_experience_batch  # noqa: E402
from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer  # noqa: E402

TEMP, TOP_P, LR = T_.TEMP, 0.8, T_.LR
B, P, T = 8, 4, T_.T                    # samples, prompt, response (openrlhf_loss's T)
LENGTHS = [7, 5, 7, 2, 7, 6, 1, 7]     # response lengths (right padding after them)


def _strategy_cls():
    """OpenRLHF's ``DeepspeedStrategy`` (its module imports torchdata's
    ``StatefulDataLoader``, for its dataloaders only: a placeholder while it is imported when
    torchdata is missing)."""
    try:
        import torchdata.stateful_dataloader  # noqa: F401
        stub = False
    except ImportError:
        stub = True
        td, sd = types.ModuleType("torchdata"), types.ModuleType("torchdata.stateful_dataloader")
        sd.StatefulDataLoader = type("StatefulDataLoader", (), {})
        td.stateful_dataloader = sd
        sys.modules.update({"torchdata": td, "torchdata.stateful_dataloader": sd})
    try:
        from openrlhf.utils.deepspeed import DeepspeedStrategy
    finally:
        if stub:
            for name in ("torchdata", "torchdata.stateful_dataloader"):
                sys.modules.pop(name, None)
    return DeepspeedStrategy


STRATEGY = _strategy_cls()


def prepared(model, args, train=False):
    """``strategy.prepare`` as OpenRLHF's workers call it (the policy with its optimizer
    config, the reference alone), DeepSpeed's engine left out: the patched ``prepare`` hands
    the model the strategy's arguments, then OpenRLHF's own ``prepare`` runs."""
    s = STRATEGY.__new__(STRATEGY)
    s.args = args
    s._ds_init_eval_model = lambda m: m
    s._ds_init_train_model = lambda m, cfg: (m, None, None)
    return s.prepare((model, {}))[0] if train else s.prepare(model)


def sargs(top_p=TOP_P, **kw):
    """OpenRLHF's arguments (``_margs``) with its rollout settings."""
    args = T_._margs(**kw)
    args.rollout.top_p, args.rollout.temperature = top_p, TEMP
    return args


# --------------------------------------------------------------------------- the sampler
def sample_rollouts(seed=0, top_p=TOP_P, temperature=TEMP, lengths=LENGTHS, stop_id=None):
    """vLLM 0.29's sampling (min-p, top-k off; top-p on the temperature-scaled float32 logits,
    the crossing token kept: ``gbc_reference.kept_set``) on ``tiny_model(0)``: an Experience
    as OpenRLHF's experience maker has it (right-padded responses, ``rollout_log_probs`` the
    processed log-probs: log-softmax over the kept set). ``stop_id``: vLLM's min-tokens
    processor (``min_tokens=1``) removes that stop token before the first response token's
    temperature and cut (by default the sampler has no stop token)."""
    model = tiny_model(0)
    g = torch.Generator().manual_seed(100 + seed)
    seq = torch.randint(1, T_.V, (B, P), generator=g)
    lps = []
    with torch.no_grad():
        for j in range(T):
            z = model(seq).logits[:, -1].float()
            if stop_id is not None and j == 0:
                z[:, stop_id] = float("-inf")
            z = z / temperature
            keep = R.kept_set(z, top_p=top_p)
            lsm = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)
            y = torch.multinomial(lsm.exp(), 1, generator=g)
            lps.append(lsm.gather(1, y)[:, 0])
            seq = torch.cat([seq, y], 1)
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    seq[:, P:][~mask] = 0
    am = torch.ones(B, P + T, dtype=torch.long)
    am[:, P:] = mask.long()
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask
    return ORL.Experience(sequences=seq, attention_mask=am, action_mask=mask,
                          rollout_log_probs=torch.stack(lps, 1) * mask, advantages=adv,
                          index=list(range(B)), info={})


def ref64(model, exp, top_p=TOP_P, temperature=TEMP):
    """Float64 references from the full logits of a float64 copy of ``model``: the actions'
    log-probs over the whole vocabulary and over the kept set (the target forced in), the
    kept mass ``LSE_S - LSE_V`` and the entropy over the set, ``[B, T]``, 0 off the mask."""
    m64 = copy.deepcopy(model).double()
    m64.config._attn_implementation = "eager"
    am, Tn = exp.attention_mask, exp.action_mask.shape[1]
    pos = (am.long().cumsum(-1) - 1).masked_fill(am == 0, 1)
    with torch.no_grad():
        z = m64(exp.sequences, attention_mask=am, position_ids=pos).logits[:, -Tn - 1:-1]
    z = z.double() / temperature
    y = exp.sequences[:, -Tn:]
    keep = R.kept_set(z, top_p=top_p).scatter(-1, y[..., None], True)
    zs = z.masked_fill(~keep, float("-inf"))
    lse_v, lse_s = z.logsumexp(-1), zs.logsumexp(-1)
    zy = z.gather(-1, y[..., None])[..., 0]
    q = zs.log_softmax(-1)
    ent = -(q.exp() * q.masked_fill(~keep, 0.0)).sum(-1)
    m = exp.action_mask.double()
    return SimpleNamespace(logp_v=(zy - lse_v) * m, logp_s=(zy - lse_s) * m,
                           lk=(lse_s - lse_v) * m, entropy_s=ent * m)


def over_kept_set(model, temperature=TEMP, top_p=TOP_P):
    """An ``Actor``-like callable for ``openrlhf_loss``: the policy's log-probs (and entropy)
    with autograd over the kept set rebuilt from its own logits (vLLM's rule on the detached
    float64 logits, the target forced in), from full logits: the stock loss fed the replayed
    log-probs."""
    def call(sequences, action_mask, attention_mask=None, return_output=False,
             return_entropy=False):
        Tn = action_mask.shape[1]
        pos = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        z = model(sequences, attention_mask=attention_mask,
                  position_ids=pos).logits[:, -Tn - 1:-1].float() / temperature
        y = sequences[:, -Tn:]
        keep = R.kept_set(z.detach().double(), top_p=top_p).scatter(-1, y[..., None], True)
        q = z.masked_fill(~keep, float("-inf")).log_softmax(-1)
        logp = q.gather(-1, y[..., None])[..., 0]
        ent = -(q.exp() * q.masked_fill(~keep, 0.0)).sum(-1)
        return (logp, SimpleNamespace(entropy=ent)) if return_output else logp
    return call


# ---------------------------------------------------------------------- the switched-on flow
@pytest.fixture
def methods_off():
    gorl.disable()
    yield
    gorl.disable()


def _enable(**options):
    gorl.enable(actor_cls=ORL.Actor, trainer_cls=False, buffer_cls=NaiveReplayBuffer, **options)


def trainer(args, packing=False, seed=0):
    """``T_._trainer`` whose actor went through OpenRLHF's (patched) ``strategy.prepare``."""
    t = T_._trainer(args, seed)
    t.actor = packed_actor(seed, TEMP, packing)
    t.actor_optim = torch.optim.SGD(t.actor.model.parameters(), lr=LR)
    t.actor_scheduler = torch.optim.lr_scheduler.LambdaLR(t.actor_optim, lambda _: 1.0)
    t.actor = prepared(t.actor, args, train=True)
    return t


def make_experience(t, args, exp, ref_actor=None):
    """The experience maker's passes (the patched ``Actor.forward`` of the policy and the
    reference model, no grad) and the replay buffer's ``append``; returns the buffer's
    training batch."""
    exp = copy.deepcopy(exp)
    t.actor.eval()
    with torch.no_grad():
        exp.action_log_probs = t.actor(exp.sequences, exp.action_mask, exp.attention_mask)
        if ref_actor is not None:
            exp.base_action_log_probs = ref_actor(exp.sequences, exp.action_mask,
                                                  exp.attention_mask)
    t.actor.train()
    t.replay_buffer = T_._buffer(exp, B)
    return exp, make_experience_batch(t.replay_buffer.items)


def reference_actor(args, packing=False):
    ref = packed_actor(3, TEMP, packing)
    ref.gbc_reference = True
    return prepared(ref, args)


def _step_stock(exp, args, actor, lbi):
    """OpenRLHF's stock training step (its loss pieces, one SGD step) on ``exp``."""
    loss, metrics = openrlhf_loss(actor, exp, args, 0.05, lbi)
    loss.backward()
    return metrics


def _sgd(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad


def _status_close(status, metrics, keys):
    for k in keys:
        got, want = (float(torch.as_tensor(x).detach())
                     for x in (status["metrics"][k], metrics[k]))
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (k, got, want)


MODE_ARGS = {
    "ppo-token-mask-kl-entropy": dict(kl="k3", entropy_coef=0.01, is_level="token"),
    "ppo-seq-mask": dict(is_level="seq", loss_agg_mode="seq-mean-token-mean"),
    "ppo-token-clip": dict(is_level="token", is_mode="clip", dual_clip=3.0),
    "ppo-token-tv": dict(is_level="token", is_gating="tv", is_threshold=(0.0, 3e-3)),
    "gspo-is": dict(policy_loss_type="gspo", is_level="token", eps=(3e-4, 4e-4)),
}


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("case", sorted(MODE_ARGS))
def test_kept_mass_equals_the_stock_step_on_moved_rollout_logprobs(case, packing, methods_off):
    """``support=kept_mass``: the actor's pass gives the whole vocabulary's log-probs, bit for
    bit the pass without the option, and keeps ``log_kept_mass`` (= the float64 ``LSE_S -
    LSE_V``), which the buffer's ``append`` stores; ``training_step`` then equals OpenRLHF's
    stock step with ``rollout_log_probs + log_kept_mass`` put in by hand (parameters, the
    correction's metrics), and differs from the step without the option."""
    args = sargs(**MODE_ARGS[case])
    rollout = sample_rollouts()
    _enable(support="kept_mass")
    t = trainer(args, packing)
    ref_actor = reference_actor(args, packing) if args.algo.kl.use_loss else None
    exp, batch = make_experience(t, args, rollout, ref_actor)
    plain = gorl.fused_action_log_probs(t.actor, exp.sequences, exp.action_mask,
                                        exp.attention_mask)
    assert torch.equal(exp.action_log_probs, plain)
    want = ref64(t.actor.model, exp)
    lk = torch.stack([it.info[gorl.KEPT_MASS_KEY] for it in t.replay_buffer.items])
    assert torch.allclose(lk.double(), want.lk, atol=2e-6)
    assert (want.lk[exp.action_mask] < -0.05).all()
    lbi = ORL.get_loss_batch_info(None, batch.action_mask)
    status = gorl.training_step(t, batch, 0.05, 0, lbi)
    gorl.disable()
    model = tiny_model(0)
    stock = copy.deepcopy(exp)
    stock.rollout_log_probs = exp.rollout_log_probs + want.lk.float()
    metrics = _step_stock(stock, args, make_actor(model, TEMP), lbi)
    _sgd(model)
    T_._close(t.actor.model, model)
    _status_close(status, metrics, [k for k in ("vllm_kl", "is_filter_ratio", "ppo_kl", "kl")
                                    if k in metrics])
    if "vllm_kl" in metrics:
        assert abs(float(metrics["vllm_kl"])) < 1e-5        # the moved rollout matches old
    off = tiny_model(0)
    _step_stock(copy.deepcopy(exp), args, make_actor(off, TEMP), lbi)
    _sgd(off)
    assert T_._differs(T_._params(off), T_._params(model))


REPLAY_ARGS = dict(MODE_ARGS, **{"ppo-correction-off-kl": dict(kl="k2", entropy_coef=0.0)})


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("case", sorted(REPLAY_ARGS))
def test_replay_equals_the_stock_step_over_the_kept_set(case, packing, methods_off):
    """``support=replay, support_set=per_pass``: the actor's and the reference model's passes
    give their log-probs over the kept set rebuilt from their own logits (= float64
    references); ``training_step`` (the policy over the set rebuilt from its own logits, the
    rollout's processed log-probs unchanged) equals OpenRLHF's stock step with the policy's,
    old and reference log-probs over the kept sets put in by hand; the sampled tokens are in
    their sets."""
    args = sargs(**REPLAY_ARGS[case])
    rollout = sample_rollouts()
    _enable(support="replay", support_set="per_pass")
    t = trainer(args, packing)
    ref_actor = reference_actor(args, packing) if args.algo.kl.use_loss else None
    exp, batch = make_experience(t, args, rollout, ref_actor)
    want = ref64(t.actor.model, exp)
    assert torch.allclose(exp.action_log_probs.double(), want.logp_s, atol=2e-6)
    assert (want.logp_s - want.logp_v)[exp.action_mask].min() > 0.05
    if ref_actor is not None:
        ref_want = ref64(ref_actor.model, exp)
        assert torch.allclose(exp.base_action_log_probs.double(), ref_want.logp_s, atol=2e-6)
    lbi = ORL.get_loss_batch_info(None, batch.action_mask)
    status = gorl.training_step(t, batch, 0.05, 0, lbi)
    assert float(status["metrics"]["gbc/support_forced_frac"]) == 0.0
    gorl.disable()
    model = tiny_model(0)
    stock = copy.deepcopy(exp)
    stock.action_log_probs = want.logp_s.float()
    if ref_actor is not None:
        stock.base_action_log_probs = ref_want.logp_s.float()
    metrics = _step_stock(stock, args, over_kept_set(model), lbi)
    _sgd(model)
    T_._close(t.actor.model, model)
    _status_close(status, metrics, [k for k in ("vllm_kl", "is_filter_ratio", "ppo_kl", "kl",
                                                "entropy_loss") if k in metrics])


# ------------------------------------------------------------------------------ measured
def _ratios(mode, rollout, monkeypatch):
    """OpenRLHF's train/rollout ratio ``exp(old - rollout)`` per response token as its
    correction sees it in ``training_step`` (the inputs of ``is_correction``), with
    ``support=mode`` (None: off)."""
    from gbc_kernels.integrations.openrlhf import actor as gactor

    seen = []
    own = gactor.is_correction

    def recorded(args, old, rollout_log_probs, mask):
        seen.append((old.detach().clone(), rollout_log_probs.detach().clone(), mask.clone()))
        return own(args, old, rollout_log_probs, mask)

    monkeypatch.setattr(gactor, "is_correction", recorded)
    args = sargs(is_level="token", is_threshold=(0.01, 100.0))
    gorl.disable()
    _enable(**({} if mode is None else {"support": mode}),
            **({"support_set": "per_pass"} if mode == "replay" else {}))
    t = trainer(args)
    exp, batch = make_experience(t, args, rollout)
    gorl.training_step(t, batch, 0.0, 0, ORL.get_loss_batch_info(None, batch.action_mask))
    gorl.disable()
    old, sampler, mask = seen[0]
    return (old - sampler).exp()[mask.bool()].double(), exp


def test_measured_sampler_ratio(monkeypatch, methods_off, record_property):
    """Rollouts drawn with OpenRLHF's settings (top_p 0.8, temperature 0.9) from the tiny
    model itself: the ratio OpenRLHF's correction computes between the old policy and the
    sampler is the kept mass per token without a mode (mean well below 1) and 1 within float32
    noise with ``kept_mass`` and with ``replay``."""
    rollout = sample_rollouts()
    means, worst = {}, {}
    for mode in (None, "kept_mass", "replay"):
        r, exp = _ratios(mode, rollout, monkeypatch)
        means[mode or "none"] = float(r.mean())
        worst[mode or "none"] = float((r - 1).abs().max())
        if mode is None:
            kept = ref64(tiny_model(0), exp).lk.exp()[exp.action_mask]
            assert torch.allclose(r, kept, rtol=2e-5)        # the ratio is the kept mass
        else:
            assert (r - 1).abs().max() < 2e-5, (mode, float((r - 1).abs().max()))
    print(f"\nOpenRLHF sampler ratio mean over {int(rollout.action_mask.sum())} response tokens "
          f"(top_p {TOP_P}, temperature {TEMP}): " +
          ", ".join(f"{k} {v:.7f} (max |r - 1| {worst[k]:.1e})" for k, v in means.items()))
    for k, v in means.items():
        record_property(f"sampler_ratio_mean_{k}", v)
    assert means["none"] < 0.95
    assert abs(means["kept_mass"] - 1) < 5e-6 and abs(means["replay"] - 1) < 5e-6


def test_measured_min_tokens_first_token(monkeypatch, methods_off, record_property):
    """What gbc does not reproduce: vLLM's min_tokens=1 (OpenRLHF's default) removes the stop
    tokens from the first response token's distribution before the top-p cut. With an EOS
    masked there by the sampler, the first tokens' ratio is off 1 under both modes by about
    the stop tokens' share of the cut (here a random model: EOS ~1/97), the later tokens'
    are not."""
    eos = 2
    rollout = sample_rollouts(stop_id=eos)
    out = {}
    for mode in ("kept_mass", "replay"):
        r, exp = _ratios(mode, rollout, monkeypatch)
        first = torch.zeros_like(exp.action_mask)
        first[:, 0] = True
        first = first[exp.action_mask]
        out[mode] = (float(r[first].mean()), float((r[~first] - 1).abs().max()))
        assert out[mode][1] < 2e-5                     # later tokens: exact
        assert 1e-4 < abs(out[mode][0] - 1) < 0.05     # first token: not reproduced
    print("\nOpenRLHF min_tokens=1, first response token's ratio mean: " +
          ", ".join(f"{k} {v[0]:.6f}" for k, v in out.items()))
    for k, v in out.items():
        record_property(f"min_tokens_first_ratio_{k}", v[0])


# ------------------------------------------------------------------------------- refused
def _check_refused(t, match):
    with pytest.raises(ValueError, match=match):
        gorl.check_trainer(t)
    with pytest.raises(ValueError, match=match):
        gorl.training_step(t, copy.deepcopy(sample_rollouts()), 0.0, 0)


@pytest.mark.parametrize("options,setting,match", [
    (dict(support="replay"), dict(top_p=1.0),
     r"^support=replay: rollout.top_p is 1.0 and OpenRLHF 0.11.2 sends vLLM no top_k"),
    (dict(support="kept_mass"), dict(top_p=1.5, is_level="token"),
     r"^support=kept_mass: rollout.top_p: expected a float in \(0, 1\], got 1.5"),
    (dict(support="kept_mass"), dict(), r"^support=kept_mass: algo.advantage."
                                        r"is_correction_level is 'off'"),
    (dict(support="kept_mass"), dict(is_level="token", dynamic=True),
     r"^support=kept_mass: train.dynamic_batch_enable"),
    (dict(support="replay"), dict(tp=2), r"^support=replay: ds.tensor_parallel_size > 1"),
    (dict(support="replay"), dict(temperature=0.7),
     r"^support=replay: the actor's temperature 0.9 is not rollout.temperature 0.7"),
])
def test_settings_refused_by_name(options, setting, match, methods_off):
    """OpenRLHF settings a mode cannot run with: refused before the first step, naming the
    option and OpenRLHF's setting."""
    args = sargs(top_p=setting.get("top_p", TOP_P), is_level=setting.get("is_level", "off"))
    args.rollout.temperature = setting.get("temperature", TEMP)
    args.train.dynamic_batch_enable = setting.get("dynamic", False)
    args.ds = SimpleNamespace(ring_attn_size=1, tensor_parallel_size=setting.get("tp", 1))
    _enable(**options)
    t = trainer(args)
    _check_refused(t, match)
    if "tp" not in setting and "dynamic" not in setting and options["support"] == "replay":
        exp = sample_rollouts()
        with pytest.raises(ValueError, match=match), torch.no_grad():   # the actor's pass
            t.actor(exp.sequences, exp.action_mask, exp.attention_mask)


@pytest.mark.parametrize("options,match", [
    (dict(support="replay", nthr=True), r"^nthr: not with support=replay"),
    (dict(support="kept_mass", support_ties="all"),
     r"^support_ties=all: OpenRLHF 0.11.2 rolls out without top-k"),
    (dict(support="recompute"), r"^support: expected one of \('replay', 'kept_mass'\)"),
])
def test_enable_refuses_by_name(options, match, methods_off):
    with pytest.raises(ValueError, match=match):
        _enable(**options)
    assert gorl._STATE.methods.support is None


def test_options_from_the_environment_and_the_strategy_patch(monkeypatch, methods_off):
    """``GBC_OPENRLHF_OPTIONS`` carries the mode to the Ray workers; with it on, OpenRLHF's
    ``DeepspeedStrategy.prepare`` is patched (hands the models their arguments) and gets its
    own method back on ``disable``; off, it is left alone."""
    monkeypatch.setenv(gorl.ENV_OPTIONS, "support=kept_mass,lopti_eta=0.4")
    _enable()
    assert gorl._STATE.methods.support == "kept_mass"
    assert STRATEGY.prepare is gorl._strategy_prepare
    args = sargs(is_level="token")
    assert getattr(prepared(make_actor(tiny_model(), TEMP), args), gorl.ARGS_ATTR) is args
    gorl.disable()
    assert STRATEGY.prepare is not gorl._strategy_prepare
    monkeypatch.setenv(gorl.ENV_OPTIONS, "lopti_eta=0.4")
    _enable()
    assert STRATEGY.prepare is not gorl._strategy_prepare
    monkeypatch.setenv(gorl.ENV_OPTIONS, "support=sometimes")
    with pytest.raises(ValueError, match=rf"^{gorl.ENV_OPTIONS}: support: expected one of"):
        _enable()


def test_flow_refusals_by_name(methods_off):
    """Where the flow cannot give a mode what it needs, it says so: an actor the strategy did
    not prepare (no sampling settings), a log-prob pass other than the plain no-grad one, an
    experience appended without the actor pass's kept mass, a training step on an experience
    without it, the kept mass asked of a pass without a kept set."""
    exp = sample_rollouts()
    args = sargs(is_level="token")
    _enable(support="replay")
    bare = make_actor(tiny_model(), TEMP)
    with pytest.raises(ValueError, match=r"^support=replay: this Actor carries no OpenRLHF "
                                         r"arguments"), torch.no_grad():
        bare(exp.sequences, exp.action_mask, exp.attention_mask)
    with pytest.raises(ValueError, match=r"^support=replay: this log-prob pass is not the "
                                         r"plain no-grad one"):
        prepared(bare, args)(exp.sequences, exp.action_mask,
                             attention_mask=exp.attention_mask, return_output=True)
    gorl.disable()
    _enable(support="kept_mass")
    t = trainer(args)
    bad = copy.deepcopy(exp)
    bad.action_log_probs = exp.rollout_log_probs
    buf = T_._buffer(copy.deepcopy(bad), B)     # a process with no actor pass (a critic's)
    assert all(gorl.KEPT_MASS_KEY not in it.info for it in buf.items)
    with pytest.raises(ValueError, match=r"^support=kept_mass: the experience carries no "
                                         r"log_kept_mass"):
        gorl.training_step(t, bad, 0.0, 0)
    make_experience(t, args, sample_rollouts(seed=1))          # the policy's process
    with pytest.raises(ValueError, match=r"^support=kept_mass: the experience's samples were "
                                         r"not scored by this process's actor pass"):
        T_._buffer(copy.deepcopy(bad), B)
    with pytest.raises(ValueError, match=r"^return_log_kept_mass: needs sampler_truncation"):
        gorl.fused_action_log_probs(t.actor, exp.sequences, exp.action_mask,
                                    exp.attention_mask, return_log_kept_mass=True)
    with pytest.raises(ValueError, match=r"^log_kept_mass: algo.advantage.is_correction_level "
                                         r"is 'off'"):
        gorl.fused_actor_loss(t.actor, bad, sargs(), 0.0, None,
                              log_kept_mass=torch.zeros(exp.action_mask.shape))


# ------------------------------------------------------------------------ ring attention
def _ring_args(size):
    args = sargs(kl="k3", entropy_coef=0.01, is_level="token")
    args.ds = SimpleNamespace(ring_attn_size=size, packing_samples=True, tensor_parallel_size=1)
    return args


def _ring_run(exp, group=None):
    """Both modes on packed samples (``group``: under ring attention): the no-grad passes
    (replay's over the kept set; kept_mass's whole-vocabulary log-probs and kept mass) and
    the fused loss (value, ring-averaged gradients, per-token values)."""
    import torch.distributed as dist

    args = _ring_args(1 if group is None else dist.get_world_size(group))
    tr = gorl.rollout_truncation(args, gorl.methods.MethodOptions(support="replay"), TEMP)
    out = {}
    lbi = ORL.get_loss_batch_info(None, exp.action_mask)
    for mode in ("replay", "kept_mass"):
        actor = packed_actor(0, TEMP)
        kept = mode == "kept_mass"
        res = gorl.fused_action_log_probs(actor, exp.sequences, exp.action_mask,
                                          exp.attention_mask, ring_attn_group=group,
                                          sampler_truncation=tr, over_support=not kept,
                                          return_log_kept_mass=kept)
        logp, lk = res if kept else (res, None)
        e = copy.deepcopy(exp)
        e.action_log_probs = logp
        e.base_action_log_probs = logp.roll(1, 0)
        token_out = {}
        loss, metrics = gorl.fused_actor_loss(
            actor, e, args, 0.05, lbi, ring_attn_group=group, token_out=token_out,
            **({"log_kept_mass": lk} if kept else {"sampler_truncation": tr}))
        loss.backward()
        grads = T_._grads(actor.model)
        if group is not None:
            for g in grads.values():
                dist.all_reduce(g, group=group)
                g /= dist.get_world_size(group)
        out[mode] = dict(logp=logp, lk=lk, loss=float(loss.detach()), grads=grads,
                         metrics={k: float(v) for k, v in metrics.items()}, token_out=token_out)
    # one set per rollout's building pass: the whole batch's ids on every ring rank
    out["ids"] = gorl.fused_action_log_probs(packed_actor(0, TEMP), exp.sequences,
                                             exp.action_mask, exp.attention_mask,
                                             ring_attn_group=group, sampler_truncation=tr,
                                             return_support_ids=True)[1]
    return out


def _ring_worker(rank, world, exp):
    import os

    import torch.distributed as dist
    from openrlhf.models import ring_attn_utils

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "standins"))
    from ring_flash_attn import substitute_hf_flash_attn

    group = dist.new_group(list(range(world)))
    ring_attn_utils.set_ring_attn_group(group)
    substitute_hf_flash_attn(group, 1)
    return _ring_run(exp, group)


@pytest.mark.slow
def test_both_modes_under_ring_attention():
    """ds.ring_attn_size 2 (2 gloo processes, each a slice of the packed stream; the rows
    keep the whole vocabulary, so top-p without a top-k bound runs): the no-grad passes of
    both modes, the loss, its per-token values and metrics and the ring-averaged gradients
    (and one set per rollout's built ids) equal the packed run in one process (tested against
    OpenRLHF's stock step above)."""
    from conftest import spawn_gloo

    exp = sample_rollouts()
    one = _ring_run(exp)
    ids = one.pop("ids")
    for got in spawn_gloo(2, _ring_worker, exp):
        K = max(ids.shape[-1], got["ids"].shape[-1])
        assert torch.equal(*(torch.nn.functional.pad(x, (0, K - x.shape[-1]), value=-1)
                             for x in (got.pop("ids"), ids)))
        for mode, want in one.items():
            res = got[mode]
            assert torch.allclose(res["logp"], want["logp"], atol=2e-6), mode
            if want["lk"] is not None:
                assert torch.allclose(res["lk"], want["lk"], atol=2e-6)
            assert res["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6), mode
            for k, v in want["metrics"].items():
                assert res["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (mode, k)
            for k, v in want["token_out"].items():
                assert torch.allclose(res["token_out"][k], v, atol=2e-6), (mode, k)
            for n, g in want["grads"].items():
                err = float((res["grads"][n] - g).abs().max() / g.abs().max().clamp(min=1e-12))
                assert err <= 2e-5, (mode, n, err)
    assert one["replay"]["metrics"]["gbc/support_forced_frac"] == 0.0


# ---------------------------------------------------------------- with the other methods
def test_replay_critical_kl_weights_over_the_kept_set(methods_off):
    """``support=replay`` with critical-token KL: the reference model's pass returns its
    log-probs over its own kept set and the weights ``(1 - c) J^gamma + c`` with ``J`` over that
    set (the reference's distribution on ``S`` at the certainty temperature, normalised by
    ``log |S|``; docs/math.md), against float64 full logits."""
    gamma, c, ct = 2.0, 0.1, 1.3
    args = sargs(kl="k3")
    _enable(support="replay", support_set="per_pass", critical_kl_exponent=gamma,
            critical_kl_intercept=c, critical_kl_temperature=ct)
    ref_actor = reference_actor(args)
    exp = sample_rollouts()
    with torch.no_grad():
        packed = ref_actor(exp.sequences, exp.action_mask, exp.attention_mask)
    m64 = copy.deepcopy(ref_actor.model).double()
    am = exp.attention_mask
    pos = (am.long().cumsum(-1) - 1).masked_fill(am == 0, 1)
    with torch.no_grad():
        z = m64(exp.sequences, attention_mask=am, position_ids=pos).logits[:, -T - 1:-1].double()
    y = exp.sequences[:, -T:]
    keep = R.kept_set(z / TEMP, top_p=TOP_P).scatter(-1, y[..., None], True)
    qc = (z / ct).masked_fill(~keep, float("-inf")).log_softmax(-1)
    size = keep.sum(-1).double()
    J = torch.where(size > 1, 1 + qc.amax(-1) / size.clamp(min=2).log(), 1.0)
    w = ((1 - c) * J ** gamma + c) * exp.action_mask
    want = ref64(ref_actor.model, exp)
    assert packed.shape == (B, T, 2)
    assert torch.allclose(packed[..., 0].double(), want.logp_s, atol=2e-6)
    assert torch.allclose(packed[..., 1].double(), w, atol=2e-5)


def test_kept_mass_with_nthr_and_lopti(methods_off):
    """``support=kept_mass`` beside NTHR (its inputs kept from the same actor pass: no second
    forward) and Lopti: the buffer carries both, the kept mass is the one without them and
    the step runs."""
    args = sargs(kl="k3", is_level="token")
    args.rollout.n_samples_per_prompt = 2
    rollout = sample_rollouts()
    lks = []
    for extra in ({}, dict(nthr=True, nthr_beta=0.0, lopti_eta=0.3)):
        gorl.disable()
        _enable(support="kept_mass", **extra)
        t = trainer(args)
        make_experience(t, args, rollout, reference_actor(args))
        lks.append(torch.stack([it.info[gorl.KEPT_MASS_KEY] for it in t.replay_buffer.items]))
    assert all(getattr(it, gorl.KEPT_ATTR, None) is not None for it in t.replay_buffer.items)
    assert gorl.nthr_pass(t)["gbc/nthr_second_forward"] == 0.0
    batch = make_experience_batch(t.replay_buffer.items)
    status = gorl.training_step(t, batch, 0.05, 0, ORL.get_loss_batch_info(None,
                                                                          batch.action_mask))
    assert "vllm_kl" in status["metrics"] and abs(float(status["metrics"]["vllm_kl"])) < 1e-5
    assert torch.equal(lks[0], lks[1])


# ------------------------------------------------------- the whole buffer checked up front
class _Loop:
    """OpenRLHF's ``ActorPPOTrainer.ppo_train`` as far as the update goes (its module imports
    vLLM): the replay buffer's samples in order, ``sample_batch_size`` a micro-batch, each
    through ``training_step`` (the strategy steps the optimizer after each: accumulation 1).
    ``enable(trainer_cls=_Loop)`` puts gbc's ``ppo_train`` and ``training_step`` on it."""

    def ppo_train(self, kl_ctl):
        items, n, status = self.replay_buffer.items, self.replay_buffer.sample_batch_size, {}
        for step, i in enumerate(range(0, len(items), n)):
            exp = make_experience_batch(items[i:i + n])
            status = self.training_step(exp, kl_ctl, step,
                                        ORL.get_loss_batch_info(None, exp.action_mask))
        return status

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        raise AssertionError("gbc's training_step is patched in")


@pytest.mark.parametrize("missing", ["log_kept_mass", "rollout_log_probs"])
def test_kept_mass_refusal_before_the_first_micro_batch(missing, methods_off):
    """``support=kept_mass``: a sample of the update's last micro-batch without the kept mass
    (or without the rollout log-probs it moves) is refused by the patched ``ppo_train``
    before the first micro-batch's step, naming the sample: no gradient, no parameter and no
    optimizer state changed (before, the earlier micro-batches had stepped)."""
    args = sargs(is_level="token")
    gorl.enable(actor_cls=ORL.Actor, trainer_cls=_Loop, buffer_cls=NaiveReplayBuffer,
                support="kept_mass")
    t = _Loop()
    t.__dict__.update(vars(trainer(args)))
    t.actor_optim = torch.optim.Adam(t.actor.model.parameters(), lr=LR)
    t.actor_scheduler = torch.optim.lr_scheduler.LambdaLR(t.actor_optim, lambda _: 1.0)
    make_experience(t, args, sample_rollouts())
    t.replay_buffer.sample_batch_size = 4                  # two micro-batches of 4 samples
    bad = t.replay_buffer.items[B - 1]                     # in the last one
    if missing == "log_kept_mass":
        del bad.info[gorl.KEPT_MASS_KEY]
        match = (rf"^support=kept_mass: the experience carries no log_kept_mass: the replay "
                 rf"buffer's sample {B - 1} \(of {B}; checked for the whole buffer before")
    else:
        bad.rollout_log_probs = None
        match = (rf"^experience.rollout_log_probs: required with log_kept_mass .*: the replay "
                 rf"buffer's sample {B - 1} \(of {B}; checked")
    params = {n: p.detach().clone() for n, p in t.actor.model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        t.ppo_train(0.0)
    for n, p in t.actor.model.named_parameters():
        assert p.grad is None, n
        assert torch.equal(p, params[n]), n
    assert t.actor_optim.state_dict()["state"] == {}
    assert t.actor_scheduler.last_epoch == 0
    if missing == "log_kept_mass":          # the buffer put right, the update runs
        bad.info[gorl.KEPT_MASS_KEY] = t.replay_buffer.items[0].info[gorl.KEPT_MASS_KEY] * 0
        t.ppo_train(0.0)
        assert any(not torch.equal(p, params[n]) for n, p in t.actor.model.named_parameters())


def test_method_metrics_logged_only_when_the_method_runs(methods_off):
    """AR's ``gbc/ar_weight_mean`` and Lopti's ``gbc/low_frac``, ``gbc/grad_share_low`` and
    ``gbc/grad_norm_sum`` are logged by ``training_step`` only when the method runs (before,
    every step logged them: an AR weight of 1, a low share with no split)."""
    args = sargs(is_level="token")
    exp = sample_rollouts()
    names = {"gbc/ar_weight_mean", "gbc/low_frac", "gbc/grad_share_low", "gbc/grad_norm_sum"}
    logged = {}
    for case, options in (("off", {}), ("ar", dict(ar_alpha=0.3)),
                          ("lopti", dict(lopti_eta=0.5))):
        gorl.disable()
        _enable(**options)
        t = trainer(args)
        batch = copy.deepcopy(exp)
        with torch.no_grad():
            batch.action_log_probs = t.actor(batch.sequences, batch.action_mask,
                                             batch.attention_mask)
        status = gorl.training_step(t, batch, 0.0, 0,
                                    ORL.get_loss_batch_info(None, batch.action_mask))
        logged[case] = names & set(status["metrics"])
        assert "gbc/ratio_mean" in status["metrics"]        # the loss's own diagnostics stay
    assert logged == {"off": set(), "ar": {"gbc/ar_weight_mean"},
                      "lopti": {"gbc/low_frac", "gbc/grad_share_low", "gbc/grad_norm_sum"}}
