"""The tensor collectives the step issues, by the name the installed torch gives them:
``all_gather_single`` and ``reduce_scatter_single`` where torch has them (it deprecates
``all_gather_into_tensor`` and ``reduce_scatter_tensor``), the older names otherwise."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["gather_into", "scatter_sum"]


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
