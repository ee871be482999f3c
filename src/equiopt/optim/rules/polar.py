"""Rules built on the polar factor ``U V^T`` of the momentum (paper, Sec. 4: the spectral
update of hidden matrices, equivariant under ``O(m) x O(n)``): Muon (``spectral``) and its
row-normalised form (``spectral_row``). NorMuon has its own module."""

from __future__ import annotations

from typing import Any

import torch

from ... import maps
from ...linalg import POLAR_METHODS
from .base import MOMENTUM_FIELDS, Rule, polar_flops

POLAR_FIELDS: tuple[str, ...] = MOMENTUM_FIELDS + ("method", "steps", "lr_scale", "polar_dtype")


def whole_or_gram_rows(rule: Rule, key: Any, reducer, col_reducer) -> None:
    """The polar rules run on a row split only by Gram Newton-Schulz (on the summed Gram)."""
    if col_reducer is not None or (reducer is not None and not rule.reducible(key, 1, 0)):
        how = ", or its rows split with method 'gram_newton_schulz'" if not rule.row_moments else ""
        raise ValueError(f"the {rule.name} map needs the whole matrix{how}")


class PolarRule(Rule):
    """The shared parts of the polar-factor rules: settings, solvers, FLOPs, reducibility
    (a tall matrix's Gram Newton-Schulz iteration runs on the summed ``n x n`` Gram)."""

    fields = POLAR_FIELDS
    defaults = {"nesterov": True}
    methods = tuple(POLAR_METHODS)
    polar = True
    divisible = True

    def reducible(self, key: Any, rows: int, cols: int) -> bool:
        return key.method == "gram_newton_schulz" and rows >= cols

    def flops(self, key: Any, batch: int, m: int, n: int, gram_rows: int | None) -> int:
        return polar_flops(key, batch, m, n)


class Spectral(PolarRule):
    """Muon: the polar factor of the momentum's work matrices."""

    name = "spectral"
    narrow = True
    sums = "matrices"
    checks = True
    doc = "Muon: polar factor"

    def factored(
        self, key, eta, D: torch.Tensor, *, reducer, col_reducer, narrow, centred_input, sums=None, finite=None
    ) -> maps.Factored:
        whole_or_gram_rows(self, key, reducer, col_reducer)
        return maps.Factored(
            maps.spectral(
                D,
                method=key.method,
                steps=key.steps,
                dtype=key.polar_dtype,
                reducer=reducer,
                narrow=narrow,
                sq_norm=sums,
                finite=finite,
            )
        )


class SpectralRow(PolarRule):
    """The polar factor, then its rows normalised to unit norm (``eps`` smoothing)."""

    name = "spectral_row"
    fields = POLAR_FIELDS + ("eps",)
    doc = "polar factor, then rows normalised"

    def factored(self, key, eta, D: torch.Tensor, *, reducer, col_reducer, narrow, centred_input) -> maps.Factored:
        whole_or_gram_rows(self, key, reducer, col_reducer)
        return maps.spectral_row_factored(
            D, method=key.method, steps=key.steps, dtype=key.polar_dtype, eps=key.eps, reducer=reducer
        )
