"""Numbers users can trust: the bf16 weight gradient summed over chunks in float32.

Measured on the ``cpu`` backend (bf16, N=512, H=64, V=4096, relative Frobenius error of
``grad_weight`` against float64 from the same bf16 inputs), 1 / 4 / 16 / 64 chunks:

    GBC_WEIGHT_GRAD_ACCUM=native   (the running sum rounded to bf16 at every chunk)
        2.33e-3 / 2.86e-3 / 3.60e-3 / 4.12e-3     (torch backend: up to 4.45e-3)
    GBC_WEIGHT_GRAD_ACCUM=float32  (the default: one rounding at the end)
        2.33e-3 / 2.33e-3 / 2.33e-3 / 2.33e-3

One chunk is the floor (the final rounding of the result to bf16); with float32 accumulation the
error no longer grows with the chunk count.
"""

from __future__ import annotations

import pytest
import torch

import gbc_kernels as gbc

N, H, V = 512, 64, 4096


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) / 8).bfloat16()
    y = torch.randint(0, V, (N,), generator=g)
    up = torch.randn(N, generator=g)
    return h, w, y, up


def _truth(h, w, y, up):
    w64 = w.double().requires_grad_(True)
    lp = torch.log_softmax(h.double() @ w64.T, -1).gather(1, y[:, None])[:, 0]
    (lp * up.double()).sum().backward()
    return w64.grad


def _chunk_mb(backend, chunks):
    """A GBC_CHUNK_MB that gives about ``chunks`` chunks of N rows of bf16 V-wide logits."""
    from gbc_kernels.backends import get_backend

    per_row = V * get_backend(backend, torch.device("cpu"), torch.bfloat16).bytes_per_logit(
        torch.bfloat16)
    return f"{(N // chunks) * per_row / 2 ** 20:.6f}"


def _rel_err(backend, chunks, mode, monkeypatch, fn):
    monkeypatch.setenv("GBC_WEIGHT_GRAD_ACCUM", mode)
    if chunks > 1:
        monkeypatch.setenv("GBC_CHUNK_MB", _chunk_mb(backend, chunks))
    else:
        monkeypatch.delenv("GBC_CHUNK_MB", raising=False)
    h, w, y, up = _inputs()
    ww = w.clone().requires_grad_(True)
    fn(h, ww, y, up, backend).backward()
    assert ww.grad.dtype == torch.bfloat16
    truth = _truth(h, w, y, up)
    return float((ww.grad.double() - truth).norm() / truth.norm())


def _logprobs(h, w, y, up, backend):
    # the operands' dtype mode (bf16 logits and gradient products), where the accumulator
    # matters: the CPU default is float32 mode, whose products are float32 already
    lp, _ = gbc.fused_linear_logprobs(h, w, y, backend=backend, logits_dtype="input")
    return (lp * up).sum()


def _fused_loss(h, w, y, up, backend):
    """A loss whose d/dlogp is ``up``: policy term -A r with A = up at r = 1 (old = logp), token
    sum (seq-mean-token-sum over one sequence)."""
    cfg = gbc.PolicyLossConfig(loss_agg="seq-mean-token-sum", epsilon_low=0.5, epsilon_high=0.5)
    mask = torch.ones(1, N, dtype=torch.bool)
    loss, _ = gbc.fused_linear_policy_loss(h[None], w, y[None], mask, -up[None], config=cfg,
                                           backend=backend, logits_dtype="input")
    return loss


@pytest.mark.parametrize("fn", [_logprobs, _fused_loss], ids=["logprobs", "fused-loss"])
def test_bf16_weight_grad_error_does_not_grow_with_chunks(backend, fn, monkeypatch):
    if backend == "triton":
        pytest.skip("the Triton interpreter takes minutes at this size; its gradient matmuls "
                    "are the same _GradMatmuls (torch.mm) as every backend's")
    errs = {c: _rel_err(backend, c, "float32", monkeypatch, fn) for c in (1, 4, 16, 64)}
    native = _rel_err(backend, 64, "native", monkeypatch, fn)
    assert errs[1] < 3e-3                               # bf16's rounding of the result
    for c in (4, 16, 64):
        assert errs[c] <= 1.05 * errs[1], errs
    assert native > 1.3 * errs[64], (native, errs)     # what the accumulator buys


