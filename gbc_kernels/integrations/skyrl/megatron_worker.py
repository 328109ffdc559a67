"""gbc's workers on SkyRL 0.3.0's Megatron backend (docs/skyrl.md, "Megatron"): SkyRL's own
Megatron policy and reference workers, in a process where SkyRL's ``MegatronModelWrapper``
carries gbc's head (:func:`.megatron.patch_wrapper`, run when this module is imported: Ray's
worker processes import it to build these classes).
:func:`gbc_kernels.integrations.skyrl.enable` puts them in SkyRL's place. Importing it needs
SkyRL's Megatron worker module, which imports megatron-bridge."""

from skyrl.backends.skyrl_train.workers.megatron.megatron_worker import (
    MegatronPolicyWorkerBase, MegatronRefWorkerBase)

from .megatron import patch_wrapper

patch_wrapper()


class GBCMegatronPolicyWorker(MegatronPolicyWorkerBase):
    """SkyRL's Megatron policy worker; its model wrapper runs gbc's head."""


class GBCMegatronRefWorker(MegatronRefWorkerBase):
    """SkyRL's Megatron reference worker; its model wrapper's log-prob pass runs gbc's."""
