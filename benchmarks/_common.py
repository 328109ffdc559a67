"""Shared pieces of the benchmarks: the setup of one GRPO-loss case, the providers, timing and
CSV rows. Each provider runs in a fresh process (see bench_cpu.py) so peak memory is clean."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import gbc_kernels as gbc

BETA, EPS = 0.04, 0.2


def setup_case(N, H, V, dtype, seed=0, T=512):
    """One GRPO batch of N completion tokens: B = N / T rows of T tokens, all masked in."""
    g = torch.Generator().manual_seed(seed)
    B = max(1, N // T)
    T = N // B
    hidden = (torch.randn(B, T, H, generator=g) * 0.5).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(dtype).requires_grad_(True)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    adv = torch.randn(B, generator=g)
    old = -torch.rand(B, T, generator=g) * 8
    ref = (old + 0.1 * torch.randn(B, T, generator=g)).clamp(max=0.0)   # log-probabilities
    return dict(hidden=hidden, weight=weight, targets=targets, mask=mask, adv=adv, old=old,
                ref=ref)


def plain_torch_loss(c):
    """The textbook way: full logits, log_softmax, then the loss on the log-probs."""
    logits = (c["hidden"] @ c["weight"].T).float()
    logp = torch.log_softmax(logits, -1).gather(-1, c["targets"].unsqueeze(-1)).squeeze(-1)
    return loss_from_logp(c, logp)


def float32_head_loss(c):
    """The "float32 LM head" as TRL (``cast_lm_head_to_fp32``), torchtitan and NeMo-RL compute
    it: hidden states and weight cast to float32, a float32 matmul, float32 ``[N, V]`` logits."""
    logits = c["hidden"].float() @ c["weight"].float().T
    logp = torch.log_softmax(logits, -1).gather(-1, c["targets"].unsqueeze(-1)).squeeze(-1)
    return loss_from_logp(c, logp)


def trl_chunked_loss(c):
    """What TRL 1.16's GRPOTrainer runs: its chunked log-prob kernel (log-probs and entropy, the
    logits recomputed in backward: four matmuls) through the fused LM head, then the loss."""
    from trl.kernels import ChunkedLogProbFunction
    x = c["hidden"].reshape(-1, c["hidden"].shape[-1])
    out = ChunkedLogProbFunction.apply(x, c["weight"], None, c["targets"].reshape(-1), 1.0,
                                       32768, None, 1.0, ("log_probs", "entropy"))
    return loss_from_logp(c, out[0].view_as(c["old"]))


def torch_lce_loss(c):
    """PyTorch 2.13's own chunked head: ``torch.nn.functional.linear_cross_entropy`` with
    ``reduction="none"`` and ``LinearCrossEntropyOptions()`` (chunked, logits recomputed in
    backward), its per-token cross-entropy negated into log-probs, then the loss."""
    import torch.nn.functional as F

    x = c["hidden"].reshape(-1, c["hidden"].shape[-1])
    ce = F.linear_cross_entropy(x, c["weight"], c["targets"].reshape(-1), reduction="none",
                                options=torch.nn.LinearCrossEntropyOptions())
    return loss_from_logp(c, -ce.float().view_as(c["old"]))


def liger_scaled_ce_loss(c):
    """Liger-Kernel 0.8.5's fused linear scaled cross-entropy (verl's default fused head): the
    per-token NLL from hidden states and the head, negated into log-probs, then the loss (its
    PyTorch fallback on CPU, its kernels on GPUs)."""
    from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction

    x = c["hidden"].reshape(-1, c["hidden"].shape[-1])
    nll = LigerFusedLinearScaledCrossEntropyFunction.apply(x, c["weight"],
                                                           c["targets"].reshape(-1), 1.0)
    return loss_from_logp(c, -nll.float().view_as(c["old"]))


# unsloth_zoo (issue 59): an optional peer, called and never copied (its metadata says LGPL-3.0-or-
# later, its source comments "All Unsloth Zoo code licensed under AGPL3"); not in requirements-dev.txt
# nor CI. bench_cpu.py lists these providers only where unsloth_zoo is installed.
UNSLOTH_PROVIDERS = ["unsloth_recompute", "unsloth_grpo", "unsloth_chunked"]

# The gbc options giving a provider's loss where it is not the base case's: bench_cpu.py's
# same-loss check holds the provider against gbc_cpu with these. Unsloth's grpo_compute_loss
# clamps the KL's log-ratio ref - logp to [-20, 20] and the k3 value to [-10, 10] (as verl's
# low_var_kl), which the benchmark's inputs reach (old/ref are not the model's log-probs).
REFERENCE_OPTIONS = {"unsloth_grpo": dict(kl_clamp=10.0, kl_log_ratio_clamp=20.0)}


def unsloth_rl():
    """``unsloth_zoo.rl_replacements``, or ImportError saying why not. unsloth_zoo's ``__init__``
    refuses to load without the ``unsloth`` package ("Please install Unsloth via `pip install
    unsloth`!") and, with it, without an accelerator; its own switch
    ``UNSLOTH_ZOO_DISABLE_GPU_INIT=1`` skips that device set-up (its ``DEVICE_TYPE`` is then
    "cpu"; its fused head still picks its Triton kernels on a CUDA tensor), which the head and
    loss functions do not need. Set here unless the caller set it."""
    import importlib.util

    if importlib.util.find_spec("unsloth_zoo") is None:
        raise ImportError("unsloth_zoo is not installed (optional peer: pip install --no-deps "
                          "unsloth_zoo)")
    os.environ.setdefault("UNSLOTH_ZOO_DISABLE_GPU_INIT", "1")
    import unsloth_zoo.rl_replacements as rl
    return rl


def _unsloth_chunks(rl, c):
    """The row chunks Unsloth's GRPO trainer asks for: rows x its autotuned multiplier
    (``autotune_batch_and_chunks``: max(4, T // 4096))."""
    B, T = c["targets"].shape
    V, H = c["weight"].shape
    dtype_bytes = 16 if c["hidden"].dtype in (torch.bfloat16, torch.float16) else 32
    _, multiplier = rl.autotune_batch_and_chunks(B, T, H, V, dtype_bytes)
    return B * multiplier


def unsloth_recompute_loss(c):
    """unsloth_zoo's plain-PyTorch chunked head with recompute:
    ``chunked_hidden_states_selective_log_softmax_recompute(..., fused_linear=False)`` keeps each
    row's logsumexp and recomputes the chunk's logits in backward (four matmuls), then the loss."""
    rl = unsloth_rl()
    logp = rl.chunked_hidden_states_selective_log_softmax_recompute(
        c["hidden"], c["weight"], c["targets"], _unsloth_chunks(rl, c), fused_linear=False)
    return loss_from_logp(c, logp.float())


def unsloth_chunked_loss(c):
    """unsloth_zoo's torch.compile'd chunked head without recompute:
    ``chunked_hidden_states_selective_log_softmax(..., fused_linear=False)`` (autograd keeps each
    chunk's logits for backward), then the loss."""
    rl = unsloth_rl()
    logp = rl.chunked_hidden_states_selective_log_softmax(
        c["hidden"], c["weight"], c["targets"], _unsloth_chunks(rl, c), fused_linear=False)
    return loss_from_logp(c, logp.float())


def unsloth_grpo_loss(c):
    """What Unsloth's ``grpo_accumulated_loss`` runs on the head's output by default: its scorer
    ``grpo_chunked_hidden_states_logprobs`` (the fused linear log-probs: Triton on CUDA, its
    PyTorch bodies elsewhere) and ``UnslothEfficientGRPO`` (``grpo_compute_loss`` under
    torch.compile, ``loss_type="bnpo"``: PPO clip + k3 KL, token-mean, the same loss)."""
    rl = unsloth_rl()
    logp = rl.grpo_chunked_hidden_states_logprobs(c["hidden"], c["weight"], c["targets"],
                                                  _unsloth_chunks(rl, c))
    opts = dict(loss_type="bnpo", epsilon_low=EPS, epsilon_high=EPS)
    out = rl.UnslothEfficientGRPO.apply(logp, c["old"], c["ref"], None, c["weight"],
                                        c["targets"], c["mask"], c["adv"], BETA, None, 1, opts,
                                        None)
    return out[0]


def loss_from_logp(c, logp):
    """Per-token PPO-clip + k3 KL, token-mean (TRL's bnpo)."""
    r = torch.exp(logp - c["old"])
    a = c["adv"].unsqueeze(-1)
    pg = torch.maximum(-a * r, -a * r.clamp(1 - EPS, 1 + EPS))
    d = c["ref"] - logp
    per_tok = pg + BETA * (torch.exp(d) - d - 1)
    m = c["mask"].float()
    return (per_tok * m).sum() / m.sum().clamp(min=1)


# The objectives of docs/math.md §10 as bench_cpu.py --objectives runs them ("gbc_cpu@NAME"); every
# one with the k3 KL of the base case. "ppo" is the token-level PPO loss they are compared to.
OBJECTIVES = {
    "ppo": dict(),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "sapo": dict(loss_type="sapo"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
    "delta": dict(loss_type="dapo", delta=1.5),
    "off_policy_mask": dict(loss_type="dapo", off_policy_mask_threshold=0.5),
    "entropy_bonus_trl": dict(loss_type="grpo", entropy_coef=0.01),
    "entropy_quantile": dict(loss_type="dapo", top_entropy_quantile=0.2),
    # docs/math.md §12: verl's registered losses as presets, and the KL forms
    "verl_vanilla": dict(loss_type="verl:vanilla"),
    "dppo_tv": dict(loss_type="verl:dppo_tv"),
    "dppo_kl": dict(loss_type="verl:dppo_kl"),
    "gspo_token": dict(loss_type="verl:gspo"),
    "cispo_two_sided": dict(loss_type="verl:cispo", epsilon_high=1.2, cispo_min=0.8),
    "gpg": dict(loss_type="verl:gpg"),
    "dro": dict(loss_type="verl:dro", log_ratio_penalty=0.1),
    "gmpo": dict(loss_type="verl:geo_mean"),
    "kl_k3_straight_through": dict(kl_estimator="low_var_kl+"),
    "kl_unbiased_clamped": dict(kl_clamp=10.0, kl_unbiased_gradient=True),
    "clip_cov": dict(loss_type="verl:clip_cov", cov_ratio=0.002),
    "kl_cov": dict(loss_type="verl:kl_cov", cov_ratio=0.002),
}
# batch-global objectives (a statistics sweep, four matmuls): compared at 1.45x, others 1.10x
BATCH_GLOBAL = ("entropy_quantile", "clip_cov", "kl_cov")


def objective_config(name):
    o = dict(OBJECTIVES[name])
    lt = o.pop("loss_type", "bnpo")
    kw = dict(epsilon_low=EPS, epsilon_high=EPS, kl_coef=BETA, kl_estimator="k3")
    kw.update(o)
    return gbc.PolicyLossConfig.preset(lt, **kw)


def _backward(loss):
    loss.backward()
    return loss.detach()


def make_provider(name, c, logits_dtype=None, **options):
    """A closure running forward+backward of one provider on case ``c`` and returning the loss
    (detached; ``None`` for the floor). ``logits_dtype``: the gbc providers' (``gbc_cpu_f32`` /
    ``gbc_torch_f32``: float32 whatever it says; ``gbc_cpu_in`` / ``gbc_torch_in``: ``"input"``,
    the operands' dtype); ``options``: more of the gbc providers'
    ``PolicyLossConfig`` fields (``REFERENCE_OPTIONS``)."""
    if name.endswith("_f32") and name.startswith("gbc_"):
        name, logits_dtype = name[:-4], torch.float32
    if name.endswith("_in") and name.startswith("gbc_"):    # the operands' dtype mode
        name, logits_dtype = name[:-3], "input"
    cfg = gbc.PolicyLossConfig(epsilon_low=EPS, epsilon_high=EPS, kl_coef=BETA,
                               kl_estimator="k3", loss_agg="token-mean",
                               logits_dtype=logits_dtype, **options)
    if "@" in name:                       # gbc_cpu@gspo: an objective of docs/math.md §10
        name, objective = name.split("@")
        cfg = objective_config(objective)
        cfg = dataclasses.replace(cfg, logits_dtype=logits_dtype)
    if name in ("floor", "floor_f32"):
        x = c["hidden"].detach().reshape(-1, c["hidden"].shape[-1])
        w = c["weight"].detach()
        if name == "floor_f32":           # the same matmuls on float32 copies (made here, untimed)
            x, w = x.float(), w.float()

        def run():
            z = x @ w.T           # logits
            z @ w                 # grad hidden
            z.T @ x               # grad weight
        return run
    if name in ("gbc_cpu", "gbc_torch"):
        backend = name.split("_")[1]

        def run():
            loss, _ = gbc.fused_linear_policy_loss(c["hidden"], c["weight"], c["targets"],
                                                   c["mask"], c["adv"], c["old"], c["ref"],
                                                   config=cfg, backend=backend)
            return _backward(loss)
        return run
    if name == "plain_torch":
        return lambda: _backward(plain_torch_loss(c))
    if name == "float32_head":
        return lambda: _backward(float32_head_loss(c))
    if name == "trl_chunked":
        return lambda: _backward(trl_chunked_loss(c))
    if name == "torch_lce":
        return lambda: _backward(torch_lce_loss(c))
    if name == "liger_scaled_ce":
        return lambda: _backward(liger_scaled_ce_loss(c))
    if name.startswith("liger"):
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        mod = LigerFusedLinearGRPOLoss(beta=BETA, compiled=name == "liger_compiled",
                                       use_ref_model=True, epsilon_low=EPS, epsilon_high=EPS,
                                       loss_type="bnpo")

        def run():
            out = mod(c["hidden"], c["weight"], c["targets"], c["mask"].long(), c["adv"],
                      ref_per_token_logps=c["ref"], old_per_token_logps=c["old"])
            return _backward(out[0] if isinstance(out, tuple) else out)
        return run
    if name in UNSLOTH_PROVIDERS:
        fn = dict(unsloth_recompute=unsloth_recompute_loss, unsloth_grpo=unsloth_grpo_loss,
                  unsloth_chunked=unsloth_chunked_loss)[name]
        unsloth_rl()            # not installed: ImportError here, an error row in the benchmark
        return lambda: _backward(fn(c))
    raise ValueError(f"unknown provider {name!r}")


def time_it(fn, reps, warmup=1):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    q = statistics.quantiles(ts, n=5) if len(ts) >= 2 else [ts[0]] * 4
    return statistics.median(ts), q[0], q[3]


def cuda_peak_bytes(fn, c):
    """Peak CUDA memory of one call of ``fn`` beyond what is allocated before it, starting from
    no gradients on ``c``'s hidden and weight (the gradients count as working memory). Measured
    apart from ``triton.testing.do_bench``, whose cache-flush buffer would count."""
    c["hidden"].grad = c["weight"].grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def append_rows(path, rows):
    """Append ``rows`` (dicts) to the CSV at ``path``; columns new to the file are added (the
    earlier rows get them empty)."""
    fields = list(rows[0].keys())
    if os.path.exists(path):
        with open(path, newline="") as f:
            old = list(csv.DictReader(f))
            f.seek(0)
            head = next(csv.reader(f), [])
        if head and set(fields) - set(head):
            head += [k for k in fields if k not in head]
            with open(path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=head)
                w.writeheader()
                w.writerows(old)
        fields = head or fields
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        if new:
            w.writeheader()
        w.writerows(rows)


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def proc_mb(path: str, key: str, default: float = 0.0) -> float:
    """A ``kB`` field of a /proc file in MiB (``default`` where there is none)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return default


def rss_mb() -> float:
    """This process's resident set size now (MiB), from /proc (0 where there is none)."""
    return proc_mb("/proc/self/status", "VmRSS")


def run_child(cmd, threads: int):
    """Run a benchmark's child process ``cmd`` with ``threads`` OpenMP threads; relay its
    progress lines (stderr lines starting with two spaces) and return the JSON of its last
    stdout line. A failed child stops the benchmark with the tail of its stderr."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    sys.stderr.write("".join(l + "\n" for l in out.stderr.splitlines() if l.startswith("  ")))
    if out.returncode != 0:
        raise SystemExit(f"child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- one trainer step, two providers: the pieces bench_openrlhf.py and bench_skyrl.py run
def step_parser(doc, **defaults):
    """The arguments of a one-step benchmark: the child modes, ``--provider`` and the case
    (``--B --P --T --H --V --threads --reps``; ``defaults`` override or add integers)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child-time", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-memory", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--provider", default="gbc")
    case = dict(B=4, P=64, T=192, H=64, V=151936, threads=2, reps=5, **defaults)
    for name, value in case.items():
        ap.add_argument(f"--{name}", type=int, default=value)
    ap.case_names = tuple(case)
    return ap


def step_child(script, mode, a, names, extra=()):
    """Run ``script`` as the ``mode`` child ("time" / "memory") with the case arguments
    ``names`` of ``a``; returns its JSON."""
    cmd = [sys.executable, script, f"--child-{mode}"]
    for name in names:
        cmd += [f"--{name}", str(getattr(a, name))]
    return run_child(cmd + list(extra), a.threads)


def step_peak_mb(step) -> dict:
    """Peak RSS of one ``step()`` beyond the RSS before it, after a warm-up step (MiB)."""
    import resource

    step()
    base = rss_mb()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mb": max(peak, before) - base, "step_peak_mb": peak - base}


def interleaved_medians(steps: dict, reps: int) -> dict:
    """``{name: median seconds}`` of each ``steps[name]()``: one warm-up each, then ``reps``
    rounds with the providers interleaved (progress on stderr)."""
    for name, step in steps.items():
        step()
        print(f"  warm-up {name} done", file=sys.stderr, flush=True)
    times = {name: [] for name in steps}
    for r in range(reps):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
        print(f"  round {r + 1}/{reps}: " + ", ".join(f"{n} {t[-1]:.3f} s"
                                                    for n, t in times.items()),
              file=sys.stderr, flush=True)
    return {name: statistics.median(t) for name, t in times.items()}


def write_step_table(out, rows, base, reps, logits_label):
    """Write one-step benchmark ``rows`` (dicts with ``path``, ``time_s``, ``time_x_<base>``,
    ``peak_mib``, ``peak_x_<base>``, ``peak_x_micro_logits``) to the CSV ``out`` and print them
    as a markdown table (``base``: the trainer's own path, the ratios' denominator)."""
    import csv

    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    key = base.split()[0].lower()
    print(f"| path | time (s), median of {reps} | × {base} | peak memory beyond the inputs "
          f"(MiB) | × {base} | × {logits_label} |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['time_s']:.3f} | {r[f'time_x_{key}']:.2f} | "
              f"{r['peak_mib']:.0f} | {r[f'peak_x_{key}']:.2f} | {r['peak_x_micro_logits']:.2f} |")
    print(f"wrote {out}")
