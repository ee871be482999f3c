"""Batches of token windows from memory-mapped shards, reproducible and data-parallel.

The shards of one split are read as a single stream of ``N`` tokens (concatenated in
manifest order; windows may run across a shard boundary, and across documents, which
are separated by end-of-text tokens). A *window* is ``T + 1`` consecutive tokens; its
first ``T`` are the inputs and its last ``T`` the targets, so ``targets[:, t] ==
inputs[:, t + 1]`` for ``t < T - 1``.

:class:`TokenLoader` (training) samples without replacement, epoch by epoch. In epoch
``e`` the windows start at ``o_e + i * T`` for ``i = 0 .. n_e - 1``, with ``n_e = (N - 1
- o_e) // T`` (consecutive windows share one token, so every token after ``o_e`` is a
target once per epoch), where the offset ``o_e`` in ``[0, T)`` and the order of the
windows come from the seed and ``e`` alone (numpy's PCG64 fed by ``SeedSequence([seed, e,
...])``, whose raw streams numpy keeps stable across versions). Global step ``k`` of the
epoch takes the next ``batch_size`` windows of that order; the epoch ends when fewer
than ``batch_size`` remain (they are dropped).

Data parallelism: ``batch_size`` is the *global* batch ``B``; it must be divisible by
``world_size`` ``W``. At every step, rank ``r`` gets rows ``r * B/W .. (r + 1) * B/W - 1``
of the global batch, so ``torch.cat([batch of rank 0, ..., rank W-1], dim=0)`` equals the
batch a single process with ``batch_size=B`` (``world_size=1``) gets at that step, row
for row. Ranks never share a window within a step, and all ranks step in lock-step.

``state_dict()`` is the global position ``(epoch, step)`` plus the settings it depends
on; it is the same on every rank. ``load_state_dict`` restores it exactly: the batches
that follow are identical, bit for bit, to those an uninterrupted loader would have
produced, and it may be loaded by a job with a different ``world_size`` (same global
batch) that then splits the same global batches differently.

:class:`ValidationBatches` is a fixed evaluation set: the first ``num_batches`` global
batches of non-overlapping windows ``[j * T, j * T + T]`` of the validation stream, in
stream order, split across ranks the same way. Iterating it again yields the same batches.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from .shards import Shard, read_shard

__all__ = ["TokenStream", "TokenLoader", "ValidationBatches", "shard_paths"]

_STATE_VERSION = 1


def shard_paths(data: str | os.PathLike | Sequence[str | os.PathLike], split: str = "train") -> list[Path]:
    """Shard files of ``split``: from a prepared directory's manifest, or the given ``.bin`` path(s)."""
    if isinstance(data, (str, os.PathLike)):
        p = Path(data)
        if p.is_dir():
            manifest_path = p / "manifest.json"
            if not manifest_path.exists():
                raise FileNotFoundError(f"{p}: no manifest.json (prepare the data with equiopt.data.prepare)")
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            if not manifest.get("complete"):
                raise ValueError(f"{manifest_path}: preparation is incomplete; run prepare again to finish it")
            if split not in manifest["shards"]:
                raise KeyError(f"{manifest_path}: no split {split!r} (splits: {list(manifest['shards'])})")
            paths = [p / e["file"] for e in manifest["shards"][split]]
            if not paths:
                raise ValueError(f"{manifest_path}: split {split!r} has no shards")
            return paths
        return [p]
    paths = [Path(x) for x in data]
    if not paths:
        raise ValueError("no shard files given")
    return paths


