"""GBCGRPOTrainer under Unsloth: refused at construction, whatever the import order.

Unsloth (unsloth/models/rl.py, ``_patch_trl_rl_trainers``) rewrites TRL's GRPO trainer as
``UnslothGRPOTrainer`` (a module of that name, its file in ``unsloth_compiled_cache/``) and
rebinds ``trl.GRPOTrainer``, ``trl.trainer.GRPOTrainer`` and
``trl.trainer.grpo_trainer.GRPOTrainer`` to it; its ``compute_loss`` is its own
(rl_replacements.py, ``grpo_trainer_compute_loss``). Its import runs that rewrite only on its GPU
path, so the default tests apply the same rebinding with a stand-in, each in a fresh process so
that no other test sees the patched TRL: gbc imported after it (gbc's class inherits it), gbc
imported before it, the smaller patches Unsloth leaves where it rewrites no trainer, and the
control (no patch: built, and its loss is gbc's). With ``GBC_UNSLOTH_PYTHON`` (an interpreter
with Unsloth installed) the same checks run against Unsloth itself: its CPU backend, and its GPU
path on CPU (``UNSLOTH_ALLOW_CPU=1``) with its own rewrite (docs/trl.md, "Unsloth").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import tiny_hf_model

pytest.importorskip("trl")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SCRIPT = r'''
import functools, json, pathlib, sys, types
args = json.loads(sys.argv[1])
sys.path.insert(0, args["tests"])
calls = []


def rebind_grpo_trainer():
    """What _patch_trl_rl_trainers leaves (as Unsloth 2026.10.9 does it with UNSLOTH_ALLOW_CPU=1):
    TRL's trainer rewritten as UnslothGRPOTrainer in a top-level module of that name, its file
    unsloth_compiled_cache/UnslothGRPOTrainer.py, with Unsloth's own compute_loss (never gbc's
    _compute_loss), bound to TRL's three names."""
    import torch, trl, trl.trainer, trl.trainer.grpo_trainer as grpo
    module = types.ModuleType("UnslothGRPOTrainer")
    module.__file__ = "/work/unsloth_compiled_cache/UnslothGRPOTrainer.py"
    sys.modules[module.__name__] = module
    module.__dict__.update(GRPOTrainer=grpo.GRPOTrainer, torch=torch, calls=calls)
    code = ("class UnslothGRPOTrainer(GRPOTrainer):\n"
            "    def compute_loss(self, model, inputs, return_outputs=False,\n"
            "                     num_items_in_batch=None):\n"
            "        calls.append('unsloth compute_loss')\n"
            "        return torch.zeros((), requires_grad=True)\n")
    exec(compile(code, module.__file__, "exec"), module.__dict__)
    cls = module.UnslothGRPOTrainer
    trl.GRPOTrainer = trl.trainer.GRPOTrainer = grpo.GRPOTrainer = cls


def rebind_unwrap():
    """PatchRL (run by Unsloth's import even where it rewrites no trainer): TRL's module-level
    unwrap_model_for_generation replaced by a function of unsloth.models.rl."""
    import trl.trainer.grpo_trainer as grpo
    space = {"__name__": "unsloth.models.rl", "original": grpo.unwrap_model_for_generation}
    exec("def unsloth_unwrap_model_for_generation(model, *a, **kw):\n"
         "    return original(model, *a, **kw)\n", space)
    grpo.unwrap_model_for_generation = space["unsloth_unwrap_model_for_generation"]


def wrap_post_init():
    """unsloth_zoo/cpu/trainer.py's _patch_post_init: GRPOConfig.__post_init__ wrapped with
    functools.wraps (so it keeps TRL's __module__; only its file is Unsloth's)."""
    from trl import GRPOConfig
    space = {"__name__": "trl.trainer.grpo_config", "functools": functools,
             "original": GRPOConfig.__post_init__}
    code = ("@functools.wraps(original)\n"
            "def __post_init__(self, *a, **kw):\n"
            "    return original(self, *a, **kw)\n")
    exec(compile(code, "/site-packages/unsloth_zoo/cpu/trainer.py", "exec"), space)
    GRPOConfig.__post_init__ = space["__post_init__"]


