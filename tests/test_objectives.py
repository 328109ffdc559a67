"""The objectives of today's trainers (docs/math.md §10): GSPO's sequence ratio, cispo, sapo, luspo,
vespo, delta, the entropy-quantile and off-policy masks, per-term aggregation.

1. gbc_reference against a float64 computation written here, line by line after TRL 1.16's
   ``GRPOTrainer._compute_loss`` (its loss types, with TRL's own normalisers);
2. every backend against the reference: fp32 and bf16, odd V, sequences cut by chunk
   boundaries (tiny ``GBC_CHUNK_MB``: the two-sweep route), empty rows, random upstream;
3. Liger-Kernel's ``LigerFusedLinearGRPOLoss`` on the same inputs, ratios far from 1.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import gbc_kernels as gbc
import gbc_reference as ref
from conftest import as64, leaves, make_batch, max_rel_err
from test_policy_loss import check_against, check_bf16

# ----------------------------------------------------------------------------------------------
# 1. the reference against TRL's formulas, written out in float64
# ----------------------------------------------------------------------------------------------


def trl_formula(logp, entropy, mask, adv, old, refl, loss_type, level="token", eps_low=0.2,
                eps_high=0.2, delta=None, beta=0.0, bias_kl=False, entropy_coef=0.0, q=1.0,
                off_thr=None, sampling=None, num_items=None, max_len=None, is_ratio=None,
                sapo=(1.0, 1.05), vespo=(2.0, 3.0, 3.0, 2.0)):
    """TRL 1.16's _compute_loss (one process, no gradient accumulation), re-derived here."""
    m = mask.double()
    A = adv.unsqueeze(1) if adv.dim() == 1 else adv
    emask = None
    if q < 1.0:
        thr = torch.quantile(entropy.detach()[mask].float(), 1 - q)
        emask = ((entropy.detach() * m) >= thr) & mask
    if off_thr is not None:
        s = old if sampling is None else sampling
        drift = torch.nan_to_num(s - logp.detach(), nan=0.0)    # NaN: a token not scored
        kl_seq = (drift * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        keep = ((A >= 0) | (kl_seq <= off_thr)).double()
    lr = logp - old
    lw = lr if level == "token" else ((lr * m).sum(-1) / m.sum(-1).clamp(min=1)).unsqueeze(-1)
    c1 = torch.exp(lw)
    if beta:
        kl = torch.exp(refl - logp) - (refl - logp) - 1
        if bias_kl:
            kl = kl * c1
    if loss_type == "cispo":
        ptl = -torch.clamp(c1, max=eps_high).detach() * A * logp
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        c2 = torch.clamp(c1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            c1 = torch.clamp(c1, max=delta)
        ptl = -torch.min(c1 * A, c2 * A)
    elif loss_type == "sapo":
        temps = torch.where(A > 0, A.new_tensor(sapo[0]), A.new_tensor(sapo[1]))
        ptl = -torch.sigmoid(temps * (c1 - 1)) * 4 / temps * A
    else:  # vespo
        with torch.no_grad():
            kp, lp_, kn, ln = vespo
            slr = (torch.clamp(lr, -20, 20) * m).sum(-1, keepdim=True)
            if is_ratio is not None:
                log_is = torch.clamp(torch.log(is_ratio), math.log(1e-8), 20)
                # TRL sums the log over the last dim: once for a sequence ratio [B, 1]; for a
                # token ratio over every position, padding holding ratio 1 (here: masked sum)
                slr = slr + (log_is if is_ratio.shape[-1] == 1 else log_is * m).sum(
                    -1, keepdim=True)
            lw_ = torch.clamp(slr, math.log(1e-8), 20)
            k = torch.where(A >= 0, A.new_tensor(kp), A.new_tensor(kn))
            lam = torch.where(A >= 0, A.new_tensor(lp_), A.new_tensor(ln)).clamp(min=1e-4)
            phi = torch.exp(lam + k * lw_ - lam * torch.exp(lw_)).nan_to_num(0, 0, 0)
        ptl = -phi * A * logp
    if off_thr is not None:
        ptl = ptl * keep
    if emask is not None:
        ptl = ptl * emask
    if is_ratio is not None and loss_type != "vespo":
        ptl = ptl * is_ratio
    if beta:
        ptl = ptl + beta * kl
    ptl = ptl * m
    if loss_type in ("grpo", "sapo"):
        loss = (ptl.sum(-1) / m.sum(-1).clamp(min=1)).mean()
    elif loss_type == "bnpo":
        loss = ptl.sum() / m.sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        loss = ptl.sum() / (ptl.size(0) * max_len)
    elif loss_type in ("cispo", "dapo", "vespo"):
        loss = ptl.sum() / num_items
    else:  # luspo
        loss = ptl.sum(-1).mean()
    if entropy_coef:
        eff = m if emask is None else m * emask
        loss = loss - entropy_coef * (entropy * eff).sum() / eff.sum().clamp(min=1)
    return loss


TRL_CASES = [
    pytest.param("grpo", dict(level="sequence"), id="gspo"),
    pytest.param("grpo", dict(level="sequence", beta=0.04, bias_kl=True), id="gspo-kl-corrected"),
    pytest.param("bnpo", dict(level="sequence", eps_high=0.28), id="gspo-bnpo"),
    pytest.param("cispo", dict(eps_high=1.1, num_items=37), id="cispo"),
    pytest.param("cispo", dict(level="sequence", eps_high=1.1, num_items=37), id="cispo-seq"),
    pytest.param("sapo", dict(sapo=(0.7, 1.3)), id="sapo"),
    pytest.param("sapo", dict(level="sequence"), id="sapo-seq"),
    pytest.param("luspo", dict(level="sequence", beta=0.04), id="luspo"),
    pytest.param("luspo", dict(), id="luspo-token"),
    pytest.param("vespo", dict(num_items=41), id="vespo"),
    pytest.param("vespo", dict(num_items=41, vespo=(1.5, 2.0, 2.5, 0.5), beta=0.04),
                 id="vespo-params-kl"),
    pytest.param("vespo", dict(num_items=41, is_ratio=True), id="vespo-is-ratio"),
    pytest.param("dapo", dict(delta=1.15, num_items=33), id="delta"),
    pytest.param("grpo", dict(delta=1.1, eps_high=0.28, level="sequence"), id="delta-seq"),
    pytest.param("bnpo", dict(q=0.4), id="entropy-quantile"),
    pytest.param("grpo", dict(q=0.25, entropy_coef=0.02), id="quantile-entropy-bonus"),
    pytest.param("dapo", dict(off_thr=0.02, num_items=30), id="off-policy"),
    pytest.param("grpo", dict(off_thr=0.0, sampling=True, level="sequence"),
                 id="off-policy-sampling-gspo"),
    pytest.param("dr_grpo", dict(entropy_coef=0.03, max_len=11), id="entropy-dr_grpo"),
    pytest.param("dapo", dict(entropy_coef=0.03, num_items=29, beta=0.04), id="entropy-dapo"),
    pytest.param("cispo", dict(entropy_coef=0.03, num_items=29, q=0.5, eps_high=1.2),
                 id="entropy-quantile-cispo"),
    pytest.param("sapo", dict(is_ratio=True, beta=0.04, off_thr=0.01), id="sapo-is-ratio"),
    pytest.param("vespo", dict(num_items=41, is_ratio="seq"), id="vespo-sequence-is-ratio"),
    pytest.param("grpo", dict(is_ratio="seq", level="sequence"), id="gspo-sequence-is-ratio"),
]


def _config_of(loss_type, o, lib=ref):
    kw = dict(epsilon_low=o.get("eps_low", 0.2), epsilon_high=o.get("eps_high", 0.2),
              importance_sampling_level=o.get("level", "token"), delta=o.get("delta"),
              kl_coef=o.get("beta", 0.0), kl_estimator="k3",
              kl_ratio_correction=o.get("bias_kl", False),
              entropy_coef=o.get("entropy_coef", 0.0), top_entropy_quantile=o.get("q", 1.0),
              off_policy_mask_threshold=o.get("off_thr"), max_len=o.get("max_len"),
              sapo_temperature_pos=o.get("sapo", (1.0, 1.05))[0],
              sapo_temperature_neg=o.get("sapo", (1.0, 1.05))[1])
    kw.update(zip(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
                  o.get("vespo", (2.0, 3.0, 3.0, 2.0))))
    return lib.PolicyLossConfig.preset(loss_type, **kw)


def _extras(batch, o, seed):
    g = torch.Generator().manual_seed(seed)
    shape = batch["mask"].shape
    out = {}
    if o.get("is_ratio"):     # True: per token [B, T]; "seq": per sequence [B, 1]
        rshape = (shape[0], 1) if o["is_ratio"] == "seq" else shape
        out["is_ratio"] = (torch.rand(rshape, generator=g) * 1.5 + 0.2).double()
    if o.get("sampling"):
        s = (batch["old_logp"] + 0.2 * torch.randn(shape, generator=g)).clamp(max=0)
        # tokens the sampler could not score (TRL passes vLLM's as NaN): no drift
        s[torch.rand(shape, generator=g) < 0.15] = float("nan")
        out["sampling_logp"] = s.double()
    return out


@pytest.mark.parametrize("loss_type,opts", TRL_CASES)
def test_reference_and_policy_loss_match_trl_formulas(loss_type, opts):
    """TRL's formulas (float64, written above), gbc_reference.policy_loss (autograd) and
    gbc.policy_loss (the analytic derivative of the fast paths) on the same log-probs."""
    batch = as64(make_batch(seed=zlib.crc32(f"{loss_type}{opts}".encode()) % 997, old_spread=4.0))
    g = torch.Generator().manual_seed(1)
    logp0 = (batch["old_logp"] + 0.4 * torch.randn(batch["old_logp"].shape, generator=g,
                                                  dtype=torch.float64))
    ent0 = torch.rand(logp0.shape, generator=g, dtype=torch.float64) * 3
    extra = _extras(batch, opts, 5)
    m = batch["mask"]
    outs, metrics = [], []
    for which in ("trl", "ref", "gbc"):
        lp = logp0.clone().requires_grad_(True)
        en = ent0.clone().requires_grad_(True)
        if which == "trl":
            o = dict(opts)
            o["is_ratio"] = extra.get("is_ratio")
            o["sampling"] = extra.get("sampling_logp")
            loss = trl_formula(lp, en, m, batch["advantages"], batch["old_logp"],
                               batch["ref_logp"], loss_type, **o)
        else:
            lib = ref if which == "ref" else gbc
            loss, met = lib.policy_loss(lp, m, batch["advantages"], batch["old_logp"],
                                        batch["ref_logp"], entropy=en,
                                        config=_config_of(loss_type, opts, lib),
                                        num_items_in_batch=opts.get("num_items"), **extra)
            metrics.append(met)
        (loss * 0.9).backward()
        outs.append((loss.detach(), lp.grad, en.grad))
    z = torch.zeros_like(ent0)
    (l1, g1, e1) = outs[0]
    assert g1.abs().max() > 0          # the case has a gradient to compare
    for l2, g2, e2 in outs[1:]:
        assert torch.allclose(l1, l2, rtol=1e-12, atol=1e-13), (float(l1), float(l2))
        assert torch.allclose(torch.where(m, g1, 0), g2, rtol=1e-10, atol=1e-13)
        assert torch.allclose(z if e1 is None else e1, z if e2 is None else e2, atol=1e-13)
    assert set(metrics[0]) == set(metrics[1])
    for k, v in metrics[0].items():
        assert abs(float(v) - float(metrics[1][k])) < 1e-6, k


# ----------------------------------------------------------------------------------------------
# 2. every backend against the reference
# ----------------------------------------------------------------------------------------------

GBC_CASES = [
    pytest.param(dict(importance_sampling_level="sequence"), None, id="gspo"),
    pytest.param(dict(importance_sampling_level="sequence", kl_coef=0.1,
                      kl_ratio_correction=True, loss_agg="grpo"), None, id="gspo-kl-corrected"),
    pytest.param(dict(objective="cispo", epsilon_high=1.1), None, id="cispo"),
    pytest.param(dict(objective="cispo", epsilon_high=1.1, importance_sampling_level="sequence",
                      kl_coef=0.05), None, id="cispo-seq-kl"),
    pytest.param(dict(objective="sapo", sapo_temperature_pos=0.8, loss_agg="grpo"), None,
                 id="sapo"),
    pytest.param(dict(objective="sapo", importance_sampling_level="sequence"), None,
                 id="sapo-seq"),
    pytest.param(dict(importance_sampling_level="sequence", loss_agg="seq-mean-token-sum"),
                 None, id="luspo"),
    pytest.param(dict(objective="vespo"), None, id="vespo"),
    pytest.param(dict(objective="vespo", kl_coef=0.1, kl_ratio_correction=True), None,
                 id="vespo-kl"),
    pytest.param(dict(delta=1.15, epsilon_high=0.28), None, id="delta"),
    pytest.param(dict(top_entropy_quantile=0.4), None, id="entropy-quantile"),
    pytest.param(dict(top_entropy_quantile=0.3, entropy_coef=0.05, entropy_agg="token-mean",
                      loss_agg="grpo"), None, id="quantile-entropy-agg"),
    pytest.param(dict(off_policy_mask_threshold=0.02), None, id="off-policy"),
    pytest.param(dict(off_policy_mask_threshold=0.02, importance_sampling_level="sequence",
                      objective="sapo"), None, id="off-policy-sapo-seq"),
    pytest.param(dict(return_entropy=True, loss_agg="grpo"), None, id="return-entropy"),
    pytest.param(dict(kl_coef=0.1, kl_agg="seq-mean-token-mean", entropy_coef=0.05,
                      entropy_agg="token-mean", loss_agg="seq-mean-token-sum-norm", max_len=12),
                 None, id="own-aggregations"),
    pytest.param(dict(importance_sampling_level="sequence", ar_alpha=0.3, lopti_eta=0.5,
                      kl_coef=0.05, kl_estimator="k2", entropy_coef=0.02,
                      entropy_agg="token-mean", top_entropy_quantile=0.6,
                      off_policy_mask_threshold=0.01, delta=1.3, clip_ratio_c=3.0,
                      temperature=0.8), "low", id="everything-low"),
    pytest.param(dict(objective="vespo", ar_alpha=0.3, lopti_eta=0.5, kl_coef=0.05,
                      off_policy_mask_threshold=0.01, top_entropy_quantile=0.7), "high",
                 id="vespo-everything-high"),
]


@pytest.fixture(params=["one-chunk", "few-sequences", "rows-cut"])
def chunking(request, monkeypatch):
    """Chunk budgets: everything in one chunk; a few whole sequences per chunk; chunks smaller
    than a sequence (the two-sweep route)."""
    mb = {"one-chunk": None, "few-sequences": "0.0013", "rows-cut": "0.0003"}[request.param]
    if mb is not None:
        monkeypatch.setenv("GBC_CHUNK_MB", mb)
    return request.param


def run(lib, batch, cfg_kwargs, phase, upstream, backend=None, extra=None):
    x = leaves(batch)
    kw = {k: batch[k] for k in ("old_logp", "ref_logp", "token_scale", "kl_weight")
          if k in batch}
    kw.update(extra or {})
    if backend is not None:
        kw["backend"] = backend
    loss, metrics = lib.fused_linear_policy_loss(
        x["hidden"], x["weight"], batch["targets"], batch["mask"], batch["advantages"],
        bias=x.get("bias"), config=lib.PolicyLossConfig(**cfg_kwargs), phase=phase, **kw)
    (loss * upstream).backward()
    return loss.detach(), metrics, {k: v.grad for k, v in x.items()}


@pytest.mark.parametrize("cfg,phase", GBC_CASES)
def test_fp32_matches_float64_reference(backend, cfg, phase, chunking):
    seed = zlib.crc32(str(cfg).encode()) % 1000
    batch = make_batch(B=5, T=9, V=37, seed=seed, old_spread=4.0)
    g = torch.Generator().manual_seed(seed)
    batch["token_scale"] = torch.rand(batch["mask"].shape, generator=g) + 0.25
    batch["kl_weight"] = torch.rand(batch["mask"].shape, generator=g)
    extra = {}
    if cfg.get("objective") in ("vespo", "sapo"):
        extra["is_ratio"] = torch.rand(batch["mask"].shape, generator=g) + 0.5
    if cfg.get("off_policy_mask_threshold") is not None:
        extra["sampling_logp"] = (batch["old_logp"] + 0.1 * torch.randn(
            batch["mask"].shape, generator=g)).clamp(max=0)
    up = float(torch.randn((), generator=g))
    out = run(gbc, batch, cfg, phase, up, backend, extra)
    truth = run(ref, as64(batch), cfg, phase, up, extra={k: v.double() for k, v in extra.items()})
    check_against(out, truth, 1e-5, 1e-4)


@pytest.mark.parametrize("cfg", [dict(objective="vespo"), dict(objective="sapo"),
                                 dict(importance_sampling_level="sequence", kl_coef=0.04)],
                         ids=["vespo", "sapo", "gspo"])
def test_sequence_is_ratio(backend, cfg, chunking):
    """A per-sequence importance ratio ``[B, 1]`` (TRL's sequence_* modes), an empty row among
    the sequences: the fused loss against the float64 reference, which folds it into vespo's
    weight once and broadcasts it elsewhere."""
    batch = make_batch(B=5, T=9, V=37, seed=8, old_spread=4.0)
    batch["mask"][2] = False
    g = torch.Generator().manual_seed(8)
    extra = {"is_ratio": torch.rand(5, 1, generator=g) * 1.5 + 0.2}
    out = run(gbc, batch, cfg, None, 0.6, backend, extra)
    truth = run(ref, as64(batch), cfg, None, 0.6, extra={"is_ratio": extra["is_ratio"].double()})
    check_against(out, truth, 1e-5, 1e-4)
    with pytest.raises(ValueError, match=r"is_ratio: expected shape \[5x9\] \(per token\) or "
                                         r"\[5x1\] \(per sequence\), got \[5x3\]"):
        run(gbc, batch, cfg, None, 0.6, backend, {"is_ratio": torch.ones(5, 3)})


@pytest.mark.parametrize("cfg,phase", [GBC_CASES[0], GBC_CASES[7], GBC_CASES[-2]])
def test_bf16_odd_vocab(backend, cfg, phase, chunking):
    """bf16 storage, V = 131 (not a multiple of any block): within bf16's error of float64."""
    batch = make_batch(B=4, T=16, H=64, V=131, dtype=torch.bfloat16, seed=17, old_spread=4.0)
    out = run(gbc, batch, cfg, phase, 0.8, backend)
    truth = run(ref, as64(batch), cfg, phase, 0.8)
    check_bf16(out, truth, 2e-2, 5e-2)


@pytest.mark.parametrize("cfg", [GBC_CASES[0][0][0], GBC_CASES[7][0][0], GBC_CASES[10][0][0],
                                 GBC_CASES[12][0][0]])
def test_all_masked_sequences(backend, cfg, chunking):
    """Empty rows among full ones, and an all-zero mask: finite, exact zeros where nothing
    counts, phi = 1 for an empty sequence."""
    check_empty_rows(cfg, backend)


def check_empty_rows(cfg, backend, call=lambda fn, *a: fn(*a)):
    """An empty row among full ones (NaN there must not leak) against the float64 reference,
    then an all-zero mask: zero loss and gradients, metrics 0 (phi_mean 1). ``call`` runs each
    loss (e.g. from a fixed random state)."""
    batch = make_batch(B=5, T=9, V=37, seed=3, old_spread=4.0)
    batch["mask"][3] = False
    batch["old_logp"][3] = float("nan")       # garbage where m = 0 must not leak
    truth = call(run, ref, as64(batch), cfg, None, 1.0)
    out = call(run, gbc, batch, cfg, None, 1.0, backend)
    batch["old_logp"][3] = 0.0
    check_against(out, truth, 1e-5, 1e-4)
    batch["mask"][:] = False
    loss, metrics, grads = run(gbc, batch, cfg, None, 1.0, backend)
    assert float(loss) == 0.0
    assert all(torch.equal(gr, torch.zeros_like(gr)) for gr in grads.values())
    for k, v in metrics.items():
        assert float(v) == (1.0 if k == "phi_mean" else 0.0), k


def test_chunk_plan_keeps_sequences_whole():
    cfg = gbc.PolicyLossConfig(importance_sampling_level="sequence")
    from gbc_kernels._fused import chunk_plan
    seq = torch.repeat_interleave(torch.arange(5), torch.tensor([3, 4, 9, 2, 2]))
    plan = chunk_plan(int(seq.numel()), 6, cfg, seq)
    # [3][4] do not fit together; 9 > 6 rows: two two-sweep pieces; [2, 2] share a chunk
    assert plan == [(0, 3, 1, False), (3, 7, 1, False), (7, 13, 1, True), (13, 16, 1, True),
                    (16, 20, 2, False)]
    quant = gbc.PolicyLossConfig(top_entropy_quantile=0.5)
    assert all(two for *_, two in chunk_plan(20, 6, quant, None))
    tok = gbc.PolicyLossConfig()
    assert chunk_plan(20, 6, tok, None) == [(0, 6, 0, False), (6, 12, 0, False),
                                            (12, 18, 0, False), (18, 20, 0, False)]


@pytest.mark.parametrize("cfg, sweeps", [
    pytest.param(dict(), 1, id="ppo"),
    pytest.param(dict(importance_sampling_level="sequence"), 1, id="gspo"),
    pytest.param(dict(objective="vespo", off_policy_mask_threshold=0.1), 1, id="vespo-off-policy"),
    pytest.param(dict(top_entropy_quantile=0.5), 2, id="entropy-quantile"),
])
def test_logits_matmuls_per_chunk(monkeypatch, cfg, sweeps):
    """A sequence-dependent loss keeps one sweep (three matmuls) per chunk when its chunks hold
    whole sequences; only the batch-global quantile sweeps twice. Counted at the projection."""
    from gbc_kernels import _chunking
    from gbc_kernels._fused import chunk_plan

    calls = []
    real = _chunking.project
    monkeypatch.setattr(_chunking, "project", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("GBC_CHUNK_MB", "0.002")       # 14 rows of V = 37: whole sequences fit
    batch = make_batch(B=6, T=9, V=37, seed=4, empty_row=False)
    c = gbc.PolicyLossConfig(**cfg)
    run(gbc, batch, cfg, None, 1.0, "cpu" if gbc.backends.cpu_available() else "torch")
    m = batch["mask"].reshape(-1)
    idx = m.nonzero().squeeze(1)
    from gbc_kernels._loss_math import local_ids
    seq = local_ids(idx // 9)[0] if c.needs_sequence else None
    be = gbc.backends.get_backend("cpu" if gbc.backends.cpu_available() else "torch",
                                  torch.device("cpu"))
    rows = gbc._chunking.rows_per_chunk(idx.numel(), 37, be.bytes_per_logit(torch.float32))
    plan = chunk_plan(idx.numel(), rows, c, seq)
    assert len(plan) > 1 and not any(two for *_, two in plan if sweeps == 1)
    assert len(calls) == sweeps * len(plan)


def test_bad_combinations_name_both_options():
    with pytest.raises(ValueError, match="delta.*objective='cispo'"):
        gbc.PolicyLossConfig(objective="cispo", delta=2.0)
    with pytest.raises(ValueError, match="clip_ratio_c.*objective='sapo'"):
        gbc.PolicyLossConfig(objective="sapo", clip_ratio_c=3.0)
    with pytest.raises(ValueError, match="preset"):
        gbc.PolicyLossConfig(loss_agg="vespo")
    with pytest.raises(ValueError, match="sapo_temperature_neg"):
        gbc.PolicyLossConfig(objective="sapo", sapo_temperature_neg=0.0)
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        gbc.PolicyLossConfig(top_entropy_quantile=1.5)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        gbc.PolicyLossConfig(importance_sampling_level="seq")
    with pytest.raises(ValueError, match="entropy_agg"):
        gbc.PolicyLossConfig(entropy_agg="mean")
    batch = make_batch(seed=1)
    with pytest.raises(ValueError, match="sampling_logp.*off_policy_mask_threshold"):
        gbc.fused_linear_policy_loss(batch["hidden"], batch["weight"], batch["targets"],
                                     batch["mask"], batch["advantages"],
                                     sampling_logp=batch["old_logp"])
    bad = torch.full_like(batch["old_logp"], -1.0)
    with pytest.raises(ValueError, match="is_ratio"):
        gbc.fused_linear_policy_loss(batch["hidden"], batch["weight"], batch["targets"],
                                     batch["mask"], batch["advantages"], is_ratio=bad)
    with pytest.raises(ValueError, match="entropy: required"):
        gbc.policy_loss(batch["old_logp"], batch["mask"], batch["advantages"],
                        config=gbc.PolicyLossConfig(top_entropy_quantile=0.5))


# ----------------------------------------------------------------------------------------------
# 3. Liger-Kernel parity, ratios far from 1
# ----------------------------------------------------------------------------------------------

LIGER_CASES = [
    pytest.param("grpo", dict(importance_sampling_level="sequence"), id="gspo-grpo"),
    pytest.param("bnpo", dict(importance_sampling_level="sequence", beta=0.04,
                              use_bias_correction_kl=True), id="gspo-bnpo-kl"),
    pytest.param("dapo", dict(importance_sampling_level="sequence"), id="gspo-dapo"),
    pytest.param("cispo", dict(epsilon_high=1.2), id="cispo"),
    pytest.param("sapo", dict(sapo_temperature_pos=0.9, sapo_temperature_neg=1.2), id="sapo"),
    pytest.param("luspo", dict(importance_sampling_level="sequence"), id="luspo"),
    pytest.param("vespo", dict(), id="vespo"),
    pytest.param("vespo", dict(vllm_is_ratio=True), id="vespo-is-ratio"),
    pytest.param("dapo", dict(delta=1.2, epsilon_high=0.28), id="delta"),
    pytest.param("sapo", dict(vllm_is_ratio=True, beta=0.04), id="sapo-is-ratio-kl"),
]


@pytest.mark.parametrize("loss_type,opts", LIGER_CASES)
def test_liger_parity(backend, loss_type, opts):
    pytest.importorskip("liger_kernel")
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    B, T, H, V = 4, 10, 16, 53
    batch = make_batch(B=B, T=T, H=H, V=V, seed=zlib.crc32(f"{loss_type}{opts}".encode()) % 97,
                       old_spread=4.0, bias=False, empty_row=False)
    g = torch.Generator().manual_seed(2)
    # old log-probs spread by ~0.8 nats: every clip and gate is active
    batch["old_logp"] = (batch["old_logp"] + 0.8 * torch.randn(B, T, generator=g)).clamp(max=0)
    o = dict(opts)
    isr = None
    if o.pop("vllm_is_ratio", False):
        # exp(masked log difference), as TRL builds it: 1 on masked-out positions
        isr = torch.where(batch["mask"], torch.rand(B, T, generator=g) + 0.5, 1.0)
    beta = o.pop("beta", 0.0)
    liger = LigerFusedLinearGRPOLoss(beta=beta, compiled=False, use_ref_model=beta != 0.0,
                                     chunk_size=2, loss_type=loss_type,
                                     max_completion_length=T, **o)
    xl = leaves(batch, bias=False)
    lloss = liger(xl["hidden"], xl["weight"], batch["targets"], batch["mask"].long(),
                  batch["advantages"], ref_per_token_logps=batch["ref_logp"],
                  old_per_token_logps=batch["old_logp"], vllm_is_ratio=isr,
                  num_items_in_batch=int(batch["mask"].sum()))
    lloss = lloss[0] if isinstance(lloss, tuple) else lloss
    lloss.backward()

    cfg = gbc.PolicyLossConfig.preset(
        loss_type, kl_coef=beta, kl_ratio_correction=o.get("use_bias_correction_kl", False),
        **{k: v for k, v in o.items() if k != "use_bias_correction_kl"})
    xg = leaves(batch, bias=False)
    loss, _ = gbc.fused_linear_policy_loss(xg["hidden"], xg["weight"], batch["targets"],
                                           batch["mask"], batch["advantages"],
                                           batch["old_logp"], batch["ref_logp"] if beta else None,
                                           config=cfg, backend=backend, is_ratio=isr)
    loss.backward()
    loss, lloss = float(loss.detach()), float(lloss.detach())
    assert abs(loss - lloss) <= 1e-5 * max(1.0, abs(lloss))
    for k in ("hidden", "weight"):
        assert max_rel_err(xg[k].grad, xl[k].grad) <= 1e-4, k
    assert xg["hidden"].grad.abs().max() > 0
