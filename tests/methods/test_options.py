"""Every method option on every adapter is honoured or refused by name at start-up, never
accepted and ignored (docs/methods.md). Each test enumerates the method layer's fields
(:class:`gbc_kernels.methods.MethodOptions`), so a new option without its wiring fails here.
(OpenRLHF's enumeration: tests/test_openrlhf.py.)"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from gbc_kernels import methods

FIELDS = {f.name for f in dataclasses.fields(methods.MethodOptions)}
# the sampler's kept set (issue 61): run by the adapters that rebuild it, refused by the others
# (tests/test_support_options.py)
SUPPORT_FIELDS = {"support", "support_ties", "support_set"}

# per option: (the options of run A, of run B): the two runs differ only in that option, with
# whatever else it needs switched on in both
PAIRS = {
    "ar_alpha": ({}, dict(ar_alpha=1.0)),
    "lopti_eta": ({}, dict(lopti_eta=1 / 40)),
    "lopti_order": (dict(lopti_eta=1 / 40), dict(lopti_eta=1 / 40, lopti_order="high-first")),
    "nthr": (dict(nthr_beta=0.0), dict(nthr=True, nthr_beta=0.0)),
    "nthr_beta": (dict(nthr=True, nthr_beta=0.0, nthr_eta=0.0),
                  dict(nthr=True, nthr_beta=-1e9, nthr_eta=0.0)),
    "nthr_eta": (dict(nthr=True, nthr_beta=0.0), dict(nthr=True, nthr_beta=0.0, nthr_eta=0.0)),
    "critical_kl_exponent": ({}, dict(critical_kl_exponent=2.0)),
    "critical_kl_intercept": (dict(critical_kl_exponent=2.0),
                              dict(critical_kl_exponent=2.0, critical_kl_intercept=0.5)),
    "critical_kl_certainty": (dict(critical_kl_exponent=2.0),
                              dict(critical_kl_exponent=2.0, critical_kl_certainty="entropy")),
    "critical_kl_temperature": (dict(critical_kl_exponent=2.0),
                                dict(critical_kl_exponent=2.0, critical_kl_temperature=0.3)),
    # the head's precision: every pass on (old policy with NTHR, reference with critical KL, the
    # loss); with float32 test models it changes no number, so the runs' sweeps are checked to
    # receive the mode (conftest.logits_dtypes_seen), not their parameters
    "logits_dtype": (dict(nthr=True, nthr_beta=0.0, critical_kl_exponent=2.0),
                     dict(nthr=True, nthr_beta=0.0, critical_kl_exponent=2.0,
                          logits_dtype="float32")),
}
PRECISION = "logits_dtype"


def test_every_field_has_a_case():
    assert set(PAIRS) | SUPPORT_FIELDS == FIELDS


@pytest.mark.parametrize("name,value", [
    ("ar_alpha", float("nan")), ("lopti_eta", float("inf")), ("lopti_order", "sideways"),
    ("nthr", "yes"), ("nthr_beta", float("nan")), ("nthr_eta", -1.0),
    ("critical_kl_exponent", float("inf")), ("critical_kl_intercept", 2.0),
    ("critical_kl_certainty", "vibes"), ("critical_kl_temperature", 0.0),
    ("logits_dtype", "bf16"), ("logits_dtype", torch.float16)])
def test_bad_values_are_refused_by_the_trainers_name(name, value):
    assert name in FIELDS
    with pytest.raises(ValueError, match=f"^--{name}: .*gbc's {name}"):
        methods.MethodOptions.from_kwargs({name: f"--{name}"}, **{name: value})
    with pytest.raises(ValueError, match="not a method option"):
        methods.MethodOptions.from_kwargs(unknown=1)


# ---------------------------------------------------------------------------------- TRL
def _trl_run(tiny, tmp_path, options):
    """The parameters after two TRL steps (fixed seed: the same first rollout in every run;
    the second step's KL term is not 0, so the KL weights act)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from gbc_kernels.integrations.trl import GBCGRPOConfig, GBCGRPOTrainer

    args = GBCGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                         num_generations=4, max_completion_length=6, report_to=[],
                         use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", seed=0,
                         optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0,
                         learning_rate=5.0, loss_type="bnpo", beta=0.5, max_steps=2,
                         **{f"gbc_{k}": v for k, v in options.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GBCGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(tiny),
            reward_funcs=lambda completions, **kw: [float(len(c) % 3 == 0) for c in completions],
            args=args, train_dataset=Dataset.from_dict({"prompt": ["you meet knights and knaves"] * 4}),
            processing_class=AutoTokenizer.from_pretrained(tiny))
        trainer.train()
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])


