"""SkyRL 0.3.0 (gbc_kernels.integrations.skyrl, docs/skyrl.md) against SkyRL's own code: its
registered policy losses, loss reductions and KL / entropy terms on the same per-token inputs
(float64), its HFModelWrapper.forward, and its policy worker's step on a tiny Qwen2."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys

import pytest
import torch

import gbc_kernels as gbc

pytest.importorskip("skyrl")
HERE = os.path.dirname(os.path.abspath(__file__))


def skyrl_cpu():
    if "skyrl_cpu" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "skyrl_cpu", os.path.join(HERE, "standins", "skyrl_cpu.py"))
        sys.modules["skyrl_cpu"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["skyrl_cpu"])
    return sys.modules["skyrl_cpu"]


@pytest.fixture(scope="module")
def sky():
    return skyrl_cpu().load()


def algorithm(sky, loss_type, **kw):
    c = sky.config
    a = c.AlgorithmConfig(
        policy_loss_type=loss_type, eps_clip_low=0.15, eps_clip_high=0.25, clip_ratio_c=2.5,
        sapo=c.SAPOConfig(tau_pos=0.9, tau_neg=1.3),
        cispo=c.CISPOConfig(cispo_eps_clip_low=0.1, cispo_eps_clip_high=0.3),
        clip_cov=c.ClipCovConfig(clip_ratio=0.3, clip_cov_lb=-1e3, clip_cov_ub=5.0),
        kl_cov=c.KLCovConfig(kl_cov_frac=0.3, ppo_kl_coef=0.7))
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def inputs(seed, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    lens[2] = 0                                     # an empty row
    mask = (torch.arange(T)[None] < lens[:, None]).double()
    logp = -2.0 * torch.rand(B, T, generator=g, dtype=torch.float64) - 0.05
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    old = old.clamp(max=-1e-3)
    ref = (logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    return dict(logp=logp, old=old, ref=ref, adv=adv, mask=mask, ent=ent)


REDUCTIONS = ("token_mean", "token_mean_legacy", "sequence_mean", "seq_mean_token_sum_norm",
              "prompt_mean")


def scaled(sky, x, reduction):
    return sky.ppo_utils.apply_loss_reduction_to_advantages_minibatch(
        x["adv"], x["mask"], reduction, micro_batch_size=3, max_seq_len=11,
        prompt_boundaries=[(0, 2), (2, 4), (4, 6)])


def _sky_loss(sky, a, loss_type, x, adv):
    logp = x["logp"].clone().requires_grad_()
    adv_in = x["mask"] if loss_type == "cross_entropy" else adv
    torch.manual_seed(7)
    loss, metrics = sky.ppo_utils.PolicyLossRegistry.get(loss_type)(
        logp, x["old"], adv, config=a, loss_mask=x["mask"])
    loss.backward()
    return loss.detach(), logp.grad, metrics, adv_in


def _gbc_loss(sky, a, loss_type, x, adv, **kw):
    from gbc_kernels.integrations.skyrl import losses

    cfg = losses.policy_loss_config(a)
    call, _ = losses.policy_loss_inputs(a, loss_type, x["mask"], adv, x["old"])
    logp = x["logp"].clone().requires_grad_()
    torch.manual_seed(7)
    loss, m = gbc.policy_loss(logp, config=cfg, **call, **kw)
    loss.backward()
    return loss.detach(), logp.grad, m


LOSS_TYPES = ("regular", "dual_clip", "sapo", "gspo", "cispo", "clip_cov", "kl_cov",
              "importance_sampling", "cross_entropy")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_registered_loss_and_reduction_equals_skyrl(sky, loss_type):
    """Each of SkyRL's registered losses that gbc reproduces, on advantages scaled by each of
    SkyRL's loss reductions (its own apply_loss_reduction_to_advantages_minibatch): the loss
    and its gradient in the log-probs equal SkyRL's."""
    a = algorithm(sky, loss_type)
    for seed, reduction in enumerate(REDUCTIONS):
        x = inputs(seed)
        adv = scaled(sky, x, reduction)
        ref_loss, ref_grad, metrics, _ = _sky_loss(sky, a, loss_type, x, adv)
        loss, grad, _ = _gbc_loss(sky, a, loss_type, x, adv)
        assert abs(ref_grad).sum() > 0
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-9,
                                   msg=f"{loss_type} {reduction}")
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-9,
                                   msg=f"{loss_type} {reduction}")
        if loss_type == "clip_cov":              # the selection acts (else the test is idle)
            assert metrics["clip_ratio"] > 0


