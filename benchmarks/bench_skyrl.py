"""One SkyRL 0.3.0 policy step with a real vocabulary: SkyRL's own FSDP policy worker
(``forward_backward``: logits, ``logprobs_from_logits``, ``chunked_entropy_from_logits``, its
registered loss, KL and entropy terms) against the same worker with gbc's micro-step
(``gbc_kernels.integrations.skyrl``: the fused loss through the lm_head, no logits). CPU, one
data-parallel rank (gloo), a tiny Qwen2 with Qwen2.5's vocabulary (V = 151,936) and a small
hidden size, so the head dominates as it does at scale.

    python benchmarks/bench_skyrl.py        # B=4, prompt 64 + response 192, H=64, 2 micro-batches

Time: both workers in one process, forward_backward of the whole batch, repetitions
interleaved (median). Memory: each in a fresh process, peak RSS during one step beyond the RSS
before it. Writes benchmarks/results/skyrl.csv and prints a markdown table.
"""

from __future__ import annotations

import importlib.util
import json
import os

from _common import (interleaved_medians, step_child, step_parser,  # noqa: E402
                     step_peak_mb, write_step_table)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "skyrl.csv")


def _standin():
    spec = importlib.util.spec_from_file_location(
        "skyrl_cpu", os.path.join(ROOT, "tests", "standins", "skyrl_cpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _setup(a):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(a.threads)
    sc = _standin()
    sc.load()
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase
    from skyrl.train.config.config import AlgorithmConfig
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gbc_kernels.integrations.skyrl.fsdp import GBCFSDPPolicyWorker

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=a.V, hidden_size=a.H, intermediate_size=2 * a.H,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).float()
    algo = AlgorithmConfig(policy_loss_type="regular", use_kl_loss=True, kl_loss_coef=0.01,
                           use_entropy_loss=True, entropy_loss_coef=0.001)
    workers = {"skyrl": sc.policy_worker(FSDPPolicyWorkerBase, algo, model, micro=a.micro,
                                         lr=0.0, temperature=1.0),
               "gbc": sc.policy_worker(GBCFSDPPolicyWorker, algo, model, micro=a.micro, lr=0.0,
                                       temperature=1.0)}
    B, P, T = a.B, a.P, a.T
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(1, a.V, (B, P + T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    old = -torch.rand(B, T, generator=g) * 3
    adv = torch.randn(B, 1, generator=g).expand(B, T) / (B * T)      # token_mean, pre-scaled
    batch = TrainingInputBatch({"sequences": seq, "attention_mask": torch.ones_like(seq),
                                "response_mask": mask, "loss_mask": mask,
                                "advantages": adv.contiguous(), "action_log_probs": old,
                                "base_action_log_probs": old - 0.1, "rollout_logprobs": None})
    batch.metadata = {"response_length": T}
    return sc, workers, batch


def _step(sc, worker, batch):
    with sc.cpu_device():
        worker.forward_backward(batch)
    worker.optimizer.zero_grad(set_to_none=True)


def child_memory(a):
    sc, workers, batch = _setup(a)
    print(json.dumps(step_peak_mb(lambda: _step(sc, workers[a.provider], batch))))


def child_time(a):
    sc, workers, batch = _setup(a)
    print(json.dumps(interleaved_medians(
        {p: (lambda w=workers[p]: _step(sc, w, batch)) for p in ("skyrl", "gbc")}, a.reps)))


def main():
    ap = step_parser(__doc__, micro=2)
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    if a.child_time:
        return child_time(a)
    if a.child_memory:
        return child_memory(a)
    N = a.micro * (a.P + a.T)
    print(f"one SkyRL policy step: B={a.B} in micro-batches of {a.micro}, prompt {a.P} + "
          f"response {a.T}, H={a.H}, V={a.V}, fp32, {a.threads} threads", flush=True)
    times = step_child(__file__, "time", a, ap.case_names)
    mem = {p: step_child(__file__, "memory", a, ap.case_names, ["--provider", p])
           for p in ("skyrl", "gbc")}
    logits_mb = N * a.V * 4 / 2 ** 20
    rows = []
    for p, name in (("skyrl", "SkyRL 0.3.0 FSDP worker (logits)"),
                    ("gbc", "gbc fused in SkyRL's worker")):
        rows.append({"path": name, "B": a.B, "micro": a.micro, "P": a.P, "T": a.T, "H": a.H,
                     "V": a.V, "threads": a.threads, "time_s": round(times[p], 4),
                     "time_x_skyrl": round(times[p] / times["skyrl"], 3),
                     "peak_mib": round(mem[p]["step_peak_mb"], 1),
                     "peak_x_skyrl": round(mem[p]["step_peak_mb"]
                                           / mem["skyrl"]["step_peak_mb"], 3),
                     "peak_x_micro_logits": round(mem[p]["step_peak_mb"] / logits_mb, 3)})
    write_step_table(a.out, rows, "SkyRL", a.reps,
                     f"one micro-batch's fp32 [N, V] ({logits_mb:.0f} MiB)")


if __name__ == "__main__":
    main()
