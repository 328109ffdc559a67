"""flash-attn's attention functions on torch's ``scaled_dot_product_attention``, for the tests
only (see ``flash_attn/__init__.py``): exact attention, in the inputs' dtype, so that code which
calls flash-attn's varlen kernel (transformers' ``flash_attention_2`` path, verl's Ulysses
attention patch around it) runs on a CPU. The packed varlen layout is honoured: each sequence of
``cu_seqlens`` attends only to itself, causally (bottom-right aligned, as flash-attn does when
the query is shorter than the key). Dropout, sliding windows, softcap and ALiBi are refused."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(dropout_p, window_size, softcap, alibi_slopes):
    if dropout_p:
        raise NotImplementedError("flash-attn stand-in: dropout_p must be 0")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError("flash-attn stand-in: sliding windows are not supported")
    if softcap:
        raise NotImplementedError("flash-attn stand-in: softcap is not supported")
    if alibi_slopes is not None:
        raise NotImplementedError("flash-attn stand-in: alibi_slopes is not supported")


def _attend(q, k, v, softmax_scale, causal):
    """One sequence: ``q [s_q, h, d]``, ``k, v [s_k, h_k, d]`` (h a multiple of h_k)."""
    h, hk = q.shape[1], k.shape[1]
    if h != hk:
        k = k.repeat_interleave(h // hk, dim=1)
        v = v.repeat_interleave(h // hk, dim=1)
    sq, sk = q.shape[0], k.shape[0]
    mask = None
    if causal:              # query i sees keys up to i + (sk - sq)
        mask = (torch.arange(sk, device=q.device)[None, :]
                <= torch.arange(sq, device=q.device)[:, None] + (sk - sq))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), attn_mask=mask,
                                         scale=softmax_scale)
    return out.transpose(0, 1)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                           max_seqlen_k=None, dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """``q [total_q, h, d]``, ``k, v [total_k, h_k, d]`` packed by ``cu_seqlens_q`` /
    ``cu_seqlens_k``: ``[total_q, h, d]``."""
    _check(dropout_p, window_size, softcap, alibi_slopes)
    if return_attn_probs or block_table is not None:
        raise NotImplementedError("flash-attn stand-in: return_attn_probs / block_table")
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(cq) != len(ck):
        raise ValueError("flash-attn stand-in: cu_seqlens_q and cu_seqlens_k differ in length")
    parts = [_attend(q[a:b], k[c:d], v[c:d], softmax_scale, causal)
             for a, b, c, d in zip(cq[:-1], cq[1:], ck[:-1], ck[1:])]
    return torch.cat(parts, 0) if parts else q.new_zeros(q.shape)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """``q [b, s_q, h, d]``, ``k, v [b, s_k, h_k, d]``: ``[b, s_q, h, d]``."""
    _check(dropout_p, window_size, softcap, alibi_slopes)
    if return_attn_probs:
        raise NotImplementedError("flash-attn stand-in: return_attn_probs")
    return torch.stack([_attend(q[i], k[i], v[i], softmax_scale, causal)
                        for i in range(q.shape[0])])


def flash_attn_with_kvcache(*args, **kwargs):
    raise NotImplementedError("flash-attn stand-in: flash_attn_with_kvcache (no KV cache)")
