"""methods.NTHRBatch (the micro-batched old-policy pass of verl's engine and OpenRLHF) against
methods.nthr_token_scale on the whole batch with the full lm_head, in float64: micro-batches of
uneven sizes, in a shuffled order, shorter than the batch's T; the head rows it keeps are the
batch's ids only."""

from __future__ import annotations

import pytest
import torch

from conftest import make_batch
from gbc_kernels import methods
from gbc_kernels.integrations.hf import LMHead


@pytest.mark.parametrize("bias", [False, True])
def test_micro_batched_pass_equals_whole_batch(bias):
    b = make_batch(B=6, T=7, H=8, V=41, seed=3, bias=bias, empty_row=False, adv_shape="BT",
                   logit_scale=8 ** 0.5, dtype=torch.float64)
    h, w, y, m, adv = (b[k] for k in ("hidden", "weight", "targets", "mask", "advantages"))
    gids = torch.tensor([0, 0, 0, 1, 1, 1])
    opts = methods.MethodOptions(nthr=True, nthr_beta=0.0)
    want = methods.nthr_token_scale(h, w, y, m, gids, adv, opts, bias=b["bias"],
                                    temperature=0.7)
    assert want.selected.any()
    batch = methods.NTHRBatch(y, backend="torch")
    assert batch.ids.tolist() == sorted(set(y.reshape(-1).tolist()))
    for rows, t in (([4, 1], 7), ([0, 5, 2], 6), ([3], 7)):      # the last column of [0, 5, 2]
        rows_t = torch.tensor(rows)                                 # is masked out there
        m[rows_t, t:] = False
        batch.add(rows, h[rows_t, :t], y[rows_t, :t], torch.ones(len(rows), t, dtype=torch.bool),
                  LMHead(w, b["bias"]), temperature=0.7)
    assert batch.head[0].shape[0] == batch.ids.numel() < w.shape[0]
    got, metrics = batch.result(m, gids, adv, opts)
    want = methods.nthr_token_scale(h, w, y, m, gids, adv, opts, bias=b["bias"],
                                    temperature=0.7)
    assert torch.equal(got.selected, want.selected)
    assert torch.allclose(got.scale.double(), want.scale.double(), atol=1e-9)
    assert metrics.keys() == methods.nthr_metrics(want, adv, m).keys()


def test_differing_temperatures_are_refused():
    b = make_batch(B=2, T=3, H=4, V=9, seed=1, bias=False)
    batch = methods.NTHRBatch(b["targets"].clamp(min=0))
    head = LMHead(b["weight"], None)
    for k, temp in enumerate((1.0, torch.tensor([0.5]))):
        batch.add([k], b["hidden"][k:k + 1], b["targets"][k:k + 1].clamp(min=0),
                  b["mask"][k:k + 1], head, temperature=temp)
    with pytest.raises(ValueError, match="^nthr: the rollout temperatures"):
        batch.result(b["mask"], torch.zeros(2, dtype=torch.long), b["advantages"],
                     methods.MethodOptions(nthr=True))


def _vocab_parallel_worker(rank, world, dtype, bias):
    """Each rank holds an uneven slice of the head; the same micro-batches as above."""
    import gbc_kernels as gbc

    b = make_batch(B=6, T=7, H=8, V=41, seed=3, bias=bias, empty_row=False, adv_shape="BT",
                   logit_scale=8 ** 0.5, dtype=dtype)
    h, w, y, m, adv = (b[k] for k in ("hidden", "weight", "targets", "mask", "advantages"))
    cut = (0, 17, 41)
    vp = gbc.VocabParallel(None, cut[rank], cut[rank + 1])
    shard = LMHead(w[cut[rank]:cut[rank + 1]],
                   None if b["bias"] is None else b["bias"][cut[rank]:cut[rank + 1]])
    batch = methods.NTHRBatch(y, backend="torch")
    logps = []
    for rows, t in (([4, 1], 7), ([0, 5, 2], 6), ([3], 7)):
        rows_t = torch.tensor(rows)
        m[rows_t, t:] = False
        logps.append(batch.add(rows, h[rows_t, :t], y[rows_t, :t],
                               torch.ones(len(rows), t, dtype=torch.bool), shard,
                               temperature=0.7, vocab_parallel=vp))
    got, _ = batch.result(m, torch.tensor([0, 0, 0, 1, 1, 1]), adv,
                          methods.MethodOptions(nthr=True, nthr_beta=0.0))
    return got, batch_whole(b, m), logps


def batch_whole(b, m):
    """The one-process result on the whole head, and the whole head's log-probs."""
    opts = methods.MethodOptions(nthr=True, nthr_beta=0.0)
    want = methods.nthr_token_scale(b["hidden"], b["weight"], b["targets"], m,
                                    torch.tensor([0, 0, 0, 1, 1, 1]), b["advantages"], opts,
                                    bias=b["bias"], temperature=0.7)
    z = b["hidden"].double() @ b["weight"].double().t()
    if b["bias"] is not None:
        z = z + b["bias"].double()
    logp = torch.log_softmax(z / 0.7, -1).gather(-1, b["targets"][..., None])[..., 0]
    return want, logp


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_vocab_parallel_pass_equals_whole_head(dtype, bias):
    """``add(vocab_parallel=)``: two ranks with uneven slices of the head give the one-process
    scales of the whole head (the rows of the batch's ids assembled from both slices) and
    float64 log-probs of the whole vocabulary."""
    from conftest import spawn_gloo

    for got, (want, logp), logps in spawn_gloo(2, _vocab_parallel_worker, dtype, bias):
        assert want.selected.any()
        assert torch.equal(got.selected, want.selected)
        assert torch.allclose(got.scale.double(), want.scale.double(), atol=1e-6)
        for (rows, t), lp in zip((([4, 1], 7), ([0, 5, 2], 6), ([3], 7)), logps):
            tol = 2e-6 if dtype == torch.float64 else 1e-5      # log-probs are float32
            torch.testing.assert_close(lp.double(), logp[rows, :t], rtol=tol, atol=tol)


def _temperature_worker(rank, world):
    b = make_batch(B=2, T=3, H=4, V=9, seed=1, bias=False)
    batch = methods.NTHRBatch(b["targets"].clamp(min=0), group="world")
    batch.add([0, 1], b["hidden"], b["targets"].clamp(min=0), b["mask"],
              LMHead(b["weight"], None), temperature=0.7 + 0.1 * rank)
    try:
        batch.result(b["mask"], torch.zeros(2, dtype=torch.long), b["advantages"],
                     methods.MethodOptions(nthr=True))
    except ValueError as e:
        return str(e)
    return None


def test_temperatures_differing_between_ranks_are_refused_on_every_rank():
    """One temperature per data-parallel rank, different: every rank refuses (none is left
    waiting in a collective)."""
    from conftest import spawn_gloo

    for msg in spawn_gloo(2, _temperature_worker):
        assert msg is not None and msg.startswith("nthr: the rollout temperatures")
