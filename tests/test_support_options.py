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


@pytest.mark.parametrize("field,value", [
    ("top_k", "all"), ("top_k", 5.7), ("top_k", True), ("top_k", "20"),
    ("top_p", "0.9x"), ("top_p", True), ("top_p", 1.5), ("min_p", "x"), ("min_p", False),
])
def test_sampler_settings_refused_by_field_never_rounded(field, value):
    """issue 65, 4: a trainer's setting of the wrong type or range is refused naming the field
    in the trainer's words (``names``), as ``SamplerTruncation`` refuses it — ``top_k=5.7`` is
    never 5, ``top_k=True`` never 1 (greedy)."""
    kw = {"top_k": 20, "top_p": 0.9, "min_p": 0.0, field: value}
    with pytest.raises(ValueError, match=rf"^rollout\.{field}=.*|^gbc_support=replay: "
                                         rf"rollout\.{field}: expected"):
        methods.sampler_truncation(methods.MethodOptions(support="replay"), **kw,
                                   names={"support": "gbc_support",
                                          field: f"rollout.{field}"})


def test_corrected_sampler_logp_checks_its_inputs():
    """issue 65, 5: a ``log_kept_mass`` of another shape is refused naming it (never
    broadcast); ``normalised`` must be a real bool (``'no'`` is not True)."""
    import torch

    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    f = methods.corrected_sampler_logp
    for bad in (torch.zeros(3), torch.zeros(3, 1), torch.zeros(1, 3, 1)):
        with pytest.raises(ValueError, match=r"^log_kept_mass: expected sampling_logp's shape"):
            f(lp, bad, "kept_mass")
    with pytest.raises(TypeError, match="^log_kept_mass: expected a tensor"):
        f(lp, [[0.0, 0.0, 0.0]], "replay", normalised=False)
    for bad in ("no", 0, 1, None):
        with pytest.raises(TypeError, match=r"^normalised: expected a bool"):
            f(lp, torch.zeros(1, 3), "replay", normalised=bad)


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
