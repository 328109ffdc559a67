"""The sampler's kept set rebuilt from its settings (docs/math.md §16, "The sampler's kept
set, recomputed"; issue 61's core):
``sampler_truncation=SamplerTruncation(top_k, top_p, min_p, ties, rule)`` on
``fused_linear_logprobs``, ``fused_linear_policy_loss`` and ``token_stats``, every backend.

Oracles: ``gbc_reference.kept_set`` (the rule on the full float64 logits, one sort of the row),
itself checked against literal transcriptions of vLLM's PyTorch sampler and SGLang's joint
filter; then ``gbc_reference``'s float64 functions over that set (``support_ids``) with
autograd.
"""

from __future__ import annotations

import math

import pytest
import torch

import gbc_kernels as gbc
import gbc_reference as ref
from conftest import as64, leaves, make_batch, max_rel_err

ST = gbc.SamplerTruncation
SETTINGS = {
    "top_k20": ST(top_k=20),
    "top_k5-all": ST(top_k=5, ties="all"),
    "top_p0.8": ST(top_p=0.8),
    "top_p0.95-min_p": ST(top_p=0.95, min_p=0.02),
    "k10-p0.7-min_p": ST(top_k=10, top_p=0.7, min_p=0.05),
    "min_p": ST(min_p=0.1),
    "sglang-k8-p0.6": ST(top_k=8, top_p=0.6, rule="sglang"),
    "sglang-p0.6-min_p": ST(top_p=0.6, min_p=0.2, rule="sglang"),
}


def err(got, want) -> float:
    return float(((got.detach().double() - want.detach().double()).abs() / (1 + want.double().abs())).max())


def ref_ids(b, tr, temperature, softcap=None, logits_dtype=None):
    return ref.truncation_support_ids(
        b["hidden"], b["weight"], b["targets"].clamp(min=0), bias=b["bias"],
        temperature=temperature, logit_softcap=softcap, logits_dtype=logits_dtype,
        top_k=tr.top_k, top_p=tr.top_p, min_p=tr.min_p, ties=tr.ties, rule=tr.rule)


# -- the reference's rule against the samplers' own algorithms ---------------------------------

def vllm_pytorch_rule(l, k=None, p=1.0, min_p=0.0):
    """vLLM's ``apply_top_k_top_p_pytorch`` after its min-p processor, transcribed: ascending
    sort, ``keep z >= k-th largest``, remove where the ascending inclusive cumsum ``<= 1 - p``
    (the largest always kept)."""
    l = l.clone()
    if min_p > 0:
        probs = torch.softmax(l, -1)
        l = l.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    s, idx = l.sort(-1)
    if k is not None:
        s = s.masked_fill(s < s[:, -k:-k + 1 if k > 1 else None][:, :1], float("-inf"))
    if p < 1.0:
        ps = torch.softmax(s, -1)
        cut = ps.cumsum(-1) <= 1 - p
        cut[:, -1] = False
        s = s.masked_fill(cut, float("-inf"))
    return torch.zeros_like(l, dtype=torch.bool).scatter_(-1, idx, torch.isfinite(s))


def sglang_rule(l, k=None, p=1.0, min_p=0.0):
    """SGLang's ``top_k_top_p_min_p_sampling_from_probs_torch``, transcribed: probabilities
    sorted descending, zero past the k-th, where the exclusive cumsum exceeds ``p``, and below
    ``min_p`` times the largest."""
    probs = torch.softmax(l, -1)
    ps, idx = probs.sort(-1, descending=True)
    if k is not None:
        ps[:, k:] = 0.0
    ps[(ps.cumsum(-1) - ps) > p] = 0.0
    if min_p > 0:
        ps[ps < ps[:, :1] * min_p] = 0.0
    return torch.zeros_like(l, dtype=torch.bool).scatter_(-1, idx, ps > 0)


@pytest.mark.parametrize("k,p,min_p", [(20, 1.0, 0.0), (None, 0.8, 0.0), (None, 1.0, 0.1),
                                       (10, 0.7, 0.05), (50, 0.95, 0.01), (1, 0.5, 0.0)])
