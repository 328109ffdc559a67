"""The fused path inside OpenRLHF 0.11.2, against OpenRLHF's own code.

OpenRLHF's ``Actor``, ``PolicyLoss``, ``aggregate_loss``, ``compute_approx_kl``,
``compute_entropy`` and ``log_probs_from_logits`` (imported from the installed package) are the
oracle: the training loss is composed from them exactly as ``ActorPPOTrainer.training_step``
composes it (that class itself imports vLLM at import time, which has no CPU build), on a tiny
Qwen2 built from a config, and compared with ``integrations.openrlhf.fused_actor_loss``: the
loss, every parameter gradient and the logged metrics, for each option; then a few training
steps through ``integrations.openrlhf.training_step`` with a plain-PyTorch stand-in for
OpenRLHF's DeepSpeed strategy (backward, optimizer step: the loss and gradients stay
OpenRLHF's and gbc's own) end in the same parameters; the no-grad log-prob pass equals
``Actor.forward``'s. OpenRLHF's wheel imports flash-attn at import time (no CPU build): the
stand-in package ``tests/standins/flash_attn`` raises if any of its functions is called, and is
on ``sys.path`` only while OpenRLHF is imported.
"""

from __future__ import annotations

import copy
import os
import sys
from types import SimpleNamespace

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _import_openrlhf():
    pytest.importorskip("deepspeed")
    sys.path.insert(0, os.path.join(HERE, "standins"))
    try:
        from openrlhf.models import Actor, PolicyLoss
        from openrlhf.models.loss import aggregate_loss
        from openrlhf.models.utils import compute_approx_kl, masked_mean
        from openrlhf.trainer.ppo_utils.experience import Experience
        from openrlhf.utils.loss_utils import get_loss_batch_info
    except ImportError as exc:                  # pragma: no cover - the dev install has it
        pytest.skip(f"openrlhf: {exc}")
    finally:
        sys.path.remove(os.path.join(HERE, "standins"))
        for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
            del sys.modules[name]             # the stand-in leaves with its path
    return SimpleNamespace(Actor=Actor, PolicyLoss=PolicyLoss, aggregate_loss=aggregate_loss,
                           compute_approx_kl=compute_approx_kl, masked_mean=masked_mean,
                           Experience=Experience, get_loss_batch_info=get_loss_batch_info)


ORL = _import_openrlhf()

import gbc_kernels as gbc  # noqa: E402
from gbc_kernels.integrations import openrlhf as gorl  # noqa: E402
from conftest import VocabWatcher  # noqa: E402

V, H, B, P, T = 97, 32, 4, 5, 7          # vocab (odd), hidden, batch, prompt, response


def tiny_model(seed=0, vocab=V):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=H, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).float()
    model.config.use_cache = False
    return model


def make_actor(model, temperature=1.0):
    """OpenRLHF's Actor around a model instance (its constructor sets ``packing_samples`` only
    when it loads a checkpoint itself)."""
    actor = ORL.Actor(model, temperature=temperature)
    actor.packing_samples = False
    return actor


def make_args(policy_loss_type="ppo", loss_agg_mode="token-mean", eps=(0.2, 0.28),
              dual_clip=None, kl=None, unbiased=False, entropy_coef=None,
              is_level="off", is_mode="mask", is_gating="ratio", is_threshold=(0.5, 5.0)):
    ns = SimpleNamespace
    return ns(actor=ns(eps_clip_low_high=eps, dual_clip=dual_clip,
                       policy_loss_type=policy_loss_type, loss_agg_mode=loss_agg_mode,
                       entropy_coef=entropy_coef, aux_loss_coef=0.0),
              algo=ns(kl=ns(use_loss=kl is not None, init_coef=0.05 if kl else 0.0,
                            estimator=kl or "k1", unbiased_gradient=unbiased),
                      advantage=ns(is_correction_level=is_level, is_correction_mode=is_mode,
                                   is_correction_gating=is_gating,
                                   is_correction_threshold=is_threshold)),
              train=ns(dynamic_batch_enable=False))


