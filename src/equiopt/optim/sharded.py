"""The optimizer step on sharded (DTensor) parameters: what each work matrix needs.

A step on a DTensor parameter works on its local block (``to_local()`` of the weight,
the gradient and the state). Per parameter, :func:`plan` reads how the layout turns
every split tensor dimension into work-matrix axes and decides how its map runs:

- ``"local"``: every work matrix lies wholly in this rank's block (replicated
  parameters; expert stacks split by whole experts; heads that the TP split keeps
  whole; any split of a leading batch axis): nothing is sent.
- ``"reduce"``: the splits cut only the work matrices' rows and the map needs only sums
  over rows (row-norm, and the right-Gram one-sided and hybrid maps): the map runs on
  the block with a :class:`ShardSum` over the product group of the cutting mesh axes
  (column sums and the ``d x d`` Gram are all-reduced; uncentred row-norm sends
  nothing). Row-norm also runs when the splits cut the columns (Megatron's vocabulary
  ``Shard(1)``, FSDP's rows of a SwiGLU down projection): the row norms are completed by a
  per-row vector all-reduce over the axes that cut the columns.
- ``"owner"``: anything else (spectral maps of whole matrices, left Grams, heads cut by
  a split, fused layouts whose halves a split cuts): each parameter is mapped on one
  owner rank of the product group of the cutting axes (:mod:`.owners`: its blocks go to
  the owner in one all-to-all for all of them, the update's blocks come back in a
  second), so the work is spread over the ranks.

Axes that split a work matrix's batch (experts, heads) take no part: their ranks hold
different matrices. Every decision depends only on global shapes, placements and mesh
sizes, so all ranks issue the same collectives in the same order, and the same
decisions are made for a fake mesh of any size (``equiopt plan``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..distributed.collectives import equal_shares, gather_shares, scatter_sum
from ..distributed.placements import Sharding, group_coordinates, is_dtensor, mesh_group, row_range
from ..layouts import Col, Experts, Heads, Layout, Row
from .costs import CostModel, map_flops, prefers_reduce
from .owners import assign, elements_sent, joint_block, map_cost
from .rules import MapKey, reducible, rule_named

__all__ = [
    "local",
    "ShardSum",
    "Plan",
    "plan",
    "global_flags",
    "LOCAL",
    "OwnerBatch",
    "owner_batches",
    "owner_units",
    "group_ranks",
]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor behind ``t``, or ``t`` itself: the DTensor's own local tensor, so
    writes into it reach ``t`` and no operator is dispatched (``to_local()``'s alias where
    a DTensor does not expose it)."""
    if not is_dtensor(t):
        return t
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t.to_local()  # type: ignore[attr-defined]


class ShardSum:
    """:class:`equiopt.maps.RowReducer` of a split work matrix: all-reduce (sum) over
    ``group``; ``count`` is the global size of the axis summed over. ``part = (i, n)``:
    this rank is replica ``i`` of ``n`` that hold the same rows, and adds only the ``i``-th
    of ``n`` slices of them to the sums (:meth:`take`), so replicas divide the work.
    ``divide``: :meth:`sum_then` divides the per-matrix work on a batch of completed Grams
    among the group's ranks."""

    def __init__(self, group, count: int, part: tuple[int, int] | None = None, divide: bool = False):
        self.group = group
        self.count = count
        self.part = part
        self.divide = divide

    def take(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self.part is None:
            return t
        a, b = row_range(t.shape[dim], self.part[1], self.part[0])
        return t.narrow(dim, a, b - a)

    def collective(self, start) -> None:
        """Run one collective: ``start(async_op)`` issues it (and returns its work handle
        when ``async_op``); here it runs synchronously."""
        start(False)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = t.contiguous()
        self.collective(lambda async_op: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op))
        return t

    def sum_then(self, t: torch.Tensor, fn, *extras) -> torch.Tensor:
        """``fn(sum(t), *extras)`` for a batch ``t`` of ``(..., d, d)`` partial Grams, where
        ``fn`` maps each matrix on its own to a matrix of the same shape (``extras``: per-matrix
        tensors, batched like ``t``). With ``divide`` and at least one matrix per rank, each
        rank maps only its share of the batch: a reduce-scatter of the partial sums, ``fn`` on
        this rank's completed Grams, an all-gather of the results (padded to equal shares) --
        the two halves of the all-reduce it replaces, so the same bytes when the batch divides
        evenly, and ``1 / n`` of the work of ``fn`` (the inverse square roots)."""
        import torch.distributed as dist

        lead, mat = t.shape[:-2], t.shape[-2:]
        b, n = math.prod(lead), dist.get_world_size(self.group)
        if not self.divide or b < n:
            return fn(self.sum(t), *extras)
        k, first, real = equal_shares(b, n, dist.get_rank(self.group))
        flat = t.reshape(b, *mat)
        if k * n > b:
            flat = torch.cat([flat, flat.new_zeros(k * n - b, *mat)])
        flat = flat.contiguous()
        mine = flat.new_empty(k, *mat)
        self.collective(lambda async_op: scatter_sum(mine, flat, group=self.group, async_op=async_op))
        parts = [e.reshape(b, *e.shape[len(lead) :]).narrow(0, min(first, b), real) for e in extras]
        out = fn(mine[:real], *parts)
        return gather_shares(out, k, b, self.group, self.collective).reshape(*lead, *out.shape[1:])


