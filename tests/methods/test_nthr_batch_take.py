"""methods.NTHRBatch kept from one pass and renumbered to another batch of the same samples
(verl's old-log-prob pass and its update batch, rows in another order): ``take`` gives the
result of a pass over the update batch itself, bitwise; ``nbytes`` counts what is held."""

from __future__ import annotations

import torch

from conftest import make_batch
from gbc_kernels import methods
from gbc_kernels.integrations.hf import LMHead


def _pass(b, order, micro):
    """A pass whose row r is the sample order[r], in micro-batches of ``micro`` rows."""
    h, w, y = b["hidden"], b["weight"], b["targets"]
    batch = methods.NTHRBatch(y, backend="torch")
    for s in range(0, len(order), micro):
        rows = list(range(s, min(s + micro, len(order))))
        src = torch.tensor([order[r] for r in rows])
        batch.add(rows, h[src], y[src], torch.ones(len(rows), y.shape[1], dtype=torch.bool),
                  LMHead(w, b["bias"]), temperature=0.7)
    return batch


def test_take_renumbers_to_the_update_batch():
    b = make_batch(B=6, T=5, H=8, V=37, seed=4, bias=True, empty_row=False, adv_shape="BT",
                   logit_scale=8 ** 0.5, dtype=torch.float64)
    m, adv = b["mask"], b["advantages"]
    gids = torch.tensor([0, 0, 0, 1, 1, 1])
    opts = methods.MethodOptions(nthr=True, nthr_beta=0.0)
    update = [3, 0, 5, 1, 4, 2]           # the update batch's row u is sample update[u]
    want, _ = _pass(b, update, 6).result(m[update], gids[update], adv[update], opts)
    assert want.selected.any()
    kept = _pass(b, list(range(6)), 6)    # the old-log-prob pass, samples in their own order
    held = kept.nbytes()
    expect = sum(t.numel() * t.element_size() for row in kept.rows for t in row)
    expect += sum(t.numel() * t.element_size() for t in kept.head[:2])
    assert held == expect > 0
    assert kept.take(torch.tensor(update))
    got, _ = kept.result(m[update], gids[update], adv[update], opts)
    assert torch.equal(got.scale, want.scale) and torch.equal(got.selected, want.selected)


def test_take_refuses_a_row_it_does_not_hold():
    b = make_batch(B=4, T=3, H=4, V=11, seed=2, bias=False, empty_row=False)
    b["targets"] = b["targets"].clamp(min=0)
    kept = _pass(b, [0, 1, 2], 2)
    rows_before = [r[0].clone() for r in kept.rows]
    assert not kept.take(torch.tensor([2, 3]))
    assert len(kept.rows) == len(rows_before) and all(
        torch.equal(r[0], before) for r, before in zip(kept.rows, rows_before))
    assert kept.take(torch.tensor([2, 2, 0]))       # one row may feed two
    assert sorted(int(i) for r in kept.rows for i in r[0]) == [0, 1, 2]
