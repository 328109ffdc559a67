"""A minimal, readable GRPO trainer over any transformers causal LM, with the gbc_kernels loss.

Default, the README's main job (CPU, under 2 minutes): GRPO from the shipped checkpoint of a
tiny Qwen2 that adds numbers of 1-3 digits with a scratchpad (examples/checkpoints/scratchpad-add3,
built once by examples/pretrain_scratchpad.py, so every machine starts from the same weights),
sampling at temperature 3: the checkpoint is right on every held-out sum greedily but on only
~20% of its temperature-3 samples, and GRPO makes the policy sure of what it knows (sampled
accuracy ~0.2 -> ~0.5 in 150 steps). ``--rl-digits 4 --paper-mix``: the critical-token KL
paper's setting (RL on sums with an operand one digit longer than pre-training saw).
``--checkpoint examples/checkpoints/scratchpad-carry3 --final-carry``: the critical-token KL
experiment's (examples/experiments.py: every RL sum carries out of its last column, which
that checkpoint hardly saw).
``--task add``: zero-padded addition learnt by a supervised warm-up from scratch, then GRPO on
N+1 digits (the warm-up's outcome depends on the CPU's floating-point path).

    python examples/grpo_trainer.py                       # the README's main job
    python examples/grpo_trainer.py --parity --steps 4    # fused loss vs gbc_reference each step
    python examples/grpo_trainer.py --compare             # GRPO vs +AR vs +Lopti vs +AR+Lopti
    python examples/grpo_trainer.py --task kk --model PATH   # K&K with a real local model

Per RL step: sample G completions per prompt; reward; group advantages; an old-policy pass
(old log-probs, NTHR's token scale); a reference pass (ref log-probs, certainty -> critical-token
KL weights); the loss from gbc_kernels (``--loss fused``) or gbc_reference (``--loss reference``);
Lopti's two phases with an optimizer step after each; AdamW. Writes metrics.jsonl, curves.png
(and parity.json / compare.png) to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gbc_kernels as gbc                         # noqa: E402
import gbc_reference                              # noqa: E402
from gbc_kernels import methods                  # noqa: E402
from gbc_kernels.integrations import hf           # noqa: E402
from grpo_tasks import (AdditionTask, CharTokenizer, KKTask,         # noqa: E402
                        ScratchpadAdditionTask)


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default in its help line."""


