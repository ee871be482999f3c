"""Rules built on a one-sided Gram ``(M^T M + eps I)^(-1/2)`` (paper, Sec. 5): the
one-sided maps RightPolarGradM and LeftPolarGradM, and HybridPolarGradM, their composition
with a row normalisation (embeddings, LM heads, SwiGLU's matrices)."""

from __future__ import annotations

from typing import Any

import torch

from ... import maps
from .base import MOMENTUM_FIELDS, Rule, polar_flops

GRAM_FIELDS: tuple[str, ...] = MOMENTUM_FIELDS + (
    "center",
    "alpha",
    "eps",
    "method",
    "steps",
    "scale",
    "damping",
    "gram_dtype",
    "route",
)


def common(key: Any, reducer, centred_input: bool) -> dict[str, Any]:
    """The settings the one-sided maps and the hybrids share."""
    return dict(
        eps=key.eps,
        alpha=key.alpha,
        center=bool(key.center),
        method=key.method,
        steps=key.steps,
        scale=key.scale,
        reducer=reducer,
        centered_input=centred_input,
        damping=key.damping,
        gram_dtype=key.gram_dtype,
        route=key.route,
    )


class GramRule(Rule):
    """The shared parts: settings, solvers, FLOPs (the Gram route, or Polar Express on the
    matrix itself), reducibility (the right ``n x n`` Gram sums over rows)."""

    fields = GRAM_FIELDS
    methods = tuple(maps.ONE_SIDED_METHODS)
    narrow = True
    divisible = True
    extra_passes = 0  # matrix-sized products beyond the one-sided stage (the hybrid's row stage)

    def reducible(self, key: Any, rows: int, cols: int) -> bool:
        return key.method != "gram_newton_schulz" and key.route != "direct" and maps.gram_side(rows, cols) == "right"

    def flops(self, key: Any, batch: int, m: int, n: int, gram_rows: int | None) -> int:
        extra = self.extra_passes * 4 * batch * m * n
        if key.route == "direct":  # Polar Express on the matrix itself (a whole one: never sharded)
            return polar_flops(key, batch, m, n) + extra
        rows = m if gram_rows is None else gram_rows
        side = n if rows >= n else rows  # the smaller Gram, see maps.gram_side
        return batch * (4 * m * n * side + key.steps * 6 * side**3) + extra


class Right(GramRule):
    name = "right"
    doc = "RightPolarGradM"

    def factored(self, key, eta, D: torch.Tensor, *, reducer, col_reducer, narrow, centred_input) -> maps.Factored:
        return maps.one_sided_factored(D, narrow=narrow, **common(key, reducer, centred_input))


class Left(Right):
    name = "left"
    doc = "LeftPolarGradM"


class Hybrid(GramRule):
    name = "hybrid"
    fields = GRAM_FIELDS + ("order", "eta")
    defaults = {"alpha": 1.0}
    extra_passes = 1
    doc = "HybridPolarGradM, with order"

    def sums_for(self, key: Any) -> str | None:
        """Its row stage first (``row_then_right``, uncentred): the rows' sums of squares."""
        return "rows" if key.order == "row_then_right" and not key.center else None

    def factored(
        self, key, eta, D: torch.Tensor, *, reducer, col_reducer, narrow, centred_input, sums=None
    ) -> maps.Factored:
        if col_reducer is not None:
            raise ValueError("the 'hybrid' map needs whole rows; gather a column-split work matrix first")
        return maps.hybrid_factored(
            D, order=key.order, eta=eta, narrow=narrow, row_sq=sums, **common(key, reducer, centred_input)
        )
