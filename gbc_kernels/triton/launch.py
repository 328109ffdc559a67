"""Launchers of the Triton kernels and the Backend that uses them.

Block sizes: ``BLOCK_V`` = the next power of two of V, capped at 4096 (one program streams the
row in tiles); 8 warps from 2048 up. No host sync: every launch reads device tensors only.
"""

from __future__ import annotations

import os

import torch
import triton

from ..backends.base import Backend, ChunkResult, RowStats, Workspace
from . import kernels as K

# FP fusion off: z = x * inv_temp is then rounded the same way wherever it is formed, so
# z - max(z) is exactly 0 at the max (with an FMA, p != 1 at p -> 1 for large logits).
COMPILE_OPTIONS = {"enable_fp_fusion": False}
MAX_BLOCK_V = 4096
TOKEN_BLOCK = 256
_PHASE = {None: 0, "low": 1, "high": 2}


def block_v(V: int) -> int:
    return min(MAX_BLOCK_V, triton.next_power_of_2(V))


def num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _opts() -> dict:
    """Compile options for a launch (the interpreter takes none)."""
    return {} if interpreting() else COMPILE_OPTIONS


def _check(logits: torch.Tensor):
    if logits.stride(1) != 1:
        raise ValueError("logits: expected unit stride over the vocabulary")


def launch_row_stats(logits, targets, inv_temp, want_entropy, want_sum_p2) -> RowStats:
    _check(logits)
    rows, V = logits.shape
    f32 = dict(device=logits.device, dtype=torch.float32)
    lse, zmax, tz = (torch.empty(rows, **f32) for _ in range(3))
    ent = torch.empty(rows, **f32) if want_entropy else lse
    sp2 = torch.empty(rows, **f32) if want_sum_p2 else lse
    if rows:
        bv = block_v(V)
        K.row_stats_kernel[(rows,)](logits, logits.stride(0), targets, lse, zmax, tz, ent, sp2,
                                    V, float(inv_temp), BLOCK_V=bv,
                                    WANT_ENTROPY=bool(want_entropy),
                                    WANT_SUM_P2=bool(want_sum_p2), num_warps=num_warps(bv),
                                    **_opts())
    return RowStats(lse, zmax, tz, ent if want_entropy else None,
                    sp2 if want_sum_p2 else None)


def launch_logit_grad_(logits, targets, inv_temp, lse, entropy, g_logp, g_entropy,
                       softcap=None):
    _check(logits)
    rows, V = logits.shape
    has_h = g_entropy is not None
    if rows:
        bv = block_v(V)
        f = lambda t: t.float().contiguous()
        K.logit_grad_kernel[(rows,)](logits, logits.stride(0), targets, f(lse),
                                     f(entropy) if has_h else lse, f(g_logp),
                                     f(g_entropy) if has_h else lse, V, float(inv_temp),
                                     0.0 if softcap is None else 1.0 / float(softcap),
                                     BLOCK_V=bv, HAS_ENTROPY=has_h, SOFTCAP=softcap is not None,
                                     num_warps=num_warps(bv), **_opts())
    return logits


