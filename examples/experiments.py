"""The three papers' mechanisms, measured at small scale with the example trainer.

    python examples/experiments.py critical-kl   [--quick] [--seeds 0,1,2,3,4]
    python examples/experiments.py critical-kl-strong   [--quick] [--seeds ...]
    python examples/experiments.py nthr          [--quick] [--seeds ...]
    python examples/experiments.py balance       [--quick] [--seeds ...]
    python examples/experiments.py all           [--quick]

Every run: a tiny Qwen2 learns 1-digit sums by a supervised warm-up (shared by the variants of a
seed), then GRPO on 2-digit sums (examples/grpo_trainer.py, imported, with a measurement hook
around each update). Per seed and variant the final metrics and the curves go to
``<out>/results.json`` (one entry per experiment, variant and seed), plots to ``<out>/*.png``.
The full mode writes to docs/experiments/ (docs/experiments.md reads them); ``--quick`` (a few
minutes, for the test suite) to runs/experiments/.

1. critical-kl (KL coefficient 0.1) and critical-kl-strong (1.0): no KL vs uniform KL vs
   critical-token KL (certainty max_prob and entropy), the KL weight on the carry-or-EOS
   decision token (the one a 1-digit model has never had to make) against the other answer
   tokens.
2. nthr: likelihood displacement measured directly: per step, the change of the summed
   log-likelihood of the batch's correct responses caused by that step's update (same batch,
   before vs after), for GRPO and GRPO + NTHR.
3. balance: the logit-gradient norm of the loss by p_old bucket (the AR/Lopti paper's first
   observation) and, per step, whether the high-probability tokens' probabilities move in the
   direction of their advantage, for GRPO, +AR and +Lopti.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import grpo_trainer as gt                          # noqa: E402
import gbc_kernels as gbc                          # noqa: E402
from gbc_kernels.integrations import hf            # noqa: E402

# p_old buckets of the balance experiment
BUCKETS = (0.0, 0.25, 0.5, 0.75, 1.0001)
HIGH_P = 0.75

def _kl_variants(coef: float) -> dict:
    """No KL, uniform KL at ``coef``, critical-token KL at ``coef`` (gamma 150, both
    certainty kinds); every run uses the k2 estimator (``base_args``)."""
    critical = dict(kl_coef=coef, critical_kl_exponent=150.0)
    return {"no KL": dict(kl_coef=0.0), "uniform KL": dict(kl_coef=coef),
            "critical KL (max_prob)": dict(critical, critical_kl_certainty="max_prob"),
            "critical KL (entropy)": dict(critical, critical_kl_certainty="entropy")}


# experiment -> {variant: the options it changes}
EXPERIMENTS = {
    "critical-kl": _kl_variants(0.1),
    # the same with a KL penalty strong enough to hold RL back
    "critical-kl-strong": _kl_variants(1.0),
    "nthr": {"GRPO": dict(), "GRPO + NTHR": dict(nthr=True)},
    "balance": {"GRPO": dict(), "+AR": dict(ar_alpha=0.3), "+Lopti": dict(lopti_eta=0.5)},
}


# ---------------------------------------------------------------------------------------------
# measurement hooks (grpo_trainer.train calls before/after around every update)
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def token_logp(model, roll, temperature):
    """log p of every target token under ``model`` now, [B, T] (0 off the mask)."""
    head = hf.lm_head(model)
    h = hf.completion_hidden(model, roll["seq"], roll["attn"])
    logp, _ = gbc.fused_linear_logprobs(h, head.weight, roll["targets"], head.bias,
                                        temperature=temperature)
    return torch.where(roll["mask"], logp, torch.zeros_like(logp))


class CriticalKLHook:
    """The KL weight on the carry-or-EOS decision token vs the other answer tokens."""

    def __init__(self, digits):
        self.decision = digits          # answer index of the carry digit / EOS decision
        self.weights = {"decision": [], "other": []}

    def before(self, model, roll, args):
        return None

    def after(self, model, roll, args, state, metrics):
        w = roll["kl_weight"]
        if w is None:
            return {}
        mask = roll["mask"]
        start = int(mask.float().argmax(1).min())      # the first completion position
        pos = torch.arange(mask.shape[1]) - start
        dec = mask & (pos == self.decision)[None, :]
        other = mask & ~dec
        self.weights["decision"] += w[dec].tolist()
        self.weights["other"] += w[other].tolist()
        return {"klw_decision": float(w[dec].mean()) if dec.any() else float("nan"),
                "klw_other": float(w[other].mean()) if other.any() else float("nan")}


class DisplacementHook:
    """Change of the summed log-likelihood of the batch's correct responses by one update."""

    def before(self, model, roll, args):
        return token_logp(model, roll, args.temperature)

    def after(self, model, roll, args, state, metrics):
        correct = roll["correct"]
        if not correct.any():
            return {"ll_correct_delta": float("nan"), "n_correct": 0}
        now = token_logp(model, roll, args.temperature)
        rows = correct.nonzero()[:, 0]
        delta = float((now[rows] - state[rows]).sum())
        return {"ll_correct_delta": delta, "n_correct": int(rows.numel())}


