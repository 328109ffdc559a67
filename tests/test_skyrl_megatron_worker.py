"""gbc's Megatron workers on SkyRL 0.3.0 (``GBCMegatronPolicyWorker`` / ``GBCMegatronRefWorker``,
gbc_kernels.integrations.skyrl.megatron_worker, docs/skyrl.md "Megatron") against SkyRL's own
Megatron workers (``MegatronPolicyWorkerBase`` / ``MegatronRefWorkerBase``), each running its
REAL worker methods on the same tiny megatron-core GPTModel and the same SkyRL
``TrainingInputBatch``: ``forward_backward`` (its micro-batching by sample count or by tokens,
``_pad_microbatch_to_size``, metric reduction and all-reduce), ``optim_step``, ``forward`` /
``_forward_logprobs`` (the token-based reorder). Two gloo ranks at tensor parallel 2 (with and
without sequence parallelism), pipeline parallel 2 (megatron's 1F1B schedule over gloo's
point-to-point ops), data parallel 2 (each rank its own batch); four ranks at pipeline 2 ×
tensor parallel 2. A float64 model (SkyRL's head casts the logits to float32: agreement to
1e-5, relative to a gradient's largest entry).

SkyRL's worker module imports on CPU with megatron-bridge's three names stood in for
(tests/standins/megatron_bridge_cpu.py). The workers are built without Ray and without
``init_model`` (it loads HF weights through megatron-bridge's ``AutoBridge``):
:func:`make_worker` sets by hand what the worker methods read (listed there). The model is
tests/test_skyrl_megatron.py's (``_model``: the CPU-shimmed GPTModel, SkyRL's padding mask
replaced by the causal mask, exact for the valid rows). Stand-ins, said here: the chunk is bare
(no megatron DDP, which ``forward_backward``'s ``chunk.zero_grad_buffer()`` belongs to: the
bare chunk gets that method, zeroing its gradients); megatron's optimizer needs DDP's grad
buffers, so the optimizer is :class:`StandInOptimizer` (megatron's optimizer interface as
SkyRL's worker and strategy call it, over SGD); the schedule's ``finalize_model_grads`` is the
sequence-parallel norms' gradient all-reduce only (as test_skyrl_megatron.py).

Stock side: SkyRL's worker class with SkyRL's own wrapper methods. gbc side: gbc's worker
class with SkyRL's ``MegatronModelWrapper`` as gbc's worker module leaves it (gbc's methods put
on it when that module is imported, the class ``init_model`` builds by name). Both live in one
process: :func:`skyrl_megatron` keeps SkyRL's own wrapper methods (taken before gbc's module is
imported) in a subclass for the stock side.

Harness for method tests (run inside a :func:`conftest.spawn_gloo` child): ``cfg =
worker_cfg(sky, "regular", use_kl_loss=True, ...)``; ``stock, ours = worker_pair(cfg,
options="ar_alpha=0.3")``; ``data = training_batch(11)``; for the stock side apply the method
by hand to the batch (e.g. ``data["advantages"] = ...``); ``run_worker_step(stock, data,
training_batch(12))`` / ``run_worker_step(ours, training_batch(11), training_batch(12))``;
in the parent ``assert_same_step(stock_result, ours_result, what)``.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("skyrl")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import megatron_bridge_cpu, spawn_gloo  # noqa: E402
from test_skyrl_megatron import (_cfg, _close, _grads, _micro_batches,  # noqa: E402
                                 _model, _same_metric)
from test_verl_megatron import _SGD  # noqa: E402

WRAPPER_METHODS = ("__init__", "forward", "forward_backward_mini_batch")
_MODULES = None


def skyrl_megatron():
    """SkyRL on CPU (tests/standins/skyrl_cpu.py), megatron-bridge's stand-in, SkyRL's Megatron
    worker module and gbc's (imported in that order, once per process). Returns a namespace:
    ``sky`` (skyrl_cpu's modules), ``skyrl`` (SkyRL's megatron_worker module), ``gbc`` (gbc's),
    ``wrapper`` (SkyRL's ``MegatronModelWrapper``, carrying gbc's methods once gbc's module is
    imported) and ``stock_wrapper`` (a subclass of it with SkyRL's own ``__init__``,
    ``forward``, ``forward_backward_mini_batch``, taken before that import)."""
    global _MODULES
    if _MODULES is None:
        from test_skyrl import skyrl_cpu

        sky = skyrl_cpu().load()
        skyrl_cpu().entrypoint_imports()
        megatron_bridge_cpu().install()
        megatron_bridge_cpu().packed_seq_params_total_tokens()
        from skyrl.backends.skyrl_train.workers.megatron import megatron_worker as skw
        from skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper import (
            MegatronModelWrapper)

        if getattr(MegatronModelWrapper, "_gbc_patched", False):
            raise RuntimeError("skyrl_megatron: SkyRL's MegatronModelWrapper already carries "
                               "gbc's methods; call skyrl_megatron() before importing "
                               "gbc_kernels.integrations.skyrl.megatron_worker")
        stock = type("SkyRLMegatronModelWrapper", (MegatronModelWrapper,),
                     {k: MegatronModelWrapper.__dict__[k] for k in WRAPPER_METHODS})
        from gbc_kernels.integrations.skyrl import megatron_worker as gw

        assert MegatronModelWrapper._gbc_patched
        _MODULES = types.SimpleNamespace(sky=sky, skyrl=skw, gbc=gw,
                                         wrapper=MegatronModelWrapper, stock_wrapper=stock)
    return _MODULES


def worker_cfg(sky, loss_type="regular", packed=False, temperature=1.0, micro=4, max_tokens=0,
               **algo):
    """SkyRL's ``trainer`` config (``TrainerConfig``: what the Megatron workers read as
    ``self.cfg``): ``loss_type`` and ``algo`` in its algorithm section (tests/test_skyrl.py's
    ``algorithm``), ``trainer.remove_microbatch_padding=packed``, ``trainer.algorithm.
    temperature``, ``micro`` sequences per training and forward micro-batch,
    ``trainer.max_tokens_per_microbatch=max_tokens`` (> 0: SkyRL's token-based micro-batches)."""
    cfg = _cfg(sky, loss_type, packed, **algo)
    cfg.algorithm.temperature = temperature
    cfg.micro_train_batch_size_per_gpu = micro
    cfg.micro_forward_batch_size_per_gpu = micro
    cfg.max_tokens_per_microbatch = max_tokens
    return cfg


def training_batch(seed, n=2, B=3, P=5, T=6):
    """SkyRL's ``TrainingInputBatch`` as its trainer stages it for the policy worker
    (``n * B`` sequences: tests/test_skyrl_megatron.py's ``_micro_batches(seed, n, B, P, T)``
    concatenated, float64): ``sequences``, ``attention_mask`` (left-padded prompts,
    right-padded responses), ``response_mask``, ``loss_mask`` (one empty row),
    ``advantages``, ``action_log_probs``, ``base_action_log_probs``, ``rollout_logprobs``;
    metadata ``response_length=T``. Fields can be edited before a step (a method by hand)."""
    from test_skyrl import skyrl_cpu

    skyrl_cpu().load()
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

    mbs = _micro_batches(seed, n, B, P, T)
    fields = {"sequences": "sequences", "attention_mask": "attention_mask",
              "response_mask": "action_mask", "loss_mask": "loss_mask",
              "advantages": "advantages", "action_log_probs": "old_action_log_probs",
              "base_action_log_probs": "base_action_log_probs",
              "rollout_logprobs": "rollout_action_logprobs"}
    batch = TrainingInputBatch({k: torch.cat([mb[v] for mb in mbs]).contiguous()
                                for k, v in fields.items()})
    batch.metadata = {"response_length": T}
    return batch


class StandInOptimizer(_SGD):
    """megatron's optimizer as SkyRL's Megatron worker, wrapper and strategy call it: tests/
    test_verl_megatron.py's ``_SGD`` (``step()`` → ``(success, grad_norm, None)``, the norm of
    this rank's gradients, ``zero_grad``) with ``param_groups`` (the worker reports the
    learning rate) and ``scale_loss`` (the wrapper hands it to the schedule; the identity, as
    megatron's float32 optimizers' loss scale is 1). megatron's own optimizer needs its DDP's
    grad buffers, which the bare CPU chunks lack."""

    def __init__(self, chunks, lr=0.5):
        super().__init__(list(chunks), lr)
        self.param_groups = self.opt.param_groups

    def scale_loss(self, loss):
        return loss


def _zero_grad_buffer(chunk):
    """The bare chunk's stand-in for DDP's ``zero_grad_buffer`` (SkyRL's ``forward_backward``
    calls it on every chunk): its gradients zeroed."""
    chunk.zero_grad_buffer = lambda: chunk.zero_grad(set_to_none=True)


def make_worker(kind, gbc, cfg, chunks, options="", lr=0.5):
    """A SkyRL Megatron worker object around ``chunks`` (this rank's model chunks), without Ray
    or ``init_model``. ``kind``: "policy" (SkyRL's ``MegatronPolicyWorkerBase``; gbc's
    ``GBCMegatronPolicyWorker`` when ``gbc``) or "ref" (``MegatronRefWorkerBase`` /
    ``GBCMegatronRefWorker``). Set by hand, as ``init_model`` / ``init_worker_process_group``
    leave them: ``cfg`` (:func:`worker_cfg`), ``actor_module`` (each chunk given
    ``zero_grad_buffer``), ``model`` (the wrapper: :func:`skyrl_megatron`'s ``stock_wrapper``
    or, for gbc, SkyRL's ``MegatronModelWrapper`` carrying gbc's methods, built as
    ``init_model`` builds it, with ``GBC_SKYRL_OPTIONS=options`` set), ``strategy``
    (SkyRL's ``MegatronStrategy`` over the default process group), ``enable_router_replay``,
    ``empty_cuda_cache``, ``is_vlm``, ``profiler``; a policy worker also ``optimizer``
    (:class:`StandInOptimizer`), ``scheduler`` (a constant one), ``policy_loss_fn``. The
    wrapper's ``finalize_model_grads`` is the sequence-parallel norms' all-reduce."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from skyrl.backends.skyrl_train.distributed.megatron.megatron_strategy import (
        MegatronStrategy)
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    from test_verl_megatron import _mc

    m = skyrl_megatron()
    policy = {"policy": True, "ref": False}[kind]
    if policy:
        cls = m.gbc.GBCMegatronPolicyWorker if gbc else m.skyrl.MegatronPolicyWorkerBase
    else:
        cls = m.gbc.GBCMegatronRefWorker if gbc else m.skyrl.MegatronRefWorkerBase
    w = object.__new__(cls)
    w.cfg = cfg
    w.actor_module = list(chunks)
    for chunk in w.actor_module:
        _zero_grad_buffer(chunk)
    w.enable_router_replay = False
    w.enable_sample_support_replay = False
    w.empty_cuda_cache = False
    w.is_vlm = False
    w.profiler = None
    w._micro_batches_accumulated = 0
    w.strategy = MegatronStrategy(megatron_config=cfg.policy.megatron_config)
    w.strategy.world_size = dist.get_world_size()
    w.gbc_test_options = options if gbc else ""
    os.environ["GBC_SKYRL_OPTIONS"] = w.gbc_test_options
    if gbc:             # its options now, not at its first call (a later worker resets the env)
        from gbc_kernels.integrations.skyrl.worker import method_options
        w._gbc_options = method_options(options)
    wrapper = m.wrapper if gbc else m.stock_wrapper
    if policy:
        w.optimizer = StandInOptimizer(w.actor_module, lr)
        w.scheduler = types.SimpleNamespace(step=lambda increment=1: None)
        w.policy_loss_fn = PolicyLossRegistry.get(cfg.algorithm.policy_loss_type)
        w.model = wrapper(config=cfg, actor_module=w.actor_module, actor_optimizer=w.optimizer,
                          policy_loss_fn=w.policy_loss_fn, is_vlm=False)
    else:
        w.optimizer = w.scheduler = None
        w.model = wrapper(config=cfg, actor_module=w.actor_module, is_vlm=False)
    group = mpu.get_tensor_model_parallel_group()
    sync = lambda models, *a, **k: [_mc().allreduce_sp_norm_grads(c, group) for c in models]
    if hasattr(w.model, "run_pending_grad_sync"):     # SkyRL 0.4: deferred to optim_step
        import sys as _s
        _s.modules[type(w.model).__module__].finalize_model_grads_with_expert_adapter_sync = sync
    else:
        for chunk in w.actor_module:    # after the wrapper (it sets megatron's, which needs DDP)
            chunk.config.finalize_model_grads_func = sync
    return w


def worker_pair(cfg, kind="policy", options="", tp=2, sp=False, pp=1, lr=0.5, cp=1):
    """(SkyRL's worker, gbc's worker) of ``kind`` (:func:`make_worker`), each on a fresh copy
    of the same model (tests/test_skyrl_megatron.py's ``_model``: tensor parallel ``tp``,
    sequence parallel ``sp``, pipeline parallel ``pp``; the packed-attention model when
    ``cfg.remove_microbatch_padding``, context parallel ``cp`` there); ``options``: gbc's
    ``GBC_SKYRL_OPTIONS``. Rebuilding
    the model re-initialises megatron's groups: build a pair, run it, then build the next."""
    packed = bool(cfg.remove_microbatch_padding)
    cfg.policy.megatron_config.context_parallel_size = cp
    return tuple(make_worker(kind, gbc, cfg, [_model(tp, sp, packed, pp, cp)], options, lr)
                 for gbc in (False, True))


def _recording_loss_masks(worker, call):
    """``call()``'s result and the loss masks of the micro-batches the worker handed its
    wrapper's ``forward_backward_mini_batch`` (in their order: the rows of its
    ``loss_fn_outputs``)."""
    seen = []
    step = worker.model.forward_backward_mini_batch

    def recording(micro_batches, *args, **kwargs):
        seen.extend(mb["loss_mask"].detach().cpu() for mb in micro_batches)
        return step(micro_batches, *args, **kwargs)

    worker.model.forward_backward_mini_batch = recording
    try:
        res = call()
    finally:
        del worker.model.forward_backward_mini_batch
    return res, torch.cat(seen)


def run_worker_step(worker, data=None, forward_data=None, optim=True, loss_data=None,
                    loss_fn=None):
    """Run the worker's methods as SkyRL's trainer calls them (``GBC_SKYRL_OPTIONS`` the
    worker's): a policy worker's ``forward_backward(data)`` (then, with ``optim``,
    ``optim_step()``), its loss-only pass ``forward(loss_data, loss_fn=loss_fn)`` (SkyRL's
    ``forward_backward_mini_batch(forward_only=True)``), and ``forward(forward_data)`` (the
    no-grad log-prob pass; a reference worker's only method here). Returns a dict of what ran:
    ``metrics``, ``loss_fn_outputs``, ``grads`` (every parameter's gradient after the step, by
    name), ``loss_masks`` (the loss masks of the micro-batches the worker handed its wrapper,
    in their order: the rows of ``loss_fn_outputs``), ``grad_norm`` and ``params`` (after
    ``optim_step``), ``loss_only`` (the loss-only pass's ``metrics``, ``loss_fn_outputs``,
    ``loss_masks``), ``logp`` (``forward``'s per-sequence log-probs, a list of lists),
    ``last`` (this rank is the last pipeline stage)."""
    from megatron.core import parallel_state as mpu

    from test_skyrl import skyrl_cpu

    os.environ["GBC_SKYRL_OPTIONS"] = worker.gbc_test_options
    out = {"last": mpu.is_pipeline_last_stage(ignore_virtual=True)}
    with skyrl_cpu().cpu_device():
        if data is not None:
            res, out["loss_masks"] = _recording_loss_masks(
                worker, lambda: worker.forward_backward(data))
            out.update(metrics=res.metrics, loss_fn_outputs=res.loss_fn_outputs,
                       grads={n: g for c in worker.actor_module for n, g in _grads(c).items()})
            if len(res.loss_fn_outputs) != out["loss_masks"].shape[0]:   # 0.4: input order
                out["output_masks"] = data["loss_mask"].detach().cpu()
            if optim:
                norm = worker.optim_step()
                out["grad_norm"] = norm
                out["params"] = {n: p.detach().clone() for c in worker.actor_module
                                 for n, p in c.named_parameters()}
        if loss_data is not None:
            res, masks = _recording_loss_masks(
                worker, lambda: worker.forward(loss_data, loss_fn=loss_fn))
            out["loss_only"] = dict(metrics=res.metrics, loss_fn_outputs=res.loss_fn_outputs,
                                    loss_masks=masks)
        if forward_data is not None:
            res = worker.forward(forward_data)
            out["logp"] = [r["logprobs"] for r in res.loss_fn_outputs]
            assert res.metrics == {}
    return out


def _close_scaled(a, b, what, tol=1e-5):
    """:func:`_close` with the absolute tolerance scaled by ``b``'s largest entry (gradients of
    SkyRL's scaled loss reach tens; SkyRL's float32 logits round relative to that)."""
    assert a.shape == b.shape, (what, a.shape, b.shape)
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol / 10 * scale,
                               msg=what)


