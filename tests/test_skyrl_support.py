"""SkyRL 0.4's sample-support replay (``trainer.algorithm.enable_sample_support_replay``) in
gbc's FSDP workers (docs/skyrl.md, "The sampler's support") against SkyRL's own code: its
scoring functions (``sample_support_scores``, ``score_aligned_sample_support``) in float64,
its row alignment, and its own FSDP policy / reference workers' step and passes on a tiny
Qwen2, padded and packed, at temperature 0.8; its error for a loss-active token without
support; a target missing from its row (forced in, counted); an id >= V refused for the whole
batch before its first micro-batch (nothing changed); two FSDP2 data-parallel ranks and
Ulysses SP 2; the switch-on on both strategies, with the methods."""

from __future__ import annotations

import pytest
import torch

import gbc_kernels as gbc
from gbc_kernels.integrations.skyrl.losses import skyrl_replays_support

pytest.importorskip("skyrl")
if not skyrl_replays_support():
    pytest.skip("SkyRL < 0.4: no sample-support replay", allow_module_level=True)

from test_skyrl import P, T, V, algorithm, skyrl_cpu, tiny_qwen2  # noqa: E402

TEMP = 0.8
K = 5


@pytest.fixture(scope="module")
def sky():
    return skyrl_cpu().load()


def _support_row(g, target, size, missing=False, dup=False):
    """A sampler's row of ``size`` distinct ids (the target among them unless ``missing``),
    shuffled, ``-1`` padded to K; ``dup``: one id twice."""
    others = torch.randperm(V, generator=g)
    others = others[others != target][:K]
    ids = others[:size - 1].tolist() + ([] if missing else [target])
    if missing:
        ids.append(int(others[size - 1]))
    ids = [ids[i] for i in torch.randperm(len(ids), generator=g).tolist()]
    if dup and len(ids) < K:
        ids.append(ids[0])
    return ids + [-1] * (K - len(ids))


