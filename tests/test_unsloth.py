"""gbc's loss inside Unsloth's GRPO trainer (gbc_kernels/integrations/unsloth.py, docs/unsloth.md).

Each case runs in fresh processes of an interpreter with Unsloth 2026.10.9 (the compat row
``make compat ONLY=unsloth``: this file runs there under that venv's own python; elsewhere
``GBC_UNSLOTH_PYTHON`` names it, or the tests skip), through both CPU routes to Unsloth's
rewrite of TRL's trainer: ``UNSLOTH_ZOO_DISABLE_GPU_INIT=1`` (``import unsloth`` takes its GPU
path and rewrites TRL) and ``UNSLOTH_ALLOW_CPU=1`` plus ``patch_trl_rl_trainers()``.

The worker (this file run as a script, ``unsloth`` imported first) builds
``GBCUnslothGRPOTrainer`` on a tiny Qwen2 (tests/conftest.py's, loaded with transformers'
``AutoModelForCausalLM``; its word-level tokenizer loaded as ``PreTrainedTokenizerFast``: under
Unsloth's transformers 5.17 ``AutoTokenizer`` reads it as Qwen2's BPE class and turns every
prompt into unknown tokens), takes a batch from Unsloth's own rollout (its generation, its
left-padded prompts and ``max_left_pad``), gives it different completion lengths, a fully masked
completion, a pad id sampled mid-completion, random advantages and off-policy old/reference
log-probs, and saves gbc's loss and every parameter gradient. The oracle (the same interpreter,
Unsloth never imported) recomputes them in float64: TRL 1.15's own ``GRPOTrainer._compute_loss``
on the model cast to float64 for the objectives, and for the four methods their inputs by hand
(AR's weights, NTHR's scales, the critical-token KL weights from the reference's certainty,
Lopti's two updates) with gbc_reference's float64 loss.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _unsloth_python():
    env = os.environ.get("GBC_UNSLOTH_PYTHON")
    if env:
        return env
    if importlib.util.find_spec("unsloth") is not None:
        return sys.executable               # the compat row's venv
    return None


UNSLOTH_PYTHON = _unsloth_python()
# gbc_kernels installed outside the checkout (the compat row's wheel): the workers use it too
_INSTALLED_GBC = (importlib.util.find_spec("gbc_kernels") is not None and not os.path.abspath(
    importlib.util.find_spec("gbc_kernels").origin).startswith(ROOT + os.sep))
needs_unsloth = pytest.mark.skipif(
    UNSLOTH_PYTHON is None,
    reason="no interpreter with Unsloth (GBC_UNSLOTH_PYTHON, or `make compat ONLY=unsloth`)")

ROUTES = {"zoo": {"UNSLOTH_ZOO_DISABLE_GPU_INIT": "1"}, "allow": {"UNSLOTH_ALLOW_CPU": "1"}}
B, MAX_LEN = 4, 8

# (name, GRPOConfig options): each TRL objective gbc maps (GSPO: importance_sampling_level)
OBJECTIVES = [
    ("grpo", dict(loss_type="grpo")),
    ("grpo-beta", dict(loss_type="grpo", beta=0.04)),
    ("bnpo", dict(loss_type="bnpo")),
    ("dr_grpo", dict(loss_type="dr_grpo", beta=0.04)),
    ("dapo", dict(loss_type="dapo")),
    ("dapo-beta-delta", dict(loss_type="dapo", beta=0.04, delta=1.5, epsilon_high=0.28)),
    ("gspo", dict(loss_type="grpo", importance_sampling_level="sequence")),
    ("gspo-dapo", dict(loss_type="dapo", importance_sampling_level="sequence", beta=0.04)),
    ("cispo", dict(loss_type="cispo", epsilon_high=5.0)),
    ("sapo", dict(loss_type="sapo")),
    ("luspo", dict(loss_type="luspo")),
    ("vespo", dict(loss_type="vespo")),
    ("entropy-quantile", dict(loss_type="grpo", top_entropy_quantile=0.5)),
    ("lora-dapo-beta", dict(loss_type="dapo", beta=0.04, lora=True)),
    # the off-policy mask against the sampler's log-probs, and vLLM's importance-sampling
    # correction (the batch's importance_sampling_ratio: vllm_is sets use_vllm on the built
    # trainer, as a vLLM rollout would; no vLLM runs), token-level and on GSPO's sequence level
    ("off-policy-mask", dict(loss_type="grpo", off_policy_mask_threshold=0.05)),
    ("vllm-is", dict(loss_type="dapo", beta=0.04, vllm_is=True)),
    ("vllm-is-gspo-mask", dict(loss_type="grpo", importance_sampling_level="sequence",
                               off_policy_mask_threshold=0.05, vllm_is=True)),
    ("vllm-is-vespo", dict(loss_type="vespo", vllm_is=True)),
]


def _case_batch(batch, options):
    """The batch a case's loss sees: TRL's rollout puts ``importance_sampling_ratio`` in it
    only under vLLM's correction (VESPO reads it whenever it is there)."""
    if options.get("vllm_is"):
        return batch
    return {k: v for k, v in batch.items() if k != "importance_sampling_ratio"}
