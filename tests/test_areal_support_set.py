"""One kept set per rollout in gbc's AReaL engine (``support=replay``, ``support_set`` unset or
``rollout``: the default; issue 66; docs/areal.md, "The sampler's kept set"): the actor's
``compute_logp`` pass builds the set from its logits (``sampler_truncation``,
``return_support_ids``), each token's row of those ids travels in the trajectories
(``gbc_support_row``) through AReaL's own concatenation, minibatch split, packing and padding,
and every later pass replays it as ``support_ids``: the update's minibatches (the second after
an optimizer step), Lopti's second phase, the reference's pass, run after the actor's or, in
AReaL's trainer order, before it (the reference's pass has the actor's building pass run first
on the batch, whose result the actor's own ``compute_logp`` then returns: no second pass).
``support_set=per_pass`` (each pass rebuilds the set from its own logits) is the semantics of
tests/test_areal_support.py.

The rollouts are drawn (SGLang's rule, float64) from a sampler model a little off the policy
(its weights plus 0.002 noise: the rollout engine's numerics), so some sampled tokens fall
outside the set the training-side policy keeps: the building pass's forced share is above 0,
and under one set per rollout every later pass forces in exactly those tokens. The same run
under AReaL's Ulysses sequence parallelism (``fsdp:d1c2``, 2 gloo ranks, flash attention on
tests/standins/flash_attn) equals it at SP 1: the decoupled loss, coupled PPO, Lopti, and
``support_set=per_pass``. Runs in AReaL's venv (``make compat ONLY=areal``); skipped where
AReaL is not installed.
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

areal = pytest.importorskip("areal", reason="AReaL runs in its own venv: make compat ONLY=areal")

from conftest import spawn_gloo  # noqa: E402
from test_areal import _compare, _init, _params, make_config  # noqa: E402
from test_areal_support import (CONFIGS, P, R, T, TOP_K, TOP_P, _experiment,  # noqa: E402,F401
                                sglang_rollouts, switched, tiny)

SAMPLER = "top_k=50,top_p=0.9,min_p=0.0,ties=first,temperature=0.8"


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory):
    """(policy, reference, sampler): the sampler is the policy plus 0.002 noise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tmp_path_factory.mktemp("tiny_areal_sampler"))
    model = AutoModelForCausalLM.from_pretrained(tiny[0])
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for w in model.parameters():
            w.add_(0.002 * torch.randn(w.shape, generator=g))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny[0]).save_pretrained(path)
    return tiny[0], tiny[1], path


