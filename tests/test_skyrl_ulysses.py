"""gbc's SkyRL workers under SkyRL's Ulysses sequence parallelism
(``trainer.policy.sequence_parallel_size`` / ``trainer.ref.sequence_parallel_size``), against
SkyRL's own stock worker at the same SP size, and against gbc's at SP 1.

What runs is SkyRL's: its ``HFModelWrapper.forward`` (packed micro-batches,
``trainer.remove_microbatch_padding``: ``ulysses_pad_and_slice_inputs``, its attention patch
``apply_monkey_patch`` — all-to-all over the SP group around transformers' flash-attention
forward — and ``gather_outputs_and_unpad``), its worker's step and loss. CPU bypasses: those of
tests/test_skyrl.py, and transformers' flash-attention functions are the varlen stand-in's
(``flash_on_cpu`` of tests/test_verl_ulysses.py, tests/standins/flash_attn). Two gloo ranks form
one SP group (one data-parallel rank); the model is FSDP2-sharded over both, as SkyRL's mesh
shards it over dp x sp.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

pytest.importorskip("skyrl")
pytest.importorskip("verl")      # tests/test_verl_ulysses.py's flash-attention set-up

from test_skyrl import (_compare, _grads, algorithm, make_batch, skyrl_cpu,  # noqa: E402
                        step_setup, tiny_qwen2)


def _setup(rank, world):
    """SkyRL's Ulysses group (the whole world) and attention patch, as its worker's
    ``init_model`` sets them; one single-rank data-parallel group per rank."""
    import torch.distributed as dist

    sky = skyrl_cpu().load()
    from skyrl.backends.skyrl_train.distributed.ulysses import (apply_monkey_patch,
                                                                set_ulysses_sequence_parallel_group)
    from test_verl_ulysses import flash_on_cpu

    dp = [dist.new_group([r]) for r in range(world)][rank]
    set_ulysses_sequence_parallel_group(dist.group.WORLD)
    fa = flash_on_cpu()
    apply_monkey_patch(model=tiny_qwen2(), ulysses_sp_size=world)
    return sky, dp, fa.seen


def _worker(sky, cls, a, sp, dp, options=None, micro=2):
    """A policy (or reference) worker at SP ``sp`` (the model FSDP2-sharded over the SP group)
    or SP 1 (this rank alone, unsharded)."""
    import torch.distributed as dist

    model = tiny_qwen2()
    if sp > 1:
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    w = skyrl_cpu().policy_worker(cls, a, model, world=sp, micro=micro, packed=True, sp=sp,
                                  groups={"dp": dp, "sp": dist.group.WORLD if sp > 1 else dp})
    if sp > 1:       # SkyRL's Ulysses patch sits on transformers' flash-attention forward
        model.config._attn_implementation = "flash_attention_2"
    if options is not None:
        w._gbc_options = options
    return w, model


def _step(sky, sp, dp, loss_type, gbc_on, kw):
    from gbc_kernels.integrations.skyrl.worker import KL_WEIGHT_KEY

    a, cls, opts = step_setup(sky, loss_type, gbc_on, kw)
    w, model = _worker(sky, cls, a, sp, dp, opts if gbc_on else None)
    data = make_batch(sky, kw.get("seed", 100), B=kw.get("B", 4), kl=kw.get("kl", True),
                      rollout=kw.get("rollout", False))      # the same batch on every SP rank
    if "critical_kl_exponent" in kw.get("methods", {}):
        g = torch.Generator().manual_seed(5)
        data[KL_WEIGHT_KEY] = torch.rand(data["loss_mask"].shape, generator=g) + 0.5
    with skyrl_cpu().cpu_device():
        torch.manual_seed(3)
        out = w.forward_backward(data, loss_fn=kw.get("loss_fn"))
        grads = _grads(model, sp)
        fwd = w.forward(data)
    return dict(metrics=out.metrics, outputs=out.loss_fn_outputs, grads=grads,
                old=[r["logprobs"] for r in fwd.loss_fn_outputs])


def _ref_pass(sky, sp, dp, gbc_on, options):
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from gbc_kernels.integrations.skyrl.worker import KL_WEIGHT_KEY
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPRefWorkerBase

    cls = gfsdp.GBCFSDPRefWorker if gbc_on else FSDPRefWorkerBase
    w, _ = _worker(sky, cls, algorithm(sky, "regular"), sp, dp, options if gbc_on else None,
                   micro=3)
    with skyrl_cpu().cpu_device():
        rows = w.forward(make_batch(sky, 9, B=5)).loss_fn_outputs
    return ([r["logprobs"] for r in rows],
            [r[KL_WEIGHT_KEY] for r in rows] if KL_WEIGHT_KEY in rows[0] else None)


def _nthr_step(sky, sp, dp):
    """NTHR through SkyRL's flow: the old-log-prob pass (which keeps NTHR's rows), then the
    update of the same mini-batch; groups split so that a response sits on both SP ranks."""
    from test_skyrl_methods import nthr_batch

    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from gbc_kernels.integrations.skyrl.worker import SCALE_KEY

    w, model = _worker(sky, gfsdp.GBCFSDPPolicyWorker,
                       algorithm(sky, "regular", use_kl_loss=False), sp, dp,
                       methods.MethodOptions(nthr=True, nthr_beta=0.0))
    data = nthr_batch(sky)
    with skyrl_cpu().cpu_device():
        old = w.forward(data)
        data["action_log_probs"] = torch.tensor([r["logprobs"] for r in old.loss_fn_outputs])
        res = w.forward_backward(data)
        grads = _grads(model, sp)
        fwd = w.forward(data)
    return dict(metrics=res.metrics, outputs=res.loss_fn_outputs, grads=grads,
                old=[r["logprobs"] for r in fwd.loss_fn_outputs], scale=data[SCALE_KEY])


def _sp_worker(rank, world, cases, methods_cases):
    """Per case: (gbc's SP 2, SkyRL's SP 2, gbc's SP 1) steps; per method case: (gbc's SP 2,
    gbc's SP 1); the reference worker's pass: (gbc's SP 2, SkyRL's SP 2, gbc's SP 2 with
    critical-token KL, gbc's SP 1 with it)."""
    from gbc_kernels import methods

    sky, dp, seen = _setup(rank, world)
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    out = [(_step(sky, world, dp, lt, True, kw), _step(sky, world, dp, lt, False, kw),
            _step(sky, 1, dp, lt, True, kw)) for lt, kw in cases]
    meth = [(_step(sky, world, dp, "regular", True, kw), _step(sky, 1, dp, "regular", True, kw))
            for kw in methods_cases]
    crit = methods.MethodOptions(critical_kl_exponent=2.0)
    ref = (_ref_pass(sky, world, dp, True, None), _ref_pass(sky, world, dp, False, None),
           _ref_pass(sky, world, dp, True, crit), _ref_pass(sky, 1, dp, True, crit))
    refused = []
    w, _ = _worker(sky, gfsdp.GBCFSDPPolicyWorker, algorithm(sky, "clip_cov"), world, dp,
                   methods.MethodOptions())
    try:
        with skyrl_cpu().cpu_device():
            w.forward_backward(make_batch(sky, 100))
    except ValueError as err:
        refused.append(str(err))
    nthr = (_nthr_step(sky, world, dp), _nthr_step(sky, 1, dp))
    return out, meth, ref, list(seen), refused, nthr


CASES = [("regular", {}), ("gspo", dict(rollout=True, kl_type="k1")),
         ("sapo", dict(ent=False, kl_type="k2", seed=7, B=5)), ("cispo", dict(kl=False)),
         ("regular", dict(loss_fn="cross_entropy"))]
METHODS = [dict(methods=dict(ar_alpha=0.3)), dict(methods=dict(lopti_eta=0.5)),
           dict(methods=dict(critical_kl_exponent=2.0))]


def test_ulysses_sp2_equals_skyrl_sp2_and_sp1():
    """trainer.policy.sequence_parallel_size=2 on SkyRL's packed micro-batches: gbc's step
    equals SkyRL's own step at SP 2 — every metric (losses, entropy, KL, clip ratio), the
    per-token log-probs of the step and of the no-grad pass, every parameter's gradient — on
    both SP ranks, for several loss types (GSPO's sequence ratio and the off-policy correction
    among them) and SkyRL's SFT loss; and gbc's SP 2 equals its SP 1 (one rank, unsharded). AR,
    Lopti, critical-token KL and NTHR (its old-log-prob pass keeping the whole micro-batch's
    rows on every SP rank) at SP 2 equal gbc's SP 1. The reference worker's pass at SP 2
    equals SkyRL's, and with critical-token KL its log-probs and weights equal SP 1's.
    Clip-Cov's loss is refused at SP 2 when it runs."""
    from conftest import spawn_gloo

    for out, meth, ref, seen, refused, nthr in spawn_gloo(2, _sp_worker, CASES, METHODS):
        # SkyRL's Ulysses attention ran (flash-attention's varlen kernel on the packed stream
        # gathered over the SP group: padded to an even length); SP 1 runs another attention
        assert seen and all(n % 2 == 0 for n in seen), seen
        # at run time: Clip-Cov's loss at SP 2, by name
        assert len(refused) == 1 and refused[0].startswith(
            "trainer.algorithm.policy_loss_type: clip_cov / kl_cov"), refused
        # NTHR: the scales from the whole micro-batch's rows (not all 1), the step, SP 2 == SP 1
        torch.testing.assert_close(nthr[0]["scale"], nthr[1]["scale"], rtol=1e-5, atol=1e-6)
        assert (nthr[0]["scale"] != 1).any()
        got, one = nthr
        assert set(got["metrics"]) == set(one["metrics"])
        for k, v in one["metrics"].items():
            assert got["metrics"][k] == pytest.approx(v, rel=2e-4, abs=2e-6), k
        torch.testing.assert_close(torch.tensor(got["old"]), torch.tensor(one["old"]),
                                   rtol=2e-4, atol=2e-6)
        for name, grad in one["grads"].items():
            assert grad.abs().sum() > 0, name
            torch.testing.assert_close(got["grads"][name], grad, rtol=2e-4, atol=2e-6, msg=name)
        for got, sky_ref, one in out:
            _compare(got, sky_ref)
            _compare(got, one)
        for got, one in meth:
            _compare(got, one)
        (g_lp, _), (s_lp, _), (c_lp, c_w), (o_lp, o_w) = ref
        torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(s_lp), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(c_lp), torch.tensor(o_lp), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(c_w), torch.tensor(o_w), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(torch.tensor(c_w), torch.ones(len(c_w), len(c_w[0])))


# ---- refusals ----------------------------------------------------------------------------------
def _cfg(sky, **kw):
    from skyrl.train.config.config import TrainerConfig

    cfg = TrainerConfig()
    cfg.algorithm.temperature = 1.0
    for k, v in kw.items():
        obj, _, name = k.rpartition("__")
        setattr(getattr(cfg, obj) if obj else cfg, name, v)
    return cfg


@pytest.mark.parametrize("kw, options, match", [
    (dict(policy__sequence_parallel_size=2, remove_microbatch_padding=False), "",
     "^trainer.policy.sequence_parallel_size=2 with trainer.remove_microbatch_padding=false"),
    (dict(ref__sequence_parallel_size=2, remove_microbatch_padding=False), "",
     "^trainer.ref.sequence_parallel_size=2 with trainer.remove_microbatch_padding=false"),
    (dict(policy__sequence_parallel_size=2, algorithm__policy_loss_type="clip_cov"), "",
     "^trainer.algorithm.policy_loss_type: clip_cov / kl_cov"),
    (dict(policy__sequence_parallel_size=2, algorithm__policy_loss_type="kl_cov"), "",
     "sequence_parallel_size=2"),
])
def test_ulysses_refusals_name_skyrls_options(kw, options, match):
    """What gbc's workers do not run under Ulysses SP is refused by name when SkyRL builds
    them: the padded layout, Clip-Cov / KL-Cov; SP 2 on packed micro-batches with a plain loss
    and the methods is accepted."""
    from gbc_kernels.integrations.skyrl import worker

    sky = skyrl_cpu().load()
    with pytest.raises(ValueError, match=match):
        worker.check_config(_cfg(sky, **kw), worker.method_options(options))
    worker.check_config(_cfg(sky, policy__sequence_parallel_size=2, ref__sequence_parallel_size=2),
                        worker.method_options("ar_alpha=0.3,lopti_eta=0.5,nthr=1"))


def test_ulysses_refusals_at_run_time():
    """A wrapped model at SP 2 on padded micro-batches is refused when it runs, naming the
    worker's option (Clip-Cov's loss at SP 2 when it runs: the SP test)."""
    from types import SimpleNamespace

    from gbc_kernels.integrations.skyrl import worker

    skyrl_cpu().load()
    padded = SimpleNamespace(sequence_parallel_size=2, remove_microbatch_padding=False)
    with pytest.raises(ValueError, match="^trainer.ref.sequence_parallel_size=2 with trainer."
                                         "remove_microbatch_padding=false"):
        worker._sp_group(padded, "trainer.ref.sequence_parallel_size")
    assert worker._sp_group(SimpleNamespace(sequence_parallel_size=1), "x") is None


def test_ulysses_size_not_dividing_the_heads_refused():
    """An SP size that does not divide the attention heads (the tiny Qwen2: 4 heads, 2 KV
    heads) is refused in SkyRL's init_model, before SkyRL's own assertion, naming the worker's
    option; SkyRL itself refuses the same sizes (an AssertionError in its attention patch)."""
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp

    skyrl_cpu().load()
    from skyrl.backends.skyrl_train.distributed.ulysses import apply_monkey_patch

    model = tiny_qwen2()
    for cls, option in ((gfsdp.GBCFSDPPolicyWorker, "trainer.policy.sequence_parallel_size"),
                        (gfsdp.GBCFSDPRefWorker, "trainer.ref.sequence_parallel_size")):
        for sp in (3, 8):
            w = cls.__new__(cls)
            w.sequence_parallel_size = sp
            with pytest.raises(ValueError, match=f"^{option}: {sp} must divide the model's 4 "
                                                 f"attention heads"):
                w._seq_parallel_monkey_patch(model)
            with pytest.raises(AssertionError):
                apply_monkey_patch(model=model, ulysses_sp_size=sp)
