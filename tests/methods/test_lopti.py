"""Lopti through every adapter against one reference (method_reference.rl_update): two SGD
steps per batch, low then high (or the order asked for), the split and ``old_logp`` taken from
the rollout policy once, before the first update (docs/math.md §3, §13)."""

from __future__ import annotations

import copy

import pytest
import torch

import gbc_kernels as gbc
from gbc_kernels import methods
from .method_reference import (completion_logp, max_rel_diff, rl_update, sequences, spy_losses,
                              trl_trainer)


def test_plain_api_refuses_a_phaseless_lopti_loss():
    h, w = torch.randn(2, 3, 8), torch.randn(11, 8)
    y, m, a = torch.randint(0, 11, (2, 3)), torch.ones(2, 3), torch.tensor([1.0, -1.0])
    with pytest.raises(ValueError, match="phase"):
        gbc.fused_linear_policy_loss(h, w, y, m, a, config=gbc.PolicyLossConfig(lopti_eta=0.5))
    with pytest.raises(ValueError, match="phase"):
        gbc.policy_loss(torch.randn(2, 3), m, a, config=gbc.PolicyLossConfig(lopti_eta=0.5))


@pytest.mark.parametrize("order", ["low-first", "high-first"])
def test_plain_api_run_lopti_equals_reference(order):
    """methods.run_lopti with the fused loss on an lm_head == the reference's two SGD steps."""
    torch.manual_seed(0)
    B, T, H, V = 4, 7, 16, 29
    head = torch.nn.Linear(H, V, bias=False).double()
    h = torch.randn(B, T, H, dtype=torch.float64)
    y = torch.randint(0, V, (B, T))
    mask = torch.rand(B, T) > 0.2
    mask[1] = False                                     # an empty response
    adv = torch.randn(B, dtype=torch.float64)
    with torch.no_grad():
        old = gbc.fused_linear_logprobs(h, head.weight, y)[0].double()
    eta = float(old[mask].exp().median())               # a mixed split
    cfg = gbc.PolicyLossConfig(lopti_eta=eta, ar_alpha=0.3, epsilon_low=0.05,
                               epsilon_high=0.05)
    start = copy.deepcopy(head)
    opt = torch.optim.SGD(head.parameters(), lr=2.0)
    methods.run_lopti(lambda phase: gbc.fused_linear_policy_loss(
        h, head.weight, y, mask, adv, old, config=cfg, phase=phase), opt, order=order)

    def reference(resplit):
        w = start.weight.detach().clone().requires_grad_(True)
        for phase in methods.LOPTI_ORDERS[order]:
            logp = torch.log_softmax(h @ w.T, -1).gather(-1, y[..., None])[..., 0]
            import gbc_reference as ref
            loss, _ = ref.policy_loss(logp, mask, adv, logp.detach() if resplit else old,
                                      config=ref.PolicyLossConfig(lopti_eta=eta, ar_alpha=0.3,
                                                                  epsilon_low=0.05,
                                                                  epsilon_high=0.05),
                                      phase=phase)
            g, = torch.autograd.grad(loss, w)
            w = (w - 2.0 * g).detach().requires_grad_(True)
        return w.detach()

    want, wrong = reference(False), reference(True)
    assert torch.allclose(head.weight, want, rtol=1e-10, atol=1e-12)
    assert float((want - wrong).abs().max()) > 1e-3 * float((want - start.weight.detach()).abs().max())


# ---------------------------------------------------------------------------------- TRL
@pytest.mark.parametrize("order", ["low-first", "high-first"])
def test_trl_on_policy_lopti_equals_reference(tiny, tmp_path, order):
    """TRL on-policy (no old_per_token_logps): both updates use the rollout's old log-probs;
    the result differs from re-splitting on the updated model (today's defect)."""
    from transformers import AutoModelForCausalLM

    eta = 1.0 / 40                        # ~1/V of the tiny model: a mixed split
    lr = 5.0
    trainer = trl_trainer(tiny, tmp_path, reward=lambda completions, **k: [
        float("knight" in c) + 0.1 * len(c) for c in completions], learning_rate=lr,
        gbc_lopti_eta=eta, gbc_lopti_order=order, gbc_ar_alpha=0.3)
    seen = spy_losses(trainer)
    trainer.train()
    assert len(seen) == 2 and seen[0][0].get("old_per_token_logps") is None
    x = seen[0][0]
    ids, attn, T, mask = sequences(x)
    start = AutoModelForCausalLM.from_pretrained(tiny)
    with torch.no_grad():
        p_old = completion_logp(start, ids, attn, T).exp()
    low = float((p_old < eta)[mask.bool()].float().mean())
    assert 0.1 < low < 0.9, low                          # both phases have tokens
    kw = dict(cfg_kw=dict(lopti_eta=eta, ar_alpha=0.3), lr=lr,
              phases=methods.LOPTI_ORDERS[order])
    want = rl_update(start, ids, attn, T, mask, x["advantages"], **kw)
    wrong = rl_update(start, ids, attn, T, mask, x["advantages"], resplit=True, **kw)
    got = trainer.model
    assert max_rel_diff(got, want, start) < 1e-4
    assert max_rel_diff(wrong, want, start) > 1e-2      # the test can tell the two apart


@pytest.mark.parametrize("order", ["low-first", "high-first"])
def test_verl_engine_logs_the_steps_grad_share_low(order):
    """verl's engines (``EngineMethods.train_batch``, FSDP and Megatron) log Lopti's
    ``grad_share_low`` with its one meaning: the low phase's summed logit-gradient norm over
    both phases' (each phase's own share is 1 or 0 by construction), from the micro-batches'
    ``grad_norm_sum``."""
    pytest.importorskip("verl")
    import functools

    from tensordict import TensorDict
    from verl.workers.utils.losses import ppo_loss

    from gbc_kernels.integrations.verl import engine as ve

    norms = {"low": [0.3, 0.5], "high": [1.1, 0.7]}

    class Engine(ve.EngineMethods):
        gbc_options = ve.EngineOptions(lopti_eta=0.5, lopti_order=order)

        def optimizer_zero_grad(self):
            pass

        def forward_backward_batch(self, data, loss_function, forward_only):
            phase = self._gbc_phase
            return {"metrics": {"actor/gbc_grad_norm_sum": list(norms[phase]),
                                "actor/gbc_grad_share_low": [float(phase == "low")] * 2}}

        def optimizer_step(self):
            return 1.0

        def is_mp_src_rank_with_outputs(self):
            return True

    out = Engine().train_batch(TensorDict({}, batch_size=[]),
                               functools.partial(ppo_loss, config=None))
    want = sum(norms["low"]) / (sum(norms["low"]) + sum(norms["high"]))
    assert out["metrics"]["actor/gbc_grad_share_low"] == pytest.approx(want)
    # a rank that does not report verl's outputs (another context- or tensor-parallel rank):
    # no gradient norms, the same step's grad_share_low
    Engine.is_mp_src_rank_with_outputs = lambda self: False
    out = Engine().train_batch(TensorDict({}, batch_size=[]),
                               functools.partial(ppo_loss, config=None))
    assert "grad_norm" not in out["metrics"]
    assert out["metrics"]["actor/gbc_grad_share_low"] == pytest.approx(want)
