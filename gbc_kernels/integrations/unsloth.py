"""Unsloth drop-in: gbc's loss, objectives and methods inside Unsloth's GRPO trainer
(docs/unsloth.md).

Unsloth (``import unsloth`` on a GPU; on a CPU machine ``UNSLOTH_ZOO_DISABLE_GPU_INIT=1``, or
``UNSLOTH_ALLOW_CPU=1`` and ``unsloth.models.rl.patch_trl_rl_trainers()``) rewrites TRL's
``GRPOTrainer`` into its generated ``UnslothGRPOTrainer`` and binds ``trl.GRPOTrainer`` to it.
Imported after that (the import order of Unsloth's notebooks: ``import unsloth`` first),
``gbc_kernels.integrations.trl.GBCGRPOTrainer`` subclasses Unsloth's class, and
:class:`GBCUnslothGRPOTrainer` (built on first use of the name, from that class) runs gbc's
``_compute_loss`` and gbc's no-grad log-prob passes where Unsloth's ``compute_loss`` would run
its own (``grpo_accumulated_loss``). Unsloth keeps the generation, the rewards, its training-loop
wrappers and its DDP gradient sync. One line switches it on::

    from gbc_kernels.integrations.unsloth import GBCUnslothGRPOTrainer as GRPOTrainer

Importing this module imports nothing of Unsloth (nor does ``import gbc_kernels``): the class
is built when the name is first looked up, and refuses to be built unless Unsloth has rewritten
TRL's trainer. Unsloth's own code is called, never copied (it is AGPL).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import sys
from typing import Optional

# the releases this drop-in is tested on (``make compat ONLY=unsloth``); Unsloth rewrites TRL's
# trainer from source with replacements that change between its releases: any other is refused
TESTED = {"unsloth": ("2026.10.9",), "unsloth_zoo": ("2026.10.9",)}

# Unsloth's environment knobs that act inside the loss or the log-prob passes gbc replaces, so
# they would silently not run: refused by name when set. Value: what the knob does in Unsloth.
_ENV_REFUSED = {
    "UNSLOTH_GRPO_VLLM_IS_MODE": "the vLLM importance-sampling mode of Unsloth's loss (gbc "
                                 "follows GRPOConfig.vllm_importance_sampling_mode)",
    "UNSLOTH_GRPO_VLLM_IS_CLIP": "the importance-sampling clip of Unsloth's loss (gbc follows "
                                 "GRPOConfig.vllm_importance_sampling_cap / _clip_*)",
    "UNSLOTH_GRPO_ROLLOUT_RS": "Unsloth's rollout rejection sampling, applied in its loss",
    "UNSLOTH_GRPO_ROLLOUT_RS_THRESHOLD": "the threshold of Unsloth's rollout rejection sampling",
    "UNSLOTH_GRPO_ROLLOUT_METRICS": "metrics of Unsloth's loss",
    "UNSLOTH_GRPO_ZERO_VARIANCE_EXCLUDE": "Unsloth's per-sample weights in its loss",
    "UNSLOTH_GRPO_LOSS_AGGREGATION": "Unsloth's prompt-level aggregation in its loss",
    "UNSLOTH_GRPO_ROLLOUT_LOGPROBS_AS_OLD": "the sampler's log-probs as the old policy's, with "
                                            "Unsloth's dual clip, in its loss",
    "UNSLOTH_GRPO_TRUNCATED_SUPPORT": "Unsloth's truncated-support scoring in its log-prob "
                                      "passes (gbc's own: GBCGRPOConfig.gbc_support)",
    "UNSLOTH_GRPO_LOGPROB_RECOMPUTE": "how Unsloth's passes recompute log-probs",
    "UNSLOTH_GRPO_MAX_ROWS_PER_CHUNK": "the chunking of Unsloth's log-prob passes",
    "UNSLOTH_GRPO_CHUNKED_LOGPROBS": "the chunking of Unsloth's log-prob passes",
    "UNSLOTH_FUSED_LINEAR": "Unsloth's fused head in its log-prob passes",
    "UNSLOTH_GRPO_SEQ_PACKING": "Unsloth's sequence packing in its log-prob passes",
    "UNSLOTH_GRPO_SEQ_PACKING_VERIFY": "Unsloth's sequence packing in its log-prob passes",
    "UNSLOTH_GRPO_PREFIX_GROUPER": "Unsloth's shared-prefix grouping in its log-prob passes",
    "UNSLOTH_VLLM_FP32_LM_HEAD": "a float32 head in Unsloth's log-prob passes (gbc: "
                                 "GRPOConfig.cast_lm_head_to_fp32 or gbc_logits_dtype)",
    "UNSLOTH_FORCE_FLOAT32": "float32 autocast in Unsloth's loss (gbc's loss runs under the "
                             "config's bf16 / fp16, TRL's)",
    "UNSLOTH_RETURN_HIDDEN_STATES": "Unsloth's fast forward returning hidden states in place of "
                                    "logits (it skips the lm_head, inside which gbc's loss runs)",
}
# the same knobs set to these values ask for nothing gbc's path does not already do
_ENV_OFF = {
    "UNSLOTH_GRPO_ROLLOUT_METRICS": ("0",), "UNSLOTH_GRPO_ZERO_VARIANCE_EXCLUDE": ("0",),
    "UNSLOTH_GRPO_ROLLOUT_LOGPROBS_AS_OLD": ("0",), "UNSLOTH_GRPO_LOGPROB_RECOMPUTE": ("0",),
    "UNSLOTH_GRPO_SEQ_PACKING": ("0", "false", "no", "off"),
    "UNSLOTH_GRPO_SEQ_PACKING_VERIFY": ("0",),
    "UNSLOTH_GRPO_PREFIX_GROUPER": ("0", "false", "no", "off"),
    "UNSLOTH_GRPO_CHUNKED_LOGPROBS": ("0",), "UNSLOTH_FUSED_LINEAR": ("0",),
    "UNSLOTH_VLLM_FP32_LM_HEAD": ("0", "false", "no", "off"), "UNSLOTH_FORCE_FLOAT32": ("0",),
    "UNSLOTH_GRPO_MAX_ROWS_PER_CHUNK": ("0",), "UNSLOTH_RETURN_HIDDEN_STATES": ("0",),
}
# UnslothGRPOConfig's fields for its own loss's chunking: refused unless at their defaults
_CONFIG_REFUSED = {"unsloth_num_chunks": -1, "unsloth_logit_chunk_multiplier": None,
                   "unsloth_grpo_mini_batch": None}

_HOW = ("import unsloth first (its notebooks' order), then gbc_kernels.integrations.unsloth; on "
        "a machine without a GPU, UNSLOTH_ZOO_DISABLE_GPU_INIT=1 before `import unsloth`, or "
        "UNSLOTH_ALLOW_CPU=1 and then unsloth.models.rl.patch_trl_rl_trainers()")


def installed(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_unsloth_release(versions: Optional[dict] = None) -> dict:
    """The installed unsloth and unsloth_zoo releases, refused by name unless in :data:`TESTED`
    (``versions``: {dist: version} to check instead of the installed ones)."""
    found = {}
    for dist, tested in TESTED.items():
        version = (versions or {}).get(dist) or installed(dist)
        if version is None:
            raise ImportError(f"{dist}: not installed (gbc's Unsloth drop-in is tested on "
                              f"{dist} {', '.join(tested)})")
        if version.split("+")[0] not in tested:
            raise RuntimeError(
                f"{dist} {version}: gbc's Unsloth drop-in is tested on {dist} "
                f"{', '.join(tested)} (it runs on the trainer Unsloth generates from TRL's "
                "source, which changes between its releases); an untested release is refused "
                "rather than run; Unsloth's own GRPO loss: trl.GRPOTrainer")
        found[dist] = version
    return found


def unsloth_environment(environ=None) -> list:
    """The Unsloth knobs set in ``environ`` (default: this process's) that gbc's path would not
    honour, as error lines naming each."""
    environ = os.environ if environ is None else environ
    bad = []
    for name, what in _ENV_REFUSED.items():
        value = environ.get(name)
        if value is None or value.strip().lower() in _ENV_OFF.get(name, ()):
            continue
        bad.append(f"{name}={value!r}: {what}, which gbc's loss and log-prob passes replace; "
                   "unset it")
    return bad


def unsloth_config(args) -> list:
    """UnslothGRPOConfig's fields gbc's path would not honour (set away from their defaults)."""
    bad = []
    for name, default in _CONFIG_REFUSED.items():
        value = getattr(args, name, default)
        if value != default:
            bad.append(f"{name}={value!r}: the chunking of Unsloth's own loss, which gbc's "
                       "replaces (its fused head forms no [tokens, V] logits); unset it")
    return bad


def _unsloth_trainer_class():
    """Unsloth's generated trainer now bound to ``trl.GRPOTrainer``, or a RuntimeError saying
    why there is none."""
    if sys.modules.get("unsloth") is None:
        raise RuntimeError("GBCUnslothGRPOTrainer: Unsloth is not imported in this process; "
                           + _HOW + ". Without Unsloth, use "
                           "gbc_kernels.integrations.trl.GBCGRPOTrainer")
    import trl.trainer.grpo_trainer as grpo

    cls = grpo.GRPOTrainer
    if cls.__module__ != "UnslothGRPOTrainer":
        raise RuntimeError(
            "GBCUnslothGRPOTrainer: Unsloth has not rewritten TRL's GRPOTrainer in this process "
            f"(trl.trainer.grpo_trainer.GRPOTrainer is {cls.__module__}.{cls.__qualname__}: "
            "Unsloth's CPU backend rewrites no GRPO trainer); " + _HOW)
    return cls


def _check_gbc_base(base):
    """gbc's TRL trainer must have been built on Unsloth's class (imported after Unsloth)."""
    from .trl import GBCGRPOTrainer

    gbc_base = GBCGRPOTrainer.__mro__[1]
    if gbc_base is not base:
        raise RuntimeError(
            "GBCUnslothGRPOTrainer: gbc_kernels.integrations.trl was imported before Unsloth "
            f"rewrote TRL's GRPOTrainer (GBCGRPOTrainer's base is {gbc_base.__module__}."
            f"{gbc_base.__qualname__}, not Unsloth's {base.__module__}.{base.__qualname__}); "
            + _HOW + ", in a fresh process")
    return GBCGRPOTrainer


def _add_mode_methods(model):
    """Unsloth's generated trainer calls ``model.for_training`` / ``model.for_inference``, which
    only a model loaded by FastLanguageModel has: a transformers or PEFT model gets Unsloth's
    own (``FastLlamaModel.for_training`` / ``for_inference`` bound to it, as Unsloth binds them
    to its models)."""
    if model is None or isinstance(model, str):
        return
    if hasattr(model, "for_training") and hasattr(model, "for_inference"):
        return
    from unsloth.models.llama import FastLlamaModel

    if not hasattr(model, "for_training"):
        model.for_training = functools.partial(FastLlamaModel.for_training, model)
    if not hasattr(model, "for_inference"):
        model.for_inference = functools.partial(FastLlamaModel.for_inference, model)


def check_head(model):
    """A quantized lm_head (bitsandbytes 4-bit / 8-bit: packed integer storage) is refused: gbc's
    fused head reads the weight as a [V, H] floating-point matrix."""
    if model is None or isinstance(model, str):
        return
    from . import hf

    weight = hf.lm_head(model).weight
    if not weight.is_floating_point() or weight.dim() != 2 or type(weight).__name__ in (
            "Params4bit", "Int8Params"):
        raise ValueError(
            f"model: its lm_head weight is a {type(weight).__name__} of {weight.dtype} "
            f"{tuple(weight.shape)}, a quantized head; gbc's fused head reads a [V, H] "
            "floating-point weight: load the model with its lm_head unquantized (Unsloth "
            "quantizes the decoder layers only by default)")


def check_route(args=None, environ=None):
    """Everything the Unsloth route refuses before anything is built: Unsloth not imported or not
    rewritten, an untested release, gbc's TRL trainer imported before Unsloth, an Unsloth knob
    or config field gbc's path would not honour. Returns Unsloth's trainer class."""
    base = _unsloth_trainer_class()
    check_unsloth_release()
    _check_gbc_base(base)
    bad = unsloth_environment(environ) + (unsloth_config(args) if args is not None else [])
    if bad:
        raise ValueError("GBCUnslothGRPOTrainer: unsupported Unsloth option(s):\n  "
                         + "\n  ".join(bad))
    return base


def _build_trainer_class():
    base = _unsloth_trainer_class()
    GBCGRPOTrainer = _check_gbc_base(base)

    class GBCUnslothGRPOTrainer(GBCGRPOTrainer):
        """gbc's :class:`~gbc_kernels.integrations.trl.GBCGRPOTrainer` on Unsloth's generated
        ``UnslothGRPOTrainer``: gbc's loss and log-prob passes, Unsloth's generation, rewards,
        loop wrappers and DDP sync (docs/unsloth.md). ``args``: a ``GRPOConfig`` (Unsloth's,
        after ``import unsloth``) or a ``GBCGRPOConfig`` (gbc's options)."""

        _gbc_unsloth_route = True        # check_no_unsloth lets it through: it checks its own

        def __init__(self, model, reward_funcs, args=None, *a, **kw):
            check_route(args)            # before anything is built
            check_head(model)
            super().__init__(model, reward_funcs, args, *a, **kw)
            if args is None:             # Unsloth built its default config
                check_route(self.args)
            check_head(self.accelerator.unwrap_model(self.model))
            # Unsloth's rollout calls model.for_training (its __init__ only where they exist)
            _add_mode_methods(self.model)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            """TRL's ``compute_loss``: gbc's ``_compute_loss`` on TRL's ``[B, T]`` batch (not
            Unsloth's ``grpo_accumulated_loss`` on its left-packed one)."""
            if return_outputs:
                raise ValueError("GBCUnslothGRPOTrainer: return_outputs=True is not supported "
                                 "(GRPOTrainer's loss returns no outputs)")
            return self._compute_loss(model, inputs)

    GBCUnslothGRPOTrainer.__module__ = __name__
    return GBCUnslothGRPOTrainer


_BUILT = {}


def __getattr__(name):
    """``GBCUnslothGRPOTrainer`` (built on first lookup, on the Unsloth trainer then bound to
    ``trl.GRPOTrainer``) and ``GBCGRPOConfig`` (gbc's config, on Unsloth's ``GRPOConfig`` when
    gbc's TRL module was imported after Unsloth)."""
    if name == "GBCUnslothGRPOTrainer":
        base = _unsloth_trainer_class()
        if base not in _BUILT:
            _BUILT[base] = _build_trainer_class()
        return _BUILT[base]
    if name == "GBCGRPOConfig":
        from .trl import GBCGRPOConfig

        return GBCGRPOConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GBCUnslothGRPOTrainer", "GBCGRPOConfig", "TESTED", "check_head", "check_route",
           "check_unsloth_release", "unsloth_config", "unsloth_environment"]
