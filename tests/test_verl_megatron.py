"""gbc inside verl 0.9.1's Megatron engine (integrations/verl/megatron.py), against verl's stock
``MegatronEngineWithLMHead`` on the same tiny megatron-core ``GPTModel`` and micro-batches, on
CPU: two gloo ranks, tensor parallel 2 (tests/standins/megatron_cpu.py holds the CPU shims);
pipeline parallel 2, alone, with tensor parallel 2 (four ranks) and with two virtual stages
per rank, under megatron's 1F1B schedules over gloo's point-to-point ops.

What runs is verl's: its ``forward_backward_batch`` (micro-batching, global-batch normalisers),
its ``forward_step`` and ``model_forward`` (``bshd`` packing and unpacking), its
``postprocess_micro_batch_func``, megatron's schedules (no pipelining; 1F1B) and backward, verl's
``ppo_loss``. Bypassed on CPU (said here):
- ``MegatronEngine.__init__``/``initialize`` (mbridge from a HF checkpoint, DDP, the distributed
  optimizer): the engine is ``object.__new__`` plus what the step reads (verl's own
  ``McoreEngineConfig``; a model config with the architecture, pad id and ``mtp``; the model's
  ``TransformerConfig``; ``module = [GPTModel]`` unwrapped); the optimizer (Lopti) is SGD behind
  megatron's ``step() -> (ok, grad_norm, zeros)``;
- the ``thd`` packing (``use_remove_padding=True``): megatron's local attention has no packed
  sequences; the tests here run ``bshd`` with the causal mask in place of verl's ``[B, S]``
  padding mask (exact for the valid rows of right-padded causal sequences, for both engines
  alike); tests/test_verl_megatron_cp.py runs ``thd`` end to end with a packed stand-in;
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

from conftest import VocabWatcher, megatron_cpu, spawn_gloo  # noqa: E402

VP, VOCAB, H = 64, 50, 24        # the model's padded vocabulary, the ids used, hidden size


class _CpuTorch:
    """``torch`` for megatron's schedules module, with its ``device="cuda"`` counter on CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


_mc = megatron_cpu


def _setup(tp, sp, seed=0, dtype=torch.float64):
    """megatron's groups, the shims, a tiny GPTModel (its sequence-parallel norms' gradients
    summed by the schedule's ``finalize_model_grads``)."""
    return _chunks(tp, sp, seed=seed, dtype=dtype)[0]


def _chunks(tp, sp, pp=1, vpp=None, seed=0, dtype=torch.float64):
    """:func:`_setup` for pipeline parallel ``pp``: this rank's model chunks, one per virtual
    stage (``vpp``; one chunk without)."""
    mc = _mc()
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    mc.install_shims()
    schedules.torch = _CpuTorch()
    mc.init_parallel(tp, pp=pp, vpp=vpp)
    group = parallel_state.get_tensor_model_parallel_group()

    def causal(module, args, kwargs):     # verl's [B, S] padding mask -> the causal mask
        m = kwargs.get("attention_mask")
        if m is not None and m.dim() == 2:
            kwargs["attention_mask"] = mc.causal_mask(m.shape[1])
        return args, kwargs

    chunks = []
    for stage in range(vpp or 1):
        model = mc.tiny_gpt(VP, hidden=H, seq=32, layers=2 * (vpp or 1), tp=tp,
                            sp=sp and tp > 1, seed=seed, dtype=dtype,
                            vp_stage=stage if vpp else None)
        model.config.finalize_model_grads_func = (
            lambda models, *a, **k: [mc.allreduce_sp_norm_grads(m, group) for m in models])
        model.register_forward_pre_hook(causal, with_kwargs=True)
        chunks.append(model)
    return chunks


def _engine(model, gbc=True, options=None, **config):
    """verl's Megatron engine (or gbc's) on ``model`` (or a rank's list of chunks) without
    ``initialize`` (docstring)."""
    from verl.workers.config import McoreEngineConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from gbc_kernels.integrations.verl import engine as ve
    from gbc_kernels.integrations.verl import megatron as vm

    cls = vm.GBCMegatronEngineWithLMHead if gbc else MegatronEngineWithLMHead
    engine = object.__new__(cls)
    chunks = model if isinstance(model, list) else [model]
    model = chunks[0]
    cfg = dict(tensor_model_parallel_size=model.config.tensor_model_parallel_size,
               pipeline_model_parallel_size=model.config.pipeline_model_parallel_size,
               virtual_pipeline_model_parallel_size=(
                   model.config.virtual_pipeline_model_parallel_size),
               sequence_parallel=model.config.sequence_parallel, use_remove_padding=False)
    cfg.update(config)
    engine.engine_config = McoreEngineConfig(**cfg)
    engine.model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(architectures=["Qwen2ForCausalLM"]),
        tokenizer=types.SimpleNamespace(pad_token_id=0),
        mtp=types.SimpleNamespace(enable=False, enable_train=False))
    engine.tf_config = model.config
    engine.module = chunks
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
    if isinstance(model, list):             # a rank's chunks (virtual pipeline stages)
        return {f"{i}.{k}": v for i, m in enumerate(model) for k, v in _grads(m).items()}
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _responses(out, key, data):
    """A per-token output of verl's engine in the response layout ``[B, T]`` (verl's
    ``no_padding_2_padding``), 0 off the response mask."""
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(out["model_output"][key], data) * _padded(data["response_mask"])


def _padded(x):
    return x.to_padded_tensor(0) if x.is_nested else x


