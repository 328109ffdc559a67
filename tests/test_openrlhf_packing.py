"""OpenRLHF 0.11.2's packed samples (``ds.packing_samples``) and ring attention
(``ds.ring_attn_size > 1``) through gbc's fused loss, its no-grad passes and the methods,
against OpenRLHF's own packed ``Actor.forward`` and ``PolicyLoss``.

flash-attn and ring-flash-attention have no CPU build: ``tests/standins/varlen_attention.py``
runs their packed (varlen) attention on ``scaled_dot_product_attention`` (one causal block per
packed sequence), flash-attn's padding helpers and its autograd ``all_gather``, and
``tests/standins/ring_flash_attn`` the ring attention (K/V gathered over the gloo group, causal
at the tokens' global positions). The tiny Qwen2 of ``test_openrlhf.py`` runs them as its
attention implementation, in OpenRLHF's path and gbc's alike. Ring attention runs in two gloo
processes; its oracle is OpenRLHF's own ring step (every rank's loss from the gathered
log-probs, DeepSpeed's gradient average over the ranks).
"""

from __future__ import annotations

import copy
import os
import sys
from types import SimpleNamespace

import pytest
import torch

import test_openrlhf as T_
from test_openrlhf import (ORL, CASES, _check, _grads, make_args, make_experience,  # noqa: F401
                           openrlhf_loss, tiny_model)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "standins"))
import varlen_attention as va  # noqa: E402

sys.path.remove(os.path.join(HERE, "standins"))

import gbc_kernels as gbc  # noqa: E402
from gbc_kernels import methods  # noqa: E402
from gbc_kernels.integrations import openrlhf as gorl  # noqa: E402

va.patch_openrlhf()


def packed_actor(seed=0, temperature=1.0, packing=True):
    """OpenRLHF's Actor on the tiny Qwen2 with the varlen stand-in as its attention (unpacked:
    eager attention)."""
    model = tiny_model(seed)
    model.config._attn_implementation = va.ATTN_IMPLEMENTATION if packing else "eager"
    actor = ORL.Actor(model, temperature=temperature)
    actor.packing_samples = packing
    return actor


def _both(args, kl_ctl=0.05, lbi=None, temperature=1.0, seed=1, exp=None, **kw):
    exp = make_experience(seed) if exp is None else exp
    lbi = lbi if lbi is not None else ORL.get_loss_batch_info(None, exp.action_mask)
    out = {}
    for which in ("openrlhf", "gbc"):
        actor = packed_actor(temperature=temperature)
        if which == "openrlhf":
            loss, metrics = openrlhf_loss(actor, exp, args, kl_ctl, lbi)
        else:
            loss, metrics = gorl.fused_actor_loss(actor, exp, args, kl_ctl, lbi, **kw)
        loss.backward()
        out[which] = (float(loss.detach()), metrics, _grads(actor.model))
    return out


@pytest.mark.parametrize("opts", CASES)
def test_packed_loss_equals_openrlhf(opts):
    """Loss, every parameter gradient and OpenRLHF's metrics on packed samples: OpenRLHF's
    packed ``Actor.forward`` + ``PolicyLoss`` against gbc's packed fused loss."""
    _check(_both(make_args(**opts)))


def test_packed_global_normalisers_and_temperature():
    lbi = dict(dp_size=2, batch_num_tokens=torch.tensor(30.0), global_batch_size=torch.tensor(7.0))
    _check(_both(make_args(kl="k3", entropy_coef=0.02), lbi=lbi, temperature=0.7))


def test_standin_packed_forward_equals_padded():
    """The stand-in is right: OpenRLHF's packed ``Actor.forward`` (varlen attention) gives the
    padded forward's (eager attention, left-padded prompts) log-probs and entropies."""
    exp = make_experience(2)
    got, want = {}, {}
    for out, packing in ((got, True), (want, False)):
        actor = packed_actor(packing=packing)
        with torch.no_grad():
            lp, o = actor(exp.sequences, exp.action_mask, attention_mask=exp.attention_mask,
                          return_output=True, return_entropy=True)
        m = exp.action_mask
        out["logp"], out["entropy"] = lp, o.entropy[:, -m.shape[1]:] * m
    for k in got:
        assert torch.allclose(got[k], want[k], atol=2e-6), k
    assert got["logp"].abs().max() > 0


