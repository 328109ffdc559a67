"""gbc's engine inside verl 0.9.1's own FSDP2 actor engine (integrations/verl/engine.py), against
verl's stock engine on the same model, weights and micro-batches.

What runs is verl's: its ``FSDPEngineWithLMHead`` built from its configs (``HFModelConfig``,
``FSDPEngineConfig``, ``FSDPOptimizerConfig``), FSDP2 wrapping, micro-batching, gradient
accumulation, global-batch normalisers, ``ppo_loss`` and its registered policy losses; the data
goes through its ``left_right_2_no_padding`` as its trainer sends it. Bypassed on CPU (said
here, because verl registers its engines for cuda/npu only):
- verl's platform detection: ``tests/standins/verl_cpu_platform.py`` says "cpu" with gloo;
- ``log_gpu_memory_usage`` (asks ``torch.cuda`` for figures) is a no-op;
- the TRL value-head patch in verl's ``apply_monkey_patch`` (TRL 1.16 no longer has that class);
- attention is SDPA (no flash-attn on CPU): with remove-padding the packed row is one causal
  sequence for both engines alike, so the comparison holds, the model's numbers are not a
  flash-attn run's;
- the Ray worker layer (``TrainingWorker``): the tests call the engine's ``train_batch`` /
  ``infer_batch`` / ``forward_backward_batch`` with the non-tensor fields the worker injects.
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

from conftest import VocabWatcher, spawn_gloo  # noqa: E402

pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")

from test_other_trainers import VERL_AGGS, VERL_MODES, verl_actor_config  # noqa: E402

V, H = 131, 32


def make_model_dir(path, vocab=V, hidden=H, tie=False):
    """A tiny Qwen2 and a word-level tokenizer, saved where verl's HFModelConfig loads them."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, tie_word_embeddings=tie)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="t0",
                            eos_token="t1").save_pretrained(path)
    return str(path)


def verl_on_cpu():
    """The CPU bypasses listed in the module docstring."""
    import importlib.util

    # by path: the standins folder also holds a flash_attn stand-in that must not be importable
    spec = importlib.util.spec_from_file_location(
        "verl_cpu_platform", os.path.join(HERE, "standins", "verl_cpu_platform.py"))
    platform = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(platform)
    platform.install()
    import verl.models.transformers.monkey_patch as mp
    import verl.workers.engine.fsdp.transformer_impl as ti
    mp.is_trl_available = lambda: False
    ti.log_gpu_memory_usage = lambda *a, **k: None


def build_engine(model_dir, gbc=True, rmpad=True, dtype="fp32", lr=1e-2, options=None,
                 optimizer="AdamW", sp=1):
    """verl's FSDP2 engine (or gbc's on top of it), initialised as its TrainingWorker does
    (``sp``: its Ulysses sequence-parallel size)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from gbc_kernels.integrations.verl import engine as ve

    mc = HFModelConfig(path=model_dir, use_remove_padding=rmpad,
                       override_config={"attn_implementation": "sdpa"})
    ec = FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, model_dtype="fp32",
                          ulysses_sequence_parallel_size=sp,
                          mixed_precision={"param_dtype": dtype, "reduce_dtype": "fp32",
                                           "buffer_dtype": "fp32"})
    oc = FSDPOptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1e6, optimizer=optimizer)
    cls = FSDPEngineWithLMHead
    if gbc:
        cls = ve.engine_class(FSDPEngineWithLMHead)
        cls.gbc_options = options or ve.EngineOptions()
    torch.manual_seed(0)
    engine = cls(mc, ec, oc, CheckpointConfig())
    if gbc:
        engine.initialize()
    else:
        # verl's own engine built as gbc's builds it (transformers >= 5.25: no hub kernels,
        # which verl's meta-device init refuses; releases.no_hub_kernels, issue 65)
        from gbc_kernels.integrations.releases import no_hub_kernels

        with no_hub_kernels():
            engine.initialize()
    return engine


def make_batch(seed, B, rmpad=True, temperature=0.8, micro=2, dynamic=False, with_is=True,
               entropy=True, world=1, vocab=V, confident=0.0, lengths=(6, 7), full=False,
               group=None, padded=False):
    """One rank's share of an actor update as verl's trainer sends it: left-padded prompts,
    right-padded responses, a masked response row and an empty one, old / ref log-probs near
    the policy's, group advantages, rollout IS weights; through ``left_right_2_no_padding``.
    ``group=G``: consecutive groups of G responses with verl's ``uid`` field and GRPO
    advantages of a binary reward (each group mixed). ``padded``: the trainer's padded tensors
    (before ``left_right_2_no_padding``), as a dict."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    Lp, Lr = lengths
    plens = torch.randint(1, Lp + 1, (B,), generator=g)
    rlens = torch.randint(1, Lr + 1, (B,), generator=g)
    rlens[0] = Lr
    if full:                                           # every sequence at full length
        plens[:], rlens[:] = Lp, Lr
    prompts = torch.zeros(B, Lp, dtype=torch.long)
    responses = torch.zeros(B, Lr, dtype=torch.long)
    attn = torch.zeros(B, Lp + Lr, dtype=torch.long)
    for b in range(B):
        p, r = int(plens[b]), int(rlens[b])
        prompts[b, Lp - p:] = torch.randint(2, vocab, (p,), generator=g)
        responses[b, :r] = torch.randint(2, vocab, (r,), generator=g)
        attn[b, Lp - p:Lp + r] = 1
    input_ids = torch.cat([prompts, responses], 1)
    position_ids = (attn.cumsum(1) - 1).clamp(min=0)
    rmask = attn[:, Lp:].clone()
    rmask &= (torch.rand(B, Lr, generator=g) < 0.85).long()
    rmask[0, :] = 1
    if B > 2:
        rmask[2] = 0                                   # an empty response row
    base = -torch.log(torch.tensor(float(vocab)))
    old = base + 0.3 * torch.randn(B, Lr, generator=g)
    # a share of tokens the old policy was sure of (p_old ~ 0.7: Lopti's high phase)
    sure = torch.rand(B, Lr, generator=g) < confident
    old = torch.where(sure, -0.36 + 0.05 * torch.randn(B, Lr, generator=g), old) * rmask
    ref = (base + 0.3 * torch.randn(B, Lr, generator=g)) * rmask
    adv = torch.randn(B, 1, generator=g).expand(B, Lr) * rmask
    if group:
        reward = (torch.rand(B, generator=g) < 0.5).float()
        reward[0::group], reward[1::group] = 1.0, 0.0                # every group mixed
        r = reward.view(-1, group)
        a = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).reshape(B, 1)
        adv = a.expand(B, Lr) * rmask
    fields = dict(input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
                  prompts=prompts, responses=responses, response_mask=rmask,
                  old_log_probs=old, advantages=adv.contiguous(), ref_log_prob=ref)
    if with_is:
        fields["rollout_is_weights"] = (0.6 + torch.rand(B, Lr, generator=g)) * rmask
    if padded:
        return fields
    td = TensorDict(fields, batch_size=[B])
    if group:
        from tensordict.tensorclass import NonTensorData, NonTensorStack
        td["uid"] = NonTensorStack.from_list([NonTensorData(f"q{seed}-{b // group}")
                                              for b in range(B)])
    td = left_right_2_no_padding(td)
    if isinstance(temperature, str):    # per-sample temperatures: a field of the batch
        td["temperature"] = 0.6 + torch.rand(B, generator=g)
    else:
        tu.assign_non_tensor(td, temperature=temperature)
    tu.assign_non_tensor(td, calculate_entropy=entropy,
                         global_batch_size=B * world, use_remove_padding=rmpad,
                         use_dynamic_bsz=dynamic, micro_batch_size_per_gpu=micro,
                         max_token_len_per_gpu=24, use_fused_kernels=False)
    return td


