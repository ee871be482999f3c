"""Muon's update size under each polar iteration, on the study's own momenta.

Trains the CPU study's Qwen3 (``results/study/peers/configs/muon.toml``: equiopt's Muon on the
hidden matrices, AdamW elsewhere) for the first ``--steps`` steps of its schedule, then maps
every hidden matrix's momentum (per work matrix, as the step does) with each polar method and
reports, per role,
the update's RMS and the mean, smallest and largest singular value of the map:

- ``polar_express`` (the recipes' method) in float32;
- ``newton_schulz_torch`` (``torch.optim.Muon``'s quintic, normalised as torch does) in
  bfloat16, its own precision;
- ``newton_schulz`` (Muon's quintic with equiopt's normalisation) in float32.

The ratio of the quintic's update RMS to Polar Express's is the step-size offset between the
two iterations at equal learning rates (the question of issue "Which Muon?").

    python scripts/polar_update_rms.py [--steps 50] [--json results/study/muon_iteration/update_rms.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from equiopt import maps
from equiopt.train import Trainer, load_config

ROOT = Path(__file__).resolve().parents[1]
METHODS = (
    ("polar_express", torch.float32),
    ("newton_schulz_torch", torch.bfloat16),
    ("newton_schulz", torch.float32),
)


def measure(config: Path, steps: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        # the study's own schedule (its 150 steps), stopped after ``steps``
        cfg = load_config(config, {"run.out_dir": out, "run.seed": seed, "train.val_every": 0})
        trainer = Trainer(cfg, progress=False)
        for _ in range(steps):
            trainer.train_step(log_now=False, diag_now=False)
        rows: dict[str, dict[str, list[float]]] = {}
        opt = trainer.optimizer
        for group in opt.param_groups:
            if group["rule"] != "spectral":
                continue
            role = group.get("role", group["names"][0])
            for p, layout in zip(group["params"], group["layouts"]):
                momentum = opt.state[p]["momentum_buffer"].float()
                for work in layout.to_work_list(momentum):
                    work = work.reshape(-1, *work.shape[-2:])
                    for method, dtype in METHODS:
                        u = maps.spectral(work, method=method, dtype=dtype).double()
                        s = torch.linalg.svdvals(u)
                        entry = rows.setdefault(role, {}).setdefault(method, [])
                        entry.extend(u.pow(2).mean(dim=(-2, -1)).sqrt().tolist())
                        rows[role].setdefault(method + ":s_mean", []).extend(s.mean(-1).tolist())
                        rows[role].setdefault(method + ":s_min", []).extend(s.amin(-1).tolist())
                        rows[role].setdefault(method + ":s_max", []).extend(s.amax(-1).tolist())
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "results/study/peers/configs/muon.toml")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    rows = measure(args.config, args.steps, args.seed)
    summary: dict[str, dict[str, float]] = {}
    print(f"after {args.steps} steps of {args.config.relative_to(ROOT)} (seed {args.seed}), per work matrix:")
    print(f"{'role':<12}{'method':<22}{'update RMS':>12}{'/ PE':>8}{'mean s':>9}{'min s':>8}{'max s':>8}")
    for role, entries in rows.items():
        base = statistics.fmean(entries["polar_express"])
        for method, _ in METHODS:
            rms = statistics.fmean(entries[method])
            stats = {
                "rms": rms,
                "rms_over_polar_express": rms / base,
                "s_mean": statistics.fmean(entries[method + ":s_mean"]),
                "s_min": min(entries[method + ":s_min"]),
                "s_max": max(entries[method + ":s_max"]),
                "matrices": len(entries[method]),
            }
            summary[f"{role}/{method}"] = stats
            print(
                f"{role:<12}{method:<22}{rms:>12.4e}{stats['rms_over_polar_express']:>8.3f}"
                f"{stats['s_mean']:>9.3f}{stats['s_min']:>8.3f}{stats['s_max']:>8.3f}"
            )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"config": str(args.config.relative_to(ROOT)), "steps": args.steps, "seed": args.seed}
        record.update(torch=torch.__version__, summary=summary)
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
