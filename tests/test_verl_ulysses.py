"""gbc's engine on verl 0.9.1's FSDP engine under Ulysses sequence parallelism
(``ulysses_sequence_parallel_size``), against verl's own stock engine at the same SP size.

What runs is verl's: its ``FSDPEngineWithLMHead`` with its Ulysses device mesh, its input
slicing (``ulysses_pad_and_slice_inputs``), its attention patch
(``_ulysses_flash_attention_forward``: all-to-all over the SP group around flash-attn's varlen
kernel), its output gather (``gather_outputs_and_unpad``) and loss. CPU bypasses beyond those
of tests/test_verl_engine.py:
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
from test_verl_engine import (_check_parity, _grads, _metric_values, _params, make_batch,  # noqa: E402
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
    seen = fa.seen = []                # the packed lengths the varlen kernel attends over
    varlen = fa.flash_attn_varlen_func

    def recorded(q, *args, **kwargs):
        seen.append(q.shape[0])
        return varlen(q, *args, **kwargs)

    fa.flash_attn_varlen_func = recorded
    fau._lazy_imports = lambda *a, **k: (fa.flash_attn_func, fa.flash_attn_varlen_func,
                                         fa.flash_attn_with_kvcache, fau._pad_input,
                                         fau._unpad_input)
    return fa


def build_engine(model_dir, sp, gbc=True, options=None, lr=1e-2, optimizer="AdamW"):
    """verl's FSDP2 engine (or gbc's on top of it) with Ulysses SP ``sp``, fp32, flash-attn
    (the stand-in) as verl's Ulysses path needs."""
    import verl.workers.engine.fsdp.transformer_impl as ti

    from gbc_kernels.integrations import hf
    from test_verl_engine import build_engine as build_plain

    verl_on_cpu()
    fa = flash_on_cpu()
    ti.device_name = "cpu"      # read at import, before the CPU platform was installed
    engine = build_plain(model_dir, gbc=gbc, lr=lr, options=options, optimizer=optimizer, sp=sp)
    hf.unwrap(engine.module).config._attn_implementation = "flash_attention_2"
    engine.test_attention_lengths = fa.seen
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


SP_MODES = [m for m in VERL_MODES if m not in ("clip_cov", "kl_cov")]   # those two: refused


def _cases():
    """Each of verl's loss modes once (Clip-Cov / KL-Cov: refused under SP), its aggregations
    in turn (each at least once), KL and an entropy term on, except for geo_mean's sequence
    aggregations (its policy term alone)."""
    return [_case(mode, VERL_AGGS[i % len(VERL_AGGS)]) for i, mode in enumerate(SP_MODES)]


def _worker(rank, world, model_dir, sp, cases, methods=True):
    """On one engine (gbc's, with verl's stock forward step swapped in for its results), at
    Ulysses SP ``sp`` (every SP rank holds the same micro-batches): verl's and gbc's loss,
    metrics and gradients for each case; both forward-only passes; gbc's NTHR scales, its
    critical-KL reference pass, and the parameters after an update with each method."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from gbc_kernels.integrations.verl import engine as ve

    from gbc_kernels.integrations import hf

    engine = build_engine(model_dir, sp, lr=0.5, optimizer="SGD")
    dp, dp_rank = world // sp, rank // sp
    head_rows = []          # the rows of hidden states the lm_head sees
    hf.unwrap(engine.module).get_output_embeddings().register_forward_hook(
        lambda m, args, o: head_rows.append(args[0].shape[-2]))
    out = {"cases": [], "head_rows": head_rows, "attention": engine.test_attention_lengths}
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
    out["init"], steps = _params(engine), []
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


# -- the flash-attn stand-in --------------------------------------------------------------------
def test_flash_standin_equals_per_sequence_causal_attention():
    """The stand-in's varlen kernel: each packed sequence attends causally to itself only, GQA
    heads shared, against a float64 softmax written out here; odd lengths, a 1-token sequence;
    the dense function equals the varlen one on equal lengths."""
    fa = flash_on_cpu()
    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 7, 3]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    n, h, hk, d = sum(lens), 4, 2, 8
    q, k, v = (torch.randn(n, x, d, generator=g, dtype=torch.float64) for x in (h, hk, hk))
    got = fa.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), softmax_scale=0.3,
                                    causal=True)
    want = torch.zeros_like(got)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for head in range(h):
            kk, vv = k[a:b, head // (h // hk)], v[a:b, head // (h // hk)]
            s = 0.3 * q[a:b, head] @ kk.T
            s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
            want[a:b, head] = s.softmax(-1) @ vv
    assert torch.allclose(got, want, atol=1e-12)
    # not causal: the whole sequence; dense = varlen on equal lengths
    qb, kb, vb = (x[:6].reshape(2, 3, *x.shape[1:]) for x in (q, k, v))
    cu2 = torch.tensor([0, 3, 6], dtype=torch.int32)
    for causal in (False, True):
        dense = fa.flash_attn_func(qb, kb, vb, causal=causal)
        var = fa.flash_attn_varlen_func(q[:6], k[:6], v[:6], cu2, cu2, 3, 3, causal=causal)
        assert torch.allclose(dense.reshape(6, h, d), var, atol=1e-12)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        fa.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, dropout_p=0.1)


# -- gbc's engine under Ulysses SP 2 against verl's stock engine at SP 2, and SP 1 --------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both engines' results at SP 2 (two gloo ranks, one data-parallel rank) and at SP 1 (the
    first three cases: gbc equals verl at SP 1 in every mode, tests/test_verl_engine.py)."""
    model_dir = make_model_dir(tmp_path_factory.mktemp("uly") / "m")
    cases = _cases()
    sp2 = spawn_gloo(2, _worker, model_dir, 2, cases)
    sp1 = spawn_gloo(1, _worker, model_dir, 1, cases[:3])[0]
    return cases, sp2, sp1


