"""NTHR and critical-token KL inside SkyRL 0.3.0 (gbc_kernels.integrations.skyrl, docs/skyrl.md),
through SkyRL's own flow on a tiny Qwen2 (gloo): the reference worker's and the policy worker's
no-grad passes, SkyRL's trainer (``fwd_logprobs_values_reward``, patched by gbc) carrying the
fields in its training batch, the policy worker's ``forward_backward`` and ``optim_step``.
Each against the method applied by hand to SkyRL's own stock step, and the weights / scales
against ``gbc_reference`` (float64, full logits); padded and packed micro-batches."""

from __future__ import annotations

import functools
import os
import sys
import types

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

pytest.importorskip("skyrl")

from test_skyrl import (T, algorithm, build_worker, make_batch,  # noqa: E402
                        skyrl_cpu, tiny_qwen2)

TEMPERATURE = 0.8           # the policy worker's (skyrl_cpu.policy_worker's default)
CRIT = dict(critical_kl_exponent=2.0, critical_kl_intercept=0.1,
            critical_kl_temperature=0.7)


def _params(model):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _hidden64(model, seq, attn):
    """float64 final hidden states predicting the last T tokens: each row's real tokens alone
    at positions 0.. (SkyRL's positions), so that no padded position enters."""
    m = (tiny_qwen2() if model is None else model).double()
    B, S = seq.shape
    out = torch.zeros(B, S, m.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        for b in range(B):
            idx = attn[b].nonzero()[:, 0]
            out[b, idx] = m.model(input_ids=seq[b, idx][None], position_ids=torch.arange(
                len(idx))[None]).last_hidden_state[0]
    return out[:, -T - 1:-1], m.lm_head.weight.detach()


def ref_model():
    """The reference: the policy's initial weights plus seeded noise."""
    model = tiny_qwen2()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _set_options(text):
    os.environ["GBC_SKYRL_OPTIONS"] = text


def _weight_stock_kl(weights, full_base, skw=None):
    """By hand: SkyRL's stock worker's KL term with each token's KL times its weight (the rows
    of a micro-batch found by their reference log-probs); ``skw``: the module whose
    ``compute_approx_kl`` the step calls (default: SkyRL's worker module, the FSDP step's)."""
    if skw is None:
        from skyrl.backends.skyrl_train.workers import worker as skw

    orig = skw.compute_approx_kl

    def weighted(logp, base, loss_mask=None, kl_estimator_type="k3"):
        kl = orig(logp, base, loss_mask=loss_mask, kl_estimator_type=kl_estimator_type)
        rows = [next(i for i in range(len(full_base)) if torch.equal(full_base[i], base[r]))
                for r in range(base.shape[0])]
        return kl * weights[rows].to(kl.dtype)

    skw.compute_approx_kl = weighted
    return lambda: setattr(skw, "compute_approx_kl", orig)


ALGO = dict(use_kl_loss=True, kl_loss_coef=0.2, kl_estimator_type="k3", use_entropy_loss=True,
            entropy_loss_coef=0.03)


def _skyrl_flow(sky, options: dict, batch, packed=False, algo=ALGO):
    """One SkyRL step with gbc switched on (``options``: the method options, as enable() sets
    them): SkyRL's trainer's ``fwd_logprobs_values_reward`` (patched by gbc) on ``batch`` (its
    sequences, masks, advantages) through gbc's reference and policy workers of this rank
    (SkyRL's dispatch stood in for), then the policy worker's ``forward_backward`` and
    ``optim_step``; ``algo``: SkyRL's algorithm options (the KL and entropy terms). Returns
    (the training batch, the step's metrics, the parameters after)."""
    skyrl_cpu().entrypoint_imports()             # skyrl.train.trainer's imports
    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from gbc_kernels.integrations.skyrl import trainer as gtrainer
    from skyrl.train.config.config import TrainerConfig

    opts = methods.MethodOptions(**options)
    _set_options(",".join(f"{k}={v}" for k, v in options.items()))
    cls = gtrainer.patch_trainer()
    model = tiny_qwen2()
    policy = build_worker(sky, gfsdp.GBCFSDPPolicyWorker, algorithm(sky, "regular", **algo), 1,
                          model, opts, packed=packed)
    refw = build_worker(sky, gfsdp.GBCFSDPRefWorker, algorithm(sky, "regular", **algo), 1,
                        ref_model(), opts, micro=3, packed=packed)

    class Dispatch:              # SkyRL's dispatch to one rank's workers
        def forward(self, name, data):
            return {"ref": refw, "policy": policy}[name].forward(data)

        def empty_cache(self, *args):
            pass

    fake = types.SimpleNamespace(cfg=types.SimpleNamespace(trainer=TrainerConfig()),
                                 has_critic=False, ref_model=object(), dispatch=Dispatch(),
                                 all_metrics={})
    fake._execute_forward_pass = functools.partial(cls._execute_forward_pass, fake)
    fake._skip_policy_forward = functools.partial(cls._skip_policy_forward, fake)
    for key in ("action_log_probs", "base_action_log_probs"):
        batch.pop(key, None)
    with skyrl_cpu().cpu_device():
        data = cls.fwd_logprobs_values_reward(fake, batch)     # SkyRL's trainer, gbc's fields
        res = policy.forward_backward(data)
        policy.optim_step()
    return data, res.metrics, _params(model)


# ---- critical-token KL ----------------------------------------------------------------------
def _critical_worker(rank, world, packed):
    sky = skyrl_cpu().load()
    import gbc_reference as ref

    from gbc_kernels.integrations.skyrl.worker import KL_WEIGHT_KEY
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase

    batch = make_batch(sky, 21, B=5)
    data, metrics, params = _skyrl_flow(sky, CRIT, batch, packed)
    got_w = data[KL_WEIGHT_KEY]
    got = (metrics, params)

    # the weights by float64 full logits of the reference model
    seq, attn, mask = batch["sequences"], batch["attention_mask"], batch["loss_mask"].bool()
    h, w = _hidden64(ref_model(), seq, attn)
    st = ref.token_stats(h, w, seq[:, -T:], certainty="max_prob",
                         certainty_temperature=CRIT["critical_kl_temperature"])
    want_w = ref.critical_kl_weight(st.certainty.double(), CRIT["critical_kl_exponent"],
                                    CRIT["critical_kl_intercept"])
    # by hand: SkyRL's stock step, its KL term times the reference weights
    model = tiny_qwen2()
    stock = build_worker(sky, FSDPPolicyWorkerBase, algorithm(sky, "regular", **ALGO), world,
                         model, packed=packed)
    undo = _weight_stock_kl(want_w.float(), data["base_action_log_probs"])
    try:
        with skyrl_cpu().cpu_device():
            d = make_batch(sky, 21, B=5)
            for key in ("action_log_probs", "base_action_log_probs"):
                d[key] = data[key]
            ref_res = stock.forward_backward(d)
            stock.optim_step()
    finally:
        undo()
    return dict(got=got, want=(ref_res.metrics, _params(model)), got_w=got_w[mask],
                want_w=want_w[mask], ref_logp=(data["base_action_log_probs"][mask],
                                               st.logp[mask]))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_critical_kl_through_skyrls_flow_equals_the_method_by_hand(packed):
    """critical_kl_exponent: the reference worker's pass gives the weights beside its log-probs,
    SkyRL's (patched) trainer puts them in its training batch as gbc_kl_weight, and the policy
    worker's KL-in-loss term (use_kl_loss, k3) weights each token: the weights equal the
    float64 reference's, and the step (metrics, parameters after SkyRL's optimizer step) equals
    SkyRL's stock step with its KL term weighted by hand."""
    from conftest import spawn_gloo

    out = spawn_gloo(1, _critical_worker, packed)[0]
    torch.testing.assert_close(out["got_w"].double(), out["want_w"], rtol=1e-4, atol=1e-6)
    assert out["want_w"].std() > 1e-3                       # the weights vary by token
    torch.testing.assert_close(out["ref_logp"][0].double(), out["ref_logp"][1].double(),
                               rtol=1e-4, atol=1e-5)
    (gm, gp), (rm, rp) = out["got"], out["want"]
    for k in rm:
        if k != "policy_kl":        # gbc's: SkyRL's KL itself; the stock one by hand: weighted
            assert gm[k] == pytest.approx(rm[k], rel=2e-4, abs=2e-6), k
    start = _params(tiny_qwen2())
    for n in rp:
        assert (rp[n] - start[n]).abs().sum() > 0
        torch.testing.assert_close(gp[n], rp[n], rtol=2e-4, atol=2e-6, msg=n)


# ---- Lopti with SkyRL's KL loss --------------------------------------------------------------
KL_ONLY = dict(use_kl_loss=True, kl_loss_coef=0.2, kl_estimator_type="k3")


def _lopti_kl_worker(rank, world, packed, order):
    """gbc's Lopti step (with AR) with SkyRL's KL loss through SkyRL's flow (the reference
    pass's log-probs, the policy's old ones), and SkyRL's stock steps by hand on each phase's
    advantages, in ``order``, with the KL term of each phase's tokens only (times 1 on them, 0
    on the others; SkyRL's normaliser kept) and, for the oracle the defect report used, with
    SkyRL's KL on every token in both phases."""
    sky = skyrl_cpu().load()
    from gbc_kernels import methods
    from gbc_kernels.integrations import hf
    from gbc_kernels.integrations.skyrl.worker import _position_ids
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase

    batch = make_batch(sky, 41, B=5)
    seq, attn = batch["sequences"], batch["attention_mask"]
    lp, _ = hf.logprobs_through_forward(tiny_qwen2(), seq, attn, T, temperature=TEMPERATURE,
                                        model_kwargs={"position_ids": _position_ids(attn)})
    eta = float(lp.exp()[batch["loss_mask"].bool()].median())    # a mixed split
    options = dict(lopti_eta=eta, lopti_order=order, ar_alpha=0.3)
    opts = methods.MethodOptions(**options)
    data, metrics, params = _skyrl_flow(sky, options, batch, packed, algo=KL_ONLY)
    old, base = data["action_log_probs"], data["base_action_log_probs"]
    low = old.exp() < eta
    assert low[batch["loss_mask"].bool()].any() and (~low[batch["loss_mask"].bool()]).any()
    out = dict(got=(metrics, params))
    for name, by_phase in (("want", True), ("every_token", False)):
        model = tiny_qwen2()
        stock = build_worker(sky, FSDPPolicyWorkerBase, algorithm(sky, "regular", **KL_ONLY),
                             world, model, packed=packed)
        steps = []
        for phase in methods.LOPTI_ORDERS[order]:
            d = make_batch(sky, 41, B=5)
            d["action_log_probs"], d["base_action_log_probs"] = old, base
            d["advantages"] = methods.loss_advantages(d["advantages"], old, opts, phase)
            on = (low if phase == "low" else ~low).float()
            undo = _weight_stock_kl(on, base) if by_phase else (lambda: None)
            try:
                with skyrl_cpu().cpu_device():
                    steps.append(stock.forward_backward(d).metrics)
                    stock.optim_step()
            finally:
                undo()
        out[name] = (steps, _params(model))
    return out


@pytest.mark.parametrize("packed,order", [(False, "low-first"), (True, "high-first")],
                         ids=["padded-low-first", "packed-high-first"])
def test_lopti_with_kl_loss_is_two_stock_steps_kl_on_each_phases_tokens(packed, order):
    """lopti_eta (with AR) and SkyRL's use_kl_loss: gbc's FSDP worker's two optimizer steps
    equal SkyRL's stock step on each phase's advantages with its KL term counted on that
    phase's tokens only, SkyRL's normaliser (the row's loss tokens) kept (docs/math.md §3: each
    token's KL once per batch; the phases' KL terms add up to SkyRL's): every parameter, and
    each phase's ``final_loss`` and ``policy_loss`` under ``gbc_lopti_<phase>/``. The stock
    step on a phase's advantages alone keeps every token's KL in both phases (each token's KL
    twice per batch): it is not gbc's step (the defect report's oracle)."""
    from conftest import spawn_gloo

    from gbc_kernels import methods

    out = spawn_gloo(1, _lopti_kl_worker, packed, order)[0]
    (gm, gp), (steps, rp), (_, naive) = out["got"], out["want"], out["every_token"]
    start = _params(tiny_qwen2())
    for n in rp:
        assert (rp[n] - start[n]).abs().sum() > 0
        torch.testing.assert_close(gp[n], rp[n], rtol=2e-4, atol=2e-6, msg=n)
    assert max(float((naive[n] - rp[n]).abs().max()) for n in rp) > 1e-4
    for phase, want in zip(methods.LOPTI_ORDERS[order], steps):
        for k in ("final_loss", "policy_loss"):
            assert gm[f"gbc_lopti_{phase}/{k}"] == pytest.approx(want[k], rel=2e-4,
                                                                 abs=2e-6), (phase, k)


# ---- NTHR -----------------------------------------------------------------------------------
GROUPS = [0, 0, 0, 1, 1, 1]
SIGNS = [1.0, -1.0, -1.0, -1.0, 1.0, -1.0]       # row 1's response is empty (make_batch)


def nthr_batch(sky, seed=31, groups=GROUPS, signs=SIGNS):
    from gbc_kernels.integrations.skyrl.worker import GROUP_KEY

    d = make_batch(sky, seed, B=len(groups), kl=False)
    sign = torch.tensor(signs)[:, None]
    d["advantages"] = d["advantages"].abs() * sign + 0.0
    d[GROUP_KEY] = torch.tensor(groups)
    return d


def _nthr_worker(rank, world, packed):
    sky = skyrl_cpu().load()
    import gbc_reference as ref

    from gbc_kernels import methods
    from gbc_kernels.integrations import hf
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from gbc_kernels.integrations.skyrl.worker import SCALE_KEY
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase

    # beta 0: on a random tiny model beta > 0 selects no token
    opts = methods.MethodOptions(nthr=True, nthr_beta=0.0)
    halves = (slice(0, 3), slice(3, 6))          # two mini-batches, whole groups each
    out = {}
    for nthr in (True, False):                   # NTHR adds no forward
        model = tiny_qwen2()
        w = build_worker(sky, gfsdp.GBCFSDPPolicyWorker,
                         algorithm(sky, "regular", use_kl_loss=False), world, model,
                         opts if nthr else methods.MethodOptions(), packed=packed)
        forwards = [0]
        hf.unwrap(model).register_forward_pre_hook(
            lambda *a: forwards.__setitem__(0, forwards[0] + 1))
        data = nthr_batch(sky)
        scales, metrics = [], []
        with skyrl_cpu().cpu_device():
            # SkyRL's old-log-prob pass, per mini-batch (recompute_old_logprobs_per_minibatch)
            old = [w.forward(data[s]) for s in halves]
            data["action_log_probs"] = torch.cat([torch.tensor(
                [r["logprobs"] for r in o.loss_fn_outputs]) for o in old])
            for s in halves:                     # the update: one optimizer step each
                mb = data[s]
                res = w.forward_backward(mb)
                w.optim_step()
                metrics.append(res.metrics)
                if nthr:
                    scales.append(mb[SCALE_KEY])
        out[nthr] = dict(forwards=forwards[0], metrics=metrics, params=_params(model),
                         scales=torch.cat(scales) if nthr else None,
                         old=data["action_log_probs"])
        if nthr:                                 # a mini-batch its pass did not keep
            with skyrl_cpu().cpu_device(), pytest.raises(
                    ValueError, match="recompute_old_logprobs_per_minibatch"):
                w.forward_backward(nthr_batch(sky, seed=32))
    # the scales by float64 full logits of the old policy (the whole batch, its groups)
    data = nthr_batch(sky)
    seq, attn, mask = data["sequences"], data["attention_mask"], data["loss_mask"].bool()
    h, wt = _hidden64(None, seq, attn)
    want = ref.nthr_scale(h, wt, seq[:, -T:], mask, torch.tensor(GROUPS),
                          methods.correct_from_advantages(data["advantages"], mask),
                          temperature=TEMPERATURE, beta=0.0)
    # by hand: SkyRL's stock steps on the advantages times the reference scales
    model = tiny_qwen2()
    stock = build_worker(sky, FSDPPolicyWorkerBase, algorithm(sky, "regular", use_kl_loss=False),
                         world, model, packed=packed)
    data["action_log_probs"] = out[True]["old"]
    data["advantages"] = data["advantages"] * want.scale.float()
    by_hand = []
    with skyrl_cpu().cpu_device():
        for s in halves:
            by_hand.append(stock.forward_backward(data[s]).metrics)
            stock.optim_step()
    out["want"] = dict(scale=want.scale, selected=want.selected, mask=mask, metrics=by_hand,
                       params=_params(model))
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_nthr_from_skyrls_own_pass_equals_the_method_by_hand(packed):
    """nthr: SkyRL's old-log-prob pass (run per mini-batch, as SkyRL's default
    recompute_old_logprobs_per_minibatch does) keeps NTHR's rows; each mini-batch's
    forward_backward scores them once its advantages exist — after the first mini-batch's
    optimizer step the second's scales are still the old policy's. No forward beyond SkyRL's
    own; the scales equal the float64 reference's on the whole batch; every step (metrics,
    parameters) equals SkyRL's stock step on the advantages times those scales; a mini-batch
    the pass did not keep is refused naming SkyRL's option."""
    from conftest import spawn_gloo

    out = spawn_gloo(1, _nthr_worker, packed)[0]
    got, plain, want = out[True], out[False], out["want"]
    # per mini-batch of 3 rows (micro-batches of 2): 2 forwards in the pass, 2 in the update
    assert got["forwards"] == plain["forwards"] == 2 * (2 + 2)
    m = want["mask"]
    assert want["selected"].any() and (want["scale"][m] != 1).any()
    torch.testing.assert_close(got["scales"][m].double(), want["scale"][m].double(),
                               rtol=1e-5, atol=1e-6)
    for gm, rm in zip(got["metrics"], want["metrics"]):
        assert {k for k in gm if k.startswith("gbc_")} >= {"gbc_nthr_second_forward",
                                                            "gbc_nthr_kept_mb"}
        assert gm["gbc_nthr_second_forward"] == 0.0
        for k in rm:
            assert gm[k] == pytest.approx(rm[k], rel=2e-4, abs=2e-6), k
    start = _params(tiny_qwen2())
    for n, p in want["params"].items():
        assert (p - start[n]).abs().sum() > 0
        torch.testing.assert_close(got["params"][n], p, rtol=2e-4, atol=2e-6, msg=n)


# two FSDP2 ranks, one mini-batch of 6 rows, 3 per rank: group 1 has rows on both ranks
GROUPS2 = [0, 0, 1, 1, 1, 2]
SIGNS2 = [1.0, -1.0, -1.0, 1.0, -1.0, 1.0]


def _nthr_two_ranks_worker(rank, world):
    sky = skyrl_cpu().load()
    import gbc_reference as ref
    from torch.distributed.fsdp import fully_shard

    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from gbc_kernels.integrations.skyrl.worker import SCALE_KEY
    from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase

    rows = slice(3 * rank, 3 * rank + 3)

    def sharded():
        model = tiny_qwen2()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model

    opts = methods.MethodOptions(nthr=True, nthr_beta=0.0)
    model = sharded()
    w = build_worker(sky, gfsdp.GBCFSDPPolicyWorker, algorithm(sky, "regular", use_kl_loss=False),
                     world, model, opts)
    full = nthr_batch(sky, 41, GROUPS2, SIGNS2)
    data = full[rows]
    with skyrl_cpu().cpu_device():
        old = w.forward(data)
        data["action_log_probs"] = torch.tensor([r["logprobs"] for r in old.loss_fn_outputs])
        res = w.forward_backward(data)
        w.optim_step()
    got = dict(scale=data[SCALE_KEY], metrics=res.metrics, params=_params(model))
    seq, attn, mask = full["sequences"], full["attention_mask"], full["loss_mask"].bool()
    h, wt = _hidden64(None, seq, attn)
    want = ref.nthr_scale(h, wt, seq[:, -T:], mask, torch.tensor(GROUPS2),
                          methods.correct_from_advantages(full["advantages"], mask),
                          temperature=TEMPERATURE, beta=0.0)
    model = sharded()
    stock = build_worker(sky, FSDPPolicyWorkerBase, algorithm(sky, "regular", use_kl_loss=False),
                         world, model)
    d = nthr_batch(sky, 41, GROUPS2, SIGNS2)[rows]
    d["action_log_probs"] = data["action_log_probs"]
    d["advantages"] = d["advantages"] * want.scale[rows].float()
    with skyrl_cpu().cpu_device():
        ref_res = stock.forward_backward(d)
        stock.optim_step()
    return dict(got=got, want=dict(scale=want.scale[rows], selected=want.selected,
                                   mask=mask[rows], metrics=ref_res.metrics,
                                   params=_params(model)))


def test_nthr_two_fsdp2_ranks_a_group_over_both():
    """Two FSDP2 ranks (gloo), a group with rows on both: each rank's scales (the kept rows of
    its own old-log-prob pass, scored over the data-parallel group) equal the float64
    reference's on the whole batch, and the step equals SkyRL's stock step on the advantages
    times them."""
    from conftest import spawn_gloo

    outs = spawn_gloo(2, _nthr_two_ranks_worker)
    # rank 0's row 2 (group 1, incorrect) is selected through rank 1's correct row 3
    assert outs[0]["want"]["selected"][2].any()
    for o in outs:
        got, want = o["got"], o["want"]
        m = want["mask"]
        torch.testing.assert_close(got["scale"][m].double(), want["scale"][m].double(),
                                   rtol=1e-5, atol=1e-6)
        for k in want["metrics"]:
            assert got["metrics"][k] == pytest.approx(want["metrics"][k], rel=2e-4, abs=2e-6), k
        for n, p in want["params"].items():
            torch.testing.assert_close(got["params"][n], p, rtol=2e-4, atol=2e-6, msg=n)


def test_trainer_adds_nthr_groups_from_skyrls_uids(monkeypatch):
    """compute_advantages_and_returns (patched): SkyRL's uids as integer group ids in the batch
    (first-seen order), before SkyRL drops them; not added with NTHR off."""
    skyrl_cpu().load()
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

    from gbc_kernels.integrations.skyrl import trainer as gtrainer
    from gbc_kernels.integrations.skyrl.worker import GROUP_KEY

    wrapped = gtrainer._group_field(lambda self, data: data)
    batch = TrainingInputBatch({"sequences": torch.zeros(5, 3, dtype=torch.long)})
    batch.metadata = {"uids": ["b", "b", "a", "c", "a"]}
    monkeypatch.setenv("GBC_SKYRL_OPTIONS", "nthr=1")
    assert wrapped(None, batch)[GROUP_KEY].tolist() == [0, 0, 1, 2, 1]
    batch.metadata = {"uids": ["b", "b"]}
    with pytest.raises(ValueError, match="nthr: SkyRL's uids"):
        wrapped(None, batch)
    monkeypatch.setenv("GBC_SKYRL_OPTIONS", "")
    batch = TrainingInputBatch({"sequences": torch.zeros(2, 3, dtype=torch.long)})
    batch.metadata = {"uids": ["b", "b"]}
    assert GROUP_KEY not in wrapped(None, batch).keys()


def test_enable_refuses_critical_kl_without_skyrls_kl_loss(monkeypatch):
    """critical_kl_exponent weights SkyRL's KL-in-loss term: without use_kl_loss (or with
    kl_loss_coef 0) enable(cfg, ...) refuses it naming SkyRL's option; with it, it runs."""
    from test_skyrl import _trainer_cfg

    sky = skyrl_cpu().load()
    skyrl_cpu().entrypoint_imports()
    import gbc_kernels.integrations.skyrl as gsky
    from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker
    for name in ("PolicyWorker", "RefWorker"):
        monkeypatch.setattr(fsdp_worker, name, getattr(fsdp_worker, name))
    monkeypatch.setitem(sys.modules, gsky.MEGATRON_WORKER, None)
    monkeypatch.setenv("GBC_SKYRL_OPTIONS", "")
    for algo in (dict(use_kl_loss=False), dict(use_kl_loss=True, kl_loss_coef=0.0)):
        with pytest.raises(ValueError, match=r"critical_kl_exponent: the loss has no KL term "
                                             r"to weight \(set trainer.algorithm.use_kl_loss"):
            gsky.enable(_trainer_cfg(sky, **algo), critical_kl_exponent=2.0)
    opts = gsky.enable(_trainer_cfg(sky, use_kl_loss=True, kl_loss_coef=0.1),
                       critical_kl_exponent=2.0, nthr=True)
    assert opts.nthr and opts.critical_kl_exponent == 2.0
    assert os.environ["GBC_SKYRL_OPTIONS"] == "critical_kl_exponent=2.0,nthr=True"


# ---- every option honoured -----------------------------------------------------------------
def _pairs_worker(rank, world):
    sky = skyrl_cpu().load()
    from methods.test_options import PAIRS

    from gbc_kernels.integrations import hf
    from gbc_kernels.integrations.skyrl.worker import _position_ids

    # Lopti's threshold: the median old probability of this batch (the pairs' 1/40 is above
    # every token of this tiny model, whose tokens are all near 1/97: no split)
    d = nthr_batch(sky, 51)
    seq, attn = d["sequences"], d["attention_mask"]
    lp, _ = hf.logprobs_through_forward(tiny_qwen2(), seq, attn, T, temperature=TEMPERATURE,
                                        model_kwargs={"position_ids": _position_ids(attn)})
    eta = float(lp.exp()[d["loss_mask"].bool()].median())
    pairs = dict(PAIRS, lopti_eta=({}, dict(lopti_eta=eta)),
                 lopti_order=(dict(lopti_eta=eta), dict(lopti_eta=eta,
                                                         lopti_order="high-first")))
    from conftest import logits_dtypes_seen

    out = {}
    for name, (a, b) in pairs.items():
        runs = []
        for opts in (a, b):
            with logits_dtypes_seen() as seen:
                params = _skyrl_flow(sky, opts, nthr_batch(sky, 51))[2]
            runs.append(list(seen) if name == "logits_dtype" else params)
        out[name] = runs
    return out


def test_every_method_option_changes_skyrls_step():
    """Each field of methods.MethodOptions (tests/methods/test_options.py's pairs: two runs that
    differ only in that option; Lopti's threshold this batch's median) changes the parameters after one SkyRL step through gbc's
    workers and SkyRL's trainer: none is accepted and ignored."""
    from conftest import spawn_gloo
    from methods.test_options import FIELDS, PAIRS, SUPPORT_FIELDS

    # support / support_ties: refused by SkyRL's adapter (tests/test_support_options.py)
    assert set(PAIRS) | SUPPORT_FIELDS == FIELDS
    out = spawn_gloo(1, _pairs_worker)[0]
    for name, (pa, pb) in out.items():
        if name == "logits_dtype":   # float32 test model: the mode reached every sweep
            from conftest import assert_logits_mode_reached
            assert_logits_mode_reached(pa, pb, at_least=3)
            continue
        diff = max(float((pa[n] - pb[n]).abs().max()) for n in pa)
        assert diff > 1e-7, name
