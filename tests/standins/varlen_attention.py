"""Test stand-ins for flash-attn's packed-sample ("varlen") attention and its padding helpers,
on PyTorch's ``scaled_dot_product_attention`` (flash-attn has no CPU build).

- :func:`flash_attn_varlen_func`: flash-attn's signature; each packed sequence (``cu_seqlens``)
  attends causally to itself only.
- :data:`ATTN_IMPLEMENTATION`: a transformers attention implementation registered under this
  name (:func:`register`), which, like transformers' ``flash_attention_2`` on a batch without
  an attention mask, takes the packed sequences' boundaries from ``position_ids`` (a sequence
  starts where its position is 0) and calls :func:`flash_attn_varlen_func`. A model runs it
  with ``model.config._attn_implementation = ATTN_IMPLEMENTATION``.
- ``unpad_input``, ``pad_input``, ``index_first_axis``, ``rearrange`` (``flash_attn.bert_padding``)
  and ``all_gather`` (``flash_attn.utils.distributed``: autograd-aware, its backward sums the
  gradient over the group and keeps this rank's slice) as flash-attn defines them.
  :func:`patch_openrlhf` puts them into OpenRLHF's ``ring_attn_utils`` (which imported flash-attn's
  names when it was imported).
- Ring attention: ``tests/standins/ring_flash_attn`` (:func:`ring_attention_forward` here).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange  # noqa: F401  (flash_attn.bert_padding re-exports einops')

ATTN_IMPLEMENTATION = "gbc_standin_varlen"


# ------------------------------------------------------------------ flash_attn.bert_padding
def index_first_axis(x, indices):
    """``x [n, ...]`` rows ``indices`` (autograd)."""
    return x[indices]


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """``hidden_states [B, S, ...]``, ``attention_mask [B, S]`` -> ``(packed [n, ...], indices,
    cu_seqlens, max_seqlen, seqused)`` as flash-attn's."""
    all_mask = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = all_mask.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_mask.flatten(), as_tuple=False).flatten()
    cu = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu, int(seqlens.max().item()), used


def pad_input(hidden_states, indices, batch, seqlen):
    """``[n, ...]`` packed -> ``[batch, seqlen, ...]`` with zeros at the padding (autograd)."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


# ---------------------------------------------------------------- flash_attn.utils.distributed
class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)         # reduce_scatter: the sum, own slice
        n = grad.shape[0] // dist.get_world_size(ctx.group)
        r = dist.get_rank(ctx.group)
        return grad[r * n:(r + 1) * n], None


def all_gather(x, group):
    """flash-attn's ``all_gather``: concatenated along dim 0; backward: reduce-scatter (sum)."""
    return _AllGather.apply(x, group)


# ------------------------------------------------------------------------------ attention
def _attend(q, k, v, allowed, scale):
    """q ``[tq, hq, d]``, k/v ``[tk, hk, d]``, allowed ``[tq, tk]`` bool -> ``[tq, hq, d]``."""
    rep = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(rep, dim=1) if rep > 1 else x for x in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


def _segments(cu, n, device):
    """(sequence id, offset in it) of each of the first ``n`` packed positions."""
    cu = cu.to(device=device, dtype=torch.long)
    pos = torch.arange(n, device=device)
    seq = torch.searchsorted(cu[1:], pos, right=True)
    return seq, pos - cu[seq]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, dropout_p=0.0, softmax_scale=None, causal=False,
                           **unused):
    """flash-attn's varlen attention: each packed sequence attends to its own keys only
    (``causal``: bottom-right aligned, as flash-attn >= 2.1)."""
    if dropout_p:
        raise ValueError("the varlen stand-in has no dropout")
    sq, oq = _segments(cu_seqlens_q, q.shape[0], q.device)
    sk, ok = _segments(cu_seqlens_k, k.shape[0], k.device)
    allowed = sq[:, None] == sk[None, :]
    if causal:
        lq = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(q.device)[sq]
        lk = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(q.device)[sq]
        allowed &= ok[None, :] <= (oq + lk - lq)[:, None]
    return _attend(q, k, v, allowed, softmax_scale)


def cu_seqlens_from_position_ids(position_ids):
    """transformers' rule for a packed batch: a sequence starts where its position is the
    minimum (0)."""
    pos = position_ids.reshape(-1)
    starts = (pos == pos.min()).nonzero().view(-1).to(torch.int32)
    return torch.cat((starts, torch.tensor([pos.numel()], dtype=torch.int32,
                                           device=pos.device)))


def varlen_attention_forward(module, query, key, value, attention_mask, dropout=0.0,
                             scaling=None, sliding_window=None, position_ids=None, **kwargs):
    """A transformers attention function (``[1, h, n, d]`` inputs, ``[1, n, h, d]`` output) for
    packed samples: boundaries from ``position_ids``, as ``flash_attention_2`` without a mask."""
    if attention_mask is not None or query.shape[0] != 1 or position_ids is None:
        raise ValueError("the varlen stand-in takes one packed row with position_ids and no "
                         "attention mask")
    if sliding_window is not None:
        raise ValueError("the varlen stand-in has no sliding window")
    cu = cu_seqlens_from_position_ids(position_ids)
    out = flash_attn_varlen_func(query[0].transpose(0, 1), key[0].transpose(0, 1),
                                 value[0].transpose(0, 1), cu, cu, dropout_p=dropout,
                                 softmax_scale=scaling, causal=module.is_causal)
    return out.unsqueeze(0), None


RING = {}          # what ring_flash_attn's stand-in was given: group, global cu_seqlens


def ring_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           sliding_window=None, **kwargs):
    """Ring attention for this rank's contiguous slice of the packed stream: K/V gathered over
    the ring group (autograd-aware), each query at its global position attends causally to
    its own sequence's keys (``cu_seqlens`` of the whole stream, padding included, as
    ``update_ring_flash_attn_params`` received them)."""
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError("the ring stand-in takes one packed row and no attention mask")
    group, cu = RING["group"], RING["cu_seqlens"]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    n, world, rank = q.shape[0], dist.get_world_size(group), dist.get_rank(group)
    k_all, v_all = all_gather(k, group), all_gather(v, group)
    if int(cu[-1]) != n * world:
        raise ValueError(f"ring stand-in: cu_seqlens cover {int(cu[-1])} tokens, the ring "
                         f"holds {n} x {world}")
    seq, _ = _segments(cu, n * world, q.device)
    qpos = torch.arange(rank * n, (rank + 1) * n, device=q.device)
    kpos = torch.arange(n * world, device=q.device)
    allowed = (seq[qpos][:, None] == seq[None, :]) & (kpos[None, :] <= qpos[:, None])
    return _attend(q, k_all, v_all, allowed, scaling).unsqueeze(0), None


def register():
    """Register :data:`ATTN_IMPLEMENTATION` (the packed varlen stand-in) with transformers."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention_forward)


def use_ring(group):
    """``ring_flash_attn.substitute_hf_flash_attn``'s stand-in: the implementation runs ring
    attention over ``group``."""
    from transformers import AttentionInterface

    RING["group"] = group
    AttentionInterface.register(ATTN_IMPLEMENTATION, ring_attention_forward)


def patch_openrlhf():
    """Put the working padding / gather functions into OpenRLHF's ``ring_attn_utils``."""
    from openrlhf.models import ring_attn_utils as r

    for name in ("index_first_axis", "pad_input", "rearrange", "unpad_input", "all_gather"):
        setattr(r, name, globals()[name])
    register()
