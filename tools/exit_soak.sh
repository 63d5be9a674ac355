#!/usr/bin/env bash
# Repeats a completed 2-process fit N times (default 50) and counts the runs in which any rank did not end cleanly:
# a non-zero exit, or libstdc++'s "terminate called" (an abort of rank 1, Lightning's child process, shows only there).
# With `lost-rank`: rank 1 is SIGKILLed at step 3 of an MNIST fit instead, and a clean end is rank 0's "lost rank"
# line and exit status 1 (not SIGABRT, not "terminate called").
# Usage: bash tools/exit_soak.sh [N] [lost-rank]   (10-15 s per run on 2 CPU cores). Logs: $SOAK_DIR (default a temp
# folder).
set -u
cd "$(dirname "$0")/.."
n=${1:-50}
mode=${2:-completed}
dir=${SOAK_DIR:-$(mktemp -d /tmp/exit-soak.XXXX)}
mkdir -p "$dir"
python=${PYTHON:-.venv/bin/python}
[ "$mode" = lost-rank ] || $python -c "from pathlib import Path; from tools.photos import build_photo_imagenet as b; b(Path('$dir/imagenet'), max_side=96)"
bad=0
for i in $(seq 1 "$n"); do
  rm -rf "$dir/run"
  if [ "$mode" = lost-rank ]; then
    $python cli.py fit --data.data_dir "${MNIST_DATA_DIR:-data}" --data.batch_size 16 --trainer.accelerator cpu \
      --trainer.devices 2 --trainer.strategy ddp --trainer.max_epochs 1 --trainer.limit_train_batches 6 \
      --trainer.limit_val_batches 1 --trainer.enable_progress_bar false --trainer.default_root_dir "$dir/run" \
      --trainer.callbacks+=tools.resume_probe.SignalAt --trainer.callbacks.step 3 --trainer.callbacks.rank 1 \
      --trainer.callbacks.sigkill true >"$dir/run_$i.log" 2>&1
    rc=$?
    expected=1
    grep -q "^error: lost rank 1 of 2" "$dir/run_$i.log" || rc="$rc (no lost-rank line)"
  else
    $python cli.py fit --config configs/imagenet.yaml --data.data_dir "$dir/imagenet" --data.image_size 32 \
      --data.global_batch_size 4 --data.num_workers 0 --model.arch resnet18 --trainer.accelerator cpu \
      --trainer.devices 2 --trainer.strategy ddp --trainer.max_epochs 1 --trainer.num_sanity_val_steps 0 \
      --trainer.enable_progress_bar false --trainer.logger lightning.pytorch.loggers.CSVLogger --trainer.logger.save_dir "$dir/run" \
      --trainer.default_root_dir "$dir/run" >"$dir/run_$i.log" 2>&1
    rc=$?
    expected=0
  fi
  if [ "$rc" != "$expected" ] || grep -q "terminate called" "$dir/run_$i.log"; then
    bad=$((bad + 1)); echo "run $i: exit $rc, NOT clean (log: $dir/run_$i.log)"
  else
    echo "run $i: clean"
  fi
done
echo "not clean: $bad of $n runs"
[ "$bad" -eq 0 ]
