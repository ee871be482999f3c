"""Which buckets a step makes (:func:`plan_buckets`), before anything is allocated.

The parameters of one param group, device, dtype and stored shape (and, for a sharded
member, placement: :mod:`.sharded_buckets`) form a part; the parts whose work matrices
share one map and shape form a bucket. :func:`~.buckets.make_buckets` builds the step's
buckets from this plan, and the step's plan (:func:`~.planner.plan_step`) reads the same
one, so what is planned is what runs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from ..layouts import Layout
from .rules import MapKey, map_key, precentred, rule_of
from .sharded import local
from .sharded_buckets import Placed, owner_deals

__all__ = ["FLAT_MAX", "PartPlan", "BucketPlan", "plan_buckets"]

#: AdamW parameters of at most this many entries share one flat part whatever their
#: shapes (norm weights, biases); larger ones are stacked by shape.
FLAT_MAX = 2**16


class PartPlan(NamedTuple):
    """One part of a :class:`BucketPlan`: the positions ``members`` of the parameters of
    ``group`` (``position`` in ``param_groups``) it stacks, their stored ``layout``, state
    dtype, whether it is ``flat``, and a sharded part's :class:`~.sharded_buckets.Placed`."""

    group: dict
    position: int
    members: list[int]
    layout: Layout | None
    state_dtype: torch.dtype
    flat: bool
    placed: Placed | None

    @property
    def params(self) -> list[torch.Tensor]:
        return [self.group["params"][j] for j in self.members]


class BucketPlan(NamedTuple):
    """Which buckets a step makes, before anything is allocated: ``matrix`` as ``(key,
    work shape, division, parts)``, the AdamW parts, the ids of the parameters whose
    bucket ``admit`` declined, each matrix bucket's owner ``deals`` (None where it is not
    owner-mapped) and the ``owner_families`` they exchange over (:func:`~.sharded_buckets.owner_deals`).
    :func:`make_buckets` builds from it; the step's plan (:func:`~.planner.plan_step`) reads it."""

    matrix: list[tuple[MapKey, tuple[int, int], str, list[PartPlan]]]
    adamw: list[PartPlan]
    declined: set[int]
    deals: list[tuple[int, ...] | None]
    owner_families: frozenset


def plan_buckets(
    groups: Iterable[tuple[dict, list[int]]],
    state_dtype: Callable[[torch.Tensor], torch.dtype],
    admit: Callable[[MapKey, tuple[int, int], int], str | None] | None = None,
    placed: Callable[[dict, int], Placed | None] | None = None,
    whole: Callable[[dict, int], tuple[tuple, float, float, int] | None] | None = None,
) -> BucketPlan:
    """The :class:`BucketPlan` of ``(group, members)`` pairs, one per param group in order
    (members: positions of the group's parameters that a part may stack).

    ``admit(key, shape, count)``: how a bucket of ``count`` work matrices of ``shape`` under
    map ``key`` divides its map among replicas (:attr:`Bucket.division`: ``"local"``,
    ``"matrices"``, ``"gram"``, see :mod:`.divided`), or None where it is not made (without
    ``admit``: every bucket, local); the parameters of one it declines keep the
    per-parameter step.

    ``placed(group, j)``: the :class:`~.sharded_buckets.Placed` of a sharded member (its
    part stacks its blocks; an owner-mapped one shares a bucket only with parts of its
    exchange), None for a local one. ``whole(group, j)``: a parameter's owner task in the
    per-parameter step (:func:`~.sharded_buckets.whole_task`), which the owner buckets'
    deals work around."""
    groups = list(groups)
    by_part: dict[tuple, list[int]] = defaultdict(list)
    owners: dict[tuple, tuple[int, dict]] = {}
    placements: dict[tuple, Placed] = {}
    for index, (group, members) in enumerate(groups):
        for j in members:
            p = group["params"][j]
            layout = group["layouts"][j]
            flat = rule_of(group).adam and p.numel() <= FLAT_MAX
            where = None if placed is None else placed(group, j)
            block = local(p)
            shape = None if flat else tuple(block.shape)
            shared = None if where is None else where.key
            key = (id(group), shape, layout if not flat else None, p.dtype, block.device, state_dtype(p), flat, shared)
            by_part[key].append(j)
            owners[key] = (index, group)
            if where is not None:
                placements.setdefault(key, where)  # (any member's: they share all that the part reads)

    def part(key: tuple) -> PartPlan:
        index, group = owners[key]
        members = by_part[key]
        return PartPlan(group, index, members, group["layouts"][members[0]], key[5], key[6], placements.get(key))

    wanted: dict[tuple, list[tuple]] = defaultdict(list)  # a bucket's key -> its parts' keys
    matrices: dict[tuple, int] = {}  # a part's key -> its work matrices
    adamw: list[PartPlan] = []
    for key in by_part:
        group = owners[key][1]
        if rule_of(group).adam:
            adamw.append(part(key))
            continue
        mkey = map_key(group)
        if rule_of(group).centres_in_place(group):
            mkey = precentred(mkey)  # the part centres its direction in place
        stored: Layout = key[2]  # type: ignore[assignment]  # (a matrix part always has its layout)
        work = stored.work_shapes(key[1])[0]
        matrices[key] = math.prod(work[:-2]) * len(by_part[key])
        where = placements.get(key)
        shared = None if where is None else where.signature
        # (owner-mapped parts share a bucket by the whole matrices their exchange maps)
        shape = work[-2:] if shared is None else where.global_work[-2:]  # type: ignore[union-attr]
        wanted[(mkey, tuple(shape), key[4], key[5], shared)].append(key)
    declined: set[int] = set()
    matrix, counts = [], []
    for bkey, keys in wanted.items():
        division = "local"
        if admit is not None and all(key[7] is None for key in keys):
            how = admit(bkey[0], bkey[1], sum(matrices[key] for key in keys))
            if how is None:
                declined |= {id(owners[key][1]["params"][j]) for key in keys for j in by_part[key]}
                continue
            division = how
        matrix.append((bkey[0], bkey[1], division, [part(key) for key in keys]))
        counts.append(sum(matrices[key] for key in keys))
    wholes = []
    if whole is not None and placements:  # (the per-parameter owner tasks beside sharded buckets)
        inside = {id(p) for *_, parts in matrix for part in parts for p in part.params}
        for group, _ in groups:
            for j, p in enumerate(group["params"]):
                task = None if id(p) in inside else whole(group, j)
                if task is not None:
                    wholes.append(task)
    deals, families = owner_deals(
        [(key, shape, parts[0].placed, n) for (key, shape, _, parts), n in zip(matrix, counts)], wholes
    )
    return BucketPlan(matrix, adamw, declined, deals, families)
