"""Every entry of the objectives table (gbc_kernels/objectives.py) against torch.autograd.

Each entry's hand derivative is held against ``torch.autograd.grad`` of its value in float64, on
random tokens and on the edges where the derivative changes (ratios exactly at ``1 - eps_low``,
``1 + eps_high``, ``delta``, ``clip_ratio_c``, ``cispo_min``; log-ratios exactly at gmpo's clip
bounds; KL inputs exactly at their clamps; ties), with advantages of both signs and zero, and
for the sequence-level entries with empty sequences and with no token at all. The case tables
below are keyed by entry name, and a test checks they cover the table: an entry added without
its cases fails here. The formulas of the oracles (sequence means, KL estimators, straight-
through surrogates) are written out in this file, not taken from the library.
"""

from __future__ import annotations

import math

import pytest
import torch

import gbc_kernels as gbc
from gbc_kernels import objectives as T
from gbc_kernels._loss_math import TokenInputs, loss_terms

F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-13)
# sequences of the token vectors; 0: an empty sequence (a row with no masked token)
LENGTHS = (9, 0, 12, 7, 0, 11)


# ---------------------------------------------------------------------------------------------
# inputs and oracle helpers
# ---------------------------------------------------------------------------------------------

def exact_log(t: float) -> float:
    """A float64 ``x`` with ``exp(x) == t`` exactly (so that the ratio sits on the edge)."""
    x = torch.tensor(math.log(t), dtype=F64)
    cands, up, dn = [x], x, x
    for _ in range(16):
        up = torch.nextafter(up, torch.tensor(math.inf, dtype=F64))
        dn = torch.nextafter(dn, torch.tensor(-math.inf, dtype=F64))
        cands += [up, dn]
    for c in cands:
        if torch.exp(c).item() == t:
            return c.item()
    raise AssertionError(f"no float64 x with exp(x) == {t}")


# ratio edges of the cases below: 1 -+ 0.2, 1 + 0.28, delta 1.5, clip_ratio_c 2.0, ties at 1
RATIO_EDGES = (0.8, 1.2, 1.28, 1.5, 2.0, 1.0, 0.5)
LOG_RATIO_EDGES = (-0.2, 0.2, -0.1, 0.3, 0.0)        # gmpo's clip bounds of its cases


def seq_ids(lengths):
    return torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])


def seq_mean(x, seq, n_seq):
    """Each token's sequence mean, written out (one Python loop over the sequences)."""
    out = 0.0 * x                         # (keeps the graph when there is no token)
    for b in range(n_seq):
        on = seq == b
        if on.any():
            out = torch.where(on, x[on].sum() / on.sum(), out)
    return out


def make_tokens(seed, lengths=LENGTHS, edges=False, is_ratio=False):
    """Leaves ``lw``, ``logp``, ``log_ratio`` (float64, independent) and the rest of an
    objective's inputs. With ``edges``, the first tokens carry every ratio and log-ratio edge
    once per advantage sign (+, -, 0)."""
    g = torch.Generator().manual_seed(seed)
    seq = seq_ids(lengths)
    n, n_seq = seq.numel(), len(lengths)
    adv = torch.randn(n, generator=g, dtype=F64)
    adv[::5] = 0.0
    scale = torch.rand(n, generator=g, dtype=F64) + 0.5
    scale[2::7] = 0.0                     # A-hat 0 with a raw advantage (a Lopti phase mask)
    logp = -3.0 * torch.rand(n, generator=g, dtype=F64) - 0.01
    old = (logp + 0.3 * torch.randn(n, generator=g, dtype=F64)).clamp(max=-1e-3)
    lw = 0.4 * torch.randn(n, generator=g, dtype=F64)
    lr = 0.3 * torch.randn(n, generator=g, dtype=F64)
    if edges:
        signs = (0.7, -0.7, 0.0)
        k = 0
        for r in RATIO_EDGES:
            for s in signs:
                lw[k], adv[k], scale[k] = exact_log(r), s, 1.0
                k += 1
        for j, v in enumerate(LOG_RATIO_EDGES * 3):
            lr[j] = v
        assert k <= n
    a = adv * scale
    isr = (torch.rand(n, generator=g, dtype=F64) + 0.5) if is_ratio else None
    w = torch.rand(n, generator=g, dtype=F64) + 0.1          # aggregation weights
    cnt = torch.zeros(n_seq, dtype=F64).index_add_(0, seq, torch.ones(n, dtype=F64))
    leaves = [t.clone().requires_grad_(True) for t in (lw, logp, lr)]
    return dict(a=a, adv=adv, old=old, is_ratio=isr, seq=seq, n_seq=n_seq, cnt=cnt, w=w,
                lw=leaves[0], logp=leaves[1], log_ratio=leaves[2])


