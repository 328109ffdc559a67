"""docs/math.md §8: every bad input raises a clear error naming the argument."""

from __future__ import annotations

import pytest
import torch

import gbc_kernels as gbc
from conftest import make_batch


def _loss(b, **over):
    kw = dict(hidden=b["hidden"], weight=b["weight"], targets=b["targets"], mask=b["mask"],
              advantages=b["advantages"], old_logp=b["old_logp"], ref_logp=b["ref_logp"],
              bias=b["bias"])
    kw.update(over)
    return gbc.fused_linear_policy_loss(**kw)


B = make_batch(B=3, T=5, H=8, V=11, seed=0)


@pytest.mark.parametrize("over,exc,words", [
    (dict(hidden=B["hidden"][0]), ValueError, "hidden"),
    (dict(weight=B["weight"][:, :4]), ValueError, "weight"),
    (dict(weight=B["weight"].double()), TypeError, "weight"),
    (dict(bias=B["bias"][:5]), ValueError, "bias"),
    (dict(targets=B["targets"][:, :3]), ValueError, "targets"),
    (dict(targets=B["targets"].float()), TypeError, "targets"),
    (dict(targets=torch.where(B["mask"], 11, 0)), ValueError, "targets"),
    (dict(targets=torch.where(B["mask"], -5, 0)), ValueError, "[0, 11)"),
    (dict(mask=B["mask"][:2]), ValueError, "mask"),
    (dict(advantages=torch.randn(4)), ValueError, "advantages"),
    (dict(advantages=torch.full((3,), float("nan"))), ValueError, "advantages"),
    (dict(old_logp=torch.where(B["mask"], float("inf"), 0.0)), ValueError, "old_logp"),
    (dict(old_logp=B["old_logp"][:, :2]), ValueError, "old_logp"),
    (dict(ref_logp=None, config=gbc.PolicyLossConfig(kl_coef=0.1)), ValueError, "ref_logp"),
    (dict(ref_logp=torch.where(B["mask"], float("nan"), 0.0),
          config=gbc.PolicyLossConfig(kl_coef=0.1)), ValueError, "ref_logp"),
    (dict(phase="low"), ValueError, "lopti_eta"),
    (dict(phase="middle", config=gbc.PolicyLossConfig(lopti_eta=0.5)), ValueError, "phase"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(config={"epsilon": 0.2}), ValueError, "unknown option"),
    (dict(config=3), TypeError, "config"),
    (dict(num_items_in_batch=0), ValueError, "num_items_in_batch"),
    (dict(token_scale=torch.ones(3, 4)), ValueError, "token_scale"),
])
def test_bad_loss_inputs(over, exc, words):
    with pytest.raises(exc, match=None) as info:
        _loss(B, **over)
    assert words in str(info.value)


@pytest.mark.parametrize("kw,words", [
    (dict(loss_agg="mean"), "loss_agg"),
    (dict(loss_agg="dr_grpo"), "max_len"),
    (dict(kl_estimator="k4"), "kl_estimator"),
    (dict(clip_ratio_c=0.9), "clip_ratio_c"),
    (dict(temperature=0.0), "temperature"),
    (dict(epsilon_low=1.5), "epsilon_low"),
    (dict(ar_alpha=2.0), "ar_alpha"),
    (dict(lopti_eta=0.0), "lopti_eta"),
])
def test_bad_config(kw, words):
    with pytest.raises(ValueError) as info:
        gbc.PolicyLossConfig(**kw)
    assert words in str(info.value)


def test_loss_agg_aliases():
    assert gbc.PolicyLossConfig(loss_agg="grpo").loss_agg == "seq-mean-token-mean"
    assert gbc.PolicyLossConfig(loss_agg="bnpo").loss_agg == "token-mean"
    assert gbc.PolicyLossConfig(loss_agg="dr_grpo", max_len=4).loss_agg == \
        "seq-mean-token-sum-norm"


def test_mixed_devices_rejected():
    meta = torch.empty(3, 5, device="meta")
    with pytest.raises(ValueError, match="device"):
        _loss(B, old_logp=meta)


