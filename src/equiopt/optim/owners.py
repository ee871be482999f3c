"""Whole-matrix maps spread over ranks: each one runs on a single *owner* rank.

A spectral map (Muon) needs its whole work matrix, and so do a router's left Gram and
layouts whose stored rows are not the work's rows. Rather than every rank computing
every such map, :func:`assign` gives each task an owner (longest task first, to the
least-loaded rank; only global shapes enter, so every rank agrees without sending
anything) and the owners' results are shared:

- sharded parameters (FSDP2, TP, EP blocks): :func:`to_owners` sends every rank's block
  of each task to its owner in one all-to-all, the owner maps the whole matrices, and
  :func:`from_owners` returns every rank's block of the update in a second all-to-all
  (gather to owner -> map -> scatter, with one collective each way per step). Under
  HSDP the group spans the replicas too: one holder of each block sends it, and every
  holder gets its block of the update back, so the replicas divide the maps;
- replicated parameters (DDP): the owner maps its tasks and :func:`share` broadcasts each
  owner's results (one broadcast per owner), so every rank adds the same update and the
  weights stay bit-identical across ranks.

Collectives go through ``torch.distributed`` on the given process group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..distributed.placements import row_range

__all__ = [
    "assign",
    "deal",
    "map_cost",
    "joint_block",
    "block_numel",
    "elements_sent",
    "Pending",
    "stack_groups",
    "start_to_owners",
    "to_owners",
    "start_from_owners",
    "from_owners",
    "start_share",
    "share",
]


def map_cost(shape: Sequence[int]) -> int:
    """Work of a matrix map on a ``(..., m, n)`` batch: ``batch * m * n * min(m, n)``
    (the flops of its matrix products, up to a constant)."""
    *lead, m, n = shape
    return math.prod(lead) * m * n * min(m, n)


def assign(costs: Sequence[float], ranks: int) -> list[int]:
    """An owner rank per task: longest task first, each to the least-loaded rank (ties: the
    lowest rank). Deterministic in ``costs`` alone, so every rank computes the same list."""
    loads: list[float] = [0.0] * ranks
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda q: (loads[q], q))
        owners[i] = r
        loads[r] += costs[i]
    return owners


def deal(count: int, cost: float, loads: list[float]) -> tuple[int, ...]:
    """How many of ``count`` tasks of equal ``cost`` each rank takes, one at a time to the
    least-loaded rank (ties: the lowest), from ``loads`` (updated in place): a share per
    rank, the tasks dealt in rank order (rank 0's first)."""
    sizes = [0] * len(loads)
    for _ in range(count):
        r = min(range(len(loads)), key=lambda q: (loads[q], q))
        sizes[r] += 1
        loads[r] += cost
    return tuple(sizes)


Block = tuple  # ((start, stop), ...) per tensor dimension, in global coordinates


def block_numel(block: Block) -> int:
    """Elements of a block."""
    return math.prod(b - a for a, b in block)


def elements_sent(blocks: Sequence[Block], sources: Sequence[int], owner: int, member: int) -> int:
    """Elements group member ``member`` sends for one task whose members hold ``blocks``:
    its block to the ``owner`` in :func:`to_owners` if it is one of the ``sources``, and, if
    it is the owner, every member's block of the update in :func:`from_owners`."""
    out = block_numel(blocks[member]) if member in sources else 0
    if member == owner:
        out += sum(block_numel(b) for b in blocks)
    return out


def _within(block: Block, joint: Block) -> tuple[slice, ...]:
    """``block``'s place inside the tensor ``joint`` (both global ranges)."""
    return tuple(slice(a - j, b - j) for (a, b), (j, _) in zip(block, joint))


def joint_block(blocks: Sequence[Block]) -> Block:
    """The block that the ranks holding ``blocks`` hold together (their bounding box)."""
    return tuple((min(b[d][0] for b in blocks), max(b[d][1] for b in blocks)) for d in range(len(blocks[0])))


class Pending:
    """A collective in flight: :meth:`wait` finishes it and returns what it delivers.

    The step starts the exchange of one owner batch, computes meanwhile, and waits only
    when it needs the result (``async_op=True`` underneath; ``wait`` on a synchronous
    exchange just unpacks)."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self):
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._finish()


def _all_to_all(send: list[torch.Tensor], recv_sizes: list[int], group, like: torch.Tensor, async_op: bool):
    """One ``all_to_all_single``: ``send[q]`` (flat) goes to rank ``q``; returns the
    work handle (None when synchronous) and the flat pieces received from each rank
    (sizes ``recv_sizes``, valid once the work is done)."""
    import torch.distributed as dist

    inp = torch.cat(send) if send else like.new_empty(0)
    out = like.new_empty(sum(recv_sizes))
    work = dist.all_to_all_single(out, inp, recv_sizes, [t.numel() for t in send], group=group, async_op=async_op)
    return work, list(torch.split(out, recv_sizes))


def stack_groups(
    blocks: Sequence[Sequence[Block]],
    owners: Sequence[int],
    sources: Sequence[Sequence[int]] | None,
    alike: Sequence | None = None,
) -> list[list[int]]:
    """The tasks of one exchange as groups whose members travel and are mapped as one stack:
    equal owner, sources, block shapes and places of the blocks in their joint block, and
    equal ``alike[t]`` (the caller's own key: map settings, layout, dtype; None: every task
    alone). Groups keep the tasks' order (first members ascending), so every rank forms
    the same groups from the same global information."""
    if alike is None:
        return [[t] for t in range(len(blocks))]
    found: dict[tuple, list[int]] = {}
    for t, bl in enumerate(blocks):
        joint = joint_block(bl)
        places = tuple(tuple((a - j, b - j) for (a, b), (j, _) in zip(b_, joint)) for b_ in bl)
        key = (owners[t], None if sources is None else tuple(sources[t]), places, alike[t])
        found.setdefault(key, []).append(t)
    return list(found.values())


def start_to_owners(
    shards: Sequence[torch.Tensor],
    blocks: Sequence[Sequence[Block]],
    owners: Sequence[int],
    me: int,
    group,
    async_op: bool = True,
    sources: Sequence[Sequence[int]] | None = None,
    groups: Sequence[Sequence[int]] | None = None,
) -> Pending:
    """Start :func:`to_owners`; ``wait()`` on the result gives ``{g: stack}``: for each
    group of ``groups`` (:func:`stack_groups`; default: every task alone) that this rank
    owns, its members' joint blocks as one ``(len(group), *joint)`` tensor. A group's blocks
    travel next to each other, so each source's share of it arrives as one piece."""
    n = len(blocks[0]) if blocks else 1
    like = shards[0]
    groups = stack_groups(blocks, owners, sources) if groups is None else groups
    senders = [range(n) if sources is None else sources[t] for t in range(len(blocks))]

    def sent(t: int, s: int) -> int:
        return block_numel(blocks[t][s]) if s in senders[t] else 0

    send: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for g in groups:
        for t in g:
            if me in senders[t]:
                send[owners[t]].append(shards[t].reshape(-1))
    mine = [k for k, g in enumerate(groups) if owners[g[0]] == me]
    work, recv = _all_to_all(
        [torch.cat(s) if s else like.new_empty(0) for s in send],
        [sum(sent(t, s) for k in mine for t in groups[k]) for s in range(n)],
        group,
        like,
        async_op,
    )

    def finish() -> dict[int, torch.Tensor]:
        out = {}
        offsets = [0] * n
        for k in mine:
            first, size = groups[k][0], len(groups[k])
            joint = joint_block(blocks[first])
            shape = tuple(b - a for a, b in joint)
            pieces = []
            for s in range(n):
                if s in senders[first]:
                    count = sent(first, s) * size
                    block = blocks[first][s]
                    piece = recv[s].narrow(0, offsets[s], count).view(size, *(b - a for a, b in block))
                    pieces.append((block, piece))
                    offsets[s] += count
            if len(pieces) == 1 and pieces[0][0] == joint:
                out[k] = pieces[0][1]  # one source holds it all: no copy
                continue
            stack = like.new_empty((size, *shape))
            for block, piece in pieces:
                stack[(slice(None),) + _within(block, joint)] = piece
            out[k] = stack
        return out

    return Pending(work, finish)


def to_owners(
    shards: Sequence[torch.Tensor],
    blocks: Sequence[Sequence[Block]],
    owners: Sequence[int],
    me: int,
    group,
    sources: Sequence[Sequence[int]] | None = None,
) -> dict[int, torch.Tensor]:
    """Whole tensors of the tasks this rank owns, ``{task: tensor}``.

    Task ``t`` is split over the group: member ``s`` holds the block ``blocks[t][s]``
    (global ranges), this rank ``shards[t]``; the owner gets the tasks' joint block
    (:func:`joint_block`). One all-to-all moves every block to its task's owner; all
    tensors share one dtype. ``sources[t]``: the members that send (default: all); where
    several members hold the same block (replicas), one of them suffices.
    """
    stacks = start_to_owners(shards, blocks, owners, me, group, async_op=False, sources=sources).wait()
    return {t: stack[0] for t, stack in stacks.items()}


def start_from_owners(
    updates: dict[int, torch.Tensor],
    blocks: Sequence[Sequence[Block]],
    owners: Sequence[int],
    me: int,
    group,
    like: torch.Tensor,
    async_op: bool = True,
    groups: Sequence[Sequence[int]] | None = None,
) -> Pending:
    """Start :func:`from_owners` for ``updates`` given per owned group as ``(len(group),
    *joint)`` stacks (``groups`` as :func:`start_to_owners` took them; default: every task
    alone); ``wait()`` on the result gives this rank's block of every task's update."""
    n = len(blocks[0]) if blocks else 1
    groups = stack_groups(blocks, owners, None) if groups is None else groups
    mine = sorted(updates)
    send = []
    for s in range(n):
        parts = [
            updates[k][(slice(None),) + _within(blocks[groups[k][0]][s], joint_block(blocks[groups[k][0]]))].reshape(-1)
            for k in mine
        ]
        send.append(torch.cat(parts) if parts else like.new_empty(0))
    by_owner = [[g for g in groups if owners[g[0]] == q] for q in range(n)]
    sizes = [[len(g) * block_numel(blocks[g[0]][me]) for g in gs] for gs in by_owner]
    work, recv = _all_to_all(send, [sum(s) for s in sizes], group, like, async_op)

    def finish() -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(blocks)
        for gs, sz, flat in zip(by_owner, sizes, recv):
            for g, part in zip(gs, torch.split(flat, sz)):
                shape = tuple(b - a for a, b in blocks[g[0]][me])
                for t, u in zip(g, part.view(len(g), *shape).unbind(0)):  # a group's blocks: one view
                    out[t] = u
        return out  # type: ignore[return-value]

    return Pending(work, finish)


def from_owners(
    updates: dict[int, torch.Tensor],
    blocks: Sequence[Sequence[Block]],
    owners: Sequence[int],
    me: int,
    group,
    like: torch.Tensor,
) -> list[torch.Tensor]:
    """The inverse of :func:`to_owners`: each owner's ``updates[t]`` (of the joint block)
    go back as blocks, one all-to-all; returns this rank's block of every task's update."""
    stacks = {t: u.unsqueeze(0) for t, u in updates.items()}
    return start_from_owners(stacks, blocks, owners, me, group, like, async_op=False).wait()


def start_share(
    results: dict[int, torch.Tensor],
    shapes: Sequence[tuple[int, ...]],
    owners: Sequence[int],
    me: int,
    group,
    like: torch.Tensor,
    async_op: bool = True,
) -> Pending:
    """Start :func:`share`; ``wait()`` on the result gives every task's result in task order."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    works, received = [], []
    for q in range(n):
        ts = [t for t in range(len(shapes)) if owners[t] == q]
        if not ts:
            continue
        sizes = [math.prod(shapes[t]) for t in ts]
        if q == me:
            flat = torch.cat([results[t].reshape(-1) for t in ts])
        else:
            flat = like.new_empty(sum(sizes))
        src = dist.get_global_rank(group, q) if group is not None else q
        works.append(dist.broadcast(flat, src=src, group=group, async_op=async_op))
        received.append((ts, sizes, flat))

    def finish() -> list[torch.Tensor]:
        for work in works:
            if work is not None:
                work.wait()
        out: list[torch.Tensor | None] = [None] * len(shapes)
        for ts, sizes, flat in received:
            for t, part in zip(ts, torch.split(flat, sizes)):
                out[t] = part.view(shapes[t])
        return out  # type: ignore[return-value]

    return Pending(None, finish)


def start_row_share(views: Sequence[torch.Tensor], group, async_op: bool = True) -> Pending:
    """Start broadcasting, from each rank of ``group``, its slice of the rows (dim ``-2``,
    :func:`~equiopt.distributed.placements.row_range`) of every tensor in ``views``, in
    place: after ``wait()`` every rank's ``views`` hold each slice as its rank wrote it.
    A slice that is not contiguous in memory (a transposed work view, a stack) travels
    through a buffer."""
    import torch.distributed as dist

    n, me = dist.get_world_size(group), dist.get_rank(group)
    works, copies = [], []
    for view in views:
        m = view.shape[-2]
        for q in range(n):
            a, b = row_range(m, n, q)
            rows = view.narrow(-2, a, b - a)
            if rows.numel() == 0:
                continue
            buf = rows if rows.is_contiguous() else (rows.contiguous() if q == me else rows.new_empty(rows.shape))
            src = dist.get_global_rank(group, q) if group is not None else q
            works.append(dist.broadcast(buf, src=src, group=group, async_op=async_op))
            if buf is not rows and q != me:
                copies.append((rows, buf))

    def finish() -> None:
        for work in works:
            if work is not None:
                work.wait()
        for rows, buf in copies:
            rows.copy_(buf)

    return Pending(None, finish)


def share(
    results: dict[int, torch.Tensor],
    shapes: Sequence[tuple[int, ...]],
    owners: Sequence[int],
    me: int,
    group,
    like: torch.Tensor,
) -> list[torch.Tensor]:
    """Every task's result on every rank: each owner broadcasts its ``results`` (one flat
    buffer per owner, tasks in order); returns all tasks' results in task order."""
    return start_share(results, shapes, owners, me, group, like, async_op=False).wait()
