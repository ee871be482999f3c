"""Profile one optimizer step of a rule on a vocabulary matrix on CUDA, against fused AdamW:
``python benchmarks/gpu_profile_map.py [rule] [order] [gram_dtype] [rows]x[cols]``.

Prints the step times (eager and compiled) and torch.profiler's CUDA-time table of one eager step.
"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from equiopt.optim import EquivariantOptimizer


def _time(opt, repeats: int = 20) -> float:
    opt.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main(rule: str = "hybrid", order: str = "row_then_right", gram_dtype: str = "bfloat16", shape: str = "151936x1024"):
    m, n = (int(v) for v in shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    p = torch.nn.Parameter(0.02 * torch.randn(m, n, generator=g, device="cuda"))
    p.grad = 1e-3 * torch.randn(m, n, generator=g, device="cuda")
    base = _time(torch.optim.AdamW([p], lr=1e-3, fused=True))
    settings = {"rule": rule, "layout": "row", "gram_dtype": gram_dtype}
    if rule == "hybrid":
        settings["order"] = order
    for compile_step in (False, True):
        opt = EquivariantOptimizer([p], lr=1e-3, compile=compile_step, **settings)
        t = _time(opt)
        print(
            f"{rule} {order} {gram_dtype} {shape} compile={compile_step}: {1e3 * t:.2f} ms, fused AdamW {1e3 * base:.2f} ms, ratio {t / base:.2f}"
        )
    opt = EquivariantOptimizer([p], lr=1e-3, compile=False, **settings)
    opt.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        opt.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main(*sys.argv[1:])