def _loss_fn_outputs(stock, ours, loss_masks, what):
    """SkyRL's per-sequence outputs (row ``i``: the last ``n`` of the ``T`` response positions,
    ``n`` from its response mask): the same rows and lengths, SkyRL's without NaN; gbc's
    log-probs NaN exactly outside the loss mask (``loss_masks``: the rows' masks), equal to
    SkyRL's everywhere else."""
    assert len(stock) == len(ours) == loss_masks.shape[0] > 0, what
    for i, (s, o) in enumerate(zip(stock, ours)):
        assert s.keys() == o.keys(), (what, i)
        for k in s:
            y = torch.tensor(s[k], dtype=torch.float64)
            x = torch.tensor(o[k], dtype=torch.float64)
            assert x.shape == y.shape and not torch.isnan(y).any(), (what, i, k)
            keep = ~torch.isnan(x)
            if k == "logprobs" and len(x):
                assert torch.equal(keep, loss_masks[i, -len(x):] > 0), (what, i, keep)
            _close(x[keep], y[keep], f"{what} loss_fn_outputs[{i}].{k}")


def _same_outputs(stock, ours, what):
    ms, mg = stock["metrics"], ours["metrics"]
    assert ms.keys() == mg.keys(), (what, ms.keys() ^ mg.keys())
    assert "policy_loss" in ms or "loss" in ms, (what, sorted(ms))
    for k in ms:
        _same_metric(ms[k], mg[k], f"{what} metric {k}")
    assert torch.equal(stock["loss_masks"], ours["loss_masks"]), what
    masks = stock.get("output_masks", stock["loss_masks"])
    _loss_fn_outputs(stock["loss_fn_outputs"], ours["loss_fn_outputs"], masks, what)