class Plan(NamedTuple):
    """How one parameter's map runs: ``how`` (``"local"``, ``"reduce"`` or ``"owner"``);
    for ``"reduce"``, the mesh axes that cut the work rows (``rows``, summed over by the
    Gram/column sums), the work columns (``cols``, summed over by row norms) and the
    replica axes that divide the Gram among themselves (``replicas``: each replica sums
    a slice of its rows; HSDP's ``dp_replicate``); for
    ``"owner"``, the axes that cut the rows (``rows``), those that cut anything else
    (``cols``) and the replica axes (``replicas``): the ranks of all of them (:attr:`axes`)
    share the owner work, so replicas divide it instead of repeating it."""

    how: str
    rows: tuple[int, ...] = ()
    cols: tuple[int, ...] = ()
    replicas: tuple[int, ...] = ()

    @property
    def axes(self) -> tuple[int, ...]:
        """Every mesh axis whose ranks take part: those that cut the work and the replicas."""
        return tuple(sorted(set(self.rows) | set(self.cols) | set(self.replicas)))

    @property
    def row_sum_axes(self) -> tuple[int, ...]:
        """The axes a ``"reduce"`` plan's sums over rows run over: the cutting and replica axes."""
        return self.rows + self.replicas


LOCAL = Plan("local")


def _dim_roles(layout: Layout, ndim: int) -> list:
    """What each stored dimension becomes in the work matrices: ``"batch"``, ``"rows"``,
    ``"cols"``, ``("heads", hd)`` (rows in blocks of ``hd``, one work matrix each) or
    ``"opaque"`` (a fused layout's axis: any cut needs the whole tensor)."""
    if isinstance(layout, Experts):
        return _dim_roles(layout.inner, ndim)
    lead = ["batch"] * (ndim - 2)
    if isinstance(layout, Row):
        return lead + ["rows", "cols"]
    if isinstance(layout, Col):
        return lead + ["cols", "rows"]
    if isinstance(layout, Heads):
        heads = ("heads", layout.head_dim)
        return lead + ([heads, "cols"] if layout.axis == "rows" else ["cols", heads])
    inner = getattr(layout, "ndim", 2)
    return ["batch"] * (ndim - inner) + ["opaque"] * inner


def cuts(layout: Layout, sharding: Sharding) -> dict[str, tuple[int, ...]]:
    """The mesh axes (of size > 1) that cut the work matrices' ``rows``, ``cols`` or an
    ``opaque`` axis; axes that split whole work matrices are left out."""
    out: dict[str, set] = {"rows": set(), "cols": set(), "opaque": set()}
    roles = _dim_roles(layout, len(sharding.shape))
    for d, split in sharding.splits.items():
        axes = {a for a in split.axes if sharding.mesh_shape[a] > 1}
        if not axes:
            continue
        role = roles[d]
        if role == "batch":
            continue
        if isinstance(role, tuple):  # heads: whole if every boundary falls between heads
            if all(x % role[1] == 0 for x in split.boundaries()):
                continue
            role = "opaque"
        out[role] |= axes
    return {k: tuple(sorted(v)) for k, v in out.items()}


