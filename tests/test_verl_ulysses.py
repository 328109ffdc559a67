"""gbc's engine on verl 0.9.1's FSDP engine under Ulysses sequence parallelism
(``ulysses_sequence_parallel_size``), against verl's own stock engine at the same SP size.

What runs is verl's: its ``FSDPEngineWithLMHead`` with its Ulysses device mesh, its input
slicing (``ulysses_pad_and_slice_inputs``), its attention patch (``_ulysses_flash_attention_forward``:
all-to-all over the SP group around flash-attn's varlen kernel), its output gather
(``gather_outputs_and_unpad``) and loss. CPU bypasses beyond those of tests/test_verl_engine.py:
- the device name verl's module reads at import (for the Ulysses mesh) is "cpu";
- flash-attn's varlen kernel is ``tests/standins/flash_attn`` (exact attention on torch's SDPA,
  each packed sequence causal on its own);
- transformers asks for a GPU before it dispatches to flash-attn: the model is built with SDPA
  and switched to ``flash_attention_2`` after verl built it (the attention interface is read at
  each forward), and transformers' lazy import of flash-attn returns the stand-in's functions.
"""

from __future__ import annotations

import functools
import os
import sys
import zlib

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import spawn_gloo  # noqa: E402

pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")

from test_other_trainers import VERL_AGGS, VERL_MODES, verl_actor_config  # noqa: E402
from test_verl_engine import (_grads, _metric_values, _params, make_batch,  # noqa: E402
                              make_model_dir, verl_on_cpu)


def flash_on_cpu():
    """transformers' flash-attn functions are the stand-in's (loaded by path: a ``flash_attn``
    on ``sys.path`` would also take verl's padding helpers)."""
    import importlib.util

    import transformers.modeling_flash_attention_utils as fau

    spec = importlib.util.spec_from_file_location(
        "gbc_flash_attn_standin",
        os.path.join(HERE, "standins", "flash_attn", "flash_attn_interface.py"))
    fa = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fa)
    fau._lazy_imports = lambda *a, **k: (fa.flash_attn_func, fa.flash_attn_varlen_func,
                                         fa.flash_attn_with_kvcache, fau._pad_input,
                                         fau._unpad_input)
    return fa


def build_engine(model_dir, sp, gbc=True, options=None, lr=1e-2, optimizer="AdamW"):
    """verl's FSDP2 engine (or gbc's on top of it) with Ulysses SP ``sp``, fp32, flash-attn
    (the stand-in) as verl's Ulysses path needs."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from gbc_kernels.integrations import hf
    from gbc_kernels.integrations import verl_engine as ve

    verl_on_cpu()
    flash_on_cpu()
    import verl.workers.engine.fsdp.transformer_impl as ti
    ti.device_name = "cpu"      # read at import, before the CPU platform was installed
    mc = HFModelConfig(path=model_dir, use_remove_padding=True,
                       override_config={"attn_implementation": "sdpa"})
    ec = FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, model_dtype="fp32",
                          ulysses_sequence_parallel_size=sp,
                          mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                           "buffer_dtype": "fp32"})
    oc = FSDPOptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1e6, optimizer=optimizer)
    cls = FSDPEngineWithLMHead
    if gbc:
        cls = ve.engine_class(FSDPEngineWithLMHead)
        cls.gbc_options = options or ve.EngineOptions()
    torch.manual_seed(0)
    engine = cls(mc, ec, oc, CheckpointConfig())
    engine.initialize()
    hf.unwrap(engine.module).config._attn_implementation = "flash_attention_2"
    return engine


def _forward_backward(engine, data, loss_fn, stock):
    """One mini-batch's forward/backward (no optimizer step) in verl's train mode (it sets the
    Ulysses group), through verl's stock forward step or gbc's."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    if stock:
        engine.forward_step = functools.partial(FSDPEngineWithLMHead.forward_step, engine)
    try:
        with engine.train_mode():
            engine.optimizer_zero_grad()
            torch.manual_seed(1234)
            out = engine.forward_backward_batch(data.clone(), loss_fn, forward_only=False)
            grads = _grads(engine)
    finally:
        engine.__dict__.pop("forward_step", None)
    return sum(out["loss"]), _metric_values(out["metrics"]), grads


