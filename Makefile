# The two set-up commands of the README: `make demo` (main job) and `make test` (the tests).
# Both install the dev environment first; torch is installed alone and first, pinned to the CPU
# wheel on this machine's disk, so that nothing afterwards can pull a CUDA build.
PYTHON ?= python

.PHONY: install demo test aot bench

install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -r requirements-dev.txt
	$(PYTHON) -m pip install -q --no-deps -r requirements-verl.txt
	DS_BUILD_OPS=0 $(PYTHON) -m pip install -q --no-build-isolation --no-deps deepspeed==0.19.8
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .

demo: install
	$(PYTHON) examples/grpo_trainer.py --out runs/demo

test: install
	$(PYTHON) -m pytest tests

bench: install
	$(PYTHON) benchmarks/bench_cpu.py --quick
