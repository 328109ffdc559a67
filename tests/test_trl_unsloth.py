"""GBCGRPOTrainer under Unsloth: refused at construction, whatever the import order.

Unsloth (unsloth/models/rl.py, ``_patch_trl_rl_trainers``) generates its own GRPO trainer in a
module ``unsloth_compiled_cache.UnslothGRPOTrainer`` and rebinds ``trl.GRPOTrainer``,
``trl.trainer.GRPOTrainer`` and ``trl.trainer.grpo_trainer.GRPOTrainer`` to it; its
``compute_loss`` is its own (rl_replacements.py, ``grpo_trainer_compute_loss``). Unsloth does not
import on this CPU machine with its GPU path (its CPU backend rewrites no GRPO trainer; docs/trl.md,
"Unsloth"), so these tests apply the same rebinding with a stand-in, each in a fresh process so
that no other test sees the patched TRL: gbc imported after it (gbc's class inherits the stand-in),
gbc imported before it, the smaller patches Unsloth leaves when it rewrites no trainer, and the
control (no patch: built and trained by gbc's loss as always).
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
import functools, json, sys, types
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


PATCHES = {"rebind": rebind_grpo_trainer, "unwrap": rebind_unwrap, "post_init": wrap_post_init,
           "imported": lambda: sys.modules.setdefault("unsloth", types.ModuleType("unsloth"))}
patch = PATCHES.get(args["patch"])
if patch is not None and args["order"] == "unsloth-first":
    patch()
from test_trl import build, make_inputs                    # imports gbc's trainer
from gbc_kernels.integrations.trl import GBCGRPOTrainer, trainer as gbc_trainer
if patch is not None and args["order"] == "gbc-first":
    patch()
report = {"base": GBCGRPOTrainer.__mro__[1].__module__}
if args.get("no_check"):          # what happens without the check
    gbc_trainer.check_no_unsloth = lambda *a, **kw: None
ours = GBCGRPOTrainer._compute_loss


def compute_loss(self, model, inputs):
    calls.append("gbc _compute_loss")
    return ours(self, model, inputs)


GBCGRPOTrainer._compute_loss = compute_loss
import pathlib
try:
    trainer = build(GBCGRPOTrainer, args["tiny"], pathlib.Path(args["out"]))
except RuntimeError as e:
    report["error"] = str(e)
else:
    loss = trainer.compute_loss(trainer.model, make_inputs(trainer, seed=0))
    loss.backward()
    report["calls"] = calls
print("REPORT " + json.dumps(report))
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_hf_model(str(path), tie_word_embeddings=False)
    return str(path)


def run(tiny, tmp_path, patch, order="unsloth-first", no_check=False):
    """A fresh process: ``patch`` applied before or after gbc's trainer is imported, then a
    GBCGRPOTrainer built and one loss taken; returns its report (``error``: the refusal,
    ``calls``: which loss ran, ``base``: the module of gbc's class's base)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GBC_")}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "python"),
                                           env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    args = dict(tests=HERE, tiny=tiny, out=str(tmp_path / "run"), patch=patch, order=order,
                no_check=no_check)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    line = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[0].split(" ", 1)[1])


def assert_refused(report, *names):
    """Refused by name: Unsloth, what is bypassed, the process that works, and the evidence."""
    error = report.get("error")
    assert error is not None and "calls" not in report, report
    for fragment in ("Unsloth has patched TRL in this process", "gbc_* option",
                     "No import order works", "a process that does not import unsloth", *names):
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
