"""gbc's Megatron head inside SkyRL 0.3.0's MegatronModelWrapper
(gbc_kernels.integrations.skyrl.megatron, docs/skyrl.md "Megatron") against SkyRL's own wrapper
on the same tiny megatron-core GPTModel and micro-batches: two gloo ranks, tensor parallel 2,
with and without sequence parallelism (a float64 model; SkyRL's head casts the logits to
float32, so the two agree to float32's rounding: 1e-5).

What runs is SkyRL's: its ``forward`` / ``forward_backward_mini_batch`` (micro-batching,
``forward_step`` with ``remove_left_padding`` / ``recover_left_padding``, its loss scaling),
megatron's schedule and backward. Bypassed here (said here): SkyRL's Megatron worker
(tests/test_skyrl_megatron_worker.py runs it, megatron-bridge's names stood in for); the model
is the CPU-shimmed tiny GPTModel of tests/test_verl_megatron.py with SkyRL's ``[B, 1, 1, S]`` padding mask replaced by the causal mask (exact for the valid rows
of the right-padded rows SkyRL's ``remove_left_padding`` makes, for both wrappers alike), and
the schedule's ``finalize_model_grads`` is the sequence-parallel norms' gradient all-reduce only
(SkyRL's wrapper sets megatron's, which needs DDP)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("skyrl")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import spawn_gloo  # noqa: E402

VOCAB = 50


def _model(tp, sp, packed=False, pp=1, cp=1):
    """The tiny GPTModel of tests/test_verl_megatron.py (same seed: the same weights), its
    attention on the causal mask; ``packed``: tests/test_verl_megatron_cp.py's (rotary
    positions, packed sequences on the stand-in attention; context parallel ``cp``). ``pp``:
    pipeline parallel size (this rank's stage; not with ``packed``)."""
    from test_verl_megatron import _chunks, _mc

    if packed:
        assert pp == 1, "packed: pipeline parallel 1"
        from test_verl_megatron_cp import _model as packed_model
        model = packed_model(tp, sp, cp=cp)
    else:
        model = _chunks(tp, sp, pp)[0]
    mc = _mc()

    def causal(module, args, kwargs):       # SkyRL's [B, 1, 1, S] padding mask -> causal
        m = args[2] if len(args) > 2 else kwargs.get("attention_mask")
        if m is not None and m.dim() == 4 and m.shape[2] == 1:
            mask = mc.causal_mask(m.shape[-1])
            if len(args) > 2:
                args = args[:2] + (mask,) + args[3:]
            else:
                kwargs["attention_mask"] = mask
        return args, kwargs

    model.register_forward_pre_hook(causal, with_kwargs=True, prepend=True)
    return model


def _cfg(sky, loss_type, packed=False, **algo):
    from test_skyrl import algorithm

    cfg = sky.config.TrainerConfig()
    cfg.algorithm = algorithm(sky, loss_type, **algo)
    cfg.remove_microbatch_padding = packed
    return cfg


def _micro_batches(seed, n=2, B=3, P=5, T=6):
    """SkyRL's micro-batches: left-padded prompts, right-padded responses (one response with
    an empty loss mask), its per-token inputs (float64)."""
    g = torch.Generator().manual_seed(seed)
    S = P + T
    out = []
    for i in range(n):
        plen = torch.randint(1, P + 1, (B,), generator=g)
        rlen = torch.randint(1, T + 1, (B,), generator=g)
        seq = torch.randint(1, VOCAB, (B, S), generator=g)
        pos = torch.arange(S)
        attn = ((pos[None] >= P - plen[:, None]) & (pos[None] < P + rlen[:, None])).long()
        seq = seq * attn
        action = (torch.arange(T)[None] < rlen[:, None]).double()
        loss_mask = action.clone()
        if i == 0:
            loss_mask[1] = 0.0                              # an empty row
        old = -2.0 * torch.rand(B, T, generator=g, dtype=torch.float64) - 4.0
        out.append(dict(
            sequences=seq, attention_mask=attn,
            position_ids=(attn.cumsum(-1) - 1).clamp(min=0), num_actions=T,
            old_action_log_probs=old,
            base_action_log_probs=old + 0.3 * torch.randn(B, T, generator=g,
                                                          dtype=torch.float64),
            rollout_action_logprobs=old + 0.05 * torch.randn(B, T, generator=g,
                                                             dtype=torch.float64),
            advantages=torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * action,
            loss_mask=loss_mask, action_mask=action, response_mask=action, num_microbatches=n,
            rollout_expert_indices=None,
            num_real_microbatches=n))
    return out


def _wrapper(sky, cfg, model, gbc):
    from conftest import megatron_bridge_cpu

    megatron_bridge_cpu().install()      # SkyRL 0.4's wrapper module imports megatron-bridge
    megatron_bridge_cpu().packed_seq_params_total_tokens()
    from megatron.core import parallel_state as mpu
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
    from skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper import (
        MegatronModelWrapper)

    from gbc_kernels.integrations.skyrl import megatron as sm

    cls = sm.wrapper_class() if gbc else MegatronModelWrapper
    w = cls(cfg, [model], policy_loss_fn=PolicyLossRegistry.get(cfg.algorithm.policy_loss_type))
    # SkyRL sets megatron's finalize_model_grads (DDP's grad sync); the bare model: the
    # sequence-parallel norms' all-reduce
    from test_verl_megatron import _mc
    group = mpu.get_tensor_model_parallel_group()
    model.config.finalize_model_grads_func = (
        lambda models, *a, **k: [_mc().allreduce_sp_norm_grads(m, group) for m in models])
    return w


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _step_worker(rank, world, cases):
    sys.path.insert(0, HERE)
    from test_skyrl import skyrl_cpu

    sky = skyrl_cpu().load()
    results = {}
    for name, (loss_type, sp, temp, options, algo) in cases.items():
        res = {}
        for gbc in (False, True):
            os.environ["GBC_SKYRL_OPTIONS"] = options if gbc else ""
            packed = name in PACKED
            model = _model(world, sp, packed)
            cfg = _cfg(sky, loss_type, packed, **algo)
            w = _wrapper(sky, cfg, model, gbc)
            mbs = _micro_batches(11)
            if not gbc and options:          # AR by hand: SkyRL's loss on AR's advantages
                from gbc_kernels import methods
                opts = methods.MethodOptions.parse(options, "GBC_SKYRL_OPTIONS")
                for mb in mbs:
                    mb["advantages"] = methods.loss_advantages(
                        mb["advantages"], mb["old_action_log_probs"], opts)
            torch.manual_seed(7)
            metrics = w.forward_backward_mini_batch(
                mbs, seq_len=mbs[0]["sequences"].shape[1], micro_batch_size=3,
                temperature=temp)
            res[gbc] = dict(metrics=metrics, grads=_grads(model))
            w.eval()
            res[gbc]["logp"] = w.forward(_micro_batches(11), mbs[0]["sequences"].shape[1], 3,
                                         temperature=temp)
        results[name] = res
    os.environ.pop("GBC_SKYRL_OPTIONS", None)
    return results


CASES = {
    "regular_kl_entropy": ("regular", False, 1.0, "",
                           dict(use_kl_loss=True, kl_loss_coef=0.2, kl_estimator_type="k3",
                                use_entropy_loss=True, entropy_loss_coef=0.03)),
    "dual_clip_sp_temperature": ("dual_clip", True, 0.7, "",
                                 dict(use_kl_loss=True, kl_loss_coef=0.1,
                                      kl_estimator_type="k1")),
    "gspo": ("gspo", False, 1.0, "", {}),
    "cispo_sp_ar": ("cispo", True, 1.0, "ar_alpha=0.4", {}),
    "cross_entropy": ("cross_entropy", True, 1.0, "", {}),
    "packed_regular_kl_entropy": ("regular", False, 1.0, "",
                                  dict(use_kl_loss=True, kl_loss_coef=0.2,
                                       kl_estimator_type="k2", use_entropy_loss=True,
                                       entropy_loss_coef=0.03)),
    "packed_sp_dual_clip_temperature": ("dual_clip", True, 0.8, "", {}),
}
# trainer.remove_microbatch_padding=true: SkyRL's thd packing
PACKED = {"packed_regular_kl_entropy", "packed_sp_dual_clip_temperature"}


@pytest.fixture(scope="module")
def stepped():
    return spawn_gloo(2, _step_worker, CASES)


def _close(a, b, what, tol=1e-5):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol / 10, msg=what)


