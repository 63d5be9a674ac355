"""Gradient edits in ``on_after_backward`` apply in every mode: the all-reduce variants average when backward ends,
before the hook, as DDP does. ``allreduce_overlap`` used to drop them (its buckets were copied during backward)."""

import pytest

from tests.distributed.conftest import AMP_MODES

TOL = 1e-5
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("parity")]  # shares the parity job


@pytest.mark.parametrize("mode", [m for m in AMP_MODES if m != "ddp"])
def test_gradient_edits_after_backward_apply_in_every_allreduce_variant(parity, mode):
    facts = parity["scenarios"]["grad_edits"]["modes"][mode]
    assert facts["max_diff_vs_ddp"] < TOL, f"{mode} lost or doubled the on_after_backward edit: {facts}"
    assert facts["ranks_identical"]


def test_the_gradient_edit_changed_the_run(parity):
    """The reference trains without the callback: halving the gradients must show, far beyond the tolerance."""
    assert parity["scenarios"]["grad_edits"]["modes"]["ddp"]["max_diff_vs_single"] > 100 * TOL
