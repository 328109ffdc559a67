"""The examples: the GRPO trainer (smoke runs per loss and method, parity mode, the K&K path),
the TRL and verl drop-in examples, the quickstart."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "examples", "grpo_trainer.py")
sys.path.insert(0, os.path.join(ROOT, "examples"))

TINY = ["--task", "add", "--digits", "1", "--sft-steps", "5", "--steps", "2", "--prompts", "2", "--group", "4",
        "--eval-size", "4", "--quiet"]


def run_trainer(tmp_path, *extra):
    import grpo_trainer
    out = str(tmp_path / "run")
    grpo_trainer.main(TINY + ["--out", out] + list(extra))
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    assert len(rows) == 2
    for r in rows:
        for k in ("reward", "accuracy", "loss", "clip_frac_low", "clip_frac_high",
                  "grad_share_low", "ratio_mean"):
            assert k in r and r[k] == r[k], k       # present and not NaN
    assert os.path.exists(os.path.join(out, "curves.png"))
    return rows


@pytest.mark.parametrize("extra", [
    pytest.param([], id="grpo-fused"),
    pytest.param(["--loss", "reference"], id="grpo-reference"),
    pytest.param(["--ar-alpha", "0.3"], id="ar"),
    pytest.param(["--lopti-eta", "0.5"], id="lopti"),
    pytest.param(["--nthr"], id="nthr"),
    pytest.param(["--kl-coef", "0.05", "--critical-kl-exponent", "2", "--critical-kl-certainty",
                  "entropy"], id="critical-kl"),
    pytest.param(["--entropy-coef", "0.01", "--loss-agg", "dr_grpo"], id="entropy-dr_grpo"),
    pytest.param(["--task", "scratchpad"], id="scratchpad-checkpoint"),
])
def test_trainer_smoke(tmp_path, extra):
    rows = run_trainer(tmp_path, *extra)
    if "--nthr" in extra:
        assert all("nthr_selected_frac" in r for r in rows)
    if "--critical-kl-exponent" in extra:
        assert all("critical_kl_weight_mean" in r and "kl" in r for r in rows)


def test_parity_mode_all_methods(tmp_path):
    out = tmp_path / "parity"
    # 4 prompts and a short warm-up: some groups have mixed rewards, so gradients are real
    r = subprocess.run([sys.executable, TRAINER, "--parity", "--out", str(out)] + TINY +
                       ["--prompts", "4", "--sft-steps", "40"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    p = json.load(open(out / "parity.json"))
    assert p["steps"] == 2 and p["checks"] == 4          # two Lopti phases per step
    assert set(p["features"]) == {"ar", "lopti", "nthr", "critical_kl"}
    assert p["max_rel_grad_diff"] <= 1e-4 and p["max_abs_loss_diff"] <= 1e-5


def test_kk_task_one_step_with_tiny_random_model(tmp_path):
    pytest.importorskip("reasoning_gym")
    path = tmp_path / "tiny"
    tiny_hf_model(str(path))
    import grpo_trainer
    out = tmp_path / "kk"
    grpo_trainer.main(["--task", "kk", "--model", str(path), "--steps", "1", "--prompts", "2",
                       "--group", "2", "--out", str(out), "--quiet", "--kl-coef", "0.04",
                       "--nthr"])
    rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert len(rows) == 1 and 0.0 <= rows[0]["reward"] <= 1.0


def test_trl_example_parameters_move(tmp_path):
    pytest.importorskip("trl")
    import trl_grpo
    from transformers import AutoModelForCausalLM
    model_dir = tmp_path / "model"
    trl_grpo.tiny_char_model(str(model_dir))
    before = {k: v.clone() for k, v in
              AutoModelForCausalLM.from_pretrained(str(model_dir)).state_dict().items()}
    trainer = trl_grpo.main(["--steps", "4", "--model", str(model_dir),
                             "--out", str(tmp_path / "out")])
    after = trainer.model.state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k].detach().cpu())]
    trainable = [k for k, p in trainer.model.named_parameters() if p.requires_grad]
    assert set(trainable) <= set(moved) | {k for k in trainable if "rotary" in k}, \
        sorted(set(trainable) - set(moved))


def test_quickstart_runs():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py"),
                        "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("step ") == 2 and "grad_share_low" in r.stdout


def test_trl_example_trains_and_logs_true_grad_norm(tmp_path):
    """The TRL example under Lopti: every parameter the loss reaches moves, and the logged
    grad_norm is that of both updates (positive, and at least each phase's own norm)."""
    pytest.importorskip("trl")
    import trl_grpo
    trainer = trl_grpo.main(["--steps", "12", "--out", str(tmp_path)])
    assert trainer.state.global_step == 12
    rows = [r for r in trainer.state.log_history if "reward" in r]
    logged = {k for row in rows for k in row}
    assert {"reward", "kl", "clip_ratio/region_mean", "gbc/nthr_selected",
            "gbc/grad_share_low_low", "gbc/grad_norm_low", "gbc/grad_norm_high"} <= logged
    for r in rows:
        assert r["grad_norm"] > 0
        both = (r["gbc/grad_norm_low"] ** 2 + r["gbc/grad_norm_high"] ** 2) ** 0.5
        assert abs(r["grad_norm"] - both) <= 1e-4 * both + 1e-6, r
    assert max(r["kl"] for r in rows) > 0            # the policy left the reference


def test_verl_example_runs():
    pytest.importorskip("verl.trainer.ppo.core_algos")
    import verl_loss
    loss, metrics = verl_loss.main()
    assert torch.isfinite(loss) and "actor/pg_clipfrac" in metrics


def test_openrlhf_example_runs():
    pytest.importorskip("deepspeed")
    pytest.importorskip("openrlhf")
    standins = os.path.join(ROOT, "tests", "standins")
    try:
        import openrlhf_loss
        loss, theirs, metrics = openrlhf_loss.main()
    finally:                  # the example's import-only flash-attn stand-in leaves with it
        while standins in sys.path:
            sys.path.remove(standins)
        for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
            del sys.modules[name]
    assert abs(float(loss) - float(theirs)) <= 1e-5 * max(1.0, abs(float(theirs)))
    assert {"policy_loss", "ppo_clip_ratio", "ppo_kl", "kl", "entropy_loss"} <= set(metrics)


@pytest.mark.slow
def test_verl_engine_example_runs():
    pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "verl_engine.py")],
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PORT="29577", OMP_NUM_THREADS="2"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "GBCFSDPEngineWithLMHead" in out.stdout
    assert out.stdout.count("Lopti's second update") == 3
    assert out.stdout.count("NTHR selected") == 3


