"""megatron-bridge on this CPU test machine: a stand-in for the three names SkyRL 0.3.0's
Megatron worker module imports (loaded by path, as skyrl_cpu.py).

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
           "megatron.bridge.peft.lora")
NAMES = {"megatron.bridge": "AutoBridge", "megatron.bridge.peft.canonical_lora": "CanonicalLoRA",
         "megatron.bridge.peft.lora": "LoRA"}
# modules that import the stand-ins' names: dropped with them
DEPENDENTS = ("skyrl.backends.skyrl_train.workers.megatron.megatron_worker",
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