def build_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    task = ap.add_argument_group("task and model")
    task.add_argument("--task", choices=["scratchpad", "add", "kk"], default=None,
                      help="None: scratchpad (add with --parity or --compare). "
                           "scratchpad: scratchpad addition from the shipped checkpoint; "
                           "add: zero-padded addition "
                           "with a supervised warm-up from scratch; kk: Knights-and-Knaves "
                           "puzzles from reasoning-gym (needs --model)")
    task.add_argument("--checkpoint", default=None,
                      help="scratchpad: the pre-trained model (None: the shipped one)")
    task.add_argument("--rl-digits", type=int, default=None,
                      help="scratchpad: longest operand of the RL sums, operands of "
                           "1..rl-digits (None: the checkpoint's)")
    task.add_argument("--longest-only", action="store_true",
                      help="scratchpad: every RL sum has an operand of --rl-digits digits")
    task.add_argument("--paper-mix", action="store_true",
                      help="scratchpad: the critical-token paper's RL operands: one of "
                           "--rl-digits digits, the other of --rl-digits half of the time, "
                           "else shorter")
    task.add_argument("--final-carry", action="store_true",
                      help="scratchpad: every RL sum carries out of its last column (the "
                           "critical token of a checkpoint pre-trained without such sums)")
    task.add_argument("--model", default=None,
                      help="path of a local Hugging Face causal LM (None: a tiny Qwen2 built "
                           "from a config, no download)")
    task.add_argument("--digits", type=int, default=1,
                      help="add: warm-up digits; RL uses digits + 1 (scratchpad: the "
                           "checkpoint's, 3)")
    task.add_argument("--sft-steps", type=int, default=None,
                      help="supervised warm-up steps (None: 1500, or 100 with --parity)")
    task.add_argument("--sft-mix", type=float, default=0.5,
                      help="share of (digits+1)-digit sums in the warm-up (a pretrained model "
                           "has seen a few of the harder task)")
    task.add_argument("--sft-lr", type=float, default=3e-3, help="warm-up learning rate")
    task.add_argument("--eval-size", type=int, default=300,
                      help="held-out sums for the accuracy before and after RL")
    rl = ap.add_argument_group("GRPO")
    rl.add_argument("--steps", type=int, default=None,
                    help="RL steps (None: 150 for scratchpad, 500 otherwise)")
    rl.add_argument("--prompts", type=int, default=None,
                    help="prompts per RL step (None: 16, or 4 with --parity)")
    rl.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    rl.add_argument("--partial-credit", action="store_true",
                    help="addition reward: half credit for the share of right digits")
    rl.add_argument("--lr", type=float, default=1e-4, help="RL learning rate (AdamW)")
    rl.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature, the loss uses the same (None: 3 for "
                         "scratchpad, 1 otherwise)")
    rl.add_argument("--top-k", type=int, default=0,
                    help="sample from the k most likely tokens (0: off); the sampler records "
                         "each token's kept ids and its processed log-prob")
    rl.add_argument("--top-p", type=float, default=1.0,
                    help="sample from the smallest set of tokens of mass >= top_p (1: off)")
    rl.add_argument("--min-p", type=float, default=0.0,
                    help="drop tokens below min_p times the most likely one's probability "
                         "(0: off)")
    rl.add_argument("--tis-cap", type=float, default=None,
                    help="vLLM-style truncated importance sampling: the policy term times "
                         "min(exp(old_logp - sampling_logp), cap) (None: off)")
    rl.add_argument("--support-replay", action="store_true",
                    help="the old-policy, reference and loss log-probs over each token's "
                         "recorded support (the sampler's kept ids: docs/math.md, 'The "
                         "sampler's support') instead of the whole vocabulary")
    rl.add_argument("--loss", choices=["fused", "reference"], default="fused",
                    help="fused: gbc_kernels; reference: gbc_reference (full logits, autograd)")
    rl.add_argument("--backend", default="auto", choices=["auto", "torch", "cpu", "triton"],
                    help="gbc_kernels backend")
    rl.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the policy's (and reference's) parameter dtype for RL")
    rl.add_argument("--logits-dtype", default=None, choices=["float32", "input"],
                    help="float32: the fused head's logits in float32 from bf16 operands (the "
                         "float32 LM head's log-probs, docs/kernels.md 'Precision'), in the loss "
                         "and the old-policy, reference and NTHR passes; input: in the model's "
                         "dtype; default: per device (float32 on a CPU, the model's dtype on a "
                         "GPU)")
    rl.add_argument("--loss-agg", default="token-mean",
                    choices=list(gbc.config.LOSS_AGG_MODES) + list(gbc.config.LOSS_AGG_ALIASES),
                    help="aggregation of the per-token loss (docs/math.md)")
    rl.add_argument("--epsilon-low", type=float, default=0.2, help="PPO clip, lower side")
    rl.add_argument("--epsilon-high", type=float, default=0.28,
                    help="PPO clip, upper side (DAPO clip-higher)")
    rl.add_argument("--dual-clip", type=float, default=None,
                    help="dual-clip bound c > 1 on negative-advantage ratios (None: off)")
    rl.add_argument("--kl-coef", type=float, default=0.0, help="KL penalty coefficient beta")
    rl.add_argument("--kl-estimator", default="k2", choices=list(gbc.config.KL_ESTIMATORS),
                    help="per-token KL estimator")
    rl.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus coefficient")
    methods = ap.add_argument_group("the papers' methods")
    methods.add_argument("--ar-alpha", type=float, default=0.0,
                         help="Advantage Reweighting alpha (0: off)")
    methods.add_argument("--lopti-eta", type=float, default=None,
                         help="Lopti probability threshold (None: off)")
    methods.add_argument("--lopti-order", default="low-first", choices=["low-first", "high-first"],
                         help="which Lopti phase updates first")
    methods.add_argument("--nthr", action="store_true",
                         help="NTHR: soften the penalty of negatives' tokens aligned with positives")
    methods.add_argument("--nthr-beta", type=float, default=1.0, help="NTHR threshold factor")
    methods.add_argument("--critical-kl-exponent", type=float, default=None,
                         help="critical-token KL: weight each token's KL by J**gamma "
                              "(None: off; needs --kl-coef)")
    methods.add_argument("--critical-kl-certainty", default="max_prob",
                         choices=["max_prob", "entropy"], help="certainty J of the reference")
    methods.add_argument("--critical-kl-temperature", type=float, default=1.0,
                         help="temperature of the reference's certainty")
    run = ap.add_argument_group("runs")
    run.add_argument("--parity", action="store_true",
                     help="every step: fused vs reference loss and gradients, all methods on "
                          "(a short warm-up unless --sft-steps is given)")
    run.add_argument("--compare", action="store_true",
                     help="GRPO vs +AR vs +Lopti vs +AR+Lopti over --seeds")
    run.add_argument("--seeds", default="0,1,2", help="comma-separated seeds for --compare")
    run.add_argument("--seed", type=int, default=0, help="random seed")
    run.add_argument("--out", default="runs/grpo",
                     help="output folder: metrics.jsonl, curves.png (parity.json, compare.png)")
    run.add_argument("--quiet", action="store_true", help="no progress bars or log lines")
    args = ap.parse_args(argv)
    if args.task is None:
        # scratchpad: the main job's default. --parity and --compare keep the add task: the
        # checkpoint is near-certain on most tokens, where --parity's fp32 gradients of tiny
        # size compare by their rounding, and --compare's docs are measured on add.
        args.task = "add" if (args.parity or args.compare) else "scratchpad"
    if args.paper_mix and args.longest_only:
        ap.error("--paper-mix and --longest-only are two operand mixes: give one")
    if args.task != "scratchpad":
        for flag in ("paper_mix", "longest_only", "final_carry"):
            if getattr(args, flag):
                ap.error(f"--{flag.replace('_', '-')} needs --task scratchpad, got --task "
                         f"{args.task}")
    if args.steps is None:
        args.steps = 150 if args.task == "scratchpad" else 500
    if args.temperature is None:
        args.temperature = 3.0 if args.task == "scratchpad" else 1.0
    if args.sft_steps is None:
        args.sft_steps = 100 if args.parity else 1500
    if args.prompts is None:
        args.prompts = 4 if args.parity else 16
    if args.top_k < 0:
        ap.error(f"--top-k: expected an int >= 0 (0: off), got {args.top_k}")
    if not 0.0 < args.top_p <= 1.0:
        ap.error(f"--top-p: expected a float in (0, 1], got {args.top_p}")
    if not 0.0 <= args.min_p < 1.0:
        ap.error(f"--min-p: expected a float in [0, 1), got {args.min_p}")
    if args.tis_cap is not None and not args.tis_cap > 0:
        ap.error(f"--tis-cap: expected a float > 0, got {args.tis_cap}")
    return args


