"""The front door of a run's checkpoints (:class:`Checkpoints`): the CLI asks it once, before anything is built, what
the run resumes from (:meth:`Checkpoints.prepare`: one :class:`~app.checkpoint.resume.Resume` record), and hands it
the Trainer once it exists (:meth:`Checkpoints.attach`). The folders and file names are :mod:`app.checkpoint.names`',
the search :mod:`app.checkpoint.resume`'s, the checks against the configuration :mod:`app.checkpoint.against_config`'s.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info

from app.checkpoint.against_config import (
    check_arch,
    check_fits,
    evaluation_dirpath,
    saved_hparams,
    weights_from_checkpoint,
)
from app.checkpoint.changed_settings import ChangedSettings
from app.checkpoint.disk import checkpoint_estimate, low_disk_space
from app.checkpoint.identity import RunIdentity
from app.checkpoint.io import AtomicCheckpointIO
from app.checkpoint.names import unreadable
from app.checkpoint.resume import From, Resume, ResumeSearch
from core.env import Launch

NAMED = ("last", "best", "hpc", "registry")  # --ckpt_path names resolved later (by the search, or by Lightning)


class Checkpoints(ResumeSearch):
    """A run's checkpoints: the one object the CLI, the loggers and the preflight ask where they are, what each holds
    (each file read at most once: :class:`~app.checkpoint.reading.Reader`) and which one the run resumes from.

    Args:
        default_root_dir: the run folder (``trainer.default_root_dir``).
        dirpath: ``--checkpoint.dirpath``, searched for ``last`` too.
        trust: ``--trust_checkpoint``: read with full unpickling.
    """

    @classmethod
    def of(cls, config: Any) -> Checkpoints:
        """The checkpoints of the run a parsed subcommand config describes."""
        dirpath = (config.get("checkpoint") or {}).get("dirpath")
        return cls(config.trainer.get("default_root_dir"), dirpath, bool(config.get("trust_checkpoint")))

    @classmethod
    def prepare(cls, config: Any, subcommand: str | None, launch: Launch | None) -> Resume:
        """The whole resume decision for a parsed subcommand config, before anything is built: ``--ckpt_path FILE``
        read and checked (missing, truncated, unsafe, another ``model.arch``: one :class:`CheckpointError` each),
        what the run resumes from (:meth:`apply`), the state it loads (read once) and the hyperparameters of the
        given file. The CLI applies those as LightningCLI does, then lets :meth:`configure` set what the
        configuration takes from the checkpoint.

        Lightning's own ``--ckpt_path`` handling loads the file with a traceback for a missing, truncated or unsafe
        file, and silently replaces a configured ``model.arch`` by the checkpoint's.

        ``launch`` None (``tools.slurm submit``, which only parses): the given file is read and checked, and nothing
        is decided: what a job resumes from is the job's to decide on its node, and the plan asks ``decide``.
        """
        checkpoints = cls.of(config)
        path = config.get("ckpt_path")
        given = None
        if subcommand and path and path not in NAMED and "://" not in str(path):
            given = checkpoints.reader.given(path)
            check_arch(given, path, config.model.get("arch"))
        if launch is None:
            return Resume(None, "decided by the job", hparams=saved_hparams(given) if given is not None else {})
        resume = checkpoints.apply(config, subcommand, launch)
        resume.reader, resume.subcommand = checkpoints.reader, subcommand
        resume.hparams = saved_hparams(given) if given is not None else {}
        resume.state = resume.state if resume.state is not None else given
        path = config.get("ckpt_path")  # the file the search found
        if resume.state is None and path and Path(path).is_file():
            resume.state = checkpoints.reader.given(path)
        return resume

    @staticmethod
    def configure(resume: Resume, config: Any) -> None:
        """What the configuration takes from the checkpoint the run loads: not the pretrained ``model.weights``
        (the checkpoint holds the network's), and outside ``fit`` the folder the checkpoint was saved in."""
        if resume.state is None:
            return
        weights_from_checkpoint(config)
        if resume.subcommand not in (None, "fit"):
            evaluation_dirpath(config, resume.state)

    @staticmethod
    def plugin(resume: Resume, configured: CheckpointIO) -> CheckpointIO:
        """The run's checkpoint I/O, built from the record: the configured :class:`AtomicCheckpointIO` with the
        run's trust (``--trust_checkpoint``) and the reader that read the checkpoint, so Lightning's load takes what
        the run read already (any other plugin is kept as configured)."""
        if not isinstance(configured, AtomicCheckpointIO) or resume.reader is None:
            return configured
        io = copy.copy(configured)  # its class and settings (a subclass of it stays one)
        io.weights_only, io.reader = configured.weights_only and not resume.reader.trust, resume.reader
        return io

    @classmethod
    def attach(
        cls, resume: Resume, trainer: Trainer, model: torch.nn.Module, config: Any, current: Callable[[], dict]
    ) -> None:
        """Once the Trainer and the model exist: the checkpoint I/O built from the record (:meth:`plugin`); the
        loaded checkpoint checked against the model, before the Trainer's ``load_state_dict`` error wall; for a fit,
        the settings changed since the checkpoint's run (:class:`ChangedSettings`, ``current``: this run's
        configuration as a checkpoint keeps it) and a warning when the disk has room for too few checkpoints."""
        trainer.strategy.checkpoint_io = cls.plugin(resume, trainer.strategy.checkpoint_io)
        fitting = resume.subcommand == "fit"
        if resume.state is not None:
            check_fits(resume.state, config.ckpt_path, model, model.hparams.get("arch"))
        if fitting and resume.state is not None:
            trainer.callbacks.append(ChangedSettings(RunIdentity.of(resume.state).configuration(), current()))
        if fitting and trainer.checkpoint_callback is not None:
            factory = getattr(model, "optimizer_factory", None)
            optimizer = factory(model.parameters()) if callable(factory) else None
            if warning := low_disk_space(trainer.default_root_dir, checkpoint_estimate(model, optimizer)):
                rank_zero_info(warning)

    def apply(self, config: Any, subcommand: str | None, launch: Launch) -> Resume:
        """:meth:`decide` for ``config.ckpt_path``, then ``config.ckpt_path`` set to the file it found in the run
        folder (None for a fresh start); rank 0 says what it chose and moves the files passed over out of the way."""
        decision = self.decide(config.get("ckpt_path"), subcommand, launch)
        self.reader.keep_only(decision.path)  # the files passed over are not held open for the whole run
        if decision.run_folder is not None:
            rank_zero_info(f"resume: {decision.why}")
        if not decision.source.found_here:  # a file or name given, or nothing to resume
            return decision
        config.ckpt_path = str(decision.path) if decision.path is not None else None
        if line := decision.fallback_line():
            rank_zero_info(line)
            if launch.rank == 0:  # out of the way of this run's saves (a new last.ckpt would replace it), never deleted
                for path, _ in decision.passed_over:
                    with contextlib.suppress(OSError):
                        os.replace(path, unreadable(path))
        if decision.path is not None:
            rank_zero_info(f"resume: {decision.describe()}")
        elif decision.source is From.LAST:
            rank_zero_info(f"{decision.why}; starting from scratch.")
        return decision
