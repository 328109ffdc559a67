"""The sampler's support (docs/math.md §16, "The sampler's support"), issue 60's core:
``support_ids`` on ``fused_linear_logprobs``, ``fused_linear_policy_loss`` and
``token_stats``, on every backend, against a float64 oracle that forms the logits, masks them
to the support and differentiates with autograd (``gbc_reference``).

The rows of every batch mix the cases: a support holding its target, one lacking it (forced
in, counted by ``support_forced_frac``), duplicate ids, ``-1`` padding inside a row, a row of
padding only, and masked-out tokens whose ids are garbage.
"""

from __future__ import annotations

import pytest
import torch

import gbc_kernels as gbc
import gbc_reference as ref
from conftest import as64, leaves, make_batch, max_rel_err

CFGS = {
    "grpo": dict(),
    "kl-entropy-ar": dict(kl_coef=0.05, entropy_coef=0.01, ar_alpha=0.3, epsilon_high=0.28),
    "lopti-low": dict(lopti_eta=0.5),
}


def err(got, want) -> float:
    """max |got - want| / (1 + |want|): float32 outputs against a float64 oracle."""
    return float(((got.double() - want.double()).abs() / (1 + want.double().abs())).max())


def support_for(targets, V, k=6, seed=0, mask=None):
    """``[B, T, k]`` ids mixing the cases of the module docstring (rows by position)."""
    g = torch.Generator().manual_seed(seed)
    B, T = targets.shape
    y = targets.clamp(min=0)
    ids = torch.randint(0, V, (B, T, k), generator=g)
    ids[..., 0] = y                                          # most rows hold their target ...
    ids[:, ::3, 0] = (y[:, ::3] + 1) % V                     # ... every third does not
    ids[:, 1::4, 2] = -1                                      # padding inside a row
    ids[:, 2::5, 1] = ids[:, 2::5, 0]                         # a duplicate
    ids[:, 3::7, :] = -1                                      # padding only: the target alone
    if mask is not None:                                      # masked-out ids are never read
        ids = torch.where(mask.unsqueeze(-1), ids, torch.full_like(ids, 10 ** 6))
    return ids


def _logprobs(lib, b, ids, backend=None, temperature=0.7, **kw):
    x = leaves(b)
    extra = {} if backend is None else {"backend": backend}
    lp, ent, kept = lib.fused_linear_logprobs(
        x["hidden"], x["weight"], b["targets"].clamp(min=0), bias=x["bias"],
        temperature=temperature, return_entropy=True, support_ids=ids,
        return_log_kept_mass=True, **extra, **kw)
    g = torch.Generator().manual_seed(5)
    u1 = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    u2 = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    (lp.double() * u1 + ent.double() * u2).sum().backward()
    return lp, ent, kept, [x[k].grad for k in ("hidden", "weight", "bias")]