def test_logprobs_and_stats_errors():
    h, w = B["hidden"].reshape(-1, 8), B["weight"]
    with pytest.raises(ValueError, match="targets"):
        gbc.fused_linear_logprobs(h, w, torch.full((15,), 11))
    with pytest.raises(ValueError, match="temperature"):
        gbc.fused_linear_logprobs(h, w, torch.zeros(15, dtype=torch.long), temperature=-1.0)
    with pytest.raises(ValueError, match="certainty"):
        gbc.token_stats(h, w, torch.zeros(15, dtype=torch.long), certainty="gini")
    with pytest.raises(ValueError, match="targets"):
        gbc.token_stats(h, w, torch.zeros(14, dtype=torch.long))


def test_nthr_errors():
    b = B
    args = (b["hidden"], b["weight"], b["targets"], b["mask"])
    with pytest.raises(ValueError, match="group_ids"):
        gbc.nthr_scale(*args, torch.zeros(2, dtype=torch.long), torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="group_ids"):
        gbc.nthr_scale(*args, torch.zeros(3), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="eta"):
        gbc.nthr_scale(*args, torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool),
                       eta="sometimes")


def test_validation_switch_clamps_instead_of_raising(monkeypatch):
    monkeypatch.setenv("GBC_VALIDATE", "0")
    bad = torch.where(B["mask"], 10 ** 6, 0)
    loss, _ = _loss(B, targets=bad)          # no error, no out-of-bounds access
    assert torch.isfinite(loss)


def test_transform_errors():
    with pytest.raises(ValueError, match="alpha"):
        gbc.advantage_reweight(torch.ones(3), torch.zeros(3, 5), 1.5)
    with pytest.raises(ValueError, match="advantages"):
        gbc.advantage_reweight(torch.ones(4), torch.zeros(3, 5), 0.3)
    with pytest.raises(ValueError, match="eta"):
        gbc.lopti_split(torch.zeros(3, 5), torch.ones(3, 5), 0.0)
    with pytest.raises(ValueError, match="scale"):
        gbc.group_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), scale="mad")
    with pytest.raises(ValueError, match="exponent"):
        gbc.critical_kl_weight(torch.ones(3), exponent=0.0)


# ---- bad and nasty input tried as a user would ------------------------------------------------

def test_nan_hidden_state_propagates_into_the_loss(backend):
    """A NaN on a masked-in row is not swallowed by a clip (Triton's max/min drop NaN)."""
    batch = make_batch(seed=31)
    h = batch["hidden"].clone()
    b, t = batch["mask"].nonzero()[0].tolist()
    h[b, t, 0] = float("nan")
    loss, _ = gbc.fused_linear_policy_loss(h, batch["weight"], batch["targets"], batch["mask"],
                                           batch["advantages"], batch["old_logp"],
                                           backend=backend)
    assert torch.isnan(loss)


def test_torch_backend_bf16_temperature_in_float32():
    """z / tau is formed in float32 from bf16 logits (not rounded to bf16 first), in the
    operands' dtype mode (``logits_dtype="input"``: the CPU default is float32 logits)."""
    batch = make_batch(B=2, T=8, H=32, V=300, dtype=torch.bfloat16, seed=5, logit_scale=8.0)
    y = batch["targets"].clamp(min=0)
    got, _ = gbc.fused_linear_logprobs(batch["hidden"], batch["weight"], y, temperature=0.7,
                                       backend="torch", logits_dtype="input")
    z = (batch["hidden"] @ batch["weight"].T).float() / 0.7    # bf16 logits, fp32 after
    want = torch.log_softmax(z, -1).gather(-1, y[..., None])[..., 0]
    assert (got - want).abs().max() < 1e-3


def test_num_items_tensor_not_positive_refused():
    batch = make_batch(seed=1)
    for bad in (torch.tensor(0.0), torch.tensor(-3)):
        with pytest.raises(ValueError, match="num_items_in_batch: expected a finite count > 0"):
            gbc.fused_linear_policy_loss(batch["hidden"], batch["weight"], batch["targets"],
                                         batch["mask"], batch["advantages"],
                                         num_items_in_batch=bad)


