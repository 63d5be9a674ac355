"""Every rank's last line reaches the job's shared stderr whole: two ranks that stop at once never print
``...#disk-fullerror: ...`` (seen in CI, where ``print`` and Python's ``SystemExit`` report wrote each line's text
and its newline separately)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.conftest import ROOT

LINE = "error: saving the checkpoint {} failed: the disk is full. Help: docs/troubleshooting.md#disk-full"
# as long as the real disk-full line with pytest's paths (~900 characters), well under PIPE_BUF
WRITER = """
import sys, time
from core.errors import exit_line_in_one_write, say
line = {line!r}.format(sys.argv[1] * 800)
start = float(sys.argv[2])
while time.time() < start:  # both processes write at the same moment
    pass
with exit_line_in_one_write():
    for _ in range(1999):
        say(line)
    raise SystemExit(line)  # the command's own end, as a DiskFullError ends every rank
"""


def test_two_processes_writing_at_once_to_one_stderr_never_run_their_lines_together():
    read, write = os.pipe()
    start = time.time() + 1.5
    code = WRITER.format(line=LINE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code, c, str(start)], stderr=write, env=env) for c in "ab"]
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        lines = pipe.read().decode().splitlines()
    assert [p.wait(timeout=60) for p in procs] == [1, 1]  # a SystemExit with a message: status 1, as Python's
    whole = {LINE.format(c * 800) for c in "ab"}
    broken = [line[:60] + " ... " + line[-60:] for line in lines if line not in whole]
    assert not broken and len(lines) == 4000, (len(lines), broken[:3])
