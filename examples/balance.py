"""AR / Lopti's gradient-balance measurements (arXiv 2505.12929, Fig. 1(c-f) and Fig. 3), with one
SGD step, on the scratchpad task.

    python examples/balance.py            # 40 batches, a few minutes on one core
    python examples/balance.py --quick    # 2 batches (the test suite)
    python examples/balance.py --accuracy 0,1,2,3,4,5,6,7,8,9   # training runs, paired seeds

From one fixed checkpoint (the shipped scratchpad-add3), each batch: 16 questions x 8 answers
sampled at the demo's temperature (3; the loss and the probabilities use the same), group
advantages, old log-probs on-policy. Then, from the same weights each time:

- **Fig. 1(d)**: the norm of the *parameter* gradient of the GRPO loss when only the tokens of
  one ``p_old`` bucket (edges 0 / 0.25 / 0.5 / 0.75 / 1) keep their advantage (the others get
  0), the loss's normaliser unchanged — which bucket's tokens dominate the update;
- **Fig. 1(c, e, f) and Fig. 3**: one SGD step with GRPO, with AR (alpha 0.3), and with Lopti
  (eta 0.5: its low step then its high step, each an SGD step at the same learning rate), then
  each token's probability again: the share of the **positive-advantage** tokens with
  ``p_old > 0.75`` whose probability went up (the paper's Fig. 3 count), and the mean change of
  probability per bucket and advantage sign.

The claims: low-probability tokens carry most of the parameter-gradient norm per token; with GRPO
a part of the positive-advantage high-probability tokens moves down; AR and Lopti raise the share
that moves up. Paired over batches (mean, 95% interval, sign test). Results:
``<out>/balance.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gbc_kernels as gbc                         # noqa: E402
import grpo_trainer as gt                         # noqa: E402
from displacement import (fixed_options, fixed_setup, output_dir,   # noqa: E402
                          restored, sgd_step)
from experiments import mean_ci, sign_test, sign_verdict, verdict     # noqa: E402
from gbc_kernels.integrations import hf           # noqa: E402

EDGES = (0.0, 0.25, 0.5, 0.75, 1.0001)
HIGH = 0.75
VARIANTS = ("GRPO", "AR", "Lopti")


def _loss(model, roll, args, advantages, ar_alpha=0.0, lopti_eta=None, phase=None):
    head = hf.lm_head(model)
    h = hf.completion_hidden(model, roll["seq"], roll["attn"])
    cfg = gbc.PolicyLossConfig(loss_agg="token-mean", temperature=args.temperature,
                               ar_alpha=ar_alpha, lopti_eta=lopti_eta)
    loss, _ = gbc.fused_linear_policy_loss(h, head.weight, roll["targets"], roll["mask"],
                                           advantages, old_logp=roll["old_logp"],
                                           bias=head.bias, config=cfg, phase=phase)
    return loss


@torch.no_grad()
def _logp(model, roll, temperature):
    head = hf.lm_head(model)
    h = hf.completion_hidden(model, roll["seq"], roll["attn"])
    return gbc.fused_linear_logprobs(h, head.weight, roll["targets"], head.bias,
                                     temperature=temperature)[0]


def grad_norm_by_bucket(model, roll, args):
    """Fig. 1(d): {bucket: (parameter-gradient norm, tokens in it)}."""
    p_old = roll["old_logp"].exp()
    adv = roll["adv"][:, None].expand_as(p_old)
    out = []
    for lo, hi in zip(EDGES[:-1], EDGES[1:]):
        inside = roll["mask"] & (p_old >= lo) & (p_old < hi)
        loss = _loss(model, roll, args, torch.where(inside, adv, torch.zeros_like(adv)))
        model.zero_grad(set_to_none=True)
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()
                             if p.grad is not None))
        out.append((norm, int(inside.sum())))
    model.zero_grad(set_to_none=True)
    return out


def step_and_measure(model, roll, args, variant):
    """One update (Lopti: its two steps) from the current weights; the per-token change of
    probability; the weights are restored."""
    with restored(model):
        if variant == "GRPO":
            sgd_step(model, _loss(model, roll, args, roll["adv"]), args.lr)
        elif variant == "AR":
            sgd_step(model, _loss(model, roll, args, roll["adv"], ar_alpha=args.ar_alpha),
                     args.lr)
        else:
            for phase in ("low", "high"):
                sgd_step(model, _loss(model, roll, args, roll["adv"],
                                      lopti_eta=args.lopti_eta, phase=phase), args.lr)
        return _logp(model, roll, args.temperature).exp() - roll["old_logp"].exp()


def measure_batch(model, roll, args):
    p_old = roll["old_logp"].exp()
    m = roll["mask"]
    adv = roll["adv"][:, None].expand_as(p_old)
    pos_high = m & (adv > 0) & (p_old > HIGH)
    neg_high = m & (adv < 0) & (p_old > HIGH)
    row = {"buckets": grad_norm_by_bucket(model, roll, args),
           "pos_high_tokens": int(pos_high.sum()), "neg_high_tokens": int(neg_high.sum())}
    for v in VARIANTS:
        dp = step_and_measure(model, roll, args, v)
        row[v] = {
            "pos_high_up": float((dp[pos_high] > 0).float().mean()) if pos_high.any() else None,
            "neg_high_down": float((dp[neg_high] < 0).float().mean()) if neg_high.any() else None,
            "dp_by_bucket": [[float(dp[m & (p_old >= lo) & (p_old < hi) & sel].mean())
                              if (m & (p_old >= lo) & (p_old < hi) & sel).any() else None
                              for lo, hi in zip(EDGES[:-1], EDGES[1:])]
                             for sel in (adv > 0, adv < 0)],
        }
    return row


def summarise(rows):
    nb = len(EDGES) - 1
    norms = [[r["buckets"][k][0] for r in rows] for k in range(nb)]
    counts = [[r["buckets"][k][1] for r in rows] for k in range(nb)]
    per_token = [[n / c for n, c in zip(norms[k], counts[k]) if c > 0] for k in range(nb)]
    out = {"grad_norm_by_bucket": [mean_ci(x) for x in norms],
           "grad_norm_per_token_by_bucket": [mean_ci(x) for x in per_token],
           "tokens_by_bucket": [statistics.mean(c) for c in counts]}
    for v in VARIANTS:
        out[f"{v} pos_high_up"] = mean_ci([r[v]["pos_high_up"] for r in rows
                                           if r[v]["pos_high_up"] is not None])
    claims = {}
    for v in ("AR", "Lopti"):
        diffs = [r[v]["pos_high_up"] - r["GRPO"]["pos_high_up"] for r in rows
                 if r["GRPO"]["pos_high_up"] is not None]
        w, l, p = sign_test(diffs)
        m, h = mean_ci(diffs)
        claims[f"{v} - GRPO, share of positive high-p tokens moving up"] = dict(
            mean=m, ci95=h, wins=w, losses=l, p=p,
            verdict=sign_verdict(w, l, p))
    out["claims"] = claims
    return out


def run(batches, args, log=print):
    model, tok, task, targs, rng = fixed_setup(args, args.prompts)
    model.eval()
    rows = []
    for b in range(batches):
        roll = gt.rollout(model, model, task, tok, targs, rng)
        model.eval()
        rows.append(measure_batch(model, roll, args))
        if (b + 1) % 10 == 0:
            log(f"{b + 1} batches")
    return dict(batches=len(rows), summary=summarise(rows), rows=rows, settings=vars(args))


# the paper's loss settings (clip 0.2/0.24, dual clip 10, low-variance KL 0.001, alpha 0.3,
# eta 0.5); the temperature is the demo's 3, not the paper's 0.7 (module docstring)
PAPER_LOSS = ["--epsilon-low", "0.2", "--epsilon-high", "0.24", "--dual-clip", "10",
              "--kl-coef", "0.001", "--kl-estimator", "low_var_kl"]
ACCURACY_VARIANTS = {"GRPO": [], "AR": ["--ar-alpha", "0.3"], "Lopti": ["--lopti-eta", "0.5"]}


def accuracy_runs(seeds, out, quick=False, log=print):
    """GRPO / +AR / +Lopti training runs from the shipped checkpoint (the demo's task and
    temperature, the paper's loss settings), one per seed and variant; returns and writes
    ``<out>/balance_accuracy_<first seed>.json``."""
    rows = []
    for seed in seeds:
        for name, extra in ACCURACY_VARIANTS.items():
            argv = ["--seed", str(seed), "--quiet", "--out",
                    os.path.join(out, "runs", f"{name}-{seed}")] + PAPER_LOSS + extra
            if quick:
                argv += ["--steps", "2", "--prompts", "2", "--group", "4", "--eval-size", "8"]
            final = gt.train(gt.build_args(argv), log=lambda *a: None)[-1]
            rows.append(dict(seed=seed, variant=name, sampled_before=final["eval_sampled_before"],
                             sampled_after=final["eval_sampled_after"],
                             greedy_after=final["eval_after"]))
            log(f"seed {seed} {name}: sampled {final['eval_sampled_before']:.3f} -> "
                f"{final['eval_sampled_after']:.3f}")
    path = os.path.join(out, f"balance_accuracy_{seeds[0]}.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def accuracy_summary(rows):
    """Paired over seeds: AR - GRPO and Lopti - GRPO of the sampled accuracy after RL."""
    by = {(r["seed"], r["variant"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    out = {"seeds": seeds}
    for v in ACCURACY_VARIANTS:
        out[v] = mean_ci([by[s, v]["sampled_after"] for s in seeds if (s, v) in by])
    for v in ("AR", "Lopti"):
        diffs = [by[s, v]["sampled_after"] - by[s, "GRPO"]["sampled_after"] for s in seeds
                 if (s, v) in by and (s, "GRPO") in by]
        call, m, h = verdict(diffs, +1)
        w, l, p = sign_test(diffs)
        out[f"{v} - GRPO"] = dict(mean=m, ci95=h, wins=w, losses=l, p=p, seeds=len(diffs),
                                  verdict=call)
    return out


def plot(res, accuracy_rows, path, control=None):
    """Fig. 1(d): the parameter-gradient norm per p_old bucket; Fig. 3: the share of positive
    high-probability tokens that move up after one SGD step, per variant (mean ± 95%
    interval over batches); and, given the training runs, the sampled accuracy after RL per
    seed (``control``: {seed: accuracy} of GRPO at twice the learning rate)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = res["summary"]
    fig, axes = plt.subplots(1, 3 if accuracy_rows else 2, figsize=(16 if accuracy_rows else 11,
                                                                   3.8))
    labels = [f"[{lo:g}, {min(hi, 1):g})" for lo, hi in zip(EDGES[:-1], EDGES[1:])]
    m, h = zip(*s["grad_norm_by_bucket"])
    axes[0].bar(labels, m, yerr=h, color="C0", capsize=3)
    axes[0].set_title("Fig. 1(d): parameter-gradient norm, one p_old bucket's tokens",
                      fontsize=9)
    for i, v in enumerate(VARIANTS):
        mv, hv = s[f"{v} pos_high_up"]
        axes[1].errorbar([i], [mv], yerr=[hv], fmt="o", color=f"C{i}", capsize=4)
    axes[1].set_xticks(range(len(VARIANTS)))
    axes[1].set_xticklabels(VARIANTS)
    axes[1].set_title(f"Fig. 3: positive tokens with p_old > {HIGH} that move up", fontsize=9)
    if accuracy_rows:
        ax = axes[2]
        seeds = sorted({r["seed"] for r in accuracy_rows})
        series = {v: {r["seed"]: r["sampled_after"] for r in accuracy_rows if r["variant"] == v}
                  for v in ACCURACY_VARIANTS}
        if control:
            series["GRPO, lr x2"] = {int(k): float(v) for k, v in control.items()}
        for i, (v, by) in enumerate(series.items()):
            ax.plot(seeds, [by.get(sd, float("nan")) for sd in seeds], "o-", color=f"C{i}",
                    label=v, lw=0.8)
        ax.set_xlabel("seed")
        ax.set_title("sampled accuracy after 150 RL steps", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def replot(out):
    """balance.png again from the JSON files in ``out``."""
    import glob
    res = json.load(open(os.path.join(out, "balance.json")))
    rows = [r for f in sorted(glob.glob(os.path.join(out, "balance_accuracy_[0-9]*.json")))
            for r in json.load(open(f))]
    ctrl = os.path.join(out, "balance_accuracy_control_grpo_lr2x.json")
    plot(res, rows, os.path.join(out, "balance.png"),
         json.load(open(ctrl)) if os.path.exists(ctrl) else None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 batches (the test suite)")
    ap.add_argument("--accuracy", default=None, metavar="SEEDS",
                    help="instead: GRPO / +AR / +Lopti training runs for these comma-separated "
                         "seeds (the paper's loss settings), then the paired summary over every "
                         "balance_accuracy_<seed>.json in the output folder")
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--ar-alpha", type=float, default=0.3)
    ap.add_argument("--lopti-eta", type=float, default=0.5)
    fixed_options(ap)
    args = ap.parse_args(argv)
    batches = 2 if args.quick else args.batches
    out = output_dir(args)
    if args.accuracy is not None:
        import glob
        seeds = [int(x) for x in args.accuracy.split(",") if x.strip()]
        if seeds:            # none: only the summary of the runs already there
            accuracy_runs(seeds, out, args.quick)
        rows = [r for f in sorted(glob.glob(os.path.join(out, "balance_accuracy_[0-9]*.json")))
                for r in json.load(open(f))]
        summary = accuracy_summary(rows)
        print(json.dumps(summary, indent=1))
        return summary
    res = run(batches, args)
    with open(os.path.join(out, "balance.json"), "w") as f:
        json.dump(res, f, indent=1)
    replot(out)
    s = res["summary"]
    print(f"{res['batches']} batches; per p_old bucket {EDGES[:-1]}..: tokens "
          f"{[round(x, 1) for x in s['tokens_by_bucket']]}")
    print("  parameter-gradient norm:   " +
          ", ".join(f"{m:.4f} ± {h:.4f}" for m, h in s["grad_norm_by_bucket"]))
    print("  the same per token:        " +
          ", ".join(f"{m:.2e} ± {h:.1e}" for m, h in s["grad_norm_per_token_by_bucket"]))
    for v in VARIANTS:
        m, h = s[f"{v} pos_high_up"]
        print(f"  {v:6s} share of positive-advantage p_old > {HIGH} tokens moving up: "
              f"{m:.3f} ± {h:.3f}")
    for k, c in s["claims"].items():
        print(f"  {k}: {c['mean']:+.3f} ± {c['ci95']:.3f}, {c['wins']} wins / {c['losses']} "
              f"losses, sign test p = {c['p']:.3g}: {c['verdict']}")
    return res


if __name__ == "__main__":
    main()
