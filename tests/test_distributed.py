"""Beyond one device, with real processes (gloo backend, CPU, spawned):

* data-parallel normalisation: token-mean with the global token count (``num_items_in_batch``,
  as DAPO and TRL pass it) gives, summed over DDP ranks, the gradient of one process on the
  whole batch;
* vocab-parallel lm_head (docs/math.md §9): every rank holds an uneven slice of an odd vocabulary; loss,
  metrics, log-probs, token statistics and NTHR equal the single-process results, hidden
  gradients are the full ones on every rank, weight/bias gradients the local slice's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import gbc_kernels as gbc
from conftest import make_batch, spawn_gloo as _spawn


PHASES = (None, "low", "high")


def _phase_config(cfg, phase):
    """Lopti off for the phase-less call (with lopti_eta set, it is refused)."""
    return cfg if phase is not None else dataclasses.replace(cfg, lopti_eta=None)


def _ddp_worker(rank, world, batch, cfg):
    """Each rank's share of the rows; the loss of every Lopti phase with the global token count;
    the gradients summed as DDP does (it sums; we do not average)."""
    rows = torch.arange(batch["mask"].shape[0]).chunk(world)[rank]   # uneven split
    n_global = batch["mask"].sum()                       # what every rank passes
    out = {}
    for phase in PHASES:
        h = batch["hidden"][rows].clone().requires_grad_(True)
        w = batch["weight"].clone().requires_grad_(True)
        loss, _ = gbc.fused_linear_policy_loss(
            h, w, batch["targets"][rows], batch["mask"][rows], batch["advantages"][rows],
            batch["old_logp"][rows], batch["ref_logp"][rows], config=_phase_config(cfg, phase),
            phase=phase,
            num_items_in_batch=n_global, backend="auto")
        loss.backward()
        gw = w.grad.clone()
        dist.all_reduce(gw)
        total = loss.detach().clone()
        dist.all_reduce(total)
        gh = torch.zeros_like(batch["hidden"])
        gh[rows] = h.grad
        dist.all_reduce(gh)
        out[phase] = (total.item(), gw, gh)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_token_mean_equals_single_process(world):
    """Also per Lopti phase: a phase masks advantages and KL per token, the normaliser keeps the
    full (global) mask, so each phase's DDP gradient is the single-process one."""
    batch = make_batch(B=7, T=6, H=8, V=23, seed=world, bias=False)
    cfg = gbc.PolicyLossConfig(loss_agg="dapo", kl_coef=0.1, ar_alpha=0.2, lopti_eta=0.5)
    got = _spawn(world, _ddp_worker, batch, cfg)[0]
    for phase in PHASES:
        total, gw, gh = got[phase]
        h = batch["hidden"].clone().requires_grad_(True)
        w = batch["weight"].clone().requires_grad_(True)
        loss, _ = gbc.fused_linear_policy_loss(h, w, batch["targets"], batch["mask"],
                                               batch["advantages"], batch["old_logp"],
                                               batch["ref_logp"], config=_phase_config(cfg, phase),
                                               phase=phase)
        loss.backward()
        assert abs(total - loss.item()) < 1e-6, phase
        assert torch.allclose(gw, w.grad, rtol=1e-5, atol=1e-7), phase
        assert torch.allclose(gh, h.grad, rtol=1e-5, atol=1e-7), phase


def _dp_quantile_worker(rank, world, batch, cfg):
    """The entropy quantile over every rank's tokens (data_parallel_group), a rank's share of
    the sequences each, the global token count: summed over ranks, one process's loss."""
    rows = torch.arange(batch["mask"].shape[0]).chunk(world)[rank]
    h = batch["hidden"][rows].clone().requires_grad_(True)
    w = batch["weight"].clone().requires_grad_(True)
    loss, metrics = gbc.fused_linear_policy_loss(
        h, w, batch["targets"][rows], batch["mask"][rows], batch["advantages"][rows],
        batch["old_logp"][rows], config=cfg, num_items_in_batch=batch["mask"].sum(),
        data_parallel_group="world")
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    gw = w.grad.clone()
    dist.all_reduce(gw)
    return total.item(), gw