@pytest.mark.slow
def test_demo_default_learns(tmp_path):
    """The main job's default (GRPO from the shipped scratchpad checkpoint, sampling at
    temperature 3), shortened to 60 steps: the held-out sampled accuracy rises (the full
    150-step run: ~0.2 -> ~0.5 on every seed and thread count tried, README), and the greedy
    accuracy on the checkpoint's own range stays near 1."""
    import grpo_trainer
    args = grpo_trainer.build_args(["--steps", "60", "--eval-size", "100", "--quiet",
                                    "--out", str(tmp_path / "demo")])
    assert (args.task, args.temperature, args.rl_digits) == ("scratchpad", 3.0, None)
    history = grpo_trainer.train(args, log=lambda *a: None)
    final = history[-1]
    assert final["eval_sampled_before"] < 0.3
    assert final["eval_sampled_after"] >= final["eval_sampled_before"] + 0.05, final
    assert final["eval_after"] >= 0.95, final


def _built_group(correct_flags):
    """One question of the scratchpad task with every answer the right one, labelled by
    ``correct_flags``: the displacement measure's built case."""
    import random as _random

    import gbc_kernels as gbc
    import grpo_trainer as gt
    import pretrain_scratchpad as ps
    from gbc_kernels.integrations import hf

    model, tok, meta = ps.load(ps.CHECKPOINT)
    task = gt.ScratchpadAdditionTask(int(meta["digits"]), tok)
    batch = task.sample(1, _random.Random(3))
    G = len(correct_flags)
    comp = torch.tensor([tok.encode(batch.answers[0]) + [tok.eos_token_id]] * G)
    prompt = batch.prompts.repeat(G, 1)
    seq = torch.cat([prompt, comp], 1)
    attn = (seq != tok.pad_token_id).long()
    attn[:, prompt.shape[1]:] = 1
    targets = seq[:, 1:]
    mask = torch.zeros_like(targets, dtype=torch.bool)
    mask[:, prompt.shape[1] - 1:] = gt.completion_mask(comp, tok.eos_token_id, tok.pad_token_id)
    correct = torch.tensor(correct_flags)
    adv = gbc.group_advantages(correct.float(), torch.zeros(G, dtype=torch.long))
    old = hf.old_policy_pass(model, seq, attn, targets, mask, temperature=3.0)
    roll = dict(seq=seq, attn=attn, targets=targets, mask=mask, adv=adv, correct=correct,
                old_logp=old.old_logp)
    return model, roll


