"""gbc's workers on SkyRL 0.3.0's FSDP backend: its policy and reference workers with
:class:`.worker.GBCPolicyWorkerMixin` / :class:`.worker.GBCRefWorkerMixin` in front
(docs/skyrl.md). :func:`gbc_kernels.integrations.skyrl.enable` puts them in SkyRL's place."""

from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import (FSDPPolicyWorkerBase,
                                                                FSDPRefWorkerBase)

from .worker import GBCPolicyWorkerMixin, GBCRefWorkerMixin


class GBCFSDPPolicyWorker(GBCPolicyWorkerMixin, FSDPPolicyWorkerBase):
    """SkyRL's FSDP policy worker, its training step and log-prob pass gbc's."""


class GBCFSDPRefWorker(GBCRefWorkerMixin, FSDPRefWorkerBase):
    """SkyRL's FSDP reference worker, its log-prob pass gbc's."""
