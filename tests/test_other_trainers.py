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
from test_objectives import check_empty_rows, chunking, run  # noqa: F401  (chunking: a fixture)
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
    pytest.param(dict(kl_coef=0.1, kl_estimator="k3", kl_log_ratio_clamp=0.6, kl_clamp=0.5),
                 None, id="kl-nemo-rl-clamps"),
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


def _case(name):
    return next(c for c in NEW_CASES if c.id == name)


@pytest.mark.parametrize("cfg,phase", [_case(n) for n in ("dppo-tv", "gmpo", "gspo-token",
                                                          "clip-cov")])
def test_bf16_odd_vocab(backend, cfg, phase, chunking):
    """bf16 storage, V = 131: within bf16's error of float64."""
    batch = make_batch(B=4, T=16, H=64, V=131, dtype=torch.bfloat16, seed=17, old_spread=4.0)
    out = _seeded(run, gbc, batch, cfg, phase, 0.8, backend)
    truth = _seeded(run, ref, as64(batch), cfg, phase, 0.8)
    check_bf16(out, truth, 2e-2, 5e-2)


@pytest.mark.parametrize("cfg", [_case(n).values[0] for n in (
    "cispo-two-sided", "dppo-tv", "gmpo", "gspo-token", "dro", "clip-cov", "kl-cov")],
                         ids=["cispo", "dppo", "gmpo", "gspo-token", "dro", "clip-cov",
                              "kl-cov"])
def test_empty_rows(backend, cfg, chunking):
    """Empty rows among full ones (garbage there must not leak), and an all-zero mask: zero
    loss and gradients, metrics 0."""
    check_empty_rows(cfg, backend, _seeded)


# ----------------------------------------------------------------------------------------------
# 1. verl 0.9.1's own functions
# ----------------------------------------------------------------------------------------------

VERL_MODES = ["vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov",
              "geo_mean", "dro", "cispo"]
VERL_AGGS = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm"]


def verl_actor_config(mode, agg, kl_type=None, entropy_coeff=0.0, **over):
    """verl's own ActorConfig (its dataclass, validated by verl)."""
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig as VerlPLC

    pl = dict(loss_mode=mode, clip_cov_ratio=0.2, clip_cov_lb=0.0, clip_cov_ub=4.0,
              kl_cov_ratio=0.15, ppo_kl_coef=0.5, dro_beta=0.3 if mode == "dro" else None)
    kw = dict(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2,
              policy_loss=VerlPLC(**pl), loss_agg_mode=agg, clip_ratio=0.2,
              clip_ratio_low=0.15 if mode.startswith("dppo") else 0.2,
              clip_ratio_high=0.25 if not mode.startswith("dppo") else 0.3,
              clip_ratio_c=2.5, tau_pos=0.9, tau_neg=1.2, entropy_coeff=entropy_coeff,
              use_kl_loss=kl_type is not None, kl_loss_type=kl_type or "low_var_kl",
              kl_loss_coef=0.07)
    kw.update(over)
    return ActorConfig(**kw)


def verl_ppo_loss(cfg, log_prob, entropy, old, adv, mask, refl, is_w, info):
    """verl's ppo_loss (verl/workers/utils/losses.py) on padded tensors: its registered policy
    loss, then its entropy and KL terms through its agg_loss, with the global batch info."""
    from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, kl_penalty

    cfg.global_batch_info.clear()
    cfg.global_batch_info.update(dp_size=info.get("dp_size", 1),
                                 batch_num_tokens=info.get("batch_num_tokens"),
                                 global_batch_size=info.get("global_batch_size"),
                                 loss_scale_factor=cfg.loss_scale_factor)
    pg_loss, _ = get_policy_loss_fn(cfg.policy_loss.loss_mode)(
        old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask,
        loss_agg_mode=cfg.loss_agg_mode, config=cfg, rollout_is_weights=is_w)
    loss = pg_loss
    if entropy is not None:
        loss = loss - cfg.entropy_coeff * agg_loss(entropy, mask, cfg.loss_agg_mode,
                                                   **cfg.global_batch_info)
    if cfg.use_kl_loss:
        kld = kl_penalty(logprob=log_prob, ref_logprob=refl, kl_penalty=cfg.kl_loss_type)
        loss = loss + cfg.kl_loss_coef * agg_loss(kld, mask, cfg.loss_agg_mode,
                                                  **cfg.global_batch_info)
    return loss