@torch.no_grad()
def built_sets(policy, ref_path, batch):
    """The float64 oracle of one set per rollout, per trajectory: the kept set the policy's
    logits give (``gbc_reference.truncation_support_ids``, SGLang's rule at ``T``; ``[S, V]``,
    -1 off the set, the target not forced in), the policy's and the reference model's
    log-probs over that set (the target forced in) and the policy's kept mass, aligned as
    AReaL's rolled log-probs."""
    import gbc_reference as ref
    from transformers import AutoModelForCausalLM

    out = dict(sets=[], prox=[], ref=[], kept=[])
    for which, path in (("prox", policy), ("ref", ref_path)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        seen = []
        model.lm_head.register_forward_pre_hook(lambda m, a: seen.append(a[0][0]))
        W = model.lm_head.weight
        for i, traj in enumerate(batch):
            ids = traj["input_ids"][0].long()
            model(ids[None])
            h, y = seen.pop(), torch.roll(ids, -1)
            if which == "prox":
                out["sets"].append(ref.truncation_support_ids(
                    h, W, y, temperature=T, top_k=TOP_K, top_p=TOP_P, ties="first",
                    rule="sglang"))
            lp, _, lk = ref.fused_linear_logprobs(h, W, y, temperature=T,
                                                  support_ids=out["sets"][i],
                                                  return_log_kept_mass=True)
            out[which].append(lp.float()[None])
            if which == "prox":
                out["kept"].append(lk.float()[None])
    return out


def _fixed_head(engine, batch, sets):
    """AReaL's stock engine with its logits restricted to the FIXED set of each trajectory
    (``sets``, the oracle's: built once, from the policy before any update; the rolled label
    always a member) and ``-1e30`` elsewhere, in every micro-batch of its update (one
    trajectory per micro-batch: its tokens first in the packed row)."""
    by_tokens = {tuple(t["input_ids"][0].tolist()): s >= 0 for t, s in zip(batch, sets)}
    inner, ids = engine.model, {}

    def keep_ids(module, args, kwargs):
        ids["x"] = kwargs.get("input_ids", args[0] if args else None)

    def mask(module, args, out):
        x = ids["x"].reshape(-1)
        keep = torch.ones(out.shape[-2:], dtype=torch.bool)
        s = by_tokens[tuple(x[:P + R].tolist())]
        keep[:P + R] = s
        keep.scatter_(-1, torch.roll(x, -1).long().unsqueeze(-1), True)
        return torch.where(keep.reshape(out.shape).to(out.device), out,
                           torch.full_like(out, -1e30))

    inner.register_forward_pre_hook(keep_ids, with_kwargs=True)
    inner.lm_head.register_forward_hook(mask)


def _forced(batch, sets):
    """The oracle's forced count of each trajectory (by its tokens): its response tokens whose
    sampled target is outside the set built from the policy."""
    out = {}
    for traj, s in zip(batch, sets):
        y = torch.roll(traj["input_ids"][0].long(), -1)[P - 1:P + R - 1]
        member = (s[P - 1:P + R - 1] == y[:, None]).any(-1)
        out[tuple(traj["input_ids"][0].tolist())] = int((~member).sum())
    return out


def _shares(rec, want, groups):
    """Per ``groups`` consecutive runs of the recorded micro-batches (minibatches, or Lopti's
    phases): the forced share logged, and the building pass's share on the same trajectories
    (``want``: :func:`_forced`)."""
    per = len(rec) // groups
    out = []
    for i in range(groups):
        part = rec[i * per:(i + 1) * per]
        n = sum(m for _, _, m in part)
        out.append((sum(f for _, f, _ in part) / n, sum(want[t] for t, _, _ in part) / n))
    return out


def _engines(policy, ref_path, cfg_kw, options):
    """gbc's actor and reference engines as AReaL's workers build them (the options and the
    sampling settings from the environment, as enable(config) writes them)."""
    from gbc_kernels.integrations.areal import OPTIONS_ENV, SAMPLER_ENV
    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    os.environ[OPTIONS_ENV], os.environ[SAMPLER_ENV] = options, SAMPLER
    out = []
    for path, kw in ((policy, cfg_kw), (ref_path, dict(cfg_kw, optimizer=None))):
        eng = GBCFSDPPPOActor(make_config(path, **kw))
        eng.create_process_group()
        out.append(_init(eng))
    return out


def _watch(actor):
    """Record, per micro-batch of the update, the forced share it logs (``gbc_support_forced_
    frac``: forced count, loss tokens) and, where it replays, the ids it looked up."""
    rec = dict(forced=[], replayed=[])
    log, look = actor._gbc_log_forced, actor._gbc_replay_ids

    def logged(forced, mb):
        m = mb["loss_mask"].reshape(-1).bool()
        rec["forced"].append((tuple(mb["input_ids"].reshape(-1)[:P + R].tolist()),
                              int(forced.reshape(-1)[m].sum()), int(m.sum())))
        return log(forced, mb)

    def looked(mb_item, n):
        ids = look(mb_item, n)
        rec["replayed"].append((mb_item.padded_mb["input_ids"].reshape(-1)[:P + R].clone(),
                                ids[:P + R].clone()))
        return ids

    actor._gbc_log_forced, actor._gbc_replay_ids = logged, looked
    return rec


def _passes(actor):
    """Count the actor's building passes and its forward-only micro-batches."""
    rec = dict(built=0, forward_mbs=0)
    keep, fbb = actor._gbc_keep_support, actor.forward_backward_batch

    def kept(building):
        rec["built"] += 1
        return keep(building)

    def counted(mb_list, process_output_fn, forward_only=False):
        if forward_only:
            rec["forward_mbs"] += len(mb_list)
        return fbb(mb_list, process_output_fn, forward_only)

    actor._gbc_keep_support, actor.forward_backward_batch = kept, counted
    return rec


def _step(actor, ref, batch, perm, by_hand=None, order="actor_first"):
    """The actor's compute_logp (the building pass), the batch reordered (``perm``: the rows
    travel with their trajectories), the reference's compute_logp after it, then
    compute_advantages and ppo_update; ``by_hand``: the float64 log-probs put in instead.
    ``order="trainer"``: AReaL's ``PPOTrainer.train`` order instead, the reference's
    compute_logp then the actor's on the same batch (the trajectories untagged), then the
    batch reordered."""
    from areal.utils import stats_tracker

    from gbc_kernels.integrations.areal import SUPPORT_ROW_KEY

    batch = copy.deepcopy(batch)
    passes = None
    if order == "trainer":
        passes = _passes(actor)
        ref_logps = ref.compute_logp(batch)          # rl_trainer.py, as PPOTrainer.train
        for traj, logp in zip(batch, ref_logps):
            traj["ref_logp"] = logp
        after_ref = dict(passes)
        prox_logps = actor.compute_logp(batch)
        for traj, logp in zip(batch, prox_logps):
            traj["prox_logp"] = logp
        passes = dict(after_ref=after_ref, after_actor=dict(passes))
        batch = [batch[i] for i in perm]
    elif by_hand is None:
        for traj, lp in zip(batch, actor.compute_logp(batch)):
            traj["prox_logp"] = lp
        batch = [batch[i] for i in perm]
        for traj, lp in zip(batch, ref.compute_logp(batch)):
            traj["ref_logp"] = lp
    else:
        batch = [batch[i] for i in perm]
        for traj, i in zip(batch, perm):
            traj["prox_logp"], traj["ref_logp"] = by_hand["prox"][i], by_hand["ref"][i]
    rows = [t.get(SUPPORT_ROW_KEY) for t in batch]
    stats_tracker.export_all(reset=True)
    adv = actor.compute_advantages(batch)
    stats_tracker.export_all(reset=True)
    actor.ppo_update(adv)
    return dict(stats=stats_tracker.export_all(reset=True), params=_params(actor),
                prox=[t["prox_logp"] for t in batch], ref=[t["ref_logp"] for t in batch],
                rows=rows, passes=passes)


def _worker_one_set(rank, world, paths, config, batch, perm, oracle):
    from areal.api.cli_args import MicroBatchSpec
    from areal.engine.fsdp_engine import FSDPPPOActor

    from gbc_kernels.integrations.areal import OPTIONS_ENV, SAMPLER_ENV

    policy, ref_path = paths
    cfg_kw = dict(CONFIGS[config], temperature=T, kl_ctl=0.1, ppo_n_minibatches=2,
                  mb_spec=MicroBatchSpec(max_tokens_per_mb=P + R))
    out = {}
    for name, options in (("rollout", "support=replay"), ("trainer", "support=replay"),
                          ("per_pass", "support=replay,support_set=per_pass")):
        if name == "per_pass" and config != "decoupled":
            continue
        actor, ref = _engines(policy, ref_path, cfg_kw, options)
        rec = _watch(actor)
        out[name] = _step(actor, ref, batch, perm,
                          order="trainer" if name == "trainer" else "actor_first")
        out[name].update(rec)
        ref.destroy()
        actor.destroy()
    # the stock step over the fixed sets, the float64 log-probs put in, the rollout's moved by
    # the float64 kept mass of the same set (decoupled)
    os.environ.pop(OPTIONS_ENV, None)
    os.environ.pop(SAMPLER_ENV, None)
    hand_batch = []
    for traj, lk in zip(batch, oracle["kept"]):
        traj = dict(traj)
        if config == "decoupled":
            traj["logprobs"] = traj["logprobs"] - torch.roll(lk, 1, -1) * traj["loss_mask"]
        hand_batch.append(traj)
    stock = FSDPPPOActor(make_config(policy, **cfg_kw))
    stock.create_process_group()
    _init(stock)
    _fixed_head(stock, batch, oracle["sets"])
    out["by_hand"] = _step(stock, None, hand_batch, perm, by_hand=oracle)
    stock.destroy()
    return out


@pytest.mark.parametrize("config", list(CONFIGS))
def test_one_set_per_rollout_equals_the_stock_step_over_the_set_built_once(models, config):
    """The default (one set per rollout): the actor's compute_logp builds the set; the batch is
    then reordered (its rows travel with it), the reference scores after it, and AReaL's
    compute_advantages and ppo_update (2 minibatches, one trajectory per micro-batch) run.
    The proximal and reference log-probs equal float64 ones over the set built from the
    policy's logits before any update (the reference's over the POLICY's set: one set per
    rollout); the ids each update micro-batch replays are that set, token by token; the whole
    step equals AReaL's stock step with its logits restricted to that fixed set (the target
    forced in), every metric to 1e-4 and every parameter to 1e-4 + 1e-6. The forced share
    (the sampler's tokens outside the policy's set) is the building pass's in both
    minibatches. The same holds in AReaL's trainer order (``PPOTrainer.train``: the reference's
    compute_logp on the untagged batch, then the actor's): the reference's pass has the actor's
    building pass run first (one pass: the building pass and the batch's forward micro-batches
    counted before the actor's own call), which returns it without a second pass; the
    reference's log-probs are the REFERENCE model's over the set built from the ACTOR's logits.
    The decoupled case also runs ``support_set=per_pass`` (the old semantics: the
    second minibatch rebuilds the set after an optimizer step): its step does not equal the
    stock step over the fixed set, and its forced share moves with the policy."""
    policy, ref_path, sampler = models
    batch = sglang_rollouts(sampler)
    oracle = built_sets(policy, ref_path, batch)
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    res = spawn_gloo(1, _worker_one_set, (policy, ref_path), config, batch, perm, oracle)[0]
    hand = res["by_hand"]
    trainer = res["trainer"]["passes"]
    # AReaL's trainer order: one building pass of the actor, run by the reference's call (its
    # 8 micro-batches); the actor's own call after it runs none
    assert trainer["after_ref"] == dict(built=1, forward_mbs=len(batch)), trainer
    assert trainer["after_actor"] == trainer["after_ref"], trainer
    for order in ("rollout", "trainer"):
        ours = res[order]
        for name in ("prox", "ref"):
            worst = max((a - b)[:, :-1].abs().max().item()
                        for a, b in zip(ours[name], hand[name]))
            assert worst < 1e-5, (name, worst)
        # the rows travelled: each replayed micro-batch's ids are its trajectory's float64 set
        by_tokens = {tuple(t["input_ids"][0].tolist()): s
                     for t, s in zip(batch, oracle["sets"])}
        assert len(ours["replayed"]) == len(batch)
        for tokens, ids in ours["replayed"]:
            want = by_tokens[tuple(tokens.tolist())]
            for t in range(P + R - 1):
                assert set(ids[t].tolist()) - {-1} == set(want[t].tolist()) - {-1}, t
        assert all(r is not None and r.dtype == torch.long for r in ours["rows"])
        _compare(dict(ours, prox=[0 * t for t in hand["prox"]], params={}),
                 dict(hand, prox=[0 * t for t in hand["prox"]], params={}),
                 skip=("gbc_support",))
        # float32 against float64 proximal / reference log-probs through two SGD steps at lr
        # 0.5: up to 8e-6 apart (the per_pass step, below, is 0.68 off)
        for n, p in hand["params"].items():
            torch.testing.assert_close(ours["params"][n], p, rtol=1e-4, atol=3e-5, msg=n)
        want = _forced(batch, oracle["sets"])
        built = sum(want.values()) / (R * len(batch))
        assert len(ours["forced"]) == len(batch) and 0 < built < 0.3, built
        for tokens, f, n in ours["forced"]:         # each micro-batch: its trajectory's count
            assert (f, n) == (want[tokens], R)
        shares = _shares(ours["forced"], want, 2)
        print(f"\n{config} ({order}): forced share, building pass {built:.4f}; one set per "
              "rollout " + ", ".join(f"minibatch {i + 1} {a:.4f} (built {b:.4f})"
                          for i, (a, b) in enumerate(shares)), end="")
    ours = res["rollout"]
    if "per_pass" not in res:
        return
    old = res["per_pass"]
    diff = max((old["params"][n] - hand["params"][n]).abs().max().item() for n in hand["params"])
    old_shares = _shares(old["forced"], want, 2)
    print("; per_pass " + ", ".join(f"minibatch {i + 1} {a:.4f} (built {b:.4f})"
                                    for i, (a, b) in enumerate(old_shares))
          + f"; per_pass parameters off the fixed-set step by {diff:.2e}")
    assert diff > 1e-4, diff
    assert old_shares[0][0] == pytest.approx(old_shares[0][1], abs=1e-9)
    assert old_shares[1][0] > old_shares[1][1] + 0.05, old_shares


def _worker_lopti(rank, world, paths, batch):
    from areal.api.cli_args import MicroBatchSpec

    policy, ref_path = paths
    cfg_kw = dict(CONFIGS["decoupled"], temperature=T, kl_ctl=0.0, ppo_n_minibatches=1,
                  mb_spec=MicroBatchSpec(max_tokens_per_mb=P + R))
    out = {}
    for name, options in (("rollout", "support=replay,lopti_eta=0.5"),
                          ("per_pass", "support=replay,lopti_eta=0.5,support_set=per_pass")):
        actor, ref = _engines(policy, ref_path, cfg_kw, options)
        ref.destroy()
        rec = _watch(actor)
        b = copy.deepcopy(batch)
        for traj, lp in zip(b, actor.compute_logp(b)):
            traj["prox_logp"] = lp
        actor.ppo_update(actor.compute_advantages(b))
        out[name] = rec
        actor.destroy()
    return out


def test_lopti_second_phase_scores_the_same_set(models):
    """Lopti (two of AReaL's updates per minibatch): the second phase, after the first's
    optimizer step, replays the ids the first replayed (the building pass's), so its forced
    share is the first's and the building pass's; under ``per_pass`` the second phase rebuilds
    the set from the moved policy and forces in more."""
    policy, ref_path, sampler = models
    batch = sglang_rollouts(sampler, seed=1)
    want = _forced(batch, built_sets(policy, ref_path, batch)["sets"])
    built = sum(want.values()) / (R * len(batch))
    res = spawn_gloo(1, _worker_lopti, (policy, ref_path), batch)[0]
    one, old = res["rollout"], res["per_pass"]
    n = len(batch)
    assert len(one["replayed"]) == 2 * n and len(one["forced"]) == 2 * n
    for (t1, ids1), (t2, ids2) in zip(one["replayed"][:n], one["replayed"][n:]):
        assert torch.equal(t1, t2) and torch.equal(ids1, ids2)
    for tokens, f, m in one["forced"]:
        assert (f, m) == (want[tokens], R)
    shares, old_shares = _shares(one["forced"], want, 2), _shares(old["forced"], want, 2)
    print(f"\nLopti forced share, building pass {built:.4f}: one set per rollout, phase 1 "
          f"{shares[0][0]:.4f}, phase 2 {shares[1][0]:.4f}; per_pass phase 1 "
          f"{old_shares[0][0]:.4f}, phase 2 {old_shares[1][0]:.4f}")
    assert 0 < built < 0.3
    assert old_shares[0][0] == pytest.approx(built, abs=1e-9)
    assert old_shares[1][0] > built + 0.05, old_shares


# ---- refused by name ---------------------------------------------------------------------

def _worker_refusals(rank, world, paths, batch):
    from areal.api.cli_args import MicroBatchSpec

    import weakref

    from gbc_kernels.integrations.areal import SUPPORT_ROW_KEY, engine

    policy, ref_path = paths
    cfg_kw = dict(CONFIGS["decoupled"], temperature=T, kl_ctl=0.1, ppo_n_minibatches=1,
                  mb_spec=MicroBatchSpec(max_tokens_per_mb=P + R))
    actor, ref = _engines(policy, ref_path, cfg_kw, "support=replay")
    errors = {}

    def attempt(name, fn):
        try:
            fn()
        except ValueError as err:
            errors[name] = str(err)

    # AReaL's trainer's order (the reference's pass first, which has the actor's run first)
    # with the actor's weights offloaded, and with two building actors in the process
    actor.is_offload = True
    attempt("reference first, actor offloaded", lambda: ref.compute_logp(copy.deepcopy(batch)))
    actor.is_offload = False

    class Other:
        pass

    other = Other()
    engine._BUILDERS[id(other)] = weakref.ref(other)
    attempt("reference first, two actors", lambda: ref.compute_logp(copy.deepcopy(batch)))
    del engine._BUILDERS[id(other)]
    a, b = copy.deepcopy(batch), copy.deepcopy(batch[:4])
    for traj, lp in zip(a, actor.compute_logp(a)):
        traj["prox_logp"] = lp
    adv = actor.compute_advantages(a)
    bare = [{k: v for k, v in t.items() if k != SUPPORT_ROW_KEY} for t in copy.deepcopy(adv)]
    attempt("update without rows", lambda: actor.ppo_update(bare))
    actor.compute_logp(b)                  # a later building pass: a's ids are freed
    attempt("stale rows", lambda: actor.ppo_update(adv))
    ref.destroy()
    actor.destroy()
    return errors


def test_engine_refuses_a_pass_with_no_set_to_replay(models):
    """Where AReaL's workers build the engines: the reference's compute_logp on trajectories
    the actor's pass has not tagged (AReaL's trainer order) while the actor's weights are
    offloaded (AReaL's trainer offloads the actor until after the reference's pass), or with
    no single building actor in the process to run its pass first; an update whose batch
    carries no rows, and rows of a building pass whose ids are gone, are refused, naming
    support_set and what to do."""
    policy, ref_path, sampler = models
    errors = spawn_gloo(1, _worker_refusals, (policy, ref_path), sglang_rollouts(sampler))[0]
    for name, why in (("reference first, actor offloaded", "the actor's weights are on the "
                       "device, and they are offloaded"),
                      ("reference first, two actors", "exactly one gbc actor (an engine with "
                       "an optimizer) is initialized in this process, and 2 are")):
        assert "support_set=rollout (the default under support=replay): trajectory 0 carries " \
               "no kept set (gbc_support_row)" in errors[name], name
        assert why in errors[name] and "set support_set=per_pass" in errors[name], name
    assert "the batch carries no kept set (gbc_support_row)" in errors["update without rows"]
    assert "whose ids are gone" in errors["stale rows"]


@pytest.mark.parametrize("opts,match", [
    (dict(support_set="per-pass"),
     r"GBC_AREAL_OPTIONS: support_set: expected one of \('rollout', 'per_pass'\)"),
    (dict(support_set="rollout", support=None),
     r"support_set: 'rollout' chooses which kept set .* support is None"),
    (dict(offload=True),
     r"support_set=rollout \(the default under support=replay\) with a KL reference "
     r"\(ref, actor.kl_ctl=0.1\) and actor.offload=true: .* reference engine's compute_logp "
     r"first.* set support_set=per_pass .*, actor.offload=false or actor.kl_ctl=0"),
])
def test_bad_support_set_stops_enable_by_name(models, switched, opts, match):
    """A misspelled ``support_set``, one without ``support=replay``, and one set per rollout
    under AReaL's KL reference with ``actor.offload`` (its trainer runs the reference's pass,
    which has the actor build the set, while the actor's weights are offloaded) stop
    ``enable(experiment, ...)`` before anything is patched."""
    import areal.engine as areal_engine

    from test_areal_support import _cfg

    before = areal_engine.FSDPPPOActor
    exp = _experiment(*models[:2], _cfg("decoupled"))
    exp.actor.offload = opts.pop("offload", False)
    kw = {k: v for k, v in {"support": "replay", **opts}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        switched.enable(exp, **kw)
    assert areal_engine.FSDPPPOActor is before and switched.ENV not in os.environ


def test_enable_and_single_controller(models, switched):
    """Without a KL term (``actor.kl_ctl=0``) and with AReaL's KL reference (``kl_ctl=0.1``, a
    ``ref`` config) ``enable`` switches one set per rollout on (the engine builds and
    replays); ``per_pass`` runs with a KL reference; AReaL's single controller refuses one set
    per rollout (its rows travel in the trajectories it serialises), naming
    ``support_set=per_pass``."""
    from test_areal_support import _cfg

    from gbc_kernels.integrations.areal.engine import GBCFSDPPPOActor

    exp = _experiment(*models[:2], _cfg("coupled-recompute"))
    exp.actor.kl_ctl = 0.0
    opts = switched.enable(exp, support="replay")
    assert opts.one_set_per_rollout
    eng = GBCFSDPPPOActor(exp.actor)
    assert eng._gbc_one_set and eng._gbc_builds
    with pytest.raises(ValueError, match=r"support_set=rollout \(the default under "
                                         r"support=replay\): .* single controller .* set "
                                         r"support_set=per_pass"):
        GBCFSDPPPOActor.as_controller(exp.actor, None)
    exp.actor.kl_ctl = 0.1
    assert switched.enable(exp, support="replay").one_set_per_rollout
    eng = GBCFSDPPPOActor(exp.actor)
    assert eng._gbc_one_set and eng._gbc_builds
    switched.enable(exp, support="replay", support_set="per_pass")
    eng = GBCFSDPPPOActor(exp.actor)
    assert not eng._gbc_one_set and eng._gbc_truncation is not None


# ---- Ulysses sequence parallelism (fsdp:d1c2) ----------------------------------------------

def _flash_on_cpu():
    """transformers 5.3's flash-attention functions are tests/standins/flash_attn's (exact
    attention on torch's SDPA, each packed sequence causal on its own; loaded by path), so
    that AReaL's Ulysses patch (``_ulysses_flash_attention_forward``: all-to-all over the SP
    group around transformers' ``_flash_attention_forward``) attends over the whole sequence
    on a CPU. Returns the list of the lengths the varlen kernel attends over, appended to at
    each call. Tokens past the last ``cu_seqlens`` (the Ulysses padding, which AReaL's
    ``cu_seqlens`` do not cover; flash-attn leaves their rows unset, and AReaL trims them)
    attend as one more sequence."""
    import functools
    import importlib.util

    import transformers.modeling_flash_attention_utils as fau

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "gbc_flash_attn_standin", os.path.join(here, "standins", "flash_attn",
                                               "flash_attn_interface.py"))
    fa = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fa)
    seen = []

    @functools.wraps(fa.flash_attn_varlen_func)     # transformers reads its signature
    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs):
        seen.append(q.shape[0])
        if int(cu_seqlens_q[-1]) < q.shape[0]:
            tail = cu_seqlens_q.new_tensor([q.shape[0]])
            cu_seqlens_q, cu_seqlens_k = torch.cat([cu_seqlens_q, tail]), \
                torch.cat([cu_seqlens_k, tail])
        return fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs)

    fau._lazy_imports = lambda *a, **k: (fa.flash_attn_func, varlen, fau._pad_input,
                                         fau._unpad_input)
    return seen


