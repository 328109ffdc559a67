"""A stand-in for ring-flash-attention (``ring_flash_attn``, CUDA only) with the two names
OpenRLHF 0.11.2 imports: ``substitute_hf_flash_attn`` (its strategy, at ring_attn_size > 1) and
``update_ring_flash_attn_params`` (before each packed forward, the whole stream's
``cu_seqlens``). The attention is ``tests/standins/varlen_attention.py``'s ring attention: K/V
gathered over the group, causal within each packed sequence at its global positions."""

import varlen_attention as _va

__version__ = "0.0.0+gbc-standin"


def substitute_hf_flash_attn(process_group, heads_k_stride=1):
    _va.use_ring(process_group)


def update_ring_flash_attn_params(cu_seqlens, process_group):
    _va.RING["group"] = process_group
    _va.RING["cu_seqlens"] = cu_seqlens.clone()
