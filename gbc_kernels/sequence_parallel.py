"""Sequence / context parallelism at the loss level (docs/distributed.md, "Sequence and
context parallelism"): the tokens of each sequence are split over the ranks of a group
(verl's Ulysses, megatron's context parallelism, ring attention).

Every rank passes ``[B, T]`` rows for the same ``B`` sequences in the same order; each token
sits on exactly one rank (masked in there, masked out on the others). The loss is a sum over
tokens of per-token terms whose sequence-level inputs (token counts, the sequence mean of the
log-ratio, the off-policy drift, ...) are sums over a sequence's tokens: each rank forms its
partial per-sequence sums, :meth:`_Group.sum` adds them over the group (``[B]``-sized or
scalar tensors only, never a ``[tokens, V]`` one), and the rest of the math is unchanged. The
loss each rank returns is its own tokens' share; the shares add up to the loss of the whole
sequences, and so do the gradients.

The derivative of a sequence statistic is a sum over the sequence's tokens too: the analytic
backward of ``loss_terms`` takes ``dL/dlw`` back through the same reduced sums (the sum of
every rank's upstream gradients), and :class:`_AllReduceSum` does the same under autograd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ._validate import resolve_group


@dataclass(frozen=True)
class SequenceParallel:
    """The tokens of each sequence are split over ``group`` (a ``torch.distributed``
    ProcessGroup, or ``"world"`` for the default group): sequence parallelism (Ulysses),
    context parallelism, ring attention. Pass it as ``sequence_parallel=`` to
    :func:`gbc_kernels.fused_linear_policy_loss` and :func:`gbc_kernels.policy_loss`."""

    group: object


class _AllReduceSum(torch.autograd.Function):
    """``all_reduce(SUM)`` whose backward is the all_reduce(SUM) of the upstream gradients: a
    reduced sum feeds every rank's loss share, so each rank's partial sum receives the
    gradient of the whole loss."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def whole_loss(share: torch.Tensor, group, scale: float = 1) -> torch.Tensor:
    """A rank's loss share as the trainers report it under sequence / context parallelism: the
    value of the whole loss (the shares summed over ``group``) with the gradient of ``scale *
    share``. verl's Megatron engine at context parallelism computes the whole loss on every CP
    rank with the gradient of the rank's own tokens (``scale`` 1); its Ulysses step scales each
    rank's slice by the SP size (``scale`` the SP size)."""
    whole = share.detach().clone()
    dist.all_reduce(whole, group=group)
    return whole + scale * (share - share.detach())


@dataclass(frozen=True)
class _Group:
    """A checked :class:`SequenceParallel`: the reductions the loss calls."""

    group: object                 # the process group (None: the default group)
    same_b: object = None         # () -> None: raises unless every rank passed the same B

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the group (a new tensor; differentiable)."""
        return _AllReduceSum.apply(t, self.group)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' 1-d tensors ``t`` (of any lengths) concatenated, in rank order."""
        local = t.reshape(-1)
        n = torch.tensor([local.numel()], device=local.device)
        sizes = [torch.zeros_like(n) for _ in range(self.size)]
        dist.all_gather(sizes, n, group=self.group)
        sizes = [int(x) for x in sizes]
        padded = torch.zeros(max(max(sizes), 1), device=local.device, dtype=local.dtype)
        padded[: local.numel()] = local
        every = [torch.zeros_like(padded) for _ in range(self.size)]
        dist.all_gather(every, padded, group=self.group)
        return torch.cat([e[:k] for e, k in zip(every, sizes)])

    def first_owner(self, mask: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: this rank is the lowest of the group's ranks holding a masked-in token
        of the sequence (so that exactly one rank puts a per-sequence value on one token)."""
        if self.same_b is not None:       # a [B] collective: the ranks' B checked first
            self.same_b()
        here = mask.any(-1)
        rank = torch.where(here, torch.full_like(here, self.rank, dtype=torch.int64),
                           torch.full_like(here, self.size, dtype=torch.int64))
        owner = rank.clone()
        dist.all_reduce(owner, op=dist.ReduceOp.MIN, group=self.group)
        return here & (owner == rank)


def resolve(sp, B: int, device, checks=None) -> Optional[_Group]:
    """``sequence_parallel`` checked (None: off). The ranks' ``B`` are compared with one
    all_reduce of two integers, its flag resolved with the call's other value checks
    (``checks``) before any collective that depends on ``B``."""
    if sp is None:
        return None
    if not isinstance(sp, SequenceParallel):
        raise TypeError(f"sequence_parallel: expected None or gbc_kernels.SequenceParallel("
                        f"group), got {type(sp).__name__}")
    if isinstance(sp.group, str):
        if sp.group != "world":
            raise ValueError(f"sequence_parallel.group: expected a torch.distributed "
                             f"ProcessGroup or 'world', got {sp.group!r}")
        group = resolve_group("sequence_parallel.group", None)
    else:
        if sp.group is None:
            raise ValueError("sequence_parallel.group: expected a torch.distributed "
                             "ProcessGroup or 'world', got None")
        group = resolve_group("sequence_parallel.group", sp.group)
    both = torch.tensor([B, -B], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    bad = (both[0] != B) | (both[1] != -B)

    def fail():
        hi, lo = both.tolist()
        raise ValueError(f"sequence_parallel: every rank of the group must pass rows for the "
                         f"same B sequences; this rank has B={B}, the group's range is "
                         f"[{-lo}, {hi}]")
    def same_b():
        if bool(bad):
            fail()
    if checks is None:
        same_b()
    else:
        checks.add(lambda: bad, fail)
    return _Group(group, same_b)


def owned_sum(values: torch.Tensor, owned: torch.Tensor, group) -> torch.Tensor:
    """``values [B, T, ...]`` of this rank, kept where it ``owned [B, T]`` the position (0
    elsewhere) and summed over ``group``: every position's value on every rank (each position
    has one owner). Per-token outputs only (``[B, T]``-sized); no autograd."""
    own = owned.reshape(owned.shape + (1,) * (values.dim() - owned.dim()))
    out = torch.where(own, values.detach(), torch.zeros((), dtype=values.dtype,
                                                        device=values.device))
    dist.all_reduce(out, group=group)
    return out


def check_heads(hf_config, size: int, option: str) -> None:
    """Ulysses attention scatters the attention heads over the SP group: ``size`` must divide
    the model's attention heads, and its key/value heads must divide ``size`` or be divided by
    it (they are repeated then). Else a ValueError naming the trainer's ``option``."""
    size = int(size or 1)
    if size <= 1:
        return
    cfg = getattr(hf_config, "text_config", None) or hf_config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % size or (kv % size and size % kv):
        raise ValueError(f"{option}: {size} must divide the model's {heads} attention heads "
                         f"(num_attention_heads), and its {kv} key/value heads "
                         f"(num_key_value_heads) must divide it or be divided by it; choose a "
                         f"size that does")


def refuse(cfg) -> None:
    """The options the sequence split cannot run exactly, refused by name."""
    if cfg.cov_mode is not None:
        raise ValueError(f"cov_mode: Clip-Cov / KL-Cov select tokens by their place in the "
                         f"batch (Clip-Cov at random, KL-Cov by rank among the covariances), "
                         f"which the split sequences do not reproduce; expected cov_mode=None "
                         f"with sequence_parallel, got cov_mode={cfg.cov_mode!r}")