def assert_same_step(stock, ours, what):
    """gbc's :func:`run_worker_step` result == SkyRL's: every metric SkyRL's worker returns
    (same keys), ``loss_fn_outputs``, every parameter's gradient (some nonzero), the optimizer
    step's gradient norm and parameters, the loss-only pass's metrics and ``loss_fn_outputs``,
    ``forward``'s log-probs (on a stage before the last,
    SkyRL's placeholder, the same on both)."""
    assert stock.keys() == ours.keys(), what
    if "loss_only" in stock:
        _same_outputs(stock["loss_only"], ours["loss_only"], f"{what} loss-only")
    if "metrics" in stock:
        _same_outputs(stock, ours, what)
        assert stock["grads"].keys() == ours["grads"].keys() and stock["grads"], what
        assert float(sum(g.abs().sum() for g in ours["grads"].values())) > 0, what
        for k in stock["grads"]:
            _close_scaled(ours["grads"][k], stock["grads"][k], f"{what} grad {k}")
    if "params" in stock:
        assert stock["grad_norm"] == pytest.approx(ours["grad_norm"], rel=1e-5), what
        for k in stock["params"]:
            _close_scaled(ours["params"][k], stock["params"][k], f"{what} param {k}")
    if "logp" in stock:
        assert len(stock["logp"]) == len(ours["logp"]) > 0, what
        for i, (s, o) in enumerate(zip(stock["logp"], ours["logp"])):
            _close(torch.tensor(o, dtype=torch.float64), torch.tensor(s, dtype=torch.float64),
                   f"{what} forward log-probs [{i}]")
        if stock["last"]:
            assert any(abs(v) > 0 for row in stock["logp"] for v in row), what