def _close(a, b, tol, what):
    if isinstance(a, dict):
        assert set(a) == set(b), what
        for k in a:
            _close(a[k], b[k], tol, (what, k))
    elif isinstance(a, torch.Tensor):
        top = float(a.abs().max()) if a.numel() else 0.0
        assert float((a - b).abs().max()) <= tol * max(1.0, top), (what, (a - b).abs().max())
    else:
        assert abs(a - b) <= tol * max(1.0, abs(a)), (what, a, b)


def _check_step(res, case, tol=2e-5):
    """gbc's (loss, metrics, gradients) equal verl's: every metric verl logs, every
    parameter's gradient (gbc adds only its own ``actor/gbc_*`` metrics)."""
    _check_parity([res], [case], tol)


@pytest.mark.slow
def test_ulysses_sp2_equals_verl_stock_sp2(runs):
    """At Ulysses SP 2, for each of verl's loss modes (its aggregations in turn, KL and entropy
    terms, IS weights, micro-batches of 2 over 6 sequences with a masked and an empty
    response): gbc's loss, every metric verl logs and every parameter's gradient equal verl's
    stock Ulysses step, on both SP ranks; so do the forward-only log-probs, entropy and sum of
    squared probabilities (per-sample temperatures). The harness runs Ulysses: the lm_head sees
    half the packed rows the attention sees (verl's all-to-all)."""
    cases, sp2, _ = runs
    for r in sp2:
        assert r["head_rows"] and max(r["head_rows"]) < max(r["attention"])
        for case, res in zip(cases, r["cases"]):
            _check_step(res, case)
        inf = r["infer"]
        for k in inf["verl"]:
            assert inf["verl"][k].abs().max() > 0
            assert torch.allclose(inf["verl"][k], inf["gbc"][k], rtol=1e-5, atol=1e-5), k
    # both SP ranks report the same (whole micro-batch) loss and gradients
    for a, b in zip(sp2[0]["cases"], sp2[1]["cases"]):
        _close(a["gbc"][0], b["gbc"][0], 1e-6, "loss on both ranks")
        _close(a["gbc"][2], b["gbc"][2], 1e-6, "gradients on both ranks")


@pytest.mark.slow
def test_ulysses_sp2_equals_sp1(runs):
    """SP 2 against SP 1 (same data; three loss modes): verl's stock step (the harness), gbc's
    step, the forward-only outputs, critical-token KL's reference pass (log-probs and weights),
    NTHR's scales (groups of 4 whose rows sit on both SP ranks), and the parameters and the
    gradient norm after an update with NTHR, with Lopti's two updates and with AR."""
    cases, sp2, sp1 = runs
    for case, a, b in zip(cases, sp2[0]["cases"], sp1["cases"]):
        for which in ("verl", "gbc"):
            (l0, m0, g0), (l1, m1, g1) = a[which], b[which]
            _close(l0, l1, 2e-5, (case, which, "loss"))
            top = max(float(g.abs().max()) for g in g1.values())
            for n in g1:
                assert float((g0[n] - g1[n]).abs().max()) <= 2e-5 * top, (case, which, n)
            for k in m1:
                for x, y in zip(m0[k], m1[k]):
                    assert abs(x - y) <= 2e-5 * max(1.0, abs(x)) + 1e-6, (case, which, k)
    _close(sp2[0]["infer"], sp1["infer"], 1e-5, "infer")
    for x, y in zip(sp2[0]["critical_kl"], sp1["critical_kl"]):
        assert x.abs().max() > 0 and torch.allclose(x, y, rtol=1e-5, atol=1e-6)
    assert (sp1["nthr_scale"] != 1).any()
    assert torch.allclose(sp2[0]["nthr_scale"], sp1["nthr_scale"], atol=1e-6)
    init = sp1["init"]
    for (m0, p0), (m1, p1) in zip(sp2[0]["steps"], sp1["steps"]):
        moved = max(float((p1[n] - init[n]).abs().max()) for n in p1)
        for n in p1:
            assert float((p0[n] - p1[n]).abs().max()) <= 1e-5 * max(moved, 1e-3), n
        assert abs(m0["grad_norm"][0] - m1["grad_norm"][0]) <= 1e-5 * m1["grad_norm"][0]
    # Lopti's second update ran
    assert "gbc_grad_norm_second_phase" in sp1["steps"][1][0]


