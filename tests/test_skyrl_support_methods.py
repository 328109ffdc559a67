"""NTHR and critical-token KL under SkyRL 0.4's sample-support replay
(``trainer.algorithm.enable_sample_support_replay``) in gbc's FSDP workers (docs/skyrl.md,
"The sampler's support"; docs/math.md §16: NTHR's error vector ``onehot(y) - q`` on S, the
critical-KL certainty from the reference's distribution over its support, normalised by
``log |S|``), through SkyRL's own flow on a tiny Qwen2 (gloo; tests/test_skyrl_methods.py's
set-up) at temperature 0.8, padded and packed micro-batches:

* critical-token KL: SkyRL's (patched) trainer's ``fwd_logprobs_values_reward`` through gbc's
  reference and policy workers, then the policy worker's step. The reference pass's weights
  equal ``gbc_reference``'s (float64, full logits) certainty over each token's support at
  ``critical_kl_temperature``; its log-probs equal the float64 support log-probs at the
  policy's temperature and SkyRL's own reference worker's under replay; the step equals
  SkyRL's stock step under replay with its KL term weighted by hand.
* NTHR: SkyRL's old-log-prob pass (per mini-batch) keeps the rows and their support; each
  mini-batch's scales equal ``gbc_reference.nthr_scale(support_ids=...)`` (float64) on the
  whole batch; the steps equal SkyRL's stock steps under replay on the advantages times
  those scales; no forward beyond SkyRL's own. At two FSDP2 data-parallel ranks too, a
  group's rows on both.
* Ulysses SP 2: NTHR's scales and the reference pass's log-probs and weights against the
  float64 reference over the support.

gbc's side gets rows SkyRL's capture never writes (targets missing from their rows, a
repeated id: §16, forced in and counted once); the oracle reads the same rows through SkyRL's
own alignment, and SkyRL's stock workers the rows its capture would write (the target in, no
duplicate). The controls (the whole vocabulary's weights and scores) differ."""

from __future__ import annotations

import functools
import os
import sys
import types

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

pytest.importorskip("skyrl")

from gbc_kernels.integrations.skyrl.losses import skyrl_replays_support  # noqa: E402

if not skyrl_replays_support():
    pytest.skip("SkyRL < 0.4: no sample-support replay", allow_module_level=True)

from test_skyrl import T, algorithm, build_worker, skyrl_cpu, tiny_qwen2  # noqa: E402
from test_skyrl_methods import (ALGO, CRIT, _hidden64, _params, _set_options,  # noqa: E402
                                _weight_stock_kl, ref_model)
from test_skyrl_support import TEMP, make_batch  # noqa: E402

# gbc's side: targets missing from their rows (one in a correct response, one in an incorrect
# one) and repeated ids (rows 0 to 2 have a response: test_skyrl_support.make_batch)
RAW = dict(forced=((0, 1), (1, 0)), dup=((0, 2), (2, 0)))
GROUPS = [0, 0, 0, 1, 1, 1]
SIGNS = [1.0, -1.0, -1.0, -1.0, 1.0, -1.0]       # row 3's response is empty (make_batch)


def _replay(sky, **kw):
    return algorithm(sky, "regular", **dict(kw, enable_sample_support_replay=True))


def skyrl_support_ids(batch, T=T):
    """The batch's ``rollout_sample_support`` as ``[B, T, k]`` at the logits that predict the
    ``T`` response columns, by SkyRL's own alignment (its canonical layout, its row gather)."""
    from skyrl.backends.skyrl_train.distributed.megatron.token_metadata import (
        canonical_token_metadata_layout)
    from skyrl.backends.skyrl_train.utils.sample_support_replay import (
        _gather_support_rows, sample_support_row_ids_in_batch_positions)

    sup = batch["rollout_sample_support"]
    rows = sample_support_row_ids_in_batch_positions(
        sup, canonical_token_metadata_layout(batch["attention_mask"]))
    return _gather_support_rows(sup, rows[:, -T - 1:-1]).long()