# ---- the cases ---------------------------------------------------------------------------

KL_ENTROPY = dict(use_kl_loss=True, kl_loss_coef=0.2, kl_estimator_type="k3",
                  use_entropy_loss=True, entropy_loss_coef=0.03)
# name: (kind, worker_cfg keywords, worker_pair keywords)
CASES = {
    "padded": ("policy", dict(micro=4, **KL_ENTROPY), {}),
    "packed_sp": ("policy", dict(packed=True, micro=4, temperature=0.8, **KL_ENTROPY),
                  dict(sp=True)),
    "tokens_padded": ("policy", dict(micro=4, max_tokens=14, **KL_ENTROPY), {}),
    "tokens_packed": ("policy", dict(packed=True, max_tokens=14, **KL_ENTROPY), {}),
    "loss_only_cross_entropy": ("policy", dict(micro=4), {}, dict(loss_fn="cross_entropy")),
    "loss_only_regular_packed": ("policy", dict(packed=True, micro=4, **KL_ENTROPY), {},
                                 dict(loss_fn="regular")),
    "ref": ("ref", dict(micro=4), {}),
    "ref_tokens_packed": ("ref", dict(packed=True, max_tokens=14, temperature=0.8), {}),
}
# the comparison's control: gbc's worker runs AR (``ar_alpha``), SkyRL's the plain advantages
CONTROL_CASES = {
    "control_ar_not_by_hand": ("policy", dict(micro=4, **KL_ENTROPY),
                               dict(options="ar_alpha=0.4")),
}
PIPELINE_CASES = {
    "pp2": ("policy", dict(micro=3, **KL_ENTROPY), dict(tp=1, pp=2)),
    "pp2_tokens": ("policy", dict(micro=3, max_tokens=14, **KL_ENTROPY), dict(tp=1, pp=2)),
    "pp2_ref": ("ref", dict(micro=3), dict(tp=1, pp=2)),
}
# data parallel 2: each rank its own batch (sample-based micro-batches: SkyRL's token-based
# padding micro-batches draw token ids up to 100, beyond the tiny model's vocabulary)
DP_CASES = {
    "dp2": ("policy", dict(micro=2, **KL_ENTROPY), dict(tp=1), dict(per_rank=True)),
    "dp2_packed": ("policy", dict(packed=True, micro=4, temperature=0.8, **KL_ENTROPY),
                   dict(tp=1), dict(per_rank=True)),
}
# context parallel 2 (packed only): each rank 2 of every sequence's 4 chunks
CP_CASES = {
    "cp2_packed": ("policy", dict(packed=True, micro=4, temperature=0.8, **KL_ENTROPY),
                   dict(tp=1, cp=2)),
    "cp2_gspo": ("policy", dict(loss_type="gspo", packed=True, micro=4), dict(tp=1, cp=2)),
    "cp2_tokens": ("policy", dict(packed=True, max_tokens=14, **KL_ENTROPY), dict(tp=1, cp=2)),
    "cp2_ref": ("ref", dict(packed=True, micro=4), dict(tp=1, cp=2)),
}
PP_TP_CASES = {
    "pp2_tp2_sp": ("policy", dict(micro=3, **KL_ENTROPY), dict(tp=2, sp=True, pp=2)),
}


