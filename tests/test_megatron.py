"""gbc on megatron-core 0.16.1's tensor-parallel output layer (gbc_kernels.integrations.megatron,
docs/megatron.md), on CPU: gloo ranks, a tiny float64 ``GPTModel`` from megatron's local layer
spec (tests/standins/megatron_cpu.py holds the CPU shims).

Oracle: megatron's and verl's own functions on the stock head's ``[B, S, V/tp]`` logits — the
model's output layer, megatron's ``vocab_parallel_cross_entropy``, verl's
``vocab_parallel_log_probs_from_logits``, ``vocab_parallel_entropy``,
``vocab_parallel_sum_pi_squared`` and its ``ppo_loss`` composition (the method inputs, which
verl has not, against ``gbc_reference.policy_loss`` on the same log-probs). Checked on each
rank: loss, log-probs, entropy, sum p^2, d hidden at the head and every parameter's gradient of
the whole model (the decoder's included) after a backward through it; tensor parallel 2 with
and without sequence parallelism, a tied head, a padded vocabulary; tensor parallel 2 equal to
tensor parallel 1; and a dispatch watcher: no ``[N, V/tp]`` logits on gbc's path.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

import megatron.core  # noqa: F401  (requirements-dev.txt: megatron-core==0.16.1)

HERE = os.path.dirname(os.path.abspath(__file__))
from conftest import VocabWatcher, megatron_cpu, spawn_gloo  # noqa: E402

S, B, H = 16, 3, 24           # H differs from every V/tp below (the watcher keys on the last dim)
VP = 64                       # the model's (padded) vocabulary
CASES = {
    # name: (vocabulary the labels use, tied head, sequence parallel, loss)
    "plain": (VP, False, False, "verl"),
    "tied_sp": (VP, True, True, "verl"),
    "padded_methods": (50, False, False, "methods"),   # rows 50..63 are megatron's padding
    "padded_sp_methods": (50, False, True, "methods"),
}


def _inputs(vocab_real, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_real, (B, S), generator=g)
    labels = torch.roll(ids, -1, 1)
    t = torch.arange(S)
    prompt, end = torch.tensor([5, 8, 3]), torch.tensor([S - 1, 12, S - 1])
    mask = (t >= prompt[:, None] - 1) & (t < end[:, None])
    adv = torch.randn(B, generator=g, dtype=torch.float64) * torch.tensor([1.0, -1.0, 1.0])
    adv = adv[:, None].expand(B, S).contiguous()      # verl's advantages are per token
    noise = torch.randn(2, B, S, generator=g, dtype=torch.float64)
    token_scale = torch.rand(B, S, generator=g, dtype=torch.float64) + 0.5
    kl_weight = torch.rand(B, S, generator=g, dtype=torch.float64)
    return dict(ids=ids, labels=labels, mask=mask, adv=adv, noise=noise,
                token_scale=token_scale, kl_weight=kl_weight)


def _losses(kind):
    """``(oracle(logp, entropy, old, ref, x) -> loss, gbc config, gbc loss kwargs(x))``."""
    import gbc_reference as ref
    from gbc_kernels import PolicyLossConfig
    from gbc_kernels.integrations import verl as gv
    from test_other_trainers import verl_actor_config, verl_ppo_loss

    if kind == "verl":
        actor = verl_actor_config("vanilla", "token-mean", "low_var_kl", entropy_coeff=0.01)
        cfg = gv.policy_loss_config(actor, response_length=S)

        def oracle(lp, en, old, refl, x):
            return verl_ppo_loss(actor, lp, en, old, x["adv"], x["mask"], refl, None, {})

        return oracle, cfg, lambda x: dict(gv.batch_normalisers(actor, x["mask"], {}))
    cfg = PolicyLossConfig(loss_agg="seq-mean-token-mean", kl_coef=0.05, kl_estimator="k3",
                           entropy_coef=0.01, ar_alpha=0.3, lopti_eta=0.5, clip_ratio_c=3.0)
    rcfg = ref.PolicyLossConfig(**{k: getattr(cfg, k) for k in
                                   ref.PolicyLossConfig.__dataclass_fields__})

    def oracle(lp, en, old, refl, x):
        return ref.policy_loss(lp, x["mask"], x["adv"], old, refl, entropy=en,
                               token_scale=x["token_scale"], kl_weight=x["kl_weight"],
                               config=rcfg, phase="low")[0]

    return oracle, cfg, lambda x: dict(token_scale=x["token_scale"], kl_weight=x["kl_weight"],
                                       phase="low")


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _case(name, tp, group):
    """One model, the stock head and gbc's processor through the whole model's backward."""
    mc = megatron_cpu()
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from verl.utils.megatron.tensor_parallel import (vocab_parallel_entropy,
                                                     vocab_parallel_log_probs_from_logits,
                                                     vocab_parallel_sum_pi_squared)

    from gbc_kernels.integrations import megatron as M

    vocab_real, tied, sp, kind = CASES[name]
    sp = sp and tp > 1
    model = mc.tiny_gpt(VP, hidden=H, seq=S, tp=tp, sp=sp, tied=tied, dtype=torch.float64)
    x = _inputs(vocab_real)
    pos = torch.arange(S)[None].expand(B, S)
    oracle, cfg, loss_kw = _losses(kind)
    weight = model.shared_embedding_or_output_weight() if tied else model.output_layer.weight
    out = {}

    # the stock head: megatron's output layer, then verl's / megatron's functions on its logits
    with mc.capture_head_input(model) as seen:
        logits = model(x["ids"], pos, mc.causal_mask(S))              # [B, S, V/tp]
    seen[0].retain_grad()
    lp = vocab_parallel_log_probs_from_logits(logits.clone(), x["labels"])
    en = vocab_parallel_entropy(logits.clone())
    nll = vocab_parallel_cross_entropy(logits.detach().clone(), x["labels"])
    sp2 = vocab_parallel_sum_pi_squared(logits.detach())
    old = (lp.detach() + 0.3 * x["noise"][0]).clamp(max=0)
    refl = (lp.detach() + 0.3 * x["noise"][1]).clamp(max=0)
    loss = oracle(lp, en, old, refl, x)
    loss.backward()
    mc.allreduce_sp_norm_grads(model, group)
    m = x["mask"]
    out["stock"] = dict(loss=loss.detach(), logp=torch.where(m, lp.detach(), 0.0),
                        mcore_logp=torch.where(m, -nll, 0.0),
                        entropy=torch.where(m, en.detach(), 0.0),
                        sum_p2=torch.where(m, sp2, 0.0), dhidden=seen[0].grad.clone(),
                        grads=_grads(model), logits_shape=tuple(logits.shape))
    model.zero_grad(set_to_none=True)

    # gbc: the same forward to the head's input, then the processor (the model's logits unused)
    step = (model, weight, x, pos, m, old, refl, cfg, sp, loss_kw, group)
    h, res = _gbc_step(*step)
    lpo = M.logprobs(h.detach(), weight.detach(), x["labels"], m, sequence_parallel=sp,
                     return_sum_p2=True)
    out["gbc"] = dict(loss=res.loss.detach(), logp=res.logp, entropy=res.entropy,
                      sum_p2=res.sum_p2, dhidden=h.grad.clone(), grads=_grads(model),
                      logprobs=(lpo.logp, lpo.entropy, lpo.sum_p2), metrics=res.metrics)
    model.zero_grad(set_to_none=True)
    out["main_grad"] = _main_grad_case(*step)

    # the differentiable log-prob variant against verl's functions on the output layer's logits
    hl = h.detach().clone().requires_grad_(True)
    wl = weight.detach().clone().requires_grad_(True)
    c1, c2 = x["token_scale"], x["kl_weight"]
    lg = model.output_layer(hl, weight=wl)[0].transpose(0, 1).contiguous()
    ((vocab_parallel_log_probs_from_logits(lg.clone(), x["labels"]) * c1
      + vocab_parallel_entropy(lg.clone()) * c2) * m).sum().backward()
    want = (hl.grad.clone(), wl.grad.clone())
    hl.grad = wl.grad = None
    got = M.logprobs(hl, wl, x["labels"], m, sequence_parallel=sp)
    ((got.logp * c1 + got.entropy * c2) * m).sum().backward()
    out["logprobs_grad"] = (want, (hl.grad, wl.grad))

    # megatron-core's output-processor hook (0.18+: GPTModel._postprocess passes these
    # keywords), verl's fused-route contract, at temperature 0.8: against the output layer
    hl = h.detach().clone().requires_grad_(True)
    wl = weight.detach().clone().requires_grad_(True)
    lg = (model.output_layer(hl, weight=wl)[0].transpose(0, 1) / 0.8).contiguous()
    lp_want = vocab_parallel_log_probs_from_logits(lg.clone(), x["labels"])
    en_want = vocab_parallel_entropy(lg.clone())
    ((lp_want * c1 + en_want * c2) * m).sum().backward()
    want = (lp_want.detach(), en_want.detach(), hl.grad.clone(), wl.grad.clone())
    model.zero_grad(set_to_none=True)
    hl.grad = None
    got = M.output_processor(
        hidden_states=hl, output_layer=model.output_layer, output_weight=weight if tied else None,
        labels=x["labels"], loss_mask=m.double(), input_ids=x["ids"], position_ids=pos,
        attention_mask=None, decoder_input=None, inference_context=None, packed_seq_params=None,
        runtime_gather_output=None, context=types.SimpleNamespace(temperature=0.8),
        compute_language_model_loss=None, scale_logits=None, config=model.config)
    # verl's fused forward rewrites the fields in place (postprocess_packed_seqs_for_dict_output)
    got.log_probs = got.log_probs.masked_fill(~m, 0.0)
    got.entropy = got.entropy.masked_fill(~m, 0.0)
    ((got.log_probs * c1 + got.entropy * c2)).sum().backward()
    out["processor"] = (want, (got.log_probs.detach(), got.entropy.detach(), hl.grad,
                               weight.grad))
    # MuP (megatron's _scale_logits: logits x mup_output_mult), the model's config otherwise
    with torch.no_grad():
        lg = (model.output_layer(h.detach(), weight=weight)[0].transpose(0, 1) * 0.5 / 0.8)
        mup = types.SimpleNamespace(use_mup=True, mup_output_mult=0.5)
        got = M.output_processor(hidden_states=h.detach(), output_layer=model.output_layer,
                                 output_weight=weight if tied else None, labels=x["labels"],
                                 context=types.SimpleNamespace(temperature=0.8), config=mup)
    out["processor_mup"] = (vocab_parallel_log_probs_from_logits(lg.contiguous(), x["labels"]),
                            got.log_probs)

    # verl's legacy fused forward (patch_fused_forward) with gbc's kernel in place of verl's,
    # against the model's own head: values and every parameter's gradient
    from verl.models.mcore.model_forward_fused import patch_fused_forward, unpatch_fused_forward

    runs = []
    for legacy in (False, True):
        model.zero_grad(set_to_none=True)
        if legacy:
            undo = M.use_in_verl_fused_forward(sp)
            patch_fused_forward(model)
            try:
                res = model(x["ids"], pos, mc.causal_mask(S), labels=x["labels"],
                            temperature=0.8)
            finally:
                unpatch_fused_forward(model)
                undo()
            lp, en = (v.view(S, B).t() for v in (res.log_probs, res.entropy))
        else:
            lg = (model(x["ids"], pos, mc.causal_mask(S)) / 0.8).contiguous()
            lp = vocab_parallel_log_probs_from_logits(lg.clone(), x["labels"])
            en = vocab_parallel_entropy(lg.clone())
        ((lp * c1 + en * c2) * m).sum().backward()
        mc.allreduce_sp_norm_grads(model, group)
        runs.append((lp.detach() * m, en.detach() * m, _grads(model)))
    out["verl_legacy"] = runs
    return out


def _gbc_step(model, weight, x, pos, m, old, refl, cfg, sp, loss_kw, group, scale=1.0):
    """The model's forward to its head's input, gbc's processor there, ``scale`` x its loss
    backward through the whole model: ``(head input, HeadOutput)``."""
    mc = megatron_cpu()
    from gbc_kernels.integrations import megatron as M

    with mc.capture_head_input(model) as seen:
        model(x["ids"], pos, mc.causal_mask(S))
    h = seen[0]
    h.retain_grad()
    res = M.policy_loss(h, weight, x["labels"], m, x["adv"], old, refl, config=cfg,
                        sequence_parallel=sp, return_sum_p2=True, **loss_kw(x))
    (res.loss if scale == 1.0 else scale * res.loss).backward()
    mc.allreduce_sp_norm_grads(model, group)
    return h, res


def _main_grad_case(model, weight, x, pos, m, old, refl, cfg, sp, loss_kw, group):
    """gbc's processor with megatron's DDP set-up on the output weight: a float32 ``main_grad``
    (prefilled: megatron accumulates into it), ``grad_added_to_main_grad`` and DDP's hook
    (``DistributedDataParallel._make_backward_post_hook``'s rule, which adds ``param.grad``
    into ``main_grad`` unless the layer already did). The loss is scaled by 0.25 (megatron
    divides by the micro-batch count), so ``main_grad`` must receive 0.25 of the gradient
    (the prefill is small: ``main_grad`` is float32, the model float64)."""
    prefill = 1e-3 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(9))
    weight.main_grad = prefill.clone()
    weight.grad_added_to_main_grad = False
    placeholders = []

    def ddp_hook(p):
        placeholders.append((p.grad.dtype, tuple(p.grad.shape), p.grad_added_to_main_grad))
        if not p.grad_added_to_main_grad or getattr(p, "zero_out_wgrad", False):
            p.main_grad.add_(p.grad)
        p.grad = None

    handle = weight.register_post_accumulate_grad_hook(ddp_hook)
    try:
        h, res = _gbc_step(model, weight, x, pos, m, old, refl, cfg, sp, loss_kw, group, 0.25)
        grads = {k: v * 4 for k, v in _grads(model).items()}
        grads["__main_grad"] = (weight.main_grad - prefill) * 4
        return dict(loss=res.loss.detach(), logp=res.logp, entropy=res.entropy,
                    sum_p2=res.sum_p2, dhidden=h.grad * 4, grads=grads, metrics=res.metrics,
                    placeholders=placeholders, zero_out=getattr(weight, "zero_out_wgrad", False))
    finally:
        handle.remove()
        del weight.main_grad, weight.grad_added_to_main_grad
        model.zero_grad(set_to_none=True)


def _watch(tp):
    """The dispatch watcher over gbc's loss (forward and backward) and log-prob pass, and over
    the stock head's output layer."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    mc = megatron_cpu()
    from gbc_kernels import PolicyLossConfig
    from gbc_kernels.integrations import megatron as M

    model = mc.tiny_gpt(VP, hidden=H, seq=S, tp=tp, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    bw = 8                                      # more rows than gbc's smallest chunk (16)
    labels = torch.randint(0, VP, (bw, S), generator=g)
    mask = torch.rand(bw, S, generator=g) < 0.7
    adv = torch.randn(bw, generator=g, dtype=torch.float64)
    h = torch.randn(S, bw, H, generator=g, dtype=torch.float64, requires_grad=True)
    vs = VP // tp
    seen = {"n_tokens": int(mask.sum()), "rows": S * bw}
    with VocabWatcher(vs) as w:
        res = M.policy_loss(h, model.output_layer.weight, labels, mask, adv,
                            config=PolicyLossConfig(entropy_coef=0.01))
        res.loss.backward()
        M.logprobs(h.detach(), model.output_layer.weight, labels, mask)
    seen["gbc"] = [s for s in w.seen if s not in ((vs, H), (H, vs))]
    with VocabWatcher(vs) as w:
        logits = model.output_layer(h)[0]
        vocab_parallel_cross_entropy(logits, labels.t().contiguous()).sum().backward()
    seen["stock"] = [s for s in w.seen if s not in ((vs, H), (H, vs))]
    return seen


def _worker(rank, world, names, watch):
    os.environ["GBC_CHUNK_MB"] = "0.001"     # several chunks, a ragged last one
    mc = megatron_cpu()

    mc.install_shims()
    mc.init_parallel(world)
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    out = {name: _case(name, world, group) for name in names}
    if watch:
        out["watch"] = _watch(world)
    return out


@pytest.fixture(scope="module")
def tp2():
    return spawn_gloo(2, _worker, list(CASES), True)


@pytest.fixture(scope="module")
def tp1():
    return spawn_gloo(1, _worker, ["plain", "padded_methods"], False)[0]


def _close(a, b, what, tol=2e-6):
    a, b = a.double(), b.double()
    err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
    assert err < tol, f"{what}: relative error {err:.3g}"


def _check_case(got, stock, name):
    _close(got["loss"], stock["loss"], f"{name} loss")
    _close(got["logp"], stock["logp"], f"{name} logp (verl)")
    _close(got["logp"], stock["mcore_logp"], f"{name} logp (megatron's cross entropy)")
    _close(got["entropy"], stock["entropy"], f"{name} entropy")
    _close(got["sum_p2"], stock["sum_p2"], f"{name} sum_p2")
    _close(got["dhidden"], stock["dhidden"], f"{name} d hidden at the head")
    assert got["grads"].keys() == stock["grads"].keys()
    for k in stock["grads"]:
        _close(got["grads"][k], stock["grads"][k], f"{name} grad {k}")
    for v, key in zip(got["logprobs"], ("logp", "entropy", "sum_p2")):
        _close(v, stock[key], f"{name} logprobs() {key}")


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_equals_megatron_and_verl(tp2, name):
    """Each rank: the processor's loss, per-token values, d hidden and every parameter's
    gradient equal the stock head's through megatron's and verl's own functions."""
    for rank in range(2):
        r = tp2[rank][name]
        assert r["stock"]["logits_shape"] == (B, S, VP // 2)
        _check_case(r["gbc"], r["stock"], f"{name} rank {rank}")
        (wh, ww), (gh, gw) = r["logprobs_grad"]
        _close(gh, wh, f"{name} rank {rank} logprobs() d hidden")
        _close(gw, ww, f"{name} rank {rank} logprobs() d weight")
    # the loss and per-token values are the same on both ranks; the weight shards differ
    for key in ("loss", "logp", "entropy", "sum_p2"):
        assert torch.equal(tp2[0][name]["gbc"][key], tp2[1][name]["gbc"][key]), key
    if CASES[name][2]:      # sequence parallel: each rank's d hidden is its own [S/2, B, H]
        assert tp2[0][name]["gbc"]["dhidden"].shape == (S // 2, B, H)


@pytest.mark.parametrize("name", list(CASES))
def test_output_processor_hook_equals_the_output_layer(tp2, name):
    """``output_processor`` called with the keywords megatron-core's ``GPTModel`` passes its
    output-processor hook (verl's fused-route context, temperature 0.8): log-probs, entropy,
    d hidden (this rank's part under sequence parallelism) and d weight (a tied model's shared
    embedding) equal megatron's output layer with verl's functions on its logits, under random
    upstream gradients, its fields rewritten in place as verl's fused forward does; with MuP's
    ``use_mup`` config the log-probs are those of megatron's scaled logits."""
    for rank in range(2):
        want, got = tp2[rank][name]["processor"]
        m = _inputs(CASES[name][0])["mask"]
        want = (want[0] * m, want[1] * m) + want[2:]
        for what, w, g in zip(("log_probs", "entropy", "d hidden", "d weight"), want, got):
            _close(g, w, f"{name} rank {rank} output_processor {what}")
        _close(*reversed(tp2[rank][name]["processor_mup"]), f"{name} rank {rank} MuP")


@pytest.mark.parametrize("name", list(CASES))
def test_verl_legacy_fused_forward_with_gbcs_kernel(tp2, name):
    """verl's legacy fused forward (``patch_fused_forward``: the model's forward computes
    log-probs and entropy with its kernel) with ``use_in_verl_fused_forward``: gbc's kernel in
    its place gives the model's own head's log-probs and entropy (megatron's output layer,
    verl's functions, temperature 0.8) and every parameter's gradient, with and without
    sequence parallelism."""
    for rank in range(2):
        (lp0, en0, g0), (lp1, en1, g1) = tp2[rank][name]["verl_legacy"]
        _close(lp1, lp0, f"{name} rank {rank} legacy log_probs")
        _close(en1, en0, f"{name} rank {rank} legacy entropy")
        assert g0.keys() == g1.keys() and g0
        for k in g0:
            _close(g1[k], g0[k], f"{name} rank {rank} legacy grad {k}")


@pytest.mark.parametrize("name", list(CASES))
def test_main_grad_route_equals_the_stock_head(tp2, name):
    """With megatron's float32 ``main_grad`` on the output weight, gbc adds ``d weight`` there
    in backward (scaled by the upstream gradient) and hands megatron's placeholder gradient to
    DDP's hook: ``main_grad`` gains exactly the stock head's weight gradient (a tied head's
    embedding part through the hook: ``zero_out_wgrad``), every other gradient, the loss, the
    per-token values and gbc's metrics (``grad_share_low`` included) equal the one-sweep
    loss's."""
    for rank in range(2):
        r = tp2[rank][name]
        got, fused, stock = r["main_grad"], r["gbc"], r["stock"]
        main = got["grads"].pop("__main_grad")
        wname = next(k for k in stock["grads"] if k.endswith(
            "word_embeddings.weight" if CASES[name][1] else "output_layer.weight"))
        # float32, summed in float32 over the chunks (the model is float64)
        _close(main, stock["grads"][wname], f"{name} rank {rank} main_grad", tol=1e-5)
        assert wname not in got["grads"], "the weight kept a gradient of its own"
        assert got["placeholders"] == [(torch.float64, tuple(main.shape), True)]
        assert got["zero_out"] == CASES[name][1]
        for k in stock["grads"]:
            if k != wname:
                _close(got["grads"][k], stock["grads"][k], f"{name} rank {rank} grad {k}")
        for key in ("loss", "logp", "entropy", "sum_p2", "dhidden"):
            _close(got[key], fused[key], f"{name} rank {rank} {key}")
        assert got["metrics"].keys() == fused["metrics"].keys()
        assert "grad_share_low" in got["metrics"]
        for k, v in fused["metrics"].items():
            assert torch.allclose(got["metrics"][k], v, rtol=1e-5, atol=1e-7), k


@pytest.mark.parametrize("name", ["plain", "padded_methods"])
def test_tp2_equals_tp1(tp2, tp1, name):
    """Tensor parallel 2 gives tensor parallel 1's values and gradients (the same seed, the
    same full weights: megatron initialises the master weight on the CPU and splits it)."""
    one = tp1[name]["gbc"]
    _check_case(one, tp1[name]["stock"], f"{name} tp1")
    for rank in range(2):
        two = tp2[rank][name]["gbc"]
        for key in ("loss", "logp", "entropy", "sum_p2", "dhidden"):
            _close(two[key], one[key], f"{name} rank {rank} {key}")
    w = "output_layer.weight"
    full = torch.cat([tp2[0][name]["gbc"]["grads"][w], tp2[1][name]["gbc"]["grads"][w]])
    _close(full, one["grads"][w], f"{name} d output weight")


def test_padded_rows_are_logits(tp2):
    """The padded vocabulary rows (50..63, in rank 1's shard) are real logits, as in megatron's
    cross entropy: the entropy over the 50 real rows alone would differ."""
    r = tp2[1]["padded_methods"]
    assert r["stock"]["logits_shape"][-1] == 32 and CASES["padded_methods"][0] < VP
    assert r["gbc"]["grads"]["output_layer.weight"][50 - 32:].abs().max() > 0


def test_no_logits_on_gbc_path(tp2):
    """No tensor over this rank's vocabulary shard has as many rows as the batch has response
    tokens on gbc's path (the chunk budget is small); the stock head forms [S, B, V/tp]."""
    for rank in range(2):
        seen = tp2[rank]["watch"]
        n = seen["n_tokens"]

        def rows(shapes):
            return max(torch.Size(s[:-1]).numel() for s in shapes) if shapes else 0

        assert rows(seen["stock"]) >= seen["rows"]
        assert 0 < rows(seen["gbc"]) < n // 2, seen["gbc"]


def test_bad_input():
    """Wrong layouts are refused naming the argument (no process group needed to get there)."""
    from gbc_kernels.integrations import megatron as M

    w = torch.randn(8, H)
    with pytest.raises(ValueError, match="hidden_states"):
        M.policy_loss(torch.randn(B, H), w, None, None, None, tp_group=object())
    with pytest.raises(ValueError, match="output_weight"):
        M.logprobs(torch.randn(S, B, H), torch.randn(8, H + 1), None, tp_group=object())
    with pytest.raises(ValueError, match="vocab_parallel"):
        M.policy_loss(torch.randn(S, B, H), w, None, None, None, vocab_parallel=None)
    y = torch.zeros(B, S, dtype=torch.long)
    with pytest.raises(ValueError, match="^reduction: "):
        M.linear_cross_entropy(torch.randn(S, B, H), w, y, 1.0, "mean")
    with pytest.raises(TypeError, match="^hidden_gathered: "):
        M.linear_cross_entropy(torch.randn(S, B, H), w, y, hidden_gathered=None)
    with pytest.raises(TypeError, match="^sequence_parallel: "):
        M.use_in_verl_fused_forward("yes")


def test_context_parallel_refused(monkeypatch):
    """Under context parallelism each rank holds part of every sequence: the loss refuses it by
    name; the per-token log-prob pass does not need whole sequences."""
    from megatron.core import parallel_state

    from gbc_kernels.integrations import megatron as M

    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match="context_parallel_size"):
        M.policy_loss(torch.randn(S, B, H), torch.randn(8, H), None, None, None)


def _errors_worker(rank, world):
    """Bad labels, temperatures and output-layer shards through each entry point at tensor
    parallel ``world``: ``({call: (exception type, message) or None}, what changed)``."""
    mc = megatron_cpu()
    mc.install_shims()
    mc.init_parallel(world)
    from megatron.core import parallel_state

    from gbc_kernels.integrations import megatron as M
    from gbc_kernels.methods import MethodOptions

    group = parallel_state.get_tensor_model_parallel_group()
    V, g = 52, torch.Generator().manual_seed(11)
    rows = V // world
    h = torch.randn(S, B, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)[rank * rows:(rank + 1) * rows]
    w = w.clone().requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=g)
    mask = torch.rand(B, S, generator=g) < 0.6
    mask[1, 5] = mask[2, 7] = True
    mask[0] = False                                         # an empty row
    bad = labels.clone()
    bad[1, 5], bad[0, 2] = 60, -7                          # [0, 2] is masked out: not an error
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    temp = torch.full((B, S), 0.8, dtype=torch.float64)
    temp[2, 7], temp[0, 3] = -1.0, float("nan")            # [0, 3] is masked out
    uneven = torch.randn(28 if rank == 0 else 24, H, generator=g, dtype=torch.float64,
                         requires_grad=True)               # slices (0, 28) and (24, 48)
    kept = [t.detach().clone() for t in (h, w, labels, bad, mask, adv, temp, uneven)]
    layer = types.SimpleNamespace(weight=uneven, bias=None, skip_bias_add=True, tp_group=group,
                                  sequence_parallel=False)
    calls = {
        "policy_loss labels": lambda: M.policy_loss(h, w, bad, mask, adv),
        "policy_loss main_grad labels": lambda: M.policy_loss(h, w, bad, mask, adv,
                                                              main_grad=True),
        "logprobs labels": lambda: M.logprobs(h, w, bad, mask),
        "logprobs labels no mask": lambda: M.logprobs(h, w, torch.where(mask, bad, 0)),
        "reference_stats labels": lambda: M.reference_stats(
            h, w, bad, MethodOptions(critical_kl_exponent=1.0), mask),
        "linear_cross_entropy labels": lambda: M.linear_cross_entropy(
            h, w, torch.where(mask, bad, 0), dist_process_group=group),
        "logprobs temperature": lambda: M.logprobs(h, w, labels, mask, temperature=temp),
        "policy_loss main_grad temperature": lambda: M.policy_loss(
            h, w, labels, mask, adv, temperature=temp, main_grad=True),
        "policy_loss shards": lambda: M.policy_loss(h, uneven, labels, mask, adv),
        "logprobs shards": lambda: M.logprobs(h, uneven, labels, mask),
        "reference_stats shards": lambda: M.reference_stats(
            h, uneven, labels, MethodOptions(critical_kl_exponent=1.0), mask),
        "linear_cross_entropy shards": lambda: M.linear_cross_entropy(
            h, uneven, labels, dist_process_group=group),
        "output_processor shards": lambda: M.output_processor(
            hidden_states=h, output_layer=layer, labels=labels,
            context=types.SimpleNamespace(temperature=1.0, mask=mask)),
        "output_processor temperature": lambda: M.output_processor(
            hidden_states=h, output_layer=layer, output_weight=w, labels=labels,
            context=types.SimpleNamespace(temperature=temp, mask=mask)),
    }
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    w.grad_added_to_main_grad = False
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except (ValueError, TypeError) as e:
            out[name] = (type(e).__name__, str(e))
    def same(a, b):             # NaN where NaN was
        return torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num()))

    changed = [i for i, (a, b) in enumerate(zip(kept, (h, w, labels, bad, mask, adv, temp,
                                                        uneven))) if not same(a, b)]
    changed += [n for n, t in (("h.grad", h.grad), ("w.grad", w.grad),
                               ("uneven.grad", uneven.grad)) if t is not None]
    if w.main_grad.any() or w.grad_added_to_main_grad:
        changed.append("w.main_grad")
    return out, changed


