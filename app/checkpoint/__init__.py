"""A run's checkpoints, one package with one front door (:class:`Checkpoints`), split by job:

- :mod:`~app.checkpoint.io`: the format and the atomic write (:class:`AtomicCheckpointIO`, the base configuration's
  checkpoint I/O: ``class_path: app.checkpoint.AtomicCheckpointIO``), a full disk said in one line;
- :mod:`~app.checkpoint.files`: the SHA-256 saved beside each file;
- :mod:`~app.checkpoint.background`: saves written by a thread while training goes on (:class:`BackgroundSaves`);
- :mod:`~app.checkpoint.local_copy`: the node-local copy of ``last.ckpt`` a restart on the same node reads;
- :mod:`~app.checkpoint.reading`: each file read and verified once per start, ``--ckpt_path FILE`` checked;
- :mod:`~app.checkpoint.identity`: the run identity every checkpoint carries;
- :mod:`~app.checkpoint.manager`: the run folder's layout and the resume decision (:class:`Checkpoints`).

The callbacks, the SIGTERM and requeue handling, the CLI and the preflight ask these; nothing outside this package
``torch.load``-s a run's checkpoint. The random generator states of a checkpoint are :class:`app.callbacks.RNGState`'s.
"""

from app.checkpoint.background import BackgroundSaves
from app.checkpoint.identity import RunIdentity
from app.checkpoint.io import AtomicCheckpointIO, DiskFullError
from app.checkpoint.manager import Checkpoints, From, Resume
from app.checkpoint.reading import CheckpointError, UnsafeCheckpointError

__all__ = [
    "AtomicCheckpointIO",
    "BackgroundSaves",
    "CheckpointError",
    "Checkpoints",
    "DiskFullError",
    "From",
    "Resume",
    "RunIdentity",
    "UnsafeCheckpointError",
]
