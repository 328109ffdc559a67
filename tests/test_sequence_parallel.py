"""Sequence / context parallelism (docs/distributed.md, "Sequence and context parallelism"):
the tokens of each sequence split over 2 and 3 gloo ranks at random.

Each rank holds its own tokens of every sequence, compacted into ``[B, T_r]`` rows with a
width of its own (padding masked out; a rank owns no token of some sequences, one row is empty
everywhere, and in the ``idle`` runs one rank owns no token at all). The sum over the ranks of
the losses and of the gradients (hidden rows scattered back to their positions, the lm_head's
summed) and every rank's metrics must equal ``gbc_reference`` on the whole sequences in one
process, float64, for every loss_agg mode, the sequence-level objectives (GSPO, GSPO-token,
geo-mean, VESPO), the off-policy mask, the entropy quantile and each method (AR, Lopti's
phases, NTHR's token_scale, critical-KL's kl_weight with a KL term); the fused loss and the
loss on given log-probs; float32 and bf16 on the fast path; vocab parallelism composed (2 x 2).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gbc_kernels as gbc
import gbc_reference as ref
from conftest import as64, make_batch, max_rel_err, spawn_gloo

U = 1.7            # the upstream gradient: loss * U, so the stored gradients are scaled

CASES = [
    dict(id="token-mean+kl+methods", cfg=dict(kl_coef=0.1, ar_alpha=0.3), tscale=True,
         klw=True),
    dict(id="seq-mean-token-mean", cfg=dict(loss_agg="seq-mean-token-mean", kl_coef=0.05)),
    dict(id="seq-mean-token-sum", cfg=dict(loss_agg="seq-mean-token-sum")),
    dict(id="sum-norm", cfg=dict(loss_agg="seq-mean-token-sum-norm", max_len=11)),
    dict(id="nonempty-count", cfg=dict(loss_agg="seq-mean-token-mean", seq_count="nonempty")),
    dict(id="num-items-global", cfg=dict(), num_items=True),
    dict(id="num-seqs-global", cfg=dict(loss_agg="seq-mean-token-sum"), num_seqs=True),
    dict(id="gspo", cfg=dict(importance_sampling_level="sequence", loss_agg="seq-mean-token-mean",
                             epsilon_low=3e-4, epsilon_high=4e-4, kl_coef=0.1,
                             kl_ratio_correction=True)),
    dict(id="gspo-token", cfg=dict(importance_sampling_level="sequence_token",
                                   epsilon_low=3e-4, epsilon_high=4e-4), is_ratio="token"),
    dict(id="geo-mean", cfg=dict(objective="gmpo", epsilon_low=0.05, epsilon_high=0.05),
         is_ratio="seq"),
    dict(id="vespo", cfg=dict(objective="vespo", importance_sampling_level="sequence"),
         is_ratio="seq"),
    dict(id="off-policy-mask", cfg=dict(off_policy_mask_threshold=0.05), sampling=True),
    dict(id="entropy-quantile", cfg=dict(top_entropy_quantile=0.4, entropy_coef=0.02,
                                         entropy_agg="seq-mean-token-mean")),
    dict(id="own-kl-agg", cfg=dict(kl_coef=0.1, kl_agg="seq-mean-token-mean", kl_estimator="k2"),
         klw=True),
    dict(id="lopti-low", cfg=dict(lopti_eta=0.5, ar_alpha=0.2), phase="low"),
    dict(id="lopti-high+gspo", cfg=dict(lopti_eta=0.5, importance_sampling_level="sequence",
                                        epsilon_low=3e-4, epsilon_high=4e-4), phase="high"),
    dict(id="nthr-scale", cfg=dict(loss_agg="seq-mean-token-mean"), tscale=True),
]
LOGP_CASES = ["token-mean+kl+methods", "seq-mean-token-mean", "nonempty-count", "gspo",
              "geo-mean", "vespo", "off-policy-mask", "entropy-quantile", "lopti-high+gspo"]


def _batch(seed):
    b = as64(make_batch(B=5, T=9, H=8, V=23, seed=seed, dtype=torch.float64))
    g = torch.Generator().manual_seed(seed + 100)
    B, T = b["mask"].shape
    b["token_scale"] = torch.rand(B, T, generator=g, dtype=torch.float64) * 1.5 + 0.25
    b["kl_weight"] = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5
    b["sampling_logp"] = (b["old_logp"] + 0.1 * torch.randn(B, T, generator=g,
                                                            dtype=torch.float64)).clamp(max=0)
    b["is_ratio_token"] = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5
    b["is_ratio_seq"] = torch.rand(B, 1, generator=g, dtype=torch.float64) + 0.5
    with torch.no_grad():
        z = b["hidden"] @ b["weight"].T + b["bias"]
        lp_all = torch.log_softmax(z, -1)
        b["logp"] = lp_all.gather(-1, b["targets"].clamp(min=0).unsqueeze(-1)).squeeze(-1)
        b["entropy"] = -(lp_all.exp() * lp_all).sum(-1)
        b["sum_p2"] = (lp_all.exp() ** 2).sum(-1)
    return b


def _owners(mask, world, seed, idle=False):
    """The rank holding each position: at random; row 0 whole on rank 0 (the others own none of
    it); ``idle``: the last rank owns nothing at all."""
    g = torch.Generator().manual_seed(seed)
    n = world - 1 if idle else world
    owner = torch.randint(0, n, mask.shape, generator=g)
    owner[0] = 0
    return owner


def _local(b, owner, rank):
    """This rank's rows: its positions of each sequence compacted to the left, ``[B, T_r]``
    (T_r its own, with a padding column on odd ranks), and ``pos`` (-1: padding)."""
    B, T = owner.shape
    own = owner == rank
    width = int(own.sum(-1).max()) + rank % 2
    pos = torch.full((B, max(width, 1)), -1, dtype=torch.long)
    for r in range(B):
        p = own[r].nonzero().squeeze(1)
        pos[r, :p.numel()] = p
    valid = pos >= 0
    safe = pos.clamp(min=0)
    out = {"pos": pos}
    for k, v in b.items():
        if not isinstance(v, torch.Tensor) or v.dim() < 2 or v.shape[:2] != (B, T):
            out[k] = v
            continue
        idx = safe.reshape(B, -1, *([1] * (v.dim() - 2))).expand(B, safe.shape[1], *v.shape[2:])
        t = v.gather(1, idx)
        if k == "mask":
            t = t & valid
        elif k == "targets":
            t = torch.where(valid, t, torch.full_like(t, -100))
        elif t.is_floating_point():          # garbage outside this rank's tokens
            fill = -0.37 if k in ("old_logp", "ref_logp", "sampling_logp", "logp") else 0.91
            vv = valid.reshape(*valid.shape, *([1] * (t.dim() - 2)))
            t = torch.where(vv, t, torch.full_like(t, fill))
        out[k] = t
    return out


def _scatter(x, pos, shape):
    """A rank's ``[B, T_r, ...]`` values back at their positions of ``shape``."""
    full = torch.zeros(shape, dtype=torch.float64)
    for r in range(pos.shape[0]):
        ok = pos[r] >= 0
        full[r, pos[r][ok]] = x[r, :pos.shape[1]][ok].double()
    return full


