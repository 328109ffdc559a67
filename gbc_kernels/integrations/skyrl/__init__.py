"""SkyRL 0.3.0 (docs/skyrl.md): its registered policy losses as gbc configs (:mod:`.losses`)
and gbc's fused loss inside its policy worker (:mod:`.worker`)."""

from .losses import (SKYRL_KL_TYPES, SKYRL_LOSS_TYPES, SKYRL_REFUSED, policy_loss_config,
                     policy_loss_inputs, skyrl_loss_metrics)

__all__ = ["SKYRL_KL_TYPES", "SKYRL_LOSS_TYPES", "SKYRL_REFUSED", "policy_loss_config",
           "policy_loss_inputs", "skyrl_loss_metrics"]
