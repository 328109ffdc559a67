"""The four methods, once: AR, Lopti, NTHR and critical-token KL (docs/methods.md).

Every adapter — TRL, verl's engines, OpenRLHF, the example trainer — takes its method options as
one :class:`MethodOptions` and calls the functions here; none keeps a copy of any rule. The
rules (docs/math.md §2-§5, §13):

* **AR** multiplies the advantage by ``alpha p_old + 1 - alpha`` inside the loss
  (``PolicyLossConfig.ar_alpha``).
* **Lopti**: two optimizer steps per batch, low tokens (``p_old < eta``) first by default
  (``lopti_order``); the split and ``old_logp`` come from the rollout policy, taken once before
  the first update, and stay fixed for both (:func:`run_lopti`). A loss call with ``lopti_eta``
  and no ``phase`` is refused.
* **NTHR**: a response is *correct* when its sequence advantage is > 0 (token-level
  advantages: their masked mean) (:func:`correct_from_advantages`); the token scales come from
  the old policy's hidden states, where whole groups are together (:func:`nthr_token_scale`).
* **Critical-token KL**: the weights ``(1 - c) J^gamma + c`` come from the reference pass that
  gives ``ref_logp`` (:func:`reference_stats`), and weight the KL term (``kl_weight``); they
  need a KL term.
"""

from __future__ import annotations

import numbers

import dataclasses
import math
from typing import Callable, NamedTuple, Optional, Union

import torch

from . import _validate
from .nthr import NTHRResult, nthr_scale
from .ops import fused_linear_logprobs, token_stats
from .transforms import critical_kl_weight

LOPTI_ORDERS = {"low-first": ("low", "high"), "high-first": ("high", "low")}
SUPPORT_MODES = ("replay", "kept_mass")
SUPPORT_TIES = ("first", "all")
# support_set under support=replay: one kept set per rollout (built in the pass that first
# scores the rollout with the sampling weights, replayed as support_ids in every later pass) or
# one rebuilt by each pass from the model it scores
SUPPORT_SETS = ("rollout", "per_pass")
CERTAINTIES = ("max_prob", "entropy")


