"""NTHR from the trainer's own old-policy pass: inside verl 0.9.1's FSDP2 engine, the
``compute_log_prob`` pass keeps NTHR's inputs and the update scores them, with no second actor
forward; the scales and the update equal those of the engine's own pass (``gbc_nthr_pass``,
used where verl runs no such pass). verl's worker functions are stood in for as in
tests/test_verl_engine.py (the engine's ``infer_batch`` / ``forward_backward_batch`` with the
worker's fields); gbc's wrappers of them are the library's own."""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import spawn_gloo  # noqa: E402

pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")

from test_other_trainers import verl_actor_config  # noqa: E402
from test_verl_engine import (GROUP, NB, _forward_backward, build_engine,  # noqa: E402
                              make_batch, make_model_dir, verl_on_cpu)

# the update batch's rows: verl's balance_batch reorders them (here whole micro-batches of 2
# move, so each sample's packed micro-batch, and so its forward, is the same in both passes)
PERM = [2, 3, 0, 1, 6, 7, 4, 5]


def record_held() -> list:
    """What each ``NTHRBatch`` holds when it is scored (bytes), appended to the list returned
    (in this process: a spawned rank's)."""
    from gbc_kernels import methods

    held, result = [], methods.NTHRBatch.result

    def recorded(self, *args, **kwargs):
        held.append(self.nbytes())
        return result(self, *args, **kwargs)

    methods.NTHRBatch.result = recorded
    return held


def count_forwards(modules) -> list:
    """``[n]``: the forwards of ``modules`` so far (a pre-hook on each; reset it by hand)."""
    forwards = [0]
    for m in modules:
        m.register_forward_pre_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
    return forwards


def _kept_worker(rank, world, model_dir, mode, rows_of):
    from types import SimpleNamespace

    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    from gbc_kernels.integrations import hf
    from gbc_kernels.integrations.verl import engine as ve

    verl_on_cpu()
    held = record_held()
    # beta 0: on a random tiny model beta > 0 selects no token (test_verl_engine.py says why)
    engine = build_engine(model_dir, options=ve.EngineOptions(nthr=True, nthr_beta=0.0))
    forwards = count_forwards([hf.unwrap(engine.module)])
    cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl", entropy_coeff=0.01)
    loss_fn = functools.partial(ppo_loss, config=cfg)
    ec = SimpleNamespace(use_dynamic_bsz=False, infer_max_token_len_per_gpu=24,
                         infer_micro_batch_size_per_gpu=2, micro_batch_size_per_gpu=2,
                         use_fused_kernels=False)
    worker = SimpleNamespace(engine=engine, engine_config=ec, loss_fn=loss_fn,
                             model_config={"use_remove_padding": True})

    def rows(td, order):
        if rows_of is not None:
            order = [rows_of[rank][i] for i in order]
        return tu.index_select_tensor_dict(td, torch.as_tensor(order))

    data = make_batch(11, NB, group=GROUP, world=world)
    n = NB if rows_of is None else len(rows_of[rank])
    out = {}
    if mode != "bypass":            # verl's old-log-prob pass (the worker's infer_batch)
        old = rows(data, range(n))
        del old["advantages"]       # computed after this pass
        tu.assign_non_tensor(old, compute_loss=False)

        def infer_batch(self, td):
            with self.engine.eval_mode():
                return self.engine.infer_batch(td, loss_function=None)

        forwards[0] = 0
        got = ve._nthr_keep_on_infer(infer_batch)(worker, old)
        out["pass_forwards"] = forwards[0]
        out["logp"] = got["model_output"]["log_probs"].values().clone()
        out["row_field_left"] = ve.NTHR_ROW_KEY in old.keys()
    order = list(range(n)) if rows_of is not None else PERM
    update = rows(data, order)
    if mode == "other":             # a row the pass did not see: the update runs its own pass
        update = rows(make_batch(12, NB, group=GROUP, world=world), order)

    def train_mini_batch(self, td):   # verl's update: one forward/backward, no optimizer step
        out["update_forwards"] = forwards[0]
        out["scale"] = td[ve.SCALE_KEY].clone()
        out["update"] = _forward_backward(engine, td, loss_fn, False)
        return "verl"

    forwards[0] = 0
    assert ve._nthr_before_update(train_mini_batch)(worker, update) == "verl"
    out["metrics"] = {**engine._gbc_update_metrics, **engine._gbc_pass_metrics}
    # today's pass on the same parameters and batch, then the same update
    today = update.clone()
    del today[ve.SCALE_KEY]
    forwards[0] = 0
    with engine.eval_mode():
        engine.gbc_nthr_pass(today)
    out["today_forwards"] = forwards[0]
    out["today_scale"] = today[ve.SCALE_KEY].clone()
    out["today_update"] = _forward_backward(engine, today, loss_fn, False)
    with engine.eval_mode():
        o = engine.infer_batch(rows(data, range(n)), loss_function=None)
    out["plain_logp"] = o["model_output"]["log_probs"].values().clone()
    out["held"] = held
    return out


