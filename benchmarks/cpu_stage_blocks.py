"""The hybrid map of one vocabulary-shaped matrix with its first stage formed or taken in
blocks of rows, added to weights as the optimizer adds it (``maps.hybrid_factored`` then
``optim.apply.add_factored_``), timed in one process; then its parts: the Gram ``Z^T Z``
and the product ``Z R`` added to the weights (each a block of rows at a time, as the
blocked map takes them) and the ``n x n`` inverse square root.

    python benchmarks/cpu_stage_blocks.py [--shape 32768x256] [--threads 1] [--repeats 9]
"""

from __future__ import annotations

import argparse

import torch

import equiopt.maps as maps
from equiopt.bench import median_time
from equiopt.linalg.inv_sqrt import inv_sqrt
from equiopt.maps import hybrids
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

    blocked = median_time(step, args.repeats, torch.device("cpu"))
    unformed = hybrids.unformed_stage  # read by hybrid_factored from its own module
    hybrids.unformed_stage = lambda *a: False
    try:
        formed = median_time(step, args.repeats, torch.device("cpu"))
    finally:
        hybrids.unformed_stage = unformed
    print(
        f"hybrid map + update of {m} x {n}, {args.threads} thread(s), torch {torch.__version__}: "
        f"formed Z {1e3 * formed:.1f} ms, blocks {1e3 * blocked:.1f} ms ({blocked / formed:.2f})"
    )
    C, R, G = D.new_zeros(n, n), torch.linalg.qr(torch.randn(n, n, generator=gen)).Q, D.mT @ D
    blocks = maps.row_blocks(D)
    parts = {
        "Gram": lambda: [C.addmm_(D[a:b].mT, D[a:b]) for a, b in blocks],
        "product with R": lambda: [W[a:b].addmm_(D[a:b], R, alpha=-1e-3) for a, b in blocks],
        "inverse square root": lambda: inv_sqrt(G),
    }
    print(
        "parts: "
        + ", ".join(f"{k} {1e3 * median_time(f, args.repeats, torch.device('cpu')):.1f} ms" for k, f in parts.items())
    )


if __name__ == "__main__":
    main()
