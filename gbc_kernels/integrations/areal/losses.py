"""AReaL 1.0.4's PPO actor options, as gbc's AReaL engine takes them (docs/areal.md).

AReaL's own loss functions (``areal.trainer.ppo.actor.grpo_loss_fn`` and what it calls) run
unchanged on gbc's log-probs, so every ``PPOActorConfig`` loss option is AReaL's by
construction. The method options (:class:`gbc_kernels.methods.MethodOptions`, the text of
``GBC_AREAL_OPTIONS``) act on the advantages that loss receives, the way the method layer
defines them for every objective (``methods.loss_advantages``: AR's weight
``alpha p_old + 1 - alpha`` and Lopti's split ``p_old < lopti_eta``, with
``p_old = exp(prox_logp)``, the policy the ratio is taken against; NTHR's token scales, from
the actor's own ``compute_logp`` pass, in the batch as ``gbc_nthr_scale``); critical-token KL
weights the KL term of AReaL's reward (the engine's ``compute_advantages``); what cannot run
inside AReaL's flow is refused by name here, before anything is built.
"""

from __future__ import annotations

import contextlib
import functools
import os

from gbc_kernels import methods

ENV = "GBC_AREAL"                      # set by enable(): gbc's engine is switched on
OPTIONS_ENV = "GBC_AREAL_OPTIONS"      # the method options, "ar_alpha=0.3,logits_dtype=float32"

KL_WEIGHT_KEY = "gbc_kl_weight"        # the reference pass's weights, in each trajectory
NTHR_ROW_KEY = "gbc_nthr_row"          # [g] int64 per trajectory: its rows in the actor's
                                       # compute_logp pass (pass id << 32 | row)
NTHR_SCALE_KEY = "gbc_nthr_scale"      # [g, S] float32: NTHR's token scales (1 off-selection)
REFERENCE_MARK = "_gbc_reference"      # set on AReaL's ref config by enable(config)
SAMPLER_ENV = "GBC_AREAL_SAMPLER"      # support=replay: the rollout's sampling settings, set by
                                       # enable(config) from its gconfig ("top_k=20,top_p=0.9,
                                       # min_p=0.0,ties=first,temperature=0.8")
LOG_KEPT_MASS_KEY = "gbc_log_kept_mass"   # [g, S] per trajectory: LSE_S - LSE_V of the actor's
                                          # compute_logp pass, aligned as its log-probs
SUPPORT_ROW_KEY = "gbc_support_row"    # [g, S] int64 per trajectory (support_set=rollout): each
                                       # token's row of the kept ids its building pass keeps,
                                       # pass id << 32 | 1 + row (0: none), aligned as the
                                       # log-probs; a [B, S] key, so AReaL's concatenation,
                                       # minibatch split, packing and padding carry it as they
                                       # carry the targets
NO_TOP_K = int(1e8)                    # AReaL's gconfig.top_k default: no bound (SGLang: -1)


def mark_reference(ref_config) -> None:
    """Mark AReaL's ``ref`` engine config: the engine built from it is the reference engine,
    whose ``compute_logp`` also gives critical-token KL's weights (``enable(config)`` does
    this; AReaL's trainer builds the reference engine from this very object)."""
    object.__setattr__(ref_config, REFERENCE_MARK, True)


def is_reference(config) -> bool:
    return bool(getattr(config, REFERENCE_MARK, False))


def trains(config) -> bool:
    """Whether an engine built from ``config`` updates its model: not the reference engine,
    and an optimizer configured (AReaL's reference and teacher engines, ``PPOActorConfig``s
    too, have none: their ``train_batch`` cannot run). Only such an engine's loss options are
    checked, and only it keeps NTHR's rows."""
    return config is None or (not is_reference(config)
                              and getattr(config, "optimizer", None) is not None)


