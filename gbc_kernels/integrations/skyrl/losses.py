"""SkyRL 0.3.0's registered policy losses as :class:`gbc_kernels.PolicyLossConfig` (the table,
docs/skyrl.md): :func:`policy_loss_config` maps SkyRL's ``trainer.algorithm`` config,
:func:`policy_loss_inputs` its per-token inputs (off-policy correction, the SFT loss's
weights), :func:`skyrl_loss_metrics` its loss metrics by its own function.

SkyRL applies its ``loss_reduction`` to the advantages before the worker
(``apply_loss_reduction_to_advantages_minibatch``); its registered loss is the masked SUM of the
per-token loss (``reduce_loss``), which gbc reproduces as ``token-mean`` over one "token"
(``num_items_in_batch=1``, a call input: the KL and entropy terms keep their own means).
"""

from __future__ import annotations

from typing import Optional

import torch

import gbc_kernels as gbc
from gbc_kernels import methods

# SkyRL's ``policy_loss_type`` -> the axes of gbc's table. The token-level losses that clip
# through ``safe_exp_delta`` clamp the log-ratio at +-20.
_CLAMP = dict(log_ratio_clamp=20.0)
SKYRL_LOSS_TYPES = {
    "regular": dict(objective="ppo_clip", **_CLAMP),
    "dual_clip": dict(objective="ppo_clip", **_CLAMP),
    "sapo": dict(objective="sapo", **_CLAMP),
    "gspo": dict(objective="ppo_clip", importance_sampling_level="sequence_token"),
    "cispo": dict(objective="cispo", **_CLAMP),
    "clip_cov": dict(objective="ppo_clip", cov_mode="clip"),
    "kl_cov": dict(objective="unclipped", cov_mode="kl"),
    "importance_sampling": dict(objective="unclipped"),
    # the SFT loss -logp: REINFORCE with the loss mask's weights as the "advantages"
    "cross_entropy": dict(objective="reinforce"),
}
# what gbc refuses, and why (SkyRL's name)
SKYRL_REFUSED = {
    "rollout_is": "its weight is the ratio to the rollout log-probs, zeroed outside "
                  "(1 - eps_clip_low, 1 + eps_clip_high); gbc's objectives clamp (cispo) or "
                  "bound p - p_old (dppo), none zeroes by the ratio",
    "dppo": "its value is -A r on the trust region (gradient through r); gbc's dppo is "
            "-A sg(r) logp, the same gradient with another value",
}
# a loss type's own options: (SkyRL's option under trainer.algorithm, gbc's field); the values
# of cispo's two offsets enter as 1 + high and 1 - low
LOSS_OPTIONS = {
    "regular": [("eps_clip_low", "epsilon_low"), ("eps_clip_high", "epsilon_high")],
    "dual_clip": [("eps_clip_low", "epsilon_low"), ("eps_clip_high", "epsilon_high"),
                  ("clip_ratio_c", "clip_ratio_c")],
    "gspo": [("eps_clip_low", "epsilon_low"), ("eps_clip_high", "epsilon_high")],
    "clip_cov": [("eps_clip_low", "epsilon_low"), ("eps_clip_high", "epsilon_high"),
                 ("clip_cov.clip_ratio", "cov_ratio"), ("clip_cov.clip_cov_lb", "cov_lb"),
                 ("clip_cov.clip_cov_ub", "cov_ub")],
    "kl_cov": [("kl_cov.kl_cov_frac", "cov_ratio"), ("kl_cov.ppo_kl_coef", "cov_kl_coef")],
    "sapo": [("sapo.tau_pos", "sapo_temperature_pos"), ("sapo.tau_neg", "sapo_temperature_neg")],
    "cispo": [("cispo.cispo_eps_clip_high", "epsilon_high"),
              ("cispo.cispo_eps_clip_low", "cispo_min")],
}
# SkyRL's kl_estimator_type -> gbc's kl_estimator (SkyRL's k3 clamps the log-ratio at 20 and the
# value at 10: gbc's low_var_kl)
SKYRL_KL_TYPES = {"k1": "k1", "k2": "k2", "k3": "low_var_kl", "abs": "abs"}
# the losses that run SkyRL's off-policy correction (apply_off_policy_correction)
OFF_POLICY_CORRECTED = ("regular", "dual_clip", "sapo", "gspo", "cispo")
SKYRL_LOSS_REDUCTIONS = ("token_mean", "token_mean_legacy", "sequence_mean",
                         "seq_mean_token_sum_norm", "prompt_mean")


def get(config, path: str, default=None):
    """``config.a.b`` for ``path="a.b"`` (a dataclass, an OmegaConf node or a dict)."""
    for key in path.split("."):
        if config is None:
            return default
        config = config.get(key, default) if isinstance(config, dict) or (
            hasattr(config, "get") and not hasattr(config, "__dataclass_fields__")) \
            else getattr(config, key, default)
    return config


