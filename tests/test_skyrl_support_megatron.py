"""SkyRL 0.4's sample-support replay (``trainer.algorithm.enable_sample_support_replay``) in
gbc's Megatron workers (``GBCMegatronPolicyWorker`` / ``GBCMegatronRefWorker``, docs/skyrl.md
"The sampler's support") against SkyRL's own Megatron path.

* Scoring, float64: gbc's Megatron head (``gbc_mcore.logprobs`` on the rows gbc's wrapper
  selects, ``support_ids`` from :func:`gbc_kernels.integrations.skyrl.megatron._support_ids`)
  against SkyRL's ``compute_sample_support_scores`` on the same float64 hidden states, at
  tensor parallel 2 (gloo): its logits path (the ``[B, S, V/tp]`` logits, the columns
  gathered) and its fused path's pair projection (every ``(token, id)`` pair projected on
  the shard), its canonical alignment, log-probs, entropy and their gradients in the hidden
  states and the weight shard.
* The workers: SkyRL's REAL Megatron worker methods (tests/test_skyrl_megatron_worker.py's
  harness: ``forward_backward``, ``optim_step``, ``forward``; the reference worker's
  ``forward``) on gbc's workers against SkyRL's own on the same tiny float64 megatron-core
  GPTModel and the same SkyRL 0.4 batch (fully left-padded, response tensors right-aligned,
  with ``rollout_sample_support``), at temperature 0.8: tensor parallel 2 with and without
  sequence parallelism, padded and packed micro-batches, token-based micro-batches (SkyRL's
  padding micro-batches), data parallel 2, pipeline parallel 2, context parallel 2 (packed),
  AR (under GSPO),
  Lopti (two optimizer steps against SkyRL's two stock steps on the phases' advantages), the
  reference pass (SkyRL's Megatron reference runs at the policy's temperature). Every metric (SkyRL's
  ``policy_entropy`` the support's), ``loss_fn_outputs``, every gradient, the optimizer step,
  the old-policy and reference log-probs. SkyRL's head casts the logits to float32: agreement
  to 1e-5 (the harness's tolerance).
* Rows SkyRL's capture never writes (a target missing from its row, a repeated id): gbc's
  worker on them equals SkyRL's on the rows the capture would write (§16), and
  ``gbc_support_forced_frac`` counts the forced tokens; a loss-active token without support
  and a micro-batch without ``rollout_sample_support`` stop with SkyRL's Megatron messages; an
  id >= V in the last micro-batch is refused for the whole batch before the first micro-batch
  (no gradient, parameter or optimizer state changed).
* NTHR and critical-token KL under replay (tests/test_skyrl_megatron_methods.py's method-by-hand
  comparisons): at tensor parallel 2 NTHR's scales over the support equal gbc_reference's
  ``nthr_scale(support_ids=...)`` and the critical-KL weights its certainty over the support
  (float64, the whole output weight); at context parallel 2 both equal the packed model's on
  one rank; every step equals SkyRL's stock step under replay with the method by hand.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("skyrl")

from gbc_kernels.integrations.skyrl.losses import skyrl_replays_support  # noqa: E402

if not skyrl_replays_support():
    pytest.skip("SkyRL < 0.4: no sample-support replay", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from conftest import spawn_gloo  # noqa: E402
from test_skyrl_megatron import VOCAB  # noqa: E402
from test_skyrl_megatron_worker import (KL_ENTROPY, assert_same_step,  # noqa: E402
                                        run_worker_step, skyrl_megatron, worker_cfg,
                                        worker_pair)

TEMP = 0.8
K = 5
# gbc's per-token outputs are float32: |gbc - SkyRL float64| / max(1, max |SkyRL|)
TOL = {"logp": 1e-6, "entropy": 1e-6, "d hidden": 1e-6, "d weight": 1e-6}
P, T = 5, 6


def _support_row(g, target, size, missing=False, dup=False):
    """A sampler's row of ``size`` distinct ids (the target among them unless ``missing``),
    shuffled, ``-1`` padded to K; ``dup``: one id twice (tests/test_skyrl_support.py's)."""
    others = torch.randperm(VOCAB, generator=g)
    others = others[others != target][:K]
    ids = others[:size - 1].tolist() + ([] if missing else [target])
    if missing:
        ids.append(int(others[size - 1]))
    ids = [ids[i] for i in torch.randperm(len(ids), generator=g).tolist()]
    if dup and len(ids) < K:
        ids.append(ids[0])
    return ids + [-1] * (K - len(ids))


def replay_batch(seed, n=2, B=3, forced=(), dup=(), bare=(), bare_active=(), support=True):
    """SkyRL 0.4's ``TrainingInputBatch`` of ``n * B`` sequences (fully left-padded, the
    response tensors right-aligned, as its ``convert_prompts_responses_to_batch_tensors`` makes
    them; float64 per-token inputs; an empty response and a row with an empty loss mask) with
    ``rollout_sample_support``: each response token's row of 1..K ids. ``forced`` / ``dup`` /
    ``bare`` / ``bare_active``: ``(b, j)`` whose row lacks its target / repeats an id / is all
    ``-1`` on a loss-masked-out token / is all ``-1`` on a loss-active token (SkyRL's error).
    Returns ``(raw, clean)``: the batch with these rows, and with the rows as SkyRL's capture
    writes them (the target in, no duplicate)."""
    from test_skyrl import skyrl_cpu

    skyrl_cpu().load()
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.utils.packed_tensor import PackedTensor

    g = torch.Generator().manual_seed(seed)
    N, S = n * B, P + T
    seq = torch.randint(1, VOCAB, (N, S), generator=g)
    attn = torch.zeros(N, S, dtype=torch.long)
    plen = torch.randint(2, P + 1, (N,), generator=g)
    rlen = torch.randint(1, T + 1, (N,), generator=g)
    rlen[0] = T
    rlen[N - 2] = 0                                  # an empty response
    lm = torch.zeros(N, T, dtype=torch.float64)
    rows, clean = [], []
    for b in range(N):
        ln, r = int(plen[b]) + int(rlen[b]), int(rlen[b])
        attn[b, S - ln:] = 1
        lm[b, T - r:] = 1
        for j in range(r):
            y = int(seq[b, S - r + j])
            size = int(torch.randint(1, K + 1, (1,), generator=g))
            if (b, j) in bare or (b, j) in bare_active:
                row, c = [-1] * K, []
                if (b, j) in bare:
                    lm[b, T - r + j] = 0
            else:
                miss, dp = (b, j) in forced, (b, j) in dup
                row = _support_row(g, y, min(max(size, 2), K - 1) if dp else size, miss, dp)
                c = [i for i in dict.fromkeys(row) if i >= 0]
                c = c if y in c else c + [y]
            rows.append(row)
            clean.append(c + [-1] * (K + 1 - len(c)))
    seq = seq * attn
    response = lm.clone()
    loss_mask = lm.clone()
    loss_mask[1] = 0.0                               # a row with an empty loss mask
    adv = torch.randn(N, 1, generator=g, dtype=torch.float64).expand(N, T) * response
    old = -2.0 * torch.rand(N, T, generator=g, dtype=torch.float64) - 1.0
    cu = torch.zeros(N + 1, dtype=torch.int32)
    cu[1:] = rlen.cumsum(0)
    d = {"sequences": seq, "attention_mask": attn, "response_mask": response,
         "loss_mask": loss_mask, "advantages": adv.contiguous(), "action_log_probs": old,
         "base_action_log_probs": old + 0.3 * torch.randn(N, T, generator=g,
                                                          dtype=torch.float64),
         "rollout_logprobs": old + 0.05 * torch.randn(N, T, generator=g, dtype=torch.float64)}
    out = []
    for r, width in ((rows, K), (clean, K + 1)):
        fields = dict(d)
        if support:
            fields["rollout_sample_support"] = PackedTensor(
                torch.tensor(r, dtype=torch.int32).reshape(-1, width), cu.clone())
        batch = TrainingInputBatch(fields)
        batch.metadata = {"response_length": T}
        out.append(batch)
    return out


# ---- scoring, float64, against SkyRL's compute_sample_support_scores ------------------------
def _scores_worker(rank, world):
    """Tensor parallel ``world``: SkyRL's ``compute_sample_support_scores`` (logits path and
    pair projection) and gbc's Megatron head on the same float64 hidden states; values and
    gradients."""
    from megatron.core import parallel_state as mpu

    from test_verl_megatron import _mc

    skyrl_megatron()
    mc = _mc()
    mc.install_shims()
    mc.init_parallel(world)
    from skyrl.backends.skyrl_train.distributed.megatron.token_metadata import (
        canonical_token_metadata_layout)
    from skyrl.backends.skyrl_train.utils.sample_support_replay import (
        compute_sample_support_scores)

    from gbc_kernels.integrations import megatron as gbc_megatron
    from gbc_kernels.integrations.skyrl import megatron as sm

    raw, clean = replay_batch(21, forced=((0, 2), (4, 0)), dup=((2, 1),), bare=((0, 4),))
    seq, attn = raw["sequences"], raw["attention_mask"]
    N, S = seq.shape
    H, vs = 16, VOCAB // world
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(N, S, H, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, H, generator=g, dtype=torch.float64)
    shard = weight[rank * vs:(rank + 1) * vs]
    group = mpu.get_tensor_model_parallel_group()
    lm = raw["loss_mask"]
    u = torch.randn(N, T, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    out = {}
    for path in ("logits", "pairs"):
        h = hidden.clone().requires_grad_(True)
        w = shard.clone().requires_grad_(True)
        src = (h @ w.T) / TEMP if path == "logits" else h
        sc = compute_sample_support_scores(
            src, seq, lm, clean["rollout_sample_support"], T, packed=False,
            metadata_layout=canonical_token_metadata_layout(attn.bool()),
            vocab_start_index=rank * vs, vocab_end_index=(rank + 1) * vs, tp_group=group,
            lm_head_weight=w if path == "pairs" else None, temperature=TEMP, chunk_size=7,
            compute_entropy=True, entropy_requires_grad=True)
        lp, ent = sc.logprobs[:, -T:], sc.entropy[:, -T:]
        (lp * u + 0.3 * ent).sum().backward()
        out[path] = (lp.detach(), ent.detach(), h.grad, w.grad)
    # gbc: the rows gbc's wrapper scores (row t predicting response token t + 1), its support
    h = hidden.clone().requires_grad_(True)
    w = shard.clone().requires_grad_(True)
    cfg = skyrl_megatron().sky.config.TrainerConfig()
    cfg.algorithm.enable_sample_support_replay = True
    data = {"rollout_sample_support": raw["rollout_sample_support"], "loss_mask": lm,
            "attention_mask": attn}
    ids = sm._support_ids(cfg.algorithm, data, T)
    res = gbc_megatron.logprobs(h[:, -T - 1:-1].transpose(0, 1), w, seq[:, -T:], None,
                                temperature=TEMP, support_ids=ids, tp_group=group)
    (res.logp * u + 0.3 * res.entropy).sum().backward()
    out["gbc"] = (res.logp.detach(), res.entropy.detach(), h.grad, w.grad)
    out["real"] = (ids >= 0).any(-1)
    return out


def test_scores_equal_skyrls_megatron_path_float64():
    """gbc's Megatron head with the wrapper's support equals SkyRL's Megatron scoring in
    float64 at tensor parallel 2, on its logits path and its pair projection: log-probs,
    entropy over the support, ``d hidden`` and the shard's ``d weight``; rows SkyRL's capture
    never writes (a target missing, a repeated id) scored by gbc as §16 says, equal to SkyRL on
    the rows the capture writes."""
    errors = {}
    ranks = spawn_gloo(2, _scores_worker)
    # SkyRL's d hidden is each shard's part (megatron's output layer all-reduces it in its
    # backward); gbc's vocab-parallel path gives the whole on every rank
    whole = {path: sum(out[path][2] for out in ranks) for path in ("logits", "pairs")}
    for rank, out in enumerate(ranks):
        got = out["gbc"]
        for path in ("logits", "pairs"):
            for i, what in enumerate(("logp", "entropy", "d hidden", "d weight")):
                a, b = got[i].double(), out[path][i].double()
                if i == 2:
                    b = whole[path]
                if i < 2:                       # SkyRL's: 0 where a column has no row
                    a = torch.where(out["real"], a, 0.0)
                e = float((a - b).abs().max() / max(1.0, float(b.abs().max())))
                errors[what] = max(errors.get(what, 0.0), e)
        assert (got[0] <= 0).all()
    print("\nSkyRL Megatron replay scoring, gbc vs SkyRL float64, max error:",
          ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    # gbc's per-token outputs are float32 (its head's float32 row statistics): their rounding
    for what, e in errors.items():
        assert e < TOL[what], (what, e)


# ---- the workers against SkyRL's own (gloo) ------------------------------------------------
# name: (kind, worker_cfg keywords, worker_pair keywords, replay_batch keywords, options)
CASES = {
    "padded": ("policy", dict(micro=3, temperature=TEMP, **KL_ENTROPY), {}, {}, ""),
    "packed_sp": ("policy", dict(packed=True, micro=3, temperature=TEMP, **KL_ENTROPY),
                  dict(sp=True), {}, ""),
    "forced_dup_padded": ("policy", dict(micro=3, temperature=TEMP, **KL_ENTROPY), {},
                          dict(forced=((0, 3), (2, 0)), dup=((3, 1),), bare=((0, 1),)), ""),
    "tokens_packed": ("policy", dict(packed=True, max_tokens=14, temperature=TEMP,
                                     **KL_ENTROPY), {}, dict(forced=((0, 0),)), ""),
    "ar_gspo": ("policy", dict(loss_type="gspo", micro=3, temperature=TEMP), {}, {},
                "ar_alpha=0.4"),
    "ref": ("ref", dict(micro=4, temperature=TEMP), {}, {}, ""),
    "ref_tokens_packed": ("ref", dict(packed=True, max_tokens=14, temperature=TEMP), {}, {},
                          ""),
}
TWO_RANK_CASES = {    # data parallel 2 (each rank its own batch); pipeline parallel 2
    "dp2_packed": ("policy", dict(packed=True, micro=3, temperature=TEMP, **KL_ENTROPY),
                   dict(tp=1), dict(per_rank=True), ""),
    "pp2": ("policy", dict(micro=3, temperature=TEMP, **KL_ENTROPY), dict(tp=1, pp=2),
            dict(forced=((0, 2),)), ""),
}
CP_CASES = {
    "cp2_packed": ("policy", dict(packed=True, micro=3, temperature=TEMP, **KL_ENTROPY),
                   dict(tp=1, cp=2), dict(forced=((0, 2),)), ""),
    "cp2_ref": ("ref", dict(packed=True, micro=4, temperature=TEMP), dict(tp=1, cp=2), {}, ""),
}


def _cases_worker(rank, world, cases):
    from gbc_kernels import methods

    sky = skyrl_megatron().sky
    out = {}
    for name, (kind, cfg_kw, pair_kw, batch_kw, options) in cases.items():
        batch_kw = dict(batch_kw)
        seed = 31 + (100 * rank if batch_kw.pop("per_rank", False) else 0)
        cfg = worker_cfg(sky, enable_sample_support_replay=True, **cfg_kw)
        stock, ours = worker_pair(cfg, kind, options=options, **pair_kw)
        for w in (stock, ours):
            w.enable_sample_support_replay = True     # init_model's, from the config
        raw, clean = replay_batch(seed, **batch_kw)
        fraw, fclean = replay_batch(seed + 1, n=3)
        if options:                                  # AR by hand on SkyRL's side
            opts = methods.MethodOptions(ar_alpha=0.4)
            clean["advantages"] = methods.loss_advantages(clean["advantages"],
                                                          clean["action_log_probs"], opts)
        train = kind == "policy"
        got = run_worker_step(ours, raw if train else None, fraw)
        want = run_worker_step(stock, clean if train else None, fclean)
        if train:       # SkyRL 0.4 returns loss_fn_outputs in the batch's order
            for res in (got, want):
                res["output_masks"] = raw["loss_mask"].detach().cpu()
        out[name] = (want, got)
    os.environ.pop("GBC_SKYRL_OPTIONS", None)
    if "padded" in cases:   # the control: SkyRL's worker without replay (the whole vocabulary)
        cfg = worker_cfg(sky, **cases["padded"][1])
        stock, _ = worker_pair(cfg, "policy")
        raw, clean = replay_batch(31)
        out["control"] = run_worker_step(stock, clean, replay_batch(32, n=3)[1])
    return out


def _same(want, got, what):
    frac = got.get("metrics", {}).pop("gbc_support_forced_frac", None)
    assert_same_step(want, got, what)
    return frac


@pytest.fixture(scope="module")
def tp2():
    return spawn_gloo(2, _cases_worker, CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_worker_replay_equals_skyrls_megatron_worker(tp2, name):
    """Tensor parallel 2: SkyRL's Megatron worker methods under replay on gbc's workers ==
    on SkyRL's (every metric, loss_fn_outputs, every gradient, the optimizer step, the
    old-policy pass's log-probs; the reference worker's pass at the policy's temperature),
    padded and packed, with sequence parallelism, token-based micro-batches (padding
    micro-batches), AR under GSPO; targets missing from their rows and a repeated id on gbc's
    side equal SkyRL on the rows its capture writes, counted by ``gbc_support_forced_frac``."""
    kind, _, _, batch_kw, _ = CASES[name]
    for r, per_rank in enumerate(tp2):
        want, got = per_rank[name]
        frac = _same(want, got, f"rank {r} {name}")
        if kind == "policy":
            assert frac is not None and (frac > 0) == bool(batch_kw.get("forced")), (name, frac)


def test_replay_changes_the_step(tp2):
    """The control: SkyRL's worker without replay gives other metrics, log-probs and
    gradients than with it on the same batch (the support is what the comparisons see)."""
    for per_rank in tp2:
        want, _ = per_rank["padded"]
        full = per_rank["control"]
        assert full["metrics"]["policy_loss"] != pytest.approx(want["metrics"]["policy_loss"])
        assert full["logp"] != want["logp"]
        assert any(not torch.allclose(full["grads"][k], want["grads"][k], rtol=1e-3)
                   for k in want["grads"])


@pytest.fixture(scope="module")
def two_ranks():
    return spawn_gloo(2, _cases_worker, TWO_RANK_CASES)


@pytest.mark.parametrize("name", sorted(TWO_RANK_CASES))
def test_worker_replay_data_and_pipeline_parallel_2(two_ranks, name):
    """Data parallel 2, each rank its own batch: SkyRL's dp scaling and its metrics'
    all-reduce under replay, each rank's gradients. Pipeline parallel 2 (megatron's 1F1B
    schedule): the last stage scores the support, the metrics reach both stages, every stage's
    gradients."""
    for r, per_rank in enumerate(two_ranks):
        want, got = per_rank[name]
        _same(want, got, f"rank {r} {name}")
    if name == "pp2":
        assert [per_rank[name][0]["last"] for per_rank in two_ranks] == [False, True]


@pytest.mark.parametrize("name", sorted(CP_CASES))
def test_worker_replay_context_parallel_2(name):
    """Context parallel 2 (packed): each rank scores its own tokens over their support rows
    (SkyRL all-gathers its support scores over the CP group); every metric (the forced share
    the whole micro-batch's), loss_fn_outputs, each rank's gradients, the no-grad passes."""
    for r, per_rank in enumerate(spawn_gloo(2, _cases_worker, {name: CP_CASES[name]})):
        want, got = per_rank[name]
        frac = _same(want, got, f"rank {r} {name}")
        if CP_CASES[name][0] == "policy":
            assert frac is not None and frac > 0


def _lopti_worker(rank, world):
    """Lopti (with AR) under replay, tensor parallel 2: gbc's worker's two optimizer steps
    against SkyRL's stock steps on the phases' advantages by hand; the parameters before and
    after, and the phases' own metrics."""
    from gbc_kernels import methods
    from test_skyrl import skyrl_cpu
    from test_skyrl_megatron_methods import _params

    sky = skyrl_megatron().sky
    opts = methods.MethodOptions(lopti_eta=0.5, ar_alpha=0.3)
    # no KL term (tests/test_skyrl_megatron_methods.py's Lopti case: SkyRL's step by hand on a
    # phase's advantages keeps the KL of every token)
    cfg = worker_cfg(sky, micro=3, temperature=TEMP, enable_sample_support_replay=True,
                     use_kl_loss=False)
    stock, ours = worker_pair(cfg, options="lopti_eta=0.5,ar_alpha=0.3", lr=0.2)
    for w in (stock, ours):
        w.enable_sample_support_replay = True
    start = _params(ours.actor_module[0])
    raw, _ = replay_batch(51, forced=((0, 1),))
    want = []
    with skyrl_cpu().cpu_device():
        os.environ["GBC_SKYRL_OPTIONS"] = ours.gbc_test_options
        got = ours.forward_backward(raw).metrics
        ours.optim_step()
        os.environ["GBC_SKYRL_OPTIONS"] = ""
        for phase in ("low", "high"):
            _, hand = replay_batch(51, forced=((0, 1),))
            hand["advantages"] = methods.loss_advantages(hand["advantages"],
                                                         hand["action_log_probs"], opts, phase)
            want.append(stock.forward_backward(hand).metrics)
            stock.optim_step()
    os.environ.pop("GBC_SKYRL_OPTIONS", None)
    return dict(got=got, want=want, params=(_params(ours.actor_module[0]),
                                            _params(stock.actor_module[0]), start))


def test_lopti_under_replay_is_two_optimizer_steps_of_skyrls_step():
    """Lopti (``lopti_eta=0.5``, with AR) under replay: gbc's Megatron worker's
    ``forward_backward`` + ``optim_step`` (SkyRL's step on the low tokens, an optimizer step,
    the high tokens) moves the parameters as SkyRL's two stock steps on the phases' AR
    advantages under replay; each phase's own metrics equal SkyRL's step on its advantages."""
    from test_skyrl_megatron_methods import _same_metrics, _same_params

    for out in spawn_gloo(2, _lopti_worker):
        _same_params(out["params"])
        for phase, want in zip(("low", "high"), out["want"]):
            own = {k[len(f"gbc_lopti_{phase}/"):]: v for k, v in out["got"].items()
                   if k.startswith(f"gbc_lopti_{phase}/")}
            _same_metrics(own, want, skip=("loss_fn_outputs", "policy_lr"))
        assert out["got"]["gbc_support_forced_frac"] > 0


# ---- SkyRL's errors ----------------------------------------------------------------------
def _errors_worker(rank, world, packed):
    sky = skyrl_megatron().sky
    msgs = {}
    for kind in ("policy", "ref"):
        cfg = worker_cfg(sky, packed=packed, micro=3, temperature=TEMP,
                         enable_sample_support_replay=True)
        pair = worker_pair(cfg, kind)
        for gbc_on, w in zip((False, True), pair):
            w.enable_sample_support_replay = True
            cases = {"bare_active": replay_batch(41, bare_active=((2, 0),))[0],
                     "missing": replay_batch(42, support=False)[0]}
            for case, batch in cases.items():
                calls = [("forward", lambda b=batch: run_worker_step(w, None, b))]
                if kind == "policy":
                    calls.append(("forward_backward",
                                  lambda b=batch: run_worker_step(w, b, None, optim=False)))
                for call, f in calls:
                    try:
                        f()
                        msgs[(gbc_on, kind, case, call)] = None
                    except ValueError as err:
                        msgs[(gbc_on, kind, case, call)] = str(err)
    os.environ.pop("GBC_SKYRL_OPTIONS", None)
    return msgs


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_skyrls_errors(packed):
    """A loss-active token whose row holds no id, and a micro-batch without
    ``rollout_sample_support``: gbc's Megatron training step, old-policy pass and reference
    pass stop with the message SkyRL's Megatron workers stop with."""
    msgs = spawn_gloo(2, _errors_worker, packed)[0]
    keys = [k for k in msgs if k[0]]
    assert len(keys) == 6
    for key in keys:
        ours, stock = msgs[key], msgs[(False,) + key[1:]]
        assert ours is not None and stock is not None, (key, ours, stock)
        if key[2] == "bare_active":
            assert "requires captured support for every loss-active token" in ours, key
            assert "requires captured support for every loss-active token" in stock, key
        else:
            assert ours == stock and "rollout_sample_support" in ours, (key, ours)


def _bad_id_worker(rank, world, packed):
    """gbc's Megatron policy worker (tensor parallel 2) on a batch of two micro-batches whose
    last one holds an id V (the padded vocabulary) on a loss-active token; the old-policy and
    reference passes on it."""
    from test_skyrl import skyrl_cpu

    from gbc_kernels.integrations.skyrl.worker import vocab_size

    sky = skyrl_megatron().sky
    cfg = worker_cfg(sky, packed=packed, micro=3, temperature=TEMP,
                     enable_sample_support_replay=True)
    _, ours = worker_pair(cfg)
    ours.enable_sample_support_replay = True
    V = vocab_size(ours)              # megatron's padded vocabulary: both shards' rows
    assert V == 2 * ours.actor_module[0].output_layer.weight.shape[0] > VOCAB
    raw, _ = replay_batch(61)
    sup = raw["rollout_sample_support"]
    row = int(sup.cu_seqlens[5])                     # sequence 5: the second micro-batch's
    assert int(sup.cu_seqlens[6]) > row and bool(raw["loss_mask"][5].any())
    sup.values[row, 0] = V
    out = {"row": row, "V": V}
    ours.optimizer.opt = torch.optim.Adam(ours.optimizer.params, lr=0.5)   # with state
    params = [p for c in ours.actor_module for p in c.parameters()]
    before = [p.detach().clone() for p in params]
    os.environ["GBC_SKYRL_OPTIONS"] = ours.gbc_test_options
    for call in ("forward_backward", "forward"):
        with skyrl_cpu().cpu_device():
            try:
                getattr(ours, call)(raw)
                out[call] = None
            except ValueError as err:
                out[call] = str(err)
        if call == "forward_backward":
            out["grads"] = sum(p.grad is not None for p in params)
            out["moved"] = sum(not torch.equal(p, b) for p, b in zip(params, before))
            out["state"] = ours.optimizer.opt.state_dict()["state"]
    _, ref = worker_pair(cfg, "ref")
    ref.enable_sample_support_replay = True
    with skyrl_cpu().cpu_device():
        try:
            ref.forward(raw)
            out["ref"] = None
        except ValueError as err:
            out["ref"] = str(err)
    os.environ.pop("GBC_SKYRL_OPTIONS", None)
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_id_outside_the_vocabulary_refused_before_the_first_micro_batch(packed):
    """An id >= V in ``rollout_sample_support`` on a loss-active token of the batch's LAST
    micro-batch (tensor parallel 2: V megatron's padded vocabulary, both shards' rows, 64 here;
    the ids below it are real logits): gbc's Megatron
    worker's ``forward_backward`` refuses it naming ``support_ids``, the range, the id and
    where it sits, before SkyRL's schedule runs the first micro-batch — no parameter's
    ``.grad`` set, every parameter as it was, the optimizer's state (Adam) empty, on both
    ranks. (Refused in the wrapper's loss function of the micro-batch that holds it, the
    first micro-batch's backward had already run.) The old-policy and reference passes refuse
    it the same way, up front."""
    import re

    for r, out in enumerate(spawn_gloo(2, _bad_id_worker, packed)):
        V = out["V"]
        where = (rf"at index \[5, \d+, 0\] of the batch's support \(rollout_sample_support: "
                 rf"sequence 5's row 0, values row {out['row']}, slot 0\); checked for the "
                 rf"whole batch before its first micro-batch")
        msg = out["forward_backward"]
        assert msg is not None and "support_ids" in msg, (r, msg)
        assert out["grads"] == 0 and out["moved"] == 0 and out["state"] == {}, (r, out)
        assert re.match(rf"^support_ids: expected ids in \[-1, {V}\) \(-1: padding\) on "
                        rf"masked-in tokens \(the loss mask's\), got {V} {where}", msg), (r, msg)
        for call in ("forward", "ref"):
            assert out[call] is not None and re.match(
                rf"^support_ids: expected ids in \[-1, {V}\) \(-1: padding\) on the "
                rf"response tokens, got {V} {where}", out[call]), (r, call, out[call])


def test_megatron_switch_on(monkeypatch):
    """Under replay gbc's Megatron wrapper's config check passes (the refusal lifted), with
    NTHR and critical-token KL on too (they run over the support: the cases above)."""
    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl import megatron as gmeg
    from gbc_kernels.integrations.skyrl import worker
    from test_skyrl import skyrl_cpu

    sky = skyrl_cpu().load()
    monkeypatch.setenv("GBC_SKYRL_OPTIONS", "")
    cfg = sky.config.TrainerConfig()
    cfg.strategy = "megatron"
    cfg.algorithm.enable_sample_support_replay = True
    cfg.remove_microbatch_padding = True
    assert gmeg.check_megatron_config(cfg, methods.MethodOptions()) == methods.MethodOptions()
    worker.check_config(cfg, methods.MethodOptions())
    cfg.algorithm.use_kl_loss = True
    for opts in (methods.MethodOptions(nthr=True),
                 methods.MethodOptions(critical_kl_exponent=2.0),
                 methods.MethodOptions(nthr=True, critical_kl_exponent=2.0)):
        assert gmeg.check_megatron_config(cfg, opts) == opts


# ---- NTHR and critical-token KL under replay ---------------------------------------------
GROUPS = [0, 0, 0, 1, 1, 1]
# row 1's loss mask and row 4's response are empty (replay_batch): one correct and one
# incorrect response with loss tokens in each group
SIGNS = [1.0, -1.0, -1.0, 1.0, -1.0, -1.0]
RAW = dict(forced=((0, 1), (2, 0)), dup=((0, 3),))
CRIT = "critical_kl_exponent=2.0,critical_kl_intercept=0.1,critical_kl_temperature=0.7"


def methods_batch(seed):
    """(raw, clean) :func:`replay_batch` with signed advantages and NTHR's group ids; targets
    missing from their rows and a repeated id on the raw side (:data:`RAW`)."""
    from gbc_kernels.integrations.skyrl.worker import GROUP_KEY

    out = replay_batch(seed, **RAW)
    for d in out:
        d["advantages"] = d["advantages"].abs() * torch.tensor(SIGNS, dtype=torch.float64)[
            :, None] + 0.0
        d[GROUP_KEY] = torch.tensor(GROUPS)
    return out


def _oracle(model, batch):
    """float64 rows of the output layer's input predicting each response column (each row's
    real tokens alone at positions 0..; the batch is fully left-padded, its responses
    right-aligned), the whole output weight ``[V, H]`` and the batch's support by SkyRL's own
    alignment."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from standins.megatron_cpu import capture_head_input, causal_mask
    from test_skyrl_support_methods import skyrl_support_ids

    seq, attn = batch["sequences"], batch["attention_mask"]
    B = seq.shape[0]
    H = model.output_layer.weight.shape[1]
    rows = torch.zeros(B, T, H, dtype=torch.float64)
    with torch.no_grad():
        for b in range(B):
            ids = seq[b][attn[b].bool()][None]
            n = ids.shape[1]
            with capture_head_input(model) as seen:
                model(ids, torch.arange(n)[None], causal_mask(n))
            h = seen[0][:, 0].double()                          # [n, H]
            for t in range(T):
                if n - T + t - 1 >= 0:             # column t is predicted at position S-T+t-1
                    rows[b, t] = h[n - T + t - 1]
        w = model.output_layer.weight.detach()
        group = mpu.get_tensor_model_parallel_group()
        parts = [torch.empty_like(w) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, w, group=group)
    return rows, torch.cat(parts).double(), skyrl_support_ids(batch, T)


def _support_methods_worker(rank, world, cp=1, packed=None):
    """NTHR and critical-token KL under replay at tensor parallel ``world / cp``: padded
    micro-batches (the values by hand gbc_reference's over the support) or packed ones
    (``packed``, always under context parallelism ``cp > 1``: the values by hand those gbc's
    last stage computed): gbc's worker's steps and SkyRL's stock steps under replay with the
    method applied by hand."""
    skyrl_megatron()                # SkyRL on CPU first: then SkyRL's modules import
    from skyrl.backends.skyrl_train.workers.megatron import megatron_model_wrapper as mmw

    import gbc_reference as ref
    from gbc_kernels import methods
    from gbc_kernels.integrations.skyrl.worker import KL_WEIGHT_KEY, SCALE_KEY
    from test_skyrl import skyrl_cpu
    from test_skyrl_megatron_methods import _pair, _params, _ref_model
    from test_skyrl_megatron_worker import make_worker
    from test_skyrl_methods import _weight_stock_kl
    packed = cp > 1 if packed is None else packed
    oracle_on = not packed
    replay = dict(enable_sample_support_replay=True)
    out = {}

    def result(g, s, start, **kw):
        return dict(params=(_params(g.actor_module[0]), _params(s.actor_module[0]), start), **kw)

    with skyrl_cpu().cpu_device():
        # NTHR: kept (with the support) from SkyRL's old-log-prob pass per mini-batch, scored
        # per update; token-based micro-batches (SkyRL's padding micro-batches)
        g, s, start = _pair("nthr=true,nthr_beta=0.0", world, 1,
                            dict(use_kl_loss=False, **replay), TEMP, max_tokens=20, cp=cp,
                            packed=packed)
        for w in (g, s):
            w.enable_sample_support_replay = True
        data, clean = methods_batch(61)
        mask = data["loss_mask"].bool()
        want = full = None
        if oracle_on:
            rows, weight, ids = _oracle(g.actor_module[0], data)
            args = (rows, weight, data["sequences"][:, -T:], mask, torch.tensor(GROUPS),
                    methods.correct_from_advantages(data["advantages"], mask))
            want = ref.nthr_scale(*args, temperature=TEMP, beta=0.0, support_ids=ids)
            full = ref.nthr_scale(*args, temperature=TEMP, beta=0.0)      # the control
        halves = (slice(0, 3), slice(3, 6))
        old = [g.forward(data[h]) for h in halves]
        data["action_log_probs"] = torch.cat([torch.tensor(
            [r["logprobs"] for r in o.loss_fn_outputs], dtype=torch.float64) for o in old])
        # the kept rows carry their support (a sixth field: methods.NTHRBatch.add's support_ids)
        kinds = {len(row) for e in g._gbc_nthr_kept for row in e["batch"].rows}
        got, scales = [], []
        for h in halves:
            mb = data[h]
            got.append(g.forward_backward(mb).metrics)
            g.optim_step()
            scales.append(mb[SCALE_KEY])
        scale = torch.cat(scales)
        clean["action_log_probs"] = data["action_log_probs"]
        clean["advantages"] = clean["advantages"] * (scale if want is None else want.scale)
        hand = []
        for h in halves:
            hand.append(s.forward_backward(clean[h]).metrics)
            s.optim_step()
        out["nthr"] = result(g, s, start, got=got, want=hand, scale=scale, mask=mask,
                             kinds=kinds, oracle=None if want is None else (
                                 want.scale, want.selected, want.scores, full.scores))

        # critical-token KL: the reference worker's pass over the support gives the weights;
        # SkyRL's stock step under replay with its KL term weighted by hand
        g, s, start = _pair(CRIT, world, 1, dict(use_kl_loss=True, kl_loss_coef=0.2,
                                                 kl_estimator_type="k3", **replay),
                            TEMP, cp=cp, packed=packed)
        refm = _ref_model(world, 1, cp, packed)
        sref = make_worker("ref", False, g.cfg, [refm])
        gref = make_worker("ref", True, g.cfg, [refm], CRIT)
        for w in (g, s, sref, gref):
            w.enable_sample_support_replay = True
        data, clean = methods_batch(62)
        outs = gref.forward(data).loss_fn_outputs
        stock_base = torch.tensor([r["logprobs"] for r in sref.forward(clean).loss_fn_outputs],
                                  dtype=torch.float64)
        base = torch.tensor([r["logprobs"] for r in outs], dtype=torch.float64)
        weights = torch.tensor([r[KL_WEIGHT_KEY] for r in outs])
        data["base_action_log_probs"] = base
        data[KL_WEIGHT_KEY] = weights
        oracle = None
        if oracle_on:
            rows, weight, ids = _oracle(refm, data)
            cert = dict(certainty="max_prob", certainty_temperature=0.7)
            y = data["sequences"][:, -T:]
            st = ref.token_stats(rows, weight, y, temperature=TEMP, support_ids=ids, **cert)
            fst = ref.token_stats(rows, weight, y, temperature=TEMP, **cert)   # the control
            oracle = (ref.critical_kl_weight(st.certainty.double(), 2.0, 0.1), st.logp,
                      ref.critical_kl_weight(fst.certainty.double(), 2.0, 0.1))
        got = g.forward_backward(data).metrics
        g.optim_step()
        undo = _weight_stock_kl(weights.double() if oracle is None else oracle[0],
                                data["base_action_log_probs"], mmw)
        try:
            clean["base_action_log_probs"] = data["base_action_log_probs"]
            want = s.forward_backward(clean).metrics
            s.optim_step()
        finally:
            undo()
        out["critical_kl"] = result(g, s, start, got=got, want=want, weight=weights,
                                    base=(base, stock_base), oracle=oracle,
                                    mask=data["loss_mask"].bool())
    os.environ.pop("GBC_SKYRL_OPTIONS", None)
    return out


def _check_steps(out):
    from test_skyrl_megatron_methods import _same_metrics, _same_params

    o = out["nthr"]
    assert o["kinds"] == {6}
    _same_params(o["params"])
    for got, want in zip(o["got"], o["want"]):
        assert got["gbc_nthr_second_forward"] == 0.0
        _same_metrics(got, want, skip=("loss_fn_outputs",))
    assert (o["scale"][o["mask"]] != 1).any()
    o = out["critical_kl"]
    _same_params(o["params"])
    m = o["mask"]
    torch.testing.assert_close(o["base"][0][m], o["base"][1][m], rtol=1e-5, atol=1e-6)
    assert o["weight"][m].std() > 1e-3
    assert o["got"]["gbc_support_forced_frac"] > 0
    _same_metrics(o["got"], o["want"], skip=("loss_fn_outputs", "policy_kl"))


def test_nthr_and_critical_kl_under_replay_tp2():
    """Tensor parallel 2 (gloo), padded micro-batches, replay on, temperature 0.8. NTHR: SkyRL's
    Megatron old-log-prob pass (per mini-batch, token-based micro-batches) keeps each rank's
    rows with their support (``methods.NTHRBatch``'s sixth field); the scales over the
    support equal gbc_reference's ``nthr_scale(support_ids=...)`` (float64, the whole output weight; its
    scores differ from the whole vocabulary's) and the steps equal SkyRL's stock steps under
    replay on the advantages times them. Critical-token KL: the reference pass's log-probs over
    the support (== SkyRL's stock reference worker's under replay, == float64) and weights from
    the reference's distribution over the support at critical_kl_temperature (== float64,
    not the whole vocabulary's); the step equals SkyRL's stock step under replay with its KL
    term weighted by hand."""
    errors = {}
    for out in spawn_gloo(2, _support_methods_worker):
        _check_steps(out)
        o = out["nthr"]
        m = o["mask"]
        scale, selected, scores, full_scores = o["oracle"]
        assert selected.any()
        assert not torch.allclose(scores[m], full_scores[m], rtol=1e-3)
        torch.testing.assert_close(o["scale"][m].double(), scale[m].double(), rtol=1e-5,
                                   atol=1e-6)
        errors["nthr scale"] = max(errors.get("nthr scale", 0.0),
                                   float((o["scale"][m].double() - scale[m]).abs().max()))
        o = out["critical_kl"]
        m = o["mask"]
        want_w, want_logp, full_w = o["oracle"]
        torch.testing.assert_close(o["base"][0][m], want_logp[m].double(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o["weight"][m].double(), want_w[m], rtol=1e-4, atol=1e-6)
        assert (want_w[m] - full_w[m]).abs().max() > 1e-2
        for what, a, b in (("ref logp", o["base"][0][m], want_logp[m]),
                           ("kl weight", o["weight"][m], want_w[m])):
            errors[what] = max(errors.get(what, 0.0), float((a.double() - b.double()).abs().max()))
    print("\nSkyRL Megatron replay methods, gbc vs float64, max error:",
          ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))


def test_nthr_and_critical_kl_under_replay_cp2():
    """Context parallel 2 (packed micro-batches): each rank keeps the whole rows and support
    of NTHR's pass (each position from the rank that holds it) and scores the reference's
    support rows it holds: NTHR's scales, the reference log-probs and the KL weights equal
    those of the same packed model on one rank; every step equals SkyRL's stock step under
    replay with them applied by hand (at both sizes)."""
    one = spawn_gloo(1, _support_methods_worker, 1, True)[0]
    _check_steps(one)
    for out in spawn_gloo(2, _support_methods_worker, 2):
        _check_steps(out)
        torch.testing.assert_close(out["nthr"]["scale"], one["nthr"]["scale"], rtol=1e-6,
                                   atol=1e-7)
        for key in ("weight", "base"):
            a, b = out["critical_kl"][key], one["critical_kl"][key]
            for x, y in zip(a if key == "base" else (a,), b if key == "base" else (b,)):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