def finite_number(name, value, lo=None, hi=None, lo_open=False, kind="a float") -> float:
    """``value`` if it is a finite real number in the range, else a ValueError naming ``name``
    (the option the user set), the range and ``value``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite float, got {value!r}")
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        rng = ""
        if lo is not None:
            rng = f" {'>' if lo_open else '>='} {lo}" + ("" if hi is None else f" and <= {hi}")
        raise ValueError(f"{name}: expected {kind}{rng}, got {value!r}")
    return value


def in_trainer_words(error: Exception, names: dict) -> Exception:
    """A config error ``"field[, field]: reason"`` led by the trainer's options: ``names`` maps a
    gbc field to the option (or a list of options) the user set, e.g. ``{"epsilon_low":
    "clip_ratio_low=-0.1"}``. ``error`` itself when none of its fields has another name."""
    msg = str(error)
    fields = [f for f in (f.strip() for f in msg.split(":", 1)[0].split(","))
              if names.get(f, f) != f]
    said = [n for f in fields for n in ([names[f]] if isinstance(names[f], str) else names[f])]
    if not said:
        return error
    return ValueError(f"{', '.join(dict.fromkeys(said))}: refused as gbc's {', '.join(fields)} "
                      f"({msg})")


# An adapter's argument errors in its caller's words (the adapters import no private module):
# in_callers_words renames gbc's argument in a raised error; check_ids / check_temperatures
# repeat a failed value check on the caller's own tensor, for its recheck.
in_callers_words = _validate.in_callers_words


def check_ids(name: str, ids: torch.Tensor, vocab: int, mask=None) -> None:
    """A ValueError naming ``name`` and the first id outside ``[0, vocab)`` where ``mask``
    (bool, ``ids``' shape; None: everywhere) is set (skipped under ``GBC_VALIDATE=0``)."""
    _validate.check_targets(ids, vocab, mask, name=name)


def check_temperatures(name: str, temperature: torch.Tensor, mask: torch.Tensor) -> None:
    """A ValueError naming ``name`` and the first temperature that is not finite and > 0 where
    ``mask`` (bool, its shape) is set (skipped under ``GBC_VALIDATE=0``)."""
    _validate.check_many([(name, temperature, "temperature")], mask, None)


@dataclasses.dataclass(frozen=True)
class MethodOptions:
    """The method options of every adapter (verl's engine option names).

    ar_alpha: AR's alpha in [0, 1] (0: off).
    lopti_eta: Lopti's threshold in (0, 1] (None: off); lopti_order: ``"low-first"`` (the
        paper's) or ``"high-first"`` (its failing ablation).
    nthr: NTHR on; nthr_beta: the anchor's factor (finite); nthr_eta: ``"auto"`` (2|0.5 - p|) or
        a float >= 0.
    critical_kl_exponent: gamma > 0 (None: off); critical_kl_intercept: c in [0, 1];
        critical_kl_certainty: ``"max_prob"`` (the official code's J) or ``"entropy"``;
        critical_kl_temperature: the reference's temperature for J, > 0.
    logits_dtype: ``torch.float32`` (``"float32"`` in the trainers' option strings): the
        float32 head's logits from bf16 operands (docs/kernels.md, "Precision"); ``"input"``:
        each chunk's logits in the head's dtype; None (the default): per device, float32 on a
        CPU and the head's dtype on a GPU. The same mode in the loss and in every pass an
        adapter runs for it (old policy, reference, NTHR), so that the ratio of an unchanged
        policy is exactly 1.
    support: None (off), ``"replay"`` or ``"kept_mass"``: the sampler's kept set rebuilt from
        the trainer's sampling settings (:func:`sampler_truncation`; docs/math.md, "The
        sampler's kept set, recomputed"). ``replay``: the policy, old and reference log-probs
        over it; ``kept_mass``: the policy stays full-vocabulary and the trainer's sampler ratio
        uses the sampler's log-probs moved by ``log_kept_mass``
        (:func:`corrected_sampler_logp`).
    support_ties: None (the trainer's default rule), ``"first"`` or ``"all"``: the top-k tie
        rule of :class:`gbc_kernels.SamplerTruncation`.
    support_set: under ``support="replay"``, which set each pass scores (docs/math.md, "One
        kept set per rollout"): None or ``"rollout"`` (the default): one set per rollout,
        built (``return_support_ids``) by the pass that first scores the rollout with the
        sampling weights and replayed as ``support_ids`` by every later pass (reference,
        update, Lopti's second phase, further PPO epochs); ``"per_pass"``: each pass rebuilds
        the set from the model it scores. Refused with ``support`` off or ``"kept_mass"``
        (whose later passes score the whole vocabulary: there is no set to keep).
    """

    ar_alpha: float = 0.0
    lopti_eta: Optional[float] = None
    lopti_order: str = "low-first"
    nthr: bool = False
    nthr_beta: float = 1.0
    nthr_eta: Union[str, float] = "auto"
    critical_kl_exponent: Optional[float] = None
    critical_kl_intercept: float = 0.0
    critical_kl_certainty: str = "max_prob"
    critical_kl_temperature: float = 1.0
    logits_dtype: Optional[torch.dtype] = None
    support: Optional[str] = None
    support_ties: Optional[str] = None
    support_set: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "logits_dtype", _validate.check_logits_dtype(self.logits_dtype))
        for name, allowed in (("support", SUPPORT_MODES), ("support_ties", SUPPORT_TIES),
                              ("support_set", SUPPORT_SETS)):
            v = getattr(self, name)
            if isinstance(v, str) and v.strip().lower() in ("", "none", "off"):
                object.__setattr__(self, name, None)
            elif v is not None and v not in allowed:
                raise ValueError(f"{name}: expected one of {allowed} or None (off), got {v!r}")
        if self.support_set is not None and self.support != "replay":
            raise ValueError(f"support_set: {self.support_set!r} chooses which kept set the "
                             f"passes of support=replay score; support is {self.support!r} "
                             + ("(kept_mass's later passes score the whole vocabulary: there "
                                "is no set to keep)" if self.support == "kept_mass" else
                                "(off)") + "; set support=replay or unset support_set")
        finite_number("ar_alpha", self.ar_alpha, 0.0, 1.0)
        if self.lopti_eta is not None:
            finite_number("lopti_eta", self.lopti_eta, 0.0, 1.0, lo_open=True)
        if self.lopti_order not in LOPTI_ORDERS:
            raise ValueError(f"lopti_order: expected one of {tuple(LOPTI_ORDERS)}, got "
                             f"{self.lopti_order!r}")
        if not isinstance(self.nthr, bool):
            raise ValueError(f"nthr: expected True or False, got {self.nthr!r}")
        finite_number("nthr_beta", self.nthr_beta)
        if self.nthr_eta != "auto":
            finite_number("nthr_eta", self.nthr_eta, 0.0, kind="'auto' or a float")
        if self.critical_kl_exponent is not None:
            finite_number("critical_kl_exponent", self.critical_kl_exponent, 0.0, lo_open=True)
        finite_number("critical_kl_intercept", self.critical_kl_intercept, 0.0, 1.0)
        if self.critical_kl_certainty not in CERTAINTIES:
            raise ValueError(f"critical_kl_certainty: expected one of {CERTAINTIES}, got "
                             f"{self.critical_kl_certainty!r}")
        finite_number("critical_kl_temperature", self.critical_kl_temperature, 0.0, lo_open=True)

    @classmethod
    def from_kwargs(cls, names: Optional[dict] = None, support_ok: bool = False,
                    **kw) -> "MethodOptions":
        """Options from a trainer's spelling: ``names`` maps this class's field to the
        trainer's option name (e.g. ``{"ar_alpha": "gbc_ar_alpha"}``), so that an error names
        the option the user set. Unknown keys are refused. ``support_ok``: the adapter runs
        ``support`` / ``support_ties`` (else they are refused by name when set)."""
        names = names or {}
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kw) - fields)
        if unknown:
            raise ValueError(f"{names.get(unknown[0], unknown[0])}: not a method option "
                             f"(expected one of {sorted(names.get(f, f) for f in fields)})")
        try:
            opts = cls(**kw)
        except ValueError as exc:
            raise in_trainer_words(exc, names) from None
        if not support_ok:
            opts.refuse_support(lambda f: names.get(f, f))
        return opts

    @property
    def one_set_per_rollout(self) -> bool:
        """``support="replay"`` with one kept set per rollout (``support_set`` None or
        ``"rollout"``): the building pass returns the ids, every later pass replays them."""
        return self.support == "replay" and self.support_set in (None, "rollout")

    def refuse_support(self, name_of) -> None:
        """Refuse ``support`` / ``support_ties`` / ``support_set`` (an adapter that does not rebuild the
        sampler's kept set); ``name_of(field)``: the trainer's name of the option."""
        for f in ("support", "support_ties", "support_set"):
            if getattr(self, f) is not None:
                raise ValueError(f"{name_of(f)}={getattr(self, f)}: not run by this gbc "
                                 f"adapter (the sampler's kept set is rebuilt inside TRL's, "
                                 f"verl's, OpenRLHF's and AReaL's; docs/methods.md, \"The "
                                 f"sampler's kept set\"); unset it")

    @classmethod
    def parse(cls, text: Optional[str], source: str, support_ok: bool = False,
              **kw) -> "MethodOptions":
        """``"ar_alpha=0.3,nthr=true"`` (the form a Ray environment variable ``source``
        carries) -> options, each value typed by its field (:data:`OPTION_KINDS`); an unknown,
        repeated, malformed or ill-typed option is refused naming ``source`` and the option.
        ``kw``: fields set beside the text; ``support_ok``: as in :meth:`from_kwargs`."""
        fields = {f.name for f in dataclasses.fields(cls)}
        for name, value in parse_items(text, source).items():
            if name not in fields:
                raise ValueError(f"{source}: unknown option {name!r} (expected one of "
                                 f"{sorted(fields)})")
            kind, what = OPTION_KINDS.get(name, (str, "a string"))
            try:
                kw[name] = kind(value)
            except ValueError:
                raise ValueError(f"{source}: {name} expects {what}, got {value!r}") from None
        try:
            opts = cls(**kw)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        if not support_ok:
            opts.refuse_support(lambda f: f"{source}: {f}")
        return opts

    @property
    def phases(self) -> tuple:
        """The loss phases of one batch: ``("low", "high")`` (or reversed) under Lopti, else
        ``(None,)``."""
        return LOPTI_ORDERS[self.lopti_order] if self.lopti_eta is not None else (None,)

    @property
    def needs_old_pass(self) -> bool:
        """Whether the old policy's log-probs must be fixed before the first update even
        on-policy (Lopti's split and its second phase's ratio; NTHR's scales)."""
        return self.lopti_eta is not None or self.nthr

    def loss_options(self) -> dict:
        """The :class:`PolicyLossConfig` fields these options set."""
        return {"ar_alpha": self.ar_alpha, "lopti_eta": self.lopti_eta,
                "logits_dtype": self.logits_dtype}

    def check_loss(self, kl_coef: float, kl_option: str = "kl_coef",
                   names: Optional[dict] = None) -> None:
        """Refuse a combination the loss cannot honour: critical-token KL without a KL term
        (``kl_coef``: the loss's KL coefficient, ``kl_option`` the trainer's name for it,
        ``names`` its method options as in :meth:`from_kwargs`)."""
        if self.critical_kl_exponent is not None and not kl_coef:
            name = (names or {}).get("critical_kl_exponent", "critical_kl_exponent")
            raise ValueError(f"{name}: the loss has no KL term to weight (set {kl_option} != 0)")


