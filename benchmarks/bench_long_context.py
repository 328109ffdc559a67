"""Long context: one tensor-parallel rank's peak memory and time of the head's training step
(hidden states and the rank's lm_head rows -> per-token log-probs -> PPO-clip + k3 KL loss ->
backward), at S = 32k ... 256k tokens, V = 151,936 and 248,320, vocabulary shards of TP 1, 4, 8.

    python benchmarks/bench_long_context.py [--S 32768,65536,131072,262144]
        [--V 151936,248320] [--tp 1,4,8] [--H 2048] [--chunk-mb default,256]
        [--skyrl PATH/fused_linear_logprob_triton.py] [--out runs/bench/long_context.csv]
    python benchmarks/bench_long_context.py --table benchmarks/results/long_context.csv

Providers, on the same bf16 inputs (one sequence of S tokens, all masked in):
  gbc      gbc_kernels.fused_linear_policy_loss (backend "auto": Triton on CUDA), for each
           chunk budget given (GBC_CHUNK_MB; "default" = the library's own sizing)
  eager    the stock head of verl (FSDP and Megatron) and OpenRLHF: logits = hidden @ W.T in
           bf16, then float32, log_softmax, gather, the loss on the log-probs, autograd.
           Where it does not fit, its peak is computed: the most bytes per [S, V_shard] logit
           element it took where it ran, times S * V_shard (the row's status says so)
  skyrl    SkyRL 0.3.0's FusedLinearLogprobTriton (distributed/megatron/
           fused_linear_logprob_triton.py, loaded from --skyrl or the installed skyrl), then
           the same loss on its log-probs. CUDA only.

A rank of TP k holds ceil(V / k) rows of the head. The shard runs here as that rank's whole
vocabulary (one process, one GPU): the cross-rank reductions a real TP rank adds are [S]-sized
(two float32 values per token), so its memory and its matmuls are those of the real rank.

Columns: peak_extra_mb = peak allocation beyond the inputs, the gradients of hidden and weight
included; work_mb = peak_extra_mb less those two gradients (what the head needs beyond what any
training step must hold: the gradients themselves), time_ms = median of --reps timed steps
after one warm-up (CUDA events; on CPU, wall clock). ratio_time_to_eager and
work_over_skyrl are measured side by side in the same run. On a CPU (no CUDA) the script
measures gbc's and eager's peak allocation through torch's CPU allocator profiler at the
sizes given (keep them small there).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import BETA, EPS, append_rows, loss_from_logp, now  # noqa: E402


def make_case(S, H, Vl, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = (torch.randn(1, S, H, generator=g) * 0.5).to(dtype).to(device).requires_grad_(True)
    weight = (torch.randn(Vl, H, generator=g) / H ** 0.5).to(dtype).to(device)
    weight.requires_grad_(True)
    targets = torch.randint(0, Vl, (1, S), generator=g).to(device)
    old = (-torch.rand(1, S, generator=g) * 8).to(device)
    ref = (old.cpu() + 0.1 * torch.randn(1, S, generator=g)).clamp(max=0.0).to(device)
    return dict(hidden=hidden, weight=weight, targets=targets,
                mask=torch.ones(1, S, dtype=torch.bool, device=device),
                adv=torch.randn(1, generator=g).to(device), old=old, ref=ref)


def load_skyrl(path):
    """SkyRL's FusedLinearLogprobTriton: from a copy of its module file, or the installed
    skyrl package. None where neither is at hand or there is no CUDA device."""
    if not torch.cuda.is_available():
        return None
    if path:
        spec = importlib.util.spec_from_file_location("skyrl_fused_linear_logprob", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.FusedLinearLogprobTriton
    try:
        from skyrl.backends.skyrl_train.distributed.megatron.fused_linear_logprob_triton import (
            FusedLinearLogprobTriton)
        return FusedLinearLogprobTriton
    except ImportError:
        return None


def providers(c, chunk_mbs, skyrl_fn, logits_dtype=None):
    """``logits_dtype``: float32 labels gbc's providers ``gbc_f32`` (float32 logits mode)."""
    import gbc_kernels as gbc

    cfg = gbc.PolicyLossConfig(epsilon_low=EPS, epsilon_high=EPS, kl_coef=BETA,
                               kl_estimator="k3", loss_agg="token-mean",
                               logits_dtype=logits_dtype)
    label = "gbc" if logits_dtype is None else "gbc_f32"
    out = {}
    for mb in chunk_mbs:
        def ours(mb=mb):
            old_env = os.environ.pop("GBC_CHUNK_MB", None)
            if mb != "default":
                os.environ["GBC_CHUNK_MB"] = mb
            try:
                loss, _ = gbc.fused_linear_policy_loss(c["hidden"], c["weight"], c["targets"],
                                                       c["mask"], c["adv"], c["old"], c["ref"],
                                                       config=cfg)
                loss.backward()
            finally:
                os.environ.pop("GBC_CHUNK_MB", None)
                if old_env is not None:
                    os.environ["GBC_CHUNK_MB"] = old_env
        out[label if mb == "default" else f"{label}@{mb}MB"] = ours

    def eager():
        logits = (c["hidden"] @ c["weight"].T).float()
        logp = torch.log_softmax(logits, -1).gather(-1, c["targets"].unsqueeze(-1)).squeeze(-1)
        del logits
        loss_from_logp(c, logp).backward()
    out["eager"] = eager

    def eager_f32():        # the "float32 LM head": TRL's cast_lm_head_to_fp32, torchtitan
        logits = c["hidden"].float() @ c["weight"].float().T
        logp = torch.log_softmax(logits, -1).gather(-1, c["targets"].unsqueeze(-1)).squeeze(-1)
        del logits
        loss_from_logp(c, logp).backward()
    out["eager_f32"] = eager_f32

    if skyrl_fn is not None:
        def skyrl():
            Vl = c["weight"].shape[0]
            logp = skyrl_fn.apply(c["hidden"], c["weight"], c["targets"], 0, Vl, 1024, None,
                                  False)
            loss_from_logp(c, logp.float()).backward()
        out["skyrl"] = skyrl
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(fn, c, device, reps):
    """(median ms, peak bytes beyond what is allocated before the call) of ``fn``; the
    gradients start as None on each call."""
    def one():
        c["hidden"].grad = c["weight"].grad = None
        fn()

    if device.type == "cuda":
        one()                                          # warm-up (compiles, autotunes)
        c["hidden"].grad = c["weight"].grad = None
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        one()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        ts = []
        for _ in range(reps):
            c["hidden"].grad = c["weight"].grad = None
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts), peak
    one()
    from torch.profiler import ProfilerActivity, profile
    c["hidden"].grad = c["weight"].grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
    # running sum of the CPU allocator's events in time order: the peak beyond the start
    evs = sorted((e for e in prof.events() if e.cpu_memory_usage),
                 key=lambda e: e.time_range.start)
    cur = peak = 0
    for e in evs:
        cur += e.cpu_memory_usage
        peak = max(peak, cur)
    return ms, peak


