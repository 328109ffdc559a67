"""Cost of NTHR next to one fused loss forward+backward on the same batch (CPU).

G = 8 responses x 512 tokens of one group (4 correct), H = 1024, V in {32768, 131072}; tokens
drawn from a 2,000-token sub-vocabulary (responses to one prompt share most of their tokens).
NTHR takes the LSE from the old-policy pass (``logp=``), as the recipe does.

    python benchmarks/bench_nthr.py

Prints the time ratio (both timed interleaved in one process) and NTHR's peak memory beyond its
inputs (in a fresh process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(what, V):
    import torch
    torch.set_num_threads(2)
    import gbc_kernels as gbc
    sys.path.insert(0, HERE)
    from bench_cpu import _peak_kb, _reset_peak_kb

    g = torch.Generator().manual_seed(0)
    B, T, H = 8, 512, 1024
    h = (torch.randn(B, T, H, generator=g) * 0.5).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) / H ** 0.5).requires_grad_(True)
    sub = torch.randperm(V, generator=g)[:2000]
    y = sub[torch.randint(0, 2000, (B, T), generator=g)]
    m = torch.ones(B, T, dtype=torch.bool)
    gid = torch.zeros(B, dtype=torch.long)
    correct = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0]).bool()
    adv = gbc.group_advantages(correct.float(), gid)
    logp = gbc.token_stats(h, w, y).logp

    def nthr():
        gbc.nthr_scale(h, w, y, m, gid, correct, logp=logp)

    def loss():
        l, _ = gbc.fused_linear_policy_loss(h, w, y, m, adv, logp)
        l.backward()
        h.grad = w.grad = None

    if what == "time":      # both, interleaved in one process: drift hits both alike
        ts = {"loss": [], "nthr": []}
        loss(), nthr()
        for _ in range(5):
            for name, fn in (("loss", loss), ("nthr", nthr)):
                t0 = time.perf_counter()
                fn()
                ts[name].append(time.perf_counter() - t0)
        print(json.dumps({k: sorted(v)[2] for k, v in ts.items()}))
        return
    fn = nthr if what == "nthr" else loss
    base = _reset_peak_kb()        # first call: the heap has not cached anything yet
    fn()
    print(json.dumps(dict(peak_extra_mb=(_peak_kb() - base) / 1024)))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], int(sys.argv[3]))
    for V in (32768, 131072):
        res = {}
        for what in ("time", "nthr"):
            r = subprocess.run([sys.executable, __file__, "--child", what, str(V)],
                               capture_output=True, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="2"))
            res[what] = json.loads(r.stdout.strip().splitlines()[-1])
        t = res["time"]
        logits_mb = 8 * 512 * V * 4 / 2 ** 20
        print(f"V={V}: fused loss fwd+bwd {t['loss']:.3f}s, NTHR {t['nthr']:.3f}s = "
              f"{t['nthr'] / t['loss']:.3f} of it (medians of 5, interleaved); NTHR peak beyond "
              f"inputs {res['nthr']['peak_extra_mb']:.1f} MiB = "
              f"{res['nthr']['peak_extra_mb'] / logits_mb:.4f} of one fp32 [N,V] logits")


if __name__ == "__main__":
    main()
