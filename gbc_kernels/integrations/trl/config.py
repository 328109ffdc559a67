"""TRL's options as gbc's: :class:`GBCGRPOConfig` (``GRPOConfig`` plus the ``gbc_*``
options), the method options of a config (:func:`method_options`), the TRL options the fused
loss does not reproduce, refused naming them (:func:`_unsupported`), and TRL's release check
(:func:`check_trl_version`); docs/trl.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from trl import GRPOConfig

import gbc_kernels as gbc
from gbc_kernels import methods
from ..releases import check_release


SUPPORTED_LOSS_TYPES = tuple(gbc.config.TRL_LOSS_TYPES)
PPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")     # TRL applies delta to these
NUM_ITEMS_LOSS_TYPES = ("cispo", "dapo", "vespo")     # normalised by num_items_in_batch


@dataclass
class GBCGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the gbc_kernels options (all off by default)."""

    gbc_ar_alpha: float = field(default=0.0, metadata={
        "help": "Advantage Reweighting alpha: advantages scaled by alpha*p_old + 1 - alpha (0 = off)."})
    gbc_lopti_eta: Optional[float] = field(default=None, metadata={
        "help": "Lopti threshold eta: two updates per step, tokens with p_old < eta first (None = off)."})
    gbc_lopti_order: str = field(default="low-first", metadata={
        "help": "'low-first' (the paper's) or 'high-first' (its failing ablation)."})
    gbc_nthr: bool = field(default=False, metadata={
        "help": "NTHR: soften the penalty of wrong-answer tokens aligned with the correct answers."})
    gbc_nthr_beta: float = field(default=1.0, metadata={"help": "NTHR threshold factor beta."})
    gbc_nthr_eta: Optional[float] = field(default=None, metadata={
        "help": "NTHR scale of selected tokens; None = 'auto' (2*|0.5 - p|, the paper's)."})
    gbc_critical_kl_exponent: Optional[float] = field(default=None, metadata={
        "help": "Critical-token KL exponent gamma (paper: 150); None = off. Needs beta > 0."})
    gbc_critical_kl_certainty: str = field(default="max_prob", metadata={
        "help": "Certainty of the reference model: 'max_prob' or 'entropy'."})
    gbc_critical_kl_temperature: float = field(default=1.0, metadata={
        "help": "Temperature of the reference distribution the certainty is measured on."})
    gbc_critical_kl_intercept: float = field(default=0.0, metadata={
        "help": "Intercept c of the weight (1 - c) * J**gamma + c."})
    gbc_backend: str = field(default="auto", metadata={
        "help": "gbc_kernels backend: 'auto', 'triton', 'cpu' or 'torch'."})
    gbc_logits_dtype: Optional[str] = field(default=None, metadata={
        "help": "'float32': the fused head's logits in float32 from the bf16 hidden states and "
                "weight (the float32 LM head's log-probs at bf16 matmul cost); 'input': the "
                "head's dtype; None = per device (float32 on a CPU, the head's dtype on a GPU). "
                "TRL's cast_lm_head_to_fp32 makes the head float32 instead."})
    gbc_support: Optional[str] = field(default=None, metadata={
        "help": "The sampler's kept set rebuilt from top_k / top_p / min_p: 'replay' (the "
                "policy, old and reference log-probs over it) or 'kept_mass' (vLLM's importance "
                "sampling correction against the sampler's log-probs moved by log_kept_mass); "
                "None = off."})
    gbc_support_ties: Optional[str] = field(default=None, metadata={
        "help": "The rebuilt set's top-k tie rule: 'first' (exactly k, lowest ids: vLLM's "
                "Triton sampler) or 'all' (every token tied with the k-th: vLLM's PyTorch "
                "sampler); None = the default of the trainer's sampler."})
    gbc_support_set: Optional[str] = field(default=None, metadata={
        "help": "Under gbc_support='replay', which kept set each pass scores: 'rollout' (the "
                "default: one set per rollout, built by the pass that first scores it with the "
                "sampling weights and replayed by the reference pass, the update, Lopti's "
                "second phase and further iterations) or 'per_pass' (each pass rebuilds it "
                "from the model it scores)."})

    def __post_init__(self):
        """TRL's checks, then gbc's: a bad ``gbc_*`` option, or a TRL option the fused loss
        does not reproduce, is refused here, naming it (TRL's command line stops at parsing);
        :class:`GBCGRPOTrainer` checks again what can change after construction."""
        super().__post_init__()
        bad = _unsupported(self)
        if bad:
            raise ValueError("GBCGRPOConfig: unsupported option(s):\n  " + "\n  ".join(bad))