def test_packed_per_token_values_and_no_grad_pass():
    """Per-token log-probs and entropies of the packed loss (``token_out``) and the packed
    no-grad pass, directly and through ``enable``'s patched ``Actor.forward``, equal OpenRLHF's
    packed ``Actor.forward``."""
    exp = make_experience(3)
    m = exp.action_mask
    actor = packed_actor(temperature=0.8)
    with torch.no_grad():
        want, o = actor(exp.sequences, m, attention_mask=exp.attention_mask, return_output=True,
                        return_entropy=True)
    ent = o.entropy[:, -m.shape[1]:] * m
    token_out = {}
    gorl.fused_actor_loss(actor, exp, make_args(entropy_coef=0.01), 0.0, None,
                          token_out=token_out)
    assert torch.allclose(token_out["logp"], want, atol=2e-6)
    assert torch.allclose(token_out["entropy"], ent, atol=2e-6)
    got = gorl.fused_action_log_probs(actor, exp.sequences, m, exp.attention_mask)
    assert torch.allclose(got, want, atol=2e-6)
    gorl.enable(actor_cls=ORL.Actor, trainer_cls=False)
    try:
        with torch.no_grad():
            patched = actor(exp.sequences, m, exp.attention_mask, ring_attn_group=None)
        assert torch.allclose(patched, want, atol=2e-6)
    finally:
        gorl.disable()


def _method_inputs(exp, seed=7):
    g = torch.Generator().manual_seed(seed)
    m = exp.action_mask
    return (0.5 + torch.rand(m.shape, generator=g)) * m, (0.2 + torch.rand(m.shape, generator=g)) * m


@pytest.mark.parametrize("opts,phase", [
    (dict(ar_alpha=0.3), None),
    (dict(lopti_eta=0.3), "low"),
    (dict(lopti_eta=0.3, ar_alpha=0.5), "high"),
    (dict(), None),
], ids=["ar", "lopti-low", "lopti-high-ar", "nthr-critical-kl"])
def test_packed_methods_equal_the_loss_on_openrlhf_logprobs(opts, phase):
    """AR, Lopti's phases, NTHR's token scales and the critical-token KL weights on packed
    samples: gbc's packed fused loss equals ``gbc.policy_loss`` (the method layer's per-token
    definition) on the log-probs of OpenRLHF's packed ``Actor.forward``, in value and every
    parameter's gradient."""
    args = make_args(kl="k3")
    exp = make_experience(4)
    m = exp.action_mask
    scale, kl_w = _method_inputs(exp)
    lbi = ORL.get_loss_batch_info(None, m)
    cfg = gorl.policy_loss_config(args, 0.05, **opts)
    theirs = packed_actor()
    logp = theirs(exp.sequences, m, attention_mask=exp.attention_mask)
    want, _ = gbc.policy_loss(logp, m, exp.advantages, exp.action_log_probs,
                              exp.base_action_log_probs, token_scale=scale, kl_weight=kl_w,
                              config=cfg, phase=phase, **gorl.batch_normalisers(lbi))
    want.backward()
    ours = packed_actor()
    loss, _ = gorl.fused_actor_loss(ours, exp, args, 0.05, lbi, token_scale=scale,
                                    kl_weight=kl_w, phase=phase, **opts)
    loss.backward()
    assert abs(float(loss) - float(want)) <= 2e-6 * max(1.0, abs(float(want)))
    go, gg = _grads(theirs.model), _grads(ours.model)
    assert set(go) == set(gg)
    for n in go:
        assert (go[n] - gg[n]).abs().max() <= 2e-5 * go[n].abs().max().clamp(min=1e-6), n
    plain, _ = gorl.fused_actor_loss(packed_actor(), exp, args, 0.05, lbi)
    assert abs(float(plain) - float(loss)) > 1e-6          # the method changed the loss


