"""NTHR's likelihood displacement, per question (arXiv 2505.18830, §5.3), on the scratchpad task.

    python examples/displacement.py            # 200 mixed groups, about 4 minutes on one core
    python examples/displacement.py --quick    # 6 groups (the test suite)

From one fixed checkpoint (the shipped scratchpad-add3), for each question: sample a group of G
answers at the demo's temperature, keep the group if it is mixed (some right, some wrong), and
for each variant take **one SGD step on that group alone** from the same weights, then measure
the change of the correct answers' mean log-likelihood (per-token mean log-prob of each correct
answer at temperature 1, averaged over the group's correct answers; positive = the right
answers became more likely). Variants (the paper's):

- ``GRPO``: every answer with its group advantage;
- ``positive-only``: the wrong answers' terms dropped (no negative gradient);
- ``NTHR``: NTHR's selected tokens of the wrong answers dropped (eta = 0), beta = 1;
- ``random``: as many of the wrong answers' tokens as NTHR selected, chosen at random, dropped.

The claims tested, each as a paired sign test over the groups: GRPO displaces the correct
answers' likelihood less favourably than positive-only (the negative gradient pulls the right
answers down: Lazy Likelihood Displacement); NTHR raises it against GRPO; NTHR raises it against
the random control (it is the choice of tokens, not their number). Results: ``<out>/displacement.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gbc_kernels as gbc                         # noqa: E402
import grpo_trainer as gt                         # noqa: E402
from experiments import sign_test, sign_verdict   # noqa: E402
from gbc_kernels.integrations import hf           # noqa: E402

VARIANTS = ("GRPO", "positive-only", "NTHR", "random")
# (variant a, variant b, the sign of a - b the claim predicts)
CLAIMS = (("positive-only", "GRPO", +1), ("NTHR", "GRPO", +1), ("NTHR", "random", +1))


def fixed_options(ap):
    """The options of both one-step protocols (this script and balance.py)."""
    ap.add_argument("--group", type=int, default=8, help="answers per question (G)")
    ap.add_argument("--temperature", type=float, default=3.0,
                    help="sampling and loss temperature (the demo's)")
    ap.add_argument("--lr", type=float, default=0.1,
                    help="the SGD step's learning rate (small: the first-order regime)")
    ap.add_argument("--checkpoint", default=None, help="None: the shipped scratchpad-add3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None,
                    help="None: docs/experiments (runs/experiments with --quick)")


def fixed_setup(args, prompts, extra=()):
    """The shipped checkpoint (or ``args.checkpoint``), its task, the trainer's arguments for
    ``prompts`` questions of ``args.group`` answers at ``args.temperature``, and the seeded RNG:
    what both of the papers' one-step protocols start from."""
    import pretrain_scratchpad as ps

    model, tok, meta = ps.load(args.checkpoint or ps.CHECKPOINT)
    task = gt.ScratchpadAdditionTask(int(meta["digits"]), tok,
                                     reversed_prompt=bool(meta.get("reversed_prompt", False)))
    targs = gt.build_args(["--task", "scratchpad", "--prompts", str(prompts), "--group",
                           str(args.group), "--temperature", str(args.temperature), "--quiet",
                           *extra])
    targs.max_len = task.max_answer_tokens
    torch.manual_seed(args.seed)
    return model, tok, task, targs, random.Random(args.seed)


def sgd_step(model, loss, lr):
    """One plain SGD step of ``loss``."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)


@contextlib.contextmanager
def restored(model):
    """Run the block, then put the model's weights back as they were."""
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        yield
    finally:
        model.load_state_dict(saved)


def output_dir(args):
    """``--out``, else docs/experiments (runs/experiments with ``--quick``); created."""
    out = args.out or os.path.join(os.path.dirname(HERE), "runs/experiments" if args.quick
                                   else "docs/experiments")
    os.makedirs(out, exist_ok=True)
    return out


@torch.no_grad()
def correct_loglik(model, roll):
    """Mean over the correct answers of their per-token mean log-prob (temperature 1)."""
    head = hf.lm_head(model)
    h = hf.completion_hidden(model, roll["seq"], roll["attn"])
    logp = gbc.fused_linear_logprobs(h, head.weight, roll["targets"], head.bias)[0]
    m = roll["mask"].float()
    per_answer = (logp * m).sum(1) / m.sum(1).clamp(min=1)
    return float(per_answer[roll["correct"]].mean())


def one_step(model, roll, scale, args):
    """The change of the correct answers' likelihood after one SGD step on this group with
    ``token_scale = scale``; the weights are restored afterwards."""
    before = correct_loglik(model, roll)
    with restored(model):
        head = hf.lm_head(model)
        h = hf.completion_hidden(model, roll["seq"], roll["attn"])
        cfg = gbc.PolicyLossConfig(loss_agg="token-mean", temperature=args.temperature)
        loss, _ = gbc.fused_linear_policy_loss(h, head.weight, roll["targets"], roll["mask"],
                                               roll["adv"], old_logp=roll["old_logp"],
                                               bias=head.bias, token_scale=scale, config=cfg)
        sgd_step(model, loss, args.lr)
        after = correct_loglik(model, roll)
    return after - before


