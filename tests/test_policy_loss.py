"""The fused GRPO loss (every backend) against gbc_reference and float64, option by option."""

from __future__ import annotations

import zlib

import pytest
import torch

import gbc_kernels as gbc
import gbc_reference as ref
from conftest import BACKENDS, as64, leaves, make_batch, max_rel_err

LOSS_ARGS = ("old_logp", "ref_logp", "token_scale", "kl_weight")

CASES = [
    pytest.param(dict(), None, id="token-mean"),
    pytest.param(dict(loss_agg="seq-mean-token-mean"), None, id="seq-mean-token-mean"),
    pytest.param(dict(loss_agg="seq-mean-token-sum"), None, id="seq-mean-token-sum"),
    pytest.param(dict(loss_agg="seq-mean-token-sum-norm", max_len=11), None, id="sum-norm"),
    pytest.param(dict(kl_coef=0.1, kl_estimator="k1"), None, id="kl-k1"),
    pytest.param(dict(kl_coef=0.1, kl_estimator="k2"), None, id="kl-k2"),
    pytest.param(dict(kl_coef=0.1, kl_estimator="k3"), None, id="kl-k3"),
    pytest.param(dict(kl_coef=0.1, kl_estimator="low_var_kl"), None, id="kl-low_var"),
    pytest.param(dict(kl_coef=0.1, kl_estimator="k3", kl_ratio_correction=True), None,
                 id="kl-k3-ratio-corrected"),
    pytest.param(dict(ar_alpha=0.3), None, id="ar"),
    pytest.param(dict(lopti_eta=0.5), "low", id="lopti-low"),
    pytest.param(dict(lopti_eta=0.5), "high", id="lopti-high"),
    pytest.param(dict(clip_ratio_c=1.5, epsilon_low=0.1, epsilon_high=0.1), None, id="dual-clip"),
    pytest.param(dict(epsilon_high=0.28), None, id="clip-higher"),
    pytest.param(dict(entropy_coef=0.05), None, id="entropy"),
    pytest.param(dict(temperature=0.7), None, id="temperature"),
    pytest.param(dict(loss_agg="grpo", kl_coef=0.05, kl_estimator="k2", entropy_coef=0.01,
                      ar_alpha=0.2, lopti_eta=0.4, clip_ratio_c=2.0, temperature=1.3,
                      epsilon_high=0.28), "high", id="everything"),
]


def run(lib, batch, cfg_kwargs, phase, upstream, backend=None, extra=None, bias=True):
    """Loss, metrics and gradients of hidden/weight/bias for loss * upstream."""
    extra = extra or {}
    x = leaves(batch, bias)
    cfg = lib.PolicyLossConfig(**cfg_kwargs)
    kw = {k: batch[k] for k in LOSS_ARGS if k in batch}
    kw.update(extra)
    if backend is not None:
        kw["backend"] = backend
    loss, metrics = lib.fused_linear_policy_loss(
        x["hidden"], x["weight"], batch["targets"], batch["mask"], batch["advantages"],
        bias=x.get("bias"), config=cfg, phase=phase, **kw)
    (loss * upstream).backward()
    grads = {k: v.grad for k, v in x.items()}
    return loss.detach(), metrics, grads


def check_against(out, truth, rtol_loss, rtol_grad):
    loss, metrics, grads = out
    tloss, tmetrics, tgrads = truth
    assert torch.isfinite(loss)
    assert abs(float(loss) - float(tloss)) <= rtol_loss * max(1.0, abs(float(tloss))), \
        (float(loss), float(tloss))
    for k, g in grads.items():
        assert torch.isfinite(g).all(), k
        assert max_rel_err(g, tgrads[k]) <= rtol_grad, (k, max_rel_err(g, tgrads[k]))
    assert set(metrics) == set(tmetrics)
    for k, v in metrics.items():
        assert v.dtype == torch.float32 and v.dim() == 0 and not v.requires_grad
        assert abs(float(v) - float(tmetrics[k])) <= 1e-4 * max(1.0, abs(float(tmetrics[k]))), k


