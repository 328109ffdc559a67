"""gbc's workers on SkyRL 0.3.0's Megatron backend (docs/skyrl.md, "Megatron"): SkyRL's own
Megatron policy and reference workers, in a process where SkyRL's ``MegatronModelWrapper``
carries gbc's head (:func:`.megatron.patch_wrapper`, run when this module is imported: Ray's
worker processes import it to build these classes), with gbc's method layer
(:class:`.worker.GBCMethodsMixin`: Lopti, NTHR) in front of the policy worker and
critical-token KL's weights from the reference worker's pass.
:func:`gbc_kernels.integrations.skyrl.enable` puts them in SkyRL's place. Importing it needs
SkyRL's Megatron worker module, which imports megatron-bridge."""

from skyrl.backends.skyrl_train.workers.megatron.megatron_worker import (
    MegatronPolicyWorkerBase, MegatronRefWorkerBase)

from gbc_kernels import methods

from .megatron import patch_wrapper, reference_forward
from .worker import GBCMethodsMixin, GBCOptionsMixin, check_replay_batch, recording

patch_wrapper()


def _on_model(name):
    """A worker attribute kept on its model wrapper, where gbc's wrapper reads it."""
    return property(lambda self: getattr(self.model, name),
                    lambda self, value: setattr(self.model, name, value))


class GBCMegatronPolicyWorker(GBCMethodsMixin, MegatronPolicyWorkerBase):
    """SkyRL's Megatron policy worker; its model wrapper runs gbc's head, with the methods."""

    _gbc_phase = _on_model("gbc_phase")
    _gbc_keeping = _on_model("gbc_keeping")

    def _gbc_dp_group(self):
        from megatron.core import parallel_state as mpu

        return methods.data_parallel_group(
            mpu.get_data_parallel_group(with_context_parallel=False))

    def _gbc_holds_head(self):
        from megatron.core import parallel_state as mpu

        return mpu.is_pipeline_last_stage(ignore_virtual=True)

    def _gbc_agree_group(self):
        return methods.data_parallel_group()      # every stage and TP rank: one branch

    def forward_backward(self, data, loss_fn=None, loss_fn_config=None, **kwargs):
        """gbc's method layer over SkyRL's ``forward_backward``; the fields gbc carries in
        the batch reach SkyRL's micro-batch dicts (:func:`.worker.recording`)."""
        with recording():
            return super().forward_backward(data, loss_fn, loss_fn_config, **kwargs)


class GBCMegatronRefWorker(GBCOptionsMixin, MegatronRefWorkerBase):
    """SkyRL's Megatron reference worker; its model wrapper's log-prob pass runs gbc's, and
    with critical-token KL on gives the KL weights (:func:`.megatron.reference_forward`)."""

    def forward(self, data):
        opts = self.gbc_options
        check_replay_batch(self, data, loss_tokens=False)    # the whole batch's support first
        if opts.critical_kl_exponent is None:
            return super().forward(data)
        return reference_forward(self, data, opts)