def _grads_at_steps(actor):
    """Record the full gradients at each optimizer step of ``actor`` (before the step)."""
    got = []
    step = actor.optimizer.step

    def stepped(*args, **kwargs):
        got.append({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                    .detach().clone() for n, p in actor.model.named_parameters()})
        return step(*args, **kwargs)

    actor.optimizer.step = stepped
    return got


def _losses(actor):
    """Record each update micro-batch's loss as this rank returns it (AReaL's scaling: the
    micro-batch's loss weight over the batch's), both of Lopti's phases."""
    got = []
    real = actor._compute_logprobs_and_loss

    def scored(*args, **kwargs):
        loss = real(*args, **kwargs)
        got.append(loss.detach().clone())
        return loss

    actor._compute_logprobs_and_loss = scored
    return got


# the runs under Ulysses: AReaL's loss config (CONFIGS) and gbc's options
ULYSSES = {
    "decoupled": ("decoupled", "support=replay"),
    # coupled PPO: no decoupled proximal pass; AReaL's recompute_logprob pass (the actor's
    # compute_logp, whose log-probs become the old ones) builds the set
    "coupled": ("coupled-recompute", "support=replay"),
    # Lopti: two of AReaL's updates per minibatch, the second after the first's step
    "lopti": ("decoupled", "support=replay,lopti_eta=0.5"),
    # each pass rebuilds the set of its own rows from its own logits: no rows travel
    "per_pass": ("decoupled", "support=replay,support_set=per_pass"),
}


