"""Vocab-parallel lm_head (SPEC §9): each rank holds rows ``[start, end)`` of the weight.

Every rank passes the same hidden states, targets (global ids) and per-token inputs. Two sweeps
over the local slice, one chunk of rows at a time:

1. statistics of the local logits per row — max ``m_r``, ``s_r = Σ exp(z - m_r)``,
   ``t_r = Σ exp(z - m_r) z``, ``q_r = Σ exp(2 (z - m_r))`` and the target logit when the target
   is in the slice — then two collectives per call (not per chunk): ``all_reduce(MAX)`` of the
   maxima, and ``all_reduce(SUM)`` of the rescaled sums and target logits. That gives the global
   ``LSE = M + log S``, entropy ``LSE - T / S``, ``Σ p² = Q / S²`` and ``logp = z[y] - LSE``, the
   same on every rank; the per-token loss, its normaliser and metrics follow as in one process.
2. the logit gradient of the local slice (``∂logp/∂z = onehot - p``, ``∂H/∂z = -p (z - Σ p z)``),
   its two matmuls into ``grad_weight[start:end]`` and this slice's part of ``grad_hidden``,
   which one ``all_reduce(SUM)`` completes.

The loss computes its gradients in the forward, like the one-device path (its backward only
scales them), so sweep 2 follows sweep 1 in the same call: four matmuls per chunk instead of
three, because the global LSE is known only after sweep 1. The collectives run outside the chunk
loops, so the ranks may chunk differently (uneven slices). The per-chunk math is PyTorch on
every device: this path is exact and memory-bounded, not yet kernel-fused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

import torch.distributed as dist

from . import _chunking
from ._validate import no_double_backward as _no_double_backward, resolve_group
from ._fused import save_grads, scale_stored_grads, token_inputs, with_entropy_mask
from ._loss_math import (certainty_from_stats, empty_metrics, logp_grad_norm, loss_terms,
                         policy_metrics)


@dataclass(frozen=True)
class VocabParallel:
    """This rank holds ``weight[start:end]`` (and ``bias[start:end]``) of the full lm_head.

    ``group``: the ``torch.distributed`` process group over which the vocabulary is split
    (None: the default group). The ranks' slices must tile ``[0, V)``.
    """

    group: object
    start: int
    end: int


@dataclass(frozen=True)
class _Slice:
    group: object
    start: int
    end: int
    vocab: int          # V of the full vocabulary
    softcap: Optional[float] = None     # final-logit soft-capping c (logits c tanh(x / c))


def check(vp, weight, bias, device, softcap=None) -> _Slice:
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
    return _Slice(group, vp.start, vp.end, covered,
                  None if softcap is None else float(softcap))


def _ct(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_logits(hc, weight, bias, inv_temp, ct, softcap=None):
    z = hc @ weight.t()
    if bias is not None:
        z = z + bias
    z = z.to(ct)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z * inv_temp


def _local_in_slice(y, sl: _Slice):
    inside = (y >= sl.start) & (y < sl.end)
    return inside, (y - sl.start).clamp(0, sl.end - sl.start - 1)


@torch.no_grad()
def row_stats(h2, weight, bias, y, sl: _Slice, temperature):
    """Global per-row statistics of ``z = (h W^T + b) / temperature`` over the split vocabulary:
    dict of [n] tensors ``lse, entropy, sum_p2, logp, zmax``."""
    n, device = h2.shape[0], h2.device
    ct = _ct(h2.dtype)
    inv_temp = 1.0 / temperature
    m = torch.empty(n, device=device, dtype=ct)
    sums = torch.empty(4, n, device=device, dtype=ct)        # s, t, q, target logit
    inside, local = _local_in_slice(y, sl)
    rows = _chunking.rows_per_chunk(n, weight.shape[0], 3 * ct.itemsize, device)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        z = _chunk_logits(h2[s:e], weight, bias, inv_temp, ct, sl.softcap)
        mc = z.max(-1).values
        ez = torch.exp(z - mc[:, None])
        m[s:e] = mc
        sums[0, s:e] = ez.sum(-1)
        sums[1, s:e] = (ez * z).sum(-1)
        sums[2, s:e] = (ez * ez).sum(-1)
        sums[3, s:e] = torch.where(inside[s:e], z.gather(1, local[s:e, None])[:, 0], 0.0)
    big = m.clone()
    dist.all_reduce(big, op=dist.ReduceOp.MAX, group=sl.group)
    scale = torch.exp(m - big)
    sums[0] *= scale
    sums[1] *= scale
    sums[2] *= scale * scale
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=sl.group)
    S, Tz, Q, zy = sums
    lse = big + torch.log(S)
    return dict(lse=lse, entropy=lse - Tz / S, sum_p2=Q / (S * S), logp=zy - lse, zmax=big)


def grads(h2, weight, bias, y, sl: _Slice, temperature, lse, entropy, g_logp, g_entropy,
          need_dh, need_dw, need_db):
    """Gradients of ``Σ g_logp logp + g_entropy H`` (per row) in hidden (all-reduced: the full
    gradient on every rank), the weight slice and the bias slice."""
    n, device = h2.shape[0], h2.device
    ct = _ct(h2.dtype)
    inv_temp = 1.0 / temperature
    inside, local = _local_in_slice(y, sl)
    gh = torch.zeros_like(h2) if need_dh else None
    gw = torch.zeros_like(weight) if need_dw else None
    gb = torch.zeros(weight.shape[0], device=device, dtype=ct) if need_db else None
    rows = _chunking.rows_per_chunk(n, weight.shape[0], 3 * ct.itemsize, device)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        hc = h2[s:e]
        z = _chunk_logits(hc, weight, bias, inv_temp, ct, sl.softcap)
        p = torch.exp(z - lse[s:e, None])
        gl = g_logp[s:e, None].to(ct)
        G = -p * gl
        G[torch.arange(e - s, device=device), local[s:e]] += torch.where(
            inside[s:e], gl[:, 0], 0.0)
        if g_entropy is not None:
            mean_z = (lse - entropy)[s:e, None]            # Σ p z = LSE - H
            G -= g_entropy[s:e, None].to(ct) * p * (z - mean_z)
        G = G * inv_temp
        if sl.softcap is not None:        # d(c tanh(x / c))/dx = 1 - (s / c)^2, s = z / inv_temp
            G = G * (1.0 - (z / (inv_temp * sl.softcap)) ** 2)
        G = G.to(weight.dtype)
        if gh is not None:
            gh[s:e] = G @ weight
        if gw is not None:
            gw.addmm_(G.t(), hc)
        if gb is not None:
            gb += G.to(ct).sum(0)
    if gh is not None:
        dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=sl.group)
    return gh, gw, None if gb is None else gb.to(bias.dtype)


# ----------------------------------------------------------------------------------------------
# the loss
# ----------------------------------------------------------------------------------------------


class _PolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden2d, weight, bias, args):
        (y, mask, adv, old, ref, tscale, klw, isr, sampling, cfg, phase, num_items, sl,
         threshold_fn, holder) = args
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = bias is not None and ctx.needs_input_grad[2]
        ct = _ct(hidden2d.dtype)
        idx = mask.reshape(-1).nonzero().squeeze(1)        # every rank holds the same mask
        h = hidden2d.detach().index_select(0, idx)
        yr = y.index_select(0, idx)
        st = row_stats(h, weight.detach(), None if bias is None else bias.detach(), yr, sl,
                       cfg.temperature)
        ti = token_inputs(mask, adv, old, ref, tscale, klw, isr, sampling, cfg, num_items, idx,
                          ct)
        ent = st["entropy"] if cfg.wants_entropy else None
        loss = torch.zeros((), device=hidden2d.device, dtype=ct)
        g = gH = None
        if idx.numel():
            # every rank holds every token: the batch-global entropy quantile is local
            ti = with_entropy_mask(ti, ent, cfg, mask, idx, ct, threshold_fn)
            lt = loss_terms(st["logp"].to(ct), None if ent is None else ent.to(ct), ti, cfg,
                            phase)
            loss, g, gH = lt.loss_sum, lt.g, lt.gH
            holder["metrics"] = policy_metrics(
                lt.terms, cfg, ent, logp_grad_norm(g, st["logp"], st["sum_p2"],
                                                   1.0 / cfg.temperature),
                mask.shape[0], ti.n_seq)
        else:
            if threshold_fn is not None:        # a collective: take part without tokens
                threshold_fn(st["logp"], cfg.top_entropy_quantile)
            holder["metrics"] = empty_metrics(cfg, hidden2d.device, mask.shape[0])
            g = torch.zeros(0, device=hidden2d.device, dtype=ct)
        gh_rows, gw, gb = grads(h, weight.detach(), None if bias is None else bias.detach(), yr,
                                sl, cfg.temperature, st["lse"], st["entropy"], g, gH,
                                need_dh, need_dw, need_db)
        gh = None
        if gh_rows is not None:
            gh = torch.zeros_like(hidden2d).index_copy_(0, idx, gh_rows)
        save_grads(ctx, gh, gw, gb)
        return loss.to(torch.float32 if ct == torch.float32 else ct)

    @staticmethod
    def backward(ctx, grad_loss):
        _no_double_backward()
        return (*scale_stored_grads(ctx, grad_loss), None)


def policy_loss(hidden, weight, bias, safe_targets, mask, adv, old, ref, tscale, klw, cfg,
                phase, num_items, sl: _Slice, is_ratio=None, sampling_logp=None,
                threshold_fn=None):
    B, T, H = hidden.shape
    holder = {}
    args = (safe_targets.reshape(-1), mask, adv, old, ref, tscale, klw, is_ratio, sampling_logp,
            cfg, phase, num_items, sl, threshold_fn, holder)
    loss = _PolicyLoss.apply(hidden.reshape(B * T, H), weight, bias, args)
    return loss, holder["metrics"]


# ----------------------------------------------------------------------------------------------
# log-probs, token statistics, NTHR
# ----------------------------------------------------------------------------------------------


class _Logprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden2d, weight, bias, y, temperature, return_entropy, sl):
        st = row_stats(hidden2d.detach(), weight.detach(),
                       None if bias is None else bias.detach(), y, sl, temperature)
        ctx.save_for_backward(hidden2d, weight, bias, y, st["lse"], st["entropy"])
        ctx.cfg = (temperature, return_entropy, sl)
        if return_entropy:
            return st["logp"].float(), st["entropy"].float()
        return st["logp"].float()

    @staticmethod
    def backward(ctx, g_logp, g_entropy=None):
        _no_double_backward()
        h, w, b, y, lse, ent = ctx.saved_tensors
        temperature, return_entropy, sl = ctx.cfg
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = b is not None and ctx.needs_input_grad[2]
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        gh, gw, gb = grads(h.detach(), w.detach(), None if b is None else b.detach(), y, sl,
                           temperature, lse, ent, g_logp,
                           g_entropy if return_entropy else None, need_dh, need_dw, need_db)
        return gh, gw, gb, None, None, None, None


def logprobs(hidden, weight, bias, safe_targets, temperature, return_entropy, sl: _Slice):
    h2 = hidden.reshape(-1, hidden.shape[-1])
    out = _Logprobs.apply(h2, weight, bias, safe_targets.reshape(-1), float(temperature),
                          bool(return_entropy), sl)
    shape = safe_targets.shape
    if return_entropy:
        return out[0].view(shape), out[1].view(shape)
    return out.view(shape), None


@torch.no_grad()
def token_stats(hidden, weight, bias, safe_targets, temperature, certainty,
                certainty_temperature, sl: _Slice):
    h2 = hidden.reshape(-1, hidden.shape[-1]).detach()
    y = safe_targets.reshape(-1)
    w, b = weight.detach(), None if bias is None else bias.detach()
    st = row_stats(h2, w, b, y, sl, temperature)
    cert = None
    if certainty is not None:
        cst = st if certainty_temperature == temperature else row_stats(
            h2, w, b, y, sl, certainty_temperature)
        cert = certainty_from_stats(certainty, cst["entropy"], cst["zmax"], cst["lse"],
                                    sl.vocab).float().view(safe_targets.shape)
    shape = safe_targets.shape
    return st["logp"].float().view(shape), st["entropy"].float().view(shape), cert


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