def make_batch(sky, seed, B=4, forced=(), dup=(), bare=(), bare_active=(), support=True):
    """A SkyRL 0.4 training batch (fully left-padded, response tensors right-aligned, as its
    ``convert_prompts_responses_to_batch_tensors`` makes them) with ``rollout_sample_support``:
    each response token's row of 1..K ids. ``forced``: (b, j) whose row lacks the target;
    ``dup``: rows with a repeated id; ``bare``: loss-masked-out tokens with an all -1 row (an
    observation token); ``bare_active``: the same, loss-active (SkyRL's error); ``support``
    False: no ``rollout_sample_support``. Returns two batches: with these rows, and with the
    rows as the sampler's capture would have written them (the target in, no duplicates:
    what SkyRL's scoring sees in a real run)."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.utils.packed_tensor import PackedTensor

    g = torch.Generator().manual_seed(seed)
    S = P + T
    seq = torch.randint(0, V, (B, S), generator=g)
    attn = torch.zeros(B, S, dtype=torch.long)
    plen = torch.randint(2, P + 1, (B,), generator=g)
    rlen = torch.randint(1, T + 1, (B,), generator=g)
    rlen[0] = T
    if B > 3:
        rlen[3] = 0                                   # an empty response
    lm = torch.zeros(B, T, dtype=torch.long)
    rows, clean = [], []
    for b in range(B):
        n, r = int(plen[b]) + int(rlen[b]), int(rlen[b])
        attn[b, S - n:] = 1
        lm[b, T - r:] = 1
        for j in range(r):
            y = int(seq[b, S - r + j])
            size = int(torch.randint(1, K + 1, (1,), generator=g))
            if (b, j) in bare or (b, j) in bare_active:
                row, c = [-1] * K, []
                if (b, j) in bare:
                    lm[b, T - r + j] = 0
            else:
                miss, dp = (b, j) in forced, (b, j) in dup
                row = _support_row(g, y, min(max(size, 2), K - 1) if dp else size, miss, dp)
                c = [i for i in dict.fromkeys(row) if i >= 0]
                c = c if y in c else c + [y]
            rows.append(row)
            clean.append(c + [-1] * (K + 1 - len(c)))
    adv = torch.randn(B, 1, generator=g).expand(B, T) * lm
    adv = sky.ppo_utils.apply_loss_reduction_to_advantages_minibatch(
        adv.float(), lm.float(), "token_mean", 2, T)
    old = -3 * torch.rand(B, T, generator=g) - 0.1
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = rlen.cumsum(0)

    def packed(r, width):
        v = torch.tensor(r, dtype=torch.int32).reshape(-1, width)
        return PackedTensor(v, cu.clone())

    d = {"sequences": seq, "attention_mask": attn, "response_mask": lm.clone(), "loss_mask": lm,
         "advantages": adv, "action_log_probs": old,
         "base_action_log_probs": -3 * torch.rand(B, T, generator=g) - 0.1,
         "rollout_logprobs": None}
    batches = []
    for r, width in ((rows, K), (clean, K + 1)):
        batch = TrainingInputBatch(dict(d, rollout_sample_support=packed(r, width))
                                   if support else d)
        batch.metadata = {"response_length": T}
        batches.append(batch)
    return batches


# ---- the scoring, in float64, against SkyRL's functions -------------------------------------
def test_scores_equal_skyrls_float64(sky):
    """gbc's log-probs and entropy over the support (fused head, temperature 0.8) equal
    SkyRL's ``sample_support_scores`` on the head (its fused path) and on the logits divided by
    the temperature (its FSDP path, float64 throughout: the reference), gradients in the hidden states and the head
    included; an all ``-1`` row gives 0 and 0 (SkyRL's ``valid_mask`` False), as gbc's row
    scored over its target alone."""
    from skyrl.backends.skyrl_train.utils.sample_support_replay import sample_support_scores

    g = torch.Generator().manual_seed(0)
    N, H = 23, 16
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (N,), generator=g)
    sup = torch.tensor([_support_row(g, int(y[i]), 1 + i % K) for i in range(N)])
    sup[4] = -1
    want = {}
    for path in ("fused", "logits"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        src = hh if path == "fused" else (hh @ ww.T) / TEMP
        s = sample_support_scores(src, y, sup.to(torch.int32), vocab_start_index=0,
                                  vocab_end_index=V, tp_group=None, compute_entropy=True,
                                  entropy_requires_grad=True,
                                  lm_head_weight=ww if path == "fused" else None,
                                  temperature=TEMP if path == "fused" else 1.0)
        assert not bool(s.valid_mask[4]) and s.valid_mask.sum() == N - 1
        (s.logprobs.sum() + 0.3 * s.entropy.sum()).backward()
        want[path] = (s.logprobs.detach(), s.entropy.detach(), hh.grad, ww.grad)
    for a, b in zip(want["fused"], want["logits"]):     # SkyRL's fused path ends in float32
        torch.testing.assert_close(a.double(), b, rtol=1e-6, atol=1e-6)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = gbc.fused_linear_logprobs(hh, ww, y, temperature=TEMP, return_entropy=True,
                                        support_ids=sup, logits_dtype="input")
    (lp.sum() + 0.3 * ent.sum()).backward()
    for got, ref in zip((lp, ent, hh.grad, ww.grad), want["logits"]):
        # gbc's log-probs are float32 (its head's float32 accumulation): float32's error
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    assert lp[4] == 0 and ent[4] == 0


def test_rows_where_skyrl_and_gbc_differ_follow_section_16(sky):
    """Rows SkyRL's capture never writes: a target missing from its row (gbc: scored over
    S + {y}, counted in ``support_forced_frac``; SkyRL: ``l_y - LSE_S``, which can exceed 0)
    and a repeated id (gbc: once; SkyRL: twice). gbc equals SkyRL on the row the capture would
    write (the target in, no duplicate); an id >= V (SkyRL drops it) is refused naming
    support_ids."""
    from skyrl.backends.skyrl_train.utils.sample_support_replay import sample_support_scores

    g = torch.Generator().manual_seed(1)
    N, H = 12, 8
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (N,), generator=g)
    raw = torch.tensor([_support_row(g, int(y[i]), 3, missing=i < 4, dup=i >= 8)
                        for i in range(N)])
    fixed = torch.full((N, K + 1), -1)
    for i in range(N):
        c = [v for v in dict.fromkeys(raw[i].tolist()) if v >= 0]
        c = c if int(y[i]) in c else c + [int(y[i])]
        fixed[i, :len(c)] = torch.tensor(c)

    def sky_lp(s):
        return sample_support_scores(h, y, s.to(torch.int32), vocab_start_index=0,
                                     vocab_end_index=V, tp_group=None, lm_head_weight=w,
                                     temperature=TEMP).logprobs

    lp, _ = gbc.fused_linear_logprobs(h, w, y, temperature=TEMP, support_ids=raw,
                                      logits_dtype="input")
    torch.testing.assert_close(lp.double(), sky_lp(fixed).double(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(sky_lp(raw)[:4], sky_lp(fixed)[:4])      # SkyRL's differ there
    assert not torch.allclose(sky_lp(raw)[8:], sky_lp(fixed)[8:])
    mask = torch.ones(1, N, dtype=torch.bool)
    _, m = gbc.fused_linear_policy_loss(h[None].float(), w.float(), y[None], mask,
                                        torch.ones(1, N), support_ids=raw[None])
    assert float(m["support_forced_frac"]) == pytest.approx(4 / N)
    bad = raw.clone()
    bad[0, 0] = V
    with pytest.raises(ValueError, match="support_ids"):
        gbc.fused_linear_logprobs(h, w, y, support_ids=bad)


def test_alignment_is_skyrls(sky):
    """gbc's ``support_ids [B, T, k]`` of a micro-batch equal SkyRL's own alignment
    (``sample_support_row_ids_in_batch_positions`` on its canonical layout, the rows gathered
    by ``_gather_support_rows``) at the logits that predict the response columns."""
    from gbc_kernels.integrations.skyrl.worker import replay_support_ids
    from skyrl.backends.skyrl_train.distributed.megatron.token_metadata import (
        canonical_token_metadata_layout)
    from skyrl.backends.skyrl_train.utils.sample_support_replay import (
        _gather_support_rows, sample_support_row_ids_in_batch_positions)

    for seed in range(3):
        batch, _ = make_batch(sky, seed, B=5, bare=((0, 1),))
        attn, sup = batch["attention_mask"], batch["rollout_sample_support"]
        row_ids = sample_support_row_ids_in_batch_positions(
            sup, canonical_token_metadata_layout(attn))
        want = _gather_support_rows(sup, row_ids[:, -T - 1:-1]).long()
        got = replay_support_ids(sup, batch["loss_mask"], attn, T)
        assert torch.equal(got, want)
        assert (got >= 0).any(-1).sum() > 0


# ---- the workers' step and passes against SkyRL's own workers (gloo, one rank) -------------
def _algo(sky, loss_type="regular", **kw):
    kw = dict(dict(use_kl_loss=True, kl_loss_coef=0.2, kl_estimator_type="k3",
                   use_entropy_loss=True, entropy_loss_coef=0.03,
                   enable_sample_support_replay=True), **kw)
    return algorithm(sky, loss_type, **kw)


def _run(sky, gbc_on, batch, packed, loss_type="regular", micro=2, replay=True, world=1):
    """One worker's forward_backward (two micro-batches), its old-policy pass and the
    reference worker's pass, on ``batch``."""
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import (FSDPPolicyWorkerBase,
                                                                    FSDPRefWorkerBase)

    from gbc_kernels import methods

    model = tiny_qwen2()
    if world > 1:
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    a = _algo(sky, loss_type, enable_sample_support_replay=replay)
    cls = gfsdp.GBCFSDPPolicyWorker if gbc_on else FSDPPolicyWorkerBase
    w = skyrl_cpu().policy_worker(cls, a, model, world, micro, temperature=TEMP, packed=packed)
    if gbc_on:
        w._gbc_options = methods.MethodOptions()
    rcls = gfsdp.GBCFSDPRefWorker if gbc_on else FSDPRefWorkerBase
    r = skyrl_cpu().policy_worker(rcls, _algo(sky, enable_sample_support_replay=replay),
                                  tiny_qwen2(), micro=3, temperature=TEMP,
                                  packed=packed)
    if gbc_on:
        r._gbc_options = methods.MethodOptions()
    with skyrl_cpu().cpu_device():
        torch.manual_seed(3)
        out = w.forward_backward(batch)
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                 .detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        fwd = w.forward(batch)
        ref = r.forward(batch)
    return dict(metrics=dict(out.metrics), outputs=out.loss_fn_outputs, grads=grads,
                old=[x["logprobs"] for x in fwd.loss_fn_outputs],
                ref=[x["logprobs"] for x in ref.loss_fn_outputs])


