"""A stand-in for SkyRL 0.3.0's ``skyrl.backends.skyrl_train.workers.megatron.megatron_worker``
(which imports megatron-bridge, absent on CPU): its worker base classes and Ray actor names, to
check what gbc's ``enable()`` puts there. Nothing here runs a model."""

import ray


class MegatronPolicyWorkerBase:
    """Stands for SkyRL's Megatron policy worker."""


class MegatronRefWorkerBase:
    """Stands for SkyRL's Megatron reference worker."""


PolicyWorker = ray.remote(num_gpus=1)(MegatronPolicyWorkerBase)
RefWorker = ray.remote(num_gpus=1)(MegatronRefWorkerBase)
