"""Switching gbc on through each trainer's own loading path: a bad option, a missing dependency,
an unsupported version or an option the trainer's flow cannot honour stops the run with an error
naming it; only ``GBC_VERL_ENGINE=fallback`` runs the trainer's stock step, with a warning.

verl: a fresh process with the variables set runs ``import verl`` (verl loads gbc's
``verl.plugins`` entry point inside its own ``try/except``), then verl's entry points: its engine
registry (``EngineRegistry.get_engine_cls`` / ``new``), its workers' init (``TrainingWorker``,
``ActorRolloutRefWorker``) and its trainers' (``RayPPOTrainer``, the v1 ``PPOTrainer``). Its
worker and trainer modules import rollout-server packages that this CPU machine lacks:
``tests/standins/verl_server_deps.py`` stands in for them (nothing of theirs runs).
OpenRLHF: the setup hook as Ray's worker runs it (``load_and_execute_setup_hook``, what Ray's
``default_worker.py`` calls), in a fresh process. TRL: ``GBCGRPOConfig`` and ``GBCGRPOTrainer``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# ---------------------------------------------------------------------------------- verl

VERL_SCRIPT = r'''
import builtins, importlib.util, io, json, os, sys, warnings
args = json.loads(sys.argv[1])
HERE = args["tests"]
spec = importlib.util.spec_from_file_location(
    "verl_server_deps", os.path.join(HERE, "standins", "verl_server_deps.py"))
deps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(deps)
deps.install()
for name in args.get("block", []):          # a module gbc needs, not importable
    sys.modules[name] = None
if args.get("verl_version"):                 # verl's version file, as another release has it
    _open = builtins.open
    def fake_open(path, *a, **k):
        if str(path).endswith(os.path.join("verl", "version", "version")):
            return io.StringIO(args["verl_version"])
        return _open(path, *a, **k)
    builtins.open = fake_open
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import verl
if args.get("verl_version"):
    builtins.open = _open
report = {"warnings": [str(w.message) for w in caught if "GBC_VERL" in str(w.message)]}

def attempt(name, fn):
    try:
        got = fn()
        report[name] = {"ok": f"{got.__module__}.{got.__name__}" if isinstance(got, type) else "ok"}
    except Exception as exc:
        report[name] = {"type": type(exc).__name__, "message": str(exc)}

from verl.workers.engine.base import EngineRegistry
attempt("fsdp2", lambda: EngineRegistry.get_engine_cls("language_model", "fsdp2"))
attempt("megatron", lambda: EngineRegistry.get_engine_cls("language_model", "megatron"))
from verl.workers import engine_workers
attempt("training_worker", lambda: engine_workers.TrainingWorker(config=None))
attempt("actor_rollout_ref_worker",
        lambda: engine_workers.ActorRolloutRefWorker(config=None, role="actor"))
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
attempt("ray_ppo_trainer", lambda: RayPPOTrainer(config=None, tokenizer=None,
                                                 role_worker_mapping={},
                                                 resource_pool_manager=None))
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
attempt("v1_trainer", lambda: PPOTrainerSync(config=None))
print("REPORT " + json.dumps(report), flush=True)

if args.get("train"):           # verl's engine from its registry, one train_batch
    import functools, tempfile
    import torch
    sys.path.insert(0, HERE)
    from conftest import _free_port
    from test_other_trainers import verl_actor_config
    from test_verl_engine import make_batch, make_model_dir, verl_on_cpu
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.utils.losses import ppo_loss
    verl_on_cpu()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    model_dir = make_model_dir(tempfile.mkdtemp())
    torch.manual_seed(0)
    engine = EngineRegistry.new(
        "language_model", "fsdp2",
        model_config=HFModelConfig(path=model_dir, use_remove_padding=True,
                                   override_config={"attn_implementation": "sdpa"}),
        engine_config=FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False,
                                       model_dtype="fp32"),
        optimizer_config=FSDPOptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=1e6),
        checkpoint_config=CheckpointConfig())
    engine.initialize()
    before = {n: p.full_tensor().clone() for n, p in engine.module.named_parameters()}
    loss_fn = functools.partial(ppo_loss, config=verl_actor_config("vanilla", "token-mean"))
    with engine.train_mode():
        out = engine.train_batch(make_batch(0, 4), loss_fn)
    moved = sum(not torch.equal(p.full_tensor(), before[n])
                for n, p in engine.module.named_parameters())
    print("TRAIN " + json.dumps({"engine": type(engine).__name__, "moved": moved,
                                 "metrics": sorted(out["metrics"])}), flush=True)
    torch.distributed.destroy_process_group()
else:                           # as verl's worker builds its engine: uncaught
    EngineRegistry.new("language_model", "fsdp2")
'''


def _env(**variables):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GBC_")}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "python"),
                                           env.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", VERL_ENGINE_DEVICE="cuda", **variables)
    return env


def run_verl(engine, options=None, timeout=600, **args):
    """A fresh process: ``import verl`` with ``GBC_VERL_ENGINE=engine`` (and
    ``GBC_VERL_OPTIONS=options``), then verl's entry points; returns (exit code, the report of
    each entry point, the TRAIN line's dict or None, stderr)."""
    variables = {"GBC_VERL_ENGINE": engine}
    if options is not None:
        variables["GBC_VERL_OPTIONS"] = options
    proc = subprocess.run([sys.executable, "-c", VERL_SCRIPT, json.dumps({"tests": HERE, **args})],
                          env=_env(**variables), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
             for line in proc.stdout.splitlines() if line.startswith(("REPORT ", "TRAIN "))}
    assert "REPORT" in lines, proc.stderr[-3000:]
    return proc.returncode, lines["REPORT"], lines.get("TRAIN"), proc.stderr


