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

import argparse
import importlib.util
import json
import os
import resource
import statistics
import sys
import time
from types import SimpleNamespace

from _common import rss_mb, run_child  # noqa: E402

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
    _step(a.provider, actor, exp, args)          # warm-up (compilation, allocator pools)
    base = rss_mb()
    # ru_maxrss is the process's peak so far: take the step's peak beyond the warm-up's
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    _step(a.provider, actor, exp, args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_mb": max(peak, before) - base, "step_peak_mb": peak - base}))


def child_time(a):
    actor, exp, args = _setup(a)
    provs = ["openrlhf", "gbc"]
    for p in provs:
        _step(p, actor, exp, args)
        print(f"  warm-up {p} done", file=sys.stderr, flush=True)
    times = {p: [] for p in provs}
    for r in range(a.reps):
        for p in provs:
            t0 = time.perf_counter()
            _step(p, actor, exp, args)
            times[p].append(time.perf_counter() - t0)
        print(f"  round {r + 1}/{a.reps}: " + ", ".join(f"{p} {times[p][-1]:.3f} s"
                                                       for p in provs), file=sys.stderr,
              flush=True)
    print(json.dumps({p: statistics.median(v) for p, v in times.items()}))


def _child(mode, a, extra=()):
    cmd = [sys.executable, __file__, f"--child-{mode}", "--B", str(a.B), "--P", str(a.P),
           "--T", str(a.T), "--H", str(a.H), "--V", str(a.V), "--threads", str(a.threads),
           "--reps", str(a.reps), *extra]
    return run_child(cmd, a.threads)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child-time", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-memory", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--provider", default="gbc")
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--P", type=int, default=64)
    ap.add_argument("--T", type=int, default=192)
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    if a.child_time:
        return child_time(a)
    if a.child_memory:
        return child_memory(a)
    N = a.B * (a.P + a.T)
    print(f"one actor update: B={a.B}, prompt {a.P} + response {a.T} ({N} tokens), H={a.H}, "
          f"V={a.V}, fp32, {a.threads} threads", flush=True)
    times = _child("time", a)
    mem = {p: _child("memory", a, ["--provider", p]) for p in ("openrlhf", "gbc")}
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
