"""The sampler's support (SPEC §16) on gbc's megatron-core head (``gbc_kernels.integrations.
megatron``, gbc_mcore): ``support_ids`` ``[B, S, k]`` on ``policy_loss`` (gbc's one-sweep loss
and the ``main_grad`` route), ``logprobs`` and ``reference_stats``, under tensor parallelism 2
(the vocabulary split over the ranks, megatron's sequence parallelism) and context parallelism
2 (each rank its own tokens, their support rows with them), on gloo CPU ranks.

Oracle: ``gbc_reference`` in float64 on the same float32 values (it forms the ``[B, S, V]``
logits, masks them to the support and differentiates with autograd). Checked: the loss, every
metric (``support_forced_frac`` with them), ``logp``, ``entropy``, ``log_kept_mass``, ``d
hidden`` (the whole, or this rank's part under sequence parallelism), ``d weight`` of the
rank's shard (in ``main_grad`` on that route), the log-prob pass's values and gradients, the
reference pass's log-probs and critical-KL certainty over the support. The supports mix a row
holding its target, one lacking it (forced in), duplicates, ``-1`` padding, a row of padding
only, a row whose members all sit on rank 0's shard and one whose members all sit on rank 1's,
and garbage ids on masked-out tokens.
"""

from __future__ import annotations

import os

import pytest
import torch

import megatron.core  # noqa: F401  (requirements-dev.txt: megatron-core==0.16.1)

from conftest import megatron_cpu, spawn_gloo  # noqa: E402

S, B, H, V, K = 12, 3, 16, 40, 6       # V/tp = 20 at tensor parallel 2
TEMP = 0.9
CFG = dict(loss_agg="seq-mean-token-mean", kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01,
           ar_alpha=0.3, lopti_eta=0.5, epsilon_high=0.28)
PHASE = "low"
# the float32 head against float64: values and gradients
TOL_VALUE, TOL_GRAD = 2e-6, 1e-4