def _train_worker(rank, world, tp, cases):
    """Per case (loss mode, aggregation, KL term, sequence parallel): stock and gbc
    ``forward_backward_batch`` on fresh copies of one model."""
    results = {}
    for name, (mode, agg, kl, sp) in cases.items():
        res = {}
        for gbc in (False, True) if tp > 1 else (True,):
            model = _setup(tp, sp)
            engine = _engine(model, gbc=gbc)
            torch.manual_seed(1234)
            data = _batch()
            out = engine.forward_backward_batch(data, _loss_fn(mode, agg, kl),
                                                forward_only=False)
            res[gbc] = dict(loss=sum(out["loss"]), logp=_responses(out, "log_probs", data),
                            entropy=_responses(out, "entropy", data),
                            metrics=_metric_values(out["metrics"]), grads=_grads(model))
        results[name] = res
    return results


def _metric_values(metrics):
    from test_verl_engine import _metric_values as values

    return values(metrics)


def _close(a, b, tol, what):
    assert a.shape == b.shape, what
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol, msg=what)


def _check(results, tol=1e-6):
    for r, per_rank in enumerate(results):
        for name, res in per_rank.items():
            stock, ours = res[False], res[True]
            what = f"rank {r} {name}"
            assert abs(float(stock["loss"]) - float(ours["loss"])) < tol * 0.1, what
            _close(stock["logp"], ours["logp"], tol, what + " log_probs")
            _close(stock["entropy"], ours["entropy"], tol, what + " entropy")
            assert stock["grads"].keys() == ours["grads"].keys()
            assert float(sum(g.abs().sum() for g in ours["grads"].values())) > 0
            for k in stock["grads"]:
                _close(stock["grads"][k], ours["grads"][k], tol, f"{what} grad {k}")
            for k, v in stock["metrics"].items():       # verl's own metrics, gbc's values
                _close(torch.tensor(v), torch.tensor(ours["metrics"][k]), 1e-5, f"{what} {k}")


CASES = {"vanilla_token_mean_kl": ("vanilla", "token-mean", True, False),
         "gspo_seq_mean_sp": ("gspo", "seq-mean-token-mean", False, True)}


@pytest.fixture(scope="module")
def trained():
    return spawn_gloo(2, _train_worker, 2, CASES)


@pytest.mark.slow
def test_training_step_equals_verl_stock_engine(trained):
    """verl's forward_backward_batch with its ppo_loss, through the stock engine and gbc's, TP=2
    with and without sequence parallelism, a padded vocabulary (ids < 50 of 64 rows): the
    loss, log_probs, entropy, verl's metrics and every parameter's gradient equal (float64
    model, float32 batch fields)."""
    _check(trained)


@pytest.mark.slow
def test_tensor_parallel_2_equals_1(trained):
    """gbc's engine at TP=1 (one process) gives TP=2's loss, log_probs and entropy."""
    name = "vanilla_token_mean_kl"
    one = spawn_gloo(1, _train_worker, 1, {name: CASES[name]})[0][name][True]
    for per_rank in trained:
        two = per_rank[name][True]
        assert abs(float(one["loss"]) - float(two["loss"])) < 1e-7
        _close(one["logp"], two["logp"], 1e-6, "log_probs")
        _close(one["entropy"], two["entropy"], 1e-6, "entropy")

def _main_grad_worker(rank, world):
    """verl's training step through the stock engine (its weight gradient) and gbc's, whose
    output weight carries megatron DDP's float32 ``main_grad``, ``grad_added_to_main_grad`` and
    gradient hook (the rule of ``DistributedDataParallel._make_backward_post_hook``)."""
    out = {}
    for gbc in (False, True):
        model = _setup(world, sp=True)
        w = model.output_layer.weight
        if gbc:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
            w.grad_added_to_main_grad = False

            def hook(p):
                if p.grad is not None and not p.grad_added_to_main_grad:
                    p.main_grad.add_(p.grad)
                p.grad = None

            w.register_post_accumulate_grad_hook(hook)
        torch.manual_seed(1234)
        data = _batch()
        res = _engine(model, gbc=gbc).forward_backward_batch(data, _loss_fn(), False)
        grads = _grads(model)
        if gbc:
            assert "output_layer.weight" not in grads and w.grad_added_to_main_grad
            grads["output_layer.weight"] = w.main_grad.clone()
        out[gbc] = dict(loss=sum(res["loss"]), grads=grads)
    return out


@pytest.mark.slow
def test_training_step_adds_the_head_gradient_into_main_grad():
    """With megatron DDP's float32 ``main_grad`` on the output weight (a real run's set-up),
    gbc's engine takes the processor's main_grad route: ``main_grad`` holds the stock engine's
    weight gradient, the weight keeps none, and every other gradient and the loss are the stock
    engine's (TP=2 with sequence parallelism)."""
    for r, res in enumerate(spawn_gloo(2, _main_grad_worker)):
        stock, ours = res[False], res[True]
        assert abs(float(stock["loss"]) - float(ours["loss"])) < 1e-7, r
        assert stock["grads"].keys() == ours["grads"].keys()
        for k in stock["grads"]:       # main_grad is float32, the model float64
            _close(stock["grads"][k], ours["grads"][k], 1e-5, f"rank {r} grad {k}")


class _SGD:
    """SGD behind megatron's optimizer interface (``step() -> (ok, grad_norm, zeros)``)."""

    def __init__(self, model, lr):
        self.params = [p for _, p in _named(model) if p.requires_grad]
        self.opt = torch.optim.SGD(self.params, lr=lr)

    def zero_grad(self, set_to_none=True):
        self.opt.zero_grad(set_to_none=True)

    def step(self):
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in self.params
                              if p.grad is not None))
        self.opt.step()
        return True, float(norm), None