def grads(value, leaves):
    gs = torch.autograd.grad(value, leaves, allow_unused=True)
    return [torch.zeros_like(x) if gx is None else gx for x, gx in zip(leaves, gs)]


def check_objective(fn, cfg, d):
    """``fn``'s hand derivatives of ``sum_t w_t pg_t`` in ``lw``, ``logp`` and ``log_ratio``
    against autograd."""
    x = T.Tokens(d["a"], d["adv"], d["logp"], d["old"], d["log_ratio"], torch.exp(d["lw"]),
                 d["is_ratio"], d["seq"], d["n_seq"], d["cnt"])
    out = fn(cfg, x)
    w = d["w"]
    assert torch.isfinite(out.pg).all()
    auto = grads((w * out.pg).sum(), [d["lw"], d["logp"], d["log_ratio"]])
    zeros = torch.zeros_like(w)
    hand = [w * out.d_lw,
            zeros if out.d_direct is None else w * out.d_direct,
            zeros if out.d_seq is None
            else seq_mean((w * out.pg).detach(), d["seq"], d["n_seq"]) * out.d_seq]
    for name, h, a in zip(("d/dlw", "d/dlogp", "d/dlog_ratio"), hand, auto):
        torch.testing.assert_close(h.detach(), a, **TOL, msg=lambda m: f"{name}: {m}")
    return out


# ---------------------------------------------------------------------------------------------
# the cases, keyed by entry name
# ---------------------------------------------------------------------------------------------

OBJECTIVE_CASES = {
    "ppo_clip": [dict(), dict(epsilon_high=0.28), dict(delta=1.5), dict(clip_ratio_c=2.0),
                 dict(delta=1.5, clip_ratio_c=2.0, epsilon_high=0.28)],
    "cispo": [dict(epsilon_high=1.2), dict(epsilon_high=1.2, cispo_min=0.8),
              dict(epsilon_high=1.5, cispo_min=1.0)],
    "sapo": [dict(), dict(sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)],
    "reinforce": [dict()],
    "unclipped": [dict()],
    "dppo": [dict(), dict(clip_ratio_c=2.0), dict(dppo_divergence="binary_kl"),
             dict(dppo_divergence="binary_kl", clip_ratio_c=0.5, epsilon_low=0.05)],
    "gmpo": [dict(), dict(epsilon_low=0.1, epsilon_high=0.3)],
    "vespo": [dict(), dict(vespo_k_pos=1.0, vespo_lambda_neg=0.5, vespo_k_neg=0.0)],
}

OBJ_PARAMS = [pytest.param(name, i, opts, id=f"{name}-{i}")
              for name, cases in OBJECTIVE_CASES.items() for i, opts in enumerate(cases)]


@pytest.mark.parametrize("name,i,opts", OBJ_PARAMS)
@pytest.mark.parametrize("edges", [False, True], ids=["random", "edges"])
def test_objective_derivative(name, i, opts, edges):
    cfg = gbc.PolicyLossConfig(objective=name, **opts)
    for seed in range(3):
        check_objective(T.OBJECTIVES[name].fn, cfg, make_tokens(seed + 10 * i, edges=edges))


