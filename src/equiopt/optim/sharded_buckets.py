"""Buckets of sharded parameters (FSDP2's ``Shard(0)``, HSDP, any even split of a DTensor).

A sharded parameter joins a bucket like a local one: its part stacks this rank's blocks of
the weights, gradients and momenta (its state entries stay DTensors, each a view of the
stack's member), so a bucket's stages run once for all of its members whatever the
placement. Two things differ from a local part, and they enter here alone:

- **The flags agree.** A member is skipped on every rank when its gradient is not finite on
  any: each part's flags are made from its blocks and then all-reduced (minimum) over the
  ranks that hold its pieces (:class:`Agree`), before the momentum reads them, and the
  skip counters count the agreed flags, as the per-parameter step's :func:`~.sharded.global_flags`.
- **The map sees whole matrices.** A parameter whose :class:`~.sharded.Plan` is ``"local"``
  (the split falls between whole work matrices: heads, experts) maps its block as it is. One whose plan is
  ``"owner"`` and whose split cuts one work axis into equal contiguous blocks (``Shard(0)``
  of a row, column or column-heads layout, no replicas dividing the owner work) is mapped
  by :class:`OwnerMap`: the bucket's ``N`` work matrices are dealt to the group's ``R``
  ranks in contiguous shares of ``ceil(N / R)``; one ``all_to_all`` brings every block of a
  rank's share to it, it maps its whole matrices in one batched call, and a second
  ``all_to_all`` returns each rank the blocks of the update it holds. What crosses ranks is
  each block once each way (the update in the map's own dtype: Muon's bfloat16). Parts cut
  along rows and parts cut along columns share one bucket where their whole matrices have
  one shape (a gate's rows and a down projection's columns): their blocks have equal sizes
  and travel end to end, each run reassembled along its own axis (:class:`Run`).

A bucket's exchange is waited for before its update is added (the per-parameter step's
owner exchange starts in waves beside the maps, ``overlap``). Everything else keeps the
per-parameter step (:mod:`.per_parameter`), named in docs/step.md: uneven splits,
``"reduce"`` plans (their all-reduces overlap each other's maps there), HSDP's owner work
(its replicas divide it), row moments, AdamW on sharded parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .. import maps
from ..distributed.collectives import equal_shares
from ..distributed.placements import Sharding, mesh_group
from ..layouts import Col, Heads, Row
from ..linalg.device_choices import decide_as, decides_like
from . import divided
from .rules import MapKey, factor_flags, factored_map, rule_of
from .sharded import Plan, cuts, group_ranks

if TYPE_CHECKING:
    from .engine import EquivariantOptimizer

__all__ = [
    "Placed",
    "placed_member",
    "Agree",
    "OwnerMap",
    "Run",
    "bucket_map",
    "shard_like",
    "update_dtype",
    "exchange_bytes",
]


class Placed(NamedTuple):
    """How a sharded part's members are placed: ``flags`` the process group its flags agree
    over (the ranks that hold its pieces), ``plan`` the members' :class:`~.sharded.Plan`,
    ``global_work`` one member's global work shape, and what a bucket of such parts shares
    (:attr:`signature`): for ``"owner"``, the exchange over ``flag_ranks``; ``axis``: the
    work axis an owner plan's split cuts (``-2`` rows, ``-1`` columns)."""

    flags: Any
    flag_ranks: tuple[int, ...]
    plan: Plan
    global_work: tuple[int, ...]
    axis: int | None = None

    @property
    def key(self) -> tuple:
        """What the members of one part share (their flags' ranks, plan, shape, cut axis and signature)."""
        return (self.flag_ranks, self.plan, self.global_work, self.axis, self.signature)

    @property
    def signature(self) -> tuple | None:
        """What the parts of one bucket must share beyond their map and (global) work shape:
        the exchange's ranks (None for a local plan, whose parts may join any bucket). Parts
        cut along different axes share an exchange: their blocks have equal sizes."""
        if self.plan.how == "owner":
            return ("owner", self.flag_ranks)
        return None


def bucket_map(parts: list) -> Callable[..., maps.Factored] | None:
    """The ``map_fn`` of a bucket of ``parts`` (:class:`~.buckets.Part`; None: the plain map):
    an :class:`OwnerMap` over their exchange where they are owner-mapped."""
    placed = parts[0].placed
    if placed is None or placed.plan.how != "owner":
        return None
    runs = [Run(part.per_member * len(part.params), part.work_shape[-2:], part.placed.axis) for part in parts]
    return OwnerMap(placed.flags, runs)


