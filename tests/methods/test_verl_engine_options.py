"""Every method option on gbc's verl FSDP engine (integrations/verl/fsdp.py, ``GBC_VERL_ENGINE``)
is honoured or refused by name: for each option of tests/methods/test_options.PAIRS, the run
with B's options against the run with A's, from the same parameters and the same batch, changes
what the option acts on and then the update — never accepted and ignored.

One FSDP2 engine of verl's (one gloo rank, the CPU set-up of tests/test_verl_engine.py), built
once; each run restores its parameters and optimizer state. What each option goes through:
- AR and Lopti: the engine's ``train_batch`` (Lopti: its two updates);
- NTHR: gbc's hook on verl's ``TrainingWorker.train_mini_batch`` (the old-policy pass writes
  the token scales into the batch), then the update (a stand-in for the rest of verl's
  worker function: ``train_batch`` in train mode);
- critical-token KL: the trainer's reference pass as gbc patches it (``compute_ref_log_prob``,
  the weights from the engine's forward-only step), then the update with verl's KL loss term on.
"""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")

from conftest import spawn_gloo  # noqa: E402
from test_other_trainers import verl_actor_config  # noqa: E402
from test_verl_engine import (GROUP, NB, _params, build_engine, make_batch,  # noqa: E402
                              make_model_dir, verl_on_cpu)

from .test_options import FIELDS, PAIRS  # noqa: E402

SEED = 11
KL_COEF = 1.0          # verl's kl_loss_coef (use_kl_loss on, low_var_kl)
REF_SHARPEN = 10.0     # the reference model: the policy with its lm_head weight times this
SWITCH = {"nthr": "nthr", "critical_kl": "critical_kl_exponent"}


def _route(name):
    """How an option reaches the update: "update" (train_batch), "nthr" (the worker hook's
    pass), "reference" (the trainer's reference pass). A new option has none: the test fails
    until it is given one here."""
    if name.startswith(("ar_", "lopti_")):
        return "update"
    if name.startswith("nthr"):
        return "nthr"
    if name.startswith("critical_kl"):
        return "reference"
    if name == "logits_dtype":      # every pass: the reference pass, NTHR's, the update
        return "precision"
    raise AssertionError(f"{name}: no route through verl's engine in this test; add one")


def _vector(engine):
    p = _params(engine)
    return torch.cat([p[n].reshape(-1) for n in sorted(p)])


