"""The sampler's support (docs/math.md §16) on gbc's megatron-core head (``gbc_kernels.integrations.
megatron``, gbc_mcore): ``support_ids`` ``[B, S, k]`` on ``policy_loss`` (gbc's one-sweep loss
and the ``main_grad`` route), ``logprobs`` and ``reference_stats``, under tensor parallelism 2
(the vocabulary split over the ranks, megatron's sequence parallelism) and context parallelism
2 (each rank its own tokens, their support rows with them), on gloo CPU ranks; and the same
with the kept set rebuilt in the row pass (``sampler_truncation=SamplerTruncation(...)``,
docs/math.md "The sampler's kept set, recomputed"), ``logprobs(over_support=False)`` among them.

Oracle: ``gbc_reference`` in float64 on the same float32 values (it forms the ``[B, S, V]``
logits, masks them to the support and differentiates with autograd). Checked: the loss, every
metric (``support_forced_frac`` with them), ``logp``, ``entropy``, ``log_kept_mass``, ``d
hidden`` (the whole, or this rank's part under sequence parallelism), ``d weight`` of the
rank's shard (in ``main_grad`` on that route), the log-prob pass's values and gradients, the
reference pass's log-probs and critical-KL certainty over the support. The supports mix a row
holding its target, one lacking it (forced in), duplicates, ``-1`` padding, a row of padding
only, a row whose members all sit on rank 0's shard and one whose members all sit on rank 1's,
and garbage ids on masked-out tokens. The rebuilt set's oracle: ``gbc_reference.
truncation_support_ids`` (the sampler's rule on the float64 logits at the loss's temperature)
passed as ``support_ids`` to the same float64 functions.
"""

from __future__ import annotations

import functools
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
# the rebuilt kept sets: all three filters under tensor parallelism (top-p below a top-k
# bound), min-p alone (each shard its own members), top-p without a bound at tensor parallel 1
TRUNCATIONS = dict(tp=dict(top_k=8, top_p=0.85, min_p=0.02), min_p=dict(min_p=0.15),
                   cp=dict(top_p=0.8, min_p=0.01))


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


def _truncation(name):
    import gbc_kernels as gbc

    return gbc.SamplerTruncation(**TRUNCATIONS[name])


def _loss_args(x, mask=None, support=None):
    return dict(mask=x["mask"] if mask is None else mask, advantages=x["adv"],
                old_logp=x["old"], ref_logp=x["refl"], token_scale=x["token_scale"],
                kl_weight=x["kl_weight"], phase=PHASE, temperature=TEMP,
                **(dict(support_ids=x["ids"]) if support is None else support))


def _head_step(M, x, weight, h_sbh, main_grad, **kw):
    """gbc_mcore's loss with ``support_ids``, backward of 1.3 x loss: its outputs and
    gradients (``d weight``: ``main_grad`` on that route)."""
    import gbc_kernels as gbc

    w = weight.detach().clone().requires_grad_(True)
    if main_grad:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        w.grad_added_to_main_grad = False
    h = h_sbh.detach().clone().requires_grad_(True)
    a = _loss_args(x, kw.pop("mask", None), kw.pop("support", None))
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
    out["tr"] = _tp_truncation(M, x, shard, h_sbh, rank, world)
    del gbc
    return out


