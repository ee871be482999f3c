"""Vocabulary and validation of per-role optimizer settings.

A *settings dict* describes how one parameter role is optimized. It is what
:class:`equiopt.EquivariantOptimizer` reads from a torch param group, plus a
``schedule`` entry that :func:`equiopt.recipes.build_scheduler` reads.

Every settings dict has a ``rule`` and an ``lr``. The other fields a rule
accepts, and their defaults, are listed in :data:`RULE_FIELDS` and
:data:`RULE_DEFAULTS`, both read from the optimizer's own table
(:data:`equiopt.optim.fields.FIELDS`); :func:`normalize_settings` fills the defaults
in, so a normalized dict spells out every hyperparameter of its rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..linalg import POLAR_METHODS
from ..maps import ETA_RULES, HYBRID_ORDERS
from ..maps import SCALES as MAP_SCALES
from ..optim import fields
from ..roles.table import ROLES as _ROLES

__all__ = [
    "ROLES",
    "RULES",
    "MATRIX_RULES",
    "ORDERS",
    "METHODS",
    "RULE_METHODS",
    "ETAS",
    "LR_SCALES",
    "SCALES",
    "SCHEDULE_KINDS",
    "FIELDS",
    "ENGINE_KEYS",
    "OPTIONAL_FIELDS",
    "RULE_FIELDS",
    "RULE_DEFAULTS",
    "default_schedule",
    "normalize_settings",
    "normalize_schedule",
    "merge_settings",
]

#: Parameter roles, as assigned by :func:`equiopt.assign_roles`.
ROLES: tuple[str, ...] = _ROLES

#: Update rules understood by the optimizer.
#: ``spectral`` is Muon (orthogonal polar factor), ``right``/``left`` are
#: RightPolarGradM/LeftPolarGradM, ``row`` is RowNormM, ``hybrid`` is
#: HybridPolarGradM (with an ``order``).
RULES: tuple[str, ...] = fields.RULES

#: Rules that keep an EMA momentum ``M = beta M + (1 - beta) G`` and map it.
MATRIX_RULES: tuple[str, ...] = fields.MATRIX_RULES

#: Composition orders of the hybrid rule (those of :func:`equiopt.maps.hybrid`).
ORDERS: tuple[str, ...] = tuple(HYBRID_ORDERS)

#: Inner solvers: every polar-factor method of :func:`equiopt.linalg.polar`.
METHODS: tuple[str, ...] = tuple(POLAR_METHODS)

#: Inner solvers each rule accepts (:data:`equiopt.optim.fields.RULE_METHODS`).
RULE_METHODS: dict[str, tuple[str, ...]] = fields.RULE_METHODS

#: Row-scaling rules of :func:`equiopt.maps.eta_scale`; ``inverse`` is
#: eta(t) = 1 / (t + eps), the paper's smoothed row normalization.
ETAS: tuple[str, ...] = tuple(ETA_RULES)

#: Shape-dependent learning-rate factor conventions of the ``spectral`` rule
#: (:func:`equiopt.optim.rules.lr_scale_factor`).
LR_SCALES: tuple[str, ...] = fields.LR_SCALES

#: Update-size conventions of the one-sided and hybrid rules (:data:`equiopt.maps.SCALES`).
SCALES: tuple[str, ...] = tuple(MAP_SCALES)

#: Learning-rate schedule kinds, see :mod:`equiopt.recipes.schedules`.
SCHEDULE_KINDS: tuple[str, ...] = ("warmup_cosine", "stable_decay", "constant")

_SCHEDULE_FIELDS: dict[str, dict[str, Any]] = {
    "warmup_cosine": {"warmup_steps": 100},
    "stable_decay": {"stable_fraction": 0.6},
    "constant": {},
}

#: Param-group keys of the optimizer engine a recipe may set: every setting of
#: :data:`equiopt.optim.fields.FIELDS`.
ENGINE_KEYS: tuple[str, ...] = tuple(fields.FIELDS)

#: Settings a recipe holds only when given (the engine's default applies otherwise).
OPTIONAL_FIELDS: tuple[str, ...] = fields.OPTIONAL_FIELDS


def _with_schedule(names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` with the recipe's own ``schedule`` after ``weight_decay``."""
    at = names.index("weight_decay") + 1
    return names[:at] + ("schedule",) + names[at:]


#: Fields each rule accepts: the engine's settings of that rule, and ``schedule``.
RULE_FIELDS: dict[str, tuple[str, ...]] = {rule: _with_schedule(names) for rule, names in fields.RULE_FIELDS.items()}