def test_triton_weight_grad_fp32_accumulation(monkeypatch):
    """The Triton backend (interpreter, a smaller case): 1 vs 8 chunks, float32 accumulation
    keeps the error of one chunk."""
    from conftest import BACKENDS

    if "triton" not in BACKENDS:
        pytest.skip("needs triton")
    g = torch.Generator().manual_seed(1)
    n, vocab = 64, 257
    h = torch.randn(n, 16, generator=g).bfloat16()
    w = (torch.randn(vocab, 16, generator=g) / 4).bfloat16()
    y = torch.randint(0, vocab, (n,), generator=g)
    up = torch.randn(n, generator=g)
    w64 = w.double().requires_grad_(True)
    (torch.log_softmax(h.double() @ w64.T, -1).gather(1, y[:, None])[:, 0] * up.double()
     ).sum().backward()
    errs = {}
    for mode, mb in (("float32", None), ("float32", "0.005"), ("native", "0.005")):
        monkeypatch.setenv("GBC_WEIGHT_GRAD_ACCUM", mode)
        if mb:
            monkeypatch.setenv("GBC_CHUNK_MB", mb)
        else:
            monkeypatch.delenv("GBC_CHUNK_MB", raising=False)
        ww = w.clone().requires_grad_(True)
        lp, _ = gbc.fused_linear_logprobs(h, ww, y, backend="triton", logits_dtype="input")
        (lp * up).sum().backward()
        errs[(mode, mb)] = float((ww.grad.double() - w64.grad).norm() / w64.grad.norm())
    assert errs[("float32", "0.005")] <= 1.05 * errs[("float32", None)], errs


def test_accumulator_env_refuses_unknown(monkeypatch):
    h, w, y, up = _inputs()
    monkeypatch.setenv("GBC_WEIGHT_GRAD_ACCUM", "fp64")
    monkeypatch.setenv("GBC_CHUNK_MB", "0.5")
    with pytest.raises(ValueError, match="GBC_WEIGHT_GRAD_ACCUM: expected 'float32' or "
                                         "'native', got 'fp64'"):
        _logprobs(h, w.clone().requires_grad_(True), y, up, "torch").backward()


def test_float32_weights_unchanged(monkeypatch):
    """A float32 weight needs no accumulator: both settings give the same bits."""
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(128, 16, generator=g), torch.randn(300, 16, generator=g)
    y = torch.randint(0, 300, (128,), generator=g)
    monkeypatch.setenv("GBC_CHUNK_MB", "0.02")
    grads = []
    for mode in ("float32", "native"):
        monkeypatch.setenv("GBC_WEIGHT_GRAD_ACCUM", mode)
        ww = w.clone().requires_grad_(True)
        gbc.fused_linear_logprobs(h, ww, y, backend="torch")[0].sum().backward()
        grads.append(ww.grad)
    assert torch.equal(*grads)


# ----------------------------------------------------------------------------------------------
# batch-invariant log-probs
# ----------------------------------------------------------------------------------------------


