"""One 2-process gloo job (torchrun, CPU) shared by the distributed tests: a job costs ~10-20 s of imports per
process here, so it checks the collectives and every mode on every scenario at once (see ``tools.parity``)."""

from __future__ import annotations

import pytest

from bench.parity_report import AMP_MODES, EXACT_MODES, MODERN_MODES, STEPS, scenarios
from tools.parity import compare, table
from tools.photos import build_photo_imagenet

# the scenarios live in bench.parity_report, which also writes the figures the README quotes
__all__ = ["AMP_MODES", "EXACT_MODES", "MODERN_MODES", "STEPS", "parity"]


@pytest.fixture(scope="session")
def parity(mnist_dir, tmp_path_factory) -> dict:
    """The job's facts per scenario and mode, with the max parameter difference against single device and ddp."""
    workdir = tmp_path_factory.mktemp("parity")
    photos = build_photo_imagenet(tmp_path_factory.mktemp("parity_photos"))  # the modern recipe's scenario
    results = compare(scenarios(mnist_dir, str(photos)), steps=STEPS, nproc=2, workdir=workdir, accelerator="cpu")
    print(f"\nparity job ({STEPS} steps, 2 gloo processes)\n{table(results)}")  # the figures, with pytest -s
    return results
