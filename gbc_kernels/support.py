"""The sampler's support (docs/math.md §16, "The sampler's support"): log-probs, entropy
and gradients over each token's kept ids ``S`` instead of the whole vocabulary.

:class:`SupportBackend` wraps the backend of the call: it gathers each row's ``k + 1`` member
logits from the chunk's logits and takes the support's statistics over them (``O(k)`` a row);
its gradient pass writes ``(δ − q)/T`` (and the entropy's term) on the members and 0
elsewhere. The support route (:meth:`SupportBackend.chunk_view`, the chunk loop's
``_fused._project``): a chunk whose distinct members ``U`` are few is projected through
``W[U]`` only, its members then positions in ``U``; otherwise through the whole head. Only when
``log_kept_mass`` is asked for does the backend's own row pass (C++, Triton or PyTorch) run over
the whole head's logits of the chunk, for ``LSE_V``.

The targets the chunk loop hands a backend become ``[rows, 2 + K]`` integer rows: column 0 the
target, column 1 the row's flat position (where its ``log_kept_mass`` goes), columns ``2:``
the members — the support's ids deduplicated, the target forced in, ``-1`` padding.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch

from . import _validate as V
from .backends.base import Backend, RowStats, Workspace


def check_support_ids(support_ids, targets: torch.Tensor, vocab: int, mask=None,
                      checks: Optional[V.Checks] = None):
    """``support_ids`` of shape ``targets.shape + (k,)``, integer, on the targets' device,
    ids in ``[-1, vocab)`` (a value check on the masked-in tokens: deferred to ``checks``'
    one host transfer when given). Refused naming ``support_ids``."""
    check_layout(support_ids, targets)
    ids = support_ids.long()
    if mask is not None:
        ids = torch.where(mask.bool().unsqueeze(-1), ids, torch.full_like(ids, -1))
    if not V.value_checks_enabled():           # GBC_VALIDATE=0: clamped, never out of range
        return ids.clamp(-1, vocab - 1)

    def bad():
        return (ids < -1) | (ids >= vocab)

    def fail():
        first = V._first(bad())
        raise ValueError(f"support_ids: expected ids in [-1, {vocab}) (-1: padding) on "
                         f"masked-in tokens, got {int(ids[first])} at index {list(first)}")
    V._defer_or_raise(checks, bad, fail)
    return ids


def check_layout(support_ids, targets: torch.Tensor,
                 what: str = "the kept ids of each target token, -1 padded") -> None:
    """``support_ids``: an integer tensor of shape ``targets.shape + (k,)``, ``k >= 1``, on the
    targets' device (its values are checked where the rows are scored); ``what``: the layout
    the error message describes."""
    if not isinstance(support_ids, torch.Tensor):
        raise TypeError(f"support_ids: expected None or an integer tensor of shape "
                        f"{list(targets.shape)} + [k], got {type(support_ids).__name__}")
    if (support_ids.dim() != targets.dim() + 1 or support_ids.shape[:-1] != targets.shape
            or support_ids.shape[-1] < 1):
        raise ValueError(f"support_ids: expected shape {list(targets.shape)} + [k] with k >= 1 "
                         f"({what}), got {list(support_ids.shape)}")
    if support_ids.dtype.is_floating_point or support_ids.dtype.is_complex \
            or support_ids.dtype == torch.bool:
        raise TypeError(f"support_ids: expected an integer tensor, got {support_ids.dtype}")
    if support_ids.device != targets.device:
        raise ValueError(f"support_ids: expected a tensor on {targets.device}, got "
                         f"{support_ids.device}")


def members(ids: torch.Tensor, targets: torch.Tensor):
    """``(cols, forced)`` for ``ids`` ``[N, k]`` (checked, -1 padded) and ``targets`` ``[N]``:
    ``cols`` ``[N, k + 1]`` the distinct members of each row with the target forced in, -1
    elsewhere; ``forced`` ``[N]`` bool, the target was not among the row's ids."""
    y = targets.long().unsqueeze(1)
    forced = ~(ids == y).any(1)
    cols = torch.cat([ids.clamp(min=-1), y], 1).sort(1).values
    dup = torch.zeros_like(cols, dtype=torch.bool)
    dup[:, 1:] = cols[:, 1:] == cols[:, :-1]
    return cols.masked_fill_(dup, -1), forced