ENTRY_POINTS = ("fsdp2", "megatron", "training_worker", "actor_rollout_ref_worker",
                "ray_ppo_trainer", "v1_trainer")


def assert_stopped(rc, report, stderr, *fragments):
    """Every entry point of verl refused with gbc's SwitchOnError, its message holding each of
    ``fragments``; the process (whose last step is the registry's ``new``) failed with it."""
    for point in ENTRY_POINTS:
        got = report[point]
        assert got.get("type") == "SwitchOnError", (point, got)
        for fragment in fragments:
            assert fragment in got["message"], (point, fragment, got["message"])
    assert rc != 0
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("gbc_kernels.integrations.verl.plugin.SwitchOnError"), last
    assert all(fragment in last for fragment in fragments), last
    assert not report["warnings"], report["warnings"]


@pytest.mark.parametrize("engine, options, fragment", [
    ("1", "ar_alpha=2", "GBC_VERL_OPTIONS: ar_alpha: expected a float >= 0.0 and <= 1.0, got 2"),
    ("strict", "lopti_eta=nan", "GBC_VERL_OPTIONS: lopti_eta: expected a finite"),
    ("1", "nthr=1,nthr_beta=inf", "GBC_VERL_OPTIONS: nthr_beta: expected a finite"),
])
def test_verl_bad_option_stops_the_run(engine, options, fragment):
    rc, report, _, stderr = run_verl(engine, options)
    assert_stopped(rc, report, stderr, fragment, f"GBC_VERL_ENGINE={engine}:")


def test_verl_missing_dependency_stops_the_run():
    """A module gbc's Megatron engine needs cannot be imported: the run stops (the FSDP
    engine's switch-on went through, but half an engine is not what was asked for)."""
    rc, report, _, stderr = run_verl("1", "ar_alpha=0.3",
                                     block=["gbc_kernels.integrations.verl.megatron"])
    assert_stopped(rc, report, stderr, "ModuleNotFoundError: import of "
                   "gbc_kernels.integrations.verl.megatron halted")


def test_verl_unsupported_version_stops_the_run():
    rc, report, _, stderr = run_verl("strict", None, verl_version="0.10.0")
    assert_stopped(rc, report, stderr, "verl 0.10.0: gbc's drop-in is tested on verl 0.9.x")


def test_verl_unknown_engine_value_stops_the_run():
    rc, report, _, stderr = run_verl("ture", "ar_alpha=0.3")
    assert_stopped(rc, report, stderr, "GBC_VERL_ENGINE='ture': expected 1/true/yes/strict")


@pytest.mark.slow
def test_verl_fallback_warns_and_runs_stock():
    """``fallback`` with a bad option: one warning naming it, verl's own engines in the
    registry, no entry point stopped, and verl's engine from its registry trains (its own
    metrics, no gbc's)."""
    rc, report, train, stderr = run_verl("fallback", "ar_alpha=2", train=True)
    assert rc == 0, stderr[-3000:]
    assert len(report["warnings"]) == 1, report["warnings"]
    assert report["warnings"][0].startswith("GBC_VERL_ENGINE=fallback: gbc's verl engine could "
                                            "not be switched on, verl runs its stock step")
    assert "GBC_VERL_OPTIONS: ar_alpha" in report["warnings"][0]
    assert report["fsdp2"] == {
        "ok": "verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead"}
    assert report["megatron"]["ok"].endswith("transformer_impl.MegatronEngineWithLMHead")
    for point in ENTRY_POINTS[2:]:      # verl's own errors for config=None, not gbc's
        assert report[point].get("type") not in (None, "SwitchOnError"), (point, report[point])
    assert train["engine"] == "FSDPEngineWithLMHead" and train["moved"] > 0
    assert "actor/pg_loss" in train["metrics"]
    assert not any(k.startswith("actor/gbc_") for k in train["metrics"])