def _inputs(seed=11):
    """Fresh random inputs, batch-first: hidden ``[B, S, H]``, the whole head ``[V, H]``,
    labels, mask, per-token inputs and the support ``[B, S, K]``."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.6
    labels = torch.randint(0, V, (B, S), generator=g)
    t = torch.arange(S)
    mask = (t >= torch.tensor([2, 4, 1])[:, None]) & (t < torch.tensor([S, 10, S - 1])[:, None])
    adv = torch.randn(B, generator=g)[:, None].expand(B, S).contiguous()
    old = -torch.rand(B, S, generator=g) * 3
    refl = -torch.rand(B, S, generator=g) * 3
    token_scale = torch.rand(B, S, generator=g) + 0.5
    kl_weight = torch.rand(B, S, generator=g)
    ids = torch.randint(0, V, (B, S, K), generator=g)
    ids[..., 0] = labels                                    # most rows hold their target ...
    ids[:, ::3, 0] = (labels[:, ::3] + 1) % V               # ... every third does not
    ids[:, 1::4, 2] = -1                                    # padding inside a row
    ids[:, 2::5, 1] = ids[:, 2::5, 0]                       # a duplicate
    ids[:, 3::7, :] = -1                                    # padding only: the target alone
    labels[0, 4] = 5                                        # every member on rank 0's shard
    ids[0, 4] = torch.tensor([3, 5, 7, 11, 13, 19])
    labels[1, 5] = 2                                        # every id on rank 1's, target forced
    ids[1, 5] = torch.tensor([20, 30, -1, 39, 27, 30])
    ids = torch.where(mask.unsqueeze(-1), ids, torch.full_like(ids, 10 ** 6))  # never read
    return dict(hidden=hidden, weight=weight, labels=labels, mask=mask, adv=adv, old=old,
                refl=refl, token_scale=token_scale, kl_weight=kl_weight, ids=ids)


def _loss_args(x, mask=None):
    return dict(mask=x["mask"] if mask is None else mask, advantages=x["adv"],
                old_logp=x["old"], ref_logp=x["refl"], token_scale=x["token_scale"],
                kl_weight=x["kl_weight"], phase=PHASE, temperature=TEMP,
                support_ids=x["ids"])


def _head_step(M, x, weight, h_sbh, main_grad, **kw):
    """gbc_mcore's loss with ``support_ids``, backward of 1.3 x loss: its outputs and
    gradients (``d weight``: ``main_grad`` on that route)."""
    import gbc_kernels as gbc

    w = weight.detach().clone().requires_grad_(True)
    if main_grad:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        w.grad_added_to_main_grad = False
    h = h_sbh.detach().clone().requires_grad_(True)
    a = _loss_args(x, kw.pop("mask", None))
    res = M.policy_loss(h, w, x["labels"], a.pop("mask"), a.pop("advantages"),
                        a.pop("old_logp"), a.pop("ref_logp"), config=gbc.PolicyLossConfig(**CFG),
                        main_grad=main_grad, return_sum_p2=True, **a, **kw)
    (1.3 * res.loss).backward()
    gw = w.main_grad.clone() if main_grad else w.grad
    return dict(loss=res.loss.detach(), metrics={k: float(v) for k, v in res.metrics.items()},
                logp=res.logp, entropy=res.entropy, kept=res.log_kept_mass, gh=h.grad, gw=gw,
                grad_added=getattr(w, "grad_added_to_main_grad", None))


def _tp_worker(rank, world):
    os.environ["GBC_CHUNK_MB"] = "0.001"        # several chunks, a ragged last one
    mc = megatron_cpu()
    mc.install_shims()
    mc.init_parallel(world)
    import gbc_kernels as gbc
    from gbc_kernels import methods
    from gbc_kernels.integrations import megatron as M

    x = _inputs()
    vs = V // world
    shard = x["weight"][rank * vs:(rank + 1) * vs]
    h_sbh = x["hidden"].transpose(0, 1).contiguous()
    n = S // world
    out = {}
    for route in ("fused", "main_grad"):
        out[route] = _head_step(M, x, shard, h_sbh, route == "main_grad")
        out[route + "_sp"] = _head_step(M, x, shard, h_sbh[rank * n:(rank + 1) * n],
                                        route == "main_grad", sequence_parallel=True)
    # the log-prob pass (old policy): values, log_kept_mass and its gradients
    h = h_sbh.clone().requires_grad_(True)
    w = shard.clone().requires_grad_(True)
    lp = M.logprobs(h, w, x["labels"], x["mask"], temperature=TEMP, return_sum_p2=True,
                    support_ids=x["ids"], return_log_kept_mass=True)
    (lp.logp * x["token_scale"] + 0.5 * lp.entropy).sum().backward()
    out["logprobs"] = dict(logp=lp.logp, entropy=lp.entropy, sum_p2=lp.sum_p2,
                           kept=lp.log_kept_mass, gh=h.grad, gw=w.grad)
    # the reference pass over the support: log-probs and the critical-KL certainty
    opts = methods.MethodOptions(critical_kl_exponent=2.0, critical_kl_certainty="entropy",
                                 critical_kl_temperature=1.3)
    st = M.reference_stats(h_sbh, shard, x["labels"], opts, x["mask"], temperature=TEMP,
                           support_ids=x["ids"])
    out["reference"] = dict(logp=st.ref_logp, kl_weight=st.kl_weight, certainty=st.certainty)
    # a bad id on a masked-in token, on the main_grad route (rows selected): the caller's index
    bad = x["ids"].clone()
    bad[2, 7, 3] = V
    errors = {}
    for route in ("fused", "main_grad"):
        try:
            _head_step(M, dict(x, ids=bad), shard, h_sbh, route == "main_grad")
        except ValueError as e:
            errors[route] = str(e)
    try:
        M.logprobs(h_sbh, shard, x["labels"], x["mask"], support_ids=bad[:, :5])
    except ValueError as e:
        errors["shape"] = str(e)
    out["errors"] = errors
    del gbc
    return out


def _reference(x, scale=1.3):
    """float64: the loss, metrics, token_out and gradients; the log-prob pass; the reference
    pass's certainty."""
    import gbc_reference as ref

    h = x["hidden"].double().requires_grad_(True)
    w = x["weight"].double().requires_grad_(True)
    a = _loss_args({k: (v.double() if v.is_floating_point() else v) for k, v in x.items()})
    tok = {}
    L, m = ref.fused_linear_policy_loss(h, w, x["labels"], a.pop("mask"), a.pop("advantages"),
                                        a.pop("old_logp"), a.pop("ref_logp"),
                                        config=ref.PolicyLossConfig(**CFG), token_out=tok, **a)
    (scale * L).backward()
    ids = torch.where(x["mask"].unsqueeze(-1), x["ids"], -1)
    out = dict(loss=L.detach(), metrics={k: float(v) for k, v in m.items()}, logp=tok["logp"],
               kept=tok["log_kept_mass"], gh=h.grad, gw=w.grad)
    # the entropy over the support (the loss's token_out has none)
    lp, ent, p2, kept = ref.fused_linear_logprobs(
        h.detach(), w.detach(), x["labels"], temperature=TEMP, return_entropy=True,
        return_sum_p2=True, support_ids=ids, return_log_kept_mass=True)
    m_in = x["mask"]
    out["entropy"] = torch.where(m_in, ent, 0.0)
    h2, w2 = (t.detach().clone().requires_grad_(True) for t in (h, w))
    lp2, ent2 = ref.fused_linear_logprobs(h2, w2, x["labels"], temperature=TEMP,
                                          return_entropy=True, support_ids=ids)
    ((lp2 * x["token_scale"].double() + 0.5 * ent2) * m_in).sum().backward()
    out["logprobs"] = dict(logp=torch.where(m_in, lp, 0.0), entropy=out["entropy"],
                           sum_p2=torch.where(m_in, p2, 0.0), kept=torch.where(m_in, kept, 0.0),
                           gh=h2.grad, gw=w2.grad)
    st = ref.token_stats(h.detach(), w.detach(), x["labels"], temperature=TEMP,
                         certainty="entropy", certainty_temperature=1.3, support_ids=ids)
    weight = ref.critical_kl_weight(st.certainty, 2.0, 0.0)
    out["reference"] = dict(logp=torch.where(m_in, st.logp, 0.0),
                            certainty=torch.where(m_in, st.certainty, 0.0),
                            kl_weight=torch.where(m_in, weight, 0.0))
    return out


