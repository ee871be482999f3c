"""Update rules of :class:`~equiopt.optim.EquivariantOptimizer` and their group defaults.

A matrix rule maps the (momentum) direction's work matrices ``D`` to an update ``U`` of
the same shape with one of the pure maps of :mod:`equiopt.maps`; the element-wise rules
(``adamw``, ``sgd``) act on the stored tensor directly.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch

from .. import maps
from ..linalg import POLAR_METHODS

MATRIX_RULES = ("spectral", "right", "left", "row", "hybrid")
ELEMENTWISE_RULES = ("adamw", "sgd")
RULES = MATRIX_RULES + ELEMENTWISE_RULES
LR_SCALES = ("none", "spectral", "match_adamw")
NONFINITE_POLICIES = ("skip", "raise")

# Defaults that depend on the rule; a group that leaves a key at None gets these.
RULE_DEFAULTS = {
    "spectral": {"scale": "nu", "nesterov": True, "lr_scale": "spectral", "alpha": 0.0},
    "right": {"scale": "nu", "nesterov": False, "lr_scale": "none", "alpha": 0.0},
    "left": {"scale": "nu", "nesterov": False, "lr_scale": "none", "alpha": 0.0},
    "row": {"scale": "nu", "nesterov": False, "lr_scale": "none", "alpha": 0.0},
    "hybrid": {"scale": "nu", "nesterov": False, "lr_scale": "none", "alpha": 1.0},
    "adamw": {"scale": "nu", "nesterov": False, "lr_scale": "none", "alpha": 0.0},
    "sgd": {"scale": "nu", "nesterov": False, "lr_scale": "none", "alpha": 0.0},
}


def resolved(group: dict, key: str):
    """A group's value for ``key``, falling back to the rule's default when it is None."""
    value = group.get(key)
    return RULE_DEFAULTS[group["rule"]][key] if value is None else value


def lr_scale_factor(kind: str, rows: int, cols: int) -> float:
    """Shape-dependent learning-rate factor for the spectral rule.

    ``"spectral"``: ``sqrt(max(1, rows / cols))`` (K. Jordan's Muon: keeps the RMS-to-RMS
    operator norm of the update constant); ``"match_adamw"``: ``0.2 sqrt(max(rows, cols))``
    (Moonlight's scaling, to reuse AdamW's learning rate and weight decay); ``"none"``: 1.
    """
    if kind == "none":
        return 1.0
    if kind == "spectral":
        return math.sqrt(max(1.0, rows / cols))
    if kind == "match_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown lr_scale {kind!r}; valid: {', '.join(LR_SCALES)}")


def shape_factor(group: dict, rows: int, cols: int) -> float:
    """The group's learning-rate factor for a work matrix of ``rows x cols``: the
    ``lr_scale`` factor for the spectral rule, 1 for every other rule."""
    if group["rule"] != "spectral":
        return 1.0
    return lr_scale_factor(resolved(group, "lr_scale"), rows, cols)


class MapKey(NamedTuple):
    """Everything a matrix rule's map depends on (learning rate and decay excluded), so
    work matrices of different groups with equal keys and shapes share one batched call.
    ``eta`` is the rule's name, or the ``id`` of a callable."""

    rule: str
    order: Optional[str]
    center: Any  # bool, or PRECENTRED
    eps: float
    alpha: float
    method: str
    steps: int
    eta: Any
    polar_dtype: Optional[torch.dtype]
    scale: str
    damping: str


def map_key(group: dict) -> MapKey:
    """The :class:`MapKey` of a group."""
    rule = group["rule"]
    eta = group["eta"]
    return MapKey(
        rule=rule,
        order=group["order"] if rule == "hybrid" else None,
        center=bool(group["center"]),
        eps=float(group["eps"]),
        alpha=float(resolved(group, "alpha")),
        method=group["method"],
        steps=int(group["steps"]),
        eta=eta if isinstance(eta, str) else id(eta),
        polar_dtype=group.get("polar_dtype"),
        scale=resolved(group, "scale"),
        damping=group.get("damping", "relative"),
    )


# The ``center`` entry of a map key whose work matrices the optimizer has already centred
# in place (their momentum is stored in the quotient, see EquivariantOptimizer).
PRECENTRED = "precentred"


def precentred(key: MapKey) -> MapKey:
    """``key`` for work matrices that already have zero column means: the map skips its
    input centring (no full-size copy) and keeps its output projection."""
    return key._replace(center=PRECENTRED)


