"""Vocabulary and validation of per-role optimizer settings.

A *settings dict* describes how one parameter role is optimized. It is what
:class:`equiopt.EquivariantOptimizer` reads from a torch param group, plus a
``schedule`` entry that :func:`equiopt.recipes.build_scheduler` reads.

Every settings dict has a ``rule`` and an ``lr``. The other fields a rule
accepts, and their defaults, are listed in :data:`RULE_FIELDS` and
:data:`RULE_DEFAULTS`; :func:`normalize_settings` fills the defaults in, so a
normalized dict spells out every hyperparameter of its rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..linalg import POLAR_METHODS
from ..maps import DAMPINGS, ETA_RULES, HYBRID_ORDERS, ONE_SIDED_METHODS
from ..maps import SCALES as MAP_SCALES

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
ROLES: tuple[str, ...] = (
    "embedding",
    "lm_head",
    "attention",
    "mlp_in",
    "mlp_out",
    "router",
    "matrix",
    "vector",
)

#: Update rules understood by the optimizer.
#: ``spectral`` is Muon (orthogonal polar factor), ``right``/``left`` are
#: RightPolarGradM/LeftPolarGradM, ``row`` is RowNormM, ``hybrid`` is
#: HybridPolarGradM (with an ``order``).
RULES: tuple[str, ...] = ("spectral", "right", "left", "row", "hybrid", "adamw", "sgd")

#: Rules that keep an EMA momentum ``M = beta M + (1 - beta) G`` and map it.
MATRIX_RULES: tuple[str, ...] = ("spectral", "right", "left", "row", "hybrid")

#: Composition orders of the hybrid rule (those of :func:`equiopt.maps.hybrid`).
ORDERS: tuple[str, ...] = tuple(HYBRID_ORDERS)

#: Inner solvers: every polar-factor method of :func:`equiopt.linalg.polar`.
METHODS: tuple[str, ...] = tuple(POLAR_METHODS)

#: Inner solvers each rule accepts: ``spectral`` computes a polar factor
#: (:func:`equiopt.linalg.polar`); the one-sided and hybrid rules compute an
#: inverse square root of a Gram matrix (:func:`equiopt.linalg.inv_sqrt`), or the
#: polar factor directly with ``gram_newton_schulz`` (the paper's hybrid runs).
RULE_METHODS: dict[str, tuple[str, ...]] = {
    "spectral": tuple(POLAR_METHODS),
    "right": tuple(ONE_SIDED_METHODS),
    "left": tuple(ONE_SIDED_METHODS),
    "hybrid": tuple(ONE_SIDED_METHODS),
}

#: Row-scaling rules of :func:`equiopt.maps.eta_scale`; ``inverse`` is
#: eta(t) = 1 / (t + eps), the paper's smoothed row normalization.
ETAS: tuple[str, ...] = tuple(ETA_RULES)

#: Shape-dependent learning-rate factor conventions of the ``spectral`` rule
#: (Muon), per work matrix of shape (rows, cols): ``none`` (1), ``spectral``
#: (sqrt(max(1, rows / cols)), the original Muon convention) and
#: ``match_adamw`` (0.2 * sqrt(max(rows, cols))). The other rules have no
#: shape factor.
LR_SCALES: tuple[str, ...] = ("none", "spectral", "match_adamw")

#: Update-size conventions of the one-sided and hybrid rules (:data:`equiopt.maps.SCALES`):
#: ``nu`` (the paper's ``nu^alpha``) and ``rms`` (scale-transferable: a well-conditioned
#: step has RMS 1 at every width and vocabulary, so the lr is the update RMS).
SCALES: tuple[str, ...] = tuple(MAP_SCALES)

#: Learning-rate schedule kinds, see :mod:`equiopt.recipes.schedules`.
SCHEDULE_KINDS: tuple[str, ...] = ("warmup_cosine", "stable_decay", "constant")

_SCHEDULE_FIELDS: dict[str, dict[str, Any]] = {
    "warmup_cosine": {"warmup_steps": 100},
    "stable_decay": {"stable_fraction": 0.6},
    "constant": {},
}

_COMMON = ("rule", "lr", "weight_decay", "schedule")
_MATRIX_COMMON = ("beta", "nesterov")
_SPECTRAL_SOLVER = ("method", "steps")

#: Fields each rule accepts (``rule``, ``lr``, ``weight_decay`` and
#: ``schedule`` are accepted by all).
RULE_FIELDS: dict[str, tuple[str, ...]] = {
    "spectral": _COMMON + _MATRIX_COMMON + ("lr_scale",) + _SPECTRAL_SOLVER,
    "right": _COMMON + _MATRIX_COMMON + ("center", "alpha", "eps", "scale") + _SPECTRAL_SOLVER,
    "left": _COMMON + _MATRIX_COMMON + ("center", "alpha", "eps", "scale") + _SPECTRAL_SOLVER,
    "row": _COMMON + _MATRIX_COMMON + ("center", "eps", "eta"),
    "hybrid": _COMMON
    + _MATRIX_COMMON
    + ("center", "alpha", "eps", "order", "eta", "scale")
    + _SPECTRAL_SOLVER,
    "adamw": _COMMON + ("betas", "adam_eps"),
    "sgd": _COMMON + ("beta", "nesterov"),
}

#: Param-group keys that come from the role table, not from a recipe.
_STRUCTURAL_KEYS = ("layout", "layouts", "names")


def _engine_group_keys() -> tuple[str, ...]:
    """Every param-group key :class:`equiopt.EquivariantOptimizer` reads (its ``defaults``)."""
    import torch

    from ..optim import EquivariantOptimizer

    probe = EquivariantOptimizer([torch.zeros(1, requires_grad=True)], rule="adamw")
    return tuple(k for k in probe.defaults if k not in _STRUCTURAL_KEYS)


#: Param-group keys of the optimizer engine a recipe may set: read from the engine
#: itself, so a key the engine gains is a recipe field at once.
ENGINE_KEYS: tuple[str, ...] = _engine_group_keys()

#: Rules an engine option applies to, where not all (the engine ignores it elsewhere).
_ENGINE_KEY_RULES: dict[str, tuple[str, ...]] = {
    "polar_dtype": ("spectral",),
    "damping": ("right", "left", "hybrid"),
    "lazy": tuple(r for r in RULES if r != "adamw"),
}

#: Engine options without a recipe default: a settings dict holds them only when
#: given, and the engine's own default applies otherwise (``polar_dtype``:
#: bfloat16 Polar Express iterations; ``nonfinite``: ``"skip"``).
OPTIONAL_FIELDS: tuple[str, ...] = tuple(
    k for k in ENGINE_KEYS if k not in {f for fields in RULE_FIELDS.values() for f in fields}
)
for _rule in RULE_FIELDS:
    RULE_FIELDS[_rule] = RULE_FIELDS[_rule] + tuple(
        k for k in OPTIONAL_FIELDS if _rule in _ENGINE_KEY_RULES.get(k, RULES)
    )

#: Every field name a settings dict may contain.
FIELDS: tuple[str, ...] = tuple(
    dict.fromkeys(f for fields in RULE_FIELDS.values() for f in fields)
)

_MATRIX_DEFAULTS: dict[str, Any] = {
    "weight_decay": 0.0,
    "beta": 0.95,
    "nesterov": False,
    "center": False,
    "eps": 1e-8,
    "method": "polar_express",
    "steps": 5,
    "eta": "inverse",
}

#: Defaults filled in for fields a settings dict leaves out. ``lr`` has no
#: default. ``schedule`` defaults by role, see :func:`default_schedule`.
#: Spectral (Muon) defaults to Nesterov momentum and the ``spectral``
#: lr_scale, as in the original Muon; the one-sided rules default to
#: ``alpha = 0`` and the hybrid rule to ``alpha = 1`` (the defaults of
#: :mod:`equiopt.maps`); AdamW defaults to ``betas = (0.9, 0.95)``, the usual
#: language-model pre-training choice.
RULE_DEFAULTS: dict[str, dict[str, Any]] = {
    "spectral": {
        **{k: _MATRIX_DEFAULTS[k] for k in ("weight_decay", "beta", "method", "steps")},
        "nesterov": True,
        "lr_scale": "spectral",
    },
    "right": {
        **{k: v for k, v in _MATRIX_DEFAULTS.items() if k != "eta"},
        "alpha": 0.0,
        "scale": "nu",
    },
    "left": {
        **{k: v for k, v in _MATRIX_DEFAULTS.items() if k != "eta"},
        "alpha": 0.0,
        "scale": "nu",
    },
    "row": {
        k: v for k, v in _MATRIX_DEFAULTS.items() if k not in ("method", "steps")
    },
    "hybrid": {**_MATRIX_DEFAULTS, "alpha": 1.0, "order": "row_then_right", "scale": "nu"},
    "adamw": {"weight_decay": 0.0, "betas": (0.9, 0.95), "adam_eps": 1e-8},
    "sgd": {"weight_decay": 0.0, "beta": 0.0, "nesterov": False},
}


def default_schedule(role: str) -> dict[str, Any]:
    """The paper's schedule for ``role``.

    The paper (appendix "Experimental Details") uses linear warmup (100 steps)
    then half-cosine decay to 0 for AdamW on scalar and vector parameters, and
    for every other parameter, whatever its optimizer, holds the base lr for
    the first 60 % of the steps and then decays it linearly to 0. So ``vector``
    gets ``warmup_cosine`` and every other role ``stable_decay``.
    """
    if role == "vector":
        return {"kind": "warmup_cosine", "warmup_steps": 100}
    return {"kind": "stable_decay", "stable_fraction": 0.6}


# --------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------


def _where(context: str, field: str) -> str:
    return f"{context}, field {field!r}" if context else f"field {field!r}"


def _fail(context: str, field: str, message: str) -> ValueError:
    return ValueError(f"{_where(context, field)}: {message}")


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _real(context: str, field: str, value: Any) -> float:
    if not _is_real(value):
        raise _fail(context, field, f"expected a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise _fail(context, field, f"expected a finite number, got {value!r}")
    return value


def _positive(context: str, field: str, value: Any) -> float:
    v = _real(context, field, value)
    if not v > 0:
        raise _fail(context, field, f"must be > 0, got {value!r}")
    return v


def _nonnegative(context: str, field: str, value: Any) -> float:
    v = _real(context, field, value)
    if not v >= 0:
        raise _fail(context, field, f"must be >= 0, got {value!r}")
    return v


def _unit_open(context: str, field: str, value: Any) -> float:
    v = _real(context, field, value)
    if not 0 <= v < 1:
        raise _fail(context, field, f"must satisfy 0 <= {field} < 1, got {value!r}")
    return v


def _unit_closed(context: str, field: str, value: Any) -> float:
    v = _real(context, field, value)
    if not 0 <= v <= 1:
        raise _fail(context, field, f"must satisfy 0 <= {field} <= 1, got {value!r}")
    return v


def _boolean(context: str, field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(context, field, f"expected true or false, got {value!r}")
    return value


def _choice(choices: Sequence[str]):
    def check(context: str, field: str, value: Any) -> str:
        if value not in choices:
            raise _fail(
                context, field, f"unknown value {value!r}; valid: {', '.join(choices)}"
            )
        return value

    return check


def _int_at_least(minimum: int):
    def check(context: str, field: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise _fail(context, field, f"expected an integer, got {value!r}")
        if value < minimum:
            raise _fail(context, field, f"must be >= {minimum}, got {value!r}")
        return value

    return check


def _betas(context: str, field: str, value: Any) -> tuple[float, float]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise _fail(context, field, f"expected a pair (beta1, beta2), got {value!r}")
    out = []
    for i, b in enumerate(value):
        v = _real(context, field, b)
        if not 0 <= v < 1:
            raise _fail(
                context, field, f"betas[{i}] must satisfy 0 <= beta < 1, got {value!r}"
            )
        out.append(v)
    return (out[0], out[1])


_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
                "fp64": "float64", "double": "float64"}


def _dtype(context: str, field: str, value: Any):
    """A floating torch dtype, from a dtype or its name (``"bfloat16"``, ``"float32"``, ``"torch.float16"``, ``"bf16"``)."""
    import torch

    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        dtype = getattr(torch, _DTYPE_NAMES.get(name, name), None)
    else:
        dtype = None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise _fail(context, field, f"expected a floating dtype name (bfloat16, float16, float32, float64), got {value!r}")
    return dtype


def _engine_choice(name: str):
    """A choice among the values the engine's own validation accepts (e.g. NONFINITE_POLICIES)."""
    from ..optim import rules

    return _choice(getattr(rules, name))


