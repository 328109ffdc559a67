#!/usr/bin/env python3
"""`make compat`: every (trainer, release) in its own venv, its tests, docs/compatibility.md.

For each row of MATRIX this script

1. reads the trainer release's own pins from its wheel (``pip download --no-deps``: the
   ``Requires-Dist`` lines; transformers and torch shown in the table);
2. builds (or reuses) a venv for the row's requirement set, ``compat/sets/<trainer>-<release>.txt``:
   ``[resolve]`` lines installed with pip's resolver under ``compat/constraints.txt``
   (torch==2.13.0), ``[no-deps]`` lines with ``--no-deps --no-build-isolation`` (packages whose
   own requirements pull vLLM / flash-attn / a CUDA torch). torch itself lives once in a shared
   base venv (``compat/base.txt``) that each row's venv sees through a ``.pth`` file. Venvs are
   cached under ``~/.cache/gbc_compat`` by a hash of the interpreter, the base set, the
   constraints and the row's set, so a second run reinstalls nothing;
3. installs gbc_kernels from the checkout: one wheel per source hash, built without build
   isolation against the base venv's torch (C++ kernels included), installed ``--no-deps``;
4. runs the trainer's test files with pytest (``python -P``: gbc_kernels is the installed wheel,
   not the checkout's sources), reads the junit XML: passed / failed / skipped, the failing
   tests with their first error line, the skip reasons;
5. writes docs/compatibility.md from the results. Rows not run in this invocation keep the
   result of their last run (kept machine-readable at the end of the file) or say why not.

The row ``transformers==newest`` is not a trainer release: it installs the test venv's pins
(``compat/sets/transformers-newest.txt``) with the newest transformers on the index at the time
of the run (``NEWEST`` in the set, resolved by ``pip download``; its venv is cached by that
version) and runs a subset of the suite (TRANSFORMERS_SUBSET), to see a transformers release
coming before requirements-dev.txt adopts it. It is not in CI: its result moves with the index.

Usage: python compat/run.py [--only trl==1.14.2 --only verl] [--jobs 1] [--install-only]
       python compat/run.py --only transformers     # the newest transformers (not in CI)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOC = os.path.join(ROOT, "docs", "compatibility.md")

# trainer -> (pypi name, test files (globs, relative to the checkout), key packages to report)
TRAINERS = {
    "trl": ("trl", ["tests/test_trl.py", "tests/test_trl_nthr_in_forward.py"],
            ["trl", "transformers", "accelerate", "peft", "deepspeed", "datasets"]),
    "verl": ("verl", ["tests/test_verl*.py"],
             ["verl", "transformers", "tensordict", "numpy", "ray", "megatron-core"]),
    "openrlhf": ("openrlhf", ["tests/test_openrlhf*.py"],
                 ["openrlhf", "transformers", "deepspeed", "ray", "peft"]),
    "skyrl": ("skyrl", ["tests/test_skyrl*.py"],
              ["skyrl", "transformers", "peft", "ray", "tensordict", "megatron-core"]),
    "areal": ("areal", ["tests/test_areal*.py"],
              ["areal", "transformers", "peft", "ray", "omegaconf", "hydra-core"]),
    # gbc's loss inside Unsloth's GRPO trainer (issue 67): its own tests, and TRL's refusal tests
    # against Unsloth itself (the row's interpreter has it)
    "unsloth": ("unsloth", ["tests/test_unsloth*.py", "tests/test_trl_unsloth.py"],
                ["unsloth", "unsloth_zoo", "transformers", "trl", "peft", "accelerate"]),
}
# the newest transformers (a release of no trainer): the suite's parts that go through
# transformers' model loading and trainers (files, or pytest node ids)
TRANSFORMERS_SUBSET = [
    "tests/test_releases_transformers.py",         # issue 65: kernelize under a meta-device init
    "tests/test_hf.py",                            # gbc's own HF path
    "tests/test_verl_ulysses.py",                  # verl's FSDP engine at world size 2 (meta init)
    "tests/test_verl_support.py::test_ulysses_sp2_equals_sp1",
    "tests/test_verl_engine.py",                   # verl's FSDP engine, gbc's and verl's steps
    "tests/test_trl.py",                           # TRL 1.16's GRPOTrainer (PEFT, ZeRO-3)
]
TRAINERS["transformers"] = ("transformers", TRANSFORMERS_SUBSET,
                            ["transformers", "kernels", "tokenizers", "huggingface-hub", "trl",
                             "verl", "accelerate", "peft"])
NEWEST = "newest"       # a MATRIX release resolved at run time: the newest on the index
# the releases users hold (issue 51); a row per (trainer, release)
MATRIX = [
    ("trl", "1.14.2"), ("trl", "1.15.0"), ("trl", "1.16.0"),
    ("verl", "0.8.0"), ("verl", "0.9.0"), ("verl", "0.9.1"),
    ("openrlhf", "0.10.4"), ("openrlhf", "0.11.2"),
    ("skyrl", "0.3.0"), ("skyrl", "0.4.0"),
    ("areal", "1.0.4"),
    ("unsloth", "2026.10.9"),
    ("transformers", NEWEST),
]
NO_ADAPTER = {}

CPU_INSTALL_NOTE = """\
verl, OpenRLHF, SkyRL and AReaL pull GPU-only packages through their own requirements (vLLM,
flash-attn, flashinfer, Transformer Engine, a CUDA torch; DeepSpeed's sdist builds against the
torch it finds, and an isolated build fetches a CUDA one). On a CPU machine, for tests: torch
first, kept pinned by a constraints file; then the trainer's pure-Python requirements with the
resolver and the trainer itself (and DeepSpeed) with `--no-deps`; then gbc_kernels against the
torch you have. These are the commands `make compat` runs for each row (from the checkout root;
`python compat/run.py --print-install TRAINER==RELEASE` prints them for any row). TRL needs no
`--no-deps`: `pip install torch==2.13.0 && pip install -c compat/constraints.txt
--no-build-isolation -e ".[trl]"`.
"""

TRANSFORMERS_NOTE = """\
The test venv (`make install`) holds transformers 5.24.0 (requirements-dev.txt, under
requirements-lock.txt); each trainer row holds the transformers its trainer pins. The row
`transformers newest` runs a subset of the suite (the verl engine's Ulysses and FSDP tests,
TRL's, gbc's HF path, tests/test_releases_transformers.py) in the test venv's pins with the
newest transformers on the index: `make compat ONLY=transformers`. It is not in CI (`.ci/run`):
its result moves with the index; it shows a release coming before requirements-dev.txt adopts
it.