def test_errors_name_the_callers_arguments():
    """At tensor parallel 2, on megatron's group: a label outside the vocabulary is reported
    naming ``labels`` at its ``[B, S]`` index (also where gbc saw the selected rows in
    megatron's ``[S, B]`` order), a bad temperature tensor at its index, and output-layer shards
    that do not tile the vocabulary naming the weight the caller passed (``output_weight``,
    verl's kernel's ``weight``, the hook's ``output_layer.weight``); nothing was computed or
    changed (no gradient, ``main_grad`` untouched, the inputs as they were)."""
    ranks = spawn_gloo(2, _errors_worker)
    labels = ("ValueError", "labels: expected token ids in [0, 52) on masked-in positions, "
                            "got 60 at index [1, 5]")
    temp = "temperature: expected finite temperatures > 0 on masked-in positions, got -1.0 " \
           "at index [2, 7]"
    tiles = "the ranks' slices [(0, 28), (24, 48)] do not tile [0, V) (gap or overlap at 24)"
    want = {
        "policy_loss labels": labels,
        "policy_loss main_grad labels": labels,
        "logprobs labels": labels,
        "logprobs labels no mask": labels,
        "reference_stats labels": labels,
        "linear_cross_entropy labels": labels,
        "logprobs temperature": ("ValueError", temp),
        "policy_loss main_grad temperature": ("ValueError", temp),
        "output_processor temperature": ("ValueError", "context." + temp),
        "policy_loss shards": ("ValueError", "output_weight: " + tiles),
        "logprobs shards": ("ValueError", "output_weight: " + tiles),
        "reference_stats shards": ("ValueError", "output_weight: " + tiles),
        "linear_cross_entropy shards": ("ValueError", "weight: " + tiles),
        "output_processor shards": ("ValueError", "output_layer.weight: " + tiles),
    }
    for rank, (got, changed) in enumerate(ranks):
        assert got == want, rank
        assert changed == [], (rank, changed)


