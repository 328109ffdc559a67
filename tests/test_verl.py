"""The verl drop-in against verl's own registry and its vanilla PPO loss.

verl's ``compute_policy_loss_vanilla`` is the oracle: with the gbc options off our registered
loss must give its value and gradient for every ``loss_agg_mode`` and ``global_batch_info``;
AR and a Lopti phase must equal vanilla on the transformed advantages (both are advantage
multipliers, docs/math.md §2-§3).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from omegaconf import OmegaConf  # noqa: E402

from gbc_kernels.integrations import verl as gbc_verl  # noqa: E402

B, T = 5, 7


def actor_config(**info):
    return OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                             "clip_ratio_c": 3.0, "global_batch_info": info})


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 3, 0, 5, 1])                 # one empty response
    mask = torch.arange(T)[None] < lengths[:, None]
    old = -torch.rand(B, T, generator=g) * 3
    logp = (old + 0.5 * torch.randn(B, T, generator=g)).clamp(max=0)
    old[0] = -2.5 - torch.rand(T, generator=g)
    logp[0] = old[0] + 1.5                                # ratio e^1.5 > clip_ratio_c = 3 ...
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    adv[0] = -4.0                                         # ... with A < 0: the dual clip binds
    logp.requires_grad_()
    return old, logp, adv, mask


def loss_grad(fn, old, logp, adv, mask, mode, config, weights=None):
    logp = logp.detach().clone().requires_grad_()
    loss, metrics = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                       loss_agg_mode=mode, config=config, rollout_is_weights=weights)
    (loss * 1.3).backward()
    return loss.detach(), logp.grad, metrics


INFOS = [dict(), dict(dp_size=2, batch_num_tokens=37, global_batch_size=9),
         dict(dp_size=1, batch_num_tokens=20, global_batch_size=6, loss_scale_factor=11)]


@pytest.mark.parametrize("info", INFOS, ids=["local", "dp2", "scale-factor"])
@pytest.mark.parametrize("mode", gbc_verl.VERL_AGG_MODES)
def test_registered_loss_equals_verl_vanilla(mode, info):
    gbc_verl.register("gbc_test")
    fn = core_algos.get_policy_loss_fn("gbc_test")
    vanilla = core_algos.get_policy_loss_fn("vanilla")
    old, logp, adv, mask = batch(1)
    weights = 0.5 + torch.rand(B, T, generator=torch.Generator().manual_seed(2))
    for w in (None, weights):
        cfg = actor_config(**info)
        want = loss_grad(vanilla, old, logp, adv, mask, mode, cfg, w)
        got = loss_grad(fn, old, logp, adv, mask, mode, actor_config(**info), w)
        assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-7), (got[0], want[0])
        assert torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-7)
        for k in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
            assert abs(got[2][k] - want[2][k]) < 1e-6, k
    assert want[2]["actor/pg_clipfrac"] > 0 and want[2]["actor/pg_clipfrac_lower"] > 0


def test_ar_and_lopti_phase_are_advantage_transforms():
    opts = gbc_verl.register("gbc_ar_lopti", ar_alpha=0.3, lopti_eta=0.4)
    fn = core_algos.get_policy_loss_fn("gbc_ar_lopti")
    vanilla = core_algos.get_policy_loss_fn("vanilla")
    old, logp, adv, mask = batch(3)
    p_old = old.exp()
    ar_adv = adv * (0.3 * p_old + 0.7)
    low = p_old < 0.4
    for phase, sel in (("low", low), ("high", ~low)):
        with opts.phase(phase):
            got = loss_grad(fn, old, logp, adv, mask, "token-mean", actor_config())
        want = loss_grad(vanilla, old, logp, ar_adv * sel, mask, "token-mean", actor_config())
        assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-7)
        assert torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-7)
    assert opts.current_phase is None


def test_scale_advantages_and_weighted_kl():
    old, logp, adv, mask = batch(4)
    scale = torch.rand(B, T)
    assert torch.equal(gbc_verl.scale_advantages(adv, scale), adv * scale)
    ref = old - 0.1
    w = torch.rand(B, T)
    kl = gbc_verl.weighted_kl_penalty(logp, ref, w, "low_var_kl")
    assert torch.allclose(kl, core_algos.kl_penalty(logp, ref, "low_var_kl") * w)
    with pytest.raises(ValueError, match="token_scale"):
        gbc_verl.scale_advantages(adv, scale[:, :3])
    with pytest.raises(ValueError, match="kl_weight"):
        gbc_verl.weighted_kl_penalty(logp, ref, w[:2], "k2")


def test_bad_arguments_raise():
    opts = gbc_verl.register("gbc_bad")
    fn = core_algos.get_policy_loss_fn("gbc_bad")
    old, logp, adv, mask = batch(5)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        fn(old, logp, adv, mask, "seq-mean", actor_config())
    with pytest.raises(ValueError, match="batch_num_tokens"):
        fn(old, logp, adv, mask, "token-mean", actor_config(dp_size=2))
    with pytest.raises(ValueError, match="lopti_eta"):
        with opts.phase("low"):
            pass
    with pytest.raises(ValueError, match="ar_alpha"):
        gbc_verl.register("gbc_bad2", ar_alpha=2.0)


def test_errors_name_verls_arguments():
    """The registered loss reports gbc's checks under verl's argument names (``old_log_prob``,
    ``rollout_is_weights``; gbc calls them ``old_logp``, ``is_ratio``), at the index verl
    passed, and computes nothing (no gradient)."""
    gbc_verl.register("gbc_names")
    fn = core_algos.get_policy_loss_fn("gbc_names")
    old, logp, adv, mask = batch(6)
    bad_old = old.clone()
    bad_old[3, 2] = float("inf")                  # masked in (row 3 has 5 tokens)
    with pytest.raises(ValueError) as info:
        fn(bad_old, logp, adv, mask, "token-mean", actor_config())
    assert str(info.value) == ("old_log_prob: expected finite values on masked-in positions, "
                               "got inf at index [3, 2]")
    weights = torch.ones(B, T)
    weights[1, 0] = -1.0
    with pytest.raises(ValueError, match=r"^rollout_is_weights: expected importance weights "
                                         r">= 0 on masked-in positions, got -1.0 at index "
                                         r"\[1, 0\]$"):
        fn(old, logp, adv, mask, "token-mean", actor_config(), weights)
    assert logp.grad is None


AR_KEYS = {"actor/gbc_ar_weight_mean"}
LOPTI_KEYS = {"actor/gbc_low_frac"}         # the registered loss sees no grad_share_low (no sum_p2)


def test_registered_loss_logs_a_methods_metrics_only_when_it_runs():
    """gbc's AR / Lopti metrics are logged only where the method runs (a logged metric reads
    as its method on): none with both off, AR's with ``ar_alpha``, Lopti's with ``lopti_eta``
    (in each phase)."""
    old, logp, adv, mask = batch(7)
    for name, kw, want in (("gbc_metrics_off", {}, set()),
                           ("gbc_metrics_ar", dict(ar_alpha=0.3), AR_KEYS),
                           ("gbc_metrics_lopti", dict(lopti_eta=0.4), LOPTI_KEYS),
                           ("gbc_metrics_both", dict(ar_alpha=0.3, lopti_eta=0.4),
                            AR_KEYS | LOPTI_KEYS)):
        opts = gbc_verl.register(name, **kw)
        fn = core_algos.get_policy_loss_fn(name)
        for phase in opts.phases:                  # (None,) without Lopti
            with opts.phase(phase) if phase else contextlib.nullcontext():
                metrics = fn(old, logp, adv, mask, "token-mean", actor_config())[-1]
            assert set(metrics) & (AR_KEYS | LOPTI_KEYS) == want, (name, phase, sorted(metrics))
            assert "actor/pg_clipfrac" in metrics
