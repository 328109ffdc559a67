"""Backend selection. See ``base.Backend`` for the interface every backend implements."""

from __future__ import annotations

import warnings

import torch

from . import cpu_backend
from .base import Backend, RowStats, Workspace
from .torch_backend import TorchBackend

_TORCH = TorchBackend()
_CPU = cpu_backend.CpuBackend() if cpu_backend.available() else None
_warned_fallback = False


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
    if name == "auto":
        if device.type == "cpu" and dtype in cpu_backend.SUPPORTED:
            if _CPU is not None:
                return _CPU
            _warn_fallback_once()
        return _TORCH
    raise ValueError(f"backend: {name!r} is not available in this build; expected 'auto', "
                     "'torch' or 'cpu'")


__all__ = ["Backend", "RowStats", "Workspace", "get_backend", "cpu_available"]