#: Every field name a settings dict may contain.
FIELDS: tuple[str, ...] = _with_schedule(tuple(fields.FIELDS))

#: Defaults filled in for fields a settings dict leaves out: the engine's
#: (:data:`equiopt.optim.fields.RULE_DEFAULTS`), so a recipe and a hand-built param
#: group give a rule the same settings. ``lr`` has no default; ``schedule`` defaults
#: by role, see :func:`default_schedule`.
RULE_DEFAULTS: dict[str, dict[str, Any]] = {
    rule: {k: v for k, v in defaults.items() if k not in OPTIONAL_FIELDS}
    for rule, defaults in fields.RULE_DEFAULTS.items()
}


def default_schedule(role: str) -> dict[str, Any]:
    """The paper's schedule for ``role``.

    The paper (appendix "Experimental Details") uses linear warmup (100 steps)
    then half-cosine decay to 0 for AdamW on scalar and vector parameters, and
    for every other parameter, whatever its optimizer, holds the base lr for
    the first 60 % of the steps and then decays it linearly to 0. So ``vector``
    gets ``warmup_cosine`` and every other role ``stable_decay``.

    Args:
        role: a parameter role (:data:`ROLES`).

    Returns:
        A new schedule dict: ``{"kind": "warmup_cosine", "warmup_steps": 100}`` for
        ``vector``, ``{"kind": "stable_decay", "stable_fraction": 0.6}`` otherwise.
    """
    if role == "vector":
        return {"kind": "warmup_cosine", "warmup_steps": 100}
    return {"kind": "stable_decay", "stable_fraction": 0.6}


# --------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------


def _fail(context: str, field: str, message: str) -> ValueError:
    where = f"{context}, field {field!r}" if context else f"field {field!r}"
    return ValueError(f"{where}: {message}")


def _checked(check, context: str, field: str, value: Any) -> Any:
    """``check`` (one of :mod:`equiopt.optim.fields`' value checks) with the error naming ``field``."""
    try:
        return check(value, "")
    except ValueError as err:
        raise _fail(context, field, str(err)) from None


def _check_values(settings: Mapping[str, Any], context: str) -> dict[str, Any]:
    """The table's checks (:data:`equiopt.optim.fields.FIELDS`) on a recipe's settings;
    a recipe names its ``eta`` (TOML holds no callables)."""
    if "eta" in settings and callable(settings["eta"]):
        raise _fail(context, "eta", f"a recipe names its eta rule ({', '.join(ETAS)}), got {settings['eta']!r}")
    return fields.check_settings(settings, context)


def normalize_schedule(schedule: Any, context: str = "") -> dict[str, Any]:
    """Validate a schedule dict and fill in its defaults.

    ``{"kind": "warmup_cosine", "warmup_steps": int >= 0}``,
    ``{"kind": "stable_decay", "stable_fraction": 0 <= float <= 1}`` or
    ``{"kind": "constant"}``.

    Args:
        schedule: the schedule as given (a mapping with a ``kind``; the other fields
            may be left out).
        context: where the schedule comes from (e.g. ``"role 'router'"``), put before
            the field in error messages.

    Returns:
        A new dict with ``kind`` first and every field of that kind, defaults filled in
        (``warmup_steps`` as an int, ``stable_fraction`` as a float).

    Raises:
        ValueError: when ``schedule`` is not a mapping, its kind is unknown, it has a
            key its kind does not take, or a value is out of range.
    """
    field = "schedule"
    if not isinstance(schedule, Mapping):
        raise _fail(context, field, f"expected a table with a 'kind', got {schedule!r}")
    kind = schedule.get("kind")
    if kind not in _SCHEDULE_FIELDS:
        raise _fail(
            context,
            field,
            f"unknown kind {kind!r}; valid: {', '.join(SCHEDULE_KINDS)}",
        )
    allowed = _SCHEDULE_FIELDS[kind]
    unknown = [k for k in schedule if k != "kind" and k not in allowed]
    if unknown:
        valid = ", ".join(["kind", *allowed])
        raise _fail(
            context,
            field,
            f"unknown key(s) {', '.join(map(repr, unknown))} for kind {kind!r}; valid: {valid}",
        )
    out: dict[str, Any] = {"kind": kind, **allowed, **{k: v for k, v in schedule.items() if k != "kind"}}
    if kind == "warmup_cosine":
        out["warmup_steps"] = _checked(
            fields.integer_at_least(0), context, "schedule.warmup_steps", out["warmup_steps"]
        )
    elif kind == "stable_decay":
        out["stable_fraction"] = _checked(
            fields.interval(0.0, 1.0, True, "in [0, 1]"), context, "schedule.stable_fraction", out["stable_fraction"]
        )
    return out