def _bool(algorithm, name):
    v = get(algorithm, name, False)
    if not isinstance(v, bool):
        raise ValueError(f"trainer.algorithm.{name}: expected a bool, got "
                         f"{type(v).__name__} {v!r}")
    return v


def check_skyrl_version(version=None) -> str:
    """SkyRL's installed version, refused by name unless ``releases.TESTED["skyrl"]``:
    :func:`gbc_kernels.integrations.skyrl.enable` checks it before it patches anything, and the
    Megatron worker processes where they load gbc's head (:func:`.megatron.patch_wrapper`, the
    wrapper's config check), also when they were not started through ``enable()``."""
    from gbc_kernels.integrations.releases import check_release

    return check_release("skyrl", version,
                         why="gbc subclasses its FSDP and Megatron workers and patches its "
                             "trainer, which change between releases",
                         off="leave enable() out to run SkyRL's own workers")


def sample_support_replay(algorithm) -> bool:
    """Whether SkyRL 0.4's ``trainer.algorithm.enable_sample_support_replay`` is on."""
    return _bool(algorithm, "enable_sample_support_replay")


def skyrl_replays_support() -> bool:
    """Whether the installed SkyRL replays the sampler's support (from 0.4: its
    ``sample_support_replay`` module, the ``rollout_sample_support`` field)."""
    from gbc_kernels.integrations import releases

    version = releases.installed("skyrl")
    return version is not None and releases._patch(version) >= (0, 4, 0)


def check_algorithm(algorithm, strategy: str = "fsdp"):
    """Refuse, by SkyRL's option, what SkyRL 0.4 added to ``trainer.algorithm`` that changes the
    log-probs themselves and gbc does not run: ``enable_sample_support_replay`` (the policy's
    log-probs renormalised over the sampler's recorded top-k/top-p support, not the whole
    vocabulary) where the installed SkyRL has no support to replay (0.3). gbc's FSDP and
    Megatron workers replay it (docs/skyrl.md "The sampler's support"); ``strategy`` is kept
    for the callers."""
    del strategy
    if not sample_support_replay(algorithm):
        return
    if not skyrl_replays_support():
        raise ValueError("trainer.algorithm.enable_sample_support_replay=true: the installed "
                         "SkyRL records no rollout_sample_support for gbc's workers to replay "
                         "(SkyRL 0.4 adds it, and gbc's FSDP and Megatron workers replay it "
                         "there); set it to false")


def policy_loss_config(algorithm, loss_type: Optional[str] = None,
                       kl_entropy_weight: Optional[float] = None,
                       **gbc_options) -> "gbc.PolicyLossConfig":
    """The config that reproduces SkyRL 0.3.0's registered policy loss ``loss_type`` (default:
    ``algorithm.policy_loss_type``) for ``algorithm`` (SkyRL's ``trainer.algorithm``: its
    ``AlgorithmConfig``, an OmegaConf node or a dict), on the advantages as SkyRL passes them
    (its loss reduction already applied). ``kl_entropy_weight = w``: also the worker's KL and
    entropy terms (``use_kl_loss``, ``use_entropy_loss``) times ``w`` — the worker's micro-batch
    loss is ``dp_size`` times this config's loss with ``w = microbatch_weight / dp_size``.
    ``gbc_options``: gbc fields on top (``ar_alpha``, ``lopti_eta``). A value or a loss gbc
    cannot honour: a ValueError naming SkyRL's option."""
    loss_type = get(algorithm, "policy_loss_type", "regular") if loss_type is None else loss_type
    if loss_type in SKYRL_REFUSED:
        raise ValueError(f"trainer.algorithm.policy_loss_type={loss_type!r}: not reproduced by "
                         f"gbc ({SKYRL_REFUSED[loss_type]}); gbc reproduces "
                         f"{tuple(SKYRL_LOSS_TYPES)}")
    if loss_type not in SKYRL_LOSS_TYPES:
        raise ValueError(f"trainer.algorithm.policy_loss_type: gbc reproduces SkyRL's "
                         f"{tuple(SKYRL_LOSS_TYPES)}, got {loss_type!r}")
    if loss_type == "cispo" and get(algorithm, "cispo.cispo_anchor", "old") != "old":
        raise ValueError(f"trainer.algorithm.cispo.cispo_anchor="
                         f"{get(algorithm, 'cispo.cispo_anchor')!r}: gbc's cispo anchors the "
                         f"ratio on the old policy's log-probs (SkyRL's default 'old'), which "
                         f"AR and Lopti read as p_old too; set cispo_anchor='old'")
    names = {}
    opts = dict(SKYRL_LOSS_TYPES[loss_type])
    for option, field in LOSS_OPTIONS.get(loss_type, ()):
        value = get(algorithm, option)
        methods.finite_number(f"trainer.algorithm.{option}", value, kind="a finite number")
        if loss_type == "cispo":
            value = 1.0 + value if field == "epsilon_high" else 1.0 - value
        opts[field] = value
        names[field] = f"trainer.algorithm.{option}={get(algorithm, option)!r}"
    # reduce_loss, the masked sum: token-mean over num_items_in_batch=1 (policy_loss_inputs)
    opts["loss_agg"] = "token-mean"
    if kl_entropy_weight is not None:
        w = methods.finite_number("kl_entropy_weight", kl_entropy_weight, 0.0)
        if _bool(algorithm, "use_kl_loss") and loss_type != "cross_entropy":
            kl_type = get(algorithm, "kl_estimator_type", "k3")
            if kl_type not in SKYRL_KL_TYPES:
                raise ValueError(f"trainer.algorithm.kl_estimator_type: expected one of "
                                 f"{tuple(SKYRL_KL_TYPES)}, got {kl_type!r}")
            coef = methods.finite_number("trainer.algorithm.kl_loss_coef",
                                         get(algorithm, "kl_loss_coef", 0.001))
            # masked_mean(kl, loss_mask, dim=-1).mean(): the mean over the rows of the call
            opts.update(kl_coef=coef * w, kl_estimator=SKYRL_KL_TYPES[kl_type],
                        kl_agg="seq-mean-token-mean", seq_count="rows")
            names["kl_coef"] = f"trainer.algorithm.kl_loss_coef={coef!r}"
        if _bool(algorithm, "use_entropy_loss") and loss_type != "cross_entropy":
            coef = methods.finite_number("trainer.algorithm.entropy_loss_coef",
                                         get(algorithm, "entropy_loss_coef", 0.01))
            opts.update(entropy_coef=coef * w, entropy_agg="token-mean")
            names["entropy_coef"] = f"trainer.algorithm.entropy_loss_coef={coef!r}"
    opts.update(gbc_options)
    for field in gbc_options:
        names.pop(field, None)
    try:
        return gbc.PolicyLossConfig(**opts)
    except (ValueError, TypeError) as err:
        raise methods.in_trainer_words(err, names) from None