def _cases_worker(rank, world, cases):
    sky = skyrl_megatron().sky
    out = {}
    for name, (kind, cfg_kw, pair_kw, *data_kw) in cases.items():
        seed = 11 + (100 * rank if data_kw and data_kw[0].get("per_rank") else 0)
        cfg = worker_cfg(sky, **cfg_kw)
        pair = worker_pair(cfg, kind, **pair_kw)
        loss_fn = data_kw[0].get("loss_fn") if data_kw else None
        train = kind == "policy" and loss_fn is None
        out[name] = [run_worker_step(w, training_batch(seed) if train else None,
                                     training_batch(seed + 1, n=3),
                                     loss_data=training_batch(seed) if loss_fn else None,
                                     loss_fn=loss_fn) for w in pair]
    os.environ.pop("GBC_SKYRL_OPTIONS", None)
    return out


@pytest.fixture(scope="module")
def stepped():
    return spawn_gloo(2, _cases_worker, {**CASES, **CONTROL_CASES})


@pytest.fixture(scope="module")
def two_ranks():
    """The pipeline and data-parallel cases: one spawn of two ranks."""
    return spawn_gloo(2, _cases_worker, {**PIPELINE_CASES, **DP_CASES})


@pytest.mark.parametrize("name", sorted(CASES))
def test_worker_step_equals_skyrls_worker(stepped, name):
    """Tensor parallel 2: SkyRL's worker methods on gbc's workers == on SkyRL's (loss and every
    metric, loss_fn_outputs, every gradient, the optimizer step, the no-grad forward's
    log-probs), padded and packed micro-batches, by sample count and by tokens
    (``trainer.max_tokens_per_microbatch``: padded micro-batches, the forward output
    reordered); the loss-only pass (``forward(data, loss_fn=...)``: SkyRL's SFT loss and
    ``regular``); the reference worker's ``forward``."""
    for r, per_rank in enumerate(stepped):
        stock, ours = per_rank[name]
        assert stock["last"]
        assert_same_step(stock, ours, f"rank {r} {name}")


