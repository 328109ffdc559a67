"""Vocab-parallel lm_head (docs/math.md, "Vocab-parallel reductions"): each rank holds rows
``[start, end)`` of the weight.

Every rank passes the same hidden states, targets (global ids), mask and per-token inputs. The
loss runs the one-device chunk loop (``_fused``) with the backend's own kernels over the local
slice; this module holds what the loop adds in this mode:

* ``local_targets``: global ids as ids into the slice, ``-1`` where the target lies in another
  rank's slice (the backends then neither read it nor add its one-hot term);
* ``combine``: per chunk, ONE collective (an all_gather of the local row statistics: LSE, max,
  target logit, entropy, ``Σp²``) from which every rank forms the global statistics:
  ``LSE = logsumexp_r LSE_r``, with ``w_r = exp(LSE_r - LSE)`` the slice's probability mass,
  ``H = Σ_r w_r (H_r - log w_r)``, ``Σp² = Σ_r w_r² Σp²_r``, ``z[y]`` from the rank holding it;
* ``reduce_hidden_grad``: each rank's ``grad_hidden`` is its slice's part ``G_r W_r``; one
  all_reduce(SUM) per call completes it. ``grad_weight`` and ``grad_bias`` are the slice's own.

Three matmuls per chunk, as on one device. The chunk plan depends only on the row count, the
widest slice and the sequences, so every rank runs the same chunks and collectives in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ._validate import resolve_group
from .backends.base import RowStats


@dataclass(frozen=True)
class VocabParallel:
    """This rank holds ``weight[start:end]`` (and ``bias[start:end]``) of the full lm_head.

    ``group``: the ``torch.distributed`` process group over which the vocabulary is split
    (None: the default group). The ranks' slices must tile ``[0, V)``.
    ``reduce_hidden_grad``: True (default): ``hidden.grad`` is the full gradient on every rank
    (one all-reduce); False: this slice's part ``G_r W_r`` only, for a caller whose own
    collective sums the parts (megatron's sequence-parallel reduce-scatter).
    """

    group: object
    start: int
    end: int
    reduce_hidden_grad: bool = True


@dataclass(frozen=True)
class _Slice:
    group: object
    start: int
    end: int
    vocab: int          # V of the full vocabulary
    width: int          # rows of the widest slice (every rank sizes its chunks by it)
    reduce: bool = True     # all-reduce the hidden gradient (VocabParallel.reduce_hidden_grad)


def check(vp, weight, bias, device) -> _Slice:
    """Validate ``vocab_parallel`` against the weight shard and the other ranks' slices (one
    all_gather of two integers)."""
    if not isinstance(vp, VocabParallel):
        raise TypeError(f"vocab_parallel: expected gbc_kernels.VocabParallel(group, start, end),"
                        f" got {type(vp).__name__}")
    group = resolve_group("vocab_parallel.group", vp.group)
    for name in ("start", "end"):
        v = getattr(vp, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"vocab_parallel.{name}: expected an int, got {v!r}")
    if not 0 <= vp.start < vp.end:
        raise ValueError(f"vocab_parallel: expected 0 <= start < end, got start={vp.start}, "
                         f"end={vp.end}")
    rows = vp.end - vp.start
    if weight.shape[0] != rows:
        raise ValueError(f"weight: expected this rank's slice of {rows} rows "
                         f"(vocab_parallel end - start), got {weight.shape[0]}")
    if bias is not None and bias.shape[0] != rows:
        raise ValueError(f"bias: expected this rank's slice of {rows} entries, got "
                         f"{bias.shape[0]}")
    world = dist.get_world_size(group)
    mine = torch.tensor([vp.start, vp.end], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    slices = sorted(tuple(int(x) for x in t.tolist()) for t in every)
    covered = 0
    for s, e in slices:
        if s != covered:
            raise ValueError(f"vocab_parallel: the ranks' slices {slices} do not tile [0, V) "
                             f"(gap or overlap at {min(s, covered)})")
        covered = e
    if not isinstance(vp.reduce_hidden_grad, bool):
        raise TypeError(f"vocab_parallel.reduce_hidden_grad: expected a bool, got "
                        f"{vp.reduce_hidden_grad!r}")
    return _Slice(group, vp.start, vp.end, covered, max(e - s for s, e in slices),
                  vp.reduce_hidden_grad)


def _local_in_slice(y, sl: _Slice):
    inside = (y >= sl.start) & (y < sl.end)
    return inside, (y - sl.start).clamp(0, sl.end - sl.start - 1)


def local_targets(y: torch.Tensor, sl: _Slice) -> torch.Tensor:
    """Global target ids as ids into this rank's slice, -1 where another rank holds them."""
    inside, local = _local_in_slice(y, sl)
    return torch.where(inside, local, torch.full_like(local, -1))


