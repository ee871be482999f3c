"""Statistics of paired comparisons: Student's t distribution, the 95 % interval of a mean
paired difference, and the exact paired sign-flip (randomisation) test (no SciPy needed).

The interval rests on the differences being normal; the sign-flip test rests only on the
pairing (under no difference, each pair's sign is a fair coin). With ``n`` pairs its p value
cannot go below ``2 / 2**n`` (0.0625 for five), so a five-seed study can be consistent in sign
on every seed and still not be decided by it."""

from __future__ import annotations

import math
import statistics

__all__ = ["t_cdf", "t_quantile", "paired_interval", "sign_flip_p", "sign_flip_floor"]


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (Lentz's method)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    front = math.exp(lbeta + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """CDF of Student's t distribution with ``df`` degrees of freedom."""
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2.0, 0.5, x)
    return 1.0 - tail if t > 0 else tail


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0 < q < 1 or df <= 0:
        raise ValueError(f"need 0 < q < 1 and df > 0, got q={q}, df={df}")
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def paired_interval(diffs: list[float]) -> tuple[float | None, float | None, tuple[float, float] | None]:
    """``(mean, std, ci)`` of paired differences: the mean (None without any), the sample
    standard deviation and the 95 % Student-t interval of the mean (None below two)."""
    mean = statistics.fmean(diffs) if diffs else None
    std = statistics.stdev(diffs) if len(diffs) > 1 else None
    if std is None or mean is None:
        return mean, std, None
    half = t_quantile(0.975, len(diffs) - 1) * std / math.sqrt(len(diffs))
    return mean, std, (mean - half, mean + half)


#: Up to this many pairs :func:`sign_flip_p` enumerates every sign assignment; beyond, it samples.
EXACT_PAIRS = 20
_SAMPLES = 200_000


def sign_flip_floor(n: int) -> float | None:
    """The smallest two-sided p value the exact sign-flip test can give with ``n`` nonzero pairs:
    ``2 / 2**n`` (0.0625 for five), None below one pair."""
    return None if n < 1 else min(1.0, 2.0 / 2**n)


def sign_flip_p(diffs: list[float]) -> float | None:
    """Two-sided exact paired sign-flip (randomisation) p value of a mean difference of 0.

    The share of the ``2**n`` assignments of signs to the ``n`` paired differences whose mean
    is at least as far from 0 as the observed one (ties count, with a relative tolerance of
    1e-9 for rounding). It assumes nothing about the differences' distribution beyond the
    pairing: under no difference each sign is a fair coin. ``[1, 2, 3, 4, 5]`` gives
    ``2 / 32 = 0.0625``, the smallest p of five pairs. Exact up to :data:`EXACT_PAIRS` pairs;
    beyond, a Monte Carlo estimate from 200,000 assignments drawn with a fixed seed
    (``(1 + hits) / (1 + draws)``). None without any difference or with a non-finite one.
    """
    d = [float(x) for x in diffs]
    if not d or not all(math.isfinite(x) for x in d):
        return None
    observed = abs(math.fsum(d))
    tol = 1e-9 * max(math.fsum(abs(x) for x in d), 1e-300)
    import numpy as np

    a = np.abs(np.asarray(d, dtype=np.float64))
    n = len(d)
    if n <= EXACT_PAIRS:
        hits = 0
        # every sign pattern as the bits of 0 .. 2**n - 1, in blocks of at most 2**16 patterns
        lo_bits = min(n, 16)
        low = ((np.arange(2**lo_bits)[:, None] >> np.arange(lo_bits)) & 1) * 2 - 1
        low_sums = low @ a[:lo_bits]
        for high in range(2 ** (n - lo_bits)):
            signs = ((high >> np.arange(n - lo_bits)) & 1) * 2 - 1
            total = low_sums + float(signs @ a[lo_bits:])
            hits += int(np.count_nonzero(np.abs(total) >= observed - tol))
        return hits / 2**n
    rng = np.random.default_rng(0)
    hits = 0
    for start in range(0, _SAMPLES, 10_000):
        signs = rng.integers(0, 2, size=(min(10_000, _SAMPLES - start), n)) * 2 - 1
        hits += int(np.count_nonzero(np.abs(signs @ a) >= observed - tol))
    return (1 + hits) / (1 + _SAMPLES)
