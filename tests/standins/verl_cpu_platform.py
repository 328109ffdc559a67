"""A CPU platform for verl 0.9.1's platform registry, for the tests only.

verl detects an accelerator (nvidia, huawei, amd) and falls back to CUDA when none is found; its
FSDP engine then builds a CUDA device mesh and asks ``torch.cuda`` for memory figures. This
platform says "cpu" with gloo, so verl's own engine code (device mesh, FSDP2 wrapping, the
forward/backward loop) runs unchanged on a CPU machine. Memory figures are zeros (they only feed
verl's logging)."""

from __future__ import annotations

import contextlib
import types

import torch


def _cpu_module():
    m = types.SimpleNamespace()
    m.current_device = lambda: "cpu"
    m.device_count = lambda: 1
    m.set_device = lambda *_: None
    m.synchronize = lambda *_: None
    m.is_available = lambda: True
    m.empty_cache = lambda: None
    m.manual_seed = torch.manual_seed
    m.manual_seed_all = torch.manual_seed
    m.mem_get_info = lambda *_: (0, 0)
    m.memory_allocated = lambda *_: 0
    m.memory_reserved = lambda *_: 0
    m.max_memory_allocated = lambda *_: 0
    m.reset_peak_memory_stats = lambda *_: None
    m.get_rng_state = torch.get_rng_state
    m.set_rng_state = torch.set_rng_state
    return m


def install():
    """Make verl's ``get_device_name()`` say "cpu" (call before building an engine)."""
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_base import PlatformBase

    module = _cpu_module()

    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = module

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return (None, None)

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    platform_manager._current_platform = PlatformCPU()
