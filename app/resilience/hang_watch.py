"""A rank that stays alive but stops making progress is named with where it is, and the whole job ends.

torch bounds each collective by the process-group timeout (30 min by default) and then says only that a collective
timed out; Lightning has nothing for a stuck rank. So every rank of a multi-process run starts a watchdog thread
(:class:`HangWatch`). Through the job's rendezvous store (a TCPStore every rank reaches; this thread opens its own
connection to it, so a main thread blocked in the store never blocks the watch) each thread publishes, about every
``timeout / 10`` s (2 s at most), how far its rank got: a counter that moves when a training or validation step
starts or ends.
Rank 0's thread reads them all. When no counter of any rank has moved for ``timeout`` seconds:

- the rank behind is the one with the lowest counter (the others started a step it has not reached, and wait in it),
  or a rank whose thread stopped publishing ("does not answer": SIGSTOPped, swapping, its node gone);
- every answering rank is asked for the innermost frames of its main thread (``sys._current_frames``, read from the
  watchdog thread: it runs while the main thread sleeps, blocks in I/O or in a collective, which release the GIL,
  and between two bytecodes of pure Python) and writes the stacks of all its threads (``faulthandler``) to
  ``<run folder>/hang/stacks-rank<R>.txt``, and its flight-recorder buffer where torch can dump it
  (``nccl_trace_rank_<R>``);
- rank 0 prints one diagnosis (``error: hang watch: rank 1 of 2 ... is stuck``), every rank leaves with status 1
  (``os._exit`` from the thread: the main thread may never return), and a rank that does not answer is SIGKILLed by
  an answering rank of its host (a stopped process cannot act on anything else).

The job's start has its own, longer allowance (``--launch.startup_timeout``): from the training set-up (the
callbacks' ``setup``, after the DataModule's) through the sanity check to the end of the first training step (the
first compile, the loader workers' start), each rank publishes which of these it is in, and the message names it. A
rank still in the DataModule's ``setup`` has not started its thread (:class:`StartEarly` starts it in the first
callback ``setup``): when the others have and it stays missing for the allowance, it is named as stuck there.
What is not progress, and so never fires the watch: a checkpoint save (``Trainer.save_checkpoint`` on any rank,
however long its write: rank 0 writes while the others wait at the barrier after it). A long validation moves the
counter at each of its steps.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from app.lightning_private import process_group_backend
from app.resilience.faults import HangError, LostRankError
from app.resilience.requeue import Requeue
from core.env import detect, export_unset, node_name
from core.errors import UserError, report

ROOT = Path(__file__).resolve().parents[2]
FRAMES = 4  # innermost frames of the main thread shown per rank
PREFIX = "app/hang_watch"
BUFFER_SIZE = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # the flight recorder's, new name first
STARTUP_FLOOR_S = 300.0  # the start-up allowance is at least this (a compile, a large index), unless given
PHASES = {  # what a rank publishes while the job starts, and how the message says it
    "set-up": "in the training set-up (the sanity check not begun)",
    "sanity": "in the sanity check (validation before training)",
    "first": "starting training: before the end of its first step (the loop's start, loader workers, a first compile)",
    "training": "",
}


def where(frame: Any, depth: int = FRAMES) -> list[str]:
    """The innermost ``depth`` frames of a stack, innermost first, as ``file:line function`` (paths shortened)."""
    return [f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(traceback.extract_stack(frame)[-depth:])]


def _short(path: str) -> str:
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


def flight_recorder_env(folder: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The NCCL flight recorder's variables, as the app sets them (a user's own values win): the last 2000
    collectives of each rank, dumped by torch's NCCL watchdog when a collective times out, to ``folder``. The buffer's
    variable is ``TORCH_FR_BUFFER_SIZE`` where torch's recorder is generic (it warns that the NCCL name is
    deprecated), unless the user set either name."""
    environ = os.environ if environ is None else environ
    generic = hasattr(torch._C._distributed_c10d, "_dump_fr_trace")
    size = {} if {*BUFFER_SIZE} & environ.keys() else {BUFFER_SIZE[0] if generic else BUFFER_SIZE[1]: "2000"}
    return {
        **size,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(folder / "nccl_trace_rank_"),
    }


