"""bfloat16 iterations on a CPU: torch's bfloat16 kernels against equiopt's float32 products
rounded to bfloat16 (``equiopt.linalg.emulates_bfloat16``) and the float32 iteration, on a-i's
84 SwiGLU matrices of 384 x 128 (median of 5 calls each):

    python benchmarks/cpu_bf16_rounded.py [--shape 84x128x384] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys

import torch

from equiopt import linalg
from equiopt.bench import median_time

REPEATS, CPU = 5, torch.device("cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="84x128x384")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    X = torch.randn(*(int(v) for v in args.shape.lower().split("x")), generator=torch.Generator().manual_seed(0))
    polar_module = sys.modules["equiopt.linalg.polar"]
    hardware = polar_module.CPU_BFLOAT16
    print(f"polar of {args.shape}, {args.threads} thread(s), torch {torch.__version__}, bfloat16 hardware: {hardware}")
    for method in ("polar_express", "newton_schulz_torch"):
        times = {}
        for label, native in (("torch's bfloat16 kernels", True), ("rounded float32 products", False)):
            polar_module.CPU_BFLOAT16 = native
            times[label] = median_time(lambda: linalg.polar(X, method, dtype=torch.bfloat16), REPEATS, CPU)
        polar_module.CPU_BFLOAT16 = hardware
        times["float32"] = median_time(lambda: linalg.polar(X, method, dtype=torch.float32), REPEATS, CPU)
        print(f"  {method}: " + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in times.items()))


if __name__ == "__main__":
    main()
