"""Atomic checkpoints: a kill at any moment leaves the previous checkpoint loadable.

Layout: ``DIR/step_00001000.pt`` files and a ``DIR/latest`` pointer. A checkpoint is
written to a temporary file in the same directory, flushed and fsynced, then renamed
into place (atomic on POSIX), and only then is ``latest`` replaced the same way. A
reader follows ``latest``; if it is missing or names an unreadable file it falls back
to the newest checkpoint that loads.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

POINTER = "latest"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, write) -> None:
    """Call ``write(fileobj)`` on a temporary file, fsync it, and rename it to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def save_checkpoint(directory: str | Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``state`` as ``step_<step>.pt`` atomically, point ``latest`` at it, keep the newest ``keep``."""
    directory = Path(directory)
    path = directory / f"step_{step:08d}.pt"
    atomic_write_bytes(path, lambda f: torch.save(state, f))
    atomic_write_bytes(directory / POINTER, lambda f: f.write(path.name.encode()))
    if keep > 0:
        for old in sorted(directory.glob("step_*.pt"))[:-keep]:
            old.unlink(missing_ok=True)
    return path


def load_checkpoint(directory: str | Path, map_location: Any = "cpu") -> tuple[Path, dict[str, Any]] | None:
    """The newest loadable checkpoint in ``directory`` as ``(path, state)``, or None if there is none."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    candidates = sorted(directory.glob("step_*.pt"), reverse=True)
    pointer = directory / POINTER
    if pointer.exists():
        named = directory / pointer.read_text().strip()
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    for path in candidates:
        try:
            return path, torch.load(path, map_location=map_location, weights_only=False)
        except Exception:  # a truncated or foreign file: try the next one
            continue
    return None
