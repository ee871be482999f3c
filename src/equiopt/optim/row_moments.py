"""Row second moments (a rule's :attr:`~equiopt.optim.rules.Rule.row_moments`, NorMuon's):
where they live and how the row stage runs on a block.

Such a rule keeps one second-moment entry per work-matrix row. Its state
``row_second_moment`` has the parameter's leading batch dimensions (experts, extra
leading axes) and then one entry per row of the rest, in the work matrices' row order:
``(m,)`` for a ``(m, n)`` matrix, ``(E, m)`` for a stack of experts.

For the layouts whose work rows are one stored axis in order (:func:`row_axes`: ``row``,
``col``, ``heads`` on either axis, ``experts`` of these), that last axis *is* the stored
row axis, so a DTensor parameter's state is a DTensor laid out like it
(:func:`row_moment_placements`): split where the parameter's rows or batch are split,
replicated where its columns are. A split that cuts the work matrices then runs the
polar factor on an owner rank, as ``spectral`` does, and the row stage on every rank's
own block (:func:`block_row_stage`): the row sums all-reduced over the mesh axes that cut
the columns, the per-matrix Frobenius sums over those that cut the rows.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..layouts import Layout
from .sharded import _dim_roles

if TYPE_CHECKING:
    from .rules import Rule

__all__ = [
    "ROW_MOMENT",
    "RowAxes",
    "row_axes",
    "row_moment_shape",
    "row_moment_block",
    "row_moment_views",
    "row_moment_placements",
    "stage_axes",
    "block_row_stage",
    "block_row_stages",
    "stage_bytes",
]

#: NorMuon's per-row second moments (state key), see :func:`row_moment_shape`.
ROW_MOMENT = "row_second_moment"


class RowAxes(NamedTuple):
    """Where a layout's work rows lie in a stored tensor of a given shape: ``batch``
    leading dimensions that only batch work matrices; ``row`` the stored dimension whose
    entries are the work rows, in order (None for fused layouts, whose rows mix axes);
    ``segment`` rows per work matrix along it; ``cols`` the stored dimensions a row's
    statistics sum over."""

    batch: int
    row: int | None
    segment: int
    cols: tuple[int, ...]


def row_axes(layout: Layout, shape: tuple[int, ...]) -> RowAxes:
    """The :class:`RowAxes` of ``layout`` on a stored ``shape`` (global or local)."""
    roles = _dim_roles(layout, len(shape))
    batch = 0
    while batch < len(roles) and roles[batch] == "batch":
        batch += 1
    rest = roles[batch:]
    rows = [d for d, r in enumerate(rest, batch) if r == "rows" or isinstance(r, tuple)]
    if len(rows) != 1 or any(r not in ("rows", "cols") and not isinstance(r, tuple) for r in rest):
        return RowAxes(batch, None, 0, ())
    row = rows[0]
    segment = roles[row][1] if isinstance(roles[row], tuple) else shape[row]
    return RowAxes(batch, row, segment, tuple(d for d in range(batch, len(shape)) if d != row))


def row_moment_shape(layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a parameter's NorMuon row second moments: its leading batch dimensions,
    then one entry per row of each work matrix of one batch entry, end to end."""
    total = 0
    for work in layout.work_shapes(shape):
        total += math.prod(work[:-1])
    lead = tuple(shape[: row_axes(layout, shape).batch])
    return (*lead, total // max(math.prod(lead), 1))


def row_moment_block(layout: Layout, shape: tuple[int, ...], block) -> tuple[int, ...]:
    """The shape of the row second moments of the ``block`` (``[start, stop)`` per
    dimension) of a parameter of global ``shape``: its batch entries and its rows (all rows
    of its batch entries for a fused layout)."""
    axes = row_axes(layout, shape)
    local = tuple(b - a for a, b in block)
    rows = local[axes.row] if axes.row is not None else row_moment_shape(layout, shape)[-1]
    return (*local[: axes.batch], rows)


def row_moment_views(layout: Layout, shape: tuple[int, ...], second: torch.Tensor) -> list[torch.Tensor]:
    """Views of a parameter's row second moments (:func:`row_moment_shape`, contiguous),
    one per work block, shaped ``(*lead, m, 1)`` beside its work matrices ``(*lead, m, n)``."""
    flat = second.reshape(-1)
    out, at = [], 0
    for work in layout.work_shapes(shape):
        count = math.prod(work[:-1])
        out.append(flat.narrow(0, at, count).view(*work[:-1], 1))
        at += count
    return out


def row_moment_placements(placements, layout: Layout, shape: tuple[int, ...]) -> list:
    """The placements of a DTensor parameter's row second moments: a split of a batch
    dimension stays, a split of the row axis moves to the state's last dimension (same
    size, so the same blocks), any other split becomes ``Replicate`` (every rank of those
    columns keeps the same rows; a fused layout's ranks keep all rows of their batch)."""
    from torch.distributed.tensor import Replicate

    axes = row_axes(layout, shape)
    out = []
    for pl in placements:
        if not (pl.is_shard() or hasattr(pl, "split_factor")):  # (strided shards are shards)
            out.append(Replicate())
            continue
        dim = pl.dim % len(shape)
        if dim < axes.batch:
            out.append(pl)
        elif dim == axes.row:
            split = getattr(pl, "split_factor", None)
            out.append(type(pl)(axes.batch, split_factor=split) if split is not None else type(pl)(axes.batch))
        else:  # a column, or an axis a fused layout mixes into its rows: every rank keeps all rows
            out.append(Replicate())
    return out


def stage_axes(layout: Layout, sharding) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The mesh axes (of size > 1) that cut a parameter's work rows and its work columns:
    the row stage sums its per-matrix totals over the first, its row sums over the second
    (a fused layout: every axis that cuts more than its batch, as columns)."""
    axes = row_axes(layout, sharding.shape)
    rows: list[int] = []
    cols: list[int] = []
    for a, d in enumerate(sharding.dims):
        if d is None or sharding.mesh_shape[a] < 2 or d < axes.batch:
            continue
        (rows if d == axes.row else cols).append(a)
    return tuple(rows), tuple(cols)


def _sum(t: torch.Tensor, sharding, axes: tuple[int, ...]) -> torch.Tensor:
    if not axes:
        return t
    import torch.distributed as dist

    from ..distributed.placements import mesh_group

    t = t.contiguous()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=mesh_group(sharding.mesh, axes))
    return t


def block_row_stage(
    o: torch.Tensor, second: torch.Tensor, weight, eps: float, layout: Layout, sharding, block, rule: Rule
) -> torch.Tensor:
    """NorMuon's row stage (:func:`equiopt.maps.normuon_rows`) on this rank's ``block`` of a
    parameter's polar factors ``o`` (stored layout), updating ``second`` (this rank's block
    of the row second moments) in place; returns the block of the update.

    Each row's mean square needs its whole row: the row sums are all-reduced over the mesh
    axes that cut the columns. Each work matrix's rescaling (its Frobenius norm kept) needs
    all its rows: the two totals per work matrix are all-reduced over the axes that cut the
    rows. The result equals the row stage of the whole matrix on one rank. ``rule``: the
    rule whose :meth:`~equiopt.optim.rules.Rule.row_moments_` updates the moments."""
    if row_axes(layout, sharding.shape).row is None:
        return _fused_row_stage(o, second, weight, eps, layout, sharding, block, rule)
    return _row_stage(o, second, weight, eps, layout, sharding, block, 0, rule)


def block_row_stages(
    os: list[torch.Tensor],
    seconds: list[torch.Tensor],
    weights: list,
    eps: float,
    layout: Layout,
    sharding,
    block,
    rule: Rule,
) -> list[torch.Tensor]:
    """:func:`block_row_stage` of several parameters whose blocks, layouts and placements are
    alike (a model's layers), stacked: one set of operators and one all-reduce of each kind
    for all of them (the same bytes as one each); their row moments are written back."""
    if len(os) == 1 or row_axes(layout, sharding.shape).row is None:
        return [block_row_stage(*a, eps, layout, sharding, block, rule) for a in zip(os, seconds, weights)]
    second = torch.stack(seconds)
    weight = torch.stack([w if torch.is_tensor(w) else torch.tensor(w) for w in weights])
    out = _row_stage(
        torch.stack(os), second, weight.view(-1, *[1] * seconds[0].ndim), eps, layout, sharding, block, 1, rule
    )
    torch._foreach_copy_(seconds, list(second.unbind(0)))
    return list(out.unbind(0))


def _row_stage(o, second, weight, eps: float, layout: Layout, sharding, block, extra: int, rule: Rule) -> torch.Tensor:
    """:func:`block_row_stage` on ``o`` with ``extra`` leading dimensions of stacked blocks."""
    axes = row_axes(layout, sharding.shape)
    assert axes.row is not None
    batch, row, cols = axes.batch + extra, axes.row + extra, tuple(c + extra for c in axes.cols)
    row_cut, col_cut = stage_axes(layout, sharding)
    o_sq = o.square().sum(dim=cols)  # (*stack, *batch, rows of the block)
    o_sq = _sum(o_sq, sharding, col_cut)
    d = rule.row_moments_(o_sq / math.prod(sharding.shape[c] for c in axes.cols), second, weight, eps, o.dtype)
    start, rows = block[axes.row][0], o.shape[row]
    segments = torch.arange(start, start + rows, device=o.device) // axes.segment
    totals = o_sq.new_zeros(*o_sq.shape[:-1], sharding.shape[axes.row] // axes.segment, 2)
    totals.index_add_(-2, segments, torch.stack([o_sq, d.square() * o_sq], dim=-1))
    totals = _sum(totals, sharding, row_cut)
    ratio = (totals[..., 0] / totals[..., 1].clamp_min(torch.finfo(totals.dtype).tiny)).sqrt()
    scale = d * ratio.index_select(-1, segments)
    return o * scale.reshape([o.shape[k] if k < batch or k == row else 1 for k in range(o.ndim)])


def _fused_row_stage(o, second, weight, eps, layout: Layout, sharding, block, rule: Rule) -> torch.Tensor:
    """:func:`block_row_stage` for a fused layout, whose work rows mix stored axes: the
    block is placed in a zero tensor of its batch entries' whole matrices (one per rank,
    for the moment), whose work rows give this rank's share of every row sum; those are
    all-reduced over the axes that cut more than the batch, after which every rank holds
    every row's statistics and rescales its own entries."""
    lead = row_axes(layout, sharding.shape).batch
    whole = o.new_zeros(*o.shape[:lead], *sharding.shape[lead:])
    index: tuple = (Ellipsis,) + tuple(slice(a, b) for a, b in block[lead:])
    whole[index] = o.square()
    works = layout.to_work_list(whole)
    flat = [w.sum(dim=-1).reshape(*o.shape[:lead], -1) for w in works]
    o_sq = _sum(torch.cat(flat, dim=-1), sharding, stage_axes(layout, sharding)[1])
    counts = torch.cat([o_sq.new_full((f.shape[-1],), float(w.shape[-1])) for f, w in zip(flat, works)])
    d = rule.row_moments_(o_sq / counts, second, weight, eps, o.dtype)
    scales, at = [], 0
    for w in works:  # each work matrix's rescaling from its rows' totals
        rows = w.shape[:-1]
        sq = o_sq.narrow(-1, at, math.prod(rows[lead:])).reshape(rows)
        dw = d.narrow(-1, at, math.prod(rows[lead:])).reshape(rows)
        at += math.prod(rows[lead:])
        ratio = sq.sum(-1, keepdim=True) / (dw.square() * sq).sum(-1, keepdim=True).clamp_min(
            torch.finfo(sq.dtype).tiny
        )
        scales.append((dw * ratio.sqrt()).unsqueeze(-1).expand(w.shape))
    scale = layout.from_work(scales if len(scales) > 1 else scales[0])
    return o * scale[index]


def stage_bytes(layout: Layout, sharding, block, item: int) -> int:
    """Bytes :func:`block_row_stage` all-reduces on ``block``: the row sums where the
    columns are cut, the per-matrix totals where the rows are."""
    axes = row_axes(layout, sharding.shape)
    row_cut, col_cut = stage_axes(layout, sharding)
    lead = math.prod(b - a for a, b in block[: axes.batch])
    rows = row_moment_block(layout, sharding.shape, block)[-1]
    sent = lead * rows * item if col_cut else 0
    if row_cut and axes.row is not None:
        sent += lead * (sharding.shape[axes.row] // axes.segment) * 2 * item
    return sent
