"""A bucket's map divided among replicas (DDP's ``divide_work``).

Every replica holds the same gradients, momentum and weights, so a bucket's batch of ``N``
work matrices (equal map settings and shapes) is the same on every rank. Each replica maps
a contiguous share of it, ``k = ceil(N / n)`` matrices (rank ``r`` the ``[r k, r k + k)``
ones; a rank past the end maps none), and the factors the map made
are all-gathered, padded to equal shares: every rank then holds the map of all ``N``
matrices, bit for bit the same, and goes on with the bucket's step (guard, row stage,
update) as one process would. A factor that is the map's input itself (the unformed
product ``x R`` of a Gram route) is not sent: every rank has its input whole.

What crosses ranks is the map's output at its own width (Muon's narrow polar factor in
bfloat16, a Gram route's ``n x n`` factors), ``(n - 1) / n`` of it received per rank; the
products are divided to within one matrix.

A bucket of fewer matrices than replicas, or of matrices too large for one rank's map
(``owner_max_bytes``), divides its Gram instead where the cost model prefers that
(:func:`~.costs.replica_division`, a Gram-route map): each replica sums the Gram of one
slice of every matrix's rows, the ``d x d`` sums are all-reduced (their inverse square roots
divided in turn, :meth:`~.sharded.ShardSum.sum_then`), and every replica finishes the map
on all rows. Any other bucket is declined (:func:`division`): its parameters keep the
per-parameter division of :mod:`.distribute` (each replica mapping its rows into its
weights, or owners).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import maps
from ..distributed.collectives import equal_shares, gather_shares
from ..linalg.device_choices import decide_as, decides_like
from .costs import CostModel, replica_division
from .rules import MapKey, factor_flags, factored_map, reducible, rule_named
from .sharded import ShardSum

__all__ = ["replica_group", "Divisions", "DividedMap", "GramDivided", "division", "map_share"]


def division(
    costs: CostModel, key: MapKey, shape: tuple[int, int], count: int, replicas: int, overlap: bool
) -> str | None:
    """How ``replicas`` divide the map of a bucket of ``count`` work matrices of ``shape``:
    ``"matrices"`` (at least one matrix per replica, none over ``costs.owner_max_bytes`` in
    float32, no preference for the Gram's division, ``prefer="reduce"``), ``"gram"`` (a
    Gram-route map whose division :func:`~.costs.replica_division` finds cheapest), else
    None (declined: the per-parameter step divides it)."""
    m, n = shape
    if replicas < 2:
        return "local"
    if count >= replicas and 4 * m * n <= costs.owner_max_bytes and costs.prefer != "reduce":
        return "matrices"
    if reducible(key, m, n) and replica_division(costs, key, (count, m, n), replicas, overlap) == "gram":
        return "gram"
    return None


def replica_group(divide_work: Any) -> Any:
    """The process group of ``divide_work`` (None: no division)."""
    if divide_work is None or divide_work is False:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "divide_work needs an initialised torch.distributed process group (torchrun, "
            "init_process_group); pass divide_work=False for a single process"
        )
    return dist.group.WORLD if divide_work is True else divide_work


class Divisions:
    """How the replicas of ``group`` divide each bucket (:meth:`admit`, for
    :func:`~.buckets.make_buckets`) and the map a divided bucket runs (:meth:`map_fn`)."""

    def __init__(self, group: Any, costs: CostModel, overlap: bool):
        import torch.distributed as dist

        self.group, self.costs, self.overlap = group, costs, overlap
        self.replicas = dist.get_world_size(group)
        self.maps: dict[str, Any] = {}

    def admit(self, key: MapKey, shape: tuple[int, int], count: int) -> str | None:
        """:func:`division` for the matrix-product maps; every other map runs whole on every rank."""
        if not rule_named(key.rule).divisible:
            return "local"
        return division(self.costs, key, shape, count, self.replicas, self.overlap)

    def map_fn(self, how: str) -> Any:
        """The ``map_fn`` of a bucket divided ``how`` (``"matrices"`` or ``"gram"``)."""
        found = self.maps.get(how)
        if found is None:
            found = self.maps[how] = (DividedMap if how == "matrices" else GramDivided)(self.group)
        return found


def map_share(key: MapKey, eta: Any, x: torch.Tensor, narrow: bool) -> maps.Factored:
    """The map of ``key`` on this rank's share ``x`` of a divided bucket (``(k, m, n)``)."""
    return factored_map(key, eta, x, narrow=narrow)


class DividedMap:
    """The ``map_fn`` of a bucket divided among the replicas of process group ``group``
    (:func:`~.stages.bucket_core`): the map of every matrix of ``x``, in factored form,
    each rank having mapped only its share (see the module)."""

    def __init__(self, group: Any):
        import torch.distributed as dist

        self.group = group
        self.ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def __call__(
        self, key: MapKey, eta: Any, x: torch.Tensor, narrow: bool = False, sums=None, finite=None
    ) -> maps.Factored:
        # (``sums``, the momentum stage's by-product, is not used: each share's map reads its own;
        # ``finite`` is read from the gathered factors)
        count = x.shape[0]
        if self.ranks < 2:
            return factored_map(key, eta, x, narrow=narrow, finite=finite)
        share, first, real = equal_shares(count, self.ranks, self.rank)
        # a rank past the end maps nothing: its factors' shapes come from the meta device
        if real:
            mine = x.narrow(0, first, real)
            f = map_share(key, eta, mine, narrow)
        else:  # (the meta device deciding as this one: the same precisions, so the same factors)
            mine = x.narrow(0, count - 1, 1).to("meta")
            with decide_as(decides_like(x)):
                f = factored_map(key, eta, mine, narrow=narrow)
        out: dict[str, torch.Tensor | None] = {}
        for name, t in f._asdict().items():
            if t is None:
                out[name] = None
            elif _is_input(t, mine):  # the map's input itself: every rank has all of it
                out[name] = x
            else:
                rows = t if real else torch.empty((0, *t.shape[1:]), dtype=t.dtype, device=x.device)
                out[name] = gather_shares(rows, share, count, self.group)
        result = maps.Factored(**out)  # type: ignore[arg-type]  # (x is always set)
        if finite is not None:
            finite.copy_(factor_flags(result))
        return result


def _is_input(t: torch.Tensor, mine: torch.Tensor) -> bool:
    """Whether ``t`` is the map's input ``mine`` (or a view of it of its shape, where it begins)."""
    if t is mine:
        return True
    if mine.device.type == "meta":  # (meta tensors have no storage to compare)
        same = t._base is not None and t._base is mine
    else:
        same = t.untyped_storage().data_ptr() == mine.untyped_storage().data_ptr()
    if same and (t.shape != mine.shape or t.storage_offset() != mine.storage_offset()):
        raise RuntimeError(f"a map returned part of its input as a factor ({tuple(t.shape)} of {tuple(mine.shape)})")
    return same


class GramDivided:
    """The ``map_fn`` of a bucket whose Gram the replicas of ``group`` divide: each sums
    its slice of every matrix's rows (:class:`~.sharded.ShardSum`), the map finishes on all
    rows (see the module)."""

    def __init__(self, group: Any):
        import torch.distributed as dist

        self.group = group
        self.part = (dist.get_rank(group), dist.get_world_size(group))

    def __call__(
        self, key: MapKey, eta: Any, x: torch.Tensor, narrow: bool = False, sums=None, finite=None
    ) -> maps.Factored:
        sums = ShardSum(self.group, x.shape[-2], self.part, divide=True)
        return factored_map(key, eta, x, sums, None, narrow=narrow, finite=finite)
