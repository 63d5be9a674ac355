"""Every rank's last line reaches the job's shared stderr whole: two ranks that stop at once never print
``...#disk-fullerror: ...`` (seen in CI, where ``print`` and Python's ``SystemExit`` report wrote each line's text
and its newline separately; every error line now goes through ``core.errors.report``, one write)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.conftest import ROOT

MESSAGE = "saving the checkpoint {} failed: the disk is full."
LINE = "error: " + MESSAGE + " Help: docs/troubleshooting.md#disk-full"
# as long as the real disk-full line with pytest's paths (~900 characters), well under PIPE_BUF
WRITER = """
import sys, time
from core.errors import UserError, report
error = UserError({message!r}.format(sys.argv[1] * 800), help="disk-full")
start = float(sys.argv[2])
while time.time() < start:  # both processes write at the same moment
    pass
for _ in range(2000):
    report(error)  # as the command's error channel prints a DiskFullError on every rank
raise SystemExit(1)
"""


def test_two_processes_writing_at_once_to_one_stderr_never_run_their_lines_together():
    read, write = os.pipe()
    start = time.time() + 1.5
    code = WRITER.format(message=MESSAGE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DPTRAIN_DOCS_URL", None)
    procs = [subprocess.Popen([sys.executable, "-c", code, c, str(start)], stderr=write, env=env) for c in "ab"]
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        lines = pipe.read().decode().splitlines()
    assert [p.wait(timeout=60) for p in procs] == [1, 1]
    whole = {LINE.format(c * 800) for c in "ab"}
    broken = [line[:60] + " ... " + line[-60:] for line in lines if line not in whole]
    assert not broken and len(lines) == 4000, (len(lines), broken[:3])