def test_meta_tensors_refused_clearly():
    batch = make_batch(seed=1)
    with pytest.raises(ValueError, match="hidden: .*meta device"):
        gbc.fused_linear_policy_loss(batch["hidden"].to("meta"), batch["weight"].to("meta"),
                                     batch["targets"], batch["mask"], batch["advantages"])


@pytest.mark.parametrize("field, value", [("temperature", "1"), ("temperature", None),
                                          ("kl_coef", "0.1"), ("epsilon_high", None),
                                          ("delta", "2"), ("logit_softcap", "30")])
def test_config_wrong_types_named(field, value):
    with pytest.raises(TypeError, match=f"{field}: expected"):
        gbc.PolicyLossConfig(**{field: value})


def test_double_backward_refused(backend):
    batch = make_batch(seed=2)
    h = batch["hidden"].clone().requires_grad_(True)
    loss, _ = gbc.fused_linear_policy_loss(h, batch["weight"], batch["targets"], batch["mask"],
                                           batch["advantages"], batch["old_logp"],
                                           backend=backend)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, h, create_graph=True)
    y = batch["targets"].clamp(min=0)
    logp, _ = gbc.fused_linear_logprobs(h, batch["weight"], y, backend=backend)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(logp.sum(), h, create_graph=True)


@pytest.mark.parametrize("upstream", [1.0, 0.3])
def test_second_backward_through_one_loss_refused(backend, upstream):
    """The fused gradients are scaled in place and handed over by the first backward: a second
    one (retain_graph=True) raises instead of returning gradients scaled twice; the first one's
    gradients are those of a fresh loss."""
    batch = make_batch(seed=4)
    args = (batch["weight"], batch["targets"], batch["mask"], batch["advantages"],
            batch["old_logp"])
    h = batch["hidden"].clone().requires_grad_(True)
    loss, _ = gbc.fused_linear_policy_loss(h, *args, backend=backend)
    (loss * upstream).backward(retain_graph=True)
    first = h.grad.clone()
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        (loss * upstream).backward()
    h2 = batch["hidden"].clone().requires_grad_(True)
    loss2, _ = gbc.fused_linear_policy_loss(h2, *args, backend=backend)
    loss2.backward()
    torch.testing.assert_close(first, h2.grad * upstream, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("value", [0.5, 2.0, float("nan")])
def test_mask_values_other_than_0_1_refused(value):
    batch = make_batch(seed=3)
    m = batch["mask"].float()
    m[0, 0] = value
    with pytest.raises(ValueError, match="mask: expected a boolean or 0/1 mask"):
        gbc.fused_linear_policy_loss(batch["hidden"], batch["weight"], batch["targets"], m,
                                     batch["advantages"])


def test_integer_and_float_0_1_masks_equal_bool():
    batch = make_batch(seed=3)
    out = [gbc.fused_linear_policy_loss(batch["hidden"], batch["weight"], batch["targets"], m,
                                        batch["advantages"], batch["old_logp"])[0]
           for m in (batch["mask"], batch["mask"].long(), batch["mask"].float())]
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])


@pytest.mark.parametrize("name", ["old_logp", "ref_logp"])
def test_positive_logprobs_refused(name):
    batch = make_batch(seed=4)
    b, t = batch["mask"].nonzero()[0].tolist()
    batch[name] = batch[name].clone()
    batch[name][b, t] = 0.7                      # a probability passed by mistake
    with pytest.raises(ValueError, match=f"{name}: expected log-probabilities"):
        gbc.fused_linear_policy_loss(batch["hidden"], batch["weight"], batch["targets"],
                                     batch["mask"], batch["advantages"], batch["old_logp"],
                                     batch["ref_logp"], config=gbc.PolicyLossConfig(kl_coef=0.1))


