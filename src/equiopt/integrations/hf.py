"""Hugging Face ``Trainer`` integration.

Two ways, both keep the recipe's per-role learning rates and schedules:

``optimizers=``, when you know the number of steps::

    trainer = Trainer(model, args, train_dataset=ds,
                      optimizers=equiopt.build_optimizer(model, "equiopt:default", total_steps=args.max_steps))

``optimizer_cls_and_kwargs=`` (the Trainer builds the optimizer from the model it
trains, e.g. after ``model_init`` or wrapping, and the schedule for the steps it
computes)::

    from equiopt.integrations import hf
    trainer = Trainer(model, args, train_dataset=ds, **hf.trainer_kwargs(recipe="equiopt:default"))

which is ``optimizer_cls_and_kwargs=hf.optimizer_cls_and_kwargs(recipe=...)`` plus the
:class:`RecipeSchedule` callback. Without the callback the Trainer's own schedule
(``args.lr_scheduler_type``) would replace the recipe's, and the optimizer warns once.
Checkpoints and ``resume_from_checkpoint`` are the Trainer's own: the optimizer state,
the schedule position and the per-group schedules are restored exactly.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from ..optim import EquivariantOptimizer
from ..recipes import DEFAULT_RECIPE, Recipe, get_recipe, make_lr_lambda
from ..recipes.schedules import Multiplier
from ..roles import assign_roles
from ..roles.build import param_groups

__all__ = ["optimizer_cls_and_kwargs", "trainer_kwargs", "RecipeSchedule", "RecipeOptimizerFactory", "TrainerOptimizer"]


class TrainerOptimizer(EquivariantOptimizer):
    """:class:`EquivariantOptimizer` with a recipe's param groups for ``model``
    (:func:`equiopt.build_optimizer` without the scheduler, which the Trainer owns).

    Args:
        model: the model the Trainer trains.
        recipe: a recipe name, TOML path or :class:`~equiopt.recipes.Recipe`.
        overrides: recipe fields per role (``"*"`` for all).
        rules: role overrides by parameter name (see :func:`equiopt.assign_roles`).
        eager_state: create the optimizer state at construction.
        **role_options: further options of :func:`equiopt.assign_roles`.

    Raises:
        TypeError: when handed param groups instead of the model (a Trainer older than
            transformers 5).
    """

    def __init__(
        self,
        model: nn.Module,
        recipe: str | Recipe = DEFAULT_RECIPE,
        overrides: Any = None,
        rules: Any = None,
        eager_state: bool = False,
        **role_options: Any,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"expected the model, got {type(model).__name__}: this transformers hands the optimizer its own "
                "param groups; use a transformers version whose Trainer accepts optimizer factories (>= 5), or "
                "Trainer(optimizers=equiopt.build_optimizer(model, recipe, total_steps))"
            )
        rec = get_recipe(recipe)
        if overrides:
            rec = rec.with_overrides(overrides)
        table = assign_roles(model, rules=rules, **role_options)
        super().__init__(param_groups(table, rec), eager_state=eager_state)
        self.role_table = table
        self.recipe = rec
        self.recipe_schedule_installed = False
        self._warned = False

    def step(self, closure=None):
        """One optimizer step; warns once when :class:`RecipeSchedule` is not installed.

        Args:
            closure (Callable | None): re-evaluates the model and returns the loss.

        Returns:
            loss (Any): what the closure returned, or None.
        """
        if not self.recipe_schedule_installed and not self._warned:
            self._warned = True
            warnings.warn(
                "the Trainer's own learning-rate schedule drives this optimizer, not the recipe's per-role "
                "schedules: add equiopt.integrations.hf.RecipeSchedule() to the Trainer's callbacks "
                "(hf.trainer_kwargs(...) does both)",
                stacklevel=2,
            )
        return super().step(closure)


class RecipeOptimizerFactory:
    """What ``optimizer_cls_and_kwargs`` names: the Trainer calls ``RecipeOptimizerFactory()(model, **kwargs)``
    with the model it trains (transformers >= 5 calls any non-Optimizer class this way).

    Args:
        *args (Any): none; an older Trainer passing param groups gets a TypeError.
        **kwargs (Any): none, as for ``args``.

    Raises:
        TypeError: when called with arguments (a Trainer older than transformers 5).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        if args or kwargs:  # an older Trainer calling it as an optimizer class with its own param groups
            raise TypeError(
                "this transformers' Trainer hands optimizer_cls its own param groups instead of the model; use "
                "transformers >= 5, or Trainer(optimizers=equiopt.build_optimizer(model, recipe, total_steps))"
            )

    def __call__(self, model: nn.Module, **kwargs: Any) -> TrainerOptimizer:
        return TrainerOptimizer(model, **kwargs)


