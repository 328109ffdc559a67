"""The chunked loss never materialises [N, V]: peak RSS, measured in a fresh process, grows by
far less than one float32 [N, V] logits tensor would take."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    import gbc_kernels as gbc
    torch.manual_seed(0)
    N, H, V = 8192, 64, 32768          # one fp32 [N, V] = 1 GiB
    B, T = 8, N // 8
    hidden = torch.randn(B, T, H, requires_grad=True)
    weight = (torch.randn(V, H) / 8).requires_grad_(True)
    targets = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    adv = torch.randn(B)
    old = torch.randn(B, T) - 10
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loss, metrics = gbc.fused_linear_policy_loss(hidden, weight, targets, mask, adv, old,
        old + 0.1, config=gbc.PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01),
        backend=sys.argv[1])
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"base_kb": base, "peak_kb": peak, "loss": float(loss)}))
""")


@pytest.mark.slow
def test_peak_memory_far_below_one_logits_tensor(backend):
    if backend == "triton":
        pytest.skip("the Triton interpreter's memory is not the GPU's; measured on a GPU by "
                    "tests/test_gpu.py::test_loss_memory_on_gpu")
    env = dict(os.environ, GBC_CHUNK_MB="64", OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", SCRIPT, backend], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grown_mb = (r["peak_kb"] - r["base_kb"]) / 1024
    one_logits_mb = 8192 * 32768 * 4 / 2 ** 20
    # the gradients of hidden [N, H] and weight [V, H] are 10 MiB together; everything else is
    # the chunk working set
    assert grown_mb < 0.15 * one_logits_mb, (grown_mb, one_logits_mb)


@pytest.mark.parametrize("H,V", [(3584, 151936), (4096, 128256), (512, 32771)])
@pytest.mark.parametrize("N", [1000, 4096, 8192, 16384])
def test_cuda_chunk_budget(monkeypatch, H, V, N):
    """The CUDA default chunk size (a pure function of the shapes: no GPU needed): within the
    1 GiB budget; chunk buffer + gradients within half of one fp32 [N, V] wherever chunks of
    GPU_MIN_ROWS rows allow it, else the plain budget; GBC_CHUNK_MB overrides both."""
    import torch
    from gbc_kernels import _chunking as C
    monkeypatch.delenv("GBC_CHUNK_MB", raising=False)
    cuda = torch.device("cuda")
    grads = V * H * 2 + N * H * 2                      # bf16 grad_weight and grad_hidden
    rows = C.rows_per_chunk(N, V, 2, cuda, grads)
    plain = C.rows_per_chunk(N, V, 2, cuda)            # no gradients counted
    assert 1 <= rows <= N and rows <= plain
    assert rows * V * 2 <= C.DEFAULT_BUDGET_MB["cuda"] * 2 ** 20 + 128 * V * 2
    assert rows == N or rows % 128 == 0
    if N * V * 2 - grads >= C.GPU_MIN_ROWS * V * 2:    # the half-logits target is reachable
        assert rows * V * 2 + grads <= 0.5 * N * V * 4 + 128 * V * 2    # within one tile
        assert rows >= min(N, C.GPU_MIN_ROWS)
    else:
        assert rows == C.rows_per_chunk(N, V, 2, cuda, 0)
    monkeypatch.setenv("GBC_CHUNK_MB", "64")           # an explicit budget is taken as given
    env_rows = C.rows_per_chunk(N, V, 2, cuda, grads)
    assert env_rows == C.rows_per_chunk(N, V, 2, cuda, 0)
    assert env_rows * V * 2 <= 64 * 2 ** 20 + 128 * V * 2
