"""The :class:`Recipe` type: one validated settings dict per parameter role."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .._tomlw import toml_value
from .schema import FIELDS, ROLES, RULE_FIELDS, merge_settings, normalize_settings

__all__ = ["Recipe"]


def _freeze(settings: Mapping[str, Any]) -> Mapping[str, Any]:
    out = {}
    for key, value in settings.items():
        out[key] = MappingProxyType(dict(value)) if isinstance(value, Mapping) else value
    return MappingProxyType(out)


def _thaw(settings: Mapping[str, Any]) -> dict[str, Any]:
    return {key: dict(value) if isinstance(value, Mapping) else value for key, value in settings.items()}


def _check_roles(keys: Iterable[Any], context: str, allow_star: bool) -> None:
    valid = ROLES + (("*",) if allow_star else ())
    for key in keys:
        if key not in valid:
            raise ValueError(f"{context}: unknown role {key!r}; valid roles: {', '.join(valid)}")


@dataclass(frozen=True, eq=True)
class Recipe:
    """Per-role optimizer settings, validated.

    ``roles`` maps every role of :data:`equiopt.recipes.ROLES` to a settings
    dict (see :mod:`equiopt.recipes.schema`). Construction validates every
    value and fills in each rule's defaults, so ``recipe.settings(role)``
    spells out every hyperparameter. A Recipe is immutable: use
    :meth:`with_overrides` to derive a new one.

    ``meta`` holds free-form provenance (for the paper's recipes: the table
    label, the number of training steps and the reported final validation
    loss); it takes no part in equality.

    Args:
        name: the recipe's name (how :func:`~equiopt.recipes.get_recipe` finds it once registered).
        description: one line saying what the recipe is.
        roles: settings per role, for every role of :data:`~equiopt.recipes.ROLES`; each a
            dict with ``rule`` and that rule's fields (defaults filled in).
        meta: free-form provenance.

    Raises:
        ValueError: for a missing role, an unknown role, rule or field, or a value out
            of range; the message names the recipe, the role and the field.
    """

    name: str
    description: str
    roles: Mapping[str, Mapping[str, Any]]
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"recipe name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.description, str):
            raise ValueError(f"recipe {self.name!r}: description must be a string, got {self.description!r}")
        context = f"recipe {self.name!r}"
        if not isinstance(self.roles, Mapping):
            raise ValueError(f"{context}: roles must be a mapping role -> settings")
        _check_roles(self.roles, context, allow_star=False)
        missing = [r for r in ROLES if r not in self.roles]
        if missing:
            raise ValueError(
                f"{context}: missing settings for role(s) {', '.join(missing)}; "
                f"a recipe covers every role: {', '.join(ROLES)}"
            )
        roles = {
            role: _freeze(normalize_settings(self.roles[role], role, f"{context}, role {role!r}")) for role in ROLES
        }
        object.__setattr__(self, "roles", MappingProxyType(roles))
        object.__setattr__(self, "meta", MappingProxyType(copy.deepcopy(dict(self.meta))))

    # -- access ----------------------------------------------------------

    def settings(self, role: str) -> dict[str, Any]:
        """A fresh, mutable copy of the settings of ``role``.

        Args:
            role: one of :data:`~equiopt.recipes.ROLES`.

        Returns:
            Every field of the role's rule, defaults included.
        """
        _check_roles([role], f"recipe {self.name!r}", allow_star=False)
        return _thaw(self.roles[role])

    def to_dict(self) -> dict[str, Any]:
        """``{"name", "description", "roles": {role: settings}}`` as plain data.

        Returns:
            A new dict; ``Recipe(**recipe.to_dict())`` is an equal recipe.
        """
        return {
            "name": self.name,
            "description": self.description,
            "roles": {role: self.settings(role) for role in ROLES},
        }

    def param_groups(
        self, params_by_role: Mapping[str, Iterable[Any]], *, include_role: bool = True
    ) -> list[dict[str, Any]]:
        """Torch param groups: one per role that has parameters.

        Each group is ``{"params": [...], **settings(role)}`` (and ``"role"``
        when ``include_role``), in the order of :data:`ROLES`.

        Args:
            params_by_role: parameters per role; roles without parameters get no group.
            include_role: add the ``"role"`` key to each group.

        Returns:
            The param groups, for :class:`~equiopt.optim.EquivariantOptimizer`.
        """
        _check_roles(params_by_role, f"recipe {self.name!r}", allow_star=False)
        groups = []
        for role in ROLES:
            params = list(params_by_role.get(role, ()))
            if not params:
                continue
            group: dict[str, Any] = {"params": params}
            if include_role:
                group["role"] = role
            group.update(self.settings(role))
            groups.append(group)
        return groups

    # -- derivation ------------------------------------------------------

    def with_overrides(
        self,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        name: str | None = None,
        description: str | None = None,
    ) -> Recipe:
        """A new, validated recipe with some settings replaced.

        ``overrides`` maps a role, or ``"*"`` for every role, to the fields to
        replace, e.g. ``{"router": {"lr": 1e-3}, "*": {"weight_decay": 0.0}}``.
        ``"*"`` is applied first, then the named roles. A ``"*"`` field is
        applied to each role whose rule accepts it (``{"*": {"beta": 0.9}}``
        leaves AdamW roles alone) and is an error if no role accepts it; a
        field given for a named role must apply to that role's rule. Changing
        ``rule`` drops the fields the new rule does not accept and fills in
        its defaults.

        Args:
            overrides: fields to replace per role (``"*"``: every role that accepts them).
            name: the new recipe's name (default: this one's).
            description: the new recipe's description (default: this one's).

        Returns:
            The new recipe; this one is unchanged.

        Raises:
            ValueError: for an unknown role or field, a field the role's rule does not
                accept, or a value out of range.
        """
        overrides = {} if overrides is None else overrides
        context = f"recipe {self.name!r} overrides"
        if not isinstance(overrides, Mapping):
            raise ValueError(f"{context}: expected a mapping role -> settings, got {overrides!r}")
        _check_roles(overrides, context, allow_star=True)
        roles = {role: _thaw(self.roles[role]) for role in ROLES}

        star = overrides.get("*")
        if star is not None:
            if not isinstance(star, Mapping):
                raise ValueError(f"{context}, role '*': expected a table of settings, got {star!r}")
            for key in star:
                if key not in FIELDS:
                    raise ValueError(f"{context}, role '*': unknown field {key!r}; valid fields: {', '.join(FIELDS)}")
            used: set[str] = set()
            for role in ROLES:
                rule = star.get("rule", roles[role]["rule"])
                accepted = RULE_FIELDS.get(rule)
                # an unknown rule is reported by merge_settings
                patch = dict(star) if accepted is None else {k: v for k, v in star.items() if k in accepted}
                used.update(patch)
                roles[role] = merge_settings(roles[role], patch, role, f"{context}, role {role!r} (from '*')")
            unused = [k for k in star if k not in used]
            if unused:
                raise ValueError(
                    f"{context}, role '*': field(s) {', '.join(map(repr, unused))} apply to no role's rule"
                )
        for role in ROLES:
            if role in overrides:
                roles[role] = merge_settings(roles[role], overrides[role], role, f"{context}, role {role!r}")
        return Recipe(
            name=self.name if name is None else name,
            description=self.description if description is None else description,
            roles=roles,
            meta={"base": self.meta.get("base", self.name)} if overrides else dict(self.meta),
        )

    # -- presentation ----------------------------------------------------

    def summary(self) -> str:
        """A compact text table: role, rule, lr, beta(s), weight decay, alpha, order, center, schedule.

        Returns:
            The table, one line per role under the recipe's name and description.
        """
        header = ("role", "rule", "lr", "beta", "wd", "alpha", "order", "center", "schedule")
        rows = [header]
        for role in ROLES:
            s = self.roles[role]
            beta = s.get("betas", s.get("beta", "-"))
            if isinstance(beta, tuple):
                beta = "(" + ", ".join(f"{b:g}" for b in beta) + ")"
            sched = s["schedule"]
            sched_txt = sched["kind"]
            if sched["kind"] == "warmup_cosine":
                sched_txt += f"({sched['warmup_steps']})"
            elif sched["kind"] == "stable_decay":
                sched_txt += f"({sched['stable_fraction']:g})"
            rows.append(
                (
                    role,
                    s["rule"],
                    f"{s['lr']:g}",
                    beta if isinstance(beta, str) else f"{beta:g}",
                    f"{s['weight_decay']:g}",
                    f"{s['alpha']:g}" if "alpha" in s else "-",
                    s.get("order", "-"),
                    str(s["center"]).lower() if "center" in s else "-",
                    sched_txt,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [f"{self.name}: {self.description}"] if self.description else [self.name]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        return "\n".join(lines)

    def to_toml(self) -> str:
        """The recipe as TOML that :func:`load_recipe_toml` reads back to an equal recipe.

        Returns:
            The TOML text (:func:`~equiopt.recipes.save_recipe_toml` writes it to a file).
        """
        lines = [f"name = {toml_value(self.name)}", f"description = {toml_value(self.description)}"]
        for role in ROLES:
            lines.append("")
            lines.append(f"[roles.{role}]")
            for key, value in self.roles[role].items():
                lines.append(f"{key} = {toml_value(value)}")
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        rules = ", ".join(f"{role}={self.roles[role]['rule']}" for role in ROLES)
        return f"Recipe({self.name!r}: {rules})"

    def __hash__(self) -> int:
        return hash((self.name, self.description, self.to_toml()))

    def __reduce__(self):
        return (_rebuild, (self.name, self.description, self.to_dict()["roles"], dict(self.meta)))


def _rebuild(name: str, description: str, roles: dict, meta: dict) -> Recipe:
    return Recipe(name=name, description=description, roles=roles, meta=meta)
