"""A run's checkpoints, one package with one front door (:class:`Checkpoints`, :mod:`~app.checkpoint.manager`) that
stands on the rest, split by job:

- :mod:`~app.checkpoint.resume`: which checkpoint a run resumes from, one record (:class:`Resume`);
- :mod:`~app.checkpoint.against_config`, :mod:`~app.checkpoint.changed_settings`: a checkpoint against the
  configuration (another network, weights that do not fit; the settings a resumed fit changed);
- :mod:`~app.checkpoint.io`: the format and the atomic save (:class:`AtomicCheckpointIO`, the base configuration's
  checkpoint I/O: ``class_path: app.checkpoint.AtomicCheckpointIO``), a full disk said in one line;
- :mod:`~app.checkpoint.reading`: each file read and verified once per start, ``--ckpt_path FILE`` checked;
- :mod:`~app.checkpoint.background`: saves written by a thread while training goes on (:class:`BackgroundSaves`);
- :mod:`~app.checkpoint.local_copy`: the node-local copy of ``last.ckpt`` a restart on the same node reads;
- :mod:`~app.checkpoint.disk`: a checkpoint's size before it exists, and the room for it;
- :mod:`~app.checkpoint.names`, :mod:`~app.checkpoint.files`, :mod:`~app.checkpoint.identity`: the run folder's
  layout and file names, the SHA-256 saved beside each file, the run identity every checkpoint carries.

Code outside this package imports from here only; nothing outside it ``torch.load``-s a run's checkpoint. The random
generator states of a checkpoint are :class:`app.callbacks.RNGState`'s.
"""

from app.checkpoint.background import BackgroundSaves, atomic_io
from app.checkpoint.files import recorded_checksum
from app.checkpoint.identity import RunIdentity, jobs_of
from app.checkpoint.io import AtomicCheckpointIO, DiskFullError
from app.checkpoint.local_copy import LocalCopies, remove_local_copies, restarts_in_place
from app.checkpoint.manager import Checkpoints
from app.checkpoint.names import (
    LAST,
    hpc_checkpoints,
    last_checkpoint_of,
    local_folder,
    local_root,
    resumable_checkpoints,
    run_folder,
    version_of,
)
from app.checkpoint.reading import CheckpointError, UnsafeCheckpointError, readable_copy
from app.checkpoint.resume import From, Resume

__all__ = [
    "LAST",
    "AtomicCheckpointIO",
    "BackgroundSaves",
    "CheckpointError",
    "Checkpoints",
    "DiskFullError",
    "From",
    "LocalCopies",
    "Resume",
    "RunIdentity",
    "UnsafeCheckpointError",
    "atomic_io",
    "hpc_checkpoints",
    "jobs_of",
    "last_checkpoint_of",
    "local_folder",
    "local_root",
    "readable_copy",
    "recorded_checksum",
    "remove_local_copies",
    "resumable_checkpoints",
    "restarts_in_place",
    "run_folder",
    "version_of",
]