METHODS = [
    ("ar", dict(loss_type="dapo", gbc_ar_alpha=0.3)),
    ("nthr", dict(loss_type="grpo", gbc_nthr=True)),
    ("critical-kl", dict(loss_type="dapo", beta=0.04, gbc_critical_kl_exponent=2.0,
                         gbc_critical_kl_intercept=0.1)),
    # eta near the tiny model's typical probability (about 1/35): both phases hold tokens
    ("lopti", dict(loss_type="dapo", gbc_lopti_eta=0.028)),
]
ACCUMULATION = 2


def run_script(mode, route, out_dir, python=None, extra_env=None, **kw):
    """This file as a script in a fresh process (cwd ``out_dir``: Unsloth writes its compiled
    cache there); returns its JSON report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GBC_", "UNSLOTH_"))}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "python"), HERE]),
               OMP_NUM_THREADS="2")
    if _INSTALLED_GBC:              # the compat row (python -P): the installed wheel, as here
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), HERE])
    if route is not None:
        env.update(ROUTES[route])
    env.update(extra_env or {})
    args = dict(mode=mode, route=route, out=str(out_dir), **kw)
    proc = subprocess.run([python or UNSLOTH_PYTHON, os.path.abspath(__file__), json.dumps(args)],
                          env=env, capture_output=True, text=True, timeout=1500,
                          cwd=str(out_dir))
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
    assert proc.returncode == 0 and line, (proc.stdout[-2000:], proc.stderr[-6000:])
    return json.loads(line[-1].split(" ", 1)[1])


@pytest.fixture(scope="module")
def objective_runs(tmp_path_factory):
    """gbc inside Unsloth's step (each route) and the float64 oracle on each route's batch."""
    runs = {}
    for route in ROUTES:
        d = tmp_path_factory.mktemp(f"objectives_{route}")
        runs[route] = (run_script("objectives", route, d),
                       run_script("oracle", None, d, saved=str(d / "gbc.pt")))
    return runs


def _compare(gbc, oracle, loss_tol=2e-6, grad_tol=2e-5):
    for name in oracle["cases"]:
        a, b = gbc["cases"][name], oracle["cases"][name]
        assert abs(a["loss"] - b["loss"]) <= loss_tol * max(1.0, abs(b["loss"])), (name, a, b)
        assert b["grad_err"] <= grad_tol, (name, b["grad_err"])
        assert b["n_grads"] > 0 and b["grads_nonzero"], name


@needs_unsloth
@pytest.mark.parametrize("route", list(ROUTES))
def test_objectives_match_float64_oracle(objective_runs, route):
    """Every objective (and GSPO, KL, delta, the entropy quantile, the off-policy mask, vLLM's
    importance-sampling correction, a PEFT LoRA model), accumulation 2, on Unsloth's rollout batch: gbc's loss and gradients inside Unsloth's
    trainer equal TRL's loss computed in float64 without Unsloth."""
    gbc, oracle = objective_runs[route]
    assert gbc["base"] == "UnslothGRPOTrainer.UnslothGRPOTrainer", gbc
    assert gbc["compute_loss"] == "gbc_kernels.integrations.unsloth", gbc
    assert gbc["pad_mid_completion"] and gbc["max_left_pad"] >= 0, gbc
    assert set(oracle["cases"]) == {n for n, _ in OBJECTIVES}
    _compare(gbc, oracle)
    # the batch was Unsloth's: its generation and left-padded prompts; gbc's passes are [B, T]
    assert gbc["ref_shape"] == [B, gbc["T"]], gbc
    assert oracle["lora_trained"], oracle


@needs_unsloth
@pytest.mark.parametrize("route", list(ROUTES))
def test_no_vocabulary_sized_tensor_on_gbcs_path(objective_runs, route):
    """The loss and its backward inside Unsloth's trainer form no [B*T, V] (nor [B*L, V])
    logits: a tensor whose last dimension is the vocabulary has at most the rows of one block
    of the fused head's (here the batch's response tokens, fewer than B*T)."""
    gbc, _ = objective_runs[route]
    assert 0 < gbc["vocab_rows_gbc"] < B * gbc["T"] < gbc["tokens"], gbc


@pytest.fixture(scope="module")
def method_runs(tmp_path_factory):
    runs = {}
    for route in ROUTES:
        d = tmp_path_factory.mktemp(f"methods_{route}")
        runs[route] = (run_script("methods", route, d),
                       run_script("method_oracle", None, d, saved=str(d / "gbc.pt")))
    return runs


@needs_unsloth
@pytest.mark.parametrize("route", list(ROUTES))
def test_four_methods_inside_unsloths_step_match_float64_by_hand(method_runs, route):
    """AR, NTHR, critical-token KL (their inputs from gbc's passes inside Unsloth's rollout)
    and Lopti (its two updates inside Unsloth's training_step) against float64 by hand."""
    gbc, oracle = method_runs[route]
    assert set(oracle["cases"]) == {n for n, _ in METHODS}
    _compare(gbc, oracle)
    checks = oracle["checks"]
    assert checks["nthr_scale_err"] <= 1e-5 and checks["nthr_selected"] > 0, checks
    assert checks["kl_weight_err"] <= 1e-5 and checks["kl_weight_spread"] > 0, checks
    assert checks["lopti_old_err"] <= 1e-5, checks
    assert checks["lopti_low"] > 0 and checks["lopti_high"] > 0, checks
    assert checks["ref_err"] <= 1e-5, checks
    assert checks["ar_changed"] > 1e-4, checks