def import_unsloth():
    """Unsloth itself: on a machine without a GPU, its CPU backend (no trainer rewritten)."""
    import unsloth  # noqa: F401


def unsloth_rewrite():
    """Unsloth itself with UNSLOTH_ALLOW_CPU=1 (its GPU path on CPU, which skips the rewrite),
    then the rewrite its import runs on a GPU: unsloth/models/rl.py's patch_trl_rl_trainers."""
    import unsloth  # noqa: F401
    from unsloth.models.rl import patch_trl_rl_trainers
    patch_trl_rl_trainers()


PATCHES = {"rebind": rebind_grpo_trainer, "unwrap": rebind_unwrap, "post_init": wrap_post_init,
           "imported": lambda: sys.modules.setdefault("unsloth", types.ModuleType("unsloth")),
           "unsloth": import_unsloth, "unsloth_rewrite": unsloth_rewrite}
patch = PATCHES.get(args["patch"])
if patch is not None and args["order"] == "unsloth-first":
    patch()
from test_trl import build, make_inputs                    # imports gbc's trainer
from gbc_kernels.integrations.trl import GBCGRPOTrainer, trainer as gbc_trainer
if patch is not None and args["order"] == "gbc-first":
    patch()
report = {"base": GBCGRPOTrainer.__mro__[1].__module__}
built = GBCGRPOTrainer
if args.get("route"):             # gbc's Unsloth trainer (gbc_kernels.integrations.unsloth)
    from gbc_kernels.integrations.unsloth import GBCUnslothGRPOTrainer as built
if args.get("no_check"):          # what happens without the check
    gbc_trainer.check_no_unsloth = lambda *a, **kw: None
ours = GBCGRPOTrainer._compute_loss


def compute_loss(self, model, inputs):
    calls.append("gbc _compute_loss")
    return ours(self, model, inputs)


GBCGRPOTrainer._compute_loss = compute_loss
try:
    trainer = build(built, args["tiny"], pathlib.Path(args["out"]))
except RuntimeError as e:
    report["error"] = str(e)
else:
    report["compute_loss_file"] = type(trainer).compute_loss.__code__.co_filename
    try:
        trainer.current_gradient_accumulation_steps = 1
        trainer.compute_loss(trainer.model, make_inputs(trainer, seed=0)).backward()
    except Exception as e:            # Unsloth's own loss on inputs it does not expect
        import traceback
        report["loss_error"] = "".join(traceback.format_exception(e))[-6000:]
        report["loss_frames"] = [f.filename for f in traceback.extract_tb(e.__traceback__)]
    report["calls"] = calls
print("REPORT " + json.dumps(report))
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_hf_model(str(path), tie_word_embeddings=False)
    return str(path)


