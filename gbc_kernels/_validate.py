"""Argument checks (docs/math.md, "Input rules").

Shape, dtype and device checks are free and always run. Value checks (target ids in range,
finite log-probs and advantages, 0/1 masks) read device values; they run unless the environment
sets ``GBC_VALIDATE=0``. Even then an out-of-range id never reaches a kernel: ids are clamped
into ``[0, V)`` (the result is garbage for that token, but no memory is touched out of bounds).

A fused loss gathers its value checks in a :class:`Checks` and resolves them with the one
device-to-host transfer it needs anyway (the masked-in row count), before any kernel reads the
inputs: validation adds no host sync. Only a failed check costs more (finding the first bad
index for the message).
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


_SWITCH = {"1": True, "true": True, "yes": True, "on": True,
           "0": False, "false": False, "no": False, "off": False}


def value_checks_enabled() -> bool:
    """``GBC_VALIDATE``: unset or 1/true/yes/on runs the value checks, 0/false/no/off skips them
    (any case); anything else raises rather than being read as either."""
    env = os.environ.get("GBC_VALIDATE")
    on = True if env is None else _SWITCH.get(env.strip().lower())
    if on is None:
        raise ValueError(f"GBC_VALIDATE: expected 1/true/yes/on or 0/false/no/off, got {env!r}")
    return on


class Checks:
    """Value checks of one call, resolved together by one device-to-host transfer.

    ``add(bad, fail)``: ``bad()`` returns a bool tensor (True where a value is wrong), ``fail()``
    raises the check's error. ``start(*counts)`` evaluates every check and queues the copy of
    their flags and of the given 0-d integer tensors to the host (on a GPU asynchronously, into
    pinned memory, so that the caller can queue its first matmul before the host waits).
    ``finish()`` of what ``start`` returns waits for that copy only (an event, not the stream),
    raises the first failed check's error and returns the counts as Python ints; the caller must
    not let a kernel read a checked input before it. ``resolve(*counts)`` is both at once."""

    def __init__(self):
        self._pending = []

    def add(self, bad, fail) -> None:
        self._pending.append((lambda: bad().any().reshape(1), [fail]))

    def add_many(self, flags, fails) -> None:
        """``flags()`` returns a bool vector, one flag per entry of ``fails``."""
        self._pending.append((flags, list(fails)))

    def start(self, *counts: torch.Tensor) -> "_PendingChecks":
        pending, self._pending = self._pending, []
        fails = [fail for _, group in pending for fail in group]
        if not counts and not pending:
            return _PendingChecks(None, None, [], 0)
        packed = self._pack(counts, pending)
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return _PendingChecks(host, event, fails, len(counts))
        return _PendingChecks(packed, None, fails, len(counts))

    @staticmethod
    def _pack(counts, pending) -> torch.Tensor:
        parts = [c.reshape(1).long() for c in counts]
        if pending:
            parts.append(torch.cat([flags().reshape(-1) for flags, _ in pending]).long())
        return torch.cat(parts)

    def resolve(self, *counts: torch.Tensor) -> list:
        return self.start(*counts).finish()


class _PendingChecks:
    def __init__(self, host, event, fails, n_counts):
        self.host, self.event, self.fails, self.n_counts = host, event, fails, n_counts

    def finish(self) -> list:
        if self.host is None:
            return []
        if self.event is not None:
            self.event.synchronize()        # the copy only, not the work queued after it
        values = self.host.tolist()         # the one host transfer
        for flag, fail in zip(values[self.n_counts:], self.fails):
            if flag:
                fail()
        return values[:self.n_counts]


def _defer_or_raise(checks: Optional[Checks], bad, fail) -> None:
    """Queue the check on ``checks``, or (None) check now (a host sync)."""
    if checks is not None:
        checks.add(bad, fail)
    elif bool(bad().any()):
        fail()


def _first(bad: torch.Tensor) -> tuple:
    return tuple(bad.nonzero()[0].tolist())


def _shape(t) -> str:
    return "x".join(str(s) for s in t.shape) if t.dim() else "scalar"


def check_tensor(name: str, t, shape: Optional[Sequence[int]] = None, floating: bool = False,
                 integer: bool = False, device: Optional[torch.device] = None, dims=None):
    """Raise TypeError/ValueError naming ``name``, the expected and the actual value."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with data (CPU or CUDA), got a tensor on the "
                         "meta device (materialise the model's parameters first)")
    if floating and t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating dtype (float16/bfloat16/float32/float64), "
                        f"got {t.dtype}")
    if integer and t.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8,
                                   torch.int8):
        raise TypeError(f"{name}: expected an integer dtype (int64 preferred), got {t.dtype}")
    if dims is not None and t.dim() not in dims:
        want = " or ".join(f"{d}-d" for d in dims)
        raise ValueError(f"{name}: expected a {want} tensor, got shape [{_shape(t)}]")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape [{'x'.join(map(str, shape))}], "
                         f"got [{_shape(t)}]")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of hidden), "
                         f"got {t.device}")