def test_verl_on_hands_out_gbc_engines_and_builds_v1_with_critical_kl():
    """Good options under ``1``: gbc's engines for FSDP2 and Megatron, the workers and both
    trainers not stopped by gbc; critical-token KL is not refused by verl's v1 trainer (gbc
    computes its weights in the v1 reference pass too: tests/test_verl_transfer_queue.py),
    which fails on verl's own ``config=None`` as the legacy one does."""
    rc, report, _, stderr = run_verl("1", "ar_alpha=0.3,critical_kl_exponent=2", train=False)
    assert report["fsdp2"] == {"ok": "gbc_kernels.integrations.verl.fsdp.GBCFSDPEngineWithLMHead"}
    assert report["megatron"] == {
        "ok": "gbc_kernels.integrations.verl.megatron.GBCMegatronEngineWithLMHead"}
    for point in ("training_worker", "actor_rollout_ref_worker", "ray_ppo_trainer",
                  "v1_trainer"):
        assert report[point].get("type") not in (None, "SwitchOnError"), (point, report[point])
        assert "critical_kl" not in report[point]["message"], (point, report[point])
    assert report["v1_trainer"]["type"] == report["ray_ppo_trainer"]["type"], report
    assert not report["warnings"]


# ------------------------------------------------------------------------------ OpenRLHF

HOOK = "gbc_kernels.integrations.openrlhf.enable"
OPENRLHF_SCRIPT = r'''
import importlib.metadata, json, os, sys
args = json.loads(sys.argv[1])
sys.path.insert(0, os.path.join(args["tests"], "standins"))     # flash_attn, as test_openrlhf
for name in args.get("block", []):          # a module the drop-in needs, not importable
    sys.modules[name] = None
if args.get("openrlhf_version"):            # OpenRLHF's metadata, as another release has it
    _version = importlib.metadata.version
    importlib.metadata.version = lambda name: (args["openrlhf_version"] if name == "openrlhf"
                                               else _version(name))
from ray._private.runtime_env.setup_hook import load_and_execute_setup_hook
error = load_and_execute_setup_hook(args["hook"])      # what Ray's default_worker.py runs
report = {"error": error}
if error is None:
    from openrlhf.models import Actor
    from gbc_kernels.integrations import openrlhf as gorl
    report["actor_patched"] = getattr(Actor.forward, "gbc_patched", False)
    report["trainer_pending"] = any(getattr(f, "name", None) == gorl.TRAINER_MODULE
                                    for f in sys.meta_path)
    report["lopti_eta"] = gorl._STATE.methods.lopti_eta
print("REPORT " + json.dumps(report), flush=True)
'''


def run_openrlhf_hook(options, **args):
    """A fresh process runs gbc's setup hook as Ray's worker does, with
    ``GBC_OPENRLHF_OPTIONS=options``; returns the report (``error``: what Ray gets back, which
    makes it end the worker)."""
    proc = subprocess.run(
        [sys.executable, "-c", OPENRLHF_SCRIPT, json.dumps({"hook": HOOK, "tests": HERE, **args})],
        env=_env(GBC_OPENRLHF_OPTIONS=options), capture_output=True, text=True, timeout=300,
        cwd=ROOT)
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[0].split(" ", 1)[1])


@pytest.mark.parametrize("options, fragment", [
    ("ar_alpha=2", "GBC_OPENRLHF_OPTIONS: ar_alpha: expected a float >= 0.0 and <= 1.0, got 2"),
    ("lopti_eta=nan", "GBC_OPENRLHF_OPTIONS: lopti_eta: expected a finite"),
    ("nthr=true,nthr_beta=inf", "GBC_OPENRLHF_OPTIONS: nthr_beta: expected a finite"),
    ("alpha=0.3", "GBC_OPENRLHF_OPTIONS: alpha: not an option of the OpenRLHF drop-in"),
])
def test_openrlhf_hook_refuses_bad_option(options, fragment):
    report = run_openrlhf_hook(options)
    assert report["error"] and report["error"].startswith("Failed to execute the setup hook")
    assert "ValueError: " + fragment in report["error"], report["error"][-2000:]