def placed_member(opt: EquivariantOptimizer, group: dict, j: int, sharding: Sharding) -> Placed | None:
    """The :class:`Placed` of parameter ``j`` of ``group`` where its blocks may join a
    bucket (see the module), else None."""
    rule = rule_of(group)
    if rule.kind != "matrix" or rule.row_moments or not sharding.is_sharded:
        return None
    for d, split in sharding.splits.items():  # equal blocks on every rank
        ranks = math.prod(sharding.mesh_shape[a] for a in split.axes)
        if sharding.shape[d] % ranks:
            return None
    layout = group["layouts"][j]
    if layout.num_blocks != 1:
        return None
    how = opt.plan_of(group, layout, sharding)
    axes = sharding.split_axes
    global_work = tuple(layout.work_shapes(sharding.shape)[0])
    flags, flag_ranks = mesh_group(sharding.mesh, axes), group_ranks(sharding, axes)
    if how.how == "local":
        return Placed(flags, flag_ranks, how, global_work)
    # ("reduce" plans keep the per-parameter step, whose reduce buckets overlap their
    # all-reduces with each other's maps; a centring over split rows needs its sums completed)
    if how.how != "owner" or rule.centres_in_place(group):
        return None
    # owner: the split (of dimension 0 of a matrix, over one mesh axis, no replicas dividing
    # the owner work) cuts one work axis into contiguous runs in rank order: a row, column
    # or column-heads layout
    if how.replicas or len(sharding.shape) != 2 or list(sharding.splits) != [0] or len(axes) != 1:
        return None
    if not (isinstance(layout, (Row, Col)) or isinstance(layout, Heads) and layout.axis == "cols"):
        return None
    cut = cuts(layout, sharding)
    axis = -2 if cut["rows"] else -1
    return Placed(flags, flag_ranks, how, global_work, axis)


