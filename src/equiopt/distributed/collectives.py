"""The tensor collectives the step issues, by the name the installed torch gives them:
``all_gather_single`` and ``reduce_scatter_single`` where torch has them (it deprecates
``all_gather_into_tensor`` and ``reduce_scatter_tensor``), the older names otherwise."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["gather_into", "scatter_sum", "equal_shares", "gather_shares"]


def gather_into(out: torch.Tensor, t: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Every rank's ``t`` (equal shapes), end to end along dimension 0, into ``out``."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, t, group=group, async_op=async_op)


def scatter_sum(out: torch.Tensor, t: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """The sum over ranks of ``t``, this rank's equal share of it (along dimension 0) into ``out``."""
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def equal_shares(count: int, ranks: int, rank: int) -> tuple[int, int, int]:
    """``(share, first, real)`` of ``count`` items split in equal shares over ``ranks``:
    ``ceil(count / ranks)`` items a rank, ``rank``'s first one, and how many of its share
    exist (fewer at the end, 0 past it)."""
    share = -(-count // ranks)
    first = rank * share
    return share, first, max(0, min(share, count - first))


def gather_shares(t: torch.Tensor, share: int, count: int, group: Any = None, run: Any = None) -> torch.Tensor:
    """Every rank's ``t`` (the rows of its :func:`equal_shares` that exist, padded here with
    zeros to ``share``) end to end: the first ``count`` rows of one all-gather.
    ``run(start)`` issues it (``start(async_op)``; default: at once, waited for)."""
    import torch.distributed as dist

    if t.shape[0] < share:
        t = torch.cat([t, t.new_zeros(share - t.shape[0], *t.shape[1:])])
    t = t.contiguous()
    gathered = t.new_empty(share * dist.get_world_size(group), *t.shape[1:])

    def start(async_op: bool) -> Any:
        return gather_into(gathered, t, group=group, async_op=async_op)

    if run is None:
        start(False)
    else:
        run(start)
    return gathered.narrow(0, 0, count)