def loss_advantages(advantages: torch.Tensor, old_logp: torch.Tensor, options: MethodOptions,
                    phase: Optional[str] = None) -> torch.Tensor:
    """The advantages the loss acts on under ``options`` (docs/math.md §2-§3): times AR's
    weight ``alpha p_old + 1 - alpha``, and under a Lopti ``phase`` zero outside its tokens
    (low: ``p_old < lopti_eta``). For a trainer that logs its own loss through its own function
    (``[B, T]`` advantages and ``old_logp``)."""
    p_old = torch.exp(old_logp)
    a = advantages
    if options.ar_alpha:
        a = a * (options.ar_alpha * p_old + (1.0 - options.ar_alpha)).to(a.dtype)
    if phase is not None:
        low = p_old < options.lopti_eta
        a = torch.where(low if phase == "low" else ~low, a, torch.zeros_like(a))
    return a


def _flag(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes"):
        return True
    if t in ("0", "false", "no"):
        return False
    raise ValueError(text)


def _logits_dtype(text: str):
    return _validate.check_logits_dtype(text)


def _auto_or_float(text: str):
    return "auto" if text.strip().lower() == "auto" else float(text)


# how :meth:`MethodOptions.parse` types a field's text (strings otherwise): (parser, name)
OPTION_KINDS = {
    **{n: (float, "a float") for n in ("ar_alpha", "lopti_eta", "nthr_beta",
                                       "critical_kl_exponent", "critical_kl_intercept",
                                       "critical_kl_temperature")},
    "nthr": (_flag, "a 1/0/true/false"), "nthr_eta": (_auto_or_float, "'auto' or a float"),
    "logits_dtype": (_logits_dtype, "'float32', 'input' or 'none'")}


def parse_items(text: Optional[str], source: str) -> dict:
    """``"ar_alpha=0.3, lopti_eta=0.5"`` (the form a Ray environment variable carries) ->
    ``{name: raw value string}``; a malformed item or a repeated name is refused, the error
    starting with ``source`` (the variable's name). Each adapter types the values."""
    out = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, eq, value = (x.strip() for x in item.partition("="))
        if not eq or not name:
            raise ValueError(f"{source}: expected name=value items separated by ',', got "
                             f"{item!r}")
        if name in out:
            raise ValueError(f"{source}: {name} given twice ({name}={out[name]} and "
                             f"{name}={value}); give it once")
        out[name] = value
    return out


# ------------------------------------------------------------ the sampler's kept set (§16)
def sampler_truncation(options: MethodOptions, top_k=None, top_p=1.0, min_p=0.0, *,
                       rule: str = "vllm", ties: str = "first", names: Optional[dict] = None):
    """The :class:`gbc_kernels.SamplerTruncation` of a trainer's sampling settings when
    ``options.support`` is on (None when it is off). ``top_k``: None, or an int where ``<= 0``
    is the engines' "no bound" (vLLM's -1 and 0); ``top_p`` None: 1; ``min_p`` None: 0.
    ``rule``: the trainer's sampler (``"vllm"`` / ``"sglang"``); ``ties``: the trainer's default
    top-k tie rule (``options.support_ties`` overrides it). Settings that truncate nothing are
    refused naming the support option (``names`` maps ``"support"`` to the trainer's
    spelling): the sampler kept the whole vocabulary, there is nothing to correct. A setting
    of the wrong type (``top_k`` not an int: ``5.7``, ``True``, ``"all"``; ``top_p`` /
    ``min_p`` not a number) or out of range is refused naming the field (``names`` maps
    ``"top_k"`` / ``"top_p"`` / ``"min_p"`` to the trainer's spelling), never rounded."""
    from .truncation import SamplerTruncation

    if options.support is None:
        return None
    names = names or {}
    name = names.get("support", "support")

    def refuse(field, value, expected):
        raise ValueError(f"{name}={options.support}: {names.get(field, field)}: expected "
                         f"{expected}, got {type(value).__name__} {value!r}")

    def real(field, value, default):
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            refuse(field, value, "a number")
        return float(value)

    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral)):
        refuse("top_k", top_k, "None or an int (<= 0: no bound)")
    k = None if top_k is None or int(top_k) <= 0 else int(top_k)
    p = real("top_p", top_p, 1.0)
    mp = real("min_p", min_p, 0.0)
    if k is None and p == 1.0 and mp == 0.0:
        raise ValueError(f"{name}={options.support}: the rollout samples without truncation "
                         f"(top_k {top_k!r}, top_p {top_p!r}, min_p {min_p!r}): the sampler "
                         f"kept the whole vocabulary and there is nothing to correct; unset "
                         f"{name} or sample with top_k / top_p / min_p")
    try:
        return SamplerTruncation(top_k=k, top_p=p, min_p=mp,
                                 ties=options.support_ties or ties, rule=rule)
    except ValueError as exc:
        text = str(exc)
        for field in ("top_k", "top_p", "min_p"):
            if text.startswith(f"{field}:"):
                text = names.get(field, field) + text[len(field):]
        raise ValueError(f"{name}={options.support}: {text}") from None