class _Options:
    """The gbc options of ``args``: a :class:`GBCGRPOConfig`, or a plain ``GRPOConfig`` (then
    every gbc option has its default, off)."""

    def __init__(self, args):
        self._args = args

    def __getattr__(self, name):
        if name.startswith("gbc_"):
            default = GBCGRPOConfig.__dataclass_fields__[name].default
            return getattr(self._args, name, default)
        return getattr(self._args, name)


# the method layer's options under TRL's names (errors name the option the user set)
METHOD_NAMES = {f.name: f"gbc_{f.name}" for f in dataclasses.fields(methods.MethodOptions)}


def method_options(args) -> methods.MethodOptions:
    """The :class:`gbc_kernels.methods.MethodOptions` of a (GBC)GRPOConfig."""
    args = _Options(args)
    kw = {f: getattr(args, name) for f, name in METHOD_NAMES.items()}
    kw["nthr_eta"] = "auto" if kw["nthr_eta"] is None else kw["nthr_eta"]
    return methods.MethodOptions.from_kwargs(METHOD_NAMES, support_ok=True, **kw)


# --------------------------------------------------- the sampler's kept set (gbc_support)
# TRL 1.16 allows vLLM 0.22-0.31; 0.31 runs its Triton top-k/top-p for processed log-probs
# on a GPU (exactly k kept, lowest ids first among ties at the k-th value): docs/trl.md
DEFAULT_SUPPORT_TIES = "first"
# the TRL release gbc_support hooks into (1.14 / 1.15: refused; their vllm-serve does not set
# processed log-probs and their client cannot report the server's mode)
SUPPORT_TRL_RELEASE = "1.16"
# vLLM treats a temperature below this as greedy: argmax, log-probs without the filters
_VLLM_GREEDY_TEMPERATURE = 1e-5
# generation_kwargs keys that leave the sampler's kept set and its processed log-probs as
# GRPOConfig's settings make them (stopping, lengths, seeds, detokenising)
_NEUTRAL_GENERATION_KWARGS = frozenset((
    "n", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "detokenize",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "output_kind", "truncate_prompt_tokens", "prompt_logprobs"))
# keys that change the distribution vLLM samples from (before its temperature and filters),
# accepted only at the value that changes nothing
_NEUTRAL_VALUES = {"repetition_penalty": 1.0, "presence_penalty": 0.0,
                   "frequency_penalty": 0.0, "min_tokens": 0}
_EMPTY_OK = ("logit_bias", "allowed_token_ids", "bad_words", "structured_outputs",
             "guided_decoding", "logits_processors", "extra_args")


def _sampling_setting(name, value):
    """A sampling setting as the sampler reads it (vLLM: top_k <= 0 and min_p None are off)."""
    if name == "top_k":
        return None if value is None or int(value) <= 0 else int(value)
    if name == "min_p":
        return 0.0 if value is None else float(value)
    return None if value is None else float(value)


