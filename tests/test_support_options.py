"""``support`` / ``support_ties`` (the sampler's kept set rebuilt from the sampling settings,
issue 61) through each adapter's own option path: run where the adapter rebuilds the set
(each trainer's own tests), refused by name everywhere else — never accepted and ignored."""

from __future__ import annotations

import pytest

from gbc_kernels import methods


def test_the_method_layer_checks_and_maps_the_settings():
    o = methods.MethodOptions(support="kept_mass")
    tr = methods.sampler_truncation(o, top_k=-1, top_p=0.9, min_p=None)
    assert (tr.top_k, tr.top_p, tr.min_p, tr.ties, tr.rule) == (None, 0.9, 0.0, "first", "vllm")
    tr = methods.sampler_truncation(methods.MethodOptions(support="replay", support_ties="all"),
                                    top_k=20, rule="sglang", ties="first")
    assert (tr.top_k, tr.ties, tr.rule) == (20, "all", "sglang")
    assert methods.sampler_truncation(methods.MethodOptions(), top_k=20) is None
    assert methods.MethodOptions(support="off").support is None
    with pytest.raises(ValueError, match="^gbc_support=replay: the rollout samples without"):
        methods.sampler_truncation(methods.MethodOptions(support="replay"), top_k=0, top_p=1.0,
                                   names={"support": "gbc_support"})
    with pytest.raises(ValueError, match="^gbc_support=replay: top_p"):
        methods.sampler_truncation(methods.MethodOptions(support="replay"), top_p=1.5,
                                   names={"support": "gbc_support"})
    with pytest.raises(ValueError, match="support: expected one of"):
        methods.MethodOptions(support="recompute")
    with pytest.raises(ValueError, match="support_ties: expected one of"):
        methods.MethodOptions(support_ties="last")


def test_corrected_sampler_logp():
    import torch

    lp, lk = torch.tensor([-1.0, -2.0]), torch.tensor([-0.1, -0.3])
    f = methods.corrected_sampler_logp
    assert torch.equal(f(lp, lk, None), lp)
    assert torch.allclose(f(lp, lk, "kept_mass"), lp + lk)          # vLLM's processed
    assert torch.equal(f(lp, lk, "replay"), lp)
    assert torch.allclose(f(lp, lk, "replay", normalised=False), lp - lk)    # SGLang's
    with pytest.raises(ValueError, match="support=kept_mass: .*full vocabulary"):
        f(lp, lk, "kept_mass", normalised=False)


def _skyrl():
    from gbc_kernels.integrations.skyrl import worker
    return lambda text: worker.method_options(text)


def _verl_register():
    pytest.importorskip("verl")
    from gbc_kernels.integrations import verl as gv

    def reg(text):
        name, value = text.split("=")
        gv.register("gbc_support_refused", **{name: value})
    return reg


# the adapters that do not rebuild the set: each refuses both options by name (SkyRL replays
# its engine's recorded support; verl's registry route sees no pass). TRL, verl's engines,
# OpenRLHF and AReaL run them: tests/test_{trl,verl,openrlhf,areal}_support.py
REFUSING = {"skyrl": _skyrl, "verl-register": _verl_register}


@pytest.mark.parametrize("adapter", sorted(REFUSING))
@pytest.mark.parametrize("text", ["support=replay", "support=kept_mass", "support_ties=all"])
def test_refused_by_name_where_not_run(adapter, text):
    parse = REFUSING[adapter]()
    name = text.split("=")[0]
    with pytest.raises(ValueError, match=rf"{name}={text.split('=')[1]}: not run by this gbc"):
        parse(text)
