"""NTHR, Negative Token Hidden Reward (docs/math.md §4), streaming: never the [N, V] logits.

Working set: one chunk of the full-vocabulary LSE pass (``O(chunk * V)``), then per group the
restricted logits ``h @ W[V*].T`` a chunk of tokens at a time and ``M+`` (``O(|V*| * H)``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _chunking
from . import _validate as V
from . import support as _S
from .config import resolve_logits_dtype
from ._fused import stats_sweep
from .backends import get_backend
from ._validate import as_mask as _mask, check_lm_head as _check_lm_head
from ._validate import check_temperature as _check_temperature, resolve_group


class NTHRResult(NamedTuple):
    scale: torch.Tensor       # [B, T] float32: eta_g on selected tokens, 1 elsewhere
    selected: torch.Tensor    # [B, T] bool: tokens of incorrect responses with s > tau_g
    scores: torch.Tensor      # [B, T] float32: s[b, t] in scored groups, 0 elsewhere
    thresholds: dict          # group id -> tau_g, for the groups with mixed correctness

    def metrics(self, correct: torch.Tensor, mask: torch.Tensor) -> dict:
        """``nthr_selected_frac`` (share of masked tokens of incorrect responses selected) and
        ``nthr_eta_mean`` (mean scale over the selected tokens; 1 when none)."""
        m = mask.bool()
        neg = m & ~correct.bool().unsqueeze(-1)
        n_sel = self.selected.sum().float()
        return {
            "nthr_selected_frac": (n_sel / neg.sum().clamp(min=1).float()),
            "nthr_eta_mean": torch.where(n_sel > 0, self.scale[self.selected].sum() /
                                         n_sel.clamp(min=1), torch.ones_like(n_sel)),
        }


def _error_chunks(h_all, tok, w_v, b_v, lse, col, inv_temp, rows, softcap=None,
                  members=None, vstar=None, from_logp=False):
    """Yield (start, end, h, e) over the tokens ``tok`` a chunk at a time: the chunk's hidden
    states (float32, gathered here: no [n, H] copy) and the restricted error
    e = onehot_{V*}(y) - q (float32, [rows, |V*|]).

    ``members`` ``[n, K]`` (the tokens' supports, -1 padded) with ``vstar`` (sorted): e is 0
    on the ids of ``V*`` off each token's support, and ``LSE_S`` is formed here from the
    chunk's own restricted logits, so that a support inside ``V*`` is normalised exactly
    (k = 1: q_y = 1, e = 0): ``from_logp``: ``lse`` holds ``logp_S``, ``LSE_S = l_y - logp_S``;
    else ``lse`` holds the LSE of the members outside ``V*`` (-inf: none), joined to that of
    those inside."""
    n = tok.numel()
    for s in range(0, n, rows):
        e_ = min(n, s + rows)
        h = h_all.index_select(0, tok[s:e_]).float()
        z = h @ w_v.t()
        if b_v is not None:
            z += b_v
        if softcap is not None:
            z = z.div_(softcap).tanh_().mul_(softcap)
        if members is None:
            err = torch.exp(z.mul_(inv_temp).sub_(lse[s:e_].unsqueeze(1))).neg_()
        else:
            l = z.mul_(inv_temp)
            on = _on_support(members[s:e_], vstar)
            if from_logp:
                lse_s = l[torch.arange(e_ - s, device=h.device), col[s:e_]] - lse[s:e_]
            else:
                lse_s = torch.logaddexp(torch.logsumexp(l.masked_fill(~on, float("-inf")), 1),
                                        lse[s:e_])
            err = torch.exp(l.sub_(lse_s.unsqueeze(1)).masked_fill_(~on, float("-inf"))).neg_()
        err[torch.arange(e_ - s, device=h.device), col[s:e_]] += 1.0
        yield s, e_, h, err


def _on_support(members, vstar):
    """``[rows, |V*|]`` bool: which ids of ``vstar`` (sorted) each row's ``members``
    (``[rows, K]``, -1 padded) hold."""
    nv = vstar.numel()
    at = torch.searchsorted(vstar, members.clamp(min=0)).clamp_(max=nv - 1)
    hit = (vstar[at] == members) & (members >= 0)
    on = torch.zeros(members.shape[0], nv + 1, device=members.device, dtype=torch.bool)
    return on.scatter_(1, torch.where(hit, at, nv), True)[:, :nv]


def _support_lse(h_all, tok, members, weight, bias, temperature, logit_softcap, vstar):
    """The LSE of the tokens ``tok`` over the members of their supports (``members``
    ``[n, K]``, -1 padded) outside ``vstar`` (-inf where none): each token's member logits
    from its hidden state and the gathered weight rows (float32 products of the operands'
    values; O(K H) a token, a chunk of tokens at a time, never the [n, V] logits).
    :func:`_error_chunks` joins the members inside ``vstar`` from its restricted logits."""
    device = h_all.device
    n, K = members.shape
    H = h_all.shape[1]
    rows = max(1, _chunking.budget_bytes(device) // (12 * K * (H + 4)))
    lse = torch.empty(n, device=device, dtype=torch.float32)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        c = members[s:e]
        flat = c.clamp(min=0).reshape(-1)
        w = weight.index_select(0, flat).float().view(e - s, K, H)
        h = h_all.index_select(0, tok[s:e]).float()
        z = torch.bmm(w, h.unsqueeze(2)).squeeze(2)
        del w
        if bias is not None:
            z += bias.index_select(0, flat).float().view(e - s, K)
        if logit_softcap is not None:
            z = z.div_(logit_softcap).tanh_().mul_(logit_softcap)
        inside = (vstar[torch.searchsorted(vstar, c.clamp(min=0)).clamp_(max=vstar.numel() - 1)]
                  == c)
        z = z.mul_(1.0 / temperature).masked_fill_((c < 0) | inside, float("-inf"))
        lse[s:e] = torch.logsumexp(z, 1)
    return lse


@torch.no_grad()
def check_whole_groups(group_ids: torch.Tensor, process_group) -> None:
    """Raise ``ValueError`` (on every rank) when a group id occurs on more than one rank of
    ``process_group`` (``"world"``: the default group)."""
    import torch.distributed as dist

    group = resolve_group("data_parallel_group", None if process_group == "world"
                          else process_group)
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, torch.unique(group_ids).tolist(), group=group)
    seen, split = set(), set()
    for ids in every:
        split |= seen & set(ids)
        seen |= set(ids)
    if split:
        raise ValueError(f"group_ids: group(s) {sorted(split)[:8]} have responses on more than "
                         "one rank of data_parallel_group; NTHR compares a group's responses with "
                         "each other, so each group must sit on one rank (shard the batch by "
                         "group, or gather the groups first)")


def nthr_scale(hidden, weight, targets, mask, group_ids, correct, bias=None, temperature=1.0,
               beta=1.0, eta="auto", backend="auto", logp=None,
               vocab_parallel=None, data_parallel_group=None,
               logit_softcap=None, logits_dtype=None, support_ids=None) -> NTHRResult:
    """Per-token advantage scale of NTHR (docs/math.md §4), from the old policy's hidden states.

    hidden: [B, T, H]; weight: [V, H]; targets, mask: [B, T]; group_ids: [B] integer (groups
    may be non-contiguous and of any size); correct: [B] bool (binary reward).
    ``eta="auto"``: ``eta_g = 2 |0.5 - p|`` with p the group's share of correct responses.
    ``logp``: optional [B, T] log-probs of ``targets`` from the same old-policy pass (what
    ``token_stats`` returns as ``old_logp``). Given, the full-vocabulary LSE is recovered as
    ``z[y] - logp`` (O(N H)) instead of a streaming pass over the vocabulary (O(N H V)), which
    makes NTHR cost only its restricted matmuls.
    ``vocab_parallel``: ``weight``/``bias`` are this rank's slice (docs/math.md §9); the result
    is the same on every rank.
    ``support_ids``: None (the whole vocabulary), or the sampler's kept ids of each token,
    ``[B, T, k]`` integer, ``-1`` padded, order free, duplicates counting once, the target
    always a member (docs/math.md, "The sampler's support"): the error vector is
    ``onehot(y) - q`` on the ids of ``V*`` in S and 0 on those off S, with
    ``q_v = exp(l_v - LSE_S)`` and ``LSE_S`` over each token's support. ``logp`` then must be
    the log-probs over the same support (``LSE_S = z[y] / T - logp``); without it ``LSE_S``
    comes from the members' own logits (gathered weight rows, float32 products, O(k H) a
    token; ``logits_dtype`` has no effect). Under ``vocab_parallel`` and
    ``data_parallel_group`` too (vocab parallel without ``logp``: the support's log-probs from
    the split vocabulary's sweep, in ``logits_dtype``'s mode).
    ``logit_softcap``: final-logit soft-capping ``c`` (the restricted logits and the LSE are
    those of ``c tanh(x / c)``).
    ``logits_dtype``: None or ``torch.float32`` / ``"float32"``: the mode of the LSE pass when
    ``logp`` is not given (docs/kernels.md, "Precision"; the restricted logits are always
    float32 products of the operands' values). Given ``logp``, it should come from a pass in
    the same mode.
    ``data_parallel_group``: the process group the batch is split over (data parallelism;
    ``"world"``: the default group); ``group_ids`` are global. A group's responses may sit on
    several ranks (verl's ``balance_batch`` splits groups): its counts and ``V*`` are merged,
    ``M+`` is summed and the anchor is the least over every rank, so each rank gets the scale
    of its own rows as one process would compute it on the whole batch. With
    ``vocab_parallel`` too, each group must sit on one rank (else ``ValueError`` on every rank).
    """
    V.check_backend(backend)
    logits_dtype = V.check_logits_dtype(logits_dtype)
    _check_lm_head(hidden, weight, bias)
    logits_dtype = resolve_logits_dtype(logits_dtype, hidden.dtype, hidden.device)
    V.check_tensor("hidden", hidden, dims=(3,))
    _check_temperature("temperature", temperature)
    B, T, H = hidden.shape
    device = hidden.device
    V.check_tensor("targets", targets, shape=(B, T), integer=True, device=device)
    m = _mask(mask, B, T, device)
    V.check_tensor("group_ids", group_ids, shape=(B,), integer=True, device=device)
    V.check_tensor("correct", correct, shape=(B,), device=device)
    if not (eta == "auto" or (isinstance(eta, (int, float)) and 0.0 <= eta)):
        raise ValueError(f"eta: expected 'auto' or a float >= 0, got {eta!r}")
    if not isinstance(beta, (int, float)):
        raise TypeError(f"beta: expected a float, got {type(beta).__name__}")
    if logit_softcap is not None and not (isinstance(logit_softcap, (int, float))
                                          and 0 < logit_softcap < float("inf")):
        raise ValueError(f"logit_softcap: expected None or a finite float > 0, "
                         f"got {logit_softcap!r}")
    if vocab_parallel is not None:
        if data_parallel_group is not None:
            check_whole_groups(group_ids, data_parallel_group)
        from . import vocab_parallel as _vp
        sl = _vp.check(vocab_parallel, weight, bias, device)
        if logp is not None:
            V.check_tensor("logp", logp, shape=(B, T), floating=True, device=device)
        safe = V.check_targets(targets, sl.vocab, m)
        ids = None if support_ids is None else _S.check_support_ids(support_ids, targets,
                                                                     sl.vocab, m)
        return _nthr_vocab_parallel(hidden, weight, bias, safe,
                                    m, group_ids, correct, temperature, beta, eta, backend, logp,
                                    sl, logit_softcap, logits_dtype, ids)
    dp = _DataParallel.of(data_parallel_group)
    safe = V.check_targets(targets, weight.shape[0], m).reshape(-1)
    members = None
    if support_ids is not None:
        ids = _S.check_support_ids(support_ids, targets, weight.shape[0], m)
        members = _S.members(ids.reshape(B * T, -1), safe)[0]
    correct = correct.bool()
    if logp is not None:
        V.check_tensor("logp", logp, shape=(B, T), floating=True, device=device)
        V.check_finite("logp", logp, m)

    scale = torch.ones(B * T, device=device, dtype=torch.float32)
    selected = torch.zeros(B * T, device=device, dtype=torch.bool)
    scores = torch.zeros(B * T, device=device, dtype=torch.float32)
    thresholds = {}

    idx = m.reshape(-1).nonzero().squeeze(1)            # masked tokens, row-major
    tok_row = idx // T
    gids = group_ids[tok_row]
    # which groups are mixed (host side: NTHR runs once per RL step, off the hot path); with
    # data parallelism, counted over every rank (a group may be split over ranks)
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    n_pos = torch.zeros(len(uniq), device=device).index_add_(0, inv, correct.float())
    n_all = torch.zeros(len(uniq), device=device).index_add_(0, inv, torch.ones(B, device=device))
    counts = {g: (float(p), float(a)) for g, p, a in zip(uniq.tolist(), n_pos.tolist(),
                                                        n_all.tolist())}
    if dp is not None:
        counts = dp.sum_counts(counts)
    order = sorted(g for g, (p, a) in counts.items() if 0 < p < a)
    if not order:
        return NTHRResult(scale.view(B, T), selected.view(B, T), scores.view(B, T), thresholds)
    tok_of = {g: idx[gids == g] for g in order}
    # V* of each group: the distinct target ids of its masked tokens (on every rank)
    vstars = {g: torch.unique(safe[tok_of[g]]) for g in order}
    if dp is not None:
        vstars = dp.union_ids(vstars, device)

    be = get_backend(backend, device, hidden.dtype)
    h_all = hidden.reshape(B * T, H)
    inv_temp = 1.0 / temperature
    stage = []                      # (group, its tokens, their scores, correct mask)
    anchors = torch.full((len(order),), float("inf"), device=device)
    for gi, g in enumerate(order):
        tok, vstar = tok_of[g], vstars[g]
        y = safe[tok]
        mem = None if members is None else members.index_select(0, tok)
        col = torch.searchsorted(vstar, y)
        w_v = weight.index_select(0, vstar).float()
        b_v = None if bias is None else bias.index_select(0, vstar).float()
        if tok.numel() == 0:        # none of the group on this rank: it joins the collectives
            lse = torch.zeros(0, device=device, dtype=torch.float32)
        elif mem is not None:       # the support's: LSE_S is formed in _error_chunks
            lse = (logp.reshape(-1)[tok].float() if logp is not None else
                   _support_lse(h_all, tok, mem, weight, bias, temperature, logit_softcap, vstar))
        elif logp is not None:
            lse = _lse_from_logp(h_all, tok, y, weight, bias, logp, temperature, logit_softcap)
        else:
            lse = stats_sweep(h_all.index_select(0, tok), weight, bias, y, be, temperature,
                              False, softcap=logit_softcap, logits_dtype=logits_dtype)[2]
        # chunk: [rows, |V*|] logits/error and [rows, H] temporaries within a quarter budget
        rows = max(1, _chunking.budget_bytes(device) // (16 * (2 * vstar.numel() + 2 * H)
                                                          + (0 if mem is None else
                                                             vstar.numel() + 32 * mem.shape[1])))
        row_of = tok // T
        pos = correct[row_of]
        # pass 1, correct tokens only: M+ = sum e (x) h (summed over the ranks)
        m_plus = torch.zeros(vstar.numel(), H, device=device, dtype=torch.float32)
        pidx = pos.nonzero().squeeze(1)
        for s, e, hc, err in _error_chunks(h_all, tok[pidx], w_v, b_v, lse[pidx], col[pidx],
                                           inv_temp, rows, logit_softcap,
                                           None if mem is None else mem[pidx], vstar,
                                           logp is not None):
            m_plus.addmm_(err.t(), hc)
        if dp is not None:
            dp.all_reduce(m_plus)
        # pass 2, every token: s = e^T M+ h
        s_tok = torch.empty(tok.numel(), device=device, dtype=torch.float32)
        for s, e, hc, err in _error_chunks(h_all, tok, w_v, b_v, lse, col, inv_temp, rows,
                                           logit_softcap, mem, vstar, logp is not None):
            s_tok[s:e] = (err @ m_plus).mul_(hc).sum(-1)
        scores[tok] = s_tok
        # anchor: mean score per correct response (a response sits on one rank), the least
        rid, rinv = torch.unique(row_of, return_inverse=True)
        ssum = torch.zeros(len(rid), device=device).index_add_(0, rinv, s_tok)
        cnt = torch.zeros(len(rid), device=device).index_add_(0, rinv, torch.ones_like(s_tok))
        pos_rows = correct[rid]
        if bool(pos_rows.any()):
            anchors[gi] = (ssum / cnt)[pos_rows].min()
        stage.append((g, tok, s_tok, pos))
    if dp is not None:
        dp.all_reduce(anchors, op="min")
    for gi, (g, tok, s_tok, pos) in enumerate(stage):
        if not torch.isfinite(anchors[gi]):       # no correct response with a masked token
            continue
        tau = beta * anchors[gi]
        thresholds[g] = float(tau)
        p, a = counts[g]
        eta_g = 2.0 * abs(0.5 - p / a) if eta == "auto" else float(eta)
        sel = (~pos) & (s_tok > tau)
        selected[tok[sel]] = True
        scale[tok[sel]] = eta_g
    return NTHRResult(scale.view(B, T), selected.view(B, T), scores.view(B, T), thresholds)


def _lse_from_logp(h_all, tok, y, weight, bias, logp, temperature, logit_softcap):
    """The full-vocabulary LSE of the tokens ``tok`` as ``z[y] / temperature - logp`` (one dot
    product per token) from the old-policy pass's log-probs."""
    device = h_all.device
    zy = torch.zeros(tok.numel(), device=device, dtype=torch.float32)
    for s in range(0, tok.numel(), 1024):
        hs = h_all.index_select(0, tok[s:s + 1024]).float()
        zy[s:s + 1024] = (hs * weight.index_select(0, y[s:s + 1024]).float()).sum(-1)
    if bias is not None:
        zy = zy + bias.index_select(0, y).float()
    if logit_softcap is not None:
        zy = zy.div(logit_softcap).tanh().mul(logit_softcap)
    return zy / temperature - logp.reshape(-1)[tok].float()


class _DataParallel:
    """The collectives of NTHR over data-parallel ranks, where a group's responses may sit on
    several ranks: counts and V* are merged, ``M+`` summed, the anchor is the least over every
    rank. Every rank walks the same (sorted) groups, so the collectives pair up."""

    def __init__(self, group):
        self.group = group

    @classmethod
    def of(cls, data_parallel_group):
        if data_parallel_group is None:
            return None
        import torch.distributed as dist

        group = resolve_group("data_parallel_group", None if data_parallel_group == "world"
                              else data_parallel_group)
        return cls(group) if dist.get_world_size(group) > 1 else None

    def _gather(self, obj):
        import torch.distributed as dist

        every = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, obj, group=self.group)
        return every

    def sum_counts(self, counts):
        total = {}
        for part in self._gather(counts):
            for g, (p, a) in part.items():
                q, b = total.get(g, (0.0, 0.0))
                total[g] = (q + p, b + a)
        return total

    def union_ids(self, vstars, device):
        merged = {g: set() for g in vstars}
        for part in self._gather({g: v.tolist() for g, v in vstars.items()}):
            for g, ids in part.items():
                merged[g].update(ids)
        return {g: torch.tensor(sorted(ids), dtype=torch.long, device=device)
                for g, ids in merged.items()}

    def all_reduce(self, t, op="sum"):
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.SUM,
                        group=self.group)


