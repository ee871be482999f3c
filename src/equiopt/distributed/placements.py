"""How a parameter is laid out across ranks, from its DTensor placements.

equiopt's maps act on rows (the symmetry axis of every work matrix, dim 0 of the stored
tensor), so it supports exactly the layouts in which each rank holds whole rows:

- ``local``: a plain tensor (one process, or DDP, where every rank holds a full copy);
- ``replicated``: a DTensor with ``Replicate()`` on every mesh dimension;
- ``row``: a DTensor with ``Shard(0)`` on one mesh dimension and ``Replicate()`` on the
  others (FSDP2's ``fully_shard``, or HSDP's ``(Replicate(), Shard(0))``), with the
  local row range following DTensor's split (``torch.chunk``: shards of
  ``ceil(rows / n)`` rows, the last ones shorter or empty).

Everything else raises :class:`UnsupportedShardingError` naming the parameter and its
placement: ``Shard`` on another dimension (tensor parallelism), ``Shard(0)`` on several
mesh dimensions, strided shards (FSDP2 over a tensor-parallel mesh) and ``Partial``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch

__all__ = ["Sharding", "UnsupportedShardingError", "describe_sharding", "check_shardings", "is_dtensor", "row_range"]


class UnsupportedShardingError(ValueError):
    """A parameter's DTensor placement is not one equiopt can step without gathering it."""


def is_dtensor(t: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (without importing it where unavailable)."""
    return torch.is_tensor(t) and hasattr(t, "placements") and hasattr(t, "device_mesh") and hasattr(t, "to_local")


def row_range(rows: int, num_shards: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of shard ``index`` when ``rows`` rows are split like ``torch.chunk``."""
    if num_shards < 1 or not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} out of range for {num_shards} shards")
    size = math.ceil(rows / num_shards) if rows else 0
    return min(index * size, rows), min((index + 1) * size, rows)


@dataclass(frozen=True)
class Sharding:
    """Where the rows of one parameter live.

    ``shape`` is the global shape, ``rows`` the ``[start, stop)`` range of dim 0 held by
    this rank (the whole range unless ``kind == "row"``), ``num_shards`` and
    ``shard_index`` the row shards and this rank's one, and ``mesh``/``mesh_dim`` the
    DTensor mesh dimension the rows are split over (None when not row-sharded).
    """

    name: str
    kind: str  # "local" | "replicated" | "row"
    shape: tuple[int, ...]
    rows: tuple[int, int]
    num_shards: int = 1
    shard_index: int = 0
    mesh: Any = None
    mesh_dim: int | None = None
    placements: str = ""

    @property
    def is_row_sharded(self) -> bool:
        return self.kind == "row"

    @property
    def local_rows(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def group(self):
        """The process group over which the rows are split (None unless row-sharded)."""
        if self.mesh is None or self.mesh_dim is None:
            return None
        return self.mesh.get_group(self.mesh_dim)

    def row_ranges(self) -> list[tuple[int, int]]:
        """Every shard's ``[start, stop)`` in shard order (one range unless row-sharded)."""
        return [row_range(self.shape[0], self.num_shards, i) for i in range(self.num_shards)] if self.shape else [(0, 0)]

    def __str__(self) -> str:
        if self.kind == "row":
            return (f"{self.name}: rows {self.rows[0]}:{self.rows[1]} of {self.shape[0]} "
                    f"(shard {self.shard_index} of {self.num_shards}, {self.placements})")
        return f"{self.name}: {self.kind}" + (f" ({self.placements})" if self.placements else "")


def _placement_names(placements) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ("," if len(placements) == 1 else "") + ")"


def _kind_of(placement) -> str:
    """"replicate", "shard0", "strided", "shard_other", "partial" or "other"."""
    name = type(placement).__name__
    if name == "_StridedShard" or hasattr(placement, "split_factor"):
        return "strided"
    if placement.is_replicate():
        return "replicate"
    if placement.is_partial():
        return "partial"
    if placement.is_shard():
        return "shard"
    return "other"


def describe_sharding(param: torch.Tensor, name: str | None = None) -> Sharding:
    """The :class:`Sharding` of ``param`` (a tensor or DTensor); raise if equiopt cannot step it in place.

    Errors name the parameter, its placements and mesh shape, and what is supported.
    """
    label = name or "<unnamed parameter>"
    shape = tuple(param.shape)
    full = (0, shape[0]) if shape else (0, 0)
    if not is_dtensor(param):
        return Sharding(label, "local", shape, full)
    mesh = param.device_mesh
    placements = tuple(param.placements)
    text = _placement_names(placements)
    where = f"parameter {label!r} of shape {shape} is placed as {text} on a device mesh of shape {tuple(mesh.shape)}"
    supported = ("equiopt steps replicated parameters and parameters sharded by rows (Shard(0) on one mesh "
                 "dimension, as torch.distributed.fsdp.fully_shard makes)")
    kinds = [_kind_of(p) for p in placements]
    if "partial" in kinds:
        raise UnsupportedShardingError(f"{where}: a Partial placement holds unreduced partial values, not weights; "
                                       f"redistribute it to Replicate() or Shard(0) first. {supported}")
    if "strided" in kinds:
        raise UnsupportedShardingError(f"{where}: strided shards (FSDP2 over a tensor-parallel mesh) are not "
                                       f"supported. {supported}")
    if "other" in kinds:
        raise UnsupportedShardingError(f"{where}: unknown placement. {supported}")
    sharded = [i for i, (k, p) in enumerate(zip(kinds, placements)) if k == "shard"]
    for i in sharded:
        dim = placements[i].dim % max(len(shape), 1)
        if dim != 0:
            raise UnsupportedShardingError(
                f"{where}: Shard({placements[i].dim}) splits dimension {dim}, not the rows; tensor parallelism "
                f"(a sharding on a non-row dimension) is not supported. {supported}")
    if len(sharded) > 1:
        raise UnsupportedShardingError(f"{where}: its rows are split over {len(sharded)} mesh dimensions; "
                                       f"only one sharded mesh dimension is supported. {supported}")
    if not sharded:
        return Sharding(label, "replicated", shape, full, placements=text)
    mesh_dim = sharded[0]
    num = mesh.size(mesh_dim)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedShardingError(f"{where}: this rank is not part of its device mesh")
    index = coordinate[mesh_dim]
    rows = row_range(shape[0], num, index)
    local = param.to_local().shape[0] if param.to_local().ndim else 0
    if local != rows[1] - rows[0]:
        raise UnsupportedShardingError(
            f"{where}: this rank holds {local} rows where an even split (torch.chunk) gives rows "
            f"{rows[0]}:{rows[1]}; only DTensor's own even split is supported")
    return Sharding(label, "row", shape, rows, num, index, mesh, mesh_dim, text)


def check_shardings(named_params: Iterable[tuple[str, torch.Tensor]]) -> list[Sharding]:
    """:func:`describe_sharding` of every ``(name, param)``; one error listing every unsupported one."""
    out, errors = [], []
    for name, p in named_params:
        try:
            out.append(describe_sharding(p, name))
        except UnsupportedShardingError as err:
            errors.append(str(err))
    if errors:
        raise UnsupportedShardingError("\n".join(errors) if len(errors) > 1 else errors[0])
    return out
