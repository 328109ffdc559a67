"""The support route (issue 66; docs/math.md §16, "The support route"): a chunk whose distinct
kept ids ``U`` are few is projected through ``W[U]`` only — the sub-GEMM ``h_c · W[U]ᵀ``, each
row read over its own members, ``dH = G · W[U]``, ``dW[U] += Gᵀ · h_c`` — and rows whose support
is the target alone are not projected at all. Every case against the float64 oracle
(``gbc_reference``, full logits masked to the support) and against the whole-head route
(``GBC_SUPPORT_ROUTE_FRACTION=0``) on every backend: forced targets, duplicates, padding-only
rows (singletons), a chunk above the threshold beside one below it, bf16 operands with float32
logits, temperature (scalar and per token), soft-capping, ``weight_grad_into``, determinism."""

from __future__ import annotations

import pytest
import torch

import gbc_kernels as gbc
import gbc_kernels.support as S
import gbc_reference as ref
from conftest import as64, leaves, make_batch, max_rel_err
from test_support import err, support_for


@pytest.fixture
def routes(monkeypatch):
    """Counts the chunks that took the route (``[routed, chunks]``) over a test."""
    seen = [0, 0]
    orig = S.SupportBackend.chunk_view

    def counted(self, targets, vocab):
        view = orig(self, targets, vocab)
        seen[0] += view is not None
        seen[1] += 1
        return view

    monkeypatch.setattr(S.SupportBackend, "chunk_view", counted)
    return seen


def _run(lib, b, ids, backend=None, temperature=0.7, softcap=None, into=None, **kw):
    x = leaves(b)
    extra = {} if backend is None else {"backend": backend}
    if into is not None:
        extra["weight_grad_into"] = into
    lp, ent = lib.fused_linear_logprobs(
        x["hidden"], x["weight"], b["targets"].clamp(min=0), bias=x["bias"],
        temperature=temperature, return_entropy=True, support_ids=ids, logit_softcap=softcap,
        **extra, **kw)
    g = torch.Generator().manual_seed(5)
    u1 = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    u2 = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    (lp.double() * u1 + ent.double() * u2).sum().backward()
    return lp, ent, [x[k].grad for k in ("hidden", "weight", "bias")]


def _wide_support(targets, V, k, seed=0):
    """``support_for``'s mixed cases with ``k`` ids a row: ``k`` large makes ``|U|`` cross
    the threshold."""
    return support_for(targets, V, k=k, seed=seed)