def _tp_truncation(M, x, shard, h_sbh, rank, world):
    """The kept set rebuilt in the row pass (``sampler_truncation``) at tensor parallel 2:
    both routes of the loss ± sequence parallelism, the log-prob pass (over the set, and
    ``over_support=False``), the reference pass, and the refusals."""
    import gbc_kernels as gbc
    from gbc_kernels import methods

    original = gbc.truncation.TruncationBackend
    tr, tr_min_p = _truncation("tp"), _truncation("min_p")
    support = dict(sampler_truncation=tr)
    n = S // world
    out = {}
    for route in ("fused", "main_grad"):
        out[route] = _head_step(M, x, shard, h_sbh, route == "main_grad", support=support)
        out[route + "_sp"] = _head_step(M, x, shard, h_sbh[rank * n:(rank + 1) * n],
                                        route == "main_grad", sequence_parallel=True,
                                        support=support)
    # min-p alone (no top-k bound: each shard's own members, the target's from its owner)
    out["main_grad_min_p"] = _head_step(M, x, shard, h_sbh, True,
                                        support=dict(sampler_truncation=tr_min_p))

    def logprobs(**kw):
        h = h_sbh.clone().requires_grad_(True)
        w = shard.clone().requires_grad_(True)
        lp = M.logprobs(h, w, x["labels"], x["mask"], temperature=TEMP, return_sum_p2=True,
                        **kw)
        (lp.logp * x["token_scale"] + 0.5 * lp.entropy).sum().backward()
        return dict(logp=lp.logp, entropy=lp.entropy, sum_p2=lp.sum_p2,
                    kept=lp.log_kept_mass, gh=h.grad, gw=w.grad)

    out["logprobs"] = logprobs(sampler_truncation=tr, return_log_kept_mass=True)
    out["logprobs_min_p"] = logprobs(sampler_truncation=tr_min_p, return_log_kept_mass=True)
    out["logprobs_plain"] = logprobs()
    for name, t in (("tp", tr), ("min_p", tr_min_p)):    # support=kept_mass's old pass
        out["logprobs_full_" + name] = logprobs(sampler_truncation=t, over_support=False,
                                                return_log_kept_mass=True)
    out["logprobs_no_kept"] = M.logprobs(h_sbh, shard, x["labels"], x["mask"],
                                         temperature=TEMP, sampler_truncation=tr).log_kept_mass
    opts = methods.MethodOptions(critical_kl_exponent=2.0, critical_kl_certainty="entropy",
                                 critical_kl_temperature=1.3)
    st = M.reference_stats(h_sbh, shard, x["labels"], opts, x["mask"], temperature=TEMP,
                           sampler_truncation=tr)
    out["reference"] = dict(logp=st.ref_logp, kl_weight=st.kl_weight, certainty=st.certainty)
    # one kept set per rollout: the building pass returns its set; a later pass replays it
    built = M.logprobs(h_sbh, shard, x["labels"], x["mask"], temperature=TEMP,
                       sampler_truncation=tr, return_support_ids=True)
    replayed = M.logprobs(h_sbh, shard, x["labels"], x["mask"], temperature=TEMP,
                          support_ids=built.support_ids)
    out["built"] = dict(ids=built.support_ids, logp=built.logp, replayed=replayed.logp,
                        plain_ids=out_ids_none(M, h_sbh, shard, x))
    out["restored"] = gbc.truncation.TruncationBackend is original
    # refused by name: both supports; top-p without a top-k bound under tensor parallelism
    # (gbc's rule, in gbc_mcore's words); not a SamplerTruncation
    errors = {}
    unbounded = gbc.SamplerTruncation(top_p=0.9)
    calls = {
        "loss": lambda mg, **kw: _head_step(M, x, shard, h_sbh, mg, support=kw),
        "logprobs": lambda mg, **kw: M.logprobs(h_sbh, shard, x["labels"], x["mask"], **kw),
        "reference": lambda mg, **kw: M.reference_stats(h_sbh, shard, x["labels"], opts,
                                                        x["mask"], **kw),
    }
    for what, call in calls.items():
        for mg in ((False, True) if what == "loss" else (False,)):
            key = f"{what}{'_main_grad' if mg else ''}"
            for case, kw in (("both", dict(support_ids=x["ids"], sampler_truncation=tr)),
                             ("top_p", dict(sampler_truncation=unbounded)),
                             ("type", dict(sampler_truncation={"top_k": 8}))):
                try:
                    call(mg, **kw)
                    errors[key, case] = None
                except (ValueError, TypeError) as e:
                    errors[key, case] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    return out


