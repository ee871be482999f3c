"""Where the maps of a step run: batching work matrices and carrying out each one's plan.

The engine decides, per parameter, momentum and decay and what its map needs
(:func:`~.sharded.plan`, :func:`~.costs.replica_division`), and queues the work here as
named records: :class:`WorkItem` in a bucket keyed by :class:`BucketKey`, or a
:class:`WholeTask` for split work that needs whole matrices. :func:`run` then maps it all,
in one place for every distribution:

- ``LOCAL``: the work matrices this rank holds whole (single process, DDP without division,
  heads or experts that a split leaves whole);
- ``REDUCE``: split work matrices mapped on their shards, the sums over rows (and columns)
  all-reduced inside the map (:class:`~.sharded.ShardSum` reducers);
- ``ROWS``: replicated matrices divided by rows: each replica maps its rows into its
  weights, which it then broadcasts;
- ``DIVIDED``: replicated matrices mapped on one owner replica each and broadcast;
- whole tasks: split matrices sent to an owner rank and back (:mod:`.owners`).

Every path batches through :func:`map_batched`: work matrices with equal map settings and
matrix shapes run as one batched call.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import maps
from ..distributed.placements import Sharding, mesh_group, row_range
from ..layouts import Layout
from .costs import mesh_cost_model
from .owners import (
    Pending,
    assign,
    map_cost,
    stack_groups,
    start_from_owners,
    start_row_share,
    start_to_owners,
)
from .row_moments import block_row_stages
from .rules import MapKey, RuleNames, factored_map, rule_named, shape_factor
from .sharded import WAVES, Plan, ShardSum, owner_batches, owner_units

__all__ = [
    "LOCAL",
    "REDUCE",
    "ROWS",
    "DIVIDED",
    "DIVIDED_RULES",
    "BucketKey",
    "WorkItem",
    "WholeTask",
    "map_batched",
    "map_whole",
    "run",
]

LOCAL, REDUCE, ROWS, DIVIDED = "local", "reduce", "rows", "divided"

# Rules whose maps are built on matrix products: worth dividing among replicas (DDP).
# Row-norm maps and the element-wise rules cost less than sending their results.
#: The rules DDP's ``divide_work`` may map on one replica and share (:attr:`Rule.divisible`).
DIVIDED_RULES = RuleNames(lambda r: r.divisible)

#: Adds work matrices' updates to their weights: ``add([(view, update, coef), ...])``.
Add = Callable[[list[tuple[torch.Tensor, maps.Factored, torch.Tensor]]], None]


class BucketKey(NamedTuple):
    """Work matrices that run as one batch: equal map settings, matrix shape and mode
    (``LOCAL``, ``REDUCE``, ``ROWS``, ``DIVIDED``); ``groups`` names the process groups of
    the reductions, so every rank forms the same buckets."""

    map: MapKey
    shape: tuple[int, int]
    mode: str = LOCAL
    groups: tuple = ()


class WorkItem(NamedTuple):
    """One parameter's work matrices (this rank's block) queued for a map."""

    work: torch.Tensor  # the momentum direction's work matrices
    view: torch.Tensor  # the weights' work matrices, views: the update is added in place
    coef: torch.Tensor  # -lr * shape factor * finite flag
    group: dict
    sums: tuple | None = None  # (row reducer, column reducer) of a split work matrix
    # NorMuon: (row second moments (..., m, 1) beside ``work``, updated in place; EMA weight
    # (1 - beta2) * finite flag)
    second: tuple | None = None


class WholeTask(NamedTuple):
    """A split parameter whose map needs whole work matrices (mapped on an owner rank)."""

    group: dict
    key: MapKey
    layout: Layout
    sharding: Sharding
    plan: Plan
    param: torch.Tensor  # this rank's block of the weights
    direction: torch.Tensor  # this rank's block of the momentum direction
    coef: torch.Tensor  # -lr * ok (NorMuon: times the shape factor, which its owner leaves out)
    # NorMuon: (this rank's block of the row second moments, updated in place; EMA weight;
    # the block's [start, stop) per dimension)
    second: tuple | None = None


def _map(key: MapKey, eta, D: torch.Tensor, sums) -> maps.Factored:
    """:func:`factored_map`, with the row and column reducers of a split ``D`` when there are."""
    return factored_map(key, eta, D) if sums is None else factored_map(key, eta, D, *sums)


def map_batched(key: MapKey, eta, works: list[torch.Tensor], sums=None) -> list[maps.Factored]:
    """The map of ``key`` on each of ``works`` (equal matrix shapes), in factored form.

    Row-wise maps (:attr:`Rule.row_wise`, ``row``) run per matrix: they gain nothing from batching and a batch
    would cost a full copy. Maps built on matrix products run as one batched call; the
    batch is a concatenation only when there are several tensors."""
    if rule_named(key.rule).row_wise or len(works) == 1:
        return [_map(key, eta, w, sums) for w in works]
    shape = tuple(works[0].shape[-2:])
    flat = [w if w.dim() == 3 else w.reshape(-1, *shape) for w in works]  # (batch, m, n) as it is
    f = _map(key, eta, torch.cat(flat), sums)
    sizes = [x.shape[0] for x in flat]
    parts: list[Any] = [torch.split(t, sizes) if t is not None else [None] * len(sizes) for t in f]

    def back(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return t if w.dim() == 3 else t.reshape(*w.shape[:-2], *t.shape[-2:])

    return [
        maps.Factored(*[None if t[i] is None else back(t[i], w) for t in parts])  # type: ignore[arg-type]
        for i, w in enumerate(works)
    ]


def map_whole(jobs: list[tuple[MapKey, Any, torch.Tensor]]) -> list[torch.Tensor]:
    """Updates (materialised, in ``D``'s dtype) of ``(key, eta, D)`` jobs on whole work
    matrices; jobs with equal keys, matrix shapes and dtypes run as one batch."""
    batches: dict[tuple, list[int]] = defaultdict(list)
    for i, (key, _, D) in enumerate(jobs):
        batches[(key, tuple(D.shape[-2:]), D.dtype)].append(i)
    out: list[torch.Tensor | None] = [None] * len(jobs)
    for (key, _, dtype), members in batches.items():
        mapped = map_batched(key, jobs[members[0]][1], [jobs[i][2] for i in members])
        for i, f in zip(members, mapped):
            out[i] = maps.materialize(f).to(dtype)
    return out  # type: ignore[return-value]


def run(
    buckets: dict[BucketKey, list[WorkItem]],
    whole: list[WholeTask],
    add: Add,
    *,
    replicas=None,
    overlap: bool = True,
    cost_model=None,
    owner_families: frozenset = frozenset(),
) -> None:
    """Map every queued work matrix and add its update through ``add``.

    ``replicas``: the process group of ``DIVIDED`` and ``ROWS`` buckets; ``overlap``: start
    the owner exchanges asynchronously, in waves, and the ``ROWS`` broadcasts, waited for
    at the end (results bitwise those of waiting);
    ``cost_model``: the optimizer's (:func:`~.costs.resolve_cost_model`), which decides
    whether replicas divide owner work (they always do over ``owner_families``, the sharded
    buckets' exchanges, :func:`~.sharded.owner_batches`)."""
    divided, reduced, shared = [], [], []
    for key, items in buckets.items():
        if key.mode == DIVIDED:
            divided.append((key.map, items))
        elif key.mode == ROWS:
            shared.append(_run_rows(key.map, items, add, overlap))
        elif key.mode == REDUCE:
            reduced.append((key, items))
        else:
            _run_bucket(key, items, add)
    if reduced:
        _run_reduce(reduced, add, overlap)
    if divided:
        _run_divided(divided, add, replicas, overlap)
    if whole:
        _run_whole(whole, add, overlap, cost_model, owner_families)
    for pending in shared:  # the weight rows other replicas mapped, broadcast meanwhile
        pending.wait()


def _run_bucket(key: BucketKey, items: list[WorkItem], add: Add) -> None:
    """Map one bucket here (its sums, if split, waited for) and add its updates."""
    if rule_named(key.map.rule).row_moments:
        _run_row_stages(key.map, items, add)
        return
    mapped = map_batched(key.map, items[0].group["eta"], [i.work for i in items], items[0].sums)
    _add_mapped(items, mapped, add)


def _run_row_stages(key: MapKey, items: list[WorkItem], add: Add) -> None:
    """A bucket of whole work matrices of a rule with row moments (NorMuon): the map of all
    of them in one batched call, then their row stages at once (:func:`_row_stages`)."""
    shape = tuple(items[0].work.shape[-2:])
    works = [i.work.reshape(-1, *shape) for i in items]
    f = _map(key, items[0].group["eta"], works[0] if len(works) == 1 else torch.cat(works), None)
    add(_row_stages(key, items, f.x))


def _row_stages(key: MapKey, items: list[WorkItem], x: torch.Tensor) -> list[tuple]:
    """The rule's row stage (:meth:`Rule.row_stage`, NorMuon's) on the mapped ``x`` of
    ``items``' work matrices (end to end, ``(N, m, n)``), all at once: their row moments
    gathered and written back (one operator each way). Returns the ``(view, update, coef)``
    of each item, its update whole."""
    if any(i.second is None for i in items):
        raise ValueError(f"a {key.rule} work matrix needs its row second moments (WorkItem.second)")
    counts = [math.prod(i.work.shape[:-2]) for i in items]
    seconds = [i.second[0].reshape(-1, x.shape[-2], 1) for i in items]  # type: ignore[index]
    second = seconds[0] if len(seconds) == 1 else torch.cat(seconds)
    weight = torch.cat([i.second[1].reshape(1).expand(c) for i, c in zip(items, counts)])  # type: ignore[index]
    scales = rule_named(key.rule).row_stage(x, second, weight.view(-1, 1, 1), key.eps)
    if len(seconds) > 1:
        torch._foreach_copy_(seconds, list(torch.split(second, counts)))
    update = x * scales
    parts = torch.split(update, counts) if len(items) > 1 else [update]
    return [(i.view, maps.Factored(u.view(i.work.shape)), i.coef) for i, u in zip(items, parts)]


def _add_mapped(items: list[WorkItem], mapped, add: Add) -> None:
    """Add each item's mapped update to its weights."""
    add([(item.view, f, item.coef) for item, f in zip(items, mapped)])


def _run_reduce(buckets: list[tuple[BucketKey, list[WorkItem]]], add: Add, overlap: bool) -> None:
    """Maps of split work matrices on their shards, the sums inside them all-reduced.

    With ``overlap`` and several buckets on CPU, each bucket's map runs in its own thread
    and its all-reduces are started asynchronously by this thread, in one fixed order on
    every rank (:class:`_Turns`), so one bucket's maps run while another's sums travel.
    Each bucket computes exactly what it computes alone, so the updates are bitwise those
    of the waited step; they are added here, in bucket order. (On CUDA the buckets run in
    turn: a wait on the shared stream would hold every thread's kernels; a side stream per
    bucket is the place for overlap there.)"""
    on_cpu = all(items[0].work.device.type == "cpu" for _, items in buckets)
    if not overlap or len(buckets) < 2 or not on_cpu:
        for key, items in buckets:
            _run_bucket(key, items, add)
        return
    turns = _Turns(len(buckets))
    results: list[Any] = [None] * len(buckets)
    errors: list[BaseException] = []
    threads_per_map = torch.get_num_threads()  # OpenMP's setting is per thread: carry it over

    def work(k: int) -> None:
        key, items = buckets[k]
        sums = tuple(None if r is None else _QueuedSum(r, turns, k) for r in items[0].sums)  # type: ignore[union-attr]
        try:
            torch.set_num_threads(threads_per_map)
            with torch.no_grad():
                results[k] = map_batched(key.map, items[0].group["eta"], [i.work for i in items], sums)
        except BaseException as err:  # re-raised by the step's thread below
            errors.append(err)
        finally:
            turns.finish(k)

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(len(buckets))]
    for t in threads:
        t.start()
    turns.issue()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for (_, items), mapped in zip(buckets, results):
        _add_mapped(items, mapped, add)


class _Turns:
    """The collectives of maps running in threads (all-reduces, and the reduce-scatters
    and all-gathers of divided Grams), started by one thread in round-robin order over the
    maps (a finished map leaves the round). Each map's sequence of collectives depends only
    on global shapes and settings, so every rank starts the same collectives
    in the same order, whatever the threads' timing."""

    def __init__(self, count: int):
        self.cv = threading.Condition()
        self.live = list(range(count))
        self.asked: dict[int, list] = {}  # map -> [start, work handle once started]
        self.finished: set[int] = set()

    def run(self, k: int, start) -> None:
        """From map ``k``'s thread: wait for its turn, then for the collective that
        ``start(async_op=True)`` issues (see :meth:`.sharded.ShardSum.collective`)."""
        with self.cv:
            self.asked[k] = [start, None]
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.asked[k][1] is not None)
            handle = self.asked.pop(k)[1]
        handle.wait()

    def finish(self, k: int) -> None:
        with self.cv:
            self.finished.add(k)
            self.cv.notify_all()

    def issue(self) -> None:
        """From the step's thread: start every map's collectives, in turn, until all finish."""
        at = 0
        with self.cv:
            while self.live:
                at %= len(self.live)
                k = self.live[at]
                self.cv.wait_for(lambda: k in self.finished or (k in self.asked and self.asked[k][1] is None))
                if k in self.asked and self.asked[k][1] is None:
                    self.asked[k][1] = self.asked[k][0](True)
                    self.cv.notify_all()
                    at += 1
                else:
                    self.live.pop(at)