def test_cispo_at_the_installed_releases_defaults_equals_skyrl(sky):
    """CISPO with the installed SkyRL's own ``CISPOConfig()`` defaults (0.3: clip low 0, high 5;
    0.4: low 1, i.e. a lower bound of 0 on the ratio, high 4): loss and gradient equal SkyRL's;
    the installed defaults are the ones gbc maps (not copied from one release)."""
    c = sky.config
    a = algorithm(sky, "cispo")
    a.cispo = c.CISPOConfig()
    x = inputs(5)
    adv = scaled(sky, x, "token_mean")
    ref_loss, ref_grad, _, _ = _sky_loss(sky, a, "cispo", x, adv)
    loss, grad, _ = _gbc_loss(sky, a, "cispo", x, adv)
    assert abs(ref_grad).sum() > 0
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("kl_type", ("k1", "k2", "k3", "abs"))
@pytest.mark.parametrize("loss_type", ("regular", "gspo", "sapo"))
def test_worker_kl_and_entropy_terms_equal_skyrl(sky, loss_type, kl_type):
    """The worker's micro-batch loss, ``policy * dp + (kl_coef * KL - entropy_coef * H) *
    microbatch_weight`` by SkyRL's own compute_approx_kl and masked_mean, equals ``dp`` times
    gbc's loss with kl_entropy_weight = microbatch_weight / dp; gradients in logp and H."""
    from gbc_kernels.integrations.skyrl import losses

    a = algorithm(sky, loss_type, use_kl_loss=True, kl_loss_coef=0.3, kl_estimator_type=kl_type,
                  use_entropy_loss=True, entropy_loss_coef=0.05)
    mm = sky.torch_utils.masked_mean
    x = inputs(11)
    adv = scaled(sky, x, "token_mean")
    dp, w = 2, 0.375
    logp = x["logp"].clone().requires_grad_()
    ent = x["ent"].clone().requires_grad_()
    pol, _ = sky.ppo_utils.PolicyLossRegistry.get(loss_type)(logp, x["old"], adv, config=a,
                                                            loss_mask=x["mask"])
    kl = sky.ppo_utils.compute_approx_kl(logp, x["ref"], loss_mask=x["mask"],
                                         kl_estimator_type=kl_type)
    ref = pol * dp + (mm(kl, x["mask"], dim=-1).mean() * 0.3 - mm(ent, x["mask"]) * 0.05) * w
    ref.backward()
    cfg = losses.policy_loss_config(a, kl_entropy_weight=w / dp)
    logp2 = x["logp"].clone().requires_grad_()
    ent2 = x["ent"].clone().requires_grad_()
    call, _ = losses.policy_loss_inputs(a, loss_type, x["mask"], adv, x["old"])
    loss, _ = gbc.policy_loss(logp2, ref_logp=x["ref"], entropy=ent2, config=cfg, **call)
    (loss * dp).backward()
    torch.testing.assert_close((loss * dp).detach().double(), ref.detach(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(logp2.grad, logp.grad, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(ent2.grad, ent.grad, rtol=1e-6, atol=1e-9)


def test_off_policy_correction_equals_skyrl(sky):
    """SkyRL's off-policy correction (token TIS and a sequence mask) enters as gbc's is_ratio."""
    c = sky.config
    x = inputs(3)
    g = torch.Generator().manual_seed(5)
    rollout = x["old"] + 0.2 * torch.randn(x["old"].shape, generator=g, dtype=torch.float64)
    adv = scaled(sky, x, "sequence_mean")
    for opc in (c.OffPolicyCorrectionConfig(tis_ratio_type="token", token_tis_ratio_clip_high=1.5),
                c.OffPolicyCorrectionConfig(tis_ratio_type="sequence",
                                            sequence_mask_metric="geometric",
                                            geo_mask_high=1.05, geo_mask_low=0.95)):
        for loss_type in ("regular", "gspo", "cispo"):
            a = algorithm(sky, loss_type, off_policy_correction=opc)
            logp = x["logp"].clone().requires_grad_()
            ref, _ = sky.ppo_utils.PolicyLossRegistry.get(loss_type)(
                logp, x["old"], adv, config=a, loss_mask=x["mask"], rollout_logprobs=rollout)
            ref.backward()
            from gbc_kernels.integrations.skyrl import losses

            call, _ = losses.policy_loss_inputs(a, loss_type, x["mask"], adv, x["old"], rollout)
            assert call["is_ratio"] is not None
            logp2 = x["logp"].clone().requires_grad_()
            loss, _ = gbc.policy_loss(logp2, config=losses.policy_loss_config(a), **call)
            loss.backward()
            torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(logp2.grad, logp.grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("case, match", [
    (dict(policy_loss_type="rollout_is"), "policy_loss_type='rollout_is'"),
    (dict(policy_loss_type="dppo"), "policy_loss_type='dppo'"),
    (dict(policy_loss_type="nope"), "trainer.algorithm.policy_loss_type"),
    (dict(policy_loss_type="dual_clip", clip_ratio_c=0.5), r"trainer.algorithm.clip_ratio_c=0.5"),
    (dict(eps_clip_low=1.5), r"trainer.algorithm.eps_clip_low=1.5"),
    (dict(eps_clip_high=float("nan")), r"trainer.algorithm.eps_clip_high"),
    (dict(use_kl_loss=True, kl_estimator_type="k9"), "trainer.algorithm.kl_estimator_type"),
    (dict(use_kl_loss="yes"), "trainer.algorithm.use_kl_loss"),
])
def test_mapping_refuses_in_skyrl_words(sky, case, match):
    from gbc_kernels.integrations.skyrl import losses

    a = algorithm(sky, case.pop("policy_loss_type", "regular"), **case)
    with pytest.raises(ValueError, match=match):
        losses.policy_loss_config(a, kl_entropy_weight=1.0)


# ---- the policy worker on a tiny Qwen2 (gloo) ------------------------------------------------
V, P, T = 97, 5, 6


def tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager")
    return Qwen2ForCausalLM(cfg).float()


def make_batch(sky, seed, B=4, kl=True, rollout=False):
    """A SkyRL training batch: left-padded prompts, right-padded responses, an empty one;
    advantages scaled by SkyRL's token_mean reduction."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, V, (B, P + T), generator=g)
    attn = torch.ones(B, P + T, dtype=torch.long)
    plen = torch.randint(2, P + 1, (B,), generator=g)
    rlen = torch.randint(1, T + 1, (B,), generator=g)
    rlen[1] = 0
    for b in range(B):
        attn[b, :P - plen[b]] = 0
        attn[b, P + rlen[b]:] = 0
    lm = (torch.arange(T)[None] < rlen[:, None]).long()
    adv = torch.randn(B, 1, generator=g).expand(B, T) * lm
    adv = sky.ppo_utils.apply_loss_reduction_to_advantages_minibatch(
        adv.float(), lm.float(), "token_mean", 2, T)
    old = -3 * torch.rand(B, T, generator=g) - 0.1
    d = {"sequences": seq, "attention_mask": attn, "response_mask": lm, "loss_mask": lm,
         "advantages": adv, "action_log_probs": old,
         "base_action_log_probs": -3 * torch.rand(B, T, generator=g) - 0.1 if kl else None,
         "rollout_logprobs": old + 0.1 * torch.randn(B, T, generator=g) if rollout else None}
    batch = TrainingInputBatch(d)
    batch.metadata = {"response_length": T}
    return batch


def build_worker(sky, cls, algorithm_cfg, world, model, options=None, micro=2, packed=False):
    w = skyrl_cpu().policy_worker(cls, algorithm_cfg, model, world, micro, packed=packed)
    if options is not None:
        w._gbc_options = options
    return w


def _grads(model, world):
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        out[n] = None if g is None else g.detach().clone()
    return out


def step_setup(sky, loss_type, gbc_on, kw):
    """A step case's SkyRL algorithm config (KL and entropy terms, the off-policy correction
    with ``kw["rollout"]``), worker class (gbc's or SkyRL's FSDP policy worker) and method
    options."""
    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase

    a = algorithm(sky, loss_type, use_kl_loss=kw.get("kl", True), kl_loss_coef=0.2,
                  kl_estimator_type=kw.get("kl_type", "k3"),
                  use_entropy_loss=kw.get("ent", True), entropy_loss_coef=0.03)
    if kw.get("rollout"):
        a.off_policy_correction = sky.config.OffPolicyCorrectionConfig(
            tis_ratio_type="token", token_tis_ratio_clip_high=1.5)
    cls = gfsdp.GBCFSDPPolicyWorker if gbc_on else FSDPPolicyWorkerBase
    opts = methods.MethodOptions(**kw.get("methods", {}))
    return a, cls, opts


def _step(sky, rank, world, loss_type, gbc_on, kw):
    model = tiny_qwen2()
    if world > 1:
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    a, cls, opts = step_setup(sky, loss_type, gbc_on, kw)
    w = build_worker(sky, cls, a, world, model, opts if gbc_on else None,
                     packed=kw.get("packed", False))
    data = make_batch(sky, 100 + rank, kl=kw.get("kl", True), rollout=kw.get("rollout", False))
    with skyrl_cpu().cpu_device():
        torch.manual_seed(3)
        out = w.forward_backward(data, loss_fn=kw.get("loss_fn"))
        grads = _grads(model, world)
        fwd = w.forward(data)
    return dict(metrics=out.metrics, outputs=out.loss_fn_outputs, grads=grads,
                old=[r["logprobs"] for r in fwd.loss_fn_outputs])


def _steps_worker(rank, world, cases, watch=False):
    """(gbc's, SkyRL's) step of each case on this rank; ``watch``: also the shapes over the
    vocabulary each path forms in one training step and log-prob pass (small chunks)."""
    from conftest import VocabWatcher

    sky = skyrl_cpu().load()
    out = [(_step(sky, rank, world, lt, True, kw), _step(sky, rank, world, lt, False, kw))
           for lt, kw in cases]
    if not watch:
        return out
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPRefWorkerBase

    ref_out = {}
    for cls in (gfsdp.GBCFSDPRefWorker, FSDPRefWorkerBase):   # the reference worker's pass
        w = skyrl_cpu().policy_worker(cls, algorithm(sky, "regular"), tiny_qwen2(), micro=3)
        with skyrl_cpu().cpu_device():
            ref_out[cls] = [r["logprobs"] for r in w.forward(make_batch(sky, 9, B=5))
                            .loss_fn_outputs]
    os.environ["GBC_CHUNK_MB"] = "0.002"
    seen = {}
    for gbc_on in (True, False):
        with VocabWatcher(V) as w:
            _step(sky, rank, world, "regular", gbc_on, {})
        seen[gbc_on] = [s for s in w.seen if len(s) >= 2 and s not in ((V, 32), (32, V))]
    seen["ref"] = (ref_out[gfsdp.GBCFSDPRefWorker], ref_out[FSDPRefWorkerBase])
    return out, seen


def _compare(got, ref, rtol=2e-4, atol=2e-6):
    assert set(got["metrics"]) == set(ref["metrics"])
    for k in ref["metrics"]:
        assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=rtol, abs=atol), k
    n = 0
    for go, ro in zip(got["outputs"], ref["outputs"]):
        assert set(go) == set(ro)
        for a, b in zip(go["logprobs"], ro["logprobs"]):
            if a == a:                              # gbc's: NaN outside the loss mask
                assert a == pytest.approx(b, rel=rtol, abs=atol)
                n += 1
        for a, b in zip(go.get("elementwise_loss", ()), ro.get("elementwise_loss", ())):
            assert a == pytest.approx(b, rel=rtol, abs=atol)
    assert n > 0
    torch.testing.assert_close(torch.tensor(got["old"]), torch.tensor(ref["old"]), rtol=rtol,
                               atol=atol)
    for name, grad in ref["grads"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(got["grads"][name], grad, rtol=rtol, atol=atol, msg=name)


ONE_RANK = [("regular", {}), ("dual_clip", dict(kl_type="k1")), ("gspo", dict(rollout=True)),
            ("cispo", dict(kl=False)), ("sapo", dict(ent=False, kl_type="abs")),
            ("clip_cov", {}), ("kl_cov", dict(kl_type="k2")),
            ("importance_sampling", dict(ent=False)),
            ("regular", dict(loss_fn="cross_entropy"))]        # SkyRL's SFT path (Tinker API)


def test_worker_step_equals_skyrl_one_rank():
    """SkyRL's own forward_backward (two micro-batches) and no-grad forward with gbc's worker
    equal its stock worker, for several loss types, KL forms and the off-policy correction:
    metrics (losses, entropy, KL, clip ratio), log-probs and every parameter's gradient; the
    reference worker's log-prob pass equals SkyRL's (temperature 1); and a dispatch-mode watcher sees no tensor over the vocabulary with a micro-batch's token rows on
    gbc's path (it does on SkyRL's, so the check can fail)."""
    from conftest import spawn_gloo

    out, seen = spawn_gloo(1, _steps_worker, ONE_RANK, True)[0]
    for (got, ref), case in zip(out, ONE_RANK):
        _compare(got, ref)
    # no [tokens, V] logits on gbc's path (a micro-batch holds 2 x 11 tokens); SkyRL's has them

    def rows(shapes):
        return max(torch.Size(s[:-1]).numel() for s in shapes) if shapes else 0

    assert rows(seen[False]) >= 2 * (P + T)
    assert 0 < rows(seen[True]) <= 16 < 2 * (P + T), seen[True]     # 16: the chunk floor
    got_ref, sky_ref = seen["ref"]                  # the reference worker's log-prob pass
    torch.testing.assert_close(torch.tensor(got_ref), torch.tensor(sky_ref), rtol=1e-5, atol=1e-5)


def test_worker_step_equals_skyrl_two_ranks_fsdp2():
    """The same at two data-parallel ranks, the model sharded by FSDP2 (gloo): SkyRL's dp_size
    scaling and its metrics' all-reduce."""
    from conftest import spawn_gloo

    cases = [("regular", {}), ("gspo", dict(kl_type="k1"))]
    for rank_out in spawn_gloo(2, _steps_worker, cases):
        for got, ref in rank_out:
            _compare(got, ref)


def _packed_worker(rank, world, cases):
    """(gbc's, SkyRL's) step of each case with ``trainer.remove_microbatch_padding`` (SkyRL's
    default: micro-batches packed into one row on the varlen stand-in, which refuses an
    attention mask, so a padded forward fails); at one rank also SkyRL's padded step of the
    first case and the reference worker's packed pass (gbc's, SkyRL's)."""
    sky = skyrl_cpu().load()
    packed = [dict(kw, packed=True) for _, kw in cases]
    out = [(_step(sky, rank, world, lt, True, kw), _step(sky, rank, world, lt, False, kw))
           for (lt, _), kw in zip(cases, packed)]
    if world > 1:
        return out, None
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPRefWorkerBase

    ref = []
    for cls in (gfsdp.GBCFSDPRefWorker, FSDPRefWorkerBase):
        w = skyrl_cpu().policy_worker(cls, algorithm(sky, "regular"), tiny_qwen2(), micro=3,
                                      packed=True)
        with skyrl_cpu().cpu_device():
            ref.append([r["logprobs"] for r in w.forward(make_batch(sky, 9, B=5))
                        .loss_fn_outputs])
    return out, (ref, _step(sky, rank, world, cases[0][0], False, cases[0][1]))


PACKED = [("regular", {}), ("gspo", dict(rollout=True, kl_type="k1")),
          ("sapo", dict(ent=False)), ("regular", dict(loss_fn="cross_entropy"))]


def test_worker_step_packed_equals_skyrl_one_rank():
    """trainer.remove_microbatch_padding=True (SkyRL's default): gbc's packed training step and
    no-grad passes equal SkyRL's own packed worker — every metric, the log-probs (the no-grad
    pass's everywhere, SkyRL's packed values at padding included), every parameter's gradient;
    the reference worker's packed pass; and SkyRL's packed no-grad output differs from its
    padded one (the packed layout is what is compared)."""
    from conftest import spawn_gloo

    out, (ref, padded) = spawn_gloo(1, _packed_worker, PACKED)[0]
    for got, want in out:
        _compare(got, want)
    torch.testing.assert_close(torch.tensor(ref[0]), torch.tensor(ref[1]), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(torch.tensor(out[0][1]["old"]), torch.tensor(padded["old"]))
    for name, grad in padded["grads"].items():       # the same step, another layout
        torch.testing.assert_close(out[0][1]["grads"][name], grad, rtol=2e-4, atol=2e-6)


def test_worker_step_packed_equals_skyrl_two_ranks_fsdp2():
    """The same packed step at two FSDP2 data-parallel ranks (gloo)."""
    from conftest import spawn_gloo

    for rank_out, _ in spawn_gloo(2, _packed_worker, [("regular", dict(kl_type="k2"))]):
        for got, want in rank_out:
            _compare(got, want)


# ---- the methods, each against the method applied by hand through SkyRL's own step ---------
def _methods_worker(rank, world, packed=False):
    sky = skyrl_cpu().load()
    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase

    out = {}

    def run(cls, opts, kl, edit=None, lopti_eta=None):
        model = tiny_qwen2()
        a = algorithm(sky, "regular", use_kl_loss=kl, kl_loss_coef=0.2, use_entropy_loss=kl,
                      entropy_loss_coef=0.03)
        w = build_worker(sky, cls, a, world, model, opts, packed=packed)
        data = make_batch(sky, 7, kl=kl)
        with skyrl_cpu().cpu_device():
            if edit is None:
                res = w.forward_backward(data)
                grads = _grads(model, world)
                w.optim_step()
            else:                                   # by hand: one stock step per phase
                for phase in ("low", "high"):
                    d = make_batch(sky, 7, kl=kl)
                    d["advantages"] = edit(d, phase)
                    res = w.forward_backward(d)
                    grads = _grads(model, world)
                    w.optim_step()
        return res.metrics, grads, {n: p.detach().clone() for n, p in model.named_parameters()}

    out["ar"] = (run(gfsdp.GBCFSDPPolicyWorker, methods.MethodOptions(ar_alpha=0.6), True),)
    # AR by hand: SkyRL's own step on the AR-weighted advantages
    model = tiny_qwen2()
    a = algorithm(sky, "regular", use_kl_loss=True, kl_loss_coef=0.2, use_entropy_loss=True,
                  entropy_loss_coef=0.03)
    w = build_worker(sky, FSDPPolicyWorkerBase, a, world, model, packed=packed)
    d = make_batch(sky, 7)
    d["advantages"] = d["advantages"] * (0.6 * d["action_log_probs"].exp() + 0.4)
    with skyrl_cpu().cpu_device():
        res = w.forward_backward(d)
        grads = _grads(model, world)
        w.optim_step()
    out["ar"] = (out["ar"][0], (res.metrics, grads,
                                {n: p.detach().clone() for n, p in model.named_parameters()}))
    # Lopti: a mixed split at the median rollout probability
    d = make_batch(sky, 7, kl=False)
    p_old = d["action_log_probs"].exp()[d["loss_mask"].bool()]
    eta = float(p_old.median())
    for order in ("low-first", "high-first"):
        lo = methods.MethodOptions(lopti_eta=eta, lopti_order=order)
        phases = methods.LOPTI_ORDERS[order]

        def by_hand(dd, i, phases=phases):
            low = dd["action_log_probs"].exp() < eta
            keep = low if phases[i] == "low" else ~low
            return torch.where(keep, dd["advantages"], torch.zeros_like(dd["advantages"]))

        got = run(gfsdp.GBCFSDPPolicyWorker, lo, False)
        count = iter(range(2))
        ref = run(FSDPPolicyWorkerBase, None, False,
                  edit=lambda dd, phase: by_hand(dd, next(count)))
        out[order] = (got, ref)
    return out


def test_methods_equal_the_method_by_hand():
    """AR: gbc's worker with ar_alpha equals SkyRL's own step on the advantages times AR's
    weight (metrics, gradients, parameters after SkyRL's optimizer step). Lopti: one
    forward_backward + optim_step call of gbc's worker makes two optimizer steps, equal to two of
    SkyRL's own steps on the advantages masked to each phase's tokens (p_old < eta first, or
    the high ones first), the split and old log-probs fixed."""
    from conftest import spawn_gloo

    _check_methods(spawn_gloo(1, _methods_worker)[0])


def test_methods_packed_equal_the_method_by_hand():
    """The same with trainer.remove_microbatch_padding=True (packed micro-batches, gbc's and
    SkyRL's)."""
    from conftest import spawn_gloo

    _check_methods(spawn_gloo(1, _methods_worker, True)[0])


def _check_methods(out):
    (gm, gg, gp), (rm, rg, rp) = out["ar"]
    for k in rm:
        assert gm[k] == pytest.approx(rm[k], rel=2e-4, abs=2e-6), k
    for n in rg:
        torch.testing.assert_close(gg[n], rg[n], rtol=2e-4, atol=2e-6, msg=n)
    for order in ("low-first", "high-first"):
        (_, _, gp), (_, _, rp) = out[order]
        start = {n: p for n, p in tiny_qwen2().named_parameters()}
        for n in rp:
            assert (rp[n] - start[n]).abs().sum() > 0
            torch.testing.assert_close(gp[n], rp[n], rtol=2e-4, atol=2e-6, msg=f"{order} {n}")


def _lopti_logged_worker(rank, world, packed, order):
    """(gbc's Lopti step's metrics, SkyRL's stock step's on AR's advantages without the split
    at the same parameters, SkyRL's stock steps' on each phase's advantages, the rows' p_old
    split): KL and entropy terms on, AR on, eta at the median p_old."""
    sky = skyrl_cpu().load()
    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase

    a = algorithm(sky, "regular", use_kl_loss=True, kl_loss_coef=0.2, use_entropy_loss=True,
                  entropy_loss_coef=0.03)
    d = make_batch(sky, 7)
    eta = float(d["action_log_probs"].exp()[d["loss_mask"].bool()].median())
    opts = methods.MethodOptions(lopti_eta=eta, lopti_order=order, ar_alpha=0.3)
    with skyrl_cpu().cpu_device():
        w = build_worker(sky, gfsdp.GBCFSDPPolicyWorker, a, world, tiny_qwen2(), opts,
                         packed=packed)
        got = w.forward_backward(make_batch(sky, 7)).metrics
        w.optim_step()
        want = {}
        for phase in (None, "low", "high"):
            w = build_worker(sky, FSDPPolicyWorkerBase, a, world, tiny_qwen2(), packed=packed)
            hand = make_batch(sky, 7)
            hand["advantages"] = methods.loss_advantages(hand["advantages"],
                                                         hand["action_log_probs"], opts, phase)
            want[phase] = w.forward_backward(hand).metrics
    return got, want


@pytest.mark.parametrize("packed, order", [(False, "low-first"), (True, "high-first")],
                         ids=["padded-low-first", "packed-high-first"])
def test_lopti_logged_terms_are_the_batchs(packed, order):
    """Issue 53, defect 1: under Lopti gbc's FSDP worker logs SkyRL's terms of the batch
    without the split — ``final_loss``, ``policy_loss``, ``policy_entropy``, ``policy_kl``,
    ``loss_metrics/*`` equal SkyRL's own stock step on AR's advantages (every loss token once,
    SkyRL's normalisers) at the parameters before the first update, not the second phase's
    own (the old log); each phase's own SkyRL metrics stay under ``gbc_lopti_<phase>/``."""
    from conftest import spawn_gloo

    got, want = spawn_gloo(1, _lopti_logged_worker, packed, order)[0]
    whole = want[None]
    for k in ("final_loss", "policy_loss", "policy_entropy", "policy_kl"):
        assert k in whole, k
    for k, v in whole.items():
        if k != "policy_lr":
            assert got[k] == pytest.approx(v, rel=2e-4, abs=2e-6), k
    # the first phase's own (at the same parameters): SkyRL's stock step on the phase's
    # advantages (its KL / entropy over every token, as SkyRL's step on those advantages logs
    # them; final_loss is gbc's phase loss, whose KL / entropy count the phase's tokens)
    from gbc_kernels import methods

    for phase in methods.LOPTI_ORDERS[order][:1]:
        own = {k[len(f"gbc_lopti_{phase}/"):]: v for k, v in got.items()
               if k.startswith(f"gbc_lopti_{phase}/")}
        for k in ("policy_loss", "loss_metrics/clip_ratio"):
            assert own[k] == pytest.approx(want[phase][k], rel=2e-4, abs=2e-6), (phase, k)
        assert own["policy_loss"] != pytest.approx(whole["policy_loss"], rel=1e-3)


# ---- the forward, the switch-on and its refusals (in this process) --------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_model_wrapper_forward_equals_gbc_passes(sky, temperature):
    """SkyRL's HFModelWrapper.forward (logits -> logprobs_from_logits ->
    chunked_entropy_from_logits, a chunk size that splits the sequence) and gbc's log-prob pass
    give the same response log-probs and entropies."""
    from gbc_kernels.integrations import hf
    from gbc_kernels.integrations.skyrl.worker import _position_ids

    model = tiny_qwen2()
    wrapper = sky.model_wrapper.HFModelWrapper(model, logprobs_chunk_size=4)
    d = make_batch(sky, 5, B=5)
    seq, attn = d["sequences"], d["attention_mask"]
    with torch.no_grad():
        lp, out = wrapper(seq, T, attention_mask=attn, temperature=temperature,
                          return_output=True, compute_entropy=True)
        ent = out["entropy"][:, -T - 1:-1]
    glp, gent = hf.logprobs_through_forward(model, seq, attn, T, temperature=temperature,
                                            return_entropy=True,
                                            model_kwargs={"position_ids": _position_ids(attn)})
    seen = attn[:, -T - 1:-1].bool()       # SkyRL zeroes the entropy at padded positions
    torch.testing.assert_close(glp, lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gent[seen], ent[seen], rtol=1e-5, atol=1e-5)
    assert seen.sum() > 0 and not seen.all()


def _trainer_cfg(sky, **algo):
    from skyrl.train.config.config import TrainerConfig

    cfg = TrainerConfig()
    cfg.algorithm.temperature = 1.0
    cfg.remove_microbatch_padding = False      # SkyRL's default packs (flash-attn only)
    for k, v in algo.items():
        if k == "cispo" and isinstance(v, str):     # cispo="rollout": the anchor
            setattr(cfg.algorithm.cispo, "cispo_anchor", v)
            continue
        setattr(cfg.algorithm, k, v)
    return cfg


@pytest.mark.parametrize("algo, env, match", [
    (dict(policy_loss_type="nope"), "", "trainer.algorithm.policy_loss_type"),
    (dict(policy_loss_type="rollout_is"), "", "policy_loss_type='rollout_is'"),
    (dict(eps_clip_low=2.0), "", "trainer.algorithm.eps_clip_low=2.0"),
    (dict(use_kl_loss=True, kl_estimator_type="k4"), "", "trainer.algorithm.kl_estimator_type"),
    ({}, "ar_alpha=2", "GBC_SKYRL_OPTIONS: ar_alpha"),
    ({}, "ar_alpha=x", "GBC_SKYRL_OPTIONS: ar_alpha expects a float"),
    ({}, "arr_alpha=0.1", "GBC_SKYRL_OPTIONS: unknown option 'arr_alpha'"),
    ({}, "nthr=maybe", "GBC_SKYRL_OPTIONS: nthr expects a 1/0/true/false"),
    (dict(use_kl_loss=False), "critical_kl_exponent=2",
     r"GBC_SKYRL_OPTIONS: critical_kl_exponent: the loss has no KL term to weight \(set "
     r"trainer.algorithm.use_kl_loss=true"),
    (dict(use_kl_loss=True, kl_loss_coef=0.0), "critical_kl_exponent=2",
     "GBC_SKYRL_OPTIONS: critical_kl_exponent: the loss has no KL term"),
    # SkyRL 0.4's options that change the log-probs or the ratio's anchor (set as attributes
    # here, so the refusal is checked on 0.3's config too)
    (dict(enable_sample_support_replay=True), "",
     "trainer.algorithm.enable_sample_support_replay=true"),
    (dict(policy_loss_type="cispo", cispo="rollout"), "",
     "trainer.algorithm.cispo.cispo_anchor='rollout'"),
])
def test_worker_init_refuses_a_bad_switch_on(sky, monkeypatch, algo, env, match):
    """SkyRL builds its policy worker from its trainer config (the Ray actor's __init__): a loss
    gbc cannot reproduce or a bad method option stops it there, naming SkyRL's option or the
    variable."""
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from gbc_kernels.integrations.skyrl.losses import skyrl_replays_support

    if algo.get("enable_sample_support_replay") and skyrl_replays_support():
        pytest.skip("SkyRL 0.4: the support is replayed on FSDP (tests/test_skyrl_support.py)")
    monkeypatch.setenv("GBC_SKYRL_OPTIONS", env)
    with pytest.raises(ValueError, match=match):
        gfsdp.GBCFSDPPolicyWorker(cfg=_trainer_cfg(sky, **algo), world_size=1, rank=0,
                                  local_rank=0, master_addr="127.0.0.1", master_port=1,
                                  sequence_parallel_size=1)


def test_megatron_path_refuses_an_untested_release_in_the_worker_process(sky, monkeypatch):
    """The Megatron path checks SkyRL's release where its worker processes load gbc's head
    (the wrapper's config check, ``patch_wrapper``), not only in ``enable()``: on an untested
    release each refuses by name before it patches anything."""
    import gbc_kernels.integrations.skyrl as gsky
    from gbc_kernels.integrations import releases
    from gbc_kernels.integrations.skyrl import megatron as gmeg

    monkeypatch.setattr(releases, "installed", lambda d: "0.5.0" if d == "skyrl" else None)
    match = r"^skyrl 0\.5\.0: gbc's drop-in is tested on skyrl 0\.3\.x, skyrl 0\.4\.x"
    cfg = _trainer_cfg(sky)
    cfg.strategy = "megatron"
    for call in (lambda: gsky.enable(cfg), lambda: gmeg.check_megatron_config(cfg),
                 gmeg.patch_wrapper):
        with pytest.raises(RuntimeError, match=match):
            call()


def assert_gbc_actors(module, policy, ref, options):
    """``module``'s ``PolicyWorker`` / ``RefWorker`` are Ray actors of gbc's ``policy`` /
    ``ref`` classes, with ``options`` and ``GBC_SKYRL=1`` in their runtime environment."""
    for name, cls in (("PolicyWorker", policy), ("RefWorker", ref)):
        actor = getattr(module, name)
        assert actor.__ray_metadata__.modified_class.__mro__[1] is cls
        env = actor._default_options["runtime_env"]["env_vars"]
        assert env["GBC_SKYRL_OPTIONS"] == options and env["GBC_SKYRL"] == "1"


def test_enable_swaps_skyrl_workers_and_refuses(sky, monkeypatch):
    """enable() puts gbc's workers where SkyRL's BasePPOExp imports them from, the options in
    their Ray runtime environment; bad options, a config gbc cannot run and a missing SkyRL
    module stop it with an error naming them."""
    import skyrl.backends.skyrl_train.workers.fsdp as fsdp_pkg
    from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker

    import gbc_kernels.integrations.skyrl as gsky
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp

    for name in ("PolicyWorker", "RefWorker"):
        monkeypatch.setattr(fsdp_worker, name, getattr(fsdp_worker, name))
    monkeypatch.setitem(sys.modules, gsky.MEGATRON_WORKER, None)    # enable() refuses it
    skyrl_cpu().entrypoint_imports()            # enable() patches skyrl.train.trainer
    monkeypatch.setenv("GBC_SKYRL_OPTIONS", "")
    opts = gsky.enable(_trainer_cfg(sky), ar_alpha=0.25)
    assert opts.ar_alpha == 0.25
    from skyrl.train.trainer import RayPPOTrainer
    assert RayPPOTrainer._gbc_patched        # the methods' fields in its training batch
    assert_gbc_actors(fsdp_worker, gfsdp.GBCFSDPPolicyWorker, gfsdp.GBCFSDPRefWorker,
                      "ar_alpha=0.25")
    with pytest.raises(ValueError, match="lopti_eta"):
        gsky.enable(lopti_eta=3.0)
    cfg = _trainer_cfg(sky)
    cfg.policy.sequence_parallel_size = 2         # Ulysses runs packed (SkyRL's default) ...
    cfg.remove_microbatch_padding = True
    gsky.enable(cfg)
    cfg.remove_microbatch_padding = False         # ... and is refused on padded micro-batches
    with pytest.raises(ValueError, match="trainer.policy.sequence_parallel_size=2 with "
                                         "trainer.remove_microbatch_padding=false"):
        gsky.enable(cfg)
    monkeypatch.setitem(sys.modules, "skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker", None)
    monkeypatch.delattr(fsdp_pkg, "fsdp_worker")
    with pytest.raises(ImportError, match="GBC_SKYRL: gbc's SkyRL workers need SkyRL"):
        gsky.enable()


def _megatron_worker(rank, world, tmp):
    """SkyRL's BasePPOExp._setup_trainer under trainer.strategy=megatron (its entrypoint's
    imports that this machine lacks as stand-ins, skyrl_cpu.entrypoint_imports): its
    error before and after gbc's enable(), and enable()'s own on such a config."""
    from types import SimpleNamespace

    sky = skyrl_cpu().load()
    skyrl_cpu().entrypoint_imports()
    from skyrl.train.entrypoints.main_base import BasePPOExp

    import gbc_kernels.integrations.skyrl as gsky

    exp = SimpleNamespace(cfg=SimpleNamespace(trainer=SimpleNamespace(
        strategy="megatron", export_path=tmp, ckpt_path=tmp)), get_cfg_as_str=str)
    errors = []
    for on in (False, True):
        if on:
            gsky.enable()
        try:
            BasePPOExp._setup_trainer(exp)
        except Exception as err:                    # noqa: BLE001 (recorded, compared)
            errors.append((type(err).__name__, str(err)))
    cfg = _trainer_cfg(sky)
    cfg.strategy = "megatron"
    try:
        gsky.enable(cfg)
    except ImportError as err:
        errors.append(("ImportError", str(err)))
    return errors


def test_megatron_strategy_without_megatron_bridge(tmp_path):
    """Where SkyRL's Megatron worker module does not import (megatron-bridge absent, as here),
    gbc's enable() leaves SkyRL's own loading error under trainer.strategy=megatron as it was,
    and enable() on a config with that strategy stops naming trainer.strategy and
    megatron-bridge (docs/skyrl.md, "Megatron")."""
    from conftest import spawn_gloo

    before, after, direct = spawn_gloo(1, _megatron_worker, str(tmp_path))[0]
    assert before[0].endswith("Error") and before == after, (before, after)
    assert direct[0] == "ImportError" and "trainer.strategy='megatron'" in direct[1], direct
    assert "megatron-bridge" in direct[1] and "Transformer Engine" in direct[1]


def test_pack_padded_is_skyrls_packing(sky):
    """hf.pack_padded packs as flash-attn's unpad_input (SkyRL's HFModelWrapper: the stand-in's
    rows, positions; the row before each response token and the packed stream's next token,
    SkyRL's roll) and refuses a loss row whose token or predecessor is padding, naming mask."""
    from gbc_kernels.integrations import hf

    sys.path.insert(0, os.path.join(HERE, "standins"))
    try:
        import varlen_attention as va
    finally:
        sys.path.remove(os.path.join(HERE, "standins"))
    d = make_batch(sky, 11, B=5)
    seq, attn, lm = d["sequences"], d["attention_mask"], d["loss_mask"]
    pk = hf.pack_padded(seq, attn, T, lm)
    ids, idx, _, _, _ = va.unpad_input(seq.unsqueeze(-1), attn)
    pos = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 1)
    torch.testing.assert_close(pk.input_ids, ids.T)
    torch.testing.assert_close(pk.position_ids, va.unpad_input(pos.unsqueeze(-1), attn)[0].T)
    rolled = torch.roll(ids.T, -1, 1)                   # SkyRL's next tokens, padded back
    back = va.pad_input(rolled.T, idx, *seq.shape).squeeze(-1)[:, -T - 1:-1]
    where = va.pad_input(torch.arange(ids.shape[0])[:, None], idx, *seq.shape).squeeze(-1)
    valid = attn[:, -T - 1:-1].bool()
    assert torch.equal(pk.valid, valid) and valid.sum() > 0 and not valid.all()
    assert torch.equal(pk.rolled[valid], back[valid])
    assert torch.equal(pk.index[valid], where[:, -T - 1:-1][valid])
    bad = lm.clone()
    b = int((attn[:, -1] == 0).nonzero()[0])            # a row with response padding
    bad[b, -1] = 1
    with pytest.raises(ValueError, match=rf"mask: row \[{b}, {T - 1}\] is set but"):
        hf.pack_padded(seq, attn, T, bad)


def test_every_method_option_is_honoured_or_refused(monkeypatch):
    """Each field of methods.MethodOptions is run by gbc's SkyRL worker (AR, Lopti: their tests
    above; NTHR, critical-token KL: tests/test_skyrl_methods.py) and parsed from
    GBC_SKYRL_OPTIONS with its type."""
    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl import worker

    fields = {f.name for f in dataclasses.fields(methods.MethodOptions)}
    text = ("ar_alpha=0.5,lopti_eta=0.3,lopti_order=high-first,nthr=true,nthr_beta=0.5,"
            "nthr_eta=0.25,critical_kl_exponent=2,critical_kl_intercept=0.1,"
            "critical_kl_certainty=entropy,critical_kl_temperature=0.7,logits_dtype=float32")
    want = methods.MethodOptions(
        ar_alpha=0.5, lopti_eta=0.3, lopti_order="high-first", nthr=True, nthr_beta=0.5,
        nthr_eta=0.25, critical_kl_exponent=2.0, critical_kl_intercept=0.1,
        critical_kl_certainty="entropy", critical_kl_temperature=0.7,
        logits_dtype=torch.float32)
    # support / support_ties / support_set: SkyRL replays its own recorded support (refused:
    # docs/skyrl.md)
    assert {name for name, _ in methods.parse_items(text, "t").items()} == \
        fields - {"support", "support_ties", "support_set"}
    assert worker.method_options(text) == want
    assert not hasattr(worker, "REFUSED")


@pytest.mark.parametrize("option", [dict(ar_alpha=0.5), dict(lopti_eta=0.5), dict(nthr=True),
                                    dict(critical_kl_exponent=2.0)])
def test_methods_refused_on_the_sft_loss(sky, option):
    """The methods on SkyRL's SFT loss (loss_fn="cross_entropy"): refused before any pass."""
    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp

    w = skyrl_cpu().policy_worker(gfsdp.GBCFSDPPolicyWorker, algorithm(sky, "regular"),
                                  tiny_qwen2())
    w._gbc_options = methods.MethodOptions(**option)
    with pytest.raises(ValueError, match=f"GBC_SKYRL_OPTIONS: {next(iter(option))} acts on RL"):
        w.forward_backward(make_batch(sky, 1), loss_fn="cross_entropy")


@pytest.mark.parametrize("kind", ["binary_tv", "binary_kl"])
def test_dppo_stays_refused_for_its_value_not_its_gradient(sky, kind):
    """SkyRL's ``dppo`` (docs/skyrl.md, why it stays refused, measured): gbc's ``dppo``
    objective (trust region by ``delta_low/high``, no truncation, the log-ratio clamp at 20)
    gives the gradient of SkyRL's own ``dppo_policy_loss`` (float64 inputs, gbc's float32 token
    math) but another loss value (``-A sg(r) logp`` against SkyRL's ``-A r``), which the
    worker would report as its ``final_loss``: refused naming SkyRL's option."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    from gbc_kernels.integrations.skyrl import losses as sl

    c = sky.config
    algo = c.AlgorithmConfig(policy_loss_type="dppo",
                             dppo=c.DPPOConfig(dppo_type=kind, delta_low=0.1, delta_high=0.15))
    g = torch.Generator().manual_seed(3)
    B, T = 6, 12
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.05
    logp0 = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.8
    theirs = logp0.clone().requires_grad_()
    value, _ = PolicyLossRegistry.get("dppo")(theirs, old, adv, config=algo,
                                              loss_mask=mask.double())
    value.backward()
    ours = logp0.clone().requires_grad_()
    cfg = gbc.PolicyLossConfig(objective="dppo", epsilon_low=0.1, epsilon_high=0.15,
                               dppo_divergence="tv" if kind == "binary_tv" else "binary_kl",
                               log_ratio_clamp=20.0)
    loss, _ = gbc.policy_loss(ours, mask, adv, old_logp=old, config=cfg, num_items_in_batch=1.0)
    loss.backward()
    assert (theirs.grad != 0).any() and (theirs.grad[mask] == 0).any()   # the region acts
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=1e-7)
    assert abs(float(loss) - float(value)) > 0.1 * abs(float(value))
    with pytest.raises(ValueError, match=r"^trainer.algorithm.policy_loss_type='dppo': not "
                                         r"reproduced by gbc \(its value is -A r"):
        sl.policy_loss_config(algo)
