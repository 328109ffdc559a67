"""transformers 5.25 and gbc's verl path (issue 65, defect 0).

transformers 5.25 kernelizes every ``from_pretrained`` model by default; under verl's
meta-device init (accelerate's ``init_empty_weights`` on every rank but 0) the ``kernels``
package refuses the device ``meta``. :func:`gbc_kernels.integrations.releases.no_hub_kernels`
(``USE_HUB_KERNELS=NO`` around the build) avoids the call: these tests build a tiny model as
verl's non-zero ranks do, with and without it, on whatever transformers is installed (the test
venv's 5.24.0; ``make compat ONLY=transformers==newest``'s newest release).
"""

from __future__ import annotations

import os

import pytest
import torch

from gbc_kernels.integrations import releases

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

ENV = releases.HUB_KERNELS_ENV


def _at_least(version: str, release: tuple) -> bool:
    return releases._patch(version) >= release


KERNELIZES_BY_DEFAULT = _at_least(transformers.__version__, (5, 25, 0))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 (untied lm_head: verl then builds the non-zero ranks on ``meta``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("qwen2")
    Qwen2ForCausalLM(cfg).save_pretrained(str(d))
    return str(d)


def _build(model_dir, meta: bool):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    if meta:
        with init_empty_weights():
            return AutoModelForCausalLM.from_pretrained(model_dir)
    return AutoModelForCausalLM.from_pretrained(model_dir)


@pytest.fixture
def env_unset(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


@pytest.mark.parametrize("before", [None, "YES", "no"])
def test_no_hub_kernels_sets_and_restores(monkeypatch, before):
    if before is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, before)
    with releases.no_hub_kernels():
        assert os.environ[ENV] == "NO"
    assert os.environ.get(ENV) == before
    with pytest.raises(KeyError):
        with releases.no_hub_kernels():
            raise KeyError("inside")
    assert os.environ.get(ENV) == before


def test_meta_init_builds_under_no_hub_kernels(model_dir, env_unset):
    """verl's non-zero ranks: the model on ``meta``, nothing kernelized, and ``train()``
    (verl's next call on it) does not kernelize later."""
    with releases.no_hub_kernels():
        model = _build(model_dir, meta=True)
    assert model.device.type == "meta"
    assert not model.use_kernels
    model.train()
    assert not model.use_kernels and model.device.type == "meta"


@pytest.mark.skipif(not KERNELIZES_BY_DEFAULT,
                    reason=f"transformers {transformers.__version__} does not kernelize by "
                           "default (5.25 and later do)")
def test_meta_init_without_it_is_refused_by_kernels(model_dir, env_unset):
    """The defect itself, on a transformers that kernelizes by default: ``from_pretrained``
    under verl's meta-device init is refused by the ``kernels`` package. Should a release stop
    failing here, :func:`releases.no_hub_kernels` may no longer be needed."""
    with pytest.raises(ValueError, match="meta"):
        _build(model_dir, meta=True)


def test_no_hub_kernels_keeps_the_model(model_dir, env_unset):
    """On rank 0 (a CPU build) the model is the same with and without it: the same module
    classes and forwards, the same log-probs and gradients."""
    plain = _build(model_dir, meta=False)
    with releases.no_hub_kernels():
        off = _build(model_dir, meta=False)
    assert not off.use_kernels
    assert [type(m) for m in plain.modules()] == [type(m) for m in off.modules()]
    assert [getattr(m.forward, "__func__", m.forward) for m in plain.modules()] == \
        [getattr(m.forward, "__func__", m.forward) for m in off.modules()]
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    outs = []
    for model in (plain, off):
        model.train()
        model.zero_grad()
        logp = torch.log_softmax(model(ids).logits.float(), -1)
        logp[..., 3].sum().backward()
        outs.append((logp.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
