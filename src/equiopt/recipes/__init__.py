"""Optimizer recipes: per-role settings as data, and their learning-rate schedules.

A :class:`Recipe` maps each parameter role (:data:`ROLES`) to a settings dict
that :class:`equiopt.EquivariantOptimizer` reads from a param group::

    >>> from equiopt.recipes import get_recipe
    >>> r = get_recipe("paper:olmoe:ii")
    >>> r.settings("router")["rule"], r.settings("router")["center"]
    ('left', True)
    >>> r2 = r.with_overrides({"router": {"lr": 1e-3}, "*": {"weight_decay": 0.0}})

Named recipes: ``equiopt:default`` (the default of :func:`equiopt.build_optimizer`,
safe at any model size), ``muon``, ``adamw`` and every configuration of the paper's
hyperparameter tables, ``paper:<model>:<config>`` (see :func:`list_recipes`
and :mod:`equiopt.recipes.paper`). User recipes can be written in TOML
(:func:`load_recipe_toml`). :func:`build_scheduler` turns the ``schedule``
entries of an optimizer's param groups into one ``LambdaLR``.
"""

from .paper import PAPER_MODELS
from .recipe import Recipe
from .registry import (
    DEFAULT_RECIPE,
    adamw_recipe,
    default_recipe,
    get_recipe,
    list_recipes,
    load_recipe_toml,
    loads_recipe_toml,
    muon_recipe,
    normuon_recipe,
    register_recipe,
)
from .schedules import Constant, StableDecay, WarmupCosine, build_scheduler, make_lr_lambda
from .schema import (
    ETAS,
    FIELDS,
    LR_SCALES,
    MATRIX_RULES,
    METHODS,
    ORDERS,
    ROLES,
    RULE_DEFAULTS,
    RULE_FIELDS,
    RULE_METHODS,
    RULES,
    SCHEDULE_KINDS,
    default_schedule,
)
from .tomlio import save_recipe_toml

__all__ = [
    "Recipe",
    "get_recipe",
    "list_recipes",
    "register_recipe",
    "default_recipe",
    "DEFAULT_RECIPE",
    "muon_recipe",
    "normuon_recipe",
    "adamw_recipe",
    "load_recipe_toml",
    "loads_recipe_toml",
    "save_recipe_toml",
    "make_lr_lambda",
    "build_scheduler",
    "WarmupCosine",
    "StableDecay",
    "Constant",
    "default_schedule",
    "PAPER_MODELS",
    "ROLES",
    "RULES",
    "MATRIX_RULES",
    "ORDERS",
    "METHODS",
    "RULE_METHODS",
    "ETAS",
    "LR_SCALES",
    "SCHEDULE_KINDS",
    "FIELDS",
    "RULE_FIELDS",
    "RULE_DEFAULTS",
]