def dump_flight_recorder(path: Path) -> str | None:
    """Writes this process's flight-recorder buffer (the last collectives of its process groups, in the format
    ``torchfrtrace`` reads) to ``path``; returns why not where the installed torch has no dump for the backend."""
    c10d, backend = torch._C._distributed_c10d, dist.get_backend()
    dump = getattr(c10d, "_dump_nccl_trace" if backend == "nccl" else "_dump_fr_trace", None)
    if dump is None:
        return f"torch {torch.__version__} has no flight-recorder dump for {backend} (a newer torch records gloo too)"
    path.write_bytes(dump())
    return None


class HangWatch(Callback):
    """Ends a multi-process job whose ranks stopped making progress, naming the rank behind and where it is.

    Args:
        timeout: seconds without a finished (or started) training or validation step on any rank before the job is
            declared stuck (``--launch.hang_timeout``); 0 turns the watch off.
        startup_timeout: the allowance while the job starts (``--launch.startup_timeout``).
        requeue: what a SLURM job does after the watch ended it (the command's; none: nothing).
    """

    def __init__(
        self, timeout: float = 600.0, startup_timeout: float | None = None, requeue: Requeue | None = None
    ) -> None:
        self.timeout = timeout
        self.startup_timeout = startup_timeout or startup_allowance(timeout, None, None)
        self.requeue = requeue or Requeue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._state: dict[str, Any] = {}

    # ----- the main thread: progress, pauses, the thread's life
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._thread is not None:  # started already, by the first callback (:class:`StartEarly`)
            return
        if stage != "fit" or not self.timeout or trainer.world_size < 2 or not dist.is_initialized():
            return
        self._state = {"counter": 0, "step": 0, "in_step": 0, "paused": 0, "phase": "set-up"}
        self._state["folder"] = trainer.default_root_dir
        save = trainer.save_checkpoint

        def paused_save(*args: Any, **kwargs: Any) -> Any:
            self._state["paused"] += 1
            try:
                return save(*args, **kwargs)
            finally:
                self._state["paused"] -= 1
                self._state["counter"] += 1

        trainer.save_checkpoint = paused_save  # this run's Trainer only (an instance attribute)
        self._stop.clear()
        self._thread = _Watchdog(self, trainer.global_rank, trainer.world_size, self._state)
        self._thread.start()

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._state:
            self._state["phase"] = "sanity"

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._state:
            self._state["phase"] = "first"

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._state:
            self._state["phase"] = "first"
            self._state["folder"] = str(trainer.log_dir if trainer.logger else trainer.default_root_dir)
            ckpt = trainer.checkpoint_callback
            self._state["checkpoints"] = getattr(ckpt, "dirpath", None)

    def _move(self) -> None:
        if self._state:
            self._state["counter"] += 1

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if self._state:
            self._state["counter"] += 1
            self._state["in_step"] = 1

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self._state:
            self._state["counter"] += 1
            self._state["step"], self._state["in_step"] = trainer.global_step, 0
            self._state["phase"] = "training"  # the start is behind us: the hang timeout from now on

    def on_validation_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self._move()

    def on_validation_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self._move()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._state:  # what follows training (the last saves, the summary) is not watched
            self._state["paused"] += 1
        self._end()

    def _end(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2)  # a store call to a gone host must not hold up the exit
            self._thread = None

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._end()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._end()
        vars(trainer).pop("save_checkpoint", None)

    def __deepcopy__(self, memo: dict) -> HangWatch:  # the thread and its event are this run's, never copied
        return HangWatch(self.timeout, self.startup_timeout, self.requeue)

    def __getstate__(self) -> dict:
        return {"timeout": self.timeout, "startup_timeout": self.startup_timeout}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["timeout"], state.get("startup_timeout"))