def test_reference_rule_is_the_samplers(k, p, min_p):
    """Distinct float64 logits (no ties): the reference's kept set equals vLLM's PyTorch
    sampler's (``ties="all"`` = its rule) and SGLang's joint filter's, row for row."""
    g = torch.Generator().manual_seed(3)
    l = torch.randn(64, 500, generator=g, dtype=torch.float64) * 2.5
    assert torch.equal(ref.kept_set(l, k, p, min_p, ties="all"), vllm_pytorch_rule(l, k, p, min_p))
    assert torch.equal(ref.kept_set(l, k, p, min_p, ties="first"),
                       vllm_pytorch_rule(l, k, p, min_p))
    assert torch.equal(ref.kept_set(l, k, p, min_p, rule="sglang"), sglang_rule(l, k, p, min_p))
    # the filters truncate: neither empty nor the whole row
    n = ref.kept_set(l, k, p, min_p).sum(-1)
    assert (n >= 1).all() and (n < 500).all()


def test_reference_ties():
    """Ties at the k-th value: ``first`` keeps exactly k, lowest ids first; ``all`` keeps every
    tied token. A top-p cut inside a tie keeps the lowest ids of it first."""
    l = torch.tensor([[0.0, 3.0, 1.0, 3.0, 1.0, 1.0, 2.0, 1.0]], dtype=torch.float64)
    first = ref.kept_set(l, top_k=4)
    assert first[0].nonzero().squeeze(1).tolist() == [1, 2, 3, 6]
    assert ref.kept_set(l, top_k=4, ties="all")[0].nonzero().squeeze(1).tolist() == \
        [1, 2, 3, 4, 5, 6, 7]
    flat = torch.zeros(1, 10, dtype=torch.float64)          # ten tokens at 0.1: p = 0.45
    assert ref.kept_set(flat, top_p=0.45)[0].nonzero().squeeze(1).tolist() == [0, 1, 2, 3, 4]


# -- the fast path against the reference -------------------------------------------------------

def _logprobs(lib, b, backend=None, temperature=0.7, **kw):
    x = leaves(b)
    extra = {} if backend is None else {"backend": backend}
    lp, ent, kept = lib.fused_linear_logprobs(
        x["hidden"], x["weight"], b["targets"].clamp(min=0), bias=x["bias"],
        temperature=temperature, return_entropy=True, return_log_kept_mass=True, **extra, **kw)
    g = torch.Generator().manual_seed(5)
    u1 = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    u2 = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    (lp.double() * u1 + ent.double() * u2).sum().backward()
    return lp, ent, kept, [x[k].grad for k in ("hidden", "weight", "bias")]


@pytest.mark.parametrize("name", list(SETTINGS))
def test_logprobs_over_the_recomputed_set_match_float64(backend, name, small_chunks):
    """Log-probs, entropy, log_kept_mass and gradients over the rebuilt set, several chunks,
    an odd vocabulary, temperature 0.7, against the float64 oracle over the reference's set."""
    tr = SETTINGS[name]
    b = make_batch(B=3, T=11, H=24, V=301, logit_scale=4.0)
    ids = ref_ids(as64(b), tr, 0.7)
    lp, ent, kept, grads = _logprobs(gbc, b, backend, sampler_truncation=tr)
    want = _logprobs(ref, as64(b), support_ids=ids)
    for got, exp in zip((lp, ent, kept), want[:3]):
        assert got.dtype == torch.float32 and err(got, exp) < 1e-5
    for got, exp in zip(grads, want[3]):
        assert max_rel_err(got, exp) < 5e-5
    size = (ids >= 0).sum(-1)
    assert (size < 301).all() and (size > 1).any()
    assert (kept <= 0).all() and (kept < -1e-3).any()


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcap"])
def test_per_token_temperature_and_softcap(softcap):
    """The set is built at each token's own temperature, after soft-capping."""
    b = make_batch(B=2, T=9, H=16, V=211, logit_scale=4.0)
    t = torch.rand(2, 9, generator=torch.Generator().manual_seed(1)) + 0.5
    tr = ST(top_k=12, top_p=0.9)
    ids = ref_ids(as64(b), tr, t.double(), softcap)
    lp, ent, kept, grads = _logprobs(gbc, b, "torch", temperature=t, sampler_truncation=tr,
                                     logit_softcap=softcap)
    want = _logprobs(ref, as64(b), temperature=t, support_ids=ids, logit_softcap=softcap)
    for got, exp in zip((lp, ent, kept), want[:3]):
        assert err(got, exp) < 1e-5
    for got, exp in zip(grads, want[3]):
        assert max_rel_err(got, exp) < 5e-5


