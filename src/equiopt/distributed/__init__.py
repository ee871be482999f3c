"""Distribution helpers below the optimizer: how a parameter is sharded, what a step sends.

- :func:`describe_sharding` reads a parameter (plain tensor or DTensor) and says whether
  it is local, replicated or row-sharded (``Shard(0)`` on one mesh dimension, as FSDP2's
  ``fully_shard`` makes) with its local row range; anything else (tensor parallelism,
  ``Shard`` on another dimension, ``Partial``, several sharded mesh dimensions) raises
  :class:`UnsupportedShardingError` naming the parameter and its placement.
- :func:`record_collectives` records every ``torch.distributed`` collective issued
  inside it, by op, bytes and dtype, including those DTensor issues when it redistributes.

Only torch.distributed is used: this package knows nothing of layers, roles or rules.
"""

from .placements import Sharding, UnsupportedShardingError, check_shardings, describe_sharding
from .recorder import CollectiveLog, CollectiveRecord, record_collectives

__all__ = ["Sharding", "UnsupportedShardingError", "describe_sharding", "check_shardings",
           "CollectiveLog", "CollectiveRecord", "record_collectives"]