class StartEarly(Callback):
    """Starts a :class:`HangWatch` in the first callback ``setup`` of the run, before any other callback's (some make
    collectives there, such as a process group of their own), so that a rank still in its DataModule's ``setup``
    finds the others watching; the watch itself stays after the callbacks whose steps it counts."""

    def __init__(self, watch: HangWatch) -> None:
        self.watch = watch

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.watch.setup(trainer, pl_module, stage)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # first of the callbacks, so the watch stops before one of them ends the process from its own on_exception
        # (app.callbacks.LostRank raises there): a watch thread left inside a store call when the interpreter
        # finalizes is ended in a C++ frame, and libstdc++ aborts ("terminate called", SIGABRT after the error line)
        self.watch._end()


class _Watchdog(threading.Thread):
    """The thread of one rank: publishes its progress, answers rank 0's questions; on rank 0, judges."""

    def __init__(self, watch: HangWatch, rank: int, world: int, state: dict[str, Any]) -> None:
        super().__init__(name="hang-watch", daemon=True)
        self.watch, self.rank, self.world, self.state = watch, rank, world, state
        self.timeout, self.startup = watch.timeout, watch.startup_timeout
        self.interval = min(max(self.timeout / 10, 0.2), 2.0)
        self.silent_after = max(3 * self.interval, 3.0)  # a rank whose beats stopped this long does not answer
        self.host, self.pid = node_name(), os.getpid()
        self.main = threading.main_thread()
        self.store: Any = None
        self.beat = 0
        self.recorder: str | None = "this rank could not write its files (the line above says why)"  # or why not

    def _connect(self) -> Any:
        return watch_store(max(10, self.silent_after))

    def run(self) -> None:
        try:
            self.store = self._connect()
            self._publish()  # at once: a rank that dies or sticks in its first interval is known, with its node
        except Exception:  # no store to reach (an unusual rendezvous): the job runs unwatched
            return
        seen, last_move, answered = {}, time.monotonic(), False
        self.started = last_move
        store_lost_since: float | None = None
        while not self.watch._stop.wait(self.interval):
            try:
                self._publish()
                store_lost_since = None
                if self.store.check(["stop"]):
                    self._leave()
                if not answered and self.store.check(["ask"]):
                    self._answer(self.store.get("ask").decode())
                    answered = True
                if self.rank == 0:
                    last_move = self._judge(seen, last_move)
            except Exception as err:  # the store's host is gone or silent
                if self.watch._stop.is_set():
                    return
                store_lost_since = store_lost_since or time.monotonic()
                if time.monotonic() - store_lost_since > self.timeout:
                    self._store_lost(err)
        with contextlib.suppress(Exception):  # the last beat: "paused" after training, so the end is never a hang
            self._publish()

    def _publish(self) -> None:
        self.beat += 1
        s = self.state
        paused = int(s["paused"] > 0)
        fields = f"{self.beat} {s['counter']} {s['step']} {paused} {self.pid} {self.host} {s['in_step']} {s['phase']}"
        self.store.set(f"beat/{self.rank}", fields)

    # ----- rank 0: is the job stuck?
    def _beats(self) -> dict[int, list[str]]:
        keys = [f"beat/{r}" for r in range(self.world)]
        present = [k for k in keys if self.store.check([k])]
        values = self.store.multi_get(present) if present else []
        return {int(k.rsplit("/", 1)[1]): v.decode().split() for k, v in zip(present, values, strict=True)}

    def _judge(self, seen: dict[int, tuple[str, float, list[str]]], last_move: float) -> float:
        now = time.monotonic()
        beats = self._beats()
        paused = False
        for r, fields in beats.items():
            beat, progress = fields[0], (fields[1], fields[3])
            before = seen.get(r)
            if before is None or before[3] != progress:
                last_move = now
            seen[r] = (beat, now if before is None or before[0] != beat else before[1], fields, progress)
            # a pause counts while the rank answers: a rank stopped in (or just after) a save is not paused forever
            paused |= fields[3] == "1" and now - seen[r][1] <= self.silent_after
        if paused:
            return now
        if len(beats) < self.world:  # a rank that has not started its watch: still in the DataModule's setup?
            if now - self.started > self.startup:
                self._diagnose(seen, now - self.started)
            return now
        if now - last_move > (self.startup if _starting(beats.values(), self.world) else self.timeout):
            self._diagnose(seen, now - last_move)
        return last_move

    def _diagnose(self, seen: dict[int, tuple], stalled: float) -> None:
        folder = Path(self.state["folder"]) / "hang"
        self.store.set("ask", str(folder))
        self._answer(str(folder))
        now = time.monotonic()
        silent = {r for r, (_, at, _, _) in seen.items() if now - at > self.silent_after}
        silent |= {r for r in range(self.world) if r not in seen}  # never started its watch
        deadline = now + self.silent_after
        answers: dict[int, str] = {}
        while time.monotonic() < deadline:
            waiting = [r for r in range(self.world) if r not in answers and r not in silent]
            for r in waiting:
                if self.store.check([f"frames/{r}"]):
                    answers[r] = self.store.get(f"frames/{r}").decode()
            if not waiting or len(answers) + len(silent) == self.world:
                break
            time.sleep(0.1)
        silent |= {r for r in range(self.world) if r not in answers}
        report(self._error(seen, answers, silent, stalled, folder))
        self.store.set("stop", " ".join(map(str, sorted(silent))))
        self._leave(settle=True)

    def _error(self, seen: dict, answers: dict[int, str], silent: set[int], stalled: float, folder: Path) -> HangError:
        behind = _behind(seen, answers, silent)
        names = ", ".join(map(str, behind))
        starting = _starting([fields for _, _, fields, _ in seen.values()], self.world)
        allowance = (
            f"--launch.startup_timeout {self.startup:g}: the job is starting" if starting
            else f"--launch.hang_timeout {self.timeout:g}"
        )  # fmt: skip
        if behind:
            head = f"rank {names} of {self.world} {'is' if len(behind) == 1 else 'are'} stuck"
        else:
            head = f"all {self.world} ranks are stuck at the same point (none is behind the others)"
        lines = [
            f"hang watch: {head}: no rank started or finished a training or validation step for {stalled:.0f} s "
            f"({allowance})."
        ]
        for r in range(self.world):
            lines += _rank_lines(r, seen.get(r), answers.get(r), r in silent, "  <- behind" if r in behind else "")
        lines.append(f"Full stacks of every thread of each answering rank: {folder}/stacks-rank<R>.txt.")
        if self.recorder is None:
            lines.append(
                f"Flight recorder (each rank's last collectives): {folder}/nccl_trace_rank_<R>; analyse with "
                f"`torchfrtrace {folder} --prefix nccl_trace_rank_` (torch.distributed.flight_recorder)."
            )
        else:
            lines.append(f"Flight recorder not dumped: {self.recorder}.")
        lines.append(self._what_next(starting))
        return HangError("\n".join(lines))

    def _what_next(self, starting: bool) -> str:
        """The last line: every rank exits; a restart follows, or how to resume; which allowance to raise."""
        ckpts = self.state.get("checkpoints")
        launch = detect()  # torchrun --max-restarts (or --launch.max_restarts) with a restart left: it heals itself
        restart = launch.restart_count < launch.max_restarts
        return (
            "Every rank now exits with status 1. "
            + (
                f"torchrun restarts the worker group (restart {launch.restart_count + 1} of {launch.max_restarts}), "
                "which resumes from the newest last.ckpt of this run"
                if restart
                else "Resume: the same command plus `--ckpt_path last`"
            )
            + (f" (the last checkpoint in {ckpts} is intact)" if ckpts else "")
            + (
                ". If the start legitimately takes longer, raise `--launch.startup_timeout SECONDS`."
                if starting
                else ". If a step legitimately takes longer, raise `--launch.hang_timeout SECONDS` (0: the watch off)."
            )
        )

    # ----- every rank
    def _answer(self, folder: str) -> None:
        """Rank 0 asked: the innermost frames of this rank's main thread, and every thread's stack to a file."""
        frame = sys._current_frames().get(self.main.ident)
        frames = where(frame) if frame is not None else ["(the main thread has ended)"]
        self.store.set(f"frames/{self.rank}", "\n".join(frames))
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            with open(Path(folder) / f"stacks-rank{self.rank}.txt", "w") as out:
                out.write(f"rank {self.rank} of {self.world}, host {self.host}, pid {self.pid}\n")
                out.flush()
                faulthandler.dump_traceback(file=out, all_threads=True)
            self.recorder = dump_flight_recorder(Path(folder) / f"nccl_trace_rank_{self.rank}")
        except Exception as err:  # a full or read-only disk must not keep the job from ending
            print(f"hang watch: rank {self.rank} could not write its stacks to {folder}: {err}", file=sys.stderr)

    def _leave(self, settle: bool = False) -> None:
        """Ends this process with status 1; first SIGKILLs the ranks of this host that do not answer."""
        if self.rank != 0:  # rank 0's diagnosis carries the link to the section; this line points at it
            report(UserError(f"hang watch: rank {self.rank} of {self.world} stops: the job is stuck (rank 0's message "
                             "says which rank and where)."))  # fmt: skip
        try:
            silent = [int(r) for r in self.store.get("stop").decode().split()]
            for r in silent:
                if not self.store.check([f"beat/{r}"]):  # never started its watch: its launcher ends it
                    continue
                fields = self.store.get(f"beat/{r}").decode().split()
                if fields[5] == self.host:
                    os.kill(int(fields[4]), signal.SIGKILL)
            self.store.set(f"left/{self.rank}", "1")
            if settle:  # the store may live in this process (rank 0): the others read "stop" before it goes
                deadline = time.monotonic() + self.silent_after
                others = [f"left/{r}" for r in range(self.world) if r != self.rank and r not in silent]
                while others and not self.store.check(others) and time.monotonic() < deadline:
                    time.sleep(0.1)
        except Exception:
            pass
        _kill_local_children()
        self.watch.requeue.after_fault(HangError)  # under SLURM with --launch.max_restarts: back in the queue
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def _store_lost(self, err: Exception) -> None:
        launch = detect()
        report(
            UserError(
                f"hang watch: rank {self.rank} of {self.world} lost the job's store at {launch.master_addr}:"
                f"{launch.master_port} for more than {self.timeout:g} s (--launch.hang_timeout): its host (rank 0, or "
                f"the torchrun agent) does not answer ({type(err).__name__}). Rank {self.rank} stops. Resume with "
                "`--ckpt_path last`."
            )
        )
        _kill_local_children()
        self.watch.requeue.after_fault(LostRankError)
        os._exit(1)