def _grads(engine):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in engine.module.named_parameters() if p.grad is not None}


def _params(engine):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in engine.module.named_parameters()}


def _metric_values(metrics):
    """verl's metrics as plain floats (Metric objects by their values), by name."""
    out = {}
    for k, vals in metrics.items():
        vals = vals if isinstance(vals, list) else [vals]
        flat = []
        for v in vals:
            flat.extend(v.values if hasattr(v, "values") and not isinstance(v, dict) else [v])
        out[k] = [float(x) for x in flat]
    return out


def _forward_backward(engine, data, loss_fn, stock):
    """One mini-batch's forward/backward over its micro-batches (no optimizer step), through
    verl's stock forward step or gbc's, from the same RNG state (Clip-Cov draws)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    if stock:
        engine.forward_step = functools.partial(FSDPEngineWithLMHead.forward_step, engine)
    try:
        engine.optimizer_zero_grad()
        torch.manual_seed(1234)
        out = engine.forward_backward_batch(data.clone(), loss_fn, forward_only=False)
    finally:
        engine.__dict__.pop("forward_step", None)
    return sum(out["loss"]), _metric_values(out["metrics"]), _grads(engine)


def _parity_worker(rank, world, model_dir, cases, rmpad, dtype, dynamic=False):
    verl_on_cpu()
    from verl.workers.utils.losses import ppo_loss

    engine = build_engine(model_dir, rmpad=rmpad, dtype=dtype)
    results = []
    for mode, agg, kl, ent, temp in cases:
        cfg = verl_actor_config(mode, agg, kl, entropy_coeff=ent)
        loss_fn = functools.partial(ppo_loss, config=cfg)
        seed = zlib.crc32(f"{mode}{agg}{kl}{rank}".encode()) % 10_000
        data = make_batch(seed, 6, rmpad=rmpad, temperature=temp, world=world, dynamic=dynamic)
        results.append({which: _forward_backward(engine, data, loss_fn, which == "verl")
                        for which in ("verl", "gbc")})
    return results


def _check_parity(results, cases, tol):
    for case, res in zip(cases, results):
        (l0, m0, g0), (l1, m1, g1) = res["verl"], res["gbc"]
        assert abs(l0 - l1) <= tol * max(1.0, abs(l0)), (case, l0, l1)
        # gbc adds its own (actor/gbc_*), verl's are all there
        assert set(m0) <= set(m1) and all(k.startswith("actor/gbc_") for k in set(m1) - set(m0)), \
            (case, set(m0) ^ set(m1))
        for k in m0:
            for a, b in zip(m0[k], m1[k]):
                assert abs(a - b) <= tol * max(1.0, abs(a)) + 1e-6, (case, k, a, b)
        assert set(g0) == set(g1)
        top = max(float(g.abs().max()) for g in g0.values())
        assert top > 0, case
        for n in g0:
            err = float((g0[n] - g1[n]).abs().max())
            assert err <= tol * top, (case, n, err, top)


def _case(mode, agg):
    # verl's geo_mean with a seq-mean-* aggregation and a KL/entropy term is refused by the
    # mapping (two sequence counts in one call, docs/math.md §12): its policy term alone there
    if mode == "geo_mean" and agg.startswith("seq-mean"):
        return (mode, agg, None, 0.0, 0.8)
    return (mode, agg, "low_var_kl", 0.01, 0.8)


ALL_CASES = [_case(mode, agg) for mode in VERL_MODES for agg in VERL_AGGS]
# without remove-padding: each mode once, the aggregations in turn
PADDED_CASES = [_case(mode, VERL_AGGS[i % len(VERL_AGGS)]) for i, mode in enumerate(VERL_MODES)]


@pytest.mark.slow
@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
def test_engine_equals_verl_every_loss_mode_and_aggregation(tmp_path, rmpad):
    """One rank, FSDP2, fp32: for each of verl's 11 loss modes x 5 loss_agg_modes (KL
    low_var_kl and an entropy term on, IS weights, micro-batches of 2 over 6 sequences with a
    masked and an empty response; without remove-padding each mode once): the mini-batch loss,
    every parameter's accumulated gradient and every metric verl logs are equal to verl's
    stock engine's."""
    model_dir = make_model_dir(tmp_path / "m")
    cases = ALL_CASES if rmpad else PADDED_CASES
    results = spawn_gloo(1, _parity_worker, model_dir, cases, rmpad, "fp32")[0]
    _check_parity(results, cases, 2e-5)


