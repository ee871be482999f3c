"""Cold compile time of the whole step on Qwen3-0.6B's structure (28 layers, 310 parameters,
width 64), one recipe per child process with an empty Inductor cache:

    python benchmarks/cpu_compile_time.py [paper:qwen3:a-i,paper:qwen3:b-ii,equiopt:default] [--threads 2]

Prints, per recipe: the first compiled step (tracing and compiling every bucket's core), the
median of the next 10 steps under a learning-rate schedule, the eager step for comparison,
the number of compiled graphs after the first step and after the last (equal: no
recompilation), and the largest relative difference from the eager step (float32 polar).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
from torch._dynamo.testing import CompileCounterWithBackend
from equiopt.opcount import qwen3_structure
from equiopt.roles import build_optimizer

recipe = sys.argv[1]
overrides = {"*": {"polar_dtype": "float32"}}

def run(compile_setting, steps=11):
    model = qwen3_structure(28, 64)
    params = list(model.parameters())
    opt, _ = build_optimizer(model, recipe, compile=compile_setting, overrides=overrides)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    gen = torch.Generator().manual_seed(1)
    times, graphs = [], []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        sched.step()
        graphs.append(counter.frame_count if compile_setting else 0)
    return params, times, graphs

counter = CompileCounterWithBackend("inductor")
compiled, ctimes, graphs = run(counter)
eager, etimes, _ = run(False)
rel = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(compiled, eager))
later = sorted(ctimes[1:])[len(ctimes[1:]) // 2]
print(json.dumps({"recipe": recipe, "first_s": ctimes[0], "compiled_ms": 1e3 * later,
                  "eager_ms": 1e3 * sorted(etimes[1:])[len(etimes[1:]) // 2],
                  "graphs_first": graphs[0], "graphs_last": graphs[-1], "rel": rel}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="?", default="paper:qwen3:a-i,paper:qwen3:b-ii,equiopt:default")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    for recipe in args.recipes.split(","):
        env = dict(
            os.environ,
            TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-"),
            TORCHINDUCTOR_FORCE_DISABLE_CACHES="1",
        )
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", CHILD, recipe, str(args.threads)], env=env, capture_output=True, text=True
        )
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode or not lines:
            print(f"{recipe}: failed\n{out.stderr[-3000:]}")
            continue
        r = json.loads(lines[-1])
        print(
            f"{recipe}: first compiled step {r['first_s']:.1f} s, then {r['compiled_ms']:.1f} ms "
            f"(eager {r['eager_ms']:.1f} ms); graphs {r['graphs_first']} after the first step, "
            f"{r['graphs_last']} after 11; compiled vs eager {r['rel']:.1e} "
            f"({time.perf_counter() - start:.0f} s in all)"
        )


if __name__ == "__main__":
    main()
