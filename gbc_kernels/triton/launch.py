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
# The token-local loss takes the one-pass row kernel (policy_rows_kernel); False composes the
# three kernels (statistics, token loss, gradient) as the other objectives do. A switch for
# benchmarks/profile_gpu.py's side-by-side measurement and for the tests of both paths.
ONE_PASS = True


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


def _inv_temp(inv_temp, dummy):
    """(per-row pointer, scalar, per-row?) for a float or a float32 ``[rows]`` tensor."""
    if isinstance(inv_temp, torch.Tensor):
        return inv_temp.float().contiguous(), 1.0, True
    return dummy, float(inv_temp), False


def launch_row_stats(logits, targets, inv_temp, want_entropy, want_sum_p2) -> RowStats:
    _check(logits)
    rows, V = logits.shape
    f32 = dict(device=logits.device, dtype=torch.float32)
    lse, zmax, tz = (torch.empty(rows, **f32) for _ in range(3))
    ent = torch.empty(rows, **f32) if want_entropy else lse
    sp2 = torch.empty(rows, **f32) if want_sum_p2 else lse
    if rows:
        bv = block_v(V)
        itemp, it, per_row = _inv_temp(inv_temp, lse)
        K.row_stats_kernel[(rows,)](logits, logits.stride(0), targets, lse, zmax, tz, ent, sp2,
                                    itemp, V, it, BLOCK_V=bv,
                                    WANT_ENTROPY=bool(want_entropy),
                                    WANT_SUM_P2=bool(want_sum_p2), ROW_TEMP=per_row,
                                    num_warps=num_warps(bv), **_opts())
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
        itemp, it, per_row = _inv_temp(inv_temp, lse)
        K.logit_grad_kernel[(rows,)](logits, logits.stride(0), targets, f(lse),
                                     f(entropy) if has_h else lse, f(g_logp),
                                     f(g_entropy) if has_h else lse, itemp, V, it,
                                     0.0 if softcap is None else 1.0 / float(softcap),
                                     BLOCK_V=bv, HAS_ENTROPY=has_h, SOFTCAP=softcap is not None,
                                     ROW_TEMP=per_row, num_warps=num_warps(bv), **_opts())
    return logits


_TOKEN_OUTPUTS = ("g", "gh", "wloss", "logp", "ratio", "adv", "ar", "p_old", "kl")


def _token_args(n, device, w, adv, old, ref, tscale, klw, cfg, phase, dummy):
    """The per-token inputs, outputs (a dict of float32 ``[n]`` views of one allocation),
    scalars and constexpr flags shared by ``policy_token_kernel`` and ``policy_rows_kernel``."""
    from ..config import KL_ESTIMATORS
    out = dict(zip(_TOKEN_OUTPUTS, torch.empty(len(_TOKEN_OUTPUTS), n, device=device,
                                               dtype=torch.float32).unbind(0)))
    has_kl = cfg.kl_coef != 0.0

    def f(t, use=True):
        return t.float().contiguous() if t is not None and use else dummy
    inputs = [f(w), f(adv), f(old), f(ref, has_kl), f(tscale), f(klw, has_kl)]
    scalars = [float(cfg.epsilon_low), float(cfg.epsilon_high), float(cfg.clip_ratio_c or 0.0),
               float(cfg.kl_coef), float(cfg.entropy_coef), float(cfg.ar_alpha),
               float(cfg.lopti_eta or 0.0)]
    flags = dict(HAS_OLD=old is not None, HAS_TS=tscale is not None,
                 HAS_KLW=klw is not None and has_kl, HAS_KL=has_kl,
                 KL_EST=KL_ESTIMATORS.index(cfg.kl_estimator),
                 HAS_ENTROPY=cfg.entropy_coef != 0.0, HAS_AR=cfg.ar_alpha != 0.0,
                 HAS_DUAL=cfg.clip_ratio_c is not None, PHASE=_PHASE[phase],
                 KL_RATIO=bool(cfg.kl_ratio_correction and has_kl))
    return inputs, out, scalars, flags


def launch_policy_tokens(st: RowStats, w, adv, old, ref, tscale, klw, cfg, phase):
    """The per-token loss (docs/math.md §1-§3) over a chunk from its row statistics: a dict of
    float32 [rows] tensors."""
    n = st.lse.numel()
    inputs, out, scalars, flags = _token_args(n, st.lse.device, w, adv, old, ref, tscale, klw,
                                              cfg, phase, st.lse)
    if n:
        ent = st.entropy if flags["HAS_ENTROPY"] else st.lse
        K.policy_token_kernel[(triton.cdiv(n, TOKEN_BLOCK),)](
            st.target_z, st.lse, ent, *inputs, out["g"], out["gh"], out["wloss"], out["logp"],
            out["ratio"], out["adv"], out["ar"], out["p_old"], out["kl"], n, *scalars,
            BLOCK=TOKEN_BLOCK, num_warps=4, **flags, **_opts())
    return out


def launch_policy_rows_(logits, targets, inv_temp, w, adv, old, ref, tscale, klw, cfg, phase,
                        need_grad):
    """The one-pass row kernel over a chunk: per-token outputs as ``launch_policy_tokens``
    plus ``entropy`` (None unless ``cfg.wants_entropy``) and ``sum_p2``; with ``need_grad`` the
    logit gradient is written into ``logits`` in place."""
    _check(logits)
    rows, V = logits.shape
    stats = torch.empty(2, rows, device=logits.device, dtype=torch.float32)
    inputs, out, scalars, flags = _token_args(rows, logits.device, w, adv, old, ref, tscale,
                                              klw, cfg, phase, stats[1])
    if rows:
        bv = block_v(V)
        cap = cfg.logit_softcap
        K.policy_rows_kernel[(rows,)](
            logits, logits.stride(0), targets, stats[0], stats[1], *inputs,
            out["g"], out["gh"], out["wloss"], out["logp"], out["ratio"], out["adv"],
            out["ar"], out["p_old"], out["kl"], V, float(inv_temp),
            0.0 if cap is None else 1.0 / float(cap), *scalars, BLOCK_V=bv,
            NEED_GRAD=bool(need_grad), SOFTCAP=cap is not None,
            WANT_ENTROPY=bool(cfg.wants_entropy), num_warps=num_warps(bv), **flags, **_opts())
    out["entropy"] = stats[0] if cfg.wants_entropy else None
    out["sum_p2"] = stats[1]
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
        if ONE_PASS:
            o = launch_policy_rows_(logits, targets, inv_temp, w, adv, old, ref, tscale, klw,
                                    cfg, phase, need_grad)
            entropy, sum_p2 = o["entropy"], o["sum_p2"]
        else:
            st = launch_row_stats(logits, targets, inv_temp, cfg.wants_entropy, True)
            o = launch_policy_tokens(st, w, adv, old, ref, tscale, klw, cfg, phase)
            if need_grad:
                launch_logit_grad_(logits, targets, inv_temp, st.lse, st.entropy, o["g"],
                                   o["gh"] if cfg.entropy_coef != 0.0 else None,
                                   cfg.logit_softcap)
            entropy, sum_p2 = st.entropy, st.sum_p2
        terms = TokenTerms(ratio=o["ratio"], adv=o["adv"], ar=o["ar"], p_old=o["p_old"],
                           kl=o["kl"] if cfg.kl_coef != 0.0 else None)
        return ChunkResult(o["logp"], entropy, sum_p2, o["g"], terms, o["wloss"].sum())
