"""Where the GPU time of one fused-loss step goes: a torch-profiler breakdown, kernel launches and
host synchronisations per step, and the step time as the chunk budget varies.

    python benchmarks/profile_gpu.py [--shape qwen2.5-7b] [--N 8192] [--chunk-mb default,2048]

Prints, for backend="triton" (forward + backward, bf16, PPO clip + k3 KL, the case of
bench_gpu.py):
  * the step time (triton.testing.do_bench median) beside the floor (the three bare matmuls),
    for every chunk budget given (GBC_CHUNK_MB), with the rows per chunk it gives;
  * the profiler's CUDA kernels of one step, grouped by name, with their share of the step;
  * the one-pass row kernel (the default) against the three row kernels it replaces;
  * the peak memory of one step, gradients included;
  * the number of kernel launches and of host synchronisations in one step (the latter counted
    by torch.cuda.set_sync_debug_mode, which reports every synchronising CUDA call PyTorch makes);
  * the GPU's idle gaps over three steps run back to back, as a training loop runs them.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SHAPES = {"qwen2.5-7b": (3584, 151936), "llama3-8b": (4096, 128256)}


def step_fn(c, cfg):
    import gbc_kernels as gbc

    def step():
        loss, _ = gbc.fused_linear_policy_loss(c["hidden"], c["weight"], c["targets"], c["mask"],
                                               c["adv"], c["old"], c["ref"], config=cfg,
                                               backend="triton")
        loss.backward()
    return step


def host_timeline(c, cfg, reps: int = 10):
    """Host time to queue the forward, the backward's wall time, the whole step's wall time and
    its CUDA-event time (median of ``reps`` steps, each from an idle GPU)."""
    import statistics
    import time

    import gbc_kernels as gbc
    rows = []
    for _ in range(reps):
        c["hidden"].grad = c["weight"].grad = None
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        loss, _ = gbc.fused_linear_policy_loss(c["hidden"], c["weight"], c["targets"], c["mask"],
                                               c["adv"], c["old"], c["ref"], config=cfg,
                                               backend="triton")
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        e1.record()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        rows.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t0) * 1e3, e0.elapsed_time(e1)))
    med = [statistics.median(r[i] for r in rows) for i in range(4)]
    print(f"host: forward queued in {med[0]:.3f} ms, backward returned after {med[1]:.3f} ms, "
          f"step wall {med[2]:.3f} ms, CUDA events {med[3]:.3f} ms")


def count_syncs(fn) -> int:
    """Synchronising CUDA calls made by ``fn`` (PyTorch's sync debug mode warns on each)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    for w in syncs:
        print(f"    sync: {str(w.message)[:100]}  ({os.path.basename(w.filename)}:{w.lineno})")
    return len(syncs)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES),
                    help="LM head shape (default: %(default)s)")
    ap.add_argument("--N", type=int, default=8192, help="tokens (default: %(default)s)")
    ap.add_argument("--chunk-mb", default="default",
                    help="comma-separated chunk budgets in MiB to time, 'default' for the "
                         "library's own (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", help="default: %(default)s")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_gpu.py: no CUDA device here; nothing to profile")
        return 0
    import triton.testing
    from torch.profiler import ProfilerActivity, profile

    from _common import BETA, EPS, cuda_peak_bytes, make_provider, setup_case
    import gbc_kernels as gbc
    from gbc_kernels import _chunking

    H, V = SHAPES[args.shape]
    c = setup_case(args.N, H, V, getattr(torch, args.dtype))
    c = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in c.items()}
    c["hidden"] = c["hidden"].detach().requires_grad_(True)
    c["weight"] = c["weight"].detach().requires_grad_(True)
    cfg = gbc.PolicyLossConfig(epsilon_low=EPS, epsilon_high=EPS, kl_coef=BETA)
    step = step_fn(c, cfg)
    floor = make_provider("floor", c)
    bench = dict(warmup=50, rep=1000, grad_to_none=[c["hidden"], c["weight"]])
    floor()
    f_ms = triton.testing.do_bench(floor, **bench)
    print(f"{torch.cuda.get_device_name()}  {args.shape} N={args.N} {args.dtype}")
    print(f"floor (3 matmuls): {f_ms:.3f} ms")
    grad_bytes = sum(c[k].numel() * c[k].element_size() for k in ("hidden", "weight"))
    for mb in args.chunk_mb.split(","):
        if mb == "default":
            os.environ.pop("GBC_CHUNK_MB", None)
        else:
            os.environ["GBC_CHUNK_MB"] = mb
        rows = _chunking.rows_per_chunk(args.N, V, c["hidden"].element_size(),
                                        c["hidden"].device, grad_bytes)
        step()
        ms = triton.testing.do_bench(step, **bench)
        print(f"gbc_triton chunk_mb={mb:>7} rows/chunk~{rows:5d}: {ms:.3f} ms = "
              f"{ms / f_ms:.3f}x floor", flush=True)
    os.environ.pop("GBC_CHUNK_MB", None)          # the rest: the library's default chunks
    from gbc_kernels.triton import launch
    for one_pass in (False, True):        # the row kernel against the three-kernel baseline
        launch.ONE_PASS = one_pass
        step()
        ms = triton.testing.do_bench(step, **bench)
        print(f"gbc_triton {'one-pass row kernel' if one_pass else 'three row kernels  '}: "
              f"{ms:.3f} ms = {ms / f_ms:.3f}x floor", flush=True)
    os.environ["GBC_VALIDATE"] = "0"
    ms = triton.testing.do_bench(step, **bench)
    print(f"gbc_triton value checks off (GBC_VALIDATE=0): {ms:.3f} ms = {ms / f_ms:.3f}x floor")
    del os.environ["GBC_VALIDATE"]

    step()
    print(f"host syncs in one step: {count_syncs(step)}")
    host_timeline(c, cfg)
    peak = cuda_peak_bytes(step, c)
    print(f"peak beyond inputs, gradients included (one step, no do_bench cache buffer): "
          f"{peak / 2**20:.0f} MiB = {peak / (args.N * V * 4):.3f}x one fp32 [N, V]")
    # three steps back to back, as a training loop runs them: the idle gaps then show what the
    # host cannot hide behind the previous step's kernels
    steps = 3
    torch.cuda.synchronize()
    marker = torch.ones(1, device="cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        marker.add_(1)            # a kernel just before the steps: the gap after it is host time
        for _ in range(steps):
            c["hidden"].grad = c["weight"].grad = None
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) / steps or 1.0
    launches = sum(e.count for e in events) / steps
    print(f"CUDA kernels per step ({steps} steps back to back): {launches:.0f} launches, "
          f"{total / 1e3:.3f} ms of GPU time")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        t = e.self_device_time_total / steps
        print(f"  {t / 1e3:8.3f} ms {100 * t / total:5.1f}%  x{e.count / steps:<5.1f} {e.key[:90]}")
    print_gaps(prof)
    return 0


def print_gaps(prof, min_us: float = 20.0):
    """The GPU's idle time inside one step: gaps between consecutive kernels, the largest first,
    with the kernels on either side (an idle GPU waits on the host: Python, a launch, a sync)."""
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
    if not kernels:
        return
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    gaps = []
    end, prev = kernels[0].time_range.end, kernels[0]
    for k in kernels[1:]:
        if k.time_range.start - end > min_us:
            gaps.append((k.time_range.start - end, prev.name, k.name, k.time_range.start
                         - kernels[0].time_range.start))
        if k.time_range.end > end:
            end, prev = k.time_range.end, k
    idle = sum(g for g, *_ in gaps)
    print(f"GPU span of the step {span / 1e3:.3f} ms, idle in gaps > {min_us:.0f} us: "
          f"{idle / 1e3:.3f} ms in {len(gaps)} gaps")
    for g, a, b, at in sorted(gaps, reverse=True)[:12]:
        print(f"  {g / 1e3:7.3f} ms at +{at / 1e3:7.3f} ms  after {a[:45]:45s} before {b[:45]}")


if __name__ == "__main__":
    sys.exit(main())
