"""NTHR (docs/math.md §4): streaming implementation vs the full-logits reference and float64."""

from __future__ import annotations

import pytest
import torch

import gbc_kernels as gbc
import gbc_reference as ref


def make_groups(group_sizes, T=8, H=12, V=40, shared_vocab=10, seed=0, dtype=torch.float32,
                correct=None, shuffle=True, bias=True):
    """Groups whose responses share tokens (drawn from a small per-group sub-vocabulary, as real
    answers to one prompt do); optionally interleaved in the batch."""
    g = torch.Generator().manual_seed(seed)
    B = sum(group_sizes)
    gid = torch.cat([torch.full((n,), i) for i, n in enumerate(group_sizes)])
    targets = torch.empty(B, T, dtype=torch.long)
    for i in range(len(group_sizes)):
        sub = torch.randperm(V, generator=g)[:shared_vocab]
        rows = (gid == i).nonzero().flatten()
        targets[rows] = sub[torch.randint(0, shared_vocab, (len(rows), T), generator=g)]
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True
    if correct is None:
        correct = torch.rand(B, generator=g) < 0.5
    if shuffle:
        perm = torch.randperm(B, generator=g)
        gid, targets, mask, correct = gid[perm], targets[perm], mask[perm], correct[perm]
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.3 if bias else None
    return dict(hidden=hidden.to(dtype), weight=weight.to(dtype),
                bias=None if b is None else b.to(dtype), targets=targets, mask=mask,
                group_ids=gid, correct=correct)


def call(lib, d, **kw):
    return lib.nthr_scale(d["hidden"], d["weight"], d["targets"], d["mask"], d["group_ids"],
                          d["correct"], bias=d["bias"], **kw)


def _compare(ours, truth, mask, tol=1e-4):
    m = mask.bool()
    s_ref = truth.scores
    scale = s_ref.abs().max().clamp(min=1e-6)
    assert (ours.scores - s_ref).abs().max() <= tol * scale
    assert set(ours.thresholds) == set(truth.thresholds)
    for g, tau in truth.thresholds.items():
        assert abs(ours.thresholds[g] - tau) <= tol * float(scale)
    # selections agree wherever the score is not within rounding of the threshold
    clear = torch.ones_like(m)
    for g, tau in truth.thresholds.items():
        clear &= (s_ref - tau).abs() > 10 * tol * scale
    assert torch.equal(ours.selected & clear, truth.selected & clear)
    assert torch.allclose(ours.scale[clear], truth.scale[clear])


@pytest.mark.parametrize("sizes", [[4, 4, 4], [8], [3, 5, 2, 6], [2, 1, 3]])
@pytest.mark.parametrize("eta", ["auto", 0.25])
@pytest.mark.parametrize("beta", [1.0, 0.0])
def test_nthr_matches_float64_reference(backend, small_chunks, sizes, eta, beta):
    d = make_groups(sizes, seed=len(sizes) * 7 + int(beta))
    ours = call(gbc, d, beta=beta, eta=eta, backend=backend)
    d64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
           for k, v in d.items()}
    truth = call(ref, d64, beta=beta, eta=eta)
    _compare(ours, truth, d["mask"])
    assert ours.scale.dtype == torch.float32 and ours.selected.dtype == torch.bool
    # only incorrect responses are ever selected, and only masked tokens
    assert not (ours.selected & d["correct"].unsqueeze(-1)).any()
    assert not (ours.selected & ~d["mask"]).any()


def test_nthr_selects_something_and_eta_auto():
    d = make_groups([8, 8], seed=3, correct=torch.tensor([1, 0, 0, 0, 1, 1, 0, 0] * 2).bool(),
                    shuffle=False)
    res = gbc.nthr_scale(d["hidden"], d["weight"], d["targets"], d["mask"], d["group_ids"],
                         d["correct"], bias=d["bias"], beta=0.0)
    assert res.selected.any()
    # p = 3/8 -> eta = 2 |0.5 - 3/8| = 0.25
    assert torch.allclose(res.scale[res.selected], torch.full_like(res.scale[res.selected], 0.25))
    met = res.metrics(d["correct"], d["mask"])
    assert 0 < float(met["nthr_selected_frac"]) <= 1 and abs(float(met["nthr_eta_mean"]) - 0.25) < 1e-6