@pytest.mark.parametrize("name", [n for n, o in T.OBJECTIVES.items() if o.needs_sequence])
def test_sequence_objective_rows(name):
    """Sequence-level objectives: a rollout is_ratio, sequences without tokens, no token at all,
    one sequence only."""
    cfg = gbc.PolicyLossConfig(objective=name)
    check_objective(T.OBJECTIVES[name].fn, cfg, make_tokens(3, edges=True, is_ratio=True))
    out = check_objective(T.OBJECTIVES[name].fn, cfg, make_tokens(4, lengths=(0, 0, 0)))
    assert out.pg.numel() == 0
    check_objective(T.OBJECTIVES[name].fn, cfg, make_tokens(5, lengths=(0, 6, 0)))


def test_a_wrong_derivative_fails():
    """The checker catches a derivative off by a factor (the test can fail)."""
    def wrong(cfg, x):
        out = T.OBJECTIVES["sapo"].fn(cfg, x)
        return T.Out(out.pg, 1.001 * out.d_lw)
    with pytest.raises(AssertionError, match="d/dlw"):
        check_objective(wrong, gbc.PolicyLossConfig(objective="sapo"), make_tokens(0))


def _level_token(lr, seq, n_seq):
    return lr


def _level_sequence(lr, seq, n_seq):
    return seq_mean(lr, seq, n_seq)


def _level_sequence_token(lr, seq, n_seq):
    # verl's GSPO-token: value the sequence mean, gradient each token's own, clamp at 10
    return (lr - lr.detach() + seq_mean(lr, seq, n_seq).detach()).clamp(max=10.0)


LEVEL_CASES = {"token": _level_token, "sequence": _level_sequence,
               "sequence_token": _level_sequence_token}


@pytest.mark.parametrize("level", list(LEVEL_CASES))
@pytest.mark.parametrize("lengths", [LENGTHS, (0, 0), (0, 5, 0, 3)], ids=["rows", "none", "few"])
def test_ratio_level(level, lengths):
    d = make_tokens(7, lengths=lengths)
    lr = d["log_ratio"]
    with torch.no_grad():                 # a sequence at the clamp of 10, one above it
        if len(lengths) > 3:
            lr[d["seq"] == 1] = 10.0
            lr[d["seq"] == 3] = 10.5
    lw, back = T.RATIO_LEVELS[level].fn(lr, d["seq"], d["n_seq"], d["cnt"])
    want = LEVEL_CASES[level](lr, d["seq"], d["n_seq"])
    torch.testing.assert_close(lw.detach(), want.detach(), **TOL)
    (auto,) = grads((d["w"] * want).sum(), [lr])
    torch.testing.assert_close(back(d["w"]), auto, **TOL)
    assert T.RATIO_LEVELS[level].needs_sequence == (level != "token")


TERM_CASES = {
    "log_ratio_penalty": [dict(log_ratio_penalty=0.3), dict(log_ratio_penalty=2.0)],
    "kl_cov": [dict(objective="unclipped", cov_mode="kl", cov_kl_coef=0.5),
               dict(objective="unclipped", cov_mode="kl", cov_kl_coef=-0.2)],
}


@pytest.mark.parametrize("name", list(TERM_CASES))
def test_token_term(name):
    for opts in TERM_CASES[name]:
        cfg = gbc.PolicyLossConfig(**opts)
        assert T.TOKEN_TERMS[name].on(cfg) and not T.TOKEN_TERMS[name].on(gbc.PolicyLossConfig())
        d = make_tokens(2, edges=True)
        lr = d["log_ratio"]
        sel = torch.rand(lr.shape, generator=torch.Generator().manual_seed(1)) < 0.5
        sel[:5] = True                                 # the log-ratio edges, 0 among them
        v, dv = T.TOKEN_TERMS[name].fn(lr, cfg, sel)
        (auto,) = grads((d["w"] * v).sum(), [lr])
        torch.testing.assert_close(d["w"] * dv.detach(), auto, **TOL)


# ---------------------------------------------------------------------------------------------
# Clip-Cov / KL-Cov: the selection rule, and the policy term composed with it
# ---------------------------------------------------------------------------------------------

def _token_inputs(d, w, sel=None, klw=None, ref=None):
    n = w.numel()
    return TokenInputs(adv=d["adv"], old=d["old"], ref=ref, tscale=None, klw=klw, is_ratio=None,
                       sampling=None, w_pg=w, w_kl=torch.full((n,), 0.7, dtype=F64),
                       w_ent=w, cov_sel=sel)


