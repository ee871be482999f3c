"""Role rows and tables: what each parameter of a model is, and which work matrices it has."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..layouts import Layout

ROLES = ("embedding", "lm_head", "attention", "mlp_in", "mlp_out", "router", "matrix", "vector")


@dataclass(frozen=True)
class RoleRow:
    """One trainable parameter: its ``role``, its ``layout`` (None for vectors) and why.

    Args:
        name: the name ``model.named_parameters()`` gives it.
        shape: its (global) shape.
        role: one of :data:`ROLES`.
        layout: how its tensor becomes work matrices (see :mod:`equiopt.layouts`); None
            for element-wise roles.
        reason: why it got this role, in words.
        param: the parameter itself.
        source: where the role came from: ``"dataflow"`` (what the parameter does in the
            model's forward), ``"name"`` (module structure, names, shapes and config) or
            ``"rule"`` (an explicit ``rules=`` entry).
    """

    name: str
    shape: tuple[int, ...]
    role: str
    layout: Layout | None
    reason: str
    param: torch.nn.Parameter = field(repr=False, compare=False)
    source: str = field(default="name", compare=False)

    @property
    def work_shapes(self) -> list[tuple[int, ...]]:
        if self.layout is None:
            return [self.shape]
        return self.layout.work_shapes(self.shape, self.name)


class RoleTable(list):
    """A list of :class:`RoleRow` with model-level notes (tied embeddings, ...).

    Args:
        rows (Iterable[RoleRow]): the rows.
        tied_embeddings: the model ties its input embedding and LM head.
        notes: model-level remarks, printed under the table.
    """

    def __init__(self, rows=(), tied_embeddings: bool = False, notes: list[str] | None = None):
        super().__init__(rows)
        self.tied_embeddings = tied_embeddings
        self.notes = list(notes or [])

    def by_role(self) -> dict[str, list[RoleRow]]:
        """The rows grouped by role.

        Returns:
            ``{role: rows}`` for every role of :data:`ROLES` (empty lists included).
        """
        out: dict[str, list[RoleRow]] = {role: [] for role in ROLES}
        for row in self:
            out[row.role].append(row)
        return out

    def row(self, name: str) -> RoleRow:
        """The row of one parameter.

        Args:
            name: the parameter's name, as ``model.named_parameters()`` gives it.

        Returns:
            Its row.

        Raises:
            KeyError: when no trainable parameter has that name.
        """
        for r in self:
            if r.name == name:
                return r
        raise KeyError(f"no trainable parameter named {name!r}")

    def format(self, recipe: Any = None, reasons: bool = True) -> str:
        """Text table: name, shape, role, work shapes (and rule, lr from ``recipe``).

        Args:
            recipe: a :class:`~equiopt.recipes.Recipe` whose rule and lr are shown per
                parameter; None leaves them out.
            reasons: show why each parameter got its role.

        Returns:
            The table, with a count of parameters per role and the notes.
        """
        header = ["name", "shape", "role", "work"]
        if recipe is not None:
            header += ["rule", "lr"]
        if reasons:
            header += ["from", "reason"]
        lines = []
        for r in self:
            work = " + ".join("x".join(map(str, s)) for s in _merge(r.work_shapes))
            cells = [r.name, "x".join(map(str, r.shape)), r.role, work]
            if recipe is not None:
                settings = recipe.settings(r.role)
                rule = settings["rule"]
                if rule == "hybrid":
                    rule += f"({settings['order']})"
                if settings.get("center"):
                    rule += " centred"
                cells += [rule, f"{settings['lr']:g}"]
            if reasons:
                cells += [r.source, r.reason]
            lines.append(cells)
        out = columns(header, lines)
        counts = {role: sum(r.param.numel() for r in rows) for role, rows in self.by_role().items() if rows}
        out.append("")
        out.append("parameters by role: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))
        if self.tied_embeddings:
            out.append(
                "note: input and output embeddings are tied (one parameter, role 'embedding'); the paper unties them"
            )
        out.extend(f"note: {n}" for n in self.notes)
        return "\n".join(out)

    def __str__(self) -> str:
        return self.format()


def _merge(shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Collapse repeated identical work shapes for display: [(8,64),(8,64)] -> [(2,8,64)]."""
    if len(shapes) > 1 and all(s == shapes[0] for s in shapes):
        return [(len(shapes), *shapes[0])]
    return shapes


def columns(header: list[str], rows: list[list]) -> list[str]:
    """A text table: the header, a rule of dashes, then one line a row, columns aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(c) for c in rows]
