"""examples/experiments.py: each experiment's --quick mode writes well-formed results, and the
likelihood-displacement measurement has the right sign on a case built to know it."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.mark.slow
def test_quick_modes_write_well_formed_results(tmp_path):
    import experiments as ex
    ex.main(["all", "--quick", "--out", str(tmp_path)])
    records = json.load(open(tmp_path / "results.json"))
    seen = {(r["experiment"], r["variant"]) for r in records}
    want = {(e, v) for e, variants in ex.EXPERIMENTS.items() for v in variants}
    assert seen == want
    for r in records:
        assert r["seed"] == 0 and isinstance(r["final"], dict) and r["curves"]
        for k in ("eval_after", "eval_sampled_after"):
            assert 0.0 <= r["final"][k] <= 1.0
        T = {len(c) for c in r["curves"].values()}
        assert T == {3}                                   # --quick: 3 RL steps
    nthr = [r for r in records if r["experiment"] == "nthr"]
    assert all("ll_correct_delta" in r["curves"] for r in nthr)
    bal = [r for r in records if r["experiment"] == "balance"]
    for r in bal:
        shares = [r["curves"][k] for k in r["curves"] if k.startswith("token_share[")]
        assert len(shares) == 4
        for t in range(3):
            assert abs(sum(s[t] for s in shares) - 1.0) < 1e-4     # 5 significant digits
    crit = [r for r in records if r["experiment"] == "critical-kl"
            and r["variant"].startswith("critical")]
    assert all("klw_decision_median" in r["final"] for r in crit)
    for png in ("critical-kl.png", "nthr.png", "balance.png", "critical-kl-weights.png"):
        assert (tmp_path / png).stat().st_size > 0
    md = (tmp_path / "tables.md").read_text()
    assert "### nthr" in md and "inconclusive" in md     # one seed decides nothing


def test_displacement_sign_on_a_built_case():
    """One correct and one wrong response sharing their first answer tokens; an update that
    only pushes the wrong response's tokens down must lower the correct one's likelihood, and
    one that pushes the correct response up must raise it."""
    import experiments as ex
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=16, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, max_position_embeddings=32,
                                         tie_word_embeddings=False))
    prompt = [1, 5, 6]
    right, wrong = [7, 8, 9, 2], [7, 8, 4, 2]               # share "7 8"
    seq = torch.tensor([prompt + right, prompt + wrong])
    targets = seq[:, 1:]
    mask = torch.zeros_like(targets, dtype=torch.bool)
    mask[:, len(prompt) - 1:] = True
    roll = dict(seq=seq, attn=torch.ones_like(seq), targets=targets, mask=mask,
                correct=torch.tensor([True, False]))

    class A:
        temperature = 1.0

    hook = ex.DisplacementHook()
    for push_row, sign in ((1, -1.0), (0, +1.0)):
        m = type(model)(model.config)
        m.load_state_dict(model.state_dict())
        state = hook.before(m, roll, A)
        logp = torch.log_softmax(m(seq).logits[:, :-1].float(), -1).gather(
            -1, targets.unsqueeze(-1)).squeeze(-1)
        # gradient step on one response only: down for the wrong one, up for the right one
        obj = sign * (logp[push_row] * mask[push_row]).sum()
        obj.backward()
        with torch.no_grad():
            for p in m.parameters():
                if p.grad is not None:
                    p += 0.05 * p.grad
        out = hook.after(m, roll, A, state, {})
        assert out["n_correct"] == 1
        assert math.isfinite(out["ll_correct_delta"])
        assert out["ll_correct_delta"] * sign > 0, (push_row, out)


@pytest.mark.slow
def test_shipped_scratchpad_checkpoint_scores_99_percent():
    """The shipped checkpoint (examples/checkpoints/scratchpad-add3) loads and adds held-out
    sums of every length it was trained on (1-3 digits, a seed the training never evaluated)
    at >= 99% greedy; on 4-digit operands, which it never saw, it is below 10%."""
    import pretrain_scratchpad as ps
    model, tok, meta = ps.load()
    assert meta["digits"] == 3 and meta.get("longer_share", 0.0) == 0.0
    acc = ps.accuracy_by_length(model, tok, 4, n=150, seed=12345)
    assert min(acc[d] for d in (1, 2, 3)) >= 0.99, acc
    assert acc[4] < 0.10, acc
