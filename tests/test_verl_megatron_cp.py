"""gbc inside verl 0.9.1's Megatron engine on long-context layouts, against verl's stock
``MegatronEngineWithLMHead`` (same harness as tests/test_verl_megatron.py, whose docstring says
what is bypassed on CPU): the packed ``thd`` layout (``use_remove_padding=True``, verl's
default) end to end. megatron's local attention refuses packed sequences; the layers' core
attention is tests/standins/megatron_cpu.py's ``packed_core_attention`` (per-sequence causal
attention over ``PackedSeqParams``' ``cu_seqlens``) and the model uses RoPE (verl's packed
forward passes no position ids; megatron's RoPE takes each sequence's positions from
``cu_seqlens``). Context parallelism: the harness is checked first (verl's stock engine in
thd at CP 2 equals CP 1); the same stand-in, at CP > 1, all-gathers K/V over the CP group and
masks by each token's position in megatron's load-balanced layout (each sequence in ``2·cp``
chunks, rank ``r`` holding chunks ``r`` and ``2·cp - 1 - r``). verl packs for CP only in thd
(its bshd preprocessing asserts CP 1). gbc's engine at CP 2 is then checked against verl's
stock engine at CP 2 (TP 1; TP 2 with sequence parallelism; pipeline parallel 2; every loss
mode gbc runs under CP; ``calculate_per_token_loss``; megatron DDP's ``main_grad``), and with
AR, critical-token KL and Lopti against CP 1. The harness's ``finalize_model_grads`` sums the
sequence-parallel norms' gradients and, in megatron's per-token regime, divides every gradient
by the token count as megatron's does; there is no DDP (each rank keeps its own gradients)."""

from __future__ import annotations

import functools
import os
import sys
import zlib

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("verl.workers.engine.megatron.transformer_impl")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import megatron_cpu, spawn_gloo  # noqa: E402


def _model(tp, sp, seed=0, dtype=torch.float64, cp=1, pp=1):
    """megatron's groups, the shims and a tiny RoPE ``GPTModel`` whose core attention takes
    packed sequences (bshd batches get the causal mask in place of verl's padding mask); under
    pipeline parallel ``pp``, this rank's stage (one of the two layers)."""
    import test_verl_megatron as tvm
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    mc = megatron_cpu()
    mc.install_shims()
    schedules.torch = tvm._CpuTorch()
    mc.init_parallel(tp, cp=cp, pp=pp)
    group = parallel_state.get_tensor_model_parallel_group()

    def causal(module, args, kwargs):
        m = kwargs.get("attention_mask")
        if m is not None and m.dim() == 2:
            kwargs["attention_mask"] = mc.causal_mask(m.shape[1])
        return args, kwargs

    model = mc.tiny_gpt(tvm.VP, hidden=tvm.H, seq=32, layers=2, tp=tp, sp=sp and tp > 1,
                        seed=seed, dtype=dtype, position="rope",
                        core_attention=mc.packed_core_attention())
    model.config.finalize_model_grads_func = functools.partial(_finalize, group=group)
    model.register_forward_pre_hook(causal, with_kwargs=True)
    return model


