"""Hugging Face transformers causal LMs: last hidden states, the lm_head (``get_decoder()`` /
``get_output_embeddings()``, tied embeddings included) and the fused passes inside the model's
forward, without logits (docs/own-loop.md, docs/math.md §11).
"""

from __future__ import annotations

import contextlib
import operator
from typing import NamedTuple, Optional

import torch

from gbc_kernels import methods


class LMHead(NamedTuple):
    weight: torch.Tensor            # [V, H]
    bias: Optional[torch.Tensor]    # [V] or None


def lm_head(model) -> LMHead:
    """The lm_head's weight and bias as the model's forward uses them; PEFT: a
    ``modules_to_save`` head's trained copy, or a LoRA adapter folded in, ``W + sum_a s_a B_a
    A_a`` (differentiable in A and B; an adapter with dropout on the head raises)."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"model: {type(model).__name__} has no output embedding (lm_head) "
                         "with a weight")
    if hasattr(head, "lora_A") and hasattr(head, "base_layer"):
        return _lora_head(head)
    return LMHead(head.weight, getattr(head, "bias", None))


def _lora_head(head) -> LMHead:
    base = head.base_layer
    weight = base.weight
    if getattr(head, "disable_adapters", False) or getattr(head, "merged", False):
        return LMHead(weight, getattr(base, "bias", None))
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        drop = head.lora_dropout[name]
        if isinstance(drop, torch.nn.Dropout) and drop.p > 0 and head.training:
            raise ValueError(f"model: the LoRA adapter {name!r} on the lm_head has dropout "
                             f"{drop.p}; the fused loss folds the adapter into the head's weight, "
                             "which dropout on the head's input forbids (use lora_dropout=0)")
        if getattr(head, "use_dora", {}).get(name, False):
            raise ValueError(f"model: the DoRA adapter {name!r} on the lm_head is not supported")
        a, b = head.lora_A[name].weight, head.lora_B[name].weight
        weight = weight + head.scaling[name] * (b @ a).to(weight.dtype)
    return LMHead(weight, getattr(base, "bias", None))


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
    """Final-layer hidden states ``[B, L, H]`` (the lm_head's input, after the decoder's final
    norm) of ``input_ids``; ``logits_to_keep = k > 0``: the last ``k`` positions only."""
    out = decoder(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                         **kwargs)
    h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return h[:, -logits_to_keep:] if logits_to_keep else h


def completion_hidden(model, input_ids, attention_mask=None, completion_len: int = 0
                      ) -> torch.Tensor:
    """Hidden states that predict ``input_ids[:, 1:]``: ``[B, L-1, H]``; with
    ``completion_len = T > 0``, only those that predict the last ``T`` tokens: ``[B, T, H]``."""
    keep = completion_len + 1 if completion_len else 0
    return hidden_states(model, input_ids, attention_mask, logits_to_keep=keep)[:, :-1]


def hidden_states_through_forward(model, input_ids, attention_mask=None, completion_len: int = 0,
                                  unwrapped=None, **kwargs) -> torch.Tensor:
    """:func:`completion_hidden` through ``model(...)`` itself (a wrapper's forward runs: DDP,
    FSDP, accelerate), the states the lm_head receives (:func:`replaced_head_forward`), no
    ``[B, L, V]`` tensor. ``unwrapped``: the model inside (default :func:`unwrap`); ``kwargs``
    go to the forward."""
    T = completion_len or input_ids.shape[1] - 1
    inner = unwrap(model) if unwrapped is None else unwrapped
    return _through_head(model, inner, input_ids, attention_mask, T, lambda h: (h, None),
                         kwargs)[0]


def check_forward_inputs(inner, input_ids, attention_mask, completion_len,
                         name="completion_len") -> int:
    """Check a forward's inputs before the model sees them: ``input_ids`` integer ``[B, L]``
    inside the embedding, ``attention_mask`` None or ``[B, L]``, ``completion_len`` an int in
    ``[1, L - 1]``. Returns ``T``."""
    import gbc_kernels as gbc

    if not hasattr(inner, "get_output_embeddings") or not hasattr(inner, "get_input_embeddings"):
        raise ValueError(f"model: expected a transformers causal LM (get_input_embeddings / "
                         f"get_output_embeddings), got {type(inner).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 \
            or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        got = (f"{type(input_ids).__name__}" if not isinstance(input_ids, torch.Tensor)
               else f"{input_ids.dtype} tensor of shape {list(input_ids.shape)}")
        raise ValueError(f"input_ids: expected an integer tensor [B, L], got {got}")
    B, L = input_ids.shape
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, L):
            got = (list(attention_mask.shape) if isinstance(attention_mask, torch.Tensor)
                   else type(attention_mask).__name__)
            raise ValueError(f"attention_mask: expected shape [{B}, {L}] (the whole sequence, "
                             f"as input_ids), got {got}")
    try:
        if isinstance(completion_len, bool):
            raise TypeError
        completion_len = operator.index(completion_len)      # ints, numpy ints; not 5.7 or "5"
    except TypeError:
        raise TypeError(f"{name}: expected an int (the completion's length), got "
                        f"{type(completion_len).__name__} {completion_len!r}") from None
    if not 0 < completion_len < L:
        raise ValueError(f"{name}: expected 1 <= {name} <= L - 1 = {L - 1} (input_ids hold "
                         f"{L} tokens, the first predicted one needs a token before it), got "
                         f"{completion_len}")
    emb = inner.get_input_embeddings()
    vocab = getattr(emb, "num_embeddings", None)
    if vocab is not None and gbc.value_checks_enabled():
        bad = (input_ids < 0) | (input_ids >= vocab)
        if bool(bad.any()):
            b, t = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"input_ids: expected token ids in [0, {vocab}) (the model's "
                             f"embedding), got {int(input_ids[b, t])} at index [{b}, {t}]")
    return completion_len


def unwrap(model):
    """The transformers (or PEFT) model inside DDP / accelerate wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