def _check_clip_cov(sel, cov, k, d, cfg):
    r = torch.exp(d["logp"].detach() - d["old"])
    lo, hi = 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high
    clipped = ((d["adv"] > 0) & (r > hi)) | ((d["adv"] < 0) & (r < lo))
    cand = (cov > cfg.cov_lb) & (cov < cfg.cov_ub) & ~clipped
    assert not (sel & ~cand).any() and int(sel.sum()) == min(k, int(cand.sum()))


def _check_kl_cov(sel, cov, k, d, cfg):
    assert int(sel.sum()) == k and cov[sel].min() >= cov[~sel].max()


COV_CASES = {
    "clip": (dict(objective="ppo_clip", cov_mode="clip", cov_ratio=0.3, cov_lb=-0.5, cov_ub=0.5),
             _check_clip_cov),
    "kl": (dict(objective="unclipped", cov_mode="kl", cov_ratio=0.2, cov_kl_coef=0.5),
           _check_kl_cov),
}


@pytest.mark.parametrize("mode", list(COV_CASES))
def test_cov_mode(mode):
    opts, check_sel = COV_CASES[mode]
    cfg = gbc.PolicyLossConfig(**opts)
    d = make_tokens(6, lengths=(40,))
    logp = d["logp"]
    sel = T.cov_selection(logp.detach(), d["adv"], d["old"], cfg)
    a, lp = d["adv"], logp.detach()
    cov = (a - a.mean()) * (lp - lp.mean())
    k = max(int(cfg.cov_ratio * lp.numel()), 1)
    assert sel.any()
    check_sel(sel, cov, k, d, cfg)
    # the composed policy term's derivative in logp equals autograd of its value
    res = loss_terms(logp, None, _token_inputs(d, d["w"], sel), cfg, None)
    (auto,) = grads(res.loss_sum, [logp])
    torch.testing.assert_close(res.g.detach(), auto, **TOL)
    assert T.cov_selection(logp[:0].detach(), a[:0], d["old"][:0], cfg).numel() == 0


# ---------------------------------------------------------------------------------------------
# KL forms and KL options, through kl_term, against estimators written out here
# ---------------------------------------------------------------------------------------------

_BASE = {"k1": lambda x: -x, "k2": lambda x: 0.5 * x * x, "k3": lambda x: torch.exp(x) - x - 1.0,
         "abs": lambda x: x.abs()}


def kl_oracle(logp, ref, old, lw, cfg):
    """The KL term of ``cfg`` as a value whose autograd is its gradient (straight-through forms
    as ``sg(v) + w k2 - sg(w k2)``)."""
    name, ic, vc = cfg.kl_estimator.rstrip("+"), cfg.kl_log_ratio_clamp, cfg.kl_clamp
    if name == "low_var_kl":
        name, ic, vc = "k3", 20.0, 10.0
    x = ref - logp
    if ic is not None:
        x = x.clamp(-ic, ic)
    v = _BASE[name](x)
    if vc is not None:
        v = v.clamp(-vc, vc)
    w = 1.0 if cfg.kl_estimator.endswith("+") else None
    if cfg.kl_unbiased_gradient:
        w = torch.exp(logp - old).clamp(max=10.0).detach()
    if w is not None:
        k2 = w * 0.5 * (logp - ref) ** 2
        v = v.detach() + k2 - k2.detach()
    return torch.exp(lw) * v if cfg.kl_ratio_correction else v


def kl_inputs(seed):
    """logp, ref, old, lw with deltas on every clamp edge of the cases (0, +-0.5, +-20, beyond)."""
    g = torch.Generator().manual_seed(seed)
    n = 40
    logp = -3.0 * torch.rand(n, generator=g, dtype=F64) - 0.01
    ref = logp + 1.5 * torch.randn(n, generator=g, dtype=F64)
    old = logp + 0.5 * torch.randn(n, generator=g, dtype=F64)
    edges = [(-1.0, -1.0), (-1.0, -0.5), (-1.0, -1.5), (-1.0, 19.0), (-1.0, -21.0),
             (-1.0, 24.0), (-1.0, -30.0), (-1.0, 2.0), (-4.0, -1.0), (-3.0, -0.5)]
    for j, (lp, rf) in enumerate(edges):
        logp[j], ref[j] = lp, rf
    old[:3] = logp[:3] - 5.0                           # ratios above OpenRLHF's cap of 10
    lw = 0.4 * torch.randn(n, generator=g, dtype=F64)
    return logp.requires_grad_(True), ref, old, lw.requires_grad_(True)