@pytest.fixture
def methods_off():
    yield
    gorl.disable()


def _packed_trainer(args, packing=True):
    t = T_._trainer(args)
    t.actor = packed_actor(temperature=T_.TEMP, packing=packing)
    t.actor_optim = torch.optim.SGD(t.actor.model.parameters(), lr=T_.LR)
    t.actor_scheduler = torch.optim.lr_scheduler.LambdaLR(t.actor_optim, lambda _: 1.0)
    return t


def test_packed_nthr_pass_and_critical_kl_equal_the_padded(methods_off):
    """NTHR's pass over the replay buffer and the reference model's critical-token KL weights
    (through ``enable``'s patched ``Actor.forward``) on packed samples equal the padded
    passes' (tested against full-logit references in test_openrlhf.py)."""
    args = T_._margs(kl="k3")
    exp = T_._nthr_experience()
    scales, weights = {}, {}
    for packing in (True, False):
        T_._enable(nthr=True, nthr_beta=0.0)
        t = _packed_trainer(args, packing)
        t.replay_buffer = T_._buffer(copy.deepcopy(exp))
        gorl.nthr_pass(t)
        scales[packing] = [it.info[gorl.SCALE_KEY] for it in t.replay_buffer.items]
        T_._enable(critical_kl_exponent=2.0, critical_kl_intercept=0.1)
        ref = packed_actor(seed=3, temperature=T_.TEMP, packing=packing)
        ref.gbc_reference = True
        with torch.no_grad():
            weights[packing] = ref(exp.sequences, exp.action_mask, exp.attention_mask,
                                   ring_attn_group=None)
    for a, b in zip(scales[True], scales[False]):
        assert torch.allclose(a, b, atol=1e-6)
    assert any((s != 1).any() for s in scales[True])
    assert weights[True].shape == (*exp.action_mask.shape, 2)
    assert torch.allclose(weights[True], weights[False], atol=2e-6)


@pytest.mark.parametrize("options", [dict(), dict(lopti_eta=0.3)], ids=["plain", "lopti"])
def test_packed_training_steps_equal_padded(options, methods_off):
    """``training_step`` (OpenRLHF's step with the fused loss; Lopti: two optimizer steps) on
    packed samples ends in the parameters of the same steps on the padded batch, and, without
    methods, of OpenRLHF's own packed loss."""
    args = T_._margs(kl="k3", entropy_coef=0.01, loss_agg_mode="seq-mean-token-mean")
    if options:
        T_._enable(**options)
    packed, padded, theirs = (_packed_trainer(args, p) for p in (True, False, True))
    for step in range(2):
        exp = make_experience(10 + step)
        lbi = ORL.get_loss_batch_info(None, exp.action_mask)
        for t in (packed, padded):
            status = gorl.training_step(t, copy.deepcopy(exp), 0.05, step, lbi)
        assert {"policy_loss", "entropy_loss", "kl", "ppo_kl"} <= set(status["metrics"])
        loss, _ = openrlhf_loss(theirs.actor, exp, args, 0.05, lbi)
        loss.backward()
        theirs.actor_optim.step()
        theirs.actor_optim.zero_grad()
    for (n, p), q, r in zip(packed.actor.model.named_parameters(),
                            padded.actor.model.parameters(), theirs.actor.model.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), n
        assert options or torch.allclose(p, r, rtol=1e-5, atol=1e-6), n
    if options:
        assert any(not torch.allclose(p, r, rtol=1e-5, atol=1e-6) for p, r in
                   zip(packed.actor.model.parameters(), theirs.actor.model.parameters()))


