"""Counting the optimizer's whole-matrix map work per rank (for the owner-rank tests)."""

from contextlib import contextmanager

import torch
import torch.distributed as dist


@contextmanager
def counting_map_work():
    """Yield a list that receives the cost (``owners.map_cost``) of every matrix the
    engine maps whole on this rank while the block runs (for an owner, or as its share of
    a divided bucket)."""
    import equiopt.optim.distribute as distribute
    import equiopt.optim.divided as divided
    from equiopt.optim.owners import map_cost

    done, original, share = [], distribute.map_whole, divided.map_share

    def counting(jobs):
        done.extend(map_cost(D.shape) for _, _, D in jobs)
        return original(jobs)

    def counting_share(key, eta, x, narrow):  # a bucket divided by matrices (equiopt.optim.divided)
        done.append(map_cost(x.shape))
        return share(key, eta, x, narrow)

    distribute.map_whole, divided.map_share = counting, counting_share
    try:
        yield done
    finally:
        distribute.map_whole, divided.map_share = original, share


def check_work_divided(done, costs) -> torch.Tensor:
    """Every matrix mapped exactly once over the ranks, no rank above an even share plus one
    matrix; returns the per-rank loads."""
    world = dist.get_world_size()
    loads = torch.zeros(world)
    loads[dist.get_rank()] = float(sum(done))
    dist.all_reduce(loads)
    assert float(loads.sum()) == sum(costs), (loads, sum(costs))
    assert float(loads.max()) <= sum(costs) / world + max(costs), loads
    return loads
