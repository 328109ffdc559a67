"""Chunk sizing from a memory budget, and the chunk's logits by one matmul."""

from __future__ import annotations

import os
from typing import Optional

import torch

# Default working-set budget over the vocabulary, MiB. CPU: 64 keeps the fused pass within
# 1-2% of the bare matmuls (benchmarks/bench_cpu.py) while peak memory stays near 0.1x of one
# [8192, 32768] float32 logits; GPUs want bigger chunks for the matmuls to saturate.
DEFAULT_BUDGET_MB = {"cpu": 64, "cuda": 1024}
# On CUDA the default budget also keeps the chunk buffer plus the gradients of the call within
# half of one float32 [rows, V] logits tensor where that leaves chunks of this many rows (below
# it the gradient matmuls lose efficiency and grad_weight is re-read once per chunk).
GPU_MIN_ROWS = 2048


def budget_bytes(device: Optional[torch.device] = None) -> int:
    """``GBC_CHUNK_MB`` MiB if set, else the device's default."""
    env = os.environ.get("GBC_CHUNK_MB")
    if env is not None:
        try:
            mb = float(env)
        except ValueError:
            mb = float("nan")
        if not mb > 0 or mb == float("inf"):
            raise ValueError(f"GBC_CHUNK_MB: expected a positive number of MiB, got {env!r}")
        return int(mb * 2 ** 20)
    kind = "cpu" if device is None else device.type
    return DEFAULT_BUDGET_MB.get(kind, 256) * 2 ** 20


# Batch invariance (docs/math.md, Numerics). A BLAS picks its kernels by shape: below some row
# count (here 1 row: a GEMV) a row's logits differ in their last bits from the same row inside
# a bigger matmul. Every logits matmul therefore has at least MIN_ROWS rows (a smaller chunk is
# padded with zero rows). GBC_BATCH_INVARIANT=1 goes further: every logits matmul has the same
# shape, FIXED_ROWS_MAX >= R >= MIN_ROWS rows fixed by the budget and V alone, the last chunk
# padded, so a token's log-prob cannot depend on the rest of the batch whatever the BLAS does.
MIN_ROWS = 16
FIXED_ROWS_MAX = 8192


def batch_invariant() -> bool:
    """``GBC_BATCH_INVARIANT``: 1/true/yes/on (fixed-shape chunks) or 0/false/no/off (the
    default)."""
    env = os.environ.get("GBC_BATCH_INVARIANT")
    if env is None:
        return False
    v = env.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"GBC_BATCH_INVARIANT: expected 1/true/yes/on or 0/false/no/off, got {env!r}")


def fixed_rows(vocab: int, bytes_per_logit: int, device: Optional[torch.device] = None) -> int:
    """The rows of every logits matmul in batch-invariant mode: the budget's rows for ``vocab``
    (not lowered by the batch's size), a multiple of the tile, within
    ``[MIN_ROWS, FIXED_ROWS_MAX]``."""
    cap = budget_bytes(device) // max(1, vocab * bytes_per_logit)
    tile = 16 if device is None or device.type == "cpu" else 128
    if cap >= tile:
        cap = cap // tile * tile
    return int(min(FIXED_ROWS_MAX, max(MIN_ROWS, cap)))


