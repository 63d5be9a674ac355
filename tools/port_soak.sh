#!/usr/bin/env bash
# Repeats a set of distributed tests on 2 pytest workers N times (default 20) and counts the runs that failed and the
# lines that say a rendezvous port was taken (EADDRINUSE, "address already in use"). Two workers start jobs at the same
# moment, so their ports would collide here if the app did not hold them (app/launch/rendezvous.py HeldPort).
# Usage: bash tools/port_soak.sh [N] [TEST ...] (default: the tests that form process groups through Lightning's
# launcher, the CLI or torchrun: about 2 minutes a run on 2 CPU cores). Logs: $SOAK_DIR.
set -u
cd "$(dirname "$0")/.."
n=${1:-20}
shift || true
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(tests/distributed/test_jobs_side_by_side.py tests/distributed/test_two_ranks_fit.py
  tests/distributed/test_strategies_cli.py tests/distributed/test_tracking_ddp.py tests/distributed/test_exact_eval.py
  tests/distributed/test_launch_torchrun.py::test_torchrun_two_process_fit)
dir=${SOAK_DIR:-$(mktemp -d /tmp/port-soak.XXXX)}
python=${PYTHON:-$PWD/.venv/bin/python}
failed=0 taken=0
for i in $(seq 1 "$n"); do
  began=$(date +%s)
  "$python" -m pytest -n 2 -q -p no:cacheprovider "${tests[@]}" >"$dir/run_$i.log" 2>&1
  status=$?
  lines=$(grep -ciE "EADDRINUSE|address already in use" "$dir/run_$i.log")
  taken=$((taken + lines))
  [ $status -ne 0 ] && failed=$((failed + 1))
  echo "run $i: pytest status $status, $(tail -1 "$dir/run_$i.log" | sed 's/=//g'), port-taken lines $lines, $(( $(date +%s) - began )) s"
done
echo "failed runs: $failed of $n; port-taken lines: $taken (logs: $dir)"
[ "$failed" -eq 0 ] && [ "$taken" -eq 0 ]