KL_CASES = [("vanilla", "token-mean", kl, 0.0, t) for kl, t in
            (("kl", 1.0), ("k2", 0.7), ("k3+", "per-sample"), ("abs", 1.3), (None, 1.0))]


@pytest.mark.slow
def test_engine_kl_forms_temperatures_two_ranks(tmp_path):
    """Two gloo ranks (FSDP2 shards the model, dp_size 2 in the normalisers), KL forms, the
    entropy term off, per-sample temperatures, and a few loss modes: equal to verl's engine."""
    model_dir = make_model_dir(tmp_path / "m")
    cases = KL_CASES + [(m, a, "low_var_kl", 0.01, 0.9) for m, a in
                        (("gspo", "seq-mean-token-mean"), ("clip_cov", "token-mean"),
                         ("geo_mean", "token-mean"), ("dppo_kl", "seq-mean-token-sum-norm"),
                         ("cispo", "token-sum"))]
    ranks = spawn_gloo(2, _parity_worker, model_dir, cases, True, "fp32")
    for results in ranks:
        _check_parity(results, cases, 2e-5)


@pytest.mark.slow
def test_engine_bf16_mixed_precision(tmp_path):
    """verl's default mixed precision (bf16 parameters in the forward, autocast): gbc's engine
    takes the bf16 hidden states and the head as FSDP2 holds it, and agrees with verl's engine
    to bf16's precision (both round the model's forward; the loss paths differ in where)."""
    model_dir = make_model_dir(tmp_path / "m")
    cases = [("vanilla", "token-mean", "low_var_kl", 0.01, 0.8),
             ("cispo", "seq-mean-token-sum", "k2", 0.0, 1.0)]
    results = spawn_gloo(1, _parity_worker, model_dir, cases, True, "bf16")[0]
    _check_parity(results, cases, 3e-2)


@pytest.mark.slow
def test_engine_dynamic_batch_sizes(tmp_path):
    """``use_dynamic_bsz``: verl packs the micro-batches by a token budget (24 tokens here, so
    they are uneven and reordered); gbc's engine equals verl's on them."""
    model_dir = make_model_dir(tmp_path / "m")
    cases = [("vanilla", "token-mean", "low_var_kl", 0.01, 0.8),
             ("gspo", "seq-mean-token-mean", "low_var_kl", 0.01, "per-sample"),
             ("clip_cov", "seq-mean-token-sum-norm", "k3+", 0.0, 1.0)]
    results = spawn_gloo(1, _parity_worker, model_dir, cases, True, "fp32", True)[0]
    _check_parity(results, cases, 2e-5)


def _steps_worker(rank, world, model_dir, gbc, rmpad, options):
    verl_on_cpu()
    from verl.workers.utils.losses import ppo_loss

    from gbc_kernels.integrations.verl import engine as ve

    # SGD: the update is linear in the gradient (AdamW would turn float32 rounding of a
    # near-zero gradient entry into a step of up to lr)
    engine = build_engine(model_dir, gbc=gbc, rmpad=rmpad, lr=0.5, optimizer="SGD",
                          options=ve.EngineOptions(**options) if options else None)
    cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl", entropy_coeff=0.01)
    loss_fn = functools.partial(ppo_loss, config=cfg)
    metrics = []
    for step in range(3):
        data = make_batch(100 * step + rank, 6, rmpad=rmpad, world=world, confident=0.4)
        with engine.train_mode():
            out = engine.train_batch(data, loss_fn)
        metrics.append(_metric_values(out["metrics"]))
    return _params(engine), metrics


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_engine_update_steps_end_in_the_same_parameters(tmp_path, world):
    """Three of verl's ``train_batch`` (micro-batches, gradient clipping, its optimizer step;
    SGD) on each rank: gbc's engine ends with the parameters of verl's stock engine, and the
    gradient norms of every step agree."""
    model_dir = make_model_dir(tmp_path / "m")
    stock = spawn_gloo(world, _steps_worker, model_dir, False, True, None)
    ours = spawn_gloo(world, _steps_worker, model_dir, True, True, None)
    (p0, m0), (p1, m1) = stock[0], ours[0]
    moved = max(float((p0[n] - _init).abs().max()) for n, _init in
                _initial_params(model_dir).items() if n in p0)
    assert moved > 1e-3
    for n in p0:
        err = float((p0[n] - p1[n]).abs().max())
        assert err <= 1e-5 * moved, (n, err, moved)
    for a, b in zip(m0, m1):
        assert abs(a["grad_norm"][0] - b["grad_norm"][0]) <= 1e-5 * a["grad_norm"][0]


def _initial_params(model_dir):
    from transformers import Qwen2ForCausalLM
    m = Qwen2ForCausalLM.from_pretrained(model_dir)
    return {n: p.detach() for n, p in m.named_parameters()}


