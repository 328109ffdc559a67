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
