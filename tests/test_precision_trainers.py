"""Float32 logits mode (``logits_dtype``, docs/kernels.md "Precision") through each
trainer's own switch-on path: TRL's ``GBCGRPOConfig.gbc_logits_dtype``, verl's
``GBC_VERL_OPTIONS``, OpenRLHF's ``GBC_OPENRLHF_OPTIONS``, SkyRL's ``enable(cfg,
logits_dtype=...)`` / ``GBC_SKYRL_OPTIONS``, the example trainer's ``--logits-dtype`` and
megatron-core's ``gbc_mcore`` functions.

Per trainer: the option is taken; a bad value is refused naming the option in the trainer's
words; on a tiny bf16 model (its head sharpened so that the logits have a std of ~3, as a
trained model's do) the log-probs gbc computes in the trainer's no-grad passes are within 1e-5
of a float64 evaluation of the same final hidden states with the bf16 head weight, while the
operands' dtype mode (``logits_dtype=input``, the default on a GPU; the default on a CPU is
float32 mode, issue 59), measured in the same test, is worse than 1e-4; and the loss's ratio at the first
step of an unchanged policy is exactly 1 (the passes and the loss in the same mode).

The hidden states and head weight the trainer handed gbc are recorded at gbc's entry points
(:class:`HeadSpy`); the trainer's own returned log-probs are compared with them too.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import sys
import warnings

import pytest
import torch

import gbc_kernels as gbc
from gbc_kernels import methods

from conftest import megatron_cpu, spawn_gloo, tiny_hf_model

HERE = os.path.dirname(os.path.abspath(__file__))
F32, BF16 = torch.float32, torch.bfloat16
# the operands' dtype mode, explicitly: the default (None) resolves to float32 on a CPU
IN = "input"
SHARPEN = 25.0        # the tiny models' lm_head x 25: logits of std ~3 (init std 0.02, H = 32)
TIGHT, LOOSE = 1e-5, 1e-4


# ---- the oracle -----------------------------------------------------------------------------

class HeadSpy(contextlib.AbstractContextManager):
    """Records every call of gbc's no-grad head functions (``token_stats``,
    ``fused_linear_logprobs``, under the names the integrations and the method layer call them
    by): the hidden states, head weight, targets, temperature, ``logits_dtype`` given, and the
    log-probs returned."""

    SITES = ((gbc, "token_stats"), (gbc, "fused_linear_logprobs"),
             (methods, "token_stats"), (methods, "fused_linear_logprobs"))

    def __init__(self):
        self.calls, self._saved = [], []

    def __enter__(self):
        for mod, name in self.SITES:
            orig = getattr(mod, name)
            self._saved.append((mod, name, orig))
            setattr(mod, name, self._wrap(orig))
        return self

    def __exit__(self, *exc):
        for mod, name, orig in reversed(self._saved):
            setattr(mod, name, orig)
        self._saved = []

    def _wrap(self, fn):
        sig = inspect.signature(fn)

        def spy(*args, **kwargs):
            out = fn(*args, **kwargs)
            a = sig.bind(*args, **kwargs)
            a.apply_defaults()
            a = a.arguments
            lp = out.logp if hasattr(out, "logp") else out[0]
            if a.get("vocab_parallel") is None:
                # copies: FSDP2 frees the gathered weight's storage after the forward
                def own(t):
                    return t.detach().clone() if isinstance(t, torch.Tensor) else t

                self.calls.append(dict(h=own(a["hidden"]), w=own(a["weight"]), b=own(a["bias"]),
                                       y=own(a["targets"]), temp=own(a["temperature"]),
                                       cap=a["logit_softcap"], ld=a["logits_dtype"],
                                       logp=own(lp)))
            return out

        return spy


def oracle64(h, w, y, b=None, temperature=1.0):
    """``log_softmax((h @ W.T + b) / temperature)[y]`` in float64 on the given (bf16) values;
    ``[...]`` like ``y`` (NaN where ``y`` is not a token id)."""
    H = h.shape[-1]
    z = h.reshape(-1, H).double() @ w.double().t()
    if b is not None:
        z = z + b.double()
    if isinstance(temperature, torch.Tensor) and temperature.numel() > 1:
        z = z / temperature.reshape(-1, 1).double()
    else:
        z = z / float(temperature)
    yy = y.reshape(-1)
    ok = (yy >= 0) & (yy < w.shape[0])
    lp = z.log_softmax(-1).gather(-1, yy.clamp(0, w.shape[0] - 1)[:, None])[:, 0]
    return torch.where(ok, lp, torch.full_like(lp, float("nan"))).view(y.shape)


def call_error(c) -> float:
    """Max |gbc's log-prob - float64's| over one recorded call's tokens."""
    assert c["cap"] is None
    want = oracle64(c["h"], c["w"], c["y"], c["b"], c["temp"])
    ok = ~want.isnan()
    assert ok.any()
    return (c["logp"].double().reshape(want.shape) - want)[ok].abs().max().item()


