"""OpenRLHF 0.11.2 without ``[N, V]`` logits: the actor's loss and no-grad log-prob passes, its
arguments as a ``PolicyLossConfig``, and AR, Lopti, NTHR and critical-token KL inside its own
loop, patched in by :func:`enable` (docs/openrlhf.md).

The parts, as every trainer's adapter has them: :mod:`.losses` (OpenRLHF's options as gbc's
config, the drop-in's options), :mod:`.actor` (the fused loss and log-prob passes of its
``Actor``), :mod:`.trainer` (the hooks patched into its actor, replay buffer and trainer), and
here the switch-on (:func:`enable`, :func:`disable`) with its release check
(:func:`check_openrlhf_version`).
"""

from __future__ import annotations

import dataclasses  # noqa: F401
import os
from types import SimpleNamespace  # noqa: F401
from typing import NamedTuple, Optional  # noqa: F401

import torch  # noqa: F401
from torch.nn.utils.rnn import pad_sequence  # noqa: F401

import gbc_kernels as gbc  # noqa: F401
from gbc_kernels import methods
from .. import hf, patching  # noqa: F401
from ..releases import TESTED, check_release, installed
# the parts' names, importable from here as from the one module this package was (the tests and
# OpenRLHF's launchers name gbc_kernels.integrations.openrlhf.X)
from .losses import (ENV_OPTIONS, IS_LEVELS, KL_ESTIMATORS, LOSS_AGG_MODES,  # noqa: F401
                     METHOD_OPTIONS, OPTION_NAMES, POLICY_LOSS_TYPES, SUPPORT_TIES, _get,
                     batch_normalisers, check_support_ties, is_correction, parse_options,
                     policy_loss_config, rollout_truncation, split_options)
from .actor import (EXPERIENCE_NAMES, PackedRows, _check_packed_per_token,  # noqa: F401
                    _inner_model, _keep_rows, _position_ids, _ring_group, check_actions,
                    fused_action_log_probs, fused_actor_loss, packed_rows)
from .trainer import (ARGS_ATTR, DRIVER_IDS_ATTR, GBC_INFO_KEYS, GIVEN_IDS_KWARG,  # noqa
                      INDEX_KEY, KEPT_ATTR, KEPT_MASS_KEY, KL_WEIGHT_KEY, REFERENCE_REFUSAL,
                      RETURN_IDS_KWARG, SCALE_KEY, _dispatch_forward, _install_worker_forward,
                      _worker_forward,
                      SUPPORT_IDS_KEY, SUPPORT_T_KEY, _PATCHES, _STATE, _actor_forward,
                      _buffer_append, _compact_rows, _info_rows, _info_support_ids,
                      _is_reference, _nthr_forget, _nthr_forward,
                      _ppo_train, _strategy_prepare, _take_pending, check_buffer, check_trainer,
                      nthr_pass, support_truncation, training_step)


# the OpenRLHF releases the drop-in is tested on (major.minor), and where its Ray trainer and
# its DeepSpeed strategy are
OPENRLHF_VERSIONS = TESTED["openrlhf"]
TRAINER_MODULE = "openrlhf.trainer.ray.ppo_actor"
STRATEGY_MODULE = "openrlhf.utils.deepspeed.deepspeed"
# the driver's experience maker (its module imports vLLM through openrlhf.trainer.ray)
EXPERIENCE_MAKER_MODULE = "openrlhf.trainer.ppo_utils.experience_maker"


def check_openrlhf_version(version: Optional[str] = None) -> str:
    """OpenRLHF's installed version, refused by name unless :data:`OPENRLHF_VERSIONS` (not
    installed: an ImportError)."""
    if version is None and installed("openrlhf") is None:
        raise ImportError("openrlhf: not installed; gbc's OpenRLHF drop-in (enable(), "
                          f"{ENV_OPTIONS}) patches its actor and trainer")
    return check_release("openrlhf", version,
                         why="gbc replaces methods of its Actor, ActorPPOTrainer and replay "
                             "buffer, which change between releases")


def _patch_trainer(cls):
    _PATCHES.set(cls, "training_step", training_step)
    _PATCHES.set(cls, "ppo_train", _ppo_train)


def enable(actor_cls=None, trainer_cls=None, buffer_cls=None, strategy_cls=None,
           **options) -> None:
    """Patch OpenRLHF in this process (docs/openrlhf.md). ``options``: ``MethodOptions``'s and
    other ``PolicyLossConfig`` fields (none: :data:`ENV_OPTIONS`'s, errors naming it); the
    classes default to OpenRLHF's (``trainer_cls=False`` / ``strategy_cls=False``: leave it).
    OpenRLHF's Ray trainer (its module imports vLLM) is patched now if imported, else right
    after its import; with ``support`` on, so is its ``DeepspeedStrategy.prepare`` (which hands
    each model the arguments its no-grad passes rebuild the sampler's kept set from), and with
    one set per rollout its driver's ``RemoteExperienceMaker._dispatch_forward`` (which hands
    the actor's kept ids to the reference model's workers), each now or right after its
    module's import. A bad
    option, OpenRLHF missing or a release outside :data:`OPENRLHF_VERSIONS` raises, and nothing
    is patched."""
    check_openrlhf_version()
    if options:
        opts, loss_options = split_options(options)
    else:
        try:
            opts, loss_options = split_options(parse_options(os.environ.get(ENV_OPTIONS)))
        except ValueError as exc:
            text = str(exc)
            raise ValueError(text if text.startswith(ENV_OPTIONS)
                             else f"{ENV_OPTIONS}: {text}") from None
    _STATE.methods, _STATE.options = opts, loss_options
    if actor_cls is None:
        from openrlhf.models import Actor as actor_cls
    _PATCHES.set(actor_cls, "forward", _actor_forward)
    if trainer_cls is None:
        _PATCHES.on_import(TRAINER_MODULE, lambda module: _patch_trainer(module.ActorPPOTrainer))
    elif trainer_cls:                                                # False: leave it
        _patch_trainer(trainer_cls)
    if opts.support is not None:
        if strategy_cls is None:
            _PATCHES.on_import(STRATEGY_MODULE, lambda module: _PATCHES.set(
                module.DeepspeedStrategy, "prepare", _strategy_prepare))
        elif strategy_cls:                                           # False: leave it
            _PATCHES.set(strategy_cls, "prepare", _strategy_prepare)
    if opts.one_set_per_rollout:      # the driver hands the actor's kept ids to the reference
        _PATCHES.on_import(EXPERIENCE_MAKER_MODULE, lambda module: _PATCHES.set(
            module.RemoteExperienceMaker, "_dispatch_forward", _dispatch_forward))
    if opts.nthr or opts.critical_kl_exponent is not None or opts.support == "kept_mass" \
            or opts.one_set_per_rollout:
        if buffer_cls is None:
            from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer as buffer_cls
        _PATCHES.set(buffer_cls, "append", _buffer_append)


def disable() -> None:
    """Undo :func:`enable` (every patched class gets its own method back)."""
    _PATCHES.undo()
    _STATE.methods, _STATE.options = methods.MethodOptions(), {}
    _STATE.kept_mass_actor = _STATE.support_actor = False
    _nthr_forget()