def _tied_batch(V=40, H=8):
    """A head whose rows repeat (ties in every row's logits, in any dtype), targets spread."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(8, H, generator=g, dtype=torch.float64)
    w = base[torch.arange(V) % 8] * 1.5                  # ids j and j + 8 tie
    h = torch.randn(2, 6, H, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (2, 6), generator=g)
    return dict(hidden=h.float(), weight=w.float(), bias=None, targets=y)


@pytest.mark.parametrize("tr", [ST(top_k=7), ST(top_k=7, ties="all"), ST(top_p=0.5),
                                ST(top_k=9, top_p=0.4), ST(top_k=3, rule="sglang")],
                         ids=["k-first", "k-all", "p-in-tie", "k-p", "sglang"])
def test_ties_at_the_boundary(backend, tr):
    """Five copies of every logit: the k-th value is tied (``first``: exactly k, the lowest
    ids; ``all``: the whole tie), the top-p cut falls inside a tie."""
    b = _tied_batch()
    ids = ref.truncation_support_ids(b["hidden"].double(), b["weight"].double(), b["targets"],
                                     top_k=tr.top_k, top_p=tr.top_p, ties=tr.ties, rule=tr.rule)
    size = (ids >= 0).sum(-1)
    if tr.top_k is not None and tr.ties == "first" and tr.top_p == 1.0:
        assert (size == tr.top_k).all()
    if tr.ties == "all":
        assert (size == 10).all()                       # two whole groups of five
    if tr.top_p < 1.0:
        assert (size % 5 != 0).any()                    # a cut inside a tie
    x = leaves(b, bias=False)
    lp, _, kept = gbc.fused_linear_logprobs(x["hidden"], x["weight"], b["targets"],
                                         sampler_truncation=tr, return_log_kept_mass=True,
                                         backend=backend)
    w = ref.fused_linear_logprobs(b["hidden"].double(), b["weight"].double(), b["targets"],
                                  support_ids=ids, return_log_kept_mass=True)
    assert err(lp, w[0]) < 1e-5 and err(kept, w[2]) < 1e-5


def test_policy_loss_and_forced_targets(backend, small_chunks):
    """The fused loss over the rebuilt set: loss, gradients, metrics and token_out against the
    oracle; targets outside their set (drawn at random, most fall outside a top-5) are forced in
    and counted by ``support_forced_frac``."""
    b = make_batch(B=4, T=9, H=16, V=97, logit_scale=3.0)
    tr = ST(top_k=5, top_p=0.9)
    ids = ref_ids(as64(b), tr, 0.9)
    cfg = dict(kl_coef=0.05, entropy_coef=0.01, ar_alpha=0.3)
    out = {}
    for lib, batch in ((gbc, b), (ref, as64(b))):
        x, tok = leaves(batch), {}
        kw = (dict(backend=backend, sampler_truncation=tr) if lib is gbc
              else dict(support_ids=ids))
        L, m = lib.fused_linear_policy_loss(
            x["hidden"], x["weight"], batch["targets"], batch["mask"], batch["advantages"],
            batch["old_logp"], batch["ref_logp"], bias=x["bias"],
            config=lib.PolicyLossConfig(**cfg), temperature=0.9, token_out=tok, **kw)
        (L * 1.7).backward()
        out[lib] = L, m, tok, [x[k].grad for k in ("hidden", "weight", "bias")]
    (L, m, tok, grads), (L64, m64, tok64, grads64) = out[gbc], out[ref]
    assert abs(L.item() - L64.item()) < 1e-5 * max(1.0, abs(L64.item()))
    for got, exp in zip(grads, grads64):
        assert max_rel_err(got, exp) < 1e-4
    for k, v in m64.items():
        assert abs(float(m[k]) - float(v)) < 1e-4 * max(1.0, abs(float(v))), k
    y = b["targets"].clamp(min=0)
    forced = ~(ids == y.unsqueeze(-1)).any(-1) & b["mask"]
    assert float(m["support_forced_frac"]) == pytest.approx(
        forced.sum().item() / b["mask"].sum().item())
    assert 0 < float(m["support_forced_frac"]) < 1
    assert err(tok["logp"], tok64["logp"]) < 1e-5
    assert err(tok["log_kept_mass"], tok64["log_kept_mass"]) < 1e-5
    assert (tok["log_kept_mass"][~b["mask"]] == 0).all()


def test_token_stats_certainty_over_the_rebuilt_set(backend):
    """token_stats: logp, entropy and the certainty (normalised by log |S|) over the set built
    at ``temperature``; the certainty's own temperature scores that same set."""
    b = make_batch(B=2, T=8, H=16, V=131, logit_scale=3.0)
    tr = ST(top_k=6, min_p=0.05)
    ids = ref_ids(as64(b), tr, 0.8)
    y = b["targets"].clamp(min=0)
    for cert in ("entropy", "max_prob"):
        got = gbc.token_stats(b["hidden"], b["weight"], y, bias=b["bias"], temperature=0.8,
                              certainty=cert, certainty_temperature=1.3, backend=backend,
                              sampler_truncation=tr)
        want = ref.token_stats(b["hidden"].double(), b["weight"].double(), y,
                               bias=b["bias"].double(), temperature=0.8, certainty=cert,
                               certainty_temperature=1.3, support_ids=ids)
        for k in ("logp", "entropy", "certainty", "sum_p2"):
            assert err(getattr(got, k), getattr(want, k)) < 1e-5, (cert, k)


