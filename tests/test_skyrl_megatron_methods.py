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


def _pair(options, world, pp, algo, temperature=1.0, max_tokens=0):
    """(gbc's policy worker with ``options``, SkyRL's, the parameters before) on fresh copies
    of the model, tensor parallel ``world / pp``, pipeline parallel ``pp``; micro-batches of
    2 (training) and 3 (no-grad pass) rows."""
    from test_skyrl_megatron_worker import skyrl_megatron, worker_cfg, worker_pair

    cfg = worker_cfg(skyrl_megatron().sky, "regular", temperature=temperature, micro=2,
                     max_tokens=max_tokens, **algo)
    cfg.micro_forward_batch_size_per_gpu = 3
    s, g = worker_pair(cfg, options=options, tp=world // pp, pp=pp, lr=LR)
    return g, s, _params(g.actor_module[0])


def _methods_worker(rank, world):
    """Every case's (gbc, by hand) results on this rank."""
    from test_skyrl import skyrl_cpu
    from test_skyrl_megatron import _model
    from test_skyrl_megatron_worker import make_worker, skyrl_megatron

    import gbc_reference as ref
    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl.worker import KL_WEIGHT_KEY, SCALE_KEY

    sky = skyrl_megatron().sky
    ALGO = dict(use_kl_loss=False)
    out = {}
    start = None

    def pair(options, algo=ALGO, temperature=1.0, max_tokens=0):
        nonlocal start
        g, s, start = _pair(options, world, 1, algo, temperature, max_tokens)
        return g, s, g.actor_module[0], s.actor_module[0]

    with skyrl_cpu().cpu_device():
        # AR: SkyRL's step on AR's advantages
        opts = methods.MethodOptions(ar_alpha=0.4)
        g, s, gm, sm_ = pair("ar_alpha=0.4")
        data = _batch(sky, 3)
        got = g.forward_backward(data).metrics
        g.optim_step()
        hand = _batch(sky, 3)
        hand["advantages"] = methods.loss_advantages(hand["advantages"],
                                                     hand["action_log_probs"], opts)
        want = s.forward_backward(hand).metrics
        s.optim_step()
        out["ar"] = dict(got=got, want=want, params=(_params(gm), _params(sm_), start))

        # Lopti: two optimizer steps of SkyRL's step (low, then high), old log-probs fixed
        opts = methods.MethodOptions(lopti_eta=0.5, ar_alpha=0.3)
        g, s, gm, sm_ = pair("lopti_eta=0.5,ar_alpha=0.3")
        got = g.forward_backward(_batch(sky, 4)).metrics
        g.optim_step()
        want = []
        for phase in ("low", "high"):
            hand = _batch(sky, 4)
            hand["advantages"] = methods.loss_advantages(hand["advantages"],
                                                         hand["action_log_probs"], opts, phase)
            want.append(s.forward_backward(hand).metrics)
            s.optim_step()
        out["lopti"] = dict(got=got, want=want, params=(_params(gm), _params(sm_), start))

        # NTHR: kept from SkyRL's old-log-prob pass (per mini-batch), scored per update
        opts = methods.MethodOptions(nthr=True, nthr_beta=0.0)
        # SkyRL's token-based micro-batching: micro-batches of unequal sizes, padded by
        # SkyRL's worker (rows with no loss tokens, which gbc's fields are padded for)
        g, s, gm, sm_ = pair("nthr=true,nthr_beta=0.0", temperature=0.8, max_tokens=20)
        data = _batch(sky, 5)
        rows, weight = _oracle_rows(gm, data["sequences"], data["attention_mask"])
        halves = (slice(0, 3), slice(3, 6))
        forwards = [0]
        gm.register_forward_pre_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
        old = [g.forward(data[h]) for h in halves]
        data["action_log_probs"] = torch.cat([torch.tensor(
            [r["logprobs"] for r in o.loss_fn_outputs], dtype=torch.float64) for o in old])
        got, scales = [], []
        for h in halves:
            mb = data[h]
            got.append(g.forward_backward(mb).metrics)
            g.optim_step()
            scales.append(mb[SCALE_KEY])
        mask = data["loss_mask"].bool()
        oracle = ref.nthr_scale(rows, weight, data["sequences"][:, -T:], mask,
                                torch.tensor(GROUPS),
                                methods.correct_from_advantages(data["advantages"], mask),
                                temperature=0.8, beta=0.0)
        hand = _batch(sky, 5)
        hand["action_log_probs"] = data["action_log_probs"]
        hand["advantages"] = hand["advantages"] * oracle.scale
        want = []
        for h in halves:
            want.append(s.forward_backward(hand[h]).metrics)
            s.optim_step()
        from skyrl.backends.skyrl_train.workers.worker_utils import get_microbatch_iterator
        skyrls = sum(len(get_microbatch_iterator(data[h], micro_batch_size=n,
                                                 max_tokens_per_microbatch=20))
                     for h in halves for n in (2, 3))      # SkyRL's pass's and update's
        sizes = [mb["sequences"].shape[0] for h in halves for mb in get_microbatch_iterator(
            data[h], micro_batch_size=2, max_tokens_per_microbatch=20)]
        with pytest.raises(ValueError, match="recompute_old_logprobs_per_minibatch"):
            g.forward_backward(_batch(sky, 7)[0:3])      # rows the pass did not keep
        out["nthr"] = dict(got=got, want=want, params=(_params(gm), _params(sm_), start),
                           scale=torch.cat(scales), oracle=oracle, mask=mask,
                           forwards=(forwards[0], skyrls), sizes=sizes)

        # critical-token KL: the reference worker's pass gives the weights; SkyRL's KL term
        # weighted by hand on the stock side
        opts = methods.MethodOptions(**CRIT)
        text = ",".join(f"{k}={v}" for k, v in CRIT.items())
        algo = dict(use_kl_loss=True, kl_loss_coef=0.2, kl_estimator_type="k3")
        g, s, gm, sm_ = pair(text, algo)
        refm = _model(world, False)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(9)
            for p in refm.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        sref = make_worker("ref", False, g.cfg, [refm])
        gref = make_worker("ref", True, g.cfg, [refm], text)
        data = _batch(sky, 6)
        outs = gref.forward(data).loss_fn_outputs
        stock_base = torch.tensor([r["logprobs"] for r in sref.forward(data).loss_fn_outputs],
                                  dtype=torch.float64)
        data["base_action_log_probs"] = torch.tensor([r["logprobs"] for r in outs],
                                                     dtype=torch.float64)
        data[KL_WEIGHT_KEY] = torch.tensor([r[KL_WEIGHT_KEY] for r in outs])
        rows, weight = _oracle_rows(refm, data["sequences"], data["attention_mask"])
        st = ref.token_stats(rows, weight, data["sequences"][:, -T:], certainty="max_prob",
                             certainty_temperature=CRIT["critical_kl_temperature"])
        oracle = ref.critical_kl_weight(st.certainty.double(), CRIT["critical_kl_exponent"],
                                        CRIT["critical_kl_intercept"])
        got = g.forward_backward(data).metrics
        g.optim_step()
        from skyrl.backends.skyrl_train.workers.megatron import megatron_model_wrapper as mmw

        from test_skyrl_methods import _weight_stock_kl
        base_rows = data["base_action_log_probs"]
        undo = _weight_stock_kl(oracle, base_rows, mmw)
        try:
            hand = _batch(sky, 6)
            hand["base_action_log_probs"] = base_rows
            want = s.forward_backward(hand).metrics
            s.optim_step()
        finally:
            undo()
        out["critical_kl"] = dict(got=got, want=want, params=(_params(gm), _params(sm_), start),
                                  weight=data[KL_WEIGHT_KEY], oracle=oracle,
                                  mask=data["loss_mask"].bool(),
                                  base=(data["base_action_log_probs"], stock_base,
                                        st.logp))
    os.environ.pop("GBC_SKYRL_OPTIONS", None)
    return out


@pytest.fixture(scope="module")
def stepped():
    return spawn_gloo(2, _methods_worker)


def _same_params(params):
    """The parameters after the steps agree (float32 logits in SkyRL's head: 1e-6), and the
    steps moved them by far more than that."""
    got, want, start = params
    moved = max((p - start[n]).abs().max().item() for n, p in want.items())
    assert moved > 1e-3, moved
    for n, p in want.items():
        torch.testing.assert_close(got[n], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_ar_equals_skyrls_step_on_ars_advantages(stepped):
    for out in stepped:
        o = out["ar"]
        _same_metrics(o["got"], o["want"], skip=("loss_fn_outputs",))
        _same_params(o["params"])


def test_lopti_is_two_optimizer_steps_of_skyrls_step(stepped):
    """lopti_eta (with AR): gbc's worker's forward_backward runs SkyRL's step on the low
    tokens, SkyRL's optimizer step, then SkyRL's step on the high tokens (SkyRL's trainer
    takes the second optimizer step): parameters and both phases' metrics equal SkyRL's
    stock steps on the phases' advantages by hand."""
    for out in stepped:
        o = out["lopti"]
        low, high = o["want"]
        _same_metrics(o["got"], high, skip=("loss_fn_outputs",))
        _same_metrics({k[len("gbc_lopti_low/"):]: v for k, v in o["got"].items()
                       if k.startswith("gbc_lopti_low/")}, low,
                      skip=("loss_fn_outputs", "policy_lr"))
        _same_params(o["params"])


def test_nthr_from_skyrls_megatron_pass_equals_reference_and_hand(stepped):
    """nthr: SkyRL's Megatron old-log-prob pass (per mini-batch) keeps NTHR's rows on the last
    stage (each TP rank its vocabulary slice of the head); each mini-batch's forward_backward
    scores them, no forward beyond SkyRL's own (one per micro-batch of its pass and update,
    token-based micro-batches of unequal sizes, which SkyRL pads);
    the scales equal gbc_reference's (float64, whole output weight) and the steps equal
    SkyRL's stock steps on the advantages times those scales; a mini-batch the pass did not
    keep is refused on every rank, naming SkyRL's option."""
    for out in stepped:
        o = out["nthr"]
        m = o["mask"]
        forwards, skyrls = o["forwards"]
        assert forwards == skyrls
        assert len(set(o["sizes"])) > 1          # SkyRL padded a micro-batch to the others'
        assert o["oracle"].selected.any() and (o["oracle"].scale[m] != 1).any()
        torch.testing.assert_close(o["scale"][m].double(), o["oracle"].scale[m].double(),
                                   rtol=1e-5, atol=1e-6)
        for got, want in zip(o["got"], o["want"]):
            assert got["gbc_nthr_second_forward"] == 0.0
            _same_metrics(got, want, skip=("loss_fn_outputs",))
        _same_params(o["params"])


def test_critical_kl_from_skyrls_megatron_reference_pass(stepped):
    """critical_kl_exponent: SkyRL's Megatron reference worker's pass gives the weights beside
    its log-probs (== SkyRL's stock reference log-probs == gbc_reference's); the weights equal
    gbc_reference's; the policy step equals SkyRL's stock step with its KL term weighted by
    hand."""
    for out in stepped:
        o = out["critical_kl"]
        m = o["mask"]
        ours, stock, oracle = o["base"]
        torch.testing.assert_close(ours[m], stock[m], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours[m], oracle[m].double(), rtol=1e-5, atol=1e-6)
        assert o["oracle"][m].std() > 1e-3
        torch.testing.assert_close(o["weight"][m].double(), o["oracle"][m], rtol=1e-4,
                                   atol=1e-6)
        _same_metrics(o["got"], o["want"], skip=("loss_fn_outputs", "policy_kl"))
        _same_params(o["params"])


def _from_last_stage(value):
    """The last pipeline stage's ``value`` on every rank (SkyRL's trainer takes the last
    stage's outputs and stages one batch for every rank)."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every[-1]


def _pp_worker(rank, world):
    """Lopti, NTHR and critical-token KL at pipeline parallel 2 (one rank per stage): gbc's
    worker steps and SkyRL's stock steps with the method by hand (NTHR's scales and the KL
    weights: those gbc's last stage computed, as SkyRL's trainer would carry them)."""
    from megatron.core import parallel_state as mpu

    from test_skyrl import skyrl_cpu
    from test_skyrl_megatron import _model
    from test_skyrl_megatron_worker import make_worker, skyrl_megatron

    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl.worker import KL_WEIGHT_KEY, SCALE_KEY

    sky = skyrl_megatron().sky
    out = {}
    with skyrl_cpu().cpu_device():
        opts = methods.MethodOptions(lopti_eta=0.5)
        g, s, start = _pair("lopti_eta=0.5", world, 2, dict(use_kl_loss=False))
        last = mpu.is_pipeline_last_stage(ignore_virtual=True)
        got = g.forward_backward(_batch(sky, 4)).metrics
        g.optim_step()
        want = []
        for phase in ("low", "high"):
            hand = _batch(sky, 4)
            hand["advantages"] = methods.loss_advantages(hand["advantages"],
                                                         hand["action_log_probs"], opts, phase)
            want.append(s.forward_backward(hand).metrics)
            s.optim_step()
        out["lopti"] = dict(got=got, want=want, last=last,
                            params=(_params(g.actor_module[0]), _params(s.actor_module[0]),
                                    start))

        g, s, start = _pair("nthr=true,nthr_beta=0.0", world, 2, dict(use_kl_loss=False), 0.8)
        data = _batch(sky, 5)
        halves = (slice(0, 3), slice(3, 6))
        old = [g.forward(data[h]) for h in halves]
        data["action_log_probs"] = _from_last_stage(torch.cat([torch.tensor(
            [r["logprobs"] for r in o.loss_fn_outputs], dtype=torch.float64) for o in old]))
        kept = sum(e["batch"].nbytes() for e in g._gbc_nthr_kept or ())
        got, scales = [], []
        for h in halves:
            mb = data[h]
            got.append(g.forward_backward(mb).metrics)
            g.optim_step()
            scales.append(mb[SCALE_KEY] if last else None)
        scale = _from_last_stage(torch.cat(scales) if last else None)
        hand = _batch(sky, 5)
        hand["action_log_probs"] = data["action_log_probs"]
        hand["advantages"] = hand["advantages"] * scale
        want = []
        for h in halves:
            want.append(s.forward_backward(hand[h]).metrics)
            s.optim_step()
        out["nthr"] = dict(got=got, want=want, last=last, kept=kept, scale=scale,
                           mask=data["loss_mask"].bool(),
                           params=(_params(g.actor_module[0]), _params(s.actor_module[0]),
                                   start))

        text = ",".join(f"{k}={v}" for k, v in CRIT.items())
        g, s, start = _pair(text, world, 2, dict(use_kl_loss=True, kl_loss_coef=0.2,
                                                 kl_estimator_type="k3"))
        refm = _model(1, False, False, 2)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(9)
            for p in refm.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        sref = make_worker("ref", False, g.cfg, [refm])
        gref = make_worker("ref", True, g.cfg, [refm], text)
        data = _batch(sky, 6)
        outs = gref.forward(data).loss_fn_outputs
        stock_base = [r["logprobs"] for r in sref.forward(data).loss_fn_outputs]
        mine = [r["logprobs"] for r in outs]
        weights = torch.tensor([r[KL_WEIGHT_KEY] for r in outs])
        ref_out = dict(rows=len(outs), stock_base=stock_base, base=mine, weights=weights)
        data["base_action_log_probs"] = _from_last_stage(torch.tensor(mine,
                                                                      dtype=torch.float64))
        data[KL_WEIGHT_KEY] = _from_last_stage(weights)
        got = g.forward_backward(data).metrics
        g.optim_step()
        from skyrl.backends.skyrl_train.workers.megatron import megatron_model_wrapper as mmw

        from test_skyrl_methods import _weight_stock_kl
        undo = _weight_stock_kl(data[KL_WEIGHT_KEY].double(), data["base_action_log_probs"],
                                mmw)
        try:
            hand = _batch(sky, 6)
            hand["base_action_log_probs"] = data["base_action_log_probs"]
            want = s.forward_backward(hand).metrics
            s.optim_step()
        finally:
            undo()
        out["critical_kl"] = dict(got=got, want=want, last=last, ref=ref_out,
                                  mask=data["loss_mask"].bool(),
                                  params=(_params(g.actor_module[0]), _params(s.actor_module[0]),
                                          start))
    os.environ.pop("GBC_SKYRL_OPTIONS", None)
    return out


def test_methods_at_pipeline_parallel_2():
    """Lopti, NTHR and critical-token KL through SkyRL's Megatron workers at pipeline parallel
    2: every stage's parameters after the steps equal SkyRL's stock steps with the method by
    hand, the last stage's metrics too. NTHR keeps nothing on the first stage (it has no
    loss); its scales come from the last stage's kept rows, with the refusal branch taken by
    every stage together. The reference worker's first stage returns zeros beside SkyRL's
    dummy log-probs; its last stage the weights beside log-probs equal to SkyRL's."""
    first, last = spawn_gloo(2, _pp_worker)
    assert not first["lopti"]["last"] and last["lopti"]["last"]
    for out in (first, last):
        for name in ("lopti", "nthr", "critical_kl"):
            _same_params(out[name]["params"])
    lo = last["lopti"]
    low, high = lo["want"]
    _same_metrics(lo["got"], high, skip=("loss_fn_outputs",))
    _same_metrics({k[len("gbc_lopti_low/"):]: v for k, v in lo["got"].items()
                   if k.startswith("gbc_lopti_low/")}, low, skip=("loss_fn_outputs", "policy_lr"))
    n = last["nthr"]
    assert first["nthr"]["kept"] == 0 and n["kept"] > 0
    assert (n["scale"][n["mask"]] != 1).any()
    for got, want in zip(n["got"], n["want"]):
        assert got["gbc_nthr_second_forward"] == 0.0
        _same_metrics(got, want, skip=("loss_fn_outputs",))
    c = last["critical_kl"]
    _same_metrics(c["got"], c["want"], skip=("loss_fn_outputs", "policy_kl"))
    m = c["mask"]
    torch.testing.assert_close(torch.tensor(c["ref"]["base"])[m],
                               torch.tensor(c["ref"]["stock_base"])[m], rtol=1e-5, atol=1e-6)
    assert c["ref"]["weights"][m].std() > 1e-3
    f = first["critical_kl"]["ref"]
    assert f["rows"] == 1 and (f["weights"] == 0).all()
