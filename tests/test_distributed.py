"""Placements of DTensor parameters and the collective recorder, on gloo groups of 1 and 2 ranks."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from equiopt.distributed import (
    UnsupportedShardingError, check_shardings, describe_sharding, record_collectives,
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
    assert (s.kind, s.rows, s.num_shards, s.group) == ("local", (0, 5), 1, None)


def _check_placements(rank: int, world: int) -> None:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    even = distribute_tensor(torch.randn(8, 3), mesh, [Shard(0)])
    s = describe_sharding(even, "embed.weight")
    assert s.kind == "row" and s.rows == row_range(8, world, rank) and s.num_shards == world
    assert s.shard_index == rank and s.mesh_dim == 0 and s.group is not None and s.local_rows == 8 // world
    assert s.row_ranges() == [row_range(8, world, i) for i in range(world)]
    # uneven last shards, an empty one included (1 row over 2 ranks)
    for rows in (5, 1):
        u = describe_sharding(distribute_tensor(torch.randn(rows, 3), mesh, [Shard(0)]), "head.weight")
        assert u.rows == row_range(rows, world, rank)
        assert u.local_rows == distribute_tensor(torch.randn(rows, 3), mesh, [Shard(0)]).to_local().shape[0]
    experts = describe_sharding(distribute_tensor(torch.randn(4, 6, 2), mesh, [Shard(0)]), "experts.gate_up")
    assert experts.kind == "row" and experts.shape == (4, 6, 2) and experts.rows == row_range(4, world, rank)
    assert describe_sharding(distribute_tensor(torch.randn(4, 3), mesh, [Replicate()]), "r").kind == "replicated"
    assert describe_sharding(distribute_tensor(torch.randn(4, 3), mesh, [Shard(-2)]), "neg").kind == "row"
    with pytest.raises(UnsupportedShardingError, match=r"'mlp\.down_proj\.weight'.*Shard\(dim=1\).*tensor parallelism"):
        describe_sharding(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]), "mlp.down_proj.weight")
    with pytest.raises(UnsupportedShardingError, match=r"'grad_like'.*Partial"):
        describe_sharding(DTensor.from_local(torch.randn(4, 3), mesh, [Partial()]), "grad_like")
    with pytest.raises(UnsupportedShardingError, match=r"'a'.*Shard\(dim=1\)[\s\S]*'b'.*Partial"):
        check_shardings([("ok", even), ("a", distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)])),
                         ("b", DTensor.from_local(torch.randn(4, 3), mesh, [Partial()]))])
    # 2-D meshes: HSDP's (Replicate, Shard(0)) is rows over the second mesh dimension
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    h = describe_sharding(distribute_tensor(torch.randn(6, 2), mesh2, [Replicate(), Shard(0)]), "hsdp")
    assert h.kind == "row" and h.mesh_dim == 1 and h.rows == row_range(6, world, rank)
    with pytest.raises(UnsupportedShardingError, match=r"'two'.*\(1, %d\).*split over 2 mesh dimensions" % world):
        describe_sharding(distribute_tensor(torch.randn(6, 2), mesh2, [Shard(0), Shard(0)]), "two")
    with pytest.raises(UnsupportedShardingError, match=r"'tp2'.*Shard\(dim=1\)"):
        describe_sharding(distribute_tensor(torch.randn(6, 4), mesh2, [Shard(0), Shard(1)]), "tp2")


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


def _worker(rank: int, world: int, rendezvous: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        _check_placements(rank, world)
        _check_recorder(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_placements_and_recorder_on_one_rank(tmp_path):
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        _check_placements(0, 1)
        _check_recorder(0, 1)
    finally:
        dist.destroy_process_group()


def test_placements_and_recorder_on_two_ranks(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous")), nprocs=2, join=True)