def test_entropy_quantile_over_data_parallel_ranks():
    """One rank holds no token at all (it must still join the collective)."""
    batch = make_batch(B=6, T=7, H=8, V=23, seed=2, bias=False)
    batch["mask"][4:] = False                           # rank 2 of 3: rows 4, 5, all masked
    cfg = gbc.PolicyLossConfig(loss_agg="dapo", top_entropy_quantile=0.3, entropy_coef=0.05,
                               importance_sampling_level="sequence")
    got = _spawn(3, _dp_quantile_worker, batch, cfg)
    w = batch["weight"].clone().requires_grad_(True)
    loss, _ = gbc.fused_linear_policy_loss(batch["hidden"], w, batch["targets"], batch["mask"],
                                           batch["advantages"], batch["old_logp"], config=cfg)
    loss.backward()
    for total, gw in got:
        assert abs(total - loss.item()) < 1e-6
        assert torch.allclose(gw, w.grad, rtol=1e-5, atol=1e-7)


def _nthr_dp_worker(rank, world, batch, group_ids, correct, rows_of, beta=0.0):
    rows = rows_of[rank]
    args = (batch["hidden"][rows], batch["weight"], batch["targets"][rows], batch["mask"][rows],
            group_ids[rows], correct[rows])
    try:
        res = gbc.nthr_scale(*args, beta=beta, data_parallel_group="world")
        return res.scale, res.selected
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_nthr_groups_across_data_parallel_ranks(beta):
    """Each rank's NTHR equals the single-process result on its rows, whether the groups sit
    whole on a rank or are split over ranks (one rank holding only incorrect responses of a
    group, another none of a group's tokens but another group's)."""
    batch = make_batch(B=8, T=5, H=8, V=19, seed=4, bias=False)
    group_ids = torch.tensor([7, 7, 7, 3, 3, 3, 9, 9])    # global ids, non-contiguous values
    correct = torch.tensor([True, False, False, False, True, False, False, True])
    truth = gbc.nthr_scale(batch["hidden"], batch["weight"], batch["targets"], batch["mask"],
                           group_ids, correct, beta=beta)
    assert truth.selected.any()
    for rows_of in ([torch.arange(0, 3), torch.arange(3, 8)],                     # whole
                    [torch.arange(0, 4), torch.arange(4, 8)],                     # 3 split
                    [torch.tensor([1, 2, 4, 6]), torch.tensor([0, 3, 5, 7])],     # all split
                    [torch.tensor([1, 2, 3]), torch.tensor([0, 4, 5, 6, 7])]):
        got = _spawn(2, _nthr_dp_worker, batch, group_ids, correct, rows_of, beta)
        for rows, res in zip(rows_of, got):
            assert not isinstance(res, str), res
            scale, selected = res
            assert torch.equal(selected, truth.selected[rows])
            assert torch.allclose(scale, truth.scale[rows])


# ----------------------------------------------------------------------------------------------
# vocab-parallel lm_head
# ----------------------------------------------------------------------------------------------

