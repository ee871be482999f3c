"""NorMuon: the polar factor, then each row scaled by the inverse square root of an EMA of
its mean square (Li et al., 2025), a row stage on the optimizer's state after Muon's map.

Everything NorMuon adds to Muon is here: its settings (``beta2``, ``eps``), its state (one
second moment per work-matrix row, laid out by :mod:`equiopt.optim.row_moments`) and its
row stage; the step calls :meth:`NorMuon.row_stage` wherever a rule has ``row_moments``.
"""

from __future__ import annotations

import torch

from ... import maps
from .polar import POLAR_FIELDS, PolarRule, whole_or_gram_rows


class NorMuon(PolarRule):
    name = "normuon"
    fields = POLAR_FIELDS + ("eps", "beta2")
    row_moments = True
    doc = "NorMuon: polar factor, then rows normalised by their second-moment EMA"

    def reducible(self, key, rows: int, cols: int) -> bool:
        return False  # its row stage reads whole rows of the polar factor

    def factored(self, key, eta, D: torch.Tensor, *, reducer, col_reducer, narrow, centred_input) -> maps.Factored:
        whole_or_gram_rows(self, key, reducer, col_reducer)
        return maps.Factored(maps.spectral(D, method=key.method, steps=key.steps, dtype=key.polar_dtype))

    def row_stage(self, x: torch.Tensor, second: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``v <- v + weight (mean_j x_ij^2 - v)`` in place, and the rows' scales ``1 / (sqrt(v) + eps)``
        (:func:`equiopt.maps.normuon_rows`)."""
        scales = maps.normuon_rows(x, second, weight, eps).row
        assert scales is not None
        return scales

    def row_moments_(self, mean_sq, second, weight, eps: float, dtype: torch.dtype) -> torch.Tensor:
        """``v <- v + weight (mean_sq - v)`` in place and ``1 / (sqrt(v) + eps)`` (:func:`equiopt.maps.normuon_moments_`)."""
        return maps.normuon_moments_(mean_sq, second, weight, eps, dtype)