@contextlib.contextmanager
def replaced_head_forward(inner, head_forward):
    """Inside the block, ``inner``'s lm_head module runs ``head_forward`` as its ``forward``; the
    module stays in place, so a wrapper's hooks on it (FSDP2, ZeRO-3 gather) run as usual."""
    head_mod = inner.get_output_embeddings()
    if head_mod is None:
        raise ValueError(f"model: {type(inner).__name__} has no output embedding (lm_head)")
    had_own = "forward" in head_mod.__dict__
    own = head_mod.__dict__.get("forward")
    head_mod.forward = head_forward
    try:
        yield head_mod
    finally:
        if had_own:
            head_mod.forward = own
        else:
            del head_mod.forward


def _through_head(model, inner, input_ids, attention_mask, T, compute, model_kwargs=None):
    """One ``model(...)`` call whose lm_head forward is ``compute`` on the hidden states that
    predict the last ``T`` tokens (``[B, T, H]``, autocast off; ``T = None``: every position's,
    ``[B, L, H]``, for packed samples). ``compute`` returns ``(result, tie)``: the stand-in
    logits are zeros plus ``tie`` (a scalar or None), so that a wrapper's backward hooks on the
    head run before ``tie``'s backward. Returns ``(result, outputs)``."""
    captured = []
    keep = slice(None) if T is None else slice(-(T + 1), None)

    def head_forward(hidden, *args, **kwargs):
        h = hidden if T is None else hidden[:, -(T + 1):-1]
        with torch.autocast(device_type=h.device.type, enabled=False):
            result, tie = compute(h)
        captured.append(result)
        stand_in = hidden[:, keep, :1] * 0
        return stand_in if tie is None else stand_in + tie.to(hidden.dtype)

    with replaced_head_forward(inner, head_forward):
        outputs = model(input_ids=input_ids, attention_mask=attention_mask,
                        logits_to_keep=0 if T is None else T + 1, use_cache=False,
                        **(model_kwargs or {}))
    if len(captured) != 1:
        raise RuntimeError(f"model: expected its forward to call its lm_head once, it did "
                           f"{len(captured)} times")
    return captured[0], outputs


