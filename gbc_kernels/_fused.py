"""The chunk loop shared by every backend, and the autograd Functions around it.

``fused_linear_policy_loss`` does three matmuls per chunk of masked-in rows during the forward
(logits, grad-hidden, grad-weight): the per-token loss and its normaliser are known there, so
``dL/dlogits`` is written into the chunk buffer right after the row statistics. ``backward`` only
scales the stored gradients by the upstream gradient (the loss is used linearly).
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional

import torch

from . import _chunking
from . import objectives as _objectives
from . import sequence_parallel as _sp
from . import vocab_parallel as _vp
from ._loss_math import (TokenInputs, aggregation_weights, concat_terms,
                         empty_metrics, logp_grad_norm, local_ids, loss_terms, own_norms,
                         policy_metrics, term_weights)
from ._validate import Checks, no_double_backward as _no_double_backward
from .backends import Backend, triton_usable
from .backends.base import Workspace
from .config import PolicyLossConfig


@dataclass
class LossInputs:
    """Everything of the loss that is not differentiated (one object, so that the autograd
    Function's signature stays short)."""

    targets: torch.Tensor                # [N] int64, safe ids
    mask: torch.Tensor                   # [B, T] bool
    advantages: torch.Tensor             # [B, T] (broadcast view allowed)
    old_logp: Optional[torch.Tensor]
    ref_logp: Optional[torch.Tensor]
    token_scale: Optional[torch.Tensor]
    kl_weight: Optional[torch.Tensor]
    config: PolicyLossConfig
    phase: Optional[str]
    num_items_in_batch: object
    backend: Backend
    is_ratio: Optional[torch.Tensor] = None
    sampling_logp: Optional[torch.Tensor] = None
    threshold_fn: Optional[object] = None           # data-parallel entropy quantile
    checks: Optional[Checks] = None                  # value checks, resolved before any kernel
    vp: Optional[_vp._Slice] = None                  # vocab parallel: this rank's lm_head slice
    inv_temp: Optional[torch.Tensor] = None          # [B*T] float32 per-token 1/temperature
    metrics: dict = field(default_factory=dict)     # filled by the forward
    logp: Optional[torch.Tensor] = None              # [B, T] float32, filled by the forward
    entropy: Optional[torch.Tensor] = None           # [B, T] float32 when computed (forward)
    want_sum_p2: bool = False                        # keep sum_v p_v^2 per token (token_out)
    sum_p2: Optional[torch.Tensor] = None            # [B, T] float32 when asked (forward)
    sp: Optional[_sp._Group] = None                  # sequence parallel: the sequences' group


def token_inputs(mask, advantages, old, ref, tscale, klw, is_ratio, sampling, cfg, num_items,
                 idx, ct, inv_temp=None, sp=None) -> TokenInputs:
    """The per-token inputs of the masked tokens ``idx`` (flat indices into ``mask``, sorted),
    with their aggregation weights and, when the loss needs them, their sequence ids.
    ``sp`` (sequence parallel): the weights' counts are the group's; the sequence ids are the
    row ids ``0 .. B - 1``, with each row's token count over the group."""
    def take(t):
        return None if t is None else t.reshape(-1)[idx].to(ct)

    w_pg, w_kl, w_ent = (w.reshape(-1)[idx] for w in term_weights(mask, cfg, num_items, ct,
                                                                   sp=sp))
    seq, n_seq, lengths, cnt = None, 0, None, None
    if cfg.needs_sequence and sp is not None:
        seq, n_seq = idx // mask.shape[1], mask.shape[0]
        cnt = sp.sum(mask.sum(-1, dtype=ct))
    elif cfg.needs_sequence:
        seq, n_seq, lengths = local_ids(idx // mask.shape[1], with_lengths=True)
    return TokenInputs(take(advantages), take(old), take(ref), take(tscale), take(klw),
                       take(is_ratio), take(sampling), w_pg, w_kl, w_ent, seq, n_seq,
                       seq_lengths=lengths, norms=num_items,
                       itemp=None if inv_temp is None else inv_temp.reshape(-1)[idx],
                       sp=sp, cnt=cnt)


def n_seq_nonempty(ti: TokenInputs):
    """The sequences with a masked-in token (vespo's ``phi_mean``): this call's, or over the
    group's ranks (sequence parallel)."""
    return ti.n_seq if ti.cnt is None else (ti.cnt > 0).sum()


def entropy_threshold(entropy: torch.Tensor, quantile: float) -> torch.Tensor:
    """The (1 - quantile) quantile of the entropies, linear interpolation (torch.quantile), in
    their own precision (float64 stays float64: a float32 threshold can round above the float64
    entropy it equals and drop that token)."""
    values = entropy if entropy.dtype in (torch.float32, torch.float64) else entropy.float()
    if values.numel() == 0:
        return torch.full((), float("inf"), device=values.device)
    if values.numel() <= 2 ** 24 - 1:     # torch.quantile's input limit
        return torch.quantile(values, 1.0 - quantile)
    srt = values.sort().values
    pos = (1.0 - quantile) * (srt.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, srt.numel() - 1)
    return torch.lerp(srt[lo], srt[hi], pos - lo)


def gathered_threshold(process_group, sp=None):
    """A ``threshold_fn`` computing the quantile over every rank's entropies (TRL gathers them
    over all processes). ``process_group``: a ProcessGroup, ``"world"`` (the default group), or
    None (no data-parallel gather) with ``sp``: the sequence-parallel group's tokens are
    gathered first (the whole sequences), then the data-parallel ranks' (the whole batch).
    A collective: every rank of the groups must call it, with or without tokens."""
    from ._validate import resolve_group

    groups = [] if sp is None else [sp]
    if process_group is not None:
        groups.append(_sp._Group(resolve_group(
            "data_parallel_group", None if process_group == "world" else process_group)))

    def fn(entropy, quantile):
        every = entropy.detach().reshape(-1)
        if every.dtype not in (torch.float32, torch.float64):
            every = every.float()
        for g in groups:
            every = g.gather(every)
        return entropy_threshold(every, quantile)

    return fn


def cov_selection(logp: torch.Tensor, ti: TokenInputs, cfg: PolicyLossConfig) -> torch.Tensor:
    """Clip-Cov / KL-Cov's tokens among the call's masked tokens (``objectives.COV_MODES``)."""
    return _objectives.cov_selection(logp, ti.adv, ti.old, cfg)


def with_batch_masks(ti: TokenInputs, entropy, logp, cfg: PolicyLossConfig, mask, idx, ct,
                     threshold_fn=None) -> TokenInputs:
    """The batch-global statistics over every masked token of the call: the entropy-quantile
    mask and the entropy term's weights over it (docs/math.md §10), Clip-Cov / KL-Cov's
    selection (§12). ``threshold_fn(entropy, quantile)`` replaces :func:`entropy_threshold`
    (data parallel)."""
    if not cfg.needs_batch:
        return ti
    if cfg.cov_mode is not None:
        ti = replace(ti, cov_sel=cov_selection(logp, ti, cfg))
    if not cfg.entropy_quantile_on:
        return ti
    thr = (threshold_fn or entropy_threshold)(entropy, cfg.top_entropy_quantile)
    emask = entropy >= thr.to(entropy.dtype)
    w_ent = ti.w_ent
    if cfg.entropy_agg is not None:
        em = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        em = em.index_copy_(0, idx, emask).view_as(mask)
        w_ent = aggregation_weights(em, cfg.entropy_agg, cfg, own_norms(ti.norms, cfg),
                                    ct, ti.sp).reshape(-1)[idx]
    return replace(ti, emask=emask, w_ent=w_ent)


def chunk_plan(n: int, rows: int, cfg: PolicyLossConfig, seq: Optional[torch.Tensor],
               lengths: Optional[list] = None):
    """Chunks ``(start, end, n_seq, two_sweep)`` over the ``n`` masked rows, at most ``rows``
    each.

    * token-local loss: plain chunks, one sweep (three matmuls per chunk);
    * a loss that needs whole sequences: chunks of whole sequences, one sweep; a sequence longer
      than a chunk is cut into two-sweep chunks (its statistics first, its gradient once the
      whole sequence is known: four matmuls for its rows only);
    * the batch-global entropy quantile: every chunk two-sweep (four matmuls).
    """
    if n == 0:
        return []
    if not cfg.needs_sequence:
        two = cfg.needs_batch
        return [(s, min(n, s + rows), 0, two) for s in range(0, n, rows)]
    if lengths is None:                           # tokens per sequence, in order (host)
        lengths = torch.bincount(seq).tolist()
    plan = []
    start = count = n_in = pos = 0
    for L in lengths:
        if L > rows:                            # a long sequence: the two-sweep route
            if count:
                plan.append((start, start + count, n_in, cfg.needs_batch))
            plan.extend((s, min(pos + L, s + rows), 1, True) for s in range(pos, pos + L, rows))
            start, count, n_in = pos + L, 0, 0
        elif count + L > rows:
            plan.append((start, start + count, n_in, cfg.needs_batch))
            start, count, n_in = pos, L, 1
        else:
            count, n_in = count + L, n_in + 1
        pos += L
    if count:
        plan.append((start, start + count, n_in, cfg.needs_batch))
    return plan


def _chunk_buffer(n: int, hidden2d, weight, backend: Backend, vp=None, grads=(False, False),
                  logits_dtype=None):
    """Rows per chunk for ``n`` rows and the reused ``[rows, V_local]`` logits buffer (None when
    there is no row). Vocab parallel sizes by the widest slice, so every rank runs the same
    chunks. ``grads``: whether the call returns (grad_hidden, grad_weight), which count against
    the CUDA default budget (``_chunking.rows_per_chunk``).

    ``logits_dtype=torch.float32`` with bf16/fp16 operands: a float32 buffer (the logits are
    the float32 head's, docs/kernels.md "Precision"); the byte budget is the same, so a chunk
    has fewer rows (on CUDA, with gradients, also the low-precision copy of dL/dlogits that the
    two gradient matmuls read: 4 + 2 bytes a logit instead of 2)."""
    width = weight.shape[0] if vp is None else vp.width
    buf_dtype = _chunking.logits_dtype_for(hidden2d.dtype, logits_dtype)
    # counted by the widest slice too: the same on every rank, so the chunks stay in step; a
    # float32 accumulator of a bf16/fp16 weight gradient (_GradMatmuls) adds 4 bytes a weight
    w_bytes = weight.element_size() + 4 * _chunking.accumulate_fp32(weight.dtype)
    grad_bytes = (grads[0] * hidden2d.numel() * hidden2d.element_size()
                  + grads[1] * width * weight.shape[1] * w_bytes)
    per_logit = backend.bytes_per_logit(buf_dtype)
    if (buf_dtype != hidden2d.dtype and (grads[0] or grads[1])
            and hidden2d.device.type in ROUND_DZ_DEVICES):
        per_logit += hidden2d.element_size()          # _GradMatmuls' rounded copy
    rows = _chunking.rows_per_chunk(n, width, per_logit, hidden2d.device, grad_bytes)
    # at least MIN_ROWS rows: a smaller chunk's matmul is padded to them (_chunking.project_chunk)
    buf = torch.empty(_chunking.buffer_rows(rows), weight.shape[0], device=hidden2d.device,
                      dtype=buf_dtype) if n else None
    return rows, buf


def _first_rows(mflat: torch.Tensor, size: int) -> torch.Tensor:
    """The indices of the first ``size`` True entries of ``mflat`` (0-padded), without a host
    sync (``torch.nonzero_static``); torch builds without it on this device take ``nonzero``
    (one more sync, same result)."""
    try:
        return torch.nonzero_static(mflat, size=size, fill_value=0).squeeze(1)
    except (AttributeError, NotImplementedError, RuntimeError):
        idx = mflat.nonzero().squeeze(1)[:size]
        return torch.cat([idx, idx.new_zeros(size - idx.numel())])


def _rows_in(plan, device):
    parts = [torch.arange(s, e, device=device) for s, e, _, two in plan if two]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def _rows(inv_temp, s, e):
    """Rows ``[s, e)`` of a per-row inverse temperature; a float as it is."""
    return inv_temp[s:e] if isinstance(inv_temp, torch.Tensor) else inv_temp


class _Head(NamedTuple):
    """The rows ``ids`` of the head (``weight``, ``bias``: the whole head's) a chunk was
    projected through on the support route; ``live`` the chunk rows that were projected
    (None: all)."""
    ids: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    live: Optional[torch.Tensor]

    def blocks(self):
        """``(columns, W[U] rows, b[U] rows)`` a block of ``U`` at a time: the gathered weight
        rows (and every temporary of the route) stay within ``_ROUTE_BLOCK_BYTES``."""
        H = self.weight.shape[1]
        step = max(256, _ROUTE_BLOCK_BYTES // max(1, 4 * H))
        u = self.ids.numel()
        for c0 in range(0, u, step):
            c1 = min(u, c0 + step)
            ids = self.ids[c0:c1]
            yield (slice(c0, c1), ids, self.weight.index_select(0, ids),
                   None if self.bias is None else self.bias.index_select(0, ids))


_ROUTE_BLOCK_BYTES = 4 * 2 ** 20


def _project(hc, weight, bias, buf, softcap, backend, targets):
    """``(logits, targets, head)`` of a chunk: through the whole head (``head`` None), or — a
    support backend's route (``support.SupportBackend.chunk_view``) — through ``W[U]`` only,
    ``[m, |U|]`` in the chunk buffer's memory, the rows whose support is the target alone left
    at 0 (no GEMM row) and ``targets`` as positions in ``U``."""
    routes = getattr(backend, "routes", False)
    view = backend.chunk_view(targets, weight.shape[0]) if routes else None
    if routes:
        backend.full = None
    if view is None:
        return _chunking.project_chunk(hc, weight, bias, buf, softcap), targets, None
    m, u = hc.shape[0], view.ids.numel()
    head = _Head(view.ids, weight, bias, view.live)
    if backend.log_kept_mass is not None:       # LSE_V too: the whole head, into the buffer
        full = _chunking.project_chunk(hc, weight, bias, buf, softcap)
        backend.full = (full, view.full_targets)
        out = torch.empty(m, u, device=buf.device, dtype=buf.dtype)
    else:
        out = buf.view(-1)[:m * u].view(m, u)
    live = view.live
    if live is not None:
        # rows not projected: logit 0 (their statistics are exact: logp 0, entropy 0, no
        # gradient), NaN where the hidden row is not finite (NaN in, NaN out)
        out.copy_(torch.where(torch.isfinite(hc).all(1, keepdim=True), 0.0, float("nan"))
                  .to(out.dtype).expand(m, u))
        if not live.numel():
            return out, view.targets, head
        hc = hc.index_select(0, live)
    one = u <= max(256, _ROUTE_BLOCK_BYTES // max(1, 4 * weight.shape[1]))
    for cols, _, w_b, b_b in head.blocks():
        if one and live is None:
            _chunking.project(hc, w_b, b_b, out, softcap)
            break
        part = torch.empty(hc.shape[0], w_b.shape[0], device=out.device, dtype=out.dtype)
        _chunking.project(hc, w_b, b_b, part, softcap)
        if live is None:
            out[:, cols] = part
        else:
            out[:, cols] = out[:, cols].index_copy(0, live, part)
    return out, view.targets, head


# Float32 mode: the devices where dL/dlogits is rounded to the operands' dtype for the two
# gradient matmuls (tensor cores); elsewhere the products are float32 (tests add "cpu" to run
# the rounding route without a GPU).
ROUND_DZ_DEVICES = ("cuda",)


class _GradMatmuls:
    """The two gradient matmuls (and the bias sum) of each chunk, shared by the fused loss and
    the log-probs backward: ``grad_h[rows] = G W``, ``grad_w += G^T h`` (the first chunk writes
    with beta = 0, so no zero fill), ``grad_b += sum_rows G`` (float32).

    A bf16/fp16 ``grad_w`` summed over more than one chunk accumulates in float32 and is rounded
    once at the end (``_chunking.accumulate_fp32``; TRL's and Liger's rule): rounding the running
    sum at every chunk makes its error grow with the chunk count. One chunk: no accumulator.

    ``idx``: the rows of ``hidden2d`` the chunks cover, in order (None: all rows, contiguous);
    ``chunks``: how many chunks will add. ``into``: a float32 tensor of the weight's shape that
    ``grad_w`` is added into in place (megatron's ``main_grad``); the result's ``grad_w`` is
    then None.

    Float32 logits of low-precision operands (``logits_dtype=torch.float32``): the float32
    dL/dlogits is rounded once to the operands' dtype for the two matmuls on CUDA (tensor
    cores; float32 accumulation); elsewhere the products are float32 (``_chunking.mm_fp32*``:
    CPUs without bf16 units run them faster, and nothing is rounded). ``grad_w`` then always
    sums in float32 and is rounded once.
    """

    def __init__(self, hidden2d, weight, bias, need_dh, need_dw, need_db, idx=None, chunks=1,
                 into=None, f32_logits=False):
        dense = idx is None
        self.weight, self.idx, self.bias = weight, idx, bias
        self.f32 = f32_logits and weight.dtype in _chunking.LOW_PRECISION
        self.round_dz = self.f32 and weight.device.type in ROUND_DZ_DEVICES
        self.low = None                             # the rounded copy (CUDA, float32 mode)
        self.grad_h = ((torch.empty_like(hidden2d) if dense else torch.zeros_like(hidden2d))
                       if need_dh else None)
        self.into = into if need_dw else None
        if self.into is not None:                   # accumulated from the first chunk on
            self.acc32, self.grad_w = into.dtype != weight.dtype, into
            if self.f32 and not self.round_dz and not self.acc32:
                raise TypeError("weight_grad_into: expected a float32 tensor in float32 "
                                "logits mode")
        else:
            self.acc32 = need_dw and chunks > 1 and _chunking.accumulate_fp32(weight.dtype)
            if self.f32 and not self.round_dz and need_dw:
                self.acc32 = True                   # float32 products: summed in float32
            self.grad_w = None
            if need_dw:
                self.grad_w = (torch.empty(weight.shape, device=weight.device,
                                           dtype=torch.float32)
                               if self.acc32 else torch.empty_like(weight))
        self.grad_b = torch.zeros(weight.shape[0], device=weight.device,
                                  dtype=torch.float32) if need_db else None
        self.first = self.into is None

    def add(self, lg, hc, s, e, head: Optional[_Head] = None):
        if head is not None:
            return self._add_rows(lg, hc, s, e, head)
        if self.f32 and lg.dtype != self.weight.dtype:
            if self.round_dz:                       # rounded once, for the tensor cores
                if self.low is None or self.low.shape[0] < lg.shape[0]:
                    self.low = torch.empty(lg.shape, device=lg.device, dtype=self.weight.dtype)
                lg = self.low[:lg.shape[0]].copy_(lg)
            else:
                return self._add_fp32(lg, hc, s, e)
        if self.grad_h is not None:
            if self.idx is None:
                torch.mm(lg, self.weight, out=self.grad_h[s:e])
            else:
                self.grad_h.index_copy_(0, self.idx[s:e], torch.mm(lg, self.weight))
        if self.grad_w is not None:
            if self.acc32:
                _chunking.addmm_fp32(self.grad_w, lg.t(), hc, self.first)
            elif self.first:
                torch.mm(lg.t(), hc, out=self.grad_w)
            else:
                self.grad_w.addmm_(lg.t(), hc)
        if self.grad_b is not None:
            self.grad_b += lg.sum(0, dtype=torch.float32)
        self.first = False

    def _add_rows(self, lg, hc, s, e, head: _Head):
        """The support route's chunk: ``lg`` ``[m, |U|]`` the gradient over ``W[U]``:
        ``grad_h = G W[U]`` (0 on rows not projected), ``grad_w[U] += G^T h`` and
        ``grad_b[U] += sum G``, a block of ``U`` at a time, each row of ``grad_w`` read and
        written once (``U`` distinct: no atomics, the same bits run to run). Float32 logits of
        low-precision operands, or a float32 accumulator: the products in float32."""
        live = head.live
        g = lg if live is None else lg.index_select(0, live)
        h = hc if live is None else hc.index_select(0, live)
        f32 = lg.dtype != head.weight.dtype
        gh = None
        if self.grad_w is not None and self.first:
            self.grad_w.zero_()
        acc = self.grad_w
        wide = acc is not None and acc.dtype == torch.float32 and (f32 or g.dtype != acc.dtype)
        h_w = h.float() if wide else h
        for cols, ids, w_b, _ in (head.blocks() if g.shape[0] else ()):
            g_b = g[:, cols]
            if self.grad_h is not None:
                part = g_b.float() @ w_b.float() if f32 else g_b @ w_b
                gh = part if gh is None else gh.add_(part)
            if acc is not None:
                prod = (g_b.t().float() if wide else g_b.t()) @ h_w
                acc.index_copy_(0, ids, acc.index_select(0, ids).add_(prod.to(acc.dtype)))
            if self.grad_b is not None:
                self.grad_b.index_copy_(0, ids, self.grad_b.index_select(0, ids)
                                        .add_(g_b.sum(0, dtype=torch.float32)))
        if self.grad_h is not None:
            if gh is None:
                gh = torch.zeros(0, hc.shape[1], device=hc.device, dtype=self.grad_h.dtype)
            if self.idx is None:
                rows = self.grad_h[s:e]
                if live is None:
                    rows.copy_(gh)
                else:
                    rows.zero_()
                    rows.index_copy_(0, live, gh.to(rows.dtype))
            else:
                at = self.idx[s:e] if live is None else self.idx[s:e].index_select(0, live)
                self.grad_h.index_copy_(0, at, gh.to(self.grad_h.dtype))
        self.first = False

    def _add_fp32(self, lg, hc, s, e):
        """Float32 products of the float32 dL/dlogits ``lg`` with low-precision operands."""
        if self.grad_h is not None:
            gh = _chunking.mm_fp32_right(lg, self.weight)
            if self.idx is None:
                self.grad_h[s:e] = gh
            else:
                self.grad_h.index_copy_(0, self.idx[s:e], gh.to(self.grad_h.dtype))
        if self.grad_w is not None:
            _chunking.addmm_fp32(self.grad_w, lg.t(), hc, self.first)
        if self.grad_b is not None:
            self.grad_b += lg.sum(0, dtype=torch.float32)
        self.first = False

    def result(self):
        if self.into is not None:                        # added into the caller's buffer
            gw = None
        else:
            if self.grad_w is not None and self.first:   # no rows at all
                self.grad_w.zero_()
            gw = self.grad_w
            if self.acc32:
                gw = gw.to(self.weight.dtype)            # rounded once
        gb = None if self.grad_b is None else self.grad_b.to(self.bias.dtype)
        return self.grad_h, gw, gb


def policy_loss_sweep(hidden2d, weight, bias, inp: LossInputs, need_dh: bool, need_dw: bool,
                      need_db: bool):
    """The chunk loop over the masked-in rows (``chunk_plan``). Returns
    (loss, grad_hidden2d, grad_weight, grad_bias)."""
    cfg, be, vp = inp.config, inp.backend, inp.vp
    device = hidden2d.device
    combine = None if getattr(be, "combines", False) else _vp.combiner(vp)
    want_entropy = cfg.wants_entropy
    mflat = inp.mask.reshape(-1)
    N = mflat.numel()
    # Row compaction: padding and prompt rows cost no matmul (their gradient is zero). The row
    # count is the one host transfer of the forward (the chunk loop needs it); the value checks'
    # flags travel with it and fail before any kernel reads the checked inputs. For a
    # token-local loss the first chunk's logits matmul (which reads only hidden and weight) is
    # queued before the host waits, so the device is busy while the host prepares the rest.
    pending = (inp.checks if inp.checks is not None else Checks()).start(mflat.sum())
    early = order = None
    if N and not (cfg.needs_sequence or cfg.needs_batch) and not getattr(be, "routes", False):
        rows, buf = _chunk_buffer(N, hidden2d, weight, be, vp, (need_dh, need_dw),
                                  cfg.logits_dtype)
        order = _first_rows(mflat, N)        # the masked-in rows first (0-padded)
        early = hidden2d.index_select(0, order[:rows])
        _chunking.project_chunk(early, weight, bias, buf, cfg.logit_softcap)
    n, = pending.finish()
    idx = (torch.arange(n, device=device) if n == N
           else order[:n] if order is not None else _first_rows(mflat, n))
    ct = torch.float64 if hidden2d.dtype == torch.float64 else torch.float32
    ti = token_inputs(inp.mask, inp.advantages, inp.old_logp, inp.ref_logp, inp.token_scale,
                      inp.kl_weight, inp.is_ratio, inp.sampling_logp, cfg,
                      inp.num_items_in_batch, idx, ct, inp.inv_temp, inp.sp)
    # 1 / temperature: the config's, or per masked token (ti.itemp, sliced by chunk)
    inv_temp = 1.0 / cfg.temperature if ti.itemp is None else ti.itemp

    # no [n, H] copies: each chunk gathers its rows and scatters its hidden gradient
    dense = n == hidden2d.shape[0]          # nothing masked out: chunks are plain views
    y = inp.targets.index_select(0, idx)
    if vp is not None and not getattr(be, "combines", False):
        y = _vp.local_targets(y, vp)
    need_grad = need_dh or need_dw or need_db
    if early is None:
        rows, buf = _chunk_buffer(n, hidden2d, weight, be, vp, (need_dh, need_dw),
                                  cfg.logits_dtype)
    # split sequences (sequence parallel): a sequence or batch statistic needs every rank's
    # tokens, so every chunk takes the two-sweep route and the loss of all rows is taken at once
    # between the sweeps (its reductions run in step on every rank, with or without tokens)
    sp_whole = inp.sp is not None and (cfg.needs_sequence or cfg.needs_batch)
    plan = ([(s, min(n, s + rows), 0, True) for s in range(0, n, rows)] if sp_whole
            else chunk_plan(n, rows, cfg, ti.seq, ti.seq_lengths))
    grads = _GradMatmuls(hidden2d, weight, bias, need_dh, need_dw, need_db,
                         None if dense else idx, chunks=len(plan),
                         f32_logits=cfg.logits_dtype is not None)
    ws = Workspace()
    f32 = dict(device=device, dtype=torch.float32)
    logp, g, sum_p2 = (torch.zeros(n, **f32) for _ in range(3))
    entropy = torch.zeros(n, **f32) if want_entropy else None
    loss = torch.zeros((), device=device, dtype=ct)
    parts, part_rows = [], []          # metric inputs, and the rows each part covers

    def project(s, e):
        """``(hidden rows, logits, targets, head)`` of chunk ``[s, e)``."""
        if s == 0 and early is not None:            # queued before the row count was known
            return early[:e], buf[:e], y[s:e], None
        hc = hidden2d[s:e] if dense else hidden2d.index_select(0, idx[s:e])
        return (hc,) + _project(hc, weight, bias, buf, cfg.logit_softcap, be, y[s:e])

    if (n == 0 and cfg.entropy_quantile_on and inp.threshold_fn is not None
            and inp.sp is None):
        inp.threshold_fn(torch.zeros(0, device=device), cfg.top_entropy_quantile)   # collective

    # Sweep 1 (two-sweep chunks only): row statistics; then the loss of those rows at once.
    pre = _rows_in(plan, device)
    lse = gH_pre = None
    if pre.numel() or (inp.sp is not None and (sp_whole or n == 0)):
        lse = torch.zeros(n, **f32)
        with torch.no_grad():
            for s, e, _, two in plan:
                if two:
                    _, lg, yc, _ = project(s, e)
                    st = be.row_stats(lg, yc, _rows(inv_temp, s, e), want_entropy, True, ws)
                    if combine is not None:
                        st = combine(st)
                    logp[s:e], lse[s:e], sum_p2[s:e] = st.target_z - st.lse, st.lse, st.sum_p2
                    if want_entropy:
                        entropy[s:e] = st.entropy
        tp = ti if pre.numel() == n else ti.take(pre)
        ent_pre = None if entropy is None else entropy[pre].to(ct)
        lp_pre = logp[pre].to(ct)
        tp = with_batch_masks(tp, ent_pre, lp_pre, cfg, inp.mask, idx[pre], ct, inp.threshold_fn)
        lt = loss_terms(lp_pre, ent_pre, tp, cfg, inp.phase)
        g[pre] = lt.g.float()
        if lt.gH is not None:
            gH_pre = torch.zeros(n, **f32)
            gH_pre[pre] = lt.gH.float()
        loss = loss + lt.loss_sum
        parts.append(lt.terms)
        part_rows.append(pre)

    # Sweep 2: every chunk; one-sweep chunks do all their work here.
    for s, e, n_seq, two in plan:
        if two:
            if need_grad:
                hc, lg, yc, head = project(s, e)
                be.logit_grad_(lg, yc, _rows(inv_temp, s, e), lse[s:e],
                               None if gH_pre is None else entropy[s:e], g[s:e],
                               None if gH_pre is None else gH_pre[s:e], ws, cfg.logit_softcap)
                grads.add(lg, hc, s, e, head)
            continue
        hc, lg, yc, head = project(s, e)
        res = be.policy_rows_(lg, yc, _rows(inv_temp, s, e), ti.slice(s, e, n_seq), cfg,
                              inp.phase, need_grad, ws, combine)
        loss = loss + res.loss_sum
        logp[s:e], sum_p2[s:e], g[s:e] = res.logp, res.sum_p2, res.g
        if want_entropy:
            entropy[s:e] = res.entropy
        parts.append(res.terms)
        part_rows.append(torch.arange(s, e, device=device))
        if need_grad:
            grads.add(lg, hc, s, e, head)

    terms = concat_terms(parts, part_rows if pre.numel() else None)
    B = inp.mask.shape[0]
    if terms is not None:
        inp.metrics = policy_metrics(terms, cfg, entropy,
                                     logp_grad_norm(g, logp, sum_p2, inv_temp), B,
                                     n_seq_nonempty(ti), inp.sp)
    else:
        inp.metrics = empty_metrics(cfg, device, B)
    full_logp = torch.zeros(mflat.numel(), device=device, dtype=torch.float32)
    inp.logp = full_logp.index_copy_(0, idx, logp).view_as(inp.mask)
    if entropy is not None:
        full_ent = torch.zeros(mflat.numel(), device=device, dtype=torch.float32)
        inp.entropy = full_ent.index_copy_(0, idx, entropy).view_as(inp.mask)
    if inp.want_sum_p2:         # computed by every row pass already (grad_share_low's norm)
        full_p2 = torch.zeros(mflat.numel(), device=device, dtype=torch.float32)
        inp.sum_p2 = full_p2.index_copy_(0, idx, sum_p2).view_as(inp.mask)
    gh, gw, gb = grads.result()
    if vp is not None:
        gh = _vp.reduce_hidden_grad(gh, vp)
    return loss, gh, gw, gb


class FusedPolicyLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden2d, weight, bias, inp: LossInputs):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = bias is not None and ctx.needs_input_grad[2]
        loss, gh, gw, gb = policy_loss_sweep(hidden2d, weight, bias, inp, need_dh, need_dw,
                                             need_db)
        save_grads(ctx, gh, gw, gb)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        _no_double_backward()
        return (*scale_stored_grads(ctx, grad_loss), None)


def save_grads(ctx, *grads):
    """Keep the gradients a forward computed (None for those not needed) for
    :func:`scale_stored_grads`."""
    ctx.save_for_backward(*(t if t is not None else torch.empty(0) for t in grads))
    ctx.has = tuple(t is not None for t in grads)


def _scale_on_device(t: torch.Tensor) -> bool:
    """Whether :func:`scale_stored_grads` tests the upstream gradient on the device (Triton's
    ``scale_unless_one_kernel``): contiguous CUDA tensors of a float type up to 32 bits."""
    return (t.device.type == "cuda" and t.is_contiguous()
            and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and triton_usable(t.device))


def scale_stored_grads(ctx, grad_loss):
    """The stored gradients are those of the loss itself: scale them in place by the upstream
    gradient and hand them over (autograd takes them as ``.grad`` without a copy).

    A unit upstream gradient (``loss.backward()``) needs no scaling, a pass over ``[V, H]``
    (1.4 ms of 25 at Qwen2.5-7B's head, N = 4096, on an H100). On CUDA the test runs on the
    device (``scale_unless_one_kernel`` reads the upstream gradient and returns at once when it
    is 1): the backward has no host sync, so the host queues the next step while the GPU is
    still busy with this one. On CPU the test is a plain comparison (no device to wait for);
    other devices scale unconditionally (one pass, no sync).

    The gradients are handed over once: a second backward through the same loss
    (``retain_graph=True``) raises instead of scaling them twice."""
    if getattr(ctx, "handed_over", False):
        raise RuntimeError("gbc_kernels: backward through the same fused loss twice "
                           "(retain_graph=True) is not supported; the gradients were computed "
                           "in the forward and handed over by the first backward: compute the "
                           "loss again")
    ctx.handed_over = True
    g = grad_loss.detach()
    unit = None
    out = []
    for has, t in zip(ctx.has, ctx.saved_tensors):
        if not has:
            out.append(None)
        elif _scale_on_device(t):
            from .triton.launch import launch_scale_unless_one_
            out.append(launch_scale_unless_one_(t, g))
        elif t.device.type == "cpu":
            unit = bool(g == 1) if unit is None else unit
            out.append(t if unit else t.mul_(g.to(t.dtype)))
        else:
            out.append(t.mul_(g.to(t.dtype)))
    return out


# ----------------------------------------------------------------------------------------------
# log-probs (gradient recomputed in backward) and no-grad statistics
# ----------------------------------------------------------------------------------------------


def stats_sweep(hidden2d, weight, bias, targets, backend: Backend, temperature,
                want_entropy: bool, extra_temperature: Optional[float] = None,
                softcap: Optional[float] = None, vp=None, want_sum_p2: bool = False,
                logits_dtype=None):
    """Row statistics for every row (``vp``: over the split vocabulary, ``targets`` global
    ids). ``temperature``: a float or a float32 ``[N]`` tensor (per row). ``logits_dtype``:
    None or torch.float32 (the chunk's logits, :func:`_chunk_buffer`). Returns
    (logp, entropy, lse, extra RowStats parts, sum_p2)."""
    N = hidden2d.shape[0]
    device = hidden2d.device
    rows, buf = _chunk_buffer(N, hidden2d, weight, backend, vp, logits_dtype=logits_dtype)
    if vp is not None and not getattr(backend, "combines", False):
        targets = _vp.local_targets(targets, vp)
    ws = Workspace()
    logp = torch.empty(N, device=device, dtype=torch.float32)
    lse = torch.empty(N, device=device, dtype=torch.float32)
    entropy = torch.empty(N, device=device, dtype=torch.float32) if want_entropy else None
    sum_p2 = torch.empty(N, device=device, dtype=torch.float32) if want_sum_p2 else None
    extra = None
    if extra_temperature is not None:
        extra = {k: torch.empty(N, device=device, dtype=torch.float32)
                 for k in ("lse", "zmax", "entropy")}
    inv_temp = 1.0 / temperature
    same_temp = not isinstance(temperature, torch.Tensor) and extra_temperature == temperature

    combine = None if getattr(backend, "combines", False) else _vp.combiner(vp)

    def stats(lg, y, it, entropy_too, p2_too):
        st = backend.row_stats(lg, y, it, entropy_too, p2_too, ws)
        return st if combine is None else combine(st)

    with torch.no_grad():
        for s in range(0, N, rows):
            e = min(N, s + rows)
            lg, yc, _ = _project(hidden2d[s:e], weight, bias, buf, softcap, backend,
                                 targets[s:e])
            st = stats(lg, yc, _rows(inv_temp, s, e), want_entropy, want_sum_p2)
            logp[s:e] = st.target_z - st.lse
            lse[s:e] = st.lse
            if want_entropy:
                entropy[s:e] = st.entropy
            if want_sum_p2:
                sum_p2[s:e] = st.sum_p2
            if extra is not None:
                # the same temperature needs no second pass over the chunk
                if same_temp and want_entropy:
                    st2 = st
                else:     # a support backend records nothing of this pass (log_kept_mass)
                    with getattr(backend, "second_statistic", contextlib.nullcontext)():
                        st2 = stats(lg, yc, 1.0 / extra_temperature, True, False)
                extra["lse"][s:e], extra["zmax"][s:e] = st2.lse, st2.zmax
                extra["entropy"][s:e] = st2.entropy
    return logp, entropy, lse, extra, sum_p2


def logit_grad_sweep(hidden2d, weight, bias, targets, backend: Backend, temperature, lse,
                     entropy, g_logp, g_entropy, need_dh, need_dw, need_db, softcap=None,
                     vp=None, grad_w_into=None, logits_dtype=None):
    """Backward of the log-probs: recompute each chunk's logits, overwrite them with dL/dlogits,
    and do the two gradient matmuls (``vp``: this slice's part; the hidden gradient summed over
    the ranks once)."""
    N = hidden2d.shape[0]
    # d weight into the caller's buffer allocates none: not counted against the chunk budget
    rows, buf = _chunk_buffer(N, hidden2d, weight, backend, vp,
                              (need_dh, need_dw and grad_w_into is None), logits_dtype)
    if vp is not None and not getattr(backend, "combines", False):
        targets = _vp.local_targets(targets, vp)
    ws = Workspace()
    grads = _GradMatmuls(hidden2d, weight, bias, need_dh, need_dw, need_db,
                         chunks=-(-N // rows), into=grad_w_into,
                         f32_logits=logits_dtype is not None)
    inv_temp = 1.0 / temperature               # a float, or per row once (not once per chunk)
    for s in range(0, N, rows):
        e = min(N, s + rows)
        hc = hidden2d[s:e]
        lg, yc, head = _project(hc, weight, bias, buf, softcap, backend, targets[s:e])
        backend.logit_grad_(lg, yc, _rows(inv_temp, s, e), lse[s:e],
                            None if entropy is None else entropy[s:e], g_logp[s:e],
                            None if g_entropy is None else g_entropy[s:e], ws, softcap)
        grads.add(lg, hc, s, e, head)
    gh, gw, gb = grads.result()
    if vp is not None:
        gh = _vp.reduce_hidden_grad(gh, vp)
    return gh, gw, gb


class FusedLogprobsFunction(torch.autograd.Function):
    """Per-row log-probs, entropy and sum p^2 (the last two empty unless asked); gradients
    through the log-probs and the entropy, recomputed in backward. ``temperature``: a float or
    a float32 ``[N]`` tensor. ``grad_w_into``: the backward adds d weight into it (the weight's
    own gradient is then None). ``logits_dtype``: None or torch.float32 (both sweeps)."""

    @staticmethod
    def forward(ctx, hidden2d, weight, bias, targets, temperature, return_entropy, backend,
                softcap=None, vp=None, return_sum_p2=False, grad_w_into=None,
                logits_dtype=None):
        logp, entropy, lse, _, sum_p2 = stats_sweep(hidden2d, weight, bias, targets, backend,
                                                    temperature, return_entropy, softcap=softcap,
                                                    vp=vp, want_sum_p2=return_sum_p2,
                                                    logits_dtype=logits_dtype)
        empty = logp.new_empty(0)
        ctx.save_for_backward(hidden2d, weight, bias if bias is not None else empty,
                              targets, lse, entropy if entropy is not None else empty)
        ctx.has_bias, ctx.return_entropy = bias is not None, return_entropy
        ctx.temperature, ctx.backend, ctx.softcap, ctx.vp = temperature, backend, softcap, vp
        ctx.grad_w_into, ctx.logits_dtype = grad_w_into, logits_dtype
        entropy = empty if entropy is None else entropy
        sum_p2 = logp.new_empty(0) if sum_p2 is None else sum_p2
        ctx.mark_non_differentiable(sum_p2)
        return logp, entropy, sum_p2

    @staticmethod
    def backward(ctx, g_logp, g_entropy=None, g_sum_p2=None):
        _no_double_backward()
        hidden2d, weight, bias, targets, lse, entropy = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = ctx.has_bias and ctx.needs_input_grad[2]
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        gH = None
        if ctx.return_entropy and g_entropy is not None:
            gH = g_entropy.float()
        gh, gw, gb = logit_grad_sweep(hidden2d, weight, bias, targets, ctx.backend,
                                      ctx.temperature, lse, entropy if gH is not None else None,
                                      g_logp.float(), gH, need_dh, need_dw, need_db,
                                      ctx.softcap, ctx.vp, ctx.grad_w_into, ctx.logits_dtype)
        return gh, gw, gb, None, None, None, None, None, None, None, None, None
