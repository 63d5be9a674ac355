"""Reads tracking output back for tests: a W&B offline run from its ``run-<id>.wandb`` file (what ``wandb sync``
would upload) and TensorBoard scalars from event files.

wandb 0.31 dropped its Python reader (``wandb.sdk.internal.datastore``); the file is LevelDB's log format behind a
7-byte W&B header: 32 KiB blocks of records ``crc32 (4) | length (2) | type (1) | data``, where a protobuf
``wandb_internal_pb2.Record`` is split over FULL, or FIRST + MIDDLE... + LAST chunks, and a block tail shorter than
a record header is zero padding.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# wandb is optional for the app (TensorBoard is the default), so tests that need it say so instead of failing
requires_wandb = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None, reason="needs the wandb package (pip install wandb)"
)

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> Iterator:
    """Yields the ``Record`` protobufs of one ``.wandb`` file in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (starts with {data[:7]!r})")
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        pos += HEADER
        chunk, pos = data[pos : pos + length], pos + length
        if kind == 0 or len(chunk) < length:  # zero-filled rest of the block, or a tail cut off by a kill
            break
        parts.append(chunk)
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


@dataclass
class OfflineRun:
    """What one offline run recorded: run id/project/group, config, history rows, artifacts, whether it resumed."""

    path: Path
    run_id: str = ""
    project: str = ""
    group: str = ""
    resumed: bool = False
    started: float | None = None  # wandb.init's time (s since the epoch, ns precision), from the run record
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    artifacts: list[dict] = field(default_factory=list)

    @property
    def keys(self) -> set[str]:
        """Every history key that was logged at least once (W&B's own ``_step``/``_runtime``/``_timestamp`` too)."""
        return {key for row in self.history for key in row}


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(path: str | Path) -> OfflineRun:
    """Parses one ``run-<id>.wandb`` file (or the ``offline-run-*`` folder holding it)."""
    path = Path(path)
    if path.is_dir():
        path = next(path.glob("run-*.wandb"))
    # the id is in the file name too (`run-<id>.wandb`, what `wandb sync` uploads): a job killed before wandb's
    # writer flushed its run record still has it
    run = OfflineRun(path=path, run_id=path.stem.removeprefix("run-"))
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.project, run.group = record.run.run_id, record.run.project, record.run.run_group
            run.resumed = run.resumed or bool(record.run.resumed)
            if record.run.HasField("start_time") and run.started is None:
                run.started = record.run.start_time.seconds + record.run.start_time.nanos / 1e9
            for item in record.run.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                run.config[_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            run.history.append({_key(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "artifact":
            art = record.artifact
            run.artifacts.append({"name": art.name, "type": art.type, "aliases": list(art.aliases)})
    return run


def _folder_time(run: OfflineRun) -> float:
    """The ``YYYYMMDD_HHMMSS`` of ``offline-run-YYYYMMDD_HHMMSS-<id>`` (local time, one-second resolution)."""
    import time

    stamp = run.path.parent.name.split("-")[2]
    return time.mktime(time.strptime(stamp, "%Y%m%d_%H%M%S"))


def offline_runs(root: str | Path) -> list[OfflineRun]:
    """Every offline run below ``root`` (each ``offline-run-*`` folder), oldest first.

    Ordered by the run record's start time, which has sub-second precision: the folder name has whole seconds only,
    so two runs started within one second (a quick requeue) would be ordered by their random ids. A run killed
    before its run record was written falls back to the folder's second; runs that cannot be told apart fail here.
    """
    runs = [read_run(d) for d in Path(root).rglob("offline-run-*") if d.is_dir()]
    runs.sort(key=lambda r: r.started if r.started is not None else _folder_time(r))
    keys = [r.started if r.started is not None else _folder_time(r) for r in runs]
    assert len(set(keys)) == len(keys), f"offline runs with the same start time cannot be ordered: {runs}"
    return runs


def tensorboard_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files of ``run_dir``: tag -> [(step, value), ...] in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: sorted((e.step, e.value) for e in events.Scalars(tag)) for tag in events.Tags()["scalars"]}
