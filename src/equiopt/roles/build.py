"""The paper's layerwise optimizer stack on any model, in two lines."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..optim import EquivariantOptimizer
from .infer import assign_roles
from .table import ROLES, RoleTable

if TYPE_CHECKING:  # recipes read ROLES from this package, so they are imported when used
    from ..recipes import Recipe


def param_groups(table: RoleTable, recipe: Recipe) -> list[dict[str, Any]]:
    """One optimizer param group per role present in ``table``, with the recipe's settings,
    the per-parameter layouts and names, the role and its schedule."""
    groups = []
    for role, rows in table.by_role().items():
        if not rows:
            continue
        settings = recipe.settings(role)
        groups.append(
            {
                **settings,
                "params": [r.param for r in rows],
                "layouts": [r.layout if r.layout is not None else "row" for r in rows],
                "names": [r.name for r in rows],
                "role": role,
            }
        )
    return groups


def build_optimizer(
    model: nn.Module,
    recipe: str | Recipe = "equiopt:default",
    total_steps: int | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    rules: Any = None,
    eager_state: bool = False,
    compile: bool | str | None = None,
    state_dtype: torch.dtype | None = None,
    divide_work: Any = None,
    cost_model: Any = None,
    **role_options: Any,
) -> tuple[EquivariantOptimizer, torch.optim.lr_scheduler.LambdaLR]:
    """``(optimizer, scheduler)`` for ``model`` from a recipe (name, TOML path or Recipe).

    The default recipe, ``equiopt:default``, is safe at any model size (see
    :func:`equiopt.recipes.default_recipe`); the paper's configurations are available by
    name, e.g. ``"paper:qwen3:b-ii"``. ``model`` may be wrapped (DDP, FSDP2,
    ``torch.compile``, a LightningModule or any module holding it).

    Roles and layouts come from :func:`assign_roles` (``rules`` and ``role_options``
    are passed to it); ``overrides`` replace recipe fields per role (``"*"`` for all).
    Without ``total_steps`` the scheduler holds every group's base lr (after AdamW
    warm-up); with it, the recipe's schedules run to 0 at ``total_steps``.
    ``eager_state``, ``compile``, ``state_dtype``, ``divide_work`` and ``cost_model`` are the optimizer's
    own options (see :class:`~equiopt.optim.EquivariantOptimizer`); ``divide_work=None``
    divides the matrix maps among the replicas when ``model`` is wrapped in DDP (its
    process group), and not otherwise.

    Args:
        model: the model, bare or wrapped.
        recipe: a registered recipe name, a path to a TOML recipe, or a :class:`~equiopt.recipes.Recipe`.
        total_steps: the length of the run, which the recipe's schedules decay over; None
            holds the base rates.
        overrides: recipe fields per role, e.g. ``{"router": {"lr": 1e-3}}`` (``"*"``: every role).
        rules: role overrides by parameter name, see :func:`assign_roles`.
        eager_state: create the optimizer state at construction instead of the first step.
        compile: compile the step (True, or a ``torch.compile`` backend name); None
            compiles when every parameter is on a CUDA device.
        state_dtype: the dtype of momentum and Adam moments; None: float32 (float64 for
            float64 parameters).
        divide_work: divide the matrix maps among replicas: True, a process group, or
            False; None decides from a DDP wrapper.
        cost_model: how a sharded parameter's plan is chosen: None/``"auto"``,
            ``"nccl-h100"``, ``"gloo-cpu"``, ``"reduce"``, ``"owner"`` or a
            :class:`~equiopt.optim.costs.CostModel`.
        **role_options: further options of :func:`assign_roles` (``dims``, ``gate_up``,
            ``per_head``).

    Returns:
        ``(optimizer, scheduler)``: an :class:`~equiopt.optim.EquivariantOptimizer` with one
        param group per role present, and a ``LambdaLR`` with each group's schedule; step
        the scheduler once per optimizer step.

    Raises:
        ValueError: for an unknown recipe, role or field, or a parameter whose role
            cannot be inferred (the message proposes the ``rules=`` entry).
    """
    from ..recipes import build_scheduler, get_recipe

    rec = get_recipe(recipe)
    if overrides:
        rec = rec.with_overrides(overrides)
    table = assign_roles(model, rules=rules, **role_options)
    if divide_work is None:
        divide_work = _ddp_group(model)
    optimizer = EquivariantOptimizer(
        param_groups(table, rec),
        eager_state=eager_state,
        compile=compile,
        state_dtype=state_dtype,
        divide_work=divide_work,
        cost_model=cost_model,
    )
    optimizer.role_table = table
    optimizer.recipe = rec
    return optimizer, build_scheduler(optimizer, total_steps)


def _ddp_group(model: nn.Module):
    """The process group of a DDP-wrapped ``model`` (replicated parameters), else None."""
    from torch.nn.parallel import DistributedDataParallel

    return model.process_group if isinstance(model, DistributedDataParallel) else None


def print_roles(model: nn.Module, recipe: str | Recipe | None = None, file=None, **role_options: Any) -> RoleTable:
    """Print the role table of ``model`` (with each role's rule and lr when ``recipe`` is given).

    Args:
        model: the model, bare or wrapped.
        recipe: a recipe name, TOML path or :class:`~equiopt.recipes.Recipe` whose rule and
            lr are printed per parameter; None prints roles only.
        file (TextIO | None): where to print (default ``sys.stdout``).
        **role_options: options of :func:`assign_roles` (``rules``, ``dims``, ...).

    Returns:
        The :class:`RoleTable` printed.
    """
    table = assign_roles(model, **role_options)
    from ..recipes import get_recipe

    rec = get_recipe(recipe) if recipe is not None else None
    print(table.format(rec), file=file)
    return table


__all__ = ["build_optimizer", "print_roles", "param_groups", "ROLES"]