@needs_unsloth
@pytest.mark.parametrize("route", list(ROUTES))
def test_train_with_gradient_accumulation_and_every_method(tmp_path, route):
    """Unsloth's training loop end to end: 2 optimizer steps of 2 micro-batches each, every
    method on; each step went through gbc's compute_loss, the parameters moved and stayed
    finite."""
    rep = run_script("train", route, tmp_path)
    assert rep["global_step"] == 2 and rep["gbc_losses"] == 2 * 2 * 2, rep  # Lopti: 2 phases
    assert rep["moved"] and rep["finite"], rep
    assert rep["unsloth_loss_calls"] == 0, rep


@needs_unsloth
def test_bad_inputs_are_refused_by_name_and_change_nothing(tmp_path):
    rep = run_script("refusals", "zoo", tmp_path)
    want = {
        "env": "UNSLOTH_GRPO_VLLM_IS_MODE='token_mask'",
        "env_packing": "UNSLOTH_GRPO_SEQ_PACKING='1'",
        "config": "unsloth_num_chunks=4",
        "release": "unsloth 2026.9.1: gbc's Unsloth drop-in is tested on unsloth 2026.10.9",
        "zoo_release": "unsloth_zoo 2026.11.1",
        "return_outputs": "return_outputs=True",
        "gbc_option": "gbc_backend='nope'",
        "hidden_states": "UNSLOTH_RETURN_HIDDEN_STATES='1'",
        "head_4bit": "a quantized head",
    }
    for key, fragment in want.items():
        assert fragment in rep["errors"][key], (key, rep["errors"][key])
    assert rep["unchanged"], rep
    assert rep["env_off_ok"], rep


@needs_unsloth
@pytest.mark.parametrize("case", ["gbc-first", "cpu-backend", "not-imported"])
def test_routes_that_are_not_unsloths_rewrite_are_refused(tmp_path, case):
    """gbc's TRL module imported before Unsloth (its class is on TRL's own trainer), Unsloth's
    CPU backend (no rewrite), no Unsloth at all: refused by name, saying what works."""
    route = {"gbc-first": "zoo", "cpu-backend": None, "not-imported": None}[case]
    rep = run_script("wrong_route", route, tmp_path, case=case)
    assert "GBCUnslothGRPOTrainer" in rep["error"], rep
    said = {"gbc-first": "was imported before Unsloth rewrote TRL's GRPOTrainer",
            "cpu-backend": "Unsloth has not rewritten TRL's GRPOTrainer",
            "not-imported": "Unsloth is not imported in this process"}[case]
    assert said in rep["error"] and "import unsloth first" in rep["error"], rep


@needs_unsloth
def test_ddp_two_gloo_ranks_gradients_averaged_once(tmp_path):
    """2 ranks (gloo), one SGD step inside Unsloth's training loop: gbc's loss ran through
    DDP's forward (DistributedDataParallel), so DDP averaged the gradients and Unsloth's own
    averaging (its training_step wrapper) never ran; the step equals the mean of both ranks'
    local gradients by hand, and the ranks hold the same parameters."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = str(tmp_path / "store")
    # the tiny model once, before the ranks start (both read it)
    run_script("tiny", None, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GBC_", "UNSLOTH_"))}
    env.update(PYTHONPATH=os.pathsep.join(([] if _INSTALLED_GBC else [ROOT])
                                          + [os.path.join(ROOT, "python"), HERE]),
               OMP_NUM_THREADS="1", **ROUTES["zoo"])
    procs = [subprocess.Popen([UNSLOTH_PYTHON, os.path.abspath(__file__), json.dumps(dict(
        mode="ddp", route="zoo", out=str(tmp_path), rank=r, port=port, store=store))],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=str(tmp_path)) for r in range(2)]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=1500)
        line = [x for x in out.splitlines() if x.startswith("REPORT ")]
        assert p.returncode == 0 and line, err[-6000:]
        reports.append(json.loads(line[-1].split(" ", 1)[1]))
    for rep in reports:
        assert rep["ddp_model"] == "DistributedDataParallel", rep
        assert rep["averaged_by_unsloth"] == 0, rep
        assert rep["step_err"] <= 1e-6 and rep["moved"] and rep["ranks_equal"], rep
        assert rep["micro_batches"] == 1, rep


def test_importing_gbc_imports_nothing_of_unsloth():
    """gbc (and its Unsloth module) import no Unsloth: the class is built on first lookup."""
    code = ("import sys, gbc_kernels, gbc_kernels.integrations.unsloth as u; "
            "print(sorted(m for m in sys.modules if m.split('.')[0].lower().startswith("
            "'unsloth')))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "python")]))
    out = subprocess.run([UNSLOTH_PYTHON or sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


# ============================================================================ the subprocesses

def _setup_route(route):
    """Unsloth's rewrite of TRL's GRPOTrainer on this CPU machine, by the route's env."""
    import unsloth  # noqa: F401  (first, as Unsloth's notebooks do)
    if route == "allow":
        from unsloth.models.rl import patch_trl_rl_trainers
        patch_trl_rl_trainers()


def _tiny(out):
    from conftest import tiny_hf_model

    path = os.path.join(out, "tiny")
    if not os.path.exists(os.path.join(path, "config.json")):
        tiny_hf_model(path, tie_word_embeddings=False)
    return path