def plan(key: MapKey, layout: Layout, sharding: Sharding, costs: CostModel | None = None) -> Plan:
    """The :class:`Plan` of a parameter under ``key``'s map (see the module). Where both a
    reduce and an owner plan are possible, ``costs`` picks the cheaper (default: reduce)."""
    if sharding.kind != "sharded":
        return LOCAL
    cut = cuts(layout, sharding)
    if not (cut["rows"] or cut["cols"] or cut["opaque"]):
        return LOCAL
    replicas = tuple(a for a in sharding.replicate_axes if sharding.mesh_shape[a] > 1)
    owner = Plan(
        "owner", rows=cut["rows"], cols=tuple(sorted(set(cut["cols"]) | set(cut["opaque"]))), replicas=replicas
    )
    if cut["opaque"]:
        return owner
    shapes = layout.work_shapes(sharding.shape)
    m, n = shapes[0][-2:]
    if not cut["cols"] and reducible(key, m, n):
        # Gram maps: replicas of the same rows sum one slice each instead of all of them
        reduce = Plan("reduce", rows=cut["rows"], replicas=replicas if not rule_named(key.rule).row_wise else ())
    elif rule_named(key.rule).row_wise:
        reduce = Plan("reduce", rows=cut["rows"], cols=cut["cols"])
    else:
        return owner
    if costs is None or prefers_reduce(costs, key, shapes, sharding.mesh_shape, reduce, owner):
        return reduce
    return owner


def reducers(how: Plan, sharding: Sharding, work_shape) -> tuple:
    """The row and column :class:`ShardSum` of a ``"reduce"`` plan (None where nothing is cut)."""
    m, n = work_shape[-2:]
    part = None
    if how.replicas:
        sizes = [sharding.mesh_shape[a] for a in how.replicas]
        index = 0
        for a, size in zip(how.replicas, sizes):
            index = index * size + sharding.coordinate[a]
        part = (index, math.prod(sizes))
    rows = ShardSum(mesh_group(sharding.mesh, how.row_sum_axes), m, part) if how.rows else None
    cols = ShardSum(mesh_group(sharding.mesh, how.cols), n) if how.cols else None
    return rows, cols


def global_flags(flags: torch.Tensor, shardings: list[Sharding]) -> torch.Tensor:
    """Finite flags made global: each sharded parameter's flag is the minimum over the
    ranks that hold its pieces (one all-reduce of the group's flags per process group)."""
    import torch.distributed as dist

    groups: dict[tuple[int, ...], tuple] = {}
    for k, s in enumerate(shardings):
        if s.kind == "sharded" and s.is_sharded:
            groups.setdefault(group_ranks(s, s.split_axes), (mesh_group(s.mesh, s.split_axes), []))[1].append(k)
    for pg, members in groups.values():
        mask = torch.zeros(len(shardings), dtype=torch.bool, device=flags.device)
        mask[members] = True
        reduced = flags.to(torch.float32)
        dist.all_reduce(reduced, op=dist.ReduceOp.MIN, group=pg)
        flags = torch.where(mask, reduced > 0.5, flags)
    return flags


def group_ranks(sharding: Sharding, axes, coordinate=None) -> tuple[int, ...]:
    """Global ranks of the group :func:`mesh_group` makes for ``axes`` around ``coordinate``
    (default: this rank's), in group order."""
    coordinate = tuple(coordinate or sharding.coordinate)
    axes = tuple(axes)
    key = (id(sharding.mesh), axes, tuple(-1 if a in axes else c for a, c in enumerate(coordinate)))
    found = _GROUP_RANKS.get(key)
    if found is None:
        table = sharding.mesh.mesh.tolist()
        found = []
        for c in group_coordinates(sharding.mesh_shape, coordinate, axes):
            entry = table
            for i in c:
                entry = entry[i]
            found.append(entry)
        found = _GROUP_RANKS[key] = tuple(found)
    return found


_GROUP_RANKS: dict = {}


#: Owner work of one process group and dtype is sent in up to this many waves, so that
#: one wave's exchange travels while another's maps run (see EquivariantOptimizer's
#: ``overlap``). Each wave takes every WAVES-th task in the owners' assignment order
#: (longest first), so the waves carry similar work.
WAVES = 4


class OwnerBatch(NamedTuple):
    """Owner-mapped parameters that share one process group and dtype, one wave of them
    (:data:`WAVES`): one all-to-all each way. ``members`` index the tasks; ``me`` is this rank's place in the group;
    ``blocks[k][s]`` is group member ``s``'s block of member ``k``; ``owners[k]`` its owner;
    ``sources[k]`` the members that send their blocks to it: one holder of each distinct
    block (replicas hold the same blocks; every holder gets the update back)."""

    members: list[int]
    me: int
    blocks: list[list[tuple]]
    owners: list[int]
    sources: list[tuple[int, ...]]
    plans: list[Plan]  # each member's plan as run: its replica axes kept or not


