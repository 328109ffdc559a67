"""What each gradient-balance method costs inside verl 0.9.1's FSDP2 engine with gbc's engine,
OpenRLHF 0.11.2's flow with gbc's drop-in and TRL's GBCGRPOTrainer, relative to a plain step of
the same trainer (CPU, one process).

    python benchmarks/bench_methods_price.py            # V = 32,768 and 151,936, every trainer
    python benchmarks/bench_methods_price.py --V 32768 --reps 3 --trainers openrlhf
    python benchmarks/bench_methods_price.py --table     # the table again, from the CSV

The model: a tiny Qwen2 (hidden 256, 2 layers, untied head); the batch: 8 sequences (2 groups of
4 with verl's ``uid``), prompts up to 32 tokens, responses up to 224 (about 900 response tokens
in all), GRPO advantages, ``use_kl_loss`` on (low_var_kl), verl's AdamW. A step is what the
actor's side of verl's trainer runs per batch: the old-log-prob pass (``compute_log_prob``
through gbc's wrapper of verl's ``TrainingWorker.infer_batch``), the reference pass (a second
engine, the reference model), and the update (gbc's wrapper of ``train_mini_batch`` around the
engine's ``train_batch``: forward, backward, optimizer step; one mini-batch of 2 micro-batches).

Methods (each a step with that option on; the same engine, its options switched):
- ``plain``: no method;
- ``ar``: ``ar_alpha=0.3``;
- ``critical_kl``: ``critical_kl_exponent=1.0`` (the reference pass also gives the weights);
- ``nthr``: NTHR's inputs kept from the old-log-prob pass (no second forward);
- ``nthr_second_forward``: NTHR as verl runs it where it skips the old-log-prob pass (bypass
  mode) and as gbc ran it before: its own no-grad forward before the update;
- ``lopti``: ``lopti_eta=0.5``, two updates; its row compares the update alone (target 2.0x).

OpenRLHF (``--trainers openrlhf``, :func:`child_time_openrlhf`): the same model and batch
sizes, samples as OpenRLHF's generator makes them; a step is the experience maker's actor
pass, the reference pass and the update (``nthr_pass`` and ``training_step`` on 2
micro-batches of 4, each an AdamW step). ``nthr``: NTHR's inputs kept from the experience
maker's actor pass; ``nthr_second_forward``: that pass keeps nothing and ``nthr_pass`` runs its
own forward (what ran before).

Time: the process's CPU time (``time.process_time``; one thread: the work itself, not the
waits of a CPU shared with other jobs), median of ``--reps`` repetitions, the methods' order
reversed every other repetition; the wall-clock step is in the CSV too (``wall_step_s``).
Writes benchmarks/results/methods_price.csv and methods_price.md (the table of docs/methods.md).
verl registers its engines for cuda/npu only: on CPU the engines are built directly, with the
CPU platform of tests/standins/verl_cpu_platform.py (tests/test_verl_engine.py says what is
bypassed).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

from _common import append_rows, now, run_child  # noqa: E402
from bench_verl import _setup  # noqa: E402  (gloo rank, verl on CPU)

ROOT = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")
METHODS = {"plain": {}, "ar": {"ar_alpha": 0.3}, "critical_kl": {"critical_kl_exponent": 1.0},
           "nthr": {"nthr": True}, "nthr_second_forward": {"nthr": True},
           "lopti": {"lopti_eta": 0.5}}
# target: (what is compared, limit)
TARGETS = {"ar": ("step", 0.01), "critical_kl": ("step", 0.05), "nthr": ("step", 0.05),
           "nthr_second_forward": ("step", None), "lopti": ("update", 2.0)}
B, GROUP, P, T, H = 8, 4, 32, 224, 256


def child_time(a):
    from types import SimpleNamespace

    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    from gbc_kernels.integrations.verl import engine as ve

    tve = _setup(a)
    from test_other_trainers import verl_actor_config
    actor = tve.build_engine(a.model_dir, lr=1e-6)
    ref = tve.build_engine(a.model_dir, lr=1e-6)
    cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl", entropy_coeff=0.0)
    loss_fn = functools.partial(ppo_loss, config=cfg)
    ec = SimpleNamespace(use_dynamic_bsz=False, infer_max_token_len_per_gpu=4096,
                         infer_micro_batch_size_per_gpu=B // 2, micro_batch_size_per_gpu=B // 2,
                         use_fused_kernels=False)
    worker = SimpleNamespace(engine=actor, engine_config=ec, loss_fn=loss_fn,
                             model_config={"use_remove_padding": True})
    flags = dict(use_remove_padding=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=B // 2,
                 max_token_len_per_gpu=4096, use_fused_kernels=False)

    def infer_batch(self, td):                  # verl's TrainingWorker.infer_batch, one rank
        with self.engine.eval_mode():
            return self.engine.infer_batch(td, loss_function=None)

    def train_mini_batch(self, td):             # verl's update of one mini-batch
        with self.engine.train_mode():
            return self.engine.train_batch(td, loss_fn)

    keep_infer = ve._nthr_keep_on_infer(infer_batch)
    update = ve._nthr_before_update(train_mini_batch)
    data = tve.make_batch(7, B, group=GROUP, vocab=a.V, lengths=(P, T), with_is=False,
                          micro=B // 2, temperature=1.0)
    fields = tve.make_batch(7, B, group=GROUP, vocab=a.V, lengths=(P, T), with_is=False,
                            padded=True)
    n_resp = int(fields["response_mask"].sum())

    def step(method):
        opts = ve.EngineOptions(**METHODS[method])
        type(actor).gbc_options = opts
        times = {}
        w0, t0 = time.perf_counter(), time.process_time()
        old = data.clone()
        del old["advantages"]
        tu.assign_non_tensor(old, compute_loss=False, calculate_entropy=True)
        (infer_batch if method == "nthr_second_forward" else keep_infer)(worker, old)
        times["old_pass"] = time.process_time() - t0
        t1 = time.process_time()
        td = left_right_2_no_padding(TensorDict(dict(fields), batch_size=[B]))
        meta = dict(flags, temperature=1.0, calculate_entropy=False, compute_loss=False)
        if opts.critical_kl_exponent is not None:
            meta[ve.CERTAINTY_KEY] = {k: getattr(opts, k) for k in ve.CRITICAL_KL_FIELDS}
        tu.assign_non_tensor(td, **meta)
        with ref.eval_mode():
            out = ref.infer_batch(td, loss_function=None)["model_output"]
        times["ref_pass"] = time.process_time() - t1
        upd = data.clone()
        if ve.KL_WEIGHT_KEY in out:
            from verl.workers.utils.padding import no_padding_2_padding
            upd[ve.KL_WEIGHT_KEY] = no_padding_2_padding(out[ve.KL_WEIGHT_KEY], td).float()
        t2 = time.process_time()
        update(worker, upd)
        times["update"] = time.process_time() - t2
        times["step"] = time.process_time() - t0
        times["wall_step"] = time.perf_counter() - w0
        times["nthr_kept_mb"] = actor._gbc_pass_metrics.get("actor/gbc_nthr_kept_mb", 0.0)
        times["second_forward"] = actor._gbc_pass_metrics.get(
            "actor/gbc_nthr_second_forward", 0.0)
        return times

    return _timed(a, list(METHODS), step, n_resp)


TRL_METHODS = {"plain": {}, "ar": {"gbc_ar_alpha": 0.3},
               "critical_kl": {"gbc_critical_kl_exponent": 1.0}, "nthr": {"gbc_nthr": True},
               "nthr_second_forward": {"gbc_nthr": True}}


def child_time_trl(a):
    """TRL's GBCGRPOTrainer: a step is gbc's part of the rollout (TRL's generation and reward
    replaced by a fixed scored batch; TRL's reference pass kept) and one update (the loss in
    the model's forward, backward, AdamW step). Lopti's two updates run in TRL's training loop
    and are not timed here."""
    import warnings
    from unittest import mock

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gbc_kernels.integrations.trl import GBCGRPOConfig, GBCGRPOTrainer

    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(7)
    rlens = torch.randint(1, T + 1, (B,), generator=g)
    Tm = int(rlens.max())
    completion_mask = (torch.arange(Tm)[None] < rlens[:, None]).long()
    base = dict(prompt_ids=torch.randint(2, a.V, (B, P), generator=g),
                prompt_mask=torch.ones(B, P, dtype=torch.long),
                completion_ids=torch.randint(2, a.V, (B, Tm), generator=g) * completion_mask,
                completion_mask=completion_mask,
                advantages=torch.tensor([1.0, -1.0, 0.5, -0.5] * (B // GROUP)),
                num_items_in_batch=completion_mask.sum())
    trainers = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m, opts in TRL_METHODS.items():
            cfg = GBCGRPOConfig(output_dir=os.path.join(a.model_dir, "out", m),
                                per_device_train_batch_size=B, num_generations=GROUP,
                                max_completion_length=T, report_to=[], use_cpu=True, bf16=False,
                                save_strategy="no", seed=0, beta=0.04, loss_type="dapo",
                                learning_rate=1e-6, **opts)
            t = GBCGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(a.model_dir),
                               reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                               args=cfg, train_dataset=Dataset.from_dict({"prompt": ["t2"] * B}),
                               processing_class=AutoTokenizer.from_pretrained(a.model_dir))
            t._gbc_nthr_in_forward = m != "nthr_second_forward"
            t.current_gradient_accumulation_steps = 1
            t.model.train()
            t._bench_opt = torch.optim.AdamW(t.model.parameters(), lr=1e-6)
            trainers[m] = t

    def scored(self, _):          # TRL's rollout after generation: its reference pass
        out = {k: v.clone() for k, v in base.items()}
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        am = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        with torch.no_grad():
            out["ref_per_token_logps"] = self._get_per_token_logps_and_entropies(
                self.ref_model, ids, am, Tm)[0]
        return out

    def step(m):
        t = trainers[m]
        times = {}
        w0, t0 = time.perf_counter(), time.process_time()
        with mock.patch.object(trl.GRPOTrainer, "_generate_and_score_completions", scored):
            out = t._generate_and_score_completions(None)
        times["old_pass"] = time.process_time() - t0
        times["ref_pass"] = 0.0
        t2 = time.process_time()
        loss = t.compute_loss(t.model, out)
        loss.backward()
        t._bench_opt.step()
        t._bench_opt.zero_grad(set_to_none=True)
        times["update"] = time.process_time() - t2
        times["step"] = time.process_time() - t0
        times["wall_step"] = time.perf_counter() - w0
        times["nthr_kept_mb"] = 0.0
        times["second_forward"] = float(m == "nthr_second_forward")
        return times

    return _timed(a, list(TRL_METHODS), step, int(completion_mask.sum()))


def child_time_openrlhf(a):
    """OpenRLHF 0.11.2's flow with gbc's drop-in (``enable()``): a step is the actor's side of
    its ``train_step``: the experience maker's actor pass (the patched ``Actor.forward`` over
    its micro-batches, giving ``action_log_probs``), the reference model's pass, advantages,
    ``NaiveReplayBuffer.append``, then what the patched ``ppo_train`` runs: NTHR's scoring
    (``nthr_pass``) and ``training_step`` on each of the buffer's micro-batches (the fused
    loss, backward, AdamW step through a plain-PyTorch stand-in of its DeepSpeed strategy).
    Samples as OpenRLHF's generator makes them (one unpadded sequence each), micro-batched
    by its ``Experience.concat_experiences``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_openrlhf as T_
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch

    from gbc_kernels.integrations import openrlhf as gorl

    ORL = T_.ORL
    args = T_._margs(kl="k3")
    args.rollout.n_samples_per_prompt = GROUP
    actor = ORL.Actor(AutoModelForCausalLM.from_pretrained(a.model_dir).float(),
                      temperature=1.0)
    actor.packing_samples = False
    ref = ORL.Actor(AutoModelForCausalLM.from_pretrained(a.model_dir).float(), temperature=1.0)
    ref.packing_samples, ref.gbc_reference = False, True
    for m in (actor.model, ref.model):
        m.config.use_cache = False
    opt = torch.optim.AdamW(actor.model.parameters(), lr=1e-6)
    trainer = SimpleNamespace(actor=actor, args=args, strategy=T_.PlainStrategy(),
                              actor_optim=opt, ema_model=None, ema_beta=0.99,
                              actor_scheduler=torch.optim.lr_scheduler.LambdaLR(opt,
                                                                                lambda _: 1.0))
    g = torch.Generator().manual_seed(7)
    samples = []
    for i in range(B):
        p, r = (int(torch.randint(1, n + 1, (1,), generator=g)) for n in (P, T))
        seq = torch.randint(2, a.V, (p + r,), generator=g)
        am = torch.zeros(p + r - 1, dtype=torch.bool)
        am[p - 1:] = True
        samples.append(dict(sequences=seq[None], attention_mask=torch.ones(1, p + r,
                            dtype=torch.long), action_mask=am[None], index=[i]))
    adv = [1.0, -1.0, 0.5, -0.5] * (B // GROUP)
    n_resp = int(sum(s["action_mask"].sum() for s in samples))
    mb = B // 2

    def enable(opts):
        gorl.disable()
        gorl.enable(actor_cls=ORL.Actor, trainer_cls=False,
                    buffer_cls=T_.NaiveReplayBuffer, **opts)

    def step(method):
        opts = dict(OPENRLHF_METHODS[method])
        times = {}
        enable({} if method == "nthr_second_forward" else opts)
        w0, t0 = time.perf_counter(), time.process_time()
        batches = [ORL.Experience.concat_experiences(
            [ORL.Experience(**s, info={}) for s in samples[i:i + mb]], 0)
            for i in range(0, B, mb)]
        for exp in batches:                # the experience maker: the actor's pass
            actor.eval()
            with torch.no_grad():
                exp.action_log_probs = actor(exp.sequences, exp.action_mask,
                                             exp.attention_mask, ring_attn_group=None)
            actor.train()
        times["old_pass"] = time.process_time() - t0
        t1 = time.process_time()
        for exp in batches:                # the reference model's pass
            with torch.no_grad():
                exp.base_action_log_probs = ref(exp.sequences, exp.action_mask,
                                                exp.attention_mask, ring_attn_group=None)
            exp.advantages = torch.tensor([adv[i] for i in exp.index])[:, None] * \
                exp.action_mask
        times["ref_pass"] = time.process_time() - t1
        if method == "nthr_second_forward":
            enable(opts)
        t2 = time.process_time()
        buf = T_._buffer(batches[0], mb)
        for exp in batches[1:]:
            buf.append(exp)
        trainer.replay_buffer = buf
        gorl.check_trainer(trainer)        # the patched ppo_train: NTHR, then the steps
        t3 = time.process_time()
        extra = gorl.nthr_pass(trainer) if opts.get("nthr") else {}
        times["nthr_pass"] = time.process_time() - t3
        for k, i in enumerate(range(0, B, mb)):
            batch = make_experience_batch(buf.items[i:i + mb])
            gorl.training_step(trainer, batch, 0.05, k,
                               ORL.get_loss_batch_info(None, batch.action_mask))
        gorl._nthr_forget()
        times["update"] = time.process_time() - t2
        times["step"] = time.process_time() - t0
        times["wall_step"] = time.perf_counter() - w0
        times["nthr_kept_mb"] = extra.get("gbc/nthr_kept_mb", 0.0)
        times["second_forward"] = extra.get("gbc/nthr_second_forward", 0.0)
        return times

    return _timed(a, list(OPENRLHF_METHODS), step, n_resp)


OPENRLHF_METHODS = {k: METHODS[k] for k in METHODS}


def _timed(a, names, step, n_resp):
    for m in names:                              # warm-up: optimizer state, allocator pools
        step(m)
    print(f"  V={a.V}: warm-up done ({n_resp} response tokens)", file=sys.stderr, flush=True)
    runs = {m: [] for m in names}
    for r in range(a.reps):
        for m in (names if r % 2 == 0 else names[::-1]):
            runs[m].append(step(m))
        print(f"  V={a.V} round {r + 1}/{a.reps}: " + ", ".join(
            f"{m} {runs[m][-1]['step']:.3f}s" for m in names), file=sys.stderr, flush=True)
    med = {m: {k: statistics.median(t[k] for t in runs[m]) for k in runs[m][0]} for m in names}
    print(json.dumps(dict(medians=med, response_tokens=n_resp)))


def _rows(V, res, reps, threads, trainer="verl-fsdp"):
    med = res["medians"]
    plain = med["plain"]
    rows = []
    for m, t in med.items():
        what, limit = TARGETS.get(m, ("step", None))
        if what == "update":
            value = t["update"] / plain["update"]
            target = f"update <= {limit:.1f}x"
            ok = value <= limit * 1.05           # 5% timing noise on a shared CPU
            shown = f"{value:.2f}x the update"
        else:
            value = t["step"] / plain["step"] - 1.0
            target = "" if limit is None else f"<= {limit:.0%}"
            ok = None if limit is None else value <= limit
            shown = f"{value:+.1%}"
        rows.append(dict(time=now(), trainer=trainer, V=V, method=m,
                         step_s=round(t["step"], 4), wall_step_s=round(t["wall_step"], 4),
                         old_pass_s=round(t["old_pass"], 4), ref_pass_s=round(t["ref_pass"], 4),
                         update_s=round(t["update"], 4), cost=shown, target=target,
                         met="" if ok is None else ("yes" if ok else "no"),
                         second_forward=int(t["second_forward"]),
                         nthr_pass_s=round(t["nthr_pass"], 4) if "nthr_pass" in t else "",
                         nthr_kept_mb=round(t["nthr_kept_mb"], 2),
                         response_tokens=res["response_tokens"], reps=reps, threads=threads))
    return rows


PLAIN = {"verl-fsdp": "plain step (old-log-prob pass + reference pass + update), CPU s",
         "openrlhf": "plain step (experience maker's actor pass + reference pass + update), "
                     "CPU s",
         "trl": "plain step (gbc's rollout part + TRL's reference pass + update), CPU s"}


def table(rows, trainer="verl-fsdp") -> str:
    rows = [r for r in rows if r["trainer"] == trainer]
    Vs = sorted({r["V"] for r in rows})
    by = {(r["method"], r["V"]): r for r in rows}
    for r in rows:
        r["plain_step_s"] = by[("plain", r["V"])]["step_s"]
    head = "| method | target | " + " | ".join(f"V = {V:,}" for V in Vs) + " |"
    out = [head, "|---|---|" + "---|" * len(Vs)]
    for m in METHODS:
        if (m, Vs[0]) not in by:
            continue
        if m == "plain":
            cells = [f"{by[(m, V)]['step_s']:.2f}" for V in Vs]
            out.append(f"| {PLAIN[trainer]} | | " + " | ".join(cells) + " |")
            continue
        cells = []
        for V in Vs:
            r = by[(m, V)]
            cell = r["cost"] + ({"yes": " ✓", "no": " ✗"}.get(r["met"], ""))
            if m == "nthr" and r["nthr_kept_mb"]:
                cell += f" (kept {r['nthr_kept_mb']:.1f} MiB"
                if r.get("nthr_pass_s"):     # NTHR's scoring, timed alone
                    cell += (f"; scoring {float(r['nthr_pass_s']):.3f} s = "
                             f"{float(r['nthr_pass_s']) / r['plain_step_s']:.1%}")
                cell += ")"
            cells.append(cell)
        out.append(f"| {m} | {by[(m, Vs[0])]['target'] or '(for comparison)'} | "
                   + " | ".join(cells) + " |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child-time", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29583, help=argparse.SUPPRESS)
    ap.add_argument("--V", type=int, nargs="+", default=[32768, 151936])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--trainers", nargs="+", default=["verl-fsdp", "openrlhf", "trl"],
                    choices=["verl-fsdp", "openrlhf", "trl"])
    ap.add_argument("--trainer", default="verl-fsdp", help=argparse.SUPPRESS)
    ap.add_argument("--table", action="store_true",
                    help="only rewrite methods_price.md from methods_price.csv")
    a = ap.parse_args()
    if a.table:
        return write_table(a)
    if a.child_time:
        a.V = a.V[0]
        return {"trl": child_time_trl, "openrlhf": child_time_openrlhf}.get(
            a.trainer, child_time)(a)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_verl_engine as tve
    rows = []
    for trainer in a.trainers:
        for i, V in enumerate(a.V):
            with tempfile.TemporaryDirectory() as d:
                model_dir = tve.make_model_dir(os.path.join(d, "m"), vocab=V, hidden=H,
                                               tie=False)
                res = run_child([sys.executable, __file__, "--child-time", "--V", str(V),
                                 "--threads", str(a.threads), "--reps", str(a.reps),
                                 "--trainer", trainer, "--model-dir", model_dir,
                                 "--port", str(a.port + i)], a.threads)
            rows += _rows(V, res, a.reps, a.threads, trainer)
    os.makedirs(RESULTS, exist_ok=True)
    append_rows(os.path.join(RESULTS, "methods_price.csv"), rows)
    write_table(a)


