#!/usr/bin/env bash
# One GPU check: CUDA tests, then the benchmark; prints a summary table last.
# Run on the GPU machine from the repository root: bash scripts/gpu_check.sh [pytest -k expr]
set -uo pipefail
export PYTHONPATH=src
out=${OUT:-/tmp}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
summary=()
run() {  # name, command...
  local name=$1; shift
  local start=$(date +%s)
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-28s rc=%-3s %4ss' "$name" "$rc" "$(( $(date +%s) - start ))")")
  tail -n 25 "$out/$name.log"
}
run cuda-tests python3 -m pytest -q -x -k "${1:-cuda}" tests/test_dispatch_combine.py
if [ -f src/epcomm/bench.py ]; then
  run bench python3 -m epcomm bench --json "$out/bench.json"
fi
echo "==== summary ===="
printf '%s\n' "${summary[@]}"