def check_bf16(out, truth, rtol_loss, rtol_grad):
    """bf16 results against float64: the loss within rtol_loss, each gradient bf16 and within
    rtol_grad of its largest entry."""
    assert abs(float(out[0]) - float(truth[0])) <= rtol_loss * max(1.0, abs(float(truth[0])))
    for k, g in out[2].items():
        assert g.dtype == torch.bfloat16
        assert max_rel_err(g, truth[2][k]) <= rtol_grad, k


@pytest.mark.parametrize("cfg,phase", CASES)
def test_fp32_matches_float64_reference(backend, cfg, phase, small_chunks):
    # old_logp within ~0.6 nats of the policy: ratios on both sides of every clip bound
    batch = make_batch(seed=zlib.crc32(str(cfg).encode()) % 1000, old_spread=3.0)
    up = torch.randn(()).item()
    out = run(gbc, batch, cfg, phase, up, backend)
    truth = run(ref, as64(batch), cfg, phase, up)
    check_against(out, truth, 1e-5, 1e-4)
    # the reference at float32 agrees too
    check_against(run(ref, batch, cfg, phase, up), truth, 1e-5, 1e-4)


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs triton (GPU or interpreter)")
@pytest.mark.parametrize("cfg,phase", CASES)
def test_triton_three_kernel_path(monkeypatch, cfg, phase, small_chunks):
    """The Triton backend's token-local loss composed of its three kernels (statistics, token
    loss, gradient; ``launch.ONE_PASS = False``, the baseline of the one-pass row kernel that
    runs by default) against the float64 reference."""
    from gbc_kernels.triton import launch
    monkeypatch.setattr(launch, "ONE_PASS", False)
    batch = make_batch(seed=zlib.crc32(str(cfg).encode()) % 1000, old_spread=3.0)
    up = torch.randn(()).item()
    check_against(run(gbc, batch, cfg, phase, up, "triton"),
                  run(ref, as64(batch), cfg, phase, up), 1e-5, 1e-4)


@pytest.mark.parametrize("variant", ["no-bias", "adv-BT", "token_scale", "kl_weight",
                                     "num_items", "no-old_logp", "no-old-ar-lopti"])
def test_fp32_input_variants(backend, variant, small_chunks):
    batch = make_batch(seed=7, bias=variant != "no-bias", adv_shape="BT" if variant == "adv-BT"
                       else "B")
    g = torch.Generator().manual_seed(3)
    cfg, extra, phase = dict(kl_coef=0.1, kl_estimator="k2"), {}, None
    if variant == "token_scale":
        batch["token_scale"] = torch.rand(batch["mask"].shape, generator=g) + 0.25
    if variant == "kl_weight":
        batch["kl_weight"] = torch.rand(batch["mask"].shape, generator=g)
    if variant == "num_items":
        extra["num_items_in_batch"] = 40
    if variant.startswith("no-old"):
        del batch["old_logp"]
    if variant == "no-old-ar-lopti":
        cfg.update(ar_alpha=0.3, lopti_eta=0.3)
        phase = "low"
    up = 0.37
    out = run(gbc, batch, cfg, phase, up, backend, extra, bias=variant != "no-bias")
    truth = run(ref, as64(batch), cfg, phase, up, extra=extra, bias=variant != "no-bias")
    check_against(out, truth, 1e-5, 1e-4)


@pytest.mark.parametrize("cfg,phase", [CASES[0], CASES[-1]])
def test_bf16_no_worse_than_plain_pytorch(backend, cfg, phase, small_chunks):
    """bf16 inputs: our error against float64 is within 2x (+ slack) of what plain PyTorch gets
    computing the same loss with bf16 logits (what TRL does)."""
    batch = make_batch(B=4, T=16, H=64, V=131, dtype=torch.bfloat16, seed=11)
    up = 1.0
    truth = run(ref, as64(batch), cfg, phase, up)
    ours = run(gbc, batch, cfg, phase, up, backend)
    check_no_worse_than_plain_bf16(ours, truth, batch, cfg, phase, up)


