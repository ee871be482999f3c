"""What an optimizer step sends and computes, per parameter and per rank, before it runs.

:func:`plan_step` walks an :class:`~equiopt.optim.EquivariantOptimizer` as its step
does, with the step's own decisions (:func:`.sharded.plan` per parameter,
:func:`.sharded.owner_batches` for owner work), and counts for any rank:

- bytes: the message sizes of the step's collectives, as
  :func:`equiopt.distributed.record_collectives` counts them (an all-reduce's tensor, an
  all-to-all's whole input). Reduce maps are run on the meta device with a reducer that
  records what it would sum, so the bytes are those of the maps' own calls;
- FLOPs of the matrix products (Grams, inverse square roots, polar iterations) and a few
  per element for momentum and the update (an estimate: :func:`.costs.map_flops`);
- state bytes (momentum, Adam moments).

Only global shapes, placements and mesh sizes enter, so a model on the meta device,
sharded over a fake process group of any size, is planned exactly like a real one.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple

import torch

from ..distributed.placements import Sharding
from .bucket_plan import plan_buckets
from .costs import map_flops, mesh_cost_model, reduce_bytes
from .owners import block_numel, elements_sent, joint_block
from .row_moments import row_moment_block, stage_bytes
from .rules import map_key, rule_named, rule_of
from .sharded import group_ranks, local, owner_batches, owner_units
from .sharded_buckets import exchange_bytes, update_dtype, whole_task
from .stacking import eligible_members

__all__ = ["ParamPlan", "StepPlan", "plan_step"]

ELEMENTWISE_FLOPS = 6  # momentum EMA, Nesterov, decay and the update, per element
ADAMW_FLOPS = 12


class ParamPlan(NamedTuple):
    """One parameter's plan; the per-rank figures are the largest over the ranks planned."""

    name: str
    shape: tuple[int, ...]
    placements: str
    rule: str
    plan: str  # "local" | "replicated" | "reduce" | "owner"
    axes: tuple[str, ...]
    bytes_sent_per_rank: int
    flops_per_rank: int
    state_bytes_per_rank: int
    step: str = "per-parameter"  # or the bucket that steps it: "bucket K" (a matrix map's), "adamw K"


class StepPlan(NamedTuple):
    parameters: list[ParamPlan]
    per_rank: dict[int, tuple[int, int, int, int]]  # rank -> (bytes, flops, state bytes, parameter elements)
    flag_bytes_per_rank: int

    def totals(self) -> dict[str, Any]:
        busiest = max(self.per_rank, key=lambda r: self.per_rank[r][0]) if self.per_rank else 0
        return {
            "bytes_sent_per_rank_max": max((v[0] for v in self.per_rank.values()), default=0),
            "flops_per_rank_max": max((v[1] for v in self.per_rank.values()), default=0),
            "state_bytes_per_rank_max": max((v[2] for v in self.per_rank.values()), default=0),
            "busiest_rank": busiest,
        }


