"""Distributed, atomic, self-verifying checkpoints with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``DIR/step_00001000/`` holding

- the tensors (model weights, optimizer state) in DCP's format (``.metadata`` and one
  ``__<rank>_0.distcp`` file per rank that wrote data); each rank writes its own shards,
  and a checkpoint loads at any world size and under any strategy (one process, DDP,
  FSDP2): DCP reads whatever slices each loading rank needs;
- ``checkpoint.json``: plain data (step, tokens, scheduler, data position, optimizer
  hyperparameters, config, the world size that wrote it);
- ``rank_<r>.json``: per-rank plain data (RNG states), one file per writing rank;
- ``manifest.json``: the name, size and SHA-256 of every other file of the checkpoint,
  and a SHA-256 of that list itself.

Nothing is unpickled on load beyond DCP's own metadata, which is read with an
unpickler that accepts only DCP's metadata classes, ``torch.Size``, dtypes and paths;
tensors are read with ``weights_only=True`` and any pickled object entry is refused.

Atomicity: every rank writes into ``DIR/.step_00001000.partial/`` (files fsynced), then
rank 0 fsyncs it, renames it to ``step_00001000`` and only then replaces the ``latest``
pointer (itself written to a temporary file, fsynced and renamed). A crash at any
moment leaves either the old checkpoint or the new one complete: readers ignore hidden
(``.partial``) directories, and the next save removes what crashed saves left.

Integrity: each rank hashes the files it wrote itself (its DCP data files and its
``rank_<r>.json``), so no rank reads another's bytes; the hashes are gathered on rank 0,
which adds ``.metadata``, ``checkpoint.json`` and any file no rank claimed and writes
``manifest.json`` into the partial directory before the rename: the manifest is part of
the atomic unit. Loading verifies the manifest first (under torch.distributed the ranks
share the hashing, each a slice of the files, and agree on the result): a file that is
missing, shorter or longer than written, or whose bytes changed makes the checkpoint
*damaged*. :func:`load_checkpoint` on a run's checkpoint directory then falls back to the
newest intact checkpoint with a :class:`CheckpointWarning` naming the damaged one; on one
checkpoint directory it raises a :class:`CheckpointError` that says what is damaged and
which checkpoints beside it are intact. Checkpoints of earlier versions (no manifest, and
``checkpoint.json`` not naming one) load with the structural checks only.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

POINTER = "latest"
META = "checkpoint.json"
MANIFEST = "manifest.json"
FORMAT = 1
MANIFEST_FORMAT = 1
_PREFIX = "step_"
_CHUNK = 1 << 22

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "check_checkpoint",
    "read_checkpoint",
    "atomic_write_bytes",
    "POINTER",
    "META",
    "MANIFEST",
]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read as asked; the message says which and why."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an older intact one."""


# ----------------------------------------------------------------------- files
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


