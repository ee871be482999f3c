"""Distributed, atomic checkpoints with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``DIR/step_00001000/`` holding

- the tensors (model weights, optimizer state) in DCP's format (``.metadata`` and one
  ``__<rank>_0.distcp`` file per rank that wrote data); each rank writes its own shards,
  and a checkpoint loads at any world size and under any strategy (one process, DDP,
  FSDP2): DCP reads whatever slices each loading rank needs;
- ``checkpoint.json``: plain data (step, tokens, scheduler, data position, optimizer
  hyperparameters, config, the world size that wrote it);
- ``rank_<r>.json``: per-rank plain data (RNG states), one file per writing rank.

Nothing is unpickled on load beyond DCP's own metadata, which is read with an
unpickler that accepts only DCP's metadata classes, ``torch.Size``, dtypes and paths;
tensors are read with ``weights_only=True`` and any pickled object entry is refused.

Atomicity: every rank writes into ``DIR/.step_00001000.partial/`` (files fsynced), then
rank 0 fsyncs it, renames it to ``step_00001000`` and only then replaces the ``latest``
pointer (itself written to a temporary file, fsynced and renamed). A crash at any
moment leaves either the old checkpoint or the new one complete: readers ignore
``.partial`` directories, follow ``latest`` and fall back to the newest complete
checkpoint.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import shutil
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Mapping

import torch

POINTER = "latest"
META = "checkpoint.json"
FORMAT = 1
_PREFIX = "step_"

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints",
           "read_checkpoint", "atomic_write_bytes", "POINTER", "META"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read as asked; the message says which and why."""


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