class BalanceHook:
    """Per step: the share of the loss's logit-gradient norm (and of the tokens) in each p_old
    bucket, at the parameters before the update; after it, the share of high-probability
    tokens whose probability moved in the direction of their advantage."""

    def before(self, model, roll, args):
        head = hf.lm_head(model)
        with torch.no_grad():
            h = hf.completion_hidden(model, roll["seq"], roll["attn"])
            z0 = h @ head.weight.T + (0 if head.bias is None else head.bias)
        z = z0.detach().requires_grad_(True)
        logp = torch.log_softmax(z / args.temperature, -1).gather(
            -1, roll["targets"].unsqueeze(-1)).squeeze(-1)
        # the loss of this variant without Lopti's phase split: per token, Lopti's two phases
        # together apply exactly this gradient (each token in one phase)
        cfg = gt.loss_config(args, gbc)
        cfg = gbc.PolicyLossConfig(**{**cfg.__dict__, "lopti_eta": None})
        loss, _ = gbc.policy_loss(logp, roll["mask"], roll["adv"], roll["old_logp"],
                                  roll["ref_logp"], token_scale=roll["token_scale"],
                                  kl_weight=roll["kl_weight"], config=cfg)
        (gz,) = torch.autograd.grad(loss, z)
        norm = gz.norm(dim=-1)                                  # per token
        return {"norm": norm, "logp": token_logp(model, roll, args.temperature)}

    def after(self, model, roll, args, state, metrics):
        mask = roll["mask"]
        p_old = roll["old_logp"].exp()
        norm = state["norm"]
        out = {}
        total = float(norm[mask].sum()) or 1.0
        for lo, hi in zip(BUCKETS[:-1], BUCKETS[1:]):
            sel = mask & (p_old >= lo) & (p_old < hi)
            key = f"{lo:.2f}-{min(hi, 1.0):.2f}"
            out[f"grad_share[{key}]"] = float(norm[sel].sum()) / total
            out[f"token_share[{key}]"] = float(sel.sum()) / max(1, int(mask.sum()))
        now = token_logp(model, roll, args.temperature)
        dp = now.exp() - state["logp"].exp()
        adv = roll["adv"][:, None].expand_as(dp)
        high = mask & (p_old >= HIGH_P) & (adv != 0)
        if high.any():
            right = (torch.sign(dp[high]) == torch.sign(adv[high])).float().mean()
            out["high_right_direction"] = float(right)
            out["high_dp_signed"] = float((dp[high] * torch.sign(adv[high])).mean())
        else:
            out["high_right_direction"] = out["high_dp_signed"] = float("nan")
        return out


def make_hook(name, args):
    if name.startswith("critical-kl"):
        return CriticalKLHook(args.digits + 1)
    return DisplacementHook() if name == "nthr" else BalanceHook()


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------

# two-sided 95% quantiles of Student's t, by degrees of freedom
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: int) -> float:
    if df <= 0:
        return float("nan")
    keys = sorted(_T975)
    return _T975[max(k for k in keys if k <= df)] if df < 30 else 1.96 + 2.4 / df