@pytest.mark.slow
def test_engine_lopti_two_updates_and_ar(tmp_path):
    """Lopti inside verl's step: two optimizer steps per mini-batch, low-probability tokens
    first, equal to running the two phases by hand with gbc's loss; AR changes the update."""
    model_dir = make_model_dir(tmp_path / "m")
    lopti = spawn_gloo(1, _steps_worker, model_dir, True, True, dict(lopti_eta=0.5))[0]
    plain = spawn_gloo(1, _steps_worker, model_dir, True, True, None)[0]
    ar = spawn_gloo(1, _steps_worker, model_dir, True, True, dict(ar_alpha=0.3))[0]
    assert "gbc_grad_norm_second_phase" in lopti[1][0]
    diff = max(float((lopti[0][n] - plain[0][n]).abs().max()) for n in plain[0])
    assert diff > 1e-4
    # what the first step logs (docs/methods.md): the batch's terms without the split, at the
    # parameters before its first update -- the same step without Lopti's (same start, batch)
    terms = [k for k in plain[1][0] if k.split("/")[-1] in (
        "pg_loss", "kl_loss", "entropy_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")]
    assert {"actor/pg_loss", "kl_loss", "actor/entropy_loss"} <= set(terms), sorted(plain[1][0])
    for k in terms:
        want, got = plain[1][0][k], lopti[1][0][k]
        assert len(got) == len(want) and all(
            abs(a - b) <= 1e-6 * (1 + abs(b)) for a, b in zip(got, want)), (k, got, want)
    assert plain[1][1]["actor/pg_loss"] != lopti[1][1]["actor/pg_loss"]   # moved apart after
    diff = max(float((ar[0][n] - plain[0][n]).abs().max()) for n in plain[0])
    assert diff > 1e-5
    hand = spawn_gloo(1, _lopti_by_hand_worker, model_dir)[0]
    for n in hand:
        assert torch.allclose(hand[n], lopti[0][n], rtol=1e-4, atol=1e-6), n


AR_METRICS = {"actor/gbc_ar_weight_mean"}
LOPTI_METRICS = {"actor/gbc_low_frac", "actor/gbc_grad_share_low", "actor/gbc_grad_norm_sum"}


def _method_metrics_worker(rank, world, model_dir, cases):
    """The metric names of one ``train_batch`` of gbc's engine under each case's options."""
    verl_on_cpu()
    from verl.workers.utils.losses import ppo_loss

    from gbc_kernels.integrations.verl import engine as ve

    engine = build_engine(model_dir, gbc=True, lr=0.5, optimizer="SGD")
    cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl", entropy_coeff=0.01)
    loss_fn = functools.partial(ppo_loss, config=cfg)
    out = {}
    for name, options in cases.items():
        type(engine).gbc_options = ve.EngineOptions(**options)
        data = make_batch(5, 6, world=world, confident=0.4)
        with engine.train_mode():
            out[name] = set(engine.train_batch(data, loss_fn)["metrics"])
    return out


@pytest.mark.slow
def test_engine_logs_a_methods_metrics_only_when_it_runs(tmp_path):
    """gbc's AR and Lopti metrics are logged only where the method runs (a logged metric reads
    as its method on): with both off none of them, with ``ar_alpha`` AR's, with ``lopti_eta``
    Lopti's (``low_frac``, the step's ``grad_share_low`` and the ``grad_norm_sum`` it is built
    from); verl's own metrics in every case."""
    model_dir = make_model_dir(tmp_path / "m")
    cases = {"off": {}, "ar": dict(ar_alpha=0.3), "lopti": dict(lopti_eta=0.5),
             "both": dict(ar_alpha=0.3, lopti_eta=0.5)}
    got = spawn_gloo(1, _method_metrics_worker, model_dir, cases)[0]
    want = {"off": set(), "ar": AR_METRICS, "lopti": LOPTI_METRICS,
            "both": AR_METRICS | LOPTI_METRICS}
    for name, keys in got.items():
        assert keys & (AR_METRICS | LOPTI_METRICS) == want[name], (name, sorted(keys))
        assert {"actor/pg_loss", "actor/ppo_kl"} <= keys, (name, sorted(keys))


def _lopti_by_hand_worker(rank, world, model_dir):
    """Lopti as two separate calls of gbc's engine, each with one phase fixed."""
    verl_on_cpu()
    from verl.workers.utils.losses import ppo_loss

    engine = build_engine(model_dir, gbc=True, lr=0.5, optimizer="SGD")
    cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl", entropy_coeff=0.01)
    loss_fn = functools.partial(ppo_loss, config=cfg)
    base_opts = type(engine).gbc_options
    from gbc_kernels.integrations.verl import engine as ve
    type(engine).gbc_options = ve.EngineOptions(lopti_eta=0.5)
    for step in range(3):
        data = make_batch(100 * step + rank, 6, world=world, confident=0.4)
        with engine.train_mode():
            for phase in ("low", "high"):
                engine._gbc_phase = phase
                engine.optimizer_zero_grad()
                engine.forward_backward_batch(data.clone(), loss_fn, forward_only=False)
                engine.optimizer_step()
        engine._gbc_phase = None
    type(engine).gbc_options = base_opts
    return _params(engine)


def _infer_worker(rank, world, model_dir, rmpad, temp, dynamic):
    verl_on_cpu()
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    engine = build_engine(model_dir, rmpad=rmpad)
    data = make_batch(7 + rank, 6, rmpad=rmpad, temperature=temp, dynamic=dynamic, world=world)
    tu.assign_non_tensor(data, calculate_sum_pi_squared=True)
    out = {}
    for which in ("verl", "gbc"):
        if which == "verl":
            engine.forward_step = functools.partial(FSDPEngineWithLMHead.forward_step, engine)
        with engine.eval_mode():
            o = engine.infer_batch(data.clone(), loss_function=None)
        engine.__dict__.pop("forward_step", None)
        out[which] = {k: no_padding_2_padding(o["model_output"][k], data)
                      for k in ("log_probs", "entropy", "sum_pi_squared")}
    return out, data["response_mask"]