def check_targets(targets: torch.Tensor, vocab: int, mask: Optional[torch.Tensor] = None,
                  name: str = "targets", checks: Optional[Checks] = None) -> torch.Tensor:
    """Return int64 targets safe to hand to a kernel: masked-out ids become 0.

    A masked-in id outside ``[0, vocab)`` raises (validation on; at ``checks.resolve()`` when
    ``checks`` is given) or is clamped (validation off).
    """
    t = targets.long()
    if mask is not None:
        t = torch.where(mask, t, torch.zeros_like(t))
    if not value_checks_enabled():
        return t.clamp(0, vocab - 1)
    def bad():
        return (t < 0) | (t >= vocab)

    def fail():
        first = _first(bad())
        raise ValueError(f"{name}: expected token ids in [0, {vocab}) on masked-in "
                         f"positions, got {int(t[first])} at index {list(first)}")
    _defer_or_raise(checks, bad, fail)
    return t


def _check_values(name: str, t: Optional[torch.Tensor], mask: Optional[torch.Tensor],
                  is_bad, expected: str, checks: Optional[Checks] = None):
    """Raise naming the first masked-in value of ``t`` for which ``is_bad`` holds (now, or at
    ``checks.resolve()``; skipped under GBC_VALIDATE=0)."""
    if t is None or not value_checks_enabled():
        return
    def bad():
        b = is_bad(t)
        return b if mask is None else b & mask

    def fail():
        first = _first(bad())
        raise ValueError(f"{name}: expected {expected} on masked-in positions, got "
                         f"{float(t[first])} at index {list(first)}")
    _defer_or_raise(checks, bad, fail)


# log-probabilities a little above 0 come from rounding (p -> 1); beyond this they are not
# log-probabilities (probabilities, or logits, passed by mistake)
LOGP_SLACK = 1e-3

# value rules of the per-token inputs: (what the message says is expected, the test of a bad value)
_RULES = {
    "finite": ("finite values", lambda x: ~torch.isfinite(x)),
    # the sampler's log-probs: NaN marks a token it could not score (TRL's convention with vLLM;
    # the off-policy mask counts it as no drift), infinities are errors
    "finite_or_nan": ("finite values or NaN (a token the sampler could not score)",
                      lambda x: torch.isinf(x)),
    "logprob": ("log-probabilities (<= 0)", lambda x: x > LOGP_SLACK),
    "nonneg": ("importance weights >= 0", lambda x: x < 0),
    "temperature": ("finite temperatures > 0", lambda x: ~(torch.isfinite(x) & (x > 0))),
}


def check_many(entries, mask: torch.Tensor, checks: Optional[Checks]) -> None:
    """Value checks of several ``[B, T]`` tensors, ``entries`` = ``(name, tensor or None, rule)``
    with ``rule`` a key of ``_RULES``: one batched test per rule (a handful of kernels instead
    of four per check), each failure still named by the argument and the first bad index."""
    entries = [(n, t, r) for n, t, r in entries if t is not None]
    if not entries or not value_checks_enabled():
        return
    by_rule = {}
    for name, t, rule in entries:
        by_rule.setdefault(rule, []).append((name, t))

    def flags():
        out = []
        for rule, group in by_rule.items():
            stacked = torch.stack([t.float() for _, t in group])
            out.append((_RULES[rule][1](stacked) & mask).flatten(1).any(1))
        return torch.cat(out)

    fails = [(lambda n=name, t=t, r=rule: _check_values(n, t, mask, _RULES[r][1], _RULES[r][0]))
             for rule, group in by_rule.items() for name, t in group]
    if checks is None:
        checks = Checks()
        checks.add_many(flags, fails)
        checks.resolve()
    else:
        checks.add_many(flags, fails)


def check_finite(name: str, t: Optional[torch.Tensor], mask: Optional[torch.Tensor],
                 checks: Optional[Checks] = None):
    expected, is_bad = _RULES["finite"]
    _check_values(name, t, mask, is_bad, expected, checks)


def check_same_device(device: torch.device, **tensors):
    for name, t in tensors.items():
        if t is not None and isinstance(t, torch.Tensor) and t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the device of hidden), "
                             f"got {t.device}")