def check_critical_kl(experiment, options: methods.MethodOptions) -> None:
    """Critical-token KL in AReaL weights the KL term of its reward, ``-kl_ctl *
    kl_estimator(old_logp, ref_logp)`` per token in ``compute_advantages``, by the reference
    pass's certainty weights, which travel in the trajectories from the reference engine's
    ``compute_logp`` to the actor's ``compute_advantages``. Refused, naming what is missing,
    without AReaL's experiment config (``enable(config, ...)``: its ``ref`` section marks the
    reference engine), without a KL term (``actor.kl_ctl > 0`` and a ``ref`` config: AReaL
    builds no reference engine otherwise), or under AReaL's single controller (its workers get
    the trajectories serialised, so the weights would not come back)."""
    if options.critical_kl_exponent is None:
        return
    name = f"{OPTIONS_ENV}: critical_kl_exponent={options.critical_kl_exponent}"
    actor = getattr(experiment, "actor", None)
    if experiment is None or actor is None or not hasattr(experiment, "ref"):
        raise ValueError(f"{name} needs enable(config, ...) with AReaL's experiment config "
                         "(its ref section is the reference engine whose pass gives the "
                         "certainty weights)")
    if experiment.ref is None or not _cfg(actor, "kl_ctl", 0.0):
        raise ValueError(f"{name}: AReaL's reward has no KL term to weight (set actor.kl_ctl "
                         "> 0 and a ref config)")
    from areal.utils.environ import is_single_controller

    if is_single_controller():
        raise ValueError(f"{name}: the certainty weights travel in the trajectories from the "
                         "reference engine to the actor, which AReaL's single controller "
                         "serialises to its workers; run under AReaL's SPMD launcher "
                         "(AREAL_SPMD_MODE=1, python -m areal.infra.launcher.local)")


def options_from_env() -> methods.MethodOptions:
    """The method options of ``GBC_AREAL_OPTIONS`` (none set: every method off)."""
    return methods.MethodOptions.parse(os.environ.get(OPTIONS_ENV, ""), OPTIONS_ENV,
                                       support_ok=True)


# ------------------------------------------------------------ the sampler's kept set (issue 61)
def _support_name(options) -> str:
    return f"{OPTIONS_ENV}: support={options.support}"


def refuse_kept_mass(options: methods.MethodOptions) -> None:
    """``support=kept_mass`` in AReaL's words (what ``methods.corrected_sampler_logp`` refuses
    for full-vocabulary sampler log-probs); ``support_ties`` without a support mode."""
    if options.support == "kept_mass":
        raise ValueError(f"{_support_name(options)}: AReaL 1.0.4 rolls out with SGLang, whose "
                         "log-probs (the trajectories' logprobs, the behaviour policy's in the "
                         "decoupled loss's behave_imp_weight) are over the full vocabulary "
                         "already, as gbc's full-vocabulary policy is: the behaviour weight "
                         "has no kept-mass bias to correct; use support=replay (the policy, "
                         "proximal and reference log-probs over the rollout's kept set) or "
                         "unset it")
    if options.support is None and options.support_ties is not None:
        raise ValueError(f"{OPTIONS_ENV}: support_ties={options.support_ties}: the tie rule of "
                         "the rebuilt kept set, which only support=replay builds; set "
                         "support=replay or unset support_ties")


def _backend_name(section) -> str:
    spec = str(getattr(section, "backend", "") or "")
    return spec.split(":", 1)[0].strip().lower()


