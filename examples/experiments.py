"""The papers' experiments at small scale, in the papers' own protocols, from shipped checkpoints
(every machine starts from the same weights). docs/experiments.md reports them.

    python examples/experiments.py critical-kl  [--quick] [--seeds 0,...,9] [--jobs 2]  # ~35 min
    python examples/experiments.py calibrate    [--quick] [--seeds 0,1,2] [--jobs 2]    # ~11 min
    python examples/experiments.py displacement [--quick]    # NTHR (examples/displacement.py)
    python examples/experiments.py balance      [--quick]    # AR/Lopti (examples/balance.py)
    python examples/experiments.py all          [--quick]
    python examples/experiments.py report                    # critical-kl's table and plot again

**critical-kl** (Vassoyan et al.'s prioritised KL). The checkpoint
``examples/checkpoints/scratchpad-carry3`` is the demo's scratchpad model pre-trained on sums of
1-3-digit operands of which only 0.1% carry out of their last column (the sum one digit longer
than both operands). RL samples only such sums: every answer holds one critical token, the
carry-out digit, where the pre-trained model is unsure, and is otherwise right. GRPO, 150 steps
of 16 prompts x 8, sampling and loss at temperature 2, k2 KL; per seed, from the same checkpoint:
no KL; uniform KL (coefficient ``KL_COEF``, calibrated by ``calibrate``: the smallest of
``CALIBRATION_COEFS`` that costs >= 10 points of accuracy against no KL); critical-token KL at
the same coefficient (each token's KL weighted by ``J**GAMMA``, J the reference's max-prob
certainty at temperature 4); critical-token KL at the matched coefficient (``variants``); and an
oracle control. Per run: sampled and greedy accuracy on the RL sums and on the checkpoint's own
sums (what the KL protects), the KL weights the updates applied at the decision token, and every
10 steps the probability of the right token at the critical position of 64 fixed probe sums.
Results: ``<out>/critical_kl.json``, ``critical-kl.png``.

``--quick`` (the test suite) runs 3 steps of 4 x 4 per variant and writes to runs/experiments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gbc_kernels as gbc                          # noqa: E402
import grpo_trainer as gt                          # noqa: E402
import pretrain_scratchpad as ps                   # noqa: E402
from gbc_kernels.integrations import hf            # noqa: E402
from grpo_tasks import ScratchpadAdditionTask, ScratchpadTokenizer   # noqa: E402

CHECKPOINT = os.path.join(HERE, "checkpoints", "scratchpad-carry3")
# the calibrated coefficient (``calibrate``) and the certainty exponent (module docstring)
KL_COEF = 1.0
GAMMA = 10.0
CALIBRATION_COEFS = (0.3, 1.0, 3.0, 10.0)


def variants(coef=KL_COEF, gamma=GAMMA, w_other=None) -> dict:
    """No KL, uniform KL, critical-token KL at the same coefficient (the paper's comparison)
    and, with ``w_other`` (the reference's mean weight on the answers' other tokens), critical
    KL at ``coef / w_other``: the same KL as uniform on an average ordinary token, less on the
    critical one; and the oracle: uniform KL with the weight 0 on the carry-out decision of each
    sampled answer (``carry_positions``), 1 elsewhere — the paper's mechanism with a perfect
    certainty signal."""
    out = {"no KL": dict(kl_coef=0.0),
           "uniform KL": dict(kl_coef=coef),
           "critical KL": dict(kl_coef=coef, critical_kl_exponent=gamma)}
    if w_other is not None:
        out["critical KL, matched"] = dict(kl_coef=coef / w_other, critical_kl_exponent=gamma)
    out["uniform KL, carry token free"] = dict(kl_coef=coef, free_carry=True)
    return out


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------

# two-sided 95% quantiles of Student's t, by degrees of freedom
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: int) -> float:
    if df <= 0:
        return float("nan")
    return _T975[max(k for k in _T975 if k <= df)] if df < 30 else 1.96 + 2.4 / df


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
    if claimed_sign * (m - h) > 0:
        return "reproduced", m, h
    if claimed_sign * (m + h) < 0:
        return "not reproduced", m, h
    return "inconclusive", m, h


def sign_test(diffs):
    """(wins, losses, two-sided p) of a paired sign test (ties dropped)."""
    w = sum(d > 0 for d in diffs)
    l = sum(d < 0 for d in diffs)
    n = w + l
    if n == 0:
        return w, l, 1.0
    k = min(w, l)
    p = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return w, l, min(1.0, 2 * p)


def sign_verdict(wins, losses, p):
    """A sign test's verdict on a claim that the wins win: reproduced / not reproduced at
    p < 0.05, inconclusive otherwise."""
    if p < 0.05 and wins != losses:
        return "reproduced" if wins > losses else "not reproduced"
    return "inconclusive"


# ---------------------------------------------------------------------------------------------
# the critical token
# ---------------------------------------------------------------------------------------------


def probe_set(tok, n=64, seed=4321, digits=3):
    """``n`` fixed sums that carry out, teacher-forced: (ids [n, L], attention mask, the index
    in ``ids`` of each row's first answer token, and of its critical token: the carry-out
    digit, one before EOS)."""
    task = ScratchpadAdditionTask(digits, tok, final_carry=True)
    ids, mask = task.sft_batch(n, random.Random(seed))    # mask: the positions predicting the
    pos = torch.arange(mask.shape[1])                      # answer and its EOS
    starts = mask.float().argmax(1) + 1
    critical = torch.where(mask, pos, -1).max(1).values    # the last one predicts EOS
    return ids, (ids != tok.PAD).long(), starts, critical


def _positions(probe):
    """Masks over the predicted tokens (index t - 1 predicts token t): the critical token, and
    the other answer tokens (EOS included)."""
    ids, _, starts, crit = probe
    t = torch.arange(1, ids.shape[1])[None, :]
    critical = t == crit[:, None]
    answer = (t >= starts[:, None]) & (t <= crit[:, None] + 1)
    return critical, answer & ~critical


@torch.no_grad()
def critical_probs(model, probe, temperature=1.0):
    """Mean probability of the right token at the critical position, and at the other answer
    positions, of the probe sums (from the fused log-probs: no full logits)."""
    ids, attn = probe[:2]
    was = model.training
    model.eval()
    head = hf.lm_head(model)
    logp, _ = gbc.fused_linear_logprobs(hf.completion_hidden(model, ids, attn), head.weight,
                                        ids[:, 1:], head.bias, temperature=temperature)
    model.train(was)
    p = logp.exp()
    critical, other = _positions(probe)
    return float(p[critical].mean()), float(p[other].mean())


@torch.no_grad()
def kl_weights(model, probe, gamma, temperature=4.0):
    """The critical-token KL weights ``J**gamma`` of the reference at the critical position
    and at the other answer positions of the probe sums, computed the way the trainer's
    reference pass computes them (``hf.reference_pass``: ``J_max_prob`` at ``temperature``)."""
    ids, attn = probe[:2]
    ref = hf.reference_pass(model, ids, attn, ids[:, 1:], critical_kl_exponent=gamma,
                            certainty="max_prob", certainty_temperature=temperature)
    critical, other = _positions(probe)
    return ref.kl_weight[critical].tolist(), ref.kl_weight[other].tolist()


def carry_positions(roll, tok):
    """Per row of a rollout, the index in ``roll["targets"]`` of the token that decides the
    carry-out in the sampled answer: ``max(len(a), len(b))`` tokens after the answer's second
    ``|`` (the sum's first digit beyond the operands' length, or EOS); -1 where the answer has
    no second ``|`` or ends before it."""
    mask, seq = roll["mask"], roll["seq"]
    if not mask.any():
        return [-1] * seq.shape[0]
    # the prompts are left-padded to one width: the first answer token of every row is at seq
    # index lp (a row whose answer starts with PAD has an empty mask there, so take any row's)
    lp = int(mask.any(0).float().argmax()) + 1
    bar = tok.encode("|")[0]
    out = []
    for i in range(seq.shape[0]):
        a, b = tok.decode(seq[i, :lp]).rstrip("=").split("+")
        comp = seq[i, lp:].tolist()
        bars = [k for k, t in enumerate(comp) if t == bar]
        t = -1
        if len(bars) >= 2:
            k = bars[1] + 1 + max(len(a), len(b))
            if lp - 1 + k < mask.shape[1] and mask[i, lp - 1 + k]:
                t = lp - 1 + k
        out.append(t)
    return out


class CriticalTokenHook:
    """Every ``every`` updates (and before the first), the probability of the right token at
    the probe sums' critical positions and elsewhere in their answers; per update, the mean KL
    weight the update applies at the sampled answers' carry decision and elsewhere. With
    ``free_carry`` (the oracle variant) it sets those weights first: 0 at the decision, 1
    elsewhere."""

    def __init__(self, probe, every=10, free_carry=False):
        self.probe, self.every, self.step, self.free_carry = probe, every, 0, free_carry
        self.tok = ScratchpadTokenizer()
        self.curve = []              # (step, p critical, p other)
        self.klw = []                # per update: (mean KL weight at the decision, elsewhere)

    def before(self, model, roll, args):
        if self.step == 0:
            self.curve.append((0, *critical_probs(model, self.probe)))
        if not self.free_carry and roll["kl_weight"] is None:
            return
        at = torch.zeros_like(roll["mask"])
        for i, t in enumerate(carry_positions(roll, self.tok)):
            if t >= 0:
                at[i, t] = True
        if self.free_carry:
            roll["kl_weight"] = (~at).float()
        w, rest = roll["kl_weight"], roll["mask"] & ~at
        self.klw.append((float(w[at].mean()) if at.any() else float("nan"),
                         float(w[rest].mean()) if rest.any() else float("nan")))

    def after(self, model, roll, args, state, metrics):
        self.step += 1
        if self.step % self.every == 0:
            self.curve.append((self.step, *critical_probs(model, self.probe)))
        return {}


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------


def base_args(quick, seed, out, checkpoint=None):
    argv = ["--checkpoint", checkpoint or CHECKPOINT, "--final-carry", "--temperature", "2",
            "--kl-estimator", "k2", "--critical-kl-certainty", "max_prob",
            "--critical-kl-temperature", "4", "--quiet", "--seed", str(seed), "--out", out]
    argv += (["--steps", "3", "--prompts", "4", "--group", "4", "--eval-size", "20"] if quick
             else ["--steps", "150", "--prompts", "16", "--group", "8", "--eval-size", "300"])
    return gt.build_args(argv)


def one_run(job):
    """One (variant, seed) RL run from the checkpoint: its record."""
    variant, over, seed, quick, checkpoint, runs = job
    torch.set_num_threads(1)           # one core per run; runs go in parallel (``--jobs``)
    t0 = time.time()
    out = os.path.join(runs, f"critical-kl-{variant}-{seed}".replace(" ", "_").replace(",", ""))
    a = base_args(quick, seed, out, checkpoint)
    for k, v in over.items():
        if k != "free_carry":
            setattr(a, k, v)
    tok, model, own, rl = gt.setup(a)
    hook = CriticalTokenHook(probe_set(tok, n=16 if quick else 64), every=1 if quick else 10,
                             free_carry=bool(over.get("free_carry")))
    hist = gt.train(a, log=lambda *_: None, model=model, tok=tok, tasks=(own, rl), hooks=hook)
    final = {k: v for k, v in hist[-1].items() if k.startswith("eval_")}
    steps = [h for h in hist if "step" in h]
    return dict(variant=variant, seed=seed, options=over, final=final,
                seconds=round(time.time() - t0),
                curves=dict(accuracy=[h["accuracy"] for h in steps],
                            kl=[h.get("kl", float("nan")) for h in steps],
                            probe_step=[c[0] for c in hook.curve],
                            p_critical=[c[1] for c in hook.curve],
                            p_other=[c[2] for c in hook.curve],
                            klw_decision=[k[0] for k in hook.klw],
                            klw_other=[k[1] for k in hook.klw]))


def run(variant_options, seeds, quick, out, log=print, checkpoint=None, jobs=1):
    """Every variant for every seed, from the same checkpoint, ``jobs`` runs at a time (each
    on one thread: the results do not depend on ``jobs``): a list of records. Each run's own
    metrics.jsonl and curves.png go to runs/experiment-runs/ (``<out>/runs`` with ``quick``)."""
    runs = os.path.join(out, "runs") if quick else os.path.join("runs", "experiment-runs")
    todo = [(v, over, seed, quick, checkpoint, runs) for seed in seeds
            for v, over in variant_options.items()]
    if jobs > 1:
        import multiprocessing as mp
        pool = mp.get_context("spawn").Pool(jobs)
        results = pool.imap(one_run, todo)
    else:
        pool, results = None, map(one_run, todo)
    records = []
    try:
        for r in results:
            f, c = r["final"], r["curves"]
            log(f"[critical-kl] seed {r['seed']} {r['variant']}: RL sums sampled "
                f"{f['eval_sampled_before']:.3f} -> {f['eval_sampled_after']:.3f}, own sums "
                f"sampled {f['eval_own_sampled_before']:.3f} -> "
                f"{f['eval_own_sampled_after']:.3f}, p(critical) {c['p_critical'][0]:.3f} -> "
                f"{c['p_critical'][-1]:.3f} ({r['seconds']} s)")
            records.append(r)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return records


# (metric, baseline, variant, the paper's claimed sign of variant - baseline)
CLAIMS = [
    ("eval_sampled_after", "no KL", "uniform KL", -1),          # the calibration's premise
    ("eval_sampled_after", "uniform KL", "critical KL", +1),    # the paper's claim
    ("eval_sampled_after", "uniform KL", "critical KL, matched", +1),
    ("eval_sampled_after", "uniform KL", "uniform KL, carry token free", +1),
    ("p_critical_after", "uniform KL", "critical KL, matched", +1),
    # what the KL protects: the checkpoint's own sums (greedy, then sampled)
    ("eval_own_greedy_after", "no KL", "uniform KL", +1),
    ("eval_own_greedy_after", "no KL", "critical KL", +1),
    ("eval_own_greedy_after", "no KL", "critical KL, matched", +1),
    ("eval_own_greedy_after", "no KL", "uniform KL, carry token free", +1),
    ("eval_own_sampled_after", "no KL", "uniform KL", +1),
    ("eval_own_sampled_after", "no KL", "critical KL, matched", +1),
]
METRICS = ["eval_sampled_after", "eval_after", "eval_own_sampled_after", "eval_own_greedy_after",
           "p_critical_after"]


def finals(r):
    f = dict(r["final"])
    f["p_critical_after"] = r["curves"]["p_critical"][-1]
    return f


def tables(records, names):
    """Markdown: mean ± 95% interval per variant, then the paired verdicts."""
    lines = [f"| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for k in METRICS + ["eval_sampled_before", "eval_own_sampled_before"]:
        cells = []
        for v in names:
            m, h = mean_ci([finals(r).get(k) for r in records if r["variant"] == v])
            cells.append(f"{m:.3f} ± {h:.3f}" if math.isfinite(h) else f"{m:.3f}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append("")
    for metric, base, var, sign in CLAIMS:
        if base not in names or var not in names:
            continue
        by_seed = {r["seed"]: finals(r)[metric] for r in records if r["variant"] == base}
        diffs = [finals(r)[metric] - by_seed[r["seed"]] for r in records
                 if r["variant"] == var and r["seed"] in by_seed]
        wins = sum(d * sign > 0 for d in diffs)
        v, m, h = verdict(diffs, sign)
        lines.append(f"- `{metric}`, {var} − {base} (claimed: {'+' if sign > 0 else '−'}): "
                     f"{m:+.3f} ± {h:.3f}, {wins}/{len(diffs)} seeds → **{v}**")
    return "\n".join(lines) + "\n"


def plot(records, names, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for i, v in enumerate(names):
        recs = [r for r in records if r["variant"] == v]
        if not recs:
            continue
        acc = [gt.smooth(r["curves"]["accuracy"], 10) for r in recs]
        T = min(map(len, acc))
        axes[0].plot([statistics.fmean(a[t] for a in acc) for t in range(T)], color=f"C{i}",
                     label=v)
        steps = recs[0]["curves"]["probe_step"]
        for key, ax in (("p_critical", axes[1]), ("p_other", axes[2])):
            cs = [r["curves"][key] for r in recs]
            n = min(map(len, cs))
            mean = [statistics.fmean(c[t] for c in cs) for t in range(n)]
            ax.plot(steps[:n], mean, color=f"C{i}", marker=".", label=v)
            ax.fill_between(steps[:n], [min(c[t] for c in cs) for t in range(n)],
                            [max(c[t] for c in cs) for t in range(n)], color=f"C{i}", alpha=0.15)
    axes[0].set_title("rollout accuracy (carry-out sums; mean over seeds)", fontsize=9)
    axes[1].set_title("p(right token) at the critical position (probe sums)", fontsize=9)
    axes[2].set_title("p(right token) at the other answer positions", fontsize=9)
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def rounded(x, digits=5):
    """``x`` with every float rounded to ``digits`` significant digits (a compact JSON)."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}") if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v, digits) for v in x]
    return x


