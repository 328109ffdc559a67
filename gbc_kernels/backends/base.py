"""The small interface every backend implements: streaming primitives over a chunk of logits.

The public API (config, validation, chunk loop, matmuls, autograd glue) lives above this
interface and is written once; a backend only supplies the two passes over ``[rows, V]``:

* ``row_stats``: per row of ``z = logits * inv_temp``: LSE, max, the target's ``z``, and when
  asked the entropy ``H = LSE - sum_v p_v z_v`` and ``sum_v p_v^2``. All float32.
* ``logit_grad_``: overwrite the chunk buffer with ``dL/dlogits`` given ``g = dL/dlogp`` and
  ``gH = dL/dH`` per row:

      dL/dz_v = g * (1[v = y] - p_v) - gH * p_v * (log p_v + H),   dL/dlogits = inv_temp * dL/dz

  With final-logit soft-capping the buffer holds the capped logits ``s = c tanh(x / c)`` (the
  driver caps it after the matmul) and ``logit_grad_(..., softcap=c)`` returns ``dL/dx``, the
  above times ``1 - (s / c)^2``.

A target id of ``-1`` means "not in this chunk's vocabulary slice" (vocab parallel): the
target's ``z`` is 0 and never read, and the gradient has no one-hot term.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class Workspace:
    """Scratch buffers reused across the chunks of one sweep (allocating fresh [rows, V]
    temporaries per chunk fragments the CPU heap: RSS then grows by gigabytes)."""

    def __init__(self):
        self._bufs = {}

    def get(self, name: str, rows: int, cols: int, like: torch.Tensor,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
        b = self._bufs.get(name)
        if b is None or b.shape[0] < rows or b.shape[1] != cols or b.dtype != dtype:
            b = torch.empty(rows, cols, device=like.device, dtype=dtype)
            self._bufs[name] = b
        return b[:rows]


class RowStats(NamedTuple):
    lse: torch.Tensor                 # [rows] float32, logsumexp of z
    zmax: torch.Tensor                # [rows] float32, max of z
    target_z: torch.Tensor            # [rows] float32, z[target]
    entropy: Optional[torch.Tensor]   # [rows] float32 or None
    sum_p2: Optional[torch.Tensor]    # [rows] float32 or None


class ChunkResult(NamedTuple):
    """Per-token results of the fused policy pass over one chunk of rows."""

    logp: torch.Tensor
    entropy: Optional[torch.Tensor]
    sum_p2: torch.Tensor
    g: torch.Tensor          # w_agg * dl/dlogp (what the gradient pass used)
    terms: object            # _loss_math.TokenTerms (the metric inputs)
    loss_sum: torch.Tensor   # sum_r w_agg[r] * l[r] over the chunk (0-d)


class Backend:
    name = "base"
    # How many [rows, V] buffers the backend's passes hold at once: the chunk's logits (in the
    # input dtype) and ``buffers_per_chunk - 1`` float32 temporaries (chunk sizing).
    buffers_per_chunk = 1

    def bytes_per_logit(self, dtype: torch.dtype) -> int:
        """Working-set bytes per logit of a chunk whose logits are ``dtype``."""
        return dtype.itemsize + 4 * (self.buffers_per_chunk - 1)

    def row_stats(self, logits: torch.Tensor, targets: torch.Tensor, inv_temp: float,
                  want_entropy: bool, want_sum_p2: bool, ws: Workspace) -> RowStats:
        raise NotImplementedError

    def policy_rows_(self, logits, targets, inv_temp, ti, cfg, phase, need_grad: bool,
                     ws: Workspace, combine=None) -> ChunkResult:
        """The fused loss's work on one chunk: row statistics, the per-token loss of docs/math.md
        §1-§3, §10 (``_loss_math.loss_terms`` over ``ti``, a ``TokenInputs`` of the chunk's
        tokens, whole sequences when the loss needs them), and (``need_grad``) dL/dlogits
        written into ``logits``.

        This generic version composes the two primitives with the PyTorch per-token math; a
        backend may override it with one pass that keeps each row in cache. ``combine`` (vocab
        parallel) turns the slice's row statistics into the global ones before the loss.
        """
        from .._loss_math import loss_terms   # local: the loss math sits above the backends

        st = self.row_stats(logits, targets, inv_temp, cfg.wants_entropy, True, ws)
        if combine is not None:
            st = combine(st)
        logp = st.target_z - st.lse
        ct = ti.adv.dtype
        ent = None if st.entropy is None else st.entropy.to(ct)
        lt = loss_terms(logp.to(ct), ent, ti, cfg, phase)
        if need_grad:
            self.logit_grad_(logits, targets, inv_temp, st.lse, st.entropy, lt.g, lt.gH, ws,
                             cfg.logit_softcap)
        return ChunkResult(logp, st.entropy, st.sum_p2, lt.g, lt.terms, lt.loss_sum)

    def logit_grad_(self, logits: torch.Tensor, targets: torch.Tensor, inv_temp: float,
                    lse: torch.Tensor, entropy: Optional[torch.Tensor], g_logp: torch.Tensor,
                    g_entropy: Optional[torch.Tensor], ws: Workspace,
                    softcap: Optional[float] = None) -> torch.Tensor:
        raise NotImplementedError