def _flow(sky, options: dict, batch, packed=False):
    """tests/test_skyrl_methods.py's ``_skyrl_flow`` under replay: SkyRL's trainer's
    ``fwd_logprobs_values_reward`` (patched by gbc; it hands the passes the support and the
    loss mask) through gbc's reference and policy workers, then the policy worker's
    ``forward_backward`` and ``optim_step``. Returns (the training batch, the step's metrics,
    the parameters after)."""
    skyrl_cpu().entrypoint_imports()
    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from gbc_kernels.integrations.skyrl import trainer as gtrainer
    from skyrl.train.config.config import TrainerConfig

    opts = methods.MethodOptions(**options)
    _set_options(",".join(f"{k}={v}" for k, v in options.items()))
    cls = gtrainer.patch_trainer()
    model = tiny_qwen2()
    policy = build_worker(sky, gfsdp.GBCFSDPPolicyWorker, _replay(sky, **ALGO), 1, model, opts,
                          packed=packed)
    refw = build_worker(sky, gfsdp.GBCFSDPRefWorker, _replay(sky, **ALGO), 1, ref_model(), opts,
                        micro=3, packed=packed)

    class Dispatch:
        def forward(self, name, data):
            return {"ref": refw, "policy": policy}[name].forward(data)

        def empty_cache(self, *args):
            pass

    fake = types.SimpleNamespace(cfg=types.SimpleNamespace(trainer=TrainerConfig()),
                                 has_critic=False, ref_model=object(), dispatch=Dispatch(),
                                 all_metrics={})
    fake._execute_forward_pass = functools.partial(cls._execute_forward_pass, fake)
    fake._skip_policy_forward = functools.partial(cls._skip_policy_forward, fake)
    for key in ("action_log_probs", "base_action_log_probs"):
        batch.pop(key, None)
    with skyrl_cpu().cpu_device():
        data = cls.fwd_logprobs_values_reward(fake, batch)
        res = policy.forward_backward(data)
        policy.optim_step()
    return data, res.metrics, _params(model)


