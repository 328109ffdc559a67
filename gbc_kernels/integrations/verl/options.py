"""What verl's engine side and trainer side share (:mod:`.engine`, :mod:`.trainer`): the
options (``GBC_VERL_OPTIONS``) and the batch keys the passes exchange, the support plan of the
rollout config, and the switch's state (the options in force, the patches). Both import it;
neither imports the other at load time.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

import gbc_kernels as gbc
from gbc_kernels import methods
from gbc_kernels.integrations import patching

ENV_ON = "GBC_VERL_ENGINE"
ENV_OPTIONS = "GBC_VERL_OPTIONS"


@dataclasses.dataclass(frozen=True)
class EngineOptions(methods.MethodOptions):
    """gbc's options in verl's engines (``GBC_VERL_OPTIONS``, read by :func:`enable`): the
    method options (:class:`gbc_kernels.methods.MethodOptions`) and the ``backend``."""

    backend: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        if self.backend not in gbc.BACKENDS:
            raise ValueError(f"backend: expected one of {gbc.BACKENDS}, got {self.backend!r}")

    @classmethod
    def parse(cls, text: Optional[str]) -> "EngineOptions":
        """``"ar_alpha=0.3,lopti_eta=0.5"`` -> options (errors naming ``GBC_VERL_OPTIONS``).
        ``support`` / ``support_ties`` run in gbc's engines (:func:`support_plan`)."""
        return super().parse(text, ENV_OPTIONS, support_ok=True)


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(EngineOptions))

# fields gbc adds to verl's batches (padded [B, T] like ``advantages``) and its pass flags
SCALE_KEY = "gbc_token_scale"          # NTHR's per-token advantage scale
KL_WEIGHT_KEY = "gbc_kl_weight"        # critical-token KL weights
CERTAINTY_KEY = "gbc_critical_kl"      # reference pass: the critical-KL options (a dict)
NTHR_ROW_KEY = "gbc_row"               # NTHR's pass: each sample's row of the update batch
# verl's loss modes that pick tokens from the whole batch (Clip-Cov at random, KL-Cov by
# covariance rank): not reproduced where each rank's loss sees part of every sequence
BATCH_SELECTING_MODES = ("clip_cov", "kl_cov")
CRITICAL_KL_FIELDS = ("critical_kl_exponent", "critical_kl_intercept", "critical_kl_certainty",
                      "critical_kl_temperature")
# what the trainer's reference pass hands the worker: critical-KL's options and the head's mode
REFERENCE_PASS_FIELDS = CRITICAL_KL_FIELDS + ("logits_dtype",)
LOG_KEPT_MASS_KEY = "gbc_log_kept_mass"   # the old-policy pass: LSE_S - LSE_V per token
# one kept set per rollout: the old-policy pass's kept ids, which verl's batch carries to the
# reference pass and the update (padded [B, T, K] in the legacy trainer's batch, -1 padded;
# the worker's output and the v1 trainer's transfer queue: nested per sequence, like
# log_probs); REF_KEY: the engine's per-token row of the ids it built, inside one pass only
SUPPORT_IDS_KEY = "gbc_support_ids"
SUPPORT_REF_KEY = "gbc_support_ids_row"


# ------------------------------------------------- the sampler's kept set, rebuilt (issue 61)
ROLLOUT = "actor_rollout_ref.rollout"
VLLM_LOGPROBS_MODE = "processed_logprobs"
# vLLM 0.24.0 (verl 0.9.1's pin) samples top-k with its Triton kernel (exactly k, lowest ids
# first) at >= 8 rows an engine step, with its PyTorch rule (every tie kept) below
DEFAULT_TIES = "first"


