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


def pack_sequences(seqs, starts, pad):
    """Token lists right-padded into ``ids [n, L]``, and the mask ``[n, L - 1]`` of the
    positions that predict each row's tokens from ``starts[i]`` on (its answer and EOS)."""
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), pad)
    mask = torch.zeros(len(seqs), L - 1, dtype=torch.bool)
    for i, (s, lp) in enumerate(zip(seqs, starts)):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, lp - 1:len(s) - 1] = True
    return ids, mask


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
        return pack_sequences(seqs, [b.prompts.shape[1]] * n, self.tok.PAD)

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


class ScratchpadTokenizer(CharTokenizer):
    """The character tokenizer with the scratchpad's separator '|'."""

    CHARS = "0123456789+=|"


class ScratchpadAdditionTask:
    """Scratchpad addition (the critical-token KL paper's setting).

    Prompt ``BOS a+b=`` with unpadded operands; the response copies each operand's digits out,
    least-significant first, then writes the sum least-significant first, then EOS::

        BOS 123+45=  321|54|861 EOS          (123 + 45 = 168)

    The two operand lengths are drawn independently and uniformly from
    ``min_digits..max_digits``; with ``longest_only`` one of them is set to ``max_digits``
    when neither is (the RL task of the demo: every prompt has the new length).

    Operand lengths are drawn independently and uniformly from ``min_digits..max_digits`` (a
    length-1 operand is 0..9, a longer one has no leading zero). A model pre-trained with
    ``max_digits = N`` and asked for ``N + 1`` meets the critical token: after copying ``N``
    digits of a longer operand, it is certain that ``|`` comes next, and wrong.
    """

    def __init__(self, max_digits: int, tokenizer: CharTokenizer, min_digits: int = 1,
                 partial_credit: bool = False, longest_only: bool = False,
                 reversed_prompt: bool = False, paper_mix: bool = False,
                 final_carry: Optional[bool] = None):
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, "
                             f"{max_digits}")
        if "|" not in tokenizer.CHARS:
            raise ValueError("ScratchpadAdditionTask needs a tokenizer with '|' "
                             "(ScratchpadTokenizer)")
        self.digits, self.longest_only, self.paper_mix = max_digits, longest_only, paper_mix
        self.final_carry = final_carry
        self.reversed_prompt = reversed_prompt
        self.min_digits, self.tok, self.partial_credit = min_digits, tokenizer, partial_credit

    @property
    def max_answer_tokens(self) -> int:
        return 2 * self.digits + (self.digits + 1) + 3     # two copies, sum, two '|', EOS

    @staticmethod
    def _operand(n_digits: int, rng: random.Random) -> int:
        return rng.randint(0, 9) if n_digits == 1 else \
            rng.randint(10 ** (n_digits - 1), 10 ** n_digits - 1)

    def prompt_text(self, a: int, b: int) -> str:
        """``a+b=``; with ``reversed_prompt`` the operands are written least-significant digit
        first too (the copy is then a forward copy)."""
        if self.reversed_prompt:
            return f"{str(a)[::-1]}+{str(b)[::-1]}="
        return f"{a}+{b}="

    @staticmethod
    def answer(a: int, b: int) -> str:
        return f"{str(a)[::-1]}|{str(b)[::-1]}|{str(a + b)[::-1]}"

    def pairs(self, n: int, rng: random.Random):
        """``n`` operand pairs (``_pairs``); with ``final_carry`` True / False only sums whose
        last column carries out (the sum is one digit longer than the longer operand) / only
        sums where it does not, by rejection."""
        if self.final_carry is None:
            return self._pairs(n, rng)
        out = []
        while len(out) < n:
            out += [(a, b) for a, b in self._pairs(n - len(out), rng)
                    if self.carries_out(a, b) == self.final_carry]
        return out

    @staticmethod
    def carries_out(a: int, b: int) -> bool:
        """True when ``a + b`` has more digits than the longer operand."""
        return len(str(a + b)) > max(len(str(a)), len(str(b)))

    def _pairs(self, n: int, rng: random.Random):
        """``n`` operand pairs; with ``longest_only`` one operand (either, evenly) has exactly
        ``max_digits`` digits and the other ``min_digits..max_digits``. With ``paper_mix`` (the
        critical-token paper's RL mix for ``max_digits = N + 1``): one operand (either, evenly)
        has ``N + 1`` digits, the other has ``N + 1`` too half of the time, else
        ``min_digits..N``."""
        lo, hi = self.min_digits, self.digits
        out = []
        for _ in range(n):
            if self.paper_mix:
                other = hi if rng.random() < 0.5 else rng.randint(lo, max(lo, hi - 1))
                la, lb = (hi, other) if rng.random() < 0.5 else (other, hi)
                out.append((self._operand(la, rng), self._operand(lb, rng)))
                continue
            la, lb = rng.randint(lo, hi), rng.randint(lo, hi)
            if self.longest_only and max(la, lb) < hi:
                if rng.random() < 0.5:
                    la = hi
                else:
                    lb = hi
            out.append((self._operand(la, rng), self._operand(lb, rng)))
        return out

    def _batch(self, pairs) -> Batch:
        """Prompts left-padded to a common length (generation appends on the right)."""
        ids = [[self.tok.BOS] + self.tok.encode(self.prompt_text(a, b)) for a, b in pairs]
        L = max(map(len, ids))
        prompts = torch.tensor([[self.tok.PAD] * (L - len(s)) + s for s in ids])
        return Batch(prompts, [self.answer(a, b) for a, b in pairs], list(pairs))

    def sample(self, n: int, rng: random.Random) -> Batch:
        return self._batch(self.pairs(n, rng))

    def sft_batch(self, n: int, rng: random.Random):
        """Full sequences ``BOS a+b= scratchpad EOS`` (right-padded) and the response mask."""
        seqs, starts = [], []
        for a, b in self.pairs(n, rng):
            p = [self.tok.BOS] + self.tok.encode(self.prompt_text(a, b))
            seqs.append(p + self.tok.encode(self.answer(a, b)) + [self.tok.EOS])
            starts.append(len(p))
        return pack_sequences(seqs, starts, self.tok.PAD)

    def score(self, completions: List[str], batch: Batch, group: int):
        """(reward, correct): 1 for the exact scratchpad and sum, else 0 (with
        ``partial_credit``: half the share of the sum's digits right when both copies are)."""
        rewards, correct = [], []
        for i, c in enumerate(completions):
            ans = batch.answers[i // group]
            exact = c == ans
            partial = 0.0
            if self.partial_credit and not exact:
                cs, As = c.split("|"), ans.split("|")
                if len(cs) == 3 and cs[:2] == As[:2]:
                    hits = sum(x == y for x, y in zip(cs[2], As[2]))
                    partial = 0.5 * hits / max(len(cs[2]), len(As[2]), 1)
            rewards.append(1.0 if exact else partial)
            correct.append(exact)
        return torch.tensor(rewards), torch.tensor(correct)

    def longest(self, batch: Batch) -> torch.Tensor:
        """Per prompt: True where an operand has ``max_digits`` digits (the new length when
        ``max_digits`` is one more than the pre-training's)."""
        return torch.tensor([max(len(str(a)), len(str(b))) == self.digits
                             for a, b in batch.meta])