def out_ids_none(M, h_sbh, shard, x):
    """``support_ids`` of calls that build no set (None), and ``return_support_ids`` without
    ``sampler_truncation`` (refused)."""
    got = [M.logprobs(h_sbh, shard, x["labels"], x["mask"], temperature=TEMP).support_ids]
    try:
        M.logprobs(h_sbh, shard, x["labels"], x["mask"], return_support_ids=True)
        got.append(None)
    except ValueError as e:
        got.append(str(e))
    return got


def _members(ids, vocab=V):
    """Kept ids ``[..., K]`` (``-1`` padded, any order, duplicates allowed) as membership
    ``[..., V]``."""
    m = torch.zeros(*ids.shape[:-1], vocab + 1, dtype=torch.bool)
    m.scatter_(-1, (ids.long() + 1).clamp(min=0), True)
    return m[..., 1:]


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


def _truncation_ids(x, name):
    """The float64 oracle's kept set of every token ``[B, S, V]`` (``-1`` padded): the
    sampler's rule on the full logits at the loss's temperature."""
    import gbc_reference as ref

    return ref.truncation_support_ids(x["hidden"].double(), x["weight"].double(), x["labels"],
                                      temperature=TEMP, **TRUNCATIONS[name])


def err(got, want) -> float:
    """max |got - want| / (1 + |want|)."""
    return float(((got.double() - want.double()).abs() / (1 + want.double().abs())).max())


def grad_err(got, want) -> float:
    """max |got - want| / max |want|."""
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


ERRORS = {}     # measured max errors against float64, printed at the end (pytest -s)


def _record(what, e, tag=""):
    """``e`` into :data:`ERRORS` under ``tag + what`` (``tag``: ``"rebuilt "`` for the
    ``sampler_truncation`` cases)."""
    ERRORS[tag + what] = max(ERRORS.get(tag + what, 0.0), e)
    return e


def _check_loss(got, want, what, rank, lo, hi, m_in, h_slice=slice(None), tag=""):
    _r = functools.partial(_record, tag=tag)
    assert _r("loss", abs(got["loss"].item() - want["loss"].item())
              / max(1.0, abs(want["loss"].item()))) < 1e-5, what
    assert set(want["metrics"]) <= set(got["metrics"]), (what, set(want["metrics"]))
    for k, v in want["metrics"].items():
        assert _r("metrics", abs(got["metrics"][k] - v) / max(1.0, abs(v))) < 1e-4, (what, k)
    assert _r("logp", err(got["logp"], want["logp"])) < TOL_VALUE, what
    assert _r("entropy", err(got["entropy"], want["entropy"])) < TOL_VALUE, what
    assert _r("log_kept_mass", err(got["kept"], want["kept"])) < TOL_VALUE, what
    assert (got["kept"] <= 0).all() and (got["kept"][~m_in] == 0).all(), what
    gh = want["gh"].transpose(0, 1)[h_slice]
    assert _r("d hidden", grad_err(got["gh"], gh)) < TOL_GRAD, (what, rank)
    assert _r("d weight", grad_err(got["gw"], want["gw"][lo:hi])) < TOL_GRAD, (what, rank)


@pytest.fixture(scope="module")
def tp2():
    return spawn_gloo(2, _tp_worker)


@pytest.fixture(scope="module")
def oracle():
    return _reference(_inputs())