gbc's verl path (verl 0.9.1, whose own pin is transformers>=5.5.3,<5.11,!=5.6.0; the test
venv installs it `--no-deps`) is tested on transformers 5.10.4 (the verl 0.9.1 row), 5.23.0
(issue 65's run), 5.24.0 (the test venv) and 5.25.0 (the row below). From 5.25
`from_pretrained` kernelizes every model by default (`use_kernels` on unless
`USE_HUB_KERNELS` is false: transformers/modeling_utils.py:4415-4423, 4495), and verl's ranks
other than 0 build the model on `meta` (accelerate's `init_empty_weights`), which the `kernels`
package refuses: `ValueError: Unsupported device type 'meta'`, so verl's own FSDP engine does
not build at world size > 1 on 5.25. gbc's FSDP engine builds its model under
`gbc_kernels.integrations.releases.no_hub_kernels()` (`USE_HUB_KERNELS=NO` around the build):
the model is built as 5.24 builds it, nothing kernelized (on a GPU, 5.25's hub kernels are not
used by gbc's engines). verl's own engines that gbc does not replace (a critic's) still fail
on 5.25: set `USE_HUB_KERNELS=NO` in the workers' environment, or install
`"transformers<5.25"`. The `verl` extra (setup.py) says transformers<5.26.
"""


def log(msg):
    print(f"[compat {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:16]


def read(path):
    with open(path) as f:
        return f.read()


def run(cmd, log_path, env=None, cwd=None, timeout=None):
    """Run cmd, appending its output to log_path; returns (rc, seconds)."""
    t0 = time.time()
    with open(log_path, "a") as out:
        out.write(f"\n$ {' '.join(shlex.quote(c) for c in cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGINT first: pytest then still writes its summary and junit XML for what ran
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            out.write(f"\n[compat] timed out after {timeout} s\n")
            rc = 124
    return rc, time.time() - t0


def tail_error(log_path, n=1):
    """The last ERROR-ish lines of a pip log (the reason an install failed)."""
    lines = read(log_path).splitlines() if os.path.exists(log_path) else []
    errs = [l.strip() for l in lines if l.startswith("ERROR") or "error:" in l.lower()]
    return " | ".join((errs or [l.strip() for l in lines if l.strip()])[-n:])[:300]


def parse_set(path, newest=None):
    """A requirement set: '[resolve]' and '[no-deps]' sections of pip requirement lines, and
    '[outside-requires-python]': like '[no-deps]', with ``--ignore-requires-python`` (a trainer
    release whose Requires-Python excludes this machine's Python, run here all the same; its
    row says so). ``==NEWEST`` in a line: ``==newest`` (the release resolved for the run)."""
    sections, cur = {"resolve": [], "no-deps": [], "outside-requires-python": []}, "resolve"
    for line in read(path).splitlines():
        line = line.split("#", 1)[0].strip()
        if newest:
            line = line.replace("==NEWEST", f"=={newest}")
        if not line:
            continue
        m = re.fullmatch(r"\[(resolve|no-deps|outside-requires-python)\]", line)
        if m:
            cur = m.group(1)
        else:
            sections[cur].append(line)
    return sections


def pip_env():
    env = dict(os.environ)
    env["DS_BUILD_OPS"] = "0"          # DeepSpeed: no CUDA ops at install
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.pop("PYTHONPATH", None)
    return env


def site_packages(venv):
    return glob.glob(os.path.join(venv, "lib", "python*", "site-packages"))[0]


def vpy(venv):
    return os.path.join(venv, "bin", "python")


class Ctx:
    def __init__(self, args):
        self.args = args
        self.cache = os.path.expanduser(args.cache_dir)
        os.makedirs(self.cache, exist_ok=True)
        self.python = args.python
        self.pyver = subprocess.check_output(
            [self.python, "-c", "import sys; print(sys.version.split()[0])"], text=True).strip()
        self.constraints = os.path.join(HERE, "constraints.txt")
        self.base_txt = os.path.join(HERE, "base.txt")
        self.base_hash = sha(self.pyver, read(self.base_txt), read(self.constraints))
        self.base = None
        self.wheel = None


def ensure_base(ctx):
    """The shared venv with torch (CPU) and the test tools; built once per base.txt."""
    base = os.path.join(ctx.cache, f"base-{ctx.base_hash}")
    if os.path.exists(os.path.join(base, ".complete")):
        ctx.base = base
        return base
    shutil.rmtree(base, ignore_errors=True)
    lg = base + ".log"
    open(lg, "w").close()
    log(f"building the base venv {base} (log {lg})")
    steps = [
        [ctx.python, "-m", "venv", base],
        [vpy(base), "-m", "pip", "install", "-q", "torch==2.13.0"],
        [vpy(base), "-m", "pip", "install", "-q", "-c", ctx.constraints, "-r", ctx.base_txt],
    ]
    for cmd in steps:
        rc, _ = run(cmd, lg, env=pip_env())
        if rc:
            sys.exit(f"compat: the base venv failed to build: {tail_error(lg)} (log {lg})")
    open(os.path.join(base, ".complete"), "w").write(dt.datetime.now().isoformat())
    ctx.base = base
    return base


def source_files():
    """The checkout's files that make the gbc_kernels wheel (tracked + untracked, not ignored)."""
    out = subprocess.check_output(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--",
         "setup.py", "pyproject.toml", "README.md", "csrc", "gbc_kernels", "python"],
        cwd=ROOT, text=True)
    return sorted(f for f in set(out.split()) if os.path.isfile(os.path.join(ROOT, f)))


def ensure_wheel(ctx):
    """gbc_kernels from the checkout, built once per source hash (C++ kernels against torch)."""
    files = source_files()
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode() + b"\0")
        with open(os.path.join(ROOT, f), "rb") as fh:
            h.update(fh.read())
    src_hash = sha(h.hexdigest(), ctx.base_hash)
    wdir = os.path.join(ctx.cache, "gbc-wheels", src_hash)
    found = glob.glob(os.path.join(wdir, "gbc_kernels-*.whl"))
    if found:
        ctx.wheel, ctx.src_hash = found[0], src_hash
        return found[0]
    os.makedirs(wdir, exist_ok=True)
    lg = os.path.join(wdir, "build.log")
    log(f"building the gbc_kernels wheel from the checkout ({len(files)} files, log {lg})")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "src")
        for f in files:           # a copy: the build writes build/ and *.egg-info next to it
            os.makedirs(os.path.dirname(os.path.join(src, f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(src, f))
        env = pip_env()
        env["MAX_JOBS"] = "1"
        rc, secs = run([vpy(ctx.base), "-m", "pip", "wheel", "-q", "--no-build-isolation",
                        "--no-deps", src, "-w", wdir], lg, env=env)
    found = glob.glob(os.path.join(wdir, "gbc_kernels-*.whl"))
    if rc or not found:
        sys.exit(f"compat: the gbc_kernels wheel failed to build: {tail_error(lg)} (log {lg})")
    with zipfile.ZipFile(found[0]) as z:
        if not any(n.startswith("gbc_kernels/_C") for n in z.namelist()):
            log("warning: the wheel holds no C++ extension (gbc_kernels._C)")
    log(f"gbc_kernels wheel built in {secs:.0f} s")
    ctx.wheel, ctx.src_hash = found[0], src_hash
    return found[0]


def outside_requires_python(name, release) -> bool:
    """Whether the row's set installs the trainer release outside its Requires-Python."""
    for trainer, (pypi, _, _) in TRAINERS.items():
        path = os.path.join(HERE, "sets", f"{trainer}-{release}.txt")
        if pypi == name and os.path.exists(path):
            return any(re.match(rf"{re.escape(name)}\s*==", line, re.I)
                       for line in parse_set(path)["outside-requires-python"])
    return False


def trainer_pins(ctx, name, release):
    """The release's own Requires-Dist (from its wheel's METADATA), or why it won't download."""
    d = os.path.join(ctx.cache, "metadata", f"{name}-{release}")
    meta = os.path.join(d, "METADATA")
    if not os.path.exists(meta):
        os.makedirs(d, exist_ok=True)
        lg = os.path.join(d, "download.log")
        open(lg, "w").close()
        outside = ["--ignore-requires-python"] if outside_requires_python(name, release) \
            else []
        rc, _ = run([vpy(ctx.base), "-m", "pip", "download", "-q", "--no-deps"] + outside
                    + [f"{name}=={release}", "-d", d], lg, env=pip_env())
        whl = glob.glob(os.path.join(d, "*.whl"))
        if rc or not whl:
            text = read(lg)
            m = re.search(r"Ignored the following versions that require a different python "
                          r"version: (.*)", text)
            why = (f"does not install on Python {ctx.pyver}: {m.group(1).strip()}" if m
                   else f"does not download: {tail_error(lg)}")
            return {"error": why}
        with zipfile.ZipFile(whl[0]) as z:
            name_meta = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")][0]
            open(meta, "wb").write(z.read(name_meta))
        os.remove(whl[0])
    reqs, py = [], ""
    for line in read(meta).splitlines():
        if line.startswith("Requires-Dist:"):
            reqs.append(line.split(":", 1)[1].strip())
        elif line.startswith("Requires-Python:"):
            py = line.split(":", 1)[1].strip()

    def applies(req):
        """No extra, and its environment marker (if any) holds on this machine."""
        if "extra ==" in req:
            return False
        if ";" not in req:
            return True
        try:
            from packaging.markers import Marker
        except ImportError:
            return True
        try:
            return Marker(req.split(";", 1)[1]).evaluate()
        except Exception:
            return True

    def pin(pkg):
        got = [r for r in reqs if re.match(rf"{pkg}(?![-_.\w])", r, re.I) and applies(r)]
        return "; ".join(re.sub(r"\s+", "", g.split(";")[0])[len(pkg):] or "any" for g in got) \
            or "—"

    gpu = sorted({re.split(r"[<>=!~; \[]", r)[0].lower() for r in reqs if applies(r)
                  and re.match(r"(vllm|flash[-_]attn|deepspeed|flashinfer|transformer[-_]engine"
                               r"|torch\b)", r, re.I)})
    return {"transformers": pin("transformers"), "torch": pin("torch"), "python": py,
            "gpu_or_build": gpu}


def newest_release(ctx, name):
    """The newest release of ``name`` the index serves (a wheel, no pre-release): (version,
    None), or (None, why not). Its METADATA seeds :func:`trainer_pins`'s cache."""
    with tempfile.TemporaryDirectory(dir=ctx.cache) as d:
        lg = os.path.join(d, "download.log")
        open(lg, "w").close()
        rc, _ = run([vpy(ctx.base), "-m", "pip", "download", "-q", "--no-deps",
                     "--only-binary=:all:", name, "-d", d], lg, env=pip_env())
        whl = glob.glob(os.path.join(d, "*.whl"))
        if rc or not whl:
            return None, f"the newest {name} does not download: {tail_error(lg)}"
        version = os.path.basename(whl[0]).split("-")[1]
        meta_dir = os.path.join(ctx.cache, "metadata", f"{name}-{version}")
        if not os.path.exists(os.path.join(meta_dir, "METADATA")):
            os.makedirs(meta_dir, exist_ok=True)
            with zipfile.ZipFile(whl[0]) as z:
                name_meta = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")][0]
                open(os.path.join(meta_dir, "METADATA"), "wb").write(z.read(name_meta))
    return version, None


def set_hash(ctx, set_path, newest=None):
    return sha(ctx.base_hash, read(set_path), "v1", *([newest] if newest else []))


def install_commands(ctx, venv, sections):
    py = vpy(venv)
    cmds = []
    if sections["resolve"]:
        cmds.append([py, "-m", "pip", "install", "-q", "-c", ctx.constraints]
                    + sections["resolve"])
    if sections["no-deps"]:
        cmds.append([py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                     "-c", ctx.constraints] + sections["no-deps"])
    if sections["outside-requires-python"]:
        cmds.append([py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                     "--ignore-requires-python", "-c", ctx.constraints]
                    + sections["outside-requires-python"])
    return cmds


def ensure_venv(ctx, trainer, release, newest=None):
    """The row's venv: cached by the hash of its requirement set (and ``newest``, the release
    its ``==NEWEST`` stands for). Returns (venv, info)."""
    set_path = os.path.join(HERE, "sets", f"{trainer}-{release}.txt")
    sections = parse_set(set_path, newest)
    name = f"{trainer}-{release}-{set_hash(ctx, set_path, newest)}"
    if name.lower().startswith("unsloth"):
        # a venv folder named unsloth-* read as Unsloth's to gbc's check_no_unsloth before it
        # matched Unsloth's own names only; the prefix stays so that cached venvs keep their path
        name = "gbc-" + name
    venv = os.path.join(ctx.cache, "venvs", name)
    info = {"set": os.path.relpath(set_path, ROOT), "cached": True, "install_s": 0.0}
    if os.path.exists(os.path.join(venv, ".complete")) and not ctx.args.rebuild:
        return venv, info
    info["cached"] = False
    shutil.rmtree(venv, ignore_errors=True)
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    lg = venv + ".install.log"
    open(lg, "w").close()
    info["install_log"] = lg
    t0 = time.time()
    rc, _ = run([ctx.python, "-m", "venv", venv], lg)
    if not rc:
        # the base venv's site-packages (torch, triton, pytest) after the row's own
        with open(os.path.join(site_packages(venv), "_gbc_compat_base.pth"), "w") as f:
            f.write(site_packages(ctx.base) + "\n")
        for cmd in install_commands(ctx, venv, sections):
            rc, _ = run(cmd, lg, env=pip_env(), timeout=ctx.args.install_timeout)
            if rc:
                break
    info["install_s"] = round(time.time() - t0, 1)
    if rc:
        info["error"] = tail_error(lg, 2)
        return None, info
    # torch must still be the base's CPU build
    out = subprocess.run([vpy(venv), "-c", "import torch; print(torch.__version__, torch.__file__)"],
                         capture_output=True, text=True)
    if out.returncode or "+cpu" not in out.stdout or ctx.base not in out.stdout:
        info["error"] = f"torch is not the base venv's CPU build: {out.stdout.strip()} " \
                        f"{out.stderr.strip()[-200:]}"
        return None, info
    open(os.path.join(venv, ".complete"), "w").write(dt.datetime.now().isoformat())
    return venv, info


VERSIONS_PY = r"""
import json, sys
from importlib import metadata
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        out[name] = None
try:
    import gbc_kernels, gbc_kernels.backends as b
    out["gbc_kernels.path"] = gbc_kernels.__file__
    out["gbc_kernels.cpu_ext"] = bool(b.cpu_available())
except Exception as exc:
    out["gbc_kernels.error"] = repr(exc)[:200]
print(json.dumps(out))
"""


def versions(venv, names):
    out = subprocess.run([vpy(venv), "-P", "-c", VERSIONS_PY] + names + ["torch", "python"],
                         capture_output=True, text=True, cwd=tempfile.gettempdir())
    try:
        v = json.loads(out.stdout.strip().splitlines()[-1])
    except Exception:
        return {"error": (out.stderr or out.stdout)[-300:]}
    v["python"] = subprocess.check_output([vpy(venv), "-c", "import platform; "
                                           "print(platform.python_version())"], text=True).strip()
    return v


def parse_junit(path):
    res = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skips": {}}
    if not os.path.exists(path):
        return res
    root = ET.parse(path).getroot()
    for tc in root.iter("testcase"):
        name = f"{tc.get('file') or tc.get('classname', '').replace('.', '/') + '.py'}" \
               f"::{tc.get('name')}"
        fail = tc.find("failure")
        err = tc.find("error")
        skip = tc.find("skipped")
        if fail is not None or err is not None:
            el = fail if fail is not None else err
            res["failed" if fail is not None else "errors"] += 1
            msg = (el.get("message") or el.text or "").strip()
            first = next((l.strip() for l in msg.splitlines() if l.strip()), "")
            res["failures"].append({"test": name, "error": first[:240]})
        elif skip is not None:
            res["skipped"] += 1
            msg = (skip.get("message") or "").strip()
            if msg in ("", "collection skipped") and skip.text:   # a module-level skip
                m = re.search(r"Skipped: (.*?)[\"']\)\s*$", skip.text.strip(), re.S)
                f = re.match(r"\('([^']+)'", skip.text.strip())
                where = os.path.relpath(f.group(1), ROOT) if f else tc.get("classname", "")
                msg = f"whole module {where}: " + (m.group(1) if m else skip.text.strip())
            msg = msg.splitlines()
            reason = re.sub(r"^Skipped:\s*", "", msg[0] if msg else "")[:200]
            res["skips"][reason] = res["skips"].get(reason, 0) + 1
        else:
            res["passed"] += 1
    return res


def log_exceptions(log_path, top=6):
    """The exception lines of the pytest log (``SomeError: message`` at the start of a line),
    distinct, most frequent first: the spawned ranks' tracebacks go to the log, not to the
    junit report, whose failure says only that a rank exited."""
    counts = {}
    if os.path.exists(log_path):
        for line in read(log_path).splitlines():
            m = re.match(r"([A-Za-z_][\w.]*(?:Error|Exception)): (.+)", line)
            if m:
                # ports, pids, addresses: one line per kind of error
                msg = re.sub(r"\b\d{4,}\b", "N", m.group(2).strip())
                key = f"{m.group(1)}: {msg}"[:200]
                counts[key] = counts.get(key, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])[:top]


def _releases():
    """gbc_kernels/integrations/releases.py (the releases each adapter is tested on), loaded by
    path: this script runs outside the rows' venvs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gbc_releases", os.path.join(ROOT, "gbc_kernels", "integrations", "releases.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def refused_release(trainer, release) -> bool:
    """A release the adapter refuses at switch-on (not in ``releases.TESTED``): its row runs
    only tests/test_releases.py, which checks the refusal by name through the real switch-on."""
    rel = _releases()
    if trainer not in rel.TESTED:
        return False
    try:
        rel.check_release(trainer, release)
    except RuntimeError:
        return True
    return False


def run_tests(ctx, venv, trainer, row):
    files, select = [], []
    if refused_release(trainer, row["release"]):
        files, select = ["tests/test_releases.py"], ["-k", trainer]
    else:
        for pat in TRAINERS[trainer][1]:
            if "::" in pat:             # a pytest node id: its file must exist
                if os.path.exists(os.path.join(ROOT, pat.split("::")[0])):
                    files.append(pat)
                continue
            files += sorted(os.path.relpath(p, ROOT)
                            for p in glob.glob(os.path.join(ROOT, pat)))
    lg_dir = os.path.join(ctx.cache, "logs")
    os.makedirs(lg_dir, exist_ok=True)
    tag = f"{trainer}-{row['release']}"
    lg = os.path.join(lg_dir, f"{tag}.pytest.log")
    xml = os.path.join(lg_dir, f"{tag}.junit.xml")
    for p in (lg, xml):
        if os.path.exists(p):
            os.remove(p)
    open(lg, "w").close()
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MAX_JOBS", "1")
    # DeepSpeed's JIT ops (ZeRO-3's shm_comm) compile once per venv, not into the shared
    # ~/.cache/torch_extensions that other environments on the machine use
    env["TORCH_EXTENSIONS_DIR"] = os.path.join(venv, "torch_extensions")
    # -P: the checkout's root is not put on sys.path, so gbc_kernels is the installed wheel
    cmd = [vpy(venv), "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           "--continue-on-collection-errors",
           "-o", "junit_family=xunit1"] + ctx.args.pytest_args + select + files
    row["command"] = " ".join(["python", "-P", "-m", "pytest", "-q",
                               "--continue-on-collection-errors"] + ctx.args.pytest_args
                              + select + files)
    rc, secs = run(cmd, lg, env=env, cwd=ROOT, timeout=ctx.args.test_timeout)
    res = parse_junit(xml)
    res.update({"rc": rc, "test_s": round(secs, 1), "log": lg, "junit": xml})
    if res["failed"] or res["errors"]:
        res["log_exceptions"] = log_exceptions(lg)
    if rc == 124:
        res["timeout"] = ctx.args.test_timeout
    return res


def do_row(ctx, trainer, release):
    name = TRAINERS[trainer][0]
    row = {"trainer": trainer, "release": release,
           "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
           "gbc_source": getattr(ctx, "src_hash", None), "commit": git_commit()}
    t0 = time.time()
    newest = None
    if release == NEWEST:
        newest, why = newest_release(ctx, name)
        if newest is None:
            row["status"] = f"not run ({why})"
            return row
        row["resolved"] = newest
    row["pins"] = trainer_pins(ctx, name, newest or release)
    if "error" in row["pins"]:
        row["status"] = f"not run ({name} {release} {row['pins']['error']})"
        return row
    set_path = os.path.join(HERE, "sets", f"{trainer}-{release}.txt")
    if trainer in NO_ADAPTER:
        why = NO_ADAPTER[trainer]
        torch_pin = row["pins"]["torch"]
        if torch_pin not in ("—", "any") and not _allows(torch_pin, "2.13.0"):
            why += f"; its own pin torch{torch_pin} excludes the tested torch 2.13.0"
        row["status"] = f"not run ({why})"
        return row
    if not os.path.exists(set_path):
        row["status"] = f"not run (no requirement set {os.path.relpath(set_path, ROOT)})"
        return row
    log(f"{trainer} {release}: venv")
    venv, info = ensure_venv(ctx, trainer, release, newest)
    row["install"] = info
    if venv is None:
        row["status"] = f"install failed: {info.get('error')}"
        log(f"{trainer} {release}: install failed in {info['install_s']} s: {info.get('error')}")
        return row
    log(f"{trainer} {release}: venv {'reused' if info['cached'] else 'built'} "
        f"({info['install_s']} s)")
    lg = venv + ".gbc.log"
    open(lg, "w").close()
    rc, _ = run([vpy(venv), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
                 ctx.wheel], lg, env=pip_env())
    if rc:
        row["status"] = f"gbc_kernels install failed: {tail_error(lg)}"
        return row
    row["versions"] = versions(venv, TRAINERS[trainer][2])
    if ctx.args.install_only:
        row["status"] = "installed (tests not run: --install-only)"
        return row
    log(f"{trainer} {release}: pytest (transformers {row['versions'].get('transformers')}"
        f"{', kernels ' + str(row['versions'].get('kernels')) if trainer == 'transformers' else ''})")
    row["tests"] = run_tests(ctx, venv, trainer, row)
    t = row["tests"]
    if t.get("timeout"):
        row["status"] = (f"not finished (stopped after {t['timeout']} s, --test-timeout; "
                         + ("counts are the tests that ran)" if os.path.exists(res_xml(row))
                            else "pytest wrote no report: no counts)"))
    elif t["rc"] < 0:
        row["status"] = f"not finished (pytest killed by signal {-t['rc']})"
    elif t["failed"] or t["errors"]:
        row["status"] = "fail"
    elif any("could not import" in reason for reason in t["skips"]):
        # an importorskip that fired: the row's environment lacks something, not a pass
        row["status"] = "incomplete (tests skipped for a missing import, see details)"
    elif t["passed"] == 0:
        row["status"] = "no test ran" + (f" (pytest rc {t['rc']})" if t["rc"] else "")
    elif refused_release(trainer, release):
        oldest = _releases().OLDEST.get(trainer)
        if oldest and _releases().minor(oldest[0]) != _releases().minor(release):
            oldest = None
        row["status"] = (f"refused by name at switch-on (gbc's {trainer} drop-in is tested on "
                         + ", ".join(f"{v}.x" for v in _releases().TESTED[trainer])
                         + (f" from {oldest[0]} on: {oldest[1]}" if oldest else "") + ")")
    else:
        row["status"] = "pass"
    py = row["pins"].get("python")
    if outside_requires_python(name, release) and py:
        row["status"] += (f" (on Python {ctx.pyver}, outside its Requires-Python {py}: "
                          f"installed with --ignore-requires-python)")
    row["total_s"] = round(time.time() - t0, 1)
    log(f"{trainer} {release}: {row['status']}: {t['passed']} passed, {t['failed']} failed, "
        f"{t['errors']} errors, {t['skipped']} skipped in {t['test_s']} s")
    return row


def _allows(spec, version):
    """Whether a specifier like '>=2.9.1,<2.11' admits version (True when it can't tell)."""
    try:
        from packaging.specifiers import SpecifierSet
        return all(SpecifierSet(s).contains(version) for s in spec.split("; "))
    except Exception:
        return True


def res_xml(row):
    return row.get("tests", {}).get("junit", "")


_COMMIT = None


def git_commit():
    global _COMMIT
    if _COMMIT is None:
        try:
            c = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                        text=True).strip()
            dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode
            _COMMIT = c + ("+dirty" if dirty else "")
        except Exception:
            _COMMIT = "?"
    return _COMMIT


# ---------------------------------------------------------------------------------- the doc

MARK = "<!-- compat-results"


def previous_rows():
    if not os.path.exists(DOC):
        return {}
    text = read(DOC)
    i = text.find(MARK)
    if i < 0:
        return {}
    body = text[i + len(MARK):text.index("-->", i)]
    try:
        return {(r["trainer"], r["release"]): r for r in json.loads(body)}
    except Exception:
        return {}


def fmt_s(s):
    return f"{s / 60:.1f} min" if s and s >= 90 else (f"{s:.0f} s" if s is not None else "—")


def install_lines(trainer, release):
    """The CPU install of one row, as shell commands (what ensure_venv runs)."""
    sections = parse_set(os.path.join(HERE, "sets", f"{trainer}-{release}.txt"))
    # ==NEWEST: unpinned (in a fresh venv pip takes the newest release)
    sections = {k: [x.replace("==NEWEST", "") for x in v] for k, v in sections.items()}
    q = lambda xs: " ".join(shlex.quote(x) for x in xs)  # noqa: E731
    out = ["pip install torch==2.13.0",
           "pip install -c compat/constraints.txt -r compat/base.txt"]
    if sections["resolve"]:
        out.append("pip install -c compat/constraints.txt " + q(sections["resolve"]))
    if sections["no-deps"]:
        out.append("DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation "
                   "-c compat/constraints.txt " + q(sections["no-deps"]))
    if sections["outside-requires-python"]:
        out.append("pip install --no-deps --no-build-isolation --ignore-requires-python "
                   "-c compat/constraints.txt " + q(sections["outside-requires-python"]))
    out.append("pip install --no-build-isolation --no-deps -e .")
    return out


def write_doc(rows, argv):
    L = ["# Compatibility: each trainer release in its own environment", "",
         "<!-- generated by compat/run.py (make compat); do not edit by hand -->", "",
         "Written by `make compat` (`python compat/run.py`) from its run: for every (trainer, "
         "release) a fresh venv with torch 2.13.0 (CPU), that release with its own dependency "
         "pins (transformers as the trainer pins it; the requirement set is "
         "`compat/sets/<trainer>-<release>.txt`), gbc_kernels built from the checkout, and that "
         "trainer's test files under pytest. Venvs are cached under `~/.cache/gbc_compat` by "
         "their requirement set. `make compat ONLY=trl==1.14.2` reruns one row; the other rows "
         "keep their last result (and its date).", "",
         "Each adapter takes the releases it is tested on and refuses any other by name when "
         "it is switched on (`gbc_kernels/integrations/releases.py`: "
         + "; ".join(f"{t} " + ", ".join(f"{v}.x" for v in vs)
                     + (f" from {_releases().OLDEST[t][0]}" if t in _releases().OLDEST else "")
                     for t, vs in _releases().TESTED.items())
         + "). The row of a refused release installs it all the same and runs "
         "`tests/test_releases.py` there, which checks that refusal through the adapter's real "
         "switch-on; its result says \"refused by name\".", "",
         "## CPU test install", "", CPU_INSTALL_NOTE]
    # the newest release of each trainer that gbc's adapter takes and that installs here
    for trainer, newest in (("verl", "0.9.1"), ("openrlhf", "0.11.2"), ("skyrl", "0.3.0"),
                            ("skyrl", "0.4.0")):
        L += [f"{trainer} {newest} (`compat/sets/{trainer}-{newest}.txt`):", "", "```bash"]
        L += install_lines(trainer, newest) + ["```", ""]
    L += ["## transformers", "", TRANSFORMERS_NOTE]
    L += ["## Matrix", "",
         "| trainer | release | result | tests passed / failed / skipped | transformers "
         "(resolved) | trainer pins transformers | other key versions | venv | test time | date "
         "(commit) |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for trainer, release in MATRIX:
        r = rows.get((trainer, release)) or {
            "trainer": trainer, "release": release,
            "status": "not run (not selected in any run yet: `make compat ONLY=%s==%s`)"
                      % (trainer, release)}
        v = r.get("versions", {})
        pins = r.get("pins", {})
        t = r.get("tests")
        counts = (f"{t['passed']} / {t['failed'] + t['errors']} / {t['skipped']}" if t else "—")
        key = ", ".join(f"{k} {v[k]}" for k in TRAINERS[trainer][2][1:]
                        if k != "transformers" and v.get(k)) or "—"
        inst = r.get("install")
        venv = ("cached" if inst and inst.get("cached") else
                f"built {fmt_s(inst['install_s'])}" if inst else "—")
        rel = f"{release} ({r['resolved']})" if r.get("resolved") else release
        L.append(f"| {trainer} | {rel} | {r['status']} | {counts} | "
                 f"{v.get('transformers') or '—'} | {pins.get('transformers', '—')} | {key} | "
                 f"{venv} | {fmt_s(t['test_s']) if t else '—'} | "
                 f"{r.get('date', '—')} ({r.get('commit', '—')}) |")
    L += ["", "## Details", ""]
    for trainer, release in MATRIX:
        r = rows.get((trainer, release))
        if not r:
            continue
        L.append(f"### {trainer} {release}")
        L.append("")
        L.append(f"- result: {r['status']}")
        if r.get("resolved"):
            L.append(f"- {release}: {trainer} {r['resolved']}, the newest release on the index "
                     f"on {r.get('date', '?')[:10]}")
        pins = r.get("pins", {})
        if "error" not in pins and pins:
            L.append(f"- its own pins: transformers `{pins['transformers']}`, torch "
                     f"`{pins['torch']}`, Python `{pins['python'] or 'any'}`; GPU-only or "
                     f"CUDA-building requirements: {', '.join(pins['gpu_or_build']) or 'none'}")
        if r.get("install"):
            L.append(f"- requirement set: `{r['install']['set']}`")
        v = r.get("versions")
        if v:
            L.append("- resolved: " + ", ".join(f"{k} {v[k]}" for k in v
                                                 if not k.startswith("gbc") and v[k]))
            if "gbc_kernels.cpu_ext" in v:
                L.append(f"- gbc_kernels: installed wheel (source {r.get('gbc_source')}), "
                         f"C++ kernels {'built' if v['gbc_kernels.cpu_ext'] else 'MISSING'}")
        if r.get("command"):
            L.append(f"- command (checkout root, the row's venv): `{r['command']}`")
        t = r.get("tests")
        if t:
            L.append(f"- {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
                     f"{t['skipped']} skipped in {fmt_s(t['test_s'])} (pytest rc {t['rc']})")
            groups = {}
            for f in t["failures"]:
                groups[f["error"]] = groups.get(f["error"], 0) + 1
            if len(groups) > 1 or len(t["failures"]) > 3:
                L.append("  - failures by first error line:")
                for err, n in sorted(groups.items(), key=lambda kv: -kv[1]):
                    L.append(f"    - ×{n}: {err or '(no message)'}")
            if t.get("log_exceptions"):
                L.append("  - exception lines in the pytest log (the spawned ranks' "
                         "tracebacks included), most frequent first:")
                for err, n in t["log_exceptions"]:
                    L.append(f"    - ×{n}: `{err}`")
            for f in t["failures"][:40]:
                L.append(f"  - FAILED `{f['test']}`: {f['error'] or '(no message)'}")
            if len(t["failures"]) > 40:
                L.append(f"  - … and {len(t['failures']) - 40} more")
            for reason, n in sorted(t["skips"].items(), key=lambda kv: -kv[1])[:8]:
                L.append(f"  - skipped ×{n}: {reason}")
        L.append("")
    L += ["Machine-readable results of the last run of each row (read back by compat/run.py):",
          "", MARK, json.dumps([rows[k] for k in MATRIX if k in rows], indent=1), "-->", ""]
    os.makedirs(os.path.dirname(DOC), exist_ok=True)
    with open(DOC, "w") as f:
        f.write("\n".join(L))


def select(only):
    if not only:
        return list(MATRIX)
    out = []
    for spec in only:
        for s in spec.split(","):
            s = s.strip()
            if not s:
                continue
            t, _, r = s.partition("==")
            hit = [m for m in MATRIX if m[0] == t.lower() and (not r or m[1] == r)]
            if not hit:
                sys.exit(f"compat: {s!r} is not in the matrix {MATRIX}")
            out += [h for h in hit if h not in out]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", default=[],
                    help="trainer or trainer==release (repeatable, comma-separated)")
    ap.add_argument("--jobs", type=int, default=1, help="rows run at once (default 1)")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter the venvs are made from (default: this one)")
    ap.add_argument("--cache-dir", default=os.environ.get("GBC_COMPAT_CACHE",
                                                          "~/.cache/gbc_compat"))
    ap.add_argument("--rebuild", action="store_true", help="rebuild the rows' venvs")
    ap.add_argument("--install-only", action="store_true", help="build the venvs, run no test")
    ap.add_argument("--test-timeout", type=int, default=3600, help="seconds per row's pytest")
    ap.add_argument("--install-timeout", type=int, default=1800)
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments (one string)")
    ap.add_argument("--print-install", metavar="TRAINER==RELEASE",
                    help="print the CPU install commands of one row and exit")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/compatibility.md")
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 unless every row passed or was refused by name (CI)")
    ap.add_argument("--doc-only", action="store_true",
                    help="rewrite docs/compatibility.md from its stored results, run nothing")
    args = ap.parse_args(argv)
    args.pytest_args = shlex.split(args.pytest_args)

    if args.print_install:
        t, _, r = args.print_install.partition("==")
        print("\n".join(install_lines(t, r)))
        return 0

    if args.doc_only:
        write_doc(previous_rows(), argv)
        log(f"wrote {os.path.relpath(DOC, ROOT)} from its stored results")
        return 0

    ctx = Ctx(args)
    rows_sel = select(args.only)
    log(f"rows: {', '.join(f'{t}=={r}' for t, r in rows_sel)}; cache {ctx.cache}; "
        f"Python {ctx.pyver}")
    t0 = time.time()
    ensure_base(ctx)
    ensure_wheel(ctx)
    rows = previous_rows()
    done = {}
    with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        futs = {ex.submit(do_row, ctx, t, r): (t, r) for t, r in rows_sel}
        for fut in cf.as_completed(futs):
            key = futs[fut]
            try:
                done[key] = fut.result()
            except Exception as exc:  # a row's crash is that row's result
                done[key] = {"trainer": key[0], "release": key[1], "status":
                             f"compat/run.py crashed: {exc!r}"[:300],
                             "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M")}
            rows[key] = done[key]
            if not args.no_doc:
                write_doc(rows, argv)       # after each row: an interrupted run keeps its rows
    log(f"done in {fmt_s(time.time() - t0)}: " + "; ".join(
        f"{t}=={r}: {done[(t, r)]['status']}" for t, r in rows_sel))
    if not args.no_doc:
        log(f"wrote {os.path.relpath(DOC, ROOT)}")
    ok = ("pass", "refused by name") if args.strict else None
    bad = [k for k, r in done.items()
           if (not r["status"].startswith(ok) if ok else
               r["status"].startswith(("fail", "install failed", "timed out", "compat/run")))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
