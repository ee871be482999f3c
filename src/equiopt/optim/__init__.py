"""The optimizer engine and the paper's presets."""

from .engine import EquivariantOptimizer, NonFiniteGradientError, UnsupportedTensorError
from .fields import FIELDS, LR_SCALES, MATRIX_RULES, RULE_DEFAULTS, RULE_FIELDS, RULES
from .graphed import GraphedStep
from .presets import HybridPolarGradM, LeftPolarGradM, Muon, NorMuon, RightPolarGradM, RowNormM

__all__ = [
    "EquivariantOptimizer",
    "NonFiniteGradientError",
    "UnsupportedTensorError",
    "GraphedStep",
    "Muon",
    "NorMuon",
    "RightPolarGradM",
    "LeftPolarGradM",
    "RowNormM",
    "HybridPolarGradM",
    "RULES",
    "MATRIX_RULES",
    "LR_SCALES",
    "FIELDS",
    "RULE_FIELDS",
    "RULE_DEFAULTS",
]
