"""Bad input through the newer options and ``hf.policy_loss_through_forward``: each case was
silently wrong or an unclear error before; now a clear error naming the argument, or a
documented result checked against a float64 formula written here."""

from __future__ import annotations

import math

import pytest
import torch

import gbc_kernels as gbc
import gbc_reference as ref
from conftest import make_batch
from gbc_kernels.integrations import hf

# ----------------------------------------------------------------------------------------------
# config fields: types and meaningless values
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(kl_ratio_correction="no"), TypeError, "kl_ratio_correction: expected a bool, got str"),
    (dict(kl_ratio_correction="False"), TypeError, "kl_ratio_correction: expected a bool"),
    (dict(return_entropy="no"), TypeError, "return_entropy: expected a bool"),
    (dict(return_entropy=2), TypeError, "return_entropy: expected a bool, got int"),
    (dict(return_entropy=0.5), TypeError, "return_entropy: expected a bool, got float"),
    (dict(objective=["cispo"]), TypeError, r"objective: expected a str, got list \['cispo'\]"),
    (dict(kl_agg=["token-mean"]), TypeError, "kl_agg: expected a str or None, got list"),
    (dict(loss_agg=3), TypeError, "loss_agg: expected a str"),
    (dict(kl_estimator=None), TypeError, "kl_estimator: expected a str"),
    (dict(objective="vespo", vespo_lambda_pos=0.0), ValueError, "vespo_lambda_pos: expected a "
                                                                 "float > 0"),
    (dict(objective="vespo", vespo_lambda_neg=-1.0), ValueError, "vespo_lambda_neg"),
    (dict(clip_ratio_c=float("inf")), ValueError, "clip_ratio_c: expected None or a finite"),
])
def test_config_refuses(kwargs, err, match):
    with pytest.raises(err, match=match):
        gbc.PolicyLossConfig(**kwargs)


def test_preset_refuses_a_list():
    with pytest.raises(ValueError, match=r"loss_type: expected one of .* got \['grpo'\]"):
        gbc.PolicyLossConfig.preset(["grpo"])


def test_logprobs_flags_are_bools():
    h, w, y = torch.randn(3, 4), torch.randn(7, 4), torch.zeros(3, dtype=torch.long)
    for bad in ("no", 1, 0.5):
        with pytest.raises(TypeError, match="return_entropy: expected a bool"):
            gbc.fused_linear_logprobs(h, w, y, return_entropy=bad)


# ----------------------------------------------------------------------------------------------
# num_items_in_batch / num_seqs_in_batch
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,match", [
    (float("inf"), "num_items_in_batch: expected a finite number > 0, got inf"),
    (torch.tensor(float("inf")), "num_items_in_batch: expected a finite count > 0, got inf"),
    (torch.tensor(float("nan")), "num_items_in_batch: expected a finite count > 0"),
    (True, "num_items_in_batch: expected a finite number > 0, got True"),
    (torch.tensor(3.0, device="meta"), "num_items_in_batch: expected a tensor with data, got one "
                                       "on the meta device"),
    (torch.tensor(True), "num_items_in_batch: expected a real count"),
])
def test_num_items_refused(backend, value, match):
    b = make_batch(B=2, T=4, V=11, seed=1)
    with pytest.raises((ValueError, TypeError), match=match):
        gbc.fused_linear_policy_loss(b["hidden"], b["weight"], b["targets"], b["mask"],
                                     b["advantages"], num_items_in_batch=value, backend=backend)
    with pytest.raises((ValueError, TypeError), match=match.replace("num_items_in_batch",
                                                                    "num_seqs_in_batch")):
        gbc.policy_loss(b["old_logp"], b["mask"], b["advantages"], num_seqs_in_batch=value)


# ----------------------------------------------------------------------------------------------
# the entropy quantile of float64 inputs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q", [0.0, 1e-9, 0.5, 0.37])
@pytest.mark.parametrize("lib", [gbc, ref], ids=["gbc", "reference"])
def test_entropy_quantile_float64_keeps_trl_share(q, lib):
    """``policy_loss`` with float64 log-probs / entropies: the tokens kept are exactly those
    whose entropy is >= TRL's ``torch.quantile(entropy[mask], 1 - q)`` in float64 (the
    threshold once rounded through float32 dropped the token at it: q = 0 kept none, q = 0.5
    kept 3 of 7). Checked against that formula: the loss of -A * logp summed over the kept
    tokens."""
    g = torch.Generator().manual_seed(3)
    ent = torch.rand(1, 7, generator=g, dtype=torch.float64) * 2.3
    logp = -torch.rand(1, 7, generator=g, dtype=torch.float64)
    mask = torch.ones(1, 7, dtype=torch.bool)
    thr = torch.quantile(ent[mask], 1 - q)                   # TRL's, in float64
    keep = (ent >= thr) & mask
    cfg = lib.PolicyLossConfig(loss_agg="seq-mean-token-sum", top_entropy_quantile=q,
                               epsilon_low=0.5, epsilon_high=0.5)
    adv = torch.ones(1, dtype=torch.float64)
    loss, _ = lib.policy_loss(logp, mask, adv, old_logp=logp, entropy=ent, config=cfg)
    want = -(keep.double()).sum()                        # -A r with r = 1 on each kept token
    assert int(keep.sum()) == max(1, math.ceil(q * 7 - 1e-12)) or q == 0.37
    assert float(loss) == float(want), (float(loss), float(want), int(keep.sum()))


