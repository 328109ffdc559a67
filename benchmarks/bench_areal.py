"""One AReaL 1.0.4 actor update with a real vocabulary: AReaL's own FSDP PPO actor
(``FSDPPPOActor.ppo_update``: ``[N, V]`` logits per packed micro-batch, its float32
``gather_logprobs_entropy``, ``grpo_loss_fn``) against gbc's
(``gbc_kernels.integrations.areal.GBCFSDPPPOActor``: the log-probs and entropy from the hidden
states and the lm_head, AReaL's own loss on them). CPU, one rank (gloo, FSDP2,
``attn_impl="sdpa"``), a tiny Qwen2 with Qwen2.5's vocabulary (V = 151,936) and a small hidden
size, so the head dominates as it does at scale; the decoupled loss with rejection sampling,
float32.

Run it where AReaL is installed (``make compat ONLY=areal`` builds that venv; docs/areal.md):

    ~/.cache/gbc_compat/venvs/areal-1.0.4-*/bin/python benchmarks/bench_areal.py

Time: both actors in one process, ``ppo_update`` of the same batch (B trajectories of prompt P
+ response T, 2 micro-batches), repetitions interleaved (median; lr 0, so every repetition
sees the same parameters). Memory: each in a fresh process, peak RSS during one update beyond
the RSS before it. AReaL wraps its log-prob gather in ``torch.compile``; on this CPU it runs
eager (``TORCHDYNAMO_DISABLE=1``: inductor's C++ build takes minutes here). Writes
benchmarks/results/areal.csv and prints a markdown table.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from _common import (interleaved_medians, step_child, step_parser,  # noqa: E402
                     step_peak_mb, write_step_table)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "areal.csv")


def _setup(a, providers):
    import torch
    import torch.distributed as dist
    from areal.api.cli_args import (MicroBatchSpec, NormConfig, OptimizerConfig,
                                    PPOActorConfig, RejectionSamplingConfig)
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPPPOActor
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    torch.set_num_threads(a.threads)
    tmp = tempfile.mkdtemp(prefix="bench_areal_")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
    vocab = {f"t{i}": i for i in range(a.V - 2)}
    vocab["<pad>"], vocab["<eos>"] = a.V - 2, a.V - 1
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                            pad_token="<pad>", eos_token="<eos>").save_pretrained(tmp)
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=a.V, hidden_size=a.H, intermediate_size=2 * a.H,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, tie_word_embeddings=False,
                                 eos_token_id=a.V - 1, pad_token_id=a.V - 2)).save_pretrained(tmp)
    cfg = dict(experiment_name="bench", trial_name="t0", path=tmp, attn_impl="sdpa",
               dtype="float32", optimizer_dtype="float32", backend="fsdp:d1",
               optimizer=OptimizerConfig(type="sgd", lr=0.0, weight_decay=0.0,
                                         lr_scheduler_type="constant"),
               mb_spec=MicroBatchSpec(n_mbs=2), ppo_n_minibatches=1, kl_ctl=0.0,
               use_decoupled_loss=True,
               rejection_sampling=RejectionSamplingConfig(level="token", action="clamp",
                                                          metric="ratio", upper=2.0),
               reward_norm=NormConfig(mean_level="group", std_level="group", group_size=a.B))
    classes = {"areal": FSDPPPOActor, "gbc": GBCFSDPPPOActor}
    g = torch.Generator().manual_seed(1)
    batch = []
    for i in range(a.B):
        L = a.P + a.T
        lp = torch.zeros(L)
        lp[a.P:] = torch.randn(a.T, generator=g) - 12.0
        batch.append({k: v.unsqueeze(0) for k, v in dict(
            input_ids=torch.randint(0, a.V - 2, (L,), generator=g, dtype=torch.int32),
            loss_mask=torch.cat([torch.zeros(a.P), torch.ones(a.T)]).int(), logprobs=lp,
            versions=torch.where(torch.arange(L) < a.P, -1, 0).int(),
            attention_mask=torch.ones(L, dtype=torch.bool),
            rewards=torch.tensor(float(i % 2))).items()})
    engines, data = {}, None
    for p in providers:
        eng = classes[p](PPOActorConfig(**cfg))
        eng.create_process_group()
        eng.initialize(addr=None, ft_spec=FinetuneSpec(1, a.B, a.B))
        if data is None:               # the same proximal log-probs and advantages for both
            b = copy.deepcopy(batch)
            for traj, lp in zip(b, eng.compute_logp(b)):
                traj["prox_logp"] = lp
            data = eng.compute_advantages(b)
        engines[p] = eng
    return engines, data


def _update(eng, data):
    from areal.utils import stats_tracker

    eng.ppo_update(copy.deepcopy(data))
    stats_tracker.export_all(reset=True)


def child_memory(a):
    engines, data = _setup(a, [a.provider])
    print(json.dumps(step_peak_mb(lambda: _update(engines[a.provider], data))))


def child_time(a):
    engines, data = _setup(a, ["areal", "gbc"])
    print(json.dumps(interleaved_medians(
        {p: (lambda e=engines[p]: _update(e, data)) for p in ("areal", "gbc")}, a.reps)))


def main():
    ap = step_parser(__doc__)
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    if a.child_time:
        return child_time(a)
    if a.child_memory:
        return child_memory(a)
    N = (a.B // 2) * (a.P + a.T)           # one micro-batch's tokens (AReaL pads to 256s)
    N_pad = -(-N // 256) * 256
    print(f"one AReaL actor update: B={a.B} in 2 micro-batches, prompt {a.P} + response "
          f"{a.T}, H={a.H}, V={a.V}, fp32, {a.threads} threads", flush=True)
    times = step_child(__file__, "time", a, ap.case_names)
    mem = {p: step_child(__file__, "memory", a, ap.case_names, ["--provider", p])
           for p in ("areal", "gbc")}
    logits_mb = N_pad * a.V * 4 / 2 ** 20
    rows = []
    for p, name in (("areal", "AReaL 1.0.4 FSDP actor (logits)"),
                    ("gbc", "gbc's head in AReaL's actor")):
        rows.append({"path": name, "B": a.B, "P": a.P, "T": a.T, "H": a.H, "V": a.V,
                     "threads": a.threads, "time_s": round(times[p], 4),
                     "time_x_areal": round(times[p] / times["areal"], 3),
                     "peak_mib": round(mem[p]["step_peak_mb"], 1),
                     "peak_x_areal": round(mem[p]["step_peak_mb"]
                                           / mem["areal"]["step_peak_mb"], 3),
                     "peak_x_micro_logits": round(mem[p]["step_peak_mb"] / logits_mb, 3)})
    write_step_table(a.out, rows, "AReaL", a.reps,
                     f"one padded micro-batch's fp32 [N, V] ({logits_mb:.0f} MiB)")


if __name__ == "__main__":
    main()
