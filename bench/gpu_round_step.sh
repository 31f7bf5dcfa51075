# Sourced by the bench/gpu_round_*.sh scripts: `step NAME CAP COMMAND...` runs COMMAND with its output in
# $OUT/NAME.log, for at most CAP seconds or what is left of BUDGET seconds since START, and skips it when less than
# MIN_STEP_S (default 20) is left; each step's exit code and time go to $SUMMARY, and a failure sets FAILED=1.
step() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt "${MIN_STEP_S:-20}" ]; then
    echo "$name: skipped, budget spent" | tee -a "$SUMMARY"
    return
  fi
  echo "== $name (at most ${limit}s)"
  local t0
  t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  [ "$rc" -ne 0 ] && FAILED=1
  echo "$name: exit $rc after $(($(date +%s) - t0))s$([ "$rc" -eq 124 ] && echo ' (cut at its limit)')" | tee -a "$SUMMARY"
}
