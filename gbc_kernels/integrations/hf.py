"""Hugging Face transformers models: last hidden states and the lm_head, without logits.

Works for any causal LM that follows transformers' conventions: the decoder is found by
``model.get_decoder()`` (else ``model.base_model``), the head by ``model.get_output_embeddings()``
(tied embeddings included: it is then the embedding matrix itself), not per model family.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class LMHead(NamedTuple):
    weight: torch.Tensor            # [V, H]
    bias: Optional[torch.Tensor]    # [V] or None


def lm_head(model) -> LMHead:
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"model: {type(model).__name__} has no output embedding (lm_head) "
                         "with a weight")
    return LMHead(head.weight, getattr(head, "bias", None))


def decoder(model):
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if dec is None:
        dec = getattr(model, "base_model", None)
    if dec is None or dec is model:
        raise ValueError(f"model: cannot find the decoder of {type(model).__name__} "
                         "(no get_decoder() and no base_model)")
    return dec


def hidden_states(model, input_ids, attention_mask=None, logits_to_keep: int = 0,
                  **kwargs) -> torch.Tensor:
    """Final-layer hidden states ``[B, L, H]`` (the input of lm_head) of ``input_ids``.

    ``logits_to_keep = k > 0`` keeps the last ``k`` positions only (as transformers' argument of
    that name does for logits). Final norms are applied by the decoder, as in the model's own
    forward.
    """
    out = decoder(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                         **kwargs)
    h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return h[:, -logits_to_keep:] if logits_to_keep else h


def completion_hidden(model, input_ids, attention_mask=None) -> torch.Tensor:
    """Hidden states that predict ``input_ids[:, 1:]``: ``[B, L-1, H]``."""
    return hidden_states(model, input_ids, attention_mask)[:, :-1]