VP_V = 37
SPLITS = {2: [(0, 11), (11, 37)], 3: [(0, 5), (5, 21), (21, 37)]}
VP_CASES = [
    ("token-mean", dict(loss_agg="token-mean", kl_coef=0.1, ar_alpha=0.3), None),
    ("grpo-entropy", dict(loss_agg="grpo", entropy_coef=0.05, temperature=0.7,
                          clip_ratio_c=2.0), None),
    ("lopti-low", dict(loss_agg="dr_grpo", max_len=11, kl_coef=0.05, kl_estimator="k2",
                       lopti_eta=0.4), "low"),
    ("gspo-quantile", dict(loss_agg="grpo", importance_sampling_level="sequence",
                           top_entropy_quantile=0.5, entropy_coef=0.02,
                           entropy_agg="token-mean"), None),
    ("vespo-off-policy", dict(objective="vespo", off_policy_mask_threshold=0.05, kl_coef=0.05),
     None),
    ("softcap", dict(loss_agg="grpo", kl_coef=0.05, entropy_coef=0.02, logit_softcap=1.0,
                     temperature=0.8), None),
    # the objectives of verl and the other trainers (docs/math.md §12)
    ("dppo-kl", dict(objective="dppo", dppo_divergence="binary_kl", epsilon_low=0.05,
                     epsilon_high=0.1, kl_coef=0.05, kl_estimator="k3+"), None),
    ("gmpo", dict(objective="gmpo", loss_agg="grpo", entropy_coef=0.02, ar_alpha=0.3), None),
    ("gspo-token-cispo", dict(objective="cispo", importance_sampling_level="sequence_token",
                              epsilon_high=1.2, cispo_min=0.8), None),
    ("kl-cov-dro", dict(objective="unclipped", cov_mode="kl", cov_ratio=0.2,
                        log_ratio_penalty=0.2, kl_coef=0.05, kl_estimator="abs",
                        kl_clamp=1.0), None),
    ("per-token-temperature", dict(loss_agg="grpo", entropy_coef=0.02, kl_coef=0.05), None),
]
# call arguments beside the config
VP_CALL = {"per-token-temperature": lambda batch: dict(
    temperature=0.6 + torch.rand(batch["mask"].shape, generator=torch.Generator().manual_seed(4)))}


def _vp_inputs():
    batch = make_batch(B=5, T=6, H=8, V=VP_V, seed=3, bias=True)
    batch["targets"][0, :3] = torch.tensor([0, 36, 11])     # slice edges
    group_ids = torch.tensor([0, 0, 1, 1, 1])
    correct = torch.tensor([True, False, True, False, False])
    upstream = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(9))
    return batch, group_ids, correct, upstream


def _leaves(batch, lo=0, hi=VP_V):
    return (batch["hidden"].clone().requires_grad_(True),
            batch["weight"][lo:hi].clone().requires_grad_(True),
            batch["bias"][lo:hi].clone().requires_grad_(True))


def _all_calls(batch, group_ids, correct, upstream, lo=0, hi=VP_V, vp=None, backend="auto"):
    """Every vocab-parallel entry point on one batch; with vp=None the single-process truth."""
    kw = {"backend": backend} if vp is None else {"vocab_parallel": vp, "backend": backend}
    out = {}
    for name, cfg, phase in VP_CASES:
        h, w, b = _leaves(batch, lo, hi)
        loss, metrics = gbc.fused_linear_policy_loss(
            h, w, batch["targets"], batch["mask"], batch["advantages"], batch["old_logp"],
            batch["ref_logp"], bias=b, config=gbc.PolicyLossConfig(**cfg), phase=phase, **kw,
            **VP_CALL.get(name, lambda _: {})(batch))
        (loss * 0.7).backward()
        out[name] = (loss.detach(), metrics, h.grad, w.grad, b.grad)
    # bf16 inputs: logits from the bf16 matmul, reductions in float32, as on one device
    h, w, b = (t.detach().to(torch.bfloat16).requires_grad_(True) for t in _leaves(batch, lo, hi))
    loss, _ = gbc.fused_linear_policy_loss(
        h, w, batch["targets"], batch["mask"], batch["advantages"], batch["old_logp"],
        bias=b, config=gbc.PolicyLossConfig(loss_agg="grpo", ar_alpha=0.2), **kw)
    loss.backward()
    out["bf16"] = (loss.detach(), h.grad.float(), w.grad.float(), b.grad.float())
    h, w, b = _leaves(batch, lo, hi)
    targets = batch["targets"].clamp(min=0)
    logp, ent = gbc.fused_linear_logprobs(h, w, targets, bias=b, temperature=1.3,
                                          return_entropy=True, **kw)
    ((logp * upstream[0]).sum() + (ent * upstream[1]).sum()).backward()
    out["logprobs"] = (logp.detach(), ent.detach(), h.grad, w.grad, b.grad)
    w0, b0 = batch["weight"][lo:hi], batch["bias"][lo:hi]
    for cert, ct in (("entropy", 0.7), ("max_prob", 1.0)):
        st = gbc.token_stats(batch["hidden"], w0, targets, bias=b0, certainty=cert,
                             certainty_temperature=ct, **kw)
        out[f"stats-{cert}"] = tuple(st)
    res = gbc.nthr_scale(batch["hidden"], w0, batch["targets"], batch["mask"], group_ids,
                         correct, bias=b0, beta=0.0, **kw)
    out["nthr"] = (res.scale, res.selected, res.scores)
    # final-logit soft-capping through the split passes
    h, w, b = _leaves(batch, lo, hi)
    logp, ent = gbc.fused_linear_logprobs(h, w, targets, bias=b, return_entropy=True,
                                          logit_softcap=1.0, **kw)
    ((logp * upstream[0]).sum() + (ent * upstream[1]).sum()).backward()
    out["logprobs-softcap"] = (logp.detach(), ent.detach(), h.grad, w.grad, b.grad)
    st = gbc.token_stats(batch["hidden"], w0, targets, bias=b0, certainty="max_prob",
                         logit_softcap=1.0, **kw)
    out["stats-softcap"] = tuple(st)
    res = gbc.nthr_scale(batch["hidden"], w0, batch["targets"], batch["mask"], group_ids,
                         correct, bias=b0, beta=0.0, logit_softcap=1.0, **kw)
    out["nthr-softcap"] = (res.scale, res.selected, res.scores)
    return out