@pytest.fixture(scope="module")
def oracle_tr():
    """The float64 oracle over each rebuilt set (``gbc_reference.truncation_support_ids`` as
    ``support_ids``), by setting."""
    x = _inputs()
    out = {}
    for name in TRUNCATIONS:
        ids = _truncation_ids(x, name)
        size = (ids >= 0).sum(-1)[x["mask"]]
        assert (size < V).all() and (size > 1).any(), name        # the filters truncate
        out[name] = _reference(dict(x, ids=ids))
        out[name]["ids"] = ids
    return out


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
    # the kept set rebuilt in the row pass (top-p without a top-k bound: tensor parallel 1)
    support = dict(sampler_truncation=_truncation("cp"))
    tr = {route: _head_step(M, x, x["weight"], h, route == "main_grad", mask=mine,
                            context_parallel=cp, support=support)
          for route in ("fused", "main_grad")}
    lp = M.logprobs(h, x["weight"], x["labels"], mine, temperature=TEMP,
                    return_log_kept_mass=True, return_support_ids=True, **support)
    tr["logprobs"] = dict(logp=lp.logp, entropy=lp.entropy, kept=lp.log_kept_mass,
                          ids=lp.support_ids)
    out["tr"] = tr
    return out


@pytest.fixture(scope="module")
def cp2():
    return spawn_gloo(2, _cp_worker)


def test_cp2_policy_loss_over_the_support_matches_float64(cp2, oracle):
    """Context parallel 2 with ``support_ids``: the ranks' losses and gradients add up to the
    whole sequences'; the metrics (``support_forced_frac``) are the whole batch's on every
    rank; each rank's per-token outputs are its own tokens'."""
    _check_cp(cp2, oracle)


def _check_cp(ranks, oracle, tag=""):
    _r = functools.partial(_record, tag=tag)
    for route in ("fused", "main_grad"):
        total = sum(r[route]["loss"].item() for r in ranks)
        want = oracle["loss"].item()
        assert _r("loss", abs(total - want) / max(1.0, abs(want))) < 1e-5, route
        for r in ranks:
            got, own = r[route], r["own"]
            for k, v in oracle["metrics"].items():
                assert _r("metrics", abs(got["metrics"][k] - v) / max(1.0, abs(v))) \
                    < 1e-4, (route, k)
            for k, w in (("logp", oracle["logp"]), ("entropy", oracle["entropy"]),
                         ("kept", oracle["kept"])):
                assert _r(k if k != "kept" else "log_kept_mass",
                          err(got[k], torch.where(own, w, 0.0))) < TOL_VALUE, (route, k)
        gh = sum(torch.where(r["own"].t().unsqueeze(-1), r[route]["gh"], 0.0) for r in ranks)
        assert _r("d hidden", grad_err(gh, oracle["gh"].transpose(0, 1))) < TOL_GRAD
        for r in ranks:      # rows a rank does not hold get no gradient
            assert (r[route]["gh"][~r["own"].t()] == 0).all()
        gw = sum(r[route]["gw"] for r in ranks)
        assert _r("d weight", grad_err(gw, oracle["gw"])) < TOL_GRAD
    for r in ranks:
        own, got, want = r["own"], r["logprobs"], oracle["logprobs"]
        for k in ("logp", "entropy", "kept"):
            assert err(got[k], torch.where(own, want[k], 0.0)) < TOL_VALUE, k


def _forced_frac(x, ids):
    forced = ~(ids == x["labels"].unsqueeze(-1)).any(-1) & x["mask"]
    return forced.sum().item() / x["mask"].sum().item()


@pytest.mark.parametrize("route", ["fused", "main_grad", "fused_sp", "main_grad_sp",
                                   "main_grad_min_p"])
