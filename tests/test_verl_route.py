"""verl's one route (docs/math.md §12-§13): ``policy_loss_config(actor_config)`` alone, with
``fused_linear_policy_loss(..., config=cfg)``, equals verl 0.9.1's real ``ppo_loss``
(``verl/workers/utils/losses.py``: its registered policy loss, ``kl_penalty`` and ``agg_loss``)
run with verl's defaults (``dp_size=1``, no global token or sequence count); adding
:func:`batch_normalisers` for that call changes nothing, and with a global batch
(``dp_size > 1``, global counts) it equals verl given that ``global_batch_info``.

The oracle is verl's own code on the same packed micro-batch (``use_remove_padding`` layout, the
logits ``h W^T`` of every packed row, verl's ``logprobs_from_logits``/``entropy_from_logits``);
gbc gets the hidden rows that predict the response tokens. Every batch holds responses whose
mask is all zero (one with no response token at all, one with masked-out tokens only). Compared:
the loss and the gradients of the hidden states and of the head.

Also here: a bad value reached through verl's config names verl's option.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

pytest.importorskip("verl.workers.utils.losses")
from omegaconf import OmegaConf  # noqa: E402

import gbc_kernels as gbc  # noqa: E402
from gbc_kernels.integrations import verl as gv  # noqa: E402

from test_other_trainers import _seeded, verl_actor_config as actor_config  # noqa: E402

MODES = gv.VERL_LOSS_MODES
AGGS = gv.VERL_AGG_MODES
KL_TYPES = tuple(gv.VERL_KL_TYPES)


def _nested(parts, offsets=None):
    if offsets is None:
        offsets = torch.cat([torch.zeros(1, dtype=torch.long),
                             torch.tensor([len(p) for p in parts]).cumsum(0)])
    lens = offsets.diff()
    return torch.nested.nested_tensor_from_jagged(torch.cat(parts), offsets,
                                                  max_seqlen=int(lens.max()),
                                                  min_seqlen=int(lens.min()))


def packed_batch(seed, B=6, H=12, V=41):
    """A packed micro-batch: response 2 is empty (no token), response 4 has tokens that are all
    masked out, response 1 has holes in its mask."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(1, 5, (B,), generator=g)
    rlens = torch.randint(2, 9, (B,), generator=g)
    rlens[2] = 0
    rlens[0] = 9                                     # the padded length T
    seqs = [torch.randint(0, V, (int(p + r),), generator=g) for p, r in zip(plens, rlens)]
    nnz = int((plens + rlens).sum())
    T = int(rlens.max())
    idx, valid = gv.response_rows(plens, rlens, T)
    mask = valid & (torch.rand(B, T, generator=g) < 0.8)
    mask[0, 0] = True
    mask[4] = False
    mask[1, 1] = False
    old = torch.where(valid, -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05, 0.)
    ref = torch.where(valid, (old + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64))
                      .clamp(max=-1e-3), 0.0)
    ref[3, :2] = old[3, :2] - 25.0                   # low_var_kl's +-20 / +-10 clamps act
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * valid
    return dict(plens=plens, rlens=rlens, seqs=seqs, idx=idx, valid=valid, mask=mask, old=old,
                ref=ref, adv=adv.contiguous(), T=T, B=B,
                h=torch.randn(nnz, H, generator=g, dtype=torch.float64),
                w=torch.randn(V, H, generator=g, dtype=torch.float64) * 0.8,
                rolled=torch.roll(torch.cat(seqs), -1))


def verl_run(cfg, b, info):
    """verl's ppo_loss on the packed micro-batch from the head; ``info``: its global batch
    info. Returns the loss and the gradients of the hidden states and the head."""
    from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

    h = b["h"].clone().requires_grad_(True)
    w = b["w"].clone().requires_grad_(True)
    logits = h @ w.T
    loss = verl_ppo_loss(cfg, b, info, logprobs_from_logits(logits, b["rolled"]),
                         entropy_from_logits(logits))
    (loss * 1.3).backward()
    return float(loss.detach()), h.grad, w.grad


