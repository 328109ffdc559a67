"""GRPO with AReaL 1.0.4's FSDP PPO actor and gbc's head, on CPU (docs/areal.md).

The actor is AReaL's own, reached the way AReaL's trainer reaches it: ``enable()`` switches
``areal.engine.FSDPPPOActor`` to gbc's class, and this script builds the name it imports.
Each step: sample a group of answers per prompt from a rollout copy of the policy (HF
``generate``: AReaL's rollout servers need a GPU), score them, then AReaL's own
``compute_logp`` (the proximal policy) -> ``compute_advantages`` (group-normalised rewards)
-> ``ppo_update`` (decoupled PPO with rejection sampling), whose log-probs come from gbc's
fused pass, without the ``[tokens, V]`` logits; the rollout copy then takes the new weights.
The task is the shipped scratchpad-addition checkpoint's (examples/checkpoints/scratchpad-add3,
docs/example-trainer.md): sampled at temperature 3 it is right ~20% of the time.

Run where AReaL is installed (``make compat ONLY=areal`` builds that venv):

    python examples/areal_grpo.py                       # 8 steps, AR, Lopti and NTHR on
    python examples/areal_grpo.py --options ""          # gbc's head alone
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")     # AReaL's torch.compile: eager on CPU

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pretrain_scratchpad as ps  # noqa: E402
from grpo_tasks import ScratchpadAdditionTask  # noqa: E402


def save_for_areal(model, tok, path):
    """The checkpoint and a tokenizer AReaL can load (``load_hf_tokenizer(path)``): a word-level
    tokenizer over the scratchpad's characters, ids as ``ScratchpadTokenizer``'s."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": tok.PAD, "<bos>": tok.BOS, "<eos>": tok.EOS}
    vocab.update({c: 3 + i for i, c in enumerate(tok.CHARS)})
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                            pad_token="<pad>", bos_token="<bos>",
                            eos_token="<eos>").save_pretrained(path)
    model.save_pretrained(path)


@torch.no_grad()
def rollout(sampler, task, tok, rng, prompts, group, temperature):
    """AReaL trajectories (its RLVRWorkflow's keys) for ``prompts`` x ``group`` samples, with
    the sampler's log-probs at ``temperature``, one trajectory per prompt holding its
    ``group`` answers (as AReaL's GroupedRolloutWorkflow concatenates them: NTHR's groups);
    and the mean reward."""
    from areal.utils.data import concat_padded_tensors

    batch = task.sample(prompts, rng)
    ids = batch.prompts.repeat_interleave(group, 0)
    out = sampler.generate(ids, attention_mask=(ids != tok.PAD).long(),
                           max_new_tokens=task.max_answer_tokens, do_sample=True,
                           temperature=temperature, top_k=0, top_p=None,
                           eos_token_id=tok.EOS, pad_token_id=tok.PAD)
    rewards, _ = task.score([tok.decode(c) for c in out[:, ids.shape[1]:]], batch, group)
    trajs = []
    for i in range(out.shape[0]):
        seq = out[i][out[i] != tok.PAD]                # the prompt's left padding dropped
        P = int((ids[i] != tok.PAD).sum())
        ends = (seq[P:] == tok.EOS).nonzero()
        seq = seq[:P + int(ends[0]) + 1] if len(ends) else seq
        logits = sampler(seq[None]).logits[0, :-1].float() / temperature
        lp = torch.zeros(len(seq))
        lp[P:] = torch.log_softmax(logits, -1)[P - 1:].gather(-1, seq[P:, None])[:, 0]
        trajs.append({k: v.unsqueeze(0) for k, v in dict(
            input_ids=seq.int(), logprobs=lp,
            loss_mask=(torch.arange(len(seq)) >= P).int(),
            versions=torch.where(torch.arange(len(seq)) >= P, 0, -1).int(),
            attention_mask=torch.ones(len(seq), dtype=torch.bool),
            rewards=torch.tensor(float(rewards[i]))).items()})
    trajs = [concat_padded_tensors(trajs[i:i + group]) for i in range(0, len(trajs), group)]
    return trajs, float(torch.as_tensor(rewards).float().mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=3.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--options", default="ar_alpha=0.3,lopti_eta=0.5,nthr=true",
                    help="gbc's method options (GBC_AREAL_OPTIONS); '' for none")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    tmp = tempfile.mkdtemp(prefix="areal_grpo_")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      AREAL_SPMD_MODE="1")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
    sampler, tok, meta = ps.load()
    save_for_areal(sampler, tok, tmp)
    task = ScratchpadAdditionTask(int(meta["digits"]), tok,
                                  reversed_prompt=bool(meta.get("reversed_prompt", False)))

    import gbc_kernels.integrations.areal as gbc_areal
    from areal.api.cli_args import (MicroBatchSpec, NormConfig, OptimizerConfig,
                                    PPOActorConfig, RejectionSamplingConfig)
    from areal.api.io_struct import FinetuneSpec
    from areal.utils import stats_tracker

    options = dict(kv.split("=") for kv in args.options.split(",") if kv)
    config = PPOActorConfig(
        experiment_name="areal_grpo", trial_name="cpu", path=tmp, attn_impl="sdpa",
        dtype="float32", optimizer_dtype="float32", backend="fsdp:d1",
        optimizer=OptimizerConfig(type="adam", lr=args.lr, weight_decay=0.0,
                                  lr_scheduler_type="constant"),
        mb_spec=MicroBatchSpec(n_mbs=2), ppo_n_minibatches=1, kl_ctl=0.0,
        temperature=args.temperature, use_decoupled_loss=True,
        rejection_sampling=RejectionSamplingConfig(level="token", action="clamp",
                                                   metric="ratio", upper=5.0),
        reward_norm=NormConfig(mean_level="group", std_level="group", group_size=args.group))
    gbc_areal.enable(config, **options)
    from areal.engine import FSDPPPOActor           # what AReaL's trainer imports: gbc's now

    actor = FSDPPPOActor(config)
    actor.create_process_group()
    actor.initialize(addr=None, ft_spec=FinetuneSpec(1, args.steps, 1))
    print(f"actor: {type(actor).__module__}.{type(actor).__name__}; options: "
          f"{args.options or 'none'}", flush=True)
    rng = random.Random(args.seed)
    for step in range(args.steps):
        t0 = time.time()
        trajs, reward = rollout(sampler, task, tok, rng, args.prompts, args.group,
                                args.temperature)
        for traj, lp in zip(trajs, actor.compute_logp(trajs)):
            traj["prox_logp"] = lp
        actor.ppo_update(actor.compute_advantages(trajs))
        stats = stats_tracker.export_all(reset=True)
        sampler.load_state_dict({n: (p.full_tensor() if hasattr(p, "full_tensor") else p)
                                 .detach() for n, p in actor.model.state_dict().items()})
        print(f"step {step + 1}/{args.steps}: sampled reward {reward:.3f}, "
              f"actor_loss {stats.get('ppo_actor/update/actor_loss/avg', float('nan')):+.4f}, "
              f"entropy {stats.get('ppo_actor/update/entropy/avg', float('nan')):.3f}, "
              f"clip_ratio {stats.get('ppo_actor/update/clip_ratio/avg', float('nan')):.3f}, "
              f"nthr_selected_frac {stats.get('ppo_actor/nthr_selected_frac', float('nan')):.3f} "
              f"({time.time() - t0:.1f} s)", flush=True)
    actor.destroy()
    gbc_areal.disable()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