def _sources(blocks: list[tuple], coords: list[tuple[int, ...]], owner: int) -> tuple[int, ...]:
    """One holder of each distinct block of a task, the one nearest its ``owner``: the owner
    itself if it holds the block, else the holder whose mesh coordinates differ from the
    owner's on the fewest axes (the same replica: HSDP's replicas span nodes), then the
    lowest member."""

    def distance(s: int) -> tuple[int, int]:
        return sum(a != b for a, b in zip(coords[s], coords[owner])), s

    chosen: dict[tuple, int] = {}
    for s, b in enumerate(blocks):
        if b not in chosen or distance(s) < distance(chosen[b]):
            chosen[b] = s
    return tuple(sorted(chosen.values()))


def owner_units(sharding: Sharding, layout: Layout, block: tuple) -> list:
    """The owner tasks of one parameter whose rank holds ``block``: ``[None]`` (the whole
    parameter), or one ``(start, stop)`` of dimension 0 per leading index when that
    dimension only batches work matrices (expert stacks, batched heads): each expert is
    then mapped on its own owner, so a stack's work spreads over the group like separate
    matrices'. The ranks of an owner group hold the same leading range (a split of it
    would be a batch split, outside the group)."""
    if len(sharding.shape) < 3 or _dim_roles(layout, len(sharding.shape))[0] != "batch":
        return [None]
    return [(e, e + 1) for e in range(*block[0])]


def _arrangement(tasks: list[tuple], members: list[int], plans: list[Plan], where) -> tuple:
    """The owner work of ``members`` (tasks of one process group) as the group lays it out:
    its coordinates, every member's block of each task, the tasks' map costs, owners and
    sources, all from global shapes. The tasks may sit on different meshes over the same
    ranks (a dense parameter on the dp_shard sub-mesh, an expert stack on the whole mesh):
    each task's members in its own coordinates, in the group's (increasing rank) order."""

    def block(task, c):
        b = task[0].block_at(c)
        return b if task[4] is None else (task[4],) + b[1:]

    places = [group_coordinates(tasks[i][0].mesh_shape, where(tasks[i][0]), plans[i].axes) for i in members]
    blocks = [[block(tasks[i], c) for c in cs] for i, cs in zip(members, places)]
    joints = [tuple(b - a for a, b in joint_block(bl)) for bl in blocks]
    costs = [sum(map_cost(s) for s in tasks[i][2].work_shapes(j)) for i, j in zip(members, joints)]
    owners = assign(costs, len(places[0]))
    sources = [_sources(bl, cs, o) for bl, cs, o in zip(blocks, places, owners)]
    return blocks, joints, costs, owners, sources


def _busiest(tasks: list[tuple], members: list[int], arrangement: tuple, model: CostModel) -> float:
    """Seconds the busiest member of a group spends on its owner work under ``model``: the
    blocks it sources, the update blocks it returns to every holder, its maps."""
    blocks, joints, _, owners, sources = arrangement
    seconds = [0.0] * len(blocks[0]) if blocks else [0.0]
    for k, i in enumerate(members):
        item = tasks[i][3].itemsize  # (host arithmetic: no tensor made)
        for s in set(sources[k]) | {owners[k]}:
            seconds[s] += elements_sent(blocks[k], sources[k], owners[k], s) * item / model.bandwidth
        flops = sum(map_flops(tasks[i][5], w) for w in tasks[i][2].work_shapes(joints[k]))
        seconds[owners[k]] += flops / model.flops
    return max(seconds)


def replica_family(sharding: Sharding, axes: tuple[int, ...]) -> tuple:
    """What names the owner work over mesh ``axes`` of ``sharding``'s mesh on every rank
    (the mesh's ranks and shape, and the axes), for :func:`owner_batches`' ``divided``."""
    mesh = sharding.mesh.mesh
    return (tuple(mesh.shape), tuple(mesh.flatten().tolist()), tuple(axes))