def test_packed_bad_input_is_refused_by_name():
    """A packed batch without its boundaries (no attention_mask), a packed_seq_lens OpenRLHF
    would ignore, and ds.ring_attn_size > 1 without a ring group: errors naming the option."""
    exp = make_experience(5)
    actor = packed_actor()
    bad = copy.deepcopy(exp)
    bad.attention_mask = None
    with pytest.raises(ValueError, match="attention_mask: ds.packing_samples"):
        gorl.fused_actor_loss(actor, bad, make_args(), 0.0, None)
    with pytest.raises(ValueError, match="attention_mask: ds.packing_samples"):
        gorl.fused_action_log_probs(actor, exp.sequences, exp.action_mask, None)
    with pytest.raises(ValueError, match="packed_seq_lens"):
        gorl.fused_action_log_probs(actor, exp.sequences, exp.action_mask, exp.attention_mask,
                                    packed_seq_lens=[3, 4])
    args = make_args()
    args.ds = SimpleNamespace(ring_attn_size=2)
    with pytest.raises(ValueError, match="ds.ring_attn_size"):
        gorl.fused_actor_loss(actor, exp, args, 0.0, None)


# ------------------------------------------------------------------------- ring attention
RING_CASES = {
    "ppo-token-kl-entropy": (dict(kl="k3", entropy_coef=0.01), {}),
    "ppo-seq-dual": (dict(loss_agg_mode="seq-mean-token-mean", dual_clip=3.0), {}),
    "gspo-is": (dict(policy_loss_type="gspo", is_level="token", eps=(3e-4, 4e-4), kl="k1"), {}),
    "is-seq-mask": (dict(is_level="seq", is_mode="mask", is_threshold=(0.7, 1.5)), {}),
    "ar-lopti-critical-kl": (dict(kl="k2"), dict(ar_alpha=0.3, lopti_eta=0.3, phase="high",
                                                 kl_weight=True)),
}
RING_SEEDS = (1, -1)      # 1: 35 packed tokens (the ring pads them to 36); -1: rank 0 holds
#                           prompts only (no action token: its share is 0)


def ring_experience(seed):
    """make_experience(seed); ``-1``: three empty responses before a full one, so that the
    first half of the packed stream (12 of its 24 tokens) has no action."""
    if seed >= 0:
        return make_experience(seed)
    exp = make_experience(10)         # a seed whose last response is not clipped away
    T = exp.action_mask.shape[1]
    exp.action_mask[:3] = False
    exp.attention_mask[:3, -T:] = 0
    exp.sequences[:3, -T:] = 0
    for k in ("action_log_probs", "base_action_log_probs", "rollout_log_probs", "advantages"):
        setattr(exp, k, getattr(exp, k) * exp.action_mask)
    return exp


def _ring_args(opts, size=2):
    args = make_args(**opts)
    args.ds = SimpleNamespace(ring_attn_size=size, packing_samples=True)
    return args


def _gbc_extra(exp, extra):
    kw = dict(extra)
    if kw.pop("kl_weight", False):
        kw["kl_weight"] = _method_inputs(exp)[1]
    return kw


def _openrlhf_step(actor, exp, args, lbi, group=None, extra=None):
    """OpenRLHF's training loss (``openrlhf_loss``: its Actor.forward with the step's
    ``ring_attn_group``, PolicyLoss, KL and entropy terms) and its backward; with ``extra``
    (the methods) ``gbc.policy_loss`` on its log-probs instead."""
    def call(*a, **k):
        return actor(*a, ring_attn_group=group, **k)

    if not extra:
        loss, metrics = openrlhf_loss(call, exp, args, 0.05, lbi)
    else:
        m = exp.action_mask
        kw = _gbc_extra(exp, extra)
        phase, kl_w = kw.pop("phase", None), kw.pop("kl_weight", None)
        cfg = gorl.policy_loss_config(args, 0.05, **kw)
        logp = call(exp.sequences, m, attention_mask=exp.attention_mask)
        loss, metrics = gbc.policy_loss(logp, m, exp.advantages, exp.action_log_probs,
                                        exp.base_action_log_probs, kl_weight=kl_w,
                                        config=cfg, phase=phase,
                                        **gorl.batch_normalisers(lbi))
    loss.backward()
    return float(loss.detach()), {k: float(v) for k, v in metrics.items()}


