"""TRL drop-in: ``GBCGRPOTrainer`` is ``trl.GRPOTrainer`` (TRL 1.14-1.16,
refused on another release: :func:`check_trl_version`) with its loss computed from
the policy's hidden states and ``lm_head``, no logits; TRL's loss with every ``gbc_*`` option
off, AR, Lopti, NTHR and critical-token KL with them, and the sampler's kept set rebuilt from
``top_k`` / ``top_p`` / ``min_p`` (``gbc_support``) (:class:`GBCGRPOConfig`; docs/trl.md).

The parts, as every trainer's adapter has them: :mod:`.config` (TRL's options as gbc's, the
``gbc_*`` options, and the release check), :mod:`.trainer` (the ``GRPOTrainer`` subclass: the
step with the fused loss and the methods). The switch-on is building a
:class:`GBCGRPOTrainer`, which first refuses a TRL that Unsloth has patched
(:func:`check_no_unsloth`) and checks TRL's release.
"""

from __future__ import annotations

# every name of the one module this package was, importable from it as before (TRL's own
# classes are imported absolutely: ``trl`` here is TRL, not this package)
import contextlib  # noqa: F401
import dataclasses  # noqa: F401
from dataclasses import dataclass, field  # noqa: F401
from typing import Optional  # noqa: F401

import torch  # noqa: F401
from trl import GRPOConfig, GRPOTrainer  # noqa: F401

import gbc_kernels as gbc  # noqa: F401
from gbc_kernels import methods  # noqa: F401
from .. import hf  # noqa: F401
from ..releases import check_release  # noqa: F401
from .config import (METHOD_NAMES, NUM_ITEMS_LOSS_TYPES, PPO_LOSS_TYPES,  # noqa: F401
                     SUPPORTED_LOSS_TYPES, TRL_NAMES, GBCGRPOConfig, _in_trl_words, _Options,
                     _unsupported, check_trl_version, method_options)
from .trainer import (_MULTIMODAL_KEYS, NTHR_GROUP_KEY, OLD_LOGP_KEY,  # noqa: F401
                      SUPPORT_IDS_KEY, GBCGRPOTrainer, _logit_scale, _model_inputs,
                      check_no_unsloth)
