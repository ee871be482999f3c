"""The hybrid map of one vocabulary-shaped matrix with its first stage formed or taken in
blocks of rows, added to weights as the optimizer adds it (``maps.hybrid_factored`` then
``optim.apply.add_factored_``), timed in one process.

    python scripts/cpu_stage_blocks.py [--shape 32768x256] [--threads 1] [--repeats 9]
"""

from __future__ import annotations

import argparse

import torch

import equiopt.maps as maps
from equiopt.bench import _median_time
from equiopt.optim.apply import add_factored_


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32768x256")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m, n = (int(v) for v in args.shape.lower().split("x"))
    gen = torch.Generator().manual_seed(0)
    D = torch.randn(m, n, generator=gen)
    W = torch.randn(m, n, generator=gen)
    coef = torch.tensor(-1e-3)

    def step():
        add_factored_(W, maps.hybrid_factored(D), coef)

    blocked = _median_time(step, args.repeats, torch.device("cpu"))
    unformed = maps._unformed_stage
    maps._unformed_stage = lambda *a: False
    try:
        formed = _median_time(step, args.repeats, torch.device("cpu"))
    finally:
        maps._unformed_stage = unformed
    print(
        f"hybrid map + update of {m} x {n}, {args.threads} thread(s), torch {torch.__version__}: "
        f"formed Z {1e3 * formed:.1f} ms, blocks {1e3 * blocked:.1f} ms ({blocked / formed:.2f})"
    )


if __name__ == "__main__":
    main()