def _worker_ulysses(rank, world, paths, batch, perm, orders, case="decoupled"):
    """``case`` (:data:`ULYSSES`: the decoupled loss by default; AReaL's KL reference, 2
    minibatches, one trajectory per micro-batch) at ``fsdp:d1c{world}``, flash attention (the
    stand-in) on every rank; ``orders``: the actor's compute_logp first (``rollout``) and/or
    AReaL's trainer order (``trainer``). Each replayed micro-batch's ids are recorded as this
    rank looked them up: its slice of the micro-batch; and the actor's building passes, each
    update micro-batch's loss, the gradients at each optimizer step."""
    from areal.api.cli_args import MicroBatchSpec, NormConfig

    attended = _flash_on_cpu()
    policy, ref_path = paths
    config, options = ULYSSES[case]
    # AReaL's batch-level advantage normalisation all-reduces over the whole world, where
    # each SP rank holds the same batch: its unbiased std (n - 1) then counts 2n - 1, and
    # AReaL's own advantages at SP 2 are 1.004 times SP 1's. The biased std is the same.
    # Each micro-batch one trajectory padded to P + R + 1 tokens (AReaL pads to 256
    # otherwise: rank 1 would hold only padding), the Ulysses padding one more: each rank
    # holds 7 rows, rank 1 five of the trajectory's tokens, AReaL's padding and Ulysses'.
    cfg_kw = dict(CONFIGS[config], temperature=T, kl_ctl=0.1, ppo_n_minibatches=2,
                  mb_spec=MicroBatchSpec(max_tokens_per_mb=P + R + 1), pad_to_maximum=True,
                  adv_norm=NormConfig(mean_level="batch", std_level="batch",
                                      std_unbiased=False),
                  backend="fsdp:d1" if world == 1 else f"fsdp:d1c{world}")
    out = {}
    for order in orders:
        actor, ref = _engines(policy, ref_path, cfg_kw, options)
        assert actor.parallel_helper.sp_size == world == ref.parallel_helper.sp_size
        for eng in (actor, ref):        # read at each forward: AReaL's Ulysses patch sits on it
            eng.model.config._attn_implementation = "flash_attention_2"
        rec = _watch(actor)
        rec["local"] = []
        look = actor._gbc_replay_ids

        def looked(mb_item, n, look=look, rec=rec):
            ids = look(mb_item, n)
            rec["local"].append((mb_item.padded_mb["input_ids"].reshape(-1).clone(),
                                 ids.clone()))
            return ids

        actor._gbc_replay_ids = looked
        grads, losses, built = _grads_at_steps(actor), _losses(actor), _passes(actor)
        carried, advantages = set(), actor.compute_advantages

        def advanced(data, *args, advantages=advantages, carried=carried, **kwargs):
            carried.update(k for t in data for k in t)
            return advantages(data, *args, **kwargs)

        actor.compute_advantages = advanced
        del attended[:]
        out[order] = _step(actor, ref, batch, perm,
                           order="trainer" if order == "trainer" else "actor_first")
        out[order].update(rec, grads=grads, losses=losses, built=dict(built),
                          attended=list(attended), rank=rank, carried=sorted(carried),
                          kept_mass=actor._gbc_keep_kept_mass, one_set=actor._gbc_one_set)
        ref.destroy()
        actor.destroy()
    return out


