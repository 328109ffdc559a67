"""Backend selection. See ``base.Backend`` for the interface every backend implements."""

from __future__ import annotations

import os
import warnings

import torch

from . import cpu_backend
from .base import Backend, RowStats, Workspace
from .torch_backend import TorchBackend

_TORCH = TorchBackend()
_CPU = cpu_backend.CpuBackend() if cpu_backend.available() else None
_TRITON = None
_warned_fallback = False


def _triton_backend():
    """The Triton backend, imported on first use (so `import gbc_kernels` needs no triton)."""
    global _TRITON
    if _TRITON is None:
        try:
            from ..triton.launch import TritonBackend
        except ImportError as exc:
            raise RuntimeError(f"backend='triton': triton is not importable ({exc}); "
                               "pip install triton") from exc
        _TRITON = TritonBackend()
    return _TRITON


def triton_usable(device: torch.device) -> bool:
    """CUDA tensors with triton installed, or CPU tensors under TRITON_INTERPRET=1."""
    if device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET", "0") == "1" and _has_triton()
    return device.type == "cuda" and _has_triton()


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
        return True
    except ImportError:
        return False


def cpu_available() -> bool:
    return _CPU is not None


def _warn_fallback_once():
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(f"gbc_kernels: {cpu_backend.unavailable_reason()}; backend='auto' uses the "
                      "chunked PyTorch path on CPU (slower). Reinstall with "
                      "`pip install --no-build-isolation .` and a C++ compiler to get it.",
                      RuntimeWarning, stacklevel=3)


def get_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> Backend:
    """Resolve ``backend=`` for tensors on ``device`` of ``dtype``.

    ``auto``: the compiled C++ kernels on CPU tensors (float32/bfloat16/float16), Triton on CUDA
    tensors, the chunked PyTorch path elsewhere and wherever the faster one is unavailable.
    """
    if name == "torch":
        return _TORCH
    if name == "cpu":
        if _CPU is None:
            raise RuntimeError(f"backend='cpu': {cpu_backend.unavailable_reason()}; use "
                               "backend='auto' or 'torch', or reinstall with "
                               "`pip install --no-build-isolation .`")
        if device.type != "cpu":
            raise ValueError(f"backend='cpu': expected CPU tensors, got tensors on {device}")
        if dtype not in cpu_backend.SUPPORTED:
            raise TypeError(f"backend='cpu': expected hidden of dtype float32, bfloat16 or "
                            f"float16, got {dtype}")
        return _CPU
    if name == "triton":
        if not triton_usable(device):
            raise ValueError(f"backend='triton': expected CUDA tensors (or CPU tensors with "
                             f"TRITON_INTERPRET=1 and triton installed), got tensors on {device}")
        if dtype not in cpu_backend.SUPPORTED:
            raise TypeError(f"backend='triton': expected hidden of dtype float32, bfloat16 or "
                            f"float16, got {dtype}")
        return _triton_backend()
    if name == "auto":
        if device.type == "cuda" and dtype in cpu_backend.SUPPORTED and _has_triton():
            return _triton_backend()
        if device.type == "cpu" and dtype in cpu_backend.SUPPORTED:
            if _CPU is not None:
                return _CPU
            _warn_fallback_once()
        return _TORCH
    raise ValueError(f"backend: expected 'auto', 'torch', 'cpu' or 'triton', got {name!r}")


__all__ = ["Backend", "RowStats", "Workspace", "get_backend", "cpu_available", "triton_usable"]
