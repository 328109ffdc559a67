# The two set-up commands of the README: `make demo` (main job) and `make test` (the tests).
# `make demo` installs only what the demo imports (the library and its `demo` extra:
# transformers, tqdm, matplotlib); `make test` installs the full dev/test environment. torch is
# installed alone and first, pinned to the CPU wheel on this machine's disk, so that nothing
# afterwards can pull a CUDA build.
PYTHON ?= python

.PHONY: install install-demo demo test aot bench

install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -r requirements-dev.txt
	$(PYTHON) -m pip install -q --no-deps -r requirements-verl.txt
	DS_BUILD_OPS=0 $(PYTHON) -m pip install -q --no-build-isolation --no-deps deepspeed==0.19.8
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .

# --no-compile: pip's byte-compiling of every installed module (torch's and transformers'
# thousands) was the largest part of the install; Python compiles what the demo imports on
# first import instead. The same packages are installed.
install-demo:
	@echo "== make demo: installing torch (CPU), the library and its demo extra"
	$(PYTHON) -m pip install --progress-bar on --no-compile torch==2.13.0 "setuptools>=64" wheel
	$(PYTHON) -m pip install --progress-bar on --no-compile --no-build-isolation -e ".[demo]"

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