def make_experience(seed=1, vocab=V):
    """Left-padded prompts, right-padded responses (OpenRLHF's layout), one empty response,
    log-probs near the policy's."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, vocab, (B, P + T), generator=g)
    am = torch.ones(B, P + T, dtype=torch.long)
    am[1, :2] = 0                                  # left padding of a short prompt
    seq[1, :2] = 0
    lengths = torch.tensor([T, 4, 0, 6])
    mask = torch.arange(T)[None] < lengths[:, None]
    am[:, P:] = mask.long()
    seq[:, P:][~mask] = 0
    old = -torch.rand(B, T, generator=g) * 3.0 - 0.05
    ref = (old + 0.4 * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    rollout = (old + 0.3 * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    return ORL.Experience(sequences=seq, attention_mask=am, action_mask=mask,
                          action_log_probs=old * mask, base_action_log_probs=ref * mask,
                          rollout_log_probs=rollout * mask, advantages=adv * mask, info={})


def openrlhf_loss(actor, exp, args, kl_ctl, lbi):
    """ActorPPOTrainer.training_step's loss, from OpenRLHF's own pieces (no vLLM import)."""
    a = args.actor
    loss_fn = ORL.PolicyLoss(clip_eps_low=a.eps_clip_low_high[0],
                             clip_eps_high=a.eps_clip_low_high[1], dual_clip=a.dual_clip,
                             token_level_loss=a.loss_agg_mode == "token-mean",
                             policy_loss_type=a.policy_loss_type,
                             is_correction_level=args.algo.advantage.is_correction_level,
                             is_correction_mode=args.algo.advantage.is_correction_mode,
                             is_correction_gating=args.algo.advantage.is_correction_gating,
                             is_correction_threshold=args.algo.advantage.is_correction_threshold)
    logp, output = actor(exp.sequences, exp.action_mask, attention_mask=exp.attention_mask,
                         return_output=True, return_entropy=a.entropy_coef is not None)
    actor_loss, clip_ratio, ppo_kl, vllm_kl, is_filter = loss_fn(
        logp, exp.action_log_probs, exp.advantages, action_mask=exp.action_mask,
        rollout_log_probs=exp.rollout_log_probs, **lbi)
    metrics = {"ppo_clip_ratio": clip_ratio, "ppo_kl": ppo_kl, "policy_loss": actor_loss}
    if vllm_kl is not None:
        metrics.update(vllm_kl=vllm_kl, is_filter_ratio=is_filter)
    loss = actor_loss
    if args.algo.kl.use_loss and args.algo.kl.init_coef > 0:
        kl = ORL.compute_approx_kl(logp, exp.base_action_log_probs,
                                   log_probs_old=exp.action_log_probs,
                                   kl_estimator=args.algo.kl.estimator,
                                   unbiased_gradient=args.algo.kl.unbiased_gradient)
        kl_loss = ORL.aggregate_loss(kl, exp.action_mask, **lbi)
        loss = loss + kl_loss * kl_ctl
        metrics["kl"] = kl_loss
    if a.entropy_coef is not None:
        ent = ORL.aggregate_loss(output.entropy[:, -T:], exp.action_mask, **lbi)
        metrics["entropy_loss"] = ent
        if a.entropy_coef != 0:
            loss = loss - ent * a.entropy_coef
    return loss, metrics


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run_both(args, kl_ctl=0.05, lbi=None, temperature=1.0, seed=1):
    exp = make_experience(seed)
    lbi = lbi if lbi is not None else ORL.get_loss_batch_info(None, exp.action_mask)
    out = {}
    for which in ("openrlhf", "gbc"):
        model = tiny_model()
        actor = make_actor(model, temperature)
        if which == "openrlhf":
            loss, metrics = openrlhf_loss(actor, exp, args, kl_ctl, lbi)
        else:
            loss, metrics = gorl.fused_actor_loss(actor, exp, args, kl_ctl, lbi)
        loss.backward()
        out[which] = (float(loss.detach()), metrics, _grads(model))
    return out


CASES = [
    pytest.param(dict(), id="ppo-token-mean"),
    pytest.param(dict(loss_agg_mode="seq-mean-token-mean", dual_clip=3.0), id="ppo-seq-dual"),
    pytest.param(dict(policy_loss_type="gspo", eps=(3e-4, 4e-4)), id="gspo"),
    pytest.param(dict(kl="k1"), id="kl-k1"),
    pytest.param(dict(kl="k2", unbiased=True), id="kl-k2-unbiased"),
    pytest.param(dict(kl="k3", entropy_coef=0.01), id="kl-k3-entropy"),
    pytest.param(dict(entropy_coef=0.0), id="entropy-logged-only"),
    pytest.param(dict(is_level="token", is_mode="mask", is_threshold=(0.8, 1.3)),
                 id="is-token-mask"),
    pytest.param(dict(is_level="token", is_mode="clip", is_threshold=(0.8, 1.3)),
                 id="is-token-clip"),
    pytest.param(dict(is_level="seq", is_mode="mask", is_threshold=(0.7, 1.5)),
                 id="is-seq-mask"),
    pytest.param(dict(is_level="token", is_gating="binary_kl", is_threshold=(0.0, 0.05)),
                 id="is-binary-kl"),
    pytest.param(dict(is_level="seq", is_gating="tv", is_threshold=(0.0, 0.1)), id="is-seq-tv"),
    pytest.param(dict(policy_loss_type="gspo", is_level="token", eps=(3e-4, 4e-4), kl="k3"),
                 id="gspo-is-kl"),
]


def _check(out, loss_tol=2e-6, grad_tol=2e-5):
    lo, mo, go = out["openrlhf"]
    lg, mg, gg = out["gbc"]
    assert abs(lo - lg) <= loss_tol * max(1.0, abs(lo)), (lo, lg)
    assert set(go) == set(gg)
    for n in go:
        scale = go[n].abs().max().clamp(min=1e-6)
        assert (go[n] - gg[n]).abs().max() <= grad_tol * scale, n
    assert any(g.abs().max() > 0 for g in go.values())
    for k, v in mo.items():
        assert abs(float(v) - float(mg[k])) <= 1e-5 * max(1.0, abs(float(v))), (k, v, mg[k])


@pytest.mark.parametrize("opts", CASES)
def test_fused_loss_equals_openrlhf(opts):
    """Loss, every parameter gradient and OpenRLHF's metrics, one process, the step's own
    normalisers (get_loss_batch_info without a process group)."""
    _check(_run_both(make_args(**opts)))


@pytest.mark.parametrize("lbi", [dict(dp_size=2, batch_num_tokens=torch.tensor(30.0),
                                      global_batch_size=torch.tensor(7.0)),
                                 dict(dp_size=4, batch_num_tokens=torch.tensor(61.0),
                                      global_batch_size=torch.tensor(13.0))],
                         ids=["dp2", "dp4"])
@pytest.mark.parametrize("opts", [dict(kl="k3", entropy_coef=0.02),
                                  dict(loss_agg_mode="seq-mean-token-mean", kl="k2"),
                                  dict(policy_loss_type="gspo", eps=(3e-4, 4e-4),
                                       entropy_coef=0.01)],
                         ids=["token", "seq", "gspo"])
def test_global_loss_batch_info(opts, lbi):
    """OpenRLHF's global normalisers (data-parallel size, global token and sample counts), its
    temperature, KL and entropy terms."""
    _check(_run_both(make_args(**opts), lbi=lbi, temperature=0.7))


def test_log_prob_pass_equals_actor_forward():
    """The no-grad pass (old policy, reference): ``Actor.forward(sequences, action_mask,
    attention_mask)`` against the fused pass, directly and through ``enable``'s patch."""
    exp = make_experience(3)
    actor = make_actor(tiny_model(), 0.8)
    with torch.no_grad():
        want = actor(exp.sequences, exp.action_mask, exp.attention_mask)
    got = gorl.fused_action_log_probs(actor, exp.sequences, exp.action_mask, exp.attention_mask)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    gorl.enable(actor_cls=ORL.Actor, trainer_cls=False)
    try:
        with torch.no_grad():
            patched = actor(exp.sequences, exp.action_mask, exp.attention_mask)
        assert torch.allclose(patched, want, rtol=1e-5, atol=1e-6)
        lp, _ = actor(exp.sequences, exp.action_mask, attention_mask=exp.attention_mask,
                      return_output=True)               # the training call: OpenRLHF's own
        assert lp.requires_grad
    finally:
        gorl.disable()
    assert ORL.Actor.forward.__module__.startswith("openrlhf")