def sampler_settings(experiment, options: methods.MethodOptions):
    """``(SamplerTruncation, temperature)`` of AReaL's rollout under ``support=replay`` (None,
    None when support is off), from the experiment config's generation config ``gconfig``:
    ``top_k`` (``<= 0`` or AReaL's default ``1e8``: no bound), ``top_p``, ``min_p`` (AReaL
    1.0.4 has none: SGLang's 0), SGLang's joint rule, ties ``"first"`` (``support_ties``
    overrides). Refused by name: no experiment config; a rollout backend other than SGLang
    (AReaL's vLLM engine returns vLLM's raw log-probs: before temperature and truncation);
    ``gconfig.greedy``; ``gconfig.frequency_penalty != 0`` (SGLang penalises the logits before
    its filter); ``actor.temperature`` (and the ``ref`` engine's) other than
    ``gconfig.temperature``; a distillation ``teacher``; no truncation at all."""
    refuse_kept_mass(options)
    if options.support is None:
        return None, None
    name = _support_name(options)
    gconfig = getattr(experiment, "gconfig", None)
    actor = getattr(experiment, "actor", None)
    if experiment is None or gconfig is None or actor is None:
        raise ValueError(f"{name} needs enable(config, ...) with AReaL's experiment config: "
                         "its gconfig holds the rollout's top_k / top_p / temperature, from "
                         "which the kept set is rebuilt")
    rollout = getattr(experiment, "rollout", None)
    backend = _backend_name(rollout)
    if backend != "sglang":
        raise ValueError(f"{name} with rollout.backend={getattr(rollout, 'backend', None)!r}: "
                         "the kept set is rebuilt by SGLang's rule and SGLang's "
                         "full-vocabulary log-probs are moved onto it; AReaL's vLLM engine "
                         "sets no logprobs_mode, so its log-probs are vLLM's raw ones (before "
                         "temperature and truncation) and neither mode applies (roll out with "
                         "sglang, or unset support)")
    if getattr(gconfig, "greedy", False):
        raise ValueError(f"{name} with gconfig.greedy=True: a greedy rollout keeps one token; "
                         "there is no sampled kept set to rebuild (unset support)")
    for field in ("frequency_penalty", "presence_penalty"):
        if getattr(gconfig, field, 0.0):
            raise ValueError(f"{name} with gconfig.{field}={getattr(gconfig, field)}: SGLang "
                             "penalises the logits by the tokens generated so far before its "
                             "filter, which the row pass cannot rebuild (set it to 0, or unset "
                             "support)")
    temp = float(getattr(gconfig, "temperature", 1.0))
    engines = [("actor", actor)]
    if getattr(experiment, "ref", None) is not None and _cfg(actor, "kl_ctl", 0.0):
        engines.append(("ref", experiment.ref))
    for section, cfg in engines:
        t = float(_cfg(cfg, "temperature", 1.0))
        if t != temp:
            raise ValueError(f"{name}: {section}.temperature={t} differs from "
                             f"gconfig.temperature={temp}: the kept set is the rollout's at "
                             "gconfig's temperature, and AReaL scores every pass at the "
                             f"engine's own temperature (set {section}.temperature to "
                             f"{temp})")
    if getattr(experiment, "teacher", None) is not None:
        raise ValueError(f"{name} with a teacher: AReaL's distillation terms compare the "
                         "policy's log-probs with the teacher's full-vocabulary ones; "
                         "support=replay puts the policy's over the rollout's kept set "
                         "(unset support, or the teacher)")
    top_k = getattr(gconfig, "top_k", None)
    if (isinstance(top_k, (int, float)) and not isinstance(top_k, bool)
            and float(top_k).is_integer() and top_k >= NO_TOP_K):
        top_k = None          # any other type: refused by sampler_truncation, naming the field
    tr = methods.sampler_truncation(options, top_k=top_k, top_p=getattr(gconfig, "top_p", 1.0),
                                    min_p=getattr(gconfig, "min_p", 0.0), rule="sglang",
                                    ties="first", names={"support": f"{OPTIONS_ENV}: support",
                                                         "top_k": "gconfig.top_k"})
    return tr, temp