def _check_field_names(settings: Mapping[str, Any], rule: str | None, context: str) -> None:
    for key in settings:
        if not isinstance(key, str) or key not in FIELDS:
            raise ValueError(
                f"{context + ': ' if context else ''}unknown field {key!r}; valid fields: {', '.join(FIELDS)}"
            )
    if rule is not None:
        allowed = RULE_FIELDS[rule]
        for key in settings:
            if key not in allowed:
                raise _fail(
                    context,
                    key,
                    f"does not apply to rule {rule!r}; fields of {rule!r}: {', '.join(allowed)}",
                )


def _rule(value: Any, context: str) -> str:
    if value not in RULES:
        raise _fail(context, "rule", f"unknown rule {value!r}; valid: {', '.join(RULES)}")
    return value


def normalize_settings(settings: Mapping[str, Any], role: str, context: str | None = None) -> dict[str, Any]:
    """Validate one role's settings and return a new dict with defaults filled in.

    Raises :class:`ValueError` naming the role and field on an unknown field, a
    field that does not apply to the rule, or a bad value.

    Args:
        settings: the role's settings; ``rule`` and ``lr`` are required, every other
            field of the rule (:data:`RULE_FIELDS`) is optional.
        role: the parameter role (:data:`ROLES`); it picks the default ``schedule``
            (:func:`default_schedule`).
        context: the prefix of error messages; None: ``"role '<role>'"``.

    Returns:
        A new dict of the rule's fields in :data:`RULE_FIELDS` order with the defaults
        of :data:`RULE_DEFAULTS` filled in (optional fields only when given), and a
        normalized ``schedule`` last.

    Raises:
        ValueError: on settings that are not a mapping, a missing ``rule`` or ``lr``,
            an unknown rule or field, a field the rule does not take, or a bad value.
    """
    if context is None:
        context = f"role {role!r}"
    if not isinstance(settings, Mapping):
        raise ValueError(f"{context}: expected a table of settings, got {settings!r}")
    _check_field_names(settings, None, context)
    if "rule" not in settings:
        raise ValueError(f"{context}: missing field 'rule'; valid rules: {', '.join(RULES)}")
    rule = _rule(settings["rule"], context)
    _check_field_names(settings, rule, context)
    if "lr" not in settings:
        raise ValueError(f"{context}: missing field 'lr'")
    merged = {**RULE_DEFAULTS[rule], **{k: v for k, v in settings.items() if k != "schedule"}}
    checked = _check_values(merged, context)
    out: dict[str, Any] = {k: checked[k] for k in RULE_FIELDS[rule] if k in checked}
    out["schedule"] = normalize_schedule(settings.get("schedule", default_schedule(role)), context)
    return out


def merge_settings(
    base: Mapping[str, Any], patch: Mapping[str, Any], role: str, context: str | None = None
) -> dict[str, Any]:
    """Apply ``patch`` to the (normalized) settings ``base`` of ``role``.

    Fields in ``patch`` replace those of ``base``. When ``patch`` changes the
    rule, fields of ``base`` that the new rule does not accept are dropped and
    the new rule's defaults fill the gaps. A partial ``schedule`` (no ``kind``,
    or the same kind) updates the current schedule; a new ``kind`` replaces it.

    Args:
        base: the current settings of ``role`` (normalized, see
            :func:`normalize_settings`); not modified.
        patch: the fields to change; any subset of :data:`FIELDS`.
        role: the parameter role (:data:`ROLES`).
        context: the prefix of error messages; None: ``"role '<role>'"``.

    Returns:
        A new normalized settings dict (as :func:`normalize_settings` returns).

    Raises:
        ValueError: when ``patch`` is not a mapping, names an unknown rule or field or
            a field the resulting rule does not take, or the merged settings are invalid.
    """
    if context is None:
        context = f"role {role!r}"
    if not isinstance(patch, Mapping):
        raise ValueError(f"{context}: expected a table of settings, got {patch!r}")
    _check_field_names(patch, None, context)
    rule = _rule(patch.get("rule", base["rule"]), context)
    _check_field_names(patch, rule, context)
    allowed = RULE_FIELDS[rule]
    merged = {k: v for k, v in base.items() if k in allowed}
    for key, value in patch.items():
        if key == "schedule" and isinstance(value, Mapping) and isinstance(base.get("schedule"), Mapping):
            old = dict(base["schedule"])
            if "kind" not in value or value["kind"] == old.get("kind"):
                merged["schedule"] = {**old, **value}
                continue
        merged[key] = value
    merged["rule"] = rule
    return normalize_settings(merged, role, context)
