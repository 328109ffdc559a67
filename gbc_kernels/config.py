"""PolicyLossConfig: every non-tensor option of the GRPO policy loss (SPEC §1-§3)."""

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

    def __post_init__(self):
        agg = LOSS_AGG_ALIASES.get(self.loss_agg, self.loss_agg)
        if agg not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg: expected one of {LOSS_AGG_MODES + tuple(LOSS_AGG_ALIASES)},"
                             f" got {self.loss_agg!r}")
        object.__setattr__(self, "loss_agg", agg)
        if agg == "seq-mean-token-sum-norm" and (self.max_len is None or self.max_len <= 0):
            raise ValueError("max_len: loss_agg='seq-mean-token-sum-norm' (dr_grpo) needs a "
                             f"positive max_len, got {self.max_len!r}")
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
