"""paper:qwen3:b-ii counted on CUDA's choices with ``route="gram"`` forced on every role
that takes a route: the Gram route that CUDA's ``route="auto"`` no longer picks.

    python benchmarks/roofline_gram_route.py [MODEL] [h100|h100-measured]

Prints one line per setting: the recipes' own ``gram_dtype`` ("auto": split bfloat16
products on CUDA) and strict float32 Grams.
"""

import sys

from equiopt import roofline as rl
from equiopt.recipes import RULE_FIELDS, get_recipe


def with_route(name: str, route: str, gram_dtype: str | None = None):
    base = get_recipe(name)
    overrides = {}
    for role, spec in base.roles.items():
        fields = RULE_FIELDS[spec["rule"]]
        entry = {}
        if "route" in fields:
            entry["route"] = route
        if gram_dtype and "gram_dtype" in fields:
            entry["gram_dtype"] = gram_dtype
        if entry:
            overrides[role] = entry
    return base.with_overrides(overrides)


model = sys.argv[1] if len(sys.argv) > 1 else "qwen3:paper"
machine = {"h100": rl.H100, "h100-measured": rl.H100_MEASURED}[sys.argv[2] if len(sys.argv) > 2 else "h100"]
for label, gram_dtype in (("gram route, gram_dtype auto", None), ("gram route, float32 Grams", "float32")):
    table = rl.roofline([with_route("paper:qwen3:b-ii", "gram", gram_dtype)], model, "cuda", None, machine=machine)
    s = next(iter(table["recipes"].values()))
    flops = ", ".join(f"{v / 1e12:.2f} T {k}" for k, v in sorted(s["flops"].items()) if v >= 1e10)
    print(
        f"{model}, {machine.name}, b-ii, {label}: {s['ms']:.1f} ms, /AdamW {s['over_adamw']:.2f}, "
        f"/fwd+bwd {s['over_fwd_bwd']:.3f}, {s['gb']:.1f} GB, {s['kernels']} kernels, {flops}, "
        f"peak extra {s['peak_extra_mib']:,.0f} MiB"
    )