def test_tp2_policy_loss_over_the_rebuilt_set_matches_float64(tp2, oracle_tr, route):
    """``policy_loss(sampler_truncation=)`` at tensor parallel 2: the kept set rebuilt in the
    row pass (each shard's top candidates merged; min-p alone: each shard's own members) on
    gbc's one-sweep loss and the ``main_grad`` route, with and without sequence parallelism,
    equals float64 over ``gbc_reference.truncation_support_ids``: loss, metrics
    (``support_forced_frac``), ``logp``, entropy, ``log_kept_mass``, ``d hidden``, ``d weight``
    (``main_grad`` on that route)."""
    x = _inputs()
    name = "min_p" if route.endswith("min_p") else "tp"
    want = oracle_tr[name]
    frac = _forced_frac(x, want["ids"])
    assert 0 < frac < 1
    assert want["metrics"]["support_forced_frac"] == pytest.approx(frac)
    vs, n = V // 2, S // 2
    for rank, out in enumerate(tp2):
        got = out["tr"][route]
        sl = slice(rank * n, (rank + 1) * n) if route.endswith("_sp") else slice(None)
        _check_loss(got, want, route, rank, rank * vs, (rank + 1) * vs, x["mask"], sl,
                    tag="rebuilt ")
        assert got["metrics"]["support_forced_frac"] == pytest.approx(frac), (route, rank)
        if route.startswith("main_grad"):
            assert got["grad_added"] is True
        fused = out["tr"]["fused"]
        if route == "main_grad":                  # the two routes agree on every output
            for k in ("logp", "entropy", "kept"):
                assert err(got[k], fused[k]) < 1e-6, k
            assert got["metrics"]["support_forced_frac"] == \
                fused["metrics"]["support_forced_frac"]


def test_tp2_logprobs_and_reference_over_the_rebuilt_set(tp2, oracle_tr):
    """``logprobs(sampler_truncation=, return_log_kept_mass=True)`` (all three filters; min-p
    alone): values and gradients over the rebuilt set; ``over_support=False``: the plain
    call's log-probs, entropy, ``sum_p2`` and gradients bit for bit, ``log_kept_mass`` the
    set's; ``reference_stats(sampler_truncation=)``: log-probs and critical-KL weights over
    the set. gbc's backend class is restored after each call."""
    vs = V // 2
    for rank, out in enumerate(tp2):
        tr = out["tr"]
        lo, hi = rank * vs, (rank + 1) * vs
        for key, name in (("logprobs", "tp"), ("logprobs_min_p", "min_p")):
            got, want = tr[key], oracle_tr[name]["logprobs"]
            for k in ("logp", "entropy", "sum_p2", "kept"):
                assert _record(k if k != "kept" else "log_kept_mass", err(got[k], want[k]),
                               "rebuilt ") < TOL_VALUE, (key, k)
            assert _record("d hidden", grad_err(got["gh"], want["gh"].transpose(0, 1)),
                           "rebuilt ") < TOL_GRAD, key
            assert _record("d weight", grad_err(got["gw"], want["gw"][lo:hi]), "rebuilt ") \
                < TOL_GRAD, key
        plain = tr["logprobs_plain"]
        assert plain["kept"] is None and tr["logprobs_no_kept"] is None
        for name in ("tp", "min_p"):
            full = tr["logprobs_full_" + name]
            for k in ("logp", "entropy", "sum_p2", "gh", "gw"):
                assert torch.equal(full[k], plain[k]), (name, k)
            kept = oracle_tr[name]["logprobs"]["kept"]
            assert _record("log_kept_mass", err(full["kept"], kept), "rebuilt ") < TOL_VALUE, name
            assert (full["kept"] < -1e-3).any(), name
        got, want = tr["reference"], oracle_tr["tp"]["reference"]
        for k in ("logp", "certainty", "kl_weight"):
            assert _record("reference " + k, err(got[k], want[k]), "rebuilt ") < TOL_VALUE, k
        assert tr["restored"]


def test_tp2_truncation_refusals_name_the_arguments(tp2):
    """``support_ids`` and ``sampler_truncation`` together are refused naming both; top-p
    without a top-k bound under tensor parallelism is refused by gbc's rule naming ``top_p``,
    in gbc_mcore's words (tensor parallel 2, not gbc's ``vocab_parallel``); a settings object
    that is not a ``SamplerTruncation`` names ``sampler_truncation``: on both routes of the
    loss, ``logprobs`` and ``reference_stats``."""
    for out in tp2:
        errors = out["tr"]["errors"]
        assert len(errors) == 12
        for (what, case), e in errors.items():
            assert e is not None, (what, case)
            if case == "both":
                assert e.startswith("ValueError: sampler_truncation: pass either support_ids "
                                    "(the kept ids the engine recorded) or sampler_truncation"), e
                assert e.endswith("not both"), e
            elif case == "top_p":
                assert e == ("ValueError: top_p: top_p < 1 without a top_k bound is not "
                             "supported under tensor parallel 2 (the cut needs every shard's "
                             "order); set top_k too (SamplerTruncation(top_k=..., top_p=...)) "
                             "or run at tensor parallel 1"), e
            else:
                assert e.startswith("TypeError: sampler_truncation: expected None or "
                                    "gbc_kernels.SamplerTruncation"), e


