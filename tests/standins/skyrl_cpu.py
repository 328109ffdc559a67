"""SkyRL 0.3.0 on this CPU test machine (loaded by path, as megatron_cpu.py):

* Python 3.11: ``skyrl/tinker/types.py`` declares a ``typing.TypedDict`` inside a pydantic model,
  which pydantic refuses below Python 3.12; that one module is imported with
  ``typing_extensions.TypedDict`` in its place (SkyRL's code unchanged).
* ``skyrl.backends.skyrl_train.workers.model_wrapper`` imports ``flash_attn.bert_padding`` at
  import time: the flash-attn stand-in (tests/standins/flash_attn, every function raises) is on
  the path for that import only; the unpadded path that would call it is not used.
* ``trainer.remove_microbatch_padding`` (SkyRL's default, packed micro-batches on
  flash-attention): ``policy_worker(..., packed=True)`` runs the model on the varlen stand-in
  (``varlen_attention.py``: each packed sequence attends to itself, boundaries from the
  positions, as transformers' ``flash_attention_2`` without a mask) and puts that stand-in's
  working ``unpad_input`` / ``pad_input`` into SkyRL's ``model_wrapper`` (which imported the
  raising flash-attn stand-in's).
* ``entrypoint_imports``: ``torchdata`` and ``httpx`` (SkyRL's ``BasePPOExp`` module imports
  them; a worker-loading test reaches neither), when absent, as modules whose every name is
  ``object``.
* ``torch.cuda.current_device()`` (the worker moves each micro-batch there): ``cpu_device()``
  gives "cpu" inside its block.
* ``policy_worker``: a SkyRL policy worker object as its FSDP ``init_model`` leaves it (model in
  SkyRL's HFModelWrapper, SkyRL's FSDPStrategy, an SGD optimizer), without Ray or CUDA.
"""

import contextlib
import os
import sys
import types
import typing

HERE = os.path.dirname(os.path.abspath(__file__))


def load():
    """Import SkyRL's policy-loss utilities, model wrapper and workers; returns the modules."""
    import typing_extensions

    if "skyrl.tinker.types" not in sys.modules:
        orig = typing.TypedDict
        typing.TypedDict = typing_extensions.TypedDict
        try:
            import skyrl.tinker.types  # noqa: F401
        finally:
            typing.TypedDict = orig
    sys.path.insert(0, HERE)
    try:
        from skyrl.backends.skyrl_train.utils import ppo_utils, torch_utils
        from skyrl.backends.skyrl_train.workers import model_wrapper, worker
    finally:
        sys.path.remove(HERE)
        for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
            del sys.modules[name]
    from skyrl.train.config import config
    return types.SimpleNamespace(ppo_utils=ppo_utils, torch_utils=torch_utils,
                                 model_wrapper=model_wrapper, worker=worker, config=config)


@contextlib.contextmanager
def cpu_device():
    """``torch.cuda.current_device()`` returns "cpu" inside the block."""
    import torch

    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = real


class _Names(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return object


def entrypoint_imports():
    """``torchdata`` and ``httpx`` as stand-ins, where they are not installed, until
    :func:`remove_entrypoint_standins` (tests/conftest.py calls it after every test: other
    libraries probe for these modules, and a stand-in without ``__spec__`` breaks them)."""
    import importlib.util

    for top, names in (("torchdata", ("torchdata", "torchdata.stateful_dataloader")),
                       ("httpx", ("httpx",))):
        if top not in sys.modules and importlib.util.find_spec(top) is None:
            for name in names:
                sys.modules[name] = _Names(name)


def remove_entrypoint_standins():
    """Take :func:`entrypoint_imports`' stand-ins out of ``sys.modules``."""
    for name in [n for n, m in sys.modules.items() if isinstance(m, _Names)]:
        del sys.modules[name]


def use_packing(model):
    """Run ``model`` on the varlen stand-in; SkyRL's model wrapper on its pad helpers."""
    sys.path.insert(0, HERE)
    try:
        import varlen_attention as va
    finally:
        sys.path.remove(HERE)
    from skyrl.backends.skyrl_train.workers import model_wrapper

    va.register()
    model_wrapper.unpad_input, model_wrapper.pad_input = va.unpad_input, va.pad_input
    model.config._attn_implementation = va.ATTN_IMPLEMENTATION


def policy_worker(cls, algorithm, model, world=1, micro=2, lr=0.5, temperature=0.8,
                  packed=False, sp=1, groups=None):
    """``cls`` (SkyRL's ``FSDPPolicyWorkerBase`` or a subclass) built around ``model`` (a
    transformers causal LM, FSDP2-sharded or not) for ``world`` data-parallel ranks of the
    default process group: SkyRL's TrainerConfig with ``algorithm`` and ``micro`` sequences per
    micro-batch, HFModelWrapper, FSDPStrategy (no gradient clipping), SGD(lr), a constant
    scheduler. ``packed``: ``remove_microbatch_padding=True`` (:func:`use_packing`). ``sp``:
    SkyRL's Ulysses SP size (``world // sp`` data-parallel ranks; the caller set SkyRL's
    Ulysses group and attention patch, as its ``init_model`` does); ``groups``: the device
    mesh's groups by name ("dp", "sp"; default: the default group)."""
    from types import SimpleNamespace

    import torch
    from skyrl.backends.skyrl_train.distributed.fsdp_strategy import FSDPStrategy
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
    from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper
    from skyrl.train.config.config import FSDPConfig, OptimizerConfig, TrainerConfig

    w = cls.__new__(cls)
    cfg = TrainerConfig()
    cfg.algorithm = algorithm
    cfg.algorithm.temperature = temperature
    cfg.remove_microbatch_padding = packed
    cfg.micro_train_batch_size_per_gpu = micro
    cfg.micro_forward_batch_size_per_gpu = micro
    w.cfg = cfg
    if packed:
        use_packing(model)
    w.model = HFModelWrapper(model, use_flash_attention_2=packed,
                             remove_microbatch_padding=packed, sequence_parallel_size=sp)
    w.sequence_parallel_size = sp
    w.optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    w.scheduler = torch.optim.lr_scheduler.LambdaLR(w.optimizer, lambda s: 1.0)
    w.strategy = FSDPStrategy(FSDPConfig(), OptimizerConfig(max_grad_norm=1e9))
    w.strategy.world_size = world
    w.mesh_rank = SimpleNamespace(dp_size=world // sp)
    w.device_mesh = SimpleNamespace(get_group=lambda name: (groups or {}).get(name))
    w.policy_loss_fn = PolicyLossRegistry.get(algorithm.policy_loss_type)
    return w
