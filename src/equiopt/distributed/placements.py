"""How a parameter is laid out across ranks, from its DTensor placements.

Every placement that torch's parallel APIs give a parameter leaves each rank holding one
*block* of the global tensor: a ``[start, stop)`` range per tensor dimension.

- a plain tensor (one process, DDP) is ``local``; a DTensor replicated on every mesh
  dimension is ``replicated``;
- otherwise it is ``sharded``: each mesh dimension either replicates it (``Replicate()``:
  DDP's and HSDP's replica axes, TP's norms) or splits one tensor dimension
  (``Shard(d)``: FSDP2's ``fully_shard``, TP's Colwise ``Shard(0)`` and Rowwise
  ``Shard(1)``, EP's expert axis; ``_StridedShard(d)``: FSDP2 on top of TP). Several mesh
  dimensions may split the same tensor dimension.

The ranges are found by letting each placement split an index vector exactly as it splits
the tensor (its own ``_split_tensor``, the function DTensor shards with), so uneven and
strided shards follow torch, not hand-written chunk arithmetic. A placement whose split
leaves a rank with indices that are not one contiguous range, ``Partial`` placements and
unknown ones raise :class:`UnsupportedShardingError` naming the parameter.

:func:`mesh_group` gives the process group of a set of mesh dimensions (their product),
which the optimizer reduces over or spreads owner work over.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "Sharding",
    "UnsupportedShardingError",
    "describe_sharding",
    "check_shardings",
    "is_dtensor",
    "row_range",
    "mesh_group",
    "group_coordinates",
]

Range = tuple[int, int]


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
class Split:
    """How the mesh dimensions ``axes`` (in mesh order) split one tensor dimension:
    ``ranges[c]`` is the ``[start, stop)`` held at coordinates ``c`` on those axes."""

    axes: tuple[int, ...]
    ranges: dict = field(compare=False)

    def boundaries(self) -> set[int]:
        return {x for r in self.ranges.values() for x in r}


@dataclass(frozen=True)
class Sharding:
    """Where one parameter's entries live.

    ``shape`` is the global shape and ``block`` this rank's ``[start, stop)`` per tensor
    dimension. For a sharded DTensor, ``mesh_shape``/``mesh_names`` describe its mesh,
    ``coordinate`` is this rank's place in it, ``dims[a]`` the tensor dimension mesh
    dimension ``a`` splits (None: it replicates) and ``splits`` every split tensor
    dimension's :class:`Split`. Only sizes and coordinates enter: the same record is made
    on a fake process group of any size, for planning.
    """

    name: str
    kind: str  # "local" | "replicated" | "sharded"
    shape: tuple[int, ...]
    block: tuple[Range, ...]
    mesh: Any = None
    mesh_shape: tuple[int, ...] = ()
    mesh_names: tuple[str, ...] = ()
    coordinate: tuple[int, ...] = ()
    dims: tuple[int | None, ...] = ()
    splits: dict = field(default_factory=dict, compare=False)
    placements: str = ""

    @property
    def is_sharded(self) -> bool:
        """Whether some mesh dimension of size > 1 splits the tensor."""
        return bool(self.split_axes)

    @property
    def sharded_axes(self) -> tuple[int, ...]:
        """Mesh dimensions that split some tensor dimension."""
        return tuple(a for a, d in enumerate(self.dims) if d is not None)

    @property
    def split_axes(self) -> tuple[int, ...]:
        """The sharded mesh dimensions of size > 1: the ranks that hold different pieces."""
        return tuple(a for a in self.sharded_axes if self.mesh_shape[a] > 1)

    @property
    def replicate_axes(self) -> tuple[int, ...]:
        """Mesh dimensions over which the parameter is replicated (DDP/HSDP replicas, TP norms)."""
        return tuple(a for a, d in enumerate(self.dims) if d is None)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.block)

    def local_slices(self) -> tuple[slice, ...]:
        """Index of this rank's block in the global tensor: ``global[s.local_slices()]``."""
        return tuple(slice(a, b) for a, b in self.block)

    def block_at(self, coordinate: Sequence[int]) -> tuple[Range, ...]:
        """The block held at mesh ``coordinate`` (a full coordinate of the mesh)."""
        out = []
        for d, size in enumerate(self.shape):
            split = self.splits.get(d)
            out.append((0, size) if split is None else split.ranges[tuple(coordinate[a] for a in split.axes)])
        return tuple(out)

    def axis_name(self, axis: int) -> str:
        return self.mesh_names[axis] if self.mesh_names else f"mesh dim {axis}"

    def __str__(self) -> str:
        if self.kind == "sharded":
            held = ", ".join(f"{a}:{b}" for a, b in self.block)
            return f"{self.name}: block [{held}] of {self.shape} ({self.placements})"
        return f"{self.name}: {self.kind}" + (f" ({self.placements})" if self.placements else "")