def scales(roll, rng):
    """Per variant, the [B, T] token scale (None: every token at 1)."""
    mask, correct = roll["mask"], roll["correct"]
    neg = mask & ~correct[:, None]
    selected = roll["selected"] & neg
    ones = torch.ones(mask.shape)
    pos_only = ones * correct[:, None].float()
    nthr = torch.where(selected, 0.0, 1.0)
    rand = ones.clone()
    cand = neg.reshape(-1).nonzero().squeeze(1).tolist()
    for i in rng.sample(cand, int(selected.sum())):
        rand.view(-1)[i] = 0.0
    return {"GRPO": None, "positive-only": pos_only, "NTHR": nthr, "random": rand}


def run(groups, args, log=print):
    model, tok, task, targs, rng = fixed_setup(args, 1, ["--nthr"])
    rows, tried = [], 0
    while len(rows) < groups:
        tried += 1
        roll = gt.rollout(model, model, task, tok, targs, rng)
        if not (roll["correct"].any() and not roll["correct"].all()):
            continue
        model.eval()       # no dropout in the tiny model; eval for the measurements alike
        old = hf.old_policy_pass(model, roll["seq"], roll["attn"], roll["targets"],
                                 roll["mask"], torch.zeros(args.group, dtype=torch.long),
                                 roll["correct"], temperature=args.temperature, nthr=True,
                                 nthr_beta=args.beta, nthr_eta=0.0)
        roll["selected"] = old.nthr.selected
        row = {"n_correct": int(roll["correct"].sum()),
               "n_selected": int(old.nthr.selected.sum())}
        for name, scale in scales(roll, rng).items():
            row[name] = one_step(model, roll, scale, args)
        rows.append(row)
        if len(rows) % 25 == 0:
            log(f"{len(rows)} mixed groups ({tried} sampled)")
    summary = {}
    for a, b, sign in CLAIMS:
        diffs = [r[a] - r[b] for r in rows if r["n_selected"] > 0 or "NTHR" not in (a, b)]
        w, l, p = sign_test([sign * d for d in diffs])
        summary[f"{a} vs {b}"] = dict(
            groups=len(diffs), wins=w, losses=l, p=p,
            mean_diff=sum(diffs) / max(len(diffs), 1),
            median_diff=statistics.median(diffs) if diffs else float("nan"),
            verdict=sign_verdict(w, l, p))
    means = {v: sum(r[v] for r in rows) / len(rows) for v in VARIANTS}
    return dict(groups=len(rows), sampled=tried, mean_displacement=means, claims=summary,
                rows=rows, settings=vars(args))


def plot(res, path):
    """Left: each variant's per-group change of the correct answers' mean log-likelihood
    (sorted; symmetric-log scale). Right: the paired comparisons' wins and losses."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 3.8))
    for i, v in enumerate(res["mean_displacement"]):
        a.plot(sorted(r[v] for r in res["rows"]), color=f"C{i}", label=v)
    a.axhline(0, color="k", lw=0.5)
    a.set_yscale("symlog", linthresh=1e-6)
    a.set_xlabel("mixed group (sorted by its change)")
    a.set_title("change of the correct answers' mean log-likelihood, one SGD step", fontsize=9)
    a.legend(fontsize=7)
    names = list(res["claims"])
    wins = [res["claims"][k]["wins"] for k in names]
    losses = [res["claims"][k]["losses"] for k in names]
    x = range(len(names))
    b.bar([i - 0.2 for i in x], wins, width=0.4, color="C2", label="first > second")
    b.bar([i + 0.2 for i in x], losses, width=0.4, color="C3", label="first < second")
    b.set_xticks(list(x))
    b.set_xticklabels(names, fontsize=8)
    b.set_title(f"paired over {res['groups']} groups (sign test p: " +
                ", ".join(f"{res['claims'][k]['p']:.0e}" for k in names) + ")", fontsize=9)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="6 groups (the test suite)")
    ap.add_argument("--groups", type=int, default=200, help="mixed groups to measure")
    ap.add_argument("--beta", type=float, default=1.0, help="NTHR's threshold factor")
    fixed_options(ap)
    args = ap.parse_args(argv)
    groups = 6 if args.quick else args.groups
    out = output_dir(args)
    res = run(groups, args)
    with open(os.path.join(out, "displacement.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(out, "displacement.png"))
    print(f"{res['groups']} mixed groups of {res['sampled']} sampled; mean change of the "
          "correct answers' mean log-likelihood after one SGD step:")
    for v, m in res["mean_displacement"].items():
        print(f"  {v:14s} {m:+.5f}")
    for k, c in res["claims"].items():
        print(f"  {k}: {c['wins']} wins / {c['losses']} losses of {c['groups']}, median "
              f"difference {c['median_diff']:+.2e}, mean {c['mean_diff']:+.2e}, sign test "
              f"p = {c['p']:.3g}: {c['verdict']}")
    return res


if __name__ == "__main__":
    main()