@pytest.mark.slow
@pytest.mark.parametrize("rmpad,temp,dynamic", [(True, 1.0, False), (False, 0.7, False),
                                                (True, "per-sample", True)])
def test_engine_forward_only_equals_verl(tmp_path, rmpad, temp, dynamic):
    """``compute_log_prob``'s pass (old policy / reference): gbc's log-probs, entropy and
    sum of squared probabilities of every response token equal verl's (remove-padding on and
    off, per-sample temperature, dynamic batch sizes: verl's reordering)."""
    model_dir = make_model_dir(tmp_path / "m")
    out, rmask = spawn_gloo(1, _infer_worker, model_dir, rmpad, temp, dynamic)[0]
    # every response position (masked-out tokens included; beyond a response's end both are 0
    # from no_padding_2_padding); the prompt part is not read by verl's trainer and gbc leaves
    # it 0
    for k in ("log_probs", "entropy", "sum_pi_squared"):
        a, b = out["verl"][k], out["gbc"][k]
        assert a.abs().max() > 0
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (k, (a - b).abs().max())


def test_options_parse_and_refusals():
    from gbc_kernels.integrations.verl import engine as ve

    o = ve.EngineOptions.parse("ar_alpha=0.3, lopti_eta=0.5,backend=torch")
    assert (o.ar_alpha, o.lopti_eta, o.backend) == (0.3, 0.5, "torch")
    assert ve.EngineOptions.parse("") == ve.EngineOptions()
    with pytest.raises(ValueError, match="GBC_VERL_OPTIONS: unknown option 'alpha'"):
        ve.EngineOptions.parse("alpha=1")
    with pytest.raises(ValueError, match="lopti_eta expects a float"):
        ve.EngineOptions.parse("lopti_eta=high")
    with pytest.raises(ValueError, match="name=value"):
        ve.EngineOptions.parse("ar_alpha")
    with pytest.raises(ValueError, match="lopti_order"):
        ve.EngineOptions(lopti_order="random")
    with pytest.raises(ValueError, match="ar_alpha"):
        ve.EngineOptions(ar_alpha=2.0)
    o = ve.EngineOptions.parse("nthr=1,nthr_eta=0.25,critical_kl_exponent=150,"
                               "critical_kl_certainty=entropy")
    assert (o.nthr, o.nthr_eta, o.critical_kl_exponent, o.critical_kl_certainty) == \
        (True, 0.25, 150.0, "entropy")
    assert ve.EngineOptions.parse("nthr=yes,nthr_eta=auto").nthr_eta == "auto"
    with pytest.raises(ValueError, match="nthr expects a 1/0/true/false"):
        ve.EngineOptions.parse("nthr=maybe")
    with pytest.raises(ValueError, match="critical_kl_exponent: expected a float > 0"):
        ve.EngineOptions(critical_kl_exponent=0.0)
    with pytest.raises(ValueError, match="critical_kl_certainty"):
        ve.EngineOptions(critical_kl_certainty="margin")
    with pytest.raises(ValueError, match="nthr_eta"):
        ve.EngineOptions(nthr_eta=-1.0)


def _refusal_worker(rank, world, model_dir, what):
    verl_on_cpu()
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    engine = build_engine(model_dir)
    cfg = verl_actor_config("vanilla", "token-mean")
    data = make_batch(3, 4)
    from gbc_kernels.integrations.verl import engine as ve

    if what == "use_fused_kernels":
        tu.assign_non_tensor(data, use_fused_kernels=True)
    elif what == "nthr":                       # no gbc_token_scale: its pass did not run
        type(engine).gbc_options = ve.EngineOptions(nthr=True)
    elif what == "critical_kl_exponent":       # no KL term in verl's config to weight
        type(engine).gbc_options = ve.EngineOptions(critical_kl_exponent=2.0)
    else:       # Ulysses SP slices verl's packed stream: without remove-padding, refused
        engine.use_ulysses_sp = True
        tu.assign_non_tensor(data, use_remove_padding=False)
    try:
        engine.forward_backward_batch(data, functools.partial(ppo_loss, config=cfg))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize("what", ["use_fused_kernels", "use_remove_padding", "nthr",
                                  "critical_kl_exponent"])
def test_engine_refuses_what_it_cannot_honour(tmp_path, what):
    model_dir = make_model_dir(tmp_path / "m")
    msg = spawn_gloo(1, _refusal_worker, model_dir, what)[0]
    assert msg.startswith(what), msg


def test_plugin_switches_the_registry(monkeypatch):
    """``import verl`` loads gbc's plugin; with GBC_VERL_ENGINE=1 the registry hands out gbc's
    engine for FSDP and FSDP2 (every device), with the options of GBC_VERL_OPTIONS; disable()
    puts verl's back."""
    import importlib

    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from gbc_kernels.integrations.verl import engine as ve
    from gbc_kernels.integrations.verl import fsdp as verl_fsdp

    monkeypatch.setenv("GBC_VERL_ENGINE", "strict")
    monkeypatch.setenv("GBC_VERL_OPTIONS", "ar_alpha=0.25")
    import gbc_kernels.integrations.verl.plugin as plugin
    try:
        importlib.reload(plugin)
        table = EngineRegistry._engines["language_model"]
        for backend in ("fsdp", "fsdp2"):
            for cls in table[backend].values():
                assert issubclass(cls, verl_fsdp.GBCEngineMixin)
                assert issubclass(cls, FSDPEngineWithLMHead)
                assert cls.gbc_options.ar_alpha == 0.25
    finally:
        ve.disable()
    for backend in ("fsdp", "fsdp2"):
        assert all(cls is FSDPEngineWithLMHead
                   for cls in EngineRegistry._engines["language_model"][backend].values())
    from importlib.metadata import entry_points
    assert any(ep.value == "gbc_kernels.integrations.verl.plugin"
               for ep in entry_points(group="verl.plugins"))