def _cp_batch_worker(rank, world):
    """Context parallel ``world`` (tensor parallel 1): the ranks pass different batch sizes
    (3 and 2 sequences) to ``policy_loss(..., context_parallel=group)``, through gbc's
    one-sweep loss and through the ``main_grad`` route: ``{route: (type, message)}``."""
    mc = megatron_cpu()
    mc.install_shims()
    mc.init_parallel(1, cp=world)
    from megatron.core import parallel_state

    from gbc_kernels.integrations import megatron as M

    cp = parallel_state.get_context_parallel_group()
    g = torch.Generator().manual_seed(5)
    b = 3 if rank == 0 else 2
    h = torch.randn(S, b, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, H, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (b, S), generator=g)
    mask = torch.rand(b, S, generator=g) < 0.6
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    out = {}
    for route, main_grad in (("fused", False), ("main_grad", True)):
        if main_grad:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
            w.grad_added_to_main_grad = False
        try:
            M.policy_loss(h, w, labels, mask, adv, context_parallel=cp, main_grad=main_grad)
            out[route] = None
        except (ValueError, TypeError) as e:
            out[route] = (type(e).__name__, str(e))
    return out


def test_context_parallel_batch_mismatch_names_context_parallel():
    """Ranks of the context-parallel group passing different batch sizes are refused on every
    rank (no hang), naming the caller's ``context_parallel`` (not megatron's
    ``sequence_parallel`` flag, another argument of the same function)."""
    ranks = spawn_gloo(2, _cp_batch_worker)
    for rank, got in enumerate(ranks):
        b = 3 if rank == 0 else 2
        want = ("ValueError", "context_parallel: every rank of the group must pass rows for the "
                f"same B sequences; this rank has B={b}, the group's range is [2, 3]")
        assert got == {"fused": want, "main_grad": want}, rank
