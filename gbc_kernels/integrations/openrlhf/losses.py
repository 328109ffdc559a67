"""OpenRLHF's arguments as gbc's: its actor loss's options as a ``PolicyLossConfig``
(:func:`policy_loss_config`), its batch normalisers, its train/rollout importance-sampling
correction, and the drop-in's own options (:data:`ENV_OPTIONS`, :func:`parse_options`,
:func:`split_options`); docs/openrlhf.md.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

import gbc_kernels as gbc
from gbc_kernels import methods


POLICY_LOSS_TYPES = ("ppo", "gspo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_LEVELS = ("off", "token", "seq")


def _get(ns, path, default=None):
    """``args.actor.dual_clip`` as ``_get(args, "actor.dual_clip")`` (namespaces or dicts)."""
    for part in path.split("."):
        ns = ns.get(part) if isinstance(ns, dict) else getattr(ns, part, None)
        if ns is None:
            return default
    return ns


# gbc's field -> the OpenRLHF option it comes from (errors name the option the user set)
OPTION_NAMES = {"epsilon_low": "actor.eps_clip_low_high", "epsilon_high": "actor.eps_clip_low_high",
                "clip_ratio_c": "actor.dual_clip", "kl_coef": "algo.kl.init_coef",
                "entropy_coef": "actor.entropy_coef", "temperature": "temperature"}


def policy_loss_config(args, kl_coef: Optional[float] = None, temperature: float = 1.0,
                       **gbc_options) -> "gbc.PolicyLossConfig":
    """The config of OpenRLHF's actor loss for its parsed ``args`` (docs/openrlhf.md);
    ``kl_coef``: the step's ``kl_ctl`` (default ``algo.kl.init_coef``); ``gbc_options``: more
    gbc fields. A bad value is refused naming OpenRLHF's option."""
    plt = _get(args, "actor.policy_loss_type", "ppo")
    if plt not in POLICY_LOSS_TYPES:
        raise ValueError(f"actor.policy_loss_type: gbc reproduces OpenRLHF's {POLICY_LOSS_TYPES}, "
                         f"got {plt!r}")
    e = _get(args, "actor.eps_clip", 0.2)
    eps = _get(args, "actor.eps_clip_low_high", (e, e))
    if isinstance(eps, (str, bytes)) or not hasattr(eps, "__len__") or len(eps) != 2:
        raise ValueError(f"actor.eps_clip_low_high: expected a pair (low, high) of floats, got "
                         f"{eps!r}")
    agg_mode = _get(args, "actor.loss_agg_mode", "token-mean")
    if agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"actor.loss_agg_mode: expected one of {LOSS_AGG_MODES}, got "
                         f"{agg_mode!r}")
    # the values are checked by PolicyLossConfig, its errors renamed to OpenRLHF's options
    opts = dict(epsilon_low=eps[0], epsilon_high=eps[1], temperature=temperature,
                clip_ratio_c=_get(args, "actor.dual_clip"))
    if plt == "ppo":
        opts["loss_agg"] = agg_mode
    init = methods.finite_number("algo.kl.init_coef", _get(args, "algo.kl.init_coef", 0.0), 0.0)
    coef = init if kl_coef is None else methods.finite_number("kl_ctl", float(kl_coef), 0.0)
    if bool(_get(args, "algo.kl.use_loss", False)) and init > 0 and coef:
        est = _get(args, "algo.kl.estimator", "k1")
        if est not in KL_ESTIMATORS:
            raise ValueError(f"algo.kl.estimator: expected one of {KL_ESTIMATORS}, got {est!r}")
        unbiased = bool(_get(args, "algo.kl.unbiased_gradient", False))
        if unbiased and plt == "gspo" and _get(args, "algo.advantage.is_correction_level",
                                               "off") != "off":
            raise ValueError("algo.kl.unbiased_gradient: with actor.policy_loss_type='gspo' and "
                             "an is_correction_level, gbc measures GSPO's ratio against the "
                             "rollout log-probs, while OpenRLHF weights the KL gradient by the "
                             "ratio to the old ones: not expressible in one call")
        opts.update(kl_coef=coef, kl_estimator=est, kl_clamp=10.0,
                    kl_unbiased_gradient=unbiased, kl_agg="token-mean")
    ent = _get(args, "actor.entropy_coef")
    if ent:
        opts.update(entropy_coef=ent, entropy_agg="token-mean")
    elif ent is not None:
        opts["return_entropy"] = True          # OpenRLHF logs the entropy with a 0 coefficient
    opts.update(gbc_options)
    names = dict(OPTION_NAMES, kl_coef="kl_ctl" if kl_coef is not None else "algo.kl.init_coef")
    for field in gbc_options:           # a gbc option keeps gbc's name
        names.pop(field, None)
    try:
        return gbc.PolicyLossConfig.preset(f"openrlhf:{plt}", **opts)
    except (TypeError, ValueError) as exc:
        raise methods.in_trainer_words(exc, names) from None


