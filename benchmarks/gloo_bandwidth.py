"""Bytes per second that one rank sends in gloo's collectives on this machine.

``python benchmarks/gloo_bandwidth.py [--mib 16] [--world 2]``: each collective on a payload
of ``--mib`` MiB per rank (``P``), one thread per process, median of five after a
warm-up. The rate is what a rank sends per second, as the ``gloo-cpu`` cost model's
``bandwidth`` counts it (``equiopt.optim.costs``): a ring all-reduce sends
``2 (n - 1) / n P``, an all-to-all ``(n - 1) / n P``, an all-gather and a broadcast from
every rank ``(n - 1) P``, the root of one broadcast ``P``. The last two move the same
bytes; they are printed side by side because gloo's all-gather is the slow one.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _median_ms(fn, repeats: int = 5) -> float:
    fn()
    dist.barrier()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    dist.barrier()
    return 1e3 * statistics.median(times)


def _worker(rank: int, world: int, rendezvous: str, mib: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        n = mib * 2**20 // 4 // world * world  # the all-to-all splits it evenly
        x, out, spread = torch.randn(n), torch.empty(world * n), torch.empty(n)
        pieces = out.view(world, n)

        def broadcasts():
            pieces[rank].copy_(x)
            works = [dist.broadcast(pieces[q], src=q, async_op=True) for q in range(world)]
            for work in works:
                work.wait()

        size = 4 * n
        cases = {  # name: (collective, bytes a rank sends)
            "all_reduce": (lambda: dist.all_reduce(x), 2 * (world - 1) / world * size),
            "broadcast (one root)": (lambda: dist.broadcast(x, src=0), size),
            "all_to_all_single": (lambda: dist.all_to_all_single(spread, x), (world - 1) / world * size),
            "all_gather_into_tensor": (lambda: dist.all_gather_into_tensor(out, x), (world - 1) * size),
            "a broadcast from every rank": (broadcasts, (world - 1) * size),
        }
        for name, (fn, sent) in cases.items():
            ms = _median_ms(fn)
            if rank == 0:
                print(f"{name:28s} {ms:8.2f} ms   {sent / ms / 1e6:6.2f} GB/s sent per rank", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=16, help="payload per rank, MiB")
    parser.add_argument("--world", type=int, default=2, help="processes")
    args = parser.parse_args()
    print(f"gloo, {args.world} processes, {args.mib} MiB per rank, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args.world, f"{tmp}/rdv", args.mib), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
