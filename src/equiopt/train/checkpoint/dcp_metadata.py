"""Reading DCP's ``.metadata``, the one pickle in a checkpoint, with an unpickler that
accepts only DCP's metadata classes, ``torch.Size``, dtypes and paths; anything else
raises :class:`CheckpointError`."""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path

import torch

from .errors import CheckpointError

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
