"""Reading and writing recipes as TOML (parsing only: ``base`` is resolved by the registry).

A recipe file::

    name = "my-recipe"
    description = "qwen3 b-ii with a centred row-norm router"   # optional
    base = "paper:qwen3:b-ii"     # optional: start from this recipe
    [roles."*"]                   # optional: applied to every role first
    weight_decay = 0.0
    [roles.router]
    rule = "row"
    center = true
    lr = 0.001

With ``base``, the ``roles`` tables are overrides (see
:meth:`Recipe.with_overrides`). Without it, the file must give every role, each
with at least ``rule`` and ``lr``; a ``roles."*"`` table then supplies fields
shared by all roles (fields a role's rule does not accept are skipped for it).
Schedules are inline tables, e.g.
``schedule = { kind = "stable_decay", stable_fraction = 0.8 }``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

from .recipe import Recipe
from .schema import FIELDS, ROLES, RULE_FIELDS

__all__ = ["RecipeFile", "parse_recipe_toml", "read_recipe_text", "save_recipe_toml"]

_TOP_LEVEL = ("name", "description", "base", "roles")


def _tomllib():
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:
        import tomli
    except ModuleNotFoundError as err:  # pragma: no cover - Python 3.10 only
        raise ModuleNotFoundError(
            "reading TOML recipes on Python 3.10 needs the 'tomli' package: pip install tomli"
        ) from err
    return tomli


class RecipeFile(NamedTuple):
    """A parsed recipe file. With ``base``, ``roles`` are overrides of that recipe
    (resolved by :func:`equiopt.recipes.registry.loads_recipe_toml`); without it,
    ``recipe`` is the complete recipe the file defines."""

    name: str
    description: str | None
    base: str | None
    roles: Mapping[str, Any]
    recipe: Recipe | None


def parse_recipe_toml(text: str, *, source: str = "<string>", default_name: str | None = None) -> RecipeFile:
    """Parse recipe TOML without resolving ``base``; errors name ``source``.

    Args:
        text: the TOML text of a recipe file (format in the module docstring).
        source: where ``text`` came from (a path), put before every error message.
        default_name: the recipe's name when the file has no ``name`` (the file's stem,
            see :func:`read_recipe_text`); None: ``name`` is required.

    Returns:
        A :class:`RecipeFile`: with ``base``, its ``roles`` are overrides for the
        registry to apply (``recipe`` is None); without it, ``recipe`` is the complete,
        validated :class:`~equiopt.recipes.Recipe` the file defines.

    Raises:
        ValueError: on invalid TOML, an unknown top-level key, a missing name or
            (without ``base``) an unknown role, a missing role or settings the recipe
            rejects; the message starts with ``source``.
    """
    toml = _tomllib()
    try:
        data = toml.loads(text)
    except toml.TOMLDecodeError as err:
        raise ValueError(f"{source}: invalid TOML: {err}") from None
    try:
        return _from_data(data, default_name)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


def read_recipe_text(path: str | os.PathLike[str]) -> tuple[str, str, str]:
    """``(text, source, default name)`` of a recipe file; unreadable files name the path."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as err:
        raise ValueError(f"{path}: cannot read recipe file: {err.strerror or err}") from None
    return text, path, os.path.splitext(os.path.basename(path))[0]


def save_recipe_toml(recipe: Recipe, path: str | os.PathLike[str]) -> None:
    """Write ``recipe`` to ``path`` in the format :func:`equiopt.recipes.load_recipe_toml` reads.

    Every role is written in full (no ``base``, no ``roles."*"``), so loading the file
    gives back an equal recipe.

    Args:
        recipe: the recipe to save.
        path: the file to write (UTF-8; replaced if it exists).

    Raises:
        OSError: when ``path`` cannot be written.
    """
    with open(os.fspath(path), "w", encoding="utf-8") as fh:
        fh.write(recipe.to_toml())


def _from_data(data: Mapping[str, Any], default_name: str | None) -> RecipeFile:
    unknown = [k for k in data if k not in _TOP_LEVEL]
    if unknown:
        raise ValueError(f"unknown top-level key(s) {', '.join(map(repr, unknown))}; valid: {', '.join(_TOP_LEVEL)}")
    for key in ("name", "description", "base"):
        if key in data and not isinstance(data[key], str):
            raise ValueError(f"{key!r} must be a string, got {data[key]!r}")
    roles = data.get("roles", {})
    if not isinstance(roles, Mapping):
        raise ValueError(f"'roles' must be a table of role tables, got {roles!r}")
    name = data.get("name", default_name)
    if not name:
        raise ValueError("missing 'name'")
    description = data.get("description")

    if "base" in data:
        return RecipeFile(name, description, data["base"], roles, None)

    # No base: a complete recipe; "*" supplies shared fields.
    for role in roles:
        if role not in ROLES and role != "*":
            raise ValueError(f"unknown role {role!r}; valid roles: {', '.join(ROLES + ('*',))}")
    star = roles.get("*", {})
    if not isinstance(star, Mapping):
        raise ValueError(f"role '*': expected a table of settings, got {star!r}")
    for key in star:
        if key not in FIELDS:
            raise ValueError(f"role '*': unknown field {key!r}; valid fields: {', '.join(FIELDS)}")
    full: dict[str, Any] = {}
    for role in ROLES:
        if role not in roles:
            continue
        own = roles[role]
        if not isinstance(own, Mapping):
            raise ValueError(f"role {role!r}: expected a table of settings, got {own!r}")
        rule = own.get("rule", star.get("rule"))
        accepted = RULE_FIELDS.get(rule, FIELDS)
        full[role] = {**{k: v for k, v in star.items() if k in accepted}, **own}
    return RecipeFile(name, description, None, roles, Recipe(name=name, description=description or "", roles=full))