def shard_like(view: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``view`` (this rank's block of a state entry shaped like ``p``) as a DTensor placed as ``p``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        view,
        p.device_mesh,  # type: ignore[attr-defined]
        p.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=p.shape,
        stride=p.stride(),
    )


class Agree:
    """The flags of a sharded part made global (the minimum over ``group``'s ranks): called by
    :func:`~.stages.bucket_core` with the part's ``(ok, reported)`` flags, its skip counters
    (which counted this rank's own) and its ``present`` mask (the same on every rank); one
    all-reduce of one float per member."""

    def __init__(self, group: Any):
        self.group = group

    def __call__(
        self, ok: torch.Tensor, reported: torch.Tensor, counters: torch.Tensor, present: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        # ``reported`` is False exactly for a present member that is not finite here
        both = reported.to(torch.float32)
        dist.all_reduce(both, op=dist.ReduceOp.MIN, group=self.group)
        agreed = both > 0.5
        counters.add_(reported & ~agreed)  # a rank whose own block was finite counts the others'
        return (agreed if present is None else agreed & present), agreed


class Run(NamedTuple):
    """``matrices`` consecutive work matrices of an owner-mapped bucket whose blocks on this
    rank are ``block``-shaped, cut along work ``axis`` (``-2`` rows, ``-1`` columns)."""

    matrices: int
    block: tuple[int, ...]
    axis: int


class OwnerMap:
    """The ``map_fn`` (:func:`~.stages.bucket_core`) of a bucket of owner-mapped parts over
    ``group``: ``runs`` (:class:`Run`) say how each run of its work matrices is cut into
    equal blocks (every block of the bucket has as many entries; the map's input holds them
    end to end, shaped as the first run's). See the module. Returns this rank's blocks of
    every update, end to end in the input's shape, materialised (a matrix whose update is
    not finite is not finite in every block, so every rank's guard refuses it)."""

    def __init__(self, group: Any, runs: list[Run]):
        import torch.distributed as dist

        self.group, self.runs = group, runs
        self.ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def __call__(
        self, key: MapKey, eta: Any, x: torch.Tensor, narrow: bool = False, sums=None, finite=None
    ) -> maps.Factored:
        # (``sums``, the momentum stage's by-product, holds this rank's blocks only: the owner reads its own)
        count, ranks = x.shape[0], self.ranks
        counts = [equal_shares(count, ranks, r)[2] for r in range(ranks)]
        _, start, mine = equal_shares(count, ranks, self.rank)
        size = x.shape[-2:].numel()
        got = x.new_empty((ranks * mine, size))
        _all_to_all(got, x.reshape(count, size).contiguous(), [mine] * ranks, counts, self.group)
        # rank s's block is the s-th run of rows (columns) of each matrix of this rank's share
        # (each buffer is let go as soon as the next is made: the step's peak holds two at most)
        spans = self._spans(start, mine)
        wholes = [_whole(_span(got.view(ranks, mine, size), 1, at, n), run) for at, n, run in spans]
        del got
        if mine:
            whole = wholes[0] if len(wholes) == 1 else torch.cat(wholes)
            del wholes
            f = divided.map_share(key, eta, whole, narrow)  # (this rank's share of the bucket, as a divided one's)
            del whole
            ok = factor_flags(f)
            u = maps.materialize(f).masked_fill(~ok.view(-1, 1, 1), float("nan"))
            del f
        else:  # (a rank past the end maps nothing)
            shape = _whole_shape(self.runs[0], ranks)
            u = x.new_empty((0, *shape), dtype=update_dtype(key, eta, shape, x, narrow))
        backs = [_blocks(_span(u, 0, at, n), run, ranks) for at, n, run in spans]
        out = u.new_empty((count, size))
        del u
        back = backs[0] if len(backs) == 1 else torch.cat(backs, dim=1) if backs else out.new_empty((ranks, 0, size))
        del backs
        _all_to_all(out, back.reshape(ranks * mine, size), counts, [mine] * ranks, self.group)
        out = out.view(x.shape)
        if finite is not None:
            finite.copy_(factor_flags(maps.Factored(out)))
        return maps.Factored(out)

    def _spans(self, start: int, mine: int) -> list[tuple[int, int, Run]]:
        """``(offset in the share, count, run)`` of each run the share ``[start, start + mine)`` meets."""
        out, at = [], 0
        for run in self.runs:
            lo, hi = max(at, start), min(at + run.matrices, start + mine)
            if lo < hi:
                out.append((lo - start, hi - lo, run))
            at += run.matrices
        return out


def _span(t: torch.Tensor, dim: int, at: int, n: int) -> torch.Tensor:
    return t if at == 0 and n == t.shape[dim] else t.narrow(dim, at, n)


def _whole_shape(run: Run, ranks: int) -> tuple[int, int]:
    rows, cols = run.block
    return (rows * ranks, cols) if run.axis == -2 else (rows, cols * ranks)


def _whole(pieces: torch.Tensor, run: Run) -> torch.Tensor:
    """Whole matrices from ``pieces`` ``(ranks, n, size)``: rank ``s``'s block of each is its
    ``s``-th run of rows (``run.axis`` -2) or columns (-1)."""
    ranks, n = pieces.shape[:2]
    rows, cols = run.block
    blocks = pieces.view(ranks, n, rows, cols)
    if run.axis == -2:
        return blocks.transpose(0, 1).reshape(n, ranks * rows, cols)
    return blocks.permute(1, 2, 0, 3).reshape(n, rows, ranks * cols)


def _blocks(u: torch.Tensor, run: Run, ranks: int) -> torch.Tensor:
    """The inverse of :func:`_whole`: ``(ranks, n, size)`` blocks of whole matrices ``u``."""
    n = u.shape[0]
    rows, cols = run.block
    if run.axis == -2:
        blocks = u.view(n, ranks, rows, cols).transpose(0, 1)
    else:
        blocks = u.view(n, rows, ranks, cols).permute(2, 0, 1, 3)
    return blocks.reshape(ranks, n, rows * cols)


def update_dtype(key: MapKey, eta: Any, shape: tuple[int, ...], like: torch.Tensor, narrow: bool) -> torch.dtype:
    """The dtype of the update that map ``key`` makes of a ``shape`` matrix of ``like``'s dtype
    on its device (what :class:`OwnerMap` returns: Muon's narrow factor in its iteration's
    dtype), found on the meta device."""
    x = torch.empty((1, *shape[-2:]), dtype=like.dtype, device="meta")
    with decide_as(decides_like(like)):
        return maps.materialize(factored_map(key, eta, x, narrow=narrow)).dtype


def _all_to_all(out: torch.Tensor, sent: torch.Tensor, received: list[int], given: list[int], group: Any) -> None:
    """``all_to_all_single`` along dimension 0 in units of rows: ``given[r]`` rows of ``sent`` to
    rank ``r``, ``received[r]`` rows from it into ``out``."""
    import torch.distributed as dist

    dist.all_to_all_single(out, sent, output_split_sizes=received, input_split_sizes=given, group=group)


def exchange_bytes(count: int, block: int, ranks: int, mine: int, sent_item: int, update_item: int) -> int:
    """Bytes one rank's :class:`OwnerMap` hands the two all-to-alls of a bucket of ``count``
    matrices of ``block`` entries per block, ``mine`` of them its own to map: every block
    of every matrix out, and every rank's block of its own back."""
    return count * block * sent_item + ranks * mine * block * update_item