def _finalize(models, num_tokens=None, *args, group, **kwargs):
    """megatron's ``finalize_model_grads`` without DDP: the sequence-parallel norms' gradients
    summed over the tensor-parallel group; with ``calculate_per_token_loss`` (``num_tokens``
    given), every gradient divided by the token count broadcast from the last pipeline stage
    and summed over the data-and-context-parallel group, as megatron's does."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    for m in models:
        megatron_cpu().allreduce_sp_norm_grads(m, group)
    if num_tokens is not None:
        n = num_tokens.clone()
        dist.broadcast(n, src=mpu.get_pipeline_model_parallel_last_rank(),
                       group=mpu.get_pipeline_model_parallel_group())
        dist.all_reduce(n, group=mpu.get_data_parallel_group(with_context_parallel=True))
        for m in models:
            for p in m.parameters():
                if p.grad is not None and n > 0:
                    p.grad.div_(n)


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


def _cp_worker(rank, world, cp, gbc_flags=(False,)):
    """verl's engine in thd at context parallel ``cp`` (TP 1): the loss, the log-probs and
    entropy (verl gathers them over the CP group), the metrics and the gradients."""
    import test_verl_megatron as tvm
    from test_verl_engine import make_batch

    res = {}
    for gbc in gbc_flags:
        model = _model(1, False, cp=cp)
        engine = tvm._engine(model, gbc=gbc, use_remove_padding=True, context_parallel_size=cp)
        torch.manual_seed(1234)
        data = make_batch(5, 4, rmpad=False, vocab=tvm.VOCAB)
        out = engine.forward_backward_batch(data, tvm._loss_fn("vanilla", "token-mean", True),
                                            forward_only=False)
        res[gbc] = dict(loss=sum(out["loss"]), logp=tvm._responses(out, "log_probs", data),
                        entropy=tvm._responses(out, "entropy", data),
                        metrics=tvm._metric_values(out["metrics"]), grads=tvm._grads(model))
    return res


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

    from gbc_kernels.integrations.verl.megatron import response_rows

    packed = make_batch(10, 5, rmpad=True, vocab=tvm.VOCAB)
    offsets = None if cu is None else torch.arange(5, dtype=torch.int32) * 14   # 5, not 6
    with pytest.raises(ValueError, match="use_remove_padding.*cu_seqlens_q_padded"):
        response_rows(packed, "thd", (1, 70), offsets)


@pytest.mark.parametrize("lengths,what", [
    (None, "use_remove_padding.*cu_seqlens_q_padded"),
    ([8, 6, 4, 8, 4], "context_parallel_size: 2 .* sequence 1 a padded length of 6"),
    ([8, 4, 2, 8, 4], "context_parallel_size: 2 .* sequence 2 a padded length of 2"),
    ([8, 4, 0, 8, 4], "context_parallel_size: 2 .* sequence 2 a padded length of 0"),
    ([8, 4, 4, 8], "use_remove_padding.*cu_seqlens_q_padded.*6 values")])
def test_context_parallel_packing_refused(lengths, what):
    """Under context parallelism the packing must split into megatron's ``2·cp`` chunks: a thd
    batch without ``cu_seqlens_q_padded``, with a padded length that ``2·cp`` does not divide,
    one shorter than ``2·cp`` chunks, or the wrong number of offsets is refused naming the
    option, before the head computes anything; verl's own padding (each length a multiple of
    ``2·cp``) passes."""
    import test_verl_megatron as tvm
    from test_verl_engine import make_batch

    from gbc_kernels.integrations.verl.megatron import cp_response_rows

    packed = make_batch(10, 5, rmpad=True, vocab=tvm.VOCAB)
    cu = None if lengths is None else torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    with pytest.raises(ValueError, match=what):
        cp_response_rows(packed, cu, 2, 0)
    n = packed["input_ids"].offsets().diff()            # verl's alignment: up to 2·cp·tp
    cu = torch.cat([torch.zeros(1), ((n + 3) // 4 * 4).cumsum(0)]).to(torch.int32)
    rows, valid, own = cp_response_rows(packed, cu, 2, 0)
    assert own.any() and (valid & ~own).any()


@pytest.mark.slow
def test_stock_engine_context_parallel_2_equals_1():
    """The harness for context parallelism: verl's stock engine in thd at CP 2 (two gloo
    ranks, tests/standins' CP attention gathering K/V over the CP group with megatron's
    load-balanced chunk positions) gives CP 1's loss, log-probs, entropy and metrics on every
    rank, and CP 1's gradients once each parameter's gradient is averaged over the CP ranks
    (what megatron's DDP does over its data-and-context-parallel group)."""
    import test_verl_megatron as tvm

    one = spawn_gloo(1, _cp_worker, 1)[0][False]
    two = [res[False] for res in spawn_gloo(2, _cp_worker, 2)]
    for r, s in enumerate(two):
        assert abs(float(one["loss"]) - float(s["loss"])) < 1e-9, r
        tvm._close(one["logp"], s["logp"], 1e-9, f"rank {r} log_probs")
        tvm._close(one["entropy"], s["entropy"], 1e-9, f"rank {r} entropy")
        for k, v in one["metrics"].items():
            tvm._close(torch.tensor(v), torch.tensor(s["metrics"][k]), 1e-6, f"rank {r} {k}")
    assert one["grads"].keys() == two[0]["grads"].keys()
    for k, g in one["grads"].items():
        tvm._close(g, (two[0]["grads"][k] + two[1]["grads"][k]) / 2, 1e-9, f"grad {k}")
        assert not torch.allclose(two[0]["grads"][k], two[1]["grads"][k]) or g.abs().sum() == 0


def _cp_gbc_worker(rank, world, cp, cases, tp=1, sp=False):
    """Per case (loss mode, aggregation, KL term, gbc's method options): verl's stock engine
    (``None`` options) or gbc's in thd at context parallel ``cp`` (tensor parallel ``tp``,
    sequence parallel ``sp``) — the training step and a forward-only pass (log-probs, entropy,
    sum of squared probabilities)."""
    import test_verl_megatron as tvm
    from test_verl_engine import make_batch

    from gbc_kernels.integrations.verl import engine as ve

    results = {}
    for name, (mode, agg, kl, variants) in cases.items():
        res = {}
        for key, opts in variants.items():
            gbc = opts is not None
            model = _model(tp, sp, cp=cp)
            engine = tvm._engine(model, gbc=gbc, use_remove_padding=True,
                                 context_parallel_size=cp,
                                 options=ve.EngineOptions(**opts) if gbc else None)
            torch.manual_seed(1234)
            data = make_batch(5, 4, rmpad=False, vocab=tvm.VOCAB)
            critical = gbc and opts.get("critical_kl_exponent") is not None
            if critical:      # the training step's per-token KL weights (fixed draws)
                g = torch.Generator().manual_seed(3)
                mask = data["response_mask"]
                data[ve.KL_WEIGHT_KEY] = torch.nested.as_nested_tensor(
                    [torch.rand(m.shape, generator=g) * m for m in mask.unbind()],
                    layout=torch.jagged) if mask.is_nested else (
                    torch.rand(mask.shape, generator=g) * mask)
            out = engine.forward_backward_batch(data, tvm._loss_fn(mode, agg, kl),
                                                forward_only=False)
            res[key] = dict(loss=sum(out["loss"]), logp=tvm._responses(out, "log_probs", data),
                            entropy=tvm._responses(out, "entropy", data),
                            metrics=tvm._metric_values(out["metrics"]), grads=tvm._grads(model))
            data = make_batch(7, 4, rmpad=False, vocab=tvm.VOCAB)
            inf = tvm._infer(engine, data, calculate_entropy=True)
            res[key]["infer"] = {k: tvm._responses(inf, k, data)
                                 for k in ("log_probs", "entropy", "sum_pi_squared")}
            if critical:      # the reference pass: log-probs and the critical-token weights
                from verl.utils import tensordict_utils as tu

                data = make_batch(8, 4, rmpad=False, vocab=tvm.VOCAB)
                tu.assign_non_tensor(data, **{ve.CERTAINTY_KEY: {
                    k: opts.get(k, getattr(ve.EngineOptions(), k))
                    for k in ve.CRITICAL_KL_FIELDS}})
                ref = engine.infer_batch(data, loss_function=None)
                res[key]["infer"].update(
                    ref_logp=tvm._responses(ref, "log_probs", data),
                    kl_weight=tvm._responses(ref, ve.KL_WEIGHT_KEY, data))
        results[name] = res
    return results


CP_CASES = {"vanilla_token_mean_kl": ("vanilla", "token-mean", True,
                                      {False: None, True: {}}),
            "gspo_seq_mean_token_mean": ("gspo", "seq-mean-token-mean", False,
                                         {False: None, True: {}}),
            "ar_seq_mean_token_sum_kl": ("vanilla", "seq-mean-token-sum", True,
                                         {"ar": {"ar_alpha": 0.3}}),
            "critical_kl_token_mean": ("vanilla", "token-mean", True,
                                       {"ar": {"critical_kl_exponent": 0.5,
                                               "critical_kl_temperature": 0.25}})}


@pytest.fixture(scope="module")
def cp_trained():
    return spawn_gloo(2, _cp_gbc_worker, 2, CP_CASES)


@pytest.mark.slow
def test_context_parallel_2_equals_verl_stock_engine(cp_trained):
    """context_parallel_size=2 in thd (two gloo ranks, each holding 2 of every sequence's 4
    load-balanced chunks): gbc's engine — the rank's tokens into the loss, its sequence terms
    reduced over the CP group, the per-token outputs back in verl's layout before verl's CP
    gather — gives verl's stock engine's loss, log_probs, entropy, metrics and every
    parameter's gradient on each rank (token-mean with a KL term; GSPO's seq-mean-token-mean),
    and its forward-only log-probs, entropy and sum of squared probabilities."""
    _check_against_stock(cp_trained)


@pytest.mark.slow
def test_context_parallel_2_with_tensor_parallel_2_equals_verl_stock_engine():
    """CP 2 composed with TP 2 and sequence parallelism (four gloo ranks): gbc's engine equals
    verl's stock engine as at TP 1 (token-mean with KL, GSPO's seq-mean-token-mean)."""
    cases = {k: CP_CASES[k] for k in ("vanilla_token_mean_kl", "gspo_seq_mean_token_mean")}
    _check_against_stock(spawn_gloo(4, _cp_gbc_worker, 2, cases, 2, True))


def _check_against_stock(results, tol=1e-6):
    """Per rank and case: gbc's loss, log_probs, entropy, verl's metrics, every parameter's
    gradient and the forward-only outputs equal verl's stock engine's."""
    import test_verl_megatron as tvm

    stock_cases = [{k: v for k, v in per_rank.items() if False in v} for per_rank in results]
    for r, per_rank in enumerate(stock_cases):
        for name, res in per_rank.items():
            # float32 batch fields: the loss's sequence sums are added in another order (each
            # rank's part, then over the CP group) than verl's whole-sequence sums
            stock, ours = float(res[False]["loss"]), float(res[True]["loss"])
            assert abs(stock - ours) <= 1e-5 * abs(stock) + 1e-7, (r, name, stock, ours)
            res[True]["loss"] = res[False]["loss"]
    tvm._check(stock_cases, tol)
    for r, per_rank in enumerate(stock_cases):
        for name, res in per_rank.items():
            for k, v in res[False].get("infer", {}).items():
                tvm._close(v, res[True]["infer"][k], 1e-6, f"rank {r} {name} infer {k}")


@pytest.mark.slow
def test_context_parallel_2_equals_1_with_ar_and_critical_kl(cp_trained):
    """gbc's methods, which have no stock counterpart — AR (a seq-mean-token-sum loss with a KL
    term) and critical-token KL (its reference pass's log-probs and weights, and a training
    step with per-token KL weights): at CP 2 gbc's engine gives CP 1's loss, log_probs,
    entropy, verl's metrics and forward-only outputs on every rank, and CP 1's gradients once
    each parameter's gradient is averaged over the CP ranks (megatron's DDP over data and
    context parallel)."""
    names = ("ar_seq_mean_token_sum_kl", "critical_kl_token_mean")
    ones = spawn_gloo(1, _cp_gbc_worker, 1, {n: CP_CASES[n] for n in names})[0]
    for name in names:
        _check_cp_1(ones[name]["ar"], [per_rank[name]["ar"] for per_rank in cp_trained])
    assert "actor/gbc_ar_weight_mean" in ones[names[0]]["ar"]["metrics"]
    assert float(ones[names[1]]["ar"]["infer"]["kl_weight"].abs().sum()) > 0


def _check_cp_1(one, two):
    """CP 2's ranks ``two`` against CP 1's ``one`` (the gradients averaged over CP ranks)."""
    import test_verl_megatron as tvm

    for r, s in enumerate(two):
        assert abs(float(one["loss"]) - float(s["loss"])) <= 1e-5 * abs(float(one["loss"])), r
        tvm._close(one["logp"], s["logp"], 1e-6, f"rank {r} log_probs")
        tvm._close(one["entropy"], s["entropy"], 1e-6, f"rank {r} entropy")
        assert one["metrics"].keys() == s["metrics"].keys()
        for k, v in one["metrics"].items():
            tvm._close(torch.tensor(v), torch.tensor(s["metrics"][k]), 1e-5, f"rank {r} {k}")
        for k, v in one["infer"].items():
            tvm._close(v, s["infer"][k], 1e-6, f"rank {r} infer {k}")
    for k, g in one["grads"].items():
        tvm._close(g, (two[0]["grads"][k] + two[1]["grads"][k]) / 2, 1e-6, f"grad {k}")


def _cp_modes_worker(rank, world, cp, cases):
    """On one model at context parallel ``cp`` (thd, TP 1), per case (loss mode, aggregation,
    KL term, megatron's ``calculate_per_token_loss``): verl's stock engine's training step and
    gbc's on a fresh batch, the gradients zeroed between them; then gbc's step of the first
    case with megatron DDP's float32 ``main_grad`` and hook on the output weight (the weight's
    gradient read from ``main_grad``)."""
    import test_verl_megatron as tvm
    from test_verl_engine import make_batch

    model = _model(1, False, cp=cp)

    def step(gbc, mode, agg, kl, seed, lengths=(6, 7)):
        model.zero_grad(set_to_none=True)
        engine = tvm._engine(model, gbc=gbc, use_remove_padding=True, context_parallel_size=cp)
        torch.manual_seed(1234)
        data = make_batch(seed, 4, rmpad=False, vocab=tvm.VOCAB, lengths=lengths)
        out = engine.forward_backward_batch(data, tvm._loss_fn(mode, agg, kl),
                                            forward_only=False)
        return dict(loss=sum(out["loss"]), logp=tvm._responses(out, "log_probs", data),
                    entropy=tvm._responses(out, "entropy", data),
                    metrics=tvm._metric_values(out["metrics"]), grads=tvm._grads(model))

    results = {}
    for name, (mode, agg, kl, per_token, *lengths) in cases.items():
        model.config.calculate_per_token_loss = per_token
        seed = zlib.crc32(f"{mode}{agg}".encode()) % 10_000
        results[name] = {gbc: step(gbc, mode, agg, kl, seed, *lengths) for gbc in (False, True)}
    model.config.calculate_per_token_loss = False
    name, (mode, agg, kl, _) = next(iter(cases.items()))
    w = model.output_layer.weight
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    w.grad_added_to_main_grad = False

    def hook(p):            # DistributedDataParallel._make_backward_post_hook's rule
        if p.grad is not None and not p.grad_added_to_main_grad:
            p.main_grad.add_(p.grad)
        p.grad = None

    handle = w.register_post_accumulate_grad_hook(hook)
    got = step(True, mode, agg, kl, zlib.crc32(f"{mode}{agg}".encode()) % 10_000)
    handle.remove()
    assert "output_layer.weight" not in got["grads"] and w.grad_added_to_main_grad
    got["grads"]["output_layer.weight"] = w.main_grad.clone()
    results["main_grad"] = {False: results[name][False], True: got}
    return results


def _mode_cases():
    """Each of verl's loss modes gbc runs under CP (not Clip-Cov / KL-Cov, refused), its
    aggregations in turn (each at least once), a KL and an entropy term on (geo_mean's
    sequence aggregations: its policy term alone); then megatron's per-token loss regime
    (``calculate_per_token_loss``) on a token-mean and a sequence-mean case; and sequences
    shorter than ``2·cp`` tokens (verl pads each to ``2·cp``: a chunk of one token)."""
    from test_other_trainers import VERL_AGGS, VERL_MODES

    modes = [m for m in VERL_MODES if m not in ("clip_cov", "kl_cov")]
    cases = {}
    for i, mode in enumerate(modes):
        agg = VERL_AGGS[i % len(VERL_AGGS)]
        cases[f"{mode}_{agg}"] = (mode, agg, not (mode == "geo_mean" and
                                                 agg.startswith("seq-mean")), False)
    cases["per_token_vanilla_token_mean"] = ("vanilla", "token-mean", True, True)
    cases["per_token_gspo_seq_mean_token_mean"] = ("gspo", "seq-mean-token-mean", False, True)
    # every sequence 2 or 3 tokens long, shorter than 2·cp = 4 chunks: verl pads it to 4
    cases["short_sequences_gspo_seq_mean_token_sum"] = ("gspo", "seq-mean-token-sum", True,
                                                        False, (1, 2))
    return cases


@pytest.mark.slow
def test_context_parallel_2_every_loss_mode_equals_verl_stock_engine():
    """context_parallel_size=2 in thd, one model, verl's stock step and gbc's in turn: for each
    of verl's loss modes gbc runs under CP (each aggregation at least once, KL and entropy
    terms), and under megatron's ``calculate_per_token_loss`` (verl's per-token branch:
    the loss times the global token count, megatron dividing every gradient by the tokens
    summed over data and context ranks), gbc's loss, log_probs, entropy, verl's metrics and
    every parameter's gradient equal the stock engine's on both CP ranks; with megatron DDP's
    ``main_grad`` on the output weight, gbc's step puts the stock engine's weight gradient
    there (the weight keeps none); and with every sequence shorter than ``2·cp`` tokens."""
    import test_verl_megatron as tvm

    cases = _mode_cases()
    results = spawn_gloo(2, _cp_modes_worker, 2, cases)
    assert set(results[0]) == set(cases) | {"main_grad"}
    for per_rank in results:     # the per-token regime (same batch) scales the gradients
        a = per_rank["per_token_vanilla_token_mean"][False]["grads"]
        b = per_rank["vanilla_token-mean"][False]["grads"]
        assert max(float((a[k] - b[k]).abs().max()) for k in a) > 1e-6
    for r, per_rank in enumerate(results):     # main_grad is float32, the model float64
        mg = per_rank["main_grad"]
        for k in mg[False]["grads"]:
            tvm._close(mg[False]["grads"][k], mg[True]["grads"][k], 1e-5, f"rank {r} {k}")
        mg[True]["grads"] = mg[False]["grads"]
    for per_rank in results:     # token-sum losses are in the tens: each gradient compared
        for res in per_rank.values():      # relative to its largest entry (float32 batch)
            for k, g in res[False]["grads"].items():
                top = max(1.0, float(g.abs().max()))
                res[False]["grads"][k], res[True]["grads"][k] = g / top, res[True]["grads"][k] / top
    _check_against_stock(results, tol=2e-6)


def _lopti_cp_worker(rank, world, cp):
    """Lopti (``lopti_eta=0.5``) at context parallel ``cp`` in thd: the parameters and the
    metrics after ``train_batch`` (its two updates) on each of two mini-batches; SGD behind
    megatron's optimizer interface, each gradient first averaged over the data-and-context
    parallel ranks (what megatron's DDP does)."""
    import torch.distributed as dist
    import test_verl_megatron as tvm
    from megatron.core import parallel_state as mpu
    from test_verl_engine import make_batch

    from gbc_kernels.integrations.verl import engine as ve

    class AveragedSGD(tvm._SGD):
        def step(self):
            group = mpu.get_data_parallel_group(with_context_parallel=True)
            for p in self.params:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
                    p.grad /= dist.get_world_size(group)
            return super().step()

    model = _model(1, False, cp=cp)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    tvm._trainable(model)
    engine = tvm._engine(model, use_remove_padding=True, context_parallel_size=cp,
                         options=ve.EngineOptions(lopti_eta=0.5))
    engine.optimizer = AveragedSGD(model, 0.5)
    metrics = []
    for seed in (20, 21):
        data = make_batch(seed, 4, rmpad=False, vocab=tvm.VOCAB, confident=0.4)
        metrics.append(tvm._metric_values(engine.train_batch(data, tvm._loss_fn())["metrics"]))
    return dict(params={n: p.detach().clone() for n, p in model.named_parameters()},
                init=init, metrics=metrics)


@pytest.mark.slow
def test_context_parallel_2_lopti_equals_1():
    """Lopti's ``train_batch`` (two updates per mini-batch, the low-probability tokens' then
    the rest) at context_parallel_size=2 in thd gives CP 1's parameters after two mini-batches
    on both CP ranks, and CP 1's metrics (both phases' gradient norms among them, reported by
    CP rank 0 as verl reports them)."""
    one = spawn_gloo(1, _lopti_cp_worker, 1)[0]
    moved = max(float((one["params"][k] - one["init"][k]).abs().max()) for k in one["params"])
    assert moved > 1e-3
    assert {"grad_norm", "gbc_grad_norm_second_phase"} <= set(one["metrics"][0])
    for r, two in enumerate(spawn_gloo(2, _lopti_cp_worker, 2)):
        for k, p in one["params"].items():
            assert float((p - two["params"][k]).abs().max()) <= 1e-6 * moved, (r, k)
        for a, b in zip(one["metrics"], two["metrics"]):
            # the gradient norms: on CP rank 0 only (verl's is_mp_src_rank_with_outputs)
            assert set(b) == set(a) - ({"grad_norm", "gbc_grad_norm_second_phase"} if r else set())
            for k in b:
                for x, y in zip(a[k], b[k]):
                    assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), (r, k, x, y)


