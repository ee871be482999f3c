"""Training runs, several at a time: a priority queue of runs and at most ``jobs`` of them running.

A small model trained on a large GPU leaves it mostly idle: each step launches more kernels than it
has work for, so the GPU waits on one Python process. Several runs side by side, each in its own
process, fill it; a study of many short runs then finishes several times sooner, and every run
trains exactly as it would alone (its own process, seed, data order and log).

:class:`RunPool` takes runs (a config path and its ``--set`` values) with a priority, and starts the
highest-priority waiting run whenever a slot is free:

- ``jobs == 1``: in this process, one after another, through ``train_fn`` (the default is
  :func:`equiopt.train.loop.train`);
- ``jobs > 1``: each run in a process of its own, ``python -m equiopt.study.runpool``, which imports
  the trainer named by ``trainer`` (``"module:function"``). The run's output is kept in a temporary
  file and shown only when the run fails; a failure stops the pool, ends the runs still going, and
  raises :class:`RunFailed` naming the run with the end of its output. On a machine with several
  GPUs the runs are spread over them, each run seeing one (``devices``).

:meth:`RunPool.wait` returns the keys of the runs that finished since the last call, so a caller can
queue runs that depend on them (a sweep queues an arm's evaluation runs once its tuning runs are
done). A run that raises :class:`~equiopt.train.loop.NonFiniteLossError` counts as finished: its
log ends with ``status: nonfinite``, a result, not a failure.
"""

from __future__ import annotations

import heapq
import importlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["RunFailed", "RunPool", "DEFAULT_TRAINER"]

DEFAULT_TRAINER = "equiopt.train.loop:train"


class RunFailed(RuntimeError):
    """A run of a :class:`RunPool` ended with an error (its name and the end of its output)."""


def _split_trainer(trainer: str) -> tuple[str, str]:
    """``"module:function"`` as its two parts, or a ValueError naming ``trainer``."""
    module, sep, name = trainer.partition(":") if isinstance(trainer, str) else ("", "", "")
    if not sep or not module or not name:
        raise ValueError(f"trainer must be 'module:function', got {trainer!r}")
    return module, name


def _import(trainer: str) -> Callable[..., Any]:
    module, name = _split_trainer(trainer)
    return getattr(importlib.import_module(module), name)


def _train_one(config: str, sets: dict, train_fn: Callable[..., Any] | None, progress: bool = False) -> None:
    from ..train.config import load_config
    from ..train.loop import NonFiniteLossError

    if train_fn is None:
        from ..train.loop import train as train_fn
    cfg = load_config(config, sets)
    try:
        train_fn(cfg, progress=progress)
    except NonFiniteLossError:
        pass  # the log ends with status "nonfinite": a result