def check_support_set(experiment, options: methods.MethodOptions) -> None:
    """``support_set`` under AReaL's trainer (``enable(config, ...)``): one kept set per rollout
    (the default under ``support=replay``) is built by the actor's ``compute_logp`` pass and
    replayed by the reference's and the update's. AReaL's ``PPOTrainer`` runs the reference
    engine's ``compute_logp`` (the KL reward: a ``ref`` config and ``actor.kl_ctl > 0``) before
    the actor's; the reference's pass then has the actor's building pass run first on the same
    batch (the engine's ``_gbc_build_ahead``), with the actor's weights on the device. Refused
    by name: ``actor.offload`` with that reference (AReaL's trainer offloads the actor until
    after the reference's pass; ``per_pass``: the reference scores its own set rebuilt from its
    logits, as every pass rebuilds its own)."""
    if not options.one_set_per_rollout or experiment is None:
        return
    actor = getattr(experiment, "actor", None)
    kl = _cfg(actor, "kl_ctl", 0.0)
    if getattr(experiment, "ref", None) is not None and kl and _cfg(actor, "offload", False):
        raise ValueError(f"{OPTIONS_ENV}: support_set=rollout (the default under "
                         f"support=replay) with a KL reference (ref, actor.kl_ctl={kl}) and "
                         "actor.offload=true: AReaL's trainer runs the reference engine's "
                         "compute_logp first, which has the actor's compute_logp build the "
                         "kept set on the same batch, but the trainer keeps the actor's "
                         "weights offloaded until after the reference's pass; set support_set="
                         "per_pass (each pass, the reference's too, rebuilds the set from "
                         "its own logits), actor.offload=false or actor.kl_ctl=0")


def sampler_text(truncation, temperature) -> str:
    """:func:`sampler_settings`' result as ``GBC_AREAL_SAMPLER``'s text."""
    k = "none" if truncation.top_k is None else truncation.top_k
    return (f"top_k={k},top_p={truncation.top_p!r},min_p={truncation.min_p!r},"
            f"ties={truncation.ties},temperature={float(temperature)!r}")


def sampler_from_env(options: methods.MethodOptions, config=None):
    """The engine's ``SamplerTruncation`` under ``support=replay`` (None when off), from
    ``GBC_AREAL_SAMPLER``; refused by name when it is missing or malformed, or when the
    engine's ``config.temperature`` is not the rollout's."""
    refuse_kept_mass(options)
    if options.support is None:
        return None
    from gbc_kernels import SamplerTruncation

    name = _support_name(options)
    text = os.environ.get(SAMPLER_ENV, "")
    if not text.strip():
        raise ValueError(f"{name}: no rollout sampling settings ({SAMPLER_ENV}); they come "
                         "from enable(config, support='replay') with AReaL's experiment "
                         "config (its gconfig)")
    items = methods.parse_items(text, SAMPLER_ENV)
    try:
        k = items["top_k"]
        tr = SamplerTruncation(top_k=None if k == "none" else int(k),
                               top_p=float(items["top_p"]), min_p=float(items["min_p"]),
                               ties=items["ties"], rule="sglang")
        temp = float(items["temperature"])
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{SAMPLER_ENV}: expected top_k, top_p, min_p, ties and temperature "
                         f"as enable(config) writes them, got {text!r} ({exc})") from None
    t = _cfg(config, "temperature", None)
    if t is not None and float(t) != temp:
        raise ValueError(f"{name}: this engine's temperature={float(t)} differs from the "
                         f"rollout's gconfig.temperature={temp} ({SAMPLER_ENV}): the kept set "
                         "is the rollout's at its temperature (set the engine's temperature "
                         f"to {temp})")
    return tr


def corrects_behaviour(config) -> bool:
    """Whether AReaL's loss keeps the rollout's log-probs (the behaviour policy's: the decoupled
    loss), so that ``support=replay`` moves them onto the kept set (coupled with
    ``recompute_logprob``, AReaL overwrites them with the proximal ones)."""
    return bool(_cfg(config, "use_decoupled_loss", False))


def _cfg(config, name, default=None):
    return getattr(config, name, default)