def verl_ppo_loss(cfg, b, info, lp, ent):
    """verl's real ppo_loss on packed per-token log-probs ``lp`` and entropies ``ent`` [nnz]."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    B, plens, rlens, seqs = b["B"], b["plens"], b["rlens"], b["seqs"]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), (plens + rlens).cumsum(0)])
    ro = torch.cat([torch.zeros(1, dtype=torch.long), rlens.cumsum(0)])

    def per_response(x):
        return _nested([x[i, :int(rlens[i])] for i in range(B)], ro)

    data = TensorDict({"prompts": _nested([s[:p] for s, p in zip(seqs, plens)]),
                       "responses": _nested([s[p:] for s, p in zip(seqs, plens)], ro),
                       "input_ids": _nested(seqs),
                       "response_mask": per_response(b["mask"].long()),
                       "old_log_probs": per_response(b["old"]),
                       "advantages": per_response(b["adv"]),
                       "ref_log_prob": per_response(b["ref"])}, batch_size=[B])
    tu.assign_non_tensor(data, dp_size=info.get("dp_size", 1),
                         batch_num_tokens=info.get("batch_num_tokens"),
                         global_batch_size=info.get("global_batch_size"))
    out = {"log_probs": torch.nested.nested_tensor_from_jagged(lp, cu),
           "entropy": torch.nested.nested_tensor_from_jagged(ent, cu)}
    return _seeded(ppo_loss, cfg, out, data)[0]


def gbc_run(cfg_verl, b, normalisers=None, backend="auto", dtype=torch.float64):
    """``fused_linear_policy_loss`` with ``policy_loss_config(cfg_verl)``; ``normalisers``: None
    (the config alone) or the global batch info handed to :func:`gv.batch_normalisers`."""
    h = b["h"].to(dtype, copy=True).requires_grad_(True)
    w = b["w"].to(dtype, copy=True).requires_grad_(True)
    cfg = gv.policy_loss_config(cfg_verl, response_length=b["T"])
    norms = {} if normalisers is None else gv.batch_normalisers(cfg_verl, b["mask"], normalisers)
    loss, _ = _seeded(gbc.fused_linear_policy_loss, h[b["idx"]], w,
                      b["rolled"][b["idx"]], b["mask"], b["adv"], old_logp=b["old"],
                      ref_logp=b["ref"] if cfg.kl_coef else None, config=cfg, backend=backend,
                      **norms)
    (loss * 1.3).backward()
    return float(loss.detach()), h.grad.double(), w.grad.double()


def logp_runs(cfg_verl, b, normalisers=None):
    """float64 per-token log-probs and entropies: verl's ppo_loss on them against
    :func:`gbc.policy_loss` with the config (and, when given, :func:`gv.batch_normalisers`).
    Returns both runs' loss and gradients in the packed log-probs and entropies."""
    g = torch.Generator().manual_seed(int(b["h"][0, 0].abs() * 1e6) % 10_000)
    nnz = b["h"].shape[0]
    lp0 = -torch.rand(nnz, generator=g, dtype=torch.float64) * 3 - 1e-3
    ent0 = torch.rand(nnz, generator=g, dtype=torch.float64) * 2
    out = []
    for which in ("verl", "gbc"):
        lp, ent = lp0.clone().requires_grad_(True), ent0.clone().requires_grad_(True)
        if which == "verl":
            loss = verl_ppo_loss(cfg_verl, b, normalisers or {}, lp, ent)
        else:
            cfg = gv.policy_loss_config(cfg_verl, response_length=b["T"])
            norms = ({} if normalisers is None
                     else gv.batch_normalisers(cfg_verl, b["mask"], normalisers))
            idx, valid = b["idx"], b["valid"]
            loss = _seeded(gbc.policy_loss, torch.where(valid, lp[idx], 0.0), b["mask"],
                           b["adv"], old_logp=b["old"], ref_logp=b["ref"] if cfg.kl_coef else None,
                           entropy=torch.where(valid, ent[idx], 0.0) if cfg.wants_entropy else None,
                           config=cfg, **norms)[0]
        (loss * 0.7).backward()
        out.append((float(loss.detach()), lp.grad,
                    torch.zeros_like(ent) if ent.grad is None else ent.grad))
    return out


