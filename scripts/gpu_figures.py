"""The GPU figures in one JSON file: ``python scripts/gpu_figures.py [--out results/gpu/figures.json]``.

On one CUDA device, in this order (each against a baseline run in the same process):

- ``*_over_fused_adamw``: one 151936 x 1024 float32 embedding, each rule's step with the
  optimizer's automatic settings (compiled cores, the fused vocabulary stages, and
  ``gram_dtype="auto"``) over ``torch.optim.AdamW(fused=True)`` on the same parameter
  (``bench --speed``); ``right_over_fused_adamw_by_gram_dtype`` and
  ``hybrid_over_fused_adamw_by_gram_dtype``: the same for each Gram precision;
- ``stack_*_over_fwd_bwd``: Qwen3-0.6B (625.8 M parameters), each recipe's step over one
  forward+backward of 8 x 1024 tokens under bf16 autocast, the best of eager, CUDA graph
  (:class:`equiopt.optim.GraphedStep`) and compiled, ``stack_mode`` naming which
  (``bench --stack --graphed``); ``peak_extra_over_state`` and ``graphed_vs_eager_rel`` from
  the same runs;
- ``compile_s``: the first compiled step of ``paper:qwen3:a-i`` on Qwen3-0.6B (cold cache,
  in a child process with a time limit; ``null`` if it did not finish), and
  ``compile_s_each`` of every recipe the child finished;
- ``roofline_ms``: the same eager steps and fused AdamW counted on the meta device at an
  H100's roofline (:mod:`equiopt.roofline`, CUDA's choices, the Gram precision ``bench
  --stack`` sets), and ``roofline_over_eager`` each one's estimate over its measured eager
  step: the roofline model checked whenever a GPU is lent;
- ``cuda_tests``: ``{passed, failed, failing}`` (the failing tests' ids) of ``tests/test_cuda.py`` and ``tests/test_buckets.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

RECIPES = ("paper:qwen3:a-i", "paper:qwen3:b-ii", "equiopt:default")
RULES = {
    "row_norm_over_fused_adamw": "row",
    "row_norm_centred_over_fused_adamw": "row centred",
    "right_over_fused_adamw": "right",
    "hybrid_over_fused_adamw": "hybrid row->right",
}


def _key(recipe: str) -> str:
    return recipe.split(":")[-1].replace("-", "_")


def compiled(recipes: str) -> None:
    """Per recipe, one JSON line: the first compiled step (tracing and compiling every
    bucket's core, ``compile=True``) and the median of later ones, on Qwen3-0.6B."""
    import torch

    from equiopt.bench import median_time, stack_model
    from equiopt.roles import build_optimizer

    device = torch.device("cuda")
    model = stack_model(device)
    for p in model.parameters():
        p.grad = 1e-3 * torch.randn_like(p)
    for recipe in recipes.split(","):
        opt, _ = build_optimizer(model, recipe, eager_state=True, compile=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        ms = 1e3 * median_time(opt.step, 20, device)
        print(json.dumps({"recipe": recipe, "compile_s": first, "ms": ms}), flush=True)
        del opt


def _child(recipes: str, limit: float) -> dict[str, dict]:
    """:func:`compiled` in a child process with an empty Inductor cache; the recipes it finished."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-"))
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--compiled", recipes], capture_output=True, text=True, timeout=limit, env=env
        )
        out, err = done.stdout, done.stderr
    except subprocess.TimeoutExpired as stopped:
        out, err = str(stopped.stdout or ""), "timed out"
    if err:
        print(err[-4000:], file=sys.stderr)
    found = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["recipe"]: r for r in found}


def _tests(limit: float) -> dict:
    try:
        done = subprocess.run(
            # (pyproject's addopts already give -q; a second -q drops the summary line read below)
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/test_cuda.py", "tests/test_buckets.py"],
            capture_output=True,
            text=True,
            timeout=limit,
        )
        text = done.stdout
    except subprocess.TimeoutExpired as err:
        text = str(err.stdout or "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error)", text)}
    failing = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M)  # pytest's short summary, one line each
    return {
        "passed": counts.get("passed", 0),
        "failed": counts.get("failed", 0) + counts.get("error", 0),
        "failing": failing,
    }


def roofline_figures(recipes=RECIPES, gram_dtype: str = "float32") -> dict[str, float]:
    """Milliseconds of fused AdamW (``"fused_adamw"``) and of each recipe's eager step on
    Qwen3-0.6B (``bench --stack``'s model on CUDA) at an H100's roofline, counted on the meta
    device with CUDA's choices and ``gram_dtype`` on every role that takes one (``bench
    --stack``'s default); no GPU needed."""
    from equiopt.roofline import roofline

    table = roofline(list(recipes), "qwen3:paper", "cuda", gram_dtype=gram_dtype)
    return {"fused_adamw": round(table["adamw"]["ms"], 2)} | {
        name: round(row["ms"], 2) for name, row in table["recipes"].items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/gpu/figures.json")
    ap.add_argument("--compiled", default=None, help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--compile-limit", type=float, default=150.0, help="seconds the compiled child may take")
    args = ap.parse_args()
    if args.compiled:
        compiled(args.compiled)
        return

    import torch

    from equiopt.bench import speed, stack

    device = torch.device("cuda")
    commit = (
        os.environ.get("EQUIOPT_COMMIT")
        or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    fig: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit or None}
    # the optimizer's automatic setting, as users step: compiled cores (the fused vocabulary
    # stages) and gram_dtype="auto"; then each Gram precision beside it
    ratios = speed(device, 1, 20, torch.float32, compile_step=None, cases=["embedding 151936x1024"])
    for key, rule in RULES.items():
        fig[key] = round(ratios[("embedding 151936x1024", rule)], 3)
    for name, rule in (("right", "right"), ("hybrid", "hybrid row->right")):
        fig[f"{name}_over_fused_adamw_by_gram_dtype"] = {
            d: round(ratios[("embedding 151936x1024", f"{rule}{suffix}")], 3)
            for d, suffix in (
                ("auto", ""),
                ("float32", ", f32 products"),
                ("bfloat16", ", bf16 Gram"),
                ("bfloat16x6", ", bf16x6 products"),
            )
        }
    table = stack(device, list(RECIPES), 20, 8, 1024, False, graphed=True)
    fb = table["fwd_bwd_ms"]
    fig["fwd_bwd_ms"], fig["fused_adamw_ms"] = round(fb, 2), round(table["adamw_ms"], 3)
    best_modes = {}
    for row in table["rows"]:
        modes = {"eager": row["ms"], "graphed": row["graphed_ms"]}
        best_modes[row["recipe"]] = modes
    found = _child(",".join(RECIPES), args.compile_limit)
    first = found.get(RECIPES[0])
    fig["compile_s"] = None if first is None else round(first["compile_s"], 1)
    fig["compile_s_each"] = {r: round(v["compile_s"], 1) for r, v in found.items()}
    for recipe, r in found.items():
        best_modes[recipe]["compiled"] = r["ms"]
    for recipe, modes in best_modes.items():
        mode = min(modes, key=modes.get)
        fig[f"stack_{_key(recipe)}_over_fwd_bwd"] = round(modes[mode] / fb, 4)
        fig[f"stack_{_key(recipe)}_mode"] = mode
        fig[f"stack_{_key(recipe)}_ms"] = {k: round(v, 2) for k, v in modes.items()}
    fig["stack_mode"] = fig[f"stack_{_key(RECIPES[0])}_mode"]
    fig["peak_extra_over_state"] = round(max(r["peak_extra_mib"] / r["state_mib"] for r in table["rows"]), 3)
    fig["graphed_vs_eager_rel"] = max(r["graphed_vs_eager"] for r in table["rows"])
    fig["roofline_ms"] = roofline_figures()
    eager = {"fused_adamw": table["adamw_ms"]} | {r: m["eager"] for r, m in best_modes.items()}
    fig["roofline_over_eager"] = {k: round(fig["roofline_ms"][k] / eager[k], 3) for k in eager}
    fig["cuda_tests"] = _tests(150.0)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(fig, f, indent=2)
    print(json.dumps(fig, indent=2))


if __name__ == "__main__":
    main()
