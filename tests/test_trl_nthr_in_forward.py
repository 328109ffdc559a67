"""NTHR in TRL on policy (``num_iterations == 1``, no vLLM log-probs, ``steps_per_generation ==
1``): GBCGRPOTrainer scores NTHR inside the update's own forward (the old policy's), with no
pass at the rollout; the training run equals the run that scores it by the rollout's pass."""

from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

trl = pytest.importorskip("trl")

from test_trl import build, tiny_hf_model  # noqa: E402

from gbc_kernels.integrations import hf  # noqa: E402
from gbc_kernels.integrations.trl import GBCGRPOTrainer  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_hf_model(str(path), tie_word_embeddings=False)
    return str(path)


def reward_parity(completions, **kwargs):
    """A reward that mixes every group of a random tiny model's completions."""
    return [float(sum(map(ord, c)) % 2) for c in completions]


THROUGH_HEAD = hf._through_head


def _run(tiny, tmp_path, in_forward, monkeypatch):
    forwards = []
    through = THROUGH_HEAD

    def counted(*a, **k):
        forwards.append(torch.is_grad_enabled())
        return through(*a, **k)

    monkeypatch.setattr(hf, "_through_head", counted)
    trainer = build(GBCGRPOTrainer, tiny, tmp_path, loss_type="dapo", max_steps=2,
                    per_device_train_batch_size=8, num_generations=4, gbc_nthr=True,
                    gbc_nthr_beta=0.0)
    trainer.reward_funcs = [reward_parity]
    trainer._gbc_nthr_in_forward = in_forward
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    selected = [r["gbc/nthr_selected"] for r in trainer.state.log_history
                if "gbc/nthr_selected" in r]
    return params, selected, forwards


def test_trl_nthr_in_update_forward_equals_rollout_pass(tiny, tmp_path, monkeypatch):
    """Two steps: in the update's forward, one forward per step (the update's, with grad);
    with the rollout's pass, two (a no-grad one first). The parameters after both steps and
    NTHR's logged share are the same, bitwise; NTHR selected tokens (the scales act)."""
    ours, sel_ours, fw_ours = _run(tiny, tmp_path / "a", True, monkeypatch)
    pass_, sel_pass, fw_pass = _run(tiny, tmp_path / "b", False, monkeypatch)
    assert fw_ours == [True, True]
    assert fw_pass == [False, True, False, True]
    assert len(sel_ours) == 2 and sel_ours == sel_pass and max(sel_ours) > 0
    for n in ours:
        assert torch.equal(ours[n], pass_[n]), n