def policy_loss_through_forward(model, input_ids, attention_mask, completion_len: int, mask,
                                advantages, old_logp=None, ref_logp=None, config=None,
                                unwrapped=None, return_outputs: bool = False,
                                model_kwargs: Optional[dict] = None, old_policy=None,
                                **loss_kwargs):
    """:func:`gbc_kernels.fused_linear_policy_loss` over the last ``completion_len = T`` tokens,
    computed inside ``model``'s forward (wrapped by DDP, accelerate, FSDP2, ZeRO-3, or PEFT:
    every wrapper's hooks run as usual; docs/math.md §11); no ``[B, T, V]`` logits. ``mask``,
    ``advantages``, ``old_logp``, ``ref_logp``, ``loss_kwargs``: as the loss takes them
    (``[B, T]``); the model's soft-capping applies unless ``config`` sets its own;
    ``model_kwargs`` go to the forward. ``old_policy``: this forward's policy is the old one
    (on policy, the first update): :func:`old_policy_head`'s ``compute`` runs on its hidden
    states first and its NTHR scales are the loss's ``token_scale``. Returns ``(loss,
    metrics[, outputs])``."""
    inner = unwrap(model) if unwrapped is None else unwrapped
    T = check_forward_inputs(inner, input_ids, attention_mask, completion_len)
    return _policy_loss_in_forward(model, inner, input_ids, attention_mask, T, lambda h: h,
                                   input_ids[:, -T:], mask, advantages, old_logp, ref_logp,
                                   config, return_outputs, model_kwargs, loss_kwargs,
                                   old_policy)


def packed_policy_loss_through_forward(model, input_ids, position_ids, rows, targets, mask,
                                       advantages, old_logp=None, ref_logp=None, config=None,
                                       unwrapped=None, return_outputs: bool = False,
                                       model_kwargs: Optional[dict] = None, **loss_kwargs):
    """:func:`policy_loss_through_forward` for packed samples: the model runs on one packed row
    ``input_ids [1, n]`` at ``position_ids [1, n]``, without an attention mask (the attention
    finds the sequences' boundaries, e.g. flash-attn's varlen kernels); ``rows(h)`` maps its
    hidden states ``[1, n, H]`` to the loss's rows ``[B, T, H]``, which ``targets``, ``mask``,
    ``advantages``, ... (``[B, T]``) describe. Returns ``(loss, metrics[, outputs])``."""
    inner = unwrap(model) if unwrapped is None else unwrapped
    kwargs = dict(model_kwargs or {}, position_ids=position_ids)
    return _policy_loss_in_forward(model, inner, input_ids, None, None, rows, targets, mask,
                                   advantages, old_logp, ref_logp, config, return_outputs,
                                   kwargs, loss_kwargs)


