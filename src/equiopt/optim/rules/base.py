"""The rule protocol and the registry of rules.

A rule is one module: a :class:`Rule` subclass that says which settings it reads, which
state it keeps, how its map acts on a batch of work matrices (one definition; the
materialised form is :func:`equiopt.maps.materialize` of the factored one), its row stage
if it has one, what it needs across shards, and its FLOPs. :func:`register` adds it;
everything else (the settings table, recipes, the step, the plan) asks the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from ... import maps

__all__ = [
    "Rule",
    "PeerRule",
    "register",
    "unregister",
    "registered",
    "rule_named",
    "rule_of",
    "RuleNames",
    "rules",
    "check_fields",
    "polar_flops",
    "LR_SCALES",
    "MOMENTUM_FIELDS",
]

#: Learning-rate shape factors of the polar-factor rules (:func:`~equiopt.optim.rules.lr_scale_factor`).
LR_SCALES: tuple[str, ...] = ("none", "spectral", "match_adamw")
#: The settings every rule with a momentum buffer reads.
MOMENTUM_FIELDS: tuple[str, ...] = ("beta", "nesterov", "nonfinite", "lazy")


class Rule:
    """One update rule. Subclasses set the class attributes and, for a matrix rule, :meth:`factored`.

    - ``name``: the ``rule`` setting that selects it.
    - ``kind``: ``"matrix"`` (maps the momentum's work matrices), ``"elementwise"`` (acts on
      the stored tensor), or ``"peer"`` (a torch optimizer steps the group).
    - ``fields``: the settings it reads beyond ``rule``, ``lr`` and ``weight_decay`` (names of
      :data:`equiopt.optim.fields.FIELDS`); ``defaults``: its own defaults where they differ
      from the table's; ``methods``: the inner solvers its ``method`` accepts.
    - ``state``: its full-size state entries (``("momentum_buffer",)``, or AdamW's moments).
    - ``polar``: its update is built on the polar factor, so the ``lr_scale`` shape factor
      applies (and centring does not); ``narrow``: its factored map may return the factor in
      the iteration's dtype (``narrow=True``); ``divisible``: DDP's ``divide_work`` may map it
      on one replica and share the result; ``complex``: it steps complex parameters as their
      real views; ``row_moments``: it keeps one second moment per work-matrix row and
      applies :meth:`row_stage` after its map; ``row_wise``: its map reads each row by
      itself (sums within rows only), so it also runs on a split of the columns, gains
      nothing from batching, and replicas gain nothing by dividing its sums.
    - ``sums``: what its map reads of ``D`` before anything else, which the momentum stage
      can sum as it writes ``D`` (then the map reads ``D`` once less): ``"rows"``, each work
      row's sum of squares (RowNormM's norms), ``"matrices"``, each work matrix's (the
      polar iteration's normalisation); its :meth:`factored` then takes ``sums``,
      ``(..., m, 1)`` or ``(..., 1, 1)``;
    - ``checks``: its :meth:`factored` takes ``finite``, an ``(N,)`` bool it sets to
      whether each of the ``N`` matrices' factor is free of NaN and Inf, known without
      reading the factor (Muon's quintic iterations see it in their small factors), so
      the guard reads no factor of the size of the bucket for it.
    """

    name: ClassVar[str]
    kind: ClassVar[str] = "matrix"
    fields: ClassVar[tuple[str, ...]] = ()
    defaults: ClassVar[Mapping[str, Any]] = {}
    methods: ClassVar[tuple[str, ...]] = ()
    lr_scales: ClassVar[tuple[str, ...]] = LR_SCALES
    state: ClassVar[tuple[str, ...]] = ("momentum_buffer",)
    polar: ClassVar[bool] = False
    narrow: ClassVar[bool] = False
    divisible: ClassVar[bool] = False
    complex: ClassVar[bool] = False
    row_moments: ClassVar[bool] = False
    row_wise: ClassVar[bool] = False
    sums: ClassVar[str | None] = None
    checks: ClassVar[bool] = False
    doc: ClassVar[str] = ""

    @property
    def adam(self) -> bool:
        """It keeps AdamW's two moments and step count (the AdamW stages step it)."""
        return "exp_avg_sq" in self.state

    def centres_in_place(self, group: Mapping[str, Any]) -> bool:
        """The step centres this group's momentum in place before the map (its ``center``
        setting on a rule that reads it and is not built on the polar factor)."""
        return bool(group.get("center")) and "center" in self.fields and not self.polar

    def sums_for(self, key: Any) -> str | None:
        """:attr:`sums` for the map of ``key`` (a rule whose first read depends on its settings says so here)."""
        return self.sums

    def factored(
        self,
        key: Any,
        eta: Any,
        D: torch.Tensor,
        *,
        reducer: maps.RowReducer | None,
        col_reducer: maps.RowReducer | None,
        narrow: bool,
        centred_input: bool,
    ) -> maps.Factored:
        """The map on a batch ``D`` of work matrices ``(..., m, n)`` in factored form.
        ``key``: the group's :class:`~equiopt.optim.rules.MapKey`; ``reducer`` /
        ``col_reducer``: sums across a split of the rows / columns (only where
        :meth:`reducible` said so); ``centred_input``: ``D`` already has zero column means."""
        raise NotImplementedError(f"rule {self.name!r} has no matrix map")

    def reducible(self, key: Any, rows: int, cols: int) -> bool:
        """Whether the map runs on a row-split ``rows x cols`` matrix with a
        :class:`~equiopt.maps.RowReducer`; otherwise sharded matrices are gathered whole."""
        return False

    def flops(self, key: Any, batch: int, m: int, n: int, gram_rows: int | None) -> int:
        """Matrix-product FLOPs of the map on ``batch`` work matrices of ``m x n``
        (``gram_rows``: the global row count when ``m`` is one shard of it); an estimate."""
        return 4 * batch * m * n

    def row_stage(self, x: torch.Tensor, second: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Row scales of the mapped ``x`` (``(N, m, n)``), updating the row moments ``second``
        (``(N, m, 1)``) in place with ``weight``; only where ``row_moments``."""
        raise NotImplementedError(f"rule {self.name!r} has no row stage")

    def row_moments_(
        self, mean_sq: torch.Tensor, second: torch.Tensor, weight: Any, eps: float, dtype: torch.dtype
    ) -> torch.Tensor:
        """The part of :meth:`row_stage` a row stage on sharded blocks shares: the row moments
        ``second`` updated in place from the rows' mean squares ``mean_sq`` (summed over
        every shard of the row), and the rows' scales in ``dtype`` before any rescaling."""
        raise NotImplementedError(f"rule {self.name!r} has no row stage")

    def __repr__(self) -> str:
        return f"<rule {self.name!r}>"


class PeerRule(Rule):
    """A rule that hands its param group to a torch optimizer (:mod:`equiopt.optim.peers`
    steps it): :meth:`build` makes the optimizer, :meth:`hyper` gives its settings from the
    group's (read every step), :meth:`step` steps it, :meth:`check_param` refuses by name a
    parameter it cannot step."""

    kind = "peer"

    def check_param(self, p: torch.Tensor, name: str, sharded: bool) -> None:
        return None

    def hyper(self, group: dict) -> dict[str, Any]:
        raise NotImplementedError

    def build(self, group: dict) -> torch.optim.Optimizer:
        raise NotImplementedError

    def step(self, inner: torch.optim.Optimizer, group: dict) -> None:
        inner.step()


_REGISTRY: dict[str, Rule] = {}


def register(rule: Rule) -> Rule:
    """Add ``rule`` to the registry (its name must be new); returns it."""
    if not isinstance(rule, Rule):
        raise TypeError(f"expected an equiopt.optim.rules.Rule, got {type(rule).__name__}")
    name = getattr(rule, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{type(rule).__name__}: a rule needs a non-empty name")
    if name in _REGISTRY:
        raise ValueError(f"a rule named {name!r} is registered already")
    if rule.kind not in ("matrix", "elementwise", "peer"):
        raise ValueError(f"rule {name!r}: kind must be matrix, elementwise or peer, got {rule.kind!r}")
    check_fields(rule)
    _REGISTRY[name] = rule
    return rule


def check_fields(rule: Rule) -> None:
    """Every setting ``rule`` reads or defaults is in the settings table (checked again for
    the built-in rules once the table exists, see :mod:`equiopt.optim.fields`)."""
    try:
        from ..fields import FIELDS
    except ImportError:  # the table is being made; it checks the registered rules at its end
        return
    unknown = [f for f in (*rule.fields, *rule.defaults) if f not in FIELDS]
    if unknown:
        raise ValueError(f"rule {rule.name!r} reads unknown settings {unknown}; valid: {', '.join(FIELDS)}")


def rules() -> tuple[Rule, ...]:
    """The registered rules, in registration order."""
    return tuple(_REGISTRY.values())


def unregister(name: str) -> None:
    """Remove the rule ``name`` (a rule registered for a while, see :func:`registered`)."""
    _REGISTRY.pop(name)


@contextmanager
def registered(rule: Rule) -> Iterator[Rule]:
    """``rule`` registered inside the block, removed after it."""
    register(rule)
    try:
        yield rule
    finally:
        unregister(rule.name)


def rule_named(name: str) -> Rule:
    """The registered rule ``name``; a clear error listing the valid names otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown rule {name!r}; valid: {', '.join(_REGISTRY)}") from None


def rule_of(group: Mapping[str, Any]) -> Rule:
    """The rule of a param group (or of a :class:`~equiopt.optim.rules.MapKey`'s ``rule``)."""
    return rule_named(group["rule"])


class RuleNames(Sequence[str]):
    """The names of the registered rules that satisfy ``keep``, in registration order, read
    at each use (so a rule registered later is in them)."""

    def __init__(self, keep: Callable[[Rule], bool]):
        self._keep = keep

    def _names(self) -> tuple[str, ...]:
        return tuple(n for n, r in _REGISTRY.items() if self._keep(r))

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        rule = _REGISTRY.get(name) if isinstance(name, str) else None
        return rule is not None and self._keep(rule)

    def __add__(self, other: Sequence[str]) -> tuple[str, ...]:
        return self._names() + tuple(other)

    def __radd__(self, other: Sequence[str]) -> tuple[str, ...]:
        return tuple(other) + self._names()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(other) == self._names()

    def __hash__(self) -> int:
        return hash(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


def polar_flops(key: Any, batch: int, m: int, n: int) -> int:
    """FLOPs of a polar factor of ``batch`` matrices ``m x n`` by ``key.method`` in ``key.steps``
    iterations: Polar Express three products per iteration; Gram Newton-Schulz the Grams
    and products with the iterate at each restart."""
    from ...linalg.polar import RESTART_EVERY

    s, steps = min(m, n), key.steps
    if key.method == "gram_newton_schulz":
        passes = 1 + (steps - 1) // RESTART_EVERY
        return batch * (4 * passes * m * n * s + steps * 8 * s**3)
    return batch * steps * (4 * m * n * s + 2 * s**3)
