"""integrations.hf: hidden states and lm_head of transformers causal LMs of several families,
checked against the models' own logits (float64 on the comparison side)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gbc_kernels as gbc  # noqa: E402
from gbc_kernels.integrations import hf  # noqa: E402

V = 53        # not a multiple of any block


def make(family, tied):
    torch.manual_seed(0)
    small = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64,
                 tie_word_embeddings=tied)
    if family == "qwen2":
        m = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=2, **small))
    elif family == "llama":
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **small))
    elif family == "gpt2":      # decoder under .transformer, Conv1D layers
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            tie_word_embeddings=tied))
    elif family == "gpt_neox":  # head named embed_out
        m = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**small))
    elif family == "phi":       # lm_head with a bias
        m = transformers.PhiForCausalLM(transformers.PhiConfig(**small))
    else:
        raise AssertionError(family)
    return m.eval()


FAMILIES = [("qwen2", True), ("qwen2", False), ("llama", False), ("gpt2", True),
            ("gpt_neox", False), ("phi", False)]


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (3, 9), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :2] = 0                                     # left padding
    return ids, attn


@pytest.mark.parametrize("family, tied", FAMILIES, ids=[f"{f}-{'tied' if t else 'untied'}"
                                                          for f, t in FAMILIES])
def test_hidden_states_and_lm_head_give_the_models_logits(family, tied):
    model = make(family, tied)
    ids, attn = batch()
    head = hf.lm_head(model)
    if family == "phi":
        assert head.bias is not None
    if tied:
        assert head.weight is model.get_input_embeddings().weight
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=attn).logits.double()
        h = hf.hidden_states(model, ids, attn)
        got = h.double() @ head.weight.double().T
        if head.bias is not None:
            got = got + head.bias.double()
        assert torch.allclose(got, want, atol=1e-4)
        # logits_to_keep and completion_len keep the last positions only
        h3 = hf.hidden_states(model, ids, attn, logits_to_keep=3)
        assert torch.equal(h3, h[:, -3:])
        c = hf.completion_hidden(model, ids, attn, completion_len=4)
        assert torch.equal(c, h[:, -5:-1])
        assert torch.equal(hf.completion_hidden(model, ids, attn), h[:, :-1])


class Wrapper(torch.nn.Module):
    """Stands in for DDP: its forward must run, its .module is the model."""

    def __init__(self, module):
        super().__init__()
        self.module, self.calls = module, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.module(*args, **kwargs)


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_hidden_states_through_a_wrappers_forward(family):
    model = make(family, True)
    ids, attn = batch()
    wrapper = Wrapper(model)
    with torch.no_grad():
        got = hf.hidden_states_through_forward(wrapper, ids, attn, 4, unwrapped=model)
        want = hf.completion_hidden(model, ids, attn, completion_len=4)
    assert wrapper.calls == 1
    assert torch.allclose(got, want, atol=1e-6)


def test_old_policy_and_reference_passes_match_full_logits():
    model = make("qwen2", False)
    ids, attn = batch()
    T = 5
    targets = ids[:, -T:]
    mask = torch.ones(3, T, dtype=torch.bool)
    mask[1, 3:] = False
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, -T - 1:-1].double() / 0.8
    lsm = torch.log_softmax(logits, -1)
    want_logp = lsm.gather(-1, targets[..., None])[..., 0]
    old = hf.old_policy_pass(model, ids, attn, targets, mask, temperature=0.8,
                             completion_len=T)
    assert old.token_scale is None
    assert torch.allclose(old.old_logp.double(), want_logp, atol=1e-5)
    ref = hf.reference_pass(model, ids, attn, targets, temperature=0.8,
                            critical_kl_exponent=3.0, certainty="max_prob",
                            certainty_temperature=1.0, completion_len=T)
    lsm1 = torch.log_softmax(logits * 0.8, -1)
    J = 1 + lsm1.max(-1).values / torch.log(torch.tensor(float(V), dtype=torch.float64))
    assert torch.allclose(ref.ref_logp.double(), want_logp, atol=1e-5)
    assert torch.allclose(ref.kl_weight.double(), gbc.critical_kl_weight(J, 3.0).double(),
                          atol=1e-5)


def test_nthr_through_old_policy_pass_needs_groups():
    model = make("qwen2", True)
    ids, attn = batch()
    with pytest.raises(ValueError, match="group_ids, correct"):
        hf.old_policy_pass(model, ids, attn, ids[:, -3:], torch.ones(3, 3), nthr=True,
                           completion_len=3)


def test_model_without_lm_head_raises():
    model = transformers.Qwen2Model(transformers.Qwen2Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="model: .*lm_head"):
        hf.lm_head(model)


def test_old_policy_pass_reuses_given_old_logp():
    """With the trainer's own old log-probs the NTHR scale is the same as from the pass's."""
    model = make("qwen2", False)
    ids, attn = batch()
    ids = torch.cat([ids, ids[:1]]).clone()                # 4 responses, 2 groups of 2
    attn = torch.cat([attn, attn[:1]])
    T = 5
    targets, mask = ids[:, -T:], torch.ones(4, T, dtype=torch.bool)
    kw = dict(group_ids=torch.tensor([0, 0, 1, 1]), correct=torch.tensor([True, False] * 2),
              temperature=0.8, nthr=True, nthr_beta=0.0, completion_len=T)
    fresh = hf.old_policy_pass(model, ids, attn, targets, mask, **kw)
    given = hf.old_policy_pass(model, ids, attn, targets, mask, old_logp=fresh.old_logp, **kw)
    assert given.old_logp is fresh.old_logp
    assert torch.equal(given.nthr.selected, fresh.nthr.selected) and fresh.nthr.selected.any()
    assert torch.allclose(given.token_scale, fresh.token_scale)
    # the passes build no autograd graph (the model's parameters require grad here)
    assert torch.is_grad_enabled() and next(model.parameters()).requires_grad
    for res in (fresh, given):
        assert not res.old_logp.requires_grad and not res.token_scale.requires_grad
        assert not res.nthr.scores.requires_grad
    ref = hf.reference_pass(model, ids, attn, targets, completion_len=T, critical_kl_exponent=2.0)
    assert not ref.ref_logp.requires_grad and not ref.kl_weight.requires_grad


def test_passes_read_the_head_inside_the_forward():
    """Under ZeRO-3 (or FSDP2) the lm_head's weight exists only while the model's forward runs
    it: the old-policy and reference passes (NTHR's scales included) read it there. Here the
    head holds an empty weight outside its forward; the passes equal those of the plain
    model."""
    plain = make("qwen2", False)
    model = make("qwen2", False)
    head = model.get_output_embeddings()
    full = head.weight.data.clone()
    head.weight.data = torch.empty(0)
    head.register_forward_pre_hook(lambda m, a: setattr(m.weight, "data", full))
    head.register_forward_hook(lambda m, a, o: setattr(m.weight, "data", torch.empty(0)))
    ids, attn = batch()
    T = 5
    targets, mask = ids[:, -T:], torch.ones(3, T, dtype=torch.bool)
    groups, correct = torch.tensor([0, 0, 0]), torch.tensor([True, False, False])
    kw = dict(temperature=0.8, completion_len=T, nthr=True, group_ids=groups, correct=correct,
              nthr_beta=0.0)
    want = hf.old_policy_pass(plain, ids, attn, targets, mask, **kw)
    got = hf.old_policy_pass(model, ids, attn, targets, mask, **kw)
    assert torch.allclose(got.old_logp, want.old_logp, atol=1e-6)
    assert torch.allclose(got.token_scale, want.token_scale, atol=1e-6)
    assert (want.token_scale != 1).any()
    want = hf.reference_pass(plain, ids, attn, targets, critical_kl_exponent=2.0,
                             completion_len=T)
    got = hf.reference_pass(model, ids, attn, targets, critical_kl_exponent=2.0,
                            completion_len=T)
    assert torch.allclose(got.ref_logp, want.ref_logp, atol=1e-6)
    assert torch.allclose(got.kl_weight, want.kl_weight, atol=1e-6)
    assert head.weight.numel() == 0