def batch_normalisers(loss_batch_info: Optional[dict]) -> dict:
    """``num_items_in_batch`` / ``num_seqs_in_batch`` from OpenRLHF's ``loss_batch_info``:
    ``batch_num_tokens / dp_size``, ``global_batch_size / dp_size`` (None: the call's own)."""
    info = loss_batch_info or {}
    dp = info.get("dp_size") or 1
    return {ours: info[theirs] / dp for ours, theirs in (("num_items_in_batch", "batch_num_tokens"),
            ("num_seqs_in_batch", "global_batch_size")) if info.get(theirs) is not None}


def is_correction(args, old_log_probs, rollout_log_probs, action_mask):
    """OpenRLHF's train/rollout importance-sampling correction of ``PolicyLoss`` (``ppo`` only)
    as the fused loss's per-token ``is_ratio``: the gated statistic per token or sequence clamps
    (``clip``) or drops (``mask``) the ratio ``old / rollout``. Returns ``(is_ratio or None,
    metrics)`` (``vllm_kl``, ``is_filter_ratio``). No gradient."""
    level = _get(args, "algo.advantage.is_correction_level", "off")
    if level not in IS_LEVELS:
        raise ValueError(f"algo.advantage.is_correction_level: expected one of {IS_LEVELS}, got "
                         f"{level!r}")
    if level == "off" or _get(args, "actor.policy_loss_type", "ppo") != "ppo":
        return None, {}
    if rollout_log_probs is None:
        raise ValueError("rollout_log_probs: required with algo.advantage.is_correction_level="
                         f"{level!r}")
    mode = _get(args, "algo.advantage.is_correction_mode", "mask")
    gating = _get(args, "algo.advantage.is_correction_gating", "ratio")
    low, high = _get(args, "algo.advantage.is_correction_threshold", (0.5, 5.0))
    m = action_mask.to(old_log_probs.dtype)

    def mmean(x, dim=None):
        return (x * m).sum(dim=dim) / m.sum(dim=dim)

    with torch.no_grad():
        is_log, seq = old_log_probs - rollout_log_probs, level == "seq"
        token_is = is_log.exp()
        if gating == "ratio":                # at seq level: the ratio's geometric mean
            stat = (mmean(is_log, -1).unsqueeze(-1) if seq else is_log).exp()
        else:
            p, q = (x.exp().clamp(1e-6, 1 - 1e-6) for x in (rollout_log_probs, old_log_probs))
            stat = (p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
                    if gating == "binary_kl" else (p - q).abs())
            stat = mmean(stat, -1).unsqueeze(-1) if seq else stat
        if mode == "clip":
            coef, filtered = stat.clamp(min=low, max=high), (stat < low) | (stat > high)
        else:
            keep = (stat >= low) & (stat <= high)
            coef, filtered = torch.where(keep, token_is, torch.zeros_like(token_is)), ~keep
        coef = coef.expand_as(old_log_probs)
        frac = filtered.float().mean() if seq else mmean(filtered.float())
        vllm_kl = mmean(rollout_log_probs - old_log_probs)
    return coef, {"vllm_kl": vllm_kl, "is_filter_ratio": frac}


ENV_OPTIONS = "GBC_OPENRLHF_OPTIONS"
METHOD_OPTIONS = tuple(f.name for f in dataclasses.fields(methods.MethodOptions))

# the sampler's kept set (support=replay / kept_mass, docs/openrlhf.md): OpenRLHF 0.11.2 pins
# vLLM 0.29.0, whose Triton sampler (>= 8 rows a step) keeps exactly k at a top-k tie, lowest
# ids first; OpenRLHF never sets a top-k, so the rule has nothing to act on
SUPPORT_TIES = "first"