@dataclasses.dataclass(frozen=True)
class SupportPlan:
    """What ``support=replay|kept_mass`` asks of gbc's engines and of verl's trainer, built by
    :func:`support_plan` from the rollout's sampling settings (docs/verl.md, "The sampler's
    kept set"). ``normalised``: the rollout's log-probs are normalised over the kept set
    (vLLM's ``processed_logprobs``), not the full vocabulary's (SGLang's)."""

    mode: str
    truncation: gbc.SamplerTruncation
    normalised: bool
    rollout: str
    one_set: bool = False

    @property
    def said(self) -> str:
        """The options as the user set them, for errors."""
        if self.mode != "replay":
            return f"{ENV_OPTIONS} support={self.mode}"
        return (f"{ENV_OPTIONS} support=replay with support_set="
                + ("rollout (the default)" if self.one_set else "per_pass"))

    @property
    def corrects_sampler(self) -> bool:
        """Whether verl's rollout correction takes the old-policy pass's ``log_kept_mass``
        (``kept_mass``; ``replay`` against SGLang's full-vocabulary log-probs)."""
        return self.mode == "kept_mass" or not self.normalised

    def scored_kwargs(self, ids=None, what: str = "this pass") -> dict:
        """The update's and the reference pass's support: under ``replay`` the old-policy
        pass's kept set ``ids`` (``[B, T, K]``, one set per rollout: refused when the batch
        brought none) or the set rebuilt from the model this pass scores (``per_pass``); the
        full vocabulary under ``kept_mass``. ``what``: the pass, for the refusal."""
        if self.mode != "replay":
            return {}
        if not self.one_set:
            return {"sampler_truncation": self.truncation}
        if ids is None:
            raise ValueError(
                f"{self.said}: {what} scores the kept set verl's old-policy pass built, and its "
                f"batch has no {SUPPORT_IDS_KEY!r} field; gbc's actor engine adds it in that "
                f"pass (compute_log_prob with entropy) and verl's batch carries it to the "
                f"reference pass and the update: run the old-policy pass first (algorithm."
                f"rollout_correction.bypass_mode=False, GBC_VERL_ENGINE and the same "
                f"{ENV_OPTIONS} in every worker), or set support_set=per_pass in {ENV_OPTIONS} "
                f"(each pass rebuilds the set from the model it scores)")
        return {"support_ids": ids}

    def old_pass_kwargs(self) -> dict:
        """The old-policy pass: over the rebuilt set (``replay``; one set per rollout: its ids
        returned, ``return_support_ids``) or the full vocabulary's numbers bit for bit
        (``kept_mass``: ``over_support=False``), with ``log_kept_mass`` where the rollout
        correction takes it."""
        if self.mode == "replay":
            return dict(sampler_truncation=self.truncation,
                        return_log_kept_mass=self.corrects_sampler,
                        **({"return_support_ids": True} if self.one_set else {}))
        return dict(sampler_truncation=self.truncation, over_support=False,
                    return_log_kept_mass=True)


def _cfg(config, name, default=None):
    if config is None:
        return default
    if hasattr(config, "get"):
        return config.get(name, default)
    return getattr(config, name, default)