def launch_policy_tokens(st: RowStats, w, adv, old, ref, tscale, klw, cfg, phase):
    """The per-token loss (docs/math.md §1-§3) over a chunk: a dict of float32 [rows]
    tensors."""
    n = st.lse.numel()
    f32 = dict(device=st.lse.device, dtype=torch.float32)
    names = ("g", "gh", "wloss", "logp", "ratio", "adv", "ar", "p_old", "kl")
    out = {k: torch.empty(n, **f32) for k in names}
    has_kl = cfg.kl_coef != 0.0
    has_ent = cfg.entropy_coef != 0.0
    f = lambda t: None if t is None else t.float().contiguous()
    dummy = st.lse
    if n:
        from ..config import KL_ESTIMATORS
        K.policy_token_kernel[(triton.cdiv(n, TOKEN_BLOCK),)](
            st.target_z, st.lse, st.entropy if has_ent else dummy, f(w), f(adv),
            f(old) if old is not None else dummy, f(ref) if has_kl else dummy,
            f(tscale) if tscale is not None else dummy, f(klw) if klw is not None else dummy,
            out["g"], out["gh"], out["wloss"], out["logp"], out["ratio"], out["adv"],
            out["ar"], out["p_old"], out["kl"], n,
            float(cfg.epsilon_low), float(cfg.epsilon_high),
            float(cfg.clip_ratio_c or 0.0), float(cfg.kl_coef), float(cfg.entropy_coef),
            float(cfg.ar_alpha), float(cfg.lopti_eta or 0.0),
            BLOCK=TOKEN_BLOCK, HAS_OLD=old is not None, HAS_TS=tscale is not None,
            HAS_KLW=klw is not None and has_kl, HAS_KL=has_kl,
            KL_EST=KL_ESTIMATORS.index(cfg.kl_estimator), HAS_ENTROPY=has_ent,
            HAS_AR=cfg.ar_alpha != 0.0, HAS_DUAL=cfg.clip_ratio_c is not None,
            PHASE=_PHASE[phase], KL_RATIO=bool(cfg.kl_ratio_correction and has_kl),
            num_warps=4, **_opts())
    return out


SCALE_BLOCK = 4096
SCALE_PROGRAMS = 1024     # programs of the in-place scale: a few waves on an H100's 132 SMs


def launch_scale_unless_one_(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``x *= g`` in place unless the device scalar ``g`` is 1 (checked on the device: no host
    sync). ``x`` contiguous; ``g`` a one-element tensor on ``x``'s device."""
    if not x.is_contiguous():
        raise ValueError("x: expected a contiguous tensor")
    n = x.numel()
    if n:
        grid = (min(SCALE_PROGRAMS, triton.cdiv(n, SCALE_BLOCK)),)
        K.scale_unless_one_kernel[grid](x, n, g.reshape(()).float(), BLOCK=SCALE_BLOCK,
                                        num_warps=4, **_opts())
    return x


class TritonBackend(Backend):
    name = "triton"
    buffers_per_chunk = 1

    def row_stats(self, logits, targets, inv_temp, want_entropy, want_sum_p2, ws: Workspace):
        return launch_row_stats(logits, targets, inv_temp, want_entropy, want_sum_p2)

    def logit_grad_(self, logits, targets, inv_temp, lse, entropy, g_logp, g_entropy,
                    ws: Workspace, softcap=None):
        return launch_logit_grad_(logits, targets, inv_temp, lse, entropy, g_logp, g_entropy,
                                  softcap)

    def policy_rows_(self, logits, targets, inv_temp, ti, cfg, phase, need_grad,
                     ws: Workspace, combine=None) -> ChunkResult:
        from .._loss_math import TokenTerms

        # the objectives of §10 and vocab parallel: Triton row passes, PyTorch token math
        if combine is not None or not ti.native_ok(cfg):
            return super().policy_rows_(logits, targets, inv_temp, ti, cfg, phase, need_grad, ws,
                                        combine)
        w, adv, old, ref, tscale = ti.w_pg, ti.adv, ti.old, ti.ref, ti.tscale
        klw = ti.klw if cfg.kl_coef != 0.0 else None
        st = launch_row_stats(logits, targets, inv_temp, cfg.wants_entropy, True)
        o = launch_policy_tokens(st, w, adv, old, ref, tscale, klw, cfg, phase)
        if need_grad:
            launch_logit_grad_(logits, targets, inv_temp, st.lse, st.entropy, o["g"],
                               o["gh"] if cfg.entropy_coef != 0.0 else None, cfg.logit_softcap)
        terms = TokenTerms(ratio=o["ratio"], adv=o["adv"], ar=o["ar"], p_old=o["p_old"],
                           kl=o["kl"] if cfg.kl_coef != 0.0 else None)
        return ChunkResult(o["logp"], st.entropy, st.sum_p2, o["g"], terms, o["wloss"].sum())
