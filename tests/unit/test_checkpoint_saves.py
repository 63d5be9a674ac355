"""How a checkpoint is written: its SHA-256 beside it (checked by the real ``sha256sum``), a flipped byte found,
saves in the background that hold the state of their step, and the node-local copy a restart reads first."""

from __future__ import annotations

import subprocess
import threading

import pytest
import torch

from app.checkpoint import AtomicCheckpointIO, BackgroundSaves, Checkpoints, local_folder, readable_copy


def checksum_problem(path) -> str | None:
    """What a new start's reader finds wrong with ``path``'s bytes (None: they match their SHA-256)."""
    return Checkpoints().read(path).problem


def flip_a_byte(path) -> None:
    """A silent disk fault: one byte in the middle of the tensor data changes; the file still loads."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_each_save_writes_a_sha256_that_sha256sum_checks_and_a_flipped_byte_fails_it(tmp_path):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"w": torch.arange(100_000.0), "step": 1}, path)
    io.save_checkpoint({"w": torch.arange(100_000.0) * 2, "step": 2}, path)  # the first is kept as last.previous
    checked = subprocess.run(
        ["sha256sum", "-c", "last.ckpt.sha256", "last.previous.ckpt.sha256"], cwd=tmp_path, capture_output=True,
        text=True,
    )  # fmt: skip
    assert checked.returncode == 0 and checked.stdout == "last.ckpt: OK\nlast.previous.ckpt: OK\n", checked
    assert torch.load(tmp_path / "last.previous.ckpt", weights_only=True)["step"] == 1
    assert checksum_problem(path) is None

    flip_a_byte(path)
    assert torch.load(path, weights_only=True)["step"] == 2  # torch alone would load the damaged weights
    assert checksum_problem(path) == "its SHA-256 differs from the one saved in last.ckpt.sha256"
    assert subprocess.run(["sha256sum", "--quiet", "-c", "last.ckpt.sha256"], cwd=tmp_path).returncode == 1


class RecordsThread:
    """Pickled like any checkpoint entry; remembers the thread that wrote it."""

    threads: list[str] = []

    def __reduce__(self):
        RecordsThread.threads.append(threading.current_thread().name)
        return int, (0,)


def test_a_background_save_is_written_by_another_thread_and_holds_the_state_of_its_step(tmp_path):
    io, path = BackgroundSaves(AtomicCheckpointIO()), tmp_path / "last.ckpt"
    weights = torch.zeros(1_000_000)
    io.deferring = True  # as during training
    io.save_checkpoint({"w": weights, "who": RecordsThread()}, path)
    weights.add_(1.0)  # the next optimizer step changes the weights in place while the save may still run
    io.wait()
    assert torch.equal(torch.load(path, weights_only=False)["w"], torch.zeros(1_000_000))  # int() stands for it
    assert RecordsThread.threads and RecordsThread.threads[-1] != threading.current_thread().name

    io.deferring = False  # the save at the end of fit: on disk when the call returns
    io.save_checkpoint({"w": weights}, path)
    assert io._pending is None and torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(1_000_000))
    io.teardown()


class Unpicklable:
    def __reduce__(self):
        raise OSError("simulated failure in the middle of writing the checkpoint")


def test_a_failed_background_save_is_raised_at_the_next_save_and_the_previous_file_stays(tmp_path):
    io, path = BackgroundSaves(AtomicCheckpointIO()), tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)
    io.deferring = True
    io.save_checkpoint({"step": 2, "bad": Unpicklable()}, path)  # returns: the thread fails later
    with pytest.raises(OSError, match="simulated failure"):
        io.save_checkpoint({"step": 3}, path)
    assert torch.load(path, weights_only=True)["step"] == 1 and checksum_problem(path) is None
    io.teardown()


def test_a_removal_waits_behind_the_save_in_flight_and_a_failed_save_removes_nothing(tmp_path):
    """Lightning removes the previous best file right after a new best is saved: the removal is queued behind the
    background save (training does not wait), and when that save fails the older file stays."""
    import threading

    class Held(AtomicCheckpointIO):  # the real atomic save, held until the test lets it go
        go = threading.Event()

        def save_checkpoint(self, checkpoint, path, storage_options=None):
            assert self.go.wait(30)
            super().save_checkpoint(checkpoint, path, storage_options)

    io = BackgroundSaves(Held())
    old, new = tmp_path / "epoch=0.ckpt", tmp_path / "epoch=1.ckpt"
    Held.go.set()
    io.save_checkpoint({"step": 1}, old)
    Held.go.clear()
    io.deferring = True
    io.save_checkpoint({"step": 2}, new)  # in flight, held
    io.remove_checkpoint(old)  # returns at once: queued behind the save
    assert old.is_file() and not new.exists()
    Held.go.set()
    io.wait()
    assert not old.exists() and torch.load(new, weights_only=True)["step"] == 2

    io.save_checkpoint({"step": 3, "bad": Unpicklable()}, old)  # fails in the thread
    io.remove_checkpoint(new)
    with pytest.raises(OSError, match="simulated failure"):
        io.save_checkpoint({"step": 4}, old)
    assert torch.load(new, weights_only=True)["step"] == 2  # the failed save removed nothing
    io.teardown()


def test_a_restart_on_the_node_reads_the_local_copy_only_while_it_holds_the_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node"))
    (tmp_path / "node").mkdir()
    shared = tmp_path / "shared" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.local_copy = True
    io.save_checkpoint({"step": 1, "w": torch.ones(1000)}, shared)
    local = local_folder(shared.parent) / "last.ckpt"
    assert local.parent.parent == tmp_path / "node" / f"dptrain-checkpoints-{__import__('os').getuid()}"
    assert local.read_bytes() == shared.read_bytes() and readable_copy(shared, Checkpoints().reader.intact) == local
    assert io.load_checkpoint(shared)["step"] == 1

    flip_a_byte(local)  # the node's copy damaged: the shared file is read
    assert readable_copy(shared, Checkpoints().reader.intact) == shared
    io.save_checkpoint({"step": 2, "w": torch.ones(1000)}, shared)  # a new save replaces both
    assert readable_copy(shared, Checkpoints().reader.intact) == local
    io.local_copy = False
    io.save_checkpoint({"step": 3, "w": torch.ones(1000)}, shared)  # the local copy is now older than the shared
    assert readable_copy(shared, Checkpoints().reader.intact) == shared and io.load_checkpoint(shared)["step"] == 3