class TokenStream:
    """The shards of one split as one read-only token stream of length ``len(self)``."""

    def __init__(self, paths: Sequence[str | os.PathLike]):
        self.shards: list[Shard] = [read_shard(p) for p in paths]
        eots = {s.header.eot_id for s in self.shards}
        if len(eots) > 1:
            raise ValueError(f"shards disagree on the end-of-text id: {sorted(eots)}")
        self.eot_id = eots.pop()
        self.vocab_size = max(s.header.vocab_size for s in self.shards)
        sizes = np.array([len(s) for s in self.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        self.num_tokens = int(self.starts[-1])

    def __len__(self) -> int:
        return self.num_tokens

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"window [{start}, {start + length}) outside the stream of {self.num_tokens} tokens")
        out = np.empty(length, dtype=np.int64)
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < length:
            shard = self.shards[i]
            lo = start + done - int(self.starts[i])
            n = min(length - done, len(shard) - lo)
            out[done : done + n] = shard.tokens[lo : lo + n]
            done += n
            i += 1
        return out

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """A ``(len(starts), length)`` int64 array of the windows beginning at ``starts``."""
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, s in enumerate(starts):
            out[row] = self.read(int(s), length)
        return out


def _check_dp(batch_size: int, rank: int, world_size: int) -> int:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if batch_size < 1 or batch_size % world_size:
        raise ValueError(f"the global batch_size {batch_size} must be a positive multiple of world_size {world_size}")
    return batch_size // world_size


def _to_torch(arr: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(arr)
    x, y = t[:, :-1], t[:, 1:]
    if device is not None and torch.device(device).type != "cpu":
        x = x.contiguous().pin_memory().to(device, non_blocking=True)
        y = y.contiguous().pin_memory().to(device, non_blocking=True)
    else:
        x, y = x.contiguous(), y.contiguous()
    return x, y


class TokenLoader:
    """Endless ``(inputs, targets)`` int64 batches of shape ``(batch_size // world_size, seq_len)``.

    ``data`` is a directory made by :func:`equiopt.data.prepare.prepare` (its ``split``
    shards are used) or shard file path(s). See the module docstring for the exact
    sampling order, the data-parallel split and the resume guarantee.
    """

    def __init__(
        self,
        data,
        batch_size: int,
        seq_len: int,
        *,
        split: str = "train",
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device | None = None,
    ):
        self.local_batch_size = _check_dp(batch_size, rank, world_size)
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.stream = TokenStream(shard_paths(data, split))
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size, self.device = rank, world_size, device
        worst = (len(self.stream) - 1 - (seq_len - 1)) // seq_len
        if worst < batch_size:
            raise ValueError(
                f"{len(self.stream)} tokens in split {split!r} give fewer than batch_size={batch_size} windows "
                f"of {seq_len + 1} tokens"
            )
        self.epoch = 0
        self.step_in_epoch = 0
        self._plan_epoch: int | None = None

    # -- sampling plan ------------------------------------------------------------------

    def _plan(self, epoch: int) -> tuple[int, np.ndarray]:
        """(offset, window order) of ``epoch``; depends only on seed, epoch and the stream length."""
        if self._plan_epoch != epoch:
            T = self.seq_len
            offset = int(np.random.PCG64(np.random.SeedSequence([self.seed, epoch, 0])).random_raw() % T)
            n = (len(self.stream) - 1 - offset) // T
            keys = np.random.PCG64(np.random.SeedSequence([self.seed, epoch, 1])).random_raw(n)
            self._order = np.argsort(keys, kind="stable")
            self._offset = offset
            self._plan_epoch = epoch
        return self._offset, self._order

    def steps_in_epoch(self, epoch: int | None = None) -> int:
        _, order = self._plan(self.epoch if epoch is None else epoch)
        return len(order) // self.batch_size

    def global_starts(self, epoch: int, step: int) -> np.ndarray:
        """Start positions in the stream of the ``batch_size`` windows of a global step."""
        offset, order = self._plan(epoch)
        idx = order[step * self.batch_size : (step + 1) * self.batch_size]
        if len(idx) < self.batch_size:
            raise IndexError(f"epoch {epoch} has only {len(order) // self.batch_size} steps, asked for step {step}")
        return offset + idx.astype(np.int64) * self.seq_len

    # -- iteration ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.global_starts(self.epoch, self.step_in_epoch)
        b = self.local_batch_size
        local = starts[self.rank * b : (self.rank + 1) * b]
        arr = self.stream.windows(local, self.seq_len + 1)
        self.step_in_epoch += 1
        if self.step_in_epoch >= self.steps_in_epoch(self.epoch):
            self.epoch += 1
            self.step_in_epoch = 0
        return _to_torch(arr, self.device)

    # -- checkpointing ------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain ints: the global position and the settings the sampling order depends on."""
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_tokens": len(self.stream),
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "batch_size", "seq_len", "num_tokens"):
            mine = len(self.stream) if key == "num_tokens" else getattr(self, key)
            if int(state[key]) != mine:
                raise ValueError(f"loader state was saved with {key}={state[key]}, this loader has {key}={mine}")
        if int(state.get("version", _STATE_VERSION)) != _STATE_VERSION:
            raise ValueError(f"unsupported loader state version {state['version']}")
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        if epoch < 0 or not 0 <= step < self.steps_in_epoch(epoch):
            raise ValueError(f"loader state position (epoch {epoch}, step {step}) does not exist")
        self.epoch, self.step_in_epoch = epoch, step


class ValidationBatches:
    """The first ``num_batches`` global batches of consecutive non-overlapping windows, the same every time.

    ``num_batches=None`` takes every full global batch. Each rank gets its rows of each
    global batch exactly as in :class:`TokenLoader`.
    """

    def __init__(
        self,
        data,
        batch_size: int,
        seq_len: int,
        *,
        split: str = "val",
        num_batches: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device | None = None,
    ):
        self.local_batch_size = _check_dp(batch_size, rank, world_size)
        self.stream = TokenStream(shard_paths(data, split))
        self.batch_size, self.seq_len = batch_size, seq_len
        self.rank, self.world_size, self.device = rank, world_size, device
        available = ((len(self.stream) - 1) // seq_len) // batch_size
        if num_batches is None:
            num_batches = available
        if num_batches < 1 or num_batches > available:
            raise ValueError(
                f"split {split!r} has {len(self.stream)} tokens: {available} global batches of "
                f"{batch_size} x {seq_len + 1}-token windows, asked for {num_batches}"
            )
        self.num_batches = num_batches

    def __len__(self) -> int:
        return self.num_batches

    @property
    def num_tokens(self) -> int:
        """Target tokens per pass, over all ranks."""
        return self.num_batches * self.batch_size * self.seq_len

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        b = self.local_batch_size
        for i in range(self.num_batches):
            first = i * self.batch_size + self.rank * b
            starts = (first + np.arange(b, dtype=np.int64)) * self.seq_len
            yield _to_torch(self.stream.windows(starts, self.seq_len + 1), self.device)
