"""Train each shipped config briefly and fail when a weight RMS or a validation loss explodes.

For every config given (default: all of ``configs/cpu``), a short run (``--steps``,
validation at the end on ``--val-batches`` batches) goes to ``runs/check/<scale>/...``;
the check then reads its ``log.jsonl`` and fails the config when

* the run stopped on a non-finite loss, or
* a logged per-role weight RMS (``weight_rms/<role>``) exceeds ``--max-weight-rms``
  (the models start at 0.02), or
* the final validation loss exceeds ``ln(vocab) + --margin`` (worse than a uniform guess).

Runs one process at a time with one thread; finished runs are reused unless ``--force``.
Exit status 1 when any config fails. Data: configs/README.md.

    PYTHONPATH=src python3 scripts/check_configs.py                     # every CPU config
    PYTHONPATH=src python3 scripts/check_configs.py configs/cpu/qwen3/a-ii.toml --steps 60
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def check_run(out: Path, vocab: int, max_weight_rms: float, margin: float) -> tuple[bool, dict]:
    recs = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines() if ln.strip()]
    end = [r for r in recs if r.get("kind") == "end"]
    status = end[-1].get("status") if end else "incomplete"
    weights = {}
    for r in recs:
        if r.get("kind") == "train":
            for k, v in r.items():
                if k.startswith("weight_rms/") and isinstance(v, (int, float)):
                    weights[k[len("weight_rms/") :]] = max(weights.get(k[len("weight_rms/") :], 0.0), float(v))
    vals = [r["val/loss"] for r in recs if r.get("kind") == "val" and "val/loss" in r]
    val = float(vals[-1]) if vals else math.nan
    limit = math.log(vocab) + margin
    problems = []
    if status != "done":
        problems.append(f"status {status}")
    for role, w in weights.items():
        if not math.isfinite(w) or w > max_weight_rms:
            problems.append(f"weight_rms/{role} reached {w:.3g} > {max_weight_rms:g}")
    if not math.isfinite(val) or val > limit:
        problems.append(f"val/loss {val:.4g} > ln({vocab}) + {margin:g} = {limit:.4g}")
    return not problems, {"status": status, "val_loss": val, "max_weight_rms": weights, "problems": problems}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("configs", nargs="*", help="config files (default: configs/cpu/**/*.toml)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--val-batches", type=int, default=2)
    p.add_argument("--max-weight-rms", type=float, default=5.0)
    p.add_argument("--margin", type=float, default=0.0)
    p.add_argument("--out", default="runs/check")
    p.add_argument("--force", action="store_true")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from equiopt.train import load_config, train
    from equiopt.train.loop import NonFiniteLossError

    configs = args.configs or sorted(str(c) for c in (ROOT / "configs" / "cpu").rglob("*.toml"))
    results, failed = {}, []
    for path in configs:
        rel = (
            Path(path).resolve().relative_to(ROOT / "configs")
            if str(Path(path).resolve()).startswith(str(ROOT / "configs"))
            else Path(Path(path).name)
        )
        out = Path(args.out) / rel.with_suffix("")
        sets = {
            "train.steps": args.steps,
            "train.val_every": args.steps,
            "train.log_every": max(1, args.steps // 10),
            "train.val_batches": args.val_batches,
            "train.checkpoint_every": 0,
            "train.tensorboard": False,
            "run.out_dir": str(out),
        }
        cfg = load_config(path, sets)
        log = out / "log.jsonl"
        if args.force or not log.exists() or '"kind": "end"' not in log.read_text():
            try:
                train(cfg, progress=False)
            except NonFiniteLossError:
                pass
        vocab = cfg.model.overrides.get("vocab_size") or 4096
        ok, info = check_run(out, int(vocab), args.max_weight_rms, args.margin)
        results[str(path)] = {"ok": ok, **info}
        worst = max(info["max_weight_rms"].items(), key=lambda kv: kv[1], default=("-", math.nan))
        print(
            f"{'ok  ' if ok else 'FAIL'} {path}: val/loss {info['val_loss']:.4f}, largest weight RMS "
            f"{worst[0]} {worst[1]:.3g}" + (f"  <- {'; '.join(info['problems'])}" if not ok else ""),
            flush=True,
        )
        if not ok:
            failed.append(str(path))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2, default=str) + "\n")
    print(
        f"{len(configs) - len(failed)} of {len(configs)} configs sane"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