class _QueuedSum(ShardSum):
    """A :class:`~.sharded.ShardSum` whose collectives :class:`_Turns` starts in their turn."""

    def __init__(self, inner: ShardSum, turns: _Turns, k: int):
        super().__init__(inner.group, inner.count, inner.part, inner.divide)
        self.turns, self.k = turns, k

    def collective(self, start) -> None:
        self.turns.run(self.k, start)


def _run_whole(
    tasks: list[WholeTask], add: Add, overlap: bool, cost_model=None, divided: frozenset = frozenset()
) -> None:
    """Maps of split parameters that need whole work matrices, spread over the ranks that
    hold their pieces (and over replicas, where ``cost_model`` finds that cheaper): each
    parameter is mapped on one owner rank (:mod:`.owners`), which receives the blocks in
    one all-to-all and returns the update's blocks in another."""
    units = []  # one per owner task: a whole parameter, or one expert of a stack
    for t in tasks:
        block = t.sharding.block
        for lead in owner_units(t.sharding, t.layout, block):
            if lead is None:
                units.append((t, None))
            else:
                at = lead[0] - block[0][0]
                second = None if t.second is None else (t.second[0].narrow(0, at, 1), t.second[1], (lead, *block[1:]))
                units.append(
                    (
                        t._replace(
                            param=t.param.narrow(0, at, 1), direction=t.direction.narrow(0, at, 1), second=second
                        ),
                        lead,
                    )
                )
    tasks = [t for t, _ in units]
    costs = mesh_cost_model(cost_model, tasks[0].sharding.mesh) if tasks else None
    batches = list(
        owner_batches(
            [(t.sharding, t.plan, t.layout, t.direction.dtype, lead, t.key) for t, lead in units],
            costs=costs,
            divided=divided,
        )
    )

    def alike(t: WholeTask) -> tuple:
        # what the members of one stack share beyond their blocks: one map, layout and factor
        return (id(t.group), t.key, t.layout, t.direction.dtype, t.second is None)

    def grouping(batch) -> list[list[int]]:
        members = [tasks[i] for i in batch.members]
        return stack_groups(batch.blocks, batch.owners, batch.sources, [alike(t) for t in members])

    def send(batch, groups):
        members = [tasks[i] for i in batch.members]
        pg = mesh_group(members[0].sharding.mesh, batch.plans[0].axes)
        return start_to_owners(
            [t.direction for t in members], batch.blocks, batch.owners, batch.me, pg, overlap, batch.sources, groups
        )

    def receive(members, pending):
        triples, stages = [], defaultdict(list)
        for t, u in zip(members, pending.wait()):
            if t.second is not None:  # a row stage (NorMuon's) on this rank's block of the map
                sharding, block = t.sharding, t.second[2]
                alike = (
                    t.layout,
                    sharding.shape,
                    block,
                    id(sharding.mesh),
                    sharding.dims,
                    t.key.eps,
                    u.dtype,
                    t.key.rule,
                )
                stages[alike].append((t, u))
            else:
                triples.append((t.param, maps.Factored(u), t.coef))
        for (layout, _, block, _, _, eps, _, rule), tasks in stages.items():  # alike blocks stacked, in one go
            t0 = tasks[0][0]
            done = block_row_stages(
                [u for _, u in tasks],
                [t.second[0] for t, _ in tasks],
                [t.second[1] for t, _ in tasks],
                eps,
                layout,
                t0.sharding,
                block,
                rule_named(rule),
            )
            triples.extend((t.param, maps.Factored(u), t.coef) for (t, _), u in zip(tasks, done))
        add(triples)

    # A window of two batches: the next batch's blocks travel to their owners while
    # this one's maps run, and its updates travel back while the next one's run;
    # every rank starts the same collectives in the same order.
    groupings = [grouping(batch) for batch in batches]
    incoming = send(batches[0], groupings[0]) if batches else None
    returning = None
    for k, batch in enumerate(batches):
        members, groups = [tasks[i] for i in batch.members], groupings[k]
        pg = mesh_group(members[0].sharding.mesh, batch.plans[0].axes)
        arrived = incoming.wait()  # type: ignore[union-attr]  # started for every batch
        incoming = send(batches[k + 1], groupings[k + 1]) if k + 1 < len(batches) else None
        # every stack of work matrices this rank owns in the batch, mapped in one batched call per kind
        works = {g: members[groups[g][0]].layout.stacked_to_work(stack) for g, stack in arrived.items()}
        jobs = [
            (members[groups[g][0]].key, members[groups[g][0]].group["eta"], w) for g, ws in works.items() for w in ws
        ]
        mapped = iter(map_whole(jobs))
        updates = {}
        for g, ws in works.items():
            t, done = members[groups[g][0]], [next(mapped) for _ in ws]
            if t.second is not None:  # NorMuon: the bare polar factor (its factor is in coef)
                updates[g] = t.layout.stacked_from_work(done)
            else:
                updates[g] = t.layout.stacked_from_work(
                    [u * shape_factor(t.group, *w.shape[-2:]) for u, w in zip(done, ws)]
                )
        if returning is not None:
            receive(*returning)
        returning = (
            members,
            start_from_owners(
                updates,
                batch.blocks,
                batch.owners,
                batch.me,
                pg,
                like=members[0].direction,
                async_op=overlap,
                groups=groups,
            ),
        )
    if returning is not None:
        receive(*returning)


