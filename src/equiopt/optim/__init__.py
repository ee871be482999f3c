"""The optimizer engine and the paper's presets."""

from .engine import EquivariantOptimizer, NonFiniteGradientError
from .presets import HybridPolarGradM, LeftPolarGradM, Muon, RightPolarGradM, RowNormM
from .rules import LR_SCALES, MATRIX_RULES, RULES

__all__ = [
    "EquivariantOptimizer", "NonFiniteGradientError", "Muon", "RightPolarGradM", "LeftPolarGradM", "RowNormM",
    "HybridPolarGradM", "RULES", "MATRIX_RULES", "LR_SCALES",
]
