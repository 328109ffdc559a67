"""The GPU section for Unsloth (issue 67; benchmarks/gpu_session.sh): one GRPO step on a
``FastLanguageModel`` LoRA model (Unsloth's fast forward and its ``"unsloth"`` gradient
checkpointing) with gbc's loss inside Unsloth's trainer (``GBCUnslothGRPOTrainer``) and with
Unsloth's own loss, each against a float64 oracle, time and peak memory side by side.

Nothing downloads: a Qwen2 is built in code (``--H``, ``--layers``, ``--V``) and saved, then
loaded by ``FastLanguageModel.from_pretrained`` from that folder (bfloat16, not quantized: gbc
refuses a quantized lm_head, and a 4-bit base is ``--4bit``). Each provider runs in its own
process; the oracle (Unsloth never imported) loads the same base in float64 with PEFT, copies the
LoRA weights the provider saved, and takes TRL's dapo loss by hand in float64 on the same batch
(``old_per_token_logps`` off policy, so that ratios clip). Printed: per provider the loss, its
error against the oracle, the LoRA gradients' largest error relative to the oracle's largest
entry, the median step time and ``torch.cuda.max_memory_allocated`` during the step.

Needs a CUDA device and Unsloth 2026.10.9 importable by ``--python`` (default this interpreter);
without either it prints why and exits 0, so the session goes on. Untested until a GPU runs it.

    python benchmarks/gpu_unsloth.py [--python PY] [--B 8 --P 64 --T 1024 --V 151936 --H 1024
        --layers 4 --steps 3] [--4bit]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model(path, V, H, layers):
    """bench_unsloth's model and tokenizer, at a GPU's shape: bf16 weights, 64-wide heads."""
    import torch

    sys.path.insert(0, HERE)
    from bench_unsloth import build_model as build

    build(path, V, H, layers, dtype=torch.bfloat16, intermediate_size=3 * H,
          num_attention_heads=H // 64, num_key_value_heads=max(1, H // 256),
          max_position_embeddings=8192, torch_dtype="bfloat16")


def make_batch(a):
    import torch

    g = torch.Generator().manual_seed(1)
    B, P, T, V = a["B"], a["P"], a["T"], a["V"]
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return {"prompt_ids": torch.randint(3, V, (B, P), generator=g),
            "prompt_mask": torch.ones(B, P, dtype=torch.long),
            # the tail after each completion's end is the pad id, as TRL's rollout leaves it
            "completion_ids": torch.randint(3, V, (B, T), generator=g).masked_fill(mask == 0, 0),
            "completion_mask": mask, "advantages": torch.randn(B, generator=g),
            "num_items_in_batch": mask.sum(),
            "max_left_pad": torch.zeros(B, 1, dtype=torch.long)}


def oracle_logp(model, batch, T):
    import torch

    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    z = model(input_ids=ids, attention_mask=att).logits[:, -T - 1:-1].double()
    return torch.log_softmax(z, -1).gather(-1, ids[:, -T:, None])[..., 0]


def child_oracle(a):
    """float64, Unsloth not imported: the old log-probs (stage "old") or the loss and LoRA
    gradients at a provider's saved LoRA weights (stage "loss")."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    assert "unsloth" not in sys.modules
    dev = "cuda"
    model = AutoModelForCausalLM.from_pretrained(a["path"], dtype=torch.float64).to(dev)
    batch = {k: v.to(dev) for k, v in torch.load(a["batch"]).items()}
    T = batch["completion_ids"].size(1)
    if a["stage"] == "old":
        with torch.no_grad():
            logp = oracle_logp(model, batch, T)
        g = torch.Generator(device=dev).manual_seed(2)
        batch["old_per_token_logps"] = (logp + 0.2 * torch.randn(logp.shape, generator=g,
                                                                 device=dev, dtype=logp.dtype)
                                        ).float()
        torch.save({k: v.cpu() for k, v in batch.items()}, a["batch"])
        return {}
    saved = torch.load(a["lora"])
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0,
                                                       target_modules=TARGETS))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, w in saved["weights"].items():
            params[n].copy_(w.to(dev, torch.float64))
    logp = oracle_logp(model, batch, T)
    mask = batch["completion_mask"].double()
    ratio = torch.exp(logp - batch["old_per_token_logps"].double())
    A = batch["advantages"].double()[:, None]
    eps_low, eps_high = 0.2, 0.2
    per_token = -torch.min(ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A)
    loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)     # TRL's dapo, one window
    loss.backward()
    err = 0.0
    for n, g in saved["grads"].items():
        ref = params[n].grad
        err = max(err, float((g.to(dev).double() - ref).abs().max() / ref.abs().max()))
    return {"oracle_loss": float(loss), "grad_err": err}


