"""equiopt: symmetry-compatible optimizers for language-model pre-training.

Layers (each depends only on those above it): :mod:`equiopt.linalg` (numerical
oracles), :mod:`equiopt.maps` (pure update maps), :mod:`equiopt.layouts` (stored tensor
<-> work matrices), :mod:`equiopt.optim` (one optimizer engine and the paper's presets),
:mod:`equiopt.diagnostics`.
"""

from . import diagnostics, layouts, linalg, maps, models, optim, recipes, roles
from .optim import EquivariantOptimizer, HybridPolarGradM, LeftPolarGradM, Muon, RightPolarGradM, RowNormM
from .roles import assign_roles, build_optimizer, print_roles, verify_roles

__version__ = "0.1.0"

__all__ = [
    "linalg", "maps", "layouts", "optim", "diagnostics", "recipes", "models",
    "assign_roles", "print_roles", "build_optimizer", "verify_roles", "roles",
    "EquivariantOptimizer", "Muon", "RightPolarGradM", "LeftPolarGradM", "RowNormM", "HybridPolarGradM",
]
