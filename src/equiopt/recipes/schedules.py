"""Learning-rate schedules of the recipes, as ``LambdaLR`` multipliers.

A schedule is a dict stored under the ``schedule`` key of a settings dict (and
so of a torch param group). ``step`` below is the scheduler's counter: the
multiplier at ``step = k`` is the one in force for the ``(k+1)``-th optimizer
update, i.e. after ``k`` calls to ``scheduler.step()``. Training for
``total_steps`` updates uses ``step = 0 .. total_steps - 1``; the multiplier
reaches exactly 0 at ``step = total_steps`` and stays 0 after it.

``warmup_cosine`` (``warmup_steps = w``, ``total_steps = T``)
    ``(step + 1) / w`` for ``step < w`` (so the first update uses ``1/w`` and
    update ``w`` uses the full rate), then ``0.5 * (1 + cos(pi * p))`` with
    ``p = (step - w) / (T - w)`` clipped to ``[0, 1]``: 1 at ``step = w``, 0 at
    ``step = T``. Without ``T``: warmup, then constant 1. With ``T <= w`` the
    multiplier would be 0 once warmup ends, never having reached 1:
    :func:`make_lr_lambda` and :func:`build_scheduler` shorten such a warm-up to
    ``max(1, T // 10)`` steps and warn, naming the param group, its role and both numbers.

``stable_decay`` (``stable_fraction = f``, ``total_steps = T``)
    1 for ``step < S = floor(f * T)``, then ``(T - step) / (T - S)``: 1 at
    ``step = S``, 0 at ``step = T``. Without ``T``: constant 1.

``constant``
    1 always.

The multipliers are small callable objects (not closures), so
``LambdaLR.state_dict()`` saves their parameters and ``load_state_dict``
restores them; they are also picklable.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .schema import normalize_schedule

__all__ = [
    "WarmupCosine",
    "StableDecay",
    "Constant",
    "make_lr_lambda",
    "build_scheduler",
]


def _check_total(total_steps: Any) -> int | None:
    if total_steps is None:
        return None
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be a positive integer or None, got {total_steps!r}")
    return int(total_steps)


class Multiplier:
    """Base: equality and repr from the instance attributes."""

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.__dict__.items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"{type(self).__name__}({args})"


class WarmupCosine(Multiplier):
    """Linear warmup ``(step + 1) / warmup_steps``, then half-cosine to 0 at ``total_steps``.

    Called with the scheduler's step counter it returns the lr multiplier in force for
    the next optimizer update (the formula is in the module docstring).

    Args:
        warmup_steps: the length ``w`` of the linear warmup; the first update uses ``1/w``
            and update ``w`` the full rate.
        total_steps: the step ``T`` at which the multiplier reaches 0 (and stays there);
            None: warmup, then constant 1.
    """

    def __init__(self, warmup_steps: int = 100, total_steps: int | None = None) -> None:
        self.warmup_steps = int(warmup_steps)
        self.total_steps = total_steps

    def __call__(self, step: int) -> float:
        """The multiplier at ``step``.

        Args:
            step: the scheduler's counter (``scheduler.step()`` calls so far).

        Returns:
            The lr multiplier, in ``[0, 1]``.
        """
        w, total = self.warmup_steps, self.total_steps
        if step < w:
            return (step + 1) / w
        if total is None:
            return 1.0
        if total <= w:
            return 0.0
        progress = min(max((step - w) / (total - w), 0.0), 1.0)
        return 0.5 * (1.0 + math.cos(math.pi * progress))


class StableDecay(Multiplier):
    """1 until ``floor(stable_fraction * total_steps)``, then linear to 0 at ``total_steps``.

    Called with the scheduler's step counter it returns the lr multiplier in force for
    the next optimizer update (the formula is in the module docstring).

    Args:
        stable_fraction: the fraction ``f`` of ``total_steps`` held at the full rate;
            the linear decay starts at ``S = floor(f * T)``.
        total_steps: the step ``T`` at which the multiplier reaches 0 (and stays there);
            None: constant 1.
    """

    def __init__(self, stable_fraction: float = 0.6, total_steps: int | None = None) -> None:
        self.stable_fraction = float(stable_fraction)
        self.total_steps = total_steps

    @property
    def stable_steps(self) -> int | None:
        """``floor(stable_fraction * total_steps)``, robust to float rounding (0.29 * 100 -> 29)."""
        if self.total_steps is None:
            return None
        return math.floor(self.stable_fraction * self.total_steps + 1e-9)

    def __call__(self, step: int) -> float:
        """The multiplier at ``step``.

        Args:
            step: the scheduler's counter (``scheduler.step()`` calls so far).

        Returns:
            The lr multiplier, in ``[0, 1]``.
        """
        total = self.total_steps
        if total is None:
            return 1.0
        stable = self.stable_steps
        if step < stable:
            return 1.0
        if step >= total:
            return 0.0
        return (total - step) / (total - stable)


class Constant(Multiplier):
    """Multiplier 1 at every step (the ``constant`` schedule; no parameters)."""

    def __call__(self, step: int) -> float:
        """The multiplier at ``step``.

        Args:
            step: the scheduler's counter (ignored).

        Returns:
            1.0.
        """
        return 1.0


def make_lr_lambda(
    schedule: Mapping[str, Any] | None, total_steps: int | None = None, where: str = "schedule"
) -> Callable[[int], float]:
    """The lr multiplier ``step -> float`` of ``schedule`` (``None``: constant 1).

    See the module docstring for the formulas and for the behaviour without
    ``total_steps``.

    Args:
        schedule: a schedule dict (``{"kind": "warmup_cosine", "warmup_steps": 100}``,
            ``{"kind": "stable_decay", "stable_fraction": 0.6}`` or
            ``{"kind": "constant"}``; missing fields take their defaults, see
            :func:`~equiopt.recipes.schema.normalize_schedule`), or None.
        total_steps: the number of optimizer updates of the run; None: no decay. A warm-up
            that does not fit in it (``warmup_steps >= total_steps``) is shortened to a tenth
            of the run, with a warning naming ``where`` and both numbers: otherwise the run
            would never reach its learning rate.
        where: what the warning calls the schedule (the param group and its role).

    Returns:
        A picklable multiplier (:class:`WarmupCosine`, :class:`StableDecay` or
        :class:`Constant`) for ``torch.optim.lr_scheduler.LambdaLR``.

    Raises:
        ValueError: on a bad schedule (unknown kind or key, out-of-range value) or a
            ``total_steps`` that is not a positive integer or None.
    """
    total = _check_total(total_steps)
    if schedule is None:
        return Constant()
    sched = normalize_schedule(schedule)
    kind = sched["kind"]
    if kind == "warmup_cosine":
        warmup = sched["warmup_steps"]
        if total is not None and warmup >= total:
            short = max(1, total // 10)
            warnings.warn(
                f"{where}: a warm-up of {warmup} steps does not fit in total_steps={total}; "
                f"shortened to {short} steps (a tenth of the run)",
                UserWarning,
                stacklevel=3,
            )
            warmup = short
        return WarmupCosine(warmup, total)
    if kind == "stable_decay":
        return StableDecay(sched["stable_fraction"], total)
    return Constant()


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int | None = None, last_epoch: int = -1
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` with one multiplier per param group, from each group's ``schedule``.

    Groups without a ``schedule`` entry (or with ``None``) keep their lr
    (multiplier 1). Call ``scheduler.step()`` once after every
    ``optimizer.step()``.

    Args:
        optimizer: the optimizer whose param groups carry the ``schedule`` entries (as
            :func:`equiopt.build_optimizer` and recipe param groups do).
        total_steps: the number of optimizer updates of the run; None: no decay.
        last_epoch: passed to ``LambdaLR`` (``-1``: a new schedule).

    Returns:
        The scheduler, one multiplier per param group (see :func:`make_lr_lambda`).

    Raises:
        ValueError: on a bad schedule, naming the param group (and its role), or a
            ``total_steps`` that is not a positive integer or None.
    """
    total = _check_total(total_steps)
    lambdas = []
    for i, group in enumerate(optimizer.param_groups):
        schedule = group.get("schedule")
        role = group.get("role")
        where = f"param group {i}" + (f" (role {role!r})" if role is not None else "")
        try:
            lambdas.append(make_lr_lambda(schedule, total, where))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas, last_epoch=last_epoch)