def spy_errors(spy, logits_dtype):
    """The calls' errors; each call was on bf16 hidden states and weight and got
    ``logits_dtype``."""
    assert spy.calls, "no gbc head call recorded"
    errs = []
    for c in spy.calls:
        assert c["h"].dtype == BF16 and c["w"].dtype == BF16, (c["h"].dtype, c["w"].dtype)
        assert methods._validate.check_logits_dtype(c["ld"]) == logits_dtype, c["ld"]
        errs.append(call_error(c))
    return errs


def check_modes(err):
    """float32 mode within 1e-5 of float64, the operands' dtype mode (``"input"``, the
    default on a GPU) worse than 1e-4."""
    print(f"\n  max |logp - float64|: input {max(err[IN]):.2e}, "
          f"float32 {max(err[F32]):.2e}")
    assert max(err[F32]) < TIGHT, err
    assert max(err[IN]) > LOOSE, err


def sharpen_(model, factor=SHARPEN):
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(factor)
    return model


def sharpen_dir(path, factor=SHARPEN):
    """A saved tiny checkpoint with its lm_head sharpened (untied heads)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert not m.config.tie_word_embeddings
    sharpen_(m, factor).save_pretrained(str(path))
    return str(path)


# ---- TRL ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_sharp(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_sharp")
    tiny_hf_model(str(path), tie_word_embeddings=False)
    return sharpen_dir(path)


def _trl_build(tiny, tmp_path, **opts):
    pytest.importorskip("trl")
    import test_trl
    from gbc_kernels.integrations.trl import GBCGRPOTrainer

    return test_trl.build(GBCGRPOTrainer, tiny, tmp_path, model_dtype=BF16, **opts)


def test_trl_option_taken_and_refused(tiny_sharp, tmp_path):
    pytest.importorskip("trl")
    from gbc_kernels.integrations.trl import GBCGRPOConfig

    cfg = GBCGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                        gbc_logits_dtype="float32")
    t = _trl_build(tiny_sharp, tmp_path / "t", gbc_logits_dtype="float32")
    assert t.gbc_methods.logits_dtype is F32
    assert t._gbc_config(0.0).logits_dtype is F32
    assert cfg.gbc_logits_dtype == "float32"
    for bad in ("bf16", "float16"):
        with pytest.raises(ValueError, match="gbc_logits_dtype"):
            GBCGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                          gbc_logits_dtype=bad)


def test_trl_passes_float32_mode(tiny_sharp, tmp_path):
    """TRL's old-policy and reference passes (``_get_per_token_logps_and_entropies``, gbc's
    ``logprobs_through_forward``) on a bf16 Qwen2, in both modes, against float64."""
    import test_trl

    err = {}
    for ld in (IN, F32):
        t = _trl_build(tiny_sharp, tmp_path / str(ld), beta=0.04,
                       gbc_logits_dtype=ld if ld == IN else "float32")
        assert t.model.lm_head.weight.dtype == BF16
        g = torch.Generator().manual_seed(0)
        V = t.model.config.vocab_size
        ids = torch.randint(3, V, (test_trl.B, test_trl.P + test_trl.T), generator=g)
        am = torch.ones_like(ids)
        am[0, 0] = 0
        err[ld] = []
        for model in (t.model, t.ref_model):
            with HeadSpy() as spy, torch.no_grad():
                logp, _, _ = t._get_per_token_logps_and_entropies(model, ids, am, test_trl.T)
            err[ld] += spy_errors(spy, ld)
            assert len(spy.calls) == 1 and torch.equal(logp, spy.calls[0]["logp"])
    check_modes(err)


def _trl_first_step(tiny, tmp_path, **opts):
    t = _trl_build(tiny, tmp_path, loss_type="grpo", beta=0.04, max_steps=1,
                   num_iterations=2, **opts)      # num_iterations=2: TRL's old-policy pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.train()
    row = next(r for r in t.state.log_history if "gbc/log_ratio_mean" in r)
    return row


def test_trl_first_step_ratio_exactly_one(tiny_sharp, tmp_path, monkeypatch):
    """One training step, float32 mode: TRL's old-policy log-probs (its pass, gbc's) and the
    loss's agree bitwise (ratio 1, log-ratio 0, nothing clipped). Mixing the modes (the pass in
    the operands' dtype mode) shows in the same metric."""
    row = _trl_first_step(tiny_sharp, tmp_path / "f32", gbc_logits_dtype="float32")
    assert row["gbc/log_ratio_mean"] == 0.0 and row["gbc/ratio_mean"] == 1.0, row
    assert row["clip_ratio/region_mean"] == 0.0
    from gbc_kernels.integrations import hf

    real = hf.logprobs_through_forward
    monkeypatch.setattr(hf, "logprobs_through_forward",
                        lambda *a, **k: real(*a, **dict(k, logits_dtype=IN)))
    row = _trl_first_step(tiny_sharp, tmp_path / "mixed", gbc_logits_dtype="float32")
    assert row["gbc/log_ratio_mean"] != 0.0, row


