"""The gbc policy loss in verl's registry, called the way verl's actor calls it.

    python examples/verl_loss.py

In a verl run, call ``register`` in a module the workers import and select the loss with
``actor_rollout_ref.actor.policy_loss.loss_mode=gbc``; around each of Lopti's two updates, set
the phase (``with opts.phase("low"): ...``). Here a random batch stands in for the actor's.
"""

from __future__ import annotations

import torch
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from gbc_kernels.integrations import verl as gbc_verl


def main():
    opts = gbc_verl.register("gbc", ar_alpha=0.3, lopti_eta=0.5)
    loss_fn = get_policy_loss_fn("gbc")

    torch.manual_seed(0)
    B, T = 4, 6
    old_log_prob = -torch.rand(B, T) * 2
    log_prob = (old_log_prob + 0.1 * torch.randn(B, T)).requires_grad_()
    advantages = torch.randn(B, 1).expand(B, T)
    response_mask = torch.ones(B, T, dtype=torch.bool)
    nthr_scale = torch.ones(B, T)          # gbc.nthr_scale(...).scale in a real step
    advantages = gbc_verl.scale_advantages(advantages, nthr_scale)
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                               "clip_ratio_c": 3.0, "global_batch_info": {}})

    for phase in ("low", "high"):          # Lopti: two updates, an optimizer step after each
        with opts.phase(phase):
            loss, metrics = loss_fn(old_log_prob=old_log_prob, log_prob=log_prob,
                                    advantages=advantages, response_mask=response_mask,
                                    loss_agg_mode="token-mean", config=config)
        loss.backward()
        print(phase, f"loss {loss.item():+.4f}",
              {k: round(v, 4) for k, v in metrics.items()})
    return loss.detach(), metrics


if __name__ == "__main__":
    main()