def write_table(a):
    """methods_price.md from the CSV's latest row of each (trainer, V, method)."""
    import csv

    with open(os.path.join(RESULTS, "methods_price.csv")) as f:
        latest = {(r["trainer"], r["V"], r["method"]): r for r in csv.DictReader(f)}
    rows = []
    for r in latest.values():
        r = dict(r, V=int(r["V"]), step_s=float(r["step_s"]),
                 nthr_kept_mb=float(r["nthr_kept_mb"]))
        rows.append(r)
    where = {"verl-fsdp": "Inside verl 0.9.1's FSDP2 engine with gbc's engine",
             "openrlhf": "In OpenRLHF 0.11.2's flow with gbc's drop-in (experience maker's "
                         "actor pass, reference pass, replay buffer, training_step)",
             "trl": "In TRL 1.16's GBCGRPOTrainer (on policy, beta 0.04)"}
    md = ""
    for trainer in where:
        tr = [r for r in rows if r["trainer"] == trainer]
        if not tr:
            continue
        md += (f"{where[trainer]}: CPU time, {tr[0]['threads']} thread(s), tiny Qwen2 (H {H}, "
               f"2 layers, untied head), {B} sequences ({B // GROUP} groups of {GROUP}), "
               f"{tr[0]['response_tokens']} response tokens, KL loss on; median of "
               f"{tr[0]['reps']}, method order alternated.\n\n" + table(rows, trainer) + "\n\n")
    with open(os.path.join(RESULTS, "methods_price.md"), "w") as f:
        f.write(md)
    doc = os.path.join(ROOT, "docs", "methods.md")       # the same table in docs/methods.md
    with open(doc) as f:
        text = f.read()
    start, end = DOC_MARKS
    if start in text and end in text:
        head, rest = text.split(start, 1)
        with open(doc, "w") as f:
            f.write(head + start + "\n" + md + rest[rest.index(end):])
    print(md)


DOC_MARKS = ("<!-- methods_price table: benchmarks/bench_methods_price.py --table writes it -->",
             "<!-- end of the methods_price table -->")


if __name__ == "__main__":
    main()