@pytest.mark.parametrize("softcap", [None, 4.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("temp", ["scalar", "per-token"])
def test_logprobs_over_the_support_match_float64(backend, softcap, temp, small_chunks):
    """Log-probs, entropy, log_kept_mass and the gradients (random upstream gradients through
    the log-prob and the entropy) over the support, several chunks, an odd vocabulary."""
    b = make_batch(B=3, T=11, H=24, V=97, logit_scale=3.0)
    ids = support_for(b["targets"], 97)
    t = 0.7 if temp == "scalar" else torch.rand(3, 11, generator=torch.Generator()
                                                .manual_seed(1)) + 0.5
    lp, ent, kept, grads = _logprobs(gbc, b, ids, backend, temperature=t, logit_softcap=softcap)
    want = _logprobs(ref, as64(b), ids, temperature=t, logit_softcap=softcap)
    for got, exp in zip((lp, ent, kept), want[:3]):
        assert got.dtype == torch.float32
        assert err(got, exp) < 1e-6
    for got, exp in zip(grads, want[3]):
        assert max_rel_err(got, exp) < 2e-5
    assert (kept <= 0).all() and (kept < -1e-3).any()
    # the support changed the numbers: the whole vocabulary's log-probs differ
    full = gbc.fused_linear_logprobs(b["hidden"], b["weight"], b["targets"].clamp(min=0),
                                     bias=b["bias"], temperature=t, logit_softcap=softcap,
                                     backend=backend)[0]
    assert torch.allclose(full, lp + kept, atol=2e-6)
    assert (lp - full).abs().max() > 1e-2


def test_full_row_and_k1(backend):
    """Every id in the support: the whole vocabulary's numbers, log_kept_mass 0. ``k = 1``
    holding the target: log-prob 0, entropy 0, no gradient."""
    b = make_batch(B=2, T=5, H=16, V=41)
    y = b["targets"].clamp(min=0)
    every = torch.arange(41).flip(0).expand(2, 5, 41).contiguous()
    lp, ent, kept, _ = _logprobs(gbc, b, every, backend)
    lp0, ent0 = gbc.fused_linear_logprobs(b["hidden"], b["weight"], y, bias=b["bias"],
                                          temperature=0.7, return_entropy=True, backend=backend)
    assert torch.allclose(lp, lp0, atol=1e-6) and torch.allclose(ent, ent0, atol=1e-6)
    assert kept.abs().max() < 1e-6
    lp, ent, kept, grads = _logprobs(gbc, b, y.unsqueeze(-1), backend)
    assert lp.abs().max() == 0 and ent.abs().max() < 1e-7
    assert all(g.abs().max() < 1e-6 for g in grads)


@pytest.mark.parametrize("cfg", list(CFGS))
def test_policy_loss_over_the_support_matches_float64(backend, cfg, small_chunks):
    """The fused loss with ``support_ids``: loss, gradients, metrics, ``token_out``'s logp and
    log_kept_mass against the oracle; ``support_forced_frac`` counts the forced tokens."""
    b = make_batch(B=4, T=9, H=16, V=37, logit_scale=2.0)
    ids = support_for(b["targets"], 37, mask=b["mask"])
    phase = "low" if cfg == "lopti-low" else None
    out = {}
    for lib, batch in ((gbc, b), (ref, as64(b))):
        x, tok = leaves(batch), {}
        extra = {"backend": backend} if lib is gbc else {}
        L, m = lib.fused_linear_policy_loss(
            x["hidden"], x["weight"], batch["targets"], batch["mask"], batch["advantages"],
            batch["old_logp"], batch["ref_logp"], bias=x["bias"],
            config=lib.PolicyLossConfig(**CFGS[cfg]), phase=phase, temperature=0.9,
            support_ids=ids, token_out=tok, **extra)
        (L * 1.7).backward()
        out[lib] = L, m, tok, [x[k].grad for k in ("hidden", "weight", "bias")]
    (L, m, tok, grads), (L64, m64, tok64, grads64) = out[gbc], out[ref]
    assert abs(L.item() - L64.item()) < 1e-5 * max(1.0, abs(L64.item()))
    for got, exp in zip(grads, grads64):
        assert max_rel_err(got, exp) < 1e-4
    for k, v in m64.items():
        assert abs(float(m[k]) - float(v)) < 1e-4 * max(1.0, abs(float(v))), k
    m_in = b["mask"]
    y = b["targets"].clamp(min=0)
    forced = ~(ids == y.unsqueeze(-1)).any(-1) & m_in
    assert float(m["support_forced_frac"]) == pytest.approx(forced.sum().item() / m_in.sum().item())
    assert 0 < float(m["support_forced_frac"]) < 1
    assert err(tok["logp"], tok64["logp"]) < 1e-6
    assert err(tok["log_kept_mass"], tok64["log_kept_mass"]) < 1e-6
    assert (tok["log_kept_mass"][~m_in] == 0).all()
    # without token_out the whole row is never read (no log_kept_mass): the same loss and grads
    x = leaves(b)
    L2, _ = gbc.fused_linear_policy_loss(
        x["hidden"], x["weight"], b["targets"], b["mask"], b["advantages"], b["old_logp"],
        b["ref_logp"], bias=x["bias"], config=gbc.PolicyLossConfig(**CFGS[cfg]), phase=phase,
        temperature=0.9, support_ids=ids, backend=backend)
    (L2 * 1.7).backward()
    assert torch.equal(L2, L)
    assert all(torch.equal(x[k].grad, g) for k, g in zip(("hidden", "weight", "bias"), grads))


def test_bf16_float32_logits_over_the_support():
    """bf16 hidden states and weight, ``logits_dtype=float32``: the support's log-probs
    within 1e-5 of float64 on the same bf16 values."""
    b = make_batch(B=3, T=7, H=64, V=301, dtype=torch.bfloat16, logit_scale=3.0)
    ids = support_for(b["targets"], 301, k=20)
    for be in ("torch", "cpu") if gbc.backends.cpu_available() else ("torch",):
        lp, ent, kept = gbc.fused_linear_logprobs(
            b["hidden"], b["weight"], b["targets"].clamp(min=0), bias=b["bias"],
            return_entropy=True, support_ids=ids, return_log_kept_mass=True,
            logits_dtype="float32", backend=be)
        want = ref.fused_linear_logprobs(
            b["hidden"], b["weight"], b["targets"].clamp(min=0), bias=b["bias"],
            return_entropy=True, support_ids=ids, return_log_kept_mass=True,
            logits_dtype="float32")
        for got, exp in zip((lp, ent, kept), want):
            assert err(got, exp) < 1e-6, be


def test_token_stats_over_the_support(backend):
    b = make_batch(B=2, T=6, H=16, V=53)
    ids = support_for(b["targets"], 53)
    y = b["targets"].clamp(min=0)
    st = gbc.token_stats(b["hidden"], b["weight"], y, bias=b["bias"], temperature=0.8,
                         support_ids=ids, backend=backend)
    lp, ent, p2 = ref.fused_linear_logprobs(*[as64(b)[k] for k in ("hidden", "weight")], y,
                                            bias=as64(b)["bias"], temperature=0.8,
                                            return_entropy=True, return_sum_p2=True,
                                            support_ids=ids)
    for got, exp in zip((st.logp, st.entropy, st.sum_p2), (lp, ent, p2)):
        assert err(got, exp) < 1e-6
    # the certainty over the support (critical-token KL): J normalised by log |S|, 1 at |S| = 1
    for kind in ("entropy", "max_prob"):
        got = gbc.token_stats(b["hidden"], b["weight"], y, bias=b["bias"], temperature=0.8,
                              certainty=kind, certainty_temperature=1.3, support_ids=ids,
                              backend=backend)
        want = ref.token_stats(*[as64(b)[k] for k in ("hidden", "weight")], y,
                               bias=as64(b)["bias"], temperature=0.8, certainty=kind,
                               certainty_temperature=1.3, support_ids=ids)
        assert err(got.certainty, want.certainty) < 1e-6, kind
        assert (got.certainty[:, 3::7] == 1).all()          # padding only: |S| = 1
        assert ((got.certainty >= -1e-6) & (got.certainty <= 1 + 1e-6)).all()
        whole = gbc.token_stats(b["hidden"], b["weight"], y, bias=b["bias"], certainty=kind,
                                certainty_temperature=1.3, backend=backend).certainty
        assert (whole - got.certainty).abs().max() > 1e-2


def test_without_support_is_todays_path(backend):
    """``support_ids=None`` is today's path bit for bit (the same calls without the
    argument)."""
    b = make_batch(B=3, T=5, H=16, V=29)
    y = b["targets"].clamp(min=0)
    a = gbc.fused_linear_logprobs(b["hidden"], b["weight"], y, bias=b["bias"],
                                  return_entropy=True, backend=backend)
    c = gbc.fused_linear_logprobs(b["hidden"], b["weight"], y, bias=b["bias"],
                                  return_entropy=True, backend=backend, support_ids=None)
    assert all(torch.equal(p, q) for p, q in zip(a, c))
    kept = gbc.fused_linear_logprobs(b["hidden"], b["weight"], y, bias=b["bias"],
                                     return_log_kept_mass=True, backend=backend)[-1]
    assert torch.equal(kept, torch.zeros_like(kept))


@pytest.mark.parametrize("bad,match", [
    ("high", r"^support_ids: expected ids in \[-1, 29\) \(-1: padding\) on masked-in tokens, "
             r"got 29 at index \[0, 2, 1\]"),
    ("low", r"^support_ids: expected ids in \[-1, 29\).*got -2"),
    ("shape", r"^support_ids: expected shape \[3, 5\] \+ \[k\]"),
    ("empty-k", r"^support_ids: expected shape"),
    ("float", r"^support_ids: expected an integer tensor"),
    ("list", r"^support_ids: expected None or an integer tensor"),
])
def test_bad_support_ids_refused_by_name(bad, match):
    b = make_batch(B=3, T=5, H=16, V=29)
    y = b["targets"].clamp(min=0)
    ids = support_for(y, 29, k=3)
    ids = {"high": lambda: ids.index_put((torch.tensor(0), torch.tensor(2), torch.tensor(1)),
                                         torch.tensor(29)),
           "low": lambda: ids.index_put((torch.tensor(2), torch.tensor(4), torch.tensor(0)),
                                        torch.tensor(-2)),
           "shape": lambda: ids[:, :4], "empty-k": lambda: ids[..., :0],
           "float": lambda: ids.float(), "list": lambda: ids.tolist()}[bad]()
    err = TypeError if bad in ("float", "list") else ValueError
    with pytest.raises(err, match=match):
        gbc.fused_linear_logprobs(b["hidden"], b["weight"], y, support_ids=ids)
    with pytest.raises(err, match=match):
        gbc.token_stats(b["hidden"], b["weight"], y, support_ids=ids)
    mask = torch.ones(3, 5, dtype=torch.bool)
    with pytest.raises(err, match=match):
        gbc.fused_linear_policy_loss(b["hidden"], b["weight"], y, mask, b["advantages"],
                                     b["old_logp"], support_ids=ids)


def test_masked_out_ids_are_not_read():
    """Ids of masked-out tokens are never checked or read (as targets there are not)."""
    b = make_batch(B=3, T=5, H=16, V=29)
    ids = support_for(b["targets"], 29, k=3, mask=b["mask"])
    assert (ids[~b["mask"]] == 10 ** 6).all()
    L, m = gbc.fused_linear_policy_loss(b["hidden"], b["weight"], b["targets"], b["mask"],
                                        b["advantages"], b["old_logp"], support_ids=ids)
    assert torch.isfinite(L)


def _vp_worker(rank, world, backend):
    """Rank ``rank`` holds rows ``[cut_r, cut_{r+1})`` of the head (uneven slices); the loss,
    its gradients, the log-probs and log_kept_mass over the support, one row's members all on
    rank 0's shard, another's all on rank 1's."""
    b = make_batch(B=3, T=7, H=16, V=45, logit_scale=2.0)
    V = 45
    cuts = [0, 17, V]
    lo, hi = cuts[rank], cuts[rank + 1]
    ids = support_for(b["targets"], V, mask=b["mask"])
    y = b["targets"]
    ids[0, 0] = torch.tensor([3, 5, 7, 11, 13, 16]); y[0, 0] = 5          # all on rank 0
    ids[0, 1] = torch.tensor([20, 30, -1, 44, 17, 30]); y[0, 1] = 2      # all on rank 1, forced
    vp = gbc.VocabParallel(None, lo, hi)
    x = leaves(b)
    w = x["weight"].detach()[lo:hi].clone().requires_grad_(True)
    bb = x["bias"].detach()[lo:hi].clone().requires_grad_(True)
    h = x["hidden"]
    tok = {}
    L, m = gbc.fused_linear_policy_loss(
        h, w, y, b["mask"], b["advantages"], b["old_logp"], b["ref_logp"], bias=bb,
        config=gbc.PolicyLossConfig(**CFGS["kl-entropy-ar"]), temperature=0.9,
        support_ids=ids, token_out=tok, vocab_parallel=vp, backend=backend)
    (L * 1.3).backward()
    h2 = b["hidden"].detach().clone().requires_grad_(True)
    w2 = b["weight"].detach()[lo:hi].clone().requires_grad_(True)
    lp, ent, kept = gbc.fused_linear_logprobs(
        h2, w2, y.clamp(min=0), bias=b["bias"][lo:hi], temperature=0.7, return_entropy=True,
        support_ids=ids.clamp(max=V - 1), return_log_kept_mass=True, vocab_parallel=vp,
        backend=backend)
    (lp.sum() + 0.5 * ent.sum()).backward()
    return dict(L=L.detach(), m={k: float(v) for k, v in m.items()}, tok=tok,
                gh=h.grad, gw=w.grad, gb=bb.grad, lp=lp.detach(), ent=ent.detach(),
                kept=kept, gh2=h2.grad, gw2=w2.grad, ids=ids, y=y)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_vocab_parallel_support_matches_float64(backend):
    from conftest import spawn_gloo

    if backend == "cpu" and not gbc.backends.cpu_available():
        pytest.skip("the C++ extension is not built")
    out = spawn_gloo(2, _vp_worker, backend)
    b = make_batch(B=3, T=7, H=16, V=45, logit_scale=2.0)
    ids, y = out[0]["ids"], out[0]["y"]
    b["targets"] = y
    x, tok = leaves(as64(b)), {}
    L64, m64 = ref.fused_linear_policy_loss(
        x["hidden"], x["weight"], y, b["mask"], b["advantages"], b["old_logp"],
        b["ref_logp"], bias=x["bias"], config=ref.PolicyLossConfig(**CFGS["kl-entropy-ar"]),
        temperature=0.9, support_ids=ids, token_out=tok)
    (L64 * 1.3).backward()
    h2, w2 = (as64(b)[k].detach().clone().requires_grad_(True) for k in ("hidden", "weight"))
    lp64, ent64, kept64 = ref.fused_linear_logprobs(
        h2, w2, y.clamp(min=0), bias=as64(b)["bias"], temperature=0.7, return_entropy=True,
        support_ids=ids.clamp(max=44), return_log_kept_mass=True)
    (lp64.sum() + 0.5 * ent64.sum()).backward()
    cuts = [0, 17, 45]
    for r, o in enumerate(out):
        lo, hi = cuts[r], cuts[r + 1]
        assert abs(o["L"].item() - L64.item()) < 1e-5 * max(1, abs(L64.item()))
        for k, v in m64.items():
            assert abs(o["m"][k] - float(v)) < 1e-4 * max(1.0, abs(float(v))), k
        assert err(o["tok"]["logp"], tok["logp"]) < 1e-6
        assert err(o["tok"]["log_kept_mass"], tok["log_kept_mass"]) < 1e-6
        assert max_rel_err(o["gh"], x["hidden"].grad) < 1e-4
        assert max_rel_err(o["gw"], x["weight"].grad[lo:hi]) < 1e-4
        assert max_rel_err(o["gb"], x["bias"].grad[lo:hi]) < 1e-4
        for got, want in ((o["lp"], lp64), (o["ent"], ent64), (o["kept"], kept64)):
            assert err(got, want) < 1e-6
        assert max_rel_err(o["gh2"], h2.grad) < 1e-4
        assert max_rel_err(o["gw2"], w2.grad[lo:hi]) < 1e-4


def _sp_worker(rank, world, backend):
    """Sequence parallel: every rank holds the same sequences, each token masked in on one
    rank (alternate positions)."""
    b = make_batch(B=3, T=8, H=16, V=33, logit_scale=2.0)
    ids = support_for(b["targets"], 33, mask=b["mask"])
    own = b["mask"] & (torch.arange(8) % world == rank)
    x = leaves(b)
    tok = {}
    L, m = gbc.fused_linear_policy_loss(
        x["hidden"], x["weight"], b["targets"], own, b["advantages"], b["old_logp"],
        b["ref_logp"], bias=x["bias"], config=gbc.PolicyLossConfig(**CFGS["kl-entropy-ar"]),
        temperature=0.9, support_ids=ids, token_out=tok, backend=backend,
        sequence_parallel=gbc.SequenceParallel("world"))
    L.backward()
    return dict(L=L.detach(), m={k: float(v) for k, v in m.items()}, own=own,
                kept=tok["log_kept_mass"], grads=[x[k].grad for k in ("hidden", "weight", "bias")])


def test_sequence_parallel_support_matches_float64():
    """The ranks' losses and gradients add up to the whole sequences'; the metrics (with
    ``support_forced_frac``) are the whole batch's on every rank."""
    from conftest import spawn_gloo

    out = spawn_gloo(2, _sp_worker, "torch")
    b = make_batch(B=3, T=8, H=16, V=33, logit_scale=2.0)
    ids = support_for(b["targets"], 33, mask=b["mask"])
    x, tok = leaves(as64(b)), {}
    L64, m64 = ref.fused_linear_policy_loss(
        x["hidden"], x["weight"], b["targets"], b["mask"], b["advantages"], b["old_logp"],
        b["ref_logp"], bias=x["bias"], config=ref.PolicyLossConfig(**CFGS["kl-entropy-ar"]),
        temperature=0.9, support_ids=ids, token_out=tok)
    L64.backward()
    assert abs(sum(o["L"].item() for o in out) - L64.item()) < 1e-5 * max(1, abs(L64.item()))
    for o in out:
        for k, v in m64.items():
            assert abs(o["m"][k] - float(v)) < 1e-4 * max(1.0, abs(float(v))), k
        own = o["own"]
        assert err(o["kept"][own], tok["log_kept_mass"][own]) < 1e-6
    for i, k in enumerate(("hidden", "weight", "bias")):
        assert max_rel_err(sum(o["grads"][i] for o in out), x[k].grad) < 1e-4


# ------------------------------------------------------------------ issue 65: edge inputs
ST = gbc.SamplerTruncation
SUPPORTS = {                      # how a call names its support: recorded ids or rebuilt
    "support_ids": lambda y, V: dict(support_ids=support_for(y, V)),
    "top_k": lambda y, V: dict(sampler_truncation=ST(top_k=5)),
    "top_p": lambda y, V: dict(sampler_truncation=ST(top_p=0.9)),       # no top-k bound
    "min_p": lambda y, V: dict(sampler_truncation=ST(min_p=0.05)),
}


def _poisoned(b, where):
    """``b``'s hidden / weight with one non-finite entry: token [0, 1] of the hidden states, or
    one row of the weight (every token's logits)."""
    h, w = b["hidden"].clone(), b["weight"].clone()
    if where == "weight-nan":
        w[5, 2] = float("nan")
    else:
        h[0, 1, 3] = {"hidden-nan": float("nan"), "hidden+inf": float("inf"),
                      "hidden-inf": float("-inf")}[where]
    return h, w


@pytest.mark.parametrize("where", ["hidden-nan", "hidden+inf", "hidden-inf", "weight-nan"])
@pytest.mark.parametrize("support", list(SUPPORTS))
def test_non_finite_rows_give_nan_as_the_whole_vocabulary(backend, support, where):
    """NaN in, NaN out (issue 65, 1-2): a NaN / ±inf hidden entry or a NaN weight row gives the
    loss and the poisoned rows' log-probs NaN over the support as over the whole vocabulary —
    never an index error (the top-p histogram select) nor a finite loss with non-finite
    gradients (a ratio exp(-inf) = 0 clipped away). Rows without a non-finite logit stay
    finite where the support does not name the poisoned weight row."""
    b = make_batch(B=2, T=5, H=16, V=67, logit_scale=3.0, empty_row=False, mask_p=1.1)
    y = b["targets"]
    h, w = _poisoned(b, where)
    kw = SUPPORTS[support](y, 67)
    lp, = gbc.fused_linear_logprobs(h, w, y, bias=b["bias"], backend=backend, **kw)[:1]
    full, = gbc.fused_linear_logprobs(h, w, y, bias=b["bias"], backend=backend)[:1]
    bad = torch.isnan(full)
    assert bad.any()
    if where != "weight-nan" or support != "support_ids":     # the row was formed: NaN too
        assert torch.isnan(lp[bad]).all()
    assert torch.isfinite(lp[~bad]).all()
    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss, _ = gbc.fused_linear_policy_loss(hl, wl, y, b["mask"], b["advantages"],
                                           old_logp=b["old_logp"], bias=b["bias"],
                                           backend=backend, **kw)
    assert torch.isnan(loss), float(loss)
    st = gbc.token_stats(h, w, y, b["bias"], backend=backend, **kw)
    assert torch.isnan(st.logp[bad]).all() if where != "weight-nan" or support != "support_ids" \
        else torch.isfinite(st.logp).any()


@pytest.mark.parametrize("support", list(SUPPORTS))
def test_log_kept_mass_stays_at_temperature_under_another_certainty_temperature(backend,
                                                                                support):
    """issue 65, 3: ``token_stats(return_log_kept_mass=True)`` with a certainty at its own
    ``certainty_temperature`` returns the kept mass at ``temperature`` (the certainty's pass
    scores the same rows again and must not overwrite it), against float64."""
    if support == "support_ids":
        pytest.skip("support_ids: covered by the float64 case below")
    b = make_batch(B=3, T=7, H=16, V=53, logit_scale=3.0)
    y = b["targets"].clamp(min=0)
    kw = SUPPORTS[support](y, 53)
    one = gbc.token_stats(b["hidden"], b["weight"], y, b["bias"], temperature=0.7,
                          backend=backend, return_log_kept_mass=True, **kw)
    two = gbc.token_stats(b["hidden"], b["weight"], y, b["bias"], temperature=0.7,
                          certainty="entropy", certainty_temperature=1.6, backend=backend,
                          return_log_kept_mass=True, **kw)
    assert (one.log_kept_mass < -1e-3).any()
    assert torch.equal(one.log_kept_mass, two.log_kept_mass)
    assert torch.equal(one.logp, two.logp)


@pytest.mark.parametrize("ctemp", [1.6, 0.7])
def test_log_kept_mass_with_certainty_matches_float64(backend, ctemp):
    """issue 65, 3 with recorded ids, against ``gbc_reference`` in float64: ``log_kept_mass``
    at ``temperature`` whatever ``certainty_temperature`` is."""
    b = make_batch(B=3, T=7, H=16, V=53, logit_scale=3.0)
    y = b["targets"].clamp(min=0)
    ids = support_for(y, 53)
    got = gbc.token_stats(b["hidden"], b["weight"], y, b["bias"], temperature=0.7,
                          certainty="max_prob", certainty_temperature=ctemp, backend=backend,
                          return_log_kept_mass=True, support_ids=ids)
    x = as64(b)
    _, _, want = ref.fused_linear_logprobs(x["hidden"], x["weight"], y, bias=x["bias"],
                                           temperature=0.7, return_entropy=True,
                                           support_ids=ids, return_log_kept_mass=True)
    assert err(got.log_kept_mass, want) < 1e-6


@pytest.mark.parametrize("shape", [(0, 4), (3, 0)], ids=["B0", "T0"])
@pytest.mark.parametrize("support", list(SUPPORTS))
def test_zero_tokens_with_a_support(backend, support, shape):
    """issue 65, 6: ``support_ids`` (and ``sampler_truncation``) on zero tokens are accepted as
    the same calls without a support are: empty outputs, a zero loss, zero gradients."""
    H, V = 8, 29
    h = torch.randn(*shape, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    y = torch.zeros(shape, dtype=torch.long)
    m = torch.ones(shape, dtype=torch.bool)
    kw = SUPPORTS[support](y, V)
    lp, ent = gbc.fused_linear_logprobs(h, w, y, return_entropy=True, backend=backend, **kw)
    assert lp.shape == shape and ent.shape == shape
    st = gbc.token_stats(h, w, y, backend=backend, return_log_kept_mass=True, **kw)
    assert st.logp.shape == shape and st.log_kept_mass.shape == shape
    loss, _ = gbc.fused_linear_policy_loss(h, w, y, m, torch.zeros(shape[0]), backend=backend,
                                           **kw)
    loss.backward()
    assert float(loss) == 0.0
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("support", ["support_ids", "min_p", "top_k"])
def test_inf_hidden_with_a_minus_inf_target_gives_nan_loss(backend, support):
    """issue 65, 2, the case the sweep found: +inf in one hidden entry puts every logit of the
    token at ±inf; with its target on the -inf side and a kept id on the +inf side, ``logp_S`` was -inf,
    the ratio 0 was clipped away and the loss came out finite with non-finite gradients. The
    whole vocabulary's loss is NaN, and so must the support's be."""
    b = make_batch(B=2, T=5, H=16, V=67, logit_scale=3.0, empty_row=False, mask_p=1.1)
    h, w, y = b["hidden"].clone(), b["weight"], b["targets"].clone()
    h[0, 1, 3] = float("inf")
    neg, pos = (w[:, 3] < 0).nonzero().squeeze(1), (w[:, 3] > 0).nonzero().squeeze(1)
    y[0, 1] = neg[0]
    kw = SUPPORTS[support](y, 67)
    if support == "support_ids":          # one kept id at +inf, the others with the target
        ids = kw["support_ids"]
        ids[0, 1] = torch.cat([pos[:1], neg[1:ids.shape[-1]]])
    hl = h.clone().requires_grad_(True)
    for old in (b["old_logp"], None):
        loss, _ = gbc.fused_linear_policy_loss(hl, w, y, b["mask"], b["advantages"],
                                               old_logp=old, bias=b["bias"], backend=backend,
                                               **kw)
        whole, _ = gbc.fused_linear_policy_loss(hl, w, y, b["mask"], b["advantages"],
                                                old_logp=old, bias=b["bias"], backend=backend)
        assert torch.isnan(whole)
        assert torch.isnan(loss), float(loss)
