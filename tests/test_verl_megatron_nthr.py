"""NTHR on verl 0.9.1's Megatron engine from verl's own old-policy pass, and under context
parallelism (same harness as tests/test_verl_megatron.py and tests/test_verl_megatron_cp.py,
whose docstrings say what is bypassed on CPU).

The actor's ``compute_log_prob`` pass (verl's worker ``infer_batch``, gbc's wrapper of it)
keeps NTHR's inputs on the last pipeline stage, and the update (gbc's wrapper of the worker's
``train_mini_batch``, verl's update stood in for by one ``forward_backward_batch``) scores
them with no actor forward; the scales and the update equal those of the engine's own pass
(``gbc_nthr_pass``, which runs where verl skips that pass). Under context parallelism
(``thd``, each rank holding 2 of every sequence's ``2·cp`` chunks) the scales and the training
step equal CP 1's, and CP 1's equal gbc_reference's on the output layer's input rows."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("verl.workers.engine.megatron.transformer_impl")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import spawn_gloo  # noqa: E402
from test_nthr_kept import _assert_equal_update, assert_own_pass  # noqa: E402

GROUP, NB = 4, 8          # 2 groups of 4 responses
# the update batch's rows: verl's balance_batch reorders them (here whole micro-batches of 2
# move, so each sample's micro-batch, and so its forward, is the same in both passes)
PERM = [2, 3, 0, 1, 6, 7, 4, 5]


def _nthr_worker(rank, world, tp=1, sp=False, pp=1, cp=None, mode="kept"):
    """verl's old-log-prob pass through gbc's worker wrapper (``mode="kept"``; ``"bypass"``:
    none; ``"other"``: the update's samples differ), then the update through gbc's wrapper,
    counting the actor's forwards; then the engine's own pass and the same update. ``cp``:
    the packed ``thd`` layout at that context-parallel size (None: ``bshd``)."""
    from megatron.core import parallel_state as mpu
    from verl.utils import tensordict_utils as tu

    import test_verl_megatron as tvm
    from gbc_kernels.integrations.verl import engine as ve
    from test_nthr_kept import count_forwards, record_held
    from test_verl_engine import verl_on_cpu

    verl_on_cpu()
    held = record_held()
    if cp is None:
        model = tvm._chunks(tp, sp, pp)
        config = {}
    else:
        import test_verl_megatron_cp as tcp
        model = [tcp._model(tp, sp, cp=cp)]
        config = dict(use_remove_padding=True, context_parallel_size=cp)
    last = mpu.is_pipeline_last_stage(ignore_virtual=True)
    engine = tvm._engine(model, options=ve.EngineOptions(nthr=True, nthr_beta=0.0), **config)
    forwards = count_forwards(model)
    loss_fn = tvm._loss_fn()
    ec = types.SimpleNamespace(use_dynamic_bsz=False, infer_max_token_len_per_gpu=24,
                               infer_micro_batch_size_per_gpu=2, micro_batch_size_per_gpu=2,
                               use_fused_kernels=False)
    worker = types.SimpleNamespace(engine=engine, engine_config=ec, loss_fn=loss_fn,
                                   model_config={"use_remove_padding": cp is not None})

    def rows(td, order):
        return tu.index_select_tensor_dict(td, torch.as_tensor(list(order)))

    def step(td):              # one forward/backward (verl's update, no optimizer step)
        for chunk in model:
            chunk.zero_grad(set_to_none=True)
        res = engine.forward_backward_batch(td.clone(), loss_fn, forward_only=False)
        return (float(sum(res["loss"])) if last else None), tvm._grads(model)

    data = tvm._batch(seed=11, B=NB, group=GROUP)
    out = {"last": last}
    if mode != "bypass":            # verl's old-log-prob pass (the worker's infer_batch)
        old = data.clone()
        del old["advantages"]       # computed after this pass
        tu.assign_non_tensor(old, compute_loss=False)

        def infer_batch(self, td):
            with torch.no_grad():
                return self.engine.infer_batch(td, loss_function=None)

        forwards[0] = 0
        got = ve._nthr_keep_on_infer(infer_batch)(worker, old)
        out["pass_forwards"] = forwards[0]
        out["row_field_left"] = ve.NTHR_ROW_KEY in old.keys()
        if last:
            out["logp"] = tvm._responses(got, "log_probs", data)
    update = rows(data, PERM)
    if mode == "other":             # rows the pass did not see: the update runs its own pass
        update = rows(tvm._batch(seed=12, B=NB, group=GROUP), PERM)
    tu.assign_non_tensor(update, disable_auto_offload=True)

    def train_mini_batch(self, td):
        out["update_forwards"] = forwards[0]
        out["scale"] = td[ve.SCALE_KEY].clone() if last else None
        out["update"] = step(td)
        return "verl"

    forwards[0] = 0
    assert ve._nthr_before_update(train_mini_batch)(worker, update) == "verl"
    out["metrics"] = {**engine._gbc_update_metrics, **engine._gbc_pass_metrics}
    # the engine's own pass on the same parameters and batch, then the same update
    today = update.clone()
    if ve.SCALE_KEY in today.keys():
        del today[ve.SCALE_KEY]
    forwards[0] = 0
    with torch.no_grad():
        engine.gbc_nthr_pass(today)
    out["today_forwards"] = forwards[0]
    out["today_scale"] = today[ve.SCALE_KEY].clone() if last else None
    out["today_update"] = step(today)
    with torch.no_grad():          # the plain forward-only pass (NTHR's keeping not asked)
        plain = engine.infer_batch(data.clone(), loss_function=None)
    if last:
        out["plain_logp"] = tvm._responses(plain, "log_probs", data)
    out["held"] = held
    if cp == 1:      # gbc_reference's inputs: the output layer's input rows (bshd, float64)
        out["oracle"] = tvm._head_oracle(model, rows(data, PERM), tp, sp)
    return out


def _check_kept(out):
    """No actor forward in the update; today's scales and update exactly; the pass's
    log-probs unchanged by keeping; what is kept is what today's pass holds."""
    assert out["update_forwards"] == 0
    assert out["today_forwards"] == out["pass_forwards"] == NB // 2
    assert not out["row_field_left"]
    _assert_equal_update(out["update"], out["today_update"])
    if not out["last"]:
        assert out["held"] == []
        return
    assert torch.equal(out["logp"], out["plain_logp"])
    assert (out["today_scale"] != 1).any()
    assert torch.equal(out["scale"], out["today_scale"])
    m = out["metrics"]
    assert m["actor/gbc_nthr_second_forward"] == 0.0
    assert m["actor/gbc_nthr_selected_frac"] > 0
    kept, today = out["held"]
    assert kept == today == m["actor/gbc_nthr_kept_mb"] * 2 ** 20 > 0


@pytest.mark.slow
def test_nthr_from_old_log_prob_pass_tp2_sp():
    """TP 2 with sequence parallelism: verl's ``compute_log_prob`` pass keeps NTHR's inputs
    (the output rows of the batch's ids assembled from both vocabulary shards); the update,
    its rows reordered, runs no actor forward and gets exactly the own pass's scales and
    update."""
    for out in spawn_gloo(2, _nthr_worker, 2, True):
        _check_kept(out)


@pytest.mark.slow
def test_nthr_from_old_log_prob_pass_pipeline_2():
    """Pipeline parallel 2 (megatron's 1F1B schedule): the last stage keeps and scores, the
    first keeps nothing; no stage runs a forward in the update; the update equals the own
    pass's on both stages."""
    outs = spawn_gloo(2, _nthr_worker, 1, False, 2)
    assert [o["last"] for o in outs] == [False, True]
    for out in outs:
        _check_kept(out)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bypass", "other"])
def test_nthr_without_old_log_prob_pass_runs_its_own(mode):
    """Where verl ran no old-log-prob pass (bypass mode: rollout log-probs as old ones), or the
    pass saw other samples, the update runs the engine's own pass and says so in its metrics."""
    for out in spawn_gloo(2, _nthr_worker, 2, True, 1, None, mode):
        assert_own_pass(out)


@pytest.mark.slow
def test_nthr_context_parallel_2_equals_1_and_reference():
    """context_parallel_size=2 in thd: the old-log-prob pass keeps each micro-batch's whole
    response rows on every CP rank (the hidden states, targets and log-probs of the rank's own
    positions summed over the CP group), with no forward in the update and the own pass's
    scales. The scales equal CP 1's, which equal gbc_reference's on the output layer's float64
    input rows and whole weight (correct = advantage > 0, beta 0); the training step with them
    equals CP 1's (loss; each gradient averaged over the CP ranks, as megatron's DDP)."""
    import gbc_reference as ref
    import test_verl_megatron as tvm

    one = spawn_gloo(1, _nthr_worker, 1, False, 1, 1)[0]
    two = spawn_gloo(2, _nthr_worker, 1, False, 1, 2)
    for out in [one] + two:
        _check_kept(out)
    o = one["oracle"]
    mask = o["mask"]
    correct = (o["advantages"] * mask).sum(1) > 0
    want = ref.nthr_scale(o["hidden"], o["weight"], o["responses"], mask,
                          torch.as_tensor(PERM) // GROUP, correct, temperature=0.8, beta=0.0)
    assert want.selected.any() and not want.selected[mask & ~correct[:, None]].all()
    assert torch.equal(one["scale"] != 1.0, want.selected)
    tvm._close(one["scale"], want.scale.float(), 1e-6, "CP 1 scale")
    loss1, g1 = one["update"]
    for r, out in enumerate(two):
        assert torch.equal(out["scale"], one["scale"]), r
        assert abs(out["update"][0] - loss1) <= 1e-6 * abs(loss1), r
    for k, g in g1.items():
        tvm._close(g, (two[0]["update"][1][k] + two[1]["update"][1][k]) / 2, 1e-6, f"grad {k}")


@pytest.mark.slow
def test_nthr_context_parallel_2_with_tensor_parallel_2():
    """CP 2 composed with TP 2 and sequence parallelism (four gloo ranks): no forward in the
    update, the own pass's scales and update, and CP 1's (TP 1) scales and loss on every rank."""
    one = spawn_gloo(1, _nthr_worker, 1, False, 1, 1)[0]
    for r, out in enumerate(spawn_gloo(4, _nthr_worker, 2, True, 1, 2)):
        _check_kept(out)
        assert torch.equal(out["scale"], one["scale"]), r
        assert abs(out["update"][0] - one["update"][0]) <= 1e-6 * abs(one["update"][0]), r