# ----------------------------------------------------------------------------------------------
# hf.policy_loss_through_forward: the inputs are checked before the model sees them
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=41, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    return Qwen2ForCausalLM(cfg)


@pytest.mark.parametrize("case,err,match", [
    ("mask-completion-shape", ValueError, r"attention_mask: expected shape \[2, 8\] \(the whole "
                                          r"sequence, as input_ids\), got \[2, 3\]"),
    ("mask-long", ValueError, r"attention_mask: expected shape \[2, 8\].*got \[2, 9\]"),
    ("mask-short", ValueError, r"attention_mask: expected shape \[2, 8\].*got \[2, 7\]"),
    ("mask-1d", ValueError, r"attention_mask: expected shape \[2, 8\].*got \[8\]"),
    ("ids-1d", ValueError, r"input_ids: expected an integer tensor \[B, L\], got torch.int64 "
                           r"tensor of shape \[8\]"),
    ("ids-float", ValueError, r"input_ids: expected an integer tensor \[B, L\], got "
                              r"torch.float32"),
    ("len-L", ValueError, r"completion_len: expected 1 <= completion_len <= L - 1 = 7"),
    ("len-L+3", ValueError, r"completion_len: expected 1 <= completion_len"),
    ("len-None", TypeError, r"completion_len: expected an int .* got NoneType None"),
    ("len-5.7", TypeError, r"completion_len: expected an int .* got float 5.7"),
    ("len-str", TypeError, r"completion_len: expected an int .* got str '5'"),
    ("id-prompt", ValueError, r"input_ids: expected token ids in \[0, 41\) \(the model's "
                              r"embedding\), got 41 at index \[1, 0\]"),
    ("id-completion", ValueError, r"input_ids: expected token ids in \[0, 41\).* got 99 at "
                                  r"index \[0, 7\]"),
    ("id-negative", ValueError, r"input_ids: expected token ids in \[0, 41\).* got -1"),
])
def test_through_forward_inputs(model, case, err, match):
    ids = torch.randint(0, 41, (2, 8), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 8, dtype=torch.long)
    T = 3
    if case == "mask-completion-shape":
        am = am[:, -T:]
    elif case == "mask-long":
        am = torch.ones(2, 9, dtype=torch.long)
    elif case == "mask-short":
        am = am[:, 1:]
    elif case == "mask-1d":
        am = am[0]
    elif case == "ids-1d":
        ids = ids[0]
    elif case == "ids-float":
        ids = ids.float()
    elif case.startswith("len-"):
        T = {"len-L": 8, "len-L+3": 11, "len-None": None, "len-5.7": 5.7, "len-str": "5"}[case]
    elif case == "id-prompt":
        ids[1, 0] = 41
    elif case == "id-completion":
        ids[0, 7] = 99
    elif case == "id-negative":
        ids[0, 2] = -1
    with pytest.raises(err, match=match):
        hf.policy_loss_through_forward(model, ids, am, T, torch.ones(2, 3, dtype=torch.bool),
                                       torch.ones(2))


def test_through_forward_refuses_a_model_without_lm_head():
    with pytest.raises(ValueError, match="model: expected a transformers causal LM"):
        hf.policy_loss_through_forward(torch.nn.Linear(4, 4), torch.zeros(1, 5, dtype=torch.long),
                                       None, 2, torch.ones(1, 2, dtype=torch.bool), torch.ones(1))