def assert_same_float64(want, got):
    """float64 throughout: agreement to float64's precision."""
    (l0, gl0, ge0), (l1, gl1, ge1) = want, got
    assert gl0.abs().max() > 0 and math.isfinite(l0)
    assert abs(l0 - l1) <= 1e-12 * max(1.0, abs(l0)), (l0, l1)
    for a, c in ((gl0, gl1), (ge0, ge1)):
        assert (a - c).abs().max() <= 1e-12 * max(a.abs().max(), 1e-12), (a - c).abs().max()


def assert_same(want, got, tol=2e-6):
    """float64 inputs; the fused path keeps its per-token statistics in float32 (docs/math.md
    §0): agreement to float32's precision."""
    (l0, gh0, gw0), (l1, gh1, gw1) = want, got
    assert gh0.abs().max() > 0 and gw0.abs().max() > 0
    assert math.isfinite(l0)
    assert abs(l0 - l1) <= tol * max(1.0, abs(l0)), (l0, l1)
    for a, c in ((gh0, gh1), (gw0, gw1)):
        assert (a - c).abs().max() <= 10 * tol * a.abs().max(), (a - c).abs().max() / a.abs().max()


def _case_config(mode, agg):
    if mode == "geo_mean" and agg.startswith("seq-mean"):
        return actor_config(mode, agg)          # its KL/entropy with a sequence mode: refused
    return actor_config(mode, agg, "low_var_kl", entropy_coeff=0.03)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mode", MODES)
def test_config_alone_equals_verl_defaults(mode, agg):
    """Every loss mode x every loss_agg_mode (KL and entropy on): the config alone is verl."""
    b = packed_batch(zlib.crc32(f"{mode}/{agg}".encode()) % 10_000)
    cfg = _case_config(mode, agg)
    want = verl_run(cfg, b, {})
    assert_same(want, gbc_run(cfg, b))
    # the second call, with nothing global to add, changes nothing
    assert_same(want, gbc_run(cfg, b, normalisers={}))
    assert_same_float64(*logp_runs(cfg, b))


@pytest.mark.parametrize("mode,agg", [("vanilla", "token-sum"), ("gspo", "seq-mean-token-mean"),
                                      ("sapo", "token-sum"), ("dro", "seq-mean-token-sum-norm"),
                                      ("kl_cov", "seq-mean-token-sum")])
def test_config_alone_every_backend(backend, mode, agg):
    """The aggregation rules (token sum, non-empty sequence count) in every backend (float32
    hidden states and head against verl in float64)."""
    b = packed_batch(zlib.crc32(f"backend/{mode}/{agg}".encode()) % 10_000)
    cfg = _case_config(mode, agg)
    assert_same(verl_run(cfg, b, {}), gbc_run(cfg, b, backend=backend, dtype=torch.float32),
                tol=2e-5)


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_config_alone_every_kl_type(kl_type):
    """Every kl_loss_type verl takes ('+': its straight-through k2 gradient), the aggregation
    cycling through verl's modes."""
    agg = AGGS[KL_TYPES.index(kl_type) % len(AGGS)]
    b = packed_batch(zlib.crc32(f"kl/{kl_type}".encode()) % 10_000)
    cfg = actor_config("vanilla", agg, kl_type, entropy_coeff=0.02)
    assert_same(verl_run(cfg, b, {}), gbc_run(cfg, b))
    assert_same_float64(*logp_runs(cfg, b))


GLOBAL = dict(dp_size=2, batch_num_tokens=67, global_batch_size=11)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mode", MODES)
def test_batch_normalisers_global_batch(mode, agg):
    """With a global batch (dp_size 2, global token and sequence counts): the config plus
    batch_normalisers equals verl given that global_batch_info."""
    b = packed_batch(zlib.crc32(f"global/{mode}/{agg}".encode()) % 10_000)
    cfg = _case_config(mode, agg)
    assert_same(verl_run(cfg, b, GLOBAL), gbc_run(cfg, b, normalisers=GLOBAL))
    assert_same_float64(*logp_runs(cfg, b, normalisers=GLOBAL))