def _tokenizer(path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)


def reward_has_knight(completions, **kwargs):
    return [float("knight" in c) for c in completions]


def _lora_model(model):
    import peft
    import torch

    torch.manual_seed(3)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                          target_modules=["q_proj", "v_proj", "up_proj"])
    return peft.get_peft_model(model, cfg)


def _config(cls, out, **options):
    args = dict(output_dir=os.path.join(out, "run"), per_device_train_batch_size=B,
                num_generations=B, max_completion_length=MAX_LEN, report_to=[], use_cpu=True,
                bf16=False, fp16=False, logging_steps=1, save_strategy="no", seed=0,
                learning_rate=1e-2, epsilon_high=0.2, mask_truncated_completions=False)
    args.update(options)
    return cls(**args)


def _dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["you meet knights and knaves",
                                         "a knave is always a knave or not"] * 4})


def _build(cls, config_cls, path, out, model=None, **options):
    import torch
    from transformers import AutoModelForCausalLM

    options = dict(options)
    lora = options.pop("lora", False)
    vllm_is = options.pop("vllm_is", False)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if lora:
            model = _lora_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model=model, reward_funcs=reward_has_knight,
                      args=_config(config_cls, out, **options), train_dataset=_dataset(),
                      processing_class=_tokenizer(path))
    if vllm_is:     # the loss multiplies by the batch's importance_sampling_ratio (TRL's rule)
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    return trainer


def _rollout(trainer):
    """One generation batch from Unsloth's own rollout (its generation and prompt layout)."""
    import torch

    trainer.model.train()
    prompts = [{"prompt": p} for p in _dataset()["prompt"][:B]]
    torch.manual_seed(0)
    return trainer._generate_and_score_completions(prompts)