def support_plan(options, rollout, tensor_parallel=()) -> Optional[SupportPlan]:
    """``support`` / ``support_ties`` of ``options`` against verl's rollout config ``rollout``
    (``actor_rollout_ref.rollout``: ``name``, ``top_k``, ``top_p``, ``logprobs_mode``,
    ``calculate_log_probs``; verl has no ``min_p``): None when ``support`` is off, else the
    :class:`SupportPlan`. ``tensor_parallel``: ``(verl's option, size)`` of each Megatron
    engine that scores under vocab parallelism. Refused by name, in verl's words: a rollout
    that is neither vLLM nor SGLang, vLLM log-probs other than ``processed_logprobs``,
    ``kept_mass`` against SGLang's full-vocabulary log-probs, settings that truncate nothing,
    top-p without a top-k bound under tensor parallelism."""
    if options.support is None:
        if options.support_ties is not None:
            raise ValueError(f"{ENV_OPTIONS}: support_ties={options.support_ties}: set without "
                             f"support (replay or kept_mass); set support too, or unset "
                             f"support_ties")
        return None
    said = f"{ENV_OPTIONS} support={options.support}"
    name = _cfg(rollout, "name")
    if name not in ("vllm", "sglang"):
        raise ValueError(f"{ROLLOUT}.name={name!r}: {said} rebuilds the kept set by vLLM's or "
                         f"SGLang's sampling rule; roll out with vllm or sglang, or unset "
                         f"support")
    normalised = name == "vllm"
    mode = _cfg(rollout, "logprobs_mode", VLLM_LOGPROBS_MODE)
    if normalised and _cfg(rollout, "calculate_log_probs", False) and mode != VLLM_LOGPROBS_MODE:
        raise ValueError(f"{ROLLOUT}.logprobs_mode={mode}: {said} compares the policy with "
                         f"vLLM's {VLLM_LOGPROBS_MODE} (after temperature and top-k/top-p, "
                         f"normalised over the kept set); {mode} is not that (raw_*: before "
                         f"temperature and truncation, vLLM's default when unset; *_logits: not "
                         f"log-probs); set {ROLLOUT}.logprobs_mode="
                         f"{VLLM_LOGPROBS_MODE}, or unset support")
    if not normalised and options.support == "kept_mass":
        raise ValueError(f"{said}: {ROLLOUT}.name=sglang returns the full vocabulary's log-probs "
                         f"(it ignores logprobs_mode), so verl's rollout correction has no "
                         f"kept-mass bias to correct; use support=replay (SGLang's log-probs "
                         f"moved onto the kept set by log_kept_mass) or unset support")
    k, p = _cfg(rollout, "top_k", -1), _cfg(rollout, "top_p", 1.0)
    p = 1.0 if p is None else p
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
        raise ValueError(f"{ROLLOUT}.top_p={p!r}: expected a float in (0, 1] ({said})")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
        raise ValueError(f"{ROLLOUT}.top_k={k!r}: expected an int (-1 or 0: no bound) "
                         f"({said})")
    bound = k is not None and k > 0
    if not bound and p >= 1.0:
        raise ValueError(f"{said}: {ROLLOUT}.top_k={k} and top_p={p}: the rollout samples "
                         f"without truncation (verl has no min_p), the sampler kept the whole "
                         f"vocabulary and there is nothing to correct; unset support, or "
                         f"sample with {ROLLOUT}.top_k / top_p")
    for option, size in tensor_parallel:
        if int(size or 1) > 1 and not bound and p < 1.0:
            raise ValueError(f"{ROLLOUT}.top_p={p} without a top_k bound ({ROLLOUT}.top_k={k})"
                             f": under Megatron's tensor parallelism ({option}={size}, the "
                             f"vocabulary sharded) gbc rebuilds the top-p cut only below a "
                             f"top-k bound (each shard's top candidates merged; the cut over "
                             f"the whole vocabulary needs every shard's order); set "
                             f"{ROLLOUT}.top_k too, set {option}=1, or unset {said}")
    tr = methods.sampler_truncation(options, k, p, 0.0, rule=name, ties=DEFAULT_TIES,
                                    names={"support": said, "top_k": f"{ROLLOUT}.top_k",
                                           "top_p": f"{ROLLOUT}.top_p"})
    return SupportPlan(options.support, tr, normalised, name, options.one_set_per_rollout)


def padded_support_ids(ids, data):
    """The old-policy pass's kept ids as the worker returns them (nested per sequence like
    ``log_probs``, ``[B, j, K]``) -> the trainer's padded ``[B, T, K]`` int32 (``-1`` padded),
    by verl's ``no_padding_2_padding`` on ``data`` (the pass's no-padding batch)."""
    from verl.workers.utils.padding import no_padding_2_padding

    values = ids.values() if ids.is_nested else ids
    return (no_padding_2_padding(values.int() + 1, data) - 1).to(torch.int32)


def _check_nthr(options, plan):
    if plan is not None and plan.mode == "replay" and options.nthr:
        raise ValueError(f"{ENV_OPTIONS}: nthr: NTHR's scores are the full vocabulary's; under "
                         f"support=replay the policy's log-probs are over the rebuilt kept set; "
                         f"use support=kept_mass with nthr, or unset one")


_OPTIONS = {}           # "current": the options in force; "plan": the trainer's checked plan
_PATCHES = patching.Patches()
_on_import = _PATCHES.on_import

