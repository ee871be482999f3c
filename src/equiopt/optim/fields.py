"""Every rule's settings, defined once: name, the rules that read it, default, check, meaning.

:data:`FIELDS` is the one table. :class:`~equiopt.optim.EquivariantOptimizer` fills a
param group's missing or ``None`` settings from it and checks them with it;
:mod:`equiopt.recipes.schema` derives the recipe vocabulary (which fields each rule
accepts, their defaults) from it; ``equiopt fields`` prints it and the docs page
"Rules and their settings" is generated from it. A hand-built param group and a recipe
therefore give the same rule the same defaults: the usual language-model pre-training
choices (EMA momentum 0.95, Nesterov for Muon, AdamW ``betas = (0.9, 0.95)``, decoupled
weight decay 0 unless set).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from .. import maps
from .rules.base import LR_SCALES, RuleNames, check_fields, rule_named, rules

__all__ = [
    "Field",
    "FIELDS",
    "RULES",
    "MATRIX_RULES",
    "ELEMENTWISE_RULES",
    "PEER_RULES",
    "LR_SCALES",
    "NONFINITE_POLICIES",
    "RULE_FIELDS",
    "RULE_DEFAULTS",
    "OPTIONAL_FIELDS",
    "RULE_METHODS",
    "POLAR_RULES",
    "default",
    "fill_defaults",
    "check_settings",
    "fields_table",
]

# (the rules live in equiopt.optim.rules, one module each; these read its registry at each use)
#: The matrix rules (:attr:`Rule.kind` ``"matrix"``).
MATRIX_RULES: Sequence[str] = RuleNames(lambda r: r.kind == "matrix")
#: The element-wise rules (``adamw``, ``sgd``).
ELEMENTWISE_RULES: Sequence[str] = RuleNames(lambda r: r.kind == "elementwise")
#: torch's own optimizers as rules, the outside reference arms of a comparison
#: (:mod:`equiopt.optim.peers`): ``torch_adamw`` steps a group with ``torch.optim.AdamW``,
#: ``torch_muon`` with ``torch.optim.Muon`` (torch >= 2.9).
PEER_RULES: Sequence[str] = RuleNames(lambda r: r.kind == "peer")
#: Every registered rule.
RULES: Sequence[str] = RuleNames(lambda r: True)
NONFINITE_POLICIES: tuple[str, ...] = ("skip", "raise")
#: Rules built on the polar factor: Muon and its row-normalised hybrids (:attr:`Rule.polar`).
POLAR_RULES: Sequence[str] = RuleNames(lambda r: r.polar)
#: The settings every rule reads.
COMMON_FIELDS: tuple[str, ...] = ("rule", "lr", "weight_decay")


class _PerRule(Mapping):
    """A mapping rule name -> ``value(rule)`` over the registered rules, read at each use."""

    def __init__(self, value: Callable[[Any], Any], keep: Callable[[Any], bool] = lambda r: True):
        self._value, self._keep = value, keep

    def __getitem__(self, name: str) -> Any:
        rule = rule_named(name) if name in RULES else None
        if rule is None or not self._keep(rule):
            raise KeyError(name)
        return self._value(rule)

    def __iter__(self):
        return (r.name for r in rules() if self._keep(r))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return repr(dict(self))


#: Inner solvers each rule accepts: ``spectral`` computes a polar factor
#: (:func:`equiopt.linalg.polar`); the one-sided and hybrid rules an inverse square root
#: of a Gram (:func:`equiopt.linalg.inv_sqrt`), or the polar factor directly with
#: ``gram_newton_schulz``.
RULE_METHODS: Mapping[str, tuple[str, ...]] = _PerRule(lambda r: tuple(r.methods), lambda r: bool(r.methods))


class Field(NamedTuple):
    """One setting. ``default``: its value unless a rule's :attr:`Rule.defaults` says
    otherwise; ``check(value, rule)`` returns the value (normalised) or raises
    :class:`ValueError` with a message that does not name the field (callers add it).
    ``optional``: a recipe leaves the field out unless given, and the engine's default
    applies. The rules that read it are those whose :attr:`Rule.fields` name it."""

    name: str
    default: Any
    check: Callable[[Any, str], Any]
    doc: str
    optional: bool = False

    @property
    def rules(self) -> tuple[str, ...]:
        """The registered rules that read this setting."""
        every = self.name in COMMON_FIELDS
        return tuple(r.name for r in rules() if every or self.name in r.fields)

    def default_for(self, rule: str) -> Any:
        return rule_named(rule).defaults.get(self.name, self.default)


# ---------------------------------------------------------------- value checks
def _number(value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")
    return float(value)


def interval(low: float, high: float, closed: bool, what: str) -> Callable[[Any, str], float]:
    def check(value: Any, rule: str) -> float:
        v = _number(value)
        if not (low <= v <= high if closed else low <= v < high):
            raise ValueError(f"must be {what}, got {value!r}")
        return v

    return check


def _learning_rate(value: Any, rule: str) -> Any:
    """A number >= 0, or a one-element tensor (torch's tensor learning rates) kept as it is
    (read here once, at construction, to check its value; the step reads it on the device)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not value.dtype.is_floating_point:
            raise ValueError(f"a tensor lr must be floating point, got {value.dtype}")
        v = float(value.detach().reshape(()).cpu())
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"must be a finite number >= 0, got {value!r}")
        return value
    return _at_least(0.0, strict=False)(value, rule)


