"""Precision of the LM head's log-probs: max and mean |logp - float64| on bf16 inputs.

Every provider gets the same bf16 hidden states and weight; the truth is float64 on those same
bf16 values (blocked over the vocabulary):

  gbc            gbc_kernels.fused_linear_logprobs, the default mode (chunk logits in bf16)
  gbc_f32        the same with logits_dtype=torch.float32 (docs/kernels.md, "Precision")
  eager_bf16     the trainers' eager head: (hidden @ weight.T) in bf16, then float32 log_softmax
  float32_head   the "float32 LM head" of TRL (cast_lm_head_to_fp32), torchtitan and NeMo-RL:
                 hidden and weight cast to float32, a float32 matmul, float32 logits
  skyrl          SkyRL's fused Triton head (CUDA only; --skyrl PATH or the installed skyrl)

gbc runs on each backend available here (cpu, torch; triton on CUDA). Prints the markdown table
of docs/kernels.md:

    python benchmarks/bench_precision.py                        # N=256 H=2048 V=32768, N=32 H=4096 V=151936
    python benchmarks/bench_precision.py --shapes 64x8192x151936
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def make(N, H, V, device, seed=0):
    """bf16 hidden states ~ N(0, 1) and a weight giving logits of std ~3 (a trained head's
    spread), drawn a block of rows at a time."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(torch.bfloat16)
    w = torch.empty(V, H, dtype=torch.bfloat16)
    for v0 in range(0, V, 8192):
        v1 = min(V, v0 + 8192)
        w[v0:v1] = (torch.randn(v1 - v0, H, generator=g) * (3 / math.sqrt(H))).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), generator=g)
    return h.to(device), w.to(device), y.to(device)


def truth(h, w, y, block=8192):
    h64 = h.double()
    lse = torch.stack([torch.logsumexp(h64 @ w[v0:v0 + block].double().T, -1)
                       for v0 in range(0, w.shape[0], block)]).logsumexp(0)
    return (h64 * w[y].double()).sum(-1) - lse


def providers(backends, skyrl_fn):
    import gbc_kernels as gbc

    out = {}
    for be in backends:
        out[f"gbc ({be})"] = lambda h, w, y, be=be: gbc.fused_linear_logprobs(h, w, y,
                                                                               backend=be)[0]
        out[f"gbc_f32 ({be})"] = lambda h, w, y, be=be: gbc.fused_linear_logprobs(
            h, w, y, backend=be, logits_dtype=torch.float32)[0]

    def eager(h, w, y):
        return torch.log_softmax((h @ w.T).float(), -1).gather(-1, y[:, None])[:, 0]

    def f32(h, w, y):
        return torch.log_softmax(h.float() @ w.float().T, -1).gather(-1, y[:, None])[:, 0]

    out["eager_bf16"], out["float32_head"] = eager, f32
    if skyrl_fn is not None:
        out["skyrl"] = lambda h, w, y: skyrl_fn.apply(h, w, y, 0, w.shape[0], 1024, None,
                                                      True).float()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="256x2048x32768,32x4096x151936",
                    help="comma list of NxHxV")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skyrl", default=os.environ.get("GBC_SKYRL_FUSED"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    from gbc_kernels.backends import cpu_available

    backends = (["triton", "torch"] if device.type == "cuda"
                else (["cpu"] if cpu_available() else []) + ["torch"])
    skyrl_fn = None
    if device.type == "cuda":
        from bench_long_context import load_skyrl
        skyrl_fn = load_skyrl(args.skyrl)
    rows = []
    for shape in args.shapes.split(","):
        N, H, V = (int(x) for x in shape.split("x"))
        h, w, y = make(N, H, V, device)
        t = truth(h, w, y)
        for name, fn in providers(backends, skyrl_fn).items():
            try:
                err = (fn(h, w, y).double() - t).abs()
                rows.append((shape, name, f"{err.max().item():.1e}", f"{err.mean().item():.1e}"))
            except Exception as exc:          # noqa: BLE001 - a provider that cannot run here
                rows.append((shape, name, f"not run ({type(exc).__name__})", ""))
            print(f"  {shape} {name}: {rows[-1][2]}", file=sys.stderr, flush=True)
        if skyrl_fn is None:
            rows.append((shape, "skyrl", "not run (needs CUDA)", ""))
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\nbf16 hidden and weight, |logp - float64 on the same bf16 values|, {dev}\n")
    print("| N x H x V | provider | max | mean |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
