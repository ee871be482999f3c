"""Distribution helpers below the optimizer: how a parameter is sharded, what a step sends.

- :func:`describe_sharding` reads a parameter (plain tensor or DTensor on a mesh of any
  number of dimensions) and gives the block of the global tensor each rank holds (FSDP2,
  tensor, sequence and expert parallelism, HSDP, strided shards); ``Partial`` placements
  and splits that are not contiguous raise :class:`UnsupportedShardingError` naming the
  parameter and its placement. :func:`mesh_group` is the process group of a product of
  mesh dimensions.
- :func:`record_collectives` records every ``torch.distributed`` collective issued
  inside it, by op, bytes and dtype, including those DTensor issues when it redistributes.

Only torch.distributed is used: this package knows nothing of layers, roles or rules.
"""

from .placements import Sharding, UnsupportedShardingError, check_shardings, describe_sharding, mesh_group
from .recorder import CollectiveLog, CollectiveRecord, record_collectives

__all__ = [
    "Sharding",
    "UnsupportedShardingError",
    "describe_sharding",
    "check_shardings",
    "mesh_group",
    "CollectiveLog",
    "CollectiveRecord",
    "record_collectives",
]