def records_support(args) -> bool:
    """Whether the sampler records each token's kept ids and processed log-prob."""
    return (args.top_k > 0 or args.top_p < 1.0 or args.min_p > 0.0 or args.support_replay
            or args.tis_cap is not None)


# ---------------------------------------------------------------------------------------------
# model, sampling, evaluation
# ---------------------------------------------------------------------------------------------


def tiny_qwen2(vocab_size: int, seed: int, layers: int = 3):
    """The examples' tiny Qwen2 (hidden 128, character vocabulary), initialised from ``seed``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=384,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=False,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return Qwen2ForCausalLM(cfg)


@torch.no_grad()
def sample(model, prompts, group, max_new, temperature, eos, pad, greedy=False,
           top_k=0, top_p=1.0, min_p=0.0, record=False):
    """``(prompt ids, completions)``; with ``record`` also ``(kept, sampling_logp)``: each
    completion token's kept ids ``[B, steps, K]`` (-1 padded) and its log-prob under the
    sampler's processed distribution (temperature, then top-k / top-p / min-p as transformers'
    sampler applies them; the softmax over the ids it kept)."""
    model.eval()
    ids = prompts.repeat_interleave(group, 0)
    out = model.generate(ids, attention_mask=(ids != pad).long(), max_new_tokens=max_new,
                         do_sample=not greedy, temperature=temperature if not greedy else None,
                         top_k=(top_k if not greedy else None), top_p=top_p if top_p < 1 else None,
                         min_p=min_p if min_p > 0 else None, eos_token_id=eos,
                         pad_token_id=pad, output_scores=record, return_dict_in_generate=record)
    if not record:
        return ids, out[:, ids.shape[1]:]
    comp = out.sequences[:, ids.shape[1]:]
    scores = torch.stack(out.scores, 1).float()              # processed: -inf where dropped
    kept = torch.isfinite(scores)
    sampling_logp = torch.log_softmax(scores, -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    K = int(kept.sum(-1).max())
    vocab = torch.arange(scores.shape[-1]).expand_as(scores)
    kept_ids = torch.where(kept, vocab, -1).sort(-1, descending=True).values[..., :K]
    return ids, comp, (kept_ids, sampling_logp)


def completion_mask(completions, eos, pad):
    """1 on completion tokens up to and including the first EOS."""
    is_end = (completions == eos) | (completions == pad)
    after = torch.cumsum(is_end.long(), 1) - is_end.long()   # ends strictly before t
    return (after == 0) & ((completions != pad) | (completions == eos))


@torch.no_grad()
def evaluate(model, task, tok, n, seed, temperature=1.0, k=4):
    """Accuracy on ``n`` held-out prompts: greedy, and sampled (the mean over ``k`` samples per
    prompt at the RL temperature: the pass@1 that GRPO optimises)."""
    batch = task.sample(n, random.Random(10_000 + seed))
    new = task.longest(batch) if hasattr(task, "longest") else None
    out = {}
    for name, group, greedy in (("greedy", 1, True), ("sampled", k, False)):
        _, comp = sample(model, batch.prompts, group, task.max_answer_tokens, temperature,
                         tok.eos_token_id, tok.pad_token_id, greedy=greedy)
        texts = [tok.decode(c) for c in comp]
        ok = task.score(texts, batch, group)[1].float().view(-1, group).mean(1)
        out[name] = float(ok.mean())
        if new is not None:      # scratchpad: the new operand length, and the lengths it knew
            out[f"{name}_new"] = float(ok[new].mean()) if new.any() else float("nan")
            out[f"{name}_known"] = float(ok[~new].mean()) if (~new).any() else float("nan")
    return out


def own_accuracy(model, task, tok, args):
    """``own_greedy`` and ``own_sampled``: :func:`evaluate` on the checkpoint's own sums."""
    acc = evaluate(model, task, tok, args.eval_size, args.seed, args.temperature)
    return {f"own_{k}": acc[k] for k in ("greedy", "sampled")}