def _blas_row_invariant(dtype, H, V):
    """Whether this machine's matmul gives a row the same bits in a 16-row product as in a
    513-row one (true of the BLAS seen here for fp32 and bf16; a GEMV, 1 row, differs)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(513, H, generator=g).to(dtype)
    w = torch.randn(V, H, generator=g).to(dtype)
    return torch.equal((x[:16] @ w.T), (x @ w.T)[:16])


def _seq_batch(dtype, V=3001, H=48, seed=11):
    """A sequence ``s`` (hidden states, targets) and three batches holding it: other sequences
    around it, padded differently (left / right / none), in another order."""
    g = torch.Generator().manual_seed(seed)
    L = 23
    s_h = torch.randn(L, H, generator=g).to(dtype)
    s_y = torch.randint(0, V, (L,), generator=g)
    w = (torch.randn(V, H, generator=g) / H ** 0.5).to(dtype)
    batches = []
    for B, T, pos, left in ((3, 30, 1, True), (6, 41, 4, False), (1, 23, 0, False)):
        h = torch.randn(B, T, H, generator=g).to(dtype)
        y = torch.randint(0, V, (B, T), generator=g)
        m = torch.rand(B, T, generator=g) < 0.6
        off = T - L if left else 0
        h[pos, off:off + L], y[pos, off:off + L] = s_h, s_y
        m[pos] = False
        m[pos, off:off + L] = True
        batches.append((h, y, m, pos, slice(off, off + L)))
    return w, batches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batch_invariant_logprobs(backend, dtype, monkeypatch):
    """``GBC_BATCH_INVARIANT=1``: a sequence's log-probs and entropies are bitwise the same
    inside different batches (other sequences, padding, order), through
    ``fused_linear_logprobs``, ``token_stats`` and inside the fused loss (its on-policy ratio is
    exactly 1: ``log_ratio_mean`` 0, no clipping at epsilon 1e-7); by construction, every logits
    matmul having the same shape."""
    if backend == "triton" and dtype == torch.bfloat16:
        pytest.skip("the interpreter's bf16 tiles are slow; fp32 covers the Triton path")
    monkeypatch.setenv("GBC_BATCH_INVARIANT", "1")
    monkeypatch.setenv("GBC_CHUNK_MB", "0.3")            # several chunks, the last one padded
    w, batches = _seq_batch(dtype)
    seen = []
    for h, y, m, pos, sl in batches:
        lp, ent = gbc.fused_linear_logprobs(h, w, y, return_entropy=True, backend=backend)
        st = gbc.token_stats(h, w, y, backend=backend)
        seen.append((lp[pos, sl], ent[pos, sl], st.logp[pos, sl], st.entropy[pos, sl]))
        old = torch.where(m, lp, torch.zeros_like(lp))
        adv = torch.randn(m.shape[0])
        cfg = gbc.PolicyLossConfig(epsilon_low=1e-7, epsilon_high=1e-7, return_entropy=True)
        _, met = gbc.fused_linear_policy_loss(h, w, y, m, adv, old_logp=old, config=cfg,
                                              backend=backend)
        assert float(met["log_ratio_mean"]) == 0.0 and float(met["ratio_mean"]) == 1.0
        assert float(met["clip_frac_low"]) == 0.0 and float(met["clip_frac_high"]) == 0.0
    for other in seen[1:]:
        for a, b in zip(seen[0], other):
            assert torch.equal(a, b)
    assert torch.equal(seen[0][0], seen[0][2]) and torch.equal(seen[0][1], seen[0][3])


@pytest.mark.parametrize("invariant", ["0", "1"], ids=["default", "fixed-shape"])
def test_logprobs_equal_inside_the_loss(backend, invariant, monkeypatch):
    """The log-probs of the training pass are those of the no-grad pass: an on-policy loss has
    ratio exactly 1 (the C++ token kernel rounds ``z_y - LSE`` as the row pass does). The
    default chunking relies on the BLAS giving a row the same bits at any row count >= 16
    (probed first); fixed-shape chunks do not."""
    monkeypatch.setenv("GBC_BATCH_INVARIANT", invariant)
    dtype = torch.float32
    if invariant == "0" and not _blas_row_invariant(dtype, 48, 3001):
        pytest.skip("this machine's BLAS gives a row other bits at another row count")
    w, batches = _seq_batch(dtype, seed=5)
    h, y, m, _, _ = batches[1]
    lp, _ = gbc.fused_linear_logprobs(h, w, y, backend=backend)
    old = torch.where(m, lp, torch.zeros_like(lp))
    for cfg in (gbc.PolicyLossConfig(epsilon_low=1e-7, epsilon_high=1e-7),
                gbc.PolicyLossConfig(epsilon_low=1e-7, epsilon_high=1e-7, kl_coef=0.1),
                gbc.PolicyLossConfig(importance_sampling_level="sequence", epsilon_low=1e-7,
                                     epsilon_high=1e-7)):
        _, met = gbc.fused_linear_policy_loss(h, w, y, m, torch.randn(m.shape[0]),
                                              old_logp=old, ref_logp=old, config=cfg,
                                              backend=backend)
        assert float(met["log_ratio_mean"]) == 0.0 and float(met["ratio_mean"]) == 1.0
        assert float(met["clip_frac_low"]) + float(met["clip_frac_high"]) == 0.0


def test_budget_change_keeps_logprobs(backend, monkeypatch):
    """Another ``GBC_CHUNK_MB`` (other chunk shapes) gives the same bits where the BLAS is
    row-invariant (probed; the fixed-shape mode cannot promise more: its shape is the
    budget's)."""
    if not _blas_row_invariant(torch.float32, 48, 3001):
        pytest.skip("this machine's BLAS gives a row other bits at another row count")
    w, batches = _seq_batch(torch.float32, seed=9)
    h, y, _, _, _ = batches[1]
    outs = []
    for mb in ("64", "0.3", "0.05"):
        monkeypatch.setenv("GBC_CHUNK_MB", mb)
        outs.append(gbc.fused_linear_logprobs(h, w, y, backend=backend)[0])
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_batch_invariant_env_refuses_unknown(monkeypatch):
    monkeypatch.setenv("GBC_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="GBC_BATCH_INVARIANT: expected"):
        gbc.fused_linear_logprobs(torch.randn(4, 8), torch.randn(11, 8),
                                  torch.zeros(4, dtype=torch.long))


def test_small_chunks_padded_to_min_rows(monkeypatch):
    """A one-row chunk is computed as a 16-row matmul (a GEMV would give other bits): its
    log-prob equals the same row's inside a bigger chunk on every machine whose BLAS is
    row-invariant from 16 rows."""
    from gbc_kernels import _chunking

    calls = []
    real = _chunking.project
    monkeypatch.setattr(_chunking, "project", lambda h, *a, **k: calls.append(h.shape[0])
                        or real(h, *a, **k))
    gbc.fused_linear_logprobs(torch.randn(1, 8), torch.randn(11, 8),
                              torch.zeros(1, dtype=torch.long), backend="torch")
    assert calls == [_chunking.MIN_ROWS]