def join_support_ids(parts, dim: int = 0) -> torch.Tensor:
    """Kept ids of several micro-batches (``-1``-padded ``[..., K_i]`` integer tensors, as
    ``return_support_ids`` gives them) as one tensor: each padded with ``-1`` to the widest
    ``K`` and concatenated along ``dim`` (the other dimensions must agree). The form a
    trainer's batch carries between passes: one kept set per rollout (docs/math.md)."""
    parts = list(parts)
    if not parts:
        raise ValueError("join_support_ids: parts: expected at least one tensor")
    for i, p in enumerate(parts):
        if not isinstance(p, torch.Tensor) or p.dtype not in (torch.int32, torch.int64) \
                or p.dim() < 2:
            raise TypeError(f"join_support_ids: parts[{i}]: expected an int32/int64 tensor "
                            f"[..., K] of kept ids, got "
                            f"{getattr(p, 'dtype', type(p).__name__)} "
                            f"{list(getattr(p, 'shape', []))}")
    if dim < 0:
        dim += parts[0].dim()
    if not 0 <= dim < parts[0].dim() - 1:
        raise ValueError(f"join_support_ids: dim: expected a dimension before the ids' last "
                         f"one, got {dim}")
    K = max(p.shape[-1] for p in parts)
    padded = [torch.nn.functional.pad(p.to(torch.int32), (0, K - p.shape[-1]), value=-1)
              for p in parts]
    return torch.cat(padded, dim=dim)