def _same_metric(a, b, what):
    if isinstance(a, list):               # loss_fn_outputs: gbc's NaN outside the loss mask
        assert len(a) == len(b), what
        for i, (ra, rb) in enumerate(zip(a, b)):
            assert ra.keys() == rb.keys(), what
            for k in ra:
                x, y = torch.tensor(ra[k], dtype=torch.float64), torch.tensor(rb[k],
                                                                             dtype=torch.float64)
                keep = ~torch.isnan(y)
                assert x.shape == y.shape, f"{what}[{i}].{k}"
                _close(x[keep], y[keep], f"{what}[{i}].{k}")
        return
    if isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), what
        return
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6), what


@pytest.mark.parametrize("name", sorted(CASES))
def test_training_step_equals_skyrls_wrapper(stepped, name):
    """Loss, metrics, log-probs and entropy (SkyRL's metrics), every parameter's gradient and
    the no-grad forward's log-probs: gbc's wrapper == SkyRL's, on both ranks."""
    for r, per_rank in enumerate(stepped):
        stock, ours = per_rank[name][False], per_rank[name][True]
        assert len(stock["metrics"]) == len(ours["metrics"]) == 2
        for i, (ms, mg) in enumerate(zip(stock["metrics"], ours["metrics"])):
            assert ms.keys() == mg.keys(), (r, name, i, ms.keys() ^ mg.keys())
            for k in ms:
                _same_metric(ms[k], mg[k], f"rank {r} {name} micro-batch {i} {k}")
        assert stock["grads"].keys() == ours["grads"].keys()
        assert len(stock["grads"]) > 0
        for k in stock["grads"]:
            _close(stock["grads"][k], ours["grads"][k], f"rank {r} {name} grad {k}")
        _close(stock["logp"], ours["logp"], f"rank {r} {name} forward log-probs")