# ---- the example trainer ----------------------------------------------------------------------

def _example():
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    import grpo_trainer
    return grpo_trainer


def test_example_option_taken_and_refused(capsys):
    ex = _example()
    from test_examples import TINY

    args = ex.build_args(TINY + ["--logits-dtype", "float32", "--dtype", "bfloat16"])
    assert ex.method_options(args).logits_dtype is F32
    assert ex.loss_config(args, gbc).logits_dtype is F32
    assert ex.method_options(ex.build_args(TINY)).logits_dtype is None
    for bad in ("bf16", "float16"):
        with pytest.raises(SystemExit):
            ex.build_args(TINY + ["--logits-dtype", bad])
        assert "--logits-dtype" in capsys.readouterr().err


def test_example_trainer_float32_mode(tmp_path, monkeypatch):
    """Two RL steps of the example trainer on its bf16 model (``--dtype bfloat16``): every
    old-policy (and reference: ``--kl-coef``) log-prob gbc computes in its passes, against
    float64, in both modes; and the loss's ratio on the first step (an unchanged policy) is
    exactly 1 in float32 mode."""
    import json

    from test_examples import TINY

    ex = _example()
    spy = HeadSpy()
    real = ex.rollout

    def rollout(*a, **k):           # the RL passes only (not the float32 warm-up, the eval)
        with spy:
            return real(*a, **k)

    monkeypatch.setattr(ex, "rollout", rollout)
    err, rows = {}, {}
    for ld in (IN, F32):
        out = tmp_path / str(ld)
        extra = ["--dtype", "bfloat16", "--kl-coef", "0.05", "--out", str(out)]
        extra += ["--logits-dtype", "input" if ld == IN else "float32"]
        spy.calls = []
        ex.main(TINY + extra)
        err[ld] = spy_errors(spy, ld)
        assert len(spy.calls) >= 4            # old policy and reference, two steps
        rows[ld] = [json.loads(line) for line in open(out / "metrics.jsonl")]
    check_modes(err)
    assert rows[F32][0]["ratio_mean"] == 1.0 and rows[F32][0]["clip_frac_low"] == 0.0 and \
        rows[F32][0]["clip_frac_high"] == 0.0, rows[F32][0]


# ---- OpenRLHF -------------------------------------------------------------------------------

def _orl():
    pytest.importorskip("deepspeed")
    import test_openrlhf
    from gbc_kernels.integrations import openrlhf as gorl
    return test_openrlhf, gorl


def test_openrlhf_option_taken_and_refused(monkeypatch):
    T, gorl = _orl()
    try:
        monkeypatch.setenv(gorl.ENV_OPTIONS, "logits_dtype=float32")
        T._enable()
        assert gorl._STATE.methods.logits_dtype is F32
        for bad in ("bf16", "float16"):
            monkeypatch.setenv(gorl.ENV_OPTIONS, f"logits_dtype={bad}")
            with pytest.raises(ValueError, match="^GBC_OPENRLHF_OPTIONS: logits_dtype"):
                T._enable()
    finally:
        gorl.disable()


