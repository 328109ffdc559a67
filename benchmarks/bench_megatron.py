"""gbc's Megatron head against verl 0.9.1's stock Megatron head and its fused route, on CPU.

Tensor parallel 2: two gloo ranks on this machine (torch.multiprocessing, one thread each), each
holding a ``[V/2, H]`` shard of the output layer. Per rank, the last pipeline stage's head only:
forward + backward of verl's GRPO policy loss (``McoreActorConfig`` defaults: vanilla PPO clip
0.2, token-mean; with GRPO's KL loss, ``low_var_kl`` x 0.001, and the entropy computed, verl's
``calculate_entropy=True`` with ``entropy_coeff=0``) through d hidden and d weight.

  gbc         gbc_kernels.integrations.megatron.policy_loss on hidden [S, B, H] and the shard:
              gbc's vocab-parallel path, response rows only, no [tokens, V/2] logits; d weight
              added into the weight's float32 main_grad in backward (its default route when
              the weight has one: four matmuls a chunk, no [V/2, H] gradient)
  gbc_one_sweep
              the same with main_grad=False: gbc's one-sweep fused loss (three matmuls a chunk,
              d weight as weight.grad in the weight's dtype, summed in float32 over the chunks;
              DDP's hook adds it into main_grad)
  verl_stock  what MegatronEngineWithLMHead does on the last stage without fused kernels:
              megatron-core's ColumnParallelLinear output layer (the shard passed as its
              ``weight``) on every row, prompt rows included, GPTModel's transposition to
              [B, S, V/2], verl's own ``_lm_head_logits_processor`` (temperature divided in
              place, ``logits.clone()``, ``vocab_parallel_entropy``,
              ``vocab_parallel_log_probs_from_logits``), then verl's policy loss, ``agg_loss``
              and ``kl_penalty`` (its ``ppo_loss``) on the response rows
  verl_fused  verl's fused route (``verl.utils.kernel.linear_cross_entropy``, as
              ``model_forward_fused.py`` calls it): Triton/CUDA only; on CPU the row records
              the exact error (and the one behind it with torch's NVTX ranges stubbed)

Every provider's shard has what megatron's DistributedDataParallel gives a parameter with
``grad_reduce_in_fp32`` (verl's default): a float32 ``main_grad`` and DDP's gradient hook,
which adds ``weight.grad`` into it and drops it unless the layer set ``grad_added_to_main_grad``
(``_ddp_hook``). Each provider runs in its own fresh pair of processes (forked from this one
after the imports). Memory: the peak resident set (VmHWM, reset once the inputs, hidden
[S, B, H], the [V/2, H] shard and its main_grad, are built and a short warm-up has run) beyond
those inputs, rank 0 and the max over the ranks. The gradients d hidden and d weight count: they appear during the step,
gbc's in its forward sweep, the stock head's at the end of its backward, after its peak (the
CSV gives their size and the first forward's peak). Time: rank 0's median of --reps steps after a warm-up step at the full shape (the ranks
start each step together). The losses of the providers are printed side by side (same inputs).

    python benchmarks/bench_megatron.py --quick     # smoke: S=256, B=2, H=256, V=8192 (seconds)
    python benchmarks/bench_megatron.py             # V=151936, H=3584, S=4096, B=1, bf16
    python benchmarks/bench_megatron.py --out benchmarks/results/megatron.csv   # tracked result

The response is the last half of each sequence (--response). Appends to runs/bench/megatron.csv
(untracked) unless --out names another file; prints the README's table rows at the end.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "standins"))   # megatron's CPU shims

PROVIDERS = ["gbc", "gbc_one_sweep", "verl_stock", "verl_fused"]
TP = 2


def _actor():
    """verl's actor config for the Megatron engine: its defaults, with GRPO's KL loss and the
    entropy computed (``calculate_entropy``; ``entropy_coeff`` stays 0)."""
    from verl.workers.config.actor import McoreActorConfig

    return McoreActorConfig(strategy="megatron", ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                            use_kl_loss=True, calculate_entropy=True)


def _inputs(args, rank):
    """Per-rank inputs: hidden [S, B, H] and per-token tensors [B, S] the same on both ranks
    (tensor parallelism without sequence parallelism), this rank's [V/2, H] shard."""
    import torch

    dt = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(args.seed)
    S, B, H, V = args.S, args.B, args.H, args.V
    hidden = torch.randn(S, B, H, generator=g).to(dt).requires_grad_(True)
    labels = torch.randint(0, V, (B, S), generator=g)
    R = args.response
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[:, S - R - 1:S - 1] = True                # logits at t predict token t + 1
    adv = torch.randn(B, generator=g)[:, None].expand(B, S).contiguous()
    base = -math.log(V)                            # random labels: log p ~ -log V
    old = (base + 0.3 * torch.randn(B, S, generator=g)).clamp(max=0)
    ref = (base + 0.3 * torch.randn(B, S, generator=g)).clamp(max=0)
    gw = torch.Generator().manual_seed(args.seed + 1 + rank)
    weight = (torch.randn(V // TP, H, generator=gw) / H ** 0.5).to(dt).requires_grad_(True)
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)     # DDP's grad buffer
    weight.grad_added_to_main_grad = False
    weight.register_post_accumulate_grad_hook(_ddp_hook)
    return dict(hidden=hidden, weight=weight, labels=labels, mask=mask, adv=adv, old=old,
                ref=ref, P=S - R - 1)


def _ddp_hook(param):
    """megatron's DistributedDataParallel gradient hook (``_make_backward_post_hook``): add
    ``param.grad`` into ``main_grad`` unless the layer already added its gradient there."""
    if param.grad is not None and not param.grad_added_to_main_grad:
        param.main_grad.add_(param.grad)
    param.grad = None


def _verl_loss(actor, lp, ent, c):
    """verl's ppo_loss (verl/workers/utils/losses.py) on the padded response rows [B, R]: its
    registered policy loss, the entropy term and the KL term through its agg_loss."""
    from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty

    sl = slice(c["P"], c["P"] + int(c["mask"][0].sum()))
    m, old, adv, ref = (c[k][:, sl] for k in ("mask", "old", "adv", "ref"))
    lp, ent = lp[:, sl], ent[:, sl]
    info = actor.global_batch_info
    info.update(dp_size=1, batch_num_tokens=int(m.sum()), global_batch_size=m.shape[0],
                loss_scale_factor=actor.loss_scale_factor)
    pg, _ = get_policy_loss_fn(actor.policy_loss.loss_mode)(
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=m,
        loss_agg_mode=actor.loss_agg_mode, config=actor, rollout_is_weights=None)
    loss = pg - actor.entropy_coeff * agg_loss(loss_mat=ent, loss_mask=m,
                                               loss_agg_mode=actor.loss_agg_mode, **info)
    kld = kl_penalty(logprob=lp, ref_logprob=ref, kl_penalty=actor.kl_loss_type)
    return loss + actor.kl_loss_coef * agg_loss(loss_mat=kld, loss_mask=m,
                                                loss_agg_mode=actor.loss_agg_mode, **info)


def _provider(name, args):
    """``forward(c) -> loss`` of one provider (its backward puts the gradients into c's
    leaves)."""
    import torch

    actor = _actor()
    if name in ("gbc", "gbc_one_sweep"):
        from gbc_kernels.integrations import megatron as M
        from gbc_kernels.integrations import verl as gv

        cfg = gv.policy_loss_config(actor)

        def forward(c):
            info = dict(dp_size=1, batch_num_tokens=int(c["mask"].sum()),
                        global_batch_size=c["mask"].shape[0])
            return M.policy_loss(c["hidden"], c["weight"], c["labels"], c["mask"], c["adv"],
                                 c["old"], c["ref"], config=cfg, return_entropy=True,
                                 main_grad=None if name == "gbc" else False,
                                 **gv.batch_normalisers(actor, c["mask"], info)).loss
        return forward
    if name == "verl_stock":
        from types import SimpleNamespace

        from megatron.core import ModelParallelConfig
        from megatron.core.tensor_parallel import ColumnParallelLinear
        from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

        mp_cfg = ModelParallelConfig(tensor_model_parallel_size=TP, params_dtype=getattr(
            torch, args.dtype), use_cpu_initialization=True, gradient_accumulation_fusion=False,
            sequence_parallel=False)
        # GPTModel's output layer; the shard is passed as its weight (a tied model's way)
        layer = ColumnParallelLinear(args.H, args.V, config=mp_cfg, init_method=lambda w: w,
                                     bias=False, gather_output=False,
                                     skip_weight_param_allocation=True)
        engine = SimpleNamespace(engine_config=SimpleNamespace(
            entropy_from_logits_with_chunking=False))
        processor = MegatronEngineWithLMHead._lm_head_logits_processor

        def forward(c):
            logits, _ = layer(c["hidden"], weight=c["weight"])          # [S, B, V/2]
            logits = logits.transpose(0, 1).contiguous()                # GPTModel._postprocess
            temperature = torch.ones(c["labels"].shape, dtype=torch.float32)
            out = processor(engine, logits, c["labels"], temperature,
                            calculate_sum_pi_squared=False, calculate_entropy=True,
                            distillation_use_topk=False, distillation_only=False,
                            logits_processor_func=None, batch=None, data_format="bshd")
            del logits
            return _verl_loss(actor, out["log_probs"], out["entropy"], c)
        return forward
    if name == "verl_fused":
        from megatron.core import parallel_state
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        def forward(c):
            S, B = c["hidden"].shape[:2]
            lp, ent = linear_cross_entropy(c["hidden"], c["weight"], c["labels"].t().contiguous(),
                                           1.0, "none",
                                           parallel_state.get_tensor_model_parallel_group())
            return _verl_loss(actor, lp.view(S, B).t(), ent.view(S, B).t(), c)
        return forward
    raise ValueError(f"provider: expected one of {PROVIDERS}, got {name!r}")


def _error(exc):
    """The exception and the line of verl (else the innermost line) that raised it."""
    frames = traceback.extract_tb(exc.__traceback__)
    tb = next((f for f in reversed(frames) if f"{os.sep}verl{os.sep}" in f.filename), frames[-1])
    where = f"{os.path.basename(tb.filename)}:{tb.lineno} `{(tb.line or '').strip()}`"
    return f"{type(exc).__name__}: {str(exc).strip() or '(no message)'} at {where}"


def _fused_reason(forward, c):
    """Why verl's fused route does not run here: the error as it is, then the one behind it
    with torch's NVTX ranges (CUDA-only markers) stubbed."""
    import contextlib

    import torch

    try:
        forward(c).backward()
        return None
    except Exception as exc:                       # noqa: BLE001 -- recorded, not hidden
        first = _error(exc)
    nvtx = torch.cuda.nvtx.range
    torch.cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    try:
        forward(c).backward()
        return f"not run on CPU: {first}"
    except Exception as exc:                       # noqa: BLE001
        return f"not run on CPU: {first}; with NVTX stubbed: {_error(exc)}"
    finally:
        torch.cuda.nvtx.range = nvtx


def _rank(rank, port, name, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    import logging

    logging.disable(logging.WARNING)            # verl's "no accelerator" notices
    import megatron_cpu as mc
    from bench_cpu import _peak_kb, _reset_peak_kb

    mc.install_shims()
    mc.init_parallel(TP)
    say = (lambda m: print(f"  [{name}] {m}", file=sys.stderr, flush=True)) if rank == 0 else \
        (lambda m: None)
    out = dict(rank=rank)
    try:
        forward = _provider(name, args)
        c = _inputs(args, rank)
        w = 16                                  # a short warm-up (imports, torch.compile)
        small = dict(c, hidden=c["hidden"][:w].detach().requires_grad_(True),
                     **{k: c[k][:, :w] for k in ("labels", "mask", "adv", "old", "ref")},
                     P=0)
        small["mask"] = torch.ones_like(small["mask"])
        if name == "verl_fused":
            reason = _fused_reason(forward, small)
            if reason is not None:
                out["error"] = reason
                say(reason)
                queue.put(out)
                return
        t0 = time.perf_counter()
        forward(small).backward()
        c["hidden"].grad = c["weight"].grad = None
        say(f"warm-up at S={w}: {time.perf_counter() - t0:.2f} s")
        base = _reset_peak_kb()
        esz = c["hidden"].element_size()
        # the gradients of the step in the inputs' dtype: d hidden, and d weight unless it
        # goes straight into main_grad (gbc's default route; main_grad is an input)
        grads_mb = (c["hidden"].numel() + (name != "gbc") * c["weight"].numel()) * esz / 2 ** 20
        times, losses, fwd_mb = [], [], 0.0
        for i in range(args.reps + 1):          # step 0: the warm-up at the full shape
            c["hidden"].grad = c["weight"].grad = None       # zero_grad(set_to_none=True)
            c["weight"].main_grad.zero_()                     # DDP's zero_grad_buffer
            c["weight"].grad_added_to_main_grad = False
            dist.barrier()
            t0 = time.perf_counter()
            loss = forward(c)
            if i == 0:                          # later steps' peaks include a backward
                fwd_mb = (_peak_kb() - base) / 1024
            loss.backward()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            del loss
            say(f"step {i}{' (warm-up)' if i == 0 else ''}: {times[-1]:.3f} s, loss "
                f"{losses[-1]:.6f}, peak RSS +{(_peak_kb() - base) / 1024:.0f} MiB "
                f"(forward +{fwd_mb:.0f} MiB)")
        # the gradients count: they appear during the step (gbc's in its forward sweep, the
        # stock head's at the end of its backward, after its peak)
        out.update(peak_extra_mb=(_peak_kb() - base) / 1024, forward_peak_mb=fwd_mb,
                   grads_mb=grads_mb, median_s=statistics.median(times[1:]), loss=losses[0])
    except Exception as exc:                    # noqa: BLE001 -- reported in the row
        out["error"] = _error(exc)
        say(out["error"])
    queue.put(out)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _preload():
    """Import once in the parent what every rank needs; the ranks are forked from it (no
    thread pool or process group exists here yet), so each fresh pair starts in seconds."""
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    import megatron.core.tensor_parallel  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401  (verl's entropy compiles a reduction)
    import verl.trainer.ppo.core_algos  # noqa: F401
    import verl.utils.kernel.linear_cross_entropy  # noqa: F401
    import verl.workers.engine.megatron.transformer_impl  # noqa: F401
    import gbc_kernels.integrations.megatron  # noqa: F401
    import gbc_kernels.integrations.verl  # noqa: F401


def run_pair(name, args):
    """One provider in a fresh pair of processes: ``{rank: result}`` or an error string."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, name, args, queue)) for r in range(TP)]
    for p in procs:
        p.start()
    results = {}
    while len(results) < TP and any(p.is_alive() for p in procs) or not queue.empty():
        try:
            r = queue.get(timeout=1.0)
            results[r["rank"]] = r
        except Exception:                       # noqa: BLE001 -- queue.Empty: poll again
            pass
    for p in procs:
        p.join()
    if len(results) < TP:
        codes = [p.exitcode for p in procs]
        return f"a rank exited with codes {codes} (killed: out of memory?)"
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--S", type=int, default=4096, help="tokens per sequence (%(default)s)")
    ap.add_argument("--B", type=int, default=1, help="sequences per micro-batch (%(default)s)")
    ap.add_argument("--H", type=int, default=3584, help="hidden size (%(default)s)")
    ap.add_argument("--V", type=int, default=151936, help="padded vocabulary (%(default)s)")
    ap.add_argument("--response", type=int, default=None,
                    help="response tokens per sequence, the last ones (default: S/2)")
    ap.add_argument("--dtype", default="bfloat16,float32",
                    help="comma list of bfloat16/float32, one run each (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=3, help="timed steps after the warm-up step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--quick", action="store_true", help="S=256, B=2, H=256, V=8192, 2 reps")
    ap.add_argument("--force", action="store_true",
                    help="run even when the stock head's estimate exceeds MemAvailable")
    ap.add_argument("--out", default=os.path.join("runs", "bench", "megatron.csv"),
                    help="CSV to append to (default: %(default)s, untracked; "
                         "benchmarks/results/megatron.csv is the tracked result)")
    args = ap.parse_args()
    if args.quick:
        args.S, args.B, args.H, args.V, args.reps = 256, 2, 256, 8192, 2
    if args.V % TP:
        raise SystemExit(f"--V: expected a multiple of the tensor-parallel size {TP}, got "
                         f"{args.V}")
    args.response = args.S // 2 if args.response is None else args.response
    if not 0 < args.response < args.S:
        raise SystemExit(f"--response: expected 0 < response < S = {args.S}, got "
                         f"{args.response}")
    for d in args.dtype.split(","):
        if d not in ("bfloat16", "float32"):
            raise SystemExit(f"--dtype: expected bfloat16 and/or float32, got {d!r}")
    provs = args.providers.split(",")
    for p in provs:
        if p not in PROVIDERS:
            raise SystemExit(f"--providers: expected names from {PROVIDERS}, got {p!r}")

    os.environ["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    _preload()
    print(f"  imports: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    table = []
    for dtype in args.dtype.split(","):
        args.dtype = dtype
        table += run_shape(args, provs)
    print("\n| shape | provider | time (s) | peak beyond inputs (MiB) | x stock peak |\n"
          "|---|---|---|---|---|\n" + "\n".join(table))


def run_shape(args, provs):
    """Every provider at one shape and dtype: rows appended to --out, README rows returned."""
    import torch

    from _common import append_rows, now, proc_mb
    import gbc_kernels

    esz = getattr(torch, args.dtype).itemsize
    logits_mb = args.S * args.B * args.V // TP * 4 / 2 ** 20     # one float32 [S*B, V/2]
    need = TP * (6 * logits_mb + 2 * args.V // TP * args.H * esz / 2 ** 20 + 600)
    avail = proc_mb("/proc/meminfo", "MemAvailable", float("inf"))
    shape = f"V={args.V},H={args.H},S={args.S},B={args.B},R={args.response}"
    print(f"tensor parallel {TP} (gloo, 1 thread per rank), {shape}, {args.dtype}; one "
          f"float32 [S*B, V/2] = {logits_mb:.0f} MiB; stock head estimate {need:.0f} MiB for "
          f"both ranks, MemAvailable {avail:.0f} MiB", flush=True)
    if need > avail and not args.force and "verl_stock" in provs:
        raise SystemExit(f"the stock head would need about {need:.0f} MiB for {TP} ranks, "
                         f"{avail:.0f} MiB available: lower --S/--B, or pass --force")

    stamp, res = now(), {}
    for p in provs:
        print(f"  [{p}] a fresh pair of ranks", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        res[p] = run_pair(p, args)
        print(f"  [{p}] done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    def ok(p):
        r = res.get(p)
        return isinstance(r, dict) and all("error" not in v for v in r.values())

    stock = res["verl_stock"][0] if ok("verl_stock") else None
    rows, table = [], []
    for p in provs:
        r = res[p]
        row = dict(provider=p, shape=shape, dtype=args.dtype, tp=TP, threads_per_rank=1,
                   status="", median_s="", peak_extra_mb_rank0="", peak_extra_mb_max="",
                   forward_peak_mb_rank0="", grads_mb="", x_stock_peak="", x_stock_time="", loss="", reps=args.reps,
                   version=gbc_kernels.__version__, timestamp=stamp)
        if ok(p):
            r0 = r[0]
            row.update(status="ok", median_s=f"{r0['median_s']:.4f}",
                       peak_extra_mb_rank0=f"{r0['peak_extra_mb']:.1f}",
                       peak_extra_mb_max=f"{max(v['peak_extra_mb'] for v in r.values()):.1f}",
                       forward_peak_mb_rank0=f"{r0['forward_peak_mb']:.1f}",
                       grads_mb=f"{r0['grads_mb']:.1f}",
                       loss=f"{r0['loss']:.6f}")
            if stock is not None:
                row.update(x_stock_peak=f"{r0['peak_extra_mb'] / stock['peak_extra_mb']:.3f}",
                           x_stock_time=f"{r0['median_s'] / stock['median_s']:.3f}")
        else:
            errs = r if isinstance(r, str) else "; ".join(
                sorted({v["error"] for v in r.values() if "error" in v}))
            row["status"] = errs if errs.startswith("not run") else f"error: {errs}"
        rows.append(row)
        print(f"{p:>11} {row['status'][:60]:<6} t={row['median_s']:>8} s  peak+ rank0="
              f"{row['peak_extra_mb_rank0']:>8} MiB max={row['peak_extra_mb_max']:>8} MiB  "
              f"x stock peak={row['x_stock_peak']:>6} time={row['x_stock_time']:>6}  "
              f"loss={row['loss']}", flush=True)
        if row["status"] == "ok":
            table.append(f"| {shape}, {args.dtype} | {p} | {float(row['median_s']):.2f} | "
                         f"{float(row['peak_extra_mb_rank0']):.0f} | {row['x_stock_peak']} |")
        else:
            table.append(f"| {shape}, {args.dtype} | {p} | — | — | {row['status']} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    append_rows(args.out, rows)
    return table


if __name__ == "__main__":
    main()
