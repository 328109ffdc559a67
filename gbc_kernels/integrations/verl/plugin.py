"""verl's plugin entry point (``verl.plugins``, imported by verl in every process): with
``GBC_VERL_ENGINE`` set it runs :func:`.engine.enable` (docs/verl.md, "Switching it on").

verl imports its plugins inside ``try: ... except Exception`` and drops the error at debug
level, so a failure to switch on (a bad ``GBC_VERL_OPTIONS``, a missing dependency, a verl
version gbc does not support, an unknown ``GBC_VERL_ENGINE`` value) is not raised here: it is
kept in :data:`error` and raised, naming it, where verl cannot hide it — every engine lookup of
verl's registry (``EngineRegistry.get_engine_cls``, behind ``EngineRegistry.new``), the
worker's init (``TrainingWorker``, ``ActorRolloutRefWorker``) and the trainer's
(``RayPPOTrainer``, the v1 ``PPOTrainer``). ``GBC_VERL_ENGINE=fallback`` asks for verl's stock
step on such a failure instead, with a warning.
"""

from __future__ import annotations

import logging
import os
import warnings

from gbc_kernels.integrations import patching

ENV_ON = "GBC_VERL_ENGINE"
ON = ("1", "true", "yes", "strict")       # gbc's engine; a failure to switch on stops the run
FALLBACK = "fallback"                     # gbc's engine; on a failure, verl's stock step
OFF = ("", "0", "false", "no")

error = None            # why gbc's engine is not on though GBC_VERL_ENGINE asked for it
_REFUSALS = patching.Patches()      # the pending on-import patches
_REPLACED = []          # (class, attribute, its own entry in the class's __dict__)

# verl's entry points that stop the run when gbc's engine failed to switch on:
# (module, class, attribute); the registry's lookup is every engine's way in
REFUSAL_POINTS = (
    ("verl.workers.engine.base", "EngineRegistry", "get_engine_cls"),
    ("verl.workers.engine_workers", "TrainingWorker", "__init__"),
    ("verl.workers.engine_workers", "ActorRolloutRefWorker", "__init__"),
    ("verl.trainer.ppo.ray_trainer", "RayPPOTrainer", "__init__"),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "__init__"),
)


class SwitchOnError(RuntimeError):
    """gbc's verl engine was asked for (``GBC_VERL_ENGINE``) and could not be switched on."""


def _refuse(*args, **kwargs):
    raise SwitchOnError(str(error)) from error.__cause__


def _install_refusals(module_name):
    def patch(module):
        for name, cls_name, attr in REFUSAL_POINTS:
            cls = getattr(module, cls_name, None) if name == module_name else None
            if cls is not None and all(c is not cls or a != attr for c, a, _ in _REPLACED):
                _REPLACED.append((cls, attr, cls.__dict__[attr]))
                setattr(cls, attr, classmethod(_refuse) if attr == "get_engine_cls" else _refuse)

    _REFUSALS.on_import(module_name, patch)


def switch_on(raw: str) -> None:
    """What ``GBC_VERL_ENGINE=raw`` asks for (see the module docstring)."""
    global error
    value = raw.strip().lower()
    if value in OFF:
        return
    cause = None
    if value in ON or value == FALLBACK:
        try:
            from gbc_kernels.integrations.verl.engine import enable
            enable()
            return
        except Exception as exc:        # noqa: BLE001 - raised below, where verl cannot hide it
            cause = exc
            _undo_partial_enable()
        if value == FALLBACK:
            warnings.warn(f"{ENV_ON}=fallback: gbc's verl engine could not be switched on, verl "
                          f"runs its stock step: {type(cause).__name__}: {cause}",
                          RuntimeWarning, stacklevel=2)
            return
        message = (f"{ENV_ON}={raw}: gbc's verl engine could not be switched on, so the run "
                   f"stops ({ENV_ON}=fallback would run verl's stock step instead): "
                   f"{type(cause).__name__}: {cause}")
    else:
        message = (f"{ENV_ON}={raw!r}: expected 1/true/yes/strict (gbc's engine), fallback "
                   "(gbc's engine, or verl's stock step with a warning if it cannot be switched "
                   "on) or 0/false/no (off)")
    error = SwitchOnError(message)
    error.__cause__ = cause
    logging.getLogger("gbc_kernels").error(message)
    for module_name in dict.fromkeys(m for m, _, _ in REFUSAL_POINTS):
        _install_refusals(module_name)


def _undo_partial_enable():
    try:
        from gbc_kernels.integrations.verl.engine import disable
        disable()
    except Exception:                   # noqa: BLE001 - nothing of gbc's was switched on
        pass


def reset() -> None:
    """Drop a recorded failure and its refusals (tests)."""
    global error
    error = None
    _REFUSALS.undo()
    while _REPLACED:
        cls, attr, original = _REPLACED.pop()
        setattr(cls, attr, original)


switch_on(os.environ.get(ENV_ON, ""))
