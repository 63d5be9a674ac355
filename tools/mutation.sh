#!/usr/bin/env bash
# `make mutation`: mutmut (pinned in constraints.txt, the dev extra) over the functions whose numbers users trust, each
# mutant run against the fast unit tests that cover it (setup.cfg's [mutmut] section lists them). CPU-heavy: not part
# of `make test`. Prints mutmut's results (killed, survived, no tests, timeout); `mutmut show NAME` shows a mutant.
# MUTATION_SCOPE="checkpoint amp agree classifier allreduce" picks the groups (default: checkpoint). The figures of
# the last run, with the reasons the survivors survive: bench/results/mutation.md. The 2-process tests among them run
# rank 0 in pytest's own process (tests/distributed/two_ranks.py): mutmut maps and times tests in its process only.
set -u
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
declare -A FUNCTIONS=(
    [checkpoint]="app.checkpoint.names.x_resumable_checkpoints__mutmut_* app.checkpoint.names.x_hpc_checkpoints__mutmut_* app.checkpoint.resume.xǁResumeSearchǁdecide__mutmut_* app.checkpoint.resume.xǁResumeSearchǁ_newest_readable__mutmut_*"
    [amp]="app.callbacks.amp.xǁAMPHealthǁon_train_batch_end__mutmut_* app.callbacks.amp.xǁAMPHealthǁ_check__mutmut_*"
    [classifier]="modules.classifier.xǁImageClassifierǁ_log_train_step__mutmut_* modules.classifier.xǁImageClassifierǁon_train_epoch_end__mutmut_*"
    [allreduce]="app.strategies.allreduce.xǁAllReduceStrategyǁconfigure_ddp__mutmut_* app.strategies.allreduce.xǁAllReduceStrategyǁ_make_buckets__mutmut_* app.strategies.allreduce.xǁAllReduceStrategyǁ_on_grad_ready__mutmut_* app.strategies.allreduce.xǁAllReduceStrategyǁ_launch__mutmut_* app.strategies.allreduce.xǁAllReduceStrategyǁaverage_gradients__mutmut_* app.strategies.allreduce.xǁAllReduceStrategyǁsync_buffers__mutmut_*"
    [agree]="app.resilience.agree.xǁAgreementǁstart__mutmut_* app.resilience.agree.xǁAgreementǁany_rank__mutmut_* app.resilience.agree.xǁAgreementǁwait__mutmut_*"
)
scopes=${MUTATION_SCOPE:-checkpoint}
names=()
for scope in $scopes; do names+=(${FUNCTIONS[$scope]}); done
# the copy under mutants/ has no data/: the tests read the real MNIST from here
export MNIST_DATA_DIR=${MNIST_DATA_DIR:-$PWD/data}
# one intra-op thread: mutmut forks each mutant's run from a process that already ran torch, and a fork of a process
# with an OpenMP thread pool hangs in its first parallel op (every mutant then "timed out")
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
"$BIN/mutmut" run "${names[@]}"
"$BIN/mutmut" results --all true 2>/dev/null || "$BIN/mutmut" results