def _save(out, name, payload):
    with open(os.path.join(out, name), "w") as f:
        json.dump(rounded(payload), f, indent=1)


def reference_weights(gamma=GAMMA):
    """The critical-token KL weights of the checkpoint on the probe sums: (critical, other)."""
    ref, tok, _ = ps.load(CHECKPOINT)
    return kl_weights(ref, probe_set(tok), gamma)


def critical_kl(seeds, quick, out, log=print, jobs=1, only=None):
    """Run the variants (``only``: those named) for ``seeds``; the records join those already
    in ``<out>/critical_kl.json`` (a rerun (variant, seed) replaces its old record)."""
    t0 = time.time()
    wc, wo = reference_weights()
    w_other = statistics.fmean(wo)
    opts = {k: v for k, v in variants(w_other=w_other).items() if not only or k in only}
    records = run(opts, seeds, quick, out, log, jobs=jobs)
    path = os.path.join(out, "critical_kl.json")
    if os.path.exists(path):
        new = {(r["variant"], r["seed"]) for r in records}
        records = [r for r in json.load(open(path))["records"]
                   if (r["variant"], r["seed"]) not in new] + records
    payload = dict(setting=dict(checkpoint=os.path.relpath(CHECKPOINT, os.path.dirname(HERE)),
                                kl_coef=KL_COEF, matched_kl_coef=KL_COEF / w_other,
                                gamma=GAMMA, certainty="max_prob",
                                certainty_temperature=4.0, temperature=2.0, estimator="k2",
                                seeds=sorted({r["seed"] for r in records}), quick=quick,
                                seconds=round(time.time() - t0)),
                   kl_weight_reference=dict(critical_mean=statistics.fmean(wc),
                                            other_mean=statistics.fmean(wo),
                                            other_below_0p5=sum(w < 0.5 for w in wo) / len(wo)),
                   records=records)
    _save(out, "critical_kl.json", payload)
    return report_critical(out)


