"""Trainers that the runs of ``RunPool`` tests import in their own processes (no model, no data)."""

import json
import math
import os
import time


def _log(cfg, val: float, status: str = "done") -> None:
    out = cfg.out_path
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"run": {"name": cfg.run.name, "seed": cfg.run.seed}}))
    recs = [
        {"kind": "val", "step": 10, "tokens": 100, "val/loss": val},
        {"kind": "end", "step": 10, "tokens": 100, "status": status},
    ]
    (out / "log.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def quadratic(cfg, progress=False):
    """val/loss = 5 + log2(lr / 0.01)^2 / 10 + seed / 1000; records when it ran, its process and its GPUs in ``<out>/when.json``."""
    start = time.time()
    time.sleep(float(os.environ.get("RUNPOOL_TEST_SLEEP", "0")))
    lr = cfg.optim.overrides["attention"]["lr"]
    _log(cfg, 5.0 + math.log2(lr / 0.01) ** 2 / 10 + cfg.run.seed / 1000)
    when = [start, time.time(), os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES")]
    (cfg.out_path / "when.json").write_text(json.dumps(when))


def broken(cfg, progress=False):
    raise RuntimeError(f"no data for {cfg.run.name}")


def diverging(cfg, progress=False):
    from equiopt.train.loop import NonFiniteLossError

    _log(cfg, float("nan"), status="nonfinite")
    raise NonFiniteLossError("loss is nan")
