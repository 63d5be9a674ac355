#!/usr/bin/env bash
# Repeats a completed 2-process fit N times (default 50) and counts the runs in which any rank did not end cleanly:
# a non-zero exit, or libstdc++'s "terminate called" (an abort of rank 1, Lightning's child process, shows only there).
# Usage: bash tools/exit_soak.sh [N]   (about 15 s per run on 2 CPU cores). Logs: $SOAK_DIR (default a temp folder).
set -u
cd "$(dirname "$0")/.."
n=${1:-50}
dir=${SOAK_DIR:-$(mktemp -d /tmp/exit-soak.XXXX)}
python=${PYTHON:-.venv/bin/python}
$python -c "from pathlib import Path; from tools.photos import build_photo_imagenet as b; b(Path('$dir/imagenet'), max_side=96)"
bad=0
for i in $(seq 1 "$n"); do
  rm -rf "$dir/run"
  $python cli.py fit --config configs/imagenet.yaml --data.data_dir "$dir/imagenet" --data.image_size 32 \
    --data.global_batch_size 4 --data.num_workers 0 --model.arch resnet18 --trainer.accelerator cpu \
    --trainer.devices 2 --trainer.strategy ddp --trainer.max_epochs 1 --trainer.num_sanity_val_steps 0 \
    --trainer.enable_progress_bar false --trainer.logger lightning.pytorch.loggers.CSVLogger --trainer.logger.save_dir "$dir/run" \
    --trainer.default_root_dir "$dir/run" >"$dir/run_$i.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ] || grep -q "terminate called" "$dir/run_$i.log"; then
    bad=$((bad + 1)); echo "run $i: exit $rc, NOT clean (log: $dir/run_$i.log)"
  else
    echo "run $i: clean"
  fi
done
echo "not clean: $bad of $n runs"
[ "$bad" -eq 0 ]
