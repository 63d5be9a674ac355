#!/usr/bin/env bash
# Repeats the 2-process job of tests/distributed/test_shards_resume.py (three fits, one loader worker per rank:
# uninterrupted, stopped by SIGTERM mid-epoch, resumed) N times (default 30) and counts the runs that failed or
# stalled. A run still going after $STALL_S s (default 150; a clean one takes about 25 s on 2 CPU cores) is a stall:
# the stacks of every process of the job go to its folder (py-spy, else gdb, when installed), then it is killed.
# This is how a loader worker stuck inside os.fork (CPython gh-112275; datamodules/base.py worker_context) was found.
# Usage: bash tools/worker_start_soak.sh [N]. APP_DIR: the checkout to run (default this one). Logs: $SOAK_DIR.
set -u
cd "$(dirname "$0")/.."
n=${1:-30}
app=$(cd "${APP_DIR:-.}" && pwd)
dir=${SOAK_DIR:-$(mktemp -d /tmp/worker-soak.XXXX)}
python=${PYTHON:-$PWD/.venv/bin/python}
stall=${STALL_S:-150}
(cd "$app" && PYTHONPATH="$app" $python -c "
from pathlib import Path
from datamodules.shards import Options, convert
from tools.photos import build_photo_imagenet
convert(build_photo_imagenet(Path('$dir/photos')), Path('$dir/shards'), Options(shard_images=4), progress=False)")
bad=0
for i in $(seq 1 "$n"); do
  out="$dir/run"; rm -rf "$out"; mkdir -p "$out"
  began=$(date +%s)
  (cd "$app" && PYTHONPATH="$app" exec $python -m torch.distributed.run --standalone --nproc_per_node=2 \
    -m tests.distributed.test_shards_resume "$out" "$dir/shards" >"$dir/run_$i.log" 2>&1) &
  job=$!
  while kill -0 $job 2>/dev/null && [ $(( $(date +%s) - began )) -lt "$stall" ]; do sleep 1; done
  if kill -0 $job 2>/dev/null; then
    for p in $(pgrep -f "test_shards_resume $out"); do
      echo "=== $p"; { py-spy dump --pid "$p" || gdb -p "$p" -batch -ex "thread apply all bt 40"; } 2>&1
    done >"$dir/stacks_$i.txt"
    pkill -9 -f "test_shards_resume $out"; wait $job
    bad=$((bad + 1)); echo "run $i: STALLED after ${stall} s (stacks: $dir/stacks_$i.txt, log: $dir/run_$i.log)"
  elif wait $job; then
    echo "run $i: passed in $(( $(date +%s) - began )) s"
  else
    bad=$((bad + 1)); echo "run $i: FAILED (log: $dir/run_$i.log)"
  fi
  rm -rf "$out"  # each run leaves ~1 GB of checkpoints
done
echo "failed or stalled: $bad of $n runs"
[ "$bad" -eq 0 ]