# ----------------------------------------------------------------- distributed
def _dist_state() -> tuple[int, int, bool]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` (plain data) on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather_object(value: Any) -> list[Any] | None:
    """Every rank's ``value`` (plain data), in rank order, on rank 0; None on the other ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, out, dst=0)
    return out


def _all_gather_object(value: Any) -> list[Any]:
    """Every rank's ``value`` (plain data), in rank order, on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# ------------------------------------------------------------- safe DCP reading
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: its own classes, ``torch.Size``, dtypes and paths only."""

    def find_class(self, module: str, name: str):
        if module == "torch.distributed.checkpoint" or module.startswith("torch.distributed.checkpoint."):
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type):
                return obj
        elif module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise CheckpointError(
            f"checkpoint metadata refers to {module}.{name}; refusing to unpickle it "
            f"(equiopt checkpoints hold only tensors and plain data)"
        )


def _read_metadata(path: Path, name: str = ".metadata"):
    with open(path / name, "rb") as f:
        return _MetadataUnpickler(f).load()


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            rank = kwargs.get("rank")
            metadata = _read_metadata(Path(self.path), ".metadata" if rank is None else f"__{rank}.metadata")
            try:
                from torch.distributed.checkpoint.metadata import StorageMeta

                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
            except ImportError:  # pragma: no cover - older torch without StorageMeta
                pass
            return metadata

    return SafeFileSystemReader(str(path))


def _load_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class TensorOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            raise CheckpointError(
                f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; "
                f"equiopt checkpoints hold only tensors and refuse to unpickle it"
            )

    return TensorOnlyLoadPlanner()


def _check_tensors(tree: Mapping[str, Any], where: str = "") -> None:
    for key, value in tree.items():
        here = f"{where}.{key}" if where else str(key)
        if isinstance(value, Mapping):
            _check_tensors(value, here)
        elif not torch.is_tensor(value):
            raise CheckpointError(
                f"checkpoint entry {here!r} is a {type(value).__name__}, not a tensor; "
                f"put plain data into the JSON extras instead"
            )


@contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when torch.distributed is not initialised: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch.distributed is disabled, unavailable or uninitialized.*")
        yield


def _writer(path: Path):
    """DCP's file writer that records the files this rank wrote (for the manifest)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class RecordingFileSystemWriter(FileSystemWriter):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.written: list[str] = []

        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)

            def record(done) -> None:
                try:
                    results = done.value()
                except BaseException:  # the save fails anyway; nothing to record
                    return
                for result in results:
                    name = getattr(getattr(result, "storage_data", None), "relative_path", None)
                    if isinstance(name, str) and name not in self.written:
                        self.written.append(name)

            future.add_done_callback(record)
            return future

    return RecordingFileSystemWriter(str(path), sync_files=True)


def _dcp_failure(err: BaseException) -> str:
    """One line per failed rank of DCP's ``CheckpointException`` (its message is a raw traceback)."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, Mapping) or not failures:
        return f"{type(err).__name__}: {err}"
    lines = []
    for rank, failure in sorted(failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        lines.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    return "; ".join(lines)


def _inner_error(err: BaseException) -> CheckpointError | None:
    """Our own :class:`CheckpointError` raised inside DCP (e.g. by the load planner), if any."""
    for failure in (getattr(err, "failures", None) or {}).values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, CheckpointError):
            return exc
    return None


# ------------------------------------------------------------------ manifest
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


# ------------------------------------------------------------------- listing
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


# ---------------------------------------------------------------------- save
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


def save_checkpoint(
    directory: str | Path,
    step: int,
    tensors: Mapping[str, Any],
    extras: Mapping[str, Any] | None = None,
    rank_extras: Mapping[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write ``step_<step>`` atomically with its manifest and point ``latest`` at it;
    collective under torch.distributed.

    ``tensors``: a nested dict of tensors or DTensors (each rank passes its own shards);
    ``extras``: JSON-serialisable data, taken from rank 0; ``rank_extras``: JSON data of
    this rank (e.g. its RNG state). Keeps the newest ``keep`` checkpoints (0: all).

    Args:
        directory: the run's checkpoint directory.
        step: the step the checkpoint holds; names it ``step_<step>`` (eight digits).
        tensors: this rank's tensors, a nested dict.
        extras: JSON data of the run, from rank 0.
        rank_extras: JSON data of this rank.
        keep: how many checkpoints to keep (0: all).

    Returns:
        The checkpoint's directory.
    """
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    rank, world, distributed = _dist_state()
    _check_tensors(tensors)
    final = directory / f"{_PREFIX}{step:08d}"
    partial = directory / f".{final.name}.partial"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        _clear_leftovers(directory)
        partial.mkdir()
    _barrier()
    writer = _writer(partial)
    with _quiet_single_process():
        dcp.save(dict(tensors), storage_writer=writer, no_dist=not distributed)
    mine = list(writer.written)
    if rank_extras is not None:
        _write_json(partial / _rank_file(rank), dict(rank_extras))
        mine.append(_rank_file(rank))
    # each rank hashes what it wrote; rank 0 gathers the hashes (this is also the barrier)
    gathered = _gather_object({name: _hash_file(partial / name) for name in mine})
    if rank == 0:
        meta = {"format": FORMAT, "step": int(step), "world_size": world, "manifest": MANIFEST, **(dict(extras or {}))}
        _write_json(partial / META, meta)
        files: dict[str, Any] = {}
        for entries in gathered or ():
            files.update(entries)
        for p in sorted(partial.iterdir()):  # .metadata, checkpoint.json, anything no rank claimed
            if p.is_file() and p.name not in files and p.name != MANIFEST:
                files[p.name] = _hash_file(p)
        _write_manifest(partial, files)
        _fsync_dir(partial)
        old = None
        if final.exists():  # the same step saved again (a run resumed from an earlier one)
            old = directory / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(partial, final)
        _fsync_dir(directory)
        atomic_write_bytes(directory / POINTER, lambda f: f.write(final.name.encode()))
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if keep > 0:
            # older steps only: those of a later step belong to a timeline this run went back
            # from (a resume from an earlier checkpoint) and are replaced when it gets there
            done = sorted(
                (p for p in directory.iterdir() if p.is_dir() and _step_of(p) is not None and _step_of(p) < step),
                key=_step_of,
            )
            for stale in done[: max(len(done) - (keep - 1), 0)]:
                _remove(stale)
    _barrier()
    return final


# ---------------------------------------------------------------------- load
def load_checkpoint(
    directory: str | Path,
    tensors: Mapping[str, Any],
) -> tuple[Path, dict[str, Any], dict[str, Any] | None] | None:
    """Load a verified checkpoint into ``tensors``: the newest intact one of a run's
    checkpoint ``directory``, or exactly the checkpoint directory given.

    ``tensors`` is the template: a nested dict of this rank's tensors or DTensors, filled
    in place (DCP reshards: the checkpoint may come from another world size or
    strategy). Collective under torch.distributed: the ranks share the verification and
    agree on the checkpoint.

    Damage (see :func:`check_checkpoint`): in a run's directory a damaged checkpoint is
    skipped for the next older intact one with a :class:`CheckpointWarning` naming it
    (raised as :class:`CheckpointError` when none is intact); a damaged checkpoint named
    directly raises :class:`CheckpointError` saying what is damaged and which
    checkpoints beside it are intact.

    Args:
        directory: a run's checkpoint directory, or one checkpoint's directory.
        tensors: the template, filled in place.

    Returns:
        ``(path, extras, rank_extras)`` (``rank_extras`` None when the checkpoint
        has no file for this rank, e.g. it was written by fewer ranks), or None if there is
        no checkpoint.

    Raises:
        CheckpointError: when no checkpoint is intact, or the one named is damaged.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    rank, world, distributed = _dist_state()
    directory = Path(directory)
    if _is_checkpoint(directory):
        path = directory
        problems = _problems_everywhere(path)
        if problems:
            raise CheckpointError(_broadcast_object(_damaged_message(path, problems) if rank == 0 else None))
    else:
        names = None
        if rank == 0:
            names = [p.name for p in _step_dirs(directory)]
            if not names and any(directory.glob(f"{_PREFIX}*.pt")):
                names = "legacy"
        names = _broadcast_object(names)
        if names == "legacy":
            raise CheckpointError(
                f"{directory} holds only single-file checkpoints (step_*.pt) of an earlier "
                f"equiopt, which this version does not resume; start a new run or resume with "
                f"that version"
            )
        path, damaged = None, []
        for name in names:
            problems = _problems_everywhere(directory / name)
            if not problems:
                path = directory / name
                break
            damaged.append(_damage(directory / name, problems))
        if path is None:
            if damaged:
                raise CheckpointError(
                    f"no intact checkpoint in {directory}: "
                    + " | ".join(damaged)
                    + ". Remove the damaged checkpoints (or the directory) to start over"
                )
            return None
        if damaged and rank == 0:
            warnings.warn(
                " | ".join(damaged) + f". Resuming from {path}, the newest intact checkpoint",
                CheckpointWarning,
                stacklevel=2,
            )
    _check_tensors(tensors)
    try:
        with _quiet_single_process():
            dcp.load(tensors, storage_reader=_reader(path), planner=_load_planner(), no_dist=not distributed)
    except CheckpointException as err:
        inner = _inner_error(err)
        if inner is not None:
            raise CheckpointError(f"{path}: {inner}") from None
        raise CheckpointError(f"{path}: loading failed ({_dcp_failure(err)})") from None
    extras = json.loads((path / META).read_text())
    if int(extras.get("format", 0)) != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {extras.get('format')!r}, this equiopt reads {FORMAT}")
    mine = path / _rank_file(rank)
    rank_extras = json.loads(mine.read_text()) if mine.is_file() else None
    return path, extras, rank_extras


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A whole checkpoint in this process, as plain tensors: its extras plus the tensor tree.

    ``path``: a checkpoint directory (verified: a damaged one raises
    :class:`CheckpointError`) or a run's checkpoint directory (its newest intact
    checkpoint). For inspection and evaluation; training resumes with :func:`load_checkpoint`.

    Args:
        path: a checkpoint directory, or a run's checkpoint directory.

    Returns:
        The checkpoint's ``checkpoint.json`` data with the full tensors put in its tree,
        and ``"path"``: the checkpoint read.

    Raises:
        CheckpointError: for a damaged checkpoint, or when none is found.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    if _is_checkpoint(path):
        problems = _problems(path)
        if problems:
            raise CheckpointError(_damaged_message(path, problems))
    else:
        found = latest_checkpoint(path)
        if found is None:
            damaged = [_damage(p, _problems(p)) for p in _step_dirs(path)]
            raise CheckpointError(f"{path}: no intact checkpoint" + (": " + " | ".join(damaged) if damaged else ""))
        path = found
    metadata = _read_metadata(path)
    flat: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if not hasattr(item, "properties") or not hasattr(item, "size"):
            raise CheckpointError(f"{path}: entry {key!r} is not a tensor")
        flat[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    try:
        with _quiet_single_process():
            dcp.load(flat, storage_reader=_reader(path), planner=_load_planner(), no_dist=True)
    except CheckpointException as err:
        inner = _inner_error(err)
        raise CheckpointError(
            f"{path}: {inner}" if inner is not None else f"{path}: loading failed ({_dcp_failure(err)})"
        ) from None
    tree: dict[str, Any] = json.loads((path / META).read_text())
    mapping = getattr(metadata, "planner_data", None) or {}
    for key, value in flat.items():
        keys = mapping.get(key, (key,))
        node = tree
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    tree["path"] = str(path)
    return tree


# ------------------------------------------------------ training state as data
def rng_state(device: torch.device | str = "cpu") -> dict[str, Any]:
    """This process's RNG states (torch, CUDA device, Python, NumPy) as JSON-serialisable data."""
    import base64
    import random

    import numpy as np

    def encode(t: torch.Tensor) -> str:
        return base64.b64encode(t.cpu().numpy().tobytes()).decode()

    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": encode(torch.get_rng_state()),
        "python": [version, list(internal), gauss],
        "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }
    device = torch.device(device)
    if device.type == "cuda":
        state["cuda"] = encode(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device | str = "cpu") -> None:
    """Restore what :func:`rng_state` returned."""
    import base64
    import random

    import numpy as np

    def decode(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(decode(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    device = torch.device(device)
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(decode(state["cuda"]), device)


def _to_json(value: Any) -> tuple[bool, Any]:
    """``(ok, value)``: plain data as JSON (tuples as lists, dtypes tagged); ok False for anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True, value
    if isinstance(value, torch.dtype):
        return True, {"__dtype__": str(value).removeprefix("torch.")}
    if torch.is_tensor(value) and value.ndim == 0 and not hasattr(value, "placements"):  # a tensor lr, say
        return True, {"__scalar__": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        items = [_to_json(v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        items = {k: _to_json(v) for k, v in value.items()}
        return all(ok for ok, _ in items.values()), {k: v for k, (_, v) in items.items()}
    return False, None


def _from_json(value: Any, like: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__dtype__"}:
        return getattr(torch, value["__dtype__"])
    if isinstance(value, dict) and set(value) == {"__scalar__", "dtype"}:
        device = like.device if torch.is_tensor(like) else None
        return torch.tensor(value["__scalar__"], dtype=getattr(torch, value["dtype"]), device=device)
    if isinstance(like, tuple) and isinstance(value, list):
        return tuple(_from_json(v, l) for v, l in zip(value, like)) if len(value) == len(like) else tuple(value)
    return value


def param_groups_to_json(groups: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """An optimizer state dict's ``param_groups`` as JSON data; values that are not plain data
    (a callable, an object) are left out and come from the optimizer being loaded into."""
    out = []
    for group in groups:
        kept = {}
        for key, value in group.items():
            ok, data = _to_json(value)
            if ok:
                kept[key] = data
        out.append(kept)
    return out


def param_groups_from_json(saved: list[Mapping[str, Any]], template: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``template`` (the groups of the optimizer being loaded into) with the saved values put back."""
    if len(saved) != len(template):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved)} parameter groups, this one "
            f"{len(template)}; resume with the recipe and model the run was started with"
        )
    out = []
    for i, (old, new) in enumerate(zip(saved, template)):
        if "params" in old and list(old["params"]) != list(new["params"]):
            raise CheckpointError(
                f"parameter group {i} ({new.get('role', '?')}) holds other parameters than in the "
                f"checkpoint; resume with the recipe and model the run was started with"
            )
        merged = dict(new)
        for key, value in old.items():
            if key != "params":
                merged[key] = _from_json(value, new.get(key))
        out.append(merged)
    return out
