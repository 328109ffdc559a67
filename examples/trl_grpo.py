"""GRPO with TRL's trainer and the gbc_kernels loss: ``GBCGRPOTrainer``.

    python examples/trl_grpo.py                       # tiny Qwen2 built in code, CPU, about 10 s
    python examples/trl_grpo.py --model PATH --steps 200 --no-use-cpu   # a real local model

The task is 1-digit addition (``"3+4="`` -> ``"7"``), rewarded 1 for an exact answer and 0.2
for any number (NTHR counts a completion as correct when its advantage is > 0). With the
built-in tiny random model the point is the wiring, not the learning: every gbc method is on
(AR, Lopti, NTHR, critical-token KL) and TRL logs their metrics (``gbc/...``) next to its own.
"""

from __future__ import annotations

import argparse
import random
import tempfile

import torch


def tiny_char_model(path: str):
    """A character tokenizer (digits, '+', '=') and a tiny Qwen2, saved like a checkpoint."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + list("0123456789+="))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>")
    tok.save_pretrained(path)
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                      tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def reward_sum(completions, prompts, **kwargs):
    """1 for the exact sum, 0.2 for an answer that at least is a number, else 0."""
    out = []
    for prompt, completion in zip(prompts, completions):
        a, b = prompt.rstrip("=").split("+")
        answer = completion.strip()
        out.append(1.0 if answer == str(int(a) + int(b)) else 0.2 if answer.isdigit() else 0.0)
    return out


def main(argv=None):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gbc_kernels.integrations.trl import GBCGRPOConfig, GBCGRPOTrainer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a local transformers causal LM (default: tiny, built here)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None, help="output dir (default: a temporary one)")
    ap.add_argument("--no-use-cpu", dest="use_cpu", action="store_false")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    out = args.out or tempfile.mkdtemp(prefix="gbc_trl_")
    path = args.model
    if path is None:
        path = tempfile.mkdtemp(prefix="gbc_tiny_")
        tiny_char_model(path)
    rng = random.Random(0)
    prompts = [f"{rng.randrange(10)}+{rng.randrange(10)}=" for _ in range(64)]

    config = GBCGRPOConfig(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=3, learning_rate=1e-4, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=args.use_cpu, seed=0,
        loss_type="dapo", beta=0.04, epsilon_high=0.28,          # TRL's own options
        gbc_ar_alpha=0.3,                                          # Advantage Reweighting
        gbc_lopti_eta=0.5,                                         # Lopti: two updates per step
        gbc_nthr=True,                                             # NTHR
        gbc_critical_kl_exponent=150.0)                            # critical-token KL
    trainer = GBCGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=reward_sum, args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=AutoTokenizer.from_pretrained(path))
    trainer.train()
    last = {k: v for row in trainer.state.log_history for k, v in row.items()}
    for k in ("reward", "loss", "kl", "clip_ratio/region_mean", "gbc/nthr_selected", "gbc/grad_share_low_low",
              "gbc/grad_share_low_high"):
        if k in last:
            print(f"{k:>26}: {last[k]:.4f}")
    return trainer


if __name__ == "__main__":
    main()