def _replica_plans(
    tasks: list[tuple], where, model: CostModel, cache: dict | None, spread: frozenset = frozenset()
) -> list[Plan]:
    """Each task's plan with its replica axes kept where the replicas divide the owner work
    more cheaply than each repeats it: per process group of such tasks, the busiest rank's
    time (:func:`_busiest`) with owners spread over every replica (each update's blocks go
    back to all holders) against owners within each replica. Few large tasks on many
    replicas are repeated (an owner would return one matrix per replica), many are divided.
    A family whose :func:`replica_family` is in ``spread`` (a sharded bucket's exchange
    over the same ranks, :mod:`.sharded_buckets`, which its replicas divide) is divided."""
    plans = [t[1] for t in tasks]
    families: dict[tuple, list[int]] = {}
    for i, (sharding, how, _, dtype, *_) in enumerate(tasks):
        if how.replicas:
            families.setdefault((group_ranks(sharding, how.axes, where(sharding)), dtype), []).append(i)
    for signature, members in families.items():
        first = tasks[members[0]]
        if replica_family(first[0], first[1].axes) in spread:
            continue
        found = None if cache is None else cache.get(("replicas", signature, tuple(members)))
        if found is None:
            alone = list(plans)
            for i in members:
                alone[i] = plans[i]._replace(replicas=())
            divided = _busiest(tasks, members, _arrangement(tasks, members, plans, where), model)
            # within one replica: the members that share this rank's group (the others' are alike)
            mine = group_ranks(tasks[members[0]][0], alone[members[0]].axes, where(tasks[members[0]][0]))
            same = [i for i in members if group_ranks(tasks[i][0], alone[i].axes, where(tasks[i][0])) == mine]
            repeated = _busiest(tasks, same, _arrangement(tasks, same, alone, where), model)
            found = divided < repeated
            if cache is not None:
                cache[("replicas", signature, tuple(members))] = found
        if not found:
            for i in members:
                plans[i] = plans[i]._replace(replicas=())
    return plans


def owner_batches(
    tasks: list[tuple],
    coordinate_of=None,
    cache: dict | None = None,
    costs: CostModel | None = None,
    divided: frozenset = frozenset(),
) -> list[OwnerBatch]:
    """Batches of ``(sharding, plan, layout, dtype, lead, key)`` owner tasks, in the order
    the step runs them, with each task's owner (longest map first to the least-loaded rank,
    from global shapes only); ``lead`` is the task's range of dimension 0 (None: all of
    the rank's block, see :func:`owner_units`). Replica axes of a plan divide its owner work
    where ``costs`` finds that cheaper (:func:`_replica_plans`; default: always), and in
    every family ``divided`` names (the sharded buckets' exchanges over the same ranks,
    whose deals leave these tasks' owners their own, :func:`~.sharded_buckets.owner_deals`).
    ``coordinate_of(sharding)`` is the rank's coordinate on that sharding's mesh (default:
    this rank's); the planner passes any rank's, and a ``cache`` shared by the ranks of one
    group (their batches differ only in ``me``)."""
    where = coordinate_of or (lambda s: s.coordinate)
    plans = [t[1] for t in tasks] if costs is None else _replica_plans(tasks, where, costs, cache, divided)
    batches: dict[tuple, list[int]] = {}
    for i, (sharding, _, _, dtype, *_) in enumerate(tasks):
        batches.setdefault((group_ranks(sharding, plans[i].axes, where(sharding)), dtype), []).append(i)
    out = []
    for signature, members in batches.items():
        first, axes = tasks[members[0]][0], plans[members[0]].axes
        coords = group_coordinates(first.mesh_shape, where(first), axes)
        found = None if cache is None else cache.get((signature, tuple(members)))
        if found is None:
            blocks, _, costs_, owners, sources = _arrangement(tasks, members, plans, where)
            order = sorted(range(len(members)), key=lambda k: (-costs_[k], k))
            waves = [sorted(order[w::WAVES]) for w in range(min(WAVES, len(members)))]
            found = (blocks, owners, sources, waves)
            if cache is not None:
                cache[(signature, tuple(members))] = found
        blocks, owners, sources, waves = found
        me = coords.index(tuple(where(first)))
        for wave in waves:
            out.append(
                OwnerBatch(
                    [members[k] for k in wave],
                    me,
                    [blocks[k] for k in wave],
                    [owners[k] for k in wave],
                    [sources[k] for k in wave],
                    [plans[members[k]] for k in wave],
                )
            )
    return out