def test_openrlhf_passes_and_first_step(monkeypatch):
    """OpenRLHF's ``Actor.forward`` no-grad pass (the experience maker's old policy and, marked
    ``gbc_reference``, the reference model), patched by ``enable()`` from
    ``GBC_OPENRLHF_OPTIONS``, on a bf16 Qwen2 in both modes against float64; then
    ``training_step`` on that experience: its ratio is exactly 1 in float32 mode."""
    from types import SimpleNamespace

    T, gorl = _orl()
    model = sharpen_(T.tiny_model()).to(BF16)
    err = {}
    try:
        for ld in (IN, F32):
            monkeypatch.setenv(gorl.ENV_OPTIONS, "logits_dtype=input" if ld == IN else "logits_dtype=float32")
            T._enable()
            actor, ref = T.make_actor(copy.deepcopy(model)), T.make_actor(copy.deepcopy(model))
            ref.gbc_reference = True
            exp = T.make_experience(3)
            m = exp.action_mask
            err[ld], out = [], []
            for a in (actor, ref):
                with HeadSpy() as spy, torch.no_grad():
                    lp = a(exp.sequences, m, exp.attention_mask)
                err[ld] += spy_errors(spy, ld)
                assert len(spy.calls) == 1
                assert torch.equal(lp[m], spy.calls[0]["logp"].view(lp.shape)[m])
                out.append(lp)
            if ld == IN:
                continue
            exp.action_log_probs, exp.base_action_log_probs = out
            opt = torch.optim.SGD(actor.parameters(), lr=0.1)
            trainer = SimpleNamespace(
                actor=actor, args=T.make_args(kl="k3"), strategy=T.PlainStrategy(),
                replay_buffer=None, actor_optim=opt,
                actor_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
                ema_model=None, ema_beta=0.99)
            status = gorl.training_step(trainer, exp, 0.05, 0)
            st = {k: float(torch.as_tensor(v).float().mean())
                  for k, v in status["metrics"].items()
                  if isinstance(v, (torch.Tensor, float, int))}
            assert st["gbc/log_ratio_mean"] == 0.0 and st["gbc/ratio_mean"] == 1.0, st
            assert st["ppo_kl"] == 0.0 and st["ppo_clip_ratio"] == 0.0, st
            # the reference model is the policy: its pass's log-probs equal the loss's too
            assert st["kl"] == 0.0, st
    finally:
        gorl.disable()
    check_modes(err)


# ---- megatron-core (gbc_mcore) ------------------------------------------------------------------

def _mcore_worker(rank, world):
    mc = megatron_cpu()
    mc.install_shims()
    mc.init_parallel(1)
    from gbc_kernels.integrations import megatron as M

    S, B, H, V = 8, 3, 64, 301
    g = torch.Generator().manual_seed(5)
    h = torch.randn(S, B, H, generator=g).to(BF16)
    w = (torch.randn(V, H, generator=g) * (3.0 / H ** 0.5)).to(BF16)
    labels = torch.randint(0, V, (B, S), generator=g)
    mask = torch.rand(B, S, generator=g) < 0.8
    adv = torch.randn(B, generator=g)
    want = oracle64(h.transpose(0, 1), w, labels)
    out = {}
    for ld in (IN, F32):
        lp = M.logprobs(h, w, labels, mask, return_entropy=False, logits_dtype=ld).logp
        r = {"logprobs": (lp.double() - want)[mask].abs().max().item()}
        for main_grad in (False, True):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            if main_grad:
                ww.main_grad = torch.zeros(w.shape, dtype=torch.float32)
                ww.grad_added_to_main_grad = False
            res = M.policy_loss(hh, ww, labels, mask, adv, lp, lp, main_grad=main_grad,
                                config=gbc.PolicyLossConfig(kl_coef=0.1), logits_dtype=ld)
            res.loss.backward()
            r[main_grad] = dict(
                err=(res.logp.double() - want)[mask].abs().max().item(),
                same=torch.equal(res.logp[mask], lp[mask]),
                log_ratio=float(res.metrics["log_ratio_mean"]),
                ratio=float(res.metrics["ratio_mean"]),
                clip=float(res.metrics["clip_frac_low"] + res.metrics["clip_frac_high"]),
                grad=bool(ww.main_grad.abs().sum() > 0 if main_grad else
                          ww.grad.abs().sum() > 0))
        out[ld] = r
    return out