def _engine_checked(context: str, field: str, value: Any) -> Any:
    """An engine option without a schema check of its own: the engine validates it."""
    if field.endswith("dtype"):
        return _dtype(context, field, value)
    return value


_CHECKS = {
    "rule": _choice(RULES),
    "lr": _positive,
    "weight_decay": _nonnegative,
    "beta": _unit_open,
    "nesterov": _boolean,
    "center": _boolean,
    "alpha": _unit_closed,
    "eps": _positive,
    "method": _choice(METHODS),
    "steps": _int_at_least(1),
    "order": _choice(ORDERS),
    "eta": _choice(ETAS),
    "lr_scale": _choice(LR_SCALES),
    "scale": _choice(SCALES),
    "damping": _choice(DAMPINGS),
    "betas": _betas,
    "adam_eps": _positive,
    "polar_dtype": _dtype,
    "nonfinite": _engine_choice("NONFINITE_POLICIES"),
    "lazy": _boolean,
}
for _key in OPTIONAL_FIELDS:
    _CHECKS.setdefault(_key, _engine_checked)


def _engine_validate(settings: Mapping[str, Any], context: str) -> None:
    """Let the engine check the options it alone knows, on a throwaway parameter."""
    import torch

    from ..optim import EquivariantOptimizer

    rule = settings["rule"]
    probe = torch.zeros(2, 2, requires_grad=True) if rule in MATRIX_RULES else torch.zeros(2, requires_grad=True)
    group = {k: v for k, v in settings.items() if k != "schedule"}
    try:
        EquivariantOptimizer([{"params": [probe], **group}])
    except (ValueError, TypeError) as err:
        given = [k for k in OPTIONAL_FIELDS if k in settings]
        raise _fail(context, given[0] if len(given) == 1 else "/".join(given), str(err)) from None