def _compare(got, ref, rtol=2e-4, atol=2e-6):
    extra = set(got["metrics"]) - set(ref["metrics"])
    assert extra == {"gbc_support_forced_frac"}, extra
    for k in ref["metrics"]:
        assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=rtol, abs=atol), k
    n = 0
    for go, ro in zip(got["outputs"], ref["outputs"]):
        for a, b in zip(go["logprobs"], ro["logprobs"]):
            if a == a:                              # gbc's: NaN outside the loss mask
                assert a == pytest.approx(b, rel=rtol, abs=atol)
                n += 1
    assert n > 0
    for key in ("old", "ref"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(ref[key]), rtol=rtol,
                                   atol=atol, msg=key)
    assert set(got["grads"]) == set(ref["grads"])
    for name, grad in ref["grads"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(got["grads"][name], grad, rtol=rtol, atol=atol, msg=name)


def _steps_worker(rank, world, cases):
    sky = skyrl_cpu().load()
    out = []
    for packed, kw, loss_type in cases:
        raw, clean = make_batch(sky, 40 + len(out), **kw)
        got = _run(sky, True, raw, packed, loss_type)
        want = _run(sky, False, clean, packed, loss_type)
        out.append((got, want))
    # SkyRL's worker without replay (the whole vocabulary): another result, so the comparisons
    # above see the support
    return out, _run(sky, False, make_batch(sky, 40)[1], False, replay=False)


CASES = [(False, {}, "regular"), (True, {}, "regular"),
         (False, dict(bare=((0, 2),), forced=((0, 4), (2, 0)), dup=((1, 0),)), "regular"),
         (True, dict(bare=((0, 2),), forced=((0, 4),)), "gspo"),
         (False, {}, "cross_entropy")]


def test_worker_replay_equals_skyrl():
    """gbc's FSDP policy worker (training step: two micro-batches, KL and entropy terms) and
    its old-policy and reference passes under replay, padded and packed
    (``trainer.remove_microbatch_padding``), temperature 0.8, equal SkyRL 0.4's own workers
    (which gather the support's columns from full logits): every metric (``policy_entropy``
    the support's entropy), the log-probs, the no-grad passes (the reference at the policy's
    temperature) and every gradient. With a loss-masked-out token whose row is empty (an
    observation token), targets missing from their rows and a repeated id: gbc's worker on
    those rows equals SkyRL's on the rows its capture writes (the target in, no duplicate),
    and ``gbc_support_forced_frac`` counts the forced tokens."""
    from conftest import spawn_gloo

    out, full = spawn_gloo(1, _steps_worker, CASES)[0]
    for key in ("old", "ref"):
        assert not torch.allclose(torch.tensor(full[key]), torch.tensor(out[0][1][key])), key
    for (got, want), (_, kw, loss_type) in zip(out, CASES):
        if loss_type == "cross_entropy":            # SkyRL's SFT loss: no RL metrics
            got["metrics"]["gbc_support_forced_frac"] = 0.0
        _compare(got, want)
        frac = got["metrics"]["gbc_support_forced_frac"]
        assert (frac > 0) == bool(kw.get("forced")), (kw, frac)


def _dp_worker(rank, world, packed):
    sky = skyrl_cpu().load()
    raw, clean = make_batch(sky, 60 + rank, forced=((0, 1),) if rank else ())
    return (_run(sky, True, raw, packed, world=world),
            _run(sky, False, clean, packed, world=world))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_worker_replay_two_ranks_fsdp2_equals_skyrl(packed):
    """The same at two data-parallel ranks, the model sharded by FSDP2 (gloo), each rank its
    own batch (a forced target on one): SkyRL's dp_size scaling and its metrics' all-reduce,
    every gradient."""
    from conftest import spawn_gloo

    for got, want in spawn_gloo(2, _dp_worker, packed):
        _compare(got, want)


def _ulysses_worker(rank, world):
    from test_skyrl import _grads
    from test_skyrl_ulysses import _setup, _worker

    sky, dp, _ = _setup(rank, world)
    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import (FSDPPolicyWorkerBase,
                                                                    FSDPRefWorkerBase)

    raw, clean = make_batch(sky, 70, forced=((0, 1),), bare=((2, 0),))
    out = []
    for gbc_on, batch in ((True, raw), (False, clean)):
        opts = methods.MethodOptions() if gbc_on else None
        w, model = _worker(sky, gfsdp.GBCFSDPPolicyWorker if gbc_on else FSDPPolicyWorkerBase,
                           _algo(sky), world, dp, opts)
        r, _ = _worker(sky, gfsdp.GBCFSDPRefWorker if gbc_on else FSDPRefWorkerBase,
                       _algo(sky), world, dp, opts, micro=3)
        with skyrl_cpu().cpu_device():
            torch.manual_seed(3)
            o = w.forward_backward(batch)
            grads = _grads(model, world)
            fwd = w.forward(batch)
            ref = r.forward(batch)
        out.append(dict(metrics=dict(o.metrics), outputs=o.loss_fn_outputs, grads=grads,
                        old=[x["logprobs"] for x in fwd.loss_fn_outputs],
                        ref=[x["logprobs"] for x in ref.loss_fn_outputs]))
    return out


def test_worker_replay_ulysses_sp2_equals_skyrl():
    """Under SkyRL's Ulysses SP 2 (packed micro-batches, two gloo ranks in one SP group, the
    model FSDP2-sharded over both; tests/test_skyrl_ulysses.py's set-up): gbc's step and passes
    under replay equal SkyRL's own at SP 2, each rank scoring the support rows of the
    positions it holds."""
    pytest.importorskip("verl")       # tests/test_skyrl_ulysses.py's flash-attention set-up
    from conftest import spawn_gloo

    for got, want in spawn_gloo(2, _ulysses_worker):
        _compare(got, want)


def _error_worker(rank, world, packed):
    sky = skyrl_cpu().load()
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import (FSDPPolicyWorkerBase,
                                                                    FSDPRefWorkerBase)

    from gbc_kernels import methods

    raw, _ = make_batch(sky, 7, bare_active=((2, 0),))
    msgs = {}
    for gbc_on in (True, False):
        pcls = gfsdp.GBCFSDPPolicyWorker if gbc_on else FSDPPolicyWorkerBase
        rcls = gfsdp.GBCFSDPRefWorker if gbc_on else FSDPRefWorkerBase
        for name, cls in (("policy", pcls), ("ref", rcls)):
            w = skyrl_cpu().policy_worker(cls, _algo(sky), tiny_qwen2(), 1, 2,
                                          temperature=TEMP, packed=packed)
            if gbc_on:
                w._gbc_options = methods.MethodOptions()
            calls = [("forward", w.forward)]
            if name == "policy":
                calls.append(("forward_backward", w.forward_backward))
            for call, f in calls:
                with skyrl_cpu().cpu_device():
                    try:
                        f(raw)
                        msgs[(gbc_on, name, call)] = None
                    except ValueError as err:
                        msgs[(gbc_on, name, call)] = str(err)
        # no rollout_sample_support in the micro-batch
        w = skyrl_cpu().policy_worker(pcls, _algo(sky), tiny_qwen2(), 1, 2, temperature=TEMP,
                                      packed=packed)
        if gbc_on:
            w._gbc_options = methods.MethodOptions()
        with skyrl_cpu().cpu_device():
            try:
                w.forward(make_batch(sky, 8, support=False)[0])
                msgs[(gbc_on, "policy", "missing")] = None
            except ValueError as err:
                msgs[(gbc_on, "policy", "missing")] = str(err)
    return msgs


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_loss_active_token_without_support_is_skyrls_error(packed):
    """A loss-active token whose row holds no id: gbc's training step, old-policy pass and
    reference pass stop with SkyRL's own message, as SkyRL's workers do; a micro-batch without
    rollout_sample_support stops with SkyRL's message too."""
    from conftest import spawn_gloo

    msgs = spawn_gloo(1, _error_worker, packed)[0]
    want = "sample-support replay requires captured support for every loss-active token"
    for key, msg in msgs.items():
        if key[2] == "missing":
            assert msg is not None and "rollout_sample_support" in msg, (key, msg)
            assert msg == msgs[(False,) + key[1:]], key
            continue
        assert msg is not None and want in msg, (key, msg)
    assert len([k for k in msgs if k[2] != "missing"]) == 6


# ---- an id >= V: the whole batch checked before its first micro-batch ------------------------
def _bad_id_batch(sky, seed=9):
    """:func:`make_batch` (4 sequences: two micro-batches of 2) with an id ``V`` in the first
    row of sequence 2's segment: a loss-active token of the last micro-batch. Returns the batch
    and the row's index in the packed values."""
    raw, _ = make_batch(sky, seed)
    sup = raw["rollout_sample_support"]
    row = int(sup.cu_seqlens[2])
    assert int(sup.cu_seqlens[3]) > row and bool(raw["loss_mask"][2].any())
    sup.values[row, 0] = V
    return raw, row


def _bad_id_worker(rank, world, packed):
    sky = skyrl_cpu().load()
    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp

    raw, row = _bad_id_batch(sky)
    out = {"row": row}
    for opts in (methods.MethodOptions(), methods.MethodOptions(lopti_eta=0.5, ar_alpha=0.3)):
        model = tiny_qwen2()
        w = skyrl_cpu().policy_worker(gfsdp.GBCFSDPPolicyWorker, _algo(sky), model, 1, 2,
                                      temperature=TEMP, packed=packed)
        w._gbc_options = opts
        w.optimizer = torch.optim.Adam(model.parameters(), lr=0.5)    # an optimizer with state
        w.scheduler = torch.optim.lr_scheduler.LambdaLR(w.optimizer, lambda s: 1.0)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with skyrl_cpu().cpu_device():
            try:
                w.forward_backward(raw)
                msg = None
            except ValueError as err:
                msg = str(err)
        out[opts.lopti_eta] = dict(
            msg=msg, grads=[n for n, p in model.named_parameters() if p.grad is not None],
            moved=[n for n, p in model.named_parameters() if not torch.equal(p, before[n])],
            state=w.optimizer.state_dict()["state"], lr_steps=w.scheduler.last_epoch)
    for name, cls in (("policy", gfsdp.GBCFSDPPolicyWorker), ("ref", gfsdp.GBCFSDPRefWorker)):
        w = skyrl_cpu().policy_worker(cls, _algo(sky), tiny_qwen2(), 1, 2, temperature=TEMP,
                                      packed=packed)
        w._gbc_options = methods.MethodOptions()
        with skyrl_cpu().cpu_device():
            try:
                w.forward(raw)
                out[name] = None
            except ValueError as err:
                out[name] = str(err)
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_id_outside_the_vocabulary_refused_before_the_first_micro_batch(packed):
    """An id >= V in ``rollout_sample_support`` on a loss-active token of the batch's LAST
    micro-batch: gbc's FSDP worker's ``forward_backward`` refuses it naming ``support_ids``,
    the range, the id and where it sits, before the first micro-batch, so nothing changed —
    every parameter's ``.grad`` None, every parameter as it was, the optimizer's state (Adam)
    empty, no scheduler step; also under Lopti (with AR), before its first optimizer step.
    (Refused in the micro-batch that holds it, the first micro-batch's gradients were already
    accumulated.) The old-policy and reference passes refuse it the same way, up front."""
    from conftest import spawn_gloo

    out = spawn_gloo(1, _bad_id_worker, packed)[0]
    where = (rf"at index \[2, \d+, 0\] of the batch's support \(rollout_sample_support: "
             rf"sequence 2's row 0, values row {out['row']}, slot 0\); checked for the whole "
             rf"batch before its first micro-batch")
    import re

    for lopti in (None, 0.5):
        got = out[lopti]
        assert got["msg"] is not None and "support_ids" in got["msg"], (lopti, got["msg"])
        assert got["grads"] == [] and got["moved"] == [], (lopti, got)
        assert got["state"] == {} and got["lr_steps"] == 0, (lopti, got)
        assert re.match(
            rf"^support_ids: expected ids in \[-1, {V}\) \(-1: padding\) on masked-in tokens "
            rf"\(the loss mask's\), got {V} {where}", got["msg"]), (lopti, got["msg"])
    for name in ("policy", "ref"):
        assert out[name] is not None and re.match(
            rf"^support_ids: expected ids in \[-1, {V}\) \(-1: padding\) on the response "
            rf"tokens, got {V} {where}", out[name]), (name, out[name])


# ---- the switch-on ---------------------------------------------------------------------------
def _trainer_cfg(sky, **kw):
    from skyrl.train.config.config import TrainerConfig

    cfg = TrainerConfig()
    cfg.algorithm.temperature = TEMP
    cfg.algorithm.enable_sample_support_replay = True
    cfg.remove_microbatch_padding = False
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def test_switch_on_fsdp_and_megatron_with_the_methods(sky, monkeypatch):
    """Under replay gbc's FSDP worker builds and a Megatron config passes both checks (replay
    runs on both strategies: tests/test_skyrl_support_megatron.py), with every method on:
    NTHR and critical-token KL run over the support too (tests/test_skyrl_support_methods.py);
    critical-token KL still needs SkyRL's KL term."""
    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from gbc_kernels.integrations.skyrl import megatron as gmeg
    from gbc_kernels.integrations.skyrl import worker

    monkeypatch.setenv("GBC_SKYRL_OPTIONS", "")
    cfg = _trainer_cfg(sky)
    w = gfsdp.GBCFSDPPolicyWorker(cfg=cfg, world_size=1, rank=0, local_rank=0,
                                  master_addr="127.0.0.1", master_port=1,
                                  sequence_parallel_size=1)
    assert w.gbc_options == methods.MethodOptions()
    meg = _trainer_cfg(sky, strategy="megatron")
    gmeg.check_megatron_config(meg, methods.MethodOptions())
    worker.check_config(meg, methods.MethodOptions())
    every = methods.MethodOptions(nthr=True, critical_kl_exponent=2.0, ar_alpha=0.3,
                                  lopti_eta=0.5)
    cfg.algorithm.use_kl_loss = False
    with pytest.raises(ValueError, match="GBC_SKYRL_OPTIONS: critical_kl_exponent: the loss "
                                         "has no KL term"):
        worker.check_config(cfg, every)
    for c in (cfg, meg):
        c.algorithm.use_kl_loss = True
    for opts in (methods.MethodOptions(nthr=True),
                 methods.MethodOptions(critical_kl_exponent=2.0), every):
        assert worker.check_config(cfg, opts) == opts
        assert gmeg.check_megatron_config(meg, opts) == opts
    monkeypatch.setenv("GBC_SKYRL_OPTIONS", "nthr=1,critical_kl_exponent=2")
    w = gfsdp.GBCFSDPPolicyWorker(cfg=cfg, world_size=1, rank=0, local_rank=0,
                                  master_addr="127.0.0.1", master_port=1,
                                  sequence_parallel_size=1)
    assert w.gbc_options.nthr and w.gbc_options.critical_kl_exponent == 2.0
    meg.algorithm.enable_sample_support_replay = False
    gmeg.check_megatron_config(meg, methods.MethodOptions())