def test_comparison_sees_a_different_step(stepped):
    """The control: gbc's worker with AR on, SkyRL's without AR applied by hand, differ in
    the loss, the metrics, the loss_fn_outputs' rows being the same (AR leaves the
    log-probs), and the gradients."""
    for r, per_rank in enumerate(stepped):
        stock, ours = per_rank["control_ar_not_by_hand"]
        with pytest.raises(AssertionError, match="metric"):
            assert_same_step(stock, ours, f"rank {r}")
        assert stock["metrics"]["policy_loss"] != pytest.approx(ours["metrics"]["policy_loss"])
        _loss_fn_outputs(stock["loss_fn_outputs"], ours["loss_fn_outputs"],
                         stock["loss_masks"], f"rank {r}")
        assert any(not torch.allclose(stock["grads"][k], ours["grads"][k], rtol=1e-3)
                   for k in stock["grads"])


def _pipeline(results, name):
    assert {per_rank[name][0]["last"] for per_rank in results} == {False, True}
    for r, per_rank in enumerate(results):
        stock, ours = per_rank[name]
        assert_same_step(stock, ours, f"rank {r} {name}")


@pytest.mark.parametrize("name", sorted(PIPELINE_CASES))
def test_pipeline_parallel_worker_step_equals_skyrls_worker(two_ranks, name):
    """Pipeline parallel 2 (SkyRL's wrapper on megatron's 1F1B schedule, gloo point-to-point):
    the metrics (SkyRL broadcasts the last stage's to every stage) and on the last stage the
    loss_fn_outputs and forward log-probs, every gradient on both stages (the first stage's
    through the schedule's backward)."""
    _pipeline(two_ranks, name)