def _vp_worker(rank, world, backend):
    batch, group_ids, correct, upstream = _vp_inputs()
    lo, hi = SPLITS[world][rank]
    group = dist.new_group(list(range(world)))        # an explicit group, not only WORLD
    out = _all_calls(batch, group_ids, correct, upstream, lo, hi,
                     gbc.VocabParallel(group, lo, hi), backend)
    w, b = batch["weight"][lo:hi], batch["bias"][lo:hi]
    from gbc_kernels import vocab_parallel as vpmod
    from gbc_kernels.backends.base import Workspace
    sl = vpmod.check(gbc.VocabParallel(group, lo, hi), w, b, w.device)
    h2 = batch["hidden"].reshape(-1, batch["hidden"].shape[-1])
    be = gbc.backends.get_backend(backend, h2.device, h2.dtype)
    y = vpmod.local_targets(batch["targets"].clamp(min=0).reshape(-1), sl)
    st = vpmod.combine(be.row_stats(h2 @ w.T + b, y, 1 / 0.9, True, True, Workspace()), sl)
    out["row_stats"] = st._asdict()
    errors = {}
    # every rank makes the same mistake, so they fail at the same point (a rank that raises
    # alone, before a collective, leaves the others waiting in it, as with any collective code)
    over = hi + 1 if rank == 0 else hi                  # rank 0 claims one row too many
    bad = {"group": (gbc.VocabParallel("world", lo, hi), w, b),
           "tiling": (gbc.VocabParallel(None, lo, over), batch["weight"][lo:over],
                      batch["bias"][lo:over]),
           "slice": (gbc.VocabParallel(None, lo, hi), w[:-1], b[:-1])}
    for what, (vp, ww, bb) in bad.items():
        try:
            gbc.fused_linear_logprobs(batch["hidden"], ww, batch["targets"].clamp(min=0),
                                      bias=bb, vocab_parallel=vp)
        except (ValueError, TypeError) as e:
            errors[what] = str(e)
    bad_targets = batch["targets"].clone()
    bad_targets[0, 0] = VP_V                             # outside [0, V): still an error
    try:
        gbc.token_stats(batch["hidden"], w, bad_targets.clamp(min=0), bias=b,
                        vocab_parallel=gbc.VocabParallel(None, lo, hi))
    except ValueError as e:
        errors["target"] = str(e)
    return out, errors


VP_RUNS = [(2, "torch"), (3, "torch")] + ([(2, "cpu"), (3, "cpu")]
                                          if gbc.backends.cpu_available() else [])


