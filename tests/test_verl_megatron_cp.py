"""gbc inside verl 0.9.1's Megatron engine on long-context layouts, against verl's stock
``MegatronEngineWithLMHead`` (same harness as tests/test_verl_megatron.py, whose docstring says
what is bypassed on CPU): the packed ``thd`` layout (``use_remove_padding=True``, verl's
default) end to end. megatron's local attention refuses packed sequences; the layers' core
attention is tests/standins/megatron_cpu.py's ``packed_core_attention`` (per-sequence causal
attention over ``PackedSeqParams``' ``cu_seqlens``) and the model uses RoPE (verl's packed
forward passes no position ids; megatron's RoPE takes each sequence's positions from
``cu_seqlens``)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("verl.workers.engine.megatron.transformer_impl")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import megatron_cpu, spawn_gloo  # noqa: E402


def _model(tp, sp, seed=0, dtype=torch.float64):
    """megatron's groups, the shims and a tiny RoPE ``GPTModel`` whose core attention takes
    packed sequences (bshd batches get the causal mask in place of verl's padding mask)."""
    import test_verl_megatron as tvm
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    mc = megatron_cpu()
    mc.install_shims()
    schedules.torch = tvm._CpuTorch()
    mc.init_parallel(tp)
    group = parallel_state.get_tensor_model_parallel_group()

    def causal(module, args, kwargs):
        m = kwargs.get("attention_mask")
        if m is not None and m.dim() == 2:
            kwargs["attention_mask"] = mc.causal_mask(m.shape[1])
        return args, kwargs

    model = mc.tiny_gpt(tvm.VP, hidden=tvm.H, seq=32, layers=2, tp=tp, sp=sp and tp > 1,
                        seed=seed, dtype=dtype, position="rope",
                        core_attention=mc.packed_core_attention())
    model.config.finalize_model_grads_func = (
        lambda models, *a, **k: [mc.allreduce_sp_norm_grads(m, group) for m in models])
    model.register_forward_pre_hook(causal, with_kwargs=True)
    return model


def _thd_worker(rank, world, tp, cases):
    """Per case (loss mode, aggregation, KL, sequence parallel, layout): verl's stock engine
    and gbc's ``forward_backward_batch`` on fresh copies of one model."""
    import test_verl_megatron as tvm
    from test_verl_engine import make_batch

    results = {}
    for name, (mode, agg, kl, sp, fmt) in cases.items():
        res = {}
        for gbc in (False, True):
            model = _model(tp, sp)
            engine = tvm._engine(model, gbc=gbc, use_remove_padding=fmt == "thd")
            torch.manual_seed(1234)
            data = make_batch(5, 4, rmpad=False, vocab=tvm.VOCAB)
            out = engine.forward_backward_batch(data, tvm._loss_fn(mode, agg, kl),
                                                forward_only=False)
            res[gbc] = dict(loss=sum(out["loss"]), logp=tvm._responses(out, "log_probs", data),
                            entropy=tvm._responses(out, "entropy", data),
                            metrics=tvm._metric_values(out["metrics"]), grads=tvm._grads(model))
        results[name] = res
    return results


THD_CASES = {"thd_vanilla_token_mean_kl": ("vanilla", "token-mean", True, False, "thd"),
             "thd_gspo_seq_mean_sp": ("gspo", "seq-mean-token-mean", False, True, "thd"),
             "bshd_vanilla_token_mean_kl": ("vanilla", "token-mean", True, False, "bshd")}


@pytest.fixture(scope="module")
def thd_trained():
    return spawn_gloo(2, _thd_worker, 2, THD_CASES)


@pytest.mark.slow
def test_thd_training_step_equals_verl_stock_engine(thd_trained):
    """use_remove_padding=True (thd) at TP 2, with and without sequence parallelism: gbc's
    engine and verl's stock engine give the same loss, log_probs, entropy, verl's metrics and
    every parameter's gradient (float64 model)."""
    import test_verl_megatron as tvm

    tvm._check(thd_trained)


@pytest.mark.slow
def test_thd_equals_bshd(thd_trained):
    """The packed layout and the padded one give the same loss, log_probs, entropy and
    gradients (the stand-in's per-sequence causal attention and RoPE positions are right)."""
    import test_verl_megatron as tvm

    for per_rank in thd_trained:
        thd, bshd = per_rank["thd_vanilla_token_mean_kl"], per_rank["bshd_vanilla_token_mean_kl"]
        for gbc in (False, True):
            a, b = thd[gbc], bshd[gbc]
            assert abs(float(a["loss"]) - float(b["loss"])) < 1e-7
            tvm._close(a["logp"], b["logp"], 1e-6, "log_probs")
            tvm._close(a["entropy"], b["entropy"], 1e-6, "entropy")
            for k in a["grads"]:
                tvm._close(a["grads"][k], b["grads"][k], 1e-6, f"grad {k}")


@pytest.mark.parametrize("cu", [None, "short"])
def test_packed_batch_without_cu_seqlens_refused(cu):
    """A thd batch whose packed_seq_params lack cu_seqlens_q_padded (or carry the wrong
    number of offsets) is refused naming use_remove_padding, before the head runs."""
    import test_verl_megatron as tvm
    from test_verl_engine import make_batch

    from gbc_kernels.integrations.verl_megatron import response_rows

    packed = make_batch(10, 5, rmpad=True, vocab=tvm.VOCAB)
    offsets = None if cu is None else torch.arange(5, dtype=torch.int32) * 14   # 5, not 6
    with pytest.raises(ValueError, match="use_remove_padding.*cu_seqlens_q_padded"):
        response_rows(packed, "thd", (1, 70), offsets)