def _initial(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_trl_honours_every_option(tiny, tmp_path, name):
    a, b = PAIRS[name]
    if name == PRECISION:
        from conftest import assert_logits_mode_reached, logits_dtypes_seen
        with logits_dtypes_seen() as seen_a:
            _trl_run(tiny, tmp_path / "a", a)
        with logits_dtypes_seen() as seen_b:
            _trl_run(tiny, tmp_path / "b", b)
        assert_logits_mode_reached(seen_a, seen_b, at_least=3)
        return
    pa = _trl_run(tiny, tmp_path / "a", a)
    pb = _trl_run(tiny, tmp_path / "b", b)
    # more than rounding: a share of the parameters' total change over the two steps
    start = _initial(tiny)
    assert float((pa - pb).abs().max()) > 1e-3 * float((pa - start).abs().max()), name


def test_trl_names_every_option():
    from gbc_kernels.integrations.trl import GBCGRPOConfig, METHOD_NAMES

    assert set(METHOD_NAMES) == FIELDS
    assert all(n in GBCGRPOConfig.__dataclass_fields__ for n in METHOD_NAMES.values())


# ------------------------------------------------------------------------ example trainer
def test_example_trainer_names_every_option():
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    gt = importlib.import_module("grpo_trainer")
    args = gt.build_args([])
    # every method option has a flag, or is refused at start-up naming it
    missing = FIELDS - set(gt.METHOD_FLAGS)
    assert missing == {"nthr_eta", "critical_kl_intercept"} | SUPPORT_FIELDS, missing
    for name, flag in gt.METHOD_FLAGS.items():
        assert hasattr(args, name) and flag.startswith("--")


# ------------------------------------------------------------------------------- verl
def test_verl_engine_options_are_the_method_options():
    pytest.importorskip("verl")
    from gbc_kernels.integrations.verl import engine as ve

    assert issubclass(ve.EngineOptions, methods.MethodOptions)
    # the trainer's reference pass hands the worker every critical-KL option
    assert set(ve.CRITICAL_KL_FIELDS) == {f for f in FIELDS if f.startswith("critical_kl")}
    assert set(ve.OPTION_NAMES) == FIELDS | {"backend"}
    with pytest.raises(ValueError, match="ar_alpha given twice"):
        ve.EngineOptions.parse("ar_alpha=0.1,ar_alpha=0.2")
    for text in ("nthr_beta=nan", "critical_kl_exponent=inf", "lopti_eta=nan"):
        with pytest.raises(ValueError, match=text.split("=")[0]):
            ve.EngineOptions.parse(text)


def test_verl_registry_route_honours_or_refuses_every_option():
    """``integrations.verl.register(**options)``: AR and Lopti change the registered loss (its
    value and gradient against the same call without the option; ``lopti_order`` the order of
    the phases); NTHR and critical-token KL, which the registered loss cannot see, are refused
    at registration naming the option; nonsense is refused by name."""
    pytest.importorskip("verl")
    from verl.trainer.ppo import core_algos

    from gbc_kernels.integrations import verl as gv

    g = torch.Generator().manual_seed(7)
    B, T = 3, 6
    old = -torch.rand(B, T, generator=g) * 3
    logp0 = old + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    mask = torch.ones(B, T)
    cfg = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
           "clip_ratio_c": 3.0, "global_batch_info": {}}

    def run(name, **options):
        reg = gv.register(name, **options)
        fn = core_algos.get_policy_loss_fn(name)
        out = []
        for phase in reg.phases:
            logp = logp0.clone().requires_grad_(True)
            if phase is None:
                loss = fn(old, logp, adv, mask, "token-mean", cfg)[0]
            else:
                with reg.phase(phase):
                    loss = fn(old, logp, adv, mask, "token-mean", cfg)[0]
            out.append((phase, loss.detach(), torch.autograd.grad(loss, logp)[0]))
        return out

    honoured = {"ar_alpha": ({}, dict(ar_alpha=1.0)), "lopti_eta": ({}, dict(lopti_eta=0.5)),
                "lopti_order": (dict(lopti_eta=0.5), dict(lopti_eta=0.5,
                                                          lopti_order="high-first"))}
    for name in sorted(FIELDS - SUPPORT_FIELDS):
        if name in honoured:
            a, b = honoured[name]
            ra, rb = run(f"gbc_opt_a_{name}", **a), run(f"gbc_opt_b_{name}", **b)
            if name == "lopti_order":
                assert [p for p, *_ in ra] == ["low", "high"]
                assert [p for p, *_ in rb] == ["high", "low"]
                continue
            for _, _, grad in rb:       # AR's loss, and each Lopti phase's, is not the plain one
                assert (grad - ra[0][2]).abs().max() > 1e-4, name
        elif name == PRECISION:         # the registered loss takes verl's own log-probs
            with pytest.raises(ValueError, match=f"^{name}: not run by the registry route"):
                gv.register(f"gbc_opt_{name}", logits_dtype="float32")
        else:
            switch = "nthr" if name.startswith("nthr") else "critical_kl_exponent"
            assert switch in PAIRS[name][1]
            with pytest.raises(ValueError, match=f"^{switch}: not run by the registry route"):
                gv.register(f"gbc_opt_{name}", **PAIRS[name][1])
    with pytest.raises(ValueError, match="not a method option"):
        gv.register("gbc_opt_bad", alpha=0.1)
    for name in sorted(SUPPORT_FIELDS):     # the registered loss sees no pass: refused
        if name == "support_set":
            continue
        with pytest.raises(ValueError, match=f"^{name}="):
            gv.register(f"gbc_opt_{name}", **{name: "all" if name == "support_ties"
                                               else "replay"})
    with pytest.raises(ValueError, match="^support=replay: not run"):     # support named first
        gv.register("gbc_opt_support_set", support="replay", support_set="per_pass")


