"""§16 "Recompute": the sampler's kept set rebuilt from its settings, the plain way (a sort of
the whole row), as the fast path's ``SamplerTruncation`` defines it (docs/math.md, "The
sampler's kept set, recomputed").

Rank order: logit descending, token id ascending. ``rule="vllm"``: min-p (``p ≥ min_p ·
p_max``), then top-k, then top-p on the distribution renormalised over what min-p and top-k
kept, keeping a token iff the mass ranked before it is ``< top_p``. ``rule="sglang"``: the
three filters on the full distribution, top-p keeping iff the mass before is ``≤ top_p``, the
intersection kept. ``ties="first"``: top-k keeps the first ``k`` of the rank order;
``ties="all"``: also every token tied with the k-th.
"""

from __future__ import annotations

import math

import torch

from .core import _logits


def kept_set(l, top_k=None, top_p=1.0, min_p=0.0, ties="first", rule="vllm"):
    """The kept set ``[..., V]`` bool of the temperature-scaled logits ``l`` ``[..., V]``."""
    shape = l.shape
    l = l.reshape(-1, shape[-1]).to(torch.float64)
    V = l.shape[1]
    order = torch.argsort(-l, dim=1, stable=True)          # stable: lowest id first in a tie
    ls = l.gather(1, order)
    keep = torch.ones_like(ls, dtype=torch.bool)
    if min_p > 0.0:
        keep &= ls >= ls[:, :1] + math.log(min_p)
    if top_k is not None:
        rank = torch.arange(V, device=l.device).expand_as(ls)
        if ties == "first":
            keep &= rank < top_k
        else:
            keep &= ls >= ls[:, min(top_k, V) - 1:min(top_k, V)]
    if top_p < 1.0:
        if rule == "vllm":
            q = torch.softmax(ls.masked_fill(~keep, float("-inf")), dim=1)
            keep &= (q.cumsum(1) - q) < top_p
        else:
            q = torch.softmax(ls, dim=1)
            keep &= (q.cumsum(1) - q) <= top_p
    out = torch.zeros_like(keep).scatter_(1, order, keep)
    return out.view(shape)


def truncation_support_ids(hidden, weight, targets, bias=None, temperature=1.0,
                           logit_softcap=None, logits_dtype=None, top_k=None, top_p=1.0,
                           min_p=0.0, ties="first", rule="vllm"):
    """The kept set of every token as ``support_ids`` (``targets.shape + (V,)``, ``-1``
    padded) from the full logits at ``temperature``: what the fast path's
    ``sampler_truncation`` scores over (pass it as ``support_ids`` to this package's
    functions)."""
    z = _logits(hidden, weight, bias, temperature, logit_softcap, logits_dtype)
    keep = kept_set(z, top_k, top_p, min_p, ties, rule)
    ids = torch.arange(keep.shape[-1], device=keep.device).expand_as(keep)
    return torch.where(keep, ids, -1)
