"""Polar Express in float32 with ``a X`` folded into the small factor, ``(a I + b G + c G^2) X``
(what ``equiopt.linalg.polar`` runs), against the unfolded form ``a X + (b G + c G^2) X``, in one
process, alternating (median of ``--repeats`` calls each).

    python benchmarks/cpu_polar_fold.py [--threads 2] [--repeats 8]

The two batches are a-i's on the Qwen3-0.6B structure at width 128 (``bench --structure 128``):
84 SwiGLU matrices of 384 x 128 and 1,344 attention heads of 16 x 128.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import equiopt.linalg  # noqa: F401  (the package first: its polar function shadows the module name)

polar_module = sys.modules["equiopt.linalg.polar"]


class _Narrow:
    """``torch.finfo`` of a type narrower than 32 bits: the unfolded form."""

    bits = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    batches = {"SwiGLU 84 x 384 x 128": torch.randn(84, 384, 128, generator=gen)}
    batches["heads 1344 x 16 x 128"] = torch.randn(1344, 16, 128, generator=gen)
    real = torch.finfo

    def call(x: torch.Tensor, fold: bool) -> float:
        polar_module.torch.finfo = real if fold else (lambda dtype: _Narrow())
        try:
            start = time.perf_counter()
            polar_module.polar(x, dtype=torch.float32)
            return time.perf_counter() - start
        finally:
            polar_module.torch.finfo = real

    for name, x in batches.items():
        times: dict[bool, list[float]] = {True: [], False: []}
        call(x, True)
        for _ in range(args.repeats):
            for fold in (True, False):
                times[fold].append(call(x, fold))
        folded, unfolded = (1e3 * statistics.median(times[f]) for f in (True, False))
        print(f"{name}: folded {folded:.1f} ms, unfolded {unfolded:.1f} ms ({folded / unfolded:.2f}x)")


if __name__ == "__main__":
    main()
