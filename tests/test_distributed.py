"""Data-parallel normalisation (issue 8, first part): token-mean with the global token count
(``num_items_in_batch``, as DAPO and TRL pass it) gives, summed over DDP ranks, the gradient of
one process on the whole batch. Real processes, gloo backend, CPU."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gbc_kernels as gbc
from conftest import make_batch


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, batch, cfg, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = torch.arange(batch["mask"].shape[0]).chunk(world)[rank]   # uneven split
        n_global = batch["mask"].sum()                       # what every rank passes
        h = batch["hidden"][rows].clone().requires_grad_(True)
        w = batch["weight"].clone().requires_grad_(True)
        loss, _ = gbc.fused_linear_policy_loss(
            h, w, batch["targets"][rows], batch["mask"][rows], batch["advantages"][rows],
            batch["old_logp"][rows], batch["ref_logp"][rows], config=cfg,
            num_items_in_batch=n_global, backend="auto")
        loss.backward()
        gw = w.grad.clone()
        dist.all_reduce(gw)                                  # DDP sums (we do not average)
        total = loss.detach().clone()
        dist.all_reduce(total)
        gh = torch.zeros_like(batch["hidden"])
        gh[rows] = h.grad
        dist.all_reduce(gh)
        if rank == 0:
            out.put((float(total), gw, gh))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_token_mean_equals_single_process(world):
    batch = make_batch(B=7, T=6, H=8, V=23, seed=world, bias=False)
    cfg = gbc.PolicyLossConfig(loss_agg="dapo", kl_coef=0.1, ar_alpha=0.2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, batch, cfg, q))
             for r in range(world)]
    for p in procs:
        p.start()
    total, gw, gh = q.get(timeout=300)
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    h = batch["hidden"].clone().requires_grad_(True)
    w = batch["weight"].clone().requires_grad_(True)
    loss, _ = gbc.fused_linear_policy_loss(h, w, batch["targets"], batch["mask"],
                                           batch["advantages"], batch["old_logp"],
                                           batch["ref_logp"], config=cfg)
    loss.backward()
    assert abs(total - float(loss)) < 1e-6
    assert torch.allclose(gw, w.grad, rtol=1e-5, atol=1e-7)
    assert torch.allclose(gh, h.grad, rtol=1e-5, atol=1e-7)