def _ring_nthr(group=None, strategy=None):
    """NTHR's pass over a packed replay buffer (``ring_attn_group``: under ring attention);
    returns each sample's scales."""
    args = T_._margs(kl="k3")
    args.ds = SimpleNamespace(ring_attn_size=1 if group is None else 2, packing_samples=True,
                              tensor_parallel_size=1)
    T_._enable(nthr=True, nthr_beta=0.0)
    try:
        t = _packed_trainer(args)
        t.strategy.ring_attn_group = group
        if strategy is not None:
            t.strategy.ds_device_mesh = strategy.ds_device_mesh
        t.strategy.accumulated_gradient = 1
        gorl.check_trainer(t)
        t.replay_buffer = T_._buffer(copy.deepcopy(T_._nthr_experience()))
        gorl.nthr_pass(t)
        return [it.info[gorl.SCALE_KEY] for it in t.replay_buffer.items]
    finally:
        gorl.disable()


def _ring_worker(rank, world, cases):
    """Ring attention over the 2 ranks (OpenRLHF's strategy: the ring group, the stand-in ring
    kernel substituted, a data-parallel group of one rank): OpenRLHF's step and gbc's on the
    same batch, gradients averaged over the ranks as DeepSpeed does."""
    import torch.distributed as dist
    from openrlhf.models import ring_attn_utils

    sys.path.insert(0, os.path.join(HERE, "standins"))
    from ring_flash_attn import substitute_hf_flash_attn

    group = dist.new_group(list(range(world)))
    dp = [dist.new_group([r]) for r in range(world)][rank]
    ring_attn_utils.set_ring_attn_group(group)
    substitute_hf_flash_attn(group, 1)
    strategy = SimpleNamespace(ds_device_mesh={"dp": SimpleNamespace(get_group=lambda: dp)})

    def averaged(model):
        g = _grads(model)
        for v in g.values():
            dist.all_reduce(v)
            v /= world
        return g

    out = {}
    for seed in RING_SEEDS:
        exp = ring_experience(seed)
        lbi = ORL.get_loss_batch_info(strategy, exp.action_mask)
        for name, (opts, extra) in cases.items():
            args = _ring_args(opts, world)
            theirs = packed_actor()
            lo, mo = _openrlhf_step(theirs, exp, args, lbi, group, extra)
            ours = packed_actor()
            token_out = {}
            loss, mg = gorl.fused_actor_loss(ours, exp, args, 0.05, lbi, ring_attn_group=group,
                                             token_out=token_out, **_gbc_extra(exp, extra))
            loss.backward()
            out[seed, name] = dict(openrlhf=(lo, mo, averaged(theirs.model)),
                                   gbc=(float(loss.detach()), {k: float(v) for k, v in mg.items()},
                                        averaged(ours.model)),
                                   token_out=token_out)
        actor = packed_actor(temperature=0.8)
        with torch.no_grad():
            lp, o = actor(exp.sequences, exp.action_mask, attention_mask=exp.attention_mask,
                          return_output=True, return_entropy=True, ring_attn_group=group)
        got = gorl.fused_action_log_probs(actor, exp.sequences, exp.action_mask,
                                          exp.attention_mask, ring_attn_group=group)
        out[seed, "no-grad"] = (lp, got)
    out["nthr"] = _ring_nthr(group, strategy)
    errors = []
    exp = make_experience(1)
    for actor, args, match in ((packed_actor(packing=False), _ring_args({}), "ds.packing_samples"),
                               (packed_actor(), _ring_args({}, 4), "ds.ring_attn_size")):
        try:
            gorl.fused_actor_loss(actor, exp, args, 0.0, None, ring_attn_group=group)
            errors.append(None)
        except ValueError as exc:
            errors.append((str(exc), match))
    out["errors"] = errors
    return out


