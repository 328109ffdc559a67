"""Empty stand-ins for the packages verl 0.9.1's worker and trainer modules import at the top
(its rollout server: uvicorn, fastapi, aiohttp, cachetools; its data loader: torchdata; hydra,
transfer_queue) where they are not installed, so that ``verl.workers.engine_workers`` and
``verl.trainer.ppo.ray_trainer`` import on a CPU test machine. A stand-in's attributes are
empty classes: nothing of theirs runs in the tests that use them (tests/test_switch_on.py
constructs verl's workers and trainers only to see whether gbc stops them). An installed package
is never replaced.
"""

import importlib.util
import sys
import types

PACKAGES = ("uvicorn", "fastapi", "fastapi.responses", "starlette", "aiohttp", "cachetools",
            "hydra", "transfer_queue", "torchdata", "torchdata.stateful_dataloader")


def _stand_in(name):
    module = types.ModuleType(name)
    module.__path__ = []

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})

    module.__getattr__ = __getattr__
    return module


def install():
    """Put a stand-in in ``sys.modules`` for each of :data:`PACKAGES` not installed."""
    stood_in = set()
    for name in PACKAGES:
        top = name.split(".")[0]
        if top in stood_in or (top not in sys.modules and importlib.util.find_spec(top) is None):
            stood_in.add(top)
            sys.modules[name] = _stand_in(name)
    return sorted(stood_in)