def _assert_equal_update(a, b):
    """Two updates, ``(loss, ..., grads)``: the same loss and every gradient bitwise."""
    (la, ga), (lb, gb) = (a[0], a[-1]), (b[0], b[-1])
    assert la == lb
    assert set(ga) == set(gb) and ga
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name


@pytest.mark.slow
def test_nthr_from_old_log_prob_pass_no_second_forward(tmp_path):
    """verl's ``compute_log_prob`` pass keeps NTHR's inputs; the update, its rows reordered,
    runs no actor forward before verl's own and gets exactly today's scales and update. The
    pass's log-probs are those of the plain forward-only pass (keeping changes nothing)."""
    model_dir = make_model_dir(tmp_path / "m")
    out = spawn_gloo(1, _kept_worker, model_dir, "kept", None)[0]
    assert out["update_forwards"] == 0
    assert out["today_forwards"] == out["pass_forwards"] == NB // 2 > 0
    assert not out["row_field_left"]
    assert torch.equal(out["logp"], out["plain_logp"])
    assert (out["today_scale"] != 1).any()
    assert torch.equal(out["scale"], out["today_scale"])
    _assert_equal_update(out["update"], out["today_update"])
    m = out["metrics"]
    assert m["actor/gbc_nthr_second_forward"] == 0.0
    assert m["actor/gbc_nthr_selected_frac"] > 0
    assert m["actor/gbc_nthr_kept_mb"] > 0
    # what is kept from the pass to the update is what today's pass holds, byte for byte
    kept, today = out["held"]
    assert kept == today == m["actor/gbc_nthr_kept_mb"] * 2 ** 20


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bypass", "other"])
def test_nthr_without_old_log_prob_pass_runs_its_own(tmp_path, mode):
    """Where verl ran no old-log-prob pass (bypass mode: rollout log-probs as old ones), or the
    pass saw other samples, the update runs today's pass and says so in its metrics."""
    model_dir = make_model_dir(tmp_path / "m")
    assert_own_pass(spawn_gloo(1, _kept_worker, model_dir, mode, None)[0])


def assert_own_pass(out):
    """The update ran NTHR's own pass (one forward per micro-batch), with its scales and
    update, and its metrics say so."""
    assert out["update_forwards"] == out["today_forwards"] == NB // 2
    assert torch.equal(out["scale"], out["today_scale"])
    _assert_equal_update(out["update"], out["today_update"])
    assert out["metrics"]["actor/gbc_nthr_second_forward"] == 1.0
    assert "actor/gbc_nthr_kept_mb" not in out["metrics"]


@pytest.mark.slow
def test_nthr_kept_groups_split_over_two_ranks(tmp_path):
    """Groups split over two data-parallel ranks (verl's balance_batch): each rank keeps its
    share from its old-log-prob pass and gets the scales of today's pass, with no forward."""
    model_dir = make_model_dir(tmp_path / "m")
    rows_of = [[0, 2, 5, 7], [1, 3, 4, 6]]
    for out in spawn_gloo(2, _kept_worker, model_dir, "kept", rows_of):
        assert out["update_forwards"] == 0 and out["today_forwards"] > 0
        assert torch.equal(out["scale"], out["today_scale"])
        _assert_equal_update(out["update"], out["today_update"])