def test_nthr_uniform_groups_scale_one():
    for flag in (True, False):
        d = make_groups([4, 3], correct=torch.full((7,), flag), seed=1)
        res = gbc.nthr_scale(d["hidden"], d["weight"], d["targets"], d["mask"], d["group_ids"],
                             d["correct"], bias=d["bias"])
        assert torch.equal(res.scale, torch.ones_like(res.scale)) and not res.selected.any()
        assert res.thresholds == {}


def test_nthr_single_token_responses_and_bf16(backend):
    d = make_groups([4, 4], T=1, seed=5, dtype=torch.bfloat16,
                    correct=torch.tensor([1, 0, 1, 0, 0, 1, 1, 0]).bool())
    ours = call(gbc, d, beta=1.0, backend=backend)
    d64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
           for k, v in d.items()}
    truth = call(ref, d64, beta=1.0)
    _compare(ours, truth, d["mask"], tol=2e-2)


def test_nthr_with_old_logp_shortcut_matches(backend):
    """Passing the old-policy pass's logp (LSE = z[y] - logp) gives the same result."""
    d = make_groups([4, 4, 4], seed=8)
    st = gbc.token_stats(d["hidden"], d["weight"], d["targets"], d["bias"])
    a = call(gbc, d, backend=backend)
    b = call(gbc, d, backend=backend, logp=st.logp)
    assert torch.allclose(a.scores, b.scores, atol=1e-4 * float(a.scores.abs().max()))
    assert a.thresholds.keys() == b.thresholds.keys()


def test_selected_tokens_most_lower_the_correct_likelihood():
    """The paper's claim on a tiny model (lm_head trained, hidden states fixed), float64: one SGD
    step penalising a negative token t (loss = +logp_t) changes the correct responses' total
    log-likelihood by about -lr * s_t, so the tokens NTHR selects (s > tau) are those whose
    penalty lowers it most."""
    d = make_groups([8], T=6, H=10, V=30, shared_vocab=8, seed=12, dtype=torch.float64,
                    correct=torch.tensor([1, 1, 1, 0, 0, 0, 0, 0]).bool(), shuffle=False)
    h, w0, b, y, m, cor = (d[k] for k in ("hidden", "weight", "bias", "targets", "mask",
                                          "correct"))
    # beta = 0 (the paper's other setting): selected <=> s > 0, i.e. penalising the token is
    # predicted to lower the correct responses' likelihood
    res = ref.nthr_scale(h, w0, y, m, d["group_ids"], cor, bias=b, beta=0.0)

    def pos_loglik(w):
        lp = torch.log_softmax(h @ w.T + b, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        return lp[cor][m[cor]].sum()

    lr, drops, scores, sel = 1e-4, [], [], []
    base = pos_loglik(w0)
    for bi in (~cor).nonzero().flatten().tolist():
        for t in m[bi].nonzero().flatten().tolist():
            w = w0.clone().requires_grad_(True)
            lp_t = torch.log_softmax(h[bi, t] @ w.T + b, -1)[y[bi, t]]
            g, = torch.autograd.grad(lp_t, w)          # gradient of the penalty +logp_t
            with torch.no_grad():
                drops.append(float(base - pos_loglik(w0 - lr * g)))
            scores.append(float(res.scores[bi, t]))
            sel.append(bool(res.selected[bi, t]))
    drops, scores, sel = torch.tensor(drops), torch.tensor(scores), torch.tensor(sel)
    assert sel.any() and (~sel).any()
    # drop ~ lr * s (restricted to V*, the first-order effect): strongly correlated
    corr = torch.corrcoef(torch.stack([drops, scores]))[0, 1]
    assert corr > 0.95, corr
    # selected tokens' penalties lower the correct likelihood, the others' do not (beyond the
    # second-order and out-of-V* terms), and on average far more
    assert (drops[sel] > 0).float().mean() > 0.9
    assert drops[sel].mean() > drops[~sel].mean() + 0.5 * drops.abs().mean()
