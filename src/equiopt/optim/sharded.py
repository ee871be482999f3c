"""The optimizer step on row-sharded (FSDP2 ``Shard(0)``) parameters: what each work matrix needs.

A step on a DTensor parameter works on its local shard (``to_local()`` of the weight,
the gradient and the state). Per parameter, :func:`plan` decides how its map runs:

- ``"local"``: every work matrix lies wholly in this rank's shard (replicated
  parameters; expert stacks, whose dim 0 is the expert axis; heads whose blocks the
  shard boundaries do not cut): nothing is sent.
- ``"reduce"``: the stored rows are the work matrix's rows (``Row`` layout) and the map
  needs only sums over rows (row-norm, right-Gram one-sided and hybrid maps): the
  map runs on the shard with a :class:`ShardRowSum` (column sums and the ``d x d``
  Gram are all-reduced; uncentred row-norm sends nothing).
- ``"gather"``: anything else (spectral maps of whole matrices, left Grams of routers,
  layouts whose stored dim 0 is not the work's row axis, heads cut by a shard
  boundary): each such parameter is mapped whole on one owner rank of the shard group
  (:mod:`.owners`: its rows go to the owner in one all-to-all for all of them, the
  update's rows come back in a second), so the work is spread over the ranks.

Every decision depends only on global shapes and the split of every shard, so all
ranks issue the same collectives in the same order. Collectives go through
``torch.distributed`` on the shard's process group.
"""

from __future__ import annotations

import torch

from ..distributed.placements import Sharding, is_dtensor
from ..layouts import Experts, Heads, Layout, Row
from .rules import reducible

__all__ = ["local", "ShardRowSum", "plan", "global_flags"]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor behind ``t`` (a view that aliases it), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


class ShardRowSum:
    """:class:`equiopt.maps.RowReducer` of a row-sharded work matrix: all-reduce (sum)
    over the shard group; ``count`` is the global row count."""

    def __init__(self, group, count: int):
        self.group = group
        self.count = count

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = t.contiguous()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t


def _heads_whole(layout: Heads, sharding: Sharding) -> bool:
    return layout.axis == "rows" and all(a % layout.head_dim == 0 and b % layout.head_dim == 0
                                         for a, b in sharding.row_ranges())


def plan(key: tuple, layout: Layout, sharding: Sharding) -> str:
    """``"local"``, ``"reduce"`` or ``"gather"`` for a parameter under ``key``'s map (see the module)."""
    if not sharding.is_row_sharded or sharding.num_shards == 1:
        return "local"
    if isinstance(layout, Experts):
        return "local"  # dim 0 is the expert axis: every shard holds whole experts
    if isinstance(layout, Heads) and _heads_whole(layout, sharding):
        return "local"
    if isinstance(layout, Row) and reducible(key, *sharding.shape[-2:]):
        return "reduce"
    return "gather"


def global_flags(flags: torch.Tensor, shardings: list[Sharding]) -> torch.Tensor:
    """Finite flags made global: each row-sharded parameter's flag is the minimum over its
    shard group (one all-reduce of the group's flags per process group)."""
    import torch.distributed as dist

    groups: dict[int, tuple] = {}
    for k, s in enumerate(shardings):
        if s.is_row_sharded and s.num_shards > 1:
            pg = s.group
            groups.setdefault(id(pg), (pg, []))[1].append(k)
    for pg, members in groups.values():
        mask = torch.zeros(len(shardings), dtype=torch.bool, device=flags.device)
        mask[members] = True
        reduced = flags.to(torch.float32)
        dist.all_reduce(reduced, op=dist.ReduceOp.MIN, group=pg)
        flags = torch.where(mask, reduced > 0.5, flags)
    return flags