def _policy_loss_in_forward(model, inner, input_ids, attention_mask, T, rows, targets, mask,
                            advantages, old_logp, ref_logp, config, return_outputs,
                            model_kwargs, loss_kwargs, old_policy=None):
    import dataclasses

    import gbc_kernels as gbc

    cfg = config if isinstance(config, gbc.PolicyLossConfig) else (
        gbc.PolicyLossConfig() if config is None else gbc.PolicyLossConfig.from_dict(config))
    cap = logit_softcap(inner)
    if cap is not None and cfg.logit_softcap is None:
        cfg = dataclasses.replace(cfg, logit_softcap=cap)

    def compute(h):
        head = lm_head(inner)         # the weight as the wrapper holds it right now
        h = rows(h).to(head.weight.dtype)          # h cast: autocast output, fp32 head
        if old_policy is not None:
            loss_kwargs["token_scale"] = old_policy(h.detach(), head, cap).token_scale
        names = (contextlib.nullcontext() if T is None     # packed: targets are the caller's
                 else targets_as_input_ids(input_ids, T, head, mask))
        with names:
            loss, metrics = gbc.fused_linear_policy_loss(
                h, head.weight, targets, mask, advantages, old_logp=old_logp,
                ref_logp=ref_logp, bias=head.bias, config=cfg, **loss_kwargs)
        return (loss, metrics), loss

    (loss, metrics), outputs = _through_head(model, inner, input_ids, attention_mask, T, compute,
                                             model_kwargs)
    loss = loss + (outputs.logits.float() * 0).sum()    # 0 to the value and every gradient
    return (loss, metrics, outputs) if return_outputs else (loss, metrics)


class PaddedPack(NamedTuple):
    """A padded batch ``[B, S]`` packed into one row as flash-attn's ``unpad_input`` packs it
    (the real tokens of the attention mask, in order), and where the hidden states that
    predict its last ``T`` tokens sit (:func:`pack_padded`)."""
    input_ids: torch.Tensor        # [1, n]
    position_ids: torch.Tensor     # [1, n]: each sequence's own positions
    index: torch.Tensor            # [B, T]: packed row of the token before column t (0 if none)
    valid: torch.Tensor            # [B, T]: that token is real
    rolled: torch.Tensor           # [B, T]: the packed token after it (the packed stream's
    #                                "next token", the following sequence's first at an end)

    def hidden(self, h):
        """The packed hidden states ``[1, n, H]`` -> the rows predicting the last ``T`` tokens,
        ``[B, T, H]`` (packed row 0 where :attr:`valid` is False)."""
        return h[0, self.index]


def pack_padded(input_ids, attention_mask, completion_len: int,
                mask: Optional[torch.Tensor] = None) -> PaddedPack:
    """Pack the padded ``input_ids [B, S]`` by ``attention_mask``; positions as
    ``attention_mask.cumsum(-1) - 1`` (the padded forward's). ``mask [B, T]``: the rows a loss
    takes; each must predict a real token from a real token (else, with gbc's value checks on,
    a ValueError naming ``mask``: the packed stream has no such row)."""
    import gbc_kernels as gbc

    B, S = input_ids.shape
    T = completion_len
    real = attention_mask.bool()
    flat = real.reshape(-1)
    pos = (attention_mask.long().cumsum(-1) - 1).reshape(-1)
    ids = input_ids.reshape(-1)[flat][None]
    at = flat.long().cumsum(0) - 1                  # packed row of each real padded position
    col = torch.arange(S - T - 1, S - 1, device=input_ids.device)
    grid = torch.arange(B, device=input_ids.device)[:, None] * S + col
    valid = flat[grid]
    index = torch.where(valid, at[grid], torch.zeros_like(grid))
    rolled = torch.roll(ids[0], -1)[index] if ids.shape[1] else torch.zeros_like(index)
    bad = None if mask is None or not gbc.value_checks_enabled() else \
        mask.bool() & ~(valid & real[:, -T:])
    if bad is not None and bool(bad.any()):
        b, t = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"mask: row [{b}, {t}] is set but its token or the one before it is "
                         f"padding (attention_mask 0); packed samples hold real tokens only")
    return PaddedPack(ids, pos[flat][None], index, valid, rolled)