def check_options(config, options: methods.MethodOptions) -> None:
    """Refuse, naming the option, what gbc's AReaL engine cannot run under AReaL's actor
    ``config`` (a ``PPOActorConfig``, a ``TrainEngineConfig`` for the reference engine, or
    None: the options alone):
    NTHR without the actor's ``compute_logp`` pass, AR, Lopti and NTHR where a per-token
    weight is not defined (these for an engine that :func:`trains` only), and AReaL's tree
    training."""
    if _cfg(config, "enable_tree_training", False):
        raise ValueError("enable_tree_training: gbc's AReaL engine computes the log-probs of "
                         "AReaL's packed rows; tree training's trie-packed logits "
                         "(gather_packed_tree_*) are not supported (set it to false, or leave "
                         "gbc off)")
    if _cfg(config, "is_critic", False):
        raise ValueError("is_critic: gbc's AReaL engine is the actor's (and the reference's); "
                         "the critic has no lm_head")
    refuse_kept_mass(options)
    if config is not None and not trains(config):
        return                  # the reference / a teacher: log-probs only, no loss
    if options.support == "replay" and config is not None:
        _check_replay(config, options)
    if options.nthr and config is not None and hasattr(config, "should_compute_prox_logp") \
            and not config.should_compute_prox_logp():
        raise ValueError(f"{OPTIONS_ENV}: nthr=true: NTHR scores the batch from the hidden "
                         "states of AReaL's actor compute_logp pass (the proximal policy: this "
                         "step's parameters, before the update), which this config skips "
                         "(recompute_logprob=false without use_decoupled_loss, or "
                         "prox_logp_method='loglinear'); set recompute_logprob=true, or "
                         "use_decoupled_loss with prox_logp_method='recompute'")
    acting = [f"{name}={getattr(options, name)}" for name in ("ar_alpha", "lopti_eta", "nthr")
              if getattr(options, name)]
    if acting and config is not None:
        level = _cfg(config, "importance_sampling_level", "token")
        if level != "token":
            raise ValueError(f"{OPTIONS_ENV}: {acting[0]} with importance_sampling_level="
                             f"{level!r}: AReaL's sequence-level losses replace each token's "
                             "advantage by its sequence's mean, so a per-token weight or split "
                             "would be averaged away (use importance_sampling_level='token')")
        if _cfg(config, "use_decoupled_loss", False) and \
                _cfg(config, "prox_logp_method", "recompute") == "loglinear":
            raise ValueError(f"{OPTIONS_ENV}: {acting[0]} with prox_logp_method='loglinear': "
                             "the proximal policy is then interpolated from the current one "
                             "inside the loss, so p_old is not fixed before the update (use "
                             "'recompute')")


def _check_replay(config, options) -> None:
    """``support=replay`` in the actor's config: the rollout's log-probs must either be
    replaced by AReaL (coupled, ``recompute_logprob``) or corrected from the actor's
    ``compute_logp`` pass (decoupled, ``prox_logp_method`` other than ``loglinear``)."""
    name = _support_name(options)
    decoupled = _cfg(config, "use_decoupled_loss", False)
    if not decoupled and not _cfg(config, "recompute_logprob", False):
        raise ValueError(f"{name} with recompute_logprob=false without use_decoupled_loss: "
                         "the PPO ratio is then taken against SGLang's full-vocabulary "
                         "rollout log-probs, and AReaL runs no actor compute_logp pass to "
                         "move them onto the kept set (set recompute_logprob=true, or "
                         "use_decoupled_loss=true)")
    if decoupled and _cfg(config, "prox_logp_method", "recompute") == "loglinear":
        raise ValueError(f"{name} with prox_logp_method='loglinear': AReaL then runs no actor "
                         "compute_logp pass, which gives the kept mass that moves SGLang's "
                         "full-vocabulary behaviour log-probs onto the kept set (use "
                         "'recompute' or 'metrics')")
    if options.nthr:
        raise ValueError(f"{name} with nthr=true: NTHR's scores over the rebuilt kept set are "
                         "not wired into AReaL's engine (unset one of them)")