def sft(model, task, args, log, harder=None):
    """Supervised warm-up on N-digit sums (and a ``--sft-mix`` share of N+1-digit ones) with
    -logp from gbc.fused_linear_logprobs."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / max(1, args.sft_steps)))
    rng = random.Random(args.seed)
    head = hf.lm_head(model)
    model.train()
    from tqdm import tqdm
    bar = tqdm(range(args.sft_steps), disable=args.quiet, desc="warm-up", dynamic_ncols=True)
    for step in bar:
        t = harder if harder is not None and rng.random() < args.sft_mix else task
        ids, mask = t.sft_batch(64, rng)
        h = hf.completion_hidden(model, ids)
        logp, _ = gbc.fused_linear_logprobs(h[mask], head.weight, ids[:, 1:][mask], head.bias,
                                            backend=args.backend)
        loss = -logp.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 10 == 0 or step == args.sft_steps - 1:
            nll = float(loss.detach())
            bar.set_postfix(nll=f"{nll:.4f}")
    if args.sft_steps:
        log(f"warm-up: {args.sft_steps} steps, final nll {nll:.4f}")


# ---------------------------------------------------------------------------------------------
# one RL step
# ---------------------------------------------------------------------------------------------


# the method layer's options under this trainer's flags (errors name the flag)
METHOD_FLAGS = {"ar_alpha": "--ar-alpha", "lopti_eta": "--lopti-eta",
                "lopti_order": "--lopti-order", "nthr": "--nthr", "nthr_beta": "--nthr-beta",
                "critical_kl_exponent": "--critical-kl-exponent",
                "critical_kl_certainty": "--critical-kl-certainty",
                "critical_kl_temperature": "--critical-kl-temperature",
                "logits_dtype": "--logits-dtype"}


def method_options(args) -> methods.MethodOptions:
    """The run's :class:`gbc_kernels.methods.MethodOptions`, checked against its loss (critical
    KL needs --kl-coef)."""
    opts = methods.MethodOptions.from_kwargs(
        METHOD_FLAGS, **{f: getattr(args, f) for f in METHOD_FLAGS})
    opts.check_loss(args.kl_coef, kl_option="--kl-coef", names=METHOD_FLAGS)
    return opts


def loss_config(args, lib):
    return lib.PolicyLossConfig(epsilon_low=args.epsilon_low, epsilon_high=args.epsilon_high,
                                clip_ratio_c=args.dual_clip,
                                loss_agg=args.loss_agg, temperature=args.temperature,
                                kl_coef=args.kl_coef, kl_estimator=args.kl_estimator,
                                entropy_coef=args.entropy_coef, ar_alpha=args.ar_alpha,
                                lopti_eta=args.lopti_eta,
                                max_len=args.max_len if args.loss_agg in
                                ("dr_grpo", "seq-mean-token-sum-norm") else None,
                                logits_dtype=method_options(args).logits_dtype)


def rollout(model, ref_model, task, tok, args, rng):
    """Sample, score, and run the old-policy and reference passes (no grad)."""
    batch = task.sample(args.prompts, rng)
    record = records_support(args)
    out = sample(model, batch.prompts, args.group, task.max_answer_tokens, args.temperature,
                 tok.eos_token_id, tok.pad_token_id, top_k=args.top_k, top_p=args.top_p,
                 min_p=args.min_p, record=record)
    prompt_ids, comp = out[:2]
    texts = [tok.decode(c) for c in comp]
    rewards, correct = task.score(texts, batch, args.group)
    group_ids = torch.arange(args.prompts).repeat_interleave(args.group)
    adv = gbc.group_advantages(rewards, group_ids)
    seq = torch.cat([prompt_ids, comp], 1)
    attn = (seq != tok.pad_token_id).long()
    attn[:, prompt_ids.shape[1]:] = 1
    Lp = prompt_ids.shape[1]
    targets = seq[:, 1:]
    mask = torch.zeros_like(targets, dtype=torch.bool)
    mask[:, Lp - 1:] = completion_mask(comp, tok.eos_token_id, tok.pad_token_id)
    support_ids = sampling_logp = None
    if record:            # the sampler's record, in the targets' layout
        kept, lp = out[2]
        support_ids = torch.full(targets.shape + (kept.shape[-1],), -1, dtype=torch.long)
        support_ids[:, Lp - 1:] = kept
        sampling_logp = torch.zeros(targets.shape)
        sampling_logp[:, Lp - 1:] = lp
    model.eval()
    opts = method_options(args)
    # --support-replay: NTHR over the recorded support, from sampler_ratios' pass
    replay_nthr = opts.nthr and args.support_replay
    old = hf.old_policy_pass(model, seq, attn, targets, mask, group_ids, advantages=adv,
                             temperature=args.temperature, nthr=opts.nthr and not replay_nthr,
                             nthr_beta=opts.nthr_beta, nthr_eta=opts.nthr_eta,
                             backend=args.backend, logits_dtype=opts.logits_dtype)
    nthr, token_scale, extra = old.nthr, old.token_scale, {}
    ref_logp = kl_weight = None
    if args.kl_coef != 0.0:
        ref = hf.reference_pass(ref_model, seq, attn, targets, temperature=args.temperature,
                                options=opts, backend=args.backend)
        ref_logp, kl_weight = ref.ref_logp, ref.kl_weight
        if kl_weight is not None:
            extra["critical_kl_weight_mean"] = float(kl_weight[mask].mean()) if mask.any() \
                else 0.0
    old_logp, is_ratio = old.old_logp, None
    if record:
        old_logp, ref_logp, is_ratio, sup_kl_weight, sup_nthr = sampler_ratios(
            model, ref_model, seq, attn, targets, mask, support_ids, sampling_logp, old_logp,
            ref_logp, args, extra, (group_ids, adv) if replay_nthr else None)
        if sup_nthr is not None:
            nthr, token_scale = sup_nthr, sup_nthr.scale
        if sup_kl_weight is not None:
            kl_weight = sup_kl_weight
            extra["critical_kl_weight_mean"] = float(kl_weight[mask].mean()) if mask.any() \
                else 0.0
    if nthr is not None:
        extra.update({k: float(v) for k, v in methods.nthr_metrics(nthr, adv, mask).items()})
    model.train()
    return dict(seq=seq, attn=attn, targets=targets, mask=mask, adv=adv,
                old_logp=old_logp, ref_logp=ref_logp, token_scale=token_scale,
                kl_weight=kl_weight, rewards=rewards, correct=correct, extra=extra,
                support_ids=support_ids if args.support_replay else None, is_ratio=is_ratio)


def ratio_stats(log_ratio, mask) -> dict:
    """The sampler ratio ``exp(logp - sampling_logp)`` over the completion tokens: its mean,
    median and the share outside [0.9, 1.1] (TRL PR #7269's table)."""
    r = log_ratio[mask].double().exp()
    if r.numel() == 0:
        return dict(mean=1.0, median=1.0, outside=0.0)
    return dict(mean=float(r.mean()), median=float(r.median()),
                outside=float(((r < 0.9) | (r > 1.1)).double().mean()))


def sampler_ratios(model, ref_model, seq, attn, targets, mask, support_ids, sampling_logp,
                   old_full, ref_full, args, extra, nthr_groups=None):
    """The policy's log-probs against the sampler's, over the whole vocabulary and over the
    recorded support (both measured, logged as ``sampler_ratio_*``); with ``--support-replay``
    the old-policy and reference log-probs (and critical-token KL's weights: the reference's
    certainty over the support) over the support, and with ``nthr_groups`` (``(group_ids,
    advantages)``) NTHR's scales over the support (its LSE from the support's old log-probs);
    with ``--tis-cap`` the truncated importance weights. Returns ``(old_logp, ref_logp,
    is_ratio, kl_weight or None, NTHR's result or None)``."""
    ids = torch.where(mask.unsqueeze(-1), support_ids, -1)

    def head_of(m):
        return hf.completion_hidden(m, seq, attn), hf.lm_head(m)

    h, head = head_of(model)
    old_sup = gbc.fused_linear_logprobs(h, head.weight, targets, bias=head.bias,
                                        temperature=args.temperature, backend=args.backend,
                                        support_ids=ids)[0].detach()
    for name, lp in (("full", old_full), ("replay", old_sup)):
        for k, v in ratio_stats(lp - sampling_logp, mask).items():
            extra[f"sampler_ratio_{k}_{name}"] = v
    old_logp, ref_logp, kl_weight, nthr = old_full, ref_full, None, None
    if args.support_replay:
        old_logp = old_sup
        if nthr_groups is not None:
            nthr = methods.nthr_token_scale(h, head.weight, targets, mask, *nthr_groups,
                                            method_options(args), head.bias,
                                            temperature=args.temperature, logp=old_sup,
                                            backend=args.backend, support_ids=ids)
        if ref_full is not None:          # the reference over the same support (SkyRL's rule)
            h, head = head_of(ref_model)
            ref = methods.reference_stats(h, head.weight, targets, method_options(args),
                                          head.bias, temperature=args.temperature,
                                          backend=args.backend, support_ids=ids)
            ref_logp, kl_weight = ref.ref_logp, ref.kl_weight
    is_ratio = None
    if args.tis_cap is not None:
        is_ratio = torch.where(mask, (old_logp - sampling_logp).exp().clamp(max=args.tis_cap),
                               1.0)
    return old_logp, ref_logp, is_ratio, kl_weight, nthr


def policy_loss(model, roll, args, phase, lib, config=None, **kw):
    head = hf.lm_head(model)
    h = hf.completion_hidden(model, roll["seq"], roll["attn"])
    if lib is not gbc_reference:
        kw["backend"] = args.backend
    return lib.fused_linear_policy_loss(
        h, head.weight, roll["targets"], roll["mask"], roll["adv"], old_logp=roll["old_logp"],
        ref_logp=roll["ref_logp"], bias=head.bias, token_scale=roll["token_scale"],
        kl_weight=roll["kl_weight"], config=config or loss_config(args, lib), phase=phase,
        support_ids=roll.get("support_ids"), is_ratio=roll.get("is_ratio"), **kw)


def unsplit_loss(model, roll, args, lib, token_out):
    """Lopti: the batch's loss and metrics without the split (every completion token once, the
    same normaliser) at the parameters of the first update, what the step without Lopti logs.
    Fused: from the per-token values the first phase's sweep returned (``token_out``; no
    vocabulary pass); the reference: its plain loss on the whole batch."""
    cfg = dataclasses.replace(loss_config(args, lib), lopti_eta=None)
    with torch.no_grad():
        if token_out:
            return lib.policy_loss(token_out["logp"], roll["mask"], roll["adv"],
                                   old_logp=roll["old_logp"], ref_logp=roll["ref_logp"],
                                   entropy=token_out.get("entropy"),
                                   token_scale=roll["token_scale"],
                                   kl_weight=roll["kl_weight"], config=cfg,
                                   is_ratio=roll.get("is_ratio"))
        return policy_loss(model, roll, args, None, lib, config=cfg)


def parity_check(model, roll, args, phase, record):
    """Fused and reference loss + gradients on the same batch and parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = {}
    for name, lib in (("fused", gbc), ("reference", gbc_reference)):
        loss, _ = policy_loss(model, roll, args, phase, lib)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        out[name] = (float(loss.detach()), [torch.zeros_like(p) if g is None else g
                                   for p, g in zip(params, grads)])
    (lf, gf), (lr_, gr) = out["fused"], out["reference"]
    # per parameter, relative to that parameter's largest reference gradient, with a floor of
    # 1e-4 in the denominator: a parameter whose whole gradient is below 1e-4 (rounding noise,
    # e.g. in a Lopti phase whose tokens all have zero advantage) is held to 1e-8 absolute
    rel = max((float((a - b).abs().max()) / max(float(b.abs().max()), 1e-4)
               for a, b in zip(gf, gr)), default=0.0)
    record["max_rel_grad_diff"] = max(record["max_rel_grad_diff"], rel)
    record["max_abs_loss_diff"] = max(record["max_abs_loss_diff"], abs(lf - lr_))
    record["checks"] += 1


def rl_step(model, opt, roll, args, parity_record=None):
    lib = gbc if args.loss == "fused" else gbc_reference
    results, logged = [], []

    def compute(phase):
        if parity_record is not None:
            parity_check(model, roll, args, phase, parity_record)
        if phase is None or logged:
            return policy_loss(model, roll, args, phase, lib)
        # Lopti's first phase: the logged terms are the batch's without the split
        token_out = {} if lib is gbc else None
        out = policy_loss(model, roll, args, phase, lib,
                          **({} if token_out is None else {"token_out": token_out}))
        logged.append(unsplit_loss(model, roll, args, lib, token_out))
        return out

    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if args.lopti_eta is None:
        opt.zero_grad(set_to_none=True)
        loss, metrics = compute(None)
        loss.backward()
        clip()
        opt.step()
        results.append((loss, metrics))
    else:     # old_logp, and so the split, fixed at the rollout for both updates
        results = methods.run_lopti(compute, opt, order=args.lopti_order, before_step=clip)
    # Lopti: the first phase's metrics (the parameters the batch met), the loss terms the
    # batch's without the split (adding the phases' losses counted their KL / entropy twice)
    loss, unsplit = results[0] if not logged else logged[0]
    loss = float(loss.detach())
    metrics = {k: float(v) for k, v in {**results[0][1], **{
        k: v for k, v in unsplit.items() if not k.startswith("grad_")}}.items()}
    if len(results) == 2:       # Lopti: the step's share over both updates
        share = methods.lopti_grad_share_low(results, args.lopti_order)
        if share is not None:
            metrics["grad_share_low"] = share
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------


def setup(args):
    if args.task == "scratchpad":
        import pretrain_scratchpad as ps
        model, tok, meta = ps.load(args.checkpoint or ps.CHECKPOINT)
        model.train()
        n = int(meta["digits"])
        args.digits, args.sft_steps = n, 0
        rev = bool(meta.get("reversed_prompt", False))      # the checkpoint's prompt format
        rl = ScratchpadAdditionTask(args.rl_digits or n, tok, partial_credit=args.partial_credit,
                                    longest_only=args.longest_only, reversed_prompt=rev,
                                    paper_mix=args.paper_mix,
                                    final_carry=True if args.final_carry else None)
        # the checkpoint's own distribution (what a KL penalty protects)
        known = ScratchpadAdditionTask(
            n, tok, reversed_prompt=rev,
            final_carry=None if meta.get("final_carry", True) else False)
        return tok, model, known, rl
    if args.task == "add":
        tok = CharTokenizer()
        model = tiny_qwen2(tok.vocab_size, args.seed)
        return (tok, model, AdditionTask(args.digits, tok),
                AdditionTask(args.digits + 1, tok, partial_credit=args.partial_credit))
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if args.model is None:
        raise SystemExit("--task kk needs --model PATH (a local Hugging Face causal LM)")
    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    tok.decode_ = tok.decode
    tok.decode = lambda ids: tok.decode_(ids, skip_special_tokens=True)
    return tok, model, None, KKTask(tok, seed=args.seed)


def train(args, log=print, model=None, tok=None, tasks=None, hooks=None):
    """SFT warm-up (addition) then GRPO. Returns the list of per-step metric dicts.

    ``hooks`` (examples/experiments.py): an object with ``before(model, roll, args)``, called
    before each RL update, and ``after(model, roll, args, state, metrics) -> dict``, called after
    it with what ``before`` returned; the dict joins the step's metrics."""
    os.makedirs(args.out, exist_ok=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if model is None:
        tok, model, sft_task, rl_task = setup(args)
        if sft_task is not None and args.sft_steps:
            sft(model, sft_task, args, log, harder=rl_task)
    else:
        sft_task, rl_task = tasks
    args.max_len = rl_task.max_answer_tokens
    model.to(getattr(torch, args.dtype))
    ref_model = copy.deepcopy(model).eval()
    for p in ref_model.parameters():
        p.requires_grad_(False)
    acc0 = evaluate(model, rl_task, tok, args.eval_size, args.seed, args.temperature) \
        if args.task != "kk" else None
    # scratchpad with an RL task other than the checkpoint's own: the pre-training's
    # distribution too (what the KL penalty protects)
    own = sft_task if args.task == "scratchpad" and (
        args.final_carry or args.paper_mix or args.longest_only
        or rl_task.digits != sft_task.digits) else None
    if own is not None:
        acc0.update(own_accuracy(model, own, tok, args))
    if acc0 is not None:
        log(f"RL task ({rl_task.digits}-digit) accuracy before RL: greedy {acc0['greedy']:.3f}, "
            f"sampled {acc0['sampled']:.3f}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rng = random.Random(args.seed + 1)
    parity = dict(steps=0, checks=0, max_rel_grad_diff=0.0, max_abs_loss_diff=0.0) \
        if args.parity else None
    history = []
    from tqdm import tqdm
    bar = tqdm(range(args.steps), disable=args.quiet, desc="GRPO", dynamic_ncols=True)
    with open(os.path.join(args.out, "metrics.jsonl"), "w") as f:
        for step in bar:
            t0 = time.time()
            roll = rollout(model, ref_model, rl_task, tok, args, rng)
            state = hooks.before(model, roll, args) if hooks is not None else None
            loss, metrics = rl_step(model, opt, roll, args, parity)
            row = dict(step=step, reward=float(roll["rewards"].mean()),
                       accuracy=float(roll["correct"].float().mean()), loss=loss,
                       seconds=time.time() - t0, **metrics, **roll["extra"])
            if hooks is not None:
                row.update(hooks.after(model, roll, args, state, metrics))
            if parity is not None:
                parity["steps"] = step + 1
            history.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            bar.set_postfix(reward=f"{row['reward']:.3f}", acc=f"{row['accuracy']:.2f}",
                            loss=f"{loss:+.4f}")
    if args.task != "kk":
        acc1 = evaluate(model, rl_task, tok, args.eval_size, args.seed, args.temperature)
        if own is not None:
            acc1.update(own_accuracy(model, own, tok, args))
        for kind in ("greedy", "sampled"):
            log(f"RL task {kind} accuracy: before {acc0[kind]:.3f} -> after {acc1[kind]:.3f}")
            if f"{kind}_new" in acc0:
                new = " (new)" if rl_task.digits > args.digits else ""
                log(f"  operands of {rl_task.digits} digits{new}: {acc0[kind + '_new']:.3f} -> "
                    f"{acc1[kind + '_new']:.3f}; shorter: "
                    f"{acc0[kind + '_known']:.3f} -> {acc1[kind + '_known']:.3f}")
            if f"own_{kind}" in acc0:
                log(f"  the checkpoint's own sums: {acc0['own_' + kind]:.3f} -> "
                    f"{acc1['own_' + kind]:.3f}")
        final = dict(eval_before=acc0["greedy"], eval_after=acc1["greedy"],
                     eval_sampled_before=acc0["sampled"], eval_sampled_after=acc1["sampled"])
        for key in acc0:
            if key.endswith(("_new", "_known")) or key.startswith("own_"):
                final[f"eval_{key}_before"], final[f"eval_{key}_after"] = acc0[key], acc1[key]
        history.append(final)
    plot_curves(history, os.path.join(args.out, "curves.png"))
    if parity is not None:
        parity["features"] = [k for k, on in (("ar", args.ar_alpha != 0.0),
                                              ("lopti", args.lopti_eta is not None),
                                              ("nthr", args.nthr),
                                              ("critical_kl", args.critical_kl_exponent is not None))
                              if on]
        with open(os.path.join(args.out, "parity.json"), "w") as f:
            json.dump(parity, f, indent=2)
        log(f"parity: {json.dumps(parity)}")
        ok = parity["max_rel_grad_diff"] <= 1e-4 and parity["max_abs_loss_diff"] <= 1e-5
        if not ok:
            raise SystemExit("parity FAILED: fused and reference differ beyond fp32 tolerance "
                             "(1e-4 relative on gradients, 1e-5 absolute on the loss)")
    return history


def smooth(xs, k=5):
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1])
            for i in range(len(xs))]