def check_kl(cfg, seed=0):
    logp, ref, old, lw = kl_inputs(seed)
    w = torch.rand(logp.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    kl, dk, kl_lw = T.kl_term(logp, ref, old, torch.exp(lw), cfg)
    want = kl_oracle(logp, ref, old, lw, cfg)
    torch.testing.assert_close(kl.detach(), want.detach(), **TOL)
    auto = grads((w * want).sum(), [logp, lw])
    torch.testing.assert_close((w * dk).detach(), auto[0], **TOL)
    hand_lw = torch.zeros_like(w) if kl_lw is None else (w * kl_lw).detach()
    torch.testing.assert_close(hand_lw, auto[1], **TOL)


KL_CASES = {name: dict(kl_estimator=name) for name in T.KL_FORMS}


@pytest.mark.parametrize("name", list(KL_CASES))
def test_kl_form(name):
    check_kl(gbc.PolicyLossConfig(kl_coef=0.1, **KL_CASES[name]))
    form = T.KL_FORMS[name]
    assert form.straight_through == name.endswith("+")
    if form.straight_through:             # the value of its base form
        base, logp, ref = T.KL_FORMS[name[:-1]], *kl_inputs(1)[:2]
        v = T.kl_value_and_grad(logp, ref, name, straight_through=1.0)[0]
        torch.testing.assert_close(v.detach(), T.kl_value_and_grad(logp, ref, base.name)[0]
                                   .detach(), **TOL)


KL_OPTION_CASES = {
    "kl_log_ratio_clamp": [dict(kl_estimator="k3", kl_log_ratio_clamp=0.5),
                           dict(kl_estimator="abs", kl_log_ratio_clamp=0.5),
                           dict(kl_estimator="k1+", kl_log_ratio_clamp=0.5)],
    "kl_clamp": [dict(kl_estimator="k1", kl_clamp=0.5), dict(kl_estimator="k3", kl_clamp=0.5),
                 dict(kl_estimator="k2", kl_clamp=0.5, kl_log_ratio_clamp=0.5)],
    "kl_unbiased_gradient": [dict(kl_estimator="k3", kl_unbiased_gradient=True),
                             dict(kl_estimator="k1", kl_unbiased_gradient=True, kl_clamp=0.5),
                             dict(kl_estimator="low_var_kl", kl_unbiased_gradient=True)],
    "kl_ratio_correction": [dict(kl_estimator="k3", kl_ratio_correction=True),
                            dict(kl_estimator="abs", kl_ratio_correction=True, kl_clamp=0.5)],
}


@pytest.mark.parametrize("name", list(KL_OPTION_CASES))
def test_kl_option(name):
    for i, opts in enumerate(KL_OPTION_CASES[name]):
        cfg = gbc.PolicyLossConfig(kl_coef=0.1, **opts)
        assert T.KL_OPTIONS[name].on(cfg)
        check_kl(cfg, seed=i)


# ---------------------------------------------------------------------------------------------
# the table as a whole: coverage, the config's names, its checks, and the composition
# ---------------------------------------------------------------------------------------------

def test_every_entry_has_its_cases():
    assert set(OBJECTIVE_CASES) == set(T.OBJECTIVES)
    assert set(LEVEL_CASES) == set(T.RATIO_LEVELS)
    assert set(TERM_CASES) == set(T.TOKEN_TERMS)
    assert set(COV_CASES) == set(T.COV_MODES)
    assert set(KL_CASES) == set(T.KL_FORMS)
    assert set(KL_OPTION_CASES) == set(T.KL_OPTIONS)


def test_config_names_come_from_the_table():
    c = gbc.config
    assert c.OBJECTIVES == tuple(T.OBJECTIVES)
    assert c.IS_LEVELS == tuple(T.RATIO_LEVELS)
    assert set(c.KL_ESTIMATORS + c.KL_STRAIGHT_THROUGH) == set(T.KL_FORMS)
    assert c.COV_MODES == (None,) + tuple(T.COV_MODES)
    # the native kernels' estimator index is the position in KL_ESTIMATORS
    assert c.KL_ESTIMATORS[:4] == ("k1", "k2", "k3", "low_var_kl")
    assert all(T.KL_FORMS[k].native == (k in c.KL_ESTIMATORS[:4]) for k in T.KL_FORMS)
    with pytest.raises(ValueError, match="objective: expected one of"):
        gbc.PolicyLossConfig(objective="ppo")


@pytest.mark.parametrize("field,owners", sorted(T.exclusive_options().items()))
def test_exclusive_options_refused_elsewhere(field, owners):
    """An objective's own option, set with an objective that does not read it, is refused
    naming both."""
    value = {"delta": 1.5, "clip_ratio_c": 2.0, "cispo_min": 0.1,
             "dppo_divergence": "binary_kl"}[field]
    names = [o for o, _ in owners]
    for obj in T.OBJECTIVES:
        if obj in names:
            gbc.PolicyLossConfig(objective=obj, **{field: value})
        else:
            with pytest.raises(ValueError, match=f"{field}.*objective={obj!r}"):
                gbc.PolicyLossConfig(objective=obj, **{field: value})


@pytest.mark.parametrize("obj", list(T.OBJECTIVES))
def test_levels_refused_by_name(obj):
    for level in T.RATIO_LEVELS:
        if level in T.OBJECTIVES[obj].levels:
            gbc.PolicyLossConfig(objective=obj, importance_sampling_level=level)
        else:
            with pytest.raises(ValueError, match=f"importance_sampling_level.*{obj!r}"):
                gbc.PolicyLossConfig(objective=obj, importance_sampling_level=level)


COMPOSED = [dict(objective=o, **x) for o in T.OBJECTIVES for x in (
    dict(), dict(kl_coef=0.2, kl_estimator="k3", entropy_coef=0.01),
    dict(ar_alpha=0.4, log_ratio_clamp=0.25, kl_coef=0.1, kl_estimator="k2"))] + [
    dict(objective=o, importance_sampling_level="sequence", kl_coef=0.1, kl_estimator="k1",
         kl_ratio_correction=True) for o in ("ppo_clip", "cispo", "sapo", "unclipped", "vespo")] + [
    dict(objective="ppo_clip", off_policy_mask_threshold=0.05, log_ratio_penalty=0.3),
    dict(objective="gmpo", kl_coef=0.3, kl_estimator="abs", kl_clamp=0.5,
         kl_log_ratio_clamp=1.0, lopti_eta=0.3)]


@pytest.mark.parametrize("opts", COMPOSED, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_loss_terms_composition(opts):
    """loss_terms' derivative in logp equals autograd of its loss, the entries composed (ratio
    level, objective, token terms, masks, KL, weights), with is_ratio, a Lopti phase when
    lopti_eta is set, empty sequences."""
    cfg = gbc.PolicyLossConfig(**opts)
    d = make_tokens(11, edges=True, is_ratio=True)
    logp = d["logp"]
    ref = logp.detach() + 0.4
    ti = _token_inputs(d, d["w"], klw=torch.rand(d["w"].shape, dtype=F64) + 0.5, ref=ref)
    ti.is_ratio = d["is_ratio"]
    ti.sampling = d["old"] + 0.05
    if cfg.off_policy_mask_threshold is None:
        ti.sampling = None
    ti.seq, ti.n_seq = d["seq"], d["n_seq"]
    entropy = torch.rand(d["w"].shape, dtype=F64)
    phase = "low" if cfg.lopti_eta is not None else None
    res = loss_terms(logp, entropy, ti, cfg, phase)
    (auto,) = grads(res.loss_sum, [logp])
    torch.testing.assert_close(res.g.detach(), auto, **TOL)