def rollout_truncation(args, options: "methods.MethodOptions", temperature=None):
    """The :class:`gbc_kernels.SamplerTruncation` of OpenRLHF's rollout (``args.rollout.top_p``;
    0.11.2 sends vLLM no top-k and no min-p) when ``options.support`` is on, else None.
    ``temperature``: the pass's (the actor's), refused unless it is ``rollout.temperature``
    (where set). No truncation (``rollout.top_p`` 1, OpenRLHF's default) or a bad top-p is
    refused naming ``support`` and ``rollout.top_p``."""
    mode = options.support
    if mode is None:
        return None
    top_p = _get(args, "rollout.top_p", 1.0)
    if isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and top_p == 1.0:
        raise ValueError(f"support={mode}: rollout.top_p is {top_p!r} and OpenRLHF 0.11.2 sends "
                         f"vLLM no top_k or min_p: the sampler kept the whole vocabulary, there "
                         f"is no kept set to rebuild and nothing to correct; unset support or "
                         f"roll out with --rollout.top_p < 1")
    try:
        tr = methods.sampler_truncation(options, top_k=None, top_p=top_p, min_p=0.0,
                                        rule="vllm", ties=SUPPORT_TIES)
    except (TypeError, ValueError) as exc:
        text = str(exc).replace(f"support={mode}: top_p:", f"support={mode}: rollout.top_p:")
        raise ValueError(text) from None
    want = _get(args, "rollout.temperature")
    if temperature is not None and want is not None and float(want) != float(temperature):
        raise ValueError(f"support={mode}: the actor's temperature {float(temperature)!r} is not "
                         f"rollout.temperature {float(want)!r} (the sampler's): the kept set is "
                         f"rebuilt at the rollout temperature")
    return tr


def check_support_ties(options: "methods.MethodOptions") -> None:
    """``support_ties`` is refused by name: OpenRLHF 0.11.2 rolls out without top-k."""
    if options.support_ties is not None:
        raise ValueError(f"support_ties={options.support_ties}: OpenRLHF 0.11.2 rolls out "
                         f"without top-k (vLLM's SamplingParams get top_k=-1), so the top-k tie "
                         f"rule has nothing to act on (ties at the top-p cut keep the lowest ids "
                         f"first, as vLLM 0.29's Triton sampler); unset it")


def parse_options(text: Optional[str]) -> dict:
    """:data:`ENV_OPTIONS`'s ``"lopti_eta=0.5,nthr=true"`` -> keyword options (a method option
    typed as ``GBC_VERL_OPTIONS`` types it, :data:`gbc_kernels.methods.OPTION_KINDS`)."""
    words = {"none": None, "null": None, "true": True, "false": False}
    out = {}
    for name, value in methods.parse_items(text, ENV_OPTIONS).items():
        if name in methods.OPTION_KINDS:
            kind, what = methods.OPTION_KINDS[name]
            try:
                out[name] = kind(value)
            except ValueError:
                raise ValueError(f"{ENV_OPTIONS}: {name} expects {what}, got {value!r}") from None
            continue
        try:
            out[name] = words[value.lower()] if value.lower() in words else (
                int(value) if value.lstrip("+-").isdigit() else float(value))
        except ValueError:
            out[name] = value
    return out


def split_options(options: dict):
    """``enable``'s options -> ``(MethodOptions, other PolicyLossConfig fields)``, validated."""
    loss_fields = {f.name for f in dataclasses.fields(gbc.PolicyLossConfig)}
    method_kw = {k: v for k, v in options.items() if k in METHOD_OPTIONS}
    loss_kw = {k: v for k, v in options.items() if k not in METHOD_OPTIONS}
    for name in loss_kw:
        if name not in loss_fields:
            raise ValueError(f"{name}: not an option of the OpenRLHF drop-in (method options: "
                             f"{list(METHOD_OPTIONS)}; or a PolicyLossConfig field)")
        if name in ("temperature", "logit_softcap"):    # the no-grad passes would not see it
            raise ValueError(f"{name}: set on OpenRLHF's actor / model (its old-policy and "
                             f"reference passes use it too), not through enable()")
    opts = methods.MethodOptions.from_kwargs(support_ok=True, **method_kw)
    check_support_ties(opts)
    if opts.support == "replay" and opts.nthr:
        raise ValueError("nthr: not with support=replay (NTHR's scales take the sampler's "
                         "recorded ids, support_ids, not a kept set rebuilt from the sampling "
                         "settings); use support=kept_mass or unset one of them")
    gbc.PolicyLossConfig(**loss_kw, **opts.loss_options())           # validates the rest
    return opts, loss_kw
