"""The paper's optimizers as thin presets of :class:`EquivariantOptimizer`.

Each sets a group default ``rule`` (and the rule's usual settings); any group key can
still be overridden per param group, e.g. ``RowNormM([{"params": head, "center": True}])``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .engine import EquivariantOptimizer


def _preset(rule: str, doc: str, **fixed: Any):
    class Preset(EquivariantOptimizer):
        def __init__(self, params: Iterable[Any], lr: float = 0.02, **kwargs: Any):
            if "rule" in kwargs:
                raise TypeError(f"{type(self).__name__} fixes rule={rule!r}; use EquivariantOptimizer for other rules")
            super().__init__(params, lr=lr, rule=rule, **{**fixed, **kwargs})

    Preset.__doc__ = doc
    return Preset


Muon = _preset(
    "spectral",
    """Muon: Nesterov EMA momentum (beta 0.95) and the orthogonal polar factor of each work
    matrix (Polar Express, in bfloat16 where the device multiplies it natively), scaled by ``sqrt(max(1, rows/cols))``.
    ``method="newton_schulz_torch"`` gives the steps of ``torch.optim.Muon``.""",
)
NorMuon = _preset(
    "normuon",
    """NorMuon: Muon's polar factor ``O`` of the Nesterov EMA momentum, then each row divided
    by ``sqrt(v_i) + eps``, where ``v_i = beta2 v_i + (1 - beta2) mean_j O_ij^2`` is an EMA
    of the row's mean square (state ``row_second_moment``, beta2 0.95), rescaled to the
    Frobenius norm of ``O`` and by Muon's ``sqrt(max(1, rows/cols))``. Symmetry group
    ``Perm(rows) x O(cols)``. Needs every work matrix whole on its rank (no sharded rows).""",
)
RightPolarGradM = _preset(
    "right",
    """RightPolarGradM (Algorithm 1): ``nu^alpha M (M^T M + eps I)^(-1/2)``.""",
)
LeftPolarGradM = _preset(
    "left",
    """LeftPolarGradM (Algorithm 1): ``nu^alpha (M M^T + eps I)^(-1/2) M``; ``center=True`` for routers.""",
)
RowNormM = _preset(
    "row",
    """RowNormM (Algorithm 2): ``Pi Diag(eta(||M_i:||)) M``; ``center=True`` for LM heads and routers.""",
)
HybridPolarGradM = _preset(
    "hybrid",
    """HybridPolarGradM (Algorithm 2), ``order`` one of ``row_then_right`` (default),
    ``right_then_row``, ``left_then_row`` (routers); ``alpha`` defaults to 1.""",
)
for _cls, _name in (
    (Muon, "Muon"),
    (NorMuon, "NorMuon"),
    (RightPolarGradM, "RightPolarGradM"),
    (LeftPolarGradM, "LeftPolarGradM"),
    (RowNormM, "RowNormM"),
    (HybridPolarGradM, "HybridPolarGradM"),
):
    _cls.__name__ = _cls.__qualname__ = _name

__all__ = ["Muon", "NorMuon", "RightPolarGradM", "LeftPolarGradM", "RowNormM", "HybridPolarGradM"]
