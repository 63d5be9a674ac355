"""The tutorial's primitives on 2 gloo processes, with known values, through the app's process-group setup
(Lightning's ``_init_dist_connection`` with the torchrun environment, exactly as DDPStrategy calls it)."""

import pytest

pytestmark = pytest.mark.xdist_group("parity")  # shares the session's parity job: built once, on one worker

PRIMITIVES = ["send_recv", "isend_irecv", "broadcast", "scatter", "gather", "reduce", "all_reduce", "all_gather"]


@pytest.mark.distributed
@pytest.mark.slow  # the shared parity job (tests/distributed/conftest.py)
@pytest.mark.parametrize("primitive", PRIMITIVES)
def test_primitive_gives_the_known_values(parity, primitive):
    assert parity["collectives"][primitive], f"{primitive} returned wrong values on some rank"
