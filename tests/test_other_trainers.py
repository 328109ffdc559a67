"""The objectives of verl, OpenRLHF and the other trainers (docs/math.md §12).

1. verl 0.9.1's own functions are the oracle: its registered policy losses, ``kl_penalty`` and
   ``agg_loss`` (imported from the installed package), composed as its ``ppo_loss`` composes
   them, against ``gbc.policy_loss`` and ``gbc_reference.policy_loss`` on the same float64
   log-probs, with the config from ``integrations.verl.policy_loss_config``: each loss mode x
   each ``loss_agg_mode``, global batch info on and off, KL and entropy on; the loss and the
   gradients in the log-probs and the entropy.
2. OpenRLHF 0.11.2's KL (``compute_approx_kl``, written out here from its source: the package
   itself needs flash-attn to import) against the reference.
3. every backend against the float64 reference for every new option: fp32 and bf16, odd V,
   chunk schedules that cut and keep sequences, empty rows, random upstream gradients.
4. bad combinations refused, naming both options.
"""

from __future__ import annotations

import zlib

import pytest
import torch

import gbc_kernels as gbc
import gbc_reference as ref
from conftest import as64, make_batch
from test_objectives import chunking, run  # noqa: F401  (the chunk-schedule fixture)
from test_policy_loss import check_against, check_bf16

# ----------------------------------------------------------------------------------------------
# 3. every backend against the reference
# ----------------------------------------------------------------------------------------------

NEW_CASES = [
    pytest.param(dict(objective="cispo", epsilon_high=1.2, cispo_min=0.8), None,
                 id="cispo-two-sided"),
    pytest.param(dict(objective="reinforce", kl_coef=0.05, kl_estimator="abs"), None,
                 id="reinforce-abs-kl"),
    pytest.param(dict(objective="unclipped", loss_agg="grpo"), None, id="unclipped"),
    pytest.param(dict(objective="dppo", epsilon_low=0.1, epsilon_high=0.15, clip_ratio_c=1.5),
                 None, id="dppo-tv"),
    pytest.param(dict(objective="dppo", dppo_divergence="binary_kl", epsilon_low=0.02,
                      epsilon_high=0.05, log_ratio_clamp=0.5), None, id="dppo-binary-kl"),
    pytest.param(dict(objective="gmpo", epsilon_low=0.3, epsilon_high=0.3, loss_agg="grpo"),
                 None, id="gmpo"),
    pytest.param(dict(objective="gmpo", epsilon_low=0.2, epsilon_high=0.4, kl_coef=0.05,
                      loss_agg="token-mean"), None, id="gmpo-token-mean-kl"),
    pytest.param(dict(importance_sampling_level="sequence_token", epsilon_high=0.28), None,
                 id="gspo-token"),
    pytest.param(dict(importance_sampling_level="sequence_token", objective="cispo",
                      epsilon_high=1.3, cispo_min=0.9, loss_agg="grpo"), None,
                 id="gspo-token-cispo"),
    pytest.param(dict(objective="reinforce", log_ratio_penalty=0.3), None, id="dro"),
    pytest.param(dict(log_ratio_clamp=0.3, clip_ratio_c=3.0), None, id="log-ratio-clamp"),
    pytest.param(dict(kl_coef=0.1, kl_estimator="low_var_kl+"), None, id="kl-k3-straight"),
    pytest.param(dict(kl_coef=0.1, kl_estimator="k1+", kl_clamp=0.5), None,
                 id="kl-k1-straight-clamp"),
    pytest.param(dict(kl_coef=0.1, kl_estimator="k2", kl_clamp=0.3), None, id="kl-k2-clamp"),
    pytest.param(dict(kl_coef=0.1, kl_estimator="k3", kl_clamp=1.0, kl_unbiased_gradient=True),
                 None, id="kl-unbiased"),
    pytest.param(dict(cov_mode="clip", cov_ratio=0.2, cov_lb=0.0, cov_ub=4.0), None,
                 id="clip-cov"),
    pytest.param(dict(objective="unclipped", cov_mode="kl", cov_ratio=0.15, cov_kl_coef=0.5),
                 None, id="kl-cov"),
    pytest.param(dict(objective="dppo", ar_alpha=0.3, lopti_eta=0.5, kl_coef=0.05,
                      kl_estimator="k3+", entropy_coef=0.02, log_ratio_penalty=0.1,
                      temperature=0.8), "low", id="dppo-everything-low"),
    pytest.param(dict(objective="gmpo", ar_alpha=0.3, lopti_eta=0.05, kl_coef=0.05,
                      kl_agg="token-mean", entropy_coef=0.02, loss_agg="grpo"), "high",
                 id="gmpo-everything-high"),
    pytest.param(dict(objective="unclipped", cov_mode="kl", cov_ratio=0.2, ar_alpha=0.3,
                      lopti_eta=0.5, top_entropy_quantile=0.7, kl_coef=0.05), "low",
                 id="kl-cov-quantile-low"),
]