def report_critical(out):
    payload = json.load(open(os.path.join(out, "critical_kl.json")))
    names = list(variants(w_other=1.0))
    plot(payload["records"], names, os.path.join(out, "critical-kl.png"))
    w = payload["kl_weight_reference"]
    md = (tables(payload["records"], names) +
          f"\nKL weight J^gamma of the reference on the probe sums: critical position "
          f"{w['critical_mean']:.3f}, other answer positions {w['other_mean']:.3f} "
          f"({100 * w['other_below_0p5']:.0f}% of them below 0.5)\n")
    print(md)
    return md


def calibrate(seeds, quick, out, log=print, jobs=1):
    """Uniform KL at each of ``CALIBRATION_COEFS`` against no KL: the accuracy it costs."""
    opts = {"no KL": dict(kl_coef=0.0)}
    opts.update({f"uniform KL {c:g}": dict(kl_coef=c) for c in CALIBRATION_COEFS})
    records = run(opts, seeds, quick, out, log, jobs=jobs)
    base = {r["seed"]: r["final"]["eval_sampled_after"] for r in records
            if r["variant"] == "no KL"}
    lines = []
    for name in opts:
        if name == "no KL":
            continue
        diffs = [r["final"]["eval_sampled_after"] - base[r["seed"]] for r in records
                 if r["variant"] == name]
        m, h = mean_ci(diffs)
        lines.append(f"- {name}: sampled accuracy − no KL = {m:+.3f} ± {h:.3f} "
                     f"({len(diffs)} seeds)")
    _save(out, "critical_kl_calibration.json", dict(seeds=seeds, quick=quick, records=records))
    md = "\n".join(lines) + "\n"
    print(md)
    return md


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment",
                    choices=["critical-kl", "calibrate", "displacement", "balance", "all",
                             "report"])
    ap.add_argument("--quick", action="store_true",
                    help="a few steps per run (minutes): checks the pipeline, not the claims")
    ap.add_argument("--seeds", default=None,
                    help="comma-separated seeds (default 0-9; 0-2 for calibrate; 0 with --quick)")
    ap.add_argument("--out", default=None,
                    help="output folder (default: docs/experiments, runs/experiments with "
                         "--quick)")
    ap.add_argument("--variants", default=None,
                    help="critical-kl: only these variants, separated by ';' (default: all)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="RL runs at a time, one thread each (2 on a 2-core machine)")
    args = ap.parse_args(argv)
    out = args.out or ("runs/experiments" if args.quick else "docs/experiments")
    os.makedirs(out, exist_ok=True)
    default = "0" if args.quick else ("0,1,2" if args.experiment == "calibrate"
                                      else ",".join(map(str, range(10))))
    seeds = [int(s) for s in (args.seeds or default).split(",")]
    extra = ["--quick"] if args.quick else []
    if args.out:
        extra += ["--out", args.out]
    if args.experiment == "report":
        return report_critical(out)
    if args.experiment == "calibrate":
        return calibrate(seeds, args.quick, out, jobs=args.jobs)
    md = None
    if args.experiment in ("critical-kl", "all"):
        md = critical_kl(seeds, args.quick, out, jobs=args.jobs,
                         only=args.variants.split(";") if args.variants else None)
    if args.experiment in ("displacement", "all"):
        import displacement
        displacement.main(extra)
    if args.experiment in ("balance", "all"):
        import balance
        balance.main(extra)
    return md


if __name__ == "__main__":
    main()
