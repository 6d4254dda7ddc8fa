#!/usr/bin/env bash
# The checks on a machine with several GPUs (one process per GPU), from the repository root:
#   bash scripts/gpu_multi.sh            (RANKS=N to use fewer GPUs than the machine has)
# Steps, each under its own time limit (seconds, overridable), in priority order:
#   matrix     scripts/gpu_multi.py: the 64-case matrix at hidden 7168 / top-8 / 256 experts /
#              4096 tokens, both backends, NCCL, bitwise against the reference
#   bench      python -m epcomm bench --configs dsv3,decode: dispatch and combine (bf16, FP8;
#              compact, expand; sync, sync-free) against NCCL all_to_all_single,
#              all_to_all_vdev_2d and a peer-to-peer copy, same run
#   lifetime   tests/test_recv_lifetime.py at 4096 x 7168, both policies, with its negative control
#   tests      the CUDA pytest targets (one GPU per rank where the tests spawn ranks)
# A summary table is printed last; logs and JSON go to $OUT (or /tmp).
set -uo pipefail
export PYTHONPATH=src
out=${OUT:-/tmp}
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
ranks=${RANKS:-$gpus}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), '$gpus GPUs, $ranks ranks')"
source "$(dirname "$0")/steps.sh"
[[ " ${SKIP:-} " == *" matrix "* ]] || step matrix "${MATRIX_S:-900}" \
  python3 scripts/gpu_multi.py --ranks "$ranks"
[[ " ${SKIP:-} " == *" bench "* ]] || step bench "${BENCH_S:-900}" \
  python3 -m epcomm bench --ranks "$ranks" --configs dsv3,decode --json "$out/bench.json" --no-progress
[[ " ${SKIP:-} " == *" lifetime "* ]] || step lifetime "${LIFETIME_S:-600}" bash -c \
  "python3 tests/test_recv_lifetime.py --num-processes $ranks --num-tokens 4096 --hidden 7168 --device cuda && \
   python3 tests/test_recv_lifetime.py --num-processes $ranks --num-tokens 4096 --hidden 7168 --device cuda --negative-control"
[[ " ${SKIP:-} " == *" tests "* ]] || step tests "${TESTS_S:-900}" \
  python3 -m pytest -q -x tests/test_kernels.py tests/test_cuda_sync_free.py tests/test_dispatch_combine.py -k "cuda or kernel"
print_summary
