"""A stand-in for flash-attn (no CPU build exists), only so that OpenRLHF 0.11.2 imports on a
machine without a GPU: ``openrlhf/models/ring_attn_utils.py`` imports names from
``flash_attn.bert_padding`` and ``flash_attn.utils.distributed`` at import time. Every function
here raises if called, so nothing stubbed is ever on a computed path (OpenRLHF calls them only
for packed samples / ring attention, which the tests do not use). ``flash_attn.ops`` is
deliberately absent: OpenRLHF's ``log_probs_from_logits`` then takes its own PyTorch fallback,
as on any machine without flash-attn's Triton cross-entropy.
"""

__version__ = "0.0.0+gbc-standin"


def _unavailable(name):
    def fn(*args, **kwargs):
        raise RuntimeError(f"flash_attn.{name}: the gbc test stand-in for flash-attn was called; "
                           "packed samples / ring attention need the real flash-attn")
    fn.__name__ = name.rsplit(".", 1)[-1]
    return fn
