"""The Triton kernels compiled and run on a real CUDA GPU (skipped elsewhere: CI has none).

Same checks as the interpreter tests, on CUDA tensors: the fused loss, log-probs, statistics
and NTHR against the float64 reference, fp32 and bf16, odd vocabularies, empty rows, random
upstream gradients, multi-chunk sweeps, NaN-poisoned allocations (conftest); and the memory
claim measured by the CUDA allocator.
"""

from __future__ import annotations

import pytest
import torch

import gbc_kernels as gbc
import gbc_reference as ref
from conftest import as64, make_batch, max_rel_err
from test_policy_loss import CASES, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda(batch):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def cpu(out):
    loss, metrics, grads = out
    return (loss.cpu(), {k: v.cpu() for k, v in metrics.items()},
            {k: v.cpu() for k, v in grads.items()})


def check(out, truth, rtol_loss, rtol_grad, rtol_metric=1e-4):
    loss, metrics, grads = out
    tloss, tmetrics, tgrads = truth
    assert torch.isfinite(loss)
    assert abs(float(loss) - float(tloss)) <= rtol_loss * max(1.0, abs(float(tloss)))
    for k, g in grads.items():
        assert torch.isfinite(g).all(), k
        assert max_rel_err(g.float(), tgrads[k].float()) <= rtol_grad, \
            (k, max_rel_err(g.float(), tgrads[k].float()))
    assert set(metrics) == set(tmetrics)
    for k, v in metrics.items():
        assert abs(float(v) - float(tmetrics[k])) <= rtol_metric * max(1.0, abs(float(tmetrics[k]))), k


@pytest.mark.parametrize("cfg,phase", CASES)
def test_triton_fp32_on_gpu_matches_float64_reference(cfg, phase, small_chunks):
    batch = make_batch(B=6, T=33, H=64, V=1001, seed=len(str(cfg)), old_spread=3.0)
    up = torch.randn(()).item()
    out = cpu(run(gbc, cuda(batch), cfg, phase, up, "triton"))
    truth = run(ref, as64(batch), cfg, phase, up)
    check(out, truth, 1e-5, 1e-4)


@pytest.mark.parametrize("cfg,phase", CASES[:4] + CASES[-1:])
def test_triton_bf16_on_gpu(cfg, phase):
    """bf16 inputs: logits from the bf16 matmul, float32 reductions; compared with the float64
    reference on the same bf16-rounded inputs."""
    batch = make_batch(B=4, T=65, H=128, V=4099, dtype=torch.bfloat16, seed=3)
    up = 0.8
    out = cpu(run(gbc, cuda(batch), cfg, phase, up, "triton"))
    truth = run(ref, as64(batch), cfg, phase, up)
    check(out, truth, 2e-2, 3e-2, rtol_metric=3e-2)


