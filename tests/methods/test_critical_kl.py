"""Critical-token KL through every adapter against one reference: the weights
``(1 - c) J^gamma + c`` with ``J`` from the reference model's float64 logits (docs/math.md §5),
given by the reference pass together with ``ref_logp``. verl's engine and OpenRLHF:
tests/test_verl_engine.py, tests/test_openrlhf.py."""

from __future__ import annotations

import math
import pytest
import torch

from gbc_kernels import methods
from .method_reference import (completion_hidden_and_head, example_rollout, sequences,
                               spy_losses, trl_trainer)


def reference_weights(h, w, y, opts, temperature=1.0):
    """float64 (ref_logp, w_kl) from full logits."""
    z = h.double() @ w.double().T
    logp = torch.log_softmax(z / temperature, -1).gather(-1, y[..., None])[..., 0]
    lsm = torch.log_softmax(z / opts.critical_kl_temperature, -1)
    log_v = math.log(z.shape[-1])
    if opts.critical_kl_certainty == "max_prob":
        J = 1 + lsm.max(-1).values / log_v
    else:
        J = 1 + (lsm.exp() * lsm).sum(-1) / log_v
    c = opts.critical_kl_intercept
    return logp, (1 - c) * J.clamp(min=0) ** opts.critical_kl_exponent + c


@pytest.mark.parametrize("certainty", ["max_prob", "entropy"])
def test_plain_api_reference_stats(certainty):
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 7, 16, generator=g)
    w = torch.randn(37, 16, generator=g)
    y = torch.randint(0, 37, (3, 7), generator=g)
    opts = methods.MethodOptions(critical_kl_exponent=3.0, critical_kl_intercept=0.2,
                                 critical_kl_certainty=certainty, critical_kl_temperature=0.5)
    st = methods.reference_stats(h, w, y, opts, temperature=0.8)
    logp, want = reference_weights(h, w, y, opts, temperature=0.8)
    assert torch.allclose(st.ref_logp.double(), logp, atol=1e-5)
    assert torch.allclose(st.kl_weight.double(), want, rtol=1e-4, atol=1e-6)
    assert st.kl_weight.dtype == torch.float32
    assert methods.reference_stats(h, w, y, methods.MethodOptions()).kl_weight is None


def test_refused_without_a_kl_term():
    opts = methods.MethodOptions(critical_kl_exponent=2.0)
    with pytest.raises(ValueError, match="^gbc_critical_kl_exponent: .*beta"):
        opts.check_loss(0.0, "beta", {"critical_kl_exponent": "gbc_critical_kl_exponent"})
    opts.check_loss(0.1)


def test_trl_weights_equal_reference(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = trl_trainer(tiny, tmp_path, beta=0.1, gbc_critical_kl_exponent=2.0,
                          gbc_critical_kl_intercept=0.1, gbc_critical_kl_temperature=0.7)
    seen = spy_losses(trainer)
    trainer.train()
    x = seen[0][0]
    ids, attn, T, mask = sequences(x)
    h, w = completion_hidden_and_head(AutoModelForCausalLM.from_pretrained(tiny), ids, attn, T)
    _, want = reference_weights(h, w, x["completion_ids"], trainer.gbc_methods)
    m = mask.bool()
    assert torch.allclose(x["gbc_kl_weight"].double()[m], want[m], rtol=1e-4, atol=1e-6)


def _count_forwards(module):
    count = [0]
    module.register_forward_pre_hook(lambda *a: count.__setitem__(0, count[0] + 1))
    return count


def test_trl_one_reference_forward(tiny, tmp_path):
    """The weights come from TRL's own reference pass: as many reference forwards as
    without critical KL, and the same ``ref_per_token_logps``."""
    runs = {}
    for crit in (None, 2.0):
        trainer = trl_trainer(tiny, tmp_path / str(crit), beta=0.1, max_steps=2,
                              gbc_critical_kl_exponent=crit)
        count, seen = _count_forwards(trainer.ref_model), spy_losses(trainer)
        trainer.train()
        runs[crit] = count[0], seen
    assert runs[2.0][0] == runs[None][0] > 0
    for (a, _), (b, _) in zip(runs[None][1], runs[2.0][1]):
        assert torch.equal(a["ref_per_token_logps"], b["ref_per_token_logps"])
        assert "gbc_kl_weight" in b and "gbc_kl_weight" not in a


def test_trl_peft_reference_adapter(tiny, tmp_path):
    """PEFT: the weights are those of TRL's reference, here a ready PeftModel whose adapter TRL
    copies into a frozen "ref" adapter (not the base model), from its one pass."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(4)
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny),
                                peft.LoraConfig(**cfg))
    trainer = trl_trainer(tiny, tmp_path, model=model, beta=0.1,
                          gbc_critical_kl_exponent=2.0, gbc_critical_kl_temperature=0.7)
    seen = spy_losses(trainer)
    trainer.train()
    x = seen[0][0]
    ids, attn, T, mask = sequences(x)
    ref = trainer.accelerator.unwrap_model(trainer.model)
    assert "ref" in ref.peft_config
    ref.set_adapter("ref")
    with torch.no_grad():
        h = ref(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states[-1]
    ref.set_adapter("default")
    w = ref.get_output_embeddings().weight
    _, want = reference_weights(h[:, -T - 1:-1], w, x["completion_ids"], trainer.gbc_methods)
    m = mask.bool()
    assert torch.allclose(x["gbc_kl_weight"].double()[m], want[m], rtol=1e-4, atol=1e-6)


def test_example_trainer_weights_equal_reference():
    args, roll, h, w, gt = example_rollout(
        ["--kl-coef", "0.1", "--critical-kl-exponent", "4", "--critical-kl-temperature", "2",
         "--prompts", "2", "--group", "4"])
    logp, want = reference_weights(h, w, roll["targets"], gt.method_options(args),
                                   temperature=args.temperature)
    m = roll["mask"]
    assert torch.allclose(roll["ref_logp"].double()[m], logp[m], atol=1e-5)
    assert torch.allclose(roll["kl_weight"].double()[m], want[m], rtol=1e-4, atol=1e-6)