def _verl_batch(seed, B=6, T=10):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.75
    mask[2] = False                                       # an empty response
    mask[0, :] = True
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3.0 - 0.02
    logp = (old + 0.35 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    refl = (old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(B, generator=g, dtype=torch.float64)[:, None].expand(B, T).contiguous()
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 2.0
    is_w = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5
    return dict(mask=mask, old=old, logp=logp, ref=refl, adv=adv, ent=ent, is_w=is_w)


VERL_CASES = [pytest.param(mode, agg, id=f"{mode}-{agg}") for mode in VERL_MODES
              for agg in VERL_AGGS]


def _gbc_verl(lib, cfg_verl, b, lp, en, info, with_is):
    from gbc_kernels.integrations import verl as gv

    T = b["mask"].shape[1]
    cfg = gv.policy_loss_config(cfg_verl, response_length=T)
    want_entropy = cfg.wants_entropy
    if lib is ref:
        cfg = ref.PolicyLossConfig(**{k: getattr(cfg, k) for k in
                                      ref.PolicyLossConfig.__dataclass_fields__})
    norms = gv.batch_normalisers(cfg_verl, b["mask"], info)
    return lib.policy_loss(lp, b["mask"], b["adv"], b["old"], b["ref"] if cfg.kl_coef else None,
                           entropy=en if want_entropy else None, config=cfg,
                           is_ratio=b["is_w"] if with_is else None, **norms)[0]


def _compare_with_verl(cfg_verl, b, info, with_is, tol=1e-10):
    pytest.importorskip("verl")
    outs = []
    for which in ("verl", "ref", "gbc"):
        lp = b["logp"].clone().requires_grad_(True)
        en = b["ent"].clone().requires_grad_(True)
        if which == "verl":        # clip_cov draws its tokens: every run from the same state
            loss = _seeded(verl_ppo_loss, cfg_verl, lp, en if cfg_verl.entropy_coeff else None,
                           b["old"], b["adv"], b["mask"], b["ref"],
                           b["is_w"] if with_is else None, info)
        else:
            loss = _seeded(_gbc_verl, ref if which == "ref" else gbc, cfg_verl, b, lp, en, info,
                           with_is)
        (loss * 0.7).backward()
        m = b["mask"]
        outs.append((float(loss.detach()), torch.where(m, lp.grad, 0.0),
                     torch.where(m, en.grad if en.grad is not None else torch.zeros_like(en),
                                 0.0)))
    (l0, g0, e0) = outs[0]
    assert g0.abs().max() > 0
    for l1, g1, e1 in outs[1:]:
        assert abs(l0 - l1) <= tol * max(1.0, abs(l0)), (l0, l1)
        assert torch.allclose(g0, g1, rtol=1e-8, atol=1e-12), (g0 - g1).abs().max()
        assert torch.allclose(e0, e1, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("mode,agg", VERL_CASES)
def test_verl_loss_modes(mode, agg):
    """Each of verl's registered losses x each loss_agg_mode, one process, no global info: its
    ppo_loss (with its KL, low_var_kl, and its entropy term) equals gbc's from the mapping."""
    b = _verl_batch(zlib.crc32(f"{mode}{agg}".encode()) % 1000)
    if mode == "geo_mean" and agg.startswith("seq-mean"):
        cfg = verl_actor_config(mode, agg)               # no KL / entropy: expressible
        with pytest.raises(ValueError, match="loss_agg_mode.*geo_mean"):
            from gbc_kernels.integrations import verl as gv
            gv.policy_loss_config(verl_actor_config(mode, agg, "k1"), response_length=10)
    else:
        cfg = verl_actor_config(mode, agg, "low_var_kl", entropy_coeff=0.03)
    _compare_with_verl(cfg, b, {}, with_is=mode in ("vanilla", "sapo", "geo_mean", "dro"))



@pytest.mark.parametrize("kl_type", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+",
                                     "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"])
def test_verl_kl_penalty_variants(kl_type):
    """verl's kl_penalty, one variant at a time (its straight-through '+' forms included), with
    log-ratios past the low_var_kl clamp on a few tokens."""
    b = _verl_batch(zlib.crc32(kl_type.encode()) % 1000)
    b["ref"][1, :3] = b["logp"][1, :3] - 12.0             # k3 beyond its +-10 clamp
    _compare_with_verl(verl_actor_config("vanilla", "token-mean", kl_type), b, {}, False)


@pytest.mark.parametrize("mode", VERL_MODES)
@pytest.mark.parametrize("agg,info", [
    ("token-mean", dict(dp_size=2, batch_num_tokens=70, global_batch_size=14)),
    ("token-sum", dict(dp_size=4, batch_num_tokens=130, global_batch_size=22)),
    ("seq-mean-token-mean", dict(dp_size=2, batch_num_tokens=70, global_batch_size=16)),
    ("seq-mean-token-sum-norm", dict(dp_size=2, batch_num_tokens=70, global_batch_size=16,
                                     lsf=7)),
], ids=["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_verl_global_batch_info(mode, agg, info):
    """verl's global_batch_info (dp_size, batch_num_tokens, global_batch_size,
    loss_scale_factor), its rollout_is_weights, KL (k3+) and entropy: the normalisers of every
    term through ``batch_normalisers``."""
    info = dict(info)
    lsf = info.pop("lsf", None)
    b = _verl_batch(zlib.crc32(f"{mode}{agg}gbi".encode()) % 1000)
    kl = ("k3+", 0.02) if not (mode == "geo_mean" and agg.startswith("seq")) else (None, 0.0)
    cfg = verl_actor_config(mode, agg, kl[0], entropy_coeff=kl[1], loss_scale_factor=lsf)
    _compare_with_verl(cfg, b, info, with_is=True)


def test_verl_refusals():
    """A verl option gbc cannot honour is refused, naming it; never a silent change."""
    from gbc_kernels.integrations import verl as gv

    with pytest.raises(ValueError, match="policy_loss.loss_mode.*bypass_mode"):
        gv.policy_loss_config(verl_actor_config("bypass_mode", "token-mean"))
    with pytest.raises(ValueError, match="policy_loss.dro_beta"):
        gv.policy_loss_config({"policy_loss": {"loss_mode": "dro"}})
    with pytest.raises(ValueError, match="kl_loss_type.*'full'"):
        gv.policy_loss_config({"use_kl_loss": True, "kl_loss_type": "full"})
    with pytest.raises(ValueError, match="response_length"):
        gv.policy_loss_config({"loss_agg_mode": "seq-mean-token-sum-norm"})
    with pytest.raises(ValueError, match="loss_agg_mode"):
        gv.policy_loss_config({"loss_agg_mode": "mean"})
    with pytest.raises(ValueError, match="batch_num_tokens"):
        gv.batch_normalisers({}, torch.ones(2, 3, dtype=torch.bool), {"dp_size": 2})
    with pytest.raises(ValueError, match="global_batch_size"):
        gv.batch_normalisers({"loss_agg_mode": "seq-mean-token-mean"},
                             torch.ones(2, 3, dtype=torch.bool), {"dp_size": 2})


# ----------------------------------------------------------------------------------------------
# 2. OpenRLHF 0.11.2's KL estimators
# ----------------------------------------------------------------------------------------------


def openrlhf_approx_kl(log_probs, log_probs_base, log_probs_old, kl_estimator, unbiased):
    """openrlhf/models/utils.py compute_approx_kl (0.11.2), line by line."""
    log_ratio = log_probs - log_probs_base
    if kl_estimator == "k1":
        value = log_ratio
    elif kl_estimator == "k2":
        value = log_ratio ** 2 / 2.0
    else:
        k3_log_ratio = log_ratio.clamp(min=-10)
        value = (-k3_log_ratio).exp() - 1 + k3_log_ratio
    value = value.clamp(min=-10, max=10)
    if not unbiased:
        return value
    w = (log_probs - log_probs_old).exp().clamp(max=10.0).detach()
    surrogate = w * (log_ratio ** 2 / 2.0)
    return value.detach() + surrogate - surrogate.detach()


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
@pytest.mark.parametrize("unbiased", [False, True], ids=["plain", "unbiased-gradient"])
def test_openrlhf_kl(est, unbiased):
    """OpenRLHF's clamped estimators (kl_clamp=10) and its unbiased_gradient, as the KL term of
    a token-mean loss, against gbc_reference and gbc.policy_loss: loss and gradient, with
    log-ratios past both clamps."""
    b = _verl_batch(zlib.crc32(f"orl{est}{unbiased}".encode()) % 1000)
    b["ref"][1, :2] = b["logp"][1, :2] - 11.0
    b["ref"][0, :2] = (b["logp"][0, :2] + 4.5).clamp(max=-1e-3)
    m = b["mask"]
    outs = []
    for which in ("openrlhf", "ref", "gbc"):
        lp = b["logp"].clone().requires_grad_(True)
        if which == "openrlhf":
            kl = openrlhf_approx_kl(lp, b["ref"], b["old"], est, unbiased)
            loss = 0.1 * (kl * m).sum() / m.sum()
        else:
            lib = ref if which == "ref" else gbc
            cfg = lib.PolicyLossConfig(objective="reinforce", kl_coef=0.1, kl_estimator=est,
                                       kl_clamp=10.0, kl_unbiased_gradient=unbiased)
            zero = torch.zeros_like(b["adv"])      # the KL term alone
            loss = lib.policy_loss(lp, m, zero, b["old"], b["ref"], config=cfg)[0]
        loss.backward()
        outs.append((float(loss.detach()), torch.where(m, lp.grad, 0.0)))
    assert outs[0][1].abs().max() > 0
    for loss, grad in outs[1:]:
        assert abs(loss - outs[0][0]) <= 1e-12
        assert torch.allclose(grad, outs[0][1], rtol=1e-10, atol=1e-14)


# ----------------------------------------------------------------------------------------------
# 4. bad combinations
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    (dict(cispo_min=0.8), "cispo_min.*objective='ppo_clip'"),
    (dict(objective="cispo", epsilon_high=1.2, cispo_min=1.5), "cispo_min.*epsilon_high"),
    (dict(dppo_divergence="binary_kl"), "dppo_divergence.*objective='ppo_clip'"),
    (dict(objective="dppo", dppo_divergence="kl"), "dppo_divergence: expected"),
    (dict(objective="gmpo", importance_sampling_level="sequence"),
     "importance_sampling_level.*objective='gmpo'"),
    (dict(objective="reinforce", importance_sampling_level="sequence_token"),
     "importance_sampling_level.*'reinforce'"),
    (dict(objective="gmpo", delta=2.0), "delta"),
    (dict(objective="sapo", clip_ratio_c=3.0), "clip_ratio_c.*objective='sapo'"),
    (dict(kl_estimator="k4"), "kl_estimator"),
    (dict(kl_estimator="low_var_kl", kl_clamp=5.0), "kl_clamp.*low_var_kl"),
    (dict(kl_estimator="low_var_kl+", kl_log_ratio_clamp=5.0), "kl_log_ratio_clamp.*low_var_kl"),
    (dict(kl_log_ratio_clamp=-1.0), "kl_log_ratio_clamp"),
    (dict(kl_estimator="k3+", kl_unbiased_gradient=True), "kl_unbiased_gradient.*k3\\+"),
    (dict(kl_ratio_correction=True, kl_estimator="k1+"), "kl_ratio_correction.*k1\\+"),
    (dict(kl_unbiased_gradient="yes"), "kl_unbiased_gradient: expected a bool"),
    (dict(normalise_all_terms=1), "normalise_all_terms: expected a bool"),
    (dict(log_ratio_clamp=0.0), "log_ratio_clamp"),
    (dict(log_ratio_clamp="20"), "log_ratio_clamp"),
    (dict(log_ratio_penalty=-0.1), "log_ratio_penalty"),
    (dict(kl_clamp=float("inf")), "kl_clamp"),
    (dict(cov_mode="topk"), "cov_mode"),
    (dict(cov_mode="clip", cov_ratio=0.0), "cov_ratio"),
    (dict(cov_mode="clip", cov_lb=5.0, cov_ub=1.0), "cov_lb, cov_ub"),
    (dict(cov_mode="clip", objective="cispo"), "cov_mode.*objective='cispo'"),
    (dict(cov_mode="kl", importance_sampling_level="sequence"),
     "cov_mode.*importance_sampling_level"),
])
def test_bad_combinations(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        gbc.PolicyLossConfig(**kwargs)


def test_presets():
    """Each "verl:<mode>" preset is a config; unknown names and dro without its beta are
    refused; an option overrides a preset's field."""
    from gbc_kernels.config import TRAINER_PRESETS

    for name in TRAINER_PRESETS:
        opts = dict(log_ratio_penalty=0.1) if name == "verl:dro" else {}
        cfg = gbc.PolicyLossConfig.preset(name, ar_alpha=0.3, **opts)
        assert cfg.ar_alpha == 0.3
    assert gbc.PolicyLossConfig.preset("verl:cispo").cispo_min == 0.8
    assert gbc.PolicyLossConfig.preset("verl:vanilla", clip_ratio_c=4.0).clip_ratio_c == 4.0
    with pytest.raises(ValueError, match="log_ratio_penalty.*verl:dro"):
        gbc.PolicyLossConfig.preset("verl:dro")
    with pytest.raises(ValueError, match="loss_type.*'verl:ppo'"):
        gbc.PolicyLossConfig.preset("verl:ppo")
    with pytest.raises(ValueError, match="loss_type"):
        gbc.PolicyLossConfig.preset(["grpo"])


@pytest.mark.parametrize("mode", VERL_MODES)
def test_verl_registry_every_base_mode(mode):
    """``integrations.verl.register(base_loss_mode=mode)``: the registered function equals
    verl's own registered ``mode`` (value and gradient), global batch info and rollout IS
    weights on."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from gbc_kernels.integrations import verl as gv

    gv.register(f"gbc_{mode}", base_loss_mode=mode)
    b = _verl_batch(zlib.crc32(f"reg{mode}".encode()) % 1000)
    agg = "token-mean" if mode == "geo_mean" else "seq-mean-token-mean"
    outs = []
    for name in (mode, f"gbc_{mode}"):
        cfg = verl_actor_config(mode, agg)
        cfg.global_batch_info.update(dp_size=2, batch_num_tokens=70, global_batch_size=14,
                                     loss_scale_factor=None)
        lp = b["logp"].clone().requires_grad_(True)
        loss, metrics = _seeded(core_algos.get_policy_loss_fn(name), old_log_prob=b["old"],
                                log_prob=lp, advantages=b["adv"], response_mask=b["mask"],
                                loss_agg_mode=agg, config=cfg, rollout_is_weights=b["is_w"])
        loss.backward()
        outs.append((float(loss.detach()), lp.grad, metrics))
    assert abs(outs[0][0] - outs[1][0]) <= 1e-10 * max(1.0, abs(outs[0][0]))
    assert torch.allclose(torch.where(b["mask"], outs[0][1], 0.0), outs[1][1], rtol=1e-8,
                          atol=1e-12)
    if "actor/ppo_kl" in outs[0][2] and mode != "kl_cov":    # kl_cov reports |lr| there
        assert abs(outs[0][2]["actor/ppo_kl"] - outs[1][2]["actor/ppo_kl"]) < 1e-9
    with pytest.raises(ValueError, match="base_loss_mode"):
        gv.register("gbc_bad", base_loss_mode="ppo")


# ----------------------------------------------------------------------------------------------
# per-sample / per-token temperature, sum_p2
# ----------------------------------------------------------------------------------------------


def _temps(kind, B, T, g):
    if kind == "per-sequence":
        return torch.rand(B, generator=g) * 1.5 + 0.4
    return torch.rand(B, T, generator=g) * 1.5 + 0.4


@pytest.mark.parametrize("kind", ["per-sequence", "per-token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logprobs_temperature_tensor_and_sum_p2(backend, kind, dtype, small_chunks):
    """fused_linear_logprobs with a [B] / [B, T] temperature against the float64 reference:
    log-probs, entropy, sum_p2 and the gradients of a random upstream through both outputs;
    token_stats' sum_p2 too. V = 37 (odd), several chunks."""
    batch = make_batch(B=4, T=9, V=37, seed=21, dtype=dtype)
    g = torch.Generator().manual_seed(21)
    temp = _temps(kind, 4, 9, g)
    y = batch["targets"].clamp(min=0)
    up = torch.randn(2, 4, 9, generator=g)
    res = {}
    for lib, cast in ((gbc, lambda t: t), (ref, lambda t: t.double())):
        h = cast(batch["hidden"]).clone().requires_grad_(True)
        w = cast(batch["weight"]).clone().requires_grad_(True)
        b = cast(batch["bias"]).clone().requires_grad_(True)
        kw = {"backend": backend} if lib is gbc else {}
        logp, ent, sp2 = lib.fused_linear_logprobs(h, w, y, bias=b, temperature=temp,
                                                   return_entropy=True, return_sum_p2=True, **kw)
        ((logp * up[0]).sum() + (ent * up[1]).sum()).backward()
        st = lib.token_stats(h.detach(), w.detach(), y, b.detach(), temperature=temp, **kw)
        res[lib] = (logp.detach(), ent.detach(), sp2, h.grad, w.grad, b.grad, st.sum_p2,
                    st.logp)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for got, want in zip(res[gbc], res[ref]):
        got, want = got.double(), want.double()
        assert (got - want).abs().max() <= tol * max(1.0, want.abs().max()), \
            (got - want).abs().max()
    assert not torch.allclose(res[gbc][0].double(), gbc.fused_linear_logprobs(
        batch["hidden"], batch["weight"], y, bias=batch["bias"])[0].double())


@pytest.mark.parametrize("kind", ["per-sequence", "per-token"])
@pytest.mark.parametrize("cfg", [dict(), dict(objective="gmpo", loss_agg="grpo", kl_coef=0.05),
                                 dict(importance_sampling_level="sequence", entropy_coef=0.03,
                                      top_entropy_quantile=0.6)],
                         ids=["ppo", "gmpo-kl", "gspo-quantile-entropy"])
def test_fused_loss_temperature_tensor(backend, kind, cfg, chunking):
    """fused_linear_policy_loss(temperature=[B] or [B, T]) against the float64 reference: loss,
    gradients and metrics (grad_share_low uses each token's temperature)."""
    batch = make_batch(B=5, T=9, V=37, seed=31, old_spread=3.0)
    g = torch.Generator().manual_seed(31)
    temp = _temps(kind, 5, 9, g)
    out = run(gbc, batch, cfg, None, 0.9, backend, {"temperature": temp})
    truth = run(ref, as64(batch), cfg, None, 0.9, extra={"temperature": temp.double()})
    check_against(out, truth, 1e-5, 1e-4)


def test_temperature_tensor_refusals():
    batch = make_batch(B=3, T=4, V=11, seed=2)
    h, w, y, m, a = (batch[k] for k in ("hidden", "weight", "targets", "mask", "advantages"))
    for bad, match in ((torch.ones(4), r"temperature: expected a float or a tensor of shape "
                                       r"\[3x4\]"),
                       (torch.ones(3, 5), r"temperature: expected .* got \[3x5\]"),
                       (torch.full((3,), -1.0), "temperature: expected finite temperatures > 0"),
                       (torch.tensor([float("nan"), 1.0, 1.0]), "temperature.*> 0"),
                       (torch.ones(3, dtype=torch.long), "temperature"),
                       (0.0, "temperature: expected a finite float > 0")):
        with pytest.raises((ValueError, TypeError), match=match):
            gbc.fused_linear_policy_loss(h, w, y, m, a, temperature=bad)
    with pytest.raises(ValueError, match="temperature"):
        gbc.fused_linear_logprobs(h, w, y.clamp(min=0), temperature=torch.ones(4))
    with pytest.raises(TypeError, match="return_sum_p2: expected a bool"):
        gbc.fused_linear_logprobs(h, w, y.clamp(min=0), return_sum_p2="yes")


# ----------------------------------------------------------------------------------------------
# verl's packed (use_remove_padding) micro-batch: the loss from the hidden rows, no logits
# ----------------------------------------------------------------------------------------------


def _nested(parts, offsets=None):
    """A jagged nested tensor; tensors of one layout share ``offsets`` (as verl's do: TensorDict
    pads fields together only when their ragged dimension is the same)."""
    if offsets is None:
        offsets = torch.cat([torch.zeros(1, dtype=torch.long),
                             torch.tensor([len(p) for p in parts]).cumsum(0)])
    lens = offsets.diff()           # the bounds padding pads to (as verl's nested data carry)
    return torch.nested.nested_tensor_from_jagged(torch.cat(parts), offsets,
                                                  max_seqlen=int(lens.max()),
                                                  min_seqlen=int(lens.min()))


@pytest.mark.parametrize("mode,agg", [("vanilla", "token-mean"), ("gspo", "seq-mean-token-mean"),
                                      ("dppo_kl", "token-sum"), ("geo_mean", "token-mean"),
                                      ("clip_cov", "seq-mean-token-sum-norm")])
def test_verl_packed_micro_batch_equals_ppo_loss(mode, agg):
    """``integrations.verl.fused_ppo_loss_packed`` on the packed hidden states of a
    ``use_remove_padding`` micro-batch against verl's own path on the same rows: the logits
    ``h W^T / temperature`` (per-token temperature), verl's ``logprobs_from_logits`` and
    ``entropy_from_logits``, its ``no_padding_2_padding`` and its real ``ppo_loss`` (policy,
    k3+ KL and entropy terms, global batch info): loss and the gradients of the hidden states
    and the head."""
    pytest.importorskip("verl.workers.utils.losses")
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from gbc_kernels.integrations import verl as gv

    g = torch.Generator().manual_seed(zlib.crc32(mode.encode()) % 1000)
    B, H, V = 4, 16, 53
    plens, rlens = torch.tensor([3, 5, 2, 4]), torch.tensor([4, 2, 6, 1])
    seqs = [torch.randint(0, V, (int(p + r),), generator=g) for p, r in zip(plens, rlens)]
    nnz = int((plens + rlens).sum())
    h0 = torch.randn(nnz, H, generator=g, dtype=torch.float64)
    w0 = torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5
    rolled = torch.roll(torch.cat(seqs), -1)
    temp_seq = torch.rand(B, generator=g, dtype=torch.float64) + 0.6
    temp_rmpad = torch.cat([t.expand(int(p + r)) for t, p, r in zip(temp_seq, plens, rlens)])
    T = int(rlens.max())
    idx, valid = gv.response_rows(plens, rlens, T)
    old = torch.where(valid, -torch.rand(B, T, generator=g, dtype=torch.float64) * 3, 0.0)
    ref = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * valid
    cfg_verl = verl_actor_config(mode, agg, "k3+", entropy_coeff=0.01, loss_scale_factor=9)
    info = dict(dp_size=2, batch_num_tokens=2 * int(rlens.sum()) + 3, global_batch_size=9)

    resp_offsets = torch.cat([torch.zeros(1, dtype=torch.long), rlens.cumsum(0)])

    def per_response(x):
        return _nested([x[b, :int(rlens[b])] for b in range(B)], resp_offsets)

    out = {}
    for which in ("verl", "gbc"):
        h = h0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        if which == "verl":
            logits = (h @ w.T) / temp_rmpad[:, None]
            lp = logprobs_from_logits(logits, rolled)
            ent = entropy_from_logits(logits)
            cu = torch.cat([torch.zeros(1, dtype=torch.long), (plens + rlens).cumsum(0)])
            data = TensorDict({"prompts": _nested([s[:p] for s, p in zip(seqs, plens)]),
                               "responses": _nested([s[p:] for s, p in zip(seqs, plens)],
                                                    resp_offsets),
                               "input_ids": _nested(seqs),
                               "response_mask": per_response(valid.long()),
                               "old_log_probs": per_response(old),
                               "advantages": per_response(adv),
                               "ref_log_prob": per_response(ref)}, batch_size=[B])
            tu.assign_non_tensor(data, **info)
            model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(lp, cu),
                            "entropy": torch.nested.nested_tensor_from_jagged(ent, cu)}
            loss, _ = _seeded(ppo_loss, cfg_verl, model_output, data)
        else:
            loss, _ = _seeded(gv.fused_ppo_loss_packed, h, w, rolled, plens, rlens,
                              valid.long(), old, adv, cfg_verl, global_batch_info=info,
                              ref_log_prob=ref, temperature=temp_rmpad)
        loss.backward()
        out[which] = (float(loss.detach()), h.grad, w.grad)
    # the fused path keeps its per-token statistics in float32 (docs/math.md §0), so float64
    # inputs agree to float32's precision
    (l0, gh0, gw0), (l1, gh1, gw1) = out["verl"], out["gbc"]
    assert gh0.abs().max() > 0
    assert abs(l0 - l1) <= 1e-6 * max(1.0, abs(l0)), (l0, l1)
    for a, b in ((gh0, gh1), (gw0, gw1)):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max(), (a - b).abs().max()


def test_verl_packed_micro_batch_takes_the_method_inputs():
    """``fused_ppo_loss_packed`` runs Lopti's phase, NTHR's ``token_scale`` and critical KL's
    ``kl_weight``: equal to the fused loss on the same gathered rows with the same inputs
    (before, ``lopti_eta`` was refused naming a ``phase`` it did not take)."""
    import gbc_kernels as gbc
    from gbc_kernels.integrations import verl as gv

    g = torch.Generator().manual_seed(7)
    B, H, V = 3, 8, 29
    plens, rlens = torch.tensor([2, 4, 3]), torch.tensor([3, 1, 4])
    nnz = int((plens + rlens).sum())
    h = torch.randn(nnz, H, generator=g)
    w = torch.randn(V, H, generator=g) / H ** 0.5
    rolled = torch.randint(0, V, (nnz,), generator=g)
    T = int(rlens.max())
    idx, valid = gv.response_rows(plens, rlens, T)
    old = torch.where(valid, -torch.rand(B, T, generator=g) * 3, 0.0)
    ref = (old + 0.3 * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    adv = torch.randn(B, 1, generator=g).expand(B, T) * valid
    scale, klw = torch.rand(2, B, T, generator=g) + 0.5
    cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl")
    for phase in ("low", "high"):
        got, _ = gv.fused_ppo_loss_packed(h, w, rolled, plens, rlens, valid.long(), old, adv,
                                          cfg, ref_log_prob=ref, lopti_eta=0.3, phase=phase,
                                          token_scale=scale, kl_weight=klw)
        want, _ = gbc.fused_linear_policy_loss(
            h[idx], w, rolled[idx], valid, adv, old, ref, token_scale=scale, kl_weight=klw,
            config=gv.policy_loss_config(cfg, response_length=T, lopti_eta=0.3), phase=phase)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), phase


def test_verl_packed_micro_batch_errors_name_verls_arguments():
    """``fused_ppo_loss_packed`` reports gbc's checks under its own arguments: an id outside
    the vocabulary in ``input_ids_rolled`` and a bad ``temperature_rmpad`` at their packed
    position (gbc saw them gathered as ``[B, T]``), ``old_log_probs`` by name; an id outside
    the vocabulary on a prompt position is not an error; nothing is computed."""
    from gbc_kernels.integrations import verl as gv

    g = torch.Generator().manual_seed(8)
    B, H, V = 3, 8, 29
    plens, rlens = torch.tensor([2, 4, 3]), torch.tensor([3, 1, 4])
    nnz = int((plens + rlens).sum())
    h = torch.randn(nnz, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g, requires_grad=True)
    rolled = torch.randint(0, V, (nnz,), generator=g)
    T = int(rlens.max())
    idx, valid = gv.response_rows(plens, rlens, T)
    old = torch.where(valid, -torch.rand(B, T, generator=g) * 3, 0.0)
    ref = (old + 0.3 * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    adv = torch.randn(B, 1, generator=g).expand(B, T) * valid
    cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl")
    temp = torch.ones(nnz)

    def call(rolled=rolled, old=old, temp=temp, ref=ref):
        return gv.fused_ppo_loss_packed(h, w, rolled, plens, rlens, valid.long(), old, adv, cfg,
                                        ref_log_prob=ref, temperature=temp)

    bad = rolled.clone()
    bad[0] = 99                                 # a prompt position: not predicted
    bad[int(idx[2, 3])] = 40                    # response token 3 of sequence 2
    with pytest.raises(ValueError) as info:
        call(rolled=bad)
    assert str(info.value) == (f"input_ids_rolled: expected token ids in [0, {V}) on "
                               f"masked-in positions, got 40 at index [{int(idx[2, 3])}]")
    bad_t = temp.clone()
    bad_t[int(idx[1, 0])] = 0.0
    with pytest.raises(ValueError) as info:
        call(temp=bad_t)
    assert str(info.value) == (f"temperature: expected finite temperatures > 0 on masked-in "
                               f"positions, got 0.0 at index [{int(idx[1, 0])}]")
    bad_old = old.clone()
    bad_old[0, 1] = float("nan")
    with pytest.raises(ValueError, match=r"^old_log_probs: expected finite values"):
        call(old=bad_old)
    with pytest.raises(ValueError, match=r"^ref_log_prob: required when config.kl_coef"):
        call(ref=None)
    assert h.grad is None and w.grad is None