def normalize_schedule(schedule: Any, context: str = "") -> dict[str, Any]:
    """Validate a schedule dict and fill in its defaults.

    ``{"kind": "warmup_cosine", "warmup_steps": int >= 0}``,
    ``{"kind": "stable_decay", "stable_fraction": 0 <= float <= 1}`` or
    ``{"kind": "constant"}``.
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
        out["warmup_steps"] = _int_at_least(0)(context, "schedule.warmup_steps", out["warmup_steps"])
    elif kind == "stable_decay":
        out["stable_fraction"] = _unit_closed(
            context, "schedule.stable_fraction", out["stable_fraction"]
        )
    return out


def _check_field_names(settings: Mapping[str, Any], rule: str | None, context: str) -> None:
    for key in settings:
        if not isinstance(key, str) or key not in FIELDS:
            raise ValueError(
                f"{context + ': ' if context else ''}unknown field {key!r}; "
                f"valid fields: {', '.join(FIELDS)}"
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


def normalize_settings(
    settings: Mapping[str, Any], role: str, context: str | None = None
) -> dict[str, Any]:
    """Validate one role's settings and return a new dict with defaults filled in.

    Raises :class:`ValueError` naming the role and field on an unknown field, a
    field that does not apply to the rule, or a bad value.
    """
    if context is None:
        context = f"role {role!r}"
    if not isinstance(settings, Mapping):
        raise ValueError(f"{context}: expected a table of settings, got {settings!r}")
    _check_field_names(settings, None, context)
    if "rule" not in settings:
        raise ValueError(f"{context}: missing field 'rule'; valid rules: {', '.join(RULES)}")
    rule = _CHECKS["rule"](context, "rule", settings["rule"])
    _check_field_names(settings, rule, context)
    if "lr" not in settings:
        raise ValueError(f"{context}: missing field 'lr'")
    out: dict[str, Any] = {"rule": rule}
    merged = {**RULE_DEFAULTS[rule], **settings}
    for key in RULE_FIELDS[rule]:
        if key in ("rule", "schedule") or (key in OPTIONAL_FIELDS and key not in merged):
            continue
        out[key] = _CHECKS[key](context, key, merged[key])
    if any(k in out for k in OPTIONAL_FIELDS):
        _engine_validate(out, context)
    if "method" in out and out["method"] not in RULE_METHODS[rule]:
        raise _fail(
            context,
            "method",
            f"{out['method']!r} is not available for rule {rule!r}; "
            f"valid: {', '.join(RULE_METHODS[rule])}",
        )
    out["schedule"] = normalize_schedule(
        settings.get("schedule", default_schedule(role)), context
    )
    return out


def merge_settings(
    base: Mapping[str, Any], patch: Mapping[str, Any], role: str, context: str | None = None
) -> dict[str, Any]:
    """Apply ``patch`` to the (normalized) settings ``base`` of ``role``.

    Fields in ``patch`` replace those of ``base``. When ``patch`` changes the
    rule, fields of ``base`` that the new rule does not accept are dropped and
    the new rule's defaults fill the gaps. A partial ``schedule`` (no ``kind``,
    or the same kind) updates the current schedule; a new ``kind`` replaces it.
    """
    if context is None:
        context = f"role {role!r}"
    if not isinstance(patch, Mapping):
        raise ValueError(f"{context}: expected a table of settings, got {patch!r}")
    _check_field_names(patch, None, context)
    rule = patch.get("rule", base["rule"])
    rule = _CHECKS["rule"](context, "rule", rule)
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
