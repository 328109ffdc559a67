"""The sampler's support recomputed from the sampling settings (docs/math.md §16, "The
sampler's kept set, recomputed").

When the rollout engine records no kept ids, ``sampler_truncation=SamplerTruncation(top_k,
top_p, min_p)`` builds each row's support ``S`` inside the row pass, from the chunk's logits at
the call's temperature (the rollout temperature), in the order and tie rule of the sampler the
trainer pairs with:

* ``rule="vllm"`` (vLLM 0.24–0.31's sampler): min-p (keep ``p ≥ min_p · p_max``), then top-k,
  then top-p on the distribution renormalised over what min-p and top-k kept; a token is kept
  iff the mass ranked before it is ``< top_p`` (the token crossing ``top_p`` is kept).
* ``rule="sglang"`` (SGLang 0.5's joint filter): min-p, top-k and top-p each on the full
  temperature-scaled distribution (top-p not renormalised after top-k; kept iff the mass
  before it is ``≤ top_p``), the intersection kept.

The rank order is (logit descending, token id ascending). ``ties="first"``: top-k keeps exactly
``k`` tokens, the lowest ids among those tied with the k-th (vLLM's Triton sampler, SGLang);
``ties="all"``: every token tied with the k-th is kept (vLLM's PyTorch sampler). Ties inside the
top-p cut are resolved by the rank order in both.

Cost: top-k by selection (``torch.topk`` on the chunk, a fix-up only for rows tied at the
boundary), top-p under a top-k bound on the ``k`` candidates, top-p without a bound by a
two-read histogram select (the mass of 4096 log-probability bins, then an exact order of the
one bin the cut falls in) — never a sort of the whole row. Under vocab parallelism each shard's
top candidates are merged (one all_gather a chunk); top-p without a top-k bound is refused
there, naming ``top_p``.

The backend stores each row's members (``[n, K]`` ids, the target forced in) from the row pass
for the gradient pass, and ``forced`` (the target was outside ``S``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .backends.base import Backend, Workspace
from .support import SupportBackend, _col

TIES = ("first", "all")
RULES = ("vllm", "sglang")
_BINS, _RANGE = 4096, 64.0          # histogram select: bins over [0, 64) nats below the row max
_BLOCK = 1 << 22                    # elements of a row block's float32 temporaries


@dataclass(frozen=True)
class SamplerTruncation:
    """The rollout sampler's truncation, to rebuild its kept set (module docstring).

    ``top_k``: None (no bound) or an int ``>= 1``. ``top_p``: in ``(0, 1]`` (1: off).
    ``min_p``: in ``[0, 1)`` (0: off). ``ties``: ``"first"`` or ``"all"``. ``rule``:
    ``"vllm"`` or ``"sglang"``. At least one of the three filters must be on.
    """

    top_k: Optional[int] = None
    top_p: float = 1.0
    min_p: float = 0.0
    ties: str = "first"
    rule: str = "vllm"

    def __post_init__(self):
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"top_k: expected None (no bound) or an int >= 1, got {k!r} "
                             f"(a trainer's -1 / 0 for 'off' is None here)")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p: expected a float in (0, 1], got {p!r}")
        mp = self.min_p
        if isinstance(mp, bool) or not isinstance(mp, (int, float)) or not 0.0 <= mp < 1.0:
            raise ValueError(f"min_p: expected a float in [0, 1), got {mp!r}")
        if self.ties not in TIES:
            raise ValueError(f"ties: expected one of {TIES}, got {self.ties!r}")
        if self.rule not in RULES:
            raise ValueError(f"rule: expected one of {RULES}, got {self.rule!r}")
        if k is None and p >= 1.0 and mp <= 0.0:
            raise ValueError("sampler_truncation: top_k None, top_p 1 and min_p 0 truncate "
                             "nothing (the support is the whole vocabulary); pass "
                             "sampler_truncation=None")


def check(tr, vp=None) -> SamplerTruncation:
    """``sampler_truncation`` checked (a :class:`SamplerTruncation`); under vocab parallelism
    top-p without a top-k bound is refused."""
    if not isinstance(tr, SamplerTruncation):
        raise TypeError(f"sampler_truncation: expected None or gbc_kernels.SamplerTruncation("
                        f"top_k, top_p, min_p), got {type(tr).__name__}")
    if vp is not None and tr.top_k is None and tr.top_p < 1.0:
        raise ValueError("top_p: top_p < 1 without a top_k bound is not supported under "
                         "vocab_parallel (the cut needs every shard's order); set top_k too "
                         "(SamplerTruncation(top_k=..., top_p=...)) or run without "
                         "vocab_parallel")
    return tr


def _ranked(v: torch.Tensor, i: torch.Tensor):
    """Candidates ``(values, ids)`` ``[r, K]`` (invalid: ``-inf`` / ``-1``) in rank order:
    value descending, id ascending."""
    big = torch.iinfo(i.dtype).max
    o = torch.where(i >= 0, i, big).argsort(1)
    v, i = v.gather(1, o), i.gather(1, o)
    o = torch.argsort(v, dim=1, descending=True, stable=True)
    return v.gather(1, o), i.gather(1, o)


def _mask_ids(keep: torch.Tensor):
    """The ids ``[r, C]`` of a ``[r, V]`` mask (ascending, ``-1`` padded)."""
    cnt = keep.sum(1, dtype=torch.int32).long()
    c = int(cnt.max()) if keep.numel() else 0
    out = torch.full((keep.shape[0], max(c, 1)), -1, dtype=torch.long, device=keep.device)
    if c:
        nz = keep.nonzero()                              # row-major: each row's ids ascending
        row = nz[:, 0]
        start = torch.cumsum(cnt, 0) - cnt
        out[row, torch.arange(nz.shape[0], device=keep.device) - start[row]] = nz[:, 1]
    return out


def _local_top_k(lm: torch.Tensor, k: int, ties: str):
    """This block's top-``k`` candidates ``(values, ids)`` of ``lm`` (``-inf``: removed), in
    rank order; ``ties="all"``: every token tied with the k-th too."""
    r, V = lm.shape
    kq = min(k, V)
    if ties == "all":
        v, i = lm.topk(kq, 1)
        kth = v[:, -1:]
        c = int((lm >= kth).sum(1, dtype=torch.int32).max())
        if c > kq:
            v, i = lm.topk(c, 1)
            i = torch.where(v >= kth, i, -1)
            v = torch.where(i >= 0, v, float("-inf"))
    else:
        v, i = lm.topk(min(kq + 1, V), 1)
        if kq < V:
            kth, nxt = v[:, kq - 1], v[:, kq]
            v, i = v[:, :kq].clone(), i[:, :kq].clone()
            tie = (nxt == kth) & torch.isfinite(kth)
            if bool(tie.any()):          # the k-th value continues past k: lowest ids first
                rows = tie.nonzero().squeeze(1)
                sub, t = lm.index_select(0, rows), kth.index_select(0, rows).unsqueeze(1)
                gt, eq = sub > t, sub == t
                need = kq - gt.sum(1, keepdim=True)
                keep = gt | (eq & (eq.cumsum(1) <= need))
                ids = keep.nonzero()[:, 1].view(-1, kq)
                i[rows] = ids
                v[rows] = sub.gather(1, ids)
    i = torch.where(torch.isfinite(v), i, -1)
    return _ranked(v, i)


def _top_p_hist(l: torch.Tensor, e: torch.Tensor, mass: torch.Tensor, strict: bool):
    """Top-p without a top-k bound, exact, by a two-read histogram select: the kept mask
    ``[r, V]`` of the tokens whose mass ranked before them (``e = exp(l)``, ``l ≤ 0`` the logits
    less the row max, rank order) is ``< mass`` (``strict``) or ``≤ mass``; zero-mass tokens
    never kept."""
    r, V = l.shape
    # a NaN row (NaN logits: a NaN hidden state or weight row) takes the last bin, never an
    # index out of range; its kept set is meaningless and its statistics NaN (TruncationBackend)
    b = (l * (-_BINS / _RANGE)).nan_to_num_(nan=_BINS - 1.0).clamp_(0, _BINS - 1).long()
    cum = torch.zeros(r, _BINS, device=l.device, dtype=e.dtype).scatter_add_(1, b, e).cumsum_(1)
    cut = mass.unsqueeze(1)
    crossed = cum >= cut if strict else cum > cut
    bstar = (~crossed).sum(1, keepdim=True).clamp_(max=_BINS - 1)     # the bin the cut is in
    above = torch.where(bstar > 0, cum.gather(1, (bstar - 1).clamp(min=0)), 0.0)
    pos = e > 0
    keep = (b < bstar) & pos
    inb = (b == bstar) & pos
    c = int(inb.sum(1, dtype=torch.int32).max())
    if c:
        v, i = torch.where(inb, l, float("-inf")).topk(c, 1)
        v, i = _ranked(v, torch.where(torch.isfinite(v), i, -1))
        ev = torch.exp(v)
        before = above + ev.cumsum(1) - ev
        k2 = ((before < cut) if strict else (before <= cut)) & (ev > 0) & (i >= 0)
        spare = torch.zeros(r, V + 1, dtype=torch.bool, device=l.device)    # -1 -> column V
        keep |= spare.scatter_(1, torch.where(i >= 0, i, V), k2)[:, :V]
    return keep


_LOCAL = object()          # "no vocab parallelism" (a group of None is the default group)


def _reduce(t, op, group):
    if group is not _LOCAL:
        dist.all_reduce(t, op=op, group=group)
    return t


def _merge(v, i, group):
    """Every rank's candidates ``[r, K]`` merged (one all_gather, padded to the widest)."""
    w = torch.tensor([v.shape[1]], device=v.device)
    _reduce(w, dist.ReduceOp.MAX, group)
    pad = int(w) - v.shape[1]
    if pad:
        v = torch.cat([v, v.new_full((v.shape[0], pad), float("-inf"))], 1)
        i = torch.cat([i, i.new_full((i.shape[0], pad), -1)], 1)
    both = torch.cat([v.to(torch.float64), i.to(torch.float64)], 1)
    every = [torch.empty_like(both) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, both, group=group)
    K = v.shape[1]
    v = torch.cat([e[:, :K] for e in every], 1).to(v.dtype)
    i = torch.cat([e[:, K:] for e in every], 1).long()
    return _ranked(v, i)