def _pp_cp_worker(rank, world, pp, cp):
    """Pipeline parallel ``pp`` × context parallel ``cp`` in thd (megatron's 1F1B schedule over
    gloo's point-to-point ops; each stage's CP ranks exchange their own halves of the packed
    micro-batch): verl's stock engine and gbc's on the same stages — a training step (every
    parameter's gradient on every stage; the loss, log-probs, entropy and metrics on the last)
    and a forward-only pass."""
    import test_verl_megatron as tvm
    from megatron.core import parallel_state as mpu
    from test_verl_engine import make_batch, verl_on_cpu

    verl_on_cpu()
    out = {"train": {}, "infer": {}}
    for gbc in (False, True):
        model = _model(1, False, cp=cp, pp=pp)
        last = mpu.is_pipeline_last_stage(ignore_virtual=True)
        engine = tvm._engine(model, gbc=gbc, use_remove_padding=True, context_parallel_size=cp)
        torch.manual_seed(1234)
        data = make_batch(5, 4, rmpad=False, vocab=tvm.VOCAB)
        res = engine.forward_backward_batch(data, tvm._loss_fn("gspo", "seq-mean-token-mean"),
                                            forward_only=False)
        out["train"][gbc] = dict(grads=tvm._grads(model), keys=sorted(res))
        if last:
            out["train"][gbc].update(
                loss=sum(res["loss"]), logp=tvm._responses(res, "log_probs", data),
                entropy=tvm._responses(res, "entropy", data),
                metrics=tvm._metric_values(res["metrics"]))
        data = make_batch(7, 4, rmpad=False, vocab=tvm.VOCAB)
        res = tvm._infer(engine, data, calculate_entropy=True)
        out["infer"][gbc] = ({k: tvm._responses(res, k, data)
                              for k in ("log_probs", "entropy", "sum_pi_squared")}
                             if last else sorted(res))
    out["last"] = last
    return out