def check_lm_head(hidden, weight, bias):
    check_tensor("hidden", hidden, floating=True)
    check_tensor("weight", weight, floating=True, dims=(2,), device=hidden.device)
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"hidden: expected hidden size H = {weight.shape[1]} in its last "
                         f"dimension (the lm_head weight is [{weight.shape[0]} x "
                         f"{weight.shape[1]}]), got [{'x'.join(map(str, hidden.shape))}]")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: expected dtype {hidden.dtype} (the dtype of hidden), "
                        f"got {weight.dtype}")
    if weight.shape[0] < 1:
        raise ValueError("weight: expected at least one vocabulary row, got V = 0")
    if bias is not None:
        check_tensor("bias", bias, shape=(weight.shape[0],), device=hidden.device)
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias: expected dtype {hidden.dtype} (the dtype of hidden), "
                            f"got {bias.dtype}")


def check_temperature(name, t):
    if not (isinstance(t, (int, float)) and t > 0 and math.isfinite(t)):
        raise ValueError(f"{name}: expected a finite float > 0, got {t!r}")


def as_mask(mask, B, T, device, checks: Optional[Checks] = None):
    """The loss mask as bool: a bool tensor, or an integer/float tensor of 0s and 1s (any other
    value, NaN included, is an error: a mask is not a weight; scale advantages or use
    ``token_scale`` to weight tokens)."""
    check_tensor("mask", mask, shape=(B, T), device=device)
    if mask.dtype == torch.bool:
        return mask
    if value_checks_enabled():
        def bad():
            return (mask != 0) & (mask != 1)

        def fail():
            first = _first(bad())
            raise ValueError(f"mask: expected a boolean or 0/1 mask, got {mask[first].item()} "
                             f"at index {list(first)} (to weight tokens, use token_scale)")
        _defer_or_raise(checks, bad, fail)
    return mask != 0


def resolve_group(name: str, group):
    """``group`` as a process group for the collectives (None: the default group), or a
    ``ValueError`` naming ``name``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{name}: torch.distributed is not initialized "
                         "(call torch.distributed.init_process_group first)")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{name}: expected a torch.distributed ProcessGroup or None (the "
                         f"default group), got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError(f"{name}: this process is not a member of the group")
    return group


def no_double_backward():
    """The fused gradients are computed analytically, not as a differentiable graph: refuse
    ``create_graph=True`` (double backward) instead of returning a non-differentiable result."""
    if torch.is_grad_enabled():
        raise RuntimeError("gbc_kernels: double backward (create_graph=True) is not supported; "
                           "the fused losses and log-probs return first-order gradients only")


def check_logits_dtype(value, name: str = "logits_dtype"):
    """``logits_dtype`` as None, ``torch.float32`` or ``"input"``
    (:func:`gbc_kernels.config.check_logits_dtype`)."""
    from .config import check_logits_dtype as check

    return check(value, name)


def check_backend(backend: str, name: str = "backend"):
    from .config import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"{name}: expected one of {BACKENDS}, got {backend!r}")


@contextlib.contextmanager
def in_callers_words(names: dict, recheck: Optional[dict] = None):
    """Errors in the caller's words, for an adapter that passes its caller's arguments to gbc
    under gbc's names. gbc's messages start with the argument they name (``targets: expected
    ...``, ``vocab_parallel.group: ...``); a ``ValueError`` or ``TypeError`` raised in the block
    that names a key ``a`` of ``names`` (or its field ``a.f`` with no key of its own) is raised
    again, the same exception and traceback, naming ``names[a]`` (``names[a].f``).

    ``recheck[a]``: called on such a ``ValueError`` only (the good path costs nothing), when gbc
    saw a reordered or selected copy of the caller's tensor whose indices mean nothing to the
    caller: it repeats the value check on the caller's own tensor and raises that error
    instead (a name the caller shares with gbc maps to itself, to be rechecked)."""
    try:
        yield
    except (ValueError, TypeError) as e:
        if len(e.args) != 1 or not isinstance(e.args[0], str):
            raise
        head, colon, rest = e.args[0].partition(":")
        base, dot, field = head.partition(".")
        if not colon or (head not in names and base not in names):
            raise
        key = head if head in names else base
        if recheck is not None and key in recheck and isinstance(e, ValueError):
            try:
                recheck[key]()
            except (ValueError, TypeError) as own:
                raise own from None
        e.args = ((names[key] if key == head else f"{names[key]}.{field}") + colon + rest,)
        raise