def _nthr_vocab_parallel(hidden, weight, bias, safe_targets, mask, group_ids, correct, temperature,
                         beta, eta, backend, logp, sl, logit_softcap=None, logits_dtype=None,
                         support_ids=None):
    """NTHR over a split vocabulary: the log-probs over the whole vocabulary or each token's
    support (the shared chunk loop in vocab-parallel mode, or ``logp``), and the rows of the
    lm_head its restricted matmuls need — the ids that occur in the masked targets — assembled
    on every rank; then the one-device computation on those rows (``support_ids``, checked:
    mapped onto those rows, the members outside them dropped: their logits are in ``logp``)."""
    from .vocab_parallel import gather_rows

    B, T, _ = hidden.shape
    if logp is None:
        h2 = hidden.detach().reshape(B * T, -1)
        be = get_backend(backend, hidden.device, hidden.dtype)
        flat = safe_targets.reshape(-1)
        if support_ids is not None:
            cols = _S.members(support_ids.reshape(B * T, -1), flat)[0]
            be = _S.SupportBackend(be, B * T, hidden.device, kept_mass=False, vp=sl)
            flat = _S.flat_targets(flat, cols)
        logp = stats_sweep(h2, weight.detach(), None if bias is None else bias.detach(),
                           flat, be, float(temperature),
                           False, softcap=logit_softcap, vp=sl,
                           logits_dtype=logits_dtype)[0].view(B, T)
    used = torch.unique(safe_targets[mask])            # sorted; the same on every rank
    rows, b = gather_rows(used, weight.detach(), None if bias is None else bias.detach(), sl)
    if used.numel() == 0:
        rows = weight.new_zeros(1, weight.shape[1])
        b = None if bias is None else bias.new_zeros(1)
    compact = torch.searchsorted(used, safe_targets).clamp(max=max(used.numel() - 1, 0))
    compact = torch.where(mask, compact, torch.zeros_like(compact))
    compact_ids = None
    if support_ids is not None:
        compact_ids = torch.full_like(support_ids, -1)
        if used.numel() > 0:
            at = torch.searchsorted(used, support_ids.clamp(min=0)).clamp_(max=used.numel() - 1)
            compact_ids = torch.where((used[at] == support_ids) & (support_ids >= 0), at, -1)
    return nthr_scale(hidden, rows, compact, mask, group_ids, correct, bias=b,
                      temperature=temperature, beta=beta, eta=eta, backend=backend, logp=logp,
                      logit_softcap=logit_softcap, logits_dtype=logits_dtype,
                      support_ids=compact_ids)
