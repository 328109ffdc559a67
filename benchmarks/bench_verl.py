"""One actor update in verl 0.9.1's own FSDP2 engine with a real vocabulary: verl's stock step
(full logits), verl's own fused kernel (``use_fused_kernels`` with its torch backend) and gbc's
engine (integrations/verl/engine.py). CPU, one gloo rank, a tiny Qwen2 with Qwen2.5's
vocabulary (V = 151936) and a small hidden size, so the head dominates as it does at scale.

    python benchmarks/bench_verl.py         # B=4, prompt 64 + response 192, H=64, 2 micro-batches

The update is verl's ``train_batch``: its micro-batches (forward, ``ppo_loss`` with a
low_var_kl term and an entropy term, backward), then its optimizer step (AdamW).
Time: the three engines in one process, repetitions interleaved (median).
Memory: each engine in a fresh process, peak RSS during one update beyond the RSS before it
(engine built, one warm-up update done, so the optimizer state exists already).
Prints a markdown table. verl registers its engines for cuda/npu only: on CPU the engines are
built directly, with the CPU platform of tests/standins/verl_cpu_platform.py (see
tests/test_verl_engine.py for what is bypassed).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import sys
import tempfile
import time

from _common import rss_mb, run_child  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROVIDERS = {"verl": "verl 0.9.1 stock (logits)",
             "verl_fused": "verl 0.9.1 use_fused_kernels (torch backend)",
             "gbc": "gbc engine"}


def _setup(a):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(a.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_verl_engine as tve
    tve.verl_on_cpu()
    return tve


def _engine(tve, provider, model_dir):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    if provider == "gbc":
        return tve.build_engine(model_dir, gbc=True, lr=1e-6)
    fused = provider == "verl_fused"
    mc = HFModelConfig(path=model_dir, use_remove_padding=True, use_fused_kernels=fused,
                       fused_kernel_options={"impl_backend": "torch"} if fused else {},
                       override_config={"attn_implementation": "sdpa"})
    ec = FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, model_dtype="fp32",
                          mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                           "buffer_dtype": "fp32"})
    engine = FSDPEngineWithLMHead(mc, ec, FSDPOptimizerConfig(lr=1e-6), CheckpointConfig())
    engine.initialize()
    return engine


def _update(tve, provider, engine, a):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    from test_other_trainers import verl_actor_config

    cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl", entropy_coeff=0.001)
    data = tve.make_batch(0, a.B, micro=a.B // a.micro, vocab=a.V, with_is=False,
                          lengths=(a.P, a.T), full=True)
    tu.assign_non_tensor(data, use_fused_kernels=provider == "verl_fused",
                         temperature=1.0)
    with engine.train_mode():
        engine.train_batch(data, functools.partial(ppo_loss, config=cfg))


def child_memory(a):
    tve = _setup(a)
    engine = _engine(tve, a.provider, a.model_dir)
    _update(tve, a.provider, engine, a)          # warm-up: optimizer state, allocator pools
    base = rss_mb()
    _update(tve, a.provider, engine, a)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_mb": peak - base}))


def child_time(a):
    from transformers import Qwen2ForCausalLM

    tve = _setup(a)
    # verl's use_fused_kernels patches the model *class*'s forward: each engine runs with the
    # forward it was built with
    forwards, engines = {}, {}
    for p in PROVIDERS:
        plain = Qwen2ForCausalLM.forward
        engines[p] = _engine(tve, p, a.model_dir)
        forwards[p], Qwen2ForCausalLM.forward = Qwen2ForCausalLM.forward, plain

    def run(p):
        Qwen2ForCausalLM.forward = forwards[p]
        _update(tve, p, engines[p], a)

    for p in engines:
        run(p)
        print(f"  warm-up {p} done", file=sys.stderr, flush=True)
    times = {p: [] for p in engines}
    for r in range(a.reps):
        for p in engines:
            t0 = time.perf_counter()
            run(p)
            times[p].append(time.perf_counter() - t0)
        print(f"  round {r + 1}/{a.reps}: " + ", ".join(f"{p} {times[p][-1]:.3f} s"
                                                       for p in engines), file=sys.stderr,
              flush=True)
    print(json.dumps({p: statistics.median(v) for p, v in times.items()}))


def _child(mode, a, port, extra=()):
    cmd = [sys.executable, __file__, f"--child-{mode}", "--B", str(a.B), "--P", str(a.P),
           "--T", str(a.T), "--H", str(a.H), "--V", str(a.V), "--threads", str(a.threads),
           "--reps", str(a.reps), "--micro", str(a.micro), "--model-dir", a.model_dir,
           "--port", str(port), *extra]
    return run_child(cmd, a.threads)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child-time", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-memory", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--provider", default="gbc", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29533, help=argparse.SUPPRESS)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--P", type=int, default=64)
    ap.add_argument("--T", type=int, default=192)
    ap.add_argument("--H", type=int, default=64)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per update")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    if a.child_time:
        return child_time(a)
    if a.child_memory:
        return child_memory(a)
    with tempfile.TemporaryDirectory() as d:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import test_verl_engine as tve
        # tied embeddings, as Qwen2.5-0.5B/1.5B/3B have them. (With an untied head verl's FSDP2
        # wraps lm_head as its own unit and its fused forward, which reads lm_head.weight
        # outside the head's forward, meets the sharded DTensor: verl 0.9.1 fails there.)
        a.model_dir = tve.make_model_dir(os.path.join(d, "m"), vocab=a.V, hidden=a.H, tie=True)
        N = a.B * (a.P + a.T)
        print(f"one actor update (verl train_batch): B={a.B} in {a.micro} micro-batches, "
              f"prompt {a.P} + response {a.T} ({N} tokens), H={a.H}, V={a.V}, fp32, "
              f"{a.threads} threads", flush=True)
        times = _child("time", a, a.port)
        mem = {p: _child("memory", a, a.port + 1 + i, ["--provider", p])
               for i, p in enumerate(PROVIDERS)}
    mb_logits = (N // a.micro) * a.V * 4 / 2 ** 20
    print(f"| path | time (s), median of {a.reps} | × stock | peak memory beyond the "
          f"inputs (MiB) | × stock | × one fp32 micro-batch [N, V] ({mb_logits:.0f} MiB) |")
    print("|---|---|---|---|---|---|")
    for p, name in PROVIDERS.items():
        print(f"| {name} | {times[p]:.3f} | {times[p] / times['verl']:.2f} | "
              f"{mem[p]['peak_mb']:.0f} | {mem[p]['peak_mb'] / mem['verl']['peak_mb']:.2f} | "
              f"{mem[p]['peak_mb'] / mb_logits:.2f} |")


if __name__ == "__main__":
    main()