def kept_mask(z: torch.Tensor, tr: SamplerTruncation, inv_t=1.0, group=_LOCAL):
    """Without a top-k bound: ``(keep, e, z_max)``, the kept mask ``[r, V]`` of this slice,
    ``e = exp((z − z_max)/T)`` with min-p's removed tokens 0 (None for min-p alone, which needs
    no exponential) and the row max ``[r, 1]``."""
    zm = _reduce(z.amax(1).float(), dist.ReduceOp.MAX, group).unsqueeze(1)
    thr = zm + math.log(tr.min_p) / inv_t if tr.min_p > 0.0 else None
    if tr.top_p >= 1.0:                            # min-p alone
        return z >= thr, None, zm
    ct = torch.promote_types(z.dtype, torch.float32)
    l = (z.to(ct) - zm).mul_(inv_t)                # l − l_max ≤ 0
    e = torch.exp(l)
    full = e.sum(1) if tr.rule == "sglang" else None
    if thr is not None:
        removed = z < thr
        l.masked_fill_(removed, float("-inf"))
        e.masked_fill_(removed, 0.0)
    mass = full if full is not None else e.sum(1)
    return _top_p_hist(l, e, tr.top_p * mass, strict=tr.rule == "vllm"), e, zm


def kept_ids(z: torch.Tensor, tr: SamplerTruncation, inv_t=1.0, offset: int = 0,
             group=_LOCAL, return_max: bool = False):
    """The kept ids (global: ``offset`` + local) of each row of ``z`` ``[r, V]`` (this rank's
    slice of the chunk's logits, before the temperature; ``inv_t``: ``1/T``, a float or
    ``[r, 1]``), ``-1`` padded. Under vocab parallelism (``group``: its process group, None the
    default one) the ids of every shard with a top-k bound; of this shard only without one.

    The order of the row does not depend on ``T > 0``: top-k selects on the raw logits and
    only the candidates are scaled; min-p compares ``z ≥ z_max + T log(min_p)``; only top-p
    without a top-k bound (and SGLang's full-row mass) forms ``exp((z − z_max)/T)`` a row.
    ``return_max=True``: ``(ids, z_max [r])``, the row max over every shard."""
    ninf = float("-inf")
    if tr.top_k is None:       # min-p alone (this shard's), or top-p without a bound
        keep, _, zm = kept_mask(z, tr, inv_t, group)
        ids = _mask_ids(keep)
        ids = torch.where(ids >= 0, ids + offset, -1)
        return (ids, zm.squeeze(1)) if return_max else ids
    zm = _reduce(z.amax(1).float(), dist.ReduceOp.MAX, group).unsqueeze(1)
    thr = zm + math.log(tr.min_p) / inv_t if tr.min_p > 0.0 else None
    full = None
    if tr.rule == "sglang" and tr.top_p < 1.0:     # top-p on the full distribution
        ct = torch.promote_types(z.dtype, torch.float32)
        full = _reduce(torch.exp((z.to(ct) - zm).mul_(inv_t)).sum(1), dist.ReduceOp.SUM,
                       group)
    v, i = _local_top_k(z, tr.top_k, tr.ties)
    if thr is not None:                            # min-p removes a tail of the order
        i = torch.where(v >= thr, i, -1)
    v = torch.where(i >= 0, (v.float() - zm) * inv_t, ninf)      # l − l_max of candidates
    i = torch.where(i >= 0, i + offset, -1)
    if group is not _LOCAL:
        v, i = _merge(v, i, group)
        if tr.ties == "first":
            v, i = v[:, :tr.top_k], i[:, :tr.top_k]
        else:
            kth = v[:, min(tr.top_k, v.shape[1]) - 1:min(tr.top_k, v.shape[1])]
            i = torch.where(v >= kth, i, -1)
            v = torch.where(i >= 0, v, ninf)
    if tr.top_p < 1.0:
        ev = torch.where(i >= 0, torch.exp(v), 0.0)
        mass = tr.top_p * (full if full is not None else ev.sum(1))
        before = ev.cumsum(1) - ev
        keep = (before < mass.unsqueeze(1)) if tr.rule == "vllm" \
            else (before <= mass.unsqueeze(1))
        i = torch.where(keep & (ev > 0), i, -1)
    return (i, zm.squeeze(1)) if return_max else i