def _kwargs(b, case, full=None):
    """The loss's optional inputs of ``case`` from batch ``b`` (``full``: the whole batch, for
    the global counts)."""
    kw = dict(old_logp=b["old_logp"], ref_logp=b["ref_logp"])
    if case.get("tscale"):
        kw["token_scale"] = b["token_scale"]
    if case.get("klw"):
        kw["kl_weight"] = b["kl_weight"]
    if case.get("sampling"):
        kw["sampling_logp"] = b["sampling_logp"]
    if case.get("is_ratio"):
        kw["is_ratio"] = b["is_ratio_" + case["is_ratio"]]
    full = b if full is None else full
    if case.get("num_items"):
        kw["num_items_in_batch"] = int(full["mask"].sum())
    if case.get("num_seqs"):
        kw["num_seqs_in_batch"] = 7
    return kw


def _ref_config(case):
    cfg = dict(case["cfg"])
    cfg.pop("seq_count", None)          # the reference: as num_seqs_in_batch below
    return ref.PolicyLossConfig(**cfg)


def _ref_extra(b, case):
    if case["cfg"].get("seq_count") == "nonempty":
        return {"num_seqs_in_batch": int(b["mask"].any(-1).sum())}
    return {}


def _cast(b, dtype):
    out = dict(b)
    for k in ("hidden", "weight", "bias"):
        out[k] = b[k].to(dtype)
    return out