@pytest.mark.slow
def test_pipeline_2_context_parallel_2_equals_verl_stock_engine():
    """Pipeline parallel 2 × context parallel 2 in thd (four gloo ranks; megatron's 1F1B
    schedule, each stage's two CP ranks holding every sequence's load-balanced chunks; GSPO's
    seq-mean-token-mean, the sequence terms reduced over the CP group): on every stage every
    parameter's gradient equals verl's stock engine's (the first stage's through megatron's
    point-to-point backward); on the last stage the loss, log-probs, entropy, verl's metrics
    and the forward-only outputs do."""
    import test_verl_megatron as tvm

    results = spawn_gloo(4, _pp_cp_worker, 2, 2)
    assert [out["last"] for out in results] == [False, False, True, True]
    for r, out in enumerate(results):
        stock, ours = out["train"][False], out["train"][True]
        what = f"rank {r}"
        assert stock["grads"].keys() == ours["grads"].keys() and stock["grads"]
        assert float(sum(g.abs().sum() for g in ours["grads"].values())) > 0
        for k in stock["grads"]:
            tvm._close(stock["grads"][k], ours["grads"][k], 1e-6, f"{what} grad {k}")
        if not out["last"]:
            assert stock["keys"] == ours["keys"] and out["infer"][False] == out["infer"][True]
            continue
        loss = float(stock["loss"])
        assert abs(loss - float(ours["loss"])) <= 1e-5 * abs(loss) + 1e-7, what
        for k in ("logp", "entropy"):
            tvm._close(stock[k], ours[k], 1e-6, f"{what} {k}")
        for k, v in stock["metrics"].items():
            tvm._close(torch.tensor(v), torch.tensor(ours["metrics"][k]), 1e-5, f"{what} {k}")
        for k, v in out["infer"][False].items():
            assert float(v.abs().sum()) > 0
            tvm._close(v, out["infer"][True][k], 1e-6, f"{what} forward-only {k}")