def _watch_worker(rank, world, model_dir, vocab):
    os.environ["GBC_CHUNK_MB"] = "0.02"
    verl_on_cpu()
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss

    engine = build_engine(model_dir)
    cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl", entropy_coeff=0.01)
    loss_fn = functools.partial(ppo_loss, config=cfg)
    data = make_batch(5, 6, micro=6, vocab=vocab)
    n_tokens = int(data["input_ids"].offsets()[-1])
    seen = {}
    for which in ("verl", "gbc"):
        if which == "verl":
            engine.forward_step = functools.partial(FSDPEngineWithLMHead.forward_step, engine)
        with VocabWatcher(vocab) as w:
            engine.optimizer_zero_grad()
            engine.forward_backward_batch(data.clone(), loss_fn, forward_only=False)
            with engine.eval_mode():
                engine.infer_batch(data.clone(), loss_function=None)
        engine.__dict__.pop("forward_step", None)
        seen[which] = [s for s in w.seen if len(s) >= 2 and s not in ((vocab, H), (H, vocab))]
    return seen, n_tokens


@pytest.mark.slow
def test_no_full_logits_on_gbc_path(tmp_path):
    """A dispatch-mode watcher over a training micro-batch (forward and backward) and a
    log-prob pass: on gbc's path no tensor over the vocabulary has as many rows as the
    micro-batch has tokens (the chunk budget is small); on verl's it does, so the test can
    fail."""
    vocab = 2053
    model_dir = make_model_dir(tmp_path / "m", vocab=vocab)
    seen, n_tokens = spawn_gloo(1, _watch_worker, model_dir, vocab)[0]

    def rows(shapes):
        return max(torch.Size(s[:-1]).numel() for s in shapes) if shapes else 0

    assert rows(seen["verl"]) >= n_tokens
    assert 0 < rows(seen["gbc"]) < n_tokens // 2, seen["gbc"]


# ----------------------------------------------------------------------------------------------
# NTHR and critical-token KL inside verl's step
# ----------------------------------------------------------------------------------------------

GROUP, NB = 4, 8          # 2 groups of 4 responses


def _reference_rows(model_dir, seed, B, temperature=0.8):
    """The lm_head's inputs at each response position, from the plain HF model in float64
    (full sequences, no packing, no FSDP), the weight, targets and response mask."""
    from transformers import Qwen2ForCausalLM

    f = make_batch(seed, B, group=GROUP, padded=True)
    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager").double()
    Lp = f["prompts"].shape[1]
    T = f["responses"].shape[1]
    hidden = torch.zeros(B, T, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        for b in range(B):
            keep = f["attention_mask"][b].bool()
            out = model.model(input_ids=f["input_ids"][b][keep][None]).last_hidden_state[0]
            p = int(keep[:Lp].sum())
            r = int(keep[Lp:].sum())
            hidden[b, :r] = out[p - 1:p - 1 + r]
    return hidden, model.lm_head.weight.detach(), f


def _nthr_worker(rank, world, model_dir, rows_of, beta):
    verl_on_cpu()
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    from gbc_kernels.integrations.verl import engine as ve

    engine = build_engine(model_dir, options=ve.EngineOptions(nthr=True, nthr_beta=beta))
    data = make_batch(11, NB, group=GROUP, world=world)
    if rows_of is not None:        # this rank's share of the global batch
        data = tu.index_select_tensor_dict(data, torch.as_tensor(rows_of[rank]))
    with engine.eval_mode():
        engine.gbc_nthr_pass(data)
    scale = data[ve.SCALE_KEY].clone()
    metrics = dict(engine._gbc_update_metrics)
    if world > 1:
        return scale, metrics
    # the update with NTHR equals the plain update with the advantages scaled by hand, and
    # differs from the plain update (old log-probs on-policy: no token is clipped away)
    from verl.workers.utils.padding import no_padding_2_padding
    with engine.eval_mode():
        o = engine.infer_batch(data.clone(), loss_function=None)
    data["old_log_probs"] = no_padding_2_padding(o["model_output"]["log_probs"], data).float()
    cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl", entropy_coeff=0.01)
    loss_fn = functools.partial(ppo_loss, config=cfg)
    with_nthr = _forward_backward(engine, data, loss_fn, False)
    by_hand = data.clone()
    by_hand["advantages"] = data["advantages"] * scale
    del by_hand[ve.SCALE_KEY]
    type(engine).gbc_options = ve.EngineOptions()
    plain = _forward_backward(engine, by_hand, loss_fn, False)
    unscaled = data.clone()
    del unscaled[ve.SCALE_KEY]
    no_nthr = _forward_backward(engine, unscaled, loss_fn, False)
    return scale, metrics, with_nthr, plain, no_nthr


@pytest.mark.slow
def test_engine_nthr_pass_equals_reference(tmp_path):
    """NTHR inside verl's step: the old-policy pass over the rank's update batch (verl's
    micro-batching, FSDP2, packed sequences) gives the token scales of gbc_reference's NTHR on
    the plain model's float64 hidden states (groups from ``uid``, correct = advantage > 0); the
    update then equals the plain update with ``advantages * scale``. β = 0: on a random tiny
    model the self-pair scores of correct responses dwarf the others, so β > 0 selects none
    (β itself is tested against the reference in tests/test_nthr.py)."""
    import gbc_reference as ref

    beta = 0.0
    model_dir = make_model_dir(tmp_path / "m")
    scale, metrics, with_nthr, plain, no_nthr = spawn_gloo(1, _nthr_worker, model_dir, None,
                                                           beta)[0]
    hidden, weight, f = _reference_rows(model_dir, 11, NB)
    mask = f["response_mask"].bool()
    adv = f["advantages"]
    correct = (adv * mask).sum(1) > 0
    gids = torch.arange(NB) // GROUP
    want = ref.nthr_scale(hidden, weight.double(), f["responses"], mask, gids, correct,
                          temperature=0.8, beta=beta)
    assert want.selected.any() and not want.selected[mask & ~correct[:, None]].all()
    assert torch.equal(scale != 1.0, want.selected), (scale, want.selected)
    assert torch.allclose(scale, want.scale.float())
    assert metrics["actor/gbc_nthr_selected_frac"] > 0
    (l0, _, g0), (l1, _, g1) = with_nthr, plain
    assert abs(l0 - l1) <= 1e-6 * max(1.0, abs(l0))
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=1e-5, atol=1e-7), n
    g2 = no_nthr[2]
    assert max(float((g0[n] - g2[n]).abs().max()) for n in g0) > 1e-4


