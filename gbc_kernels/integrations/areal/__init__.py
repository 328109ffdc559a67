"""AReaL 1.0.4 (docs/areal.md): gbc's head inside AReaL's FSDP PPO actor
(:class:`.engine.GBCFSDPPPOActor`: the log-probs and entropy of every pass from the hidden
states and the lm_head's weight, no ``[N, V]`` logits; AReaL's own loss on them), the method
options as AReaL's engine takes them (:mod:`.losses`), switched on by :func:`enable` in the
script that builds AReaL's ``PPOTrainer``.

This package imports without AReaL; :class:`GBCFSDPPPOActor` imports it when first used.
"""

from __future__ import annotations

import os

from .losses import (ENV, KL_WEIGHT_KEY, LOG_KEPT_MASS_KEY, NTHR_ROW_KEY, NTHR_SCALE_KEY,
                     OPTIONS_ENV, SAMPLER_ENV, SUPPORT_ROW_KEY, check_critical_kl, check_options,
                     check_support_set, mark_reference, options_from_env, sampler_settings,
                     sampler_text)

__all__ = ["ENV", "KL_WEIGHT_KEY", "LOG_KEPT_MASS_KEY", "NTHR_ROW_KEY", "NTHR_SCALE_KEY",
           "OPTIONS_ENV", "SAMPLER_ENV", "SUPPORT_ROW_KEY", "GBCFSDPPPOActor", "check_areal_version", "enable",
           "disable", "mark_reference"]

_SAVED = {}


def enable(config=None, **method_options):
    """Make AReaL's trainer build gbc's actor: ``areal.engine.FSDPPPOActor`` (the name
    ``PPOTrainer._create_train_engine`` imports for the actor, the reference model and a
    train-type teacher under ``backend=fsdp``) becomes :class:`GBCFSDPPPOActor`. Call it
    before ``PPOTrainer(...)``; under AReaL's SPMD launcher every rank runs the script, so
    every rank switches on; under its single controller the workers import the class by its
    path and get the options through the actor's scheduling specs
    (:meth:`GBCFSDPPPOActor.as_controller`).

    ``method_options``: ``ar_alpha=0.3``, ``lopti_eta=0.5``, ``nthr=True``,
    ``critical_kl_exponent=2.0``, ``logits_dtype="float32"``, ``support="replay"``,
    ``support_ties="all"``, ``support_set="per_pass"`` (the method layer's names; a value set in ``GBC_AREAL_OPTIONS``
    is used when none are given). ``config``: AReaL's experiment config (its ``actor``
    section, or the actor config itself), checked now (:func:`.losses.check_options`);
    critical-token KL needs the experiment config (:func:`.losses.check_critical_kl`), whose
    ``ref`` section it marks as the reference engine's; so does ``support="replay"``, whose
    sampling settings come from its ``gconfig`` (:func:`.losses.sampler_settings`) and reach
    the engines in ``GBC_AREAL_SAMPLER``, and whose one kept set per rollout (the default
    ``support_set``) runs with AReaL's KL reference, the reference's pass having the actor
    build the set first (``actor.offload`` then refused: :func:`.losses.check_support_set`);
    ``support="kept_mass"`` is refused (SGLang's
    log-probs are the full vocabulary's already). A bad option, an option AReaL's flow
    cannot run, an untested AReaL release or a missing AReaL stops here, naming it. Returns
    the options."""
    from gbc_kernels import methods

    try:
        import areal.engine as areal_engine
        from areal.engine import fsdp_engine
    except ImportError as err:
        raise ImportError(f"{ENV}: gbc's AReaL engine needs AReaL 1.0.4's FSDP engine "
                          f"(pip install --no-deps areal==1.0.4, and what it imports: "
                          f"docs/areal.md): {err}") from err
    check_areal_version()
    if method_options:
        text = ",".join(f"{k}={_text(v)}" for k, v in method_options.items())
    else:
        text = os.environ.get(OPTIONS_ENV, "")
    opts = methods.MethodOptions.parse(text, OPTIONS_ENV, support_ok=True)
    check_options(None if config is None else getattr(config, "actor", None) or config, opts)
    check_critical_kl(config, opts)
    truncation, temperature = sampler_settings(config, opts)
    check_support_set(config, opts)
    if truncation is not None:
        _warn_sampling_backend(config)
    if opts.critical_kl_exponent is not None:
        mark_reference(config.ref)
    from .engine import GBCFSDPPPOActor

    if not _SAVED:
        _SAVED.update(engine=areal_engine.__dict__.get("FSDPPPOActor"),
                      fsdp=fsdp_engine.FSDPPPOActor,
                      env={k: os.environ.get(k) for k in (ENV, OPTIONS_ENV, SAMPLER_ENV)})
    os.environ[ENV], os.environ[OPTIONS_ENV] = "1", text
    if truncation is None:
        os.environ.pop(SAMPLER_ENV, None)
    else:
        os.environ[SAMPLER_ENV] = sampler_text(truncation, temperature)
    areal_engine.FSDPPPOActor = GBCFSDPPPOActor      # areal.engine's lazy name, cached
    fsdp_engine.FSDPPPOActor = GBCFSDPPPOActor
    return opts


def disable():
    """Undo :func:`enable` in this process (AReaL's own actor again)."""
    if not _SAVED:
        return
    import areal.engine as areal_engine
    from areal.engine import fsdp_engine

    if _SAVED["engine"] is None:
        areal_engine.__dict__.pop("FSDPPPOActor", None)
    else:
        areal_engine.FSDPPPOActor = _SAVED["engine"]
    fsdp_engine.FSDPPPOActor = _SAVED["fsdp"]
    for k, v in _SAVED["env"].items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _SAVED.clear()


def _warn_sampling_backend(config) -> None:
    """SGLang's default sampling backend (FlashInfer on CUDA) samples by a joint rejection
    sampler that never forms the kept set; only ``sampling_backend="pytorch"`` keeps the set
    ``rule="sglang"`` rebuilds (docs/areal.md)."""
    import warnings

    backend = getattr(getattr(config, "sglang", None), "sampling_backend", None)
    if backend != "pytorch":
        warnings.warn(f"{OPTIONS_ENV}: support=replay rebuilds the kept set of SGLang's "
                      f"PyTorch sampling backend; sglang.sampling_backend={backend!r} "
                      "(FlashInfer by default on CUDA) samples with a joint rejection sampler "
                      "whose boundary handling may differ (set sglang.sampling_backend="
                      "'pytorch' for the exact set; docs/areal.md)", stacklevel=3)


def _text(value) -> str:
    if value is True or value is False:
        return str(value).lower()
    return "float32" if str(value) == "torch.float32" else str(value)


def check_areal_version(version=None) -> str:
    """AReaL's installed version, refused by name unless ``releases.TESTED["areal"]``
    (:func:`enable` checks it before it patches anything)."""
    from gbc_kernels.integrations.releases import check_release

    return check_release("areal", version,
                         why="gbc subclasses its FSDP actor and replaces its engine's "
                             "micro-batch loop, which change between releases",
                         off="leave enable() out to run AReaL's own actor")


def __getattr__(name):
    if name == "GBCFSDPPPOActor":
        from .engine import GBCFSDPPPOActor

        return GBCFSDPPPOActor
    raise AttributeError(name)