def watch_store(timeout_s: float) -> Any:
    """A client of the job's store (at ``MASTER_ADDR:MASTER_PORT``) under this attempt's hang-watch prefix: where
    every rank's watch publishes its beats."""
    launch = detect()  # read now: Lightning exports MASTER_ADDR/MASTER_PORT when it forms the process group
    client = dist.TCPStore(
        launch.master_addr, int(launch.master_port), is_master=False, timeout=timedelta(seconds=timeout_s)
    )
    return dist.PrefixStore(f"{PREFIX}/{launch.restart_count}", client)


def hosts_of(ranks: list[int]) -> dict[int, str]:
    """The node each of ``ranks`` named in its hang watch's last beat (``SLURMD_NODENAME`` or the host name), read
    from the job's store: for the line about a lost rank, which cannot say it itself. Empty when unknown (no watch
    yet, the watch off, the store gone)."""
    try:
        store = watch_store(5)
        beats = {r: store.get(f"beat/{r}").decode().split() for r in ranks if store.check([f"beat/{r}"])}
        return {r: fields[5] for r, fields in beats.items() if len(fields) > 5}
    except Exception:
        return {}


def _behind(seen: dict[int, tuple], answers: dict[int, str], silent: set[int]) -> list[int]:
    """The ranks the others wait for: those that do not answer; else those with the lowest counter (the others started
    a step they have not reached); else, at the same count, those not in a collective while the others wait in one."""
    counters = {r: int(fields[1]) for r, (_, _, fields, _) in seen.items()}
    answering = [r for r in counters if r not in silent]
    low = min((counters[r] for r in answering), default=0)
    if silent:
        return sorted(silent)
    if len({counters[r] for r in answering}) > 1:
        return sorted(r for r in answering if counters[r] == low)
    waiting = {r for r in answering if "torch/distributed/" in answers[r]}
    return sorted(set(answering) - waiting) if 0 < len(waiting) < len(answering) else []