def test_displacement_measure_sign_on_a_built_case():
    """Every answer is the right one; two are labelled correct, two wrong. One SGD step on the
    correct ones alone makes the right answer more likely (> 0); on the "wrong" ones alone —
    the same tokens pushed down — less likely (< 0): the measure's sign is the claim's."""
    import argparse

    import displacement as dsp

    model, roll = _built_group([True, True, False, False])
    args = argparse.Namespace(lr=0.1, temperature=3.0)
    pos = roll["correct"][:, None].float().expand_as(roll["mask"])
    up = dsp.one_step(model, roll, pos, args)
    down = dsp.one_step(model, roll, 1.0 - pos, args)
    assert up > 0 > down, (up, down)
    assert dsp.one_step(model, roll, pos, args) == up        # the weights were restored


def test_displacement_quick_writes_results(tmp_path):
    import displacement as dsp

    res = dsp.main(["--quick", "--out", str(tmp_path)])
    saved = json.load(open(tmp_path / "displacement.json"))
    assert saved["groups"] == 6 == len(saved["rows"])
    for row in saved["rows"]:
        assert 0 < row["n_correct"] < 8
        for v in dsp.VARIANTS:
            assert math.isfinite(row[v])
    for claim in saved["claims"].values():
        assert claim["wins"] + claim["losses"] <= claim["groups"]
        assert 0.0 <= claim["p"] <= 1.0
    assert res["claims"].keys() == saved["claims"].keys()
    assert (tmp_path / "displacement.png").stat().st_size > 0


def test_balance_quick_writes_results(tmp_path):
    """examples/balance.py --quick: per batch the gradient norm of each p_old bucket (a bucket
    with tokens has a positive norm, an empty one 0) and each variant's share of positive-
    advantage high-probability tokens moving up, in [0, 1]."""
    import balance

    balance.main(["--quick", "--out", str(tmp_path)])
    saved = json.load(open(tmp_path / "balance.json"))
    assert saved["batches"] == 2 == len(saved["rows"])
    for row in saved["rows"]:
        assert len(row["buckets"]) == len(balance.EDGES) - 1
        for norm, count in row["buckets"]:
            assert (norm > 0) == (count > 0) and math.isfinite(norm)
        for v in balance.VARIANTS:
            share = row[v]["pos_high_up"]
            assert share is None or 0.0 <= share <= 1.0
    assert set(saved["summary"]["claims"]) == {
        f"{v} - GRPO, share of positive high-p tokens moving up" for v in ("AR", "Lopti")}
    assert (tmp_path / "balance.png").stat().st_size > 0


