"""CPU benchmark of the fused GRPO loss (forward + backward) against its floor and baselines.

Providers, same inputs, same thread count. Timing: all providers in one process, repetitions interleaved (robust to machine drift);
memory: each provider in a fresh process (peak RSS beyond inputs and gradients).

  floor        the three bare matmuls a training step needs (logits, grad-hidden, grad-weight)
  gbc_cpu      gbc_kernels, C++ backend            gbc_torch   gbc_kernels, chunked PyTorch path
  plain_torch  full logits + log_softmax + autograd (the textbook way)
  trl_chunked  TRL 1.16 GRPOTrainer's chunked log-prob kernel (logits recomputed in backward)
  torch_lce    PyTorch 2.13's torch.nn.functional.linear_cross_entropy (reduction="none",
               LinearCrossEntropyOptions(): chunked, logits recomputed in backward)
  liger        Liger-Kernel LigerFusedLinearGRPOLoss(compiled=False)  (liger_compiled: =True)
  liger_scaled_ce  Liger's fused linear scaled cross-entropy (verl's default fused head) + loss
  gbc_cpu_f32  gbc_cpu with logits_dtype=float32 (gbc_torch_f32: the PyTorch path's)
  gbc_cpu_in   gbc_cpu with logits_dtype="input": the operands' dtype (the CPU default for
               bf16 is float32 logits on a CPU without bf16 units; gbc_torch_in likewise)
  floor_f32    the floor's three matmuls on float32 copies of bf16 inputs (made untimed)
  float32_head the "float32 LM head" (TRL's cast_lm_head_to_fp32, torchtitan, NeMo-RL): hidden
               and weight cast to float32, float32 matmul and [N, V] logits, then the loss
  unsloth_recompute  unsloth_zoo's plain-PyTorch chunked head with recompute
               (chunked_hidden_states_selective_log_softmax_recompute, fused_linear=False) + loss
  unsloth_grpo  what unsloth_zoo's grpo_accumulated_loss runs: its scorer
               grpo_chunked_hidden_states_logprobs, then UnslothEfficientGRPO (loss_type="bnpo")
  unsloth_chunked  unsloth_zoo's compiled chunked head without recompute (fused_linear=False) + loss
               (the unsloth_* providers: only where unsloth_zoo is installed, never a requirement:
               pip install --no-deps unsloth_zoo; benchmarks/_common.unsloth_rl)

Same loss: each provider's warm-up call (from no gradients) is held against gbc_cpu's on the same
inputs; the CSV's loss_diff, dhidden_diff, dweight_diff are the max abs differences of the loss and
of the two gradients (printed on each warm-up line), same_loss_as the gbc configuration held
against: gbc_cpu, or gbc_cpu with _common.REFERENCE_OPTIONS where a provider's loss differs by
design (unsloth_grpo: its KL clamps), computed untimed.

--logits-dtype float32 runs every gbc provider in float32 logits mode (docs/kernels.md,
"Precision"); with --dtype bfloat16, e.g.
    python benchmarks/bench_cpu.py --Ns 2048 --Hs 1024 --Vs 32768 --dtype bfloat16 \
        --providers floor,gbc_cpu,gbc_cpu_f32,plain_torch,float32_head

    python benchmarks/bench_cpu.py --quick            # N=2048, H=1024, V=32768 (the README table)
    python benchmarks/bench_cpu.py                    # N in 1k..8k, V in 32768/128256/151936, H in 1024/2048
    python benchmarks/bench_cpu.py --objectives       # docs/math.md §10's objectives vs token-level PPO

--objectives times gbc_cpu with each objective of _common.OBJECTIVES against the token-level
PPO loss in one process (round-robin), writes objectives.csv beside --out and prints the
markdown table of the README.

Prints a progress line per provider warm-up, per round of timed repetitions and per memory
measurement. Appends to runs/bench/cpu.csv (untracked) and draws cpu.png beside it; the tracked
reference results are regenerated only on request: --out benchmarks/results/cpu.csv.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PROVIDERS = ["floor", "gbc_cpu", "gbc_torch", "plain_torch", "trl_chunked", "torch_lce",
             "liger", "liger_compiled", "liger_scaled_ce"]
UNSLOTH_PROVIDERS = ["unsloth_recompute", "unsloth_grpo", "unsloth_chunked"]  # _common's
if importlib.util.find_spec("unsloth_zoo") is not None:       # an optional peer: only if installed
    PROVIDERS += UNSLOTH_PROVIDERS[:2]
# also accepted by --providers (not in the default grid): the float32 logits mode and head
EXTRA_PROVIDERS = ["floor_f32", "gbc_cpu_f32", "gbc_torch_f32", "gbc_cpu_in", "gbc_torch_in",
                   "float32_head"] + \
    [p for p in UNSLOTH_PROVIDERS if p not in PROVIDERS]


def _peak_kb():
    """Peak resident set (VmHWM) of this process, KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak_kb():
    """Reset the peak to the current RSS (Linux: write 5 to clear_refs) and return it, so the
    set-up's temporaries do not count."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _peak_kb()


def child_memory(args):
    """Fresh process, one provider: peak RSS beyond the inputs and the gradients."""
    import torch
    torch.set_num_threads(args.threads)
    from _common import make_provider, setup_case

    c = setup_case(args.N, args.H, args.V, getattr(torch, args.dtype), T=args.T)
    fn = make_provider(args.provider, c, _logits_dtype(args))
    base = _reset_peak_kb()
    for _ in range(2):          # a training loop: zero_grad(set_to_none=True) between steps
        c["hidden"].grad = c["weight"].grad = None
        fn()
    peak = _peak_kb()
    esz = c["hidden"].element_size()
    grads_mb = (c["hidden"].numel() + c["weight"].numel()) * esz / 2 ** 20
    if args.provider in ("floor", "floor_f32"):
        grads_mb = 0.0      # the floor's matmul outputs are not kept as .grad
    print(json.dumps(dict(peak_extra_mb=max(0.0, (peak - base) / 1024 - grads_mb))))


def child_time(args):
    """One process, every provider, repetitions interleaved round-robin: drift of the machine
    (the other core's load, turbo) hits every provider alike."""
    import torch
    torch.set_num_threads(args.threads)
    import gbc_kernels
    from _common import REFERENCE_OPTIONS, make_provider, setup_case
    import statistics, time

    c = setup_case(args.N, args.H, args.V, getattr(torch, args.dtype), T=args.T)
    provs = args.providers.split(",")
    fns, times, errors = {}, {p: [] for p in provs}, {}
    shape = f"N={args.N},H={args.H},V={args.V}"

    def progress(msg):
        print(f"  [{shape}] {msg}", file=sys.stderr, flush=True)

    def result():
        """The loss and the gradients of the call just made (float32 copies)."""
        return [None if t is None else t.detach().float().clone()
                for t in (loss, c["hidden"].grad, c["weight"].grad)]

    ref, diffs, refs = None, {}, {}
    for p in provs:                     # the references of the providers with another loss
        if p in REFERENCE_OPTIONS:
            c["hidden"].grad = c["weight"].grad = None
            loss = make_provider("gbc_cpu", c, **REFERENCE_OPTIONS[p])()
            refs[p] = result()
    if "gbc_cpu" not in provs and any(p != "floor" and "@" not in p for p in provs):
        # the same-loss check's reference, untimed (not for --objectives: other losses)
        c["hidden"].grad = c["weight"].grad = None
        loss = make_provider("gbc_cpu", c)()
        ref = result()
    for p in sorted(provs, key=lambda p: p != "gbc_cpu"):     # gbc_cpu first: the reference
        t0 = time.perf_counter()
        try:
            fns[p] = make_provider(p, c, _logits_dtype(args))
            c["hidden"].grad = c["weight"].grad = None
            loss = fns[p]()                             # warm-up (and compile)
            msg = f"warm-up {p}: {time.perf_counter() - t0:.2f} s"
            if loss is not None:                        # the same loss as gbc_cpu's?
                got = result()
                ref = got if p == "gbc_cpu" else ref
                diffs[p] = {k: float((a - b).abs().max()) if a is not None and b is not None
                            else float("nan") for k, a, b in
                            zip(("loss_diff", "dhidden_diff", "dweight_diff"), got,
                                refs.get(p, ref) or [None] * 3)}
                diffs[p]["same_loss_as"] = "gbc_cpu" + "".join(
                    f",{k}={v}" for k, v in REFERENCE_OPTIONS.get(p, {}).items())
                msg += f", max abs diff vs {diffs[p]['same_loss_as']}: " + ", ".join(
                    f"{k[:-5]} {v:.2e}" for k, v in diffs[p].items() if k.endswith("_diff"))
            progress(msg)
        except Exception as exc:                        # e.g. a baseline that can't run here
            errors[p] = f"{type(exc).__name__}: {exc}"[:200]
            progress(f"warm-up {p}: {errors[p][:80]}")
    fns = {p: fns[p] for p in provs if p in fns}                 # round-robin in --providers order
    for i in range(args.reps):
        for p in fns:
            if p in errors:
                continue
            c["hidden"].grad = c["weight"].grad = None
            t0 = time.perf_counter()
            fns[p]()
            times[p].append(time.perf_counter() - t0)
        progress(f"round {i + 1}/{args.reps}: " + ", ".join(
            f"{p} {times[p][-1]:.3f} s" for p in fns if p not in errors))
    out = {}
    for p in provs:
        if p in errors:
            out[p] = dict(error=errors[p])
            continue
        ts = sorted(times[p])
        q = statistics.quantiles(ts, n=5) if len(ts) >= 2 else [ts[0]] * 4
        out[p] = dict(median_s=statistics.median(ts), p20_s=q[0], p80_s=q[3], **diffs.get(p, {}))
    out["version"] = gbc_kernels.__version__
    print(json.dumps(out))


def _logits_dtype(args):
    import torch
    if args.logits_dtype in (None, "input"):
        return args.logits_dtype
    return getattr(torch, args.logits_dtype)


def _dtype_label(args) -> str:
    """The CSV's dtype column: the inputs', and the gbc providers' logits mode when set."""
    return args.dtype + ("" if args.logits_dtype is None else f"/logits={args.logits_dtype}")


def _child(kind, args, extra):
    cmd = [sys.executable, __file__, f"--child-{kind}", "--N", str(args.N), "--H", str(args.H),
           "--V", str(args.V), "--dtype", args.dtype, "--threads", str(args.threads), "--reps",
           str(args.reps), "--T", str(args.T)] + extra
    if args.logits_dtype is not None:
        cmd += ["--logits-dtype", args.logits_dtype]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    # the child's stderr (its progress lines) goes straight to the terminal
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=7200)
    if r.returncode != 0:
        return None, (f"the {kind} child exited with code {r.returncode} (killed: out of "
                      "memory?); its output is above")
    return json.loads(r.stdout.strip().splitlines()[-1]), None