def _rank_lines(r: int, seen: tuple | None, frames: str | None, silent: bool, mark: str) -> list[str]:
    """The diagnosis's lines about rank ``r``: where it was when last heard of, and where its main thread is now."""
    if seen is None:
        return [
            f"  rank {r}: never started its hang watch: still in the DataModule's setup (or a callback's setup "
            f"before it) when the others had finished theirs{mark}"
        ]
    _, _, fields, _ = seen
    step, pid, host, inside = int(fields[2]), fields[4], fields[5], fields[6] == "1"
    last = f"last finished step {step}" + (f", in step {step + 1}" if inside else "")
    if fields[7] != "training":
        last = PHASES[fields[7]]
    if silent:
        return [
            f"  rank {r} (host {host}, pid {pid}): does not answer (stopped, swapping, or its node is gone); "
            f"when last heard of: {last}{mark}"
        ]
    return [f"  rank {r} (host {host}, pid {pid}): {last}; now at{mark}"] + [f"      {f}" for f in frames.split("\n")]


def _starting(beats: Any, world: int) -> bool:
    """Whether the job is still starting: a rank has not published yet, or one is before the end of its first step
    (each beat's last field is its phase, :data:`PHASES`)."""
    beats = list(beats)
    return len(beats) < world or any(fields[7] != "training" for fields in beats)