def test_no_full_logits_on_gbc_path(monkeypatch):
    """No op on gbc's path (the training loss with its backward, and the log-prob pass)
    produces a tensor holding the logits of every token: with a small chunk budget the widest
    tensor over the vocabulary has fewer rows than the batch has tokens. OpenRLHF's own path
    does form them (the watcher sees them), so the test can fail."""
    vocab = 4099
    monkeypatch.setenv("GBC_CHUNK_MB", "0.05")
    exp = make_experience(5, vocab=vocab)
    args = make_args(kl="k3", entropy_coef=0.01)
    n_tokens = exp.sequences.numel()
    model = tiny_model(vocab=vocab)
    actor = make_actor(model)
    lbi = ORL.get_loss_batch_info(None, exp.action_mask)
    for fn in (lambda: gorl.fused_actor_loss(actor, exp, args, 0.05, lbi)[0].backward(),
               lambda: gorl.fused_action_log_probs(actor, exp.sequences, exp.action_mask,
                                                   exp.attention_mask)):
        with VocabWatcher(vocab) as w:
            fn()
        # [H, V] is the head's weight seen transposed (a parameter view, not logits)
        rows = [torch.Size(s[:-1]).numel() for s in w.seen if len(s) >= 2 and s != (H, vocab)]
        assert rows and max(rows) < int(exp.action_mask.sum()) < n_tokens, w.seen
    with VocabWatcher(vocab) as w:
        openrlhf_loss(actor, exp, args, 0.05, lbi)
    assert max(torch.Size(s[:-1]).numel() for s in w.seen) >= n_tokens


class PlainStrategy:
    """OpenRLHF's strategy interface as the training step uses it, in plain PyTorch (one
    process): backward, optimizer step, grad norm. The loss and its gradients stay OpenRLHF's /
    gbc's own."""

    def backward(self, loss, model, optimizer):
        loss.backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model"):
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    def get_grad_norm(self, model):
        return 0.0

    def moving_average(self, *args, **kwargs):
        raise AssertionError("no EMA model in this test")