@pytest.mark.slow
def test_balance_accuracy_quick_pairs_seeds(tmp_path):
    """examples/balance.py --accuracy: GRPO / +AR / +Lopti training runs per seed with the
    paper's loss settings, summarised as paired differences over the seeds."""
    import balance

    summary = balance.main(["--accuracy", "0,1", "--quick", "--out", str(tmp_path)])
    assert summary["seeds"] == [0, 1]
    for v in ("AR", "Lopti"):
        d = summary[f"{v} - GRPO"]
        assert d["seeds"] == 2 and d["wins"] + d["losses"] <= 2
        assert d["verdict"] in ("reproduced", "not reproduced", "inconclusive")
    rows = json.load(open(tmp_path / "balance_accuracy_0.json"))
    assert {(r["seed"], r["variant"]) for r in rows} == {
        (s, v) for s in (0, 1) for v in ("GRPO", "AR", "Lopti")}
    for r in rows:
        assert 0.0 <= r["sampled_after"] <= 1.0


def test_scratchpad_operand_mixes():
    """The RL operand mixes: ``final_carry`` True / False gives only sums that carry out of
    their last column / none; ``paper_mix`` (the critical-token paper's, for N + 1 = 4) always
    has a 4-digit operand, the other one 4 digits about half of the time, else 1-3."""
    import random
    from grpo_tasks import ScratchpadAdditionTask, ScratchpadTokenizer
    tok = ScratchpadTokenizer()
    rng = random.Random(0)
    carry = ScratchpadAdditionTask(3, tok, final_carry=True).pairs(400, rng)
    assert all(len(str(a + b)) == max(len(str(a)), len(str(b))) + 1 for a, b in carry)
    none = ScratchpadAdditionTask(3, tok, final_carry=False).pairs(400, rng)
    assert all(len(str(a + b)) == max(len(str(a)), len(str(b))) for a, b in none)
    assert max(max(a, b) for a, b in carry + none) >= 100          # every length drawn
    pairs = ScratchpadAdditionTask(4, tok, paper_mix=True).pairs(2000, rng)
    lens = [sorted((len(str(a)), len(str(b)))) for a, b in pairs]
    assert all(hi == 4 for _, hi in lens)
    both = sum(lo == 4 for lo, _ in lens) / len(lens)
    assert 0.45 < both < 0.55, both
    assert {lo for lo, _ in lens} == {1, 2, 3, 4}
    first_long = sum(len(str(a)) == 4 for a, _ in pairs) / len(pairs)
    assert 0.7 < first_long < 0.8          # either side evenly, both sides half the time


@pytest.mark.slow
def test_shipped_carry_checkpoint_has_an_unsure_critical_token():
    """examples/checkpoints/scratchpad-carry3 (the critical-token KL experiment's model): >= 99%
    greedy on held-out sums of every length 1-3 that do not carry out (its training
    distribution); on sums that do, the carry-out digit is the one token it is unsure of: the
    right digit's mean probability there is below 0.5, while the other answer tokens' is above
    0.95 (teacher-forced, fixed probe sums)."""
    import experiments as ex
    import pretrain_scratchpad as ps
    model, tok, meta = ps.load(ex.CHECKPOINT)
    assert meta["digits"] == 3 and meta["final_carry"] is False
    acc = ps.accuracy_by_length(model, tok, 3, n=150, seed=12345, final_carry=False)
    assert min(acc.values()) >= 0.99, acc
    p_crit, p_other = ex.critical_probs(model, ex.probe_set(tok, n=64, seed=99))
    assert p_crit < 0.5 and p_other > 0.95, (p_crit, p_other)


