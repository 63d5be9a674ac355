"""Which file ``--ckpt_path last`` and SLURM's requeue resume from, on real folders and files (the functions the
mutation run checks: ``make mutation``); a newest checkpoint that does not read falls back to the newest that does."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace

from app.checkpoint import LAST, CheckpointError, Checkpoints, From, RunIdentity, hpc_checkpoints, resumable_checkpoints
from core.env import Launch
from core.errors import DOCS_URL, error_line

NO_LAUNCHER = Launch()


def apply(config: Namespace, subcommand: str, launch: Launch):
    """The resume decision of a new start (a new reader: nothing read yet) for ``config``, applied to it."""
    return Checkpoints.of(config).apply(config, subcommand, launch)


def resolve_last(config: Namespace, subcommand: str) -> Path | None:
    """``--ckpt_path last`` resolved by the resume decision: its file when ``last`` named one, else None."""
    given = config.ckpt_path
    decision = apply(config, subcommand, NO_LAUNCHER)
    return decision.path if given == "last" else None


def find_last_checkpoint(root: Path, dirpath: Path | None = None) -> Path | None:
    return next((p for p in resumable_checkpoints(root, dirpath) if p.name == f"{LAST}.ckpt"), None)


def hpc_checkpoint(root: Path) -> Path | None:
    return next(iter(hpc_checkpoints(root)), None)


def saved(path: Path, mtime: int, step: int = 0) -> Path:
    """A real (tiny) checkpoint file at ``path``, modified at ``mtime``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step}, path)
    os.utime(path, (mtime, mtime))
    return path


