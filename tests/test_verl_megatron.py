"""gbc inside verl 0.9.1's Megatron engine (integrations/verl_megatron.py), against verl's stock
``MegatronEngineWithLMHead`` on the same tiny megatron-core ``GPTModel`` and micro-batches, on
CPU: two gloo ranks, tensor parallel 2 (tests/standins/megatron_cpu.py holds the CPU shims).

What runs is verl's: its ``forward_backward_batch`` (micro-batching, global-batch normalisers),
its ``forward_step`` and ``model_forward`` (``bshd`` packing and unpacking), its
``postprocess_micro_batch_func``, megatron's no-pipelining schedule and backward, verl's
``ppo_loss``. Bypassed on CPU (said here):
- ``MegatronEngine.__init__``/``initialize`` (mbridge from a HF checkpoint, DDP, the distributed
  optimizer): the engine is ``object.__new__`` plus what the step reads (verl's own
  ``McoreEngineConfig``; a model config with the architecture, pad id and ``mtp``; the model's
  ``TransformerConfig``; ``module = [GPTModel]`` unwrapped); the optimizer (Lopti) is SGD behind
  megatron's ``step() -> (ok, grad_norm, zeros)``;
- the ``thd`` packing (``use_remove_padding=True``): megatron's local attention has no packed
  sequences; the tests run ``bshd`` with the causal mask in place of verl's ``[B, S]`` padding
  mask (exact for the valid rows of right-padded causal sequences, for both engines alike);
  gbc's ``thd`` row mapping is checked against verl's ``preprocess_thd_engine`` instead;
- megatron's schedule allocates its token counter with ``device="cuda"`` (made CPU here), and
  its ``finalize_model_grads`` is the sequence-parallel norms' gradient all-reduce only.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("verl.workers.engine.megatron.transformer_impl")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import VocabWatcher, spawn_gloo  # noqa: E402

VP, VOCAB, H = 64, 50, 24        # the model's padded vocabulary, the ids used, hidden size


class _CpuTorch:
    """``torch`` for megatron's schedules module, with its ``device="cuda"`` counter on CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _mc():
    """tests/standins/megatron_cpu.py, by path: the standins folder also holds a flash-attn
    stand-in that verl's padding helpers must not find."""
    import importlib.util

    if "megatron_cpu" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "megatron_cpu", os.path.join(HERE, "standins", "megatron_cpu.py"))
        sys.modules["megatron_cpu"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["megatron_cpu"])
    return sys.modules["megatron_cpu"]


def _setup(tp, sp, seed=0, dtype=torch.float64):
    """megatron's groups, the shims, a tiny GPTModel (its sequence-parallel norms' gradients
    summed by the schedule's ``finalize_model_grads``)."""
    mc = _mc()
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    mc.install_shims()
    schedules.torch = _CpuTorch()
    mc.init_parallel(tp)
    model = mc.tiny_gpt(VP, hidden=H, seq=32, tp=tp, sp=sp and tp > 1, seed=seed, dtype=dtype)
    group = parallel_state.get_tensor_model_parallel_group()
    model.config.finalize_model_grads_func = (
        lambda models, *a, **k: mc.allreduce_sp_norm_grads(models[0], group))

    def causal(module, args, kwargs):     # verl's [B, S] padding mask -> the causal mask
        m = kwargs.get("attention_mask")
        if m is not None and m.dim() == 2:
            kwargs["attention_mask"] = mc.causal_mask(m.shape[1])
        return args, kwargs

    model.register_forward_pre_hook(causal, with_kwargs=True)
    return model


def _engine(model, gbc=True, options=None, **config):
    """verl's Megatron engine (or gbc's) on ``model`` without ``initialize`` (docstring)."""
    from verl.workers.config import McoreEngineConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from gbc_kernels.integrations import verl_engine as ve
    from gbc_kernels.integrations import verl_megatron as vm

    cls = vm.GBCMegatronEngineWithLMHead if gbc else MegatronEngineWithLMHead
    engine = object.__new__(cls)
    cfg = dict(tensor_model_parallel_size=model.config.tensor_model_parallel_size,
               sequence_parallel=model.config.sequence_parallel, use_remove_padding=False)
    cfg.update(config)
    engine.engine_config = McoreEngineConfig(**cfg)
    engine.model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(architectures=["Qwen2ForCausalLM"]),
        tokenizer=types.SimpleNamespace(pad_token_id=0),
        mtp=types.SimpleNamespace(enable=False, enable_train=False))
    engine.tf_config = model.config
    engine.module = [model]
    engine.enable_routing_replay = False
    if gbc:
        engine.gbc_options = options or ve.EngineOptions()
    return engine


def _batch(seed=5, B=4, **kw):
    from test_verl_engine import make_batch

    return make_batch(seed, B, rmpad=False, vocab=VOCAB, **kw)


def _loss_fn(mode="vanilla", agg="token-mean", kl=True, entropy_coeff=0.01, **extra):
    import functools

    from test_other_trainers import verl_actor_config
    from verl.workers.utils.losses import ppo_loss

    cfg = verl_actor_config(mode, agg, "low_var_kl" if kl else None,
                            entropy_coeff=entropy_coeff, **extra)
    return functools.partial(ppo_loss, config=cfg)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _responses(out, key, data):
    """A per-token output of verl's engine in the response layout ``[B, T]`` (verl's
    ``no_padding_2_padding``), 0 off the response mask."""
    from verl.workers.utils.padding import no_padding_2_padding

    v = no_padding_2_padding(out["model_output"][key], data)
    return v * data["response_mask"].to_padded_tensor(0) if data["response_mask"].is_nested \
        else v * data["response_mask"]


def _train_worker(rank, world, tp, sp, cases):
    """Per case: stock and gbc forward_backward_batch on fresh copies of one model."""
    results = {}
    for name, (mode, agg, kl) in cases.items():
        res = {}
        for gbc in (False, True):
            model = _setup(tp, sp)
            engine = _engine(model, gbc=gbc)
            torch.manual_seed(1234)
            data = _batch()
            out = engine.forward_backward_batch(data, _loss_fn(mode, agg, kl),
                                                forward_only=False)
            res[gbc] = dict(loss=sum(out["loss"]), logp=_responses(out, "log_probs", data),
                            entropy=_responses(out, "entropy", data), metrics=out["metrics"],
                            grads=_grads(model))
        results[name] = res
    return results


def _close(a, b, tol, what):
    assert a.shape == b.shape, what
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol, msg=what)


def _check(results, tol=1e-6):
    for r, per_rank in enumerate(results):
        for name, res in per_rank.items():
            stock, ours = res[False], res[True]
            what = f"rank {r} {name}"
            assert abs(float(stock["loss"]) - float(ours["loss"])) < tol * 0.1, what
            _close(stock["logp"], ours["logp"], 1e-6, what + " log_probs")
            _close(stock["entropy"], ours["entropy"], 1e-6, what + " entropy")
            assert stock["grads"].keys() == ours["grads"].keys()
            for k in stock["grads"]:
                _close(stock["grads"][k], ours["grads"][k], tol, f"{what} grad {k}")
            for k, v in stock["metrics"].items():
                assert k in ours["metrics"], (what, k)


CASES = {"vanilla_token_mean_kl": ("vanilla", "token-mean", True),
         "gspo_seq_mean": ("gspo", "seq-mean-token-mean", False)}


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_training_step_equals_verl_stock_engine(sp):
    _check(spawn_gloo(2, _train_worker, 2, sp, CASES))
