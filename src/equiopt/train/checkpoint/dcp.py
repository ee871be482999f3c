"""Saving and loading checkpoints with ``torch.distributed.checkpoint`` (DCP).

Each rank writes its own shards and ``rank_<r>.json``, and hashes what it wrote; rank 0
adds ``checkpoint.json`` and the manifest to the partial directory, renames it into place
and only then moves ``latest``. A checkpoint loads at any world size and under any
strategy (one process, DDP, FSDP2), after verification; only tensors are read, and a
pickled object entry is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from . import files as on_disk
from .collectives import _barrier, _broadcast_object, _dist_state, _gather_object
from .dcp_metadata import _read_metadata
from .errors import CheckpointError, CheckpointWarning
from .files import (
    _PREFIX,
    MANIFEST,
    META,
    POINTER,
    _clear_leftovers,
    _is_checkpoint,
    _rank_file,
    _remove,
    _step_dirs,
    _step_of,
    _write_json,
    atomic_write_bytes,
)
from .manifest import (
    _damage,
    _damaged_message,
    _hash_file,
    _problems,
    _problems_everywhere,
    _write_manifest,
    latest_checkpoint,
)

FORMAT = 1


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
        on_disk._fsync_dir(partial)  # (looked up in its module when called, where a test may replace it)
        old = None
        if final.exists():  # the same step saved again (a run resumed from an earlier one)
            old = directory / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(partial, final)
        on_disk._fsync_dir(directory)
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
