"""hf.policy_loss_through_forward (docs/math.md §11): the fused loss inside the model's own forward, so
that wrappers which gather the lm_head only for the forward (FSDP2, ZeRO-3) and adapters (PEFT)
route its gradients. Against plain full logits in float64: one process (plain, tied head, PEFT
LoRA with an adapter on the lm_head, soft-capped Gemma-2), and FSDP2 on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

import gbc_kernels as gbc
from conftest import spawn_gloo
from gbc_kernels.integrations import hf

T = 5


def _model(kind="qwen2", tie=False, dtype=torch.float64):
    torch.manual_seed(0)
    if kind == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM
        cfg = Gemma2Config(vocab_size=61, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, final_logit_softcapping=3.0, pad_token_id=0)
        m = Gemma2ForCausalLM(cfg)
        with torch.no_grad():
            m.lm_head.weight.mul_(40.0)          # past the cap
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM
        cfg = Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                          tie_word_embeddings=tie, pad_token_id=0)
        m = Qwen2ForCausalLM(cfg)
    return m.to(dtype)


def _batch(B=4, L=9, V=61, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, L), generator=g)
    attn = torch.ones(B, L, dtype=torch.long)
    attn[0, :2] = 0                                   # left padding
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[2] = False                                   # an empty completion
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    return ids, attn, mask, adv, old


def _plain_loss(model, ids, attn, mask, adv, old, cfg, num_items=None):
    """The textbook computation: full logits (through the model's forward), log_softmax,
    PPO clip, token-mean."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, -(T + 1):-1].double()
    logits = logits / cfg.temperature
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, -T:, None])[..., 0]
    r = torch.exp(logp - old)
    a = adv[:, None]
    pg = torch.maximum(-a * r, -a * r.clamp(1 - cfg.epsilon_low, 1 + cfg.epsilon_high))
    m = mask.double()
    n = m.sum() if num_items is None else torch.as_tensor(float(num_items))
    return (pg * m).sum() / n.clamp(min=1)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _compare(model, cfg=None, pad=True, **kw):
    cfg = cfg or gbc.PolicyLossConfig(epsilon_high=0.28, temperature=0.9)
    ids, attn, mask, adv, old = _batch()
    if not pad:
        attn = torch.ones_like(attn)
    model.zero_grad()
    loss, metrics = hf.policy_loss_through_forward(model, ids, attn, T, mask, adv, old,
                                                   config=cfg, backend="torch", **kw)
    (loss * 0.7).backward()
    ours = (float(loss.detach()), _grads(model))
    model.zero_grad()
    ref = _plain_loss(model, ids, attn, mask, adv, old, cfg)
    (ref * 0.7).backward()
    theirs = (float(ref.detach()), _grads(model))
    assert abs(ours[0] - theirs[0]) < 1e-10
    assert ours[1].keys() == theirs[1].keys() and theirs[1]
    for n, g in theirs[1].items():
        assert torch.allclose(ours[1][n], g, rtol=1e-8, atol=1e-12), n
    return metrics


@pytest.mark.parametrize("tie", [False, True])
def test_plain_model_equals_full_logits(tie):
    metrics = _compare(_model(tie=tie))
    assert "clip_frac_low" in metrics


def test_gemma2_softcap_equals_full_logits():
    # no left padding: Gemma-2's eager attention turns fully masked rows into NaN
    _compare(_model("gemma2"), pad=False)


def test_peft_lora_with_adapter_on_lm_head_equals_full_logits():
    peft = pytest.importorskip("peft")
    torch.manual_seed(5)
    model = peft.get_peft_model(_model(), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
        target_modules=["q_proj", "v_proj", "lm_head"]))
    _compare(model)
    assert any("lm_head.lora_B" in n for n, p in model.named_parameters() if p.grad is not None)


def test_head_forward_restored_and_errors():
    model = _model()
    ids, attn, mask, adv, old = _batch()
    hf.policy_loss_through_forward(model, ids, attn, T, mask, adv, old, backend="torch")
    assert "forward" not in model.lm_head.__dict__          # the module is itself again
    out = model(input_ids=ids).logits
    assert out.shape[-1] == 61
    with pytest.raises(ValueError, match="completion_len"):
        hf.policy_loss_through_forward(model, ids, attn, 0, mask, adv)


