"""Backend selection. See ``base.Backend`` for the interface."""

from __future__ import annotations

import torch

from .base import Backend, RowStats
from .torch_backend import TorchBackend

_TORCH = TorchBackend()


def get_backend(name: str, device: torch.device) -> Backend:
    """Resolve ``backend=`` for tensors on ``device``.

    ``auto``: Triton on CUDA tensors, the compiled C++ kernels on CPU tensors, the chunked PyTorch
    path elsewhere (and wherever the faster backend is unavailable).
    """
    if name in ("auto", "torch"):
        return _TORCH
    raise ValueError(f"backend: {name!r} is not available in this build; expected 'auto' or "
                     "'torch'")


__all__ = ["Backend", "RowStats", "get_backend"]