def run(tiny, tmp_path, patch, order="unsloth-first", no_check=False, python=sys.executable,
        route=False, **variables):
    """A fresh process of ``python`` (in ``tmp_path``: Unsloth writes its compiled cache in the
    working directory): ``patch`` applied before or after gbc's trainer is imported, then a
    GBCGRPOTrainer built and one loss taken; returns its report (``error``: the refusal,
    ``calls``: which loss ran, ``base``: the module of gbc's class's base)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GBC_", "UNSLOTH_"))}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "python"),
                                           env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               **variables)
    args = dict(tests=HERE, tiny=tiny, out=str(tmp_path / "run"), patch=patch, order=order,
                no_check=no_check, route=route)
    proc = subprocess.run([python, "-c", SCRIPT, json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[0].split(" ", 1)[1])


def assert_refused(report, *names):
    """Refused by name: Unsloth, what is bypassed, the process that works, and the evidence."""
    error = report.get("error")
    assert error is not None and "calls" not in report, report
    for fragment in ("Unsloth has patched TRL in this process", "gbc_* option",
                     "GBCUnslothGRPOTrainer", "a process that does not import unsloth", *names):
        assert fragment in error, (fragment, error)


def test_no_unsloth_builds_and_runs_gbcs_loss(tiny, tmp_path):
    report = run(tiny, tmp_path, patch=None)
    assert report["base"] == "trl.trainer.grpo_trainer"
    assert "error" not in report and report["calls"] == ["gbc _compute_loss"], report


def test_gbc_imported_after_unsloth_is_refused(tiny, tmp_path):
    report = run(tiny, tmp_path, patch="rebind", order="unsloth-first")
    assert report["base"] == "UnslothGRPOTrainer"
    assert_refused(report, "GBCGRPOTrainer's base is UnslothGRPOTrainer.UnslothGRPOTrainer, "
                   "not TRL's GRPOTrainer", "trl.GRPOTrainer")


def test_without_the_check_unsloths_loss_would_run(tiny, tmp_path):
    """The defect the refusal prevents: gbc's class on Unsloth's trainer builds, and its training
    loss is Unsloth's compute_loss, gbc's never called."""
    report = run(tiny, tmp_path, patch="rebind", order="unsloth-first", no_check=True)
    assert "error" not in report and report["calls"] == ["unsloth compute_loss"], report
    assert report["compute_loss_file"].endswith("unsloth_compiled_cache/UnslothGRPOTrainer.py")


def test_gbc_imported_before_unsloth_is_refused(tiny, tmp_path):
    """gbc's class keeps TRL's own base, but Unsloth has rewritten TRL around it."""
    report = run(tiny, tmp_path, patch="rebind", order="gbc-first")
    assert report["base"] == "trl.trainer.grpo_trainer"
    assert_refused(report, "trl.trainer.grpo_trainer.GRPOTrainer", "trl.GRPOTrainer")


@pytest.mark.parametrize("patch, evidence", [
    ("unwrap", "trl.trainer.grpo_trainer.unwrap_model_for_generation"),
    ("post_init", "trl.trainer.grpo_config.GRPOConfig.__post_init__"),
    ("imported", "the unsloth package is imported"),
])
def test_unsloths_other_patches_are_refused(tiny, tmp_path, patch, evidence):
    """Where Unsloth rewrites no trainer (its CPU backend, UNSLOTH_ALLOW_CPU=1) its import still
    patches TRL: each patch alone is refused, naming it."""
    assert_refused(run(tiny, tmp_path, patch=patch, order="gbc-first"), evidence)


# ------------------------------------------------------------------ Unsloth itself (opt-in)
# GBC_UNSLOTH_PYTHON: the interpreter of a venv with unsloth==2026.10.9 and unsloth_zoo, trl
# 1.15.0 (Unsloth pins trl<=1.15.0), the CPU torch and no torchvision (docs/trl.md, "Unsloth")
# (the compat row `make compat ONLY=unsloth` runs this file in such a venv: its own interpreter)
import importlib.util  # noqa: E402

UNSLOTH_PYTHON = os.environ.get("GBC_UNSLOTH_PYTHON") or (
    sys.executable if importlib.util.find_spec("unsloth") is not None else None)
needs_unsloth = pytest.mark.skipif(not UNSLOTH_PYTHON,
                                   reason="GBC_UNSLOTH_PYTHON: no interpreter with Unsloth")


@needs_unsloth
@pytest.mark.parametrize("order", ["unsloth-first", "gbc-first"])
def test_real_unsloth_cpu_backend_is_refused(tiny, tmp_path, order):
    """Unsloth's import on a machine without a GPU: its CPU backend rewrites no trainer but
    patches GRPOConfig's __post_init__ (the user's bf16, optim, ... changed) and TRL's head."""
    report = run(tiny, tmp_path, patch="unsloth", order=order, python=UNSLOTH_PYTHON)
    assert report["base"] == "trl.trainer.grpo_trainer"
    assert_refused(report, "the unsloth package is imported",
                   "trl.trainer.grpo_config.GRPOConfig.__post_init__")


