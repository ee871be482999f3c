"""Polynomial coefficients for the polar-factor and inverse-square-root iterations.

Every coefficient used by :mod:`equiopt.linalg` comes from this module, either derived
here or quoted with its source.

Polar Express (Amsel, Persson, Musco and Gower, 2025) composes odd quintic polynomials
``p_k(x) = a_k x + b_k x^3 + c_k x^5``, each the minimax approximation of the constant 1
on the interval that currently contains the singular values:

    p_k = argmin_{p odd, deg 5} max_{x in [l_k, u_k]} |1 - p(x)|.

By the equioscillation theorem the optimum touches ``1 - E_k`` at ``l_k`` and at its
interior minimum and ``1 + E_k`` at its interior maximum and at ``u_k`` (four alternation
points for three coefficients plus the error). The greedy schedule maps the interval to
``[l_{k+1}, u_{k+1}] = [1 - E_k, 1 + E_k]``; its composition is optimal among all
compositions of quintics (Amsel et al., Theorem 4.1). :func:`minimax_quintic` computes
``p_k`` with the Remez exchange algorithm in float64, and :func:`greedy_schedule` chains
the steps. Nothing here is copied from a table: the schedules are recomputed (and
cached) from the interval bounds, and the tests check the equioscillation property.
"""

from __future__ import annotations

import functools
import math

import torch

# Muon's quintic Newton-Schulz coefficients (K. Jordan et al., "Muon: An optimizer for
# hidden layers in neural networks", 2024). They are tuned so that the iteration's
# slope at 0 is large (3.4445) and singular values settle in about [0.7, 1.2] after
# five steps; the iteration is not convergent to exactly 1, by design.
MUON_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

# The classical cubic Newton-Schulz step h(t) = (3 - t) / 2 (Higham, "Functions of
# Matrices", 2008, eq. 6.35); used by the coupled inverse-square-root iteration.
NEWTON_SCHULZ_CUBIC = (1.5, -0.5)


# Limit of the minimax quintic on [1 - E, 1 + E] as E -> 0: the unique odd quintic with
# p(1) = 1, p'(1) = 0, p''(1) = 0 (solve the 3x3 system), third-order convergent.
QUINTIC_LIMIT = (15.0 / 8.0, -10.0 / 8.0, 3.0 / 8.0)


def _quintic(a: float, b: float, c: float, x: float) -> float:
    return x * (a + x * x * (b + c * x * x))


def _interior_extrema(a: float, b: float, c: float) -> list[float]:
    """Positive critical points of ``a x + b x^3 + c x^5`` (roots of a + 3b y + 5c y^2, y = x^2)."""
    disc = 9.0 * b * b - 20.0 * a * c
    if disc < 0 or c == 0:
        return []
    r = math.sqrt(disc)
    ys = sorted(((-3.0 * b - r) / (10.0 * c), (-3.0 * b + r) / (10.0 * c)))
    return [math.sqrt(y) for y in ys if y > 0]


def minimax_quintic(lo: float, hi: float, iters: int = 100) -> tuple[float, float, float, float]:
    """Odd quintic minimising ``max |1 - p(x)|`` on ``[lo, hi]``; returns ``(a, b, c, E)``.

    Remez exchange on the four alternation points ``lo < x1 < x2 < hi``: solve
    ``p(x_i) + (-1)^i E = 1`` for ``(a, b, c, E)``, move ``x1, x2`` to the interior
    extrema of ``p`` and repeat until the points stop moving.

    Args:
        lo: the lower end of the interval, ``0 < lo < hi``.
        hi: the upper end.
        iters: the most exchange iterations.

    Returns:
        ``(a, b, c, E)``: ``p(x) = a x + b x^3 + c x^5`` and its largest error ``E``.

    Raises:
        ValueError: unless ``0 < lo < hi``.
    """
    if not (0.0 < lo < hi):
        raise ValueError(f"need 0 < lo < hi, got lo={lo}, hi={hi}")
    import numpy as np

    xs = [lo, lo + (hi - lo) / 3.0, lo + 2.0 * (hi - lo) / 3.0, hi]
    sol = None
    for _ in range(iters):
        mat = np.array([[x, x**3, x**5, (-1.0) ** i] for i, x in enumerate(xs)])
        sol = np.linalg.solve(mat, np.ones(4))
        a, b, c, _ = (float(v) for v in sol)
        ext = [x for x in _interior_extrema(a, b, c) if lo < x < hi]
        if len(ext) != 2:
            break
        new = [lo, ext[0], ext[1], hi]
        if max(abs(p - q) for p, q in zip(new, xs)) <= 1e-15 * hi:
            xs = new
            break
        xs = new
    assert sol is not None
    a, b, c, _ = (float(v) for v in sol)
    # The true maximum deviation (not the levelled error of the last linear solve).
    grid = [lo, hi, *(x for x in _interior_extrema(a, b, c) if lo < x < hi)]
    err = max(abs(1.0 - _quintic(a, b, c, x)) for x in grid)
    return a, b, c, err


def schedule(lo: float, steps: int, hi: float = 1.0, safety: float = 1.0) -> tuple[tuple[float, float, float], ...]:
    """:func:`greedy_schedule` for use inside a traced step: a compiler calls it once at
    trace time and bakes the coefficients in as constants (they depend on Python numbers
    only), instead of tracing the Remez iteration."""
    return greedy_schedule(lo, steps, hi, safety)


@functools.cache
def greedy_schedule(
    lo: float, steps: int, hi: float = 1.0, safety: float = 1.0
) -> tuple[tuple[float, float, float], ...]:
    """The greedy Polar Express schedule for singular values in ``[lo, hi]``.

    ``safety > 1`` designs every step but the last for an interval whose upper end is
    widened by that factor, so rounding that pushes a value slightly past the bound is
    mapped back inside rather than amplified (Amsel et al. use the same device).

    Args:
        lo: the smallest singular value the schedule is designed for (after normalisation).
        steps: the number of quintic steps.
        hi: the largest singular value.
        safety: the widening factor of the upper end for every step but the last.

    Returns:
        One ``(a, b, c)`` per step, ``p(x) = a x + b x^3 + c x^5``; each step is the
        minimax quintic for the interval the previous steps leave.
    """
    coeffs = []
    l, u = lo, hi
    for k in range(steps):
        top = u * (safety if k < steps - 1 else 1.0)
        if top - l < 1e-4:
            # Interval has collapsed onto 1: the minimax quintic tends to the one with a
            # triple contact at 1 (p(1) = 1, p'(1) = p''(1) = 0), i.e. Newton-Schulz's
            # quintic (15 x - 10 x^3 + 3 x^5) / 8, which squares (cubes) the error.
            coeffs.append(QUINTIC_LIMIT)
            err = 0.0
        else:
            a, b, c, err = minimax_quintic(l, top)
            coeffs.append((a, b, c))
        l, u = 1.0 - err, 1.0 + err
    return tuple(coeffs)


def schedule_bounds(lo: float, coeffs, hi: float = 1.0, samples: int = 20001) -> tuple[float, float]:
    """Range of the composed polynomial on ``[lo, hi]`` (dense log-spaced sampling)."""
    import numpy as np

    x = np.exp(np.linspace(math.log(lo), math.log(hi), samples))
    for a, b, c in coeffs:
        x = x * (a + x * x * (b + c * x * x))
    return float(x.min()), float(x.max())


if hasattr(torch, "compiler") and hasattr(torch.compiler, "assume_constant_result"):
    schedule = torch.compiler.assume_constant_result(schedule)