def _trainer(args, seed=0):
    model = tiny_model(seed)
    actor = make_actor(model, 0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    return SimpleNamespace(actor=actor, args=args, strategy=PlainStrategy(), replay_buffer=None,
                           actor_optim=opt, actor_scheduler=sched, ema_model=None, ema_beta=0.99)


def test_training_steps_end_in_the_same_parameters():
    """Three steps of ``integrations.openrlhf.training_step`` (gbc's loss, AR off) and of the
    same step with OpenRLHF's loss: the parameters agree after every step, and the status
    carries OpenRLHF's keys."""
    args = make_args(kl="k3", entropy_coef=0.01, loss_agg_mode="seq-mean-token-mean")
    ours, theirs = _trainer(args), _trainer(args)
    for step in range(3):
        exp = make_experience(10 + step)
        status = gorl.training_step(ours, copy.deepcopy(exp), 0.05, step)
        lbi = ORL.get_loss_batch_info(None, exp.action_mask)
        loss, _ = openrlhf_loss(theirs.actor, exp, args, 0.05, lbi)
        loss.backward()
        theirs.actor_optim.step()
        theirs.actor_optim.zero_grad()
        for (n, p), q in zip(ours.actor.named_parameters(), theirs.actor.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (step, n)
        assert {"policy_loss", "entropy_loss", "actor_lr", "ppo_clip_ratio", "ppo_kl",
                "kl"} <= set(status["metrics"])
        assert status["num_action_tokens"] == float(exp.action_mask.sum())
    assert any(not torch.equal(p, q) for p, q in zip(ours.actor.parameters(),
                                                      tiny_model(0).parameters()))


def test_gbc_methods_on_top():
    """AR and a Lopti phase through the OpenRLHF loss change it, and equal gbc's own loss on
    the log-probs OpenRLHF computes (the same model, the same mapping)."""
    args = make_args(kl="k3")
    exp = make_experience(4)
    lbi = ORL.get_loss_batch_info(None, exp.action_mask)
    actor = make_actor(tiny_model())
    plain, _ = gorl.fused_actor_loss(actor, exp, args, 0.05, lbi)
    ar, m = gorl.fused_actor_loss(actor, exp, args, 0.05, lbi, ar_alpha=0.3, lopti_eta=0.5,
                                  phase="low")
    assert abs(float(ar) - float(plain)) > 1e-6
    with torch.no_grad():
        logp = actor(exp.sequences, exp.action_mask, exp.attention_mask)
    cfg = gorl.policy_loss_config(args, 0.05, ar_alpha=0.3, lopti_eta=0.5)
    want, _ = gbc.policy_loss(logp, exp.action_mask, exp.advantages, exp.action_log_probs,
                              exp.base_action_log_probs, config=cfg, phase="low",
                              **gorl.batch_normalisers(lbi))
    assert abs(float(ar) - float(want)) <= 1e-5 * max(1.0, abs(float(want)))
    assert float(m["gbc/ar_weight_mean"]) < 1.0


@pytest.mark.parametrize("bad,match", [
    (dict(policy_loss_type="grpo"), "actor.policy_loss_type"),
    (dict(loss_agg_mode="seq-mean-token-sum"), "actor.loss_agg_mode"),
    (dict(kl="k4"), "algo.kl.estimator"),
    (dict(policy_loss_type="gspo", is_level="token", kl="k3", unbiased=True),
     "algo.kl.unbiased_gradient"),
])
def test_refusals(bad, match):
    with pytest.raises(ValueError, match=match):
        gorl.policy_loss_config(make_args(**bad), 0.05)


def test_errors_name_the_experiences_fields():
    """gbc's checks inside ``fused_actor_loss`` name the Experience's fields (gbc calls them
    ``advantages``, ``ref_logp``, ``input_ids``), at the index the Experience has; nothing is
    computed (no gradient)."""
    model = tiny_model()
    actor = make_actor(model)
    exp = make_experience(3)
    exp.advantages[0, 2] = float("nan")
    with pytest.raises(ValueError) as info:
        gorl.fused_actor_loss(actor, exp, make_args(), 0.0, None)
    assert str(info.value) == ("experience.advantages: expected finite values on masked-in "
                               "positions, got nan at index [0, 2]")
    exp = make_experience(3)
    exp.base_action_log_probs[3, 5] = float("inf")
    with pytest.raises(ValueError, match=r"^experience.base_action_log_probs: expected finite "
                                         r"values on masked-in positions, got inf at index "
                                         r"\[3, 5\]$"):
        gorl.fused_actor_loss(actor, exp, make_args(kl="k3"), 0.05, None)
    exp = make_experience(3)
    exp.sequences[2, 1] = V + 4
    with pytest.raises(ValueError, match=r"^experience.sequences: expected token ids in "
                                         rf"\[0, {V}\) \(the model's embedding\), got {V + 4} "
                                         r"at index \[2, 1\]$"):
        gorl.fused_actor_loss(actor, exp, make_args(), 0.0, None)
    assert all(p.grad is None for p in model.parameters())


def _zero3_worker(rank, world, opts):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    deepspeed.init_distributed(dist_backend="gloo")
    actor = make_actor(tiny_model(), 0.9)
    engine, *_ = deepspeed.initialize(
        model=actor, model_parameters=actor.parameters(),
        config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
                "zero_allow_untested_optimizer": True})
    outside = engine.module.model.lm_head.weight.numel()   # ZeRO-3: no data outside a forward
    exp = make_experience(21)
    rows = torch.arange(B).chunk(world)[rank]
    mine = ORL.Experience(**{k: getattr(exp, k)[rows] if isinstance(getattr(exp, k),
                                                                     torch.Tensor) else
                             getattr(exp, k) for k in ("sequences", "attention_mask",
                                                       "action_mask", "action_log_probs",
                                                       "base_action_log_probs",
                                                       "rollout_log_probs", "advantages",
                                                       "info")})
    # OpenRLHF's own normalisers over the group: global token and sample counts, dp_size
    lbi = ORL.get_loss_batch_info(None, mine.action_mask)
    loss, _ = gorl.fused_actor_loss(engine, mine, make_args(**opts), 0.05, lbi)
    engine.backward(loss)
    grads = {n: safe_get_full_grad(p) for n, p in engine.module.model.named_parameters()}
    return outside, float(lbi["batch_num_tokens"]), grads


@pytest.mark.parametrize("opts", [dict(kl="k3", entropy_coef=0.01),
                                  dict(loss_agg_mode="seq-mean-token-mean", dual_clip=3.0)],
                         ids=["token-kl-entropy", "seq-dual"])
def test_deepspeed_zero3_two_ranks_equal_one_process(opts):
    """DeepSpeed ZeRO-3 on 2 CPU processes, each with half the batch and OpenRLHF's global
    normalisers: the gradient DeepSpeed averages over the ranks equals OpenRLHF's own loss on
    the whole batch in one process (parameters exist only inside the forward under ZeRO-3: the
    fused loss runs inside the lm_head's forward, where they are gathered)."""
    pytest.importorskip("deepspeed")
    from conftest import spawn_gloo

    got = spawn_gloo(2, _zero3_worker, opts)
    model = tiny_model()
    exp = make_experience(21)
    loss, _ = openrlhf_loss(make_actor(model, 0.9), exp, make_args(**opts), 0.05,
                            ORL.get_loss_batch_info(None, exp.action_mask))
    loss.backward()
    want = _grads(model)
    for outside, n_tokens, grads in got:
        assert outside == 0 and n_tokens == float(exp.action_mask.sum())
        for n, g in want.items():
            err = float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12))
            assert err <= 1e-5, (n, err)