def test_ring_attention_equals_openrlhf_ring_step():
    """ds.ring_attn_size = 2 (2 gloo processes, each with its slice of the packed stream, the
    first batch padded to the ring): gbc's loss (value on every rank), OpenRLHF's metrics, the
    per-token log-probs and entropies (``token_out``), the no-grad pass and every parameter's
    gradient averaged over the ring (DeepSpeed's reduction) equal OpenRLHF's own ring step; that
    step equals the packed step in one process. AR, Lopti and critical-token KL against
    ``gbc.policy_loss`` on OpenRLHF's ring log-probs; NTHR's pass under ring attention equals
    the packed pass in one process. A ring without packed samples and a ring group of another
    size than ds.ring_attn_size are refused by name."""
    from conftest import spawn_gloo

    got = spawn_gloo(2, _ring_worker, RING_CASES)
    want = _ring_nthr()
    assert any((s != 1).any() for s in want)
    for r in got:
        for (text, match) in r["errors"]:
            assert match in text, text
        for a, b in zip(r["nthr"], want):
            assert torch.allclose(a, b, atol=1e-6)
    for seed in RING_SEEDS:
        exp = ring_experience(seed)
        lbi = ORL.get_loss_batch_info(None, exp.action_mask)
        m = exp.action_mask
        for name, (opts, extra) in RING_CASES.items():
            single = packed_actor()
            ls, ms = _openrlhf_step(single, exp, _ring_args(opts), lbi, None, extra)
            one = dict(openrlhf=(ls, ms, _grads(single.model)))
            for r in got:
                res = r[seed, name]
                _check({"openrlhf": res["openrlhf"], "gbc": one["openrlhf"]})   # ring == one
                if not extra:
                    _check(res)
                else:
                    _check({"openrlhf": res["openrlhf"][:1] + ({},) + res["openrlhf"][2:],
                            "gbc": res["gbc"]})
            if name == "ppo-token-kl-entropy":
                with torch.no_grad():
                    lp, o = packed_actor()(exp.sequences, m, attention_mask=exp.attention_mask,
                                           return_output=True, return_entropy=True)
                for r in got:
                    tok = r[seed, name]["token_out"]
                    assert torch.allclose(tok["logp"], lp, atol=2e-6)
                    assert torch.allclose(tok["entropy"], o.entropy[:, -m.shape[1]:] * m,
                                          atol=2e-6)
        for r in got:
            want, fused = r[seed, "no-grad"]
            assert torch.allclose(fused, want, atol=2e-6)


def _refusal(args, exp, packing):
    """``training_step`` on ``exp`` (packed or padded): the ValueError's message, and whether
    the parameters, their gradients and the optimizer stayed as they were."""
    t = _packed_trainer(args, packing)
    before = [p.detach().clone() for p in t.actor.model.parameters()]
    lbi = ORL.get_loss_batch_info(None, exp.action_mask)
    with pytest.raises(ValueError) as err:
        gorl.training_step(t, exp, 0.05, 0, lbi)
    untouched = (all(torch.equal(p, q) for p, q in zip(t.actor.model.parameters(), before))
                 and all(p.grad is None for p in t.actor.model.parameters())
                 and not t.actor_optim.state)
    return str(err.value), untouched


def _wide(exp):
    """``exp`` with an ``action_mask`` one column wider than ``sequences[:, 1:]``: its extra
    column (sequence position 0) an action no position predicts; the per-token fields widened
    alike."""
    bad = copy.deepcopy(exp)
    S = exp.sequences.shape[1]
    for k in ("action_mask", "action_log_probs", "base_action_log_probs", "rollout_log_probs",
              "advantages"):
        v = getattr(exp, k)
        w = v.new_zeros(v.shape[0], S)
        w[:, S - v.shape[1]:] = v
        setattr(bad, k, w)
    bad.action_mask[:, 0] = True
    bad.advantages[:, 0] = 1.0
    return bad