def err(got, want) -> float:
    """max |got - want| / (1 + |want|)."""
    return float(((got.double() - want.double()).abs() / (1 + want.double().abs())).max())


def grad_err(got, want) -> float:
    """max |got - want| / max |want|."""
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


ERRORS = {}     # measured max errors against float64, printed at the end (pytest -s)


def _record(what, e):
    ERRORS[what] = max(ERRORS.get(what, 0.0), e)
    return e


def _check_loss(got, want, what, rank, lo, hi, m_in, h_slice=slice(None)):
    assert _record("loss", abs(got["loss"].item() - want["loss"].item())
                   / max(1.0, abs(want["loss"].item()))) < 1e-5, what
    assert set(want["metrics"]) <= set(got["metrics"]), (what, set(want["metrics"]))
    for k, v in want["metrics"].items():
        assert _record("metrics", abs(got["metrics"][k] - v) / max(1.0, abs(v))) < 1e-4, (what, k)
    assert _record("logp", err(got["logp"], want["logp"])) < TOL_VALUE, what
    assert _record("entropy", err(got["entropy"], want["entropy"])) < TOL_VALUE, what
    assert _record("log_kept_mass", err(got["kept"], want["kept"])) < TOL_VALUE, what
    assert (got["kept"] <= 0).all() and (got["kept"][~m_in] == 0).all(), what
    gh = want["gh"].transpose(0, 1)[h_slice]
    assert _record("d hidden", grad_err(got["gh"], gh)) < TOL_GRAD, (what, rank)
    assert _record("d weight", grad_err(got["gw"], want["gw"][lo:hi])) < TOL_GRAD, (what, rank)


