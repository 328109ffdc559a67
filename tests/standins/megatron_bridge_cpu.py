"""megatron-bridge on this CPU test machine: a stand-in for the names SkyRL's Megatron worker
and (0.4) model wrapper modules import (loaded by path, as skyrl_cpu.py). SkyRL 0.4's wrapper
imports ``megatron.bridge.peft.utils``: its two gradient-finalisation functions are megatron-
core's ``finalize_model_grads`` (no expert adapters on CPU) and a no-op, and its
``ParallelLinearAdapter`` a refusing class marked as already patched (SkyRL's worker module
patches it at import).

* ``skyrl.backends.skyrl_train.workers.megatron.megatron_worker`` imports
  ``megatron.bridge.AutoBridge``, ``megatron.bridge.peft.canonical_lora.CanonicalLoRA`` and
  ``megatron.bridge.peft.lora.LoRA`` at import time (megatron-bridge itself needs Transformer
  Engine, CUDA builds only). :func:`install` puts the modules ``megatron.bridge`` (a package
  with an empty ``__path__``: every other ``megatron.bridge.*`` import still fails with
  ``ImportError``, which SkyRL's guarded imports, e.g. its extra model bridges, expect),
  ``megatron.bridge.peft``, ``megatron.bridge.peft.canonical_lora`` and
  ``megatron.bridge.peft.lora`` into ``sys.modules``, each with a module spec. Each of the
  three names is a class that raises ``RuntimeError`` ("CPU stand-in") when called or when any
  of its attributes is read: what needs megatron-bridge (``init_model``'s ``AutoBridge``, LoRA)
  never runs silently on it; ``isinstance`` against them is False.
* :func:`remove` takes the stand-ins out of ``sys.modules`` (and ``megatron.bridge`` off the
  ``megatron`` package), and with them every module imported while they were in place that
  holds their names: SkyRL's Megatron worker module and gbc's
  ``gbc_kernels.integrations.skyrl.megatron_worker``. tests/conftest.py calls it after every
  test: verl probes ``megatron.bridge`` and gbc's ``enable()`` probes SkyRL's Megatron worker
  module, and both must find them absent in later tests, as on this machine.

Importing gbc's worker module also puts gbc's methods on SkyRL's ``MegatronModelWrapper``
(``patch_wrapper``); the test that imports it restores them (``monkeypatch``).
"""

import importlib.machinery
import importlib.util
import sys
import types

MODULES = ("megatron.bridge", "megatron.bridge.peft", "megatron.bridge.peft.canonical_lora",
           "megatron.bridge.peft.lora", "megatron.bridge.peft.utils")
NAMES = {"megatron.bridge": "AutoBridge", "megatron.bridge.peft.canonical_lora": "CanonicalLoRA",
         "megatron.bridge.peft.lora": "LoRA"}
# modules that import the stand-ins' names: dropped with them
DEPENDENTS = ("skyrl.backends.skyrl_train.workers.megatron.megatron_worker",
              "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper",
              "gbc_kernels.integrations.skyrl.megatron_worker")


def _refuse(what):
    raise RuntimeError(f"{what}: megatron-bridge's CPU stand-in (tests/standins/"
                       f"megatron_bridge_cpu.py); megatron-bridge is not installed here")


class _Refusing(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        _refuse(f"{cls.__module__}.{cls.__name__}.{name}")

    def __call__(cls, *args, **kwargs):
        _refuse(f"{cls.__module__}.{cls.__name__}(...)")


class _StandIn(types.ModuleType):
    """A stand-in module (its type tells :func:`remove` which modules are stand-ins)."""


def installed():
    """Whether the stand-in is in ``sys.modules``."""
    return isinstance(sys.modules.get("megatron.bridge"), _StandIn)


def install():
    """Put the stand-in modules into ``sys.modules`` (no-op when installed); refuses where a
    real megatron-bridge is importable (nothing to stand in for)."""
    import megatron

    if installed():
        return
    if "megatron.bridge" in sys.modules or importlib.util.find_spec("megatron.bridge"):
        raise RuntimeError("megatron_bridge_cpu.install: megatron-bridge is installed here; "
                           "the stand-in is for machines without it")
    for name in MODULES:
        mod = _StandIn(name, "megatron-bridge's CPU stand-in (tests/standins/"
                             "megatron_bridge_cpu.py)")
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__path__ = []
        if name in NAMES:
            setattr(mod, NAMES[name], _Refusing(NAMES[name], (), {"__module__": name}))
        if name == "megatron.bridge.peft.utils":
            mod.enable_expert_parallel_grad_sync_in_finalize = lambda modules: None
            def finalize_model_grads_with_expert_adapter_sync(models, num_tokens=None):
                from megatron.core.distributed import finalize_model_grads
                return finalize_model_grads(models, num_tokens)
            mod.finalize_model_grads_with_expert_adapter_sync = (
                finalize_model_grads_with_expert_adapter_sync)
            mod.ParallelLinearAdapter = _Refusing("ParallelLinearAdapter", (), {
                "__module__": name, "_skyrl_shared_expert_lora_tp_patch": True})
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent] if parent != "megatron" else megatron, child, mod)


def remove():
    """Take the stand-ins, and the modules that imported their names (:data:`DEPENDENTS`), out
    of ``sys.modules``; ``megatron.bridge`` off the ``megatron`` package."""
    if not installed():
        return
    for name in DEPENDENTS:
        mod = sys.modules.pop(name, None)
        parent, _, child = name.rpartition(".")
        if mod is not None and getattr(sys.modules.get(parent), child, None) is mod:
            delattr(sys.modules[parent], child)
    for name in MODULES:
        sys.modules.pop(name, None)
    megatron = sys.modules.get("megatron")
    if isinstance(getattr(megatron, "bridge", None), _StandIn):
        del megatron.bridge


def packed_seq_params_total_tokens():
    """SkyRL 0.4's ``preprocess_packed_seqs`` passes ``PackedSeqParams(total_tokens=...)``, a
    field of megatron-core 0.17+ (Python >= 3.12; 0.16.1 is the newest on this machine's 3.11)
    that only Mamba layers read: SkyRL's ``megatron_utils`` gets a subclass with that field
    (default None) where megatron-core's lacks it; nothing else changes."""
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams
    from skyrl.backends.skyrl_train.distributed.megatron import megatron_utils

    if "total_tokens" not in {f.name for f in dataclasses.fields(PackedSeqParams)}:
        megatron_utils.PackedSeqParams = dataclasses.make_dataclass(
            "PackedSeqParams", [("total_tokens", int, dataclasses.field(default=None))],
            bases=(PackedSeqParams,))
