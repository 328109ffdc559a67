"""examples/experiments.py: the critical-token KL experiment's --quick mode writes well-formed
results, its probe marks the critical token, and the shipped checkpoints score as documented."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.mark.slow
def test_critical_kl_quick_writes_well_formed_results(tmp_path):
    import experiments as ex
    md = ex.main(["critical-kl", "--quick", "--out", str(tmp_path)])
    saved = json.load(open(tmp_path / "critical_kl.json"))
    recs = saved["records"]
    assert {r["variant"] for r in recs} == set(ex.variants(w_other=1.0)) and len(recs) == 5
    for r in recs:
        assert r["seed"] == 0
        for k in ("eval_sampled_after", "eval_after", "eval_own_sampled_after",
                  "eval_own_greedy_after"):
            assert 0.0 <= r["final"][k] <= 1.0
        c = r["curves"]
        assert len(c["accuracy"]) == 3                      # --quick: 3 RL steps
        assert c["probe_step"] == [0, 1, 2, 3]              # before the first, after each
        assert all(0.0 < p < 1.0 for p in c["p_critical"] + c["p_other"])
    # the variants start from the same checkpoint: the same probabilities before RL
    assert len({r["curves"]["p_critical"][0] for r in recs}) == 1
    opts = {r["variant"]: r["options"] for r in recs}
    w = saved["kl_weight_reference"]
    assert 0.0 < w["critical_mean"] < w["other_mean"] < 1.0       # the critical token: unsure
    assert opts["uniform KL"] == dict(kl_coef=ex.KL_COEF)
    assert opts["uniform KL, carry token free"] == dict(kl_coef=ex.KL_COEF, free_carry=True)
    assert opts["critical KL"] == dict(kl_coef=ex.KL_COEF, critical_kl_exponent=ex.GAMMA)
    matched = opts["critical KL, matched"]
    assert matched["critical_kl_exponent"] == ex.GAMMA
    assert abs(matched["kl_coef"] * w["other_mean"] - ex.KL_COEF) < 1e-3 * ex.KL_COEF
    assert (tmp_path / "critical-kl.png").stat().st_size > 0
    assert "critical KL − uniform KL" in md and "inconclusive" in md   # one seed decides nothing


def test_probe_set_marks_the_carry_out_digit():
    """The probe's critical position is the carry-out digit '1' right before EOS, and the
    other answer positions are the rest of the scratchpad and the EOS."""
    import experiments as ex
    from grpo_tasks import ScratchpadTokenizer
    tok = ScratchpadTokenizer()
    probe = ex.probe_set(tok, n=40, seed=3)
    ids, attn, starts, crit = probe
    rows = torch.arange(ids.shape[0])
    assert (ids[rows, crit] == tok.encode("1")[0]).all()
    assert (ids[rows, crit + 1] == tok.EOS).all()
    critical, other = ex._positions(probe)
    assert critical.sum(1).tolist() == [1] * 40
    for i in range(40):
        answer = tok.decode(ids[i, starts[i]:])
        a, b = map(int, tok.decode(ids[i, 1:starts[i]]).rstrip("=").split("+"))
        assert answer == f"{str(a)[::-1]}|{str(b)[::-1]}|{str(a + b)[::-1]}"
        assert len(str(a + b)) > max(len(str(a)), len(str(b)))
        assert int(other[i].sum()) == len(answer)          # the answer less '1', plus EOS


def test_carry_positions_on_sampled_answers():
    """The oracle's decision token: max(len(a), len(b)) tokens after the answer's second '|',
    wherever the sampled copies put it; none without a second '|' or past the answer's end."""
    import experiments as ex
    from grpo_tasks import ScratchpadTokenizer
    tok = ScratchpadTokenizer()
    cases = [("95+17=", "59|71|211"),       # right: the decision is the final '1'
             ("95+17=", "59|71|21"),        # stops early: the decision is the EOS
             ("95+17=", "5|71|2111"),       # a wrong copy shifts it; it follows the bars
             ("95+17=", "59|71"),           # no second '|'
             ("5+3=", "5|3|8"),             # the decision is the EOS after '8'
             ("5+3=", "")]                  # an answer that is PAD at once: empty
    rows = [[tok.BOS] + tok.encode(p) for p, _ in cases]
    L = max(map(len, rows))
    comps = [tok.encode(c) + [tok.EOS] if c else [] for _, c in cases]
    C = max(map(len, comps))
    seq = torch.full((len(cases), L + C), tok.PAD)
    mask = torch.zeros(len(cases), L + C - 1, dtype=torch.bool)
    for i, (r, c) in enumerate(zip(rows, comps)):
        seq[i, L - len(r):L] = torch.tensor(r)             # prompts left-padded
        if c:
            seq[i, L:L + len(c)] = torch.tensor(c)
            mask[i, L - 1:L - 1 + len(c)] = True
    roll = dict(seq=seq, mask=mask)
    pos = ex.carry_positions(roll, tok)
    targets = seq[:, 1:]
    got = [tok.decode([int(targets[i, t])]) if t >= 0 and int(targets[i, t]) != tok.EOS
           else ("EOS" if t >= 0 else None) for i, t in enumerate(pos)]
    assert got == ["1", "EOS", "1", None, "EOS", None], (pos, got)
    # the index counts from the answer's start: the third case's decision is its token 7
    assert pos[2] == L - 1 + 7


def test_reference_kl_weights_match_the_formula():
    """kl_weights (what sets the matched coefficient) equals docs/math.md §5 computed in float64
    from the reference's full logits: J = 1 + log max softmax(z / 4) / log V, w = J**gamma."""
    import experiments as ex
    import pretrain_scratchpad as ps
    model, tok, _ = ps.load(ex.CHECKPOINT)
    probe = ex.probe_set(tok, n=12, seed=7)
    wc, wo = ex.kl_weights(model, probe, gamma=10.0)
    with torch.no_grad():
        z = model(probe[0], attention_mask=probe[1]).logits[:, :-1].double()
    V = z.shape[-1]
    J = 1 + torch.log_softmax(z / 4.0, -1).max(-1).values / math.log(V)
    w = J ** 10.0
    critical, other = ex._positions(probe)
    torch.testing.assert_close(torch.tensor(wc, dtype=torch.float64), w[critical],
                               rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(torch.tensor(wo, dtype=torch.float64), w[other],
                               rtol=1e-4, atol=1e-7)
    assert statistics.fmean(wc) < 0.5 * statistics.fmean(wo)      # the unsure token


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