@pytest.fixture(scope="module")
def tp2():
    return spawn_gloo(2, _tp_worker)


@pytest.fixture(scope="module")
def oracle():
    return _reference(_inputs())


@pytest.mark.parametrize("route", ["fused", "main_grad", "fused_sp", "main_grad_sp"])
def test_tp2_policy_loss_over_the_support_matches_float64(tp2, oracle, route):
    """gbc_mcore's loss with ``support_ids`` at tensor parallel 2, gbc's one-sweep loss and
    the ``main_grad`` route, with and without sequence parallelism: loss, metrics
    (``support_forced_frac`` among them), per-token outputs and gradients on every rank."""
    x = _inputs()
    m_in = x["mask"]
    y = x["labels"]
    forced = ~(x["ids"] == y.unsqueeze(-1)).any(-1) & m_in
    frac = forced.sum().item() / m_in.sum().item()
    assert 0 < frac < 1
    assert oracle["metrics"]["support_forced_frac"] == pytest.approx(frac)
    vs, n = V // 2, S // 2
    for rank, out in enumerate(tp2):
        got = out[route]
        sl = slice(rank * n, (rank + 1) * n) if route.endswith("_sp") else slice(None)
        _check_loss(got, oracle, route, rank, rank * vs, (rank + 1) * vs, m_in, sl)
        assert got["metrics"]["support_forced_frac"] == pytest.approx(frac)
        if route.startswith("main_grad"):
            assert got["grad_added"] is True
    # the two routes agree with each other on every output
    for rank, out in enumerate(tp2):
        for k in ("logp", "entropy", "kept"):
            assert err(out["fused"][k], out["main_grad"][k]) < 1e-6


def test_tp2_logprobs_and_reference_over_the_support(tp2, oracle):
    """The log-prob pass (``logprobs(support_ids=, return_log_kept_mass=True)``): values and
    gradients; the reference pass (``reference_stats(support_ids=)``): log-probs and the
    critical-KL weights from the certainty over the support."""
    vs = V // 2
    for rank, out in enumerate(tp2):
        got, want = out["logprobs"], oracle["logprobs"]
        for k in ("logp", "entropy", "sum_p2", "kept"):
            assert _record(k if k != "kept" else "log_kept_mass", err(got[k], want[k])) \
                < TOL_VALUE, k
        assert _record("d hidden", grad_err(got["gh"], want["gh"].transpose(0, 1))) < TOL_GRAD
        assert _record("d weight", grad_err(got["gw"], want["gw"][rank * vs:(rank + 1) * vs])) \
            < TOL_GRAD
        got, want = out["reference"], oracle["reference"]
        for k in ("logp", "certainty", "kl_weight"):
            assert _record("reference " + k, err(got[k], want[k])) < TOL_VALUE, k


def test_tp2_bad_support_ids_name_the_callers_index(tp2):
    """An id outside ``[-1, V)`` on a masked-in token is refused naming ``support_ids`` and
    the caller's ``[b, s, j]`` index, also where only the response rows were scored (the
    ``main_grad`` route); a wrong shape names the ``[B, S] + [k]`` layout."""
    for out in tp2:
        e = out["errors"]
        for route in ("fused", "main_grad"):
            assert e[route].startswith(f"support_ids: expected ids in [-1, {V}) (-1: padding) on "
                                       f"masked-in tokens, got {V} at index [2, 7, 3]"), e[route]
        assert e["shape"].startswith(f"support_ids: expected shape [{B}, {S}] + [k]"), e["shape"]


