"""The ``equiopt`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="equiopt", description="Symmetry-compatible optimizers for LM pre-training.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="fit a small LM-shaped problem with several optimizer stacks and show what each map did")
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--seed", type=int, default=0)
    sub.add_parser("bench", help="step-time and accuracy benchmarks (python -m equiopt.bench --help)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from .demo import main as demo_main

        demo_main(steps=args.steps, seed=args.seed)
    elif args.command == "bench":
        from .bench import main as bench_main

        bench_main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
