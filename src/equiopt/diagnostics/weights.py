"""Per-role weight and update statistics for the training loop.

For a role ``r`` (``embedding``, ``lm_head``, ``attention``, ``mlp_in``, ``mlp_out``,
``router``, ``matrix``, ``vector``, or any string) with parameters ``W_1..W_m`` the
statistics are taken over all of the role's entries together, ``numel = sum_j numel(W_j)``:

- ``weight_rms  = sqrt(sum_j ||W_j||_F^2 / numel)`` of the current weights,
- ``update_rms  = sqrt(sum_j ||W_j - W_j^snap||_F^2 / numel)`` since the last snapshot,
- ``update_to_weight = update_rms / weight_rms``.

Memory: :meth:`WeightTracker.snapshot` copies the tracked parameters (in their own dtype,
so exactly; a lower-precision copy would round away updates of relative size ~1e-3), so
it costs one extra copy of those weights while a snapshot is held. Take it only at the
log cadence, once per log interval. To measure a single optimizer step, call
``snapshot()`` just before ``optimizer.step()`` on a logging step and ``update_stats()``
right after; the snapshot is then released (``release=True``), so the copy lives for one
step per interval. To measure the cumulative update over an interval instead, snapshot at
the start of the interval and call ``update_stats()`` at its end. ``offload=True`` keeps
the copy in CPU memory (plain tensors only) at the cost of a device-to-host copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

__all__ = ["WEIGHT_STAT_KEYS", "WeightTracker"]

#: Keys of each role's dict returned by :meth:`WeightTracker.update_stats`.
WEIGHT_STAT_KEYS = ("weight_rms", "update_rms", "update_to_weight", "numel")


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def _sq_norm(t: torch.Tensor) -> torch.Tensor:
    """``||t||_F^2`` as a float64 scalar tensor; sharded DTensors are reduced over their mesh."""
    n = torch.linalg.vector_norm(t, dtype=torch.float32)
    if _is_dtensor(n):
        n = n.full_tensor()
    return n.double().square()


def _total(scalars: list[torch.Tensor]) -> float:
    total = 0.0
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in scalars:
        by_device.setdefault(t.device, []).append(t)
    for ts in by_device.values():
        total += float(torch.stack(ts).sum())
    return total


class WeightTracker:
    """Weight RMS, update RMS and their ratio per parameter role.

    ``named_params_by_role``: a mapping role -> iterable of ``(name, parameter)``. A
    parameter listed twice within a role is counted once; one listed under two roles
    (a tied embedding/LM head) counts in both.

    Usage::

        tracker = WeightTracker({"embedding": [("wte.weight", wte.weight)], ...})
        if step % log_every == 0:
            tracker.snapshot()
        optimizer.step()
        if step % log_every == 0:
            stats = tracker.update_stats()   # {role: {"weight_rms": ..., ...}}
            log(WeightTracker.flatten(stats))

    Args:
        named_params_by_role: ``(name, parameter)`` pairs per role.
        offload: keep the snapshot in CPU memory.
    """

    def __init__(
        self, named_params_by_role: Mapping[str, Iterable[tuple[str, torch.Tensor]]], *, offload: bool = False
    ):
        self.roles: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for role, pairs in named_params_by_role.items():
            seen, kept = set(), []
            for name, p in pairs:
                if id(p) not in seen:
                    seen.add(id(p))
                    kept.append((str(name), p))
            self.roles[str(role)] = kept
        self.offload = offload
        self._snap: dict[str, list[torch.Tensor]] | None = None

    @classmethod
    def from_assignments(cls, model: torch.nn.Module, rows: Iterable, **kwargs) -> WeightTracker:
        """Build from role rows (objects with ``.name`` and ``.role``, e.g. ``equiopt.assign_roles(model)``).

        Args:
            model: the model the rows name parameters of.
            rows (Iterable): the rows, e.g. a :class:`~equiopt.roles.RoleTable`.
            **kwargs (Any): passed to the constructor (``offload``).

        Returns:
            The tracker.
        """
        params = dict(model.named_parameters(remove_duplicate=False))
        by_role: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for row in rows:
            by_role.setdefault(str(row.role), []).append((row.name, params[row.name]))
        return cls(by_role, **kwargs)

    @property
    def has_snapshot(self) -> bool:
        return self._snap is not None

    @torch.no_grad()
    def snapshot(self) -> None:
        """Copy the tracked parameters (one extra copy of them until released)."""
        snap = {}
        for role, pairs in self.roles.items():
            copies = []
            for _, p in pairs:
                c = p.detach()
                if self.offload and not _is_dtensor(c):
                    c = c.to("cpu", copy=True)
                else:
                    c = c.clone()
                copies.append(c)
            snap[role] = copies
        self._snap = snap

    def release(self) -> None:
        """Drop the snapshot."""
        self._snap = None

    @torch.no_grad()
    def weight_stats(self) -> dict[str, dict[str, float]]:
        """``{role: {"weight_rms", "numel"}}`` of the current weights; needs no snapshot.

        Returns:
            The statistics per role.
        """
        return self._stats(with_update=False)

    @torch.no_grad()
    def update_stats(self, release: bool = True) -> dict[str, dict[str, float]]:
        """``{role: {"weight_rms", "update_rms", "update_to_weight", "numel"}}`` since the last snapshot.

        Floats (``numel`` an int); NaN for a role without parameters or with zero weights
        in the ratio. Drops the snapshot afterwards unless ``release=False``.

        Args:
            release: drop the snapshot afterwards.

        Returns:
            The statistics per role.

        Raises:
            RuntimeError: without a snapshot.
        """
        if self._snap is None:
            raise RuntimeError("update_stats() needs a snapshot(); call it at the start of the interval")
        out = self._stats(with_update=True)
        if release:
            self._snap = None
        return out

    def _stats(self, with_update: bool) -> dict[str, dict[str, float]]:
        values: list[tuple[float, float]] = []
        for role, pairs in self.roles.items():
            w2: list[torch.Tensor] = []
            d2: list[torch.Tensor] = []
            for j, (_, p) in enumerate(pairs):
                x = p.detach()
                w2.append(_sq_norm(x))
                if with_update:
                    s = self._snap[role][j]
                    if not _is_dtensor(x) and s.device != x.device:
                        s = s.to(x.device)
                    d2.append(_sq_norm(x - s))
            # one host transfer per role and device, not one per parameter
            values.append((_total(w2), _total(d2)))
        out: dict[str, dict[str, float]] = {}
        for (role, pairs), (w2, d2) in zip(self.roles.items(), values):
            numel = sum(p.numel() for _, p in pairs)
            nan = float("nan")
            weight_rms = math.sqrt(w2 / numel) if numel else nan
            stats: dict = {"weight_rms": weight_rms}
            if with_update:
                update_rms = math.sqrt(d2 / numel) if numel else nan
                stats["update_rms"] = update_rms
                stats["update_to_weight"] = update_rms / weight_rms if numel and weight_rms > 0 else nan
            stats["numel"] = numel
            out[role] = stats
        return out

    @staticmethod
    def flatten(stats: Mapping[str, Mapping[str, float]], prefix: str = "weights") -> dict[str, float]:
        """``{role: {key: v}}`` to ``{f"{prefix}/{role}/{key}": v}`` for loggers (``numel`` dropped).

        Args:
            stats: statistics per role, as :meth:`update_stats` or :meth:`weight_stats` give them.
            prefix: the first part of every key.

        Returns:
            A flat mapping of keys to floats.
        """
        return {
            f"{prefix}/{role}/{key}" if prefix else f"{role}/{key}": value
            for role, d in stats.items()
            for key, value in d.items()
            if key != "numel"
        }