def test_pretraining_auxiliary_documents():
    """pretrain_scratchpad.aux_batch (docs/experiments.md §4's length-generalisation attempt):
    bare copies 'a=' -> reversed digits and digit-list sums 'x|y|' -> reversed sum, the loss
    mask on the part after the prompt and the EOS only."""
    import random
    import pretrain_scratchpad as ps
    from grpo_tasks import ScratchpadTokenizer
    tok = ScratchpadTokenizer()
    ids, mask = ps.aux_batch(tok, 40, 5, random.Random(0))
    assert mask.shape == (40, ids.shape[1] - 1)
    longest = 0
    for i in range(40):
        row = ids[i].tolist()
        end = row.index(tok.EOS)
        text = tok.decode(row[1:end])
        target = [t for t, m in zip(row[1:], mask[i].tolist()) if m]
        assert target[-1] == tok.EOS
        answer = tok.decode(target[:-1])
        prompt = text[:len(text) - len(answer)]
        if i % 2 == 0:                                   # a bare copy
            assert prompt.endswith("=") and "+" not in prompt
            assert answer == prompt[:-1][::-1]
        else:                                            # a sum of digit lists
            x, y, rest = prompt.split("|")
            assert rest == "" and answer == str(int(x[::-1]) + int(y[::-1]))[::-1]
        longest = max(longest, max(len(p) for p in prompt.rstrip("=|").split("|")))
    assert longest == 5                                  # operands up to --aux-digits


@pytest.mark.parametrize("loss", ["fused", "reference"])
def test_sampler_support_replay(tmp_path, loss):
    """Top-p sampling recorded by the trainer's own sampler (issue 60): the policy's ratio
    against the sampler's processed log-probs is off by the kept mass over the whole
    vocabulary (mean < 1, most tokens outside [0.9, 1.1]) and 1 within float32 noise over the
    recorded support; the update replays the support, with truncated importance sampling, and
    NTHR's scales over the support."""
    rows = run_trainer(tmp_path, "--task", "scratchpad", "--top-p", "0.7", "--support-replay",
                       "--tis-cap", "3", "--kl-coef", "0.05", "--critical-kl-exponent", "2",
                       "--nthr", "--loss", loss)
    for r in rows:
        assert r["sampler_ratio_mean_full"] < 0.95 and r["sampler_ratio_outside_full"] > 0.5
        assert abs(r["sampler_ratio_mean_replay"] - 1) < 1e-4
        assert r["sampler_ratio_outside_replay"] == 0.0
    assert rows[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)    # the update's own ratio
    # critical-token KL's weights from the reference's certainty over the support (in (0, 1])
    assert all(0 < r["critical_kl_weight_mean"] <= 1 for r in rows)
    assert all(0 <= r["nthr_selected_frac"] <= 1 and r["nthr_eta_mean"] <= 1 for r in rows)