@pytest.mark.slow
def test_engine_nthr_groups_split_over_two_ranks(tmp_path):
    """verl's ``balance_batch`` scatters a group's responses over data-parallel ranks: each
    rank's scales equal the one-rank pass over the whole batch, row for row."""
    model_dir = make_model_dir(tmp_path / "m")
    whole = spawn_gloo(1, _nthr_worker, model_dir, None, 0.0)[0][0]
    assert (whole != 1).any()
    rows_of = [[0, 2, 5, 7], [1, 3, 4, 6]]
    ranks = spawn_gloo(2, _nthr_worker, model_dir, rows_of, 0.0)
    for rows, (scale, _) in zip(rows_of, ranks):
        assert torch.allclose(scale, whole[rows], atol=1e-6), (rows, scale, whole[rows])


def test_nthr_hook_runs_before_verl_update(tmp_path):
    """The wrapper gbc puts on verl's ``TrainingWorker.train_mini_batch``: with ``nthr`` on it
    runs the engine's pass (in eval mode, with the worker's forward-only micro-batching) and
    then verl's function; otherwise verl's function alone."""
    import contextlib
    from types import SimpleNamespace

    from verl.workers.utils.losses import ppo_loss

    from gbc_kernels.integrations.verl import engine as ve
    from gbc_kernels.integrations.verl import fsdp as verl_fsdp

    calls = []

    class Engine(verl_fsdp.GBCEngineMixin):
        gbc_options = ve.EngineOptions(nthr=True)

        def eval_mode(self, **kw):
            calls.append("eval_mode")
            return contextlib.nullcontext()

        def gbc_nthr_pass(self, data, defaults):
            calls.append(("pass", defaults["micro_batch_size_per_gpu"]))
            self._gbc_update_metrics = {"actor/gbc_nthr_selected_frac": 0.5}

    ec = SimpleNamespace(use_dynamic_bsz=False, infer_max_token_len_per_gpu=64,
                         infer_micro_batch_size_per_gpu=None, micro_batch_size_per_gpu=3,
                         use_fused_kernels=False)
    worker = SimpleNamespace(engine=Engine(), engine_config=ec, model_config={},
                             loss_fn=functools.partial(ppo_loss, config=None))
    hooked = ve._nthr_before_update(lambda self, data: calls.append("verl") or "out")
    data = make_batch(1, 4)
    assert hooked(worker, data) == "out"
    assert calls == ["eval_mode", ("pass", 3), "verl"]
    assert worker.engine._gbc_update_metrics == {"actor/gbc_nthr_selected_frac": 0.5}
    calls.clear()
    Engine.gbc_options = ve.EngineOptions()
    assert hooked(worker, data) == "out" and calls == ["verl"]
    # NTHR off on the next update: its metrics of the update before are not logged again
    assert worker.engine._gbc_update_metrics == {}


def _certainty_worker(rank, world, model_dir, exponent):
    verl_on_cpu()
    from types import SimpleNamespace

    from verl import DataProto
    from verl.utils import tensordict_utils as tu

    from gbc_kernels.integrations.verl import engine as ve

    opts = ve.EngineOptions(critical_kl_exponent=exponent, critical_kl_temperature=0.25)
    engine = build_engine(model_dir, options=opts)
    ve._OPTIONS["current"] = opts
    f = make_batch(11, NB, group=GROUP, padded=True)
    batch = DataProto.from_dict(tensors=f, meta_info={"temperature": 0.8})

    def ref_worker(td):            # the worker's infer_batch: its defaults, eval mode
        tu.assign_non_tensor(td, use_remove_padding=True, use_dynamic_bsz=False,
                             micro_batch_size_per_gpu=2, max_token_len_per_gpu=64,
                             use_fused_kernels=False)
        with engine.eval_mode():
            return engine.infer_batch(td, loss_function=None)["model_output"]

    cfg = SimpleNamespace(actor_rollout_ref=SimpleNamespace(actor={"use_kl_loss": True}))
    trainer = SimpleNamespace(config=cfg, ref_in_actor=False,
                              ref_policy_wg=SimpleNamespace(compute_ref_log_prob=ref_worker))
    out = ve.compute_ref_log_prob(trainer, batch)
    return out.batch["ref_log_prob"], out.batch[ve.KL_WEIGHT_KEY]


