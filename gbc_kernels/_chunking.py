"""Chunk sizing from a memory budget, and the chunk's logits by one matmul."""

from __future__ import annotations

import os
from typing import Optional

import torch

DEFAULT_BUDGET_MB = 128


def budget_bytes() -> int:
    """Working-set budget over the vocabulary, ``GBC_CHUNK_MB`` MiB (default 128)."""
    return int(float(os.environ.get("GBC_CHUNK_MB", DEFAULT_BUDGET_MB)) * 2 ** 20)


def rows_per_chunk(n_rows: int, vocab: int, buffers: int, budget: Optional[int] = None) -> int:
    """Rows such that ``buffers`` float32 ``[rows, V]`` arrays fit the budget; at least 1, at most
    ``n_rows``, a multiple of 16 when larger than 16 (friendlier to BLAS)."""
    budget = budget_bytes() if budget is None else budget
    rows = max(1, budget // max(1, vocab * 4 * buffers))
    if rows > 16:
        rows -= rows % 16
    return max(1, min(rows, n_rows))


def project(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            out: torch.Tensor) -> torch.Tensor:
    """out = h @ weight.T + bias, written into the preallocated chunk buffer."""
    if bias is None:
        return torch.mm(h, weight.t(), out=out)
    return torch.addmm(bias, h, weight.t(), out=out)
