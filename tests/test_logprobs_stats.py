"""fused_linear_logprobs (forward and recomputing backward) and token_stats (§5 certainty)."""

from __future__ import annotations

import math

import pytest
import torch

import gbc_kernels as gbc
import gbc_reference as ref
from conftest import max_rel_err


def _inputs(N, H, V, dtype, seed, scale=1.0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, H, generator=g, dtype=torch.float64)).to(dtype)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) * scale / H ** 0.5).to(dtype)
    b = (torch.randn(V, generator=g, dtype=torch.float64) * 0.3).to(dtype) if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    return h, w, b, y


@pytest.mark.parametrize("N,H,V,temp", [(1, 4, 3, 1.0), (17, 16, 257, 0.6), (40, 8, 1001, 1.7)])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_logprobs_fp32_vs_float64(backend, small_chunks, N, H, V, temp, with_entropy):
    h, w, b, y = _inputs(N, H, V, torch.float32, N + V)
    gl = torch.randn(N, dtype=torch.float64)
    ge = torch.randn(N, dtype=torch.float64)
    outs = []
    for lib, dt, kw in ((gbc, torch.float32, dict(backend=backend)), (ref, torch.float64, {})):
        hh = h.detach().to(dt).clone().requires_grad_(True)
        ww = w.detach().to(dt).clone().requires_grad_(True)
        bb = b.detach().to(dt).clone().requires_grad_(True)
        logp, ent = lib.fused_linear_logprobs(hh, ww, y, bb, temperature=temp,
                                              return_entropy=with_entropy, **kw)
        obj = (logp * gl.to(logp.dtype)).sum()
        if with_entropy:
            obj = obj + (ent * ge.to(ent.dtype)).sum()
        obj.backward()
        outs.append((logp.detach(), None if ent is None else ent.detach(), hh.grad, ww.grad,
                     bb.grad))
    ours, truth = outs
    assert ours[0].dtype == torch.float32 and ours[0].shape == (N,)
    assert torch.allclose(ours[0].double(), truth[0], rtol=1e-5, atol=1e-5)
    if with_entropy:
        assert torch.allclose(ours[1].double(), truth[1], rtol=1e-5, atol=1e-5)
    else:
        assert ours[1] is None
    for a, t in zip(ours[2:], truth[2:]):
        assert max_rel_err(a, t) < 1e-4


def test_logprobs_bf16_and_3d_shape(backend):
    h, w, b, y = _inputs(24, 32, 300, torch.bfloat16, 5)
    h3, y3 = h.view(2, 12, 32), y.view(2, 12)
    logp, ent = gbc.fused_linear_logprobs(h3, w, y3, b, return_entropy=True, backend=backend)
    truth, tent = ref.fused_linear_logprobs(h3.double(), w.double(), y3, b.double(),
                                            return_entropy=True)
    assert logp.shape == (2, 12) and logp.dtype == torch.float32
    assert (logp.double() - truth).abs().max() < 5e-2
    assert (ent.double() - tent).abs().max() < 5e-2


@pytest.mark.parametrize("kind", ["entropy", "max_prob"])
@pytest.mark.parametrize("temp,ctemp", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.3), (1.2, 2.0)])
def test_token_stats_certainty(backend, small_chunks, kind, temp, ctemp):
    h, w, b, y = _inputs(33, 16, 517, torch.float32, 9, scale=3.0)
    st = gbc.token_stats(h, w, y, b, temperature=temp, certainty=kind,
                         certainty_temperature=ctemp, backend=backend)
    tr = ref.token_stats(h.double(), w.double(), y, b.double(), temperature=temp,
                         certainty=kind, certainty_temperature=ctemp)
    for a, t in zip(st, tr):
        assert a.dtype == torch.float32
        assert torch.allclose(a.double(), t.double(), rtol=1e-5, atol=1e-5)
    # by definition J is in [0, 1]
    assert float(st.certainty.min()) >= -1e-6 and float(st.certainty.max()) <= 1 + 1e-6


def test_token_stats_known_values():
    """Uniform logits: J = 0 for both kinds; one dominant logit: J -> 1."""
    V, H = 64, 4
    w = torch.zeros(V, H)
    h = torch.zeros(2, H)
    b = torch.zeros(V)
    b2 = b.clone()
    b2[3] = 60.0
    y = torch.tensor([0, 3])
    st = gbc.token_stats(h, w, y, b, certainty="entropy", backend="torch")
    assert torch.allclose(st.certainty, torch.zeros(2), atol=1e-6)
    assert torch.allclose(st.logp, torch.full((2,), -math.log(V)), atol=1e-6)
    st2 = gbc.token_stats(h, w, y, b2, certainty="max_prob", backend="torch")
    assert torch.allclose(st2.certainty, torch.ones(2), atol=1e-6)


def test_token_stats_has_no_grad():
    h, w, b, y = _inputs(5, 4, 11, torch.float32, 0)
    h.requires_grad_(True)
    st = gbc.token_stats(h, w, y, b)
    assert not st.logp.requires_grad and st.certainty is None