@pytest.mark.parametrize("world,backend", VP_RUNS)
def test_vocab_parallel_equals_single_process(world, backend):
    """Every entry point over 2 or 3 uneven slices equals one process on the same backend: the
    shared chunk loop with the backend's own row kernels and one collective per chunk."""
    batch, group_ids, correct, upstream = _vp_inputs()
    truth = _all_calls(batch, group_ids, correct, upstream, backend=backend)
    ranks = _spawn(world, _vp_worker, backend)
    close = (lambda a, b: torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6))
    for rank, (out, errors) in enumerate(ranks):
        lo, hi = SPLITS[world][rank]
        for name, _, _ in VP_CASES:
            loss, metrics, gh, gw, gb = out[name]
            tl, tm, tgh, tgw, tgb = truth[name]
            assert close(loss, tl), (name, loss, tl)
            assert metrics.keys() == tm.keys()
            for k in tm:
                assert close(metrics[k], tm[k]), (name, k, metrics[k], tm[k])
            assert close(gh, tgh), name                  # the full hidden gradient
            assert close(gw, tgw[lo:hi]) and close(gb, tgb[lo:hi]), name
        loss, gh, gw, gb = out["bf16"]
        tl, tgh, tgw, tgb = truth["bf16"]
        bf = (lambda a, b: torch.allclose(a, b, rtol=2e-2, atol=2e-3 * b.abs().max()))
        assert abs(loss - tl) <= 1e-2 * abs(tl) + 1e-4
        assert bf(gh, tgh) and bf(gw, tgw[lo:hi]) and bf(gb, tgb[lo:hi])
        logp, ent, gh, gw, gb = out["logprobs"]
        tlogp, tent, tgh, tgw, tgb = truth["logprobs"]
        assert close(logp, tlogp) and close(ent, tent)
        assert close(gh, tgh) and close(gw, tgw[lo:hi]) and close(gb, tgb[lo:hi])
        for cert in ("entropy", "max_prob"):
            for got, want in zip(out[f"stats-{cert}"], truth[f"stats-{cert}"]):
                assert close(got, want), cert
        # the reduced row statistics against the full softmax in float64
        z = (batch["hidden"].double().reshape(-1, 8) @ batch["weight"].double().T
             + batch["bias"].double()) / 0.9
        p = torch.softmax(z, -1)
        st = out["row_stats"]
        assert close(st["lse"], torch.logsumexp(z, -1))
        assert close(st["sum_p2"], (p * p).sum(-1))
        assert close(st["entropy"], -(p * p.log()).sum(-1))
        assert close(st["zmax"], z.max(-1).values)
        y = batch["targets"].clamp(min=0).reshape(-1, 1)
        assert close(st["target_z"], z.gather(1, y)[:, 0])
        scale, selected, scores = out["nthr"]
        assert torch.equal(selected, truth["nthr"][1]) and close(scale, truth["nthr"][0])
        assert close(scores, truth["nthr"][2])
        logp, ent, gh, gw, gb = out["logprobs-softcap"]
        tlogp, tent, tgh, tgw, tgb = truth["logprobs-softcap"]
        assert close(logp, tlogp) and close(ent, tent) and not close(logp, truth["logprobs"][0])
        assert close(gh, tgh) and close(gw, tgw[lo:hi]) and close(gb, tgb[lo:hi])
        for got, want in zip(out["stats-softcap"], truth["stats-softcap"]):
            assert close(got, want)
        scale, selected, scores = out["nthr-softcap"]
        assert torch.equal(selected, truth["nthr-softcap"][1])
        assert close(scores, truth["nthr-softcap"][2])
        assert truth["nthr"][1].any()                    # NTHR did select tokens here
        assert "vocab_parallel.group" in errors["group"]
        assert "do not tile" in errors["tiling"]
        assert "weight: expected this rank's slice" in errors["slice"]
        assert "targets: expected token ids in [0, 37)" in errors["target"]