@torch.no_grad()
def logprobs_through_forward(model, input_ids, attention_mask, completion_len: int,
                             temperature=1.0, return_entropy: bool = False, backend="auto",
                             unwrapped=None, model_kwargs: Optional[dict] = None,
                             logits_dtype=None):
    """No-grad log-probs (and entropies) of the last ``completion_len`` tokens inside ``model``'s
    forward, by the training loss's row passes (an on-policy ratio is exactly 1): ``(logp,
    entropy or None)``, ``[B, T]`` float32. ``logits_dtype``: the loss's (docs/kernels.md,
    "Precision")."""
    import gbc_kernels as gbc

    inner = unwrap(model) if unwrapped is None else unwrapped
    T = check_forward_inputs(inner, input_ids, attention_mask, completion_len)

    def compute(h, head, cap):
        with targets_as_input_ids(input_ids, T, head):
            return gbc.token_stats(h, head.weight, input_ids[:, -T:], head.bias,
                                   temperature=temperature, backend=backend, logit_softcap=cap,
                                   logits_dtype=logits_dtype)

    st = in_head(model, input_ids, attention_mask, T, model_kwargs, compute, inner)
    return st.logp, (st.entropy if return_entropy else None)


def targets_as_input_ids(input_ids, T, head, mask=None):
    """A context in which gbc's errors about the targets ``input_ids[:, -T:]`` (masked-in by
    ``mask [B, T]``) name ``input_ids``, at their index in ``input_ids`` (the lm_head's
    vocabulary may be smaller than the embedding's, which :func:`check_forward_inputs`
    checked). For a trainer's own pass through :func:`in_head` that scores the completion of a
    padded batch: ``with targets_as_input_ids(input_ids, T, head): gbc.token_stats(...)``."""
    def recheck():
        rows = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
        rows[:, -T:] = True if mask is None else (mask != 0)
        methods.check_ids("input_ids", input_ids, head.weight.shape[0], rows)

    return methods.in_callers_words({"targets": "input_ids"}, {"targets": recheck})


class OldPolicyPass(NamedTuple):
    old_logp: torch.Tensor                 # [B, T] float32
    token_scale: Optional[torch.Tensor]    # [B, T] NTHR scale (None when NTHR is off)
    nthr: object                           # gbc_kernels.NTHRResult or None


def logit_softcap(model):
    """The model's final-logit soft-capping constant ``c`` (Gemma-2/3's
    ``final_logit_softcapping``: logits = c tanh(x / c)), or None."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    c = getattr(cfg, "final_logit_softcapping", None)
    return None if c is None else float(c)


def in_head(model, input_ids, attention_mask, completion_len, model_kwargs, compute,
            unwrapped=None):
    """``compute(h [B, T, H], head, softcap)`` inside the model's forward, where ZeRO-3 and
    FSDP2 hold the lm_head's weight gathered (:func:`_through_head`); returns its result.
    ``completion_len=None``: every position's hidden states (packed samples, ``[1, n, H]``)."""
    inner = unwrap(model) if unwrapped is None else unwrapped
    T = None if completion_len is None else (completion_len or input_ids.shape[1] - 1)

    def run(h):
        head = lm_head(inner)
        return compute(h.to(head.weight.dtype), head, logit_softcap(inner)), None

    return _through_head(model, inner, input_ids, attention_mask, T, run, model_kwargs)[0]


@torch.no_grad()
def old_policy_pass(model, input_ids, attention_mask, targets, mask, group_ids=None,
                    correct=None, temperature=1.0, nthr=False, nthr_beta=1.0, nthr_eta="auto",
                    backend="auto", completion_len: int = 0,
                    old_logp=None, model_kwargs: Optional[dict] = None,
                    advantages=None, logits_dtype=None) -> OldPolicyPass:
    """The rollout policy's pass: ``old_logp`` of ``targets`` (the last ``completion_len`` tokens,
    or ``input_ids[:, 1:]``; the trainer's ``old_logp`` used as is) and, with ``nthr``, NTHR's
    token scales from the same hidden states; correct responses: ``correct`` [B], or the method
    layer's rule on ``advantages`` (docs/methods.md). ``model_kwargs``: more forward inputs
    (a vision-language model's images)."""
    if not nthr and old_logp is not None:          # nothing to compute: no forward
        return OldPolicyPass(old_logp, None, None)
    compute = old_policy_head(targets, mask, group_ids, correct, temperature, nthr, nthr_beta,
                              nthr_eta, backend, old_logp, advantages, logits_dtype)
    return in_head(model, input_ids, attention_mask, completion_len, model_kwargs, compute)