# ---------------------------------------------------------------- the methods through OpenRLHF
# Lopti, NTHR and critical-token KL through enable()'s options, OpenRLHF's replay buffer
# (its own split / merge of samples) and training_step, against plain autograd on OpenRLHF's
# own loss pieces (full logits) with each method written out independently.

from openrlhf.trainer.ppo_utils.experience import (  # noqa: E402
    make_experience_batch, remove_padding_in_sequences, split_experience_batch)
from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer  # noqa: E402

LR, TEMP, N_PER_PROMPT = 0.5, 0.9, 2


def _margs(**kw):
    args = make_args(**kw)
    args.rollout = SimpleNamespace(n_samples_per_prompt=N_PER_PROMPT)
    return args


def _full_stats(model, exp, temperature=TEMP):
    """Log-probs of the actions, max-probability and entropy from full logits (float64)."""
    am = exp.attention_mask
    pos = (am.long().cumsum(-1) - 1).masked_fill(am == 0, 1)
    T = exp.action_mask.shape[1]
    with torch.no_grad():
        logits = model(exp.sequences, attention_mask=am, position_ids=pos).logits
    z = logits[:, -T - 1:-1].double() / temperature
    lsm = z.log_softmax(-1)
    logp = lsm.gather(-1, exp.sequences[:, -T:, None])[..., 0]
    return logp, lsm.exp().amax(-1), -(lsm.exp() * lsm).sum(-1)


def _ref_step(model, exp, args, kl_ctl, lbi, adv_scale=None, active=None, kl_w=None):
    """One SGD step on OpenRLHF's loss (Actor.forward's full logits, PolicyLoss,
    compute_approx_kl, aggregate_loss) with the methods spelled out: advantages times
    ``adv_scale`` and zeroed outside ``active`` (Lopti's phase: KL and entropy too, the
    normalisers over the full mask), the KL term times ``kl_w``."""
    a = args.actor
    actor = make_actor(model, TEMP)
    mask = exp.action_mask
    act = torch.ones_like(mask, dtype=torch.float32) if active is None else active.float()
    adv = exp.advantages * act * (1.0 if adv_scale is None else adv_scale)
    loss_fn = ORL.PolicyLoss(clip_eps_low=a.eps_clip_low_high[0],
                             clip_eps_high=a.eps_clip_low_high[1], dual_clip=a.dual_clip,
                             token_level_loss=a.loss_agg_mode == "token-mean",
                             policy_loss_type=a.policy_loss_type)
    logp, output = actor(exp.sequences, mask, attention_mask=exp.attention_mask,
                         return_output=True, return_entropy=a.entropy_coef is not None)
    loss = loss_fn(logp, exp.action_log_probs, adv, action_mask=mask, **lbi)[0]
    if args.algo.kl.use_loss and args.algo.kl.init_coef > 0:
        kl = ORL.compute_approx_kl(logp, exp.base_action_log_probs,
                                   log_probs_old=exp.action_log_probs,
                                   kl_estimator=args.algo.kl.estimator)
        kl = kl * act * (1.0 if kl_w is None else kl_w)
        loss = loss + ORL.aggregate_loss(kl, mask, **lbi) * kl_ctl
    if a.entropy_coef:
        ent = output.entropy[:, -mask.shape[1]:] * act
        loss = loss - ORL.aggregate_loss(ent, mask, **lbi) * a.entropy_coef
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad


def _sched_trainer(args):
    t = _trainer(args)
    t.actor_scheduler = torch.optim.lr_scheduler.LambdaLR(t.actor_optim, lambda s: 0.5 ** s)
    return t


def _close(model_a, model_b, tol=2e-5):
    for (n, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        scale = (p - tiny_model(0).get_parameter(n)).abs().max().clamp(min=1e-6)
        assert (p - q).abs().max() <= tol * scale + 1e-6, n


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _differs(a, b):
    return any(not torch.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a, b))


@pytest.fixture
def methods_off():
    yield
    gorl.disable()


def _enable(**options):
    gorl.enable(actor_cls=ORL.Actor, trainer_cls=False, buffer_cls=NaiveReplayBuffer, **options)