def _fused(b, case, sp, dtype=torch.float64, vp=None, full=None):
    """One rank's fused loss: (loss, metrics, grads, token logp). The fused path keeps
    logp in float32 between its sweeps: its loss agrees with float64 to ~1e-7."""
    b = _cast(b, dtype)
    h = b["hidden"].clone().requires_grad_(True)
    w, bias = b["weight"], b["bias"]
    if vp is not None:
        w, bias = w[vp.start:vp.end], bias[vp.start:vp.end]
    w, bias = w.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    tok = {}
    loss, metrics = gbc.fused_linear_policy_loss(
        h, w, b["targets"], b["mask"], b["advantages"], bias=bias,
        config=gbc.PolicyLossConfig(**case["cfg"]), phase=case.get("phase"),
        sequence_parallel=sp, vocab_parallel=vp, token_out=tok, **_kwargs(b, case, full))
    (loss * U).backward()
    return (float(loss.detach()), {k: float(v) for k, v in metrics.items()},
            {"hidden": h.grad.double(), "weight": w.grad.double(), "bias": bias.grad.double()},
            tok["logp"])


def _from_logp(b, case, sp, full=None):
    cfg = gbc.PolicyLossConfig(**case["cfg"])
    lp = b["logp"].clone().requires_grad_(True)
    ent = b["entropy"].clone().requires_grad_(True) if cfg.wants_entropy else None
    loss, metrics = gbc.policy_loss(lp, b["mask"], b["advantages"], entropy=ent, config=cfg,
                                    phase=case.get("phase"), sum_p2=b["sum_p2"],
                                    sequence_parallel=sp, **_kwargs(b, case, full))
    (loss * U).backward()
    grads = {"logp": lp.grad.double()}
    if ent is not None:
        grads["entropy"] = ent.grad.double()
    return float(loss.detach()), {k: float(v) for k, v in metrics.items()}, grads


def _worker(rank, world, b, owner, fused_cases, logp_cases, dtypes):
    loc = _local(b, owner, rank)
    sp = gbc.SequenceParallel("world")
    shape3 = b["hidden"].shape
    out = {"fused": [], "logp": [], "dtypes": []}
    for case in fused_cases:
        loss, metrics, grads, lp = _fused(loc, case, sp, full=b)
        grads["hidden"] = _scatter(grads["hidden"], loc["pos"], shape3)
        out["fused"].append((loss, metrics, grads, _scatter(lp, loc["pos"], owner.shape)))
    for case in logp_cases:
        loss, metrics, grads = _from_logp(loc, case, sp, full=b)
        grads = {k: _scatter(v, loc["pos"], owner.shape) for k, v in grads.items()}
        out["logp"].append((loss, metrics, grads))
    for case, dtype in dtypes:
        loss, metrics, grads, _ = _fused(loc, case, sp, dtype, full=b)
        grads["hidden"] = _scatter(grads["hidden"], loc["pos"], shape3)
        out["dtypes"].append((loss, metrics, grads))
    return out


def _ref_fused(b, case, dtype=torch.float64):
    x = {k: b[k].detach().clone().requires_grad_(True) for k in ("hidden", "weight", "bias")}
    loss, metrics = ref.fused_linear_policy_loss(
        x["hidden"], x["weight"], b["targets"], b["mask"], b["advantages"], bias=x["bias"],
        config=_ref_config(case), phase=case.get("phase"),
        **_kwargs(b, case), **_ref_extra(b, case))
    (loss * U).backward()
    return float(loss), {k: float(v) for k, v in metrics.items()}, \
        {k: v.grad for k, v in x.items()}


