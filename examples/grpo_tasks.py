"""Tasks and tokenizers of the example GRPO trainer.

* ``AdditionTask``: multi-digit addition with a character tokenizer built in code. Operands are
  zero-padded to a fixed width (so every prompt has the same length); the answer is written
  least-significant digit first (the order in which a carry propagates, far easier for a tiny
  transformer) without padding, then EOS: whether a final carry digit is emitted before EOS is
  the length decision, the critical token of the critical-token paper's setting (a model trained
  on N digits asked for N+1).
* ``KKTask``: Knights-and-Knaves puzzles generated and scored locally by ``reasoning-gym``, for a
  real model (``--model PATH``) and its own tokenizer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Optional

import torch


class CharTokenizer:
    """Digits, '+', '=', and the specials PAD, BOS, EOS."""

    PAD, BOS, EOS = 0, 1, 2
    CHARS = "0123456789+="

    def __init__(self):
        self.vocab_size = 3 + len(self.CHARS)
        self.pad_token_id, self.bos_token_id, self.eos_token_id = self.PAD, self.BOS, self.EOS

    def encode(self, text: str) -> List[int]:
        return [3 + self.CHARS.index(c) for c in text]

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.EOS:
                break
            if i >= 3:
                out.append(self.CHARS[i - 3])
        return "".join(out)


@dataclass
class Batch:
    prompts: torch.Tensor           # [P, Lp] token ids
    answers: List[str]              # reference answers, one per prompt
    meta: Optional[list] = None     # task-specific data for the scorer


class AdditionTask:
    """``a+b=`` with ``digits``-digit operands (zero-padded), answer ``a+b`` reversed, EOS."""

    def __init__(self, digits: int, tokenizer: CharTokenizer, partial_credit: bool = False):
        self.digits, self.tok, self.partial_credit = digits, tokenizer, partial_credit

    @property
    def max_answer_tokens(self) -> int:
        return self.digits + 2          # digits + a carry digit + EOS

    def prompt_text(self, a: int, b: int) -> str:
        return f"{a:0{self.digits}d}+{b:0{self.digits}d}="

    def sample(self, n: int, rng: random.Random) -> Batch:
        hi = 10 ** self.digits - 1
        pairs = [(rng.randint(0, hi), rng.randint(0, hi)) for _ in range(n)]
        ids = [[self.tok.BOS] + self.tok.encode(self.prompt_text(a, b)) for a, b in pairs]
        return Batch(torch.tensor(ids), [str(a + b)[::-1] for a, b in pairs])

    def sft_batch(self, n: int, rng: random.Random):
        """Full sequences ``BOS a+b= c EOS`` (right-padded) and the answer mask."""
        b = self.sample(n, rng)
        seqs = [p.tolist() + self.tok.encode(ans) + [self.tok.EOS]
                for p, ans in zip(b.prompts, b.answers)]
        L = max(map(len, seqs))
        ids = torch.full((n, L), self.tok.PAD)
        mask = torch.zeros(n, L - 1, dtype=torch.bool)
        lp = b.prompts.shape[1]
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, lp - 1:len(s) - 1] = True     # positions predicting answer + EOS
        return ids, mask

    def score(self, completions: List[str], batch: Batch, group: int):
        """(reward, correct) per completion: 1 for an exact answer, else 0 (or, with
        ``partial_credit``, half the share of answer digits right); correct = exact."""
        rewards, correct = [], []
        for i, c in enumerate(completions):
            ans = batch.answers[i // group]
            exact = c == ans
            hits = sum(x == y for x, y in zip(c, ans))
            partial = 0.5 * hits / max(len(ans), len(c), 1) if self.partial_credit else 0.0
            rewards.append(1.0 if exact else partial)
            correct.append(exact)
        return torch.tensor(rewards), torch.tensor(correct)


class KKTask:
    """Knights-and-Knaves from reasoning-gym, prompts through the model's tokenizer."""

    def __init__(self, tokenizer, seed: int = 0, max_answer_tokens: int = 64):
        import reasoning_gym
        self.tok, self.max_answer_tokens = tokenizer, max_answer_tokens
        self.data = reasoning_gym.create_dataset("knights_knaves", seed=seed, size=10_000)
        self.i = 0

    def sample(self, n: int, rng: random.Random) -> Batch:
        items = [self.data[(self.i + k) % len(self.data)] for k in range(n)]
        self.i += n
        texts = [it["question"] + "\nAnswer:" for it in items]
        enc = self.tok(texts, return_tensors="pt", padding=True, padding_side="left")
        return Batch(enc["input_ids"], [it["answer"] for it in items], items)

    def score(self, completions: List[str], batch: Batch, group: int):
        rewards = [float(self.data.score_answer(c, batch.meta[i // group]))
                   for i, c in enumerate(completions)]
        r = torch.tensor(rewards)
        return r, r >= 1.0