def _broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank (an int64 tensor on the backend's device)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    nccl = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())


# ------------------------------------------------------------- safe DCP reading
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
            ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
            ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"), ("builtins", "set"),
            ("builtins", "frozenset")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: its own classes, ``torch.Size``, dtypes and paths only."""

    def find_class(self, module: str, name: str):
        if module == "torch.distributed.checkpoint" or module.startswith("torch.distributed.checkpoint."):
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type):
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise CheckpointError(f"checkpoint metadata refers to {module}.{name}; refusing to unpickle it "
                              f"(equiopt checkpoints hold only tensors and plain data)")


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
            raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; "
                                  f"equiopt checkpoints hold only tensors and refuse to unpickle it")

    return TensorOnlyLoadPlanner()


def _check_tensors(tree: Mapping[str, Any], where: str = "") -> None:
    for key, value in tree.items():
        here = f"{where}.{key}" if where else str(key)
        if isinstance(value, Mapping):
            _check_tensors(value, here)
        elif not torch.is_tensor(value):
            raise CheckpointError(f"checkpoint entry {here!r} is a {type(value).__name__}, not a tensor; "
                                  f"put plain data into the JSON extras instead")


@contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when torch.distributed is not initialised: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch.distributed is disabled, unavailable or uninitialized.*")
        yield


# ------------------------------------------------------------------- listing
def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(_PREFIX):
        return None
    try:
        return int(name[len(_PREFIX):])
    except ValueError:
        return None


def _complete(path: Path) -> bool:
    return path.is_dir() and _step_of(path) is not None and (path / ".metadata").is_file() and (path / META).is_file()


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints in ``directory``: the one ``latest`` names first, then newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = sorted((p for p in directory.iterdir() if _complete(p)), key=lambda p: _step_of(p), reverse=True)
    pointer = directory / POINTER
    if pointer.is_file():
        named = directory / pointer.read_text().strip()
        if named in found:
            found.remove(named)
            found.insert(0, named)
    return found


def _readable(path: Path) -> bool:
    try:
        json.loads((path / META).read_text())
        _read_metadata(path)
        return True
    except Exception:  # a damaged or foreign checkpoint: the caller tries the next one
        return False


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete, readable checkpoint of ``directory`` (following ``latest``), or None."""
    for path in list_checkpoints(directory):
        if _readable(path):
            return path
    return None


# ---------------------------------------------------------------------- save
def save_checkpoint(
    directory: str | Path,
    step: int,
    tensors: Mapping[str, Any],
    extras: Mapping[str, Any] | None = None,
    rank_extras: Mapping[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write ``step_<step>`` atomically and point ``latest`` at it; collective under torch.distributed.

    ``tensors``: a nested dict of tensors or DTensors (each rank passes its own shards);
    ``extras``: JSON-serialisable data, taken from rank 0; ``rank_extras``: JSON data of
    this rank (e.g. its RNG state). Keeps the newest ``keep`` checkpoints (0: all).
    """
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    rank, world, distributed = _dist_state()
    _check_tensors(tensors)
    final = directory / f"{_PREFIX}{step:08d}"
    partial = directory / f".{final.name}.partial"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # what a crashed save left behind
        partial.mkdir()
    _barrier()
    writer = dcp.FileSystemWriter(str(partial), sync_files=True)
    with _quiet_single_process():
        dcp.save(dict(tensors), storage_writer=writer, no_dist=not distributed)
    if rank_extras is not None:
        _write_json(partial / _rank_file(rank), dict(rank_extras))
    _barrier()
    if rank == 0:
        meta = {"format": FORMAT, "step": int(step), "world_size": world, **(dict(extras or {}))}
        _write_json(partial / META, meta)
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
            done = sorted((p for p in directory.iterdir() if _complete(p) and p != final), key=_step_of)
            for stale in done[: max(len(done) - (keep - 1), 0)]:
                shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


# ---------------------------------------------------------------------- load
def load_checkpoint(
    directory: str | Path,
    tensors: Mapping[str, Any],
) -> tuple[Path, dict[str, Any], dict[str, Any] | None] | None:
    """Load the newest checkpoint of ``directory`` (or the checkpoint directory given) into ``tensors``.

    ``tensors`` is the template: a nested dict of this rank's tensors or DTensors, filled
    in place (DCP reshards: the checkpoint may come from another world size or
    strategy). Collective under torch.distributed: rank 0 chooses the checkpoint.
    Returns ``(path, extras, rank_extras)`` (``rank_extras`` None when the checkpoint
    has no file for this rank, e.g. it was written by fewer ranks), or None if there is
    no checkpoint.
    """
    import torch.distributed.checkpoint as dcp

    rank, world, distributed = _dist_state()
    directory = Path(directory)
    if _complete(directory):
        candidates = [directory]
        directory = directory.parent
    else:
        candidates = list_checkpoints(directory)
        if not candidates and any(directory.glob(f"{_PREFIX}*.pt")):
            raise CheckpointError(f"{directory} holds only single-file checkpoints (step_*.pt) of an earlier equiopt, "
                                  f"which this version does not resume; start a new run or resume with that version")
    choice = -1
    if rank == 0:
        choice = next((_step_of(p) for p in candidates if _readable(p)), -1)
    choice = _broadcast_int(choice)
    if choice < 0:
        return None
    path = directory / f"{_PREFIX}{choice:08d}"
    _check_tensors(tensors)
    with _quiet_single_process():
        dcp.load(tensors, storage_reader=_reader(path), planner=_load_planner(), no_dist=not distributed)
    extras = json.loads((path / META).read_text())
    if int(extras.get("format", 0)) != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {extras.get('format')!r}, this equiopt reads {FORMAT}")
    mine = path / _rank_file(rank)
    rank_extras = json.loads(mine.read_text()) if mine.is_file() else None
    return path, extras, rank_extras


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A whole checkpoint in this process, as plain tensors: its extras plus the tensor tree.

    ``path``: a checkpoint directory or a run's checkpoint directory (its newest
    checkpoint). For inspection and evaluation; training resumes with :func:`load_checkpoint`.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if not _complete(path):
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"{path}: no complete checkpoint")
        path = found
    metadata = _read_metadata(path)
    flat: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        if not hasattr(item, "properties") or not hasattr(item, "size"):
            raise CheckpointError(f"{path}: entry {key!r} is not a tensor")
        flat[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    with _quiet_single_process():
        dcp.load(flat, storage_reader=_reader(path), planner=_load_planner(), no_dist=True)
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
    state = {"torch": encode(torch.get_rng_state()), "python": [version, list(internal), gauss],
             "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]}
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
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this one "
                              f"{len(template)}; resume with the recipe and model the run was started with")
    out = []
    for i, (old, new) in enumerate(zip(saved, template)):
        if "params" in old and list(old["params"]) != list(new["params"]):
            raise CheckpointError(f"parameter group {i} ({new.get('role', '?')}) holds other parameters than in the "
                                  f"checkpoint; resume with the recipe and model the run was started with")
        merged = dict(new)
        for key, value in old.items():
            if key != "params":
                merged[key] = _from_json(value, new.get(key))
        out.append(merged)
    return out