def test_megatron_logprobs_and_policy_loss_float32_mode():
    """``gbc_mcore.logprobs`` (the old-policy / reference pass) and ``policy_loss`` on both
    routes (one-sweep; ``main_grad``: megatron's DDP weight), on bf16 ``[S, B, H]`` hidden
    states and a bf16 ``[V, H]`` head at tensor parallel 1: log-probs against float64 in both
    modes; in float32 mode the loss's log-probs equal the pass's bitwise (ratio exactly 1)."""
    r = spawn_gloo(1, _mcore_worker)[0]
    err = {ld: [r[ld]["logprobs"], r[ld][False]["err"], r[ld][True]["err"]] for ld in r}
    check_modes(err)
    for main_grad in (False, True):
        f = r[F32][main_grad]
        assert f["same"] and f["log_ratio"] == 0.0 and f["ratio"] == 1.0 and f["clip"] == 0.0, f
        assert f["grad"], f


# ---- verl: gbc's engine on verl's FSDP2 engine -----------------------------------------------

def _verl_worker(rank, world, model_dir):
    import functools

    from test_other_trainers import verl_actor_config
    from test_verl_engine import _metric_values, build_engine, make_batch, verl_on_cpu

    verl_on_cpu()
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from gbc_kernels.integrations.verl import engine as ve

    os.environ[ve.ENV_OPTIONS] = "logits_dtype=float32"
    try:
        opts = ve.enable()                    # GBC_VERL_OPTIONS, as verl's plugin reads it
    finally:
        ve.disable()
    assert opts.logits_dtype is F32
    # FSDP2 mixed precision: the forward's parameters (the head's included) in bf16
    engine = build_engine(model_dir, dtype="bf16", options=opts)
    data = make_batch(7, 4, temperature=1.0, with_is=False)
    err = {}
    for ld, o in ((IN, ve.EngineOptions(logits_dtype=IN)), (F32, opts)):
        type(engine).gbc_options = o
        with HeadSpy() as spy, engine.eval_mode():
            out = engine.infer_batch(data.clone(), loss_function=None)
        err[ld] = spy_errors(spy, ld)
    # the update on the pass's old log-probs (float32 mode), before any optimizer step
    old = no_padding_2_padding(out["model_output"]["log_probs"], data)
    data["old_log_probs"] = (old * data["response_mask"]).float()
    cfg = verl_actor_config("vanilla", "token-mean", "low_var_kl")
    engine.optimizer_zero_grad()
    res = engine.forward_backward_batch(data.clone(), functools.partial(ppo_loss, config=cfg),
                                        forward_only=False)
    return err, _metric_values(res["metrics"])


def test_verl_option_taken_and_refused(monkeypatch):
    pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")
    from gbc_kernels.integrations.verl import engine as ve

    assert ve.EngineOptions.parse("logits_dtype=float32").logits_dtype is F32
    assert ve.EngineOptions.parse("logits_dtype=none").logits_dtype is None
    try:
        monkeypatch.setenv(ve.ENV_OPTIONS, "logits_dtype=float32")
        assert ve.enable().logits_dtype is F32
        for bad in ("bf16", "float16"):
            monkeypatch.setenv(ve.ENV_OPTIONS, f"logits_dtype={bad}")
            with pytest.raises(ValueError, match="^GBC_VERL_OPTIONS: logits_dtype"):
                ve.enable()
    finally:
        ve.disable()


def test_verl_engine_pass_and_first_step(tmp_path):
    """verl's ``compute_log_prob`` pass (``infer_batch``) of gbc's FSDP2 engine with bf16
    mixed precision, options from ``GBC_VERL_OPTIONS``: both modes against float64; then the
    update on those old log-probs: verl's ``ppo_kl`` and clip fraction exactly 0."""
    pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")
    from test_verl_engine import make_model_dir

    model_dir = sharpen_dir(make_model_dir(tmp_path / "m"))
    err, metrics = spawn_gloo(1, _verl_worker, model_dir)[0]
    check_modes(err)
    kl = [k for k in metrics if k.endswith("ppo_kl")]
    clip = [k for k in metrics if k.endswith("pg_clipfrac")]
    assert kl and clip, sorted(metrics)
    for k in kl + clip:
        assert all(v == 0.0 for v in metrics[k]), (k, metrics[k])


