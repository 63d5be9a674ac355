"""The run's identity, one record written and read here: which TensorBoard version and W&B run a checkpoint belongs
to, which job saved it (a restarted torchrun group or a requeued SLURM job resumes only its own), and the run's whole
configuration (a resumed run compares its own with it).

Every checkpoint the app saves carries it under its own top-level key (:data:`KEY`), whatever class wrote it
(:class:`app.loggers.TrackingConfigCallback` does); the run folder's ``hparams.yaml`` carries the job ids under the same
names (``env.torchrun_job``, ``env.slurm_job``), for a restart that finds no checkpoint yet.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import yaml

from core.env import Launch

KEY = "run_identity"  # the checkpoint's top-level key of the record
JOBS = ("torchrun_job", "slurm_job")  # the record's job ids, as hparams.yaml's env names them too


@dataclass(frozen=True)
class RunIdentity:
    """Who a checkpoint belongs to.

    Attributes:
        tensorboard_version: the TensorBoard version folder (``version_N``) the run writes to.
        wandb_id: the W&B run id.
        torchrun_job: ``TORCHELASTIC_RUN_ID`` of the job that saved it.
        slurm_job: ``SLURM_JOB_ID`` of the job that saved it.
        config: the run's whole configuration as YAML (credentials redacted).
    """

    KEY: ClassVar[str] = KEY  # the checkpoint's top-level key of the record

    tensorboard_version: str | None = None
    wandb_id: str | None = None
    torchrun_job: str | None = None
    slurm_job: str | None = None
    config: str | None = None

    @classmethod
    def of(cls, checkpoint: dict | None) -> RunIdentity:
        """The record saved in ``checkpoint`` (an empty one when it has none)."""
        state = checkpoint or {}
        names = {f.name for f in dataclasses.fields(cls)}
        saved = state.get(KEY)
        if saved is None:
            # saved before the record existed: the state of the config callback of the time (whatever its class was
            # called), the one callback state made of the record's fields only; read, never written
            states = (state.get("callbacks") or {}).values()
            saved = next((s for s in states if isinstance(s, dict) and s and s.keys() <= names), None)
        return cls(**{k: v for k, v in dict(saved or {}).items() if k in names})

    def as_dict(self) -> dict[str, Any]:
        """The fields that are set (a checkpoint stores nothing for the others)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def save_in(self, checkpoint: dict) -> None:
        """Writes the record into ``checkpoint`` (a dict about to be saved)."""
        checkpoint[KEY] = self.as_dict()

    def job(self, key: str) -> str | None:
        """The job id ``key`` (one of :data:`JOBS`) that saved the checkpoint."""
        return getattr(self, key)

    def configuration(self) -> dict | None:
        """The run's configuration as a dict, or None when the checkpoint holds none (an older version wrote it)."""
        return yaml.safe_load(self.config) if isinstance(self.config, str) else None


def jobs_of(launch: Launch) -> dict[str, str | None]:
    """The job ids of this process's job, as the record and ``hparams.yaml`` store them."""
    return {"torchrun_job": launch.torchrun_job, "slurm_job": launch.slurm_job}


def started_by(folder: Path) -> dict[str, str]:
    """The job ids a run folder's ``hparams.yaml`` names (``env``: :func:`app.loggers.environment`); empty when it
    names none or does not read."""
    try:
        env = (yaml.safe_load((folder / "hparams.yaml").read_text()) or {}).get("env") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return {}
    return {key: str(env[key]) for key in JOBS if isinstance(env, dict) and env.get(key) is not None}
