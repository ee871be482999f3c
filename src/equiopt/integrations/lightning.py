"""Lightning integration: ``configure_optimizers`` in one line.

::

    import lightning as L
    from equiopt.integrations import lightning as eol

    class LitLM(L.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def configure_optimizers(self):
            return eol.configure_optimizers(self, recipe="equiopt:default")

The roles are those of the model the LightningModule holds; the scheduler steps every
optimizer step (``interval="step"``) over ``trainer.estimated_stepping_batches`` steps
unless ``total_steps`` is given. Lightning's checkpoints hold the optimizer and scheduler
states, so ``trainer.fit(module, ckpt_path=...)`` resumes exactly.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ..recipes import DEFAULT_RECIPE, Recipe
from ..roles import build_optimizer

__all__ = ["configure_optimizers"]


def _estimated_steps(module: nn.Module) -> int | None:
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return None
    steps = trainer.estimated_stepping_batches
    return int(steps) if isinstance(steps, (int, float)) and math.isfinite(steps) and steps > 0 else None


def configure_optimizers(
    module: nn.Module,
    recipe: str | Recipe = DEFAULT_RECIPE,
    total_steps: int | None = None,
    overrides: Any = None,
    rules: Any = None,
    **role_options: Any,
) -> dict[str, Any]:
    """``{"optimizer": ..., "lr_scheduler": {"scheduler": ..., "interval": "step"}}`` for ``module``.

    ``total_steps`` defaults to the attached trainer's ``estimated_stepping_batches``
    (``max_steps``, or epochs x batches / accumulation); without either the schedules
    hold their base rates after warm-up. ``overrides``, ``rules`` and ``role_options``
    are those of :func:`equiopt.build_optimizer`.

    Args:
        module: the LightningModule (or the model it holds).
        recipe: a recipe name, TOML path or :class:`~equiopt.recipes.Recipe`.
        total_steps: the run's length; None asks the attached trainer.
        overrides: recipe fields per role (``"*"`` for all).
        rules: role overrides by parameter name.
        **role_options: further options of :func:`equiopt.assign_roles`.

    Returns:
        What ``LightningModule.configure_optimizers`` returns: the optimizer and its
        step-interval scheduler.
    """
    if total_steps is None:
        total_steps = _estimated_steps(module)
    optimizer, scheduler = build_optimizer(
        module, recipe, total_steps=total_steps, overrides=overrides, rules=rules, **role_options
    )
    return {
        "optimizer": optimizer,
        "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1, "name": "equiopt"},
    }
