"""The four methods on SkyRL 0.3.0's Megatron backend (gbc_kernels.integrations.skyrl.megatron
and .megatron_worker, docs/skyrl.md "Megatron"), through SkyRL's own Megatron policy and
reference workers (``MegatronPolicyWorkerBase.forward_backward`` / ``forward``: its
micro-batch dicts, its wrapper's schedule) on the tiny megatron-core GPTModel of
tests/test_skyrl_megatron.py, two gloo ranks at tensor parallel 2.

Each method's step (metrics, every parameter after the optimizer steps) equals SkyRL's stock
worker step with the method applied by hand; NTHR's scales and critical-token KL's weights
equal gbc_reference's on the model's float64 output-layer inputs and whole output weight.

The workers are built by tests/test_skyrl_megatron_worker.py's harness (``worker_pair`` /
``make_worker``: SkyRL's classes without Ray or ``init_model``; what is stood in for on CPU is
said there)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("skyrl")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import spawn_gloo  # noqa: E402

VOCAB = 50
P, T = 5, 6
LR = 0.5
GROUPS = [0, 0, 0, 1, 1, 1]
SIGNS = [1.0, -1.0, -1.0, -1.0, 1.0, -1.0]
CRIT = dict(critical_kl_exponent=2.0, critical_kl_intercept=0.1,
            critical_kl_temperature=0.7)


def _batch(sky, seed, B=6):
    """A SkyRL training batch (TrainingInputBatch): left-padded prompts, right-padded
    responses (row 1's loss mask empty), old log-probs on both sides of p = 0.5, one advantage
    per row with the signs of :data:`SIGNS`, NTHR's group ids."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

    from gbc_kernels.integrations.skyrl.worker import GROUP_KEY

    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(1, P + 1, (B,), generator=g)
    rlen = torch.randint(2, T + 1, (B,), generator=g)
    pos = torch.arange(P + T)
    attn = ((pos[None] >= P - plen[:, None]) & (pos[None] < P + rlen[:, None])).long()
    seq = torch.randint(1, VOCAB, (B, P + T), generator=g) * attn
    action = (torch.arange(T)[None] < rlen[:, None]).long()
    loss_mask = action.clone()
    loss_mask[1] = 0
    old = -1.4 * torch.rand(B, T, generator=g, dtype=torch.float64) - 0.05
    adv = (torch.rand(B, 1, generator=g, dtype=torch.float64) + 0.2) * torch.tensor(
        SIGNS[:B], dtype=torch.float64)[:, None]
    d = TrainingInputBatch({
        "sequences": seq, "attention_mask": attn, "response_mask": action,
        "loss_mask": loss_mask, "advantages": adv.expand(B, T) * action,
        "action_log_probs": old,
        "base_action_log_probs": old + 0.3 * torch.randn(B, T, generator=g,
                                                         dtype=torch.float64),
        "rollout_logprobs": None, GROUP_KEY: torch.tensor(GROUPS[:B])})
    d.metadata = {"response_length": T}
    return d


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _oracle_rows(model, seq, attn):
    """float64 rows of the output layer's input predicting each response token (each row's
    real tokens alone at positions 0..), and the whole output weight ``[V, H]``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from standins.megatron_cpu import capture_head_input, causal_mask

    B = seq.shape[0]
    H = model.output_layer.weight.shape[1]
    rows = torch.zeros(B, T, H, dtype=torch.float64)
    with torch.no_grad():
        for b in range(B):
            real = attn[b].bool()
            ids = seq[b][real][None]
            n = ids.shape[1]
            rlen = int(attn[b, -T:].sum())
            with capture_head_input(model) as seen:
                model(ids, torch.arange(n)[None], causal_mask(n))
            h = seen[0][:, 0]                                   # [n, H]
            rows[b, :rlen] = h[n - rlen - 1:n - 1].double()
        w = model.output_layer.weight.detach()
        group = mpu.get_tensor_model_parallel_group()
        parts = [torch.empty_like(w) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, w, group=group)
    return rows, torch.cat(parts).double()


def _same_metrics(got, want, skip=()):
    for k, v in want.items():
        if k in skip:
            continue
        if isinstance(v, float) and math.isnan(v):
            assert math.isnan(got[k]), k
        else:
            assert got[k] == pytest.approx(v, rel=2e-5, abs=1e-6), k


def _pair(options, world, pp, algo, temperature=1.0, max_tokens=0, cp=1, packed=False):
    """(gbc's policy worker with ``options``, SkyRL's, the parameters before) on fresh copies
    of the model, tensor parallel ``world / (pp cp)``, pipeline parallel ``pp``, context
    parallel ``cp`` (on SkyRL's packed micro-batches); micro-batches of 2 (training) and 3
    (no-grad pass) rows."""
    from test_skyrl_megatron_worker import skyrl_megatron, worker_cfg, worker_pair

    cfg = worker_cfg(skyrl_megatron().sky, "regular", packed=packed or cp > 1,
                     temperature=temperature,
                     micro=2, max_tokens=max_tokens, **algo)
    cfg.micro_forward_batch_size_per_gpu = 3
    s, g = worker_pair(cfg, options=options, tp=world // (pp * cp), pp=pp, lr=LR, cp=cp)
    return g, s, _params(g.actor_module[0])


def _from_last_stage(value):
    """The last pipeline stage's ``value`` on every rank (SkyRL's trainer takes the last
    stage's outputs and stages one batch for every rank)."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every[-1]


def _ref_model(world, pp, cp, packed):
    """The reference model: the policy's, perturbed (the same on every rank)."""
    from test_skyrl_megatron import _model

    refm = _model(world // (pp * cp), False, packed or cp > 1, pp, cp)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(9)
        for p in refm.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return refm


def _methods_worker(rank, world, pp, cp=1, packed=False,
                    cases=("ar", "lopti", "lopti_kl", "nthr", "critical_kl")):
    """Every case's (gbc, by hand) results on this rank, at pipeline parallel ``pp`` and
    context parallel ``cp`` (tensor parallel the rest of ``world``). At tensor parallel the
    methods' values by hand are gbc_reference's (the oracle: the model's float64 output-layer
    inputs); at ``pp=2`` or ``cp=2`` (no rank runs the whole model on a sequence) they are
    those gbc's last stage computed. ``packed``: SkyRL's packed micro-batches (always under
    context parallelism); ``cases``: which methods run."""
    from megatron.core import parallel_state as mpu

    from test_skyrl import skyrl_cpu
    from test_skyrl_megatron_worker import make_worker, skyrl_megatron

    sky = skyrl_megatron().sky           # SkyRL on CPU first: then SkyRL's modules import
    from skyrl.backends.skyrl_train.workers.megatron import megatron_model_wrapper as mmw
    from skyrl.backends.skyrl_train.workers.worker_utils import get_microbatch_iterator

    import gbc_reference as ref
    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl.worker import KL_WEIGHT_KEY, SCALE_KEY
    from test_skyrl_methods import _weight_stock_kl

    no_kl = dict(use_kl_loss=False)
    out = {}

    def last():
        return mpu.is_pipeline_last_stage(ignore_virtual=True)

    def result(g, s, start, **kw):
        return dict(params=(_params(g.actor_module[0]), _params(s.actor_module[0]), start),
                    **kw)

    with skyrl_cpu().cpu_device():
        if "ar" in cases:
            # AR: SkyRL's step on AR's advantages
            opts = methods.MethodOptions(ar_alpha=0.4)
            g, s, start = _pair("ar_alpha=0.4", world, pp, no_kl, cp=cp, packed=packed)
            got = g.forward_backward(_batch(sky, 3)).metrics
            g.optim_step()
            hand = _batch(sky, 3)
            hand["advantages"] = methods.loss_advantages(hand["advantages"],
                                                         hand["action_log_probs"], opts)
            want = s.forward_backward(hand).metrics
            s.optim_step()
            out["ar"] = result(g, s, start, got=got, want=want)

        if "lopti" in cases:
            # Lopti: two optimizer steps of SkyRL's step (low, then high), old log-probs fixed
            opts = methods.MethodOptions(lopti_eta=0.5, ar_alpha=0.3)
            # the logged terms: SkyRL's stock step without the split (AR's advantages, every
            # loss token) at the parameters before the first update (a fresh copy, built and
            # run first: building a model re-initialises megatron's groups)
            _, s0, start0 = _pair("", world, pp, no_kl, cp=cp, packed=packed)
            hand = _batch(sky, 4)
            hand["advantages"] = methods.loss_advantages(hand["advantages"],
                                                         hand["action_log_probs"], opts)
            whole = s0.forward_backward(hand).metrics
            g, s, start = _pair("lopti_eta=0.5,ar_alpha=0.3", world, pp, no_kl, cp=cp,
                                packed=packed)
            assert all(torch.equal(p, start[n]) for n, p in start0.items())
            got = g.forward_backward(_batch(sky, 4)).metrics
            g.optim_step()
            want = []
            for phase in ("low", "high"):
                hand = _batch(sky, 4)
                hand["advantages"] = methods.loss_advantages(hand["advantages"],
                                                             hand["action_log_probs"], opts, phase)
                want.append(s.forward_backward(hand).metrics)
                s.optim_step()
            out["lopti"] = result(g, s, start, got=got, want=want, whole=whole)

        if "lopti_kl" in cases:
            # Lopti with SkyRL's KL loss: SkyRL's step by hand on each phase's advantages with
            # its KL term counted on the phase's tokens only (each token's KL times 1 on them,
            # 0 elsewhere; SkyRL's normaliser, the row's loss tokens, kept: docs/math.md §3),
            # the reference log-probs fixed. The stock step on a phase's advantages alone keeps
            # every token's KL in both phases: each token's KL twice per batch
            opts = methods.MethodOptions(lopti_eta=0.5, ar_alpha=0.3)
            kl = dict(use_kl_loss=True, kl_loss_coef=0.2, kl_estimator_type="k3")

            _, s0, start0 = _pair("", world, pp, kl, cp=cp, packed=packed)
            # the reference log-probs: SkyRL's reference worker's on the perturbed model (near
            # the policy's: k3's clamp at 10 would cut the KL's gradient)
            refm = _ref_model(world, pp, cp, packed)
            base = _from_last_stage(torch.tensor(
                [r["logprobs"] for r in make_worker("ref", False, s0.cfg, [refm]).forward(
                    _batch(sky, 8)).loss_fn_outputs], dtype=torch.float64))

            def kl_batch():
                d = _batch(sky, 8)
                d["base_action_log_probs"] = base
                return d

            hand = kl_batch()
            hand["advantages"] = methods.loss_advantages(hand["advantages"],
                                                         hand["action_log_probs"], opts)
            whole = s0.forward_backward(hand).metrics
            g, s, start = _pair("lopti_eta=0.5,ar_alpha=0.3", world, pp, kl, cp=cp,
                                packed=packed)
            assert all(torch.equal(p, start[n]) for n, p in start0.items())
            got = g.forward_backward(kl_batch()).metrics
            g.optim_step()
            want = []
            for phase in ("low", "high"):
                hand = kl_batch()
                low = hand["action_log_probs"].exp() < opts.lopti_eta
                on = (low if phase == "low" else ~low).double()
                hand["advantages"] = methods.loss_advantages(hand["advantages"],
                                                             hand["action_log_probs"], opts, phase)
                undo = _weight_stock_kl(on, hand["base_action_log_probs"], mmw)
                try:
                    want.append(s.forward_backward(hand).metrics)
                    s.optim_step()
                finally:
                    undo()
            out["lopti_kl"] = result(g, s, start, got=got, want=want, whole=whole)

        if "nthr" in cases:
            # NTHR: kept from SkyRL's old-log-prob pass (per mini-batch), scored per update, on
            # SkyRL's token-based micro-batching: micro-batches of unequal sizes, padded by
            # SkyRL's worker (rows with no loss tokens, which gbc's fields are padded for)
            g, s, start = _pair("nthr=true,nthr_beta=0.0", world, pp, no_kl, 0.8, max_tokens=20,
                                cp=cp, packed=packed)
            gm = g.actor_module[0]
            data = _batch(sky, 5)
            mask = data["loss_mask"].bool()
            oracle = None
            if pp == cp == 1 and not packed:
                rows, weight = _oracle_rows(gm, data["sequences"], data["attention_mask"])
                oracle = ref.nthr_scale(rows, weight, data["sequences"][:, -T:], mask,
                                        torch.tensor(GROUPS),
                                        methods.correct_from_advantages(data["advantages"], mask),
                                        temperature=0.8, beta=0.0)
            halves = (slice(0, 3), slice(3, 6))
            forwards = [0]
            gm.register_forward_pre_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
            old = [g.forward(data[h]) for h in halves]
            data["action_log_probs"] = _from_last_stage(torch.cat([torch.tensor(
                [r["logprobs"] for r in o.loss_fn_outputs], dtype=torch.float64) for o in old]))
            kept = sum(e["batch"].nbytes() for e in g._gbc_nthr_kept or ())
            got, scales = [], []
            for h in halves:
                mb = data[h]
                got.append(g.forward_backward(mb).metrics)
                g.optim_step()
                scales.append(mb[SCALE_KEY] if last() else None)
            scale = _from_last_stage(torch.cat(scales) if last() else None)
            hand = _batch(sky, 5)
            hand["action_log_probs"] = data["action_log_probs"]
            hand["advantages"] = hand["advantages"] * (scale if oracle is None else oracle.scale)
            want = []
            for h in halves:
                want.append(s.forward_backward(hand[h]).metrics)
                s.optim_step()
            skyrls = sum(len(get_microbatch_iterator(data[h], micro_batch_size=n,
                                                     max_tokens_per_microbatch=20))
                         for h in halves for n in (2, 3))      # SkyRL's pass's and update's
            sizes = [mb["sequences"].shape[0] for h in halves for mb in get_microbatch_iterator(
                data[h], micro_batch_size=2, max_tokens_per_microbatch=20)]
            with pytest.raises(ValueError, match="recompute_old_logprobs_per_minibatch"):
                g.forward_backward(_batch(sky, 7)[0:3])      # rows the pass did not keep
            out["nthr"] = result(g, s, start, got=got, want=want, scale=scale, oracle=oracle,
                                 mask=mask, forwards=(forwards[0], skyrls), sizes=sizes, kept=kept)

        if "critical_kl" in cases:
            # critical-token KL: the reference worker's pass gives the weights; SkyRL's KL term
            # weighted by hand on the stock side
            text = ",".join(f"{k}={v}" for k, v in CRIT.items())
            g, s, start = _pair(text, world, pp, dict(use_kl_loss=True, kl_loss_coef=0.2,
                                                      kl_estimator_type="k3"), cp=cp,
                                packed=packed)
            refm = _ref_model(world, pp, cp, packed)
            sref = make_worker("ref", False, g.cfg, [refm])
            gref = make_worker("ref", True, g.cfg, [refm], text)
            data = _batch(sky, 6)
            outs = gref.forward(data).loss_fn_outputs
            stock_base = torch.tensor([r["logprobs"] for r in sref.forward(data).loss_fn_outputs],
                                      dtype=torch.float64)
            base = torch.tensor([r["logprobs"] for r in outs], dtype=torch.float64)
            weights = torch.tensor([r[KL_WEIGHT_KEY] for r in outs])
            data["base_action_log_probs"] = _from_last_stage(base)
            data[KL_WEIGHT_KEY] = _from_last_stage(weights)
            oracle = oracle_logp = None
            if pp == cp == 1 and not packed:
                rows, weight = _oracle_rows(refm, data["sequences"], data["attention_mask"])
                st = ref.token_stats(rows, weight, data["sequences"][:, -T:], certainty="max_prob",
                                     certainty_temperature=CRIT["critical_kl_temperature"])
                oracle = ref.critical_kl_weight(st.certainty.double(), CRIT["critical_kl_exponent"],
                                                CRIT["critical_kl_intercept"])
                oracle_logp = st.logp
            got = g.forward_backward(data).metrics
            g.optim_step()
            undo = _weight_stock_kl(data[KL_WEIGHT_KEY].double() if oracle is None else oracle,
                                    data["base_action_log_probs"], mmw)
            try:
                hand = _batch(sky, 6)
                hand["base_action_log_probs"] = data["base_action_log_probs"]
                want = s.forward_backward(hand).metrics
                s.optim_step()
            finally:
                undo()
            out["critical_kl"] = result(g, s, start, got=got, want=want, weight=weights,
                                        oracle=oracle, mask=data["loss_mask"].bool(),
                                        base=(base, stock_base, oracle_logp))
    os.environ.pop("GBC_SKYRL_OPTIONS", None)
    out["last"] = last()
    return out


@pytest.fixture(scope="module", params=[(1, 1), (2, 1), (1, 2)], ids=["tp2", "pp2", "cp2"])
def stepped(request):
    """Each rank's results, at tensor parallel 2 (``tp2``), pipeline parallel 2 (``pp2``, one
    rank per stage: the checks of the last stage's values run on rank 1) and context parallel
    2 (``cp2``, SkyRL's packed micro-batches)."""
    pp, cp = request.param
    return spawn_gloo(2, _methods_worker, pp, cp), pp, cp


def _ranks(stepped):
    """(rank results, those on the last pipeline stage) of a :func:`stepped`."""
    outs, pp, _ = stepped
    assert [o["last"] for o in outs] == ([True, True] if pp == 1 else [False, True])
    return outs, [o for o in outs if o["last"]]


def _same_params(params):
    """The parameters after the steps agree (float32 logits in SkyRL's head: 1e-6), and the
    steps moved them by far more than that."""
    got, want, start = params
    moved = max((p - start[n]).abs().max().item() for n, p in want.items())
    assert moved > 1e-3, moved
    for n, p in want.items():
        torch.testing.assert_close(got[n], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_ar_equals_skyrls_step_on_ars_advantages(stepped):
    outs, lasts = _ranks(stepped)
    for out in outs:
        _same_params(out["ar"]["params"])
    for out in lasts:
        _same_metrics(out["ar"]["got"], out["ar"]["want"], skip=("loss_fn_outputs",))


def test_lopti_is_two_optimizer_steps_of_skyrls_step(stepped):
    """lopti_eta (with AR): gbc's worker's forward_backward runs SkyRL's step on the low
    tokens, SkyRL's optimizer step, then SkyRL's step on the high tokens (SkyRL's trainer
    takes the second optimizer step): parameters (every stage's) equal SkyRL's stock steps on
    the phases' advantages by hand. The logged terms (``final_loss``, ``policy_loss``,
    ``policy_entropy``, ``policy_kl``, ``loss_metrics/*``) are the batch's without the split:
    SkyRL's stock step on AR's advantages, every loss token, at the parameters before the
    first update (issue 53, defect 1: they were the high phase's own); each phase's own
    metrics, under ``gbc_lopti_<phase>/``, equal SkyRL's stock step on its advantages."""
    outs, lasts = _ranks(stepped)
    for out in outs:
        _same_params(out["lopti"]["params"])
    for out in lasts:
        o = out["lopti"]
        low, high = o["want"]
        _same_metrics(o["got"], o["whole"], skip=("loss_fn_outputs", "policy_lr"))
        assert o["got"]["policy_lr"] == pytest.approx(high["policy_lr"])
        for phase, want in (("low", low), ("high", high)):
            _same_metrics({k[len(f"gbc_lopti_{phase}/"):]: v for k, v in o["got"].items()
                           if k.startswith(f"gbc_lopti_{phase}/")}, want,
                          skip=("loss_fn_outputs", "policy_lr"))
        # the phases' own policy losses are not the batch's (the old log)
        assert o["got"]["policy_loss"] != pytest.approx(high["policy_loss"], rel=1e-3)


def test_lopti_with_kl_loss_counts_each_tokens_kl_in_its_phase(stepped):
    """lopti_eta (with AR) and SkyRL's use_kl_loss (k3, the reference worker's log-probs):
    gbc's two optimizer steps (every stage's parameters) equal SkyRL's stock steps on the
    phases' advantages with SkyRL's KL term counted on the phase's tokens only and its
    normaliser (the row's loss tokens) kept: docs/math.md §3, each token's KL once per batch
    (the stock step on a phase's advantages alone counts every token's KL in both phases:
    tests/test_skyrl_methods.py shows it is another step). Each phase's ``final_loss`` and
    ``policy_loss`` equal those stock steps'; the logged terms are the batch's without the
    split (SkyRL's stock step on AR's advantages, KL on every loss token once)."""
    outs, lasts = _ranks(stepped)
    for out in outs:
        _same_params(out["lopti_kl"]["params"])
    for out in lasts:
        o = out["lopti_kl"]
        assert o["whole"]["policy_kl"] > 1e-3
        _same_metrics(o["got"], o["whole"], skip=("loss_fn_outputs", "policy_lr"))
        for phase, want in zip(("low", "high"), o["want"]):
            for k in ("final_loss", "policy_loss"):
                assert o["got"][f"gbc_lopti_{phase}/{k}"] == pytest.approx(
                    want[k], rel=2e-5, abs=1e-6), (phase, k)


def test_nthr_from_skyrls_megatron_pass(stepped):
    """nthr: SkyRL's Megatron old-log-prob pass (per mini-batch) keeps NTHR's rows on the last
    stage only (each TP rank its vocabulary slice of the head); each mini-batch's
    forward_backward scores them, no forward beyond SkyRL's own (one per micro-batch of its
    pass and update, token-based micro-batches of unequal sizes, which SkyRL pads); at TP 2
    the scales equal gbc_reference's (float64, whole output weight); the steps (every
    stage's parameters) equal SkyRL's stock steps on the advantages times the scales; a
    mini-batch the pass did not keep is refused on every rank, naming SkyRL's option."""
    outs, lasts = _ranks(stepped)
    for out in outs:
        o = out["nthr"]
        forwards, skyrls = o["forwards"]
        assert forwards == skyrls
        assert len(set(o["sizes"])) > 1          # SkyRL padded a micro-batch to the others'
        assert (o["kept"] > 0) == out["last"]
        _same_params(o["params"])
    for out in lasts:
        o = out["nthr"]
        m = o["mask"]
        assert (o["scale"][m] != 1).any()
        if o["oracle"] is not None:
            assert o["oracle"].selected.any()
            torch.testing.assert_close(o["scale"][m].double(), o["oracle"].scale[m].double(),
                                       rtol=1e-5, atol=1e-6)
        for got, want in zip(o["got"], o["want"]):
            assert got["gbc_nthr_second_forward"] == 0.0
            _same_metrics(got, want, skip=("loss_fn_outputs",))


def test_critical_kl_from_skyrls_megatron_reference_pass(stepped):
    """critical_kl_exponent: SkyRL's Megatron reference worker's pass gives the weights beside
    its log-probs (== SkyRL's stock reference log-probs; at TP 2 both == gbc_reference's and
    the weights too); a stage before the last gives zeros beside SkyRL's dummy log-probs; the
    policy step equals SkyRL's stock step with its KL term weighted by hand."""
    outs, lasts = _ranks(stepped)
    for out in outs:
        o = out["critical_kl"]
        _same_params(o["params"])
        if not out["last"]:
            assert o["weight"].shape == (1, 1) and (o["weight"] == 0).all()
    for out in lasts:
        o = out["critical_kl"]
        m = o["mask"]
        ours, stock, oracle = o["base"]
        torch.testing.assert_close(ours[m], stock[m], rtol=1e-5, atol=1e-6)
        assert o["weight"][m].std() > 1e-3
        if o["oracle"] is not None:
            torch.testing.assert_close(ours[m], oracle[m].double(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(o["weight"][m].double(), o["oracle"][m], rtol=1e-4,
                                       atol=1e-6)
        _same_metrics(o["got"], o["want"], skip=("loss_fn_outputs", "policy_kl"))


@pytest.mark.parametrize("stepped", [(1, 2)], indirect=True, ids=["cp2"])
def test_context_parallel_2_scales_and_weights_equal_1s(stepped):
    """At context parallel 2 each rank holds 2 of every sequence's 4 chunks; NTHR's kept rows
    and the reference pass's log-probs and KL weights are assembled over the CP group: NTHR's
    scales, the reference log-probs and the KL weights equal those of the same packed model
    on one rank."""
    outs, _, cp = stepped
    assert cp == 2
    one = spawn_gloo(1, _methods_worker, 1, 1, True, ("nthr", "critical_kl"))[0]
    m = one["nthr"]["mask"]
    assert (one["nthr"]["scale"][m] != 1).any()
    for out in outs:
        torch.testing.assert_close(out["nthr"]["scale"], one["nthr"]["scale"], rtol=1e-6,
                                   atol=1e-7)
        torch.testing.assert_close(out["critical_kl"]["weight"], one["critical_kl"]["weight"],
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["critical_kl"]["base"][0],
                                   one["critical_kl"]["base"][0], rtol=1e-6, atol=1e-6)