def _with_target(ids, y):
    """``(cols, forced)``: a row's kept ids (distinct by construction) with its target added
    where missing."""
    forced = ~(ids == y.unsqueeze(1)).any(1)
    return torch.cat([ids, torch.where(forced, y, -1).unsqueeze(1)], 1), forced


class TruncationBackend(SupportBackend):
    """:class:`~gbc_kernels.support.SupportBackend` whose members come from the sampler's
    rule over the row's own logits (module docstring). The chunk loop hands it ``[rows, 2]``
    targets (the target, the row's flat position); ``cols`` ``[n, K]`` and ``forced`` ``[n]``
    keep what the row pass found for the gradient pass and the metric."""

    def __init__(self, inner: Backend, n: int, device, tr: SamplerTruncation,
                 kept_mass: bool = True, vp=None, over_support: bool = True):
        super().__init__(inner, n, device, kept_mass, vp, over_support)
        self.tr = tr
        self.cols = torch.full((n, 1), -1, dtype=torch.long, device=device)
        self.forced = torch.zeros(n, dtype=torch.bool, device=device)
        self.size = torch.zeros(n, dtype=torch.long, device=device)     # |S|, target included
        self.bad = torch.zeros(n, dtype=torch.bool, device=device)      # a NaN / +inf row
        self.routes = False     # the set is built from the whole row: no support route
        self.kept = None        # [n, K] int32: the kept ids (keep_ids), else not recorded
        self._last = None       # the chunk last recomputed: a second statistic of the same
        #                         rows (another temperature) keeps its support

    def _store(self, pos, cols, name: str = "cols"):
        """``cols`` ``[rows, K]`` into the rows ``pos`` of ``self.<name>`` (``[n, K']``, -1
        padded, widened as needed)."""
        have = getattr(self, name)
        if cols.shape[1] > have.shape[1]:
            have = torch.cat([have, have.new_full(
                (have.shape[0], cols.shape[1] - have.shape[1]), -1)], 1)
        if cols.shape[1] < have.shape[1]:
            cols = torch.cat([cols, cols.new_full(
                (cols.shape[0], have.shape[1] - cols.shape[1]), -1)], 1)
        have.index_copy_(0, pos, cols.to(have.dtype))
        setattr(self, name, have)

    def keep_ids(self):
        """Record the sampler's kept ids of every row scored from now on (``kept``: ``[n, K]``
        int32, -1 padded, the target not forced in): ``return_support_ids``."""
        self.kept = torch.full((self.cols.shape[0], 1), -1, dtype=torch.int32,
                               device=self.cols.device)

    def _recompute(self, logits, targets, inv_temp):
        """The chunk's ``[rows, 2 + K]`` targets: its members from the sampler's rule."""
        y, pos = targets[:, 0], targets[:, 1]
        group, offset = _LOCAL, 0
        if self.vp is not None:
            group, offset = self.vp.group, self.vp.start
        rows, V = logits.shape
        width = self.vp.width if self.vp is not None else V
        step = max(1, _BLOCK // max(1, width))
        parts, zmax = [], []
        for s in range(0, rows, step):           # bounded float32 temporaries (same on ranks)
            e = min(rows, s + step)
            it = inv_temp[s:e] if isinstance(inv_temp, torch.Tensor) else inv_temp
            ids, zm = kept_ids(logits[s:e], self.tr, _col(it), offset, group, return_max=True)
            parts.append(ids)
            zmax.append(zm)
        # NaN in, NaN out: a row holding a NaN or +inf logit has no meaningful kept set; its
        # statistics are NaN, as the whole vocabulary's are
        zmax = torch.cat(zmax)
        self.bad.index_copy_(0, pos, torch.isnan(zmax) | (zmax == float("inf")))
        w = max(p.shape[1] for p in parts)
        ids = torch.cat([torch.cat([p, p.new_full((p.shape[0], w - p.shape[1]), -1)], 1)
                         for p in parts])
        if self.vp is not None and self.tr.top_k is None:
            # min-p alone: each shard knows only its own members; the target's membership
            # comes from its owner (one all_reduce)
            mine = (ids == y.unsqueeze(1)).any(1)
            has = ((y >= self.vp.start) & (y < self.vp.end))
            forced = (has & ~mine).to(torch.int32)
            forced = _reduce(forced, dist.ReduceOp.MAX, group).bool()
            cols, _ = _with_target(ids, y)
            size = _reduce((ids >= 0).sum(1), dist.ReduceOp.SUM, group) + forced
        else:
            cols, forced = _with_target(ids, y)
            size = (cols >= 0).sum(1)
        if self.kept is not None:
            self._store(pos, ids, "kept")
        self.size.index_copy_(0, pos, size)
        self._store(pos, cols)
        self.forced.index_copy_(0, pos, forced)
        return torch.cat([targets[:, :2], cols], 1)

    def _stored(self, targets):
        return torch.cat([targets[:, :2], self.cols.index_select(0, targets[:, 1])], 1)

    def _dense_kept_mass(self, logits, targets, inv_temp, want_entropy, want_sum_p2, ws):
        """``over_support=False`` without a top-k bound (a set of any size): the whole
        vocabulary's statistics, and ``LSE_S`` from the kept mask itself (no ids gathered)."""
        pos = targets[:, 1]
        y = targets[:, 0]
        group = _LOCAL if self.vp is None else self.vp.group
        if self.vp is not None:
            from .vocab_parallel import local_targets
            y = local_targets(y, self.vp)
        y = y.contiguous()
        st = self.inner.row_stats(logits, y, inv_temp, want_entropy, want_sum_p2, ws)
        if not self.recording:
            if self.vp is None:
                return st
            from .vocab_parallel import combine

            return combine(st, self.vp)
        rows, V = logits.shape
        width = self.vp.width if self.vp is not None else V
        step = max(1, _BLOCK // max(1, width))
        lse_s, forced = [], []
        for s in range(0, rows, step):
            e = min(rows, s + step)
            it = _col(inv_temp[s:e] if isinstance(inv_temp, torch.Tensor) else inv_temp)
            z = logits[s:e]
            keep, ex, zm = kept_mask(z, self.tr, it, group)
            if self.kept is not None:
                self._store(pos[s:e], _mask_ids(keep), "kept")
            yb = y[s:e]
            has = yb >= 0
            at = yb.clamp(min=0).unsqueeze(1)
            kept_y = keep.gather(1, at).squeeze(1)
            ct = torch.promote_types(z.dtype, torch.float32)
            if ex is None:                         # min-p alone: no exponential of the row yet
                keep.scatter_(1, at, (kept_y | has).unsqueeze(1))   # the target forced in
                lse_s.append(torch.logsumexp(torch.where(keep, z.to(ct) * it, float("-inf")),
                                             1))
            else:                                  # the kept mass, the forced target's added
                ey = torch.exp((z.gather(1, at).to(ct) - zm) * it).squeeze(1)
                mass = torch.where(keep, ex, 0.0).sum(1) + torch.where(has & ~kept_y, ey, 0.0)
                lse_s.append(torch.log(mass) + (zm * it).squeeze(1))
            forced.append(has & ~kept_y)
        lse_s = torch.cat(lse_s).float()
        forced = torch.cat(forced)
        if self.vp is not None:
            from .vocab_parallel import combine

            forced = _reduce(forced.to(torch.int32), dist.ReduceOp.MAX, group).bool()
            st, lse_s = combine(st, self.vp, lse_s)
        self.log_kept_mass.index_copy_(0, pos, (lse_s - st.lse).clamp(max=0.0).float())
        self.forced.index_copy_(0, pos, forced)
        return st

    def row_stats(self, logits, targets, inv_temp, want_entropy, want_sum_p2, ws: Workspace):
        if not self.over_support and self.tr.top_k is None:
            return self._dense_kept_mass(logits, targets, inv_temp, want_entropy, want_sum_p2,
                                         ws)
        key = (targets.data_ptr(), targets.shape[0])
        full = (self._stored(targets) if key == self._last
                else self._recompute(logits, targets, inv_temp))
        self._last = key
        self.poison = self.bad.index_select(0, targets[:, 1])
        return super().row_stats(logits, full, inv_temp, want_entropy, want_sum_p2, ws)

    def logit_grad_(self, logits, targets, inv_temp, lse, entropy, g_logp, g_entropy,
                    ws: Workspace, softcap=None):
        return super().logit_grad_(logits, self._stored(targets), inv_temp, lse, entropy, g_logp, g_entropy, ws,
                                   softcap)
