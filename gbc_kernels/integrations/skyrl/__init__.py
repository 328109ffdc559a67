"""SkyRL 0.3 and 0.4 (docs/skyrl.md): its registered policy losses as gbc configs
(:mod:`.losses`),
gbc's fused loss inside its FSDP policy worker (:mod:`.worker`, :mod:`.fsdp`) and gbc's
Megatron head inside its Megatron model wrapper (:mod:`.megatron`, :mod:`.megatron_worker`),
switched on by :func:`enable` in the process that runs SkyRL's trainer.
"""

import os

from .losses import (SKYRL_KL_TYPES, SKYRL_LOSS_TYPES, SKYRL_REFUSED, check_skyrl_version, get,
                     policy_loss_config, policy_loss_inputs, skyrl_loss_metrics)

__all__ = ["MEGATRON_NEEDS", "SKYRL_KL_TYPES", "SKYRL_LOSS_TYPES", "SKYRL_REFUSED",
           "check_skyrl_version", "enable", "policy_loss_config", "policy_loss_inputs",
           "skyrl_loss_metrics"]


# SkyRL's Megatron workers: the module its BasePPOExp imports them from under
# trainer.strategy=megatron, and what it needs (docs/skyrl.md, "Megatron")
MEGATRON_WORKER = "skyrl.backends.skyrl_train.workers.megatron.megatron_worker"
MEGATRON_NEEDS = (
    "trainer.strategy='megatron': gbc's Megatron workers are SkyRL's own, whose module "
    "imports megatron-bridge (its wheel requires Transformer Engine, CUDA builds only, and "
    "transformers<5); install them where SkyRL's Megatron backend runs")


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
    Under ``trainer.strategy=megatron``, gbc's Megatron workers go in place of SkyRL's
    (:mod:`.megatron_worker`: SkyRL's own, its model wrapper carrying gbc's head) wherever
    SkyRL's Megatron worker module imports, after :func:`.megatron.check_megatron_config`'s
    refusals when ``cfg`` says so; such a ``cfg`` where that module does not import stops here
    (:data:`MEGATRON_NEEDS`). Returns the method options."""
    from gbc_kernels import methods

    from .worker import ENV, OPTIONS_ENV, check_config, method_options as parse

    try:
        import ray
        from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker
    except ImportError as err:
        raise ImportError(f"{ENV}: gbc's SkyRL workers need SkyRL's FSDP worker "
                          f"(pip install --no-deps skyrl==0.4.0 or 0.3.0, and what it imports: "
                          f"docs/skyrl.md): {err}") from err
    check_skyrl_version()
    from . import fsdp

    if method_options:
        opts = methods.MethodOptions.from_kwargs(**method_options)
        text = ",".join(f"{k}={v}" for k, v in method_options.items())
    else:
        text = os.environ.get(OPTIONS_ENV, "")
    opts = parse(text)
    megatron = False
    if cfg is not None:
        trainer = losses_trainer(cfg)
        megatron = get(trainer, "strategy", "fsdp") == "megatron"
        if megatron:
            from .megatron import check_megatron_config
            check_megatron_config(trainer, opts)
        else:
            check_config(trainer, opts)
    env = {"env_vars": {ENV: "1", OPTIONS_ENV: text}}
    _megatron_workers(ray, env, required=megatron)
    os.environ[ENV], os.environ[OPTIONS_ENV] = "1", text
    from .trainer import patch_trainer
    patch_trainer()
    fsdp_worker.PolicyWorker = ray.remote(num_gpus=1, runtime_env=env)(fsdp.GBCFSDPPolicyWorker)
    fsdp_worker.RefWorker = ray.remote(num_gpus=1, runtime_env=env)(fsdp.GBCFSDPRefWorker)
    return opts


def _megatron_workers(ray, env, required):
    """gbc's Megatron workers in SkyRL's place where its Megatron worker module imports
    (True); where it does not, False, or an ImportError naming what it needs when
    ``required``."""
    import importlib

    try:
        megatron_worker = importlib.import_module(MEGATRON_WORKER)
        from . import megatron_worker as gbc_worker
    except ImportError as err:
        if required:
            raise ImportError(f"{MEGATRON_NEEDS}: {err}") from err
        return False
    megatron_worker.PolicyWorker = ray.remote(num_gpus=1, runtime_env=env)(
        gbc_worker.GBCMegatronPolicyWorker)
    megatron_worker.RefWorker = ray.remote(num_gpus=1, runtime_env=env)(
        gbc_worker.GBCMegatronRefWorker)
    return True


def losses_trainer(cfg):
    """SkyRL's ``trainer`` section of ``cfg`` (``cfg`` itself when it is that section)."""
    trainer = get(cfg, "trainer")
    return cfg if trainer is None else trainer
