"""What :func:`~equiopt.roles.verify_roles` returns: one :class:`RoleCheck` a check, the
:class:`RoleReport` that lists them (with its text table), the check kinds, and the
default tolerances by model dtype."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..table import columns
from .paths import _compress

CHECK_KINDS = ("neuron", "expert", "shift", "vocab", "conv")

#: default ``(rtol, atol)`` per model dtype (see the module docstring)
DEFAULT_TOLERANCES = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (1e-4, 1e-6),
    torch.float16: (5e-3, 1e-4),
    torch.bfloat16: (3e-2, 1e-3),
}


@dataclass(frozen=True)
class RoleCheck:
    """One symmetry check: which parameters were moved and how much the output changed.

    ``max_change`` is the largest absolute change of a log-probability (for ``vocab``
    after undoing the output permutation); ``detail`` says what was moved and notes
    anything left unchanged.

    Args:
        kind: the check (one of :data:`CHECK_KINDS`).
        names: the parameters moved together.
        max_change: the largest absolute change of a log-probability.
        tolerance: the largest change that passes.
        passed: ``max_change <= tolerance``.
        detail: what was moved, and anything left unchanged.
    """

    kind: str
    names: tuple[str, ...]
    max_change: float
    tolerance: float
    passed: bool
    detail: str = ""

    @property
    def where(self) -> str:
        """The parameter names with their common module prefix factored out."""
        return _compress(self.names)


class RoleReport(list):
    """A list of :class:`RoleCheck` with ``.ok``, ``.failures`` and a text table.

    Also ``dtype`` (the model's), ``input_shape``, ``scale`` (largest absolute centred
    logit of the model, the spread tolerances are relative to) and ``notes`` (filled
    zero parameters, roles without a check).

    Args:
        checks: the checks run.
        dtype: the model's dtype.
        input_shape: the shape of the token ids the model ran on.
        scale: the largest absolute centred logit of the model.
        notes: remarks printed under the table.
    """

    def __init__(
        self,
        checks: Sequence[RoleCheck] = (),
        dtype: torch.dtype | None = None,
        input_shape: tuple[int, ...] | None = None,
        scale: float | None = None,
        notes: Sequence[str] = (),
    ):
        super().__init__(checks)
        self.dtype = dtype
        self.input_shape = input_shape
        self.scale = scale
        self.notes = list(notes)

    @property
    def ok(self) -> bool:
        return all(c.passed for c in self)

    @property
    def failures(self) -> list[RoleCheck]:
        return [c for c in self if not c.passed]

    def kinds(self) -> set[str]:
        """The kinds of check the report holds.

        Returns:
            A set of :data:`CHECK_KINDS` entries.
        """
        return {c.kind for c in self}

    def format(self, details: bool = True) -> str:
        """The report as a text table: kind, result, largest change, tolerance, parameters.

        Args:
            details: add each failed (or compound) check's detail line.

        Returns:
            The table, with a summary line first and the notes last.
        """
        dtype = str(self.dtype).replace("torch.", "") if self.dtype is not None else "?"
        shape = "x".join(map(str, self.input_shape)) if self.input_shape else "?"
        n_fail = len(self.failures)
        head = f"role symmetry checks ({dtype}, input {shape}): {len(self)} checks, "
        head += "all passed" if n_fail == 0 else f"{n_fail} FAILED"
        header = ["kind", "result", "max change", "tolerance", "parameters"]
        lines = [
            [c.kind, "ok" if c.passed else "FAIL", f"{c.max_change:.2e}", f"{c.tolerance:.2e}", c.where] for c in self
        ]
        table = columns(header, lines)
        out = [head, *table[:2]]
        for c, line in zip(self, table[2:]):
            out.append(line)
            if details and c.detail and (not c.passed or ";" in c.detail):
                out.append("    " + c.detail)
        out.extend(f"note: {n}" for n in self.notes)
        return "\n".join(out)

    def __str__(self) -> str:
        return self.format()

    __repr__ = list.__repr__
