"""Buckets of sharded parameters (FSDP2's ``Shard(0)``, HSDP, any even split of a DTensor).

A sharded parameter joins a bucket like a local one: its part stacks this rank's blocks of
the weights, gradients and momenta (its state entries stay DTensors, each a view of the
stack's member), so a bucket's stages run once for all of its members whatever the
placement. Two things differ from a local part, and they enter here alone:

- **The flags agree.** A member is skipped on every rank when its gradient is not finite on
  any: each part's flags are made from its blocks and then all-reduced (minimum) over the
  ranks that hold its pieces (:func:`agree_all`: one all-reduce per bucket and process
  group), before the momentum reads them, and the
  skip counters count the agreed flags, as the per-parameter step's :func:`~.sharded.global_flags`.
- **The map sees whole matrices.** A parameter whose :class:`~.sharded.Plan` is ``"local"``
  (the split falls between whole work matrices: heads, experts) maps its block as it is. One
  whose plan is ``"owner"`` and whose split cuts one work axis into equal contiguous blocks
  (``Shard(0)`` of a row, column or column-heads layout, over one mesh axis) is mapped by
  :class:`OwnerMap`: the bucket's ``N`` work matrices are dealt to the ranks of its exchange
  in contiguous runs, each matrix to the least-loaded rank, the owner work of the buckets
  before it counted (:func:`owner_deals`); one ``all_to_all`` brings every block of a rank's
  matrices to it, it maps them in one batched call, and a second ``all_to_all`` returns each
  rank the blocks of the update it holds. What crosses ranks is each block once each way
  (the update in the map's own dtype: Muon's bfloat16). Parts cut along rows and parts cut
  along columns share one bucket where their whole matrices have one shape (a gate's rows
  and a down projection's columns): their blocks have equal sizes and travel end to end,
  each run reassembled along its own axis (:class:`Run`).
- **Replicas divide the owner work** (HSDP's, mesh axes before the split's): the exchange
  spans the replicas and the holders, replica-major; each matrix's blocks come from the
  holders in its owner's replica, and the owner returns its update blocks to the holders
  in every replica. The whole-matrix tasks of the per-parameter step over the same ranks
  then divide among the replicas too; they take their owners first, and the buckets'
  matrices are dealt around them (:func:`owner_deals`).

A bucket's exchange is waited for before its update is added (the per-parameter step's
owner exchange starts in waves beside the maps, ``overlap``). Everything else keeps the
per-parameter step (:mod:`.per_parameter`), named in docs/step.md: uneven splits,
``"reduce"`` plans (their all-reduces overlap each other's maps there), row moments, AdamW
on sharded parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .. import maps
from ..distributed.placements import mesh_group
from ..layouts import Col, Heads, Row
from ..linalg.device_choices import decide_as, decides_like
from . import divided
from .costs import map_flops
from .owners import assign, deal, map_cost
from .rules import MapKey, factor_flags, factored_map, map_key, rule_of
from .sharded import Plan, cuts, group_ranks, replica_family

if TYPE_CHECKING:
    from .engine import EquivariantOptimizer

__all__ = [
    "Placed",
    "placed_member",
    "Agree",
    "agree_all",
    "OwnerMap",
    "Run",
    "bucket_map",
    "owner_deals",
    "whole_task",
    "shard_like",
    "update_dtype",
    "exchange_bytes",
]


class Placed(NamedTuple):
    """How a sharded part's members are placed: ``flags`` the process group its flags agree
    over (the ranks that hold its pieces, ``flag_ranks``), ``plan`` the members'
    :class:`~.sharded.Plan`, ``global_work`` one member's global work shape; for an owner
    plan, ``axis`` the work axis its split cuts (``-2`` rows, ``-1`` columns), ``exchange``
    the process group of its exchange (``exchange_ranks``: the holders of its pieces and,
    replica-major before them, the ``replicas`` replicas that divide the owner work)."""

    flags: Any
    flag_ranks: tuple[int, ...]
    plan: Plan
    global_work: tuple[int, ...]
    axis: int | None = None
    exchange: Any = None
    exchange_ranks: tuple[int, ...] = ()
    replicas: int = 1
    family: tuple = ()  # the owner work's :func:`~.sharded.replica_family`

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
            return ("owner", self.exchange_ranks, self.replicas)
        return None


def bucket_map(parts: list, deal: tuple[int, ...] | None) -> Callable[..., maps.Factored] | None:
    """The ``map_fn`` of a bucket of ``parts`` (:class:`~.buckets.Part`; None: the plain map):
    an :class:`OwnerMap` over their exchange where they are owner-mapped, by ``deal``
    (:func:`owner_deals`)."""
    placed = parts[0].placed
    if placed is None or placed.plan.how != "owner" or deal is None:
        return None
    runs = [Run(part.per_member * len(part.params), part.work_shape[-2:], part.placed.axis) for part in parts]
    return OwnerMap(placed.exchange, runs, deal, placed.replicas)


def placed_member(opt: EquivariantOptimizer, group: dict, j: int) -> Placed | None:
    """The :class:`Placed` of parameter ``j`` of ``group`` where its blocks may join a
    bucket (see the module), else None."""
    rule = rule_of(group)
    sharding = opt._sharding(group["params"][j])
    if rule.kind != "matrix" or rule.row_moments or sharding.kind != "sharded" or not sharding.is_sharded:
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
    # owner: the split (of dimension 0 of a matrix, over one mesh axis) cuts one work axis
    # into contiguous runs in rank order (a row, column or column-heads layout); replicas
    # that divide the owner work come before it on the mesh (HSDP's), so that the exchange's
    # ranks are replica-major
    if len(sharding.shape) != 2 or list(sharding.splits) != [0] or len(axes) != 1:
        return None
    if any(a > axes[0] for a in how.replicas) or set(how.axes) != set(axes) | set(how.replicas):
        return None
    if not (isinstance(layout, (Row, Col)) or isinstance(layout, Heads) and layout.axis == "cols"):
        return None
    cut = cuts(layout, sharding)
    axis = -2 if cut["rows"] else -1
    replicas = math.prod(sharding.mesh_shape[a] for a in how.replicas)
    exchange, exchange_ranks = (
        (flags, flag_ranks)
        if not how.replicas
        else (
            mesh_group(sharding.mesh, how.axes),
            group_ranks(sharding, how.axes),
        )
    )
    family = replica_family(sharding, how.axes)
    return Placed(flags, flag_ranks, how, global_work, axis, exchange, exchange_ranks, replicas, family)


def whole_task(opt: EquivariantOptimizer, group: dict, j: int) -> tuple[tuple, float, float, int] | None:
    """``(family, cost, flops, ranks)`` of parameter ``j`` of ``group`` where the per-parameter
    step maps it whole on an owner (a sharded matrix whose plan is ``"owner"``): its
    :func:`~.sharded.replica_family`, :func:`~.owners.map_cost` (what that step deals by),
    map FLOPs and the ranks of that family; else None."""
    p = group["params"][j]
    sharding = opt._sharding(p)
    if rule_of(group).kind != "matrix" or sharding.kind != "sharded" or not sharding.is_sharded:
        return None
    layout = group["layouts"][j]
    how = opt.plan_of(group, layout, sharding)
    if how.how != "owner":
        return None
    ranks = math.prod(sharding.mesh_shape[a] for a in how.axes)
    works = layout.work_shapes(sharding.shape)
    key = map_key(group)
    # (its owner as the per-parameter step picks it, by map_cost; its load in the map's FLOPs)
    return (
        replica_family(sharding, how.axes),
        sum(map_cost(w) for w in works),
        sum(map_flops(key, w) for w in works),
        ranks,
    )


def owner_deals(
    buckets: list[tuple[MapKey, tuple[int, ...], Placed | None, int]],
    wholes: Sequence[tuple[tuple, float, float, int]] = (),
) -> tuple[list[tuple[int, ...] | None], frozenset]:
    """How many of its matrices each rank of its exchange maps, for every bucket of
    ``(map, work shape, its parts' placement, its count of work matrices)`` in order (None where
    it is not owner-mapped), and the :func:`~.sharded.replica_family` of every such
    exchange (whose replicas then divide the per-parameter owner work over the same ranks
    too, :func:`~.sharded.owner_batches`). The per-parameter step's whole-matrix tasks
    (``wholes``, :func:`whole_task`) take their owners first, as it deals them (longest
    first, :func:`~.owners.assign`); then each bucket's matrices go one at a time to the
    least-loaded rank of its family, so that small buckets do not all land on one rank and
    the large tasks stay alone. Loads count the maps' FLOPs (:func:`~.costs.map_flops`).
    From global shapes alone: the same on every rank."""
    start: dict[tuple, list[float]] = {}
    by_family: dict[tuple, tuple[int, list[float], list[float]]] = {}
    for family, cost, flops, ranks in wholes:
        entry = by_family.setdefault(family, (ranks, [], []))
        entry[1].append(cost)
        entry[2].append(flops)
    for family, (size, costs, work) in by_family.items():
        row = start[family] = [0.0] * size
        for owner, f in zip(assign(costs, size), work):
            row[owner] += f
    loads: dict[tuple, list[float]] = {}
    deals: list[tuple[int, ...] | None] = []
    for key, shape, placed, count in buckets:
        if placed is None or placed.plan.how != "owner":
            deals.append(None)
            continue
        found = loads.get(placed.family)
        if found is None:  # (a family's whole-matrix tasks and buckets span the same ranks)
            found = loads[placed.family] = start.get(placed.family) or [0.0] * len(placed.exchange_ranks)
        deals.append(deal(count, map_flops(key, tuple(shape[-2:])), found))
    return deals, frozenset(loads)


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
    """What makes a sharded part's flags global: the minimum over ``group``'s ranks (the
    ranks that hold its pieces), taken for a whole bucket by :func:`agree_all`."""

    def __init__(self, group: Any):
        self.group = group


def agree_all(
    agrees: list[Agree | None],
    oks: list[torch.Tensor],
    reported: list[torch.Tensor],
    counters: list[torch.Tensor],
    presents: list[torch.Tensor | None],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each part's ``(ok, reported)`` flags, those of a sharded part (its ``agrees`` entry)
    made global: called by :func:`~.stages.bucket_core` with every part's flags, skip
    counters (which counted this rank's own) and ``present`` masks (the same on every
    rank); one all-reduce of one float per member for the parts of each process group."""
    import torch.distributed as dist

    out = list(zip(oks, reported))
    groups: dict[int, list[int]] = {}
    for i, agree in enumerate(agrees):
        if agree is not None:
            groups.setdefault(id(agree.group), []).append(i)
    for members in groups.values():
        # ``reported`` is False exactly for a present member that is not finite here
        flags = [reported[i] for i in members]
        joined = flags[0] if len(flags) == 1 else torch.cat(flags)
        both = joined.to(torch.float32)
        dist.all_reduce(both, op=dist.ReduceOp.MIN, group=agrees[members[0]].group)  # type: ignore[union-attr]
        every = both > 0.5
        # a rank whose own block was finite counts the others' refusals
        others = joined & ~every
        at = 0
        for i in members:
            n = reported[i].shape[0]
            agreed, refused = (
                (every, others) if len(members) == 1 else (every.narrow(0, at, n), others.narrow(0, at, n))
            )
            at += n
            counters[i].add_(refused)
            present = presents[i]
            out[i] = (agreed if present is None else agreed & present, agreed)
    return out