def test_geo_mean_sequence_modes_with_kl_refused():
    """verl's geo_mean averages its policy term over every row of the micro-batch while its KL
    and entropy terms count sequences by loss_agg_mode: refused, naming loss_agg_mode."""
    for agg in AGGS[2:]:
        with pytest.raises(ValueError, match="loss_agg_mode"):
            gv.policy_loss_config(actor_config("geo_mean", agg, "k1"), response_length=8)


def test_token_sum_is_a_sum():
    """token-sum doubles when the batch doubles (a sum, not a mean), config alone."""
    b = packed_batch(7)
    cfg = gv.policy_loss_config(actor_config("gpg", "token-sum"))
    x = dict(hidden=b["h"][b["idx"]], weight=b["w"], targets=b["rolled"][b["idx"]],
             mask=b["mask"], advantages=b["adv"], old_logp=b["old"])
    one = gbc.fused_linear_policy_loss(**x, config=cfg)[0]
    two = gbc.fused_linear_policy_loss(**{k: torch.cat([v, v]) if k != "weight" else v
                                          for k, v in x.items()}, config=cfg)[0]
    assert torch.allclose(two, 2 * one, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# errors in verl's words
# ----------------------------------------------------------------------------------------------

# (verl loss mode, verl's option with a bad value, the name the error must give)
BAD_VALUES = [
    ("vanilla", dict(clip_ratio_low=-0.1), "clip_ratio_low"),
    ("vanilla", dict(clip_ratio_low=1.0), "clip_ratio_low"),
    ("vanilla", dict(clip_ratio_high=-0.2), "clip_ratio_high"),
    ("vanilla", dict(clip_ratio_high=float("inf")), "clip_ratio_high"),
    ("vanilla", dict(clip_ratio=float("nan"), clip_ratio_low=None, clip_ratio_high=None),
     "clip_ratio"),
    ("vanilla", dict(clip_ratio_c=0.5), "clip_ratio_c"),
    ("vanilla", dict(clip_ratio_c=float("inf")), "clip_ratio_c"),
    ("dppo_tv", dict(clip_ratio_c=-1.0), "clip_ratio_c"),
    ("gspo", dict(clip_ratio_low=-0.5), "clip_ratio_low"),
    ("cispo", dict(clip_ratio_low=1.5), "clip_ratio_low"),
    ("cispo", dict(clip_ratio_high=float("nan")), "clip_ratio_high"),
    ("cispo", dict(clip_ratio_low=0.2, clip_ratio_high=-0.9), "clip_ratio_low"),
    ("sapo", dict(tau_pos=0.0), "tau_pos"),
    ("sapo", dict(tau_neg=-1.0), "tau_neg"),
    ("vanilla", dict(use_kl_loss=True, kl_loss_coef=float("nan")), "kl_loss_coef"),
    ("vanilla", dict(use_kl_loss=True, kl_loss_coef="0.1"), "kl_loss_coef"),
    ("vanilla", dict(entropy_coeff=float("inf")), "entropy_coeff"),
    ("vanilla", dict(entropy_coeff="much"), "entropy_coeff"),
    ("vanilla", dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=-3),
     "loss_scale_factor"),
    ("clip_cov", dict(policy_loss=dict(clip_cov_ratio=0.0)), "policy_loss.clip_cov_ratio"),
    ("clip_cov", dict(policy_loss=dict(clip_cov_lb=5.0, clip_cov_ub=1.0)),
     "policy_loss.clip_cov_lb"),
    ("clip_cov", dict(policy_loss=dict(clip_cov_ub=float("nan"))), "policy_loss.clip_cov_ub"),
    ("kl_cov", dict(policy_loss=dict(kl_cov_ratio=2.0)), "policy_loss.kl_cov_ratio"),
    ("kl_cov", dict(policy_loss=dict(ppo_kl_coef=float("inf"))), "policy_loss.ppo_kl_coef"),
    ("dro", dict(policy_loss=dict(dro_beta=float("inf"))), "policy_loss.dro_beta"),
    ("dro", dict(policy_loss=dict(dro_beta=-0.1)), "policy_loss.dro_beta"),
    ("vanilla", dict(use_kl_loss="false"), "use_kl_loss"),
    ("vanilla", dict(use_kl_loss=True, kl_loss_type="k4"), "kl_loss_type"),
    ("vanilla", dict(loss_agg_mode="seq-mean"), "loss_agg_mode"),
    ("ppo", dict(), "policy_loss.loss_mode"),
]


