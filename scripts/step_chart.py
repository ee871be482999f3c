"""The step-time chart of docs/step.md, from the measured figures:

    python scripts/step_chart.py [--gpu results/gpu/figures.json] [--cpu results/cpu_stack.json]
                                 [--out docs/img/step-times.svg]

Left: each recipe's optimizer step over AdamW in the same process (torch's fused AdamW on the
GPU, foreach on the CPU); right: over one forward+backward of the same model. GPU bars: eager,
CUDA graph and compiled (`scripts/gpu_figures.py`); CPU bars: eager (`python -m equiopt.bench
--stack --json`). The files say which device, torch and commit measured them.
"""

from __future__ import annotations

import argparse
import json

RECIPES = ("paper:qwen3:a-i", "paper:qwen3:b-ii", "equiopt:default")


def _gpu_bars(fig: dict) -> dict[str, dict[str, tuple[float, float]]]:
    """``{mode: {recipe: (over AdamW, over forward+backward)}}`` of a figures.json."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for recipe in RECIPES:
        key = recipe.split(":")[-1].replace("-", "_")
        for mode, ms in fig.get(f"stack_{key}_ms", {}).items():
            out.setdefault(f"{fig['device']} {mode}", {})[recipe] = (ms / fig["fused_adamw_ms"], ms / fig["fwd_bwd_ms"])
    return out


def _cpu_bars(table: dict) -> dict[str, dict[str, tuple[float, float]]]:
    rows = {r["recipe"]: r["ms"] for r in table["rows"]}
    return {
        "CPU eager": {r: (rows[r] / table["adamw_ms"], rows[r] / table["fwd_bwd_ms"]) for r in RECIPES if r in rows}
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="results/gpu/figures.json")
    ap.add_argument("--cpu", default="results/cpu_stack.json")
    ap.add_argument("--out", default="docs/img/step-times.svg")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.gpu) as f:
        gpu = json.load(f)
    with open(args.cpu) as f:
        cpu = json.load(f)
    bars = {**_cpu_bars(cpu), **_gpu_bars(gpu)}
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(bars)
    for side, (ax, title) in enumerate(zip(axes, ("step / AdamW (same process)", "step / forward+backward"))):
        for k, (label, values) in enumerate(bars.items()):
            xs = [i + (k - (len(bars) - 1) / 2) * width for i in range(len(RECIPES))]
            ys = [values.get(r, (float("nan"), float("nan")))[side] for r in RECIPES]
            drawn = ax.bar(xs, ys, width, label=label)
            ax.bar_label(drawn, fmt="%.2f", fontsize=7, padding=1)
        ax.set_xticks(range(len(RECIPES)), [r.split(":", 1)[1] for r in RECIPES])
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()  # below the plots, clear of the bars
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(
        f"Optimizer step of a Qwen3 stack: GPU {gpu['device']} (torch {gpu['torch']}, Qwen3-0.6B, commit "
        f"{(gpu.get('commit') or '?')[:7]}); CPU {cpu.get('torch', '?')} (19.7 M parameters)",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
