"""The ``equiopt`` command."""

from __future__ import annotations

import argparse
import sys


def _load_model(spec: str):
    """``family[:size]`` built on the meta device (nothing allocated), or ``module:attr``."""
    from . import models

    family, _, size = spec.partition(":")
    if family in models.FAMILIES:
        return models.build(family, size or "tiny", device="meta")
    if ":" in spec:
        import importlib

        module, _, attr = spec.partition(":")
        obj = getattr(importlib.import_module(module), attr)
        return obj() if callable(obj) else obj
    raise SystemExit(f"unknown model {spec!r}: use one of {', '.join(models.FAMILIES)} (optionally :SIZE), "
                     "or module:attribute")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="equiopt", description="Symmetry-compatible optimizers for LM pre-training.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="fit a small LM-shaped problem with several optimizer stacks and show what each map did")
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--seed", type=int, default=0)
    sub.add_parser("bench", help="step-time and accuracy benchmarks (python -m equiopt.bench --help)", add_help=False)
    roles = sub.add_parser("roles", help="print the role table of a model: name, shape, role, work shape, rule, lr")
    roles.add_argument("model", help="FAMILY[:SIZE] of equiopt.models (e.g. qwen3:paper, olmoe:tiny), or module:attribute of a "
                                     "callable returning an nn.Module")
    roles.add_argument("--recipe", default="paper:qwen3:b-ii", help="recipe whose rule and lr are shown (default %(default)s)")
    roles.add_argument("--no-reasons", action="store_true", help="omit the reason column")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from .demo import main as demo_main

        demo_main(steps=args.steps, seed=args.seed)
    elif args.command == "roles":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from .recipes import get_recipe
        from .roles import assign_roles

        model = _load_model(args.model)
        print(assign_roles(model).format(get_recipe(args.recipe), reasons=not args.no_reasons))
    elif args.command == "bench":
        from .bench import main as bench_main

        bench_main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