def mean_ci(xs):
    """(mean, half-width of the 95% t interval) over the finite values of ``xs``."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return float("nan"), float("nan")
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def verdict(diffs, claimed_sign):
    """Paired differences (variant - baseline) over seeds against the paper's claimed sign:
    reproduced when the 95% interval excludes 0 on the claimed side, not reproduced when it
    excludes 0 on the other, inconclusive otherwise."""
    m, h = mean_ci(diffs)
    if not math.isfinite(h):
        return "inconclusive", m, h
    if claimed_sign * (m - h) > 0 and claimed_sign * (m + h) > 0:
        return "reproduced", m, h
    if claimed_sign * (m - h) < 0 and claimed_sign * (m + h) < 0:
        return "not reproduced", m, h
    return "inconclusive", m, h


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------


def base_args(quick, seed, out):
    argv = ["--task", "add", "--quiet", "--seed", str(seed), "--out", out,
            "--kl-estimator", "k2"]
    if quick:
        argv += ["--sft-steps", "60", "--steps", "3", "--prompts", "4", "--group", "4",
                 "--eval-size", "20"]
    else:
        argv += ["--sft-steps", "1500", "--steps", "200", "--prompts", "16", "--group", "8",
                 "--eval-size", "300"]
    return gt.build_args(argv)


def summarise(name, hist, hook):
    """The per-seed record: final metrics and curves."""
    steps = [h for h in hist if "step" in h]
    ev = hist[-1]
    curves = {k: [h.get(k) for h in steps] for k in steps[0] if k not in ("step", "seconds")}
    final = {k: ev[k] for k in ("eval_before", "eval_after", "eval_sampled_before",
                                "eval_sampled_after") if k in ev}
    for k, xs in curves.items():
        vals = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
        if vals:
            final[f"mean_{k}"] = statistics.fmean(vals)
    if name == "nthr":
        d = [x for x in curves.get("ll_correct_delta", []) if x is not None and math.isfinite(x)]
        final["displaced_share"] = sum(x < 0 for x in d) / len(d) if d else float("nan")
    if isinstance(hook, CriticalKLHook):
        for part, ws in hook.weights.items():
            if ws:
                s = sorted(ws)
                final[f"klw_{part}_median"] = s[len(s) // 2]
                final[f"klw_{part}_below_0.5"] = sum(w < 0.5 for w in s) / len(s)
                final[f"klw_{part}_hist"] = [sum(lo <= w < lo + 0.1 for w in s) / len(s)
                                             for lo in [i / 10 for i in range(10)]]
    return final, curves


def run_experiment(name, seeds, quick, out, log=print):
    variants = EXPERIMENTS[name]
    records = []
    # each run's own metrics.jsonl / curves.png: beside a quick run's results, else under runs/
    # (untracked), not in docs/
    runs = os.path.join(out, "runs") if quick else os.path.join("runs", "experiment-runs")
    for seed in seeds:
        t0 = time.time()
        a0 = base_args(quick, seed, os.path.join(runs, f"{name}-sft-{seed}"))
        tok, model0, sft_task, rl_task = gt.setup(a0)
        gt.sft(model0, sft_task, a0, lambda *_: None, harder=rl_task)
        for variant, over in variants.items():
            a = copy.copy(a0)
            for k, v in over.items():
                setattr(a, k, v)
            a.out = os.path.join(runs, f"{name}-{variant}-{seed}".replace(" ", "_"))
            hook = make_hook(name, a)
            hist = gt.train(a, log=lambda *_: None, model=copy.deepcopy(model0), tok=tok,
                            tasks=(sft_task, rl_task), hooks=hook)
            final, curves = summarise(name, hist, hook)
            records.append(dict(experiment=name, variant=variant, seed=seed, final=final,
                                curves=curves))
            log(f"[{name}] seed {seed} {variant}: greedy {final.get('eval_after', 0):.3f}, "
                f"sampled {final.get('eval_sampled_after', 0):.3f} "
                f"({time.time() - t0:.0f} s so far)")
    return records


# ---------------------------------------------------------------------------------------------
# tables, verdicts and plots
# ---------------------------------------------------------------------------------------------

# (experiment, metric, baseline variant, variant, the paper's claimed sign of variant - baseline)
CLAIMS = [
    ("critical-kl", "eval_sampled_after", "uniform KL", "critical KL (max_prob)", +1),
    ("critical-kl", "eval_sampled_after", "uniform KL", "critical KL (entropy)", +1),
    ("critical-kl-strong", "eval_sampled_after", "no KL", "uniform KL", -1),
    ("critical-kl-strong", "eval_sampled_after", "uniform KL", "critical KL (max_prob)", +1),
    ("critical-kl-strong", "eval_sampled_after", "uniform KL", "critical KL (entropy)", +1),
    ("nthr", "displaced_share", "GRPO", "GRPO + NTHR", -1),
    ("nthr", "mean_ll_correct_delta", "GRPO", "GRPO + NTHR", +1),
    ("nthr", "eval_sampled_after", "GRPO", "GRPO + NTHR", +1),
    ("balance", "mean_high_right_direction", "GRPO", "+Lopti", +1),
    ("balance", "mean_high_right_direction", "GRPO", "+AR", +1),
    ("balance", "eval_sampled_after", "GRPO", "+AR", +1),
    ("balance", "eval_sampled_after", "GRPO", "+Lopti", +1),
]


# (experiment, variant, metric a, metric b, claimed sign of a - b): within-run observations
OBSERVATIONS = [
    ("balance", "GRPO", "mean_grad_share[0.00-0.25]", "mean_token_share[0.00-0.25]", +1),
]


def tables(records):
    """Markdown: per experiment, mean ± 95% interval over seeds of the final metrics, and the
    paired verdicts of CLAIMS."""
    lines = []
    for name in EXPERIMENTS:
        recs = [r for r in records if r["experiment"] == name]
        if not recs:
            continue
        keys = sorted({k for r in recs for k, v in r["final"].items()
                       if isinstance(v, (int, float))})
        lines.append(f"### {name} ({len({r['seed'] for r in recs})} seeds)\n")
        lines.append("| metric | " + " | ".join(EXPERIMENTS[name]) + " |")
        lines.append("|---|" + "---|" * len(EXPERIMENTS[name]))
        for k in keys:
            cells = []
            for v in EXPERIMENTS[name]:
                m, h = mean_ci([r["final"].get(k) for r in recs if r["variant"] == v])
                cells.append(f"{m:.4g} ± {h:.2g}" if math.isfinite(h) else f"{m:.4g}")
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines.append("")
        for exp, metric, base, var, sign in CLAIMS:
            if exp != name:
                continue
            by_seed = {r["seed"]: r["final"].get(metric) for r in recs if r["variant"] == base}
            diffs = [r["final"].get(metric) - by_seed[r["seed"]] for r in recs
                     if r["variant"] == var and by_seed.get(r["seed"]) is not None
                     and r["final"].get(metric) is not None]
            v, m, h = verdict(diffs, sign)
            lines.append(f"- `{metric}`, {var} − {base} (paper: {'+' if sign > 0 else '−'}): "
                         f"{m:+.4g} ± {h:.2g} over {len(diffs)} seeds → **{v}**")
        for exp, var, a, b, sign in OBSERVATIONS:
            if exp != name:
                continue
            diffs = [r["final"][a] - r["final"][b] for r in recs if r["variant"] == var
                     and r["final"].get(a) is not None and r["final"].get(b) is not None]
            v, m, h = verdict(diffs, sign)
            lines.append(f"- {var}: `{a}` − `{b}` (paper: {'+' if sign > 0 else '−'}): "
                         f"{m:+.4g} ± {h:.2g} over {len(diffs)} seeds → **{v}**")
        lines.append("")
    return "\n".join(lines)


def _smooth_finite(xs, k):
    """Trailing mean over the last ``k`` steps, of the finite values only (a step without a
    measurement, e.g. no high-probability token, is NaN)."""
    out = []
    for i in range(len(xs)):
        w = [x for x in xs[max(0, i - k + 1):i + 1] if math.isfinite(x)]
        out.append(statistics.fmean(w) if w else float("nan"))
    return out


def plot(records, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = {"critical-kl": ["accuracy", "kl"], "critical-kl-strong": ["accuracy", "kl"],
              "nthr": ["accuracy", "ll_correct_delta"],
              "balance": ["accuracy", "high_right_direction"]}
    for name, keys in panels.items():
        recs = [r for r in records if r["experiment"] == name]
        if not recs:
            continue
        fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 3.8))
        for ax, key in zip(axes, keys):
            for i, v in enumerate(EXPERIMENTS[name]):
                cs = [r["curves"].get(key) for r in recs if r["variant"] == v]
                cs = [[x if x is not None and math.isfinite(x) else float("nan") for x in c]
                      for c in cs if c]
                if not cs:
                    continue
                T = min(map(len, cs))
                sm = [_smooth_finite(c[:T], 10) for c in cs]
                cols = [[s[t] for s in sm if math.isfinite(s[t])] for t in range(T)]
                nan = float("nan")
                mean = [statistics.fmean(c) if c else nan for c in cols]
                lo = [min(c) if c else nan for c in cols]
                hi = [max(c) if c else nan for c in cols]
                ax.plot(mean, color=f"C{i}", label=v)
                ax.fill_between(range(T), lo, hi, color=f"C{i}", alpha=0.15)
            ax.set_xlabel("RL step")
            ax.set_title(f"{key} (smoothed; band: min-max over seeds)", fontsize=9)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"{name}.png"), dpi=100)
        plt.close(fig)
    recs = [r for r in records if r["experiment"] == "critical-kl" and
            "klw_decision_hist" in r["final"]]          # the weights do not depend on the coefficient
    if recs:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        for ax, v in zip(axes, ["critical KL (max_prob)", "critical KL (entropy)"]):
            for part, c in (("decision", "C3"), ("other", "C0")):
                hs = [r["final"][f"klw_{part}_hist"] for r in recs if r["variant"] == v
                      and f"klw_{part}_hist" in r["final"]]
                if hs:
                    mean = [statistics.fmean(h[i] for h in hs) for i in range(10)]
                    ax.bar([i / 10 + (0.05 if part == "other" else 0) for i in range(10)], mean,
                           width=0.05, color=c, label=f"{part} tokens")
            ax.set_title(f"{v}: KL weight distribution", fontsize=9)
            ax.set_xlabel("w_kl = J^150")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "critical-kl-weights.png"), dpi=100)
        plt.close(fig)


def rounded(x, digits=5):
    """``x`` with every float rounded to ``digits`` significant digits (a compact results.json)."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}") if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v, digits) for v in x]
    return x


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=list(EXPERIMENTS) + ["all", "report"],
                    help="which experiment (all: the three; report: only the plots and tables "
                         "from the results.json in --out)")
    ap.add_argument("--quick", action="store_true",
                    help="a few steps per run (minutes): checks the pipeline, not the claims")
    ap.add_argument("--seeds", default=None,
                    help="comma-separated seeds (default: 0-4, or 0 with --quick)")
    ap.add_argument("--out", default=None,
                    help="output folder (default: docs/experiments, runs/experiments with "
                         "--quick)")
    args = ap.parse_args(argv)
    out = args.out or ("runs/experiments" if args.quick else "docs/experiments")
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2,3,4")).split(",")]
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "results.json")
    names = {"all": list(EXPERIMENTS), "report": []}.get(args.experiment, [args.experiment])
    records = json.load(open(path)) if os.path.exists(path) else []
    for name in names:
        t0 = time.time()
        new = run_experiment(name, seeds, args.quick, out)
        records = [r for r in records if not (r["experiment"] == name and r["seed"] in seeds)]
        records += new
        seconds = time.time() - t0
        for r in new:
            r["experiment_seconds"] = round(seconds)
        print(f"[{name}] {len(seeds)} seed(s) in {seconds:.0f} s", flush=True)
        with open(path, "w") as f:
            json.dump(rounded(records), f)
    plot(records, out)
    md = tables(records)
    with open(os.path.join(out, "tables.md"), "w") as f:
        f.write(md)
    print(md)
    return records


if __name__ == "__main__":
    main()