def _at_least(low: float, strict: bool) -> Callable[[Any, str], float]:
    def check(value: Any, rule: str) -> float:
        v = _number(value)
        if not (v > low if strict else v >= low):
            raise ValueError(f"must be {'>' if strict else '>='} {low:g}, got {value!r}")
        return v

    return check


def _boolean(value: Any, rule: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false (True or False in Python), got {value!r}")
    return value


def integer_at_least(low: int) -> Callable[[Any, str], int]:
    def check(value: Any, rule: str) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
        if value < low:
            raise ValueError(f"must be >= {low}, got {value!r}")
        return value

    return check


def _choice(noun: str, choices: Sequence[str] | Callable[[str], Sequence[str]]) -> Callable[[Any, str], str]:
    def check(value: Any, rule: str) -> str:
        valid = choices(rule) if callable(choices) else choices
        if value not in valid:
            for_rule = f" for rule {rule!r}" if callable(choices) else ""
            raise ValueError(f"unknown {noun} {value!r}{for_rule}; valid: {', '.join(valid)}")
        return value

    return check


def _eta(value: Any, rule: str) -> Any:
    if callable(value):
        return value
    return _choice("eta", maps.ETA_RULES)(value, rule)


def _betas(value: Any, rule: str) -> tuple[float, float]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"expected a pair (beta1, beta2), got {value!r}")
    pair = tuple(_number(b) for b in value)
    if not all(0 <= b < 1 for b in pair):
        raise ValueError(f"must be a pair in [0, 1), got {value!r}")
    return pair  # type: ignore[return-value]


_DTYPE_NAMES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
}