def _wrapper_cls_cfg(sky, **trainer):
    from conftest import megatron_bridge_cpu

    megatron_bridge_cpu().install()
    from gbc_kernels.integrations.skyrl import megatron as sm

    cfg = _cfg(sky, "regular")
    for k, v in trainer.items():
        obj = cfg
        *path, last = k.split(".")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, v)
    return sm.wrapper_class(), cfg


REFUSALS = [
    (dict(fused_lm_head_logprob=True), "", "trainer.fused_lm_head_logprob"),
    ({"policy.megatron_config.mtp_num_layers": 1}, "",
     "trainer.policy.megatron_config.mtp_num_layers"),
    ({"policy.model.lora.rank": 8}, "", "trainer.policy.model.lora.rank=8"),
    ({"policy.megatron_config.context_parallel_size": 2}, "",
     "trainer.policy.megatron_config.context_parallel_size=2 with "
     "trainer.remove_microbatch_padding=false"),
    ({"policy.megatron_config.context_parallel_size": 2, "remove_microbatch_padding": True,
      "algorithm.policy_loss_type": "kl_cov"}, "", "clip_cov / kl_cov"),
    ({"algorithm.policy_loss_type": "rollout_is"}, "", "policy_loss_type='rollout_is'"),
    ({"algorithm.use_kl_loss": False}, "critical_kl_exponent=2.0",
     "GBC_SKYRL_OPTIONS: critical_kl_exponent: the loss has no KL term"),
    ({}, "nthr=maybe", "nthr"),
    ({}, "ar_alpha=nope", "ar_alpha"),
]


@pytest.mark.parametrize("trainer, options, match", REFUSALS)
def test_wrapper_refuses_what_it_cannot_honour(trainer, options, match, monkeypatch):
    """Each option gbc's Megatron wrapper does not run stops its construction, naming
    SkyRL's option (or gbc's method option), before SkyRL's own __init__ runs."""
    from test_skyrl import skyrl_cpu

    sky = skyrl_cpu().load()
    monkeypatch.setenv("GBC_SKYRL_OPTIONS", options)
    cls, cfg = _wrapper_cls_cfg(sky, **trainer)
    with pytest.raises(ValueError, match=match.replace(".", r"\.").replace("(", r"\(")):
        cls(cfg, [])


def test_wrapper_refuses_a_vlm_and_per_call_overrides(monkeypatch):
    from test_skyrl import skyrl_cpu

    sky = skyrl_cpu().load()
    monkeypatch.setenv("GBC_SKYRL_OPTIONS", "")
    cls, cfg = _wrapper_cls_cfg(sky)
    with pytest.raises(ValueError, match="vision-language"):
        cls(cfg, [], is_vlm=True)
    w = object.__new__(cls)
    w.cfg, w.gbc_options = cfg, sm_options()
    with pytest.raises(ValueError, match="loss_fn_config"):
        w.forward_backward_mini_batch([], 4, 1, loss_fn_config={"eps_clip_low": 0.1})
    w.gbc_options = sm_options("ar_alpha=0.5")
    with pytest.raises(ValueError, match="ar_alpha acts on RL advantages"):
        w.forward_backward_mini_batch([], 4, 1, loss_fn="cross_entropy")


def sm_options(text=""):
    from gbc_kernels.integrations.skyrl.worker import method_options

    return method_options(text)