def _kill_local_children() -> None:
    """Every descendant of this process (under Lightning's own launcher rank 0 started the other local ranks; the
    loader workers, also those a forkserver started, ``datamodules.base.worker_context``): none outlives it. Read
    from Linux's ``/proc`` (psutil is not a dependency)."""
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid``, children first."""
    found: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(child) for child in children.read_text().split()]
        except OSError:
            continue
    return found + [grandchild for child in list(found) for grandchild in _descendants(child)]


def effective_timeout(hang_timeout: float, launch_timeout: float | None) -> float:
    """The hang timeout a run uses: ``--launch.hang_timeout``, but inside ``--launch.timeout`` when that is shorter
    (a collective timing out first would end the job with torch's message, which names no rank and no place)."""
    if hang_timeout and launch_timeout and hang_timeout >= launch_timeout:
        return max(launch_timeout * 0.5, launch_timeout - 30)
    return hang_timeout


def startup_allowance(hang_timeout: float, given: float | None, launch_timeout: float | None) -> float:
    """The hang watch's allowance while the job starts: ``--launch.startup_timeout``, else twice the hang timeout and
    at least :data:`STARTUP_FLOOR_S`; inside ``--launch.timeout`` as the hang timeout is (:func:`effective_timeout`)."""
    return effective_timeout(given or max(2 * hang_timeout, STARTUP_FLOOR_S), launch_timeout)


def install(
    trainer: Trainer, seconds: float, startup_seconds: float | None = None, requeue: Requeue | None = None
) -> None:
    """Gives ``trainer`` a :class:`HangWatch` of ``seconds`` (the config's, if it lists one, else a new one), and
    ``startup_seconds`` while the job starts: on by default, whatever callbacks a config lists. It does nothing in a
    single-process run. ``requeue``: the command's, called after the watch ended the job."""
    found = [cb for cb in trainer.callbacks if isinstance(cb, HangWatch)]
    if not found:
        found = [HangWatch(seconds, startup_seconds)]
        trainer.callbacks.append(found[0])
    for watch in found:
        watch.timeout = seconds
        watch.startup_timeout = startup_seconds or startup_allowance(seconds, None, None)
        watch.requeue = requeue or watch.requeue
        trainer.callbacks.insert(0, StartEarly(watch))


def apply_flight_recorder(strategy: Any, folder: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Turns the NCCL flight recorder on (``flight_recorder_env``, user values kept) when ``strategy`` will form an
    NCCL process group; returns the variables set. Must run before the process group exists (torch reads them when
    it creates ``ProcessGroupNCCL``)."""
    if getattr(strategy, "world_size", 1) < 2 or process_group_backend(strategy) != "nccl":
        return {}
    return export_unset(flight_recorder_env(folder, environ), environ)