@pytest.mark.parametrize("huge", [1e4, -1e4])
def test_extreme_logits_and_p_to_one(backend, huge):
    """Huge logits, tiny temperature, p -> 1: finite values and the right gradient."""
    V, H = 50, 4
    g = torch.Generator().manual_seed(1)
    h = torch.randn(6, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.01
    b = torch.zeros(V)
    b[7] = huge
    y = torch.tensor([7, 7, 1, 2, 3, 7])
    for temp in (1.0, 0.05):
        ours = []
        for lib, dt, kw in ((gbc, torch.float32, dict(backend=backend)), (ref, torch.float64, {})):
            hh = h.detach().to(dt).clone().requires_grad_(True)
            ww = w.detach().to(dt).clone().requires_grad_(True)
            lp, en = lib.fused_linear_logprobs(hh, ww, y, b.to(dt), temperature=temp,
                                               return_entropy=True, **kw)
            (lp.sum() + en.sum()).backward()
            ours.append((lp.detach().double(), en.detach().double(), hh.grad.double()))
        (a, ea, ga), (t, et, gt) = ours
        assert torch.isfinite(a).all() and torch.isfinite(ga).all()
        assert torch.allclose(a, t, rtol=1e-5, atol=1e-3)
        assert torch.allclose(ea, et, atol=1e-4)
        assert torch.allclose(ga, gt, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("V", [4097, 262147])
def test_large_vocab_not_multiple_of_tile(backend, V):
    """V past one tile (4096) and past 2^18, not a multiple of any block."""
    if backend == "torch" and V > 10000:
        pytest.skip("covered by the kernels; the torch path has no tiles")
    h, w, b, y = _inputs(3, 8, V, torch.float32, V, scale=4.0)
    y[0] = V - 1                      # the last column, in the masked tail tile
    hh = h.clone().requires_grad_(True)
    logp, ent = gbc.fused_linear_logprobs(hh, w, y, b, return_entropy=True, backend=backend)
    (logp.sum() - 0.5 * ent.sum()).backward()
    h64 = h.double().requires_grad_(True)
    tl_, te = ref.fused_linear_logprobs(h64, w.double(), y, b.double(), return_entropy=True)
    (tl_.sum() - 0.5 * te.sum()).backward()
    assert torch.allclose(logp.double(), tl_, atol=2e-5, rtol=1e-5)
    assert torch.allclose(ent.double(), te, atol=2e-4, rtol=1e-5)
    assert max_rel_err(hh.grad, h64.grad) < 1e-4


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_weight_grad_into_adds_the_weight_gradient(backend, small_chunks, dtype, tol):
    """``weight_grad_into`` (megatron's float32 ``main_grad``): the backward adds d weight into
    it, scaled by the upstream gradient, summed in float32 over the chunks; the weight gets no
    gradient; d hidden and d bias are the plain call's. Against float64 autograd on the same
    (rounded) inputs, every row's upstream gradient random, an odd vocabulary."""
    h, w, b, y = _inputs(29, 16, 203, dtype, 11)
    g = torch.Generator().manual_seed(4)
    gl, ge = torch.randn(2, 29, generator=g, dtype=torch.float64)
    prefill = torch.randn(w.shape, generator=g)

    def run(lib, dt, into=None, **kw):
        hh, ww, bb = (t.detach().to(dt).clone().requires_grad_(True) for t in (h, w, b))
        extra = {} if into is None else dict(weight_grad_into=into)
        logp, ent = lib.fused_linear_logprobs(hh, ww, y, bb, temperature=0.8,
                                              return_entropy=True, **kw, **extra)
        (0.5 * ((logp * gl.to(logp.dtype)).sum() + (ent * ge.to(ent.dtype)).sum())).backward()
        return hh.grad, ww.grad, bb.grad

    truth = run(ref, torch.float64)
    plain = run(gbc, dtype, backend=backend)
    into = prefill.clone()
    got = run(gbc, dtype, into, backend=backend)
    assert got[1] is None
    assert max_rel_err(into - prefill, truth[1]) < tol
    assert max_rel_err(into - prefill, plain[1]) < tol          # the plain call's, unrounded
    assert torch.equal(got[0], plain[0]) and torch.equal(got[2], plain[2])


def test_weight_grad_into_bad_input():
    h, w, b, y = _inputs(5, 8, 11, torch.float32, 1)
    w.requires_grad_(True)
    for into, err, what in ((torch.zeros(11, 8, dtype=torch.bfloat16), TypeError, "float32"),
                            (torch.zeros(8, 11).t(), TypeError, "contiguous"),
                            (torch.zeros(10, 8), ValueError, "shape")):
        with pytest.raises(err, match=f"weight_grad_into: .*{what}"):
            gbc.fused_linear_logprobs(h, w, y, b, weight_grad_into=into)