def test_vocab_parallel_without_init_raises():
    b = make_batch(B=2, T=3, H=4, V=9)
    with pytest.raises(ValueError, match="vocab_parallel.group: torch.distributed is not"):
        gbc.fused_linear_logprobs(b["hidden"], b["weight"][:4], b["targets"].clamp(min=0),
                                  vocab_parallel=gbc.VocabParallel(None, 0, 4))
    with pytest.raises(TypeError, match="vocab_parallel: expected"):
        gbc.fused_linear_logprobs(b["hidden"], b["weight"], b["targets"].clamp(min=0),
                                  vocab_parallel=(None, 0, 9))


BACKEND_NAMES = ["torch", "triton"] + (["cpu"] if gbc.backends.cpu_available() else [])


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_target_outside_slice(backend, dtype):
    """A target id of -1 (another rank's slice): the target logit is 0 and never read, and the
    gradient has no one-hot term; other rows are untouched by the rule. Against float64."""
    from gbc_kernels.backends.base import Workspace
    g = torch.Generator().manual_seed(2)
    rows, V = 7, 133                      # V not a multiple of any block
    logits = (torch.randn(rows, V, generator=g) * 3).to(dtype)
    y = torch.randint(0, V, (rows,), generator=g)
    y[[1, 4, 5]] = -1
    be = gbc.backends.get_backend(backend, torch.device("cpu"), dtype)
    it = 1 / 0.8
    st = be.row_stats(logits.clone(), y, it, True, True, Workspace())
    z = logits.double() * it
    lse = torch.logsumexp(z, -1)
    p = torch.softmax(z, -1)
    inside = y >= 0
    tz = torch.where(inside, z.gather(1, y.clamp(min=0)[:, None])[:, 0], 0.0)
    tol = dict(rtol=1e-5, atol=1e-5)
    assert torch.allclose(st.lse.double(), lse, **tol)
    assert torch.allclose(st.target_z.double(), tz, **tol)
    assert torch.allclose(st.entropy.double(), -(p * p.log()).sum(-1), **tol)
    gl, gh = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    buf = logits.clone()
    be.logit_grad_(buf, y, it, st.lse, st.entropy, gl, gh, Workspace())
    H = -(p * p.log()).sum(-1)
    want = -p * (gl.double()[:, None] + gh.double()[:, None] * (p.log() + H[:, None]))
    want[inside.nonzero()[:, 0], y[inside]] += gl.double()[inside]
    want *= it
    err = (buf.double() - want).abs().max() / want.abs().max()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("need_dw", [False, True])
def test_uneven_slices_size_chunks_alike(monkeypatch, need_dw):
    """Every rank of a vocab-parallel group must run the same chunks (one collective each): the
    chunk size depends on the widest slice only, never on the rank's own slice, also where the
    CUDA budget counts the weight gradient."""
    from gbc_kernels import _chunking, _fused
    from gbc_kernels.backends import get_backend
    from gbc_kernels.vocab_parallel import _Slice
    seen = []
    monkeypatch.setattr(_chunking, "rows_per_chunk", lambda *a: seen.append(a) or 64)
    hidden = torch.randn(300, 16)
    be = get_backend("torch", hidden.device, hidden.dtype)
    for start, end in ((0, 40), (40, 101)):              # V = 101 over two uneven slices
        sl = _Slice(None, start, end, 101, 61)
        _fused._chunk_buffer(300, hidden, torch.randn(end - start, 16), be, sl, (True, need_dw))
    assert len(seen) == 2 and seen[0] == seen[1], seen


def _rank_sum(rank, world):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return float(t)


def test_spawned_ranks_meet_whatever_port_another_run_took(monkeypatch):
    """On a shared machine another test run can take the port ``spawn_gloo`` found free
    before its ranks bind it (issue 53: a multi-rank test failing only under load): the ranks
    meet through a file store, so a taken port changes nothing."""
    import socket

    import conftest

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(conftest, "_free_port", lambda: taken.getsockname()[1])
        assert conftest.spawn_gloo(2, _rank_sum) == [3.0, 3.0]