def support_truncation(args):
    """The :class:`gbc_kernels.SamplerTruncation` the rollout sampled with (None with
    ``gbc_support`` off): ``GRPOConfig``'s ``top_k`` / ``top_p`` / ``min_p`` by vLLM's rule, the
    tie rule ``gbc_support_ties`` (default :data:`DEFAULT_SUPPORT_TIES`). Refuses, naming
    ``gbc_support``, settings that truncate nothing."""
    args = _Options(args)
    return methods.sampler_truncation(method_options(args), args.top_k, args.top_p, args.min_p,
                                      rule="vllm", ties=DEFAULT_SUPPORT_TIES,
                                      names=METHOD_NAMES)


def _support_unsupported(args) -> list:
    """What ``gbc_support`` cannot run exactly with these TRL options, as error lines
    (docs/trl.md, "The sampler's kept set")."""
    args = _Options(args)
    try:
        opts = method_options(args)
    except ValueError:                   # a bad value: _unsupported reports it
        return []
    mode = opts.support
    if mode is None:
        if opts.support_ties is not None:
            return [f"gbc_support_ties={opts.support_ties}: the tie rule of the rebuilt kept "
                    "set, which only gbc_support builds; set gbc_support too or unset it"]
        return []
    name = f"gbc_support={mode}"
    bad = []
    import trl

    release = str(getattr(trl, "__version__", ""))
    if release.split(".")[:2] != SUPPORT_TRL_RELEASE.split("."):
        bad.append(f"{name}: runs on TRL {SUPPORT_TRL_RELEASE} only, the release whose rollout "
                   f"(old-policy pass, vLLM ratio, vllm-serve's processed log-probs) it was "
                   f"read and tested against; installed: TRL {release}")
    try:
        support_truncation(args)
    except ValueError as exc:
        bad.append(str(exc))
    if not args.use_vllm:
        bad.append(f"{name}: needs use_vllm=True. Without vLLM TRL samples with transformers' "
                   "generate, which returns no log-probs (TRL then has no sampler ratio to "
                   "correct) and applies its filters in another order (top-k, top-p, then "
                   "min-p, every tie kept)")
    if mode == "kept_mass" and not args.vllm_importance_sampling_correction:
        bad.append(f"{name}: vllm_importance_sampling_correction=False: kept_mass corrects "
                   "TRL's vLLM importance-sampling ratio, which is off (nothing to correct); "
                   "turn it on or use gbc_support=replay")
    if mode == "replay" and args.gbc_nthr:
        bad.append(f"{name}: gbc_nthr: NTHR's scales over the rebuilt kept set are not "
                   "computed (nthr_scale takes recorded support_ids only); use "
                   "gbc_support=kept_mass or turn gbc_nthr off")
    if args.temperature is not None and args.temperature < _VLLM_GREEDY_TEMPERATURE:
        bad.append(f"{name}: temperature={args.temperature}: vLLM samples greedily below "
                   f"{_VLLM_GREEDY_TEMPERATURE} and its log-probs skip the filters")
    if args.repetition_penalty is not None and float(args.repetition_penalty) != 1.0:
        bad.append(f"{name}: repetition_penalty={args.repetition_penalty}: vLLM penalises the "
                   "logits before its temperature and filters; the kept set rebuilt from the "
                   "policy's logits would not be the sampler's (set it to 1.0)")
    if getattr(args, "vllm_structured_outputs_regex", None) is not None:
        bad.append(f"{name}: vllm_structured_outputs_regex: the structured-output mask removes "
                   "tokens from the sampler's kept set that the policy's logits do not show")
    bad += [f"{name}: {line}" for line in _generation_kwargs_refused(args)]
    return bad