def optimizer_cls_and_kwargs(
    recipe: str | Recipe = DEFAULT_RECIPE, overrides: Any = None, rules: Any = None, **role_options: Any
) -> tuple[type, dict[str, Any]]:
    """``(factory, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)``: the optimizer gets the
    recipe's groups for the Trainer's model. Pair it with :class:`RecipeSchedule` (or use
    :func:`trainer_kwargs`) to keep the recipe's schedules.

    Args:
        recipe: a recipe name, TOML path or :class:`~equiopt.recipes.Recipe`.
        overrides: recipe fields per role (``"*"`` for all).
        rules: role overrides by parameter name (see :func:`equiopt.assign_roles`).
        **role_options: further options of :func:`equiopt.assign_roles`.

    Returns:
        ``(RecipeOptimizerFactory, kwargs)``; the recipe is checked here.
    """
    rec = get_recipe(recipe)  # a bad name or override fails here, not inside trainer.train()
    if overrides:
        rec.with_overrides(overrides)
    return RecipeOptimizerFactory, {"recipe": recipe, "overrides": overrides, "rules": rules, **role_options}


def trainer_kwargs(
    recipe: str | Recipe = DEFAULT_RECIPE, overrides: Any = None, rules: Any = None, **role_options: Any
) -> dict[str, Any]:
    """``Trainer(..., **trainer_kwargs(...))``: ``optimizer_cls_and_kwargs`` and the ``callbacks``
    that keep the recipe's schedules. (With callbacks of your own, pass
    ``callbacks=[*yours, RecipeSchedule()]`` and ``optimizer_cls_and_kwargs`` yourself.)

    Args:
        recipe: a recipe name, TOML path or :class:`~equiopt.recipes.Recipe`.
        overrides: recipe fields per role (``"*"`` for all).
        rules: role overrides by parameter name (see :func:`equiopt.assign_roles`).
        **role_options: further options of :func:`equiopt.assign_roles`.

    Returns:
        ``{"optimizer_cls_and_kwargs": ..., "callbacks": [RecipeSchedule()]}``.
    """
    return {
        "optimizer_cls_and_kwargs": optimizer_cls_and_kwargs(recipe, overrides, rules, **role_options),
        "callbacks": [RecipeSchedule()],
    }


def _inner(optimizer: Any) -> Any:
    """The optimizer under accelerate's ``AcceleratedOptimizer`` (and similar wrappers)."""
    seen = 0
    while optimizer is not None and not isinstance(optimizer, EquivariantOptimizer) and seen < 8:
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return optimizer


class RecipeSchedule(TrainerCallback):
    """Drive the Trainer's scheduler with the recipe's per-role schedules over ``max_steps``.

    At the start of training (after a resume has restored the scheduler's position) the
    Trainer's ``LambdaLR`` gets one multiplier per param group, from each group's
    ``schedule``, for the Trainer's number of steps; its base rates are already the
    recipe's. The multipliers are small objects, so the Trainer's scheduler checkpoint
    saves and restores them. A scheduler that already runs a recipe's multipliers (from
    ``optimizers=(opt, equiopt scheduler)``) is left as is.
    """

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        """Give the Trainer's ``LambdaLR`` the recipe's multipliers, one per param group.

        Args:
            args (TrainingArguments): the Trainer's arguments.
            state (TrainerState): the Trainer's state (``max_steps``).
            control (TrainerControl): the Trainer's control flags.
            optimizer (torch.optim.Optimizer | None): the Trainer's optimizer (possibly wrapped).
            lr_scheduler (torch.optim.lr_scheduler.LRScheduler | None): the Trainer's scheduler.
            **kwargs (Any): the callback's other arguments.
        """
        opt = _inner(optimizer)
        if opt is None:
            return
        if not isinstance(lr_scheduler, torch.optim.lr_scheduler.LambdaLR):
            warnings.warn(
                f"RecipeSchedule: the Trainer's scheduler is a {type(lr_scheduler).__name__}, not a "
                "LambdaLR; the recipe's schedules are not applied",
                stacklevel=2,
            )
            return
        if not all(isinstance(f, Multiplier) for f in lr_scheduler.lr_lambdas):
            total = state.max_steps if state.max_steps and state.max_steps > 0 else None
            lr_scheduler.lr_lambdas = [
                make_lr_lambda(g.get("schedule"), total, f"param group {i} (role {g.get('role')!r})")
                for i, g in enumerate(opt.param_groups)
            ]
            step = lr_scheduler.last_epoch
            lrs = [base * f(step) for base, f in zip(lr_scheduler.base_lrs, lr_scheduler.lr_lambdas)]
            for group, lr in zip(opt.param_groups, lrs):
                group["lr"] = lr
            lr_scheduler._last_lr = lrs
        if hasattr(opt, "recipe_schedule_installed"):
            opt.recipe_schedule_installed = True
