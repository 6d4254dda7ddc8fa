#!/usr/bin/env bash
# One GPU check on the one-GPU machine, from the repository root: bash scripts/gpu_check.sh
# Steps, each under its own time limit (seconds, overridable), in priority order:
#   symmetric  scripts/gpu_symmetric.py: symmetric vs collective bitwise at hidden 7168 with 2 and
#              4 processes on the GPU (4096 tokens), sync-debug mode, graph replay, then the EP=1
#              benchmark
#   symmetric8 the same check with 8 processes at 4096 tokens (66 s on the H200; the check keeps
#              one call's capacity-sized outputs on the GPU at a time)
#   symmetric128  the check with 2 and 4 processes at 128 tokens: the dispatch's one-block paths
#   lifetime   scripts/gpu_lifetime.sh: receive-tensor lifetime, 2/4/8 processes, both policies
#   cuda-tests the kernel examples on the GPU, then the CUDA pytest targets (sync-free, graph
#              capture, matrix on 2 ranks, stream options, inputs dropped early, strided and
#              unaligned inputs)
#   adapters   the CUDA cases of the DeepEP drop-in tests (ElasticBuffer, V1 Buffer, adapters)
#   low-latency  V1's low-latency mode: its CUDA tests, then scripts/gpu_low_latency.py (2, 4 and
#              8 processes against the reference, then the EP=1 timing table)
#   compile    tests/test_compile.py and tests/test_compile_low_latency.py on CUDA (Inductor,
#              CUDA graphs of the compiled layer, the compiled low-latency pair)
#   faults     scripts/gpu_faults.py: mismatched calls, NaN, timeouts, out of step on the GPU
#   soak       scripts/soak.py: 400 mixed round trips per backend on 4 processes sharing the
#              GPU, each bitwise against the reference, CUDA memory sampled (flat)
#   collective scripts/gpu_collective.py: the collective backend over NCCL at EP=1 (bitwise,
#              sync-debug, graph replay, time against its floor)
#   bench      python -m epcomm bench (4 ranks sharing the GPU, then every path at EP=1)
# A summary table is printed last; logs and JSON go to $OUT (or /tmp).
set -uo pipefail
export PYTHONPATH=src:scripts
out=${OUT:-/tmp}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
source "$(dirname "$0")/steps.sh"
[[ " ${SKIP:-} " == *" symmetric "* ]] || step symmetric "${SYMMETRIC_S:-170}" python3 scripts/gpu_symmetric.py --ranks 2 4
[[ " ${SKIP:-} " == *" symmetric8 "* ]] || step symmetric8 "${SYMMETRIC8_S:-170}" python3 scripts/gpu_symmetric.py --ranks 8 --no-bench
[[ " ${SKIP:-} " == *" symmetric128 "* ]] || step symmetric128 "${SYMMETRIC128_S:-120}" python3 scripts/gpu_symmetric.py --ranks 2 4 --tokens 128 --no-bench
[[ " ${SKIP:-} " == *" lifetime "* ]] || LIFETIME_BUDGET_S=${LIFETIME_S:-280} LIFETIME_RUN_TIMEOUT_S=60 \
  step lifetime "$(( ${LIFETIME_S:-280} + 70 ))" bash scripts/gpu_lifetime.sh
[[ " ${SKIP:-} " == *" cuda-tests "* ]] || step cuda-tests "${CUDA_TESTS_S:-330}" bash -c \
  'python3 -m pytest -q -x tests/test_kernels.py && python3 -m pytest -q -x \
   tests/test_cuda_sync_free.py tests/test_dispatch_combine.py \
   -k "cuda and (matrix and 2- or stream or sync or graph or invalid or dropped or aligned)"'
[[ " ${SKIP:-} " == *" adapters "* ]] || step adapters "${ADAPTERS_S:-300}" python3 -m pytest -q -x \
  -k cuda tests/test_elastic.py tests/test_adapters_v1.py tests/test_adapters_v2.py \
  tests/test_legacy.py tests/test_deep_ep.py
[[ " ${SKIP:-} " == *" low-latency "* ]] || step low-latency "${LOW_LATENCY_S:-360}" bash -c \
  'python3 -m pytest -q -x -k cuda tests/test_low_latency.py && python3 scripts/gpu_low_latency.py'
[[ " ${SKIP:-} " == *" compile "* ]] || step compile "${COMPILE_S:-200}" \
  python3 -m pytest -q -x -rs tests/test_compile.py tests/test_compile_low_latency.py
[[ " ${SKIP:-} " == *" faults "* ]] || step faults "${FAULTS_S:-120}" python3 scripts/gpu_faults.py --ranks 2 4
[[ " ${SKIP:-} " == *" soak "* ]] || step soak "${SOAK_S:-200}" python3 scripts/soak.py \
  --device cuda --ranks 4 --round-trips 400 --report-every 100
[[ " ${SKIP:-} " == *" collective "* ]] || step collective "${COLLECTIVE_S:-150}" \
  python3 scripts/gpu_collective.py --tokens 128 4096
[[ " ${SKIP:-} " == *" bench "* ]] || step bench "${BENCH_S:-150}" python3 -m epcomm bench --json "$out/bench.json" --no-progress
print_summary
