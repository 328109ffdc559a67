"""gbc inside Unsloth's GRPO trainer against Unsloth's own loss, one step each, on the CPU path
(docs/unsloth.md, "Benchmark").

Each provider runs in its own process of an interpreter with Unsloth 2026.10.9 (``--python``,
default this one; ``make compat ONLY=unsloth`` builds such a venv) through the CPU route
``UNSLOTH_ZOO_DISABLE_GPU_INIT=1``, on the same Qwen2 built in code (its weights saved once) and
the same batch:

- ``gbc``: ``GBCUnslothGRPOTrainer.compute_loss`` (gbc's fused head inside the model's forward);
- ``unsloth``: Unsloth's generated ``UnslothGRPOTrainer.compute_loss`` (its
  ``grpo_accumulated_loss``, which on this CPU path runs under float16 autocast whatever the
  config says);
- ``unsloth_f32``: the same with ``UNSLOTH_FORCE_FLOAT32=1`` (its loss without the autocast).

The batch has no left padding in its prompts, so Unsloth's left-packed layout is TRL's and both
losses read the same tensors. Per provider: the median time of the loss and its backward over
``--steps`` steps after one warm-up, and the peak resident memory the step adds (the process's
peak RSS during the steps minus its RSS before them). Both rows and the ratios come from one
run. Usage::

    python benchmarks/bench_unsloth.py [--python VENV/bin/python] [--B 8 --P 32 --T 512
        --V 65536 --H 512 --layers 2 --steps 3] [--loss-type dapo]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def build_model(path, V, H, layers, dtype=None, **config):
    """A Qwen2 of ``layers`` layers and a word-level tokenizer (built in code, saved to
    ``path``); ``config`` overrides the Qwen2Config's fields, ``dtype`` the saved weights'
    (``benchmarks/gpu_unsloth.py``: bf16, wider heads)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = ["<pad>", "<unk>", "<eos>"] + [f"w{i}" for i in range(61)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>",
                            eos_token="<eos>").save_pretrained(path)
    torch.manual_seed(0)
    fields = dict(vocab_size=V, hidden_size=H, intermediate_size=2 * H,
                  num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=4096, pad_token_id=0, eos_token_id=2,
                  tie_word_embeddings=False)
    fields.update(config)
    model = Qwen2ForCausalLM(Qwen2Config(**fields))
    (model if dtype is None else model.to(dtype)).save_pretrained(path)


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(a):
    os.environ["UNSLOTH_ZOO_DISABLE_GPU_INIT"] = "1"
    if a["provider"] == "unsloth_f32":        # Unsloth's loss without its float16 autocast
        os.environ["UNSLOTH_FORCE_FLOAT32"] = "1"
    import unsloth  # noqa: F401  (first, as Unsloth's notebooks do)
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from gbc_kernels.integrations.unsloth import GBCUnslothGRPOTrainer, _add_mode_methods

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a["path"], dtype=torch.float32)
    _add_mode_methods(model)
    # one config class for every provider (Unsloth's GRPOConfig, what trl.GRPOConfig is after
    # `import unsloth`): GBCGRPOConfig keeps TRL's defaults where Unsloth's changes them
    cls, cfg = (GBCUnslothGRPOTrainer if a["provider"] == "gbc" else trl.GRPOTrainer,
                trl.GRPOConfig)
    B, P, T, V = a["B"], a["P"], a["T"], a["V"]
    args = cfg(output_dir=os.path.join(a["out"], a["provider"]), per_device_train_batch_size=B,
               num_generations=B, max_completion_length=T, report_to=[], use_cpu=True,
               bf16=False, fp16=False, save_strategy="no", loss_type=a["loss_type"], beta=0.0,
               gradient_accumulation_steps=1, optim="adamw_torch",
               epsilon_high=0.2, mask_truncated_completions=False)
    trainer = cls(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                  args=args, train_dataset=Dataset.from_dict({"prompt": ["w1 w2"] * B}),
                  processing_class=PreTrainedTokenizerFast.from_pretrained(a["path"]))
    trainer.current_gradient_accumulation_steps = 1
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    batch = {"prompt_ids": torch.randint(3, V, (B, P), generator=g),
             "prompt_mask": torch.ones(B, P, dtype=torch.long),
             # the tail after each completion's end is the pad id, as TRL's rollout leaves it
             "completion_ids": torch.randint(3, V, (B, T), generator=g).masked_fill(mask == 0, 0),
             "completion_mask": mask, "advantages": torch.randn(B, generator=g),
             "num_items_in_batch": mask.sum(),
             "max_left_pad": torch.zeros(B, 1, dtype=torch.long)}
    trainer.model.train()

    def step():
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, dict(batch))
        loss.backward()
        return float(loss)

    loss = step()                                   # warm-up (Unsloth compiles its loss)
    before = rss_bytes()
    times = []
    for _ in range(a["steps"]):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times.sort()
    return {"provider": a["provider"], "loss": loss, "step_s": times[len(times) // 2],
            "peak_added_mib": max(0, peak - before) / 2**20,
            "logits_mib": B * (P + T) * V * 4 / 2**20}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--P", type=int, default=32)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--V", type=int, default=65536)
    ap.add_argument("--H", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--loss-type", default="dapo")
    ap.add_argument("--providers", default="gbc,unsloth,unsloth_f32")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(json.loads(a.child))), flush=True)
        return
    out = tempfile.mkdtemp(prefix="bench_unsloth_")
    path = os.path.join(out, "model")
    build_model(path, a.V, a.H, a.layers)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, os.path.join(ROOT, "python")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                else []))
    rows = {}
    for provider in a.providers.split(","):
        args = dict(provider=provider, path=path, out=out, B=a.B, P=a.P, T=a.T, V=a.V,
                    steps=a.steps, loss_type=a.loss_type)
        proc = subprocess.run([a.python, os.path.abspath(__file__), "--child", json.dumps(args)],
                              env=env, capture_output=True, text=True, cwd=out)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.exit(f"bench_unsloth: {provider} failed:\n{proc.stderr[-4000:]}")
        rows[provider] = json.loads(line[-1].split(" ", 1)[1])
    print(f"CPU, torch threads {env['OMP_NUM_THREADS']}: B={a.B} P={a.P} T={a.T} V={a.V} "
          f"H={a.H} layers={a.layers} loss_type={a.loss_type}; [B*(P+T), V] float32 logits = "
          f"{next(iter(rows.values()))['logits_mib']:.0f} MiB")
    print(f"{'provider':<10} {'loss':>14} {'step s':>8} {'peak added MiB':>15}")
    for r in rows.values():
        print(f"{r['provider']:<10} {r['loss']:>14.8f} {r['step_s']:>8.3f} "
              f"{r['peak_added_mib']:>15.0f}")
    for other in ("unsloth", "unsloth_f32"):
        if "gbc" in rows and other in rows:
            g, u = rows["gbc"], rows[other]
            print(f"gbc / {other}: time {g['step_s'] / u['step_s']:.2f}x, peak memory added "
                  f"{g['peak_added_mib'] / max(u['peak_added_mib'], 1e-9):.2f}x, loss "
                  f"difference {abs(g['loss'] - u['loss']):.2e}")


if __name__ == "__main__":
    main()
