"""The rendezvous port of a run that Lightning's own launcher starts is held by the app from the plan until the run
ends: no other job on the machine can bind it or be handed it, while rank 0's TCPStore binds and listens on it."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch.distributed as dist

from app.launch.preflight import build
from app.launch.rendezvous import HeldPort
from core.env import detect
from tools.slurm import resolve_config

TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0"}


def plan(*args: str, env: dict | None = None):
    config = resolve_config(
        ["fit", "--trainer.default_root_dir", "/tmp/port-test", "--trainer.accelerator", "cpu", *args]
    )
    return build(config, launch=detect(env or {}))


@pytest.fixture
def held(monkeypatch):
    """The command's port holder (released at the end, as the command does)."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    port = HeldPort()
    yield port
    port.release()


def test_the_held_port_is_nobody_elses_until_the_run_ends(held):
    port = held.hold(plan("--trainer.devices", "2", "--trainer.strategy", "ddp"))
    assert port and os.environ["MASTER_PORT"] == str(port)  # what the ranks Lightning starts inherit
    with socket.socket() as other, pytest.raises(OSError, match="in use"):
        other.bind(("", port))
    handed = set()
    for _ in range(2000):  # the kernel's choice for everyone else's port-0 binds (Lightning's own included)
        with socket.socket() as other:
            other.bind(("", 0))
            handed.add(other.getsockname()[1])
    assert port not in handed
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))  # rank 0's store
    store.set("rank0", "here")
    assert store.get("rank0") == b"here"
    del store
    held.release()
    assert "MASTER_PORT" not in os.environ
    with socket.socket() as other:
        other.bind(("", port))  # free again once the run is over


@pytest.mark.parametrize(
    "args, env",
    [
        (["--trainer.devices", "1"], {}),  # one process: no rendezvous
        (["--trainer.devices", "2", "--trainer.strategy", "ddp"], TORCHRUN),  # torchrun's store binds its own port
        (["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.num_nodes", "2"], {}),  # you give it
    ],
)
def test_nothing_is_held_where_the_launcher_or_you_choose_the_port(held, args, env):
    assert held.hold(plan(*args, env=env)) is None


def test_a_master_port_you_set_is_kept(held):
    assert held.hold(plan("--trainer.devices", "2", "--trainer.strategy", "ddp", env={"MASTER_PORT": "29511"})) is None