@pytest.mark.parametrize("name", sorted(DP_CASES))
def test_data_parallel_worker_step_equals_skyrls_worker(two_ranks, name):
    """Data parallel 2, each rank its own batch: gbc's loss scaled by the data-parallel size as
    SkyRL's, the worker's metrics all-reduced over the ranks (the same on both ranks), each
    rank's gradients (no DDP: the ranks' own) == SkyRL's."""
    for r, per_rank in enumerate(two_ranks):
        stock, ours = per_rank[name]
        assert_same_step(stock, ours, f"rank {r} {name}")
    (s0, _), (s1, _) = two_ranks[0][name], two_ranks[1][name]
    assert s0["metrics"] == s1["metrics"]
    assert not torch.equal(s0["loss_masks"], s1["loss_masks"]) or any(
        not torch.equal(s0["grads"][k], s1["grads"][k]) for k in s0["grads"])


@pytest.fixture(scope="module")
def context_parallel():
    return spawn_gloo(2, _cases_worker, CP_CASES)


@pytest.mark.parametrize("name", sorted(CP_CASES))
def test_context_parallel_worker_step_equals_skyrls_worker(context_parallel, name):
    """Context parallel 2 on SkyRL's packed micro-batches (``trainer.policy.megatron_config.
    context_parallel_size=2``; SkyRL's ``preprocess_packed_seqs`` gives each rank 2 of every
    sequence's 4 chunks): gbc's loss over this rank's tokens with the whole micro-batch's
    normalisers, the whole loss's value; every metric, loss_fn_outputs, each rank's
    gradients and the no-grad log-probs == SkyRL's (its log-probs all-gathered over the CP
    group)."""
    for r, per_rank in enumerate(context_parallel):
        stock, ours = per_rank[name]
        assert_same_step(stock, ours, f"rank {r} {name}")


@pytest.mark.slow
def test_pipeline_and_tensor_parallel_worker_step_equals_skyrls_worker():
    """Pipeline parallel 2 × tensor parallel 2 with sequence parallelism, four ranks: as
    :func:`test_pipeline_parallel_worker_step_equals_skyrls_worker`."""
    results = spawn_gloo(4, _cases_worker, PP_TP_CASES)
    for name in PP_TP_CASES:
        _pipeline(results, name)


def test_token_microbatching_pads_and_reorders():
    """The token-based cases do what they are for: with ``max_tokens_per_microbatch=14`` SkyRL
    splits :func:`training_batch` into micro-batches of different sizes (so
    ``_pad_microbatch_to_size`` pads) in an order other than the batch's (so the forward
    output is reordered)."""
    for data in (training_batch(11), training_batch(12, n=3)):
        from skyrl.backends.skyrl_train.workers.worker_utils import get_microbatch_iterator

        it = get_microbatch_iterator(data, micro_batch_size=4, max_tokens_per_microbatch=14)
        sizes = [len(mb) for mb in it._microbatches]
        assert len(set(sizes)) > 1, sizes
        assert sum(it._microbatches, []) != list(range(data.batch_size)), it._microbatches