def _placement_names(placements) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ("," if len(placements) == 1 else "") + ")"


def _kind_of(placement) -> str:
    """ "replicate", "shard", "partial" or "other" (strided shards are shards)."""
    if placement.is_replicate():
        return "replicate"
    if placement.is_partial():
        return "partial"
    if placement.is_shard() or hasattr(placement, "split_factor"):
        return "shard"
    return "other"


def _split_ranges(size: int, ndim: int, dim: int, levels: list[tuple[int, Any, int]]) -> dict:
    """``{coordinates on the splitting axes: [start, stop)}`` for one tensor dimension of
    ``size`` split by ``levels`` (``(mesh dim, placement, mesh size)`` in mesh order): each
    placement splits an index vector as it would split the tensor. Raises ValueError
    when a piece is not one contiguous range."""
    view = [1] * ndim
    view[dim] = size
    out = {}

    def walk(t: torch.Tensor, level: int, coord: tuple[int, ...]) -> None:
        if level == len(levels):
            flat = t.reshape(-1)
            start = int(flat[0]) if flat.numel() else 0
            if flat.numel() and not torch.equal(flat, torch.arange(start, start + flat.numel())):
                raise ValueError(f"coordinates {coord} hold indices {flat.tolist()[:8]}..., not one contiguous range")
            if not flat.numel():  # an empty piece sits after the last one that is not
                start = size
            out[coord] = (start, start + flat.numel())
            return
        _, placement, n = levels[level]
        pieces, _ = placement._split_tensor(t, n, with_padding=False)
        for c in range(n):
            piece = pieces[c] if c < len(pieces) else t.narrow(dim, 0, 0)
            walk(piece, level + 1, coord + (c,))

    walk(torch.arange(size).view(view), 0, ())
    return out


_SPLIT_CACHE: dict = {}


def _splits_of(shape: tuple[int, ...], placements, mesh_shape: tuple[int, ...], where: str) -> tuple[dict, tuple]:
    dims: list[int | None] = []
    for p in placements:
        dims.append(p.dim % len(shape) if _kind_of(p) == "shard" else None)
    splits = {}
    for d in sorted({d for d in dims if d is not None}):
        levels = [(a, placements[a], mesh_shape[a]) for a, dd in enumerate(dims) if dd == d]
        key = (shape[d], len(shape), d, tuple((a, repr(p), n) for a, p, n in levels))
        ranges = _SPLIT_CACHE.get(key)
        if ranges is None:
            try:
                ranges = _split_ranges(shape[d], len(shape), d, levels)
            except ValueError as err:
                raise UnsupportedShardingError(
                    f"{where}: dimension {d} is split into pieces that are not contiguous ({err}); equiopt steps "
                    "placements whose every rank holds one block of the tensor"
                ) from None
            _SPLIT_CACHE[key] = ranges
        splits[d] = Split(tuple(a for a, _, _ in levels), ranges)
    return splits, tuple(dims)


