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
  each block once each way (the update in the map's own dtype: Muon's bfloat16).

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
    "shard_like",
    "update_dtype",
    "exchange_bytes",
]


class Placed(NamedTuple):
    """How a sharded part's members are placed: ``flags`` the process group its flags agree
    over (the ranks that hold its pieces), ``plan`` the members' :class:`~.sharded.Plan`,
    ``global_work`` one member's global work shape, and what a bucket of such parts shares
    (:attr:`signature`): for ``"owner"``, the exchange's global ``ranks`` and the work
    ``axis`` its split cuts (``-2`` rows, ``-1`` columns)."""

    flags: Any
    flag_ranks: tuple[int, ...]
    plan: Plan
    global_work: tuple[int, ...]
    ranks: tuple[int, ...] = ()
    axis: int | None = None

    @property
    def key(self) -> tuple:
        """What the members of one part share (their flags' ranks, plan, shape and signature)."""
        return (self.flag_ranks, self.plan, self.global_work, self.signature)

    @property
    def signature(self) -> tuple | None:
        """What the parts of one bucket must share beyond their map and work shape: the
        exchange (None for a local plan, whose parts may join any bucket)."""
        if self.plan.how == "owner":
            return ("owner", self.ranks, self.axis)
        return None

    def map_fn(self) -> Callable[..., maps.Factored] | None:
        """The ``map_fn`` of a bucket of such parts (None: the plain map)."""
        if self.plan.how == "owner":
            return OwnerMap(self.flags, self.axis)  # type: ignore[arg-type]
        return None


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
    return Placed(flags, flag_ranks, how, global_work, flag_ranks, axis)


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


class OwnerMap:
    """The ``map_fn`` (:func:`~.stages.bucket_core`) of a bucket whose work matrices are cut
    along ``axis`` (``-2`` rows, ``-1`` columns) into equal blocks over ``group``: see the
    module. Returns this rank's blocks of every update, materialised (a matrix whose update
    is not finite is not finite in every block, so every rank's guard refuses it)."""

    def __init__(self, group: Any, axis: int):
        import torch.distributed as dist

        self.group, self.axis = group, axis
        self.ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def __call__(
        self, key: MapKey, eta: Any, x: torch.Tensor, narrow: bool = False, sums=None, finite=None
    ) -> maps.Factored:
        # (``sums``, the momentum stage's by-product, holds this rank's blocks only: the owner reads its own)
        count, ranks = x.shape[0], self.ranks
        counts = [equal_shares(count, ranks, r)[2] for r in range(ranks)]
        mine = counts[self.rank]
        block = x.shape[-2:]
        sent = x.reshape(count, block.numel()).contiguous()
        got = x.new_empty((ranks * mine, block.numel()))
        _all_to_all(got, sent, [mine] * ranks, counts, self.group)
        pieces = got.view(ranks, mine, *block)
        # rank s's block is the s-th run of rows (columns) of each matrix of this rank's share
        if self.axis == -2:
            whole = pieces.transpose(0, 1).reshape(mine, ranks * block[0], block[1])
        else:
            whole = pieces.permute(1, 2, 0, 3).reshape(mine, block[0], ranks * block[1])
        if mine:
            f = divided.map_share(key, eta, whole, narrow)  # (this rank's share of the bucket, as a divided one's)
            u = maps.materialize(f)
            ok = factor_flags(f)
            u = u.masked_fill(~ok.view(-1, 1, 1), float("nan"))
        else:  # (a rank past the end maps nothing)
            u = x.new_empty((0, *whole.shape[-2:]), dtype=update_dtype(key, eta, whole.shape[-2:], x, narrow))
        if self.axis == -2:
            back = u.view(mine, ranks, block[0], block[1]).transpose(0, 1)
        else:
            back = u.view(mine, block[0], ranks, block[1]).permute(2, 0, 1, 3)
        out = u.new_empty((count, block.numel()))
        _all_to_all(out, back.reshape(ranks * mine, block.numel()).contiguous(), counts, [mine] * ranks, self.group)
        out = out.view(count, *block)
        if finite is not None:
            finite.copy_(factor_flags(maps.Factored(out)))
        return maps.Factored(out)


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