class RunPool:
    """Runs ``(config, sets)`` pairs, ``jobs`` at a time, highest priority (lowest key) first.

    Args:
        jobs: runs at once; 1 trains in this process, more start a process per run.
        train_fn: with ``jobs == 1``, the callable ``train_fn(cfg, progress=...)`` (default
            :func:`equiopt.train.loop.train`).
        trainer: with ``jobs > 1``, the trainer each run's process imports, ``"module:function"``.
        progress: with ``jobs == 1``, whether each run shows its own progress bar (runs side by
            side never do: their bars would interleave).
        env: extra environment variables for the runs' processes. Unless given here or already
            set, ``OMP_NUM_THREADS`` is the machine's cores divided among the jobs.
        devices: with ``jobs > 1``, the GPUs the runs are spread over: each run sees one of them
            (``CUDA_VISIBLE_DEVICES``), the one with the fewest runs of the pool on it. ``"auto"``:
            the GPUs this process sees, when it sees two or more (one GPU, or none: every run sees
            what this process sees).
    """

    def __init__(
        self,
        jobs: int = 1,
        train_fn: Callable[..., Any] | None = None,
        trainer: str = DEFAULT_TRAINER,
        progress: bool = True,
        env: dict[str, str] | None = None,
        devices: Sequence[str] | str | None = "auto",
    ):
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
        if jobs > 1 and train_fn is not None:
            raise ValueError(
                "train_fn runs in this process, one run at a time; with jobs > 1 name the trainer each run's "
                "process imports (trainer='module:function')"
            )
        if jobs > 1:
            _split_trainer(trainer)
        self.jobs, self.train_fn, self.trainer, self.progress = jobs, train_fn, trainer, progress
        self.env = dict(os.environ)
        if "OMP_NUM_THREADS" not in self.env and jobs > 1:
            self.env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
        self.env.update(env or {})
        if devices == "auto":
            devices = _visible_gpus(self.env) if jobs > 1 else None
        elif isinstance(devices, str):
            raise ValueError(f"devices must be 'auto', None or a list of GPU ids, got {devices!r}")
        self.devices = [str(d) for d in devices] if devices else []
        self._device_of: dict[subprocess.Popen, str] = {}
        self._queue: list[tuple[Any, int, Hashable, str, dict]] = []
        self._order = itertools.count()
        self._running: dict[subprocess.Popen, tuple[Hashable, str, Any]] = {}
        self._started: dict[subprocess.Popen, float] = {}
        self.seconds: dict[Hashable, float] = {}  # each finished run's own wall time

    def __len__(self) -> int:
        """Runs waiting or running."""
        return len(self._queue) + len(self._running)

    def submit(self, key: Hashable, config: str | Path, sets: dict, priority: Any = 0) -> None:
        """Queue a run: ``load_config(config, sets)`` then the trainer; ``key`` comes back from :meth:`wait`."""
        heapq.heappush(self._queue, (priority, next(self._order), key, str(config), json.loads(json.dumps(sets))))

    def wait(self) -> list[Hashable]:
        """Start waiting runs in free slots, block until at least one run ends, return the keys that ended.

        Raises:
            RunFailed: a run ended with an error (the runs still going are ended first).
        """
        if not self:
            return []
        if self.jobs == 1:
            _, _, key, config, sets = heapq.heappop(self._queue)
            start = time.perf_counter()
            _train_one(config, sets, self.train_fn, self.progress)
            self.seconds[key] = time.perf_counter() - start
            return [key]
        while self._queue and len(self._running) < self.jobs:
            self._start(*heapq.heappop(self._queue)[2:])
        while True:
            ended = [proc for proc in self._running if proc.poll() is not None]
            if ended:
                break
            time.sleep(0.2)
        keys = []
        for proc in ended:
            key, name, output = self._running.pop(proc)
            if proc.returncode != 0:
                output.seek(0)
                tail = output.read().decode(errors="replace")[-4000:]
                output.close()
                self.close()
                raise RunFailed(f"run {name} exited with code {proc.returncode}; the end of its output:\n{tail}")
            output.close()
            self.seconds[key] = time.perf_counter() - self._started.pop(proc)
            self._device_of.pop(proc, None)
            keys.append(key)
        return keys

    def _start(self, key: Hashable, config: str, sets: dict) -> None:
        output = tempfile.TemporaryFile()
        job = json.dumps({"config": config, "sets": sets, "trainer": self.trainer})
        env, device = self.env, None
        if self.devices:
            busy = list(self._device_of.values())
            device = min(self.devices, key=busy.count)
            env = {**self.env, "CUDA_VISIBLE_DEVICES": device}
        proc = subprocess.Popen(
            [sys.executable, "-m", "equiopt.study.runpool", job],
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        if device is not None:
            self._device_of[proc] = device
        self._running[proc] = (key, sets.get("run.name", config), output)
        self._started[proc] = time.perf_counter()

    def close(self) -> None:
        """End the runs still going (they restart from scratch when queued again) and drop the queue."""
        self._queue.clear()
        for proc in list(self._running):
            if proc.poll() is None:
                proc.terminate()
        for proc, (_, _, output) in list(self._running.items()):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            output.close()
        self._running.clear()
        self._started.clear()
        self._device_of.clear()

    def __enter__(self) -> RunPool:
        if self.jobs > 1 and _main_thread():
            self._previous = signal.signal(signal.SIGTERM, _terminated)
        return self

    def __exit__(self, *exc) -> None:
        previous = getattr(self, "_previous", None)
        if previous is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the cleanup short
        try:
            self.close()
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
                del self._previous


def _visible_gpus(env: dict[str, str]) -> list[str] | None:
    """The GPUs a process started with ``env`` sees, when there are two or more."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [d.strip() for d in listed.split(",") if d.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    return ids if len(ids) > 1 else None


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _terminated(signum, frame):  # SIGTERM ends the pool's runs as Ctrl-C does
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    """One run of a pool: ``python -m equiopt.study.runpool '{"config": ..., "sets": ..., "trainer": ...}'``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit(
            'usage: python -m equiopt.study.runpool \'{"config": PATH, "sets": {...}, "trainer": "module:function"}\''
        )
    job = json.loads(args[0])
    _train_one(job["config"], job["sets"], _import(job.get("trainer", DEFAULT_TRAINER)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
