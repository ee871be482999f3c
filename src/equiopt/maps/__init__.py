"""Symmetry-compatible update maps on work matrices ``D`` of shape ``(..., m, n)``.

Rows are the symmetry axis (vocabulary items, intermediate neurons, experts). Every map
is a pure function; every reduction (row norms, means, Gram matrices, traces, ``nu``)
is taken per matrix, so a batch of experts or heads gives what a loop over them gives.
References are to the paper (Lau and Su, "Symmetry-Compatible Principle for Optimizer
Design"): section 3.3 for the LPRO maps, 3.5 for routers, Algorithms 1 and 2.

``center=True`` gives the horizontal (quotient) versions used for LM heads and routers:
the input is centred, ``D_c = Pi D`` with ``Pi = I - 11^T/m``, every row-wise stage is
re-projected, and the final update is projected by ``Pi`` (paper eq. for the horizontal
LM-head row-norm update and Algorithm 2).

Low-precision inputs (bfloat16, float16) are computed in float32 and returned in their
own dtype; float32 and float64 inputs are computed in their dtype (the Gram inverse
square root itself runs in float32 except for ``method="exact"``).

Every map is computed in *factored form* (:class:`Factored`): ``U = s * (L X R) - 1 c``
with at most one of the row scales ``s``, left factor ``L`` or right factor ``R``, and
an optional row-shared shift ``c``. :func:`materialize` multiplies it out; the
optimizer instead folds the learning rate into the small factor and accumulates the
product straight into the parameter (one GEMM, no full-size update tensor), and the
centring of the quotient maps costs a vector, not a pass over the matrix.

The maps are grouped by family, a module each: :mod:`~equiopt.maps.row` (row-norm maps),
:mod:`~equiopt.maps.one_sided` (right and left spectral maps) with the choice of their route
in :mod:`~equiopt.maps.routes`, :mod:`~equiopt.maps.two_sided` (the polar factor, Muon+ and
NorMuon) and :mod:`~equiopt.maps.hybrids` (Algorithm 2); :mod:`~equiopt.maps.base` holds the
factored form and the row reducer, :mod:`~equiopt.maps.precision` the precision of the
products. Every public name is imported from ``equiopt.maps`` itself.
"""

# The families in reading order (the API reference lists the maps in this order).
from .base import Factored, RowReducer, center, materialize
from .base import gemm_ as gemm_

# isort: split
from .precision import AUTO_SPLIT_MIN as AUTO_SPLIT_MIN
from .precision import GRAM_DTYPES, gram_precision, low_product, low_times

# isort: split
from .row import ETA_RULES, eta_scale, row_norm, row_norm_factored
from .row import EtaRule as EtaRule

# isort: split
from .routes import ROUTE_RATES as ROUTE_RATES
from .routes import ROUTES, one_sided_route, route_costs, route_flops

# isort: split
from .one_sided import (
    DAMPINGS,
    GRAM_SIDES,
    ONE_SIDED_METHODS,
    SCALES,
    gram_side,
    left_spectral,
    one_sided_factored,
    right_spectral,
)

# isort: split
from .two_sided import normuon_moments_, normuon_rows, spectral, spectral_row, spectral_row_factored

# isort: split
from .hybrids import HYBRID_ORDERS, hybrid, hybrid_factored, row_blocks, row_scaled_blocks
from .hybrids import STAGE_BLOCK_BYTES as STAGE_BLOCK_BYTES
from .hybrids import unformed_stage as unformed_stage

# ``__all__`` is the maps' API; the names imported "as" themselves are public too, for the
# optimizer and the tools (the blocked first stage, the route rates, the precision threshold)
__all__ = [
    "Factored",
    "RowReducer",
    "gram_side",
    "materialize",
    "row_norm_factored",
    "one_sided_factored",
    "hybrid_factored",
    "center",
    "row_norm",
    "right_spectral",
    "left_spectral",
    "spectral",
    "hybrid",
    "spectral_row",
    "spectral_row_factored",
    "normuon_rows",
    "normuon_moments_",
    "eta_scale",
    "ETA_RULES",
    "HYBRID_ORDERS",
    "GRAM_SIDES",
    "ONE_SIDED_METHODS",
    "SCALES",
    "DAMPINGS",
    "GRAM_DTYPES",
    "ROUTES",
    "ROUTE_RATES",
    "route_flops",
    "route_costs",
    "one_sided_route",
    "low_product",
    "gram_precision",
    "row_blocks",
    "row_scaled_blocks",
    "low_times",
]