def _extras(cfg, batch, g):
    extra = {}
    if cfg.get("objective") in ("gmpo", "dppo", "reinforce"):
        extra["is_ratio"] = torch.rand(batch["mask"].shape, generator=g) + 0.5
    return extra


def _seeded(fn, *args, **kwargs):
    """Run with the default generator at a fixed state: Clip-Cov draws its tokens with
    torch.randperm, as verl does, so two runs compare the same selection."""
    state = torch.get_rng_state()
    torch.manual_seed(1234)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_rng_state(state)


@pytest.mark.parametrize("cfg,phase", NEW_CASES)
def test_fp32_matches_float64_reference(backend, cfg, phase, chunking):
    seed = zlib.crc32(str(cfg).encode()) % 1000
    batch = make_batch(B=5, T=9, V=37, seed=seed, old_spread=4.0, adv_shape="BT")
    g = torch.Generator().manual_seed(seed)
    batch["token_scale"] = torch.rand(batch["mask"].shape, generator=g) + 0.25
    batch["kl_weight"] = torch.rand(batch["mask"].shape, generator=g)
    extra = _extras(cfg, batch, g)
    up = float(torch.randn((), generator=g))
    out = _seeded(run, gbc, batch, cfg, phase, up, backend, extra)
    truth = _seeded(run, ref, as64(batch), cfg, phase, up,
                    extra={k: v.double() for k, v in extra.items()})
    check_against(out, truth, 1e-5, 1e-4)
    assert any(float(v.abs().max()) > 0 for v in out[2].values())


@pytest.mark.parametrize("cfg,phase", [NEW_CASES[3], NEW_CASES[5], NEW_CASES[7], NEW_CASES[15]])
def test_bf16_odd_vocab(backend, cfg, phase, chunking):
    """bf16 storage, V = 131: within bf16's error of float64."""
    batch = make_batch(B=4, T=16, H=64, V=131, dtype=torch.bfloat16, seed=17, old_spread=4.0)
    out = _seeded(run, gbc, batch, cfg, phase, 0.8, backend)
    truth = _seeded(run, ref, as64(batch), cfg, phase, 0.8)
    check_bf16(out, truth, 2e-2, 5e-2)


@pytest.mark.parametrize("cfg", [NEW_CASES[i][0][0] for i in (0, 3, 5, 7, 9, 15, 16)],
                         ids=["cispo", "dppo", "gmpo", "gspo-token", "dro", "clip-cov",
                              "kl-cov"])
def test_empty_rows(backend, cfg, chunking):
    """Empty rows among full ones (garbage there must not leak), and an all-zero mask: zero
    loss and gradients, metrics 0."""
    batch = make_batch(B=5, T=9, V=37, seed=3, old_spread=4.0)
    batch["mask"][3] = False
    batch["old_logp"][3] = float("nan")
    truth = _seeded(run, ref, as64(batch), cfg, None, 1.0)
    out = _seeded(run, gbc, batch, cfg, None, 1.0, backend)
    batch["old_logp"][3] = 0.0
    check_against(out, truth, 1e-5, 1e-4)
    batch["mask"][:] = False
    loss, metrics, grads = run(gbc, batch, cfg, None, 1.0, backend)
    assert float(loss) == 0.0
    assert all(torch.equal(gr, torch.zeros_like(gr)) for gr in grads.values())
    assert all(float(v) == 0.0 for v in metrics.values())