def _example_run(options):
    """The example trainer's parameters after two RL steps (its rollout, its rl_step; SGD; a
    fixed seed: the same first rollout in every run; the second step's KL term is not 0);
    options None: the starting parameters."""
    import copy
    import random
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import grpo_trainer as gt

    flags = ["--kl-coef", "0.5", "--prompts", "2", "--group", "8"]
    for name, value in (options or {}).items():
        flag = gt.METHOD_FLAGS[name]
        flags += [flag] if value is True else [flag, str(value)]
    args = gt.build_args(flags)
    gt.method_options(args)
    tok, model, _, task = gt.setup(args)
    args.max_len = task.max_answer_tokens
    ref_model = copy.deepcopy(model).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    rng = random.Random(0)
    torch.manual_seed(0)
    for _ in range(0 if options is None else 2):     # None: the starting parameters
        gt.rl_step(model, opt, gt.rollout(model, ref_model, task, tok, args, rng), args)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(PAIRS) - {"nthr_eta", "critical_kl_intercept"}))
def test_example_trainer_honours_every_flag(name):
    """Each method flag of the example trainer changes its update (two steps, against the same
    run without it; nthr_eta and critical_kl_intercept have no flag: see above)."""
    a, b = PAIRS[name]
    skip = {"nthr_eta", "critical_kl_intercept"}
    a, b = ({k: v for k, v in d.items() if k not in skip} for d in (a, b))
    if name == "nthr_beta":           # the example's NTHR runs with eta 'auto'
        a, b = dict(nthr=True, nthr_beta=0.0), dict(nthr=True, nthr_beta=-1e9)
    if name == PRECISION:
        from conftest import assert_logits_mode_reached, logits_dtypes_seen
        with logits_dtypes_seen() as seen_a:
            _example_run(a)
        with logits_dtypes_seen() as seen_b:
            _example_run(b)
        assert_logits_mode_reached(seen_a, seen_b, at_least=3)
        return
    pa, pb, start = _example_run(a), _example_run(b), _example_run(None)
    # more than rounding: a share of the parameters' total change over the two steps
    assert float((pa - pb).abs().max()) > 1e-3 * float((pa - start).abs().max()), name