class Run(NamedTuple):
    """``matrices`` consecutive work matrices of an owner-mapped bucket whose blocks on this
    rank are ``block``-shaped, cut along work ``axis`` (``-2`` rows, ``-1`` columns)."""

    matrices: int
    block: tuple[int, ...]
    axis: int


class OwnerMap:
    """The ``map_fn`` (:func:`~.stages.bucket_core`) of a bucket of owner-mapped parts over
    ``group`` (``replicas`` replicas of the ranks that hold the pieces, replica-major):
    ``runs`` (:class:`Run`) say how each run of its work matrices is cut into equal blocks
    (every block of the bucket has as many entries; the map's input holds them end to end,
    shaped as the first run's). See the module. Returns this rank's blocks of every
    update, end to end in the input's shape, materialised (a matrix whose update is not
    finite is not finite in every block, so every rank's guard refuses it).

    ``deal``: how many of the matrices each rank of ``group`` maps, in rank order
    (:func:`owner_deals`). With replicas, they are dealt over every rank of ``group``; a rank sends its
    blocks of the matrices its own replica's ranks map, and every owner returns its update
    blocks to the holders of those blocks in every replica."""

    def __init__(self, group: Any, runs: list[Run], deal: tuple[int, ...], replicas: int = 1):
        import torch.distributed as dist

        self.group, self.runs, self.replicas = group, runs, replicas
        self.ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if len(deal) != self.ranks or sum(deal) != sum(run.matrices for run in runs):
            raise ValueError(f"OwnerMap: a deal of {deal} does not fit {self.ranks} ranks and {runs}")
        self.counts = list(deal)
        self.holders = self.ranks // replicas  # the ranks of one replica: a matrix's pieces

    def __call__(
        self, key: MapKey, eta: Any, x: torch.Tensor, narrow: bool = False, sums=None, finite=None
    ) -> maps.Factored:
        # (``sums``, the momentum stage's by-product, holds this rank's blocks only: the owner reads its own)
        count, ranks, holders, counts = x.shape[0], self.ranks, self.holders, self.counts
        start, mine = sum(counts[: self.rank]), counts[self.rank]
        mates = range(self.rank - self.rank % holders, self.rank - self.rank % holders + holders)  # my replica's
        first = sum(counts[: mates[0]])
        given = [counts[r] if r in mates else 0 for r in range(ranks)]
        size = x.shape[-2:].numel()
        got = x.new_empty((holders * mine, size))
        sent = _span(x, 0, first, sum(given)).reshape(sum(given), size).contiguous()
        _all_to_all(got, sent, [mine if r in mates else 0 for r in range(ranks)], given, self.group)
        del sent
        # holder s's block is the s-th run of rows (columns) of each matrix of this rank's share
        # (each buffer is let go as soon as the next is made: the step's peak holds two at most)
        spans = self._spans(start, mine)
        wholes = [_whole(_span(got.view(holders, mine, size), 1, at, n), run) for at, n, run in spans]
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
            shape = _whole_shape(self.runs[0], holders)
            u = x.new_empty((0, *shape), dtype=update_dtype(key, eta, shape, x, narrow))
        backs = [_blocks(_span(u, 0, at, n), run, holders) for at, n, run in spans]
        out = u.new_empty((count, size))
        del u
        back = backs[0] if len(backs) == 1 else torch.cat(backs, dim=1) if backs else out.new_empty((holders, 0, size))
        del backs
        if self.replicas > 1:  # (the holders of each block in every replica, replica-major)
            back = back.expand(self.replicas, *back.shape)
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
    """Bytes one rank's :class:`OwnerMap` hands the two all-to-alls for ``count`` matrices
    of ``block`` entries per block that its replica's ranks map, ``mine`` of them its own:
    its block of each out, and the block of each of its own for every one of the
    exchange's ``ranks`` back."""
    return count * block * sent_item + ranks * mine * block * update_item