@pytest.mark.parametrize("order", ["low-first", "high-first"])
def test_lopti_two_steps_equal_reference(order, methods_off):
    """enable(lopti_eta=.5): one training_step = two SGD steps, the phases in ``order``, the
    split and old log-probs from the experience's action_log_probs (fixed for both), the
    scheduler stepped once; different from the plain update."""
    args = _margs(kl="k3", entropy_coef=0.01)
    exp = make_experience(31)
    lbi = ORL.get_loss_batch_info(None, exp.action_mask)
    _enable(lopti_eta=0.5, lopti_order=order)
    t = _sched_trainer(args)
    gorl.training_step(t, copy.deepcopy(exp), 0.05, 0, lbi)
    assert t.actor_scheduler.last_epoch == 1 and t.actor_optim.param_groups[0]["lr"] == LR / 2
    ref = tiny_model(0)
    low = exp.action_log_probs.double().exp() < 0.5
    assert low[exp.action_mask].any() and (~low)[exp.action_mask].any()
    for phase in ((low, ~low) if order == "low-first" else (~low, low)):
        _ref_step(ref, exp, args, 0.05, lbi, active=phase & exp.action_mask)
    _close(t.actor.model, ref)
    gorl.disable()
    plain = _sched_trainer(args)
    gorl.training_step(plain, copy.deepcopy(exp), 0.05, 0, lbi)
    assert _differs(_params(plain.actor.model), _params(t.actor.model))


def _buffer(exp, batch=2):
    """OpenRLHF's replay buffer (no CUDA: its attributes set by hand) after ``append``."""
    buf = NaiveReplayBuffer.__new__(NaiveReplayBuffer)
    buf.sample_batch_size, buf.limit, buf.cpu_offload, buf.items = batch, 0, False, []
    buf.append(exp)
    return buf


def _nthr_experience(seed=41):
    exp = make_experience(seed)
    exp.index = [0, 1, 2, 3]                  # groups 0, 0, 1, 1 (N_PER_PROMPT = 2)
    adv = torch.tensor([1.0, -1.0, -0.7, 0.5])[:, None].expand_as(exp.action_mask)
    exp.advantages = adv * exp.action_mask
    logp = _full_stats(tiny_model(0), exp)[0].float()      # on-policy: the ratio is 1
    exp.action_log_probs = logp * exp.action_mask
    return exp


def test_nthr_scales_and_update_equal_reference(methods_off):
    """enable(nthr=True): the scales nthr_pass leaves on the replay buffer's samples equal
    gbc.nthr_scale on full-batch hidden states, groups Experience.index // n_samples, correct
    = advantage > 0; the step on OpenRLHF's merged batch equals the reference step with the
    advantages times that scale, and differs from the plain step."""
    args = _margs(kl="k3")
    exp = _nthr_experience()
    _enable(nthr=True, nthr_beta=0.0)        # beta 0: the tiny model's scores select tokens
    t = _trainer(args)
    t.actor.temperature = TEMP
    t.replay_buffer = _buffer(copy.deepcopy(exp))
    metrics = gorl.nthr_pass(t)
    assert "gbc/nthr_selected_frac" in metrics
    model = tiny_model(0)
    am = exp.attention_mask
    pos = (am.long().cumsum(-1) - 1).masked_fill(am == 0, 1)
    T = exp.action_mask.shape[1]
    with torch.no_grad():
        h = model(exp.sequences, attention_mask=am, position_ids=pos,
                  output_hidden_states=True).hidden_states[-1][:, -T - 1:-1]
    gids = torch.tensor(exp.index) // N_PER_PROMPT
    correct = torch.tensor([True, False, False, True])
    want = gbc.nthr_scale(h, model.lm_head.weight.detach(), exp.sequences[:, -T:],
                          exp.action_mask, gids, correct, temperature=TEMP, beta=0.0).scale
    for i, item in enumerate(t.replay_buffer.items):
        n = item.action_mask.shape[0]
        assert torch.allclose(item.info[gorl.SCALE_KEY], want[i, :n].float(), atol=1e-5), i
    assert (want[exp.action_mask] != 1).any()
    batch = make_experience_batch(t.replay_buffer.items)
    lbi = ORL.get_loss_batch_info(None, batch.action_mask)
    gorl.training_step(t, batch, 0.05, 0, lbi)
    ref = tiny_model(0)
    plain_batch = make_experience_batch(remove_padding_in_sequences(
        split_experience_batch(copy.deepcopy(exp))))
    Tb = plain_batch.action_mask.shape[1]
    _ref_step(ref, plain_batch, args, 0.05, lbi, adv_scale=want[:, :Tb].float())
    _close(t.actor.model, ref)
    plain = _trainer(args)
    plain.actor.temperature = TEMP
    gorl.disable()
    gorl.training_step(plain, copy.deepcopy(plain_batch), 0.05, 0, lbi)
    assert _differs(_params(plain.actor.model), _params(t.actor.model))


def _reference_actor(seed=3):
    ref = make_actor(tiny_model(seed), TEMP)
    ref.gbc_reference = True
    return ref