def _ref_logp(b, case):
    cfg = _ref_config(case)
    lp = b["logp"].clone().requires_grad_(True)
    wants = gbc.PolicyLossConfig(**case["cfg"]).wants_entropy
    ent = b["entropy"].clone().requires_grad_(True) if wants else None
    loss, metrics = ref.policy_loss(lp, b["mask"], b["advantages"], entropy=ent, config=cfg,
                                    phase=case.get("phase"), sum_p2=b["sum_p2"],
                                    **_kwargs(b, case), **_ref_extra(b, case))
    (loss * U).backward()
    grads = {"logp": lp.grad}
    if ent is not None:
        grads["entropy"] = ent.grad
    return float(loss), {k: float(v) for k, v in metrics.items()}, grads


def _summed(per_rank):
    """Loss and gradients summed over ranks; every rank's metrics (they must agree)."""
    loss = sum(r[0] for r in per_rank)
    grads = {k: sum(r[2][k] for r in per_rank) for k in per_rank[0][2]}
    return loss, [r[1] for r in per_rank], grads


def _check(name, per_rank, truth, rtol, mtol=2e-6, gtol=None):
    """``gtol``: the gradients' (float64: 1e-6, the bias gradient sums in float32)."""
    loss, metrics, grads = _summed(per_rank)
    tloss, tmetrics, tgrads = truth
    assert abs(loss - tloss) <= rtol * max(1.0, abs(tloss)), (name, loss, tloss)
    for k, g in grads.items():
        err = max_rel_err(g, tgrads[k])
        assert err <= (gtol or rtol), (name, k, err)
    for m in metrics:
        assert m == metrics[0], (name, "ranks disagree on the metrics")
        assert set(m) == set(tmetrics), (name, set(m) ^ set(tmetrics))
        for k, v in m.items():
            assert abs(v - tmetrics[k]) <= mtol * max(1.0, abs(tmetrics[k])), (name, k, v,
                                                                              tmetrics[k])


def _run(world, idle):
    seed = 11 * world + idle
    b = _batch(seed)
    owner = _owners(b["mask"], world, seed, idle)
    # the split is what the test claims: a sequence some rank holds nothing of, an empty row
    own_rows = [((owner == r) & b["mask"]).any(-1) for r in range(world)]
    assert not b["mask"][1].any() and not all(bool(o[0]) for o in own_rows)
    by_id = {c["id"]: c for c in CASES}
    logp_cases = [by_id[i] for i in LOGP_CASES]
    dtypes = [(by_id["token-mean+kl+methods"], torch.float32), (by_id["gspo"], torch.float32),
              (by_id["token-mean+kl+methods"], torch.bfloat16)]
    got = spawn_gloo(world, _worker, b, owner, CASES, logp_cases, dtypes)
    for i, case in enumerate(CASES):
        per_rank = [g["fused"][i] for g in got]
        _check(case["id"], [r[:3] for r in per_rank], _ref_fused(b, case), 1e-6, gtol=1e-6)
        lp = sum(r[3].double() for r in per_rank)       # each rank's own positions
        assert torch.allclose(torch.where(b["mask"], lp, 0.0),
                              torch.where(b["mask"], b["logp"], 0.0), atol=1e-6)
    for i, case in enumerate(logp_cases):
        _check("logp:" + case["id"], [g["logp"][i] for g in got], _ref_logp(b, case), 1e-9)
    for i, (case, dtype) in enumerate(dtypes):
        per_rank = [g["dtypes"][i] for g in got]
        truth = _ref_fused(b, case)
        name = f"{case['id']}:{dtype}"
        if dtype == torch.float32:
            _check(name, per_rank, truth, 1e-4, 1e-4)
        else:
            loss, _, grads = _summed(per_rank)
            assert abs(loss - truth[0]) <= 2e-2 * max(1.0, abs(truth[0])), name
            for k, g in grads.items():
                assert max_rel_err(g, truth[2][k]) <= 5e-2, (name, k)