def check_no_worse_than_plain_bf16(ours, truth, batch, cfg, phase, up):
    """``ours`` (bf16 inputs) against float64 ``truth``: the loss's and each gradient's error
    within 2x (+ slack) of plain PyTorch's computing the same loss with bf16 logits."""
    # plain PyTorch at bf16: bf16 logits, float32 log-softmax, same per-token loss
    x = leaves(batch)
    z = (x["hidden"] @ x["weight"].T + x["bias"]).float() / ref.PolicyLossConfig(**cfg).temperature
    lp_all = torch.log_softmax(z, -1)
    m = batch["mask"]
    safe = torch.where(m, batch["targets"], 0)
    logp = lp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    ent = -(lp_all.exp() * lp_all).sum(-1)
    kw = {k: batch[k] for k in ("old_logp", "ref_logp")}
    pl, _ = ref.policy_loss(logp, m, batch["advantages"], entropy=ent,
                            config=ref.PolicyLossConfig(**cfg), phase=phase, **kw)
    (pl * up).backward()
    plain_err = abs(float(pl.detach()) - float(truth[0]))
    assert abs(float(ours[0]) - float(truth[0])) <= 2 * plain_err + 2e-3
    for k in ("hidden", "weight", "bias"):
        e_plain = max_rel_err(x[k].grad, truth[2][k])
        e_ours = max_rel_err(ours[2][k], truth[2][k])
        assert ours[2][k].dtype == torch.bfloat16
        assert e_ours <= 2 * e_plain + 2e-2, (k, e_ours, e_plain)


@pytest.mark.parametrize("shape", [
    pytest.param((1, 1, 8, 5), id="one-token"),
    pytest.param((1, 13, 8, 257), id="one-row-V257"),
    pytest.param((5, 3, 24, 1000), id="V1000"),
    pytest.param((2, 6, 7, 2), id="V2-H7"),
])
def test_odd_sizes(backend, shape, small_chunks):
    B, T, H, V = shape
    batch = make_batch(B=B, T=T, H=H, V=V, seed=B * T + V, empty_row=False, mask_p=1.0)
    cfg = dict(kl_coef=0.1, entropy_coef=0.02, ar_alpha=0.1)
    check_against(run(gbc, batch, cfg, None, 1.3, backend),
                  run(ref, as64(batch), cfg, None, 1.3), 1e-5, 1e-4)


@pytest.mark.parametrize("agg", ["token-mean", "grpo", "seq-mean-token-sum", "dr_grpo"])
def test_all_zero_mask(backend, agg):
    batch = make_batch(seed=5)
    batch["mask"] = torch.zeros_like(batch["mask"])
    batch["targets"][:] = -1                 # anything goes where m = 0
    batch["old_logp"][:] = float("nan")      # masked-out garbage must not leak
    cfg = dict(loss_agg=agg, max_len=9, kl_coef=0.1, entropy_coef=0.1)
    loss, metrics, grads = run(gbc, batch, cfg, None, 1.0, backend)
    assert float(loss) == 0.0
    for g in grads.values():
        assert torch.equal(g, torch.zeros_like(g))
    for v in metrics.values():
        assert torch.isfinite(v) and float(v) == 0.0


def test_masked_out_garbage_does_not_leak(backend):
    batch = make_batch(seed=9)
    m = batch["mask"]
    clean = run(gbc, batch, dict(kl_coef=0.1), None, 1.0, backend)
    for k in ("old_logp", "ref_logp", "advantages"):
        if batch[k].dim() == 2:
            batch[k] = torch.where(m, batch[k], torch.full_like(batch[k], float("inf")))
    dirty = run(gbc, batch, dict(kl_coef=0.1), None, 1.0, backend)
    assert torch.equal(clean[0], dirty[0])
    for k in clean[2]:
        assert torch.equal(clean[2][k], dirty[2][k])


def test_noncontiguous_inputs(backend):
    batch = make_batch(B=3, T=10, H=16, V=29, seed=2)
    nc = dict(batch)
    nc["hidden"] = batch["hidden"].transpose(0, 1).contiguous().transpose(0, 1)
    nc["weight"] = batch["weight"].t().contiguous().t()
    big = torch.randn(3, 20)
    big[:, ::2] = batch["old_logp"]
    nc["old_logp"] = big[:, ::2]
    a = run(gbc, batch, {}, None, 1.0, backend)
    b = run(gbc, nc, {}, None, 1.0, backend)
    assert torch.allclose(a[0], b[0], rtol=1e-6, atol=1e-7)
    for k in a[2]:
        assert torch.allclose(a[2][k], b[2][k], rtol=1e-5, atol=1e-6)


