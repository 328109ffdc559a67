"""CPU backend: the C++ streaming passes of ``csrc/gbc_cpu.cpp`` (pybind11 extension
``gbc_kernels._C``). The chunk's logits are produced by the driver's BLAS call; these passes
run over the buffer in place, in float32, rows in parallel, no [rows, V] temporaries."""

from __future__ import annotations

import torch

from .base import Backend, ChunkResult, RowStats, Workspace

try:
    from .. import _C  # type: ignore[attr-defined]
    _IMPORT_ERROR = None
except ImportError as exc:   # built without a compiler, or an isolated build without torch
    _C = None
    _IMPORT_ERROR = exc

_PHASE_CODE = {None: 0, "low": 1, "high": 2}
SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    return _C is not None


def unavailable_reason() -> str:
    return f"the C++ extension gbc_kernels._C was not built ({_IMPORT_ERROR})"


class CpuBackend(Backend):
    name = "cpu"
    buffers_per_chunk = 1   # the chunk's logits only; the passes work in place

    def row_stats(self, logits, targets, inv_temp, want_entropy, want_sum_p2, ws: Workspace):
        it, rows_t = _inv_temp(inv_temp)
        lse, zmax, tz, ent, sp2 = _C.row_stats(logits, targets, it, bool(want_entropy),
                                               bool(want_sum_p2), rows_t)
        return RowStats(lse, zmax, tz, ent if want_entropy else None,
                        sp2 if want_sum_p2 else None)

    def policy_rows_(self, logits, targets, inv_temp, ti, cfg, phase, need_grad,
                     ws: Workspace, combine=None) -> ChunkResult:
        from .._loss_math import TokenTerms
        from ..config import KL_ESTIMATORS

        # the objectives of §10 and vocab parallel: C++ row passes, PyTorch token math
        if combine is not None or not ti.native_ok(cfg):
            return super().policy_rows_(logits, targets, inv_temp, ti, cfg, phase, need_grad, ws,
                                        combine)
        out = _C.policy_rows_(
            logits, targets, float(inv_temp), ti.w_pg, ti.adv, ti.old, ti.ref, ti.tscale,
            ti.klw if cfg.kl_coef != 0.0 else None,
            cfg.epsilon_low, cfg.epsilon_high,
            -1.0 if cfg.clip_ratio_c is None else cfg.clip_ratio_c, cfg.kl_coef,
            KL_ESTIMATORS.index(cfg.kl_estimator), cfg.entropy_coef, cfg.ar_alpha,
            _PHASE_CODE[phase], 0.0 if cfg.lopti_eta is None else cfg.lopti_eta,
            bool(cfg.kl_ratio_correction), bool(need_grad), _inv_cap(cfg.logit_softcap))
        logp, entropy, sum_p2, g, wloss, ratio, adv_hat, ar, p_old, kl = out
        want_entropy = cfg.wants_entropy
        # the loss is returned already weighted (wloss); the metrics need only the fields below
        terms = TokenTerms(ratio=ratio, adv=adv_hat, ar=ar, p_old=p_old,
                           kl=kl if cfg.kl_coef != 0.0 else None)
        return ChunkResult(logp, entropy if want_entropy else None, sum_p2, g, terms,
                           wloss.sum())

    def logit_grad_(self, logits, targets, inv_temp, lse, entropy, g_logp, g_entropy,
                    ws: Workspace, softcap=None):
        it, rows_t = _inv_temp(inv_temp)
        return _C.logit_grad_(logits, targets, it, lse, entropy, g_logp, g_entropy,
                              _inv_cap(softcap), rows_t)


def _inv_temp(inv_temp):
    """(scalar, per-row tensor or None): the C++ passes take a float32 ``[rows]`` tensor of
    per-row inverse temperatures beside the scalar."""
    if isinstance(inv_temp, torch.Tensor):
        return 1.0, inv_temp.float().contiguous()
    return float(inv_temp), None


def _inv_cap(softcap) -> float:
    return 0.0 if softcap is None else 1.0 / float(softcap)
