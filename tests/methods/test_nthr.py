"""NTHR through every adapter against one reference (gbc_reference.nthr_scale on float64
hidden states, docs/math.md §4) with the method layer's correct rule: a response is correct when
its sequence advantage is > 0 (token-level advantages: their masked mean) (docs/methods.md).
verl's engine and OpenRLHF: tests/test_verl_engine.py, tests/test_openrlhf.py."""

from __future__ import annotations

import torch

import gbc_reference as ref
from conftest import as64, make_batch
from gbc_kernels import methods
from .method_reference import (completion_hidden_and_head, example_rollout, sequences,
                               spy_losses, trl_trainer)


def test_correct_rule():
    adv = torch.tensor([0.5, -0.1, 0.0, 2.0], dtype=torch.float64)
    mask = torch.ones(4, 3)
    assert methods.correct_from_advantages(adv, mask).tolist() == [True, False, False, True]
    tok = torch.tensor([[1.0, -3.0, 5.0], [1.0, 1.0, -3.0], [2.0, 0.0, 0.0], [-1.0, 4.0, 4.0]],
                       dtype=torch.float64)
    m = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]])
    want = [(tok[b] * m[b]).sum() / max(int(m[b].sum()), 1) > 0 for b in range(4)]
    assert methods.correct_from_advantages(tok, m).tolist() == [bool(w) for w in want]
    assert want == [False, False, False, False]          # masked-out values never count


def test_plain_api_equals_reference():
    b = as64(make_batch(B=6, T=5, H=8, V=23, seed=8, bias=False, adv_shape="BT",
                           logit_scale=8 ** 0.5))
    h, w, y, m, adv = (b[k] for k in ("hidden", "weight", "targets", "mask", "advantages"))
    gids = torch.tensor([0, 0, 0, 1, 1, 1])
    opts = methods.MethodOptions(nthr=True, nthr_beta=0.0)
    got = methods.nthr_token_scale(h, w, y, m, gids, adv, opts)
    want = ref.nthr_scale(h, w, y, m, gids, methods.correct_from_advantages(adv, m), beta=0.0)
    assert torch.equal(got.selected, want.selected) and got.selected.any()
    assert torch.allclose(got.scale.double(), want.scale.double())


def test_trl_scales_equal_reference(tiny, tmp_path):
    """TRL: the scales of the rollout's whole batch (groups of num_generations) equal the
    reference's on the rollout policy's hidden states."""
    from transformers import AutoModelForCausalLM

    trainer = trl_trainer(tiny, tmp_path, gbc_nthr=True, gbc_nthr_beta=0.0)
    seen = spy_losses(trainer)
    trainer.train()
    x = seen[0][0]
    ids, attn, T, mask = sequences(x)
    h, w = completion_hidden_and_head(AutoModelForCausalLM.from_pretrained(tiny), ids, attn, T)
    adv = x["advantages"]
    assert methods.correct_from_advantages(adv, mask).unique().numel() == 2   # a mixed group
    want = ref.nthr_scale(h, w, x["completion_ids"], mask, torch.zeros(4, dtype=torch.long),
                          adv > 0, beta=0.0)
    assert want.selected.any()
    assert torch.equal(x["gbc_token_scale"] != 1, want.selected)
    assert torch.allclose(x["gbc_token_scale"].double(), want.scale.double(), atol=1e-6)


def test_example_trainer_scales_equal_reference():
    """The example trainer's rollout: groups of --group, correct from the advantages."""
    args, roll, h, w, _ = example_rollout(["--nthr", "--nthr-beta", "0", "--prompts", "4",
                                           "--group", "8"])
    gids = torch.arange(args.prompts).repeat_interleave(args.group)
    want = ref.nthr_scale(h, w, roll["targets"], roll["mask"], gids, roll["adv"] > 0,
                          beta=0.0, temperature=args.temperature)
    assert want.selected.any()
    assert torch.equal(roll["token_scale"] != 1, want.selected)
    assert torch.allclose(roll["token_scale"].double(), want.scale.double(), atol=1e-6)