@pytest.mark.parametrize("certainty,cert_temp", [("max_prob", 1.0), ("entropy", 2.0)])
def test_critical_kl_through_the_reference_pass(certainty, cert_temp, methods_off):
    """enable(critical_kl_exponent=...): the reference model's no-grad pass returns its
    log-probs with the weights (1 - c) J^gamma + c (J of docs/math.md §5 from full logits at
    the certainty temperature), the replay buffer keeps them, and training_step weights
    OpenRLHF's KL term by them."""
    gamma, c = 2.0, 0.1
    args = _margs(kl="k3")
    exp = make_experience(51)
    ref_actor = _reference_actor()
    _enable(critical_kl_exponent=gamma, critical_kl_intercept=c, critical_kl_certainty=certainty,
            critical_kl_temperature=cert_temp)
    with torch.no_grad():
        packed = ref_actor(exp.sequences, exp.action_mask, exp.attention_mask)
    logp = _full_stats(ref_actor.model, exp)[0]
    _, maxp, ent = _full_stats(ref_actor.model, exp, cert_temp)
    logV = torch.log(torch.tensor(float(V), dtype=torch.float64))
    J = 1 + maxp.log() / logV if certainty == "max_prob" else 1 - ent / logV
    w = ((1 - c) * J ** gamma + c) * exp.action_mask
    m = exp.action_mask
    assert packed.shape == (*m.shape, 2)
    assert torch.allclose(packed[..., 0], (logp * m).float(), atol=2e-5)
    assert torch.allclose(packed[..., 1], w.float(), atol=2e-5)
    exp.base_action_log_probs = packed
    t = _trainer(args)
    t.replay_buffer = _buffer(copy.deepcopy(exp))
    batch = make_experience_batch(t.replay_buffer.items)
    lbi = ORL.get_loss_batch_info(None, batch.action_mask)
    gorl.training_step(t, batch, 0.05, 0, lbi)
    ref_exp = copy.deepcopy(exp)
    ref_exp.base_action_log_probs = packed[..., 0].contiguous()
    ref_batch = make_experience_batch(remove_padding_in_sequences(
        split_experience_batch(ref_exp)))
    Tb = ref_batch.action_mask.shape[1]
    model = tiny_model(0)
    _ref_step(model, ref_batch, args, 0.05, lbi, kl_w=w[:, :Tb].float())
    _close(t.actor.model, model)
    plain = tiny_model(0)
    _ref_step(plain, ref_batch, args, 0.05, lbi)
    assert _differs(_params(plain), _params(t.actor.model))


def _pipeline(**options):
    """The whole path of one update with ``options``: reference pass, replay buffer,
    nthr_pass, one training_step. Returns the parameters after it."""
    args = _margs(kl="k3")
    exp = _nthr_experience(42)
    if options.get("lopti_eta") == "median":    # on-policy p_old ~ 1/V: split at its median
        p_old = exp.action_log_probs.exp()[exp.action_mask]
        options["lopti_eta"] = float(p_old.median())
    gorl.disable()
    _enable(**options)
    if options.get("critical_kl_exponent") is not None:
        with torch.no_grad():
            exp.base_action_log_probs = _reference_actor()(exp.sequences, exp.action_mask,
                                                           exp.attention_mask)
    t = _trainer(args)
    t.replay_buffer = _buffer(exp)
    if options.get("nthr"):
        gorl.nthr_pass(t)
    batch = make_experience_batch(t.replay_buffer.items)
    gorl.training_step(t, batch, 0.05, 0, ORL.get_loss_batch_info(None, batch.action_mask))
    return _params(t.actor.model)


# every method option of enable(): (its value, the options it is compared against)
OPTION_CASES = {
    "ar_alpha": (0.5, {}),
    "lopti_eta": ("median", {}),
    "lopti_order": ("high-first", {"lopti_eta": "median"}),
    "nthr": (True, {"nthr_beta": 0.0}),
    "nthr_beta": (1.0, {"nthr": True, "nthr_beta": 0.0}),
    "nthr_eta": (0.3, {"nthr": True, "nthr_beta": 0.0}),
    "critical_kl_exponent": (2.0, {}),
    "critical_kl_intercept": (0.5, {"critical_kl_exponent": 2.0}),
    "critical_kl_certainty": ("entropy", {"critical_kl_exponent": 2.0}),
    "critical_kl_temperature": (3.0, {"critical_kl_exponent": 2.0}),
    # every pass on: float32 test models, so the sweeps are checked to receive the mode
    "logits_dtype": ("float32", {"nthr": True, "nthr_beta": 0.0, "critical_kl_exponent": 2.0}),
}


@pytest.mark.parametrize("name", sorted(OPTION_CASES))
def test_every_method_option_changes_the_update(name, methods_off):
    """Each method option of enable() (the list is MethodOptions' own) changes OpenRLHF's
    update against the same options without it: none is accepted and ignored."""
    # the kept-set options: tests/test_openrlhf_support.py, tests/test_openrlhf_support_set.py
    assert set(OPTION_CASES) | {"support", "support_ties", "support_set"} == set(gorl.METHOD_OPTIONS)
    value, base = OPTION_CASES[name]
    if name == "logits_dtype":
        from conftest import assert_logits_mode_reached, logits_dtypes_seen
        with logits_dtypes_seen() as seen_a:
            _pipeline(**base)
        with logits_dtypes_seen() as seen_b:
            _pipeline(**dict(base, **{name: value}))
        assert_logits_mode_reached(seen_a, seen_b, at_least=3)
        return
    assert _differs(_pipeline(**base), _pipeline(**dict(base, **{name: value})))


@pytest.mark.parametrize("options,setting,match", [
    (dict(lopti_eta=0.5), dict(gas=2), "lopti_eta: .*train.micro_batch_size"),
    (dict(lopti_eta=0.5), dict(dynamic=True), "lopti_eta: train.dynamic_batch_enable"),
    (dict(nthr=True), dict(dynamic=True), "nthr: train.dynamic_batch_enable"),
    (dict(nthr=True), dict(tp=2), "nthr: ds.tensor_parallel_size"),
    (dict(critical_kl_exponent=2.0), dict(kl=None), "critical_kl_exponent: .*algo.kl.use_loss"),
])
def test_methods_refuse_settings_by_name(options, setting, match, methods_off):
    """A setting a method cannot run with is refused before the first step, naming both."""
    args = _margs(kl=setting.get("kl", "k3"))
    args.train.dynamic_batch_enable = setting.get("dynamic", False)
    args.ds = SimpleNamespace(ring_attn_size=1, tensor_parallel_size=setting.get("tp", 1))
    t = _trainer(args)
    t.strategy.accumulated_gradient = setting.get("gas", 1)
    _enable(**options)
    with pytest.raises(ValueError, match=match):
        gorl.check_trainer(t)
    with pytest.raises(ValueError, match=match.split(":")[0]):
        gorl.training_step(t, make_experience(3), 0.05, 0)