def check_engine(engine) -> None:
    """Refuse the parallel layouts gbc's head does not run in (called at ``initialize``, when
    AReaL's process groups exist): tensor parallelism (a vocabulary-sharded lm_head)."""
    tp = getattr(getattr(engine, "parallel_helper", None), "tp_size", 1)
    if tp > 1:
        raise ValueError(f"backend: tensor parallelism (tp={tp}) shards AReaL's lm_head over "
                         "the vocabulary (a DTensor with Shard(0)); gbc's AReaL engine runs "
                         "with data and Ulysses sequence parallelism only (fsdp:dNcM)")
    check_options(engine.config, getattr(engine, "gbc_options", methods.MethodOptions()))


def method_loss_fn(loss_fn, options: methods.MethodOptions, phase=None):
    """AReaL's ``loss_fn(logprobs, entropy, input_data, **kw)`` with the method options applied
    to ``input_data["advantages"]``: NTHR's token scales (``gbc_nthr_scale``, put in the batch
    by the engine's ``compute_advantages``; a token's scale times its advantage is its loss
    term times the scale, as every AReaL loss is linear in a positive factor of the
    advantage), then ``methods.loss_advantages`` (AR times ``alpha exp(prox_logp) + 1 - alpha``;
    a Lopti ``phase`` zeroes them outside its tokens, ``exp(prox_logp) < lopti_eta`` for
    ``"low"``, and AReaL's normaliser keeps the whole mask); the same function when nothing
    acts on the advantages."""
    if not options.ar_alpha and not options.nthr and phase is None:
        return loss_fn

    @functools.wraps(loss_fn)
    def with_methods(logprobs, entropy, input_data, **kwargs):
        if "advantages" not in input_data:
            return loss_fn(logprobs, entropy, input_data, **kwargs)
        data = dict(input_data)
        if options.nthr:
            scale = input_data.get(NTHR_SCALE_KEY)
            if scale is None:
                raise ValueError(f"{OPTIONS_ENV}: nthr=true: the batch has no NTHR token "
                                 f"scales ({NTHR_SCALE_KEY}); they come from gbc's actor "
                                 "compute_advantages after its compute_logp pass")
            data["advantages"] = input_data["advantages"] * scale.to(
                input_data["advantages"].dtype)
        if not options.ar_alpha and phase is None:
            return loss_fn(logprobs, entropy, data, **kwargs)
        base = input_data.get("prox_logp")
        if base is None:
            raise ValueError(f"{OPTIONS_ENV}: ar_alpha and lopti_eta need the proximal "
                             "log-probs "
                             "(prox_logp) in AReaL's batch; it has none")
        data["advantages"] = methods.loss_advantages(data["advantages"],
                                                     base.float(), options, phase)
        return loss_fn(logprobs, entropy, data, **kwargs)

    return with_methods


@contextlib.contextmanager
def silent_stats():
    """AReaL's loss functions log through ``areal.trainer.ppo.actor.stats_tracker``; inside
    the block they log nothing (a Lopti phase's loss: its logged terms are the batch's, from
    the unsplit loss)."""
    from areal.trainer.ppo import actor

    real = actor.stats_tracker
    actor.stats_tracker = _Silent()
    try:
        yield
    finally:
        actor.stats_tracker = real


class _Silent:
    def __getattr__(self, name):
        if name in ("scope", "disable_scope", "record_timing"):
            return lambda *a, **k: contextlib.nullcontext()
        return lambda *a, **k: None


def lopti_train_stats(phases, stats) -> dict:
    """One dict of ``train_batch`` statistics for Lopti's updates (``stats``: AReaL's dict of
    each, in ``phases`` order): the first update's, ``update_successful`` only if every update
    succeeded, and each update's gradient norm as ``lopti_<phase>_grad_norm``."""
    out = dict(stats[0])
    out["update_successful"] = float(all(s.get("update_successful", 1.0) for s in stats))
    for phase, s in zip(phases, stats):
        if "grad_norm" in s:
            out[f"lopti_{phase}_grad_norm"] = s["grad_norm"]
    return out