def test_packed_malformed_actions_refused_before_anything():
    """Under packing, as on the padded path and before anything is computed (no forward, no
    gradient, no step): an ``attention_mask`` one column narrower than ``sequences``, refused
    naming ``experience.attention_mask`` and the expected shape; an ``action_mask`` one column wider than ``sequences[:, 1:]`` and an
    action where ``attention_mask`` is 0 are refused naming ``experience.action_mask``;
    ``advantages`` narrower than the action mask with the padded path's own message."""
    args = T_._margs(kl="k3", entropy_coef=0.01)
    exp = make_experience(12)
    (B, S), Ta = exp.sequences.shape, exp.action_mask.shape[1]
    narrow = copy.deepcopy(exp)
    narrow.advantages = exp.advantages[:, :-1].contiguous()
    outside = copy.deepcopy(exp)
    row = int((exp.action_mask.sum(1) < Ta).nonzero()[0])          # a response shorter than T
    assert exp.attention_mask[row, -1] == 0
    outside.action_mask[row, -1] = True
    short = copy.deepcopy(exp)
    short.attention_mask = exp.attention_mask[:, 1:].contiguous()      # one column short
    want = {
        "short": f"experience.attention_mask: expected the shape of sequences [{B}, {S}], got "
                 f"[{B}, {S - 1}]",
        "wide": f"experience.action_mask: expected shape [{B}, T] with 1 <= T <= {S - 1}",
        "narrow": f"experience.advantages: expected shape [{B}] or [{B}x{Ta}], got "
                  f"[{B}x{Ta - 1}]",
        "outside": f"experience.action_mask: marks an action outside its sequence at index "
                   f"[{row}, {Ta - 1}] (attention_mask[{row}, {S - 1}] is 0",
    }
    for name, bad in (("short", short), ("wide", _wide(exp)), ("narrow", narrow),
                      ("outside", outside)):
        got = {packing: _refusal(args, copy.deepcopy(bad), packing) for packing in (True, False)}
        assert got[True] == got[False], name                 # the same error on both paths
        message, untouched = got[True]
        assert message.startswith(want[name]), (name, message)
        assert untouched, name
    # the packed no-grad pass names its own argument
    actor = packed_actor()
    with pytest.raises(ValueError, match=r"^action_mask: marks an action outside"):
        gorl.fused_action_log_probs(actor, outside.sequences, outside.action_mask,
                                    outside.attention_mask)
    with pytest.raises(ValueError, match=r"^attention_mask: expected the shape of sequences"):
        gorl.fused_action_log_probs(actor, short.sequences, short.action_mask,
                                    short.attention_mask)
    with pytest.raises(ValueError, match=r"^action_mask: expected shape"):
        w = _wide(exp)
        gorl.fused_action_log_probs(actor, w.sequences, w.action_mask, w.attention_mask)


def _float64_actions(model, exp, temperature=T_.TEMP):
    """The actions' log-probs and entropies ``[B, T]`` (0 off the action mask) of a float64
    copy of ``model``, each sequence run alone without its padding (positions from 0, as
    OpenRLHF's ``Actor.forward`` numbers a left-padded one)."""
    m64 = copy.deepcopy(model).double()
    m64.config._attn_implementation = "eager"
    (B, S), T = exp.sequences.shape, exp.action_mask.shape[1]
    logp = torch.zeros(B, T, dtype=torch.float64)
    ent = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        keep = exp.attention_mask[b].bool()
        where = keep.long().cumsum(0) - 1                 # full position -> compact one
        with torch.no_grad():
            z = m64(exp.sequences[b, keep][None]).logits[0].double() / temperature
        lsm = z.log_softmax(-1)
        for j in exp.action_mask[b].nonzero().flatten().tolist():
            s = S - T + j
            row = lsm[where[s] - 1]
            logp[b, j] = row[exp.sequences[b, s]]
            ent[b, j] = -(row.exp() * row).sum()
    return logp, ent