def test_tp2_logprobs_returns_the_built_set(tp2, oracle_tr):
    """``logprobs(sampler_truncation=, return_support_ids=True)`` at tensor parallel 2 (one
    kept set per rollout: the old-policy pass builds it): ``support_ids`` ``[B, S, K]`` int32
    holds, in every masked-in row, the float64 oracle's kept set
    (``gbc_reference.truncation_support_ids``, the target not forced in), ``-1`` only in the
    rows outside the mask, the same on both ranks; replayed as ``support_ids`` it gives the
    rebuilding call's log-probs. A call that builds no set returns None; ``return_support_ids``
    without ``sampler_truncation`` is refused naming both."""
    x = _inputs()
    want = _members(oracle_tr["tp"]["ids"])
    m = x["mask"]
    ids0 = tp2[0]["tr"]["built"]["ids"]
    for rank, out in enumerate(tp2):
        b = out["tr"]["built"]
        assert b["ids"].dtype == torch.int32 and b["ids"].shape[:2] == (B, S), rank
        assert torch.equal(b["ids"], ids0), rank
        got = _members(b["ids"])
        assert torch.equal(got[m], want[m]), rank
        assert (b["ids"][~m] == -1).all(), rank
        assert b["ids"].shape[-1] >= int(want[m].sum(-1).max()), rank
        assert err(b["replayed"], b["logp"]) < 1e-6, rank
        none, refused = b["plain_ids"]
        assert none is None
        assert refused.startswith("return_support_ids: needs sampler_truncation"), refused


def test_cp2_logprobs_returns_each_ranks_built_set(cp2, oracle_tr):
    """Context parallel 2: each rank's ``return_support_ids`` holds the oracle's kept set of
    its own tokens and ``-1`` in every row it does not score."""
    want = _members(oracle_tr["cp"]["ids"])
    for r in cp2:
        ids, own = r["tr"]["logprobs"]["ids"], r["own"]
        assert torch.equal(_members(ids)[own], want[own])
        assert (ids[~own] == -1).all()


def test_cp2_policy_loss_over_the_rebuilt_set_matches_float64(cp2, oracle_tr):
    """Context parallel 2 with ``sampler_truncation`` (top-p without a top-k bound, min-p):
    each rank rebuilds the set of its own tokens; the ranks' losses and gradients add up to
    the whole sequences', ``support_forced_frac`` is the whole batch's on every rank, on both
    routes; the log-prob pass over the set on each rank's tokens."""
    want = oracle_tr["cp"]
    frac = _forced_frac(_inputs(), want["ids"])
    assert 0 < frac < 1
    _check_cp([dict(r["tr"], own=r["own"]) for r in cp2], want, tag="rebuilt ")
    for r in cp2:
        for route in ("fused", "main_grad"):
            assert r["tr"][route]["metrics"]["support_forced_frac"] == pytest.approx(frac)


def test_zz_report_errors():
    """Prints the measured max errors against float64 (run with ``-s``)."""
    for tag, what in (("", "support_ids"), ("rebuilt ", "sampler_truncation")):
        print(f"\ngbc_mcore over the support ({what}), max error vs float64:",
              ", ".join(f"{k[len(tag):]} {v:.1e}" for k, v in sorted(ERRORS.items())
                        if k.startswith(tag) and (tag or not k.startswith("rebuilt "))))