def _sp_ids(ranks, i):
    """The ``i``-th replayed micro-batch's ids over the whole micro-batch: each SP rank's
    slice, in rank order (``-1``-padded to the widest), and the micro-batch's tokens."""
    tokens = ranks[0]["local"][i][0]
    parts = [r["local"][i][1] for r in ranks]
    assert all(torch.equal(r["local"][i][0], tokens) for r in ranks)
    k = max(p.shape[-1] for p in parts)
    return tokens, torch.cat([torch.nn.functional.pad(p, (0, k - p.shape[-1]), value=-1)
                              for p in parts])


def _ulysses_runs(models, case, orders):
    """The rollouts, the float64 oracle, the run at SP 1 (the actor's pass first) and each
    SP 2 rank's runs in ``orders``."""
    policy, ref_path, sampler = models
    batch = sglang_rollouts(sampler)
    oracle = built_sets(policy, ref_path, batch)
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    one = spawn_gloo(1, _worker_ulysses, (policy, ref_path), batch, perm, ("rollout",),
                     case)[0]
    two = spawn_gloo(2, _worker_ulysses, (policy, ref_path), batch, perm, orders, case)
    return batch, oracle, perm, one["rollout"], two


def _check_replayed_ids(ranks, sp1, batch, sets):
    """One set per rollout: each replayed micro-batch's ids, each rank its slice (7 rows: P +
    R tokens, AReaL's one padding token, Ulysses' one; rank 1 the trajectory's last 5 tokens),
    put together in rank order, are the float64 set of its trajectory (the target not forced
    in) and SP 1's ids of the same micro-batch (the same place in the run), row by row; the
    padding holds none."""
    by_tokens = {tuple(t["input_ids"][0].tolist()): s for t, s in zip(batch, sets)}
    assert len(ranks[0]["local"]) == len(sp1["replayed"])
    for i in range(len(sp1["replayed"])):
        tokens, ids = _sp_ids(ranks, i)
        n = ranks[0]["local"][i][1].shape[0]
        assert all(r["local"][i][1].shape[0] == n for r in ranks)
        assert n * len(ranks) == tokens.numel() + 1 == P + R + 2, (n, tokens.numel())
        sp1_tokens, sp1_ids = sp1["replayed"][i]
        assert torch.equal(tokens[:P + R], sp1_tokens), i
        want = by_tokens[tuple(sp1_tokens.tolist())]
        for t in range(P + R):
            got = set(ids[t].tolist()) - {-1}
            if t < P + R - 1:                        # the last: a wrapped target
                assert got == set(want[t].tolist()) - {-1}, (i, t)
            assert got == set(sp1_ids[t].tolist()) - {-1}, (i, t)
        assert (ids[P + R:] == -1).all()             # padding: no row