def _run_divided(buckets: list[tuple[MapKey, list[WorkItem]]], add: Add, pg, overlap: bool) -> None:
    """Matrix-product maps of replicated parameters divided among the replicas: each
    parameter's work matrices are mapped on one owner rank and broadcast; every rank then
    adds the same updates, so the weights stay identical.

    Owners are given per parameter (longest first, :func:`.owners.assign`), in waves of
    similar work: a wave's broadcasts travel while the next wave's maps run. An owner maps
    its parameters of one map and matrix shape as one batch, and its batches, end to end,
    are the buffer it broadcasts (one per owner and dtype in a wave): a parameter costs a
    view or two, whatever its number of work matrices."""
    import torch.distributed as dist

    n, me = dist.get_world_size(pg), dist.get_rank(pg)
    items = [(key, item) for key, its in buckets for item in its]
    costs = [map_cost(item.work.shape) for _, item in items]
    owners = assign(costs, n)
    order = sorted(range(len(items)), key=lambda t: (-costs[t], t))
    shared: list = [None] * len(items)
    pending = []
    for w in range(min(WAVES, len(items))):
        # per dtype and owner, the wave's parameters of one map and matrix shape next to each other
        batches: dict[tuple, list[int]] = {}
        for t in sorted(order[w::WAVES]):
            key, item = items[t]
            dtype = item.work.dtype
            batches.setdefault((dtype, owners[t], key, tuple(item.work.shape[-2:])), []).append(t)
        for dtype in dict.fromkeys(b[0] for b in batches):
            for q in range(n):
                runs = [(b, ts) for b, ts in batches.items() if b[0] == dtype and b[1] == q]
                if not runs:
                    continue
                ts = [t for _, ts_ in runs for t in ts_]
                sizes = [items[t][1].work.numel() for t in ts]
                if q == me:
                    jobs = []  # one per run: its parameters' work matrices as one (N, m, n) batch
                    for (_, _, key, shape), members in runs:  # (the key names the eta rule: one per run)
                        works = [items[t][1].work.reshape(-1, *shape) for t in members]
                        jobs.append(
                            (key, items[members[0]][1].group["eta"], torch.cat(works) if len(works) > 1 else works[0])
                        )
                    mapped = map_whole(jobs)
                    flat = torch.cat([u.reshape(-1) for u in mapped]) if len(mapped) > 1 else mapped[0].reshape(-1)
                else:
                    flat = items[ts[0]][1].work.new_empty(sum(sizes))
                src = dist.get_global_rank(pg, q) if pg is not None else q
                pending.append((ts, sizes, flat, dist.broadcast(flat, src=src, group=pg, async_op=overlap)))
    for ts, sizes, flat, work in pending:
        if work is not None:
            work.wait()
        for t, part in zip(ts, torch.split(flat, sizes)):
            shared[t] = part.view(items[t][1].work.shape)
    triples = []
    start = 0
    for key, its in buckets:
        polar = shared[start : start + len(its)]
        start += len(its)
        if rule_named(key.rule).row_moments:  # every replica runs the row stages on the same factors
            x = torch.cat([u.reshape(-1, *u.shape[-2:]) for u in polar])
            triples.extend(_row_stages(key, its, x))
        else:
            triples.extend((item.view, maps.Factored(u), item.coef) for item, u in zip(its, polar))
    add(triples)


def _run_rows(key: MapKey, items: list[WorkItem], add: Add, overlap: bool) -> Pending:
    """Gram maps of replicated matrices divided by rows completely: each replica maps its
    slice of every matrix's rows (the sums over rows all-reduced) and adds the update to
    those rows of its weights; then each broadcasts its rows of the weights, so every
    replica holds the rows their mapper wrote. No update is formed or sent: the rows
    travel once, in place, at the weights' dtype; the returned exchange is in flight
    when ``overlap``."""
    sums = items[0].sums[0]  # type: ignore[index]  # ROWS items carry their ShardSum
    pg, (me, n) = sums.group, sums.part
    for item in items:
        m = item.work.shape[-2]
        a, b = row_range(m, n, me)
        f = factored_map(key, item.group["eta"], item.work.narrow(-2, a, b - a), ShardSum(pg, m))
        add([(item.view.narrow(-2, a, b - a), f, item.coef)])
    return start_row_share([item.view for item in items], pg, async_op=overlap)