def test_wrong_hidden_size_blames_hidden():
    batch = make_batch(seed=4)
    with pytest.raises(ValueError, match="hidden: expected hidden size H = 16"):
        gbc.fused_linear_policy_loss(batch["hidden"][..., :12], batch["weight"],
                                     batch["targets"], batch["mask"], batch["advantages"])


@pytest.mark.parametrize("name,value,message", [
    ("sampling_logp", 0.7, "sampling_logp: expected log-probabilities"),
    ("sampling_logp", float("inf"), "sampling_logp: expected finite values or NaN"),
    ("sampling_logp", float("-inf"), "sampling_logp: expected finite values or NaN"),
    ("is_ratio", -0.5, "is_ratio: expected importance weights >= 0"),
    ("is_ratio", float("inf"), "is_ratio: expected finite values"),
    ("advantages", float("nan"), "advantages: expected finite values"),
])
@pytest.mark.parametrize("entry", ["fused", "from_logp"])
def test_batched_value_checks_name_the_argument_and_index(name, value, message, entry):
    """The per-token value checks run as one batched test per rule; a failure still names the
    argument, the rule and the first bad index, for the fused loss and the logp-given loss."""
    batch = make_batch(seed=6, adv_shape="BT")
    b, t = batch["mask"].nonzero()[1].tolist()
    B, T = batch["mask"].shape
    extra = dict(sampling_logp=batch["old_logp"].clone(), is_ratio=torch.ones(B, T))
    cfg = gbc.PolicyLossConfig(off_policy_mask_threshold=0.5)
    if name == "advantages":
        batch["advantages"] = batch["advantages"].clone()
        batch["advantages"][b, t] = value
    else:
        extra[name][b, t] = value
    with pytest.raises(ValueError, match=rf"{message}.*\[{b}, {t}\]"):
        if entry == "fused":
            gbc.fused_linear_policy_loss(batch["hidden"], batch["weight"], batch["targets"],
                                         batch["mask"], batch["advantages"], batch["old_logp"],
                                         config=cfg, **extra)
        else:
            gbc.policy_loss(batch["old_logp"], batch["mask"], batch["advantages"],
                            batch["old_logp"], config=cfg, **extra)


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", ""])
def test_bad_chunk_budget_env_named(monkeypatch, value):
    """GBC_CHUNK_MB must be a positive number of MiB: anything else is named, not turned into
    one-row chunks or an obscure float() error."""
    batch = make_batch(seed=6)
    monkeypatch.setenv("GBC_CHUNK_MB", value)
    with pytest.raises(ValueError, match="GBC_CHUNK_MB: expected a positive number"):
        gbc.fused_linear_policy_loss(batch["hidden"], batch["weight"], batch["targets"],
                                     batch["mask"], batch["advantages"], batch["old_logp"])
    monkeypatch.setenv("GBC_CHUNK_MB", "0.5")           # a fraction of a MiB is fine
    loss, _ = gbc.fused_linear_policy_loss(batch["hidden"], batch["weight"], batch["targets"],
                                           batch["mask"], batch["advantages"],
                                           batch["old_logp"])
    assert torch.isfinite(loss)


@pytest.mark.parametrize("value,on", [("0", False), ("false", False), ("OFF", False),
                                      ("1", True), ("yes", True), ("maybe", None)])
def test_validate_switch(monkeypatch, value, on):
    """GBC_VALIDATE takes the usual spellings of on and off; any other value is named."""
    batch = make_batch(seed=7)
    batch["mask"][:] = True
    batch["old_logp"][0, 1] = float("nan")          # caught only while the checks run
    monkeypatch.setenv("GBC_VALIDATE", value)
    call = lambda: gbc.fused_linear_policy_loss(batch["hidden"], batch["weight"],
                                                batch["targets"], batch["mask"],
                                                batch["advantages"], batch["old_logp"])
    if on is None:
        with pytest.raises(ValueError, match="GBC_VALIDATE: expected"):
            call()
    elif on:
        with pytest.raises(ValueError, match="old_logp: expected finite"):
            call()
    else:
        call()                                       # no check: the NaN flows into the loss
