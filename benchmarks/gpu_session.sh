#!/usr/bin/env bash
# Everything to run when a GPU is at hand, in order of value: the GPU tests, the profile of one
# step (Qwen2.5-7B and Llama-3-8B heads), then the side-by-side benchmark. Logs and CSVs go to
# ${OUT:-runs/gpu}. Usage: bash benchmarks/gpu_session.sh [N list for bench_gpu.py]
set -u
out=${OUT:-runs/gpu}
mkdir -p "$out"
nlist=${1:-4096,8192}
# the device machine gets a copy of the working tree, not an installed package: import gbc_kernels
# and gbc_reference from the tree (the GPU paths are Triton and torch; the C++ CPU extension is
# optional and not built here)
if ! python -c "import gbc_kernels, gbc_reference" 2>/dev/null; then
    export PYTHONPATH="$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
python -c "import gbc_kernels, gbc_reference" || { echo "gpu_session.sh: cannot import gbc_kernels / gbc_reference from $PWD"; exit 1; }
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
timeout 150 python -m pytest -q -s tests/test_gpu.py 2>&1 | tail -15 | tee "$out/gpu_tests.log"
timeout 120 python benchmarks/profile_gpu.py --shape qwen2.5-7b --N 8192 --chunk-mb default,2048 \
    2>&1 | tee "$out/profile_qwen.log"
timeout 90 python benchmarks/profile_gpu.py --shape llama3-8b --N 8192 2>&1 \
    | tee "$out/profile_llama.log"
timeout 300 python benchmarks/bench_gpu.py --N "$nlist" --out "$out/gpu.csv" 2>&1 | tail -30
