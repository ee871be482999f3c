"""Median step time of one recipe on the ``--stack`` model, alone in its process (for
alternating runs of two versions of the code; the ratios against AdamW are
``python -m equiopt.bench --stack``'s).

    python benchmarks/cpu_step_time.py paper:qwen3:b-ii [--threads 2] [--repeats 9] [--structure 128]
"""

from __future__ import annotations

import argparse

import torch

from equiopt.bench import stack_model, time_steps
from equiopt.roles import build_optimizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--structure", type=int, default=None, help="Qwen3-0.6B's structure at this width")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    model = stack_model(cpu, structure=args.structure) if args.structure else stack_model(cpu)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(1)
    grads = [1e-3 * torch.randn(p.shape, generator=gen) for p in params]
    opt, _ = build_optimizer(model, args.recipe, eager_state=True, compile=False)
    ms = 1e3 * time_steps(opt, params, grads, cpu, args.repeats)
    print(f"{args.recipe}: {ms:.1f} ms per step ({args.threads} threads, torch {torch.__version__})")


if __name__ == "__main__":
    main()
