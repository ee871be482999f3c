"""Run-directory logging: JSONL records, TensorBoard events, a progress line."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them readable
    return value


class RunLogger:
    """Appends one JSON object per record to ``RUN/log.jsonl`` (flushed per line) and mirrors
    numeric fields to TensorBoard under ``RUN/tb`` when the ``tensorboard`` package is present."""

    def __init__(
        self,
        out_dir: Path,
        enabled: bool = True,
        tensorboard: bool = True,
        progress: bool = True,
        total_steps: int | None = None,
    ):
        self.enabled = enabled
        self.out_dir = Path(out_dir)
        self.start = time.perf_counter()
        self._tb = None
        self._bar = None
        self.total_steps = total_steps
        self.show_progress = progress
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.out_dir / "log.jsonl", "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tb"))
            except ImportError:  # tensorboard not installed: JSONL only
                self._tb = None
        if progress:
            try:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=total_steps, dynamic_ncols=True, file=sys.stderr, desc=self.out_dir.name)
            except ImportError:
                self._bar = None

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def log(self, kind: str, step: int, tokens: int, **fields: Any) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, "tokens": tokens, "time": round(self.elapsed, 3)}
        record.update({k: _clean(v) for k, v in fields.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in fields.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self._tb.add_scalar(key if "/" in key else f"{kind}/{key}", value, step)

    def progress(self, step: int, text: str) -> None:
        if not (self.enabled and self.show_progress):
            return
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix_str(text, refresh=True)
        else:
            total = f"/{self.total_steps}" if self.total_steps else ""
            print(f"step {step}{total} {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