def touch(path: Path, mtime: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    os.utime(path, (mtime, mtime))
    return path


def test_the_last_checkpoint_is_the_newest_run_s_not_the_highest_version(tmp_path):
    assert find_last_checkpoint(tmp_path) is None
    second = touch(tmp_path / "version_2" / "checkpoints" / "last.ckpt", 1_000)
    tenth = touch(tmp_path / "version_10" / "checkpoints" / "last.ckpt", 2_000)  # by name, version_2 would be last
    touch(tmp_path / "version_3" / "checkpoints" / "epoch=1.ckpt", 3_000)  # not a last.ckpt
    touch(tmp_path / "other" / "checkpoints" / "last.ckpt", 4_000)  # not a run folder
    assert find_last_checkpoint(tmp_path) == tenth
    os.utime(second, (5_000, 5_000))  # a resumed run writes into its old folder: the newest file, not the highest N
    assert find_last_checkpoint(tmp_path) == second
    unlogged = touch(tmp_path / "checkpoints" / "last.ckpt", 6_000)  # a run with --trainer.logger false
    assert find_last_checkpoint(tmp_path) == unlogged
    elsewhere = touch(tmp_path.parent / f"{tmp_path.name}_ckpts" / "last.ckpt", 7_000)  # --checkpoint.dirpath
    assert find_last_checkpoint(tmp_path) == unlogged and find_last_checkpoint(tmp_path, elsewhere.parent) == elsewhere


def test_the_hpc_checkpoint_is_the_highest_number_not_the_longest_name(tmp_path):
    assert hpc_checkpoint(tmp_path) is None
    for n in (2, 10, 9):
        touch(tmp_path / f"hpc_ckpt_{n}.ckpt", 1_000 + n)
    touch(tmp_path / "hpc_ckpt_x.ckpt", 5_000)
    assert hpc_checkpoint(tmp_path) == tmp_path / "hpc_ckpt_10.ckpt"


def config(root: Path, ckpt_path: str | None) -> Namespace:
    return Namespace(ckpt_path=ckpt_path, trainer=Namespace(default_root_dir=str(root)))


def test_last_resolves_to_the_file_and_sets_ckpt_path(tmp_path):
    last = saved(tmp_path / "version_0" / "checkpoints" / "last.ckpt", 1_000)
    for subcommand in ("fit", "validate"):
        cfg = config(tmp_path, "last")
        assert resolve_last(cfg, subcommand) == last and cfg.ckpt_path == str(last)
    cfg = config(tmp_path, str(last))  # a file, not "last": nothing to resolve
    assert resolve_last(cfg, "fit") is None and cfg.ckpt_path == str(last)


def test_last_without_a_checkpoint_starts_fit_from_scratch_and_stops_the_others(tmp_path):
    cfg = config(tmp_path, "last")
    assert resolve_last(cfg, "fit") is None and cfg.ckpt_path is None
    cfg = config(tmp_path, "last")
    with pytest.raises(CheckpointError) as stop:
        resolve_last(cfg, "test")
    assert error_line(stop.value) == (
        f"error: --ckpt_path last: no checkpoint found in {tmp_path}/version_*/checkpoints/ or {tmp_path}/checkpoints/ "
        "(runs with --trainer.logger false). Train first with "
        "`python cli.py fit` (same --trainer.default_root_dir), or pass --ckpt_path FILE. "
        f"Help: {DOCS_URL}#checkpoint-last-missing"
    )


def test_last_searches_the_checkpoint_dirpath_too_and_names_every_folder_it_searched(tmp_path, caplog):
    """With --checkpoint.dirpath, "last" is also looked for there; each outcome's line names the folders searched."""
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    root, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    searched = (
        f"{root}/version_*/checkpoints/ or {root}/checkpoints/ (runs with --trainer.logger false) or {elsewhere}/ "
        "(--checkpoint.dirpath)"
    )

    def cfg() -> Namespace:
        return Namespace(
            ckpt_path="last",
            trainer=Namespace(default_root_dir=str(root)),
            checkpoint=Namespace(dirpath=str(elsewhere)),
        )

    fresh = cfg()
    assert resolve_last(fresh, "fit") is None and fresh.ckpt_path is None
    assert f"--ckpt_path last: no last.ckpt in {searched} yet; starting from scratch." in caplog.messages
    with pytest.raises(CheckpointError) as stop:
        resolve_last(cfg(), "validate")
    assert error_line(stop.value).startswith(f"error: --ckpt_path last: no checkpoint found in {searched}. ")
    in_run = saved(root / "version_0" / "checkpoints" / "last.ckpt", 1_000)
    newer = saved(elsewhere / "last.ckpt", 2_000)
    found = cfg()
    assert resolve_last(found, "fit") == newer and found.ckpt_path == str(newer)
    assert f"resume: {newer} (--ckpt_path last: the newest last.ckpt)" in caplog.messages
    os.utime(in_run, (3_000, 3_000))  # the run folder's is the newest now: the dirpath adds a place, it replaces none
    assert resolve_last(cfg(), "fit") == in_run


def test_a_newest_checkpoint_that_does_not_read_falls_back_to_the_newest_that_does_and_is_kept(tmp_path, caplog):
    """A truncated newest last.ckpt (a disk fault): ``last`` resumes the newest intact checkpoint of the run folder
    (here the ``last.previous.ckpt`` each save keeps), with one line naming both; the bad file stays as it is. Past
    every unreadable file and none left: a fit starts from scratch and says so."""
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    folder = tmp_path / "version_0" / "checkpoints"
    previous = saved(folder / "last.previous.ckpt", 1_000, step=10)
    best = saved(folder / "epoch=0-val_acc1=0.9.ckpt", 500, step=5)
    last = saved(folder / "last.ckpt", 2_000, step=20)
    intact = last.read_bytes()
    last.write_bytes(intact[: len(intact) // 2])  # the second half never reached the disk
    os.utime(last, (2_000, 2_000))
    cfg = config(tmp_path, "last")
    assert resolve_last(cfg, "fit") == previous and cfg.ckpt_path == str(previous)
    (line,) = [m for m in caplog.messages if m.startswith("warning: resume:")]
    assert line.startswith(f"warning: resume: {last} (") and f"resuming from {previous}, the newest that reads" in line
    assert line.endswith(f"Help: {DOCS_URL}#checkpoint-corrupt"), line
    kept = folder / "last.ckpt.unreadable"  # out of the way of the next save, never deleted nor rewritten
    assert not last.exists() and kept.read_bytes() == intact[: len(intact) // 2]
    assert f"kept as {kept.name}" in line
    previous.write_bytes(b"not a checkpoint")
    assert resolve_last(config(tmp_path, "last"), "fit") == best  # the next newest that reads
    best.write_bytes(b"")
    fresh = config(tmp_path, "last")
    assert resolve_last(fresh, "fit") is None and fresh.ckpt_path is None
    assert "starting from scratch" in caplog.messages[-2], caplog.messages[-2:]


def test_an_explicit_corrupt_checkpoint_is_refused_never_replaced(tmp_path):
    """``--ckpt_path FILE`` is what the user asked for: the decision is that file, whatever else the folder holds
    (the CLI's check refuses it with one line when it does not read: tests/e2e/test_bad_checkpoints.py)."""
    saved(tmp_path / "version_0" / "checkpoints" / "last.ckpt", 1_000)
    named = tmp_path / "broken.ckpt"
    named.write_bytes(b"PK\x03\x04 truncated")
    cfg = config(tmp_path, str(named))
    decision = apply(cfg, "fit", NO_LAUNCHER)
    assert (decision.path, decision.source, cfg.ckpt_path) == (named, From.FILE, str(named))


def test_a_requeued_slurm_job_resumes_its_own_newest_checkpoint_hpc_or_last(tmp_path):
    """A SLURM job requeued after a fault has no new ``hpc_ckpt``: it resumes its own newest ``last.ckpt`` when that
    is newer than the preemption's ``hpc_ckpt``, never another job's; the first attempt resumes nothing of it."""
    from core.env import detect

    def identity(path: Path, job: str, mtime: int) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        checkpoint: dict = {}
        RunIdentity(slurm_job=job).save_in(checkpoint)
        torch.save(checkpoint, path)
        os.utime(path, (mtime, mtime))
        return path

    hpc = identity(tmp_path / "hpc_ckpt_1.ckpt", "77", 1_000)  # saved at a preemption of job 77
    own = identity(tmp_path / "version_0" / "checkpoints" / "last.ckpt", "77", 2_000)  # later, before a fault
    identity(tmp_path / "version_1" / "checkpoints" / "last.ckpt", "78", 3_000)  # another job's, newer

    def slurm(restarts: int):
        env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": str(restarts), "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
        return detect({**env, "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n1"})

    decision = apply(config(tmp_path, None), "fit", slurm(1))
    assert (decision.path, decision.source) == (own, From.SLURM), decision
    assert decision.why == "SLURM requeue 1: the newest checkpoint of job 77"
    os.utime(hpc, (4_000, 4_000))  # preempted after that save: the hpc_ckpt is the newest state
    assert apply(config(tmp_path, None), "fit", slurm(1)).path == hpc
    os.utime(hpc, (1_000, 1_000))
    assert apply(config(tmp_path, None), "fit", slurm(0)).path == hpc  # a fresh job: the preflight refuses it


def test_a_restart_with_nothing_saved_continues_the_run_folder_its_job_started(tmp_path):
    """Rank 1 stuck while the job started: the attempt ended before any checkpoint. The restarted worker group (and a
    requeued SLURM job) continues the ``version_N`` the job's first attempt started (its ``hparams.yaml`` names the
    job), not a new one; another job's folder, or one with checkpoints, is not taken."""
    from core.env import detect

    def started(version: str, key: str, job: str, mtime: int) -> Path:
        folder = tmp_path / version
        folder.mkdir()
        (folder / "hparams.yaml").write_text(f"model:\n  arch: mnist_lenet\nenv:\n  {key}: '{job}'\n")
        os.utime(folder, (mtime, mtime))
        return folder

    ours = started("version_0", "torchrun_job", "abc", 1_000)
    started("version_1", "torchrun_job", "other", 2_000)  # another job's, newer
    slurm_folder = started("version_2", "slurm_job", "77", 500)

    def torchrun(restarts: int, job: str = "abc"):
        return detect({"TORCHELASTIC_RUN_ID": job, "TORCHELASTIC_RESTART_COUNT": str(restarts), "RANK": "0",
                       "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"})  # fmt: skip

    decision = apply(config(tmp_path, None), "fit", torchrun(1))
    assert (decision.path, decision.run_folder) == (None, ours), decision
    assert decision.describe() == "nothing saved yet; continuing version_0, which this job started"
    assert apply(config(tmp_path, None), "fit", torchrun(0)).run_folder is None  # the first attempt: a new folder
    assert apply(config(tmp_path, None), "fit", torchrun(1, "new")).run_folder is None
    saved(ours / "checkpoints" / "epoch=0.ckpt", 3_000)  # a folder with a checkpoint is resumed from, not continued
    assert apply(config(tmp_path, None), "fit", torchrun(1)).run_folder is None

    env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
    requeued = detect({**env, "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n1"})
    assert apply(config(tmp_path, None), "fit", requeued).run_folder == slurm_folder


def test_a_restart_and_a_requeue_resume_from_the_checkpoint_dirpath(tmp_path):
    """With --checkpoint.dirpath outside the run folder, a restarted torchrun group and a requeued SLURM job find
    their own newest checkpoint there (a fresh start would replace it); another job's newer file is not taken, and
    only the chosen file stays read."""
    from core.env import detect

    root, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"

    def identity(path: Path, mtime: int, **job: str) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        checkpoint: dict = {}
        RunIdentity(**job).save_in(checkpoint)
        torch.save(checkpoint, path)
        os.utime(path, (mtime, mtime))
        return path

    def cfg() -> Namespace:
        return Namespace(ckpt_path=None, trainer=Namespace(default_root_dir=str(root)),
                         checkpoint=Namespace(dirpath=str(elsewhere)))  # fmt: skip

    torchrun_last = identity(elsewhere / "last.ckpt", 1_000, torchrun_job="abc")
    identity(elsewhere / "epoch=0-step=9.ckpt", 2_000, torchrun_job="other")  # another job's, newer
    restarted = detect({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "1", "RANK": "0",
                        "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"})  # fmt: skip
    checkpoints = Checkpoints.of(cfg())
    decision = checkpoints.apply(cfg(), "fit", restarted)
    assert (decision.path, decision.source) == (torchrun_last, From.TORCHRUN), decision
    assert [key[0] for key in checkpoints.reader._reads] == [str(torchrun_last.resolve())]

    slurm_last = identity(elsewhere / "last.ckpt", 3_000, slurm_job="77")
    env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
    requeued = detect({**env, "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n1"})
    decision = apply(cfg(), "fit", requeued)
    assert (decision.path, decision.source) == (slurm_last, From.SLURM), decision


def test_a_checkpoint_gone_since_it_was_listed_is_passed_over_not_a_traceback(tmp_path):
    """Another rank moved the file aside between the listing and the read: it does not read, with the reason."""
    read = Checkpoints().read(tmp_path / "version_0" / "checkpoints" / "last.ckpt")
    assert read.state is None and read.problem.startswith("FileNotFoundError: "), read


def test_a_restart_of_a_run_started_from_a_file_continues_its_own_newer_checkpoint(tmp_path):
    """``--ckpt_path FILE`` names where the job starts: its first attempt loads FILE; a restarted group or a requeued
    job continues from its own newest checkpoint (reloading FILE would lose every step since), and from FILE only
    while it has saved none."""
    from core.env import detect

    start = saved(tmp_path / "elsewhere" / "start.ckpt", 500, step=5)
    root = tmp_path / "runs"

    def given() -> Namespace:
        return Namespace(ckpt_path=str(start), trainer=Namespace(default_root_dir=str(root)))

    def torchrun(restarts: int):
        return detect({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": str(restarts), "RANK": "0",
                       "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"})  # fmt: skip

    def requeued(restarts: int):
        env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": str(restarts), "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
        return detect({**env, "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n1"})

    for launch in (torchrun(0), torchrun(1), requeued(0), requeued(1)):  # nothing saved yet: the file
        decision = apply(given(), "fit", launch)
        assert (decision.path, decision.source) == (start, From.FILE), (launch, decision)

    for job, launch in ((dict(torchrun_job="abc"), torchrun(1)), (dict(slurm_job="77"), requeued(1))):
        checkpoint: dict = {"global_step": 40}
        RunIdentity(**job).save_in(checkpoint)
        own = root / "version_0" / "checkpoints" / "last.ckpt"
        own.parent.mkdir(parents=True, exist_ok=True)
        torch.save(checkpoint, own)
        os.utime(own, (1_000, 1_000))
        config = given()
        decision = apply(config, "fit", launch)
        assert decision.path == own and decision.source in (From.TORCHRUN, From.SLURM), decision
        assert config.ckpt_path == str(own)
    assert apply(given(), "fit", torchrun(0)).path == start  # the first attempt of a new job: the file