def test_policy_loss_from_logp_matches_reference():
    """gbc.policy_loss (analytic derivative) == reference autograd, gradient into logp and
    entropy, every option on."""
    batch = make_batch(seed=21)
    cfg = dict(loss_agg="seq-mean-token-mean", kl_coef=0.1, kl_estimator="low_var_kl",
               entropy_coef=0.03, ar_alpha=0.3, clip_ratio_c=3.0)
    g = torch.Generator().manual_seed(0)
    logp0 = (batch["old_logp"] + 0.3 * torch.randn(batch["old_logp"].shape, generator=g)).double()
    ent0 = torch.rand(logp0.shape, generator=g, dtype=torch.float64) * 3
    for phase in (None, "low", "high"):
        outs = []
        for lib in (gbc, ref):
            lp = logp0.clone().requires_grad_(True)
            en = ent0.clone().requires_grad_(True)
            loss, metrics = lib.policy_loss(lp, batch["mask"], batch["advantages"].double(),
                                            batch["old_logp"].double(), batch["ref_logp"].double(),
                                            entropy=en, phase=phase,
                                            # Lopti off for the phase-less call
                                            config=lib.PolicyLossConfig(
                                                **cfg, lopti_eta=0.5 if phase else None))
            (loss * 0.7).backward()
            outs.append((loss.detach(), lp.grad, en.grad, metrics))
        assert torch.allclose(outs[0][0], outs[1][0], rtol=1e-12, atol=1e-12)
        assert torch.allclose(outs[0][1], outs[1][1], rtol=1e-10, atol=1e-12)
        assert torch.allclose(outs[0][2], outs[1][2], rtol=1e-10, atol=1e-12)
        for k, v in outs[1][3].items():
            assert abs(float(outs[0][3][k]) - float(v)) < 1e-6, k


def test_module_wrapper_equals_function():
    batch = make_batch(seed=4)
    cfg = gbc.PolicyLossConfig(kl_coef=0.1)
    mod = gbc.FusedLinearPolicyLoss(cfg, backend="torch")
    a, _ = mod(batch["hidden"], batch["weight"], batch["targets"], batch["mask"],
               batch["advantages"], batch["old_logp"], batch["ref_logp"], bias=batch["bias"])
    b, _ = gbc.fused_linear_policy_loss(batch["hidden"], batch["weight"], batch["targets"],
                                        batch["mask"], batch["advantages"], batch["old_logp"],
                                        batch["ref_logp"], bias=batch["bias"], config=cfg,
                                        backend="torch")
    assert torch.equal(a, b)


@pytest.mark.parametrize("cfg", [dict(), dict(importance_sampling_level="sequence",
                                              entropy_coef=0.01)], ids=["token", "sequence"])
def test_token_out_sum_p2_is_the_row_passes(backend, cfg):
    """token_out["sum_p2"]: Σ_v p_v² of each masked token from the loss's own row passes
    (one- and two-sweep chunks), 0 elsewhere, against float64 full logits."""
    batch = make_batch(seed=17)
    batch["mask"][1] = False                                       # an empty row
    tok = {}
    gbc.fused_linear_policy_loss(batch["hidden"], batch["weight"], batch["targets"],
                                 batch["mask"], batch["advantages"], batch["old_logp"],
                                 bias=batch["bias"], config=gbc.PolicyLossConfig(**cfg),
                                 backend=backend, token_out=tok)
    b = as64(batch)
    p = torch.softmax(b["hidden"] @ b["weight"].T + b["bias"], -1)
    want = torch.where(b["mask"].bool(), (p * p).sum(-1), 0.0)
    assert tok["sum_p2"].dtype == torch.float32
    assert torch.allclose(tok["sum_p2"].double(), want, rtol=1e-5, atol=1e-7)


