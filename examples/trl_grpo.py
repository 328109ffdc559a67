"""GRPO with TRL's trainer and the gbc_kernels loss: ``GBCGRPOTrainer``.

    python examples/trl_grpo.py                       # tiny Qwen2 built in code, CPU, about 15 s
    python examples/trl_grpo.py --model PATH --steps 500 --no-use-cpu   # a real local model

The task is 1-digit addition (``"3+4="`` -> ``"7"``), rewarded 1 for the exact sum, up to 0.5
for a number the closer it is, 0 otherwise (NTHR counts a completion as correct when its
advantage is > 0). Every gbc method is on (AR, Lopti, NTHR, critical-token KL) with TRL's
DAPO loss, its KL penalty and two iterations per generation (so the clip ratios are not
trivially 0), and TRL logs the gbc metrics (``gbc/...``) next to its own. The built-in model
starts from random weights: in 200 steps it learns to answer with numbers near the sum (reward
about 0.12 -> 0.30) while its KL from the reference grows and the share of the gradient on
low-probability tokens falls; the run ends with each metric's first and last quarter.

Critical-token KL uses ``--critical-kl-exponent 2`` here: the paper's 150 suits a pretrained
model that is certain on most tokens; a model trained from scratch is uncertain everywhere, so
150 would switch its KL penalty off.
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
    """1 for the exact sum; for another number, up to 0.5 the closer it is (0 when 9 or more
    off); 0 for an answer that is not a number. A graded reward keeps the groups' rewards
    spread, so the advantages (and the updates) do not vanish once every answer is a number."""
    out = []
    for prompt, completion in zip(prompts, completions):
        a, b = prompt.rstrip("=").split("+")
        answer, truth = completion.strip(), int(a) + int(b)
        if not answer.isdigit():
            out.append(0.0)
        elif int(answer) == truth:
            out.append(1.0)
        else:
            out.append(0.5 * max(0.0, 1.0 - abs(int(answer) - truth) / 9.0))
    return out


def main(argv=None):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gbc_kernels.integrations.trl import GBCGRPOConfig, GBCGRPOTrainer

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a local transformers causal LM (default: a tiny Qwen2 "
                                    "built here, no download)")
    ap.add_argument("--steps", type=int, default=200, help="training steps (default: 200)")
    ap.add_argument("--lr", type=float, default=3e-3, help="learning rate (default: 3e-3)")
    ap.add_argument("--iters", type=int, default=2,
                    help="TRL num_iterations: updates per generation (default: 2)")
    ap.add_argument("--critical-kl-exponent", type=float, default=2.0,
                    help="critical-token KL exponent gamma (default: 2)")
    ap.add_argument("--out", default=None, help="output dir (default: a temporary one)")
    ap.add_argument("--no-use-cpu", dest="use_cpu", action="store_false",
                    help="let TRL use a GPU when there is one (default: CPU)")
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
        max_completion_length=3, learning_rate=args.lr, num_iterations=args.iters, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=args.use_cpu, seed=0,
        loss_type="dapo", beta=0.04, epsilon_high=0.28,          # TRL's own options
        gbc_ar_alpha=0.3,                                          # Advantage Reweighting
        gbc_lopti_eta=0.5,                                         # Lopti: two updates per step
        gbc_nthr=True,                                             # NTHR
        gbc_critical_kl_exponent=args.critical_kl_exponent)       # critical-token KL
    trainer = GBCGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=reward_sum, args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=AutoTokenizer.from_pretrained(path))
    trainer.train()
    rows = [r for r in trainer.state.log_history if "reward" in r]
    q = max(1, len(rows) // 4)
    print(f"{'metric':>24}  first quarter -> last quarter of the run ({len(rows)} log rows)")
    for k in ("reward", "loss", "grad_norm", "kl", "clip_ratio/region_mean", "entropy",
              "gbc/grad_share_low", "gbc/nthr_selected", "gbc/ar_weight_mean_low"):
        vals = [r[k] for r in rows if k in r]
        if vals:
            first, last = vals[:q], vals[-q:]
            print(f"{k:>24}  {sum(first) / len(first):9.4f} -> {sum(last) / len(last):9.4f}")
    return trainer


if __name__ == "__main__":
    main()
