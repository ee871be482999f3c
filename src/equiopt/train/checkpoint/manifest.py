"""The manifest and the verification of a checkpoint against it.

``manifest.json`` records the name, size and SHA-256 of every other file of a
checkpoint, and a SHA-256 of that list itself. A checkpoint is *damaged* when a file
is missing, shorter or longer than written, or its bytes changed, or when the
manifest, ``checkpoint.json`` or ``.metadata`` cannot be read. Checkpoints of earlier
versions (no manifest, and ``checkpoint.json`` not naming one) get the readability
checks only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .collectives import _all_gather_object, _dist_state
from .dcp_metadata import _read_metadata
from .errors import CheckpointError
from .files import MANIFEST, META, _step_dirs, _write_json

MANIFEST_FORMAT = 1
_CHUNK = 1 << 22


def _hash_file(path: Path) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of a file."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def _files_digest(files: Mapping[str, Any]) -> str:
    text = json.dumps(files, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _write_manifest(path: Path, files: Mapping[str, Any]) -> None:
    files = {name: dict(files[name]) for name in sorted(files)}
    _write_json(
        path / MANIFEST,
        {"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": files, "digest": _files_digest(files)},
    )


def _read_manifest(path: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """``(files, problems)`` of a checkpoint's manifest; ``files`` None when there is no
    usable manifest (a checkpoint of an earlier version has none, and no problem then)."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        meta = None
    try:
        raw = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        if isinstance(meta, dict) and "manifest" not in meta:
            return None, []  # written before checkpoints had manifests
        return None, [f"{MANIFEST} is missing"]
    except OSError as err:
        return None, [f"{MANIFEST} cannot be read ({err.strerror or err})"]
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        ok = (
            isinstance(files, dict)
            and manifest.get("digest") == _files_digest(files)
            and all(
                isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
                for v in files.values()
            )
        )
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        return None, [f"{MANIFEST} is damaged (its own checksum does not match)"]
    if int(manifest.get("format", 0)) > MANIFEST_FORMAT or manifest.get("algorithm") != "sha256":
        return None, [
            f"{MANIFEST} has format {manifest.get('format')!r} ({manifest.get('algorithm')!r}), "
            f"newer than this equiopt reads"
        ]
    return files, []


def _check_files(path: Path, files: Mapping[str, Any], names: list[str]) -> list[str]:
    problems = []
    for name in names:
        want = files[name]
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if size < want["size"]:
            problems.append(f"{name} is truncated ({size} of {want['size']} bytes)")
        elif size > want["size"]:
            problems.append(f"{name} has {size} bytes, {want['size']} were written")
        elif _hash_file(path / name)["sha256"] != want["sha256"]:
            problems.append(f"{name} is damaged (its SHA-256 differs from the one recorded at save time)")
    return problems


def _check_readable(path: Path, skip: set[str]) -> list[str]:
    """Whether ``checkpoint.json`` parses and ``.metadata`` unpickles (safely)."""
    problems = []
    if META not in skip:
        try:
            json.loads((path / META).read_text())
        except FileNotFoundError:
            problems.append(f"{META} is missing")
        except (OSError, ValueError) as err:
            problems.append(f"{META} is unreadable ({err})")
    if ".metadata" not in skip:
        try:
            _read_metadata(path)
        except FileNotFoundError:
            problems.append(".metadata is missing")
        except CheckpointError as err:
            problems.append(f".metadata: {err}")
        except Exception as err:  # a damaged pickle raises whatever the bytes make it raise
            problems.append(f".metadata is unreadable ({type(err).__name__}: {err})")
    return problems


def _problems(path: Path, share: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with the checkpoint ``path`` (empty: intact). With ``share=(i, n)``
    this process hashes only every n-th file from the i-th (the ranks split the work);
    the manifest and the readability checks are done by share 0."""
    index, count = share
    if not path.is_dir():
        return [f"{path} is not a directory"] if index == 0 else []
    files, problems = _read_manifest(path)
    if files is None:
        if problems:
            return problems if index == 0 else []
        return _check_readable(path, set()) if index == 0 else []  # an earlier version's checkpoint
    names = sorted(files)
    problems = _check_files(path, files, names[index::count])
    if index == 0:
        for required in (META, ".metadata"):
            if required not in files:
                problems.append(f"{MANIFEST} does not list {required}")
        problems += _check_readable(path, {p.split(" ", 1)[0] for p in problems})
    return problems


def _problems_everywhere(path: Path) -> list[str]:
    """:func:`_problems` with the hashing shared by the ranks; every rank gets the union."""
    rank, world, _ = _dist_state()
    found = _all_gather_object(_problems(path, (rank, world)))
    out: list[str] = []
    for problems in found:
        out.extend(p for p in problems if p not in out)
    return out


def check_checkpoint(path: str | Path) -> list[str]:
    """What is damaged in the checkpoint directory ``path``: one line per problem (a file
    missing, truncated, grown or changed since it was saved; an unreadable manifest,
    ``checkpoint.json`` or ``.metadata``). Empty when the checkpoint is intact. Reads every
    byte of the checkpoint in this process.

    Args:
        path: a checkpoint directory (``.../checkpoints/step_00001000``).

    Returns:
        One line per problem; empty when the checkpoint is intact.
    """
    return _problems(Path(path))


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest intact checkpoint of ``directory`` (following ``latest``; verified), or None.

    Args:
        directory: a run's checkpoint directory (``<out_dir>/checkpoints``).

    Returns:
        The checkpoint's path, or None when there is no intact one.
    """
    for path in _step_dirs(Path(directory)):
        if not _problems(path):
            return path
    return None


def _intact_names(directory: Path, skip: Path | None = None) -> list[str]:
    return [p.name for p in _step_dirs(directory) if p != skip and not _problems(p)]


def _damage(path: Path, problems: list[str]) -> str:
    return f"{path} is damaged: " + "; ".join(problems)


def _damaged_message(path: Path, problems: list[str]) -> str:
    intact = _intact_names(path.parent, skip=path)
    where = (
        f"intact checkpoints in {path.parent}: {', '.join(intact)}"
        if intact
        else f"there is no intact checkpoint in {path.parent}"
    )
    return f"{_damage(path, problems)}. It cannot be resumed; {where}"
