"""The hang watch on NCCL: a stuck rank's diagnosis names the flight recorder's dumps, which exist in the run folder
and which torch's analyser reads. Needs two GPUs (NCCL refuses two ranks on one device); the CPU tests
(tests/distributed/test_hangs.py, tests/unit/test_hang_watch.py) cover the watch itself and the settings it makes."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import run_if
from tests.distributed.test_faults import nothing_left, start
from tests.distributed.test_hangs import HERE, ddp, diagnosis, run_until_done


@run_if(cuda=2)
def test_a_stuck_nccl_rank_leaves_flight_recorder_dumps_that_torch_reads(mnist_dir, tmp_path):
    root = tmp_path / "run"
    job = start(root, mnist_dir, *ddp(f"--trainer.callbacks+={HERE}.SleepOnRank1"), "--trainer.accelerator", "cuda")
    code, out, _, seen = run_until_done(job)
    assert code != 0 and seen is not None, out[-4000:]
    text = "\n".join(diagnosis(out))
    folder = root / "version_0" / "hang"
    assert f"NCCL flight recorder: {folder}/nccl_trace_rank_<R>" in text, text
    dumps = sorted(folder.glob("nccl_trace_rank_*"))
    assert dumps and all(p.stat().st_size > 0 for p in dumps), (dumps, text)
    nothing_left(job.pid)
    # the command the diagnosis names: torch's own analyser of the dumps (torch.distributed.flight_recorder)
    analysed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder), "--prefix",
         "nccl_trace_rank_"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert analysed.returncode == 0, analysed.stdout[-2000:] + analysed.stderr[-2000:]
