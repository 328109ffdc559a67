"""The one reference of the method tests: a plain PyTorch RL update on a Hugging Face model
(full logits, ``gbc_reference``'s loss, autograd, SGD) that every adapter's update is held to.

Lopti (docs/math.md §3, §13): ``old_logp`` from the rollout policy, computed once before the
first update; the low phase, an SGD step, the high phase on the updated model with the SAME
``old_logp`` (its ratio carries the first step's drift), an SGD step.
"""

from __future__ import annotations

import copy

import torch

import gbc_reference as ref


def completion_logp(model, input_ids, attention_mask, completion_len, temperature=1.0):
    """Full-logits log-probs of the last ``completion_len`` tokens (float32)."""
    T = completion_len
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -T - 1:-1]
    lsm = torch.log_softmax(logits.float() / temperature, dim=-1)
    return lsm.gather(-1, input_ids[:, -T:, None])[..., 0]


def rl_update(model0, input_ids, attention_mask, completion_len, mask, advantages, cfg_kw,
              lr, phases=(None,), old_logp=None, ref_logp=None, token_scale=None,
              kl_weight=None, resplit=False, temperature=1.0):
    """A copy of ``model0`` after one RL step of SGD(lr) per phase. ``old_logp`` None: taken
    from ``model0`` (on-policy) before the first update. ``resplit=True``: the defect
    docs/methods.md (Lopti, "The rules") forbids — each phase takes ``old_logp`` from the model
    as it is then."""
    model = copy.deepcopy(model0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    args = (input_ids, attention_mask, completion_len)
    if old_logp is None:
        with torch.no_grad():
            old_logp = completion_logp(model, *args, temperature=temperature)
    for phase in phases:
        opt.zero_grad(set_to_none=True)
        logp = completion_logp(model, *args, temperature=temperature)
        old = logp.detach() if resplit else old_logp
        cfg = ref.PolicyLossConfig(**cfg_kw)
        loss, _ = ref.policy_loss(logp, mask, advantages, old, ref_logp, config=cfg,
                                  phase=phase, token_scale=token_scale, kl_weight=kl_weight)
        loss.backward()
        opt.step()
    return model


def max_rel_diff(model_a, model_b, start):
    """The largest parameter difference between two updated models, relative to the largest
    update of ``model_b`` from ``start``."""
    pb = dict(model_b.named_parameters())
    ps = dict(start.named_parameters())
    diff = max(float((p - pb[n]).abs().max()) for n, p in model_a.named_parameters())
    update = max(float((pb[n] - ps[n]).abs().max()) for n in pb)
    return diff / max(update, 1e-30)


# ------------------------------------------------------------------------ adapters' runs
def trl_trainer(tiny, tmp_path, reward=None, model=None, **options):
    """A GBCGRPOTrainer on the tiny model (or ``model``): 4 completions of one prompt per step,
    SGD at a constant rate, no gradient clipping, TRL's bnpo loss; ``options``:
    GBCGRPOConfig's."""
    import warnings

    import pytest

    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from gbc_kernels.integrations.trl import GBCGRPOConfig, GBCGRPOTrainer

    kw = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
              max_completion_length=6, report_to=[], use_cpu=True, bf16=False, logging_steps=1,
              save_strategy="no", seed=0, optim="sgd", lr_scheduler_type="constant",
              max_grad_norm=0.0, weight_decay=0.0, loss_type="bnpo", beta=0.0, max_steps=1)
    kw.update(options)
    reward = reward or (lambda completions, **k: [float(len(c) % 3 == 0) for c in completions])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(tiny) if model is None else model
        return GBCGRPOTrainer(model=model,
                              reward_funcs=reward, args=GBCGRPOConfig(**kw),
                              train_dataset=Dataset.from_dict(
                                  {"prompt": ["you meet knights and knaves"] * 4}),
                              processing_class=AutoTokenizer.from_pretrained(tiny))


def spy_losses(trainer):
    """Record every ``_compute_loss`` call's tensor inputs and loss, in order."""
    seen = []
    compute = trainer._compute_loss

    def spy(model, inputs):
        loss = compute(model, inputs)
        seen.append(({k: v for k, v in inputs.items() if torch.is_tensor(v)},
                     float(loss.detach())))
        return loss

    trainer._compute_loss = spy
    return seen


def sequences(x):
    """(input_ids, attention_mask, completion length, completion mask) of a TRL batch."""
    ids = torch.cat([x["prompt_ids"], x["completion_ids"]], 1)
    attn = torch.cat([x["prompt_mask"], x["completion_mask"]], 1)
    return ids, attn, x["completion_ids"].shape[1], x["completion_mask"]


def completion_hidden_and_head(model, ids, attn, T):
    """The final hidden states predicting the last ``T`` tokens and the lm_head weight,
    float64 (the reference's inputs)."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attn, output_hidden_states=True)
    h = out.hidden_states[-1][:, -T - 1:-1].double()
    return h, model.get_output_embeddings().weight.detach().double()


def example_rollout(flags):
    """One rollout of the example trainer (``examples/grpo_trainer.py`` with ``flags``, the
    shipped checkpoint) and the float64 hidden states and head of its completion:
    ``(args, roll, h, w, grpo_trainer module)``."""
    import random
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import grpo_trainer as gt
    from gbc_kernels.integrations import hf

    args = gt.build_args(flags)
    tok, model, _, task = gt.setup(args)
    torch.manual_seed(0)
    roll = gt.rollout(model, model, task, tok, args, random.Random(0))
    model.eval()
    h = hf.completion_hidden(model, roll["seq"], roll["attn"]).double()
    return args, roll, h, hf.lm_head(model).weight.detach().double(), gt