@pytest.mark.parametrize("options,match", [
    (dict(bogus=1.0), "bogus"),
    (dict(nthr_beta=float("nan")), "nthr_beta"),
    (dict(critical_kl_exponent=float("inf")), "critical_kl_exponent"),
    (dict(lopti_eta=1.5), "lopti_eta"),
    (dict(lopti_order="low"), "lopti_order"),
    (dict(critical_kl_certainty="argmax"), "critical_kl_certainty"),
])
def test_enable_refuses_bad_options_by_name(options, match, methods_off):
    with pytest.raises(ValueError, match=match):
        _enable(**options)


def test_options_from_the_environment(monkeypatch, methods_off):
    """Ray workers get the options through GBC_OPENRLHF_OPTIONS; a repeated one is refused."""
    monkeypatch.setenv(gorl.ENV_OPTIONS, "lopti_eta=0.4,nthr=true,nthr_eta=auto")
    _enable()
    assert gorl._STATE.methods.lopti_eta == 0.4 and gorl._STATE.methods.nthr
    monkeypatch.setenv(gorl.ENV_OPTIONS, "lopti_eta=0.4,lopti_eta=0.3")
    with pytest.raises(ValueError, match="lopti_eta"):
        _enable()


@pytest.mark.parametrize("bad,match", [
    (dict(eps=(-0.1, 0.2)), "actor.eps_clip_low_high"),
    (dict(eps=(0.2,)), "actor.eps_clip_low_high"),
    (dict(eps=(0.2, float("nan"))), "actor.eps_clip_low_high"),
    (dict(dual_clip=0.5), "actor.dual_clip"),
    (dict(entropy_coef=float("inf")), "actor.entropy_coef"),
])
def test_errors_name_openrlhf_options(bad, match):
    """A bad value in OpenRLHF's arguments is refused naming OpenRLHF's option."""
    with pytest.raises(ValueError, match=match):
        gorl.policy_loss_config(make_args(**bad), 0.05)
    args = make_args(kl="k3")
    args.algo.kl.init_coef = float("nan")
    with pytest.raises(ValueError, match="algo.kl.init_coef"):
        gorl.policy_loss_config(args)


def test_openrlhf_presets_equal_the_mapping():
    """preset('openrlhf:<policy_loss_type>') is the policy term policy_loss_config maps to."""
    for plt in ("ppo", "gspo"):
        args = make_args(policy_loss_type=plt, eps=(0.2, 0.28))
        assert gorl.policy_loss_config(args) == gbc.PolicyLossConfig.preset(
            f"openrlhf:{plt}", epsilon_low=0.2, epsilon_high=0.28)


@pytest.mark.parametrize("plt,agg", [("gspo", "seq-mean-token-mean"),
                                     ("ppo", "seq-mean-token-mean")])
def test_config_alone_counts_the_nonempty_sequences(plt, agg):
    """``policy_loss_config(args)`` alone (no loss_batch_info) equals OpenRLHF's ``PolicyLoss``
    on a batch with an empty response: its ``aggregate_loss`` averages over the non-empty
    sequences (the preset's ``seq_count``), so leaving the batch normalisers out does not
    change the value."""
    args = make_args(policy_loss_type=plt, loss_agg_mode=agg)
    exp = make_experience()
    assert not bool(exp.action_mask.any(-1).all())
    logp = (exp.action_log_probs + 0.2 * torch.randn(exp.action_mask.shape,
                                                     generator=torch.Generator().manual_seed(3)))
    a = args.actor
    want = ORL.PolicyLoss(clip_eps_low=a.eps_clip_low_high[0],
                          clip_eps_high=a.eps_clip_low_high[1], dual_clip=a.dual_clip,
                          token_level_loss=False, policy_loss_type=plt)(
        logp, exp.action_log_probs, exp.advantages, action_mask=exp.action_mask)[0]
    got, _ = gbc.policy_loss(logp, exp.action_mask, exp.advantages, exp.action_log_probs,
                             config=gorl.policy_loss_config(args))
    assert abs(float(got) - float(want)) < 1e-6


def test_enable_refuses_what_the_no_grad_passes_would_not_see(methods_off):
    for name in ("temperature", "logit_softcap"):
        with pytest.raises(ValueError, match=f"^{name}: set on OpenRLHF's actor"):
            _enable(**{name: 0.7})


def test_environment_options_typed_as_verls(monkeypatch, methods_off):
    """GBC_OPENRLHF_OPTIONS types a method option as GBC_VERL_OPTIONS does (``nthr=1``)."""
    monkeypatch.setenv(gorl.ENV_OPTIONS, "nthr=1,nthr_eta=0.5")
    _enable()
    assert gorl._STATE.methods.nthr is True and gorl._STATE.methods.nthr_eta == 0.5
    monkeypatch.setenv(gorl.ENV_OPTIONS, "nthr=maybe")
    with pytest.raises(ValueError, match="nthr expects"):
        _enable()