def _trainable(model, lr=0.5):
    for chunk in model if isinstance(model, list) else [model]:
        chunk.zero_grad_buffer = lambda: None       # megatron's DDP buffer (none here)
    return _SGD(model, lr)


def _named(model):
    """``named_parameters`` of a model or of a rank's chunks (virtual pipeline stages)."""
    if isinstance(model, list):
        return [(f"{i}.{n}", p) for i, m in enumerate(model) for n, p in m.named_parameters()]
    return list(model.named_parameters())


def _infer(engine, data, **flags):
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(data, calculate_sum_pi_squared=True, **flags)
    return engine.infer_batch(data, loss_function=None)


def _methods_worker(rank, world, tp, sp):
    """Forward-only passes (stock and gbc), critical-KL weights with the reference rows, a
    dispatch watcher, Lopti's two updates (train_batch and by hand), gbc's training loss."""
    from gbc_kernels.integrations.verl import engine as ve

    out = {}
    for gbc in (False, True):
        model = _setup(tp, sp)
        data = _batch(seed=7)
        res = _infer(_engine(model, gbc=gbc), data)
        out[f"infer{int(gbc)}"] = {k: _responses(res, k, data)
                                   for k in ("log_probs", "entropy", "sum_pi_squared")}
    # critical-token KL's reference pass, and the rows gbc_reference needs
    model = _setup(tp, sp)
    opts = ve.EngineOptions(critical_kl_exponent=0.5, critical_kl_temperature=0.25)
    data = _batch(seed=8, micro=4)
    from verl.utils import tensordict_utils as tu
    tu.assign_non_tensor(data, **{ve.CERTAINTY_KEY: {k: getattr(opts, k)
                                                     for k in ve.CRITICAL_KL_FIELDS}})
    res = _infer(_engine(model, options=opts), data)
    out["critical"] = dict(logp=_responses(res, "log_probs", data),
                           w=_responses(res, ve.KL_WEIGHT_KEY, data),
                           **_head_oracle([model], data, tp, sp))
    # no [N, V/tp] logits on gbc's path (a training step and a forward-only pass)
    os.environ["GBC_CHUNK_MB"] = "0.001"     # several chunks
    model = _setup(tp, sp)
    data = _batch(seed=9, B=12, micro=12)
    watched = {}
    for gbc in (True, False):
        engine = _engine(model, gbc=gbc)
        with VocabWatcher(VP // tp) as w:
            engine.forward_backward_batch(data.clone(), _loss_fn(), forward_only=False)
            _infer(engine, data.clone())
        watched[gbc] = [s for s in w.seen if s not in ((VP // tp, H), (H, VP // tp))]
    del os.environ["GBC_CHUNK_MB"]
    out["watch"] = dict(gbc=watched[True], stock=watched[False],
                        n_tokens=int(_padded(data["response_mask"]).sum()))
    # gbc's thd rows against verl's own packing (preprocess_thd_engine, TP=2 alignment)
    from verl.models.mcore.util import preprocess_thd_engine

    from gbc_kernels.integrations.verl.megatron import response_rows
    from test_verl_engine import make_batch
    packed = make_batch(10, 5, rmpad=True, vocab=VOCAB)
    labels, psp, _ = preprocess_thd_engine(packed["input_ids"], pre_process=True, need_roll=True)
    rows, valid = response_rows(packed, "thd", labels.shape, psp.cu_seqlens_q_padded)
    out["thd"] = dict(got=torch.where(valid, labels.reshape(-1)[rows], -1),
                      want=torch.where(valid, _padded(packed["responses"]), -1),
                      padded=bool((psp.cu_seqlens_q_padded != psp.cu_seqlens_q).any())
                      if psp.cu_seqlens_q is not psp.cu_seqlens_q_padded else True)
    # Lopti: train_batch's two updates against the phases run by hand
    out["lopti"], out["lopti_metrics"] = _lopti_two_ways(
        lambda: _setup(tp, sp), lambda: [_batch(seed=20 + s, confident=0.4) for s in (0, 1)])
    return out


def _lopti_two_ways(make_model, batches):
    """Lopti (``lopti_eta=0.5``) from fresh models: the parameters after ``train_batch`` on each
    of ``batches()`` and after its two phases run by hand; ``train_batch``'s metric names."""
    from gbc_kernels.integrations.verl import engine as ve

    params, names = [], None
    for by_hand in (False, True):
        model = make_model()
        engine = _engine(model, options=ve.EngineOptions(lopti_eta=0.5))
        engine.optimizer = _trainable(model)
        for data in batches():
            if by_hand:
                for phase in ("low", "high"):
                    engine._gbc_phase = phase
                    engine.optimizer_zero_grad()
                    engine.forward_backward_batch(data.clone(), _loss_fn(), forward_only=False)
                    engine.optimizer_step()
                engine._gbc_phase = None
            else:
                got = engine.train_batch(data, _loss_fn())     # no outputs before the last stage
                names = sorted((got or {}).get("metrics", {}))
        params.append({n: p.detach().clone() for n, p in _named(model)})
    return params, names


@pytest.fixture(scope="module")
def tp2_sp():
    return spawn_gloo(2, _methods_worker, 2, True)


@pytest.mark.slow
def test_forward_only_equals_verl_stock_engine(tp2_sp):
    """log_probs, entropy and sum_pi_squared of verl's forward-only pass (temperature 0.8),
    TP=2 with sequence parallelism: gbc's equal the stock engine's on every response token."""
    for r, out in enumerate(tp2_sp):
        for k in ("log_probs", "entropy", "sum_pi_squared"):
            a, b = out["infer0"][k], out["infer1"][k]
            assert float(a.abs().sum()) > 0
            _close(a, b, 1e-6, f"rank {r} {k}")


@pytest.mark.slow
def test_critical_kl_reference_pass_equals_reference(tp2_sp):
    """The reference pass with CERTAINTY_KEY returns gbc_reference's ``ref_logp`` and weights
    ``(J_max_prob at T=0.25)^0.5`` over megatron's padded vocabulary (its padded rows are real
    logits), from the same hidden rows and the gathered output-layer weight."""
    import gbc_reference as ref

    for out in tp2_sp:
        c = out["critical"]
        st = ref.token_stats(c["hidden"], c["weight"], c["responses"], temperature=0.8,
                             certainty="max_prob", certainty_temperature=0.25)
        m = c["mask"]
        want = ref.critical_kl_weight(st.certainty, 0.5) * m
        assert float(want[m].std()) > 1e-3
        _close(c["w"], want.to(c["w"].dtype), 1e-6, "kl weight")
        _close(c["logp"][m], st.logp[m].to(c["logp"].dtype), 1e-5, "ref logp")


@pytest.mark.slow
def test_no_full_logits_on_gbc_path(tp2_sp):
    """No tensor over this rank's vocabulary shard has as many rows as the micro-batch has
    response tokens (gbc's chunks only), in a training step and a forward-only pass."""
    def rows(shapes):
        return max(torch.Size(s[:-1]).numel() for s in shapes) if shapes else 0

    for out in tp2_sp:
        n = out["watch"]["n_tokens"]
        assert rows(out["watch"]["stock"]) > n            # the watcher sees verl's logits
        assert 0 < rows(out["watch"]["gbc"]) < n // 2, out["watch"]["gbc"]


@pytest.mark.slow
def test_lopti_train_batch_is_two_updates(tp2_sp):
    """``train_batch`` with ``lopti_eta`` (EngineMethods on the Megatron engine's optimizer
    interface): the parameters after two mini-batches equal the two phases run by hand."""
    for out in tp2_sp:
        a, b = out["lopti"]
        for k in a:
            _close(a[k], b[k], 1e-9, k)
    assert {"grad_norm", "gbc_grad_norm_second_phase"} <= set(tp2_sp[0]["lopti_metrics"])


@pytest.mark.slow
def test_thd_rows_follow_verls_packing(tp2_sp):
    """``use_remove_padding`` (thd): the rows gbc projects are those whose rolled label, as
    verl's ``preprocess_thd_engine`` packs it for TP=2 (sequences padded to even lengths), is
    the response token; the engine's thd forward itself needs megatron's fused attention."""
    for out in tp2_sp:
        t = out["thd"]
        assert torch.equal(t["got"], t["want"])
        assert (t["want"] >= 0).sum() > 10


def _nthr_worker(rank, world, tp, sp, beta):
    """NTHR's pass (dynamic micro-batches, so verl reorders the rows) with the oracle's inputs:
    the output layer's input rows of the batch from one forward-only pass, and the gathered
    output weight; then the training step with NTHR, by hand, and without."""
    from gbc_kernels.integrations.verl import engine as ve
    from test_verl_engine import verl_on_cpu

    verl_on_cpu()           # verl's dynamic micro-batching asks for its device
    model = _setup(tp, sp)
    engine = _engine(model, options=ve.EngineOptions(nthr=True, nthr_beta=beta))
    data = _batch(seed=11, B=NB, group=GROUP, dynamic=True)
    with torch.no_grad():
        engine.gbc_nthr_pass(data)
    scale = data[ve.SCALE_KEY].clone()
    metrics = dict(engine._gbc_update_metrics)
    oracle = _head_oracle([model], _batch(seed=11, B=NB, group=GROUP, micro=NB), tp, sp)
    # the training step: with NTHR's scales = NTHR off with advantages * scale; != without
    steps = []
    for opts, adv_scale, keep in ((dict(nthr=True), None, True), ({}, scale, False),
                                  ({}, None, False)):
        model.zero_grad(set_to_none=True)
        engine.gbc_options = ve.EngineOptions(**opts)
        step = data.clone()
        if adv_scale is not None:
            step["advantages"] = _padded(step["advantages"]) * adv_scale
        if not keep:
            del step[ve.SCALE_KEY]
        out = engine.forward_backward_batch(step, _loss_fn(), forward_only=False)
        steps.append((float(sum(out["loss"])), _grads(model)))
    return dict(scale=scale, metrics=metrics, oracle=oracle, steps=steps)


GROUP, NB = 4, 8          # 2 groups of 4 responses


@pytest.mark.slow
@pytest.mark.parametrize("tp,sp", [(2, True), (1, False)])
def test_nthr_pass_equals_reference(tp, sp):
    """NTHR on verl's Megatron engine: the pass over the rank's update batch (verl's dynamic
    micro-batches, TP=2 with sequence parallelism: the output rows of the batch's ids gathered
    from both shards, the log-probs over the split padded vocabulary) gives gbc_reference's
    token scales on the output layer's float64 input rows and the whole weight (groups from
    ``uid``, correct = advantage > 0, β = 0 as in tests/test_verl_engine.py); the training step
    then equals the step with ``advantages * scale`` and NTHR off, and differs from the step
    without NTHR."""
    import gbc_reference as ref

    for r, out in enumerate(spawn_gloo(tp, _nthr_worker, tp, sp, 0.0)):
        o = out["oracle"]
        mask = o["mask"]
        correct = (o["advantages"] * mask).sum(1) > 0
        want = ref.nthr_scale(o["hidden"], o["weight"], o["responses"], mask,
                              torch.arange(NB) // GROUP, correct, temperature=0.8, beta=0.0)
        assert want.selected.any() and not want.selected[mask & ~correct[:, None]].all()
        assert torch.equal(out["scale"] != 1.0, want.selected), (r, out["scale"], want.selected)
        _close(out["scale"], want.scale.float(), 1e-6, f"rank {r} scale")
        assert out["metrics"]["actor/gbc_nthr_selected_frac"] > 0
        (l0, g0), (l1, g1), (_, g2) = out["steps"]
        assert abs(l0 - l1) <= 1e-9 * max(1.0, abs(l0))
        for k in g0:
            _close(g0[k], g1[k], 1e-9, f"rank {r} grad {k}")
        assert max(float((g0[k] - g2[k]).abs().max()) for k in g0) > 1e-4


def _nthr_rows_worker(rank, world, rows_of):
    """NTHR's scales of this rank's share (``rows_of[rank]``; None: the whole batch) at tensor
    parallel 1: with two ranks, data parallel 2."""
    from verl.utils import tensordict_utils as tu

    from gbc_kernels.integrations.verl import engine as ve

    model = _setup(1, False)
    engine = _engine(model, options=ve.EngineOptions(nthr=True, nthr_beta=0.0))
    data = _batch(seed=11, B=NB, group=GROUP)
    if rows_of is not None:
        data = tu.index_select_tensor_dict(data, torch.as_tensor(rows_of[rank]))
    with torch.no_grad():
        engine.gbc_nthr_pass(data)
    return data[ve.SCALE_KEY].clone()


@pytest.mark.slow
def test_nthr_groups_split_over_data_parallel_ranks():
    """Data parallel 2 on the Megatron engine, each group's responses on both ranks (verl's
    ``balance_batch`` splits groups): each rank's scales equal the one-rank pass over the whole
    batch, row for row (the counts, ``V*``, ``M+`` and anchors merged over megatron's
    data-parallel group)."""
    whole = spawn_gloo(1, _nthr_rows_worker, None)[0]
    assert (whole != 1).any()
    rows_of = [[0, 2, 5, 7], [1, 3, 4, 6]]
    for rows, scale in zip(rows_of, spawn_gloo(2, _nthr_rows_worker, rows_of)):
        _close(scale, whole[rows, :scale.shape[1]], 1e-6, f"rows {rows}")


def _pipeline_worker(rank, world, tp, sp, vpp=None):
    """Pipeline parallel ``world // tp`` (megatron's 1F1B schedule over gloo's isend/irecv;
    interleaved over ``vpp`` virtual stages per rank), each rank its stage(s) of the model:
    verl's stock engine and gbc's on the same stages — a training step, a forward-only pass,
    the critical-KL reference pass; then NTHR's pass and the step with its scales against the
    step with ``advantages × scale`` (the last stage's scales, sent to every stage), and
    Lopti's ``train_batch`` against its phases by hand."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from verl.utils import tensordict_utils as tu

    from gbc_kernels.integrations.verl import engine as ve
    from test_verl_engine import verl_on_cpu

    verl_on_cpu()
    pp = world // tp
    # interleaved: four micro-batches (with two, megatron's interleaved 1F1B hangs on gloo's
    # point-to-point ops, verl's stock engine alike)
    micro = dict(micro=1) if vpp else {}
    out = {"train": {}, "infer": {}}
    for gbc in (False, True):
        model = _chunks(tp, sp, pp, vpp)
        last = mpu.is_pipeline_last_stage(ignore_virtual=True)
        engine = _engine(model, gbc=gbc)
        torch.manual_seed(1234)
        data = _batch(**micro)
        res = engine.forward_backward_batch(data, _loss_fn(), forward_only=False)
        out["train"][gbc] = dict(grads=_grads(model), keys=sorted(res))
        if last:
            out["train"][gbc].update(
                loss=sum(res["loss"]), logp=_responses(res, "log_probs", data),
                entropy=_responses(res, "entropy", data), metrics=_metric_values(res["metrics"]))
        data = _batch(seed=7, **micro)
        res = _infer(engine, data)
        out["infer"][gbc] = ({k: _responses(res, k, data)
                              for k in ("log_probs", "entropy", "sum_pi_squared")}
                             if last else sorted(res))
    out["last"] = last
    # critical-token KL: the reference pass's weights against gbc_reference's on the last stage
    model = _chunks(tp, sp, pp, vpp)
    opts = ve.EngineOptions(critical_kl_exponent=0.5, critical_kl_temperature=0.25)
    data = _batch(seed=8, **micro)
    tu.assign_non_tensor(data, **{ve.CERTAINTY_KEY: {k: getattr(opts, k)
                                                     for k in ve.CRITICAL_KL_FIELDS}})
    res = _infer(_engine(model, options=opts), data)
    out["critical_oracle"] = _head_oracle(model, data, tp, sp, last)
    if last:
        out["critical"] = _responses(res, ve.KL_WEIGHT_KEY, data)
    # NTHR: the pass on every stage (the last one gets the scales), then the three steps
    model = _chunks(tp, sp, pp, vpp)
    engine = _engine(model, options=ve.EngineOptions(nthr=True, nthr_beta=0.0))
    data = _batch(seed=11, B=NB, group=GROUP, dynamic=True)
    with torch.no_grad():
        got = engine.gbc_nthr_pass(data)
    out["nthr_got"] = got is not None
    scale = [data[ve.SCALE_KEY].clone() if last else None]
    dist.broadcast_object_list(scale, src=world - 1)
    scale = scale[0]
    out["nthr_scale"] = scale
    out["nthr_oracle"] = _head_oracle(model, _batch(seed=11, B=NB, group=GROUP), tp, sp, last)
    steps = []
    for opts, adv_scale in ((dict(nthr=True), None), ({}, scale), ({}, None)):
        for chunk in model:
            chunk.zero_grad(set_to_none=True)
        engine.gbc_options = ve.EngineOptions(**opts)
        step = data.clone()
        if adv_scale is not None:
            step["advantages"] = _padded(step["advantages"]) * adv_scale
        if not opts and ve.SCALE_KEY in step.keys():
            del step[ve.SCALE_KEY]
        engine.forward_backward_batch(step, _loss_fn(), forward_only=False)
        steps.append(_grads(model))
    out["nthr_steps"] = steps
    # Lopti: train_batch's two updates against the phases by hand, on every stage
    out["lopti"], _ = _lopti_two_ways(lambda: _chunks(tp, sp, pp, vpp),
                                      lambda: [_batch(seed=20, confident=0.4, **micro)])
    return out


def _head_oracle(model, data, tp, sp, last=True):
    """The output layer's float64 input rows of ``data``'s response tokens (one forward-only
    pass of the stock engine on this rank's chunks ``model``, which every pipeline stage runs;
    verl's own split into micro-batches, in order) and the gathered output weight, for
    gbc_reference; None on a stage before the last."""
    from megatron.core.tensor_parallel.mappings import (gather_from_sequence_parallel_region,
                                                        gather_from_tensor_model_parallel_region)
    from verl.workers.engine.utils import prepare_micro_batches

    from gbc_kernels.integrations.verl.megatron import response_rows

    if not last:
        _infer(_engine(model, gbc=False), data.clone())
        return None
    head = model[-1]                  # the chunk with the output layer
    with _mc().capture_head_input(head) as seen:
        _infer(_engine(model, gbc=False), data.clone())
    micro, _ = prepare_micro_batches(data.clone())
    assert len(seen) == len(micro)
    responses = _padded(data["responses"])
    B, T = responses.shape
    hidden = torch.zeros(B, T, H, dtype=seen[0].dtype)
    mask = torch.zeros(B, T, dtype=torch.bool)
    start = 0
    for h, mb in zip(seen, micro):
        if sp and tp > 1:
            h = gather_from_sequence_parallel_region(h)
        rows, valid = response_rows(mb, "bshd", h.transpose(0, 1).shape)
        b, t = rows.shape
        hidden[start:start + b, :t] = h.transpose(0, 1).reshape(-1, H)[rows].detach()
        mask[start:start + b, :t] = _padded(mb["response_mask"]).bool() & valid
        start += b
    assert start == B
    weight = gather_from_tensor_model_parallel_region(head.output_layer.weight.detach().t()).t()
    return dict(hidden=hidden, weight=weight.detach(), responses=responses, mask=mask,
                advantages=_padded(data["advantages"]))


@pytest.fixture(scope="module", params=[(1, False, None), (2, True, None), (1, False, 2)],
                ids=["pp2", "pp2_tp2_sp", "pp2_vpp2"])
def pipelined(request):
    tp, sp, vpp = request.param
    return spawn_gloo(2 * tp, _pipeline_worker, tp, sp, vpp)


@pytest.mark.slow
def test_pipeline_parallel_equals_verl_stock_engine(pipelined):
    """Pipeline parallel 2 (also × tensor parallel 2 with sequence parallelism, four ranks; and
    with two virtual stages per rank, megatron's interleaved schedule): on the last stage gbc's
    loss, log-probs, entropy and verl's metrics equal the stock engine's, in training and in
    the forward-only pass; on every stage every parameter's gradient does (the first stage's
    through megatron's point-to-point backward)."""
    stages = {out["last"] for out in pipelined}
    assert stages == {False, True}
    for r, out in enumerate(pipelined):
        stock, ours = out["train"][False], out["train"][True]
        what = f"rank {r}"
        assert stock["grads"].keys() == ours["grads"].keys() and stock["grads"]
        assert float(sum(g.abs().sum() for g in ours["grads"].values())) > 0
        for k in stock["grads"]:
            _close(stock["grads"][k], ours["grads"][k], 1e-6, f"{what} grad {k}")
        if not out["last"]:
            assert stock["keys"] == ours["keys"] and out["infer"][False] == out["infer"][True]
            continue
        assert abs(float(stock["loss"]) - float(ours["loss"])) < 1e-7, what
        for k in ("logp", "entropy"):
            _close(stock[k], ours[k], 1e-6, f"{what} {k}")
        for k, v in stock["metrics"].items():
            _close(torch.tensor(v), torch.tensor(ours["metrics"][k]), 1e-5, f"{what} {k}")
        for k, v in out["infer"][False].items():
            assert float(v.abs().sum()) > 0
            _close(v, out["infer"][True][k], 1e-6, f"{what} forward-only {k}")


@pytest.mark.slow
def test_pipeline_parallel_methods(pipelined):
    """The methods under pipeline parallelism: the critical-KL weights and NTHR's scales on the
    last stage equal gbc_reference's on its output layer's input rows (NTHR's pass gives the
    other stages none); the step with NTHR equals the step with ``advantages × scale`` on every
    stage, and differs from the step without; Lopti's ``train_batch`` equals its two phases run
    by hand on every stage."""
    import gbc_reference as ref

    for r, out in enumerate(pipelined):
        assert out["nthr_got"] == out["last"]
        if out["last"]:
            c = out["critical_oracle"]
            st = ref.token_stats(c["hidden"], c["weight"], c["responses"], temperature=0.8,
                                 certainty="max_prob", certainty_temperature=0.25)
            want = ref.critical_kl_weight(st.certainty, 0.5) * c["mask"]
            _close(out["critical"], want.to(out["critical"].dtype), 1e-6, f"rank {r} kl weight")
            o = out["nthr_oracle"]
            correct = (o["advantages"] * o["mask"]).sum(1) > 0
            want = ref.nthr_scale(o["hidden"], o["weight"], o["responses"], o["mask"],
                                  torch.arange(NB) // GROUP, correct, temperature=0.8, beta=0.0)
            assert want.selected.any()
            _close(out["nthr_scale"], want.scale.float(), 1e-6, f"rank {r} nthr scale")
        g0, g1, g2 = out["nthr_steps"]
        for k in g0:
            _close(g0[k], g1[k], 1e-9, f"rank {r} nthr grad {k}")
        assert max(float((g0[k] - g2[k]).abs().max()) for k in g0) > 1e-5
        a, b = out["lopti"]
        for k in a:
            _close(a[k], b[k], 1e-9, f"rank {r} lopti {k}")


def _bare_engine(options=None, mtp=False, **config):
    from verl.workers.config import McoreEngineConfig

    from gbc_kernels.integrations.verl import engine as ve
    from gbc_kernels.integrations.verl import megatron as vm

    engine = object.__new__(vm.GBCMegatronEngineWithLMHead)
    engine.engine_config = McoreEngineConfig(**config)
    engine.model_config = types.SimpleNamespace(mtp=types.SimpleNamespace(enable=mtp))
    engine.module = [None]
    engine.gbc_options = options or ve.EngineOptions()
    return engine


def test_fused_kernels_option_takes_gbcs_head():
    """``use_fused_kernels=True``: gbc's engine installs no fused forward of verl's and switches
    the option off in the config it shares with verl's worker (whose batches then take the
    unfused step, where gbc's head sits); verl's own engine, on the same config, patches the
    model."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    calls = []
    import verl.models.mcore.model_forward_fused as fused
    original = fused.patch_fused_forward
    fused.patch_fused_forward = lambda model: calls.append(model)
    try:
        engine = _bare_engine(use_fused_kernels=True, use_remove_padding=True)
        engine.is_value_model = False
        engine.module = ["model"]
        engine._maybe_enable_fused_kernels()
        assert engine.engine_config.use_fused_kernels is False and calls == []
        stock = _bare_engine(use_fused_kernels=True, use_remove_padding=True)
        stock.is_value_model = False
        stock.module = ["model"]
        MegatronEngineWithLMHead._maybe_enable_fused_kernels(stock)
        assert stock.engine_config.use_fused_kernels is True and calls == ["model"]
    finally:
        fused.patch_fused_forward = original
    # a batch gbc's head does not take (here an SFT-style loss) is refused naming the option
    from tensordict import TensorDict
    batch = TensorDict({"responses": torch.zeros(1, 2, dtype=torch.long)}, batch_size=[1])
    with pytest.raises(ValueError, match="^use_fused_kernels: "):
        engine.forward_step(iter([batch]), None, lambda **kw: None, None)


def _fused_worker(rank, world):
    """A training step on an engine built with ``use_fused_kernels=True`` (switched off by gbc),
    its batch's flag defaulting from the shared config as verl's worker sets it, and on an
    engine built without it."""
    from verl.utils import tensordict_utils as tu

    out = []
    for fused in (True, False):
        model = _setup(world, True)
        engine = _engine(model, use_fused_kernels=fused)
        engine._maybe_enable_fused_kernels()
        torch.manual_seed(1234)
        data = _batch()
        tu.assign_non_tensor(data, use_fused_kernels=engine.engine_config.use_fused_kernels)
        seen = []
        head = type(engine)._gbc_head
        engine._gbc_head = lambda m: (seen.append(1), head(engine, m))[1]
        res = engine.forward_backward_batch(data, _loss_fn(), forward_only=False)
        out.append((float(sum(res["loss"])), _grads(model), len(seen)))
    return out


@pytest.mark.slow
def test_fused_kernels_step_runs_gbcs_head():
    """With ``use_fused_kernels=True`` the training step goes through gbc's head and equals the
    step of an engine built without the option (TP=2 with sequence parallelism)."""
    for (l0, g0, n0), (l1, g1, _) in spawn_gloo(2, _fused_worker):
        assert n0 > 0 and l0 == l1
        for k in g1:
            assert torch.equal(g0[k], g1[k]), k


REFUSALS = {
    # context parallelism runs in thd (tests/test_verl_megatron_cp.py); bshd is refused
    "context_parallel_size": dict(context_parallel_size=2, use_remove_padding=False),
    "dynamic_context_parallel": dict(dynamic_context_parallel=True,
                                     max_seqlen_per_dp_cp_rank=64),
    "mtp.enable": dict(mtp=True),
}


@pytest.mark.parametrize("what", sorted(REFUSALS))
def test_refuses_what_it_cannot_honour(what):
    """Each Megatron option gbc cannot honour is refused by name, at ``initialize`` (before
    verl builds anything) and at each ``forward_backward_batch``."""
    engine = _bare_engine(**REFUSALS[what])
    with pytest.raises(ValueError, match=what.replace(".", r"\.")):
        engine.initialize()
    with pytest.raises(ValueError, match=what.replace(".", r"\.")):
        engine.forward_backward_batch(None, None)


def test_refuses_distillation_batches():
    """A training micro-batch with verl's top-k distillation under ppo_loss is refused."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    batch = TensorDict({"responses": torch.zeros(1, 2, dtype=torch.long)}, batch_size=[1])
    tu.assign_non_tensor(batch, distillation_use_topk=True)
    with pytest.raises(ValueError, match="distillation"):
        _bare_engine().forward_step(iter([batch]), None, _loss_fn(), None)


def test_enable_registers_the_megatron_engine():
    """enable() hands out gbc's engine for verl's ``megatron`` backend (every device it is
    registered for), with the options in force; disable() puts verl's back."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from gbc_kernels.integrations.verl import engine as ve
    from gbc_kernels.integrations.verl import megatron as vm

    table = EngineRegistry._engines["language_model"]["megatron"]
    before = dict(table)
    assert MegatronEngineWithLMHead in before.values()
    try:
        ve.enable(ve.EngineOptions(ar_alpha=0.25))
        for cls in table.values():
            assert issubclass(cls, vm.GBCMegatronMixin)
            assert issubclass(cls, MegatronEngineWithLMHead)
            assert cls.gbc_options.ar_alpha == 0.25
    finally:
        ve.disable()
    assert table == before


def _options_worker(rank, world, tp):
    """Per method option: the parameters after one ``train_batch`` (AR, Lopti; NTHR after its
    pass over the update batch) or the reference pass's KL weights (critical-token KL), with
    the option's two settings of tests/methods/test_options.PAIRS."""
    from verl.utils import tensordict_utils as tu

    from gbc_kernels.integrations.verl import engine as ve
    from conftest import logits_dtypes_seen
    from methods.test_options import PAIRS, PRECISION

    out = {}
    for name, pair in sorted(PAIRS.items()):
        runs = []
        for opts in pair:
            model = _setup(tp, False)
            engine = _engine(model, options=ve.EngineOptions(**opts))
            nthr = name.startswith("nthr") or name == PRECISION
            data = (_batch(seed=30, B=NB, group=GROUP) if nthr else
                    _batch(seed=30, confident=0.4))
            try:
                if name == PRECISION:
                    # every pass, as the worker runs them: the reference pass with the
                    # certainty options, the NTHR pass, the update; their sweeps' modes
                    with logits_dtypes_seen() as seen:
                        ref = data.clone()
                        tu.assign_non_tensor(ref, **{ve.CERTAINTY_KEY: {
                            k: getattr(engine.gbc_options, k)
                            for k in ve.REFERENCE_PASS_FIELDS}})
                        r = _infer(engine, ref)
                        data[ve.KL_WEIGHT_KEY] = _responses(r, ve.KL_WEIGHT_KEY, ref).float()
                        engine.optimizer = _trainable(model)
                        o = _infer(engine, data.clone())
                        data["old_log_probs"] = _responses(o, "log_probs", data).float()
                        with torch.no_grad():
                            engine.gbc_nthr_pass(data)
                        data["advantages"] = _padded(data["advantages"])
                        engine.train_batch(data, _loss_fn())
                    runs.append(list(seen))
                elif name.startswith("critical_kl"):
                    tu.assign_non_tensor(data, **{ve.CERTAINTY_KEY: {
                        k: getattr(engine.gbc_options, k) for k in ve.CRITICAL_KL_FIELDS}})
                    res = _infer(engine, data)
                    runs.append(_responses(res, ve.KL_WEIGHT_KEY, data)
                                if ve.KL_WEIGHT_KEY in res["model_output"] else
                                torch.zeros_like(_responses(res, "log_probs", data)))
                else:
                    engine.optimizer = _trainable(model)
                    if nthr:       # as the worker hook runs it (nthr off: no pass)
                        # on-policy old log-probs: no selected token is clipped away
                        o = _infer(engine, data.clone())
                        data["old_log_probs"] = _responses(o, "log_probs", data).float()
                        if engine.gbc_options.nthr:
                            with torch.no_grad():
                                engine.gbc_nthr_pass(data)
                        data["advantages"] = _padded(data["advantages"])
                    engine.train_batch(data, _loss_fn())
                    runs.append(torch.cat([p.detach().reshape(-1)
                                           for p in model.parameters()]))
            except ValueError as e:
                runs.append(str(e))
        out[name] = runs
    return out


@pytest.mark.slow
def test_every_method_option_changes_the_update_or_is_refused():
    """Each method option on the Megatron engine, against the same run without it: AR and Lopti
    and NTHR change the parameters after ``train_batch`` by more than rounding, the critical-KL
    options change the reference pass's KL weights."""
    from methods.test_options import PAIRS

    from conftest import assert_logits_mode_reached
    from methods.test_options import PRECISION

    out = spawn_gloo(2, _options_worker, 2)[0]
    assert set(out) == set(PAIRS)
    for name, (a, b) in out.items():
        assert not isinstance(a, str) and not isinstance(b, str), (name, a, b)
        if name == PRECISION:       # float32 test model: the sweeps are checked for the mode
            assert_logits_mode_reached(a, b, at_least=4)
            continue
        assert (a - b).abs().max() > 1e-6 * (1 + a.abs().max()), name
