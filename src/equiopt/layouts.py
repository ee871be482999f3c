"""Invertible views between a stored parameter tensor and its work matrices.

An update map acts on *work matrices* of shape ``(..., rows, cols)`` whose rows are
the parameter's symmetry axis (vocabulary rows, intermediate neurons, experts, the
rows of one attention head). A :class:`Layout` turns a stored tensor (a weight, its
gradient, momentum or an update of the same shape) into its work matrices and back::

    work = layout.to_work(t)          # Tensor, or list of Tensors for multi-block layouts
    t2 = layout.from_work(work)       # bitwise equal to t: same shape, dtype and values

Both directions only reshape, transpose, split, concatenate or index: no arithmetic,
so the round trip is exact for every dtype (NaN payloads and signed zeros included).
Views are returned where the memory layout allows it, so treat work tensors as
read-only unless you know they are copies.

Every layout reads the *last* dimensions of the stored tensor and carries any extra
leading dimensions through unchanged; :meth:`Layout.check` only accepts exactly
``layout.ndim`` dimensions, and :class:`Experts` adds one leading batch axis.
Layouts compose: :class:`Experts` wraps any layout, :class:`Fused` gives each
concatenated block its own layout, and :class:`Compose` applies one layout to every
work matrix of another.

Orientation summary (stored shape -> work shapes; ``...`` are extra leading dims):

=============================  ===================  =================================
layout                         stored               work
=============================  ===================  =================================
``Row()``                      ``(m, n)``           ``(m, n)`` (the tensor itself)
``Col()``                      ``(n, m)``           ``(m, n)`` (transpose view)
``Heads(hd)``                  ``(H*hd, n)``        ``(H, hd, n)``, ``w[h] = t[h*hd:(h+1)*hd]``
``Heads(hd, "cols")``          ``(m, H*hd)``        ``(H, hd, m)``, ``w[h] = t[:, h*hd:(h+1)*hd].T``
``GateUp(mode)``               ``(2*f, d)``         ``(2, f, d)``, ``w[0]`` gate, ``w[1]`` up
``GateUp(mode, split=False)``  ``(2*f, d)``         ``(f, 2*d)``, row i = ``[gate_i, up_i]``
``GateUp(mode, axis=1)``       ``(d, 2*f)``         as above (rows are still the f neurons)
``Experts(inner)``             ``(E, *s)``          ``(E, *w)`` for each inner work ``w``
``Flatten(k)``                 ``(m, c, *k)``       ``(m, c*prod(k))`` (a convolution weight)
``Flatten(k, groups=g)``       ``(m, c, *k)``       ``(g, m/g, c*prod(k))``, one block per group
``Fused(sizes, parts, 0)``     ``(sum(sizes), n)``  part i's work of ``t[o_i:o_i+s_i]``
``Fused(sizes, parts, 1)``     ``(m, sum(sizes))``  part i's work of ``t[:, o_i:o_i+s_i]``
``Compose(outer, inner)``      outer's stored       inner's work of every outer work
=============================  ===================  =================================

``GateUp`` modes: ``"concat"`` stores ``[gate; up]`` (all gate rows, then all up
rows), ``"interleave"`` stores ``g0, u0, g1, u1, ...``; with ``axis=1`` the same
holds along the columns.

:func:`parse_layout` builds layouts from short strings for config files and every
layout's :attr:`Layout.spec` parses back to an equal layout. :func:`stack_by_shape`
batches same-shaped work matrices from many parameters into one tensor per shape.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "Layout",
    "Row",
    "Col",
    "Heads",
    "GateUp",
    "Fused",
    "Experts",
    "Flatten",
    "Unflatten",
    "Compose",
    "parse_layout",
    "stack_by_shape",
    "Unstack",
    "SPEC_FORMS",
]

Shape = tuple[int, ...]


def _shape(shape) -> Shape:
    return tuple(int(s) for s in shape)


def _axis(axis, valid=(0, 1)) -> int:
    """Normalise an axis given as 0/1, -2/-1 or "rows"/"cols" to 0 (rows) or 1 (cols)."""
    table = {0: 0, -2: 0, "rows": 0, "row": 0, 1: 1, -1: 1, "cols": 1, "col": 1}
    if isinstance(axis, bool) or axis not in table:
        raise ValueError(f"axis must be 0 / 'rows' or 1 / 'cols', got {axis!r}")
    return table[axis]


def _positive_int(value, what: str) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        number = 0
    if isinstance(value, bool) or number < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return number


class Layout:
    """Base class: an invertible view from a stored tensor to its work matrices.

    Subclasses are frozen dataclasses (immutable, hashable, equal by value) and
    implement the private hooks below on the last ``ndim`` dimensions of a tensor,
    keeping any extra leading dimensions:

    - ``_problem(shape)``: why the trailing dims do not fit, or ``None``;
    - ``_to_work(t)``: list of ``num_blocks`` work tensors;
    - ``_from_work(work)``: the inverse;
    - ``_work_shapes(shape)`` and ``_stored_shape(shapes)``: the same on shapes.
    """

    #: number of trailing stored dimensions the layout reads.
    ndim: int = 2

    # -- public API ---------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Number of work tensors; ``to_work`` returns a list exactly when this is > 1."""
        return 1

    @property
    def spec(self) -> str:
        """Short string that :func:`parse_layout` turns back into an equal layout."""
        raise NotImplementedError

    def check(self, shape, name: str = "parameter") -> None:
        """Raise a ValueError naming ``name``, the layout and ``shape`` if they do not fit."""
        shape = _shape(shape)
        if len(shape) != self.ndim:
            hint = ""
            if len(shape) == self.ndim + 1:
                hint = f"; for a leading expert axis use Experts({self!r})"
            reason = f"expects a {self.ndim}-D tensor, got {len(shape)}-D{hint}"
        else:
            reason = self._problem(shape)
        if reason is not None:
            raise ValueError(f"{name}: layout {self!r} does not fit shape {shape}: {reason}")

    def to_work(self, t: Tensor, *, name: str = "parameter") -> Tensor | list[Tensor]:
        """Work view(s) of ``t``: a Tensor if ``num_blocks == 1``, else a list."""
        work = self.to_work_list(t, name=name)
        return work[0] if len(work) == 1 else work

    def to_work_list(self, t: Tensor, *, name: str = "parameter") -> list[Tensor]:
        """Like :meth:`to_work` but always a list of ``num_blocks`` tensors."""
        self.check(t.shape, name)
        return self._to_work(t)

    def from_work(self, work: Tensor | Sequence[Tensor]) -> Tensor:
        """Exact inverse of :meth:`to_work`; accepts a Tensor or a list of Tensors.

        Work tensors may be non-contiguous (e.g. outputs of a map); only their shapes
        must match what :meth:`to_work` produced.
        """
        work = [work] if isinstance(work, Tensor) else list(work)
        shapes = [_shape(w.shape) for w in work]
        self._check_work(shapes)
        if len({(w.dtype, w.device) for w in work}) > 1:
            raise ValueError(f"layout {self!r}: work tensors differ in dtype or device")
        return self._from_work(work)

    def from_work_list(self, work: Sequence[Tensor]) -> Tensor:
        """Inverse of :meth:`to_work_list` (same as :meth:`from_work`)."""
        return self.from_work(work)

    def stacked_to_work(self, t: Tensor) -> list[Tensor]:
        """:meth:`to_work_list` of a stack ``t`` of ``(B, *stored)`` tensors, each checked
        when the stack was made: work tensors ``(B, *work)``, views where the memory allows."""
        return self._to_work(t)

    def stacked_from_work(self, work: Sequence[Tensor]) -> Tensor:
        """Inverse of :meth:`stacked_to_work`: ``(B, *stored)`` from work tensors ``(B, *work)``."""
        return self._from_work(list(work))

    def work_shapes(self, shape, name: str = "parameter") -> list[Shape]:
        """Shapes of the tensors ``to_work`` produces for a stored tensor of ``shape``."""
        shape = _shape(shape)
        self.check(shape, name)
        return self._work_shapes(shape)

    def stored_shape(self, work_shapes: Sequence) -> Shape:
        """Stored shape whose work has ``work_shapes`` (inverse of :meth:`work_shapes`)."""
        shapes = [_shape(s) for s in work_shapes]
        return self._check_work(shapes)

    def segments(self, shape) -> tuple[int, int] | None:
        """How the entries of a stored tensor of ``shape``, in storage order, fall into its
        work matrices where that is periodic: ``(run, count)``, entry ``e`` lies in work
        matrix ``(e // run) % count`` (runs of ``run`` entries, cycling over ``count``
        matrices); None where the layout does not split its entries that way."""
        return None

    # -- helpers --------------------------------------------------------------------
    def _check_work(self, shapes: list[Shape]) -> Shape:
        problem = None
        if len(shapes) != self.num_blocks:
            problem = f"expected {self.num_blocks} work tensor(s), got {len(shapes)}"
        else:
            try:
                stored = self._stored_shape(shapes)
            except (IndexError, ValueError, ZeroDivisionError):
                stored = None
            if (
                stored is None
                or len(stored) != self.ndim
                or self._problem(stored) is not None
                or self._work_shapes(stored) != shapes
            ):
                problem = "shapes are not the work of any stored tensor"
        if problem is not None:
            raise ValueError(f"layout {self!r}: work shapes {shapes}: {problem}")
        return stored

    def _problem(self, shape: Shape) -> str | None:
        return None

    def _to_work(self, t: Tensor) -> list[Tensor]:
        raise NotImplementedError

    def _from_work(self, work: list[Tensor]) -> Tensor:
        raise NotImplementedError

    def _work_shapes(self, shape: Shape) -> list[Shape]:
        raise NotImplementedError

    def _stored_shape(self, shapes: list[Shape]) -> Shape:
        raise NotImplementedError