def policy_loss_inputs(algorithm, loss_type, loss_mask, advantages, old_log_probs,
                       rollout_logprobs=None):
    """``(inputs, metrics)``: gbc's loss keywords ``mask``, ``advantages``, ``old_logp``,
    ``is_ratio``, ``num_items_in_batch`` (1: SkyRL's sum) from SkyRL's per-token inputs: the
    policy mask (bool), the SFT loss's weights as its advantages
    (``cross_entropy``: ``-logp * loss_mask`` summed), and SkyRL's off-policy correction (its
    own ``compute_off_policy_correction``: the TIS ratio times the masks it applies, as
    ``is_ratio``; its metrics) for the losses that apply it. An RL loss with a fractional
    ``loss_mask`` is refused."""
    if loss_type == "cross_entropy":
        dtype = torch.float32 if old_log_probs is None else old_log_probs.dtype
        return _inputs(loss_mask != 0, loss_mask.to(dtype), old_log_probs, None), {}
    if gbc.value_checks_enabled() and bool(((loss_mask != 0) & (loss_mask != 1)).any()):
        raise ValueError(f"loss_mask: gbc's RL loss takes a 0/1 loss mask "
                         f"(trainer.algorithm.policy_loss_type={loss_type!r}); got weights")
    mask, is_ratio, metrics = loss_mask.bool(), None, {}
    if rollout_logprobs is not None and loss_type in OFF_POLICY_CORRECTED:
        from skyrl.backends.skyrl_train.utils.off_policy_correction_utils import (
            compute_off_policy_correction)

        tis, metrics, new_mask = compute_off_policy_correction(
            old_log_probs, rollout_logprobs, loss_mask, get(algorithm, "off_policy_correction"))
        weight = new_mask.to(old_log_probs.dtype)
        if tis is not None:
            weight = weight * tis.detach()
        is_ratio = weight
    return _inputs(mask, advantages, old_log_probs, is_ratio), metrics


def _inputs(mask, advantages, old_logp, is_ratio):
    return dict(mask=mask, advantages=advantages, old_logp=old_logp, is_ratio=is_ratio,
                num_items_in_batch=1.0)


@torch.no_grad()
def skyrl_loss_metrics(algorithm, loss_type, log_probs, old_log_probs, advantages, loss_mask,
                       rollout_logprobs=None) -> dict:
    """SkyRL's loss metrics (``clip_ratio``, the off-policy correction's, ...) by its own
    registered loss on the detached log-probs; the random state is left as it was (Clip-Cov
    draws tokens)."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    with torch.random.fork_rng(devices=[]):
        _, metrics = PolicyLossRegistry.get(loss_type)(
            log_probs.detach(), old_log_probs, advantages, config=algorithm,
            loss_mask=loss_mask, rollout_logprobs=rollout_logprobs)
    return metrics
