"""Which file ``--ckpt_path last`` and SLURM's requeue resume from, on real folders and files (the functions the
mutation run checks: ``make mutation``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from jsonargparse import Namespace

from app.checkpoint import find_last_checkpoint, hpc_checkpoint, resolve_last
from core.errors import DOCS_URL


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
    last = touch(tmp_path / "version_0" / "checkpoints" / "last.ckpt", 1_000)
    for subcommand in ("fit", "validate"):
        cfg = config(tmp_path, "last")
        assert resolve_last(cfg, subcommand) == last and cfg.ckpt_path == str(last)
    cfg = config(tmp_path, str(last))  # a file, not "last": nothing to resolve
    assert resolve_last(cfg, "fit") is None and cfg.ckpt_path == str(last)


def test_last_without_a_checkpoint_starts_fit_from_scratch_and_stops_the_others(tmp_path):
    cfg = config(tmp_path, "last")
    assert resolve_last(cfg, "fit") is None and cfg.ckpt_path is None
    cfg = config(tmp_path, "last")
    with pytest.raises(SystemExit) as stop:
        resolve_last(cfg, "test")
    assert str(stop.value.code) == (
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
    with pytest.raises(SystemExit) as stop:
        resolve_last(cfg(), "validate")
    assert str(stop.value.code).startswith(f"error: --ckpt_path last: no checkpoint found in {searched}. ")
    in_run = touch(root / "version_0" / "checkpoints" / "last.ckpt", 1_000)
    newer = touch(elsewhere / "last.ckpt", 2_000)
    found = cfg()
    assert resolve_last(found, "fit") == newer and found.ckpt_path == str(newer)
    assert f"--ckpt_path last resolved to {newer}" in caplog.messages
    os.utime(in_run, (3_000, 3_000))  # the run folder's is the newest now: the dirpath adds a place, it replaces none
    assert resolve_last(cfg(), "fit") == in_run
