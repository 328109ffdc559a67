# The two set-up commands of the README: `make demo` (main job) and `make test` (the tests).
# `make demo` installs only what the demo imports (the library and its `demo` extra:
# transformers, tqdm, matplotlib); `make test` installs the full dev/test environment. torch is
# installed alone and first, pinned to the CPU wheel on this machine's disk, so that nothing
# afterwards can pull a CUDA build.
PYTHON ?= python
# requirements-lock.txt: every package of the test environment (the dependencies of
# requirements-dev.txt's lines too) at the version the suite passed on. Each pip step of `make
# install` runs under `-c $(LOCK)`, so a fresh clone installs that set whatever the index serves
# that day (`make install LOCK=` installs without it). To adopt a release on purpose:
#   1. change its pin in requirements-dev.txt (or requirements-verl.txt, DEEPSPEED below);
#   2. make install LOCK=          # in a fresh venv: the new pins, nothing held by the lock
#   3. make test LOCK=             # the whole suite must pass there
#   4. make lock                   # compat/lock.py rewrites requirements-lock.txt from that venv
#   5. commit requirements-*.txt together.
# `make compat ONLY=transformers` runs a test subset on the newest transformers, to see a
# release coming before it is adopted (docs/compatibility.md).
LOCK ?= requirements-lock.txt
DEEPSPEED = deepspeed==0.19.8
PIP_LOCK = $(if $(LOCK),-c $(LOCK))

.PHONY: install install-demo demo test aot bench lock

install:
	$(PYTHON) -m pip install -q $(PIP_LOCK) torch==2.13.0
	$(PYTHON) -m pip install -q $(PIP_LOCK) -r requirements-dev.txt
	$(PYTHON) -m pip install -q $(PIP_LOCK) --no-deps -r requirements-verl.txt
	DS_BUILD_OPS=0 $(PYTHON) -m pip install -q $(PIP_LOCK) --no-build-isolation --no-deps $(DEEPSPEED)
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .

# requirements-lock.txt from the environment of $(PYTHON) (the one `make test` just passed in)
lock:
	$(PYTHON) compat/lock.py --no-deps $(DEEPSPEED)

# --no-compile: pip's byte-compiling of every installed module (torch's and transformers'
# thousands) was the largest part of the install; Python compiles what the demo imports on
# first import instead. The same packages are installed. The lock holds the demo's packages
# to the test environment's versions too.
install-demo:
	@echo "== make demo: installing torch (CPU), the library and its demo extra"
	$(PYTHON) -m pip install --progress-bar on --no-compile $(PIP_LOCK) torch==2.13.0 "setuptools>=64" wheel
	$(PYTHON) -m pip install --progress-bar on --no-compile --no-build-isolation $(PIP_LOCK) -e ".[demo]"

demo: install-demo
	@echo "== make demo: GRPO from the shipped scratchpad checkpoint (progress bar below; outputs in runs/demo)"
	$(PYTHON) examples/grpo_trainer.py --out runs/demo

test: install
	$(PYTHON) -m pytest tests --durations=30

bench: install
	$(PYTHON) benchmarks/bench_cpu.py --quick

# `make compat`: every (trainer, release) of the matrix (issue 51) in its own venv: torch 2.13.0
# CPU from a shared base venv, that release with its own pins (compat/sets/), gbc_kernels built
# from the checkout; runs that trainer's tests and writes docs/compatibility.md from the run.
# Venvs are cached under ~/.cache/gbc_compat by their requirement set.
# `make compat ONLY=trl==1.14.2` (comma-separated, or a trainer name) runs some rows only.
.PHONY: compat
compat:
	$(PYTHON) compat/run.py --jobs $(or $(JOBS),1) $(if $(ONLY),--only $(ONLY))
