# Sourced by the GPU check scripts (gpu_check.sh, gpu_multi.sh): `step NAME LIMIT_S COMMAND...`
# runs one step under a time limit with its output in $out/NAME.log, prints the log's tail
# (TAIL_LINES, default 30) and remembers a summary line; `print_summary` prints them last.
summary=()
step() {  # name, limit_s, command...
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-11s rc=%-3s %4ss' "$name" "$rc" "$(( $(date +%s) - start ))")")
  echo "---- $name (rc=$rc) ----"
  tail -n "${TAIL_LINES:-30}" "$out/$name.log"
}
print_summary() {
  echo "==== summary ===="
  printf '%s\n' "${summary[@]}"
}
