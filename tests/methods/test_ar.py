"""AR through every adapter against one reference: the loss with ``ar_alpha`` equals the plain
loss on advantages ``A (alpha p_old + 1 - alpha)`` (docs/math.md §2). verl and OpenRLHF:
tests/test_verl.py, tests/test_verl_engine.py, tests/test_openrlhf.py."""

from __future__ import annotations

import torch

import gbc_kernels as gbc
import gbc_reference as ref
from conftest import as64, make_batch
from .method_reference import completion_logp, sequences, spy_losses, trl_trainer


def test_plain_api_equals_reweighted_advantages():
    b = as64(make_batch(seed=9))                       # an empty row, both advantage signs
    h, w, y, m, adv, old = (b[k] for k in ("hidden", "weight", "targets", "mask", "advantages",
                                           "old_logp"))
    got, metrics = gbc.fused_linear_policy_loss(h, w, y, m, adv, old,
                                                config=gbc.PolicyLossConfig(ar_alpha=0.4))
    a = ref.advantage_reweight(adv, old, 0.4)
    want, _ = ref.fused_linear_policy_loss(h, w, y, m, a, old, config=ref.PolicyLossConfig())
    assert abs(float(got) - float(want)) < 1e-12
    wmean = (0.4 * old.exp() + 0.6)[m].mean()
    assert abs(float(metrics["ar_weight_mean"]) - float(wmean)) < 1e-6


def test_trl_loss_equals_reference(tiny, tmp_path):
    """TRL on-policy: the step's loss with gbc_ar_alpha is the reference's on the rollout
    batch, p_old the rollout policy's (the detached current policy, TRL's on-policy rule)."""
    from transformers import AutoModelForCausalLM

    trainer = trl_trainer(tiny, tmp_path, gbc_ar_alpha=0.5)
    seen = spy_losses(trainer)
    trainer.train()
    x, loss = seen[0]
    ids, attn, T, mask = sequences(x)
    logp = completion_logp(AutoModelForCausalLM.from_pretrained(tiny), ids, attn, T).double()
    want, _ = ref.policy_loss(logp, mask, x["advantages"].double(), None,
                              config=ref.PolicyLossConfig(ar_alpha=0.5))
    plain, _ = ref.policy_loss(logp, mask, x["advantages"].double(), None,
                               config=ref.PolicyLossConfig())
    err = abs(loss - float(want))
    assert err < 1e-7 + 1e-5 * abs(float(want))
    assert abs(float(want) - float(plain)) > max(100 * err, 1e-6)   # AR moved it, measurably
