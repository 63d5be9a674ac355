"""The two most common failures of multi-GPU training, each one ``error:`` line with its section of
docs/troubleshooting.md: CUDA out of memory (what to lower while the global batch stays; a mistake of the batch, so
never requeued) and an NCCL error (a fault: recorded, and requeued while the budget lasts). On a GPU the
out-of-memory error is a real one; elsewhere, and for NCCL on any machine, torch's own exception as torch words it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from app.command import user_errors_explained
from app.resilience.requeue import Requeue, faults_of
from core.env import detect
from tests.troubleshooting import assert_documented

NCCL_SAYS = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, remote process exited or there "
    "was a network error, NCCL version 2.27.5\nncclRemoteError: A call failed possibly due to a network error or a "
    "remote process exiting prematurely.\nLast error:\nsocketProgress: Connection closed by remote peer"
)


def cuda_out_of_memory() -> torch.OutOfMemoryError:
    if torch.cuda.is_available():
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # a petabyte
        except torch.OutOfMemoryError as err:
            return err
    return torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is "
        "free. Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the allocated memory 75.40 "
        "GiB is allocated by PyTorch, and 1.21 GiB is reserved by PyTorch but unallocated."
    )


def slurm_job(tmp_path, restarts: int = 0) -> Requeue:
    """The requeue policy of task 0 of SLURM job 77 under the batch script of tools.slurm, --launch.max_restarts 2."""
    env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": str(restarts), "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}
    requeue = Requeue()
    requeue.arm(2, tmp_path, detect({**env, "SLURM_NNODES": "1", "DPTRAIN_REQUEUE_BY": "script"}))
    return requeue


def test_cuda_out_of_memory_is_one_line_naming_what_to_lower_and_is_no_fault(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop, user_errors_explained(slurm_job(tmp_path)):
        raise cuda_out_of_memory()
    line = assert_documented(capsys.readouterr().err, "cuda-out-of-memory")
    assert "CUDA out of memory. Tried to allocate " in line and "--trainer.accumulate_grad_batches 2" in line, line
    assert "--trainer.precision bf16-mixed" in line and "--model.channels_last true" in line, line
    assert stop.value.code == 1 and faults_of(tmp_path, "77") == []  # a requeue would meet it again


def test_an_nccl_error_is_one_line_with_where_to_look_and_a_fault(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop, user_errors_explained(slurm_job(tmp_path)):
        raise dist.DistBackendError(NCCL_SAYS)
    line = assert_documented(capsys.readouterr().err, "nccl-error")
    assert "NCCL failed (NCCL error in: " in line and "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET" in line, line
    assert stop.value.code == 1
    assert [f["kind"] for f in faults_of(tmp_path, "77")] == ["nccl-error"]  # counted by the batch script's budget
