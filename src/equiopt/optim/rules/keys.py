"""A group's map as a key: :class:`MapKey` (what a rule's map depends on), and the calls
the step makes through it: the map itself (:func:`factored_map`), whether it runs on a
row split (:func:`reducible`), the shape factor of the learning rate (:func:`shape_factor`)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ... import maps
from .base import LR_SCALES, RuleNames, rule_named


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
    ``lr_scale`` factor for the polar-factor rules (:attr:`Rule.polar`), 1 for every other rule."""
    if not rule_named(group["rule"]).polar:
        return 1.0
    return lr_scale_factor(group["lr_scale"], rows, cols)


class MapKey(NamedTuple):
    """Everything a matrix rule's map depends on (learning rate and decay excluded), so
    work matrices of different groups with equal keys and shapes share one batched call.
    ``eta`` is the rule's name, or the ``id`` of a callable."""

    rule: str
    order: str | None
    center: Any  # bool, or PRECENTRED
    eps: float
    alpha: float
    method: str
    steps: int
    eta: Any
    polar_dtype: torch.dtype | None
    scale: str
    damping: str
    gram_dtype: str = "auto"
    route: str = "auto"


def map_key(group: dict) -> MapKey:
    """The :class:`MapKey` of a group."""
    rule = group["rule"]
    eta = group["eta"]
    return MapKey(
        rule=rule,
        order=group["order"] if "order" in rule_named(rule).fields else None,
        center=bool(group["center"]),
        eps=float(group["eps"]),
        alpha=float(group["alpha"]),
        method=group["method"],
        steps=int(group["steps"]),
        eta=eta if isinstance(eta, str) else id(eta),
        polar_dtype=group.get("polar_dtype"),
        scale=group["scale"],
        damping=group.get("damping", "relative"),
        gram_dtype=group.get("gram_dtype") or "auto",
        route=group.get("route") or "auto",
    )


# The ``center`` entry of a map key whose work matrices the optimizer has already centred
# in place (their momentum is stored in the quotient, see EquivariantOptimizer).
PRECENTRED = "precentred"


#: The rules whose polar factor ``factored_map(..., narrow=True)`` may return in its
#: iteration's dtype (:attr:`Rule.narrow`): Muon's, and the direct route's of the one-sided maps and hybrids.
NARROW_RULES = RuleNames(lambda r: r.narrow)


def precentred(key: MapKey) -> MapKey:
    """``key`` for work matrices that already have zero column means: the map skips its
    input centring (no full-size copy) and keeps its output projection."""
    return key._replace(center=PRECENTRED)


def factored_map(
    key: MapKey,
    eta,
    D: torch.Tensor,
    reducer: maps.RowReducer | None = None,
    col_reducer: maps.RowReducer | None = None,
    narrow: bool = False,
    sums: torch.Tensor | None = None,
    finite: torch.Tensor | None = None,
) -> maps.Factored:
    """The map identified by ``key`` (see :func:`map_key`, :func:`precentred`) on a batch
    of work matrices, in factored form (:class:`equiopt.maps.Factored`), in the compute dtype
    (``narrow``: Muon's polar factor, and the direct route's of the one-sided and hybrid
    maps, in its iteration's dtype where that is narrower; the caller widens it as it scales
    it and checks it for non-finite values, see :func:`equiopt.linalg.polar`).

    ``reducer``: the :class:`~equiopt.maps.RowReducer` when ``D`` holds one shard of the
    rows (row-norm, and right-Gram one-sided and hybrid maps only; see :func:`reducible`);
    ``col_reducer``: the same for a split of the columns (row-norm only). ``sums``: the sums
    of squares the rule's map reads first (:attr:`Rule.sums`), where the step made them as
    it wrote ``D``. ``finite``: an ``(N,)`` bool set to whether each matrix's factor is free
    of NaN and Inf, by the map where it knows (:attr:`Rule.checks`), else from the factor."""
    rule = rule_named(key.rule)
    hints: dict = {} if sums is None else {"sums": sums}
    if finite is not None and rule.checks:
        hints["finite"] = finite
    f = rule.factored(
        key,
        eta,
        D,
        reducer=reducer,
        col_reducer=col_reducer,
        narrow=narrow,
        centred_input=key.center == PRECENTRED,
        **hints,
    )
    if finite is not None and not rule.checks:
        finite.copy_(factor_flags(f))
    return f


def factor_flags(f: maps.Factored) -> torch.Tensor:
    """``(N,)``: whether each of the ``N`` updates of ``f`` is free of NaN and Inf, read from
    its tensors (:func:`finite_flags_of`)."""
    return finite_flags_of([t for t in f if t is not None])


def finite_flags_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``(N,)``: whether each of the ``N`` matrices (leading dimensions flattened) is free of
    NaN and Inf in every one of ``tensors``: each matrix's sum carries any, and so does a sum
    of the sums (one pass over each tensor; sums in float32 or wider)."""
    total: Any = None
    for t in tensors:
        s = t.sum(dim=(-2, -1), dtype=torch.promote_types(t.dtype, torch.float32)).reshape(-1)
        total = s if total is None else total + s
    return (total - total) == 0


def reducible(key: MapKey, rows: int, cols: int) -> bool:
    """Whether the map of ``key`` on an ``rows x cols`` work matrix split by rows across
    ranks runs on the shards with a :class:`~equiopt.maps.RowReducer` (sums over rows
    only): row-norm always; one-sided and hybrid maps when they form the right
    (``cols x cols``) Gram with a damped inverse square root; the spectral map of a tall
    matrix (``rows >= cols``) with the Gram Newton-Schulz polar factor, whose iteration
    runs on the summed ``cols x cols`` Gram. Other spectral maps, left Grams, the
    one-sided maps' Gram Newton-Schulz and their ``route="direct"`` need the whole matrix
    (the engine gathers it to an owner rank). ``route="auto"`` is reducible: given a
    reducer, the map keeps the Gram route (:func:`equiopt.maps.one_sided_route`)."""
    return rule_named(key.rule).reducible(key, rows, cols)


def apply_map(key: MapKey, eta, D: torch.Tensor) -> torch.Tensor:
    """The map identified by ``key`` on a batch of work matrices, as one tensor of ``D``'s dtype."""
    return maps.materialize(factored_map(key, eta, D)).to(D.dtype)


def validate_group(group: dict, where: str) -> None:
    """Fill ``group``'s missing settings from the rule's defaults and check them in place:
    clear errors naming ``where`` and the setting for unknown names and out-of-range values
    (the checks of :data:`~equiopt.optim.fields.FIELDS`)."""
    from ..fields import RULE_FIELDS, check_settings, fill_defaults

    try:
        fill_defaults(group)
    except ValueError as err:
        raise ValueError(f"{where}, field 'rule': {err}") from None
    rule: str = group["rule"]
    if group["lazy"] is not False and "lazy" not in RULE_FIELDS[rule]:
        raise ValueError(
            f"{where}, field 'lazy': lazy=True needs a momentum rule (row, hybrid, right, left, "
            f"spectral, sgd), not {rule!r}"
        )
    group.update(check_settings(group, where))
