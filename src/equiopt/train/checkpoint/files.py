"""The checkpoint files on disk: their names, atomic writes, listing and rotation.

A run's checkpoint directory holds ``step_<8 digits>/`` checkpoints and a ``latest``
pointer naming one. Every file is written to a temporary file, fsynced and renamed;
hidden (``.``-prefixed) directories are saves or deletions under way, which readers
ignore and the next save removes. A checkpoint is deleted by hiding it first (one
rename), so a crash never leaves a visible half.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

POINTER = "latest"
META = "checkpoint.json"
MANIFEST = "manifest.json"
_PREFIX = "step_"


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
    path = Path(path)
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


def _write_json(path: Path, obj: Any) -> None:
    data = json.dumps(obj, indent=1, allow_nan=True).encode()
    atomic_write_bytes(path, lambda f: f.write(data))


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(_PREFIX):
        return None
    try:
        return int(name[len(_PREFIX) :])
    except ValueError:
        return None


def _complete(path: Path) -> bool:
    return path.is_dir() and _step_of(path) is not None and (path / ".metadata").is_file() and (path / META).is_file()


def _is_checkpoint(path: Path) -> bool:
    """Whether ``path`` names one checkpoint (rather than a directory of checkpoints)."""
    return _step_of(path) is not None or any((path / name).exists() for name in (META, MANIFEST, ".metadata"))


def _pointed(directory: Path) -> str | None:
    try:
        return (directory / POINTER).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _step_dirs(directory: Path) -> list[Path]:
    """Every (visible) checkpoint directory, complete or not: the one ``latest`` names first, then newest first."""
    if not directory.is_dir():
        return []
    found = sorted(
        (p for p in directory.iterdir() if p.is_dir() and _step_of(p) is not None),
        key=lambda p: _step_of(p),
        reverse=True,
    )
    named = _pointed(directory)
    if named is not None and (directory / named) in found:
        found.remove(directory / named)
        found.insert(0, directory / named)
    return found


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoints in ``directory`` that have their files' names (not verified; see
    :func:`check_checkpoint`): the one ``latest`` names first, then newest first."""
    return [p for p in _step_dirs(Path(directory)) if _complete(p)]


def _clear_leftovers(directory: Path) -> None:
    """Remove what crashed saves and deletions left: hidden ``.step_*`` directories and
    temporary ``latest`` pointers."""
    for p in directory.iterdir():
        if p.name.startswith("." + _PREFIX) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(f".{POINTER}.") and p.name.endswith(".tmp") and p.is_file():
            p.unlink(missing_ok=True)


def _remove(path: Path) -> None:
    """Delete a checkpoint: hide it first (one rename), so that a crash leaves no visible half."""
    hidden = path.parent / f".{path.name}.deleted"
    shutil.rmtree(hidden, ignore_errors=True)
    try:
        os.replace(path, hidden)
    except OSError:
        hidden = path
    shutil.rmtree(hidden, ignore_errors=True)
