"""The fused loss inside OpenRLHF 0.11.2's actor, on a tiny Qwen2 (CPU, seconds).

    python examples/openrlhf_loss.py

In an OpenRLHF run, ``gbc_kernels.integrations.openrlhf.enable`` is the one switch: give it to
every Ray worker (``runtime_env={"worker_process_setup_hook":
"gbc_kernels.integrations.openrlhf.enable"}`` in the launcher) and ``Actor.forward``'s
old-policy / reference passes and ``ActorPPOTrainer.training_step``'s loss run without logits.
Here one process plays both parts: the old-policy pass through the patched ``Actor``, then one
training loss with AR and a Lopti phase, beside OpenRLHF's own loss on the same batch.

OpenRLHF imports flash-attn at import time; on a machine without it (any CPU machine) this
example puts the repository's import-only stand-in (``tests/standins``) on the path.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if importlib.util.find_spec("flash_attn") is None:
    sys.path.insert(0, os.path.join(ROOT, "tests", "standins"))

from openrlhf.models import Actor, PolicyLoss  # noqa: E402
from openrlhf.models.loss import aggregate_loss  # noqa: E402
from openrlhf.models.utils import compute_approx_kl  # noqa: E402
from openrlhf.utils.loss_utils import get_loss_batch_info  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from gbc_kernels.integrations import openrlhf as gbc_openrlhf  # noqa: E402


def demo_args():
    """OpenRLHF's parsed arguments as its launcher builds them (the ones the loss reads): PPO
    clip 0.2/0.28, token-mean, a k3 KL loss (0.01), entropy 0.001."""
    ns = SimpleNamespace
    return ns(actor=ns(eps_clip_low_high=(0.2, 0.28), dual_clip=None, policy_loss_type="ppo",
                       loss_agg_mode="token-mean", entropy_coef=0.001, aux_loss_coef=0.0),
              algo=ns(kl=ns(use_loss=True, init_coef=0.01, estimator="k3",
                            unbiased_gradient=False),
                      advantage=ns(is_correction_level="off")),
              train=ns(dynamic_batch_enable=False))


def main(vocab=151, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=False)
    actor = Actor(Qwen2ForCausalLM(cfg), temperature=1.0)
    actor.packing_samples = False
    ns = SimpleNamespace
    args = demo_args()

    B, P, T = 4, 6, 8
    seq = torch.randint(1, vocab, (B, P + T))
    attn = torch.ones_like(seq)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 5:] = False                                   # a short response
    attn[1, P + 5:] = 0
    gbc_openrlhf.enable(actor_cls=Actor, trainer_cls=False)   # the log-prob passes, fused
    try:
        with torch.no_grad():
            old = actor(seq, mask, attn)                      # no [B, L, V] logits
    finally:
        gbc_openrlhf.disable()
    exp = ns(sequences=seq, attention_mask=attn, action_mask=mask, action_log_probs=old,
             base_action_log_probs=old, rollout_log_probs=None,
             advantages=torch.randn(B, 1).expand(B, T) * mask)
    lbi = get_loss_batch_info(None, mask)

    loss, metrics = gbc_openrlhf.fused_actor_loss(actor, exp, args, kl_ctl=0.01,
                                                  loss_batch_info=lbi)
    # OpenRLHF's own loss on the same batch (logits formed), for comparison
    logp, out = actor(seq, mask, attention_mask=attn, return_output=True, return_entropy=True)
    pl = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28)
    theirs = pl(logp, old, exp.advantages, action_mask=mask, **lbi)[0]
    kl = compute_approx_kl(logp, old, log_probs_old=old, kl_estimator="k3")
    theirs = (theirs + 0.01 * aggregate_loss(kl, mask, **lbi)
              - 0.001 * aggregate_loss(out.entropy[:, -T:], mask, **lbi))
    print(f"fused loss {loss.item():+.6f}   OpenRLHF's {theirs.item():+.6f}")
    ar_loss, ar_metrics = gbc_openrlhf.fused_actor_loss(actor, exp, args, 0.01, lbi,
                                                        ar_alpha=0.3, lopti_eta=0.5,
                                                        phase="low")
    print(f"with AR (alpha 0.3) and Lopti's low phase: {ar_loss.item():+.6f}")
    print({k: round(float(v), 5) for k, v in metrics.items() if not k.startswith("gbc/")})
    return loss.detach(), theirs.detach(), metrics


if __name__ == "__main__":
    main()
