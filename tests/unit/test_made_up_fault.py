"""A new kind of fault is one file plus its troubleshooting section: registered with its translator and its injector
(here the throwaway ``tests/unit/made_up_fault.py``), it is detected, named in the one ``error:`` line with the link
to its section, and healed by a launcher with restarts left, with no other edit."""

from __future__ import annotations

import pytest

from app.command import user_errors_explained
from app.resilience.faults import KINDS, named, unregister
from core.errors import DOCS_URL
from tests.distributed.test_lightning_launcher_heals import BATCHES, EPOCHS, FAULT_AT, job_args, last_of, run
from tests.troubleshooting import quotes

LINK = f" Help: {DOCS_URL}#weights-diverged"


@pytest.fixture
def made_up():
    """The kind, registered for the test only (the app's list stays as it is)."""
    from tests.unit import made_up_fault

    made_up_fault.register(made_up_fault.WeightsDiverged)
    yield made_up_fault
    unregister(made_up_fault.WeightsDiverged)


class Requeue:
    faults = 0

    def after_fault(self, fault: object = None) -> None:
        self.faults += 1


def test_its_section_is_the_one_other_edit(made_up):
    assert KINDS[-1] is made_up.WeightsDiverged
    assert [kind.help for kind in KINDS if kind.help not in quotes()] == ["weights-diverged"]  # the others have theirs


def test_it_is_detected_and_named_in_one_line_with_its_link(made_up, capsys):
    mismatch = made_up.ChecksumMismatch("0x1 on rank 0, 0x0 on rank 1")
    assert isinstance(named(mismatch), made_up.WeightsDiverged) and named(RuntimeError("a bug")) is None
    requeue = Requeue()
    with pytest.raises(SystemExit) as stop, user_errors_explained(requeue):
        raise mismatch
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: the ranks' weights no longer match (0x1 on rank 0, 0x0 on rank 1): "), line
    assert line.endswith(LINK) and stop.value.code == 1, line
    assert requeue.faults == 1  # a fault: a SLURM job with requeues left goes back in the queue


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("timing")  # as the heal tests: its start-up allowance is wall-clock
def test_it_heals_under_the_launcher_with_restarts(made_up, mnist_dir, tmp_path):
    """``--launch.max_restarts 1``: the fault mid-epoch 1 of the first attempt ends every rank; the agent restarts the
    group, which resumes the newest ``last.ckpt`` and finishes."""
    inject = ["--trainer.callbacks+=tests.unit.made_up_fault.DivergeAt", "--trainer.callbacks.step", str(FAULT_AT)]
    code, out = run(job_args(mnist_dir, tmp_path, "--launch.max_restarts", "1", *inject), tmp_path)
    assert code == 0 and "Traceback" not in out, out[-6000:]
    said = [line for line in out.splitlines() if line.endswith(LINK)]
    assert len(said) == 2, said  # each rank says it
    assert all(
        line.startswith(f"error: the ranks' weights no longer match (global step {FAULT_AT - 1}: ") for line in said
    )
    last = tmp_path / "version_0" / "checkpoints" / "last.ckpt"
    assert f"resume: {last} (torchrun restart 1: the newest last.ckpt of job" in out, out[-6000:]
    assert last_of(tmp_path)["global_step"] == EPOCHS * BATCHES
