"""gbc's fields in SkyRL 0.3.0's training batch, added by its own trainer
(``skyrl.train.trainer.RayPPOTrainer``, patched by :func:`patch_trainer`; docs/skyrl.md):

* critical-token KL: the reference worker's ``forward`` returns the weights beside the
  log-probs (:class:`.worker.GBCRefWorkerMixin`); ``fwd_logprobs_values_reward`` puts them in
  the batch as ``gbc_kl_weight``, beside ``base_action_log_probs``;
* NTHR: ``compute_advantages_and_returns`` puts SkyRL's ``uids`` (the groups, which it drops
  from the batch after the advantages) in the batch as integer group ids, ``gbc_group``.

The fields then travel as SkyRL's own do: staged per mini-batch and data-parallel rank, into
the policy worker's ``forward_backward``, and into each micro-batch's ``Experience.info``
(:func:`.worker.carry_fields`).
"""

from __future__ import annotations

import functools

import torch

from .worker import GROUP_KEY, KL_WEIGHT_KEY, method_options


def patch_trainer():
    """Patch SkyRL's ``RayPPOTrainer`` (idempotent); what is added follows the method options
    of this process (``GBC_SKYRL_OPTIONS``, set by :func:`gbc_kernels.integrations.skyrl.
    enable`)."""
    from skyrl.train import trainer

    cls = trainer.RayPPOTrainer
    if getattr(cls, "_gbc_patched", False):
        return cls
    cls._execute_forward_pass = _reference_weights(cls._execute_forward_pass)
    cls.fwd_logprobs_values_reward = _kl_weight_field(cls.fwd_logprobs_values_reward)
    cls.compute_advantages_and_returns = _group_field(cls.compute_advantages_and_returns)
    cls._gbc_patched = True
    return cls


def _reference_weights(original):
    """The reference worker's pass (one full-batch forward in SkyRL's trainer): its log-probs
    as SkyRL takes them, and with critical-token KL on, its weights kept on the trainer."""

    @functools.wraps(original)
    def _execute_forward_pass(self, model, data_fwd_pass, key, mini_batch_boundaries):
        if model != "ref" or method_options().critical_kl_exponent is None:
            return original(self, model, data_fwd_pass, key, mini_batch_boundaries)
        from skyrl.backends.skyrl_train.distributed.dispatch import loss_fn_outputs_to_tensor

        outputs = self.dispatch.forward(model, data_fwd_pass).loss_fn_outputs
        if outputs and KL_WEIGHT_KEY not in outputs[0]:
            raise ValueError(f"GBC_SKYRL_OPTIONS: critical_kl_exponent: SkyRL's reference "
                             f"worker returned no '{KL_WEIGHT_KEY}' (gbc's reference worker "
                             f"gives them: enable() before SkyRL builds its workers)")
        self._gbc_kl_weight = loss_fn_outputs_to_tensor(outputs, key=KL_WEIGHT_KEY)
        return loss_fn_outputs_to_tensor(outputs, key=key)

    return _execute_forward_pass


def _kl_weight_field(original):
    @functools.wraps(original)
    def fwd_logprobs_values_reward(self, training_input):
        self._gbc_kl_weight = None
        out = original(self, training_input)
        weight, self._gbc_kl_weight = self._gbc_kl_weight, None
        if weight is not None:
            out[KL_WEIGHT_KEY] = weight[: len(out["sequences"])]
        return out

    return fwd_logprobs_values_reward


def _group_field(original):
    @functools.wraps(original)
    def compute_advantages_and_returns(self, data):
        if method_options().nthr:
            uids = list(data.metadata["uids"])
            if len(uids) != len(data["sequences"]):
                raise ValueError(f"GBC_SKYRL_OPTIONS: nthr: SkyRL's uids ({len(uids)}) do not "
                                 f"match the batch's {len(data['sequences'])} rows")
            first = {}
            data[GROUP_KEY] = torch.tensor([first.setdefault(u, len(first)) for u in uids],
                                           dtype=torch.long)
        return original(self, data)

    return compute_advantages_and_returns
