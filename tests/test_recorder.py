"""The collective recorder on gloo groups of 1 and 2 ranks: what each path of issuing a
collective records (async work, functional collectives, DTensor's own redistributions,
a DDP reducer's C++ all-reduces, point-to-point), and that it patches nothing."""

import threading

import pytest
import torch
import torch.distributed as dist

from equiopt.distributed import record_collectives

if dist.is_available():  # imported by name before any recorder runs: a recorder that patched would miss it
    from torch.distributed import all_reduce as imported_by_name

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning"),
]  # torch 2.13 renames; 2.6 has only these


def _rows(log):
    return [(r.op, r.bytes, r.dtype, r.shape, r.group_size) for r in log]


def _check(rank: int, world: int) -> None:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    f32, w = torch.float32, world
    mesh = init_device_mesh("cpu", (world,))
    # the c10d functions, waited on or not: the tensor sizes nccl-tests reports
    with record_collectives() as log:
        dist.all_reduce(torch.ones(5, dtype=torch.float64), async_op=True).wait()
        imported_by_name(torch.ones(2))  # a function imported by name still issues the op
        dist.all_gather_into_tensor(torch.empty(2 * w, 3), torch.ones(2, 3), async_op=True).wait()
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * w))
        dist.all_to_all_single(torch.empty(2 * w), torch.ones(2 * w))
        dist.gather(torch.ones(2), [torch.empty(2) for _ in range(w)] if rank == 0 else None, dst=0)
        dist.scatter(torch.empty(3), [torch.ones(3) for _ in range(w)] if rank == 0 else None, src=0)
        dist.broadcast(torch.zeros(3, dtype=torch.int32), src=0)
        dist.barrier()
    assert _rows(log) == [
        ("all_reduce", 40, torch.float64, (5,), w),
        ("all_reduce", 8, f32, (2,), w),
        ("all_gather", 24 * w, f32, (2 * w, 3), w),
        ("reduce_scatter", 8 * w, f32, (2 * w,), w),
        ("all_to_all", 8 * w, f32, (2 * w,), w),
        ("gather", 8 * w, f32, (2,), w),
        ("scatter", 12 * w, f32, (3,), w),
        ("broadcast", 12, torch.int32, (3,), w),
        ("barrier", 0, None, (), w),
    ], _rows(log)
    assert [r.api for r in log][:3] == ["c10d.allreduce_", "c10d.allreduce_", "c10d._allgather_base_"]
    # nothing is patched, and nothing is recorded once the block has ended
    assert dist.all_reduce.__module__ == "torch.distributed.distributed_c10d"
    assert type(torch.ops._c10d_functional.all_reduce).__name__ == "OpOverloadPacket"
    dist.all_reduce(torch.ones(2))
    assert len(log) == 9
    # functional collectives: an all-gather is its gathered size, counted once (not again
    # as the c10d op it runs); nested recorders both see it
    with record_collectives() as outer:
        with record_collectives() as inner:
            gathered = funcol.all_gather_tensor(torch.ones(3), 0, mesh) + 0
        funcol.all_reduce(torch.ones(4), "sum", mesh).wait()
    assert torch.equal(gathered, torch.ones(3 * w))
    assert _rows(inner) == [("all_gather", 12 * w, f32, (3,), w)]
    assert _rows(outer) == _rows(inner) + [("all_reduce", 16, f32, (4,), w)]
    assert [r.api for r in outer] == ["_c10d_functional.all_gather_into_tensor", "_c10d_functional.all_reduce"]
    # DTensor: a redistribution, and an op that redistributes its inputs before it runs
    x = distribute_tensor(torch.arange(48.0).reshape(8, 6), mesh, [Shard(0)])
    y = distribute_tensor(torch.ones(6, 2), mesh, [Shard(0)])
    with record_collectives() as dt:
        rep = x.redistribute(mesh, [Replicate()])
        product = (x @ y).full_tensor()
    assert torch.equal(rep.to_local(), torch.arange(48.0).reshape(8, 6))
    assert torch.equal(product, torch.arange(48.0).reshape(8, 6).sum(1, keepdim=True).expand(8, 2))
    if world > 1:
        assert dt.ops() and set(dt.ops()) <= {"all_gather", "all_reduce", "all_to_all"}, _rows(dt)
        assert _rows(dt)[0] == ("all_gather", 8 * 6 * 4, f32, (4, 6), 2)
    # point-to-point, blocking or batched
    if world > 1:
        peer = 1 - rank
        with record_collectives() as p2p:
            if rank == 0:
                dist.send(torch.ones(4), 1)
            else:
                dist.recv(torch.empty(4), 0)
            ops = [
                dist.P2POp(dist.isend, torch.ones(3, dtype=torch.float16), peer),
                dist.P2POp(dist.irecv, torch.empty(3, dtype=torch.float16), peer),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        first = ("send", 16, f32, (4,), 2) if rank == 0 else ("recv", 16, f32, (4,), 2)
        half = torch.float16
        assert _rows(p2p) == [first, ("send", 6, half, (3,), 2), ("recv", 6, half, (3,), 2)], _rows(p2p)
        if hasattr(funcol, "batch_p2p_ops_inplace"):  # functional point-to-point (torch >= 2.13)
            with record_collectives() as p2p:
                sent, got = (
                    t + 0
                    for t in funcol.batch_p2p_ops_inplace(  # + 0 waits
                        ["isend", "irecv"], [peer, peer], [0, 0], [torch.full((3,), float(rank)), torch.empty(3)], None
                    )
                )
            assert torch.equal(got, torch.full((3,), float(peer)))
            assert [(r.op, r.bytes, r.api) for r in p2p] == [
                ("send", 12, "_c10d_functional.batch_p2p_ops"),
                ("recv", 12, "_c10d_functional.batch_p2p_ops"),
            ]
    # a DDP reducer's bucket all-reduce, issued from C++ during backward
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 6, bias=False))
    with record_collectives() as ddp:
        model(torch.randn(2, 4)).sum().backward()
    assert ("all_reduce", 6 * 4 * 4) in [(r.op, r.bytes) for r in ddp], _rows(ddp)
    # another thread's collectives are its own (a dispatch mode belongs to its thread)
    with record_collectives() as here:
        thread = threading.Thread(target=dist.all_reduce, args=(torch.ones(7),))
        thread.start()
        thread.join()
    assert _rows(here) == []


