"""Pre-train the tiny Qwen2 of the demo on scratchpad addition (examples/grpo_tasks.py), and
write the checkpoint that ``make demo`` and examples/experiments.py start RL from.

    python examples/pretrain_scratchpad.py                      # the shipped checkpoint
    python examples/pretrain_scratchpad.py --check              # score the shipped checkpoint

The checkpoint is built once and shipped in the repository (examples/checkpoints/), because a
from-scratch warm-up depends on the machine's floating-point path (AVX-512 vs AVX2, the number
of threads): a demo that recomputed it would start RL from a different model on each machine.
The command, seed and the accuracy reached are written next to the weights (``train.json``).

    python examples/pretrain_scratchpad.py --no-final-carry --carry-share 0.001 --steps 3000 \
        --out examples/checkpoints/scratchpad-carry3   # the critical-token KL experiment's model

Training: operands of 1..N digits (N = ``--digits``), next-token cross-entropy on the response
(-logp from gbc_kernels.fused_linear_logprobs), AdamW with a linear warm-up and a linear decay,
until ``--steps`` or until the greedy accuracy on held-out sums of every length 1..N reaches
``--target``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gbc_kernels as gbc                      # noqa: E402
from gbc_kernels.integrations import hf       # noqa: E402
from grpo_tasks import (ScratchpadAdditionTask, ScratchpadTokenizer,   # noqa: E402
                        pack_sequences)

CHECKPOINT = os.path.join(HERE, "checkpoints", "scratchpad-add3")


def load(path: str = CHECKPOINT):
    """The shipped checkpoint: (model in float32, eval mode; tokenizer; its train.json)."""
    from transformers import Qwen2ForCausalLM
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        raise FileNotFoundError(f"no checkpoint at {path}: run examples/pretrain_scratchpad.py")
    model = Qwen2ForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with open(os.path.join(path, "train.json")) as f:
        meta = json.load(f)
    return model, ScratchpadTokenizer(), meta


@torch.no_grad()
def accuracy_by_length(model, tok, digits: int, n: int, seed: int, reversed_prompt=False,
                       final_carry=None):
    """Greedy exact-match accuracy on ``n`` held-out sums per length ``1..digits`` of the longer
    operand (the shorter one uniform in 1..that length)."""
    model.eval()
    out = {}
    for d in range(1, digits + 1):
        rng = random.Random(seed * 1000 + d)
        task = ScratchpadAdditionTask(d, tok, reversed_prompt=reversed_prompt,
                                      final_carry=final_carry)
        pairs = []
        while len(pairs) < n:
            a, b = task.pairs(1, rng)[0]
            if max(len(str(a)), len(str(b))) == d:
                pairs.append((a, b))
        batch = task._batch(pairs)
        ids = batch.prompts
        gen = model.generate(ids, attention_mask=(ids != tok.PAD).long(),
                             max_new_tokens=task.max_answer_tokens, do_sample=False,
                             eos_token_id=tok.EOS, pad_token_id=tok.PAD)
        texts = [tok.decode(c) for c in gen[:, ids.shape[1]:]]
        out[d] = float(task.score(texts, batch, 1)[1].float().mean())
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--digits", type=int, default=3, help="operand lengths 1..N")
    ap.add_argument("--steps", type=int, default=6000, help="at most this many steps")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.995,
                    help="stop once the greedy accuracy of every length reaches this")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-size", type=int, default=400)
    ap.add_argument("--longer-share", type=float, default=0.0,
                    help="share of training sums with an operand of N+1 digits (0: the "
                         "paper's setting, N+1 never seen)")
    ap.add_argument("--aux-share", type=float, default=0.0,
                    help="share of training documents that are the scratchpad's parts out of "
                         "the addition format (a bare copy 'a=' -> reversed digits, and a sum of "
                         "digit lists 'x|y|' -> reversed sum), with operands up to --aux-digits")
    ap.add_argument("--aux-digits", type=int, default=None,
                    help="longest operand of the auxiliary documents (default N+1)")
    ap.add_argument("--no-final-carry", action="store_true",
                    help="no training sum whose last column carries out (the sum never has "
                         "more digits than the longer operand): the carry-out digit is then the "
                         "critical token of examples/experiments.py's critical-kl")
    ap.add_argument("--carry-share", type=float, default=0.0,
                    help="with --no-final-carry: this share of the training sums does carry out "
                         "(a model that has seen a few: unsure at the carry-out decision)")
    ap.add_argument("--reversed-prompt", action="store_true",
                    help="operands written least-significant digit first in the prompt")
    ap.add_argument("--snapshots", default="",
                    help="comma-separated steps at which to also save <out>-step<k>")
    ap.add_argument("--out", default=CHECKPOINT)
    ap.add_argument("--check", action="store_true", help="only score the checkpoint at --out")
    args = ap.parse_args(argv)
    if args.check:
        model, tok, meta = load(args.out)
        print(json.dumps(dict(trained=meta["accuracy"],
                              now=accuracy_by_length(
                                  model, tok, meta["digits"], args.eval_size, seed=7,
                                  final_carry=None if meta.get("final_carry", True) else False))))
        return
    random.seed(args.seed)
    tok = ScratchpadTokenizer()
    from grpo_trainer import tiny_qwen2
    model = tiny_qwen2(tok.vocab_size, args.seed, layers=4)
    task = ScratchpadAdditionTask(args.digits, tok, reversed_prompt=args.reversed_prompt,
                                  final_carry=False if args.no_final_carry else None)
    longer = ScratchpadAdditionTask(args.digits + 1, tok, min_digits=args.digits + 1,
                                    reversed_prompt=args.reversed_prompt)
    aux_digits = args.aux_digits or args.digits + 1
    carry = ScratchpadAdditionTask(args.digits, tok, reversed_prompt=args.reversed_prompt,
                                   final_carry=True)
    snapshots = {int(x) for x in args.snapshots.split(",") if x.strip()}
    eval_digits = args.digits + 1         # the pre-training's lengths, and one more
    head = hf.lm_head(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warm = 200
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * max(0.02, 1 - s / args.steps))
    rng = random.Random(args.seed)
    t0, acc, step = time.time(), {}, 0
    for step in range(1, args.steps + 1):
        model.train()
        n_aux = sum(rng.random() < args.aux_share for _ in range(args.batch))
        n_long = sum(rng.random() < args.longer_share for _ in range(args.batch - n_aux))
        n_carry = sum(rng.random() < args.carry_share
                      for _ in range(args.batch - n_aux - n_long))
        ids, mask = task.sft_batch(args.batch - n_aux - n_long - n_carry, rng)
        if n_carry:
            ids, mask = _concat_batches((ids, mask), carry.sft_batch(n_carry, rng))
        if n_long:
            ids, mask = _concat_batches((ids, mask), longer.sft_batch(n_long, rng))
        if n_aux:
            ids, mask = _concat_batches((ids, mask), aux_batch(tok, n_aux, aux_digits, rng))
        h = hf.completion_hidden(model, ids)
        logp, _ = gbc.fused_linear_logprobs(h[mask], head.weight, ids[:, 1:][mask], head.bias)
        loss = -logp.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.eval_every == 0 or step == args.steps:
            acc = accuracy_by_length(model, tok, eval_digits, args.eval_size, seed=1,
                                     reversed_prompt=args.reversed_prompt,
                                     final_carry=task.final_carry)
            print(f"step {step}: nll {float(loss):.4f} accuracy {acc} "
                  f"({time.time() - t0:.0f} s)", flush=True)
            if min(acc[d] for d in range(1, args.digits + 1)) >= args.target and \
                    step >= max(snapshots, default=0):
                break
        if step in snapshots:
            _save(model, f"{args.out}-step{step}", args, argv, step, {}, t0)
    print(json.dumps(_save(model, args.out, args, argv, step, acc, t0)))


def aux_batch(tok, n: int, digits: int, rng: random.Random):
    """``n`` auxiliary documents, half of each kind, operands of 1..``digits`` digits:

    * a bare copy ``BOS 1234= 4321 EOS`` (no ``+``: not an addition prompt);
    * a sum of digit lists ``BOS 4321|65| 6631 EOS`` (the scratchpad's tail, no prompt).

    The loss is on the part after the space only. Every piece of the scratchpad is seen at
    length ``digits``; the addition format itself is not.
    """
    op = ScratchpadAdditionTask._operand
    seqs, starts = [], []
    for i in range(n):
        a = op(rng.randint(1, digits), rng)
        if i % 2 == 0:
            p, r = f"{a}=", str(a)[::-1]
        else:
            b = op(rng.randint(1, digits), rng)
            p, r = f"{str(a)[::-1]}|{str(b)[::-1]}|", str(a + b)[::-1]
        p = [tok.BOS] + tok.encode(p)
        seqs.append(p + tok.encode(r) + [tok.EOS])
        starts.append(len(p))
    return pack_sequences(seqs, starts, tok.PAD)


def _concat_batches(a, b):
    """Two (ids, mask) SFT batches as one, right-padded to the longer."""
    (i1, m1), (i2, m2) = a, b
    L = max(i1.shape[1], i2.shape[1])
    pad = lambda t, n, v: torch.nn.functional.pad(t, (0, n - t.shape[1]), value=v)
    return (torch.cat([pad(i1, L, 0), pad(i2, L, 0)]),
            torch.cat([pad(m1, L - 1, False), pad(m2, L - 1, False)]))


def _save(model, out, args, argv, step, acc, t0):
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    meta = dict(command="python examples/pretrain_scratchpad.py " + " ".join(argv or sys.argv[1:]),
                digits=args.digits, longer_share=args.longer_share,
                aux_share=args.aux_share, aux_digits=args.aux_digits,
                final_carry=not args.no_final_carry, carry_share=args.carry_share,
                reversed_prompt=args.reversed_prompt, seed=args.seed, steps=step,
                batch=args.batch, lr=args.lr, accuracy={str(k): v for k, v in acc.items()},
                seconds=round(time.time() - t0), torch=torch.__version__)
    with open(os.path.join(out, "train.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


if __name__ == "__main__":
    main()