def test_openrlhf_hook_refuses_missing_dependency_and_version():
    report = run_openrlhf_hook("ar_alpha=0.3", block=["openrlhf.models"])
    assert report["error"] and "openrlhf.models" in report["error"], report
    report = run_openrlhf_hook("ar_alpha=0.3", openrlhf_version="0.12.0")
    assert report["error"] and ("RuntimeError: openrlhf 0.12.0: gbc's drop-in is tested on "
                                "openrlhf 0.11.x") in report["error"], report


def test_openrlhf_hook_switches_on():
    """Good options: the actor patched now; OpenRLHF's Ray trainer (its module imports vLLM,
    absent here) right after its import, never skipped."""
    report = run_openrlhf_hook("lopti_eta=0.4")
    assert report == {"error": None, "actor_patched": True, "trainer_pending": True,
                      "lopti_eta": 0.4}


@pytest.mark.slow
def test_openrlhf_hook_under_ray_stops_the_actor(tmp_path):
    """A real local Ray cluster with gbc's hook and a bad option: the actor never runs, and
    its error names the option."""
    ray = pytest.importorskip("ray")
    script = tmp_path / "ray_run.py"
    script.write_text(
        "import os, ray\n"
        "ray.init(num_cpus=1, include_dashboard=False, runtime_env={'env_vars': {\n"
        "    'GBC_OPENRLHF_OPTIONS': 'ar_alpha=2', 'PYTHONPATH': os.environ['PYTHONPATH'],\n"
        "    'OMP_NUM_THREADS': '1'}, 'worker_process_setup_hook': '" + HOOK + "'})\n"
        "@ray.remote\n"
        "class A:\n"
        "    def ping(self):\n"
        "        return 'pong'\n"
        "try:\n"
        "    print('GOT', ray.get(A.remote().ping.remote(), timeout=240))\n"
        "except Exception as e:\n"
        "    print('ERROR', type(e).__name__, str(e).replace(chr(10), ' '))\n"
        "ray.shutdown()\n")
    proc = subprocess.run([sys.executable, str(script)], env=_env(), capture_output=True,
                          text=True, timeout=400, cwd=ROOT)
    line = [x for x in proc.stdout.splitlines() if x.startswith(("GOT", "ERROR"))]
    assert line and line[-1].startswith("ERROR ActorDiedError"), proc.stdout + proc.stderr[-2000:]
    assert "GBC_OPENRLHF_OPTIONS: ar_alpha: expected a float" in line[-1]
    del ray


# ----------------------------------------------------------------------------------- TRL

@pytest.mark.parametrize("argv, fragment", [
    (["--gbc_ar_alpha", "2"], "gbc_ar_alpha: refused as gbc's ar_alpha (ar_alpha: expected"),
    (["--gbc_lopti_eta", "nan"], "gbc_lopti_eta: refused as gbc's lopti_eta (lopti_eta: "
                                 "expected a finite"),
    (["--gbc_nthr", "true", "--gbc_nthr_beta", "inf"], "gbc_nthr_beta: refused as gbc's "
                                                       "nthr_beta (nthr_beta: expected a finite"),
    (["--gbc_backend", "cuda"], "gbc_backend='cuda': expected one of"),
    (["--gbc_critical_kl_exponent", "2"], "gbc_critical_kl_exponent"),      # beta 0: no KL
    (["--loss_type", "sft"], "loss_type='sft': expected one of"),
])
def test_trl_config_refuses_on_the_command_line(tmp_path, argv, fragment):
    """TRL's command line (``TrlParser``, as ``trl grpo`` parses) stops at parsing, naming the
    option; nothing is built."""
    pytest.importorskip("trl")
    from trl import TrlParser

    from gbc_kernels.integrations.trl import GBCGRPOConfig

    base = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none"]
    with pytest.raises(ValueError, match="^GBCGRPOConfig: unsupported option") as info:
        TrlParser((GBCGRPOConfig,)).parse_args_and_config(base + argv)
    assert fragment in str(info.value), str(info.value)
    (args,) = TrlParser((GBCGRPOConfig,)).parse_args_and_config(
        base + ["--gbc_ar_alpha", "0.3", "--beta", "0.04", "--gbc_critical_kl_exponent", "2"])
    assert args.gbc_ar_alpha == 0.3 and args.gbc_critical_kl_exponent == 2.0