def compact_support_ids(ids: torch.Tensor) -> torch.Tensor:
    """Kept ids ``[B, T, K]`` (``-1`` padded, as ``return_support_ids`` gives them) in the
    compact form a trainer's batch carries between passes: one int32 tensor ``[B, 1 + T + M]``
    whose first column is ``T`` (the form describes itself), the next ``T`` columns each token's
    number of ids, and the rest each sequence's ids in token order, ``-1`` padded to the longest
    sequence's total ``M``. Split or gathered along ``B`` it stays valid (every row holds its
    own sequence), so a trainer's shuffle and micro-batching carry it as they carry ``[B, T]``
    tensors. Costs ``4·(1 + (1 + M)/T)`` bytes a token against ``4·K`` padded: the widest set no
    longer sets every token's width (docs/math.md, "One kept set per rollout").
    :func:`expand_support_ids` inverts it."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64) \
            or ids.dim() != 3:
        raise TypeError(f"compact_support_ids: ids: expected an int32/int64 tensor [B, T, K] "
                        f"of kept ids, got {getattr(ids, 'dtype', type(ids).__name__)} "
                        f"{list(getattr(ids, 'shape', []))}")
    B, T, K = ids.shape
    keep = ids >= 0
    counts = keep.sum(-1, dtype=torch.int32)                                   # [B, T]
    total = counts.sum(-1)                                                     # [B]
    M = int(total.max()) if B else 0
    flat = torch.full((B, M), -1, dtype=torch.int32, device=ids.device)
    if M:
        # each kept id's slot in its sequence: its token's offset plus its rank among the
        # token's kept ids (the ids keep their order)
        start = torch.cumsum(counts, -1) - counts                              # [B, T]
        rank = torch.cumsum(keep.to(torch.int32), -1) - 1                      # [B, T, K]
        slot = (start.unsqueeze(-1) + rank)[keep].long()
        row = torch.arange(B, device=ids.device).view(B, 1, 1).expand(B, T, K)[keep]
        flat[row, slot] = ids[keep].to(torch.int32)
    head = torch.full((B, 1), T, dtype=torch.int32, device=ids.device)
    return torch.cat([head, counts, flat], dim=1)


def expand_support_ids(compact: torch.Tensor, T: Optional[int] = None) -> torch.Tensor:
    """The compact form of :func:`compact_support_ids` (``[B, 1 + T + M]``) back to
    ``-1``-padded ids ``[B, T, K]`` int32, ``K`` the widest set among these rows (at least 1),
    ready for ``support_ids``. ``T``: None (the form's own), or the tokens the caller expects
    (refused when the form says otherwise). Refuses counts that do not fit the row."""
    if not isinstance(compact, torch.Tensor) or compact.dtype not in (torch.int32, torch.int64) \
            or compact.dim() != 2 or compact.shape[1] < 1:
        raise TypeError(f"expand_support_ids: compact: expected an int32/int64 tensor "
                        f"[B, 1 + T + M] (compact_support_ids' form), got "
                        f"{getattr(compact, 'dtype', type(compact).__name__)} "
                        f"{list(getattr(compact, 'shape', []))}")
    B = compact.shape[0]
    heads = compact[:, 0].unique().tolist() if B else [T or 0]
    own = heads[0]
    if len(heads) != 1 or not 0 <= own <= compact.shape[1] - 1:
        raise ValueError(f"expand_support_ids: compact: its first column must hold T, the "
                         f"same in every row and at most {compact.shape[1] - 1}, got {heads[:4]} "
                         f"(not compact_support_ids' form)")
    if T is not None and (isinstance(T, bool) or T != own):
        raise ValueError(f"expand_support_ids: T: expected the {own} tokens the compact form "
                         f"holds (or None), got {T!r}")
    T = own
    M = compact.shape[1] - 1 - T
    counts, flat = compact[:, 1:1 + T].long(), compact[:, 1 + T:]
    if B and T and (counts.min() < 0 or (counts.sum(-1) > M).any()):
        raise ValueError(f"expand_support_ids: compact: a row's counts are negative or exceed "
                         f"its {M} id slots (not compact_support_ids' form)")
    K = max(int(counts.max()) if B and T else 0, 1)
    out = torch.full((B, T, K), -1, dtype=torch.int32, device=compact.device)
    if B and T and M:
        start = torch.cumsum(counts, -1) - counts                              # [B, T]
        j = torch.arange(K, device=compact.device)
        take = j < counts.unsqueeze(-1)                                        # [B, T, K]
        slot = (start.unsqueeze(-1) + j).clamp(max=M - 1)
        got = torch.gather(flat, 1, slot.view(B, -1)).view(B, T, K)
        out = torch.where(take, got.to(torch.int32), out)
    return out


def corrected_sampler_logp(sampling_logp: torch.Tensor, log_kept_mass: torch.Tensor,
                           mode: Optional[str], normalised: bool = True) -> torch.Tensor:
    """The rollout engine's log-probs as the sampler ratio of ``mode`` needs them (docs/math.md,
    "The sampler's kept set, recomputed"). ``normalised``: the engine's log-probs are
    normalised over the kept set (vLLM's ``processed_logprobs``) or not (SGLang: the full
    vocabulary's). ``kept_mass`` with normalised log-probs: ``logp + log_kept_mass`` (the full
    vocabulary's, as the policy's); ``replay`` with full-vocabulary ones: ``logp -
    log_kept_mass`` (over the kept set, as the policy's); otherwise unchanged. ``kept_mass``
    with full-vocabulary log-probs has nothing to correct and is refused. ``log_kept_mass``
    must have ``sampling_logp``'s shape and device; ``normalised`` must be a real bool."""
    if not isinstance(normalised, bool):
        raise TypeError(f"normalised: expected a bool (the engine's log-probs are normalised "
                        f"over the kept set), got {type(normalised).__name__} {normalised!r}")
    if mode is None:
        return sampling_logp
    if mode not in SUPPORT_MODES:
        raise ValueError(f"support: expected one of {SUPPORT_MODES} or None, got {mode!r}")
    if mode == "kept_mass" and not normalised:
        raise ValueError("support=kept_mass: the rollout engine's log-probs are the full "
                         "vocabulary's already (not normalised over the kept set): the ratio "
                         "has no kept-mass bias to correct; use support=replay or unset it")
    if not isinstance(sampling_logp, torch.Tensor) or not sampling_logp.dtype.is_floating_point:
        raise TypeError(f"sampling_logp: expected a floating-point tensor, got "
                        f"{getattr(sampling_logp, 'dtype', type(sampling_logp).__name__)}")
    if not isinstance(log_kept_mass, torch.Tensor):
        raise TypeError(f"log_kept_mass: expected a tensor of sampling_logp's shape "
                        f"{list(sampling_logp.shape)}, got {type(log_kept_mass).__name__}")
    if log_kept_mass.shape != sampling_logp.shape:
        raise ValueError(f"log_kept_mass: expected sampling_logp's shape "
                         f"{list(sampling_logp.shape)}, got {list(log_kept_mass.shape)}")
    if log_kept_mass.device != sampling_logp.device:
        raise ValueError(f"log_kept_mass: expected a tensor on sampling_logp's device "
                         f"{sampling_logp.device}, got {log_kept_mass.device}")
    lk = log_kept_mass.to(sampling_logp.dtype)
    if mode == "kept_mass":
        return sampling_logp + lk
    return sampling_logp if normalised else sampling_logp - lk


# ------------------------------------------------------------------------------------ NTHR
def correct_from_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """NTHR's *correct* responses (§13): sequence advantage > 0; ``[B, T]`` token-level
    advantages: their mean over the masked tokens > 0 (an empty response: not correct)."""
    if advantages.dim() == 1:
        return advantages > 0
    m = mask.to(advantages.dtype)
    return (advantages * m).sum(-1) > 0


def nthr_token_scale(hidden, weight, targets, mask, group_ids, advantages,
                     options: MethodOptions, bias=None, temperature=1.0, logp=None,
                     logit_softcap=None, backend="auto", **parallel) -> NTHRResult:
    """NTHR's token scales (docs/math.md §4) from the old policy's hidden states, with the
    correct responses taken from the advantages. ``parallel``: ``vocab_parallel=`` /
    ``data_parallel_group=`` of :func:`gbc_kernels.nthr_scale`."""
    return nthr_scale(hidden, weight, targets, mask, group_ids,
                      correct_from_advantages(advantages, mask), bias=bias,
                      temperature=temperature, beta=options.nthr_beta, eta=options.nthr_eta,
                      backend=backend, logp=logp, logit_softcap=logit_softcap,
                      logits_dtype=options.logits_dtype, **parallel)


def nthr_metrics(result: NTHRResult, advantages, mask) -> dict:
    """``nthr_selected_frac``: the share of the incorrect responses' masked tokens that NTHR
    selected; ``nthr_eta_mean``: the mean scale over the selected tokens (1 when none)."""
    return result.metrics(correct_from_advantages(advantages, mask), mask)


def data_parallel_group(group=None):
    """The data-parallel group for :func:`union_ids` / ``nthr_scale``: ``group`` (None: the
    default group, ``"world"``) under torch.distributed, None in a single process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return "world" if group is None else group


def every_rank(flag: bool, group) -> bool:
    """``flag`` on every rank of ``group`` (:func:`data_parallel_group`'s form): the ranks take
    the same branch, as a collective inside it needs."""
    if group is None:
        return bool(flag)
    import torch.distributed as dist

    pg = None if group == "world" else group
    every = [None] * dist.get_world_size(pg)
    dist.all_gather_object(every, bool(flag), group=pg)
    return all(every)


def union_ids(ids: torch.Tensor, group=None) -> torch.Tensor:
    """The sorted distinct token ids of ``ids`` over the ranks of ``group`` (``"world"``: the
    default group; None: this process only) — a superset of every NTHR group's ``V*``."""
    ids = torch.unique(ids.detach().reshape(-1).cpu())
    if group is not None:
        import torch.distributed as dist

        pg = None if group == "world" else group
        every = [None] * dist.get_world_size(pg)
        dist.all_gather_object(every, ids.tolist(), group=pg)
        ids = torch.tensor(sorted(set().union(*every)), dtype=torch.long)
    return ids.long()


class NTHRBatch:
    """NTHR's inputs gathered over the micro-batches of a no-grad old-policy pass, where the
    lm_head's weight exists only during each forward (FSDP, ZeRO-3): each micro-batch's hidden
    states and log-probs, and once the head's rows of the batch's token ids ``token_ids`` over
    the ranks of ``group`` (:func:`union_ids`, a superset of every group's ``V*``);
    :meth:`result` then scores the whole batch, its groups together."""

    def __init__(self, token_ids: torch.Tensor, group=None, backend: str = "auto",
                 logits_dtype=None):
        self.ids, self.group, self.backend = union_ids(token_ids, group), group, backend
        self.logits_dtype = _validate.check_logits_dtype(logits_dtype)
        self.rows, self.head, self.temperatures = [], None, set()
        self.tokens = []            # (row, columns, hidden, targets, logp) of add_tokens

    def add_kept(self, kept: "list[NTHRKeptRow]", targets, heads: "NTHRHeadRows",
                 device=None):
        """What an old-policy pass kept (:class:`NTHRKeptRow`, one per row of the batch, in
        order; ``targets``: each row's target ids ``[t]``), in place of :meth:`add`; the
        head's rows of the batch's ids come from ``heads`` over the ranks of the group (a
        collective). No forward."""
        device = torch.device("cpu") if device is None else torch.device(device)
        self.head = heads.assemble(self.ids, self.group, device)
        self.temperatures.update(heads.temperatures)
        for i, (k, y) in enumerate(zip(kept, targets)):
            cols = k.cols.to(device=device, dtype=torch.long)
            self.tokens.append((i, cols, k.hidden.to(device), y.to(device)[cols],
                                k.logp.to(device)))

    def add(self, index, hidden, targets, valid, head, logit_softcap=None, temperature=1.0,
            vocab_parallel=None, logp=None, support_ids=None):
        """One micro-batch, inside its forward: rows ``index`` of the batch, ``hidden [b, t, H]``
        (``t`` up to the batch's T), ``targets`` and ``valid`` ``[b, t]``, ``head`` (``weight``,
        ``bias``) as the forward holds it; ``temperature``: a float or per-sample ``[b]``.
        ``vocab_parallel``: ``head`` is this rank's slice (a :class:`gbc_kernels.VocabParallel`;
        every rank of its group adds the same micro-batches): the rows of ``token_ids`` are
        assembled from every slice. ``logp``: the micro-batch's log-probs ``[b, t]`` when the
        forward already computed them with these arguments (the trainer's old-policy pass),
        else computed here. ``support_ids`` ``[b, t, k]`` (the sampler's support, replayed:
        ``logp`` then over it): kept beside the rows, and :meth:`result` scores NTHR over each
        token's support (every micro-batch of the batch must carry one). Returns the
        micro-batch's log-probs ``[b, t]``."""
        weight = head.weight.detach()
        bias = None if head.bias is None else head.bias.detach()
        if self.head is None:
            ids = self.ids.to(weight.device)
            if vocab_parallel is None:
                rows = (weight.index_select(0, ids),
                        None if bias is None else bias.index_select(0, ids))
            else:
                from . import vocab_parallel as vp
                rows = vp.gather_rows(ids, weight, bias,
                                      vp.check(vocab_parallel, weight, bias, weight.device))
            self.head = (*rows, logit_softcap)
        temps = temperature.unique().tolist() if isinstance(temperature, torch.Tensor) \
            else [temperature]
        self.temperatures.update(float(t) for t in temps)
        if logp is None:
            logp = fused_linear_logprobs(hidden, weight, targets, bias, temperature,
                                         backend=self.backend, logit_softcap=logit_softcap,
                                         vocab_parallel=vocab_parallel,
                                         logits_dtype=self.logits_dtype,
                                         support_ids=support_ids)[0]
        index = torch.as_tensor(index, dtype=torch.long, device=hidden.device)
        # a view would keep the forward's whole hidden states (prompt rows included) alive
        h = hidden.detach()
        row = (index, h.clone() if h._base is not None else h, targets, valid, logp.float())
        if support_ids is not None:
            row += (support_ids.detach().to(device=h.device, dtype=torch.int32),)
        self.rows.append(row)
        return logp

    def take(self, source_rows: torch.Tensor) -> bool:
        """Renumber the rows to another batch's: its row ``u`` is this batch's row
        ``source_rows[u]`` (a row may feed several, e.g. equal samples). False, and nothing
        changed, when a row of the other batch has no source here."""
        source_rows = torch.as_tensor(source_rows, dtype=torch.long).cpu()
        found = torch.zeros(source_rows.numel(), dtype=torch.bool)
        taken = []
        for index, *held in self.rows:
            j, u = (index.cpu()[:, None] == source_rows[None, :]).nonzero(as_tuple=True)
            found[u] = True
            if u.numel():
                jj = j.to(held[0].device)
                taken.append((u.to(held[0].device), *(t[jj] for t in held)))
        if not bool(found.all()):
            return False
        self.rows = taken
        return True

    def to(self, device) -> "NTHRBatch":
        """Everything held (the rows and the head's rows) moved to ``device``, in place."""
        self.rows = [tuple(t.to(device, non_blocking=True) for t in row) for row in self.rows]
        self.tokens = [(i, *(t.to(device) for t in row)) for i, *row in self.tokens]
        if self.head is not None:
            w, b, softcap = self.head
            self.head = (w.to(device), None if b is None else b.to(device), softcap)
        return self

    def nbytes(self) -> int:
        """Bytes held: the micro-batches' rows and the head's rows."""
        held = [t for row in self.rows for t in row] + [t for row in self.tokens
                                                         for t in row[1:]]
        if self.head is not None:
            held += [t for t in self.head[:2] if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def result(self, mask, group_ids, advantages, options: MethodOptions):
        """``(NTHRResult, metrics)`` of the whole batch: ``mask`` ``[B, T]``, ``group_ids``
        ``[B]``, ``advantages`` ``[B, T]`` or ``[B]`` (the correct rule's input)."""
        temps = self.temperatures
        if self.group is not None:      # every rank decides alike (a refusal on one alone
            import torch.distributed as dist          # would leave the others in a collective)

            pg = None if self.group == "world" else self.group
            every = [None] * dist.get_world_size(pg)
            dist.all_gather_object(every, sorted(temps), group=pg)
            temps = set().union(*every)
        if len(temps) > 1:
            raise ValueError(f"nthr: the rollout temperatures of the batch differ "
                             f"({sorted(temps)[:4]}); NTHR's scores use one temperature")
        (B, T), h0 = mask.shape, (self.rows[0][1] if self.rows else self.tokens[0][2])
        device = h0.device
        hidden = h0.new_zeros(B, T, h0.shape[-1])
        targets = torch.zeros(B, T, dtype=torch.long, device=device)
        valid = torch.zeros(B, T, dtype=torch.bool, device=device)
        logp = torch.zeros(B, T, dtype=torch.float32, device=device)
        with_support = {len(row) > 5 for row in self.rows}
        if with_support == {True, False} or (True in with_support and self.tokens):
            raise ValueError("nthr: some micro-batches carry the sampler's support and others "
                             "do not; NTHR's scores need one kind for the whole batch")
        support = None
        if True in with_support:
            k = max(row[5].shape[-1] for row in self.rows)
            support = torch.full((B, T, k), -1, dtype=torch.long, device=device)
        while self.rows:                 # each micro-batch freed once copied: one batch's worth
            i, h, y, v, lp, *s = self.rows.pop()
            t = h.shape[1]
            hidden[i, :t], targets[i, :t], valid[i, :t], logp[i, :t] = h, y, v, lp
            if s:
                support[i, :t, :s[0].shape[-1]] = s[0].long()
        while self.tokens:               # kept tokens: each at its column
            i, cols, h, y, lp = self.tokens.pop()
            hidden[i, cols], targets[i, cols], valid[i, cols], logp[i, cols] = h, y, True, lp
        mask, ids = mask.to(device).bool() & valid, self.ids.to(device)
        last = ids.numel() - 1
        compact = torch.where(mask, torch.searchsorted(ids, targets).clamp(max=last), 0)
        extra = {}
        if support is not None:
            # the support's ids as columns of the kept head rows (a superset of every group's
            # V*); a member outside them is in no V* and enters only through logp's LSE
            at = torch.searchsorted(ids, support.clamp(min=0)).clamp(max=last)
            cols = torch.where((support >= 0) & (ids[at] == support), at, -1)
            extra["support_ids"] = cols.masked_fill(~mask[..., None], -1)
        adv = advantages.to(device).float()
        weight, bias, softcap = self.head
        res = nthr_token_scale(hidden, weight, compact, mask, group_ids.to(device), adv, options,
                               bias=bias, temperature=temps.pop(), logp=logp,
                               logit_softcap=softcap, backend=self.backend,
                               data_parallel_group=self.group, **extra)
        return res, nthr_metrics(res, adv, mask)


class NTHRKeptRow(NamedTuple):
    """One response's NTHR inputs kept from the trainer's old-policy pass: its valid columns
    ``cols`` (int32, ascending), their hidden states ``[n, H]`` and log-probs ``[n]``, and the
    :class:`NTHRHeadRows` of the pass."""
    cols: torch.Tensor
    hidden: torch.Tensor
    logp: torch.Tensor
    heads: "NTHRHeadRows"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.cols, self.hidden, self.logp))


class NTHRHeadRows:
    """The lm_head's rows of the token ids an old-policy pass scored, kept a micro-batch at a
    time inside its forwards (where ZeRO-3 / FSDP hold the head), each id once, on ``device``
    (default: the CPU), with no collective: the ranks may run different numbers of
    micro-batches. :meth:`assemble` gives every rank the rows of an update's ids."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.ids = torch.zeros(0, dtype=torch.long)
        self.weight = self.bias = self.softcap = None
        self.temperatures = set()
        self.stale = False          # set when the parameters change (the rows describe none)

    def add(self, ids, head, logit_softcap=None, temperature=1.0):
        """Inside the pass's forward: the rows of ``ids`` not yet held; ``head`` (``weight``,
        ``bias``) as the forward holds it."""
        w = head.weight.detach()
        b = None if head.bias is None else head.bias.detach()
        if self.weight is None:
            self.weight = w.new_zeros(0, w.shape[1], device=self.device)
            self.bias = None if b is None else b.new_zeros(0, device=self.device)
            self.softcap = logit_softcap
        temps = temperature.unique().tolist() if isinstance(temperature, torch.Tensor) \
            else [temperature]
        self.temperatures.update(float(t) for t in temps)
        new = torch.unique(ids.detach().reshape(-1).cpu()).long()
        new = new[~torch.isin(new, self.ids)]
        if not new.numel():
            return
        ids = torch.cat([self.ids, new])
        order = ids.argsort()
        take = new.to(w.device)
        self.weight = torch.cat([self.weight, w.index_select(0, take).to(self.device)])[order]
        if b is not None:
            self.bias = torch.cat([self.bias, b.index_select(0, take).to(self.device)])[order]
        self.ids = ids[order]

    def nbytes(self) -> int:
        held = [t for t in (self.weight, self.bias) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def assemble(self, ids, group=None, device="cpu"):
        """``(weight [U, H], bias [U] or None, softcap)``: the rows of the sorted ``ids`` on
        ``device``; over the ranks of ``group`` (a collective) each row from the lowest rank
        that holds it (the others add zeros: the same values, exactly). An id no rank holds:
        ``ValueError``."""
        ids = torch.as_tensor(ids, dtype=torch.long).cpu()
        if self.weight is None:
            raise ValueError("heads: no head rows were kept (the pass ran no forward)")
        mine = torch.isin(ids, self.ids)
        owned = mine
        if group is not None:
            import torch.distributed as dist

            pg = None if group == "world" else group
            every = [None] * dist.get_world_size(pg)
            dist.all_gather_object(every, self.ids.tolist(), group=pg)
            taken = torch.zeros_like(mine)
            me = dist.get_rank(pg)
            for r, held in enumerate(every):
                has = torch.isin(ids, torch.tensor(held, dtype=torch.long)) & ~taken
                if r == me:
                    owned = has
                taken |= has
            mine = taken
        if not bool(mine.all()):
            raise ValueError(f"heads: token ids {ids[~mine][:8].tolist()} have no kept head "
                             "rows")
        pos = torch.searchsorted(self.ids, ids[owned])

        def rows(t):
            out = t.new_zeros(ids.numel(), *t.shape[1:], device=device)
            out[owned.to(device)] = t[pos].to(device)
            if group is not None:
                import torch.distributed as dist
                dist.all_reduce(out, group=None if group == "world" else group)
            return out

        return rows(self.weight), None if self.bias is None else rows(self.bias), self.softcap


# ------------------------------------------------------------------------ critical-token KL
class ReferenceStats(NamedTuple):
    ref_logp: torch.Tensor                 # [.., T] float32
    kl_weight: Optional[torch.Tensor]      # critical-token KL weights (None when off)
    certainty: Optional[torch.Tensor]


@torch.no_grad()
def reference_stats(hidden, weight, targets, options: MethodOptions, bias=None,
                    temperature=1.0, logit_softcap=None, backend="auto",
                    **parallel) -> ReferenceStats:
    """The reference pass over the reference model's hidden states: ``ref_logp`` and, with
    critical-token KL on, its weights ``(1 - c) J^gamma + c`` (docs/math.md §5), from one
    streaming pass over the vocabulary."""
    crit = options.critical_kl_exponent is not None
    st = token_stats(hidden, weight, targets, bias, temperature=temperature,
                     certainty=options.critical_kl_certainty if crit else None,
                     certainty_temperature=options.critical_kl_temperature, backend=backend,
                     logit_softcap=logit_softcap, logits_dtype=options.logits_dtype,
                     **parallel)
    w = (critical_kl_weight(st.certainty, options.critical_kl_exponent,
                            options.critical_kl_intercept) if crit else None)
    return ReferenceStats(st.logp, w, st.certainty)


# ----------------------------------------------------------------------------------- Lopti
def run_lopti(compute_loss: Callable, optimizer, order: str = "low-first",
              before_step: Optional[Callable] = None) -> list:
    """Lopti's two updates over one batch: for each phase of ``order``,
    ``optimizer.zero_grad()``, ``compute_loss(phase).backward()``, ``before_step()`` (e.g.
    gradient clipping), ``optimizer.step()``.

    ``compute_loss(phase)`` returns the loss or ``(loss, metrics)``; it recomputes the policy's
    forward, so the second phase sees the parameters after the first, and passes the SAME
    ``old_logp`` to both phases (taken from the rollout policy before the first update: the
    split stays fixed, the second phase's ratio carries the first's drift and the clip acts on
    it). Returns what ``compute_loss`` returned, one per phase."""
    if order not in LOPTI_ORDERS:
        raise ValueError(f"order: expected one of {tuple(LOPTI_ORDERS)}, got {order!r}")
    results = []
    for phase in LOPTI_ORDERS[order]:
        optimizer.zero_grad(set_to_none=True)
        out = compute_loss(phase)
        (out[0] if isinstance(out, tuple) else out).backward()
        if before_step is not None:
            before_step()
        optimizer.step()
        results.append(out)
    return results


def each_phase(options, update: Callable) -> list:
    """``[update(phase) for phase in options.phases]``: an engine's own updates (its zero-grad,
    forward-backward and optimizer step in ``update``) once per Lopti phase, in the order asked
    for; with Lopti off, one update with ``phase=None``."""
    return [update(phase) for phase in options.phases]


def lopti_grad_share_low(results, order: str = "low-first") -> Optional[float]:
    """``grad_share_low`` of a Lopti step (docs/math.md §6, one meaning everywhere): the share
    of the logit-gradient norm (summed over tokens) on the low tokens; over the two updates it
    is the low phase's ``grad_norm_sum`` over both phases'. None when the metrics carry no
    ``grad_norm_sum``. Reads two device values."""
    norms = {}
    for phase, out in zip(LOPTI_ORDERS[order], results):
        metrics = out[1] if isinstance(out, tuple) else {}
        if "grad_norm_sum" not in metrics:
            return None
        norms[phase] = float(metrics["grad_norm_sum"])
    return share_low(norms["low"], norms["high"])


def share_low(low: float, high: float) -> float:
    """The low share of two summed gradient norms (0 when both are 0)."""
    total = low + high
    return low / total if total > 0 else 0.0