@pytest.mark.parametrize("world,idle", [(2, False), (3, True)], ids=["sp2", "sp3-idle-rank"])
def test_split_sequences_equal_whole(world, idle):
    """Summed over the ranks: the loss and gradients of the whole sequences; the metrics the
    whole batch's on every rank."""
    _run(world, idle)


# ----------------------------------------------------------------------------------------------
# composed with vocab parallelism: 2 sequence ranks x 2 vocabulary slices
# ----------------------------------------------------------------------------------------------

VP_CASES = ["gspo", "seq-mean-token-mean", "entropy-quantile", "lopti-low"]


def _vp_worker(rank, world, b, owner, cases):
    """Ranks (0, 1) and (2, 3) split the vocabulary; (0, 2) and (1, 3) the sequences."""
    vp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    sp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    sp_index, vp_index = divmod(rank, 2)
    V = b["weight"].shape[0]
    cut = 10
    start, end = (0, cut) if vp_index == 0 else (cut, V)
    vp = gbc.VocabParallel(vp_groups[sp_index], start, end)
    sp = gbc.SequenceParallel(sp_groups[vp_index])
    loc = _local(b, owner, sp_index)
    out = []
    for case in cases:
        loss, metrics, grads, _ = _fused(loc, case, sp, vp=vp, full=b)
        grads["hidden"] = _scatter(grads["hidden"], loc["pos"], b["hidden"].shape)
        out.append((loss, metrics, grads, (start, end)))
    return out


def test_with_vocab_parallel():
    b = _batch(5)
    owner = _owners(b["mask"], 2, 5)
    by_id = {c["id"]: c for c in CASES}
    cases = [by_id[i] for i in VP_CASES]
    got = spawn_gloo(4, _vp_worker, b, owner, cases)
    for i, case in enumerate(cases):
        tloss, tmetrics, tgrads = _ref_fused(b, case)
        for vp_index in (0, 1):               # each slice's ranks: sequences split over two
            parts = [got[2 * s + vp_index][i] for s in (0, 1)]
            loss = sum(p[0] for p in parts)
            assert abs(loss - tloss) <= 1e-7 * max(1.0, abs(tloss)), case["id"]
            gh = sum(p[2]["hidden"] for p in parts)        # full on every slice's rank
            assert max_rel_err(gh, tgrads["hidden"]) <= 1e-6, case["id"]
            s, e = parts[0][3]
            for k in ("weight", "bias"):
                assert max_rel_err(sum(p[2][k] for p in parts), tgrads[k][s:e]) <= 1e-6, k
            for p in parts:
                for k, v in p[1].items():
                    assert abs(v - tmetrics[k]) <= 2e-6 * max(1.0, abs(tmetrics[k])), k


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------

def _bad_worker(rank, world):
    b = _batch(3)
    errors = {}

    def call(**kw):
        args = dict(sequence_parallel=gbc.SequenceParallel("world"))
        args.update(kw)
        n = args.pop("rows", b["mask"].shape[0])
        try:
            gbc.policy_loss(b["logp"][:n], b["mask"][:n], b["advantages"][:n],
                            old_logp=b["old_logp"][:n], **args)
        except (TypeError, ValueError) as e:
            return str(e)
        return None

    errors["type"] = call(sequence_parallel=dist.group.WORLD)
    errors["group"] = call(sequence_parallel=gbc.SequenceParallel("everyone"))
    errors["cov"] = call(config=gbc.PolicyLossConfig(cov_mode="kl"))
    errors["B"] = call(rows=5 - rank)
    return errors


def test_bad_input():
    for errors in spawn_gloo(2, _bad_worker):
        assert "sequence_parallel: expected None or gbc_kernels.SequenceParallel" in errors["type"]
        assert "sequence_parallel.group" in errors["group"]
        assert errors["cov"].startswith("cov_mode:") and "sequence_parallel" in errors["cov"]
        assert "same B sequences" in errors["B"]