def _fsdp2_worker(rank, world):
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids, attn, mask, adv, old = _batch()
    rows = torch.arange(ids.shape[0]).chunk(world)[rank]
    cfg = gbc.PolicyLossConfig(epsilon_high=0.28)
    loss, _ = hf.policy_loss_through_forward(model, ids[rows], attn[rows], T, mask[rows],
                                             adv[rows], old[rows], config=cfg, backend="torch",
                                             num_items_in_batch=int(mask.sum()))
    loss.backward()
    # FSDP2 averages gradients over ranks; each rank's loss is its share of the global mean
    return {n: p.grad.full_tensor() * world for n, p in model.named_parameters()}


def test_fsdp2_two_ranks_equal_one_process_full_logits():
    got = spawn_gloo(2, _fsdp2_worker)
    model = _model()
    ids, attn, mask, adv, old = _batch()
    cfg = gbc.PolicyLossConfig(epsilon_high=0.28)
    _plain_loss(model, ids, attn, mask, adv, old, cfg).backward()
    want = _grads(model)
    for rank_grads in got:
        assert rank_grads.keys() == want.keys()
        for n, g in want.items():
            assert torch.allclose(rank_grads[n], g, rtol=1e-7, atol=1e-10), n


def test_zero3_style_parameters_that_exist_only_inside_the_forward():
    """A stand-in for DeepSpeed ZeRO-3 (not installable on this CPU machine): the lm_head's
    weight holds no data outside its module's forward; a pre-forward hook gathers it, a
    post-forward hook frees it, and a backward pre-hook gathers it again before its gradient
    is accumulated (ZeRO-3's hooks do the same). The loss computed inside the forward gives the
    gradients of full logits; a loss computed outside it could not even read the weight."""
    model = _model()
    head = model.lm_head
    full = head.weight.detach().clone()
    events = []

    def gather(*_):
        head.weight.data = full.clone()
        events.append("gather")

    def free(*_):
        head.weight.data = torch.empty(0, dtype=full.dtype)
        events.append("free")

    head.register_forward_pre_hook(gather)
    head.register_forward_hook(free)
    head.register_full_backward_pre_hook(lambda *_: gather())
    free()
    ids, attn, mask, adv, old = _batch()
    cfg = gbc.PolicyLossConfig(epsilon_high=0.28)
    loss, _ = hf.policy_loss_through_forward(model, ids, attn, T, mask, adv, old, config=cfg,
                                             backend="torch")
    assert head.weight.numel() == 0                     # freed after the forward
    loss.backward()
    assert events[-1] == "gather"                       # gathered again for the backward
    ours = _grads(model)

    plain = _model()
    _plain_loss(plain, ids, attn, mask, adv, old, cfg).backward()
    want = _grads(plain)
    assert ours.keys() == want.keys()
    for n, g in want.items():
        assert torch.allclose(ours[n], g, rtol=1e-8, atol=1e-12), n


def _zero3_worker(rank, world):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(dtype=torch.float32)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(),
        config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
                "zero_allow_untested_optimizer": True})
    outside = engine.module.lm_head.weight.numel()     # ZeRO-3: no data outside a forward
    ids, attn, mask, adv, old = _batch()
    rows = torch.arange(ids.shape[0]).chunk(world)[rank]
    cfg = gbc.PolicyLossConfig(epsilon_high=0.28)
    loss, _ = hf.policy_loss_through_forward(
        engine, ids[rows], attn[rows], T, mask[rows], adv[rows].float(), old[rows].float(),
        config=cfg, backend="torch", num_items_in_batch=int(mask.sum()), unwrapped=engine.module)
    engine.backward(loss)
    # ZeRO averages gradients over ranks; each rank's loss is its share of the global mean
    grads = {n: safe_get_full_grad(p) * world for n, p in engine.module.named_parameters()}
    return outside, grads


def test_deepspeed_zero3_two_ranks_equal_one_process_full_logits():
    pytest.importorskip("deepspeed")
    got = spawn_gloo(2, _zero3_worker)
    model = _model(dtype=torch.float32)
    ids, attn, mask, adv, old = _batch()
    _plain_loss(model, ids, attn, mask, adv, old, gbc.PolicyLossConfig(epsilon_high=0.28)).backward()
    want = _grads(model)
    for outside, grads in got:
        assert outside == 0
        for n, g in want.items():
            assert max_rel(grads[n], g) <= 1e-5, n


def max_rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))
