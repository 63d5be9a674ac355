"""What the mid-epoch resume tests (and ``bench/resume_exact.py``) put into a real ``cli.py fit``: a real signal at a
chosen global step, and a record of every sample each rank trained on.

Kept free of the app's newer modules so the same file measures an older checkout ("before").
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path

from lightning.pytorch import Callback


class SignalAt(Callback):
    """Rank ``rank`` sends itself ``signum`` when the training batch that makes global step ``step - 1`` ends, so the
    app stops at the end of the batch that makes global step ``step`` (its ranks agree on the signal at the next
    batch's start). ``sigkill``: SIGKILL instead (a worker that dies; torchrun restarts the job). ``attempt``: only in
    that attempt of a restarted job (``TORCHELASTIC_RESTART_COUNT``; 0: the first), or in every one (None)."""

    def __init__(
        self,
        step: int = 17,
        signum: int = int(signal.SIGTERM),
        rank: int = 0,
        sigkill: bool = False,
        attempt: int | None = None,
    ) -> None:
        self.step, self.signum, self.rank, self.sigkill, self.attempt = step, signum, rank, sigkill, attempt
        self._sent = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._sent or trainer.global_rank != self.rank or trainer.global_step != self.step - 1:
            return
        if not in_attempt(self.attempt):
            return
        self._sent = True
        os.kill(os.getpid(), signal.SIGKILL if self.sigkill else self.signum)


class HangAt(Callback):
    """Rank ``rank`` stops making progress (sleeps ``seconds``) when the training batch that makes global step
    ``step - 1`` ends, alive but stuck as on a dead file system; ``attempt`` as for :class:`SignalAt`."""

    def __init__(self, step: int = 17, rank: int = 1, seconds: float = 3600.0, attempt: int | None = None) -> None:
        self.step, self.rank, self.seconds, self.attempt = step, rank, seconds, attempt

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step - 1 and in_attempt(self.attempt):
            time.sleep(self.seconds)


class HangIn(Callback):
    """Rank ``rank`` sleeps ``seconds`` in the hook ``hook`` (``on_sanity_check_start`` or ``on_train_start``), alive
    but stuck while the job starts; ``attempt`` as for :class:`SignalAt`. (A rank stuck in its DataModule's ``setup``,
    before its hang watch starts, needs a DataModule of its own: tests/distributed/test_hangs.py.)"""

    def __init__(
        self, hook: str = "on_train_start", rank: int = 1, seconds: float = 3600.0, attempt: int | None = None
    ) -> None:
        self.hook, self.rank, self.seconds, self.attempt = hook, rank, seconds, attempt

    def _maybe(self, trainer, hook: str) -> None:
        if hook == self.hook and trainer.global_rank == self.rank and in_attempt(self.attempt):
            time.sleep(self.seconds)

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self._maybe(trainer, "on_sanity_check_start")

    def on_train_start(self, trainer, pl_module) -> None:
        self._maybe(trainer, "on_train_start")


class DieStarting(Callback):
    """Rank ``rank`` SIGKILLs itself as its configuration is read, before the trainer exists and before the process
    group forms (a node that crashes as the job starts); ``attempt`` as for :class:`SignalAt`. The rank comes from the
    launcher's environment: ``RANK`` (torchrun, the elastic agent) or ``SLURM_PROCID`` (srun)."""

    def __init__(self, rank: int = 1, attempt: int | None = None) -> None:
        mine = os.environ.get("RANK") or os.environ.get("SLURM_PROCID")
        if mine is not None and int(mine) == rank and in_attempt(attempt):
            os.kill(os.getpid(), signal.SIGKILL)


class KillLoaderWorkerAt(Callback):
    """Rank ``rank`` SIGKILLs a worker of its training DataLoader (the OOM killer's way) when the training batch that
    makes global step ``step - 1`` ends; ``attempt`` as for :class:`SignalAt`. The workers are persistent (the app's
    loaders), so the training loader keeps its iterator and the iterator its worker processes; the validation
    loader's workers live too, and may be the newest (a resumed run starts training before any validation)."""

    def __init__(self, step: int = 17, rank: int = 1, attempt: int | None = None) -> None:
        self.step, self.rank, self.attempt = step, rank, attempt

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step - 1 and in_attempt(self.attempt):
            iterator = getattr(trainer.train_dataloader, "_iterator", None)
            workers = [w.pid for w in getattr(iterator, "_workers", [])]
            os.kill(workers[-1] if workers else loader_workers(os.getpid())[-1], signal.SIGKILL)


def children(pid: int) -> list[int]:
    """The live child processes of ``pid``, from Linux's ``/proc``, oldest first."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return sorted(found)


def loader_workers(rank_pid: int) -> list[int]:
    """A rank's DataLoader workers, oldest first: the children of its multiprocessing forkserver (the app's start
    method for them in a multi-process job, ``datamodules.base.worker_context``). In a run's first attempt the newest
    is a training worker (the sanity check's validation workers start before the training's; both persist); in a
    resumed attempt it may be a validation worker."""
    servers = [p for p in children(rank_pid) if b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return sorted(w for server in servers for w in children(server))


def in_attempt(attempt: int | None) -> bool:
    """Whether this process runs in ``attempt`` of a restarted job (``TORCHELASTIC_RESTART_COUNT``, or SLURM's
    ``SLURM_RESTART_COUNT`` for a requeued job; unset: 0)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SLURM_RESTART_COUNT") or "0"
    return attempt is None or int(count) == attempt