# ---- SkyRL: gbc's FSDP policy worker ------------------------------------------------------------

def _skyrl_worker(rank, world):
    from test_skyrl import build_worker, make_batch, skyrl_cpu, step_setup, tiny_qwen2

    sky = skyrl_cpu().load()
    model = sharpen_(tiny_qwen2()).to(BF16)
    a, cls, _ = step_setup(sky, "regular", True, {})
    err, res = {}, {}
    for ld in (IN, F32):
        # no options given to the worker: it reads GBC_SKYRL_OPTIONS, as on a Ray worker
        os.environ["GBC_SKYRL_OPTIONS"] = "logits_dtype=input" if ld == IN else "logits_dtype=float32"
        w = build_worker(sky, cls, a, 1, copy.deepcopy(model))
        assert w.gbc_options.logits_dtype == ld
        data = make_batch(sky, 100)
        with skyrl_cpu().cpu_device():
            with HeadSpy() as spy:
                fwd = w.forward(data)                  # the old-policy pass
            err[ld] = spy_errors(spy, ld)
            rows = [list(r["logprobs"]) for r in fwd.loss_fn_outputs]   # each response's
            if ld is F32:
                old = torch.zeros_like(data["action_log_probs"])
                for i, r in enumerate(rows):
                    old[i, :len(r)] = torch.tensor(r, dtype=old.dtype)
                data["action_log_probs"] = old
                out = w.forward_backward(data)
                # SkyRL's outputs: each response's last positions, NaN off the loss mask
                pairs = [(v, r[len(r) - len(lr) + j])
                         for r, lr in zip(rows, (list(o["logprobs"])
                                                 for o in out.loss_fn_outputs))
                         for j, v in enumerate(lr) if v == v]
                res = dict(same=all(a == b for a, b in pairs), n=len(pairs),
                           metrics=dict(out.metrics))
    return err, res


def test_skyrl_option_taken_and_refused(monkeypatch):
    pytest.importorskip("skyrl")
    from test_skyrl import _trainer_cfg, skyrl_cpu

    sky = skyrl_cpu().load()                 # SkyRL's CPU stand-ins before its modules
    import gbc_kernels.integrations.skyrl as gsky
    from gbc_kernels.integrations.skyrl import fsdp as gfsdp
    from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker

    for name in ("PolicyWorker", "RefWorker"):
        monkeypatch.setattr(fsdp_worker, name, getattr(fsdp_worker, name))
    monkeypatch.setitem(sys.modules, gsky.MEGATRON_WORKER, None)
    skyrl_cpu().entrypoint_imports()
    monkeypatch.setenv("GBC_SKYRL_OPTIONS", "")
    monkeypatch.setenv("GBC_SKYRL", "")
    assert gsky.enable(_trainer_cfg(sky), logits_dtype="float32").logits_dtype is F32
    assert os.environ["GBC_SKYRL_OPTIONS"] == "logits_dtype=float32"     # to the Ray workers
    for bad in ("bf16", "float16"):
        with pytest.raises(ValueError, match="logits_dtype"):
            gsky.enable(_trainer_cfg(sky), logits_dtype=bad)
        monkeypatch.setenv("GBC_SKYRL_OPTIONS", f"logits_dtype={bad}")
        with pytest.raises(ValueError, match="^GBC_SKYRL_OPTIONS: logits_dtype"):
            gfsdp.GBCFSDPPolicyWorker(cfg=_trainer_cfg(sky), world_size=1, rank=0,
                                      local_rank=0, master_addr="127.0.0.1", master_port=1,
                                      sequence_parallel_size=1)


def test_skyrl_worker_pass_and_first_step():
    """SkyRL's policy worker (gbc's FSDP worker, options from ``GBC_SKYRL_OPTIONS``) on a bf16
    Qwen2: its no-grad pass (``forward``: the old policy's log-probs) in both modes against
    float64; then ``forward_backward`` on those log-probs: the loss's log-probs (its
    ``loss_fn_outputs``) equal the pass's bitwise (ratio exactly 1)."""
    pytest.importorskip("skyrl")
    err, res = spawn_gloo(1, _skyrl_worker)[0]
    check_modes(err)
    assert res["same"] and res["n"] >= 4, res
    assert res["metrics"]["loss_metrics/clip_ratio"] == 0.0, res
