"""gbc's engine inside verl 0.9.1's FSDP2 actor engine, on CPU: a few actor updates of a tiny
Qwen2 (Qwen2.5's vocabulary size) through verl's own ``train_batch``, with gbc switched on the
way a verl run switches it on (``GBC_VERL_ENGINE=1``: the ``verl.plugins`` entry point).

    python examples/verl_engine.py

In a real run the same switch is one line of the launch command (README, "Use with verl"):
``+ray_kwargs.ray_init.runtime_env.env_vars.GBC_VERL_ENGINE=1``. verl registers its engines for
cuda/npu only, so on CPU this script builds the engine class from verl's registry itself, with
the CPU platform stand-in of the tests (tests/standins/verl_cpu_platform.py).
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(steps: int = 3, vocab: int = 151936):
    os.environ["GBC_VERL_ENGINE"] = "strict"
    os.environ.setdefault("GBC_VERL_OPTIONS", "ar_alpha=0.3,lopti_eta=0.5,nthr=1,nthr_beta=0")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29561"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import verl                                   # noqa: F401  (loads gbc's plugin)
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_verl_engine as tve                # the tests' CPU set-up and batch builder
    from test_other_trainers import verl_actor_config

    engine_cls = EngineRegistry._engines["language_model"]["fsdp2"]["cuda"]
    print(f"verl's registry hands out {engine_cls.__name__} with {engine_cls.gbc_options}")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        tve.verl_on_cpu()
        with tempfile.TemporaryDirectory() as d:
            model_dir = tve.make_model_dir(os.path.join(d, "m"), vocab=vocab, hidden=64)
            # verl's own engine class from the registry, built as its TrainingWorker does
            from verl.trainer.config import CheckpointConfig
            from verl.workers.config import (FSDPEngineConfig, FSDPOptimizerConfig,
                                             HFModelConfig)
            engine = engine_cls(
                HFModelConfig(path=model_dir, use_remove_padding=True,
                              override_config={"attn_implementation": "sdpa"}),
                FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False,
                                 mixed_precision={"param_dtype": "fp32"}),
                FSDPOptimizerConfig(lr=1e-3), CheckpointConfig())
            engine.initialize()
            cfg = verl_actor_config("gspo", "seq-mean-token-mean", "low_var_kl",
                                    entropy_coeff=0.001)
            loss_fn = functools.partial(ppo_loss, config=cfg)
            out = None
            for step in range(steps):
                data = tve.make_batch(step, 8, micro=4, vocab=vocab, confident=0.3,
                                      lengths=(16, 48), group=4)
                # verl's compute_log_prob: the old policy's log-probs (gbc's forward-only pass).
                # An untrained model puts ~1/V on every token: Lopti's high phase is empty and
                # its second update's gradient norm is 0 here, not in a real run
                with engine.eval_mode():
                    o = engine.infer_batch(data.clone(), loss_function=None)
                data["old_log_probs"] = no_padding_2_padding(o["model_output"]["log_probs"],
                                                             data).float()
                if engine.gbc_options.nthr:
                    # what gbc's wrapper of verl's TrainingWorker.train_mini_batch runs first:
                    # NTHR's old-policy pass over the update batch (no grad, no logits)
                    with engine.eval_mode():
                        engine.gbc_nthr_pass(data)
                with engine.train_mode():
                    out = engine.train_batch(data, loss_fn)
                m = out["metrics"]
                pick = lambda k: [round(float(getattr(v, "values", [v])[0]
                                              if hasattr(v, "values") else v), 4)
                                  for v in (m[k] if isinstance(m[k], list) else [m[k]])]
                print(f"update {step}: actor/pg_loss {pick('actor/pg_loss')} kl_loss "
                      f"{pick('kl_loss')} grad_norm {m['grad_norm']:.4f} (Lopti's second "
                      f"update: {m['gbc_grad_norm_second_phase']:.4f})"
                      + (f" NTHR selected {pick('actor/gbc_nthr_selected_frac')}"
                         if engine.gbc_options.nthr else ""))
            return out
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