def rows_per_chunk(n_rows: int, vocab: int, bytes_per_logit: int,
                   device: Optional[torch.device] = None, grad_bytes: int = 0) -> int:
    """Rows per chunk: ``[rows, V]`` working arrays of ``bytes_per_logit`` bytes per logit in
    all (the chunk buffer's real element size, plus any float32 temporaries of the backend)
    within the budget, the rows then spread evenly over the chunks that takes (no small ragged
    last chunk) and rounded up to a multiple of the matmul tile (128 rows on GPUs, 16 on CPUs)
    when that many rows are allowed: the budget is met to within one tile. At least 1, at most
    ``n_rows``.

    On CUDA without ``GBC_CHUNK_MB`` the budget is lowered to half of one float32
    ``[n_rows, V]`` less ``grad_bytes`` (the gradients the call returns) where that still
    allows chunks of ``GPU_MIN_ROWS`` rows: the call's peak then stays within 0.5x of what one
    float32 logits tensor would take. Where it does not (few rows against a large
    ``grad_weight``: the gradients alone come near 0.5x) the budget stays as it is, for
    speed."""
    if n_rows <= 0:
        return 1
    if batch_invariant():
        return fixed_rows(vocab, bytes_per_logit, device)
    budget = budget_bytes(device)
    gpu = device is not None and device.type == "cuda"
    if gpu and os.environ.get("GBC_CHUNK_MB") is None:
        within_half = n_rows * vocab * 2 - grad_bytes
        if within_half >= GPU_MIN_ROWS * vocab * bytes_per_logit:
            budget = min(budget, within_half)
    cap = max(1, budget // max(1, vocab * bytes_per_logit))
    chunks = -(-n_rows // cap)
    rows = -(-n_rows // chunks)
    tile = 16 if device is None or device.type == "cpu" else 128
    if cap >= tile:
        rows = -(-rows // tile) * tile
    return max(1, min(rows, n_rows))



LOW_PRECISION = (torch.bfloat16, torch.float16)


def accumulate_fp32(dtype: torch.dtype) -> bool:
    """Whether a ``dtype`` (bf16/fp16) weight gradient is summed over the chunks in float32 and
    rounded once at the end: ``GBC_WEIGHT_GRAD_ACCUM`` is ``float32`` (the default) or
    ``native`` (the weight's own dtype, rounded at every chunk: half the accumulator's memory,
    for memory-bound runs)."""
    env = os.environ.get("GBC_WEIGHT_GRAD_ACCUM", "float32").strip().lower()
    if env not in ("float32", "native"):
        raise ValueError(f"GBC_WEIGHT_GRAD_ACCUM: expected 'float32' or 'native', got {env!r}")
    return env == "float32" and dtype in LOW_PRECISION


# columns of a low-precision chunk converted to float32 at a time (CPU accumulation): bounds the
# temporary at rows x 4096 x 4 bytes, whatever the vocabulary
_FP32_COLS = 4096


def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``acc = (0 if first else acc) + a @ b`` with a float32 ``acc`` and low-precision ``a``,
    ``b``, the product never rounded to their dtype: CUDA's ``out_dtype`` matmul (PyTorch >=
    2.8); elsewhere float32 copies of ``a``'s rows in blocks of columns (``a`` is ``[V, rows]``,
    the chunk's gradient transposed)."""
    beta = 0.0 if first else 1.0
    if acc.device.type == "cuda":
        try:
            torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, RuntimeError):
            pass
    b32 = b.float()
    for v0 in range(0, a.shape[0], _FP32_COLS):
        v1 = min(a.shape[0], v0 + _FP32_COLS)
        torch.addmm(acc[v0:v1], a[v0:v1].float(), b32, beta=beta, out=acc[v0:v1])


# Float32 logits of low-precision operands (``logits_dtype=torch.float32``, docs/kernels.md,
# "Precision"). A bf16 x bf16 (or fp16 x fp16) product is exact in float32, so a matmul that
# accumulates in float32 and writes float32 gives the float32 head's logits (hidden states and
# weight cast to float32, a float32 matmul) up to summation order, without a float32 copy of
# the weight: CUDA's ``out_dtype`` matmul (tensor cores, PyTorch >= 2.8); elsewhere float32
# copies of the weight's rows a block at a time (CPUs without bf16 units run float32 GEMMs
# faster than bf16 ones: benchmarks/bench_cpu.py --logits-dtype float32).
_FP32_BLOCK_BYTES = 8 * 2 ** 20


def _block_rows(H: int) -> int:
    """Rows of a float32 weight block of ``_FP32_BLOCK_BYTES`` (at least 256)."""
    return max(256, _FP32_BLOCK_BYTES // max(1, 4 * H))


def logits_dtype_for(dtype: torch.dtype, logits_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The chunk buffer's dtype: ``logits_dtype`` (float32) for low-precision operands, else
    the operands' own dtype (float32 and float64 inputs: the option changes nothing)."""
    if logits_dtype is not None and dtype in LOW_PRECISION:
        return logits_dtype
    return dtype


_warned_out_dtype = False


def _warn_no_out_dtype(exc) -> None:
    global _warned_out_dtype
    if not _warned_out_dtype:
        _warned_out_dtype = True
        import warnings
        warnings.warn(f"gbc_kernels: logits_dtype=float32 on CUDA without a bf16 -> float32 "
                      f"out_dtype matmul in this PyTorch ({exc}); the weight is upcast a block "
                      f"at a time instead (slower; PyTorch >= 2.8 has it)", RuntimeWarning,
                      stacklevel=4)


def mm_fp32(a: torch.Tensor, b_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a @ b_t.T`` into a float32 ``out`` for low-precision ``a`` ``[m, K]`` and
    ``b_t`` ``[n, K]``, accumulated in float32 and never rounded to their dtype."""
    if out.device.type == "cuda":
        try:
            return torch.mm(a, b_t.t(), out_dtype=torch.float32, out=out)
        except (TypeError, RuntimeError) as exc:
            _warn_no_out_dtype(exc)
    a32 = a.float()
    step = _block_rows(a.shape[1])
    for v0 in range(0, b_t.shape[0], step):
        v1 = min(b_t.shape[0], v0 + step)
        torch.mm(a32, b_t[v0:v1].float().t(), out=out[:, v0:v1])
    return out


def mm_fp32_right(a32: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a32 @ b`` as float32 for a float32 ``a32`` ``[m, n]`` and a low-precision ``b``
    ``[n, K]`` (the hidden gradient ``dz W`` of float32 mode off CUDA), ``b`` upcast a block of
    rows at a time."""
    out = torch.zeros(a32.shape[0], b.shape[1], device=a32.device, dtype=torch.float32)
    step = _block_rows(b.shape[1])
    for v0 in range(0, b.shape[0], step):
        v1 = min(b.shape[0], v0 + step)
        out.addmm_(a32[:, v0:v1], b[v0:v1].float())
    return out


def buffer_rows(rows: int) -> int:
    """Rows of the chunk buffer for chunks of ``rows`` rows: at least ``MIN_ROWS``, so that a
    small chunk's matmul can be padded."""
    return max(rows, MIN_ROWS)


def project_chunk(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  buf: torch.Tensor, softcap: Optional[float] = None) -> torch.Tensor:
    """The chunk's logits ``[m, V]`` for its hidden rows ``h`` (``m`` rows), in ``buf[:m]``:
    one matmul of ``max(m, MIN_ROWS)`` rows, or of all ``buf``'s rows in batch-invariant mode,
    the extra rows zero (their logits are never read)."""
    m = h.shape[0]
    rows = buf.shape[0] if batch_invariant() else min(buf.shape[0], max(m, MIN_ROWS))
    if m >= rows:
        return project(h, weight, bias, buf[:m], softcap)
    hp = h.new_zeros(rows, h.shape[1])
    hp[:m] = h
    project(hp, weight, bias, buf[:rows], softcap)
    return buf[:m]


def project(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            out: torch.Tensor, softcap: Optional[float] = None) -> torch.Tensor:
    """out = h @ weight.T + bias, written into the preallocated chunk buffer; with ``softcap``
    (Gemma's final-logit soft-capping) ``out = c * tanh(out / c)`` in place: the row passes see
    the capped logits, and the gradient pass multiplies by ``1 - (out / c)^2``.

    A float32 ``out`` for low-precision ``h`` and ``weight`` (``logits_dtype=torch.float32``):
    the float32 head's ``h.float() @ weight.float().T + bias.float()`` by :func:`mm_fp32`, the
    bias and the soft-cap applied in float32."""
    if out.dtype != h.dtype:
        mm_fp32(h, weight, out)
        if bias is not None:
            out.add_(bias.float())
        if softcap is not None:
            out.div_(softcap).tanh_().mul_(softcap)
        return out
    if softcap is None:
        if bias is None:
            return torch.mm(h, weight.t(), out=out)
        return torch.addmm(bias, h, weight.t(), out=out)
    # x / c folded into the matmul (alpha, beta): two passes over the chunk, tanh and * c
    inv = 1.0 / softcap
    if bias is None:        # beta = 0: the (uninitialised) buffer is not read
        torch.addmm(out, h, weight.t(), beta=0.0, alpha=inv, out=out)
    else:
        torch.addmm(bias, h, weight.t(), beta=inv, alpha=inv, out=out)
    return out.tanh_().mul_(softcap)