def _dtype(value: Any, rule: str) -> Any:
    """``None``, or a floating torch dtype from a dtype or its name (``"bfloat16"``, ``"bf16"``, ``"torch.float16"``)."""
    import torch

    if value is None or isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    dtype = None
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        dtype = getattr(torch, _DTYPE_NAMES.get(name, name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"expected a floating dtype name (bfloat16, float16, float32, float64), got {value!r}")
    return dtype


def _gram_dtype(value: Any, rule: str) -> str:
    """One of :data:`equiopt.maps.GRAM_DTYPES`, from its name or a torch dtype (``"bf16"``,
    ``torch.bfloat16``); None is ``"auto"``."""
    if value is None:
        return "auto"
    if isinstance(value, str) and value.strip().lower() in maps.GRAM_DTYPES:
        return value.strip().lower()
    try:
        dtype = _dtype(value, rule)
    except ValueError:
        raise ValueError(f"expected one of {', '.join(maps.GRAM_DTYPES)}, got {value!r}") from None
    name = "float32" if dtype is None else str(dtype).removeprefix("torch.")
    if name not in maps.GRAM_DTYPES:
        raise ValueError(f"expected one of {', '.join(maps.GRAM_DTYPES)}, got {value!r}")
    return name


def _lr_scales(rule: str) -> Sequence[str]:
    return rule_named(rule).lr_scales


def _methods(rule: str) -> Sequence[str]:
    return rule_named(rule).methods


# ------------------------------------------------------------------ the table
FIELDS: dict[str, Field] = {
    f.name: f
    for f in (
        Field(
            "rule",
            None,
            _choice("rule", RULES),
            "the update rule: one of the registered rules (equiopt.optim.rules), listed in the table with what each is",
        ),
        Field("lr", 1e-3, _learning_rate, "learning rate (a recipe must give it; a float or a 1-element tensor)"),
        Field("weight_decay", 0.0, _at_least(0.0, strict=False), "decoupled weight decay, multiplied by lr"),
        Field(
            "beta",
            0.95,
            interval(0.0, 1.0, False, "in [0, 1)"),
            "EMA momentum M = beta M + (1 - beta) G",
        ),
        Field(
            "nesterov",
            False,
            _boolean,
            "map beta M + (1 - beta) G instead of M (Muon's default)",
        ),
        Field(
            "center",
            False,
            _boolean,
            "project onto the quotient that removes softmax's shared shift (LM heads, routers)",
        ),
        Field(
            "alpha",
            0.0,
            interval(0.0, 1.0, True, "in [0, 1]"),
            "exponent of the nu^alpha update size",
        ),
        Field(
            "eps",
            1e-8,
            _at_least(0.0, strict=True),
            "Gram damping (relative or absolute, see damping), row-norm smoothing (spectral_row), "
            "added to sqrt(v_i) (normuon)",
        ),
        Field(
            "method",
            "polar_express",
            _choice("method", _methods),
            "polar-factor method (spectral) or Gram inverse-square-root method",
        ),
        Field("steps", 5, integer_at_least(1), "iterations of the method"),
        Field(
            "order",
            "row_then_right",
            _choice("hybrid order", maps.HYBRID_ORDERS),
            "composition order of the hybrid map",
        ),
        Field("eta", "inverse", _eta, "row-scaling rule (inverse: 1 / (t + eps)), or a callable"),
        Field(
            "lr_scale",
            "spectral",
            _choice("lr_scale", _lr_scales),
            "shape factor: spectral sqrt(max(1, rows/cols)), match_adamw 0.2 sqrt(max(rows, cols)), none",
        ),
        Field(
            "scale",
            "nu",
            _choice("scale", maps.SCALES),
            "update size: nu (the paper's nu^alpha) or rms (RMS 1 at every width)",
        ),
        Field(
            "damping",
            "relative",
            _choice("damping", maps.DAMPINGS),
            "relative: eps times the mean eigenvalue of the Gram, tr(C) / min(m, n); absolute: the paper's eps",
            optional=True,
        ),
        Field(
            "gram_dtype",
            "auto",
            _gram_dtype,
            "precision of the Gram, inverse square root and final product: float32; bfloat16x6 "
            "(float32's accuracy from six bfloat16 tensor-core products each); bfloat16 (one "
            "rounding, safe to condition numbers of about 100); auto (bfloat16x6 on CUDA for "
            "matrices of 512 and more, float32 elsewhere)",
            optional=True,
        ),
        Field(
            "route",
            "auto",
            _choice("route", maps.ROUTES),
            "how the one-sided stage is computed: gram (Gram, inverse square root, product; damped by eps); "
            "direct (Polar Express on the matrix itself in the iteration's dtype, as Muon, nu = tr(M^T P); "
            "undamped, Muon's accuracy); auto (the cheaper by FLOPs at each precision's rate on the device: "
            "direct on CUDA, gram on CPU, float64 and row-sharded matrices)",
            optional=True,
        ),
        Field(
            "beta2",
            0.95,
            interval(0.0, 1.0, False, "in [0, 1)"),
            "EMA of each row's mean square of the polar factor, v = beta2 v + (1 - beta2) mean_j O_ij^2",
        ),
        Field("betas", (0.9, 0.95), _betas, "AdamW's (beta1, beta2)"),
        Field("adam_eps", 1e-8, _at_least(0.0, strict=True), "AdamW's epsilon"),
        Field(
            "polar_dtype",
            None,
            _dtype,
            "dtype of the polar iterations (None: bfloat16 where the device multiplies it natively, else float32; linalg.default_dtype)",
            optional=True,
        ),
        Field(
            "nonfinite",
            "skip",
            _choice("nonfinite policy", NONFINITE_POLICIES),
            "skip: leave a parameter with a NaN/Inf gradient untouched and count it; raise: name it",
            optional=True,
        ),
        Field(
            "lazy",
            False,
            _boolean,
            "update only rows whose gradient is nonzero this step (embeddings)",
            optional=True,
        ),
    )
}

#: Fields each rule reads, in table order.
RULE_FIELDS: Mapping[str, tuple[str, ...]] = _PerRule(
    lambda r: tuple(n for n in FIELDS if n in COMMON_FIELDS or n in r.fields)
)
#: Every rule's defaults (``lr`` and ``rule`` excluded).
RULE_DEFAULTS: Mapping[str, dict[str, Any]] = _PerRule(
    lambda r: {n: FIELDS[n].default_for(r.name) for n in RULE_FIELDS[r.name] if n not in ("rule", "lr")}
)
#: Fields a recipe holds only when given (the engine's default applies otherwise).
OPTIONAL_FIELDS: tuple[str, ...] = tuple(n for n, f in FIELDS.items() if f.optional)
for _rule in rules():  # the built-in rules, registered before this table existed
    check_fields(_rule)


def default(name: str, rule: str = "spectral") -> Any:
    """The default of setting ``name`` for ``rule``."""
    return FIELDS[name].default_for(rule)


def fill_defaults(group: dict) -> dict:
    """Set every setting ``group`` leaves out or at ``None`` to its rule's default (in place)."""
    rule = rule_named(group.get("rule")).name  # type: ignore[arg-type]
    for name, field in FIELDS.items():
        if group.get(name) is None:
            group[name] = field.default_for(rule)
    return group


def check_settings(settings: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Checked (normalised) values of the rule's settings in ``settings``, plus the checks
    across fields. Errors read ``"{where}, field 'name': ..."``."""
    rule = _checked("rule", settings.get("rule"), "", where)
    out: dict[str, Any] = {"rule": rule}
    for name in RULE_FIELDS[rule]:
        if name != "rule" and name in settings:
            out[name] = _checked(name, settings[name], rule, where)
    if out.get("lazy"):
        if out.get("center"):
            raise ValueError(
                f"{where}, field 'lazy': lazy=True cannot be combined with center=True (the quotient "
                "maps of LM heads and routers see dense gradients; the row mask is not shift-invariant)"
            )
    return out


def _checked(name: str, value: Any, rule: str, where: str) -> Any:
    try:
        return FIELDS[name].check(value, rule)
    except ValueError as err:
        raise ValueError(f"{where}, field {name!r}: {err}") from None


def fields_table() -> str:
    """The table as Markdown: each setting, the rules that read it, its default(s), meaning."""
    lines = ["| setting | rules | default | meaning |", "|---|---|---|---|"]
    for name, f in FIELDS.items():
        readers = "all" if f.rules == RULES else ", ".join(f.rules)
        doc = f.doc if name != "rule" else "; ".join(f"{r.name} ({r.doc})" if r.doc else r.name for r in rules())
        if any(name in rule_named(r).defaults for r in f.rules):
            values = [f.default_for(r) for r in f.rules]
            usual = max(values, key=values.count)
            others = [f"{r}: {f.default_for(r)!r}" for r in f.rules if f.default_for(r) != usual]
            shown = repr(usual) + (f" ({'; '.join(others)})" if others else "")
        else:
            shown = (
                "required in a recipe; 1e-3 by hand" if name == "lr" else ("-" if name == "rule" else repr(f.default))
            )
        lines.append(f"| `{name}` | {readers} | {shown}{' (optional)' if f.optional else ''} | {doc} |")
    return "\n".join(lines)