def combine(st: RowStats, sl: _Slice, lse_full: Optional[torch.Tensor] = None):
    """The global row statistics from every rank's statistics of its slice (one all_gather).

    A slice may hold none of a row's terms (the sampler's support, docs/math.md §16: ``LSE_r =
    -inf``): its mass is 0 and it adds nothing. ``lse_full``: this slice's whole-row LSE beside
    the support's statistics, combined in the same all_gather; then ``(RowStats, lse_full)``
    is returned."""
    parts = [st.lse, st.target_z, st.zmax]
    if st.entropy is not None:
        parts.append(st.entropy)
    if st.sum_p2 is not None:
        parts.append(st.sum_p2)
    if lse_full is not None:
        parts.append(lse_full)
    local = torch.stack(parts)                                     # [k, rows]
    every = [torch.empty_like(local) for _ in range(dist.get_world_size(sl.group))]
    dist.all_gather(every, local, group=sl.group)
    every = torch.stack(every)                                     # [ranks, k, rows]
    lse_r = every[:, 0]
    lse = torch.logsumexp(lse_r, 0)
    log_w = lse_r - lse                                            # log of each slice's mass
    w = torch.exp(log_w)
    entropy = sum_p2 = None
    k = 3
    if st.entropy is not None:
        entropy = torch.where(w > 0, w * (every[:, k] - log_w), 0.0).sum(0)
        k += 1
    if st.sum_p2 is not None:
        sum_p2 = (w * w * every[:, k]).sum(0)
        k += 1
    out = RowStats(lse, every[:, 2].amax(0), every[:, 1].sum(0), entropy, sum_p2)
    return out if lse_full is None else (out, torch.logsumexp(every[:, k], 0))


def combiner(sl: Optional[_Slice]):
    """``combine`` bound to ``sl`` (None without vocab parallelism)."""
    return None if sl is None else (lambda st: combine(st, sl))


def resolve(vp, weight, bias, device):
    """``(slice, vocab)``: the checked slice (None without vocab parallelism) and the size of
    the whole vocabulary the target ids index."""
    if vp is None:
        return None, weight.shape[0]
    sl = check(vp, weight, bias, device)
    return sl, sl.vocab


def reduce_hidden_grad(grad_hidden: Optional[torch.Tensor], sl: _Slice):
    """Sum the slices' parts of the hidden gradient (once per call), unless the caller sums
    them itself (``reduce_hidden_grad=False``)."""
    if grad_hidden is not None and sl.reduce:
        dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=sl.group)
    return grad_hidden


@torch.no_grad()
def gather_rows(ids: torch.Tensor, weight, bias, sl: _Slice):
    """``weight[ids]`` (and ``bias[ids]``) of the full lm_head on every rank: each rank fills
    the rows of its slice, one all_reduce(SUM) assembles them."""
    inside, local = _local_in_slice(ids, sl)
    rows = torch.where(inside[:, None], weight.index_select(0, local),
                       torch.zeros((), dtype=weight.dtype, device=weight.device))
    dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=sl.group)
    b = None
    if bias is not None:
        b = torch.where(inside, bias.index_select(0, local),
                        torch.zeros((), dtype=bias.dtype, device=bias.device))
        dist.all_reduce(b, op=dist.ReduceOp.SUM, group=sl.group)
    return rows, b
