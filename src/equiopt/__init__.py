"""equiopt: symmetry-compatible optimizers for language-model pre-training.

Layers (each depends only on those above it): :mod:`equiopt.linalg` (numerical
oracles), :mod:`equiopt.maps` (pure update maps), :mod:`equiopt.layouts` (stored tensor
<-> work matrices), :mod:`equiopt.optim` (one optimizer engine and the paper's presets),
:mod:`equiopt.diagnostics`.
"""

from . import diagnostics, layouts, linalg, maps, models, optim, recipes, roles
from .optim import (
    EquivariantOptimizer,
    HybridPolarGradM,
    LeftPolarGradM,
    Muon,
    NorMuon,
    RightPolarGradM,
    RowNormM,
)
from .roles import assign_roles, build_optimizer, print_roles, verify_roles


def _version() -> str:
    """The installed distribution's version; for a checkout on ``sys.path`` that is not
    installed, the version in its ``pyproject.toml`` (``"0+unknown"`` without one)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("equiopt")
    except PackageNotFoundError:
        import re
        from pathlib import Path

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        text = pyproject.read_text() if pyproject.is_file() else ""
        found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M) if 'name = "equiopt"' in text else None
        return found.group(1) if found else "0+unknown"


__version__ = _version()

__all__ = [
    "linalg",
    "maps",
    "layouts",
    "optim",
    "diagnostics",
    "recipes",
    "models",
    "assign_roles",
    "print_roles",
    "build_optimizer",
    "verify_roles",
    "roles",
    "EquivariantOptimizer",
    "Muon",
    "NorMuon",
    "RightPolarGradM",
    "LeftPolarGradM",
    "RowNormM",
    "HybridPolarGradM",
]