def is_oom(exc):
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def table(path, V=248320, tps=(4, 8, 1)):
    """The README's table from a CSV this script wrote: per S and TP at vocabulary ``V``, each
    provider's time and working memory (the last row of each key wins)."""
    import csv

    rows = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            if int(r["V"]) == V:
                rows[(int(r["tp"]), int(r["S"]), r["provider"])] = r
    provs = ["gbc", "gbc@256MB", "eager", "skyrl"]
    print(f"| TP (V shard) | S | " + " | ".join(f"{p} ms / work MiB" for p in provs)
          + " | gbc@256MB: work / skyrl's, time / eager's |")
    print("|---|---|" + "---|" * (len(provs) + 1))
    for tp in tps:
        for S in sorted({k[1] for k in rows if k[0] == tp}):
            cells = []
            for p in provs:
                r = rows.get((tp, S, p))
                if r is None:
                    cells.append("")
                elif r["status"] != "measured":
                    cells.append(f"OOM (computed {int(r['work_mb']) / 1024:.0f} GiB)")
                else:
                    cells.append(f"{float(r['time_ms']):.0f} / {r['work_mb']}")
            r = rows.get((tp, S, "gbc@256MB"))
            ratio = "" if r is None else (f"{r['work_over_skyrl'] or '-'}, "
                                          f"{r['ratio_time_to_eager'] or '-'}")
            Vl = next(rows[k]["V_shard"] for k in rows if k[0] == tp)
            print(f"| {tp} ({Vl}) | {S // 1024}k | " + " | ".join(cells) + f" | {ratio} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", metavar="CSV",
                    help="print the README's markdown table of a CSV this script wrote, and exit")
    ap.add_argument("--S", default="32768,65536,131072,262144")
    ap.add_argument("--V", default="151936,248320")
    ap.add_argument("--tp", default="8,4,1")
    ap.add_argument("--H", type=int, default=2048,
                    help="hidden size (default %(default)s: Qwen3.5/3.6-35B-A3B's, SkyRL's "
                         "benchmark's)")
    ap.add_argument("--chunk-mb", default="default,256")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--providers", default="gbc,eager,skyrl",
                    help="of gbc, gbc_f32 (with --logits-dtype float32), eager, eager_f32 (the "
                         "float32-cast head), skyrl")
    ap.add_argument("--logits-dtype", default=None, choices=["float32"],
                    help="gbc's logits_dtype: its providers are then labelled gbc_f32")
    ap.add_argument("--skyrl", default=os.environ.get("GBC_SKYRL_FUSED"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.path.join("runs", "bench", "long_context.csv"))
    args = ap.parse_args()
    if args.table:
        table(args.table)
        return 0
    device = torch.device(args.device)
    dtype = torch.bfloat16
    want = set(args.providers.split(","))
    skyrl_fn = load_skyrl(args.skyrl) if "skyrl" in want else None
    if "skyrl" in want and skyrl_fn is None:
        print("skyrl: not measured (needs CUDA and SkyRL's fused_linear_logprob_triton)")
    stamp = now()
    devname = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    import gbc_kernels

    # the providers compute the same log-probs: checked once on a small case
    c = make_case(512, args.H, 1000, dtype, device, seed=1)
    ref = torch.log_softmax((c["hidden"].double() @ c["weight"].double().T), -1)
    ref = ref.gather(-1, c["targets"].unsqueeze(-1)).squeeze(-1).float()
    ours = gbc_kernels.fused_linear_logprobs(c["hidden"].detach(), c["weight"].detach(),
                                             c["targets"])[0]
    print(f"check: gbc log-probs vs float64, max abs err {(ours - ref).abs().max().item():.2e}")
    ours32 = gbc_kernels.fused_linear_logprobs(c["hidden"].detach(), c["weight"].detach(),
                                               c["targets"], logits_dtype=torch.float32)[0]
    print(f"check: gbc float32 mode vs float64, max abs err "
          f"{(ours32 - ref).abs().max().item():.2e}")
    if skyrl_fn is not None:
        sk = skyrl_fn.apply(c["hidden"].detach(), c["weight"].detach(), c["targets"], 0, 1000,
                            1024, None, True)
        print(f"check: skyrl log-probs vs float64, max abs err {(sk - ref).abs().max().item():.2e}")
    del c

    rows = []
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    # provider -> the most bytes per [S, V_shard] logit element seen where it ran: a provider
    # that holds the logits (eager) is linear in S * V_shard, so where it does not fit its peak
    # is that many bytes per element (labelled as computed)
    per_elem = {}
    for V in (int(x) for x in args.V.split(",")):
        for tp in (int(x) for x in args.tp.split(",")):
            Vl = math.ceil(V / tp)
            for S in (int(x) for x in args.S.split(",")):
                c = make_case(S, args.H, Vl, dtype, device)
                grads = (S * args.H + Vl * args.H) * c["hidden"].element_size()
                res = {}
                ld = None if args.logits_dtype is None else torch.float32
                for name, fn in providers(c, args.chunk_mb.split(","), skyrl_fn, ld).items():
                    if name.split("@")[0] not in want:
                        continue
                    status = "measured"
                    try:
                        ms, peak = measure(fn, c, device, args.reps)
                    except Exception as exc:          # noqa: BLE001 - OOM is a result here
                        c["hidden"].grad = c["weight"].grad = None
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                        if not is_oom(exc):
                            raise
                        ms, peak, status = float("nan"), float("nan"), "OOM"
                        if name in per_elem:
                            peak = per_elem[name] * S * Vl
                            status = (f"OOM; peak computed: {per_elem[name]:.2f} B per "
                                      f"[S, V_shard] element, measured")
                    else:
                        per_elem[name] = max(per_elem.get(name, 0.0), peak / (S * Vl))
                    res[name] = (ms, peak, status)
                for name, (ms, peak, status) in res.items():
                    e_ms = res.get("eager", (float("nan"),))[0]
                    sk = res.get("skyrl", (0, float("nan")))[1]
                    rows.append(dict(
                        provider=name, S=S, V=V, tp=tp, V_shard=Vl, H=args.H,
                        dtype="bfloat16", device=devname, status=status,
                        time_ms=f"{ms:.1f}", peak_extra_mb=f"{peak / 2**20:.0f}",
                        work_mb=f"{(peak - grads) / 2**20:.0f}",
                        ratio_time_to_eager=f"{ms / e_ms:.3f}" if e_ms == e_ms else "",
                        work_over_skyrl=(f"{(peak - grads) / (sk - grads):.3f}"
                                         if sk == sk and name != "skyrl" else ""),
                        version=gbc_kernels.__version__, timestamp=stamp))
                    print({k: rows[-1][k] for k in ("provider", "S", "V", "tp", "status",
                                                     "time_ms", "peak_extra_mb", "work_mb",
                                                     "ratio_time_to_eager",
                                                     "work_over_skyrl")}, flush=True)
                del c
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                append_rows(args.out, rows[-len(res):])       # row by row: a cut run keeps its rows
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
