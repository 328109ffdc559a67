"""gbc_reference itself: gradcheck in float64 and hand-computed known values (the formulas of
docs/math.md §1-§3, and TRL's loss-type normalisations where they coincide)."""

from __future__ import annotations

import math

import pytest
import torch

import gbc_kernels as gbc
import gbc_reference as ref
from conftest import as64, make_batch


def test_gradcheck_fused_loss_reference():
    b = as64(make_batch(B=2, T=4, H=5, V=7, seed=1, old_spread=3.0))
    cfg = ref.PolicyLossConfig(kl_coef=0.1, entropy_coef=0.05, ar_alpha=0.3, lopti_eta=0.5,
                               loss_agg="grpo", temperature=0.8)
    h = b["hidden"].clone().requires_grad_(True)
    w = b["weight"].clone().requires_grad_(True)
    bias = b["bias"].clone().requires_grad_(True)

    def f(h, w, bias):
        return ref.fused_linear_policy_loss(h, w, b["targets"], b["mask"], b["advantages"],
                                            b["old_logp"], b["ref_logp"], bias, config=cfg,
                                            phase="low")[0]
    assert torch.autograd.gradcheck(f, (h, w, bias), eps=1e-6, atol=1e-6)


def test_gradcheck_logprobs_reference():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(9, 5, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 9, (6,), generator=g)
    f = lambda h, w: sum(ref.fused_linear_logprobs(h, w, y, temperature=0.7,
                                                   return_entropy=True))
    assert torch.autograd.gradcheck(f, (h, w), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("lib", [gbc, ref], ids=["gbc", "ref"])
def test_advantage_reweight_known_values(lib):
    adv = torch.tensor([2.0, -1.0])
    old = torch.log(torch.tensor([[1.0, 0.5], [0.1, 0.0]]))
    out = lib.advantage_reweight(adv, old, 0.3)
    # alpha * p + 1 - alpha
    expect = torch.tensor([[2.0 * 1.0, 2.0 * 0.85], [-1.0 * 0.73, -1.0 * 0.7]])
    assert torch.allclose(out, expect, atol=1e-6)


@pytest.mark.parametrize("lib", [gbc, ref], ids=["gbc", "ref"])
def test_lopti_split_is_strict(lib):
    p = torch.tensor([[0.49, 0.5, 0.51, 0.2]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    low, high = lib.lopti_split(p.log(), mask, 0.5)
    assert low.tolist() == [[True, False, False, False]]
    assert high.tolist() == [[False, True, True, False]]


def test_kl_estimators_known_values():
    logp = torch.tensor([-1.0, -2.0, -30.0])
    refl = torch.tensor([-1.5, -1.0, -1.0])   # delta = ref - logp = -0.5, 1.0, 29.0
    expect = {
        "k1": [0.5, -1.0, -29.0],
        "k2": [0.125, 0.5, 420.5],
        "k3": [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 2.0, math.exp(29.0) - 30.0],
        "low_var_kl": [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 2.0, 10.0],
    }
    for name, val in expect.items():
        got = ref.kl_estimate(logp.double(), refl.double(), name)
        assert torch.allclose(got, torch.tensor(val, dtype=torch.float64), rtol=1e-12), name


def _trl_style(per_token, mask, loss_type, max_len=None, num_items=None):
    """TRL's GRPOTrainer normalisations (formulas from its docs)."""
    m = mask.double()
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (per_token.size(0) * max_len)
    if loss_type == "dapo":
        return (per_token * m).sum() / num_items


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("lib", [gbc, ref], ids=["gbc", "ref"])
def test_aggregation_matches_trl_loss_types(lib, loss_type):
    """On-policy (ratio 1), no KL: per-token loss is -A, so the aggregate is TRL's."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    logp = torch.full((3, 4), -1.0, dtype=torch.float64)
    per_token = -adv.unsqueeze(-1).expand(3, 4)
    kw = dict(max_len=6) if loss_type == "dr_grpo" else {}
    n_items = 7 if loss_type == "dapo" else None
    cfg = lib.PolicyLossConfig(loss_agg=loss_type, **kw)
    loss, _ = lib.policy_loss(logp, mask, adv, config=cfg, num_items_in_batch=n_items)
    expect = _trl_style(per_token, mask, loss_type, 6, 7)
    assert abs(float(loss) - float(expect)) < 1e-12
    # and by hand: grpo = (1/3)(-1 + 2 + 0); bnpo = (-3 + 2)/4; dr_grpo = -1/18; dapo = -1/7
    by_hand = {"grpo": 1 / 3, "bnpo": -0.25, "dr_grpo": -1 / 18, "dapo": -1 / 7}[loss_type]
    assert abs(float(loss) - by_hand) < 1e-12


@pytest.mark.parametrize("lib", [gbc, ref], ids=["gbc", "ref"])
def test_clip_and_dual_clip_known_values(lib):
    """One token each: r = 1.5 and r = 0.5 with A = +-1, eps = 0.2, c = 3 / c = 1.2."""
    logp = torch.log(torch.tensor([[0.6, 0.2, 0.6, 0.6]], dtype=torch.float64))
    old = torch.log(torch.tensor([[0.4, 0.4, 0.4, 0.1]], dtype=torch.float64))
    adv = torch.tensor([[1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    cfg = lib.PolicyLossConfig(loss_agg="seq-mean-token-sum")
    loss, m = lib.policy_loss(logp, mask, adv, old, config=cfg)
    # r = 1.5, A=+1: max(-1.5, -1.2) = -1.2 ; r = 0.5, A=-1: max(0.5, 0.8) = 0.8
    # r = 1.5, A=-1: max(1.5, 1.2) = 1.5 ; r = 6, A=-1: max(6, 1.2) = 6
    assert abs(float(loss) - (-1.2 + 0.8 + 1.5 + 6.0)) < 1e-12
    cfg_c = lib.PolicyLossConfig(loss_agg="seq-mean-token-sum", clip_ratio_c=3.0)
    loss_c, _ = lib.policy_loss(logp, mask, adv, old, config=cfg_c)
    assert abs(float(loss_c) - (-1.2 + 0.8 + 1.5 + 3.0)) < 1e-12   # dual clip caps at c = 3
    # token 0: A > 0, r > 1.2 (high); token 1: A < 0, r < 0.8 (low)
    assert abs(float(m["clip_frac_low"]) - 0.25) < 1e-7
    assert abs(float(m["clip_frac_high"]) - 0.25) < 1e-7


@pytest.mark.parametrize("lib", [gbc, ref], ids=["gbc", "ref"])
def test_lopti_phases_partition_the_loss(lib):
    """Without KL/entropy/normaliser coupling the two phases sum to the full loss (the
    normaliser always uses the full mask)."""
    b = as64(make_batch(seed=3, old_spread=3.0))
    cfg = lib.PolicyLossConfig(lopti_eta=0.05, kl_coef=0.1, entropy_coef=0.0)
    args = (b["hidden"], b["weight"], b["targets"], b["mask"], b["advantages"], b["old_logp"],
            b["ref_logp"], b["bias"])
    # the full loss: Lopti off (with lopti_eta set, a call without a phase is refused)
    full, _ = lib.fused_linear_policy_loss(*args, config=lib.PolicyLossConfig(kl_coef=0.1,
                                                                              entropy_coef=0.0))
    with pytest.raises(ValueError, match="phase"):
        lib.fused_linear_policy_loss(*args, config=cfg)
    low, m = lib.fused_linear_policy_loss(*args, config=cfg, phase="low")
    high, _ = lib.fused_linear_policy_loss(*args, config=cfg, phase="high")
    assert 0.0 < float(m["low_frac"]) < 1.0
    assert abs(float(low + high) - float(full)) < 1e-10


def test_critical_kl_weight_known_values():
    j = torch.tensor([1.0, 0.99, 0.5, 0.0])
    for lib in (gbc, ref):
        w = lib.critical_kl_weight(j, exponent=150.0, intercept=0.1)
        expect = 0.9 * torch.tensor([1.0, 0.99 ** 150, 0.5 ** 150, 0.0]) + 0.1
        assert torch.allclose(w.float(), expect, rtol=1e-5)


def test_every_config_field_is_defined_here():
    """gbc_reference.PolicyLossConfig has every field of gbc_kernels.PolicyLossConfig, with the
    same default: the fast path's every option is held against the reference."""
    import dataclasses

    ours = {f.name: f.default for f in dataclasses.fields(gbc.PolicyLossConfig)}
    refs = {f.name: f.default for f in dataclasses.fields(ref.PolicyLossConfig)}
    assert ours == refs


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                 "seq-mean-token-sum-norm"])
def test_token_count_and_seq_count_are_the_normalisers(agg):
    """docs/math.md §1: ``token_count=c`` divides token-mean by ``c`` as
    ``num_items_in_batch=c`` does; ``seq_count="nonempty"`` counts the rows with a masked-in
    token, as ``num_seqs_in_batch`` set to that count does, and differs from ``"rows"`` when a
    row is empty. Policy term only (the call's normalisers act on it alone)."""
    b = as64(make_batch(seed=4, old_spread=3.0))
    m = b["mask"]
    nonempty = int(m.any(-1).sum())
    assert 0 < nonempty < m.shape[0]

    def loss(**kw):
        counts = {k: kw.pop(k) for k in ("token_count", "seq_count") if k in kw}
        cfg = ref.PolicyLossConfig(loss_agg=agg, max_len=11, **counts)
        return ref.fused_linear_policy_loss(b["hidden"], b["weight"], b["targets"], m,
                                            b["advantages"], b["old_logp"], b["ref_logp"],
                                            b["bias"], config=cfg, **kw)[0]

    if agg == "token-mean":
        assert torch.allclose(loss(token_count=6.5), loss(num_items_in_batch=6.5), rtol=1e-12)
        assert torch.allclose(loss(token_count=1.0),
                              loss() * m.sum(), rtol=1e-12)      # verl's token-sum: a sum
        assert torch.equal(loss(seq_count="nonempty"), loss())
    else:
        assert torch.allclose(loss(seq_count="nonempty"), loss(num_seqs_in_batch=nonempty),
                              rtol=1e-12)
        assert torch.allclose(loss(seq_count="nonempty") * nonempty,
                              loss(seq_count="rows") * m.shape[0], rtol=1e-12)
        assert torch.equal(loss(token_count=6.5), loss())