def plot(csv_path, png_path):
    import csv
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(csv_path)))
    latest = {}
    for r in rows:                      # the latest run of each shape
        latest[r["shape"]] = max(latest.get(r["shape"], ""), r["timestamp"])
    last = max(latest.values())
    rows = [r for r in rows if r["timestamp"] == latest[r["shape"]] and r["status"] == "ok"]
    shapes = sorted({r["shape"] for r in rows}, key=lambda s: [int(x.split("=")[1])
                                                             for x in s.split(",")])
    provs = [p for p in PROVIDERS + EXTRA_PROVIDERS if any(r["provider"] == p for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(provs))
    for i, p in enumerate(provs):
        t = [next((float(r["ratio_to_floor"]) for r in rows if r["provider"] == p and
                   r["shape"] == s), 0) for s in shapes]
        m = [next((float(r["peak_extra_mb"]) for r in rows if r["provider"] == p and
                   r["shape"] == s), 0) for s in shapes]
        xs = [j + i * width for j in range(len(shapes))]
        axes[0].bar(xs, t, width, label=p)
        axes[1].bar(xs, m, width, label=p)
    for ax, title in zip(axes, ["time / floor (fwd+bwd, lower is better)",
                                "peak memory beyond gradients, MiB"]):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
        ax.set_xticklabels(shapes, rotation=15, fontsize=7)
        ax.set_title(title)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"gbc_kernels CPU, fp32, {rows[0]['threads']} threads ({last})")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def objectives(args):
    """gbc_cpu per objective, side by side with token-level PPO, one process."""
    from _common import OBJECTIVES, append_rows, now

    provs = ["floor"] + [f"gbc_cpu@{k}" for k in OBJECTIVES]
    args.reps = max(args.reps, 5)
    timing, err = _child("time", args, ["--providers", ",".join(provs)])
    if timing is None:
        raise SystemExit(f"benchmark child failed: {err}")
    base = timing["gbc_cpu@ppo"]["median_s"]
    floor_t = timing["floor"]["median_s"]
    stamp, rows = now(), []
    print(f"N={args.N}, H={args.H}, V={args.V}, T={args.T}, {args.dtype}, {args.threads} threads")
    print("| objective | median s | x token-level PPO | x matmul floor |")
    print("|---|---|---|---|")
    for p in provs[1:]:
        t = timing[p]
        name = p.split("@")[1]
        row = dict(objective=name, shape=f"N={args.N},H={args.H},V={args.V},T={args.T}",
                   dtype=_dtype_label(args), threads=args.threads, median_s="", p20_s="", p80_s="",
                   ratio_to_ppo="", ratio_to_floor="", status="ok" if "error" not in t
                   else f"error: {t['error']}", version=timing.get("version", ""),
                   timestamp=stamp)
        if "error" not in t:
            row.update(median_s=f"{t['median_s']:.4f}", p20_s=f"{t['p20_s']:.4f}",
                       p80_s=f"{t['p80_s']:.4f}", ratio_to_ppo=f"{t['median_s'] / base:.3f}",
                       ratio_to_floor=f"{t['median_s'] / floor_t:.3f}")
        rows.append(row)
        print(f"| {name} | {row['median_s']} | {row['ratio_to_ppo']} | {row['ratio_to_floor']} |",
              flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    append_rows(os.path.join(os.path.dirname(args.out), "objectives.csv"), rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child-time", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-memory", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--provider", default=None)
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--N", type=int, default=2048)
    ap.add_argument("--H", type=int, default=1024)
    ap.add_argument("--V", type=int, default=32768)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--logits-dtype", default=None, choices=["float32", "input"],
                    help="the gbc providers' logits_dtype (default: None, per device: float32 "
                         "logits for bf16 operands on a CPU without bf16 units)")
    ap.add_argument("--T", type=int, default=512, help="tokens per sequence (B = N / T)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--objectives", action="store_true",
                    help="time every objective of docs/math.md §10 against token-level PPO (gbc_cpu)")
    ap.add_argument("--Ns", default=None, help="comma list, overrides the grid's N")
    ap.add_argument("--Hs", default=None)
    ap.add_argument("--Vs", default=None)
    ap.add_argument("--out", default=os.path.join("runs", "bench", "cpu.csv"),
                    help="CSV to append to, cpu.png beside it (default: %(default)s, untracked; "
                         "benchmarks/results/cpu.csv regenerates the tracked reference)")
    args = ap.parse_args()
    if args.child_time:
        return child_time(args)
    if args.child_memory:
        return child_memory(args)

    from _common import append_rows, now

    if args.objectives:
        return objectives(args)
    if args.quick:
        grid = [(2048, 1024, 32768)]
    else:
        grid = [(N, H, V) for V in (32768, 128256, 151936) for H in (1024, 2048)
                for N in (1024, 2048, 4096, 8192)]
    if args.Ns or args.Hs or args.Vs:
        pick = lambda a, d: [int(x) for x in a.split(",")] if a else d
        grid = [(N, H, V) for V in pick(args.Vs, [32768]) for H in pick(args.Hs, [1024])
                for N in pick(args.Ns, [2048])]
    stamp = now()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for N, H, V in grid:
        args.N, args.H, args.V = N, H, V
        provs = args.providers.split(",")
        timing, err = _child("time", args, ["--providers", ",".join(provs)])
        timing = timing or {p: dict(error=err) for p in provs}
        # the floor: the bf16 matmuls, or (floor_f32 alone) their float32 copies
        floor_t = (timing.get("floor") or timing.get("floor_f32") or {}).get("median_s")
        logits_mb = N * V * 4 / 2 ** 20
        rows = []
        for p in provs:
            t = timing[p]
            if "error" not in t:
                print(f"  [N={N},H={H},V={V}] peak memory of {p} (a fresh process)",
                      file=sys.stderr, flush=True)
            mem, merr = _child("memory", args, ["--provider", p]) if "error" not in t else \
                (None, t["error"])
            ok = "error" not in t and mem is not None
            row = dict(provider=p, mode="fwd+bwd", shape=f"N={N},H={H},V={V}", dtype=_dtype_label(args),
                       threads=args.threads, status="ok" if ok else f"error: {t.get('error', merr)}",
                       median_s="", p20_s="", p80_s="", peak_extra_mb="", peak_over_logits="",
                       ratio_to_floor="", loss_diff="", dhidden_diff="", dweight_diff="",
                       same_loss_as=t.get("same_loss_as", ""), version=timing.get("version", ""),
                       timestamp=stamp)
            if ok:
                row.update({k: f"{t[k]:.2e}" for k in ("loss_diff", "dhidden_diff",
                                                       "dweight_diff") if k in t})
                row.update(median_s=f"{t['median_s']:.4f}", p20_s=f"{t['p20_s']:.4f}",
                           p80_s=f"{t['p80_s']:.4f}",
                           peak_extra_mb=f"{mem['peak_extra_mb']:.1f}",
                           peak_over_logits=f"{mem['peak_extra_mb'] / logits_mb:.3f}",
                           ratio_to_floor=f"{t['median_s'] / floor_t:.3f}" if floor_t else "")
            rows.append(row)
            print(f"{row['shape']:>24} {p:>15} {row['status'][:40]:>5} t={row['median_s']:>8}s "
                  f"x floor={row['ratio_to_floor']:>6} peak+={row['peak_extra_mb']:>8} MiB "
                  f"({row['peak_over_logits']} of one [N,V] fp32) vs {row['same_loss_as'] or 'gbc_cpu'}: loss "
                  f"{row['loss_diff'] or '-'} dh {row['dhidden_diff'] or '-'} "
                  f"dw {row['dweight_diff'] or '-'}", flush=True)
        append_rows(args.out, rows)
    plot(args.out, args.out.replace(".csv", ".png"))


if __name__ == "__main__":
    main()