def flat_targets(targets: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The ``[N, 2 + K]`` rows the chunk loop hands :class:`SupportBackend`."""
    pos = torch.arange(targets.shape[0], device=targets.device).unsqueeze(1)
    return torch.cat([targets.long().unsqueeze(1), pos, cols], 1)


# The support route: a chunk is projected through W[U] only (U its distinct members) while
# |U| <= ROUTE_FRACTION * V; above, through the whole head. GBC_SUPPORT_ROUTE_FRACTION overrides
# it (0: never; 1: always). Measured on this kind of CPU (docs/kernels.md, "The support route").
ROUTE_FRACTION = 0.5


def route_fraction() -> float:
    import os

    text = os.environ.get("GBC_SUPPORT_ROUTE_FRACTION")
    if text is None:
        return ROUTE_FRACTION
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"GBC_SUPPORT_ROUTE_FRACTION: expected a number in [0, 1] (the largest "
                         f"|U| / V a chunk takes the support route at), got {text!r}")
    return value


class ChunkView(NamedTuple):
    """A chunk scored over the rows of ``W`` its supports name (the support route)."""
    ids: torch.Tensor                 # [u] the chunk's distinct member ids, ascending (this
    #                                   rank's slice's rows under vocab parallelism)
    targets: torch.Tensor             # [m, 2 + K] the chunk's rows, ids as positions in ids
    live: Optional[torch.Tensor]      # rows projected (None: every row); the others are the
    #                                   target alone (no GEMM row, logit 0, no gradient) or,
    #                                   vocab parallel, hold no member in this slice
    full_targets: torch.Tensor        # [m] the targets as rows of this rank's head (LSE_V)


def _col(inv_temp):
    return inv_temp.unsqueeze(1) if isinstance(inv_temp, torch.Tensor) else inv_temp


class SupportBackend(Backend):
    """A backend whose row statistics and gradient are the support's (module docstring).
    ``log_kept_mass`` ``[n]`` float32 receives ``LSE_S − LSE_V`` of every row it scores, at
    the row's position (column 1 of its targets).

    ``over_support=False``: the rows are scored over the whole vocabulary (the inner backend's
    statistics and gradient, today's numbers bit for bit) and only ``log_kept_mass`` is the
    support's: the full-vocabulary policy and the kept mass of one pass (``support=kept_mass``
    in the trainers)."""

    def __init__(self, inner: Backend, n: int, device, kept_mass: bool = True, vp=None,
                 over_support: bool = True):
        self.inner = inner
        self.over_support = over_support
        kept_mass = kept_mass or not over_support
        # vocab parallel: this backend localises the ids and combines its statistics over the
        # ranks itself (support and whole-row LSE in one all_gather); the chunk loop does not
        self.vp = vp
        self.combines = vp is not None
        self.name = inner.name
        self.buffers_per_chunk = inner.buffers_per_chunk
        # without log_kept_mass the whole vocabulary's row pass is not needed at all
        self.log_kept_mass = (torch.zeros(n, device=device, dtype=torch.float32) if kept_mass
                              else None)
        # False during a second statistic of the same rows (token_stats' certainty at its own
        # temperature): log_kept_mass is the call's temperature's, never overwritten by it
        self.recording = True
        self.poison = None      # [rows] bool of the chunk being scored: its LSE NaN (truncation:
        #                         a NaN / +inf anywhere in the row its set was built from)
        # the support route (module docstring): not with over_support=False (the whole
        # vocabulary's statistics). With log_kept_mass the chunk is
        # projected through the whole head too, for LSE_V alone (``full``): the support's
        # statistics come from W[U] either way, so asking for log_kept_mass changes no bit of
        # the log-probs, the loss or the gradients
        self.routes = over_support
        self.full = None        # (the chunk's whole-head logits, its targets) on the route
        self.local_view = False     # the chunk being scored is on the route: its targets are
        #                             positions in U already (no localising)

    @contextlib.contextmanager
    def second_statistic(self):
        """Row passes inside this context score the rows (over the support kept from the
        first pass) and record nothing: no ``log_kept_mass``, no support, no ``forced``."""
        self.recording = False
        try:
            yield
        finally:
            self.recording = True

    def bytes_per_logit(self, dtype):
        return self.inner.bytes_per_logit(dtype)

    def chunk_view(self, targets, vocab: int) -> Optional[ChunkView]:
        """The support route's view of a chunk's ``[m, 2 + K]`` rows (None: the chunk is
        projected through the whole head): ``U`` the distinct members of its rows (the
        targets among them), taken when ``|U| <= route_fraction() * vocab``; ``|U|`` (with
        whether every row is projected) is one host transfer a chunk."""
        self.local_view = False
        if not self.routes:
            return None
        frac = route_fraction()
        if frac <= 0.0:
            return None
        from ._chunking import batch_invariant

        if batch_invariant():   # U depends on the chunk's other rows: the fixed-shape head
            return None
        multi = (targets[:, 2:] >= 0).sum(1) > 1        # |S| > 1 (over the whole vocabulary)
        y, cols = self._local(targets)                   # this slice's rows (-1: elsewhere)
        valid = cols >= 0
        # U by a bitmap of the slice (no sort): its count is the one host transfer; a chunk
        # above the threshold costs that and nothing more
        seen = torch.zeros(vocab, dtype=torch.bool, device=cols.device)
        seen[cols[valid]] = True
        live = multi & valid.any(1)
        u, every = torch.stack([seen.sum(), live.all().long()]).tolist()
        if u > frac * vocab:
            return None
        ids = seen.nonzero().squeeze(1)                  # ascending
        if not u:               # no member in this slice: one column read by no row
            ids = torch.zeros(1, dtype=cols.dtype, device=cols.device)
        at = torch.searchsorted(ids, cols.clamp(min=0).contiguous())
        yp = torch.searchsorted(ids, y.clamp(min=0).contiguous())
        local = torch.cat([torch.where(y >= 0, yp, -1).unsqueeze(1), targets[:, 1:2],
                           torch.where(valid, at, -1)], 1)
        live = None if every else live.nonzero().squeeze(1)
        self.local_view = True
        return ChunkView(ids, local, live, y.contiguous())

    def _local(self, targets):
        """``(y, cols)``: the target and members as ids into this rank's slice (-1: elsewhere
        or padding)."""
        y, cols = targets[:, 0], targets[:, 2:]
        if self.vp is None or self.local_view:
            return y, cols
        from .vocab_parallel import local_targets

        return (local_targets(y, self.vp),
                torch.where(cols >= 0, local_targets(cols, self.vp), -1))

    @staticmethod
    def _gather(logits, cols, inv_temp):
        """The members' logits ``l = z / T`` ``[rows, K]`` (in float32, float64 for float64
        logits), the capped logits ``s`` they came from, and the members' mask."""
        ct = torch.promote_types(logits.dtype, torch.float32)
        valid = cols >= 0
        s = logits.gather(1, cols.clamp(min=0)).to(ct)
        return s * _col(inv_temp), s, valid

    def row_stats(self, logits, targets, inv_temp, want_entropy, want_sum_p2, ws: Workspace):
        if not self.over_support:
            return self._full_row_stats(logits, targets, inv_temp, want_entropy, want_sum_p2,
                                        ws)
        pos = targets[:, 1]
        y, cols = self._local(targets)
        y = y.contiguous()
        l, _, valid = self._gather(logits, cols, inv_temp)
        # NaN in, NaN out: a member logit NaN or +inf (a non-finite hidden state or weight row)
        # makes the row's LSE NaN, as the whole vocabulary's is (-inf is a member of zero mass)
        poison = ((torch.isnan(l) | (l == float("inf"))) & valid).any(1)
        if self.poison is not None:
            poison = poison | self.poison
        l = l.masked_fill(~valid, float("-inf"))
        zmax = l.amax(1)
        # a row may have no member in this slice (vocab parallel): LSE -inf, nothing else
        e = torch.exp(l - torch.where(torch.isfinite(zmax), zmax, 0.0).unsqueeze(1))
        se = e.sum(1)
        lse = torch.where(se > 0, zmax + torch.log(se), float("-inf"))
        lse = torch.where(poison, float("nan"), lse)
        q = torch.where(se.unsqueeze(1) > 0, e / se.clamp(min=1e-30).unsqueeze(1), 0.0)
        entropy = sum_p2 = None
        if want_entropy:
            entropy = -torch.where(valid, q * (l - lse.unsqueeze(1)), 0.0).sum(1)
        if want_sum_p2:
            sum_p2 = (q * q).sum(1)
        at = ((cols == y.unsqueeze(1)) & valid).to(torch.int64).argmax(1, keepdim=True)
        target_z = torch.where(y >= 0, l.gather(1, at).squeeze(1), 0.0)
        f32 = lambda t: None if t is None else t.float()      # noqa: E731
        st = RowStats(f32(lse), f32(zmax), f32(target_z), f32(entropy), f32(sum_p2))
        full, kept_lse = None, st.lse
        if self.log_kept_mass is not None and self.recording:
            # on the support route LSE_V comes from the whole head's logits of the chunk
            lg_v, y_v = (logits, y) if self.full is None else self.full
            whole = self.inner.row_stats(lg_v, y_v, inv_temp, False, False, ws)
            full = whole.lse
            if self.full is not None:
                # the route left a row whose support is its target alone at logit 0: its
                # LSE_S is l_y, the whole head's target logit
                kept_lse = torch.where(valid.sum(1) == 1, whole.target_z.float(), st.lse)
        if self.vp is not None:
            from .vocab_parallel import combine

            out = combine(st, self.vp, full)
            st, full = out if full is not None else (out, None)
            kept_lse = st.lse
        if full is not None:
            self.log_kept_mass.index_copy_(0, pos, (kept_lse - full).clamp(max=0.0).float())
        return st

    def _full_row_stats(self, logits, targets, inv_temp, want_entropy, want_sum_p2, ws):
        """``over_support=False``: the whole vocabulary's statistics; the support's LSE only
        for ``log_kept_mass`` (joined to the same all_gather under vocab parallelism)."""
        pos = targets[:, 1]
        y, cols = self._local(targets)
        y = y.contiguous()
        st = self.inner.row_stats(logits, y, inv_temp, want_entropy, want_sum_p2, ws)
        if not self.recording:
            if self.vp is None:
                return st
            from .vocab_parallel import combine

            return combine(st, self.vp)
        l, _, valid = self._gather(logits, cols, inv_temp)
        lse_s = torch.logsumexp(l.masked_fill(~valid, float("-inf")), 1).float()
        if self.vp is not None:
            from .vocab_parallel import combine

            st, lse_s = combine(st, self.vp, lse_s)
        self.log_kept_mass.index_copy_(0, pos, (lse_s - st.lse).clamp(max=0.0).float())
        return st

    def logit_grad_(self, logits, targets, inv_temp, lse, entropy, g_logp, g_entropy,
                    ws: Workspace, softcap=None):
        y, cols = self._local(targets)
        if not self.over_support:
            return self.inner.logit_grad_(logits, y.contiguous(), inv_temp, lse, entropy, g_logp,
                                          g_entropy, ws, softcap)
        l, s, valid = self._gather(logits, cols, inv_temp)
        logq = l - lse.to(l.dtype).unsqueeze(1)
        q = torch.where(valid, torch.exp(logq), 0.0)
        g = g_logp.to(l.dtype).unsqueeze(1)
        if g_entropy is not None:
            # dH_S/dz_j = -q_j (log q_j + H_S) on the members
            grad = -q * (g + g_entropy.to(l.dtype).unsqueeze(1)
                         * (logq + entropy.to(l.dtype).unsqueeze(1)))
        else:
            grad = -q * g
        grad = grad + torch.where((cols == y.unsqueeze(1)) & valid, g, 0.0)
        if softcap is not None:
            grad = grad * (1.0 - (s / softcap) ** 2)
        grad = torch.where(valid, grad * _col(inv_temp), 0.0)
        logits.zero_()
        logits.scatter_add_(1, cols.clamp(min=0), grad.to(logits.dtype))
        return logits
