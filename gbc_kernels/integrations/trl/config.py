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
    return methods.MethodOptions.from_kwargs(METHOD_NAMES, **kw)


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
