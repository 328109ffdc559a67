"""group_advantages and the Lopti two-phase helper."""

from __future__ import annotations

import torch

import gbc_kernels as gbc
import gbc_reference as ref


def test_group_advantages_vs_reference_noncontiguous_groups():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(11, generator=g)
    gid = torch.tensor([3, 1, 3, 1, 7, 3, 1, 7, 3, 9, 1])       # group 9 has one response
    for scale in ("std", None):
        a = gbc.group_advantages(rewards, gid, scale=scale)
        b = ref.group_advantages(rewards, gid, scale=scale)
        assert torch.allclose(a, b, atol=1e-6)
    # by hand for group 7: rewards r4, r7 -> (r - mean) / (std_unbiased + 1e-6)
    r = rewards[[4, 7]].double()
    expect = (r - r.mean()) / (r.std() + 1e-6)
    assert torch.allclose(gbc.group_advantages(rewards, gid)[[4, 7]].double(), expect, atol=1e-6)
    assert float(gbc.group_advantages(rewards, gid)[9]) == 0.0


def test_lopti_phases_runs_low_then_high_with_a_step_after_each():
    torch.manual_seed(0)
    H, V, B, T = 8, 13, 4, 6
    lin = torch.nn.Linear(H, V, bias=False)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    h = torch.randn(B, T, H)
    y = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad():
        old = gbc.fused_linear_logprobs(h, lin.weight, y)[0]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    cfg = gbc.PolicyLossConfig(lopti_eta=0.08)
    seen = []

    def compute(phase):
        seen.append((phase, lin.weight.detach().clone()))
        return gbc.fused_linear_policy_loss(h, lin.weight, y, mask, adv, old, config=cfg,
                                            phase=phase)

    out = gbc.lopti_phases(compute, opt)
    assert [p for p, _ in seen] == ["low", "high"]
    assert not torch.equal(seen[0][1], seen[1][1])          # a step happened in between
    assert 0.0 < float(out[0][1]["low_frac"]) < 1.0
    # in phase 2 the ratio carries phase 1's drift
    assert abs(float(out[1][1]["ratio_mean"]) - 1.0) > 1e-6
    seen.clear()
    gbc.lopti_phases(compute, opt, order="high-first")
    assert [p for p, _ in seen] == ["high", "low"]


def test_lopti_grad_share_low_over_both_updates():
    """The step's share is the low phase's summed norm over both phases' (either order); the
    loss given per-token log-probs has no norms: None."""
    t = torch.tensor
    low, high = (t(1.0), {"grad_norm_sum": t(3.0)}), (t(2.0), {"grad_norm_sum": t(1.0)})
    assert gbc.lopti_grad_share_low([low, high]) == 0.75
    assert gbc.lopti_grad_share_low([high, low], order="high-first") == 0.75
    zero = (t(0.0), {"grad_norm_sum": t(0.0)})
    assert gbc.lopti_grad_share_low([zero, zero]) == 0.0
    assert gbc.lopti_grad_share_low([(t(1.0), {}), high]) is None
