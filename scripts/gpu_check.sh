#!/usr/bin/env bash
# One GPU check on the one-GPU machine, from the repository root: bash scripts/gpu_check.sh
# Steps, each under its own time limit (seconds, overridable), in priority order:
#   symmetric  scripts/gpu_symmetric.py: symmetric vs collective bitwise at hidden 7168 with 2 and
#              4 processes on the GPU (4096 tokens), sync-debug mode, graph replay, then the EP=1
#              benchmark
#   symmetric8 the same check with 8 processes at 4096 tokens (66 s on the H200; the check keeps
#              one call's capacity-sized outputs on the GPU at a time)
#   lifetime   scripts/gpu_lifetime.sh: receive-tensor lifetime, 2/4/8 processes, both policies
#   cuda-tests the kernel examples on the GPU, then the CUDA pytest targets (sync-free, graph
#              capture, matrix on 2 ranks, stream options, inputs dropped early, strided and
#              unaligned inputs)
#   bench      python -m epcomm bench (4 ranks sharing the GPU)
# A summary table is printed last; logs and JSON go to $OUT (or /tmp).
set -uo pipefail
export PYTHONPATH=src
out=${OUT:-/tmp}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
source "$(dirname "$0")/steps.sh"
[[ " ${SKIP:-} " == *" symmetric "* ]] || step symmetric "${SYMMETRIC_S:-170}" python3 scripts/gpu_symmetric.py --ranks 2 4
[[ " ${SKIP:-} " == *" symmetric8 "* ]] || step symmetric8 "${SYMMETRIC8_S:-170}" python3 scripts/gpu_symmetric.py --ranks 8 --no-bench
[[ " ${SKIP:-} " == *" lifetime "* ]] || LIFETIME_BUDGET_S=${LIFETIME_S:-230} LIFETIME_RUN_TIMEOUT_S=60 \
  step lifetime "$(( ${LIFETIME_S:-230} + 70 ))" bash scripts/gpu_lifetime.sh
[[ " ${SKIP:-} " == *" cuda-tests "* ]] || step cuda-tests "${CUDA_TESTS_S:-330}" bash -c \
  'python3 -m pytest -q -x tests/test_kernels.py && python3 -m pytest -q -x \
   tests/test_cuda_sync_free.py tests/test_dispatch_combine.py \
   -k "cuda and (matrix and 2- or stream or sync or graph or invalid or dropped or aligned)"'
[[ " ${SKIP:-} " == *" bench "* ]] || step bench "${BENCH_S:-150}" python3 -m epcomm bench --json "$out/bench.json" --no-progress
print_summary