def _cp_own(rank, cp):
    """Megatron's load-balanced context-parallel layout: each sequence in ``2 cp`` chunks,
    rank ``r`` holding chunks ``r`` and ``2 cp - 1 - r``: ``[S]`` bool."""
    chunk = torch.arange(S) // (S // (2 * cp))
    return (chunk == rank) | (chunk == 2 * cp - 1 - rank)


def _cp_worker(rank, world):
    """Context parallel 2 (tensor parallel 1): each rank's ``[S, B, H]`` rows hold its own
    tokens (the others' rows are garbage, as a rank's stream does not hold them), its labels,
    mask and support ``[B, S, k]`` the whole batch's with its own tokens masked in."""
    os.environ["GBC_CHUNK_MB"] = "0.001"
    mc = megatron_cpu()
    mc.install_shims()
    mc.init_parallel(1, cp=world)
    from megatron.core import parallel_state

    from gbc_kernels.integrations import megatron as M

    cp = parallel_state.get_context_parallel_group()
    x = _inputs()
    own = _cp_own(rank, world)
    h = x["hidden"].transpose(0, 1).contiguous()
    h[~own] = torch.randn(int((~own).sum()), B, H, generator=torch.Generator().manual_seed(rank))
    mine = x["mask"] & own
    out = {"own": mine}
    for route in ("fused", "main_grad"):
        out[route] = _head_step(M, x, x["weight"], h, route == "main_grad", mask=mine,
                                context_parallel=cp)
    lp = M.logprobs(h, x["weight"], x["labels"], mine, temperature=TEMP, support_ids=x["ids"],
                    return_log_kept_mass=True)
    out["logprobs"] = dict(logp=lp.logp, entropy=lp.entropy, kept=lp.log_kept_mass)
    return out


def test_cp2_policy_loss_over_the_support_matches_float64(oracle):
    """Context parallel 2 with ``support_ids``: the ranks' losses and gradients add up to the
    whole sequences'; the metrics (``support_forced_frac``) are the whole batch's on every
    rank; each rank's per-token outputs are its own tokens'."""
    ranks = spawn_gloo(2, _cp_worker)
    for route in ("fused", "main_grad"):
        total = sum(r[route]["loss"].item() for r in ranks)
        want = oracle["loss"].item()
        assert _record("loss", abs(total - want) / max(1.0, abs(want))) < 1e-5, route
        for r in ranks:
            got, own = r[route], r["own"]
            for k, v in oracle["metrics"].items():
                assert _record("metrics", abs(got["metrics"][k] - v) / max(1.0, abs(v))) \
                    < 1e-4, (route, k)
            for k, w in (("logp", oracle["logp"]), ("entropy", oracle["entropy"]),
                         ("kept", oracle["kept"])):
                assert _record(k if k != "kept" else "log_kept_mass",
                               err(got[k], torch.where(own, w, 0.0))) < TOL_VALUE, (route, k)
        gh = sum(torch.where(r["own"].t().unsqueeze(-1), r[route]["gh"], 0.0) for r in ranks)
        assert _record("d hidden", grad_err(gh, oracle["gh"].transpose(0, 1))) < TOL_GRAD
        for r in ranks:      # rows a rank does not hold get no gradient
            assert (r[route]["gh"][~r["own"].t()] == 0).all()
        gw = sum(r[route]["gw"] for r in ranks)
        assert _record("d weight", grad_err(gw, oracle["gw"])) < TOL_GRAD
    for r in ranks:
        own, got, want = r["own"], r["logprobs"], oracle["logprobs"]
        for k in ("logp", "entropy", "kept"):
            assert err(got[k], torch.where(own, want[k], 0.0)) < TOL_VALUE, k


def test_zz_report_errors():
    """Prints the measured max errors against float64 (run with ``-s``)."""
    print("\ngbc_mcore over the support, max error vs float64:",
          ", ".join(f"{k} {v:.1e}" for k, v in sorted(ERRORS.items())))
