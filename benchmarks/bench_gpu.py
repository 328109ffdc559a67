"""GPU benchmark of the fused GRPO loss (forward + backward), ready for the day a GPU is at hand.

Providers on the same inputs (bf16 by default):
  floor           cuBLAS alone: the three matmuls (logits, grad-hidden, grad-weight)
  gbc_triton      gbc_kernels, backend="triton"
  liger_chunked   Liger-Kernel LigerFusedLinearGRPOLoss (chunked, torch.compile'd)
  liger_triton    Liger's Triton grpo_loss given materialised logits (+ the lm_head matmul)
  plain_torch     full logits + log_softmax + autograd (the textbook way)
  trl_chunked     TRL 1.16 GRPOTrainer's chunked log-prob kernel (logits recomputed in backward)
  torch_lce       PyTorch 2.13's linear_cross_entropy (reduction="none", chunked options)
  liger_scaled_ce Liger's fused linear scaled cross-entropy (verl's default fused head)
  verl_fused      verl 0.9.1's fused head (verl/utils/kernel/linear_cross_entropy.py)
  quack_lce       quack's chunked linear cross-entropy, where it installs
  unsloth_recompute  unsloth_zoo's chunked head with recompute (fused_linear=False), where installed
  unsloth_grpo    unsloth_zoo's GRPO scorer + UnslothEfficientGRPO (its KL clamps), where installed
  (each baseline with the same loss on top of its per-token log-probs)
Shapes: Qwen2.5-7B (H=3584, V=151936) and Llama-3-8B (H=4096, V=128256), N in {4096, 8192}.

    python benchmarks/bench_gpu.py [--N 4096,8192] [--dtype bfloat16]

Time by triton.testing.do_bench (median, p20, p80 over 1.5 s of repetitions); memory by
torch.cuda.max_memory_allocated beyond the inputs, also as a multiple of one fp32 [N, V] logits.
Prints a line per provider; appends to runs/bench/gpu.csv (--out benchmarks/results/gpu.csv
regenerates the tracked reference). See docs/kernels.md for the byte and
FLOP counts and the H100 roofline these numbers should be judged against.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SHAPES = {"qwen2.5-7b": (3584, 151936), "llama3-8b": (4096, 128256)}


def _missing(exc):
    raise exc


def providers(c):
    from _common import make_provider, BETA, EPS
    import gbc_kernels as gbc

    cfg = gbc.PolicyLossConfig(epsilon_low=EPS, epsilon_high=EPS, kl_coef=BETA)
    out = {"floor": make_provider("floor", c), "plain_torch": make_provider("plain_torch", c)}

    def ours():
        loss, _ = gbc.fused_linear_policy_loss(c["hidden"], c["weight"], c["targets"], c["mask"],
                                               c["adv"], c["old"], c["ref"], config=cfg,
                                               backend="triton")
        loss.backward()
    out["gbc_triton"] = ours
    cfg32 = dataclasses.replace(cfg, logits_dtype=torch.float32)

    def ours_f32():       # float32 logits mode (docs/kernels.md, "Precision")
        loss, _ = gbc.fused_linear_policy_loss(c["hidden"], c["weight"], c["targets"], c["mask"],
                                               c["adv"], c["old"], c["ref"], config=cfg32,
                                               backend="triton")
        loss.backward()
    out["gbc_triton_f32"] = ours_f32
    out["float32_head"] = make_provider("float32_head", c)   # TRL's cast_lm_head_to_fp32 way
    # a baseline whose package is not installed gets an error row, not a crash
    for key, name in (("liger_chunked", "liger_compiled"), ("trl_chunked", "trl_chunked"),
                      ("unsloth_recompute", "unsloth_recompute"),    # optional: _common.unsloth_rl
                      ("unsloth_grpo", "unsloth_grpo")):
        try:
            out[key] = make_provider(name, c)
        except ImportError as exc:
            out[key] = functools.partial(_missing, exc)

    def liger_triton():
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
        logits = c["hidden"] @ c["weight"].T
        # Liger's kernel expects logits for T+1 positions; pad one row as it does in TRL
        logits = torch.cat([logits, logits[:, -1:]], dim=1)
        out = triton_grpo_loss(logits, c["old"], c["ref"], c["targets"], c["adv"],
                               c["mask"].int(), temperature=1.0, beta=BETA, eps_low=EPS,
                               eps_high=EPS, inplace=True, loss_type="bnpo", reduce=True)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
    out["liger_triton"] = liger_triton
    out["torch_lce"] = make_provider("torch_lce", c)
    out["liger_scaled_ce"] = make_provider("liger_scaled_ce", c)

    def verl_fused():
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
        from _common import loss_from_logp
        x = c["hidden"].reshape(-1, c["hidden"].shape[-1])
        logp, _ = linear_cross_entropy(x, c["weight"], c["targets"].reshape(-1), 1.0, "none")
        loss_from_logp(c, logp.float().view_as(c["old"])).backward()
    out["verl_fused"] = verl_fused

    def quack_lce():
        from quack.linear_cross_entropy import chunked_linear_cross_entropy   # optional
        from _common import loss_from_logp
        x = c["hidden"].reshape(-1, c["hidden"].shape[-1])
        ce = chunked_linear_cross_entropy(x, c["weight"], c["targets"].reshape(-1),
                                          reduction="none")
        loss_from_logp(c, -ce.float().view_as(c["old"])).backward()
    out["quack_lce"] = quack_lce
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--N", default="4096,8192")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=os.path.join("runs", "bench", "gpu.csv"),
                    help="CSV to append to (default: %(default)s, untracked; "
                         "benchmarks/results/gpu.csv regenerates the tracked reference)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA device here; nothing to measure")
        return 0
    import triton.testing
    from _common import append_rows, cuda_peak_bytes, now, setup_case
    import gbc_kernels

    stamp, dev = now(), torch.cuda.get_device_name()
    for name, (H, V) in SHAPES.items():
        for N in (int(x) for x in args.N.split(",")):
            c = setup_case(N, H, V, getattr(torch, args.dtype))
            c = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in c.items()}
            c["hidden"] = c["hidden"].detach().requires_grad_(True)
            c["weight"] = c["weight"].detach().requires_grad_(True)
            rows, floor = [], None
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            for prov, fn in providers(c).items():
                try:
                    fn()
                    ms = triton.testing.do_bench(fn, warmup=100, rep=1500,
                                                 quantiles=[0.5, 0.2, 0.8],
                                                 grad_to_none=[c["hidden"], c["weight"]])
                    peak = cuda_peak_bytes(fn, c) / 2 ** 20
                    floor = ms[0] if prov == "floor" else floor
                    status = "ok"
                except Exception as exc:
                    ms, peak, status = [float("nan")] * 3, float("nan"), f"error: {exc}"[:120]
                rows.append(dict(provider=prov, mode="fwd+bwd", shape=f"{name},N={N}",
                                 dtype=args.dtype, device=dev, status=status,
                                 median_ms=f"{ms[0]:.3f}", p20_ms=f"{ms[1]:.3f}",
                                 p80_ms=f"{ms[2]:.3f}", peak_extra_mb=f"{peak:.0f}",
                                 peak_over_logits=f"{peak * 2 ** 20 / (N * V * 4):.3f}",
                                 ratio_to_floor=f"{ms[0] / floor:.3f}" if floor else "",
                                 version=gbc_kernels.__version__, timestamp=stamp))
                print(rows[-1], flush=True)
            append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