def _infer(engine, data, stock):
    """compute_log_prob's pass: log-probs, entropy, sum of squared probabilities, padded."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.padding import no_padding_2_padding

    data = data.clone()
    tu.assign_non_tensor(data, calculate_sum_pi_squared=True)
    if stock:
        engine.forward_step = functools.partial(FSDPEngineWithLMHead.forward_step, engine)
    try:
        with engine.eval_mode():
            o = engine.infer_batch(data, loss_function=None)
    finally:
        engine.__dict__.pop("forward_step", None)
    return {k: no_padding_2_padding(o["model_output"][k], data)
            for k in ("log_probs", "entropy", "sum_pi_squared")}


def _case(mode, agg):
    if mode == "geo_mean" and agg.startswith("seq-mean"):
        return (mode, agg, None, 0.0, 0.8)
    return (mode, agg, "low_var_kl", 0.01, 0.8)


GROUP, NB = 4, 8


def _cases():
    """Each of verl's loss modes once, its aggregations in turn (each several times), KL and
    an entropy term on, except for geo_mean's sequence aggregations (its policy term alone)."""
    return [_case(mode, VERL_AGGS[i % len(VERL_AGGS)]) for i, mode in enumerate(VERL_MODES)]


def _worker(rank, world, model_dir, sp, cases, methods=True):
    """On one engine (gbc's, with verl's stock forward step swapped in for its results), at
    Ulysses SP ``sp`` (every SP rank holds the same micro-batches): verl's and gbc's loss,
    metrics and gradients for each case; both forward-only passes; gbc's NTHR scales, its
    critical-KL reference pass, and the parameters after an update with each method."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from gbc_kernels.integrations import verl_engine as ve

    engine = build_engine(model_dir, sp, lr=0.5, optimizer="SGD")
    dp, dp_rank = world // sp, rank // sp
    out = {"cases": []}
    for mode, agg, kl, ent, temp in cases:
        cfg = verl_actor_config(mode, agg, kl, entropy_coeff=ent)
        loss_fn = functools.partial(ppo_loss, config=cfg)
        seed = zlib.crc32(f"{mode}{agg}{kl}{dp_rank}".encode()) % 10_000
        data = make_batch(seed, 6, temperature=temp, world=dp, lengths=(7, 9))
        out["cases"].append({which: _forward_backward(engine, data, loss_fn, which == "verl")
                             for which in ("verl", "gbc")})
    data = make_batch(7 + dp_rank, 6, world=dp, temperature="per-sample", lengths=(7, 9))
    out["infer"] = {which: _infer(engine, data, which == "verl") for which in ("verl", "gbc")}
    if not methods:
        return out
    # critical-token KL's reference pass (the trainer's metadata, through infer_batch)
    data = make_batch(11, NB, group=GROUP, world=dp, lengths=(7, 9))
    td = data.clone()
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False, **{
        ve.CERTAINTY_KEY: dict(critical_kl_exponent=0.5, critical_kl_intercept=0.0,
                               critical_kl_certainty="max_prob", critical_kl_temperature=0.25)})
    with engine.eval_mode():
        o = engine.infer_batch(td, loss_function=None)["model_output"]
    out["critical_kl"] = [no_padding_2_padding(o[k], data)
                          for k in ("log_probs", ve.KL_WEIGHT_KEY)]
    # NTHR's pass, then one update with each method (SGD: linear in the gradient)
    cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl", entropy_coeff=0.01)
    loss_fn = functools.partial(ppo_loss, config=cfg)
    steps = []
    for opts in (dict(nthr=True, nthr_beta=0.0), dict(lopti_eta=0.5), dict(ar_alpha=0.3)):
        type(engine).gbc_options = ve.EngineOptions(**opts)
        d = data.clone()
        if "nthr" in opts:
            with engine.eval_mode():
                engine.gbc_nthr_pass(d)
            out["nthr_scale"] = d[ve.SCALE_KEY].clone()
        with engine.train_mode():
            m = _metric_values(engine.train_batch(d, loss_fn)["metrics"])
        steps.append((m, _params(engine)))
    out["steps"] = steps
    return out