def child_provider(a):
    import torch

    import unsloth  # noqa: F401  (first)
    from unsloth import FastLanguageModel
    import trl
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast

    from gbc_kernels.integrations.unsloth import GBCUnslothGRPOTrainer

    model, _ = FastLanguageModel.from_pretrained(
        model_name=a["path"], max_seq_length=a["P"] + a["T"], dtype=torch.bfloat16,
        load_in_4bit=a["four_bit"])
    model = FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=16, lora_dropout=0, target_modules=TARGETS,
        use_gradient_checkpointing="unsloth", random_state=3)
    with torch.no_grad():       # B != 0, the same in every provider: the adapter moves the loss
        g = torch.Generator(device="cpu").manual_seed(4)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_((0.01 * torch.randn(p.shape, generator=g)).to(p.device, p.dtype))
    gbc = a["provider"] == "gbc"
    # one config class for both (Unsloth's GRPOConfig, trl.GRPOConfig after `import unsloth`)
    cls, cfg = (GBCUnslothGRPOTrainer if gbc else trl.GRPOTrainer, trl.GRPOConfig)
    args = cfg(output_dir=os.path.join(a["out"], a["provider"]),
               per_device_train_batch_size=a["B"], num_generations=a["B"],
               max_completion_length=a["T"], report_to=[], bf16=True, save_strategy="no",
               loss_type="dapo", beta=0.0, epsilon_high=0.2, mask_truncated_completions=False,
               gradient_accumulation_steps=1, optim="adamw_torch")
    trainer = cls(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                  args=args, train_dataset=Dataset.from_dict({"prompt": ["w1 w2"] * a["B"]}),
                  processing_class=PreTrainedTokenizerFast.from_pretrained(a["path"]))
    trainer.current_gradient_accumulation_steps = 1
    batch = {k: v.cuda() for k, v in torch.load(a["batch"]).items()}
    trainer.model.train()

    def step():
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, dict(batch))
        loss.backward()
        torch.cuda.synchronize()
        return float(loss)

    loss = step()                                        # warm-up (compiles)
    times, peaks = [], []
    for _ in range(a["steps"]):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated() - base)
    lora = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    torch.save({"weights": {n: p.detach().float().cpu() for n, p in lora.items()},
                "grads": {n: p.grad.detach().float().cpu() for n, p in lora.items()
                          if "lora_" in n and p.grad is not None}}, a["lora"])
    times.sort()
    return {"provider": a["provider"], "loss": loss, "step_s": times[len(times) // 2],
            "peak_mib": max(peaks) / 2**20}


def run_child(python, payload, env, cwd):
    proc = subprocess.run([python, os.path.abspath(__file__), "--child", json.dumps(payload)],
                          env=env, capture_output=True, text=True, cwd=cwd)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not line:
        return {"error": (proc.stderr or proc.stdout)[-3000:]}
    return json.loads(line[-1].split(" ", 1)[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--P", type=int, default=64)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--H", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--4bit", dest="four_bit", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        payload = json.loads(a.child)
        fn = child_oracle if payload["provider"] == "oracle" else child_provider
        print("RESULT " + json.dumps(fn(payload)), flush=True)
        return
    check = subprocess.run([a.python, "-c", "import torch, importlib.util as u; "
                            "print(torch.cuda.is_available(), u.find_spec('unsloth') is not None)"],
                           capture_output=True, text=True)
    cuda, has_unsloth = (check.stdout.split() + ["False", "False"])[:2]
    if cuda != "True" or has_unsloth != "True":
        print(f"gpu_unsloth.py: skipped (CUDA available: {cuda}, unsloth importable by "
              f"{a.python}: {has_unsloth}; the venv of compat/sets/unsloth-2026.10.9.txt with a "
              "CUDA torch)")
        return
    out = tempfile.mkdtemp(prefix="gpu_unsloth_")
    path = os.path.join(out, "model")
    build_model(path, a.V, a.H, a.layers)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, os.path.join(ROOT, "python")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                else []))
    common = dict(path=path, out=out, B=a.B, P=a.P, T=a.T, V=a.V, steps=a.steps,
                  four_bit=a.four_bit, batch=os.path.join(out, "batch.pt"))
    import torch

    torch.save(make_batch(common), common["batch"])
    r = run_child(a.python, dict(common, provider="oracle", stage="old"), env, out)
    if "error" in r:
        sys.exit("gpu_unsloth.py: the oracle's old log-probs failed:\n" + r["error"])
    print(f"FastLanguageModel LoRA r=16 ({'4-bit' if a.four_bit else 'bf16'} base), "
          f"\"unsloth\" gradient checkpointing: B={a.B} P={a.P} T={a.T} V={a.V} H={a.H} "
          f"layers={a.layers}, dapo")
    print(f"{'provider':<10} {'loss':>12} {'|loss-f64|':>11} {'grad err':>9} {'step s':>8} "
          f"{'peak MiB':>9}")
    rows = {}
    for provider in ("gbc", "unsloth"):
        lora = os.path.join(out, f"lora_{provider}.pt")
        r = run_child(a.python, dict(common, provider=provider, lora=lora), env, out)
        if "error" in r:
            print(f"{provider:<10} failed: {r['error'].strip().splitlines()[-1][:300]}")
            continue
        o = run_child(a.python, dict(common, provider="oracle", stage="loss", lora=lora), env,
                      out)
        r.update(o if "error" not in o else {"oracle_loss": float("nan"),
                                              "grad_err": float("nan")})
        rows[provider] = r
        print(f"{provider:<10} {r['loss']:>12.6f} {abs(r['loss'] - r['oracle_loss']):>11.2e} "
              f"{r['grad_err']:>9.2e} {r['step_s']:>8.3f} {r['peak_mib']:>9.0f}")
    if len(rows) == 2:
        g, u = rows["gbc"], rows["unsloth"]
        print(f"gbc / unsloth: time {g['step_s'] / u['step_s']:.2f}x, peak memory "
              f"{g['peak_mib'] / max(u['peak_mib'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