def _sub_spec(layout: Layout) -> str:
    """Spec of a nested layout, parenthesised when it contains a separator."""
    s = layout.spec
    return f"({s})" if (_split_top(s, ">")[1:] or _split_top(s, "/")[1:]) else s


@dataclass(frozen=True, repr=False)
class Row(Layout):
    """Stored ``(m, n)`` is its own work matrix ``(m, n)``: rows are the stored rows."""

    def __repr__(self) -> str:
        return "Row()"

    @property
    def spec(self) -> str:
        return "row"

    def _to_work(self, t):
        return [t]

    def _from_work(self, work):
        return work[0]

    def segments(self, shape):
        return (math.prod(shape), 1)

    def _work_shapes(self, shape):
        return [shape]

    def _stored_shape(self, shapes):
        return shapes[0]


@dataclass(frozen=True, repr=False)
class Col(Layout):
    """Stored ``(n, m)`` -> work ``(m, n)``, the transpose (a view): rows are stored columns.

    E.g. a SwiGLU down projection ``(d, d_ff)`` gives work ``(d_ff, d)``, one row per
    neuron; Conv1D-style ``(in, out)`` storage gives ``(out, in)``.
    """

    def __repr__(self) -> str:
        return "Col()"

    @property
    def spec(self) -> str:
        return "col"

    def _to_work(self, t):
        return [t.transpose(-2, -1)]

    def segments(self, shape):
        return (math.prod(shape), 1)

    def _from_work(self, work):
        return work[0].transpose(-2, -1)

    def _work_shapes(self, shape):
        return [shape[:-2] + (shape[-1], shape[-2])]

    def _stored_shape(self, shapes):
        s = shapes[0]
        return s[:-2] + (s[-1], s[-2])