@pytest.mark.slow
def test_critical_kl_reference_pass_equals_reference(tmp_path):
    """The trainer's reference pass as gbc wraps it: through the engine's forward-only step,
    ``ref_log_prob`` and the weights ``(J_max_prob at T=0.25)^γ`` of every response token equal
    gbc_reference's on the plain model's float64 logits."""
    import gbc_reference as ref

    model_dir = make_model_dir(tmp_path / "m")
    logp, w = spawn_gloo(1, _certainty_worker, model_dir, 0.5)[0]
    hidden, weight, f = _reference_rows(model_dir, 11, NB)
    mask = f["response_mask"].bool()
    st = ref.token_stats(hidden, weight.double(), f["responses"], temperature=0.8,
                         certainty="max_prob", certainty_temperature=0.25)
    want = ref.critical_kl_weight(st.certainty, 0.5) * mask
    assert float(want[mask].std()) > 1e-3
    assert torch.allclose(w, want.float(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(logp[mask], st.logp[mask], rtol=1e-5, atol=1e-5)


def _kl_weight_worker(rank, world, model_dir):
    verl_on_cpu()
    from verl.trainer.ppo.core_algos import kl_penalty
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from gbc_kernels.integrations.verl import engine as ve

    engine = build_engine(model_dir, options=ve.EngineOptions(critical_kl_exponent=1.0))
    cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl", entropy_coeff=0.0)
    loss_fn = functools.partial(ppo_loss, config=cfg)
    data = make_batch(5, 6)
    g = torch.Generator().manual_seed(3)
    w = torch.rand(data["response_mask"].shape, generator=g) * data["response_mask"]
    losses = {}
    for name, weight in (("w", w), ("zero", torch.zeros_like(w))):
        d = data.clone()
        d[ve.KL_WEIGHT_KEY] = weight
        losses[name] = _forward_backward(engine, d, loss_fn, False)[0]
    # verl's own log-probs (stock forward) and KL estimator give the term the weights scale
    engine.forward_step = functools.partial(FSDPEngineWithLMHead.forward_step, engine)
    with engine.eval_mode():
        o = engine.infer_batch(data.clone(), loss_function=None)
    engine.__dict__.pop("forward_step")
    logp = no_padding_2_padding(o["model_output"]["log_probs"], data)
    kl = kl_penalty(logp, data["ref_log_prob"], "low_var_kl")
    mask = data["response_mask"].bool()
    refused = {}
    d = data.clone()
    try:
        _forward_backward(engine, d, loss_fn, False)
    except ValueError as e:
        refused["missing"] = str(e)
    return losses, float((w * kl)[mask].sum() / mask.sum()), cfg.kl_loss_coef, refused


@pytest.mark.slow
def test_critical_kl_weights_scale_verl_kl_term(tmp_path):
    """The weights enter verl's KL loss term token by token: L(w) − L(0) = β · Σ w·k / N with
    k verl's own ``kl_penalty`` of its stock log-probs (token-mean over the N masked tokens);
    without the weights' field the update is refused with the field named."""
    model_dir = make_model_dir(tmp_path / "m")
    losses, weighted, beta, refused = spawn_gloo(1, _kl_weight_worker, model_dir)[0]
    assert abs(weighted) > 1e-4
    got = losses["w"] - losses["zero"]
    assert abs(got - beta * weighted) <= 1e-5 * abs(beta * weighted), (got, beta * weighted)
    assert "gbc_kl_weight" in refused["missing"]


def test_patch_on_import(tmp_path, monkeypatch):
    """verl imports gbc's plugin before its worker and trainer modules: ``enable()`` then
    wraps their functions right after the modules are imported (a ``sys.meta_path`` hook),
    once; a module already imported is wrapped at once."""
    import importlib
    import sys

    from gbc_kernels.integrations.verl import engine as ve

    (tmp_path / "gbc_fake_trainer_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    try:
        ve._on_import("gbc_fake_trainer_mod", lambda m: seen.append(m.VALUE))
        ve._on_import("gbc_fake_trainer_mod", lambda m: seen.append("twice"))
        assert seen == []
        mod = importlib.import_module("gbc_fake_trainer_mod")
        assert seen == [1] and mod.VALUE == 1
        ve._on_import("gbc_fake_trainer_mod", lambda m: seen.append("loaded"))
        assert seen == [1, "loaded"]
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, ve._PatchOnImport)]
        sys.modules.pop("gbc_fake_trainer_mod", None)


@pytest.mark.parametrize("item", ["nthr_beta=nan", "critical_kl_exponent=inf", "ar_alpha=nan",
                                  "lopti_eta=nan", "nthr_eta=inf", "nthr_eta=-inf",
                                  "critical_kl_intercept=nan", "critical_kl_temperature=inf",
                                  "nthr_beta=-inf"])
def test_options_non_finite_refused(item):
    """GBC_VERL_OPTIONS: a float option that is nan or +-inf is refused, naming it (nan and inf
    would pass a "> 0" check or poison the scales)."""
    from gbc_kernels.integrations.verl import engine as ve

    name = item.split("=")[0]
    with pytest.raises(ValueError, match=f"^GBC_VERL_OPTIONS: {name}: expected a finite"):
        ve.EngineOptions.parse(f"backend=torch,{item}")
    value = float(item.split("=")[1])
    with pytest.raises(ValueError, match=f"^{name}: expected a finite float"):
        ve.EngineOptions(**{name: value})
    assert ve.EngineOptions.parse(f"{name}=0.5").__dict__[name] == 0.5


def test_options_repeated_name_refused():
    """GBC_VERL_OPTIONS: an option given twice is refused, naming it and both values (never
    the last one kept silently)."""
    from gbc_kernels.integrations.verl import engine as ve

    with pytest.raises(ValueError, match=r"^GBC_VERL_OPTIONS: ar_alpha given twice "
                                         r"\(ar_alpha=0\.1 and ar_alpha=0\.2\)"):
        ve.EngineOptions.parse("ar_alpha=0.1,ar_alpha=0.2")
    with pytest.raises(ValueError, match="GBC_VERL_OPTIONS: nthr given twice"):
        ve.EngineOptions.parse("nthr=1, lopti_eta=0.5, nthr=1")
    assert ve.EngineOptions.parse("ar_alpha=0.1,lopti_eta=0.2").ar_alpha == 0.1