def _openrlhf_terms(logp, entropy, exp, args, kl_ctl, lbi):
    """``policy_loss``, ``kl`` and ``entropy_loss`` of OpenRLHF's ``training_step`` from its own
    ``PolicyLoss``, ``compute_approx_kl`` and ``aggregate_loss`` on given per-token values."""
    a = args.actor
    loss_fn = ORL.PolicyLoss(clip_eps_low=a.eps_clip_low_high[0],
                             clip_eps_high=a.eps_clip_low_high[1], dual_clip=a.dual_clip,
                             token_level_loss=a.loss_agg_mode == "token-mean",
                             policy_loss_type=a.policy_loss_type)
    pg = loss_fn(logp, exp.action_log_probs, exp.advantages, action_mask=exp.action_mask,
                 **lbi)[0]
    kl = ORL.compute_approx_kl(logp, exp.base_action_log_probs,
                               log_probs_old=exp.action_log_probs,
                               kl_estimator=args.algo.kl.estimator,
                               unbiased_gradient=args.algo.kl.unbiased_gradient)
    return {"policy_loss": float(pg),
            "kl": float(ORL.aggregate_loss(kl, exp.action_mask, **lbi)),
            "entropy_loss": float(ORL.aggregate_loss(entropy, exp.action_mask, **lbi))}


@pytest.mark.parametrize("order", ["low-first", "high-first"])
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_lopti_logged_terms_are_the_batchs(packing, order, methods_off):
    """Under Lopti (two optimizer steps), ``training_step`` logs ``policy_loss``, ``kl`` and
    ``entropy_loss`` as the batch's terms without Lopti's split — every action token once, the
    batch's normalisers, at the parameters the batch met — i.e. OpenRLHF's own loss pieces on
    the same batch without Lopti, in float64; each phase's ``fused_actor_loss`` logs the same at
    its own parameters (neither counts a token twice nor drops the other phase's tokens)."""
    args = T_._margs(kl="k3", entropy_coef=0.01)
    exp = make_experience(31)
    lbi = ORL.get_loss_batch_info(None, exp.action_mask)
    low = exp.action_log_probs.exp() < 0.5
    assert (low & exp.action_mask).any() and (~low & exp.action_mask).any()
    exp64 = copy.deepcopy(exp)
    for k in ("action_log_probs", "base_action_log_probs", "rollout_log_probs", "advantages"):
        setattr(exp64, k, getattr(exp, k).double())

    def oracle(model):                  # OpenRLHF's loss pieces, float64, no Lopti
        logp, ent = _float64_actions(model, exp)
        return _openrlhf_terms(logp, ent, exp64, args, 0.05, lbi)

    T_._enable(lopti_eta=0.5, lopti_order=order)
    t = _packed_trainer(args, packing)
    want = oracle(t.actor.model)
    status = gorl.training_step(t, copy.deepcopy(exp), 0.05, 0, lbi)
    got = {k: float(status["metrics"][k]) for k in want}
    assert set(want) == {"policy_loss", "kl", "entropy_loss"}
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (k, got, want)
    # each phase alone, on a fresh trainer: the batch's terms at that phase's parameters
    t = _packed_trainer(args, packing)
    for phase in methods.MethodOptions(lopti_eta=0.5, lopti_order=order).phases:
        want = oracle(t.actor.model)
        loss, m = gorl.fused_actor_loss(t.actor, copy.deepcopy(exp), args, 0.05, lbi,
                                        phase=phase, **methods.MethodOptions(
                                            lopti_eta=0.5).loss_options())
        for k in want:
            assert float(m[k]) == pytest.approx(want[k], rel=1e-5, abs=1e-6), (phase, k)
        loss.backward()
        t.actor_optim.step()
        t.actor_optim.zero_grad()
    assert oracle(t.actor.model)["policy_loss"] != pytest.approx(want["policy_loss"])