@dataclass(frozen=True, repr=False)
class Heads(Layout):
    """One work matrix per attention head, batched on a leading head axis.

    ``axis="rows"`` (q/k/v projections): stored ``(H*hd, n)`` -> work ``(H, hd, n)``
    with ``work[h] = t[h*hd:(h+1)*hd, :]`` (a view).

    ``axis="cols"`` (o projection): stored ``(m, H*hd)`` -> work ``(H, hd, m)`` with
    ``work[h] = t[:, h*hd:(h+1)*hd].T``: the rows of each work matrix are the head's
    ``hd`` input columns, the same orientation as the q/k/v heads.
    """

    head_dim: int
    axis: str = "rows"

    def __post_init__(self):
        object.__setattr__(self, "head_dim", _positive_int(self.head_dim, "Heads head_dim"))
        object.__setattr__(self, "axis", ("rows", "cols")[_axis(self.axis)])

    def __repr__(self) -> str:
        return f"Heads({self.head_dim})" if self.axis == "rows" else f"Heads({self.head_dim}, axis='cols')"

    @property
    def spec(self) -> str:
        return f"heads:{self.head_dim}" if self.axis == "rows" else f"heads_cols:{self.head_dim}"

    def _problem(self, shape):
        size = shape[-2] if self.axis == "rows" else shape[-1]
        if size % self.head_dim:
            where = "row" if self.axis == "rows" else "column"
            return f"{where} count {size} is not divisible by head_dim {self.head_dim}"
        return None

    def segments(self, shape):
        hd = self.head_dim
        if self.axis == "rows":  # each head a run of its rows
            return (math.prod(shape) // (shape[-2] // hd), shape[-2] // hd)
        if len(shape) != 2:
            return None
        return (hd, shape[-1] // hd)  # each row's columns: a run per head, in turn

    def _to_work(self, t):
        hd = self.head_dim
        if self.axis == "rows":
            return [t.unflatten(-2, (t.shape[-2] // hd, hd))]
        return [t.unflatten(-1, (t.shape[-1] // hd, hd)).movedim(-3, -1)]

    def _from_work(self, work):
        w = work[0]
        if self.axis == "rows":
            return w.flatten(-3, -2)
        return w.movedim(-1, -3).flatten(-2, -1)

    def _work_shapes(self, shape):
        hd = self.head_dim
        if self.axis == "rows":
            return [shape[:-2] + (shape[-2] // hd, hd, shape[-1])]
        return [shape[:-2] + (shape[-1] // hd, hd, shape[-2])]

    def _stored_shape(self, shapes):
        s = shapes[0]
        if self.axis == "rows":
            return s[:-3] + (s[-3] * s[-2], s[-1])
        return s[:-3] + (s[-1], s[-3] * s[-2])


_GATE_UP_MODES = ("concat", "interleave")


@dataclass(frozen=True, repr=False)
class GateUp(Layout):
    """A fused SwiGLU gate/up projection; work rows are the ``f`` intermediate neurons.

    Stored ``(2*f, d)`` (``axis=0``) or ``(d, 2*f)`` (``axis=1``, gate/up along the
    columns, e.g. transposed or gpt-oss ``(E, d, 2*f)`` storage). ``mode="concat"``:
    gate is the first half, up the second; ``mode="interleave"``: gate at even and
    up at odd positions.

    ``split=True``: work ``(2, f, d)``, ``work[0]`` the gate matrix and ``work[1]`` the
    up matrix, each ``(f, d)`` with one row per neuron.
    ``split=False``: work ``(f, 2*d)`` whose row ``i`` is ``[gate_i, up_i]``, so a
    neuron's two rows are treated as one row.
    """

    mode: str = "concat"
    split: bool = True
    axis: int = 0

    def __post_init__(self):
        if self.mode not in _GATE_UP_MODES:
            raise ValueError(f"GateUp mode must be one of {_GATE_UP_MODES}, got {self.mode!r}")
        if not isinstance(self.split, bool):
            raise ValueError(f"GateUp split must be a bool, got {self.split!r}")
        object.__setattr__(self, "axis", _axis(self.axis))

    def __repr__(self) -> str:
        args = [repr(self.mode)]
        if not self.split:
            args.append("split=False")
        if self.axis:
            args.append("axis=1")
        return f"GateUp({', '.join(args)})"

    @property
    def spec(self) -> str:
        return "gate_up:" + self.mode + (":cols" if self.axis else "") + ("" if self.split else ":paired")

    def _problem(self, shape):
        size = shape[-2 + self.axis]
        if size % 2:
            where = "column" if self.axis else "row"
            return f"gate/up {where} count {size} is odd"
        return None

    def _to_work(self, t):
        if self.axis:
            t = t.transpose(-2, -1)
        f = t.shape[-2] // 2
        if self.mode == "concat":
            w = t.unflatten(-2, (2, f))  # (..., 2, f, d)
            return [w if self.split else w.movedim(-3, -2).flatten(-2, -1)]
        if self.split:
            return [t.unflatten(-2, (f, 2)).transpose(-3, -2)]
        return [t.unflatten(-2, (f, 2)).flatten(-2, -1)]  # (..., f, 2*d), a view

    def _from_work(self, work):
        w = work[0]
        if self.split:
            pairs = w if self.mode == "concat" else w.transpose(-3, -2)
        else:
            pairs = w.unflatten(-1, (2, w.shape[-1] // 2))  # (..., f, 2, d)
            if self.mode == "concat":
                pairs = pairs.movedim(-2, -3)
        t = pairs.flatten(-3, -2)
        return t.transpose(-2, -1) if self.axis else t

    def _work_shapes(self, shape):
        lead = shape[:-2]
        f2, d = (shape[-1], shape[-2]) if self.axis else (shape[-2], shape[-1])
        if self.split:
            return [lead + (2, f2 // 2, d)]
        return [lead + (f2 // 2, 2 * d)]

    def _stored_shape(self, shapes):
        s = shapes[0]
        if self.split:
            lead, f2, d = s[:-3], 2 * s[-2], s[-1]
        else:
            lead, f2, d = s[:-2], 2 * s[-2], s[-1] // 2
        return lead + ((d, f2) if self.axis else (f2, d))


@dataclass(frozen=True, repr=False)
class Experts(Layout):
    """A leading expert axis: stored ``(E, *s)`` -> the inner work with a leading ``E``.

    ``Experts(Row())``: ``(E, a, b)`` -> ``(E, a, b)``; ``Experts(Col())``:
    ``(E, in, out)`` -> ``(E, out, in)``; ``Experts(GateUp("interleave", axis=1))``:
    ``(E, d, 2*f)`` -> ``(E, 2, f, d)``. All experts are handled in one batched view.
    """

    inner: Layout = Row()

    def __post_init__(self):
        object.__setattr__(self, "inner", parse_layout(self.inner))

    def __repr__(self) -> str:
        return f"Experts({self.inner!r})"

    @property
    def ndim(self) -> int:  # type: ignore[override]
        return self.inner.ndim + 1

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    @property
    def spec(self) -> str:
        return "experts:" + _sub_spec(self.inner)

    def _problem(self, shape):
        return self.inner._problem(shape)

    def _to_work(self, t):
        return self.inner._to_work(t)

    def _from_work(self, work):
        return self.inner._from_work(work)

    def _work_shapes(self, shape):
        return self.inner._work_shapes(shape)

    def _stored_shape(self, shapes):
        return self.inner._stored_shape(shapes)


@dataclass(frozen=True, repr=False)
class Flatten(Layout):
    """A tensor with trailing axes ``tail`` folded into the columns: stored ``(m, c, *tail)``
    -> work ``(m, c * prod(tail))`` (a view of a contiguous tensor); rows are the stored
    first axis.

    This is a convolution weight ``(out, in/groups, *kernel)`` as the matrix the layer
    applies to each flattened input patch: ``Flatten((3, 3))`` turns a ``Conv2d(64, 128,
    3)`` weight ``(128, 64, 3, 3)`` into ``(128, 576)``. A grouped convolution is block
    diagonal: ``groups=g`` gives one work matrix per group, ``(g, m/g, c * prod(tail))``
    with ``work[j]`` the rows ``j*m/g : (j+1)*m/g`` (the output channels of group ``j``);
    a depthwise ``Conv1d(d, d, 4, groups=d)`` weight ``(d, 1, 4)`` becomes ``d`` blocks of
    one row, ``(d, 1, 4)``.
    """

    tail: tuple[int, ...]
    groups: int = 1

    def __post_init__(self):
        tail = (self.tail,) if isinstance(self.tail, int) else tuple(self.tail)
        if not tail:
            raise ValueError("Flatten needs at least one trailing axis to fold")
        object.__setattr__(self, "tail", tuple(_positive_int(k, "Flatten axis size") for k in tail))
        object.__setattr__(self, "groups", _positive_int(self.groups, "Flatten groups"))

    def __repr__(self) -> str:
        return f"Flatten({self.tail!r}" + (f", groups={self.groups})" if self.groups > 1 else ")")

    @property
    def ndim(self) -> int:  # type: ignore[override]
        return 2 + len(self.tail)

    @property
    def spec(self) -> str:
        return "flatten:" + "x".join(map(str, self.tail)) + (f":groups={self.groups}" if self.groups > 1 else "")

    @property
    def _fold(self) -> int:
        return math.prod(self.tail)

    def _problem(self, shape):
        k = len(self.tail)
        if shape[-k:] != self.tail:
            return f"trailing axes {shape[-k:]} are not {self.tail}"
        rows = shape[-k - 2]
        if rows % self.groups:
            return f"row count {rows} is not divisible by groups {self.groups}"
        return None

    def _to_work(self, t):
        w = t.flatten(-len(self.tail) - 1)
        return [w.unflatten(-2, (self.groups, w.shape[-2] // self.groups)) if self.groups > 1 else w]

    def _from_work(self, work):
        w = work[0]
        if self.groups > 1:
            w = w.flatten(-3, -2)
        return w.unflatten(-1, (w.shape[-1] // self._fold, *self.tail))

    def _work_shapes(self, shape):
        k = len(self.tail)
        lead, rows, cols = shape[: -k - 2], shape[-k - 2], shape[-k - 1] * self._fold
        if self.groups > 1:
            return [lead + (self.groups, rows // self.groups, cols)]
        return [lead + (rows, cols)]

    def _stored_shape(self, shapes):
        s = shapes[0]
        if self.groups > 1:
            if s[-3] != self.groups:
                raise ValueError("not one block per group")
            lead, rows, cols = s[:-3], s[-3] * s[-2], s[-1]
        else:
            lead, rows, cols = s[:-2], s[-2], s[-1]
        if cols % self._fold:
            raise ValueError("columns do not fold")
        return lead + (rows, cols // self._fold) + self.tail


@dataclass(frozen=True, repr=False)
class Unflatten(Layout):
    """A flat ``(rows * cols,)`` tensor read as the ``(rows, cols)`` matrix it stores (a view):
    e.g. a router kept 1-D as ``(experts * d,)`` that the model applies as ``weight.view(experts,
    d)``; work rows are its ``rows`` (the experts)."""

    rows: int

    def __post_init__(self):
        object.__setattr__(self, "rows", _positive_int(self.rows, "Unflatten rows"))

    ndim = 1

    def __repr__(self) -> str:
        return f"Unflatten({self.rows})"

    @property
    def spec(self) -> str:
        return f"unflatten:{self.rows}"

    def _problem(self, shape):
        if shape[-1] % self.rows:
            return f"length {shape[-1]} is not divisible by {self.rows} rows"
        return None

    def _to_work(self, t):
        return [t.unflatten(-1, (self.rows, t.shape[-1] // self.rows))]

    def _from_work(self, work):
        return work[0].flatten(-2, -1)

    def _work_shapes(self, shape):
        return [shape[:-1] + (self.rows, shape[-1] // self.rows)]

    def _stored_shape(self, shapes):
        s = shapes[0]
        return s[:-2] + (s[-2] * s[-1],)


@dataclass(frozen=True, repr=False)
class Fused(Layout):
    """Blocks of possibly unequal sizes concatenated along ``axis``, each with its own layout.

    ``axis=0``: stored ``(sum(sizes), n)``; block ``i`` is the ``(sizes[i], n)`` row
    slice. ``axis=1``: stored ``(m, sum(sizes))``; block ``i`` is the ``(m, sizes[i])``
    column slice. ``parts`` gives one 2-D layout per block, or a single layout for all
    (default ``Row()``). The work is the concatenation of every block's work list,
    e.g. fused qkv ``Fused((q, kv, kv), Heads(hd))`` -> ``[(Hq, hd, d), (Hkv, hd, d),
    (Hkv, hd, d)]``.
    """

    sizes: tuple[int, ...]
    parts: tuple[Layout, ...] = None  # type: ignore[assignment]
    axis: int = 0

    def __post_init__(self):
        sizes = (self.sizes,) if isinstance(self.sizes, int) else tuple(self.sizes)
        if not sizes:
            raise ValueError("Fused needs at least one block size")
        sizes = tuple(_positive_int(s, "Fused block size") for s in sizes)
        parts = self.parts
        if parts is None:
            parts = Row()
        if isinstance(parts, (Layout, str)):
            parts = (parts,) * len(sizes)
        parts = tuple(parse_layout(p) for p in parts)
        if len(parts) != len(sizes):
            raise ValueError(f"Fused got {len(sizes)} sizes but {len(parts)} parts")
        for p in parts:
            if p.ndim != 2:
                raise ValueError(f"Fused parts must be 2-D layouts, got {p!r}; wrap Experts around Fused instead")
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "parts", parts)
        object.__setattr__(self, "axis", _axis(self.axis))

    def __repr__(self) -> str:
        args = [repr(self.sizes)]
        if any(p != Row() for p in self.parts):
            same = all(p == self.parts[0] for p in self.parts)
            args.append(f"parts={self.parts[0]!r}" if same else f"parts={self.parts!r}")
        if self.axis:
            args.append("axis=1")
        return f"Fused({', '.join(args)})"

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.parts)

    @property
    def spec(self) -> str:
        s = ("fused_cols:" if self.axis else "fused:") + ",".join(map(str, self.sizes))
        if all(p == Row() for p in self.parts):
            return s
        if all(p == self.parts[0] for p in self.parts):
            return s + ":" + _sub_spec(self.parts[0])
        return s + ":" + "/".join(_sub_spec(p) for p in self.parts)

    @property
    def _dim(self) -> int:
        return -2 + self.axis

    def _block_shape(self, shape: Shape, size: int) -> Shape:
        return shape[:-2] + ((size, shape[-1]) if self.axis == 0 else (shape[-2], size))

    def _problem(self, shape):
        total = shape[self._dim]
        if total != sum(self.sizes):
            where = "column" if self.axis else "row"
            return f"block sizes {self.sizes} sum to {sum(self.sizes)}, but the {where} count is {total}"
        offset = 0
        for i, (size, part) in enumerate(zip(self.sizes, self.parts)):
            reason = part._problem(self._block_shape(shape, size))
            if reason is not None:
                return f"block {i} ({offset}:{offset + size}, {part!r}): {reason}"
            offset += size
        return None

    def _groups(self, items: list) -> list[list]:
        out, start = [], 0
        for p in self.parts:
            out.append(items[start : start + p.num_blocks])
            start += p.num_blocks
        return out

    def _to_work(self, t):
        blocks = torch.split(t, self.sizes, dim=self._dim)
        return [w for p, b in zip(self.parts, blocks) for w in p._to_work(b)]

    def _from_work(self, work):
        blocks = [p._from_work(g) for p, g in zip(self.parts, self._groups(work))]
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=self._dim)

    def _work_shapes(self, shape):
        return [s for p, n in zip(self.parts, self.sizes) for s in p._work_shapes(self._block_shape(shape, n))]

    def _stored_shape(self, shapes):
        blocks = [p._stored_shape(g) for p, g in zip(self.parts, self._groups(shapes))]
        b = blocks[0]
        total = sum(s[self._dim] for s in blocks)
        return b[:-2] + ((total, b[-1]) if self.axis == 0 else (b[-2], total))


@dataclass(frozen=True, repr=False)
class Compose(Layout):
    """Apply ``inner`` to every work matrix of ``outer``: stored -> outer work -> inner work.

    ``inner`` reads the trailing dims of each outer work tensor and keeps the rest,
    e.g. ``Compose(Col(), Heads(hd))``: stored ``(n, H*hd)`` -> ``(H*hd, n)`` ->
    ``(H, hd, n)``, and ``Compose(GateUp(), Heads(hd))``: ``(2*f, d)`` ->
    ``(2, f/hd, hd, d)``. (``Experts`` and ``Fused(parts=...)`` cover the usual
    nestings; ``Compose`` is the general chaining.)
    """

    outer: Layout
    inner: Layout

    def __post_init__(self):
        object.__setattr__(self, "outer", parse_layout(self.outer))
        object.__setattr__(self, "inner", parse_layout(self.inner))

    def __repr__(self) -> str:
        return f"Compose({self.outer!r}, {self.inner!r})"

    @property
    def ndim(self) -> int:  # type: ignore[override]
        return self.outer.ndim

    @property
    def num_blocks(self) -> int:
        return self.outer.num_blocks * self.inner.num_blocks

    @property
    def spec(self) -> str:
        inner = self.inner.spec
        if _split_top(inner, ">")[1:]:
            inner = f"({inner})"
        return f"{self.outer.spec}>{inner}"

    def _problem(self, shape):
        reason = self.outer._problem(shape)
        if reason is not None:
            return reason
        for i, ws in enumerate(self.outer._work_shapes(shape)):
            if len(ws) < self.inner.ndim:
                return f"outer work {i} {ws} has fewer than {self.inner.ndim} dims for {self.inner!r}"
            reason = self.inner._problem(ws)
            if reason is not None:
                return f"outer work {i} {ws} under {self.inner!r}: {reason}"
        return None

    def _chunks(self, items: list) -> list[list]:
        k = self.inner.num_blocks
        return [items[i : i + k] for i in range(0, len(items), k)]

    def _to_work(self, t):
        return [w for o in self.outer._to_work(t) for w in self.inner._to_work(o)]

    def _from_work(self, work):
        return self.outer._from_work([self.inner._from_work(c) for c in self._chunks(work)])

    def _work_shapes(self, shape):
        return [s for o in self.outer._work_shapes(shape) for s in self.inner._work_shapes(o)]

    def _stored_shape(self, shapes):
        return self.outer._stored_shape([self.inner._stored_shape(c) for c in self._chunks(shapes)])


# -- parsing -------------------------------------------------------------------------

SPEC_FORMS = """\
  row                           stored (m, n) as is
  col                           transpose
  heads:HD                      q/k/v rows per head      (H*HD, n) -> (H, HD, n)
  heads_cols:HD                 o-proj columns per head  (m, H*HD) -> (H, HD, m)
  gate_up[:concat|:interleave][:rows|:cols][:split|:paired]
                                fused gate/up, e.g. gate_up:interleave:cols
  experts[:SPEC]                leading expert axis, e.g. experts:col (default experts:row)
  unflatten:R                   a flat (R*C,) tensor as its (R, C) matrix (a 1-D router)
  flatten:K1xK2..[:groups=G]    trailing axes folded into the columns (a convolution weight):
                                (m, c, K1, K2) -> (m, c*K1*K2); with groups: (G, m/G, c*K1*K2)
  fused:S1,S2,..[:SPEC|:SPEC1/SPEC2/..]
                                blocks concatenated along rows (fused_cols: along columns)
  SPEC>SPEC                     compose: the right layout on each work of the left one
  (SPEC)                        grouping"""


def _split_top(s: str, sep: str) -> list[str]:
    """Split ``s`` on ``sep`` outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _strip_parens(s: str) -> str:
    while s.startswith("(") and s.endswith(")"):
        depth = 0
        for i, c in enumerate(s):
            depth += c == "("
            depth -= c == ")"
            if depth == 0 and i < len(s) - 1:
                return s  # "(a)>(b)": the first group closes early
        s = s[1:-1]
    return s


def _parse(s: str) -> Layout:
    s = _strip_parens(s)
    chain = _split_top(s, ">")
    if len(chain) > 1:
        layout = _parse(chain[0])
        for item in chain[1:]:
            layout = Compose(layout, _parse(item))
        return layout
    head, _, rest = s.partition(":")
    if head in ("row", "col") and not rest:
        return Row() if head == "row" else Col()
    if head in ("heads", "heads_cols"):
        hd, _, axis = rest.partition(":")
        if head == "heads_cols" and axis:
            raise ValueError("heads_cols takes only a head dim")
        return Heads(int(hd), "cols" if head == "heads_cols" else (axis or "rows"))
    if head == "gate_up":
        kwargs: dict = {}
        options = {
            "concat": ("mode", "concat"),
            "interleave": ("mode", "interleave"),
            "rows": ("axis", 0),
            "cols": ("axis", 1),
            "split": ("split", True),
            "paired": ("split", False),
        }
        for token in rest.split(":") if rest else []:
            key, value = options[token]
            if key in kwargs:
                raise ValueError(f"gate_up option {key} given twice")
            kwargs[key] = value
        return GateUp(**kwargs)
    if head == "experts":
        return Experts(_parse(rest) if rest else Row())
    if head == "unflatten":
        return Unflatten(int(rest))
    if head == "flatten":
        tail, _, option = rest.partition(":")
        groups = 1
        if option:
            key, eq, value = option.partition("=")
            if key != "groups" or not eq:
                raise ValueError(f"flatten takes only groups=G, got {option!r}")
            groups = int(value)
        return Flatten(tuple(int(k) for k in tail.split("x")), groups)
    if head in ("fused", "fused_cols"):
        sizes, _, parts = rest.partition(":")
        size_list = tuple(int(x) for x in sizes.split(","))
        part_list = [_parse(p) for p in _split_top(parts, "/")] if parts else None
        if part_list is not None and len(part_list) == 1:
            part_list = part_list[0]
        return Fused(size_list, part_list, axis=1 if head == "fused_cols" else 0)
    raise ValueError(f"unknown layout {head!r}")


def parse_layout(spec: str | Layout) -> Layout:
    """Build a layout from a short string (see ``SPEC_FORMS``); layouts pass through.

    Examples: ``"row"``, ``"col"``, ``"heads:128"``, ``"heads_cols:128"``,
    ``"gate_up:interleave:cols"``, ``"experts:col"``, ``"fused:1024,512,512:heads:128"``,
    ``"fused:1024,128:heads:128/row"``, ``"col>heads:64"``.
    """
    if isinstance(spec, Layout):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"layout spec must be a str or Layout, got {type(spec).__name__}")
    text = "".join(spec.split()).lower()
    try:
        if text.count("(") != text.count(")"):
            raise ValueError("unbalanced parentheses")
        return _parse(text)
    except (ValueError, KeyError) as err:
        raise ValueError(f"invalid layout spec {spec!r} ({err}); valid forms:\n{SPEC_FORMS}") from None


# -- batching same-shaped work across parameters ---------------------------------------


@dataclass(frozen=True)
class Unstack:
    """Recipe returned by :func:`stack_by_shape`; call it on the per-group results.

    ``keys[g]`` is ``(rows, cols, dtype, device)`` of group ``g``; ``members[g]`` lists
    ``(index, batch, leading_shape)`` for each work tensor in the group, in order.
    """

    keys: tuple[tuple, ...]
    members: tuple[tuple[tuple[int, int, Shape], ...], ...]
    count: int

    def __call__(self, results: Sequence[Tensor]) -> list[Tensor]:
        """Split per-group results ``(B, r, c)`` back into a list ordered like the input.

        Output ``i`` has input ``i``'s leading dims and the result's trailing dims;
        pieces are views of the results where possible.
        """
        if len(results) != len(self.members):
            raise ValueError(f"expected {len(self.members)} group results, got {len(results)}")
        out: list = [None] * self.count
        for g, (res, members) in enumerate(zip(results, self.members)):
            batches = [b for _, b, _ in members]
            if res.ndim != 3 or res.shape[0] != sum(batches):
                raise ValueError(
                    f"group {g} result has shape {tuple(res.shape)}, expected ({sum(batches)}, rows, cols)"
                )
            pieces = [res] if len(members) == 1 else torch.split(res, batches)
            for (i, _, lead), piece in zip(members, pieces):
                out[i] = piece.reshape(lead + tuple(piece.shape[-2:]))
        return out


def stack_by_shape(works: Sequence[Tensor]) -> tuple[list[Tensor], Unstack]:
    """Batch work matrices of equal ``(rows, cols)``, dtype and device into one tensor each.

    Each work tensor ``(..., rows, cols)`` has its leading dims flattened into one batch
    axis, and same-keyed tensors are concatenated (one ``torch.cat`` per group, none for
    a group of one) into ``(B, rows, cols)``, groups ordered by first appearance.
    Returns ``(groups, restore)``: ``restore(results)`` splits per-group results of
    the same batch size back into the original order and leading shapes, exactly.
    Groups may share memory with the inputs; treat them as read-only.
    """
    index: dict[tuple, int] = {}
    members: list[list[tuple[int, int, Shape]]] = []
    flats: list[list[Tensor]] = []
    for i, w in enumerate(works):
        if w.ndim < 2:
            raise ValueError(f"work tensor {i} has shape {tuple(w.shape)}; expected (..., rows, cols)")
        lead, (rows, cols) = tuple(w.shape[:-2]), tuple(w.shape[-2:])
        key = (rows, cols, w.dtype, w.device)
        g = index.setdefault(key, len(index))
        if g == len(members):
            members.append([])
            flats.append([])
        batch = math.prod(lead)
        members[g].append((i, batch, lead))
        flats[g].append(w.reshape(batch, rows, cols))
    groups = [f[0] if len(f) == 1 else torch.cat(f) for f in flats]
    restore = Unstack(tuple(index), tuple(tuple(m) for m in members), len(works))
    return groups, restore