# ---- critical-token KL ----------------------------------------------------------------------
def _critical_worker(rank, world, packed):
    sky = skyrl_cpu().load()
    import gbc_reference as ref

    from gbc_kernels.integrations.skyrl.worker import KL_WEIGHT_KEY
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import (FSDPPolicyWorkerBase,
                                                                    FSDPRefWorkerBase)

    raw, _ = make_batch(sky, 21, B=5, **RAW)
    data, metrics, params = _flow(sky, CRIT, raw, packed)
    seq, attn, mask = data["sequences"], data["attention_mask"], data["loss_mask"].bool()
    ids = skyrl_support_ids(data)
    # the float64 reference over each token's support: log-probs at the policy's temperature
    # (SkyRL's reference under replay), the certainty at critical_kl_temperature
    h, w = _hidden64(ref_model(), seq, attn)
    cert = dict(certainty="max_prob", certainty_temperature=CRIT["critical_kl_temperature"])
    st = ref.token_stats(h, w, seq[:, -T:], temperature=TEMP, support_ids=ids, **cert)
    want_w = ref.critical_kl_weight(st.certainty.double(), CRIT["critical_kl_exponent"],
                                    CRIT["critical_kl_intercept"])
    full = ref.token_stats(h, w, seq[:, -T:], temperature=TEMP, **cert)        # the control
    full_w = ref.critical_kl_weight(full.certainty.double(), CRIT["critical_kl_exponent"],
                                    CRIT["critical_kl_intercept"])
    # SkyRL's own reference worker under replay, on the rows its capture writes
    sref = build_worker(sky, FSDPRefWorkerBase, _replay(sky, **ALGO), 1, ref_model(), micro=3,
                        packed=packed)
    # by hand: SkyRL's stock step under replay, its KL term times the reference weights
    model = tiny_qwen2()
    stock = build_worker(sky, FSDPPolicyWorkerBase, _replay(sky, **ALGO), world, model,
                         packed=packed)
    undo = _weight_stock_kl(want_w.float(), data["base_action_log_probs"])
    try:
        with skyrl_cpu().cpu_device():
            _, d = make_batch(sky, 21, B=5, **RAW)
            stock_ref = torch.tensor([r["logprobs"] for r in sref.forward(d).loss_fn_outputs])
            for key in ("action_log_probs", "base_action_log_probs"):
                d[key] = data[key]
            ref_res = stock.forward_backward(d)
            stock.optim_step()
    finally:
        undo()
    return dict(got=(metrics, params), want=(ref_res.metrics, _params(model)),
                got_w=data[KL_WEIGHT_KEY][mask], want_w=want_w[mask], full_w=full_w[mask],
                ref_logp=(data["base_action_log_probs"][mask], st.logp[mask],
                          stock_ref[mask]))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_critical_kl_under_replay_equals_the_method_by_hand(packed):
    """critical_kl_exponent under replay: gbc's reference worker's pass (at the policy's
    temperature, over each token's support) gives the weights from the reference's
    distribution over the support at critical_kl_temperature — equal to the float64
    reference's (J normalised by log |S|, 1 where |S| = 1), not the whole vocabulary's —
    and log-probs equal to the float64 support log-probs and SkyRL's own reference worker's;
    SkyRL's trainer carries the weights, and the policy step equals SkyRL's stock step under
    replay with its KL term weighted by hand."""
    from conftest import spawn_gloo

    out = spawn_gloo(1, _critical_worker, packed)[0]
    err = float((out["got_w"].double() - out["want_w"]).abs().max())
    print(f"\ncritical-KL weights under replay, gbc vs float64: max error {err:.1e}")
    torch.testing.assert_close(out["got_w"].double(), out["want_w"], rtol=1e-4, atol=1e-6)
    assert out["want_w"].std() > 1e-3                         # the weights vary by token
    assert (out["want_w"] - out["full_w"]).abs().max() > 1e-2   # the support's, not V's
    ours, oracle, stock = out["ref_logp"]
    torch.testing.assert_close(ours.double(), oracle.double(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.double(), stock.double(), rtol=1e-4, atol=1e-5)
    (gm, gp), (rm, rp) = out["got"], out["want"]
    assert gm["gbc_support_forced_frac"] > 0
    for k in rm:
        if k != "policy_kl":        # gbc's: SkyRL's KL itself; the stock one by hand: weighted
            assert gm[k] == pytest.approx(rm[k], rel=2e-4, abs=2e-6), k
    start = _params(tiny_qwen2())
    for n in rp:
        assert (rp[n] - start[n]).abs().sum() > 0
        torch.testing.assert_close(gp[n], rp[n], rtol=2e-4, atol=2e-6, msg=n)


# ---- NTHR -----------------------------------------------------------------------------------
def nthr_batches(sky, seed, groups=GROUPS, signs=SIGNS, **kw):
    """(raw, clean) replay batches (test_skyrl_support.make_batch) with signed advantages and
    NTHR's group ids."""
    from gbc_kernels.integrations.skyrl.worker import GROUP_KEY

    out = make_batch(sky, seed, B=len(groups), **kw)
    for d in out:
        d["advantages"] = d["advantages"].abs() * torch.tensor(signs)[:, None] + 0.0
        d[GROUP_KEY] = torch.tensor(groups)
    return out


def _oracle_nthr(sky, batch, groups, hidden=None):
    """gbc_reference's NTHR scales (float64, full logits of the initial policy) over each
    token's support, and over the whole vocabulary (the control)."""
    import gbc_reference as ref

    from gbc_kernels import methods

    seq, attn, mask = batch["sequences"], batch["attention_mask"], batch["loss_mask"].bool()
    h, wt = _hidden64(None, seq, attn) if hidden is None else hidden
    args = (h, wt, seq[:, -T:], mask, torch.tensor(groups),
            methods.correct_from_advantages(batch["advantages"], mask))
    kw = dict(temperature=TEMP, beta=0.0)
    return (ref.nthr_scale(*args, support_ids=skyrl_support_ids(batch), **kw),
            ref.nthr_scale(*args, **kw))


def _nthr_worker(rank, world, packed):
    sky = skyrl_cpu().load()
    from gbc_kernels import methods
    from gbc_kernels.integrations import hf
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from gbc_kernels.integrations.skyrl.worker import SCALE_KEY
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase

    # beta 0: on a random tiny model beta > 0 selects no token
    opts = methods.MethodOptions(nthr=True, nthr_beta=0.0)
    halves = (slice(0, 3), slice(3, 6))          # two mini-batches, whole groups each
    out = {}
    for nthr in (True, False):                   # NTHR adds no forward
        model = tiny_qwen2()
        w = build_worker(sky, gfsdp.GBCFSDPPolicyWorker, _replay(sky, use_kl_loss=False), world,
                         model, opts if nthr else methods.MethodOptions(), packed=packed)
        forwards = [0]
        hf.unwrap(model).register_forward_pre_hook(
            lambda *a: forwards.__setitem__(0, forwards[0] + 1))
        data, _ = nthr_batches(sky, 31, **RAW)
        scales, metrics = [], []
        with skyrl_cpu().cpu_device():
            # SkyRL's old-log-prob pass, per mini-batch (recompute_old_logprobs_per_minibatch)
            old = [w.forward(data[s]) for s in halves]
            if nthr:
                # each kept micro-batch carries its support (NTHRBatch.add's support_ids)
                assert all(len(row) == 6 for e in w._gbc_nthr_kept for row in e["batch"].rows)
            data["action_log_probs"] = torch.cat([torch.tensor(
                [r["logprobs"] for r in o.loss_fn_outputs]) for o in old])
            for s in halves:                     # the update: one optimizer step each
                mb = data[s]
                res = w.forward_backward(mb)
                w.optim_step()
                metrics.append(res.metrics)
                if nthr:
                    scales.append(mb[SCALE_KEY])
        out[nthr] = dict(forwards=forwards[0], metrics=metrics, params=_params(model),
                         scales=torch.cat(scales) if nthr else None,
                         old=data["action_log_probs"])
    raw, clean = nthr_batches(sky, 31, **RAW)
    want, full = _oracle_nthr(sky, raw, GROUPS)
    # by hand: SkyRL's stock steps under replay (the rows its capture writes) on the advantages
    # times the reference scales
    model = tiny_qwen2()
    stock = build_worker(sky, FSDPPolicyWorkerBase, _replay(sky, use_kl_loss=False), world,
                         model, packed=packed)
    clean["action_log_probs"] = out[True]["old"]
    clean["advantages"] = clean["advantages"] * want.scale.float()
    by_hand = []
    with skyrl_cpu().cpu_device():
        for s in halves:
            by_hand.append(stock.forward_backward(clean[s]).metrics)
            stock.optim_step()
    mask = raw["loss_mask"].bool()
    out["want"] = dict(scale=want.scale, selected=want.selected, scores=want.scores,
                       full_scores=full.scores, mask=mask, metrics=by_hand,
                       params=_params(model))
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_nthr_under_replay_equals_the_method_by_hand(packed):
    """nthr under replay: SkyRL's old-log-prob pass (per mini-batch) keeps NTHR's rows with
    their tokens' support and log-probs over it; each mini-batch's forward_backward scores
    them over the support (the error vector onehot(y) - q on S): the scales equal the float64
    reference's ``nthr_scale(support_ids=...)`` on the whole batch (whose scores differ from
    the whole vocabulary's); every step (metrics, parameters) equals SkyRL's stock step under
    replay on the advantages times those scales; no forward beyond SkyRL's own."""
    from conftest import spawn_gloo

    out = spawn_gloo(1, _nthr_worker, packed)[0]
    got, plain, want = out[True], out[False], out["want"]
    assert got["forwards"] == plain["forwards"] == 2 * (2 + 2)
    m = want["mask"]
    assert want["selected"].any() and (want["scale"][m] != 1).any()
    assert not torch.allclose(want["scores"][m], want["full_scores"][m], rtol=1e-3)
    err = float((got["scales"][m].double() - want["scale"][m].double()).abs().max())
    print(f"\nNTHR scales under replay, gbc vs float64: max error {err:.1e}")
    torch.testing.assert_close(got["scales"][m].double(), want["scale"][m].double(),
                               rtol=1e-5, atol=1e-6)
    for gm, rm in zip(got["metrics"], want["metrics"]):
        assert gm["gbc_nthr_second_forward"] == 0.0
        assert "gbc_support_forced_frac" in gm
        for k in rm:
            assert gm[k] == pytest.approx(rm[k], rel=2e-4, abs=2e-6), k
    start = _params(tiny_qwen2())
    for n, p in want["params"].items():
        assert (p - start[n]).abs().sum() > 0
        torch.testing.assert_close(got["params"][n], p, rtol=2e-4, atol=2e-6, msg=n)


# two FSDP2 ranks, one mini-batch of 6 rows, 3 per rank: group 1 has rows on both ranks
GROUPS2 = [0, 0, 1, 1, 1, 2]
SIGNS2 = [1.0, -1.0, -1.0, -1.0, 1.0, 1.0]      # row 3's response is empty (make_batch)


def _nthr_two_ranks_worker(rank, world):
    sky = skyrl_cpu().load()
    from torch.distributed.fsdp import fully_shard

    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from gbc_kernels.integrations.skyrl.worker import SCALE_KEY
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase

    rows = slice(3 * rank, 3 * rank + 3)

    def sharded():
        model = tiny_qwen2()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model

    opts = methods.MethodOptions(nthr=True, nthr_beta=0.0)
    model = sharded()
    w = build_worker(sky, gfsdp.GBCFSDPPolicyWorker, _replay(sky, use_kl_loss=False), world,
                     model, opts)
    raw, clean = nthr_batches(sky, 47, GROUPS2, SIGNS2, **RAW)
    data = raw[rows]
    with skyrl_cpu().cpu_device():
        old = w.forward(data)
        data["action_log_probs"] = torch.tensor([r["logprobs"] for r in old.loss_fn_outputs])
        res = w.forward_backward(data)
        w.optim_step()
    got = dict(scale=data[SCALE_KEY], metrics=res.metrics, params=_params(model))
    want, _ = _oracle_nthr(sky, raw, GROUPS2)
    model = sharded()
    stock = build_worker(sky, FSDPPolicyWorkerBase, _replay(sky, use_kl_loss=False), world,
                         model)
    d = clean[rows]
    d["action_log_probs"] = data["action_log_probs"]
    d["advantages"] = d["advantages"] * want.scale[rows].float()
    with skyrl_cpu().cpu_device():
        ref_res = stock.forward_backward(d)
        stock.optim_step()
    return dict(got=got, want=dict(scale=want.scale[rows], selected=want.selected[rows],
                                   mask=raw["loss_mask"].bool()[rows], metrics=ref_res.metrics,
                                   params=_params(model)))


def test_nthr_under_replay_two_fsdp2_ranks_a_group_over_both():
    """Two FSDP2 ranks (gloo), a group with rows on both: each rank's scales over the support
    (its own pass's kept rows and support, scored over the data-parallel group: the head rows
    of the ids of both ranks) equal the float64 reference's on the whole batch, and the step
    equals SkyRL's stock step under replay on the advantages times them."""
    from conftest import spawn_gloo

    outs = spawn_gloo(2, _nthr_two_ranks_worker)
    # rank 0's row 2 (group 1, incorrect) is selected through rank 1's correct row 4
    assert outs[0]["want"]["selected"][2].any()
    for o in outs:
        got, want = o["got"], o["want"]
        m = want["mask"]
        torch.testing.assert_close(got["scale"][m].double(), want["scale"][m].double(),
                                   rtol=1e-5, atol=1e-6)
        for k in want["metrics"]:
            assert got["metrics"][k] == pytest.approx(want["metrics"][k], rel=2e-4, abs=2e-6), k
        for n, p in want["params"].items():
            torch.testing.assert_close(got["params"][n], p, rtol=2e-4, atol=2e-6, msg=n)


def _ulysses_worker(rank, world):
    from test_skyrl_ulysses import _setup, _worker

    sky, dp, _ = _setup(rank, world)
    import gbc_reference as ref

    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from gbc_kernels.integrations.skyrl.worker import KL_WEIGHT_KEY, SCALE_KEY

    w, _ = _worker(sky, gfsdp.GBCFSDPPolicyWorker, _replay(sky, use_kl_loss=False), world, dp,
                   methods.MethodOptions(nthr=True, nthr_beta=0.0))
    data, _ = nthr_batches(sky, 31, **RAW)
    # the reference: the policy's initial weights (the float64 reference's model)
    r, _ = _worker(sky, gfsdp.GBCFSDPRefWorker, _replay(sky, **ALGO), world, dp,
                   methods.MethodOptions(**CRIT), micro=3)
    with skyrl_cpu().cpu_device():
        old = w.forward(data)
        data["action_log_probs"] = torch.tensor([x["logprobs"] for x in old.loss_fn_outputs])
        w.forward_backward(data)
        rows = r.forward(data).loss_fn_outputs
    raw, _ = nthr_batches(sky, 31, **RAW)
    want, _ = _oracle_nthr(sky, raw, GROUPS)
    seq, attn = raw["sequences"], raw["attention_mask"]
    h, wt = _hidden64(None, seq, attn)
    st = ref.token_stats(h, wt, seq[:, -T:], temperature=TEMP,
                         support_ids=skyrl_support_ids(raw), certainty="max_prob",
                         certainty_temperature=CRIT["critical_kl_temperature"])
    return dict(scale=data[SCALE_KEY], want_scale=want.scale, mask=raw["loss_mask"].bool(),
                ref_logp=torch.tensor([x["logprobs"] for x in rows]),
                weight=torch.tensor([x[KL_WEIGHT_KEY] for x in rows]), want_logp=st.logp,
                want_w=ref.critical_kl_weight(st.certainty.double(),
                                              CRIT["critical_kl_exponent"],
                                              CRIT["critical_kl_intercept"]))


def test_nthr_and_critical_kl_under_replay_ulysses_sp2():
    """Under SkyRL's Ulysses SP 2 (packed, two gloo ranks in one SP group; tests/
    test_skyrl_ulysses.py's set-up): NTHR's old-log-prob pass keeps the whole micro-batch's
    rows and support on every SP rank (each position from the rank that holds it) and the
    scales equal the float64 reference's over the support; the reference pass's log-probs and
    critical-KL weights over the support equal float64's."""
    pytest.importorskip("verl")       # tests/test_skyrl_ulysses.py's flash-attention set-up
    from conftest import spawn_gloo

    for out in spawn_gloo(2, _ulysses_worker):
        m = out["mask"]
        assert (out["want_scale"][m] != 1).any()
        torch.testing.assert_close(out["scale"][m].double(), out["want_scale"][m].double(),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["ref_logp"][m].double(), out["want_logp"][m].double(),
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out["weight"][m].double(), out["want_w"][m], rtol=1e-4,
                                   atol=1e-6)
