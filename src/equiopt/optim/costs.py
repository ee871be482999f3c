"""What a map costs on a split work matrix, and the cost model that picks between plans.

Where a parameter's map can run either on the shards with all-reduced sums ("reduce")
or on one owner rank ("owner"), the cheaper depends on the mesh size and the shapes: per
rank, a ring all-reduce of a ``c x c`` Gram sends about ``8 c^2`` bytes and every rank
then inverts it, while an owner round trip sends about ``8 r c / N`` bytes and the
owners share the maps (``N`` ranks, ``r x c`` work matrix). So the Gram wins when
``c < r / N`` and loses at large ``N``: at 512 ranks one all-reduced 1024 x 1024 Gram per
MLP matrix costs more than sending the matrix to an owner. :class:`CostModel` turns bytes
and FLOPs into seconds with named constants (bandwidth and FLOP/s per rank) and keeps any
matrix larger than ``owner_max_bytes`` (a vocabulary) off owners.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .rules import MapKey, factored_map, rule_named

__all__ = ["CostModel", "COST_MODELS", "resolve_cost_model", "mesh_cost_model", "map_flops", "reduce_bytes"]

PREFER = ("cheaper", "reduce", "owner")


@dataclass(frozen=True)
class CostModel:
    """Constants of the plan choice: ``bandwidth`` (bytes/s a rank sends in a collective),
    ``flops`` (FLOP/s of the maps' matrix products on a rank), ``owner_max_bytes`` (the
    largest matrix, in bytes of its float32 momentum, ever sent whole to an owner) and
    ``prefer`` (``"cheaper"``; ``"reduce"`` or ``"owner"`` wherever that plan is possible)
    and ``hidden`` (the fraction of an exchange started asynchronously that the maps
    running meanwhile hide: the broadcasts of replicas dividing work, by owners or rows)."""

    bandwidth: float
    flops: float
    owner_max_bytes: int = 128 * 2**20
    prefer: str = "cheaper"
    name: str = "custom"
    hidden: float = 0.0

    def __post_init__(self):
        if self.prefer not in PREFER:
            raise ValueError(f"cost model: unknown prefer {self.prefer!r}; valid: {', '.join(PREFER)}")
        if self.bandwidth <= 0 or self.flops <= 0:
            raise ValueError(f"cost model: bandwidth and flops must be > 0, got {self.bandwidth}, {self.flops}")
        if not 0.0 <= self.hidden <= 1.0:
            raise ValueError(f"cost model: hidden must be in [0, 1], got {self.hidden}")


COST_MODELS = {
    # gloo over loopback on a 2-core CPU, one thread per process: float32 products at about
    # 100 GFLOP/s; 1 GB/s sent per rank, as in gloo's all-reduces, all-to-alls and
    # broadcasts from every rank of 16 MiB (1.0-1.2 GB/s on 2 and 3 processes,
    # benchmarks/gloo_bandwidth.py; its all-gather, 0.45 GB/s, carries nothing large here);
    # an asynchronous exchange beside the maps hides about a third of its time (the transport
    # shares the two cores with the maps); no matrix over 16 MiB goes to an owner: every
    # rank would take a fresh update of that size from the kernel page by page (glibc's
    # allocator maps it anew each step), which costs more than the products it divides
    "gloo-cpu": CostModel(1e9, 1e11, owner_max_bytes=16 * 2**20, name="gloo-cpu", hidden=0.3),
    # NCCL across H100 nodes (400 Gb/s per GPU), bfloat16 products at a realistic 200 TFLOP/s;
    # NCCL's transfers run beside the maps' kernels, most of them hidden (an assumed 0.8)
    "nccl-h100": CostModel(4.5e10, 2e14, name="nccl-h100", hidden=0.8),
}


def resolve_cost_model(spec, device_type: str = "cpu") -> CostModel:
    """``None``/``"auto"`` (by device: ``nccl-h100`` on CUDA, ``gloo-cpu`` otherwise), a
    name of :data:`COST_MODELS`, ``"reduce"``/``"owner"`` (the device's model, that plan
    wherever possible), or a :class:`CostModel`."""
    if isinstance(spec, CostModel):
        return spec
    base = COST_MODELS["nccl-h100" if device_type == "cuda" else "gloo-cpu"]
    if spec is None or spec == "auto":
        return base
    if spec in ("reduce", "owner"):
        return CostModel(base.bandwidth, base.flops, base.owner_max_bytes, spec, base.name, base.hidden)
    if spec in COST_MODELS:
        return COST_MODELS[spec]
    raise ValueError(
        f"unknown cost_model {spec!r}; valid: auto, reduce, owner, {', '.join(COST_MODELS)} "
        "or an equiopt.optim.costs.CostModel"
    )


def mesh_cost_model(spec, mesh) -> CostModel:
    """:func:`resolve_cost_model` for parameters on ``mesh`` (by its device type)."""
    return resolve_cost_model(spec, getattr(mesh, "device_type", "cpu"))


def map_flops(key: MapKey, shape: tuple[int, ...], gram_rows: int | None = None) -> int:
    """Matrix-product FLOPs of ``key``'s map on a ``(..., m, n)`` batch of work matrices
    (``gram_rows``: the global row count when ``m`` is one shard of it). Polar Express and
    the coupled inverse square root count three products per iteration; an estimate."""
    *lead, m, n = shape
    return rule_named(key.rule).flops(key, math.prod(lead), m, n, gram_rows)


class _Recorder:
    """A :class:`~equiopt.maps.RowReducer` that records the bytes it would all-reduce."""

    def __init__(self, count: int, log: list):
        self.count = count
        self.log = log

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        self.log.append(t.numel() * t.element_size())
        return t


_REDUCE_CACHE: dict = {}


def reduce_bytes(
    key: MapKey, eta, local_shape: tuple, gshape: tuple, rows: bool, cols: bool, dtype: torch.dtype = torch.float32
) -> int:
    """Bytes the map of ``key`` all-reduces on a ``local_shape`` piece of ``gshape`` work
    matrices split on their rows and/or columns: the map itself runs on the meta device
    with reducers that record what they would sum."""
    cache_key = (
        key,
        eta if isinstance(eta, str) else id(eta),
        tuple(local_shape),
        tuple(gshape[-2:]),
        rows,
        cols,
        dtype,
    )
    found = _REDUCE_CACHE.get(cache_key)
    if found is None:
        log: list[int] = []
        factored_map(
            key,
            eta,
            torch.empty(tuple(local_shape), dtype=dtype, device="meta"),
            _Recorder(gshape[-2], log) if rows else None,
            _Recorder(gshape[-1], log) if cols else None,
        )
        found = _REDUCE_CACHE[cache_key] = sum(log)
    return found


def _size(mesh_shape, axes) -> int:
    return math.prod(mesh_shape[a] for a in axes)


def prefers_reduce(costs: CostModel, key: MapKey, work_shapes: list, mesh_shape, reduce, owner) -> bool:
    """Whether the ``reduce`` plan is the one to run rather than ``owner`` (both possible)
    for a parameter whose global work matrices are ``work_shapes``: per rank, the reduce
    plan's ring all-reduce and the map on its shard against the owner round trip and the
    owner's map shared among the owner group (:class:`CostModel`)."""
    whole = sum(math.prod(s) for s in work_shapes) * 4
    if costs.prefer == "reduce" or whole > costs.owner_max_bytes:
        return True
    if costs.prefer == "owner":
        return False
    n_rows, n_cols, n_owner = (
        _size(mesh_shape, reduce.rows),
        _size(mesh_shape, reduce.cols),
        _size(mesh_shape, owner.axes),
    )
    n_reduce = max(n_rows, n_cols) if not (reduce.rows and reduce.cols) else n_rows * n_cols
    t_reduce = t_owner = 0.0
    for shape in work_shapes:
        *lead, m, n = shape
        batch = math.prod(lead)
        local = (batch, -(-m // n_rows), -(-n // n_cols))
        sent = reduce_bytes(key, "inverse", local, shape, bool(reduce.rows), bool(reduce.cols))
        t_reduce += 2 * (n_reduce - 1) / n_reduce * sent / costs.bandwidth + map_flops(key, local, m) / costs.flops
        t_owner += 8 * batch * m * n / n_owner / costs.bandwidth + map_flops(key, (batch, m, n)) / n_owner / costs.flops
    return t_reduce <= t_owner


@functools.lru_cache(maxsize=4096)  # asked every step for every replicated Gram map
def replica_division(costs: CostModel, key: MapKey, shape: tuple, replicas: int, overlap: bool = False) -> str:
    """How ``replicas`` ranks that each hold a whole matrix (DDP) divide its Gram map:
    ``"gram"`` (each sums the Gram of a slice of the rows; the ``d x d`` sums are
    reduce-scattered, each rank inverts its share of a bucket's Grams and the factors are
    all-gathered, the bytes of one all-reduce; the product with ``R`` on every rank; the
    estimate takes the inverse square roots as divided, as they are once a bucket holds
    at least one matrix per replica, which a model's layers usually give it), ``"rows"``
    (the same sums, every rank inverts; each maps its rows completely into its weights and
    broadcasts them, ``m d`` elements) or ``"owner"`` (one rank maps it and broadcasts the
    update, ``m d`` elements, everything divided over the matrices): the cheapest per rank
    under ``costs``. Where a vocabulary's product with ``R`` costs more than sending its
    rows, rows wins; where bandwidth is scarce, the Gram. A SwiGLU matrix's ``d x d``
    inverse square root costs as much as its products, and sending ``d x d`` factors
    instead of ``m x d`` updates makes the Gram win there unless bandwidth is plentiful.
    Matrices over ``owner_max_bytes`` never go to an owner. With ``overlap`` (the
    optimizer's), the broadcasts of rows and owners travel while later maps run, which
    hides ``costs.hidden`` of them, at most the time of this rank's share of the maps."""
    if costs.prefer == "reduce" or replicas < 2:
        return "gram"
    *lead, m, d = shape
    batch = math.prod(lead)
    flops = map_flops(key, tuple(shape))
    gram = 2 * batch * m * d * min(m, d)
    inverse = batch * key.steps * 6 * min(m, d) ** 3  # the d x d inverse square root, on every rank but for owners
    update = 4 * batch * m * d * (replicas - 1) / replicas / costs.bandwidth
    sums = 2 * (replicas - 1) / replicas * 4 * batch * d * d / costs.bandwidth

    def exposed(sent: float, maps_after: float) -> float:  # what overlapping leaves of an exchange
        return sent - (costs.hidden * min(sent, maps_after) if overlap else 0.0)

    rows = ((flops - inverse) / replicas + inverse) / costs.flops
    times = {
        "gram": sums + (flops - (gram + inverse) * (1 - 1 / replicas)) / costs.flops,
        "rows": sums + exposed(update, rows) + rows,
        "owner": exposed(update, flops / replicas / costs.flops) + flops / replicas / costs.flops,
    }
    if 4 * batch * m * d > costs.owner_max_bytes:  # a vocabulary is never mapped whole on one rank
        del times["owner"]
    if costs.prefer == "owner" and "owner" in times:
        return "owner"
    return min(times, key=lambda k: times[k])
