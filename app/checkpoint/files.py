"""What a checkpoint file leaves beside it: its SHA-256 (``<name>.sha256``, the format of ``sha256sum``: ``sha256sum -c
last.ckpt.sha256`` checks it by hand), written atomically, with the permissions the process's umask gives any file."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from core.files import replaced_atomically


class Hashing:
    """A binary file that also feeds every byte written to a SHA-256 (``torch.save`` writes its zip sequentially)."""

    def __init__(self, file: Any) -> None:
        self.file, self.sha256 = file, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def checksum_path(path: Path) -> Path:
    """Where the SHA-256 of checkpoint ``path`` is kept: ``<name>.sha256``, in the format of ``sha256sum``."""
    return path.with_name(f"{path.name}.sha256")


def write_checksum(path: Path, digest: str) -> None:
    """Writes ``digest`` as ``path``'s checksum file, atomically (the file or its previous version, never half)."""
    with replaced_atomically(checksum_path(path), durable=False) as tmp:
        tmp.write_text(f"{digest}  {path.name}\n")


def recorded_checksum(path: Path) -> str | None:
    """The SHA-256 saved with ``path``, or None when it has none (a file saved by another tool or version)."""
    try:
        text = checksum_path(path).read_text().split()
    except (OSError, UnicodeDecodeError):
        return None
    return text[0].lower() if text and len(text[0]) == 64 else None


def file_checksum(path: Path) -> str:
    """The SHA-256 of ``path``'s bytes as they are on disk now."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def megabytes(size: float) -> str:
    return f"{size / 1e6:.1f} MB"
