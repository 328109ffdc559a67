"""NTHR over the sampler's support (docs/math.md §16, docs/methods.md "NTHR over the support"): the
streaming ``nthr_scale(..., support_ids=...)`` against the float64 reference, on one process,
over data-parallel ranks and over a split vocabulary."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import gbc_kernels as gbc
import gbc_reference as ref

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import spawn_gloo  # noqa: E402

V_ = 40


def make(sizes, k=6, T=8, H=12, V=V_, seed=0, correct=None, pad=0.3, dup=0.2, miss=0.2,
         spread=2.0):
    """Groups whose responses share tokens (a small sub-vocabulary per group, as answers to one
    prompt do), interleaved in the batch; each token's support ``[k]``: some of the group's
    sub-vocabulary and other ids, ``-1`` padding anywhere, duplicates, and the target itself
    missing from a share ``miss`` of the rows (k = 1: the target or one other id)."""
    g = torch.Generator().manual_seed(seed)
    B = sum(sizes)
    gid = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
    targets = torch.empty(B, T, dtype=torch.long)
    subs = []
    for i in range(len(sizes)):
        sub = torch.randperm(V, generator=g)[:8]
        subs.append(sub)
        rows = (gid == i).nonzero().flatten()
        targets[rows] = sub[torch.randint(0, 8, (len(rows), T), generator=g)]
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True
    if correct is None:
        correct = torch.rand(B, generator=g) < 0.5
        correct[0], correct[1] = True, False
    ids = torch.randint(0, V, (B, T, k), generator=g)
    near = torch.rand(B, T, k, generator=g) < 0.5          # half from the group's sub-vocab
    for i, sub in enumerate(subs):
        rows = (gid == i)
        pick = sub[torch.randint(0, 8, (int(rows.sum()), T, k), generator=g)]
        ids[rows] = torch.where(near[rows], pick, ids[rows])
    has_y = torch.rand(B, T, generator=g) >= miss
    slot = torch.randint(0, k, (B, T), generator=g)
    ids.scatter_(-1, slot.unsqueeze(-1), torch.where(has_y, targets, ids.gather(
        -1, slot.unsqueeze(-1)).squeeze(-1)).unsqueeze(-1))
    if k > 1:
        d = (torch.rand(B, T, k, generator=g) < dup) & (torch.arange(k) != slot.unsqueeze(-1))
        ids = torch.where(d, ids.gather(-1, slot.unsqueeze(-1)).expand_as(ids), ids)
        p = (torch.rand(B, T, k, generator=g) < pad) & (torch.arange(k) != slot.unsqueeze(-1))
        ids = ids.masked_fill(p, -1)
    ids = ids.masked_fill(~mask.unsqueeze(-1), 999)         # masked-out tokens: ignored
    perm = torch.randperm(B, generator=g)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (spread / H ** 0.5)
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.3
    return dict(hidden=hidden[perm], weight=weight, bias=bias, targets=targets[perm],
                mask=mask[perm], group_ids=gid[perm], correct=correct[perm],
                support_ids=ids[perm])


def cast(d, dtype):
    return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in d.items()}


def call(lib, d, **kw):
    return lib.nthr_scale(d["hidden"], d["weight"], d["targets"], d["mask"], d["group_ids"],
                          d["correct"], bias=d["bias"], **kw)


def compare(ours, truth, tol):
    """Scores and thresholds within ``tol`` of the reference's largest score; the selections
    and scales agree wherever the score is not within rounding of the threshold. Returns the
    relative max error of the scores."""
    s_ref = truth.scores.double()
    scale = float(s_ref.abs().max().clamp(min=1e-6))
    err = float((ours.scores.double() - s_ref).abs().max()) / scale
    assert err <= tol, err
    assert set(ours.thresholds) == set(truth.thresholds)
    for g, tau in truth.thresholds.items():
        assert abs(ours.thresholds[g] - tau) <= tol * scale
    clear = torch.ones_like(truth.selected)
    for tau in truth.thresholds.values():
        clear &= (s_ref - tau).abs() > 10 * tol * scale
    assert torch.equal(ours.selected & clear, truth.selected & clear)
    assert torch.allclose(ours.scale[clear], truth.scale[clear])
    return err


CASES = [  # k, temperature, softcap, logp given, dtype
    (1, 1.0, None, False, torch.float32),
    (1, 0.7, None, True, torch.float32),
    (6, 1.0, None, False, torch.float32),
    (6, 1.0, None, True, torch.float32),
    (6, 0.7, None, False, torch.float32),
    (6, 1.3, 3.0, True, torch.float32),
    (6, 0.8, 3.0, False, torch.float32),
    (16, 1.0, None, False, torch.float32),
    (6, 1.0, None, False, torch.bfloat16),
    (6, 0.7, 3.0, True, torch.bfloat16),
]


@pytest.mark.parametrize("k,temp,cap,with_logp,dtype", CASES)
def test_support_nthr_matches_float64_reference(backend, small_chunks, k, temp, cap, with_logp,
                                                dtype):
    d = cast(make([4, 5, 3], k=k, seed=k * 13 + int(temp * 10) + int(cap or 0) * 3 + with_logp),
             dtype)
    kw = dict(temperature=temp, logit_softcap=cap, support_ids=d["support_ids"])
    if with_logp:          # the old-policy pass's log-probs over the same support
        # float32 logits from the bf16 operands, as the comparison below assumes: the default
        # mode is the head's dtype on a CPU with bf16 units (bf16-rounded logits, ~2e-2 off)
        kw["logp"] = gbc.fused_linear_logprobs(
            d["hidden"], d["weight"], d["targets"].masked_fill(~d["mask"], 0), bias=d["bias"],
            temperature=temp, logit_softcap=cap, backend=backend, logits_dtype=torch.float32,
            support_ids=d["support_ids"].masked_fill(~d["mask"].unsqueeze(-1), -1))[0]
    for beta in (1.0, 0.0):
        ours = call(gbc, d, beta=beta, backend=backend, **kw)
        truth = call(ref, cast(d, torch.float64), beta=beta,
                     **{k_: v for k_, v in kw.items() if k_ != "logp"})
        compare(ours, truth, 1e-4)      # bf16: float32 products of the same bf16 values
        assert not (ours.selected & d["correct"].unsqueeze(-1)).any()
        assert not (ours.selected & ~d["mask"]).any()
    # the support does change the result (k = 1: q = 1 on the target, so e = 0 on S)
    full = call(ref, cast(d, torch.float64), temperature=temp, logit_softcap=cap)
    assert not torch.allclose(full.scores, truth.scores)


def test_k1_own_target_scores_zero():
    """k = 1 with the target as the only member: q_y = 1, e = 0, every score 0, nothing
    selected (tau = 0, the comparison strict)."""
    d = make([4, 4], k=1, miss=0.0, seed=3)
    res = call(gbc, d, support_ids=d["support_ids"], beta=0.0)
    assert torch.equal(res.scores, torch.zeros_like(res.scores)) and not res.selected.any()


def test_mixed_and_all_correct_groups():
    """A mixed group is scored; an all-correct and an all-incorrect group keep scale 1 and no
    threshold, with a support as without."""
    d = make([4, 3, 3], seed=5, correct=torch.tensor([1, 0, 1, 0, 1, 1, 1, 0, 0, 0]).bool())
    ours = call(gbc, d, support_ids=d["support_ids"], beta=0.0)
    truth = call(ref, d, support_ids=d["support_ids"], beta=0.0)
    compare(ours, truth, 1e-4)
    assert set(ours.thresholds) == {0}
    rest = d["group_ids"] != 0
    assert torch.equal(ours.scale[rest], torch.ones_like(ours.scale[rest]))
    assert not ours.selected[rest].any() and not ours.scores[rest].any()
    assert ours.selected.any()


def test_none_unchanged_and_full_support_is_the_vocabulary(backend):
    """``support_ids=None`` is the call without it, bit for bit; a support of every id gives
    the full-vocabulary result (to rounding: its LSE is formed another way)."""
    d = cast(make([4, 5, 3], seed=9), torch.float32)
    a = call(gbc, d, backend=backend)
    b = call(gbc, d, backend=backend, support_ids=None)
    for x, y in zip(a[:3], b[:3]):
        assert torch.equal(x, y)
    assert a.thresholds == b.thresholds
    every = torch.arange(V_).expand(*d["targets"].shape, V_)
    c = call(gbc, d, backend=backend, support_ids=every, temperature=1.0)
    compare(c, call(ref, cast(d, torch.float64)), 1e-4)
    compare(a, call(ref, cast(d, torch.float64)), 1e-4)


@pytest.mark.parametrize("bad,err,match", [
    (lambda d: d["support_ids"][..., 0], ValueError, r"support_ids: expected shape"),
    (lambda d: d["support_ids"].float(), TypeError, r"support_ids: expected an integer"),
    (lambda d: d["support_ids"].masked_fill(
        d["mask"].unsqueeze(-1) & (torch.arange(6) == 0), V_), ValueError,
     r"support_ids: expected ids in \[-1, 40\)"),
    (lambda d: d["support_ids"].masked_fill(
        d["mask"].unsqueeze(-1) & (torch.arange(6) == 0), -2), ValueError,
     r"support_ids: expected ids in \[-1, 40\)"),
    (lambda d: d["support_ids"].tolist(), TypeError, r"support_ids: expected None or an"),
])
def test_bad_support_ids_are_refused_by_name(bad, err, match):
    d = make([4, 4], seed=1)
    with pytest.raises(err, match=match):
        call(gbc, d, support_ids=bad(d))


def _dp_worker(rank, world, d, rows_of):
    rows = rows_of[rank]
    res = gbc.nthr_scale(d["hidden"][rows], d["weight"], d["targets"][rows], d["mask"][rows],
                         d["group_ids"][rows], d["correct"][rows], bias=d["bias"],
                         temperature=0.8, beta=0.0, support_ids=d["support_ids"][rows],
                         data_parallel_group="world")
    return tuple(res)


def _vp_worker(rank, world, d, with_logp):
    V = d["weight"].shape[0]
    lo, hi = (0, 17) if rank == 0 else (17, V)
    kw = dict(temperature=0.8, beta=0.0, support_ids=d["support_ids"], logit_softcap=3.0,
              vocab_parallel=gbc.VocabParallel(None, lo, hi))
    if with_logp:
        kw["logp"] = gbc.fused_linear_logprobs(
            d["hidden"], d["weight"][lo:hi], d["targets"].masked_fill(~d["mask"], 0),
            bias=d["bias"][lo:hi], temperature=0.8, logit_softcap=3.0,
            vocab_parallel=kw["vocab_parallel"],
            support_ids=d["support_ids"].masked_fill(~d["mask"].unsqueeze(-1), -1))[0]
    res = gbc.nthr_scale(d["hidden"], d["weight"][lo:hi], d["targets"], d["mask"],
                         d["group_ids"], d["correct"], bias=d["bias"][lo:hi], **kw)
    return tuple(res)


def test_support_nthr_over_data_parallel_ranks_and_a_split_vocabulary():
    """Over two data-parallel ranks (groups split over them) and over a vocabulary split in two
    (``logp`` given and not): each rank's result is the one-process result."""
    d = make([4, 4, 4], seed=21, correct=torch.tensor([1, 0, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1])
             .bool())
    one = call(gbc, d, temperature=0.8, beta=0.0, support_ids=d["support_ids"])
    compare(one, call(ref, cast(d, torch.float64), temperature=0.8, beta=0.0,
                      support_ids=d["support_ids"]), 1e-4)
    assert one.selected.any()
    rows_of = [torch.tensor([0, 2, 3, 7, 9]), torch.tensor([1, 4, 5, 6, 8, 10, 11])]
    for rows, (scale, selected, scores, _) in zip(rows_of, spawn_gloo(2, _dp_worker, d,
                                                                      rows_of)):
        assert torch.equal(selected, one.selected[rows])
        assert torch.allclose(scale, one.scale[rows])
        assert torch.allclose(scores, one.scores[rows], atol=1e-5 * float(one.scores.abs().max()))
    capped = call(ref, cast(d, torch.float64), temperature=0.8, beta=0.0, logit_softcap=3.0,
                  support_ids=d["support_ids"])
    for with_logp in (False, True):
        for res in spawn_gloo(2, _vp_worker, d, with_logp):
            compare(gbc.NTHRResult(*res), capped, 1e-4)