def _generation_kwargs_refused(args) -> list:
    """The ``generation_kwargs`` that change vLLM's kept set or its processed log-probs away
    from what ``GRPOConfig``'s settings make them."""
    kw = args.generation_kwargs or {}
    if not isinstance(kw, dict):
        return [f"generation_kwargs={kw!r}: expected a dict"]
    bad = []
    for key in sorted(kw, key=str):
        value = kw[key]
        where = f"generation_kwargs[{key!r}]={value!r}"
        if key in _NEUTRAL_GENERATION_KWARGS:
            continue
        if key in ("top_k", "top_p", "min_p", "temperature"):
            mine = getattr(args, key)
            try:
                same = _sampling_setting(key, value) == _sampling_setting(key, mine)
            except (TypeError, ValueError):
                same = False
            if not same:
                bad.append(f"{where} overrides GRPOConfig's {key}={mine!r} for the sampler "
                           f"only; set {key} itself (the kept set is rebuilt from GRPOConfig's "
                           "settings)")
        elif key in _NEUTRAL_VALUES:
            try:
                same = float(value) == _NEUTRAL_VALUES[key]
            except (TypeError, ValueError):
                same = False
            if not same:
                bad.append(f"{where}: changes the sampler's logits (or, min_tokens, masks the "
                           "stop tokens) before its filters; the kept set rebuilt from the "
                           "policy's logits would not be the sampler's")
        elif key in _EMPTY_OK:
            if value:
                bad.append(f"{where}: masks or moves logits inside vLLM's sampler; the kept "
                           "set rebuilt from the policy's logits would not be the sampler's")
        elif key == "logprobs":
            if value not in (0, None):
                bad.append(f"{where}: TRL reads the first returned log-prob as the sampled "
                           "token's, which holds only with logprobs=0 (TRL's)")
        else:
            bad.append(f"{where}: not known to leave vLLM's kept set and processed log-probs "
                       "unchanged; remove it (or run without gbc_support)")
    return bad


# gbc's config fields -> TRL's options (GRPOConfig), for the config's errors
TRL_NAMES = dict(METHOD_NAMES, epsilon_low="epsilon", kl_coef="beta",
                 max_len="max_completion_length", kl_ratio_correction="use_bias_correction_kl")


@contextlib.contextmanager
def _in_trl_words():
    """A config error naming gbc's field, raised again naming TRL's option."""
    try:
        yield
    except ValueError as exc:
        raise methods.in_trainer_words(exc, TRL_NAMES) from None


def _unsupported(args) -> list[str]:
    """TRL options whose objective the fused loss does not reproduce, as error lines."""
    args = _Options(args)
    bad = []
    if args.loss_type not in SUPPORTED_LOSS_TYPES:
        bad.append(f"loss_type={args.loss_type!r}: expected one of {SUPPORTED_LOSS_TYPES}")
    if args.importance_sampling_level not in ("token", "sequence"):
        bad.append(f"importance_sampling_level={args.importance_sampling_level!r}: expected "
                   "'token' or 'sequence'")
    if args.gbc_nthr:
        local = args.per_device_train_batch_size * args.steps_per_generation
        if args.num_generations and local % args.num_generations:
            bad.append(f"gbc_nthr with per_device_train_batch_size * steps_per_generation = "
                       f"{local}, not a multiple of num_generations={args.num_generations}: "
                       "NTHR needs every group's completions on the same process")
    try:
        method_options(args).check_loss(args.beta, "beta", METHOD_NAMES)
    except ValueError as exc:
        bad.append(str(exc))
    if args.gbc_backend not in gbc.BACKENDS:
        bad.append(f"gbc_backend={args.gbc_backend!r}: expected one of {gbc.BACKENDS}")
    bad += _support_unsupported(args)
    return bad


def check_trl_version(version: Optional[str] = None) -> str:
    """TRL's installed version, refused by name unless :data:`releases.TESTED` ["trl"] (every
    :class:`GBCGRPOTrainer` checks it when built)."""
    import trl

    return check_release("trl", version or getattr(trl, "__version__", None),
                         why="GBCGRPOTrainer overrides GRPOTrainer's loss, its batch "
                             "preparation and its optimizer step, which change between "
                             "releases",
                         off="trl.GRPOTrainer runs TRL's own loss")