@needs_unsloth
@pytest.mark.parametrize("order, evidence", [
    ("unsloth-first", "GBCGRPOTrainer's base is UnslothGRPOTrainer.UnslothGRPOTrainer, not "
                      "TRL's GRPOTrainer"),
    ("gbc-first", "trl.trainer.grpo_trainer.GRPOTrainer")])
def test_real_unsloth_rewrite_is_refused(tiny, tmp_path, order, evidence):
    """Unsloth's GPU path (UNSLOTH_ALLOW_CPU=1) and its rewrite of TRL's GRPOTrainer."""
    report = run(tiny, tmp_path, patch="unsloth_rewrite", order=order, python=UNSLOTH_PYTHON,
                 UNSLOTH_ALLOW_CPU="1")
    assert_refused(report, evidence, "trl.GRPOTrainer")


@needs_unsloth
def test_real_unsloth_without_the_check_runs_its_own_loss(tiny, tmp_path):
    """gbc's class on Unsloth's rewritten trainer builds and its loss goes into Unsloth's
    compiled grpo_compute_loss, never gbc's _compute_loss."""
    report = run(tiny, tmp_path, patch="unsloth_rewrite", no_check=True, python=UNSLOTH_PYTHON,
                 UNSLOTH_ALLOW_CPU="1")
    assert "error" not in report and "gbc _compute_loss" not in report["calls"], report
    assert report["compute_loss_file"].endswith("unsloth_compiled_cache/UnslothGRPOTrainer.py")
    # where Unsloth's loss fails on this machine (on some CPUs inside its fused model forward,
    # deep below), the failing call went through Unsloth's compiled trainer
    if "loss_error" in report:
        assert any(f.endswith("unsloth_compiled_cache/UnslothGRPOTrainer.py")
                   for f in report["loss_frames"]), report


@needs_unsloth
@pytest.mark.parametrize("patch, variables", [
    ("unsloth_rewrite", {"UNSLOTH_ALLOW_CPU": "1"}),
    ("unsloth", {"UNSLOTH_ZOO_DISABLE_GPU_INIT": "1"})], ids=["allow-cpu", "zoo-gpu-path"])
def test_real_unsloth_route_class_runs_gbcs_loss(tiny, tmp_path, patch, variables):
    """What the refusals above leave open (issue 67): gbc's Unsloth trainer
    (gbc_kernels.integrations.unsloth.GBCUnslothGRPOTrainer, docs/unsloth.md), on the class
    Unsloth generated, is built and its loss is gbc's _compute_loss, never Unsloth's."""
    report = run(tiny, tmp_path, patch=patch, python=UNSLOTH_PYTHON, route=True, **variables)
    assert report["base"] == "UnslothGRPOTrainer", report
    assert "error" not in report and "loss_error" not in report, report
    assert report["calls"] == ["gbc _compute_loss"], report
    assert report["compute_loss_file"].endswith("gbc_kernels/integrations/unsloth.py"), report


def test_only_unsloths_own_names_count():
    """What marks an object as Unsloth's: its packages (``unsloth``, ``unsloth_zoo``), the
    compiled cache and the trainers generated there, as module or folder names — never a user's
    folder that merely starts with "unsloth" (a venv ``~/venvs/unsloth-env``), which would refuse
    the plain trainer in a process without Unsloth."""
    from gbc_kernels.integrations.trl import trainer as t

    for name in ("unsloth", "unsloth_zoo", "unsloth_compiled_cache", "UnslothGRPOTrainer",
                 "UnslothSFTTrainer"):
        assert t._unsloth_name(name), name
    for name in ("unsloth-env", "unsloth_venv", "Unsloth", "unslothy", "gbc-unsloth-2026.10.9",
                 "", None, "trl"):
        assert not t._unsloth_name(name), name

    def f():
        return 1

    code = f.__code__
    f.__code__ = code.replace(co_filename="/home/u/venvs/unsloth-env/lib/mod.py")
    assert not t._from_unsloth(f)
    f.__code__ = code.replace(co_filename="/x/unsloth_compiled_cache/UnslothGRPOTrainer.py")
    assert t._from_unsloth(f)