def test_policy_loss_from_logp_reports_grad_share_low_with_sum_p2():
    """With ``sum_p2`` (and the temperature), ``policy_loss`` on per-token log-probs reports the
    fused loss's ``grad_share_low`` and ``grad_norm_sum`` (docs/math.md §6): against the
    float64 reference's fused loss on the same hidden states, a per-sequence temperature, Lopti's
    low phase and an empty row."""
    batch = make_batch(seed=8)
    temp = torch.tensor([0.7, 1.0, 1.3, 0.9])[:batch["mask"].shape[0]]
    cfg = dict(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.02, ar_alpha=0.3, lopti_eta=0.4)
    d = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
         for k, v in batch.items()}
    _, want = ref.fused_linear_policy_loss(
        d["hidden"], d["weight"], d["targets"], d["mask"], d["advantages"], d["old_logp"],
        d["ref_logp"], d["bias"], config=ref.PolicyLossConfig(**cfg), phase="low",
        temperature=temp.double())
    assert not bool(batch["mask"].any(-1).all())          # make_batch leaves a row empty
    ids = torch.where(batch["mask"].bool(), batch["targets"], 0)    # -100 off the mask
    for lib, dt in ((gbc, torch.float32), (ref, torch.float64)):
        lp, ent, p2 = gbc.fused_linear_logprobs(
            batch["hidden"].to(dt), batch["weight"].to(dt), ids,
            batch["bias"].to(dt), temperature=temp.to(dt), return_entropy=True,
            return_sum_p2=True)
        _, got = lib.policy_loss(lp.to(dt), batch["mask"], batch["advantages"].to(dt),
                                 batch["old_logp"].to(dt), batch["ref_logp"].to(dt),
                                 entropy=ent.to(dt), config=lib.PolicyLossConfig(**cfg),
                                 phase="low", sum_p2=p2.to(dt), temperature=temp.to(dt))
        for k in ("grad_share_low", "grad_norm_sum"):
            assert abs(float(got[k]) - float(want[k])) < 1e-5 * max(1.0, abs(float(want[k]))), \
                (lib.__name__, k)
    _, without = gbc.policy_loss(lp.float(), batch["mask"], batch["advantages"],
                                 batch["old_logp"], batch["ref_logp"],
                                 config=gbc.PolicyLossConfig(**cfg),
                                 phase="low", entropy=ent.float())
    assert "grad_share_low" not in without
    with pytest.raises(ValueError, match="^temperature: .*sum_p2"):    # it would have no effect
        gbc.policy_loss(lp.float(), batch["mask"], batch["advantages"], batch["old_logp"],
                        batch["ref_logp"], config=gbc.PolicyLossConfig(**cfg), phase="low",
                        entropy=ent.float(), temperature=temp)


# token_count / seq_count (verl's and OpenRLHF's counts): each aggregation mode; terms with
# their own aggregation (KL, the entropy bonus over an entropy quantile, whose mask has empty
# rows) count with them too
COUNTS = [
    pytest.param(dict(token_count=1.0), id="token_count-1"),
    pytest.param(dict(token_count=6.5), id="token_count-6.5"),
    pytest.param(dict(seq_count="nonempty"), id="nonempty"),
    pytest.param(dict(token_count=3.0, seq_count="nonempty", kl_coef=0.1, kl_estimator="k3",
                      kl_agg="seq-mean-token-sum", entropy_coef=0.05, entropy_agg="token-mean",
                      top_entropy_quantile=0.5), id="both-own-terms"),
    pytest.param(dict(seq_count="nonempty", kl_coef=0.1, kl_agg="token-mean",
                      entropy_coef=0.05, entropy_agg="seq-mean-token-mean",
                      top_entropy_quantile=0.3), id="nonempty-own-terms"),
]
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("counts", COUNTS)
def test_counts_match_float64_reference(backend, counts, agg, dtype, small_chunks):
    """``token_count`` and ``seq_count`` against gbc_reference in float64: loss, metrics and
    the gradients of hidden, weight and bias (bf16 inputs: no worse than plain PyTorch's bf16
    head), with an empty row (and rows without a token above the entropy quantile); a random
    upstream gradient."""
    cfg = dict(counts, loss_agg=agg, max_len=11)
    batch = make_batch(seed=zlib.crc32(str(cfg).encode()) % 1000, old_spread=3.0, dtype=dtype)
    assert not batch["mask"].any(-1).all()          # an empty row: "nonempty" counts fewer
    up = torch.randn(()).item()
    truth = run(ref, as64(batch), cfg, None, up)
    out = run(gbc, batch, cfg, None, up, backend)
    if dtype == torch.float32:
        check_against(out, truth, 1e-5, 1e-4)
    else:
        check_no_worse_than_plain_bf16(out, truth, batch, cfg, None, up)