@pytest.mark.slow
def test_ulysses_dp2_sp2_equals_verl_stock(tmp_path):
    """Data parallel 2 × Ulysses SP 2 (four gloo ranks: two SP groups of two, each data-parallel
    rank its own micro-batches and verl's global token and sequence counts): gbc's loss, every
    metric verl logs and every parameter's gradient (FSDP's reduction over the four ranks)
    equal verl's stock step on every rank, for four loss modes with the token-mean, token-sum
    and both seq-mean-token-* aggregations; so do the forward-only outputs. The two SP ranks of
    a data-parallel rank report the same loss; the two data-parallel ranks' losses differ."""
    model_dir = make_model_dir(tmp_path / "m")
    cases = _cases()[:4]
    assert {c[1] for c in cases} >= {"token-mean", "token-sum", "seq-mean-token-mean"}
    ranks = spawn_gloo(4, _worker, model_dir, 2, cases, False)
    for r in ranks:
        assert r["head_rows"] and max(r["head_rows"]) < max(r["attention"])
        for case, res in zip(cases, r["cases"]):
            _check_step(res, case)
        inf = r["infer"]
        for k in inf["verl"]:
            assert inf["verl"][k].abs().max() > 0
            assert torch.allclose(inf["verl"][k], inf["gbc"][k], rtol=1e-5, atol=1e-5), k
    for i in range(len(cases)):
        loss = [float(r["cases"][i]["gbc"][0]) for r in ranks]
        assert loss[0] == pytest.approx(loss[1], rel=1e-6) and loss[2] == pytest.approx(
            loss[3], rel=1e-6) and abs(loss[0] - loss[2]) > 1e-4, (cases[i], loss)
        _close(ranks[0]["cases"][i]["gbc"][2], ranks[3]["cases"][i]["gbc"][2], 1e-6,
               "gradients on every rank")


# -- refusals -----------------------------------------------------------------------------------
def test_ulysses_size_not_dividing_the_heads_refused():
    """An SP size that does not divide the attention heads is refused before the model is
    built, naming ``ulysses_sequence_parallel_size`` (the tiny Qwen2: 4 heads, 2 KV heads)."""
    from types import SimpleNamespace

    from gbc_kernels.integrations.verl import fsdp as verl_fsdp

    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    for sp, ok in ((2, True), (4, True), (3, False), (8, False)):
        engine = SimpleNamespace(ulysses_sequence_parallel_size=sp,
                                 model_config=SimpleNamespace(hf_config=cfg))
        if ok:
            verl_fsdp._check_ulysses_heads(engine)
        else:
            with pytest.raises(ValueError, match="^ulysses_sequence_parallel_size: "):
                verl_fsdp.GBCEngineMixin.initialize(engine)
    # KV heads neither dividing nor divided by the size
    engine = SimpleNamespace(ulysses_sequence_parallel_size=4, model_config=SimpleNamespace(
        hf_config=SimpleNamespace(num_attention_heads=12, num_key_value_heads=6)))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        verl_fsdp._check_ulysses_heads(engine)


def test_ulysses_without_remove_padding_refused():
    """A micro-batch without remove-padding under Ulysses SP: refused naming
    ``use_remove_padding`` (verl slices only the packed stream)."""
    from types import SimpleNamespace

    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from gbc_kernels.integrations.verl import fsdp as verl_fsdp

    td = TensorDict({"x": torch.zeros(2, 1)}, batch_size=[2])
    tu.assign_non_tensor(td, use_remove_padding=False)
    with pytest.raises(ValueError, match="^use_remove_padding: "):
        verl_fsdp._check_supported(SimpleNamespace(use_ulysses_sp=True), td)
    verl_fsdp._check_supported(SimpleNamespace(use_ulysses_sp=False), td)


@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_ulysses_batch_selecting_loss_modes_refused(mode):
    """Clip-Cov and KL-Cov pick tokens from the whole batch (at random, by covariance rank),
    which a rank's share of the loss does not reproduce: refused under SP naming
    ``policy_loss.loss_mode`` before anything runs; allowed without SP."""
    from types import SimpleNamespace

    from verl.workers.utils.losses import ppo_loss

    from gbc_kernels.integrations.verl import fsdp as verl_fsdp

    loss_fn = functools.partial(ppo_loss, config=verl_actor_config(mode, "token-mean"))
    with pytest.raises(ValueError, match=f"^policy_loss.loss_mode: '{mode}'"):
        verl_fsdp._check_ulysses_loss(SimpleNamespace(use_ulysses_sp=True), loss_fn)
    verl_fsdp._check_ulysses_loss(SimpleNamespace(use_ulysses_sp=False), loss_fn)
    ok = functools.partial(ppo_loss, config=verl_actor_config("vanilla", "token-mean"))
    verl_fsdp._check_ulysses_loss(SimpleNamespace(use_ulysses_sp=True), ok)