def _shape_batch(trainer, batch, seed, off_policy=True):
    """Different lengths, a fully masked completion, a pad id sampled mid-completion, random
    advantages; old / reference log-probs off the policy (so ratios clip on both sides)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    T = batch["completion_ids"].size(1)
    lengths = torch.tensor([T, T - 3, 0, 2])
    mask = (torch.arange(T)[None] < lengths[:, None]).to(batch["completion_mask"].dtype)
    ids = batch["completion_ids"].clone()
    if off_policy:        # (else the rollout's log-probs, of these very ids, are kept)
        ids[0, 2] = trainer.processing_class.pad_token_id    # sampled mid-completion: scored
    batch["completion_ids"], batch["completion_mask"] = ids, mask
    batch["advantages"] = torch.randn(B, generator=g)
    batch["num_items_in_batch"] = mask.sum() * 3
    if off_policy:
        with torch.no_grad():
            logp = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([batch["prompt_ids"], ids], 1),
                torch.cat([batch["prompt_mask"], mask], 1), T)[0]
        batch["old_per_token_logps"] = logp + 0.4 * torch.randn(B, T, generator=g)
        batch["ref_per_token_logps"] = logp + 0.3 * torch.randn(B, T, generator=g)
        # a sampler's log-probs and the importance-sampling ratio a vLLM rollout would give
        # (read only with off_policy_mask_threshold / use_vllm)
        batch["sampling_per_token_logps"] = logp + 0.5 * torch.randn(B, T, generator=g)
        # 1 outside the mask, as TRL's rollout computes it (exp of masked log-prob gaps)
        batch["importance_sampling_ratio"] = torch.exp(
            0.3 * torch.randn(B, T, generator=g) * mask.to(torch.float32))
    return batch


def _loss_and_grads(trainer, inputs, accumulation):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = accumulation
    loss = trainer.compute_loss(trainer.model, inputs)
    (loss * 0.7).backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()
                         if p.grad is not None}


def _vocab_rows(fn, vocab):
    """The largest row count of any tensor whose last dimension is the vocabulary (the head's
    [H, V] weight view excepted), made while ``fn`` runs."""
    import torch
    from conftest import VocabWatcher

    with VocabWatcher(vocab) as w:
        fn()
    return max([torch.Size(s[:-1]).numel() for s in w.seen if len(s) >= 2 and s[0] != 32]
               or [0])


def _unsloth_model(path):
    """A transformers model as Unsloth's own trainer takes it: Unsloth's for_training /
    for_inference bound to it (as FastLanguageModel binds them)."""
    import torch
    from transformers import AutoModelForCausalLM

    from gbc_kernels.integrations.unsloth import _add_mode_methods

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _add_mode_methods(model)
    return model


def _cpu(batch):
    import torch

    return {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in batch.items()}


def worker_objectives(a):
    import torch

    _setup_route(a["route"])
    import trl
    from gbc_kernels.integrations.unsloth import GBCGRPOConfig, GBCUnslothGRPOTrainer

    out, path = a["out"], _tiny(a["out"])
    report, saved = {"cases": {}}, {"cases": {}, "path": path}
    first = _build(GBCUnslothGRPOTrainer, GBCGRPOConfig, path, out, loss_type="grpo")
    report["base"] = "%s.%s" % (GBCUnslothGRPOTrainer.__mro__[2].__module__,
                                GBCUnslothGRPOTrainer.__mro__[2].__qualname__)
    report["compute_loss"] = type(first).compute_loss.__module__
    batch = _rollout(first)
    report["max_left_pad"] = int(batch["max_left_pad"].max()) if "max_left_pad" in batch else -1
    batch = _shape_batch(first, batch, seed=7)
    report["pad_mid_completion"] = bool(
        (batch["completion_ids"][0, 2] == first.processing_class.pad_token_id)
        and batch["completion_mask"][0, 2] == 1)
    report["T"] = batch["completion_ids"].size(1)
    report["ref_shape"] = list(batch["ref_per_token_logps"].shape)
    saved["batch"] = _cpu(batch)
    V = first.model.config.vocab_size
    first.current_gradient_accumulation_steps = 1
    report["tokens"] = int(batch["prompt_ids"].numel() + batch["completion_ids"].numel())
    report["vocab_rows_gbc"] = _vocab_rows(
        lambda: first.compute_loss(first.model, _cpu(batch)).backward(), V)
    for name, options in OBJECTIVES:
        trainer = _build(GBCUnslothGRPOTrainer, GBCGRPOConfig, path, out, **options)
        loss, grads = _loss_and_grads(trainer, _cpu(_case_batch(batch, options)), ACCUMULATION)
        report["cases"][name] = {"loss": loss}
        saved["cases"][name] = {"options": options, "loss": loss, "grads": grads}
        if options.get("lora"):
            saved["cases"][name]["lora_state"] = {
                n: p.detach().clone() for n, p in trainer.model.named_parameters()
                if "lora_" in n}
    torch.save(saved, os.path.join(out, "gbc.pt"))
    return report


def _grad_err(ours, theirs):
    """max over parameters of |ours - theirs|_max / |theirs|_max (theirs: float64)."""
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    return max(float((ours[n].double() - g).abs().max() / g.abs().max().clamp(min=1e-12))
               for n, g in theirs.items())


def _oracle_model(path, options, lora_state=None):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if options.get("lora"):
        model = _lora_model(model)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in lora_state:
                    p.copy_(lora_state[n])
    return model.double()


def _float64_trainer():
    """TRL 1.15's GRPOTrainer with its log-prob pass by plain float64 logits (TRL's own pass is
    a fused head that accumulates in float32): its ``_compute_loss`` unchanged."""
    import torch
    import trl

    class Float64GRPOTrainer(trl.GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                               logits_to_keep, batch_size=None,
                                               compute_entropy=False, **kw):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            z = logits[:, -logits_to_keep - 1:-1].double() / self.temperature
            lp = torch.log_softmax(z, -1)
            logp = lp.gather(-1, input_ids[:, -logits_to_keep:, None])[..., 0]
            entropy = -(lp.exp() * lp).sum(-1) if compute_entropy else None
            if entropy is not None:
                # TRL takes the quantile threshold in float32 and compares the entropies with it:
                # float64 entropies would drop the median token itself (the threshold rounded up)
                entropy = entropy.float().double()
            return logp, entropy, None

    return Float64GRPOTrainer


def worker_oracle(a):
    """TRL 1.15's own GRPOTrainer._compute_loss, the model in float64, Unsloth not imported."""
    import torch
    import trl

    assert "unsloth" not in sys.modules
    saved = torch.load(a["saved"], weights_only=False)
    path, out = saved["path"], a["out"]
    report = {"cases": {}}
    for name, case in saved["cases"].items():
        options = dict(case["options"])
        model = _oracle_model(path, options, case.get("lora_state"))
        options.pop("lora", None)
        ref = _build(_float64_trainer(), trl.GRPOConfig, path, out, model=model, **options)
        assert "unsloth" not in sys.modules
        assert type(ref).__mro__[1].__module__ == "trl.trainer.grpo_trainer"
        batch = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v)
                 for k, v in _case_batch(saved["batch"], case["options"]).items()}
        loss, grads = _loss_and_grads(ref, batch, ACCUMULATION)
        report["cases"][name] = {"loss": loss, "grad_err": _grad_err(case["grads"], grads),
                                 "n_grads": len(grads),
                                 "grads_nonzero": all(float(g.abs().max()) > 0
                                                      for g in grads.values())}
        if case["options"].get("lora"):
            report["lora_trained"] = sorted(grads) == sorted(case["lora_state"])
    return report


# ---------------------------------------------------------------- the four methods