@pytest.mark.parametrize("softcap", [None, 4.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("temp", ["scalar", "per-token"])
def test_route_matches_float64_and_the_whole_head(backend, softcap, temp, small_chunks,
                                                  routes, monkeypatch):
    """Log-probs, entropy and the gradients (random upstream gradients) on the route, against
    float64 and against the whole-head route of the same call."""
    b = make_batch(B=3, T=11, H=24, V=211, logit_scale=3.0)
    ids = support_for(b["targets"], 211, k=4)
    t = 0.7 if temp == "scalar" else torch.rand(3, 11, generator=torch.Generator()
                                                .manual_seed(1)) + 0.5
    got = _run(gbc, b, ids, backend, temperature=t, softcap=softcap)
    assert routes[0] == routes[1] > 1          # every chunk took the route
    want = _run(ref, as64(b), ids, temperature=t, softcap=softcap)
    for g_, w_ in zip(got[:2], want[:2]):
        assert g_.dtype == torch.float32 and err(g_, w_) < 1e-6
    for g_, w_ in zip(got[2], want[2]):
        assert max_rel_err(g_, w_) < 2e-5
    monkeypatch.setenv("GBC_SUPPORT_ROUTE_FRACTION", "0")
    whole = _run(gbc, b, ids, backend, temperature=t, softcap=softcap)
    for g_, w_ in zip(got[:2], whole[:2]):
        assert err(g_, w_) < 1e-6
    for g_, w_ in zip(got[2], whole[2]):
        assert max_rel_err(g_, w_) < 2e-5


def test_singletons_cost_no_row_and_are_exact(backend, routes):
    """A row whose support is its target alone (padding only, or its ids all the target) is
    not projected: log-prob 0, entropy 0, no gradient on its hidden state — and a row of
    singletons only runs no GEMM at all. A NaN hidden state in such a row still gives NaN."""
    b = make_batch(B=2, T=6, H=16, V=97, logit_scale=3.0, empty_row=False)
    y = b["targets"]
    ids = support_for(y, 97, k=5)
    ids[0, :3] = -1                                          # padding only
    ids[1, 2] = y[1, 2]                                      # the target, repeated
    lp, ent, (gh, gw, gb) = _run(gbc, b, ids, backend)
    assert routes[0] == routes[1] >= 1
    single = ~((ids >= 0) & (ids != y.unsqueeze(-1))).any(-1)
    assert single[0, :3].all() and single[1, 2] and not single.all()
    assert (lp[single] == 0).all() and (ent[single] == 0).all()
    assert (gh[single] == 0).all() and (gh[~single].abs().sum(-1) > 0).all()
    want = _run(ref, as64(b), ids)
    assert err(lp, want[0]) < 1e-6 and max_rel_err(gw, want[2][1]) < 2e-5
    # every row a singleton: no GEMM, every output exact, the weight gradient zero
    lp, ent, (gh, gw, gb) = _run(gbc, b, torch.full_like(ids, -1), backend)
    assert (lp == 0).all() and (ent == 0).all() and (gw == 0).all() and (gh == 0).all()
    h = b["hidden"].clone()
    h[0, 1, 4] = float("nan")
    lp, = gbc.fused_linear_logprobs(h, b["weight"], y, bias=b["bias"], support_ids=ids,
                                    backend=backend)[:1]
    assert torch.isnan(lp[0, 1]) and torch.isfinite(lp[1]).all()


def test_chunks_on_both_sides_of_the_threshold(backend, small_chunks, routes):
    """Rows with wide supports (their chunk's ``|U|`` above the threshold: the whole head) and
    rows with narrow ones (the route) in one call: both routes run and the numbers are the
    oracle's."""
    b = make_batch(B=4, T=10, H=16, V=61, logit_scale=2.0)
    y = b["targets"].clamp(min=0)
    ids = _wide_support(y, 61, 40)
    ids[2:, :, 3:] = -1                                      # the last rows: narrow supports
    ids[2:, :, :3] = ids[2:, :, :3] % 7
    got = _run(gbc, b, ids, backend)
    assert 0 < routes[0] < routes[1]
    want = _run(ref, as64(b), ids)
    for g_, w_ in zip(got[:2], want[:2]):
        assert err(g_, w_) < 1e-6
    for g_, w_ in zip(got[2], want[2]):
        assert max_rel_err(g_, w_) < 2e-5


@pytest.mark.parametrize("cfg", [dict(), dict(kl_coef=0.05, entropy_coef=0.01, ar_alpha=0.3)],
                         ids=["grpo", "kl-entropy-ar"])
def test_policy_loss_on_the_route(backend, cfg, small_chunks, routes):
    """The fused loss on the route: loss, gradients and metrics against float64; with
    ``token_out`` (log_kept_mass, the whole head projected for ``LSE_V`` alone) the same bits."""
    b = make_batch(B=4, T=9, H=16, V=131, logit_scale=2.0)
    ids = support_for(b["targets"], 131, k=3, mask=b["mask"])
    out = {}
    for lib, batch in ((gbc, b), (ref, as64(b))):
        x, tok = leaves(batch), {}
        extra = {"backend": backend} if lib is gbc else {}
        L, m = lib.fused_linear_policy_loss(
            x["hidden"], x["weight"], batch["targets"], batch["mask"], batch["advantages"],
            batch["old_logp"], batch["ref_logp"], bias=x["bias"],
            config=lib.PolicyLossConfig(**cfg), temperature=0.9, support_ids=ids,
            token_out=tok, **extra)
        (L * 1.7).backward()
        out[lib] = L, m, tok, [x[k].grad for k in ("hidden", "weight", "bias")]
    (L, m, tok, grads), (L64, m64, tok64, grads64) = out[gbc], out[ref]
    assert routes[0] == routes[1] > 0
    assert abs(L.item() - L64.item()) < 1e-5 * max(1.0, abs(L64.item()))
    for g_, w_ in zip(grads, grads64):
        assert max_rel_err(g_, w_) < 1e-4
    for k, v in m64.items():
        assert abs(float(m[k]) - float(v)) < 1e-4 * max(1.0, abs(float(v))), k
    assert err(tok["log_kept_mass"], tok64["log_kept_mass"]) < 1e-6
    x = leaves(b)
    L2, _ = gbc.fused_linear_policy_loss(
        x["hidden"], x["weight"], b["targets"], b["mask"], b["advantages"], b["old_logp"],
        b["ref_logp"], bias=x["bias"], config=gbc.PolicyLossConfig(**cfg), temperature=0.9,
        support_ids=ids, backend=backend)
    (L2 * 1.7).backward()
    assert torch.equal(L2, L)
    assert all(torch.equal(x[k].grad, g) for k, g in zip(("hidden", "weight", "bias"), grads))


def test_bf16_operands_float32_logits_on_the_route(routes):
    """bf16 hidden states and weight, ``logits_dtype=float32``: the sub-GEMM's logits and the
    gradient products in float32, against float64 of the same bf16 values."""
    b = make_batch(B=3, T=8, H=32, V=157, logit_scale=3.0, dtype=torch.bfloat16)
    ids = support_for(b["targets"], 157, k=4)
    got = _run(gbc, b, ids, "torch", logits_dtype=torch.float32)
    assert routes[0] == routes[1] > 0
    want = _run(ref, as64(b), ids)
    assert got[0].dtype == torch.float32 and err(got[0], want[0]) < 1e-5
    for g_, w_ in zip(got[2], want[2]):
        assert max_rel_err(g_, w_) < 1e-2          # bf16 gradients: rounded once


def test_weight_grad_into_and_determinism(backend, small_chunks, routes):
    """``weight_grad_into`` (megatron's float32 ``main_grad``) takes the route's ``dW[U]`` rows
    added into it, the rest untouched; two runs give the same bits."""
    b = make_batch(B=3, T=9, H=16, V=101, logit_scale=2.0)
    ids = support_for(b["targets"], 101, k=4)
    base = torch.randn(101, 16, generator=torch.Generator().manual_seed(3))
    into = base.clone()
    _run(gbc, b, ids, backend, into=into)
    want = _run(ref, as64(b), ids)
    assert max_rel_err(into - base, want[2][1]) < 2e-5
    untouched = ~torch.isin(torch.arange(101), torch.cat([ids[ids >= 0],
                                                          b["targets"].clamp(min=0).flatten()]))
    assert untouched.any() and torch.equal(into[untouched], base[untouched])
    one = _run(gbc, b, ids, backend)
    two = _run(gbc, b, ids, backend)
    assert all(torch.equal(p, q) for p, q in zip(one[:2] + tuple(one[2]),
                                                 two[:2] + tuple(two[2])))
    assert routes[0] > 0


def test_token_stats_and_reference_stats_on_the_route(backend, routes):
    """``token_stats`` (certainty over the support) and ``methods.reference_stats`` (the
    critical-KL weights over the support) take the route; same numbers as the whole head."""
    from gbc_kernels import methods

    b = make_batch(B=3, T=8, H=16, V=89, logit_scale=3.0)
    y = b["targets"].clamp(min=0)
    ids = support_for(y, 89, k=3)
    st = gbc.token_stats(b["hidden"], b["weight"], y, b["bias"], temperature=0.8,
                         certainty="entropy", certainty_temperature=1.3, support_ids=ids,
                         backend=backend)
    opts = methods.MethodOptions(critical_kl_exponent=1.5)
    rs = methods.reference_stats(b["hidden"], b["weight"], y, opts, b["bias"], temperature=0.8,
                                 support_ids=ids, backend=backend)
    assert routes[0] == routes[1] > 0
    x = as64(b)
    lp64, ent64 = ref.fused_linear_logprobs(x["hidden"], x["weight"], y, bias=x["bias"],
                                            temperature=0.8, return_entropy=True,
                                            support_ids=ids)
    assert err(st.logp, lp64) < 1e-6 and err(st.entropy, ent64) < 1e-6
    import os
    os.environ["GBC_SUPPORT_ROUTE_FRACTION"] = "0"
    try:
        st0 = gbc.token_stats(b["hidden"], b["weight"], y, b["bias"], temperature=0.8,
                              certainty="entropy", certainty_temperature=1.3, support_ids=ids,
                              backend=backend)
        rs0 = methods.reference_stats(b["hidden"], b["weight"], y, opts, b["bias"],
                                      temperature=0.8, support_ids=ids, backend=backend)
    finally:
        del os.environ["GBC_SUPPORT_ROUTE_FRACTION"]
    assert err(st.certainty, st0.certainty) < 1e-6
    for a, c in zip(rs, rs0):
        if isinstance(a, torch.Tensor):
            assert err(a, c) < 1e-6


def test_route_fraction_setting_refused_when_bad(monkeypatch):
    b = make_batch(B=1, T=3, H=8, V=29)
    monkeypatch.setenv("GBC_SUPPORT_ROUTE_FRACTION", "half")
    with pytest.raises(ValueError, match="^GBC_SUPPORT_ROUTE_FRACTION: expected a number"):
        gbc.fused_linear_logprobs(b["hidden"], b["weight"], b["targets"].clamp(min=0),
                                  support_ids=support_for(b["targets"], 29, k=3))


# ------------------------------------------------- one kept set per rollout (issue 66, 2)
TRUNCS = {"top_k": dict(top_k=5), "top_p": dict(top_p=0.8), "min_p": dict(min_p=0.1),
          "top_k_top_p": dict(top_k=8, top_p=0.9)}


def _as_sets(ids):
    """Each row's ids as a set (padding dropped)."""
    flat = ids.reshape(-1, ids.shape[-1]).tolist()
    return [frozenset(i for i in row if i >= 0) for row in flat]


@pytest.mark.parametrize("kept_mass", [False, True], ids=["replay", "kept_mass"])
@pytest.mark.parametrize("trunc", list(TRUNCS))
def test_return_support_ids_is_the_set_built_and_replays_it(backend, trunc, kept_mass,
                                                            small_chunks):
    """``return_support_ids=True``: the ids each row's kept set holds (the float64 oracle's
    rule over the full logits; the target not forced in), int32, -1 padded; replayed as
    ``support_ids`` in a later pass they give that pass's numbers over the same set, and the
    loss over them forces exactly the tokens the building pass forced."""
    b = make_batch(B=3, T=9, H=16, V=71, logit_scale=4.0)
    y = b["targets"].clamp(min=0)
    tr = gbc.SamplerTruncation(**TRUNCS[trunc])
    st = gbc.token_stats(b["hidden"], b["weight"], y, b["bias"], temperature=0.8,
                         sampler_truncation=tr, return_support_ids=True,
                         return_log_kept_mass=True, over_support=not kept_mass, backend=backend)
    ids = st.support_ids
    assert ids.dtype == torch.int32 and ids.shape[:2] == y.shape and ids.min() >= -1
    x = as64(b)
    want = ref.truncation_support_ids(x["hidden"], x["weight"], y, x["bias"], temperature=0.8,
                                      **TRUNCS[trunc])
    assert _as_sets(ids) == _as_sets(want)
    # replayed: the same log-probs and kept mass as the pass that built the set
    lp, _, lk, forced = gbc.fused_linear_logprobs(
        b["hidden"], b["weight"], y, bias=b["bias"], temperature=0.8, return_entropy=True,
        support_ids=ids, return_log_kept_mass=True, return_support_forced=True,
        over_support=not kept_mass, backend=backend)
    assert err(lp, st.logp) < 1e-6
    assert err(lk, st.log_kept_mass) < 1e-5      # LSE_S − LSE_V: two float32 sums apart
    _, _, _, forced_built = gbc.fused_linear_logprobs(
        b["hidden"], b["weight"], y, bias=b["bias"], temperature=0.8, return_entropy=True,
        sampler_truncation=tr, return_log_kept_mass=True, return_support_forced=True,
        over_support=not kept_mass, backend=backend)
    assert torch.equal(forced, forced_built)
    assert not ((ids == y.unsqueeze(-1)).any(-1) & forced).any()    # the target not forced in


def test_return_support_ids_from_fused_linear_logprobs_and_refusals(backend):
    """The same ids from ``fused_linear_logprobs`` (a last output); refused without
    ``sampler_truncation`` and when not a bool."""
    b = make_batch(B=2, T=5, H=16, V=43, logit_scale=4.0)
    y = b["targets"].clamp(min=0)
    tr = gbc.SamplerTruncation(top_k=4, top_p=0.9)
    *_, ids = gbc.fused_linear_logprobs(b["hidden"], b["weight"], y, bias=b["bias"],
                                        sampler_truncation=tr, return_support_ids=True,
                                        backend=backend)
    st = gbc.token_stats(b["hidden"], b["weight"], y, b["bias"], sampler_truncation=tr,
                         return_support_ids=True, backend=backend)
    assert _as_sets(ids) == _as_sets(st.support_ids) and st.log_kept_mass is None
    with pytest.raises(ValueError, match="^return_support_ids: needs sampler_truncation"):
        gbc.token_stats(b["hidden"], b["weight"], y, support_ids=support_for(y, 43),
                        return_support_ids=True)
    with pytest.raises(TypeError, match="^return_support_ids: expected a bool"):
        gbc.fused_linear_logprobs(b["hidden"], b["weight"], y, sampler_truncation=tr,
                                  return_support_ids=1)


def test_return_support_ids_from_the_policy_loss_builds_what_the_later_passes_replay(backend):
    """``fused_linear_policy_loss(..., sampler_truncation, return_support_ids=True)`` (the
    update that builds the set where a trainer runs no old-policy pass): the ids of the float64
    oracle's rule on the masked-in rows (-1 elsewhere: the loss projects no other row), -1
    padded int32; that pass's loss and gradients (upstream 1.7) against
    float64 replaying the oracle's set, and equal to the same loss replaying the returned ids
    (the support route)."""
    b = make_batch(B=3, T=7, H=16, V=67, logit_scale=4.0)
    y = b["targets"].clamp(min=0)
    tr = gbc.SamplerTruncation(top_k=5, top_p=0.9)
    x64 = as64(b)
    want = ref.truncation_support_ids(x64["hidden"], x64["weight"], y, x64["bias"],
                                      temperature=0.8, top_k=5, top_p=0.9)
    out = {}
    for name, lib, batch, kw in (
            ("built", gbc, b, dict(sampler_truncation=tr, return_support_ids=True,
                                   backend=backend)),
            ("f64", ref, x64, dict(support_ids=want)), ("replayed", gbc, b, None)):
        x = leaves(batch)
        if kw is None:
            kw = dict(support_ids=ids, backend=backend)
        res = lib.fused_linear_policy_loss(
            x["hidden"], x["weight"], y, batch["mask"], batch["advantages"], batch["old_logp"],
            batch["ref_logp"], bias=x["bias"], config=lib.PolicyLossConfig(kl_coef=0.05),
            temperature=0.8, **kw)
        if name == "built":
            L, m, ids = res
            assert ids.dtype == torch.int32 and ids.shape[:2] == y.shape
            # the loss projects the masked-in rows only: the others hold no id
            inside = b["mask"].reshape(-1).tolist()
            got, exp = _as_sets(ids), _as_sets(want)
            assert [g for g, i in zip(got, inside) if i] == [e for e, i in zip(exp, inside) if i]
            assert not any(g for g, i in zip(got, inside) if not i)
        else:
            L, m = res
        (L * 1.7).backward()
        out[name] = L.detach(), m, [x[k].grad for k in ("hidden", "weight", "bias")]
    (L, m, g), (L64, m64, g64), (Lr, mr, gr) = out["built"], out["f64"], out["replayed"]
    assert abs(L.item() - L64.item()) < 1e-5 * max(1.0, abs(L64.item()))
    for a, c in zip(g, g64):
        assert max_rel_err(a, c) < 1e-4
    assert abs(float(m["support_forced_frac"]) - float(m64["support_forced_frac"])) < 1e-6
    assert abs(Lr.item() - L.item()) < 1e-6 * max(1.0, abs(L.item()))
    for a, c in zip(gr, g):
        assert max_rel_err(a, c) < 1e-5
    assert float(mr["support_forced_frac"]) == float(m["support_forced_frac"])
    cfg = gbc.PolicyLossConfig()
    with pytest.raises(ValueError, match="^return_support_ids: needs sampler_truncation"):
        gbc.fused_linear_policy_loss(b["hidden"], b["weight"], y, b["mask"], b["advantages"],
                                     config=cfg, support_ids=ids, return_support_ids=True)
    with pytest.raises(TypeError, match="^return_support_ids: expected a bool"):
        gbc.fused_linear_policy_loss(b["hidden"], b["weight"], y, b["mask"], b["advantages"],
                                     config=cfg, sampler_truncation=tr, return_support_ids="yes")


def test_support_set_option_and_join_support_ids():
    """``MethodOptions.support_set``: "rollout" (the default under replay) or "per_pass";
    refused without replay, naming the trainer's option. ``join_support_ids`` pads each part
    to the widest set with -1 and concatenates, refusing what is not a kept-id tensor."""
    from gbc_kernels import methods
    assert methods.MethodOptions(support="replay").one_set_per_rollout
    assert methods.MethodOptions(support="replay", support_set="rollout").one_set_per_rollout
    assert not methods.MethodOptions(support="replay", support_set="per_pass").one_set_per_rollout
    assert not methods.MethodOptions(support="kept_mass").one_set_per_rollout
    assert methods.MethodOptions(support="replay", support_set="off").support_set is None
    with pytest.raises(ValueError, match="^support_set: expected one of"):
        methods.MethodOptions(support="replay", support_set="once")
    with pytest.raises(ValueError, match="^support_set: 'rollout' .*kept_mass's later passes"):
        methods.MethodOptions(support="kept_mass", support_set="rollout")
    with pytest.raises(ValueError, match="^gbc_support_set: refused .*support is None"):
        methods.MethodOptions.from_kwargs({"support_set": "gbc_support_set"}, support_ok=True,
                                          support_set="per_pass")
    with pytest.raises(ValueError, match="^gbc_support=replay: not run by this gbc"):
        methods.MethodOptions.from_kwargs({"support_set": "gbc_support_set",
                                           "support": "gbc_support"},
                                          support="replay", support_set="per_pass")
    a = torch.tensor([[[4, 1]], [[7, -1]]], dtype=torch.int32)
    c = torch.tensor([[[3, -1, 9]]], dtype=torch.int64)
    j = methods.join_support_ids([a, c])
    assert j.dtype == torch.int32
    assert j.tolist() == [[[4, 1, -1]], [[7, -1, -1]], [[3, -1, 9]]]
    assert methods.join_support_ids([a, a[:, :, :1]], dim=1).tolist() == [
        [[4, 1], [4, -1]], [[7, -1], [7, -1]]]
    with pytest.raises(ValueError, match="^join_support_ids: parts: expected at least one"):
        methods.join_support_ids([])
    with pytest.raises(TypeError, match=r"^join_support_ids: parts\[1\]: expected an int32"):
        methods.join_support_ids([a, a.float()])
    with pytest.raises(ValueError, match="^join_support_ids: dim: expected a dimension"):
        methods.join_support_ids([a], dim=2)


def _token_sets(ids):
    return [[frozenset(t[t >= 0].tolist()) for t in row] for row in ids]


def test_compact_support_ids_round_trip_and_row_splits():
    """``compact_support_ids`` / ``expand_support_ids``: the same set at every token after a
    round trip (ids of random widths, holes of -1 inside a row, rows of padding only, a
    sequence with no id), after any gather of rows (a trainer's shuffle and micro-batches), the
    expanded width the widest set of the rows kept; the form carries its own T; bad inputs
    refused by name."""
    from gbc_kernels import methods
    g = torch.Generator().manual_seed(3)
    B, T, K = 5, 11, 9
    ids = torch.randint(0, 1000, (B, T, K), generator=g)
    width = torch.randint(0, K + 1, (B, T), generator=g)
    ids = torch.where(torch.arange(K) < width.unsqueeze(-1), ids, -1)
    ids[..., 0] = torch.where(torch.rand(B, T, generator=g) < 0.2, -1, ids[..., 0])   # holes
    ids[2] = -1                                               # a sequence with no id at all
    compact = methods.compact_support_ids(ids)
    M = int((ids >= 0).sum((1, 2)).max())
    assert compact.dtype == torch.int32 and compact.shape == (B, 1 + T + M)
    assert (compact[:, 0] == T).all()
    back = methods.expand_support_ids(compact, T)
    assert torch.equal(methods.expand_support_ids(compact), back)
    assert _token_sets(back) == _token_sets(ids)
    assert back.shape[-1] == int((ids >= 0).sum(-1).max())
    for rows in ([3, 0], [2], [4, 1, 1]):
        part = methods.expand_support_ids(compact[rows], T)
        assert _token_sets(part) == _token_sets(ids[rows])
        assert part.shape[-1] == max(1, int((ids[rows] >= 0).sum(-1).max()))
    # replayed from the compact form: the same log-probs as from the padded ids
    b = make_batch(B=2, T=6, H=16, V=53, logit_scale=3.0)
    y = b["targets"].clamp(min=0)
    st = gbc.token_stats(b["hidden"], b["weight"], y, b["bias"],
                         sampler_truncation=gbc.SamplerTruncation(top_k=6, top_p=0.9),
                         return_support_ids=True)
    lp = gbc.fused_linear_logprobs(b["hidden"], b["weight"], y, bias=b["bias"],
                                   support_ids=st.support_ids)[0]
    lp_c = gbc.fused_linear_logprobs(
        b["hidden"], b["weight"], y, bias=b["bias"],
        support_ids=methods.expand_support_ids(methods.compact_support_ids(st.support_ids),
                                               6))[0]
    assert torch.equal(lp, lp_c)
    empty = methods.compact_support_ids(torch.full((0, 4, 3), -1))
    assert empty.shape == (0, 5) and methods.expand_support_ids(empty, 4).shape == (0, 4, 1)
    with pytest.raises(TypeError, match="^compact_support_ids: ids: expected"):
        methods.compact_support_ids(ids.float())
    with pytest.raises(TypeError, match="^expand_support_ids: compact: expected"):
        methods.expand_support_ids(ids, T)
    with pytest.raises(ValueError, match="^expand_support_ids: T: expected the 11 tokens"):
        methods.expand_support_ids(compact, T + 1)
    bad = compact.clone()
    bad[0, 0] = T + 2
    with pytest.raises(ValueError, match="^expand_support_ids: compact: its first column"):
        methods.expand_support_ids(bad)
    bad = compact.clone()
    bad[1, 1] = M + 1
    with pytest.raises(ValueError, match="^expand_support_ids: compact: a row's counts"):
        methods.expand_support_ids(bad)


# ------------------------------------------------------------------ vocab parallel
def _vp_route_worker(rank, world, backend):
    """Rank ``rank`` holds rows ``[cut_r, cut_{r+1})`` of the head (uneven slices). Narrow
    supports (the route on both ranks); the first sequence's members all on rank 0's slice and
    chunks of a few rows, so that rank 1 holds none of some chunks' ``U``."""
    import os

    os.environ["GBC_CHUNK_MB"] = "0.002"
    V, cuts = 97, [0, 40, 97]
    lo, hi = cuts[rank], cuts[rank + 1]
    b = make_batch(B=3, T=7, H=16, V=V, logit_scale=2.0)
    y = b["targets"]
    ids = support_for(y.clamp(min=0), V, k=3)
    y[0] = y[0] % 40
    ids[0] = ids[0] % 40                       # all on rank 0 (the padding stays -1 ... )
    ids[0][support_for(y.clamp(min=0), V, k=3)[0] < 0] = -1
    seen = []
    orig = S.SupportBackend.chunk_view

    def counted(self, targets, vocab):
        view = orig(self, targets, vocab)
        seen.append(-1 if view is None else int((view.targets[:, 2:] >= 0).sum()))
        return view

    S.SupportBackend.chunk_view = counted
    vp = gbc.VocabParallel(None, lo, hi)
    x = leaves(b)
    w = x["weight"].detach()[lo:hi].clone().requires_grad_(True)
    bb = x["bias"].detach()[lo:hi].clone().requires_grad_(True)
    h = x["hidden"]
    L, m = gbc.fused_linear_policy_loss(
        h, w, y, b["mask"], b["advantages"], b["old_logp"], b["ref_logp"], bias=bb,
        config=gbc.PolicyLossConfig(kl_coef=0.05, entropy_coef=0.01), temperature=0.9,
        support_ids=ids, vocab_parallel=vp, backend=backend)
    (L * 1.3).backward()
    h2 = b["hidden"].detach().clone().requires_grad_(True)
    w2 = b["weight"].detach()[lo:hi].clone().requires_grad_(True)
    lp, ent = gbc.fused_linear_logprobs(h2, w2, y.clamp(min=0), bias=b["bias"][lo:hi],
                                        temperature=0.7, return_entropy=True, support_ids=ids,
                                        vocab_parallel=vp, backend=backend)
    (lp.sum() + 0.5 * ent.sum()).backward()
    return dict(L=L.detach(), gh=h.grad, gw=w.grad, gb=bb.grad, lp=lp.detach(),
                ent=ent.detach(), gh2=h2.grad, gw2=w2.grad, ids=ids, y=y, seen=seen)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_vocab_parallel_route_matches_float64(backend):
    """Two gloo ranks with uneven slices, each taking the route over its own slice's ``U``
    (a rank holding none of a chunk's ids projects nothing for it), the support's statistics
    in the existing all_gather: the loss, log-probs, entropy and every gradient against
    float64."""
    from conftest import spawn_gloo

    if backend == "cpu" and not gbc.backends.cpu_available():
        pytest.skip("the C++ extension is not built")
    out = spawn_gloo(2, _vp_route_worker, backend)
    b = make_batch(B=3, T=7, H=16, V=97, logit_scale=2.0)
    ids, y = out[0]["ids"], out[0]["y"]
    b["targets"] = y
    x = leaves(as64(b))
    L64, _ = ref.fused_linear_policy_loss(
        x["hidden"], x["weight"], y, b["mask"], b["advantages"], b["old_logp"],
        b["ref_logp"], bias=x["bias"], config=ref.PolicyLossConfig(kl_coef=0.05,
                                                                   entropy_coef=0.01),
        temperature=0.9, support_ids=ids)
    (L64 * 1.3).backward()
    h2, w2 = (as64(b)[k].detach().clone().requires_grad_(True) for k in ("hidden", "weight"))
    lp64, ent64 = ref.fused_linear_logprobs(h2, w2, y.clamp(min=0), bias=as64(b)["bias"],
                                            temperature=0.7, return_entropy=True,
                                            support_ids=ids)
    (lp64.sum() + 0.5 * ent64.sum()).backward()
    cuts = [0, 40, 97]
    assert all(u >= 0 for o in out for u in o["seen"])          # every chunk on the route
    assert 0 in out[1]["seen"]                           # rank 1 held no member of a chunk
    for r, o in enumerate(out):
        lo, hi = cuts[r], cuts[r + 1]
        assert abs(o["L"].item() - L64.item()) < 1e-5 * max(1, abs(L64.item()))
        assert max_rel_err(o["gh"], x["hidden"].grad) < 1e-4
        assert max_rel_err(o["gw"], x["weight"].grad[lo:hi]) < 1e-4
        assert max_rel_err(o["gb"], x["bias"].grad[lo:hi]) < 1e-4
        assert err(o["lp"], lp64) < 1e-6 and err(o["ent"], ent64) < 1e-6
        assert max_rel_err(o["gh2"], h2.grad) < 1e-4
        assert max_rel_err(o["gw2"], w2.grad[lo:hi]) < 1e-4


def test_batch_invariant_mode_keeps_the_whole_head(monkeypatch, routes):
    """``GBC_BATCH_INVARIANT=1``: a chunk's ``U`` depends on its other rows, so the route is
    not taken (every chunk through the fixed-shape whole head)."""
    monkeypatch.setenv("GBC_BATCH_INVARIANT", "1")
    b = make_batch(B=2, T=5, H=16, V=97)
    y = b["targets"].clamp(min=0)
    gbc.fused_linear_logprobs(b["hidden"], b["weight"], y, support_ids=support_for(y, 97, k=3))
    assert routes[0] == 0 and routes[1] > 0