def old_policy_head(targets, mask, group_ids=None, correct=None, temperature=1.0, nthr=False,
                    nthr_beta=1.0, nthr_eta="auto", backend="auto", old_logp=None,
                    advantages=None, logits_dtype=None):
    """The head's part of :func:`old_policy_pass` (same arguments): ``compute(h, head, softcap)
    -> OldPolicyPass`` on the old policy's hidden states ``h [B, T, H]``, no grad. Run inside
    the pass's forward, or inside a forward that already runs on the old policy (the on-policy
    update's, :func:`policy_loss_through_forward`'s ``old_policy``). ``logits_dtype``: the
    loss's (docs/kernels.md, "Precision"), for the log-probs and NTHR's LSE alike."""
    import gbc_kernels as gbc

    if nthr:
        if correct is None and advantages is not None:
            correct = methods.correct_from_advantages(advantages, mask)
        if group_ids is None or correct is None:
            raise ValueError("group_ids, correct: required when nthr=True (correct: or "
                             "advantages)")

    @torch.no_grad()
    def compute(h, head, cap):
        logp = old_logp
        if logp is None:
            logp = gbc.token_stats(h, head.weight, targets, head.bias, temperature=temperature,
                                   backend=backend, logit_softcap=cap,
                                   logits_dtype=logits_dtype).logp
        with methods.in_callers_words({"beta": "nthr_beta", "eta": "nthr_eta",
                                       "logp": "old_logp"}):
            res = None if not nthr else gbc.nthr_scale(
                h, head.weight, targets, mask, group_ids, correct, bias=head.bias,
                temperature=temperature, beta=nthr_beta, eta=nthr_eta, backend=backend,
                logp=logp, logit_softcap=cap, logits_dtype=logits_dtype)
        return OldPolicyPass(logp, None if res is None else res.scale, res)

    return compute


@torch.no_grad()
def reference_pass(ref_model, input_ids, attention_mask, targets, temperature=1.0,
                   critical_kl_exponent=None, certainty="max_prob", certainty_temperature=1.0,
                   intercept=0.0, backend="auto", completion_len: int = 0,
                   model_kwargs: Optional[dict] = None, options=None, unwrapped=None,
                   logits_dtype=None):
    """The reference model's pass: ``ref_logp`` and, with ``critical_kl_exponent``, the
    critical-token KL weights, as :func:`gbc_kernels.methods.reference_stats` returns them;
    ``options``: a ``MethodOptions`` in place of the four critical-KL keywords (and
    ``logits_dtype``, the loss's: docs/kernels.md, "Precision")."""
    if options is not None and (critical_kl_exponent is not None or certainty != "max_prob"
                                or certainty_temperature != 1.0 or intercept != 0.0
                                or logits_dtype is not None):
        raise ValueError("options: give the MethodOptions or the critical-KL keywords "
                         "(critical_kl_exponent, certainty, ...), not both")
    with methods.in_callers_words({"critical_kl_intercept": "intercept",
                                   "critical_kl_certainty": "certainty",
                                   "critical_kl_temperature": "certainty_temperature"}):
        opts = options or methods.MethodOptions(critical_kl_exponent=critical_kl_exponent,
                                                critical_kl_intercept=intercept,
                                                critical_kl_certainty=certainty,
                                                critical_kl_temperature=certainty_temperature,
                                                logits_dtype=logits_dtype)
    return in_head(ref_model, input_ids, attention_mask, completion_len, model_kwargs,
                   lambda h, head, cap: methods.reference_stats(
                       h, head.weight, targets, opts, head.bias, temperature=temperature,
                       logit_softcap=cap, backend=backend), unwrapped)