def worker_methods(a):
    import torch

    _setup_route(a["route"])
    from gbc_kernels.integrations.unsloth import GBCGRPOConfig, GBCUnslothGRPOTrainer

    out, path = a["out"], _tiny(a["out"])
    report, saved = {"cases": {}}, {"cases": {}, "path": path}
    for name, options in METHODS:
        extra = dict(max_grad_norm=0.0, optim="sgd", learning_rate=0.5) if name == "lopti" \
            else {}
        trainer = _build(GBCUnslothGRPOTrainer, GBCGRPOConfig, path, out, **options, **extra)
        batch = _rollout(trainer)                   # gbc's passes inside Unsloth's rollout
        batch = _shape_batch(trainer, batch, seed=11, off_policy=name == "ar")
        if name == "nthr":
            # one group (whole, as NTHR inside the update's forward needs), both signs, and a
            # wrong completion that repeats the right one (its tokens are the aligned ones)
            batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
            batch["prompt_ids"][1], batch["prompt_mask"][1] = (batch["prompt_ids"][0],
                                                               batch["prompt_mask"][0])
            batch["completion_ids"][1] = batch["completion_ids"][0]
            batch["completion_mask"][1] = batch["completion_mask"][0]
        case = {"options": options, "batch": _cpu(batch)}
        if name == "lopti":
            trainer.create_optimizer()
            trainer.model.train()
            trainer.model.zero_grad()
            trainer.current_gradient_accumulation_steps = 1
            # the micro-batch as prepared: Unsloth's _prepare_inputs would roll out again
            type(trainer).__mro__[2]._prepare_inputs = lambda self, prepared: prepared
            loss = trainer.training_step(trainer.model, _cpu(batch))
            case["grads"] = {n: p.grad.detach().clone()
                             for n, p in trainer.model.named_parameters() if p.grad is not None}
            case["params"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            case["lr"] = trainer.args.learning_rate
            loss = float(loss)
        else:
            inputs = _cpu(batch)
            loss, case["grads"] = _loss_and_grads(trainer, inputs, 1)
            case["token_scale"] = inputs.get("gbc_token_scale")
        case["loss"] = loss
        case["config"] = _plain_config(trainer)
        report["cases"][name] = {"loss": loss}
        saved["cases"][name] = case
    torch.save(saved, os.path.join(out, "gbc.pt"))
    return report


def _plain_config(trainer):
    """gbc's loss config of this trainer as a dict (for gbc_reference's float64 loss)."""
    import dataclasses

    cfg = trainer._gbc_config(0.0, lopti=trainer.gbc_methods.lopti_eta is not None)
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    d["logits_dtype"] = None
    return d


def _ref_config(d):
    import dataclasses

    from gbc_reference import PolicyLossConfig

    names = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    return PolicyLossConfig(**{k: v for k, v in d.items() if k in names})


def _logits64(model, batch):
    import torch

    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    T = batch["completion_ids"].size(1)
    out = model(input_ids=ids, attention_mask=att, output_hidden_states=True)
    return out.logits[:, -T - 1:-1].double(), out.hidden_states[-1][:, -T - 1:-1]


def worker_method_oracle(a):
    """The methods by hand in float64 (Unsloth not imported): AR's weight alpha p_old + 1 -
    alpha, NTHR's scales (gbc_reference.nthr_scale, the paper's formula over the full
    vocabulary), the critical-token KL weight (1 - c) J**gamma + c with J = 1 + log max_v
    pi_ref(v) / log V, Lopti's first update by hand then its second phase at the moved
    parameters; the loss: gbc_reference.policy_loss in float64."""
    import math

    import torch
    from gbc_reference import nthr_scale, policy_loss

    assert "unsloth" not in sys.modules
    saved = torch.load(a["saved"], weights_only=False)
    path = saved["path"]
    report, checks = {"cases": {}}, {}
    for name, case in saved["cases"].items():
        batch, d = case["batch"], dict(case["config"])
        model = _oracle_model(path, {})
        base = {n: p.detach().clone() for n, p in model.named_parameters()}
        mask = batch["completion_mask"].double()
        targets = batch["completion_ids"]
        A = batch["advantages"].double()
        old = batch.get("old_per_token_logps")
        ref = batch.get("ref_per_token_logps")
        kw = dict(num_items_in_batch=batch["num_items_in_batch"].double()
                  if d["loss_agg"] == "token-mean" and "dapo" == case["options"]["loss_type"]
                  else None)
        if kw["num_items_in_batch"] is not None:
            # gbc's rescale of TRL's generation-batch count to one window (accumulation 1)
            kw["num_items_in_batch"] = kw["num_items_in_batch"].clamp(min=1.0)

        def logp_of(m):
            z, h = _logits64(m, batch)
            lp = torch.log_softmax(z / d["temperature"], -1)
            return lp.gather(-1, targets[..., None])[..., 0], z, h

        token_scale = kl_weight = None
        if name == "nthr":
            with torch.no_grad():
                _, z, h = logp_of(model)
                res = nthr_scale(h.double(), model.lm_head.weight.double(), targets, mask,
                                 torch.zeros(B, dtype=torch.long), A > 0,
                                 temperature=d["temperature"], beta=1.0, eta="auto")
            token_scale = res.scale.double()
            checks["nthr_scale_err"] = float((case["token_scale"].double() - token_scale)
                                             .abs().max())
            checks["nthr_selected"] = float(((token_scale != 1) & (mask > 0)).sum())
        if name == "critical-kl":
            with torch.no_grad():
                z, _ = _logits64(model, batch)
                p_max = torch.softmax(z / 1.0, -1).max(-1).values
                J = 1 + torch.log(p_max) / math.log(z.size(-1))
                gamma, c = 2.0, 0.1
                kl_weight = (1 - c) * J ** gamma + c
                ref_by_hand = torch.log_softmax(z / d["temperature"], -1).gather(
                    -1, targets[..., None])[..., 0]
            got = batch["gbc_kl_weight"].double()
            checks["kl_weight_err"] = float(((got - kl_weight) * mask).abs().max())
            checks["kl_weight_spread"] = float((kl_weight * mask).max()
                                               - (kl_weight + (1 - mask) * 9).min())
            checks["ref_err"] = float(((ref.double() - ref_by_hand) * mask).abs().max())
        cfg = _ref_config(d)
        if name == "lopti":
            # the first phase at the rollout's parameters, one SGD step by hand, the second
            with torch.no_grad():
                old_by_hand = logp_of(model)[0]
            old = batch["gbc_old_logp"].double()
            checks["lopti_old_err"] = float(((old - old_by_hand) * mask).abs().max())
            eta = case["options"]["gbc_lopti_eta"]
            checks["lopti_low"] = float(((old.exp() < eta) & (mask > 0)).sum())
            checks["lopti_high"] = float(((old.exp() >= eta) & (mask > 0)).sum())
            lp, _, _ = logp_of(model)
            # what the Trainer logs: the batch's loss without the split, at these parameters
            unsplit, _ = policy_loss(lp.detach(), mask, A, old_logp=old,
                                     config=_ref_config(dict(d, lopti_eta=None)), **kw)
            first, _ = policy_loss(lp, mask, A, old_logp=old, config=cfg, phase="low", **kw)
            model.zero_grad()
            first.backward()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p -= case["lr"] * p.grad
            moved = {n: p.detach().clone() for n, p in model.named_parameters()}
            lp, _, _ = logp_of(model)
            loss, _ = policy_loss(lp, mask, A, old_logp=old, config=cfg, phase="high", **kw)
            model.zero_grad()
            loss.backward()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            checks["lopti_param_err"] = max(float((case["params"][n].double() - moved[n])
                                                  .abs().max()) for n in moved)
            assert checks["lopti_param_err"] <= 1e-5, checks
            report["cases"][name] = {"loss": float(unsplit), "grad_err": _grad_err(
                case["grads"], grads), "n_grads": len(grads),
                "grads_nonzero": all(float(g.abs().max()) > 0 for g in grads.values())}
            continue
        lp, _, _ = logp_of(model)
        loss, _ = policy_loss(lp, mask, A, old_logp=None if old is None else old.double(),
                              ref_logp=None if ref is None else ref.double(),
                              token_scale=token_scale, kl_weight=kl_weight, config=cfg, **kw)
        model.zero_grad()
        (loss * 0.7).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        if name == "ar":
            d0 = dict(d, ar_alpha=0.0)
            plain, _ = policy_loss(lp.detach(), mask, A, old_logp=old.double(),
                                   config=_ref_config(d0), **kw)
            checks["ar_changed"] = abs(float(plain) - float(loss))
        report["cases"][name] = {"loss": float(loss), "grad_err": _grad_err(case["grads"], grads),
                                 "n_grads": len(grads),
                                 "grads_nonzero": all(float(g.abs().max()) > 0
                                                      for g in grads.values())}
        del base
    report["checks"] = checks
    return report


# ---------------------------------------------------------------- training, refusals

def worker_train(a):
    import torch

    _setup_route(a["route"])
    from gbc_kernels.integrations.unsloth import GBCGRPOConfig, GBCUnslothGRPOTrainer

    out, path = a["out"], _tiny(a["out"])
    calls = {"gbc": 0, "unsloth": 0}
    trainer = _build(GBCUnslothGRPOTrainer, GBCGRPOConfig, path, out, loss_type="dapo",
                     beta=0.04, max_steps=2, gradient_accumulation_steps=2,
                     per_device_train_batch_size=B, gbc_ar_alpha=0.3, gbc_lopti_eta=0.5,
                     gbc_nthr=True, gbc_critical_kl_exponent=2.0)
    ours = type(trainer)._compute_loss
    theirs = type(trainer).__mro__[2].compute_loss

    def spy(self, model, inputs):
        calls["gbc"] += 1
        return ours(self, model, inputs)

    def spy_theirs(self, *args, **kw):
        calls["unsloth"] += 1
        return theirs(self, *args, **kw)

    type(trainer)._compute_loss = spy
    type(trainer).__mro__[2].compute_loss = spy_theirs
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    finite = all(torch.isfinite(p).all() for p in trainer.model.parameters())
    return {"global_step": trainer.state.global_step, "gbc_losses": calls["gbc"],
            "unsloth_loss_calls": calls["unsloth"], "moved": moved, "finite": bool(finite)}


def worker_refusals(a):
    import torch
    import trl

    _setup_route(a["route"])
    import gbc_kernels.integrations.unsloth as gu
    from gbc_kernels.integrations.unsloth import GBCGRPOConfig, GBCUnslothGRPOTrainer
    from transformers import AutoModelForCausalLM

    out, path = a["out"], _tiny(a["out"])
    errors = {}
    bound = trl.GRPOTrainer
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    env_before = dict(os.environ)

    def attempt(key, fn):
        try:
            fn()
        except (RuntimeError, ValueError, ImportError) as e:
            errors[key] = str(e)
        else:
            errors[key] = "(not refused)"

    def build(**options):
        return _build(GBCUnslothGRPOTrainer, GBCGRPOConfig, path, out, model=model, **options)

    os.environ["UNSLOTH_GRPO_VLLM_IS_MODE"] = "token_mask"
    attempt("env", build)
    del os.environ["UNSLOTH_GRPO_VLLM_IS_MODE"]
    os.environ["UNSLOTH_GRPO_SEQ_PACKING"] = "1"
    attempt("env_packing", build)
    os.environ["UNSLOTH_GRPO_SEQ_PACKING"] = "0"     # off: nothing asked that gbc does not do
    errors["env_off_ok"] = gu.unsloth_environment() == []
    del os.environ["UNSLOTH_GRPO_SEQ_PACKING"]
    attempt("config", lambda: build(unsloth_num_chunks=4))
    os.environ["UNSLOTH_RETURN_HIDDEN_STATES"] = "1"
    attempt("hidden_states", build)
    del os.environ["UNSLOTH_RETURN_HIDDEN_STATES"]
    # a quantized head: the lm_head's weight as bitsandbytes packs a 4-bit one (uint8 storage)
    quantized = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    w = quantized.lm_head.weight
    quantized.lm_head.weight = torch.nn.Parameter(
        torch.zeros(w.numel() // 2, 1, dtype=torch.uint8), requires_grad=False)
    attempt("head_4bit", lambda: _build(GBCUnslothGRPOTrainer, GBCGRPOConfig, path, out,
                                        model=quantized))
    attempt("release", lambda: gu.check_unsloth_release({"unsloth": "2026.9.1"}))
    attempt("zoo_release", lambda: gu.check_unsloth_release({"unsloth_zoo": "2026.11.1"}))
    attempt("gbc_option", lambda: build(gbc_backend="nope"))
    unchanged = (trl.GRPOTrainer is bound and not hasattr(model, "for_training")
                 and all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
                 and dict(os.environ) == env_before)
    trainer = build()
    attempt("return_outputs", lambda: trainer.compute_loss(trainer.model, {}, True))
    return {"errors": errors, "unchanged": unchanged, "env_off_ok": errors.pop("env_off_ok")}


def worker_wrong_route(a):
    case = a["case"]
    if case == "gbc-first":
        import gbc_kernels.integrations.trl  # noqa: F401  (before Unsloth)
        _setup_route(a["route"])
    elif case == "cpu-backend":
        import unsloth  # noqa: F401  (no route env: its CPU backend, no rewrite)
    import gbc_kernels.integrations.unsloth as gu

    try:
        gu.GBCUnslothGRPOTrainer
    except RuntimeError as e:
        return {"error": str(e)}
    return {"error": "(not refused)"}


def worker_ddp(a):
    """One of 2 gloo ranks (the group met by a file): one SGD step of Unsloth's training loop
    under accelerate's DDP with gbc's loss. Reports Unsloth's own gradient averaging calls (its
    training_step wrapper averages when no DDP forward ran with gradients: gbc's loss runs
    inside DDP's forward, so it must not), and the step against the mean of both ranks' local
    gradients taken by hand on the same micro-batches."""
    import torch
    import torch.distributed as dist

    rank, world = a["rank"], 2
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a["port"]))
    _setup_route(a["route"])
    import unsloth.models.rl as unsloth_rl
    from gbc_kernels.integrations.unsloth import GBCGRPOConfig, GBCUnslothGRPOTrainer

    dist.init_process_group("gloo", init_method="file://" + a["store"], rank=rank,
                            world_size=world)
    averaged = []
    original = unsloth_rl._unsloth_average_gradients
    unsloth_rl._unsloth_average_gradients = lambda *x, **k: (averaged.append(1),
                                                            original(*x, **k))[1]
    out, path = a["out"], os.path.join(a["out"], "tiny")
    trainer = _build(GBCUnslothGRPOTrainer, GBCGRPOConfig, path, os.path.join(out, str(rank)),
                     loss_type="dapo", beta=0.0, max_steps=1, optim="sgd", learning_rate=0.5,
                     max_grad_norm=0.0, lr_scheduler_type="constant")
    assert trainer.accelerator.num_processes == world
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    seen = []
    ours = type(trainer)._compute_loss

    def spy(self, model, inputs):
        seen.append((_cpu(inputs), type(model).__name__))
        return ours(self, model, inputs)

    type(trainer)._compute_loss = spy
    trainer.train()
    type(trainer)._compute_loss = ours
    final = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    # by hand: this rank's gradient at the start on its micro-batch, averaged over the ranks
    model = trainer.model
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1
    ours(trainer, model, seen[0][0]).backward()
    err = 0.0
    for n, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g)
        want = start[n] - 0.5 * g / world
        err = max(err, float((final[n] - want).abs().max()))
    same = []
    for n in sorted(final):
        other = final[n].clone()
        dist.broadcast(other, src=0)
        same.append(torch.equal(other, final[n]))
    dist.destroy_process_group()
    return {"averaged_by_unsloth": len(averaged), "ddp_model": seen[0][1],
            "step_err": err, "ranks_equal": all(same), "micro_batches": len(seen),
            "moved": any(not torch.equal(final[n], start[n]) for n in final)}


def worker_tiny(a):
    return {"path": _tiny(a["out"])}


WORKERS = {"ddp": worker_ddp, "tiny": worker_tiny, "objectives": worker_objectives, "oracle": worker_oracle, "methods": worker_methods,
           "method_oracle": worker_method_oracle, "train": worker_train,
           "refusals": worker_refusals, "wrong_route": worker_wrong_route}

if __name__ == "__main__":
    _args = json.loads(sys.argv[1])
    sys.path.insert(0, HERE)
    _report = WORKERS[_args["mode"]](_args)
    print("REPORT " + json.dumps(_report), flush=True)