def test_enable_puts_gbcs_megatron_workers_in_place(monkeypatch):
    """Under trainer.strategy=megatron, enable() puts gbc's Megatron workers where SkyRL's
    BasePPOExp imports them from (SkyRL's own module, importable with megatron-bridge's
    names stood in for: tests/standins/megatron_bridge_cpu.py), the options in their Ray
    runtime environment; importing gbc's worker module (as Ray's worker processes do) puts
    gbc's methods on SkyRL's MegatronModelWrapper; a config gbc's wrapper cannot run stops
    enable(), naming the option."""
    import importlib

    from conftest import megatron_bridge_cpu
    from test_skyrl import _trainer_cfg, assert_gbc_actors, skyrl_cpu

    sky = skyrl_cpu().load()
    skyrl_cpu().entrypoint_imports()
    megatron_bridge_cpu().install()      # conftest removes it, SkyRL's module and gbc's
    from skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper import (
        MegatronModelWrapper)

    import gbc_kernels.integrations.skyrl as gsky

    skyrl_module = importlib.import_module(gsky.MEGATRON_WORKER)
    monkeypatch.delitem(sys.modules, "gbc_kernels.integrations.skyrl.megatron_worker",
                        raising=False)
    for name in ("__init__", "forward", "forward_backward_mini_batch"):
        monkeypatch.setattr(MegatronModelWrapper, name, MegatronModelWrapper.__dict__[name])
    monkeypatch.setattr(MegatronModelWrapper, "_gbc_patched", False, raising=False)
    monkeypatch.setattr(MegatronModelWrapper, "_gbc_skyrl_methods", None, raising=False)
    from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker
    for name in ("PolicyWorker", "RefWorker"):
        monkeypatch.setattr(fsdp_worker, name, getattr(fsdp_worker, name))
    monkeypatch.setenv("GBC_SKYRL_OPTIONS", "")
    monkeypatch.setenv("GBC_SKYRL", "")
    stock_forward = MegatronModelWrapper.forward

    cfg = _trainer_cfg(sky)
    cfg.strategy = "megatron"
    cfg.fused_lm_head_logprob = True
    with pytest.raises(ValueError, match="trainer.fused_lm_head_logprob"):
        gsky.enable(cfg)
    assert skyrl_module.PolicyWorker.__ray_metadata__.modified_class.__mro__[1] is (
        skyrl_module.MegatronPolicyWorkerBase)
    cfg.algorithm.use_kl_loss = False
    with pytest.raises(ValueError, match="critical_kl_exponent: the loss has no KL term"):
        gsky.enable(_megatron(cfg), critical_kl_exponent=2.0)
    cfg.algorithm.use_kl_loss = True

    opts = gsky.enable(_megatron(cfg), ar_alpha=0.25)
    assert opts.ar_alpha == 0.25
    from gbc_kernels.integrations.skyrl import megatron_worker as gw
    assert issubclass(gw.GBCMegatronPolicyWorker, skyrl_module.MegatronPolicyWorkerBase)
    assert issubclass(gw.GBCMegatronRefWorker, skyrl_module.MegatronRefWorkerBase)
    assert_gbc_actors(skyrl_module, gw.GBCMegatronPolicyWorker, gw.GBCMegatronRefWorker,
                      "ar_alpha=0.25")
    assert MegatronModelWrapper._gbc_patched
    assert MegatronModelWrapper.forward is not stock_forward
    assert MegatronModelWrapper.forward.__qualname__.startswith("_wrapper_methods")
    # gbc's subclass built after the patch stands on SkyRL's own methods, not on gbc's again
    from gbc_kernels.integrations.skyrl import megatron as sm
    assert sm._skyrl_methods(MegatronModelWrapper)["forward"] is stock_forward
    forward = sm.wrapper_class().forward
    assert forward is not MegatronModelWrapper.forward
    base = [c.cell_contents for c in forward.__closure__ if isinstance(c.cell_contents, dict)]
    assert [b["forward"] for b in base] == [stock_forward]


def _megatron(cfg):
    cfg.fused_lm_head_logprob = False
    return cfg


def test_mini_batch_packing_refused():
    """SkyRL's mini-batch packing (``sub_seq_lengths``: several sequences per row) stops gbc's
    head, naming it."""
    from types import SimpleNamespace

    from gbc_kernels.integrations.skyrl import megatron as sm

    data = dict(num_actions=2, sequences=torch.ones(1, 4, dtype=torch.long),
                attention_mask=torch.ones(1, 4, dtype=torch.long),
                packed_seq_params=SimpleNamespace(cu_seqlens_q_padded=torch.tensor([0, 2, 4])),
                sub_seq_lengths_list=[[2, 2]])
    with pytest.raises(ValueError, match="sub_seq_lengths"):
        sm._rows(torch.zeros(1, 4, 3), data)
