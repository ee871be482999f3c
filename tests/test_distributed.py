"""Placements of DTensor parameters and the collective recorder, on gloo groups of 1 and 2 ranks."""

import pytest
import torch
import torch.distributed as dist

from equiopt.distributed import (
    UnsupportedShardingError,
    check_shardings,
    describe_sharding,
    record_collectives,
)
from equiopt.distributed.placements import row_range

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def test_row_ranges_follow_torch_chunk():
    for rows in range(0, 12):
        for n in range(1, 5):
            chunks = torch.arange(rows).chunk(n) if rows else ()
            got = [row_range(rows, n, i) for i in range(n)]
            want = [(int(c[0]), int(c[-1]) + 1) for c in chunks if len(c)]
            assert [r for r in got if r[1] > r[0]] == want
            assert got[0][0] == 0 and got[-1][1] == rows and all(a[1] == b[0] for a, b in zip(got, got[1:]))


def test_a_plain_tensor_is_local():
    s = describe_sharding(torch.zeros(5, 3), "w")
    assert (s.kind, s.block, s.is_sharded, s.mesh) == ("local", ((0, 5), (0, 3)), False, None)


def _torch_block(t, mesh, placements):
    """This rank's block from torch's own ``compute_local_shape_and_global_offset``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    return tuple((o, o + n) if n else (t.shape[d], t.shape[d]) for d, (o, n) in enumerate(zip(offset, shape)))


def _check_placements(rank: int, world: int) -> None:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))  # the same on every rank
    even = distribute_tensor(full, mesh, [Shard(0)])
    s = describe_sharding(even, "embed.weight")
    assert s.kind == "sharded" and s.block == (row_range(8, world, rank), (0, 3)) and s.dims == (0,)
    assert torch.equal(full[s.local_slices()], even.to_local())
    assert [s.block_at((i,)) for i in range(world)] == [(row_range(8, world, i), (0, 3)) for i in range(world)]
    # uneven last shards, an empty one included (1 row over 2 ranks)
    for rows in (5, 1):
        t = distribute_tensor(torch.randn(rows, 3), mesh, [Shard(0)])
        u = describe_sharding(t, "head.weight")
        assert u.local_shape == tuple(t.to_local().shape)
        if t.to_local().numel():
            assert u.block == _torch_block(t, mesh, [Shard(0)])
    experts = describe_sharding(distribute_tensor(torch.randn(4, 6, 2), mesh, [Shard(0)]), "experts.gate_up")
    assert experts.kind == "sharded" and experts.shape == (4, 6, 2) and experts.block[0] == row_range(4, world, rank)
    assert describe_sharding(distribute_tensor(torch.randn(4, 3), mesh, [Replicate()]), "r").kind == "replicated"
    assert describe_sharding(distribute_tensor(torch.randn(4, 3), mesh, [Shard(-2)]), "neg").dims == (0,)
    # tensor parallelism's Rowwise split: columns
    cols = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    tp = distribute_tensor(cols, mesh, [Shard(1)])
    c = describe_sharding(tp, "mlp.down_proj.weight")
    assert c.dims == (1,) and torch.equal(cols[c.local_slices()], tp.to_local())
    with pytest.raises(UnsupportedShardingError, match=r"'grad_like'.*Partial"):
        describe_sharding(DTensor.from_local(torch.randn(4, 3), mesh, [Partial()]), "grad_like")
    with pytest.raises(UnsupportedShardingError, match=r"'a'.*Partial[\s\S]*'b'.*Partial"):
        check_shardings(
            [
                ("ok", even),
                ("a", DTensor.from_local(torch.randn(4, 6), mesh, [Partial()])),
                ("b", DTensor.from_local(torch.randn(4, 3), mesh, [Partial()])),
            ]
        )
    # 2-D meshes: HSDP's (Replicate, Shard(0)) is rows over the second mesh dimension; two
    # axes on one dimension, and rows x columns, are blocks
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    h = describe_sharding(distribute_tensor(torch.randn(6, 2), mesh2, [Replicate(), Shard(0)]), "hsdp")
    assert h.dims == (None, 0) and h.replicate_axes == (0,) and h.block[0] == row_range(6, world, rank)
    for placements in ([Shard(0), Shard(0)], [Shard(0), Shard(1)], [Shard(1), Shard(0)]):
        t = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
        d = distribute_tensor(t, mesh2, placements)
        got = describe_sharding(d, "two")
        assert torch.equal(t[got.local_slices()], d.to_local()), placements
        if d.to_local().numel():
            assert got.block == _torch_block(t, mesh2, placements), placements


def _check_recorder(rank: int, world: int) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)])
    original = dist.all_reduce
    with record_collectives() as log:
        full = x.full_tensor()
        t = torch.ones(5, dtype=torch.float64)
        dist.all_reduce(t)
        with record_collectives() as inner:
            dist.broadcast(torch.zeros(3, dtype=torch.int32), src=0)
    assert full.shape == (8, 6) and torch.equal(t, torch.full((5,), float(world), dtype=torch.float64))
    # one rank: DTensor gathers nothing (its mesh has one member); two: the whole matrix, 8 x 6 float32
    gather = [("all_gather", 8 * 6 * 4, torch.float32)] if world > 1 else []
    ops = [(r.op, r.bytes, r.dtype) for r in log]
    assert ops == gather + [("all_reduce", 5 * 8, torch.float64), ("broadcast", 3 * 4, torch.int32)], ops
    assert [r.group_size for r in log] == [world] * len(ops)
    assert [(r.op, r.bytes) for r in inner] == [("broadcast", 12)]
    assert log.total_bytes() == (192 if world > 1 else 0) + 40 + 12 and log.summary()["all_reduce"] == (1, 40)
    # everything is restored: nothing recorded outside the block
    assert dist.all_reduce is original and not hasattr(torch.ops._c10d_functional.all_reduce, "_packet")
    dist.all_reduce(torch.ones(2))
    assert len(log) == len(ops)
    # FSDP2's own parameter all-gathers and gradient reduce-scatters
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    layer = torch.nn.Linear(4, 6, bias=False)
    fully_shard(layer, mesh=mesh)
    with record_collectives() as fsdp:
        layer(torch.randn(2, 4)).sum().backward()
    if world > 1:
        assert {"all_gather", "reduce_scatter"} <= set(fsdp.ops()), fsdp.ops()
        assert max(r.bytes for r in fsdp if r.op == "all_gather") >= 6 * 4 * 4
    # an object collective is seen as the tensor collectives it makes, counted once
    with record_collectives() as objects:
        gathered = [None] * world
        dist.all_gather_object(gathered, {"rank": rank})
    assert gathered == [{"rank": r} for r in range(world)]
    assert objects.ops() and set(objects.ops()) == {"all_gather"}


def _worker(rank: int, world: int) -> None:
    _check_placements(rank, world)
    _check_recorder(rank, world)


def test_placements_and_recorder_on_one_rank(tmp_path):
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        _check_placements(0, 1)
        _check_recorder(0, 1)
    finally:
        dist.destroy_process_group()


def test_placements_and_recorder_on_two_ranks(gloo):
    gloo(_worker, 2)


@pytest.mark.parametrize("seed", range(3))
def test_overlapped_reduce_maps_start_collectives_in_one_order(seed, monkeypatch):
    """Maps that run in threads (overlapped reduce buckets) have their all-reduces started
    in round-robin order over the maps, whatever the threads' timing: every rank then
    issues the same collectives in the same order. Each map gets its own sums back."""
    import random
    import threading
    import time

    from equiopt.optim import distribute

    started = []

    class Handle:
        def wait(self):
            time.sleep(rng.random() * 0.002)

    def fake_all_reduce(t, op=None, group=None, async_op=False):
        started.append((int(t[0]), int(t[1])))
        t.mul_(2)
        return Handle()

    monkeypatch.setattr(torch.distributed, "all_reduce", fake_all_reduce)
    rng = random.Random(seed)
    counts = [3, 1, 0, 2]  # sums per map: map 2 sends nothing
    turns = distribute._Turns(len(counts))
    got = {}

    def run(k):
        try:
            for i in range(counts[k]):
                time.sleep(rng.random() * 0.003)  # compute of varying length
                out = torch.tensor([k, i])
                turns.run(k, lambda async_op, out=out: torch.distributed.all_reduce(out, async_op=async_op))
                got[(k, i)] = out.tolist()
        finally:
            turns.finish(k)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(counts))]
    for t in threads:
        t.start()
    turns.issue()
    for t in threads:
        t.join()
    assert started == [(0, 0), (1, 0), (3, 0), (0, 1), (3, 1), (0, 2)]
    assert got == {(k, i): [2 * k, 2 * i] for k in range(len(counts)) for i in range(counts[k])}
