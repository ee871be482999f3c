"""The rounding error of Polar Express in bfloat16 for three ways of starting the iteration
from a float32 direction ``D`` (bfloat16 products emulated exactly: float32 products of
bfloat16 values, each result rounded to bfloat16):

- ``A``, what the step does: ``y0 = bf16(D / s)``, then five steps;
- ``B``, the direction written in bfloat16 first: ``y0 = bf16(bf16(D) / s)``;
- ``C``, the division folded into the first step: ``y1 = bf16(C0 bf16(D))`` with
  ``C0 = bf16((a I + h0) / s)``, ``h0`` from ``G0 = bf16(bf16(D) bf16(D)^T) / s^2``,
  then four steps (``a I`` rounded into the small factor once, in bfloat16).

Each is compared with the same iteration in float64 (its rounding error) and with the
exact polar factor (SVD), as the RMS of the difference per entry, averaged over a batch.

    python benchmarks/polar_first_step_accuracy.py [--batch 8] [--seed 0]

B and C would let the momentum stage write the direction in bfloat16 (results/roofline).
"""

from __future__ import annotations

import argparse

import torch

from equiopt.linalg.coefficients import schedule
from equiopt.linalg.polar import NORM_FLOOR, NORM_MARGIN, POLAR_LOWER, POLAR_SAFETY

COEFFS = schedule(POLAR_LOWER, 5, 1.0, POLAR_SAFETY)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def iterate(y: torch.Tensor, steps, rounded) -> torch.Tensor:
    for a, b, c in steps:
        g = rounded(y @ y.mT)
        h = rounded(b * g + c * (g @ g))
        y = rounded(a * y + h @ y)
    return y


def start(D: torch.Tensor, how: str) -> torch.Tensor:
    s = NORM_MARGIN * torch.linalg.matrix_norm(D.double(), keepdim=True) + NORM_FLOOR
    if how == "float64":
        return iterate(D.double() / s, COEFFS, lambda x: x)
    s = s.float()
    if how == "A":
        return iterate(bf16(D / s), COEFFS, bf16)
    narrow = bf16(D)
    if how == "B":
        return iterate(bf16(narrow / s), COEFFS, bf16)
    a, b, c = COEFFS[0]
    g = bf16(bf16(narrow @ narrow.mT) / s**2)
    h = bf16(b * g + c * (g @ g))
    first = bf16((h + a * torch.eye(D.shape[-2])) / s)
    return iterate(bf16(first @ narrow), COEFFS[1:], bf16)


def cases(batch: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for m, n in ((128, 1024), (256, 768), (1024, 3072)):
        k = min(m, n)
        u = torch.linalg.qr(torch.randn(batch, m, k, generator=gen))[0]
        v = torch.linalg.qr(torch.randn(batch, n, k, generator=gen))[0]
        out[f"{m}x{n} gaussian"] = torch.randn(batch, m, n, generator=gen)
        out[f"{m}x{n} singular values 1 to 1e-3, noise 1e-4"] = (
            u * torch.logspace(0, -3, k)
        ) @ v.mT + 1e-4 * torch.randn(batch, m, n, generator=gen)
        out[f"{m}x{n} singular values 1 to 1e-2, scale 1e-3"] = 1e-3 * ((u * torch.logspace(0, -2, k)) @ v.mT)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("RMS error per entry: against the float64 iteration / against the exact polar factor")
    print(f"{'matrices':48} {'A (now)':>22} {'B (bf16 D)':>22} {'C (folded)':>22}")
    for name, D in cases(args.batch, args.seed).items():
        reference = start(D, "float64")
        u, _, vh = torch.linalg.svd(D.double(), full_matrices=False)
        exact = u @ vh
        scale = min(D.shape[-2:]) ** 0.5
        cells = []
        for how in "ABC":
            X = start(D, how).double()
            rounding = (torch.linalg.matrix_norm(X - reference) / scale).mean().item()
            total = (torch.linalg.matrix_norm(X - exact) / scale).mean().item()
            cells.append(f"{rounding:.3e} / {total:.3e}")
        print(f"{name:48} " + " ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
