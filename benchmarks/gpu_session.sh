#!/usr/bin/env bash
# Everything to run when a GPU is at hand, in order of value, each step under its own time limit
# (the whole fits a 10-minute device call): the GPU tests, the long-context head benchmark
# (bench_long_context.py, with SkyRL's fused head beside gbc's where GBC_SKYRL_FUSED names a
# copy of SkyRL 0.3.0's fused_linear_logprob_triton.py), the side-by-side benchmark, then the
# profile of one step (Qwen2.5-7B and Llama-3-8B heads). Logs and CSVs go to ${OUT:-runs/gpu}.
# Usage: bash benchmarks/gpu_session.sh [N list for bench_gpu.py]
set -u
out=${OUT:-runs/gpu}
mkdir -p "$out"
nlist=${1:-8192}
export PYTHONUNBUFFERED=1
# the device machine gets a copy of the working tree, not an installed package: import gbc_kernels
# and gbc_reference from the tree (the GPU paths are Triton and torch; the C++ CPU extension is
# optional and not built here)
if ! python -c "import gbc_kernels, gbc_reference" 2>/dev/null; then
    export PYTHONPATH="$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
python -c "import gbc_kernels, gbc_reference" || { echo "gpu_session.sh: cannot import gbc_kernels / gbc_reference from $PWD"; exit 1; }
python -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
timeout 90 python -m pytest -q -s -x tests/test_gpu.py 2>&1 | tail -15 | tee "$out/gpu_tests.log"
timeout 45 python benchmarks/bench_precision.py 2>&1 | tee "$out/precision.log"
timeout 150 python benchmarks/bench_long_context.py --out "$out/long_context.csv" 2>&1 \
    | grep -v USDT | tee "$out/long_context.log"
timeout 75 python benchmarks/bench_long_context.py --logits-dtype float32 --S 32768,131072 \
    --providers gbc_f32,eager_f32 --out "$out/long_context_f32.csv" 2>&1 \
    | grep -v USDT | tee "$out/long_context_f32.log"
timeout 150 python benchmarks/bench_gpu.py --N "$nlist" --out "$out/gpu.csv" 2>&1 | tail -30
# the sampler's support (issue 60): the replayed step against the plain one and SkyRL's routes
timeout 150 python benchmarks/bench_support.py --device cuda --dtype bfloat16 --N 8192 \
    --H 3584 --V 151936 --ks 20,512 --rounds 1 2>&1 | tee "$out/support.log"
# the support route (issue 66): top-p-sized sets and top_k 64 over W[U] only, against the
# plain step and the route off; a whole recompute step with the set built once
timeout 120 python benchmarks/bench_support.py --device cuda --dtype bfloat16 --N 8192 \
    --H 3584 --V 151936 --ks 64 --sets topp --rounds 1 \
    --providers plain,support,support_whole 2>&1 | tee "$out/support_route.log"
timeout 90 python benchmarks/bench_support.py --device cuda --dtype bfloat16 --N 8192 \
    --H 3584 --V 151936 --ks 20 --rounds 1 --logit-std 3.0 \
    --providers step_plain,step_rebuilt,step_once 2>&1 | tee "$out/support_step.log"
# the kept set rebuilt from the sampling settings (issue 61): top_k 20, top_p 0.95 without and
# with a top-k bound, and the kept_mass old pass, against the plain step / pass
timeout 120 python benchmarks/bench_support.py --device cuda --dtype bfloat16 --N 8192 \
    --H 3584 --V 151936 --ks 20 --rounds 1 --logit-std 3.0 \
    --providers plain,trunc_k20,trunc_p095,trunc_k20_p095,plain_old,kept_mass_old 2>&1 \
    | tee "$out/truncation.log"
timeout 60 python benchmarks/profile_gpu.py --shape qwen2.5-7b --N 8192 --chunk-mb default,256 \
    2>&1 | tee "$out/profile_qwen.log"
# gbc inside Unsloth's trainer on a FastLanguageModel LoRA model (issue 67), against Unsloth's
# own loss and float64: needs an interpreter with Unsloth and a CUDA torch (GBC_UNSLOTH_PYTHON);
# without one it says why and exits 0
timeout 240 python benchmarks/gpu_unsloth.py --python "${GBC_UNSLOTH_PYTHON:-python}" 2>&1 \
    | tee "$out/unsloth.log"
