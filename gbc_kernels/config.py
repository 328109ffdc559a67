"""PolicyLossConfig: every non-tensor option of the GRPO policy loss (docs/math.md §1-§3)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch

from . import objectives as _table

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm")
# TRL's loss_type names for the same normalisations (TRL's formulas, not its code).
LOSS_AGG_ALIASES = {
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}
# the sequence count B of the sequence modes when a call passes no num_seqs_in_batch
SEQ_COUNTS = ("rows", "nonempty")
# The names below come from the table of objectives and KL forms (gbc_kernels.objectives).
# KL_ESTIMATORS' order is the native kernels' estimator index.
KL_ESTIMATORS = _table.KL_BASE_NAMES
# "k3+" and the like (verl): the value of the estimator, the gradient of k2 (straight-through)
KL_STRAIGHT_THROUGH = tuple(k for k, form in _table.KL_FORMS.items() if form.straight_through)
PHASES = (None, "low", "high")
# the kernels' backends (`backend=`): auto picks Triton on CUDA, C++ on CPU, else torch
BACKENDS = ("auto", "torch", "cpu", "triton")
IS_LEVELS = tuple(_table.RATIO_LEVELS)
OBJECTIVES = tuple(_table.OBJECTIVES)
DPPO_DIVERGENCES = _table.DPPO_DIVERGENCES
COV_MODES = (None,) + tuple(_table.COV_MODES)
# TRL 1.16 GRPOTrainer's loss_type names as presets over the axes (PolicyLossConfig.preset).
# TRL averages the entropy bonus over the tokens it acts on whatever the loss type: its own
# normaliser, entropy_agg="token-mean". luspo is PPO clip summed over each sequence's tokens.
TRL_LOSS_TYPES = {
    "grpo": dict(loss_agg="seq-mean-token-mean"),
    "bnpo": dict(loss_agg="token-mean"),
    "dr_grpo": dict(loss_agg="seq-mean-token-sum-norm"),
    "dapo": dict(loss_agg="token-mean"),
    "cispo": dict(objective="cispo", loss_agg="token-mean"),
    "sapo": dict(objective="sapo", loss_agg="seq-mean-token-mean"),
    "luspo": dict(loss_agg="seq-mean-token-sum"),
    "vespo": dict(objective="vespo", loss_agg="token-mean"),
}

# Other trainers' objective names as presets, "trainer:name" (docs/math.md §12). Each sets the
# axes with that trainer's defaults; the trainer's own values (clip ratios, coefficients) come
# in as options, or through its mapping (gbc_kernels.integrations.verl.policy_loss_config).
# verl 0.9.1: verl/trainer/ppo/core_algos.py, its registered policy losses (defaults of its
# ActorConfig: clip_ratio 0.2, clip_ratio_c 3.0, loss_agg_mode token-mean). Its vanilla, dppo,
# sapo and cispo clamp the log-ratio to +-20; its sapo aggregates seq-mean-token-mean whatever
# loss_agg_mode says, its geo_mean takes the plain mean over the micro-batch's sequences.
_VERL_CLAMP = dict(log_ratio_clamp=20.0)
TRAINER_PRESETS = {
    "verl:vanilla": dict(objective="ppo_clip", clip_ratio_c=3.0, **_VERL_CLAMP),
    "verl:dppo_tv": dict(objective="dppo", dppo_divergence="tv", clip_ratio_c=3.0, **_VERL_CLAMP),
    "verl:dppo_kl": dict(objective="dppo", dppo_divergence="binary_kl", clip_ratio_c=3.0,
                         **_VERL_CLAMP),
    "verl:gspo": dict(objective="ppo_clip", importance_sampling_level="sequence_token"),
    "verl:sapo": dict(objective="sapo", loss_agg="seq-mean-token-mean", **_VERL_CLAMP),
    "verl:gpg": dict(objective="reinforce"),
    "verl:clip_cov": dict(objective="ppo_clip", cov_mode="clip"),
    "verl:kl_cov": dict(objective="unclipped", cov_mode="kl"),
    "verl:geo_mean": dict(objective="gmpo", loss_agg="seq-mean-token-mean"),
    "verl:dro": dict(objective="reinforce"),          # + log_ratio_penalty = dro_beta (required)
    "verl:cispo": dict(objective="cispo", epsilon_high=1.2, cispo_min=0.8, **_VERL_CLAMP),
    # OpenRLHF 0.11.2's PolicyLoss (policy_loss_type): ppo clamps the log-ratio to +-20, gspo
    # takes the sequence ratio and aggregates per sequence; its KL and entropy terms are token
    # means over the batch normalisers (gbc_kernels.integrations.openrlhf.policy_loss_config).
    # Without a global_batch_size its aggregate_loss averages over the non-empty sequences.
    "openrlhf:ppo": dict(objective="ppo_clip", normalise_all_terms=True, seq_count="nonempty",
                         **_VERL_CLAMP),
    "openrlhf:gspo": dict(objective="ppo_clip", importance_sampling_level="sequence",
                          loss_agg="seq-mean-token-mean", normalise_all_terms=True,
                          seq_count="nonempty"),
}


@dataclass(frozen=True)
class PolicyLossConfig:
    """Options of :func:`gbc_kernels.fused_linear_policy_loss` and :func:`policy_loss`.

    epsilon_low, epsilon_high: PPO clip range ``[1 - epsilon_low, 1 + epsilon_high]`` (DAPO's
        clip-higher sets ``epsilon_high > epsilon_low``).
    clip_ratio_c: dual-clip constant ``c > 1`` for negative advantages (None = off).
    loss_agg: one of ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``,
        ``seq-mean-token-sum-norm`` or TRL's aliases ``bnpo``, ``dapo``, ``grpo``, ``dr_grpo``.
    max_len: the constant of ``seq-mean-token-sum-norm`` (TRL's ``max_completion_length``).
    token_count: token-mean's count ``N_tok`` when the call passes no ``num_items_in_batch``
        (None: the call's masked-in tokens; 1.0: a token sum, verl's ``token-sum``).
    seq_count: the sequence modes' count ``B`` when the call passes no ``num_seqs_in_batch``:
        ``rows`` (every row, TRL's) or ``nonempty`` (rows with a masked-in token, verl's).
    temperature: logits are divided by it before the softmax.
    kl_coef, kl_estimator: KL penalty weight and estimator (``k1``, ``k2``, ``k3``,
        ``low_var_kl``); the KL term is skipped when ``kl_coef == 0``.
    kl_ratio_correction: multiply the KL estimator by the ratio ``r`` (with its gradient), the
        importance-sampling correction of TRL's ``use_bias_correction_kl`` (default off).
    entropy_coef: entropy bonus weight (the loss subtracts ``entropy_coef * H``).
    ar_alpha: Advantage Reweighting alpha (0 = off).
    lopti_eta: Lopti's probability threshold; required when a ``phase`` is given. Also the
        threshold of the ``low_frac`` and ``grad_share_low`` metrics (0.5 when None).

    The objectives of today's trainers (docs/math.md §10), each an axis of its own:

    importance_sampling_level: ``token`` (one ratio per token) or ``sequence`` (GSPO: one ratio
        per sequence, ``exp`` of the masked mean of ``logp - old_logp``, gradient through it).
    objective: the policy term: ``ppo_clip`` (PPO/DAPO clip, dual clip, ``delta``), ``cispo``
        (``-min(r, epsilon_high).detach() * A * logp``), ``sapo`` (soft gate
        ``sigmoid(k (r - 1)) * 4 / k``), ``vespo`` (``-phi * A * logp`` with TRL's gamma weight
        phi of the sequence log-ratio).
    delta: two-sided clip of ``ppo_clip`` (INTELLECT-2): the unclipped ratio is capped at delta.
    sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperature for A > 0 / A <= 0.
    vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's gamma shape and rate
        for A >= 0 / A < 0.
    top_entropy_quantile: keep the policy term (and the entropy bonus) only on tokens whose
        entropy is in the batch's top quantile (1.0 = off; a batch-global statistic).
    off_policy_mask_threshold: drop the policy term of negative-advantage sequences whose mean
        ``sampling_logp - logp`` exceeds it (DeepSeek-V3.2's off-policy sequence mask; None = off).
    kl_agg, entropy_agg: the KL / entropy term's own aggregation (None: aggregated with the
        policy term by ``loss_agg``). A term with its own aggregation is normalised over the
        tokens it acts on in this call; ``num_items_in_batch`` and ``num_seqs_in_batch`` are
        the policy term's only, unless ``normalise_all_terms``.
    normalise_all_terms: the call's ``num_items_in_batch`` / ``num_seqs_in_batch`` normalise
        every term, those with their own aggregation too (verl: its ``global_batch_info``
        enters the KL and entropy terms). False: TRL's rule above.

    return_entropy: compute the entropy (``entropy`` metric) even when no term uses it.
    logit_softcap: final-logit soft-capping ``c`` (Gemma-2/3's ``final_logit_softcapping``):
        the logits are ``c * tanh((h W^T + b) / c)`` before the temperature (None = off).
    logits_dtype: ``torch.float32`` (``"float32"``): the float32 head's logits — the exact
        products of the bf16/fp16 operands summed in float32, never rounded before the
        log-softmax — at the cost of a bf16 matmul, without a float32 ``[N, V]``
        (docs/kernels.md, "Precision"); ``"input"``: each chunk's logits held in the input's
        dtype before the row statistics, as the trainers' eager bf16 heads do; None (the
        default): per device — float32 on a CPU without bf16/fp16 matmul units, the input's
        dtype on one with them and on a GPU (:func:`resolve_logits_dtype`). float32 inputs:
        no effect.

    The objectives of verl, OpenRLHF and the other trainers (docs/math.md §12):

    objective ``reinforce`` (``-A * logp``: GPG, verl's ``gpg``/REINFORCE), ``unclipped``
        (``-A * r``, PPO's surrogate without a clip: verl ``kl_cov``'s base), ``dppo`` (DPPO's
        binary trust region: ``-A * sg(min(r, clip_ratio_c)) * logp`` on the tokens whose
        sampled-token probability stayed within ``epsilon_low``/``epsilon_high`` of ``p_old``,
        one-sided by the sign of A), ``gmpo`` (the geometric mean of the token ratios of a
        sequence, each log-ratio clipped to ``[-epsilon_low, epsilon_high]`` by the sign of A).
    importance_sampling_level ``sequence_token``: verl's GSPO-token ratio, the sequence's ratio
        as value (log clamped at 10 above) and each token's own gradient.
    cispo_min: the lower bound of cispo's detached weight, ``clamp(r, cispo_min, epsilon_high)``
        (verl's two-sided CISPO: ``cispo_min = 1 - clip_ratio_low``); None = upper bound only.
    dppo_divergence: ``tv`` (``|p - p_old|``) or ``binary_kl`` (the KL between the Bernoulli
        distributions ``p_old`` and ``p``), the divergence dppo's trust region bounds.
    log_ratio_clamp: clamp each token's ``logp - old_logp`` to ``[-c, c]`` before the ratio
        (verl's and OpenRLHF's 20); the gradient passes inside only. None = off.
    log_ratio_penalty: ``beta``: adds ``beta/2 * (logp - old_logp)^2`` to the policy term (verl
        ``dro``, ROLL ``kimi15``, prime-rl's ``kl_tau``). 0 = off.
    kl_estimator also takes ``abs`` (``|logp - ref_logp|``) and a ``+`` suffix on any estimator
        (``k3+``: its value with the gradient of k2, verl's straight-through form).
    kl_clamp: clamp the KL estimator's value to ``[-c, c]`` (OpenRLHF's 10, NeMo-RL's
        ``kl_output_clamp_value``); None = off.
    kl_log_ratio_clamp: clamp ``ref_logp - logp`` to ``[-c, c]`` before the estimator
        (NeMo-RL's ``kl_input_clamp_value``); None = off.
    kl_unbiased_gradient: OpenRLHF's ``unbiased_gradient``: the estimator's value with the
        gradient ``w * (logp - ref_logp)``, ``w = min(exp(logp - old_logp), 10)`` detached.
    cov_mode: ``clip`` (Clip-Cov: the policy term dropped on ``max(1, int(cov_ratio * N))``
        random tokens among those, not already clipped, whose covariance ``(A - mean A)(logp -
        mean logp)`` over the call's N tokens lies in ``(cov_lb, cov_ub)``) or ``kl`` (KL-Cov:
        ``cov_kl_coef * |logp - old_logp|`` added on the top ``max(1, int(cov_ratio * N))``
        tokens by covariance); None = off. A batch-global statistic (a statistics sweep).

    ``PolicyLossConfig.preset(loss_type, **options)`` sets these axes from TRL's ``loss_type``;
    ``preset("verl:<loss_mode>")`` and ``preset("openrlhf:<policy_loss_type>")`` from those
    trainers' names (docs/math.md §12).
    """

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    clip_ratio_c: Optional[float] = None
    loss_agg: str = "token-mean"
    max_len: Optional[int] = None
    token_count: Optional[float] = None
    seq_count: str = "rows"
    temperature: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_ratio_correction: bool = False
    entropy_coef: float = 0.0
    ar_alpha: float = 0.0
    lopti_eta: Optional[float] = None
    importance_sampling_level: str = "token"
    objective: str = "ppo_clip"
    delta: Optional[float] = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: Optional[float] = None
    kl_agg: Optional[str] = None
    entropy_agg: Optional[str] = None
    return_entropy: bool = False
    logit_softcap: Optional[float] = None
    logits_dtype: Optional[torch.dtype] = None
    # the objectives of verl, OpenRLHF and the other trainers (docs/math.md §12)
    cispo_min: Optional[float] = None
    dppo_divergence: str = "tv"
    log_ratio_clamp: Optional[float] = None
    log_ratio_penalty: float = 0.0
    kl_clamp: Optional[float] = None
    kl_log_ratio_clamp: Optional[float] = None
    kl_unbiased_gradient: bool = False
    cov_mode: Optional[str] = None
    cov_ratio: float = 2e-4
    cov_lb: float = 1.0
    cov_ub: float = 5.0
    cov_kl_coef: float = 0.1
    normalise_all_terms: bool = False

    def __post_init__(self):
        object.__setattr__(self, "logits_dtype", check_logits_dtype(self.logits_dtype))
        for f in fields(self):
            if f.name in _FLOAT_FIELDS:
                v = getattr(self, f.name)
                if v is None and f.name in _OPTIONAL_FIELDS:
                    continue
                if not _is_number(v):
                    want = "None or a float" if f.name in _OPTIONAL_FIELDS else "a float"
                    raise TypeError(f"{f.name}: expected {want}, got {type(v).__name__} {v!r}")
            elif f.name in _BOOL_FIELDS:
                v = getattr(self, f.name)
                if not isinstance(v, bool):      # "no" or 0.5 would act on its truthiness
                    raise TypeError(f"{f.name}: expected a bool, got {type(v).__name__} {v!r}")
            elif f.name in _STR_FIELDS:
                v = getattr(self, f.name)
                optional = f.name in ("kl_agg", "entropy_agg", "cov_mode")
                if not isinstance(v, str) and not (v is None and optional):
                    opt = " or None" if optional else ""
                    raise TypeError(f"{f.name}: expected a str{opt}, got {type(v).__name__} "
                                    f"{v!r}")
        for name in ("loss_agg", "kl_agg", "entropy_agg"):
            value = getattr(self, name)
            if value is None and name != "loss_agg":
                continue
            agg = LOSS_AGG_ALIASES.get(value, value)
            if agg not in LOSS_AGG_MODES:
                hint = (f" (TRL's loss_type {value!r} is a preset: "
                        f"PolicyLossConfig.preset({value!r}))" if value in TRL_LOSS_TYPES else "")
                raise ValueError(f"{name}: expected one of "
                                 f"{LOSS_AGG_MODES + tuple(LOSS_AGG_ALIASES)}, got {value!r}{hint}")
            object.__setattr__(self, name, agg)
            if agg == "seq-mean-token-sum-norm" and (self.max_len is None or self.max_len <= 0):
                raise ValueError(f"max_len: {name}='seq-mean-token-sum-norm' (dr_grpo) needs a "
                                 f"positive max_len, got {self.max_len!r}")
        if self.seq_count not in SEQ_COUNTS:
            raise ValueError(f"seq_count: expected one of {SEQ_COUNTS}, got {self.seq_count!r}")
        c = self.token_count
        if c is not None and not (_is_number(c) and c > 0 and math.isfinite(c)):
            raise ValueError(f"token_count: expected None or a finite float > 0, got {c!r}")
        self._check_names()
        for name in ("epsilon_low", "epsilon_high"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v and math.isfinite(v)):
                raise ValueError(f"{name}: expected a finite float >= 0, got {v!r}")
        if self.epsilon_low >= 1.0:
            raise ValueError(f"epsilon_low: expected < 1 (the lower clip bound is "
                             f"1 - epsilon_low > 0), got {self.epsilon_low!r}")
        _table.check_values(self)         # each entry's parameters (objectives.py)
        _table.check_choice(self)         # the chosen entries' combinations
        self._check_shared()
        if not (self.temperature > 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature: expected a finite float > 0, got {self.temperature!r}")
        for name in ("kl_coef", "entropy_coef"):
            v = getattr(self, name)
            if not math.isfinite(v):
                raise ValueError(f"{name}: expected a finite float, got {v!r}")
        if not 0.0 <= self.ar_alpha <= 1.0:
            raise ValueError(f"ar_alpha: expected a float in [0, 1], got {self.ar_alpha!r}")
        if self.lopti_eta is not None and not 0.0 < self.lopti_eta <= 1.0:
            raise ValueError(f"lopti_eta: expected None or a float in (0, 1], "
                             f"got {self.lopti_eta!r}")

    def _check_names(self):
        """The names of the table's entries (gbc_kernels.objectives)."""
        if self.importance_sampling_level not in IS_LEVELS:
            raise ValueError(f"importance_sampling_level: expected one of {IS_LEVELS}, "
                             f"got {self.importance_sampling_level!r}")
        if self.objective not in OBJECTIVES:
            hint = (f" (TRL's loss_type {self.objective!r}: PolicyLossConfig.preset("
                    f"{self.objective!r}))" if self.objective in TRL_LOSS_TYPES else "")
            raise ValueError(f"objective: expected one of {OBJECTIVES}, got "
                             f"{self.objective!r}{hint}")
        if self.kl_estimator not in KL_ESTIMATORS + KL_STRAIGHT_THROUGH:
            raise ValueError(f"kl_estimator: expected one of "
                             f"{KL_ESTIMATORS + KL_STRAIGHT_THROUGH}, got {self.kl_estimator!r}")
        if self.cov_mode not in COV_MODES:
            raise ValueError(f"cov_mode: expected one of {COV_MODES}, got {self.cov_mode!r}")

    def _check_shared(self):
        """The options of no single entry of the table."""
        q = self.top_entropy_quantile
        if not (_is_number(q) and 0.0 <= q <= 1.0):
            raise ValueError(f"top_entropy_quantile: expected a float in [0, 1], got {q!r}")
        for name in ("logit_softcap", "log_ratio_clamp"):
            c = getattr(self, name)
            if c is not None and not (_is_number(c) and c > 0 and math.isfinite(c)):
                raise ValueError(f"{name}: expected None or a finite float > 0, got {c!r}")
        t = self.off_policy_mask_threshold
        if t is not None and not (_is_number(t) and math.isfinite(t)):
            raise ValueError(f"off_policy_mask_threshold: expected None or a finite float, "
                             f"got {t!r}")

    @classmethod
    def preset(cls, loss_type: str, **options) -> "PolicyLossConfig":
        """The config of TRL's ``loss_type`` (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo,
        vespo) with TRL's entropy normaliser, or of another trainer's objective
        (``"verl:<loss_mode>"``, :data:`TRAINER_PRESETS`); ``options`` set or override any
        other field."""
        if not isinstance(loss_type, str) or (loss_type not in TRL_LOSS_TYPES
                                              and loss_type not in TRAINER_PRESETS):
            raise ValueError(f"loss_type: expected one of "
                             f"{tuple(TRL_LOSS_TYPES) + tuple(TRAINER_PRESETS)}, "
                             f"got {loss_type!r}")
        if loss_type in TRAINER_PRESETS:
            if loss_type == "verl:dro" and not options.get("log_ratio_penalty"):
                raise ValueError("log_ratio_penalty: preset 'verl:dro' needs verl's dro_beta > 0 "
                                 "as log_ratio_penalty")
            d = dict(TRAINER_PRESETS[loss_type])
        else:
            d = dict(TRL_LOSS_TYPES[loss_type], entropy_agg="token-mean")
        d.update(options)
        return cls.from_dict(d)

    # ---- which chunk schedule the options need (docs/kernels.md) ----
    @property
    def needs_sequence(self) -> bool:
        """A token's loss depends on the other tokens of its sequence."""
        return (_table.RATIO_LEVELS[self.importance_sampling_level].needs_sequence
                or _table.OBJECTIVES[self.objective].needs_sequence
                or self.off_policy_mask_threshold is not None)

    @property
    def needs_batch(self) -> bool:
        """A token's loss depends on the whole batch (the entropy quantile, Clip/KL-Cov)."""
        return self.entropy_quantile_on or self.cov_mode is not None

    @property
    def entropy_quantile_on(self) -> bool:
        """The policy term (and entropy bonus) acts on the batch's top-entropy tokens only."""
        return self.top_entropy_quantile < 1.0

    @property
    def wants_entropy(self) -> bool:
        """The per-token entropy is computed (bonus, quantile mask, or asked for)."""
        return self.entropy_coef != 0.0 or self.entropy_quantile_on or self.return_entropy

    @property
    def metric_eta(self) -> float:
        """Threshold of ``low_frac`` / ``grad_share_low``: ``lopti_eta`` or 0.5."""
        return 0.5 if self.lopti_eta is None else self.lopti_eta

    @classmethod
    def coerce(cls, config) -> "PolicyLossConfig":
        """The ``config`` argument of the loss functions as a config: None (the defaults), a
        :class:`PolicyLossConfig`, or a dict of its fields."""
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        if isinstance(config, dict):
            return cls.from_dict(config)
        raise TypeError(f"config: expected a gbc_kernels.PolicyLossConfig or a dict, got "
                        f"{type(config).__name__}")

    @classmethod
    def from_dict(cls, d: dict) -> "PolicyLossConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"config: unknown option(s) {unknown}; expected a subset of "
                             f"{sorted(names)}")
        return cls(**d)


_FLOAT_FIELDS = ("epsilon_low", "epsilon_high", "clip_ratio_c", "temperature", "kl_coef",
                 "entropy_coef", "ar_alpha", "lopti_eta", "delta", "sapo_temperature_pos",
                 "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                 "vespo_lambda_neg", "top_entropy_quantile", "off_policy_mask_threshold",
                 "logit_softcap", "max_len", "cispo_min", "log_ratio_clamp", "log_ratio_penalty",
                 "kl_clamp", "kl_log_ratio_clamp", "cov_ratio", "cov_lb", "cov_ub", "cov_kl_coef")
_BOOL_FIELDS = ("kl_ratio_correction", "return_entropy", "kl_unbiased_gradient",
                "normalise_all_terms")
_STR_FIELDS = ("loss_agg", "kl_agg", "entropy_agg", "kl_estimator", "importance_sampling_level",
               "objective", "dppo_divergence", "cov_mode")
_OPTIONAL_FIELDS = ("clip_ratio_c", "lopti_eta", "delta", "off_policy_mask_threshold",
                    "logit_softcap", "max_len", "cispo_min", "log_ratio_clamp", "kl_clamp",
                    "kl_log_ratio_clamp")


# None: resolved per device at each call (:func:`resolve_logits_dtype`); "input": the operands'
# own dtype everywhere (the eager bf16 head's logits)
LOGITS_DTYPES = (None, torch.float32, "input")
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def check_logits_dtype(value, name: str = "logits_dtype"):
    """``logits_dtype`` as None, ``torch.float32`` or ``"input"``; the strings ``"float32"``
    (the trainers' option strings), ``"input"`` and ``"none"``/``"default"``/``"auto"`` (None)
    are taken too. Anything else: ``ValueError`` naming ``name``."""
    if value is None or value is torch.float32:
        return value
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("float32", "torch.float32", "fp32"):
            return torch.float32
        if v == "input":
            return "input"
        if v in ("none", "default", "auto", ""):
            return None
    raise ValueError(f"{name}: expected None (per device: float32 logits for bf16/fp16 "
                     f"operands on CPU, the input's dtype elsewhere), torch.float32 "
                     f"(\"float32\") or \"input\" (the input's dtype), got {value!r}")


# a CPU's matmul units for a low-precision dtype (Linux /proc/cpuinfo flags)
_CPU_UNITS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"),
              torch.float16: ("avx512_fp16", "amx_fp16")}
_cpu_flags: Optional[frozenset] = None


def cpu_flags() -> frozenset:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    global _cpu_flags
    if _cpu_flags is None:
        flags = set()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("flags"):
                        flags.update(line.partition(":")[2].split())
                        break
        except OSError:
            pass
        _cpu_flags = frozenset(flags)
    return _cpu_flags


def cpu_has_units(dtype: torch.dtype) -> bool:
    """Whether this CPU has matmul units for ``dtype`` (bf16: ``avx512_bf16`` or ``amx_bf16``;
    fp16: ``avx512_fp16`` or ``amx_fp16``)."""
    return any(f in cpu_flags() for f in _CPU_UNITS.get(dtype, ()))


def resolve_logits_dtype(value, dtype: torch.dtype, device) -> Optional[torch.dtype]:
    """The mode a call runs in, from its ``logits_dtype`` (checked) and its operands' ``dtype``
    and ``device``: ``torch.float32`` (float32 logits of bf16/fp16 operands) or None (each
    chunk's logits in the operands' dtype).

    ``"input"`` -> None and ``torch.float32`` -> float32 on every device. ``None`` resolves per
    device (docs/kernels.md, "Precision"): on a CPU without matmul units for the operands'
    dtype (:func:`cpu_has_units`), bf16/fp16 operands get float32 logits — such a CPU runs
    bf16 GEMMs ~90x slower than float32 ones, and the float32 route is also the precise one;
    on a CPU with them, and on a GPU (docs/kernels.md's table), the operands' dtype.
    float32/float64 operands: no effect either way."""
    value = check_logits_dtype(value)
    if value == "input":
        return None
    if value is None:
        dev = torch.device(device) if not isinstance(device, torch.device) else device
        return (torch.float32 if dev.type == "cpu" and dtype in _LOW_PRECISION
                and not cpu_has_units(dtype) else None)
    return value


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