def _options_worker(rank, world, model_dir):
    verl_on_cpu()
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    from gbc_kernels.integrations.verl import engine as ve

    # SGD: the update is linear in the gradient
    engine = build_engine(model_dir, lr=0.5, optimizer="SGD")
    cls = type(engine)
    cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl", kl_loss_coef=KL_COEF)
    loss_fn = functools.partial(ppo_loss, config=cfg)

    def state():
        return (copy.deepcopy(engine.module.state_dict()),
                copy.deepcopy(engine.optimizer.state_dict()))

    def restore(s):
        engine.module.load_state_dict(s[0])
        engine.optimizer.load_state_dict(s[1])

    def batch():           # the update batch: a few sure old tokens (both Lopti phases)
        return make_batch(SEED, NB, group=GROUP, confident=0.4)

    def update(data):
        with engine.train_mode():
            engine.train_batch(data, loss_fn)
        return _vector(engine)

    # the policy starts at the initial model; the reference model is the policy with a sharper
    # lm_head: KL > 0 at the first update, and reference certainties spread over (0, 1) (on the
    # initial model's near-uniform distributions every J^gamma is ~0 and the critical-KL
    # options could not move the weights)
    cls.gbc_options = ve.EngineOptions()
    start, start_vec = state(), _vector(engine)
    reference = (copy.deepcopy(start[0]), start[1])
    with torch.no_grad():
        reference[0]["lm_head.weight"].mul_(REF_SHARPEN)

    # verl's worker around gbc's NTHR hook (its forward-only micro-batching keys)
    ec = SimpleNamespace(use_dynamic_bsz=False, infer_max_token_len_per_gpu=64,
                         infer_micro_batch_size_per_gpu=2, micro_batch_size_per_gpu=2,
                         use_fused_kernels=False)
    worker = SimpleNamespace(engine=engine, engine_config=ec,
                             model_config={"use_remove_padding": True}, loss_fn=loss_fn)
    hooked = ve._nthr_before_update(lambda self, data: update(data))

    def ref_worker(td):     # the reference worker's compute_ref_log_prob: its infer_batch
        tu.assign_non_tensor(td, use_remove_padding=True, use_dynamic_bsz=False,
                             micro_batch_size_per_gpu=2, max_token_len_per_gpu=64,
                             use_fused_kernels=False)
        with engine.eval_mode():
            return engine.infer_batch(td, loss_function=None)["model_output"]

    class Trainer:
        """verl's RayPPOTrainer as compute_ref_log_prob reads it; its own reference pass (run
        without critical_kl_exponent) is verl 0.9.1's ``_compute_ref_log_prob``."""
        config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(
            actor={"use_kl_loss": True}))
        ref_in_actor = False
        ref_policy_wg = SimpleNamespace(compute_ref_log_prob=ref_worker)

        def _compute_ref_log_prob(self, data):
            td = left_right_2_no_padding(data.to_tensordict())
            tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
            out = self.ref_policy_wg.compute_ref_log_prob(td)
            logp = no_padding_2_padding(tu.get(out, "log_probs"), td)
            return DataProto.from_tensordict(tu.get_tensordict({"ref_log_prob": logp.float()}))

    def run(name, opts):
        """(what the option acts on before the update, or None; the parameters after it;
        the reference log-probs of the update batch)."""
        options = ve.EngineOptions(**opts)
        cls.gbc_options = options
        ve._OPTIONS["current"] = options
        route = _route(name)
        data = batch()
        if route == "precision":     # the sweeps' logits_dtype, in place of what it acts on
            from conftest import logits_dtypes_seen
            with logits_dtypes_seen() as seen:
                restore(reference)
                fields = make_batch(SEED, NB, group=GROUP, confident=0.4, padded=True)
                out = ve.compute_ref_log_prob(
                    Trainer(), DataProto.from_dict(tensors=fields,
                                                   meta_info={"temperature": 0.8}))
                data["ref_log_prob"] = out.batch["ref_log_prob"]
                data[ve.KL_WEIGHT_KEY] = out.batch[ve.KL_WEIGHT_KEY]
                restore(start)
                hooked(worker, data)
            return list(seen), _vector(engine), data["ref_log_prob"]
        if route == "reference":
            restore(reference)
            fields = make_batch(SEED, NB, group=GROUP, confident=0.4, padded=True)
            out = ve.compute_ref_log_prob(
                Trainer(), DataProto.from_dict(tensors=fields, meta_info={"temperature": 0.8}))
            data["ref_log_prob"] = out.batch["ref_log_prob"]
            weight = out.batch.get(ve.KL_WEIGHT_KEY, None)
            if weight is not None:
                data[ve.KL_WEIGHT_KEY] = weight
            restore(start)
            return weight, update(data), data["ref_log_prob"]
        restore(start)
        if route == "nthr":
            hooked(worker, data)
            return data.get(ve.SCALE_KEY, None), _vector(engine), data["ref_log_prob"]
        return None, update(data), data["ref_log_prob"]

    out = {}
    try:
        for name, pair in sorted(PAIRS.items()):
            runs = []
            for opts in pair:
                try:
                    runs.append(run(name, opts))
                except ValueError as e:
                    runs.append(str(e))
            out[name] = runs
        # the restore is exact: the first run again gives the same parameters
        name0 = min(PAIRS)
        again = run(name0, PAIRS[name0][0])[1]
    finally:
        cls.gbc_options = ve.EngineOptions()
        ve._OPTIONS.pop("current", None)
    return out, start_vec, again


def test_every_field_is_enumerated():
    from gbc_kernels.integrations.verl import engine as ve

    from .test_options import SUPPORT_FIELDS      # tests/test_verl_support.py

    assert set(PAIRS) | SUPPORT_FIELDS == FIELDS == set(ve.OPTION_NAMES) - {"backend"}
    for name in PAIRS:
        _route(name)


def test_every_method_option_changes_the_update_or_is_refused(tmp_path):
    """Per option (A and B of PAIRS): the NTHR scales the worker hook writes, or the KL weights
    of the reference pass, differ; and the parameters after the update differ by more than
    rounding (a share of the update's total change). An option the engine refuses raises a
    ValueError naming it (or the switch it goes with)."""
    model_dir = make_model_dir(tmp_path / "m")
    out, start, again = spawn_gloo(1, _options_worker, model_dir)[0]
    assert set(out) == set(PAIRS)
    name0 = min(PAIRS)
    assert torch.equal(again, out[name0][0][1]), "restoring the engine's state is not exact"
    for name, (ra, rb) in sorted(out.items()):
        refused = [r for r in (ra, rb) if isinstance(r, str)]
        if refused:
            switch = next((s for p, s in SWITCH.items() if name.startswith(p)), name)
            assert all(r.startswith((f"{name}:", f"{switch}:")) for r in refused), (name, refused)
            continue
        (sa, pa, ref_a), (sb, pb, ref_b) = ra, rb
        if _route(name) == "precision":   # float32 test model: the mode reached every sweep
            from conftest import assert_logits_mode_reached
            assert_logits_mode_reached(sa, sb, at_least=3)
            continue
        # the same reference log-probs (gbc's reference pass, or verl's without the option):
        # what differs is the option's
        assert torch.allclose(ref_a, ref_b, rtol=1e-5, atol=1e-6), name
        if _route(name) != "update":
            sa = torch.ones_like(sb) if sa is None else sa
            sb = torch.ones_like(sa) if sb is None else sb
            gap = float((sa - sb).abs().max())
            assert gap > 1e-3, (name, "the scales / KL weights it acts on are equal", gap)
        total = float((pa - start).abs().max())
        assert total > 1e-3, name
        diff = float((pa - pb).abs().max())
        assert diff > 1e-3 * total, (name, diff, total)
