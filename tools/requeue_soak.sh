#!/usr/bin/env bash
# Submits N (default 20) one-task jobs to the throwaway SLURM cluster (tools/slurm_cluster.sh) whose task does what a
# faulted step does under `--launch.max_restarts 1`: app.resilience.requeue's after_fault (scontrol requeue of its own job),
# then waits to be ended. Counts the jobs whose first attempt's log lacks the "SLURM: requeue 1 (" line: scontrol's
# requeue ends the step (SIGTERM) at once, so a line said after it returned can be lost.
# Usage: eval "$(bash tools/slurm_cluster.sh env)"; bash tools/requeue_soak.sh [N]   (about 12 s a job). Logs: $SOAK_DIR.
set -u
cd "$(dirname "$0")/.."
n=${1:-20}
dir=${SOAK_DIR:-$(mktemp -d /tmp/requeue-soak.XXXX)}
mkdir -p "$dir"
python=${PYTHON:-$PWD/.venv/bin/python}
task="import os, time; from pathlib import Path; from app.resilience.requeue import Requeue; from core.env import detect
r = Requeue(); r.arm(1, Path('$dir/run_' + os.environ['SLURM_JOB_ID']), detect()); r.after_fault()
time.sleep(60)"
bad=0
for i in $(seq 1 "$n"); do
  job=$(sbatch --parsable --requeue --open-mode=append --ntasks=1 --time=2:00 --chdir="$PWD" \
    --output="$dir/job-%j.out" --wrap "srun $python -c \"$task\"" | cut -d';' -f1)
  # requeued: its first attempt is over (SLURM holds the second back a while: cancelled, it is not waited for)
  until scontrol show job "$job" -o 2>/dev/null | grep -qE "Restarts=[1-9]|JobState=(FAILED|COMPLETED|CANCELLED)"; do
    sleep 0.2
  done
  sleep 8  # srun's own lines after the step's end (it waits up to 7 s for the step's tasks)
  scancel "$job"
  if grep -q "^SLURM: requeue 1 (" "$dir/job-$job.out"; then echo "job $job: said"; else
    bad=$((bad + 1)); echo "job $job: the requeue line is MISSING (log: $dir/job-$job.out)"
  fi
done
echo "$bad of $n jobs lost the requeue line"
