"""The few torch.distributed collectives the checkpoints use; each is the identity (or
a no-op) in one process or when torch.distributed is not initialised."""

from __future__ import annotations

from typing import Any


def _dist_state() -> tuple[int, int, bool]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` (plain data) on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather_object(value: Any) -> list[Any] | None:
    """Every rank's ``value`` (plain data), in rank order, on rank 0; None on the other ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, out, dst=0)
    return out


def _all_gather_object(value: Any) -> list[Any]:
    """Every rank's ``value`` (plain data), in rank order, on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