def _grad_atol(g):
    """The gradients' absolute tolerance, with 1e-4 relative: 2e-5 of the tensor's largest
    absolute entry. float32's summation orders differ between the ranks' all-to-all and one
    rank (coupled: an embedding entry near 0 is 3.7e-6 off where the tensor's largest is
    0.59), and Lopti's second phase, its tokens' probabilities near 1, has gradients of 2e-5
    at most: a fixed 1e-6 would fail the one and pass anything in the other."""
    return 2e-5 * g.abs().max().item()


def _check_step(ours, ranks, sp1, worst, key):
    """The update at SP 2 against SP 1: each micro-batch's forced count (in order), every
    metric AReaL logs (the loss included), each micro-batch's loss on every rank, the
    gradients at every optimizer step, the parameters (the ranks in sync)."""
    assert ours["forced"] == sp1["forced"]
    _compare(dict(ours, params={}), dict(sp1, params={}))
    assert any("loss" in k for k in sp1["stats"]), sorted(sp1["stats"])
    for r in ranks:
        assert len(r["losses"]) == len(sp1["losses"]) > 0
        for a, b in zip(r["losses"], sp1["losses"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    worst[key + ("loss",)] = max((a - b).abs().item()
                                 for r in ranks for a, b in zip(r["losses"], sp1["losses"]))
    assert len(ours["grads"]) == len(sp1["grads"]) > 0
    assert all(max(g.abs().max().item() for g in step.values()) > 0 for step in sp1["grads"])
    for g2, g1 in zip(ours["grads"], sp1["grads"]):
        assert g2.keys() == g1.keys()
        for n, g in g1.items():
            torch.testing.assert_close(g2[n], g, rtol=1e-4, atol=_grad_atol(g),
                                       msg=lambda m, n=n: f"{n}: {m}")
    worst[key + ("grads",)] = max((g2[n] - g1[n]).abs().max().item()
                                  for g2, g1 in zip(ours["grads"], sp1["grads"]) for n in g1)
    worst[key + ("grads", "of tolerance")] = max(
        ((g2[n] - g1[n]).abs() / (_grad_atol(g1[n]) + 1e-4 * g1[n].abs())).max().item()
        for g2, g1 in zip(ours["grads"], sp1["grads"]) for n in g1)
    for n, p in sp1["params"].items():
        torch.testing.assert_close(ours["params"][n], p, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=n: f"{n}: {m}")
        assert torch.equal(ours["params"][n], ranks[1]["params"][n]), n
    worst[key + ("params",)] = max((ours["params"][n] - p).abs().max().item()
                                   for n, p in sp1["params"].items())


def _check_logps(ours, sp1, oracle, perm, names, worst, key):
    """The log-probs ``names`` of the step's batch: SP 1's and, where given, the float64
    oracle's (every position but the last: its label is packing's), to 1e-5."""
    for name in ("prox", "ref"):
        worst[key + (name, "sp1")] = max((a - b).abs().max().item()
                                         for a, b in zip(ours[name], sp1[name]))
        assert worst[key + (name, "sp1")] < 1e-5
        if name in names:
            want_lp = [oracle[name][i] for i in perm]      # the batch reordered
            worst[key + (name, "oracle")] = max((a - b)[:, :-1].abs().max().item()
                                                for a, b in zip(ours[name], want_lp))
            assert worst[key + (name, "oracle")] < 1e-5


def _print_worst(title, worst):
    print(f"\n{title} (largest differences): "
          + ", ".join(f"{'/'.join(k)} {v:.1e}" for k, v in worst.items()), end="")


@pytest.mark.parametrize("case", ["decoupled", "coupled", "lopti"])
def test_one_set_per_rollout_under_ulysses_equals_sp1(models, case):
    """One set per rollout under AReaL's Ulysses sequence parallelism (``fsdp:d1c2``, 2 gloo
    ranks in one SP group, each a slice of every packed micro-batch; flash attention, the
    stand-in, so that AReaL's Ulysses patch attends over the whole sequence as on a GPU),
    against the same run at SP 1 and the float64 oracle: the actor's building pass gathers
    each rank's ids; every later pass slices each token's row as AReaL slices its labels. The
    ids each rank replays, put together in rank order, are the float64 set built from the
    policy's logits (the target not forced in) and SP 1's, row by row; the rows the
    trajectories carry are SP 1's; the proximal and reference log-probs equal the float64
    ones to 1e-5 and SP 1's; each micro-batch forces in its trajectory's building-pass count
    (above 0: no target was forced into the set); every metric AReaL logs (the loss
    included), each micro-batch's loss, the gradients at every optimizer step and the
    parameters after them equal SP 1's, and both ranks end in sync. In AReaL's trainer order
    (the reference's compute_logp first, which has the actor's building pass run on the
    batch) the same holds, with one building pass.

    ``coupled`` (``recompute_logprob``, no decoupled loss: no proximal pass of its own, no
    kept mass): the actor's compute_logp, AReaL's recompute pass whose log-probs become the
    old ones, builds the set (one building pass, its 8 forward micro-batches, in both orders),
    and the same holds. ``lopti`` (``lopti_eta=0.5``: two of AReaL's updates per minibatch,
    4 optimizer steps): both phases replay the one set, each rank in the second phase the
    very ids of its slice it replayed in the first; the second phase's ids, losses and
    gradients equal SP 1's as the first's do."""
    from gbc_kernels.integrations.areal import LOG_KEPT_MASS_KEY, SUPPORT_ROW_KEY
    from gbc_kernels.integrations.areal import engine as gbc_engine

    orders = ("rollout",) if case == "lopti" else ("rollout", "trainer")
    batch, oracle, perm, sp1, two = _ulysses_runs(models, case, orders)
    want = _forced(batch, oracle["sets"])
    built = sum(want.values()) / (R * len(batch))
    assert 0 < built < 0.3, built
    phases = 2 if case == "lopti" else 1
    worst = {}
    for order in orders:
        ranks = [r[order] for r in two]
        ours = ranks[0]
        assert ours["one_set"] and ours["kept_mass"] == (case != "coupled")
        # what the trajectories carry into compute_advantages: the rows; the kept mass that
        # moves the behaviour log-probs only under the decoupled loss (coupled: AReaL
        # replaces them with the recompute pass's)
        assert SUPPORT_ROW_KEY in ours["carried"]
        assert (LOG_KEPT_MASS_KEY in ours["carried"]) == (case != "coupled"), ours["carried"]
        # one building pass: the actor's compute_logp (coupled: AReaL's recompute pass), its
        # forward micro-batches; in the trainer order, run by the reference's call
        for r in ranks + [sp1]:
            assert r["built"] == dict(built=1, forward_mbs=len(batch)), (order, r["built"])
        if order == "trainer":
            assert ours["passes"]["after_ref"] == dict(built=1, forward_mbs=len(batch))
            assert ours["passes"]["after_actor"] == ours["passes"]["after_ref"]
        # the attention spans both ranks' slices: each call attends over a whole micro-batch
        assert ours["attended"] and min(ours["attended"]) >= P + R, ours["attended"]
        # the ids: each rank looked up its slice; together, the float64 set and SP 1's
        assert len(ours["local"]) == phases * len(batch)
        _check_replayed_ids(ranks, sp1, batch, oracle["sets"])
        if case == "lopti":             # per minibatch: phase 1's micro-batches, then phase 2's
            k = len(batch) // 2
            for r in ranks:
                for m in range(2):
                    first, second = (r["local"][m * 2 * k:(m * 2 + 1) * k],
                                     r["local"][(m * 2 + 1) * k:(m * 2 + 2) * k])
                    for (t1, i1), (t2, i2) in zip(first, second):
                        assert torch.equal(t1, t2) and torch.equal(i1, i2)
        for a, b in zip(ours["rows"], sp1["rows"]):      # the rows, less the pass id
            assert torch.equal(a & gbc_engine._ROW_MASK, b & gbc_engine._ROW_MASK)
        _check_logps(ours, sp1, oracle, perm, ("prox", "ref"), worst, (case, order))
        # forced: each micro-batch (each phase) its trajectory's building-pass count
        assert len(ours["forced"]) == phases * len(batch)
        for tokens, f, n in ours["forced"]:
            assert (f, n) == (want[tokens], R)
        assert ours["stats"]["ppo_actor/update/gbc_support_forced_frac/avg"] == \
            pytest.approx(built, abs=1e-6)
        # the step: every metric (the loss included), losses, gradients, parameters
        assert len(ours["losses"]) == len(ours["forced"])
        assert len(ours["grads"]) == 2 * phases
        _check_step(ours, ranks, sp1, worst, (case, order))
    _print_worst(f"Ulysses SP 2 ({case}) against SP 1 / the float64 oracle", worst)


def test_per_pass_under_ulysses_equals_sp1(models):
    """``support_set=per_pass`` under Ulysses (``fsdp:d1c2``, as above): each pass rebuilds
    the set of each rank's own rows from its own logits, nothing replayed (no rows travel, no
    building pass, no lookup). The proximal log-probs equal the float64 ones over the set the
    policy's logits give and SP 1's; the reference's (over its own set) SP 1's; each update
    micro-batch's forced count equals SP 1's, in the first minibatch the building-pass count
    (the policy not yet moved), in the second above it (the moved policy's own set); every
    metric (the loss and the forced share included), each micro-batch's loss, the gradients
    at both optimizer steps and the parameters equal SP 1's, the ranks in sync."""
    batch, oracle, perm, sp1, two = _ulysses_runs(models, "per_pass", ("rollout",))
    want = _forced(batch, oracle["sets"])
    ranks = [r["rollout"] for r in two]
    ours = ranks[0]
    worst = {}
    for r in ranks + [sp1]:
        assert not r["one_set"] and r["local"] == [] and r["replayed"] == []
        assert r["built"] == dict(built=0, forward_mbs=len(batch))
        assert all(row is None for row in r["rows"])
    assert ours["attended"] and min(ours["attended"]) >= P + R, ours["attended"]
    _check_logps(ours, sp1, oracle, perm, ("prox",), worst, ("per_pass",))
    n = len(batch) // 2
    assert len(ours["forced"]) == len(batch)
    for tokens, f, m in ours["forced"][:n]:
        assert (f, m) == (want[tokens], R)
    shares = _shares(ours["forced"], want, 2)
    assert shares[1][0] > shares[1][1], shares
    _check_step(ours, ranks, sp1, worst, ("per_pass",))
    print("\nper_pass at SP 2: forced share " + ", ".join(
        f"minibatch {i + 1} {a:.4f} (built {b:.4f})" for i, (a, b) in enumerate(shares)), end="")
    _print_worst("; against SP 1 / the float64 oracle", worst)