def _coordinates(mesh) -> dict[int, tuple[int, ...]]:
    """Every global rank's coordinate on ``mesh``. A sub-mesh (``mesh["dp_shard"]``) holds
    only this rank's slice of ranks; the other ranks have their own slices of the same
    shape, so their coordinates are read off the root mesh by dimension name."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    names, root_names = tuple(mesh.mesh_dim_names or ()), tuple(root.mesh_dim_names or ())
    if root is mesh or not names or not set(names) <= set(root_names):
        ranks = mesh.mesh
        return {int(r): tuple(int(i) for i in torch.nonzero(ranks == r)[0]) for r in ranks.flatten()}
    dims = [root_names.index(n) for n in names]
    ranks = root.mesh
    out = {}
    for r in ranks.flatten().tolist():
        at = torch.nonzero(ranks == r)[0].tolist()
        out[int(r)] = tuple(at[d] for d in dims)
    return out


def plan_step(optimizer, ranks: list[int] | None = None) -> StepPlan:
    """The plan of one step of ``optimizer`` (every parameter with a gradient) for each of
    ``ranks`` (default: every rank of the default process group, or rank 0 alone)."""
    import torch.distributed as dist

    if ranks is None:
        ranks = list(range(dist.get_world_size())) if dist.is_available() and dist.is_initialized() else [0]
    entries = []  # (group, name, param, layout, sharding, plan)
    for group in optimizer.param_groups:
        for j, p in enumerate(group["params"]):
            sharding = optimizer._sharding(p)
            how = None
            if rule_of(group).kind == "matrix" and sharding.kind == "sharded":
                how = optimizer.plan_of(group, group["layouts"][j], sharding)
            entries.append((group, group["names"][j], p, group["layouts"][j], sharding, how))
    coords: dict[int, dict[int, tuple]] = {}
    divisions = optimizer._divisions()
    buckets = plan_buckets(
        [(g, eligible_members(optimizer, g)) for g in optimizer.param_groups],
        optimizer._state_dtype,
        None if divisions is None else divisions.admit,
        optimizer._placed,
        partial(whole_task, optimizer),
    )  # the step's own buckets (buckets.make_buckets builds them from this)
    steps = {
        id(p): f"bucket {k}" for k, (*_, parts) in enumerate(buckets.matrix) for part in parts for p in part.params
    }
    steps |= {id(p): f"adamw {k}" for k, part in enumerate(buckets.adamw) for p in part.params}
    bucketed = set(steps)
    exchanged = {
        id(p)
        for *_, parts in buckets.matrix
        for part in parts
        if part.placed and part.placed.plan.how == "owner"
        for p in part.params
    }

    def coordinate(s: Sharding, rank: int):
        if s.kind != "sharded":
            return None
        table = coords.get(id(s.mesh))
        if table is None:
            table = coords[id(s.mesh)] = _coordinates(s.mesh)
        return table.get(rank)

    def owner_costs(tasks):  # the cost model of the step's owner work (distribute.run's)
        return mesh_cost_model(optimizer.cost_model, tasks[0][0].mesh if tasks else None)

    per_param: dict[str, list[int]] = {name: [0, 0, 0] for _, name, *_ in entries}
    owner_axes: dict[str, tuple[str, ...]] = {}
    per_rank: dict[int, tuple[int, int, int, int]] = {}
    flag_max = 0
    batch_cache: dict = {}
    for rank in ranks:
        totals = [0, 0, 0, 0]

        def add(name: str, sent: int, flops: int, state: int) -> None:
            row = per_param[name]
            for k, v in enumerate((sent, flops, state)):
                totals[k] += v
            row[0], row[1], row[2] = max(row[0], sent), max(row[1], flops), max(row[2], state)

        owner_tasks, owner_info = [], []
        # the finite flags of every parameter no bucket holds (peers aside) at once, one
        # all-reduce per process group (per_parameter.step)
        flagged = [e for e in entries if rule_of(e[0]).kind != "peer" and id(e[2]) not in bucketed]
        flag_groups = set()
        for _, _, _, _, s, _ in flagged:
            c = coordinate(s, rank)
            if s.kind == "sharded" and s.is_sharded and c is not None:
                flag_groups.add(group_ranks(s, s.split_axes, c))
        flag_bytes = 4 * len(flagged) * len(flag_groups)
        # a sharded part's flags agree in one all-reduce of its own; an owner-mapped bucket's exchange
        for (key, _, _, parts), deal in zip(buckets.matrix, buckets.deals):
            if parts[0].placed is None:
                continue
            flag_bytes += 4 * sum(len(part.members) for part in parts)
            if deal is not None:
                for name, sent, flops in _exchange(optimizer, key, parts, deal, rank, coordinate):
                    add(name, sent, flops, 0)
        for group in optimizer.param_groups:
            members = [e for e in entries if e[0] is group]
            for _, name, p, layout, s, how in members:
                c = coordinate(s, rank)
                block = s.block_at(c) if c is not None else s.block
                numel = block_numel(block)
                totals[3] += numel
                dtype = optimizer._state_dtype(p)
                item = dtype.itemsize
                rule = rule_of(group)
                state = len(rule.state) * numel * item  # its full-size state entries
                if rule.adam:
                    add(name, 0, ADAMW_FLOPS * numel, state)
                    continue
                if rule.row_moments:  # its row second moments
                    state += math.prod(row_moment_block(layout, s.shape, block)) * item
                if rule.kind == "elementwise":  # SGD
                    add(name, 0, ELEMENTWISE_FLOPS * numel, state)
                    continue
                key = map_key(group)
                shape = tuple(b - a for a, b in block)
                if id(p) in exchanged:  # its bucket's exchange and map are counted above
                    add(name, 0, ELEMENTWISE_FLOPS * numel, state)
                elif how is None or how.how == "local":
                    flops = sum(map_flops(key, w) for w in layout.work_shapes(shape))
                    add(name, 0, flops + ELEMENTWISE_FLOPS * numel, state)
                elif how.how == "reduce":
                    gshape = layout.work_shapes(s.shape)[0]
                    sent = sum(
                        reduce_bytes(key, group["eta"], w, gshape, bool(how.rows), bool(how.cols), dtype)
                        for w in layout.work_shapes(shape)
                    )
                    flops = sum(map_flops(key, w, gshape[-2]) for w in layout.work_shapes(shape))
                    add(name, sent, flops + ELEMENTWISE_FLOPS * numel, state)
                else:
                    units = owner_units(s, layout, block)
                    for k, lead in enumerate(units):
                        part = numel if lead is None else numel // max(block[0][1] - block[0][0], 1)
                        owner_tasks.append((s, how, layout, dtype, lead, key))
                        owner_info.append((name, key, part, item, state if k == 0 else 0))
        owned: dict[str, list[int]] = {}  # per parameter: the sum over its owner tasks
        batches = owner_batches(
            owner_tasks,
            coordinate_of=lambda s: coordinate(s, rank),
            cache=batch_cache,
            costs=owner_costs(owner_tasks),
            divided=buckets.owner_families,
        )
        for batch in batches:
            for k, i in enumerate(batch.members):
                name, key, numel, item, state = owner_info[i]
                owner_axes[name] = tuple(owner_tasks[i][0].axis_name(a) for a in batch.plans[k].axes)
                sent = elements_sent(batch.blocks[k], batch.sources[k], batch.owners[k], batch.me) * item
                if rule_named(key.rule).row_moments:  # its row stage on this rank's block
                    sharding, _, layout, *_ = owner_tasks[i]
                    sent += stage_bytes(layout, sharding, batch.blocks[k][batch.me], item)
                flops = ELEMENTWISE_FLOPS * numel
                if batch.owners[k] == batch.me:
                    whole = tuple(b - a for a, b in joint_block(batch.blocks[k]))
                    flops += sum(map_flops(key, w) for w in owner_tasks[i][2].work_shapes(whole))
                row = owned.setdefault(name, [0, 0, 0])
                row[0], row[1], row[2] = row[0] + sent, row[1] + flops, row[2] + state
        for name, (sent, flops, state) in owned.items():
            add(name, sent, flops, state)
        totals[0] += flag_bytes
        flag_max = max(flag_max, flag_bytes)
        per_rank[rank] = (totals[0], totals[1], totals[2], totals[3])
    params = []
    for group, name, p, _layout, s, how in entries:
        label = "replicated" if s.kind == "replicated" else ("local" if how is None else how.how)
        axes = owner_axes.get(name) or (tuple(s.axis_name(a) for a in how.axes) if how is not None else ())
        sent, flops, state = per_param[name]
        step = steps.get(id(p), "per-parameter")
        params.append(
            ParamPlan(name, tuple(p.shape), s.placements, group["rule"], label, axes, sent, flops, state, step)
        )
    return StepPlan(params, per_rank, flag_max)


def _exchange(optimizer, key, parts, deal, rank: int, coordinate) -> list[tuple[str, int, int]]:
    """Per member of an owner-mapped bucket (:class:`~.sharded_buckets.OwnerMap`, its matrices
    dealt by ``deal``) on ``rank``: the bytes of its blocks sent and of the updates of its
    matrices that ``rank`` maps returned, and the FLOPs of those maps."""
    first = parts[0].params[0]
    placed = parts[0].placed
    s = optimizer._sharding(first)
    ranks = group_ranks(s, placed.plan.axes, coordinate(s, rank))  # the exchange's, replica-major
    me, size = ranks.index(rank), len(ranks)
    mates = me - me % (size // placed.replicas)  # the first rank of this rank's replica
    shape = parts[0].layout.work_shapes(s.local_shape)[0][-2:]
    block = math.prod(shape)
    global_work = placed.global_work
    per = [math.prod(p.layout.work_shapes(optimizer._sharding(p.params[0]).local_shape)[0][:-2]) for p in parts]
    own_span = (sum(deal[:me]), sum(deal[: me + 1]))  # the matrices ``rank`` maps
    sends = (sum(deal[:mates]), sum(deal[: mates + size // placed.replicas]))  # those its replica maps
    item = parts[0].state_dtype.itemsize
    narrow = rule_named(key.rule).narrow
    back = update_dtype(
        key, parts[0].group["eta"], global_work, local(first).new_empty((), dtype=parts[0].state_dtype), narrow
    ).itemsize

    def within(lo: int, hi: int, span: tuple[int, int]) -> int:
        return max(0, min(hi, span[1]) - max(lo, span[0]))

    out, at = [], 0
    for n, part in zip(per, parts):
        for name in (part.group["names"][j] for j in part.members):
            own = within(at, at + n, own_span)
            sent = exchange_bytes(within(at, at + n, sends), block, size, own, item, back)
            out.append((name, sent, own * map_flops(key, tuple(global_work[-2:]))))
            at += n
    return out
