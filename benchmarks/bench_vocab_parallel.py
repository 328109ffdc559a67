"""Vocab parallel against one device, on CPU (forward + backward of the fused GRPO loss).

    python benchmarks/bench_vocab_parallel.py [--N 1024 --H 512 --V 32768] [--reps 7]

1. One process, interleaved: the one-device fused loss and the same loss over a one-rank
   vocab-parallel group (the whole lm_head as the rank's slice), alternating rep by rep so that
   both see the same machine state. The ratio is the cost of vocab parallelism itself: the
   per-chunk all_gather of the row statistics, the target-id translation, the hidden-gradient
   all_reduce (goal: <= 1.15x).
2. Two ranks on this machine (gloo, one thread each), each holding half the vocabulary: the
   time per step of rank 0, beside one device on one thread.

Prints a line per measurement as it goes and writes a CSV (default: runs/bench/, untracked;
pass --out benchmarks/results/vocab_parallel.csv to regenerate the tracked reference).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _case(N, H, V, seed=0):
    from _common import setup_case
    return setup_case(N, H, V, torch.float32, seed=seed)


def _step(c, vp=None, w=None, b=None, backend="cpu"):
    import gbc_kernels as gbc
    cfg = gbc.PolicyLossConfig(kl_coef=0.04)
    h = c["hidden"].detach().requires_grad_(True)
    w = (c["weight"] if w is None else w).detach().requires_grad_(True)
    loss, _ = gbc.fused_linear_policy_loss(h, w, c["targets"], c["mask"], c["adv"], c["old"],
                                           c["ref"], config=cfg, backend=backend,
                                           vocab_parallel=vp)
    loss.backward()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, args, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import gbc_kernels as gbc
    c = _case(args.N, args.H, args.V)
    lo, hi = rank * args.V // world, (rank + 1) * args.V // world
    vp = gbc.VocabParallel(None, lo, hi)
    w = c["weight"][lo:hi]
    times = []
    _step(c, vp, w, backend=args.backend)
    for _ in range(args.reps):
        dist.barrier()
        t0 = time.perf_counter()
        _step(c, vp, w, backend=args.backend)
        times.append(time.perf_counter() - t0)
    q.put((rank, statistics.median(times)))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--N", type=int, default=1024, help="tokens (default: %(default)s)")
    ap.add_argument("--H", type=int, default=512, help="hidden size (default: %(default)s)")
    ap.add_argument("--V", type=int, default=32768, help="vocabulary (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=7, help="timed reps (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="threads, part 1 (default: %(default)s)")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "torch"],
                    help="gbc backend (default: %(default)s)")
    ap.add_argument("--out", default=os.path.join("runs", "bench", "vocab_parallel.csv"),
                    help="CSV to append to (default: %(default)s)")
    args = ap.parse_args()
    from _common import append_rows, now, time_it
    import gbc_kernels as gbc

    torch.set_num_threads(args.threads)
    stamp, rows = now(), []
    shape = f"N={args.N},H={args.H},V={args.V}"
    c = _case(args.N, args.H, args.V)

    # 1. one rank, interleaved with one device
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    vp = gbc.VocabParallel(None, 0, args.V)
    one, par = [], []
    _step(c, backend=args.backend)
    _step(c, vp, backend=args.backend)
    for i in range(args.reps):
        one.append(time_it(lambda: _step(c, backend=args.backend), 1, warmup=0)[0])
        par.append(time_it(lambda: _step(c, vp, backend=args.backend), 1, warmup=0)[0])
        print(f"  rep {i + 1}/{args.reps}: one device {one[-1]:.3f} s, one-rank vocab "
              f"parallel {par[-1]:.3f} s", flush=True)
    dist.destroy_process_group()
    t1, tp = statistics.median(one), statistics.median(par)
    print(f"{shape} {args.backend} {args.threads} threads: one device {t1:.3f} s, vocab "
          f"parallel on one rank {tp:.3f} s = {tp / t1:.3f}x", flush=True)
    rows.append(dict(case="one_device", shape=shape, backend=args.backend, threads=args.threads,
                     median_s=f"{t1:.4f}", ratio="1.000", timestamp=stamp))
    rows.append(dict(case="vp_one_rank", shape=shape, backend=args.backend,
                     threads=args.threads, median_s=f"{tp:.4f}", ratio=f"{tp / t1:.3f}",
                     timestamp=stamp))

    # 2. two ranks, one thread each, beside one device on one thread
    torch.set_num_threads(1)
    t_one1 = time_it(lambda: _step(c, backend=args.backend), args.reps)[0]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    t2 = got[0]
    print(f"{shape} {args.backend}: one device on 1 thread {t_one1:.3f} s, two ranks (half the "
          f"vocabulary each, 1 thread each) {t2:.3f} s = {t2 / t_one1:.3f}x", flush=True)
    rows.append(dict(case="one_device_1_thread", shape=shape, backend=args.backend, threads=1,
                     median_s=f"{t_one1:.4f}", ratio="1.000", timestamp=stamp))
    rows.append(dict(case="vp_two_ranks", shape=shape, backend=args.backend, threads=1,
                     median_s=f"{t2:.4f}", ratio=f"{t2 / t_one1:.3f}", timestamp=stamp))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    append_rows(args.out, rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
