"""SkyRL 0.3.0 (docs/skyrl.md): its registered policy losses as gbc configs (:mod:`.losses`)
and gbc's fused loss inside its FSDP policy worker (:mod:`.worker`, :mod:`.fsdp`), switched on
by :func:`enable` in the process that runs SkyRL's trainer; its Megatron strategy is refused
(:data:`MEGATRON_REFUSAL`).
"""

import os
import sys
import types

from .losses import (SKYRL_KL_TYPES, SKYRL_LOSS_TYPES, SKYRL_REFUSED, get, policy_loss_config,
                     policy_loss_inputs, skyrl_loss_metrics)

__all__ = ["MEGATRON_REFUSAL", "SKYRL_KL_TYPES", "SKYRL_LOSS_TYPES", "SKYRL_REFUSED", "enable",
           "policy_loss_config", "policy_loss_inputs", "skyrl_loss_metrics"]


# SkyRL's Megatron workers: the module its BasePPOExp imports them from under
# trainer.strategy=megatron, and why gbc refuses that strategy (docs/skyrl.md, "Megatron")
MEGATRON_WORKER = "skyrl.backends.skyrl_train.workers.megatron.megatron_worker"
MEGATRON_REFUSAL = (
    "trainer.strategy='megatron': gbc's SkyRL workers run on SkyRL's FSDP backend only "
    "(trainer.strategy=fsdp); SkyRL 0.3.0's Megatron worker imports megatron-bridge, whose "
    "wheel requires Transformer Engine (CUDA builds only) and transformers<5, and gbc's fused "
    "loss is not wired into it (docs/skyrl.md)")


class _RefusedModule(types.ModuleType):
    """Stands in ``sys.modules`` for SkyRL's Megatron worker module once gbc is switched on:
    importing a name from it (``BasePPOExp`` does, under ``trainer.strategy=megatron``)
    raises :data:`MEGATRON_REFUSAL`, so that strategy never runs SkyRL's own loss silently."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ValueError(MEGATRON_REFUSAL)


def enable(cfg=None, **method_options):
    """Put gbc's FSDP policy and reference workers in place of SkyRL's
    (``skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker.PolicyWorker`` / ``RefWorker``, the
    names SkyRL's ``BasePPOExp`` builds its models from): call it before ``exp.run()`` in the
    process that runs it, which also patches SkyRL's trainer there (:mod:`.trainer`: the
    critical-token KL weights and NTHR's groups in its training batch). ``method_options``:
    the four methods (``ar_alpha=0.3``, ``lopti_eta=0.5``, ``nthr=True``,
    ``critical_kl_exponent=2.0``, ...), carried to the Ray workers as ``GBC_SKYRL_OPTIONS``
    in their runtime environment (a value set in this process's environment is used when
    none are given). ``cfg``: SkyRL's config
    (its ``trainer`` section is checked now: ``check_config``). A bad option, a loss gbc
    cannot reproduce or a missing dependency stops here, naming SkyRL's option.
    ``trainer.strategy=megatron`` is refused: here when ``cfg`` says so, else where SkyRL's
    ``BasePPOExp`` imports its Megatron workers (:class:`_RefusedModule`). Returns the method
    options."""
    from gbc_kernels import methods

    from .worker import ENV, OPTIONS_ENV, check_config, method_options as parse

    try:
        import ray
        from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker
    except ImportError as err:
        raise ImportError(f"{ENV}: gbc's SkyRL workers need SkyRL 0.3.0's FSDP worker "
                          f"(pip install --no-deps skyrl==0.3.0, and what it imports: "
                          f"docs/skyrl.md): {err}") from err
    from . import fsdp

    if method_options:
        opts = methods.MethodOptions.from_kwargs(**method_options)
        text = ",".join(f"{k}={v}" for k, v in method_options.items())
    else:
        text = os.environ.get(OPTIONS_ENV, "")
    opts = parse(text)
    if cfg is not None:
        trainer = losses_trainer(cfg)
        if get(trainer, "strategy", "fsdp") == "megatron":
            raise ValueError(MEGATRON_REFUSAL)
        check_config(trainer, opts)
    sys.modules[MEGATRON_WORKER] = _RefusedModule(MEGATRON_WORKER)
    env = {"env_vars": {ENV: "1", OPTIONS_ENV: text}}
    os.environ[ENV], os.environ[OPTIONS_ENV] = "1", text
    from .trainer import patch_trainer
    patch_trainer()
    fsdp_worker.PolicyWorker = ray.remote(num_gpus=1, runtime_env=env)(fsdp.GBCFSDPPolicyWorker)
    fsdp_worker.RefWorker = ray.remote(num_gpus=1, runtime_env=env)(fsdp.GBCFSDPRefWorker)
    return opts


def losses_trainer(cfg):
    """SkyRL's ``trainer`` section of ``cfg`` (``cfg`` itself when it is that section)."""
    trainer = get(cfg, "trainer")
    return cfg if trainer is None else trainer
