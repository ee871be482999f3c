"""Distributed, atomic, self-verifying checkpoints with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``DIR/step_00001000/`` holding the tensors in DCP's format
(``.metadata`` and one ``__<rank>_0.distcp`` file per writing rank), ``checkpoint.json``
(plain data of the run), ``rank_<r>.json`` (plain data of each writing rank, e.g. its RNG
states) and ``manifest.json`` (the size and SHA-256 of every other file). It is written
atomically (:mod:`.files`, :mod:`.dcp`), verified before it is loaded (:mod:`.manifest`),
and nothing in it is unpickled beyond DCP's own metadata (:mod:`.dcp_metadata`).
"""

import shutil  # noqa: F401  (an attribute of the package, as the module it replaces had)

from .dcp import FORMAT, load_checkpoint, read_checkpoint, save_checkpoint  # noqa: F401
from .errors import CheckpointError, CheckpointWarning
from .files import (  # noqa: F401
    MANIFEST,
    META,
    POINTER,
    _is_checkpoint,
    atomic_write_bytes,
    list_checkpoints,
)
from .manifest import (  # noqa: F401
    MANIFEST_FORMAT,
    _hash_file,
    _write_manifest,
    check_checkpoint,
    latest_checkpoint,
)
from .param_groups import param_groups_from_json, param_groups_to_json  # noqa: F401
from .rng import rng_state, set_rng_state  # noqa: F401

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
