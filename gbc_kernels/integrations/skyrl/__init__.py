"""SkyRL 0.3.0 (docs/skyrl.md): its registered policy losses as gbc configs (:mod:`.losses`)
and gbc's fused loss inside its FSDP policy worker (:mod:`.worker`, :mod:`.fsdp`), switched on
by :func:`enable` in the process that builds SkyRL's models.
"""

import os

from .losses import (SKYRL_KL_TYPES, SKYRL_LOSS_TYPES, SKYRL_REFUSED, policy_loss_config,
                     policy_loss_inputs, skyrl_loss_metrics)

__all__ = ["SKYRL_KL_TYPES", "SKYRL_LOSS_TYPES", "SKYRL_REFUSED", "enable", "policy_loss_config",
           "policy_loss_inputs", "skyrl_loss_metrics"]


def enable(cfg=None, **method_options):
    """Put gbc's FSDP policy and reference workers in place of SkyRL's
    (``skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker.PolicyWorker`` / ``RefWorker``, the
    names SkyRL's ``BasePPOExp`` builds its models from): call it before ``exp.run()`` in the
    process that runs it. ``method_options``: AR / Lopti (``ar_alpha=0.3``, ``lopti_eta=0.5``),
    carried to the Ray workers as ``GBC_SKYRL_OPTIONS`` in their runtime environment (a value
    set in this process's environment is used when none are given). ``cfg``: SkyRL's config
    (its ``trainer`` section is checked now: ``check_config``). A bad option, a loss gbc
    cannot reproduce or a missing dependency stops here, naming SkyRL's option. Returns the
    method options."""
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
        check_config(losses_trainer(cfg), opts)
    env = {"env_vars": {ENV: "1", OPTIONS_ENV: text}}
    os.environ[ENV], os.environ[OPTIONS_ENV] = "1", text
    fsdp_worker.PolicyWorker = ray.remote(num_gpus=1, runtime_env=env)(fsdp.GBCFSDPPolicyWorker)
    fsdp_worker.RefWorker = ray.remote(num_gpus=1, runtime_env=env)(fsdp.GBCFSDPRefWorker)
    return opts


def losses_trainer(cfg):
    """SkyRL's ``trainer`` section of ``cfg`` (``cfg`` itself when it is that section)."""
    from .losses import get

    trainer = get(cfg, "trainer")
    return cfg if trainer is None else trainer