def test_bf16_inputs_float32_logits():
    """bf16 operands, ``logits_dtype=float32``: the set and the numbers of the float32 head."""
    b = make_batch(B=3, T=7, H=64, V=301, dtype=torch.bfloat16, logit_scale=4.0)
    tr = ST(top_k=20, top_p=0.95)
    ids = ref_ids(b, tr, 1.0, logits_dtype="float32")
    y = b["targets"].clamp(min=0)
    for be in ("torch", "cpu") if gbc.backends.cpu_available() else ("torch",):
        got = gbc.fused_linear_logprobs(b["hidden"], b["weight"], y, bias=b["bias"],
                                        return_entropy=True, return_log_kept_mass=True,
                                        logits_dtype="float32", backend=be,
                                        sampler_truncation=tr)
        want = ref.fused_linear_logprobs(b["hidden"], b["weight"], y, bias=b["bias"],
                                         return_entropy=True, return_log_kept_mass=True,
                                         logits_dtype="float32", support_ids=ids)
        for g_, w_ in zip(got, want):
            assert err(g_, w_) < 1e-5, be


def test_top_p_without_bound_large_flat_rows():
    """The histogram select on wide, nearly flat rows (the cut deep in the row, thousands of
    members) and on a peaked row whose cut falls in the first bin; p near 1 (the cut in the
    far tail)."""
    g = torch.Generator().manual_seed(11)
    V, H = 5003, 8
    h = torch.randn(1, 6, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.05            # nearly flat
    w[17] = h[0, 0] * 3.0                                 # row 0 peaked on id 17
    y = torch.randint(0, V, (1, 6), generator=g)
    for p in (0.3, 0.95, 0.99999):
        ids = ref.truncation_support_ids(h.double(), w.double(), y, top_p=p)
        lp, _, kept = gbc.fused_linear_logprobs(h, w, y, sampler_truncation=ST(top_p=p),
                                             return_log_kept_mass=True, backend="torch")
        want = ref.fused_linear_logprobs(h.double(), w.double(), y, support_ids=ids,
                                         return_log_kept_mass=True)
        assert err(lp, want[0]) < 1e-5 and err(kept, want[2]) < 1e-5, p
        size = (ids >= 0).sum(-1)
        assert size[0, 1:].min() > 1000 if p > 0.9 else True


def test_recomputed_set_equals_passing_its_ids(backend):
    """``sampler_truncation`` is ``support_ids`` of the same set (the members summed in
    another order: within float32 rounding)."""
    b = make_batch(B=2, T=7, H=16, V=89, logit_scale=3.0)
    tr = ST(top_k=9, top_p=0.85)
    ids = ref_ids(b, tr, 1.0)          # float32 logits, no ties: the same set
    y = b["targets"].clamp(min=0)
    a = gbc.fused_linear_logprobs(b["hidden"], b["weight"], y, bias=b["bias"],
                                  return_entropy=True, sampler_truncation=tr, backend=backend)
    c = gbc.fused_linear_logprobs(b["hidden"], b["weight"], y, bias=b["bias"],
                                  return_entropy=True, support_ids=ids, backend=backend)
    assert (a[0] - c[0]).abs().max() < 1e-6 and (a[1] - c[1]).abs().max() < 1e-6


@pytest.mark.parametrize("kw,match", [
    (dict(top_k=0), "top_k"), (dict(top_k=-1), "top_k"), (dict(top_k=2.0), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(min_p=1.0), "min_p"),
    (dict(min_p=-0.1), "min_p"), (dict(top_k=5, ties="some"), "ties"),
    (dict(top_k=5, rule="hf"), "rule"), (dict(), "sampler_truncation"),
])
def test_bad_settings_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        ST(**kw)


def test_bad_calls_refused_by_name():
    b = make_batch(B=2, T=4, H=8, V=23)
    y = b["targets"].clamp(min=0)
    with pytest.raises(ValueError, match="sampler_truncation.*support_ids|support_ids.*sampler"):
        gbc.fused_linear_logprobs(b["hidden"], b["weight"], y, sampler_truncation=ST(top_k=3),
                                  support_ids=y.unsqueeze(-1))
    with pytest.raises(TypeError, match="sampler_truncation"):
        gbc.token_stats(b["hidden"], b["weight"], y, sampler_truncation={"top_k": 3})
    with pytest.raises(ValueError, match="sampler_truncation.*support_ids|support_ids.*sampler"):
        gbc.fused_linear_policy_loss(b["hidden"], b["weight"], b["targets"], b["mask"],
                                     b["advantages"], sampler_truncation=ST(top_p=0.9),
                                     support_ids=y.unsqueeze(-1))


# -- vocab parallel -----------------------------------------------------------------------------

VP_SETTINGS = [ST(top_k=6), ST(top_k=6, ties="all"), ST(top_k=10, top_p=0.8, min_p=0.02),
               ST(min_p=0.1), ST(top_k=7, top_p=0.7, rule="sglang")]


def _vp_worker(rank, world, backend):
    V = 45
    cuts = [0, 17, V]
    lo, hi = cuts[rank], cuts[rank + 1]
    b = make_batch(B=3, T=7, H=16, V=V, logit_scale=4.0)
    b["weight"][30:35] = b["weight"][10:15]             # ties across the two shards
    vp = gbc.VocabParallel(None, lo, hi)
    res = []
    for tr in VP_SETTINGS:
        x = leaves(b)
        w = x["weight"].detach()[lo:hi].clone().requires_grad_(True)
        bb = x["bias"].detach()[lo:hi].clone().requires_grad_(True)
        tok = {}
        L, m = gbc.fused_linear_policy_loss(
            x["hidden"], w, b["targets"], b["mask"], b["advantages"], b["old_logp"],
            b["ref_logp"], bias=bb, config=gbc.PolicyLossConfig(kl_coef=0.05), temperature=0.9,
            sampler_truncation=tr, token_out=tok, vocab_parallel=vp, backend=backend)
        L.backward()
        st = gbc.token_stats(b["hidden"], b["weight"][lo:hi], b["targets"].clamp(min=0),
                             bias=b["bias"][lo:hi], temperature=0.9, certainty="entropy",
                             vocab_parallel=vp, backend=backend, sampler_truncation=tr)
        res.append(dict(L=L.detach(), m={k: float(v) for k, v in m.items()}, tok=tok,
                        gh=x["hidden"].grad, gw=w.grad, st=st))
    try:
        gbc.fused_linear_logprobs(b["hidden"], b["weight"][lo:hi], b["targets"].clamp(min=0),
                                  vocab_parallel=vp, sampler_truncation=ST(top_p=0.9))
        refused = None
    except ValueError as e:
        refused = str(e)
    return res, refused


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_vocab_parallel_recompute_matches_float64(backend):
    """Two uneven shards, ties across them: each shard's top candidates merged; min-p from the
    global max; the loss, gradients, metrics and log_kept_mass equal the one-device oracle's.
    Top-p without a top-k bound is refused naming ``top_p``."""
    from conftest import spawn_gloo

    if backend == "cpu" and not gbc.backends.cpu_available():
        pytest.skip("the C++ extension is not built")
    out = spawn_gloo(2, _vp_worker, backend)
    b = make_batch(B=3, T=7, H=16, V=45, logit_scale=4.0)
    b["weight"][30:35] = b["weight"][10:15]
    cuts = [0, 17, 45]
    for i, tr in enumerate(VP_SETTINGS):
        ids = ref_ids(b, tr, 0.9)
        x, tok = leaves(as64(b)), {}
        L64, m64 = ref.fused_linear_policy_loss(
            x["hidden"], x["weight"], b["targets"], b["mask"], b["advantages"], b["old_logp"],
            b["ref_logp"], bias=x["bias"], config=ref.PolicyLossConfig(kl_coef=0.05),
            temperature=0.9, support_ids=ids, token_out=tok)
        L64.backward()
        st64 = ref.token_stats(as64(b)["hidden"], as64(b)["weight"], b["targets"].clamp(min=0),
                               bias=as64(b)["bias"], temperature=0.9, certainty="entropy",
                               support_ids=ids)
        for r, (res, _) in enumerate(out):
            o = res[i]
            for k in ("logp", "entropy", "certainty"):      # |S| over every shard
                assert err(getattr(o["st"], k), getattr(st64, k)) < 1e-5, (tr, k)
            assert abs(o["L"].item() - L64.item()) < 1e-5 * max(1, abs(L64.item())), tr
            for k, v in m64.items():
                assert abs(o["m"][k] - float(v)) < 1e-4 * max(1.0, abs(float(v))), (tr, k)
            assert err(o["tok"]["log_kept_mass"], tok["log_kept_mass"]) < 1e-5, tr
            assert max_rel_err(o["gh"], x["hidden"].grad) < 1e-4, tr
            assert max_rel_err(o["gw"], x["weight"].grad[cuts[r]:cuts[r + 1]]) < 1e-4, tr
            y = b["targets"].clamp(min=0)
            forced = ~(ids == y.unsqueeze(-1)).any(-1) & b["mask"]
            assert o["m"]["support_forced_frac"] == pytest.approx(
                forced.sum().item() / b["mask"].sum().item()), tr
    for _, refused in out:
        assert refused is not None and "top_p" in refused and "vocab_parallel" in refused


def test_min_p_threshold_is_the_samplers():
    """Min-p keeps ``p >= min_p * p_max``: log-space ``l >= l_max + log(min_p)``."""
    l = torch.tensor([[0.0, math.log(0.25), math.log(0.2499), -5.0]], dtype=torch.float64)
    assert ref.kept_set(l, min_p=0.25)[0].tolist() == [True, True, False, False]


@pytest.mark.parametrize("vp", [False, True], ids=["one-device", "vocab-parallel"])
def test_over_support_false_is_the_full_vocabulary_bit_for_bit(backend, vp):
    """``over_support=False``: the whole vocabulary's log-probs, entropy and gradients exactly
    as the call without a support, ``log_kept_mass`` the set's (``support=kept_mass``'s one
    pass); token_stats alike."""
    if vp:
        from conftest import spawn_gloo
        if backend == "triton":
            pytest.skip("gloo workers run the CPU backends")
        for o in spawn_gloo(2, _full_worker, backend):
            assert o
        return
    for tr in (ST(top_k=9, top_p=0.9), ST(top_p=0.9, min_p=0.02), ST(min_p=0.05)):
        _full_one_device(backend, tr)


def _full_one_device(backend, tr):
    b = make_batch(B=3, T=7, H=16, V=97, logit_scale=3.0)
    y = b["targets"].clamp(min=0)
    outs = []
    for kw in ({}, dict(sampler_truncation=tr, over_support=False, return_log_kept_mass=True)):
        x = leaves(b)
        o = gbc.fused_linear_logprobs(x["hidden"], x["weight"], y, bias=x["bias"],
                                      temperature=0.8, return_entropy=True, backend=backend,
                                      **kw)
        (o[0].sum() + 0.3 * o[1].sum()).backward()
        outs.append((o, [x[k].grad for k in ("hidden", "weight", "bias")]))
    (a, ga), (c, gc) = outs
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
    assert all(torch.equal(u, v) for u, v in zip(ga, gc))
    want = ref.fused_linear_logprobs(b["hidden"].double(), b["weight"].double(), y,
                                     bias=b["bias"].double(), temperature=0.8,
                                     support_ids=ref_ids(as64(b), tr, 0.8),
                                     return_log_kept_mass=True)[2]
    assert err(c[2], want) < 1e-5 and (c[2] < -1e-3).any()
    s0 = gbc.token_stats(b["hidden"], b["weight"], y, bias=b["bias"], temperature=0.8,
                         backend=backend)
    s1 = gbc.token_stats(b["hidden"], b["weight"], y, bias=b["bias"], temperature=0.8,
                         backend=backend, sampler_truncation=tr, over_support=False,
                         return_log_kept_mass=True)
    assert torch.equal(s0.logp, s1.logp) and torch.equal(s0.entropy, s1.entropy)
    assert err(s1.log_kept_mass, want) < 1e-5


def _full_worker(rank, world, backend):
    V, cuts = 45, [0, 17, 45]
    lo, hi = cuts[rank], cuts[rank + 1]
    b = make_batch(B=3, T=7, H=16, V=V, logit_scale=4.0)
    y = b["targets"].clamp(min=0)
    vp = gbc.VocabParallel(None, lo, hi)
    return all(_full_vp(b, y, lo, hi, vp, backend, tr)
               for tr in (ST(top_k=6, top_p=0.8), ST(min_p=0.1)))


def _full_vp(b, y, lo, hi, vp, backend, tr):
    a = gbc.token_stats(b["hidden"], b["weight"][lo:hi], y, bias=b["bias"][lo:hi],
                        vocab_parallel=vp, backend=backend)
    c = gbc.token_stats(b["hidden"], b["weight"][lo:hi], y, bias=b["bias"][lo:hi],
                        vocab_parallel=vp, backend=backend, sampler_truncation=tr,
                        over_support=False, return_log_kept_mass=True)
    want = ref.fused_linear_logprobs(b["hidden"].double(), b["weight"].double(), y,
                                     bias=b["bias"].double(),
                                     support_ids=ref_ids(as64(b), tr, 1.0),
                                     return_log_kept_mass=True)[2]
    return bool(torch.equal(a.logp, c.logp) and err(c.log_kept_mass, want) < 1e-5)


def test_return_support_forced(backend):
    """``return_support_forced=True``: which targets fell outside their set (rebuilt or given),
    the tokens the loss's ``support_forced_frac`` counts; all False without a support."""
    b = make_batch(B=2, T=9, H=16, V=97, logit_scale=3.0)
    y = b["targets"].clamp(min=0)
    tr = ST(top_k=5, top_p=0.9)
    ids = ref_ids(b, tr, 1.0)
    want = ~(ids == y.unsqueeze(-1)).any(-1)
    assert want.any() and not want.all()
    for kw in (dict(sampler_truncation=tr), dict(support_ids=ids), {}):
        out = gbc.fused_linear_logprobs(b["hidden"], b["weight"], y, bias=b["bias"],
                                        backend=backend, return_support_forced=True, **kw)
        assert out[-1].dtype == torch.bool and out[-1].shape == y.shape
        assert torch.equal(out[-1], want if kw else torch.zeros_like(want))