def describe_sharding(param: torch.Tensor, name: str | None = None) -> Sharding:
    """The :class:`Sharding` of ``param`` (a tensor or DTensor); raise if equiopt cannot step it in place.

    Errors name the parameter, its placements and mesh shape, and what to change.
    """
    label = name or "<unnamed parameter>"
    shape = tuple(param.shape)
    full = tuple((0, s) for s in shape)
    if not is_dtensor(param):
        return Sharding(label, "local", shape, full)
    mesh = param.device_mesh
    placements = tuple(param.placements)
    text = _placement_names(placements)
    mesh_shape = tuple(mesh.shape)
    where = f"parameter {label!r} of shape {shape} is placed as {text} on a device mesh of shape {mesh_shape}"
    kinds = [_kind_of(p) for p in placements]
    if "partial" in kinds:
        raise UnsupportedShardingError(
            f"{where}: a Partial placement holds unreduced partial values, not weights; "
            "redistribute it to Replicate() or Shard(d) first"
        )
    if "other" in kinds:
        raise UnsupportedShardingError(
            f"{where}: unknown placement; equiopt steps Replicate(), Shard(d) and _StridedShard(d) placements"
        )
    names = tuple(mesh.mesh_dim_names or ())
    if "shard" not in kinds:
        return Sharding(
            label, "replicated", shape, full, mesh, mesh_shape, names, dims=(None,) * len(placements), placements=text
        )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedShardingError(f"{where}: this rank is not part of its device mesh")
    splits, dims = _splits_of(shape, placements, mesh_shape, where)
    s = Sharding(label, "sharded", shape, full, mesh, mesh_shape, names, tuple(coordinate), dims, splits, text)
    block = s.block_at(coordinate)
    held = tuple(param.to_local().shape)
    if held != tuple(b - a for a, b in block):
        raise UnsupportedShardingError(
            f"{where}: this rank holds a {held} block where its placements give "
            f"{tuple(b - a for a, b in block)}; only DTensor's own splits are supported"
        )
    return Sharding(label, "sharded", shape, block, mesh, mesh_shape, names, tuple(coordinate), dims, splits, text)


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


def group_coordinates(
    mesh_shape: Sequence[int], coordinate: Sequence[int], axes: Sequence[int]
) -> list[tuple[int, ...]]:
    """The mesh coordinates of the ranks that share ``coordinate`` off ``axes``, in the order
    of their ranks in :func:`mesh_group` (row-major over ``axes``)."""
    out = []
    for c in itertools.product(*(range(mesh_shape[a]) for a in axes)):
        full = list(coordinate)
        for a, v in zip(axes, c):
            full[a] = v
        out.append(tuple(full))
    return out


_GROUPS: dict = {}


def mesh_group(mesh, axes: Sequence[int]):
    """The process group of the ranks that differ from this one only on the mesh dimensions
    ``axes`` (their product). One axis: the mesh's own group. Several: made once per mesh
    and axes with ``torch.distributed.new_group`` for every such set of ranks, in the same
    order on every rank (a collective call, like DeviceMesh's own), then cached. Its ranks
    are ordered as :func:`group_coordinates` orders coordinates."""
    axes = tuple(sorted(axes))
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    import torch.distributed as dist

    ranks = mesh.mesh
    key = (tuple(ranks.flatten().tolist()), tuple(ranks.shape), axes)
    found = _GROUPS.get(key)
    if found is not None:
        return found
    others = [a for a in range(ranks.ndim) if a not in axes]
    blocks = ranks.permute(*others, *axes).reshape(-1, math.prod(ranks.shape[a] for a in axes))
    me = dist.get_rank()
    mine = None
    for row in blocks.tolist():
        # group ranks follow the sorted global ranks; keep the mesh's row-major order
        if sorted(row) != row:
            raise UnsupportedShardingError(
                f"device mesh {tuple(ranks.shape)}: ranks {row} along mesh dimensions "
                f"{axes} are not in increasing order; equiopt needs a mesh whose ranks "
                "increase along every dimension (init_device_mesh makes such meshes)"
            )
        pg = dist.new_group(row)
        if me in row:
            mine = pg
    _GROUPS[key] = mine
    return mine