class SampleLog(Callback):
    """Appends, per training batch, ``{"epoch", "batch", "samples": [digest of each sample's image and label]}`` to
    ``<folder>/samples_rank<R>.jsonl``: a resumed run appends to what the stopped one wrote. A digest of the pixels
    names the sample and the augmentation it got (crop, flip; with mixup/cutmix the mixed pixels and labels)."""

    def __init__(self, folder: str, pause: float = 0.0) -> None:
        self.folder, self.pause = folder, pause  # pause: seconds each batch takes longer (a slow step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        images, labels = batch[0], batch[1]
        digests = [
            hashlib.sha1(images[i].detach().cpu().numpy().tobytes() + _label_bytes(labels[i])).hexdigest()[:12]
            for i in range(len(labels))
        ]
        line = {"epoch": trainer.current_epoch, "batch": batch_idx, "step": trainer.global_step, "samples": digests}
        path = Path(self.folder) / f"samples_rank{trainer.global_rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        time.sleep(self.pause)


def _label_bytes(label) -> bytes:
    """A class index as its digits (as before); mixed labels (probabilities, mixup/cutmix) as their bytes."""
    if label.dim() == 0:
        return bytes(str(int(label)), "ascii")
    return label.detach().cpu().numpy().tobytes()


def read_samples(folder: Path, rank: int) -> list[dict]:
    path = Path(folder) / f"samples_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def per_step(root: Path, rank: int) -> list:
    """The samples each global step of ``rank`` trained on (``tools.resume_probe.SampleLog``; the last record of a step
    trained again after a restart)."""
    steps = {line["step"]: (line["epoch"], line["batch"], line["samples"]) for line in read_samples(root, rank)}
    assert sorted(steps) == list(range(len(steps))), sorted(steps)
    return [steps[step] for step in sorted(steps)]


class Heartbeat(Callback):
    """Writes ``<pid> <global step> <first step of this process> <time.time()>`` to ``<folder>/heartbeat/rank<R>``
    after each training step (atomically), then sleeps ``pause`` seconds: where each rank is, for a script that
    injects a fault at a chosen step and times the recovery. Each process also appends ``<pid> <first step>
    <time>`` to ``starts_rank<R>`` at its first step."""

    def __init__(self, folder: str, pause: float = 0.0) -> None:
        self.folder, self.pause, self.first = folder, pause, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        folder = Path(self.folder) / "heartbeat"
        folder.mkdir(parents=True, exist_ok=True)
        if self.first is None:  # this process's first step: one line per process, appended
            self.first = trainer.global_step
            with (folder / f"starts_rank{trainer.global_rank}").open("a") as starts:
                starts.write(f"{os.getpid()} {self.first} {time.time()}\n")
        tmp = folder / f"rank{trainer.global_rank}.tmp"
        tmp.write_text(f"{os.getpid()} {trainer.global_step} {self.first} {time.time()}")
        tmp.replace(folder / f"rank{trainer.global_rank}")
        time.sleep(self.pause)


def heartbeats(folder: Path, ranks: int) -> list[tuple[int, int, int, float]] | None:
    """``(pid, step, first step, time)`` of each rank's latest :class:`Heartbeat`, or None until every rank has one."""
    found = [Path(folder) / "heartbeat" / f"rank{r}" for r in range(ranks)]
    try:
        beats = [p.read_text().split() for p in found]
    except FileNotFoundError:
        return None
    return [(int(b[0]), int(b[1]), int(b[2]), float(b[3])) for b in beats]
