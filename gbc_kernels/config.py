"""PolicyLossConfig: every non-tensor option of the GRPO policy loss (docs/math.md §1-§3)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm")
# TRL's loss_type names for the same normalisations (TRL's formulas, not its code).
LOSS_AGG_ALIASES = {
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
PHASES = (None, "low", "high")
IS_LEVELS = ("token", "sequence")
OBJECTIVES = ("ppo_clip", "cispo", "sapo", "vespo")
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


@dataclass(frozen=True)
class PolicyLossConfig:
    """Options of :func:`gbc_kernels.fused_linear_policy_loss` and :func:`policy_loss`.

    epsilon_low, epsilon_high: PPO clip range ``[1 - epsilon_low, 1 + epsilon_high]`` (DAPO's
        clip-higher sets ``epsilon_high > epsilon_low``).
    clip_ratio_c: dual-clip constant ``c > 1`` for negative advantages (None = off).
    loss_agg: one of ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``,
        ``seq-mean-token-sum-norm`` or TRL's aliases ``bnpo``, ``dapo``, ``grpo``, ``dr_grpo``.
    max_len: the constant of ``seq-mean-token-sum-norm`` (TRL's ``max_completion_length``).
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
        tokens it acts on in this call; ``num_items_in_batch`` is the policy term's only.

    return_entropy: compute the entropy (``entropy`` metric) even when no term uses it.
    logit_softcap: final-logit soft-capping ``c`` (Gemma-2/3's ``final_logit_softcapping``):
        the logits are ``c * tanh((h W^T + b) / c)`` before the temperature (None = off).

    ``PolicyLossConfig.preset(loss_type, **options)`` sets these axes from TRL's ``loss_type``.
    """

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    clip_ratio_c: Optional[float] = None
    loss_agg: str = "token-mean"
    max_len: Optional[int] = None
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

    def __post_init__(self):
        for f in fields(self):
            if f.name in _FLOAT_FIELDS:
                v = getattr(self, f.name)
                if v is None and f.name in _OPTIONAL_FIELDS:
                    continue
                if not _is_number(v):
                    want = "None or a float" if f.name in _OPTIONAL_FIELDS else "a float"
                    raise TypeError(f"{f.name}: expected {want}, got {type(v).__name__} {v!r}")
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
        self._check_objective_axes()
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator: expected one of {KL_ESTIMATORS}, "
                             f"got {self.kl_estimator!r}")
        for name in ("epsilon_low", "epsilon_high"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v and math.isfinite(v)):
                raise ValueError(f"{name}: expected a finite float >= 0, got {v!r}")
        if self.epsilon_low >= 1.0:
            raise ValueError(f"epsilon_low: expected < 1 (the lower clip bound is "
                             f"1 - epsilon_low > 0), got {self.epsilon_low!r}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c: expected None or a float > 1, "
                             f"got {self.clip_ratio_c!r}")
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

    def _check_objective_axes(self):
        if self.importance_sampling_level not in IS_LEVELS:
            raise ValueError(f"importance_sampling_level: expected one of {IS_LEVELS}, "
                             f"got {self.importance_sampling_level!r}")
        if self.objective not in OBJECTIVES:
            hint = (f" (TRL's loss_type {self.objective!r}: PolicyLossConfig.preset("
                    f"{self.objective!r}))" if self.objective in TRL_LOSS_TYPES else "")
            raise ValueError(f"objective: expected one of {OBJECTIVES}, got "
                             f"{self.objective!r}{hint}")
        if self.delta is not None:
            if not (_is_number(self.delta) and self.delta > 0 and math.isfinite(self.delta)):
                raise ValueError(f"delta: expected None or a finite float > 0, got {self.delta!r}")
            if self.objective != "ppo_clip":
                raise ValueError(f"delta: the two-sided clip applies to objective='ppo_clip' "
                                 f"only, got delta={self.delta!r} with objective="
                                 f"{self.objective!r}")
        if self.clip_ratio_c is not None and self.objective != "ppo_clip":
            raise ValueError(f"clip_ratio_c: the dual clip applies to objective='ppo_clip' only, "
                             f"got clip_ratio_c={self.clip_ratio_c!r} with objective="
                             f"{self.objective!r}")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            v = getattr(self, name)
            if not (_is_number(v) and v > 0 and math.isfinite(v)):
                raise ValueError(f"{name}: expected a finite float > 0, got {v!r}")
        for name in ("vespo_k_pos", "vespo_k_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            v = getattr(self, name)
            if not (_is_number(v) and math.isfinite(v)):
                raise ValueError(f"{name}: expected a finite float, got {v!r}")
        q = self.top_entropy_quantile
        if not (_is_number(q) and 0.0 <= q <= 1.0):
            raise ValueError(f"top_entropy_quantile: expected a float in [0, 1], got {q!r}")
        c = self.logit_softcap
        if c is not None and not (_is_number(c) and c > 0 and math.isfinite(c)):
            raise ValueError(f"logit_softcap: expected None or a finite float > 0, got {c!r}")
        t = self.off_policy_mask_threshold
        if t is not None and not (_is_number(t) and math.isfinite(t)):
            raise ValueError(f"off_policy_mask_threshold: expected None or a finite float, "
                             f"got {t!r}")

    @classmethod
    def preset(cls, loss_type: str, **options) -> "PolicyLossConfig":
        """The config of TRL's ``loss_type`` (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo,
        vespo) with TRL's entropy normaliser; ``options`` set or override any other field."""
        if loss_type not in TRL_LOSS_TYPES:
            raise ValueError(f"loss_type: expected one of {tuple(TRL_LOSS_TYPES)}, "
                             f"got {loss_type!r}")
        d = dict(TRL_LOSS_TYPES[loss_type], entropy_agg="token-mean")
        d.update(options)
        return cls.from_dict(d)

    # ---- which chunk schedule the options need (docs/kernels.md) ----
    @property
    def needs_sequence(self) -> bool:
        """A token's loss depends on the other tokens of its sequence."""
        return (self.importance_sampling_level == "sequence" or self.objective == "vespo"
                or self.off_policy_mask_threshold is not None)

    @property
    def needs_batch(self) -> bool:
        """A token's loss depends on the whole batch (the entropy quantile)."""
        return self.top_entropy_quantile < 1.0

    @property
    def wants_entropy(self) -> bool:
        """The per-token entropy is computed (bonus, quantile mask, or asked for)."""
        return self.entropy_coef != 0.0 or self.needs_batch or self.return_entropy

    @property
    def metric_eta(self) -> float:
        """Threshold of ``low_frac`` / ``grad_share_low``: ``lopti_eta`` or 0.5."""
        return 0.5 if self.lopti_eta is None else self.lopti_eta

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
                 "logit_softcap", "max_len")
_OPTIONAL_FIELDS = ("clip_ratio_c", "lopti_eta", "delta", "off_policy_mask_threshold",
                    "logit_softcap", "max_len")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