@pytest.mark.parametrize("option", ["use_remove_padding", "dynamic_context_parallel"])
def test_context_parallel_refusals(option):
    """Under context_parallel_size 2, gbc's engine refuses by name what it does not run: the
    padded bshd layout (verl itself packs for context parallelism only in thd) and
    dynamic_context_parallel (NTHR runs: tests/test_verl_megatron_nthr.py)."""
    import types

    from gbc_kernels.integrations.verl import engine as ve
    from gbc_kernels.integrations.verl.megatron import _check_config

    ec = types.SimpleNamespace(context_parallel_size=2, use_remove_padding=True,
                               dynamic_context_parallel=False, qat=None)
    if option == "use_remove_padding":
        ec.use_remove_padding = False
    else:
        ec.dynamic_context_parallel = True
    engine = types.SimpleNamespace(engine_config=ec, gbc_options=ve.EngineOptions(nthr=True),
                                   model_config=types.SimpleNamespace(mtp=None))
    with pytest.raises(ValueError, match=option):
        _check_config(engine)
    ec.context_parallel_size, ec.use_remove_padding, ec.dynamic_context_parallel = 1, True, False
    _check_config(engine)       # the same engine at CP 1 runs
    ec.context_parallel_size = 2
    _check_config(engine)       # and at CP 2 in thd, NTHR on


@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_context_parallel_batch_selecting_loss_modes_refused(mode):
    """Clip-Cov and KL-Cov pick tokens from the whole batch; under context parallelism each
    rank's loss sees its own tokens, so gbc's engine refuses them naming loss_mode."""
    import test_verl_megatron as tvm

    from gbc_kernels.integrations.verl.megatron import _check_cp_loss

    with pytest.raises(ValueError, match="loss_mode.*context_parallel_size=2"):
        _check_cp_loss(tvm._loss_fn(mode), 2)
    _check_cp_loss(tvm._loss_fn("gspo"), 2)