@pytest.mark.parametrize("mode,bad,name", BAD_VALUES,
                         ids=[f"{m}-{'-'.join(b)}" for m, b, _ in BAD_VALUES])
def test_bad_value_names_verl_option(mode, bad, name):
    """Every mapped verl option, one bad value each: a ValueError that names verl's option
    (gbc's field may follow)."""
    pl = {"loss_mode": mode, "dro_beta": 0.3 if mode == "dro" else None}
    pl.update(bad.pop("policy_loss", {}))
    cfg = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.25,
                            "loss_agg_mode": "token-mean", "policy_loss": pl, **bad})
    with pytest.raises(ValueError) as err:
        gv.policy_loss_config(cfg, response_length=8)
    msg = str(err.value)
    assert msg.startswith(name), msg
    if "=" not in name:
        value = {**bad, **pl}.get(name.split(".")[-1])
        assert repr(value) in msg, msg


def test_every_mapped_option_has_a_bad_value_case():
    """The table above covers every verl option the mapping reads."""
    covered = {name for _, _, name in BAD_VALUES}
    assert set(gv.VERL_OPTION_NAMES) <= covered, set(gv.VERL_OPTION_NAMES) - covered


def test_gbc_option_keeps_gbc_name():
    """An option given as a gbc field (not through verl's config) keeps gbc's name."""
    with pytest.raises(ValueError, match="^ar_alpha"):
        gv.policy_loss_config({"loss_agg_mode": "token-mean"}, ar_alpha=3.0)


@pytest.mark.parametrize("info,name", [
    (dict(dp_size=0, batch_num_tokens=10), "global_batch_info.dp_size"),
    (dict(dp_size=1.5, batch_num_tokens=10), "global_batch_info.dp_size"),
    (dict(dp_size=True), "global_batch_info.dp_size"),
    (dict(dp_size=2, batch_num_tokens=-4, global_batch_size=3),
     "global_batch_info.batch_num_tokens"),
    (dict(batch_num_tokens=float("nan")), "global_batch_info.batch_num_tokens"),
    (dict(dp_size=2, batch_num_tokens=8, global_batch_size=0),
     "global_batch_info.global_batch_size"),
    (dict(dp_size=2), "global_batch_info: batch_num_tokens is required"),
])
def test_bad_global_batch_info_names_it(info, name):
    """A bad value in verl's global_batch_info is refused naming the entry."""
    with pytest.raises(ValueError, match=f"^{name}"):
        gv.batch_normalisers(actor_config("vanilla", "token-mean"), torch.ones(2, 3, dtype=bool),
                             info)
    if "global_batch_size" in name:          # refused whatever the mode reads
        with pytest.raises(ValueError, match=f"^{name}"):
            gv.batch_normalisers(actor_config("gspo", "seq-mean-token-mean"),
                                 torch.ones(2, 3, dtype=bool), info)


def test_aggregation_count_fields_checked():
    """The config's own counts (token_count, seq_count) refuse bad values, naming them."""
    for bad in (0.0, -1.0, float("inf"), float("nan"), "1", True):
        with pytest.raises((ValueError, TypeError), match="token_count"):
            gbc.PolicyLossConfig(token_count=bad)
    for bad in ("all", None, "nonempty "):
        with pytest.raises(ValueError, match="seq_count"):
            gbc.PolicyLossConfig(seq_count=bad)
    # the sequence count of a batch whose responses are all empty: 1 (loss 0), never NaN
    cfg = gbc.PolicyLossConfig(loss_agg="seq-mean-token-mean", seq_count="nonempty")
    logp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    loss = gbc.policy_loss(logp, torch.zeros(3, 4, dtype=torch.bool), torch.ones(3),
                           config=cfg)[0]
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp))
