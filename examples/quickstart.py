"""Quick start: a few GRPO steps on a tiny Qwen2 built from a config, with the fused loss.

Toy task (no data, no download): the reward of a completion is the share of its tokens equal to
one chosen id (7). The fused loss trains the policy from its last hidden states and the lm_head
weight, never computing [tokens x vocab] logits; a KL penalty ties it to the initial model. Runs
on a CPU in a few seconds:

    python examples/quickstart.py --steps 40

What moves: the reward (0 -> near 1 as the policy learns to say 7), the KL from the initial
model, and, as token 7 becomes likely, the share of tokens with p_old >= eta (1 - low_frac) and
the share of the policy-gradient norm they carry (1 - grad_share_low): the imbalance AR and
Lopti address. The printed loss is near 0 on the first update of fresh samples whatever is
learned (the ratio is 1 and group advantages have mean 0); its gradient is not.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import gbc_kernels as gbc


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--ar-alpha", type=float, default=0.3)
    ap.add_argument("--lopti-eta", type=float, default=0.5)
    ap.add_argument("--kl-coef", type=float, default=0.02)
    ap.add_argument("--token", type=int, default=7, help="the rewarded token id")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    V = 512
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=128,
                                         tie_word_embeddings=False))
    ref_model = copy.deepcopy(model).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = gbc.PolicyLossConfig(loss_agg="token-mean", ar_alpha=args.ar_alpha,
                               lopti_eta=args.lopti_eta, kl_coef=args.kl_coef)
    G, P, L = args.group, args.prompts, args.new_tokens
    t0 = time.time()
    for step in range(args.steps):
        prompts = torch.randint(0, V, (P, 4)).repeat_interleave(G, 0)
        group_ids = torch.arange(P).repeat_interleave(G)
        model.eval()
        with torch.no_grad():
            seq = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                                 max_new_tokens=L, min_new_tokens=L, do_sample=True, top_k=0,
                                 pad_token_id=0)
        completion = seq[:, prompts.shape[1]:]
        rewards = (completion == args.token).float().mean(-1)
        adv = gbc.group_advantages(rewards, group_ids)
        targets = seq[:, 1:]
        mask = torch.zeros_like(targets, dtype=torch.bool)
        mask[:, prompts.shape[1] - 1:] = True
        model.train()

        def hidden_states():
            # hidden state at position t predicts token t + 1: drop the last one
            return model.model(input_ids=seq).last_hidden_state[:, :-1]

        with torch.no_grad():
            old_logp, _ = gbc.fused_linear_logprobs(hidden_states(), model.lm_head.weight,
                                                    targets)
            ref_logp, _ = gbc.fused_linear_logprobs(
                ref_model.model(input_ids=seq).last_hidden_state[:, :-1],
                ref_model.lm_head.weight, targets)

        def compute_loss(phase):
            return gbc.fused_linear_policy_loss(hidden_states(), model.lm_head.weight, targets,
                                                mask, adv, old_logp, ref_logp, config=cfg,
                                                phase=phase)

        results = gbc.lopti_phases(compute_loss, opt)
        (loss_low, m_low), (loss_high, _) = results
        # each phase's loss covers its own tokens: the step's share of the policy-gradient norm
        # on low-probability tokens is taken over both updates
        share = gbc.lopti_grad_share_low(results)
        print(f"step {step:2d}  reward {float(rewards.mean()):.3f}  "
              f"loss {float(loss_low.detach() + loss_high.detach()):+.4f}  "
              f"kl {float(m_low['kl']):.4f}  low_frac {float(m_low['low_frac']):.2f}  "
              f"grad_share_low {share:.2f}  "
              f"({time.time() - t0:.1f}s)")


if __name__ == "__main__":
    main()
