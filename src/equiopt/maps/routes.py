"""The two routes of a one-sided map and the choice between them: ``"gram"`` (Gram, coupled
inverse square root, product: Algorithm 1 as written) or ``"direct"`` (the polar factor of
the work matrix itself, as Muon computes it). :func:`one_sided_route` decides; with
``"auto"`` it takes the cheaper by :func:`route_costs`, from :func:`route_flops` at the
device's :data:`ROUTE_RATES`."""

from __future__ import annotations

import math

import torch

from ..linalg import default_dtype
from ..linalg.device_choices import decides_like
from ..linalg.products import OUT_DTYPE_MM
from .base import RowReducer
from .precision import gram_precision

ROUTES = ("auto", "gram", "direct")

#: Product rates (FLOP/s) by precision on the device types whose rates are known: an
#: H100's nominal dense rates (:data:`equiopt.roofline.H100`, which the roofline calibrates
#: against measured steps). ``"auto"`` keeps the Gram route on other devices (the CPU, the
#: meta device outside :func:`~equiopt.linalg.device_choices.decide_as`).
ROUTE_RATES: dict[str, dict[str, float]] = {"cuda": {"bfloat16": 700e12, "float32": 55e12}}

# Polar methods the direct route takes for each inverse-square-root method
_DIRECT_METHODS = {"polar_express": "polar_express", "newton_schulz": "newton_schulz", "exact": "exact"}


def route_flops(m: int, n: int, steps: int, route: str, precision: str, iteration: torch.dtype) -> dict[str, float]:
    """Matrix-product FLOPs by precision of one one-sided map of an ``m x n`` matrix.

    With ``k = max(m, n)``, ``r = min(m, n)``: the Gram route forms the ``r x r`` Gram
    (``2 k r^2``), runs the coupled inverse square root (``4 steps + 1`` products of
    ``2 r^3``, see :func:`~equiopt.linalg.inv_sqrt`) and the product with ``R``
    (``2 k r^2``), each at ``precision`` (:func:`gram_precision`; ``"bfloat16x6"``: six
    bfloat16 products each, four for the Gram). The direct route runs Polar Express on the
    matrix itself, ``steps`` iterations of ``x x^T``, ``h(G)`` and ``h(G) x``
    (``4 k r^2 + 2 r^3`` each) in ``iteration`` (Muon's cost).
    """
    k, r = max(m, n), min(m, n)
    side, inverse = 2.0 * k * r * r, (8.0 * steps + 2.0) * r**3
    if route == "direct":
        return {"bfloat16" if iteration == torch.bfloat16 else "float32": steps * (2 * side + 2.0 * r**3)}
    if precision == "bfloat16x6":
        return {"bfloat16": 4 * side + 6 * inverse + 6 * side}
    if precision == "bfloat16":
        return {"bfloat16": (1 if OUT_DTYPE_MM else 2) * side + 2 * side, "float32": inverse}
    return {"float32": 2 * side + inverse}


def route_costs(
    x: torch.Tensor, method: str = "polar_express", steps: int = 5, gram_dtype: str | None = None
) -> dict[str, float] | None:
    """The estimated seconds of each route (``"gram"``, ``"direct"``) of a one-sided map of
    ``x`` (``(..., m, n)``) on the device ``x`` decides as: :func:`route_flops` at the
    device's :data:`ROUTE_RATES` for each precision. None where the rates are unknown."""
    rates = ROUTE_RATES.get(decides_like(x))
    if rates is None:
        return None
    m, n = x.shape[-2:]
    batch = math.prod(x.shape[:-2])
    precision = gram_precision(x, gram_dtype)
    iteration = default_dtype(_DIRECT_METHODS.get(method, method), x.device)
    return {
        route: batch * sum(f / rates[p] for p, f in route_flops(m, n, steps, route, precision, iteration).items())
        for route in ("gram", "direct")
    }


def one_sided_route(
    x: torch.Tensor,
    route: str = "auto",
    method: str = "polar_express",
    steps: int = 5,
    gram_dtype: str | None = None,
    reducer: RowReducer | None = None,
) -> str:
    """The route a one-sided map (or a hybrid's one-sided stage) of ``x`` takes: ``"gram"``
    (Gram, coupled inverse square root, product: Algorithm 1 as written) or ``"direct"``
    (the polar factor of ``x`` itself by Polar Express in the iteration's dtype, as Muon
    computes it, with ``nu = tr(x^T P)``; see :func:`_one_sided_polar`).

    ``route="auto"`` takes the cheaper of the two by :func:`route_costs`: the products'
    FLOPs charged at the rate of their precision on ``x``'s device. It keeps the Gram route
    where the rates are unknown (CPU), for float64 inputs (the direct route would iterate
    below their precision), for methods other than Polar Express, and for a row-sharded
    ``x`` (``reducer`` set): the Gram route is the one whose only cross-shard operation is
    the all-reduce of a ``d x d`` Gram, while the direct route needs the whole matrix.

    Raises:
        ValueError: for an unknown ``route``, or ``"direct"`` with a ``reducer``.
    """
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r}; valid: {', '.join(ROUTES)}")
    if route == "direct":
        if reducer is not None:
            raise ValueError(
                "route 'direct' needs the whole work matrix; a row-sharded one takes route 'gram' "
                "(or 'auto'), or is gathered to one rank"
            )
        return "direct"
    if route == "gram" or reducer is not None or method != "polar_express" or x.dtype == torch.float64:
        return "gram"
    costs = route_costs(x, method, steps, gram_dtype)
    return "direct" if costs is not None and costs["direct"] < costs["gram"] else "gram"
