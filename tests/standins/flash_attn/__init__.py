"""A stand-in for flash-attn (no CPU build exists), for the tests only. OpenRLHF 0.11.2 imports
names from ``flash_attn.bert_padding`` and ``flash_attn.utils.distributed`` at import time;
those raise if called, so nothing stubbed is ever on a computed path (OpenRLHF calls them only
for packed samples / ring attention). The attention functions themselves
(``flash_attn_varlen_func``, ``flash_attn_func``, in ``flash_attn_interface.py``) compute exact
attention on torch's ``scaled_dot_product_attention`` with each packed sequence's own causal
mask, so transformers' ``flash_attention_2`` path and verl's Ulysses patch around it run on a
CPU. ``flash_attn.ops`` is deliberately absent: OpenRLHF's ``log_probs_from_logits`` then takes
its own PyTorch fallback, as on any machine without flash-attn's Triton cross-entropy.
"""

__version__ = "0.0.0+gbc-standin"


def _unavailable(name):
    def fn(*args, **kwargs):
        raise RuntimeError(f"flash_attn.{name}: the gbc test stand-in for flash-attn was called; "
                           "packed samples / ring attention need the real flash-attn")
    fn.__name__ = name.rsplit(".", 1)[-1]
    return fn


from .flash_attn_interface import (  # noqa: E402
    flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache)
