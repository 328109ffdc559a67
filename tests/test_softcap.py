"""Final-logit soft-capping (Gemma-2/3: logits = c tanh(x / c)) inside the row passes of every
backend, against the reference and a float64 computation written here; logits large enough that
tanh saturates (|x| up to ~100 against c = 5)."""

from __future__ import annotations

import pytest
import torch

import gbc_kernels as gbc
import gbc_reference as ref
from conftest import as64, leaves, make_batch, max_rel_err
from test_policy_loss import check_against, check_bf16, run

CAP = 5.0

CASES = [
    pytest.param(dict(kl_coef=0.1, entropy_coef=0.02), None, id="ppo-kl-entropy"),
    pytest.param(dict(loss_agg="grpo", ar_alpha=0.3, lopti_eta=0.5, temperature=0.7), "low",
                 id="ar-lopti-temperature"),
    pytest.param(dict(importance_sampling_level="sequence", kl_coef=0.05), None, id="gspo"),
    pytest.param(dict(top_entropy_quantile=0.5, entropy_coef=0.02), None, id="quantile"),
]


def _batch(dtype=torch.float32, seed=0):
    """Saturating raw logits; old/ref log-probs near the capped policy's."""
    b = make_batch(B=4, T=9, H=16, V=41, dtype=dtype, seed=seed, logit_scale=30.0)
    b64 = as64(b)
    logp, _ = ref.fused_linear_logprobs(b64["hidden"], b64["weight"], b["targets"].clamp(min=0),
                                        b64["bias"], logit_softcap=CAP)
    g = torch.Generator().manual_seed(seed + 100)
    noise = (lambda: 0.3 * torch.randn(logp.shape, generator=g, dtype=logp.dtype))
    b["old_logp"] = (logp + noise()).clamp(max=0).float()
    b["ref_logp"] = (logp + noise()).clamp(max=0).float()
    return b


def test_reference_softcap_is_the_formula():
    b = as64(_batch())
    z = b["hidden"] @ b["weight"].T + b["bias"]
    assert z.abs().max() > 8 * CAP                  # tanh saturates on many logits
    capped = CAP * torch.tanh(z / CAP) / 0.8
    want = torch.log_softmax(capped, -1).gather(-1, b["targets"].clamp(min=0)[..., None])[..., 0]
    got, _ = ref.fused_linear_logprobs(b["hidden"], b["weight"], b["targets"].clamp(min=0),
                                       b["bias"], temperature=0.8, logit_softcap=CAP)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cfg,phase", CASES)
def test_loss_matches_float64_reference(backend, cfg, phase, small_chunks):
    cfg = dict(cfg, logit_softcap=CAP)
    batch = _batch(seed=len(str(cfg)))
    up = 0.6
    check_against(run(gbc, batch, cfg, phase, up, backend),
                  run(ref, as64(batch), cfg, phase, up), 1e-5, 1e-4)


def test_loss_bf16(backend):
    cfg = dict(kl_coef=0.1, entropy_coef=0.02, logit_softcap=CAP)
    batch = _batch(torch.bfloat16, seed=3)
    out = run(gbc, batch, cfg, None, 1.0, backend)
    truth = run(ref, as64(batch), cfg, None, 1.0)
    check_bf16(out, truth, 3e-2, 6e-2)


def test_softcap_changes_the_loss(backend):
    """Not a no-op: capped and uncapped losses differ on saturating logits."""
    batch = _batch(seed=5)
    a = run(gbc, batch, dict(logit_softcap=CAP), None, 1.0, backend)[0]
    b = run(gbc, batch, dict(), None, 1.0, backend)[0]
    assert abs(float(a) - float(b)) > 1e-3


def test_logprobs_and_entropy_gradients(backend, small_chunks):
    batch = _batch(seed=7)
    y = batch["targets"].clamp(min=0)
    g = torch.Generator().manual_seed(1)
    up_l, up_h = torch.randn(y.shape, generator=g), torch.randn(y.shape, generator=g)
    outs = []
    for lib, b, kw in ((gbc, batch, dict(backend=backend)), (ref, as64(batch), {})):
        x = leaves(b)
        lp, ent = lib.fused_linear_logprobs(x["hidden"], x["weight"], y, x["bias"],
                                            temperature=1.3, return_entropy=True,
                                            logit_softcap=CAP, **kw)
        ((lp * up_l.to(lp.dtype)).sum() + (ent * up_h.to(ent.dtype)).sum()).backward()
        outs.append((lp.detach(), ent.detach(), {k: v.grad for k, v in x.items()}))
    assert torch.allclose(outs[0][0].double(), outs[1][0], atol=2e-5)
    assert torch.allclose(outs[0][1].double(), outs[1][1], atol=2e-5)
    for k in outs[1][2]:
        assert max_rel_err(outs[0][2][k], outs[1][2][k]) <= 1e-4, k


def test_token_stats_certainty(backend):
    batch = _batch(seed=9)
    y = batch["targets"].clamp(min=0)
    for kind in ("entropy", "max_prob"):
        a = gbc.token_stats(batch["hidden"], batch["weight"], y, batch["bias"], temperature=0.9,
                            certainty=kind, certainty_temperature=1.7, backend=backend,
                            logit_softcap=CAP)
        b64 = as64(batch)
        t = ref.token_stats(b64["hidden"], b64["weight"], y, b64["bias"], temperature=0.9,
                            certainty=kind, certainty_temperature=1.7, logit_softcap=CAP)
        for f in ("logp", "entropy", "certainty"):
            assert torch.allclose(getattr(a, f).double(), getattr(t, f).double(), atol=2e-5), f


@pytest.mark.parametrize("with_logp", [False, True])
def test_nthr_with_softcap(backend, with_logp):
    batch = _batch(seed=11)
    group_ids = torch.tensor([0, 0, 1, 1])
    correct = torch.tensor([True, False, False, True])
    kw = {}
    if with_logp:
        kw["logp"] = gbc.token_stats(batch["hidden"], batch["weight"],
                                     batch["targets"].clamp(min=0), batch["bias"],
                                     logit_softcap=CAP).logp
    a = gbc.nthr_scale(batch["hidden"], batch["weight"], batch["targets"], batch["mask"],
                       group_ids, correct, batch["bias"], beta=0.0, backend=backend,
                       logit_softcap=CAP, **kw)
    b64 = as64(batch)
    t = ref.nthr_scale(b64["hidden"], b64["weight"], b64["targets"], b64["mask"], group_ids,
                       correct, b64["bias"], beta=0.0, logit_softcap=CAP)
    assert torch.allclose(a.scores.double(), t.scores.double(), rtol=1e-4, atol=1e-4)
    assert torch.equal(a.selected, t.selected)


def test_bad_softcap():
    batch = _batch()
    with pytest.raises(ValueError, match="logit_softcap"):
        gbc.PolicyLossConfig(logit_softcap=0.0)
    with pytest.raises(ValueError, match="logit_softcap"):
        gbc.fused_linear_logprobs(batch["hidden"], batch["weight"], batch["targets"].clamp(min=0),
                                  logit_softcap=-1.0)
