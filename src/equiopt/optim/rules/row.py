"""RowNormM: each row of the momentum scaled to unit norm (paper, Sec. 5: the row-norm
update of embeddings, equivariant under permutations and scalings of rows), optionally in
the quotient that removes softmax's shared shift (``center``, LM heads and routers)."""

from __future__ import annotations

import torch

from ... import maps
from .base import MOMENTUM_FIELDS, Rule


class RowNorm(Rule):
    name = "row"
    fields = MOMENTUM_FIELDS + ("center", "eps", "eta")
    row_wise = True
    sums = "rows"
    doc = "RowNormM"

    def reducible(self, key, rows: int, cols: int) -> bool:
        return True  # sums of squares over rows, over columns when they are split

    def factored(
        self, key, eta, D: torch.Tensor, *, reducer, col_reducer, narrow, centred_input, sums=None
    ) -> maps.Factored:
        return maps.row_norm_factored(
            D,
            eps=key.eps,
            center=bool(key.center),
            eta=eta,
            reducer=reducer,
            centered_input=centred_input,
            col_reducer=col_reducer,
            row_sq=sums,
        )
