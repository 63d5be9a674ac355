"""One 2-process gloo job (torchrun, CPU) shared by the distributed tests: a job costs ~10-20 s of imports per
process here, so it checks the collectives and every mode on three scenarios at once (see ``tools.parity``)."""

from __future__ import annotations

import pytest

from bench.parity_report import AMP_MODES, EXACT_MODES, STEPS, scenarios
from tools.parity import compare, table

# the scenarios live in bench.parity_report, which also writes the figures the README quotes
__all__ = ["AMP_MODES", "EXACT_MODES", "STEPS", "parity"]


@pytest.fixture(scope="session")
def parity(mnist_dir, tmp_path_factory) -> dict:
    """The job's facts per scenario and mode, with the max parameter difference against single device and ddp."""
    workdir = tmp_path_factory.mktemp("parity")
    results = compare(scenarios(mnist_dir), steps=STEPS, nproc=2, workdir=workdir, accelerator="cpu")
    print(f"\nparity job ({STEPS} steps, 2 gloo processes)\n{table(results)}")  # the figures, with pytest -s
    return results