@pytest.mark.parametrize("argv, named", [
    (["--top-k", "-1"], "--top-k: expected an int >= 0"),
    (["--top-p", "0"], "--top-p: expected a float in (0, 1]"),
    (["--min-p", "1"], "--min-p: expected a float in [0, 1)"),
    (["--tis-cap", "0"], "--tis-cap: expected a float > 0"),
    (["--paper-mix", "--longest-only"], "--paper-mix and --longest-only"),
    (["--task", "add", "--final-carry"], "--final-carry needs --task scratchpad"),
    (["--parity", "--paper-mix"], "--paper-mix needs --task scratchpad"),
])
def test_trainer_refuses_conflicting_task_options(argv, named, capsys):
    """The scratchpad operand options are refused, by name, where they would be ignored."""
    import grpo_trainer as gt
    with pytest.raises(SystemExit):
        gt.build_args(argv)
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("loss", ["fused", "reference"])
def test_lopti_logged_loss_is_the_batchs(loss):
    """Issue 53, defect 1: under Lopti ``rl_step`` logs the batch's loss without the split (every
    completion token once, the same normaliser) and its KL / entropy terms, at the parameters
    before the first update — gbc_reference's loss on the whole batch in float64 — not the sum
    of the two phases' losses (the old log)."""
    import dataclasses

    import gbc_reference
    import grpo_trainer as gt

    torch.manual_seed(3)
    V, B, S = 20, 4, 10
    model = gt.tiny_qwen2(V, seed=0, layers=1).float()
    seq = torch.randint(3, V, (B, S))
    attn = torch.ones(B, S, dtype=torch.long)
    mask = torch.zeros(B, S - 1, dtype=torch.bool)
    mask[:, 4:] = True
    mask[1, 7:] = False
    head = model.lm_head.weight
    with torch.no_grad():
        h = gt.hf.completion_hidden(model, seq, attn)
        logp = torch.log_softmax(h @ head.T, -1).gather(-1, seq[:, 1:, None])[..., 0]
    roll = dict(seq=seq, attn=attn, targets=seq[:, 1:], mask=mask,
                adv=torch.tensor([1.0, -0.5, 0.8, -1.2]),
                old_logp=logp + 0.3 * torch.randn(B, S - 1),
                ref_logp=logp + 0.2 * torch.randn(B, S - 1),
                token_scale=None, kl_weight=None)
    eta = float(roll["old_logp"].exp()[mask].median())
    args = gt.build_args(["--task", "add", "--loss", loss, "--lopti-eta", str(eta),
                          "--ar-alpha", "0.3", "--kl-coef", "0.05", "--entropy-coef", "0.01",
                          "--temperature", "1.0"])
    # float64: the whole batch, no split, at the parameters before the step
    m64 = __import__("copy").deepcopy(model).double()
    r64 = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v)
           for k, v in roll.items()}
    cfg = dataclasses.replace(gt.loss_config(args, gbc_reference), lopti_eta=None)
    with torch.no_grad():
        h64 = gt.hf.completion_hidden(m64, seq, attn)
        want, want_m = gbc_reference.fused_linear_policy_loss(
            h64, m64.lm_head.weight, r64["targets"], mask, r64["adv"], old_logp=r64["old_logp"],
            ref_logp=r64["ref_logp"], config=cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    got, metrics = gt.rl_step(model, opt, roll, args)
    assert got == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    for k in ("kl", "entropy", "clip_frac_low", "clip_frac_high"):
        assert metrics[k] == pytest.approx(float(want_m[k]), rel=1e-5, abs=1e-6), k
    assert "grad_share_low" in metrics


def test_support_replay_nthr_is_over_the_support():
    """``--support-replay --nthr``: the trainer's NTHR scales are the float64 reference's over
    the recorded support (issue 60), not the whole vocabulary's."""
    import gbc_reference
    import grpo_trainer as gt

    torch.manual_seed(5)
    V, B, S, k = 20, 8, 10, 4
    model = gt.tiny_qwen2(V, seed=0, layers=1).float()
    seq = torch.randint(3, V, (B, S))
    attn = torch.ones(B, S, dtype=torch.long)
    targets, mask = seq[:, 1:], torch.zeros(B, S - 1, dtype=torch.bool)
    mask[:, 4:] = True
    mask[1, 7:] = False
    ids = torch.randint(0, V, (B, S - 1, k))
    ids[..., 0] = torch.where(torch.rand(B, S - 1) < 0.8, targets, ids[..., 0])
    ids[..., -1] = -1
    group_ids = torch.arange(2).repeat_interleave(4)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0])
    args = gt.build_args(["--task", "add", "--support-replay", "--nthr", "--nthr-beta", "0",
                          "--temperature", "0.9"])
    with torch.no_grad():
        out = gt.sampler_ratios(model, model, seq, attn, targets, mask, ids,
                                torch.zeros(B, S - 1), torch.zeros(B, S - 1), None, args, {},
                                (group_ids, adv))
        m64 = __import__("copy").deepcopy(model).double()
        h64 = gt.hf.completion_hidden(m64, seq, attn)
        kw = dict(temperature=0.9, beta=0.0)
        want = gbc_reference.nthr_scale(h64, m64.lm_head.weight, targets, mask, group_ids,
                                        adv > 0, support_ids=ids, **kw)
        full = gbc_reference.nthr_scale(h64, m64.lm_head.weight, targets, mask, group_ids,
                                        adv > 0, **kw)
    got = out[-1]
    top = float(want.scores.abs().max())
    assert float((got.scores - want.scores).abs().max()) <= 1e-4 * top
    assert float((full.scores - want.scores).abs().max()) > 1e-2 * top
    assert torch.equal(got.selected, want.selected) and want.selected.any()