def test_through_forward_left_padding_respected(model):
    """The whole-sequence attention mask (left padding) reaches the model: the loss equals the
    plain full-logits loss with that mask (and differs from the unpadded one)."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 41, (2, 8), generator=g)
    am = torch.ones(2, 8, dtype=torch.long)
    am[0, :3] = 0
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5])
    old = -torch.rand(2, 3, generator=g)
    loss, _ = hf.policy_loss_through_forward(model, ids, am, 3, mask, adv, old_logp=old)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am).logits[:, -4:-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, -3:, None])[..., 0]
    want, _ = gbc.policy_loss(logp, mask, adv, old_logp=old)
    assert abs(float(loss) - float(want)) < 1e-5
    loss_nopad, _ = hf.policy_loss_through_forward(model, ids, torch.ones_like(am), 3, mask, adv,
                                                   old_logp=old)
    assert abs(float(loss_nopad) - float(loss)) > 1e-6


# ----------------------------------------------------------------------------------------------
# Errors in the caller's words: the hf passes name the caller's arguments, not gbc's
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_head_model(model):
    """``model`` with an lm_head of 30 rows, fewer than its embedding's 41: ids 30..40 pass
    the embedding's check and are outside the head's vocabulary."""
    import copy

    m = copy.deepcopy(model)
    m.lm_head = torch.nn.Linear(16, 30, bias=False)
    return m


@pytest.mark.parametrize("call", ["policy_loss_through_forward", "logprobs_through_forward"])
def test_hf_targets_are_named_input_ids(small_head_model, call):
    """An id outside the lm_head's vocabulary among the predicted tokens is reported as
    ``input_ids`` at its index in ``input_ids`` (gbc saw ``input_ids[:, -T:]`` as ``targets``);
    an out-of-range id on a masked-out position is not an error; nothing was changed."""
    ids = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(1))
    ids[1, 6], ids[0, 7] = 36, 35
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 1] = False                                # ids[1, 6] is masked out
    kept = (ids.clone(), mask.clone())
    with pytest.raises(ValueError) as info:
        if call == "policy_loss_through_forward":
            hf.policy_loss_through_forward(small_head_model, ids, None, 3, mask, torch.ones(2))
        else:
            hf.logprobs_through_forward(small_head_model, ids[:1], None, 3)
    assert str(info.value) == ("input_ids: expected token ids in [0, 30) on masked-in "
                               "positions, got 35 at index [0, 7]")
    assert torch.equal(ids, kept[0]) and torch.equal(mask, kept[1])
    assert all(p.grad is None for p in small_head_model.parameters())


@pytest.mark.parametrize("kwargs,err,message", [
    (dict(nthr_beta="1"), TypeError, "nthr_beta: expected a float, got str"),
    (dict(nthr_eta=-0.5), ValueError, "nthr_eta: expected 'auto' or a float >= 0, got -0.5"),
])
def test_hf_old_policy_pass_names_nthr_options(model, kwargs, err, message):
    """NTHR's options of ``old_policy_pass`` are named as the caller passed them (gbc's
    ``nthr_scale`` calls them ``beta`` and ``eta``)."""
    ids = torch.randint(0, 41, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(err) as info:
        hf.old_policy_pass(model, ids, None, ids[:, -3:], mask, group_ids=torch.zeros(2).long(),
                           correct=torch.tensor([True, False]), nthr=True, completion_len=3,
                           **kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("kwargs,message", [
    (dict(intercept=1.5), "intercept: expected a float >= 0.0 and <= 1.0, got 1.5"),
    (dict(certainty="top1"), "certainty: expected one of ('max_prob', 'entropy'), got 'top1'"),
    (dict(certainty_temperature=0.0),
     "certainty_temperature: expected a float > 0.0, got 0.0"),
])
def test_hf_reference_pass_names_its_keywords(model, kwargs, message):
    """``reference_pass``'s critical-KL keywords are named as the caller passed them (the
    method options call them ``critical_kl_intercept`` ...)."""
    ids = torch.randint(0, 41, (2, 8), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError) as info:
        hf.reference_pass(model, ids, None, ids[:, -3:], critical_kl_exponent=2.0,
                          completion_len=3, **kwargs)
    assert str(info.value) == message


def test_in_callers_words_renames_only_the_named_argument():
    """The mechanism itself: the leading argument (or ``argument.field``) is renamed, the same
    exception object raised (type kept); an error naming another argument, or none, passes
    unchanged; ``recheck`` replaces a ValueError only."""
    from gbc_kernels.methods import in_callers_words

    names = {"targets": "labels", "vocab_parallel": "output_weight",
             "vocab_parallel.group": "tp_group"}

    def raised(exc, recheck=None):
        with pytest.raises(type(exc)) as info:
            with in_callers_words(names, recheck):
                raise exc
        assert info.value is exc or recheck is not None
        return str(info.value)

    assert raised(ValueError("targets: expected ids, got 9")) == "labels: expected ids, got 9"
    assert raised(TypeError("targets: expected an integer dtype")) == \
        "labels: expected an integer dtype"
    assert raised(ValueError("vocab_parallel: slices")) == "output_weight: slices"
    assert raised(ValueError("vocab_parallel.group: not a member")) == "tp_group: not a member"
    assert raised(ValueError("vocab_parallel.start: x")) == "output_weight.start: x"
    assert raised(ValueError("mask: expected bool")) == "mask: expected bool"
    assert raised(ValueError("no argument named here")) == "no argument named here"

    def own():
        raise ValueError("labels: at index [1, 5]")

    assert raised(ValueError("targets: at index [7]"), {"targets": own}) == \
        "labels: at index [1, 5]"
    assert raised(TypeError("targets: dtype"), {"targets": own}) == "labels: dtype"
    assert raised(ValueError("targets: at index [7]"), {"targets": lambda: None}) == \
        "labels: at index [7]"
