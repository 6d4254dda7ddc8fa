#!/usr/bin/env bash
# Receive-tensor lifetime on the GPU (tests/test_recv_lifetime.py): 2, 4 and 8 processes sharing
# the GPU (gloo group), each under EP_AVOID_RECORD_STREAM=0 and =1 (one process group per policy),
# normal and negative control, plus the scheduling control; the tables are printed last.
# Run from the repository root: bash scripts/gpu_lifetime.sh   (about 3-5 minutes on one H200)
# Logs (one line per reader attempt for the controls) go to $OUT/recv-lifetime or /tmp/recv-lifetime.
set -uo pipefail
export PYTHONPATH=src
out=${OUT:-/tmp}/recv-lifetime
mkdir -p "$out"
seed=${EPCOMM_TEST_SEED:-$(( $(date +%s) % 1000000 ))}
budget_s=${LIFETIME_BUDGET_S:-330}   # start no new run after this many seconds
per_run_s=${LIFETIME_RUN_TIMEOUT_S:-150}
common=(--num-tokens 64 --hidden 512 --device cuda --seed "$seed")
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(), 'seed $seed')"

start_all=$(date +%s)
summary=()
logs=()
failed=0
run() {  # name, extra args...
  local name=$1; shift
  local log="$out/$name.log"
  if (( $(date +%s) - start_all > budget_s )); then
    summary+=("$(printf '%-14s SKIPPED (time budget %ss spent)' "$name" "$budget_s")")
    failed=1
    return
  fi
  local start=$(date +%s)
  timeout -k 10 "$per_run_s" python3 tests/test_recv_lifetime.py "${common[@]}" "$@" > "$log" 2>&1
  local rc=$?
  (( rc != 0 )) && failed=1
  summary+=("$(printf '%-14s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - start ))" "$*")")
  logs+=("$log")
  echo "---- $name (rc=$rc) ----"
  grep -E '^(FAILURE|SKIP)|Error' "$log" | head -n 20
}

run n2-normal   --num-processes 2
run n2-negative --num-processes 2 --negative-control --verbose
run n4-normal   --num-processes 4
run n4-negative --num-processes 4 --negative-control --verbose
run n4-schedule --num-processes 4 --schedule-control --verbose
run n8-normal   --num-processes 8
run n8-negative --num-processes 8 --negative-control --verbose

echo
echo "==== runs (total $(( $(date +%s) - start_all ))s) ===="
printf '%s\n' "${summary[@]}"
echo
echo "==== recv-lifetime tables ===="
for log in "${logs[@]}"; do
  if grep -q '^=== recv-lifetime' "$log"; then
    sed -n '/^=== recv-lifetime/,$p' "$log"
  else
    echo "=== $(basename "$log" .log): no table; last lines of the log:"
    tail -n 15 "$log"
  fi
  echo
done
exit $failed
