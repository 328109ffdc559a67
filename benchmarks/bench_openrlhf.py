"""One OpenRLHF actor update with a real vocabulary: OpenRLHF 0.11.2's own path (fp32 logits,
``compute_entropy``, ``log_probs_from_logits``, ``PolicyLoss``, its KL and entropy terms) against
``gbc_kernels.integrations.openrlhf.fused_actor_loss`` (the same loss through the lm_head, no
logits). CPU, a tiny Qwen2 with Qwen2.5's vocabulary (V = 151936) and a small hidden size, so
the head dominates as it does at scale.

    python benchmarks/bench_openrlhf.py            # B=4, prompt 64 + response 192, H=64

Time: both providers in one process, forward + backward, repetitions interleaved (median).
Memory: each provider in a fresh process, peak RSS during one step beyond the RSS before it
(model, optimizer-free, inputs built). Prints a markdown table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from types import SimpleNamespace

from _common import interleaved_medians, step_child, step_parser, step_peak_mb  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup(a):
    if importlib.util.find_spec("flash_attn") is None:       # OpenRLHF's import-time need
        sys.path.insert(0, os.path.join(ROOT, "tests", "standins"))
    import torch
    from openrlhf.models import Actor
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=a.V, hidden_size=a.H, intermediate_size=2 * a.H,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=False)
    actor = Actor(Qwen2ForCausalLM(cfg).float(), temperature=1.0)
    actor.packing_samples = False
    B, P, T = a.B, a.P, a.T
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(1, a.V, (B, P + T), generator=g)
    attn = torch.ones_like(seq)
    mask = torch.ones(B, T, dtype=torch.bool)
    old = -torch.rand(B, T, generator=g) * 3
    ns = SimpleNamespace
    exp = ns(sequences=seq, attention_mask=attn, action_mask=mask, action_log_probs=old,
             base_action_log_probs=old - 0.1, rollout_log_probs=None,
             advantages=torch.randn(B, 1, generator=g).expand(B, T).contiguous())
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from openrlhf_loss import demo_args        # the example's arguments: the same loss

    return actor, exp, demo_args()


def _step(provider, actor, exp, args):
    from openrlhf.models import PolicyLoss
    from openrlhf.models.loss import aggregate_loss
    from openrlhf.models.utils import compute_approx_kl
    from openrlhf.utils.loss_utils import get_loss_batch_info

    from gbc_kernels.integrations import openrlhf as gorl

    lbi = get_loss_batch_info(None, exp.action_mask)
    T = exp.action_mask.shape[1]
    if provider == "gbc":
        loss, _ = gorl.fused_actor_loss(actor, exp, args, 0.01, lbi)
    else:
        logp, out = actor(exp.sequences, exp.action_mask, attention_mask=exp.attention_mask,
                          return_output=True, return_entropy=True)
        loss = PolicyLoss(0.2, 0.28)(logp, exp.action_log_probs, exp.advantages,
                                     action_mask=exp.action_mask, **lbi)[0]
        kl = compute_approx_kl(logp, exp.base_action_log_probs,
                               log_probs_old=exp.action_log_probs, kl_estimator="k3")
        loss = (loss + 0.01 * aggregate_loss(kl, exp.action_mask, **lbi)
                - 0.001 * aggregate_loss(out.entropy[:, -T:], exp.action_mask, **lbi))
        del out
    loss.backward()
    actor.zero_grad(set_to_none=True)


def child_memory(a):
    actor, exp, args = _setup(a)
    print(json.dumps(step_peak_mb(lambda: _step(a.provider, actor, exp, args))))


def child_time(a):
    actor, exp, args = _setup(a)
    steps = {p: (lambda p=p: _step(p, actor, exp, args)) for p in ("openrlhf", "gbc")}
    print(json.dumps(interleaved_medians(steps, a.reps)))


def main():
    ap = step_parser(__doc__)
    a = ap.parse_args()
    if a.child_time:
        return child_time(a)
    if a.child_memory:
        return child_memory(a)
    N = a.B * (a.P + a.T)
    print(f"one actor update: B={a.B}, prompt {a.P} + response {a.T} ({N} tokens), H={a.H}, "
          f"V={a.V}, fp32, {a.threads} threads", flush=True)
    times = step_child(__file__, "time", a, ap.case_names)
    mem = {p: step_child(__file__, "memory", a, ap.case_names, ["--provider", p])
           for p in ("openrlhf", "gbc")}
    logits_mb = N * a.V * 4 / 2 ** 20
    print(f"| path | time (s), median of {a.reps} | × OpenRLHF | peak memory beyond the "
          f"inputs (MiB) | × OpenRLHF | × one fp32 [N, V] ({logits_mb:.0f} MiB) |")
    print("|---|---|---|---|---|---|")
    for p, name in (("openrlhf", "OpenRLHF 0.11.2 (logits)"), ("gbc", "gbc fused")):
        print(f"| {name} | {times[p]:.3f} | {times[p] / times['openrlhf']:.2f} | "
              f"{mem[p]['step_peak_mb']:.0f} | "
              f"{mem[p]['step_peak_mb'] / mem['openrlhf']['step_peak_mb']:.2f} | "
              f"{mem[p]['step_peak_mb'] / logits_mb:.2f} |")


if __name__ == "__main__":
    main()
