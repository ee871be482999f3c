"""Compiled against eager steps on CUDA: ``python benchmarks/gpu_compile_check.py [recipes]``.

For each recipe, builds the small Qwen3-style model twice from one seed, runs 3 steps with
``compile=True`` (Inductor, one full graph: an error if Dynamo cannot trace it) and with
``compile=False`` on the same gradients, and prints the largest relative difference of any
parameter, the first compiled step's time (tracing and compiling) and the later steps' times
against eager ones.
"""

from __future__ import annotations

import sys
import time
import traceback

import torch

from equiopt import models
from equiopt.roles import build_optimizer


def _steps(recipe: str, compile_step: bool, grads, steps: int = 3):
    model = models.build("qwen3", "small", seed=0, device="cuda")
    opt, _ = build_optimizer(model, recipe)
    opt.compile = compile_step
    times = []
    for k in range(steps):
        for p, g in zip(model.parameters(), grads[k]):
            p.grad = g.clone()
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return [p.detach().clone() for p in model.parameters()], times


def main(recipes) -> None:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    shapes = [p.shape for p in models.build("qwen3", "small", seed=0, device="cuda").parameters()]
    g = torch.Generator(device="cuda").manual_seed(1)
    grads = [[1e-3 * torch.randn(s, generator=g, device="cuda") for s in shapes] for _ in range(3)]
    for recipe in recipes:
        try:
            eager, te = _steps(recipe, False, grads)
            compiled, tc = _steps(recipe, True, grads)
        except Exception as err:  # report and go on to the next recipe
            print(f"{recipe}: compile failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
            traceback.print_exc(limit=-6)
            continue
        rel = max(float((c - e).norm() / e.norm().clamp_min(1e-30)) for c, e in zip(compiled, eager))
        print(
            f"{recipe}: compiled vs eager max relative difference {rel:.2e}; first compiled step "
            f"{tc[0]:.1f} s; later steps compiled {1e3 * min(tc[1:]):.2f} ms, eager {1e3 * min(te[1:]):.2f} ms"
        )


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["paper:qwen3:a-i", "paper:qwen3:b-ii"])