def plot_curves(history, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [h for h in history if "step" in h]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot([h["reward"] for h in steps], alpha=0.3, color="C0")
    ax[0].plot(smooth([h["reward"] for h in steps]), color="C0", label="reward")
    ax[0].plot(smooth([h["accuracy"] for h in steps]), color="C1", label="accuracy (sampled)")
    ax[0].set_xlabel("RL step")
    ax[0].legend()
    ax[1].plot([h["grad_share_low"] for h in steps], color="C2")
    ax[1].set_xlabel("RL step")
    ax[1].set_title("grad_share_low (share of the policy-gradient norm on p_old < eta)",
                    fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare(args):
    """GRPO vs +AR vs +Lopti vs +AR+Lopti from the same initialisation, over several seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    variants = {"GRPO": {}, "+AR": dict(ar_alpha=0.3), "+Lopti": dict(lopti_eta=0.5),
                "+AR+Lopti": dict(ar_alpha=0.3, lopti_eta=0.5)}
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {v: [] for v in variants}
    base_out = args.out
    for seed in seeds:
        a0 = copy.copy(args)
        a0.seed, a0.out, a0.quiet = seed, os.path.join(base_out, f"sft-{seed}"), True
        tok, model0, sft_task, rl_task = setup(a0)
        sft(model0, sft_task, a0, lambda *_: None, harder=rl_task)
        for name, over in variants.items():
            a = copy.copy(args)
            a.seed, a.quiet = seed, True
            a.out = os.path.join(base_out, f"{name.strip('+').replace('+', '_')}-{seed}")
            for k, v in over.items():
                setattr(a, k, v)
            hist = train(a, log=lambda *_: None, model=copy.deepcopy(model0), tok=tok,
                         tasks=(sft_task, rl_task))
            results[name].append(hist)
            ev = hist[-1]
            print(f"seed {seed} {name:>10}: greedy accuracy {ev['eval_before']:.3f} -> "
                  f"{ev['eval_after']:.3f}, sampled {ev['eval_sampled_before']:.3f} -> "
                  f"{ev['eval_sampled_after']:.3f}", flush=True)
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    summary = {}
    for i, (name, runs) in enumerate(results.items()):
        curves = [[h["reward"] for h in r if "step" in h] for r in runs]
        mean = [sum(c[t] for c in curves) / len(curves) for t in range(len(curves[0]))]
        share = [[h["grad_share_low"] for h in r if "step" in h] for r in runs]
        mshare = [sum(c[t] for c in share) / len(share) for t in range(len(share[0]))]
        ax[0].plot(smooth(mean), label=name, color=f"C{i}")
        ax[1].plot(smooth(mshare), label=name, color=f"C{i}")
        after = [r[-1]["eval_after"] for r in runs]
        sampled = [r[-1]["eval_sampled_after"] for r in runs]
        summary[name] = dict(eval_before=[r[-1]["eval_before"] for r in runs], eval_after=after,
                             eval_after_mean=sum(after) / len(after),
                             eval_sampled_before=[r[-1]["eval_sampled_before"] for r in runs],
                             eval_sampled_after=sampled,
                             eval_sampled_after_mean=sum(sampled) / len(sampled),
                             final_reward_mean=sum(mean[-10:]) / len(mean[-10:]),
                             grad_share_low_mean=sum(mshare) / len(mshare))
    ax[0].set_title(f"reward (mean of {len(seeds)} seeds, smoothed)")
    ax[1].set_title("grad_share_low")
    for a_ in ax:
        a_.set_xlabel("RL step")
        a_.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(base_out, "compare.png"), dpi=100)
    with open(os.path.join(base_out, "compare.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))


def main(argv=None):
    args = build_args(argv)
    if args.parity:
        # every method on, so the parity covers them all
        args.ar_alpha = args.ar_alpha or 0.3
        args.lopti_eta = args.lopti_eta or 0.5
        args.nthr = True
        args.kl_coef = args.kl_coef or 0.05
        args.critical_kl_exponent = args.critical_kl_exponent or 2.0
        torch.set_default_dtype(torch.float32)
    try:
        method_options(args)
    except ValueError as exc:
        sys.exit(f"grpo_trainer.py: error: {exc}")
    if args.compare:
        return compare(args)
    train(args)


if __name__ == "__main__":
    main()