def test_large_vocab_fp32(small_chunks):
    """V = 128257 (not a multiple of any tile), several chunks of rows."""
    batch = make_batch(B=2, T=40, H=64, V=128257, seed=7)
    cfg = dict(loss_agg="grpo", kl_coef=0.05, ar_alpha=0.3, entropy_coef=0.01)
    out = cpu(run(gbc, cuda(batch), cfg, None, 1.3, "triton"))
    truth = run(ref, as64(batch), cfg, None, 1.3)
    check(out, truth, 1e-5, 2e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_entropy_and_stats_on_gpu(dtype):
    b = make_batch(B=3, T=17, H=96, V=5003, dtype=dtype, seed=11)
    g = torch.Generator().manual_seed(0)
    up = torch.randn(2, 3, 17, generator=g)
    targets = b["targets"].clamp(min=0)
    outs = []
    for lib, dev, d in ((gbc, "cuda", dtype), (ref, "cpu", torch.float64)):
        h = b["hidden"].to(dev, d).requires_grad_(True)
        w = b["weight"].to(dev, d).requires_grad_(True)
        bias = b["bias"].to(dev, d).requires_grad_(True)
        kw = dict(backend="triton") if lib is gbc else {}
        logp, ent = lib.fused_linear_logprobs(h, w, targets.to(dev), bias=bias, temperature=0.9,
                                              return_entropy=True, **kw)
        ((logp * up[0].to(dev)).sum() + (ent * up[1].to(dev)).sum()).backward()
        st = lib.token_stats(h.detach(), w.detach(), targets.to(dev), bias=bias.detach(),
                             temperature=0.9, certainty="entropy", certainty_temperature=1.4,
                             **kw)
        outs.append([t.detach().float().cpu() for t in (logp, ent, h.grad, w.grad, bias.grad,
                                                        st.logp, st.certainty)])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for got, want in zip(*outs):
        assert max_rel_err(got, want) <= tol


def test_nthr_on_gpu_matches_reference():
    b = make_batch(B=8, T=12, H=32, V=301, seed=5)
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    correct = torch.tensor([True, False, True, False, False, True, False, False])
    got = gbc.nthr_scale(b["hidden"].cuda(), b["weight"].cuda(), b["targets"].cuda(),
                         b["mask"].cuda(), group_ids.cuda(), correct.cuda(), bias=b["bias"].cuda(),
                         beta=0.0, backend="triton")
    want = ref.nthr_scale(b["hidden"].double(), b["weight"].double(), b["targets"], b["mask"],
                          group_ids, correct, bias=b["bias"].double(), beta=0.0)
    assert want.selected.any()
    assert torch.equal(got.selected.cpu(), want.selected)
    assert torch.allclose(got.scale.cpu(), want.scale.float())


def test_loss_memory_on_gpu():
    """Peak CUDA memory of the fused loss forward+backward beyond inputs and gradients, against
    one fp32 [N, V] logits tensor (bf16, N = 8192, V = 128256)."""
    N, H, V = 8192, 1024, 128256
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(4, N // 4, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) / H ** 0.5).bfloat16().requires_grad_()
    y = torch.randint(0, V, (4, N // 4), device="cuda", generator=g)
    mask = torch.ones(4, N // 4, dtype=torch.bool, device="cuda")
    adv = torch.randn(4, device="cuda", generator=g)
    old = -torch.rand(4, N // 4, device="cuda", generator=g) * 5
    h.grad = torch.zeros_like(h)
    w.grad = torch.zeros_like(w)          # gradients count as inputs here
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss, _ = gbc.fused_linear_policy_loss(h, w, y, mask, adv, old, backend="triton")
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    logits_fp32 = N * V * 4
    print(f"peak beyond inputs+grads: {extra / 2**20:.0f} MiB = {extra / logits_fp32:.3f} x "
          f"one fp32 [N, V] ({logits_fp32 / 2**20:.0f} MiB)")
    assert torch.isfinite(loss)
    assert extra < 0.5 * logits_fp32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_row_kernel_equals_three_kernels_on_gpu(monkeypatch, dtype):
    """The one-pass row kernel (the default) and the three kernels it replaces give the same
    loss, metrics and gradients on the GPU (the same float32 operations, FP fusion off), on a
    vocabulary that is not a multiple of the tile and several chunks."""
    from gbc_kernels.triton import launch
    batch = make_batch(B=5, T=37, H=64, V=4099, dtype=dtype, seed=12, old_spread=3.0)
    cfg = dict(kl_coef=0.1, entropy_coef=0.01, ar_alpha=0.3, clip_ratio_c=3.0)
    monkeypatch.setenv("GBC_CHUNK_MB", "0.2")
    outs = []
    for one_pass in (True, False):
        monkeypatch.setattr(launch, "ONE_PASS", one_pass)
        outs.append(cpu(run(gbc, cuda(batch), cfg, None, 0.7, "triton")))
    (l1, m1, g1), (l2, m2, g2) = outs
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-7)
    for k in m1:
        torch.testing.assert_close(m1[k], m2[k], rtol=1e-5, atol=1e-7)
    for k in g1:
        torch.testing.assert_close(g1[k].float(), g2[k].float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("upstream", [1.0, 0.25])
def test_backward_without_host_sync_on_gpu(upstream):
    """The backward tests the upstream gradient on the device: PyTorch's sync debug mode
    ("error": raise on any synchronising CUDA call) stays silent, and the gradients are those
    of a second, synchronised run scaled by the upstream gradient."""
    batch = cuda(make_batch(B=3, T=40, H=64, V=1001, dtype=torch.bfloat16, seed=9))
    grads = []
    for sync_free in (False, True):
        h = batch["hidden"].detach().requires_grad_()
        w = batch["weight"].detach().requires_grad_()
        loss, _ = gbc.fused_linear_policy_loss(h, w, batch["targets"], batch["mask"],
                                               batch["advantages"], batch["old_logp"],
                                               backend="triton")
        up = torch.tensor(upstream if sync_free else 1.0, device="cuda")
        torch.cuda.synchronize()
        if sync_free:
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward(up)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        grads.append((h.grad.float(), w.grad.float()))
    for unit, scaled in zip(*grads):
        torch.testing.assert_close(scaled, unit * upstream, rtol=1e-2, atol=0)
        assert scaled.abs().sum() > 0


def test_vocab_parallel_one_rank_on_gpu(monkeypatch):
    """Vocab parallel with the Triton kernels on a one-rank NCCL group (the slice is the whole
    lm_head) equals the one-device loss: the per-chunk all_gather and the hidden-gradient
    all_reduce on CUDA tensors. The multi-rank math is tested on CPU (test_distributed.py)."""
    import socket
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        b = cuda(make_batch(B=4, T=33, H=64, V=1001, seed=13))
        cfg = gbc.PolicyLossConfig(loss_agg="grpo", kl_coef=0.05, entropy_coef=0.01)
        outs = []
        for vp in (None, gbc.VocabParallel(None, 0, 1001)):
            h = b["hidden"].clone().requires_grad_(True)
            w = b["weight"].clone().requires_grad_(True)
            loss, m = gbc.fused_linear_policy_loss(h, w, b["targets"], b["mask"],
                                                   b["advantages"], b["old_logp"], b["ref_logp"],
                                                   config=cfg, backend="triton", vocab_parallel=vp)
            loss.backward()
            outs.append((loss.detach(), m["entropy"], h.grad, w.grad))
        for a, c in zip(*outs):
            assert torch.allclose(a, c, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batch_invariant_logprobs_on_gpu(dtype, monkeypatch):
    """``GBC_BATCH_INVARIANT=1`` on CUDA (cuBLAS picks kernels, split-K included, by shape): a
    sequence's log-probs and entropies are bitwise the same inside different batches, and the
    on-policy ratio inside the fused loss is exactly 1 (tests/test_numerics.py on a GPU)."""
    from test_numerics import _seq_batch

    monkeypatch.setenv("GBC_BATCH_INVARIANT", "1")
    monkeypatch.setenv("GBC_CHUNK_MB", "2")
    w, batches = _seq_batch(dtype, V=32003, H=256)
    w = w.cuda()
    seen = []
    for h, y, m, pos, sl in batches:
        h, y, m = h.cuda(), y.cuda(), m.cuda()
        lp, ent = gbc.fused_linear_logprobs(h, w, y, return_entropy=True, backend="triton")
        seen.append((lp[pos, sl].cpu(), ent[pos, sl].cpu()))
        old = torch.where(m, lp, torch.zeros_like(lp))
        cfg = gbc.PolicyLossConfig(epsilon_low=1e-7, epsilon_high=1e-7)
        _, met = gbc.fused_linear_policy_loss(h, w, y, m, torch.randn(m.shape[0], device="cuda"),
                                              old_logp=old, config=cfg, backend="triton")
        assert float(met["ratio_mean"]) == 1.0 and float(met["log_ratio_mean"]) == 0.0
        assert float(met["clip_frac_low"]) + float(met["clip_frac_high"]) == 0.0
    for other in seen[1:]:
        assert all(torch.equal(a, b) for a, b in zip(seen[0], other))


def test_bf16_weight_grad_fp32_accumulation_on_gpu(monkeypatch):
    """The float32 accumulator on CUDA (``addmm(..., out_dtype=float32)``): the bf16 weight
    gradient's error against float64 does not grow with the chunk count."""
    g = torch.Generator().manual_seed(0)
    n, H, V = 2048, 128, 32003
    h = torch.randn(n, H, generator=g).bfloat16().cuda()
    w = (torch.randn(V, H, generator=g) / 11).bfloat16().cuda()
    y = torch.randint(0, V, (n,), generator=g).cuda()
    up = torch.randn(n, generator=g).cuda()
    w64 = w.double().requires_grad_(True)
    (torch.log_softmax(h.double() @ w64.T, -1).gather(1, y[:, None])[:, 0] * up.double()
     ).sum().backward()
    errs = {}
    for mb in (None, "8"):
        if mb:
            monkeypatch.setenv("GBC_CHUNK_MB", mb)
        ww = w.clone().requires_grad_(True)
        lp, _ = gbc.fused_linear_logprobs(h, ww, y, backend="triton")
        (lp * up).sum().backward()
        errs[mb] = float((ww.grad.double() - w64.grad).norm() / w64.grad.norm())
    assert errs["8"] <= 1.05 * errs[None], errs


@pytest.mark.parametrize("N,H,V", [(64, 4096, 151936), (16, 8192, 248320)],
                         ids=["N64-H4096-V151936", "N16-H8192-V248320"])
def test_float32_logits_mode_on_gpu(N, H, V):
    """Float32 logits mode on CUDA (the out_dtype matmul into a float32 chunk, Triton's row
    passes on it): log-probs and entropy within 1e-5 of float64 on the same bf16 values, the
    default mode worse than 1e-4; the loss's gradients at the rounding route's bound
    (tests/test_precision.py measures the same on CPU)."""
    from test_precision import _head, _oracle64
    h, w, _, y = _head(N, H, V, seed=11)
    lp64, ent64 = _oracle64(h, w, y)
    h, w, y = h.cuda(), w.cuda(), y.cuda()
    err = {}
    for ld in (None, torch.float32):
        lp, ent = gbc.fused_linear_logprobs(h, w, y, return_entropy=True, backend="triton",
                                            logits_dtype=ld)
        err[ld] = ((lp.double().cpu() - lp64).abs().max().item(),
                   (ent.double().cpu() - ent64).abs().max().item())
    assert err[torch.float32][0] < 1e-5 and err[torch.float32][1] < 1e-5, err
    assert err[None][0] > 1e-4, err
    print(f"\n[float32 mode, N={N} H={H} V={V}] |logp - f64| default {err[None][0]:.2e}, "
          f"float32 {err[torch.float32][0]:.2e}")


def test_float32_logits_mode_loss_on_gpu():
    """The fused loss in float32 mode on CUDA (dL/dlogits rounded once to bf16 for the tensor-core
    gradient matmuls): loss and log-probs within 1e-5 of float64, gradients within 2x the bf16
    floor (tests/test_precision.py's bound for that route)."""
    from test_precision import OPTS, _loss_inputs, _rel
    h, w, b, y, mask, adv, old, refl, lp64 = _loss_inputs()
    leaves64 = [t.double().requires_grad_(True) for t in (h, w, b)]
    L64, _ = ref.fused_linear_policy_loss(*leaves64[:2], y, mask, adv, old, refl,
                                          bias=leaves64[2],
                                          config=ref.PolicyLossConfig(logits_dtype=torch.float32,
                                                                      **OPTS))
    L64.backward()
    xs = [t.cuda().requires_grad_(True) for t in (h, w, b)]
    out = {}
    L, _ = gbc.fused_linear_policy_loss(xs[0], xs[1], y.cuda(), mask.cuda(), adv.cuda(),
                                        old.cuda(), refl.cuda(), bias=xs[2], backend="triton",
                                        config=gbc.PolicyLossConfig(logits_dtype=torch.float32,
                                                                    **OPTS), token_out=out)
    L.backward()
    assert abs(L.item() - L64.item()) < 1e-5
    assert (out["logp"].double().cpu() - lp64).abs()[mask].max().item() < 1e-5
    for x, t in zip(xs, leaves64):
        floor = _rel(t.grad.to(torch.bfloat16), t.grad)
        assert _rel(x.grad.cpu(), t.grad) < 2.0 * floor