def _worker(rank: int, world: int) -> None:
    _check(rank, world)


def test_recorder_on_one_rank(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        _check(0, 1)
    finally:
        dist.destroy_process_group()


def test_recorder_on_two_ranks(gloo):
    gloo(_worker, 2)


def test_compiled_collectives_are_recorded(tmp_path):
    from torch.utils._python_dispatch import TorchDispatchMode

    if not hasattr(TorchDispatchMode, "ignore_compile_internals"):
        pytest.skip("torch < 2.9: Dynamo does not compile under a dispatch mode")
    import torch.distributed._functional_collectives as funcol

    def step(x):
        return funcol.all_gather_tensor(funcol.all_reduce(x * 2, "sum", dist.group.WORLD), 0, dist.group.WORLD) + 1

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        for _ in range(2):  # compiled inside the block, then run from the cache
            with record_collectives() as log:
                out = compiled(torch.ones(4))
            assert torch.equal(out, torch.full((4,), 3.0))
            assert [(r.op, r.bytes, r.group_size) for r in log] == [("all_reduce", 16, 1), ("all_gather", 16, 1)]
        with record_collectives() as log:  # a higher-order operator passes through
            assert torch.equal(
                torch.cond(torch.tensor(True), lambda t: t + 1, lambda t: t - 1, (torch.ones(2),)),
                torch.full((2,), 2.0),
            )
        assert len(log) == 0
    finally:
        dist.destroy_process_group()


def test_recorder_without_a_process_group():
    with record_collectives() as log:
        torch.ones(3).sum()
    assert len(log) == 0 and log.summary() == {} and log.total_bytes() == 0