def factored_map(key: MapKey, eta, D: torch.Tensor, reducer: maps.RowReducer | None = None,
                 col_reducer: maps.RowReducer | None = None) -> maps.Factored:
    """The map identified by ``key`` (see :func:`map_key`, :func:`precentred`) on a batch
    of work matrices, in factored form (:class:`equiopt.maps.Factored`), in the compute dtype.

    ``reducer``: the :class:`~equiopt.maps.RowReducer` when ``D`` holds one shard of the
    rows (row-norm, and right-Gram one-sided and hybrid maps only; see :func:`reducible`);
    ``col_reducer``: the same for a split of the columns (row-norm only)."""
    rule, order, center, eps, alpha, method, steps, _, polar_dtype, scale, damping = key
    done = center == PRECENTRED
    center = bool(center)
    if rule == "spectral":
        if reducer is not None:
            raise ValueError("the spectral map needs the whole matrix; gather a row-sharded one first")
        return maps.Factored(maps.spectral(D, method=method, steps=steps, dtype=polar_dtype))
    if rule in ("right", "left"):
        return maps.one_sided_factored(D, eps=eps, alpha=alpha, center=center, method=method, steps=steps,
                                       scale=scale, reducer=reducer, centred_input=done, damping=damping)
    if col_reducer is not None and rule != "row":
        raise ValueError(f"the {rule!r} map needs whole rows; gather a column-split work matrix first")
    if rule == "row":
        return maps.row_norm_factored(D, eps=eps, center=center, eta=eta, reducer=reducer, centred_input=done,
                                      col_reducer=col_reducer)
    return maps.hybrid_factored(D, order=order, eps=eps, alpha=alpha, center=center, method=method, steps=steps, eta=eta,
                                scale=scale, reducer=reducer, centred_input=done, damping=damping)


def reducible(key: MapKey, rows: int, cols: int) -> bool:
    """Whether the map of ``key`` on an ``rows x cols`` work matrix split by rows across
    ranks runs on the shards with a :class:`~equiopt.maps.RowReducer` (sums over rows
    only): row-norm always; one-sided and hybrid maps when they form the right
    (``cols x cols``) Gram with a damped inverse square root. Spectral maps, left Grams
    and the Gram Newton-Schulz polar factor need the whole matrix."""
    rule, method = key.rule, key.method
    if rule == "row":
        return True
    if rule in ("right", "left", "hybrid"):
        return method != "gram_newton_schulz" and maps.gram_side(rows, cols) == "right"
    return False


def apply_map(key: MapKey, eta, D: torch.Tensor) -> torch.Tensor:
    """The map identified by ``key`` on a batch of work matrices, as one tensor of ``D``'s dtype."""
    return maps.materialize(factored_map(key, eta, D)).to(D.dtype)


def validate_group(group: dict, where: str) -> None:
    """Clear errors for unknown names and out-of-range values (``where`` names the group)."""
    rule = group.get("rule")
    if rule not in RULES:
        raise ValueError(f"{where}: unknown rule {rule!r}; valid: {', '.join(RULES)}")
    if rule in MATRIX_RULES and rule != "row":
        valid = POLAR_METHODS if rule == "spectral" else maps.ONE_SIDED_METHODS
        if group["method"] not in valid:
            raise ValueError(f"{where}: unknown method {group['method']!r} for rule {rule!r}; valid: {', '.join(valid)}")
    if rule == "hybrid" and group["order"] not in maps.HYBRID_ORDERS:
        raise ValueError(f"{where}: unknown hybrid order {group['order']!r}; valid: {', '.join(maps.HYBRID_ORDERS)}")
    if not callable(group["eta"]) and group["eta"] not in maps.ETA_RULES:
        raise ValueError(f"{where}: unknown eta {group['eta']!r}; valid: {', '.join(maps.ETA_RULES)} or a callable")
    if resolved(group, "lr_scale") not in LR_SCALES:
        raise ValueError(f"{where}: unknown lr_scale {group['lr_scale']!r}; valid: {', '.join(LR_SCALES)}")
    if group.get("damping", "relative") not in maps.DAMPINGS:
        raise ValueError(f"{where}: unknown damping {group['damping']!r}; valid: {', '.join(maps.DAMPINGS)}")
    if resolved(group, "scale") not in maps.SCALES:
        raise ValueError(f"{where}: unknown scale {group['scale']!r}; valid: {', '.join(maps.SCALES)}")
    if group["nonfinite"] not in NONFINITE_POLICIES:
        raise ValueError(f"{where}: unknown nonfinite policy {group['nonfinite']!r}; valid: {', '.join(NONFINITE_POLICIES)}")
    if not isinstance(group["lazy"], bool):
        raise ValueError(f"{where}: lazy must be True or False, got {group['lazy']!r}")
    if group["lazy"]:
        if rule == "adamw":
            raise ValueError(f"{where}: lazy=True needs a momentum rule (row, hybrid, right, left, spectral, sgd), "
                             "not 'adamw'")
        if group["center"]:
            raise ValueError(f"{where}: lazy=True cannot be combined with center=True (the quotient maps of LM "
                             "heads and routers see dense gradients; the row mask is not shift-invariant)")
    checks = [
        ("lr", group["lr"] >= 0, ">= 0"),
        ("beta", 0 <= group["beta"] < 1, "in [0, 1)"),
        ("eps", group["eps"] > 0, "> 0"),
        ("weight_decay", group["weight_decay"] >= 0, ">= 0"),
        ("steps", int(group["steps"]) >= 1, ">= 1"),
        ("alpha", 0 <= resolved(group, "alpha") <= 1, "in [0, 1]"),
        ("adam_eps", group["adam_eps"] > 0, "> 0"),
    ]
    b1, b2 = group["betas"]
    checks.append(("betas", 0 <= b1 < 1 and 0 <= b2 < 1, "a pair in [0, 1)"))
    for name, ok, what in checks:
        if not ok:
            raise ValueError(f"{where}: {name} must be {what}, got {group[name]!r}")
